#!/bin/bash
# The device-side steps of docs/transport.md, one per `run` call on the H200 machine, from the repo root.
# usage: bash bench/gpu/run_device.sh hw|nixl|vllm   (nixl and vllm need the vLLM stage unpacked to /tmp/site)
# Every result goes to $OUT (at most 8 files come back); engine logs travel as one tarball.
set -u
export PYTHONUNBUFFERED=1
MB="python3 -m pdserve.verify.microbench"
GETZ=UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
case "$1" in
hw)  # hardware limits: no NIXL, no vLLM (torch only)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi nvlink -s 2>&1 | head -8; nvidia-smi topo -m 2>&1 | head -4
  $MB --size-mb 452 --block-kb 32 --path host-memcpy --path device-copy --path pinned-h2d --path pinned-d2h \
      --path cuda-ipc --path cuda-ipc-gather 2>&1 | tee $OUT/hw_32k.txt
  $MB --size-mb 452 --block-kb 2304 --path cuda-ipc-gather 2>&1 | tee $OUT/hw_2304k.txt ;;
nixl)  # what UCX sees and why, then NIXL agent-to-agent transfers, per-layer (32 KiB) and cross-layer (2.25 MiB) blocks
  export PYTHONPATH=/tmp/site
  python3 bench/gpu/ucx_check.py > $OUT/ucx_check.txt 2>&1; head -70 $OUT/ucx_check.txt
  UCX_LOG_LEVEL=debug python3 bench/gpu/ucx_check.py 2>&1 | grep -iE "nvlink|zcopy|nvml|cuda_ipc" | head -40 \
      > $OUT/ucx_debug.txt; cat $OUT/ucx_debug.txt
  $MB --size-mb 16 --block-kb 32 --repeats 1 --timeout-s 60 --path "nixl-vram UCX_PROTO_INFO=y" \
      --path "nixl-vram UCX_PROTO_INFO=y $GETZ" > $OUT/proto.txt 2>&1
  grep -B1 -A5 "remote memory read" $OUT/proto.txt | grep -vE "^--$" | head -40; tail -4 $OUT/proto.txt
  $MB --size-mb 452 --block-kb 32 --timeout-s 100 --path "nixl-vram $GETZ" --path "nixl-vram op=WRITE" \
      --path "nixl-vram $GETZ threads=0" --path nixl-dram 2>&1 | grep -v "NIXL INFO" | tee $OUT/nixl_32k.txt
  $MB --size-mb 452 --block-kb 2304 --timeout-s 100 --path "nixl-vram $GETZ" --path "nixl-vram op=WRITE" \
      --path nixl-dram 2>&1 | grep -v "NIXL INFO" | tee $OUT/nixl_2304k.txt ;;
vllm)  # PD pair vs aggregated engine, Qwen3-8B shape, dummy weights, both PD engines on the one GPU
  export PYTHONPATH=/tmp/site
  ENGINE="--gpu-memory-utilization 0.4 --kv-cache-memory-bytes 34359738368"
  GRAPHS='--compilation-config {"mode":0,"cudagraph_mode":"FULL_DECODE_ONLY","cudagraph_capture_sizes":[1,2,4,8,16,24,32,48,64]}'
  mkdir -p /tmp/hrun
  timeout -k 20 ${VLLM_STEP_TIMEOUT_S:-540} python3 bench/gpu/handoff.py --out /tmp/hrun ${PD_CONFIGS:---pd pull-ipc-xlayer-v1 --pd pull-ipc --pd pull-host-xlayer} \
      --duration-s ${LOAD_S:-50} --budget-s ${BUDGET_S:-380} --engine-args "$ENGINE $GRAPHS" \
      --fallback-engine-args "$ENGINE --enforce-eager" 2>&1 | tee $OUT/handoff.txt
  for pgid in $(cat /tmp/hrun/engine-pgids 2>/dev/null); do kill -9 -- -"$pgid" 2>/dev/null; done
  cp /tmp/hrun/results.json $OUT/ 2>/dev/null
  tar czf $OUT/engine-logs.tgz -C /tmp/hrun --exclude results.json . ;;
esac
