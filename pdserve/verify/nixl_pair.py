"""NIXL agent-to-agent transfers for the microbenchmark: a target and an initiator agent in two
spawned processes, as a prefill and a decode engine hold them; every byte that arrives is checked.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import statistics
import time
from typing import Any

import numpy as np

from pdserve.verify import transfers


def measure_nixl(path: transfers.Path, plan: transfers.Plan) -> transfers.TransferResult:
    """Run a target agent and an initiator agent in two spawned processes; this process only relays metadata."""
    ctx = mp.get_context("spawn")
    target_conn, target_end = ctx.Pipe()
    initiator_conn, initiator_end = ctx.Pipe()
    target = ctx.Process(target=_run_agent, args=(target_end, path, plan, False), daemon=True)
    initiator = ctx.Process(target=_run_agent, args=(initiator_end, path, plan, True), daemon=True)
    target.start()
    initiator.start()
    try:
        initiator_conn.send(_receive(target_conn, plan.timeout_s))
        seconds, descriptors, initiator_ok = _receive(initiator_conn, plan.timeout_s)
        target_conn.send("finish")
        target_ok = _receive(target_conn, plan.timeout_s)
        return transfers.TransferResult(path, plan.size_bytes, seconds, descriptors, bool(initiator_ok and target_ok))
    except (RuntimeError, TimeoutError, EOFError) as exc:
        return transfers.TransferResult(path, plan.size_bytes, float("inf"), plan.n_blocks, False, error=str(exc))
    finally:
        for process in (initiator, target):
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


def _receive(conn: mpc.Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer from a NIXL agent process within {timeout_s:.0f} s")
    is_ok, payload = conn.recv()
    if not is_ok:
        raise RuntimeError(payload)
    return payload


def _run_agent(conn: mpc.Connection, path: transfers.Path, plan: transfers.Plan, is_initiator: bool) -> None:
    """One agent process: the target serves its buffer, the initiator posts the transfers and times them."""
    try:
        os.environ.update(dict(path.env))  # before NIXL loads: UCX reads its configuration when the backend starts
        agent = _Agent(path, plan, name="initiator" if is_initiator else "target")
        is_source = is_initiator == (path.operation is transfers.Operation.WRITE)
        agent.fill(is_source=is_source)
        if is_initiator:
            remote_metadata, remote_address = conn.recv()
            seconds = agent.time_transfers(remote_metadata, remote_address)
            conn.send((True, (seconds, plan.n_blocks, is_source or agent.is_correct())))
        else:
            conn.send((True, (agent.metadata(), agent.address)))
            conn.recv()
            conn.send((True, is_source or agent.is_correct()))
    except Exception as exc:  # reported to the parent, which records the path as failed
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        raise


class _Agent:
    """A NIXL agent that owns one registered buffer of the plan's size, in DRAM (numpy) or VRAM (torch)."""

    def __init__(self, path: transfers.Path, plan: transfers.Plan, *, name: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.path, self.plan = path, plan
        self.is_vram = path.kind is transfers.PathKind.NIXL_VRAM
        self.buffer: Any  # np.ndarray in DRAM, torch.Tensor in VRAM
        self.torch: Any = None
        self.mem_type = "VRAM" if self.is_vram else "DRAM"
        if self.is_vram:
            import torch

            self.torch = torch
            self.buffer = torch.full((plan.n_words,), transfers.POISON, dtype=torch.int64, device="cuda")
            self.address, self.device_id = self.buffer.data_ptr(), self.buffer.device.index or 0
        else:
            self.buffer = np.full(plan.n_words, transfers.POISON, dtype=np.int64)
            self.address, self.device_id = self.buffer.ctypes.data, 0
        config = nixl_agent_config(backends=[path.backend], num_threads=path.num_threads)
        self.agent = nixl_agent(name, config)
        regions = [(self.address, plan.size_bytes, self.device_id, "")]
        self.agent.register_memory(self.agent.get_reg_descs(regions, self.mem_type), backends=[path.backend])

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def fill(self, *, is_source: bool) -> None:
        if is_source and self.is_vram:
            self.buffer.copy_(transfers.pattern_torch(self.torch, self.plan.n_words, "cuda"))
            self.torch.cuda.synchronize()
        elif is_source:
            self.buffer[:] = np.arange(self.plan.n_words, dtype=np.int64) + transfers.SEED

    def descriptors(self, address: int) -> np.ndarray:
        out = np.empty((self.plan.n_blocks, 3), dtype=np.uint64)
        out[:, 0] = address + np.arange(self.plan.n_blocks, dtype=np.uint64) * self.plan.block_bytes
        out[:, 1] = self.plan.block_bytes
        out[:, 2] = self.device_id
        return out

    def time_transfers(self, remote_metadata: bytes, remote_address: int) -> float:
        """Warm up once (connection, memory-handle mapping), then time make_prepped_xfer + post + completion."""
        remote_name = self.agent.add_remote_agent(remote_metadata)
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.descriptors(self.address), self.mem_type)
        remote = self.agent.prep_xfer_dlist(remote_name, self.descriptors(remote_address), self.mem_type)
        perm = self.plan.permutation().astype(np.int32)
        identity = np.arange(self.plan.n_blocks, dtype=np.int32)
        # Destination block i always receives source block perm[i].
        is_read = self.path.operation is transfers.Operation.READ
        local_ids, remote_ids = (identity, perm) if is_read else (perm, identity)
        samples = []
        for repeat in range(self.plan.repeats + 1):
            start = time.perf_counter()
            handle = self.agent.make_prepped_xfer(self.path.operation.value, local, local_ids, remote, remote_ids)
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended in state {state}")
            samples.append(time.perf_counter() - start)
            handle.release()
            if time.perf_counter() - start > self.plan.timeout_s / (self.plan.repeats + 1):
                break  # a path this slow gets one timed sample rather than a timeout
        return statistics.median(samples[1:] or samples)

    def is_correct(self) -> bool:
        expected = transfers.expected_blocks(self.plan)
        if self.is_vram:
            received = self.buffer.view(self.plan.n_blocks, -1)
            return bool(self.torch.equal(received, self.torch.from_numpy(expected).to(received.device)))
        return bool(np.array_equal(self.buffer.reshape(self.plan.n_blocks, -1), expected))
