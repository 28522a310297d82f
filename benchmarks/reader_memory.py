"""Resident memory per token and docs/s reading a generated corpus: spaCy's `Corpus`
listed as `spacy train` lists it (max_epochs >= 0), spaCy's `Corpus` streamed
(max_epochs = -1), and spacy-lean's `Corpus.v1` streaming and compact. Each reader
runs in a fresh subprocess; memory is the process's resident set (VmRSS / VmHWM from
/proc) above its level just before reading: "held" after a gc and glibc's
malloc_trim (what the listed or compact corpus keeps), "peak" the high-water mark.
Prints JSON and writes benchmarks/results/reader_memory.json.

    python benchmarks/reader_memory.py [--quick] [--tokens N] [--repeats R] [--data-dir DIR]

Every mode runs R times (default 3), round-robin, and each figure is the median.

The corpus (generated NER docs, `spacy_lean.synthetic`, in shards of ~2,000 docs) is
written once to --data-dir and reused.
"""

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _procmem import proc_status, reset_peak  # benchmarks/_procmem.py

MODES = ["spacy_listed", "spacy_streamed", "lean_streaming", "lean_compact"]


def _held() -> int:
    """Resident bytes after a collection and after glibc returns freed heap to the OS
    (so the figure is what the process holds, not what its allocator keeps cached)."""
    from spacy_lean.memory import trim_host_memory

    gc.collect()
    trim_host_memory()
    return proc_status("VmRSS")


def make_corpus(data_dir: Path, n_tokens: int) -> Path:
    """Generated shards holding about `n_tokens` tokens (written once)."""
    import spacy
    from spacy.tokens import DocBin

    from spacy_lean import synthetic

    root = data_dir / f"ner_{n_tokens}"
    done = root / "DONE"
    if done.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    nlp = spacy.blank("en")
    total, i = 0, 0
    while total < n_tokens:
        docs = synthetic.make_ner_docs(nlp, 2000, seed=1000 + i)
        total += sum(len(d) for d in docs)
        DocBin(docs=docs, store_user_data=True).to_disk(root / f"shard-{i:05d}.spacy")
        i += 1
    done.write_text(str(total))
    return root


def worker(mode: str, path: Path) -> dict:
    import spacy
    from spacy.training import Corpus

    from spacy_lean.corpus import LeanCorpus

    nlp = spacy.blank("en")
    base = _held()
    peak_ok = reset_peak()
    out = {"mode": mode}
    start = time.perf_counter()
    n_docs = n_tokens = 0
    if mode == "spacy_listed":
        examples = list(Corpus(path)(nlp))
        seconds = time.perf_counter() - start
        n_docs = len(examples)
        n_tokens = sum(len(eg.reference) for eg in examples)
        held = _held() - base
    elif mode in ("spacy_streamed", "lean_streaming"):
        corpus = Corpus(path) if mode == "spacy_streamed" else LeanCorpus(path)
        for eg in corpus(nlp):
            n_docs += 1
            n_tokens += len(eg.reference)
        seconds = time.perf_counter() - start
        held = None
    elif mode == "lean_compact":
        corpus = LeanCorpus(path, compact=True)
        for eg in corpus(nlp):  # first epoch: reads the files, keeps compact chunks
            pass
        out["build_seconds"] = round(time.perf_counter() - start, 2)
        held = _held() - base
        out["compact_bytes_per_token"] = round(corpus.compact_nbytes() / corpus.stats.tokens, 2)
        start = time.perf_counter()
        for eg in corpus(nlp):  # second epoch: from memory
            n_docs += 1
            n_tokens += len(eg.reference)
        seconds = time.perf_counter() - start
    else:
        raise ValueError(mode)
    peak = proc_status("VmHWM") - base if peak_ok else None
    out.update(
        docs=n_docs,
        tokens=n_tokens,
        seconds=round(seconds, 2),
        docs_per_second=round(n_docs / seconds, 1),
        held_bytes_per_token=None if held is None else round(held / n_tokens, 1),
        peak_bytes_per_token=None if peak is None else round(peak / n_tokens, 1),
        peak_mb=None if peak is None else round(peak / 2**20, 1),
    )
    return out


def _median_run(runs: list) -> dict:
    """Each numeric figure's median over the runs of one mode."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    out["runs"] = len(runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small corpus (~200k tokens)")
    parser.add_argument("--tokens", type=int, default=None, help="corpus size (default 2M)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per mode (median)")
    parser.add_argument("--data-dir", default="/tmp/spacy_lean_bench", help="corpus cache")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "reader_memory.json")
    )
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.path))))
        return
    n_tokens = args.tokens or (200_000 if args.quick else 2_000_000)
    repeats = args.repeats or (2 if args.quick else 3)
    path = make_corpus(Path(args.data_dir), n_tokens)
    runs: dict = {mode: [] for mode in MODES}
    for _ in range(repeats):  # round-robin, so machine load hits every mode alike
        for mode in MODES:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", mode, "--path", str(path)],
                check=True,
                capture_output=True,
                text=True,
            )
            runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[mode][-1]), file=sys.stderr)
    results = {mode: _median_run(runs[mode]) for mode in MODES}
    base = results["spacy_listed"]
    summary = {
        "command": "python benchmarks/reader_memory.py"
        + (" --quick" if args.quick else "")
        + (f" --tokens {args.tokens}" if args.tokens else "")
        + (f" --repeats {args.repeats}" if args.repeats else ""),
        "repeats": repeats,
        "corpus_tokens": base["tokens"],
        "corpus_docs": base["docs"],
        "results": results,
        "ratio_held_memory_compact_vs_spacy_listed": round(
            results["lean_compact"]["held_bytes_per_token"] / base["held_bytes_per_token"], 4
        ),
        "ratio_peak_memory_streaming_vs_spacy_listed": round(
            results["lean_streaming"]["peak_bytes_per_token"] / base["peak_bytes_per_token"], 4
        ),
        "ratio_speed_streaming_vs_spacy_streamed": round(
            results["lean_streaming"]["docs_per_second"]
            / results["spacy_streamed"]["docs_per_second"],
            3,
        ),
        "ratio_speed_compact_vs_spacy_streamed": round(
            results["lean_compact"]["docs_per_second"]
            / results["spacy_streamed"]["docs_per_second"],
            3,
        ),
    }
    text = json.dumps(summary, indent=2)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
