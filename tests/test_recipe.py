"""The pretraining recipe (examples/pretrain.py) on CPU: presets, packing, FLOP count, and a tiny
train -> evaluate -> save -> resume run."""

from __future__ import annotations

import json
import math
import os
import random
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import pretrain  # noqa: E402

WORDS = "the key reads a value from memory while each head stores one token of the layer".split()


def write_corpus(path: Path, documents: int = 120, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(documents):
            handle.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))}) + "\n")
    return path


@pytest.mark.parametrize("size", ["128M", "370M", "1.3B"])
def test_paper_presets_keep_every_architecture_at_the_baseline_size(size):
    from transformers import AutoModelForCausalLM

    counts = {}
    for arch in pretrain.ARCHITECTURE_NAMES:
        config = pretrain.build_config(arch, size, vocab_size=50432)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        counts[arch] = sum(p.numel() for p in model.parameters())
    for arch, count in counts.items():
        assert abs(count / counts["llama"] - 1) < 0.03, (size, counts)
    if size == "128M":
        assert 115e6 < counts["llama"] < 130e6


def test_recipe_names_the_registered_architectures():
    from hf_memffn.architectures import ARCHITECTURE_NAMES

    assert pretrain.ARCHITECTURE_NAMES == ARCHITECTURE_NAMES


def test_flash_mhf_presets_match_table_4_shapes():
    for name, layers, heads, subnetworks, subnetwork_size in (("128M", 10, 6, 8, 256), ("370M", 21, 8, 7, 384), ("1.3B", 20, 16, 15, 384)):
        config = pretrain.build_config("flash_mhf", name, vocab_size=50432)
        assert (config.num_hidden_layers, config.ffn_num_heads, config.ffn_num_subnetworks) == (layers, heads, subnetworks)
        assert config.ffn_head_dim == 128 and config.subnetwork_size == subnetwork_size


def test_every_flash_mhf_preset_runs_the_fused_kernels():
    """On a GPU the FlashMHF layer runs the fused kernels, which take a few head widths and fail loudly on others:
    every preset, `tiny` (the recipe's default) included, must be one of their shapes."""
    from hf_memffn.flash_mhf_op import SUPPORTED_HEAD_DIMS

    for name in pretrain.PRESETS:
        config = pretrain.build_config("flash_mhf", name, vocab_size=256)
        assert config.ffn_head_dim in SUPPORTED_HEAD_DIMS and config.subnetwork_size % 16 == 0, name


def test_flex_memoryllm_presets_split_the_ffn_with_beta_3():
    """memoryllm.md: FFN-C keeps beta * h^2 = 3 h^2 of the FFN's parameters, FFN-M the rest (5 h^2 at width 8h/3)."""
    for name in ("128M", "370M", "1.3B"):
        preset = pretrain.get_preset(name)
        config = pretrain.build_config("flex_memoryllm", name, vocab_size=50432)
        h = preset.hidden_size
        assert 3 * h * config.intermediate_size == 3 * h * h
        assert config.intermediate_size + config.memory_intermediate_size == preset.intermediate_size
    assert pretrain.build_config("flex_memoryllm", "128M", vocab_size=50432).memory_intermediate_size == 1280


def test_unknown_preset_and_file_type_are_refused(tmp_path):
    with pytest.raises(ValueError, match="preset='7B'"):
        pretrain.build_config("llama", "7B", vocab_size=100)
    with pytest.raises(ValueError, match="suffix '.xyz'"):
        pretrain._builder_for(str(tmp_path / "corpus.xyz"))


@pytest.mark.parametrize("arch", ["llama", "kvffn"])
def test_rope_overrides_reach_the_baseline_and_our_configs_alike(arch):
    """--config-overrides of `rope_parameters` were replaced by the preset's default RoPE for the Llama baseline
    (which kept training unscaled beside our scaled models), and a dict value was split at its own commas."""
    overrides = pretrain.parse_overrides('rope_parameters={"rope_type": "linear", "factor": 2.0},attention_dropout=0.1')
    assert overrides == {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "attention_dropout": 0.1}
    config = pretrain.build_config(arch, "tiny", vocab_size=256, **overrides)
    assert {key: config.rope_parameters[key] for key in ("rope_type", "factor", "rope_theta")} == {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    theta = pretrain.build_config(arch, "tiny", vocab_size=256, rope_parameters={"rope_theta": 5e5}).rope_parameters
    assert (theta["rope_type"], theta["rope_theta"]) == ("default", 5e5)


def test_packing_joins_documents_with_eos_into_full_blocks():
    import datasets

    from hf_memffn.tokenization import train_tokenizer

    tokenizer = train_tokenizer(WORDS * 3, vocab_size=300)
    docs = datasets.Dataset.from_dict({"text": ["the key reads", "a value from memory", "each head"]})
    blocks = pretrain.pack_into_blocks(docs, tokenizer, block_size=4, text_column="text")
    stream = []
    for text in docs["text"]:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    expected = [stream[i : i + 4] for i in range(0, len(stream) - len(stream) % 4, 4)]
    assert blocks["input_ids"] == expected


def test_packing_leaves_blank_documents_out():
    """An empty line of a .txt file (or an empty or blank text) is no document: each added a lone EOS, so blank
    lines between paragraphs put runs of EOS into the training and the held-out blocks."""
    import datasets

    from hf_memffn.tokenization import train_tokenizer

    tokenizer = train_tokenizer(WORDS * 3, vocab_size=300)
    texts = ["the key reads", "", "a value from memory", "  ", "\t", "each head"]
    blocks = pretrain.pack_into_blocks(datasets.Dataset.from_dict({"text": texts}), tokenizer, block_size=1,
                                       text_column="text")
    stream = []
    for text in ("the key reads", "a value from memory", "each head"):
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert [token for block in blocks["input_ids"] for token in block] == stream


def test_packing_gives_the_same_blocks_whatever_the_number_of_tokenizing_processes():
    """--num-proc split the documents into one shard per process before the stream was cut per batch of 1000
    documents, so the blocks (and their number) depended on it: these 2,500 documents gave 3,609 blocks in one process
    and 3,608 in two, 1,439 of them different. `datasets` leaves `num_proc` out of its cache key, so a run could also
    read the blocks that an earlier run with another --num-proc had cached."""
    import datasets

    from hf_memffn.tokenization import train_tokenizer

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for _ in range(2500)]
    tokenizer = train_tokenizer(WORDS * 3, vocab_size=300)
    docs = datasets.Dataset.from_dict({"text": texts})
    one = pretrain.pack_into_blocks(docs, tokenizer, block_size=32, text_column="text")
    two = pretrain.pack_into_blocks(docs, tokenizer, block_size=32, text_column="text", num_proc=2)
    assert two["input_ids"] == one["input_ids"]


def test_packing_runs_one_stream_through_every_batch_as_token_shards_do(tmp_path):
    """The stream was cut per batch of 1000 documents, each batch dropping its own tail: 2500 short documents gave
    12 blocks of 2048 tokens where their 28,890 tokens hold 14, and none at all in blocks longer than 1000 documents'
    tokens. Now only the stream's tail is dropped, and the blocks are those of token shards of the same documents."""
    import datasets
    import token_shards

    from hf_memffn.tokenization import train_tokenizer

    tokenizer = train_tokenizer(WORDS * 3, vocab_size=300)
    texts = [f"doc {i} the key" if i % 7 else "" for i in range(2500)]  # blank documents among them
    documents = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    tokens = sum(len(ids) + 1 for ids in documents if ids)
    token_shards.write_split(tmp_path, "train", documents, tokenizer.eos_token_id)
    dataset = datasets.Dataset.from_dict({"text": texts})
    for block_size in (64, 2048, tokens // 2):
        blocks = pretrain.pack_into_blocks(dataset, tokenizer, block_size, text_column="text")
        shard_blocks = token_shards.load_blocks(tmp_path, block_size)
        assert len(blocks) == tokens // block_size == len(shard_blocks)
        assert blocks["input_ids"] == [shard_blocks[i]["input_ids"].tolist() for i in range(len(shard_blocks))]


def test_documents_without_text_or_of_a_file_not_utf8_are_refused_naming_the_row_or_file(tmp_path):
    """A JSON line without the text field (or with a number there) failed in the tokenizer (`TypeError: 'NoneType'
    object is not iterable`), and a file not in UTF-8 with `DatasetGenerationError: An error occurred while generating
    the dataset` (.txt, .csv) or, read unchecked by the json builder, in the tokenizer; neither error named the file
    or the row."""
    import types

    def load(name, text_column="text"):
        return pretrain.load_raw_splits(types.SimpleNamespace(
            data_files=[str(tmp_path / name)], dataset=None, dataset_config=None, train_split="train",
            validation_split="validation", text_column=text_column))

    rows = [{"text": "the key reads"}, {"title": "no text"}, {"text": "a value"}, {"text": None}]
    (tmp_path / "missing.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(ValueError, match=r"--text-column='text' has no value in 2 of the 4 rows of the 'train' split "
                                         r"\(the first: row 1\)"):
        load("missing.jsonl")
    (tmp_path / "numbers.jsonl").write_text(json.dumps({"text": 3}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--text-column='text' holds Value\('int64'\) values .*, not text"):
        load("numbers.jsonl")
    for name, content in (("latin1.txt", "caf\xe9 au lait\n"), ("latin1.csv", "text\ncaf\xe9\n"),
                          ("latin1.jsonl", json.dumps({"text": "caf\xe9"}, ensure_ascii=False) + "\n")):
        (tmp_path / name).write_bytes(content.encode("latin-1"))
        with pytest.raises(ValueError, match=rf"--data-files: '.*{name}' is not UTF-8 text .*; convert it to UTF-8"):
            load(name)


def test_text_files_of_windows_editors_read_without_byte_order_mark_or_carriage_returns(tmp_path):
    """A .txt file saved with a UTF-8 byte-order mark gave its first document a leading U+FEFF (tokens of their
    own, in front of the text); the .jsonl and .csv builders already left it out."""
    import types

    (tmp_path / "notes.txt").write_bytes("\ufeff日本語 😀 e\u0301\r\nsecond line\r\n".encode("utf-8"))
    train, _ = pretrain.load_raw_splits(types.SimpleNamespace(
        data_files=[str(tmp_path / "notes.txt")], dataset=None, dataset_config=None, train_split="train",
        validation_split="validation", text_column="text"))
    assert train["text"] == ["日本語 😀 e\u0301", "second line"]
    # a validation split named on purpose but missing was left out without a word (the default's is optional)
    with pytest.raises(ValueError, match=r"--validation-split='heldout' is not one of the dataset's splits "
                                         r"\['train'\]"):
        pretrain.load_raw_splits(types.SimpleNamespace(
            data_files=[str(tmp_path / "notes.txt")], dataset=None, dataset_config=None, train_split="train",
            validation_split="heldout", text_column="text"))


def test_a_json_line_that_is_no_json_object_is_refused_naming_the_file_and_line(tmp_path):
    """A line of a .jsonl cut short (or not JSON, or JSON but no object) failed with `DatasetGenerationError: An
    error occurred while generating the dataset`, naming neither the file nor the line."""
    import types

    def load(*names):
        return pretrain.load_raw_splits(types.SimpleNamespace(
            data_files=[str(tmp_path / name) for name in names], dataset=None, dataset_config=None,
            train_split="train", validation_split="validation", text_column="text"))

    rows = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(30))
    (tmp_path / "good.jsonl").write_text(rows, encoding="utf-8-sig")  # (a byte-order mark, which the builder reads)
    (tmp_path / "array.json").write_text('[{"text": "a"},\n {"text": "b"}]\n', encoding="utf-8")
    for name, content, place in (("cut.jsonl", rows + '{"text": "half a li', r"line 31, is not JSON"),
                                 ("list.jsonl", rows + "\n[1, 2]\n" + rows, r"line 32, holds a JSON list, not an "
                                                                           r"object"),
                                 ("broken.json", '[{"text": "a"},\n {"text": }]\n', r"line 2, is not JSON")):
        (tmp_path / name).write_text(content, encoding="utf-8")
        with pytest.raises(ValueError, match=rf"--data-files: '.*{name}', {place}"):
            load("good.jsonl", "array.json", name)
    assert len(load("good.jsonl", "array.json")[0]) == 32


def test_files_of_other_columns_than_the_first_are_refused_naming_both(tmp_path):
    """A file whose text has another name than the first file's failed with "An error occurred while generating the
    dataset" (its cause naming the columns, but no file), for JSON lines and CSV alike."""
    import types

    def load(*names):
        return pretrain.load_raw_splits(types.SimpleNamespace(
            data_files=[str(tmp_path / name) for name in names], dataset=None, dataset_config=None,
            train_split="train", validation_split="validation", text_column="text"))

    (tmp_path / "a.jsonl").write_text('{"text": "the key", "id": 1}\n', encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"id": 2, "text": "a value"}\n', encoding="utf-8")  # the same columns
    (tmp_path / "c.jsonl").write_text('{"content": "each head", "id": 3}\n', encoding="utf-8")
    (tmp_path / "a.csv").write_text("text,id\nthe key,1\n", encoding="utf-8")
    (tmp_path / "c.csv").write_text("body,id\neach head,3\n", encoding="utf-8")
    assert len(load("a.jsonl", "b.jsonl")[0]) == 2
    for names, other in ((("a.jsonl", "b.jsonl", "c.jsonl"), r"'.*c.jsonl' has the columns \['content', 'id'\], "
                                                                r"'.*a.jsonl' \['id', 'text'\]"),
                         (("a.csv", "c.csv"), r"'.*c.csv' has the columns \['body', 'id'\], "
                                              r"'.*a.csv' \['id', 'text'\]")):
        with pytest.raises(ValueError, match=rf"--data-files: {other}: one dataset reads files of the same columns"):
            load(*names)


def test_a_parquet_file_that_is_no_parquet_is_refused_naming_it_not_another_as_not_utf8(tmp_path):
    """A parquet file cut short failed in pyarrow ("Parquet magic bytes not found"), which the recipe took for text
    that is not UTF-8: it named the first parquet file, a whole one, as "not UTF-8 text; convert it to UTF-8"."""
    import types

    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table({"text": [f"document {i}" for i in range(50)]}), tmp_path / "a.parquet")
    whole = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"--data-files: '.*cut.parquet' is not a parquet file \(.*magic bytes"):
        pretrain.load_raw_splits(types.SimpleNamespace(
            data_files=[str(tmp_path / "a.parquet"), str(tmp_path / "cut.parquet")], dataset=None,
            dataset_config=None, train_split="train", validation_split="validation", text_column="text"))


