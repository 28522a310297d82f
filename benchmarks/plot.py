"""Draw PNG charts from the benchmark results (benchmarks/results/*.json).

Every benchmark script writes one JSON file. This script finds, in each file, the
list of measurement rows (dicts) and draws:

- a line chart of each measured quantity against the size that varies across rows
  (e.g. peak memory against dev-set size), one line per method (stock spaCy vs
  spacy-lean), when the rows have such a size;
- otherwise a bar chart of each measured quantity by method (e.g. padding fraction
  by batcher).

It writes `plots.json` into the output folder: which PNG came from which file, and
which files had nothing to draw. Usage:

    python benchmarks/plot.py benchmarks/results benchmarks/results
"""
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

# Keys that name the method a row measures (first match wins).
METHOD_KEYS = (
    "method", "variant", "side", "impl", "implementation", "batcher", "strategy", "mode",
    "reader", "evaluator", "name", "label", "setting", "config",
)
# Keys that are the size a row was measured at (first match with >1 value wins).
SIZE_KEYS = (
    "dev_docs", "n_docs", "docs", "dev_size", "size", "n_examples", "examples", "n_tokens",
    "tokens", "n_texts", "texts", "n_sentences", "sentences", "n_chars", "chars",
    "budget", "window", "batch_size", "n",
)
# What is worth drawing: measured quantities, not settings.
METRIC_PATTERN = re.compile(
    r"(peak|mem|rss|bytes|_mb|mib|gib|_kb|seconds|time|_s$|speed|per_sec|/s|ratio|"
    r"fraction|padding|waste|throughput|words|tokens_per|docs_per|chars_per)",
    re.IGNORECASE,
)
SKIP_FILES = ("plots.json",)


def find_rows(data: Any) -> List[Dict[str, Any]]:
    """The longest list of flat-ish dicts anywhere in `data` (nested dicts flattened
    with dotted keys); rows kept as dicts keyed by their dict key when the results
    are a mapping of method -> measurements."""
    best: List[Dict[str, Any]] = []

    def visit(node: Any, key: Optional[str] = None) -> None:
        nonlocal best
        if isinstance(node, list):
            rows = [_flatten(item) for item in node if isinstance(item, dict)]
            if len(rows) > len(best):
                best = rows
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            values = list(node.values())
            # {"stock": {...}, "lean": {...}}: one row per key.
            if len(values) >= 2 and all(isinstance(v, dict) for v in values):
                rows = []
                for name, value in node.items():
                    flat = _flatten(value)
                    if any(_is_number(v) for v in flat.values()):
                        rows.append({"method": str(name), **flat})
                if len(rows) > len(best):
                    best = rows
            for name, value in node.items():
                visit(value, name)

    visit(data)
    return best


def _flatten(row: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    flat: Dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def choose_method_key(rows: Sequence[Dict[str, Any]]) -> Optional[str]:
    keys = [k for k in METHOD_KEYS if all(isinstance(r.get(k), str) for r in rows)]
    for key in keys:
        if len({r[key] for r in rows}) > 1:
            return key
    return keys[0] if keys else None


def choose_size_key(rows: Sequence[Dict[str, Any]]) -> Optional[str]:
    for key in SIZE_KEYS:
        if all(_is_number(r.get(key)) for r in rows) and len({r[key] for r in rows}) > 1:
            return key
    return None


def choose_metrics(rows: Sequence[Dict[str, Any]], exclude: Sequence[Optional[str]]) -> List[str]:
    keys: List[str] = []
    for row in rows:
        for key, value in row.items():
            if key in exclude or key in keys or not _is_number(value):
                continue
            if METRIC_PATTERN.search(key):
                keys.append(key)
    return keys


def plot_file(path: Path, out_dir: Path) -> Tuple[List[str], Optional[str]]:
    """Draw the charts of one results file. RETURNS: (PNG paths, reason if none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        data = json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError) as err:
        return [], f"unreadable: {err}"
    rows = find_rows(data)
    if len(rows) < 2:
        return [], "no list of measurement rows"
    method_key = choose_method_key(rows)
    size_key = choose_size_key(rows)
    metrics = choose_metrics(rows, exclude=[method_key, size_key])
    if not metrics:
        return [], "no measured quantity (memory, time, speed, padding...) in the rows"
    methods = sorted({str(r.get(method_key, "")) for r in rows}) if method_key else [""]
    pngs = []
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 4))
        if size_key is not None:
            for method in methods:
                points = sorted(
                    (r[size_key], r[metric]) for r in rows
                    if _is_number(r.get(metric)) and (not method_key or str(r.get(method_key)) == method)
                )
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", label=method or metric)
            ax.set_xlabel(size_key)
            if len({r[size_key] for r in rows}) > 2 and min(r[size_key] for r in rows) > 0:
                ratio = max(r[size_key] for r in rows) / min(r[size_key] for r in rows)
                if ratio >= 20:
                    ax.set_xscale("log")
        else:
            labels, values = [], []
            for i, row in enumerate(rows):
                if _is_number(row.get(metric)):
                    labels.append(str(row.get(method_key, i)) if method_key else str(i))
                    values.append(row[metric])
            if not values:
                plt.close(fig)
                continue
            ax.bar(range(len(values)), values)
            ax.set_xticks(range(len(values)))
            ax.set_xticklabels(labels, rotation=30, ha="right")
        ax.set_ylabel(metric)
        ax.set_title(f"{path.stem}: {metric}")
        ax.grid(alpha=0.3)
        if size_key is not None and method_key:
            ax.legend()
        fig.tight_layout()
        png = out_dir / f"{path.stem}__{_slug(metric)}.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        pngs.append(str(png))
    return pngs, None if pngs else "nothing numeric to draw"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def main(results_dir: str = "benchmarks/results", out_dir: Optional[str] = None) -> Dict[str, Any]:
    results = Path(results_dir)
    out = Path(out_dir) if out_dir else results
    out.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {"plots": {}, "skipped": {}}
    for path in sorted(results.glob("*.json")):
        if path.name in SKIP_FILES:
            continue
        pngs, reason = plot_file(path, out)
        if pngs:
            report["plots"][path.name] = pngs
            print(f"{path.name}: {len(pngs)} chart(s)")
        else:
            report["skipped"][path.name] = reason
            print(f"{path.name}: skipped ({reason})")
    (out / "plots.json").write_text(json.dumps(report, indent=2), encoding="utf8")
    return report


if __name__ == "__main__":
    main(*sys.argv[1:3])
