#!/bin/bash
# Issue #56 in one device call: pdserve on the vLLM the stage carries (../shared/gpu/README.md; vLLM 0.32.0, NIXL 1.5.1,
# in /tmp/site), both shapes one after the other on one GPU, each `pdserve up` once: RUNS rounds of streamed chat
# against the decode engine alone (bench/gpu/side_by_side.sh's RUNS, DIRECT_S seconds each) and VERIFY verifies.
# Qwen3-8B keeps the KV buffer pdserve picks on the GPU (cuda); the Qwen3.5-9B hybrid stages it in host memory
# (KV_BUFFER=cpu), the reference's case. Builds the C relay first, as a user's `pip install` would (said if it cannot).
# Each shape's folder comes back as $OUT/<shape>.tgz; a shape that would not finish by the call's end is cut by its
# own timeout so that what it measured still comes back.
#   RUNS=1 DIRECT_S=20 bash bench/gpu/current_engines.sh
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
RUNS=${RUNS:-1} DIRECT_S=${DIRECT_S:-20} VERIFY=${VERIFY:-1} CALL_S=${CALL_S:-585}
if python3 setup.py build_ext --inplace > $OUT/build-ext.log 2>&1; then echo "C relay built"
else echo "C relay NOT built (chunks relayed in Python):"; tail -3 $OUT/build-ext.log; fi
python3 -c "import vllm, nixl, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
shape() {  # SHAPE SECONDS ENV...: one side_by_side.sh run of SHAPE, cut at SECONDS
  local name=$1 limit=$2
  shift 2
  env "$@" SYSTEM=pdserve SHAPE=$name KV_BYTES=12884901888 COMPILE= RATE= RUNS=$RUNS DIRECT_S=$DIRECT_S \
    DIRECT_WORKLOAD=chat VERIFY=$VERIFY DEADLINE_S=$((limit - 15)) timeout -s INT -k 20 $limit bash bench/gpu/side_by_side.sh
  mv $OUT/side-by-side-pdserve.tgz $OUT/$name.tgz 2>/dev/null
  pkill -INT -f "pdserve up"; sleep 5; pkill -9 -f vllm.entrypoints; pkill -9 -f "pdserve up"; sleep 2
}
shape qwen3-8b ${EIGHT_B_S:-230}
shape qwen3.5-9b $((CALL_S - SECONDS)) KV_BUFFER=cpu
