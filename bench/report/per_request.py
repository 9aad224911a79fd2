"""Renderer of bench/proxy_reference.py runs at two reply lengths: each path's CPU split into per chunk and per request.

Arguments: the run with short replies and the run with long ones (files under docs/results/), then ``@SHORT-LONG``,
their tokens per reply. A path's CPU per request is a + b x tokens: b is its CPU per chunk, a its CPU per request.
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.report.overhead import links
from bench.report.raw import read_text
from bench.report.tables import Renderer, fixed, table

_PATH_CPU = re.compile(r"^\s+(nginx|pdserve-1leg|pdserve-pd)\s+gateway adds .*\n\s+gateway CPU [\d.]+ us per relayed "
                       r"chunk, (\d+) us per request", re.MULTILINE)
_LABELS = {"nginx": "nginx", "pdserve-1leg": "pdserve, one leg", "pdserve-pd": "pdserve, PD"}


def _per_request_us(results_dir: Path, name: str) -> dict[str, float]:
    found = {path: float(us) for path, us in _PATH_CPU.findall(read_text(results_dir / name))}
    assert found.keys() == _LABELS.keys(), f"{name}: not one point per path"
    return found


def proxy_split(results_dir: Path, args: tuple[str, ...]) -> str:
    """One row per path: µs of CPU per chunk and ms per request, from the two runs' CPU per request."""
    short_name, long_name, lengths = args
    short_tokens, long_tokens = (int(tokens) for tokens in lengths.lstrip("@").split("-"))
    short, long = _per_request_us(results_dir, short_name), _per_request_us(results_dir, long_name)
    rows = []
    for path, label in _LABELS.items():
        per_chunk = (long[path] - short[path]) / (long_tokens - short_tokens)
        per_request_ms = (short[path] - per_chunk * short_tokens) / 1000
        rows.append([label, fixed(per_chunk), f"{per_request_ms:.2f}"])
    return (table(["path", "µs CPU per chunk", "ms CPU per request"], rows)
            + f"\n\nFrom the CPU per request at {short_tokens} and {long_tokens} tokens a reply: {links(args[:2])}")


RENDERERS: dict[str, Renderer] = {"proxy_split": proxy_split}
