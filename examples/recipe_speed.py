"""Training speed of the recipe as users run it: examples/pretrain.py, one process per run, side by side.

    python examples/recipe_speed.py --out DIR [--data-dir SHARDS] [--preset 370M] [--steps 40] \
        --runs llama:reduce-overhead:1 flash_mhf:reduce-overhead:1 flash_mhf:default:1

Each run is `ARCH:MODE[:BATCH]`: an architecture of the recipe, how the Trainer runs the model (`eager`, or a
`torch.compile` mode: `default`, `reduce-overhead` (CUDA graphs), `max-autotune`, `max-autotune-no-cudagraphs`) and
the sequences per step (default 1). Every run trains from the same token shards (bf16 unless `--precision fp32`),
in blocks of `--block-size` tokens, with no evaluation or checkpoint until the end. Its speed is the median of the
recipe's own tokens/s windows (one per `--logging-steps` steps) after the first `--skip-windows`, which hold
compilation and CUDA-graph recording. Ratios are to the first run of the same batch. A run named twice runs twice
(its second row is `NAME_2`), which shows how much the speed drifts from one run to the next.

`--data-dir` is a folder of token shards (examples/token_shards.py); without one, shards are built from the Python
standard library's sources with a byte-level BPE of `--vocab-size` tokens (examples/reproduce/prepare_data.py), so
the script runs offline on any machine; they are kept under `--work` for later calls, in a folder of their own for
each vocabulary size, training-stream length (from `--steps`, `--block-size` and the largest batch) and Python.
Writes DIR/recipe_speed.{json,md} (after every run) and each run's log and train_log.jsonl; each run's folder under
`--work`, with the model it saved, is removed once read (unless `--keep-run-folders`), so a long list of runs does
not fill the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from presets import ARCHITECTURE_NAMES, PRESETS  # noqa: E402

from hf_memffn.atomic_write import atomic_output  # noqa: E402
from hf_memffn.cli_args import output_dir  # noqa: E402
from hf_memffn.run_records import read_run_record, run_record_json  # noqa: E402

MODES = ("eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def name_repeated_runs(runs: list[dict]) -> None:
    """A run named twice (to see the drift between runs) gets a second folder and row: `NAME_2`, then `NAME_3`."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run["name"]] = seen.get(run["name"], 0) + 1
        if seen[run["name"]] > 1:
            run["name"] = f"{run['name']}_{seen[run['name']]}"


def parse_run(text: str) -> dict:
    """`ARCH:MODE[:BATCH]` -> {"arch", "mode", "batch", "name"}, with errors that name the allowed values."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--runs {text!r}: expected ARCH:MODE[:BATCH]")
    arch, mode = parts[0], parts[1]
    if arch not in ARCHITECTURE_NAMES:
        raise argparse.ArgumentTypeError(f"--runs {text!r}: ARCH must be one of {', '.join(ARCHITECTURE_NAMES)}")
    if mode not in MODES:
        raise argparse.ArgumentTypeError(f"--runs {text!r}: MODE must be one of {', '.join(MODES)}")
    try:
        batch = int(parts[2]) if len(parts) == 3 else 1
    except ValueError:
        batch = 0
    if batch < 1:
        raise argparse.ArgumentTypeError(f"--runs {text!r}: BATCH must be a positive integer")
    return {"arch": arch, "mode": mode, "batch": batch, "name": f"{arch}_{mode}_b{batch}"}


def standard_library_files() -> list[str]:
    """The top-level modules of Python's standard library, each file once: some Pythons link one module under two
    names (Ubuntu's `_sysconfigdata_*`), which prepare_data refuses as a file named twice."""
    files, seen = [], set()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if path.resolve() not in seen:
            seen.add(path.resolve())
            files.append(str(path))
    return files


def standard_library_shards(work: Path, vocab_size: int, max_train_tokens: int) -> Path:
    """Token shards of the Python standard library's sources, under `work` in a folder named by everything they
    depend on: the vocabulary size, the training stream's length, the source files and the Python that holds them.
    Built once per such key (the folder appears whole or not at all); a call of other settings builds its own."""
    files = standard_library_files()
    prepare_argv = ["--source", "text-files", "--text-files", *files, "--vocab-size", str(vocab_size),
                    "--max-train-tokens", str(max_train_tokens), "--max-heldout-tokens", str(64 * 2048), "--wiki", "no"]
    key = json.dumps({"prepare_data": prepare_argv, "python": sys.version}, sort_keys=True)
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
    folder = work / f"shards_vocab{vocab_size}_train{max_train_tokens}_{digest}"
    if (folder / "meta.json").is_file():
        return folder
    sys.path.insert(0, str(HERE / "reproduce"))
    import prepare_data

    prepare_data.main(["--out", str(folder), *prepare_argv])
    return folder


def recipe_command(run: dict, args, output_dir: Path) -> list[str]:
    command = [sys.executable, str(HERE / "pretrain.py"), "--arch", run["arch"], "--preset", args.preset,
               "--data-dir", str(args.data_dir), "--block-size", str(args.block_size), "--precision", args.precision,
               "--per-device-batch-size", str(run["batch"]), "--max-steps", str(args.steps),
               "--logging-steps", str(args.logging_steps), "--eval-steps", "1000000", "--save-steps", "1000000",
               "--max-eval-blocks", "2", "--seed", "0", "--output-dir", str(output_dir)]
    if run["mode"] != "eager":
        command += ["--torch_compile", "--torch_compile_mode", run["mode"]]
    return command + args.extra_args


def window_rates(train_log: Path) -> list[float]:
    rates = []
    for line in train_log.read_text(encoding="utf-8").splitlines():
        record = read_run_record(line)
        if "tokens_per_second" in record:
            rates.append(float(record["tokens_per_second"]))
    return rates


def run_environment() -> dict:
    """The runs import the checkout this script imported (it puts the checkout first on its path), installed or not."""
    pythonpath = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath}


