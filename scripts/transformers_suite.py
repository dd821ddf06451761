"""Run transformers' own model test suite (`ModelTesterMixin`, `GenerationTesterMixin`, `ConfigTester`) on the four
architectures of this package and on transformers' `LlamaForCausalLM` (the control), and write the
pass / fail / not-applicable table.

transformers' test modules are not part of this repository. This script copies the ones the testers import from a
transformers source into a cache outside the tree (default `~/.cache/hf-memffn/transformers-tests/<version>`, the
source's version):

    python scripts/transformers_suite.py --source ~/src/transformers          # a checkout (its working tree)
    python scripts/transformers_suite.py --source ~/src/transformers --ref v5.23.0   # a checkout or bare git dir, at a tag
    python scripts/transformers_suite.py --source transformers-5.23.0.tar.gz  # the source distribution from PyPI
    python scripts/transformers_suite.py                                     # the cache filled by an earlier run

The source distribution (`pip download --no-deps --no-binary :all: transformers==5.23.0`) ships only the top-level
`tests/test_*.py` files: `ModelTesterMixin` and `ConfigTester` run from it, but `tests/generation/test_utils.py`
(`GenerationTesterMixin`) and `tests/exporters/test_export.py` (`ExportTesterMixin`) are not in it; the script then
puts an empty mixin in their place and says so in the table (use a git checkout for those). The source should match
the installed transformers version: the script reads the source's version from its `src/transformers/__init__.py`,
warns when it differs (transformers' test modules import helpers of their own release, so a mismatch usually stops
pytest before any test runs; the end of pytest's log is printed then) and keeps each source version's files in a
cache of their own.

Output (`--out`, default `./transformers-suite`): `junit.xml`, `pytest.log`, `results.json` and `results.md` (one
row per test, one column per architecture: pass, FAIL, n/a with the reason). Needs `pip install parameterized`
(imported by transformers' test modules). Runs on CPU in a few minutes (`-k` selects tests, `--archs` architectures);
on a GPU machine transformers' tests run on the GPU (`--cpu` hides it), FlashMHF still through the PyTorch op.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import transformers

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
TESTERS_MODULE = HERE / "transformers_suite_models.py"
DEFAULT_CACHE = Path.home() / ".cache" / "hf-memffn" / "transformers-tests"  # one folder per source version

ARCHS = ("flash_mhf", "memoryllm", "flex_memoryllm", "kvffn", "llama")

# The transformers test files the testers import, relative to the transformers source root. `None`: required;
# otherwise the stand-in written when the source lacks the file.
TEST_FILES = {
    "tests/test_modeling_common.py": None,
    "tests/test_configuration_common.py": None,
    "tests/generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "tests/exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    # Non-default values of the common config fields (`ConfigTester.check_config_arguments_init`); a stand-in that
    # names fields every PreTrainedConfig takes, used when the source lacks the file.
    "tests/utils/test_configuration_utils.py": (
        "config_common_kwargs = {\n"
        "    'return_dict': False,\n"
        "    'output_hidden_states': True,\n"
        "    'dtype': 'float16',\n"
        "    'chunk_size_feed_forward': 5,\n"
        "    'architectures': ['SomeModel'],\n"
        "    'id2label': {0: 'first', 1: 'second'},\n"
        "    'label2id': {'first': 0, 'second': 1},\n"
        "    'problem_type': 'regression',\n"
        "    'bos_token_id': 5,\n"
        "    'eos_token_id': 6,\n"
        "}\n"
    ),
}
# Files whose stand-in means whole groups of tests did not run (reported in the table).
MIXIN_FILES = {"tests/generation/test_utils.py": "GenerationTesterMixin", "tests/exporters/test_export.py": "ExportTesterMixin"}
VERSION_FILE = "src/transformers/__init__.py"  # where a transformers source names its version


class SourceError(ValueError):
    pass


def _read_from_tarball(path: Path, names: list[str]) -> dict[str, bytes]:
    found = {}
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            parts = member.name.split("/", 1)
            if len(parts) == 2 and parts[1] in names and member.isfile():
                found[parts[1]] = archive.extractfile(member).read()
    return found


def _read_from_git(path: Path, ref: str, names: list[str]) -> dict[str, bytes]:
    found = {}
    for name in names:
        result = subprocess.run(
            ["git", f"--git-dir={path}", "show", f"{ref}:{name}"], capture_output=True, check=False
        )
        if result.returncode == 0:
            found[name] = result.stdout
    return found


def source_version(source: Path, ref: str | None) -> str | None:
    """The transformers version a source holds (its `__version__`), or None where it names none."""
    text = read_test_files(source, ref, [VERSION_FILE]).get(VERSION_FILE, b"").decode("utf-8", "replace")
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return None


def warn_if_other_version(version: str | None, where: str) -> None:
    if version is not None and version != transformers.__version__:
        print(f"warning: {where} holds transformers {version}'s tests, but transformers {transformers.__version__} is "
              "installed: their test modules import helpers of their own release, so pytest may stop before any test "
              f"runs. Use the source of {transformers.__version__} (`pip download --no-deps --no-binary :all: "
              f"transformers=={transformers.__version__}`) or install {version}.", file=sys.stderr)


def read_test_files(source: Path, ref: str | None, names: list[str] | None = None) -> dict[str, bytes]:
    names = list(TEST_FILES) if names is None else names
    if source.is_file() and tarfile.is_tarfile(source):
        return _read_from_tarball(source, names)
    if source.is_dir():
        git_dir = source / ".git" if (source / ".git").exists() else source
        if ref is not None:
            return _read_from_git(git_dir, ref, names)
        found = {}
        for name in names:
            if (source / name).is_file():
                found[name] = (source / name).read_bytes()
        return found
    raise SourceError(f"--source {source}: not a transformers checkout, git directory or source tarball")


def fill_cache(cache: Path, source: Path | None, ref: str | None, version: str | None = None) -> dict[str, str]:
    """Copy the test files into `cache/tests`; returns {file: "source" | "stand-in"}. `version`: the source's
    transformers version (`source_version`)."""
    provenance_path = cache / "provenance.json"
    if source is None:
        if not provenance_path.exists():
            raise SourceError(
                f"no transformers tests cached in {cache}: pass --source (a transformers checkout, git dir or the "
                f"sdist from `pip download --no-deps --no-binary :all: transformers=={transformers.__version__}`)"
            )
        cached = json.loads(provenance_path.read_text())
        warn_if_other_version(cached.get("source_version"), f"the cache {cache}")
        return cached["files"]
    warn_if_other_version(version, f"--source {source}")
    found = read_test_files(source, ref)
    if "tests/test_modeling_common.py" not in found:
        at = f" at {ref} (is --ref a tag?)" if ref is not None else ""
        raise SourceError(f"--source {source}: no tests/test_modeling_common.py in it{at}")
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    provenance = {}
    for name, stand_in in TEST_FILES.items():
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name in found:
            target.write_bytes(found[name])
            provenance[name] = "source"
        elif stand_in is not None:
            target.write_text(stand_in)
            provenance[name] = "stand-in"
        else:
            raise SourceError(f"--source {source}: {name} is missing")
    for folder in {p.parent for p in tmp.rglob("*.py")}:
        (folder / "__init__.py").touch()
    (tmp / "provenance.json").write_text(
        json.dumps({"source": str(source), "ref": ref, "source_version": version,
                    "transformers": transformers.__version__, "files": provenance}, indent=1)
    )
    shutil.rmtree(cache, ignore_errors=True)
    os.replace(tmp, cache)
    return provenance


def run_pytest(cache: Path, out: Path, archs: list[str], select: str | None, extra: list[str], cpu: bool) -> int:
    shutil.copyfile(TESTERS_MODULE, cache / "tests" / "test_memffn_models.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(cache), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["MEMFFN_SUITE_ARCHS"] = ",".join(archs)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable, "-m", "pytest", "tests/test_memffn_models.py", "-q", "-rN", "-p", "no:cacheprovider",
        "-o", "addopts=", "-o", "testpaths=", f"--rootdir={cache}", f"--junitxml={out / 'junit.xml'}",
        "-p", "no:warnings", "--tb=line",
    ]
    if select:
        command += ["-k", select]
    command += extra
    with open(out / "pytest.log", "w") as log:
        return subprocess.run(command, cwd=cache, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def _outcome(case) -> tuple[str, str]:
    for tag, outcome in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "n/a")):
        node = case.find(tag)
        if node is not None:
            message = (node.get("message") or node.text or "").strip().splitlines()
            return outcome, message[0][:160] if message else ""
    return "pass", ""


def collect(out: Path, provenance: dict[str, str]) -> dict:
    tree = ElementTree.parse(out / "junit.xml")
    rows: dict[str, dict[str, tuple[str, str]]] = collections.defaultdict(dict)
    for case in tree.iter("testcase"):
        class_name = case.get("classname", "").rsplit(".", 1)[-1]
        arch = class_name.removeprefix("Test_")
        rows[case.get("name")][arch] = _outcome(case)
    counts = collections.defaultdict(collections.Counter)
    for row in rows.values():
        for arch, (outcome, _) in row.items():
            counts[arch][outcome] += 1
    return {
        "transformers": transformers.__version__,
        "files": provenance,
        "not_run": [mixin for name, mixin in MIXIN_FILES.items() if provenance.get(name) == "stand-in"],
        "counts": {arch: dict(counter) for arch, counter in counts.items()},
        "tests": {name: {arch: list(value) for arch, value in row.items()} for name, row in sorted(rows.items())},
    }


def write_markdown(result: dict, archs: list[str], path: Path) -> None:
    columns = archs
    lines = [f"transformers {result['transformers']}; test files: "
             + ", ".join(f"`{k}` ({v})" for k, v in result["files"].items()), ""]
    if result["not_run"]:
        lines += [f"Not run (their module was not in the source): {', '.join(result['not_run'])}.", ""]
    lines += ["| architecture | pass | FAIL | n/a |", "|---|---|---|---|"]
    for arch in columns:
        c = result["counts"].get(arch, {})
        lines.append(f"| {arch} | {c.get('pass', 0)} | {c.get('FAIL', 0)} | {c.get('n/a', 0)} |")
    lines += ["", "| test | " + " | ".join(columns) + " | reason (n/a or FAIL) |", "|---" * (len(columns) + 2) + "|"]
    for name, row in result["tests"].items():
        cells, reasons = [], []
        for arch in columns:
            outcome, reason = row.get(arch, ("-", ""))
            cells.append(outcome)
            if reason and reason not in reasons:
                reasons.append(reason)
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + "; ".join(reasons).replace("|", "/") + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help="transformers checkout, git directory or source tarball")
    parser.add_argument("--ref", help="git tag or commit to read the test files at (with a checkout or git dir)")
    parser.add_argument("--cache", type=Path, help="where the test files go (default: ~/.cache/hf-memffn/...)")
    parser.add_argument("--out", type=Path, default=Path("transformers-suite"))
    parser.add_argument("--archs", default=",".join(ARCHS), help=f"comma separated subset of {','.join(ARCHS)}")
    parser.add_argument("-k", dest="select", help="pytest -k expression")
    parser.add_argument("--cpu", action="store_true", help="hide GPUs (default: transformers' tests use one if present)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    archs = [a for a in args.archs.replace(" ", ",").split(",") if a]
    unknown = sorted(set(archs) - set(ARCHS))
    if unknown:
        parser.error(f"--archs: {unknown} not allowed; allowed values: {list(ARCHS)}")
    try:
        import parameterized  # noqa: F401
    except ImportError:
        parser.error("transformers' test modules import `parameterized`: pip install parameterized")
    try:
        version = source_version(args.source, args.ref) if args.source is not None else None
        cache = args.cache or DEFAULT_CACHE / (version or transformers.__version__)
        provenance = fill_cache(cache, args.source, args.ref, version)
    except SourceError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    status = run_pytest(cache, args.out, archs, args.select, args.pytest_args, args.cpu)
    if status not in (0, 1):  # pytest stopped before or outside the tests (an import error, a bad option)
        log = (args.out / "pytest.log").read_text(errors="replace").splitlines()
        print("\n".join(["pytest stopped; the end of its log:", *log[-15:]]), file=sys.stderr)
        if not (args.out / "junit.xml").exists():
            return status
    result = collect(args.out, provenance)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, archs, args.out / "results.md")
    for arch in archs:
        print(arch, result["counts"].get(arch, {}))
    print(f"pytest exit status {status}; table in {args.out / 'results.md'}")
    return 0 if status in (0, 1) else status


if __name__ == "__main__":
    sys.exit(main())
