"""Character-LM embeddings: spacy-lean vs Flair's FlairEmbeddings, same checkpoint.

Embeds generated sentences with a forward + backward character LM (random weights,
1 layer) and reports, for each side: tokens/s, peak resident memory while embedding,
bytes retained by the kept vectors, and the largest difference between the two
sides' vectors. Every measurement runs in a fresh child process (so one side's
memory does not hide the other's), and the sides alternate, repeated.

Flair is not a dependency of spacy-lean: run this with a Python that has it (see
benchmarks/requirements-flair.txt); spacy_lean is imported from this repository.

    /work/flair-venv/bin/python benchmarks/charlm_speed.py            # ~3-5 min
    /work/flair-venv/bin/python benchmarks/charlm_speed.py --quick    # ~1 min

Settings (defaults): 2,000 sentences, batch size 32, hidden 256 with 2 threads and
hidden 1024 with 1 thread, embedding size 100, CPU (and CUDA when available).
Sides:
- `flair`: `StackedEmbeddings([FlairEmbeddings(fw), FlairEmbeddings(bw)]).embed` on
  mini-batches of 32 sentences in the given order (how Flair embeds during training);
- `flair-sorted`: the same, the sentences first sorted by token count, as Flair's own
  `predict` does;
- `ours`: one `CharLMEmbedder` call over all spaCy Docs (sorted by character length
  inside, LM batches of 32); with 2 threads the two LMs run side by side, one
  thread each; with 1 thread, one after the other;
- `ours-sequential` (2-thread configurations): the LMs one after the other, each
  with 2 intra-op threads.
Flair keeps its vectors with storage mode 'cpu' (on the tokens); ours keeps the
`[n_tokens, width]` array the embedder returns.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import command_line, print_and_save  # noqa: E402  (benchmarks/_report.py)

# (hidden size, threads). (256, 1) is an extra: on a shared machine a second intra-op
# thread can make any LSTM many times slower, and one thread per side is the steadier
# comparison.
CONFIGS = [(256, 2), (256, 1), (1024, 1)]


def _words(n: int, seed: int):
    from spacy_lean.synthetic import generated_sentences

    return [s.split(" ") for s in generated_sentences(n, seed=seed)]


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _unique_storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def child(args) -> None:
    """One measurement: one side, one configuration, in this (fresh) process."""
    import numpy
    import torch

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    words = _words(args.n_sentences, seed=args.seed)
    n_tokens = sum(len(w) for w in words)
    fw, bw = str(Path(args.ckpt_dir) / "forward.pt"), str(Path(args.ckpt_dir) / "backward.pt")
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if args.side.startswith("flair"):
        import flair
        from flair.data import Sentence
        from flair.embeddings import FlairEmbeddings, StackedEmbeddings

        flair.device = device
        stacked = StackedEmbeddings([FlairEmbeddings(fw), FlairEmbeddings(bw)])
        stacked.embed([Sentence(w) for w in words[:8]])  # warm-up
        sents = [Sentence(w) for w in words]
        order = list(range(len(sents)))  # as given (FlairEmbeddings.embed, training)
        if args.side == "flair-sorted":
            # Flair's predict() sorts by number of tokens before batching.
            order.sort(key=lambda i: len(sents[i]), reverse=True)
        batches = [
            [sents[i] for i in order[b : b + args.batch_size]]
            for b in range(0, len(order), args.batch_size)
        ]
        _reset_peak()
        base = _rss_kb("VmRSS")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base_cuda = torch.cuda.memory_allocated()
        sync()
        t0 = time.perf_counter()
        for batch in batches:
            stacked.embed(batch)
        sync()
        seconds = time.perf_counter() - t0
        kept = [t.get_embedding() for s in sents for t in s]
        width = int(kept[0].shape[0])
        retained = _unique_storage_bytes(
            [e for s in sents for t in s for e in t._embeddings.values()]
        )
        vectors = torch.stack(kept).detach().cpu().numpy() if args.save_vectors else None
    else:
        import spacy
        from spacy.tokens import Doc

        from spacy_lean.charlm import CharLM
        from spacy_lean.charlm.embed import CharLMEmbedder

        vocab = spacy.blank("en").vocab
        lms = [CharLM.load(p, map_location=device, has_decoder=False) for p in (fw, bw)]
        embedder = CharLMEmbedder(
            *lms,
            batch_size=args.batch_size,
            threads=args.threads,
            # Side by side only when there are 2 threads to share: never more cores
            # than Flair gets.
            concurrent=args.side == "ours" and args.threads >= 2,
        )
        embedder([Doc(vocab, words=w) for w in words[:8]])  # warm-up
        docs = [Doc(vocab, words=w) for w in words]
        _reset_peak()
        base = _rss_kb("VmRSS")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base_cuda = torch.cuda.memory_allocated()
        sync()
        t0 = time.perf_counter()
        out, _ = embedder(docs)
        sync()
        seconds = time.perf_counter() - t0
        width = int(out.shape[1])
        retained = _unique_storage_bytes([out])
        vectors = out.cpu().numpy() if args.save_vectors else None
    result = {
        "side": args.side,
        "seconds": seconds,
        "tokens": n_tokens,
        "tokens_per_s": n_tokens / seconds,
        "peak_rss_increase_mb": (_rss_kb("VmHWM") - base) / 1024,
        "retained_bytes": retained,
        "vector_bytes": n_tokens * width * 4,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    if cuda:
        result["peak_cuda_increase_mb"] = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
    if vectors is not None:
        numpy.save(args.save_vectors, vectors.astype(numpy.float32))
    print("RESULT " + json.dumps(result))


def make_checkpoints(ckpt_dir: Path, hidden: int, n_sentences: int, seed: int) -> None:
    import torch

    from spacy_lean.charlm import CharDictionary, CharLM

    texts = [" ".join(w) for w in _words(n_sentences, seed)]
    dictionary = CharDictionary.from_texts(texts)
    for k, forward in enumerate((True, False)):
        torch.manual_seed(100 + k)
        lm = CharLM(
            dictionary, is_forward_lm=forward, hidden_size=hidden, nlayers=1, embedding_size=100
        )
        lm.save(ckpt_dir / ("forward.pt" if forward else "backward.pt"))


def run_child(side, hidden, threads, device, ckpt_dir, args, save_vectors=None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        side,
        "--threads",
        str(threads),
        "--device",
        device,
        "--ckpt-dir",
        str(ckpt_dir),
        "--n-sentences",
        str(args.n_sentences),
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
    ]
    if save_vectors:
        cmd += ["--save-vectors", str(save_vectors)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {side} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description="spacy-lean vs Flair character-LM embeddings")
    parser.add_argument("--quick", action="store_true", help="small sizes (300 sentences)")
    parser.add_argument("--n-sentences", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per side for hidden < 1024 (default 3; 1 for 1024)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "charlm_speed.json"
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="hidden:threads[:repeats] list, e.g. 256:2:3,1024:1 (default: "
        + ",".join(f"{h}:{t}" for h, t in CONFIGS)
        + ")",
    )
    # child-process options
    parser.add_argument(
        "--child", choices=["flair", "flair-sorted", "ours", "ours-sequential"], default=None
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--save-vectors", default=None)
    args = parser.parse_args()
    if args.n_sentences is None:
        args.n_sentences = 300 if args.quick else 2000
    if args.child:
        args.side = args.child
        child(args)
        return

    import numpy
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    configs = CONFIGS
    if args.configs:
        configs = [tuple(int(v) for v in item.split(":")) for item in args.configs.split(",")]
    report = {
        "benchmark": "charlm_speed",
        # Which Python ran it matters: one with Flair.
        "command": command_line(__file__, python=sys.executable),
        "n_sentences": args.n_sentences,
        "batch_size": args.batch_size,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "results": [],
    }
    try:
        import flair

        report["flair"] = flair.__version__
    except ImportError:
        sys.exit("flair is not installed in this Python: see benchmarks/requirements-flair.txt")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for device in devices:
            for hidden, threads, *config_repeats in configs:
                ckpt_dir = tmp / f"h{hidden}"
                ckpt_dir.mkdir(exist_ok=True)
                make_checkpoints(ckpt_dir, hidden, args.n_sentences, args.seed)
                repeats = (config_repeats[0] if config_repeats else args.repeats) or (
                    1 if (args.quick or hidden >= 1024) else 3
                )
                if device == "cuda":
                    repeats = max(repeats, 3)
                sides = ["flair", "flair-sorted", "ours"] + (
                    ["ours-sequential"] if threads >= 2 else []
                )
                runs = {side: [] for side in sides}
                for r in range(repeats):
                    # Alternate the order, so drift on a shared machine hits both sides.
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        vec = tmp / f"{side}.npy" if r == 0 else None
                        runs[side].append(
                            run_child(
                                side, hidden, threads, device, ckpt_dir, args, save_vectors=vec
                            )
                        )
                        print(
                            f"[{device} h{hidden} t{threads} #{r}] {side}: "
                            f"{runs[side][-1]['tokens_per_s']:.0f} tokens/s",
                            file=sys.stderr,
                        )
                ref = numpy.load(tmp / "flair.npy")
                entry = {
                    "device": device,
                    "hidden_size": hidden,
                    "threads": threads,
                    "nlayers": 1,
                    "repeats": repeats,
                    "sides": {},
                }
                for side in sides:
                    rs = runs[side]
                    entry["sides"][side] = {
                        "tokens_per_s_median": median(x["tokens_per_s"] for x in rs),
                        "tokens_per_s_runs": [round(x["tokens_per_s"], 1) for x in rs],
                        "peak_rss_increase_mb_median": median(
                            x["peak_rss_increase_mb"] for x in rs
                        ),
                        "retained_bytes": rs[0]["retained_bytes"],
                        "vector_bytes": rs[0]["vector_bytes"],
                        "retained_over_vector_bytes": (
                            rs[0]["retained_bytes"] / rs[0]["vector_bytes"]
                        ),
                        "tokens": rs[0]["tokens"],
                        "load_average_1min_runs": [x["load_average_1min"] for x in rs],
                    }
                    if "peak_cuda_increase_mb" in rs[0]:
                        entry["sides"][side]["peak_cuda_increase_mb_median"] = median(
                            x["peak_cuda_increase_mb"] for x in rs
                        )
                    if side != "flair":
                        ours = numpy.load(tmp / f"{side}.npy")
                        entry["sides"][side]["max_abs_diff_vs_flair"] = float(
                            numpy.abs(ours - ref).max()
                        )
                    if side.startswith("ours"):
                        for base in ("flair", "flair-sorted"):
                            entry["sides"][side][f"speedup_vs_{base}"] = (
                                entry["sides"][side]["tokens_per_s_median"]
                                / entry["sides"][base]["tokens_per_s_median"]
                            )
                            entry["sides"][side][f"speedup_runs_vs_{base}"] = [
                                round(o["tokens_per_s"] / f["tokens_per_s"], 3)
                                for o, f in zip(rs, runs[base])
                            ]
                report["results"].append(entry)
    print_and_save(report, args.out)


if __name__ == "__main__":
    main()
