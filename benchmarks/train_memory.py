"""Training memory and speed: `spacy train` with the stock config against
`spacy lean train` with the lean config, on one generated corpus at 1x, 4x and 16x its
size and a dev set at 1x and 8x; and `spacy lean train --nproc 2` against 1 process.

Each run is a fresh `python -m spacy ...` process; its peak RSS is the largest
`ru_maxrss` of the processes it waited for (with --nproc 2: the largest rank, not the
sum). Words per second are training words over the time from the first to the last
logged evaluation (dev evaluations included), read from a JSONL logger given with
--code; words per wall second are the run's training words over the whole command's
wall time (stock's reader lists the corpus before the first step, outside the first).
Final dev F is the last evaluation's ents_f. Runs alternate stock / lean so that load
changes hit both alike; the load average is recorded.

On a 2-core machine with one torch thread per process (the default `--threads 1`),
`--nproc 2` can use both cores where one process uses one.

    nice -n 10 python benchmarks/train_memory.py [--quick]
    nice -n 10 python benchmarks/train_memory.py --add-factor 64   # then: a 64x corpus, merged in
    nice -n 10 python benchmarks/train_memory.py --speed-arms 3    # then: words/s by piece length
                                                                   # and cut
    nice -n 10 python benchmarks/train_memory.py --dev-repeats 2   # then: more dev 1x/8x pairs
    nice -n 10 python benchmarks/train_memory.py --long-arms 1200  # then: trimming over 1,200 steps
    python benchmarks/train_memory.py --gpu-id 0 --threads 4        # on a GPU: also peak GPU memory

With --gpu-id every run trains on that GPU (`--gpu-id` for one process; with --nproc 2,
one GPU per rank where there are two, else both ranks on it over gloo) and each log line
records torch's peak allocated GPU memory so far (spaCy's configs put cupy on torch's
allocator, so that counts thinc's arrays too): the run's "peak_gpu_mb" is rank 0's.
Results then go to benchmarks/results/train_memory_gpu.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "train_memory.json"
GPU_RESULTS = ROOT / "benchmarks" / "results" / "train_memory_gpu.json"
sys.path.insert(0, str(ROOT / "benchmarks"))
from _report import command_line  # noqa: E402

LOGGER_CODE = '''
import json, time
from spacy.util import registry


def peak_gpu_mb():
    """torch's peak allocated GPU memory of this process so far, or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.max_memory_allocated() / 2 ** 20


def rss_mb():
    """This process's resident memory now, in MB (Linux), or None."""
    try:
        import os
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except (OSError, ValueError):
        return None


@registry.loggers("bench.jsonl_logger.v1")
def make_jsonl_logger(path: str):
    def setup(nlp, stdout, stderr):
        out = open(path, "a", encoding="utf8")

        def log_step(info):
            if info is None:
                return
            scores = {k: v for k, v in info["other_scores"].items() if isinstance(v, (int, float))}
            out.write(json.dumps({"step": info["step"], "words": info["words"],
                                  "time": time.perf_counter(), "score": info["score"],
                                  "scores": scores, "peak_gpu_mb": peak_gpu_mb(),
                                  "rss_mb": rss_mb()}) + "\\n")
            out.flush()

        return log_step, out.close

    return setup
