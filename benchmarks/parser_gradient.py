"""Does `exact_parser_gradient` cost a dependency parser accuracy? `spacy lean train` of
a tok2vec + parser pipeline with the `spacy-lean.lean_training.v1` callback's
`exact_parser_gradient` on (the default: the `W` gradient without spaCy's term of the
batch's last token, see docs/training.md) and off (stock spaCy's gradient, the same
weights as `spacy train`), over several seeds, on a generated treebank: sentences of a
small grammar (determiners, adjectives, subject, verb, object, prepositional phrases
whose attachment to the verb or the object depends on the preposition, with 10% of
them attached the other way; coordinated clauses), words drawn from made-up
lexicons, with a fifth of the dev set's nouns and adjectives unseen in training.
Prints JSON with the dev UAS/LAS per run and the mean and spread per arm, and writes
benchmarks/results/parser_gradient.json.

    python benchmarks/parser_gradient.py [--seeds 3] [--steps 100,400] [--train-docs 800]
        [--dev-docs 300] [--jobs 2] [--work-dir DIR]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _report import command_line, work_folder  # noqa: E402

ARMS = {"exact": True, "stock_gradient": False}
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "tu",
    "sa",
    "vor",
    "el",
    "nii",
    "pa",
    "dru",
    "om",
    "zet",
    "qui",
]


def lexicon(rng: random.Random, n: int, suffix: str) -> List[str]:
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) + suffix)
    return sorted(words)


class Grammar:
    """Made-up lexicons and the grammar's sentences as (words, heads, deps)."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.nouns = lexicon(rng, 400, "")
        self.adjs = lexicon(rng, 120, "ish")
        self.verbs = lexicon(rng, 150, "ed")
        self.unseen_nouns = [w + "o" for w in lexicon(random.Random(seed + 1), 100, "")]
        self.unseen_adjs = [w + "ic" for w in lexicon(random.Random(seed + 2), 40, "")]
        self.dets = ["the", "a", "this", "every", "some"]
        self.verb_preps = ["during", "after", "before", "despite"]  # attach to the verb
        self.noun_preps = ["of", "with", "near", "beside"]  # attach to the object

    def noun_phrase(
        self, rng, unseen: bool, start: int
    ) -> Tuple[List[str], List[int], List[str], int]:
        """Words, heads (absolute, within the sentence), deps; RETURNS also the noun's index."""
        nouns = self.unseen_nouns if unseen and rng.random() < 0.2 else self.nouns
        adjs = self.unseen_adjs if unseen and rng.random() < 0.2 else self.adjs
        words = [rng.choice(self.dets)] + [
            rng.choice(adjs) for _ in range(rng.choice([0, 0, 1, 2]))
        ]
        words.append(rng.choice(nouns))
        head = start + len(words) - 1
        heads = [head] * (len(words) - 1) + [-1]
        deps = ["det"] + ["amod"] * (len(words) - 2) + [""]
        return words, heads, deps, head

    def clause(self, rng, unseen: bool, start: int):
        words: List[str] = []
        heads: List[int] = []
        deps: List[str] = []

        def phrase() -> int:
            """Add a noun phrase; RETURNS its noun's index in the clause."""
            w, h, d, noun = self.noun_phrase(rng, unseen, start + len(words))
            words.extend(w)
            heads.extend(h)
            deps.extend(d)
            return noun - start

        def attach(i: int, head: int, dep: str) -> None:
            heads[i], deps[i] = head, dep

        subj = phrase()
        verb = start + len(words)
        attach(subj, verb, "nsubj")
        words.append(rng.choice(self.verbs))
        heads.append(-1)
        deps.append("")
        obj = phrase()
        attach(obj, verb, "obj")
        if rng.random() < 0.6:
            to_verb = rng.random() < 0.5
            prep = rng.choice(self.verb_preps if to_verb else self.noun_preps)
            if rng.random() < 0.1:  # attached the other way: noise
                to_verb = not to_verb
            p = start + len(words)
            words.append(prep)
            heads.append(verb if to_verb else start + obj)
            deps.append("prep")
            attach(phrase(), p, "pobj")
        return words, heads, deps, verb

    def sentence(self, rng, unseen: bool):
        words, heads, deps, root = self.clause(rng, unseen, 0)
        deps[root] = "ROOT"
        heads[root] = root
        if rng.random() < 0.3:
            words.append("and")
            heads.append(-1)
            deps.append("cc")
            w, h, d, verb = self.clause(rng, unseen, len(words))
            heads[-1] = verb
            words += w
            heads += h
            deps += d
            heads[verb], deps[verb] = root, "conj"
        words.append(".")
        heads.append(root)
        deps.append("punct")
        return words, heads, deps


