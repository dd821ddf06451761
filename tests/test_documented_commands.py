"""Every command the documentation shows is a real command: the script or subcommand exists, each flag is one its
parser knows (with a value where it takes one), each named value (architecture, preset, task, choice) is one it
accepts, and each repository file it names exists.

The commands are taken from the fenced and indented code blocks and the inline code of README.md, docs/*.md,
conversion/README.md and the READMEs under examples/ and kernels/; nothing is run: each script's parser is built as
its main builds it (its main stopped at the parse) and given the documented arguments. kernels/flash_mhf_notes.md is
a dated log of what was run at each commit, so it is not held to today's parsers here.

Each Python name of the package (`hf_memffn.flash_mhf_op.flash_mhf_path`) that these documents or the package's own
docstrings and comments give is a module or an attribute of one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib
import importlib.util
import io
import itertools
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = sorted({"README.md", "conversion/README.md",
                    *(os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
                    *(os.path.relpath(path, ROOT) for folder in ("examples", "kernels")
                      for path in glob.glob(os.path.join(ROOT, folder, "**", "README*"), recursive=True))})
SCRIPT_FOLDERS = ("examples/", "kernels/", "conversion/", "scripts/")
REPOSITORY_FOLDERS = (*SCRIPT_FOLDERS, "tests/", "docs/", "hf_memffn/")
# what starts a command the documentation shows (after `VAR=value` settings)
PROGRAMS = ("hf-memffn", "python", "python3", "accelerate", "bash", "torchrun", "pytest", "pip")
ELISION = "..."
# a name that stands for the reader's own value: DIR, MODEL_DIR, OUT, N, ... (or a shell variable, `$a`)
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
# the options (their dest) that name presets of examples/presets.py where they have no choices
PRESET_OPTIONS = {"size", "sizes", "decode_sizes", "compile_sizes", "presets", "preset"}
# environment variables that other programs read (Python, CUDA, transformers' test suite)
OTHER_PROGRAMS_SETTINGS = {"PYTHONPATH", "CUDA_VISIBLE_DEVICES", "RUN_SLOW"}
# the flags whose value is a file or folder that the command writes: it need not exist yet
OUTPUT_FLAGS = {"--out", "--output-dir", "--markdown", "--json", "--work", "--cache"}


# --- finding the commands -------------------------------------------------------------------------------------------


def _code_and_prose(text: str) -> tuple[list[tuple[int, str]], str]:
    """(the lines of fenced blocks and of indented command lines, as (line number, text)) and the rest of the
    document with those lines blanked (the line numbers kept)."""
    code, prose, fence, continued = [], [], None, False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            prose.append("")
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
            else:
                code.append((number, line))
            prose.append("")
        elif line.startswith("    ") and "`" not in line and (continued or _starts_a_command(stripped)):
            code.append((number, line))
            prose.append("")
        else:
            prose.append(line)
        # (an indented command continued with a backslash goes on on the next line, whatever that starts with)
        continued = bool(code) and code[-1][0] == number and fence is None and line.rstrip().endswith("\\")
    return code, "\n".join(prose)


def _starts_a_command(text: str) -> bool:
    words = text.split()
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words = words[1:]
    return bool(words) and words[0] in PROGRAMS


def _joined_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines continued with a trailing backslash joined into one."""
    joined, pending, first = [], "", None
    for number, line in lines:
        if first is None:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((first, pending + line))
        pending, first = "", None
    if pending:
        joined.append((first, pending))
    return joined


def _words(text: str) -> list[str] | None:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: prose, not a command
        return None


