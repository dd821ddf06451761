"""Hub edges of a first-party model, without the network: `push_to_hub` takes transformers' arguments, the card's
metadata is huggingface_hub's `ModelCardData`, `Trainer.push_to_hub` keeps this package's card, and the saved
tokenizer loads in a Python without the package with no y/N prompt."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_memffn import hub
from hf_memffn.testing import BLOCK_PACKAGE_IMPORT, tiny_config, tiny_tokenizer
from test_hub import FakeHubClient  # noqa: F401  (same fake client as the other Hub tests)


@pytest.fixture
def fake_hub(monkeypatch):
    client = FakeHubClient()
    monkeypatch.setattr(hub, "_hub_client", lambda token=None: client)
    return client


def tiny_model(arch="flash_mhf", **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))


def test_push_to_hub_takes_transformers_arguments(fake_hub):
    model = tiny_model()
    model.add_model_tags(["from-model"])
    model.push_to_hub(
        "someone/tiny", commit_message="first", commit_description="tiny FlashMHF", private=True, token="hf_x",
        revision="main", create_pr=True, max_shard_size="40KB", tags=["mine"], tokenizer=tiny_tokenizer(),
    )
    upload = fake_hub.calls[-1][2]
    assert (upload["commit_message"], upload["commit_description"], upload["create_pr"]) == ("first", "tiny FlashMHF", True)
    assert upload["revision"] == "main" and fake_hub.calls[0][2]["private"] is True
    shards = [name for name in fake_hub.uploaded if re.fullmatch(r"model-\d+-of-\d+\.safetensors", name)]
    assert len(shards) > 1 and "model.safetensors.index.json" in fake_hub.uploaded
    tags = ModelCard(fake_hub.uploaded["README.md"].decode()).data.tags
    assert {"mine", "from-model", "hf-memffn", "memffn_flash_mhf"} <= set(tags)


def test_card_metadata_is_model_card_data(tmp_path):
    model = tiny_model("memoryllm")
    model.attach_card_metadata(license="apache-2.0", datasets="HuggingFaceFW/fineweb-edu", base_model="someone/base",
                               tags=["memory"])
    model.save_pretrained(tmp_path)
    data = ModelCard.load(tmp_path / "README.md").data
    assert (data.license, data.datasets, data.base_model) == ("apache-2.0", ["HuggingFaceFW/fineweb-edu"], "someone/base")
    assert (data.library_name, data.pipeline_tag) == ("transformers", "text-generation")
    assert {"hf-memffn", "memffn_memoryllm", "custom_code", "memory"} <= set(data.tags)
    with pytest.raises(ValueError, match="'licence'.*allowed fields"):
        model.attach_card_metadata(licence="mit")



@pytest.mark.parametrize("fields, named", [
    (dict(tags=5), "`tags`=5"),
    (dict(tags=["mine", 2]), "`tags`=['mine', 2]"),
    (dict(license=3), "`license`=3"),
    (dict(license=["mit"]), "`license`=['mit']"),
    (dict(datasets={"name": "fineweb"}), "`datasets`="),
    (dict(language=b"en"), "`language`="),
])
def test_card_metadata_of_a_type_the_card_does_not_take_is_refused_when_attached(fields, named, tmp_path):
    """`attach_card_metadata(tags=5)` was accepted, and `save_pretrained` then failed with a TypeError from inside the
    card's writer, leaving the weights and config without a card; `license=3` went into the card as it was."""
    model = tiny_model("kvffn")
    with pytest.raises(ValueError, match=re.escape(named) + ".*allowed values"):
        model.attach_card_metadata(**fields)
    model.attach_card_metadata(tags="mine", language=["en", "fr"], datasets=("a/b",), license=None)
    model.save_pretrained(tmp_path)
    data = ModelCard.load(tmp_path / "README.md").data
    assert ("mine" in data.tags, data.language, data.datasets, data.license) == (True, ["en", "fr"], ["a/b"], None)

