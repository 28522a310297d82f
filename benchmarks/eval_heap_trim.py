"""What handing freed heap memory back to the OS costs the streaming evaluation, and
what it saves: `spacy lean evaluate` with the evaluator's heap trimming policies against
`spacy evaluate`, each command in a fresh process, on one .spacy file of news-like docs
(the 2x64 "small" model and data of benchmarks/eval_memory.py, where the loop's own
costs show most).

Policies (`StreamingEvaluator(trim_heap=..., trim_slack_mb=...)`, set in the child by
replacing the evaluator's trimmer):

- `every_batch`: trim after every batch (`trim_slack_mb=0`, the default);
- `slack16`, `slack32`, `slack64`: trim once resident memory has crept more than that
  many MB above its working level, re-measured at the first batch after each trim
  (`spacy_lean.memory.HeapTrimmer`);
- `min_level32`: the same with a working level that never rises (the lowest level
  measured after any trim), so the peak cannot drift up trim after trim;
- `never`: `trim_heap=False`;
- `mmap_1mb`, `mmap_4mb`: never trim, but fix glibc's mmap threshold (`mallopt
  (M_MMAP_THRESHOLD)`, which otherwise rises up to 32 MB as large blocks are freed), so
  every block that large is its own mapping, unmapped when freed.

Per run: seconds of the command after imports, user and system CPU seconds, minor page
faults, peak RSS after the model was loaded (the kernel's mark reset then), number of
trims. Arms interleaved, order reversed every repeat.

    nice -n 10 python benchmarks/eval_heap_trim.py [--sizes 1200 4800] [--repeats 3 1]
        [--policies every_batch slack32 ...] [--work-dir DIR]

Prints JSON and writes benchmarks/results/eval_heap_trim.json.
"""

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _procmem import proc_status, reset_peak  # noqa: E402
from _report import command_line, work_folder  # noqa: E402
from eval_memory import (  # noqa: E402
    build_data,
    build_model,
    lean_evaluate_argv,
    spacy_evaluate_argv,
)

RESULTS = Path(__file__).parent / "results" / "eval_heap_trim.json"
# name -> (slack MB or None for never, lowest-level mode, fixed mmap threshold MB)
POLICIES = {
    "every_batch": (0.0, False, None),
    "slack16": (16.0, False, None),
    "slack32": (32.0, False, None),
    "slack64": (64.0, False, None),
    "min_level32": (32.0, True, None),
    "never": (None, False, None),
    "mmap_1mb": (None, False, 1),
    "mmap_4mb": (None, False, 4),
}
ARMS = ["spacy evaluate"] + [f"spacy lean evaluate ({name})" for name in POLICIES]
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def lowest_level_trimmer(memory, slack_mb: float, settle: int = 0):
    """A HeapTrimmer whose working level is the lowest measured after any trim."""

    class LowestLevelTrimmer(memory.HeapTrimmer):
        base = None

        def __call__(self) -> bool:
            measuring = self.floor is None
            trimmed = super().__call__()
            if measuring and self.floor is not None:  # it just measured the level
                self.base = self.floor if self.base is None else min(self.base, self.floor)
                self.floor = self.base
            return trimmed

    return LowestLevelTrimmer(slack_mb, settle=settle)


def child(arm: str, model: str, data: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import spacy.util
    from spacy.cli._util import app

    import spacy_lean.cli  # noqa: F401
    from spacy_lean import memory, streaming

    trimmers = []
    if arm != "spacy evaluate":
        slack, lowest, mmap_mb = POLICIES[arm[arm.index("(") + 1 : -1]]
        if mmap_mb is not None:
            import ctypes

            ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, mmap_mb * 2**20)

        def make_trimmer(_default_slack, settle=0):
            # The evaluator's trimmer with this arm's slack (and the evaluator's settle).
            if slack is None:
                trimmer = None
            elif lowest:
                trimmer = lowest_level_trimmer(memory, slack, settle)
            else:
                trimmer = memory.HeapTrimmer(slack, settle=settle)
            trimmers.append(trimmer)
            return trimmer if trimmer is not None else (lambda: False)

        streaming.HeapTrimmer = make_trimmer
    marks = {}
    load_model = spacy.util.load_model

    def load_and_mark(*args, **kwargs):
        nlp = load_model(*args, **kwargs)
        marks["peak_reset"] = reset_peak()
        return nlp

    spacy.util.load_model = load_and_mark
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "scores.json"
        make_argv = spacy_evaluate_argv if arm == "spacy evaluate" else lean_evaluate_argv
        argv = make_argv(Path(model), Path(data), output)
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            app(argv, standalone_mode=False)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        scores = json.loads(output.read_text())
    scores.pop("speed", None)
    return {
        "command_seconds": seconds,
        "user_seconds": after.ru_utime - before.ru_utime,
        "system_seconds": after.ru_stime - before.ru_stime,
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "peak_rss_after_load_mb": proc_status("VmHWM") / 2**20,
        "peak_reset_after_load": marks.get("peak_reset", False),
        "trims": sum(t.n_trims for t in trimmers if t is not None),
        "scores": scores,
    }


