# The machine a GPU figure ran on, for its raw files: docs/benchmarks.md names the card, the CPU model and the load
# average beside each figure. Sourced by the bench/gpu scripts; `machine FILE` appends the time, the load average,
# the card (name, memory, driver) and the CPU model to FILE, at a run's start and again at its end.
machine() {
  { date -u; uptime; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    lscpu | grep "Model name"; } >> "$1" 2>&1
}