'''

# The heap-trimming arms: `spacy lean train` with the update policy's trimming replaced
# (the default is a 64 MB slack: `UpdatePolicy.trim_heap_slack_mb`).
TRIM_PATCHES = {
    "lean_no_trim": """
from spacy_lean.training.update import UpdatePolicy
UpdatePolicy.trim_heap = lambda self: False
""",
    "lean_trim_every": """
from spacy_lean.memory import trim_host_memory
from spacy_lean.training.update import UpdatePolicy
UpdatePolicy.trim_heap = lambda self: trim_host_memory()
""",
    # The speed arm without length-sorted span groups in training (sort_spans off).
    "lean_no_sort": """
import contextlib
from spacy_lean.training import update
update.sorted_span_groups = lambda nlp, **kwargs: contextlib.nullcontext(0)
""",
    # The default before: a 64 MB slack over the level of the first update after each
    # trim (more trims, the peak more tightly bounded).
    "lean_trim_slack64_settle1": """
from spacy_lean import memory
from spacy_lean.training import update
update.HeapTrimmer = lambda slack_mb, settle=1: memory.HeapTrimmer(64.0, settle=1)
""",
}

# The first is `lean` as is (a 32 MB slack over the highest level of the 16 updates
# after a trim). Each arm runs --trim-arms times on the 1x corpus, then once on the 1x and the
# 16x corpus with the reader's and batcher's bounds below the 1x corpus (tag "-w100"):
# the peak's growth with the corpus once those bounds hold, which is the heap's.
TRIM_ARMS = ("lean_trim_default", "lean_trim_slack64_settle1", "lean_no_trim", "lean_trim_every")

# The speed arms (--speed-arms): the lean config with explicit piece lengths and
# oracle cuts, against stock and the lean config as it is. The ner's transition parser
# runs as many sequential steps per update as a batch's longest piece, up to its oracle
# cut (`update_with_oracle_cut_size`, cut at random between half and twice it).
_CUT = "--components.ner.update_with_oracle_cut_size"
_LEN = "--corpora.train.max_length"
SPEED_OVERRIDES = {
    "lean_len256_cut100": [_LEN, "256", _CUT, "100"],
    "lean_len256_cut32": [_LEN, "256", _CUT, "32"],
    "lean_len128_cut100": [_LEN, "128", _CUT, "100"],
}
# The 2x2 of config (stock / lean) and command (`spacy train` / `spacy lean train`):
# the loop's cost apart from the data's; the lean config without sorted span groups in training;
# then the lean config's piece length and cut.
SPEED_ARMS = (
    "stock",
    "lean",
    "stock_cfg_lean_train",
    "lean_cfg_spacy_train",
    "lean_no_sort",
    "lean_len256_cut100",
    "lean_len256_cut32",
    "lean_len128_cut100",
)

RUNNER = r"""
import json, resource, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.run(sys.argv[2:], capture_output=True, text=True)
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
json.dump({"rc": proc.returncode, "wall_s": time.perf_counter() - start,
           "peak_rss": usage.ru_maxrss * 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
           "tail": (proc.stdout + proc.stderr)[-3000:]}, open(sys.argv[1], "w"))
"""


def make_data(root: Path, n_train: int, n_dev: int, factors, dev_factors, seed: int = 0):
    """One news-like corpus (`spacy_lean.synthetic_news`: documents of 100-400 tokens
    with a long tail, four entity types): each size is generated (same generator, more
    docs), one .spacy file per size, as a user hands `spacy train` one big file."""
    import spacy
    from spacy.tokens import DocBin

    from spacy_lean.synthetic_news import make_news_docs

    nlp = spacy.blank("en")
    paths = {}
    for key, n, base in [(f"train{f}", n_train * f, 100) for f in factors] + [
        (f"dev{f}", n_dev * f, 200) for f in dev_factors
    ]:
        paths[key] = root / f"{key}.spacy"
        DocBin(docs=make_news_docs(nlp, n, seed=base + seed)).to_disk(paths[key])
    return paths


def words_in(path: Path) -> int:
    import spacy
    from spacy.tokens import DocBin

    nlp = spacy.blank("en")
    return sum(len(d) for d in DocBin().from_disk(path).get_docs(nlp.vocab))


def _texts(path: Path):
    import spacy
    from spacy.tokens import DocBin

    return [d.text for d in DocBin().from_disk(path).get_docs(spacy.blank("en").vocab)]


def bench_config(src: Path, dst: Path, log_path: Path) -> Path:
    from thinc.api import Config

    config = Config().from_disk(src, interpolate=False)
    config["training"]["logger"] = {"@loggers": "bench.jsonl_logger.v1", "path": str(log_path)}
    config.to_disk(dst)
    return dst


def run_one(kind, tmp: Path, data, train_key, dev_key, seed, args, nproc=1, tag=""):
    name = f"{kind}-{train_key}-{dev_key}-s{seed}-n{nproc}{tag}"
    out = tmp / name
    log = tmp / f"{name}.jsonl"
    code = tmp / f"bench_code_{kind}.py"
    code.write_text(LOGGER_CODE + TRIM_PATCHES.get(kind, ""), encoding="utf8")
    cfg_src = (
        ROOT / "configs" / ("ner_trf_stock.cfg" if kind.startswith("stock") else "ner_trf.cfg")
    )
    cfg = bench_config(cfg_src, tmp / f"{name}.cfg", log)
    spacy_train = kind in ("stock", "lean_cfg_spacy_train")
    command = [sys.executable, "-m", "spacy"] + (["train"] if spacy_train else ["lean", "train"])
    command += [
        str(cfg),
        "--output",
        str(out),
        "--code",
        str(code),
        "--paths.train",
        str(data[train_key]),
        "--paths.dev",
        str(data[dev_key]),
        "--paths.transformer",
        str(data["transformer"]),
        "--system.seed",
        str(seed),
        "--training.max_steps",
        str(args.steps),
        "--training.eval_frequency",
        str(args.steps),
        "--training.optimizer.learn_rate.initial_rate",
        "0.001",
        "--training.optimizer.learn_rate.warmup_steps",
        str(max(1, args.steps // 10)),
        "--training.batcher.size",
        str(args.batch_size),
        "--components.transformer.model.get_spans.window",
        "64",
        "--components.transformer.model.get_spans.stride",
        "48",
    ]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    command += gpu_options(args.gpu_id, nproc)
    if kind == "lean_window100" or tag.startswith("-w100"):
        command += ["--corpora.train.shuffle_buffer", "100", "--training.batcher.window", "100"]
    command += SPEED_OVERRIDES.get(kind, [])
    if "-long" in tag:  # --long-arms: four evaluations, resident memory logged at each
        command += ["--training.eval_frequency", str(max(1, args.steps // 4))]
    result_file = tmp / f"{name}.result.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    subprocess.run([sys.executable, "-c", RUNNER, str(result_file), *command], env=env, check=True)
    result = json.loads(result_file.read_text())
    if result["rc"] != 0:
        raise RuntimeError(f"{name} failed:\n{result['tail']}")
    logs = [json.loads(line) for line in log.read_text().splitlines()]
    first, last = logs[0], logs[-1]
    seconds = last["time"] - first["time"]
    return {
        "name": name,
        "system": kind,
        "train": train_key,
        "dev": dev_key,
        "seed": seed,
        "nproc": nproc,
        "peak_rss_mb": round(result["peak_rss"] / 2**20, 1),
        "peak_gpu_mb": max(
            (x["peak_gpu_mb"] for x in logs if x.get("peak_gpu_mb") is not None), default=None
        ),
        "wall_s": round(result["wall_s"], 1),
        "cpu_s": round(result["cpu_s"], 1),
        "words": last["words"],
        "words_per_s": (
            round((last["words"] - first["words"]) / seconds, 1) if seconds > 0 else None
        ),
        "words_per_wall_s": round(last["words"] / result["wall_s"], 1),
        "ents_f": last["scores"].get("ents_f"),
        "steps": last["step"],
        "rss_mb_by_step": [
            [x["step"], round(x["rss_mb"], 1)] for x in logs if x.get("rss_mb") is not None
        ],
        "loadavg_after": os.getloadavg(),
    }


def gpu_options(gpu_id: int, nproc: int) -> List[str]:
    """The command's GPU options: none on the CPU (gpu_id < 0); `--gpu-id` for one
    process; for several, one GPU per rank from gpu_id on where there are enough, else
    all on gpu_id, over gloo (nccl refuses two ranks on one GPU)."""
    if gpu_id < 0:
        return []
    if nproc == 1:
        return ["--gpu-id", str(gpu_id)]
    import torch

    if torch.cuda.device_count() >= gpu_id + nproc:
        return ["--gpu-ids", ",".join(str(gpu_id + i) for i in range(nproc))]
    return ["--gpu-ids", ",".join([str(gpu_id)] * nproc), "--dist-backend", "gloo"]


def _growth(by_train, into):
    """Peak growth from 1x to 16x, and from 16x to each larger size, written into `into`."""
    if "train1" in by_train and "train16" in by_train:
        into["rss_growth_1x_to_16x"] = round(by_train["train16"] / by_train["train1"] - 1, 4)
    if "train16" in by_train:
        for key in sorted(by_train, key=lambda k: int(k[5:])):
            if int(key[5:]) > 16:
                into[f"rss_growth_16x_to_{key[5:]}x"] = round(
                    by_train[key] / by_train["train16"] - 1, 4
                )


def _per_wall_s(run):
    """Training words per second of the whole command (start-up, initialization, reading
    the corpus, training, evaluations and saving): what a user waits for. Stock's reader
    lists the corpus before the first step, so `words_per_s` (between the first and the
    last logged evaluation) leaves that out; this does not."""
    return run.get("words_per_wall_s") or run["words"] / run["wall_s"]


def _dev_pair(run, kind, dev) -> bool:
    """Whether `run` is one of the seed-0 runs of `kind` on the 1x corpus with `dev`, in
    the default run or in the --dev-repeats."""
    return run.get("group") in (None, "dev_repeat") and (
        run["system"],
        run["train"],
        run["dev"],
        run["seed"],
        run["nproc"],
    ) == (kind, "train1", dev, 0, 1)


def summarize(runs):
    def pick(group=None, **kw):
        return [
            r for r in runs if r.get("group") == group and all(r[k] == v for k, v in kw.items())
        ]

    summary = {}
    for kind in ("stock", "lean"):
        seeds = pick(system=kind, train="train1", dev="dev1", nproc=1)
        if not seeds:
            continue
        fs = [r["ents_f"] or 0.0 for r in seeds]
        summary[kind] = {
            "ents_f_mean": statistics.mean(fs),
            "ents_f_spread": [min(fs), max(fs)],
            "seeds": len(fs),
            "words_per_s_mean": statistics.mean(r["words_per_s"] for r in seeds),
            "words_per_wall_s_mean": statistics.mean(_per_wall_s(r) for r in seeds),
            "words_per_wall_s_by_train_size": {
                r["train"]: round(_per_wall_s(r), 1)
                for r in pick(system=kind, dev="dev1", seed=0, nproc=1)
            },
            "peak_rss_mb_by_train_size": {
                r["train"]: r["peak_rss_mb"] for r in pick(system=kind, dev="dev1", seed=0, nproc=1)
            },
            "peak_rss_mb_by_dev_size": {
                r["dev"]: r["peak_rss_mb"]
                for r in pick(system=kind, train="train1", seed=0, nproc=1)
            },
        }
        _growth(summary[kind]["peak_rss_mb_by_train_size"], summary[kind])
        if any(r.get("peak_gpu_mb") is not None for r in seeds):
            summary[kind]["peak_gpu_mb_by_train_size"] = {
                r["train"]: r["peak_gpu_mb"] for r in pick(system=kind, dev="dev1", seed=0, nproc=1)
            }
            summary[kind]["peak_gpu_mb_by_dev_size"] = {
                r["dev"]: r["peak_gpu_mb"]
                for r in pick(system=kind, train="train1", seed=0, nproc=1)
            }
        by_dev = summary[kind]["peak_rss_mb_by_dev_size"]
        if "dev1" in by_dev and "dev8" in by_dev:
            summary[kind]["rss_growth_dev_1x_to_8x"] = round(by_dev["dev8"] / by_dev["dev1"] - 1, 4)
        # With --dev-repeats: the mean peak per dev size over the seed-0 pairs.
        pairs = {
            dev: [r["peak_rss_mb"] for r in runs if _dev_pair(r, kind, dev)]
            for dev in ("dev1", "dev8")
        }
        if len(pairs["dev1"]) > 1 and len(pairs["dev8"]) > 1:
            means = {dev: statistics.mean(peaks) for dev, peaks in pairs.items()}
            summary[kind]["dev_pairs_peak_rss_mb"] = pairs
            summary[kind]["dev_pairs_rss_growth_dev_1x_to_8x"] = round(
                means["dev8"] / means["dev1"] - 1, 4
            )
    for kind in TRIM_ARMS:
        rows = [r for r in pick(system=kind) if "-w100" not in r["name"]]
        if rows:
            summary[kind] = {
                "runs": len(rows),
                "words_per_s_mean": statistics.mean(r["words_per_s"] for r in rows),
                "words_per_s_spread": [
                    min(r["words_per_s"] for r in rows),
                    max(r["words_per_s"] for r in rows),
                ],
                "peak_rss_mb_mean": statistics.mean(r["peak_rss_mb"] for r in rows),
                "peak_rss_mb_max": max(r["peak_rss_mb"] for r in rows),
                "cpu_s_mean": statistics.mean(r["cpu_s"] for r in rows),
                "ents_f": sorted({r["ents_f"] for r in rows}),
            }
            # Peaks of single runs vary by a few percent: the mean of the repeats per size.
            bounded: Dict[str, List[float]] = {}
            for r in pick(system=kind):
                if "-w100" in r["name"]:
                    bounded.setdefault(r["train"], []).append(r["peak_rss_mb"])
            if bounded:
                summary[kind]["window100_peak_rss_mb_by_train_size"] = {
                    size: round(statistics.mean(peaks), 1) for size, peaks in bounded.items()
                }
                summary[kind]["window100_peak_rss_mb_runs"] = bounded
                if "train1" in bounded and "train16" in bounded:
                    summary[kind]["window100_rss_growth_1x_to_16x"] = round(
                        statistics.mean(bounded["train16"]) / statistics.mean(bounded["train1"])
                        - 1,
                        4,
                    )
    for kind in ("lean_cfg_spacy_train", "lean_window100"):
        rows = pick(system=kind)
        if rows:
            summary[kind] = {
                "words_per_s_mean": statistics.mean(r["words_per_s"] for r in rows),
                "peak_rss_mb_by_train_size": {r["train"]: r["peak_rss_mb"] for r in rows},
                "ents_f": [r["ents_f"] for r in rows],
            }
    if "lean_window100" in summary:
        _growth(summary["lean_window100"]["peak_rss_mb_by_train_size"], summary["lean_window100"])
    if "stock" in summary and "lean" in summary and summary["stock"]["words_per_s_mean"]:
        summary["lean_vs_stock_words_per_s"] = round(
            summary["lean"]["words_per_s_mean"] / summary["stock"]["words_per_s_mean"], 3
        )
        summary["lean_vs_stock_words_per_wall_s"] = round(
            summary["lean"]["words_per_wall_s_mean"] / summary["stock"]["words_per_wall_s_mean"], 3
        )
        by_size = {}
        for size, value in summary["lean"]["words_per_wall_s_by_train_size"].items():
            stock_value = summary["stock"]["words_per_wall_s_by_train_size"].get(size)
            if stock_value:
                by_size[size] = round(value / stock_value, 3)
        summary["lean_vs_stock_words_per_wall_s_by_train_size"] = by_size
    speed = {}
    for kind in SPEED_ARMS:
        rows = pick(group="speed", system=kind)
        if rows:
            fs = [r["ents_f"] or 0.0 for r in rows]
            speed[kind] = {
                "runs": len(rows),
                "words_per_s_mean": statistics.mean(r["words_per_s"] for r in rows),
                "words_per_s_spread": [
                    min(r["words_per_s"] for r in rows),
                    max(r["words_per_s"] for r in rows),
                ],
                "words_per_wall_s_mean": statistics.mean(_per_wall_s(r) for r in rows),
                "ents_f_mean": statistics.mean(fs),
                "ents_f_spread": [min(fs), max(fs)],
                "peak_rss_mb_max": max(r["peak_rss_mb"] for r in rows),
            }
    if "stock" in speed:
        for kind, row in speed.items():
            row["words_per_s_vs_stock"] = round(
                row["words_per_s_mean"] / speed["stock"]["words_per_s_mean"], 3
            )
            row["words_per_wall_s_vs_stock"] = round(
                row["words_per_wall_s_mean"] / speed["stock"]["words_per_wall_s_mean"], 3
            )
        summary["speed_arms"] = speed
    long_arms = {}
    for kind in ("lean", "lean_no_trim"):
        rows = pick(group="long", system=kind)
        if rows:
            long_arms[kind] = {
                "runs": len(rows),
                "steps": rows[0]["steps"],
                "peak_rss_mb": [r["peak_rss_mb"] for r in rows],
                "peak_rss_mb_mean": statistics.mean(r["peak_rss_mb"] for r in rows),
                "words_per_s": [r["words_per_s"] for r in rows],
                "words_per_s_mean": statistics.mean(r["words_per_s"] for r in rows),
                "rss_mb_by_step": [r.get("rss_mb_by_step") for r in rows],
            }
    if long_arms:
        summary["long_arms"] = long_arms
    two = pick(system="lean", nproc=2)
    one = pick(system="lean", train="train1", dev="dev1", seed=0, nproc=1)
    if two and one:
        summary["nproc2_vs_1"] = {
            "words_per_s_ratio": round(two[0]["words_per_s"] / one[0]["words_per_s"], 3),
            "ents_f_1": one[0]["ents_f"],
            "ents_f_2": two[0]["ents_f"],
            "note": "each process runs --threads torch threads (default 1): 2 ranks can use both "
            "cores where 1 process uses one; each rank takes batch_size tokens per step, so 2 "
            "ranks train on twice the data per step",
        }
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, 1 seed")
    parser.add_argument("--n-train", type=int, default=100, help="docs in the 1x training set")
    parser.add_argument("--n-dev", type=int, default=30, help="docs in the 1x dev set")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"results file (default {RESULTS.name}; with --gpu-id {GPU_RESULTS.name})",
    )
    parser.add_argument(
        "--gpu-id",
        type=int,
        default=-1,
        help="train on this GPU and record peak GPU memory (-1: the CPU)",
    )
    parser.add_argument(
        "--only-extra",
        action="store_true",
        help="run only the extra arms, keeping the other runs in --output",
    )
    parser.add_argument(
        "--trim-arms",
        type=int,
        default=0,
        metavar="REPEATS",
        help="run only the TRIM_ARMS (the default, the old default, never, before every "
        "update) on the 1x corpus (seed 0), this many times each, interleaved, keeping "
        "the other runs in --output: what the "
        "training updates' heap trimming costs and saves",
    )
    parser.add_argument(
        "--add-factor",
        type=int,
        default=0,
        help="run only stock, lean and lean_window100 (seed 0) on a training corpus this "
        "many times the 1x, keeping the other runs in --output: past the size that fills "
        "the reader's shuffle buffer and the batcher's window, the lean peak stays flat",
    )
    parser.add_argument(
        "--long-arms",
        type=int,
        default=0,
        metavar="STEPS",
        help="run only lean and lean_no_trim (seed 0, twice each, ABBA) for this many steps "
        "on the 16x corpus with both bounds at 100, keeping the other runs in --output: "
        "what the heap trimming bounds over a longer run",
    )
    parser.add_argument(
        "--dev-repeats",
        type=int,
        default=0,
        metavar="PAIRS",
        help="run only stock and lean (seed 0) on the 1x corpus with the 1x and 8x dev sets, "
        "this many more times each, keeping the other runs in --output: single peaks vary "
        "by a few percent, and the dev-size growth is summarized over all the pairs",
    )
    parser.add_argument(
        "--speed-arms",
        type=int,
        default=0,
        metavar="SEEDS",
        help="run only the SPEED_ARMS (stock, the lean config, and the lean config with "
        "explicit piece lengths and oracle cuts) on the 1x corpus with this many seeds, "
        "interleaved, keeping the other runs in --output: words/s and dev F against the "
        "ner parser's sequential steps",
    )
    args = parser.parse_args()
    if args.output is None:
        args.output = GPU_RESULTS if args.gpu_id >= 0 else RESULTS
    factors, dev_factors = (1, 4, 16), (1, 8)
    if args.speed_arms:
        factors, dev_factors = (1,), (1,)
    if args.trim_arms:
        factors, dev_factors = (1, 16), (1,)
    if args.add_factor:
        factors, dev_factors = (1, args.add_factor), (1,)
    if args.dev_repeats:
        factors, dev_factors = (1,), (1, 8)
    if args.long_arms:
        factors, dev_factors = (1, 16), (1,)  # the 1x: the tokenizer's text
        args.steps = args.long_arms
    if args.quick:
        args.n_train, args.n_dev, args.steps, args.seeds = 6, 4, 4, 1
    from spacy_lean import synthetic

    runs = []
    # The most telling pairs first, and the results saved after every run, so that a
    # run cut short (a loaded machine) still leaves what it measured.
    plan = [("train1", "dev1", 0, 1), ("train16", "dev1", 0, 1), ("train1", "dev8", 0, 1)]
    plan += [("train1", "dev1", 0, 2), ("train4", "dev1", 0, 1)]
    plan += [("train1", "dev1", s, 1) for s in range(1, args.seeds)]
    # The lean config under stock `spacy train` (the loop's cost apart from the data's),
    # and the lean config with a shuffle buffer and a batcher window both smaller than
    # the 1x corpus (what the peak is bounded by: those two, not the corpus).
    extra = [
        ("lean_cfg_spacy_train", "train1", "dev1", 0),
        ("lean_window100", "train1", "dev1", 0),
        ("lean_window100", "train16", "dev1", 0),
    ]
    with tempfile.TemporaryDirectory(prefix="train_memory_") as tmp_name:
        tmp = Path(tmp_name)
        data = make_data(tmp, args.n_train, args.n_dev, factors, dev_factors)
        data["transformer"] = synthetic.make_tiny_transformer(
            tmp / "tiny_bert",
            _texts(data["train1"]),
            vocab_size=1000,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=256,
        )
        words = {k: words_in(v) for k, v in data.items() if k != "transformer"}
        jobs = [
            (kind, t, d, s, n)
            for t, d, s, n in plan
            for kind in (("stock", "lean") if n == 1 else ("lean",))
        ]  # interleaved
        jobs += [(kind, t, d, s, 1) for kind, t, d, s in extra]
        if args.only_extra:
            jobs = [(kind, t, d, s, 1) for kind, t, d, s in extra]
            runs, words = merge_into(args, words, lambda r: r["system"] in {e[0] for e in extra})
        if args.trim_arms:
            arms = list(TRIM_ARMS)
            jobs = [
                (kind, "train1", "dev1", 0, 1, f"-r{rep}")
                for rep in range(args.trim_arms)
                for kind in (arms if rep % 2 == 0 else arms[::-1])
            ]
            jobs += [
                (kind, size, "dev1", 0, 1, "-w100", f"-r{rep}")
                for rep in range(args.trim_arms)
                for size in ("train1", "train16")
                for kind in arms
            ]
            runs, words = merge_into(args, words, lambda r: r["system"] in TRIM_ARMS)
        if args.speed_arms:
            arms = list(SPEED_ARMS)
            jobs = [
                (kind, "train1", "dev1", seed, 1, "-speed")
                for seed in range(args.speed_arms)
                for kind in (arms if seed % 2 == 0 else arms[::-1])
            ]
            runs, words = merge_into(args, words, lambda r: r.get("group") == "speed")
        if args.add_factor:
            big = f"train{args.add_factor}"
            jobs = [(kind, big, "dev1", 0, 1) for kind in ("stock", "lean", "lean_window100")]
            runs, words = merge_into(args, words, lambda r: r["train"] == big)
        if args.dev_repeats:
            jobs = [
                (kind, "train1", dev, 0, 1, f"-rep{rep}")
                for rep in range(args.dev_repeats)
                for kind in ("lean", "stock")
                for dev in ("dev1", "dev8")
            ]
            runs, words = merge_into(args, words, lambda r: r.get("group") == "dev_repeat")
        if args.long_arms:
            jobs = [
                (kind, "train16", "dev1", 0, 1, f"-w100-long{i}")
                for i, kind in enumerate(("lean", "lean_no_trim", "lean_no_trim", "lean"))
            ]
            runs, words = merge_into(args, words, lambda r: r.get("group") == "long")
        for kind, train_key, dev_key, seed, nproc, *tag in jobs:
            tag = "".join(tag)
            run = run_one(kind, tmp, data, train_key, dev_key, seed, args, nproc=nproc, tag=tag)
            if tag == "-speed":
                run["group"] = "speed"
            if tag.startswith("-rep"):
                run["group"] = "dev_repeat"
            if "-long" in tag:
                run["group"] = "long"
            runs.append(run)
            print(json.dumps(run), flush=True)
            save(args, words, runs)


def merge_into(args, words, replaced):
    """The runs of the earlier results in --output that this run does not replace, and
    its corpus sizes with this run's; this run's command is noted after the earlier one.
    No earlier results (a fresh --output): this run's alone."""
    if not args.output.exists():
        return [], words
    old = json.loads(args.output.read_text())
    args.merged_into = old["command"]
    kept = [r for r in old["runs"] if not replaced(r)]
    return kept, {**old.get("corpus_words", {}), **words}


def gpu_name(gpu_id: int):
    if gpu_id < 0:
        return None
    import torch

    return torch.cuda.get_device_name(gpu_id)


def save(args, words, runs):
    result = {
        "benchmark": "train_memory",
        # A run merged into an earlier one (--only-extra, --add-factor, --trim-arms,
        # --speed-arms) appends itself to the earlier command.
        "command": (
            f"{args.merged_into} (then {command_line(__file__)})"
            if hasattr(args, "merged_into")
            else command_line(__file__)
        ),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "corpus_words": words,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "gpu": gpu_name(args.gpu_id),
            "loadavg_end": os.getloadavg(),
        },
        # One entry per run, for benchmarks/plot.py.
        "by_run": {
            r["name"]: {"peak_rss_mb": r["peak_rss_mb"], "words_per_s": r["words_per_s"]}
            for r in runs
        },
        "runs": runs,
        "summary": summarize(runs),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2), encoding="utf8")


if __name__ == "__main__":
    main()