def test_a_run_resumed_from_a_checkpoint_off_the_logging_grid_logs_each_step_once(tmp_path):
    """A session stopped (--stop-after-steps 5) after its last checkpoint (3, off the --logging-steps 2 grid) had
    logged step 4 and its own end; resumed, the run logged step 4 again after them. The resumed run's log is now the
    uninterrupted run's: each record once, the same training losses (a checkpoint ends a loss window), and its last
    record's `train_loss` the run's mean (it was the mean of the resumed session's steps)."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")

    def common(out):
        return ["--arch", "llama", "--preset", "tiny", "--data-files", str(corpus), "--train-tokenizer", "300",
                "--block-size", "32", "--per-device-batch-size", "4", "--logging-steps", "2", "--eval-steps", "100",
                "--save-steps", "3", "--max-eval-blocks", "2", "--max-steps", "8", "--output-dir", str(out)]

    def log_of(out):
        return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]

    whole = pretrain.main(common(tmp_path / "whole"))
    pretrain.main(common(tmp_path / "cut") + ["--stop-after-steps", "5"])
    assert max(r["step"] for r in log_of(tmp_path / "cut") if "loss" in r) == 4  # after checkpoint-3, the latest
    resumed = pretrain.main(common(tmp_path / "cut") + ["--resume", "latest"])
    whole_log, resumed_log = log_of(tmp_path / "whole"), log_of(tmp_path / "cut")
    assert [(r["step"], sorted(r)) for r in resumed_log] == [(r["step"], sorted(r)) for r in whole_log]
    assert [r["step"] for r in resumed_log if "loss" in r] == [2, 3, 4, 6, 8]
    for whole_record, resumed_record in zip(whole_log, resumed_log):
        if "loss" in whole_record:
            assert resumed_record["loss"] == pytest.approx(whole_record["loss"], rel=1e-4)
    assert resumed["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-4)
    # the log's last record (the Trainer's end of training) holds the run's mean too, not the resumed session's
    assert resumed_log[-1]["train_loss"] == pytest.approx(whole_log[-1]["train_loss"], rel=1e-4)


def out_of_memory_at_a_batch_of_8(monkeypatch, nth: int) -> list[int]:
    """The recipe's batches collated from now on run out of memory at the `nth` batch of 8 blocks (as a GPU would, for
    --auto-find-batch-size to retry smaller); returns the list the batches' sizes are appended to."""
    collate_blocks, batches = pretrain.collate_blocks, []

    def collate(features):
        batches.append(len(features))
        if len(features) == 8 and batches.count(8) == nth:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return collate_blocks(features)

    monkeypatch.setattr(pretrain, "collate_blocks", collate)
    return batches


def test_auto_find_batch_size_counts_the_tokens_of_the_batch_that_trained(tmp_path, monkeypatch):
    """--auto-find-batch-size: out of memory at the third batch of 8 blocks, the Trainer starts over with smaller
    ones. The summary's tokens per step (which compare_loss_curves.py matches runs by) and the rates are those of the
    smaller batches (they counted 8 blocks), and the log holds the run that trained, each step once (it kept the
    first attempt's steps too)."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    batches = out_of_memory_at_a_batch_of_8(monkeypatch, 3)
    out = tmp_path / "run"
    summary = pretrain.main([
        "--arch", "llama", "--preset", "tiny", "--data-files", str(corpus), "--train-tokenizer", "300",
        "--block-size", "32", "--per-device-batch-size", "8", "--auto-find-batch-size", "--logging-steps", "1",
        "--eval-steps", "100", "--save-steps", "100", "--max-eval-blocks", "1", "--max-steps", "3",
        "--output-dir", str(out)])
    retried = batches[3]  # (accelerate takes 90% of the batch that ran out of memory)
    assert retried < 8 and summary["tokens_per_step"] == retried * 32
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]


def test_a_checkpoint_records_the_batch_that_auto_find_batch_size_trained(tmp_path, monkeypatch):
    """recipe_batches.json recorded the arguments' batch of 8 after --auto-find-batch-size had trained with a smaller
    one: a resume without that option trained the steps left on batches of 8 (the Trainer takes back the batch found
    only with it), unrefused. The record holds the batch that trained; a resume with the option (as the Trainer
    does) takes it back and passes, one without is refused before the data is read, naming both ways."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    batches = out_of_memory_at_a_batch_of_8(monkeypatch, 1)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--preset", "tiny", "--data-files", str(corpus), "--train-tokenizer", "300",
              "--block-size", "32", "--per-device-batch-size", "8", "--eval-steps", "100", "--save-steps", "2",
              "--max-eval-blocks", "1", "--output-dir", str(out)]
    pretrain.main(common + ["--auto-find-batch-size", "--max-steps", "2"])
    retried = batches[1]
    assert retried < 8
    record = json.loads((out / "checkpoint-2" / pretrain.BATCH_SETTINGS_FILE).read_text(encoding="utf-8"))
    assert record["per_device_train_batch_size"] == retried and record["auto_find_batch_size"]

    load_data = pretrain.load_data
    forbid_reading_data(monkeypatch)
    with pytest.raises(ValueError, match=rf"trained on {retried} blocks per step \(--per-device-train-batch-size "
                                         rf"{retried} x .*these arguments give 8 .*resume with {retried} blocks per "
                                         r"step, or with --auto-find-batch-size, with which the Trainer takes back"):
        pretrain.main(common + ["--max-steps", "3", "--resume", "latest"])
    monkeypatch.setattr(pretrain, "load_data", load_data)
    batches.clear()
    resumed = pretrain.main(common + ["--auto-find-batch-size", "--max-steps", "3", "--resume", "latest"])
    assert resumed["global_step"] == 3 and resumed["tokens_per_step"] == retried * 32
    assert batches[0] == retried  # (the step left trained on the batch found)


