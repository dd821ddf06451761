"""`hf-memffn analyze` end to end on a saved tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_memffn.cli import main
from hf_memffn.testing import blocked_imports, run_python, tiny_config, tiny_tokenizer


def save_tiny_model(arch: str, directory):
    """A tiny random `arch` model with its tokenizer saved in `directory`, which is returned."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return save_tiny_model("memoryllm", tmp_path_factory.mktemp("memoryllm"))


def test_analyze_command_writes_json_and_html(saved_model, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\n\na value of the token is the layer\nhead reads the memory of a token\n")
    out = tmp_path / "report"
    code = main(["analyze", str(saved_model), "--texts", str(texts), "--out", str(out), "--device", "cpu",
                 "--top-triggers", "3", "--cells-per-bank", "2", "--clusters", "4", "--edit", "the memory=> value"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["model"]["class"] == "MemoryLLMForCausalLM"
    assert len(report["texts"]) == 3
    assert set(report["token_memory"]) == {"0", "1"}
    assert report["edits"][0]["method"] == "token_memory" and report["edits"][0]["edited_token"].strip() == "memory"
    assert report["edits"][0]["target_probability_after"] > report["edits"][0]["target_probability_before"]
    assert all(share > 0 for share in report["contributions"]["memory_share"])
    html = (out / "index.html").read_text()
    assert "Token memory" in html and "token clusters" in html and html.count("data:image/png;base64,") == 3


def test_analyze_command_reads_a_checkpoint_saved_with_a_variant(tmp_path):
    """A folder of `save_pretrained(folder, variant="fp16")` holds model.fp16.safetensors, which from_pretrained finds
    only given the variant: the command read it from the file names (it stopped with "no file named
    model.safetensors")."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm"))
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(tmp_path / "model", variant="fp16")
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\n")
    out = tmp_path / "report"
    assert main(["analyze", str(tmp_path / "model"), "--texts", str(texts), "--out", str(out), "--device", "cpu",
                 "--top-triggers", "2", "--cells-per-bank", "2", "--clusters", "2"]) == 0
    assert json.loads((out / "report.json").read_text())["model"]["class"] == "MemoryLLMForCausalLM"


def _exits_with_error(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_analyze_command_refuses_bad_arguments(saved_model, tmp_path, capsys):
    _exits_with_error(capsys, ["analyze", str(saved_model), "--texts", str(tmp_path / "none.txt"), "--out",
                               str(tmp_path / "r")], "does not exist")
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory\n")
    _exits_with_error(capsys, ["analyze", str(saved_model), "--texts", str(texts), "--out", str(tmp_path / "r"),
                               "--top-triggers", "0"], "argument --top-triggers: 0 is invalid")
    _exits_with_error(capsys, ["analyze", str(saved_model), "--texts", str(texts), "--out", str(tmp_path / "r"),
                               "--edit", "no arrow"], "expected 'PROMPT=>TARGET'")
    assert not (tmp_path / "r").exists()


def test_analyze_command_refuses_an_edit_target_of_several_tokens_and_an_empty_prompt(saved_model, tmp_path, capsys):
    """An edit promotes one next token: a target of two tokens was edited as its first token alone, silently. An
    empty prompt (`<s>` alone once encoded) edited the start token's memory."""
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\n")
    argv = ["analyze", str(saved_model), "--texts", str(texts), "--out", str(tmp_path / "r"), "--device", "cpu"]
    _exits_with_error(capsys, [*argv, "--edit", "the memory=> value key"],
                      "error: edit ('the memory', ' value key') (--edit, or edits[0]): the target is 2 tokens "
                      "[' value', ' key']; allowed: a target of one token")
    _exits_with_error(capsys, [*argv, "--edit", "the memory=> value", "--edit", "=> value"],
                      "error: edit ('', ' value'): prompt and target must both contain tokens")
    assert not (tmp_path / "r").exists()


def test_analyze_command_names_a_tokenizer_option_that_is_no_tokenizer(saved_model, tmp_path, capsys):
    """A --tokenizer path that does not exist was read as a Hub id ("Repo id must use alphanumeric chars")."""
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\n")
    argv = ["analyze", str(saved_model), "--texts", str(texts), "--out", str(tmp_path / "r"), "--tokenizer"]
    missing = str(tmp_path / "no-such-tokenizer")
    _exits_with_error(capsys, [*argv, missing], f"argument --tokenizer: {missing!r} does not exist; allowed: a "
                                                "tokenizer directory or a Hub id such as org/name")
    (tmp_path / "empty").mkdir()
    _exits_with_error(capsys, [*argv, str(tmp_path / "empty")], "holds no tokenizer (none of tokenizer.json")
    _exits_with_error(capsys, [*argv, str(texts)], "is a file; allowed: a tokenizer directory or a Hub id")
    assert not (tmp_path / "r").exists()


def test_analyze_command_takes_layers_and_config_overrides(tmp_path, capsys):
    save_tiny_model("flash_mhf", tmp_path / "flash_mhf")
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "the memory stores a key"}\n{"text": "head reads the memory"}\n')
    out = tmp_path / "report"
    code = main(["analyze", str(tmp_path / "flash_mhf"), "--texts", str(texts), "--out", str(out), "--device", "cpu",
                 "--layers", "1", "--override", "ffn_kernel=torch", "--top-triggers", "2"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert [bank["name"] for bank in report["model"]["banks"]] == ["layers.1.mlp"]
    assert report["edits"][0]["method"] == "value" and report["edits"][0]["location"].startswith("layers.1.mlp cell h")
    _exits_with_error(capsys, ["analyze", str(tmp_path / "flash_mhf"), "--texts", str(texts), "--out", str(out),
                               "--layers", "7"], "--layers: layers [7] do not exist")


def test_analyze_command_works_on_a_plain_llama_and_takes_a_tokenizer_option(tmp_path, capsys):
    """Any Llama-family checkpoint is analysed; a directory without a tokenizer names the `--tokenizer` option."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path / "llama")  # saved without a tokenizer
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\nhead reads the memory of a token\n")
    argv = ["analyze", str(tmp_path / "llama"), "--texts", str(texts), "--out", str(tmp_path / "report"),
            "--device", "cpu", "--top-triggers", "2", "--cells-per-bank", "1", "--clusters", "2"]
    _exits_with_error(capsys, argv, f"no tokenizer found in {tmp_path / 'llama'}")
    assert not (tmp_path / "report").exists()
    assert main([*argv, "--tokenizer", str(tmp_path / "tokenizer")]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["model"]["class"] == "LlamaForCausalLM"
    assert [bank["name"] for bank in report["model"]["banks"]] == ["layers.0.mlp", "layers.1.mlp"]


def test_analyze_command_refuses_overrides_that_leave_checkpoint_weights_unused(tmp_path, capsys):
    save_tiny_model("kvffn", tmp_path / "kvffn")
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\n")
    argv = ["analyze", str(tmp_path / "kvffn"), "--texts", str(texts), "--out", str(tmp_path / "r"), "--device", "cpu"]
    _exits_with_error(capsys, [*argv, "--override", "ffn_variant=relu"],
                      "--override ffn_variant: the config it gives does not use the checkpoint's weights")
    _exits_with_error(capsys, [*argv, "--override", "num_hidden_layers=1", "--override", "rms_norm_eps=1e-6"],
                      "--override num_hidden_layers, rms_norm_eps: the config it gives does not use")
    assert not (tmp_path / "r").exists()


def test_analyze_command_names_the_texts_file_and_line_and_refuses_empty_layers(saved_model, tmp_path, capsys):
    argv = ["analyze", str(saved_model), "--out", str(tmp_path / "r"), "--device", "cpu"]
    records = tmp_path / "texts.jsonl"
    records.write_text('{"text": "the memory"}\n{"text": "oops"\n')
    _exits_with_error(capsys, [*argv, "--texts", str(records)], f"error: {records}:2: invalid JSON: Expecting ','")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 memory\n".encode("latin-1"))
    _exits_with_error(capsys, [*argv, "--texts", str(latin1)], f"error: {latin1}:1: not UTF-8 text")
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory\n")
    _exits_with_error(capsys, [*argv, "--texts", str(texts), "--layers", ""],
                      "argument --layers: '' is invalid; allowed: comma-separated integers")
    assert not (tmp_path / "r").exists()


def test_analyze_command_streams_the_dataset_and_checks_it_before_the_analysis(saved_model, tmp_path, capsys,
                                                                                 monkeypatch):
    """`--dataset` ("texts streamed for the top-triggering prefixes") was read whole into memory (its bytes, the
    decoded text and every line at once) before the analysis; it is read a line at a time, and a bad line at its
    end is still named before any model is loaded."""
    from pathlib import Path

    import hf_memffn.analysis.cli as analysis_cli

    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\n")
    dataset = tmp_path / "dataset.jsonl"
    lines = [json.dumps({"text": f"a value of the token {i} is the layer"}) for i in range(40)]
    dataset.write_text("\n".join(lines) + "\n")
    argv = ["analyze", str(saved_model), "--texts", str(texts), "--device", "cpu", "--top-triggers", "2",
            "--cells-per-bank", "1", "--clusters", "2"]
    read_whole, real_read_bytes = [], Path.read_bytes

    def recording_read_bytes(path):
        read_whole.append(str(path))
        return real_read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", recording_read_bytes)
    assert main([*argv, "--dataset", str(dataset), "--out", str(tmp_path / "report")]) == 0
    assert str(dataset) not in read_whole
    cell = next(iter(json.loads((tmp_path / "report" / "report.json").read_text())["cells"].values()))[0]
    assert any(trigger["text_index"] > 0 for trigger in cell["triggers"])  # (the dataset's texts, not --texts)

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset was checked")

    monkeypatch.setattr(analysis_cli, "load_causal_lm", no_loading)
    dataset.write_text("\n".join(lines) + '\n{"txt": "a key"}\n')
    _exits_with_error(capsys, [*argv, "--dataset", str(dataset), "--out", str(tmp_path / "r")],
                      f"error: {dataset}:41: each .jsonl line must be an object with a string field 'text'")


def test_analyze_command_reports_a_memoryllm_read_one_token_a_text(saved_model, tmp_path):
    """`--max-length 1` leaves the start token alone: a special token, so the token memory has no clusters."""
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\nhead reads the memory of a token\n")
    out = tmp_path / "report"
    assert main(["analyze", str(saved_model), "--texts", str(texts), "--out", str(out), "--device", "cpu",
                 "--max-length", "1", "--top-triggers", "1", "--cells-per-bank", "1", "--clusters", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["token_memory_clustered"] == "none: every token is a special one"
    assert all(section["clusters"] == [] for section in report["token_memory"].values())


def test_analyze_command_names_token_ids_outside_a_plain_llamas_embedding(tmp_path, capsys):
    """A tokenizer with more tokens than the model's embedding: one line naming the id, not an IndexError from
    inside transformers' embedding (the memffn models check their ids themselves)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama", vocab_size=260)).save_pretrained(tmp_path / "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "llama")  # 320 tokens
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\n")
    _exits_with_error(capsys, ["analyze", str(tmp_path / "llama"), "--texts", str(texts), "--out",
                               str(tmp_path / "r"), "--device", "cpu"],
                      "error: text 0 has token id 279: allowed ids are 0..259")
    assert not (tmp_path / "r").exists()


def test_analyze_command_names_a_peft_adapter_folder_and_says_to_merge_it(saved_model, tmp_path, capsys):
    """A folder saved by a PEFT model holds the adapter alone: it was refused for lacking config.json, with no word
    that it is an adapter, or of how to analyse the adapted model."""
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(saved_model)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    adapted.save_pretrained(tmp_path / "adapter")
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory\n")
    _exits_with_error(capsys, ["analyze", str(tmp_path / "adapter"), "--texts", str(texts), "--out",
                               str(tmp_path / "r")], "is a PEFT adapter (adapter_config.json, no config.json); "
                      "allowed: a whole model's directory: merge the adapter into its base model first")


def test_analyze_command_without_matplotlib_names_the_package_to_install_in_one_line(tmp_path):
    """A Python without matplotlib (a checkout on PYTHONPATH, an install with --no-deps): the report's module imports
    it, and `hf-memffn analyze` ended in that import's traceback, also for --help. Its --help needs no matplotlib (the
    command's arguments import none of the analysis); a run names the package in one line."""
    completed = run_python(blocked_imports("matplotlib") + (
        "from hf_memffn.cli import main; raise SystemExit(main(['analyze', '--help']))"))
    assert completed.returncode == 0 and "usage: hf-memffn analyze" in completed.stdout, completed.stderr[-2000:]
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "texts.txt").write_text("the memory\n")
    argv = ["analyze", str(tmp_path), "--texts", str(tmp_path / "texts.txt"), "--out", str(tmp_path / "report")]
    completed = run_python(blocked_imports("matplotlib") + (
        f"from hf_memffn.cli import main; raise SystemExit(main({argv!r}))"))
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert completed.stderr.strip() == ("hf-memffn analyze: error: needs the 'matplotlib' package, which is not "
                                        "installed: pip install matplotlib (a dependency of hf-memffn: pip install "
                                        "hf-memffn installs it)"), completed.stderr[-2000:]


def test_analyze_command_stopped_by_sigterm_leaves_no_temporary_file_and_says_so_in_one_line(saved_model, tmp_path):
    """A scheduler stops a job with SIGTERM. Python's default for it ends the process on the spot: a file being
    written stayed behind under its temporary name, and nothing was said. The command now takes it like Ctrl-C: the
    temporary is removed, one line names the signal, and the status is 128 + 15."""
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory stores a key\n")
    out = tmp_path / "report"
    script = """
import os, pathlib, signal, sys
from hf_memffn.cli import main

write_bytes = pathlib.Path.write_bytes

def write_then_stopped(self, data):  # the job is stopped while report.json is being written
    written = write_bytes(self, data)
    if self.name.startswith(".report.json."):
        os.kill(os.getpid(), signal.SIGTERM)
    return written

pathlib.Path.write_bytes = write_then_stopped
sys.exit(main(["analyze", sys.argv[1], "--texts", sys.argv[2], "--out", sys.argv[3], "--device", "cpu",
               "--top-triggers", "2", "--cells-per-bank", "1", "--clusters", "2"]))
"""
    result = run_python(script, saved_model, texts, out)
    assert result.returncode == 128 + 15, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == "hf-memffn analyze: terminated (SIGTERM)"
    assert "Traceback" not in result.stderr
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert not (out / "report.json").exists() and not (out / "index.html").exists()
