"""The papers' orderings across model sizes and training budgets: one column per learning-rate sweep (a
`learning_rates.py --out` folder), each cell the ordering's paired difference with both models at their best rate, as
that sweep's last table gives it.

    python examples/reproduce/verdicts.py --out DIR --sweeps SWEEP_DIR [SWEEP_DIR ...] [--shared-orderings-only]

Writes verdicts.md, verdicts.json and verdicts.png to --out. The columns run from most to fewest training tokens per
parameter (of the sweep's SwiGLU baseline); a column is named by its size, by its budget too where two sweeps
share a size (one size trained on several numbers of tokens), and by its training stream too where sweeps of one size
read streams of different lengths (`prepare_data.py --max-train-tokens`: one budget then repeats a shorter stream more
often). A cell is loss(right) - loss(left) over the seeds both models ran, ± its standard error (seeds): positive where
the paper's ordering holds, **bold** where study.py's verdict calls the difference resolved either way; a cell where
a run diverged (a NaN or infinite loss) says so and names the run, with no verdict. Where several
sizes (or streams) each train on several budgets, each ordering gets a second table too, of sizes (or streams) by
budgets. The plot has a panel per ordering: the difference against tokens per parameter (or, for several sizes at
several budgets, a line per size, or per stream, against the budget), with bars of two standard errors.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from learning_rates import best_rate_text, paired_text, passes_over  # noqa: E402
from study import (CLAIMS, DIVERGED, fmt_tokens, read_json, save_figure, strict_json,  # noqa: E402
                   verdict_is_resolved, write_atomic)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweeps", nargs="+", required=True,
                   help="learning_rates.py --out folders (each with learning_rates.json), one per size and budget")
    p.add_argument("--shared-orderings-only", action="store_true",
                   help="only the orderings that every sweep holds (by default, those that any sweep holds)")
    p.add_argument("--out", required=True, help="folder for verdicts.{md,json,png}")
    return p


def read_sweep(folder: Path) -> dict:
    """A sweep's size, budget, the SwiGLU baseline's parameters (from the first of its studies that ran it) and its
    orderings."""
    path = folder / "learning_rates.json"
    if not path.is_file():
        raise ValueError(f"--sweeps: {str(folder)!r} holds no sweep (learning_rates.json is missing)")
    sweep = read_json(path)
    total = stream = None
    for study in sweep["studies"]:
        results = Path(study) / "results.json"
        if not results.is_file():
            raise ValueError(f"--sweeps: {str(folder)!r} names the study {study!r}, which holds no results.json here "
                             "(run from the folder its paths are relative to)")
        state = read_json(results)
        stream = stream or state["data"]["splits"]["train"].get("tokens")
        if "llama" in state["parameters"]:
            total = state["parameters"]["llama"]["total"]
            break
    if total is None:
        raise ValueError(f"--sweeps: no study of {str(folder)!r} ran the SwiGLU baseline (llama) to count")
    return {"path": str(folder), "size": sweep["size"], "tokens": sweep["tokens"], "stream": stream,
            "parameters": total,
            "tokens_per_parameter": sweep["tokens"] / total,
            "passes": round(sweep["tokens"] / stream, 2) if stream else None,
            "devices": sorted({run["device"] for run in sweep["runs"]}),
            "claims": [c for c in sweep["claims_at_best_rates"] if "lower" in c]}


def several_streams(sweeps: list[dict], size: str | None = None) -> bool:
    """Whether the sweeps of `size` (of any one size, without it) read training streams (numbers of tokens in the
    training split) of several lengths."""
    sizes = [size] if size else {s["size"] for s in sweeps}
    return any(len({s["stream"] for s in sweeps if s["size"] == one}) > 1 for one in sizes)


def stream_text(stream: int | None) -> str:
    return fmt_tokens(stream) if stream else "unknown"


def budget_text(tokens: int, budgets: list[int]) -> str:
    """A budget as the tables print it, "16M"; its exact number of tokens where another of `budgets` prints alike
    (15.99M and 16M)."""
    alike = {other for other in budgets if fmt_tokens(other) == fmt_tokens(tokens)}
    return f"{tokens:,}" if len(alike) > 1 else fmt_tokens(tokens)


def name_columns(sweeps: list[dict]) -> None:
    """Each sweep's column: its size, with its budget where another sweep has the same size, and with its training
    stream where another sweep of that size reads another one (the same budget then repeats a shorter stream more
    often). Two sweeps of one size, budget and stream are refused."""
    sizes = [s["size"] for s in sweeps]
    budgets = [(s["size"], s["tokens"], s["stream"]) for s in sweeps]
    repeated = sorted({f"{size} at {tokens:,} tokens" + (f" of a {stream:,}-token stream" if stream else "")
                       for size, tokens, stream in budgets if budgets.count((size, tokens, stream)) > 1})
    if repeated:
        raise ValueError(f"--sweeps: one sweep per size, budget and training stream; {repeated} given more than once")
    for sweep in sweeps:
        several = sizes.count(sweep["size"]) > 1
        budget = budget_text(sweep["tokens"], [s["tokens"] for s in sweeps if s["size"] == sweep["size"]])
        sweep["column"] = f"{sweep['size']} {budget}" if several else sweep["size"]
        if several_streams(sweeps, sweep["size"]):
            sweep["column"] += f", {stream_text(sweep['stream'])} stream"


def rows_of(sweeps: list[dict], shared_only: bool = False) -> list[dict]:
    """One row per ordering (a pair of model keys) that any sweep holds (every sweep, with `shared_only`), in
    study.py's order of them; each sweep's cell, and the ordering as the sweep with the fewest tokens per parameter
    words it."""
    rows: dict[tuple[str, str], dict] = {}
    for sweep in sweeps:
        for claim in sweep["claims"]:
            row = rows.setdefault((claim["lower"], claim["higher"]),
                                  {"lower": claim["lower"], "higher": claim["higher"], "paper": claim["paper"],
                                   "claims": {}, "cells": {}})
            row["claims"][sweep["column"]] = claim["claim"]
            row["cells"][sweep["column"]] = {
                "paired_delta": claim.get("paired_delta"), "paired_standard_error": claim.get("paired_standard_error"),
                "paired_seeds": claim["paired_seeds"], "delta": claim["delta"], "verdict": claim["verdict"],
                "resolved": verdict_is_resolved(claim["verdict"]), "learning_rates": claim.get("learning_rates"),
                "learning_rate_edges": claim.get("learning_rate_edges")}
    for row in rows.values():
        row["claim"] = next(row["claims"][s["column"]] for s in reversed(sweeps) if s["column"] in row["claims"])
    order = [(claim.lower, claim.higher) for claim in CLAIMS]
    kept = [row for row in rows.values() if not shared_only or len(row["cells"]) == len(sweeps)]
    return sorted(kept, key=lambda row: order.index((row["lower"], row["higher"])))


def cell_text(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if cell["verdict"].startswith(DIVERGED):  # (a NaN or infinite difference, naming the runs that diverged)
        return cell["verdict"]
    if cell["paired_delta"] is None:  # (no seed in common: the difference of the means)
        text = f"{cell['delta']:+.3f} (means)"
    else:
        text = paired_text((cell["paired_seeds"], cell["paired_delta"], cell["paired_standard_error"]))
    return f"**{text}**" if cell["resolved"] else text


def passes_text(sweep: dict) -> str:
    """Said only of a budget longer than the training stream, which the runs then read more than once."""
    return f", {sweep['passes']:g} passes over the training stream" if passes_over(sweep["tokens"], sweep["stream"]) \
        else ""


def spanned(sweeps: list[dict]) -> str:
    """What the sweeps vary: "sizes", "training budgets", or "sizes and training budgets", and "training streams" as
    well where sweeps of one size read streams of several lengths."""
    sizes = {s["size"] for s in sweeps}
    what = ("sizes" if len(sizes) == len(sweeps) else "training budgets" if len(sizes) == 1
            else "sizes and training budgets")
    if several_streams(sweeps):
        what = what.replace(" and ", ", ") + " and training streams"
    return what


def by_line(sweeps: list[dict]) -> dict[str, list[dict]]:
    """The sweeps of each size (and, where a size reads several, of each of its training streams): the lines of the
    grid and of the plot, from fewest parameters and longest stream, each line's sweeps from fewest tokens."""
    lines: dict[str, list[dict]] = {}
    for sweep in sorted(sweeps, key=lambda s: (s["parameters"], -(s["stream"] or 0), s["tokens"])):
        several = several_streams(sweeps, sweep["size"])
        label = f"{sweep['size']}, {stream_text(sweep['stream'])} stream" if several else sweep["size"]
        lines.setdefault(label, []).append(sweep)
    return lines