def write_treebank(path: Path, grammar: Grammar, n_docs: int, seed: int, unseen: bool) -> None:
    import spacy
    from spacy.tokens import Doc, DocBin

    rng = random.Random(seed)
    vocab = spacy.blank("en").vocab
    docs = []
    for _ in range(n_docs):
        words, heads, deps = [], [], []
        for _ in range(rng.randint(1, 4)):
            w, h, d = grammar.sentence(rng, unseen)
            heads += [len(words) + x for x in h]
            words += w
            deps += d
        docs.append(Doc(vocab, words=words, heads=heads, deps=deps))
    DocBin(docs=docs).to_disk(path)


def write_config(path: Path, train: Path, dev: Path) -> None:
    from spacy.cli.init_config import init_config

    config = init_config(lang="en", pipeline=["parser"], optimize="efficiency")
    config["paths"]["train"] = str(train)
    config["paths"]["dev"] = str(dev)
    config["components"]["tok2vec"]["model"]["encode"]["width"] = 64
    config["training"].update(patience=0, max_epochs=0)
    config["nlp"]["after_pipeline_creation"] = {
        "@callbacks": "spacy-lean.lean_training.v1",
        "exact_parser_gradient": True,
    }
    config.to_disk(path)


def run_one(work: Path, arm: str, seed: int, steps: int) -> Dict:
    out = work / f"{arm}-{seed}-{steps}"
    cmd = [
        sys.executable, "-m", "spacy", "lean", "train", str(work / "config.cfg"),
        "--output", str(out), "--training.seed", str(seed), "--training.max_steps", str(steps),
        "--training.eval_frequency", str(steps),
        "--nlp.after_pipeline_creation.exact_parser_gradient", str(ARMS[arm]).lower(),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode:
        raise RuntimeError(
            f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    meta = json.loads((out / "model-last" / "meta.json").read_text(encoding="utf8"))
    scores = meta["performance"]
    return {
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "dep_uas": scores["dep_uas"],
        "dep_las": scores["dep_las"],
        "seconds": round(time.perf_counter() - started, 1),
    }


def summary(runs: List[Dict]) -> Dict:
    """Per step count: each arm's mean, min and max UAS/LAS, and the LAS difference."""
    out: Dict[str, Dict] = {}
    for steps in sorted({r["steps"] for r in runs}):
        at = out[f"{steps}_steps"] = {}
        for arm in ARMS:
            mine = [r for r in runs if r["arm"] == arm and r["steps"] == steps]
            at[arm] = {
                key: {
                    "mean": round(statistics.mean(r[key] for r in mine), 4),
                    "min": round(min(r[key] for r in mine), 4),
                    "max": round(max(r[key] for r in mine), 4),
                }
                for key in ("dep_uas", "dep_las")
            }
        at["las_exact_minus_stock"] = round(
            at["exact"]["dep_las"]["mean"] - at["stock_gradient"]["dep_las"]["mean"], 4
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", default="100,400", help="comma-separated step counts")
    parser.add_argument("--train-docs", type=int, default=800)
    parser.add_argument("--dev-docs", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument(
        "--output", default=str(ROOT / "benchmarks" / "results" / "parser_gradient.json")
    )
    args = parser.parse_args()
    with work_folder(args.work_dir, "parser_gradient-") as work:
        grammar = Grammar(0)
        write_treebank(work / "train.spacy", grammar, args.train_docs, seed=1, unseen=False)
        write_treebank(work / "dev.spacy", grammar, args.dev_docs, seed=2, unseen=True)
        write_config(work / "config.cfg", work / "train.spacy", work / "dev.spacy")
        steps = [int(n) for n in args.steps.split(",")]
        jobs = [(arm, seed, n) for n in steps for seed in range(args.seeds) for arm in ARMS]
        with ThreadPoolExecutor(args.jobs) as pool:
            runs = list(pool.map(lambda job: run_one(work, *job), jobs))
    report = {
        "benchmark": "parser_gradient",
        "command": command_line(__file__),
        "settings": vars(args),
        "runs": runs,
        "summary": summary(runs),
    }
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.output).write_text(text + "\n", encoding="utf8")


if __name__ == "__main__":
    main()
