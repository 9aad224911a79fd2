"""One host's engines of a deployment, with no gateway: what runs on each engine host of the bed
(tests/netbed.py), from the config file a user writes for that machine, until SIGTERM or SIGINT.

    ip netns exec HOST python -m tests.netbed_engines CONFIG.yaml

Prints ``engines ready`` once every engine answers /health.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from pdserve.config import load_settings
from pdserve.engine_key import deployment_engine_key, engine_session
from pdserve.engines.supervisor import Supervisor
from pdserve.up import resolve_layout, resolve_model


async def run(config: Path) -> None:
    settings = load_settings(config)
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    model_path = await resolve_model(settings, progress=print)
    layout = await resolve_layout(model_path, progress=print)
    with deployment_engine_key(settings.gateway, run_dir=settings.run_dir) as key:  # the bed gives every host one
        supervisor = Supervisor(settings, model_path=model_path, layout=layout, progress=print, engine_key=key)
        async with engine_session(key) as session:
            try:
                await supervisor.start_all(session)
                print("engines ready", flush=True)
                await stop.wait()
            finally:
                await supervisor.stop_all()


if __name__ == "__main__":
    asyncio.run(run(Path(sys.argv[1])))
