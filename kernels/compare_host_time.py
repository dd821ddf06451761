"""Tables of `compare_host_time.sh`'s runs: the host's microseconds per call of each piece of the FlashMHF layer and
the small-batch training steps, before and after, per round and as medians.

    python kernels/compare_host_time.py WORK_DIR ROUNDS OUT_DIR    # OUT_DIR/host_time.{json,md}
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import markdown_table, median, output_folder, read_json, write_report  # noqa: E402

TREES = ("before", "after")
ISSUE_TEXT = {"idle": "(the median of 200 calls, each started on an idle GPU).",
              "back-to-back": "(200 calls back to back, no synchronisation between them)."}


def load(work: str, kind: str, tree: str, round_: int) -> dict | None:
    name = "flash_mhf_host_profile.json" if kind == "parts" else "models_bench.json"
    path = os.path.join(work, f"{kind}_{tree}_{round_}", name)
    if not os.path.exists(path):
        return None
    return read_json(path)


def collect(work: str, rounds: int) -> dict:
    """Each piece's and training step's times by tree, one entry per round: None where that round's run of the tree
    left no result (a run that failed or timed out), so that the rounds stay in their places."""
    parts, train, device, issue = {}, {}, None, None
    for round_ in range(1, rounds + 1):
        index = round_ - 1
        for tree in TREES:
            data = load(work, "parts", tree, round_)
            if data:
                device, issue = data["environment"]["device"], data.get("issue")
                for row in data["parts"]:
                    parts.setdefault(row["part"], {t: [None] * rounds for t in TREES})[tree][index] = row["host_us"]
            data = load(work, "train", tree, round_)
            if data:
                device = device or data["environment"]["device"]
                for row in data["train"]:
                    cell = train.setdefault(f"{row['size']} {row['arch']} batch {row['batch']}",
                                            {t: {"step_ms": [None] * rounds, "host_ms": [None] * rounds}
                                             for t in TREES})
                    cell[tree]["step_ms"][index] = row["step_ms"]
                    cell[tree]["host_ms"][index] = row["host_ms"]
    return {"device": device, "rounds": rounds, "issue": issue, "parts_host_us": parts, "train": train}


def report(result: dict) -> str:
    def cell(values, spec=".1f"):  # (a round without a result: "-")
        return " / ".join("-" if v is None else format(v, spec) for v in values) or "-"

    def ratio(before, after):
        before, after = ([v for v in values if v is not None] for values in (before, after))
        return f"{median(after) / median(before):.2f}" if before and after else "-"

    lines = [f"# Host time before and after, {result['device']}", "",
             f"{result['rounds']} rounds, the two trees alternating. Host microseconds to issue one call of each piece "
             + ISSUE_TEXT.get(result.get("issue"), "(200 calls per piece)."), ""]
    lines += markdown_table(
        ["piece", "before (rounds)", "after (rounds)", "after / before (medians)"],
        [[name, cell(v["before"]), cell(v["after"]), ratio(v["before"], v["after"])]
         for name, v in result["parts_host_us"].items()])
    if not result["train"]:
        return "\n".join(lines) + "\n"
    lines += ["", "Training steps (forward + backward, eager, bf16, random tokens x 2048): step ms and the host's ms "
              "to issue one step, per round.", ""]
    lines += markdown_table(
        ["model", "step ms before", "step ms after", "after / before", "host ms before", "host ms after"],
        [[name, cell(v["before"]["step_ms"]), cell(v["after"]["step_ms"]),
          ratio(v["before"]["step_ms"], v["after"]["step_ms"]), cell(v["before"]["host_ms"]),
          cell(v["after"]["host_ms"])] for name, v in result["train"].items()])
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", help="the folder of compare_host_time.sh's runs")
    parser.add_argument("rounds", type=int)
    parser.add_argument("out", type=output_folder, help="folder for host_time.{json,md}")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"rounds must be at least 1, got {args.rounds}")
    if not os.path.isdir(args.work):
        parser.error(f"work {args.work!r} is not a folder; allowed: the folder of compare_host_time.sh's runs")
    result = collect(args.work, args.rounds)
    if not result["parts_host_us"] and not result["train"]:
        parser.error(f"work {args.work!r} holds no run of rounds 1 to {args.rounds} (parts_<tree>_<round>/"
                     "flash_mhf_host_profile.json or train_<tree>_<round>/models_bench.json, tree before or after)")
    write_report(args.out, "host_time", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
