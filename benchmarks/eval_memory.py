"""Peak memory and wall time of evaluation commands on dev sets of three sizes (1x,
4x, 16x), as one single .spacy file and as a folder of .spacy shards.

Data: news-like NER docs (`spacy_lean.synthetic_news`: multi-sentence documents of
100-400 tokens with a long tail, four entity types at CoNLL-like rates), a base set
of `--base` docs tiled to each size, so the scores are the same at every size.
Models: a local, randomly initialised BERT (WordPiece vocabulary trained on the same
kind of text) + ner trained a few steps; "small" is 2 layers x 64 wide (where the
evaluation loop's own overhead shows), "base" 4 layers x 256 wide.

Each run is one command in a fresh process, as a user runs it (an *arm*):

- `spacy evaluate MODEL DATA --output ...` (stock spaCy: lists the dev set, then
  `nlp.evaluate`);
- `spacy lean evaluate MODEL DATA --output ...` (streaming, bounded by its token budget).

Arms are functions in `ARMS` (name -> `Arm(argv, model)`): `argv(model, data, output)`
gives the command-line arguments after `python -m spacy`, `model(work, model)` may
prepare a model variant (e.g. a copy whose config names a callback). Add an arm by
adding an entry.

Per run: wall time of the command (process start to exit) and of the command body
(after imports), peak RSS of the whole process (loading included), peak RSS after the model
was loaded (the kernel's mark is reset once `spacy.util.load_model` returns: that is
the evaluation's own peak), the load average before and after, and the scores. The
arms run interleaved (order alternating per repeat), so load changes hit both.

    python benchmarks/eval_memory.py              # small model: 300/1200/4800 docs, file and
                                                  # shards; base model: wall-time ratio on 300 docs
    python benchmarks/eval_memory.py --quick      # 20/80/320 docs
    nice -n 10 python benchmarks/eval_memory.py --timing-size 1200 --timing-repeats 2 \
        --small-timing-repeats 4                  # the recorded run: wall-time ratios at
                                                  # 1,200 docs, 5 pairs (small), 2 (base)
Prints JSON and writes benchmarks/results/eval_memory.json.
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
from _devsets import write_tiled  # noqa: E402
from _procmem import proc_status, reset_peak  # noqa: E402
from _report import command_line, work_folder  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "eval_memory.json"
SHARD_DOCS = 100
MODELS = {
    "small": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256
    ),
    "base": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024
    ),
}


class Arm(NamedTuple):
    argv: Callable[[Path, Path, Path], List[str]]
    model: Callable[[Path, Path], Path] = lambda work, model: model


def spacy_evaluate_argv(model: Path, data: Path, output: Path) -> List[str]:
    return ["evaluate", str(model), str(data), "--output", str(output)]


def lean_evaluate_argv(model: Path, data: Path, output: Path) -> List[str]:
    return ["lean", "evaluate", str(model), str(data), "--output", str(output), "--no-progress"]


def lean_slack16_argv(model: Path, data: Path, output: Path) -> List[str]:
    return lean_evaluate_argv(model, data, output) + ["--trim-slack-mb", "16"]


ARMS: Dict[str, Arm] = {
    "spacy evaluate": Arm(spacy_evaluate_argv),
    "spacy lean evaluate": Arm(lean_evaluate_argv),
    # eval_shapes.py's third arm (not run here unless named with --arms).
    "spacy lean evaluate --trim-slack-mb 16": Arm(lean_slack16_argv),
}
STOCK_ARM = "spacy evaluate"
LEAN_ARM = "spacy lean evaluate"
SLACK16_ARM = "spacy lean evaluate --trim-slack-mb 16"


# ---------------------------------------------------------------------------------
# Assets


def build_model(work: Path, kind: str, seed: int = 0) -> Path:
    """A transformer + ner pipeline saved under `work/<kind>/model` (kept between runs)."""
    import spacy

    from spacy_lean import synthetic
    from spacy_lean.synthetic_news import make_news_docs

    model = work / kind / "model"
    if (model / "config.cfg").exists():
        return model
    nlp = spacy.blank("en")
    train = make_news_docs(nlp, 64, seed=seed + 1)
    bert = synthetic.make_tiny_transformer(
        work / kind / "bert", texts=[d.text for d in train], vocab_size=1000, **MODELS[kind]
    )
    synthetic.build_trf_ner_pipeline(bert, train, n_steps=30, seed=seed).to_disk(model)
    return model


def build_data(
    work: Path, n_base: int, sizes: List[int], seed: int = 2
) -> Dict[str, Dict[int, Path]]:
    """Each size as one .spacy file and as a folder of shards of SHARD_DOCS docs."""
    import spacy

    from spacy_lean.synthetic_news import corpus_stats, make_news_docs

    base = make_news_docs(spacy.blank("en"), n_base, seed=seed)
    (work / f"data_stats_base{n_base}.json").write_text(json.dumps(corpus_stats(base)))
    tiled = write_tiled(base, sizes, work, f"base{n_base}", SHARD_DOCS)
    return {layout: {size: tiled[size][layout] for size in sizes} for layout in ("file", "shards")}


# ---------------------------------------------------------------------------------
# One run, in a fresh process


def child(arm: str, model: str, data: str, threads: int) -> dict:
    """Run one arm's command in this process; print its measurements as JSON."""
    import torch

    torch.set_num_threads(threads)
    import spacy.util
    from spacy.cli._util import app

    import spacy_lean.cli  # noqa: F401  (adds `spacy lean`, as spaCy's entry point does)

    marks: Dict[str, float] = {}
    load_model = spacy.util.load_model

    def load_and_mark(*args, **kwargs):
        nlp = load_model(*args, **kwargs)
        marks["rss_after_load_mb"] = proc_status("VmRSS") / 2**20
        marks["peak_rss_during_load_mb"] = proc_status("VmHWM") / 2**20
        marks["peak_reset_after_load"] = reset_peak()
        marks["loaded_at"] = time.perf_counter()
        return nlp

    spacy.util.load_model = load_and_mark
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "scores.json"
        argv = ARMS[arm].argv(Path(model), Path(data), output)
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # the command's table
            app(argv, standalone_mode=False)
        end = time.perf_counter()
        scores = json.loads(output.read_text())
    return {
        "command_seconds": end - start,
        "after_load_seconds": end - marks.get("loaded_at", start),
        "peak_rss_after_load_mb": proc_status("VmHWM") / 2**20,
        **marks,
        "scores": scores,
    }


