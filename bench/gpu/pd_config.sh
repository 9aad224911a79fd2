# Sourced by the GPU scripts: writes the Qwen3-8B-shaped model folder (/tmp/q8b, no weights: the engines
# run with --load-format dummy) and the pdserve config /tmp/pd.yaml for PREFILL_GPU, DECODE_GPU, MEM (GPU
# memory share), MPS (auto, on, off), KV_BLOCK (tokens per KV block; unset: pdserve's GPU default, 128),
# KV_BUFFER (auto, cpu, cuda) and ENGINE_ENV (a YAML mapping of extra engine environment, applied last),
# then validates it, so a bad setting fails here and not after the engines' minutes of start-up.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
PREFILL_GPU=${PREFILL_GPU:-0} DECODE_GPU=${DECODE_GPU:-0} MEM=${MEM:-0.4}
python3 -m pdserve demo-model /tmp/q8b --shape qwen3-8b || return 1
# A fixed 32 GiB of KV cache per engine, no torch.compile, full CUDA graphs for decode batches up to 256.
# pdserve adds --block-size 128 to GPU engines itself, and starts CUDA MPS when both share a GPU.
ENGINE='["--load-format", "dummy", "--gpu-memory-utilization", "'$MEM'", "--kv-cache-memory-bytes", "34359738368",
  "--compilation-config",
  "{\"mode\":0,\"cudagraph_mode\":\"FULL_DECODE_ONLY\",\"cudagraph_capture_sizes\":[1,2,4,8,16,24,32,48,64,96,128,192,256]}"]'
cat > /tmp/pd.yaml <<YAML
model: {path: /tmp/q8b, served_name: qwen3-8b, max_model_len: 8192}
prefill: {device: cuda, gpu_ids: [$PREFILL_GPU], extra_args: $ENGINE, env: ${ENGINE_ENV:-{\}}}
decode: {device: cuda, gpu_ids: [$DECODE_GPU], extra_args: $ENGINE, env: ${ENGINE_ENV:-{\}}}
launch: {log_dir: /tmp/pdlogs, ready_timeout_s: 420, mps: "${MPS:-auto}"}
kv: {${KV_BLOCK:+block_size: $KV_BLOCK, }buffer_device: ${KV_BUFFER:-auto}}
YAML
python3 -m pdserve config validate /tmp/pd.yaml || return 1
