"""`hf-memffn analyze` end to end on a saved tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_memffn.cli import main
from hf_memffn.testing import tiny_config, tiny_tokenizer


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("memoryllm")
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm"))
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(directory)
    return directory


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


def test_analyze_command_refuses_bad_arguments(saved_model, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        main(["analyze", str(saved_model), "--texts", str(tmp_path / "none.txt"), "--out", str(tmp_path / "r")])
    texts = tmp_path / "texts.txt"
    texts.write_text("the memory\n")
    with pytest.raises(ValueError, match="--top-triggers=0"):
        main(["analyze", str(saved_model), "--texts", str(texts), "--out", str(tmp_path / "r"), "--top-triggers", "0"])
    with pytest.raises(SystemExit):
        main(["analyze", str(saved_model), "--texts", str(texts), "--out", str(tmp_path / "r"), "--edit", "no arrow"])
    assert not (tmp_path / "r").exists()


def test_analyze_command_takes_layers_and_config_overrides(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf"))
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(tmp_path / "flash_mhf")
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "the memory stores a key"}\n{"text": "head reads the memory"}\n')
    out = tmp_path / "report"
    code = main(["analyze", str(tmp_path / "flash_mhf"), "--texts", str(texts), "--out", str(out), "--device", "cpu",
                 "--layers", "1", "--override", "ffn_kernel=torch", "--top-triggers", "2"])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert [bank["name"] for bank in report["model"]["banks"]] == ["layers.1.mlp"]
    assert report["edits"][0]["method"] == "value" and report["edits"][0]["location"].startswith("layers.1.mlp cell h")
    with pytest.raises(ValueError, match="--layers='7'"):
        main(["analyze", str(tmp_path / "flash_mhf"), "--texts", str(texts), "--out", str(out), "--layers", "7"])
