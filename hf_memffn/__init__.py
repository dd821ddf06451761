"""hf-memffn: FFN-as-key-value-memory architectures for Hugging Face Transformers.

Importing the package registers FlashMHFLlama, MemoryLLM, FlexMemoryLLM and KVFFN with `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` and the task heads' Auto classes: `AutoModelForSequenceClassification`,
`AutoModelForTokenClassification` and `AutoModelForQuestionAnswering`.

The `hf-memffn` command (pyproject's script) defers that until a subcommand runs (`cli.main` calls
`import_architectures`): its `--help` and its argument errors answer without importing torch and transformers' models,
which take seconds.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"
COMMAND_NAME = "hf-memffn"  # pyproject.toml's [project.scripts]

if TYPE_CHECKING:
    from .public_api import *  # noqa: F403


def started_as_command() -> bool:
    """Whether this process is the `hf-memffn` command: the script pip installs, the program's main module, imports
    the package first. (A process that multiprocessing spawns from it has its arguments but another main module: it
    imports the whole package, as its parent does once a subcommand runs.)"""
    argv = getattr(sys, "argv", None) or [""]
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return (os.path.basename(argv[0]) == COMMAND_NAME and main_file is not None
            and os.path.abspath(main_file) == os.path.abspath(argv[0]))


def import_architectures() -> None:
    """Import the architectures, register them with the transformers Auto classes and set the names of
    `public_api` on the package (`__all__` lists the public ones): what `import hf_memffn` does. Idempotent."""
    from . import public_api

    public_api.register_auto_classes()
    globals().update((name, value) for name, value in vars(public_api).items() if not name.startswith("__"))
    globals()["__all__"] = list(public_api.__all__)


if not started_as_command():
    import_architectures()
