"""Held-out loss against the peak learning rate, from studies of one size, budget and data that differ only in it
(`study.py --learning-rate LR`; a study without the option ran every model at its recipe's rate).

    python examples/reproduce/learning_rates.py --out DIR --studies STUDY_DIR [STUDY_DIR ...] [--models llama,pkv]

Writes learning_rates.md, learning_rates.json and learning_rates.png to --out: per model and rate the held-out loss
(mean ± standard deviation over seeds), each model's best rate, and every model's paired difference from its
group's baseline (SwiGLU; for the KV-FFN group, SwiGLU with that group's recipe) at each rate and at each one's best
rate, and the papers' orderings that study.py checks (`study.CLAIMS`) with each model at its best rate. A seed fixes
the order of the training batches whatever the rate, so runs of one seed are paired across rates too. A model, rate
and seed run in two studies keeps its run in the first of them, in the order of --studies; the later run is listed
as a repeat beside it.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import models as study_models  # noqa: E402
from study import (DIVERGED, aggregate, claims_rows, claims_table, evaluated_tokens_text, fmt,  # noqa: E402
                   nan_where_null, paired_difference, read_json, repeat_pairs_markdown, save_figure, strict_json,
                   write_atomic)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--studies", nargs="+", required=True, help="study.py --out folders (each with results.json)")
    p.add_argument("--out", required=True, help="folder for learning_rates.{md,json,png}")
    p.add_argument("--models", default=None,
                   help="comma-separated model keys (default: every model run at two or more rates)")
    return p


def read_runs(folders: list[Path]) -> tuple[dict, list[dict], list[tuple[dict, dict]]]:
    """The first study's settings, every run of all of them with the peak learning rate it trained at, and the runs
    repeated with a model, rate and seed of an earlier study as (kept run, repeat) pairs, the repeat left out of the
    runs. Studies of another size, budget or data, and a study named twice, are refused."""
    named = [folder.resolve() for folder in folders]
    twice = sorted({str(folder) for folder, path in zip(folders, named) if named.count(path) > 1})
    if twice:
        raise ValueError(f"--studies: {twice} named more than once; name each study once")
    studies = []
    for folder in folders:
        path = folder / "results.json"
        if not path.is_file():
            raise ValueError(f"--studies: {str(folder)!r} holds no study (results.json is missing)")
        studies.append((folder, read_json(path)))
    first_folder, first = studies[0]

    def settings(study: dict) -> dict:
        splits = {name: split.get("sha256") for name, split in study["data"]["splits"].items()}
        return {"size": study["size"], "tokens": study["tokens"], "eval_tokens": study["eval_tokens"], "data": splits}

    recipes = {m.key: m.recipe for m in study_models.study_models(study_models.SHAPES[first["size"]])}
    kept: dict[tuple, dict] = {}
    repeats = []
    for folder, study in studies:
        if settings(study) != settings(first):
            raise ValueError(f"--studies: {str(folder)!r} was made with {settings(study)}, {str(first_folder)!r} "
                             f"with {settings(first)}; compare studies of one size, budget and data")
        for run in study["runs"]:
            rate = run.get("learning_rate") or study.get("learning_rate") or \
                study_models.RECIPES[recipes[run["model"]]].learning_rate
            run = {**nan_where_null(run), "learning_rate": rate, "study": str(folder)}
            key = (run["model"], rate, run["seed"])
            if key in kept:
                repeats.append((kept[key], run))
            else:
                kept[key] = run
    return first, list(kept.values()), repeats


def summarize(runs: list[dict], keys: list[str], baselines: dict[str, str]) -> dict:
    """Per model: per rate the losses' mean, standard deviation and seeds; the best rate; the paired differences from
    its baseline (`baselines[key]`, where that model is among `keys`) at each rate and at both models' best rates."""
    tagged = [{**run, "model": f"{run['model']}@{rate_text(run['learning_rate'])}"} for run in runs]
    by_model_and_rate = aggregate(tagged)
    table: dict = {}
    for key in keys:
        per_rate = {}
        for rate in sorted({r["learning_rate"] for r in runs if r["model"] == key}):
            entry = by_model_and_rate[f"{key}@{rate_text(rate)}"]
            per_rate[rate_text(rate)] = {"learning_rate": rate, "seeds": sorted(entry["seeds"]),
                                         **{k: entry[k] for k in ("heldout_loss_mean", "heldout_loss_std")}}
        # (a rate whose mean is not finite, a run diverged, is never the best: where every rate's is, none is)
        finite = [entry for entry in per_rate.values() if math.isfinite(entry["heldout_loss_mean"])]
        best = min(finite, key=lambda entry: entry["heldout_loss_mean"])["learning_rate"] if finite else None
        table[key] = {"rates": per_rate, "best_learning_rate": best,
                      "best_rate_edge": None if best is None else rate_edge(
                          [entry["learning_rate"] for entry in per_rate.values()], best)}
    for key in keys:
        base = baselines[key]
        if base == key or base not in table:
            continue
        entry = table[key]
        entry["baseline"] = base
        entry["vs_baseline"] = {}
        for label in entry["rates"]:
            if label in table[base]["rates"]:
                entry["vs_baseline"][label] = paired_difference(tagged, f"{base}@{label}", f"{key}@{label}")
        if None in (table[base]["best_learning_rate"], entry["best_learning_rate"]):
            entry["vs_baseline_at_best"] = (0, None, None)  # (every rate of either diverged: no pair of best rates)
            continue
        best_base = f"{base}@{rate_text(table[base]['best_learning_rate'])}"
        best_own = f"{key}@{rate_text(entry['best_learning_rate'])}"
        entry["vs_baseline_at_best"] = paired_difference(tagged, best_base, best_own)
    return table


