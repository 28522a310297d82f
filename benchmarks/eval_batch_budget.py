"""What the streaming evaluator's batching costs in speed. In one process, on the same
examples: spaCy's `nlp.evaluate` against `spacy_lean.evaluate` with token budgets
(`max_batch_tokens`) of 4096 (the default: the transformer's `max_batch_items`), 2048,
1024 and 512, and at 4096 without the length-sorted span groups (`sort_spans=False`),
for the 2x64 ("small") and 4x256 ("base") BERT + ner pipelines of
benchmarks/eval_memory.py. Per arm: wall seconds (median of the repeats, arms
interleaved with the order reversed every repeat), transformer forward calls and the
wordpieces the Hugging Face model ran (rows x padded length, from a forward pre-hook)
against the real ones (its attention mask), so the wordpiece padding each batching
costs is measured, not estimated. Scores must be identical in every arm.

    nice -n 10 python benchmarks/eval_batch_budget.py [--docs 300] [--repeats 3]
        [--work-dir DIR] [--threads 2]

Prints JSON and writes benchmarks/results/eval_batch_budget.json. Models and data go to
--work-dir (kept, and reused by later runs) or to a temporary folder removed at the end.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _report import command_line, work_folder  # noqa: E402
from eval_memory import build_data, build_model  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "eval_batch_budget.json"
BUDGETS = (4096, 2048, 1024, 512)


def hf_model(nlp):
    return nlp.get_pipe("transformer").model.layers[0].shims[0]._hfmodel.transformer


def measure(kind: str, model: Path, data: Path, repeats: int, threads: int) -> dict:
    import spacy
    import torch
    from spacy.tokens import DocBin
    from spacy.training import Example

    import spacy_lean

    torch.set_num_threads(threads)
    nlp = spacy.load(model)
    gold = list(DocBin().from_disk(data).get_docs(nlp.vocab))
    counts = {"calls": 0, "run": 0, "real": 0}

    def hook(module, args, kwargs):
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is None and args:
            ids = args[0]
        counts["calls"] += 1
        counts["run"] += int(ids.shape[0] * ids.shape[1])
        counts["real"] += int(mask.sum()) if mask is not None else int(ids.numel())

    hf_model(nlp).register_forward_pre_hook(hook, with_kwargs=True)
    arms = ["stock", "unsorted_4096"] + [str(b) for b in BUDGETS]
    rows = {arm: {"seconds": []} for arm in arms}
    scores = {}
    for rep in range(repeats):
        for arm in arms if rep % 2 == 0 else arms[::-1]:
            examples = [Example(nlp.make_doc(d.text), d) for d in gold]
            counts.update(calls=0, run=0, real=0)
            start = time.perf_counter()
            if arm == "stock":
                result = nlp.evaluate(examples)
            else:
                budget = int(arm.split("_")[-1])
                result = spacy_lean.evaluate(
                    nlp,
                    examples,
                    max_batch_tokens=budget,
                    sort_spans=not arm.startswith("unsorted"),
                )
            rows[arm]["seconds"].append(round(time.perf_counter() - start, 3))
            rows[arm].update(
                forward_calls=counts["calls"],
                wordpieces_run=counts["run"],
                wordpieces_real=counts["real"],
            )
            scores[arm] = {k: v for k, v in result.items() if k not in ("speed",)}
    stock_s = statistics.median(rows["stock"]["seconds"])
    for arm, row in rows.items():
        row["seconds_median"] = statistics.median(row["seconds"])
        row["ratio_vs_stock"] = round(row["seconds_median"] / stock_s, 3)
        row["wordpiece_padding_fraction"] = round(
            1 - row["wordpieces_real"] / row["wordpieces_run"], 4
        )
    return {
        "docs": len(gold),
        "tokens": sum(len(d) for d in gold),
        "max_batch_items": nlp.get_pipe("transformer").cfg["max_batch_items"],
        "nlp_batch_size": nlp.batch_size,
        "arms": rows,
        "scores_identical": all(s == scores["stock"] for s in scores.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["small", "base"])
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    load = os.getloadavg()
    with work_folder(args.work_dir, "eval_batch_budget_") as work:
        data = build_data(work, args.docs, [args.docs])["file"][args.docs]
        results = {
            kind: measure(kind, build_model(work, kind), data, args.repeats, args.threads)
            for kind in args.models
        }
    report = {
        "benchmark": "eval_batch_budget",
        "command": command_line(__file__),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "torch_threads": args.threads,
            "load_avg_at_start": load,
            "load_avg_at_end": os.getloadavg(),
        },
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: {
                    a: {
                        f: r[f]
                        for f in (
                            "seconds_median",
                            "ratio_vs_stock",
                            "forward_calls",
                            "wordpiece_padding_fraction",
                        )
                    }
                    for a, r in v["arms"].items()
                }
                for k, v in results.items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
