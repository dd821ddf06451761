"""Compare the loss curves of two or more runs of examples/pretrain.py (their `train_log.jsonl`).

    python examples/compare_loss_curves.py runs/single runs/fsdp2 [runs/fsdp2-compile] --json out.json --markdown out.md

The first run is the reference. For every other run it reports, over the steps both logged, the largest and mean
absolute difference of the training loss and of the evaluation loss, next to the noise of the reference curve
(the standard deviation of its training loss around a 5-point moving average): runs that agree "within noise"
have a mean difference below that noise. Steps are compared as such, so every run whose summary.json is there must
have trained on as many tokens per step as the reference, and every run must have logged its training loss (the mean
since the previous log) over the same windows of steps as the reference where both logged (the script refuses runs
that did not: another --logging-steps, or another --save-steps, at which the recipe also logs).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from hf_memffn.atomic_write import write_atomic
from hf_memffn.run_records import read_run_record, run_record_json  # (a loss that is not finite: see its NOT_FINITE)


def read_curves(run_dir: Path) -> dict:
    """The run's training and evaluation losses by step, and the first step of each training loss's window (the
    Trainer logs the mean loss of the steps since its previous log). A last line cut short is left out."""
    train, windows, evaluation, summary = {}, {}, {}, {}
    log = run_dir / "train_log.jsonl"
    lines = log.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            record = read_run_record(line)
        except ValueError as error:
            if number == len(lines):  # (cut short by a run stopped while appending it, or one still writing it)
                break
            raise ValueError(f"{log}: line {number} is no record of examples/pretrain.py's log ({error})") from None
        if "loss" in record:
            windows[record["step"]] = max(train, default=0) + 1
            train[record["step"]] = record["loss"]
        if "eval_loss" in record:
            evaluation[record["step"]] = record["eval_loss"]
    if (run_dir / "summary.json").is_file():
        try:
            summary = read_run_record((run_dir / "summary.json").read_text(encoding="utf-8"))
        except ValueError as error:
            raise ValueError(f"{run_dir / 'summary.json'} is no summary of examples/pretrain.py ({error})") from None
    return {"train": train, "windows": windows, "eval": evaluation, "summary": summary}


def curve_noise(curve: dict[int, float], window: int = 5) -> float | None:
    """The spread of the finite losses around their moving average (None under two of them: no spread to compare).
    A loss that is not finite (a step where the run diverged) is left out: it has no spread, and `statistics.pstdev`
    raises on it. A run compared with a reference that diverged gets a mean difference of NaN, within no noise."""
    values = [curve[step] for step in sorted(curve) if math.isfinite(curve[step])]
    residuals = []
    for i in range(len(values)):
        lo, hi = max(0, i - window // 2), min(len(values), i + window // 2 + 1)
        residuals.append(values[i] - statistics.fmean(values[lo:hi]))
    return statistics.pstdev(residuals) if len(residuals) > 1 else None


def differences(reference: dict[int, float], other: dict[int, float]) -> dict:
    """The absolute differences over the steps both logged; a step where either loss is NaN (a run that diverged)
    makes the largest and the mean NaN, as no difference there is known."""
    steps = sorted(set(reference) & set(other))
    if not steps:
        return {"steps": 0}
    deltas = [abs(reference[s] - other[s]) for s in steps]
    # (`max` skips a NaN that is not first: a run that diverged for some steps read as close as its other steps)
    largest = math.nan if any(math.isnan(delta) for delta in deltas) else max(deltas)
    return {"steps": len(steps), "last_step": steps[-1], "max_abs": largest, "mean_abs": statistics.fmean(deltas),
            "reference_last": reference[steps[-1]], "other_last": other[steps[-1]]}


def compare(run_dirs: list[Path]) -> dict:
    runs = {str(d): read_curves(d) for d in run_dirs}
    reference_name = str(run_dirs[0])
    reference = runs[reference_name]
    per_step = {name: run["summary"].get("tokens_per_step") for name, run in runs.items()}
    if len({tokens for tokens in per_step.values() if tokens is not None}) > 1:
        raise ValueError(f"the runs trained on different tokens per step, so their curves do not match step for step: "
                         f"{per_step}")
    for name, run in runs.items():
        steps = sorted(set(reference["windows"]) & set(run["windows"]))
        other = [step for step in steps if reference["windows"][step] != run["windows"][step]]
        if other:
            step = other[0]
            raise ValueError(f"{name} logged its training loss over other steps than the reference, so their losses "
                             f"at a step are means over other windows: at step {step}, steps "
                             f"{run['windows'][step]}-{step} against {reference['windows'][step]}-{step}; compare "
                             "runs of the same --logging-steps and --save-steps")
    result = {"reference": reference_name, "reference_train_noise": curve_noise(reference["train"]), "runs": {}}
    for name, run in runs.items():
        summary = run["summary"]
        entry = {key: summary.get(key) for key in ("world_size", "device", "global_step", "eval_loss", "tokens_per_second", "mfu", "train_seconds")}
        if name != reference_name:
            entry["train_loss_difference"] = differences(reference["train"], run["train"])
            entry["eval_loss_difference"] = differences(reference["eval"], run["eval"])
            mean_abs, noise = entry["train_loss_difference"].get("mean_abs"), result["reference_train_noise"]
            # (None: no common step, or too few of the reference's losses to know its noise)
            entry["within_noise"] = None if mean_abs is None or noise is None else mean_abs < noise
        result["runs"][name] = entry
    return result


def markdown(result: dict) -> str:
    noise = result["reference_train_noise"]
    lines = [
        f"Reference: `{result['reference']}`; noise of its training loss (std around a 5-point moving average): "
        + (f"{noise:.4f}" if noise is not None else "- (under two logged losses)"),
        "",
        "| run | GPUs | steps | final eval loss | tokens/s | MFU | mean abs Δ train loss | max abs Δ train loss | max abs Δ eval loss | within noise |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, entry in result["runs"].items():
        train = entry.get("train_loss_difference", {})
        evaluation = entry.get("eval_loss_difference", {})
        fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"  # noqa: E731
        mfu = f"{entry['mfu'] * 100:.1f}%" if entry.get("mfu") is not None else "-"
        lines.append(
            f"| `{name}` | {entry.get('world_size')} | {entry.get('global_step')} | {fmt(entry.get('eval_loss'), '.4f')} | "
            f"{fmt(entry.get('tokens_per_second'), ',.0f')} | {mfu} | "
            f"{fmt(train.get('mean_abs'), '.4f')} | {fmt(train.get('max_abs'), '.4f')} | {fmt(evaluation.get('max_abs'), '.4f')} | "
            f"{'-' if entry.get('within_noise', '') is None else entry.get('within_noise', 'reference')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="output dirs of pretrain.py; the first is the reference")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    without_log = [str(run) for run in args.runs if not (run / "train_log.jsonl").is_file()]
    if without_log:
        parser.error(f"runs {without_log} hold no train_log.jsonl: give output dirs of examples/pretrain.py")
    resolved = [run.resolve() for run in args.runs]
    repeated = sorted({str(run) for run, path in zip(args.runs, resolved) if resolved.count(path) > 1})
    if repeated:
        parser.error(f"runs {repeated} given more than once (each run is a row of the comparison)")
    try:
        result = compare(args.runs)
    except ValueError as error:
        parser.error(str(error))
    table = markdown(result)
    print(table)
    # (strict JSON: a difference that is NaN, a run that diverged, is written as null and named under not_finite)
    strict_json = run_record_json(result, indent=2) + "\n"
    for path, text in ((args.json, strict_json), (args.markdown, table)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text)
    return result


if __name__ == "__main__":
    main()
