"""The Dockerfile cannot be built here: check what it builds on, installs and runs instead."""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pdserve.cluster_config import KubernetesSpec

REPO = Path(__file__).parents[2]
DOCKERFILE = REPO / "Dockerfile"
RAY_LLM_IMAGE = re.compile(r"rayproject/ray-llm:(?P<ray_version>\d+\.\d+\.\d+)-py3\d+-cu\d+@(?P<digest>.*)")
LOCK = REPO / "docker" / "requirements.lock"
MISSING_FROM_IMAGE = REPO / "docker" / "missing_from_image.py"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = DOCKERFILE.read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(word.upper(), rest.strip()) for word, _, rest in
            (line.strip().partition(" ") for line in joined.splitlines() if line.strip())]


def arguments(name: str) -> list[str]:
    return [rest for word, rest in instructions() if word == name]


def arg_defaults() -> dict[str, str]:
    """The default of every ``ARG NAME=value`` (a bare ``ARG NAME`` only brings one into scope)."""
    return dict(rest.partition("=")[::2] for rest in arguments("ARG") if "=" in rest)


def resolve(text: str) -> str:
    """``text`` with each ``${NAME}`` (or ``${NAME:?message}``) replaced by that ARG's default, as a build without
    --build-arg does."""
    return re.sub(r"\$\{(\w+)(?::\?[^}]*)?\}", lambda match: arg_defaults()[match[1]], text)


def steps(run: str) -> list[tuple[str, str]]:
    """A RUN's shell commands, each with the separator (``&&``, ``||``, ``;`` or ``""``) before it."""
    parts = re.split(r"\s*(&&|\|\||;)\s*", run)
    return list(zip(["", *parts[1::2]], parts[::2], strict=True))


def efa_step() -> str:
    (run,) = [run for run in arguments("RUN") if "efa_installer.sh" in run]
    return run


def first_step(run: str, *words: str) -> int:
    """The index in ``steps(run)`` of the first command containing every one of ``words``."""
    found = [index for index, (_, command) in enumerate(steps(run)) if all(word in command for word in words)]
    assert found, f"no command of the RUN contains {words}"
    return found[0]


def pip_installs() -> list[str]:
    return [command for run in arguments("RUN") for command in re.split(r"&&|\|\|", run) if "pip install" in command]


def test_base_image_is_the_ray_llm_image_of_the_default_ray_version() -> None:
    (base,) = arguments("FROM")
    match = RAY_LLM_IMAGE.fullmatch(resolve(base))
    assert match, f"not a Ray LLM image: {base}"
    assert match["ray_version"] == KubernetesSpec().ray_version, "render k8s would announce another Ray version"


def test_the_base_image_is_taken_by_digest_and_the_build_refuses_it_unpinned() -> None:
    """BuildKit expands ``${BASE_DIGEST:?message}`` to an error while the ARG is empty (moby/buildkit
    frontend/dockerfile/shell/lex.go, processDollar), so FROM never pulls by tag alone."""
    (base,) = arguments("FROM")
    message = re.fullmatch(r"\S+@\$\{BASE_DIGEST:\?(?P<message>[^}\s]+)\}", base)
    assert message, f"FROM must take the image by ${{BASE_DIGEST:?...}}: {base}"
    assert "docker/pin-base.sh" in message["message"], "the refusal names the command that pins it"
    digest = arg_defaults()["BASE_DIGEST"]
    assert digest == "" or re.fullmatch(r"sha256:[0-9a-f]{64}", digest), digest
    order = [(word, rest) for word, rest in instructions() if word in {"ARG", "FROM"}]
    assert order.index(("ARG", "BASE_DIGEST=" + digest)) < order.index(("FROM", base)), "an ARG FROM can see"
    pin = (REPO / "docker" / "pin-base.sh").read_text()
    assert "s/^ARG BASE_DIGEST=.*/ARG BASE_DIGEST=$digest/" in pin and "imagetools inspect" in pin