def run_child(arm: str, model: Path, data: Path, threads: int) -> dict:
    env = dict(
        os.environ,
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(threads),
    )
    cmd = [
        sys.executable,
        __file__,
        "--child",
        arm,
        str(model),
        str(data),
        "--threads",
        str(threads),
    ]
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} on {data} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # (wait4's ru_maxrss would carry this process's size over from the fork.)
    result.update(
        arm=arm,
        wall_seconds=wall,
        load_avg_before=load_before,
        load_avg_after=os.getloadavg(),
        peak_rss_process_mb=max(
            result["peak_rss_after_load_mb"], result.get("peak_rss_during_load_mb", 0.0)
        ),
    )
    return result


def without_speed(scores: dict) -> dict:
    return {k: v for k, v in scores.items() if k != "speed"}


def run_series(
    work,
    model_kind,
    model,
    layouts,
    data,
    sizes,
    arms,
    repeats,
    threads,
    runs,
    stock_sizes=None,
    first_repeat=0,
):
    """Every (layout, size) with every arm, `repeats` times, the arm order alternating
    (the stock arm only at `stock_sizes`, when given). Repeats are numbered from
    `first_repeat` (the wall-time ratios pair the two arms' runs of one repeat)."""
    for layout in layouts:
        for size in sizes:
            these = [a for a in arms if a != STOCK_ARM or not stock_sizes or size in stock_sizes]
            for rep in range(first_repeat, first_repeat + repeats):
                order = these if rep % 2 == 0 else these[::-1]
                for arm in order:
                    arm_model = ARMS[arm].model(work, model)
                    result = run_child(arm, arm_model, data[layout][size], threads)
                    result.update(model=model_kind, layout=layout, size=size, repeat=rep)
                    runs.append(result)
                    print(
                        f"{model_kind:5s} {layout:6s} {size:5d} {arm:22s} "
                        f"wall {result['wall_seconds']:6.1f}s "
                        f"peak {result['peak_rss_after_load_mb']:6.0f} MB "
                        f"(process {result['peak_rss_process_mb']:.0f}) "
                        f"load {result['load_avg_before'][0]:.1f}",
                        file=sys.stderr,
                        flush=True,
                    )