def test_held_out_documents_are_split_off_before_the_tokenizer_is_trained(tmp_path, monkeypatch):
    """Without a validation split the last documents are held out whole, and `--train-tokenizer` learns its
    vocabulary from the others only: a word found only in held-out text is not one of its tokens."""
    import types

    import datasets
    from transformers import TrainingArguments

    # (the last documents differ from one another: one that a training document repeats is not held out)
    documents = [f"the key reads value {i % 7} of the memory" for i in range(400)] + [f"zyxquvol {i} " * 10
                                                                                       for i in range(20)]
    raw = datasets.Dataset.from_dict({"text": documents})
    monkeypatch.setattr(pretrain, "load_raw_splits", lambda args: (raw, None))
    args = types.SimpleNamespace(train_tokenizer=300, output_dir=str(tmp_path), text_column="text", block_size=64,
                                 num_proc=None, validation_fraction=0.048, resume=None)  # 20 of 420
    train_blocks, eval_blocks, tokenizer = pretrain.load_and_pack(args, TrainingArguments(output_dir=str(tmp_path),
                                                                                           report_to="none"))
    held_out_word = tokenizer(" zyxquvol", add_special_tokens=False)["input_ids"]
    assert len(held_out_word) > 1  # not a learned token: the tokenizer never saw it
    eval_text = tokenizer.decode([t for block in eval_blocks["input_ids"] for t in block])
    train_text = tokenizer.decode([t for block in train_blocks["input_ids"] for t in block])
    assert "zyxquvol" in eval_text and "zyxquvol" not in train_text and "memory" not in eval_text
    # a held-out fraction too small for one block holds out enough documents for one
    args.validation_fraction = 0.0001
    _, eval_blocks, _ = pretrain.load_and_pack(args, TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    assert len(eval_blocks) >= 1


def test_held_out_documents_that_the_training_text_repeats_are_left_out(tmp_path, monkeypatch, capsys):
    """A corpus that repeats a document (a .txt file's repeated lines, a document copied into two files) held out its
    last copy and trained on the others: the held-out loss measured text trained on. Only the held-out documents
    that are no training document are evaluated."""
    import types

    import datasets
    from transformers import TrainingArguments

    trained = [f"the key reads value {i} of the memory" for i in range(400)]
    tail = [text for i in range(10) for text in ("zyxquvol " * 20, trained[i * 37])] + ["zyxquvol " * 20] * 10
    raw = datasets.Dataset.from_dict({"text": trained + tail})
    monkeypatch.setattr(pretrain, "load_raw_splits", lambda args: (raw, None))
    args = types.SimpleNamespace(train_tokenizer=300, output_dir=str(tmp_path), text_column="text", block_size=64,
                                 num_proc=None, validation_fraction=0.07, resume=None)  # the 30 of the tail
    train_blocks, eval_blocks, tokenizer = pretrain.load_and_pack(args, TrainingArguments(output_dir=str(tmp_path),
                                                                                           report_to="none"))
    eval_text = tokenizer.decode([t for block in eval_blocks["input_ids"] for t in block])
    assert "zyxquvol" in eval_text and "memory" not in eval_text
    assert "held out 20 documents: 10 of the last 30 left out, their text being a training document too" in (
        capsys.readouterr().out)


def test_a_training_text_too_short_for_a_held_out_block_is_refused_naming_the_block_size(tmp_path, monkeypatch):
    """Three short documents and no validation split: the documents of one held-out block took them all, and the
    error blamed --validation-fraction ("=0.01 holds out 3 of the 3 documents"), which no value of it mended."""
    import types

    import datasets
    from transformers import TrainingArguments

    raw = datasets.Dataset.from_dict({"text": ["the key reads", "a value from", "the memory of each head"]})
    monkeypatch.setattr(pretrain, "load_raw_splits", lambda args: (raw, None))
    args = types.SimpleNamespace(train_tokenizer=300, output_dir=str(tmp_path), text_column="text", block_size=32,
                                 num_proc=None, validation_fraction=0.01, resume=None)
    with pytest.raises(ValueError, match=r"the 3 documents of the training text are too few to hold out one "
                                         r"--block-size=32 block of them and train on the rest; give more text"):
        pretrain.load_and_pack(args, TrainingArguments(output_dir=str(tmp_path), report_to="none"))


def test_flops_per_token_counts_matmul_weights_and_attention():
    from transformers import AutoModelForCausalLM

    config = pretrain.build_config("llama", "tiny", vocab_size=256)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # tied: the embedding is the output head's matmul
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 64
    assert pretrain.training_flops_per_token(model, 64) == 6 * params + attention


def test_train_evaluate_save_and_resume(tmp_path):
    from transformers import AutoModelForCausalLM

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "run"
    common = [
        "--arch", "flash_mhf", "--preset", "tiny", "--data-files", str(corpus), "--train-tokenizer", "300",
        "--block-size", "32", "--per-device-batch-size", "4", "--logging-steps", "2", "--eval-steps", "2",
        "--save-steps", "2", "--max-eval-blocks", "4", "--peak-tflops", "0.001", "--output-dir", str(out),
    ]
    first = pretrain.main(common + ["--max-steps", "4"])
    assert first["global_step"] == 4 and math.isfinite(first["eval_loss"])
    assert first["eval_loss"] < math.log(300) + 1
    assert first["tokens_per_second"] > 0 and 0 < first["mfu"]
    final = out / "final"
    for name in ("config.json", "model.safetensors", "README.md", "modeling_memffn.py", "tokenizer.json"):
        assert (final / name).is_file(), name
    assert (out / "checkpoint-4").is_dir()
    log = out / "train_log.jsonl"
    # --eval-steps divides the last step: the final evaluation is the one logged there, not run a second time
    assert [r["step"] for r in map(json.loads, log.read_text().splitlines()) if "eval_loss" in r] == [2, 4]

    with pytest.raises(ValueError, match=r"--output-dir=.* holds a run \(checkpoint-2, checkpoint-4, final, "
                                         r"summary.json\): pass --resume latest"):
        pretrain.main(common + ["--max-steps", "4"])  # a fresh run would append to this run's log
    second = pretrain.main(common + ["--max-steps", "6", "--resume", "latest"])
    assert second["global_step"] == 6
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # training went on from step 4, not from scratch, and the log holds each step once (the first session's end
    # record, logged after its last checkpoint, is not the run's)
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6]
    assert [r["step"] for r in records if "train_runtime" in r] == [6]
    # the run's mean training loss, not the mean of the steps since the resume (the Trainer's)
    windows = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert second["train_loss"] == pytest.approx(sum(2 * windows[step] for step in (2, 4, 6)) / 6)

    # Stopped after its last checkpoint, before the final evaluation: resuming trains no step beyond --max-steps.
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    third = pretrain.main(common + ["--max-steps", "6", "--resume", "latest"])
    assert third["global_step"] == 6 and third["eval_loss"] == pytest.approx(second["eval_loss"])
    assert third["train_loss"] == pytest.approx(second["train_loss"])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 6]
    model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True)
    assert type(model).__name__ == "FlashMHFLlamaForCausalLM"

    # Fine-tuning from the saved model: the summary names the saved model's type and folder.
    tuned = pretrain.main([
        "--init-from", str(final), "--data-files", str(corpus), "--block-size", "32", "--per-device-batch-size", "4",
        "--max-steps", "4", "--logging-steps", "1", "--eval-steps", "4", "--save-steps", "100",
        "--max-eval-blocks", "4", "--peak-tflops", "0.001", "--output-dir", str(tmp_path / "tuned"),
        "--profile-steps", "2:2",
    ])
    assert tuned["init_from"] == str(final) and tuned["model_type"] == model.config.model_type
    assert tuned["global_step"] == 4 and math.isfinite(tuned["eval_loss"])
    # steps 2 (profiled) and 3 (writes the profile) are not timed, step 1 never is: the rate is step 4's
    rated = [r["step"] for r in map(json.loads, (tmp_path / "tuned" / "train_log.jsonl").read_text().splitlines())
             if "tokens_per_second" in r]
    assert rated == [4] and tuned["tokens_per_second"] > 0
    profile = json.loads((tmp_path / "tuned" / "profile_steps.json").read_text())
    assert profile["steps"] == 1 and profile["wall_ms_per_step"] > 0 and profile["host_operators"]
    assert "ms wall per step" in (tmp_path / "tuned" / "profile_steps.txt").read_text()
    with pytest.raises(ValueError, match="--profile-steps='3:1'"):
        pretrain.parse_profile_steps("3:1")


def test_load_best_model_at_end_saves_and_evaluates_the_best_checkpoint(tmp_path):
    """`--load-best-model-at-end` with a best checkpoint before the last step: final/ holds that checkpoint's weights,
    and the summary's eval loss is theirs (it was the last step's evaluation, of weights that final/ does not hold).
    A run stopped after its last checkpoint and resumed at --max-steps loads the best checkpoint too."""
    from safetensors.torch import load_file

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "run"
    # the highest held-out loss is the best: the first evaluation's, as the loss falls from the start
    common = ["--arch", "kvffn", "--preset", "tiny", "--data-files", str(corpus), "--train-tokenizer", "300",
              "--block-size", "32", "--per-device-batch-size", "4", "--logging-steps", "2", "--eval-steps", "2",
              "--save-steps", "2", "--max-eval-blocks", "4", "--max-steps", "6", "--load-best-model-at-end",
              "--metric-for-best-model", "loss", "--greater-is-better", "true", "--output-dir", str(out)]

    def eval_losses():
        records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        return [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]

    def assert_final_is_checkpoint_2():
        final = load_file(out / "final" / "model.safetensors")
        best = load_file(out / "checkpoint-2" / "model.safetensors")
        assert final.keys() == best.keys()
        for name in final:
            torch.testing.assert_close(final[name], best[name], rtol=0, atol=0, msg=name)

    first = pretrain.main(common)
    losses = eval_losses()  # the three in training, then the final evaluation's, of the best checkpoint
    assert [step for step, _ in losses] == [2, 4, 6, 6] and losses[0][1] > losses[2][1]
    assert_final_is_checkpoint_2()
    assert first["eval_loss"] == losses[3][1] == pytest.approx(losses[0][1], rel=1e-5)

    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    resumed = pretrain.main(common + ["--resume", "latest"])  # checkpoint-6 is at --max-steps: nothing to train
    assert_final_is_checkpoint_2()
    assert resumed["eval_loss"] == pytest.approx(losses[0][1], rel=1e-5)


