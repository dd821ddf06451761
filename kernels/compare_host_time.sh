#!/usr/bin/env bash
# The host's time to issue the FlashMHF layer's pieces and small-batch training steps, for this checkout against
# another copy of the package (an earlier commit), in one GPU call, alternating the two so that a drift of the
# host's speed falls on both.
#
#   bash kernels/compare_host_time.sh BEFORE_DIR OUT_DIR [ROUNDS]
#
# BEFORE_DIR holds the other `hf_memffn/` and `examples/presets.py` (e.g. `git archive <commit> hf_memffn
# examples/presets.py | tar -x -C BEFORE_DIR`); this checkout's `kernels/` scripts run against both, so they measure
# the same pieces. TRAIN_TASKS (bench_models tasks; default: 370M Llama and FlashMHFLlama at batch 1 and 2; empty:
# none) are the training steps timed after the pieces; ISSUE ("idle", default, or "back-to-back") is how the pieces'
# calls are issued (profile_flash_mhf_host.py --issue). Writes OUT_DIR/host_time.json and OUT_DIR/host_time.md.
set -euo pipefail
before=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
rounds=${3:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
mkdir -p "$before/kernels"
cp "$here"/kernels/{profile_flash_mhf_host.py,harness.py,bench_models.py} "$before/kernels/"
tasks=${TRAIN_TASKS-"train:370M:llama:eager:1 train:370M:flash_mhf:eager:1 train:370M:llama:eager:2 train:370M:flash_mhf:eager:2"}
# a run that fails or times out is reported and its round left out of the tables ("-"), not the end of the call
for round in $(seq "$rounds"); do
  for tree in after before; do
    root=$here; [ "$tree" = before ] && root=$before
    (cd "$root" && PYTHONPATH=. timeout 150 python kernels/profile_flash_mhf_host.py --out "$work/parts_${tree}_$round" \
       --no-cprofile --parts 200 --issue "${ISSUE:-idle}" > "$work/parts_${tree}_$round.log" 2>&1) \
      || echo "round $round, $tree: the parts' run failed (exit status $?), see $work/parts_${tree}_$round.log"
    if [ -n "$tasks" ]; then
      (cd "$root" && PYTHONPATH=. timeout 150 python kernels/bench_models.py --out "$work/train_${tree}_$round" \
         --tasks $tasks > "$work/train_${tree}_$round.log" 2>&1) \
        || echo "round $round, $tree: the training run failed (exit status $?), see $work/train_${tree}_$round.log"
    fi
    echo "round $round, $tree: done"
  done
done
python "$here/kernels/compare_host_time.py" "$work" "$rounds" "$out"
