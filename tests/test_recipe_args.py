"""The pretraining recipe's arguments (HfArgumentParser over dataclasses with the preset defaults), bf16 on CPU,
DeepSpeed ZeRO-3's partitioned parameters in its counts, and examples/accelerate/ddp.yaml on a machine without GPUs."""

from __future__ import annotations

import json
import math
import os
import re
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


@pytest.mark.parametrize("precision", ["fp32", "auto", "bf16"])
def test_precision_decides_the_autocast_under_accelerate_launch(tmp_path, monkeypatch, precision):
    """`accelerate launch` with the configs of examples/accelerate/ (`mixed_precision: bf16`) sets
    ACCELERATE_MIXED_PRECISION, which the Trainer took while bf16 was off: `--precision fp32` trained in bf16 autocast,
    and `auto` on a CPU did too while the summary said bf16 false."""
    from transformers import Trainer

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    _, training = pretrain.parse_arguments(["--output-dir", str(tmp_path), "--precision", precision,
                                            "--eval-strategy", "no"])
    model = AutoModelForCausalLM.from_config(pretrain.build_config("kvffn", "tiny", vocab_size=256))
    autocast = Trainer(model=model, args=training).accelerator.mixed_precision
    assert autocast == ("bf16" if training.bf16 else "no")
    assert training.bf16 == (precision == "bf16" or precision == "auto" and torch.cuda.is_available()
                             and torch.cuda.is_bf16_supported())


