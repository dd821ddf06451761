#!/usr/bin/env bash
# FSDP2 on two GPUs reproduces the single-GPU loss curve.
#
# Trains the same small FlashMHFLlama (Triton kernel forced) three times on the same data, from the same
# initialisation, with the same global batch (16 blocks of 512 tokens) and data order:
#   1. one GPU, per-device batch 16;
#   2. two GPUs with FSDP2 (examples/accelerate/fsdp2.yaml), per-device batch 8;
#   3. as 2, under torch.compile, stopped early (same schedule): it checks the kernel compiles and trains alike.
# then compares the curves (examples/compare_loss_curves.py). Text: the Python standard library's sources
# (available offline on any machine). Usage: bash examples/fsdp2_check.sh RESULTS_DIR [STEPS]
# A failed torch.compile run leaves the summaries to be written, then the script exits 1.
set -euo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RESULTS=${1:?results dir}
STEPS=${2:-200}
COMPILE_STEPS=${COMPILE_STEPS:-60}
WORK=${WORK:-/tmp/fsdp2-check}
mkdir -p "$RESULTS" "$WORK"
rm -rf "${WORK:?}/single" "$WORK/fsdp2" "$WORK/fsdp2-compile"  # runs of an earlier call: pretrain.py refuses them
# an earlier call's results, so that a run that fails leaves none of them beside this call's
rm -f "$RESULTS/single_gpu_train_log.jsonl" "$RESULTS/fsdp2_train_log.jsonl" "$RESULTS/comparison.json" \
    "$RESULTS/comparison.md" "$RESULTS/fsdp2_compile_train_log.jsonl" "$RESULTS/comparison_compile.json" \
    "$RESULTS/summaries.json"
HERE=$(cd "$(dirname "$0")" && pwd)

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import datasets, torch, transformers, accelerate, triton; print('datasets', datasets.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())"
python3 "$HERE/write_code_corpus.py" "$WORK/corpus.jsonl"

COMMON=(--arch flash_mhf --preset "${PRESET:-small}" --config-overrides "ffn_kernel=${KERNEL:-triton}"
        --data-files "$WORK/corpus.jsonl" --block-size 512 --num-proc 8
        --logging-steps 5 --eval-steps 50 --max-eval-blocks 64 --save-steps 100000 --seed 0)

echo "=== 1 GPU ==="
CUDA_VISIBLE_DEVICES=0 python3 "$HERE/pretrain.py" "${COMMON[@]}" --train-tokenizer 8192 \
    --per-device-batch-size 16 --max-steps "$STEPS" --output-dir "$WORK/single"
echo "=== 2 GPUs, FSDP2 ==="
python3 -m accelerate.commands.launch --config_file "$HERE/accelerate/fsdp2.yaml" --num_processes 2 "$HERE/pretrain.py" "${COMMON[@]}" \
    --tokenizer "$WORK/single/tokenizer" --per-device-batch-size 8 --max-steps "$STEPS" --output-dir "$WORK/fsdp2"
cp "$WORK/single/train_log.jsonl" "$RESULTS/single_gpu_train_log.jsonl"
cp "$WORK/fsdp2/train_log.jsonl" "$RESULTS/fsdp2_train_log.jsonl"
python3 "$HERE/compare_loss_curves.py" "$WORK/single" "$WORK/fsdp2" --json "$RESULTS/comparison.json" --markdown "$RESULTS/comparison.md"

echo "=== 2 GPUs, FSDP2 + torch.compile ==="
compile_failed=0
python3 -m accelerate.commands.launch --config_file "$HERE/accelerate/fsdp2.yaml" --num_processes 2 "$HERE/pretrain.py" "${COMMON[@]}" \
    --tokenizer "$WORK/single/tokenizer" --per-device-batch-size 8 --max-steps "$STEPS" --stop-after-steps "$COMPILE_STEPS" --torch-compile \
    --output-dir "$WORK/fsdp2-compile" || { echo "FSDP2 + torch.compile run FAILED"; compile_failed=1; }
if [ -f "$WORK/fsdp2-compile/train_log.jsonl" ]; then
    cp "$WORK/fsdp2-compile/train_log.jsonl" "$RESULTS/fsdp2_compile_train_log.jsonl"
    python3 "$HERE/compare_loss_curves.py" "$WORK/fsdp2" "$WORK/fsdp2-compile" --json "$RESULTS/comparison_compile.json"
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
exit $compile_failed
