"""Check that `spacy lean evaluate` and `spacy evaluate` agree, and write a summary.

Every score present in both files (nested per-type scores included) is compared,
a score that one file gives and the other leaves out (null) included; `speed` is
reported, not compared. Exits with 1 when a score differs by
more than the tolerance, so the workflow stops on a disagreement.
"""

import json
from pathlib import Path
from typing import Any, Dict, Optional

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
    stock = _flatten(json.loads(spacy_metrics.read_text(encoding="utf8")))
    lean = _flatten(json.loads(lean_metrics.read_text(encoding="utf8")))
    shared = sorted(
        k
        for k in stock.keys() & lean.keys()
        if k.split(".")[0] not in NOT_COMPARED and (stock[k], lean[k]) != (None, None)
    )
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
        "agree": diffs[worst] <= tolerance,
        "only_in_spacy_evaluate": sorted(stock.keys() - lean.keys()),
        "only_in_lean_evaluate": sorted(lean.keys() - stock.keys()),
        "speed": {"spacy_evaluate": stock.get("speed"), "lean_evaluate": lean.get("speed")},
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2), encoding="utf8")
    if not summary["agree"]:
        msg.fail(
            f"spacy evaluate and spacy lean evaluate disagree on {worst}: "
            f"{stock[worst]} vs {lean[worst]}",
            exits=1,
        )
    msg.good(f"{len(shared)} scores agree (max difference {diffs[worst]:.2g}) -> {output}")


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
