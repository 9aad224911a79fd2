#!/bin/bash
# `pdserve bench overhead` on the GPU machine's 16 cores: synthetic engines, no GPU. That machine has no
# network and no pdserve dependencies: build the wheels here first (docs/benchmarks.md, section 1) and
# carry them as .stage/gw. Each argument is one run's `bench overhead` flags; run N's output goes to
# $OUT/sweep-N.txt, the machine's description and load to $OUT/machine.txt.
# usage: bash bench/gpu/overhead_16_cores.sh "--streams 512,1024 --repeats 1" "--streams 2048 --repeats 3"
# The relay thread's C module (pd/_chunk_relay.c) is built here for that machine's Python 3.12, which has
# no compiler there, and carried as .stage/relay312 (without it the gateways relay every chunk in Python,
# and say so in their logs):
#   gcc -O2 -shared -fPIC -I"$(python3.12 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
#       pdserve/pd/_chunk_relay.c -o .stage/relay312/_chunk_relay.cpython-312-x86_64-linux-gnu.so -lpthread
set -u -o pipefail
export PYTHONUNBUFFERED=1
if compgen -G ".stage/relay312/*.so" > /dev/null; then cp .stage/relay312/*.so pdserve/pd/; fi
python3 -m venv --system-site-packages /tmp/gw && /tmp/gw/bin/pip install -q --no-index --no-deps .stage/gw/*.whl \
    || exit 1
ulimit -n 65536 || ulimit -n "$(ulimit -Hn)"  # 2,048 streams hold ~6,000 sockets across the processes
{ date -u +%FT%TZ; nproc; lscpu | grep -E "^Model name|^CPU\(s\)|^Thread"; uptime; /tmp/gw/bin/python --version; } \
    2>&1 | tee "$OUT/machine.txt"
run=0
for flags in "$@"; do
    run=$((run + 1))
    # shellcheck disable=SC2086  # one string of flags per run, split on purpose
    /tmp/gw/bin/python -m pdserve bench overhead $flags --log-dir "/tmp/bench-logs-$run" 2>&1 | tee "$OUT/sweep-$run.txt" \
        || { tail -n 20 "/tmp/bench-logs-$run"/*.log; exit 1; }
    echo "after run $run: $(uptime)" | tee -a "$OUT/machine.txt"
done