@pytest.mark.parametrize("arch", pretrain.ARCHITECTURE_NAMES)
def test_fsdp2_config_wraps_every_decoder_layer(arch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from transformers import AutoModelForCausalLM

    fsdp = load_config_from_file(str(EXAMPLES / "accelerate" / "fsdp2.yaml")).fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    model = AutoModelForCausalLM.from_config(pretrain.build_config(arch, "tiny", vocab_size=256))
    pretrain.keep_present_wrap_units(model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [module for module in model.modules() if policy(module)]
    layers = list(model.model.layers)
    assert all(any(layer is module for module in wrapped) for layer in layers)
    memory = getattr(model.model, "memory", None)
    assert len(wrapped) == len(layers) + (memory is not None)


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    kinds = {name: load_config_from_file(str(EXAMPLES / "accelerate" / f"{name}.yaml")).distributed_type for name in
             ("ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3")}
    assert [str(kind).split(".")[-1] for kind in kinds.values()] == ["MULTI_GPU", "FSDP", "DEEPSPEED", "DEEPSPEED"]
    for stage in (2, 3):
        config = load_config_from_file(str(EXAMPLES / "accelerate" / f"deepspeed_zero{stage}.yaml")).deepspeed_config
        ds = json.loads((EXAMPLES.parent / config["deepspeed_config_file"]).read_text())
        assert ds["zero_optimization"]["stage"] == stage


LOAD_SCRIPT = """
import sys
sys.path.insert(0, {examples!r})
from pretrain import from_pretrained_main_process_first
model = from_pretrained_main_process_first({folder!r})
assert "hf_memffn" not in sys.modules, "fine-tuning must run the checkpoint's own code"
# one write per line: the two ranks share the pipe, and print() writes its parts separately
sys.stdout.write(f"loaded {{type(model).__module__.split('.')[0]}} {{type(model).__name__}}\\n")
sys.stdout.flush()
"""


def test_two_processes_load_remote_code_main_process_first(tmp_path):
    """Two processes start together on a fresh module cache: both load the checkpoint's own (remote) code."""
    import os
    import subprocess

    from transformers import AutoModelForCausalLM

    from hf_memffn.testing import tiny_config, torchrun_command

    folder = tmp_path / "checkpoint"
    AutoModelForCausalLM.from_config(tiny_config("kvffn")).save_pretrained(folder)
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT.format(examples=str(EXAMPLES), folder=str(folder)))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # two gloo processes on the CPU, on a one-GPU machine too
    done = subprocess.run(torchrun_command(2, script), env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert done.stdout.count("loaded transformers_modules KVFFNForCausalLM") == 2, done.stdout


TOKENIZER_SCRIPT = """
import sys
from types import SimpleNamespace
sys.path.insert(0, {examples!r})
from pretrain import load_tokenizer
args = SimpleNamespace(train_tokenizer=None, tokenizer=None, init_from={folder!r})
tokenizer = load_tokenizer(args, None, SimpleNamespace(world_size=1, process_index=0))
assert "hf_memffn" not in sys.modules, "fine-tuning must run the checkpoint's own code"
print("tokenizer of", len(tokenizer), "tokens")
"""


def test_fine_tuning_loads_the_checkpoints_tokenizer_without_asking_to_trust_its_code(tmp_path):
    """--init-from DIR takes DIR's tokenizer in a process that does not import `hf_memffn`: AutoTokenizer meets a
    model type it does not know in DIR/config.json and, without `trust_remote_code` (which loads the model), asked
    `[y/N]` and waited 15 s on a terminal."""
    import subprocess

    from transformers import AutoModelForCausalLM

    from hf_memffn.testing import tiny_config, tiny_tokenizer

    folder = tmp_path / "checkpoint"
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn"))
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(folder)
    script = tmp_path / "tokenizer.py"
    script.write_text(TOKENIZER_SCRIPT.format(examples=str(EXAMPLES), folder=str(folder)))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "tokenizer of 301 tokens" in done.stdout
    assert "trust_remote_code" not in done.stdout + done.stderr


def test_a_dataset_folder_gives_its_validation_file_as_the_held_out_split(tmp_path):
    """README: every --data-files file is training text; a folder of train.jsonl and validation.jsonl given as
    --dataset FOLDER evaluates on the validation file."""
    (tmp_path / "data").mkdir()
    write_corpus(tmp_path / "data" / "train.jsonl", documents=20, seed=1)
    write_corpus(tmp_path / "data" / "validation.jsonl", documents=5, seed=2)
    args = pretrain.SimpleNamespace(data_files=None, dataset=str(tmp_path / "data"), dataset_config=None,
                                    train_split="train", validation_split="validation", text_column="text")
    train, validation = pretrain.load_raw_splits(args)
    assert (len(train), len(validation)) == (20, 5)


def test_a_dataset_folder_of_text_files_is_read_without_byte_order_marks(tmp_path):
    """The .txt files of a --dataset FOLDER kept a leading U+FEFF in each file's first document, which the same files
    given as --data-files leave out; a folder of JSON lines reads as before."""
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "train.txt").write_bytes("\ufeffcafe\u0301 one\r\nsecond line\n".encode("utf-8"))
    (tmp_path / "text" / "validation.txt").write_bytes("\ufeffheld out \U0001f642\n".encode("utf-8"))
    (tmp_path / "json").mkdir()
    write_corpus(tmp_path / "json" / "train.jsonl", documents=3)
    splits = {}
    for folder in ("text", "json"):
        args = pretrain.SimpleNamespace(data_files=None, dataset=str(tmp_path / folder), dataset_config=None,
                                        train_split="train", validation_split="validation", text_column="text")
        splits[folder] = pretrain.load_raw_splits(args)
    assert splits["text"][0]["text"] == ["cafe\u0301 one", "second line"]
    assert splits["text"][1]["text"] == ["held out \U0001f642"]
    assert len(splits["json"][0]) == 3 and splits["json"][1] is None


def test_only_the_main_process_tells_which_checkpoints_resume_latest_passes_over(tmp_path, capsys):
    """Every process resolves `--resume latest`; the message naming the checkpoints left half saved came once per
    process (the Trainer's messages come from the main process only). The others find the same checkpoint silently."""
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}", encoding="utf-8")
    (tmp_path / "checkpoint-4").mkdir()
    args = pretrain.SimpleNamespace(resume="latest")
    assert pretrain.resume_checkpoint(args, tmp_path, is_main_process=False) == str(tmp_path / "checkpoint-2")
    assert capsys.readouterr().out == ""
    assert pretrain.resume_checkpoint(args, tmp_path) == str(tmp_path / "checkpoint-2")
    assert "checkpoint-4 (no readable trainer_state.json); resuming from checkpoint-2" in capsys.readouterr().out


UNSHARED_TOKENIZER_SCRIPT = """
import sys
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, {examples!r})
import torch.distributed as dist
from datasets import Dataset
from pretrain import load_tokenizer

dist.init_process_group("gloo")  # (the process group, as TrainingArguments makes it on the CPU)
rank = dist.get_rank()
args = SimpleNamespace(train_tokenizer=300, tokenizer=None, init_from=None, resume=None, text_column="text",
                       output_dir=str(Path({out!r}) / f"node{{rank}}"))  # (each process a node of its own)
texts = Dataset.from_dict({{"text": [line.strip() for line in open({corpus!r})]}})
tokenizer = load_tokenizer(args, texts, SimpleNamespace(world_size=2, process_index=rank, local_process_index=0))
# (a file per process: the processes' prints can interleave on the launcher's stdout)
ids = tokenizer("alpha beta")["input_ids"]
Path({out!r}, f"rank{{rank}}.txt").write_text(f"{{len(tokenizer)}} tokens, ids {{ids}}")
"""


