"""Nsight Compute profile of the FlashMHF kernels, one launch of each (one GPU call):

    python kernels/profile_flash_mhf_kernels.py --out DIR                      # the production kernels
    python kernels/profile_flash_mhf_kernels.py --out DIR --kernels forward_triton gates_backward

The op's kernels run at the paper shape (B=8, H=16, L=4032, d_h=128, E=15, d_e=384, bf16), launched by
``kernels/tune_flash_mhf.py --profile``: on Hopper the production kernels are the Gluon ones (``forward``, ``rows``,
``weights``), and the Triton kernels that run elsewhere are there too (``*_triton``). The layer's norm/gate kernels
(``gates_forward``, ``gates_backward``) run at the 1.3B layer's shape (4 x 2048 tokens, 16 heads, E=15), launched by
``kernels/tune_flash_mhf_layer.py --profile``. Everything runs under ``ncu --clock-control none`` (the GPU keeps its
own clocks, as in the timings). Writes the raw metrics of each kernel (DIR/ncu_<kernel>.csv) and a summary of the
metrics that say what limits them (DIR/ncu_summary.{json,md}): tensor-pipe activity, issue-slot use, shared-memory
traffic, spills, and the stall reasons per issued instruction.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import output_folder, read_json, write_json, write_text  # noqa: E402

OP_SHAPE = "B=8, H=16, L=4032, d_h=128, E=15, d_e=384, bf16"
GATES_SHAPE = "4 x 2048 tokens, H=16, d_h=128, E=15, bf16"
# role -> (kernel name, the script and arguments that launch it, shape); the op's configuration tuples are those
# tune_flash_mhf.py times (BLOCK_L,BLOCK_N,warps,stages; for the Gluon kernels, labels of their one launch shape)
KERNELS = {
    "forward": ("_warp_specialised_forward_kernel", ["tune_flash_mhf.py", "--profile", "forward:gluon:192,64,12,3"],
                OP_SHAPE),
    "rows": ("_rows_gradients_kernel", ["tune_flash_mhf.py", "--profile", "rows:gluon:128,64,8,3"], OP_SHAPE),
    "weights": ("_weight_gradients_kernel", ["tune_flash_mhf.py", "--profile", "weights:gluon:128,64,8,2"], OP_SHAPE),
    "forward_triton": ("_forward_kernel", ["tune_flash_mhf.py", "--profile", "forward:production:128,64,8,3"],
                       OP_SHAPE),
    "rows_triton": ("_backward_rows_kernel", ["tune_flash_mhf.py", "--profile", "rows:production:128,64,8,3"],
                    OP_SHAPE),
    "weights_triton": ("_backward_weights_kernel", ["tune_flash_mhf.py", "--profile", "weights:production:128,64,8,2"],
                       OP_SHAPE),
    "gates_forward": ("_queries_and_gates_kernel", ["tune_flash_mhf_layer.py", "--profile", "forward:1.3B"],
                      GATES_SHAPE),
    "gates_backward": ("_queries_and_gates_backward_kernel", ["tune_flash_mhf_layer.py", "--profile", "backward:1.3B"],
                       GATES_SHAPE),
}
DEFAULT_KERNELS = ("forward", "rows", "weights", "gates_forward", "gates_backward")
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats", "LaunchStats",
            "Occupancy"]
# metrics beyond the sections (only those the installed ncu knows are requested)
EXTRA_METRICS = [
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed",
    "smsp__inst_executed_op_local_ld.sum",
    "smsp__inst_executed_op_local_st.sum",
]
# summary: (label, metric name)
SUMMARY = [
    ("duration ms", "gpu__time_duration.sum"),
    ("SM frequency GHz", "gpc__cycles_elapsed.avg.per_second"),
    ("registers/thread", "launch__registers_per_thread"),
    ("tensor pipe active %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("issue slots busy %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
    ("shared-memory bank reads %", "l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed"),
    ("shared-memory bank writes %", "l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed"),
    ("shared ld/st wavefronts %", "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"),
    ("local (spill) loads", "smsp__inst_executed_op_local_ld.sum"),
    ("local (spill) stores", "smsp__inst_executed_op_local_st.sum"),
]
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def known_metrics(ncu: str) -> set[str]:
    listing = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip() and not line.startswith(("-", "Device"))}


def read_raw(lines: list[str]) -> dict[str, str]:
    """Metric name -> value of the one profiled launch in ncu's raw CSV page (header, units, values)."""
    header, _units, values = list(csv.reader(io.StringIO("\n".join(lines[:3]))))
    return dict(zip(header, values))


