"""Paired differences between any two models of a learning-rate sweep, each at a rate of its own: the numbers quoted
beside the report tables (learning_rates.md pairs each model with its group's baseline only).

    python examples/reproduce/paired.py --studies SWEEP/lr1e-3 SWEEP/lr2e-3 \
        --pair flash_mhf_double_head_dim@1e-3 mh_ffn@2e-3 [--pair A@RATE B@RATE ...]

For each pair A B: loss(A) - loss(B) over the seeds both ran, their mean ± standard error (study.py's pairing; one
seed: the difference alone), on the held-out text and on Wikipedia. Negative: A ends lower.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from learning_rates import paired_text, rate_text, read_runs  # noqa: E402
from study import paired_difference  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--studies", nargs="+", required=True, help="study.py --out folders (each with results.json)")
    p.add_argument("--pair", nargs=2, action="append", required=True, metavar=("A@RATE", "B@RATE"),
                   help="two runs' model keys at their peak learning rates, e.g. kvffn@1e-3 kv_swiglu@1e-3")
    return p


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    _, runs, _ = read_runs([Path(folder) for folder in args.studies])
    tagged = [{**run, "model": f"{run['model']}@{rate_text(run['learning_rate'])}"} for run in runs]
    known = sorted({run["model"] for run in tagged})
    rows = []
    for first, second in args.pair:
        unknown = [name for name in (first, second) if name not in known]
        if unknown:
            raise ValueError(f"--pair: {unknown} not run in these studies; they ran {known}")
        row = {"a": first, "b": second}
        for loss, column in (("heldout_loss", "heldout"), ("wiki_loss", "wikipedia")):
            row[column] = paired_difference(tagged, second, first, loss)
        rows.append(row)
        print(f"{first} - {second}: held-out {paired_text(row['heldout'])}, Wikipedia {paired_text(row['wikipedia'])}")
    return rows


if __name__ == "__main__":
    main()
