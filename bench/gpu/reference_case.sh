#!/bin/bash
# The reference's own engines on one GPU (Qwen3.5-9B shape, dummy weights, max_model_len 4096, enforce_eager,
# bf16, each engine held to an L4's 0.90 x 24 GB), from the repo root with the vLLM stage in /tmp/site:
# `pdserve up` and RUNS `pdserve verify` with the KV staged in host memory (as pdserve runs g6 nodes), then the
# same with the KV buffer in GPU memory, for its GB/s beside. KV_BYTES: KV cache per engine (none, the default:
# what the L4's share leaves beside the weights, as vLLM sizes it; pdserve sizes --max-num-seqs itself).
# Everything lands in $OUT/reference-case.tgz and $OUT/*.txt (machine.txt: the card, CPU and load at the start and end).
set -u
RUNS=${RUNS:-3} KV_BYTES=${KV_BYTES:-none}
FINAL_OUT=$OUT
source bench/gpu/machine.sh
machine "$FINAL_OUT/machine.txt"
trap 'machine "$FINAL_OUT/machine.txt"' EXIT  # the load at the end too
for buffer in ${BUFFERS:-cpu cuda}; do
  mkdir -p /tmp/reference-case/$buffer
  OUT=/tmp/reference-case/$buffer SHAPE=qwen3.5-9b KV_BUFFER=$buffer EAGER=1 MAX_LEN=4096 MEM=l4 KV_BYTES=$KV_BYTES \
    RUNS=$RUNS BROKEN=0 LOG_DIR=/tmp/reference-case/$buffer/logs bash bench/gpu/verify_h200.sh \
    > "$FINAL_OUT/verify-kv-$buffer.txt" 2>&1
  echo "== KV buffer $buffer"; grep -hE "verify [0-9]: exit|GB/s|PD == local|^ready in|Error|error" \
    "$FINAL_OUT/verify-kv-$buffer.txt" /tmp/reference-case/$buffer/*verify* 2>/dev/null | head -30
done
tar czf "$FINAL_OUT/reference-case.tgz" -C /tmp reference-case