def profile(ncu: str, role: str, metrics: list[str], out: str) -> dict[str, str]:
    kernel, (script, *arguments), _ = KERNELS[role]
    command = [ncu, "--clock-control", "none", "-k", kernel, "--launch-skip", "1", "--launch-count", "1",
               *[arg for section in SECTIONS for arg in ("--section", section)],
               *(["--metrics", ",".join(metrics)] if metrics else []), "--csv", "--page", "raw",
               sys.executable, os.path.join(HERE, script), *arguments]
    run = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith('"')]
    write_text(os.path.join(out, f"ncu_{role}.csv"), "\n".join(lines) + "\n")
    if run.returncode or len(lines) < 3:
        raise RuntimeError(f"ncu failed for {kernel} (exit {run.returncode}): {run.stderr[-2000:]}")
    return read_raw(lines)


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--kernels", nargs="+", default=list(DEFAULT_KERNELS), choices=list(KERNELS),
                        help="which kernels (default: %(default)s)")
    parser.add_argument("--from-csv", action="store_true",
                        help="only rebuild the summary from ncu_summary.json and the ncu_<kernel>.csv files already in "
                        "--out (no GPU)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.from_csv:
        previous = read_json(os.path.join(args.out, "ncu_summary.json"))
        device = previous["device"]
        ncu = metrics = None
    else:
        ncu = shutil.which("ncu")
        if ncu is None:
            sys.exit("profile_flash_mhf_kernels.py needs Nsight Compute (ncu) on PATH")
        known = known_metrics(ncu)
        metrics = [name for name in EXTRA_METRICS if name.split(".")[0] in known]
        import torch  # noqa: PLC0415 - only for the device name, after ncu was found

        device = torch.cuda.get_device_name()

    roles = list(previous["kernels"]) if args.from_csv else list(dict.fromkeys(args.kernels))
    summary = {"device": device, "command": "python kernels/profile_flash_mhf_kernels.py --kernels " + " ".join(roles),
               "kernels": {}}
    for role in roles:
        csv_path = os.path.join(args.out, f"ncu_{role}.csv")
        if args.from_csv and not os.path.exists(csv_path):  # (a summary kept without its raw metrics)
            summary["kernels"][role] = previous["kernels"][role]
            continue
        if args.from_csv:
            with open(csv_path) as handle:
                raw = read_raw([line.rstrip("\n") for line in handle if line.startswith('"')])
        else:
            try:
                raw = profile(ncu, role, metrics, args.out)
            except RuntimeError as exc:  # one kernel's failure is a result; the others are still profiled
                print(exc, flush=True)
                raw = {"error": str(exc)[:500]}
        kernel, launch, shape = KERNELS[role]
        row = {"kernel": kernel, "launch": " ".join(launch), "shape": shape}
        if "error" in raw:
            row["error"] = raw["error"]
        for label, name in SUMMARY:
            value = number(raw.get(name))
            if value is not None:
                row[label] = value / 1e6 if label == "duration ms" else (value / 1e9 if "GHz" in label else value)
        row["stalls per issued instruction"] = {
            name[len(STALL_PREFIX):-len(STALL_SUFFIX)]: number(value) for name, value in raw.items()
            if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and (number(value) or 0) >= 0.05
        }
        summary["kernels"][role] = row
        print(role, json.dumps(row), flush=True)

    labels = [label for label, _ in SUMMARY]
    lines = [f"# Nsight Compute: FlashMHF kernels on {summary['device']}", "", "`" + summary["command"] + "`.", "",
             "| metric | " + " | ".join(roles) + " |", "|---|" + "---|" * len(roles)]
    for label in ["kernel", "shape", *labels]:
        cells = [summary["kernels"][role].get(label, "-") for role in roles]
        text = [f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells]
        lines.append(f"| {label} | " + " | ".join(text) + " |")
    stalls = sorted({name for role in roles for name in summary["kernels"][role]["stalls per issued instruction"]})
    for name in stalls:
        cells = [summary["kernels"][role]["stalls per issued instruction"].get(name) for role in roles]
        lines.append(f"| stall: {name} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    write_json(os.path.join(args.out, "ncu_summary.json"), summary)
    write_text(os.path.join(args.out, "ncu_summary.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
