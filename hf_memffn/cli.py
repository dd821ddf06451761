"""The `hf-memffn` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args)`; it is imported only when
chosen, and imports neither torch nor the models until `run` (nor does the package, started as this command: see
hf_memffn/__init__.py), so `hf-memffn --help`, a subcommand's `--help` and an argument error answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from . import import_architectures

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hf_memffn.demo_command", "train every architecture on the built-in fact world and compare them"),
    "push": ("hf_memffn.hub", "upload a saved checkpoint folder (weights, tokenizer, remote code, model card) to the Hub"),
    "export-tols": ("hf_memffn.export_command", "export a MemoryLLM's memory FFN as a token lookup table"),
    "analyze": ("hf_memffn.analyze_command",
                "what do the FFN memories store? a JSON + HTML report of a model's memories"),
    "serve": ("hf_memffn.serving", "serve checkpoints with transformers' OpenAI-compatible server (`transformers serve`)"),
}


class Terminated(KeyboardInterrupt):
    """SIGTERM, the signal a scheduler (Slurm, Kubernetes, `timeout`) stops a job with, raised like Ctrl-C's
    KeyboardInterrupt: Python's default for it ends the process on the spot, so a file being written stayed behind under
    its temporary name and `finally` blocks did not run."""


@contextlib.contextmanager
def sigterm_raises_terminated() -> Iterator[None]:
    """Within the block SIGTERM raises `Terminated` in the main thread, where nothing else handles SIGTERM (a handler
    that a caller installed, or a thread that cannot install one, leaves it as it is)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def interruption_exit(prog: str, stop: KeyboardInterrupt, hint: str = "") -> SystemExit:
    """Says in one line on stderr that Ctrl-C (SIGINT) or SIGTERM (`Terminated`) stopped `prog`, followed by `hint`
    where one is given, and returns the SystemExit to raise: status 128 + the signal's number, as a shell gives a
    process that the signal ended."""
    number, what = (signal.SIGTERM, "terminated (SIGTERM)") if isinstance(stop, Terminated) else (
        signal.SIGINT, "interrupted")
    print(f"{prog}: {what}{hint}", file=sys.stderr, flush=True)
    return SystemExit(128 + number)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-memffn", description="FFN-as-memory architectures for transformers.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module_name, help_text) in SUBCOMMANDS.items():
        # Each command's own arguments are added in `main`, so that running one command imports only its module.
        subparsers.add_parser(name, help=help_text, description=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # handles --help, and exits with an error naming the allowed commands
        parser.print_help()
        return 2
    name = argv[0]
    sub = argparse.ArgumentParser(prog=f"hf-memffn {name}", description=SUBCOMMANDS[name][1])
    try:
        # (a package the command needs that is not installed is named in one line, with the pip command that
        # installs it, when its `run` imports it)
        module = importlib.import_module(SUBCOMMANDS[name][0])
        if getattr(module, "PASS_THROUGH_ARGUMENTS", False):  # a wrapper around another command line: parses its own
            if not {"-h", "--help"} & set(argv[1:]):  # (its --help answers without the models too)
                import_architectures()
            return int(module.main(argv[1:]) or 0)
        module.add_arguments(sub)
        args = sub.parse_args(argv[1:])
        import_architectures()  # (what `import hf_memffn` does, deferred in this command until here)
        with sigterm_raises_terminated():
            result = module.run(args)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM
        raise interruption_exit(sub.prog, stop) from None
    except (ValueError, OSError, ImportError) as error:
        # Bad input found while running (a value a library refused, a missing or unwritable file, a package not
        # installed): one line. Other exceptions are bugs and keep their traceback; HF_MEMFFN_TRACEBACK=1 shows it
        # for these too.
        if os.environ.get("HF_MEMFFN_TRACEBACK"):
            raise
        from .cli_args import first_line, import_error_line

        line = import_error_line(error) if isinstance(error, ImportError) else first_line(error)
        sub.exit(2, f"{sub.prog}: error: {line}\n")
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
