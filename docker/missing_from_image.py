"""Print the entries of a hashed lock file (pip-compile --generate-hashes) whose packages an image lacks.

    python missing_from_image.py LOCK FREEZE > missing.lock

FREEZE is the image's `pip list --format=freeze`. Each entry is printed as the lock has it (its pin and every
--hash), so `pip install --require-hashes --no-deps -r missing.lock` adds only what the image lacks, each file
checked, and every package the image has keeps its version (vLLM, torch and Ray are built for its CUDA). The
lock's options (--index-url, ...) are dropped. Runs in the image at build time: the standard library only.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): case and runs of -, _ and . do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def entries(lock_text: str) -> list[tuple[str, str]]:
    """(canonical name, the entry's text) per requirement: its line and the indented lines (hashes, comments)
    under it. Comment and option lines at the left margin belong to no entry."""
    found: list[tuple[str, str]] = []
    for line in lock_text.splitlines(keepends=True):
        if line[:1].isspace() and found:
            found[-1] = (found[-1][0], found[-1][1] + line)
        elif line.strip() and not line.startswith(("#", "-")):
            found.append((canonical(re.split(r"[\s=<>!~;\[]", line, maxsplit=1)[0]), line))
    return found


def installed(freeze_text: str) -> set[str]:
    """The canonical names of a `pip list --format=freeze`."""
    return {canonical(re.split(r"[\s=@]", line, maxsplit=1)[0]) for line in freeze_text.splitlines() if line.strip()}


def missing(lock_text: str, freeze_text: str) -> str:
    """The lock's entries for packages ``freeze_text`` does not name, in the lock's order."""
    have = installed(freeze_text)
    return "".join(text for name, text in entries(lock_text) if name not in have)


if __name__ == "__main__":
    lock, freeze = (Path(argument).read_text() for argument in sys.argv[1:3])
    sys.stdout.write(missing(lock, freeze))