def measure(run: dict, args) -> dict:
    output_dir = args.work / run["name"]
    shutil.rmtree(output_dir, ignore_errors=True)  # a folder left by an earlier call would resume and add to its log
    log_path = args.out / f"{run['name']}.log"
    started = time.perf_counter()
    with log_path.open("w", encoding="utf-8") as log:
        completed = subprocess.run(recipe_command(run, args, output_dir), stdout=log, stderr=subprocess.STDOUT,
                                   env=run_environment())
    row = {**run, "returncode": completed.returncode, "wall_s": round(time.perf_counter() - started, 1)}
    summary_path, train_log = output_dir / "summary.json", output_dir / "train_log.jsonl"
    if completed.returncode != 0 or not summary_path.is_file():
        row["error"] = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        return row
    write(args.out / f"{run['name']}_train_log.jsonl", train_log.read_text(encoding="utf-8"))
    summary = read_run_record(summary_path.read_text(encoding="utf-8"))  # (a diverged loss: NaN, see run_records)
    rates = window_rates(train_log)
    if not args.keep_run_folders:  # the saved model: 1.5 GB at 370M, 5.4 GB at 1.3B per run
        shutil.rmtree(output_dir, ignore_errors=True)
    steady = rates[args.skip_windows:]
    if not steady:
        row["error"] = [f"{len(rates)} tokens/s windows, none after the first {args.skip_windows}: raise --steps"]
        return row
    tokens_per_second = statistics.median(steady)
    row.update(
        tokens_per_second=round(tokens_per_second, 1),
        ms_per_step=round(1000 * summary["tokens_per_step"] / tokens_per_second, 2),
        windows=steady,
        peak_memory_gib=summary.get("peak_memory_gib"),
        parameters=summary["parameters"]["total"],
        final_train_loss=summary.get("train_loss"),
        device=summary.get("device"),
    )
    return row


def add_ratios(rows: list[dict]) -> None:
    reference = {}
    for row in rows:
        if "tokens_per_second" in row:
            reference.setdefault(row["batch"], row)
            base = reference[row["batch"]]
            row["ratio"] = round(row["tokens_per_second"] / base["tokens_per_second"], 3)
            row["ratio_to"] = base["name"]


