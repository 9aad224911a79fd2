#!/bin/bash
# `pdserve verify` on one H200, both engines on GPU 0 under MPS (Qwen3-8B shape, dummy weights), from the repo
# root with the vLLM stage in /tmp/site: RUNS verifies of the default setup, each of which must pass, then
# (BROKEN=1) one of a deliberately broken path, KV staged in host memory and moved over UCX's TCP, which must
# fail and say why. CROSS_LAYER (auto, on, off) sets kv.cross_layer_blocks. Everything lands in $OUT.
set -u
RUNS=${RUNS:-5} BROKEN=${BROKEN:-1}
up_and_verify() {  # NAME CONFIG LOG_DIR RUNS
  python3 -m pdserve up --config "$2" > "$OUT/$1-up.log" 2>&1 &
  local up=$!
  for _ in $(seq 420); do grep -q "^ready in" "$OUT/$1-up.log" && break; kill -0 $up 2>/dev/null || break; sleep 1; done
  grep -E "^ready in|loading|error" "$OUT/$1-up.log" | tail -6
  for run in $(seq "$4"); do
    python3 -m pdserve verify --config "$2" --prompt-tokens 3072 > "$OUT/$1-verify-$run.txt" 2>&1
    echo "$1 verify $run: exit $?"; grep -vE "^\s*$" "$OUT/$1-verify-$run.txt" | tail -4
  done
  grep -hE "Allocating a cross layer KV cache|enable_cross_layers_blocks|Backend .* was instantiated" "$3"/*.log \
    | sort | uniq -c | head -6
  kill -INT $up; wait $up
}
source bench/gpu/pd_config.sh || exit 1
up_and_verify healthy "$CONFIG" "$LOG_DIR" "$RUNS"
if [ "$BROKEN" = 1 ]; then
  KV_BUFFER=cpu ENGINE_ENV='{UCX_TLS: "tcp,self"}' CONFIG=/tmp/pd-broken.yaml LOG_DIR=/tmp/pdlogs-broken \
    source bench/gpu/pd_config.sh || exit 1
  up_and_verify broken /tmp/pd-broken.yaml /tmp/pdlogs-broken 1
fi
tar czf "$OUT/engine-logs.tgz" -C /tmp $(cd /tmp && ls -d pdlogs*)