# ---------------------------------------------------------------------------------
# Summary


def summarize(runs: List[dict], arms: List[str]) -> dict:
    keys = sorted({(r["model"], r["layout"], r["size"]) for r in runs})
    rows = []
    for model, layout, size in keys:
        group = [r for r in runs if (r["model"], r["layout"], r["size"]) == (model, layout, size)]
        row = {"model": model, "layout": layout, "size": size}
        for arm in arms:
            mine = [r for r in group if r["arm"] == arm]
            if not mine:
                continue
            row[arm] = {
                "wall_seconds_median": statistics.median(r["wall_seconds"] for r in mine),
                "after_load_seconds_median": statistics.median(
                    r["after_load_seconds"] for r in mine
                ),
                "peak_rss_after_load_mb": max(r["peak_rss_after_load_mb"] for r in mine),
                "peak_rss_process_mb": max(r["peak_rss_process_mb"] for r in mine),
                "n": len(mine),
            }
        if STOCK_ARM in row:
            stock = row[STOCK_ARM]
            for arm in arms:
                if arm != STOCK_ARM and arm in row:
                    # Per repeat, the two arms ran back to back: ratio of each pair.
                    pairs = [
                        a["wall_seconds"] / b["wall_seconds"]
                        for a in group
                        if a["arm"] == arm
                        for b in group
                        if b["arm"] == STOCK_ARM and b["repeat"] == a["repeat"]
                    ]
                    row[arm]["wall_ratio_vs_stock_median"] = statistics.median(pairs)
                    # The command alone (`app(argv)`): the interpreter start and imports
                    # before it are the same code in both arms (spaCy's CLI imports
                    # spacy-lean's entry point either way), so only their noise differs.
                    row[arm]["command_ratio_vs_stock_median"] = statistics.median(
                        a["command_seconds"] / b["command_seconds"]
                        for a in group
                        if a["arm"] == arm
                        for b in group
                        if b["arm"] == STOCK_ARM and b["repeat"] == a["repeat"]
                    )
                    row[arm]["wall_ratio_vs_stock_of_medians"] = (
                        row[arm]["wall_seconds_median"] / stock["wall_seconds_median"]
                    )
                    row[arm]["after_load_ratio_vs_stock"] = (
                        row[arm]["after_load_seconds_median"] / stock["after_load_seconds_median"]
                    )
        scores = [json.dumps(without_speed(r["scores"]), sort_keys=True) for r in group]
        row["scores_identical_across_arms"] = len(set(scores)) == 1
        rows.append(row)
    growth = {}
    for model, layout in sorted({(r["model"], r["layout"]) for r in rows}):
        mine = sorted(
            (r for r in rows if (r["model"], r["layout"]) == (model, layout)),
            key=lambda r: r["size"],
        )
        if len(mine) < 3:
            continue
        for arm in arms:
            if all(arm in r for r in mine):
                peaks = [r[arm]["peak_rss_after_load_mb"] for r in mine]
                procs = [r[arm]["peak_rss_process_mb"] for r in mine]
                growth[f"{model}/{layout}/{arm}"] = {
                    "peak_rss_after_load_mb": peaks,
                    "growth_4x_to_16x": peaks[2] / peaks[1] - 1,
                    "growth_1x_to_16x": peaks[2] / peaks[0] - 1,
                    "process_peak_growth_4x_to_16x": procs[2] / procs[1] - 1,
                }
    return {"rows": rows, "rss_growth": growth}