def test_pdserve_is_installed_from_the_copied_project() -> None:
    copied = " ".join(arguments("COPY"))
    assert "pyproject.toml" in copied
    for package in sorted(path.parent.name for path in REPO.glob("pdserve*/__init__.py")):  # every one pip installs
        assert f"{package} /home/ray/pdserve/{package}" in copied, package
        assert f"!{package}/" in (REPO / ".dockerignore").read_text().splitlines(), package
    assert any(command.strip().endswith("/home/ray/pdserve") for command in pip_installs())


def install_options(command: str) -> set[str]:
    return {token for token in command.split() if token.startswith("-")}


def test_every_package_pip_adds_is_locked_and_hash_checked() -> None:
    """vLLM, torch and Ray come with the image, built for its CUDA, and keep their versions: pip adds only the lock's
    entries the image lacks, each file checked against its sha256, then pdserve with no index to fetch from."""
    (run,) = [" ".join(run.split()) for run in arguments("RUN") if "missing_from_image.py" in run]
    assert "pip list --format=freeze > /tmp/image-packages.txt" in run
    assert ("docker/missing_from_image.py /home/ray/pdserve/docker/requirements.lock /tmp/image-packages.txt "
            "> /tmp/missing.lock") in run
    installs = pip_installs()
    assert len(installs) == 2 and all(" ".join(install.split()) in run for install in installs)
    locked, project = installs
    assert {"--require-hashes", "--no-deps", "-r"} <= install_options(locked) and locked.split()[-1] == "/tmp/missing.lock"
    assert {"--no-index", "--no-build-isolation"} <= install_options(project)
    assert project.strip().endswith("/home/ray/pdserve")
    steps_ = [command for _, command in steps(run)]
    assert steps_.index(next(step for step in steps_ if "missing_from_image.py" in step)) < steps_.index(
        " ".join(locked.split()))


def lock_entries() -> list[tuple[str, str]]:
    entries: list[tuple[str, str]] = runpy.run_path(str(MISSING_FROM_IMAGE))["entries"](LOCK.read_text())
    return entries


def test_the_lock_pins_every_package_with_the_hash_of_each_file() -> None:
    entries = lock_entries()
    for name, text in entries:
        assert re.fullmatch(r"[\w.-]+==[\w.+!-]+", text.split()[0]), f"not pinned: {text.split()[0]}"
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", text), f"{name} has no hash: pip --require-hashes refuses it"
    names = {name for name, _ in entries}
    canonical = runpy.run_path(str(MISSING_FROM_IMAGE))["canonical"]
    wanted = {canonical(re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0])
              for requirement in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert wanted | {"nixl", "nixl-cu13", "setuptools", "wheel"} <= names, "docker/lock.sh: the lock misses a requirement"
    (nixl,) = [text for name, text in entries if name == "nixl-cu13"]
    assert nixl.startswith("nixl-cu13==1.5.1 "), "NIXL pinned, as docker/requirements.in asks"


def test_nixl_comes_with_the_package_that_import_nixl_finds() -> None:
    """nixl-cu13 alone installs nixl_cu13 and no ``nixl`` module: the ``nixl`` package (nixl/__init__.py, which loads
    nixl_cu13) comes with its cu13 extra, at the same version, and the build imports it."""
    assert "nixl[cu13]==1.5.1" in (REPO / "docker" / "requirements.in").read_text().split()
    versions = {name: text.split()[0] for name, text in lock_entries() if name in ("nixl", "nixl-cu13")}
    assert versions == {"nixl": "nixl==1.5.1", "nixl-cu13": "nixl-cu13==1.5.1"}
    (run,) = [" ".join(run.split()) for run in arguments("RUN") if "missing_from_image.py" in run]
    commands = [command for _, command in steps(run)]
    assert commands.index('python -c "import nixl, vllm, pdserve"') > commands.index(
        "pip install --no-cache-dir --no-index --no-build-isolation /home/ray/pdserve")


