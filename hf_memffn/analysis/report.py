"""Render an `analyze` report: `report.json`, the plots as PNG files, and a self-contained `index.html`
(the PNGs embedded as base64, no external resources) that opens in any browser.

Every file is written to a temporary name first and renamed into place (`hf_memffn.atomic_write`).
"""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no global backend or figure state is touched

from ..atomic_write import write_atomic
from ..run_records import run_record_json


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def _finite(values) -> np.ndarray:
    """`values` as floats, a statistic that overflowed (inf, nan; report.json names them under not_finite) as nan:
    drawn as a gap, and left out of the axis limits and colour scales, which an inf or nan made matplotlib refuse."""
    values = np.asarray(values, dtype=float)
    return np.where(np.isfinite(values), values, np.nan)


def _bank_series(report: dict, kind_filter, key: str) -> tuple[list[int], list[float]]:
    layers, values = [], []
    for bank in report["model"]["banks"]:
        if kind_filter(bank) and report["banks"][bank["name"]].get(key) is not None:
            layers.append(bank["layer"])
            values.append(report["banks"][bank["name"]][key])
    return layers, values


def _bank_groups(report: dict) -> dict[str, callable]:
    """Residual-FFN banks and token-memory banks, plotted as separate lines (only the groups the model has)."""
    groups = {
        "residual FFN": lambda bank: bank["kind"] != "token_memory",
        "token memory (X0)": lambda bank: bank["kind"] == "token_memory",
    }
    return {label: keep for label, keep in groups.items() if any(keep(b) for b in report["model"]["banks"])}


def plot_memory_statistics(report: dict) -> bytes:
    """Per layer: share of cells holding 90% of the coefficient mass, sparsity, key-value agreement."""
    figure = Figure(figsize=(13, 3.4))
    axes = figure.subplots(1, 3)
    num_cells = {bank["name"]: bank["num_cells"] for bank in report["model"]["banks"]}
    for label, keep in _bank_groups(report).items():
        names = [b["name"] for b in report["model"]["banks"] if keep(b)]
        layers = [b["layer"] for b in report["model"]["banks"] if keep(b)]
        mass = _finite([report["banks"][n]["mean_cells_for_90pct_mass"] / num_cells[n] for n in names])
        sparsity = _finite([report["banks"][n]["mean_sparsity"] for n in names])
        axes[0].plot(layers, mass, marker="o", label=label)
        axes[1].plot(layers, sparsity, marker="o", label=label)
        agreement_layers, agreement = _bank_series(report, keep, "key_value_agreement")
        axes[2].plot(agreement_layers, _finite(agreement), marker="o", label=label)
    axes[0].set_title("cells carrying 90% of |coefficient| mass\n(fraction of the bank)")
    axes[1].set_title("sparsity: cells with |c| < 1% of the max")
    axes[2].set_title("key-value agreement\n(next token of trigger in value's top tokens)")
    for axis in axes:
        axis.set_xlabel("layer")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        axis.xaxis.get_major_locator().set_params(integer=True)
    axes[2].set_ylim(-0.02, 1.02)
    return _png(figure)


def plot_contributions(report: dict) -> bytes:
    """Per layer, the mean norm of what attention, the residual FFN and the token memory add to the residual."""
    contributions = report["contributions"]
    layers = np.arange(len(contributions["attention"]))
    figure = Figure(figsize=(12, 3.4))
    axes = figure.subplots(1, 2)
    bottom = np.zeros(len(layers))
    for key, label in (("attention", "attention"), ("ffn", "residual FFN"), ("memory", "token memory (lookup table)")):
        values = _finite(contributions[key])
        if np.nan_to_num(values).any():
            axes[0].bar(layers, values, bottom=bottom, label=label)
            bottom += np.nan_to_num(values)
    axes[0].set_title("mean output norm per layer")
    axes[0].set_ylim(0, bottom.max() * 1.3)  # room for the legend above the bars
    axes[0].legend(fontsize=8, loc="upper left", ncol=3)
    if any(contributions["ffn"]):
        axes[1].plot(layers, _finite(contributions["ffn_share"]), marker="o", label="residual FFN share")
    if any(contributions["memory"]):
        axes[1].plot(layers, _finite(contributions["memory_share"]), marker="o", label="token memory share")
    axes[1].set_title("share of the layer's output norm")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=8)
    for axis in axes:
        axis.set_xlabel("layer")
        axis.set_xticks(layers)
        axis.grid(alpha=0.3)
    return _png(figure)


