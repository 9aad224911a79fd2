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
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import Qwen3ForCausalLM

from pdserve.config import DEMO_MODEL_NAME
from pdserve.demo import corpus, train

MARKER_FILE = "pdserve-demo.json"
DEFAULT_TRAIN_STEPS = 250
# Bump whenever a change to corpus.py, train.py or this file would change the built bytes.
RECIPE_VERSION = 1
# float32, not bfloat16: the model is tiny, and full precision keeps greedy output identical
# between a prefill/decode pair and one local engine (vLLM needs `--dtype float32` to keep it).
WEIGHTS_DTYPE = torch.float32


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
    plan = train.TrainPlan(steps=train_steps)
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
            _build(staging, plan=plan, recipe=recipe, progress=progress)
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


def _recipe(plan: train.TrainPlan) -> dict[str, object]:
    return {"version": RECIPE_VERSION, "dtype": str(WEIGHTS_DTYPE), "train": dataclasses.asdict(plan)}


def _build(staging: Path, *, plan: train.TrainPlan, recipe: dict[str, object], progress: Callable[[str], None]) -> None:
    started = time.monotonic()
    passages = corpus.load_passages(Path(sysconfig.get_path("stdlib")))
    documents = corpus.render_documents(passages)
    tokenizer = corpus.train_tokenizer(documents)
    corpus.save_tokenizer(tokenizer, staging)
    token_ids = torch.tensor([token for encoding in tokenizer.encode_batch(documents) for token in encoding.ids])
    progress(f"demo model: {len(passages)} passages, {token_ids.numel()} tokens, vocab {tokenizer.get_vocab_size()}")
    config = train.make_config(
        vocab_size=corpus.VOCAB_SIZE,
        bos_token_id=corpus.special_token_id(tokenizer, corpus.END_OF_TEXT),
        eos_token_id=corpus.special_token_id(tokenizer, corpus.IM_END),
        max_position_embeddings=corpus.MAX_CONTEXT_TOKENS,
    )
    model = train.train_model(token_ids, config=config, plan=plan, progress=progress)
    _save_weights(model, staging)
    _save_generation_config(tokenizer, staging)
    _seal(staging, recipe=recipe)
    progress(f"demo model: built in {time.monotonic() - started:.1f}s")


def _seal(staging: Path, *, recipe: dict[str, object]) -> None:
    """Write the marker last: a marker whose hashes match is what makes a folder complete."""
    files = _file_hashes(staging, names=sorted(path.name for path in staging.iterdir()))
    marker = {"name": DEMO_MODEL_NAME, "recipe": recipe, "files": files}
    (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    # mkdtemp and safetensors make owner-only files; a model folder should read like any other.
    staging.chmod(0o755)
    for path in staging.iterdir():
        path.chmod(0o644)


def _save_weights(model: Qwen3ForCausalLM, staging: Path) -> None:
    """Write config.json and model.safetensors without lm_head (it is the tied embedding)."""
    model.config.dtype = WEIGHTS_DTYPE
    model.config.save_pretrained(staging)
    weights = {name: tensor.to(WEIGHTS_DTYPE).contiguous() for name, tensor in model.state_dict().items()}
    del weights["lm_head.weight"]
    save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})


def _save_generation_config(tokenizer: Tokenizer, staging: Path) -> None:
    """Chat answers end with <|im_end|>, plain completions with <|endoftext|>: either one stops generation."""
    end_of_text = corpus.special_token_id(tokenizer, corpus.END_OF_TEXT)
    generation = {
        "bos_token_id": end_of_text,
        "eos_token_id": [corpus.special_token_id(tokenizer, corpus.IM_END), end_of_text],
        "pad_token_id": end_of_text,
    }
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")


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
