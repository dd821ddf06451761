"""Hub helpers: stage a checkpoint folder a stranger can use, and push it.

`push_checkpoint(model, repo_id)` saves the model (weights, config with `auto_map`, the flat remote-code files,
the attached tokenizer and the generated model card) into a temporary folder and uploads that folder in one commit.
`push_folder(folder, repo_id)` uploads a folder that `save_pretrained` already wrote, after checking it is complete.

The Hub client is created in one place, `_hub_client`, so tests replace exactly that boundary.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import posixpath
import re
import tempfile
from pathlib import Path

from .atomic_write import write_atomic
from .cli_args import first_line, local_path
from .model_card import TABLE_INDEX_NAME, card_for_repository, render_model_card

# What every folder written by `save_pretrained` of this package must hold (besides the weights).
REQUIRED_FILES = ("config.json", "README.md", "configuration_memffn.py", "modeling_memffn.py")
WEIGHTS_NAME = "model.safetensors"  # the weights of a checkpoint in one file, where `from_pretrained` looks for them
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"  # names the shards of a sharded checkpoint
# the same names with a variant (`save_pretrained(folder, variant="fp16")`, loaded by `from_pretrained(folder,
# variant="fp16")`): `model.fp16.safetensors`, `model.safetensors.index.fp16.json`; not a shard (`model-00001-of-00002.
# safetensors`, `model.fp16-00001-of-00002.safetensors`), which loads through its index only
_WEIGHTS_FILE = re.compile(r"model(\.[^/]+)?\.safetensors")
_WEIGHTS_INDEX_FILE = re.compile(r"model\.safetensors\.index(\.[^/]+)?\.json")
_WEIGHTS_SHARD = re.compile(r".*-\d+-of-\d+\.safetensors")
TABLE_FILE_PREFIX = "token_lookup"  # files of a token lookup table (`hf-memffn export-tols`): index, shards, report
# Never uploaded: what interrupted writes leave (`atomic_write`'s hidden `.<name>.<pid>.<random>.tmp`, and the
# `<file>.<pid>.partial` copies of the modeling code of `MemFFNConfig.save_pretrained`, remote code that cannot import
# `atomic_write`), and caches (`.cache/huggingface/` of a `--local-dir` download; the Hub refuses a commit with a file
# under `.cache/`), and the Trainer's `checkpoint-*/` folders (with optimizer states) in its output_dir, which
# `Trainer.push_to_hub` skips too.
UPLOAD_IGNORE_PATTERNS = ["*.tmp", "*.partial", ".cache/*", "*/.cache/*", "checkpoint-*/*"]


HUB_ERROR_MODULES = ("httpx", "httpx2", "requests", "huggingface_hub")  # where the Hub's and the network's errors live


@contextlib.contextmanager
def hub_errors_in_one_line(what: str):
    """The Hub's and the network's own errors raised in the block (httpx's are not OSErrors) as one ValueError,
    `<what>: <error class>: <its first line>`, which the command line prints in one line; other errors pass."""
    try:
        yield
    except Exception as error:
        if type(error).__module__.split(".")[0] not in HUB_ERROR_MODULES:
            raise
        raise ValueError(f"{what}: {type(error).__name__}: {first_line(error)}") from error


def check_repo_id(repo_id, field: str = "repo_id") -> str:
    """`repo_id` if it is a valid Hub repository id, else a ValueError naming `field` and what is allowed."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except ValueError as error:
        raise ValueError(f"{field}={repo_id!r} is not a Hub repository id ({first_line(error)}); allowed: "
                         "'name' or 'namespace/name', e.g. user/my-model-tols") from None
    return repo_id


def _hub_client(token: str | bool | None = None):
    """The huggingface_hub client every push goes through."""
    from huggingface_hub import HfApi

    return HfApi(token=token)


def staged_files(folder: str | os.PathLike) -> list[str]:
    """The files under `folder` that an upload of the folder sends (all but `UPLOAD_IGNORE_PATTERNS`), as sorted
    POSIX paths relative to it."""
    root = Path(folder)
    names = (path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())
    return sorted(name for name in names
                  if not any(fnmatch.fnmatch(name, pattern) for pattern in UPLOAD_IGNORE_PATTERNS))


def check_checkpoint_folder(folder: str | os.PathLike) -> list[str]:
    """Raise ValueError unless `folder` is a complete checkpoint of this package; return its files."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"folder={str(folder)!r} is not a directory")
    files = staged_files(root)
    missing = [name for name in REQUIRED_FILES if name not in files]
    # (`from_pretrained` reads the weights from these names at the top of the folder, with or without a variant:
    # shards without their index, or weights in a subfolder, do not load)
    indexes, single_files = _weights_files(files)
    weight_maps = [_json_object(root, index).get("weight_map") or {} for index in indexes]
    for weight_map in weight_maps:
        missing += sorted(set(weight_map.values()) - set(files))
    if not indexes and not single_files:
        missing.append(f"{WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} (weights)")
    if missing:
        raise ValueError(f"folder={str(folder)!r} is missing {missing}; write it with model.save_pretrained(folder)")
    shadowing = [(single_file, index) for single_file in single_files for index in indexes
                 if _variant_of(single_file) == _variant_of(index)]
    if shadowing:
        # (transformers' save_pretrained removes the shards of an earlier save, not its single file or index)
        single_file, index = shadowing[0]
        newer = max(shadowing[0], key=lambda name: (root / name).stat().st_mtime)
        raise ValueError(f"folder={str(folder)!r} holds both {single_file} and {index} with its shards, one of them "
                         f"left by an earlier save with another max_shard_size: from_pretrained loads {single_file} "
                         f"and ignores the shards. {newer} is the newer; remove the other's files")
    weight_names = [name for weight_map in weight_maps for name in weight_map]
    weight_names += [name for single_file in single_files for name in _safetensors_keys(root / single_file)]
    parametrized = _parametrized_weight_names(weight_names)
    if parametrized:
        raise ValueError(f"folder={str(folder)!r} stores {len(parametrized)} weights ({_some(parametrized)}) with "
                         "adapters or int8 attached (hf_memffn.adapters), which from_pretrained refuses; merge them "
                         "(adapters.merge_weight_lora) and save the model again")
    incomplete = _incomplete_tables(root, files)
    if incomplete:
        raise ValueError(f"folder={str(folder)!r} holds an incomplete token lookup table: {'; '.join(incomplete)}; "
                         "run `hf-memffn export-tols` into its folder again, or remove the table's token_lookup* files")
    config = _json_object(root, "config.json")
    if "auto_map" not in config:
        raise ValueError(
            f"folder={str(folder)!r}: config.json has no 'auto_map', so trust_remote_code loading cannot find the classes"
        )
    for module_file in _remote_code_files(config):
        if module_file not in files:
            raise ValueError(f"folder={str(folder)!r}: config.json's auto_map needs {module_file!r}, which is missing")
    missing_imports = _missing_relative_imports(root, files, _remote_code_files(config))
    if missing_imports:
        raise ValueError(f"folder={str(folder)!r} is missing {missing_imports}, imported by its modeling code, so "
                         "trust_remote_code loading would fail; write it with model.save_pretrained(folder)")
    return files


def _weights_files(files: list[str]) -> tuple[list[str], list[str]]:
    """The indexes of sharded weights and the weights in one file among `files` (names at the top of a folder, with
    or without a variant), the names `from_pretrained` looks for."""
    indexes = [name for name in files if _WEIGHTS_INDEX_FILE.fullmatch(name)]
    single_files = [name for name in files if _WEIGHTS_FILE.fullmatch(name) and not _WEIGHTS_SHARD.fullmatch(name)]
    return indexes, single_files


def weights_variant(folder: str | os.PathLike | None) -> str | None:
    """The variant the weights in `folder` were saved with (`save_pretrained(folder, variant="fp16")` writes
    `model.fp16.safetensors`, or `model.safetensors.index.fp16.json` and its shards), which `from_pretrained` finds
    only when given it; None where the folder holds weights without a variant, or none. (Of several variants, and
    none without, the first by name: each loads.)"""
    if folder is None or not os.path.isdir(folder):
        return None
    indexes, single_files = _weights_files(sorted(os.listdir(folder)))
    variants = [_variant_of(name) for name in indexes + single_files]
    return None if not variants or "" in variants else min(variants)


def weights_file_names(variant: str | None) -> tuple[str, str]:
    """The names `from_pretrained(folder, variant=variant)` reads the weights from: one file, and the index of
    shards."""
    infix = f".{variant}" if variant else ""
    return f"model{infix}.safetensors", f"model.safetensors.index{infix}.json"


def _variant_of(weights_name: str) -> str:
    """The variant in the name of a weights file or index of `_weights_files` ("fp16"), "" for none."""
    variant = (_WEIGHTS_INDEX_FILE.fullmatch(weights_name) or _WEIGHTS_FILE.fullmatch(weights_name)).group(1)
    return variant[1:] if variant else ""  # (the group is ".fp16")


def _json_object(root: Path, name: str) -> dict:
    """The JSON object in the file `name` of the checkpoint folder `root`; a ValueError naming the file where it is
    not one (cut short by an interrupted save: json's own error names no file)."""
    try:
        data = json.loads((root / name).read_text(encoding="utf-8"))
    except ValueError as error:  # (a JSONDecodeError, or a UnicodeDecodeError)
        raise ValueError(f"folder={str(root)!r}: {name} is not valid JSON ({first_line(error)}); write the folder "
                         "again with model.save_pretrained(folder)") from None
    if not isinstance(data, dict):
        raise ValueError(f"folder={str(root)!r}: {name} holds a JSON {type(data).__name__}, not an object; write the "
                         "folder again with model.save_pretrained(folder)")
    return data


def _safetensors_keys(path: Path) -> list[str]:
    """The tensor names in the safetensors file at `path` (a ValueError naming it where it is damaged)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception as error:  # (safetensors' errors of a damaged file have their own class)
        if type(error).__name__ != "SafetensorError":
            raise
        raise ValueError(f"{str(path)!r} is not a readable safetensors file ({first_line(error)}); write it with "
                         "model.save_pretrained(folder)") from None


def _parametrized_weight_names(tensor_names) -> list[str]:
    """The weights that `tensor_names` (a checkpoint's) store as parametrizations (`<module>.parametrizations.<weight>.
    original*`: an adapter or int8 of `hf_memffn.adapters` was attached when it was saved), as `<module>.<weight>`."""
    return sorted({module + "." + rest.split(".")[0] for module, _, rest in
                   (name.partition(".parametrizations.") for name in tensor_names) if rest})


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def refuse_parametrized_weights(model) -> None:
    """A ValueError, before anything is written, while weights of `model` have adapters or int8 attached
    (`hf_memffn.adapters`): saved so, they are stored as their parametrizations, which `from_pretrained` refuses."""
    from torch.nn.utils import parametrize

    parametrized = sorted(f"{module_name}.{name}" if module_name else name
                          for module_name, module in model.named_modules() if parametrize.is_parametrized(module)
                          for name in module.parametrizations)
    if parametrized:
        raise ValueError(f"{len(parametrized)} weights of the model ({_some(parametrized)}) have adapters or int8 "
                         "attached (hf_memffn.adapters): a checkpoint saved so stores them as such, which "
                         "from_pretrained refuses; merge them (adapters.merge_weight_lora(model)) before pushing")


def _incomplete_tables(root: Path, files: list[str]) -> list[str]:
    """What the token lookup tables among `files` (at the top of `root` or in a subfolder) lack: a shard that their
    index names and that is not there or not of the size the index records (cut short or altered: `load_tols`
    refuses it), an index for the shards of a folder that has none (an interrupted export)."""
    problems = []
    folders = {posixpath.dirname(name) for name in files
               if posixpath.basename(name).startswith(TABLE_FILE_PREFIX) and name.endswith(".safetensors")}
    for name in files:
        if posixpath.basename(name) == TABLE_INDEX_NAME:
            folders.add(posixpath.dirname(name))
    for table in sorted(folders):
        index = posixpath.join(table, TABLE_INDEX_NAME)
        if index not in files:
            problems.append(f"{table or '.'} holds token_lookup shards without {TABLE_INDEX_NAME} (an interrupted "
                            "export)")
            continue
        try:
            shards = json.loads((root / index).read_text(encoding="utf-8"))["metadata"]["token_lookup"]["shards"]
        except (ValueError, KeyError, TypeError):
            problems.append(f"{index} is not a token lookup table's index")
            continue
        missing = sorted(posixpath.join(table, shard) for shard in shards if posixpath.join(table, shard) not in files)
        if missing:
            problems.append(f"{index} names {missing}, which are missing")
            continue
        resized = sorted(posixpath.join(table, shard) for shard, record in
                         (shards.items() if isinstance(shards, dict) else ())
                         if isinstance(record, dict) and os.path.getsize(root / table / shard) != record.get("size"))
        if resized:
            problems.append(f"{index} names {resized}, whose size is not the one it records (cut short or altered)")
    return problems


def _missing_relative_imports(root: Path, files: list[str], module_files: set[str]) -> list[str]:
    """The Python files that `module_files` import relatively (`from .name import ...`, also through each other)
    and that are not among `files`."""
    from transformers.dynamic_module_utils import get_relative_imports

    needed, pending = set(), sorted(module_files)
    while pending:
        name = pending.pop()
        if name in needed:
            continue
        needed.add(name)
        if name in files:
            pending.extend(module.replace(".", "/") + ".py" for module in get_relative_imports(root / name))
    return sorted(needed - set(files))


def _remote_code_files(config: dict) -> set[str]:
    """The Python files named by config.json's auto_map (`"module.Class"` -> `module.py`)."""
    names = set()
    for reference in config.get("auto_map", {}).values():
        for ref in reference if isinstance(reference, (list, tuple)) else [reference]:
            if ref and "--" not in ref:  # "repo--module.Class" points at another repo
                names.add(ref.rsplit(".", 1)[0] + ".py")
    return names


def attached_table(model):
    """The token lookup table a MemoryLLM / FlexMemoryLLM model reads, or None."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    return getattr(base, "token_lookup", None)


def stage_checkpoint(
    model,
    folder: str | os.PathLike,
    tokenizer=None,
    repo_id: str | None = None,
    include_token_lookup: bool = True,
    max_shard_size: int | str | None = None,
    tags: list[str] | str | None = None,
) -> list[str]:
    """Write `model` (and `tokenizer`, if given, else the one attached to the model) into `folder`; return its files.

    If the model reads a token lookup table, the table's files (the shards its index names, the report, the index)
    are copied next to the weights (unless `include_token_lookup=False`). The model card is rendered again with
    `repo_id`, so its usage snippet names the Hub repository, and it says whether a table is included.
    `max_shard_size` goes to `save_pretrained`, `tags` into the card's metadata. A `tokenizer` given here is attached
    for the save only: the model keeps the tokenizer it had attached before (or none).
    """
    table = _table_to_stage(model, folder, include_token_lookup)
    return _write_checkpoint(model, folder, table, tokenizer, repo_id, max_shard_size, tags)


def _table_to_stage(model, folder: str | os.PathLike, include_token_lookup: bool):
    """The token lookup table whose files `stage_checkpoint` copies into `folder` (None: none, or it is there
    already); what `stage_checkpoint` refuses (weights saved with adapters or int8 attached, a table its checkpoint's
    `load_tols` would not take) is refused here, before anything is written."""
    from .token_lookup import check_table_to_save  # (torch: `hf-memffn push --help` answers without it)

    refuse_parametrized_weights(model)
    table = attached_table(model)
    if not include_token_lookup or table is None or Path(table.index.directory).resolve() == Path(folder).resolve():
        return None
    check_table_to_save(table.index, model)
    return table


def _write_checkpoint(model, folder: str | os.PathLike, table, tokenizer, repo_id: str | None,
                      max_shard_size: int | str | None, tags) -> list[str]:
    """The writing part of `stage_checkpoint`, the table `_table_to_stage` gave; returns the folder's files."""
    attach = getattr(model, "attach_tokenizer", None) if tokenizer is not None else None
    previous = getattr(model, "attached_tokenizer", None)
    if tokenizer is not None and attach is None:
        tokenizer.save_pretrained(folder)
    if attach is not None:
        attach(tokenizer)
    try:
        model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size is not None else {}))
        if table is not None:
            from .token_lookup import copy_table_files

            copy_table_files(table.index, folder)  # (the files its index names: not token_lookup.py, the remote code)
        write_atomic(Path(folder) / "README.md",
                     render_model_card(model, repo_id=repo_id, save_directory=folder, tags=tags))
    finally:
        if attach is not None:
            attach(previous)
    return check_checkpoint_folder(folder)


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    commit_description: str | None = None,
):
    """Create `repo_id` if needed and upload the checkpoint `folder` in one commit (huggingface_hub 2 with `hf_xet`
    installed commits a large folder in several batches); return the commit info.

    The uploaded model card names `repo_id` in its usage snippets and lists the token lookup tables the folder holds
    (`model_card.card_for_repository`); the card in `folder` itself is left as it is. Leftover temporary files and
    caches are not uploaded (`UPLOAD_IGNORE_PATTERNS`). The weights the repository held in other files under the
    same variant (`model.safetensors` where shards are pushed, or the reverse, or shards of another count) are
    removed in that commit: `from_pretrained` would load a `model.safetensors` left there, the earlier weights."""
    check_pull_request_target(revision, create_pr)
    files = check_checkpoint_folder(folder)
    client = _hub_client(token)
    repo_id = _create_repository(client, repo_id, private, revision, create_pr)
    return _upload_checkpoint(client, folder, files, repo_id, revision, commit_message, create_pr, commit_description)


def _create_repository(client, repo_id: str, private: bool | None, revision: str | None, create_pr: bool) -> str:
    """Create the model repository `repo_id` and the branch `revision` where missing; returns the repository's full
    id (`create_repo` puts "name" under the user's namespace)."""
    repo_id = client.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    if revision is not None and not revision.startswith("refs/pr/"):
        # (as transformers' `push_to_hub`: a pull request's ref is uploaded to as it is, the Hub refuses a branch of
        # that name; a pull request against a branch of a repository the user cannot write to may not create the
        # branch, HTTP 403, even where it exists: the upload says so where it does not)
        from huggingface_hub.errors import HfHubHTTPError

        try:
            client.create_branch(repo_id, branch=revision, exist_ok=True)
        except HfHubHTTPError as error:
            if not (create_pr and getattr(error.response, "status_code", None) == 403):
                raise
    return repo_id


def _upload_checkpoint(client, folder: str | os.PathLike, files: list[str], repo_id: str, revision: str | None,
                       commit_message: str | None, create_pr: bool, commit_description: str | None):
    """`push_folder`'s commit of the checked checkpoint `folder` (its `files`) into the repository `repo_id`."""
    with _as_the_repository_receives_it(folder, repo_id) as upload:
        return client.upload_folder(
            repo_id=repo_id,
            folder_path=str(upload),
            repo_type="model",
            revision=revision,
            commit_message=commit_message or "Upload model",
            commit_description=commit_description,
            create_pr=create_pr,
            ignore_patterns=UPLOAD_IGNORE_PATTERNS,
            delete_patterns=_replaced_weights_patterns(files),
        )


def check_pull_request_target(revision: str | None, create_pr: bool) -> None:
    """A ValueError where `create_pr` comes with a `revision` other than the default branch: huggingface_hub's
    `upload_folder` (1.x and 2.x) opens a pull request against the default branch only and refuses the pair, after
    the repository and the branch were created. Checked before anything is saved, created or uploaded."""
    if create_pr and revision not in (None, "main"):
        raise ValueError(f"create_pr=True (--create-pr) with revision={revision!r} (--revision): a pull request opens "
                         "against the default branch only (huggingface_hub's upload_folder refuses the pair); drop "
                         "the revision to open one there, or push to an open pull request with revision='refs/pr/N' "
                         "and no create_pr")


def _replaced_weights_patterns(files: list[str]) -> list[str]:
    """Patterns of the names of the weights, in one file or sharded, under the variants of the weights among `files`
    (those of a repository that an upload of `files` replaces; huggingface_hub keeps the files uploaded)."""
    patterns = []
    for variant in sorted({_variant_of(name) for names in _weights_files(files) for name in names}):
        infix = f".{variant}" if variant else ""
        patterns += [*weights_file_names(variant), f"model{infix}-*-of-*.safetensors"]
    return patterns


@contextlib.contextmanager
def _as_the_repository_receives_it(folder: str | os.PathLike, repo_id: str):
    """`folder` itself when its card is already the one `repo_id` should show; otherwise a temporary folder of
    links to its files, with that card as README.md (the weights are not copied)."""
    card = (Path(folder) / "README.md").read_text(encoding="utf-8")
    card_for_repo = card_for_repository(card, repo_id, folder)
    if card_for_repo == card:
        yield Path(folder)
        return
    with tempfile.TemporaryDirectory(prefix="memffn-push-") as staged:
        for name in staged_files(folder):
            if name != "README.md":
                link = Path(staged) / name
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink((Path(folder) / name).resolve(), link)
        (Path(staged) / "README.md").write_text(card_for_repo, encoding="utf-8")
        yield Path(staged)


def push_checkpoint(
    model,
    repo_id: str,
    *,
    tokenizer=None,
    include_token_lookup: bool = True,
    max_shard_size: int | str | None = None,
    tags: list[str] | str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    commit_description: str | None = None,
):
    """Save `model` with its model card, tokenizer, remote code (and attached token lookup table) into a temporary
    folder and push that folder in one commit (the keywords after `tags`: those of `push_folder`).

    As transformers' `push_to_hub`, the repository (and branch) is created before the model is saved: an offline
    machine, a token without write access or a repository id the Hub refuses fails at once, not after a save that
    takes minutes for a large model. What `stage_checkpoint` refuses is refused before either."""
    check_pull_request_target(revision, create_pr)
    with tempfile.TemporaryDirectory(prefix="memffn-push-") as folder:
        table = _table_to_stage(model, folder, include_token_lookup)
        client = _hub_client(token)
        repo_id = _create_repository(client, repo_id, private, revision, create_pr)
        files = _write_checkpoint(model, folder, table, tokenizer, repo_id, max_shard_size, tags)
        return _upload_checkpoint(client, folder, files, repo_id, revision, commit_message, create_pr,
                                  commit_description)


TRAINER_CARD_MARKER = "This model card has been generated automatically according to the information the Trainer"


def keep_model_card(trainer):
    """Make `trainer.create_model_card` (which `Trainer.push_to_hub` calls after saving) write this package's model
    card instead of transformers' generic one: the Trainer's summary (data, results, hyperparameters, versions)
    becomes its "Training" section and the metadata it knows (license, datasets, base model, tags) its metadata,
    on top of (tags: next to) the metadata attached to the model. The Trainer of a PEFT model saves its adapters
    alone, without config, weights or modeling code: its card stays the Trainer's, which PEFT completes (this
    package's card would describe, and load, files the folder lacks). Returns the trainer."""
    generic_card = trainer.create_model_card

    def create_model_card(**kwargs):
        generic_card(**kwargs)
        if not trainer.is_world_process_zero():
            return
        model = trainer.accelerator.unwrap_model(trainer.model)
        if saves_adapters_only(model):
            return
        from huggingface_hub import ModelCard

        path = Path(trainer.args.output_dir) / "README.md"
        generic = ModelCard.load(path)
        data = generic.data.to_dict()
        metadata = {key: data.get(key) for key in ("license", "datasets", "base_model", "language")}
        metadata["datasets"] = metadata["datasets"] or kwargs.get("dataset_tags") or kwargs.get("dataset")
        metadata["tags"] = [tag for tag in data.get("tags") or [] if tag != "generated_from_trainer"]
        card = render_model_card(model, repo_id=trainer.hub_model_id, save_directory=path.parent,
                                 training_summary=_training_summary(generic.text), **metadata)
        write_atomic(path, card)

    trainer.create_model_card = create_model_card
    return trainer


def saves_adapters_only(model) -> bool:
    """Whether `model.save_pretrained` writes PEFT adapters alone: a `PeftModel` (`get_peft_model`), or a model with
    adapters added through transformers' PEFT integration (`add_adapter`, `load_adapter`)."""
    if getattr(model, "_hf_peft_config_loaded", False):
        return True
    try:
        from peft import PeftMixedModel, PeftModel
    except ImportError:
        return False
    return isinstance(model, (PeftModel, PeftMixedModel))


def _training_summary(text: str) -> str:
    """The body of the Trainer's generic card, without its title and comment, its headings one level down."""
    lines = []
    for line in text.splitlines():
        if line.startswith("# ") or TRAINER_CARD_MARKER in line or line.startswith("should probably proofread"):
            continue
        lines.append("#" + line if line.startswith("#") else line)
    return "\n".join(lines).strip()


# --- `hf-memffn push` -------------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("folder", type=local_path, help="a folder written by model.save_pretrained")
    parser.add_argument("repo_id", help="the Hub repository, e.g. user/flashmhf-128m")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", default=None,
                        help="branch to push to (created if missing), or an open pull request's ref, refs/pr/N")
    parser.add_argument("--commit-message", default=None)
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")


def run(args) -> int:
    files = check_checkpoint_folder(args.folder)
    with hub_errors_in_one_line(f"push to {args.repo_id} failed"):
        info = push_folder(
            args.folder,
            args.repo_id,
            private=args.private or None,
            revision=args.revision,
            commit_message=args.commit_message,
            create_pr=args.create_pr,
        )
    print(f"pushed {len(files)} files to {args.repo_id}: {getattr(info, 'commit_url', info)}")
    return 0
