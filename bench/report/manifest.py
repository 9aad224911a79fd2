"""The manifest of a raw folder (docs/results/NAME/manifest.json): how, where and with what the figures were made.

Reads and compares manifests; a field nobody recorded is the string "unknown", never a guess.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

Unknown = Literal["unknown"]
NOT_SET = "not set"


class Machine(BaseModel, frozen=True):
    cpu_model: str
    cores: int | Unknown
    load_average_start: float | Unknown
    load_average_end: float | Unknown
    gpu: str  # "none" on a CPU machine
    driver: str


class Run(BaseModel, frozen=True):
    """One system's run: ``folder`` is relative to the manifest's own folder ("." for the folder itself)."""

    folder: str
    system: str
    command: str
    commit: str
    date_utc: str
    machine: Machine


class Manifest(BaseModel, frozen=True):
    what: str
    versions: dict[str, str]
    systems: dict[str, dict[str, str]]  # every engine and serving setting of each system compared
    runs: list[Run]


def manifest_path(results_dir: Path, folder: str) -> Path:
    """The manifest that describes ``folder``: its own, else the nearest one above it under ``results_dir``."""
    path = results_dir / folder
    while path != results_dir and not (path / "manifest.json").exists():
        path = path.parent
    if path == results_dir:
        raise FileNotFoundError(f"no manifest.json for {folder} under {results_dir}")
    return path / "manifest.json"


def load_manifest(results_dir: Path, folder: str) -> Manifest:
    return Manifest.model_validate(json.loads(manifest_path(results_dir, folder).read_text()))


def differing_settings(manifest: Manifest, systems: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Each setting whose value is not the same for every one of ``systems``, with those values in order."""
    keys = sorted({key for system in systems for key in manifest.systems[system]})
    rows = []
    for key in keys:
        values = [manifest.systems[system].get(key, NOT_SET) for system in systems]
        if len(set(values)) > 1:
            rows.append((key, values))
    return rows


def settings_note(manifest: Manifest, systems: Sequence[str], *, source: str) -> str:
    """A Markdown list of the settings in which ``systems`` differ, naming the manifest it came from."""
    lines = [f"Settings in which the systems differ ([`{source}`]({source.removeprefix('docs/')})):"]
    for key, values in differing_settings(manifest, systems):
        pairs = " · ".join(f"{system} `{value}`" for system, value in zip(systems, values, strict=True))
        lines.append(f"- {key}: {pairs}")
    if len(lines) == 1:
        lines.append("- none recorded")
    return "\n".join(lines)
