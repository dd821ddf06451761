"""The real-text study (examples/reproduce/): data preparation, token shards, parameter-matched configurations, and
the whole study end to end at toy size on CPU."""

from __future__ import annotations

import copyreg
import gzip
import io
import json
import math
import os
import pickle
import re
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "reproduce"))
import learning_rates  # noqa: E402
import models as study_models  # noqa: E402
import paired  # noqa: E402
import prepare_data  # noqa: E402
import pretrain  # noqa: E402
import study  # noqa: E402
import token_shards  # noqa: E402
import verdicts  # noqa: E402


def old_pandas_pickle(lines: list[str]) -> bytes:
    """A gzip-ed DataFrame pickle laid out as pandas 1.0 wrote the Gutenberg Poetry Corpus (text, meter, syllables)."""
    pandas = pytest.importorskip("pandas")
    from pandas.core.indexes.base import _new_Index
    from pandas.core.internals.managers import BlockManager

    class Frame:
        __class__ = property(lambda self: pandas.DataFrame)

    class Manager:
        __class__ = property(lambda self: BlockManager)

    class IndexArgs:
        def __init__(self, cls, fields):
            self.cls, self.fields = cls, fields

    def names(*items):
        return IndexArgs(pandas.Index, {"data": np.array(items, dtype=object), "name": None})

    n = len(lines)
    axes = [names("text", "meter", "syllables"), IndexArgs(pandas.RangeIndex, {"name": None, "start": 0, "stop": n, "step": 1})]
    numbers, objects = np.full((1, n), 3, dtype=np.int64), np.array([lines, ["01"] * n], dtype=object)
    manager, frame = Manager(), Frame()
    manager.state = (axes, [numbers, objects], [names("syllables"), names("text", "meter")], {"0.14.1": {"axes": axes}})
    frame.state = {"_data": manager, "_typ": "dataframe", "_metadata": []}

    class OldLayoutPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if type(obj) in (Frame, Manager):
                return copyreg.__newobj__, (obj.__class__,), obj.state
            if type(obj) is IndexArgs:
                return _new_Index, (obj.cls, obj.fields)
            return NotImplemented

    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as handle:
        OldLayoutPickler(handle, protocol=4).dump(frame)
    return buffer.getvalue()


def test_poetry_corpus_pickle_is_read_without_pandas_objects(tmp_path):
    path = tmp_path / "data.pkl.compress"
    path.write_bytes(old_pandas_pickle(["Of man's first disobedience, and the fruit", "Of that forbidden tree"]))
    assert prepare_data.read_poetry_lines(path) == ["Of man's first disobedience, and the fruit", "Of that forbidden tree"]
    documents = list(prepare_data.poetry_documents(path))
    assert documents == [("Of man's first disobedience, and the fruit\nOf that forbidden tree", False)]


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    class RunsCode:
        def __reduce__(self):
            return (print, ("this must never run",))

    path = tmp_path / "evil.pkl.gz"
    path.write_bytes(gzip.compress(pickle.dumps(RunsCode())))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load builtins.print"):
        prepare_data.read_poetry_lines(path)


def test_token_shards_round_trip_and_refuse_ids_beyond_uint16(tmp_path):
    written = token_shards.write_split(tmp_path, "train", [[5, 6, 7], [8], [9, 10]], eos_id=2, max_tokens=8)
    assert written == 8
    tokens = token_shards.read_tokens(tmp_path, "train")
    assert tokens.tolist() == [5, 6, 7, 2, 8, 2, 9, 10]
    blocks = token_shards.load_blocks(tmp_path, 3)
    assert len(blocks) == 2 and blocks[1]["input_ids"].tolist() == [2, 8, 2]
    assert [b["input_ids"].tolist() for b in blocks.select(range(1, 2))] == [[2, 8, 2]]
    with pytest.raises(ValueError, match="does not fit uint16"):
        token_shards.write_split(tmp_path, "bad", [[70000]], eos_id=2)
    with pytest.raises(ValueError, match="split='heldout' is not in"):
        token_shards.read_tokens(tmp_path, "heldout")


def test_token_blocks_pickle_as_the_path_of_their_mapped_file(tmp_path):
    """DataLoader workers started by spawn or forkserver receive the dataset pickled: a mapped split was pickled with
    all its tokens (a copy of train.bin in each worker's memory); it is mapped again from its file."""
    token_shards.write_split(tmp_path, "train", [list(range(100, 300))] * 50, eos_id=2)
    blocks = token_shards.load_blocks(tmp_path, 16).select(range(3, 9))
    pickled = pickle.dumps(blocks)
    assert len(pickled) < 1000  # the 10,050 tokens take 20,100 bytes
    copy = pickle.loads(pickled)
    assert isinstance(copy.tokens, np.memmap) and Path(copy.tokens.filename) == tmp_path / "train.bin"
    assert len(copy) == 6 and [copy[i]["input_ids"].tolist() for i in range(6)] == [
        blocks[i]["input_ids"].tolist() for i in range(6)]
    in_memory = token_shards.TokenBlocks(np.arange(40, dtype=np.uint16), 8)  # tokens not mapped from a file
    assert pickle.loads(pickle.dumps(in_memory))[4]["input_ids"].tolist() == list(range(32, 40))


def test_token_shards_name_the_id_out_of_range_and_an_empty_split(tmp_path):
    """A negative id was reported as the largest id of its document; an empty split failed in numpy's memmap."""
    with pytest.raises(ValueError, match=r"token id -1 does not fit uint16 \(0 to 65535\)"):
        token_shards.write_split(tmp_path, "train", [[5, -1]], eos_id=2)
    assert not list(tmp_path.iterdir())  # neither the split nor its temporary file
    assert token_shards.write_split(tmp_path, "heldout", [], eos_id=2) == 0
    with pytest.raises(ValueError, match=r"split='heldout' of .* holds no tokens \(heldout.bin is empty\)"):
        token_shards.load_blocks(tmp_path, 4, "heldout")


def test_token_shards_leave_empty_documents_out_as_the_text_path_does(tmp_path):
    """An empty document (the ids of a blank text) added a lone EOS: runs of EOS in the shards that the recipe's
    packing of the same documents, which leaves blank ones out, does not have."""
    assert token_shards.write_split(tmp_path, "train", [[5, 6], [], [7], []], eos_id=2) == 5
    assert token_shards.read_tokens(tmp_path, "train").tolist() == [5, 6, 2, 7, 2]