def test_the_build_fails_unless_libfabric_lists_its_efa_provider() -> None:
    (run,) = [" ".join(run.split()) for run in arguments("RUN") if "check-shared-libs.sh" in run]
    assert steps(run)[-1] == ("&&", "/opt/amazon/efa/bin/fi_info -l | grep -q '^efa:'")


def fake_docker(tmp_path: Path, *, has_daemon: bool) -> tuple[Path, Path]:
    """A docker that records each call's arguments (NUL-separated) in a file of its own, numbered in order, and
    whose ``info`` answers or not."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "docker-calls"
    bin_dir.mkdir()
    calls.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > "{calls}/$(ls {calls} | wc -l)"\n'
                      f'[ "$1" != info ] || exit {0 if has_daemon else 1}\n')
    docker.chmod(0o755)
    return bin_dir, calls


def docker_calls(calls: Path) -> list[list[str]]:
    return [path.read_text().rstrip("\0").split("\0") for path in sorted(calls.iterdir(), key=lambda path: int(path.name))]


def build_script_copy(tmp_path: Path, *, digest: str) -> Path:
    """docker/build-image.sh beside a copy of the Dockerfile whose BASE_DIGEST is ``digest``."""
    (tmp_path / "docker").mkdir()
    script = tmp_path / "docker" / "build-image.sh"
    shutil.copy(REPO / "docker" / "build-image.sh", script)
    (tmp_path / "Dockerfile").write_text(DOCKERFILE.read_text().replace("ARG BASE_DIGEST=\n", f"ARG BASE_DIGEST={digest}\n"))
    return script


def test_make_image_builds_the_image_and_runs_its_checks_inside_it(tmp_path: Path) -> None:
    """No Docker daemon here: a recording docker shows what the script asks of a real one."""
    assert re.search(r"^image:\n\tdocker/build-image\.sh \$\(TAG\)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    script = build_script_copy(tmp_path, digest="sha256:" + "0" * 64)
    bin_dir, recorded = fake_docker(tmp_path, has_daemon=True)
    subprocess.run(["sh", str(script), "pdserve:test"], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, check=True,
                   capture_output=True, timeout=30)
    calls = docker_calls(recorded)
    assert [call[:2] for call in calls] == [["info"], ["build", "--tag"], ["run", "--rm"]]
    assert calls[1][2:] == ["pdserve:test", "."]
    checks = calls[2][-1]
    for check in ('python -c "import nixl, vllm, pdserve', "libplugin_LIBFABRIC.so",
                  "check-shared-libs.sh --at-run-time libcuda.so.1", '/opt/amazon/efa/bin/fi_info -l | grep -q "^efa:"'):
        assert check in checks


@pytest.mark.parametrize(("digest", "has_daemon", "words"), [
    ("", True, "the base image is not pinned; run docker/pin-base.sh"),
    ("sha256:" + "0" * 64, False, "no Docker daemon answers"),
])
def test_the_build_script_stops_before_building_without_a_pinned_base_or_a_daemon(
    tmp_path: Path, digest: str, has_daemon: bool, words: str,
) -> None:
    script = build_script_copy(tmp_path, digest=digest)
    bin_dir, recorded = fake_docker(tmp_path, has_daemon=has_daemon)
    result = subprocess.run(["sh", str(script)], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 2 and words in result.stderr
    assert [call[0] for call in docker_calls(recorded)] in ([], ["info"])


def test_missing_from_image_keeps_the_lock_entries_the_image_lacks_with_their_hashes(tmp_path: Path) -> None:
    """Run as the build runs it; names compare as pip compares them (PEP 503)."""
    lock = tmp_path / "requirements.lock"
    lock.write_text("#\n# header\n#\n--index-url https://example.invalid/simple\n\n"
                    "pyyaml==6.0.4 \\\n    --hash=sha256:" + "a" * 64 + "\n    # via pdserve\n"
                    "typing-extensions==4.16.0 \\\n    --hash=sha256:" + "b" * 64 + "\n"
                    "uvloop==0.23.0 \\\n    --hash=sha256:" + "c" * 64 + " \\\n    --hash=sha256:" + "d" * 64 + "\n")
    freeze = tmp_path / "image-packages.txt"
    freeze.write_text("PyYAML==6.0.1\ntyping_extensions==4.12.2\nvllm==0.26.0\n")
    result = subprocess.run([sys.executable, str(MISSING_FROM_IMAGE), str(lock), str(freeze)], capture_output=True,
                            text=True, timeout=30, check=True)
    assert result.stdout == ("uvloop==0.23.0 \\\n    --hash=sha256:" + "c" * 64 + " \\\n    --hash=sha256:" + "d" * 64
                             + "\n")


def test_no_secret_is_baked_in() -> None:
    for word, rest in instructions():
        if word in {"ENV", "ARG"}:
            assert not re.search(r"TOKEN|SECRET|PASSWORD|KEY", rest, re.IGNORECASE), rest


def test_the_documented_build_tag_is_the_default_image() -> None:
    assert f"docker build -t {KubernetesSpec().image} ." in DOCKERFILE.read_text()


def test_build_context_keeps_only_what_the_install_needs() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") + 1:][:3] == ["!pyproject.toml", "!README.md", "!pdserve/"]
    # Every file the image copies is in the context (setup.py builds the C relay: without it, no error, a slower gateway).
    copied = {source.rstrip("/") for copy in arguments("COPY") for source in copy.split()[:-1]
              if not source.startswith("--")}
    assert copied == {path.removeprefix("!").rstrip("/") for path in ignored if path.startswith("!")}


def test_build_fails_unless_the_image_has_the_ray_version_render_announces() -> None:
    assert arg_defaults()["RAY_VERSION"] == KubernetesSpec().ray_version
    order = [word for word, rest in instructions() if word == "FROM" or (word, rest) == ("ARG", "RAY_VERSION")]
    assert order == ["FROM", "ARG"], "RUN sees RAY_VERSION only if it is declared again after FROM"
    assert "io.ray.version=${RAY_VERSION}" in arguments("LABEL")
    (check,) = [run for run in arguments("RUN") if "ray.__version__" in run]
    assert "import ray" in check and "'${RAY_VERSION}'" in check and "sys.exit" in check, check


def test_efa_installer_version_is_pinned() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", arg_defaults()["EFA_INSTALLER_VERSION"]), "a rebuild must get the same EFA"
    assert "latest" not in efa_step()


def test_efa_installer_apt_installs_after_apt_get_update_and_leaves_no_apt_lists() -> None:
    """The base image deletes its apt lists; efa_installer.sh apt-installs pciutils, libnl-3, …"""
    run = efa_step()
    update = first_step(run, "apt-get update")
    installer = first_step(run, "efa_installer.sh")
    cleanup = first_step(run, "rm -rf", "/var/lib/apt/lists/")
    assert update < installer < cleanup


def test_efa_tarball_is_verified_by_its_signature_before_it_is_unpacked() -> None:
    run = efa_step()
    verify = first_step(run, "gpg", "--verify", ".sig")
    unpack = first_step(run, "tar x")
    installer = first_step(run, "efa_installer.sh")
    assert verify < unpack < installer
    separators = [separator for separator, _ in steps(run)[verify + 1:installer + 1]]
    assert set(separators) == {"&&"}, "a failed verify must stop the build before the installer runs"
    assert not re.search(r"[^|]\|\s*tar\b", run), "piping the download into tar unpacks it unverified"


CHECK_SCRIPT = REPO / "docker" / "check-shared-libs.sh"


def plugin_step() -> str:
    (run,) = [run for run in arguments("RUN") if "check-shared-libs.sh" in run]
    return run


def test_the_build_fails_unless_nixls_libfabric_plugin_finds_every_library_it_needs() -> None:
    """NIXL's wheels leave libfabric and hwloc out (ai-dynamo/nixl contrib/build-wheel.sh); the plugin links both."""
    run = plugin_step()
    assert {separator for separator, _ in steps(run)[1:]} == {"&&"}, "a failed step must stop the build"
    update, install = first_step(run, "apt-get update"), first_step(run, "apt-get install", "libhwloc15")
    loader_path = first_step(run, "/opt/amazon/efa/lib", "/etc/ld.so.conf.d/")
    check = first_step(run, "check-shared-libs.sh")
    assert update < install < first_step(run, "rm -rf", "/var/lib/apt/lists/") < check
    assert loader_path < first_step(run, "ldconfig") < check
    command = steps(run)[check][1]
    # the copy NIXL loads, of the image's CUDA 13 wheel ("Loading plugins from: ..." in NIXL's debug log)
    assert "-path '*/.nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so'" in command
    assert re.findall(r"--at-run-time (\S+)", command) == ["libcuda.so.1"], "only the driver's, which the node mounts"
    # NIXL comes from the image or, where it lacks it, from the lock (docker/requirements.in: nixl-cu13)
    (nixl_installed,) = [index for index, (_, rest) in enumerate(instructions()) if "--require-hashes" in rest]
    (checked,) = [index for index, (_, rest) in enumerate(instructions()) if rest == run]
    assert nixl_installed < checked
    assert "docker/check-shared-libs.sh /home/ray/pdserve/docker/check-shared-libs.sh" in " ".join(arguments("COPY"))


