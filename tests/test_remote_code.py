"""A checkpoint saved by this package carries exactly the code of its architecture, loads with
`trust_remote_code=True` in a Python where `hf_memffn` cannot be imported, gives the same logits, and saves again."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_memffn
from hf_memffn.testing import BLOCK_PACKAGE_IMPORT, REMOTE_CODE_FILES, tiny_config, tiny_tokenizer

LOADER = BLOCK_PACKAGE_IMPORT + textwrap.dedent(
    """
    import json, os, sys

    try:
        import hf_memffn  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("hf_memffn is importable: the test would prove nothing")

    import torch
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto import modeling_auto

    results = {}
    for directory in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
        base = AutoModel.from_pretrained(directory, trust_remote_code=True)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        expected = torch.load(f"{directory}/expected.pt")
        with torch.no_grad():
            logits = model(expected["input_ids"]).logits
        prompt = tokenizer("the memory reads", return_tensors="pt")
        generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
        # label smoothing: the Trainer computes the loss itself and shifts the labels only for the classes transformers
        # names as causal LMs, which the remote code's import extends
        from transformers import Trainer, TrainingArguments
        args = TrainingArguments(output_dir=directory + "-trainer", label_smoothing_factor=0.1, use_cpu=True,
                                 report_to=[])
        ids = expected["input_ids"]
        with torch.no_grad():
            smoothed = Trainer(model=model, args=args).compute_loss(model, {"input_ids": ids, "labels": ids.clone()})
            shifted = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                                        label_smoothing=0.1)
        # the causal LM's checkpoint under each task head: its decoder's weights, a new head
        with torch.no_grad():
            hidden = base(ids).last_hidden_state
        heads = {}
        for auto_class, table in (("AutoModelForSequenceClassification", "SEQUENCE_CLASSIFICATION"),
                                  ("AutoModelForTokenClassification", "TOKEN_CLASSIFICATION"),
                                  ("AutoModelForQuestionAnswering", "QUESTION_ANSWERING")):
            head = getattr(transformers, auto_class).from_pretrained(directory, trust_remote_code=True,
                                                                     num_labels=3).eval()
            with torch.no_grad():
                output = head(ids, attention_mask=torch.ones_like(ids), use_cache=False)
                decoder_diff = (head.model(ids).last_hidden_state - hidden).abs().max().item()
            shapes = [list(value.shape) for value in output.values()]
            # (each pipeline looks for the class in its task's table)
            named = getattr(modeling_auto, f"MODEL_FOR_{table}_MAPPING_NAMES").get(model.config.model_type)
            heads[auto_class] = [type(head).__module__, type(head).__name__, shapes, decoder_diff, named]
        resaved = directory + "-resaved"
        model.save_pretrained(resaved)
        results[directory] = {
            "module": type(model).__module__,
            "base_class": type(base).__name__,
            "max_abs_diff": (logits - expected["logits"]).abs().max().item(),
            "label_smoothing_diff": (smoothed - shifted).abs().item(),
            "generated": generated[0].tolist(),
            "resaved": sorted(os.listdir(resaved)),
            "has_lookup_tables": any(c.__name__ == "TokenLookupMixin" for c in type(model).__mro__),
            "heads": heads,
        }
    with open(sys.argv[1], "w") as handle:
        json.dump(results, handle)
    """
)


@pytest.mark.parametrize("arch", sorted(hf_memffn.ARCHITECTURES))
def test_checkpoint_carries_exactly_the_code_of_its_architecture(arch, tmp_path):
    AutoModelForCausalLM.from_config(tiny_config(arch)).save_pretrained(tmp_path)
    carried = {path.name for path in tmp_path.glob("*.py")}
    assert carried == REMOTE_CODE_FILES[arch]
    assert not carried & {"hub.py", "model_card.py"}  # publishing is the package's job, not the checkpoint's
    assert ("token_lookup.py" in carried) == (arch in ("memoryllm", "flex_memoryllm"))
    assert ("flash_mhf_op.py" in carried) == (arch == "flash_mhf")
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert {reference.split(".")[0] + ".py" for reference in auto_map.values()} <= carried


README_CARRIED_ROW = {"flash_mhf": "FlashMHFLlama", "memoryllm": "MemoryLLM, FlexMemoryLLM", "kvffn": "KVFFN"}


def test_readme_counts_the_files_and_lines_each_checkpoint_carries():
    """README.md's table "Python files (lines)" under "Hub-ready checkpoints" counts what a saved checkpoint carries."""
    package = os.path.dirname(hf_memffn.__file__)
    with open(os.path.join(package, "..", "README.md"), encoding="utf-8") as handle:
        section = handle.read().split("\n## Hub-ready checkpoints\n")[1].split("\n## ")[0]
    rows = {cells[0]: cells[-1] for cells in (line.strip("| ").split(" | ") for line in section.splitlines()
                                              if line.startswith("| "))}
    for arch, row in README_CARRIED_ROW.items():
        files = REMOTE_CODE_FILES[arch]
        lines = 0
        for name in files:
            with open(os.path.join(package, name), encoding="utf-8") as handle:
                lines += sum(1 for _ in handle)
        assert rows[row] == f"{len(files)} ({lines:,})", f"README.md's row {row!r}: {len(files)} files, {lines:,} lines"


