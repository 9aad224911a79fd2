"""Block digests (pdserve_vllm/kv_digest.py) and the two halves of the KV integrity check (kv_integrity.py) over
tensors laid out as vLLM's CPU backend lays an attention layer's KV cache out: blocks first, [num_blocks, kv_heads,
block_size, 2 * head_size] (vllm/v1/attention/backends/cpu_attn.py, get_kv_cache_shape)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pdserve.pd.kv_proof import IntegrityResult, KvOutcome, integrity
from pdserve_vllm import KV_DIGEST_KEY
from pdserve_vllm.fault_injection import FaultInjector
from pdserve_vllm.kv_digest import attention_blocks, digest_blocks, state_views
from pdserve_vllm.kv_integrity import DIGEST_REQUESTS_ATTR, EXPECTED_ATTR, SchedulerChecks, WorkerChecks

NUM_BLOCKS = 8


def caches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [attention_blocks(torch.randn(NUM_BLOCKS, 2, 16, 8, generator=generator).to(torch.bfloat16),
                             num_blocks=NUM_BLOCKS) for _ in range(3)]


def test_a_digest_changes_with_one_value_another_blocks_bytes_or_a_swap_and_only_then() -> None:
    layers = caches(0)
    before = digest_blocks(layers, [1, 2, 3])
    assert before == digest_blocks([layer.clone() for layer in layers], [1, 2, 3])
    assert len(set(before)) == 3
    layers[2][2].view(-1)[5] += 1
    assert digest_blocks(layers, [1, 2, 3]) == [before[0], digest_blocks(layers, [2])[0], before[2]] != before
    swapped = [layer.clone() for layer in caches(0)]
    row = swapped[0][1].view(-1)
    row[[0, 1]] = row[[1, 0]]
    assert digest_blocks(swapped, [1])[0] != before[0]
    assert digest_blocks(caches(0)[::-1], [1]) != digest_blocks(caches(0), [1])  # layers out of place


def scheduler_request(request_id: str, params: dict[str, Any], *, prompt_tokens: int = 40) -> Any:
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, num_computed_tokens=0,
                           num_prompt_tokens=prompt_tokens)


def prefill_handoff(worker: WorkerChecks) -> dict[str, Any]:
    """One prefill through both halves in vLLM's order: the step's metadata, its forward, ``request_finished``
    (the reply params), then the step's worker output (v1/core/sched/scheduler.py, update_from_output)."""
    checks = SchedulerChecks()
    checks.note(scheduler_request("p", {"do_remote_decode": True}))
    ending = checks.ending({"p": 40}, lambda request_id: ([1, 2, 3],))
    worker.bind(SimpleNamespace(reqs_to_recv={}, **{DIGEST_REQUESTS_ATTR: ending}))
    worker.after_save()
    reply = {"do_remote_prefill": True, "remote_block_ids": ([1, 2, 3],)}
    checks.hold("p", reply)
    checks.fill(worker.report())
    return reply


def pull(reply: dict[str, Any], received: list[torch.Tensor], *, fault: FaultInjector | None = None) -> set[str]:
    """The decode side of the handoff into blocks 5, 6, 7 of ``received`` (copied from the prefill's 1, 2, 3):
    the request ids its check fails."""
    checks = SchedulerChecks()
    checks.note(scheduler_request("d", {"do_remote_prefill": True, **reply}))
    worker = WorkerChecks(rank=0, sent={}, received={0: received}, fault=fault)
    worker.bind(SimpleNamespace(reqs_to_recv={"d": SimpleNamespace(local_block_ids=([5, 6, 7],))},
                                **{EXPECTED_ATTR: checks.expected(["d"])}))
    for layer in received:
        layer[5:8] = layer[1:4]
    failed: set[str] = set()
    worker.check({"d"}, failed)
    return failed