def test_every_node_gets_the_trained_tokenizer_without_a_shared_output_dir(tmp_path):
    """--train-tokenizer: the main process trains and saves the tokenizer to --output-dir, where the other processes
    read it. The nodes of a multi-node run may not share that folder (--save-on-each-node): the other nodes found no
    tokenizer there and stopped. They are now sent the main process's files."""
    import subprocess

    from hf_memffn.testing import torchrun_command

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(random.Random(n).choices(WORDS, k=20)) for n in range(40)), "utf-8")
    script = tmp_path / "tokenizer.py"
    script.write_text(UNSHARED_TOKENIZER_SCRIPT.format(examples=str(EXAMPLES), out=str(tmp_path / "out"),
                                                       corpus=str(corpus)))
    (tmp_path / "out").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(torchrun_command(2, script), env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    main, other = ((tmp_path / "out" / f"rank{rank}.txt").read_text() for rank in (0, 1))
    assert other == main and main.startswith("300 tokens"), (main, other)


SLOW_PACKING_SCRIPT = """
import datetime, os, sys, time
import torch.distributed.distributed_c10d as c10d
sys.path.insert(0, {examples!r})
import pretrain

# the collectives' timeout made short: 30 minutes on the CPU (--ddp-timeout, default 30 minutes, on GPUs)
c10d.default_pg_timeout = datetime.timedelta(seconds=6)
pack_into_blocks = pretrain.pack_into_blocks
slept = []


def slow_pack_into_blocks(*args, **kwargs):  # the main process packs for longer than that (a large corpus)
    if os.environ["RANK"] == "0" and not slept:
        time.sleep(10)
        slept.append(True)
    return pack_into_blocks(*args, **kwargs)


pretrain.pack_into_blocks = slow_pack_into_blocks
pretrain.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_two_processes_wait_for_the_main_process_to_pack_however_long_it_takes(tmp_path):
    """The other processes waited for the main one to read, tokenize and pack the data at a barrier of the process
    group, which gives up after the collectives' timeout (30 minutes on the CPU, whatever --ddp-timeout says;
    --ddp-timeout on GPUs): a corpus that took longer to pack (hours, for the README's Hub dataset) stopped the run
    there. They wait at a barrier of a group of their own, whose timeout is hours."""
    import subprocess

    from hf_memffn.testing import torchrun_command

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    script = tmp_path / "slow_packing.py"
    script.write_text(SLOW_PACKING_SCRIPT.format(examples=str(EXAMPLES)))
    package_root = os.path.dirname(os.path.dirname(pretrain.__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "run"
    done = subprocess.run(torchrun_command(2, script, "--arch", "kvffn", "--data-files", corpus, "--train-tokenizer",
                                           "300", "--block-size", "32", "--per-device-batch-size", "2",
                                           "--max-steps", "2", "--save-steps", "2", "--eval-steps", "2",
                                           "--max-eval-blocks", "2", "--output-dir", out),
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("arch, overrides", [("llama", "initializer_range=0.05"),
                                             ("flash_mhf", "ffn_kernel=torch,initializer_range=0.05")])
def test_initial_weights_for_a_multi_gpu_comparison_load_and_train(tmp_path, arch, overrides):
    """examples/save_initial_weights.py (the starting point of examples/ddp_check.sh) for our models and Llama; its
    --config-overrides were ignored for every architecture but FlashMHFLlama."""
    import save_initial_weights

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    with corpus.open("a", encoding="utf-8") as handle:  # (a blank line, as an editor leaves at the end: no document)
        handle.write("\n")
    init = save_initial_weights.main([str(corpus), str(tmp_path / "init"), "--arch", arch, "--preset", "tiny",
                                      "--config-overrides", overrides, "--vocab-size", "300"])
    assert (init / "tokenizer.json").is_file() and (init / "config.json").is_file()
    assert json.loads((init / "config.json").read_text())["initializer_range"] == 0.05
    summary = pretrain.main([
        "--init-from", str(init), "--arch", arch, "--preset", "tiny", "--data-files", str(corpus), "--block-size", "32",
        "--per-device-batch-size", "4", "--max-steps", "2", "--logging-steps", "1", "--eval-steps", "2",
        "--save-steps", "100", "--max-eval-blocks", "4", "--output-dir", str(tmp_path / "run"),
    ])
    expected_type = "llama" if arch == "llama" else "memffn_flash_mhf"
    assert summary["model_type"] == expected_type and summary["global_step"] == 2


@pytest.mark.parametrize("arch", ["llama", "memoryllm", "flex_memoryllm", "kvffn"])
def test_initial_weights_refuse_an_override_their_config_does_not_have(tmp_path, arch):
    """ffn_kernel is FlashMHFLlama's: given for another architecture it was ignored; it is refused before any work."""
    import save_initial_weights

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    with pytest.raises(ValueError, match=r"--config-overrides: 'ffn_kernel' not a field of \w+Config; its fields:"):
        save_initial_weights.main([str(corpus), str(tmp_path / "init"), "--arch", arch, "--preset", "tiny",
                                   "--config-overrides", "ffn_kernel=torch", "--vocab-size", "300"])
    assert not (tmp_path / "init").exists()


def test_initial_weights_take_a_vocab_size_of_the_config_overrides(tmp_path):
    """--config-overrides vocab_size=... failed in a `TypeError` ("build_config() got multiple values for argument
    'vocab_size'"), as in pretrain.py: it sets the model's vocabulary there too (the tokenizer's is --vocab-size), and
    one smaller than the tokenizer is refused, as there."""
    import save_initial_weights

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    init = save_initial_weights.main([str(corpus), str(tmp_path / "init"), "--arch", "kvffn", "--preset", "tiny",
                                      "--config-overrides", "vocab_size=384", "--vocab-size", "300"])
    assert json.loads((init / "config.json").read_text())["vocab_size"] == 384
    with pytest.raises(ValueError, match=r"the tokenizer has 300 tokens, more than the model's embedding has rows "
                                         r"\(256\)"):  # (Llama's save took it: ids past 255 failed every forward)
        save_initial_weights.main([str(corpus), str(tmp_path / "small"), "--arch", "llama", "--preset", "tiny",
                                   "--config-overrides", "vocab_size=256", "--vocab-size", "300"])
    assert not (tmp_path / "small").exists()


@pytest.mark.parametrize("line, extra, message", [
    ('{"body": "the key"}', [], r"CORPUS='.*corpus.jsonl': line 121 holds no 'text' string \(found None\); give "
                                r"JSON lines with a 'text' field"),
    ("the key reads a value", [], r"CORPUS='.*corpus.jsonl': line 121 is not JSON \(Expecting value"),
    ('{"text": 3}', [], r"CORPUS='.*corpus.jsonl': line 121 holds no 'text' string \(found 3\)"),
    ('{"text": "the key"}', ["--vocab-size", "100"], r"--vocab-size=100: expected a vocabulary of 259 tokens or more"),
])
def test_initial_weights_refuse_a_corpus_line_without_text_naming_it(tmp_path, line, extra, message):
    """A corpus line without a 'text' field failed with a bare `KeyError: 'text'`, one of plain text with a
    `JSONDecodeError` naming no file, and a --vocab-size below the byte alphabet after the corpus was read, naming
    `vocab_size`."""
    import save_initial_weights

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    with corpus.open("a", encoding="utf-8") as handle:
        handle.write(line + "\n")
    with pytest.raises(ValueError, match=message):
        save_initial_weights.main([str(corpus), str(tmp_path / "init"), "--arch", "llama", "--preset", "tiny",
                                   "--vocab-size", "300", *extra])
    assert not (tmp_path / "init").exists()


def test_initial_weights_appear_whole_or_not_at_all(tmp_path, monkeypatch):
    """save_initial_weights.py wrote into OUT_DIR in place: interrupted after the model, it left a folder without a
    tokenizer, which `pretrain.py --init-from` then failed on. An existing OUT_DIR is refused before any work."""
    import save_initial_weights
    from transformers import PreTrainedModel

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    saved = PreTrainedModel.save_pretrained

    def interrupted(self, *args, **kwargs):
        saved(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", interrupted)
    argv = [str(corpus), str(tmp_path / "init"), "--arch", "llama", "--preset", "tiny", "--vocab-size", "300"]
    with pytest.raises(KeyboardInterrupt):
        save_initial_weights.main(argv)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.jsonl"]
    (tmp_path / "init").mkdir()
    with pytest.raises(ValueError, match=r"OUT_DIR='.*init' exists: remove it or name a new folder"):
        save_initial_weights.main(argv)


def test_a_run_stopped_by_ctrl_c_while_saving_says_so_in_one_line_and_leaves_no_half_saved_final(tmp_path,
                                                                                                  monkeypatch, capsys):
    """Ctrl-C ended `python examples/pretrain.py` in a traceback with status 1. It now names the interruption and
    `--resume latest` in one line, with status 130; the final folder being saved is not left behind, under its own
    name or its temporary one. (SIGTERM takes the same way, with status 143: tests/test_study.py sends a real one.)"""
    from transformers import Trainer

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "run"
    save_model = Trainer.save_model

    def saved_then_interrupted(self, output_dir=None, _internal_call=False):
        save_model(self, output_dir, _internal_call=_internal_call)
        if output_dir and Path(output_dir).name.startswith(".final."):
            raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "save_model", saved_then_interrupted)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the script puts its folder on it again)
    monkeypatch.setattr(sys, "argv", [
        "pretrain.py", "--arch", "llama", "--preset", "tiny", "--data-files", str(corpus), "--train-tokenizer", "300",
        "--block-size", "32", "--per-device-batch-size", "8", "--eval-steps", "100", "--save-steps", "100",
        "--max-eval-blocks", "1", "--max-steps", "2", "--output-dir", str(out)])
    with pytest.raises(BaseException) as stop:  # (a KeyboardInterrupt let through would stop pytest itself)
        runpy.run_path(str(EXAMPLES / "pretrain.py"), run_name="__main__")
    assert isinstance(stop.value, SystemExit) and stop.value.code == 130, repr(stop.value)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "examples/pretrain.py: interrupted; --resume latest continues from the newest checkpoint")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") or p.name == "final"]


def test_fresh_run_trains_its_tokenizer_over_one_a_stopped_run_left(tmp_path):
    """A run stopped before its first checkpoint leaves OUTPUT_DIR/tokenizer, which is no run the folder holds: a
    fresh run there with another --train-tokenizer size trains its own (it took the old one), a resumed run keeps it."""
    from transformers import AutoTokenizer

    from hf_memffn.tokenization import train_tokenizer

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    train_tokenizer(texts, vocab_size=300).save_pretrained(out / pretrain.TOKENIZER_DIR)
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "270", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "1", "--max-eval-blocks", "1", "--output-dir", str(out)]
    pretrain.main(common + ["--max-steps", "1"])
    assert len(AutoTokenizer.from_pretrained(out / "final")) == 270
    assert not [path.name for path in out.iterdir() if path.name.endswith(".tmp")]  # no temporary left
    resumed = pretrain.main(common[:5] + ["290"] + common[6:] + ["--max-steps", "2", "--resume", "latest"])
    assert resumed["global_step"] == 2 and len(AutoTokenizer.from_pretrained(out / "final")) == 270


def test_resuming_from_a_checkpoint_of_another_model_is_refused_naming_the_fields(tmp_path):
    """`--resume` with another --arch failed in the optimizer's state after a warning about the weights, with another
    --preset in a size mismatch of a weight, and with another dropout trained on silently: each is refused before
    anything is written, naming the config fields. Fields that choose only how the model computes may differ."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32", "--per-device-batch-size",
              "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1", "--output-dir", str(out)]
    kvffn = ["--arch", "kvffn", "--preset", "tiny", "--config-overrides", "attention_dropout=0.1"]
    pretrain.main(kvffn + common + ["--max-steps", "2"])
    log_before = (out / "train_log.jsonl").read_text()
    refused = {
        ("--arch", "memoryllm"): r"model_type='memffn_kvffn' \(these arguments: 'memffn_memoryllm'\)",
        ("--config-overrides", "attention_dropout=0.2"): r"attention_dropout=0.1 \(these arguments: 0.2\)",
        ("--preset", "small"): r"head_dim=16 \(these arguments: 64\), hidden_size=64 \(these arguments: 256\)",
    }
    for (option, value), fields in refused.items():
        arguments = list(kvffn)
        arguments[arguments.index(option) + 1] = value
        with pytest.raises(ValueError, match=rf"--resume: '.*checkpoint-2' is a checkpoint of another model: its "
                                             rf"config has {fields}.*; resume with the run's own --arch"):
            pretrain.main(arguments + common + ["--max-steps", "3", "--resume", "latest"])
        assert (out / "train_log.jsonl").read_text() == log_before
        assert not (out / "checkpoint-3").exists()
    resumed = pretrain.main(kvffn[:-1] + ["attention_dropout=0.1,decoder_kernels=torch"] + common
                            + ["--max-steps", "3", "--resume", "latest"])
    assert resumed["global_step"] == 3


def a_run_stopped_before_its_end(tmp_path) -> tuple[list[str], Path, dict]:
    """(its arguments, its --output-dir, its summary) of a 4-step Llama run with checkpoints at steps 2 and 4, whose
    final model and summary are then removed: a session stopped after its last checkpoint."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--max-steps", "4", "--precision", "fp32", "--output-dir", str(out)]
    whole = pretrain.main(common)
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    return common, out, whole


def test_resume_latest_skips_a_checkpoint_a_stopped_session_left_half_saved(tmp_path, capsys):
    """A session stopped while saving a checkpoint leaves its folder without trainer_state.json (the Trainer writes it
    last): `--resume latest` took that folder and failed in a FileNotFoundError after the data was packed. It now
    resumes from the newest whole checkpoint, and ends on the uninterrupted run's evaluation."""
    common, out, whole = a_run_stopped_before_its_end(tmp_path)
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    resumed = pretrain.main(common + ["--resume", "latest"])
    printed = capsys.readouterr().out
    assert "--resume latest: not saved whole in --output-dir=" in printed
    assert "checkpoint-4 (no readable trainer_state.json); resuming from checkpoint-2" in printed
    assert resumed["global_step"] == 4 and resumed["eval_loss"] == whole["eval_loss"]
    (tmp_path / "cut" / "checkpoint-3").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--resume latest: no whole checkpoint in --output-dir='.*cut': checkpoint-3 "
                                         r"\(no readable trainer_state.json\)"):
        pretrain.resume_checkpoint(pretrain.SimpleNamespace(resume="latest"), tmp_path / "cut")


def cut_short(path: Path) -> None:
    """What a session stopped while writing `path` leaves: its first half."""
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def test_resume_passes_over_a_checkpoint_whose_weights_or_optimizer_state_were_cut_short(tmp_path, capsys):
    """A checkpoint with a readable trainer_state.json beside weights or optimizer state cut short (saved again in
    place over an older one, or written by a machine that went down before its writes reached the disk) was taken by
    `--resume latest`, which failed in transformers after the data was packed (a SafetensorError, or "[Errno 22]
    Invalid argument" for the optimizer's state). `latest` passes over it, naming the file; named, it is refused."""
    common, out, whole = a_run_stopped_before_its_end(tmp_path)
    cut_short(out / "checkpoint-4" / "model.safetensors")
    resumed = pretrain.main(common + ["--resume", "latest"])
    assert "checkpoint-4 (model.safetensors cut short); resuming from checkpoint-2" in capsys.readouterr().out
    assert resumed["global_step"] == 4 and resumed["eval_loss"] == whole["eval_loss"]

    cut_short(out / "checkpoint-4" / "optimizer.pt")
    with pytest.raises(ValueError, match=r"--resume='.*checkpoint-4' is not a checkpoint folder saved whole "
                                         r"\(optimizer.pt cut short\)"):
        pretrain.resume_checkpoint(pretrain.SimpleNamespace(resume=str(out / "checkpoint-4")), out)
    cut_short(out / "checkpoint-2" / "model.safetensors")
    with pytest.raises(ValueError, match=r"no whole checkpoint in --output-dir='.*run': checkpoint-4 \(optimizer.pt "
                                         r"cut short\), checkpoint-2 \(model.safetensors cut short\)"):
        pretrain.resume_checkpoint(pretrain.SimpleNamespace(resume="latest"), out)


