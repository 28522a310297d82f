"""Evaluation on dev sets shaped like real corpora other than our news-like docs: does
`spacy lean evaluate` stay flat in memory, as fast as `spacy evaluate`, and give the same
scores, when the docs are tweets, CoNLL-style groups of sentences, or very long?

Figures taken on generated corpora have not always held on real ones, so the news-like
docs of `spacy_lean.synthetic_news` (sentence starts and entities set) are re-cut into
three shapes, each as one .spacy file at 1x and 4x its size, and 16x for one run of
`spacy lean evaluate` (each larger set tiles the 1x one, so the scores are the same at
every size):

- tweets: one sentence per doc, at most 30 tokens, each with a user handle before it and
  most with a hashtag after it (WNUT-17-like: short, many docs);
- conll: groups of 1-10 sentences, each group opened by a one-token "-DOCSTART-"
  sentence (what `spacy convert --converter ner --n-sents 10` makes of CoNLL-2003:
  ragged lengths, one-token sentences);
- long: 8-16 news docs joined into one (docs of thousands of tokens, one big file).

A third arm runs `spacy lean evaluate --trim-slack-mb 16` (the heap trimmed only once
resident memory has crept 16 MB above its working level, instead of after every batch).

The model is eval_memory.py's small one (a local random-init BERT 2 layers x 64 + ner
trained a few steps), where the evaluation loop's own cost shows most. Each command
runs in a fresh process (eval_memory.py's child), the two arms alternating per repeat:

    nice -n 10 python benchmarks/eval_shapes.py                 # ~60k tokens at 1x per shape
    python benchmarks/eval_shapes.py --quick                    # ~6k tokens, 1 repeat

Prints JSON and writes benchmarks/results/eval_shapes.json: per shape and size, each
arm's median wall time and peak RSS after loading, the wall-time ratio (median of the
per-repeat pairs), the peak's growth from 1x to 4x (and lean's from 4x to 16x), and whether
the scores are identical.
"""

import argparse
import json
import platform
import random
import statistics
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).parent))
from _devsets import write_tiled  # noqa: E402
from _report import command_line  # noqa: E402
from eval_memory import (  # noqa: E402
    LEAN_ARM,
    SLACK16_ARM,
    STOCK_ARM,
    build_model,
    run_child,
    without_speed,
)

RESULTS = Path(__file__).parent / "results" / "eval_shapes.json"
SHAPES = ("tweets", "conll", "long")
ARMS = (STOCK_ARM, LEAN_ARM, SLACK16_ARM)


def sentences(docs):
    for doc in docs:
        for sent in doc.sents:
            yield sent.as_doc()


def one_token(vocab, text: str):
    from spacy.tokens import Doc

    return Doc(vocab, words=[text], spaces=[True])


