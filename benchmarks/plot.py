"""Draw PNG charts from the benchmark results (benchmarks/results/*.json).

One PNG per results file, named like it (`eval_memory.json` -> `eval_memory.png`):

- eval_memory: peak RSS after loading the model against dev-set size, per evaluation
  command (arm) and data layout (one file, shards); wall-time ratios to `spacy evaluate`;
- cleaner_memory: peak RSS growth against the number of docs kept, by mode;
- padding: padding fraction by batcher, for each corpus;
- reader_memory: peak and held memory, and speed, by reader;
- charlm_loader_memory: peak and resident memory by LM data loader;
- charlm_speed: tokens/s and peak memory, Flair vs spacy-lean, by setting;
- charlm_long_doc: peak memory of one long doc, whole vs in chunks, and seconds by chunk length;
- train_memory: peak RSS against training-corpus and dev-set size, and words/s, by system;
- spacy_evaluate_memory: peak RSS of `spacy evaluate` against dev-set size, per arm and layout;
- train_accuracy: dev F per variant (mean, min-max over seeds, stock's spread shaded) and CPU s
  per run;
- eval_heap_trim: peak RSS, minor page faults and CPU seconds per heap-trimming policy and size;
- any other file: bars of each measured quantity (memory, time, speed, ratio...) of
  the first group of two or more named entries found in it; skipped if it has none.

`plots.json` in the output folder lists the PNG of each file (relative to it) and
why a file was skipped. Usage: `python benchmarks/plot.py [RESULTS_DIR] [OUTPUT_DIR]` (default
benchmarks/results for both).
"""

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
SKIP_FILES = ("plots.json",)
# Which numeric fields the generic plot draws.
MEASURED = re.compile(
    r"(peak|mem|rss|bytes|_mb$|_kb$|seconds|_s$|speed|per_s|ratio|fraction|padding|"
    r"throughput|over)",
    re.IGNORECASE,
)


class SchemaError(ValueError):
    """A results file lacks what its plotter needs."""


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _label(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _bars(
    ax,
    groups: Sequence[str],
    series: Dict[str, Sequence[Optional[float]]],
    ylabel: str,
    title: str,
    fmt: Optional[str] = None,
) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=name)
        for bar, value in zip(bars, values):
            if value is not None:
                text = fmt.format(value) if fmt else _label(value)
                ax.annotate(
                    text,
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)


