#!/bin/sh
# Fails (exit 1) naming every shared library that `ldd` reports "not found" for the given files, so an image
# whose NIXL LIBFABRIC plugin cannot load fails its build instead of every engine's preflight, 40 minutes into
# `pdserve cloud up`. Exit 2 when given no file: a plugin that moved in a new wheel must not pass unchecked.
#
#   check-shared-libs.sh [--at-run-time LIB]... FILE...
#
# --at-run-time LIB: a library the node mounts into the container when it starts, so the image has none by
# design; for a GPU image the NVIDIA driver's libcuda.so.1 (the NVIDIA container toolkit mounts it).
set -eu

run_time=" "
while [ "$#" -gt 1 ] && [ "$1" = "--at-run-time" ]; do
    run_time="$run_time$2 "
    shift 2
done
if [ "$#" -eq 0 ]; then
    echo "check-shared-libs: no file to check" >&2
    exit 2
fi

status=0
for file in "$@"; do
    # ldd lists "libx.so.1 => not found" on stdout and a missing symbol version on stderr
    if ! report=$(ldd "$file" 2>&1); then
        echo "$file: ldd failed: $report" >&2
        status=1
        continue
    fi
    missing=$(printf '%s\n' "$report" | grep "not found" | while read -r library rest; do
        case "$run_time" in
            *" $library "*) ;;
            *) echo "  $library $rest" ;;
        esac
    done)
    if [ -n "$missing" ]; then
        printf '%s needs shared libraries this image lacks:\n%s\n' "$file" "$missing" >&2
        status=1
    else
        mounted=${run_time# }
        mounted=${mounted% }
        echo "$file: every shared library it needs is here${mounted:+, but $mounted, which the node mounts}"
    fi
done
exit "$status"