def rate_edge(rates: list[float], best: float) -> str | None:
    """Where the best rate lies among the rates a model ran: "lowest" or "highest" of them (so a rate beyond might do
    better: the best is bounded on one side only), "only" (one rate ran), or None (rates on both sides did worse)."""
    if len(rates) == 1:
        return "only"
    if best == min(rates):
        return "lowest"
    if best == max(rates):
        return "highest"
    return None


def claims_at_best_rates(runs: list[dict], table: dict, labels: dict) -> list[dict]:
    """study.py's rows of the papers' orderings between the models of `table`, each model's runs taken at its best
    rate (so two models may have run at different rates); every row names both rates. An ordering with a model that
    has no best rate (every rate diverged) is "diverged: no verdict", naming that model."""
    best = [run for run in runs
            if run["model"] in table and run["learning_rate"] == table[run["model"]]["best_learning_rate"]]
    summary = aggregate(best)
    for key, entry in table.items():
        if entry["best_learning_rate"] is None:  # (a mean that is not finite: study.py's verdict for a divergence)
            summary[key] = {"seeds": [], "heldout_loss_mean": math.nan, "heldout_loss_std": math.nan}
    rows = claims_table(summary, labels, best)
    for row in rows:
        unranked = [f"{labels[row[side]]} at every rate it ran" for side in ("lower", "higher")
                    if side in row and table[row[side]]["best_learning_rate"] is None]
        if unranked:  # (the other model's runs, at its best rate, all ended finite)
            row.update(verdict=f"{DIVERGED} ({', '.join(unranked)})", diverged=unranked)
        if "lower" in row:
            row["learning_rates"] = [table[row[side]]["best_learning_rate"] for side in ("lower", "higher")]
            row["learning_rate_edges"] = [table[row[side]]["best_rate_edge"] for side in ("lower", "higher")]
    return rows


def rate_text(rate: float) -> str:
    """3e-4, 1e-3, 2.5e-3: a learning rate as people write it."""
    mantissa, exponent = f"{rate:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


# What the reports say of a model's best rate where every rate it ran diverged (its best_learning_rate is None).
NO_BEST_RATE = "none: every rate diverged"


def best_rate_text(rate: float | None) -> str:
    """A best learning rate as `rate_text` writes it, or NO_BEST_RATE where there is none."""
    return NO_BEST_RATE if rate is None else rate_text(rate)


def paired_text(paired) -> str:
    seeds, delta, error = paired
    if not seeds:
        return "-"
    return f"{delta:+.3f}" + (f" ± {error:.3f}" if error is not None else "") + f" ({seeds})"


