"""Padding and batch counts: spaCy's `batch_by_padded` against spacy-lean's
`batch_by_tokens` on the same long-tailed lengths, in one run. Padding fraction =
share of the padded batches (longest x count, summed) that is padding; real tokens
per batch = what one training step carries. Also counts what `discard_oversize = true`
drops, and spacy-lean's batcher with the per-batch padding cap it had before issue #15
(`padding_scope = "batch"`). Prints JSON and writes benchmarks/results/padding.json.

    python benchmarks/padding.py [--quick] [--n-docs N] [--size 2000]

Lengths: generated NER documents (`spacy_lean.synthetic.make_ner_docs`, long-tailed:
mostly 1-15 sentences, 3% with 20-60), as whole docs and as the pieces
spacy-lean.Corpus.v1 makes with max_length = 128; generated news-like documents
(`spacy_lean.synthetic_news`, mostly 100-400 tokens) as the pieces max_length = 256
makes; plus a lognormal(3, 0.9) distribution of sentence-like lengths.
"""

import argparse
import random
import time
from pathlib import Path

import spacy
from spacy.training.batchers import minibatch_by_padded_size

from spacy_lean import synthetic, synthetic_news
from spacy_lean.corpus import DocSplitter, TokenBudgetBatcher

from _report import command_line, print_and_save  # noqa: E402  (benchmarks/_report.py)


def measure(batches, lengths_total, n_items):
    batches = list(batches)
    padded = sum(max(b) * len(b) for b in batches)
    kept = sum(sum(b) for b in batches)
    return {
        "batches": len(batches),
        "padding_fraction": round(1 - kept / padded, 4) if padded else 0.0,
        "items_dropped": n_items - sum(len(b) for b in batches),
        "tokens_dropped": lengths_total - kept,
        "real_tokens_per_batch": round(kept / len(batches), 1) if batches else 0.0,
    }


def run(lengths, size):
    """Every strategy on one list of lengths (items are lists so spaCy's len() works)."""
    items = [[0] * n for n in lengths]
    total, n = sum(lengths), len(lengths)

    def as_lengths(batches):
        return ([len(x) for x in b] for b in batches)

    out = {
        "items": n,
        "tokens": total,
        "mean_length": round(total / n, 1),
        "max_length": max(lengths),
    }
    t = time.perf_counter()
    out["spacy_batch_by_padded_buffer256"] = measure(
        as_lengths(minibatch_by_padded_size(items, size=size, buffer=256)), total, n
    )
    out["spacy_batch_by_padded_buffer256_discard_oversize"] = measure(
        as_lengths(minibatch_by_padded_size(items, size=size, buffer=256, discard_oversize=True)),
        total,
        n,
    )
    out["spacy_seconds"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    for name, kwargs in [
        ("lean_batch_by_tokens_default", {}),
        ("lean_batch_by_tokens_window2000", {"window": 2000}),
        ("lean_batch_by_tokens_max_padding1", {"max_padding": 1.0}),
        ("lean_batch_by_tokens_per_batch_cap", {"padding_scope": "batch"}),
    ]:
        batcher = TokenBudgetBatcher(size=size, **kwargs)
        out[name] = measure(as_lengths(batcher(items)), total, n)
        out[name]["oversize_alone"] = batcher.stats.oversize
    out["lean_seconds"] = round(time.perf_counter() - t, 3)
    base = out["spacy_batch_by_padded_buffer256"]
    lean = out["lean_batch_by_tokens_default"]
    out["ratio_padding_lean_vs_spacy"] = round(
        lean["padding_fraction"] / base["padding_fraction"], 3
    )
    out["ratio_batches_lean_vs_spacy"] = round(lean["batches"] / base["batches"], 3)
    out["ratio_real_tokens_per_batch_lean_vs_spacy"] = round(
        lean["real_tokens_per_batch"] / base["real_tokens_per_batch"], 3
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--n-docs", type=int, default=None, help="generated docs (default 20000)")
    parser.add_argument("--size", type=int, default=2000, help="padded-token budget per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "padding.json"))
    args = parser.parse_args()
    n_docs = args.n_docs or (2000 if args.quick else 20000)
    nlp = spacy.blank("en")
    docs = synthetic.make_ner_docs(nlp, n_docs, seed=args.seed)
    splitter = DocSplitter(128)
    pieces = [len(p) for d in docs for p in splitter(d)]
    news_splitter = DocSplitter(256)
    news = synthetic_news.make_news_docs(nlp, n_docs // 10, seed=args.seed)
    news_pieces = [len(p) for d in news for p in news_splitter(d)]
    rng = random.Random(args.seed)
    lognormal = [min(1 + int(rng.lognormvariate(3, 0.9)), 1500) for _ in range(n_docs * 3)]
    result = {
        "command": command_line(__file__),
        "size": args.size,
        "docs": run([len(d) for d in docs], args.size),
        "pieces_max_length_128": run(pieces, args.size),
        "news_pieces_max_length_256": run(news_pieces, args.size),
        "lognormal_sentences": run(lognormal, args.size),
    }
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