def test_fp16_is_taken_over_auto_precision_and_contradicting_precisions_are_refused(tmp_path, monkeypatch, capsys):
    """`--fp16` (a TrainingArguments flag) with the default `--precision auto` on a GPU that has bf16 trains in fp16:
    auto had added bf16 to it, which TrainingArguments refused ("At most one of fp16 and bf16"). A `--precision` that
    contradicts `--bf16` or `--fp16` is refused naming both, where `--precision fp32` had dropped `--bf16` silently."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    common = ["--output-dir", str(tmp_path), "--eval-strategy", "no", "--use-cpu"]  # (no CUDA device to set up here)
    _, training = pretrain.parse_arguments([*common, "--fp16"])
    assert (training.fp16, training.bf16) == (True, False)
    _, training = pretrain.parse_arguments(common)
    assert (training.fp16, training.bf16) == (False, True)
    _, training = pretrain.parse_arguments([*common, "--precision", "bf16", "--bf16"])
    assert (training.fp16, training.bf16) == (False, True)
    for precision, flag in (("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "fp16")):
        with pytest.raises(SystemExit):
            pretrain.parse_arguments([*common, "--precision", precision, f"--{flag}"])
        assert f"--precision {precision} contradicts --{flag}" in capsys.readouterr().err


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
    assert (out / "final" / "model.safetensors").is_file() and not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("extra, message", [
    (["--block-size", "0"], r"--block-size=0: expected a positive number of tokens"),
    (["--max-eval-blocks", "-1"], r"--max-eval-blocks=-1: expected a positive number"),
    (["--stop-after-steps", "0"], r"--stop-after-steps=0: expected a step number of 1 or more"),
    (["--stop-after-steps", "-2"], r"--stop-after-steps=-2: expected a step number of 1 or more"),
    (["--learning-rate", "5e-6", "--min-learning-rate", "2e-5"],
     r"--min-learning-rate=2e-05: expected 0 to --learning-rate=5e-06"),
    (["--learning-rate", "0"], r"--learning-rate=0: expected a rate above 0, the peak the cosine decay falls from"),
    (["--learning-rate", "inf"], r"--learning-rate=inf: expected a finite rate of 0 or more \(the peak of the "
                                 r"--lr-scheduler-type=cosine_with_min_lr schedule\)"),
    (["--learning-rate", "inf", "--lr-scheduler-type", "linear"], r"--learning-rate=inf: expected a finite rate"),
    (["--learning-rate", "-1", "--lr-scheduler-type", "linear"], r"--learning-rate=-1: expected a finite rate of 0 "
                                                                 r"or more \(the peak of the --lr-scheduler-type="
                                                                 r"linear schedule\)"),
    (["--learning-rate", "nan", "--lr-scheduler-type", "constant"], r"--learning-rate=nan: expected a finite rate"),
    (["--learning-rate", "nan"], r"--learning-rate=nan: expected a finite rate"),
    (["--stop-after-steps", "1"], r"--stop-after-steps=1: at or past --max-steps=1, where training stops anyway"),
    (["--stop-after-steps", "5"], r"--stop-after-steps=5: at or past --max-steps=1, where training stops anyway"),
    (["--data-dir", "shards"], r"--data-dir reads token shards, so --data-files would be left unused"),
    (["--init-from", "saved"], r"--train-tokenizer: the model of --init-from='saved' reads the token ids"),
    (["--config-overrides", "ffn_kernal=torch"], r"'ffn_kernal' not a field of FlashMHFLlamaConfig; its fields:"),
    (["--resume", "no_such_checkpoint"], r"--resume='no_such_checkpoint' is not a checkpoint folder"),
    (["--resume", "latest"], r"--resume latest: no checkpoint-\* folder"),
    (["--train-tokenizer", "100"], r"--train-tokenizer=100: expected a vocabulary of 259 tokens or more"),
    (["--train-tokenizer", "0"], r"--train-tokenizer=0: expected a vocabulary of 259 tokens or more"),
    (["--validation-fraction", "nan"], r"--validation-fraction=nan: expected a fraction of the documents from 0 to "
                                       r"below 1"),
    (["--validation-fraction", "-0.5"], r"--validation-fraction=-0.5: expected a fraction"),
    (["--validation-fraction", "1.5"], r"--validation-fraction=1.5: expected a fraction"),
    (["--num-proc", "-1"], r"--num-proc=-1: expected a number of tokenizing processes of 1 or more"),
    (["--peak-tflops", "-3"], r"--peak-tflops=-3.0: expected the device's peak in TFLOP/s, a finite number above 0"),
    (["--peak-tflops", "0"], r"--peak-tflops=0.0: expected the device's peak in TFLOP/s, a finite number above 0"),
    (["--peak-tflops", "inf"], r"--peak-tflops=inf: expected the device's peak in TFLOP/s, a finite number above 0"),
    (["--lr-scheduler-kwargs", '{"min_lr": 0.01}'], r"--lr-scheduler-kwargs min_lr=0.01: expected 0 to 0.003 "
                                                   r"\(the learning rate of preset 'tiny'"),
    (["--learning-rate", "1e-3", "--lr-scheduler-kwargs", '{"min_lr": 0.01}'],
     r"--lr-scheduler-kwargs min_lr=0.01: expected 0 to --learning-rate=0.001"),
    (["--lr-scheduler-kwargs", '{"min_lr": 1e-4, "min_lr_rate": 0.1}'],
     r"--lr-scheduler-kwargs sets both min_lr and min_lr_rate: give one of them"),
    (["--min-learning-rate", "1e-5", "--lr-scheduler-kwargs", '{"min_lr": 1e-4}'],
     r"--lr-scheduler-kwargs sets min_lr=0.0001 and --min-learning-rate=1e-05 is given too: both set the floor"),
    (["--min_learning_rate=2e-5", "--lr-scheduler-kwargs", '{"min_lr_rate": 0.1}'],
     r"--lr-scheduler-kwargs sets min_lr_rate=0.1 and --min-learning-rate=2e-05 is given too"),
    (["--lr-scheduler-type", "linear", "--min-learning-rate", "1e-4"],
     r"--min-learning-rate=0.0001 is the floor of the cosine schedules \(cosine_with_min_lr, "
     r"cosine_warmup_with_min_lr\), not of --lr-scheduler-type=linear: drop one of them"),
    (["--lr-scheduler-type", "cosine_warmup_with_min_lr", "--learning-rate", "5e-6", "--min-learning-rate", "1e-5"],
     r"--min-learning-rate=1e-05: expected 0 to --learning-rate=5e-06, the rate"),
    (["--min-learning-rate", "0.01"], r"--min-learning-rate=0.01: expected 0 to 0.003 \(the learning rate of preset "
                                      r"'tiny'; --learning-rate sets another\), the rate the cosine decay falls from"),
    (["--tokenizer", "gpt2"], r"--train-tokenizer trains a tokenizer, so --tokenizer='gpt2' would be left unused"),
    (["--dataset-config", "sample-10BT"], r"--dataset-config='sample-10BT' names a configuration of a --dataset, "
                                          r"which is not given"),
    (["--dataset", "json", "--dataset-config", "x"], r"--dataset-config='x': --data-files are read by the builder "
                                                     r"--dataset='json' without a configuration, so it would be left "
                                                     r"unused"),
    (["--profile-steps", "1:3"], r"--profile-steps='1:3': its last step 3 is past --max-steps=1, where training stops"),
    (["--max-steps", "4", "--stop-after-steps", "2", "--profile-steps", "2:3"],
     r"--profile-steps='2:3': its last step 3 is past --stop-after-steps=2"),
    (["--learning-rate", "5e-6", "--lr-scheduler-kwargs", '{"min_lr_rate": 2}'],
     r"--lr-scheduler-kwargs min_lr_rate=2: expected 0 to 1, the floor's fraction of --learning-rate"),
])
def test_options_out_of_range_or_left_unused_are_refused_before_any_work(tmp_path, monkeypatch, extra, message):
    """Each of these trained and failed late (a `ZeroDivisionError`, a `KeyError` after the last step, a traceback
    after the data was packed), or trained while ignoring an option: a typo in --config-overrides, --data-files beside
    --data-dir, a tokenizer trained anew for an --init-from model that reads another's token ids; or trained on a
    rate that climbed from a peak below --min-learning-rate up to it; --stop-after-steps 0 trained the whole schedule
    (and -2 stopped after step 1), and one at or past --max-steps was left unused. An infinite --learning-rate trained
    on (NaN updates), a negative or NaN one failed in torch's AdamW after the data was packed, with any schedule. A
    --train-tokenizer below the byte alphabet failed after the dataset was read, naming `vocab_size` (0 asked for a
    --tokenizer). A --validation-fraction of NaN failed after the data was read
    (a negative one held out one block's documents, 1.5 was refused after --output-dir was made), a negative
    --num-proc after the tokenizer was trained, naming `num_proc`; a --peak-tflops of 0 was taken as not given, a
    negative one gave a negative MFU and an infinite one an MFU of 0; a `min_lr` in --lr-scheduler-kwargs failed in
    transformers after the tokenizer was trained ("Only one of min_lr or min_lr_rate should be set"). A floor in
    --lr-scheduler-kwargs won without a word over a --min-learning-rate that was typed, which a schedule without a
    floor (linear) left unused; the other cosine with a floor (cosine_warmup_with_min_lr) did not get
    --min-learning-rate and failed in transformers after the tokenizer was trained; a `min_lr_rate` beside a low
    --learning-rate was refused for the default --min-learning-rate it replaces. A --tokenizer beside
    --train-tokenizer was left unused, and so was a --dataset-config without --dataset or beside --data-files (their
    builder takes none); a --profile-steps ending past
    the run's last step wrote no profile (the profiler ran on to the end)."""
    monkeypatch.chdir(tmp_path)
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=20)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        pretrain.main(["--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
                       "--max-steps", "1", "--output-dir", str(out), *extra])
    assert not out.exists()


