"""Nsight Compute profile of the three production FlashMHF kernels at the paper shape (B=8, H=16, L=4032, d_h=128,
E=15, d_e=384, bf16), one launch of each at its tuned configuration (one GPU call):

    python kernels/profile_flash_mhf_kernels.py --out DIR

Each kernel is launched by ``kernels/tune_flash_mhf.py --profile`` under ``ncu --clock-control none`` (the GPU keeps
its own clocks, as in the timings). Writes the raw metrics of each kernel (DIR/ncu_<kernel>.csv) and a summary of the
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

# (kernel role, Triton kernel name, tuned configuration BLOCK_L,BLOCK_N,warps,stages)
KERNELS = [
    ("forward", "_forward_kernel", "128,64,8,3"),
    ("rows", "_backward_rows_kernel", "128,64,8,3"),
    ("weights", "_backward_weights_kernel", "128,64,8,2"),
]
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


def profile(ncu: str, role: str, kernel: str, config: str, metrics: list[str], out: str) -> dict[str, str]:
    command = [ncu, "--clock-control", "none", "-k", kernel, "--launch-skip", "1", "--launch-count", "1",
               *[arg for section in SECTIONS for arg in ("--section", section)],
               *(["--metrics", ",".join(metrics)] if metrics else []), "--csv", "--page", "raw",
               sys.executable, os.path.join(HERE, "tune_flash_mhf.py"), "--profile", f"{role}:production:{config}"]
    run = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith('"')]
    path = os.path.join(out, f"ncu_{role}.csv")
    with open(path + ".tmp", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
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
    parser.add_argument("--out", required=True)
    parser.add_argument("--from-csv", action="store_true",
                        help="only rebuild the summary from the ncu_<kernel>.csv files already in --out (no GPU)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.from_csv:
        device = json.load(open(os.path.join(args.out, "ncu_summary.json")))["device"]
        ncu = metrics = None
    else:
        ncu = shutil.which("ncu")
        if ncu is None:
            sys.exit("profile_flash_mhf_kernels.py needs Nsight Compute (ncu) on PATH")
        known = known_metrics(ncu)
        metrics = [name for name in EXTRA_METRICS if name.split(".")[0] in known]
        import torch  # noqa: PLC0415 - only for the device name, after ncu was found

        device = torch.cuda.get_device_name()

    summary = {"device": device, "command": "python kernels/profile_flash_mhf_kernels.py",
               "shape": "B=8, H=16, L=4032, d_h=128, E=15, d_e=384, bf16", "kernels": {}}
    for role, kernel, config in KERNELS:
        if args.from_csv:
            with open(os.path.join(args.out, f"ncu_{role}.csv")) as handle:
                raw = read_raw([line.rstrip("\n") for line in handle if line.startswith('"')])
        else:
            raw = profile(ncu, role, kernel, config, metrics, args.out)
        row = {"config": config}
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
    lines = [f"# Nsight Compute: FlashMHF kernels on {summary['device']}", "", summary["shape"] + "; `"
             + summary["command"] + "`.", "", "| metric | " + " | ".join(r for r, _, _ in KERNELS) + " |",
             "|---|" + "---|" * len(KERNELS)]
    for label in ["config", *labels]:
        cells = [summary["kernels"][role].get(label, "-") for role, _, _ in KERNELS]
        lines.append(f"| {label} | " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells) + " |")
    stalls = sorted({name for role, _, _ in KERNELS for name in summary["kernels"][role]["stalls per issued instruction"]})
    for name in stalls:
        cells = [summary["kernels"][role]["stalls per issued instruction"].get(name) for role, _, _ in KERNELS]
        lines.append(f"| stall: {name} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    for name, text in (("ncu_summary.json", json.dumps(summary, indent=1)), ("ncu_summary.md", "\n".join(lines) + "\n")):
        path = os.path.join(args.out, name)
        with open(path + ".tmp", "w") as handle:
            handle.write(text)
        os.replace(path + ".tmp", path)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