def test_resume_drops_a_last_line_of_the_train_log_cut_short(tmp_path):
    """train_log.jsonl is appended a line at a time: a session killed while appending one (or a disk that filled)
    leaves a last line cut short, and `--resume latest` failed on it in `json.loads`. The line is dropped with the
    rest of what was logged after the checkpoint, and the log is the uninterrupted run's."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--logging-steps", "1", "--max-steps", "4", "--precision", "fp32"]

    def log_of(out):
        return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]

    whole = pretrain.main(common + ["--output-dir", str(tmp_path / "whole")])
    out = tmp_path / "cut"
    pretrain.main(common + ["--output-dir", str(out), "--stop-after-steps", "3"])
    with (out / "train_log.jsonl").open("a", encoding="utf-8") as log:
        log.write('{"step": 4, "loss": 5.1, "grad_no')
    resumed = pretrain.main(common + ["--output-dir", str(out), "--resume", "latest"])
    assert [(r["step"], sorted(r)) for r in log_of(out)] == [(r["step"], sorted(r)) for r in log_of(tmp_path / "whole")]
    assert resumed["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-4)


def test_a_resume_with_another_learning_rate_or_a_stop_before_its_checkpoint_is_refused(tmp_path, monkeypatch,
                                                                                          capsys):
    """A run resumed with another --learning-rate trained at the checkpoint's peak rate (the Trainer takes it back
    with the schedule's state) and the new rate's cosine floor, a schedule of neither; one resumed with a
    --stop-after-steps before the checkpoint's step trained a step past the checkpoint. Both are refused before the
    data is read. A --stop-after-steps at the checkpoint's step (the same command again, after a session stopped
    before its final save) trained one step more: it now evaluates and saves the checkpoint's model."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--max-steps", "4", "--output-dir", str(out)]
    first = pretrain.main(common + ["--stop-after-steps", "2"])
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    load_data = pretrain.load_data

    forbid_reading_data(monkeypatch)
    with pytest.raises(ValueError, match=r"--learning-rate=0.0001: the checkpoint to resume from \('.*checkpoint-2'\) "
                                         r"was trained at a peak rate of 0.003, .* resume with --learning-rate 0.003"):
        pretrain.main(common + ["--resume", "latest", "--learning-rate", "1e-4"])
    with pytest.raises(ValueError, match=r"--stop-after-steps=1: the checkpoint to resume from \('.*checkpoint-2'\) "
                                         r"is at step 2, past it; give step 2 or later"):
        pretrain.main(common + ["--resume", "latest", "--stop-after-steps", "1"])
    monkeypatch.setattr(pretrain, "load_data", load_data)
    again = pretrain.main(common + ["--resume", "latest", "--stop-after-steps", "2", "--learning-rate", "3e-3"])
    assert "checkpoint-2 is at --stop-after-steps=2: nothing left to train" in capsys.readouterr().out
    assert again["global_step"] == 2 and again["eval_loss"] == pytest.approx(first["eval_loss"])
    assert not (out / "checkpoint-3").exists() and (out / "final" / "model.safetensors").is_file()


def forbid_reading_data(monkeypatch):
    """Makes the recipe fail if it reads its data: what a refusal "before the data is read" promises."""

    def no_data(*args, **kwargs):
        raise AssertionError("the data was read")

    monkeypatch.setattr(pretrain, "load_data", no_data)


def test_resuming_with_other_blocks_per_step_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    """A run resumed with another --block-size, or another number of blocks per step, trained on (the Trainer only
    warned about the batch size): its steps left packed other blocks, or skipped another number of them. Both are
    refused before the data is read, naming the setting, the checkpoint's value and the new one; the same blocks per
    step split otherwise (per-device batch x accumulation) resume."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--save-steps", "2",
              "--eval-steps", "100", "--max-eval-blocks", "1", "--output-dir", str(out)]
    pretrain.main(common + ["--block-size", "32", "--per-device-batch-size", "4", "--max-steps", "2"])
    log_before = (out / "train_log.jsonl").read_text()
    load_data = pretrain.load_data

    forbid_reading_data(monkeypatch)
    resume = common + ["--max-steps", "3", "--resume", "latest"]
    with pytest.raises(ValueError, match=r"--block-size=16: the checkpoint to resume from \('.*checkpoint-2'\) was "
                                         r"trained on blocks of 32 tokens; resume with --block-size 32"):
        pretrain.main(resume + ["--block-size", "16", "--per-device-batch-size", "4"])
    with pytest.raises(ValueError, match=r"--resume: the checkpoint to resume from \('.*checkpoint-2'\) was trained "
                                         r"on 4 blocks per step \(--per-device-train-batch-size 4 x "
                                         r"--gradient-accumulation-steps 1 x 1 process\(es\)\), these arguments give 2 "
                                         r"\(--per-device-train-batch-size 2 x "):
        pretrain.main(resume + ["--block-size", "32", "--per-device-batch-size", "2"])
    assert (out / "train_log.jsonl").read_text() == log_before and not (out / "checkpoint-3").exists()
    monkeypatch.setattr(pretrain, "load_data", load_data)
    resumed = pretrain.main(resume + ["--block-size", "32", "--per-device-batch-size", "2", "--grad-accum", "2"])
    assert resumed["global_step"] == 3


def test_resuming_with_another_seed_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    """A run resumed with another --seed or --data-seed trained on: the Trainer's sampler shuffles the blocks with
    --data-seed, else --seed, so the steps left took other blocks than the run's (some trained on twice, others
    never). Refused before the data is read, naming the option, the checkpoint's seed and the new one; another --seed
    beside a --data-seed that keeps the run's order resumes."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--output-dir", str(out)]
    pretrain.main(common + ["--max-steps", "2"])

    forbid_reading_data(monkeypatch)
    resume = common + ["--max-steps", "3", "--resume", "latest"]
    with pytest.raises(ValueError, match=r"--seed=1: the checkpoint to resume from \('.*checkpoint-2'\) was trained "
                                         r"on the blocks in the order of --seed 0; resume with --seed 0"):
        pretrain.main(resume + ["--seed", "1"])
    with pytest.raises(ValueError, match=r"--data-seed=5: the checkpoint to resume from \('.*checkpoint-2'\) was "
                                         r"trained on the blocks in the order of --seed 0; resume with --data-seed 0"):
        pretrain.main(resume + ["--data-seed", "5"])
    assert not (out / "checkpoint-3").exists()
    saved = json.loads((out / "checkpoint-2" / pretrain.BATCH_SETTINGS_FILE).read_text(encoding="utf-8"))
    pretrain.refuse_a_checkpoint_of_other_batches(str(out / "checkpoint-2"), {**saved, "seed": 7, "data_seed": 0})


def test_the_seed_check_names_the_option_that_restores_the_order_and_leaves_an_unshuffled_run_alone(tmp_path):
    """A run of --seed 0 resumed with --data-seed 5 was told "resume with --seed 0", which it already had (the
    --data-seed it kept still decides the order); and a run of --train-sampling-strategy sequential, whose blocks no
    seed shuffles, was refused when resumed with another --seed. Another sampler than the run's is refused instead."""
    record = {"block_size": 32, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "world_size": 1}

    def resume(saved: dict, now: dict):
        (tmp_path / pretrain.BATCH_SETTINGS_FILE).write_text(json.dumps({**record, **saved}), encoding="utf-8")
        pretrain.refuse_a_checkpoint_of_other_batches(str(tmp_path), {**record, **now})

    by_seed = {"seed": 0, "data_seed": None, "train_sampling_strategy": "random"}
    with pytest.raises(ValueError, match=r"--data-seed=5: .* in the order of --seed 0; resume with --data-seed 0 "):
        resume(by_seed, {**by_seed, "data_seed": 5})
    with pytest.raises(ValueError, match=r"--seed=1: .* in the order of --data-seed 5; resume with --data-seed 5 "):
        resume({**by_seed, "data_seed": 5}, {**by_seed, "seed": 1})
    sequential = {**by_seed, "train_sampling_strategy": "sequential"}
    resume(sequential, {**sequential, "seed": 1, "data_seed": 3})
    with pytest.raises(ValueError, match=r"--train-sampling-strategy=sequential: .* in the order of --seed 0; resume "
                                         r"with --train-sampling-strategy random --seed 0 "):
        resume(by_seed, sequential)
    with pytest.raises(ValueError, match=r"--seed=0: .* in the order of --train-sampling-strategy sequential; resume "
                                         r"with --train-sampling-strategy sequential "):
        resume(sequential, by_seed)
    resume({key: by_seed[key] for key in ("seed", "data_seed")}, by_seed)  # (a record without the sampler: random)


def assert_resuming_with_other_blocks_is_refused(common: list[str], monkeypatch):
    """The run of `common` saved checkpoint-2 with blocks of 32 tokens: a resume with blocks of 16 is refused before
    the data is read, which it could only be with the checkpoint's batch record."""
    forbid_reading_data(monkeypatch)
    with pytest.raises(ValueError, match=r"--block-size=16: the checkpoint to resume from \('.*checkpoint-2'\) was "
                                         r"trained on blocks of 32 tokens"):
        pretrain.main(common + ["--block-size", "16", "--max-steps", "3", "--resume", "latest"])


def test_a_checkpoint_holds_its_batch_record_once_its_trainer_state_is_written(tmp_path, monkeypatch):
    """recipe_batches.json was written after the Trainer's state (at `on_save`): a session stopped in between left a
    checkpoint that `--resume latest` takes, without the record, and a resume with another --block-size trained on
    unchecked. The record is written with the checkpoint's weights, before the Trainer's state."""
    from transformers import TrainerState

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--per-device-batch-size",
              "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1", "--output-dir", str(out)]
    save_to_json = TrainerState.save_to_json

    def stopped_after_the_state(self, json_path):
        save_to_json(self, json_path)
        if "checkpoint-" in str(json_path):
            raise KeyboardInterrupt

    monkeypatch.setattr(TrainerState, "save_to_json", stopped_after_the_state)
    with pytest.raises(KeyboardInterrupt):
        pretrain.main(common + ["--block-size", "32", "--max-steps", "2"])
    monkeypatch.setattr(TrainerState, "save_to_json", save_to_json)

    assert_resuming_with_other_blocks_is_refused(common, monkeypatch)