def _expanded_braces(word: str) -> list[str]:
    """`a{b,c}d` -> [`abd`, `acd`], as bash expands it (groups side by side, not nested)."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", word)
    if len(parts) == 1:
        return [word]
    choices = [[part] if index % 2 == 0 else part.split(",") for index, part in enumerate(parts)]
    return ["".join(pieces) for pieces in itertools.product(*choices)]


def _simple_commands(text: str, variables: dict[str, str]) -> list[list[str]]:
    """The simple commands of one shell line: split at `;`, `&&`, `|` and the like, `for` loops opened (the loop
    variable set to its first value), `VAR=value` lines remembered in `variables` and expanded in later commands."""
    def expand(match):
        return variables.get(match.group(1) or match.group(2), match.group(0))

    text = text.strip()
    if text.startswith("$ "):  # a shell prompt
        text = text[2:]
    words = _words(re.sub(r"\$\{(\w+)\}|\$(\w+)", expand, text))
    if words is None:
        return []
    commands, current = [], []
    for word in [*words, ";"]:
        if word and set(word) <= set(";&|()<>"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    simple = []
    for words in commands:
        while words and words[0] in ("do", "then", "else", "time", "export"):
            words = words[1:]
        if words[:1] == ["for"] and len(words) > 3 and words[2] == "in":
            variables[words[1]] = _expanded_braces(words[3])[0]
            continue
        settings = list(itertools.takewhile(lambda word: re.fullmatch(r"[A-Za-z_]\w*=.*", word), words))
        if len(settings) == len(words):
            variables.update(setting.split("=", 1) for setting in settings)
        elif words[len(settings)] in PROGRAMS:
            simple.append(words)
        elif len(words) > len(settings) + 1 and _named_script(words[len(settings)]):
            # `bench_models.py --tasks ...`: a script named by itself, with the arguments it was run with
            script = _named_script(words[len(settings)])
            program = "bash" if script.endswith(".sh") else "pytest" if script.startswith("tests/") else "python"
            simple.append([*settings, program, script, *words[len(settings) + 1:]])
    return simple


@functools.cache
def _named_script(word: str) -> str | None:
    """The repository script that `word` names (`kernels/bench_models.py`, or `bench_models.py` where one script
    has that name) if it reads a command line, else None."""
    if not word.endswith((".py", ".sh")):
        return None
    paths = [path for folder in (*SCRIPT_FOLDERS, "tests/")
             for path in glob.glob(os.path.join(ROOT, folder, "**", os.path.basename(word)), recursive=True)
             if path.endswith(os.sep + word) or path == os.path.join(ROOT, word)]
    if len(paths) != 1:
        return None
    source = open(paths[0], encoding="utf-8").read()
    if word.endswith(".py") and not word.startswith("tests/") and "ArgumentParser" not in source:
        return None
    return os.path.relpath(paths[0], ROOT)


def documented_commands(document: str) -> list[tuple[int, list[str], bool]]:
    """(line number, the command's words, whether it is inline code) of every command that `document` shows."""
    text = open(os.path.join(ROOT, document), encoding="utf-8").read()
    code, prose = _code_and_prose(text)
    found, variables = [], {}
    for number, line in _joined_lines(code):
        found += [(number, command, False) for command in _simple_commands(line, variables)]
    for match in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(match.group(1).split())
        number = prose.count("\n", 0, match.start()) + 1
        found += [(number, command, True) for command in _simple_commands(span, {})]
    return sorted(found)


# --- the parsers ----------------------------------------------------------------------------------------------------


class _ParserBuilt(Exception):
    def __init__(self, parser):
        super().__init__("parser built")
        self.parser = parser


def _script_module(path: str):
    """The script at `path` (relative to the repository) imported as a module, its own folder first on sys.path
    (where its imports of the scripts beside it resolve), its `__main__` part not run."""
    folder = os.path.dirname(os.path.join(ROOT, path))
    name = "documented_" + re.sub(r"\W", "_", path[:-3])
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(folder)
    return module


def _parser_of(module) -> argparse.ArgumentParser:
    """The parser that `module`'s main builds: its `build_parser()`, else its main stopped where it first parses."""
    if hasattr(module, "build_parser"):
        return module.build_parser()

    def stop(self, *args, **kwargs):
        raise _ParserBuilt(self)

    original_parse, original_argv = argparse.ArgumentParser.parse_known_args, sys.argv
    argparse.ArgumentParser.parse_known_args = stop
    sys.argv = [module.__name__]  # (a main that reads sys.argv itself)
    try:
        module.main()
    except _ParserBuilt as built:
        return built.parser
    finally:
        argparse.ArgumentParser.parse_known_args, sys.argv = original_parse, original_argv
    raise AssertionError(f"{module.__name__}.main() returned without parsing its arguments")


def _cli_parser(subcommand: str) -> argparse.ArgumentParser:
    """`hf-memffn SUBCOMMAND`'s parser, built as hf_memffn/cli.py builds it."""
    from hf_memffn import cli

    module = importlib.import_module(cli.SUBCOMMANDS[subcommand][0])
    if hasattr(module, "build_parser"):
        return module.build_parser()
    parser = argparse.ArgumentParser(prog=f"hf-memffn {subcommand}")
    module.add_arguments(parser)
    return parser


# --- checking one command -------------------------------------------------------------------------------------------


def _is_placeholder(word: str) -> bool:
    return bool(PLACEHOLDER.fullmatch(word)) or "$" in word or word.startswith("<")


def _elided(words: list[str]) -> tuple[list[str], bool]:
    """The words without what the documentation leaves out or marks optional (`...`, `...same arguments as
    above...`, `[options]`, `[--other-package OTHER]`), and whether there was any."""
    kept, closing = [], None
    for word in words:
        if closing is not None:  # inside a part left out, until the word that closes it
            closing = None if word.endswith(closing) else closing
        elif word.startswith(ELISION) and word != ELISION and not word.endswith(ELISION):
            closing = ELISION
        elif word.startswith("[") and not word.endswith("]"):
            closing = "]"
        elif not (word.startswith(ELISION) or word.endswith(ELISION) or re.fullmatch(r"\[.*\]", word)):
            kept.append(word)
    return kept, len(kept) < len(words)


def _missing_paths(words: list[str]) -> list[str]:
    """The repository files and folders that `words` name and that do not exist (outputs excepted)."""
    missing = []
    for before, word in zip(["", *words], words):
        if before in OUTPUT_FLAGS or not word.startswith(REPOSITORY_FOLDERS) or _is_placeholder(word):
            continue
        missing += [path for path in _expanded_braces(word.split("::")[0])
                    if not glob.glob(os.path.join(ROOT, path))]
    return missing


def _lenient(convert):
    """An argparse type that takes what `convert` refuses only for this machine or the reader's own files (a
    missing file, no GPU here); every other refusal stands."""
    def converted(text):
        try:
            return convert(text)
        except (argparse.ArgumentTypeError, ValueError) as error:
            if re.search(r"does not exist|no CUDA device|no such", str(error)):
                return text
            raise

    return converted


def _parse(parser: argparse.ArgumentParser, words: list[str], elided: bool):
    """(the namespace or None, the parser's error or None) for `words`; with a command left partly out, a
    missing required argument is no error. A placeholder stands for a valid value: a number for a number option,
    one of the choices of an option that has them; and a file the reader has (a type's "does not exist") passes."""
    words = list(words)
    for action in _all_actions(parser):
        if action.type is not None and action.type not in (int, float):
            action.type = _lenient(action.type)
    options = {option: action for action in _all_actions(parser) for option in action.option_strings}
    action = None  # the option whose values the words are
    for index, word in enumerate(words):
        if word.startswith("-"):
            action = options.get(word.split("=")[0])
        elif action is not None and _is_placeholder(word):
            if action.choices:
                words[index] = next(iter(action.choices))
            elif action.type in (int, float):
                words[index] = "1"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(words), None
    except SystemExit as stop:
        if stop.code == 0:  # --help
            return None, None
        message = printed.getvalue().strip().splitlines()[-1]
        return None, None if _left_out(message, elided) else message


def _left_out(message: str, elided: bool) -> bool:
    """Whether the parser's error is about what a command shown in part leaves out: a required argument, an
    option's value (`--token-lookup` named in prose)."""
    return elided and bool(re.search(r"the following arguments are required|expected (one|at least one) argument",
                                     message))


def _all_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        yield action
        for subparser in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
            yield from _all_actions(subparser)


def _unknown_presets(parser: argparse.ArgumentParser, namespace) -> list[str]:
    """The values of the options that name presets of examples/presets.py (`--size`, `--sizes`, `--presets`, ...)
    and take any text, that are no preset."""
    presets = _script_module("examples/presets.py")
    problems = []
    for action in _all_actions(parser):
        if action.dest not in PRESET_OPTIONS or action.choices or getattr(namespace, action.dest, None) is None:
            continue
        values = getattr(namespace, action.dest)
        for value in (values if isinstance(values, list) else [values]):
            for name in value.split(","):
                try:
                    presets.get_preset(name)
                except ValueError as error:
                    problems.append(f"{action.option_strings[0]}: {error}")
    return problems


def _check_script(path: str, arguments: list[str], elided: bool) -> list[str]:
    """The problems of `python PATH ARGUMENTS` (PATH relative to the repository)."""
    if "*" in path:  # (`python kernels/*.py`: the scripts, named together; the paths are checked on their own)
        return []
    if not os.path.isfile(os.path.join(ROOT, path)):
        return [f"no script {path}"]
    if not path.startswith(SCRIPT_FOLDERS):
        return []  # (tests/test_bad_input.py: a test file run as a script, no options)
    module = _script_module(path)
    if path == "examples/pretrain.py":
        arguments = module._renamed(arguments)
        peek = argparse.ArgumentParser(add_help=False)
        peek.add_argument("--preset", default=module.ModelArguments.preset)
        preset = peek.parse_known_args(arguments)[0].preset
        try:
            module.get_preset(preset)
        except ValueError as error:
            return [str(error)]
        parser = module.build_parser(preset)
    elif path == "conversion/export_tols.py":
        parser = _cli_parser("export-tols")
    else:
        parser = _parser_of(module)
    namespace, error = _parse(parser, arguments, elided)
    if error is not None:
        return [error]
    if namespace is None:
        return []
    problems = _unknown_presets(parser, namespace)
    if path == "kernels/bench_models.py":
        for task in namespace.tasks or []:
            if not _is_placeholder(task):
                try:
                    module.check_task(task)
                except ValueError as error:
                    problems.append(f"--tasks: {error}")
    if path == "scripts/transformers_suite.py":
        problems += [f"--archs: {name!r} is not one of {module.ARCHS}" for name in namespace.archs.split(",")
                     if name and name not in module.ARCHS]
    if path == "examples/reproduce/study.py" and namespace.models and not _is_placeholder(namespace.models):
        try:
            module.select_models(namespace, module.SHAPES[namespace.size])
        except ValueError as error:
            problems.append(str(error))
    return problems


def _check_rate_sweep(arguments: list[str], elided: bool) -> list[str]:
    """`rate_sweep.sh SIZE OUT_ROOT SECONDS RATE:MODELS:SEEDS...` runs study.py once per spec: each as study.py."""
    if arguments[:1] == ["--check"] or (elided and len(arguments) < 4):
        return []
    if len(arguments) < 4:
        return [f"rate_sweep.sh takes SIZE OUT_ROOT SECONDS RATE:MODELS:SEEDS...: {arguments}"]
    size, root, _seconds, *specs = arguments
    problems = []
    for spec in specs:
        rate, models, seeds = (spec.split(":") + ["", "", ""])[:3]
        study = ["--size", size, "--seeds-for", "all", "--models", models, "--seeds", seeds, "--out", root]
        if not _is_placeholder(rate):
            study += ["--learning-rate", rate]
        problems += _check_script("examples/reproduce/study.py", study, False)
    return problems


def _check_shell_script(path: str, arguments: list[str], elided: bool) -> list[str]:
    """The problems of `bash PATH ARGUMENTS`: the script exists, and each --flag is one it (or a script of the
    repository it runs, which it hands the rest of its arguments) reads."""
    if not os.path.isfile(os.path.join(ROOT, path)):
        return [f"no script {path}"]
    if path == "examples/reproduce/rate_sweep.sh":
        return _check_rate_sweep(arguments, elided)
    source = open(os.path.join(ROOT, path), encoding="utf-8").read()
    for named in set(re.findall(r"[\w/]+\.py", source)):
        for candidate in (os.path.join(os.path.dirname(path), named), named):
            if os.path.isfile(os.path.join(ROOT, candidate)):
                source += open(os.path.join(ROOT, candidate), encoding="utf-8").read()
    return [f"{path} knows no {flag}" for flag in (word.split("=")[0] for word in arguments if word.startswith("--"))
            if not re.search(re.escape(flag) + r"\b", source)]


def _check_launcher(parser: argparse.ArgumentParser, words: list[str], elided: bool) -> list[str]:
    """`accelerate launch` / `torchrun`: their own options, then the script with its arguments."""
    namespace, error = _parse(parser, words, elided)
    if error is not None:
        return [error]
    if namespace is None:
        return []
    return _check_script(namespace.training_script, namespace.training_script_args, elided)


def _check_serve(arguments: list[str], elided: bool) -> list[str]:
    """`hf-memffn serve [MODEL] OPTIONS`: its own options, the rest as `transformers serve` takes them."""
    import click
    from transformers.cli.transformers import app

    from hf_memffn import serving

    parser = serving.build_parser()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            _options, rest = parser.parse_known_args(arguments)
    except SystemExit:
        message = printed.getvalue().strip().splitlines()[-1]
        return [] if _left_out(message, elided) else [message]
    serve = getattr(app, "commands", {}).get("serve")  # (how transformers 5.25 builds its command line)
    if serve is None:
        return []
    try:
        serve.make_context("serve", list(rest))
    except click.ClickException as error:
        return [f"transformers serve: {error.format_message()}"]
    return []


def _check_cli(arguments: list[str], elided: bool) -> list[str]:
    from hf_memffn import cli

    if not arguments or not re.fullmatch(r"[a-z][\w-]*", arguments[0]):
        return []  # the program named in prose (`hf-memffn <command>: error: ...`)
    if "/" in arguments:  # `hf-memffn export-tols / analyze / demo`: the subcommands listed
        return [f"hf-memffn has no subcommand {name}" for name in arguments[::2] if name not in cli.SUBCOMMANDS]
    subcommand, *rest = arguments
    if subcommand not in cli.SUBCOMMANDS:
        return [f"hf-memffn has no subcommand {subcommand!r} (allowed: {', '.join(cli.SUBCOMMANDS)})"]
    if subcommand == "serve":
        return _check_serve(rest, elided)
    namespace, error = _parse(_cli_parser(subcommand), rest, elided)
    if error is not None:
        return [error]
    if subcommand == "demo" and namespace is not None:
        from hf_memffn import demo

        try:
            demo._parse_archs(namespace.archs)
        except ValueError as error:
            return [str(error)]
    return []


def _check_pytest(arguments: list[str]) -> list[str]:
    """`pytest FILE::TEST`: the test is in its file (the files are checked with every command's paths). A `-k`
    expression is not checked: pytest matches it against parametrisation ids and file names as well."""
    problems = []
    for word in arguments:
        path, _, test = word.partition("::")
        if test and os.path.isfile(os.path.join(ROOT, path)):
            source = open(os.path.join(ROOT, path), encoding="utf-8").read()
            name = test.split("::")[-1].split("[")[0]
            if not re.search(rf"(def|class) {re.escape(name)}\b", source):
                problems.append(f"{path} has no test {name}")
    return problems


def _check_pip(arguments: list[str]) -> list[str]:
    """`pip install "hf-memffn[EXTRA]"` / `-e ".[EXTRA]"`: each extra is one pyproject.toml defines."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as file:
        extras = tomllib.load(file)["project"].get("optional-dependencies", {})
    problems = []
    for word in arguments:
        match = re.fullmatch(r"(?:hf-memffn|\.)\[([\w,-]+)\]", word)
        problems += [f"pyproject.toml has no extra {extra!r} (allowed: {', '.join(extras)})"
                     for extra in (match.group(1).split(",") if match else []) if extra not in extras]
    return problems


def _check_module(module_name: str, arguments: list[str], elided: bool) -> list[str]:
    if module_name == "hf_memffn.cli":
        return _check_cli(arguments, elided)
    if module_name == "pytest":
        return _check_pytest(arguments)
    if not module_name.startswith("hf_memffn"):
        return []  # another project's command (pip)
    if importlib.util.find_spec(module_name) is None:
        return [f"no module {module_name}"]
    if module_name == "hf_memffn.lm_eval_model":
        return []  # (lm_eval's own command line, with the model registered; lm_eval may not be installed)
    module = importlib.import_module(module_name)
    return [error for error in [_parse(_parser_of(module), arguments, elided)[1]] if error]


def _unread_settings(settings: list[str]) -> list[str]:
    """The environment variables set before a command that no code of the repository reads (a name misspelt, or
    one the code no longer reads), those that other programs read aside."""
    names = [setting.split("=")[0] for setting in settings]
    return [f"{name} is set, but no code of the repository reads it" for name in names
            if name not in OTHER_PROGRAMS_SETTINGS and not re.search(rf"\b{name}\b", _repository_code())]


@functools.cache
def _repository_code() -> str:
    """The repository's code (this file aside, whose wrong commands name variables nothing reads)."""
    return "".join(open(path, encoding="utf-8").read() for folder in ("hf_memffn", *SCRIPT_FOLDERS, "tests")
                   for pattern in ("*.py", "*.sh")
                   for path in glob.glob(os.path.join(ROOT, folder, "**", pattern), recursive=True)
                   if path != os.path.abspath(__file__))


def command_problems(words: list[str], inline: bool = False) -> list[str]:
    """What is wrong with one documented command (its words, the `VAR=value` settings before it included).
    Inline code may name a command without the arguments it requires (`python kernels/bench_triton_launch.py`)."""
    settings = list(itertools.takewhile(lambda word: re.fullmatch(r"[A-Za-z_]\w*=.*", word), words))
    problems = _unread_settings(settings)
    words = words[len(settings):]
    # (bash's brace expansion: `--tasks train:370M:{llama,kvffn}:eager` names two tasks; a repository path in
    # braces, `deepspeed_zero{2,3}.yaml`, names one file or the other)
    words = sum(([word] if word.startswith(REPOSITORY_FOLDERS) else _expanded_braces(word) for word in words), [])
    words, elided = _elided(words)
    elided = elided or inline
    program, *arguments = words
    problems += [f"no such file in the repository: {path}" for path in _missing_paths(arguments)]
    if program == "hf-memffn":
        return problems + _check_cli(arguments, elided)
    if program == "pytest":
        return problems + _check_pytest(arguments)
    if program == "pip":
        return problems + _check_pip(arguments)
    if program in ("python", "python3"):
        if arguments[:1] == ["-m"] and len(arguments) > 1:
            return problems + _check_module(arguments[1], arguments[2:], elided)
        if arguments and arguments[0].startswith(REPOSITORY_FOLDERS):
            return problems + _check_script(arguments[0], arguments[1:], elided)
        return problems  # `python -c`, or a file the reader wrote (the docs show it)
    if program == "bash":
        if arguments and arguments[0].startswith(REPOSITORY_FOLDERS):
            return problems + _check_shell_script(arguments[0], arguments[1:], elided)
        return problems
    if program == "accelerate":
        if arguments[:1] != ["launch"]:
            return problems
        launch_command_parser = pytest.importorskip("accelerate.commands.launch").launch_command_parser

        return problems + _check_launcher(launch_command_parser(), arguments[1:], elided)
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        if not any(word.endswith(".py") for word in arguments):
            return problems  # (`torchrun --nproc_per_node N` in prose)
        return problems + _check_launcher(get_args_parser(), arguments, elided)
    return problems


# a Python name of the package that a document or docstring gives, `hf_memffn.flash_mhf_op.flash_mhf_path` (not a
# path, hf_memffn/ffn.py, nor a name built in code, f"hf_memffn.{name}")
PACKAGE_NAME = re.compile(r"(?<![\w/.{])hf_memffn(?:\.[A-Za-z_]\w*)+")


def python_name_problem(dotted: str) -> str | None:
    """Why `dotted` (`hf_memffn.<module>...<attribute>`) names nothing, or None where it names a module or an
    attribute of one. A module is found without being imported (`hf_memffn.lm_eval_model` needs lm_eval)."""
    parts = dotted.split(".")
    depth = 1
    while depth < len(parts):
        try:
            found = importlib.util.find_spec(".".join(parts[:depth + 1])) is not None
        except ModuleNotFoundError:  # (the parent is a module, not a package)
            found = False
        if not found:
            break
        depth += 1
    if depth == len(parts):
        return None
    owner = importlib.import_module(".".join(parts[:depth]))
    for index, part in enumerate(parts[depth:], depth):
        if not hasattr(owner, part):
            return f"{'.'.join(parts[:index])} has no {part!r}"
        owner = getattr(owner, part)
    return None


def documented_python_names(path: str) -> list[tuple[int, str]]:
    """(line number, name) of each `hf_memffn.` name in the file `path` (relative to the repository)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as file:
        return [(number, match.group(0)) for number, line in enumerate(file, 1)
                for match in PACKAGE_NAME.finditer(line)]


# --- the tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("document", DOCUMENTS)
def test_documented_commands_are_real(document):
    """Each command `document` shows runs as written: its script or subcommand, flags, values and files exist."""
    problems = [f"{document}:{number}: {' '.join(words)[:200]}\n    " + "\n    ".join(found)
                for number, words, inline in documented_commands(document)
                for found in [command_problems(words, inline)] if found]
    assert not problems, "\n".join(problems)


def test_the_documentation_shows_commands_of_every_kind():
    """The commands are found (a change to how the documents write them must not leave this test checking none)."""
    programs = {}
    for document in DOCUMENTS:
        for _number, words, _inline in documented_commands(document):
            program = words[len(list(itertools.takewhile(lambda word: "=" in word, words)))]
            programs[program] = programs.get(program, 0) + 1
    assert sum(programs.values()) > 300, programs
    assert {"hf-memffn", "python", "accelerate", "bash", "torchrun", "pip"} <= set(programs), programs
    readme = [" ".join(words) for _number, words, _inline in documented_commands("README.md")]
    # a variable set on one line and used on the next, a `for` loop, an inline command across two lines
    assert any(command.startswith("PYTHONPATH=. python examples/reproduce/study.py --data .study-data") and
               "--models llama,flash_mhf,flash_mhf_half_head_dim" in command for command in readme)
    assert any(command.startswith("python examples/reproduce/learning_rates.py --out sweep-") for command in readme)
    assert any(command.startswith("accelerate launch --config_file examples/accelerate/ddp.yaml examples/pretrain.py")
               for command in readme)


@pytest.mark.parametrize("command, problem", [
    ("hf-memffn demoo", "no subcommand 'demoo'"),
    ("hf-memffn demo --archs memoryllm,foo", "'foo'"),
    ("hf-memffn export-tols MODEL_DIR OUT_DIR --format int3", "invalid choice: 'int3'"),
    ("hf-memffn serve MODEL --continous-batching", "--continous-batching"),
    ("python examples/pretrain.py --arch flash_mhf --preset 2B --output-dir runs/x", "preset='2B'"),
    ("python examples/pretrain.py --arch flashmhf --output-dir runs/x", "invalid choice: 'flashmhf'"),
    ("python examples/reproduce/study.py --resume yes", "unrecognized arguments: yes"),
    ("python kernels/bench_models.py --out DIR --tasks train:370M:foo:eager", "architecture 'foo'"),
    ("python kernels/profile_decode_host.py --out DIR --size 7B", "preset='7B'"),
    ("python kernels/compare_triton_builds.py exportt --out DIR", "invalid choice: 'exportt'"),
    ("python examples/reproduce/study.py --size small --models llama,foo", "['foo']"),
    ("bash examples/reproduce/rate_sweep.sh small sweep 540 1e-3:llama,foo:3", "['foo']"),
    ("bash examples/ddp_check.sh --wheelz", "knows no --wheelz"),
    ("PRESETT=370M bash examples/ddp_check.sh DIR 60", "PRESETT is set"),
    ("accelerate launch --config_file examples/accelerate/ddp3.yaml examples/pretrain.py ...", "ddp3.yaml"),
    ("torchrun --nproc_per_node 2 examples/pretrain.py --output-dir runs/x --bogus 1", "--bogus"),
    ("python -m pytest tests/test_models.py::test_no_such_test", "no test test_no_such_test"),
    ("python -m hf_memffn.no_such_module", "no module"),
    ("pip install 'hf-memffn[evals]'", "no extra 'evals'"),
    ("python kernels/no_such_script.py --out DIR", "no_such_script.py"),
])
def test_a_wrong_command_is_caught(command, problem):
    found = command_problems(shlex.split(command))
    assert any(problem in text for text in found), found


def test_documented_python_names_exist():
    """Each `hf_memffn.` name that the documentation or the package's docstrings and comments give is a module or an
    attribute of one: docs/speed.md and flash_mhf_gluon.py's docstring named `hf_memffn.flash_mhf_path`, which the
    package does not export (it is `hf_memffn.flash_mhf_op.flash_mhf_path`)."""
    sources = [*DOCUMENTS, *sorted(os.path.relpath(path, ROOT) for path in
                                   glob.glob(os.path.join(ROOT, "hf_memffn", "**", "*.py"), recursive=True))]
    problems = [f"{path}:{number}: {name}: {problem}" for path in sources
                for number, name in documented_python_names(path)
                for problem in [python_name_problem(name)] if problem]
    assert not problems, "\n".join(problems)
    names = {name for path in sources for _number, name in documented_python_names(path)}
    assert {"hf_memffn.flash_mhf", "hf_memffn.flash_mhf_op.flash_mhf_path", "hf_memffn.lm_eval_model"} <= names


@pytest.mark.parametrize("name, problem", [
    ("hf_memffn.flash_mhf_path", "hf_memffn has no 'flash_mhf_path'"),
    ("hf_memffn.flash_mhf_op.no_such_function", "hf_memffn.flash_mhf_op has no 'no_such_function'"),
    ("hf_memffn.analysis.no_such_module", "hf_memffn.analysis has no 'no_such_module'"),
])
def test_a_wrong_python_name_is_caught(name, problem):
    assert python_name_problem(name) == problem
