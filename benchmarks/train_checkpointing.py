"""Peak memory and time of a training step: stock `nlp.update` vs `lean_update` with
activation checkpointing and/or a padded-token ceiling per micro-batch.

A transformer + ner pipeline (a local, randomly initialised BERT, 4 layers, 256 wide,
strided spans of 128 wordpieces) is trained on batches of generated multi-sentence docs
(long-tailed lengths). Each (mode, repeat) runs in a fresh subprocess, the modes
interleaved (their order alternates between repeats). In the child: load the pipeline,
one warm-up step (the optimizer's state is allocated there), give the freed heap back
(malloc_trim), reset the kernel's peak RSS mark, then `--steps` steps; reported: peak RSS
during those steps above the RSS before them ("step_peak_mb": the memory a step needs),
seconds per step, and the summed losses (they differ between modes: the transformer's own
dropout, 0.1 in TRF_NER_CONFIG, draws other masks; the same-update claim is tested with
dropout 0 in tests/test_train_oom.py).

Modes:
- stock: `nlp.update(batch, sgd=False)` then each component's `finish_update`, as
  `spacy train` does;
- lean: `lean_update` with default settings (no ceiling: one call per batch);
- checkpointing: `lean_update` with `gradient_checkpointing=True`;
- ceiling: `lean_update` with `max_padded_tokens` = 1/4 of the batch's padded size;
- checkpointing+ceiling: both.

    python benchmarks/train_checkpointing.py              # 3 repeats, batches of ~4,000 tokens
    python benchmarks/train_checkpointing.py --quick      # 1 repeat, smaller batch
Prints JSON and writes benchmarks/results/train_checkpointing.json. CPU only here:
on a GPU the same modes would be measured in peak GPU memory.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "train_checkpointing.json"
sys.path.insert(0, str(HERE))

from _report import command_line, work_folder  # noqa: E402

MODES = ["stock", "lean", "checkpointing", "ceiling", "checkpointing+ceiling"]


def build_model(work: Path, seed: int = 0, overrides=None) -> Path:
    """Save an initialised (untrained) transformer + ner pipeline once (`overrides`: more
    config overrides, e.g. oom_gpu.py's dropout 0)."""
    import spacy
    from spacy.training import Example
    from spacy.util import fix_random_seed
    from thinc.api import Config

    from spacy_lean import synthetic

    model = work / "model"
    if (model / "config.cfg").exists():
        return model
    bert = synthetic.make_tiny_transformer(
        work / "bert",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
    )
    fix_random_seed(seed)
    config = Config().from_str(
        synthetic.TRF_NER_CONFIG,
        overrides={
            "paths.transformer": str(bert),
            "components.transformer.model.get_spans.window": 128,
            "components.transformer.model.get_spans.stride": 96,
            **(overrides or {}),
        },
    )
    nlp = spacy.util.load_model_from_config(config, auto_fill=True, validate=True)
    docs = synthetic.make_ner_docs(nlp, 64, seed=seed + 1)
    nlp.initialize(lambda: [Example(nlp.make_doc(d.text), d) for d in docs])
    nlp.to_disk(model)
    return model


def make_batches(nlp, n_batches: int, batch_tokens: int, seed: int):
    """`n_batches` batches of at least `batch_tokens` tokens each, of generated docs. The
    docs are drawn until the batches are full (the generator's first docs do not depend on
    how many are drawn, so a small request gets the batches it always got)."""
    from spacy.training import Example

    from spacy_lean import synthetic

    n_docs = 40 * n_batches
    while True:
        docs = synthetic.make_ner_docs(nlp, n_docs, seed=seed, long_doc_rate=0.05)
        batches, current, tokens = [], [], 0
        for doc in docs:
            current.append(Example(nlp.make_doc(doc.text), doc))
            tokens += len(doc)
            if tokens >= batch_tokens:
                batches.append(current)
                current, tokens = [], 0
                if len(batches) == n_batches:
                    return batches
        n_docs *= 2


def child(mode: str, model: str, steps: int, batch_tokens: int, threads: int) -> dict:
    import spacy
    import torch
    from thinc.api import Adam

    sys.path.insert(0, str(HERE))
    from _procmem import proc_status, reset_peak

    from spacy_lean.memory import trim_host_memory
    from spacy_lean.training import UpdatePolicy, lean_update
    from spacy_lean.training.update import padded_size

    torch.set_num_threads(threads)
    nlp = spacy.load(model)
    batches = make_batches(nlp, steps + 1, batch_tokens, seed=7)
    optimizer = Adam(0.001)
    policy = None
    if mode != "stock":
        lengths = [len(eg.predicted) for eg in batches[0]]
        policy = UpdatePolicy(
            gradient_checkpointing="checkpointing" in mode,
            max_padded_tokens=padded_size(lengths) // 4 if "ceiling" in mode else None,
        )
    times, total_losses = [], {}
    for i, batch in enumerate(batches):
        if i == 1:
            trim_host_memory()  # so the warm-up's freed heap does not hide the step's peak
            rss_before = proc_status("VmRSS")
            peak_reset = reset_peak()
        start = time.perf_counter()
        losses = {}
        if policy is None:
            nlp.update(batch, sgd=False, losses=losses)
        else:
            lean_update(nlp, batch, losses=losses, policy=policy)
        for _, proc in nlp.pipeline:
            if getattr(proc, "is_trainable", False):
                proc.finish_update(optimizer)
        if i >= 1:
            times.append(time.perf_counter() - start)
            for key, value in losses.items():
                total_losses[key] = total_losses.get(key, 0.0) + float(value)
    peak = proc_status("VmHWM")
    lengths = [[len(eg.predicted) for eg in b] for b in batches[1:]]
    return {
        "mode": mode,
        "peak_rss_mb": peak / 2**20,
        "rss_before_steps_mb": rss_before / 2**20,
        "step_peak_mb": (peak - rss_before) / 2**20,
        "peak_mark_reset": peak_reset,
        "seconds_per_step": statistics.mean(times),
        "tokens_per_batch": [sum(x) for x in lengths],
        "padded_per_batch": [padded_size(x) for x in lengths],
        "losses": total_losses,
        "policy": policy.to_dict() if policy is not None else None,
    }


def run_child(mode: str, model: Path, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--model",
        str(model),
        "--steps",
        str(args.steps),
        "--batch-tokens",
        str(args.batch_tokens),
        "--threads",
        str(args.threads),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    load_before = os.getloadavg()
    start = time.time()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(
        wall_s=time.time() - start, load_avg_before=load_before, load_avg_after=os.getloadavg()
    )
    return result


def summarize(runs):
    by_mode = {}
    for mode in MODES:
        rows = [r for r in runs if r["mode"] == mode]
        if not rows:
            continue
        by_mode[mode] = {
            "step_peak_mb_median": statistics.median(r["step_peak_mb"] for r in rows),
            "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in rows),
            "seconds_per_step_median": statistics.median(r["seconds_per_step"] for r in rows),
            "repeats": len(rows),
        }
    stock = by_mode.get("stock")
    if stock:
        for mode, row in by_mode.items():
            for key, ratio in (("step_peak_mb", "step_peak"), ("seconds_per_step", "time")):
                row[f"{ratio}_ratio_to_stock"] = row[f"{key}_median"] / stock[f"{key}_median"]
    return by_mode


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--work", default=None, help="folder for the model, kept (default: a temp dir, removed)"
    )
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if args.child:
        result = child(args.child, args.model, args.steps, args.batch_tokens, args.threads)
        print(json.dumps(result))
        return
    if args.quick:
        args.repeats, args.batch_tokens, args.steps = 1, 1500, 2
    with work_folder(args.work, "train_ckpt_") as work:
        model = build_model(work)
        runs = []
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for mode in order:
                result = run_child(mode, model, args)
                result["repeat"] = repeat
                runs.append(result)
                print(
                    f"{mode:24s} step peak {result['step_peak_mb']:8.1f} MB  "
                    f"{result['seconds_per_step']:6.2f} s/step",
                    file=sys.stderr,
                )
    report = {
        "benchmark": "train_checkpointing",
        "command": command_line(__file__),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "gpu": None,
        },
        "settings": {
            "model": "BERT 4 layers x 256, strided spans 128/96, + ner (listener)",
            "batch_tokens": args.batch_tokens,
            "steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
        },
        "summary": summarize(runs),
        "runs": runs,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
