"""Argument types and checks shared by the `hf-memffn` subcommands.

Each fails with one line naming what was wrong and what is allowed (argparse prefixes the argument's name), before
anything is loaded or written.
"""

from __future__ import annotations

import argparse
import codecs
import os
import re

# A Hugging Face Hub repository id: `name` or `namespace/name`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
PEFT_ADAPTER_CONFIG = "adapter_config.json"  # (PEFT's and transformers' name of a saved adapter's config)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class UsageError(ValueError):
    """Bad input to a command: printed as one line, without a traceback."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid; allowed: an integer >= 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: a finite number > 0") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"{value} is invalid; allowed: a finite number > 0")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated integers, e.g. `0,11,23`; an empty text is an empty list."""
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: comma-separated integers, e.g. 0,11,23") from None


def nonempty_int_list(text: str) -> list[int]:
    """Comma-separated integers, at least one."""
    values = int_list(text)
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: comma-separated integers, e.g. 0,11,23")
    return values


def local_path(text: str) -> str:
    """`text` with a leading `~` (or `~user`) made the home folder, as the shell does for a word of its own but not
    after `=` (`--out=~/runs` would otherwise be a folder named `~` in the current directory)."""
    return os.path.expanduser(text)


def _directory_or_hub_id(text: str, what: str, holds, lacks: str) -> str:
    """`text` as a directory that `holds(path)` accepts, or as a Hub id such as `org/name`; else an
    ArgumentTypeError naming `what` the option takes (`lacks`: what a directory `holds` refuses is missing)."""
    path = local_path(text)
    if os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a file; allowed: a {what} directory or a Hub id")
    if os.path.isdir(path):
        if not holds(path):
            raise argparse.ArgumentTypeError(f"{text!r} {lacks}; allowed: a directory saved by save_pretrained, "
                                             "or a Hub id")
        return path
    if _HUB_ID.match(text) and not text.startswith((".", "~")):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} does not exist; allowed: a {what} directory or a Hub id such as "
                                     "org/name")


def model_source(text: str) -> str:
    """A saved model directory (with config.json), or a Hub id such as `org/name`."""
    path = local_path(text)
    saved = {name: os.path.isfile(os.path.join(path, name)) for name in ("config.json", PEFT_ADAPTER_CONFIG)}
    if saved[PEFT_ADAPTER_CONFIG] and not saved["config.json"]:
        raise argparse.ArgumentTypeError(
            f"{text!r} is a PEFT adapter ({PEFT_ADAPTER_CONFIG}, no config.json); allowed: a whole model's directory: "
            "merge the adapter into its base model first (PeftModel.from_pretrained(base_model, folder)"
            ".merge_and_unload(), then save_pretrained with the tokenizer)")
    return _directory_or_hub_id(text, "model", lambda path: os.path.isfile(os.path.join(path, "config.json")),
                                "has no config.json")


def tokenizer_source(text: str) -> str:
    """A directory holding a saved tokenizer (one of TOKENIZER_FILES), or a Hub id such as `org/name`."""
    return _directory_or_hub_id(text, "tokenizer", has_tokenizer,
                                f"holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def decode_utf8(data: bytes, source: str, first_line: int = 1, first_byte: int = 0) -> str:
    """A file's bytes as UTF-8 text, whatever the locale's encoding, without a leading byte order mark (as some
    Windows editors save UTF-8); a ValueError naming `source`, the line and the byte where they are not UTF-8.
    `data` may be a part of the file read on its own (a line): `first_line` and `first_byte` say where it starts."""
    start = len(codecs.BOM_UTF8) if first_byte == 0 and data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        byte = first_byte + start + error.start
        line = first_line + data[: start + error.start].count(b"\n")
        raise ValueError(f"{source}:{line}: not UTF-8 text ({error.reason} at byte {byte}); allowed: a UTF-8 "
                         "encoded file") from None


def output_dir(text: str) -> str:
    """A directory to write into: it may exist (as a directory) or not yet (then no file may stand where one of its
    parent folders would be created); the directory, or the nearest existing folder above it, must be writable (a
    command would otherwise fail only once its work is done, when it writes)."""
    if not text:  # (an unset shell variable, `--out "$OUT"`: not the current directory)
        raise argparse.ArgumentTypeError("'' is an empty path; allowed: a directory (created if missing)")
    path = local_path(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a file; allowed: a directory (created if missing)")
    parent = os.path.abspath(path) if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r} is inside {parent!r}, which is a file; allowed: a directory "
                                         "(created if missing) whose parent folders are folders or missing")
    if not os.access(parent, os.W_OK | os.X_OK):
        where = "is" if parent == os.path.abspath(path) else f"would be created in {parent!r}, which is"
        raise argparse.ArgumentTypeError(f"{text!r} {where} not writable by this user; allowed: a directory "
                                         "(created if missing) in a folder this user can write")
    return path



