"""Peak memory and throughput of evaluation: stock `nlp.evaluate` vs spacy-lean's
streaming `evaluate`, on dev sets of three sizes growing 4x.

A transformer + ner pipeline (a local, randomly initialised 4-layer 256-wide BERT;
ner trained a few steps) is evaluated on tiled generated text written as .spacy shards
of 100 docs. Each (size, mode) runs in a fresh subprocess, as `spacy evaluate` would:

- stock: `list(Corpus(dev)(nlp))` then `nlp.evaluate(...)` (what `spacy evaluate` does);
- streaming: `spacy_lean.evaluate(nlp, read_examples(nlp, shards))`.

Reported per run: peak RSS while evaluating (the kernel's peak mark is reset after the
model is loaded, since loading peaks higher; peak GPU memory on CUDA), RSS before
evaluating, docs/s of the evaluation, and the scores. Pairs run interleaved (the order
alternates between repeats); ratios compare the two modes in the same run.

    python benchmarks/eval_memory.py            # 300, 1200, 4800 docs (each above one read-ahead window)
    python benchmarks/eval_memory.py --quick    # 25, 100, 400 docs
Then, on the smallest set, both modes run alternating in one process (--interleaved N
times each) for a throughput ratio less noisy than separate processes.
Prints JSON and writes benchmarks/results/eval_memory.json.
"""
import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "eval_memory.json"
SHARD_DOCS = 100


def build_assets(work: Path, n_base: int, sizes, seed: int = 0):
    """The model and the tiled dev sets (as folders of .spacy shards)."""
    import spacy
    from spacy.tokens import DocBin

    from spacy_lean import synthetic

    model = work / "model"
    if not (model / "config.cfg").exists():
        bert = synthetic.make_tiny_transformer(
            work / "bert", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024,
        )
        nlp = spacy.blank("en")
        train_docs = synthetic.make_ner_docs(nlp, 64, seed=seed + 1)
        trained = synthetic.build_trf_ner_pipeline(bert, train_docs, n_steps=8, seed=seed)
        trained.to_disk(model)
    nlp = spacy.blank("en")
    base = synthetic.make_ner_docs(nlp, n_base, seed=seed + 2)
    dev_dirs = {}
    for size in sizes:
        folder = work / f"dev_{size}_base{n_base}_seed{seed}"
        if not folder.exists():
            folder.mkdir()
            docs = [base[i % len(base)] for i in range(size)]
            for k in range(0, size, SHARD_DOCS):
                DocBin(docs=docs[k:k + SHARD_DOCS]).to_disk(folder / f"{k // SHARD_DOCS:05d}.spacy")
        dev_dirs[size] = folder
    return model, dev_dirs


