#!/bin/bash
# The raw-transfer steps of docs/transport.md on the H200 machine, from the repo root: the hardware's copy
# limits (hw) and NIXL agent to agent, with what UCX sees and why (nixl). No model, no vLLM engine; the
# engine runs are pdserve_h200.sh (up + verify) and compare_h200.sh (bench compare).
# usage: bash bench/gpu/run_device.sh hw|nixl   (nixl needs the vLLM stage unpacked to /tmp/site)
# Every result goes to $OUT (at most 8 files come back).
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
esac