def markdown(result: dict) -> str:
    versions = ", ".join(f"{name} {version}" for name, version in result["versions"].items() if version)
    lines = [f"# The recipe's training speed ({result['device']}, preset {result['preset']}, "
             f"{result['block_size']}-token blocks, {result['precision']})", "", f"Versions: {versions}.", "",
             f"`{result['command']}`", "",
             "| run | arch | mode | sequences | tokens/s | ms/step | ratio | peak GiB | parameters |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['name']} | {row['arch']} | {row['mode']} | {row['batch']} | failed: "
                         f"{' '.join(row['error'])} | | | | |")
            continue
        lines.append(f"| {row['name']} | {row['arch']} | {row['mode']} | {row['batch']} | "
                     f"{row['tokens_per_second']:,.0f} | {row['ms_per_step']} | {row['ratio']:.2f}x | "
                     f"{'-' if row['peak_memory_gib'] is None else row['peak_memory_gib']} | {row['parameters']:,} |")
    lines += ["", f"Ratios are to the first run of the same batch. Speed: the median of the recipe's tokens/s windows "
              f"({result['logging_steps']} steps each) after the first {result['skip_windows']}."]
    return "\n".join(lines) + "\n"


def write(path: Path, text: str) -> None:
    with atomic_output(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def library_versions() -> dict:
    """The versions of torch, transformers and triton (None where not installed) in this Python, which runs the
    recipe's processes, as each module reports it (torch's with its build, e.g. ``2.11.0+cu130``)."""
    import importlib

    versions = {}
    for name in ("torch", "transformers", "triton"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    return versions


def report(rows: list[dict], args, argv) -> dict:
    add_ratios(rows)
    devices = sorted({row["device"] for row in rows if row.get("device")})
    result = {"device": ", ".join(devices) or "unknown", "versions": library_versions(), "preset": args.preset,
              "block_size": args.block_size,
              "precision": args.precision, "steps": args.steps, "logging_steps": args.logging_steps,
              "skip_windows": args.skip_windows, "data_dir": str(args.data_dir),
              "command": " ".join(["examples/recipe_speed.py", *(sys.argv[1:] if argv is None else argv)]),
              "rows": rows}
    write(args.out / "recipe_speed.json", run_record_json(result, indent=2) + "\n")
    write(args.out / "recipe_speed.md", markdown(result))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=lambda text: Path(output_dir(text)), required=True, help="results folder")
    parser.add_argument("--runs", type=parse_run, nargs="+", required=True, help="ARCH:MODE[:BATCH] ...")
    parser.add_argument("--data-dir", type=Path, default=None, help="token shards (default: built from the stdlib)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "recipe_speed",
                        help="run folders, each with the run's saved model, and the shards built without --data-dir "
                        "(default: TMPDIR/recipe_speed)")
    parser.add_argument("--preset", default="370M", choices=sorted(PRESETS))
    parser.add_argument("--block-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--skip-windows", type=int, default=2)
    parser.add_argument("--keep-run-folders", action="store_true",
                        help="keep each run's folder under --work (its saved model) after reading its results")
    parser.add_argument("--vocab-size", type=int, default=32000, help="of the shards built without --data-dir")
    parser.add_argument("--extra-args", nargs=argparse.REMAINDER, default=[], help="more pretrain.py arguments")
    args = parser.parse_args(argv)
    for option, value, least in (("--block-size", args.block_size, 1), ("--steps", args.steps, 1),
                                 ("--logging-steps", args.logging_steps, 1), ("--skip-windows", args.skip_windows, 0)):
        if value < least:
            parser.error(f"{option} must be at least {least}, got {value}")
    if args.data_dir is not None and not (args.data_dir / "train.bin").is_file():
        parser.error(f"--data-dir {args.data_dir}: no train.bin there (a folder of token shards, "
                     "examples/token_shards.py; leave --data-dir out to build one from the standard library)")
    if args.data_dir is None:
        largest_batch = max(run["batch"] for run in args.runs)
        tokens = max(1_000_000, 2 * args.steps * largest_batch * (args.block_size + 1))
        args.data_dir = standard_library_shards(args.work, args.vocab_size, tokens)
    args.out.mkdir(parents=True, exist_ok=True)  # (once the data is there: a refused --vocab-size leaves no folder)
    name_repeated_runs(args.runs)
    rows = []
    for run in args.runs:
        rows.append(measure(run, args))
        print(run_record_json({k: v for k, v in rows[-1].items() if k != "windows"}), flush=True)
        result = report(rows, args, argv)  # after every run, so a run cut short keeps the rows before it
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
