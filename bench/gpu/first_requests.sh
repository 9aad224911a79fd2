#!/bin/bash
# Which first request pays a first-use cost on a prefill engine (bench/gpu/first_requests.py says why it is asked),
# with the engines side_by_side.sh's TTFT rounds start: SHAPE (qwen3-8b; qwen3.5-9b), 12 GiB of KV each, decode
# CUDA graphs and no torch.compile, both on GPU 0 under MPS, as `pdserve up` starts them:
#   SHAPE=qwen3-8b bash bench/gpu/first_requests.sh
# Lands in $OUT: first-requests.jsonl (one line a request), machine.txt, up.log and the engines' logs.
set -u
SHAPE=${SHAPE:-qwen3-8b} PORT=9000 COMPILE= KV_BYTES=${KV_BYTES:-12884901888} LOG_DIR=/tmp/first-requests-logs
source bench/gpu/machine.sh
machine $OUT/machine.txt
source bench/gpu/pd_config.sh > $OUT/config.log 2>&1 || { cat $OUT/config.log; exit 1; }
python3 -m pdserve up --config $CONFIG > $OUT/up.log 2>&1 &
UP=$!
for _ in $(seq 420); do grep -q "^ready in" $OUT/up.log && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
grep -E "^ready in" $OUT/up.log && python3 bench/gpu/first_requests.py --prefill http://127.0.0.1:$((PORT + 100)) \
  --gateway http://127.0.0.1:$PORT --model $SHAPE --words ${WORDS:-470} | tee $OUT/first-requests.jsonl
kill -INT $UP 2>/dev/null; wait $UP
tar czf $OUT/engine-logs.tgz -C $LOG_DIR .
