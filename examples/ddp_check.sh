#!/usr/bin/env bash
# DDP, FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 on two GPUs against one GPU, with the committed accelerate configs.
#
# Every run trains the same model (default: the `small` FlashMHFLlama, Triton kernel forced) from the same saved
# initial weights (`--init-from`, so ZeRO-3's own initialisation plays no part), on the same data in the same order,
# with the same global batch (default 16 blocks of 512 tokens): one GPU with per-device batch 16; two GPUs with
# per-device batch 8 through examples/accelerate/{ddp,fsdp2,deepspeed_zero2,deepspeed_zero3}.yaml. Then
# examples/compare_loss_curves.py compares every curve and tokens/s with the one-GPU run (which also replaces the
# FSDP2 check's one-GPU reference). Text: the Python standard library's sources (on any machine, offline).
#
#   bash examples/ddp_check.sh RESULTS_DIR [STEPS]          # on a machine with 2 GPUs; default 200 steps
#   bash examples/ddp_check.sh --wheels [DIR]               # on a machine with the package index: DeepSpeed wheels
#
# Environment: RUNS (default "single ddp fsdp2 zero2 zero3"; later runs reuse WORK's initial weights and one-GPU
# run, so the list can be split over several calls with the same settings; a call with other settings (ARCH, PRESET,
# KERNEL, BATCH, BLOCK, STEPS, EXTRA_ARGS) starts WORK's weights and runs afresh), ARCH (flash_mhf), PRESET (small;
# also the learning rate),
# KERNEL (triton; FlashMHFLlama's ffn_kernel), BATCH (global batch in blocks, 16; even), BLOCK (tokens per block,
# 512), WORK (/tmp/ddp-check),
# WHEELS (.whl/deepspeed), EXTRA_ARGS (more examples/pretrain.py arguments for every run, e.g.
# "--profile-steps 21:25", whose profile_steps.{json,txt} are copied to RESULTS_DIR as RUN_profile_steps.*).
# DeepSpeed: used if importable; otherwise installed from the wheels in WHEELS (`--wheels` builds them: DeepSpeed
# as a pure-Python wheel with no prebuilt ops, plus einops, hjson, msgpack, ninja, py-cpuinfo and pydantic with its
# own dependencies; also `datasets` with dill and multiprocess, installed the same way where it is missing). The
# recipe's optimizer is torch's AdamW, so no DeepSpeed op is compiled. If DeepSpeed cannot be imported, the ZeRO runs are
# skipped and RESULTS_DIR/deepspeed_status.txt says why. A run that fails leaves the others to run and the script
# exits 1 at the end.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)

if [ "${1:-}" = "--wheels" ]; then
    DIR=${2:-.whl/deepspeed}
    mkdir -p "$DIR"
    DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
    python3 -m pip download -q --no-deps -d "$DIR" einops hjson ninja py-cpuinfo "pydantic==${PYDANTIC_VERSION:-2.13.4}" \
        annotated-types typing-inspection
    for version in 3.10 3.11 3.12 3.13; do  # compiled: one wheel per Python the GPU machine may have
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$DIR" msgpack "pydantic-core==${PYDANTIC_CORE_VERSION:-2.46.4}" "multiprocess==${MULTIPROCESS_VERSION:-0.70.19}"
    done
    # `datasets` for the recipe, where the GPU machine's image lacks it (its other needs are common there)
    python3 -m pip download -q --no-deps -d "$DIR" "datasets==${DATASETS_VERSION:-5.2.0}" "dill==${DILL_VERSION:-0.4.1}"
    ls -la "$DIR"
    exit 0
fi

export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RESULTS=${1:?results dir}
STEPS=${2:-200}
RUNS=${RUNS:-single ddp fsdp2 zero2 zero3}
ARCH=${ARCH:-flash_mhf}
WORK=${WORK:-/tmp/ddp-check}
WHEELS=${WHEELS:-.whl/deepspeed}
PRESET=${PRESET:-small}
BATCH=${BATCH:-16}
BLOCK=${BLOCK:-512}
if (( BATCH % 2 )); then echo "BATCH=$BATCH: the global batch must be even (two GPUs share it)" >&2; exit 2; fi
for run in $RUNS; do
    case $run in
        single|ddp|fsdp2|zero2|zero3) ;;
        *) echo "RUNS: unknown run $run (allowed: single ddp fsdp2 zero2 zero3)" >&2; exit 2 ;;
    esac
done
mkdir -p "$RESULTS" "$WORK"
RESULTS=$(cd "$RESULTS" && pwd)

# `datasets` (the recipe's data loading): importable, or installed from the carried wheels.
if ! python3 -c "import datasets" 2>/dev/null && ls "$WHEELS"/datasets-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target "$WORK/datasets-site" \
        datasets dill multiprocess 2>&1 | tail -3 || true
    export PYTHONPATH="$WORK/datasets-site${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    python3 -c "import datasets, torch, transformers, accelerate, triton; print('datasets', datasets.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())"
} | tee "$RESULTS/versions.txt"

