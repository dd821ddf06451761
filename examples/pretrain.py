"""Pretrain (or fine-tune) any hf-memffn architecture, or the Llama baseline, with the transformers `Trainer`.

Text comes from a `datasets` dataset: a Hub name (`--dataset HuggingFaceFW/fineweb-edu --dataset-config sample-10BT`)
or local files (`--data-files corpus/*.jsonl`, builder inferred from the suffix: text, json, csv, parquet; all
training text: a folder of `train.jsonl` and `validation.jsonl` as `--dataset FOLDER` gives a validation file).
Documents are tokenized, joined with EOS and packed into fixed blocks of `--block-size` tokens. Or it comes already
tokenized: `--data-dir DIR` of uint16 token shards (examples/token_shards.py; train.bin, heldout.bin and the
tokenizer), which needs no `datasets`.

Single process:
    python examples/pretrain.py --arch flash_mhf --preset 128M --dataset ... --tokenizer EleutherAI/gpt-neox-20b \
        --block-size 4096 --per-device-batch-size 8 --grad-accum 8 --max-steps 245000 --output-dir runs/fmhf-128m
Several GPUs (configs in examples/accelerate/):
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/pretrain.py <same arguments>
On CPU (no GPU) it trains on the CPU; several CPU processes form one gloo run when launched with
    torchrun --nproc_per_node 2 examples/pretrain.py <same arguments>
(`accelerate launch --cpu --num_processes 2` starts one process: accelerate starts several only through mpirun.)
Resume: add `--resume latest` (or a checkpoint folder). Fine-tune a saved model: `--init-from DIR_OR_REPO`.

Arguments are dataclasses read by transformers' `HfArgumentParser`: this recipe's (`ModelArguments`,
`DataArguments`, `RecipeArguments`) and every `TrainingArguments` field (`--help` lists them all; `-` and `_` are
interchangeable), with the recipe's defaults (`TRAINING_DEFAULTS`). Optimiser defaults are flash-mhf.md Table 3: AdamW
(0.9, 0.95), weight decay 0.1, cosine to 1e-5 with 1.5% warmup, learning rate from the preset. `--precision bf16`
works on CPU too (bf16 autocast). Every log line carries tokens/s and MFU (model FLOPs utilisation: 6 N + 12 L d T
FLOPs per token over the device's dense bf16 peak, `--peak-tflops` to override); parameters partitioned by DeepSpeed
ZeRO-3 count with their full size (`ds_numel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from presets import ARCHITECTURE_NAMES, OPTIMIZER_DEFAULTS, PRESETS, get_preset  # noqa: E402,F401 (tests read the names here)

LOCAL_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# Dense bf16 tensor-core peak per device, TFLOP/s (datasheet, SXM parts).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0}
TOKENIZER_DIR = "tokenizer"
# A byte-order mark (Windows editors write one) is no text: the text builder kept it at the start of a file's first
# document (the json and csv builders leave it out).
TEXT_OPTIONS = {"encoding": "utf-8-sig"}


# --- arguments ----------------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    arch: Literal["llama", "flash_mhf", "memoryllm", "flex_memoryllm", "kvffn"] = "flash_mhf"
    preset: str = field(default="tiny", metadata={"help": f"model size: one of {sorted(PRESETS)}"})
    config_overrides: str = field(default="", metadata={"help": "comma-separated key=value config fields, e.g. ffn_kernel=triton"})
    init_from: str | None = field(default=None, metadata={"help": "fine-tune: start from this saved model (folder or Hub repo)"})


@dataclass
class DataArguments:
    dataset: str | None = field(default=None, metadata={
        "help": "Hub dataset name, a local folder of data files (splits named after the files: train.jsonl, "
                "validation.jsonl), or a `datasets` builder (text/json/...) for --data-files"})
    dataset_config: str | None = None
    data_files: list[str] | None = field(default=None, metadata={"help": "local text/jsonl/csv/parquet files (globs allowed)"})
    data_dir: str | None = field(default=None, metadata={"help": "pre-tokenized shards (train.bin, heldout.bin, tokenizer) instead"})
    text_column: str = "text"
    train_split: str = "train"
    validation_split: str = field(default="validation", metadata={
        "help": "held-out split: 'validation' is used when the dataset has it; another name must be a split"})
    validation_fraction: float = field(default=0.01, metadata={"help": "the last documents held out otherwise"})
    block_size: int = 1024
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder or Hub name (default: --init-from's)"})
    train_tokenizer: int | None = field(default=None, metadata={"help": "train a byte-level BPE of this vocabulary size on the training text"})
    num_proc: int | None = field(default=None, metadata={"help": "processes for tokenization"})
    max_eval_blocks: int | None = field(default=None, metadata={"help": "cap on held-out blocks evaluated (a resumed "
                                        "run keeps the run's: its evaluation losses compare one set of blocks)"})


@dataclass
class RecipeArguments:
    precision: Literal["auto", "bf16", "fp32"] = field(default="auto", metadata={
        "help": "auto: bf16 on GPUs that have it, else fp32 (fp32 on CPU; fp16 with --fp16); --precision bf16 trains "
                "in bf16 autocast on CPU too"})
    min_learning_rate: float = OPTIMIZER_DEFAULTS["min_learning_rate"]
    stop_after_steps: int | None = field(default=None, metadata={"help": "stop at this step, keeping the --max-steps schedule"})
    resume: str | None = field(default=None, metadata={"help": "checkpoint folder, or 'latest' for the newest in "
                               "--output-dir; the run's model, data, batch, optimizer and schedule settings must be "
                               "its own (a longer --max-steps, other logging, evaluation and saving intervals may be "
                               "given)"})
    peak_tflops: float | None = field(default=None, metadata={"help": "device peak for MFU (default: known GPUs' bf16 peak)"})
    profile_steps: str | None = field(default=None, metadata={"help": "FIRST:LAST: profile these training steps on the "
                                      "main process; writes profile_steps.json and profile_steps.txt to --output-dir"})


# TrainingArguments defaults of the recipe (the learning rate defaults to the preset's).
TRAINING_DEFAULTS = {
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "lr_scheduler_type": "cosine_with_min_lr",
    "warmup_steps": OPTIMIZER_DEFAULTS["warmup_ratio"],  # a float in [0, 1) is a ratio of the total steps
    "weight_decay": OPTIMIZER_DEFAULTS["weight_decay"],
    "adam_beta1": OPTIMIZER_DEFAULTS["adam_beta1"],
    "adam_beta2": OPTIMIZER_DEFAULTS["adam_beta2"],
    "max_grad_norm": 1.0,
    "logging_steps": 10,
    "eval_strategy": "steps",
    "eval_steps": 500,
    "prediction_loss_only": True,
    "save_strategy": "steps",
    "save_steps": 1000,
    "save_total_limit": 2,
    "seed": 0,
    "report_to": "none",
    "ddp_find_unused_parameters": False,
    "remove_unused_columns": False,
    "disable_tqdm": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "activation_checkpointing_kwargs": {"use_reentrant": False},
}
# Flags of earlier versions of this recipe -> the TrainingArguments flag they are now.
RENAMED_FLAGS = {
    "--per-device-batch-size": ("--per_device_train_batch_size", "--per_device_eval_batch_size"),
    "--grad-accum": ("--gradient_accumulation_steps",),
    "--num-epochs": ("--num_train_epochs",),
    "--warmup-ratio": ("--warmup_steps",),
    "--gradient-checkpointing": ("--gradient_checkpointing",),  # see _renamed_flags
}
RECIPE_DATACLASSES = (ModelArguments, DataArguments, RecipeArguments)


# The extra of pyproject.toml that installs what the recipe imports besides the package's own dependencies
TRAIN_EXTRA = "pip install 'hf-memffn[train]'"


def require_package(name: str, needed_for: str) -> None:
    """Stops with one line naming package `name` and the extra that installs it, where it is not installed (else an
    import deep in transformers or the data loading would end in a traceback)."""
    if importlib.util.find_spec(name) is None:
        raise SystemExit(f"examples/pretrain.py: error: {needed_for} needs the {name!r} package, which is not "
                         f"installed: {TRAIN_EXTRA} (or pip install {name})")


def _training_argument_names() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


def _renamed_flags() -> dict[str, tuple[str, ...]]:
    """`RENAMED_FLAGS` for the installed transformers: from 5.25 on, `gradient_checkpointing` is a deprecated alias
    of `activation_checkpointing` (a FutureWarning), so `--gradient-checkpointing` becomes the new name there."""
    if "activation_checkpointing" not in _training_argument_names():
        return RENAMED_FLAGS
    return {**RENAMED_FLAGS, "--gradient-checkpointing": ("--activation_checkpointing",)}


def _renamed(argv: list[str]) -> list[str]:
    renamed_flags = _renamed_flags()
    out = []
    for i, token in enumerate(argv):
        flag, eq, value = token.partition("=")
        names = renamed_flags.get(flag)
        if names is None:
            out.append(token)
            continue
        takes_value = flag != "--gradient-checkpointing"
        if eq or not takes_value:
            out += [name + eq + value for name in names]
        else:  # the value follows: repeat it after every new flag but the last
            value = argv[i + 1] if i + 1 < len(argv) else ""
            for name in names[:-1]:
                out += [name, value]
            out.append(names[-1])
    return out


def build_parser(preset: str = "tiny"):
    """HfArgumentParser over the recipe's dataclasses and TrainingArguments, with the recipe's defaults."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((*RECIPE_DATACLASSES, TrainingArguments), description=__doc__.split("\n\n")[0])
    known = _training_argument_names()
    parser.set_defaults(**{key: value for key, value in TRAINING_DEFAULTS.items() if key in known},
                        learning_rate=get_preset(preset).learning_rate)
    return parser


def parse_arguments(argv=None):
    """(recipe arguments as one namespace, TrainingArguments) from the command line."""
    import argparse

    require_package("accelerate", "transformers' Trainer")  # (its TrainingArguments refuse to import without it)
    from transformers import TrainingArguments

    argv = _renamed(list(sys.argv[1:] if argv is None else argv))
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--preset", default=ModelArguments.preset)
    preset = peek.parse_known_args(argv)[0].preset
    get_preset(preset)  # a clear error for an unknown preset
    parser = build_parser(preset)
    namespace = vars(parser.parse_args(argv))
    given = given_options(preset, argv)
    recipe = {}
    for dtype in RECIPE_DATACLASSES:
        names = [f.name for f in dataclasses.fields(dtype)]
        recipe.update(dataclasses.asdict(dtype(**{name: namespace.pop(name) for name in names})))
    if not namespace.get("output_dir") or namespace["output_dir"] == "trainer_output":
        parser.error("--output-dir is required")
    cuda = torch.cuda.is_available()
    precision = recipe["precision"]
    # TrainingArguments' own --bf16 / --fp16 name a precision too: one that --precision contradicts is refused, and
    # auto takes an explicit --fp16 instead of adding bf16 to it (TrainingArguments refuses the two together)
    asked = [flag for flag in ("bf16", "fp16") if namespace.get(flag)]
    conflicting = {"fp32": asked, "bf16": [flag for flag in asked if flag == "fp16"]}.get(precision, [])
    if conflicting:
        parser.error(f"--precision {precision} contradicts --{conflicting[0]}: pass one of them (--precision takes "
                     "bf16, fp32 or auto; --fp16 goes with --precision auto)")
    namespace["bf16"] = bool(namespace.get("bf16")) or precision == "bf16" or (
        precision == "auto" and not asked and cuda and torch.cuda.is_bf16_supported())
    # `accelerate launch` passes its config's mixed precision (bf16 in examples/accelerate/) in the environment, and
    # TrainingArguments takes it where bf16 and fp16 are off: the autocast would then not be the one --precision chose
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        chosen = "bf16" if namespace.get("bf16") else "fp16" if namespace.get("fp16") else "no"
        os.environ["ACCELERATE_MIXED_PRECISION"] = chosen
    # Without a GPU, train on the CPU (bf16 autocast included), and let several launched processes form one gloo run.
    namespace["use_cpu"] = namespace.get("use_cpu") or not cuda
    training_args = TrainingArguments(**namespace)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size != launched:
        raise ValueError(f"WORLD_SIZE={launched} processes were launched but they form a run of {training_args.world_size}: "
                         "they would train separately into one --output-dir; on CPU pass --use-cpu or launch with torchrun")
    return SimpleNamespace(**recipe, output_dir=training_args.output_dir, seed=training_args.seed,
                           given_options=given), training_args


def given_options(preset: str, argv: list[str]) -> frozenset[str]:
    """The names of the options that `argv` gives (in either spelling, or abbreviated), apart from those left at
    their default: a default nobody typed must not contradict an option that was typed."""
    import argparse

    parser = build_parser(preset)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    parser._defaults.clear()  # (the recipe's defaults, `set_defaults`)
    return frozenset(vars(parser.parse_args(argv)))


# --- data ---------------------------------------------------------------------------------------------------------


# How long the other processes wait for the main one to prepare the data: hours where it downloads, tokenizes and
# packs a large corpus (`main_process_first`).
PREPARATION_TIMEOUT = timedelta(hours=24)
_preparation_group = None


@contextlib.contextmanager
def main_process_first(training_args):
    """`training_args.main_process_first(local=False)`: the main process runs the block first (reads the dataset,
    trains the tokenizer, tokenizes and packs into `datasets`' cache), then the others, which find its results. They
    wait for it at a barrier of a group of their own, of `PREPARATION_TIMEOUT`: the process group's barrier gave up
    after the collectives' timeout (30 minutes on the CPU, where --ddp-timeout is not passed on; --ddp-timeout on
    GPUs), which stopped a run whose main process took longer to pack its corpus."""
    global _preparation_group
    if training_args.world_size <= 1:
        yield
        return
    import torch.distributed as dist

    if _preparation_group is None:  # (made by every process at its first preparation, as `new_group` requires)
        _preparation_group = dist.new_group(timeout=PREPARATION_TIMEOUT)  # (of the run's backend)
        # connected while every process is here: NCCL connects a group at its first collective, and a process that
        # waited there for the main one's part of the connection gave up after the store's timeout
        dist.barrier(group=_preparation_group)
    is_main = training_args.process_index == 0
    if not is_main:
        dist.barrier(group=_preparation_group)
    yield
    if is_main:
        dist.barrier(group=_preparation_group)