def test_a_min_lr_in_the_lr_scheduler_kwargs_is_the_floor_of_the_cosine_decay(tmp_path):
    """`--lr-scheduler-kwargs '{"min_lr": ...}'`, transformers' own way to give the cosine's floor, failed after the
    tokenizer was trained: the recipe set `min_lr_rate` beside it, which transformers refuses. It stands for
    --min-learning-rate now."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=40)
    out = tmp_path / "run"
    pretrain.main(["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
                   "--per-device-batch-size", "2", "--max-steps", "3", "--logging-steps", "1", "--save-steps", "100",
                   "--max-eval-blocks", "1", "--lr-scheduler-kwargs", '{"min_lr": 1e-4}', "--output-dir", str(out)])
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()]
    rates = {record["step"]: record["learning_rate"] for record in records if "learning_rate" in record}
    # one warmup step, then the cosine from the preset's 3e-3: halfway down to min_lr at step 3
    assert rates[3] == pytest.approx(1e-4 + (3e-3 - 1e-4) / 2)


def test_the_cosine_floor_is_given_once_and_a_default_min_learning_rate_gives_way(tmp_path):
    """A floor in --lr-scheduler-kwargs is taken where --min-learning-rate was not typed: its default neither
    contradicts nor bounds it (a `min_lr_rate` beside --learning-rate 5e-6 was refused for the default 1e-5), nor
    does it bound a --learning-rate alone. A typed --min-learning-rate, also abbreviated, is the floor of either
    cosine."""
    def floor(*extra):
        args, training = pretrain.parse_arguments(["--output-dir", str(tmp_path), *extra])
        pretrain.apply_the_cosine_floor(args, training)
        return training.lr_scheduler_kwargs

    assert floor("--learning-rate", "5e-6", "--lr-scheduler-kwargs", '{"min_lr_rate": 0.1}') == {"min_lr_rate": 0.1}
    assert floor("--learning-rate", "1e-3", "--lr-scheduler-kwargs", '{"min_lr": 1e-4}') == {"min_lr_rate": 0.1}
    assert floor("--learning-rate", "1e-3", "--min-learning-rate", "2e-4") == {"min_lr_rate": pytest.approx(0.2)}
    assert floor("--learning-rate", "1e-3", "--min-learning", "2e-4", "--lr-scheduler-type",  # (abbreviated)
                 "cosine_warmup_with_min_lr") == {"min_lr_rate": pytest.approx(0.2)}
    assert not floor("--lr-scheduler-type", "linear")
    # a --learning-rate at or below the default floor (fine-tuning at 5e-6) was refused, naming the untyped default:
    # the floor is then the fraction of it that the default is of the preset's rate (1e-5 of 3e-3)
    for scheduler in pretrain.COSINE_FLOOR_SCHEDULERS:
        assert floor("--learning-rate", "5e-6", "--lr-scheduler-type", scheduler) == {
            "min_lr_rate": pytest.approx(1e-5 / 3e-3)}
    assert floor("--learning-rate", "1e-5", "--preset", "1.3B") == {"min_lr_rate": pytest.approx(1e-5 / 1e-3)}
    assert floor("--learning-rate", "2e-5") == {"min_lr_rate": pytest.approx(0.5)}  # (below it: the default)
    with pytest.raises(ValueError, match=r"--lr-scheduler-kwargs sets min_lr=0.0001 and --min-learning-rate=1e-05"):
        floor("--min-learning", "1e-5", "--lr-scheduler-kwargs", '{"min_lr": 1e-4}')


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_training(tmp_path):
    """--init-from a model of this package with a --tokenizer of more tokens than its vocabulary (the model's own with
    tokens added, which the text does not use) trained until the first checkpoint, whose `save_pretrained` refused
    the attached tokenizer; it is refused before training, with that message."""
    from hf_memffn.tokenization import train_tokenizer

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=40)
    saved = tmp_path / "saved"
    tokenizer = train_tokenizer([json.loads(line)["text"] for line in corpus.read_text().splitlines()], vocab_size=300)
    AutoModelForCausalLM.from_config(pretrain.build_config("kvffn", "tiny", 300, tokenizer)).save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.save_pretrained(tmp_path / "larger")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"save_pretrained: the attached tokenizer has 302 tokens, more than the "
                                         r"model's vocab_size=300; attach the model's own tokenizer"):
        pretrain.main(["--init-from", str(saved), "--tokenizer", str(tmp_path / "larger"), "--data-files", str(corpus),
                       "--block-size", "32", "--per-device-batch-size", "2", "--max-steps", "2", "--save-steps", "1",
                       "--max-eval-blocks", "1", "--output-dir", str(out)])
    assert not list(out.glob("checkpoint-*")) and not (out / "train_log.jsonl").exists()
    # a new model given a vocabulary below its tokenizer's size: the Llama baseline, which attaches no tokenizer
    with pytest.raises(ValueError, match=r"the tokenizer has 300 tokens, more than the model's embedding has rows "
                                         r"\(256\): the ids past them would fail the forward"):
        pretrain.main(["--arch", "llama", "--config-overrides", "vocab_size=256", "--data-files", str(corpus),
                       "--train-tokenizer", "300", "--block-size", "32", "--max-steps", "2", "--save-steps", "1",
                       "--output-dir", str(tmp_path / "llama")])
    assert not list((tmp_path / "llama").glob("checkpoint-*"))


def test_config_overrides_set_the_vocabulary_of_a_new_model():
    """--config-overrides vocab_size (a larger vocabulary than the tokenizer's padded size) failed in a `TypeError`,
    "build_config() got multiple values for argument 'vocab_size'", before any work."""
    from hf_memffn.tokenization import train_tokenizer

    tokenizer = train_tokenizer(["the key reads a value from memory"] * 10, vocab_size=300)
    args = pretrain.SimpleNamespace(init_from=None, arch="kvffn", preset="tiny", config_overrides="vocab_size=384",
                                    block_size=32)
    assert pretrain.build_model(args, tokenizer).config.vocab_size == 384


@pytest.mark.parametrize("arch", ["llama", "memoryllm"])
def test_a_new_model_has_positions_for_its_block_size(arch):
    """The tiny preset's 512 positions under the default --block-size of 1024 trained a model at 1024 positions whose
    saved config said 512 (and this package's models warned of positions never trained); an override of fewer
    positions than a block is refused."""
    from hf_memffn.tokenization import train_tokenizer

    tokenizer = train_tokenizer(["the key reads a value from memory"] * 10, vocab_size=300)
    args = pretrain.SimpleNamespace(init_from=None, arch=arch, preset="tiny", config_overrides="", block_size=1024)
    assert pretrain.build_model(args, tokenizer).config.max_position_embeddings == 1024
    args.block_size = 256
    assert pretrain.build_model(args, tokenizer).config.max_position_embeddings == 512
    args.config_overrides = "max_position_embeddings=768"
    assert pretrain.build_model(args, tokenizer).config.max_position_embeddings == 768
    args.block_size = 1024
    with pytest.raises(ValueError, match=r"--config-overrides max_position_embeddings=768 is below --block-size=1024"):
        pretrain.build_model(args, tokenizer)


def test_resuming_a_checkpoint_beyond_max_steps_is_refused_before_any_work(tmp_path):
    """A checkpoint at step 6 resumed with --max-steps 4 was taken as one at --max-steps: "nothing left to train",
    and the 6 steps' weights were saved and evaluated as the 4-step run's (the log rewound to the checkpoint's)."""
    from transformers import TrainerState

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=20)
    out = tmp_path / "run"
    (out / "checkpoint-6").mkdir(parents=True)
    TrainerState(global_step=6, max_steps=6).save_to_json(str(out / "checkpoint-6" / "trainer_state.json"))
    (out / "train_log.jsonl").write_text('{"step": 6, "loss": 1.0}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--max-steps=4: the checkpoint to resume from \('.*checkpoint-6'\) is at "
                                         r"step 6, beyond it; resume with --max-steps 6 or more"):
        pretrain.main(["--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
                       "--max-steps", "4", "--output-dir", str(out), "--resume", "latest"])
    assert sorted(path.name for path in out.iterdir()) == ["checkpoint-6", "train_log.jsonl"]
    assert (out / "train_log.jsonl").read_text(encoding="utf-8") == '{"step": 6, "loss": 1.0}\n'


def test_a_folder_of_a_run_stopped_before_its_first_checkpoint_is_not_sent_to_resume(tmp_path):
    """A run stopped before its first checkpoint leaves its log: run again, it was refused with "pass --resume
    latest", and with --resume latest refused again, as holding no checkpoint, with no word on what to do. Each
    refusal now says what to do instead, and neither touches the folder."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=20)
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_log.jsonl").write_text('{"step": 10, "loss": 5.0}\n', encoding="utf-8")
    common = ["--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32", "--max-steps", "40",
              "--output-dir", str(out)]
    with pytest.raises(ValueError, match=r"--output-dir=.* holds a run \(train_log.jsonl\) without a checkpoint to "
                                         r"resume from: remove train_log.jsonl to start afresh, or choose another"):
        pretrain.main(common)
    with pytest.raises(ValueError, match=r"--resume latest: no checkpoint-\* folder in --output-dir=.*, so nothing to "
                                         r"resume from .*: run without --resume"):
        pretrain.main(common + ["--resume", "latest"])
    assert [path.name for path in out.iterdir()] == ["train_log.jsonl"]


def test_data_files_named_twice_or_of_two_formats_are_refused_before_any_work(tmp_path, monkeypatch):
    """A file named twice (by a path and a glob) was read twice: its documents trained on twice, and the held-out
    ones (the last documents) trained on as the other copy; spelled `./a.jsonl` beside `a.jsonl`, or named through a
    link, it still was. Files of two formats were all read with the first file's builder: each JSON line of a .jsonl
    after a .txt trained on as a line of text."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "corpus.jsonl", documents=20)
    (tmp_path / "notes.txt").write_text("the key reads a value\n", encoding="utf-8")
    out = tmp_path / "run"
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "corpus.jsonl")
    for files, message in ((["corpus.jsonl", "*.jsonl"], r"--data-files names '.*corpus.jsonl' more than once"),
                           (["./corpus.jsonl", "corpus.jsonl"], r"--data-files names '.*corpus.jsonl' more than once"),
                           (["corpus.jsonl", "link.jsonl"], r"--data-files names '.*corpus.jsonl' more than once"),
                           (["notes.txt", "corpus.jsonl"], r"--data-files mixes formats: text \('.*notes.txt'\), "
                                                           r"json \('.*corpus.jsonl'\)")):
        with pytest.raises(ValueError, match=message):
            pretrain.main(["--data-files", *files, "--train-tokenizer", "300", "--block-size", "32",
                           "--max-steps", "1", "--output-dir", str(out)])
        assert not out.exists()


def test_data_files_of_a_glob_that_matches_no_file_are_refused_naming_it(tmp_path, monkeypatch):
    """`datasets` passes over a glob that matches no file: beside another pattern, a mistyped one left its files out
    of training without a word; alone, it failed with a bare `StopIteration`."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "corpus.jsonl", documents=20)
    out = tmp_path / "run"
    for files in (["corpus.jsonl", "more/*.jsonl"], ["more/*.jsonl"], ["corpus.jsonl", "missing.jsonl"]):
        with pytest.raises(ValueError, match=rf"--data-files: '{re.escape(files[-1])}' matches no file"):
            pretrain.main(["--data-files", *files, "--train-tokenizer", "300", "--block-size", "32",
                           "--max-steps", "1", "--output-dir", str(out)])
        assert not out.exists()


def test_data_files_without_text_are_refused_before_any_work(tmp_path, monkeypatch):
    """--data-files of empty files (or of blank lines only) failed in `datasets` after --output-dir was made: a bare
    `StopIteration` for a .jsonl, "An error occurred while generating the dataset" for a .txt, "Instruction "train"
    corresponds to no data!" for blank lines, naming neither the option nor the file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b"\r\n\n  \n")
    out = tmp_path / "run"
    for files, message in ((["empty.jsonl"], r"--data-files: '.*empty.jsonl' holds no text \(empty, or blank lines "
                                             r"only\), so no document to train on"),
                           (["empty.txt", "blank.txt"], r"--data-files: none of its 2 files \('.*empty.txt', \.\.\.\) "
                                                        r"holds text")):
        with pytest.raises(ValueError, match=message):
            pretrain.main(["--data-files", *files, "--train-tokenizer", "300", "--block-size", "32",
                           "--max-steps", "1", "--output-dir", str(out)])
        assert not out.exists()


def write_shards(shards, held_out_documents):
    """Token shards of one short document (train.bin: 40 copies) in a new folder `shards` with their tokenizer of 300
    ids at most; heldout.bin holds `held_out_documents(document)`. Returns the folder and heldout.bin's token count."""
    import token_shards

    from hf_memffn.tokenization import train_tokenizer

    shards.mkdir()
    tokenizer = train_tokenizer(["the key reads a value from memory"] * 10, vocab_size=300)
    tokenizer.save_pretrained(shards)
    document = tokenizer("the key reads a value from memory", add_special_tokens=False)["input_ids"]
    token_shards.write_split(shards, "train", [document] * 40, tokenizer.eos_token_id)
    return shards, token_shards.write_split(shards, "heldout", held_out_documents(document), tokenizer.eos_token_id)


def test_held_out_shard_shorter_than_a_block_is_refused(tmp_path):
    """A heldout.bin of fewer tokens than --block-size gave no evaluation block: the run trained to the end, then
    failed with `KeyError: 'eval_loss'` before saving the final model."""
    shards, held_out = write_shards(tmp_path / "shards", lambda document: [document] * 2)
    assert held_out < 32
    with pytest.raises(ValueError, match=rf"--data-dir=.*: heldout.bin holds {held_out} tokens, fewer than "
                                         r"--block-size=32, so no evaluation block"):
        pretrain.main(["--arch", "llama", "--data-dir", str(shards), "--block-size", "32", "--max-steps", "2",
                       "--per-device-batch-size", "2", "--save-steps", "100", "--output-dir", str(tmp_path / "run")])


def test_training_text_of_fewer_blocks_than_one_step_is_refused(tmp_path):
    """Fewer training blocks than one step's 8 trained: every step on all of them, its tokens/s and MFU counting the
    tokens of 8 blocks (two blocks in a batch of 8 reported four times the tokens that trained)."""
    import token_shards

    shards, _ = write_shards(tmp_path / "shards", lambda document: [document] * 10)
    train_blocks = len(token_shards.load_blocks(shards, 64))
    assert train_blocks < 8
    with pytest.raises(ValueError, match=rf"the training text gives {train_blocks} block\(s\) of --block-size=64 "
                                         r"tokens, fewer than the 8 of one optimizer step \(--per-device-train-batch-"
                                         r"size 4 x --gradient-accumulation-steps 2 x 1 process\(es\)\)"):
        pretrain.main(["--arch", "llama", "--data-dir", str(shards), "--block-size", "64", "--max-steps", "2",
                       "--per-device-batch-size", "4", "--grad-accum", "2", "--save-steps", "100",
                       "--output-dir", str(tmp_path / "run")])


def test_a_tokenizer_without_eos_is_refused_naming_the_option_that_gave_it(tmp_path):
    """--data-dir's own tokenizer, taken where --tokenizer is left out, was refused as "--tokenizer='DIR' has no EOS
    token": an option the command did not have."""
    from transformers import AutoTokenizer

    shards, _ = write_shards(tmp_path / "shards", lambda document: [document] * 10)
    without_eos = AutoTokenizer.from_pretrained(shards)
    without_eos.eos_token = None
    without_eos.save_pretrained(shards)
    without_eos.save_pretrained(tmp_path / "other")
    common = ["--arch", "llama", "--data-dir", str(shards), "--block-size", "16", "--max-steps", "1",
              "--per-device-batch-size", "2", "--save-steps", "100"]
    for extra, option in (([], "--data-dir"), (["--tokenizer", str(tmp_path / "other")], "--tokenizer")):
        with pytest.raises(ValueError, match=rf"^{option}='[^']*': its tokenizer has no EOS token"):
            pretrain.main([*common, *extra, "--output-dir", str(tmp_path / "run")])


def test_a_data_dir_that_holds_no_shards_is_refused_before_any_work(tmp_path):
    """A mistyped --data-dir, or the folder above the shards, made --output-dir and then failed loading the tokenizer
    (a Hub repo id error, or one about sentencepiece) naming neither the option nor what the folder lacks."""
    shards, _ = write_shards(tmp_path / "shards", lambda document: [document] * 10)
    (shards / "heldout.bin").rename(tmp_path / "heldout.bin")
    out = tmp_path / "run"
    for data_dir, message in ((tmp_path / "no_such_folder", r"--data-dir='.*no_such_folder' is not a folder"),
                              (tmp_path, r"--data-dir='.*' lacks train.bin, a tokenizer \(tokenizer.json; or pass "
                                         r"--tokenizer\): give a folder of token shards"),
                              (shards, r"--data-dir='.*shards' lacks heldout.bin: give a folder of token shards")):
        with pytest.raises(ValueError, match=message):
            pretrain.main(["--arch", "llama", "--data-dir", str(data_dir), "--block-size", "16", "--max-steps", "2",
                           "--save-steps", "100", "--output-dir", str(out)])
        assert not out.exists()


@pytest.mark.parametrize("extra, named", [
    (["--text-column", "body"], "--text-column"),
    (["--validation-fraction", "0.2"], "--validation-fraction"),
    (["--validation_split=test", "--num-proc", "4"], "--validation-split, --num-proc"),
    (["--train-split", "train"], "--train-split"),  # (typed, even at its default)
])
def test_options_of_text_data_beside_a_data_dir_are_refused_naming_them(tmp_path, extra, named):
    """Token shards are tokenized and split already: --text-column, --train-split, --validation-split,
    --validation-fraction and --num-proc beside --data-dir trained without a word, as if they had taken effect (a
    held-out fraction that was not held out)."""
    shards, _ = write_shards(tmp_path / "shards", lambda document: [document] * 10)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"^--data-dir reads token shards, already tokenized and split into "
                                         rf"train.bin and heldout.bin, so {named} would be left unused: drop"):
        pretrain.main(["--arch", "llama", "--data-dir", str(shards), "--block-size", "16", "--max-steps", "1",
                       "--per-device-batch-size", "2", "--save-steps", "100", "--output-dir", str(out), *extra])
    assert not out.exists()


