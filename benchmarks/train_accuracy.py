"""Does the lean training config cost accuracy? Dev ents_f of `spacy train` with the
stock config (configs/ner_trf_stock.cfg), with the stock config and one spacy-lean
part swapped in at a time, and with the full lean config (configs/ner_trf.cfg), over
several seeds, on a generated news-like corpus (`spacy_lean.synthetic_news`) and a
tiny local BERT (2 layers, 64 wide). Also what the steps are made of: real tokens,
padded tokens and examples per step, from the configured reader and batcher run over
the corpus without training (spaCy's own `create_train_batches`, as `spacy train`).
Prints JSON and writes benchmarks/results/train_accuracy.json after every run, so
partial results survive.

    python benchmarks/train_accuracy.py [--quick] [--seeds 5] [--steps 250] [--jobs 2]
        [--variants stock,lean,...] [--tiers stock,lean/lean_per_batch_cap,...]
        [--resume] [--data-dir DIR]

Runs are interleaved seed-major (seed 0 of every variant, then seed 1, ...), at most
--jobs at once, each with OMP_NUM_THREADS=1, so machine load affects every variant
alike. With --tiers, the variants of the first tier (separated by "/") run for every
seed before the second tier starts, and so on, so that on a busy machine the
comparison that matters most completes first. --resume keeps the runs already in the
output file (same settings) and runs only the missing ones. Every run evaluates
once, at its last step. Peak RSS (per run, from wait4) and CPU seconds are recorded,
with the load average.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
sys.path.insert(0, str(ROOT / "benchmarks"))
from _report import command_line  # noqa: E402

# One spaCy-lean part at a time, on top of the stock config; then the full lean config.
# The shuffle buffer is scaled to the corpus (about a fifth of its pieces, read in
# shards in a shuffled order), as 1,000 is to a corpus of 5,000 docs; "full" holds all.
SCALED_BUFFER = 100
VARIANTS: Dict[str, str] = {
    "stock": "configs/ner_trf_stock.cfg as it is",
    "reader": "spacy-lean.Corpus.v1 for train (max_length 256, bounded shuffle), streamed",
    "reader_no_split": "spacy-lean.Corpus.v1, max_length 0 (whole docs), bounded shuffle",
    "reader_full_shuffle": "spacy-lean.Corpus.v1, max_length 256, shuffle buffer > corpus",
    "batcher_per_batch_cap": "batch_by_tokens.v1 with padding_scope 'batch' (the old default)",
    "batcher": "spacy-lean.batch_by_tokens.v1 with the defaults of configs/ner_trf.cfg",
    "streaming_eval": "spacy-lean.streaming_evaluate.v1 for the dev evaluation",
    "lean_cleaner": "lean_cleaner added at the end of the pipeline",
    "lean_per_batch_cap": "lean_cut_100 with padding_scope 'batch' (the old default)",
    "lean": "configs/ner_trf.cfg as it is (the ner's update_with_oracle_cut_size 32)",
    "lean_cut_100": "configs/ner_trf.cfg with the ner's update_with_oracle_cut_size at spaCy's "
    "100 (the lean config before issue #10's speed work): the parser's training cuts each "
    "transition sequence into pieces of 50-200 moves instead of 16-64",
    "lean_cut_50": "configs/ner_trf.cfg with update_with_oracle_cut_size 50 (25-100 moves)",
    "lean_size_0.75": "lean_cut_100 with batcher size 0.75 x --batch-size: about as many real "
    "tokens per step as stock",
    "lean_update": "lean_cut_100 with the spacy-lean.lean_training.v1 callback "
    "(exact_parser_gradient on, no ceiling: what it changes is the ner weight gradient)",
    "lean_update_spacy_grad": "lean_cut_100 with spacy-lean.lean_training.v1, "
    "exact_parser_gradient off (should train as 'lean_cut_100')",
    "lean_max_length_128": "lean_cut_100 with the train reader's max_length 128 (shorter "
    "pieces: fewer sequential ner parser steps per batch)",
    "stock_cut_50": "configs/ner_trf_stock.cfg with the ner's update_with_oracle_cut_size 50: "
    "what the same setting does for stock",
}
# Lean variants measured with the ner's oracle cut at spaCy's 100, as the lean config
# had it when they were added: what each changes is compared with lean_cut_100.
CUT_100 = (
    "lean_per_batch_cap",
    "lean_size_0.75",
    "lean_update",
    "lean_update_spacy_grad",
    "lean_max_length_128",
)
# Batcher size of a variant, as a share of --batch-size.
SIZE_SHARE = {"lean_size_0.75": 0.75}


def load_cfg(name: str):
    from thinc.api import Config

    return Config().from_disk(CONFIGS / name, interpolate=False)


def variant_config(name: str):
    """The config of a variant (not interpolated: ${...} references stay)."""
    import copy

    stock, lean = load_cfg("ner_trf_stock.cfg"), load_cfg("ner_trf.cfg")
    cfg = copy.deepcopy(lean if name.startswith("lean") and name != "lean_cleaner" else stock)
    if name.startswith("reader"):
        cfg["corpora"]["train"] = copy.deepcopy(lean["corpora"]["train"])
        cfg["corpora"]["train"]["shuffle_buffer"] = SCALED_BUFFER
        cfg["training"]["max_epochs"] = -1
        if name == "reader_no_split":
            cfg["corpora"]["train"]["max_length"] = 0
        if name == "reader_full_shuffle":
            cfg["corpora"]["train"]["shuffle_buffer"] = 1_000_000
    elif name.startswith("batcher"):
        cfg["training"]["batcher"] = copy.deepcopy(lean["training"]["batcher"])
    elif name == "streaming_eval":
        cfg["nlp"]["after_pipeline_creation"] = copy.deepcopy(
            lean["nlp"]["after_pipeline_creation"]
        )
        cfg["training"]["before_to_disk"] = copy.deepcopy(lean["training"]["before_to_disk"])
    elif name == "lean_cleaner":
        cfg["nlp"]["pipeline"] = list(cfg["nlp"]["pipeline"]) + ["lean_cleaner"]
        cfg["components"]["lean_cleaner"] = copy.deepcopy(lean["components"]["lean_cleaner"])
    if name.startswith("lean_update"):
        cfg["nlp"]["after_pipeline_creation"] = {
            "@callbacks": "spacy-lean.lean_training.v1",
            "exact_parser_gradient": name == "lean_update",
        }
    if name == "lean_max_length_128":
        cfg["corpora"]["train"]["max_length"] = 128
    if "_cut_" in name:
        cfg["components"]["ner"]["update_with_oracle_cut_size"] = int(name.rsplit("_", 1)[1])
    elif name in CUT_100:
        cfg["components"]["ner"]["update_with_oracle_cut_size"] = 100
    if name.endswith("per_batch_cap"):
        cfg["training"]["batcher"]["padding_scope"] = "batch"
    return cfg


def overrides(args, paths: Dict[str, Path], seed: int, name: str) -> Dict[str, Any]:
    return {
        "paths.train": str(paths["train"]),
        "paths.dev": str(paths["dev"]),
        "paths.transformer": str(paths["transformer"]),
        "system.seed": seed,
        "training.max_steps": args.steps,
        "training.eval_frequency": args.steps,
        "training.optimizer.learn_rate.initial_rate": args.learn_rate,
        "training.optimizer.learn_rate.warmup_steps": args.warmup,
        "training.batcher.size": int(round(args.batch_size * SIZE_SHARE.get(name, 1.0))),
    }


def make_data(args) -> Dict[str, Path]:
    """Train shards, a dev file and a tiny BERT (made once per settings, reused)."""
    import spacy
    from spacy.tokens import DocBin

    from spacy_lean.synthetic import make_tiny_transformer
    from spacy_lean.synthetic_news import corpus_stats, make_news_docs

    root = Path(args.data_dir) / f"news_{args.train_docs}_{args.dev_docs}"
    paths = {"train": root / "train", "dev": root / "dev.spacy", "transformer": root / "bert"}
    done = root / "stats.json"
    if done.exists():
        return paths
    nlp = spacy.blank("en")
    train = make_news_docs(nlp, args.train_docs, seed=1)
    dev = make_news_docs(nlp, args.dev_docs, seed=2)
    paths["train"].mkdir(parents=True, exist_ok=True)
    for i in range(0, len(train), args.docs_per_shard):
        part = train[i : i + args.docs_per_shard]
        DocBin(docs=part, store_user_data=True).to_disk(paths["train"] / f"{i:06d}.spacy")
    DocBin(docs=dev, store_user_data=True).to_disk(paths["dev"])
    make_tiny_transformer(
        paths["transformer"],
        (d.text for d in train),
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
    )
    seen = {e.text for d in train for e in d.ents}
    dev_ents = [e.text for d in dev for e in d.ents]
    stats = {"train": corpus_stats(train), "dev": corpus_stats(dev)}
    stats["dev"]["entities_unseen_in_train"] = round(
        sum(t not in seen for t in dev_ents) / max(1, len(dev_ents)), 3
    )
    done.write_text(json.dumps(stats, indent=2))
    return paths


def step_stats(name: str, args, paths: Dict[str, Path], seed: int = 0) -> Dict[str, Any]:
    """Real tokens, padded tokens and examples per step over the run's steps, from the
    variant's train corpus and batcher, batched as `spacy train` batches them."""
    import spacy
    from spacy.training.loop import create_train_batches
    from spacy.util import fix_random_seed, registry

    cfg = variant_config(name)
    for key, value in overrides(args, paths, seed, name).items():
        section, *rest = key.split(".")
        node = cfg[section]
        for part in rest[:-1]:
            node = node[part]
        node[rest[-1]] = value
    cfg = cfg.interpolate()
    nlp = spacy.blank("en")
    fix_random_seed(seed)
    parts = registry.resolve(
        {"corpus": cfg["corpora"]["train"], "batcher": cfg["training"]["batcher"]},
        validate=False,
    )
    real: List[int] = []
    padded: List[int] = []
    count: List[int] = []
    batches = create_train_batches(
        nlp, parts["corpus"], parts["batcher"], cfg["training"]["max_epochs"]
    )
    for _, batch in batches:
        lengths = [len(eg) for eg in batch]
        real.append(sum(lengths))
        padded.append(max(lengths) * len(lengths))
        count.append(len(lengths))
        if len(real) >= args.steps:
            break

    def summary(xs: List[int]) -> Dict[str, float]:
        xs_sorted = sorted(xs)
        return {
            "mean": round(statistics.mean(xs), 1),
            "p10": xs_sorted[len(xs) // 10],
            "p50": xs_sorted[len(xs) // 2],
            "min": xs_sorted[0],
            "max": xs_sorted[-1],
        }

    return {
        "steps": len(real),
        "real_tokens_per_step": summary(real),
        "padded_tokens_per_step": summary(padded),
        "examples_per_step": summary(count),
        "padding_fraction": round(1 - sum(real) / sum(padded), 4),
        "real_tokens_total": sum(real),
    }


def train_once(name: str, seed: int, args, paths: Dict[str, Path], work: Path) -> Dict[str, Any]:
    """One `spacy train` in a child process; dev scores of its last step."""
    cfg_path = work / f"{name}.cfg"
    out = work / f"{name}-seed{seed}"
    cmd = [sys.executable, "-m", "spacy", "train", str(cfg_path), "--output", str(out)]
    for key, value in overrides(args, paths, seed, name).items():
        cmd += [f"--{key}", str(value)]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    log = (work / f"{name}-seed{seed}.log").open("w")
    start = time.time()
    load = os.getloadavg()[0]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=lambda: os.nice(args.nice)
    )
    _, status, usage = os.wait4(proc.pid, 0)
    log.close()
    result: Dict[str, Any] = {
        "variant": name,
        "seed": seed,
        "wall_seconds": round(time.time() - start, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "loadavg_1min_at_start": round(load, 2),
        "exit_status": os.waitstatus_to_exitcode(status),
    }
    meta = out / "model-last" / "meta.json"
    if result["exit_status"] == 0 and meta.exists():
        perf = json.loads(meta.read_text())["performance"]
        result.update({k: perf.get(k) for k in ("ents_f", "ents_p", "ents_r")})
    else:
        result["error"] = (work / f"{name}-seed{seed}.log").read_text()[-2000:]
    return result


def eval_check(model: Path, dev: Path) -> Dict[str, Any]:
    """Dev scores of one trained pipeline evaluated three ways: spaCy's
    `Language.evaluate`, spacy-lean's streaming evaluation, and spaCy's with
    lean_cleaner added at the end of the pipeline. Neither part takes part in the
    weight updates, so equal scores here mean they cannot change dev F except through
    run-to-run noise."""
    import spacy
    from spacy.training import Corpus

    from spacy_lean.streaming import install_streaming_evaluate

    keys = ("ents_f", "ents_p", "ents_r")
    out: Dict[str, Any] = {"model": str(model)}
    nlp = spacy.load(model)
    out["stock_evaluate"] = {k: nlp.evaluate(Corpus(dev)(nlp))[k] for k in keys}
    install_streaming_evaluate(nlp)
    out["streaming_evaluate"] = {k: nlp.evaluate(Corpus(dev)(nlp))[k] for k in keys}
    nlp = spacy.load(model)
    nlp.add_pipe("lean_cleaner", last=True)
    out["stock_evaluate_with_lean_cleaner"] = {k: nlp.evaluate(Corpus(dev)(nlp))[k] for k in keys}
    out["identical"] = (
        out["stock_evaluate"]
        == out["streaming_evaluate"]
        == out["stock_evaluate_with_lean_cleaner"]
    )
    return out


def summarise(runs: List[Dict[str, Any]], names: List[str]) -> Dict[str, Any]:
    table: Dict[str, Any] = {}
    stock = [r["ents_f"] for r in runs if r["variant"] == "stock" and r.get("ents_f") is not None]
    for name in names:
        fs = [
            r["ents_f"] * 100 for r in runs if r["variant"] == name and r.get("ents_f") is not None
        ]
        if not fs:
            continue
        row = {
            "n": len(fs),
            "mean": round(statistics.mean(fs), 2),
            "std": round(statistics.stdev(fs), 2) if len(fs) > 1 else None,
            "min": round(min(fs), 2),
            "max": round(max(fs), 2),
            "per_seed": {
                r["seed"]: round(r["ents_f"] * 100, 2)
                for r in runs
                if r["variant"] == name and r.get("ents_f") is not None
            },
            "peak_rss_mb_median": statistics.median(
                r["peak_rss_mb"] for r in runs if r["variant"] == name
            ),
            "cpu_seconds_median": statistics.median(
                r["cpu_seconds"] for r in runs if r["variant"] == name
            ),
        }
        if stock:
            lo = min(stock) * 100
            row["mean_within_or_above_stock_spread"] = row["mean"] >= lo
            row["mean_minus_stock_mean"] = round(row["mean"] - statistics.mean(stock) * 100, 2)
        table[name] = row
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, 40 steps, small corpus")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--jobs", type=int, default=2, help="trainings at once")
    parser.add_argument("--train-docs", type=int, default=380)
    parser.add_argument("--dev-docs", type=int, default=80)
    parser.add_argument("--docs-per-shard", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument("--learn-rate", type=float, default=0.001)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tiers", default=None, help="variants in run order, tiers split by /")
    parser.add_argument("--resume", action="store_true", help="keep runs already in --out")
    parser.add_argument(
        "--eval-check-only",
        action="store_true",
        help="only evaluate the stock seed-0 pipeline three ways (eval_check)",
    )
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument("--data-dir", default="/tmp/spacy_lean_train_accuracy")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "train_accuracy.json")
    )
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.warmup, args.train_docs, args.dev_docs = 2, 40, 5, 60, 20
    tiers = [
        [n.strip() for n in t.split(",") if n.strip()]
        for t in (args.tiers or args.variants).split("/")
    ]
    names = [n for tier in tiers for n in tier]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    paths = make_data(args)
    work = Path(args.data_dir) / "runs"
    work.mkdir(parents=True, exist_ok=True)
    if args.eval_check_only:  # into the results of an earlier (finished) run
        check = eval_check(work / "stock-seed0" / "model-last", paths["dev"])
        print(json.dumps(check, indent=2))
        recorded = json.loads(Path(args.out).read_text())
        recorded["eval_check"] = check
        Path(args.out).write_text(json.dumps(recorded, indent=2) + "\n")
        return
    for name in names:
        variant_config(name).to_disk(work / f"{name}.cfg", interpolate=False)
    result: Dict[str, Any] = {
        "command": command_line(__file__),
        "summary": {},  # first, so benchmarks/plot.py draws it
        "variants": {n: VARIANTS[n] for n in names},
        "corpus": json.loads((paths["train"].parent / "stats.json").read_text()),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "steps": {},
        "runs": [],
    }
    lock = threading.Lock()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["summary"] = summarise(result["runs"], names)
        out.write_text(json.dumps(result, indent=2) + "\n")

    settings = {k: v for k, v in vars(args).items() if k not in ("out", "resume")}
    result["settings"] = settings
    if args.resume and out.exists():
        old = json.loads(out.read_text())
        # Runs are keyed by variant; how many run at once and their niceness change no score.
        free = ("tiers", "variants", "eval_check_only", "jobs", "nice")
        same = {k: v for k, v in old["settings"].items() if k not in free}
        if same == {k: v for k, v in settings.items() if k not in free}:
            # Runs of variants not asked for this time stay in the results (and the table).
            result["runs"] = [
                r for r in old["runs"] if r["variant"] in VARIANTS and "error" not in r
            ]
            result["steps"] = {k: v for k, v in old.get("steps", {}).items() if k in VARIANTS}
            kept = [
                n
                for n in VARIANTS
                if n not in names and any(r["variant"] == n for r in result["runs"])
            ]
            names[:0] = [n for n in ("stock",) if n in kept]
            names += [n for n in kept if n != "stock"]
            result["variants"] = {n: VARIANTS[n] for n in names}
            # What earlier runs recorded beside their runs (eval_check, superseded runs,
            # notes) stays.
            result.update({k: v for k, v in old.items() if k not in result})
            if old.get("command") and old["command"] != result["command"]:
                result["command"] = f"{old['command']}; then: {result['command']}"
    for name in names:
        if name not in result["steps"]:
            result["steps"][name] = step_stats(name, args, paths)
    save()
    done = {(r["variant"], r["seed"]) for r in result["runs"]}
    jobs = [
        (name, seed)
        for tier in tiers
        for seed in range(args.seeds)
        for name in tier
        if (name, seed) not in done
    ]

    def run(job) -> None:
        r = train_once(job[0], job[1], args, paths, work)
        with lock:
            result["runs"].append(r)
            save()
            print(
                json.dumps(
                    {
                        k: r.get(k)
                        for k in (
                            "variant",
                            "seed",
                            "ents_f",
                            "wall_seconds",
                            "cpu_seconds",
                            "peak_rss_mb",
                        )
                    }
                ),
                flush=True,
            )

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(run, jobs))
    model = work / "stock-seed0" / "model-last"
    if model.exists():
        result["eval_check"] = eval_check(model, paths["dev"])
    with lock:
        save()
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