def _lines(
    ax,
    xs_by_name: Dict[str, Sequence[float]],
    ys_by_name: Dict[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str,
) -> None:
    for name, xs in xs_by_name.items():
        ax.plot(xs, ys_by_name[name], marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_ylim(bottom=0)


def _plot_eval_memory_per_size(data: Dict[str, Any]) -> plt.Figure:
    """Results written before the commands were compared (stock vs streaming API)."""
    rows = data["summary"]["per_size"]
    if not rows:
        raise SchemaError("summary.per_size is empty")
    sizes = [r["size"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    modes = {"stock nlp.evaluate": "stock", "spacy-lean streaming": "streaming"}
    _lines(
        axes[0],
        {m: sizes for m in modes},
        {m: [r[f"{k}_peak_rss_mb"] for r in rows] for m, k in modes.items()},
        "dev-set size (docs)",
        "peak RSS (MB)",
        "Evaluation: peak memory vs dev-set size",
    )
    _lines(
        axes[1],
        {m: sizes for m in modes},
        {m: [r[f"{k}_docs_per_s"] for r in rows] for m, k in modes.items()},
        "dev-set size (docs)",
        "docs / s",
        "Evaluation throughput",
    )
    return fig


def plot_eval_memory(data: Dict[str, Any]) -> plt.Figure:
    if "per_size" in data["summary"]:
        return _plot_eval_memory_per_size(data)
    rows = data["summary"]["rows"]
    if not rows:
        raise SchemaError("summary.rows is empty")
    arms = list(data.get("arms") or [])
    series = sorted({(r["model"], r["layout"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs: Dict[str, List[float]] = {}
    ys: Dict[str, List[float]] = {}
    for model, layout in series:
        mine = sorted(
            (r for r in rows if (r["model"], r["layout"]) == (model, layout)),
            key=lambda r: r["size"],
        )
        if len(mine) < 2:
            continue
        for arm in arms:
            if all(arm in r for r in mine):
                name = f"{arm} ({layout}, {model} model)"
                xs[name] = [r["size"] for r in mine]
                ys[name] = [r[arm]["peak_rss_after_load_mb"] for r in mine]
    _lines(
        axes[0],
        xs,
        ys,
        "dev-set size (docs)",
        "peak RSS after loading the model (MB)",
        "Evaluation commands: peak memory vs dev-set size",
    )
    groups, ratios = [], []
    for r in rows:
        for arm in arms:
            ratio = r.get(arm, {}).get("wall_ratio_vs_stock_median")
            if ratio is not None:
                groups.append(f"{arm}\n{r['model']} {r['layout']} {r['size']}")
                ratios.append(ratio)
    _bars(
        axes[1],
        groups,
        {"wall time / spacy evaluate": ratios},
        "ratio (lower is faster)",
        "Wall time of the command vs `spacy evaluate` (same run)",
        fmt="{:.2f}",
    )
    axes[1].axhline(1.0, color="grey", lw=0.8)
    load = data.get("machine", {}).get("load_avg_at_start")
    if load:
        fig.suptitle(
            f"{data['machine'].get('cpu_count')} CPUs, load average at start " f"{load[0]:.1f}",
            fontsize=9,
        )
    return fig


def plot_cleaner_memory(data: Dict[str, Any]) -> plt.Figure:
    points: Dict[str, List[Dict[str, Any]]] = data["points"]
    if not points:
        raise SchemaError("points is empty")
    has_gpu = all("gpu_kept_kb" in p for rows in points.values() for p in rows)
    fig, axes = plt.subplots(
        1, 2 if has_gpu else 1, figsize=(11 if has_gpu else 6, 4), squeeze=False
    )
    _lines(
        axes[0][0],
        {m: [p["n_docs"] for p in rows] for m, rows in points.items()},
        {m: [p["peak_rss_growth_kb"] / 1024 for p in rows] for m, rows in points.items()},
        "docs kept (list(nlp.pipe(texts)))",
        "peak RSS growth (MB)",
        "Kept docs: memory with and without lean_cleaner",
    )
    if has_gpu:
        _lines(
            axes[0][1],
            {m: [p["n_docs"] for p in rows] for m, rows in points.items()},
            {m: [p["gpu_kept_kb"] / 1024 for p in rows] for m, rows in points.items()},
            "docs kept",
            "GPU memory kept (MB)",
            "Kept docs: GPU memory",
        )
    return fig


def plot_padding(data: Dict[str, Any]) -> plt.Figure:
    corpora = {k: v for k, v in data.items() if isinstance(v, dict) and "items" in v}
    if not corpora:
        raise SchemaError("no corpus entries (dicts with 'items')")
    batchers: List[str] = []
    for entry in corpora.values():
        for key, value in entry.items():
            if isinstance(value, dict) and "padding_fraction" in value and key not in batchers:
                batchers.append(key)
    if not batchers:
        raise SchemaError("no batcher entries with padding_fraction")
    groups = [
        f"{name}\n(mean {c.get('mean_length', '?')}, max {c.get('max_length', '?')})"
        for name, c in corpora.items()
    ]
    fig, ax = plt.subplots(figsize=(max(7, 2.5 * len(groups)), 4.5))
    _bars(
        ax,
        groups,
        {
            b: [c[b]["padding_fraction"] if b in c else None for c in corpora.values()]
            for b in batchers
        },
        "padding fraction (padded - real) / padded",
        f"Padding by batcher (budget {data.get('size', '?')} padded tokens)",
        fmt="{:.1%}",
    )
    return fig


def _by_name(
    entries: Dict[str, Dict[str, Any]], keys: Sequence[Tuple[str, str]], title: str
) -> plt.Figure:
    """One bar panel per (key, label), one bar per named entry."""
    present = [(k, label) for k, label in keys if any(_num(e.get(k)) for e in entries.values())]
    if not present:
        raise SchemaError(f"none of {[k for k, _ in keys]} in the entries")
    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 4), squeeze=False)
    names = list(entries)
    for ax, (key, label) in zip(axes[0], present):
        _bars(
            ax,
            names,
            {label: [entries[n].get(key) if _num(entries[n].get(key)) else None for n in names]},
            label,
            label,
        )
    fig.suptitle(title)
    return fig


def plot_reader_memory(data: Dict[str, Any]) -> plt.Figure:
    return _by_name(
        data["results"],
        [
            ("peak_mb", "peak RSS (MB)"),
            ("held_bytes_per_token", "held bytes / token"),
            ("docs_per_second", "docs / s"),
        ],
        f"Readers over {data.get('corpus_tokens', '?')} tokens",
    )


def plot_charlm_loader_memory(data: Dict[str, Any]) -> plt.Figure:
    return _by_name(
        data["results"],
        [
            ("peak_rss_mb", "peak RSS (MB)"),
            ("rss_after_epoch_mb", "RSS after an epoch (MB)"),
            ("data_seconds", "seconds reading an epoch"),
        ],
        f"Char-LM data loaders over {data.get('text_mb', '?')} MB of text",
    )


def plot_charlm_speed(data: Dict[str, Any]) -> plt.Figure:
    results = data["results"]
    if not results:
        raise SchemaError("results is empty")
    groups = [f"{r['device']} h{r['hidden_size']} t{r['threads']}" for r in results]
    sides: List[str] = []
    for r in results:
        sides += [s for s in r["sides"] if s not in sides]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _bars(
        axes[0],
        groups,
        {s: [r["sides"].get(s, {}).get("tokens_per_s_median") for r in results] for s in sides},
        "tokens / s (median)",
        "Char-LM embedding speed",
        fmt="{:.0f}",
    )
    _bars(
        axes[1],
        groups,
        {
            s: [r["sides"].get(s, {}).get("peak_rss_increase_mb_median") for r in results]
            for s in sides
        },
        "peak RSS increase (MB)",
        "Char-LM embedding memory",
        fmt="{:.0f}",
    )
    return fig


def plot_charlm_long_doc(data: Dict[str, Any]) -> plt.Figure:
    """Per LM size and doc length: peak RSS increase of the whole-doc LSTM call against
    the default chunks (and the vectors' own size), "failed" where an arm raised; and the
    seconds of each chunk length where several were measured."""
    results = data["results"]
    if not results:
        raise SchemaError("results is empty")
    groups = [f"hidden {r['hidden_size']}\n{r['chars']:,} chars" for r in results]
    chunked = [
        next(
            (a for a in r["arms"] if a != "unchunked" and r["arms"][a]["max_chunk_chars"] == 2048),
            None,
        )
        for r in results
    ]
    sweep = max(results, key=lambda r: len(r["arms"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    series = {
        "whole doc (max_chunk_chars = null)": [
            r["arms"]["unchunked"].get("peak_rss_increase_mb_median") for r in results
        ],
        "chunks of 2048 (default)": [
            r["arms"][c].get("peak_rss_increase_mb_median") if c else None
            for r, c in zip(results, chunked)
        ],
        "the vectors themselves": [r.get("vector_mb") for r in results],
    }
    _bars(axes[0], groups, series, "MB", "Peak RSS increase embedding one doc", fmt="{:.0f}")
    width = 0.8 / len(series)
    for g, r in enumerate(results):
        if "error" in r["arms"]["unchunked"]:
            axes[0].annotate(
                "failed",
                (g - width, 0),
                ha="center",
                va="bottom",
                fontsize=7,
                color="red",
                rotation=90,
            )
    arms = [a for a in sweep["arms"] if "seconds_median" in sweep["arms"][a]]
    labels = [
        "whole doc" if a == "unchunked" else a.replace("chunked-", "chunks of ") for a in arms
    ]
    _bars(
        axes[1],
        labels,
        {"seconds (median)": [sweep["arms"][a]["seconds_median"] for a in arms]},
        "seconds",
        f"Time, hidden {sweep['hidden_size']}, {sweep['chars']:,} chars, 1 thread",
        fmt="{:.2f}",
    )
    return fig


def _named_groups(node: Any) -> Optional[Dict[str, Dict[str, float]]]:
    """The first mapping (depth first) of >= 2 names to dicts with measured numbers."""
    if isinstance(node, dict):
        values = list(node.values())
        if len(values) >= 2 and all(isinstance(v, dict) for v in values):
            flat = {
                name: {k: v for k, v in value.items() if _num(v) and MEASURED.search(k)}
                for name, value in node.items()
            }
            if sum(1 for f in flat.values() if f) >= 2:
                return {name: f for name, f in flat.items() if f}
        for value in values:
            found = _named_groups(value)
            if found:
                return found
    elif isinstance(node, list):
        for item in node:
            found = _named_groups(item)
            if found:
                return found
    return None


def plot_generic(data: Any) -> plt.Figure:
    groups = _named_groups(data)
    if not groups:
        raise SchemaError("no group of named entries with measured quantities")
    keys: List[str] = []
    for entry in groups.values():
        keys += [k for k in entry if k not in keys and sum(k in e for e in groups.values()) >= 2]
    if not keys:
        raise SchemaError("the named entries share no measured quantity")
    return _by_name(groups, [(k, k) for k in keys[:4]], "")


def _factor(key: str) -> int:
    """`train16` -> 16."""
    return int(re.sub(r"\D", "", key) or 1)


def plot_train_memory(data: Dict[str, Any]) -> plt.Figure:
    summary = data["summary"]
    systems = {k: v for k, v in summary.items() if isinstance(v, dict) and "words_per_s_mean" in v}
    if not systems:
        raise SchemaError("summary has no system with measurements")
    fig = plt.figure(figsize=(14, 10))
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 1.5))
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])]
    for ax, key, xlabel, title in (
        (
            axes[0],
            "peak_rss_mb_by_train_size",
            "training corpus (x its 1x size)",
            "Peak RSS vs training-corpus size",
        ),
        (axes[1], "peak_rss_mb_by_dev_size", "dev set (x its 1x size)", "Peak RSS vs dev-set size"),
    ):
        xs: Dict[str, List[float]] = {}
        ys: Dict[str, List[float]] = {}
        for name, entry in systems.items():
            points = sorted((_factor(k), v) for k, v in (entry.get(key) or {}).items())
            if len(points) >= 2:
                xs[name] = [x for x, _ in points]
                ys[name] = [y for _, y in points]
        if not xs:
            ax.set_visible(False)
            continue
        _lines(ax, xs, ys, xlabel, "peak RSS of the command (MB)", title)
        ax.set_xscale("log", base=2)
    # The speed arms (--speed-arms: interleaved seeds, one run at a time) beside the rest.
    speed = {f"{k} (speed arms)": v for k, v in (summary.get("speed_arms") or {}).items()}
    bars = {**systems, **speed}
    names = list(bars)
    speeds = {"between the first and last evaluation": [bars[n]["words_per_s_mean"] for n in names]}
    if any("words_per_wall_s_mean" in bars[n] for n in names):
        speeds["whole command"] = [bars[n].get("words_per_wall_s_mean") for n in names]
    # Horizontal bars: the arms' names are long.
    ax = axes[2]
    height = 0.8 / len(speeds)
    for j, (label, values) in enumerate(speeds.items()):
        ys = [i + (j - (len(speeds) - 1) / 2) * height for i in range(len(names))]
        drawn = [(y, v) for y, v in zip(ys, values) if v is not None]
        ax.barh([y for y, _ in drawn], [v for _, v in drawn], height=height, label=label)
        for y, v in drawn:
            ax.annotate(
                f"{v:,.0f}",
                (v, y),
                va="center",
                fontsize=7,
                xytext=(3, 0),
                textcoords="offset points",
            )
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("training words / s")
    ax.set_title("Training speed (1x corpus; the summary's means)")
    # Room on the right for the legend, clear of the longest bars and their labels.
    longest = max((v for values in speeds.values() for v in values if v is not None), default=0)
    if longest > 0:
        ax.set_xlim(0, longest * 1.35)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def plot_spacy_evaluate_memory(data: Dict[str, Any]) -> plt.Figure:
    fig, ax = plt.subplots(1, 1, figsize=(7, 4.5))
    xs: Dict[str, List[float]] = {}
    ys: Dict[str, List[float]] = {}
    # A later re-run of some arms (on a quieter machine) is drawn beside the first run.
    reruns = [(key, value) for key, value in data.items() if key.startswith("rerun")]
    for key, result in [("", data)] + reruns:
        for layout, arms in result["summary"]["layouts"].items():
            for arm, entry in arms.items():
                points = sorted((int(k), v) for k, v in entry["peak_rss_mb"].items())
                name = f"{arm} ({layout}{', ' + key.replace('_', ' ') if key else ''})"
                xs[name] = [x for x, _ in points]
                ys[name] = [y for _, y in points]
    if not xs:
        raise SchemaError("summary.layouts is empty")
    _lines(
        ax,
        xs,
        ys,
        "dev-set size (docs)",
        "peak RSS (MB)",
        "`spacy evaluate` with and without spacy-lean's wrapper",
    )
    return fig


def plot_train_accuracy(data: Dict[str, Any]) -> plt.Figure:
    summary = {k: v for k, v in data["summary"].items() if isinstance(v, dict) and "mean" in v}
    if not summary:
        raise SchemaError("summary has no variant with a dev F mean")
    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    means = [summary[n]["mean"] for n in names]
    lows = [summary[n]["mean"] - summary[n]["min"] for n in names]
    highs = [summary[n]["max"] - summary[n]["mean"] for n in names]
    axes[0].bar(range(len(names)), means, yerr=[lows, highs], capsize=3)
    for i, mean in enumerate(means):
        axes[0].annotate(
            f"{mean:.2f}",
            (i, mean),
            ha="center",
            va="bottom",
            fontsize=7,
            xytext=(0, 8),
            textcoords="offset points",
        )
    if "stock" in summary:
        axes[0].axhspan(
            summary["stock"]["min"],
            summary["stock"]["max"],
            color="grey",
            alpha=0.2,
            label="stock's seed spread",
        )
        axes[0].legend(fontsize=7)
    axes[0].set_xticks(range(len(names)))
    axes[0].set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    lowest = min(entry["min"] for entry in summary.values())
    axes[0].set_ylim(lowest - 1, max(entry["max"] for entry in summary.values()) + 1)
    axes[0].set_ylabel("dev ents_f (mean, min-max over seeds)")
    axes[0].set_title("Dev F per variant", fontsize=10)
    axes[0].grid(axis="y", alpha=0.3)
    cpu = [summary[n].get("cpu_seconds_median") for n in names]
    _bars(axes[1], names, {"CPU s per run (median)": cpu}, "CPU seconds", "Training cost per run")
    return fig


def plot_eval_heap_trim(data: Dict[str, Any]) -> plt.Figure:
    """Per heap-trimming policy: peak RSS, minor page faults and CPU seconds at each size."""
    summary = data["summary"]
    sizes = sorted(summary, key=int)
    arms = [a for a in summary[sizes[0]] if isinstance(summary[sizes[0]][a], dict)]
    if not arms:
        raise SchemaError("summary has no arms")
    names = [a.replace("spacy lean evaluate (", "").rstrip(")") for a in arms]

    def series(key, scale=1.0):
        return {
            f"{int(size):,} docs": [
                (summary[size][a][key] / scale) if a in summary[size] else None for a in arms
            ]
            for size in sizes
        }

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    _bars(
        axes[0],
        names,
        series("peak_rss_after_load_mb_max"),
        "MB",
        "Peak RSS after the model loaded",
        fmt="{:.0f}",
    )
    _bars(
        axes[1],
        names,
        series("minor_faults_median", 1e6),
        "million",
        "Minor page faults",
        fmt="{:.2f}",
    )
    _bars(
        axes[2],
        names,
        series("cpu_seconds_median"),
        "s",
        "CPU seconds (user + system)",
        fmt="{:.0f}",
    )
    return fig


def plot_eval_shapes(data: Dict[str, Any]) -> plt.Figure:
    """Per data shape: each command's peak RSS at 1x and 4x, and lean/stock wall time."""
    summary = data["summary"]
    shapes = list(summary)
    if not shapes:
        raise SchemaError("summary has no shapes")
    arms = [a for a in summary[shapes[0]]["1x"] if isinstance(summary[shapes[0]]["1x"][a], dict)]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    peaks = {
        f"{arm}, {f}": [summary[s][f][arm]["peak_rss_after_load_mb"] for s in shapes]
        for arm in arms
        for f in ("1x", "4x")
    }
    title = "Peak RSS after the model loaded, 1x and 4x the dev set"
    big = [s for s in shapes if "16x" in summary[s]]
    if len(big) == len(shapes):
        for arm in summary[shapes[0]]["16x"]:
            if isinstance(summary[shapes[0]]["16x"][arm], dict):
                peaks[f"{arm}, 16x"] = [
                    summary[s]["16x"][arm]["peak_rss_after_load_mb"] for s in shapes
                ]
        title = "Peak RSS after the model loaded, 1x, 4x (and lean: 16x) the dev set"
    _bars(axes[0], shapes, peaks, "MB", title, fmt="{:.0f}")
    top = max(v for values in peaks.values() for v in values if v is not None)
    axes[0].set_ylim(0, top * 1.45)
    axes[0].legend(fontsize=6.5, ncol=2, loc="upper right")
    ratios = {f: [summary[s][f]["wall_ratio_lean_vs_stock"] for s in shapes] for f in ("1x", "4x")}
    if all("wall_ratio_lean_slack16_vs_stock" in summary[s]["1x"] for s in shapes):
        for f in ("1x", "4x"):
            ratios[f"{f}, --trim-slack-mb 16"] = [
                summary[s][f]["wall_ratio_lean_slack16_vs_stock"] for s in shapes
            ]
    _bars(
        axes[1],
        shapes,
        ratios,
        "lean / stock",
        "Wall time, spacy lean evaluate / spacy evaluate",
        fmt="{:.2f}",
    )
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    return fig


def plot_train_shapes(data: Dict[str, Any]) -> plt.Figure:
    """Per corpus shape: each system's peak RSS by training-corpus and dev-set size,
    lean/stock words per second, and dev F."""
    summary = data["summary"]
    shapes = [s for s in summary if "stock" in summary[s] and "lean" in summary[s]]
    if not shapes:
        raise SchemaError("summary has no shape with both systems")
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    peaks = {}
    for system in ("stock", "lean"):
        for key, label in (
            ("peak_rss_mb_by_train_size", "train"),
            ("peak_rss_mb_by_dev_size", "dev"),
        ):
            sizes = sorted(summary[shapes[0]][system][key], key=lambda k: int(k[len(label) :]))
            for size in sizes:
                if label == "dev" and size == "dev1":
                    continue  # the train1 bar is that run
                name = (
                    f"{system}, {size[len(label):]}x {label}"
                    if label == "train"
                    else f"{system}, {size[len(label):]}x dev"
                )
                peaks[name] = [summary[s][system][key].get(size) for s in shapes]
    _bars(
        axes[0],
        shapes,
        peaks,
        "MB",
        "Peak RSS of the training command (1x corpus and dev unless named)",
        fmt="{:.0f}",
    )
    top = max(v for values in peaks.values() for v in values if v is not None)
    axes[0].set_ylim(0, top * 1.35)
    axes[0].legend(fontsize=7, ncol=4, loc="upper center")
    ratios = {
        "words/s": [summary[s].get("lean_vs_stock_words_per_s_median") for s in shapes],
        "words per wall s": [summary[s].get("lean_vs_stock_words_per_wall_s") for s in shapes],
    }
    _bars(
        axes[1],
        shapes,
        ratios,
        "lean / stock",
        "Training speed, spacy lean train / spacy train",
        fmt="{:.2f}",
    )
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    scores = {
        system: [statistics.mean(summary[s][system]["ents_f"]) for s in shapes]
        for system in ("stock", "lean")
    }
    _bars(
        axes[2], shapes, scores, "ents_f", "Final dev F (1x corpus, mean of the runs)", fmt="{:.3f}"
    )
    return fig


def plot_gradient_noise(data: Dict[str, Any]) -> plt.Figure:
    """Left: the smallest gradient arrays relative to the largest gradient (log scale):
    the key biases' rounding noise far below everything else. Right: per run against
    stock on 1 thread, the largest difference of a real gradient relative to its array,
    and of a noise array relative to itself."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    arrays = data["smallest_arrays"]
    names = [a["name"].split("shim0/")[-1].replace("encoder.layer.", "L") for a in arrays]
    _bars(
        left,
        names,
        {"max |grad| / scale": [a["relative_to_scale"] for a in arrays]},
        "relative to the largest gradient",
        "Smallest gradient arrays",
        fmt="{:.1e}",
    )
    left.set_yscale("log")
    runs = data["differences_from_stock_1_thread"]
    real = [runs[r]["relative"] or None for r in runs]
    noise = [
        max(
            (row.get("relative_to_itself") or 0.0 for row in runs[r]["worst_near_zero"]),
            default=0.0,
        )
        or None
        for r in runs
    ]
    _bars(
        right,
        list(runs),
        {"real gradients (vs own max)": real, "noise arrays (vs themselves)": noise},
        "largest relative difference",
        "Against stock, 1 thread",
        fmt="{:.1e}",
    )
    right.set_yscale("log")
    fig.tight_layout()
    return fig


def plot_torch_step_memory(data: Dict[str, Any]) -> plt.Figure:
    """Heap in use, RSS and live torch tensors against training steps, thinc's torch
    optimizer step against spacy-lean's."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for arm in data["arms"]:
        steps = [p["step"] for p in arm["points"]]
        for ax, key in zip(axes, ("heap_mb", "rss_mb", "tensors")):
            ax.plot(steps, [p[key] for p in arm["points"]], marker="o", label=arm["arm"])
    for ax, title in zip(axes, ("Heap in use (MB)", "RSS (MB)", "Live torch tensors")):
        ax.set_title(title)
        ax.set_xlabel("training steps")
        ax.legend()
    return fig


def plot_parser_gradient(data: Dict[str, Any]) -> plt.Figure:
    """Dev LAS per seed and its mean, with and without exact_parser_gradient, at each
    step count."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    runs = data["runs"]
    arms = sorted({r["arm"] for r in runs})
    steps = sorted({r["steps"] for r in runs})
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        for j, n in enumerate(steps):
            values = [r["dep_las"] for r in runs if r["arm"] == arm and r["steps"] == n]
            x = j + (i - (len(arms) - 1) / 2) * width
            ax.bar(x, statistics.mean(values), width, label=arm if j == 0 else None, alpha=0.6)
            ax.scatter([x] * len(values), values, color="black", s=10)
    ax.set_xticks(range(len(steps)), [f"{n} steps" for n in steps])
    ax.set_ylim(min(r["dep_las"] for r in runs) - 0.02, 1.0)
    ax.set_ylabel("dev LAS")
    ax.set_title("exact_parser_gradient: dev LAS per seed (bars: mean)")
    ax.legend()
    return fig


PLOTTERS: Dict[str, Callable[[Any], plt.Figure]] = {
    "gradient_noise": plot_gradient_noise,
    "eval_heap_trim": plot_eval_heap_trim,
    "eval_shapes": plot_eval_shapes,
    "train_shapes": plot_train_shapes,
    "eval_memory": plot_eval_memory,
    "cleaner_memory": plot_cleaner_memory,
    "padding": plot_padding,
    "reader_memory": plot_reader_memory,
    "charlm_loader_memory": plot_charlm_loader_memory,
    "charlm_speed": plot_charlm_speed,
    "charlm_long_doc": plot_charlm_long_doc,
    "train_memory": plot_train_memory,
    "spacy_evaluate_memory": plot_spacy_evaluate_memory,
    "train_accuracy": plot_train_accuracy,
    "torch_step_memory": plot_torch_step_memory,
    "parser_gradient": plot_parser_gradient,
}


def plot_file(path: Path, out_dir: Path) -> Tuple[Optional[Path], Optional[str]]:
    """Draw one results file. RETURNS: (the PNG, None) or (None, why it was skipped)."""
    try:
        data = json.loads(path.read_text(encoding="utf8"))
    except (OSError, ValueError) as err:
        return None, f"unreadable: {err}"
    plotter = PLOTTERS.get(path.stem, plot_generic)
    try:
        fig = plotter(data)
    except (KeyError, TypeError, IndexError, SchemaError) as err:
        if plotter is plot_generic:
            return None, str(err)
        # A known benchmark whose format changed: still draw what can be drawn.
        try:
            fig = plot_generic(data)
        except SchemaError:
            return None, f"unexpected format for {path.stem} ({type(err).__name__}: {err})"
    command = data.get("command") if isinstance(data, dict) else None
    if command:
        fig.text(0.01, 0.01, command, fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95 if fig._suptitle is not None else 1))
    png = out_dir / f"{path.stem}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png, None


def main(results_dir: Optional[str] = None, out_dir: Optional[str] = None) -> Dict[str, Any]:
    results = Path(results_dir) if results_dir else HERE / "results"
    out = Path(out_dir) if out_dir else results
    out.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {"plots": {}, "skipped": {}}
    for path in sorted(results.glob("*.json")):
        if path.name in SKIP_FILES:
            continue
        png, reason = plot_file(path, out)
        if png is not None:
            report["plots"][path.name] = png.name
            print(f"{path.name} -> {png}")
        else:
            report["skipped"][path.name] = reason
            print(f"{path.name}: skipped ({reason})")
    (out / "plots.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf8")
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Draw a PNG for each benchmark JSON result.")
    parser.add_argument("results_dir", nargs="?", default=None, help="default: benchmarks/results")
    parser.add_argument("out_dir", nargs="?", default=None, help="default: the results folder")
    args = parser.parse_args()
    main(args.results_dir, args.out_dir)
