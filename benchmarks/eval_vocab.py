"""What the vocab costs a streaming evaluation, and what memory zones save: spaCy's
`Language.evaluate` (the examples listed, as `spacy evaluate` lists them) against
`spacy_lean.evaluate` without and with memory zones (`memory_zones=False` / the
default), each run in a fresh process, on dev sets at 1x, 4x and 16x one size, as
.jsonl and as .spacy.

The data look like real text where it matters here: generated NER docs
(`spacy_lean.synthetic`) whose plain words are drawn a fifth of the time from a
Zipf-distributed vocabulary of 200,000 words, and whose docs each end in a user
handle, a short URL and a number no other doc has (as tweets, forum posts and news
with figures do), so the number of distinct words grows with the size of the data.
The model: tok2vec (width 64, depth 2) + ner, trained briefly on other generated docs
(a CPU pipeline, where the reader's and tokenizer's share of the time is largest).

Per run: peak RSS after the model is loaded (the kernel's mark reset then), RSS held
at the end (after a collection and a heap trim), strings in the vocab before and
after, seconds, words/s, and the scores (the same in every arm: checked).

    nice -n 10 python benchmarks/eval_vocab.py [--tokens 75000] [--scales 1 4 16]
        [--arms stock lean_no_zones lean_zones] [--formats jsonl spacy] [--work-dir DIR]

Prints JSON and writes benchmarks/results/eval_vocab.json.
"""

import argparse
import gc
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _procmem import proc_status, reset_peak  # noqa: E402
from _report import command_line, print_and_save, work_folder  # noqa: E402

ARMS = ["stock", "lean_no_zones", "lean_zones"]
FORMATS = ["jsonl", "spacy"]
RESULT = Path(__file__).parent / "results" / "eval_vocab.json"


def _held() -> int:
    from spacy_lean.memory import trim_host_memory

    gc.collect()
    trim_host_memory()
    return proc_status("VmRSS")


def build_model(work: Path) -> Path:
    """A small tok2vec + ner pipeline, trained for a few steps (written once)."""
    path = work / "model"
    if (path / "meta.json").exists():
        return path
    import spacy
    from spacy.cli.init_config import init_config
    from spacy.training import Example
    from thinc.api import fix_random_seed

    from spacy_lean import synthetic

    fix_random_seed(0)
    config = init_config(lang="en", pipeline=["ner"], optimize="efficiency")
    config["components"]["tok2vec"]["model"]["encode"]["width"] = 64
    config["components"]["tok2vec"]["model"]["encode"]["depth"] = 2
    nlp = spacy.util.load_model_from_config(config, auto_fill=True)
    docs = synthetic.make_ner_docs(spacy.blank("en"), 120, seed=7)
    train = [Example(nlp.make_doc(d.text), d) for d in docs]
    optimizer = nlp.initialize(lambda: train)
    for _ in range(4):
        for start in range(0, len(train), 8):
            nlp.update(train[start : start + 8], sgd=optimizer)
    nlp.to_disk(path)
    return path


def make_records(n_tokens: int, seed: int):
    """Generated docs of about `n_tokens` tokens, as (text, entities) records."""
    import numpy
    import spacy

    from spacy_lean import synthetic

    nlp = spacy.blank("en")
    rng = random.Random(seed)
    zipf = numpy.random.default_rng(seed).zipf(1.3, size=4 * n_tokens)
    zipf = zipf[zipf <= 200_000]
    total, z, k = 0, 0, 0
    while total < n_tokens:
        doc = synthetic.make_ner_doc(nlp, rng)
        words, ents = [], []
        for token in doc:
            word = token.text
            if token.ent_iob_ == "O" and token.is_alpha and rng.random() < 0.2:
                word = f"w{int(zipf[z % len(zipf)])}"
                z += 1
            words.append(word)
        text, offsets = "", []
        for token, word in zip(doc, words):
            offsets.append(len(text))
            text += word + token.whitespace_
        for ent in doc.ents:
            start = offsets[ent.start]
            end = offsets[ent.end - 1] + len(words[ent.end - 1])
            ents.append([start, end, ent.label_])
        k += 1
        text += f" @user{seed}_{k} https://t.co/{seed:x}{k:06x} {rng.random() * 1000:.3f}"
        total += len(doc) + 3
        yield {"text": text, "entities": ents}


