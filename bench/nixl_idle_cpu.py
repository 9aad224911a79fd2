"""How much CPU one idle NIXL agent burns (docs/transport.md, section 6).

    python bench/nixl_idle_cpu.py                 # vLLM's agent: UCX backend, progress thread on, no pause
    python bench/nixl_idle_cpu.py --pause-us 100  # as pdserve's CPU engines make it (kv.progress_delay_us)
    python bench/nixl_idle_cpu.py --no-progress-thread --num-threads 0
"""

from __future__ import annotations

import argparse
import importlib
import os
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from pdserve_vllm import pause_progress_thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=4, help="UCX worker threads (vLLM's default: 4)")
    parser.add_argument("--no-progress-thread", action="store_true")
    parser.add_argument("--pause-us", type=int, default=0, help="the progress thread's pause between rounds")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if args.pause_us:
        pause_progress_thread(importlib.import_module(nixl_agent.__module__).nixlBind, args.pause_us)
    config = nixl_agent_config(enable_prog_thread=not args.no_progress_thread, num_threads=args.num_threads)
    agent = nixl_agent("idle", config)
    buffer = np.ones(1 << 20, dtype=np.uint8)  # registered memory, as an engine's KV cache would be
    agent.register_memory(agent.get_reg_descs([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM"))
    start = time.process_time()
    time.sleep(args.seconds)
    busy = (time.process_time() - start) / args.seconds
    print(f"progress thread {'off' if args.no_progress_thread else 'on'}, pause {args.pause_us} us, "
          f"num_threads {args.num_threads}, UCX_TLS={os.environ.get('UCX_TLS', '(default)')}: "
          f"idle CPU {busy:.0%} of a core")


if __name__ == "__main__":
    main()