def load_raw_splits(args):
    """Return (train, validation or None) datasets of raw documents."""
    require_package("datasets", "--dataset / --data-files")
    import datasets

    if args.data_files:
        loaded = _load_data_files(datasets, args)
    elif args.dataset:
        # (a local folder of .txt files is read by the text builder: its byte-order marks left out as --data-files')
        text_files = (Path(args.dataset).is_dir()
                      and datasets.load_dataset_builder(args.dataset, args.dataset_config).name == "text")
        loaded = datasets.load_dataset(args.dataset, args.dataset_config, **(TEXT_OPTIONS if text_files else {}))
    else:
        raise ValueError("give --dataset (Hub name), --data-files (local files) or --data-dir (token shards)")
    if args.train_split not in loaded:
        raise ValueError(f"--train-split={args.train_split!r} is not one of the dataset's splits {sorted(loaded)}")
    train = loaded[args.train_split]
    if args.text_column not in train.column_names:
        raise ValueError(f"--text-column={args.text_column!r} is not one of the dataset's columns {train.column_names}")
    if args.validation_split not in loaded and args.validation_split != DataArguments.validation_split:
        # (a split named on purpose, missing, would otherwise hold out --validation-fraction of the training text)
        raise ValueError(f"--validation-split={args.validation_split!r} is not one of the dataset's splits "
                         f"{sorted(loaded)}; leave it out to hold out --validation-fraction of {args.train_split!r}")
    validation = loaded[args.validation_split] if args.validation_split in loaded else None
    for split_name, split in ((args.train_split, train), (args.validation_split, validation)):
        if split is not None:
            refuse_documents_without_text(split, split_name, args.text_column)
    return train, validation


def refuse_documents_without_text(split, split_name: str, column: str) -> None:
    """A text column of another type, or without a value in some rows (a JSON line without the field), failed in the
    tokenizer with an error that named neither the column nor the row."""
    if column not in split.column_names:
        raise ValueError(f"--text-column={column!r} is not one of the columns {split.column_names} of the "
                         f"{split_name!r} split")
    feature = split.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"--text-column={column!r} holds {feature} values in the {split_name!r} split, not text: "
                         "choose the column of the documents' text")
    values = split.data.column(column)
    if values.null_count:
        import pyarrow.compute

        first = pyarrow.compute.index(values.is_null(), True).as_py()
        raise ValueError(f"--text-column={column!r} has no value in {values.null_count} of the {len(split)} rows of "
                         f"the {split_name!r} split (the first: row {first}); drop those rows or give them a text")


def data_files_builder(args) -> str:
    """The `datasets` builder that reads --data-files: --dataset, else the one of the files' suffix. A file named
    twice (also by two globs, by paths spelled otherwise such as `./a.jsonl`, or through a link) is refused: its
    documents would be trained on twice, and the held-out ones (the last documents) could be trained on too. So are
    files of two formats, which one builder would read as the other's (a JSON line as a line of text)."""
    from collections import Counter

    files = _data_files(args.data_files)
    # (a local file by the one path it resolves to: `datasets` keeps the `./` and `..` of the path given)
    real = Counter(os.path.realpath(name) if os.path.exists(name) else name for name in files)
    repeated = sorted(name for name, count in real.items() if count > 1)
    if repeated:
        raise ValueError(f"--data-files names {repeated[0]!r} more than once ({len(repeated)} such file(s)): its "
                         "documents would be trained on twice; give each file once")
    if files and all(Path(name).is_file() and not _holds_text(name) for name in files):
        # (`datasets` failed on them after --output-dir was made: a bare `StopIteration` for a .jsonl, "An error
        # occurred while generating the dataset" for a .txt, naming neither the option nor the file)
        which = (f"{files[0]!r} holds no" if len(files) == 1
                 else f"none of its {len(files)} files ({files[0]!r}, ...) holds")
        raise ValueError(f"--data-files: {which} text (empty, or blank lines only), so no document to train on")
    if args.dataset:
        return args.dataset
    builders = {}
    for name in files:
        builders.setdefault(_builder_for(name), name)
    if len(builders) > 1:
        found = ", ".join(f"{builder} ({name!r})" for builder, name in builders.items())
        raise ValueError(f"--data-files mixes formats: {found}; one builder reads them all, so give files of one "
                         "format (or --dataset BUILDER to read every file with it)")
    return next(iter(builders))


def _data_files(patterns: list[str]) -> list[str]:
    """The files of --data-files, pattern by pattern: `datasets` passes over a glob that matches no file, so a
    mistyped one (`corpus/*.jsnol` beside others) left its files out of training without a word, or, alone, failed
    with a bare `StopIteration`."""
    from datasets.data_files import DataFilesList

    files = []
    for pattern in patterns:
        try:
            matched = list(DataFilesList.from_patterns([pattern]))
        except FileNotFoundError:
            matched = []
        if not matched:
            raise ValueError(f"--data-files: {pattern!r} matches no file (relative to {os.getcwd()!r}); give "
                             "existing files or globs that match some")
        files += matched
    return files


def _holds_text(name: str) -> bool:
    """Whether the file holds a byte other than whitespace (read until the first one)."""
    with open(name, "rb") as handle:
        while chunk := handle.read(1 << 20):
            if chunk.strip():
                return True
    return False


def _load_data_files(datasets, args):
    """`datasets.load_dataset` of --data-files, with an error that names a file that is not UTF-8, the line of a
    JSON file that is not a JSON object, a parquet file that does not read as one, or a file of other columns than
    the first: `datasets` names neither the file nor the encoding it expected (nor the line: "An error occurred
    while generating the dataset"), and its json builder reads bytes that are not UTF-8 into the text column
    unchecked (they failed later, in the tokenizer)."""
    import pyarrow

    builder = data_files_builder(args)
    options = TEXT_OPTIONS if builder == "text" else {}
    try:
        loaded = datasets.load_dataset(builder, data_files={"train": args.data_files}, **options)
        if args.text_column in loaded["train"].column_names:
            loaded["train"].data.column(args.text_column).validate(full=True)
    except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError, pyarrow.ArrowInvalid) as error:
        cause = error.__cause__ if isinstance(error, datasets.exceptions.DatasetGenerationError) else error
        # (parquet files are not text: pyarrow's error on one says nothing of UTF-8)
        decoding = isinstance(cause, (UnicodeDecodeError, pyarrow.ArrowInvalid)) and builder != "parquet"
        name = _first_file_not_utf8(args.data_files) if decoding else None
        if name is not None:
            raise ValueError(f"--data-files: {name!r} is not UTF-8 text ({cause}); convert it to UTF-8") from error
        where = _first_row_not_json(args.data_files) if builder == "json" else None
        if where is not None:
            raise ValueError(f"--data-files: {where}; give one JSON object a line (or one JSON array of objects)") \
                from error
        if builder == "parquet":
            _refuse_files_not_parquet(args.data_files, error)
        # (`datasets` told of other columns in a message naming them, but no file: a `CastError`, an `ArrowInvalid`)
        _refuse_files_of_other_columns(args.data_files, builder, error)
        raise
    return loaded


def _refuse_files_not_parquet(patterns: list[str], error: Exception) -> None:
    """Refuse the first local file of --data-files whose parquet schema does not read (cut short, or another format
    under a .parquet name), naming it: pyarrow's error ("Parquet magic bytes not found") names no file."""
    import pyarrow
    import pyarrow.parquet

    for name in _data_files(patterns):
        if not Path(name).is_file():
            continue
        try:
            pyarrow.parquet.read_schema(name)
        except (pyarrow.ArrowException, OSError) as unreadable:
            raise ValueError(f"--data-files: {name!r} is not a parquet file ({unreadable}); give whole parquet "
                             "files") from error


def _refuse_files_of_other_columns(patterns: list[str], builder: str, error: Exception) -> None:
    """Refuse --data-files whose first rows have other columns than the first file's (`datasets` reads every file
    with the first one's columns, and failed on another's naming neither file), naming the two files."""
    known = [(name, columns) for name in _data_files(patterns) if (columns := _first_row_columns(name, builder))]
    for name, columns in known[1:]:
        if set(columns) != set(known[0][1]):
            raise ValueError(f"--data-files: {name!r} has the columns {sorted(columns)}, {known[0][0]!r} "
                             f"{sorted(known[0][1])}: one dataset reads files of the same columns; give the text of "
                             "every file the same name (--text-column), or convert them alike") from error


def _first_row_columns(name: str, builder: str) -> list[str] | None:
    """The columns of one file of --data-files, as its first row gives them (a CSV header, the keys of the first
    JSON line, a parquet schema); None where they cannot be read that way (a .json array, a file of text)."""
    if not Path(name).is_file():  # (a remote file: not read here)
        return None
    if builder == "parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_schema(name).names
    if builder not in ("csv", "json"):
        return None
    with open(name, encoding="utf-8-sig", newline="" if builder == "csv" else "\n") as handle:
        if builder == "csv":
            import csv

            return next(csv.reader(handle), None)
        first = next((line for line in handle if line.strip()), "")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return None
    return list(row) if isinstance(row, dict) else None


def _first_row_not_json(patterns: list[str]) -> str | None:
    """Where the first file of --data-files that the json builder cannot read goes wrong ("'FILE', line N ..."):
    the first line of JSON lines that is no JSON object, or the place where a file of one JSON document (a .json
    array over several lines) stops being JSON; None if every file reads as one or the other."""
    for name in _data_files(patterns):
        if not Path(name).is_file():
            continue
        rows_read, number, why, parsed = 0, 0, None, False
        # (lines end at \n alone, as the builder's do; a byte-order mark in front, which it reads past, left out)
        with open(name, encoding="utf-8-sig", newline="\n") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row, parsed = json.loads(line), True
                except json.JSONDecodeError as error:
                    why, parsed = f"is not JSON ({error.msg} at column {error.colno})", False
                else:
                    why = None if isinstance(row, dict) else f"holds a JSON {type(row).__name__}, not an object"
                if why is not None:
                    break
                rows_read += 1
        if why is None:
            continue  # JSON lines, every one an object
        if rows_read:  # JSON lines up to this one
            return f"{name!r}, line {number}, {why}"
        try:  # the first line is no JSON object: the file may be one JSON document (an array, over several lines)
            json.loads(Path(name).read_text(encoding="utf-8-sig"))
        except json.JSONDecodeError as error:
            if parsed:  # the first line is JSON of its own, but no object
                return f"{name!r}, line {number}, {why}"
            return f"{name!r}, line {error.lineno}, is not JSON ({error.msg} at column {error.colno})"
    return None


