# Sourced by the GPU scripts: the counters bench/gpu/ttft_split.py splits PD TTFT with (engines read with
# PDSERVE_ENGINE_KEY where it is set; a gateway with no API keys ignores it).
# sample_metrics URL...: one "# <unix time> <url>" block per URL of its /metrics, the series that split needs.
# metrics_around DIR GATEWAY PREFILL DECODE -- COMMAND...: DIR/metrics-before.txt, the decode engine every 3 s
#   while COMMAND runs (direct first, then pd: the sample between the phases splits its histograms), then
#   DIR/metrics-after.txt.
sample_metrics() {
  for url in "$@"; do
    echo "# $(date +%s.%N) $url"
    curl -s --max-time 5 ${PDSERVE_ENGINE_KEY:+-H "Authorization: Bearer $PDSERVE_ENGINE_KEY"} "$url/metrics" | grep -E "^(pdserve_(kv|leg|engine|time_to_first|prefill_first)|vllm:(time_to_first|request_queue|request_prefill|request_decode|nixl|e2e|num_requests|prefix_cache))"
  done
}
metrics_around() {
  local dir=$1 gateway=$2 prefill=$3 decode=$4 sampler status
  shift 5
  mkdir -p "$dir"
  sample_metrics "$gateway" "$prefill" "$decode" > "$dir/metrics-before.txt"
  ( while :; do sample_metrics "$decode"; sleep 3; done ) > "$dir/metrics-decode-samples.txt" 2>&1 &
  sampler=$!
  "$@"; status=$?
  kill $sampler; wait $sampler 2>/dev/null
  sample_metrics "$gateway" "$prefill" "$decode" > "$dir/metrics-after.txt"
  return $status
}
