"""The logits processor that starts a request with a given token (pdserve_vllm/first_token.py), driven
through vLLM's own batch-update types as its model runner drives it (vllm/v1/sample/logits_processor)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality, validate_logits_processors_parameters

from pdserve_vllm import FIRST_TOKEN_ARG, FIRST_TOKEN_PROCESSOR
from pdserve_vllm.first_token import FirstTokenProcessor

VOCAB = 8


def processor() -> FirstTokenProcessor:
    return FirstTokenProcessor(None, torch.device("cpu"), False)  # type: ignore[arg-type]  # it reads no config


def update(*, added: list[tuple[int, SamplingParams, list[int]]] = (), removed: list[int] = (),  # type: ignore[assignment]
           moved: list[tuple[int, int, MoveDirectionality]] = (), size: int = 2) -> BatchUpdate:  # type: ignore[assignment]
    return BatchUpdate(batch_size=size, removed=removed, added=[(i, p, [1, 2], out) for i, p, out in added],
                       moved=moved)


def forced(token: int) -> SamplingParams:
    return SamplingParams(extra_args={FIRST_TOKEN_ARG: token})


def test_only_the_named_rows_first_step_is_forced_and_later_steps_sample_freely() -> None:
    lp, first_output, other_output = processor(), [], []  # type: ignore[var-annotated]
    lp.update_state(update(added=[(0, forced(5), first_output), (1, SamplingParams(), other_output)]))
    logits = torch.arange(2 * VOCAB, dtype=torch.float32).reshape(2, VOCAB)  # argmax 7 in both rows
    out = lp.apply(logits.clone())
    assert out[0].argmax().item() == 5 and torch.isinf(out[0]).sum().item() == VOCAB - 1
    assert torch.equal(out[1], logits[1])
    first_output.append(5)  # vLLM appends the sampled token to the live list
    lp.update_state(None)
    assert torch.equal(lp.apply(logits.clone()), logits)


def test_a_row_that_moves_in_the_batch_is_still_forced_at_its_new_index() -> None:
    lp = processor()
    lp.update_state(update(added=[(0, forced(3), [])]))
    lp.update_state(update(moved=[(0, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    out = lp.apply(torch.zeros(2, VOCAB))
    assert out[1].argmax().item() == 3 and not torch.isinf(out[0]).any()


def test_a_removed_row_is_forgotten() -> None:
    lp = processor()
    lp.update_state(update(added=[(0, forced(3), [])]))
    lp.update_state(update(removed=[0]))
    assert not torch.isinf(lp.apply(torch.zeros(2, VOCAB))).any()


def test_a_token_that_is_not_an_id_is_refused_when_the_request_arrives() -> None:
    with pytest.raises(ValueError, match=FIRST_TOKEN_ARG):
        FirstTokenProcessor.validate_params(SamplingParams(extra_args={FIRST_TOKEN_ARG: "5"}))
    FirstTokenProcessor.validate_params(forced(0))


def test_vllm_loads_it_by_the_name_pdserve_gives_engines_and_checks_requests_with_it() -> None:
    with pytest.raises(VLLMValidationError, match=FIRST_TOKEN_ARG):
        validate_logits_processors_parameters([FIRST_TOKEN_PROCESSOR], SamplingParams(extra_args={FIRST_TOKEN_ARG: -1}))