@pytest.fixture(scope="module")
def linked_libraries(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """liba.so, which needs libb.so beside it (found through its $ORIGIN runpath), both built here with gcc."""
    directory = tmp_path_factory.mktemp("libs")
    (directory / "b.c").write_text("int b(void) { return 2; }\n")
    (directory / "a.c").write_text("int b(void);\nint a(void) { return b() + 1; }\n")
    compile_ = ["gcc", "-shared", "-fPIC", "-o"]
    subprocess.run([*compile_, "libb.so", "b.c"], cwd=directory, check=True)
    subprocess.run([*compile_, "liba.so", "a.c", "-L.", "-lb", "-Wl,-rpath,$ORIGIN"], cwd=directory, check=True)
    return directory


def check_libraries(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(CHECK_SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          check=False)


def test_the_check_passes_a_library_whose_dependencies_are_all_there(linked_libraries: Path) -> None:
    result = check_libraries("liba.so", cwd=linked_libraries)
    assert result.returncode == 0 and "liba.so: every shared library it needs is here" in result.stdout


def test_the_check_fails_naming_the_library_that_is_gone(linked_libraries: Path, tmp_path: Path) -> None:
    for name in ("liba.so", "libb.so"):
        shutil.copy(linked_libraries / name, tmp_path / name)
    (tmp_path / "libb.so").unlink()
    result = check_libraries("liba.so", cwd=tmp_path)
    assert result.returncode == 1
    assert "liba.so needs shared libraries this image lacks:\n  libb.so => not found" in result.stderr
    mounted = check_libraries("--at-run-time", "libb.so", "liba.so", cwd=tmp_path)
    assert mounted.returncode == 0 and "but libb.so, which the node mounts" in mounted.stdout


def test_the_check_fails_when_it_finds_nothing_to_check(tmp_path: Path) -> None:
    """The Dockerfile's find gives no file when a new wheel moves the plugin: that must not pass."""
    assert check_libraries("--at-run-time", "libcuda.so.1", cwd=tmp_path).returncode == 2
    assert check_libraries("gone.so", cwd=tmp_path).returncode == 1
