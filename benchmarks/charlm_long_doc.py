"""Character-LM embeddings of one very long doc: time-chunked LSTM vs the whole doc at once.

Embeds a single doc of generated sentences (200,000 characters by default) with a
forward + backward character LM (random weights, 1 layer, embedding 100) and reports,
per arm: the peak resident memory while embedding (the increase of the process's
VmHWM over its resident memory just before the call), the wall and CPU seconds of the
call, and the largest difference of its vectors from the unchunked arm's (or the
error, where an arm fails). Arms:
- `unchunked`: `CharLMEmbedder(max_chunk_chars=None)`: each LM reads the whole doc in
  one LSTM call (the behaviour before chunking);
- `chunked-<C>`: `max_chunk_chars=C`, the LSTM state carried from chunk to chunk
  (C = 2048 is the default).
Every measurement runs in a fresh child process (one arm's freed memory cannot hide
another's peak), and the arms alternate order from one repeat to the next. One torch
thread; the two LMs one after the other.

`--short-docs N` adds the speed on ordinary short docs (2,000 generated sentences,
hidden 256, LM batches of 32, default settings, N repeats): this checkout, and with
`--baseline-src DIR` the `spacy_lean` of another checkout (e.g. a worktree of the commit
before chunking), alternating, with the largest difference of their vectors.

    nice -n 10 python benchmarks/charlm_long_doc.py           # ~7 min on 2 cores
    nice -n 10 python benchmarks/charlm_long_doc.py --quick   # ~20 s, writes no results
    nice -n 10 python benchmarks/charlm_long_doc.py --configs "" --short-docs 5 \
        --baseline-src /path/to/old/checkout --out /tmp/short.json   # short docs only

`--configs hidden:chars:chunk/chunk/...:repeats,...` sets the LM sizes, the doc
lengths, the chunk lengths and the repeats (default: DEFAULT_CONFIGS below).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procmem import proc_status, reset_peak  # noqa: E402
from _report import command_line, print_and_save  # noqa: E402  (benchmarks/_report.py)

# Hidden 1024 at 200,000 characters: the whole-doc LSTM call fails on torch's CPU LSTM
# (oneDNN, recorded as the arm's error); at 100,000 characters it runs.
DEFAULT_CONFIGS = "256:200000:256/512/1024/2048/8192:3,1024:100000:2048:1,1024:200000:2048:1"
QUICK_CONFIGS = "64:20000:64/2048:1"


def long_doc_words(n_chars: int, seed: int):
    """Words and spaces of one doc of generated sentences, at least `n_chars` long."""
    from spacy_lean.synthetic import generated_sentences

    words, spaces, length = [], [], 0
    sentences = generated_sentences(10**9, seed=seed)
    while length < n_chars:
        sentence = next(sentences).split(" ")
        words.extend(sentence)
        spaces.extend([True] * len(sentence))
        length += sum(map(len, sentence)) + len(sentence)
    spaces[-1] = False
    return words, spaces


def child(args) -> None:
    """One measurement: one arm, one LM size, one doc length, in this (fresh) process."""
    import numpy
    import spacy
    import torch
    from spacy.tokens import Doc

    from spacy_lean.charlm import CharLM
    from spacy_lean.charlm.embed import CharLMEmbedder
    from spacy_lean.memory import resident_bytes

    torch.set_num_threads(1)
    vocab = spacy.blank("en").vocab
    words, spaces = long_doc_words(args.chars, args.seed)
    doc = Doc(vocab, words=words, spaces=spaces)
    lms = [
        CharLM.load(Path(args.ckpt_dir) / f"{d}.pt", has_decoder=False)
        for d in ("forward", "backward")
    ]
    chunk = None if args.arm == "unchunked" else int(args.arm.split("-")[1])
    embedder = CharLMEmbedder(*lms, max_chunk_chars=chunk, threads=1)
    embedder([Doc(vocab, words=words[:50], spaces=spaces[:50])])  # warm-up
    could_reset = reset_peak()
    base = resident_bytes()
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        vectors, _ = embedder([doc])
    except RuntimeError as err:  # e.g. oneDNN's "could not create a primitive"
        error = str(err).splitlines()[0]
        print("RESULT " + json.dumps({"arm": args.arm, "error": error, "chars": len(doc.text)}))
        return
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    peak = proc_status("VmHWM")
    result = {
        "arm": args.arm,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "chars_per_s": len(doc.text) / seconds,
        "peak_rss_increase_mb": (peak - base) / 2**20,
        "peak_reset": could_reset,
        "chars": len(doc.text),
        "tokens": len(doc),
        "vector_mb": vectors.numel() * 4 / 2**20,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    numpy.save(args.save_vectors, vectors.numpy())
    print("RESULT " + json.dumps(result))


def short_docs_child(args) -> None:
    """Time one default-settings call over 2,000 generated sentences (short docs)."""
    import numpy
    import spacy
    import torch
    from spacy.tokens import Doc

    import spacy_lean
    from spacy_lean.charlm import CharLM
    from spacy_lean.charlm.embed import CharLMEmbedder
    from spacy_lean.synthetic import generated_sentences

    torch.set_num_threads(1)
    vocab = spacy.blank("en").vocab
    docs = [Doc(vocab, words=s.split(" ")) for s in generated_sentences(2000, seed=args.seed)]
    lms = [
        CharLM.load(Path(args.ckpt_dir) / f"{d}.pt", has_decoder=False)
        for d in ("forward", "backward")
    ]
    embedder = CharLMEmbedder(*lms, batch_size=32, threads=1)
    embedder(docs[:64])  # warm-up
    t0, cpu0 = time.perf_counter(), time.process_time()
    vectors, n_tokens = embedder(docs)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    numpy.save(args.save_vectors, vectors.numpy())
    result = {
        "arm": args.arm,
        "spacy_lean": str(Path(spacy_lean.__file__).parent.parent),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens": int(n_tokens.sum()),
        "tokens_per_s": int(n_tokens.sum()) / seconds,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print("RESULT " + json.dumps(result))


def short_docs(repeats: int, baseline_src: Optional[str], tmp: Path, seed: int) -> dict:
    """This checkout against `baseline_src` (if given) on 2,000 short docs."""
    import numpy

    from spacy_lean.synthetic import generated_sentences

    ckpt_dir = tmp / "short_h256"
    ckpt_dir.mkdir()
    texts = list(generated_sentences(2000, seed=seed))
    make_checkpoints(ckpt_dir, 256, seed, texts=texts)
    arms = {"this checkout": str(ROOT)}
    if baseline_src:
        arms["baseline"] = str(Path(baseline_src).resolve())
    runs = {arm: [] for arm in arms}
    names = list(arms)
    for r in range(repeats):
        for arm in names if r % 2 == 0 else names[::-1]:
            # The vectors of each arm's first run are compared.
            vectors = tmp / f"short-{'first' if not runs[arm] else 'later'}-{arm}.npy"
            run = run_child(arm, 0, ckpt_dir, vectors, seed, mode="short", src=arms[arm])
            runs[arm].append(run)
            print(f"[short docs #{r}] {arm}: {run['seconds']:.2f} s", file=sys.stderr)
    out = {"n_docs": 2000, "hidden_size": 256, "batch_size": 32, "repeats": repeats, "arms": {}}
    for arm, src in arms.items():
        rs = runs[arm]
        out["arms"][arm] = {
            "spacy_lean": rs[0]["spacy_lean"],
            "git_commit": _git_commit(src),
            "tokens": rs[0]["tokens"],
            "seconds_median": median(x["seconds"] for x in rs),
            "seconds_runs": [round(x["seconds"], 3) for x in rs],
            "cpu_seconds_median": median(x["cpu_seconds"] for x in rs),
            "cpu_seconds_runs": [round(x["cpu_seconds"], 3) for x in rs],
            "tokens_per_s_median": median(x["tokens_per_s"] for x in rs),
            "load_average_1min_runs": [x["load_average_1min"] for x in rs],
        }
    if baseline_src:
        mine = numpy.load(tmp / "short-first-this checkout.npy")
        base = numpy.load(tmp / "short-first-baseline.npy")
        out["max_abs_diff_vs_baseline"] = float(numpy.abs(mine - base).max())
        out["seconds_ratio_vs_baseline"] = (
            out["arms"]["this checkout"]["seconds_median"]
            / out["arms"]["baseline"]["seconds_median"]
        )
        out["cpu_seconds_ratio_vs_baseline"] = (
            out["arms"]["this checkout"]["cpu_seconds_median"]
            / out["arms"]["baseline"]["cpu_seconds_median"]
        )
    return out


def _git_commit(src: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None


def make_checkpoints(ckpt_dir: Path, hidden: int, seed: int, texts=None) -> None:
    import torch

    from spacy_lean.charlm import CharDictionary, CharLM

    if texts is None:
        texts = [" ".join(long_doc_words(20_000, seed)[0])]
    dictionary = CharDictionary.from_texts(texts)
    for k, forward in enumerate((True, False)):
        torch.manual_seed(100 + k)
        lm = CharLM(
            dictionary, is_forward_lm=forward, hidden_size=hidden, nlayers=1, embedding_size=100
        )
        lm.save(ckpt_dir / ("forward.pt" if forward else "backward.pt"))


def run_child(
    arm: str, chars: int, ckpt_dir: Path, vectors: Path, seed: int, mode: str = "long",
    src: Optional[str] = None,
) -> dict:  # fmt: skip
    cmd = [
        sys.executable, __file__, "--child", arm, "--ckpt-dir", str(ckpt_dir),
        "--chars", str(chars), "--seed", str(seed), "--save-vectors", str(vectors),
        "--mode", mode,
    ]  # fmt: skip
    if src:
        cmd += ["--src", src]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {arm} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


def summarize(arm: str, rs: list, base: list, reference, vectors_path: Path) -> dict:
    """Medians over the repeats of one arm (`base`: the unchunked arm's runs)."""
    import numpy

    entry = {"max_chunk_chars": None if arm == "unchunked" else int(arm.split("-")[1])}
    errors = [x["error"] for x in rs if "error" in x]
    if errors:
        return {**entry, "error": errors[0]}
    seconds = median(x["seconds"] for x in rs)
    cpu_seconds = median(x["cpu_seconds"] for x in rs)
    entry.update(
        seconds_median=seconds,
        seconds_runs=[round(x["seconds"], 3) for x in rs],
        cpu_seconds_median=cpu_seconds,
        cpu_seconds_runs=[round(x["cpu_seconds"], 3) for x in rs],
        chars_per_s_median=median(x["chars_per_s"] for x in rs),
        peak_rss_increase_mb_median=median(x["peak_rss_increase_mb"] for x in rs),
        peak_rss_increase_mb_runs=[round(x["peak_rss_increase_mb"], 1) for x in rs],
        peak_reset=all(x["peak_reset"] for x in rs),
        load_average_1min_runs=[x["load_average_1min"] for x in rs],
    )
    if not any("error" in x for x in base):
        entry["seconds_ratio_vs_unchunked"] = seconds / median(x["seconds"] for x in base)
        entry["cpu_seconds_ratio_vs_unchunked"] = cpu_seconds / median(
            x["cpu_seconds"] for x in base
        )
        entry["max_abs_diff_vs_unchunked"] = float(
            numpy.abs(numpy.load(vectors_path) - reference).max()
        )
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"configs {QUICK_CONFIGS}")
    parser.add_argument("--configs", default=None, help=f"default: {DEFAULT_CONFIGS}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--short-docs",
        type=int,
        default=0,
        metavar="REPEATS",
        help="also time 2,000 short docs, this many repeats (default 0: not)",
    )
    parser.add_argument(
        "--baseline-src",
        default=None,
        help="a checkout whose spacy_lean the short docs are also timed with",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/results/charlm_long_doc.json; --quick: none",
    )
    # child-process options
    parser.add_argument("--child", default=None)
    parser.add_argument("--chars", type=int, default=None)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--save-vectors", default=None)
    parser.add_argument("--mode", default="long")
    parser.add_argument("--src", default=None)
    args = parser.parse_args()
    if args.child:
        if args.src:
            sys.path.insert(0, args.src)  # before this checkout's
        args.arm = args.child
        (short_docs_child if args.mode == "short" else child)(args)
        return

    import numpy
    import torch

    configs = []
    chosen = args.configs if args.configs is not None else (
        QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)  # fmt: skip
    for item in filter(None, chosen.split(",")):
        hidden, chars, chunks, repeats = item.split(":")
        chunk_list = [int(c) for c in chunks.split("/")]
        configs.append((int(hidden), int(chars), chunk_list, int(repeats)))
    report = {
        "benchmark": "charlm_long_doc",
        "command": command_line(__file__),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "threads": 1,
        "results": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for hidden, chars, chunks, repeats in configs:
            ckpt_dir = tmp / f"h{hidden}"
            if not ckpt_dir.exists():
                ckpt_dir.mkdir()
                make_checkpoints(ckpt_dir, hidden, args.seed)
            arms = ["unchunked"] + [f"chunked-{c}" for c in chunks]
            runs = {arm: [] for arm in arms}
            for r in range(repeats):
                # Alternate the order, so drift on a shared machine hits every arm.
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    run = run_child(arm, chars, ckpt_dir, tmp / f"{arm}.npy", args.seed)
                    runs[arm].append(run)
                    said = run.get("error") or (
                        f"{run['seconds']:.2f} s, {run['cpu_seconds']:.2f} CPU s, "
                        f"peak +{run['peak_rss_increase_mb']:.0f} MB"
                    )
                    print(f"[h{hidden} {chars} chars #{r}] {arm}: {said}", file=sys.stderr)
            ok = [run for rs in runs.values() for run in rs if "error" not in run]
            reference = None
            if "error" not in runs["unchunked"][0]:
                reference = numpy.load(tmp / "unchunked.npy")
            entry = {
                "hidden_size": hidden,
                "nlayers": 1,
                "embedding_size": 100,
                "repeats": repeats,
                "chars": runs["unchunked"][0]["chars"],
                "tokens": ok[0]["tokens"] if ok else None,
                "vector_mb": ok[0]["vector_mb"] if ok else None,
                "arms": {
                    arm: summarize(arm, runs[arm], runs["unchunked"], reference, tmp / f"{arm}.npy")
                    for arm in arms
                },
            }
            report["results"].append(entry)
        if args.short_docs:
            report["short_docs"] = short_docs(args.short_docs, args.baseline_src, tmp, args.seed)
    out = args.out or (None if args.quick else ROOT / "benchmarks/results/charlm_long_doc.json")
    print_and_save(report, out)


if __name__ == "__main__":
    main()
