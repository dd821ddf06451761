"""Side by side: where a training step's time goes under each engine of examples/ddp_check.sh.

Reads, from each results folder of `EXTRA_ARGS="--profile-steps FIRST:LAST" bash examples/ddp_check.sh DIR`, every
run's `RUN_profile_steps.txt` and `.json` (written by examples/pretrain.py on the main process) and `summaries.json`,
and prints one row per run: wall time per step, the kernel time of the main process's GPU per step (each kernel
once), the collective kernels' share of it, the GPU's idle share, how long the host waited for the GPU
(`cudaStreamSynchronize`) and the host's own time (torch.profiler's "Self CPU time total", all threads). A step
whose GPU idles while the host never waits is bound by the host: the engine's per-parameter Python work, not the
model's kernels.

    python examples/compare_engine_profiles.py DIR [DIR ...] --markdown OUT.md --json OUT.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hf_memffn.atomic_write import write_atomic
from hf_memffn.run_records import read_run_record, run_record_json

RUNS = ("single", "ddp", "fsdp2", "zero2", "zero3")
RUN_NAMES = {"single": "1 GPU", "ddp": "DDP", "fsdp2": "FSDP2", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def total_ms(text: str, label: str) -> float:
    """A torch.profiler table footer ('Self CUDA time total: 1.714s') in milliseconds."""
    match = re.search(rf"{label} time total: ([0-9.]+)(us|ms|s)\b", text)
    if match is None:
        raise ValueError(f"no '{label} time total' line in the profile table")
    return float(match.group(1)) * UNITS_MS[match.group(2)]


def profile_row(folder: Path, run: str) -> dict | None:
    text_path, json_path = folder / f"{run}_profile_steps.txt", folder / f"{run}_profile_steps.json"
    if not (text_path.is_file() and json_path.is_file()):
        return None
    text, profile = text_path.read_text(), read_run_record(json_path.read_text())
    # (summaries.json: each run's summary.json, a run record: a loss that is not finite is a float again)
    summaries_path = folder / "summaries.json"
    summaries = read_run_record(summaries_path.read_text()) if summaries_path.is_file() else {}
    summary = summaries.get(run, {})
    steps, wall, kernel = profile["steps"], profile["wall_ms_per_step"], profile["kernel_ms_per_step"]
    waited = sum(h["self_ms_per_step"] for h in profile["host_operators"] if h["name"] == "cudaStreamSynchronize")
    row = {
        "model": summary.get("model_type") or summary.get("arch") or folder.name,
        "run": run,
        "gpus": summary.get("world_size", 1 if run == "single" else 2),
        "device": summary.get("device", "unknown"),
        "steps_profiled": steps,
        "wall_ms_per_step": round(wall, 1),
        "kernel_ms_per_step": round(kernel, 1),
        "communication_kernel_ms_per_step": round(profile["communication_kernel_ms_per_step"], 1),
        "gpu_idle_fraction": round(max(0.0, 1 - kernel / wall), 3),
        "host_waits_for_gpu_ms_per_step": round(waited, 1),
        "host_self_ms_per_step": round(total_ms(text, "Self CPU") / steps, 1),
    }
    if "tokens_per_step" in summary:
        row["tokens_per_second_profiled"] = round(summary["tokens_per_step"] / wall * 1e3)
    return row


def markdown(rows: list[dict]) -> str:
    devices = ", ".join(sorted({r["device"] for r in rows}))
    lines = [f"Device: {devices}.", "",
             "| model | run | GPUs | wall ms/step | GPU 0 kernels ms/step | of which collectives | GPU idle | host waits for GPU ms/step | host self ms/step (all threads) | tokens/s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {RUN_NAMES[r['run']]} | {r['gpus']} | {r['wall_ms_per_step']:.1f} | {r['kernel_ms_per_step']:.1f} "
            f"| {r['communication_kernel_ms_per_step']:.1f} | {100 * r['gpu_idle_fraction']:.0f}% "
            f"| {r['host_waits_for_gpu_ms_per_step']:.1f} | {r['host_self_ms_per_step']:.1f} "
            f"| {r.get('tokens_per_second_profiled', 0):,} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    per_folder = [[row for run in RUNS if (row := profile_row(folder, run)) is not None] for folder in args.folders]
    without = [str(folder) for folder, folder_rows in zip(args.folders, per_folder) if not folder_rows]
    if without:  # (a mistyped folder among others would leave its rows out of the table unsaid)
        sys.exit(f"no RUN_profile_steps.txt/.json in {without}: run examples/ddp_check.sh "
                 "with EXTRA_ARGS='--profile-steps FIRST:LAST'")
    rows = [row for folder_rows in per_folder for row in folder_rows]
    table = markdown(rows)
    print(table, end="")
    for path, text in ((args.markdown, table), (args.json, run_record_json(rows, indent=2) + "\n")):
        if path is not None:
            write_atomic(path, text)
    return rows


if __name__ == "__main__":
    main()
