"""Resident memory per token and docs/s reading a generated corpus: spaCy's `Corpus`
listed as `spacy train` lists it (max_epochs >= 0), spaCy's `Corpus` streamed
(max_epochs = -1), and spacy-lean's `Corpus.v1` streaming and compact. Each reader
runs in a fresh subprocess; memory is the process's resident set (VmRSS / VmHWM from
/proc) above its level just before reading: "held" after a gc and glibc's
malloc_trim (what the listed or compact corpus keeps), "peak" the high-water mark.
Prints JSON and writes benchmarks/results/reader_memory.json.

A second part reads ONE large .spacy file (no sharding), at two sizes (--file-tokens
and a quarter of it): spaCy's `DocBin.from_disk(...).get_docs` against spacy-lean's
`DocBinReader.get_docs`, and spaCy's `Corpus` against `spacy-lean.Corpus.v1` on that
file (both streamed). "held" there is what the reader holds after reading every doc
(docs dropped, reader still open); "peak" the high-water mark; with bounded memory the
peak stays flat from the small file to the large one, so its bytes per token fall.

    python benchmarks/reader_memory.py [--quick] [--tokens N] [--file-tokens N]
        [--repeats R] [--data-dir DIR] [--parts shards,file]

Every mode runs R times (default 3), round-robin, and each figure is the median.

The corpora (generated NER docs, `spacy_lean.synthetic`: multi-sentence docs with a
long tail of 20-60 sentence ones; the single file also draws a fifth of its plain words
from a Zipf-distributed vocabulary of 200,000 words, so its string table grows as
real text's does) are written once to --data-dir and reused.
"""

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _procmem import proc_status, reset_peak  # benchmarks/_procmem.py
from _report import command_line, print_and_save  # noqa: E402  (benchmarks/_report.py)

MODES = ["spacy_listed", "spacy_streamed", "lean_streaming", "lean_compact"]
FILE_MODES = ["file_docbin", "file_lean_reader", "file_spacy_corpus", "file_lean_corpus"]


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


def make_single_file(data_dir: Path, n_tokens: int) -> Path:
    """One .spacy file of about `n_tokens` tokens (written once), as `spacy convert`
    writes them (no user data)."""
    import numpy
    import spacy
    from spacy.tokens import Doc, DocBin

    from spacy_lean import synthetic

    path = data_dir / f"single_{n_tokens}.spacy"
    if path.exists():
        return path
    data_dir.mkdir(parents=True, exist_ok=True)
    nlp = spacy.blank("en")
    rng = random.Random(n_tokens)
    zipf = numpy.random.default_rng(n_tokens).zipf(1.3, size=4 * n_tokens)
    zipf = zipf[zipf <= 200_000]
    doc_bin = DocBin()
    total, z = 0, 0
    while total < n_tokens:
        doc = synthetic.make_ner_doc(nlp, rng)
        words = [t.text for t in doc]
        for i, token in enumerate(doc):
            if token.ent_iob_ == "O" and token.is_alpha and rng.random() < 0.2:
                words[i] = f"w{int(zipf[z % len(zipf)])}"
                z += 1
        new = Doc(
            nlp.vocab,
            words=words,
            spaces=[bool(t.whitespace_) for t in doc],
            sent_starts=[t.is_sent_start for t in doc],
            ents=[t.ent_iob_ + ("-" + t.ent_type_ if t.ent_type_ else "") for t in doc],
        )
        doc_bin.add(new)
        total += len(new)
    tmp = path.with_suffix(".tmp")
    doc_bin.to_disk(tmp)
    tmp.rename(path)
    return path


def file_worker(mode: str, path: Path) -> dict:
    """Read every doc of one .spacy file with `mode`, in this process."""
    import spacy
    from spacy.tokens import DocBin
    from spacy.training import Corpus

    from spacy_lean.corpus import LeanCorpus
    from spacy_lean.corpus.docbin import DocBinReader

    nlp = spacy.blank("en")
    base = _held()
    peak_ok = reset_peak()
    start = time.perf_counter()
    held = None
    if mode in ("file_docbin", "file_lean_reader"):
        reader = DocBin().from_disk(path) if mode == "file_docbin" else DocBinReader(path)
        n_docs, n_tokens = _count(reader.get_docs(nlp.vocab))
        seconds = time.perf_counter() - start
        held = _held() - base  # the reader still open, every doc dropped
        del reader
    elif mode in ("file_spacy_corpus", "file_lean_corpus"):
        corpus = Corpus(path) if mode == "file_spacy_corpus" else LeanCorpus(path)
        n_docs, n_tokens = _count(eg.reference for eg in corpus(nlp))
        seconds = time.perf_counter() - start
    else:
        raise ValueError(mode)
    peak = proc_status("VmHWM") - base if peak_ok else None
    out = {"mode": mode, "file_bytes": path.stat().st_size, "strings": len(nlp.vocab.strings)}
    out.update(_figures(n_docs, n_tokens, seconds, held, peak))
    out["held_mb"] = None if held is None else round(held / 2**20, 1)
    return out


def _count(docs) -> tuple:
    """(docs, tokens) of an iterable of docs, consumed one at a time."""
    n_docs = n_tokens = 0
    for doc in docs:
        n_docs += 1
        n_tokens += len(doc)
    return n_docs, n_tokens


