# Sourced by the GPU scripts: writes a model folder of SHAPE (qwen3-8b or qwen3.5-9b; /tmp/SHAPE, no weights:
# the engines run with --load-format dummy) and the pdserve config CONFIG (/tmp/pd.yaml) for PREFILL_GPU,
# DECODE_GPU, MEM (GPU memory share; l4: an L4's, bench/gpu/l4_share.sh), KV_BYTES (KV cache per engine; default 32 GiB;
# none: what the memory share leaves, as vLLM sizes it), MAX_LEN (max_model_len;
# default 8192), EAGER (1: the reference's enforce_eager, no CUDA graphs), COMPILE (vllm: vLLM's default compilation), MPS (auto, on, off), KV_BLOCK (tokens per KV block; unset: pdserve's GPU
# default, 128), KV_BUFFER (auto, cpu, cuda), CROSS_LAYER (kv.cross_layer_blocks: auto, on, off), ENGINE_ENV (a YAML mapping of extra engine environment, applied
# last; DECODE_ENV: the decode pool's in its place, e.g. '{CUDA_MPS_CLIENT_PRIORITY: "1"}', MPS's below-normal
# priority for its kernels), PREFILL_ARGS / DECODE_ARGS (extra vLLM args of one pool, as JSON list items: '"--flag", "value"'),
# PORT (gateway; engines at PORT+100 and PORT+200), SIDE_PORT (first NIXL side channel), LOG_DIR and MODEL_DIR, then
# validates it, so a bad setting fails here and not after the engines' minutes of start-up.
# Nothing model-specific is set by hand: pdserve reads the shape's config.json (a hybrid model gets its
# flags from pdserve/engines/model_layout.py).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
PREFILL_GPU=${PREFILL_GPU:-0} DECODE_GPU=${DECODE_GPU:-0} MEM=${MEM:-0.4} SHAPE=${SHAPE:-qwen3-8b}
CONFIG=${CONFIG:-/tmp/pd.yaml} PORT=${PORT:-8000} SIDE_PORT=${SIDE_PORT:-5600} LOG_DIR=${LOG_DIR:-/tmp/pdlogs}
DEFAULT_MODEL_DIR=/tmp/$SHAPE; [ "$SHAPE" = qwen3-8b ] && DEFAULT_MODEL_DIR=/tmp/q8b
MODEL_DIR=${MODEL_DIR:-$DEFAULT_MODEL_DIR}
if [ "$MEM" = l4 ]; then source bench/gpu/l4_share.sh; MEM=$L4_SHARE; fi
python3 -m pdserve demo-model $MODEL_DIR --shape $SHAPE || return 1
# A fixed KV cache per engine (KV_BYTES, 32 GiB); unless COMPILE=vllm (vLLM's own torch.compile and CUDA graphs)
# or EAGER=1 (neither), no torch.compile and full CUDA graphs for decode batches up to 256.
# pdserve adds --block-size 128 to GPU engines itself, and starts CUDA MPS when both share a GPU.
ENGINE='"--load-format", "dummy", "--gpu-memory-utilization", "'$MEM'"'
[ "${KV_BYTES:-}" = none ] || ENGINE="$ENGINE"', "--kv-cache-memory-bytes", "'${KV_BYTES:-34359738368}'"'
if [ "${EAGER:-0}" = 1 ]; then ENGINE="$ENGINE"', "--enforce-eager"'
elif [ "${COMPILE:-}" != vllm ]; then ENGINE="$ENGINE"', "--compilation-config",
  "{\"mode\":0,\"cudagraph_mode\":\"FULL_DECODE_ONLY\",\"cudagraph_capture_sizes\":[1,2,4,8,16,24,32,48,64,96,128,192,256]}"'; fi
cat > $CONFIG <<YAML
model: {path: $MODEL_DIR, served_name: $SHAPE, max_model_len: ${MAX_LEN:-8192}}
prefill: {device: cuda, gpu_ids: [$PREFILL_GPU], base_port: $((PORT + 100)), extra_args: [$ENGINE${PREFILL_ARGS:+, $PREFILL_ARGS}], env: ${ENGINE_ENV:-{\}}}
decode: {device: cuda, gpu_ids: [$DECODE_GPU], base_port: $((PORT + 200)), extra_args: [$ENGINE${DECODE_ARGS:+, $DECODE_ARGS}], env: ${DECODE_ENV:-${ENGINE_ENV:-{\}}}}
gateway: {port: $PORT}
launch: {log_dir: $LOG_DIR, ready_timeout_s: 420, mps: "${MPS:-auto}"}
kv: {${KV_BLOCK:+block_size: $KV_BLOCK, }${CROSS_LAYER:+cross_layer_blocks: $CROSS_LAYER, }buffer_device: ${KV_BUFFER:-auto}, side_channel_base_port: $SIDE_PORT}
YAML
python3 -m pdserve config validate $CONFIG || return 1
