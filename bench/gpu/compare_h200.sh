#!/bin/bash
# `pdserve bench compare` on the GPU machine: it starts the engines of /tmp/pd.yaml itself and runs
# the same Poisson workload (3072-token prompts, 256-token outputs) against each way of serving,
# level by level, then reports the KV handoff bandwidth from the decode engine's own counters.
# Needs the vLLM stage in /tmp/site (docs/transport.md). Results land in $OUT.
#   two GPUs: PREFILL_GPU=0 DECODE_GPU=1 MEM=0.8 RATE=12,14,16 LOAD_S=15 NAME=h200x2-compare bash bench/gpu/compare_h200.sh
# docs/benchmarks.md and docs/transport.md give the exact environment of every quoted run.
set -u
RATE=${RATE:-2,4,8} LOAD_S=${LOAD_S:-20} WAYS=${WAYS:-aggregated,disaggregated} NAME=${NAME:-compare}
source bench/gpu/pd_config.sh || exit 1
mkdir -p $OUT/$NAME; rm -rf .pdserve/bench-logs
timeout -k 20 ${STEP_TIMEOUT_S:-540} python3 -m pdserve bench compare --config /tmp/pd.yaml --ways "$WAYS" \
  --rate "$RATE" --duration "$LOAD_S" --input-tokens 3072 --output-tokens 256 --ttft-slo-ms 2000 --itl-slo-ms 50 \
  --out $OUT/$NAME > $OUT/$NAME/compare.log 2>&1
echo "exit $?"; grep -v "━" $OUT/$NAME/compare.log | tail -25
# vLLM's own per-interval NIXL telemetry (descriptors and post time per handoff), and the MPS daemon's log
grep -h "KV Transfer metrics" .pdserve/bench-logs/decode-*.log | sed 's/.*KV Transfer metrics/KV Transfer metrics/' \
  > $OUT/$NAME/decode-kv-transfer-metrics.txt
[ -f .pdserve/bench-logs/mps/control.log ] && cp .pdserve/bench-logs/mps/control.log $OUT/$NAME/mps-control.log
tar czf $OUT/$NAME/engine-logs.tgz -C .pdserve/bench-logs .
