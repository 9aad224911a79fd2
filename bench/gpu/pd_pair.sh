#!/bin/bash
# One prefill/decode pair through pdserve on the GPU machine, as a user runs it: `pdserve up` of the plain
# config that pd_config.sh writes (no model-specific flags), `pdserve verify` (PD output == local, handoff
# size and speed), then, with RATE set, `pdserve bench run` of whole requests on the decode engine alone
# (direct) against PD through the gateway, same arrivals. Several pairs can run at once on different GPUs:
# give each its own NAME, PORT, SIDE_PORT. Needs the vLLM stage in /tmp/site (docs/transport.md).
#   NAME=q35 SHAPE=qwen3.5-9b PREFILL_GPU=1 DECODE_GPU=1 PORT=9000 SIDE_PORT=5700 RATE=2 LOAD_S=60 bash bench/gpu/pd_pair.sh
# WAYS=pd skips the direct run (for load past what one engine serves). Everything lands in $OUT/$NAME.tgz
# (up.log, verify.*, bench/, metrics samples, engine logs); a summary goes to stdout. Every engine is
# stopped before the end.
set -u
NAME=${NAME:-pair} RATE=${RATE:-} LOAD_S=${LOAD_S:-60} READY_S=${READY_S:-420}
D=/tmp/$NAME-out; rm -rf $D; mkdir -p $D
# VARIANT: a change tried against the defaults, by hand and for measurement only (pdserve's config has no
# field for either yet).
#   xlayer: vLLM's cross-layer KV blocks (one NIXL descriptor per block for all layers), which NixlConnector
#           honours only on vLLM's V1 model runner; the whole --kv-transfer-config is restated (the last wins).
#   sync:   no asynchronous scheduling on the decode engine, whose scheduler then sees a finished KV pull one
#           step sooner.
xlayer_kv() { echo '"--kv-transfer-config", "{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_'$1'\", \"engine_id\": \"xlayer-'$1'-'$NAME'\", \"kv_buffer_device\": \"cuda\", \"kv_connector_extra_config\": {\"backends\": [\"UCX\"], \"enable_cross_layers_blocks\": \"true\"}}"'; }
case "${VARIANT:-}" in
  xlayer) ENGINE_ENV='{VLLM_USE_V2_MODEL_RUNNER: "0"}' PREFILL_ARGS=$(xlayer_kv producer) DECODE_ARGS=$(xlayer_kv consumer) ;;
  sync) DECODE_ARGS='"--no-async-scheduling"' ;;
esac
CONFIG=/tmp/$NAME.yaml LOG_DIR=/tmp/$NAME-logs
source bench/gpu/pd_config.sh > $D/config.log 2>&1 || { cat $D/config.log; exit 1; }
source bench/gpu/metrics.sh
cp $CONFIG $D/pd.yaml
GATEWAY=http://127.0.0.1:$PORT PREFILL=http://127.0.0.1:$((PORT + 100)) DECODE=http://127.0.0.1:$((PORT + 200))
say() { echo "[$NAME $(date +%T)] $*"; }
python3 -m pdserve up --config $CONFIG > $D/up.log 2>&1 &
UP=$!
for _ in $(seq $READY_S); do grep -q "^ready in" $D/up.log && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
say "$(grep -E '^ +model +|^ready in' $D/up.log | tr -s ' ' | tr '\n' ' ')"
if grep -q "^ready in" $D/up.log; then
  python3 -m pdserve verify --config $CONFIG --prompt-tokens 3072 > $D/verify.txt 2>&1
  python3 -m pdserve verify --config $CONFIG --prompt-tokens 3072 --json > $D/verify.json 2>&1
  say "verify: $(tail -1 $D/verify.txt)"
  tar czf $OUT/$NAME.tgz -C /tmp $NAME-out  # what is there so far, should the call run out of time
  if [ -n "$RATE" ]; then
    # Counters of the gateway and both engines around the load (bench/gpu/metrics.sh) for ttft_split.py.
    [ "${WAYS:-direct,pd}" = pd ] && TARGETS="--target pd=$GATEWAY" || TARGETS="--target direct=$DECODE --target pd=$GATEWAY"
    metrics_around $D $GATEWAY $PREFILL $DECODE -- timeout 400 python3 -m pdserve bench run $TARGETS --model $SHAPE \
      --tokenizer $MODEL_DIR/tokenizer.json --rate "$RATE" --duration "$LOAD_S" --input-tokens 3072 \
      --output-tokens 256 --ttft-slo-ms 2000 --itl-slo-ms 50 --out $D/bench > $D/bench.log 2>&1
    grep -E "^\| (direct|pd) " $D/bench/results.md | sed "s/^/[$NAME] /"
  fi
else
  say "not ready; last lines of up.log:"; tail -15 $D/up.log
fi
kill -INT $UP 2>/dev/null; wait $UP
grep -h "KV Transfer metrics" $LOG_DIR/decode-*.log | sed 's/.*KV Transfer metrics/KV Transfer metrics/' \
  > $D/decode-kv-transfer-metrics.txt
say "decode NIXL windows: $(wc -l < $D/decode-kv-transfer-metrics.txt)"; tail -3 $D/decode-kv-transfer-metrics.txt
tar czf $D/engine-logs.tgz -C $LOG_DIR .
tar czf $OUT/$NAME.tgz -C /tmp $NAME-out