def test_a_checkpoint_holds_its_batch_record_where_save_model_writes_no_weights(tmp_path, monkeypatch):
    """Under FSDP with SHARDED_STATE_DICT (what examples/accelerate/fsdp2.yaml names for large runs) the Trainer's
    `save_model` writes nothing: the sharded weights are saved with the optimizer's state, after it. The record was
    written only into a folder that `save_model` had made, so these checkpoints had none, and a resume with another
    --block-size trained on unchecked."""
    from transformers import Trainer

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--per-device-batch-size",
              "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1", "--output-dir", str(out)]
    save_model, save_optimizer = Trainer.save_model, Trainer._save_optimizer_and_scheduler

    def sharded_save_model(self, output_dir=None, _internal_call=False):
        if not Path(output_dir).name.startswith("checkpoint-"):  # (the final model, gathered by the recipe)
            save_model(self, output_dir, _internal_call)

    def save_sharded_weights_and_optimizer(self, output_dir):
        os.makedirs(output_dir, exist_ok=True)  # (as accelerate's `save_fsdp_model` makes the checkpoint's folder)
        save_optimizer(self, output_dir)

    monkeypatch.setattr(Trainer, "save_model", sharded_save_model)
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", save_sharded_weights_and_optimizer)
    pretrain.main(common + ["--block-size", "32", "--max-steps", "2"])
    monkeypatch.setattr(Trainer, "save_model", save_model)
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", save_optimizer)

    assert_resuming_with_other_blocks_is_refused(common, monkeypatch)


def test_the_final_model_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """`final/` was written in place: a session stopped while saving it (here after the weights, before the rest)
    left a folder that looked complete. It is written beside and renamed once whole; a save that completes replaces
    an earlier `final/` whole."""
    from transformers import PreTrainedModel

    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=40)
    out = tmp_path / "run"
    common = ["--arch", "kvffn", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "1", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--output-dir", str(out)]
    saved = PreTrainedModel.save_pretrained

    def interrupted(self, save_directory, *args, **kwargs):
        saved(self, save_directory, *args, **kwargs)
        if "checkpoint-" not in str(save_directory):  # (the Trainer's checkpoints are saved whole)
            raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pretrain.main(common + ["--max-steps", "1"])
    assert not (out / "final").exists() and not [path.name for path in out.iterdir() if path.name.endswith(".tmp")]
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", saved)
    (out / "final").mkdir()
    (out / "final" / "stale.bin").write_bytes(b"an earlier save's file")
    summary = pretrain.main(common + ["--max-steps", "2", "--resume", "latest"])
    assert summary["global_step"] == 2 and not (out / "final" / "stale.bin").exists()
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "tokenizer.json").is_file()


def test_the_final_model_is_in_place_before_the_hub_upload(tmp_path):
    """With --push-to-hub, `Trainer.save_model` uploads the whole --output-dir from within: saving into a temporary
    folder, it would upload that folder under its hidden name. The upload follows the rename."""
    class TrainerUploadingItsOutputDir:
        args = pretrain.SimpleNamespace(should_save=True, save_on_each_node=False, push_to_hub=True, hub_revision=None)
        uploaded = None

        def save_model(self, output_dir, _internal_call=False):
            Path(output_dir).mkdir()
            (Path(output_dir) / "model.safetensors").write_bytes(b"weights")
            if not _internal_call:
                self.push_to_hub()

        def push_to_hub(self, **kwargs):
            self.uploaded = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))

    trainer = TrainerUploadingItsOutputDir()
    pretrain.save_final_model(trainer, tmp_path / "final")
    assert trainer.uploaded == ["final", "final/model.safetensors"]


def test_resuming_with_other_optimizer_or_schedule_settings_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    """A run resumed with another --weight-decay, Adam beta or epsilon trained on with the checkpoint's (the Trainer
    takes them back with the optimizer's state), one with another --optim loaded that state into another optimizer,
    and one with another schedule (--lr-scheduler-type, --warmup-steps, --min-learning-rate) or --max-grad-norm
    trained its steps left otherwise than its steps before, all without a word. Each is refused before the data is
    read, naming the option, the checkpoint's value and the new one; what a resume may change (a longer --max-steps,
    the logging, evaluation and saving intervals) resumes."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--output-dir", str(out)]
    pretrain.main(common + ["--max-steps", "2"])
    record = json.loads((out / "checkpoint-2" / pretrain.OPTIMIZER_SETTINGS_FILE).read_text(encoding="utf-8"))
    assert record["weight_decay"] == 0.1 and record["adam_beta2"] == 0.95 and record["optim"].startswith("adamw")
    load_data = pretrain.load_data

    forbid_reading_data(monkeypatch)
    resume = common + ["--max-steps", "3", "--resume", "latest"]
    for changed, message in [
        (["--weight-decay", "0.5"], r"--weight-decay=0.5: the checkpoint to resume from \('.*checkpoint-2'\) was "
                                    r"trained with --weight-decay 0.1 \(the Trainer takes .*\); resume with "
                                    r"--weight-decay 0.1"),
        (["--adam-beta2", "0.999"], r"--adam-beta2=0.999: .* was trained with --adam-beta2 0.95 "),
        (["--adam-epsilon", "1e-6"], r"--adam-epsilon=1e-06: .* was trained with --adam-epsilon 1e-08 "),
        (["--optim", "sgd"], r"--optim=sgd: .* was trained with --optim adamw\w* \(the checkpoint's optimizer state "),
        (["--lr-scheduler-type", "linear"], r"--lr-scheduler-type=linear: .* was trained with --lr-scheduler-type "
                                            r"cosine_with_min_lr "),
        (["--warmup-steps", "1"], r"--warmup-steps=1(\.0)?: .* was trained with --warmup-steps 0.015 "),
        (["--min-learning-rate", "1e-4"], r"--min-learning-rate=0.0001: .* was trained with --min-learning-rate "
                                          r"1e-05 "),
        (["--max-grad-norm", "0.5"], r"--max-grad-norm=0.5: .* was trained with --max-grad-norm 1.0 "),
        (["--optim-args", "foreach=False"], r"--optim-args=foreach=False: .* was trained with no --optim-args "),
        (["--lr-scheduler-kwargs", '{"num_cycles": 0.4}'], r"""--lr-scheduler-kwargs='\{"num_cycles": 0.4\}': .* """
                                                           r"""was trained with --lr-scheduler-kwargs '\{\}' """),
        (["--weight-decay", "0", "--adam-beta1", "0.8"], r"--adam-beta1=0.8, --weight-decay=0.0: .* resume with "
                                                         r"--adam-beta1 0.9 --weight-decay 0.1"),
    ]:
        with pytest.raises(ValueError, match=message):
            pretrain.main(resume + changed)
    monkeypatch.setattr(pretrain, "load_data", load_data)
    resumed = pretrain.main(resume + ["--logging-steps", "1", "--eval-steps", "50", "--save-steps", "3"])
    assert resumed["global_step"] == 3


def test_resuming_on_another_training_text_is_refused(tmp_path):
    """A run resumed on another training text (another --data-files, or the same file grown) trained on: the
    sampler shuffled another number of blocks, and the steps left skipped the first blocks of that other order, so
    the resumed run was of neither text's blocks in the run's order. Refused once the blocks are counted, naming the
    checkpoint's count and the new one."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    other = write_corpus(tmp_path / "other.jsonl", documents=90, seed=1)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--train-tokenizer", "300", "--block-size", "32", "--per-device-batch-size", "4",
              "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1", "--output-dir", str(out)]
    pretrain.main(common + ["--data-files", str(corpus), "--max-steps", "2"])
    record = json.loads((out / "checkpoint-2" / pretrain.BATCH_SETTINGS_FILE).read_text(encoding="utf-8"))
    with pytest.raises(ValueError, match=rf"--resume: the checkpoint to resume from \('.*checkpoint-2'\) was trained "
                                         rf"on {record['train_blocks']} blocks of 32 tokens, the training text of "
                                         rf"these arguments \(--data-files\) gives \d+; resume with the run's own "
                                         "training text"):
        pretrain.main(common + ["--data-files", str(other), "--max-steps", "3", "--resume", "latest"])
    assert not (out / "checkpoint-3").exists()
    assert pretrain.main(common + ["--data-files", str(corpus), "--max-steps", "3", "--resume", "latest"])[
        "global_step"] == 3


def test_resuming_with_profile_steps_at_or_before_the_checkpoint_is_refused(tmp_path, monkeypatch):
    """A run resumed with a --profile-steps window that starts at or before its checkpoint's step wrote no profile
    without a word (the profiler starts before the window's first step, which the resumed run never begins). Refused
    before the data is read, naming the checkpoint's step; a window after it profiles."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--output-dir", str(out)]
    pretrain.main(common + ["--max-steps", "2"])
    load_data = pretrain.load_data

    forbid_reading_data(monkeypatch)
    resume = common + ["--max-steps", "4", "--resume", "latest"]
    for window in ("1:1", "2:3"):
        with pytest.raises(ValueError, match=rf"--profile-steps='{window}': the checkpoint to resume from "
                                             rf"\('.*checkpoint-2'\) is at step 2, so its first step .* is not "
                                             rf"trained again; give steps after 2, or leave it out"):
            pretrain.main(resume + ["--profile-steps", window])
    monkeypatch.setattr(pretrain, "load_data", load_data)
    pretrain.main(resume + ["--profile-steps", "3:3"])
    assert json.loads((out / "profile_steps.json").read_text())["steps"] == 1


def test_resuming_from_a_checkpoint_without_optimizer_state_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    """A checkpoint saved with --save-only-model holds no optimizer or schedule state: resumed, the Trainer trained
    the steps left without a word from a new optimizer state and with its schedule started again from step 0 (the
    warmup again, the decay ending past --max-steps). Refused before the data is read, naming --save-only-model and
    --init-from; a session stopped after its last checkpoint still finishes (nothing is left to train)."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--save-only-model", "--output-dir", str(out)]
    first = pretrain.main(common + ["--max-steps", "2"])
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    load_data = pretrain.load_data

    forbid_reading_data(monkeypatch)
    with pytest.raises(ValueError, match=r"--resume: the checkpoint to resume from \('.*checkpoint-2'\) holds no "
                                         r"optimizer state \(saved with --save-only-model\).*--init-from"):
        pretrain.main(common + ["--max-steps", "4", "--resume", "latest"])
    monkeypatch.setattr(pretrain, "load_data", load_data)
    again = pretrain.main(common + ["--max-steps", "2", "--resume", "latest"])
    assert again["global_step"] == 2 and again["eval_loss"] == pytest.approx(first["eval_loss"])


