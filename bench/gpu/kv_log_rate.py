"""KV handoff bandwidth from vLLM's own "KV Transfer metrics" log lines, the same way for any system whose
engines log them (pdserve's engine logs, Ray's worker logs): the sum of each window's megabytes over the sum of
its transfer time. Prints one JSON object: transfers, GB moved, seconds of transfer, GB/s.

    python3 bench/gpu/kv_log_rate.py LOG [LOG ...]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# vLLM 0.26, distributed/kv_transfer/kv_connector/v1/nixl/stats.py (reduce): one line per logging window.
_WINDOW = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+), .*?Avg MB per transfer=([\d.]+), "
                     r"Throughput \(MB/s\)=([\d.]+)")


def main() -> None:
    transfers, megabytes, seconds = 0, 0.0, 0.0
    for path in sys.argv[1:]:
        for count, avg_mb, mb_per_s in _WINDOW.findall(Path(path).read_text(errors="replace")):
            window_mb = int(count) * float(avg_mb)
            if int(count) == 0 or float(mb_per_s) == 0:
                continue
            transfers += int(count)
            megabytes += window_mb
            seconds += window_mb / float(mb_per_s)
    gigabytes = megabytes * 2**20 / 1e9  # vLLM's MB are MiB
    print(json.dumps({"transfers": transfers, "gb": round(gigabytes, 2), "transfer_s": round(seconds, 3),
                      "gb_per_s": round(gigabytes / seconds, 1) if seconds else None}))


if __name__ == "__main__":
    main()