def test_a_validation_fraction_beside_a_validation_split_is_refused(tmp_path):
    """A dataset with a validation split evaluates on it: a --validation-fraction typed beside it held out nothing
    and trained on every document without a word."""
    (tmp_path / "data").mkdir()
    write_corpus(tmp_path / "data" / "train.jsonl", documents=40, seed=1)
    write_corpus(tmp_path / "data" / "validation.jsonl", documents=10, seed=2)
    common = ["--arch", "llama", "--dataset", str(tmp_path / "data"), "--train-tokenizer", "300", "--block-size",
              "16", "--max-steps", "1", "--per-device-batch-size", "2", "--save-steps", "100"]
    with pytest.raises(ValueError, match=r"^--validation-fraction=0.2: the dataset has a 'validation' split, which "
                                         r"is the held-out text, so no training document is held out: drop"):
        pretrain.main([*common, "--validation-fraction", "0.2", "--output-dir", str(tmp_path / "run")])


def test_shards_with_ids_beyond_the_embedding_are_refused(tmp_path):
    """Shards tokenized for a larger vocabulary than the model's trained until the first such id, then failed in the
    embedding (an `IndexError` here, a device-side assert on a GPU); they are refused before training, naming the id
    and the embedding's rows."""
    shards, _ = write_shards(tmp_path / "shards", lambda document: [document * 3 + [500]] * 4)
    rows = 320  # the tokenizer's ids (300 at most) padded to a multiple of 64
    with pytest.raises(ValueError, match=rf"--data-dir=.*: heldout.bin holds token id 500, but the model's embedding "
                                         rf"has {rows} rows"):
        pretrain.main(["--arch", "llama", "--data-dir", str(shards), "--block-size", "16", "--max-steps", "2",
                       "--per-device-batch-size", "2", "--save-steps", "100", "--output-dir", str(tmp_path / "run")])
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_shards_of_another_tokenizer_than_the_one_given_are_refused(tmp_path):
    """A --tokenizer other than the one the shards were made with (meta.json records its vocabulary size and EOS id)
    trained without a word: every id fitted the embedding, and each named another token than the shards' did."""
    import token_shards
    from transformers import AutoTokenizer

    from hf_memffn.tokenization import train_tokenizer

    shards, _ = write_shards(tmp_path / "shards", lambda document: [document] * 10)
    own = AutoTokenizer.from_pretrained(shards)
    token_shards.write_meta(shards, {"tokenizer": {"vocab_size": len(own), "eos_id": own.eos_token_id}})
    other = train_tokenizer(["a value from the memory of the layer, read by each key"] * 10, vocab_size=280)
    other.save_pretrained(tmp_path / "other")
    assert len(other) != len(own)
    common = ["--arch", "llama", "--data-dir", str(shards), "--block-size", "16", "--max-steps", "1",
              "--per-device-batch-size", "2", "--save-steps", "100", "--max-eval-blocks", "1"]
    with pytest.raises(ValueError, match=rf"--data-dir=.*: its meta.json records the tokenizer the shards were made "
                                         rf"with, of vocab_size {len(own)} \(the tokenizer's: {len(other)}\), another "
                                         r"than --tokenizer='.*other'"):
        pretrain.main(common + ["--tokenizer", str(tmp_path / "other"), "--output-dir", str(tmp_path / "run")])
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    # the shards' own tokenizer, saved beside them or named, trains
    assert pretrain.main(common + ["--output-dir", str(tmp_path / "own")])["global_step"] == 1
    named = pretrain.main(common + ["--tokenizer", str(shards), "--output-dir", str(tmp_path / "named")])
    assert named["global_step"] == 1


