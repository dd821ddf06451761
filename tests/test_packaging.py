"""The package, its export code (`hf_memffn.conversion`) and the scripts work in every usual install mode:
`pip install .` (a wheel), `pip install -e .` / `pip install --no-build-isolation -e .` (an editable wheel), and a
checkout on PYTHONPATH without installing; also when the checkout's root shadows an installed copy (Python started
in the repository root puts it first on sys.path), and without the optional extras.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE = ("import hf_memffn.conversion.export as export, hf_memffn.cli_args, hf_memffn.analysis.cli; "
         "print(export.__file__)")
# which copy of the package an import would take, found without importing it (torch and transformers): where the
# probe above has already shown that copy's imports to work
FIND = ("import importlib.util, os; spec = importlib.util.find_spec('hf_memffn'); "
        "print(os.path.join(os.path.dirname(spec.origin), 'conversion', 'export.py'))")

pytestmark = pytest.mark.slow  # builds wheels (seconds each)


def _python(code: str, cwd: Path, pythonpath: str | None = None, site_dir: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if site_dir is not None:  # an install target: process its .pth files as site-packages would
        code = f"import site; site.addsitedir({str(site_dir)!r}); " + code
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def _build(kind: str, out: Path) -> Path:
    """A wheel built the way pip builds one without isolation (`build_wheel` or `build_editable`)."""
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}({str(out)!r}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return out / result.stdout.strip().splitlines()[-1]


def _install(wheel: Path, target: Path) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target),
               str(wheel)]
    subprocess.run(command, check=True, capture_output=True)


def test_wheel_holds_the_export_code_and_works_with_and_without_the_checkout_shadowing_it(tmp_path):
    wheel = _build("wheel", tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hf_memffn/conversion/export.py" in names and "hf_memffn/cli_args.py" in names
    assert not [n for n in names if n.startswith("conversion/")]
    _install(wheel, tmp_path / "site")
    outside = _python(PROBE, cwd=tmp_path, pythonpath=str(tmp_path / "site"))
    assert Path(outside).is_relative_to(tmp_path / "site")
    shadowed = _python(FIND, cwd=REPO, pythonpath=str(tmp_path / "site"))  # the checkout comes first
    assert Path(shadowed).is_relative_to(REPO) and Path(shadowed).is_file()


def test_editable_install_points_at_the_checkout(tmp_path):
    wheel = _build("editable", tmp_path / "dist")
    _install(wheel, tmp_path / "site")
    for cwd, probe in ((tmp_path, PROBE), (REPO, FIND)):
        assert Path(_python(probe, cwd=cwd, site_dir=tmp_path / "site")).is_relative_to(REPO)


def test_checkout_on_pythonpath_runs_the_commands_and_scripts(tmp_path):
    assert Path(_python(PROBE, cwd=tmp_path, pythonpath=str(REPO))).is_relative_to(REPO)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    for command in ([str(REPO / "conversion" / "export_tols.py"), "--help"],
                    [str(REPO / "kernels" / "bench_token_lookup.py"), "--help"],
                    [str(REPO / "scripts" / "transformers_suite.py"), "--help"]):
        result = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert result.returncode == 0 and "usage:" in result.stdout, (command, result.stderr[-2000:])


def test_export_script_runs_from_a_checkout_without_pythonpath(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(REPO / "conversion" / "export_tols.py"), "--help"], cwd=tmp_path,
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0 and "MODEL_DIR" in result.stdout, result.stderr[-2000:]


def test_the_package_imports_without_the_optional_extras_and_leaves_global_settings_alone():
    """`import hf_memffn` where none of the optional extras is installed (triton, peft, accelerate, datasets,
    lm_eval, onnx): every architecture builds and runs through the Auto classes; the import changes no torch setting,
    warnings filter or transformers logging setting; registering again (`importlib.reload`) keeps the same classes."""
    from hf_memffn.testing import blocked_imports, run_python

    script = blocked_imports("triton", "peft", "accelerate", "datasets", "lm_eval", "onnx", "onnxscript") + \
        textwrap.dedent("""
        import importlib, logging, warnings
        import torch, transformers
        # (PreTrainedModel first: transformers' modeling modules import scipy, which adds warnings filters of its own)
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

        def settings():
            return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
                    torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
                    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark, list(warnings.filters),
                    transformers.logging.get_verbosity(), logging.getLogger("transformers").handlers,
                    logging.root.level, logging.root.handlers)

        before = settings()
        import hf_memffn
        from hf_memffn.testing import tiny_config
        assert settings() == before, (before, settings())
        for name in hf_memffn.ARCHITECTURES:
            model = AutoModelForCausalLM.from_config(tiny_config(name))
            assert model(torch.randint(0, 300, (1, 6))).logits.shape == (1, 6, 320)
        importlib.reload(hf_memffn)
        for name, config_class in hf_memffn.ARCHITECTURES.items():
            assert type(AutoConfig.for_model(config_class.model_type)) is config_class, name
        print("ok")
        """)
    completed = run_python(script, timeout=300)
    assert completed.returncode == 0 and completed.stdout.split()[-1:] == ["ok"], completed.stderr[-2000:]


def test_command_help_and_argument_errors_import_no_torch(tmp_path):
    """`hf-memffn --help`, each subcommand's `--help` and an argument error answer without importing torch (which,
    with transformers' models, took 5-13 s before a line was printed), run as pip installs the command: a script named
    `hf-memffn` calling pyproject's entry point. `import hf_memffn` in a program still registers the architectures
    (the test above); so does the command once it runs a subcommand (tests/test_demo.py and the others)."""
    import re

    from hf_memffn.cli import SUBCOMMANDS

    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    module, function = re.search(r'^hf-memffn = "([\w.]+):(\w+)"$', pyproject, re.MULTILINE).groups()
    script = tmp_path / "hf-memffn"  # (pip's console script, with a report of the loaded modules at exit)
    script.write_text(textwrap.dedent(f"""\
        import atexit, sys
        atexit.register(lambda: print("torch loaded:", "torch" in sys.modules, file=sys.stderr))
        from {module} import {function}
        sys.exit({function}())
        """), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [(["--help"], 0), (["no-such-command"], 2)]
    runs += [([name, "--help"], 0) for name in SUBCOMMANDS]
    runs += [([name, "--no-such-option"], 2) for name in SUBCOMMANDS if name != "serve"]  # (serve passes them on)
    for argv, status in runs:
        result = subprocess.run([sys.executable, str(script), *argv], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == status, (argv, result.stderr[-2000:])
        assert ("usage: hf-memffn" in result.stdout) == (status == 0), (argv, result.stdout[-2000:])
        assert result.stderr.splitlines()[-1] == "torch loaded: False", (argv, result.stderr[-2000:])


def test_the_command_modules_name_what_the_package_registers():
    """The names that the subcommands' argument modules keep, so as to import no models: the demo's architectures are
    `architectures.ARCHITECTURE_NAMES`, export-tols' dtypes those of `token_lookup.FLOAT_DTYPES`."""
    from hf_memffn import demo_command, export_command
    from hf_memffn.architectures import ARCHITECTURE_NAMES
    from hf_memffn.token_lookup import FLOAT_DTYPES

    assert demo_command.DEMO_ARCHITECTURES == tuple(ARCHITECTURE_NAMES)
    assert export_command.FLOAT_DTYPE_NAMES == tuple(FLOAT_DTYPES)
