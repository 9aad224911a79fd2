"""``cloud status``'s kv-link row, pure: the bar by instance type, the probe's length from what the served
model's KV moved, and the verdict from the decode engines' counters (the CLI path: test_cloud_status.py)."""

from __future__ import annotations

import pytest

from pdserve.config import Settings, load_settings
from pdserve.deploy.cluster_view import Check
from pdserve.deploy.kv_link_row import (
    KV_LINK_TARGET_BYTES,
    KvLinkBar,
    is_probe_done,
    kv_link_bar,
    kv_link_check,
    kv_link_max_prompt_tokens,
    next_probe_tokens,
)
from pdserve.pd.transfer_stats import TransferCounters
from pdserve.verify.checks import ADVICE, Link

DECODE_URL = "http://10.0.3.7:8200"
QWEN3_8B_BYTES_PER_TOKEN = 147456  # 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes, no per-request state
# Qwen3.5-9B (eks_standins.KV_BYTES_PER_TOKEN, KV_STATE_BYTES say how): 8 attention layers' KV per token, and
# the 24 Gated DeltaNet layers' state once per request
QWEN35_9B_BYTES_PER_TOKEN, QWEN35_9B_STATE_BYTES = 32768, 51511296
BEFORE = {DECODE_URL: TransferCounters(bytes=4.0e8, seconds=0.2, transfers=12.0)}
PLAIN_BAR = KvLinkBar(0.5, "gateway.slow_kv_gbps 0.5 GB/s", is_tcp_ceiling=False)


def efa_settings(instance_type: str = "g6.8xlarge", **overrides: object) -> Settings:
    return load_settings(None, overrides={"prefill.placement.efa_devices": 1, "decode.placement.efa_devices": 1,
                                          "eks.gpu_instance_type": instance_type, **overrides})


def after_probe(*, gbps: float, kv_bytes: float = 3072 * QWEN3_8B_BYTES_PER_TOKEN,
                failed: float = 0.0) -> dict[str, TransferCounters]:
    """BEFORE plus one transfer of ``kv_bytes`` at ``gbps``."""
    moved = TransferCounters(bytes=kv_bytes, seconds=kv_bytes / (gbps * 1e9), transfers=1.0, failed=failed)
    return {DECODE_URL: BEFORE[DECODE_URL].plus(moved)}


def test_on_efa_the_bar_is_one_tcp_flows_ceiling_on_the_instance_type_chosen() -> None:
    """AWS: one TCP flow goes up to 10 Gbit/s inside a cluster placement group (5 outside); g6.8xlarge's
    network, and so its EFA, is 25 Gbit/s."""
    assert kv_link_bar(efa_settings()) == KvLinkBar(
        1.25, "one TCP flow's 1.25 GB/s on g6.8xlarge (its EFA: 3.12 GB/s)", is_tcp_ceiling=True)
    assert kv_link_bar(efa_settings("p5.48xlarge")).gbps == 1.25
    # a user's bar above TCP's is kept
    assert kv_link_bar(efa_settings(**{"gateway.slow_kv_gbps": 2.0})) == KvLinkBar(
        2.0, "gateway.slow_kv_gbps 2 GB/s", is_tcp_ceiling=False)


def test_without_efa_or_a_network_figure_the_bar_is_slow_kv_gbps_and_says_why() -> None:
    assert kv_link_bar(load_settings(None)) == PLAIN_BAR  # KV over TCP by design
    unknown = kv_link_bar(efa_settings("x9.large"))
    assert unknown == KvLinkBar(0.5, "gateway.slow_kv_gbps 0.5 GB/s (EFA and TCP not told apart on x9.large: "
                                     "no network figure for it)", is_tcp_ceiling=False)


@pytest.mark.parametrize("gbps", [0.3, 1.1])
def test_tcp_speed_on_a_g6_fails_naming_tcp_fallback_and_what_to_check(gbps: float) -> None:
    """1.1 GB/s passed the fixed 0.5 GB/s bar; it is what one TCP flow reaches between two g6 nodes."""
    check = kv_link_check(BEFORE, after_probe(gbps=gbps), bar=kv_link_bar(efa_settings()), prompt_tokens=3072,
                          waited_s=15)
    assert check.result == "FAIL"
    assert check.detail.startswith(f"{DECODE_URL}: 453.0 MB in 1 transfer at {gbps:g} GB/s (prompt 3072 tokens), no "
                                   "faster than one TCP flow's 1.25 GB/s on g6.8xlarge (its EFA: 3.12 GB/s): the KV "
                                   "fell back to TCP over the node's ENA: check the nixl-backend rows")
    assert "`fi_info -p efa`" in check.detail and "vpc.amazonaws.com/efa" in check.detail


def test_efa_speed_on_a_g6_passes_and_says_over_what() -> None:
    check = kv_link_check(BEFORE, after_probe(gbps=3.1), bar=kv_link_bar(efa_settings()), prompt_tokens=3072,
                          waited_s=15)
    assert check == Check("kv-link", "OK", f"{DECODE_URL}: 453.0 MB in 1 transfer at 3.1 GB/s (prompt 3072 tokens), "
                                           "over one TCP flow's 1.25 GB/s on g6.8xlarge (its EFA: 3.12 GB/s)")