def _first_file_not_utf8(patterns: list[str]) -> str | None:
    """The first local file of --data-files that does not decode as UTF-8 (None if all do)."""
    import codecs

    for name in _data_files(patterns):
        if not Path(name).is_file():
            continue
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            with open(name, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    decoder.decode(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return name
    return None


def _builder_for(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in LOCAL_BUILDERS:
        raise ValueError(f"--data-files: suffix {suffix!r} of {path!r} is not one of {sorted(LOCAL_BUILDERS)}; pass --dataset BUILDER")
    return LOCAL_BUILDERS[suffix]


def load_tokenizer(args, train_text, training_args):
    """The tokenizer: trained here (by the main process; a resumed run reuses its own, while a fresh run trains anew
    over one that a run stopped before its first checkpoint left, whose settings may differ) or loaded."""
    from transformers import AutoTokenizer

    if args.train_tokenizer:
        folder = Path(args.output_dir) / TOKENIZER_DIR
        with main_process_first(training_args):
            if training_args.process_index == 0 and not (args.resume and (folder / "tokenizer_config.json").exists()):
                from hf_memffn.atomic_write import atomic_output
                from hf_memffn.tokenization import train_tokenizer

                texts = (text for batch in _batches(train_text, args.text_column) for text in batch)
                tokenizer = train_tokenizer(texts, vocab_size=args.train_tokenizer)
                with atomic_output(folder) as temporary:
                    tokenizer.save_pretrained(temporary)
        if training_args.world_size > 1:
            return main_process_tokenizer(folder, training_args)
        return AutoTokenizer.from_pretrained(folder)
    source = args.tokenizer or args.init_from
    if source is None:
        raise ValueError("give --tokenizer NAME_OR_DIR, --train-tokenizer VOCAB, or --init-from DIR")
    # the --init-from checkpoint's code runs anyway (its model loads with trust_remote_code): AutoTokenizer reads its
    # config.json too, whose model type a run without hf_memffn does not know, and asked y/N for 15 s on a terminal
    trust_remote_code = True if source == args.init_from else None
    with main_process_first(training_args):
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        # (the option that gave it: --data-dir's own tokenizer, taken where --tokenizer is left out, was named as if
        # passed with --tokenizer)
        option = ("--init-from" if not args.tokenizer
                  else "--data-dir" if args.tokenizer == getattr(args, "data_dir", None) else "--tokenizer")
        raise ValueError(f"{option}={source!r}: its tokenizer has no EOS token, which ends each document of the "
                         "training text (give a tokenizer that has one)")
    return tokenizer


def main_process_tokenizer(folder: Path, training_args):
    """The tokenizer that the main process saved to `folder`, in every process: the others are sent its files, since
    the nodes of a multi-node run may not share --output-dir (--save-on-each-node); they failed to find the folder."""
    import tempfile

    import torch.distributed as dist
    from transformers import AutoTokenizer

    files = [{path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
             if training_args.process_index == 0 else None]
    dist.broadcast_object_list(files, src=0)
    if training_args.process_index == 0:
        return AutoTokenizer.from_pretrained(folder)
    with tempfile.TemporaryDirectory() as copy:
        for name, content in files[0].items():
            (Path(copy) / name).write_bytes(content)
        return AutoTokenizer.from_pretrained(copy)


def _batches(dataset, column: str, batch_size: int = 1000):
    for start in range(0, len(dataset), batch_size):
        yield dataset[start : start + batch_size][column]


def pack_into_blocks(dataset, tokenizer, block_size: int, text_column: str, num_proc=None):
    """Tokenize documents, join them with EOS and cut the stream into `block_size`-token blocks. Blank documents (the
    empty lines of a .txt file) are not documents and add nothing, no EOS either. One stream runs through all the
    documents, so only its tail of fewer than `block_size` tokens is dropped: the blocks of token shards
    (examples/token_shards.py) of the same documents. (Cut per batch of 1000 documents, as `datasets`' batched map
    hands them over, each batch dropped a tail of its own: up to a third of the text of short documents in long
    blocks, and all of it where 1000 documents held fewer tokens than a block.) `num_proc` processes tokenize; one
    process packs, in order, so that the blocks are the same for any `num_proc` (processes would each carry a stream
    of their own and drop a tail each, and `datasets` leaves `num_proc` out of the key of the results it caches)."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [doc + [eos] for doc, text in zip(ids, batch[text_column]) if text.strip()]}

    left_over = []  # the tokens after a batch's last full block, which begin the next batch's first

    def group(batch):
        stream = left_over + [token for doc in batch["input_ids"] for token in doc]
        usable = len(stream) - len(stream) % block_size
        left_over[:] = stream[usable:]
        return {"input_ids": [stream[i : i + block_size] for i in range(0, usable, block_size)]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc="tokenize")
    return tokenized.map(group, batched=True, desc=f"pack into {block_size}-token blocks")


def collate_blocks(features):
    input_ids = torch.as_tensor(np.stack([np.asarray(f["input_ids"]) for f in features]), dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


# --- model --------------------------------------------------------------------------------------------------------


def split_overrides(text: str) -> list[str]:
    """The `key=value` items of `text`, split at the commas outside a JSON value's brackets and strings (a dict
    value such as `rope_parameters={"rope_type": "linear", "factor": 2.0}` has commas of its own)."""
    items, start, depth, in_string, escaped = [], 0, 0, False, False
    for index, char in enumerate(text):
        if in_string:
            escaped, in_string = (not escaped and char == "\\"), (escaped or char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_overrides(text: str) -> dict:
    overrides = {}
    for item in split_overrides(text):
        if "=" not in item:
            raise ValueError(f"--config-overrides: {item!r} is not key=value")
        key, value = item.split("=", 1)
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
    return overrides


def vocab_size_and_fields(overrides: dict, default: int) -> tuple[int, dict]:
    """(the vocabulary size that --config-overrides sets, else `default`; its other fields), as `build_config` takes
    them: the size is its own argument there, so a `vocab_size` left among the fields was a repeated argument."""
    fields = dict(overrides)
    return fields.pop("vocab_size", default), fields


def positions_for_the_block_size(args, overrides: dict) -> dict:
    """--config-overrides' fields for a new model, its `max_position_embeddings` at least --block-size: the model
    trains at every position of a block, which its config then says (the tiny preset's 512 under the default
    --block-size of 1024 saved a config that called the positions past 512 untrained). An override below the block
    size is refused."""
    given = overrides.get("max_position_embeddings")
    if given is not None:
        if isinstance(given, int) and given < args.block_size:
            raise ValueError(f"--config-overrides max_position_embeddings={given} is below --block-size="
                             f"{args.block_size}, the positions the model trains at: raise it, or lower --block-size")
        return overrides
    if args.block_size > get_preset(args.preset).max_position_embeddings:
        return {**overrides, "max_position_embeddings": args.block_size}
    return overrides


def config_class_of(architecture: str):
    """The config class of an --arch: transformers' own Llama for the baseline, else this package's."""
    if architecture == "llama":
        from transformers import LlamaConfig

        return LlamaConfig
    import hf_memffn

    return hf_memffn.ARCHITECTURES[architecture]


def build_config(architecture: str, preset_name: str, vocab_size: int, tokenizer=None, **overrides):
    fields = get_preset(preset_name).config_fields(architecture)
    fields["vocab_size"] = vocab_size
    if tokenizer is not None:
        fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config_class = config_class_of(architecture)
    if overrides:
        refuse_unknown_overrides(overrides, set(fields) | set(config_class().to_dict()), config_class.__name__)
    fields.update(overrides)
    if architecture == "llama":  # (transformers' Llama reads its theta from `rope_parameters`, beside the scaling)
        rope_theta, rope_parameters = fields.pop("rope_theta"), fields.get("rope_parameters")
        if rope_parameters is None or isinstance(rope_parameters, dict):  # (LlamaConfig reports any other value)
            # (an override's own theta wins over the preset's, as in this package's configs; LlamaConfig sets the
            # type: "default", or an older dict's `type`)
            fields["rope_parameters"] = {"rope_theta": rope_theta, **(rope_parameters or {})}
    return config_class(**fields)


def refuse_unknown_overrides(overrides: dict, known: set[str], config_name: str) -> None:
    """A key that is not a field of the config would be kept on it and read by nothing."""
    unknown = sorted(key for key in overrides if key not in known)
    if unknown:
        fields = ", ".join(sorted(key for key in known if not key.startswith("_")))
        raise ValueError(f"--config-overrides: {', '.join(map(repr, unknown))} not a field of {config_name}; "
                         f"its fields: {fields}")


def build_model(args, tokenizer):
    from transformers import AutoModelForCausalLM

    if args.init_from:
        model = from_pretrained_main_process_first(args.init_from, parse_overrides(args.config_overrides),
                                                   dtype=torch.float32)
    else:
        # the tokenizer's size padded for tensor-core friendly shapes, unless --config-overrides sets vocab_size
        vocab_size, overrides = vocab_size_and_fields(parse_overrides(args.config_overrides),
                                                      64 * math.ceil(len(tokenizer) / 64))
        overrides = positions_for_the_block_size(args, overrides)
        config = build_config(args.arch, args.preset, vocab_size, tokenizer, **overrides)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if hasattr(model, "attach_tokenizer"):
        model.attach_tokenizer(tokenizer)
    refuse_a_tokenizer_beyond_the_vocabulary(model, tokenizer)
    keep_present_wrap_units(model)
    return model


def refuse_a_tokenizer_beyond_the_vocabulary(model, tokenizer) -> None:
    """A tokenizer of more tokens than the model's embedding has rows is refused before training. A model of this
    package refuses to save with such a tokenizer attached, which stopped the run at its first checkpoint: its own
    check runs here, with its message (so do its other checks of what a save would refuse). Any model's forward
    fails at the first id past its embedding."""
    refuse_an_incomplete_checkpoint = getattr(model, "_refuse_an_incomplete_checkpoint", None)
    if refuse_an_incomplete_checkpoint is not None:
        refuse_an_incomplete_checkpoint()
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's embedding has rows "
                         f"({rows}): the ids past them would fail the forward; pass the model's own tokenizer (for a "
                         "new model, leave vocab_size out of --config-overrides)")


def refuse_an_arch_other_than_the_saved_models(args, model) -> None:
    """With --init-from the saved model decides the architecture: an --arch typed beside it that names another one
    was left unused without a word (and the summary named it as the run's `arch`)."""
    if not args.init_from or "arch" not in args.given_options:
        return
    config_class = config_class_of(args.arch)
    if config_class.model_type != model.config.model_type:
        raise ValueError(f"--arch={args.arch}: the model of --init-from={args.init_from!r} is a "
                         f"{model.config.model_type} model, not a {config_class.model_type} one; drop --arch (the "
                         "saved model decides the architecture) or start from a model of that architecture")


def keep_present_wrap_units(model) -> None:
    """Keep in `model._no_split_modules` (the FSDP2 wrap units of examples/accelerate/fsdp2.yaml) only the classes
    the model contains: accelerate refuses a listed class that is absent (e.g. `TokenMemory` in a FlashMHF model)."""
    present = {type(module).__name__ for module in model.modules()}
    model._no_split_modules = {name for name in (model._no_split_modules or ()) if name in present}


def saved_weights_variant(path: str) -> str | None:
    """The variant of the weights in the local folder `path` where it holds weights saved with a variant only
    (`model.ema.safetensors`), else None. The package is imported only then: a checkpoint's own code runs otherwise."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    plain = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, name)) for name in plain):
        return None
    from hf_memffn.hub import weights_variant

    return weights_variant(path)


def from_pretrained_main_process_first(path: str, overrides: dict | None = None, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`, safe when many processes start at once.

    The main process resolves the config first, which copies the checkpoint's modeling code into the transformers
    module cache; the other processes wait at a barrier, then find the cache populated instead of writing the same
    files at the same time. (Fine-tuning does not import `hf_memffn`, so the checkpoint's own code is what runs.)
    `overrides` (--config-overrides) are set on the saved config; one that leaves a saved weight unused, or a weight
    of the model without its saved value, is refused. A folder whose weights were saved with a variant only
    (`save_pretrained(folder, variant="ema")`) loads with that variant, as the package's commands load it.
    """
    from accelerate import PartialState
    from transformers import AutoConfig, AutoModelForCausalLM

    if (variant := saved_weights_variant(path)) is not None:  # (from_pretrained finds such weights only given it)
        kwargs = {"variant": variant, **kwargs}
    with PartialState().main_process_first():
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    if not overrides:
        return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs)
    refuse_unknown_overrides(overrides, set(config.to_dict()), type(config).__name__)
    model, info = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, output_loading_info=True,
                                                       **kwargs, **overrides)
    left_out = sorted(info.get("missing_keys", ())) + sorted(info.get("unexpected_keys", ()))
    if left_out:
        raise ValueError(f"--config-overrides of {', '.join(overrides)}: the model of "
                         f"--init-from={path!r} would load without some of its saved weights ({left_out[0]}, "
                         f"{len(left_out)} in all); override only fields that keep the weights")
    return model


def full_numel(param) -> int:
    """A parameter's size, also when DeepSpeed ZeRO-3 has partitioned it (its local tensor is then empty)."""
    return getattr(param, "ds_numel", None) or param.numel()


def parameter_counts(model) -> dict[str, int]:
    if hasattr(model, "parameter_counts"):
        return model.parameter_counts()
    return {"total": sum(full_numel(p) for p in model.parameters())}


def training_flops_per_token(model, sequence_length: int) -> float:
    """Forward+backward FLOPs per token: 6 per weight used in a matmul, plus 12 L d T for attention scores and mixing.

    The input embedding is a lookup (not counted) unless it is tied to the output head. FlashMHF's key/up/value
    banks are shared by `ffn_num_heads / ffn_num_kv_heads` query heads and are counted once per sharing head.
    """
    config = model.config
    matmul_params = 0
    embedding = model.get_input_embeddings().weight
    for name, param in model.named_parameters():
        if param is embedding and not getattr(config, "tie_word_embeddings", False):
            continue
        uses = 1
        if name.endswith("mlp.key_up_value"):
            uses = getattr(config, "ffn_num_heads", 1) // max(1, getattr(config, "ffn_num_kv_heads", None) or getattr(config, "ffn_num_heads", 1))
        matmul_params += uses * full_numel(param)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * sequence_length
    return 6.0 * matmul_params + attention


def device_peak_flops(override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


# --- throughput ---------------------------------------------------------------------------------------------------


def make_throughput_callback(tokens_per_step: int, block_size: int, flops_per_token: float, peak_flops: float | None,
                             world_size: int, log_path: Path, untimed_steps: range = range(0)):
    from transformers import TrainerCallback

    class ThroughputCallback(TrainerCallback):
        """Adds tokens/s and MFU to each training log (steady-state steps only) and appends every log to a JSONL file.

        Steps in `untimed_steps` are left out of the rates (the profiled steps, and the one after them, which pays
        for writing the profile). `tokens_per_step` is the arguments' count until training starts, then that of the
        batches the Trainer draws."""

        def __init__(self):
            self.tokens_per_step = tokens_per_step
            self.trainings_begun = 0
            self.start_timing()
            self.session_first_step = 1

        def start_timing(self) -> None:
            self.last_step_end = None
            self.window_seconds = 0.0
            self.window_steps = 0
            self.total_seconds = 0.0
            self.total_steps = 0

        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            self.session_first_step = state.global_step + 1  # (a resumed run's state is the checkpoint's by now)
            # --auto-find-batch-size starts training over with a smaller per-device batch after running out of
            # memory: count the blocks of the batches drawn now (accelerate's loader gives them over all processes),
            # time this attempt's steps only, and drop from the log the steps of the attempt that ran out of memory
            blocks = getattr(train_dataloader, "total_batch_size", None)
            if blocks:
                self.tokens_per_step = blocks * args.gradient_accumulation_steps * block_size
            if self.trainings_begun and state.is_world_process_zero:
                rewind_train_log(log_path, state.log_history)
            self.trainings_begun += 1
            self.start_timing()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            # the first step (compilation, autotuning) is not timed
            if self.last_step_end is not None and state.global_step not in untimed_steps:
                self.window_seconds += now - self.last_step_end
                self.window_steps += 1
            self.last_step_end = now

        def on_evaluate(self, args, state, control, **kwargs):
            self.last_step_end = None  # evaluation time is not training time

        def on_save(self, args, state, control, **kwargs):
            self.last_step_end = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            if "loss" in logs and self.window_steps:
                tokens_per_second = self.window_steps * self.tokens_per_step / self.window_seconds
                logs["tokens_per_second"] = round(tokens_per_second, 1)
                if peak_flops:
                    logs["mfu"] = tokens_per_second * flops_per_token / (peak_flops * world_size)
                self.total_seconds += self.window_seconds
                self.total_steps += self.window_steps
                self.window_seconds, self.window_steps = 0.0, 0
            if "train_loss" in logs and self.session_first_step > 1:
                # the Trainer's mean covers this session's steps; the log of a resumed run keeps the run's mean, as
                # the uninterrupted run's log does
                logs.update(run_training_loss(state.log_history, state.global_step, logs["train_loss"],
                                              self.session_first_step))
            if state.is_world_process_zero:
                record = {"step": state.global_step, **logs}
                with log_path.open("a", encoding="utf-8") as handle:
                    handle.write(run_record_json(record) + "\n")
                if "tokens_per_second" in logs:
                    mfu = f"  MFU {100 * logs['mfu']:.1f}%" if "mfu" in logs else ""
                    print(f"step {state.global_step}: loss {logs['loss']:.4f}  {logs['tokens_per_second']:,.0f} tokens/s{mfu}", flush=True)

        def summary(self) -> dict:
            if not self.total_steps:
                return {}
            tokens_per_second = self.total_steps * self.tokens_per_step / self.total_seconds
            result = {"tokens_per_second": round(tokens_per_second, 1)}
            if peak_flops:
                result["mfu"] = tokens_per_second * flops_per_token / (peak_flops * world_size)
            return result

    return ThroughputCallback()


# --- main ---------------------------------------------------------------------------------------------------------


def parse_profile_steps(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise ValueError(f"--profile-steps={text!r}: expected FIRST:LAST, two step numbers with 1 <= FIRST <= LAST")
    return int(first), int(last)


def refuse_profile_steps_past_the_run(text: str, last: int, max_steps: int, stop_after_steps: int | None) -> None:
    """The profile is written at its last step: one past the run's last step was never written, while the profiler
    ran on to the end of training."""
    ends = (("--max-steps", max_steps if max_steps > 0 else None), ("--stop-after-steps", stop_after_steps))
    for option, end in ends:
        if end is not None and last > end:
            raise ValueError(f"--profile-steps={text!r}: its last step {last} is past {option}={end}, where training "
                             f"stops; the profile is written at its last step, so end it at step {end} or before")


def refuse_profile_steps_before_the_checkpoint(text: str, first: int, checkpoint: str | None) -> None:
    """The profiler starts as the window's first step begins: a window from a step at or before the checkpoint a run
    resumes from never started, and no profile was written, without a word."""
    step = checkpoint_state(checkpoint).global_step if checkpoint else 0
    if first <= step:
        raise ValueError(f"--profile-steps={text!r}: the checkpoint to resume from ({str(checkpoint)!r}) is at step "
                         f"{step}, so its first step {first} is not trained again; give steps after {step}, or leave "
                         "it out")


def make_profile_callback(first: int, last: int, output_dir: Path, is_main_process: bool):
    """Profiles training steps FIRST..LAST (counted from 1) with torch.profiler on the main process.

    profile_steps.json: wall time per step, and per step the device's kernel time (all kernels, and the collective
    communication kernels apart), with the 25 kernels and the 25 host operators that took longest.
    profile_steps.txt: torch.profiler's tables of the same events, by device time and by host time.
    A step whose wall time is well above its kernel time waits on the host (Python, launches, the optimizer's
    per-tensor work); one whose communication kernels fill the gap waits on the interconnect.
    """
    from transformers import TrainerCallback

    class ProfileSteps(TrainerCallback):
        def __init__(self):
            self.profiler = None
            self.started = None

        def on_step_begin(self, args, state, control, **kwargs):
            if is_main_process and state.global_step == first - 1 and self.profiler is None:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                    torch.cuda.synchronize()
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.profiler is None or state.global_step != last:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.started
            self.profiler.__exit__(None, None, None)
            write_profile(self.profiler, wall, last - first + 1, output_dir)
            self.profiler = None

    return ProfileSteps()


def write_profile(profiler, wall_seconds: float, steps: int, output_dir: Path) -> None:
    from hf_memffn.atomic_write import write_atomic

    averages = profiler.key_averages()

    def device_us(event) -> float:
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)

    # The device's own events (kernels, copies). A host operator's device time repeats that of its kernels, and a
    # `record_function` region (DDP's forward, the optimizer's step, a collective) shows on the device as an
    # annotation spanning them: both are left out, as in the total of torch.profiler's own table.
    kernels = [e for e in averages if e.device_type != torch.autograd.DeviceType.CPU
               and not getattr(e, "is_user_annotation", False) and device_us(e) > 0]
    communication = [e for e in kernels if "nccl" in e.key.lower()]
    kernel_ms = sum(device_us(e) for e in kernels) / 1e3 / steps
    summary = {
        "steps": steps,
        "wall_ms_per_step": round(wall_seconds * 1e3 / steps, 2),
        "kernel_ms_per_step": round(kernel_ms, 2),
        "communication_kernel_ms_per_step": round(sum(device_us(e) for e in communication) / 1e3 / steps, 2),
        "kernels": [{"name": e.key[:120], "calls_per_step": e.count / steps, "ms_per_step": round(device_us(e) / 1e3 / steps, 3)}
                    for e in sorted(kernels, key=device_us, reverse=True)[:25]],
        "host_operators": [{"name": e.key[:120], "calls_per_step": e.count / steps,
                            "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
                            "total_ms_per_step": round(e.cpu_time_total / 1e3 / steps, 3)}
                           for e in sorted(averages, key=lambda e: e.cpu_time_total, reverse=True)[:25]],
    }
    write_atomic(output_dir / "profile_steps.json", run_record_json(summary, indent=2) + "\n")
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    tables = (f"{steps} steps, {summary['wall_ms_per_step']} ms wall per step, {summary['kernel_ms_per_step']} ms of kernels "
              f"per step ({summary['communication_kernel_ms_per_step']} ms communication)\n\n"
              + averages.table(sort_by=device_key, row_limit=40) + "\n\n"
              + averages.table(sort_by="cpu_time_total", row_limit=40) + "\n")
    write_atomic(output_dir / "profile_steps.txt", tables)
    print(f"profiled steps: {tables.splitlines()[0]} -> {output_dir / 'profile_steps.json'}", flush=True)


def make_log_at_checkpoints_callback():
    from transformers import TrainerCallback

    class LogAtCheckpoints(TrainerCallback):
        """Logs the training loss at every checkpoint before --max-steps, also one off the --logging-steps grid: a run
        resumed from it starts its next loss window there, so its log holds the windows of the run left alone. (The
        checkpoint at --max-steps ends the schedule; its window stays as --logging-steps cuts it.)"""

        def on_step_end(self, args, state, control, **kwargs):
            if control.should_save and state.global_step < state.max_steps:
                control.should_log = True

    return LogAtCheckpoints()


def rewind_train_log(log_path: Path, log_history: list[dict]) -> None:
    """The train log as it stood at the checkpoint a run resumes from: a record per entry of the checkpoint's log
    history. What a session logged after its last checkpoint (steps that the resumed run trains and logs again, the
    session's end and final evaluation) is dropped. A record is kept from the file where it holds its entry (it adds
    tokens/s and MFU to it); otherwise the entry stands in for it. A line that is no record (cut short by a session
    killed, or a disk that filled, while appending it) holds no entry: the checkpoint's entry stands in for it too."""
    from hf_memffn.atomic_write import write_atomic

    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines() if log_path.is_file() else []
    records = [_run_record_or_nothing(line) for line in lines if line.strip()]
    kept = []
    for index, entry in enumerate(log_history):
        record = records[index] if index < len(records) else {}
        holds_entry = all(key in record and _same_value(record[key], value) for key, value in entry.items())
        kept.append(record if holds_entry else {"step": entry["step"], **entry})
    write_atomic(log_path, "".join(run_record_json(record) + "\n" for record in kept))


def _run_record_or_nothing(line: str) -> dict:
    """The record of a line of the train log, or {} for a line that is none (see `rewind_train_log`)."""
    try:
        return read_run_record(line)
    except ValueError:  # (a line cut short is no JSON: each record is one object, written whole or cut)
        return {}


def _same_value(first, second) -> bool:
    """`first == second`, a NaN (a loss of a run that diverged) taken as the same as a NaN."""
    nan_pair = isinstance(first, float) and isinstance(second, float) and math.isnan(first) and math.isnan(second)
    return nan_pair or first == second


def make_stop_callback(stop_step: int):
    from transformers import TrainerCallback

    class StopAfterSteps(TrainerCallback):
        """Ends training at `stop_step` while the learning-rate schedule stays the one of --max-steps."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= stop_step:
                control.should_training_stop = True

    return StopAfterSteps()


def load_and_pack(args, training_args):
    """(train blocks, held-out blocks, tokenizer) from a `datasets` dataset (--dataset / --data-files)."""
    with main_process_first(training_args):
        raw_train, raw_validation = load_raw_splits(args)
    if raw_validation is None:
        # the last documents, held out before a tokenizer is trained on the rest: no held-out text shapes the
        # vocabulary, and no document is cut between the two splits
        held_out = max(int(len(raw_train) * args.validation_fraction), _documents_for_one_block(raw_train, args))
        if held_out >= len(raw_train):
            # (a fraction below 1 leaves a document: only the one block's documents take them all, and the error
            # named --validation-fraction, whose value did not matter)
            raise ValueError(f"the {len(raw_train)} documents of the training text are too few to hold out one "
                             f"--block-size={args.block_size} block of them and train on the rest; give more text, "
                             "smaller blocks, or a validation split (--dataset FOLDER holding validation.jsonl)")
        split = raw_train.train_test_split(test_size=held_out, shuffle=False)
        raw_train, raw_validation = split["train"], split["test"]
        raw_validation = held_out_documents_not_trained_on(raw_train, raw_validation, args.text_column,
                                                           training_args.process_index == 0)
    elif "validation_fraction" in args.given_options:  # (it holds out training documents only where no split is)
        raise ValueError(f"--validation-fraction={args.validation_fraction}: the dataset has a "
                         f"{args.validation_split!r} split, which is the held-out text, so no training document is "
                         "held out: drop --validation-fraction")
    tokenizer = load_tokenizer(args, raw_train, training_args)
    with main_process_first(training_args):
        train_blocks = pack_into_blocks(raw_train, tokenizer, args.block_size, args.text_column, args.num_proc)
        eval_blocks = pack_into_blocks(raw_validation, tokenizer, args.block_size, args.text_column, args.num_proc)
    if len(eval_blocks) == 0:
        raise ValueError(f"the held-out documents give fewer than --block-size={args.block_size} tokens, so no "
                         "evaluation block (those whose text is a training document too are left out); raise "
                         "--validation-fraction or give a validation split")
    return train_blocks, eval_blocks, tokenizer


def held_out_documents_not_trained_on(raw_train, held_out, column: str, is_main_process: bool = True):
    """`held_out` (the last documents of the training text) without those whose text is also a document of
    `raw_train`: a corpus that repeats a document (a .txt file's repeated lines, a document copied into several
    files) held it out and trained on it, so the held-out loss measured recall of text trained on. Compared in Arrow,
    without a Python string a document: a hash table of the held-out texts, and one pass over the training ones."""
    import pyarrow.compute

    held_out_texts = held_out.with_format("arrow")[:][column]
    train_texts = raw_train.with_format("arrow")[:][column]
    repeated = pyarrow.compute.unique(train_texts.filter(pyarrow.compute.is_in(train_texts, value_set=held_out_texts)))
    if len(repeated) == 0:
        return held_out
    kept = pyarrow.compute.invert(pyarrow.compute.is_in(held_out_texts, value_set=repeated))
    left_out = len(held_out) - pyarrow.compute.sum(kept).as_py()
    if is_main_process:
        print(f"held out {len(held_out) - left_out:,} documents: {left_out:,} of the last {len(held_out):,} left out, "
              "their text being a training document too", flush=True)
    return held_out.select(np.flatnonzero(kept.to_numpy(zero_copy_only=False)))


def _documents_for_one_block(raw_train, args) -> int:
    """How many of the last documents hold at least `--block-size` + 1 words: as many tokens or more (a tokenizer
    gives every word a token at least), so one held-out block at least."""
    words, count = 0, 0
    for start in range(len(raw_train), 0, -1000):
        texts = raw_train[max(0, start - 1000):start][args.text_column]
        for text in reversed(texts):
            words, count = words + len(text.split()), count + 1
            if words > args.block_size:
                return count
    return count


def load_data(args, training_args):
    """(train blocks, held-out blocks, tokenizer): token shards (--data-dir) or a `datasets` dataset."""
    if args.data_dir:
        from token_shards import load_blocks

        if args.train_tokenizer:
            raise ValueError("--train-tokenizer: the shards of --data-dir are already tokenized; drop it")
        args.tokenizer = args.tokenizer or args.data_dir
        tokenizer = load_tokenizer(args, None, training_args)
        refuse_a_tokenizer_other_than_the_shards(args.data_dir, args.tokenizer, tokenizer)
        train_blocks = load_blocks(args.data_dir, args.block_size, "train")
        eval_blocks = load_blocks(args.data_dir, args.block_size, "heldout")
        if len(eval_blocks) == 0:
            raise ValueError(f"--data-dir={args.data_dir!r}: heldout.bin holds {len(eval_blocks.tokens)} tokens, fewer "
                             f"than --block-size={args.block_size}, so no evaluation block; use smaller blocks")
    else:
        train_blocks, eval_blocks, tokenizer = load_and_pack(args, training_args)
    if args.max_eval_blocks:
        eval_blocks = eval_blocks.select(range(min(args.max_eval_blocks, len(eval_blocks))))
    if len(train_blocks) == 0:
        raise ValueError(f"--block-size={args.block_size}: the training text gives no full block; use more text or smaller blocks")
    return train_blocks, eval_blocks, tokenizer


def refuse_a_tokenizer_other_than_the_shards(data_dir: str, tokenizer_source: str, tokenizer) -> None:
    """Shards whose meta.json records the tokenizer they were made with (examples/reproduce/prepare_data.py writes
    its vocabulary size and EOS id) are refused with a tokenizer of another size or EOS id (a --tokenizer beside
    them): its ids name other tokens than the shards', and those within the embedding trained without a word."""
    from token_shards import META_FILE, read_meta

    if not (Path(data_dir) / META_FILE).is_file():
        return
    recorded = read_meta(data_dir).get("tokenizer")
    if not isinstance(recorded, dict):
        return
    found = {"vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id}
    differing = [key for key in found if key in recorded and recorded[key] != found[key]]
    if differing:
        shown = ", ".join(f"{key} {recorded[key]!r} (the tokenizer's: {found[key]!r})" for key in differing)
        raise ValueError(f"--data-dir={data_dir!r}: its {META_FILE} records the tokenizer the shards were made with, "
                         f"of {shown}, another than --tokenizer={tokenizer_source!r}; pass the shards' own tokenizer "
                         "(leave --tokenizer out to take the one saved in --data-dir)")


def refuse_token_ids_beyond_the_embedding(model, data_dir: str, train_blocks, eval_blocks) -> None:
    """Shards of --data-dir that hold token ids the model's embedding has no row for (tokenized for a larger
    vocabulary than the --init-from model's, or than --tokenizer's) are refused before training, which would fail at
    the first such id: an `IndexError` on the CPU, a device-side assert on a GPU."""
    rows = model.get_input_embeddings().num_embeddings
    for split, blocks in (("train", train_blocks), ("heldout", eval_blocks)):
        largest = int(blocks.tokens.max())
        if largest >= rows:
            raise ValueError(f"--data-dir={data_dir!r}: {split}.bin holds token id {largest}, but the model's "
                             f"embedding has {rows} rows (ids 0 to {rows - 1}); tokenize the shards with the model's "
                             "tokenizer, or pass the tokenizer the shards were made with")


def evaluation_at_the_last_step(state, load_best_model_at_end: bool = False) -> dict | None:
    """The evaluation the Trainer logged at the run's last step (when --eval-steps divides it), which the final
    evaluation would repeat on the same weights (logged twice, and its time spent twice); None if there is none, or
    if the model now holds the weights of an earlier step's checkpoint (--load-best-model-at-end, which loads the
    best one)."""
    if load_best_model_at_end and state.best_model_checkpoint and state.best_global_step != state.global_step:
        return None
    for record in reversed(state.log_history):
        if "eval_loss" in record:
            return record if record.get("step") == state.global_step else None
    return None


def refuse_conflicting_arguments(args) -> None:
    """Options out of range, or that another option given with them would leave unused, refused before any work."""
    if args.block_size < 1:
        raise ValueError(f"--block-size={args.block_size}: expected a positive number of tokens")
    if args.max_eval_blocks is not None and args.max_eval_blocks < 1:
        raise ValueError(f"--max-eval-blocks={args.max_eval_blocks}: expected a positive number of blocks (leave it "
                         "out to evaluate every held-out block)")
    if args.stop_after_steps is not None and args.stop_after_steps < 1:
        raise ValueError(f"--stop-after-steps={args.stop_after_steps}: expected a step number of 1 or more (leave it "
                         "out to train the whole --max-steps schedule)")
    # (a negative fraction held out one block's documents, NaN failed after the data was read, naming no option)
    if not 0 <= args.validation_fraction < 1:
        raise ValueError(f"--validation-fraction={args.validation_fraction}: expected a fraction of the documents "
                         "from 0 to below 1")
    if args.num_proc is not None and args.num_proc < 0:
        raise ValueError(f"--num-proc={args.num_proc}: expected a number of tokenizing processes of 1 or more (0, or "
                         "leaving it out, tokenizes in this process)")
    # (0 was taken as not given, a negative one kept, an infinite one gave an MFU of 0)
    if args.peak_tflops is not None and not 0 < args.peak_tflops < math.inf:
        raise ValueError(f"--peak-tflops={args.peak_tflops}: expected the device's peak in TFLOP/s, a finite number "
                         "above 0 (leave it out for the known GPUs' bf16 peak)")
    if args.train_tokenizer is not None:
        from hf_memffn.tokenization import MIN_VOCAB_SIZE

        if args.train_tokenizer < MIN_VOCAB_SIZE:
            raise ValueError(f"--train-tokenizer={args.train_tokenizer}: expected a vocabulary of {MIN_VOCAB_SIZE} "
                             "tokens or more (256 bytes and 3 special tokens)")
    if args.data_dir and (args.data_files or args.dataset):
        given = "--data-files" if args.data_files else "--dataset"
        raise ValueError(f"--data-dir reads token shards, so {given} would be left unused: give one of the two")
    if args.data_dir:
        unused = [f"--{name.replace('_', '-')}" for name in TEXT_DATA_OPTIONS if name in args.given_options]
        if unused:
            raise ValueError(f"--data-dir reads token shards, already tokenized and split into train.bin and "
                             f"heldout.bin, so {', '.join(unused)} would be left unused: drop "
                             f"{'it' if len(unused) == 1 else 'them'}, or give the text as --dataset or --data-files")
        refuse_a_folder_without_shards(args.data_dir, tokenizer_given=bool(args.tokenizer))
    if args.data_files:
        data_files_builder(args)  # (a file named twice, or files of two formats)
    if args.dataset_config and not args.dataset:
        raise ValueError(f"--dataset-config={args.dataset_config!r} names a configuration of a --dataset, which is "
                         "not given: drop it, or give the --dataset it belongs to")
    if args.dataset_config and args.data_files:  # (--dataset is then the builder that reads them, given no config)
        raise ValueError(f"--dataset-config={args.dataset_config!r}: --data-files are read by the builder "
                         f"--dataset={args.dataset!r} without a configuration, so it would be left unused: drop it")
    if args.train_tokenizer and args.tokenizer:
        raise ValueError(f"--train-tokenizer trains a tokenizer, so --tokenizer={args.tokenizer!r} would be left "
                         "unused: give one of the two")
    if args.init_from and args.train_tokenizer:
        raise ValueError(f"--train-tokenizer: the model of --init-from={args.init_from!r} reads the token ids of its "
                         "own tokenizer, which a new one would not keep; drop --train-tokenizer")
    if args.config_overrides and not args.init_from:  # its fields and values, before the tokenizer sets the vocabulary
        vocab_size, overrides = vocab_size_and_fields(parse_overrides(args.config_overrides), 64 * 1024)
        build_config(args.arch, args.preset, vocab_size, **positions_for_the_block_size(args, overrides))


# The options of text data (--dataset, --data-files) that token shards (--data-dir) have no use for: which column
# holds the text, which splits train and evaluate, how many processes tokenize.
TEXT_DATA_OPTIONS = ("text_column", "train_split", "validation_split", "validation_fraction", "num_proc")


def refuse_a_folder_without_shards(data_dir: str, tokenizer_given: bool) -> None:
    """A --data-dir that is not a folder of token shards (a mistyped path, the folder above the shards) failed after
    --output-dir was made, in the tokenizer's loading, with an error that named neither the option nor the folder."""
    folder = Path(data_dir)
    if not folder.is_dir():
        raise ValueError(f"--data-dir={data_dir!r} is not a folder: give the folder of token shards "
                         "(examples/reproduce/prepare_data.py writes one)")
    missing = [name for name in ("train.bin", "heldout.bin") if not (folder / name).is_file()]
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json")
    if not tokenizer_given and not any((folder / name).is_file() for name in tokenizer_files):
        missing.append("a tokenizer (tokenizer.json; or pass --tokenizer)")
    if missing:
        raise ValueError(f"--data-dir={data_dir!r} lacks {', '.join(missing)}: give a folder of token shards "
                         "(examples/token_shards.py; examples/reproduce/prepare_data.py writes one)")


def refuse_a_used_output_dir(args, output_dir: Path) -> None:
    """A fresh run (no --resume) into a folder that holds another run's log, checkpoints or results would append to
    its log and keep its checkpoints, which a later `--resume latest` would then take. So would a run resumed from a
    checkpoint of another folder (`--resume DIR/checkpoint-N`), its log rewritten with the other run's history."""
    elsewhere = args.resume not in (None, "latest") and Path(args.resume).resolve().parent != output_dir.resolve()
    if (args.resume and not elsewhere) or not output_dir.is_dir():
        return
    found = sorted(path.name for pattern in ("checkpoint-*", "train_log.jsonl", "summary.json", "final")
                   for path in output_dir.glob(pattern))
    if not found:
        return
    if elsewhere:
        raise ValueError(f"--output-dir={str(output_dir)!r} holds a run ({', '.join(found[:4])}) and "
                         f"--resume={args.resume!r} is a checkpoint of another folder: resumed there, the two runs "
                         "would share a log and checkpoints; choose another --output-dir, or resume a checkpoint of "
                         "that folder")
    # (a run stopped before its first checkpoint left its log only: told to pass --resume latest, the user was then
    # told that there is no checkpoint to resume from)
    if any(name.startswith("checkpoint-") for name in found):
        advice = "): pass --resume latest to go on with it"
    else:
        advice = f") without a checkpoint to resume from: remove {', '.join(found)} to start afresh"
    raise ValueError(f"--output-dir={str(output_dir)!r} holds a run ({', '.join(found[:4])}{advice}, or choose "
                     "another folder")


def resume_checkpoint(args, output_dir: Path, is_main_process: bool = True) -> str | None:
    """The checkpoint that --resume names (`latest`: the newest one saved whole, `damaged_part`); the checkpoints it
    passes over are told by the main process only, as the Trainer's messages are."""
    if args.resume is None:
        return None
    if args.resume != "latest":
        damage = damaged_part(Path(args.resume))
        if damage:
            raise ValueError(f"--resume={args.resume!r} is not a checkpoint folder saved whole ({damage}): give a "
                             "checkpoint-* folder of a run, or 'latest' (the newest one saved whole)")
        return args.resume
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    numbered = sorted((int(path.name.split("-", 1)[1]), path) for path in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
                      if path.is_dir() and path.name.split("-", 1)[1].isdigit()) if output_dir.is_dir() else []
    damaged = []
    for _, path in reversed(numbered):
        damage = damaged_part(path)
        if damage is None:
            if damaged and is_main_process:
                print(f"--resume latest: not saved whole in --output-dir={str(output_dir)!r}: {', '.join(damaged)}; "
                      f"resuming from {path.name}", flush=True)
            return str(path)
        damaged.append(f"{path.name} ({damage})")
    if damaged:
        raise ValueError(f"--resume latest: no whole checkpoint in --output-dir={str(output_dir)!r}: "
                         f"{', '.join(damaged)} (a session stopped while saving)")
    raise ValueError(f"--resume latest: no checkpoint-* folder in --output-dir={str(output_dir)!r}, so nothing to "
                     "resume from (a session stopped before its first checkpoint, --save-steps, leaves none): run "
                     "without --resume")


# The files of a checkpoint that the Trainer writes with `torch.save`, a zip archive: one cut short lacks the archive's
# closing directory.
TORCH_SAVED_SUFFIXES = (".pt", ".pth", ".bin")


def damaged_part(checkpoint: Path) -> str | None:
    """What keeps `checkpoint` from being a checkpoint saved whole, or None. The Trainer writes a checkpoint in place
    and its trainer_state.json last, so a session stopped while saving leaves a folder without a readable one
    (transformers' `get_last_checkpoint` took that folder, which failed to load). Weights or optimizer state cut short
    beside a readable trainer_state.json (a checkpoint saved again over an older one, or a machine that went down
    before its writes reached the disk) failed in transformers after the data was packed."""
    try:
        json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "no readable trainer_state.json"
    import zipfile

    from safetensors import SafetensorError, safe_open

    for path in sorted(checkpoint.iterdir()):
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt"):  # (reads the header, checks the data covers the file)
                    pass
            except (OSError, SafetensorError):
                return f"{path.name} cut short"
        elif path.suffix in TORCH_SAVED_SUFFIXES and path.is_file() and not zipfile.is_zipfile(path):
            return f"{path.name} cut short"
    return None


# Config fields that choose how the model computes (kernels, recomputation, the generation cache), not what: a run may
# resume with other values of them (on another device, say).
EXECUTION_CONFIG_FIELDS = ("ffn_kernel", "decoder_kernels", "ffn_recompute_chunk_tokens", "use_cache")
# Written by `save_pretrained` about the saving, not the model.
SAVED_CONFIG_BOOKKEEPING = ("transformers_version", "architectures", "auto_map", "dtype", "torch_dtype",
                            "_name_or_path")


def refuse_a_checkpoint_of_another_model(model, checkpoint: str | None) -> None:
    """A checkpoint of another architecture or config (another --arch, --preset or --config-overrides than the run's)
    is refused before training: the Trainer loaded its weights with a warning and failed in the optimizer's state
    (another architecture), with a size mismatch of some weight (another size), or went on training another model
    than the checkpoint's (another dropout, activation, ...) from its weights."""
    if checkpoint is None or not (Path(checkpoint) / "config.json").is_file():
        return
    saved_type = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8")).get("model_type")
    if saved_type != model.config.model_type:
        differing, saved, built = ["model_type"], {"model_type": saved_type}, {"model_type": model.config.model_type}
    else:  # (config.json holds the fields that differ from the class's defaults: read whole, by the same class)
        saved = json.loads(type(model.config).from_pretrained(checkpoint).to_json_string(use_diff=False))
        built = json.loads(model.config.to_json_string(use_diff=False))
        ignored = set(EXECUTION_CONFIG_FIELDS) | set(SAVED_CONFIG_BOOKKEEPING)
        differing = sorted(key for key in set(saved) | set(built)
                           if key not in ignored and saved.get(key) != built.get(key))
    if differing:
        _refuse_another_model(checkpoint, differing, saved, built)


def refuse_a_checkpoint_of_another_arch(args, checkpoint: str | None) -> None:
    """The --arch of a new model against its checkpoint's model type, before the data is read, tokenized and packed
    (the whole config is compared once the model is built: `refuse_a_checkpoint_of_another_model`)."""
    if checkpoint is None or args.init_from or not (Path(checkpoint) / "config.json").is_file():
        return
    saved_type = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8")).get("model_type")
    built_type = config_class_of(args.arch).model_type
    if saved_type != built_type:
        _refuse_another_model(checkpoint, ["model_type"], {"model_type": saved_type}, {"model_type": built_type})


def _refuse_another_model(checkpoint: str, differing: list[str], saved: dict, built: dict) -> None:
    shown = ", ".join(f"{key}={saved.get(key)!r} (these arguments: {built.get(key)!r})" for key in differing[:3])
    more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
    raise ValueError(f"--resume: {str(checkpoint)!r} is a checkpoint of another model: its config has "
                     f"{shown}{more}; resume with the run's own --arch, --preset, --config-overrides and "
                     "tokenizer, or choose another --output-dir")


def refuse_a_checkpoint_beyond_max_steps(checkpoint: str | None, max_steps: int) -> None:
    """A checkpoint of a step beyond --max-steps was taken as one at --max-steps ("nothing left to train"): its
    weights, trained for more steps than the schedule has, were saved and evaluated as the run's."""
    if checkpoint is None or max_steps <= 0:
        return
    step = checkpoint_state(checkpoint).global_step
    if step > max_steps:
        raise ValueError(f"--max-steps={max_steps}: the checkpoint to resume from ({str(checkpoint)!r}) is at step "
                         f"{step}, beyond it; resume with --max-steps {step} or more (the run's own schedule)")


def refuse_a_stop_that_stops_nothing(stop_after_steps: int | None, max_steps: int, checkpoint: str | None) -> None:
    """A --stop-after-steps at or past --max-steps was left unused without a word (the run trained to --max-steps), and
    one before the step of the checkpoint to resume from trained one step more than the checkpoint (the Trainer asks
    whether to stop at the end of each step it trains). One at the checkpoint's step leaves nothing to train: the run
    evaluates and saves the checkpoint's model (`main`), as a session stopped there before doing so would have."""
    if stop_after_steps is None:
        return
    if 0 < max_steps <= stop_after_steps:
        raise ValueError(f"--stop-after-steps={stop_after_steps}: at or past --max-steps={max_steps}, where training "
                         "stops anyway; give an earlier step, or leave it out")
    step = checkpoint_state(checkpoint).global_step if checkpoint else 0
    if stop_after_steps < step:
        raise ValueError(f"--stop-after-steps={stop_after_steps}: the checkpoint to resume from ({str(checkpoint)!r}) "
                         f"is at step {step}, past it; give step {step} or later, or leave it out to train on to "
                         "--max-steps")


def refuse_a_checkpoint_without_optimizer_state(checkpoint: str | None, max_steps: int,
                                                stop_after_steps: int | None) -> None:
    """A checkpoint saved with --save-only-model holds no optimizer or schedule state: resumed, the Trainer trained the
    steps left without a word from a new optimizer state, with its schedule started again from step 0 (the warmup
    again, the decay ending past --max-steps). Refused where steps are left to train before --max-steps or
    --stop-after-steps: a session stopped after its last checkpoint still finishes. The state is
    looked for where the Trainer loads it: optimizer.pt or optimizer.bin, a folder of FSDP's sharded state, or
    DeepSpeed's global_step folder."""
    from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN

    if checkpoint is None:
        return
    folder = Path(checkpoint)
    step = checkpoint_state(checkpoint).global_step
    if any(step >= end for end in (max_steps, stop_after_steps) if end and end > 0):  # (nothing left to train)
        return
    if (folder / OPTIMIZER_NAME).is_file() or (folder / OPTIMIZER_NAME_BIN).is_file() or any(
            path.is_dir() and ("optimizer" in path.name or path.name.startswith("global_step"))
            for path in folder.iterdir()):
        return
    raise ValueError(f"--resume: the checkpoint to resume from ({str(checkpoint)!r}) holds no optimizer state (saved "
                     "with --save-only-model): the steps left would train from a new optimizer state with the "
                     f"schedule started again from step 0 at step {step}; go on from its weights in a new run: "
                     f"--init-from {str(checkpoint)!r} with another --output-dir")


def refuse_another_learning_rate(checkpoint: str | None, learning_rate: float) -> None:
    """A run resumed with another --learning-rate trained on without a word at the checkpoint's peak rate, which the
    Trainer takes back with the schedule's state (`base_lrs` of scheduler.pt), and with the cosine floor of the new
    rate (--min-learning-rate is applied as a fraction of --learning-rate): a schedule of neither run. Checkpoints
    without the schedule's state (DeepSpeed saves its own), or of a schedule without `base_lrs`, pass."""
    from transformers.trainer import SCHEDULER_NAME

    saved = Path(checkpoint) / SCHEDULER_NAME if checkpoint else None
    if saved is None or not saved.is_file():
        return
    saved_rate = max(torch.load(saved, map_location="cpu", weights_only=True).get("base_lrs") or [None])
    if saved_rate is not None and not math.isclose(saved_rate, learning_rate, rel_tol=1e-6):
        raise ValueError(f"--learning-rate={learning_rate!r}: the checkpoint to resume from ({str(checkpoint)!r}) was "
                         f"trained at a peak rate of {saved_rate!r}, which the Trainer takes back with its schedule "
                         f"(another rate would be left unused); resume with --learning-rate {saved_rate!r}")


# Written into each checkpoint: the settings that decide which tokens each step trains on (see `batch_settings`), and
# the number and `blocks_fingerprint` of the training and held-out blocks with --max-eval-blocks (see `main`).
BATCH_SETTINGS_FILE = "recipe_batches.json"


def recorded_batch_settings(checkpoint: str | None) -> dict | None:
    """The batch settings and data record that `checkpoint` holds (`BATCH_SETTINGS_FILE`), or None where there is
    none: no checkpoint, or one of a recipe version that recorded nothing."""
    recorded = Path(checkpoint) / BATCH_SETTINGS_FILE if checkpoint else None
    if recorded is None or not recorded.is_file():
        return None
    return json.loads(recorded.read_text(encoding="utf-8"))


def batch_settings(args, training_args, train_batch_size: int | None = None) -> dict:
    """The block size, what makes the blocks of one optimizer step and the sampler and seeds of their order: a run
    resumed with others packs other blocks, skips another number of them or orders them otherwise, so the steps left
    train on other data than the run's (the Trainer only warns about the batch size). `train_batch_size`: the
    Trainer's batch per process (`TrainerState.train_batch_size`, over its `n_gpu` GPUs), where it differs from the
    arguments': --auto-find-batch-size shrinks it after running out of memory, and a resume with that option takes
    the checkpoint's back (`trainer_batch_size_on_resume`)."""
    # (a TrainingArguments field of the later transformers versions; "random" before)
    sampler = getattr(training_args, "train_sampling_strategy", "random")
    return {"block_size": args.block_size,
            "per_device_train_batch_size": per_device_batch(training_args, train_batch_size),
            "auto_find_batch_size": training_args.auto_find_batch_size,
            "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
            "world_size": training_args.world_size,
            "seed": training_args.seed, "data_seed": training_args.data_seed,
            "train_sampling_strategy": getattr(sampler, "value", sampler)}  # (the name, where an enum holds it)


def per_device_batch(training_args, train_batch_size: int | None) -> int:
    """The per-device batch of the Trainer's batch per process `train_batch_size` (the arguments' where None)."""
    if train_batch_size is None:
        return training_args.per_device_train_batch_size
    return train_batch_size // max(1, training_args.n_gpu)  # (as `TrainingArguments.train_batch_size` multiplied)


def trainer_batch_size_on_resume(checkpoint: str | None, training_args) -> int | None:
    """The batch per process the Trainer resumes `checkpoint` with where it is not the arguments': with
    --auto-find-batch-size it takes back the batch saved in the checkpoint's state (the one found before), without it
    the arguments' batch, whatever trained."""
    if checkpoint is None or not training_args.auto_find_batch_size:
        return None
    return checkpoint_state(checkpoint).train_batch_size


def _data_order(settings: dict) -> tuple[str, str | None, int | None]:
    """How the Trainer orders the training blocks: its sampler (a record without one was of "random"), and the
    option whose seed shuffles them with its value, --data-seed, else --seed (none for "sequential": no seed moves
    its blocks)."""
    sampler = settings.get("train_sampling_strategy") or "random"
    if sampler == "sequential":
        return sampler, None, None
    if settings.get("data_seed") is not None:
        return sampler, "--data-seed", settings["data_seed"]
    return sampler, "--seed", settings["seed"]


def _describe_data_order(sampler: str, seed_option: str | None, seed: int | None, separator: str) -> str:
    """The options of a `_data_order`, as typed ("--seed 0", separator " ") or as given ("--seed=0", "=")."""
    options = [] if sampler == "random" else [f"--train-sampling-strategy{separator}{sampler}"]
    return " ".join(options + ([f"{seed_option}{separator}{seed}"] if seed_option else []))


def _refuse_another_data_order(checkpoint: str, saved_settings: dict, settings: dict) -> None:
    """Refuse resuming with blocks in another order (`_data_order`) than the checkpoint's, with the options that give
    its order back: a --data-seed given now wins over the run's --seed, so the advice sets it."""
    now, saved = _data_order(settings), _data_order(saved_settings)
    (sampler, seed_option, seed), (saved_sampler, saved_seed_option, saved_seed) = now, saved
    if (sampler, seed) == (saved_sampler, saved_seed):
        return
    advice = [f"--train-sampling-strategy {saved_sampler}"] if saved_sampler != sampler else []
    if saved_seed_option:
        option = "--data-seed" if settings.get("data_seed") is not None else saved_seed_option
        advice.append(f"{option} {saved_seed}")
    raise ValueError(f"{_describe_data_order(*now, '=')}: the checkpoint to resume from ({str(checkpoint)!r}) was "
                     f"trained on the blocks in the order of {_describe_data_order(*saved, ' ')}; resume with "
                     f"{' '.join(advice)} (another order gives the steps left other blocks than the run's: some "
                     "trained on twice, others never)")


def _blocks_per_step(settings: dict) -> int:
    return (settings["per_device_train_batch_size"] * settings["gradient_accumulation_steps"]
            * settings["world_size"])


def refuse_fewer_blocks_than_one_step(train_blocks, block_size: int, settings: dict) -> None:
    """A training text of fewer blocks than one optimizer step takes trained every step on all of them: on short
    batches whose tokens/s and MFU counted the full step's tokens (4x too many for 2 blocks in a batch of 8), and,
    over several processes, on blocks the sampler repeats to fill each one's batch."""
    needed = _blocks_per_step(settings)
    if len(train_blocks) < needed:
        raise ValueError(f"the training text gives {len(train_blocks)} block(s) of --block-size={block_size} tokens, "
                         f"fewer than the {needed} of one optimizer step (--per-device-train-batch-size "
                         f"{settings['per_device_train_batch_size']} x --gradient-accumulation-steps "
                         f"{settings['gradient_accumulation_steps']} x {settings['world_size']} process(es)); give "
                         "more text, or smaller blocks or batches")


def refuse_a_checkpoint_of_other_batches(checkpoint: str | None, settings: dict) -> None:
    """A checkpoint trained with another --block-size, another order of the blocks (--seed, or --data-seed where
    given, and --train-sampling-strategy) or another number of blocks per step is refused before the data is read.
    (The same number of blocks per step split otherwise between processes, per-device batches and accumulation steps
    is accepted: each step of an epoch takes the same blocks; so is another --seed beside the run's --data-seed, and
    any seed where the blocks are not shuffled, "sequential". Checkpoints of recipe versions that recorded nothing,
    or no seeds, pass.)"""
    saved = recorded_batch_settings(checkpoint)
    if saved is None:
        return
    if saved.get("block_size") != settings["block_size"]:
        raise ValueError(f"--block-size={settings['block_size']}: the checkpoint to resume from ({str(checkpoint)!r}) "
                         f"was trained on blocks of {saved.get('block_size')} tokens; resume with --block-size "
                         f"{saved.get('block_size')} (other blocks would give the steps left other data than the "
                         "run's)")
    if "seed" in saved:
        _refuse_another_data_order(checkpoint, saved, settings)
    try:
        saved_blocks = _blocks_per_step(saved)
    except (KeyError, TypeError):
        return
    if saved_blocks != _blocks_per_step(settings):
        def spelled(values):
            return (f"--per-device-train-batch-size {values['per_device_train_batch_size']} x "
                    f"--gradient-accumulation-steps {values['gradient_accumulation_steps']} x "
                    f"{values['world_size']} process(es)")

        # (the Trainer takes back the batch that --auto-find-batch-size found only where that option is given again)
        found = (", or with --auto-find-batch-size, with which the Trainer takes back the batch it found"
                 if saved.get("auto_find_batch_size") and not settings.get("auto_find_batch_size") else "")
        raise ValueError(f"--resume: the checkpoint to resume from ({str(checkpoint)!r}) was "
                         f"trained on {saved_blocks} blocks per step ({spelled(saved)}), these arguments give "
                         f"{_blocks_per_step(settings)} ({spelled(settings)}); resume with {saved_blocks} blocks per "
                         f"step{found} (with another count the resumed run skips other blocks: some would be trained "
                         "on twice, others never)")


# Written into each checkpoint: the optimizer's and the schedule's settings (see `optimizer_settings`).
OPTIMIZER_SETTINGS_FILE = "recipe_optimizer.json"
_TAKEN_BACK = "the Trainer takes the checkpoint's back with the optimizer's state: another value would be left unused"
_ANOTHER_SCHEDULE = "the steps left would follow another schedule than the steps trained: a schedule of neither run"
# The settings a resumed run must keep (`refuse_a_checkpoint_of_other_optimizer_settings`): the option of each, and
# what another value did. (A longer --max-steps may be given: the steps left follow the schedule of the new total.)
OPTIMIZER_OPTIONS = {
    "optim": ("--optim", "the checkpoint's optimizer state would be loaded into another optimizer"),
    "optim_args": ("--optim-args", "the checkpoint's optimizer state would be loaded into another optimizer"),
    "adam_beta1": ("--adam-beta1", _TAKEN_BACK),
    "adam_beta2": ("--adam-beta2", _TAKEN_BACK),
    "adam_epsilon": ("--adam-epsilon", _TAKEN_BACK),
    "weight_decay": ("--weight-decay", _TAKEN_BACK),
    "lr_scheduler_type": ("--lr-scheduler-type", _ANOTHER_SCHEDULE),
    "lr_scheduler_kwargs": ("--lr-scheduler-kwargs", _ANOTHER_SCHEDULE),
    "min_learning_rate": ("--min-learning-rate", _ANOTHER_SCHEDULE),
    "warmup_steps": ("--warmup-steps", _ANOTHER_SCHEDULE),
    "max_grad_norm": ("--max-grad-norm", "the steps left would clip their gradients otherwise than the steps trained"),
}


def optimizer_settings(training_args) -> dict:
    """The settings of `OPTIMIZER_OPTIONS` (after `apply_the_cosine_floor`): --min-learning-rate is the cosine floor
    as a rate (None for a schedule without one), apart from the other --lr-scheduler-kwargs."""
    scheduler_kwargs = dict(training_args.lr_scheduler_kwargs or {})
    floor_rate = scheduler_kwargs.pop("min_lr_rate", None)
    return {"optim": getattr(training_args.optim, "value", training_args.optim),  # (the name, where an enum holds it)
            "optim_args": training_args.optim_args,
            "adam_beta1": training_args.adam_beta1, "adam_beta2": training_args.adam_beta2,
            "adam_epsilon": training_args.adam_epsilon, "weight_decay": training_args.weight_decay,
            "lr_scheduler_type": getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type),
            "lr_scheduler_kwargs": scheduler_kwargs,
            "min_learning_rate": None if floor_rate is None else floor_rate * training_args.learning_rate,
            "warmup_steps": training_args.warmup_steps, "max_grad_norm": training_args.max_grad_norm}


def _spelled_option(option: str, value, separator: str = " ") -> str:
    """An option with its value as typed ("--weight-decay 0.1", separator " ") or as given ("=") on the command line,
    or "no --optim-args" for a value of None."""
    if value is None:
        return f"no {option}"
    return f"{option}{separator}{shlex.quote(json.dumps(value)) if isinstance(value, dict) else value}"


def refuse_a_checkpoint_of_other_optimizer_settings(checkpoint: str | None, settings: dict) -> None:
    """A run resumed with another optimizer setting (`OPTIMIZER_OPTIONS`) than its checkpoint's is refused before the
    data is read, naming each option with the checkpoint's value and the new one: the Trainer took some back from the
    checkpoint (the optimizer's state holds the betas, epsilon and weight decay), loaded the state into another
    --optim, and built the schedule and clipping of the steps left from the new ones. Checkpoints of recipe versions
    that recorded nothing, and settings a record lacks, pass."""
    recorded = Path(checkpoint) / OPTIMIZER_SETTINGS_FILE if checkpoint else None
    if recorded is None or not recorded.is_file():
        return
    saved = json.loads(recorded.read_text(encoding="utf-8"))

    def same(first, second) -> bool:
        if isinstance(first, float) and isinstance(second, (int, float)) and not isinstance(second, bool):
            return math.isclose(first, second, rel_tol=1e-6)
        return first == second

    # (a cosine floor of None comes with a schedule type without one: that type is named)
    differing = sorted((OPTIMIZER_OPTIONS[key][0], key) for key in OPTIMIZER_OPTIONS
                       if key in saved and not same(saved[key], settings[key])
                       and not (key == "min_learning_rate" and None in (saved[key], settings[key])))
    if not differing:
        return
    given = ", ".join(_spelled_option(option, settings[key], "=") for option, key in differing)
    trained = "; ".join(f"{_spelled_option(option, saved[key])} ({OPTIMIZER_OPTIONS[key][1]})"
                        for option, key in differing)
    advice = " ".join(_spelled_option(option, saved[key]) for option, key in differing)
    raise ValueError(f"{given}: the checkpoint to resume from ({str(checkpoint)!r}) was trained with {trained}; "
                     f"resume with {advice}")


def refuse_a_checkpoint_of_other_weight_decay_groups(trainer, checkpoint: str | None) -> None:
    """A checkpoint whose optimizer state (optimizer.pt) holds other numbers of trained parameters in the Trainer's two
    groups (with weight decay, without) than the Trainer's optimizer for this run is refused before training, naming
    both: the Trainer failed in torch's `load_state_dict` ("loaded state dict contains a parameter group that doesn't
    match the size of optimizer's group"). Earlier versions of the package saved such states: before MemoryLLM's and
    FlexMemoryLLM's RMSNorm weights of the FFNs on X0 were named `rmsnorm_weight` (which the Trainer leaves out of
    weight decay), and before FlashMHF's key, up and value and KV-FFN's key and value projections were joined into one
    parameter each. A state of another layout (more groups, or groups of other settings, as GaLore's) is left to the
    Trainer."""
    from transformers.trainer import OPTIMIZER_NAME

    saved_file = Path(checkpoint) / OPTIMIZER_NAME if checkpoint else None
    if saved_file is None or not saved_file.is_file():
        return
    try:
        groups = torch.load(saved_file, map_location="cpu", mmap=True, weights_only=True)["param_groups"]
        saved = [len(group["params"]) for group in groups]
        trainers_layout = (len(groups) == 2 and set(groups[0]) == set(groups[1])
                           and [group.get("weight_decay") for group in groups] == [trainer.args.weight_decay, 0.0])
    except Exception:  # (a state this check cannot read is left to the Trainer, which names what is wrong)
        return
    decayed = set(trainer.get_decay_parameter_names(trainer.model))
    trained = [name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad]
    built = [sum(name in decayed for name in trained), sum(name not in decayed for name in trained)]
    if trainers_layout and saved != built:
        raise ValueError(
            f"--resume: the optimizer state of {str(checkpoint)!r} holds {saved[0]} trained parameters with weight "
            f"decay and {saved[1]} without, this run's optimizer {built[0]} and {built[1]}, which the Trainer cannot "
            "load (a state saved by an earlier version of hf-memffn: the RMSNorm weights of MemoryLLM's and "
            "FlexMemoryLLM's FFNs on X0 were decayed, FlashMHF's key, up and value and KV-FFN's key and value "
            "projections were separate parameters); continue from its weights with a new optimizer state "
            f"(--init-from {str(checkpoint)!r} with another --output-dir), or resume with the version that saved it")


def refuse_a_checkpoint_of_another_training_text(checkpoint: str | None, settings: dict, train_blocks: int,
                                                 fingerprint: str | None, options: str) -> None:
    """A run resumed on another training text (other --data-files, --dataset or --data-dir, or the run's file grown,
    cut or edited) packs other blocks: a shuffling sampler orders them otherwise, and the steps left skip the first
    blocks of that order, so some would be trained on twice, others never. Refused once the blocks are packed, by
    their number, then by the `blocks_fingerprint` of their tokens (both recorded beside the batch settings), naming
    the `options` that gave the text. Blocks taken in order ("sequential": a grown text goes on where the run was)
    pass, and so do checkpoints that recorded no count or no fingerprint (of earlier versions)."""
    saved = recorded_batch_settings(checkpoint)
    if saved is None or _data_order(settings)[0] == "sequential":
        return
    advice = ("resume with the run's own training text (a shuffled order of other blocks would give the steps left "
              "some blocks trained on twice, others never), or choose another --output-dir")
    if saved.get("train_blocks") is not None and saved["train_blocks"] != train_blocks:
        raise ValueError(f"--resume: the checkpoint to resume from ({str(checkpoint)!r}) was trained on "
                         f"{saved['train_blocks']} blocks of {settings['block_size']} tokens, the training text of "
                         f"these arguments ({options}) gives {train_blocks}; {advice}")
    saved_fingerprint = saved.get("train_text_fingerprint")
    if saved_fingerprint is not None and fingerprint is not None and saved_fingerprint != fingerprint:
        raise ValueError(f"--resume: the checkpoint to resume from ({str(checkpoint)!r}) was trained on {train_blocks} "
                         f"blocks of {settings['block_size']} tokens of fingerprint {saved_fingerprint[:12]}, the "
                         f"training text of these arguments ({options}) gives as many of fingerprint "
                         f"{fingerprint[:12]}, another text (a file edited in place, or other files of as many "
                         f"tokens); {advice}")


def refuse_another_max_eval_blocks(checkpoint: str | None, max_eval_blocks: int | None) -> None:
    """A run resumed with another --max-eval-blocks than its checkpoint's is refused before the data is read: its
    evaluation losses from then on would be of another set of held-out blocks, a curve of two sets in one log, and
    --load-best-model-at-end would pick its best checkpoint by comparing losses of different texts. Checkpoints that
    recorded no cap (of earlier versions) pass."""
    saved = recorded_batch_settings(checkpoint)
    if saved is None:
        return
    if "max_eval_blocks" not in saved or saved["max_eval_blocks"] == max_eval_blocks:
        return
    evaluated = ("every held-out block" if saved["max_eval_blocks"] is None
                 else f"at most {saved['max_eval_blocks']} held-out block(s)")
    advice = ("without --max-eval-blocks" if saved["max_eval_blocks"] is None
              else f"--max-eval-blocks {saved['max_eval_blocks']}")
    raise ValueError(f"{_spelled_option('--max-eval-blocks', max_eval_blocks, '=')}: the checkpoint to resume from "
                     f"({str(checkpoint)!r}) was evaluated on {evaluated}; resume with {advice} (the evaluation "
                     "losses of the steps left would be of another set of blocks than the run's, and the best "
                     "checkpoint picked by comparing the two), or choose another --output-dir")


def refuse_a_checkpoint_of_another_held_out_text(checkpoint: str | None, eval_blocks: int, fingerprint: str,
                                                 options: str) -> None:
    """A run resumed on another held-out text than its checkpoint's (another validation split, --validation-fraction
    or heldout.bin, with the run's --max-eval-blocks: `refuse_another_max_eval_blocks`) is refused once the blocks
    are packed, by their number and `blocks_fingerprint`, naming the `options` that gave the text: its evaluation
    losses would be of other blocks than the run's. Checkpoints that recorded no fingerprint pass."""
    saved = recorded_batch_settings(checkpoint)
    if saved is None:
        return
    saved_fingerprint, saved_blocks = saved.get("eval_text_fingerprint"), saved.get("eval_blocks")
    if saved_fingerprint is None or (saved_fingerprint, saved_blocks) == (fingerprint, eval_blocks):
        return
    raise ValueError(f"--resume: the checkpoint to resume from ({str(checkpoint)!r}) was evaluated on {saved_blocks} "
                     f"held-out block(s) of fingerprint {saved_fingerprint[:12]}, these arguments' held-out text "
                     f"({options}) gives {eval_blocks} of fingerprint {fingerprint[:12]}; resume with the run's own "
                     "held-out text (the evaluation losses of the steps left would be of other blocks than the "
                     "run's), or choose another --output-dir")


def training_text_options(args) -> str:
    """The options that gave the training text, as `refuse_a_checkpoint_of_another_training_text` names them."""
    if args.data_dir:
        return "--data-dir's train.bin"
    return "--data-files" if args.data_files else "--dataset"


def held_out_text_options(args) -> str:
    """The options that gave the held-out text, as `refuse_a_checkpoint_of_another_held_out_text` names them."""
    if args.data_dir:
        return "--data-dir's heldout.bin"
    return (f"{training_text_options(args)}: their --validation-split {args.validation_split!r}, or the last "
            "documents --validation-fraction holds out")


# The most blocks of token shards (--data-dir) that `blocks_fingerprint` reads
FINGERPRINTED_SHARD_BLOCKS = 256


def blocks_fingerprint(blocks) -> str:
    """A hash (hex) of the token ids of packed blocks, which tells a resumed run's text from the run's where both
    give as many blocks. Taken once at the start of a run (`main`) and recorded in each checkpoint. Blocks packed
    from text (`datasets`) are hashed whole, as 64-bit ids: one pass of the hash over 8 bytes a token, little beside
    their tokenization. Token shards (--data-dir, the way of large corpora) are fingerprinted by their number
    of blocks and up to `FINGERPRINTED_SHARD_BLOCKS` blocks spread evenly over them, the first and last among them: a
    few megabytes read, which tell other shards apart, though not an edit between the blocks read."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{len(blocks)} blocks;".encode())
    if hasattr(blocks, "tokens"):  # (token shards: examples/token_shards.TokenBlocks)
        read = np.unique(np.linspace(0, len(blocks) - 1, num=min(FINGERPRINTED_SHARD_BLOCKS, len(blocks)), dtype=int))
        for index in read.tolist():
            digest.update(np.ascontiguousarray(blocks[index]["input_ids"], dtype=np.int64))
        return digest.hexdigest()
    column = blocks.with_format("arrow")[:]["input_ids"]
    for chunk in column.chunks:
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        for start in range(0, len(values), 1 << 22):  # (a bounded copy of the ids at a time, as 64-bit ids)
            digest.update(np.ascontiguousarray(values[start:start + (1 << 22)], dtype=np.int64))
    return digest.hexdigest()


def record_settings_in_checkpoints(trainer, settings: dict, optimizer: dict):
    """Makes the Trainer write the batch `settings` and the `optimizer` settings into each checkpoint it saves
    (`refuse_a_checkpoint_of_other_batches`, `refuse_a_checkpoint_of_other_optimizer_settings`, and of the text:
    `refuse_a_checkpoint_of_another_training_text`, `refuse_another_max_eval_blocks`), with
    the checkpoint's weights: before its trainer_state.json, which the Trainer writes last and without which
    `resume_checkpoint` takes no checkpoint. (Written at `on_save`, after the Trainer's state, a session stopped in
    between left a checkpoint that resumed unchecked.) The per-device batch written is the one that trained, which
    --auto-find-batch-size may have made smaller than the arguments'. Returns the trainer."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from hf_memffn.atomic_write import write_atomic

    save_model = trainer.save_model

    def save_model_and_record(output_dir=None, _internal_call=False):
        save_model(output_dir, _internal_call=_internal_call)
        folder = Path(output_dir or trainer.args.output_dir)
        # (the Trainer saves a checkpoint's weights by this call; `save_final_model`'s folder is another). The folder
        # is made where the call wrote none: FSDP's sharded state dict is saved later, with the optimizer's state.
        if trainer.args.should_save and folder.name.startswith(f"{PREFIX_CHECKPOINT_DIR}-"):
            folder.mkdir(parents=True, exist_ok=True)
            # (the Trainer's state holds the batch of the current start of training)
            trained = {**settings, "per_device_train_batch_size": per_device_batch(trainer.args,
                                                                                    trainer.state.train_batch_size)}
            write_atomic(folder / BATCH_SETTINGS_FILE, json.dumps(trained, indent=2) + "\n")
            write_atomic(folder / OPTIMIZER_SETTINGS_FILE, json.dumps(optimizer, indent=2) + "\n")

    trainer.save_model = save_model_and_record
    return trainer


def checkpoint_state(checkpoint: str | None):
    """The Trainer's state saved with ``checkpoint`` (its step, its log), or None without a checkpoint."""
    from transformers import TrainerState

    return TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json")) if checkpoint else None


def run_training_loss(log_history: list[dict], global_step: int, session_loss: float | None,
                      session_first_step: int) -> dict:
    """The mean training loss of the run. The Trainer's own mean covers the steps since this session started, which
    for a resumed run is not the run's: then the logged windows' losses are averaged, weighted by their steps, where
    they cover every step; otherwise the session's mean is kept and the field says from which step it counts."""
    if session_first_step == 1:
        return {"train_loss": session_loss}
    total, last = 0.0, 0
    for record in log_history:
        if "loss" in record and record["step"] > last:
            total, last = total + record["loss"] * (record["step"] - last), record["step"]
    if last == global_step:
        return {"train_loss": total / global_step}
    return {"train_loss": session_loss, "train_loss_from_step": session_first_step}


def save_final_model(trainer, final_dir: Path) -> None:
    """`trainer.save_model` into a temporary folder beside `final_dir`, renamed to it once whole: saved in place, a
    session stopped while saving left a `final/` that looked complete without some of its files (or, saved over an
    earlier one, with some of that one's). Every process takes part in the save (FSDP and ZeRO-3 gather the weights;
    ZeRO-3 without gathering writes a file per process), so each saves into the temporary folder of the process that
    writes (process 0, or with --save-on-each-node its node's first), which renames it once all are done. With
    --push-to-hub the Trainer's upload of --output-dir follows the rename (from within `save_model` it would upload
    the temporary folder under its hidden name)."""
    import contextlib

    from accelerate import PartialState
    from accelerate.utils import gather_object

    from hf_memffn.atomic_write import atomic_output

    state = PartialState()
    writes = trainer.args.should_save
    with (atomic_output(final_dir) if writes else contextlib.nullcontext()) as temporary:
        temporaries = gather_object([str(temporary) if writes else None])  # (one a process, by process index)
        writer = state.process_index - state.local_process_index if trainer.args.save_on_each_node else 0
        trainer.save_model(temporaries[writer], _internal_call=True)  # (`_internal_call`: no upload from within)
        state.wait_for_everyone()
    if trainer.args.push_to_hub:  # (what `save_model` uploads otherwise, on every process as it does)
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)


# The run's files, train_log.jsonl and summary.json, are strict JSON: a number that is not finite is written as null
# and named under `not_finite` (`hf_memffn.run_records`, imported when used: fine-tuning a saved model runs its own
# modeling code, not this package's).
def run_record_json(record: dict, indent: int | None = None) -> str:
    """A record of the run's files (a line of train_log.jsonl, the summary) as strict JSON."""
    from hf_memffn.run_records import run_record_json as strict_json

    return strict_json(record, indent)


def read_run_record(text: str) -> dict:
    """A record of `run_record_json`, each number that is not finite a float again (NaN, or an infinity)."""
    from hf_memffn.run_records import read_run_record as read_strict_json

    return read_strict_json(text)


def write_summary(summary: dict, output_dir: Path) -> None:
    from hf_memffn.atomic_write import write_atomic

    write_atomic(output_dir / "summary.json", run_record_json(summary, indent=2) + "\n")
    rate = f", {summary['tokens_per_second']:,.0f} tokens/s" if "tokens_per_second" in summary else ""
    mfu = f", MFU {100 * summary['mfu']:.1f}%" if "mfu" in summary else ""
    print(f"done: step {summary['global_step']}, eval loss {summary['eval_loss']:.4f}{rate}{mfu}", flush=True)


def refuse_a_learning_rate_out_of_range(training_args) -> None:
    """A --learning-rate of infinity trained on (every step's update NaN, the log's rate null), and a negative or NaN
    one failed in torch's AdamW after the data was packed, naming no option; with any --lr-scheduler-type."""
    rate = training_args.learning_rate
    if not 0 <= rate < math.inf:
        scheduler_type = getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)
        raise ValueError(f"--learning-rate={rate:g}: expected a finite rate of 0 or more (the peak of the "
                         f"--lr-scheduler-type={scheduler_type} schedule)")


# transformers' schedulers whose cosine decays to a floor, given in `lr_scheduler_kwargs` (`min_lr` or `min_lr_rate`)
COSINE_FLOOR_SCHEDULERS = ("cosine_with_min_lr", "cosine_warmup_with_min_lr")


def apply_the_cosine_floor(args, training_args) -> None:
    """--min-learning-rate as the floor of a cosine schedule (`lr_scheduler_kwargs`' `min_lr_rate`), or the floor
    that --lr-scheduler-kwargs gives. Refused before any work: a floor in both places (the kwargs' one won without a
    word over a --min-learning-rate that was typed), a --min-learning-rate for a schedule without a floor (left
    unused), and a floor above the peak. A --min-learning-rate left at its default is the floor where it is below
    --learning-rate; at or above a lower rate (fine-tuning at 5e-6, say) the floor is the same fraction of that rate
    as the default is of the preset's (1e-5 of 3e-3): the cosine still decays, and nothing untyped is refused."""
    scheduler_type = getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)
    min_learning_rate_given = "min_learning_rate" in args.given_options
    if scheduler_type not in COSINE_FLOOR_SCHEDULERS:
        if min_learning_rate_given:
            raise ValueError(f"--min-learning-rate={args.min_learning_rate:g} is the floor of the cosine schedules "
                             f"({', '.join(COSINE_FLOOR_SCHEDULERS)}), not of --lr-scheduler-type={scheduler_type}: "
                             "drop one of them")
        return
    scheduler_kwargs = dict(training_args.lr_scheduler_kwargs or {})
    floors = [key for key in ("min_lr", "min_lr_rate") if key in scheduler_kwargs]
    if len(floors) == 2:
        raise ValueError("--lr-scheduler-kwargs sets both min_lr and min_lr_rate: give one of them (or neither, "
                         "and --min-learning-rate)")
    for key in floors:
        if isinstance(scheduler_kwargs[key], bool) or not isinstance(scheduler_kwargs[key], (int, float)):
            raise ValueError(f"--lr-scheduler-kwargs {key}={scheduler_kwargs[key]!r}: expected a number")
    if floors and min_learning_rate_given:
        raise ValueError(f"--lr-scheduler-kwargs sets {floors[0]}={scheduler_kwargs[floors[0]]:g} and "
                         f"--min-learning-rate={args.min_learning_rate:g} is given too: both set the floor of the "
                         "cosine decay; give one of them")
    if floors == ["min_lr_rate"]:  # the ratio itself (--min-learning-rate's default is then not the floor)
        if not 0 <= scheduler_kwargs["min_lr_rate"] <= 1:
            raise ValueError(f"--lr-scheduler-kwargs min_lr_rate={scheduler_kwargs['min_lr_rate']:g}: expected 0 to "
                             "1, the floor's fraction of --learning-rate")
        return
    # an absolute `min_lr` there stands for --min-learning-rate (transformers refused it beside the `min_lr_rate`
    # set here, after the data was read)
    minimum, option = ((scheduler_kwargs.pop("min_lr"), "--lr-scheduler-kwargs min_lr")
                       if floors else (args.min_learning_rate, "--min-learning-rate"))
    if not training_args.learning_rate > 0:  # (the floor is a fraction of it)
        raise ValueError(f"--learning-rate={training_args.learning_rate:g}: expected a rate above 0, the peak the "
                         "cosine decay falls from")
    if not floors and not min_learning_rate_given and minimum >= training_args.learning_rate:
        minimum = training_args.learning_rate * minimum / get_preset(args.preset).learning_rate
    if not 0 <= minimum <= training_args.learning_rate:
        # (above the peak, the cosine "decay" would climb from the peak to it)
        peak = (f"--learning-rate={training_args.learning_rate:g}" if "learning_rate" in args.given_options
                else f"{training_args.learning_rate:g} (the learning rate of preset {args.preset!r}; --learning-rate "
                     "sets another)")
        raise ValueError(f"{option}={minimum:g}: expected 0 to {peak}, the rate the cosine decay falls from")
    # as a ratio: an absolute `min_lr` is divided by `optimizer.defaults["lr"]`, which DeepSpeed's ZeRO optimizers
    # do not have
    min_lr_rate = minimum / training_args.learning_rate
    training_args.lr_scheduler_kwargs = {"min_lr_rate": min_lr_rate, **scheduler_kwargs}