def refuse_an_output_dir_that_cannot_be_written(path, option: str) -> None:
    """`output_dir`'s check for a script that is not an argparse command: a ValueError naming `option` where `path`
    is a file, inside a file, or in a folder this user cannot write, raised before the script's work."""
    try:
        output_dir(str(path))
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"{option}: {error}") from None

def existing_file(text: str) -> str:
    path = local_path(text)
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {what}; allowed: an existing file")
    return path


def torch_device(text: str) -> str:
    """`auto`, `cpu`, `cuda`, `cuda:N`, `mps`: a device this machine has."""
    if text == "auto":
        return text
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; allowed: auto, cpu, cuda, cuda:N, mps") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported; allowed: auto, cpu, cuda, cuda:N, mps")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no MPS device on this machine; allowed here: cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device on this machine; allowed here: cpu")
    problem = missing_gpu(device)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


def missing_gpu(device) -> str | None:
    """What is wrong with a `cuda:N` (a `torch.device`) this machine does not have; None for any other device."""
    if device.type != "cuda" or device.index is None:
        return None
    import torch

    count = torch.cuda.device_count()
    if device.index < count:
        return None
    return f"this machine has {count} CUDA device(s); allowed here: cpu, cuda, cuda:0..{count - 1}"


def has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


def load_causal_lm(source: str, what: str = "MODEL_DIR", auto_class: str = "AutoModelForCausalLM", **kwargs):
    """`AutoModelForCausalLM.from_pretrained(source, **kwargs)` (or another transformers Auto class, `auto_class`)
    with a one-line error for an unreadable checkpoint.
    A local folder whose weights were saved with a variant (`save_pretrained(folder, variant="fp16")`) loads with
    that variant, which `from_pretrained` needs to find them and which the commands have no option for."""
    import transformers

    import hf_memffn  # noqa: F401  (registers the architectures)
    from .hub import weights_variant

    if "variant" not in kwargs and (variant := weights_variant(source)) is not None:
        kwargs["variant"] = variant
    try:
        return getattr(transformers, auto_class).from_pretrained(source, **kwargs)
    except (OSError, ValueError, SyntaxError, ImportError) as error:
        raise UsageError(f"{what} {source}: cannot load the model: {first_line(error)}") from error
    except Exception as error:  # safetensors' errors of a damaged file have their own class
        if type(error).__name__ != "SafetensorError":
            raise
        raise UsageError(f"{what} {source}: damaged weights file: {first_line(error)}") from error


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


# The extra of pyproject.toml that installs each optional package a command imports; the packages not named here are
# base dependencies, which `pip install hf-memffn` installs.
PACKAGE_EXTRAS = {"triton": "triton", "datasets": "train", "accelerate": "train", "peft": "train", "lm_eval": "eval",
                  "onnx": "onnx", "onnxscript": "onnx", "fastapi": "serve", "uvicorn": "serve", "openai": "serve",
                  "pydantic": "serve"}


def install_hint(package: str) -> str:
    """The pip command that installs `package` (a top-level module name) for this package's features."""
    extra = PACKAGE_EXTRAS.get(package)
    if extra is None:
        return f"pip install {package} (a dependency of hf-memffn: pip install hf-memffn installs it)"
    return f"pip install 'hf-memffn[{extra}]' (or pip install {package})"


def import_error_line(error: ImportError) -> str:
    """One line for an ImportError: for a package that is not installed, its name and the pip command that installs
    it; otherwise the error's first line (a name missing from a module that is there is not solved by installing)."""
    package = (error.name or "").split(".")[0] if isinstance(error, ModuleNotFoundError) else ""
    if not package or package == __name__.split(".")[0]:
        return first_line(error)
    return f"needs the {package!r} package, which is not installed: {install_hint(package)}"