def in_grid(sweeps: list[dict]) -> bool:
    """Several lines (sizes, or streams of one size), one of them trained on several budgets."""
    lines = by_line(sweeps)
    return 1 < len(lines) < len(sweeps)


def grid(sweeps: list[dict], row: dict) -> list[str]:
    """One ordering's cells as a table: a line per size (per training stream of a size that read several), a column
    per training budget."""
    budgets = sorted({s["tokens"] for s in sweeps})
    lines = [f"| {row['claim']} | " + " | ".join(budget_text(b, budgets) + " tokens" for b in budgets) + " |",
             "|---|" + "---:|" * len(budgets)]
    for of_line in by_line(sweeps).values():
        first = of_line[0]
        column = {s["tokens"]: s["column"] for s in of_line}
        cells = [cell_text(row["cells"].get(column[b])) if b in column else "-" for b in budgets]
        stream = (f", a training stream of {stream_text(first['stream'])} tokens"
                  if several_streams(sweeps, first["size"]) else "")
        lines.append(f"| `{first['size']}`, {first['parameters'] / 1e6:.1f}M parameters{stream} | "
                     + " | ".join(cells) + " |")
    return lines


def markdown(sweeps: list[dict], rows: list[dict]) -> str:
    devices = sorted({d for s in sweeps for d in s["devices"]})
    header = " | ".join(f"`{s['column']}`, {s['tokens_per_parameter']:.2g} tokens/param" for s in sweeps)
    across = spanned(sweeps)
    lines = [f"# The papers' orderings across {across}, each model at its best learning rate", "",
             "- sweeps: " + ", ".join(f"`{s['path']}` (`{s['size']}`, {s['parameters']:,} parameters, "
                                       f"{s['tokens']:,} tokens{passes_text(s)})" for s in sweeps),
             f"- devices: {', '.join(devices)}", "",
             "Each cell: loss(right) - loss(left) with both models at their best rate, paired over the seeds both "
             "ran, ± its standard error (seeds); positive where the paper's ordering holds; **bold** where study.py's "
             "verdict calls it resolved (with three or more seeds, more than twice its standard error; with fewer, a "
             "difference of the means more than twice the larger seed deviation); \"-\": not in that sweep.", "",
             f"| paper's ordering | paper | {header} |", "|---|---|" + "---:|" * len(sweeps)]
    for row in rows:
        cells = " | ".join(cell_text(row["cells"].get(s["column"])) for s in sweeps)
        lines.append(f"| {row['claim']} | {row['paper']} | {cells} |")
    if in_grid(sweeps):
        by_what = "size, training stream" if several_streams(sweeps) else "size"
        lines += ["", f"The same cells by {by_what} and training budget (each budget a whole schedule of its own):"]
        for row in rows:
            lines += [""] + grid(sweeps, row)
    worded = [(s["column"], row["claims"][s["column"]]) for row in rows for s in sweeps
              if s["column"] in row["claims"] and row["claims"][s["column"]] != row["claim"]]
    if worded:
        lines += ["", "The models of a row differ in shape with the size; where a sweep names them otherwise:", ""]
        lines += [f"- `{column}`: {claim}" for column, claim in worded]
    if any(cell["learning_rates"] for row in rows for cell in row["cells"].values()):
        lines += ["", "Best rates (left / right) behind each cell; \"(lowest)\" / \"(highest)\" / \"(only)\": the "
                  "lowest, highest or only of the rates that model ran in that sweep, so a rate beyond might do "
                  "better:", "",
                  "| paper's ordering | " + " | ".join(f"`{s['column']}`" for s in sweeps) + " |",
                  "|---|" + "---:|" * len(sweeps)]
        for row in rows:
            cells = []
            for sweep in sweeps:
                cell = row["cells"].get(sweep["column"], {})
                pair, edges = cell.get("learning_rates"), cell.get("learning_rate_edges") or [None, None]
                cells.append(" / ".join(best_rate_text(rate) + (f" ({edge})" if edge else "")
                                        for rate, edge in zip(pair, edges)) if pair else "-")
            lines.append(f"| {row['claim']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(sweeps: list[dict], rows: list[dict], path: Path) -> bool:
    """A panel per ordering: its paired difference against tokens per parameter (log scale), bars of two standard
    errors, filled markers where resolved; above zero the paper's ordering holds. Where several sizes each train on
    several budgets, a line per size against the number of training tokens instead."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        print("matplotlib is not installed: no verdicts.png")
        return False
    columns = min(4, len(rows))
    lines_of_panels = -(-len(rows) // columns)
    figure, axes = plt.subplots(lines_of_panels, columns, figsize=(4.2 * columns, 3.0 * lines_of_panels),
                                squeeze=False)
    # sizes (or streams) at several budgets: a line each against the budget; otherwise one line against tokens per
    # parameter
    per_size = in_grid(sweeps)
    if per_size:
        x = {s["column"]: s["tokens"] for s in sweeps}
        lines = {label: [s["column"] for s in of_line] for label, of_line in by_line(sweeps).items()}
        ticks, tick_text, label = sorted(set(x.values())), fmt_tokens, "training tokens (each a whole schedule)"
        if several_streams(sweeps):  # the streams of one size share budgets: each line a little to the right
            x = {column: x[column] * 1.04 ** index
                 for index, columns in enumerate(lines.values()) for column in columns}
    else:
        x = {s["column"]: s["tokens_per_parameter"] for s in sweeps}
        lines = {None: [s["column"] for s in sweeps]}
        ticks, tick_text, label = sorted(x.values()), "{:.2g}".format, "training tokens per parameter"
    colours = {size: f"C{i % 10}" for i, size in enumerate(lines)}  # matplotlib's default colour cycle
    for axis, row in zip(axes.flat, rows):
        for size, columns_of_line in lines.items():
            # (a difference of a run that diverged to infinity has no place on the axis)
            cells = {column: row["cells"][column] for column in columns_of_line
                     if column in row["cells"] and row["cells"][column]["paired_delta"] is not None
                     and math.isfinite(row["cells"][column]["paired_delta"])}
            colour = colours[size]
            trend = sorted((x[column], cell["paired_delta"]) for column, cell in cells.items())
            if trend:
                axis.plot(*zip(*trend), color=colour, linewidth=0.8, alpha=0.5, label=size)
            for column, cell in cells.items():
                error = 2 * cell["paired_standard_error"] if cell["paired_standard_error"] is not None else None
                axis.errorbar([x[column]], [cell["paired_delta"]], yerr=error, marker="o", capsize=3,
                              color=colour, markerfacecolor=colour if cell["resolved"] else "white")
                if not per_size:
                    axis.annotate(column, (x[column], cell["paired_delta"]), textcoords="offset points",
                                  xytext=(4, 4), fontsize=7)
        if per_size:
            axis.legend(fontsize=7, title="size, stream" if several_streams(sweeps) else "size", title_fontsize=7)
        axis.axhline(0.0, color="grey", linewidth=0.8)
        axis.set_xscale("log")
        axis.set_xticks(ticks, [tick_text(tick) for tick in ticks])
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_title(row["claim"], fontsize=8)
        axis.set_xlabel(label, fontsize=7)
        axis.set_ylabel("loss(right) - loss(left)", fontsize=7)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(rows):]:
        axis.set_visible(False)
    devices = ", ".join(sorted({d for s in sweeps for d in s["devices"]}))
    title = (f"the papers' orderings, each model at its best rate ({devices}); above zero: the paper's order, "
             "filled: resolved, bars: 2 standard errors")
    figure.suptitle(textwrap.fill(title, width=int(14 * 4.2 * columns)), fontsize=9)  # ~14 characters per inch
    save_figure(figure, path, dpi=110)
    return True


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    sweeps = [read_sweep(Path(folder)) for folder in args.sweeps]
    name_columns(sweeps)
    sweeps.sort(key=lambda s: (-s["tokens_per_parameter"], -(s["stream"] or 0)))
    rows = rows_of(sweeps, args.shared_orderings_only)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"sweeps": [{k: v for k, v in s.items() if k != "claims"} for s in sweeps], "rows": rows}
    write_atomic(out / "verdicts.json", strict_json(report))
    text = markdown(sweeps, rows)
    write_atomic(out / "verdicts.md", text)
    plot(sweeps, rows, out / "verdicts.png")
    print(text)
    return report


if __name__ == "__main__":
    main()
