#!/usr/bin/env bash
# Runs the real-text study at several peak learning rates inside one time budget: one study folder per rate,
# OUT_ROOT/lrRATE, each continued with --resume, so a sweep can span several calls of this script.
#
#   bash examples/reproduce/rate_sweep.sh SIZE OUT_ROOT SECONDS RATE:MODELS:SEEDS [RATE:MODELS:SEEDS ...]
#
# e.g. `bash examples/reproduce/rate_sweep.sh small sweep 540 1e-3:llama,flash_mhf:3 2e-3:llama,flash_mhf:3`.
# Every model trains on 15.99M tokens, the whole training split once (or $STUDY_TOKENS), on the shards in
# .study-data (or $STUDY_DATA).
# A run starts only if 1.15 x its estimated time fits in what is left ($STUDY_DEADLINE_MARGIN sets the 0.15; study.py's
# --deadline-margin).
# The specs run in the order given; each gets the seconds the earlier ones left as its --deadline-minutes, and one
# is not started with less than a minute left. Tabulate the folders with learning_rates.py.
# (`rate_sweep.sh --check SPEC...` only checks the specs: exit status 2, with the reason, if one is malformed.)
set -euo pipefail
check_specs() {
    local spec rate models seeds extra
    for spec in "$@"; do
        IFS=: read -r rate models seeds extra <<< "$spec"
        if [[ -z $rate || -z $models || -z $seeds || -n ${extra:-} ]]; then
            echo "rate_sweep: a spec is RATE:MODELS:SEEDS (e.g. 1e-3:llama,flash_mhf:3), not '$spec'" >&2
            exit 2
        fi
    done
}
if [[ ${1:-} == --check ]]; then
    shift
    check_specs "$@"
    exit 0
fi
if (( $# < 4 )); then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
size=$1 root=$2 budget=$3
shift 3
if ! [[ $budget =~ ^[0-9]+$ ]]; then
    echo "rate_sweep: SECONDS is a whole number of seconds, not '$budget'" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
check_specs "$@"
start=$(date +%s)
for spec in "$@"; do
    IFS=: read -r rate models seeds <<< "$spec"
    left=$(( budget - ($(date +%s) - start) ))
    if (( left < 60 )); then
        echo "rate_sweep: $left s left, not starting $spec"
        continue
    fi
    echo "rate_sweep: $spec with $left s left"
    python "$here/study.py" --data "${STUDY_DATA:-.study-data}" --size "$size" --tokens "${STUDY_TOKENS:-15.99e6}" --seeds-for all \
        --learning-rate "$rate" --models "$models" --seeds "$seeds" --out "$root/lr$rate" --resume \
        ${STUDY_DEADLINE_MARGIN:+--deadline-margin "$STUDY_DEADLINE_MARGIN"} \
        --deadline-minutes "$(awk -v s="$left" 'BEGIN { printf "%.2f", s / 60 }')"
done
