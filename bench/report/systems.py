"""Which system a raw folder holds, by its manifest, and the settings note for a table of several folders."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from bench.report.manifest import Manifest, load_manifest, manifest_path, settings_note


def system_of(results_dir: Path, folder: str) -> str:
    """The ``system`` of the manifest run whose folder holds ``folder``."""
    manifest = load_manifest(results_dir, folder)
    inside = PurePosixPath(folder).relative_to(_manifest_folder(results_dir, folder))
    for run in manifest.runs:
        if run.folder == "." or inside.is_relative_to(run.folder):
            return run.system
    raise LookupError(f"{folder}: no run of its manifest holds it")


def note_for(results_dir: Path, folders: Sequence[str]) -> str:
    """The settings in which the systems of ``folders`` differ (one manifest holds them all)."""
    manifest: Manifest = load_manifest(results_dir, folders[0])
    systems = list(dict.fromkeys(system_of(results_dir, folder) for folder in folders))
    source = f"docs/results/{_manifest_folder(results_dir, folders[0])}/manifest.json"
    return settings_note(manifest, systems, source=source)


def _manifest_folder(results_dir: Path, folder: str) -> PurePosixPath:
    return PurePosixPath(manifest_path(results_dir, folder).parent.relative_to(results_dir).as_posix())
