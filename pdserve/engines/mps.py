"""CUDA MPS for engines that share a GPU.

Two engine processes on one GPU take turns on it: on an H200 at 2 req/s of 3072-token prompts,
the prefill leg of a PD pair on one GPU made TTFT 2.2x that of one engine alone; under MPS their
kernels run side by side and it is 1.62x (docs/transport.md, section 5). So when engines share a GPU,
pdserve starts one MPS control daemon for the deployment, with pipe and log folders of its own,
and stops it after the engines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine_config import EngineSpec, MpsMode
from pdserve.errors import ConfigError, EngineStartFailed

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"


def shared_gpus(specs: Sequence[EngineSpec]) -> set[int]:
    """GPU ids that two or more GPU engines are placed on."""
    counts = Counter(gpu for spec in specs if spec.pool.device == "cuda" for gpu in spec.gpu_ids)
    return {gpu for gpu, count in counts.items() if count > 1}


@dataclass(frozen=True, slots=True)
class MpsDaemon:
    gpus: frozenset[int]  # the shared GPUs: engines placed on any of them are its clients
    pipe_dir: Path  # short, under /tmp: the daemon's unix socket path must fit in 108 bytes
    log_dir: Path

    def serves(self, spec: EngineSpec) -> bool:
        return bool(self.gpus & set(spec.gpu_ids))

    @property
    def env(self) -> dict[str, str]:
        """What the daemon and every client engine must share to find each other."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    async def start(self) -> None:
        """Start the daemon (it forks into the background); raises EngineStartFailed if it will not."""
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        code, output = await self._control("-d")
        if code != 0:
            raise EngineStartFailed(f"{MPS_CONTROL} -d failed (exit {code}): {output or 'no output'}; "
                                    f"set launch.mps: off to let the engines time-slice the GPU")

    async def stop(self) -> None:
        code, output = await self._control(stdin="quit\n")
        if code != 0:
            log.warning("%s quit failed (exit %s): %s", MPS_CONTROL, code, output)

    async def _control(self, *args: str, stdin: str = "") -> tuple[int, str]:
        """Run the control binary; returns its exit code and what it printed.

        Its output goes to a file, not a pipe: with ``-d`` the daemon it forks keeps the
        inherited stdout open, so a pipe would never reach end-of-file (found on an H200).
        """
        output_path = self.log_dir / "control.log"
        with output_path.open("ab") as output:
            start = output.tell()
            process = await asyncio.create_subprocess_exec(
                MPS_CONTROL, *args, env={**os.environ, **self.env}, stdin=asyncio.subprocess.PIPE,
                stdout=output, stderr=asyncio.subprocess.STDOUT,
            )
            await asyncio.wait_for(process.communicate(stdin.encode()), timeout=30)
        printed = output_path.read_bytes()[start:].decode(errors="replace").strip()
        return process.returncode or 0, printed


def plan_mps(specs: Sequence[EngineSpec], *, mode: MpsMode, log_dir: Path) -> MpsDaemon | None:
    """The daemon this deployment needs, or None. Raises ConfigError when ``on`` cannot be honoured."""
    shared = shared_gpus(specs)
    if mode == "off" or not shared:
        return None
    if shutil.which(MPS_CONTROL) is None:
        if mode == "on":
            raise ConfigError(f"launch.mps is on but {MPS_CONTROL} is not on PATH")
        log.warning("engines share GPU(s) %s but %s is not on PATH: they will time-slice it, which "
                    "roughly doubles the prefill leg under load (docs/transport.md)", sorted(shared), MPS_CONTROL)
        return None
    pipe_dir = Path(tempfile.gettempdir()) / f"pdserve-mps-{os.getpid()}"
    return MpsDaemon(gpus=frozenset(shared), pipe_dir=pipe_dir, log_dir=log_dir / "mps")
