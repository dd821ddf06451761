#!/usr/bin/env bash
# Continuous batching's first timed round in processes that compile their Triton kernels themselves (an empty Triton
# disk cache) against one that loads them from the cache, with the first steps of every timed workload taken apart
# (bench_continuous_batching.py --synchronised-steps: each step's host part, the device's remainder and the device
# blocks the caching allocator obtained in it).
#
#   bash examples/cold_cache_first_step.sh OUT_DIR [SYNCHRONISED_STEPS [BENCHMARK ARGUMENTS...]]
#
# (the arguments after SYNCHRONISED_STEPS go last to every process, replacing the defaults below: a CPU smoke run
# passes `--preset tiny --device cpu ...`)
# Four processes, one after the other (RUNS names some of them), each in OUT_DIR/<name>/ with its log beside:
#   cold        Llama and FlashMHFLlama, 2 rounds, a new empty Triton cache
#   warm        the same, reusing the cache that `cold` filled
#   cold_again  the same, another new empty cache
#   cold_eager  FlashMHFLlama alone, a new empty cache, CUDA_MODULE_LOADING=EAGER (every kernel of a module loaded
#               with it, not at its first launch)
# `warm` needs `cold` before it (the cache it reuses). A process that fails leaves the others to run; the script then
# exits 1.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash examples/cold_cache_first_step.sh OUT_DIR" \
                       "[SYNCHRONISED_STEPS [BENCHMARK ARGUMENTS...]]"; exit 2; }
seen=""
for name in ${RUNS:-cold warm cold_again cold_eager}; do
  case $name in
    cold|cold_again|cold_eager) ;;
    warm) [[ " $seen " == *" cold "* ]] \
            || { echo "RUNS: warm reuses the cache that cold fills: name cold before it"; exit 2; } ;;
    *) echo "RUNS: unknown run $name (allowed: cold warm cold_again cold_eager)"; exit 2 ;;
  esac
  seen+=" $name"
done
out=$(mkdir -p "$1" && cd "$1" && pwd)
synchronised=${2:-3}
extra=("${@:3}")
here=$(cd "$(dirname "$0")/.." && pwd)
caches=$(mktemp -d)
failed=()
run() {  # name, cache directory, extra environment and arguments
  local name=$1 cache=$2
  shift 2
  mkdir -p "$cache"
  rm -rf "${out:?}/$name"  # an earlier call's results: a process that fails before writing leaves none of them
  echo "== $name: TRITON_CACHE_DIR=$cache $*"
  (cd "$here" && env TRITON_CACHE_DIR="$cache" "$@" --requests 32 --rounds 2 --no-token-lookup \
     --synchronised-steps "$synchronised" "${extra[@]}" --out "$out/$name" > "$out/$name.log" 2>&1) \
    || { echo "$name failed:"; tail -20 "$out/$name.log"; failed+=("$name"); }
}
bench=(python examples/bench_continuous_batching.py)
for name in ${RUNS:-cold warm cold_again cold_eager}; do
  case $name in
    cold) run cold "$caches/first" "${bench[@]}" --archs llama flash_mhf ;;
    warm) run warm "$caches/first" "${bench[@]}" --archs llama flash_mhf ;;
    cold_again) run cold_again "$caches/second" "${bench[@]}" --archs llama flash_mhf ;;
    cold_eager) run cold_eager "$caches/third" CUDA_MODULE_LOADING=EAGER "${bench[@]}" --archs flash_mhf ;;
  esac
done
rm -rf "$caches"
if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]}"; exit 1; fi
