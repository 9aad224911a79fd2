#!/bin/bash
# A client's first chat after `pdserve up` against its second, on CPU engines with the tiny hybrid (a hybrid's chat
# asks its prefill engine for logprobs, whose first use an engine pays once): with the gateway's chat warm-up
# (gateway/readiness.py) the two should take alike. One start per call; its lines go to stdout:
#   bash bench/first_chat_cpu.sh > docs/results/cpu-chat-warm-up/after-1.txt
# Ports 8300 (gateway), 8310, 8320 and NIXL side channels from 5650; the model is built once in .pdserve/first-chat.
set -u
DIR=.pdserve/first-chat BIN=.venv/bin
echo "# $(date -u) $(uptime) $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- pdserve || echo ' (changed)')"
lscpu | grep "Model name"
[ -f $DIR/model/config.json ] || $BIN/python -m pdserve demo-model $DIR/model --shape qwen3-next-tiny --random-weights \
  > /dev/null || exit 1
cat > $DIR/pd.yaml <<YAML
model: {path: $DIR/model, served_name: hybrid, max_model_len: 1024}
gateway: {port: 8300}
prefill: {base_port: 8310}
decode: {base_port: 8320}
kv: {side_channel_base_port: 5650}
launch: {log_dir: $DIR/logs}
YAML
$BIN/pdserve up --config $DIR/pd.yaml > $DIR/up.log 2>&1 &
UP=$!
for _ in $(seq 300); do grep -q "^ready in" $DIR/up.log && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
grep "^ready in" $DIR/up.log || { tail -20 $DIR/up.log; kill -INT $UP; exit 1; }
$BIN/python bench/gpu/first_requests.py --prefill http://127.0.0.1:8310 --gateway http://127.0.0.1:8300 --model hybrid \
  --words 60 --gateway-only
curl -s http://127.0.0.1:8300/metrics | grep "^pdserve_first_tokens_total"
kill -INT $UP; wait $UP