def run_child(arm: str, model: Path, data: Path, threads: int) -> dict:
    env = dict(
        os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads)
    )
    cmd = [
        sys.executable,
        __file__,
        "--child",
        arm,
        str(model),
        str(data),
        "--threads",
        str(threads),
    ]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} on {data} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(arm=arm, load_avg_before=load)
    return result


def summarize(runs):
    summary = {}
    for size in sorted({r["size"] for r in runs}):
        row = {}
        for arm in ARMS:
            mine = [r for r in runs if r["size"] == size and r["arm"] == arm]
            if not mine:
                continue
            row[arm] = {
                "command_seconds_median": statistics.median(r["command_seconds"] for r in mine),
                "cpu_seconds_median": statistics.median(
                    r["user_seconds"] + r["system_seconds"] for r in mine
                ),
                "system_seconds_median": statistics.median(r["system_seconds"] for r in mine),
                "minor_faults_median": statistics.median(r["minor_faults"] for r in mine),
                "peak_rss_after_load_mb_max": max(r["peak_rss_after_load_mb"] for r in mine),
                "trims_median": statistics.median(r["trims"] for r in mine),
                "n": len(mine),
            }
        stock = row.get("spacy evaluate")
        for arm, entry in row.items():
            if stock and arm != "spacy evaluate":
                pairs = [
                    a["command_seconds"] / b["command_seconds"]
                    for a in runs
                    if a["size"] == size and a["arm"] == arm
                    for b in runs
                    if b["size"] == size
                    and b["arm"] == "spacy evaluate"
                    and b["repeat"] == a["repeat"]
                ]
                entry["seconds_ratio_vs_stock_median"] = statistics.median(pairs)
        scores = {json.dumps(r["scores"], sort_keys=True) for r in runs if r["size"] == size}
        row["scores_identical"] = len(scores) == 1
        summary[str(size)] = row
    return summary


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", type=int, default=[1200, 4800])
    parser.add_argument("--repeats", nargs="+", type=int, default=[3, 1], help="per size")
    parser.add_argument("--base", type=int, default=300, help="distinct docs, tiled to each size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        choices=list(POLICIES),
        help="the lean arms to run (with spacy evaluate)",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global ARMS
    ARMS = ["spacy evaluate"] + [f"spacy lean evaluate ({name})" for name in args.policies]
    if args.child:
        print(json.dumps(child(*args.child, args.threads)))
        return
    with work_folder(args.work_dir, "eval_heap_trim_") as work:
        data = build_data(work, args.base, sorted(set(args.sizes)))["file"]
        model = build_model(work, "small")
        repeats = dict(zip(args.sizes, args.repeats + [args.repeats[-1]] * len(args.sizes)))
        runs = []
        started = time.time()
        for size in args.sizes:
            for rep in range(repeats[size]):
                for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                    result = run_child(arm, model, data[size], args.threads)
                    result.update(size=size, repeat=rep)
                    runs.append(result)
                    print(
                        f"{size:5d} {arm:36s} {result['command_seconds']:6.1f}s "
                        f"sys {result['system_seconds']:5.1f}s faults {result['minor_faults']:>8} "
                        f"peak {result['peak_rss_after_load_mb']:5.0f} MB trims {result['trims']} "
                        f"load {result['load_avg_before']:.1f}",
                        file=sys.stderr,
                        flush=True,
                    )
    summary = summarize(runs)
    report = {
        "benchmark": "eval_heap_trim",
        "command": command_line(__file__),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "threads_per_run": args.threads,
            "load_avg_at_end": os.getloadavg(),
        },
        "model": "BERT 2 layers x 64 wide (random init, local WordPiece) + ner (30 steps)",
        "data": f"{args.base} news-like docs tiled to each size, one .spacy file",
        "seconds_total": time.time() - started,
        "by_arm": {
            f"{arm} @ {size}": {k: v for k, v in entry.items() if isinstance(v, (int, float))}
            for size, row in summary.items()
            for arm, entry in row.items()
            if isinstance(entry, dict)
        },
        "summary": summary,
        "runs": runs,
    }
    if args.output.exists():  # what an earlier run recorded beside its own runs stays
        old = json.loads(args.output.read_text())
        report.update({k: v for k, v in old.items() if k not in report and k != "previous_run"})
        report["previous_run"] = {k: old[k] for k in ("command", "summary", "runs") if k in old}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