def test_a_run_that_diverged_writes_its_log_and_summary_as_strict_json(tmp_path):
    """A loss or gradient norm that was not finite (a run that diverged, here at a learning rate of 1e30) went into
    train_log.jsonl and summary.json as the bare word `NaN`, which jq, JavaScript and strict `json.loads` refuse. It
    is null there, its field named under `not_finite`, and the readers of these files (compare_loss_curves.py,
    `--resume`'s rewind of the log) take it back as NaN."""
    import compare_loss_curves

    shards, _ = write_shards(tmp_path / "shards", lambda document: [document] * 10)
    out = tmp_path / "run"
    summary = pretrain.main(["--arch", "llama", "--data-dir", str(shards), "--block-size", "16", "--max-steps", "3",
                             "--per-device-batch-size", "2", "--save-steps", "100", "--logging-steps", "1",
                             "--eval-steps", "3", "--learning-rate", "1e30", "--min-learning-rate", "0",
                             "--logging-nan-inf-filter", "false", "--output-dir", str(out)])
    assert math.isnan(summary["eval_loss"])

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    written = strict((out / "summary.json").read_text())
    assert written["eval_loss"] is None and written["not_finite"] == {"eval_loss": "NaN"}
    log = [strict(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert any(record.get("not_finite") for record in log)
    curves = compare_loss_curves.read_curves(out)
    assert math.isnan(curves["eval"][3]) and math.isnan(curves["summary"]["eval_loss"])
    # the rewind of a resume keeps a record whose entry is NaN (with its tokens/s) and writes it strict again
    records = [pretrain.read_run_record(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    history = [{key: value for key, value in record.items() if key != "tokens_per_second"} for record in records]
    pretrain.rewind_train_log(out / "train_log.jsonl", history)
    rewound = (out / "train_log.jsonl").read_text().splitlines()
    assert [strict(line) for line in rewound] == log


def test_config_overrides_apply_to_an_init_from_model(tmp_path):
    """--config-overrides with --init-from set the saved config's fields (they were ignored); one that would load the
    model without some of its saved weights is refused, and so is an --arch typed beside it that names another
    architecture than the saved model's (it was left unused, and the summary named it)."""
    from hf_memffn.tokenization import train_tokenizer

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=40)
    saved = tmp_path / "saved"
    tokenizer = train_tokenizer([json.loads(line)["text"] for line in corpus.read_text().splitlines()], vocab_size=300)
    config = pretrain.build_config("flash_mhf", "tiny", 320, tokenizer, ffn_kernel="torch")
    AutoModelForCausalLM.from_config(config).save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    common = ["--init-from", str(saved), "--data-files", str(corpus), "--block-size", "32",
              "--per-device-batch-size", "2", "--max-steps", "1", "--save-steps", "100", "--max-eval-blocks", "1"]
    summary = pretrain.main(common + ["--config-overrides", "attention_dropout=0.25,rms_norm_eps=0.001",
                                      "--output-dir", str(tmp_path / "run")])
    final = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert (final["attention_dropout"], final["rms_norm_eps"]) == (0.25, 0.001) and summary["global_step"] == 1
    with pytest.raises(ValueError, match=r"--arch=kvffn: the model of --init-from=.* is a memffn_flash_mhf model, "
                                         r"not a memffn_kvffn one; drop --arch"):  # (it trained the saved model)
        pretrain.main(common + ["--arch", "kvffn", "--output-dir", str(tmp_path / "run3")])
    assert not list((tmp_path / "run3").glob("checkpoint-*"))
    with pytest.raises(ValueError, match=r"--config-overrides of ffn_io_projections: the model of --init-from=.* would "
                                         r"load without some of its saved weights \(model.layers.0.mlp.in_proj.weight"):
        pretrain.main(common + ["--config-overrides", "ffn_io_projections=false",
                                "--output-dir", str(tmp_path / "run2")])


def test_init_from_a_folder_of_variant_weights_loads_them(tmp_path):
    """--init-from a folder saved with `save_pretrained(folder, variant="ema")` (`model.ema.safetensors` only) failed
    after the corpus was tokenized and packed, in "no file named model.safetensors, or pytorch_model.bin", with no
    option to name the variant; it loads the variant's weights, as the package's commands do."""
    from hf_memffn.tokenization import train_tokenizer

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=40)
    saved = tmp_path / "saved"
    tokenizer = train_tokenizer([json.loads(line)["text"] for line in corpus.read_text().splitlines()], vocab_size=300)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(pretrain.build_config("kvffn", "tiny", 320, tokenizer))
    model.save_pretrained(saved, variant="ema")
    tokenizer.save_pretrained(saved)
    assert not (saved / "model.safetensors").exists()
    loaded = pretrain.from_pretrained_main_process_first(str(saved), dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    summary = pretrain.main(["--init-from", str(saved), "--data-files", str(corpus), "--block-size", "32",
                             "--per-device-batch-size", "2", "--max-steps", "1", "--save-steps", "100",
                             "--max-eval-blocks", "1", "--output-dir", str(tmp_path / "run")])
    assert summary["global_step"] == 1 and (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_the_recipe_without_the_train_extras_names_the_package_and_the_extra_in_one_line(monkeypatch):
    """Without accelerate, transformers' TrainingArguments do not import: `pretrain.py --help` ended in transformers'
    "Could not import module 'TrainingArguments'" traceback. Without datasets, reading --dataset or --data-files
    ended in the import's traceback."""
    from types import SimpleNamespace

    from hf_memffn.testing import blocked_imports, run_python

    script = blocked_imports("accelerate") + (
        f"import runpy, sys; sys.argv = ['pretrain.py', '--help']; "
        f"runpy.run_path({str(EXAMPLES / 'pretrain.py')!r}, run_name='__main__')")
    completed = run_python(script)
    assert completed.returncode == 1 and "Traceback" not in completed.stderr, completed.stderr[-2000:]
    assert completed.stderr.strip() == (
        "examples/pretrain.py: error: transformers' Trainer needs the 'accelerate' package, which is not installed: "
        "pip install 'hf-memffn[train]' (or pip install accelerate)")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"--dataset / --data-files needs the 'datasets' package, which is not "
                                         r"installed: pip install 'hf-memffn\[train\]' \(or pip install datasets\)"):
        pretrain.load_raw_splits(SimpleNamespace(data_files=None, dataset="some/dataset", dataset_config=None))


def test_the_precision_help_says_what_auto_trains_in_without_a_gpu():
    """`--precision`'s help read "auto: bf16 on GPUs that have it; bf16 also on CPU", which says auto picks bf16 on a
    CPU; it trains in float32 there (bf16 only where asked for, with --precision bf16), as README says."""
    from dataclasses import fields

    help_text = next(field for field in fields(pretrain.RecipeArguments) if field.name == "precision").metadata["help"]
    assert "fp32 on CPU" in help_text and "--precision bf16" in help_text, help_text


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_data_is_loaded(tmp_path, monkeypatch,
                                                                                   read_only_folder):
    """--output-dir that is a file, inside a file, or in a folder this user cannot write: a ValueError naming
    --output-dir and the path, before the data is loaded and a tokenizer trained (a file failed in `mkdir` with
    `File exists`, naming no option; a read-only folder trained until the first log line or checkpoint was written).
    (Run as root, which writes anywhere, the folder's mode is read by `os.access` as for another user.)"""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=20)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    read_only = read_only_folder
    loaded = []
    monkeypatch.setattr(pretrain, "load_data", lambda *args, **kwargs: loaded.append(args) or [][5])
    for out, reason in ((a_file, "is a file"), (a_file / "run", "which is a file"),
                        (read_only, "not writable"), (read_only / "run", "not writable")):
        with pytest.raises(ValueError, match=f"--output-dir.*{re.escape(repr(str(out)))}.*{reason}"):
            pretrain.main(["--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
                           "--max-steps", "1", "--output-dir", str(out)])
    assert not loaded and a_file.read_text() == "not a folder\n"
    assert os.listdir(read_only) == []


def test_resuming_on_other_token_shards_of_as_many_blocks_is_refused_reading_a_few_blocks(tmp_path):
    """Token shards (--data-dir) rewritten with as many tokens (here train.bin's tokens reversed) resumed without a
    word, the block count being the same. Their fingerprint reads a bounded number of blocks spread over the shards
    (the first and last among them), not the whole corpus; a resume whose fingerprint differs is refused naming
    --data-dir's train.bin."""
    import numpy as np
    import token_shards

    shards, _ = write_shards(tmp_path / "shards", lambda document: [document] * 10)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-dir", str(shards), "--block-size", "16", "--per-device-batch-size", "2",
              "--save-steps", "2", "--eval-steps", "100", "--output-dir", str(out)]
    pretrain.main(common + ["--max-steps", "2"])
    train = token_shards.split_path(shards, "train")
    tokens = np.fromfile(train, dtype=token_shards.TOKEN_DTYPE)
    train.write_bytes(tokens[::-1].tobytes())
    with pytest.raises(ValueError, match=r"--resume: .*checkpoint-2'\) was trained on \d+ blocks of 16 tokens of "
                                         r"fingerprint [0-9a-f]{12}, the training text of these arguments "
                                         r"\(--data-dir's train.bin\) gives as many of fingerprint [0-9a-f]{12}"):
        pretrain.main(common + ["--max-steps", "3", "--resume", "latest"])

    class CountedBlocks(token_shards.TokenBlocks):
        read = 0

        def __getitem__(self, index):
            CountedBlocks.read += 1
            return super().__getitem__(index)

    many = np.arange(4 * 10_000, dtype=token_shards.TOKEN_DTYPE)
    fingerprint = pretrain.blocks_fingerprint(CountedBlocks(many, 4))
    assert CountedBlocks.read <= pretrain.FINGERPRINTED_SHARD_BLOCKS
    last_changed = many.copy()
    last_changed[-1] += 1
    assert pretrain.blocks_fingerprint(token_shards.TokenBlocks(last_changed, 4)) != fingerprint
    assert pretrain.blocks_fingerprint(token_shards.TokenBlocks(many.copy(), 4)) == fingerprint