def _figures(n_docs: int, n_tokens: int, seconds: float, held, peak) -> dict:
    return {
        "docs": n_docs,
        "tokens": n_tokens,
        "seconds": round(seconds, 2),
        "docs_per_second": round(n_docs / seconds, 1),
        "held_bytes_per_token": None if held is None else round(held / n_tokens, 1),
        "peak_bytes_per_token": None if peak is None else round(peak / n_tokens, 1),
        "peak_mb": None if peak is None else round(peak / 2**20, 1),
    }


def worker(mode: str, path: Path) -> dict:
    import spacy
    from spacy.training import Corpus

    from spacy_lean.corpus import LeanCorpus

    nlp = spacy.blank("en")
    base = _held()
    peak_ok = reset_peak()
    out = {"mode": mode}
    start = time.perf_counter()
    if mode == "spacy_listed":
        examples = list(Corpus(path)(nlp))
        seconds = time.perf_counter() - start
        n_docs = len(examples)
        n_tokens = sum(len(eg.reference) for eg in examples)
        held = _held() - base
    elif mode in ("spacy_streamed", "lean_streaming"):
        corpus = Corpus(path) if mode == "spacy_streamed" else LeanCorpus(path)
        n_docs, n_tokens = _count(eg.reference for eg in corpus(nlp))
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
        n_docs, n_tokens = _count(eg.reference for eg in corpus(nlp))  # second epoch: memory
        seconds = time.perf_counter() - start
    else:
        raise ValueError(mode)
    peak = proc_status("VmHWM") - base if peak_ok else None
    out.update(_figures(n_docs, n_tokens, seconds, held, peak))
    return out


def _median_run(runs: list) -> dict:
    """Each numeric figure's median over the runs of one mode."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    out["runs"] = len(runs)
    return out


def _shard_summary(results: dict) -> dict:
    base = results["spacy_listed"]
    return {
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


def _file_summary(results: dict, sizes: list) -> dict:
    """Single-file figures, and how each mode's peak grows from the small file to the
    large one (4x the tokens)."""
    small, large = sizes
    out: dict = {"sizes": sizes, "results": results}
    for mode in FILE_MODES:
        a, b = results[f"{mode}@{small}"], results[f"{mode}@{large}"]
        out[f"peak_growth_{mode}"] = round(b["peak_mb"] / a["peak_mb"], 3)
    for ours, theirs in (
        ("file_lean_reader", "file_docbin"),
        ("file_lean_corpus", "file_spacy_corpus"),
    ):
        r, s = results[f"{ours}@{large}"], results[f"{theirs}@{large}"]
        out[f"ratio_peak_{ours}_vs_{theirs}"] = round(r["peak_mb"] / s["peak_mb"], 4)
        out[f"ratio_speed_{ours}_vs_{theirs}"] = round(
            r["docs_per_second"] / s["docs_per_second"], 3
        )
    r, s = results[f"file_lean_reader@{large}"], results[f"file_docbin@{large}"]
    out["ratio_held_file_lean_reader_vs_file_docbin"] = round(r["held_mb"] / s["held_mb"], 4)
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
    parser.add_argument(
        "--file-tokens", type=int, default=None, help="single-file size (default 4M)"
    )
    parser.add_argument("--parts", default="shards,file", help="what to run: shards, file, or both")
    parser.add_argument("--file-worker", choices=FILE_MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.path))))
        return
    if args.file_worker:
        print(json.dumps(file_worker(args.file_worker, Path(args.path))))
        return
    parts = set(args.parts.split(","))
    n_tokens = args.tokens or (200_000 if args.quick else 2_000_000)
    file_tokens = args.file_tokens or (400_000 if args.quick else 4_000_000)
    repeats = args.repeats or (2 if args.quick else 3)
    data_dir = Path(args.data_dir)
    jobs = []  # (key, argv)
    if "shards" in parts:
        path = make_corpus(data_dir, n_tokens)
        jobs += [(mode, ["--worker", mode, "--path", str(path)]) for mode in MODES]
    sizes = [file_tokens // 4, file_tokens]
    if "file" in parts:
        for size in sizes:
            path = make_single_file(data_dir, size)
            jobs += [
                (f"{mode}@{size}", ["--file-worker", mode, "--path", str(path)])
                for mode in FILE_MODES
            ]
    load_before = os.getloadavg()
    runs: dict = {key: [] for key, _ in jobs}
    for _ in range(repeats):  # round-robin, so machine load hits every mode alike
        for key, argv in jobs:
            proc = subprocess.run(
                [sys.executable, __file__, *argv], check=True, capture_output=True, text=True
            )
            runs[key].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[key][-1]), file=sys.stderr)
    summary = {
        "command": command_line(__file__),
        "repeats": repeats,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
    }
    if "shards" in parts:
        summary.update(_shard_summary({mode: _median_run(runs[mode]) for mode in MODES}))
    if "file" in parts:
        summary["single_file"] = _file_summary(
            {key: _median_run(runs[key]) for key in runs if "@" in key}, sizes
        )
    print_and_save(summary, args.out)


if __name__ == "__main__":
    main()