def passes_over(tokens: int, stream: int | None) -> float | None:
    """How many times a budget of `tokens` reads a training stream of `stream` tokens, where it reads it more than
    once (None where once or less, or the stream's length is unknown)."""
    return tokens / stream if stream and tokens > 1.01 * stream else None


def passes_text(study: dict) -> str:
    """Said only of a budget longer than the study's training stream, which its runs then read more than once."""
    stream = study["data"]["splits"]["train"].get("tokens")
    passes = passes_over(study["tokens"], stream)
    return f" ({passes:.2g} passes over a training stream of {stream:,} tokens)" if passes else ""


def markdown(first: dict, runs: list[dict], table: dict, labels: dict, studies: list[str], claims: list[dict],
             repeats: list[tuple[dict, dict]], left_out: dict, named: bool) -> str:
    rates = sorted({r["learning_rate"] for r in runs if r["model"] in table})
    devices = sorted({r["device"] for r in runs if r["model"] in table})
    lines = [
        "# Held-out loss against the peak learning rate", "",
        f"- device: {', '.join(devices)}; size `{first['size']}`, {first['tokens']:,} training tokens per model"
        f"{passes_text(first)}, "
        f"held-out loss over {evaluated_tokens_text(runs, first['eval_tokens'])} tokens; everything else as each "
        "model's recipe (warmup, cosine decay to 1e-5, AdamW, weight decay, clipping)",
        "- studies: " + ", ".join(f"`{s}`" for s in studies), "",
        "Held-out loss, mean ± sample standard deviation (seeds); **bold**: the best of the rates the model ran.", "",
        "| model | " + " | ".join(f"lr {rate_text(rate)}" for rate in rates) + " |",
        "|---|" + "---:|" * len(rates),
    ]
    for key, entry in table.items():
        cells = []
        for rate in rates:
            cell = entry["rates"].get(rate_text(rate))
            if cell is None:
                cells.append("-")
                continue
            text = fmt(cell["heldout_loss_mean"]) + (f" ± {fmt(cell['heldout_loss_std'])}"
                                                     if cell["heldout_loss_std"] is not None else "")
            text += f" ({len(cell['seeds'])})"
            cells.append(f"**{text}**" if rate == entry["best_learning_rate"] else text)
        lines.append(f"| {labels[key]} | " + " | ".join(cells) + " |")
    where = {"lowest": "the lowest it ran", "highest": "the highest it ran", "only": "the only rate it ran"}
    edges = [f"{labels[key]} ({rate_text(entry['best_learning_rate'])}, {where[entry['best_rate_edge']]})"
             for key, entry in table.items() if entry["best_rate_edge"]]
    lines += ["", "Best rates not bounded on both sides (a rate beyond the ones run might do better): "
              + ("; ".join(edges) if edges else "none") + "."]
    unranked = [labels[key] for key, entry in table.items() if entry["best_learning_rate"] is None]
    if unranked:
        lines += ["", "No best rate (a run diverged at every rate the model ran): " + "; ".join(unranked) + "."]
    if left_out:
        why = "not named in --models" if named else "run at one rate only; --models names the models to tabulate"
        lines += ["", f"Run in these studies but not tabulated ({why}): "
                  + "; ".join(f"{labels[key]} ({', '.join(rate_text(rate) for rate in rates)})"
                              for key, rates in left_out.items()) + "."]
    compared = [key for key, entry in table.items() if "baseline" in entry]
    if compared:
        lines += ["", "Paired difference from the baseline of each model's group (loss(model) - loss(baseline) over "
                  "the seeds both ran, ± its standard error; positive: the baseline is ahead), at each rate, and "
                  "between the best rates each ran.", "",
                  "| model | baseline | " + " | ".join(f"lr {rate_text(rate)}" for rate in rates)
                  + " | each at its best rate |",
                  "|---|---|" + "---:|" * (len(rates) + 1)]
        for key in compared:
            entry = table[key]
            base = entry["baseline"]
            cells = [paired_text(entry["vs_baseline"].get(rate_text(rate), (0, None, None))) for rate in rates]
            best = (f"{paired_text(entry['vs_baseline_at_best'])} (lr {best_rate_text(entry['best_learning_rate'])} "
                    f"against {best_rate_text(table[base]['best_learning_rate'])})")
            lines.append(f"| {labels[key]} | {labels[base]} | " + " | ".join(cells) + f" | {best} |")
    if claims:
        rates = {key: best_rate_text(entry["best_learning_rate"]) for key, entry in table.items()}
        lines += ["", "The papers' orderings (study.py's table of them) with each model at its best rate: Δ = "
                  "loss(right) - loss(left), positive when the paper's ordering holds; the verdict as study.py gives "
                  "it (with three or more common seeds, resolved when |paired Δ| is more than twice its standard "
                  "error; with fewer, when |Δ| is more than twice the larger seed standard deviation). Only the "
                  "models of the tables above: those run at two or more rates, unless --models names them.", "",
                  *claims_rows(claims, rates)]
    if repeats:
        lines += ["", *repeat_pairs_markdown(repeats, labels, "in a later study of --studies", rate_text)]
    return "\n".join(lines).rstrip("\n") + "\n"


