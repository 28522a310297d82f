"""Which gradients of the transformer + ner pipeline are rounding noise, and how far two
summation orders move them (issue 10: `oom_gpu.py`'s gradient comparison on the GPU).

oom_gpu.py's pipeline (a local, randomly initialised BERT, 4 layers, 256 wide, + ner,
every source of randomness in an update off) accumulates the gradients of `--batches`
batches of generated docs, on the CPU:
- stock `nlp.update` with torch on 1 thread, again on 1 thread (must be identical), and on
  2 threads (another summation order in the matrix products: a stand-in for another
  device's kernels);
- `lean_update` on 1 thread (its length-sorted span groups: another grouping).

Reported: for each array its largest magnitude relative to the largest gradient anywhere
(the smallest `--show` of them), and each run's difference from the first, as oom_gpu.py
measures it (`gradient_differences`: arrays that carry a gradient relative to their own
largest value; BERT's self-attention key biases, zero in exact arithmetic, and any array
under 1e-7 of the scale, relative to the scale).

    python benchmarks/gradient_noise.py            # 2 batches of ~2,000 tokens
    python benchmarks/gradient_noise.py --batch-tokens 8000

Prints JSON and writes benchmarks/results/gradient_noise.json. The model is built in a
temporary folder, removed at the end (`--work DIR`: built there, or reused, and kept).
"""

import argparse
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "gradient_noise.json"
sys.path.insert(0, str(HERE))

from _report import command_line, print_and_save, work_folder  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=2000)
    parser.add_argument("--show", type=int, default=8, help="smallest arrays to list")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--work", type=Path, default=None, help="folder for the model, kept (default: a temp dir)"
    )
    args = parser.parse_args()
    with work_folder(args.work, "gradient_noise_") as work:
        result = measure(args, work)
    print_and_save(result, args.output)


def measure(args, work: Path) -> dict:
    import numpy
    import torch

    from oom_gpu import DETERMINISTIC, gradient_differences, gradients, load
    from train_checkpointing import build_model, make_batches

    from spacy_lean.training import UpdatePolicy, lean_update

    start = time.perf_counter()
    model = build_model(work, overrides=DETERMINISTIC)
    batches = make_batches(load(model, None), args.batches, args.batch_tokens, seed=7)

    def run(threads, lean=False):
        torch.set_num_threads(threads)
        nlp = load(model, None)
        for batch in batches:
            if lean:
                lean_update(nlp, batch, policy=UpdatePolicy())
            else:
                nlp.update(batch, sgd=False, losses={})
        return gradients(nlp)

    reference = run(1)
    runs = {
        "stock, 1 thread, again": run(1),
        "stock, 2 threads": run(2),
        "lean_update, 1 thread": run(1, lean=True),
    }
    magnitudes = {
        name: float(numpy.abs(grad).max()) for name, grad in reference if grad is not None
    }
    scale = max(magnitudes.values())
    smallest = sorted(magnitudes.items(), key=lambda item: item[1])[: args.show]
    return {
        "benchmark": "gradient_noise",
        "command": command_line(__file__),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "batches": [
            {"docs": len(b), "tokens": sum(len(eg.predicted) for eg in b)} for b in batches
        ],
        "scale": scale,
        "smallest_arrays": [
            {"name": name, "max_abs": value, "relative_to_scale": value / scale}
            for name, value in smallest
        ],
        "differences_from_stock_1_thread": {
            label: gradient_differences(grads, reference) for label, grads in runs.items()
        },
        "seconds": time.perf_counter() - start,
    }


if __name__ == "__main__":
    main()