def make_data(work: Path, n_tokens: int) -> dict:
    """The dev set of about `n_tokens` tokens, as .jsonl and .spacy (written once)."""
    import spacy
    from spacy.tokens import DocBin

    from spacy_lean.corpus.jsonl import doc_from_record

    jsonl = work / f"dev_{n_tokens}.jsonl"
    binary = work / f"dev_{n_tokens}.spacy"
    if not binary.exists():
        nlp = spacy.blank("en")
        records = list(make_records(n_tokens, seed=n_tokens))
        tmp = jsonl.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf8")
        tmp.rename(jsonl)
        docs = [doc_from_record(nlp, r, where="generated") for r in records]
        DocBin(docs=docs).to_disk(binary.with_suffix(".tmp"))
        binary.with_suffix(".tmp").rename(binary)
    return {"jsonl": jsonl, "spacy": binary}


def child(arm: str, model: Path, data: Path) -> dict:
    """One evaluation, in this (fresh) process."""
    import spacy

    from spacy_lean import evaluate
    from spacy_lean.corpus import read_examples

    nlp = spacy.load(model)
    nlp(nlp.make_doc("warm up"))
    base = _held()
    strings_before = len(nlp.vocab.strings)
    peak_ok = reset_peak()
    start = time.perf_counter()
    if arm == "stock":
        scores = nlp.evaluate(list(read_examples(nlp, [data])))
    else:
        scores = evaluate(nlp, data, memory_zones=arm == "lean_zones")
    seconds = time.perf_counter() - start
    peak = proc_status("VmHWM") if peak_ok else None
    held = _held()
    return {
        "arm": arm,
        "seconds": round(seconds, 2),
        "words_per_s": round(scores["speed"], 1),
        "peak_rss_mb": round((peak - base) / 2**20, 1) if peak else None,
        "held_rss_mb": round((held - base) / 2**20, 1),
        "strings_before": strings_before,
        "strings_after": len(nlp.vocab.strings),
        "ents_f": scores["ents_f"],
        "ents_per_type": scores["ents_per_type"],
    }


def run_child(arm: str, model: Path, data: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", arm, str(model), str(data)],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=75_000)
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    parser.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--output", default=str(RESULT))
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        arm, model, data = args.child
        print(json.dumps(child(arm, Path(model), Path(data))))
        return
    with work_folder(args.work_dir, "eval_vocab_") as work:
        model = build_model(work)
        runs = []
        for scale in args.scales:
            files = make_data(work, args.tokens * scale)
            for fmt in args.formats:
                for arm in args.arms:
                    result = run_child(arm, model, files[fmt])
                    result.update(
                        scale=scale, format=fmt, file_mb=round(files[fmt].stat().st_size / 2**20, 1)
                    )
                    print(json.dumps(result), file=sys.stderr)
                    runs.append(result)
    summary = {}
    for fmt in args.formats:
        for arm in args.arms:
            mine = {r["scale"]: r for r in runs if r["format"] == fmt and r["arm"] == arm}
            lo, hi = min(mine), max(mine)
            stock = {r["scale"]: r for r in runs if r["format"] == fmt and r["arm"] == "stock"}
            summary[f"{fmt}/{arm}"] = {
                f"peak_growth_{lo}x_to_{hi}x": (
                    round(mine[hi]["peak_rss_mb"] / mine[lo]["peak_rss_mb"], 3)
                    if mine[lo]["peak_rss_mb"]
                    else None
                ),
                f"held_mb_{hi}x": mine[hi]["held_rss_mb"],
                f"new_strings_{hi}x": mine[hi]["strings_after"] - mine[hi]["strings_before"],
                f"time_vs_stock_{hi}x": (
                    round(mine[hi]["seconds"] / stock[hi]["seconds"], 3) if hi in stock else None
                ),
            }
    for fmt in args.formats:
        by = {}
        for r in runs:
            if r["format"] == fmt:
                by.setdefault(r["scale"], []).append(json.dumps(r["ents_per_type"], sort_keys=True))
        assert all(len(set(v)) == 1 for v in by.values()), f"{fmt}: the arms' scores differ"
    for r in runs:
        del r["ents_per_type"]  # checked equal above; ents_f stays
    report = {
        "command": command_line(__file__),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "summary": summary,
        "runs": runs,
    }
    print_and_save(report, args.output)


if __name__ == "__main__":
    main()