def make_shape(shape: str, n_tokens: int, seed: int) -> List:
    """Docs of one shape, about `n_tokens` tokens in all."""
    import spacy
    from spacy.tokens import Doc

    from spacy_lean.synthetic_news import make_news_docs

    nlp = spacy.blank("en")
    rng = random.Random(seed)
    news = make_news_docs(nlp, max(8, n_tokens // 150), seed=seed)
    out, total = [], 0
    if shape == "tweets":
        for sent in sentences(news):
            if len(sent) > 30:
                continue
            parts = [one_token(nlp.vocab, f"@user{rng.randrange(10_000)}"), sent]
            if rng.random() < 0.7:
                parts.append(one_token(nlp.vocab, f"#topic{rng.randrange(300)}"))
            out.append(Doc.from_docs(parts))
    elif shape == "conll":
        pool = list(sentences(news))
        i = 0
        while i < len(pool):
            k = rng.randint(1, 10)
            out.append(Doc.from_docs([one_token(nlp.vocab, "-DOCSTART-")] + pool[i : i + k]))
            i += k
    elif shape == "long":
        i = 0
        while i < len(news):
            k = rng.randint(8, 16)
            out.append(Doc.from_docs(news[i : i + k]))
            i += k
    else:
        raise ValueError(f"Unknown shape {shape!r}: one of {', '.join(SHAPES)}.")
    kept = []
    for doc in out:
        if total >= n_tokens and kept:
            break
        kept.append(doc)
        total += len(doc)
    return kept


def stats(docs) -> Dict[str, float]:
    lengths = sorted(len(d) for d in docs)

    def pct(p):
        return lengths[min(len(lengths) - 1, int(p * len(lengths)))]

    return {
        "docs": len(docs),
        "tokens": sum(lengths),
        "entities": sum(len(d.ents) for d in docs),
        "p10": pct(0.1),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "max": lengths[-1],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=60_000, help="tokens per shape at 1x")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/eval_shapes"))
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--no-lean-16x",
        dest="lean_16x",
        action="store_false",
        help="skip the one `spacy lean evaluate` run on each dev set at 16x",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 6_000, 1
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work_dir, "small")
    runs, shapes = [], {}
    for shape in args.shapes:
        base = make_shape(shape, args.tokens, seed=5)
        shapes[shape] = stats(base)
        sizes = [len(base), 4 * len(base)] + ([16 * len(base)] if args.lean_16x else [])
        files = write_tiled(base, sizes, args.work_dir, f"{shape}{args.tokens}", shard_docs=100)
        for factor, size in zip((1, 4, 16), sizes):
            # 16x: `spacy lean evaluate` once (stock's growth shows at 4x already).
            for rep in range(args.repeats if factor < 16 else 1):
                arms = ARMS if factor < 16 else (LEAN_ARM,)
                for arm in arms if rep % 2 == 0 else arms[::-1]:
                    result = run_child(arm, model, files[size]["file"], args.threads)
                    result.update(shape=shape, factor=factor, size=size, repeat=rep)
                    runs.append(result)
                    print(
                        f"{shape:6s} {factor}x {arm:20s} wall {result['wall_seconds']:6.1f}s "
                        f"peak {result['peak_rss_after_load_mb']:6.0f} MB",
                        file=sys.stderr,
                        flush=True,
                    )
    summary = {}
    for shape in args.shapes:
        row = {"data": shapes[shape]}
        for factor in (1, 4):
            group = [r for r in runs if r["shape"] == shape and r["factor"] == factor]
            cell = {}
            for arm in ARMS:
                mine = [r for r in group if r["arm"] == arm]
                cell[arm] = {
                    "wall_seconds_median": statistics.median(r["wall_seconds"] for r in mine),
                    "peak_rss_after_load_mb": max(r["peak_rss_after_load_mb"] for r in mine),
                }
            for arm, key in (
                (LEAN_ARM, "wall_ratio_lean_vs_stock"),
                (SLACK16_ARM, "wall_ratio_lean_slack16_vs_stock"),
            ):
                cell[key] = statistics.median(
                    a["wall_seconds"] / b["wall_seconds"]
                    for a in group
                    if a["arm"] == arm
                    for b in group
                    if b["arm"] == STOCK_ARM and b["repeat"] == a["repeat"]
                )
            scores = {json.dumps(without_speed(r["scores"]), sort_keys=True) for r in group}
            cell["scores_identical"] = len(scores) == 1
            row[f"{factor}x"] = cell
        for arm in ARMS:
            one, four = (row[f"{f}x"][arm]["peak_rss_after_load_mb"] for f in (1, 4))
            row[f"growth_1x_to_4x/{arm}"] = round(four / one - 1, 4)
        big = [r for r in runs if r["shape"] == shape and r["factor"] == 16]
        if big:
            peak = max(r["peak_rss_after_load_mb"] for r in big)
            four = row["4x"][LEAN_ARM]["peak_rss_after_load_mb"]
            row["16x"] = {
                LEAN_ARM: {
                    "peak_rss_after_load_mb": peak,
                    "wall_seconds_median": statistics.median(r["wall_seconds"] for r in big),
                },
                "scores_equal_to_1x": {
                    json.dumps(without_speed(r["scores"]), sort_keys=True) for r in big
                }
                == {
                    json.dumps(without_speed(r["scores"]), sort_keys=True)
                    for r in runs
                    if r["shape"] == shape and r["factor"] == 1
                },
            }
            row[f"growth_4x_to_16x/{LEAN_ARM}"] = round(peak / four - 1, 4)
            row[f"growth_1x_to_16x/{LEAN_ARM}"] = round(
                peak / row["1x"][LEAN_ARM]["peak_rss_after_load_mb"] - 1, 4
            )
        summary[shape] = row
    result = {
        "benchmark": "eval_shapes",
        "command": command_line(__file__),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(summary, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2), encoding="utf8")


if __name__ == "__main__":
    main()