def test_token_shards_refuse_a_split_cut_short_and_a_meta_json_that_is_not_json(tmp_path):
    """A split cut to an odd number of bytes failed in numpy's memmap without naming it, one cut to fewer whole tokens
    than meta.json records was read as the shorter stream, and a meta.json cut short failed with a bare
    `JSONDecodeError`."""
    token_shards.write_split(tmp_path, "train", [[5, 6, 7], [8]], eos_id=2)
    token_shards.write_meta(tmp_path, {"splits": {"train": {"tokens": 6}}})
    assert token_shards.read_tokens(tmp_path, "train").tolist() == [5, 6, 7, 2, 8, 2]
    path = token_shards.split_path(tmp_path, "train")
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])
    with pytest.raises(ValueError, match=r"split='train' of .*: train.bin holds 11 bytes, not a whole number of "
                                         r"2-byte tokens"):
        token_shards.load_blocks(tmp_path, 2)
    path.write_bytes(whole[:-2])
    with pytest.raises(ValueError, match=r"split='train' of .*: train.bin holds 5 tokens, but meta.json records 6"):
        token_shards.load_blocks(tmp_path, 2)
    (tmp_path / "meta.json").write_text('{"splits": {"train": ', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--data=.*: meta.json is not readable JSON"):
        token_shards.read_meta(tmp_path, option="--data")
    (tmp_path / "meta.json").write_text("[6]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--data-dir=.*: meta.json holds a list, not a JSON object"):
        token_shards.read_meta(tmp_path)
    (tmp_path / "meta.json").unlink()  # without meta.json, the tokens the file holds
    assert token_shards.read_tokens(tmp_path, "train").tolist() == [5, 6, 7, 2, 8]


def test_write_split_refuses_an_eos_id_or_a_cap_out_of_range_before_writing(tmp_path):
    """`eos_id=None` (a tokenizer without EOS) failed in numpy with "int() argument must be ... not 'NoneType'", and
    `max_tokens=-1` wrote each document but its last token(s)."""
    for eos_id in (None, -1, 65536, 2.0):
        with pytest.raises(ValueError, match=rf"eos_id={eos_id!r} is invalid; allowed: a token id from 0 to 65535"):
            token_shards.write_split(tmp_path, "train", [[5, 6, 7]], eos_id=eos_id)
    for cap in (-1, 2.5):
        with pytest.raises(ValueError, match=rf"max_tokens={cap!r} is invalid; allowed: None \(no cap\) or an "
                                             r"integer >= 0"):
            token_shards.write_split(tmp_path, "train", [[5, 6, 7]], eos_id=2, max_tokens=cap)
    assert not list(tmp_path.iterdir())
    assert token_shards.write_split(tmp_path, "train", [[5, 6, 7]], eos_id=np.int64(2), max_tokens=np.int32(3)) == 3


@pytest.mark.parametrize("size", ["small", "wide", "370M"])
def test_every_compared_model_is_parameter_matched(size):
    shape = study_models.SHAPES[size]
    selected = study_models.study_models(shape)
    described = study.describe_models(selected, shape, shape.vocab_size)
    counts = {key: value["counts"] for key, value in described.items()}
    baseline = counts["llama"]["total"]
    for model in selected:
        if model.key in ("memoryllm_active", "flex_active"):
            # equal active: what stays on the device once the FFNs on X0 are lookup tables
            assert abs(counts[model.key]["active"] / baseline - 1) < 0.01, (model.key, counts[model.key])
            assert counts[model.key]["total"] > 1.5 * baseline
        else:
            assert abs(counts[model.key]["total"] / baseline - 1) < 0.01, (model.key, counts[model.key])
    assert counts["memoryllm_total"]["active"] < 0.6 * baseline
    flex = {m.key: m.config_fields(shape) for m in selected}["flex_total"]
    assert flex["intermediate_size"] == shape.hidden_size  # beta = 3: FFN-C keeps 3 h^2
    assert flex["intermediate_size"] + flex["memory_intermediate_size"] == shape.intermediate_size
    kv = {m.key: m.config_fields(shape) for m in selected if m.recipe == "kv-ffn"}
    assert {f["attention_dropout"] for f in kv.values()} == {0.1} and {f["kvffn_dropout"] for f in kv.values()} == {0.1}
    if size == "small":
        fields = {m.key: m.config_fields(shape) for m in selected}["flash_mhf"]
        assert shape.hidden_size // fields["ffn_num_heads"] == 128  # the paper's d_h, so the fused kernels run
        assert fields["intermediate_size"] // fields["ffn_num_subnetworks"] == 384  # d_e = 8/3 d_h rounded up to 64
        half = {m.key: m.config_fields(shape) for m in selected}["flash_mhf_half_head_dim"]
        assert shape.hidden_size // half["ffn_num_heads"] == 64  # the paper's head-width ablation
        assert (half["ffn_num_subnetworks"], half["intermediate_size"] // half["ffn_num_subnetworks"]) == (4, 192)


def test_head_width_ablation_from_the_wide_side_follows_the_papers_sizing_rule():
    """FlashMHF d_h=256 exists where the width divides into heads of 256; where the sizing rule leaves one sub-network
    per head it is an MH-FFN (no router to train towards a constant gate), and says so in its label."""
    def double(size):
        models = {m.key: m for m in study_models.study_models(study_models.SHAPES[size])}
        model = models.get("flash_mhf_double_head_dim")
        return model and (model.label, model.config_fields(study_models.SHAPES[size]))

    label, fields = double("base")
    assert label == "FlashMHF d_h=256 (E=1: MH-FFN)" and fields["ffn_variant"] == "mh_ffn"
    assert (fields["ffn_num_heads"], fields["ffn_num_subnetworks"], fields["intermediate_size"]) == (2, 1, 1040)
    label, fields = double("370M")
    assert label == "FlashMHF d_h=256" and fields["ffn_variant"] == "flash_mhf"
    assert (fields["ffn_num_heads"], fields["ffn_num_subnetworks"]) == (4, 3)
    assert "ffn_kernel" not in fields  # heads of 256: the fused kernels run
    assert double("small") is None  # 384 does not divide into heads of 256


@pytest.mark.slow
def test_study_end_to_end_at_toy_size(tmp_path):
    """prepare_data on a text that ships with the repository, then the whole study (every model, two seeds of the
    main comparison, one ablation) through examples/pretrain.py's Trainer recipe, and every output file."""
    data = tmp_path / "data"
    meta = prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
                              "--heldout-every", "10", "--vocab-size", "300", "--max-train-tokens", "20000",
                              "--max-heldout-tokens", "2000", "--wiki", "no"])
    assert meta["splits"]["train"]["tokens"] == 20000 and meta["tokenizer"]["vocab_size"] <= 300
    with pytest.raises(ValueError, match="exists"):
        prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md")])

    out = tmp_path / "results"
    keys = [m.key for m in study_models.study_models(study_models.SHAPES["toy"]) if not m.ablation] + ["kvffn_sum"]
    state = study.main(["--data", str(data), "--size", "toy", "--tokens", "512", "--seeds", "2",
                        "--models", ",".join(keys), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["configs.json", "log.txt", "loss_curves.png", "results.json", "results.md"]
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == len(keys) + 2 and not results["skipped"]
    assert {r["model"] for r in results["runs"] if r["seed"] == 1} == set(study.MAIN_SEED_KEYS)
    for run in results["runs"]:
        assert run["tokens"] == 512 and math.isfinite(run["heldout_loss"]) and len(run["eval_curve"]) >= 2
    assert results["summary"]["llama"]["heldout_loss_std"] is not None
    configs = json.loads((out / "configs.json").read_text())
    assert configs["models"]["flex_total"]["config"]["memory_intermediate_size"] > 0
    assert configs["models"]["llama"]["config"]["architectures"] == ["LlamaForCausalLM"]
    markdown = (out / "results.md").read_text()
    for heading in ("flash-mhf.md Table 1", "memoryllm.md", "kv-ffn.md Table 1", "orderings at this scale",
                    "Held-out loss at fixed token counts", "Training loss at the same token counts"):
        assert heading in markdown
    assert "FlashMHF d_h=32 < SwiGLU" in markdown


def test_the_report_sets_the_training_loss_since_each_evaluation_beside_the_held_out_loss():
    """Each evaluation's cell is the mean of the training losses logged since the evaluation before (since the start
    at the first), then the mean over seeds; an evaluation with none logged since the one before gets '-'."""
    def run(model, seed, train, evals):
        return {"model": model, "seed": seed, "train_curve": train, "eval_curve": evals}

    first = run("llama", 0, [[10_000, 6.0], [20_000, 5.0], [30_000, 4.0], [40_000, 3.0]],
                [[20_000, 5.5], [40_000, 4.5], [41_000, 4.4]])
    second = run("llama", 1, [[10_000, 7.0], [20_000, 6.0], [30_000, 5.0], [40_000, 4.0]],
                 [[20_000, 5.7], [40_000, 4.7], [41_000, 4.6]])
    assert study.training_loss_at_evaluations(first) == {20_000: 5.5, 40_000: 3.5}
    state = {"order": ["llama"], "labels": {"llama": "SwiGLU"}, "runs": [first, second]}
    lines = study.curves_markdown(state, {"llama": {"seeds": [0, 1]}})
    held_out = lines.index("## Held-out loss at fixed token counts (mean over seeds)")
    training = lines.index("## Training loss at the same token counts (mean over seeds)")
    assert lines[held_out + 2:held_out + 5] == ["| model | n | 20k | 40k | 41k |", "|---|---:|---:|---:|---:|",
                                                "| SwiGLU | 2 | 5.600 | 4.600 | 4.500 |"]
    assert lines[training + 4:] == ["| model | n | 20k | 40k | 41k |", "|---|---:|---:|---:|---:|",
                                    "| SwiGLU | 2 | 6.000 | 4.000 | - |"]
    assert study.curves_markdown({**state, "runs": []}, {"llama": {"seeds": []}}) == []


def test_the_loss_curves_plot_takes_a_run_whose_loss_diverged_to_nan(tmp_path):
    """A SwiGLU run that ended with a NaN held-out loss (too high a rate) stopped the study at its plot, matplotlib
    refusing NaN axis limits: after that run, after each run of a --resume and at --report. The plot's scale is the
    finite losses'."""
    pytest.importorskip("matplotlib")

    def run(model, losses):
        return {"model": model, "seed": 0, "eval_curve": [[256 * (i + 1), loss] for i, loss in enumerate(losses)]}

    keys = {"llama": "flash-mhf", "flash_mhf": "flash-mhf", "memoryllm_total": "memoryllm"}
    state = {"order": list(keys), "labels": {key: key for key in keys}, "groups": keys, "ablations": [],
             "device": "cpu", "size": "toy",
             "runs": [run("llama", [6.0, math.nan]), run("flash_mhf", [6.1, 5.9]), run("memoryllm_total", [6.2, 5.8])]}
    assert study.plot_curves(state, tmp_path / "loss_curves.png")
    assert (tmp_path / "loss_curves.png").stat().st_size > 0


def test_the_curves_of_a_run_read_a_loss_that_diverged_from_its_strict_json_log(tmp_path):
    """pretrain.py writes a loss that is not finite as null in train_log.jsonl (its field named under `not_finite`):
    the study's curves read it back as NaN or infinity, not as a missing loss (`round(None)` failed)."""
    log = tmp_path / "train_log.jsonl"
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": math.inf}, {"step": 2, "eval_loss": math.nan}]
    log.write_text("".join(pretrain.run_record_json(record) + "\n" for record in records))
    train, evals = study.read_curves(log, tokens_per_step=256)
    assert train[0] == [256, 5.0] and train[1] == [512, math.inf]
    assert evals[0][0] == 512 and math.isnan(evals[0][1])


def test_study_refuses_unknown_models_and_paper_shapes(tmp_path):
    with pytest.raises(ValueError, match="--models"):
        study.main(["--print-configs", "--size", "toy", "--models", "llama,gpt"])
    with pytest.raises(ValueError, match="paper shape"):
        study.main(["--size", "370M", "--out", str(tmp_path)])


def test_prepare_data_streams_a_datasets_dataset(tmp_path):
    """The path a Hub name takes (`--source hub`, streamed with `datasets`), here on a local dataset folder."""
    pytest.importorskip("datasets")
    folder = tmp_path / "corpus"
    folder.mkdir()
    sentences = (ROOT / "README.md").read_text(encoding="utf-8").split(". ")
    with (folder / "train.jsonl").open("w", encoding="utf-8") as handle:
        for sentence in sentences:
            handle.write(json.dumps({"body": sentence}) + "\n")
    meta = prepare_data.main(["--out", str(tmp_path / "shards"), "--source", "hub", "--dataset", str(folder),
                              "--text-column", "body", "--heldout-every", "5", "--vocab-size", "300",
                              "--max-train-tokens", "5000", "--max-heldout-tokens", "500", "--wiki", "no"])
    assert meta["splits"]["train"]["tokens"] == 5000 and meta["splits"]["heldout"]["tokens"] == 500
    assert len(meta["splits"]["train"]["sha256"]) == 64
    with pytest.raises(ValueError, match="--text-column='text'"):
        prepare_data.main(["--out", str(tmp_path / "other"), "--source", "hub", "--dataset", str(folder), "--wiki", "no"])


def test_prepare_data_refuses_a_held_out_share_of_every_document_or_none(tmp_path):
    """--heldout-every 0 divided by zero; 1 held every document out and the error named no option."""
    for every in ("0", "1", "-5"):
        with pytest.raises(ValueError, match=f"--heldout-every must be 2 or more .*, got {every}"):
            prepare_data.main(["--out", str(tmp_path / "shards"), "--source", "text-files", "--text-files",
                               str(ROOT / "README.md"), "--heldout-every", every, "--wiki", "no"])
    assert not (tmp_path / "shards").exists()


def test_prepare_data_refuses_a_text_file_named_twice(tmp_path, monkeypatch):
    """A file given twice had its paragraphs read twice, so a held-out paragraph (every --heldout-every-th) was in
    train.bin as the other copy."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError, match=r"--text-files names \['\./README.md', 'README.md'\] more than once"):
        prepare_data.main(["--out", str(tmp_path / "shards"), "--source", "text-files", "--text-files", "README.md",
                           "./README.md", "--wiki", "no"])
    assert not (tmp_path / "shards").exists()


def test_prepare_data_paragraphs_split_at_lines_of_spaces_and_leave_a_byte_order_mark_out(tmp_path):
    """A line of spaces between two paragraphs (or of spaces after a CR LF) joined them into one document, and a
    byte-order mark began the first one; pretrain.py's reading of a .txt file leaves it out."""
    corpus = tmp_path / "notes.txt"
    corpus.write_bytes("\ufeffcafe\u0301 one\r\nline two\r\n \t\r\nsecond \U0001f642\n\n\n\nthird\n".encode("utf-8"))
    assert list(prepare_data.paragraphs([str(corpus)])) == ["cafe\u0301 one\nline two", "second \U0001f642", "third"]


def test_prepare_data_refuses_a_text_file_that_is_not_utf8(tmp_path):
    """A Latin-1 file was read with its accented letters replaced by U+FFFD, which the tokenizer and the shards then
    held in their place; it is refused, naming the file, and no folder is made."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("\n\n".join(f"le caf\xe9 num\xe9ro {i} ouvre t\xf4t" for i in range(40)).encode("latin-1"))
    with pytest.raises(ValueError, match=r"--text-files: '.*latin1.txt' is not UTF-8 text .*; convert it to UTF-8"):
        prepare_data.main(["--out", str(tmp_path / "shards"), "--source", "text-files", "--text-files", str(latin1),
                           "--wiki", "no"])
    assert not (tmp_path / "shards").exists() and not (tmp_path / "shards.tmp").exists()


def test_prepare_data_refuses_sizes_out_of_range_and_leaves_no_half_built_folder(tmp_path, monkeypatch):
    """--vocab-size 0 failed after the corpus was read, naming `vocab_size`, and left OUT.tmp behind; --tokenizer-chars
    0 trained a tokenizer of bytes alone without a word; a vocabulary beyond uint16 failed only once the tokenizer was
    trained. A failure while the shards are written leaves neither --out nor its temporary folder."""
    common = ["--out", str(tmp_path / "shards"), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
              "--wiki", "no"]
    for option, value, message in [("--vocab-size", "0", "--vocab-size must be 259 to 65536 .*, got 0"),
                                   ("--vocab-size", "70000", "--vocab-size must be 259 to 65536"),
                                   ("--max-train-tokens", "0", "--max-train-tokens must be 1 or more, got 0"),
                                   ("--max-heldout-tokens", "-1", "--max-heldout-tokens must be 1 or more, got -1"),
                                   ("--tokenizer-chars", "0", "--tokenizer-chars must be 1 or more, got 0")]:
        with pytest.raises(ValueError, match=message):
            prepare_data.main([*common, option, value])
    assert not list(tmp_path.iterdir())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(token_shards, "write_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.main([*common, "--vocab-size", "300", "--max-train-tokens", "2000", "--max-heldout-tokens", "500"])
    assert not list(tmp_path.iterdir())


def test_study_resumes_in_its_folder_and_refuses_another_budget(tmp_path):
    """--resume keeps the runs already in --out and trains only the planned runs it lacks; the reported models are
    the union of both calls'; a different budget is refused before anything is written."""
    data = tmp_path / "data"
    prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
                       "--heldout-every", "10", "--vocab-size", "300", "--max-train-tokens", "6000",
                       "--max-heldout-tokens", "1000", "--wiki", "no"])
    out = tmp_path / "results"
    common = ["--data", str(data), "--size", "toy", "--tokens", "256", "--out", str(out)]
    first = study.main([*common, "--models", "llama", "--seeds", "1"])
    assert [(r["model"], r["seed"]) for r in first["runs"]] == [("llama", 0)]
    before = (out / "results.json").read_text()
    with pytest.raises(ValueError, match=r"--out=.* holds a study \(results.json\): pass --resume"):
        study.main([*common, "--models", "memoryllm_total", "--seeds", "1"])

    with pytest.raises(ValueError, match=r"--resume: .* tokens=256, this call has tokens=512"):
        study.main([*common[:-4], "--tokens", "512", "--out", str(out), "--models", "llama", "--resume"])
    with pytest.raises(ValueError, match=r"--resume: .* learning_rate=None, this call has learning_rate=0.001"):
        study.main([*common, "--models", "llama", "--resume", "--learning-rate", "1e-3"])
    assert (out / "results.json").read_text() == before

    state = study.main([*common, "--models", "llama,memoryllm_total", "--seeds", "2", "--seeds-for", "all", "--resume"])
    runs = [(r["model"], r["seed"]) for r in state["runs"]]
    assert runs == [("llama", 0), ("memoryllm_total", 0), ("llama", 1), ("memoryllm_total", 1)]
    assert state["runs"][0] == {**first["runs"][0], "config": state["runs"][0]["config"]}  # kept, not retrained
    results = json.loads((out / "results.json").read_text())
    assert results["summary"]["llama"]["seeds"] == [0, 1] and results["earlier_calls"][0]["command"] == first["command"]
    assert set(results["plan"]) == {"llama/seed0", "llama/seed1", "memoryllm_total/seed0", "memoryllm_total/seed1"}
    configs = json.loads((out / "configs.json").read_text())
    assert configs["models"]["llama"]["config"]["architectures"] == ["LlamaForCausalLM"]
    log = (out / "log.txt").read_text()
    assert log.count("===== llama seed 0") == 1 and "llama seed 0: already done" in log
    markdown = (out / "results.md").read_text()
    assert "2 calls, each after the first continuing the study with `--resume`" in markdown
    assert " (2) |" in markdown.split("## The papers' orderings")[1]  # llama vs MemoryLLM over two common seeds

    (out / "results.md").unlink()
    reported = study.main(["--report", "--out", str(out)])
    assert (out / "results.md").read_text() == markdown and len(reported["runs"]) == 4
    assert json.loads((out / "configs.json").read_text()) == configs
    with pytest.raises(ValueError, match="--report: no study in --out="):
        study.main(["--report", "--out", str(tmp_path / "nothing")])


def _toy_data(tmp_path) -> Path:
    data = tmp_path / "data"
    prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
                       "--heldout-every", "10", "--vocab-size", "300", "--max-train-tokens", "3000",
                       "--max-heldout-tokens", "500", "--wiki", "no"])
    return data


