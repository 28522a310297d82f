"""Training on corpora shaped unlike our news-like docs: does `spacy lean train` keep its
peak memory flat in corpus and dev size, train as fast as `spacy train` and reach its dev
F, when the docs are tweets, CoNLL-style groups of sentences, or very long?

`benchmarks/train_memory.py` measures this on one generated news-like corpus; figures
taken on generated corpora have not always held on real ones. Here the news-like docs are
re-cut into `eval_shapes.py`'s three shapes (tweets: one sentence of at most 30 tokens
with a handle and most with a hashtag; conll: "-DOCSTART-" then 1-10 sentences; long:
8-16 news docs joined, thousands of tokens each), each handed over as one big .spacy file:
a training corpus of about --tokens tokens at 1x and 16x (and 64x, for `spacy lean train`
alone), a dev set of a third of that at 1x and 8x (generated from other seeds). Every run
is train_memory.py's: a fresh `python -m spacy train` (stock config
`configs/ner_trf_stock.cfg`) or
`python -m spacy lean train` (lean config `configs/ner_trf.cfg`), the same 2-layer
64-wide local BERT, 150 steps, a batch of 1,000 words, one evaluation at the end; runs
alternate stock / lean. Per shape: the 1x pair --repeats times (words/s between the first
and the last logged evaluation, per wall second, dev F), the 16x corpus and the 8x dev set
once each, and lean once on the 64x corpus (peak RSS growth: the lean config's reader holds
up to 1,000 examples to shuffle and its batcher 2,000 to sort, so its peak may grow until
the corpus fills both, and should stay flat from there: 16x -> 64x).

    nice -n 10 python benchmarks/train_shapes.py               # ~15 min on 2 cores
    python benchmarks/train_shapes.py --quick                  # smoke run, tiny sizes

Prints a JSON line per run and writes benchmarks/results/train_shapes.json: per shape,
each system's peak RSS by train and dev size, the growth, words/s, and dev F.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
from _report import command_line  # noqa: E402
from eval_shapes import SHAPES, make_shape, stats  # noqa: E402
from train_memory import _per_wall_s, _texts, run_one  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "train_shapes.json"
SYSTEMS = ("stock", "lean")


def make_data(root: Path, shape: str, tokens: int, quick: bool):
    """The shape's training corpus at 1x and 16x and its dev set at 1x and 8x, one .spacy
    file each; the 16x corpus starts with the 1x one (same generator and seed)."""
    from spacy.tokens import DocBin

    train_x, dev_x = (1, 16, 64), (1, 8)
    if quick:
        train_x, dev_x = (1, 2, 4), (1, 2)
    data, info = {}, {}
    for key, n_tokens, seed in [(f"train{f}", tokens * f, 11) for f in train_x] + [
        (f"dev{f}", tokens // 3 * f, 23) for f in dev_x
    ]:
        docs = make_shape(shape, n_tokens, seed=seed)
        data[key] = root / f"{shape}_{key}.spacy"
        DocBin(docs=docs).to_disk(data[key])
        info[key] = stats(docs)
    return data, info


def summarize(runs, info):
    summary = {}
    for shape in sorted({r["shape"] for r in runs}):
        row = {"data": info.get(shape, {})}
        for system in SYSTEMS:
            mine = [
                r
                for r in runs
                if r["shape"] == shape and r["system"] == system and not r.get("bounded")
            ]
            base = [r for r in mine if r["train"] == "train1" and r["dev"] == "dev1"]
            if not base:
                continue
            cell = {
                "runs_1x": len(base),
                "words_per_s_median": statistics.median(r["words_per_s"] for r in base),
                "words_per_wall_s_median": statistics.median(_per_wall_s(r) for r in base),
                "ents_f": [r["ents_f"] for r in base],
                "peak_rss_mb_by_train_size": {},
                "peak_rss_mb_by_dev_size": {},
            }
            for r in mine:
                if r["dev"] == "dev1":
                    old = cell["peak_rss_mb_by_train_size"].get(r["train"], 0)
                    cell["peak_rss_mb_by_train_size"][r["train"]] = max(old, r["peak_rss_mb"])
                if r["train"] == "train1":
                    old = cell["peak_rss_mb_by_dev_size"].get(r["dev"], 0)
                    cell["peak_rss_mb_by_dev_size"][r["dev"]] = max(old, r["peak_rss_mb"])
            for what, key in (
                ("train", "peak_rss_mb_by_train_size"),
                ("dev", "peak_rss_mb_by_dev_size"),
            ):
                sizes = sorted(cell[key], key=lambda k: int(k[len(what) :]))
                for first, last in zip(sizes, sizes[1:]):
                    cell[f"rss_growth_{what}_{first[len(what):]}x_to_{last[len(what):]}x"] = round(
                        cell[key][last] / cell[key][first] - 1, 4
                    )
            row[system] = cell
        bounded = {
            r["train"]: r["peak_rss_mb"] for r in runs if r["shape"] == shape and r.get("bounded")
        }
        if bounded:
            sizes = sorted(bounded, key=lambda k: int(k[5:]))
            row["lean_bounds100"] = {"peak_rss_mb_by_train_size": bounded}
            for first, last in zip(sizes, sizes[1:]):
                row["lean_bounds100"][f"rss_growth_train_{first[5:]}x_to_{last[5:]}x"] = round(
                    bounded[last] / bounded[first] - 1, 4
                )
        if "stock" in row and "lean" in row:
            pairs = [
                a["words_per_s"] / b["words_per_s"]
                for a in runs
                if a["shape"] == shape and a["system"] == "lean" and a.get("pair") is not None
                for b in runs
                if b["shape"] == shape and b["system"] == "stock" and b.get("pair") == a["pair"]
            ]
            row["lean_vs_stock_words_per_s_median"] = (
                round(statistics.median(pairs), 3) if pairs else None
            )
            row["lean_vs_stock_words_per_wall_s"] = round(
                row["lean"]["words_per_wall_s_median"] / row["stock"]["words_per_wall_s_median"], 3
            )
        summary[shape] = row
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokens", type=int, default=25_000, help="tokens in the 1x training corpus"
    )
    parser.add_argument("--repeats", type=int, default=2, help="stock/lean pairs on the 1x corpus")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--bounded",
        action="store_true",
        help="run only lean with the reader's shuffle_buffer and the batcher's window set to "
        "100 (below every 1x corpus) on the 1x, 16x and 64x corpora, merged into --output: "
        "the peak's growth with the corpus once both bounds hold from the start",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.steps = 1_500, 1, 4
    from spacy_lean import synthetic

    runs, info = [], {}
    if args.bounded:  # keep the earlier runs and data of --output, but their bounded ones
        old = json.loads(args.output.read_text())
        runs = [r for r in old["runs"] if not r.get("bounded")]
        args.merged_into = old["command"]
        info = {shape: row.get("data", {}) for shape, row in old["summary"].items()}
    opts = SimpleNamespace(
        steps=args.steps, batch_size=args.batch_size, threads=args.threads, gpu_id=-1
    )
    with tempfile.TemporaryDirectory(prefix="train_shapes_") as tmp_name:
        tmp = Path(tmp_name)
        for shape in args.shapes:
            data, shape_info = make_data(tmp, shape, args.tokens, args.quick)
            if not args.bounded:
                info[shape] = shape_info
            data["transformer"] = synthetic.make_tiny_transformer(
                tmp / f"tiny_bert_{shape}",
                _texts(data["train1"]),
                vocab_size=1000,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=256,
            )
            trains = sorted((k for k in data if k.startswith("train")), key=lambda k: int(k[5:]))
            big_dev = max((k for k in data if k.startswith("dev")), key=lambda k: int(k[3:]))
            jobs = [("train1", "dev1", rep, SYSTEMS) for rep in range(args.repeats)]
            jobs += [(trains[1], "dev1", None, SYSTEMS), ("train1", big_dev, None, SYSTEMS)]
            # The largest corpus: lean once, past its reader's shuffle buffer and its
            # batcher's window (stock's growth shows at 16x already).
            jobs += [(trains[2], "dev1", None, ("lean",))]
            tag = ""
            if args.bounded:
                jobs = [(train_key, "dev1", None, ("lean",)) for train_key in trains]
                tag = "-w100"  # train_memory.run_one: shuffle_buffer and window 100
            for i, (train_key, dev_key, pair, systems) in enumerate(jobs):
                for system in systems if i % 2 == 0 else systems[::-1]:
                    run = run_one(
                        system, tmp, data, train_key, dev_key, 0, opts, tag=f"{tag}-{shape}-{i}"
                    )
                    run.update(shape=shape, pair=pair, bounded=bool(tag))
                    runs.append(run)
                    print(json.dumps(run), flush=True)
                    save(args, runs, info)
    print(json.dumps(summarize(runs, info), indent=2))


def save(args, runs, info):
    result = {
        "benchmark": "train_shapes",
        # A --bounded run, merged into the results of an earlier one, appends itself to
        # the earlier command.
        "command": (
            f"{args.merged_into} (then {command_line(__file__)})"
            if hasattr(args, "merged_into")
            else command_line(__file__)
        ),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_end": os.getloadavg(),
        },
        "summary": summarize(runs, info),
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2), encoding="utf8")


if __name__ == "__main__":
    main()
