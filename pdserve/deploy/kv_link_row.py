"""``cloud status``'s kv-link row, pure: how long its probe prompts are, the rate they must reach, and the
verdict from the decode engines' KV counters (``cloud_status`` sends the probes and reads the counters).

The probe is sized from what the served model's KV actually takes, read off the decode engine's counters
after a first short probe, not from a model's config: the config is not on the user's machine, and the
counters include what no per-token formula does (a hybrid model's per-request recurrent state, block
padding, kv_cache_dtype). Bytes grow linearly with the prompt from a per-request offset, so two probes fix
the line and a third lands on KV_LINK_TARGET_BYTES.

The bar: on EFA, faster than TCP can go on the instance type chosen, so a KV path that fell back to TCP
over the node's ENA fails instead of passing a fixed bar.

EFA and ENA share the instance's network bandwidth, so many TCP flows together could match EFA; one flow
cannot. NIXL over libfabric's tcp provider moves one peer's KV over one connection (one rail, on the first
device: nixl src/utils/libfabric/libfabric_common.cpp), so the ceiling of a single TCP flow between two
instances is what tells them apart. (A fallback to NIXL's UCX shows in the nixl-backend rows instead.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import Settings
from pdserve.deploy.cluster_view import Check
from pdserve.pd.transfer_stats import TransferCounters
from pdserve.role import Role
from pdserve.verify.checks import ADVICE, Link

KV_LINK_CHECK = "kv-link"
# How much KV the judged probe should move: at EFA's 3 GB/s on a g6.8xlarge, 0.13 s, so the bytes and not the
# milliseconds each transfer costs beyond them set its time; over TCP's 1.25 GB/s, 0.3 s.
KV_LINK_TARGET_BYTES = 400e6
KV_LINK_FIRST_PROMPT_TOKENS = 512  # the first probe, whose KV tells the bytes per token
KV_LINK_MAX_PROBES = 3  # the first, one through the origin, one from two points (next_probe_tokens)
KV_LINK_HEADROOM_TOKENS = 64  # under max_model_len, for the output token
KV_LINK_EFA_ADVICE = f"{ADVICE[Link.NETWORK]}; `fi_info -p efa` in the engine pods must list an EFA device"

BITS_PER_BYTE = 8
# One TCP (5-tuple) flow between two EC2 instances: 5 Gbit/s, up to 10 Gbit/s inside one cluster placement
# group (EC2 User Guide, "Amazon EC2 instance network bandwidth", single-flow traffic; ENA Express, which lifts
# it to 25, is off unless enabled per interface, and pdserve does not). The higher figure, so the bar holds
# whether or not the nodes share a placement group.
TCP_FLOW_GBITPS = 10.0
# Network bandwidth of the EFA-capable GPU instance types, Gbit/s, as the EC2 instance type specifications
# list it (accelerated computing, network specifications; `aws ec2 describe-instance-types --instance-types T
# --query 'InstanceTypes[].NetworkInfo.NetworkPerformance'`). The smaller g6 sizes have no EFA.
NETWORK_GBITPS = {
    "g6.8xlarge": 25.0, "g6.12xlarge": 40.0, "g6.16xlarge": 25.0, "g6.24xlarge": 50.0, "g6.48xlarge": 100.0,
    "g6e.8xlarge": 25.0, "g6e.12xlarge": 100.0, "g6e.16xlarge": 35.0, "g6e.24xlarge": 200.0,
    "g6e.48xlarge": 400.0, "p4d.24xlarge": 400.0, "p4de.24xlarge": 400.0, "p5.48xlarge": 3200.0,
    "p5e.48xlarge": 3200.0, "p5en.48xlarge": 3200.0,
}
TCP_FALLBACK_ADVICE = ("the KV fell back to TCP over the node's ENA: check the nixl-backend rows (LIBFABRIC, "
                       "provider efa), that `fi_info -p efa` in the engine pods lists an EFA device, that both "
                       "pools request vpc.amazonaws.com/efa, and that the nodes' EFA security group admits all "
                       "traffic between them")


@dataclass(frozen=True, slots=True)
class KvLinkBar:
    gbps: float  # GB/s: the probe passes at this rate or faster
    what: str  # what the bar is, for the row: "one TCP flow's 1.25 GB/s on g6.8xlarge (its EFA: 3.12 GB/s)"
    is_tcp_ceiling: bool  # a slower probe moved at TCP speed: say so


def kv_link_bar(settings: Settings) -> KvLinkBar:
    """The kv-link bar for this deployment: gateway.slow_kv_gbps, raised on EFA to one TCP flow's ceiling
    where ``eks.gpu_instance_type``'s network is faster than that (else EFA and TCP cannot be told apart by
    rate, and the row says so)."""
    configured = settings.gateway.slow_kv_gbps
    plain = KvLinkBar(configured, f"gateway.slow_kv_gbps {configured:g} GB/s", is_tcp_ceiling=False)
    if not all(settings.pool(role).placement.efa_devices for role in Role):
        return plain  # KV moves over TCP by design
    instance_type = settings.eks.gpu_instance_type
    network_gbitps = NETWORK_GBITPS.get(instance_type)
    if network_gbitps is None or network_gbitps <= TCP_FLOW_GBITPS:
        why = ("no network figure for it" if network_gbitps is None
               else f"its {network_gbitps:g} Gbit/s is no faster than one TCP flow")
        return KvLinkBar(configured, f"{plain.what} (EFA and TCP not told apart on {instance_type}: {why})",
                         is_tcp_ceiling=False)
    tcp_gbps = TCP_FLOW_GBITPS / BITS_PER_BYTE
    if configured > tcp_gbps:
        return plain
    return KvLinkBar(tcp_gbps, f"one TCP flow's {tcp_gbps:g} GB/s on {instance_type} (its EFA: "
                               f"{network_gbitps / BITS_PER_BYTE:.3g} GB/s)", is_tcp_ceiling=True)


def kv_link_max_prompt_tokens(max_model_len: int) -> int:
    """The longest probe prompt: the model's context less room for the output token."""
    return max(1, max_model_len - KV_LINK_HEADROOM_TOKENS)