def main(argv=None) -> dict:
    args, training_args = parse_arguments(argv)
    from transformers import Trainer, set_seed

    from hf_memffn.hub import keep_model_card

    output_dir = Path(args.output_dir)
    profile_steps = parse_profile_steps(args.profile_steps) if args.profile_steps else None
    refuse_a_learning_rate_out_of_range(training_args)
    apply_the_cosine_floor(args, training_args)
    refuse_conflicting_arguments(args)
    if profile_steps:
        refuse_profile_steps_past_the_run(args.profile_steps, profile_steps[1], training_args.max_steps,
                                          args.stop_after_steps)
    from hf_memffn.cli_args import refuse_an_output_dir_that_cannot_be_written

    # (before the data is loaded and a tokenizer trained: a file failed after them in `mkdir` naming no option, and a
    # read-only folder after training up to its first log line)
    refuse_an_output_dir_that_cannot_be_written(output_dir, "--output-dir")
    refuse_a_used_output_dir(args, output_dir)
    checkpoint = resume_checkpoint(args, output_dir, training_args.process_index == 0)
    refuse_a_checkpoint_of_another_arch(args, checkpoint)
    refuse_a_checkpoint_beyond_max_steps(checkpoint, training_args.max_steps)
    refuse_a_stop_that_stops_nothing(args.stop_after_steps, training_args.max_steps, checkpoint)
    refuse_a_checkpoint_without_optimizer_state(checkpoint, training_args.max_steps, args.stop_after_steps)
    if profile_steps:
        refuse_profile_steps_before_the_checkpoint(args.profile_steps, profile_steps[0], checkpoint)
    refuse_another_learning_rate(checkpoint, training_args.learning_rate)
    batches = batch_settings(args, training_args, trainer_batch_size_on_resume(checkpoint, training_args))
    refuse_a_checkpoint_of_other_batches(checkpoint, batches)
    optimizer = optimizer_settings(training_args)
    refuse_a_checkpoint_of_other_optimizer_settings(checkpoint, optimizer)
    refuse_another_max_eval_blocks(checkpoint, args.max_eval_blocks)
    set_seed(args.seed)
    output_dir.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train_blocks, eval_blocks, tokenizer = load_data(args, training_args)
    refuse_fewer_blocks_than_one_step(train_blocks, args.block_size, batches)
    # (recorded in the checkpoints with the batch settings; the fingerprints taken once, here)
    data_record = {"train_blocks": len(train_blocks), "train_text_fingerprint": blocks_fingerprint(train_blocks),
                   "max_eval_blocks": args.max_eval_blocks, "eval_blocks": len(eval_blocks),
                   "eval_text_fingerprint": blocks_fingerprint(eval_blocks)}
    refuse_a_checkpoint_of_another_training_text(checkpoint, batches, len(train_blocks),
                                                 data_record["train_text_fingerprint"], training_text_options(args))
    refuse_a_checkpoint_of_another_held_out_text(checkpoint, len(eval_blocks), data_record["eval_text_fingerprint"],
                                                 held_out_text_options(args))
    batches.update(data_record)

    model = build_model(args, tokenizer)
    refuse_an_arch_other_than_the_saved_models(args, model)
    refuse_a_checkpoint_of_another_model(model, checkpoint)
    if args.data_dir:
        refuse_token_ids_beyond_the_embedding(model, args.data_dir, train_blocks, eval_blocks)
    counts = parameter_counts(model)
    world_size = training_args.world_size
    tokens_per_step = _blocks_per_step(batches) * args.block_size  # (a resume's auto-found batch, too)
    flops_per_token = training_flops_per_token(model, args.block_size)
    throughput = make_throughput_callback(tokens_per_step, args.block_size, flops_per_token,
                                          device_peak_flops(args.peak_tflops), world_size,
                                          output_dir / "train_log.jsonl",
                                          range(profile_steps[0], profile_steps[1] + 2) if profile_steps else range(0))
    # With --init-from the saved model decides the architecture and size; --preset then gives only the learning rate.
    model_label = (f"{model.config.model_type} from {args.init_from}" if args.init_from
                   else f"{args.arch} preset={args.preset}")
    if training_args.process_index == 0:
        print(
            f"{model_label}: {counts['total']:,} parameters, {len(train_blocks):,} train / "
            f"{len(eval_blocks):,} eval blocks of {args.block_size} tokens, {tokens_per_step:,} tokens/step on {world_size} "
            f"process(es), bf16={training_args.bf16}, {flops_per_token / 1e9:.3f} GFLOP/token",
            flush=True,
        )

    trainer = record_settings_in_checkpoints(keep_model_card(Trainer(
        model=model,
        args=training_args,
        train_dataset=train_blocks,
        eval_dataset=eval_blocks,
        data_collator=collate_blocks,
        processing_class=tokenizer,
        callbacks=[throughput, make_log_at_checkpoints_callback()]
        + ([make_stop_callback(args.stop_after_steps)] if args.stop_after_steps else [])
        + ([make_profile_callback(*profile_steps, output_dir, training_args.process_index == 0)] if profile_steps else []),
    )), batches, optimizer)
    started = time.perf_counter()
    resumed_state = checkpoint_state(checkpoint)
    if resumed_state and trainer.is_world_process_zero():
        rewind_train_log(output_dir / "train_log.jsonl", resumed_state.log_history)
    session_first_step = 1 + (resumed_state.global_step if resumed_state else 0)
    # the step this session trains to, where the arguments name one
    last_steps = {option: step for option, step in (("--max-steps", training_args.max_steps),
                                                    ("--stop-after-steps", args.stop_after_steps)) if step and step > 0}
    last_option = min(last_steps, key=last_steps.get) if last_steps else None
    if resumed_state and last_option and last_steps[last_option] <= resumed_state.global_step:
        # stopped after its last checkpoint, before its final evaluation: transformers' Trainer would resume it with
        # one step more than the schedule (or the stop) has
        if trainer.is_world_process_zero():
            print(f"{checkpoint} is at {last_option}={last_steps[last_option]}: nothing left to train", flush=True)
        trainer._load_from_checkpoint(checkpoint)
        trainer.state, session_loss = resumed_state, None
        if training_args.load_best_model_at_end and resumed_state.best_model_checkpoint:
            trainer._load_best_model()  # (as the Trainer does at the end of training)
    else:
        refuse_a_checkpoint_of_other_weight_decay_groups(trainer, checkpoint)
        session_loss = trainer.train(resume_from_checkpoint=checkpoint).training_loss
    train_seconds = time.perf_counter() - started
    eval_metrics = (evaluation_at_the_last_step(trainer.state, training_args.load_best_model_at_end)
                    or trainer.evaluate())
    final_dir = output_dir / "final"
    save_final_model(trainer, final_dir)

    summary = {
        "arch": args.arch,
        "preset": args.preset,
        "init_from": args.init_from,
        "model_type": model.config.model_type,
        "parameters": counts,
        "world_size": world_size,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "bf16": training_args.bf16,
        "global_step": trainer.state.global_step,
        **run_training_loss(trainer.state.log_history, trainer.state.global_step, session_loss, session_first_step),
        "eval_loss": eval_metrics["eval_loss"],
        "train_seconds": round(train_seconds, 2),
        "tokens_per_step": throughput.tokens_per_step,  # (of the batches that trained: see --auto-find-batch-size)
        "flops_per_token": flops_per_token,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None,
        **throughput.summary(),
        "final_model": str(final_dir),
        "argv": sys.argv[1:] if argv is None else list(argv),
    }
    if trainer.is_world_process_zero():
        write_summary(summary, output_dir)
    return summary


if __name__ == "__main__":
    from hf_memffn.cli import interruption_exit, sigterm_raises_terminated

    try:
        with sigterm_raises_terminated():  # (a scheduler's SIGTERM, too, removes a half-saved final/ on its way out)
            main()
    except KeyboardInterrupt as stop:
        raise interruption_exit("examples/pretrain.py", stop, "; --resume latest continues from the newest "
                                "checkpoint") from None
