"""Seeded random weights for a tiny shape: a spread-out lm_head and slowly decaying Gated DeltaNet state."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from pdserve.demo.random_weights import LM_HEAD_STD, STATE_DECAY_RANGE, write_random_weights
from pdserve.demo.shapes import Shape, write_shape_model


def test_weights_follow_the_config_with_a_wide_lm_head_and_slow_state_decay(tmp_path: Path) -> None:
    folder = write_shape_model(tmp_path / "tiny", Shape.QWEN3_NEXT_TINY)
    weights = load_file(write_random_weights(folder))

    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}  # the config's torch_dtype
    assert abs(weights["lm_head.weight"].float().std().item() - LM_HEAD_STD) < 0.01
    decays = torch.cat([tensor.float().exp() for name, tensor in weights.items() if name.endswith(".A_log")])
    assert decays.numel() == 6 * 4  # 6 Gated DeltaNet layers x 4 value heads
    low, high = STATE_DECAY_RANGE
    assert low * 0.99 <= decays.min().item() and decays.max().item() <= high * 1.01  # bfloat16 rounding