def next_probe_tokens(moved: Sequence[tuple[int, float]], *, max_tokens: int) -> int:
    """The next probe's prompt length, tokens, from the (prompt tokens, KV bytes moved) of the probes so far,
    aimed at KV_LINK_TARGET_BYTES. One probe is read as bytes per token through the origin: high by a hybrid
    model's per-request state, so the next probe falls short rather than past the target; two fix the
    per-request offset too. Always longer than the last probe, at most ``max_tokens``."""
    last_tokens, last_bytes = moved[-1]
    offset_bytes, bytes_per_token = 0.0, last_bytes / last_tokens
    if len(moved) > 1 and moved[-2][0] < last_tokens:
        first_tokens, first_bytes = moved[-2]
        bytes_per_token = (last_bytes - first_bytes) / (last_tokens - first_tokens)
        offset_bytes = last_bytes - bytes_per_token * last_tokens
    if bytes_per_token <= 0:
        return max_tokens
    wanted = math.ceil((KV_LINK_TARGET_BYTES - offset_bytes) / bytes_per_token)
    return min(max_tokens, max(last_tokens + 1, wanted))


def is_probe_done(moved: dict[str, TransferCounters], *, prompt_tokens: int, max_tokens: int) -> bool:
    """Whether this probe is the one to judge: nothing moved or a transfer failed (nothing to size from),
    enough KV moved, or the prompt is as long as the model allows."""
    return (not moved or any(delta.failed for delta in moved.values()) or prompt_tokens >= max_tokens
            or max(delta.bytes for delta in moved.values()) >= KV_LINK_TARGET_BYTES)


def kv_moved(before: dict[str, TransferCounters], after: dict[str, TransferCounters]) -> dict[str, TransferCounters]:
    """Decode engine URL -> what it counted between the two readings, for each engine that finished or failed
    a transfer in between."""
    deltas = {url: total.since(before.get(url, TransferCounters())) for url, total in after.items()}
    return {url: delta for url, delta in deltas.items() if delta.transfers > 0 or delta.failed > 0}


def kv_link_check(before: dict[str, TransferCounters], after: dict[str, TransferCounters], *, bar: KvLinkBar,
                  prompt_tokens: int, waited_s: float) -> Check:
    """The kv-link row from the gateway's KV counters before the judged probe and after it. OK at ``bar`` or
    faster; FAIL, saying what to check, when slower (naming TCP fallback where the bar is TCP's ceiling) or a
    transfer failed; SKIPPED when no engine counted a transfer in ``waited_s``. With other traffic moving KV
    too, the engine that moved most is judged: the probe's prompt is long."""
    moved = kv_moved(before, after)
    if not moved:
        return Check(KV_LINK_CHECK, "SKIPPED", f"no decode engine counted a KV transfer within {waited_s:g} s of a "
                                               f"{prompt_tokens}-token PD request: it recomputed the prompt instead "
                                               "(is the KV connector set on both engines?)")
    url, delta = max(moved.items(), key=lambda item: item[1].bytes)
    count = f"{delta.transfers:.0f} transfer{'' if delta.transfers == 1 else 's'}"
    measured = f"{url}: {delta.bytes / 1e6:.1f} MB in {count} at {delta.gbps:.3g} GB/s (prompt {prompt_tokens} tokens)"
    if delta.failed:
        return Check(KV_LINK_CHECK, "FAIL", f"{url}: {delta.failed:.0f} KV transfer(s) failed (prompt "
                                            f"{prompt_tokens} tokens). {KV_LINK_EFA_ADVICE}")
    if delta.gbps < bar.gbps:
        if bar.is_tcp_ceiling:
            return Check(KV_LINK_CHECK, "FAIL", f"{measured}, no faster than {bar.what}: {TCP_FALLBACK_ADVICE}")
        return Check(KV_LINK_CHECK, "FAIL", f"{measured}, under {bar.what}. {KV_LINK_EFA_ADVICE}")
    return Check(KV_LINK_CHECK, "OK", f"{measured}, over {bar.what}")
