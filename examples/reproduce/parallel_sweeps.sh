#!/usr/bin/env bash
# Runs several rate_sweep.sh streams at the same time, so that one call on a machine keeps its GPUs busy:
#
#   bash examples/reproduce/parallel_sweeps.sh SIZE SECONDS STREAM [STREAM ...]
#
# A STREAM is one or more sweeps run one after another, separated by ';'. A sweep is "TOKENS ROOT SPEC [SPEC ...]":
# rate_sweep.sh's arguments, with TOKENS as its $STUDY_TOKENS and SPEC as RATE:MODELS:SEEDS. A leading "@N" runs the
# stream on GPU N alone (CUDA_VISIBLE_DEVICES=N). e.g. two streams on one GPU, the second running two sweeps:
#   bash examples/reproduce/parallel_sweeps.sh base 565 '128e6 sweep-128M 2e-3:mh_ffn:1' \
#       '64e6 sweep-64M 3e-3:flex_total:3; 64e6 sweep-64M 1e-3:mh_ffn:1'
# Each sweep gets the seconds its stream's earlier sweeps left of SECONDS, and is not started with under a minute left.
# Every output line starts with its stream's number; the exit status is 1 if any stream failed.
# Two streams may not write one study folder (ROOT/lrRATE): give each its own ROOT and join them with study.py --merge.
set -euo pipefail
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
(( $# >= 3 )) || usage
size=$1 budget=$2
shift 2
if ! [[ $budget =~ ^[0-9]+$ ]]; then
    echo "parallel_sweeps: SECONDS is a whole number of seconds, not '$budget'" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)

# Split each stream into its GPU (empty: all of them) and its sweeps, and check every one before anything starts.
# (A study folder written by two streams at once would keep the runs of whichever wrote its results.json last.)
gpus=() bodies=() folders=() owners=()
stream_number=0
for stream in "$@"; do
    stream_number=$(( stream_number + 1 ))
    gpu='' body=$stream
    if [[ $body =~ ^[[:space:]]*@([^[:space:]]*)[[:space:]]+(.*)$ ]]; then
        gpu=${BASH_REMATCH[1]} body=${BASH_REMATCH[2]}
        if ! [[ $gpu =~ ^[0-9]+$ ]]; then
            echo "parallel_sweeps: a stream's GPU is @N with N a number, not '@$gpu'" >&2
            exit 2
        fi
    fi
    gpus+=("$gpu") bodies+=("$body")
    IFS=';' read -r -a sweeps <<< "$body"
    for sweep in "${sweeps[@]}"; do
        read -r -a fields <<< "$sweep"
        if (( ${#fields[@]} < 3 )) || ! [[ ${fields[0]} =~ ^[0-9]+(\.[0-9]+)?(e[0-9]+)?$ ]]; then
            echo "parallel_sweeps: a sweep is 'TOKENS ROOT RATE:MODELS:SEEDS [...]' (e.g. 64e6 sweep 1e-3:llama:3)," \
                 "not '$sweep'" >&2
            exit 2
        fi
        bash "$here/rate_sweep.sh" --check "${fields[@]:2}"
        for spec in "${fields[@]:2}"; do
            folder=${fields[1]%/}/lr${spec%%:*}
            folder=$(realpath -m -- "$folder" 2>/dev/null || echo "$folder")
            for (( index = 0; index < ${#folders[@]}; index++ )); do
                if [[ ${folders[$index]} == "$folder" ]] && (( owners[index] != stream_number )); then
                    echo "parallel_sweeps: streams ${owners[$index]} and $stream_number both write $folder; give" \
                         "each stream its own ROOT (study.py --merge joins the folders after)" >&2
                    exit 2
                fi
            done
            folders+=("$folder") owners+=("$stream_number")
        done
    done
done

start=$(date +%s)
run_stream() {  # GPU (or empty) and sweeps, as split above
    local gpu=$1 body=$2 sweep left
    local -a sweeps fields
    if [[ -n $gpu ]]; then
        export CUDA_VISIBLE_DEVICES=$gpu
        echo "on GPU $gpu"
    fi
    IFS=';' read -r -a sweeps <<< "$body"
    for sweep in "${sweeps[@]}"; do
        read -r -a fields <<< "$sweep"
        left=$(( budget - ($(date +%s) - start) ))
        if (( left < 60 )); then
            echo "parallel_sweeps: $left s left, not starting '${fields[*]}'"
            continue
        fi
        STUDY_TOKENS=${fields[0]} bash "$here/rate_sweep.sh" "$size" "${fields[1]}" "$left" "${fields[@]:2}"
    done
}

pids=()
for index in "${!bodies[@]}"; do
    ( run_stream "${gpus[$index]}" "${bodies[$index]}" 2>&1 | sed -u "s/^/[stream $(( index + 1 ))] /" ) &
    pids+=("$!")
done
status=0
for index in "${!pids[@]}"; do
    if ! wait "${pids[$index]}"; then
        echo "parallel_sweeps: stream $(( index + 1 )) failed" >&2
        status=1
    fi
done
exit $status