def test_trainer_push_to_hub_keeps_our_card(tmp_path, monkeypatch):
    import transformers.trainer
    from transformers import Trainer, TrainingArguments

    client = FakeHubClient()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda *args, **kwargs: client)
    model = tiny_model("kvffn")
    ids = torch.randint(3, 320, (4, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to="none",
                             hub_model_id="someone/tiny-kvffn", use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = hub.keep_model_card(Trainer(model=model, args=args, train_dataset=data))
    trainer.train()
    trainer.push_to_hub(license="apache-2.0", dataset="generated-ids")

    card = ModelCard(client.uploaded["README.md"].decode())
    assert "# KVFFN (memffn_kvffn)" in card.text and 'checkpoint = "someone/tiny-kvffn"' in card.text
    assert "## Training" in card.text and "learning_rate" in card.text  # the Trainer's summary is kept
    assert card.data.license == "apache-2.0" and card.data.datasets == ["generated-ids"]
    assert "hf-memffn" in card.data.tags and "generated_from_trainer" not in card.data.tags


def test_trainer_push_to_hub_keeps_the_tags_attached_to_the_model(tmp_path, monkeypatch):
    """A push without tags: the Trainer's generic card has none of the model's card's tags (it merges them only into
    tags passed to it), and the card written in its place keeps those attached to the model."""
    import transformers.trainer
    from transformers import Trainer, TrainingArguments

    client = FakeHubClient()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda *args, **kwargs: client)
    model = tiny_model("kvffn")
    model.attach_card_metadata(tags=["mine"], license="mit")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", hub_model_id="someone/tiny-kvffn",
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = hub.keep_model_card(Trainer(model=model, args=args))
    trainer.push_to_hub()

    data = ModelCard(client.uploaded["README.md"].decode()).data
    assert {"mine", "hf-memffn"} <= set(data.tags) and data.license == "mit"


def test_trainer_push_to_hub_of_a_peft_model_keeps_the_trainers_card(tmp_path, monkeypatch):
    """A PEFT model's Trainer saves its adapters alone (no config, weights or modeling code): the card left is the
    Trainer's, which PEFT completes, not this package's card of a whole checkpoint, whose usage loads files the folder
    lacks (as `save_pretrained` writes no card for adapters)."""
    import transformers.trainer
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from hf_memffn import LORA_TARGET_MODULES

    client = FakeHubClient()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda *args, **kwargs: client)
    model = get_peft_model(tiny_model("kvffn"), LoraConfig(r=4, target_modules=LORA_TARGET_MODULES["kvffn"],
                                                           task_type="CAUSAL_LM"))
    ids = torch.randint(3, 320, (4, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none",
                             hub_model_id="someone/tiny-kvffn-lora", use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    trainer = hub.keep_model_card(Trainer(model=model, args=args, train_dataset=data))
    trainer.train()
    trainer.push_to_hub(dataset="generated-ids")

    assert "adapter_model.safetensors" in client.uploaded and "config.json" not in client.uploaded
    card = ModelCard(client.uploaded["README.md"].decode())
    assert "# KVFFN (memffn_kvffn)" not in card.text and "trust_remote_code" not in card.text
    assert "learning_rate" in card.text and card.data.library_name == "peft"


def test_card_metadata_survives_save_reload_and_push(tmp_path, fake_hub):
    """The metadata attached before `save_pretrained` is in the card that `push_to_hub` of the reloaded model
    uploads (read from the card in the folder it was loaded from), and the tags passed to the push join it."""
    model = tiny_model("kvffn")
    model.attach_card_metadata(license="apache-2.0", datasets="HuggingFaceFW/fineweb-edu", base_model="someone/base",
                               tags=["memory"])
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    reloaded.push_to_hub("someone/tiny", tags=["pushed"])

    data = ModelCard(fake_hub.uploaded["README.md"].decode()).data
    assert (data.license, data.base_model) == ("apache-2.0", "someone/base")
    assert data.datasets == ["HuggingFaceFW/fineweb-edu"]
    assert {"memory", "pushed", "hf-memffn", "memffn_kvffn"} <= set(data.tags)


def test_saved_tokenizer_loads_without_package_and_without_prompt(tmp_path):
    model = tiny_model("kvffn")
    model.attach_tokenizer(tiny_tokenizer())
    model.save_pretrained(tmp_path)
    assert PreTrainedTokenizerFast.from_pretrained(tmp_path)("memory key").input_ids[0] == 1  # no code at all
    card = (tmp_path / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    tokenizer_lines = [line for line in snippet.splitlines() if "import" in line or "tokenizer =" in line]
    script = BLOCK_PACKAGE_IMPORT + "\n".join(tokenizer_lines).replace('checkpoint', repr(str(tmp_path))) + (
        "\nprint('ids', tokenizer('memory key').input_ids)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    done = subprocess.run([sys.executable, "-c", script], input="", capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[y/N]" not in done.stdout + done.stderr and "ids [1," in done.stdout