def test_a_clean_handoff_carries_digests_and_passes_the_decode_engines_check() -> None:
    layers = caches(1)
    reply = prefill_handoff(WorkerChecks(rank=0, sent={0: layers}, received={}, fault=None))
    assert reply[KV_DIGEST_KEY] == {"ranks": {"0": [digest_blocks(layers, [1, 2, 3])]}}
    assert pull(reply, layers) == set()


def test_altered_stale_and_short_handoffs_fail_the_check(tmp_path: Path) -> None:
    fault_file = tmp_path / "fault"
    for fault, side in (("alter", "prefill"), ("stale", "prefill"), ("short", "decode")):
        fault_file.write_text(fault)
        injector = FaultInjector(fault_file, state_groups=frozenset())
        layers = caches(2)
        reply = prefill_handoff(WorkerChecks(rank=0, sent={0: layers}, received={},
                                             fault=injector if side == "prefill" else None))
        received = [layer.clone() for layer in layers]
        for layer in received:
            layer[7] = 0  # what the decode engine's block held before the pull
        assert pull(reply, received, fault=injector if side == "decode" else None) == {"d"}, fault


def test_a_handoff_without_digests_for_this_rank_goes_unchecked_not_failed() -> None:
    layers = caches(3)
    reply = prefill_handoff(WorkerChecks(rank=1, sent={0: layers}, received={}, fault=None))
    for layer in layers:
        layer[1] += 1
    assert pull(reply, layers) == set()


def test_the_gateway_reads_the_result_from_the_digests_and_the_usage() -> None:
    assert integrity({KV_DIGEST_KEY: {}}, KvOutcome.PULLED) is IntegrityResult.OK
    assert integrity({KV_DIGEST_KEY: {}}, KvOutcome.RECOMPUTED) is IntegrityResult.RECOMPUTED
    assert integrity({}, KvOutcome.PULLED) is IntegrityResult.UNCHECKED
    assert integrity({KV_DIGEST_KEY: {}}, KvOutcome.UNKNOWN) is IntegrityResult.UNKNOWN


def test_a_recurrent_states_digest_covers_its_state_and_not_its_pages_padding() -> None:
    """vLLM pads a state page to an attention page's size (v1/kv_cache_interface.py, MambaSpec.page_size_padded);
    NIXL moves the state alone, so the padding differs between engines and must not count."""
    page_bytes, state_bytes = 64, 40
    cache = torch.zeros(NUM_BLOCKS * page_bytes, dtype=torch.uint8)
    (rows,) = state_views(cache, page_size_bytes=page_bytes, state_bytes=state_bytes, num_blocks=NUM_BLOCKS)
    before = digest_blocks([rows], [3])
    cache[3 * page_bytes + state_bytes:4 * page_bytes] = 7  # the padding
    assert digest_blocks([rows], [3]) == before
    cache[3 * page_bytes + state_bytes - 1] = 7  # the state's last byte
    assert digest_blocks([rows], [3]) != before


def test_a_decode_block_past_the_pulled_ones_is_not_checked_and_a_cached_prefix_is_skipped() -> None:
    """vLLM pairs a longer decode list's first blocks with the prefill engine's (the last one holds the token after
    a prompt that ends a block, computed there), and a shorter one's with their end (a prefix cached there):
    base_worker._apply_prefix_caching."""
    layers = caches(4)
    digests = digest_blocks(layers, [1, 2, 3])
    expected = {"ranks": {"0": [digests]}}
    for local, copied in (([5, 6, 7, 4], {5: 1, 6: 2, 7: 3}), ([6, 7], {6: 2, 7: 3})):
        received = [layer.clone() for layer in layers]
        for layer in received:
            layer[4] = 0
            for block, source in copied.items():
                layer[block] = layer[source]
        worker = WorkerChecks(rank=0, sent={}, received={0: received}, fault=None)
        worker.bind(SimpleNamespace(reqs_to_recv={"d": SimpleNamespace(local_block_ids=(local,))},
                                    **{EXPECTED_ATTR: {"d": expected}}))
        failed: set[str] = set()
        worker.check({"d"}, failed)
        assert failed == set(), local