def test_a_study_stopped_by_sigterm_removes_its_work_folder_and_says_so_in_one_line(tmp_path):
    """SIGTERM (a scheduler stopping the job) ended the study on the spot: its work folder (the run's model, the
    shards of --dataset) stayed in the temporary directory, and nothing was said. Now it goes as on Ctrl-C, and one
    line names the signal and --resume; the status is 128 + 15."""
    data = _toy_data(tmp_path)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    script = f"""
import os, runpy, signal, sys
sys.path[:0] = [{str(ROOT / "examples")!r}, {str(ROOT / "examples" / "reproduce")!r}]
import pretrain

def stopped_while_training(argv):
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()  # (the signal's exception is raised here at the latest)

pretrain.main = stopped_while_training
sys.argv = ["study.py", "--data", sys.argv[1], "--size", "toy", "--tokens", "256", "--models", "llama",
            "--out", sys.argv[2]]
runpy.run_path({str(ROOT / "examples" / "reproduce" / "study.py")!r}, run_name="__main__")
"""
    env = {**os.environ, "TMPDIR": str(temporary), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script, str(data), str(tmp_path / "study")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + 15, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("study.py: terminated (SIGTERM); --resume continues the study "
                                                      "from its last finished run")
    assert not list(temporary.iterdir())


def test_a_study_stopped_by_ctrl_c_says_so_in_one_line_with_status_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C ended the study in a traceback, with status 1."""
    data = _toy_data(tmp_path)

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain, "main", interrupted)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the script puts its folders on it again)
    monkeypatch.setattr(sys, "argv", ["study.py", "--data", str(data), "--size", "toy", "--tokens", "256",
                                      "--models", "llama", "--out", str(tmp_path / "study")])
    with pytest.raises(BaseException) as stop:  # (a KeyboardInterrupt let through would stop pytest itself)
        runpy.run_path(str(ROOT / "examples" / "reproduce" / "study.py"), run_name="__main__")
    assert isinstance(stop.value, SystemExit) and stop.value.code == 130, repr(stop.value)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "study.py: interrupted; --resume continues the study from its last finished run")


def test_report_writes_every_committed_studys_files_again_byte_for_byte(tmp_path, monkeypatch):
    """`--report` on a copy of each committed study writes its results.md, results.json and configs.json as
    committed: results.md explained the verdict "diverged: no verdict" in every report, none of which has one, so
    none of the committed reports came out as written."""
    monkeypatch.setattr(study, "plot_curves", lambda state, path: False)  # (the plot is not compared)
    folders = sorted(path.parent for path in (ROOT / "examples" / "results").glob("**/results.json"))
    assert len(folders) > 10
    changed = {}
    for index, folder in enumerate(folders):
        copy = tmp_path / str(index)
        copy.mkdir()
        for name in ("results.json", "results.md", "configs.json"):
            (copy / name).write_bytes((folder / name).read_bytes())
        study.rewrite_report(copy)
        files = [name for name in ("results.md", "results.json", "configs.json")
                 if (copy / name).read_bytes() != (folder / name).read_bytes()]
        if files:
            changed[str(folder.relative_to(ROOT))] = files
    assert changed == {}


def test_eval_tokens_beyond_the_held_out_split_are_reported_as_the_tokens_evaluated(tmp_path, capsys):
    """`--eval-tokens` larger than the held-out split evaluated the whole split but the report gave the count asked:
    now each run records the tokens its evaluations read (whole blocks, at most the split), the report gives that
    count and the study says so when it starts."""
    data = tmp_path / "data"
    meta = prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
                              "--heldout-every", "10", "--vocab-size", "300", "--max-train-tokens", "6000",
                              "--max-heldout-tokens", "1000", "--wiki", "no"])
    capsys.readouterr()
    state = study.main(["--data", str(data), "--size", "toy", "--tokens", "256", "--models", "llama", "--seeds", "1",
                        "--eval-tokens", "100000", "--out", str(tmp_path / "out")])
    (run,) = state["runs"]
    split, block = meta["splits"]["heldout"]["tokens"], run["block_size"]
    assert split == 1000 and run["eval_tokens"] == split // block * block < split
    assert state["eval_tokens"] == 100000  # (the setting, which --resume compares, is kept as given)
    assert f"held-out loss over {run['eval_tokens']:,} tokens at" in (tmp_path / "out" / "results.md").read_text()
    assert "note: 100,000 held-out tokens per evaluation (--eval-tokens) is more than the 1,000 of the held-out " \
           "split" in capsys.readouterr().out
    assert study.evaluated_tokens(split, block, 130) == 2 * block  # (whole blocks, at least one)
    assert study.evaluated_tokens(split, block, 10) == block
    assert study.evaluated_tokens_text([{"eval_tokens": 960}, {"eval_tokens": 896}, {}], 5000) == "960 or 896"
    assert study.evaluated_tokens_text([{}], 5000) == "5,000"


def test_study_at_another_learning_rate_says_so_and_resumes_only_at_it(tmp_path):
    data = tmp_path / "data"
    prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
                       "--heldout-every", "10", "--vocab-size", "300", "--max-train-tokens", "3000",
                       "--max-heldout-tokens", "600", "--wiki", "no"])
    out = tmp_path / "results"
    common = ["--data", str(data), "--size", "toy", "--tokens", "256", "--out", str(out), "--models", "pkv"]
    with pytest.raises(ValueError, match="--learning-rate must be a positive number, got 0.0"):
        study.main([*common, "--learning-rate", "0"])
    state = study.main([*common, "--seeds", "1", "--learning-rate", "1e-3"])
    assert [run["learning_rate"] for run in state["runs"]] == [1e-3]
    assert "--learning-rate 0.001" in (out / "log.txt").read_text()  # what examples/pretrain.py was given
    assert "every run here at peak learning rate 0.001 instead of its recipe's" in (out / "results.md").read_text()
    with pytest.raises(ValueError, match=r"learning_rate=0.001, this call has learning_rate=None"):
        study.main([*common, "--resume"])


def test_repeated_runs_name_their_devices_where_a_repeat_ran_on_another():
    run = {"model": "llama", "seed": 0, "heldout_loss": 4.5, "wiki_loss": 6.0, "device": "GPU A"}
    repeat = {**run, "heldout_loss": 4.52, "wiki_loss": None, "study": "second"}
    state = {"labels": {"llama": "SwiGLU"}, "runs": [run], "repeats": [repeat]}
    same = study.repeats_markdown(state)
    assert "| SwiGLU | 0 | 4.500 | 4.520 | +0.020 | - | second |" in same
    assert not any("kept on" in line for line in same)
    across = study.repeats_markdown({**state, "repeats": [{**repeat, "device": "GPU B"}]})
    assert "| SwiGLU | 0 | 4.500 | 4.520 | +0.020 | - | second | GPU A / GPU B |" in across
    header, separator = next((line, across[i + 1]) for i, line in enumerate(across) if line.startswith("| model"))
    assert header.endswith("| kept on / repeat on |") and separator.count("|") == header.count("|")
    assert "the two devices' differences are in it too" in "".join(across)
    assert not any(line.startswith("- ") for line in across), "one repeat per pair of devices gets no summary"


def test_repeats_are_summarised_per_pair_of_devices():
    """The repeats table ends with a line per pair of devices that holds two or more repeats: the mean, sample
    standard deviation and largest size of repeat - kept, a loss missing on either side left out."""
    runs = [{"model": "llama", "seed": seed, "heldout_loss": 4.5, "wiki_loss": 6.0, "device": "GPU A"}
            for seed in range(4)]
    gaps = [(0.02, 0.1), (-0.01, -0.2), (0.05, None), (0.03, 0.0)]
    repeats = [{**run, "heldout_loss": 4.5 + held, "wiki_loss": None if wiki is None else 6.0 + wiki,
                "study": "second", "device": "GPU B" if run["seed"] < 3 else "GPU A"}
               for run, (held, wiki) in zip(runs, gaps)]
    lines = study.repeats_markdown({"labels": {"llama": "SwiGLU"}, "runs": runs, "repeats": repeats})
    summary = [line for line in lines if line.startswith("- ")]
    assert lines[-1] == "" and lines[-2] == summary[-1]
    assert summary == ["- 3 repeats kept on GPU A, repeated on GPU B: repeat - kept, mean ± sample standard "
                       "deviation, held-out +0.020 ± 0.030 (largest 0.050); Wikipedia -0.050 ± 0.212 (largest "
                       "0.200)."], "the repeat on GPU A alone is no pair of devices with two repeats"


def test_studies_made_apart_merge_into_one_and_keep_repeated_seeds_aside(tmp_path):
    """--merge: each model and seed keeps its first run, in the order the studies are named; a second run of one seed
    is kept as a repeat beside it, and survives --report and --resume; studies of other settings are refused."""
    data = tmp_path / "data"
    prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
                       "--heldout-every", "10", "--vocab-size", "300", "--max-train-tokens", "3000",
                       "--max-heldout-tokens", "600", "--wiki", "no"])
    common = ["--data", str(data), "--size", "toy", "--tokens", "256", "--learning-rate", "1e-3"]
    first_dir, second_dir, merged_dir = tmp_path / "first", tmp_path / "second", tmp_path / "merged"
    first = study.main([*common, "--out", str(first_dir), "--models", "llama", "--seeds", "2", "--seeds-for", "all"])
    second = study.main([*common, "--out", str(second_dir), "--models", "llama,pkv", "--seeds", "1"])

    merged = study.main(["--merge", str(first_dir), str(second_dir), "--out", str(merged_dir)])
    assert [(r["model"], r["seed"]) for r in merged["runs"]] == [("llama", 0), ("llama", 1), ("pkv", 0)]
    assert merged["runs"][0]["heldout_loss"] == first["runs"][0]["heldout_loss"]
    # two runs of one seed are two runs even where every loss and timing matches (CPU runs are deterministic)
    assert first["runs"][0]["run_id"] != second["runs"][0]["run_id"]
    (repeat,) = merged["repeats"]
    assert repeat["model"] == "llama" and repeat["seed"] == 0 and repeat["study"] == str(second_dir)
    assert repeat["heldout_loss"] == second["runs"][0]["heldout_loss"]
    results = json.loads((merged_dir / "results.json").read_text())
    assert [call["command"] for call in results["earlier_calls"]] == [first["command"], second["command"]]
    assert results["summary"]["llama"]["seeds"] == [0, 1] and results["learning_rate"] == 1e-3
    markdown = (merged_dir / "results.md").read_text()
    assert "- merged with `python examples/reproduce/study.py --merge" in markdown and "made in these 2 calls" in markdown
    assert "## Runs repeated with the same seed" in markdown and "every run here at peak learning rate 0.001" in markdown
    assert (merged_dir / "log.txt").read_text().count("===== merged from ") == 2
    (merged_dir / "results.md").unlink()
    study.main(["--report", "--out", str(merged_dir)])
    assert (merged_dir / "results.md").read_text() == markdown

    resumed = study.main([*common, "--out", str(merged_dir), "--models", "pkv", "--seeds", "2", "--seeds-for", "all",
                          "--resume"])
    assert [(r["model"], r["seed"]) for r in resumed["runs"]][-1] == ("pkv", 1) and resumed["repeats"] == [repeat]
    markdown = (merged_dir / "results.md").read_text()
    assert "## Runs repeated with the same seed" in markdown
    # the merge trained nothing: it is listed as a merge, not as one of the calls
    assert [call["command"] for call in resumed["earlier_calls"]] == [first["command"], second["command"]]
    assert resumed["earlier_merges"] == [merged["command"]]
    assert "- 3 calls, in studies joined by the merges below" in markdown
    assert f"- studies merged with `{merged['command']}`" in markdown
    # a study merged again with one it already holds: its runs and calls are the same ones, kept once
    remerged = study.main(["--merge", str(merged_dir), str(first_dir), "--out", str(tmp_path / "remerged")])
    assert [call["command"] for call in remerged["earlier_calls"]] == [
        first["command"], second["command"], resumed["command"]]
    assert remerged["runs"] == resumed["runs"] and remerged["repeats"] == [repeat]
    assert remerged["earlier_merges"] == [merged["command"]]
    assert f"- of those, studies merged earlier with `{merged['command']}`" in \
        (tmp_path / "remerged" / "results.md").read_text()

    other_rate = tmp_path / "other_rate"
    other_rate.mkdir()
    (other_rate / "results.json").write_text(json.dumps({**json.loads((second_dir / "results.json").read_text()),
                                                         "learning_rate": 2e-3}))
    with pytest.raises(ValueError, match=r"--merge: .*other_rate was made with learning_rate=0.002, .* with "
                                         r"learning_rate=0.001; merge studies of one size"):
        study.main(["--merge", str(first_dir), str(other_rate), "--out", str(tmp_path / "refused")])
    with pytest.raises(ValueError, match="--merge: name two or more study folders"):
        study.main(["--merge", str(first_dir), "--out", str(tmp_path / "refused")])
    with pytest.raises(ValueError, match="already holds a study"):
        study.main(["--merge", str(first_dir), str(second_dir), "--out", str(merged_dir)])
    with pytest.raises(ValueError, match="without --report and --resume"):
        study.main(["--merge", str(first_dir), str(second_dir), "--out", str(tmp_path / "refused"), "--resume"])
    with pytest.raises(ValueError, match="--merge takes only --out and the study folders; --seeds, --models would"):
        study.main(["--merge", str(first_dir), str(second_dir), "--out", str(tmp_path / "refused"), "--models", "pkv",
                    "--seeds", "2"])
    assert not (tmp_path / "refused").exists()


def test_rate_sweep_runs_one_study_per_rate_within_its_budget(tmp_path):
    """examples/reproduce/rate_sweep.sh: a study folder per rate, at that rate; a spec left less than a minute by
    the ones before it is not started, and a malformed spec is refused before anything runs."""
    data = tmp_path / "data"
    prepare_data.main(["--out", str(data), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
                       "--heldout-every", "10", "--vocab-size", "300", "--max-train-tokens", "3000",
                       "--max-heldout-tokens", "600", "--wiki", "no"])
    script = ROOT / "examples" / "reproduce" / "rate_sweep.sh"
    env = {**os.environ, "STUDY_DATA": str(data), "STUDY_TOKENS": "256", "STUDY_DEADLINE_MARGIN": "0.05",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def sweep(*args):
        return subprocess.run(["bash", str(script), "toy", str(tmp_path / "sweep"), *args], env=env,
                              capture_output=True, text=True, timeout=600)

    refused = sweep("600", "1e-3:llama:1", "2e-3:llama")
    assert refused.returncode == 2 and "a spec is RATE:MODELS:SEEDS" in refused.stderr
    assert not (tmp_path / "sweep").exists()
    done = sweep("61", "1e-3:llama:1", "2e-3:llama:1")  # the first takes more than the 1 s the second could spare
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "sweep" / "lr1e-3" / "results.json").read_text())
    assert results["learning_rate"] == 1e-3 and [r["learning_rate"] for r in results["runs"]] == [1e-3]
    assert "--deadline-margin 0.05 --deadline-minutes" in results["command"]
    assert "not starting 2e-3:llama:1" in done.stdout and not (tmp_path / "sweep" / "lr2e-3").exists()


def test_rate_sweep_refuses_seconds_that_are_not_a_whole_number(tmp_path):
    """SECONDS left out (a spec in its place), or given with a unit or a fraction: refused, naming SECONDS, before
    anything runs (bash's arithmetic said "value too great for base" or "unbound variable")."""
    script = ROOT / "examples" / "reproduce" / "rate_sweep.sh"
    for seconds in ("1e-3:llama:1", "600s", "90.5", "abc"):
        refused = subprocess.run(["bash", str(script), "toy", str(tmp_path / "sweep"), seconds, "2e-3:llama:1"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and f"SECONDS is a whole number of seconds, not '{seconds}'" in refused.stderr
    assert not (tmp_path / "sweep").exists()


# stands in for rate_sweep.sh beside a copy of parallel_sweeps.sh: `--check` is the real script's; a sweep notes how it
# was called and when each spec ran, fails for a model named no_such_model, and otherwise leaves the spec's folder
STAND_IN_RATE_SWEEP = r"""#!/usr/bin/env bash
set -euo pipefail
if [[ $1 == --check ]]; then exec bash "$REAL_RATE_SWEEP" "$@"; fi
size=$1 root=$2 left=$3
shift 3
for spec in "$@"; do
    IFS=: read -r rate models seeds <<< "$spec"
    echo "rate_sweep: $spec with $left s left"
    if [[ $models == *no_such_model* ]]; then echo "no such model" >&2; exit 1; fi
    started=$(date +%s.%N)
    sleep 1
    mkdir -p "$root/lr$rate"
    printf '{"size": "%s", "tokens": %s, "left": %s, "gpu": "%s", "started": %s, "ended": %s}' "$size" \
        "$STUDY_TOKENS" "$left" "${CUDA_VISIBLE_DEVICES:-}" "$started" "$(date +%s.%N)" > "$root/lr$rate/call.json"
done
"""


def test_parallel_sweeps_runs_its_streams_at_once_and_each_streams_sweeps_in_turn(tmp_path):
    """examples/reproduce/parallel_sweeps.sh (beside a stand-in for rate_sweep.sh, whose own test trains): the streams
    run at the same time and each stream's sweeps one after another, each given its tokens, root, seconds left and
    GPU; the output lines carry their stream's number, a failed stream fails the whole while the others finish, a
    sweep is not started with under a minute left, and a malformed stream is refused before anything runs."""
    scripts = tmp_path / "reproduce"
    scripts.mkdir()
    (scripts / "parallel_sweeps.sh").write_text((ROOT / "examples" / "reproduce" / "parallel_sweeps.sh").read_text())
    (scripts / "rate_sweep.sh").write_text(STAND_IN_RATE_SWEEP)
    env = {**os.environ, "REAL_RATE_SWEEP": str(ROOT / "examples" / "reproduce" / "rate_sweep.sh")}
    env.pop("CUDA_VISIBLE_DEVICES", None)

    def sweeps(*args):
        return subprocess.run(["bash", str(scripts / "parallel_sweeps.sh"), "toy", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    first, second = tmp_path / "first", tmp_path / "second"
    for bad, message in [(["600", f"256 {first} 1e-3:llama:1", f"@x 256 {second} 1e-3:llama:1"], "@N with N a number"),
                         (["600", f"256 {first} 1e-3:llama:1; {second} 1e-3:llama:1"], "a sweep is 'TOKENS ROOT"),
                         (["600", f"256 {first} 1e-3:llama"], "a spec is RATE:MODELS:SEEDS"),
                         (["ten", f"256 {first} 1e-3:llama:1"], "SECONDS is a whole number")]:
        refused = sweeps(*bad)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    assert not first.exists() and not second.exists()
    # the third stream fails (no such model): the exit status says so, and the other two still finish
    done = sweeps("600", f"@0 256 {first} 1e-3:llama:1", f"256 {second} 1e-3:llama:1; 384 {second} 2e-3:llama:1",
                  f"256 {first} 3e-3:no_such_model:1")
    assert done.returncode == 1, done.stderr[-2000:] + done.stdout[-2000:]
    assert "parallel_sweeps: stream 3 failed" in done.stderr and "stream 1 failed" not in done.stderr
    assert "stream 2 failed" not in done.stderr
    assert "[stream 1] on GPU 0" in done.stdout and "[stream 2] rate_sweep: 2e-3:llama:1 with" in done.stdout
    calls = [json.loads((folder / "call.json").read_text())
             for folder in (first / "lr1e-3", second / "lr1e-3", second / "lr2e-3")]
    assert [(c["size"], c["tokens"], c["gpu"]) for c in calls] == [("toy", 256, "0"), ("toy", 256, ""), ("toy", 384, "")]
    assert calls[0]["left"] >= 598 and calls[1]["left"] >= 598  # each stream's first sweep starts at once
    assert calls[2]["left"] < calls[1]["left"]  # the stream's second sweep gets what its first left
    one, two, three = calls
    assert one["started"] < two["ended"] and two["started"] < one["ended"]  # two streams at the same time
    assert three["started"] >= two["ended"]  # a stream's sweeps in turn
    late = sweeps("59", f"256 {first} 3e-3:llama:1")
    # the script counts its seconds from its own start, so a busy machine may already have taken one or two of them
    assert late.returncode == 0 and re.search(r"\[stream 1\] parallel_sweeps: 5[7-9] s left, not starting", late.stdout), \
        late.stdout
    assert not (first / "lr3e-3").exists()  # neither the failed stream's sweep nor the late one made a folder


def test_parallel_sweeps_refuses_two_streams_that_would_write_one_study_folder(tmp_path):
    """Two streams at once in one ROOT/lrRATE: each study.py would rewrite results.json with its own runs, losing the
    other's (or trip over its temporary files). Refused before anything runs, however ROOT is spelled; one ROOT at two
    rates in two streams, and one folder in a stream's sweeps in turn, still run."""
    scripts = tmp_path / "reproduce"
    scripts.mkdir()
    (scripts / "parallel_sweeps.sh").write_text((ROOT / "examples" / "reproduce" / "parallel_sweeps.sh").read_text())
    (scripts / "rate_sweep.sh").write_text(STAND_IN_RATE_SWEEP)
    env = {**os.environ, "REAL_RATE_SWEEP": str(ROOT / "examples" / "reproduce" / "rate_sweep.sh")}

    def sweeps(*streams):
        return subprocess.run(["bash", str(scripts / "parallel_sweeps.sh"), "toy", "600", *streams], env=env,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)

    for streams in [("256 sweep 1e-3:llama:1", "256 sweep 1e-3:pkv:1"),
                    ("256 sweep 1e-3:llama:1 2e-3:llama:1", "@0 384 ./sweep/ 2e-3:pkv:1"),
                    ("256 other 1e-3:llama:1; 256 sweep 1e-3:llama:1", f"256 {tmp_path / 'sweep'} 1e-3:pkv:1")]:
        refused = sweeps(*streams)
        assert refused.returncode == 2, refused.stderr
        assert "parallel_sweeps: streams 1 and 2 both write " in refused.stderr and "own ROOT" in refused.stderr
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "other").exists()
    done = sweeps("256 sweep 1e-3:llama:1; 256 sweep 1e-3:pkv:1", "256 sweep 2e-3:llama:1")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "sweep" / "lr1e-3").is_dir() and (tmp_path / "sweep" / "lr2e-3").is_dir()


def test_the_deadline_estimates_a_run_from_the_models_last_run_with_its_margin(tmp_path):
    """A model already run on this device is taken to need its last run's time, another the runs' median time per
    FLOP, each times (1 + --deadline-margin); with no run to go by there is no estimate (the run starts)."""
    last = {"llama": 500.0}
    per_flop = [1e-9, 3e-9, 2e-9]
    assert study.estimated_run_seconds("llama", 1e12, last, per_flop, 0.15) == pytest.approx(575.0)
    assert study.estimated_run_seconds("llama", 1e12, last, per_flop, 0.0) == pytest.approx(500.0)
    assert study.estimated_run_seconds("pkv", 1e11, last, per_flop, 0.1) == pytest.approx(220.0)
    assert study.estimated_run_seconds("pkv", 1e11, {}, [], 0.15) is None
    with pytest.raises(ValueError, match=r"--deadline-margin must be 0 or more .* got -0.1"):
        study.main(["--size", "toy", "--deadline-margin", "-0.1", "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()


def test_a_study_refuses_a_rate_below_its_recipes_final_rate_and_a_deadline_of_no_time(tmp_path):
    """--learning-rate 5e-6, below the 1e-5 the recipes' cosine decay ends at, trained on a rate that climbed from 5e-6
    to 1e-5 while the report gave 5e-6 as its peak; --deadline-minutes 0 was taken as no deadline at all."""
    for option, value, message in [("--learning-rate", "5e-6", r"--learning-rate must be at least 1e-05, the rate the "
                                     r"recipes' cosine decay ends at .*got 5e-06"),
                                    ("--deadline-minutes", "0", "--deadline-minutes must be a positive number of "
                                     "minutes, got 0.0"),
                                    ("--deadline-minutes", "-5", "--deadline-minutes must be a positive number")]:
        with pytest.raises(ValueError, match=message):
            study.main(["--size", "toy", option, value, "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()


def test_a_study_refused_for_its_models_or_data_makes_no_folder(tmp_path):
    with pytest.raises(ValueError, match=r"--models: \['no_such_model'\] not among \['llama'"):
        study.main(["--size", "toy", "--models", "llama,no_such_model", "--out", str(tmp_path / "refused")])
    with pytest.raises(ValueError, match="--data=.* has no meta.json: prepare it with examples/reproduce/prepare_data"):
        study.main(["--size", "toy", "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()


def test_a_models_list_that_names_no_model_is_refused(tmp_path):
    """`--models ","` (or an empty shell variable) planned no run: the study wrote a results.json of no runs, and
    learning_rates.py wrote empty tables, then failed at its plot with a bare StopIteration."""
    for models in ("", ",", " , "):
        with pytest.raises(ValueError, match=r"--models: .* names no model; name one or more of \['llama'"):
            study.main(["--size", "toy", "--models", models, "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
    first = write_study(tmp_path / "first", {"llama": [5.0, 5.1], "pkv": [5.3, 5.2]})
    second = write_study(tmp_path / "second", {"llama": [4.9, 5.2], "pkv": [5.4, 5.0]}, learning_rate=2e-3)
    for models in ("", ","):
        with pytest.raises(ValueError, match=r"--models: .* names no model; name one or more of \['llama', 'pkv'\]"):
            learning_rates.main(["--out", str(tmp_path / "refused"), "--studies", str(first), str(second),
                                 "--models", models])
    assert not (tmp_path / "refused").exists()


def test_a_study_refuses_two_sources_of_data_counts_below_one_and_options_it_would_ignore(tmp_path, capsys):
    """--data, --dataset and --text-files each name the data: given two, the study would train on one and drop the
    other without a word. --seeds, --tokens and --eval-tokens below one would plan one seed or the size's default."""
    with pytest.raises(SystemExit):
        study.main(["--size", "toy", "--data", str(tmp_path / "shards"), "--text-files", str(ROOT / "README.md"),
                    "--out", str(tmp_path / "refused")])
    assert "argument --text-files: not allowed with argument --data" in capsys.readouterr().err
    for option, value, message in [("--seeds", "0", "--seeds must be 1 or more, got 0"),
                                   ("--tokens", "0", "--tokens must be 1 or more training tokens per model, got 0.0"),
                                   ("--tokens", "-256", "--tokens must be 1 or more"),
                                   ("--eval-tokens", "0", "--eval-tokens must be 1 or more held-out tokens")]:
        with pytest.raises(ValueError, match=message):
            study.main(["--size", "toy", option, value, "--out", str(tmp_path / "refused")])
    # options that only another mode reads: --report rewrites a study's report from its own settings
    with pytest.raises(ValueError, match="--report takes only --out; --size, --seeds would change nothing"):
        study.main(["--report", "--size", "toy", "--seeds", "2", "--out", str(tmp_path / "refused")])
    for option in ("--dataset-config", "--text-column"):
        with pytest.raises(ValueError, match=f"{option} applies to --dataset only"):
            study.main(["--size", "toy", option, "x", "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()


def test_paired_difference_decides_the_verdict_from_three_seeds():
    runs = [{"model": m, "seed": s, "heldout_loss": loss} for m, s, loss in [
        ("a", 0, 4.0), ("a", 1, 4.2), ("a", 2, 4.1), ("b", 0, 4.05), ("b", 1, 4.26), ("b", 2, 4.14), ("b", 3, 9.0)]]
    seeds, delta, error = study.paired_difference(runs, "a", "b")
    assert seeds == 3 and delta == pytest.approx(0.05) and error == pytest.approx(0.01 / math.sqrt(3))
    summary = {m: {"heldout_loss_mean": mean, "heldout_loss_std": std}
               for m, mean, std in [("a", 4.1, 0.1), ("b", 5.3625, 2.4)]}
    # the means' spread (seed 3 of b) would call it noise; the paired seeds resolve it
    assert study.verdict(summary["a"], summary["b"])[1] == "same order, within seed noise"
    assert study.verdict(summary["a"], summary["b"], (seeds, delta, error))[1] == "reproduced"
    assert study.paired_difference(runs, "a", "c") == (0, None, None)


def test_equal_losses_are_a_tie_not_a_reversed_order():
    """Two models that end with equal losses on every seed (an ablation that changes nothing) were reported as
    "reversed, within seed noise", an order that does not hold either; a level claim stays level."""
    runs = [{"model": m, "seed": s, "heldout_loss": loss} for m in ("a", "b") for s, loss in enumerate([4.0, 4.2, 4.1])]
    paired = study.paired_difference(runs, "a", "b")
    assert paired == (3, 0.0, 0.0)
    summary = {"heldout_loss_mean": statistics.fmean([4.0, 4.2, 4.1]), "heldout_loss_std": 0.1}
    assert study.verdict(summary, dict(summary), paired) == (0.0, "tied, within seed noise")
    assert study.verdict(summary, dict(summary))[1] == "tied, within seed noise"  # (the means, under three seeds)
    assert study.verdict(summary, dict(summary), paired, level=True)[1] == "level, within seed noise"
    assert not study.verdict_is_resolved("tied, within seed noise")


def test_equal_losses_of_one_seed_are_a_tie_not_a_failed_ordering():
    """Two models of one seed each that end with equal losses were reported as "not reproduced (one seed)", an order
    that does not hold either: the verdict says tied, as it does over several seeds."""
    summary = {"heldout_loss_mean": 4.1, "heldout_loss_std": None}
    assert study.verdict(summary, dict(summary), (1, 0.0, None)) == (0.0, "tied (one seed)")
    assert study.verdict(summary, dict(summary), level=True)[1] == "undecided (one seed)"
    assert study.verdict(summary, {**summary, "heldout_loss_mean": 4.0})[1] == "not reproduced (one seed)"
    assert not study.verdict_is_resolved("tied (one seed)")


def test_a_level_claim_is_judged_by_whether_the_difference_is_resolved_either_way():
    """The paper calls SwiGLU and MH-FFN level (3.030 vs 3.031): the verdict says level within seed noise, or which
    model is ahead when the paired difference is resolved, whatever its sign; one seed decides nothing."""
    def claim(mh_ffn_losses):
        losses = {"llama": [5.00, 5.10, 5.05], "mh_ffn": mh_ffn_losses}
        runs = [{"model": m, "seed": s, "heldout_loss": loss} for m, v in losses.items() for s, loss in enumerate(v)]
        summary = {m: {"heldout_loss_mean": statistics.fmean(v), "heldout_loss_std": statistics.stdev(v)}
                   for m, v in losses.items()}
        (row,) = study.claims_table(summary, {"llama": "SwiGLU", "mh_ffn": "MH-FFN"}, runs)
        return row

    behind = claim([5.06, 5.17, 5.10])
    assert behind["claim"] == "SwiGLU level with MH-FFN" and behind["verdict"] == "not level: SwiGLU ahead"
    assert claim([4.94, 5.05, 4.98])["verdict"] == "not level: MH-FFN ahead"
    assert claim([5.01, 5.08, 5.07])["verdict"] == "level, within seed noise"
    # verdicts.py reads "resolved" from these texts
    assert study.verdict_is_resolved(behind["verdict"]) and not study.verdict_is_resolved("level, within seed noise")
    summary = {m: {"heldout_loss_mean": loss, "heldout_loss_std": None} for m, loss in [("a", 5.0), ("b", 5.3)]}
    assert study.verdict(summary["a"], summary["b"], level=True)[1] == "undecided (one seed)"
    assert study.verdict(summary["a"], summary["b"])[1] == "reproduced (one seed)"
    assert not study.verdict_is_resolved("reproduced (one seed)")
    # one seed of one model: its spread is unknown, so the other's does not resolve the difference either
    summary["b"]["heldout_loss_std"] = 0.01
    assert study.verdict(summary["a"], summary["b"])[1] == "reproduced (one seed)"
    assert study.verdict(summary["b"], summary["a"], level=True)[1] == "undecided (one seed)"


def test_a_run_that_diverged_gives_no_verdict_and_is_named():
    """A run whose held-out loss diverged to NaN or infinity counted as evidence: "not reproduced (one seed)",
    "reversed, within seed noise", or for a level claim "level, within seed noise". Its ordering now has no verdict,
    naming the run, and verdicts.py's cell says the same."""
    labels = {"llama": "SwiGLU", "flash_mhf": "FlashMHF", "mh_ffn": "MH-FFN", "memoryllm_total": "MemoryLLM",
              "flex_total": "Flex"}

    def claims(losses):
        runs = [{"model": m, "seed": s, "heldout_loss": loss} for m, v in losses.items() for s, loss in enumerate(v)]
        summary = {m: {"heldout_loss_mean": statistics.fmean(v), "heldout_loss_std": study.sample_stdev(v)}
                   for m, v in losses.items()}
        return study.claims_table(summary, labels, runs)

    (one_seed,) = claims({"flash_mhf": [5.0], "llama": [math.nan]})
    assert one_seed["verdict"] == "diverged: no verdict (SwiGLU seed 0)" and one_seed["diverged"] == ["SwiGLU seed 0"]
    (infinite,) = claims({"flash_mhf": [math.inf], "llama": [5.0]})
    assert infinite["verdict"] == "diverged: no verdict (FlashMHF seed 0)"
    (paired,) = claims({"flash_mhf": [5.0, 5.1, 5.05], "llama": [5.1, math.nan, 5.2]})
    assert paired["verdict"] == "diverged: no verdict (SwiGLU seed 1)" and paired["paired_seeds"] == 3
    (level,) = claims({"llama": [5.0, 5.1, 5.05], "mh_ffn": [5.0, math.nan, 5.1]})
    assert level["verdict"] == "diverged: no verdict (MH-FFN seed 1)"
    gap = claims({"llama": [5.0, 5.1], "memoryllm_total": [5.3, 5.4], "flex_total": [math.nan, 5.2]})[-1]
    assert gap["claim"].startswith("share of MemoryLLM's gap")
    assert gap["verdict"] == "diverged: no verdict (Flex seed 0)"
    for row in (one_seed, infinite, paired, level, gap):
        assert not study.verdict_is_resolved(row["verdict"])
    # a mean that is not finite with no run at hand names the model
    summary = {"flash_mhf": {"heldout_loss_mean": 5.0, "heldout_loss_std": None},
               "llama": {"heldout_loss_mean": math.nan, "heldout_loss_std": None}}
    assert study.claims_table(summary, labels)[0]["verdict"] == "diverged: no verdict (SwiGLU)"
    cell = {"verdict": paired["verdict"], "paired_delta": math.nan, "paired_standard_error": math.nan,
            "paired_seeds": 3, "delta": math.nan, "resolved": False}
    assert verdicts.cell_text(cell) == "diverged: no verdict (SwiGLU seed 1)"


def test_orderings_table_rounds_each_difference_once():
    """A paired difference of -0.00148 prints -0.001 in the orderings table, as in the table of paired differences:
    the claim keeps the value unrounded (rounded first to four places it would read -0.0015 and print -0.002)."""
    losses = {"kv_swiglu": [4.7480, 4.7660, 4.7390], "kvffn": [4.7430, 4.7780, 4.72755]}
    runs = [{"model": m, "seed": s, "heldout_loss": loss} for m, v in losses.items() for s, loss in enumerate(v)]
    summary = {m: {"heldout_loss_mean": statistics.fmean(v), "heldout_loss_std": statistics.stdev(v)}
               for m, v in losses.items()}
    (claim,) = study.claims_table(summary, {"kv_swiglu": "SwiGLU", "kvffn": "KV-FFN"}, runs)
    assert claim["paired_delta"] == pytest.approx(-0.0014833, abs=1e-7)
    (row,) = study.claims_rows([claim])[2:]
    assert "| -0.001 | -0.001 ± " in row


def test_orderings_report_the_out_of_domain_paired_difference_beside_the_verdict():
    """The verdict stays the held-out text's; the Wikipedia set's paired difference is reported beside it, over the
    seeds that measured it (a run without an out-of-domain loss is left out)."""
    rows = [("llama", 0, 5.00, 6.50), ("llama", 1, 5.10, 6.40), ("llama", 2, 5.05, 6.45), ("llama", 3, 5.2, None),
            ("flash_mhf", 0, 4.99, 6.40), ("flash_mhf", 1, 5.08, 6.32), ("flash_mhf", 2, 5.06, 6.33),
            ("flash_mhf", 3, 5.1, 6.0)]
    runs = [{"model": m, "seed": s, "heldout_loss": loss, **({} if wiki is None else {"wiki_loss": wiki})}
            for m, s, loss, wiki in rows]
    seeds, delta, error = study.paired_difference(runs, "flash_mhf", "llama", loss="wiki_loss")
    assert seeds == 3 and delta == pytest.approx(0.1) and error == pytest.approx(0.02 / math.sqrt(3))
    summary = {m: {"heldout_loss_mean": mean, "heldout_loss_std": 0.08} for m, mean in [("llama", 5.0875),
                                                                                          ("flash_mhf", 5.0575)]}
    (claim,) = study.claims_table(summary, {"llama": "SwiGLU", "flash_mhf": "FlashMHF"}, runs)
    assert claim["paired_seeds"] == 4 and claim["wiki_paired_seeds"] == 3
    assert claim["wiki_paired_delta"] == pytest.approx(0.1)
    assert claim["verdict"] == "same order, within seed noise"  # the held-out text's, not the Wikipedia set's


def write_study(folder: Path, losses: dict, learning_rate: float | None = None, tokens: int = 1000,
                size: str = "toy", baseline_parameters: int = 100) -> Path:
    """A study's results.json as study.py writes it, holding only what learning_rates.py and verdicts.py read."""
    folder.mkdir(parents=True)
    runs = [{"model": model, "seed": seed, "heldout_loss": loss, "device": "test device", "tokens_per_second": 1.0,
             "peak_memory_gib": 1.0, "train_seconds": 1.0, "wall_seconds": 1.0}
            for model, by_seed in losses.items() for seed, loss in enumerate(by_seed)]
    parameters = {model: {"total": baseline_parameters} for model in losses}
    study_state = {"size": size, "tokens": tokens, "eval_tokens": 512, "learning_rate": learning_rate, "runs": runs,
                   "parameters": parameters, "data": {"splits": {"train": {"sha256": "a"}, "heldout": {"sha256": "b"}}}}
    (folder / "results.json").write_text(json.dumps(study_state))
    return folder


def test_learning_rate_table_pairs_each_model_with_its_groups_baseline(tmp_path):
    recipe = write_study(tmp_path / "recipe", {"llama": [5.0, 5.1], "kv_swiglu": [5.5, 5.6], "kvffn": [5.6, 5.8],
                                               "memoryllm_total": [4.9, 5.0]})
    high = write_study(tmp_path / "high", {"llama": [4.7, 4.8], "kv_swiglu": [5.0, 5.2], "kvffn": [5.1, 5.2],
                                           "memoryllm_total": [4.6, 4.6]}, learning_rate=1e-3)
    report = learning_rates.main(["--out", str(tmp_path / "out"), "--studies", str(recipe), str(high)])
    models = report["models"]
    assert list(models) == ["llama", "memoryllm_total", "kv_swiglu", "kvffn"]
    # the KV-FFN group's recipe rate (3e-4) for the study without --learning-rate, the flash-mhf recipe's for the rest
    assert sorted(models["kvffn"]["rates"]) == ["1e-3", "3e-4"] and sorted(models["llama"]["rates"]) == ["1e-3", "3e-3"]
    assert models["kvffn"]["baseline"] == "kv_swiglu" and models["memoryllm_total"]["baseline"] == "llama"
    assert "baseline" not in models["kv_swiglu"] and "baseline" not in models["llama"]
    seeds, delta, _ = models["kvffn"]["vs_baseline_at_best"]
    assert seeds == 2 and delta == pytest.approx(0.05)
    assert models["kvffn"]["vs_baseline"]["3e-4"][1] == pytest.approx(0.15)
    markdown = (tmp_path / "out" / "learning_rates.md").read_text()
    row = "| KV-FFN | SwiGLU (KV-FFN block without biases) | +0.150 ± 0.050 (2) | +0.050 ± 0.050 (2) | - |"
    assert row in markdown


def test_learning_rate_report_checks_the_papers_orderings_with_each_model_at_its_best_rate(tmp_path):
    """study.py's orderings, each model's runs taken at its own best rate and paired by seed across the two rates; the
    row names both rates, in the JSON and the markdown."""
    recipe = write_study(tmp_path / "recipe", {"llama": [5.0, 5.1, 5.2], "flash_mhf": [4.9, 5.05, 5.1]})
    high = write_study(tmp_path / "high", {"llama": [4.7, 4.8, 4.9], "flash_mhf": [5.1, 5.1, 5.1]}, learning_rate=1e-3)
    report = learning_rates.main(["--out", str(tmp_path / "out"), "--studies", str(recipe), str(high)])
    (claim,) = report["claims_at_best_rates"]
    assert (claim["lower"], claim["higher"], claim["learning_rates"]) == ("flash_mhf", "llama", [3e-3, 1e-3])
    assert claim["paired_seeds"] == 3 and claim["paired_delta"] == pytest.approx(-0.65 / 3, abs=1e-4)
    assert claim["verdict"] == "not reproduced"  # FlashMHF at 3e-3 behind SwiGLU at 1e-3 on every seed
    markdown = (tmp_path / "out" / "learning_rates.md").read_text()
    labels = report["labels"]
    assert (f"| flash-mhf | {labels['flash_mhf']} < {labels['llama']} | 3.014 < 3.030 | 3e-3 / 1e-3 | -0.217 | "
            "-0.217 ± 0.017 (3) | not reproduced | - |") in markdown


def test_learning_rate_table_finds_each_best_rate_and_pairs_seeds_across_studies(tmp_path):
    recipe = write_study(tmp_path / "recipe", {"llama": [5.0, 5.2, 5.1], "pkv": [5.6, 5.9, 5.7], "kvffn": [4.0]})
    low = write_study(tmp_path / "low", {"llama": [4.8, 4.9, 4.7], "pkv": [4.85, 5.0, 4.8]}, learning_rate=1e-3)
    report = learning_rates.main(["--out", str(tmp_path / "out"), "--studies", str(recipe), str(low)])
    assert list(report["models"]) == ["llama", "pkv"]  # kvffn ran at one rate only
    pkv = report["models"]["pkv"]
    assert report["models"]["llama"]["best_learning_rate"] == pkv["best_learning_rate"] == 1e-3
    assert pkv["best_rate_edge"] == "lowest"  # of the two rates it ran: 1e-3 is bounded above only
    assert pkv["rates"]["3e-3"]["learning_rate"] == 3e-3  # the recipe's, for the study without --learning-rate
    seeds, delta, error = pkv["vs_baseline_at_best"]
    assert pkv["baseline"] == "llama" and "baseline" not in report["models"]["llama"]
    assert seeds == 3 and delta == pytest.approx(statistics.fmean([0.05, 0.1, 0.1]))
    assert error == pytest.approx(statistics.stdev([0.05, 0.1, 0.1]) / math.sqrt(3))
    markdown = (tmp_path / "out" / "learning_rates.md").read_text()
    assert "| model | lr 1e-3 | lr 3e-3 |" in markdown and "**4.800 ± 0.100 (3)**" in markdown
    assert ("Best rates not bounded on both sides (a rate beyond the ones run might do better): SwiGLU (transformers "
            "Llama) (1e-3, the lowest it ran); PKV d_h=32 (1e-3, the lowest it ran).") in markdown
    named = learning_rates.main(["--out", str(tmp_path / "named"), "--studies", str(recipe), str(low),
                                 "--models", "llama,kvffn"])  # kvffn ran at its recipe's rate alone
    assert named["models"]["kvffn"]["best_rate_edge"] == "only"
    assert "KV-FFN (3e-4, the only rate it ran)." in (tmp_path / "named" / "learning_rates.md").read_text()
    # the models left out of the tables are named, with their rates and why, never dropped silently
    assert report["left_out"] == {"kvffn": [3e-4]} and named["left_out"] == {"pkv": [1e-3, 3e-3]}
    assert ("Run in these studies but not tabulated (run at one rate only; --models names the models to tabulate): "
            "KV-FFN (3e-4).") in markdown
    assert ("Run in these studies but not tabulated (not named in --models): PKV d_h=32 (1e-3, 3e-3)."
            in (tmp_path / "named" / "learning_rates.md").read_text())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "learning_rates.json", "learning_rates.md", "learning_rates.png"]

    other = write_study(tmp_path / "other", {"llama": [4.0]}, learning_rate=2e-3, tokens=2000)
    with pytest.raises(ValueError, match="compare studies of one size, budget and data"):
        learning_rates.main(["--out", str(tmp_path / "out2"), "--studies", str(recipe), str(other)])
    with pytest.raises(ValueError, match=r"--studies: \['.*recipe'\] named more than once"):
        learning_rates.main(["--out", str(tmp_path / "out2"), "--studies", str(recipe), str(low), str(recipe)])
    assert not (tmp_path / "out2").exists()


def test_a_run_in_two_learning_rate_studies_is_kept_once_and_listed_as_a_repeat(tmp_path):
    """The same model, rate and seed in two studies (a recipe study and a --learning-rate study at the recipe's rate):
    the tables keep the run of the first study named and the report lists the other beside it, in the JSON and the
    markdown, with its rate; the table's seeds and means are those of the kept runs alone."""
    recipe = write_study(tmp_path / "recipe", {"llama": [5.0, 5.2], "memoryllm_active": [4.6, 4.7]})
    again = write_study(tmp_path / "again", {"llama": [4.8, 4.9], "memoryllm_active": [4.5, 4.72]},
                        learning_rate=3e-3)  # the flash-mhf recipe's rate: the recipe study's runs again
    lower = write_study(tmp_path / "lower", {"llama": [4.7, 4.8], "memoryllm_active": [4.4, 4.4]}, learning_rate=2e-3)
    report = learning_rates.main(["--out", str(tmp_path / "out"), "--studies", str(recipe), str(again), str(lower)])
    memory = report["models"]["memoryllm_active"]["rates"]["3e-3"]
    assert memory["seeds"] == [0, 1] and memory["heldout_loss_mean"] == pytest.approx(4.65)
    assert len(report["runs"]) == 8 and {r["study"] for r in report["runs"] if r["learning_rate"] == 3e-3} == \
        {str(recipe)}
    repeats = {(r["model"], r["seed"]): r for r in report["repeats"]}
    assert sorted(repeats) == [("llama", 0), ("llama", 1), ("memoryllm_active", 0), ("memoryllm_active", 1)]
    assert repeats[("memoryllm_active", 0)] == {
        "model": "memoryllm_active", "seed": 0, "learning_rate": 3e-3, "heldout_loss": 4.5, "device": "test device",
        "study": str(again), "kept_heldout_loss": 4.6, "kept_study": str(recipe)}
    markdown = (tmp_path / "out" / "learning_rates.md").read_text()
    assert "## Runs repeated with the same seed" in markdown and "in a later study of --studies" in markdown
    assert f"| MemoryLLM, equal active | 3e-3 | 0 | 4.600 | 4.500 | -0.100 | - | {again} |" in markdown
    assert "- 4 repeats both on test device: repeat - kept, mean ± sample standard deviation, held-out -0.145 ± 0.137" \
        in markdown
    assert markdown.endswith("\n") and not markdown.endswith("\n\n")


def _rate_plot_legend(tmp_path, monkeypatch, low_means: dict, high_means: dict) -> tuple[float, list[str]]:
    """The top of the learning-rate plot's loss axis and its legend, for two studies at 1e-3 and 3e-3."""
    figures = []
    monkeypatch.setattr(learning_rates, "save_figure", lambda figure, path, dpi: figures.append(figure))
    low = write_study(tmp_path / "low", low_means, learning_rate=1e-3)
    high = write_study(tmp_path / "high", high_means, learning_rate=3e-3)
    learning_rates.main(["--out", str(tmp_path / "out"), "--studies", str(low), str(high)])
    (axis,) = figures[-1].axes
    return axis.get_ylim()[1], [text.get_text() for text in axis.get_legend().get_texts()]


def test_learning_rate_plot_draws_a_diverged_mean_at_its_top_edge_with_its_value(tmp_path, monkeypatch):
    """A mean more than OFF_SCALE above the lowest (a run that diverged) would squeeze every other line into a sliver:
    the axis stops just above the highest loss on the scale, the mean is a triangle at that edge and its value is in
    the model's legend entry. With no such mean the axis is matplotlib's own."""
    pytest.importorskip("matplotlib")
    assert learning_rates.off_scale_cut([4.0, 4.2, 5.4]) is None
    assert learning_rates.off_scale_cut([4.0, 4.2, 6.8]) == pytest.approx(4.0 + learning_rates.OFF_SCALE)
    top, legend = _rate_plot_legend(tmp_path, monkeypatch, {"llama": [4.0, 4.1], "kvffn": [4.2, 4.3]},
                                    {"llama": [4.1, 4.2], "kvffn": [6.7, 6.9]})
    assert 4.3 < top < 4.4  # 4.3 plus a tenth of the on-scale spread (4.0-4.3)
    assert legend == ["SwiGLU (transformers Llama) (flash-mhf recipe)",
                      "KV-FFN (kv-ffn recipe); ▲ off scale, 3e-3: 6.80"]
    top, legend = _rate_plot_legend(tmp_path / "mild", monkeypatch, {"llama": [4.0, 4.1], "kvffn": [4.2, 4.3]},
                                    {"llama": [4.1, 4.2], "kvffn": [5.0, 5.2]})
    assert top > 5.2 and "off scale" not in " ".join(legend)


def test_learning_rate_plot_marks_a_mean_that_diverged_to_nan_off_scale(tmp_path, monkeypatch):
    """A NaN mean (a run that diverged to NaN) left the plot without a mark or a word in the legend, and where it came
    first it turned the off-scale cut off for every other mean: it is off the scale, at the top edge, "nan" in its
    model's legend entry."""
    pytest.importorskip("matplotlib")
    assert learning_rates.off_scale_cut([math.nan, 4.0, 6.8]) == pytest.approx(4.0 + learning_rates.OFF_SCALE)
    assert learning_rates.off_scale_cut([4.0, 4.2, math.nan]) == pytest.approx(4.0 + learning_rates.OFF_SCALE)
    assert learning_rates.off_scale_cut([math.nan]) is None
    top, legend = _rate_plot_legend(tmp_path, monkeypatch, {"llama": [math.nan, 4.1], "kvffn": [4.2, 4.3]},
                                    {"llama": [4.0, 4.2], "kvffn": [6.7, 6.9]})
    assert 4.3 < top < 4.4  # 4.3 plus a tenth of the on-scale spread (4.0-4.3)
    assert legend == ["SwiGLU (transformers Llama) (flash-mhf recipe); ▲ off scale, 1e-3: nan",
                      "KV-FFN (kv-ffn recipe); ▲ off scale, 3e-3: 6.80"]


def test_learning_rate_plot_keeps_a_long_title_inside_the_figure(tmp_path, monkeypatch):
    """A sweep of several passes has a title longer than the axes are wide (the 64M sweep's: size, tokens, passes,
    stream and device, beside a legend widened by off-scale entries); laid out as save_figure lays it out, every line
    of it stays inside the figure."""
    pytest.importorskip("matplotlib")
    figures = []
    monkeypatch.setattr(learning_rates, "save_figure", lambda figure, path, dpi: figures.append(figure))
    sweep = ROOT / "examples" / "results" / "study_h200_base_64M_learning_rates"
    rates = ("lr6e-4", "lr1e-3", "lr2e-3", "lr3e-3")
    learning_rates.main(["--out", str(tmp_path / "out"), "--studies", *(str(sweep / rate) for rate in rates)])
    (figure,) = figures
    (axis,) = figure.axes
    assert "passes" in axis.get_title() and len(axis.get_title().splitlines()) == 2
    figure.tight_layout()
    figure.canvas.draw()
    title = axis.title.get_window_extent(figure.canvas.get_renderer())
    assert 0 <= title.x0 and title.x1 <= figure.bbox.x1 and title.y1 <= figure.bbox.y1


def test_a_best_rate_is_marked_where_no_rate_beyond_it_ran():
    assert learning_rates.rate_edge([1e-3, 2e-3, 3e-3], 2e-3) is None
    assert learning_rates.rate_edge([2e-3, 1e-3, 3e-3], 1e-3) == "lowest"
    assert learning_rates.rate_edge([1e-3, 3e-3], 3e-3) == "highest"
    assert learning_rates.rate_edge([1e-3], 1e-3) == "only"


def test_verdicts_put_each_sweeps_orderings_in_a_column_by_tokens_per_parameter(tmp_path):
    """One column per sweep, most tokens per parameter first; a cell is the sweep's paired difference at the best
    rates, bold where resolved, "-" where the sweep lacks the ordering; a bad --sweeps is refused, nothing written."""
    def sweep(name, size, parameters, losses_by_rate):
        studies = [write_study(tmp_path / f"{name}_{rate}", losses, learning_rate=rate, size=size,
                               baseline_parameters=parameters) for rate, losses in losses_by_rate.items()]
        learning_rates.main(["--out", str(tmp_path / name), "--studies", *map(str, studies)])
        return str(tmp_path / name)

    wide = sweep("wide", "toy", 1000, {1e-3: {"llama": [5.0, 5.1, 5.2], "flash_mhf": [5.01, 5.12, 5.2]},
                                       2e-3: {"llama": [5.3, 5.3, 5.3], "flash_mhf": [5.3, 5.3, 5.3]},
                                       5e-4: {"llama": [5.4, 5.4, 5.4], "flash_mhf": [5.4, 5.4, 5.4]}})
    narrow = sweep("narrow", "cpu", 100, {1e-3: {"llama": [5.0, 5.1, 5.2], "flash_mhf": [5.1, 5.2, 5.31],
                                                 "kv_swiglu": [5.0, 5.02], "kvffn": [5.1, 5.12]},
                                          2e-3: {"llama": [5.3, 5.3, 5.3], "flash_mhf": [5.3, 5.3, 5.3],
                                                 "kv_swiglu": [5.3, 5.3], "kvffn": [5.3, 5.3]}})
    report = verdicts.main(["--out", str(tmp_path / "out"), "--sweeps", wide, narrow])
    assert [s["size"] for s in report["sweeps"]] == ["cpu", "toy"]  # 10 tokens per parameter, then 1
    assert [s["tokens_per_parameter"] for s in report["sweeps"]] == [10.0, 1.0]
    first, kv = report["rows"]
    assert (first["lower"], first["higher"]) == ("flash_mhf", "llama")
    assert first["cells"]["cpu"]["resolved"] and not first["cells"]["toy"]["resolved"]
    markdown = (tmp_path / "out" / "verdicts.md").read_text()
    assert "| `cpu`, 10 tokens/param | `toy`, 1 tokens/param |" in markdown
    assert "| 3.014 < 3.030 | **-0.103 ± 0.003 (3)** | -0.010 ± 0.006 (3) |" in markdown
    assert "| 4.927 < 5.161 | **+0.100 ± 0.000 (2)** | - |" in markdown and kv["cells"]["cpu"]["paired_seeds"] == 2
    # the best rates behind each cell, marked where the sweep ran no rate below (or above) them
    assert "| 1e-3 (lowest) / 1e-3 (lowest) | 1e-3 / 1e-3 |" in markdown
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["verdicts.json", "verdicts.md", "verdicts.png"]
    with pytest.raises(ValueError, match="--sweeps: one sweep per size, budget and training stream"):
        verdicts.main(["--out", str(tmp_path / "out2"), "--sweeps", wide, wide])
    with pytest.raises(ValueError, match="--sweeps: .* holds no sweep"):
        verdicts.main(["--out", str(tmp_path / "out2"), "--sweeps", str(tmp_path / "wide_0.001")])
    assert not (tmp_path / "out2").exists()


def test_verdicts_of_one_size_at_several_budgets_name_each_column_by_its_budget(tmp_path):
    """Sweeps of one size trained on different numbers of tokens: a column each, named by size and budget, most tokens
    first; a budget longer than the training stream says how many passes it made; --shared-orderings-only keeps the
    orderings that every sweep holds."""
    def sweep(name, tokens, losses):
        studies = []
        for rate, by_model in losses.items():
            folder = write_study(tmp_path / f"{name}_{rate}", by_model, learning_rate=rate, tokens=tokens, size="toy",
                                 baseline_parameters=1000)
            state = json.loads((folder / "results.json").read_text())
            state["data"]["splits"]["train"]["tokens"] = 2000  # the training stream: 2,000 tokens
            (folder / "results.json").write_text(json.dumps(state))
            studies.append(str(folder))
        learning_rates.main(["--out", str(tmp_path / name), "--studies", *studies])
        return str(tmp_path / name)

    short = sweep("short", 1000, {1e-3: {"llama": [5.2, 5.3, 5.4], "flash_mhf": [5.1, 5.2, 5.3],
                                         "kv_swiglu": [5.0, 5.0], "kvffn": [5.1, 5.1]},
                                  2e-3: {"llama": [5.5, 5.5, 5.5], "flash_mhf": [5.5, 5.5, 5.5],
                                         "kv_swiglu": [5.5, 5.5], "kvffn": [5.5, 5.5]}})
    long = sweep("long", 4000, {1e-3: {"llama": [4.0, 4.1, 4.2], "flash_mhf": [4.2, 4.3, 4.4]},
                                2e-3: {"llama": [4.5, 4.5, 4.5], "flash_mhf": [4.5, 4.5, 4.5]}})
    report = verdicts.main(["--out", str(tmp_path / "out"), "--sweeps", short, long, "--shared-orderings-only"])
    assert [s["column"] for s in report["sweeps"]] == ["toy 4k", "toy 1k"]
    assert [s["passes"] for s in report["sweeps"]] == [2.0, 0.5]
    (row,) = report["rows"]  # the KV-FFN ordering is in the short sweep alone
    assert (row["lower"], row["higher"]) == ("flash_mhf", "llama")
    assert row["cells"]["toy 4k"]["paired_delta"] == pytest.approx(-0.2)
    assert row["cells"]["toy 1k"]["paired_delta"] == pytest.approx(0.1)
    markdown = (tmp_path / "out" / "verdicts.md").read_text()
    assert markdown.startswith("# The papers' orderings across training budgets, each model at its best learning rate")
    assert "| `toy 4k`, 4 tokens/param | `toy 1k`, 1 tokens/param |" in markdown
    assert "4,000 tokens, 2 passes over the training stream)" in markdown and "1,000 tokens)" in markdown
    # each sweep's own table says so too, of the longer budget only
    assert "4,000 training tokens per model (2 passes over a training stream of 2,000 tokens), held-out" in \
        (tmp_path / "long" / "learning_rates.md").read_text()
    assert "1,000 training tokens per model, held-out" in (tmp_path / "short" / "learning_rates.md").read_text()
    everything = verdicts.main(["--out", str(tmp_path / "all"), "--sweeps", short, long])
    assert len(everything["rows"]) == 2 and "toy 4k" not in everything["rows"][1]["cells"]


def test_verdicts_of_one_size_at_budgets_that_print_alike_keep_a_column_each(tmp_path):
    """15.99M and 16M tokens both print as "16M": named so, the two sweeps shared one column and the later one's
    cell replaced the earlier one's. Each is named by its exact number of tokens instead."""
    def sweep(name, tokens, flash_mhf):
        studies = [str(write_study(tmp_path / f"{name}_{rate}", by_model, learning_rate=rate, tokens=tokens,
                                   baseline_parameters=1000))
                   for rate, by_model in {1e-3: {"llama": [5.0, 5.1, 5.2], "flash_mhf": flash_mhf},
                                          2e-3: {"llama": [6.0] * 3, "flash_mhf": [6.0] * 3}}.items()]
        learning_rates.main(["--out", str(tmp_path / name), "--studies", *studies])
        return str(tmp_path / name)

    one_pass = sweep("one_pass", 15_990_000, [5.5, 5.6, 5.7])
    rounded = sweep("rounded", 16_000_000, [4.5, 4.6, 4.7])
    other = sweep("other", 32_000_000, [5.0, 5.1, 5.2])
    report = verdicts.main(["--out", str(tmp_path / "out"), "--sweeps", one_pass, rounded, other])
    assert [s["column"] for s in report["sweeps"]] == ["toy 32M", "toy 16,000,000", "toy 15,990,000"]
    (row,) = report["rows"]
    assert {column: round(cell["paired_delta"], 3) for column, cell in row["cells"].items()} == {
        "toy 32M": 0.0, "toy 16,000,000": 0.5, "toy 15,990,000": -0.5}
    # the table of sizes by budgets heads its columns so too
    sweeps = [{"size": size, "parameters": parameters, "stream": None, "tokens": tokens, "column": f"{size} {tokens}"}
              for size, parameters, tokens in (("toy", 1e6, 15_990_000), ("toy", 1e6, 16_000_000),
                                               ("small", 2e6, 16_000_000))]
    assert verdicts.grid(sweeps, {"claim": "x", "cells": {}})[0] == "| x | 15,990,000 tokens | 16,000,000 tokens |"


def test_verdicts_of_several_sizes_at_several_budgets_add_a_table_of_sizes_by_budgets(tmp_path):
    """Two sizes, one at two budgets and one at a single budget: every sweep a column of the main table, and a second
    table per ordering with a line per size (fewest parameters first) and a column per budget, "-" where that size
    did not train on that budget."""
    def sweep(name, size, parameters, tokens, flash_mhf):
        folder = write_study(tmp_path / f"{name}_lr", {"llama": [5.0, 5.0, 5.0], "flash_mhf": flash_mhf},
                             learning_rate=1e-3, tokens=tokens, size=size, baseline_parameters=parameters)
        learning_rates.main(["--out", str(tmp_path / name), "--studies", str(folder),
                             "--models", "llama,flash_mhf"])
        return str(tmp_path / name)

    sweeps = [sweep("base_short", "base", 4_000_000, 1_000_000, [4.9, 4.8, 4.9]),
              sweep("small_short", "small", 1_000_000, 1_000_000, [4.95, 4.9, 4.95]),
              sweep("small_long", "small", 1_000_000, 2_000_000, [5.1, 5.2, 5.1])]
    report = verdicts.main(["--out", str(tmp_path / "out"), "--sweeps", *sweeps])
    assert [s["column"] for s in report["sweeps"]] == ["small 2M", "small 1M", "base"]
    markdown = (tmp_path / "out" / "verdicts.md").read_text()
    assert markdown.startswith("# The papers' orderings across sizes and training budgets")
    start = markdown.index("| FlashMHF d_h=128 < SwiGLU (transformers Llama) | 1M tokens | 2M tokens |")
    table = markdown[start:].split("\n\n")[0].splitlines()
    assert table[2] == "| `small`, 1.0M parameters | **+0.067 ± 0.017 (3)** | **-0.133 ± 0.033 (3)** |"
    assert table[3] == "| `base`, 4.0M parameters | **+0.133 ± 0.033 (3)** | - |"
    # one size at several budgets, or several sizes at one budget each: no second table
    for alone in ([sweeps[1], sweeps[2]], [sweeps[0], sweeps[1]]):
        assert "1M tokens |" not in verdicts.markdown(*_sweeps_and_rows(alone))


def test_verdicts_of_one_size_on_several_training_streams_name_each_stream(tmp_path):
    """Sweeps of one size and budget that read training streams of different lengths (the shorter one repeated more
    often): a column each, named by its stream too, the longer stream first among equal tokens per parameter, and a
    line per stream in the table by budgets; two sweeps of one size, budget and stream are refused."""
    def sweep(name, tokens, stream, flash_mhf):
        folder = write_study(tmp_path / f"{name}_lr", {"llama": [5.0, 5.0, 5.0], "flash_mhf": flash_mhf},
                             learning_rate=1e-3, tokens=tokens, size="toy", baseline_parameters=1_000_000)
        state = json.loads((folder / "results.json").read_text())
        state["data"]["splits"]["train"] = {"tokens": stream, "sha256": f"the first {stream} tokens"}
        (folder / "results.json").write_text(json.dumps(state))
        learning_rates.main(["--out", str(tmp_path / name), "--studies", str(folder), "--models", "llama,flash_mhf"])
        return str(tmp_path / name)

    once = sweep("once", 2_000_000, 2_000_000, [4.9, 4.8, 4.9])
    twice = sweep("twice", 2_000_000, 1_000_000, [4.95, 4.9, 4.95])
    longer = sweep("longer", 4_000_000, 2_000_000, [5.1, 5.2, 5.1])
    report = verdicts.main(["--out", str(tmp_path / "out"), "--sweeps", twice, longer, once])
    assert [s["column"] for s in report["sweeps"]] == ["toy 4M, 2M stream", "toy 2M, 2M stream", "toy 2M, 1M stream"]
    markdown = (tmp_path / "out" / "verdicts.md").read_text()
    assert markdown.startswith("# The papers' orderings across training budgets and training streams")
    assert "15,990,000" not in markdown and "2,000,000 tokens, 2 passes over the training stream)" in markdown
    start = markdown.index("| FlashMHF d_h=32 < SwiGLU (transformers Llama) | 2M tokens | 4M tokens |")
    table = markdown[start:].split("\n\n")[0].splitlines()
    assert table[2:] == ["| `toy`, 1.0M parameters, a training stream of 2M tokens | **+0.133 ± 0.033 (3)** "
                         "| **-0.133 ± 0.033 (3)** |",
                         "| `toy`, 1.0M parameters, a training stream of 1M tokens | **+0.067 ± 0.017 (3)** | - |"]
    twice_table = (tmp_path / "twice" / "learning_rates.md").read_text()
    assert "(2 passes over a training stream of 1,000,000 tokens)" in twice_table
    with pytest.raises(ValueError, match="one sweep per size, budget and training stream; .*toy at 2,000,000 tokens of "
                                         "a 1,000,000-token stream"):
        verdicts.main(["--out", str(tmp_path / "out2"), "--sweeps", twice, twice])
    assert not (tmp_path / "out2").exists()


def _sweeps_and_rows(folders: list[str]) -> tuple[list[dict], list[dict]]:
    sweeps = [verdicts.read_sweep(Path(folder)) for folder in folders]
    verdicts.name_columns(sweeps)
    return sweeps, verdicts.rows_of(sweeps)


def _rebuild_committed_verdicts(folder: str, tmp_path, monkeypatch, *options) -> tuple[dict, str]:
    """Rebuilds examples/results/`folder` from the sweeps its verdicts.json names, in tmp_path, checks that its
    verdicts.md comes out as committed, and returns verdicts.py's report and that text."""
    committed = ROOT / "examples" / "results" / folder
    sweeps = [s["path"] for s in json.loads((committed / "verdicts.json").read_text())["sweeps"]]
    monkeypatch.chdir(ROOT)  # (the sweeps name their studies relative to the checkout)
    report = verdicts.main(["--out", str(tmp_path), "--sweeps", *sweeps, *options])
    rebuilt = (tmp_path / "verdicts.md").read_text()
    assert rebuilt == (committed / "verdicts.md").read_text()
    return report, rebuilt


def test_readmes_verdict_table_is_the_committed_verdicts_table(tmp_path, monkeypatch):
    """examples/results/verdicts/ rebuilds from the committed sweeps it names, and the README's table "The verdicts"
    holds its cells, row by row (the README adds a verdict in words)."""
    report, rebuilt = _rebuild_committed_verdicts("verdicts", tmp_path, monkeypatch)
    sweeps = report["sweeps"]

    def table_cells(text, header_start, first_cell_column):
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
        rows = []
        for line in lines[start + 2:]:
            if not line.startswith("|"):
                break
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows.append(cells[first_cell_column:first_cell_column + len(sweeps)])
        return rows

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert table_cells(readme, "| paper's ordering (paper's numbers) |", 1) == \
        table_cells(rebuilt, "| paper's ordering | paper |", 2)


def test_readmes_budget_tables_are_the_committed_budget_sweeps(tmp_path, monkeypatch):
    """examples/results/verdicts_budgets/ rebuilds from the sweeps it names; the README's table under "Three sizes,
    four budgets" is its table of sizes by budgets, and the one under "One size, four budgets" holds the numbers of
    `base`'s sweeps at its four budgets: each model's mean loss at each rate, and the verdict rows' cells."""
    report, rebuilt = _rebuild_committed_verdicts("verdicts_budgets", tmp_path, monkeypatch, "--shared-orderings-only")

    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    header = ("| FlashMHF < SwiGLU, each at its best rate, paired (seeds) | 4M tokens | 8M tokens | 12M tokens "
              "| 16M tokens | 32M tokens | 64M tokens | 128M tokens |")
    start = readme.index(header)
    grid = rebuilt.split("\n\n| FlashMHF d_h=128 < SwiGLU (transformers Llama) | 4M tokens |")[1].split("\n\n")[0]
    assert readme[start + 2:start + 5] == grid.splitlines()[2:] and readme[start + 5] == ""

    start = next(i for i, line in enumerate(readme) if line.startswith("| held-out loss, 3 seeds | 4M: lr"))
    table = {cells[0]: cells[1:] for cells in
             ([c.strip() for c in line.strip("|").split("|")] for line in readme[start + 2:start + 6])}
    # the README's columns: 4M, 8M, 16M, 32M (base's 12M sweep is in the table above)
    budgets = [cell.split(":")[0].strip() for cell in readme[start].strip("|").split("|")[1:]]
    assert budgets == ["4M", "8M", "16M", "32M"]
    by_budget = sorted((s for s in report["sweeps"]
                        if s["size"] == "base" and study.fmt_tokens(s["tokens"]) in budgets), key=lambda s: s["tokens"])
    rates = [cell.split(": ")[-1].replace("lr ", "").split(" / ") for cell in readme[start].strip("|").split("|")[1:]]
    for row, key in (("SwiGLU", "llama"), ("FlashMHF d_h=128", "flash_mhf")):
        for sweep, rates_of_column, cell in zip(by_budget, rates, table[row]):
            models = json.loads((Path(sweep["path"]) / "learning_rates.json").read_text())["models"][key]
            means = [f"{models['rates'][rate.strip()]['heldout_loss_mean']:.3f}" for rate in rates_of_column]
            best = learning_rates.rate_text(models["best_learning_rate"])
            written = [m.replace("**", "") for m in cell.split(" / ")]
            assert written == means, (row, sweep["column"])
            assert [m.startswith("**") for m in cell.split(" / ")] == [r.strip() == best for r in rates_of_column]
    (row,) = report["rows"]
    cells = [verdicts.cell_text(row["cells"][s["column"]]) for s in by_budget]
    assert table["FlashMHF < SwiGLU, each at its best rate"] == [re.sub(r" \(\d+\)", "", c) for c in cells]
    wiki = []  # out of domain, the same runs paired the same way; bold where more than twice its standard error
    for sweep in by_budget:
        (claim,) = [c for c in json.loads((Path(sweep["path"]) / "learning_rates.json").read_text())
                    ["claims_at_best_rates"] if (c.get("lower"), c.get("higher")) == ("flash_mhf", "llama")]
        delta, error = claim["wiki_paired_delta"], claim["wiki_paired_standard_error"]
        text = f"{delta:+.3f} ± {error:.3f}"
        wiki.append(f"**{text}**" if abs(delta) > 2 * error else text)
    assert table["the same on Wikipedia (out of domain)"] == wiki


def test_readmes_passes_table_is_the_committed_sweeps(tmp_path, monkeypatch):
    """examples/results/verdicts_memoryllm_passes/ rebuilds from the sweeps it names (`narrow` on 16M, 32M and 64M
    tokens of the whole corpus, and on 16M of its first 8M and 4M tokens); under "Repeated text or more tokens?" the
    README's table is its table of training streams by budgets."""
    report, rebuilt = _rebuild_committed_verdicts("verdicts_memoryllm_passes", tmp_path, monkeypatch,
                                                  "--shared-orderings-only")
    assert sorted((s["tokens"], s["stream"]) for s in report["sweeps"]) == \
        [(15_990_000, 4_000_000), (15_990_000, 8_000_000), (15_990_000, 16_000_000), (32_000_000, 16_000_000),
         (64_000_000, 16_000_000)]
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = readme.index("| SwiGLU < MemoryLLM, equal total, each at its best rate, paired (seeds) | 16M tokens "
                         "| 32M tokens | 64M tokens |")
    lines = rebuilt.splitlines()
    grid = lines.index("| SwiGLU (transformers Llama) < MemoryLLM, equal total | 16M tokens | 32M tokens "
                       "| 64M tokens |")
    assert readme[start + 1:start + 5] == lines[grid + 1:grid + 5] and lines[grid + 5] == readme[start + 5] == ""


def test_readmes_memoryllm_budget_tables_are_the_committed_sweeps(tmp_path, monkeypatch):
    """examples/results/verdicts_memoryllm_budgets/ rebuilds from the sweeps it names; under "The memory models on more
    tokens per parameter" the README's first table is its table of sizes by budgets, and the next three hold each
    model's mean loss at its best rate, that rate and its number of seeds in the sweeps of `narrow`, `small` and
    `base`."""
    report, rebuilt = _rebuild_committed_verdicts("verdicts_memoryllm_budgets", tmp_path, monkeypatch,
                                                  "--shared-orderings-only")

    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(readme)
                 if line.startswith("| SwiGLU < MemoryLLM, equal total, each at its best rate, paired (seeds) |"))
    lines = rebuilt.splitlines()
    grid = lines.index(next(line for line in lines
                            if line.startswith("| SwiGLU (transformers Llama) < MemoryLLM, equal total | 4M tokens |")))
    assert readme[start].split("|")[2:] == lines[grid].split("|")[2:]
    assert readme[start + 2:start + 6] == lines[grid + 2:grid + 6] and lines[grid + 6] == readme[start + 6] == ""

    rows = {"SwiGLU": "llama", "MemoryLLM, equal total": "memoryllm_total",
            "FlexMemoryLLM beta=3, equal total": "flex_total"}
    for size in ("narrow", "small", "base"):
        start = next(i for i, line in enumerate(readme)
                     if line.startswith(f"| `{size}`, held-out loss at each model's best"))
        sweeps = sorted((s for s in report["sweeps"] if s["size"] == size), key=lambda s: s["tokens"])
        assert [c.strip() for c in readme[start].strip("|").split("|")[1:]] == \
            [f"{round(s['tokens'] / 1e6)}M tokens" for s in sweeps]
        for line in readme[start + 2:start + 2 + len(rows)]:
            label, *cells = [c.strip() for c in line.strip("|").split("|")]
            expected = []
            for sweep in sweeps:
                model = json.loads((Path(sweep["path"]) / "learning_rates.json").read_text())["models"][rows[label]]
                best = learning_rates.rate_text(model["best_learning_rate"])
                at_best = model["rates"][best]
                expected.append(f"{at_best['heldout_loss_mean']:.3f} ({best}, {len(at_best['seeds'])})")
            assert cells == expected, (size, label)
        assert readme[start + 2 + len(rows)] == ""


def test_paired_differences_between_models_at_rates_of_their_own(capsys):
    """paired.py pairs two models' runs seed by seed, each at its own rate (the numbers README and the notes quote
    beside the report tables), and refuses a model or rate the studies did not run, naming the ones they did."""
    results = ROOT / "examples" / "results"
    studies = [str(results / "study_h200_base_64M_learning_rates" / rate) for rate in ("lr1e-3", "lr2e-3", "lr6e-4")]
    rows = paired.main(["--studies", *studies, "--pair", "flash_mhf_double_head_dim@1e-3", "mh_ffn@2e-3"])
    seeds, mean, error = rows[0]["heldout"]
    assert (seeds, round(mean, 3), round(error, 3)) == (5, -0.043, 0.007)
    assert "flash_mhf_double_head_dim@1e-3 - mh_ffn@2e-3: held-out -0.043 ± 0.007 (5)" in capsys.readouterr().out
    # one seed at 1e-3 (FlashMHF d_h=64 on 128M tokens, whose best rate is bounded): the difference alone, no error
    sweep_128m = results / "study_h200_base_128M_learning_rates"
    (row,) = paired.main(["--studies", str(sweep_128m / "lr1e-3"), str(sweep_128m / "lr2e-3"),
                          "--pair", "flash_mhf_half_head_dim@1e-3", "flash_mhf_half_head_dim@2e-3"])
    assert row["heldout"][0] == 1 and row["heldout"][2] is None and round(row["heldout"][1], 3) == 0.026
    with pytest.raises(ValueError, match=r"--pair: \['flex_total@6e-4'\] not run in these studies; they ran"):
        paired.main(["--studies", *studies, "--pair", "flex_total@6e-4", "llama@1e-3"])


def test_heldout_overlap_counts_repeated_lines_windows_and_documents(tmp_path, capsys):
    """`heldout_overlap.py`: held-out lines (long ones), windows of consecutive lines and documents found verbatim in
    the training documents; the command reads a prepared data folder and writes the JSON and the table. Its counts
    are those of the texts: decoded from the shards, a document's first line starts with the space the tokenizer adds,
    so the poem that opens a training document was found in the held-out text one line and one window short."""
    import heldout_overlap

    poem = "\n".join(f"line {i} of a poem that an anthology prints again" for i in range(6))
    train = [poem, "something else entirely\nand more of it\nthird\nfourth"]
    heldout = ["a new opening line\n" + poem, "never seen anywhere before this\nshort\nalso new\nand new"]
    result = heldout_overlap.overlap(train, heldout, min_chars=20, window=4)
    assert (result["long_lines"], result["long_lines_in_train"]) == (7, 6)
    assert (result["windows"], result["windows_in_train"]) == (4 + 1, 3)
    assert result["documents_with_a_window_in_train"] == 1
    assert heldout_overlap.documents(np.array([5, 6, 2, 7, 2, 8]), 2) == [[5, 6], [7], [8]]

    from hf_memffn.testing import tiny_tokenizer
    from token_shards import write_meta, write_split

    tokenizer = tiny_tokenizer()
    data = tmp_path / "data"
    data.mkdir()
    tokenizer.save_pretrained(data)
    eos = tokenizer.eos_token_id
    for split, texts in (("train", train), ("heldout", heldout)):
        write_split(data, split, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], eos)
    write_meta(data, {"tokenizer": {"eos_id": eos}, "splits": {"train": {"sha256": "a"}, "heldout": {"sha256": "b"}}})
    assert heldout_overlap.main(["--data", str(data), "--out", str(tmp_path / "out"), "--min-chars", "20"]) == 0
    written = json.loads((tmp_path / "out" / "overlap.json").read_text())
    assert written["documents_with_a_window_in_train"] == 1 and written["heldout_documents"] == 2
    assert {key: written[key] for key in result} == result
    assert "| windows of 4 consecutive lines |" in (tmp_path / "out" / "overlap.md").read_text()


def test_heldout_overlap_refuses_a_window_of_no_lines(tmp_path):
    """--window 0 counted every held-out document as found in training (its empty window is in every document)."""
    import heldout_overlap

    for option, value in (("--window", "0"), ("--window", "-1"), ("--min-chars", "-1")):
        with pytest.raises(ValueError, match=f"{option} must be"):
            heldout_overlap.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), option, value])
    assert not (tmp_path / "out").exists()


def test_a_run_whose_loss_diverged_to_nan_is_summarised_and_never_the_best_rate(tmp_path):
    """A run at too high a rate can end with a NaN held-out loss: the study's summary and the rate table take it (a
    NaN mean and spread, where `statistics.stdev` raised), and the best rate is one whose runs all ended finite."""
    runs = [{"model": "llama", "seed": seed, "heldout_loss": loss, "tokens_per_second": 1.0, "peak_memory_gib": None,
             "train_seconds": 1.0, "wall_seconds": 1.0} for seed, loss in enumerate([5.0, math.nan])]
    summary = study.aggregate(runs)["llama"]
    assert math.isnan(summary["heldout_loss_mean"]) and math.isnan(summary["heldout_loss_std"])
    assert study.sample_stdev([1.0]) is None and study.sample_stdev([1.0, 3.0]) == pytest.approx(math.sqrt(2))
    recipe = write_study(tmp_path / "recipe", {"llama": [5.0, 5.2], "pkv": [5.6, 5.9]})
    high = write_study(tmp_path / "high", {"llama": [math.nan, 4.0], "pkv": [4.5, 4.6]}, learning_rate=3e-2)
    report = learning_rates.main(["--out", str(tmp_path / "out"), "--studies", str(high), str(recipe)])
    assert report["models"]["llama"]["best_learning_rate"] != 3e-2
    assert report["models"]["pkv"]["best_learning_rate"] == 3e-2
    seeds, delta, error = report["models"]["pkv"]["vs_baseline_at_best"]
    assert seeds == 2 and math.isfinite(delta)


def test_a_model_that_diverged_at_every_rate_has_no_best_rate(tmp_path, monkeypatch):
    """Every rate of SwiGLU had a run that diverged: the report named one of them its best rate (bold in the table,
    its runs behind the orderings' verdicts); it names none, says so, and the orderings with it give no verdict."""
    monkeypatch.setattr(learning_rates, "plot", lambda *args: False)
    monkeypatch.setattr(verdicts, "plot", lambda *args: False)
    recipe = write_study(tmp_path / "recipe", {"llama": [math.nan, 5.0], "flash_mhf": [5.6, 5.9]})
    high = write_study(tmp_path / "high", {"llama": [math.nan, math.inf], "flash_mhf": [4.5, 4.6]}, learning_rate=3e-2)
    report = learning_rates.main(["--out", str(tmp_path / "rates"), "--studies", str(high), str(recipe)])
    llama = report["models"]["llama"]
    assert llama["best_learning_rate"] is None and llama["best_rate_edge"] is None
    assert report["models"]["flash_mhf"]["vs_baseline_at_best"] == (0, None, None)
    (claim,) = report["claims_at_best_rates"]
    assert claim["verdict"] == "diverged: no verdict (SwiGLU (transformers Llama) at every rate it ran)"
    assert claim["learning_rates"] == [3e-2, None]
    markdown = (tmp_path / "rates" / "learning_rates.md").read_text()
    assert "**" not in markdown.split("| SwiGLU (transformers Llama) |")[1].split("\n")[0]
    assert "No best rate (a run diverged at every rate the model ran): SwiGLU (transformers Llama)." in markdown
    assert "(lr 3e-2 against none: every rate diverged)" in markdown
    assert "| 3e-2 / none: every rate diverged |" in markdown
    assert json.loads((tmp_path / "rates" / "learning_rates.json").read_text())["models"]["llama"][
        "best_learning_rate"] is None
    verdicts.main(["--out", str(tmp_path / "verdicts"), "--sweeps", str(tmp_path / "rates")])
    assert "| 3e-2 (highest) / none: every rate diverged |" in (tmp_path / "verdicts" / "verdicts.md").read_text()


def test_a_loss_that_diverged_to_infinity_reads_back_as_infinity(tmp_path, monkeypatch):
    """results.json wrote a loss of infinity as null, which --report and learning_rates.py read back as NaN: it is
    null named "Infinity" under `not_finite` there (JSON has no infinity), read back as infinity; NaN is named "NaN"."""
    monkeypatch.setattr(study, "plot_curves", lambda state, path: False)
    monkeypatch.setattr(learning_rates, "plot", lambda *args: False)
    low = tmp_path / "low"
    low.mkdir()
    study.write_outputs(study_state(1e-3, {"llama": [5.0, 5.1], "flash_mhf": [math.inf, math.nan]}), low)
    written = json.loads((low / "results.json").read_text(), parse_constant=lambda constant: pytest.fail(constant))
    assert [run["heldout_loss"] for run in written["runs"]] == [5.0, 5.1, None, None]
    assert [run.get("not_finite", {}).get("heldout_loss") for run in written["runs"]] == [None, None, "Infinity", "NaN"]
    assert written["runs"][2]["eval_curve"] == [[200, None]]
    state = study.rewrite_report(low)
    losses = [run["heldout_loss"] for run in state["runs"]]
    assert losses[2] == math.inf and math.isnan(losses[3]) and state["runs"][2]["eval_curve"] == [[200, math.inf]]
    high = tmp_path / "high"
    high.mkdir()
    study.write_outputs(study_state(2e-3, {"llama": [4.9, 5.0], "flash_mhf": [5.2, 5.3]}), high)
    report = learning_rates.main(["--out", str(tmp_path / "rates"), "--studies", str(low), str(high)])
    assert [run["heldout_loss"] for run in report["runs"] if run["model"] == "flash_mhf"][0] == math.inf
    assert study.read_json(tmp_path / "rates" / "learning_rates.json")["runs"][2]["heldout_loss"] == math.inf


def study_state(learning_rate: float | None, losses: dict, tokens_per_second: float | None = 1.0) -> dict:
    """The state study.py writes its results from, of SwiGLU and FlashMHF runs with these held-out losses (by seed)."""
    shape, keys = study.SHAPES["toy"], ("llama", "flash_mhf")
    runs = [{"model": model, "seed": seed, "run_id": f"{model}-{seed}-{learning_rate}", "heldout_loss": loss,
             "wiki_loss": loss + 1, "train_loss": loss, "learning_rate": learning_rate, "eval_tokens": 512,
             "tokens_per_second": tokens_per_second, "peak_memory_gib": None, "train_seconds": 1.0,
             "wall_seconds": 1.0, "device": "test device", "train_curve": [[100, 6.0], [200, loss]],
             "eval_curve": [[200, loss]]}
            for model, by_seed in losses.items() for seed, loss in enumerate(by_seed)]
    return {"command": "study.py", "device": "test device", "bf16": False, "torch": "torch", "transformers": "t",
            "size": "toy", "shape": {**vars(shape), "tokens_per_step": shape.tokens_per_step}, "tokens": 1000,
            "eval_tokens": 512, "learning_rate": learning_rate, "runs": runs, "repeats": [], "plan": [],
            "skipped": [], "elapsed_seconds": 1.0,
            "data": {"source": {"name": "text", "licence": "none"}, "tokenizer": {"vocab_size": 300},
                     "splits": {"train": {"tokens": 10_000, "sha256": "a"}, "heldout": {"tokens": 600, "sha256": "b"}}},
            "described": {key: {"counts": {"total": 100, "active": 100, "non_embedding": 50}, "ffn_path": None,
                                "config": {}} for key in keys},
            "order": list(keys), "labels": {"llama": "SwiGLU", "flash_mhf": "FlashMHF"},
            "groups": {key: "flash-mhf" for key in keys}, "paper": {key: "" for key in keys}, "ablations": []}


def test_results_files_are_strict_json_with_a_diverged_loss_written_as_null(tmp_path, monkeypatch):
    """A run whose loss diverged to NaN wrote `NaN` into results.json, learning_rates.json and verdicts.json, which
    strict JSON readers refuse: each is strict JSON now, the loss null, and --report, learning_rates.py and
    verdicts.py read it back as the NaN it was (a diverged run, named in the verdicts)."""
    monkeypatch.setattr(study, "plot_curves", lambda state, path: False)

    def write(folder, learning_rate, losses):
        folder.mkdir()
        study.write_outputs(study_state(learning_rate, losses), folder)
        return folder

    def strict(path):
        def refuse(constant):
            raise ValueError(f"{path.name} holds {constant}")
        return json.loads(path.read_text(), parse_constant=refuse)

    low = write(tmp_path / "low", 1e-3, {"llama": [5.0, 5.1, 5.2], "flash_mhf": [5.1, math.nan, 5.3]})
    high = write(tmp_path / "high", 2e-3, {"llama": [4.9, 5.0, 5.1], "flash_mhf": [math.nan, 5.0, 5.2]})
    run = strict(low / "results.json")["runs"][4]
    assert (run["model"], run["seed"], run["heldout_loss"], run["eval_curve"]) == ("flash_mhf", 1, None, [[200, None]])
    files = {name: (low / name).read_bytes() for name in ("results.md", "results.json")}
    assert "diverged: no verdict (FlashMHF seed 1)" in files["results.md"].decode()
    assert "'Diverged: no verdict': a run of either model (named)" in files["results.md"].decode()
    state = study.rewrite_report(low)
    assert math.isnan(state["runs"][4]["heldout_loss"]) and math.isnan(state["runs"][4]["eval_curve"][0][1])
    assert {name: (low / name).read_bytes() for name in files} == files

    report = learning_rates.main(["--out", str(tmp_path / "rates"), "--studies", str(low), str(high)])
    assert math.isnan(report["models"]["flash_mhf"]["rates"]["1e-3"]["heldout_loss_mean"])
    assert strict(tmp_path / "rates" / "learning_rates.json")["models"]["flash_mhf"]["rates"]["2e-3"][
        "heldout_loss_mean"] is None
    verdicts.main(["--out", str(tmp_path / "verdicts"), "--sweeps", str(tmp_path / "rates")])
    (row,) = strict(tmp_path / "verdicts" / "verdicts.json")["rows"]
    (cell,) = row["cells"].values()
    # (a run diverged at each of the two rates: there is no best rate of FlashMHF for an ordering)
    assert cell["paired_delta"] is None
    assert cell["verdict"] == "diverged: no verdict (FlashMHF d_h=32 at every rate it ran)"


def test_a_model_whose_runs_timed_no_step_has_no_tokens_per_second():
    """A run too short to time a step (its first step is untimed) records no tokens/s: the study's table printed a
    rate of 0 tokens/s for its model; it prints "-", and a model with some runs timed gets their mean."""
    state = study_state(None, {"llama": [5.0, 5.2], "flash_mhf": [5.1, 5.3]}, tokens_per_second=None)
    state["runs"][3]["tokens_per_second"] = 2000.0
    summary = study.aggregate(state["runs"])
    assert summary["llama"]["tokens_per_second"] is None and summary["flash_mhf"]["tokens_per_second"] == 2000.0
    state["summary"] = summary
    rows = {}  # (the first table's rows: model, params, params, loss, n, ppl, Δ, Wikipedia loss, tokens/s, ...)
    for line in study.results_markdown(state).splitlines():
        if line.startswith(("| SwiGLU |", "| FlashMHF |")):
            rows.setdefault(line.split(" | ")[0], line.split(" | "))
    assert rows["| SwiGLU"][8] == "-" and rows["| FlashMHF"][8] == "2,000"


def test_a_run_that_diverged_to_a_loss_beyond_exp_is_summarised(tmp_path):
    """A finite held-out loss above 709 (a run that diverged without reaching NaN) made `math.exp` raise in the
    perplexity, so the study stopped after the run, and --report and learning_rates.py failed on its results."""
    runs = [{"model": "llama", "seed": seed, "heldout_loss": loss, "tokens_per_second": 1.0, "peak_memory_gib": None,
             "train_seconds": 1.0, "wall_seconds": 1.0} for seed, loss in enumerate([750.0, 760.0])]
    summary = study.aggregate(runs)["llama"]
    assert summary["heldout_loss_mean"] == 755.0 and summary["perplexity"] == math.inf
    assert study.aggregate([{**runs[0], "heldout_loss": 5.0}])["llama"]["perplexity"] == math.exp(5.0)
    recipe = write_study(tmp_path / "recipe", {"llama": [5.0, 5.2], "pkv": [5.6, 5.9]})
    high = write_study(tmp_path / "high", {"llama": [750.0, 4.0], "pkv": [4.5, 4.6]}, learning_rate=3e-2)
    report = learning_rates.main(["--out", str(tmp_path / "out"), "--studies", str(high), str(recipe)])
    assert report["models"]["llama"]["best_learning_rate"] != 3e-2


def test_results_files_name_a_diverged_loss_under_not_finite_and_read_earlier_files(tmp_path, monkeypatch):
    """results.json wrote a NaN loss as a bare null and an infinity as the text "Infinity", apart from the package's
    run records: each is null and named under `not_finite` (`hf_memffn.run_records`), and `read_json` gives them back;
    a file of the earlier form (the text "Infinity", a bare null for NaN) still reads."""
    monkeypatch.setattr(study, "plot_curves", lambda state, path: False)
    study.write_outputs(study_state(1e-3, {"llama": [5.0, 5.1], "flash_mhf": [math.inf, math.nan]}), tmp_path)
    text = (tmp_path / "results.json").read_text()
    runs = json.loads(text, parse_constant=lambda constant: pytest.fail(constant))["runs"]
    assert runs[2]["heldout_loss"] is None and runs[2]["not_finite"]["heldout_loss"] == "Infinity"
    assert runs[2]["not_finite"]["eval_curve"] == {"0": {"1": "Infinity"}}
    assert runs[3]["heldout_loss"] is None and runs[3]["not_finite"]["heldout_loss"] == "NaN"
    read = study.read_json(tmp_path / "results.json")["runs"]
    assert read[2]["heldout_loss"] == math.inf and read[2]["eval_curve"] == [[200, math.inf]]
    assert math.isnan(read[3]["heldout_loss"]) and "not_finite" not in read[3]
    earlier = json.loads(text)
    for run, loss in ((earlier["runs"][2], "Infinity"), (earlier["runs"][3], None)):
        del run["not_finite"]
        run.update(heldout_loss=loss, wiki_loss=loss, train_loss=loss, eval_curve=[[200, loss]],
                   train_curve=[[100, 6.0], [200, loss]])
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    state = study.rewrite_report(tmp_path)
    assert state["runs"][2]["heldout_loss"] == math.inf and state["runs"][2]["eval_curve"] == [[200, math.inf]]
    assert math.isnan(state["runs"][3]["heldout_loss"])


def _write_half_then_fail(path, text, *args, **kwargs):
    """A `Path.write_text` that a full disk cuts short: half the text is written, then OSError (ENOSPC)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text[: len(text) // 2])
    raise OSError(28, "No space left on device")


def test_token_shards_two_writers_of_one_split_and_a_meta_write_cut_short(tmp_path, monkeypatch):
    """Each `write_split` writes through a temporary name of its own (`hf_memffn.atomic_write`): a second writer of
    the same split, started while the first is writing (another process preparing the same folder), no longer writes
    into the first one's temporary file, which it truncated and renamed under the first one's feet (the first then
    wrote on into `train.bin` in place and failed with FileNotFoundError). A `write_meta` cut short (a full disk)
    leaves the previous meta.json whole and no temporary file beside it."""
    def first_documents():
        yield [5, 6, 7]
        assert token_shards.write_split(tmp_path, "train", [[8, 9]], eos_id=2) == 3
        yield [10]

    assert token_shards.write_split(tmp_path, "train", first_documents(), eos_id=2) == 6
    assert token_shards.read_tokens(tmp_path, "train").tolist() == [5, 6, 7, 2, 10, 2]  # (the last one renamed)
    token_shards.write_meta(tmp_path, {"tokenizer": {"eos_id": 2}})

    monkeypatch.setattr(Path, "write_text", _write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        token_shards.write_meta(tmp_path, {"tokenizer": {"eos_id": 3}})
    monkeypatch.undo()
    assert json.loads((tmp_path / token_shards.META_FILE).read_text()) == {"tokenizer": {"eos_id": 2}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [token_shards.META_FILE, "train.bin"]


def test_prepare_data_two_runs_into_one_out_each_build_in_a_folder_of_their_own(tmp_path, monkeypatch):
    """Each run builds --out under a temporary name of its own (`hf_memffn.atomic_write`): a second run started while
    the first is building no longer removes the first one's half-built folder (the fixed name OUT.tmp, which each run
    cleared first), and the first no longer fails writing into a folder gone; --out ends as one run's whole folder,
    with nothing beside it."""
    argv = ["--out", str(tmp_path / "shards"), "--source", "text-files", "--text-files", str(ROOT / "README.md"),
            "--wiki", "no", "--vocab-size", "300", "--max-train-tokens", "2000", "--max-heldout-tokens", "500"]
    write_split = token_shards.write_split
    runs = []

    def second_run_meanwhile(folder, split, *args, **kwargs):
        if not runs:
            runs.append("second")
            prepare_data.main(argv)
        return write_split(folder, split, *args, **kwargs)

    monkeypatch.setattr(token_shards, "write_split", second_run_meanwhile)
    prepare_data.main(argv)
    assert runs == ["second"] and [p.name for p in tmp_path.iterdir()] == ["shards"]
    assert token_shards.read_meta(tmp_path / "shards")["splits"]["train"]["tokens"] == 2000


def test_the_study_reports_written_half_way_leave_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    """`study.write_atomic` and `study.save_figure`, through which the study, verdicts and learning-rate reports write
    their JSON, markdown and figures, are the package's atomic writes (`hf_memffn.atomic_write`): a write cut short (a
    full disk, an interrupt) leaves the previous file whole and no temporary file beside it (the fixed names
    `results.json.tmp` and `loss_curves.png.tmp.png` stayed, half written), and the figure is closed either way."""
    plt = pytest.importorskip("matplotlib.pyplot")
    results, figure_path = tmp_path / "results.json", tmp_path / "loss_curves.png"
    study.write_atomic(results, '{"runs": []}\n')
    figure, axes = plt.subplots()
    axes.plot([0, 1], [1, 0])
    study.save_figure(figure, figure_path, dpi=30)
    before = figure_path.read_bytes()

    monkeypatch.setattr(Path, "write_text", _write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        study.write_atomic(results, '{"runs": [{"model": "llama"}]}\n')
    figure, axes = plt.subplots()
    monkeypatch.setattr(figure, "savefig", lambda path, **kwargs: (Path(path).write_bytes(before[:10]),
                                                                    (_ for _ in ()).throw(KeyboardInterrupt)))
    with pytest.raises(KeyboardInterrupt):
        study.save_figure(figure, figure_path, dpi=30)
    monkeypatch.undo()
    assert not plt.fignum_exists(figure.number)
    assert results.read_text() == '{"runs": []}\n' and figure_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss_curves.png", "results.json"]


def test_heldout_overlap_cut_short_while_writing_leaves_the_earlier_files_and_no_temporary(tmp_path, monkeypatch):
    """`heldout_overlap.py` writes overlap.json and overlap.md through the package's atomic write
    (`hf_memffn.atomic_write`): a write cut short (a full disk) leaves the earlier run's files whole and no temporary
    file in --out (its own `.overlap.json.tmp` stayed, half written)."""
    import heldout_overlap
    from hf_memffn.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    tokenizer.save_pretrained(data)
    for split, text in (("train", "a line that is long enough to count\nmore"), ("heldout", "another line\nend")):
        token_shards.write_split(data, split, [tokenizer(text, add_special_tokens=False)["input_ids"]],
                                 tokenizer.eos_token_id)
    token_shards.write_meta(data, {"tokenizer": {"eos_id": tokenizer.eos_token_id},
                                   "splits": {"train": {"sha256": "a"}, "heldout": {"sha256": "b"}}})
    assert heldout_overlap.main(["--data", str(data), "--out", str(out), "--min-chars", "20"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    monkeypatch.setattr(Path, "write_text", _write_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        heldout_overlap.main(["--data", str(data), "--out", str(out), "--min-chars", "5"])
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_prepare_data_refuses_an_out_it_cannot_write_before_reading_the_corpus(tmp_path, monkeypatch, read_only_folder):
    """--out that is a file (with --overwrite), inside a file, or in a folder this user cannot write failed only once
    the corpus was read, the tokenizer trained and the splits written, naming a hidden temporary folder; refused now
    before the source is read, naming --out. (Run as root, which writes anywhere, the folder's mode is read by
    `os.access` as for another user.)"""
    a_file, read_only = tmp_path / "a_file", read_only_folder
    a_file.write_text("not a folder\n")
    monkeypatch.setattr(prepare_data, "paragraphs", lambda *args, **kwargs: pytest.fail("the source was read"))
    for out, reason in ((a_file, "is a file"), (a_file / "shards", "which is a file"),
                        (read_only / "shards", "not writable")):
        with pytest.raises(ValueError, match=f"--out: {re.escape(repr(str(out)))}.*{reason}"):
            prepare_data.main(["--out", str(out), "--overwrite", "--source", "text-files", "--text-files",
                               str(ROOT / "README.md"), "--wiki", "no"])
    assert os.listdir(read_only) == [] and a_file.read_text() == "not a folder\n"