def _status_kb(field: str) -> float:
    with open("/proc/self/status") as file_:
        for line in file_:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM), so the peak measured is that of the
    evaluation, not of loading the model (which peaks higher). Linux >= 4.0."""
    try:
        with open("/proc/self/clear_refs", "w") as file_:
            file_.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    try:
        return _status_kb("VmHWM") / 1024
    except (OSError, KeyError):  # not Linux: the process's peak since it started
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, model: str, data: str, gpu_id: int, threads: int) -> dict:
    """One measurement, in a fresh process."""
    import spacy
    import torch

    torch.set_num_threads(threads)
    if gpu_id >= 0:
        spacy.require_gpu(gpu_id)
    from spacy.training import Corpus

    from spacy_lean.streaming import evaluate, list_shards, read_examples

    nlp = spacy.load(model)
    peak_load = peak_rss_mb()
    was_reset = reset_peak_rss()
    rss_loaded = _status_kb("VmRSS") / 1024
    if gpu_id >= 0:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if mode == "stock":
        examples = list(Corpus(data)(nlp))
        n_docs = len(examples)
        scores = nlp.evaluate(examples)
    else:
        counted = []

        def stream():
            for eg in read_examples(nlp, list_shards(data)):
                counted.append(1)
                yield eg

        scores = evaluate(nlp, stream())
        n_docs = len(counted)
    seconds = time.perf_counter() - start
    out = {
        "mode": mode,
        "n_docs": n_docs,
        "seconds": seconds,
        "docs_per_s": n_docs / seconds,
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_is_evaluation_only": was_reset,
        "rss_after_load_mb": rss_loaded,
        "peak_rss_during_load_mb": peak_load,
        "scores": scores,
    }
    if gpu_id >= 0:
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def interleaved(model: str, data: str, gpu_id: int, threads: int, repeats: int) -> dict:
    """Throughput of both modes in one process, alternating, `repeats` times each:
    less noisy than comparing two processes on a shared machine."""
    import spacy
    import torch

    torch.set_num_threads(threads)
    if gpu_id >= 0:
        spacy.require_gpu(gpu_id)
    from spacy.training import Corpus

    from spacy_lean.streaming import evaluate, list_shards, read_examples

    nlp = spacy.load(model)
    nlp.evaluate(list(Corpus(data)(nlp))[:16])  # warm up
    runs = {
        "stock": lambda: nlp.evaluate(list(Corpus(data)(nlp))),
        "streaming": lambda: evaluate(nlp, read_examples(nlp, list_shards(data))),
    }
    seconds = {name: [] for name in runs}
    for rep in range(repeats):
        for name in (("stock", "streaming") if rep % 2 == 0 else ("streaming", "stock")):
            start = time.perf_counter()
            runs[name]()
            seconds[name].append(time.perf_counter() - start)
    return {
        "seconds": seconds,
        "best_ratio_streaming_over_stock": min(seconds["stock"]) / min(seconds["streaming"]),
        "median_ratio_streaming_over_stock": (
            statistics.median(seconds["stock"]) / statistics.median(seconds["streaming"])
        ),
    }


def run_child(mode, model, data, gpu_id, threads, repeats=0):
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--child", mode, str(model), str(data),
           "--gpu-id", str(gpu_id), "--threads", str(threads), "--interleaved", str(repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def without_speed(scores):
    return {k: v for k, v in scores.items() if k != "speed"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (25, 100, 400 docs)")
    parser.add_argument("--sizes", type=int, nargs=3, default=None, help="three dev-set sizes")
    parser.add_argument("--repeats", type=int, default=1, help="runs per (size, mode), order alternating")
    parser.add_argument("--gpu-id", type=int, default=-1)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the model and data go (kept)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--interleaved", type=int, default=3,
                        help="throughput check: both modes alternating in one process, N times "
                        "each, on the smallest set (0: skip)")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "MODEL", "DATA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "interleaved":
            print(json.dumps(interleaved(*args.child[1:], args.gpu_id, args.threads, args.interleaved)))
        else:
            print(json.dumps(child(*args.child, args.gpu_id, args.threads)))
        return
    sizes = args.sizes or ([25, 100, 400] if args.quick else [300, 1200, 4800])
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="eval_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    model, dev_dirs = build_assets(work, n_base=min(sizes), sizes=sizes)
    runs = []
    for size in sizes:
        for rep in range(args.repeats):
            order = ("stock", "streaming") if rep % 2 == 0 else ("streaming", "stock")
            for mode in order:
                result = run_child(mode, model, dev_dirs[size], args.gpu_id, args.threads)
                result.update(size=size, repeat=rep)
                runs.append(result)
                print(f"{mode:9s} {size:5d} docs: peak RSS {result['peak_rss_mb']:.0f} MB, "
                      f"{result['docs_per_s']:.1f} docs/s", file=sys.stderr)

    interleaved_result = None
    if args.interleaved > 0:
        interleaved_result = run_child(
            "interleaved", model, dev_dirs[sizes[0]], args.gpu_id, args.threads, args.interleaved
        )
        interleaved_result["size"] = sizes[0]
        print(f"interleaved {sizes[0]} docs: best-of-{args.interleaved} throughput ratio "
              f"{interleaved_result['best_ratio_streaming_over_stock']:.2f}", file=sys.stderr)

    def pick(mode, size, key, agg):
        return agg([r[key] for r in runs if r["mode"] == mode and r["size"] == size])

    summary = {"per_size": []}
    for size in sizes:
        row = {"size": size}
        for mode in ("stock", "streaming"):
            row[f"{mode}_peak_rss_mb"] = pick(mode, size, "peak_rss_mb", max)
            row[f"{mode}_docs_per_s"] = pick(mode, size, "docs_per_s", statistics.median)
            if args.gpu_id >= 0:
                row[f"{mode}_peak_gpu_mb"] = pick(mode, size, "peak_gpu_mb", max)
        row["rss_ratio_streaming_over_stock"] = row["streaming_peak_rss_mb"] / row["stock_peak_rss_mb"]
        row["throughput_ratio_streaming_over_stock"] = row["streaming_docs_per_s"] / row["stock_docs_per_s"]
        summary["per_size"].append(row)
    first, last = summary["per_size"][0], summary["per_size"][-1]
    for mode in ("stock", "streaming"):
        key = f"{mode}_peak_rss_mb"
        summary[f"{mode}_rss_growth_smallest_to_largest"] = last[key] / first[key] - 1
        if args.gpu_id >= 0:
            key = f"{mode}_peak_gpu_mb"
            summary[f"{mode}_gpu_growth_smallest_to_largest"] = last[key] / first[key] - 1
    reference = {size: [without_speed(r["scores"]) for r in runs if r["size"] == size] for size in sizes}
    summary["interleaved_throughput"] = interleaved_result
    summary["scores_identical"] = all(all(s == group[0] for s in group) for group in reference.values())
    summary["targets"] = {
        "streaming_rss_growth_below_5pct": summary["streaming_rss_growth_smallest_to_largest"] < 0.05,
        "streaming_throughput_at_least_stock": all(
            row["throughput_ratio_streaming_over_stock"] >= 1.0 for row in summary["per_size"]
        ),
        "identical_scores": summary["scores_identical"],
    }
    report = {
        "benchmark": "eval_memory",
        "command": "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg()},
        "model": "BERT 4 layers x 256 hidden (random init, local WordPiece) + ner (8 steps)",
        "sizes": sizes,
        "repeats": args.repeats,
        "device": f"cuda:{args.gpu_id}" if args.gpu_id >= 0 else "cpu",
        "summary": summary,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