def test_under_a_plain_bar_it_fails_saying_to_check_libfabric_on_efa() -> None:
    check = kv_link_check(BEFORE, after_probe(gbps=0.3), bar=PLAIN_BAR, prompt_tokens=3072, waited_s=15)
    assert check.result == "FAIL"
    assert check.detail.startswith(f"{DECODE_URL}: 453.0 MB in 1 transfer at 0.3 GB/s (prompt 3072 tokens), "
                                   "under gateway.slow_kv_gbps 0.5 GB/s. ")
    assert ADVICE[Link.NETWORK] in check.detail and "`fi_info -p efa`" in check.detail


def test_a_failed_transfer_fails_even_when_fast() -> None:
    check = kv_link_check(BEFORE, after_probe(gbps=3.1, failed=1.0), bar=PLAIN_BAR, prompt_tokens=3072, waited_s=15)
    assert check.result == "FAIL"
    assert check.detail.startswith(f"{DECODE_URL}: 1 KV transfer(s) failed (prompt 3072 tokens). ")
    assert ADVICE[Link.NETWORK] in check.detail


def test_without_a_new_transfer_it_is_skipped_saying_the_prompt_was_recomputed() -> None:
    for after in (BEFORE, {}):  # the counters did not move; the gateway has read no engine yet
        check = kv_link_check(BEFORE, after, bar=PLAIN_BAR, prompt_tokens=3072, waited_s=15)
        assert check == Check("kv-link", "SKIPPED", "no decode engine counted a KV transfer within 15 s of a "
                                                    "3072-token PD request: it recomputed the prompt instead (is "
                                                    "the KV connector set on both engines?)")


def test_the_engine_that_moved_most_is_judged_when_others_serve_traffic_too() -> None:
    other = "http://10.0.3.8:8200"
    before = {**BEFORE, other: TransferCounters(bytes=1e6, seconds=1.0, transfers=1.0)}
    after = {**after_probe(gbps=3.1), other: TransferCounters(bytes=2e6, seconds=2.0, transfers=2.0)}
    check = kv_link_check(before, after, bar=PLAIN_BAR, prompt_tokens=3072, waited_s=15)
    assert (check.result, check.detail.split(":")[:2]) == ("OK", ["http", "//10.0.3.7"])


def probe_lengths(*, bytes_per_token: int, state_bytes: int, max_tokens: int) -> list[int]:
    """The prompt lengths the kv-link row sends for a model whose KV takes ``state_bytes`` + tokens x
    ``bytes_per_token``, as cloud_status's loop chooses them."""
    tokens, lengths, sizes = min(512, max_tokens), [], []
    for _ in range(3):
        lengths.append(tokens)
        kv_bytes = state_bytes + tokens * bytes_per_token
        moved = {DECODE_URL: TransferCounters(bytes=kv_bytes, seconds=1.0, transfers=1.0)}
        if is_probe_done(moved, prompt_tokens=tokens, max_tokens=max_tokens):
            break
        sizes.append((tokens, float(kv_bytes)))
        tokens = next_probe_tokens(sizes, max_tokens=max_tokens)
    return lengths


def test_the_probe_is_sized_from_what_the_served_models_kv_takes() -> None:
    """A plain model: the first probe's bytes per token size the second. A hybrid: the first overstates bytes per
    token by its per-request state, the second falls short, and the two fix the line for the third."""
    assert probe_lengths(bytes_per_token=QWEN3_8B_BYTES_PER_TOKEN, state_bytes=0, max_tokens=16320) == [512, 2713]
    hybrid = probe_lengths(bytes_per_token=QWEN35_9B_BYTES_PER_TOKEN, state_bytes=QWEN35_9B_STATE_BYTES,
                           max_tokens=16320)
    assert hybrid == [512, 3000, 10636]
    assert QWEN35_9B_STATE_BYTES + hybrid[-1] * QWEN35_9B_BYTES_PER_TOKEN >= KV_LINK_TARGET_BYTES
    # the model's context caps it, and a probe that moved nothing or failed is the one judged
    assert probe_lengths(bytes_per_token=QWEN35_9B_BYTES_PER_TOKEN, state_bytes=QWEN35_9B_STATE_BYTES,
                         max_tokens=kv_link_max_prompt_tokens(4096)) == [512, 3000, 4032]
    assert is_probe_done({}, prompt_tokens=512, max_tokens=4032)
    failed = {DECODE_URL: TransferCounters(bytes=0.0, seconds=0.0, transfers=0.0, failed=1.0)}
    assert is_probe_done(failed, prompt_tokens=512, max_tokens=4032)


def test_the_longest_probe_leaves_room_for_the_output_token() -> None:
    assert [kv_link_max_prompt_tokens(length) for length in (32, 2048, 32768)] == [1, 1984, 32704]