def targets(summary: dict) -> dict:
    out = {}
    for key, g in summary["rss_growth"].items():
        if key.endswith(LEAN_ARM):
            out[f"{key}: peak growth 4x->16x < 3%"] = g["growth_4x_to_16x"] < 0.03
    for row in summary["rows"]:
        lean = row.get(LEAN_ARM, {})
        if "wall_ratio_vs_stock_median" in lean:
            limit = 1.0 if row["model"] == "small" else 0.85
            out[f"{row['model']}/{row['layout']}/{row['size']}: wall ratio <= {limit}"] = (
                lean["wall_ratio_vs_stock_median"] <= limit
            )
    out["identical scores"] = all(r["scores_identical_across_arms"] for r in summary["rows"])
    return out


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (20, 80, 320 docs)")
    parser.add_argument("--base", type=int, default=None, help="docs of the 1x set (default 300)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per (layout, size, arm) for memory"
    )
    parser.add_argument(
        "--timing-repeats",
        type=int,
        default=2,
        help="runs per arm of the base model's wall-time comparison (0: skip it)",
    )
    parser.add_argument(
        "--timing-size", type=int, default=None, help="docs of that comparison (default: 1x)"
    )
    parser.add_argument(
        "--small-timing-repeats",
        type=int,
        default=0,
        help="extra runs per arm of the small model on one file of --timing-size docs, "
        "added to that cell of the memory series (its wall-time ratio is the median "
        "over all pairs)",
    )
    parser.add_argument(
        "--stock-max-size",
        type=int,
        default=None,
        help="run the stock arm only up to this many docs in the memory series "
        "(it lists the whole dev set, so it is the slow one; default: every size)",
    )
    parser.add_argument("--models", nargs="+", default=["small", "base"], choices=sorted(MODELS))
    parser.add_argument("--arms", nargs="+", default=[STOCK_ARM, LEAN_ARM], choices=list(ARMS))
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where models and data go, kept (default: a temporary folder, removed at the end)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--child", nargs=3, metavar=("ARM", "MODEL", "DATA"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.threads)))
        return
    with work_folder(args.work_dir, "eval_memory_") as work:
        report = measure(args, work)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report["summary"][k] for k in ("rss_growth", "targets")}, indent=2))


def measure(args, work: Path) -> dict:
    """Build the data and models in `work`, run the series; the report."""
    n_base = args.base or (20 if args.quick else 300)
    sizes = [n_base, 4 * n_base, 16 * n_base]
    data = build_data(work, n_base, sizes)
    models = {kind: build_model(work, kind) for kind in args.models}
    runs: List[dict] = []
    started = time.time()
    if "small" in models:
        stock_sizes = [n for n in sizes if args.stock_max_size is None or n <= args.stock_max_size]
        run_series(
            work,
            "small",
            models["small"],
            ["file", "shards"],
            data,
            sizes,
            args.arms,
            args.repeats,
            args.threads,
            runs,
            stock_sizes=stock_sizes,
        )
        size = args.timing_size or n_base
        if args.small_timing_repeats > 0:
            if size not in data["file"]:
                data = build_data(work, n_base, sorted(set(sizes + [size])))
            run_series(
                work,
                "small",
                models["small"],
                ["file"],
                data,
                [size],
                args.arms,
                args.small_timing_repeats,
                args.threads,
                runs,
                first_repeat=args.repeats,
            )
    if "base" in models and args.timing_repeats > 0:
        size = args.timing_size or n_base
        if size not in data["file"]:
            data = build_data(work, n_base, sorted(set(sizes + [size])))
        run_series(
            work,
            "base",
            models["base"],
            ["file"],
            data,
            [size],
            args.arms,
            args.timing_repeats,
            args.threads,
            runs,
        )
    summary = summarize(runs, args.arms)
    summary["targets"] = targets(summary)
    return {
        "benchmark": "eval_memory",
        "command": command_line(__file__),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_avg_at_start": os.getloadavg(),
            "threads_per_run": args.threads,
        },
        "models": {
            k: f"BERT {v['num_hidden_layers']} layers x {v['hidden_size']} wide (random init, "
            "local WordPiece) + ner (30 steps)"
            for k, v in MODELS.items()
            if k in models
        },
        "data": json.loads((work / f"data_stats_base{n_base}.json").read_text()),
        "sizes": sizes,
        "arms": {
            name: " ".join(
                ["python -m spacy", *ARMS[name].argv(Path("MODEL"), Path("DATA"), Path("OUT"))]
            )
            for name in args.arms
        },
        "seconds_total": time.time() - started,
        "summary": summary,
        "runs": runs,
    }


if __name__ == "__main__":
    main()
