"""Build the demo model folder once: tokenizer, trained weights and configs, marked complete by a marker file.

Writes only under the target's parent folder. The build happens in a sibling temp folder that is
renamed into place, so a crash never leaves a half-written model where vLLM would load it.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from pdserve.demo.plan import TrainPlan
from pdserve.engine_config import DEMO_MODEL_NAME

MARKER_FILE = "pdserve-demo.json"
DEFAULT_TRAIN_STEPS = 250
# Bump whenever a change to corpus.py, train.py or this file would change the built bytes.
RECIPE_VERSION = 1
# build.WEIGHTS_DTYPE as the recipe names it; a constant here, so checking a built folder needs no torch.
WEIGHTS_DTYPE_NAME = "torch.float32"


def default_demo_model_dir(cache_home: Path) -> Path:
    """Where the demo model lives for a user whose cache folder is `cache_home` (e.g. ~/.cache). Pure."""
    return cache_home / "pdserve" / "demo-model"


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def build_demo_model(
    target_dir: Path,
    *,
    progress: Callable[[str], None] = print,
    train_steps: int = DEFAULT_TRAIN_STEPS,
) -> Path:
    """Make `target_dir` hold the demo model (HF format, served by vLLM as-is) and return it.

    A no-op when `target_dir` already holds a complete build of this recipe and `train_steps`.
    Otherwise builds offline from the interpreter's stdlib text in about a minute on 2 CPU cores
    (training dominates: `train_steps` AdamW steps), and replaces whatever `target_dir` held.
    `progress` receives one human-readable line per stage and every few training steps.
    Raises FileExistsError when `target_dir` holds files but no demo-model marker (it is never
    deleted then), and OSError when the parent folder cannot be written.
    """
    plan = TrainPlan(steps=train_steps)
    recipe = _recipe(plan)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    # Engines that start together on one node (Ray replicas) build it once: the rest wait on a lock
    # of the parent folder (a lock of a folder, not a file: nothing is left behind).
    with _folder_lock(target_dir.parent):
        if _is_complete(target_dir, recipe=recipe):
            progress(f"demo model: {target_dir} is up to date")
            return target_dir
        if target_dir.exists() and any(target_dir.iterdir()) and not (target_dir / MARKER_FILE).exists():
            raise FileExistsError(f"{target_dir} holds files that are not a pdserve demo model; refusing to replace it")
        staging = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}-", dir=target_dir.parent))
        try:
            from pdserve.demo.build import build_into  # torch + transformers: only to build

            build_into(staging, plan=plan, progress=progress)
            _seal(staging, recipe=recipe)
            _move_into_place(staging, target_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    progress(f"demo model: ready in {target_dir}")
    return target_dir


def _is_complete(model_dir: Path, *, recipe: dict[str, object]) -> bool:
    """True when `model_dir` has a marker for `recipe` and every file it lists still has its recorded hash."""
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
        return bool(marker["recipe"] == recipe and marker["files"] == _file_hashes(model_dir, names=marker["files"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _recipe(plan: TrainPlan) -> dict[str, object]:
    return {"version": RECIPE_VERSION, "dtype": WEIGHTS_DTYPE_NAME, "train": dataclasses.asdict(plan)}


def _seal(staging: Path, *, recipe: dict[str, object]) -> None:
    """Write the marker last: a marker whose hashes match is what makes a folder complete."""
    files = _file_hashes(staging, names=sorted(path.name for path in staging.iterdir()))
    marker = {"name": DEMO_MODEL_NAME, "recipe": recipe, "files": files}
    (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    # mkdtemp and safetensors make owner-only files; a model folder should read like any other.
    staging.chmod(0o755)
    for path in staging.iterdir():
        path.chmod(0o644)


def _file_hashes(model_dir: Path, *, names: Iterable[str]) -> dict[str, str]:
    return {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest() for name in names}


def _move_into_place(staging: Path, target_dir: Path) -> None:
    """Rename `staging` to `target_dir`; an old (empty or stale demo) `target_dir` is moved aside, then deleted."""
    if not target_dir.exists():
        staging.rename(target_dir)
        return
    stale = staging.with_name(f"{staging.name}-stale")
    target_dir.rename(stale)
    staging.rename(target_dir)
    shutil.rmtree(stale)