def plot_head_subnetwork_mass(report: dict) -> bytes | None:
    """FlashMHF: share of the coefficient mass per head (rows) and sub-network (columns), one panel per layer."""
    banks = [b for b in report["model"]["banks"] if "head_subnetwork_mass" in report["banks"][b["name"]]]
    if not banks:
        return None
    masses = [_finite(report["banks"][bank["name"]]["head_subnetwork_mass"]) for bank in banks]
    top = max((float(np.nanmax(mass)) for mass in masses if not np.isnan(mass).all()), default=1.0)
    figure = Figure(figsize=(2.2 * len(banks) + 1.5, 3.2))
    axes = figure.subplots(1, len(banks), squeeze=False)
    for axis, bank, mass in zip(axes[0], banks, masses):
        image = axis.imshow(mass, cmap="viridis", vmin=0, vmax=top)
        axis.set_title(f"layer {bank['layer']}")
        axis.set_xlabel("sub-network")
        axis.set_xticks(range(mass.shape[1]))
        axis.set_yticks(range(mass.shape[0]))
    axes[0][0].set_ylabel("head")
    figure.colorbar(image, ax=list(axes[0]), fraction=0.02, label="share of |c| mass")
    figure.suptitle("FlashMHF: share of |coefficient| mass per head and sub-network", y=1.02)
    return _png(figure)


# A token's tick label is cut at this many characters: the picture grows with its labels, and a token of thousands of
# characters drew one of tens of thousands of pixels (the HTML tables show every token whole).
MAX_LABEL_CHARACTERS = 24


def _token_label(token: str) -> str:
    """A token as a tick label: escapes for what is not printable (as Python writes them), cut when long."""
    label = repr(token)[1:-1]
    return label if len(label) <= MAX_LABEL_CHARACTERS else label[: MAX_LABEL_CHARACTERS - 1] + "\u2026"


def plot_text_coefficients(report: dict, text_index: int = 0) -> bytes:
    """For one text: the largest |coefficient| of each bank (rows) at each token (columns)."""
    text = report["texts"][text_index]
    names = [b["name"] for b in report["model"]["banks"]]
    peak = _finite([[abs(cells[0][1]) for cells in text["banks"][n]["top_cells"]] for n in names])
    peak = peak / np.maximum(np.nan_to_num(peak).max(axis=1, keepdims=True), 1e-30)
    tokens = text["tokens"]
    figure = Figure(figsize=(max(6, 0.45 * len(tokens) + 2), 0.34 * len(names) + 1.6))
    axis = figure.subplots()
    image = axis.imshow(peak, aspect="auto", cmap="magma", vmin=0, vmax=1)
    if len(tokens) * len(names) <= 1200:  # write the top cell into each square while it stays readable
        for row, name in enumerate(names):
            for column, cells in enumerate(text["banks"][name]["top_cells"]):
                colour = "black" if peak[row, column] > 0.6 else "white"
                axis.text(column, row, cells[0][0], ha="center", va="center", fontsize=5.5, color=colour)
    axis.set_yticks(range(len(names)), names, fontsize=7)
    # (tokens are text, not mathtext: a `$$` or `$_` token fails to parse, and `$x$` would show as an italic x)
    axis.set_xticks(range(len(tokens)), [_token_label(t) for t in tokens], rotation=70, fontsize=7, parse_math=False)
    axis.set_title("top memory cell per token and bank (colour: |coefficient| scaled to the bank's max in the text)")
    figure.colorbar(image, ax=axis, fraction=0.02)
    return _png(figure)


PLOT_NAMES = ("memory_statistics.png", "contributions.png", "text0_coefficients.png", "flash_mhf_heads.png")


def render_plots(report: dict) -> dict[str, bytes]:
    """The report's plots by file name (of `PLOT_NAMES`; the heads' plot for FlashMHF models only)."""
    plots = {
        "memory_statistics.png": plot_memory_statistics(report),
        "contributions.png": plot_contributions(report),
        "text0_coefficients.png": plot_text_coefficients(report),
    }
    heads = plot_head_subnetwork_mass(report)
    if heads is not None:
        plots["flash_mhf_heads.png"] = heads
    return plots


