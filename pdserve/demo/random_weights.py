"""Seeded random weights for a shape folder, so a tiny model's greedy output depends on its whole prompt.

vLLM's ``--load-format dummy`` fills weights with values of about 0.001: every prompt then repeats one token,
and a broken KV or state handoff would repeat the same one. Writes ``model.safetensors`` into the folder only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

SEED = 0
# transformers initialises lm_head like every layer (std 0.02): next-token log-probabilities then lie within
# hundredths of each other, and bfloat16 rounding decides between them. At 0.5 they spread over units.
LM_HEAD_STD = 0.5
# Gated DeltaNet and Mamba layers decay their state by exp(-A * softplus(...)) per token. transformers draws A
# up to 16, so most heads forget a token at the next one and the state handed off would hardly matter; with
# A in this range a token fades over tens to hundreds of tokens.
STATE_DECAY_RANGE = (0.01, 0.1)


def write_random_weights(model_dir: Path, *, seed: int = SEED) -> Path:
    """Write ``model_dir/model.safetensors``: the architecture of ``model_dir/config.json`` with weights drawn
    from ``seed``, in the config's ``torch_dtype``; the same seed gives the same bytes. Seconds for a tiny
    shape, never meant for a real model's size. Returns the file's path.
    """
    config = AutoConfig.from_pretrained(model_dir)
    dtype = config.dtype  # transformers reads config.json's torch_dtype into a torch.dtype
    assert isinstance(dtype, torch.dtype), f"{model_dir}/config.json names no torch_dtype"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, LM_HEAD_STD)
        for name, parameter in model.named_parameters():
            if name.endswith(".A_log"):
                parameter.copy_(torch.empty_like(parameter).uniform_(*STATE_DECAY_RANGE).log())
    weights = {name: tensor.to(dtype).contiguous() for name, tensor in model.state_dict().items()}
    path = model_dir / "model.safetensors"
    save_file(weights, path, metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors writes owner-only files; a model folder should read like any other
    return path