def test_trust_remote_code_without_the_package(tmp_path):
    tokenizer = tiny_tokenizer()
    directories, generated = [], {}
    for arch in hf_memffn.ARCHITECTURES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
        model.attach_tokenizer(tokenizer)
        directory = tmp_path / arch
        model.save_pretrained(directory)
        input_ids = torch.randint(0, 320, (2, 11))
        with torch.no_grad():
            logits = model(input_ids).logits
        torch.save({"input_ids": input_ids, "logits": logits}, directory / "expected.pt")
        prompt = tokenizer("the memory reads", return_tensors="pt")
        generated[str(directory)] = model.generate(**prompt, max_new_tokens=4, do_sample=False)[0].tolist()
        directories.append(str(directory))

    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    env["HF_HUB_OFFLINE"] = "1"
    completed = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "results.json"), *directories],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for directory in directories:
        result = results[directory]
        assert result["module"].startswith("transformers_modules."), result["module"]
        assert result["base_class"].endswith("Model")
        assert result["max_abs_diff"] < 1e-5, (directory, result["max_abs_diff"])
        assert result["generated"] == generated[directory]
        assert result["label_smoothing_diff"] < 1e-5, (directory, result["label_smoothing_diff"])
        # saved again without the package: the same code, and no model card (the package writes that)
        arch = os.path.basename(directory)
        assert {name for name in result["resaved"] if name.endswith(".py")} == REMOTE_CODE_FILES[arch]
        assert "README.md" not in result["resaved"]
        assert result["has_lookup_tables"] == (arch in ("memoryllm", "flex_memoryllm"))
        shapes = {"AutoModelForSequenceClassification": [[2, 3]], "AutoModelForTokenClassification": [[2, 11, 3]],
                  "AutoModelForQuestionAnswering": [[2, 11], [2, 11]]}
        assert result["heads"].keys() == shapes.keys()
        for auto_class, (module, name, shape, decoder_diff, named) in result["heads"].items():
            assert module.startswith("transformers_modules.") and name.endswith(auto_class[len("AutoModel"):]), result
            assert shape == shapes[auto_class] and decoder_diff < 1e-5 and named == name, result


BLOCK_TRITON_IMPORT = textwrap.dedent(
    """
    class _BlockTriton(_importlib_abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: a machine without triton)", name=name)
            return None


    _sys.meta_path.insert(0, _BlockTriton())
    """
)

HUB_LOADER = BLOCK_PACKAGE_IMPORT + BLOCK_TRITON_IMPORT + textwrap.dedent(
    """
    import json, sys

    import torch
    from huggingface_hub import hf_hub_download
    from transformers import AutoModelForCausalLM

    differences = {}
    for repo_id in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True).eval()
        expected = torch.load(hf_hub_download(repo_id, "expected.pt"))
        with torch.no_grad():
            differences[repo_id] = (model(expected["input_ids"]).logits - expected["logits"]).abs().max().item()
    with open(sys.argv[1], "w") as handle:
        json.dump(differences, handle)
    """
)


