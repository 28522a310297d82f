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
