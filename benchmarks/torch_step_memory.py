"""Does the memory of a transformer training run grow with its number of steps? thinc
8.3's optimizer step of torch models (`PyTorchShim.finish_update`, which stock `spacy
train` runs) against spacy-lean's (`spacy_lean.training.torch_step`, installed by
`lean_update`), each in a fresh process: a BERT (4 layers, 64 wide: 71 torch
parameters) + ner pipeline, `nlp.update` with Adam on 8 generated docs a step, and at
every `--every` steps the torch tensors alive (gc), the in-use heap (glibc's
mallinfo2) and RSS. Reports the growth per 1,000 steps after the first `--every`
steps, per torch parameter, and what it comes to for BERT-base (199 parameters) over
20,000 steps. Prints JSON and writes benchmarks/results/torch_step_memory.json.

    python benchmarks/torch_step_memory.py [--steps 1000] [--every 100] [--work-dir DIR]
"""

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _procmem import proc_status  # noqa: E402
from _report import command_line, work_folder  # noqa: E402

BERT_BASE_PARAMS = 199


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
        + ("uordblks", "fordblks", "keepcost")
    ]


def heap_in_use() -> int:
    """Bytes of the glibc heap in use (mallinfo2's uordblks + hblkhd)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def child(work: Path, arm: str, steps: int, every: int) -> dict:
    import torch
    from spacy.training import Example
    from thinc.api import Adam

    from spacy_lean import synthetic
    from spacy_lean.training.torch_step import install_flat_torch_step, restore_thinc_torch_step

    torch.set_num_threads(1)
    install_flat_torch_step() if arm == "spacy_lean" else restore_thinc_torch_step()
    nlp = synthetic.build_trf_ner_pipeline(work / "bert", n_steps=0)
    docs = synthetic.make_ner_docs(nlp, 64, seed=1)
    examples = [Example(nlp.make_doc(d.text), d) for d in docs]
    optimizer = Adam(1e-4)
    trf = nlp.get_pipe("transformer")
    shim = next(node for node in trf.model.walk() if node.shims).shims[0]
    n_params = sum(1 for _ in shim._model.parameters())
    points = []
    for step in range(steps + 1):
        if step % every == 0:
            gc.collect()
            points.append(
                {
                    "step": step,
                    "tensors": sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)),
                    "heap_mb": round(heap_in_use() / 2**20, 2),
                    "rss_mb": round(proc_status("VmRSS") / 2**20, 1),
                }
            )
        if step < steps:
            batch = [examples[(step * 8 + k) % len(examples)] for k in range(8)]
            nlp.update(batch, sgd=optimizer)
    first, last = points[1], points[-1]
    per_k = 1000 / (last["step"] - first["step"])
    heap_per_k = (last["heap_mb"] - first["heap_mb"]) * per_k
    return {
        "arm": arm,
        "torch_parameters": n_params,
        "points": points,
        "tensors_per_step": round((last["tensors"] - first["tensors"]) * per_k / 1000, 2),
        "heap_mb_per_1000_steps": round(heap_per_k, 2),
        "rss_mb_per_1000_steps": round((last["rss_mb"] - first["rss_mb"]) * per_k, 1),
        "heap_bytes_per_parameter_step": round(heap_per_k * 2**20 / 1000 / n_params, 1),
        "bert_base_20k_steps_mb": round(heap_per_k / n_params * BERT_BASE_PARAMS * 20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--child", nargs=2, metavar=("WORK", "ARM"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--output", default=str(ROOT / "benchmarks" / "results" / "torch_step_memory.json")
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], args.steps, args.every)))
        return
    with work_folder(args.work_dir, "torch_step_memory-") as work:
        from spacy_lean import synthetic

        synthetic.make_tiny_transformer(
            work / "bert", hidden_size=64, num_hidden_layers=4, intermediate_size=128
        )
        arms = []
        for arm in ("thinc", "spacy_lean"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(work), arm]
                + ["--steps", str(args.steps), "--every", str(args.every)],
                capture_output=True,
                text=True,
                check=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            arms.append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {
        "benchmark": "torch_step_memory",
        "command": command_line(__file__),
        "settings": {"steps": args.steps, "every": args.every},
        "arms": arms,
    }
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.output).write_text(text + "\n", encoding="utf8")


if __name__ == "__main__":
    main()
