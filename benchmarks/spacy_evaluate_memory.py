"""Peak memory of `python -m spacy evaluate` itself on dev sets of three sizes (1x, 4x,
16x), for a pipeline whose config names `spacy-lean.streaming_evaluate.v1`.

Each run is a fresh `spacy evaluate` process; its peak RSS is the kernel's figure for
the whole process (`os.wait4`), loading included, as a user would see it. Three arms,
interleaved (the order rotates from size to size and repeat to repeat):

- `lean`: `python -m spacy evaluate` on the pipeline with the callback (spacy-lean's
  `spacy_cli` entry point wraps the command: the dev set streams);
- `unwrapped`: spaCy's own command (its CLI without entry points) on the same pipeline:
  the predictions stream but spaCy lists every reference doc first (issue #16's case);
- `stock`: spaCy's own command on the same pipeline without the callback.

The pipeline is a local, randomly initialised BERT (2 layers, 64 wide; --layers/--width)
+ ner trained a few steps. The dev sets are generated news-like documents
(`spacy_lean.synthetic_news`: multi-sentence, mostly 100-400 tokens with a long tail),
tiled, written as one .spacy file and as a folder of shards of 100 docs.

    nice -n 10 python benchmarks/spacy_evaluate_memory.py            # 300, 1200, 4800 docs
    python benchmarks/spacy_evaluate_memory.py --quick              # 25, 100, 400 docs
Prints JSON and writes benchmarks/results/spacy_evaluate_memory.json. `measure` is the
arm as a function, for other benchmarks to call.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).parent))
from _report import command_line, work_folder  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "spacy_evaluate_memory.json"
SHARD_DOCS = 100
MODES = ("lean", "unwrapped", "stock")
# spaCy's CLI without its `spacy_cli` entry points, i.e. spaCy's own `evaluate`.
STOCK_CLI = (
    "import sys\n"
    "from spacy.cli._util import app\n"
    "from typer.main import get_command\n"
    "get_command(app)(sys.argv[1:], prog_name='python -m spacy')\n"
)


def build_assets(work: Path, sizes: Sequence[int], layers: int, width: int, seed: int = 0):
    """The two pipelines (with and without the callback) and the dev sets: for each
    size, one .spacy file and one folder of shards."""
    import spacy

    from spacy_lean import synthetic, synthetic_news
    from spacy_lean.streaming import CALLBACK_NAME

    name = f"model_{layers}x{width}"
    models = {"plain": work / name, "streaming": work / f"{name}_cb"}
    if not (models["streaming"] / "config.cfg").exists():
        bert = synthetic.make_tiny_transformer(
            work / f"bert_{layers}x{width}",
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=max(1, width // 32),
            intermediate_size=4 * width,
        )
        nlp = spacy.blank("en")
        train_docs = synthetic_news.make_news_docs(nlp, 64, seed=seed + 1)
        # 30 steps, as eval_memory.py: the ner then predicts entities (after 8 steps it
        # predicted none, and every arm's scores were zeros: nothing to tell them apart).
        trained = synthetic.build_trf_ner_pipeline(bert, train_docs, n_steps=30, seed=seed)
        trained.to_disk(models["plain"])
        trained.config["nlp"]["after_pipeline_creation"] = {"@callbacks": CALLBACK_NAME}
        trained.to_disk(models["streaming"])
    base = synthetic_news.make_news_docs(spacy.blank("en"), min(sizes), seed=seed + 2)
    sys.path.insert(0, str(Path(__file__).parent))
    from _devsets import write_tiled

    data = write_tiled(base, sizes, work, f"seed{seed}", SHARD_DOCS)
    n_tokens = {size: sum(len(base[i % len(base)]) for i in range(size)) for size in sizes}
    return models, data, n_tokens


def run_once(mode: str, model: Path, data: Path, out: Path, threads: int) -> dict:
    """One `spacy evaluate` process: peak RSS (MB), wall seconds, the scores."""
    args = ["evaluate", str(model), str(data), "--output", str(out)]
    if mode == "lean":
        cmd = [sys.executable, "-m", "spacy", *args]
    else:
        cmd = [sys.executable, "-c", STOCK_CLI, *args]
    env = dict(
        os.environ,
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(threads),
    )
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({' '.join(cmd)}):\n{stderr.decode()[-3000:]}")
    return {
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "seconds": seconds,
        "scores": json.loads(out.read_text()),
        "load_avg": os.getloadavg()[0],
    }


def measure(
    models: Dict[str, Path],
    data: Dict[int, Dict[str, Path]],
    *,
    modes=MODES,
    layouts=("file", "shards"),
    repeats: int = 1,
    threads: int = 1,
    log=None,
) -> List[dict]:
    """The arm: every (layout, size, mode), `repeats` times, the order of the modes
    rotating so that none always runs first.

    models (dict): {"plain": Path, "streaming": Path} from `build_assets`.
    data (dict): {size: {"file": Path, "shards": Path}}.
    RETURNS (List[dict]): one record per run.
    """
    runs = []
    turn = 0
    with tempfile.TemporaryDirectory(prefix="spacy_evaluate_memory_") as tmp:
        for rep in range(repeats):
            for layout in layouts:
                for size in sorted(data):
                    order = modes[turn % len(modes) :] + modes[: turn % len(modes)]
                    turn += 1
                    for mode in order:
                        model = models["plain" if mode == "stock" else "streaming"]
                        out = Path(tmp) / f"{mode}_{layout}_{size}_{rep}.json"
                        result = run_once(mode, model, data[size][layout], out, threads)
                        result.update(mode=mode, layout=layout, size=size, repeat=rep)
                        runs.append(result)
                        if log is not None:
                            log(
                                f"{mode:9s} {layout:6s} {size:5d} docs: peak RSS "
                                f"{result['peak_rss_mb']:.0f} MB, {result['seconds']:.1f} s "
                                f"(load {result['load_avg']:.1f})"
                            )
    return runs


def summarize(runs: List[dict], sizes: Sequence[int], n_tokens: Dict[int, int]) -> dict:
    def peak(mode, layout, size):
        return max(
            r["peak_rss_mb"]
            for r in runs
            if (r["mode"], r["layout"], r["size"]) == (mode, layout, size)
        )

    layouts = {}
    small, mid, large = sorted(sizes)
    for layout in sorted({r["layout"] for r in runs}):
        rows = {}
        present = {r["mode"] for r in runs if r["layout"] == layout}
        for mode in [m for m in MODES if m in present]:
            peaks = {size: peak(mode, layout, size) for size in sizes}
            rows[mode] = {
                "peak_rss_mb": peaks,
                "growth_4x_to_16x": peaks[large] / peaks[mid] - 1,
                "growth_1x_to_16x": peaks[large] / peaks[small] - 1,
                "bytes_per_added_token_4x_to_16x": (peaks[large] - peaks[mid])
                * 2**20
                / (n_tokens[large] - n_tokens[mid]),
            }
        layouts[layout] = rows
    # The same scores in every arm, apart from the timing (`speed`).
    by_size = {}
    for r in runs:
        scores = {k: v for k, v in r["scores"].items() if k != "speed"}
        by_size.setdefault(r["size"], []).append(scores)
    return {
        "layouts": layouts,
        "scores_identical": all(all(s == group[0] for s in group) for group in by_size.values()),
        # Identical zeros would tell nothing: the runs' largest entity F.
        "max_ents_f": max((r["scores"].get("ents_f") or 0.0) for r in runs) if runs else None,
        "target_lean_growth_4x_to_16x_below_3pct": all(
            rows["lean"]["growth_4x_to_16x"] < 0.03 for rows in layouts.values() if "lean" in rows
        ),
    }


def _own_rss_mb() -> float:
    """This (harness) process's resident memory: a floor under every run's peak."""
    with open("/proc/self/status") as file_:
        return next(int(line.split()[1]) for line in file_ if line.startswith("VmRSS:")) / 1024


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (25, 100, 400 docs)")
    parser.add_argument("--sizes", type=int, nargs=3, default=None, help="three dev-set sizes")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="arms run on the single file"
    )
    parser.add_argument(
        "--shard-modes",
        nargs="+",
        choices=MODES,
        default=["lean"],
        help="arms run on the folder of shards (spaCy's own command reads "
        "shards as it reads one file: listed whole)",
    )
    parser.add_argument(
        "--layouts", nargs="+", choices=("file", "shards"), default=["file", "shards"]
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where the models and data go, kept (default: a temporary folder, removed at the end)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--build-assets", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = args.sizes or ([25, 100, 400] if args.quick else [300, 1200, 4800])
    if args.build_assets:
        models, data, n_tokens = build_assets(args.build_assets, sizes, args.layers, args.width)
        print(json.dumps({"models": models, "data": data, "tokens": n_tokens}, default=str))
        return
    load_at_start = os.getloadavg()
    with work_folder(args.work_dir, "spacy_evaluate_memory_") as work:
        # Built in a child process: a run's peak RSS counts the address space it was
        # forked from (Linux records the forked copy's peak at exec), so this process
        # must stay small.
        built = subprocess.run(
            [
                sys.executable,
                __file__,
                "--build-assets",
                str(work),
                "--sizes",
                *map(str, sizes),
                "--layers",
                str(args.layers),
                "--width",
                str(args.width),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        assets = json.loads(built.stdout.strip().splitlines()[-1])
        models = {k: Path(v) for k, v in assets["models"].items()}
        data = {
            int(size): {k: Path(v) for k, v in paths.items()}
            for size, paths in assets["data"].items()
        }
        n_tokens = {int(size): n for size, n in assets["tokens"].items()}
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        runs = []
        for layout in args.layouts:
            modes = tuple(args.modes if layout == "file" else args.shard_modes)
            runs += measure(
                models,
                data,
                modes=modes,
                layouts=(layout,),
                repeats=args.repeats,
                threads=args.threads,
                log=log,
            )
    report = {
        "benchmark": "spacy_evaluate_memory",
        "command": command_line(__file__),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "load_avg_at_start": load_at_start,
            "load_avg_at_end": os.getloadavg(),
        },
        "peak_rss": "whole `spacy evaluate` process (os.wait4 ru_maxrss), model loading included",
        "model": f"BERT {args.layers} layers x {args.width} hidden (random init, local WordPiece) "
        "+ ner (30 steps)",
        "data": "synthetic_news docs, tiled; one .spacy file and shards of 100 docs",
        "harness_rss_mb": _own_rss_mb(),
        "sizes": sizes,
        "tokens": n_tokens,
        "summary": summarize(runs, sizes, n_tokens),
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
