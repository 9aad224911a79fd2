"""The source files of vLLM releases that pdserve_vllm/contract.py names, fetched once into a cache: each release's
GPU wheel is downloaded with pip (no dependencies), the files are extracted and the wheel deleted. Nothing of vLLM
is imported or kept beyond those files (~2 MB a release); ``python -m tests.engines.vllm_sources 0.34.0`` fetches
one and prints its contract problems.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pdserve_vllm.contract import CONTRACT
from pdserve_vllm.contract_check import problems

MANIFEST = "files.txt"  # the wheel members a cached release was extracted for
DOWNLOAD_TIMEOUT_S = 600
# The wheel of the x86-64 Linux build, whatever machine runs this: one source per release.
PLATFORM_ARGS = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--only-binary=:all:")


def cache_dir() -> Path:
    """Where fetched releases are kept: $XDG_CACHE_HOME/pdserve/vllm-sources, else ~/.cache/pdserve/vllm-sources."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve" / "vllm-sources"


def wanted_members() -> list[str]:
    """Every wheel member a contract module may be: ``vllm/a/b.py`` or ``vllm/a/b/__init__.py``."""
    modules = {entry.module for entry in CONTRACT}
    return sorted({f"{module.replace('.', '/')}{suffix}" for module in modules for suffix in (".py", "/__init__.py")})


def release_source(version: str, *, cache: Path | None = None) -> Path:
    """The folder holding ``vllm/...`` of release ``version`` (the files contract.py names), fetched if the cache
    lacks any of them. Raises subprocess.CalledProcessError if pip cannot download the wheel."""
    folder = (cache or cache_dir()) / version
    wanted = wanted_members()
    manifest = folder / MANIFEST
    if manifest.is_file() and set(wanted) <= set(manifest.read_text().split()):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        wheel = _download(version, Path(scratch))
        staged = Path(scratch) / "staged"
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(staged, members=sorted(set(archive.namelist()) & set(wanted)))
        (staged / MANIFEST).write_text("\n".join(wanted) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        staged.rename(folder)
    return folder


def _download(version: str, into: Path) -> Path:
    """vLLM ``version``'s wheel in ``into``, by pip, with no dependencies and without filling pip's cache."""
    subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--no-cache-dir",
                    "--quiet", "--dest", str(into), *PLATFORM_ARGS], check=True, timeout=DOWNLOAD_TIMEOUT_S)
    return next(into.glob("vllm-*.whl"))


if __name__ == "__main__":
    for release in sys.argv[1:]:
        found = problems(CONTRACT, source_root=release_source(release), version=release)
        print(f"vLLM {release}: {len(found)} problem(s)", *found, sep="\n  ")