# ---------------------------------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------------------------------
STYLE = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; line-height: 1.4; padding: 0 1em; }
h1 { border-bottom: 2px solid #444; } h2 { margin-top: 2em; border-bottom: 1px solid #bbb; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 13px; max-width: 100%; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
code, .tok { font-family: Menlo, Consolas, monospace; font-size: 12px; }
.tok { background: #eef1f4; border-radius: 3px; padding: 0 2px; margin: 1px 0; white-space: pre;
       display: inline-block; }
mark { background: #ffd54f; font-weight: bold; padding: 0 2px; white-space: pre; }
.next { color: #1565c0; white-space: pre; }
.muted { color: #777; } img { max-width: 100%; } details { margin: 0.4em 0; }
summary { cursor: pointer; font-weight: 600; }
.up { color: #2e7d32; } .down { color: #c62828; }
"""


# Characters an HTML page may not hold (control characters other than whitespace, noncharacters): a browser drops them
# or shows them as nothing, so a token such as a byte-level `\x16` would read as an empty one. Shown as Python escapes,
# as the plots' token labels show them.
_NONCHARACTERS = "".join(chr(plane + end) for plane in range(0, 0x110000, 0x10000) for end in (0xFFFE, 0xFFFF))
_NOT_IN_HTML = re.compile(f"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufdd0-\ufdef{_NONCHARACTERS}]")


def _e(text) -> str:
    return _NOT_IN_HTML.sub(lambda match: ascii(match.group())[1:-1], html.escape(str(text)))


def _tok(text: str) -> str:
    return f'<span class="tok">{_e(text)}</span>'


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _image(png: bytes, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _trigger_html(trigger: dict) -> str:
    prefix = "".join(_e(t) for t in trigger["prefix"][:-1])
    marked = f"<mark>{_e(trigger['prefix'][-1])}</mark>" if trigger["prefix"] else ""
    following = f'<span class="next">{_e(trigger["next"])}</span>' if trigger["next"] else ""
    return f'<code>{prefix}{marked}{following}</code>'


def _overview(report: dict) -> str:
    model = report["model"]
    rows = []
    for bank in model["banks"]:
        stats = report["banks"][bank["name"]]
        agreement = stats.get("key_value_agreement")
        rows.append(
            [
                _e(bank["name"]),
                _e(bank["kind"]),
                " x ".join(f"{size} {axis}s" for size, axis in zip(bank["cell_shape"], bank["cell_axes"])),
                f"{stats['mean_sparsity']:.3f}",
                f"{stats['mean_cells_for_90pct_mass']:.1f}",
                "-" if agreement is None else f"{agreement:.3f} ({stats['agreement_cells']} cells)",
            ]
        )
    return _table(
        ["bank", "kind", "cells", "sparsity", "cells for 90% mass", "key-value agreement"], rows
    )


def _spread(items: list, count: int) -> list:
    """At most `count` items, evenly spread, first and last included."""
    if len(items) <= count:
        return items
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def _texts_html(report: dict, max_texts: int = 5, max_banks: int = 6) -> str:
    parts = []
    for index, text in enumerate(report["texts"][:max_texts]):
        banks = _spread(list(text["banks"]), max_banks)
        rows = []
        for position, token in enumerate(text["tokens"]):
            row = [str(position), _tok(token)]
            for name in banks:
                cells = text["banks"][name]["top_cells"][position]
                row.append(" ".join(f"{_e(c)}<span class='muted'>({v:+.2g})</span>" for c, v in cells[:3]))
            rows.append(row)
        table = _table(["#", "token", *[_e(n) for n in banks]], rows)
        preview = _e("".join(text["tokens"])[:120])
        parts.append(f"<details{' open' if index == 0 else ''}><summary>text {index}: <code>{preview}</code></summary>"
                     f"<p class='muted'>top 3 cells per token and bank: cell(coefficient)"
                     f"{'' if len(banks) == len(text['banks']) else '; some banks, all are in report.json'}</p>"
                     f"{table}</details>")
    return "".join(parts)


def _cells_html(report: dict) -> str:
    parts = []
    for bank_name, cells in report["cells"].items():
        rows = []
        for cell in cells:
            triggers = "<br>".join(
                f"{_trigger_html(t)} <span class='muted'>{t['coefficient']:+.3g}</span>" for t in cell["triggers"]
            )
            promotes = " ".join(_tok(t) for t in cell["promotes"])
            demotes = " ".join(_tok(t) for t in cell["demotes"][:5])
            agreement = "-" if cell["agreement"] is None else f"{cell['agreement']:.2f}"
            rows.append([_e(cell["cell"]), triggers, f"{promotes}<br><span class='muted'>demotes:</span> {demotes}",
                         agreement])
        opened = " open" if len(report["cells"]) <= 8 else ""
        parts.append(
            f"<details{opened}><summary>{_e(bank_name)}</summary>"
            + _table(["cell", "top-triggering prefixes (trigger <mark>highlighted</mark>, "
                      "<span class='next'>next token</span>)", "value promotes", "agreement"], rows)
            + "</details>"
        )
    return "".join(parts)


def _token_memory_html(report: dict) -> str:
    if "token_memory" not in report:
        return ""
    parts = ["<h2>Token memory (the FFNs on X0)</h2><p>The query space is the vocabulary: each token reads the same "
             "cells in every context. Clusters group tokens whose coefficient vectors point the same way "
             f"(clustered: {_e(report.get('token_memory_clustered', ''))}).</p>"]
    for layer, section in report["token_memory"].items():
        busiest = _table(
            ["cell", "tokens with it as top cell", "examples"],
            [
                [str(c["cell"]), str(c["num_tokens"]), " ".join(_tok(t) for t in c["tokens"])]
                for c in section["busiest_cells"]
            ],
        )
        clusters = _table(
            ["size", "cohesion", "shared cells", "tokens (closest to centre first)"],
            [[str(c["size"]), f"{c['cohesion']:.2f}", ", ".join(map(str, c["shared_cells"])),
              " ".join(_tok(t) for t in c["tokens"])] for c in section["clusters"]],
        )
        summary = f"layer {layer}: {section['cells_used_as_top1']} cells are some token's top cell"
        parts.append(f"<details open><summary>{summary}</summary><h4>busiest cells</h4>{busiest}"
                     f"<h4>token clusters</h4>{clusters}</details>")
    return "".join(parts)


def _edits_html(report: dict) -> str:
    rows = []
    for edit in report["edits"]:
        prompt = edit["prompt"]
        token = edit["edited_token"]
        if token and prompt.endswith(token):
            prompt_html = f"<code>{_e(prompt[: -len(token)])}<mark>{_e(token)}</mark></code>"
        else:
            prompt_html = f"<code>{_e(prompt)}</code>"
        before = ", ".join(f"{_tok(t)} {p:.3f}" for t, p in edit["top_before"])
        after = ", ".join(f"{_tok(t)} {p:.3f}" for t, p in edit["top_after"])
        change = "up" if edit["target_probability_after"] > edit["target_probability_before"] else "down"
        rows.append([
            prompt_html, _tok(edit["target"]), _e(f"{edit['method']}: {edit['location']}"),
            f"<span class='{change}'>{edit['target_probability_before']:.4f} &rarr; "
            f"{edit['target_probability_after']:.4f}</span>", before, after,
        ])
    return _table(["prompt", "target", "edit", "p(target)", "top next tokens before", "after"], rows)


def render_html(report: dict, plots: dict[str, bytes], title: str) -> str:
    model = report["model"]
    sections = [
        f"<h1>{_e(title)}</h1>",
        f"<p><b>{_e(model['class'])}</b> ({_e(model['model_type'])}), {model['num_layers']} layers, "
        f"{len(model['banks'])} memory banks. An FFN reads as <code>FFN(x) = &Sigma;<sub>i</sub> c<sub>i</sub>(x) "
        "v<sub>i</sub></code>: keys detect input patterns (coefficients c), values promote output tokens.</p>",
        "<h2>Memory banks</h2>", _overview(report), _image(plots["memory_statistics.png"], "memory statistics"),
        "<h2>Where each layer's output comes from</h2>", _image(plots["contributions.png"], "contributions"),
    ]
    if "flash_mhf_heads.png" in plots:
        sections += ["<h2>FlashMHF heads and sub-networks</h2>", _image(plots["flash_mhf_heads.png"], "heads")]
    sections += [
        "<h2>Memory coefficients of the texts</h2>", _image(plots["text0_coefficients.png"], "coefficients"),
        _texts_html(report),
        "<h2>Most triggered cells: trigger prefixes and promoted tokens</h2>"
        "<p>Value vectors are read through the final norm and the output embedding. Agreement: share of the trigger "
        "examples whose next token is among the value's top tokens.</p>", _cells_html(report),
        _token_memory_html(report),
        "<h2>Memory editing</h2><p>The memory of the prompt's last token (<mark>highlighted</mark>) is rewritten to "
        "promote the target; the edit is measured, then reverted. A token-memory edit changes that token's "
        "lookup-table row, so it acts wherever the token occurs; a value edit changes the cell the token triggers "
        "most.</p>",
        _edits_html(report),
    ]
    body = "\n".join(sections)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def write_report(report: dict, out_dir: str | Path, title: str = "FFN memory analysis") -> Path:
    """Writes `report.json`, the PNG plots and `index.html` into `out_dir`; returns the HTML path. Everything is
    rendered first; an earlier report's `index.html` goes before the new files are written and the new one comes
    last, so a folder with an `index.html` holds one report's files (an earlier report's plots that this one does
    not draw are removed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = render_plots(report)
    html = render_html(report, plots, title).encode()
    html_path = out_dir / "index.html"
    html_path.unlink(missing_ok=True)
    for name in set(PLOT_NAMES) - set(plots):
        (out_dir / name).unlink(missing_ok=True)
    # (strict JSON: a statistic that overflowed is written as null and named under `not_finite`, not as the `NaN` /
    # `Infinity` of Python's json; `hf_memffn.run_records.read_run_record` reads it back)
    write_atomic(out_dir / "report.json", run_record_json(report, indent=1).encode())
    for name, png in plots.items():
        write_atomic(out_dir / name, png)
    write_atomic(html_path, html)
    return html_path
