#!/bin/bash
# Issue #25, on one H200: Ray Serve LLM's own PD app (build_pd_openai_app, Ray 2.58) and pdserve, the same vLLM
# 0.26 engines (Qwen3-8B shape, dummy weights, 32 GiB of KV cache each, 128-token blocks, vLLM's default
# compilation), both engines sharing GPU 0, one system after the other, under the same Poisson workload (3072
# prompt tokens, exactly 256 output tokens) swept in rate. One device call per system (each fits its 600 s):
#   SYSTEM=reference RATE=2,4,6,8 LOAD_S=20 bash bench/gpu/side_by_side.sh
#   SYSTEM=pdserve   RATE=2,4,6,8 LOAD_S=20 bash bench/gpu/side_by_side.sh
#   SYSTEM=pdserve   RATE= RUNS=3 bash bench/gpu/side_by_side.sh
# reference: Ray's fractional-GPU setup (bench/gpu/reference_start.py: bundles of {GPU: 0.45}); its time to
#   ready runs from `serve deploy` to RUNNING. pdserve: `pdserve up` (MPS, as it starts itself when two engines
#   share a GPU) with the same engine flags; its time to ready is its own "ready in". With RUNS, pdserve also
#   runs RUNS rounds of the decode engine alone (direct) against PD at DIRECT_RATE, for PD's TTFT cost.
# Everything lands in $OUT/side-by-side-$SYSTEM.tgz (bench/, the engines' KV transfer rate from their own "KV
# Transfer metrics" log lines, ready.txt, logs); needs the vLLM stage in /tmp/site (../shared/gpu/README.md).
set -u
SYSTEM=${SYSTEM:?reference or pdserve} RATE=${RATE-2,4,6,8} LOAD_S=${LOAD_S:-20} RUNS=${RUNS:-0} DIRECT_RATE=${DIRECT_RATE:-2}
D=/tmp/side-by-side-$SYSTEM; rm -rf $D; mkdir -p $D
trap 'tar czf $OUT/side-by-side-$SYSTEM.tgz -C /tmp side-by-side-$SYSTEM' EXIT
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
BENCH="python3 -m pdserve bench run --model qwen3-8b --tokenizer /tmp/q8b/tokenizer.json --input-tokens 3072
  --output-tokens 256 --ttft-slo-ms 2000 --itl-slo-ms 50"
say() { echo "[$SYSTEM $(date +%T)] $*"; }
case $SYSTEM in
reference)
  # Ray 2.58's OpenAI ingress answers every request 400 "Field required at ('query', 'self')" under FastAPI >= 0.137
  # (ray-project/ray#64475: < 0.137 works) and the stage carries 0.165, so this run installs 0.136.1
  # from a wheel carried in .whl (pip download fastapi==0.136.1, pure Python).
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/fastapi-0.136.1-*.whl \
    2>&1 | grep -v WARNING; python3 -c "import fastapi; print('fastapi', fastapi.__version__)"
  RAY="python3 -m ray.scripts.scripts"
  python3 -m pdserve demo-model /tmp/q8b --shape qwen3-8b > /dev/null || exit 1
  $RAY start --head --node-ip-address 127.0.0.1 --num-gpus 1 --num-cpus 16 --dashboard-port 8265 \
    --disable-usage-stats > $D/ray-start.log 2>&1 || { tail -20 $D/ray-start.log; exit 1; }
  python3 bench/gpu/reference_start.py --model-dir /tmp/q8b --out $D/reference.json --timeout-s 400 \
    > $D/ready.txt 2>&1; tail -2 $D/ready.txt
  if grep -q '"status": "RUNNING"' $D/ready.txt; then
    timeout 300 $BENCH -t reference=http://127.0.0.1:8000 --rate "$RATE" --duration "$LOAD_S" --out $D/bench \
      > $D/bench.log 2>&1; grep -E "^\| reference " $D/bench/results.md
  fi
  python3 bench/gpu/kv_log_rate.py $(grep -rl "KV Transfer metrics" /tmp/ray/session_latest/logs/ 2>/dev/null) \
    | tee $D/kv-rate.json
  $RAY stop --force > /dev/null 2>&1
  tar czf $D/ray-logs.tgz -C /tmp/ray session_latest/logs 2>/dev/null ;;
pdserve)
  PORT=9000 COMPILE=vllm LOG_DIR=/tmp/sbs-logs
  source bench/gpu/pd_config.sh > $D/config.log 2>&1 || { cat $D/config.log; exit 1; }
  cp $CONFIG $D/pd.yaml
  python3 -m pdserve up --config $CONFIG > $D/up.log 2>&1 &
  UP=$!
  for _ in $(seq 420); do grep -q "^ready in" $D/up.log && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
  grep -E "^ready in" $D/up.log | tee $D/ready.txt
  if [ -s $D/ready.txt ]; then
    if [ -n "$RATE" ]; then
      timeout 300 $BENCH -t pdserve=http://127.0.0.1:$PORT --rate "$RATE" --duration "$LOAD_S" --out $D/bench \
        > $D/bench.log 2>&1; grep -E "^\| pdserve " $D/bench/results.md
      python3 bench/gpu/kv_log_rate.py $LOG_DIR/decode-*.log | tee $D/kv-rate.json
    fi
    for run in $(seq $RUNS); do
      timeout 200 $BENCH -t direct=http://127.0.0.1:$((PORT + 200)) -t pd=http://127.0.0.1:$PORT \
        --rate "$DIRECT_RATE" --duration ${DIRECT_S:-30} --seed $run --out $D/ttft-$run > $D/ttft-$run.log 2>&1
      grep -E "^\| (direct|pd) " $D/ttft-$run/results.md | sed "s/^/[run $run] /"
    done
    curl -s http://127.0.0.1:$PORT/metrics | grep -E "^pdserve_(prefill_first_tokens|kv_handoff_seconds_(sum|count))" \
      > $D/gateway-metrics.txt
  else
    say "not ready; last lines of up.log:"; tail -15 $D/up.log
  fi
  kill -INT $UP 2>/dev/null; wait $UP
  tar czf $D/engine-logs.tgz -C $LOG_DIR . ;;
esac
