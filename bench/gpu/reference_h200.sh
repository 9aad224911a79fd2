#!/bin/bash
# Ray Serve LLM's own PD app (build_pd_openai_app, Ray 2.58, vLLM 0.26) on ONE H200, both engines on it, set up
# as Ray's fractional-GPU guide says (bench/gpu/reference_start.py). From the repo root with the vLLM stage in
# /tmp/site. Says whether it starts, in how long, and why not; Ray's logs go to $OUT; Ray is stopped at the end.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
RAY="python3 -m ray.scripts.scripts"
python3 -m pdserve demo-model /tmp/q8b --shape qwen3-8b > /dev/null || exit 1
$RAY start --head --node-ip-address 127.0.0.1 --num-gpus 1 --num-cpus 16 --dashboard-port 8265 \
  --disable-usage-stats > $OUT/ray-start.log 2>&1 || { tail -20 $OUT/ray-start.log; exit 1; }
timeout 480 python3 bench/gpu/reference_start.py --model-dir /tmp/q8b --out $OUT/reference.json \
  --timeout-s ${TIMEOUT_S:-420} 2>&1 | tee $OUT/reference.txt | tail -25
grep -rhE "Error|error|Traceback|cannot fit|ActorHandle|Backend .* was instantiated" /tmp/ray/session_latest/logs/ \
  2>/dev/null | sort | uniq -c | sort -rn | head -25 > $OUT/ray-errors.txt; head -25 $OUT/ray-errors.txt
$RAY stop --force > /dev/null 2>&1
tar czf $OUT/ray-logs.tgz -C /tmp/ray session_latest/logs 2>/dev/null
