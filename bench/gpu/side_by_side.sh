#!/bin/bash
# Issue #25, on one H200: Ray Serve LLM's own PD app (build_pd_openai_app, Ray 2.58) and pdserve, the same vLLM
# 0.26 engines (Qwen3-8B shape, dummy weights, 32 GiB of KV cache each, 128-token blocks, vLLM's default
# compilation), both engines sharing GPU 0, one system after the other, under the same Poisson workloads swept
# in rate: RATE for 3072 prompt tokens and exactly 256 output tokens, CHAT_RATE for shared-prefix chat (a
# 2048-token system prompt, 4 turns of 256 tokens in and 256 out). One device call per system (each fits its
# 600 s; a step that would not finish by DEADLINE_S, default 570, is skipped and says so):
#   SYSTEM=reference RATE=2,4,6,8 CHAT_RATE=4,8 LOAD_S=15 bash bench/gpu/side_by_side.sh
#   SYSTEM=pdserve   RATE=2,4,6,8 LOAD_S=15 bash bench/gpu/side_by_side.sh
#   SYSTEM=pdserve   RATE= RUNS=3 CHAT_RATE=4,8 LOAD_S=15 bash bench/gpu/side_by_side.sh
# REPEAT=3 runs each sweep three times (folders chat-1.., bench-1.., seeds 0..2): 3 runs at the knee with one rate each;
# FIRST_ROUND=3 runs only the third of them (a round a call's deadline left out, in a later call).
# The first start on a fresh machine compiles the hybrid's Triton kernels for minutes: the kernel cache (with vLLM's
# cached autotuning) goes back as $OUT/triton-cache.tgz, and a copy of it carried in .triton-cache/ (untracked)
# is unpacked before the engines start, so a later machine of the same card skips that compile.
# reference: Ray's fractional-GPU setup (bench/gpu/reference_start.py: bundles of {GPU: 0.45}); its time to
#   ready runs from `serve deploy` to RUNNING. pdserve: `pdserve up` (MPS, as it starts itself when two engines
#   share a GPU) with the same engine flags; its time to ready is its own "ready in". With RUNS, pdserve also
#   runs RUNS rounds of the decode engine alone (direct) against PD at DIRECT_RATE (DIRECT_WORKLOAD: 3072-token
#   completions, or chat: the chat sweep's shared-prefix conversations), for PD's TTFT cost, with
#   the gateway's and engines' counters around each (ttft-N/metrics-*.txt, for bench/gpu/ttft_split.py).
#   SHAPE (qwen3-8b; qwen3.5-9b: the hybrid) and KV_BYTES (pd_config.sh's) pick the model and its cache; COMPILE=
#   (empty) gives pdserve pd_config.sh's default compilation (decode CUDA graphs, no torch.compile) instead of vLLM's.
#   VERIFY=N runs `pdserve verify` N times against the pair after those runs (verify-N.txt).
#   Issue #42's PD cost over chat: SYSTEM=pdserve SHAPE=qwen3.5-9b KV_BYTES=12884901888 COMPILE= RATE= RUNS=3 DIRECT_WORKLOAD=chat
# CASE=reference runs the reference's own case instead: Qwen3.5-9B shape, max_model_len 4096, enforce_eager, 3 GiB of
# KV cache and an L4's share of the GPU per engine (bench/gpu/l4_share.sh), inter-token SLO 100 ms; REF_BATCHING_MS
# sets the reference's stream_batching_interval_ms (its docs' own knob; unset: Ray's 50 ms), REF_MPS=1 runs the reference's
# engines under CUDA MPS as pdserve runs its own (a daemon started before Ray, its default pipe directory), KV_BUFFER pdserve's. Both
# serve the text model only (the dummy folder has no image processor) and chat has 3 turns (a 4th passes 4096 tokens).
# Everything lands in $OUT/side-by-side-$SYSTEM.tgz (bench/, machine.txt: the card, CPU and load at the start and end,
# the KV transfer rate from the decode engine's own NIXL histograms, bench/gpu/kv_rate.py, ready.txt, logs); needs the
# vLLM stage in /tmp/site (../shared/gpu/README.md).
set -u
SYSTEM=${SYSTEM:?reference or pdserve} RATE=${RATE-2,4,6,8} CHAT_RATE=${CHAT_RATE:-} LOAD_S=${LOAD_S:-20}
DIRECT_WORKLOAD=${DIRECT_WORKLOAD:-completions} REPEAT=${REPEAT:-1} FIRST_ROUND=${FIRST_ROUND:-1} RUNS=${RUNS:-0} DIRECT_RATE=${DIRECT_RATE:-2} DIRECT_S=${DIRECT_S:-30} DEADLINE_S=${DEADLINE_S:-570} VERIFY=${VERIFY:-0}
SHAPE=${SHAPE:-qwen3-8b} ITL_SLO_MS=50 REF_ARGS="" TURNS=4
MODEL_DIR=/tmp/$SHAPE; [ "$SHAPE" = qwen3-8b ] && MODEL_DIR=/tmp/q8b  # as pd_config.sh names it
if [ "${CASE:-}" = reference ]; then
  SHAPE=qwen3.5-9b MODEL_DIR=/tmp/qwen3.5-9b ITL_SLO_MS=100 EAGER=1 MAX_LEN=4096 KV_BYTES=3221225472 MEM=l4 TURNS=3
  source bench/gpu/l4_share.sh
  REF_ARGS="--max-model-len 4096 --eager --kv-bytes 3221225472 --gpu-memory-utilization $L4_SHARE --gdn-prefill-backend triton --language-model-only --conv-state-layout DS"
