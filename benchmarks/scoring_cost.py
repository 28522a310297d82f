"""Cost of scoring: spaCy's `Scorer(nlp).score(examples)` against spacy-lean's
mergeable states (`make_pipeline_state(nlp)`, `update`, `result`) on the same
processed examples, measured interleaved in one run, whole pipeline and per
component. Also checks that both give the same scores and reports the size of the
saved state. Prints JSON and writes benchmarks/results/scoring_cost.json.

    python benchmarks/scoring_cost.py [--quick] [--n-docs N] [--repeats R]
"""

import argparse
import statistics
import time
import warnings
from pathlib import Path

import spacy
import srsly
from spacy.scorer import Scorer
from spacy.tokens import Doc
from spacy.training import Example

from spacy_lean.scoring import make_pipeline_state
from spacy_lean.scoring.gold import build_scoring_pipeline, make_scoring_docs

from _report import command_line, print_and_save  # noqa: E402  (benchmarks/_report.py)


def _time(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _sum_without(per_component, skip):
    s = sum(v["spacy_s"] for k, v in per_component.items() if k != skip)
    l_ = sum(v["lean_s"] for k, v in per_component.items() if k != skip)
    return {"spacy_s": round(s, 4), "lean_s": round(l_, 4), "lean_over_spacy": round(l_ / s, 3)}


def _run_setting(nlp, gold, repeats):
    docs = nlp.pipe([nlp.make_doc(d.text) for d in gold], batch_size=64)
    examples = [Example(doc, ref) for doc, ref in zip(docs, gold)]
    n_tokens = sum(len(eg.predicted) for eg in examples)

    def lean_score():
        state = make_pipeline_state(nlp)
        state.update(examples)
        return state

    expected = Scorer(nlp).score(examples)
    state = lean_score()
    got = state.result()
    got.pop("speed")
    same = srsly.json_dumps(expected, sort_keys=False) == srsly.json_dumps(got, sort_keys=False)
    spacy_t, lean_t = [], []
    for _ in range(repeats):
        spacy_t.append(_time(lambda: Scorer(nlp).score(examples)))
        lean_t.append(_time(lambda: lean_score().result()))
    per_component = {}
    for name, _ in make_pipeline_state(nlp).states:
        comp = nlp.tokenizer if name == "tokenizer" else nlp.get_pipe(name)
        s_t, l_t = [], []
        fresh = [dict(make_pipeline_state(nlp).states)[name] for _ in range(repeats)]
        for i in range(repeats):
            s_t.append(_time(lambda: comp.score(examples)))

            def lean_one(one=fresh[i]):
                one.update(examples)
                one.result()

            l_t.append(_time(lean_one))
        s, l_ = statistics.median(s_t), statistics.median(l_t)
        per_component[name] = {
            "spacy_s": round(s, 4),
            "lean_s": round(l_, 4),
            "lean_over_spacy": round(l_ / s, 3) if s else None,
        }
    s, l_ = statistics.median(spacy_t), statistics.median(lean_t)
    return {
        "n_docs": len(examples),
        "tokens_per_doc": round(n_tokens / max(1, len(examples)), 1),
        "n_tokens": n_tokens,
        "same_scores_as_spacy": same,
        "whole_pipeline": {
            "spacy_s": round(s, 4),
            "lean_s": round(l_, 4),
            "lean_over_spacy": round(l_ / s, 3),
        },
        "sum_of_components_without_entity_linker": _sum_without(per_component, "entity_linker"),
        "per_component": per_component,
        "state_json_bytes": len(srsly.json_dumps(state.to_dict())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--n-docs", type=int, default=None, help="dev docs (default 1000)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per side")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    default_out = Path(__file__).parent / "results" / "scoring_cost.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    n_docs = args.n_docs or (100 if args.quick else 1000)
    repeats = args.repeats or (3 if args.quick else 5)
    try:
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:  # pragma: no cover
        pass

    nlp = spacy.blank("en")
    nlp = build_scoring_pipeline(nlp, make_scoring_docs(nlp, 60, seed=1), n_steps=15)
    settings = []
    for merge in (1, 10):  # short docs (~14 tokens) and long docs (~140 tokens)
        gold = make_scoring_docs(nlp, n_docs, seed=2)
        gold = [Doc.from_docs(gold[i : i + merge]) for i in range(0, len(gold), merge)]
        settings.append(_run_setting(nlp, gold, repeats))
    result = {
        "benchmark": "scoring_cost",
        "command": command_line(__file__),
        "repeats": repeats,
        "pipeline": nlp.pipe_names,
        "settings": settings,
        "note": "median seconds over interleaved repeats; entity_linker (use_gold_ents) "
        "re-runs the linker on copies inside scoring on both sides.",
    }
    print_and_save(result, args.out)


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)
        main()