def test_a_hub_checkpoint_loads_without_the_package_on_a_machine_without_triton(tmp_path):
    """From the Hub, transformers fetches each file of a checkpoint's code and refuses it if it imports a package that
    is missing (outside a `try` block): the code's imports of triton, which a CPU machine may lack, are all guarded.
    The Hub's cache is stood in for by a folder of its layout (offline, `HF_HUB_CACHE`)."""
    from transformers.dynamic_module_utils import get_imports

    package = os.path.dirname(hf_memffn.__file__)
    for name in sorted(set().union(*REMOTE_CODE_FILES.values())):
        assert "triton" not in get_imports(os.path.join(package, name)), f"{name} imports triton outside a try block"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_ids = []
    for arch in sorted(hf_memffn.ARCHITECTURES):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
        repository = tmp_path / "hub" / f"models--someone--tiny-{arch}"
        snapshot = repository / "snapshots" / commit
        model.save_pretrained(snapshot)
        input_ids = torch.randint(0, 320, (2, 7))
        with torch.no_grad():
            torch.save({"input_ids": input_ids, "logits": model(input_ids).logits}, snapshot / "expected.pt")
        (repository / "refs").mkdir()
        (repository / "refs" / "main").write_text(commit)
        repo_ids.append(f"someone/tiny-{arch}")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    completed = subprocess.run([sys.executable, "-c", HUB_LOADER, str(tmp_path / "differences.json"), *repo_ids],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    differences = json.loads((tmp_path / "differences.json").read_text())
    assert set(differences) == set(repo_ids) and max(differences.values()) < 1e-5, differences


def run_without_the_package(script: str, tmp_path, *args) -> subprocess.CompletedProcess:
    """Runs `script` (which starts with BLOCK_PACKAGE_IMPORT) in a Python where `hf_memffn` cannot be imported,
    offline, with its own cache of the checkpoints' modeling code."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


PUSHER = BLOCK_PACKAGE_IMPORT + textwrap.dedent(
    """
    import json, os, sys

    import transformers.modeling_utils as transformers_modeling
    import transformers.utils.hub as transformers_hub
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers' uploads without the network: the repository's creation, the card it reads from the Hub and the
    # upload are replaced; the upload records the files of the folder it is given
    class Repository:
        def create_repo(self, repo_id, **kwargs):
            uploads.setdefault("created", []).append(repo_id)
            return type("RepoUrl", (), {"repo_id": repo_id})()


    class Card:
        def save(self, path):
            with open(path, "w") as handle:
                handle.write("transformers' card")


    uploads = {}


    def upload(self, folder, repo_id, *args, **kwargs):
        uploads[repo_id] = sorted(os.listdir(folder))
        return f"https://hub.invalid/{repo_id}/commit/1"


    for module in (transformers_hub, transformers_modeling):  # (save_pretrained's own upload reads the second)
        module.hf_api = Repository
        module.create_and_tag_model_card = lambda repo_id, tags=None, token=None: Card()
    transformers_hub.PushToHubMixin._upload_modified_files = upload

    directory = sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    if sys.argv[2] == "push_to_hub_reading_a_table":  # (the table's folder: sys.argv[4])
        model.load_tols(sys.argv[4], placement="cpu")
        model.push_to_hub("someone/with-table")
        model.push_to_hub("someone/without-table", include_token_lookup=False)
        model.save_pretrained(directory + "-saved", push_to_hub=True, repo_id="someone/saved")
        model.drop_memory_ffn()
        try:
            model.push_to_hub("someone/dropped")
        except ValueError as error:
            uploads["refused"] = str(error)
    elif sys.argv[2] == "push_to_hub":
        model.push_to_hub("someone/plain")
        model.push_to_hub("someone/with-tokenizer", tokenizer=tokenizer, tags=["memffn"])
        model.push_to_hub("someone/plain-again")
    else:
        model.attach_tokenizer(tokenizer)
        model.save_pretrained(directory + "-saved", push_to_hub=True, repo_id="someone/saved")
        uploads["saved locally"] = sorted(os.listdir(directory + "-saved"))
    with open(sys.argv[1], "w") as handle:
        json.dump(uploads, handle)
    """
)

CHECKPOINT_FILES = {"README.md", "config.json", "generation_config.json", "model.safetensors",
                    *REMOTE_CODE_FILES["kvffn"]}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}


def push_without_the_package(how: str, tmp_path) -> dict[str, list[str]]:
    """The files each upload of a KVFFN checkpoint loaded with `trust_remote_code` alone sent (PUSHER)."""
    torch.manual_seed(0)
    directory = tmp_path / "kvffn"
    AutoModelForCausalLM.from_config(tiny_config("kvffn")).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    completed = run_without_the_package(PUSHER, tmp_path, tmp_path / "uploads.json", how, directory)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((tmp_path / "uploads.json").read_text())


def test_push_to_hub_without_the_package_is_transformers_own(tmp_path):
    """Loaded with `trust_remote_code` alone, `push_to_hub` uploads through transformers' own: what `save_pretrained`
    writes, and the tokenizer it is given (for that push only)."""
    uploads = push_without_the_package("push_to_hub", tmp_path)
    assert set(uploads["someone/plain"]) == CHECKPOINT_FILES
    assert set(uploads["someone/with-tokenizer"]) == CHECKPOINT_FILES | TOKENIZER_FILES
    assert set(uploads["someone/plain-again"]) == CHECKPOINT_FILES


def test_save_pretrained_with_push_to_hub_without_the_package_uploads_the_attached_tokenizer(tmp_path):
    """`save_pretrained(folder, push_to_hub=True)` uploads what it writes in the folder, the attached tokenizer too
    (transformers' own upload there happens before the tokenizer is written)."""
    uploads = push_without_the_package("save_pretrained", tmp_path)
    assert set(uploads["saved locally"]) == CHECKPOINT_FILES - {"README.md"} | TOKENIZER_FILES
    assert set(uploads["someone/saved"]) == CHECKPOINT_FILES | TOKENIZER_FILES


def test_push_to_hub_without_the_package_uploads_the_token_lookup_table_the_model_reads(tmp_path):
    """A MemoryLLM loaded with `trust_remote_code` alone and reading a token lookup table pushes the table's files
    with it, as `hub.push_checkpoint` does (not with `include_token_lookup=False`, nor from `save_pretrained(folder,
    push_to_hub=True)`, which uploads what the folder holds). Once its memory FFN is dropped the push is refused
    before the repository is created."""
    from hf_memffn.conversion.export import export_tols

    torch.manual_seed(0)
    directory = tmp_path / "memoryllm"
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm"))
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    export_tols(model, tmp_path / "table", format="int8", progress=False)
    completed = run_without_the_package(PUSHER, tmp_path, tmp_path / "uploads.json", "push_to_hub_reading_a_table",
                                        directory, tmp_path / "table")
    assert completed.returncode == 0, completed.stderr[-3000:]
    uploads = json.loads((tmp_path / "uploads.json").read_text())
    checkpoint = CHECKPOINT_FILES - REMOTE_CODE_FILES["kvffn"] | REMOTE_CODE_FILES["memoryllm"]
    table = {"token_lookup.safetensors", "token_lookup.safetensors.index.json", "token_lookup_report.json"}
    assert set(uploads["someone/with-table"]) == checkpoint | table
    assert set(uploads["someone/without-table"]) == checkpoint
    assert set(uploads["someone/saved"]) == checkpoint
    assert "drop_memory_ffn" in uploads["refused"] and "someone/dropped" not in uploads["created"]


FROM_CONFIG = BLOCK_PACKAGE_IMPORT + textwrap.dedent(
    """
    import json, os, sys

    from transformers import AutoConfig, AutoModelForCausalLM

    results = {}
    for directory in sys.argv[2:]:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
        resaved = directory + "-resaved"
        config.save_pretrained(resaved)  # (the remote copy of the config, saved alone again)
        results[directory] = [type(model).__module__, type(model).__name__, model.num_parameters(),
                              sorted(name for name in os.listdir(resaved) if name.endswith(".py"))]
    with open(sys.argv[1], "w") as handle:
        json.dump(results, handle)
    """
)


def test_a_config_saved_alone_builds_its_model_without_the_package(tmp_path):
    """`config.save_pretrained(folder)` (a model's `model.config`, or a new config) writes the modeling code its
    `auto_map` names beside config.json, as `model.save_pretrained` does: `from_config` with `trust_remote_code` builds
    the model from that folder where the package is absent (the folder named modeling files it lacked)."""
    directories, parameters = [], {}
    for arch in sorted(hf_memffn.ARCHITECTURES):
        config = tiny_config(arch)
        directory = tmp_path / arch
        config.save_pretrained(directory)
        assert {path.name for path in directory.glob("*.py")} == REMOTE_CODE_FILES[arch]
        parameters[str(directory)] = AutoModelForCausalLM.from_config(config).num_parameters()
        directories.append(str(directory))
    completed = run_without_the_package(FROM_CONFIG, tmp_path, tmp_path / "results.json", *directories)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for directory in directories:
        module, name, count, resaved_code = results[directory]
        assert module.startswith("transformers_modules.") and name.endswith("ForCausalLM"), results[directory]
        assert count == parameters[directory]
        assert "configuration_memffn.py" in resaved_code


@pytest.mark.parametrize("installed", [True, False])
def test_attach_card_metadata_on_the_checkpoints_own_code_says_what_to_do(installed, tmp_path, monkeypatch):
    """A model built from the code saved with its checkpoint (`trust_remote_code` without hf_memffn imported first)
    cannot write the package's model card: `attach_card_metadata` said it "needs the hf-memffn package" even where the
    package is installed. It says to import hf_memffn before loading (and to install it first where it is absent); done
    so, the package's classes load the checkpoint and take the metadata."""
    import importlib.util

    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    AutoModelForCausalLM.from_config(tiny_config("kvffn")).save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    model_class = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(tmp_path))
    assert model_class.__module__.startswith("transformers_modules.")
    model = model_class.from_pretrained(tmp_path)
    if not installed:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *args: None if name == "hf_memffn" else find_spec(name, *args))
    with pytest.raises(RuntimeError, match="import hf_memffn before loading the model") as error:
        model.attach_card_metadata(license="mit")
    assert ("pip install hf-memffn" in str(error.value)) == (not installed)
    monkeypatch.undo()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)  # (hf_memffn is imported here)
    loaded.attach_card_metadata(license="mit")
    assert loaded.card_metadata["license"] == "mit"