# A mean this far above the plot's lowest (a run that diverged) is drawn at the top edge, its value in the legend, so
# that it does not squeeze the rest of the plot into a sliver.
OFF_SCALE = 1.5
# The title's characters per line: a longer title, centred over the axes, would run off the figure's left edge.
TITLE_WIDTH = 80


def off_scale_cut(means: list[float]) -> float | None:
    """The loss above which a mean is off the plot's scale (None if every mean is on it); a mean that is not finite (a
    run that diverged to NaN) is off it."""
    finite = [mean for mean in means if math.isfinite(mean)]
    if not finite:
        return None
    cut = min(finite) + OFF_SCALE
    return cut if any(not mean <= cut for mean in means) else None


def plot(table: dict, labels: dict, recipes: dict, runs: list[dict], title: str, path: Path) -> bool:
    """Loss against rate, a line per model: dashed for the models of another recipe than the first model's; a mean
    more than OFF_SCALE above the lowest drawn as a triangle at the top edge, its value in the model's legend entry."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        print("matplotlib is not installed: no learning_rates.png")
        return False
    figure, axis = plt.subplots(figsize=(10, 4.8))
    first_recipe = recipes[next(iter(table))]
    # one colour per model (the default cycle repeats after ten; tab20 after twenty)
    colours = plt.get_cmap("tab10" if len(table) <= 10 else "tab20").colors
    cut = off_scale_cut([cell["heldout_loss_mean"] for entry in table.values() for cell in entry["rates"].values()])
    edge = None
    if cut is not None:  # the top edge: a little above the highest seed's loss still on the scale
        on_scale = [r["heldout_loss"] for r in runs if r["heldout_loss"] <= cut]
        edge = max(on_scale) + 0.1 * (max(on_scale) - min(on_scale))
    for index, (key, entry) in enumerate(table.items()):
        cells = sorted(entry["rates"].values(), key=lambda cell: cell["learning_rate"])
        rates = [cell["learning_rate"] for cell in cells]
        means = [cell["heldout_loss_mean"] for cell in cells]
        spread = [[r["heldout_loss"] for r in runs if r["model"] == key and r["learning_rate"] == rate]
                  for rate in rates]
        # (clamped at zero: the mean of equal losses can round a hair past them)
        errors = [[max(0.0, m - min(s)) for m, s in zip(means, spread)],
                  [max(0.0, max(s) - m) for m, s in zip(means, spread)]]
        colour = colours[index % len(colours)]
        off = [cut is not None and not m <= cut for m in means]  # (NaN too)
        shown = [edge if is_off else m for m, is_off in zip(means, off)]
        errors = [[0.0 if is_off else e for e, is_off in zip(side, off)] for side in errors]
        beyond = "".join(f"; ▲ off scale, {rate_text(rate)}: {mean:.2f}"
                         for rate, mean, is_off in zip(rates, means, off) if is_off)
        axis.errorbar(rates, shown, yerr=errors, marker="o", markevery=[not is_off for is_off in off], capsize=3,
                      label=f"{labels[key]} ({recipes[key]} recipe){beyond}", color=colour,
                      linestyle="-" if recipes[key] == first_recipe else "--")
        if any(off):
            axis.plot([r for r, is_off in zip(rates, off) if is_off], [edge] * sum(off), marker="^", linestyle="",
                      color=colour, clip_on=False)
    if edge is not None:
        axis.set_ylim(top=edge)
    axis.set_xscale("log")
    every_rate = sorted({cell["learning_rate"] for entry in table.values() for cell in entry["rates"].values()})
    axis.set_xticks(every_rate, [rate_text(rate) for rate in every_rate])
    axis.tick_params(axis="x", labelsize=8, labelrotation=30)  # (close rates, such as 5e-3 and 6e-3, stay apart)
    axis.xaxis.set_minor_formatter(NullFormatter())
    axis.set_xlabel("peak learning rate")
    axis.set_ylabel("held-out loss (mean, bars: min-max over seeds)")
    axis.set_title(textwrap.fill(title, TITLE_WIDTH), fontsize=9)  # centred over the axes, so it wraps to stay whole
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: never over a line
    save_figure(figure, path, dpi=120)
    return True


def run_fields(run: dict) -> dict:
    """What the JSON report keeps of a run."""
    return {k: run[k] for k in ("model", "seed", "learning_rate", "heldout_loss", "device", "study")}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    folders = [Path(folder) for folder in args.studies]
    first, runs, repeats = read_runs(folders)
    described = study_models.study_models(study_models.SHAPES[first["size"]])
    labels = {m.key: m.label for m in described}
    baselines = {m.key: study_models.GROUP_BASELINES[m.group] for m in described}
    recipes = {m.key: m.recipe for m in described}
    rates_of = {}
    for run in runs:
        rates_of.setdefault(run["model"], set()).add(run["learning_rate"])
    if args.models is not None:
        keys = [k.strip() for k in args.models.split(",") if k.strip()]
        if not keys:  # (no model to tabulate)
            raise ValueError(f"--models: {args.models!r} names no model; name one or more of {sorted(rates_of)}, "
                             "comma-separated")
        unknown = [k for k in keys if k not in rates_of]
        if unknown:
            raise ValueError(f"--models: {unknown} not run in these studies; they ran {sorted(rates_of)}")
    else:
        keys = [k for k in labels if len(rates_of.get(k, ())) >= 2]
        if not keys:
            raise ValueError("--studies: no model was run at two or more learning rates")
    keys.sort(key=lambda k: list(labels).index(k))
    # the models these studies ran that the tables leave out, with their rates: said in the report, not dropped silently
    left_out = {k: sorted(rates_of[k]) for k in labels if k in rates_of and k not in keys}
    chosen = [r for r in runs if r["model"] in keys]
    repeats = [(run, repeat) for run, repeat in repeats if run["model"] in keys]
    table = summarize(chosen, keys, baselines)
    claims = claims_at_best_rates(chosen, table, labels)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    studies = [str(folder) for folder in folders]
    report = {"size": first["size"], "tokens": first["tokens"], "eval_tokens": first["eval_tokens"],
              "studies": studies, "labels": {k: labels[k] for k in keys}, "models": table,
              "claims_at_best_rates": claims, "left_out": left_out,
              "runs": [run_fields(r) for r in chosen],
              "repeats": [run_fields(repeat) | {"kept_heldout_loss": run["heldout_loss"], "kept_study": run["study"]}
                          for run, repeat in repeats]}
    write_atomic(out / "learning_rates.json", strict_json(report))
    text = markdown(first, chosen, table, labels, studies, claims, repeats, left_out, bool(args.models))
    write_atomic(out / "learning_rates.md", text)
    devices = ", ".join(sorted({r["device"] for r in chosen}))
    title = f"size {first['size']}, {first['tokens'] / 1e6:.0f}M tokens per model{passes_text(first)}, {devices}"
    plot(table, labels, recipes, chosen, title, out / "learning_rates.png")
    print(text)
    return report


if __name__ == "__main__":
    main()