fi
[ -n "${REF_BATCHING_MS:-}" ] && REF_ARGS="$REF_ARGS --batching-interval-ms $REF_BATCHING_MS"
CHAT_LOAD="--workload chat --prefix-tokens 2048 --input-tokens 256 --turns $TURNS" DIRECT_LOAD="--input-tokens 3072"
[ "$DIRECT_WORKLOAD" = chat ] && DIRECT_LOAD=$CHAT_LOAD
D=/tmp/side-by-side-$SYSTEM; rm -rf $D; mkdir -p $D
source bench/gpu/machine.sh
machine $D/machine.txt
TRITON=$HOME/.triton  # Triton's default cache folder (TRITON_CACHE_DIR unset), shared by both systems' engines
if [ -s .triton-cache/triton-cache.tgz ]; then
  mkdir -p $TRITON && tar xzf .triton-cache/triton-cache.tgz -C $TRITON && echo "Triton cache carried in" >> $D/machine.txt
fi
trap 'uptime >> $D/machine.txt; tar czf $OUT/side-by-side-$SYSTEM.tgz -C /tmp side-by-side-$SYSTEM
  [ -d $TRITON/cache ] && tar czf $OUT/triton-cache.tgz -C $TRITON cache' EXIT
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
say() { echo "[$SYSTEM $(date +%T)] $*"; }
# bench NEED_S NAME URL FOLDER FLAGS...: `pdserve bench run` of one target, if NEED_S seconds are left before
# DEADLINE_S (and cut off there); its results.md rows on stdout.
bench() {
  local need=$1 name=$2 url=$3 folder=$4 left=$((DEADLINE_S - SECONDS))
  shift 4
  [ $left -ge "$need" ] || { say "skipped $folder: ${left}s left of ${need}s needed"; return 1; }
  local flag=-t; [ "$name" = direct ] && flag=--engine-target  # an engine alone wants the engine key
  timeout $left python3 -m pdserve bench run $flag "$name=$url" --model $SHAPE --tokenizer $MODEL_DIR/tokenizer.json \
    --output-tokens 256 --ttft-slo-ms 2000 --itl-slo-ms $ITL_SLO_MS --duration "$LOAD_S" --out $D/$folder "$@" \
    > $D/$folder.log 2>&1
  grep -E "^\| $name " $D/$folder/results.md | sed "s|^|[$folder] |"
}
# each rate's load, then its longest requests draining
levels_s() { echo $(( $(echo "$1" | tr ',' '\n' | grep -c .) * (LOAD_S + 20) )); }
sweeps() {  # NAME URL: REPEAT rounds of the chat sweep (the reference's request type), then the synthetic sweep
  local round suffix
  for round in $(seq $FIRST_ROUND $REPEAT); do
    suffix=""; [ "$REPEAT" -gt 1 ] && suffix="-$round"
    [ -z "$CHAT_RATE" ] || bench "$(levels_s "$CHAT_RATE")" "$1" "$2" chat$suffix $CHAT_LOAD --rate "$CHAT_RATE" \
      --seed $((round - 1))
    [ -z "$RATE" ] || bench "$(levels_s "$RATE")" "$1" "$2" bench$suffix --input-tokens 3072 --rate "$RATE" --seed $((round - 1))
  done
}
case $SYSTEM in
reference)
  # Ray 2.58's OpenAI ingress answers every request 400 "Field required at ('query', 'self')" under FastAPI >= 0.137
  # (ray-project/ray#64475: < 0.137 works) and the stage carries 0.165, so this run installs 0.136.1
  # from a wheel carried in .whl (pip download fastapi==0.136.1, pure Python).
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/fastapi-0.136.1-*.whl \
    2>&1 | grep -v WARNING; python3 -c "import fastapi; print('fastapi', fastapi.__version__)"
  RAY="python3 -m ray.scripts.scripts"
  if [ "${REF_MPS:-0}" = 1 ]; then nvidia-cuda-mps-control -d && say "CUDA MPS daemon started for the reference"; fi
  python3 -m pdserve demo-model $MODEL_DIR --shape $SHAPE > /dev/null || exit 1
  $RAY start --head --node-ip-address 127.0.0.1 --num-gpus 1 --num-cpus 16 --dashboard-port 8265 \
    --metrics-export-port 8090 --disable-usage-stats > $D/ray-start.log 2>&1 || { tail -20 $D/ray-start.log; exit 1; }
  python3 bench/gpu/reference_start.py --model-dir $MODEL_DIR --served-name $SHAPE $REF_ARGS --out $D/reference.json --timeout-s 400 \
    > $D/ready.txt 2>&1; tail -2 $D/ready.txt
  grep -q '"status": "RUNNING"' $D/ready.txt && sweeps reference http://127.0.0.1:8000
  sleep 10  # Ray's agent exports what the replicas reported up to its last interval
  curl -s http://127.0.0.1:8090/metrics > $D/ray-metrics.txt
  python3 bench/gpu/kv_rate.py $D/ray-metrics.txt | tee $D/kv-rate.json
  $RAY stop --force > /dev/null 2>&1
  [ "${REF_MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control
  tar czf $D/ray-logs.tgz -C /tmp/ray session_latest/logs 2>/dev/null ;;
pdserve)
  PORT=9000 COMPILE=${COMPILE-vllm} LOG_DIR=/tmp/sbs-logs  # CASE=reference: EAGER=1 above outweighs COMPILE
  source bench/gpu/pd_config.sh > $D/config.log 2>&1 || { cat $D/config.log; exit 1; }
  cp $CONFIG $D/pd.yaml
  # the engines' key, known to this script's direct runs and metric reads (pdserve up would make its own)
  export PDSERVE_ENGINE_KEY=${PDSERVE_ENGINE_KEY:-$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')}
  python3 -m pdserve up --config $CONFIG > $D/up.log 2>&1 &
  UP=$!
  for _ in $(seq 420); do grep -q "^ready in" $D/up.log && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
  grep -E "^ready in" $D/up.log | tee $D/ready.txt
  if [ -s $D/ready.txt ]; then
    source bench/gpu/metrics.sh
    GATEWAY=http://127.0.0.1:$PORT PREFILL=http://127.0.0.1:$((PORT + 100)) DECODE=http://127.0.0.1:$((PORT + 200))
    for run in $(seq $RUNS); do  # direct, then PD, the same arrivals; the counters around both
      metrics_around $D/ttft-$run $GATEWAY $PREFILL $DECODE -- \
        bench $((2 * (DIRECT_S + 10))) direct $DECODE ttft-$run/bench -t pd=$GATEWAY $DIRECT_LOAD \
        --rate "$DIRECT_RATE" --duration $DIRECT_S --seed $run
      grep -E "^\| pd " $D/ttft-$run/bench/results.md | sed "s/^/[run $run] /"
    done
    for v in $(seq $VERIFY); do  # `pdserve verify` against the running pair: content and speed of the KV path
      [ $((DEADLINE_S - SECONDS)) -ge 40 ] || { say "skipped verify $v: too little time left"; break; }
      timeout 40 python3 -m pdserve verify --config $CONFIG --prompt-tokens 3072 > $D/verify-$v.txt 2>&1
      say "verify $v: exit $?"; grep -vE "^\s*$" $D/verify-$v.txt | tail -3
    done
    sweeps pdserve $GATEWAY
    curl -s -H "Authorization: Bearer $PDSERVE_ENGINE_KEY" $DECODE/metrics > $D/decode-metrics.txt
    python3 bench/gpu/kv_rate.py $D/decode-metrics.txt | tee $D/kv-rate.json
    python3 bench/gpu/kv_rate.py $LOG_DIR/decode-*.log > $D/kv-rate-from-log.json  # the same, a cross-check
    curl -s $GATEWAY/metrics | grep -E "^pdserve_(first_tokens|kv_handoff_seconds_(sum|count))" \
      > $D/gateway-metrics.txt
  else
    say "not ready; last lines of up.log:"; tail -15 $D/up.log
  fi
  kill -INT $UP 2>/dev/null; wait $UP
  tar czf $D/engine-logs.tgz -C $LOG_DIR . ;;
esac
