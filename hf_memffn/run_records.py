"""The JSON records that the package's commands write about a run: the training recipe's train_log.jsonl and
summary.json, the demo's results.json, analyze's report.json, export-tols' token_lookup_report.json,
compare_loss_curves' comparison, the study's results files (examples/reproduce) and the kernel scripts' results
(kernels/harness.py).

JSON has no NaN or infinity: Python's json writes the bare words NaN and Infinity, which strict readers (jq,
JavaScript's JSON.parse, json.loads with parse_constant) refuse. A record writes such a number (a loss or gradient
norm of a run that diverged) as null and names its field under NOT_FINITE with the number's spelling, so that a
diverged loss stays apart from a value never measured:
    {"step": 30, "eval_loss": null, ..., "not_finite": {"eval_loss": "NaN"}}
Each object of a nested record names its own fields; a list field names its items by index:
    {"losses": [2.5, null, null], "not_finite": {"losses": {"1": "-Infinity", "2": "NaN"}}}
`read_run_record` gives the numbers back (it reads the bare words of earlier versions' files too).
"""

from __future__ import annotations

import json
import math

NOT_FINITE = "not_finite"


def _spelling(value: float) -> str:
    return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"


def _strict(value):
    """(`value` with each number that is not finite made None, the spelling of those it holds itself: a str for a
    number, {index: spelling} for a list; None where it holds none). An object names its own under NOT_FINITE."""
    if isinstance(value, float):
        return (value, None) if math.isfinite(value) else (None, _spelling(value))
    if isinstance(value, dict):
        fields = {key: _strict(item) for key, item in value.items()}
        not_finite = {key: spelled for key, (_, spelled) in fields.items() if spelled is not None}
        strict = {key: item for key, (item, _) in fields.items()}
        return ({**strict, NOT_FINITE: not_finite} if not_finite else strict), None
    if isinstance(value, (list, tuple)):
        items = [_strict(item) for item in value]
        not_finite = {str(index): spelled for index, (_, spelled) in enumerate(items) if spelled is not None}
        return [item for item, _ in items], not_finite or None
    return value, None


def run_record_json(record, indent: int | None = None, default=None, sort_keys: bool = False) -> str:
    """`record` (a dict, with nested dicts, lists and tuples) as strict JSON: see NOT_FINITE. `default` and
    `sort_keys` as json's: `default` gives what to write for an object JSON has no form for (without it json raises
    TypeError)."""
    strict, spelled = _strict(record)
    if spelled is not None:  # (a list of numbers has no object to name them in)
        raise ValueError(f"a run record holds numbers that are not finite outside an object: {spelled}")
    return json.dumps(strict, indent=indent, allow_nan=False, default=default, sort_keys=sort_keys)


def _restored(value, spelled):
    """`value` of a record read back, each number that `spelled` names a float again (nested objects name theirs)."""
    if isinstance(value, dict):
        not_finite = value.get(NOT_FINITE) or {}
        return {key: _restored(item, not_finite.get(key)) for key, item in value.items() if key != NOT_FINITE}
    if isinstance(value, list):
        spelled = spelled if isinstance(spelled, dict) else {}
        return [_restored(item, spelled.get(str(index))) for index, item in enumerate(value)]
    return float(spelled) if isinstance(spelled, str) and value is None else value


def read_run_record(text: str) -> dict:
    """A record of `run_record_json`, each number that is not finite a float again (NaN, or an infinity)."""
    return _restored(json.loads(text), None)
