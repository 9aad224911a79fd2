#!/bin/bash
# bench/proxy_reference.py on the GPU machine's 16 cores: synthetic engines, no GPU. That machine has no
# network: carry pdserve's gateway wheels as .stage/gw (docs/benchmarks.md, section 1) and Debian's nginx
# binary with the libraries it links as .stage/nginx. Each argument is one run's flags; run N's output
# goes to $OUT/reference-N.txt, the machine's description and load to $OUT/machine.txt.
# usage: bash bench/gpu/proxy_reference_16_cores.sh "--streams 1024,2048 --workers 8 --upstreams 4 --load-processes 8"
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. LD_LIBRARY_PATH="$PWD/.stage/nginx"
python3 -m venv --system-site-packages /tmp/gw && /tmp/gw/bin/pip install -q --no-index --no-deps .stage/gw/*.whl \
    || exit 1
ulimit -n 65536 || ulimit -n "$(ulimit -Hn)"
{ date -u +%FT%TZ; nproc; lscpu | grep -E "^Model name|^CPU\(s\)|^Thread"; uptime; /tmp/gw/bin/python --version;
  .stage/nginx/nginx -v; } 2>&1 | tee "$OUT/machine.txt"
run=0
for flags in "$@"; do
    run=$((run + 1))
    # shellcheck disable=SC2086  # one string of flags per run, split on purpose
    /tmp/gw/bin/python bench/proxy_reference.py $flags --nginx .stage/nginx/nginx --logs "/tmp/reference-logs-$run" \
        2>&1 | tee "$OUT/reference-$run.txt" || { tail -n 20 "/tmp/reference-logs-$run"/*.log; exit 1; }
    echo "after run $run: $(uptime)" | tee -a "$OUT/machine.txt"
done
