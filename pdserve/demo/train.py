"""Train the demo model's weights: a tiny Qwen3 fitted to the corpus with a fixed seed and step count.

A fixed step count, not a time budget, is what makes two builds bit-identical. CPU only; saves nothing
(model.py writes the checkpoint).
"""

import math
import time
from collections.abc import Callable

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from pdserve.demo.plan import TrainPlan

_PROGRESS_EVERY_STEPS = 25


def make_config(*, vocab_size: int, bos_token_id: int, eos_token_id: int, max_position_embeddings: int) -> Qwen3Config:
    """The demo architecture: Qwen3 with GQA (4 query heads share 2 KV heads) and tied embeddings.

    head_dim 64 is one of the sizes vLLM's CPU attention kernels support.
    """
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def train_model(
    token_ids: torch.Tensor,
    *,
    config: Qwen3Config,
    plan: TrainPlan,
    progress: Callable[[str], None],
) -> Qwen3ForCausalLM:
    """Initialise from `plan.seed` and run `plan.steps` AdamW steps on random windows of `token_ids` (1-D).

    Restores torch's global RNG state and thread count afterwards. Returns the float32 model in inference mode.
    """
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(plan.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(plan.seed)
            model = Qwen3ForCausalLM(config)  # type: ignore[no-untyped-call]  # transformers leaves __init__ bare
        _fit(model, token_ids, plan=plan, progress=progress)
    finally:
        torch.set_num_threads(previous_threads)
    model.train(mode=False)
    return model


def _fit(model: Qwen3ForCausalLM, token_ids: torch.Tensor, *, plan: TrainPlan, progress: Callable[[str], None]) -> None:
    windows = torch.Generator().manual_seed(plan.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.peak_learning_rate, weight_decay=0.01)
    model.train()
    started = time.monotonic()
    for step in range(1, plan.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, plan=plan)
        batch = _sample_batch(token_ids, plan=plan, generator=windows)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        if step % _PROGRESS_EVERY_STEPS == 0 or step == plan.steps:
            elapsed_s = time.monotonic() - started
            progress(f"demo model: step {step}/{plan.steps} loss {loss.item():.3f} elapsed {elapsed_s:.1f}s")


def _learning_rate(step: int, *, plan: TrainPlan) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak: the usual shape for short runs."""
    if step <= plan.warmup_steps:
        return plan.peak_learning_rate * step / plan.warmup_steps
    progress = (step - plan.warmup_steps) / max(1, plan.steps - plan.warmup_steps)
    return plan.peak_learning_rate * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _sample_batch(token_ids: torch.Tensor, *, plan: TrainPlan, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, token_ids.numel() - plan.context_tokens, (plan.batch_size,), generator=generator)
    return torch.stack([token_ids[start : start + plan.context_tokens] for start in starts.tolist()])
