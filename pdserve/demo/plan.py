"""What a demo-model build is made of, without torch: the training plan, whose every field feeds the
recipe that says whether a built folder is up to date (model.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrainPlan:
    """How long and how hard to train; every field feeds the recipe hash, so changing one rebuilds."""

    steps: int
    batch_size: int = 16
    context_tokens: int = 128
    peak_learning_rate: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0
    # Pinned so float reductions split the same way whatever the core count, keeping the weights identical.
    threads: int = 2