# DeepSpeed: importable, or installed from the carried wheels, or the reason it is not there.
if [[ " $RUNS " == *" zero"* ]]; then
    if ! python3 -c "import deepspeed" 2>/dev/null && ls "$WHEELS"/deepspeed-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target "$WORK/deepspeed-site" \
            deepspeed einops hjson msgpack ninja py-cpuinfo pydantic pydantic-core annotated-types typing-inspection 2>&1 | tail -3 || true
        export PYTHONPATH="$WORK/deepspeed-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if python3 -c "import deepspeed, sys; print('deepspeed', deepspeed.__version__, 'imports; accelerator', deepspeed.get_accelerator().device_name())" > "$RESULTS/deepspeed_status.txt" 2>&1; then
        cat "$RESULTS/deepspeed_status.txt"
    else
        { echo "ZeRO runs skipped: deepspeed cannot be imported (wheels looked for in $WHEELS):"; tail -5 "$RESULTS/deepspeed_status.txt"; } > "$RESULTS/deepspeed_status.tmp"
        mv "$RESULTS/deepspeed_status.tmp" "$RESULTS/deepspeed_status.txt"
        cat "$RESULTS/deepspeed_status.txt"
        RUNS=$(echo "$RUNS" | tr ' ' '\n' | grep -v '^zero' | tr '\n' ' ')
    fi
fi

if [ ! -f "$WORK/corpus.jsonl" ]; then
python3 "$HERE/write_code_corpus.py" "$WORK/corpus.jsonl"
fi

# The shared initial weights and tokenizer: a byte-level BPE of 8192 on the corpus, the model from the preset. They
# and the runs of an earlier call are reused only with the same settings (written once the weights are saved whole).
SETTINGS="arch=$ARCH preset=$PRESET kernel=${KERNEL:-triton} batch=$BATCH block=$BLOCK steps=$STEPS"
SETTINGS+=" extra=${EXTRA_ARGS:-}"
if [ "$(cat "$WORK/settings.txt" 2>/dev/null)" != "$SETTINGS" ]; then
    rm -rf "${WORK:?}/settings.txt" "$WORK/init" "$WORK/single" "$WORK/ddp" "$WORK/fsdp2" "$WORK/zero2" "$WORK/zero3"
    OVERRIDES=()  # (the FFN kernel is a field of FlashMHFLlama's config only)
    [ "$ARCH" = flash_mhf ] && OVERRIDES=(--config-overrides "ffn_kernel=${KERNEL:-triton}")
    python3 "$HERE/save_initial_weights.py" "$WORK/corpus.jsonl" "$WORK/init" --arch "$ARCH" --preset "$PRESET" \
        "${OVERRIDES[@]}"
    echo "$SETTINGS" > "$WORK/settings.txt"
fi

COMMON=(--init-from "$WORK/init" --arch "$ARCH" --preset "$PRESET" --data-files "$WORK/corpus.jsonl" --block-size "$BLOCK" --num-proc 8
        --logging-steps 5 --eval-steps 50 --max-eval-blocks 64 --save-steps 100000 --seed 0 --max-steps "$STEPS")
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
COMMON+=("${EXTRA[@]}")
declare -A CONFIG=([ddp]=ddp [fsdp2]=fsdp2 [zero2]=deepspeed_zero2 [zero3]=deepspeed_zero3)
# the ZeRO configs name their DeepSpeed JSON relative to the repository root; given by its own path here, so that
# the script runs from any directory
declare -A DEEPSPEED_JSON=([zero2]="$HERE/accelerate/ds_zero2.json" [zero3]="$HERE/accelerate/ds_zero3.json")
FAILED=()
for run in $RUNS; do
    echo "=== $run ==="
    rm -rf "${WORK:?}/$run"  # a run left by an earlier call: pretrain.py refuses a folder that holds one
    rm -f "$RESULTS/${run}_train_log.jsonl" "$RESULTS/${run}_profile_steps.json" "$RESULTS/${run}_profile_steps.txt"
    if [ "$run" = single ]; then
        CUDA_VISIBLE_DEVICES=0 python3 "$HERE/pretrain.py" "${COMMON[@]}" --per-device-batch-size "$BATCH" \
            --output-dir "$WORK/single" || { echo "$run FAILED"; FAILED+=("$run"); }
    else
        LAUNCH=(--config_file "$HERE/accelerate/${CONFIG[$run]}.yaml" --num_processes 2)
        if [ -n "${DEEPSPEED_JSON[$run]:-}" ]; then LAUNCH+=(--deepspeed_config_file "${DEEPSPEED_JSON[$run]}"); fi
        python3 -m accelerate.commands.launch "${LAUNCH[@]}" \
            "$HERE/pretrain.py" "${COMMON[@]}" --per-device-batch-size $((BATCH / 2)) --output-dir "$WORK/$run" \
            || { echo "$run FAILED"; FAILED+=("$run"); }
    fi
    if [ -f "$WORK/$run/train_log.jsonl" ]; then cp "$WORK/$run/train_log.jsonl" "$RESULTS/${run}_train_log.jsonl"; fi
    for kind in json txt; do
        if [ -f "$WORK/$run/profile_steps.$kind" ]; then cp "$WORK/$run/profile_steps.$kind" "$RESULTS/${run}_profile_steps.$kind"; fi
    done
done

COMPARED=()
for run in single ddp fsdp2 zero2 zero3; do
    if [ -f "$WORK/$run/summary.json" ]; then COMPARED+=("$WORK/$run"); fi
done
rm -f "$RESULTS/comparison.json" "$RESULTS/comparison.md"  # an earlier call's, of runs that may be gone
if [ -f "$WORK/single/summary.json" ] && [ ${#COMPARED[@]} -gt 1 ]; then
    python3 "$HERE/compare_loss_curves.py" "${COMPARED[@]}" --json "$RESULTS/comparison.json" --markdown "$RESULTS/comparison.md"
fi
python3 - "$WORK" "$RESULTS/summaries.json" <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in sorted(work.iterdir()) if (d / "summary.json").is_file()}
out = Path(sys.argv[2])
temporary = out.with_name(out.name + ".partial")
temporary.write_text(json.dumps(summaries, indent=2) + "\n")
temporary.replace(out)
EOF
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed runs: ${FAILED[*]}" >&2; exit 1; fi
