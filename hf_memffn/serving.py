"""`hf-memffn serve`: transformers' own OpenAI-compatible server (`transformers serve`) for checkpoints of this package.

transformers 5.17-5.25 cannot serve a checkpoint whose modeling code lives next to its weights: the server's
model loader (`_load_model` in cli/serving/model_manager.py) looks `config.architectures[0]` up as an attribute of the
`transformers` module and never reads `auto_map`, so it stops with `AttributeError: module transformers has no
attribute KVFFNForCausalLM` before serving anything (docs/serving-remote-code.md has the reproduction and the fix
proposed upstream). This module is the bridge until then: it makes those names resolve to a loader that goes through
`AutoModelForCausalLM` (which follows `auto_map` and honours `--trust-remote-code`), optionally switches a MemoryLLM /
FlexMemoryLLM to its token lookup table, and runs transformers' `serve` command unchanged: same options, same
endpoints, continuous batching included. From 5.25 the server loads each model in a process it spawns, where the
names are made resolvable again (`SpawnedProcessBridge`).

    hf-memffn serve MODEL_DIR --trust-remote-code --continuous-batching [transformers serve options]
    hf-memffn serve MODEL_DIR --token-lookup TABLE_DIR --drop-memory-ffn --continuous-batching

The model comes first; every option but the `--token-lookup*` / `--drop-memory-ffn` ones is passed to `transformers
serve`. Without a model, the server loads whatever each request names, as `transformers serve` does.

The file imports only the standard library, huggingface_hub and transformers, so where this package is not installed
it runs as a plain script next to the checkpoint's own code: `python serving.py MODEL_DIR --trust-remote-code ...`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import runpy
import sys
from collections.abc import Sequence

import transformers

# The `architectures` names that `save_pretrained` writes for this package's models (the `*ForCausalLM` classes);
# checked against the package's registry by the tests. A served model's own `architectures` are added at start-up.
ARCHITECTURE_NAMES = (
    "FlashMHFLlamaForCausalLM",
    "MemoryLLMForCausalLM",
    "FlexMemoryLLMForCausalLM",
    "KVFFNForCausalLM",
)
PLACEMENTS = ("gpu", "cpu", "disk")  # token_lookup.PLACEMENTS (this file imports nothing of the package)
TABLE_INDEX_NAME = "token_lookup.safetensors.index.json"  # token_lookup.INDEX_NAME: the file every table has
# the `model_type`s with FFNs on the token embeddings, which `--token-lookup` can read from a table
MEMORY_MODEL_TYPES = ("memffn_memoryllm", "memffn_flex_memoryllm")
# cli_args.TOKENIZER_FILES: a folder holding none of them has no tokenizer for the server
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def is_hub_repo_id(name: str) -> bool:
    """Whether `name` has the form of a Hub repo id ('name' or 'namespace/name'); an absolute path, `./x` or `a/b/c`
    has not. (huggingface_hub's own check, as `hub.check_repo_id` makes it: this file runs alone too, as a plain
    script beside the checkpoints, where no sibling of the package can be imported.)"""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError:  # (huggingface_hub's HFValidationError)
        return False
    return True


def table_location_problem(token_lookup: str) -> str | None:
    """Why `token_lookup` can name no table (neither a local folder nor a Hub repo id), said with what is allowed;
    None if it is one of them."""
    allowed = (f"allowed: a local folder holding an exported table ({TABLE_INDEX_NAME} and its shards: hf-memffn "
               "export-tols MODEL_DIR TABLE_DIR), or a Hub repo id ('name' or 'namespace/name')")
    if os.path.isdir(token_lookup):
        return None
    if os.path.exists(token_lookup):
        return f"token lookup table {token_lookup!r} is a file, not a folder; {allowed}"
    if not is_hub_repo_id(token_lookup):
        return f"token lookup table {token_lookup!r}: no such folder, and not a Hub repo id; {allowed}"
    return None


def local_table_dir(token_lookup: str, revision: str | None = None) -> str:
    """A local folder as is; otherwise a Hub repo id, of which only the table files are downloaded. Anything else (a
    local path that does not exist, a file) is refused with what is allowed, as is a repo id that neither names a
    local folder nor could be read from the Hub."""
    problem = table_location_problem(token_lookup)
    if problem is not None:
        raise FileNotFoundError(problem)
    if os.path.isdir(token_lookup):
        return token_lookup
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(token_lookup, revision=revision, allow_patterns=["token_lookup*"])
    except (RepositoryNotFoundError, LocalEntryNotFoundError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FileNotFoundError(f"token lookup table {token_lookup!r}: no such local folder, and no Hub repo of that "
                                f"id could be read ({reason})") from error


# the fields of a table's index that must equal the model's config (token_lookup.check_table_matches compares them
# when the table loads, then the weights' fingerprint)
TABLE_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers")


def table_shape_mismatch(index_path: str, config: dict) -> str | None:
    """Which of `TABLE_SHAPE_FIELDS` the table indexed at `index_path` and the model's `config` (its config.json)
    disagree on, said as `field=N (the model has M)`; None if none (or if the index cannot be read: loading the
    table says what is wrong with it)."""
    try:
        with open(index_path) as handle:
            table = json.load(handle)["metadata"]["token_lookup"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(table, dict):
        return None
    differences = [f"{field}={table[field]} (the model has {config[field]})" for field in TABLE_SHAPE_FIELDS
                   if field in table and field in config and table[field] != config[field]]
    return ", ".join(differences) or None


def table_folder_problem(table_dir: str, config: dict, model_dir: str = "MODEL_DIR") -> str | None:
    """What the folder `table_dir` lacks as a token lookup table for the model of `config` (its config.json): a
    table at all, or one exported from a model of this shape; None if nothing (`model_dir` names the model in the
    export command said)."""
    index_path = os.path.join(table_dir, TABLE_INDEX_NAME)
    if not os.path.isfile(index_path):
        return (f"no token lookup table in this folder ({TABLE_INDEX_NAME} is missing); export one first: hf-memffn "
                f"export-tols {model_dir} TABLE_DIR")
    mismatch = table_shape_mismatch(index_path, config)
    if mismatch is not None:
        return (f"the table was exported from another model: {mismatch}; export this model's table: hf-memffn "
                f"export-tols {model_dir} TABLE_DIR")
    return None


def placement_problem(placement: str | None) -> str | None:
    """Why this machine cannot hold a table in `placement` (`gpu` without CUDA); None if it can."""
    if placement != "gpu":
        return None
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device; allowed here: cpu, disk"


def default_placement(model) -> str:
    """Where a token lookup table goes when no placement is named: "gpu" where the model's token embedding computes
    on CUDA, else "cpu" (`--device cpu` on a machine with CUDA keeps it on the host). An embedding that a device map
    offloaded has its weight on the meta device and computes where its offload hook puts it: `execution_device` of
    the `token_lookup` module beside the model's modeling code (the package's, or a checkpoint's own copy) knows that
    device, and this file imports nothing of the package by name."""
    if callable(getattr(model, "get_base_model", None)):  # (a PEFT model: its class's module is peft's)
        model = model.get_base_model()
    embedding = model.get_input_embeddings()
    package = type(model).__module__.rpartition(".")[0]
    try:
        execution_device = importlib.import_module(f"{package}.token_lookup").execution_device
    except (ImportError, AttributeError, TypeError, ValueError):  # (no such sibling, or code saved before it had one)
        device = embedding.weight.device
    else:
        device = execution_device(embedding)
    return "gpu" if device.type == "cuda" else "cpu"


def split_revision(model: str) -> tuple[str, str | None]:
    """`"org/model@dev"` -> `("org/model", "dev")`, as `transformers serve` names a model; an existing local path keeps
    an `@` as part of the path (`"/ckpt@1000"` -> `("/ckpt@1000", None)`)."""
    if os.path.exists(model):
        return model, None
    model_id, _, revision = model.partition("@")
    return model_id, revision or None


class TokenLookupSettings:
    """Which model reads which token lookup table, and how (the `--token-lookup*` options)."""

    def __init__(self, model: str, table: str, placement: str | None = None, drop_memory_ffn: bool = False):
        if placement is not None and placement not in PLACEMENTS:
            raise ValueError(f"--token-lookup-placement={placement!r} is not supported; allowed values: "
                             f"{', '.join(PLACEMENTS)}")
        self.arguments = (model, table, placement, drop_memory_ffn)
        self.model = model
        self.model_id, self.revision = split_revision(model)
        self.table = table
        self.placement = placement
        self.drop_memory_ffn = drop_memory_ffn

    def problem(self, config: dict) -> str | None:
        """What `apply` would refuse only once the server loads the model (`config`: the served model's config.json),
        said before the server starts; None if nothing."""
        if config.get("model_type") not in MEMORY_MODEL_TYPES:
            return (f"--token-lookup: {self.model} is a {config.get('model_type')!r} model, which has no token lookup "
                    "tables (only MemoryLLM and FlexMemoryLLM have FFNs on the token embeddings)")
        # a Hub repo id's table files are fetched now, as the model's load would fetch them (it then reads them from
        # the cache), so that a name that is neither a folder nor a readable repo is said here
        try:
            table_dir = local_table_dir(self.table, self.revision if self.table == self.model_id else None)
        except FileNotFoundError as error:
            return f"--token-lookup: {error}"
        folder_problem = table_folder_problem(table_dir, config, self.model_id)
        if folder_problem is not None:
            return f"--token-lookup {self.table}: {folder_problem}"
        if (problem := placement_problem(self.placement)) is not None:
            return f"--token-lookup-placement {self.placement}: {problem}"
        return None

    def applies_to(self, model_id: str, revision: str | None = None) -> bool:
        """Whether `transformers serve` loading `model_id` at `revision` loads the served model (it asks for a Hub
        repo's `main` when the model was named without a revision)."""
        if os.path.exists(model_id) and os.path.exists(self.model_id):
            return os.path.samefile(model_id, self.model_id)
        return model_id == self.model_id and (revision or "main") == (self.revision or "main")

    def apply(self, model) -> None:
        if getattr(model.config, "token_memory_size", None) is None:
            raise ValueError(f"--token-lookup: {type(model).__name__} has no token lookup tables (only MemoryLLM and "
                             "FlexMemoryLLM have FFNs on the token embeddings)")
        placement = self.placement or default_placement(model)
        # (a table in the served Hub repo itself is read at the served revision)
        revision = self.revision if self.table == self.model_id else None
        table = model.load_tols(local_table_dir(self.table, revision), placement=placement,
                                drop_memory_ffn=self.drop_memory_ffn)
        dropped = "memory FFN weights dropped" if self.drop_memory_ffn else "memory FFN weights kept"
        print(f"hf-memffn serve: {self.model} reads the token lookup table in {self.table} ({table.extra_repr()}); "
              f"{dropped}", file=sys.stderr, flush=True)


# hub.weights_variant's file names (this file imports nothing of the package): `save_pretrained(folder, variant="ema")`
# writes model.ema.safetensors, or model.safetensors.index.ema.json and shards that load through it
_VARIANT_WEIGHTS_FILE = re.compile(r"model\.safetensors\.index\.([^/]+)\.json|model\.([^/]+)\.safetensors")
_WEIGHTS_SHARD = re.compile(r".*-\d+-of-\d+\.safetensors")


def weights_variant(model_dir: str) -> str | None:
    """The variant of the weights in the local folder `model_dir` where it holds weights saved with a variant only,
    which `from_pretrained` finds only when given it (and `transformers serve` has no option for); else None. As
    `hub.weights_variant`: of several variants, the first by name."""
    if not os.path.isdir(model_dir):
        return None
    names = os.listdir(model_dir)
    if "model.safetensors" in names or "model.safetensors.index.json" in names:
        return None
    found = [match for match in map(_VARIANT_WEIGHTS_FILE.fullmatch, names)
             if match is not None and not _WEIGHTS_SHARD.fullmatch(match.string)]
    return min((match.group(1) or match.group(2) for match in found), default=None)


def auto_map_loader(architecture: str, token_lookup: TokenLookupSettings | None = None) -> type:
    """A stand-in for `transformers.<architecture>`: its `from_pretrained` loads through `AutoModelForCausalLM` (the
    weights of a folder saved with a variant only, too)."""

    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        if "variant" not in kwargs and (variant := weights_variant(str(pretrained_model_name_or_path))) is not None:
            kwargs["variant"] = variant
        model = transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if token_lookup is not None and token_lookup.applies_to(str(pretrained_model_name_or_path),
                                                                kwargs.get("revision")):
            token_lookup.apply(model)
        return model

    return type(architecture, (), {
        "__doc__": f"Loads checkpoints of `{architecture}` with AutoModelForCausalLM (their `auto_map`).",
        "from_pretrained": classmethod(from_pretrained),
    })


def make_architectures_resolvable(names: Sequence[str], token_lookup: TokenLookupSettings | None = None) -> list[str]:
    """Let `getattr(transformers, name)` find each architecture transformers does not have itself, in this process
    and in those the server spawns; returns those names. transformers' own classes are never replaced."""
    added = []
    for name in dict.fromkeys(names):
        try:
            getattr(transformers, name)
        except AttributeError:
            setattr(transformers, name, auto_map_loader(name, token_lookup))
            added.append(name)
    SpawnedProcessBridge(list(dict.fromkeys(names)), token_lookup).install()
    return added


# the module name under which this file runs again in a process the server spawns (see SpawnedProcessBridge)
SPAWNED_RUN_NAME = "hf_memffn_serving_in_spawned_process"


class SpawnedProcessBridge:
    """transformers 5.25 and later load each model in a process of the server's own (multiprocessing's "spawn"),
    into which the server's model loader is pickled; a fresh `transformers` there has none of the names above.
    `install` adds this object to the state the loader pickles; unpickling it runs this file again in that process
    (`runpy.run_path`, standard library only, so it works as a plain script too) with the same names and
    `--token-lookup*` settings, after importing hf_memffn there if this process had, as its models register there."""

    def __init__(self, names: Sequence[str], token_lookup: TokenLookupSettings | None = None):
        self.names = list(names)
        self.token_lookup = None if token_lookup is None else token_lookup.arguments
        self.import_package = "hf_memffn" in sys.modules

    def __reduce__(self):
        settings = {"SPAWNED_WITH": (self.names, self.token_lookup, self.import_package)}
        return runpy.run_path, (os.path.abspath(__file__), settings, SPAWNED_RUN_NAME)

    def install(self) -> bool:
        """Whether the server has a model loader to pickle (5.25 and later; earlier ones load in their own process)."""
        try:
            from transformers.cli.serving.model_manager import ModelLoader
        except ImportError:
            return False
        bridge = self

        def __getstate__(loader):
            return {**loader.__dict__, "hf_memffn_serving": bridge}

        ModelLoader.__getstate__ = __getstate__
        return True


def read_config(model_id: str, revision: str | None = None) -> dict:
    """A checkpoint's config.json, as a dict."""
    from transformers import PreTrainedConfig

    return PreTrainedConfig.get_config_dict(model_id, revision=revision)[0]


def auto_map_causal_lm(config: dict) -> str | None:
    """The class name a checkpoint's `auto_map` gives `AutoModelForCausalLM` (`"modeling_x.XForCausalLM"` or
    `"repo--modeling_x.XForCausalLM"` -> `"XForCausalLM"`); None if it names none."""
    entry = (config.get("auto_map") or {}).get("AutoModelForCausalLM")
    return entry.rpartition(".")[2] if isinstance(entry, str) else None


def remote_code_architectures(model_id: str, revision: str | None = None, config: dict | None = None) -> list[str]:
    """The `architectures` of a checkpoint that are the class its config maps `AutoModelForCausalLM` to in its own
    code (else []). A checkpoint saved with another head (`XForSequenceClassification`, ...) has none: loaded through
    `AutoModelForCausalLM`, it would get a causal LM head of random weights."""
    config = read_config(model_id, revision) if config is None else config
    causal_lm = auto_map_causal_lm(config)
    return [name for name in config.get("architectures") or [] if name == causal_lm]


def device_option(serve_args: Sequence[str]) -> str | None:
    """The `--device` among the arguments passed on to `transformers serve` (`--device X` or `--device=X`, the last
    one given, as the server takes it); None if none is given."""
    device = None
    for index, argument in enumerate(serve_args):
        if argument == "--device" and index + 1 < len(serve_args):
            device = serve_args[index + 1]
        elif argument.startswith("--device="):
            device = argument.partition("=")[2]
    return device


def device_problem(device: str) -> str | None:
    """Why `--device DEVICE` names a device this machine lacks (`cuda`, `cuda:N` or a GPU index without CUDA or past
    its GPUs, `mps` without MPS), said with what is allowed; None otherwise (`auto`, `cpu`, a `device_map` strategy:
    the server's own to judge). The server would start and fail loading the model, in a traceback."""
    import torch

    kind, _, index = device.partition(":")
    if device.isdigit():  # (a GPU index, as `device_map` takes it)
        kind, index = "cuda", device
    if kind == "mps" and not torch.backends.mps.is_available():
        return f"--device {device}: no MPS device on this machine; allowed here: auto, cpu"
    if kind != "cuda":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return f"--device {device}: no CUDA device on this machine; allowed here: auto, cpu"
    if index.isdigit() and int(index) >= count:
        return (f"--device {device}: this machine has {count} CUDA device(s); allowed here: auto, cpu, cuda, "
                f"cuda:0..{count - 1}")
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-memffn serve", allow_abbrev=False,
        description="transformers' OpenAI-compatible server (`transformers serve`) for checkpoints of this package. "
                    "Usage: hf-memffn serve [MODEL] [options]; options not listed here go to `transformers serve` "
                    "(see `transformers serve --help`): --continuous-batching, --trust-remote-code, --port, ...")
    # (`~` made the home folder, which the shell does not do after `=`: `--token-lookup=~/table`)
    parser.add_argument("--token-lookup", metavar="TABLE_DIR", type=os.path.expanduser,
                        help="MemoryLLM / FlexMemoryLLM: read the FFNs on the token embeddings from the table exported "
                             "to TABLE_DIR (`hf-memffn export-tols`; the model folder itself if the table is saved "
                             "there, or a Hub repo id); needs MODEL")
    parser.add_argument("--token-lookup-placement", choices=PLACEMENTS,
                        help="where the table lives (default: gpu when the model runs on CUDA, else cpu)")
    parser.add_argument("--drop-memory-ffn", action="store_true",
                        help="free the memory FFN weights once the table is loaded")
    return parser


SERVER_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic")  # what `transformers serve` checks before it starts


def missing_server_packages() -> list[str]:
    """The packages `transformers serve` needs that are not installed (transformers[serving])."""
    return [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    options, serve_args = parser.parse_known_args(argv)
    model = serve_args[0] if serve_args and not serve_args[0].startswith("-") else None
    if options.token_lookup is None and (options.token_lookup_placement or options.drop_memory_ffn):
        parser.error("--token-lookup-placement / --drop-memory-ffn need --token-lookup TABLE_DIR")
    token_lookup = None
    if options.token_lookup is not None:
        if model is None:
            parser.error("--token-lookup needs the model to serve as the first argument")
        token_lookup = TokenLookupSettings(model, options.token_lookup, options.token_lookup_placement,
                                           options.drop_memory_ffn)
    missing = missing_server_packages()
    if missing:  # (else the server's own ImportError, in a traceback, once the command line has been read)
        parser.error(f"the server needs {', '.join(missing)}, which transformers' serving extra installs and which "
                     "are not installed: pip install 'hf-memffn[serve]' (or pip install 'transformers[serving]')")
    device = device_option(serve_args)
    problem = None if device is None else device_problem(device)
    if problem is not None:
        parser.error(problem)
    names = list(ARCHITECTURE_NAMES)
    if model is not None:  # (read here, so that a wrong MODEL ends in one line, not in the server's traceback)
        model_id, revision = split_revision(model)
        allowed = ("allowed: a local checkpoint folder (save_pretrained), or a Hub repo id ('name' or "
                   "'namespace/name', @revision optional)")
        if os.path.isfile(model_id):
            parser.error(f"MODEL {model} is a file, not a folder; {allowed}")
        if os.path.isdir(model_id) and not os.path.isfile(os.path.join(model_id, "config.json")):
            parser.error(f"MODEL {model}: no config.json in this folder, so no model to serve; {allowed}")
        tokenizer_files = [os.path.join(model_id, name) for name in TOKENIZER_FILES]
        if os.path.isdir(model_id) and not any(os.path.isfile(path) for path in tokenizer_files):
            parser.error(f"{model_id} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), which the server "
                         "needs: save it with the model (model.attach_tokenizer(tokenizer) before save_pretrained)")
        if not os.path.exists(model_id) and not is_hub_repo_id(model_id):
            parser.error(f"MODEL {model}: no such folder, and not a Hub repo id; {allowed}")
        try:
            config = read_config(model_id, revision)
        except (OSError, ValueError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            parser.error(f"MODEL {model}: cannot read its config.json: {reason}")
        architectures = config.get("architectures") or []
        causal_lm = auto_map_causal_lm(config)
        if causal_lm is not None and architectures and architectures[0] != causal_lm \
                and not hasattr(transformers, architectures[0]):
            parser.error(f"MODEL {model} is a {architectures[0]} checkpoint (config.json's architectures), which does "
                         f"not generate text; the server takes a causal LM checkpoint ({causal_lm}): save the model "
                         "with its language modeling head")
        names += remote_code_architectures(model_id, revision, config)
        problem = token_lookup.problem(config) if token_lookup is not None else None
        if problem is not None:
            parser.error(problem)
    make_architectures_resolvable(names, token_lookup)

    from transformers.cli.transformers import app

    return int(app(args=["serve", *serve_args], prog_name="hf-memffn") or 0)


# `hf-memffn serve` passes its arguments through as they are (see cli.py)
PASS_THROUGH_ARGUMENTS = True

if __name__ == "__main__":
    raise SystemExit(main())
if __name__ == SPAWNED_RUN_NAME:  # in a model process of the server (SpawnedProcessBridge)
    spawned_names, spawned_token_lookup, spawned_import_package = globals()["SPAWNED_WITH"]
    if spawned_import_package:
        importlib.import_module("hf_memffn")
    make_architectures_resolvable(spawned_names, spawned_token_lookup and TokenLookupSettings(*spawned_token_lookup))