# One process loads a checkpoint through its own copy of the code (`trust_remote_code`) and others through the package,
# in either order, with the other's copy imported in between: each copy registers the checkpoint conversions of its
# model types (`overwrite=True`) and the `memffn_v2` operators (the first copy's stay), so the later loads go through
# what the other copy registered. argv: results file, order ("remote-first" / "package-first"), then pairs of folders
# (the copy's, the package's).
TWO_COPIES = textwrap.dedent(
    """
    import json, sys

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    results_file, order, folders = sys.argv[1], sys.argv[2], sys.argv[3:]
    pairs = list(zip(folders[::2], folders[1::2]))
    results = {}

    def difference(model, folder):
        expected = torch.load(f"{folder}/expected.pt")
        with torch.no_grad():
            return (model.eval()(expected["input_ids"]).logits - expected["logits"]).abs().max().item()

    def through_its_code(folder):
        # (the copy's own class, imported from the folder even where the package's classes are registered)
        reference = AutoConfig.from_pretrained(folder, trust_remote_code=True).auto_map["AutoModelForCausalLM"]
        model = get_class_from_dynamic_module(reference, folder).from_pretrained(folder)
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        return model

    def through_the_package(folder):
        import hf_memffn  # noqa: F401

        model = AutoModelForCausalLM.from_pretrained(folder)
        assert type(model).__module__.startswith("hf_memffn."), type(model).__module__
        return model

    copies = {}
    for copy_folder, package_folder in pairs:
        if order == "remote-first":
            copies[copy_folder] = through_its_code(copy_folder)
            results[package_folder] = difference(through_the_package(package_folder), package_folder)
        else:
            results[package_folder + " before"] = difference(through_the_package(package_folder), package_folder)
            copies[copy_folder] = through_its_code(copy_folder)
            results[package_folder] = difference(through_the_package(package_folder), package_folder)
        # the copy's model after the other copy's import, and saved through the conversions registered last
        results[copy_folder] = difference(copies[copy_folder], copy_folder)
        copies[copy_folder].save_pretrained(copy_folder + "-resaved")
        results[copy_folder + " resaved"] = difference(through_the_package(copy_folder + "-resaved"), copy_folder)
    with open(results_file, "w") as handle:
        json.dump(results, handle)
    """
)


