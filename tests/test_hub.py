"""Hub-ready checkpoints: the staged folder (exact files), the model card, and the push path with the Hub client
replaced at our boundary (`hf_memffn.hub._hub_client`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoModelForCausalLM

import hf_memffn
from hf_memffn import hub
from hf_memffn.model_card import render_model_card
from hf_memffn.testing import REMOTE_CODE_FILES, tiny_config, tiny_tokenizer
from hf_memffn.token_lookup import TokenLookupError

NON_CODE_FILES = {"README.md", "config.json", "generation_config.json", "model.safetensors"}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}


class FakeHubClient:
    """Records the calls `hf_memffn.hub` makes and what the uploaded folder held at upload time."""

    def __init__(self):
        self.calls = []
        self.uploaded: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        """Keeps every file under `folder_path` that huggingface_hub's `upload_folder` would send: those its
        `allow_patterns` / `ignore_patterns` (matched against the relative path) let through; and removes the files
        uploaded before that its `delete_patterns` match, unless uploaded again."""
        self.calls.append(("upload_folder", repo_id, kwargs))
        if kwargs.get("create_pr") and kwargs.get("revision") not in (None, "main"):  # (as huggingface_hub refuses it)
            raise ValueError(f"Cannot use `create_pr=True` with `revision={kwargs['revision']!r}`")
        root = Path(folder_path)
        names = [path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file()]
        sent = list(filter_repo_objects(names, allow_patterns=kwargs.get("allow_patterns"),
                                        ignore_patterns=kwargs.get("ignore_patterns")))
        if kwargs.get("delete_patterns"):
            for name in filter_repo_objects(list(self.uploaded), allow_patterns=kwargs["delete_patterns"]):
                if name not in sent:
                    del self.uploaded[name]
        for name in sent:
            self.uploaded[name] = (root / name).read_bytes()
        return type("CommitInfo", (), {"commit_url": f"https://hub.invalid/{repo_id}/commit/1"})()


@pytest.fixture
def fake_hub(monkeypatch):
    client = FakeHubClient()
    monkeypatch.setattr(hub, "_hub_client", lambda token=None: client)
    return client


def tiny_model(arch: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch))


@pytest.mark.parametrize("arch", sorted(hf_memffn.ARCHITECTURES))
def test_push_checkpoint_stages_exactly_weights_tokenizer_code_and_card(arch, fake_hub, tmp_path):
    model = tiny_model(arch)
    info = hub.push_checkpoint(model, "someone/tiny-" + arch, tokenizer=tiny_tokenizer(), private=True)

    assert info.commit_url.endswith("/commit/1")
    assert [call[0] for call in fake_hub.calls] == ["create_repo", "upload_folder"]
    assert fake_hub.calls[0][2]["private"] is True
    assert set(fake_hub.uploaded) == NON_CODE_FILES | TOKENIZER_FILES | REMOTE_CODE_FILES[arch]

    config = json.loads(fake_hub.uploaded["config.json"])
    assert config["model_type"] == model.config.model_type and "AutoModelForCausalLM" in config["auto_map"]
    card = fake_hub.uploaded["README.md"].decode()
    assert f'checkpoint = "someone/tiny-{arch}"' in card and "trust_remote_code=True" in card

    # A stranger's view: the staged files alone load with trust_remote_code and give the same logits.
    folder = tmp_path / "download"
    folder.mkdir()
    for name, data in fake_hub.uploaded.items():
        (folder / name).write_bytes(data)
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    ids = torch.tensor([[1, 5, 9, 3]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_a_tokenizer_given_to_a_push_goes_with_it_and_leaves_the_model_as_it_was(fake_hub):
    """`push_checkpoint(..., tokenizer=)` and `model.push_to_hub(tokenizer=)` upload that tokenizer; the model keeps
    the one it had attached before, or none (it stayed attached, and went with every later save)."""
    model = tiny_model("memoryllm")
    pushed = tiny_tokenizer(vocab_size=300)
    hub.push_checkpoint(model, "someone/tiny-memoryllm", tokenizer=pushed)
    assert TOKENIZER_FILES <= set(fake_hub.uploaded) and model.attached_tokenizer is None
    own = tiny_tokenizer()
    model.attach_tokenizer(own)
    model.push_to_hub("someone/tiny-memoryllm", tokenizer=pushed)
    assert model.attached_tokenizer is own
    vocab = json.loads(fake_hub.uploaded["tokenizer.json"])["model"]["vocab"]
    assert len(vocab) == len(pushed.get_vocab()) != len(own.get_vocab())


def test_model_push_to_hub_keeps_our_card(fake_hub):
    model = tiny_model("memoryllm")
    model.attach_tokenizer(tiny_tokenizer())
    model.push_to_hub("someone/tiny-memoryllm", commit_message="first")
    assert [call[0] for call in fake_hub.calls] == ["create_repo", "upload_folder"]
    assert fake_hub.calls[1][2]["commit_message"] == "first"
    assert set(fake_hub.uploaded) == NON_CODE_FILES | TOKENIZER_FILES | REMOTE_CODE_FILES["memoryllm"]
    assert "trust_remote_code=True" in fake_hub.uploaded["README.md"].decode()


def test_save_pretrained_with_push_to_hub_uploads_our_card_and_the_tokenizer(fake_hub, tmp_path):
    """`save_pretrained(folder, push_to_hub=True)` uploads the folder once it is complete: this package's card (also
    left in the folder, where later saves write it again) and the attached tokenizer, as `push_to_hub` does."""
    model = tiny_model("kvffn")
    model.attach_tokenizer(tiny_tokenizer())
    folder = tmp_path / "tiny-kvffn"
    model.save_pretrained(folder, push_to_hub=True, commit_message="first", private=True)
    assert [call[0] for call in fake_hub.calls] == ["create_repo", "upload_folder"]
    assert fake_hub.calls[0][1] == "tiny-kvffn" and fake_hub.calls[0][2]["private"] is True
    assert fake_hub.calls[1][2]["commit_message"] == "first"
    assert set(fake_hub.uploaded) == NON_CODE_FILES | TOKENIZER_FILES | REMOTE_CODE_FILES["kvffn"]
    assert 'checkpoint = "tiny-kvffn"' in fake_hub.uploaded["README.md"].decode()  # (the card names the repo)
    assert "trust_remote_code=True" in (folder / "README.md").read_text()

    with pytest.raises(ValueError, match="repo_id='a/b/c' is not a Hub repository id"):
        model.save_pretrained(tmp_path / "refused", push_to_hub=True, repo_id="a/b/c")
    assert not (tmp_path / "refused").exists()


def test_push_folder_refuses_an_incomplete_folder_and_uploads_nothing(fake_hub, tmp_path):
    model = tiny_model("kvffn")
    model.save_pretrained(tmp_path)
    (tmp_path / "modeling_memffn.py").unlink()
    with pytest.raises(ValueError, match="modeling_memffn.py"):
        hub.push_folder(tmp_path, "someone/broken")
    assert fake_hub.calls == []



def test_push_folder_refuses_a_folder_missing_a_file_the_modeling_code_imports(fake_hub, tmp_path):
    tiny_model("flash_mhf").save_pretrained(tmp_path)
    (tmp_path / "ffn_multihead.py").unlink()  # imported by modeling_flash_mhf.py, which auto_map names
    with pytest.raises(ValueError, match=r"missing \['ffn_multihead.py'\], imported by its modeling code"):
        hub.push_folder(tmp_path, "someone/broken")
    assert fake_hub.calls == []


def test_push_folder_refuses_a_sharded_checkpoint_missing_a_shard(fake_hub, tmp_path):
    tiny_model("kvffn").save_pretrained(tmp_path, max_shard_size="40KB")
    last_shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    last_shard.unlink()
    with pytest.raises(ValueError, match=f"is missing \\['{last_shard.name}'\\]"):
        hub.push_folder(tmp_path, "someone/broken")
    assert fake_hub.calls == []


@pytest.mark.parametrize("damaged", ["model.safetensors.index.json", "config.json"])
def test_push_refuses_a_cut_short_json_file_naming_it(damaged, fake_hub, tmp_path, capsys):
    """A weights index or config.json cut short (a save interrupted while writing it): the push is refused with an
    error that names the file (it said `Expecting value: line 1 column 16 (char 15)`), and nothing is sent."""
    from hf_memffn.cli import main as cli_main

    tiny_model("kvffn").save_pretrained(tmp_path, max_shard_size="40KB")
    (tmp_path / damaged).write_text((tmp_path / damaged).read_text()[:15])
    expected = f"{damaged} is not valid JSON"
    with pytest.raises(ValueError, match=expected):
        hub.push_folder(tmp_path, "someone/broken")
    with pytest.raises(SystemExit) as stop:
        cli_main(["push", str(tmp_path), "someone/broken"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1 and expected in errors[0]
    assert fake_hub.calls == []


@pytest.mark.parametrize("variant", [None, "fp16"])
def test_push_folder_refuses_weights_that_an_earlier_save_shadows(variant, fake_hub, tmp_path):
    """Saved into a folder that held a single weights file, sharded weights leave it there (transformers removes
    the shards of an earlier save only), and `from_pretrained` loads that file, the earlier weights: the push is
    refused, naming both and the newer, before anything is sent; the folder pushes once the stale file is gone."""
    model = tiny_model("kvffn")
    options = {"variant": variant} if variant else {}
    model.save_pretrained(tmp_path, **options)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # (trained on)
    model.save_pretrained(tmp_path, max_shard_size="40KB", **options)
    single, index = ("model.fp16.safetensors", "model.safetensors.index.fp16.json") if variant else (
        "model.safetensors", "model.safetensors.index.json")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, **options)
    assert not torch.equal(loaded.lm_head.weight, model.lm_head.weight)  # (what a stranger would load)
    with pytest.raises(ValueError, match=f"holds both {single} and {index} with its shards.*from_pretrained loads "
                                         f"{single} and ignores the shards. {index} is the newer"):
        hub.push_folder(tmp_path, "someone/tiny")
    assert fake_hub.calls == []
    (tmp_path / single).unlink()
    hub.push_folder(tmp_path, "someone/tiny")
    assert index in fake_hub.uploaded and single not in fake_hub.uploaded


def test_a_push_removes_the_weights_of_an_earlier_push_that_it_replaces(fake_hub, tmp_path):
    """A repository that holds `model.safetensors` of an earlier push, pushed sharded weights to: the upload left
    that file there, and `from_pretrained` of the repository loads it, the earlier weights. The push removes the
    weights of the same variant that it does not upload again, and leaves those of other variants."""
    model = tiny_model("kvffn")
    model.push_to_hub("someone/tiny")
    model.save_pretrained(tmp_path / "fp16", variant="fp16")
    hub.push_folder(tmp_path / "fp16", "someone/tiny")
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # (trained on)
    model.push_to_hub("someone/tiny", max_shard_size="40KB")
    weights = {name for name in fake_hub.uploaded if name.endswith((".safetensors", ".index.json"))}
    assert "model.safetensors.index.json" in weights and "model.fp16.safetensors" in weights
    assert "model.safetensors" not in weights

    folder = tmp_path / "download"
    folder.mkdir()
    for name, data in fake_hub.uploaded.items():
        (folder / name).write_bytes(data)
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    model.push_to_hub("someone/tiny")  # (and back to one file: the shards go)
    assert not [name for name in fake_hub.uploaded if name.startswith("model-") or name.endswith(".index.json")]


@pytest.mark.parametrize("damage", ["index-missing", "weights-in-a-subfolder"])
def test_push_folder_refuses_weights_that_from_pretrained_does_not_find(damage, fake_hub, tmp_path):
    """`from_pretrained` reads `model.safetensors`, or the shards `model.safetensors.index.json` names, at the top of
    the folder: shards without their index (a save stopped before it wrote the index) or weights moved into a
    subfolder do not load, and the push is refused, naming the weights, before anything is sent."""
    if damage == "index-missing":
        tiny_model("kvffn").save_pretrained(tmp_path, max_shard_size="40KB")
        (tmp_path / "model.safetensors.index.json").unlink()
    else:
        tiny_model("kvffn").save_pretrained(tmp_path)
        (tmp_path / "weights").mkdir()
        (tmp_path / "model.safetensors").rename(tmp_path / "weights" / "model.safetensors")
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    missing = r"is missing \['model.safetensors or model.safetensors.index.json \(weights\)'\]"
    with pytest.raises(ValueError, match=missing):
        hub.push_folder(tmp_path, "someone/broken")
    assert fake_hub.calls == []


@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_push_folder_takes_weights_saved_with_a_variant(max_shard_size, fake_hub, tmp_path):
    """`save_pretrained(folder, variant="fp16")` names the weights `model.fp16.safetensors` (sharded: its index
    `model.safetensors.index.fp16.json`), which `from_pretrained(folder, variant="fp16")` loads: the push was refused
    as missing its weights, also after `save_pretrained(..., push_to_hub=True)` had written the folder. Shards of a
    variant without their index, and int8 weights stored under a variant, are still refused."""
    from hf_memffn import adapters

    model = tiny_model("memoryllm")
    model.save_pretrained(tmp_path / "saved", variant="fp16", push_to_hub=True, repo_id="someone/tiny-fp16",
                          **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    weights = sorted(name for name in fake_hub.uploaded if name.endswith((".safetensors", ".json")))
    assert ("model.safetensors.index.fp16.json" in weights) == (max_shard_size is not None)
    assert all(".fp16" in name for name in weights if name.startswith("model"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", variant="fp16", trust_remote_code=True)
    ids = torch.tensor([[1, 5, 9, 3]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)

    if max_shard_size is not None:
        (tmp_path / "saved" / "model.safetensors.index.fp16.json").unlink()
        with pytest.raises(ValueError, match=r"is missing \['model.safetensors or model.safetensors.index.json"):
            hub.push_folder(tmp_path / "saved", "someone/broken")
    adapters.quantize_weights_int8(model)
    model.save_pretrained(tmp_path / "int8", variant="fp16")
    with pytest.raises(ValueError, match=r"stores 3 weights \(.*\) with adapters or int8 attached"):
        hub.push_folder(tmp_path / "int8", "someone/tiny-int8")


@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_the_cards_snippets_load_weights_saved_with_a_variant(max_shard_size, tmp_path):
    """`from_pretrained(folder)` does not find weights saved with a variant (`model.fp16.safetensors`), nor does
    lm-eval: the card's snippets and commands pass the variant, and the snippets run as written (the usage snippet,
    and that of the table exported into the folder). Saved again without a variant into the folder, the card loads
    the plain weights."""
    import re

    from hf_memffn.conversion.export import export_tols

    model = tiny_model("memoryllm").eval()
    model.attach_tokenizer(tiny_tokenizer())
    folder = tmp_path / "fp16"
    model.save_pretrained(folder, variant="fp16", **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    export_tols(model, folder, format="fp32", progress=False)
    card = (folder / "README.md").read_text()
    usage = re.search(r"## Usage\n\n.*?```python\n(.*?)```", card, re.S).group(1)
    lookup = re.search(r"Load it from a local copy of this folder:\n\n```python\n(.*?)```", card, re.S).group(1)
    assert 'trust_remote_code=True, dtype=torch.bfloat16, variant="fp16")' in usage
    assert 'trust_remote_code=True, dtype=torch.bfloat16, variant="fp16")' in lookup
    # (lm-eval passes the model_args it does not know to from_pretrained)
    assert "--model_args pretrained=path/to/this/folder,trust_remote_code=True,variant=fp16 --tasks" in card
    assert "pretrained=path/to/this/folder,token_lookup=path/to/this/folder,variant=fp16 --tasks" in card
    ids = torch.tensor([[1, 5, 9, 3]])
    namespace = {}  # (the lookup section's snippet goes on from the usage snippet's imports)
    for snippet in (usage.replace("max_new_tokens=20", "max_new_tokens=2"), lookup.replace('"gpu"', '"cpu"')):
        exec(snippet.replace('snapshot_download("path/to/this/folder")', repr(str(folder)))
             .replace('"path/to/this/folder"', repr(str(folder))), namespace)
        with torch.no_grad():
            torch.testing.assert_close(namespace["model"].float()(ids).logits, model(ids).logits,
                                       atol=0.05, rtol=0.05)  # (stored in fp16, run in bf16)

    model.save_pretrained(folder)  # (the plain weights, next to those of the variant)
    assert "variant=" not in (folder / "README.md").read_text()


def test_a_model_with_adapters_or_int8_weights_is_refused_before_anything_is_pushed(fake_hub, tmp_path, capsys):
    """Saved while `hf_memffn.adapters` parametrizes weights (int8, LoRA), a checkpoint stores them as such, and
    `from_pretrained` refuses it: pushing such a model is refused before anything is written or sent, naming the
    weights and how to merge them; a folder saved so (a Trainer's checkpoint) is refused by `hf-memffn push`."""
    from hf_memffn import adapters
    from hf_memffn.cli import main as cli_main

    model = tiny_model("memoryllm")
    adapters.quantize_weights_int8(model)
    refused = r"3 weights of the model \(model.memory.down_proj, .*\) have adapters or int8 attached.*merge_weight_lora"
    with pytest.raises(ValueError, match=refused):
        hub.push_checkpoint(model, "someone/tiny-int8")
    with pytest.raises(ValueError, match=refused):
        model.push_to_hub("someone/tiny-int8")
    with pytest.raises(ValueError, match=refused):
        model.save_pretrained(tmp_path / "pushed", push_to_hub=True, repo_id="someone/tiny-int8")
    with pytest.raises(ValueError, match=refused):
        hub.stage_checkpoint(model, tmp_path / "staged")
    assert fake_hub.calls == [] and not (tmp_path / "pushed").exists() and not (tmp_path / "staged").exists()

    model.save_pretrained(tmp_path / "saved")  # (allowed: the Trainer resumes from such checkpoints)
    with pytest.raises(SystemExit) as stop:
        cli_main(["push", str(tmp_path / "saved"), "someone/tiny-int8"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1
    assert "stores 3 weights (model.memory.down_proj, model.memory.gate_proj, model.memory.up_proj)" in errors[0]
    assert fake_hub.calls == []

    adapters.merge_weight_lora(model)
    hub.push_checkpoint(model, "someone/tiny-int8")
    assert "model.safetensors" in fake_hub.uploaded


@pytest.mark.parametrize("damage", ["shard-missing", "shard-cut-short", "index-missing"])
def test_push_folder_refuses_an_incomplete_token_lookup_table(damage, fake_hub, tmp_path, capsys):
    """A table exported next to the weights that lost a shard its index names, or holds one cut short (the card
    would say the table is included, and loading it from the repository fails), or shards without an index (an
    interrupted export, uploaded for nothing): the push is refused, naming what is missing, and nothing is sent."""
    from hf_memffn.cli import main as cli_main
    from hf_memffn.conversion.export import export_tols

    model = tiny_model("memoryllm").eval()
    model.save_pretrained(tmp_path)
    export_tols(model, tmp_path, format="bf16", batch_size=100, max_shard_size="30KB", progress=False)
    shard = sorted(path.name for path in tmp_path.glob("token_lookup-*.safetensors"))[1]
    if damage == "shard-missing":
        (tmp_path / shard).unlink()
        expected = f"token_lookup.safetensors.index.json names ['{shard}'], which are missing"
    elif damage == "shard-cut-short":
        (tmp_path / shard).write_bytes((tmp_path / shard).read_bytes()[:1000])
        with pytest.raises(TokenLookupError, match="is truncated or altered"):
            model.load_tols(tmp_path, placement="cpu")
        expected = (f"token_lookup.safetensors.index.json names ['{shard}'], whose size is not the one it records "
                    "(cut short or altered)")
    else:
        (tmp_path / "token_lookup.safetensors.index.json").unlink()
        expected = "holds token_lookup shards without token_lookup.safetensors.index.json (an interrupted export)"
    with pytest.raises(ValueError, match="incomplete token lookup table") as refused:
        hub.push_folder(tmp_path, "someone/tiny-memoryllm")
    assert expected in str(refused.value)
    with pytest.raises(SystemExit) as stop:
        cli_main(["push", str(tmp_path), "someone/tiny-memoryllm"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1 and expected in errors[0]
    assert fake_hub.calls == []


def test_pushing_a_folder_with_a_readme_of_the_users_own_leaves_its_lookup_section_alone(fake_hub, tmp_path):
    """A README.md without the markers of this package's card is the user's: as `save_pretrained` and `export-tols`
    leave it alone, the push uploads it as it is, its own "Token lookup tables" section included (not replaced by
    the generated one, with its placeholder path)."""
    from hf_memffn.model_card import CARD_PLACEHOLDER_PATH

    tiny_model("memoryllm").save_pretrained(tmp_path)
    own = ("# My model\n\n## Token lookup tables\n\nOur int8 tables live in the `tols-int8` repository.\n\n"
           "## License\n\nMIT\n")
    (tmp_path / "README.md").write_text(own)
    hub.push_folder(tmp_path, "someone/tiny-memoryllm")
    assert fake_hub.uploaded["README.md"].decode() == own and CARD_PLACEHOLDER_PATH not in own


def test_push_folder_to_a_branch(fake_hub, tmp_path):
    tiny_model("flash_mhf").save_pretrained(tmp_path)
    hub.push_folder(tmp_path, "someone/tiny", revision="step-100", commit_message="step 100")
    assert [call[0] for call in fake_hub.calls] == ["create_repo", "create_branch", "upload_folder"]
    assert fake_hub.calls[2][2]["revision"] == "step-100" and fake_hub.calls[2][2]["commit_message"] == "step 100"


def hub_http_error(status_code: int, message: str):
    """The error huggingface_hub raises for an HTTP answer of `status_code`."""
    from types import SimpleNamespace

    from huggingface_hub.errors import HfHubHTTPError

    return HfHubHTTPError(message, response=SimpleNamespace(status_code=status_code, headers={}, request=None))


def test_push_checkpoint_creates_the_repository_before_saving_the_model(fake_hub, monkeypatch):
    """The model was saved into the temporary folder before the repository was created: an offline machine, a token
    without write access or a repository id the Hub refuses failed only after that save (minutes for a large model).
    As transformers' `push_to_hub`, the repository comes first, and a failure to create it saves nothing."""
    from huggingface_hub.errors import HfHubHTTPError

    model = tiny_model("kvffn")
    order = []
    save_pretrained = model.save_pretrained
    monkeypatch.setattr(model, "save_pretrained", lambda *args, **kwargs: order.append("save_pretrained") or
                        save_pretrained(*args, **kwargs))
    create_repo = fake_hub.create_repo
    monkeypatch.setattr(fake_hub, "create_repo", lambda *args, **kwargs: order.append("create_repo") or
                        create_repo(*args, **kwargs))
    hub.push_checkpoint(model, "someone/tiny-kvffn", revision="dev")
    assert order == ["create_repo", "save_pretrained"]
    assert [call[0] for call in fake_hub.calls] == ["create_repo", "create_branch", "upload_folder"]

    def refused(repo_id, **kwargs):
        raise hub_http_error(401, "401 Client Error: Unauthorized")

    order.clear()
    monkeypatch.setattr(fake_hub, "create_repo", refused)
    with pytest.raises(HfHubHTTPError, match="Unauthorized"):
        hub.push_checkpoint(model, "someone/tiny-kvffn")
    assert order == []


def test_a_pull_request_against_another_branch_is_refused_before_anything_is_created(fake_hub, tmp_path, capsys):
    """huggingface_hub's `upload_folder` opens a pull request against the default branch only: `create_pr` with
    another `revision` was refused by it after the repository and the branch had been created (and, through
    `push_checkpoint`, the model saved). Refused first, naming both options and the ways that work."""
    from huggingface_hub import HfApi

    from hf_memffn.cli import main as cli_main

    with pytest.raises(ValueError, match="create_pr"):  # (huggingface_hub's own refusal, before any request)
        HfApi().upload_folder(repo_id="someone/tiny", folder_path=str(tmp_path), revision="dev", create_pr=True)
    model = tiny_model("kvffn")
    model.save_pretrained(tmp_path)
    for push in (lambda: hub.push_folder(tmp_path, "someone/tiny", revision="dev", create_pr=True),
                 lambda: hub.push_checkpoint(model, "someone/tiny", revision="dev", create_pr=True)):
        with pytest.raises(ValueError, match=r"create_pr=True \(--create-pr\) with revision='dev' .*'refs/pr/N'"):
            push()
    with pytest.raises(SystemExit) as stop:
        cli_main(["push", str(tmp_path), "someone/tiny", "--revision", "dev", "--create-pr"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1 and "revision='dev' (--revision)" in errors[0]
    assert fake_hub.calls == []


def test_push_to_a_pull_requests_ref_or_a_branch_the_user_may_not_create(fake_hub, tmp_path, monkeypatch):
    """As transformers' `push_to_hub` does: a pull request's ref (`revision="refs/pr/1"`, to add to an open pull
    request) is uploaded to without creating a branch of that name, which the Hub refuses (HTTP 400); a pull request
    opened against a branch of a repository the user cannot write to goes on where creating that branch is
    forbidden (HTTP 403); other refusals stop the push before anything is uploaded."""
    from hf_memffn.cli import main as cli_main

    create_branch = fake_hub.create_branch
    forbidden = []

    def hub_create_branch(repo_id, *, branch, **kwargs):
        if branch.startswith("refs/"):
            raise hub_http_error(400, f"Invalid reference for a branch: {branch}")
        if forbidden:
            raise hub_http_error(403, "Forbidden: you do not have write access")
        return create_branch(repo_id, branch=branch, **kwargs)

    monkeypatch.setattr(fake_hub, "create_branch", hub_create_branch)
    tiny_model("kvffn").save_pretrained(tmp_path)
    hub.push_folder(tmp_path, "someone/tiny", revision="refs/pr/1")
    assert [call[0] for call in fake_hub.calls] == ["create_repo", "upload_folder"]
    assert fake_hub.calls[-1][2]["revision"] == "refs/pr/1"
    assert cli_main(["push", str(tmp_path), "someone/tiny", "--revision", "refs/pr/2"]) == 0
    assert fake_hub.calls[-1][2]["revision"] == "refs/pr/2"

    forbidden.append(True)
    fake_hub.calls.clear()
    hub.push_folder(tmp_path, "someone/tiny", revision="main", create_pr=True)
    assert [call[0] for call in fake_hub.calls] == ["create_repo", "upload_folder"]
    assert (fake_hub.calls[-1][2]["revision"], fake_hub.calls[-1][2]["create_pr"]) == ("main", True)
    fake_hub.calls.clear()
    with pytest.raises(Exception, match="Forbidden"):
        hub.push_folder(tmp_path, "someone/tiny", revision="dev")
    assert [call[0] for call in fake_hub.calls] == ["create_repo"]


def test_cli_push(fake_hub, tmp_path, capsys):
    from hf_memffn.cli import main

    tiny_model("memoryllm").save_pretrained(tmp_path)
    assert main(["push", str(tmp_path), "someone/tiny-memoryllm", "--private"]) == 0
    assert "pushed" in capsys.readouterr().out
    assert set(fake_hub.uploaded) == NON_CODE_FILES | REMOTE_CODE_FILES["memoryllm"]


def test_pushing_a_saved_folder_names_the_repository_in_the_uploaded_card(fake_hub, tmp_path):
    """`save_pretrained` knows no repository, so its card's usage snippets show a placeholder path; the card that
    `push_folder` uploads names the repository, and the folder's own card and every other file are left as they are."""
    from hf_memffn.model_card import CARD_PLACEHOLDER_PATH

    tiny_model("kvffn").save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert CARD_PLACEHOLDER_PATH in card
    hub.push_folder(tmp_path, "someone/tiny-kvffn")

    uploaded = fake_hub.uploaded["README.md"].decode()
    assert uploaded == card.replace(CARD_PLACEHOLDER_PATH, "someone/tiny-kvffn") != card
    assert 'checkpoint = "someone/tiny-kvffn"' in uploaded and "pretrained=someone/tiny-kvffn," in uploaded
    assert (tmp_path / "README.md").read_text() == card
    assert fake_hub.uploaded.keys() == set(hub.staged_files(tmp_path))
    for name in fake_hub.uploaded.keys() - {"README.md"}:
        assert fake_hub.uploaded[name] == (tmp_path / name).read_bytes(), name


def test_a_card_already_naming_the_repository_is_uploaded_from_the_folder_itself(fake_hub, tmp_path, monkeypatch):
    folder_paths = []
    upload = fake_hub.upload_folder
    monkeypatch.setattr(fake_hub, "upload_folder",
                        lambda **kwargs: folder_paths.append(kwargs["folder_path"]) or upload(**kwargs))
    model = tiny_model("flash_mhf")
    model.save_pretrained(tmp_path)
    (tmp_path / "README.md").write_text(render_model_card(model, repo_id="someone/tiny"))
    hub.push_folder(tmp_path, "someone/tiny")
    assert folder_paths == [str(tmp_path)]


def test_pushing_a_folder_whose_card_names_another_repository_names_the_one_pushed_to(fake_hub, tmp_path):
    """A folder whose card names a repository (a Trainer's output_dir with `hub_model_id`, a folder staged for
    another repository) pushed to a second one: the uploaded card's snippets name the second; text outside the
    generated sections is left as it is."""
    model = tiny_model("memoryllm")
    model.save_pretrained(tmp_path)
    card = render_model_card(model, repo_id="alice/first", save_directory=tmp_path) + "\nAbout alice/first.\n"
    (tmp_path / "README.md").write_text(card)
    hub.push_folder(tmp_path, "bob/second")

    uploaded = fake_hub.uploaded["README.md"].decode()
    expected = render_model_card(model, repo_id="bob/second", save_directory=tmp_path) + "\nAbout alice/first.\n"
    assert uploaded == expected
    for snippet in ('checkpoint = "bob/second"', "export-tols bob/second TABLE_DIR", "pretrained=bob/second,"):
        assert snippet in uploaded, snippet



def test_pushing_to_a_repo_id_without_namespace_changes_only_the_snippets(fake_hub, monkeypatch):
    """The Hub puts `memoryllm` under the user's namespace; the card's snippets name the full id, and the rest of the
    card (the heading's `memffn_memoryllm`) is left as it is."""
    create_repo = fake_hub.create_repo
    monkeypatch.setattr(fake_hub, "create_repo", lambda repo_id, **kwargs: type(
        "RepoUrl", (), {"repo_id": "someone/" + create_repo(repo_id, **kwargs).repo_id})())
    model = tiny_model("memoryllm")
    hub.push_checkpoint(model, "memoryllm")

    card = fake_hub.uploaded["README.md"].decode()
    assert fake_hub.calls[-1][1] == "someone/memoryllm"
    assert card == render_model_card(model, repo_id="someone/memoryllm")

@pytest.mark.parametrize("card_names_the_repository", [False, True])
def test_push_folder_uploads_no_leftover_temporaries_or_caches(card_names_the_repository, fake_hub, tmp_path):
    """Files an interrupted write left (`atomic_write`'s hidden `*.tmp`) and caches (`.cache/`, which the Hub refuses
    in a commit) are not uploaded, whether the folder itself is uploaded or a staged copy with another card."""
    model = tiny_model("kvffn")
    model.save_pretrained(tmp_path)
    if card_names_the_repository:
        (tmp_path / "README.md").write_text(render_model_card(model, repo_id="someone/tiny"))
    checkpoint_files = set(hub.staged_files(tmp_path))
    for leftover in (".model.safetensors.4242.0a1b2c3d.tmp", ".README.md.4242.0a1b2c3d.tmp",
                     ".cache/huggingface/download/model.safetensors.metadata", ".cache/notes.txt",
                     "token_lookup/int8/.token_lookup-00001-of-00001.safetensors.4242.0a1b2c3d.tmp"):
        (tmp_path / leftover).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / leftover).write_text("left over")
    assert set(hub.staged_files(tmp_path)) == checkpoint_files
    hub.push_folder(tmp_path, "someone/tiny")
    assert set(fake_hub.uploaded) == checkpoint_files



def test_pushing_a_trainers_output_dir_leaves_out_its_checkpoint_folders(fake_hub, tmp_path):
    """The final model saved into the Trainer's output_dir next to its `checkpoint-*/` folders (weights and optimizer
    states): only the final model is uploaded, as `Trainer.push_to_hub` would."""
    model = tiny_model("kvffn")
    model.save_pretrained(tmp_path / "checkpoint-500")
    (tmp_path / "checkpoint-500" / "optimizer.pt").write_bytes(b"optimizer state")
    model.save_pretrained(tmp_path)
    hub.push_folder(tmp_path, "someone/tiny")
    assert set(fake_hub.uploaded) == NON_CODE_FILES | REMOTE_CODE_FILES["kvffn"]

def test_saving_again_rewrites_the_generated_sections_and_keeps_the_rest_of_the_card(tmp_path):
    """`save_pretrained` over an earlier save (another config): the card's generated sections and metadata describe
    the model saved now; the metadata attached before, the text the user wrote outside the generated sections and a
    Trainer's "Training" section are kept. A README.md the package did not write is left alone."""
    from huggingface_hub import ModelCard

    torch.manual_seed(0)
    small = AutoModelForCausalLM.from_config(tiny_config("memoryllm", num_hidden_layers=2))
    small.attach_card_metadata(license="apache-2.0", tags=["mine"])
    small.save_pretrained(tmp_path)
    card = tmp_path / "README.md"
    front_matter, body = card.read_text().split("\n---\n", 1)
    card.write_text(front_matter + "\n---\n\nAn introduction of the user's.\n" + body
                    + "\n## Training\n\nThe Trainer's summary.\n\n## Notes\n\nA note of the user's.\n")

    large = AutoModelForCausalLM.from_config(tiny_config("memoryllm", num_hidden_layers=4, hidden_size=128))
    large.save_pretrained(tmp_path)
    text = card.read_text()
    assert "| `num_hidden_layers` | `4` |" in text and "| `hidden_size` | `128` |" in text
    assert f"| total | {large.parameter_counts()['total']:,} " in text and "| `num_hidden_layers` | `2` |" not in text
    expected = render_model_card(large, save_directory=tmp_path).split("\n---\n", 1)
    assert text == (expected[0] + "\n---\n\nAn introduction of the user's.\n" + expected[1]
                    + "\n## Training\n\nThe Trainer's summary.\n\n## Notes\n\nA note of the user's.\n")
    data = ModelCard(text).data
    assert data.license == "apache-2.0" and "mine" in data.tags

    # fields the user added to the front matter stay; those the package generates are written anew
    front_matter, body = text.split("\n---\n", 1)
    card.write_text(front_matter.replace("library_name: transformers", "library_name: other")
                    + "\ninference: false\nwidget:\n- text: The capital of\n---\n" + body)
    large.save_pretrained(tmp_path)
    data = ModelCard(card.read_text()).data
    assert (data.inference, data.widget, data.library_name) == (False, [{"text": "The capital of"}], "transformers")
    assert data.license == "apache-2.0" and "mine" in data.tags
    assert card.read_text().count("An introduction of the user's.") == 1

    card.write_text("# My own card\n")
    large.save_pretrained(tmp_path)
    assert card.read_text() == "# My own card\n"


def test_the_pushed_card_lists_the_tables_in_subfolders(fake_hub, tmp_path):
    """The demo exports one table per format into `token_lookup/<format>/` of the MemoryLLM's checkpoint. The card
    (refreshed locally, and the one pushed) lists those subfolders and loads the first; the pushed files load so."""
    from hf_memffn.conversion.export import export_tols
    from hf_memffn.model_card import refresh_lookup_section

    model = tiny_model("memoryllm").eval()
    model.save_pretrained(tmp_path)
    for name in ("fp32", "int8"):
        export_tols(model, tmp_path / "token_lookup" / name, format=name, progress=False)
    assert "one subfolder each" not in (tmp_path / "README.md").read_text()
    hub.push_folder(tmp_path, "someone/tiny-memoryllm")
    card = fake_hub.uploaded["README.md"].decode()
    assert ("Tables exported from these weights are included in this folder, one subfolder each: "
            "`token_lookup/fp32`, `token_lookup/int8`.") in card
    assert 'model.load_tols(f"{checkpoint_dir}/token_lookup/fp32", placement="gpu")' in card
    assert 'snapshot_download("someone/tiny-memoryllm")' in card
    assert "token_lookup/int8/token_lookup.safetensors.index.json" in fake_hub.uploaded

    assert refresh_lookup_section(tmp_path)
    assert (tmp_path / "README.md").read_text() == card.replace("someone/tiny-memoryllm", "path/to/this/folder")

    folder = tmp_path.parent / "download"
    for name, data in fake_hub.uploaded.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    loaded.load_tols(f"{folder}/token_lookup/fp32", placement="cpu")
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_model_card_describes_architecture_config_and_parameters():
    model = tiny_model("flash_mhf")
    card = render_model_card(model)
    counts = model.parameter_counts()
    assert card.startswith("---\nlibrary_name: transformers")
    assert "# FlashMHFLlama (memffn_flash_mhf)" in card
    assert f"| total | {counts['total']:,}" in card
    for field in ("ffn_num_heads", "ffn_num_subnetworks", "subnetwork_size", "hidden_size", "num_hidden_layers"):
        assert f"| `{field}` | `{getattr(model.config, field)}` |" in card
    assert "trust_remote_code=True" in card and "Token lookup tables" not in card


def test_the_cards_parameter_counts_keep_their_full_size_under_zero3():
    """Under DeepSpeed ZeRO-3 the Trainer's final save writes the card from a model whose parameters are empty
    placeholders on each rank (the full size in `ds_numel`): the card counts the embedding as `parameter_counts`
    counts the rest (it said 0)."""
    model = tiny_model("memoryllm")
    expected = render_model_card(model)
    for param in model.parameters():  # what ZeRO-3 leaves on a rank: an empty tensor and the full size
        param.ds_numel = param.numel()
        param.data = torch.empty(0)
    card = render_model_card(model)
    assert f"| embedding (input) | {320 * 64:,} (20.48K) |" in card
    assert card == expected


@pytest.mark.parametrize("arch, fields, says, lists, omits", [
    ("flash_mhf", {"ffn_variant": "pkv"}, "parametric key-value baseline", ["ffn_num_heads"],
     ["ffn_num_subnetworks", "subnetwork_size", "ffn_num_kv_heads"]),
    ("flash_mhf", {"ffn_variant": "swiglu"}, "Llama's SwiGLU MLP", ["hidden_act"], ["ffn_num_heads"]),
    ("flash_mhf", {"ffn_variant": "mh_ffn", "ffn_num_subnetworks": 1}, "one SwiGLU sub-network, with no gates",
     ["ffn_num_heads", "ffn_num_subnetworks"], []),
    ("kvffn", {}, "`y = W_o(silu(W_k x + b_k) * (W_v x + b_v)) + b_o`: keys select", ["kvffn_inner_residual"],
     []),
    ("kvffn", {"kvffn_composition": "sum", "kvffn_activation": "gelu", "kvffn_inner_residual": True},
     "`y = W_o(gelu(W_k x + b_k) + (W_v x + b_v)) + b_o`", ["kvffn_composition"], []),
    ("kvffn", {"ffn_variant": "relu"}, "`y = W_o relu(W_k x + b_k) + b_o`", ["kvffn_bias"],
     ["kvffn_activation", "kvffn_composition", "kvffn_inner_residual"]),
    ("kvffn", {"ffn_variant": "densenet"}, "`y = W_o [relu(W_k x + b_k); x] + b_o`", ["kvffn_init"],
     ["kvffn_activation"]),
])
def test_the_card_describes_the_baseline_a_config_selects(arch, fields, says, lists, omits):
    """A baseline's card describes the baseline's block and lists the fields it reads, not the architecture's."""
    card = render_model_card(AutoModelForCausalLM.from_config(tiny_config(arch, **fields)))
    assert says in card
    assert ("inner residual" in card) == bool(fields.get("kvffn_inner_residual"))
    for field in lists:
        assert f"| `{field}` |" in card
    for field in omits:
        assert f"| `{field}` |" not in card


@pytest.mark.parametrize("variant", ["flash_mhf", "mh_ffn", "dense_moe"])
def test_the_card_says_the_pytorch_op_runs_the_ffn_where_the_config_forces_it(variant):
    """A FlashMHF config with `ffn_kernel="torch"` (as the demo saves a model on CUDA whose FFN heads the kernels do
    not take) runs the PyTorch op on CUDA too: its card said the fused Triton kernel ran there."""
    config = {"ffn_variant": variant, **{"flash_mhf": {}, "mh_ffn": {"ffn_num_subnetworks": 1},
                                         "dense_moe": {"ffn_num_heads": 1, "ffn_num_kv_heads": 1}}[variant]}
    card = render_model_card(AutoModelForCausalLM.from_config(tiny_config("flash_mhf", **config)))
    assert "On CUDA" in card and "fused Triton kernel" in card
    card = render_model_card(AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_kernel="torch", **config)))
    assert "On CUDA" not in card and "fused Triton kernel" not in card
    assert 'With `ffn_kernel="torch"` the FFN runs as its PyTorch op on every device, CUDA included.' in card


def test_memoryllm_card_says_whether_lookup_tables_are_attached(tmp_path):
    from hf_memffn.conversion.export import export_tols

    model = tiny_model("memoryllm").eval()
    card = render_model_card(model)
    assert "**Token lookup tables: not attached.**" in card and "model.load_tols(" in card
    counts = model.parameter_counts()
    assert f"| active (on the device once the FFNs on X0 are lookup tables) | {counts['active']:,}" in card

    export_tols(model, tmp_path, format="fp32", progress=False)
    model.load_tols(tmp_path, placement="cpu")
    card = render_model_card(model, save_directory=tmp_path)
    assert "**Token lookup tables: attached.**" in card and "`fp32` table" in card
    assert "is included in this folder" in card


def test_saving_into_a_folder_that_holds_a_table_says_so_in_the_card(tmp_path):
    """`save_pretrained` into the folder a table was exported to (a checkpoint saved again after `export-tols
    MODEL_DIR MODEL_DIR`): the card says the folder holds the table."""
    from hf_memffn.conversion.export import export_tols

    model = tiny_model("memoryllm").eval()
    export_tols(model, tmp_path, format="fp32", progress=False)
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "**Token lookup tables: not attached.**" in card and "is included in this folder" in card


def test_a_card_written_after_new_weights_are_saved_names_the_tables_of_the_old_ones(tmp_path):
    """Tables exported from a checkpoint's weights (at the folder's top and in a subfolder), then new weights saved
    into the folder (training went on): the card still said the folder holds a table and loaded it, which the new
    weights refuse. It names those tables as exported from other weights now; one exported from the new weights is
    listed as the folder's table again."""
    from hf_memffn.conversion.export import export_tols

    model = tiny_model("memoryllm").eval()
    model.save_pretrained(tmp_path)
    export_tols(model, tmp_path / "token_lookup" / "int8", format="int8", progress=False)
    export_tols(model, tmp_path, format="fp32", progress=False)
    with torch.no_grad():
        model.model.embed_tokens.weight[7] += 0.5  # (fine-tuned: one embedding row changed)
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    stale = ("The folder also holds tables exported from other weights than these, which a model loaded from it "
             "refuses (export them again): `token_lookup.safetensors.index.json` at its top, `token_lookup/int8`.")
    assert stale in card and "is included in this folder" not in card and "one subfolder each" not in card
    assert "hf-memffn export-tols path/to/this/folder TABLE_DIR --format bf16" in card
    export_tols(tmp_path, tmp_path, format="bf16", progress=False)
    card = (tmp_path / "README.md").read_text()
    assert "A table (`token_lookup.safetensors.index.json` and its shards) is included in this folder." in card
    assert ("is included in this folder. The folder also holds tables exported from other weights than these, "
            "which a model loaded from it refuses (export them again): `token_lookup/int8`.") in card


@pytest.mark.parametrize("model_dtype, loaded_in", [(None, "torch.bfloat16"), ("bf16", "torch.bfloat16"),
                                                     ("fp16", "torch.float16")])
def test_the_cards_snippet_loads_the_table_in_the_folder_in_a_dtype_that_takes_it(model_dtype, loaded_in, tmp_path):
    """A table exported from the weights in fp16 (`--model-dtype fp16`) is refused by the model loaded in bf16: the
    card's snippet for the table in the folder loads the model in fp16 then, in bf16 otherwise, and runs as written."""
    import re

    from hf_memffn.conversion.export import export_tols

    tiny_model("memoryllm").save_pretrained(tmp_path)
    export_tols(tmp_path, tmp_path, format="int8", model_dtype=model_dtype, progress=False)
    card = (tmp_path / "README.md").read_text()
    snippet = re.search(r"Load it from a local copy of this folder:\n\n```python\n(.*?)```", card, re.S).group(1)
    assert f"trust_remote_code=True, dtype={loaded_in})" in snippet
    snippet = (snippet.replace('snapshot_download("path/to/this/folder")', repr(str(tmp_path)))
               .replace('placement="gpu"', 'placement="cpu"'))
    namespace = {"torch": torch, "AutoModelForCausalLM": AutoModelForCausalLM}
    exec(snippet, namespace)  # (raises TokenLookupError where the model's dtype does not take the table)
    model = namespace["model"]
    assert model.dtype == getattr(torch, loaded_in.split(".")[1]) and model.model.token_lookup is not None


def test_exporting_into_a_saved_checkpoint_rewrites_the_cards_lookup_section(tmp_path):
    """`export-tols MODEL_DIR MODEL_DIR` after `save_pretrained`: the card written at save time said that no table
    was included. The export rewrites that section alone (metadata and a section the user added are kept), and a
    second export changes nothing."""
    from hf_memffn.conversion.export import export_tols

    model = tiny_model("memoryllm").eval()
    model.attach_card_metadata(license="apache-2.0")
    model.save_pretrained(tmp_path)
    card = tmp_path / "README.md"
    assert "is included in this folder" not in card.read_text()
    card.write_text(card.read_text() + "\n## Notes\n\nA note of the user's.\n")

    report = export_tols(tmp_path, tmp_path, format="int8", progress=False)
    assert report["model_card"] == str(card)
    expected = render_model_card(model, save_directory=tmp_path) + "\n## Notes\n\nA note of the user's.\n"
    assert "is included in this folder" in expected and card.read_text() == expected
    assert "model_card" not in export_tols(tmp_path, tmp_path, format="int8", progress=False)
    assert card.read_text() == expected


def test_the_rewritten_lookup_section_keeps_the_attached_tables_format(tmp_path):
    """A checkpoint saved while the model read a table (not in the folder): exporting a table into the folder keeps
    the card's "attached" status and format, adds that the folder holds a table, and leaves a card without the
    section alone."""
    from hf_memffn.conversion.export import export_tols
    from hf_memffn.model_card import refresh_lookup_section

    model = tiny_model("memoryllm").eval()
    export_tols(model, tmp_path / "table", format="fp32", progress=False)
    model.load_tols(tmp_path / "table", placement="cpu")
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "README.md").write_text(render_model_card(model, repo_id="someone/tiny"))
    assert refresh_lookup_section(folder) is False  # no table in the folder yet: the section is already right
    export_tols(tiny_model("memoryllm").eval(), folder, format="int8", progress=False)
    card = (folder / "README.md").read_text()
    assert card == render_model_card(model, repo_id="someone/tiny", save_directory=folder)
    assert "**Token lookup tables: attached.**" in card and "`fp32` table" in card and "someone/tiny" in card

    (folder / "README.md").write_text("# My own card\n")
    assert refresh_lookup_section(folder) is False and (folder / "README.md").read_text() == "# My own card\n"


def test_exporting_into_a_folder_leaves_a_readme_of_the_users_own_alone(tmp_path):
    """A README.md without the markers of this package's card is the user's (as `save_pretrained` leaves it alone):
    exporting a table into its folder keeps it byte for byte, even where it has a "Token lookup tables" section."""
    from hf_memffn.conversion.export import export_tols

    tiny_model("memoryllm").save_pretrained(tmp_path)
    own = ("# My model\n\n## Token lookup tables\n\nOur int8 tables live in the `tols-int8` repository.\n\n"
           "## License\n\nMIT\n")
    (tmp_path / "README.md").write_text(own)
    report = export_tols(tmp_path, tmp_path, format="int8", progress=False)
    assert "model_card" not in report and (tmp_path / "README.md").read_text() == own


@pytest.mark.parametrize("auto_class, pipeline_tag", [
    ("AutoModelForSequenceClassification", "text-classification"),
    ("AutoModelForTokenClassification", "token-classification"),
    ("AutoModelForQuestionAnswering", "question-answering"),
    ("AutoModel", "feature-extraction"),
])
def test_a_task_heads_card_names_its_task_and_loads_it_with_its_auto_class(auto_class, pipeline_tag, tmp_path):
    """The card of a task head (or a base model) is not a causal LM's: its pipeline tag is its task's, its snippets
    load it with its own Auto class (AutoModelForCausalLM would start an lm_head at random and drop the head), and
    lm-eval, which scores causal LMs, is left out. Exporting a table into the folder keeps all that, and the text the
    user wrote after the generated sections."""
    import transformers
    from huggingface_hub import ModelCard

    from hf_memffn.conversion.export import export_tols

    torch.manual_seed(0)
    model = getattr(transformers, auto_class).from_config(tiny_config("memoryllm", num_labels=3)).eval()
    model.save_pretrained(tmp_path)
    card = tmp_path / "README.md"
    card.write_text(card.read_text() + "\nA note of the user's.\n")
    export_tols(tmp_path, tmp_path, format="fp32", progress=False)
    text = card.read_text()
    assert text == render_model_card(model, save_directory=tmp_path) + "\nA note of the user's.\n"
    assert ModelCard(text).data.pipeline_tag == pipeline_tag
    assert f"model = {auto_class}.from_pretrained(checkpoint, trust_remote_code=True" in text
    assert f"model = {auto_class}.from_pretrained(checkpoint_dir, trust_remote_code=True" in text
    assert "is included in this folder" in text
    assert "AutoModelForCausalLM" not in text and "lm_eval" not in text


def test_push_includes_the_attached_lookup_table(fake_hub, tmp_path):
    from hf_memffn.conversion.export import export_tols

    model = tiny_model("memoryllm").eval()
    export_tols(model, tmp_path / "table", format="int8", progress=False)
    model.load_tols(tmp_path / "table", placement="cpu")
    hub.push_checkpoint(model, "someone/tiny-memoryllm-tol")

    table_files = {name for name in fake_hub.uploaded if name.startswith("token_lookup") and not name.endswith(".py")}
    assert table_files == set(hub.staged_files(tmp_path / "table")) and "token_lookup.safetensors.index.json" in table_files
    assert set(fake_hub.uploaded) == NON_CODE_FILES | REMOTE_CODE_FILES["memoryllm"] | table_files
    card = fake_hub.uploaded["README.md"].decode()
    assert "**Token lookup tables: attached.**" in card and "is included in this folder" in card

    folder = tmp_path / "download"
    folder.mkdir()
    for name, data in fake_hub.uploaded.items():
        (folder / name).write_bytes(data)
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    loaded.load_tols(folder, placement="cpu")
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("again", [{"format": "fp32", "max_shard_size": "2GB"},  # other shards: names gone
                                   {"format": "bf16", "max_shard_size": "25KB"}])  # same names, another table
def test_a_table_exported_again_after_load_tols_is_refused_before_anything_is_pushed_or_written(again, fake_hub,
                                                                                               tmp_path):
    """The model reads the table loaded from a folder; exported into that folder again since, the folder's files are
    another table: the shard names held in memory were copied with the index on disk (a FileNotFoundError half-way
    through the copy, or the other table pushed under the card of the one the model reads)."""
    from hf_memffn.conversion.export import export_tols

    model = tiny_model("memoryllm").eval()
    export_tols(model, tmp_path / "table", format="fp32", batch_size=64, max_shard_size="50KB", progress=False)
    model.load_tols(tmp_path / "table", placement="cpu")
    export_tols(model, tmp_path / "table", batch_size=64, progress=False, **again)
    refused = r"the token lookup table the model reads is no longer the one in .*table: a table was exported there"
    with pytest.raises(TokenLookupError, match=refused):
        hub.push_checkpoint(model, "someone/tiny-memoryllm-tol")
    with pytest.raises(TokenLookupError, match=refused):
        model.push_to_hub("someone/tiny-memoryllm-tol")
    assert fake_hub.uploaded == {}
    with pytest.raises(TokenLookupError, match=refused):
        hub.stage_checkpoint(model, tmp_path / "staged")
    assert not (tmp_path / "staged").exists()

    model.load_tols(tmp_path / "table", placement="cpu")  # (the table in the folder now)
    hub.push_checkpoint(model, "someone/tiny-memoryllm-tol")
    table_files = {name for name in fake_hub.uploaded if name.startswith("token_lookup") and not name.endswith(".py")}
    assert table_files == set(hub.staged_files(tmp_path / "table"))


def test_push_command_ends_a_network_failure_in_one_line(fake_hub, tmp_path, monkeypatch, capsys):
    """The HTTP client's transport errors (httpx2 under huggingface_hub 2, httpx under 1) are not OSErrors:
    `hf-memffn push` still ends in one line."""
    import importlib.util

    from hf_memffn.cli import main as cli_main

    name = next((name for name in ("httpx2", "httpx") if importlib.util.find_spec(name)), None)
    if name is None:
        pytest.skip("huggingface_hub's HTTP client (httpx2 or httpx) is not installed")
    client = importlib.import_module(name)

    def offline(**kwargs):
        raise client.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(fake_hub, "upload_folder", offline)
    tiny_model("kvffn").save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as stop:
        cli_main(["push", str(tmp_path), "someone/tiny"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stop.value.code == 2 and len(errors) == 1
    assert "push to someone/tiny failed: ConnectError: [Errno -3]" in errors[0]


class SwiGLUDecoderConfig(hf_memffn.MemFFNConfig):
    """A user's own architecture on the shared decoder: no `class_prefix`, so its config names no modeling code."""

    model_type = "test_hub_swiglu_decoder"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


class SwiGLUDecoderModel(hf_memffn.MemFFNModel):
    config_class = SwiGLUDecoderConfig


class SwiGLUDecoderForCausalLM(hf_memffn.MemFFNForCausalLM):
    config_class = SwiGLUDecoderConfig
    base_model_class = SwiGLUDecoderModel


class MemoryLLMWithANote(hf_memffn.MemoryLLMForCausalLM):
    """A user's subclass of a package class: its checkpoint's `auto_map` names this module, not the package's code."""


def test_the_card_of_a_users_own_classes_promises_no_remote_code_loading(tmp_path):
    """A model of a user's subclasses (a `MemFFNConfig` subclass without `class_prefix`, or a subclass of one of the
    package's model classes) is saved without modeling code that `trust_remote_code` loads it with: its card loads it
    with the class it was saved from, and says nothing of `trust_remote_code` (no `custom_code` tag, no lm-eval
    command through it). It promised `AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)`."""
    fields = {key: value for key, value in tiny_config("flash_mhf").to_dict().items()
              if key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
    torch.manual_seed(0)
    for name, model in (("swiglu", SwiGLUDecoderForCausalLM(SwiGLUDecoderConfig(**fields))),
                        ("memoryllm", MemoryLLMWithANote(tiny_config("memoryllm")))):
        model.save_pretrained(tmp_path / name)
        card = (tmp_path / name / "README.md").read_text()
        class_name = type(model).__name__
        assert "trust_remote_code=True" not in card and "custom_code" not in card and "lm_eval" not in card
        assert f"from {__name__} import {class_name}\n" in card
        assert f"model = {class_name}.from_pretrained(checkpoint, dtype=torch.bfloat16)" in card
        assert card == render_model_card(model, save_directory=tmp_path / name)
        type(model).from_pretrained(tmp_path / name)  # (what the card says loads it)
    assert "## Token lookup tables" in card  # (MemoryLLM's, without lm-eval's command either)
    package_card = render_model_card(tiny_model("memoryllm"))
    assert "trust_remote_code=True" in package_card and "custom_code" in package_card



def test_the_card_of_a_compiled_model_loads_it_as_the_model_it_wraps(tmp_path):
    """`torch.compile(model)` wraps the model in torch's `OptimizedModule`, whose `save_pretrained` and config are the
    model's: the card of a compiled model, written by `stage_checkpoint` (`hf-memffn push`, `push_checkpoint`), is the
    model's own card, loading it with `trust_remote_code` and its own Auto class. It told the user to load the
    checkpoint with `torch.nn.Module` (the wrapper's base class), with no word of the code saved beside the weights,
    and a base model's card named AutoModelForCausalLM."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    for auto_class in (AutoModelForCausalLM, AutoModel, AutoModelForSequenceClassification):
        model = auto_class.from_config(tiny_config("kvffn"))
        compiled = torch.compile(model)  # (never run: nothing is compiled)
        assert render_model_card(compiled) == render_model_card(model), auto_class.__name__
    hub.stage_checkpoint(torch.compile(tiny_model("kvffn")), tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True" in card
    assert "Module.from_pretrained" not in card and "torch.nn" not in card


def test_push_folder_uploads_no_modeling_code_copy_a_killed_save_left(fake_hub, tmp_path):
    """`config.save_pretrained` copies each modeling file under `<file>.<pid>.partial` and renames it: a save killed
    in between (SIGKILL, a power cut: no cleanup runs) left such a copy beside the checkpoint's files, which a later
    upload of the folder sent to the Hub with them."""
    model = tiny_model("kvffn")
    model.save_pretrained(tmp_path)
    checkpoint_files = set(hub.staged_files(tmp_path))
    (tmp_path / "modeling_memffn.py.4242.partial").write_text("left over")
    assert set(hub.staged_files(tmp_path)) == checkpoint_files
    hub.push_folder(tmp_path, "someone/tiny")
    assert set(fake_hub.uploaded) == checkpoint_files


def test_a_card_written_before_the_generated_sections_were_marked_gets_its_lookup_section_rewritten(fake_hub, tmp_path):
    """Earlier versions of the package wrote the same card without the markers around its generated sections. A
    table exported into the folder of such a checkpoint rewrites the card's "Token lookup tables" section (and only
    it) to say the folder holds the table, and a push of the folder uploads it so, where the card went on saying that
    no table was there ("export a table ... then load it from TABLE_DIR"). A README.md of the user's own stays alone
    (`test_exporting_into_a_folder_leaves_a_readme_of_the_users_own_alone`)."""
    from hf_memffn.conversion.export import export_tols
    from hf_memffn.model_card import GENERATED_END, GENERATED_START

    def unmarked(card: str) -> str:
        return "".join(line for line in card.splitlines(keepends=True)
                       if line.rstrip("\n") not in (GENERATED_START, GENERATED_END))

    model = tiny_model("memoryllm").eval()
    model.save_pretrained(tmp_path)
    card = tmp_path / "README.md"
    earlier = unmarked(card.read_text())
    card.write_text(earlier)
    assert "**Token lookup tables: not attached.**" in earlier and "is included in this folder" not in earlier
    report = export_tols(tmp_path, tmp_path, format="int8", progress=False)
    text = card.read_text()
    assert report.get("model_card") == str(card) and "is included in this folder" in text
    assert text == unmarked(render_model_card(model, save_directory=tmp_path))
    assert GENERATED_START not in text  # (the rest of the card as it was)
    card.write_text(earlier)
    hub.push_folder(tmp_path, "someone/tiny-memoryllm")
    assert "is included in this folder" in fake_hub.uploaded["README.md"].decode()
