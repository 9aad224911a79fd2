"""Runs inside a vLLM engine, loaded as a logits processor (``--logits-processors``): a request whose
``vllm_xargs`` name a first token gets that token as its first output token, whatever it would sample.

A decode engine given the prefill engine's first token this way writes the whole reply as one engine
does, its chat layer included (the role event, reasoning and tool-call parsers, usage, finish reason),
while the client already has that token from the prefill engine (pdserve/pd/first_token.py). The rest
of the sampling runs as usual: penalties and stop strings see the token as output, and a seeded
sampler draws for it as for any step, so the second token is sampled as one engine would sample it.

vLLM's V1 interface (vllm/v1/sample/logits_processor/interface.py, 0.32): one instance per engine
sees the batch's rows; ``update_state`` is told which rows came, went or moved, and ``apply`` edits
the logits of the whole batch before sampling.
"""

from __future__ import annotations

from pdserve_vllm.contract import Hook
from pdserve_vllm.contract_check import require

require(Hook.FIRST_TOKEN)  # before vLLM's imports: a release without these names is refused by name (contract.py)

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pdserve_vllm import FIRST_TOKEN_ARG


def first_token_of(params: SamplingParams) -> int | None:
    """The token id the request asks to start with (``vllm_xargs``, carried as ``extra_args``), if any.
    Raises ValueError on one that is not a non-negative integer."""
    token = (params.extra_args or {}).get(FIRST_TOKEN_ARG)
    if token is None:
        return None
    if type(token) is not int or token < 0:
        raise ValueError(f"vllm_xargs.{FIRST_TOKEN_ARG} must be a token id (a non-negative integer), not {token!r}")
    return token


class FirstTokenProcessor(LogitsProcessor):
    """Makes a row's first output token the one its request names: every other logit of that row
    becomes -inf for that one step; rows that name none, and later steps, are left alone."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # Batch row -> (the token to force, the request's output token ids: vLLM's live list).
        self._rows: dict[int, tuple[int, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse a malformed token id when the request arrives (vLLM answers 400)."""
        first_token_of(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the argmax: greedy requests need it too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, _new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        for row, (token, output) in list(self._rows.items()):
            if output:  # the first token is out: nothing more to force
                del self._rows[row]
                continue
            if not 0 <= token < logits.shape[1]:
                continue  # a token this model has no logit for: vLLM's own sampling goes on
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0  # finite even where a grammar's mask had made it -inf
        return logits


def _new_row(params: SamplingParams, _prompt: list[int] | None, output: list[int]) -> tuple[int, list[int]] | None:
    token = first_token_of(params)
    return None if token is None or output else (token, output)
