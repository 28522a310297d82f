"""Memory kept by `docs = list(nlp.pipe(texts))`: stock spaCy vs `doc_cleaner` vs
`lean_cleaner`.

For each mode and each of three sizes (growing 4x), a fresh Python process loads a
transformer + ner pipeline (a local random-init BERT, 4 layers, 256 wide, and a ner
trained for a couple of steps), warms it up, resets the peak RSS counter, runs
`docs = list(nlp.pipe(texts))` and reports the peak RSS above the starting point
(and, with CUDA, torch's peak allocated GPU memory). The growth per kept doc is the
slope between the smallest and largest size, so fixed costs (the first batch's
buffers) cancel out. `tokenizer_only` (`docs = list(nlp.tokenizer.pipe(texts))`)
measures what the docs themselves take: the floor any cleaner can reach.

    python benchmarks/cleaner_memory.py            # defaults: a few minutes on 2 cores
    python benchmarks/cleaner_memory.py --quick    # small sizes, a smoke run

Prints JSON and writes it to benchmarks/results/cleaner_memory.json (or --out).
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from _report import command_line, print_and_save  # noqa: E402  (benchmarks/_report.py)

MODES = {
    "tokenizer_only": "docs from the tokenizer alone: the docs' own memory",
    "stock": "transformer + ner, nothing released",
    "doc_cleaner": "spaCy's doc_cleaner (default attrs: tensor, _.trf_data) last",
    "lean_cleaner": "lean_cleaner last, default settings (trim_memory_every = 32)",
    "lean_cleaner_no_trim": "lean_cleaner last, trim_memory_every = 0",
    "lean_cleaner_compact16": "lean_cleaner last, compact_vectors = float16",
}


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1))


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    from spacy_lean.memory import trim_host_memory

    trim_host_memory()


def run_child(
    mode: str,
    n_docs: int,
    model_dir: str,
    seed: int,
    gpu: bool,
    long_doc_rate: float,
    empty_every: int = 0,
) -> dict:
    import gc

    import torch

    torch.set_num_threads(1)
    import spacy
    from spacy_lean import synthetic

    if gpu:
        from thinc.api import require_gpu, set_gpu_allocator

        set_gpu_allocator("pytorch")
        require_gpu(0)
    # Time spent giving memory back (trim_memory_every/empty_cache_every), in the run.
    from spacy_lean import cleaner

    give_back_time = [0.0]

    def timed(function):
        def wrapper():
            start = time.perf_counter()
            function()
            give_back_time[0] += time.perf_counter() - start

        return wrapper

    cleaner.trim_host_memory = timed(cleaner.trim_host_memory)
    cleaner.empty_gpu_caches = timed(cleaner.empty_gpu_caches)
    nlp = spacy.load(model_dir)
    # On GPU, the cleaner modes also empty torch's cache (every batch by default).
    gpu_cfg = {"empty_cache_every": empty_every or nlp.batch_size} if gpu else {}
    if mode == "doc_cleaner":
        nlp.add_pipe("doc_cleaner")
    elif mode == "lean_cleaner":
        nlp.add_pipe("lean_cleaner", config=gpu_cfg)
    elif mode == "lean_cleaner_no_trim":
        nlp.add_pipe("lean_cleaner", config={"trim_memory_every": 0, **gpu_cfg})
    elif mode == "lean_cleaner_compact16":
        nlp.add_pipe("lean_cleaner", config={"compact_vectors": "float16", **gpu_cfg})
    blank = spacy.blank("en")
    texts = [d.text for d in synthetic.make_ner_docs(blank, n_docs, seed, long_doc_rate)]
    if mode == "tokenizer_only":

        def run(batch):
            return list(nlp.tokenizer.pipe(batch))

    else:

        def run(batch):
            return list(nlp.pipe(batch))

    # A discarded pass over the same texts first: the allocators then already hold
    # the largest batch's working memory, so what the measured pass adds is what
    # the kept docs hold (plus heap fragmentation), not the luck of batch shapes.
    run(texts)
    gc.collect()
    _malloc_trim()
    rss0 = _status_kb("VmRSS")
    exact_peak = _reset_peak()
    if gpu:
        torch.cuda.synchronize()
        gpu0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    give_back_time[0] = 0.0
    docs = run(texts)
    seconds = time.perf_counter() - start
    peak_kb = _status_kb("VmHWM") - rss0
    rss_after_kb = _status_kb("VmRSS") - rss0
    gc.collect()
    _malloc_trim()
    result = {
        "mode": mode,
        "n_docs": n_docs,
        "n_tokens": sum(len(doc) for doc in docs),
        "seconds": round(seconds, 3),
        "peak_rss_growth_kb": peak_kb,
        "rss_after_kb": rss_after_kb,
        # RSS still in use once free heap pages are given back: what the docs keep
        "kept_kb": _status_kb("VmRSS") - rss0,
        "exact_peak": exact_peak,
    }
    if gpu:
        torch.cuda.synchronize()
        result["gpu_peak_growth_kb"] = (torch.cuda.max_memory_allocated() - gpu0) // 1024
        result["gpu_kept_kb"] = (torch.cuda.memory_allocated() - gpu0) // 1024
    if mode.startswith("lean_cleaner"):
        result["cleaner_stats"] = dict(nlp.get_pipe("lean_cleaner").stats)
        result["give_back_seconds"] = round(give_back_time[0], 4)
    return result


def build_model(workdir: Path) -> Path:
    """A 4-layer, 256-wide random-init BERT with a ner trained for 2 steps."""
    from spacy_lean import synthetic

    bert = workdir / "bert256"
    model = workdir / "trf_ner256"
    if not (model / "config.cfg").exists():
        synthetic.make_tiny_transformer(
            bert,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
        )
        nlp = synthetic.build_trf_ner_pipeline(bert, n_steps=2)
        nlp.to_disk(model)
    return model


def measure(mode, n_docs, model, seed, gpu, repeats, long_doc_rate, every):
    """Run one measurement in a fresh subprocess per repeat; keep the median."""
    results = []
    for _ in range(repeats):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            mode,
            str(n_docs),
            str(model),
            "--seed",
            str(seed),
            "--long-doc-rate",
            str(long_doc_rate),
            "--empty-cache-every",
            str(every),
        ]
        cmd += ["--gpu"] if gpu else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    results.sort(key=lambda r: r["peak_rss_growth_kb"])
    return results[len(results) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs=3,
        default=None,
        help="three doc counts (default 100 400 1600; --quick 25 100 400)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per point (median)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--empty-cache-every",
        type=int,
        default=0,
        help="with CUDA: empty_cache_every of the lean_cleaner modes "
        "(default 0: nlp.batch_size)",
    )
    parser.add_argument(
        "--long-doc-rate",
        type=float,
        default=0.0,
        help="share of 20-60 sentence docs (default 0: each batch then needs "
        "about the same working memory, so the slope measures what is kept)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the local BERT and pipeline are built (default: temp)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "cleaner_memory.json"
    )
    parser.add_argument("--gpu", action="store_true", help="run on CUDA (default: if available)")
    parser.add_argument("--cpu", action="store_true", help="never use CUDA")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--child", nargs=3, metavar=("MODE", "N", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        mode, n_docs, model = args.child
        result = run_child(
            mode,
            int(n_docs),
            model,
            args.seed,
            args.gpu,
            args.long_doc_rate,
            args.empty_cache_every,
        )
        print(json.dumps(result))
        return

    import torch

    gpu = (args.gpu or torch.cuda.is_available()) and not args.cpu
    sizes = args.sizes or ([25, 100, 400] if args.quick else [100, 400, 1600])
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        model = build_model(workdir)
        rows = {}
        for mode in args.modes:
            rows[mode] = [
                measure(
                    mode,
                    n,
                    model,
                    args.seed,
                    gpu,
                    args.repeats,
                    args.long_doc_rate,
                    args.empty_cache_every,
                )
                for n in sizes
            ]
            print(
                f"# {mode}: "
                + ", ".join(
                    f"{r['n_docs']} docs -> +{r['peak_rss_growth_kb'] / 1024:.1f} MB peak RSS"
                    + (
                        f", {r['gpu_kept_kb'] / 1024:.1f} MB kept on the GPU"
                        if "gpu_kept_kb" in r
                        else ""
                    )
                    for r in rows[mode]
                ),
                file=sys.stderr,
            )

    def slope(points, key, first=0):
        lo, hi = points[first], points[-1]
        return (hi[key] - lo[key]) / (hi["n_docs"] - lo["n_docs"])

    summary = {}
    for mode, points in rows.items():
        entry = {
            "peak_rss_kb_per_doc": round(slope(points, "peak_rss_growth_kb"), 2),
            # between the two largest sizes, where the batches' working memory has
            # long reached its maximum
            "peak_rss_kb_per_doc_largest_two": round(slope(points, "peak_rss_growth_kb", 1), 2),
            "rss_after_kb_per_doc": round(slope(points, "rss_after_kb"), 2),
            "kept_kb_per_doc": round(slope(points, "kept_kb"), 2),
            "tokens_per_doc": round(points[-1]["n_tokens"] / points[-1]["n_docs"], 1),
            "seconds_largest": points[-1]["seconds"],
        }
        if gpu:
            entry["gpu_peak_kb_per_doc"] = round(slope(points, "gpu_peak_growth_kb"), 2)
            entry["gpu_kept_kb_per_doc"] = round(slope(points, "gpu_kept_kb"), 2)
        summary[mode] = entry
    ratios = {}
    if "stock" in summary:
        base = summary["stock"]["peak_rss_kb_per_doc"]
        for mode, entry in summary.items():
            if mode != "stock" and entry["peak_rss_kb_per_doc"] > 0:
                ratios[f"peak stock/{mode}"] = round(base / entry["peak_rss_kb_per_doc"], 1)
        base = summary["stock"]["kept_kb_per_doc"]
        for mode, entry in summary.items():
            if mode != "stock" and entry["kept_kb_per_doc"] > 0:
                ratios[f"kept stock/{mode}"] = round(base / entry["kept_kb_per_doc"], 1)
        if gpu:
            base = summary["stock"]["gpu_kept_kb_per_doc"]
            for mode, entry in summary.items():
                if mode != "stock" and entry["gpu_kept_kb_per_doc"] > 0:
                    ratios[f"gpu_kept stock/{mode}"] = round(base / entry["gpu_kept_kb_per_doc"], 1)
    report = {
        "benchmark": "cleaner_memory",
        "command": command_line(__file__),
        "what": "KB per kept doc (slope between the smallest and largest size) of "
        "docs = list(nlp.pipe(texts)), each point in a fresh process after a discarded "
        "warm-up pass over the same texts: peak_rss = growth of peak RSS (VmHWM); "
        "kept = RSS still used after the pass once gc and malloc_trim ran",
        "model": "random-init BERT, 4 layers, hidden 256, 4 heads, intermediate 1024; "
        "ner (TransitionBasedParser, listener) trained 2 steps; strided spans 64/48; "
        "nlp.batch_size 32",
        "device": "cuda" if gpu else "cpu",
        "sizes": sizes,
        "long_doc_rate": args.long_doc_rate,
        "empty_cache_every (CUDA only)": args.empty_cache_every or "nlp.batch_size (32)",
        "modes": {m: MODES[m] for m in rows},
        "summary": summary,
        "ratios": ratios,
        "points": rows,
        "python": platform.python_version(),
        "torch_threads": 1,
    }
    print_and_save(report, args.out)


if __name__ == "__main__":
    main()