def other_conversions(text: str) -> str:
    """The file as a copy of the code that registers other checkpoint conversions (none) for its model types."""
    return re.sub(r"(register_checkpoint_conversion\w*\([^,()]+, )[A-Z_]+_CONVERSION\b", r"\1[]", text)


@pytest.mark.parametrize("copy", ["a-line-added", "other-conversions"])
@pytest.mark.parametrize("order", ["remote-first", "package-first"])
def test_a_checkpoints_own_copy_of_the_code_and_the_package_in_one_process_give_each_model_its_logits(tmp_path,
                                                                                                      order, copy):
    """The copy's files differ from the package's (a line added, as in an older copy, so it is imported as another
    module), or register other checkpoint conversions: the package's models give the logits they gave when saved
    (they loaded through the conversions that the copy imported last registered), and so do the copy's models where
    the copy converts as the package does, whichever copy was imported first."""
    folders = []
    for arch in sorted(hf_memffn.ARCHITECTURES):
        for role, seed in (("copy", 0), ("package", 1)):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
            with torch.no_grad():  # (weights no new model starts with: a weight that failed to load shows)
                for parameter in model.parameters():
                    parameter.mul_(1 + 0.1 * torch.randn_like(parameter))
            folder = tmp_path / f"{arch}-{role}"
            model.save_pretrained(folder)
            input_ids = torch.randint(0, 320, (2, 9))
            with torch.no_grad():
                torch.save({"input_ids": input_ids, "logits": model(input_ids).logits}, folder / "expected.pt")
            if role == "copy":
                for path in folder.glob("*.py"):
                    text = "# an older copy of this file\n" + path.read_text()
                    path.write_text(other_conversions(text) if copy == "other-conversions" else text)
            folders.append(str(folder))
    if copy == "other-conversions":
        assert other_conversions((tmp_path / "kvffn-package" / "modeling_kvffn.py").read_text()) != (
            tmp_path / "kvffn-package" / "modeling_kvffn.py").read_text()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(hf_memffn.__file__)))
    completed = subprocess.run([sys.executable, "-c", TWO_COPIES, str(tmp_path / "results.json"), order, *folders],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == len(folders) // 2 * (4 if order == "package-first" else 3)
    checked = {key: value for key, value in results.items() if copy == "a-line-added" or "-package" in key}
    assert all(difference < 1e-5 for difference in checked.values()), checked


# The schema of every operator of the `memffn_v2` namespace. Each file registers its operators once per process,
# whichever copy of it is imported first (the package, or a checkpoint's remote code, perhaps of another version), and
# the other copies call that copy's operators: an operator must keep its meaning (name, arguments, results, what it
# computes) for as long as the namespace stays the same.
OPERATOR_SCHEMAS = {
    "flash_mhf": "(Tensor q, Tensor k, Tensor u, Tensor v, Tensor r, str impl) -> Tensor",
    "flash_mhf_backward": "(Tensor grad_out, Tensor q, Tensor k, Tensor u, Tensor v, Tensor r, str impl) -> "
                          "(Tensor, Tensor, Tensor, Tensor, Tensor)",
    "flash_mhf_layer": "(Tensor p, Tensor? norm_weight, Tensor? router, Tensor weights, SymInt head_dim, float eps, "
                       "float gate_eps) -> Tensor",
    "flash_mhf_layer_backward": "(Tensor grad_out, Tensor p, Tensor? norm_weight, Tensor? router, Tensor weights, "
                                "SymInt head_dim, float eps, float gate_eps) -> (Tensor, Tensor, Tensor, Tensor)",
    "flash_mhf_layer_keeping_queries": "(Tensor p, Tensor? norm_weight, Tensor? router, Tensor weights, "
                                       "SymInt head_dim, float eps, float gate_eps) -> "
                                       "(Tensor, Tensor, Tensor, Tensor)",
    "flash_mhf_layer_backward_from_queries": "(Tensor grad_out, Tensor p, Tensor? norm_weight, Tensor? router, "
                                             "Tensor weights, Tensor q, Tensor r, Tensor totals, SymInt head_dim, "
                                             "float eps, float gate_eps) -> (Tensor, Tensor, Tensor, Tensor)",
    "flash_mhf_layer_backward_from_queries_frozen_weights": "(Tensor grad_out, Tensor p, Tensor? norm_weight, "
                                                            "Tensor? router, Tensor weights, Tensor q, Tensor r, "
                                                            "Tensor totals, SymInt head_dim, float eps, "
                                                            "float gate_eps) -> (Tensor, Tensor, Tensor)",
    "rotary_tables": "(Tensor position_ids, Tensor inv_freq, float scaling, ScalarType dtype) -> (Tensor, Tensor)",
    # (registered where triton is installed)
    "kvffn_paired_forward": "(Tensor y, SymInt activation, bool product) -> Tensor",
    "kvffn_paired_backward": "(Tensor y, Tensor grad_hidden, SymInt activation, bool product) -> Tensor",
    "token_lookup_add": "(Tensor hidden, Tensor row_ids, Tensor rows, Tensor? scales, SymInt layer_position, "
                        "SymInt hidden_size, SymInt format_code, SymInt group_size) -> Tensor",
    "token_lookup_gather_rows": "(Tensor token_ids, Tensor? slot_of_token, Tensor? cache, Tensor table) -> Tensor",
}


def test_the_operators_of_the_namespace_keep_their_schemas():
    """Every operator the package registers in its namespace has the schema pinned above, and every file names the
    same namespace: a changed or new operator under the old namespace fails here, with a message saying to bump it
    (a checkpoint's remote code of the old version, imported first, would otherwise run its own operator of that name
    for the new code, or the reverse)."""
    from hf_memffn import ffn_triton, flash_mhf_op, modeling_memffn, token_lookup_triton

    namespace = flash_mhf_op.OP_NAMESPACE
    named = {"flash_mhf_op.OP_NAMESPACE": namespace, "ffn_triton.OP_NAMESPACE": ffn_triton.OP_NAMESPACE,
             "token_lookup_triton.OP_NAMESPACE": token_lookup_triton.OP_NAMESPACE,
             "modeling_memffn.ROTARY_TABLES_OP": modeling_memffn.ROTARY_TABLES_OP.split("::")[0]}
    assert set(named.values()) == {namespace}, f"the operators' namespace differs between files: {named}"
    bump = (f"Operators are registered once per process by whichever copy of the code is imported first (the package "
            f"or a checkpoint's remote code), so an operator of {namespace!r} must never change: register the new "
            f"one under a new namespace (bump {namespace!r} in {', '.join(named)}), then pin it in OPERATOR_SCHEMAS")
    triton_only = {"kvffn_paired_forward", "kvffn_paired_backward", "token_lookup_add", "token_lookup_gather_rows"}
    expected = {name: schema for name, schema in OPERATOR_SCHEMAS.items()
                if name not in triton_only or (ffn_triton.TRITON_AVAILABLE and token_lookup_triton.HAS_TRITON)}
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith(f"{namespace}::")}
    assert registered == set(expected), (f"operators of {namespace!r} added {sorted(registered - set(expected))} or "
                                         f"gone {sorted(set(expected) - registered)}. {bump}")
    for name, schema in expected.items():
        actual = str(getattr(getattr(torch.ops, namespace), name).default._schema)
        pinned = f"{namespace}::{name}{schema}"
        assert actual == pinned, f"{namespace}::{name} has the schema {actual}, not the pinned {pinned}. {bump}"
