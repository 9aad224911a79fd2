#!/bin/bash
# pdserve itself on one H200 (both engines on GPU 0, Qwen3-8B shape, dummy weights):
# `pdserve up`, `pdserve verify`, then `pdserve bench run` of PD through the gateway against the
# decode engine serving whole requests alone (aggregated), same run. Needs the vLLM stage in
# /tmp/site (docs/transport.md). Results land in $OUT; every engine is stopped before the end.
set -u
RATE=${RATE:-2} LOAD_S=${LOAD_S:-40}
source bench/gpu/pd_config.sh || exit 1
# aggregated = whole requests on every engine we started: one when both share GPU 0, else one per GPU
AGGREGATED=http://127.0.0.1:8200; [ "$PREFILL_GPU" != "$DECODE_GPU" ] && AGGREGATED=http://127.0.0.1:8100,http://127.0.0.1:8200
python3 -m pdserve up --config /tmp/pd.yaml > $OUT/up.log 2>&1 &
UP=$!
for _ in $(seq 450); do grep -q "^ready in" $OUT/up.log && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
tail -4 $OUT/up.log
python3 -m pdserve verify --config /tmp/pd.yaml --prompt-tokens 3072 2>&1 | tee $OUT/verify.txt
python3 -m pdserve verify --config /tmp/pd.yaml --prompt-tokens 3072 --json > $OUT/verify.json 2>&1
timeout 300 python3 -m pdserve bench run --target pd=http://127.0.0.1:8000 --target aggregated=$AGGREGATED \
  --model qwen3-8b --tokenizer /tmp/q8b/tokenizer.json --rate "$RATE" --duration "$LOAD_S" \
  --input-tokens 3072 --output-tokens 256 --ttft-slo-ms 2000 --itl-slo-ms 50 --out $OUT/bench 2>&1 | tail -30
curl -s http://127.0.0.1:8000/metrics | grep -E "^pdserve_(kv_handoff|engine_kv)" > $OUT/gateway-metrics.txt
kill -INT $UP; wait $UP
tar czf $OUT/engine-logs.tgz -C /tmp/pdlogs .
