"""Helpers of the benchmark scripts that a GPU run depends on, checked here: a device
call that fails on them loses its minutes."""

import argparse
import importlib.util
import json
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_for_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_memory_runs_extra_arms_into_a_fresh_output(tmp_path):
    """`train_memory.py --only-extra --output NEW` (scripts/gpu_check.sh's first step of
    its train_memory lane) read the earlier results unconditionally and failed on a file
    that did not exist yet; it now starts from none, and still merges into one that does."""
    train_memory = load("train_memory")
    args = argparse.Namespace(output=tmp_path / "extra.json")
    assert train_memory.merge_into(args, {"train1": 10}, lambda run: False) == ([], {"train1": 10})
    assert not hasattr(args, "merged_into")
    earlier = {"command": "python train_memory.py", "runs": [{"system": "stock"}, {"system": "x"}]}
    earlier["corpus_words"] = {"train16": 160}
    args.output.write_text(json.dumps(earlier), encoding="utf8")
    kept, words = train_memory.merge_into(args, {"train1": 10}, lambda run: run["system"] == "x")
    assert kept == [{"system": "stock"}] and words == {"train16": 160, "train1": 10}
    assert args.merged_into == "python train_memory.py"


def _run(system, dev, peak, words_per_s=100.0, group=None, train="train1", steps=150):
    run = {
        "name": f"{system}-{train}-{dev}-{group}-{peak}",
        "system": system,
        "train": train,
        "dev": dev,
        "seed": 0,
        "nproc": 1,
        "peak_rss_mb": peak,
        "words_per_s": words_per_s,
        "words_per_wall_s": words_per_s / 2,
        "wall_s": 10.0,
        "words": 1000,
        "ents_f": 0.5,
        "steps": steps,
        "peak_gpu_mb": None,
    }
    if group:
        run["group"] = group
    return run


def test_train_memory_summarizes_the_dev_pairs_and_the_long_arms_apart():
    """The --dev-repeats pairs count in the dev growth's means (with the default run's
    pair), and neither they nor the --long-arms runs change the default run's figures."""
    train_memory = load("train_memory")
    runs = [
        _run("lean", "dev1", 500.0),
        _run("lean", "dev8", 520.0),
        _run("lean", "dev1", 510.0, group="dev_repeat"),
        _run("lean", "dev8", 540.0, group="dev_repeat"),
        _run("lean", "dev1", 900.0, words_per_s=7.0, group="long", train="train16", steps=1200),
        _run("lean_no_trim", "dev1", 950.0, words_per_s=9.0, group="long", train="train16"),
    ]
    summary = train_memory.summarize(runs)
    lean = summary["lean"]
    assert lean["peak_rss_mb_by_dev_size"] == {"dev1": 500.0, "dev8": 520.0}
    assert lean["words_per_s_mean"] == 100.0
    assert lean["dev_pairs_peak_rss_mb"] == {"dev1": [500.0, 510.0], "dev8": [520.0, 540.0]}
    assert lean["dev_pairs_rss_growth_dev_1x_to_8x"] == round(530.0 / 505.0 - 1, 4)
    long_arms = summary["long_arms"]
    assert long_arms["lean"]["peak_rss_mb"] == [900.0] and long_arms["lean"]["steps"] == 1200
    assert long_arms["lean_no_trim"]["words_per_s_mean"] == 9.0
