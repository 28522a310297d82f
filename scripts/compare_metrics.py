"""Check that `spacy lean evaluate` and `spacy evaluate` agree, and write a summary.

Every score (nested per-type scores included) must be in both files and agree: a score
that one file gives and the other leaves out (null) differs, and so does a score that
one file has and the other lacks (a per-type score of a label only one evaluation saw, a
score only one command writes). `speed` (words per second: each command's own, not a
score of the pipeline) is reported, not compared. Exits with 1 on a disagreement, so the
workflow stops.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import typer
from wasabi import msg

NOT_COMPARED = ("speed",)


def main(
    spacy_metrics: Path = typer.Argument(..., help="JSON written by `spacy evaluate --output`"),
    lean_metrics: Path = typer.Argument(..., help="JSON written by `spacy lean evaluate --output`"),
    output: Path = typer.Argument(..., help="Where to write the summary JSON"),
    tolerance: float = typer.Option(
        1e-6, "--tolerance", help="Largest allowed absolute difference"
    ),
):
    """Compare two metrics files and write {scores, differences, speeds} to `output`."""
    stock_all = _flatten(json.loads(spacy_metrics.read_text(encoding="utf8")))
    lean_all = _flatten(json.loads(lean_metrics.read_text(encoding="utf8")))
    stock, lean = _scores(stock_all), _scores(lean_all)
    shared = sorted(k for k in stock.keys() & lean.keys() if (stock[k], lean[k]) != (None, None))
    only_stock = sorted(stock.keys() - lean.keys())
    only_lean = sorted(lean.keys() - stock.keys())
    if not shared:
        msg.fail(f"No scores in common between {spacy_metrics} and {lean_metrics}", exits=1)
    # A score one side leaves out (None) and the other gives differs by infinity.
    diffs = {
        k: float("inf") if None in (stock[k], lean[k]) else abs(stock[k] - lean[k]) for k in shared
    }
    worst = max(diffs, key=diffs.get)
    summary: Dict[str, Any] = {
        "scores": {k: lean[k] for k in shared},
        "compared": len(shared),
        "max_abs_diff": diffs[worst] if diffs[worst] != float("inf") else None,
        "agree": diffs[worst] <= tolerance and not (only_stock or only_lean),
        "only_in_spacy_evaluate": only_stock,
        "only_in_lean_evaluate": only_lean,
        "speed": {"spacy_evaluate": stock_all.get("speed"), "lean_evaluate": lean_all.get("speed")},
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2), encoding="utf8")
    if only_stock or only_lean:
        missing = [
            f"{_some(keys)} only in {path}"
            for keys, path in ((only_stock, spacy_metrics), (only_lean, lean_metrics))
            if keys
        ]
        msg.fail(
            "spacy evaluate and spacy lean evaluate do not give the same scores: "
            + "; ".join(missing),
            exits=1,
        )
    if not summary["agree"]:
        msg.fail(
            f"spacy evaluate and spacy lean evaluate disagree on {worst}: "
            f"{stock[worst]} vs {lean[worst]}",
            exits=1,
        )
    msg.good(f"{len(shared)} scores agree (max difference {diffs[worst]:.2g}) -> {output}")


def _scores(flat: Dict[str, Optional[float]]) -> Dict[str, Optional[float]]:
    """The leaves that are compared (all but NOT_COMPARED and what is under them)."""
    return {k: v for k, v in flat.items() if k.split(".")[0] not in NOT_COMPARED}


def _some(keys: List[str], shown: int = 10) -> str:
    """`keys` joined, the first `shown` of them named."""
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def _flatten(data: Any, prefix: str = "") -> Dict[str, Optional[float]]:
    """Numeric (and None) leaves of nested dicts, keyed by dotted paths."""
    flat: Dict[str, Optional[float]] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
    elif data is None:
        flat[prefix[:-1]] = None
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        flat[prefix[:-1]] = float(data)
    return flat


if __name__ == "__main__":
    typer.run(main)