def test_resuming_a_checkpoint_of_another_folder_into_a_folder_that_holds_a_run_is_refused(tmp_path):
    """`--resume DIR/checkpoint-N` with an --output-dir that holds another run went on into that run's folder: its log
    was rewritten with the other run's history and the new checkpoints joined its own, which a later `--resume
    latest` took by their step. Refused naming what the folder holds; into a new folder the checkpoint resumes."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1"]
    for name in ("a", "b"):
        pretrain.main(common + ["--max-steps", "2", "--output-dir", str(tmp_path / name)])
    log_before = (tmp_path / "b" / "train_log.jsonl").read_text()
    checkpoint = str(tmp_path / "a" / "checkpoint-2")
    with pytest.raises(ValueError, match=r"--output-dir='.*b' holds a run \(checkpoint-2, final, summary.json, "
                                         r"train_log.jsonl\) and --resume='.*a/checkpoint-2' is a checkpoint of "
                                         r"another folder: .*choose another --output-dir"):
        pretrain.main(common + ["--max-steps", "3", "--output-dir", str(tmp_path / "b"), "--resume", checkpoint])
    assert (tmp_path / "b" / "train_log.jsonl").read_text() == log_before
    branched = pretrain.main(common + ["--max-steps", "3", "--output-dir", str(tmp_path / "c"), "--resume",
                                       checkpoint])
    assert branched["global_step"] == 3


def test_resuming_with_another_arch_is_refused_before_the_data_is_read(tmp_path, monkeypatch):
    """A resume with another --arch was refused only once the data was read, tokenized and packed (hours for a large
    corpus) and the model built. The architecture is compared before the data is read."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32", "--per-device-batch-size",
              "4", "--save-steps", "2", "--eval-steps", "100", "--max-eval-blocks", "1", "--output-dir", str(out)]
    pretrain.main(["--arch", "kvffn"] + common + ["--max-steps", "2"])
    forbid_reading_data(monkeypatch)
    with pytest.raises(ValueError, match=r"--resume: '.*checkpoint-2' is a checkpoint of another model: its config has "
                                         r"model_type='memffn_kvffn' \(these arguments: 'llama'\); resume with the "
                                         r"run's own --arch"):
        pretrain.main(["--arch", "llama"] + common + ["--max-steps", "3", "--resume", "latest"])


def test_initial_weights_refuse_an_out_dir_they_cannot_write_before_training_the_tokenizer(tmp_path, monkeypatch,
                                                                                          read_only_folder):
    """save_initial_weights.py's OUT_DIR inside a file or in a folder this user cannot write failed only when the
    weights were saved, after the tokenizer was trained and the model built, naming a hidden temporary folder; refused
    now before the corpus is read, naming OUT_DIR and the folder. (Run as root, which writes anywhere, the folder's
    mode is read by `os.access` as for another user.)"""
    import re

    import save_initial_weights

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    a_file, read_only = tmp_path / "a_file", read_only_folder
    a_file.write_text("not a folder\n")
    monkeypatch.setattr("hf_memffn.tokenization.train_tokenizer", lambda *args, **kwargs: pytest.fail("trained"))
    for out, reason in ((a_file / "init", "which is a file"), (read_only / "init", "not writable")):
        with pytest.raises(ValueError, match=f"OUT_DIR: {re.escape(repr(str(out)))}.*{reason}"):
            save_initial_weights.main([str(corpus), str(out), "--arch", "llama", "--preset", "tiny",
                                       "--vocab-size", "300"])
    assert os.listdir(read_only) == [] and a_file.read_text() == "not a folder\n"


@pytest.mark.parametrize("earlier", ["norm_decayed", "weights_apart"])
def test_a_checkpoint_whose_optimizer_state_groups_the_weight_decay_otherwise_is_refused_naming_what_changed(
        tmp_path, earlier):
    """Versions of the package before MemoryLLM's RMSNorm weights of the FFNs on X0 were named `rmsnorm_weight`
    (left out of weight decay by the Trainer) saved an optimizer state with that weight in the weight-decay group, and
    those before FlashMHF's key, up and value (KV-FFN's key and value) were joined one with more parameters. Resumed,
    the Trainer failed inside torch ("loaded state dict contains a parameter group that doesn't match the size of
    optimizer's group") after the data was read: the run is refused before training, naming both groupings and what
    to do. The fixture is this version's checkpoint with one parameter moved between the groups, or one more in the
    weight-decay group, as the earlier versions wrote them."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "memoryllm", "--preset", "tiny", "--data-files", str(corpus), "--train-tokenizer", "300",
              "--block-size", "32", "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100",
              "--max-eval-blocks", "1", "--max-steps", "4", "--output-dir", str(out)]
    pretrain.main(common + ["--stop-after-steps", "2"])
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    optimizer_file = out / "checkpoint-2" / "optimizer.pt"
    state = torch.load(optimizer_file, weights_only=True)
    decayed, not_decayed = state["param_groups"]
    built = (len(decayed["params"]), len(not_decayed["params"]))
    if earlier == "norm_decayed":
        decayed["params"].append(not_decayed["params"].pop(0))
    else:
        decayed["params"].append(1 + max(decayed["params"] + not_decayed["params"]))
    torch.save(state, optimizer_file)
    with pytest.raises(ValueError, match=rf"--resume: the optimizer state of '.*checkpoint-2' holds "
                                         rf"{len(decayed['params'])} trained parameters with weight decay and "
                                         rf"{len(not_decayed['params'])} without, this run's optimizer "
                                         rf"{built[0]} and {built[1]}, .*--init-from"):
        pretrain.main(common + ["--resume", "latest"])


def _swap_documents(corpus: Path, first: int, second: int) -> None:
    """Swaps two documents of a JSON-lines corpus in place: the same tokens, so as many blocks, in another order."""
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[first], lines[second] = lines[second], lines[first]
    corpus.write_text("".join(lines), encoding="utf-8")


def test_resuming_on_another_training_text_of_as_many_blocks_is_refused_by_its_fingerprint(tmp_path, monkeypatch):
    """A run resumed on its --data-files edited in place (two training documents swapped: as many blocks of other
    tokens) trained its steps left on other blocks than the run's without a word, the block count being the same.
    The fingerprint of the packed training blocks, taken once at the start of a run (not at each step or save), is
    recorded in each checkpoint; a resume whose fingerprint differs is refused naming the option and both
    fingerprints' short forms. A checkpoint that recorded no fingerprint (an earlier version's) resumes."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "1", "--eval-steps", "100", "--max-eval-blocks", "1",
              "--output-dir", str(out)]
    fingerprint, calls = pretrain.blocks_fingerprint, []
    monkeypatch.setattr(pretrain, "blocks_fingerprint", lambda blocks: calls.append(len(blocks)) or fingerprint(blocks))
    pretrain.main(common + ["--max-steps", "4", "--stop-after-steps", "3"])
    assert len(calls) == 2  # (the training and the held-out blocks, once each)
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    record_file = out / "checkpoint-3" / pretrain.BATCH_SETTINGS_FILE
    record = json.loads(record_file.read_text(encoding="utf-8"))
    saved = record["train_text_fingerprint"]
    _swap_documents(corpus, 0, 1)
    with pytest.raises(ValueError, match=rf"--resume: the checkpoint to resume from \('.*checkpoint-3'\) was trained "
                                         rf"on {record['train_blocks']} blocks of 32 tokens of fingerprint "
                                         rf"{saved[:12]}, the training text of these arguments \(--data-files\) "
                                         rf"gives as many of fingerprint (?!{saved[:12]})[0-9a-f]{{12}}, another "
                                         r"text \(a file edited in place, .*\); resume with the run's own training "
                                         "text"):
        pretrain.main(common + ["--max-steps", "4", "--resume", "latest"])
    assert not (out / "checkpoint-4").exists()
    del record["train_text_fingerprint"]
    record_file.write_text(json.dumps(record), encoding="utf-8")
    assert pretrain.main(common + ["--max-steps", "4", "--resume", "latest"])["global_step"] == 4


def test_resuming_with_another_held_out_set_is_refused(tmp_path, monkeypatch):
    """A run resumed with another --max-eval-blocks, or on another held-out text, logged evaluation losses of
    another set of blocks from then on: a curve of two sets, whose best checkpoint (--load-best-model-at-end) was
    picked by comparing losses of different texts. Another --max-eval-blocks is refused before the data is read,
    another held-out text (of the same training text) once it is packed, each naming what to resume with."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", documents=60)
    out = tmp_path / "run"
    common = ["--arch", "llama", "--data-files", str(corpus), "--train-tokenizer", "300", "--block-size", "32",
              "--per-device-batch-size", "4", "--save-steps", "2", "--eval-steps", "100", "--output-dir", str(out)]
    pretrain.main(common + ["--max-eval-blocks", "1", "--max-steps", "2"])
    load_data = pretrain.load_data

    forbid_reading_data(monkeypatch)
    resume = common + ["--max-steps", "3", "--resume", "latest"]
    with pytest.raises(ValueError, match=r"--max-eval-blocks=2: the checkpoint to resume from \('.*checkpoint-2'\) "
                                         r"was evaluated on at most 1 held-out block\(s\); resume with "
                                         r"--max-eval-blocks 1 \(the evaluation losses"):
        pretrain.main(resume + ["--max-eval-blocks", "2"])
    with pytest.raises(ValueError, match=r"no --max-eval-blocks: the checkpoint .* was evaluated on at most 1 "
                                         r"held-out block\(s\); resume with --max-eval-blocks 1 "):
        pretrain.main(resume)
    monkeypatch.setattr(pretrain, "load_data", load_data)
    _swap_documents(corpus, 58, 59)  # (the last documents are held out)
    with pytest.raises(ValueError, match=r"--resume: the checkpoint to resume from \('.*checkpoint-2'\) was evaluated "
                                         r"on 1 held-out block\(s\) of fingerprint [0-9a-f]{12}, these arguments' "
                                         r"held-out text .* gives 1 of fingerprint [0-9a-f]{12}; resume with the "
                                         r"run's own held-out text"):
        pretrain.main(resume + ["--max-eval-blocks", "1"])
    assert not (out / "checkpoint-3").exists()
    _swap_documents(corpus, 58, 59)
    assert pretrain.main(resume + ["--max-eval-blocks", "1"])["global_step"] == 3
    record_file = out / "checkpoint-3" / pretrain.BATCH_SETTINGS_FILE
    record = json.loads(record_file.read_text(encoding="utf-8"))
    # (a checkpoint of an earlier version, which recorded no held-out set, resumes with any)
    record_file.write_text(json.dumps({key: value for key, value in record.items()
                                       if key not in ("max_eval_blocks", "eval_blocks", "eval_text_fingerprint")}))
    assert pretrain.main(resume + ["--max-steps", "4", "--max-eval-blocks", "2"])["global_step"] == 4
