"""The pretraining recipe's arguments (HfArgumentParser over dataclasses with the preset defaults), bf16 on CPU,
DeepSpeed ZeRO-3's partitioned parameters in its counts, and examples/accelerate/ddp.yaml on a machine without GPUs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("datasets")
from test_recipe import EXAMPLES, pretrain, write_corpus  # noqa: E402


def test_every_training_argument_parses_with_the_preset_defaults(tmp_path):
    args, training = pretrain.parse_arguments(["--output-dir", str(tmp_path), "--preset", "128M", "--arch", "memoryllm",
                                               "--dataloader-num-workers", "2", "--optim", "adafactor"])
    assert (args.arch, args.preset, training.dataloader_num_workers, training.optim) == ("memoryllm", "128M", 2, "adafactor")
    assert training.learning_rate == pretrain.get_preset("128M").learning_rate
    assert (training.adam_beta1, training.adam_beta2, training.weight_decay) == (0.9, 0.95, 0.1)
    assert training.warmup_steps == 0.015 and training.eval_steps == 500 and training.report_to in ("none", [], ["none"])
    _, training = pretrain.parse_arguments(["--output-dir", str(tmp_path), "--learning-rate", "1e-4", "--grad-accum", "4",
                                            "--per-device-batch-size", "3", "--warmup-ratio", "0.1"])
    assert (training.learning_rate, training.gradient_accumulation_steps) == (1e-4, 4)
    assert (training.per_device_train_batch_size, training.per_device_eval_batch_size, training.warmup_steps) == (3, 3, 0.1)
    with pytest.raises(SystemExit):
        pretrain.parse_arguments(["--output-dir", str(tmp_path), "--precision", "fp8"])
    with pytest.raises(ValueError, match="preset='7B'"):
        pretrain.parse_arguments(["--output-dir", str(tmp_path), "--preset", "7B"])


def test_gradient_checkpointing_flag_uses_the_installed_transformers_name(tmp_path):
    """`--gradient-checkpointing` turns activation checkpointing on under the name the installed TrainingArguments has
    (`activation_checkpointing` from transformers 5.25 on, whose old name warns), without a deprecation warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, training = pretrain.parse_arguments(["--output-dir", str(tmp_path), "--gradient-checkpointing"])
        _, plain = pretrain.parse_arguments(["--output-dir", str(tmp_path)])
    assert training.gradient_checkpointing is True and getattr(training, "activation_checkpointing", True) is True
    assert training.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert plain.gradient_checkpointing is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_bf16_precision_trains_on_cpu(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=40)
    summary = pretrain.main([
        "--arch", "kvffn", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
        "--per-device-batch-size", "4", "--max-steps", "2", "--eval-steps", "2", "--save-steps", "2",
        "--max-eval-blocks", "2", "--precision", "bf16", "--output-dir", str(tmp_path / "run"),
    ])
    assert summary["bf16"] is True and summary["device"] == "cpu" and math.isfinite(summary["eval_loss"])


@pytest.mark.parametrize("arch", ["llama", "flash_mhf", "memoryllm"])
def test_zero3_partitioned_parameters_count_with_their_full_size(arch):
    model = AutoModelForCausalLM.from_config(pretrain.build_config(arch, "tiny", vocab_size=256))
    flops, counts = pretrain.training_flops_per_token(model, 64), pretrain.parameter_counts(model)
    for param in model.parameters():  # what ZeRO-3 leaves on a rank: an empty tensor and the full size
        param.ds_numel = param.numel()
        param.data = torch.empty(0)
    assert pretrain.training_flops_per_token(model, 64) == flops
    assert pretrain.parameter_counts(model) == counts and counts["total"] > 0


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without GPUs")
def test_ddp_config_without_gpus_forms_one_run(tmp_path):
    """accelerate's ddp.yaml starts two processes; without GPUs they must train as one gloo run, not as two."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(EXAMPLES / "accelerate" / "ddp.yaml"), "--main_process_port", "0", str(EXAMPLES / "pretrain.py"),
               "--arch", "kvffn", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
               "--per-device-batch-size", "4", "--max-steps", "2", "--eval-steps", "2", "--save-steps", "2",
               "--max-eval-blocks", "2", "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 2
