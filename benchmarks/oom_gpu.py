"""A real out-of-memory error on a GPU, in training and in evaluation (issue 10, part 1;
the streaming evaluator's back-off).

The pipeline is train_checkpointing.py's (a local, randomly initialised BERT, 4 layers,
256 wide, strided spans of 128 wordpieces, + ner), with every source of randomness in an
update off (the BERT's dropout 0, no random oracle cut) so that two runs can be compared.
On the GPU (`require_gpu`, cupy on torch's allocator, so torch's counters see every
allocation), each part measures uncapped first, then caps the process with
`torch.cuda.set_per_process_memory_fraction` so that it may reserve what it reserves plus
halfway between two needs (growths of the reserved memory, which is what the cap limits):
the whole does not fit, a quarter does. If nothing ran out of memory there (the allocator
found room), again with the cap a tenth of the way, then at the quarter's need.

Training:
1. uncapped: stock `nlp.update(batch, sgd=False)` on each of `--batches` batches,
   accumulating gradients (the reference), twice (the second run: how far two identical
   runs differ on this device); `lean_update` on the same batches (its length-sorted span
   groups need less than stock) and on a quarter of one: peaks, seconds;
2. capped between those two `lean_update` needs: `lean_update` on the same batches (a
   fresh copy of the same weights): its out-of-memory errors, splits and micro-batches,
   seconds, peak; its accumulated gradients against the reference (largest difference per
   array relative to the array's largest magnitude, and the arrays that differ most);
3. capped, stock `nlp.update` on the first batch must raise an out-of-memory error.

Evaluation (run first, before training leaves memory with room in it): every doc of the
batches, `--eval-repeat` times over, as one dev set, `spacy_lean.evaluate`'s evaluator with
one batch for all of them (no token budget, input order): uncapped (the reference scores,
and `nlp.evaluate`'s), then capped between its need and the need of a quarter of the docs
in one batch: its out-of-memory back-offs (batch sizes halved), and scores equal to the
reference.

    python benchmarks/oom_gpu.py                  # on a machine with CUDA
    python benchmarks/oom_gpu.py --quick          # smaller batches
    python benchmarks/oom_gpu.py --cpu-check      # no GPU: the cap replaced by a hook that
                                                  # raises torch's OutOfMemoryError above the
                                                  # midpoint in wordpieces per transformer call
                                                  # (checks the script, not the GPU; not saved)

Prints JSON and writes benchmarks/results/oom_gpu.json (with the device's name).
"""

import argparse
import gc
import json
import platform
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "oom_gpu.json"
sys.path.insert(0, str(HERE))

from _report import command_line, work_folder  # noqa: E402

# No randomness in an update: two runs of the same batches must give the same gradients.
DETERMINISTIC = {
    "components.transformer.model.transformer_config": {
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
    "components.ner.update_with_oracle_cut_size": 0,
}


def gradients(nlp):
    """Every gradient of the pipeline (thinc's and torch's), in the fixed order of the
    data-parallel loop's parameter list, as (name, numpy array); absent ones as None."""
    from spacy_lean.training.dist import collect_params

    named = [(entry.name, entry.grad_tensor()) for entry in collect_params(nlp)]
    return [(n, None if g is None else g.detach().cpu().numpy().copy()) for n, g in named]


# Gradients that are zero in exact arithmetic: a self-attention key bias adds q . b to
# every logit of a query's row, which softmax cancels. What is computed for them is
# rounding noise (on the CPU ~1e-11 of the largest gradient, six orders of magnitude
# below the next smallest array, the query biases), and two summation orders (another
# grouping, another device's kernels) give two different noises: their difference is
# compared with the gradient's scale, never with their own magnitude.
ZERO_IN_EXACT_ARITHMETIC = ("attention.self.key.bias",)
# Any other array whose largest value is below this fraction of the largest gradient
# anywhere is treated the same way.
NOISE_FRACTION = 1e-7


def no_comparison(value, **extra):
    """gradient_differences' verdicts where no array could be compared, all `value`
    (inf: an array in one run only; nan: a run that made no gradients)."""
    verdicts = ("relative", "near_zero", "near_zero_relative_to_scale")
    return {**{key: value for key in verdicts}, "worst": [], **extra}


def gradient_differences(got, expected):
    """How far two runs' gradients differ, as (got, expected) lists of (name, array).

    - "relative": the largest difference per array relative to that array's largest
      magnitude, over the arrays that carry a gradient;
    - "near_zero" and "near_zero_relative_to_scale": the largest absolute difference
      in the arrays whose gradient is zero in exact arithmetic (ZERO_IN_EXACT_ARITHMETIC,
      or below NOISE_FRACTION of the scale), and that relative to the scale;
    - "scale": the largest magnitude of any array; "relative_to_scale": the largest
      difference anywhere relative to it;
    - "worst": the five arrays that differ most relative to their magnitude, and
      "worst_near_zero": the near-zero arrays that differ most (name, shape, largest
      magnitude, largest difference), to tell float noise from a wrong gradient."""
    import numpy

    assert len(got) == len(expected), (len(got), len(expected))
    pairs = []
    for (name, a), (name_b, b) in zip(got, expected):
        assert name == name_b, (name, name_b)
        if a is None or b is None:
            if (a is None) != (b is None):
                return no_comparison(float("inf"), worst=[{"name": name}])
            continue
        if b.size:
            pairs.append((name, a, b))
    magnitudes = [float(numpy.abs(b).max()) for _, _, b in pairs]
    scale = max(magnitudes, default=0.0)
    relative, near_zero, largest_diff = 0.0, 0.0, 0.0
    rows, noise_rows = [], []
    for (name, a, b), magnitude in zip(pairs, magnitudes):
        diff = float(numpy.abs(a - b).max())
        largest_diff = max(largest_diff, diff)
        row = {"name": name, "shape": list(b.shape), "max_abs": magnitude, "max_abs_diff": diff}
        if name.endswith(ZERO_IN_EXACT_ARITHMETIC) or magnitude <= NOISE_FRACTION * scale:
            near_zero = max(near_zero, diff)
            # Shown, not judged: one noise against another, relative to itself.
            row["relative_to_itself"] = diff / magnitude if magnitude else None
            noise_rows.append(row)
        else:
            row["relative"] = diff / magnitude
            relative = max(relative, row["relative"])
            rows.append(row)
    rows.sort(key=lambda r: (r["relative"], r["max_abs_diff"]), reverse=True)
    noise_rows.sort(key=lambda r: r["max_abs_diff"], reverse=True)
    return {
        "relative": relative,
        "near_zero": near_zero,
        "near_zero_relative_to_scale": near_zero / scale if scale else 0.0,
        "relative_to_scale": largest_diff / scale if scale else 0.0,
        "scale": scale,
        "worst": rows[:5],
        "worst_near_zero": noise_rows[:5],
    }


class Device:
    """The GPU's counters, or (with --cpu-check) none."""

    def __init__(self, cpu_check: bool):
        import torch

        self.torch = torch
        self.cuda = not cpu_check
        if self.cuda:
            from thinc.api import require_gpu, set_gpu_allocator

            if not torch.cuda.is_available():
                raise SystemExit("No CUDA device: run on a GPU machine, or with --cpu-check.")
            require_gpu(0)
            set_gpu_allocator("pytorch")

    def name(self):
        return self.torch.cuda.get_device_name(0) if self.cuda else "cpu (--cpu-check)"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def release(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def start_peak(self) -> int:
        self.sync()
        self.reserved_growth = 0.0
        if not self.cuda:
            return 0
        self.torch.cuda.reset_peak_memory_stats()
        self._reserved_base = self.torch.cuda.memory_reserved()
        return self.torch.cuda.memory_allocated()

    def peak_since(self, base: int) -> float:
        """The peak of allocated memory since `start_peak`, in MB; the peak growth of
        the reserved memory (what the cap limits) is left in `reserved_growth`."""
        self.sync()
        if not self.cuda:
            return 0.0
        cuda = self.torch.cuda
        self.reserved_growth = (cuda.max_memory_reserved() - self._reserved_base) / 2**20
        return (cuda.max_memory_allocated() - base) / 2**20

    def reserved_mb(self) -> float:
        return self.torch.cuda.memory_reserved() / 2**20 if self.cuda else 0.0

    def allocated_mb(self) -> float:
        return self.torch.cuda.memory_allocated() / 2**20 if self.cuda else 0.0


class WordpieceCounter:
    """A forward pre-hook on the pipeline's Hugging Face model: records the wordpieces
    of every call and (raise_above) raises torch's OutOfMemoryError above that many."""

    def __init__(self, nlp, raise_above=None):
        self.sizes = []
        self.raise_above = raise_above
        model = nlp.get_pipe("transformer").model.transformer
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        self.sizes.append(int(ids.numel()))
        if self.raise_above is not None and ids.numel() > self.raise_above:
            raise torch.OutOfMemoryError("CUDA out of memory (--cpu-check: simulated)")

    def remove(self):
        self.handle.remove()


def load(model, device):
    import spacy

    from spacy_lean.training import install_exact_parser_gradient

    nlp = spacy.load(model)
    # lean_update installs it too: the stock W gradient of the ner's lower layer depends
    # on the grouping of examples, in one process as well (tests/test_train_oom.py).
    install_exact_parser_gradient(nlp)
    return nlp


class Cap:
    """Within the block, the process may hold `cap_mb` of GPU memory (or, with
    --cpu-check, the pipelines' transformers raise torch's error above `wordpieces` per
    call)."""

    def __init__(self, device, cap_mb, wordpieces, nlps):
        self.device, self.cap_mb, self.wordpieces, self.nlps = device, cap_mb, wordpieces, nlps
        self.hooks = []

    def __enter__(self):
        torch = self.device.torch
        if self.device.cuda:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(self.cap_mb * 2**20 / total, 0)
        else:
            self.hooks = [WordpieceCounter(nlp, raise_above=self.wordpieces) for nlp in self.nlps]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        if self.device.cuda:
            self.device.torch.cuda.set_per_process_memory_fraction(1.0, 0)


def cap_between(device, small_need, large_need, small_calls, large_calls, args, at=0.5):
    """The cap at `at` of the way between two needs (peak growths of the reserved
    memory, which is what set_per_process_memory_fraction limits), over what the process
    reserves now; and the --cpu-check limit midway between two largest transformer
    calls. (Allocated peaks are the wrong currency: the reserved memory held between
    runs has free room in its segments, which a run's allocations reuse; the first GPU
    run capped that way never ran out of memory.)"""
    device.release()
    held = device.reserved_mb()
    wordpieces = args.cpu_check_limit or (max(small_calls) + max(large_calls)) // 2
    return held + small_need + at * (large_need - small_need), wordpieces


def cap_fractions(device):
    """Where the caps sit between the quarter's need (0) and the whole's (1), tried in
    turn until something runs out of memory. The --cpu-check hook raises at the midpoint
    in wordpieces, which always binds."""
    return (0.5, 0.1, 0.0) if device.cuda else (0.5,)


def timed(device, func, *args, **kwargs):
    """(result, seconds, peak MB since the call began)."""
    base = device.start_peak()
    start = time.perf_counter()
    result = func(*args, **kwargs)
    device.sync()
    return result, time.perf_counter() - start, device.peak_since(base)


def lean_updater(nlp):
    """`lean_update` of `nlp` on a batch, with a fresh policy each time (nothing learnt
    from one batch carries over to the next, as in stock `nlp.update`)."""
    from spacy_lean.training import UpdatePolicy, lean_update

    return lambda batch: lean_update(nlp, batch, policy=UpdatePolicy())


def training(args, device, model, batches) -> dict:
    from spacy_lean.training import OOMSplitWarning, UpdatePolicy, lean_update

    # 1. Uncapped. Each batch starts from an emptied cache, so that its growth of the
    # reserved memory is its whole need.
    def uncapped_pass(update, **kwargs):
        """(seconds, peaks, reserved-memory needs) of `update(batch, **kwargs)` per batch."""
        seconds, peaks, needs = [], [], []
        for batch in batches:
            device.release()
            _, took, peak = timed(device, update, batch, **kwargs)
            seconds.append(took)
            peaks.append(peak)
            needs.append(device.reserved_growth)
        return seconds, peaks, needs

    def stock_pass():
        nlp, losses = load(model, device), {}
        seconds, peaks, _ = uncapped_pass(nlp.update, sgd=False, losses=losses)
        grads = gradients(nlp)
        del nlp
        device.release()
        return losses, seconds, peaks, grads

    ref_losses, stock_seconds, stock_peaks, ref_grads = stock_pass()
    # The same updates again: how far two identical runs differ on this device, the
    # floor for comparing lean_update's gradients with stock's.
    _, rerun_seconds, _, rerun_grads = stock_pass()
    rerun = gradient_differences(rerun_grads, ref_grads)
    del rerun_grads
    uncapped = load(model, device)
    calls = WordpieceCounter(uncapped)
    uncapped_seconds, uncapped_peaks, uncapped_needs = uncapped_pass(lean_updater(uncapped))
    calls.remove()
    del uncapped
    device.release()
    quarter_nlp = load(model, device)
    quarter_calls = WordpieceCounter(quarter_nlp)
    quarter = batches[0][: max(1, len(batches[0]) // 4)]
    device.release()
    _, _, quarter_peak = timed(device, lean_update, quarter_nlp, quarter, policy=UpdatePolicy())
    quarter_need = device.reserved_growth
    quarter_calls.remove()
    del quarter_nlp

    # 2. Capped: a whole batch does not fit (lean_update's included), a quarter does. The
    # cap sits halfway between the two needs; if no batch ran out of memory there (the
    # allocator found room), a tenth of the way, then at the quarter's need.
    def capped_run(at):
        lean = load(model, device)
        stock = load(model, device)
        cap_mb, wordpieces = cap_between(
            device, quarter_need, min(uncapped_needs), quarter_calls.sizes, calls.sizes, args, at
        )
        run = {
            "cap_mb": cap_mb,
            "wordpieces": wordpieces,
            "policy": UpdatePolicy(),
            "losses": {},
            "seconds": [],
            "peaks": [],
            "grads": None,
            "error": None,
        }
        with Cap(device, cap_mb, wordpieces, [lean, stock]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", OOMSplitWarning)
                try:
                    for batch in batches:
                        _, seconds, peak = timed(
                            device,
                            lean_update,
                            lean,
                            batch,
                            losses=run["losses"],
                            policy=run["policy"],
                        )
                        run["seconds"].append(seconds)
                        run["peaks"].append(peak)
                    run["grads"] = gradients(lean)
                except Exception as err:  # e.g. BatchTooLargeError: one doc does not fit
                    run["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            run["warnings"] = sorted(
                {str(w.message) for w in caught if issubclass(w.category, OOMSplitWarning)}
            )
            del lean
            device.release()
            # 3. Stock, capped: it dies of the first batch.
            run["stock_error"] = None
            try:
                stock.update(batches[0], sgd=False)
            except Exception as err:  # torch's or cupy's out-of-memory error
                run["stock_error"] = f"{type(err).__module__}.{type(err).__name__}"
        del stock
        device.release()
        return run

    attempts = []
    for at in cap_fractions(device):
        run = capped_run(at)
        oom_errors = run["policy"].stats()["oom_errors"]
        attempts.append(
            {"cap_mb": run["cap_mb"], "at": at, "oom_errors": oom_errors, "error": run["error"]}
        )
        if oom_errors or run["error"]:
            break
    policy, lean_seconds = run["policy"], run["seconds"]
    if run["grads"] is None:  # lean_update failed under the cap: nothing to compare
        diffs = no_comparison(float("nan"), error=run["error"])
    else:
        diffs = gradient_differences(run["grads"], ref_grads)
    return {
        "stock_peak_mb": stock_peaks,
        "lean_uncapped_peak_mb": uncapped_peaks,
        "lean_quarter_batch_peak_mb": quarter_peak,
        "reserved_growth_mb": {"whole": uncapped_needs, "quarter": quarter_need},
        "cap_mb": run["cap_mb"] if device.cuda else None,
        "cap_attempts": attempts if device.cuda else None,
        "cpu_check_wordpiece_limit": None if device.cuda else run["wordpieces"],
        "largest_transformer_call_wordpieces": {
            "whole": max(calls.sizes),
            "quarter": max(quarter_calls.sizes),
        },
        "stock_seconds": stock_seconds,
        "stock_rerun_seconds": rerun_seconds,
        "lean_uncapped_seconds": uncapped_seconds,
        "lean_capped_seconds": lean_seconds,
        "lean_capped_peak_mb": run["peaks"],
        "lean_capped_time_ratio_to_stock": sum(lean_seconds) / sum(rerun_seconds),
        "lean_uncapped_time_ratio_to_stock": sum(uncapped_seconds) / sum(rerun_seconds),
        "policy": policy.stats(),
        "learned_limits": {str(k): v for k, v in policy.learned_limits.items()},
        "warnings": run["warnings"],
        "lean_update_under_cap": run["error"] or "finished",
        "stock_update_under_cap": run["stock_error"] or "finished (the cap did not bind)",
        "max_relative_gradient_difference": diffs["relative"],
        "max_abs_difference_of_near_zero_gradients": diffs["near_zero"],
        "near_zero_gradient_difference_relative_to_scale": diffs["near_zero_relative_to_scale"],
        "gradient_differences": diffs,
        "stock_rerun_gradient_differences": rerun,
        "losses": {
            "stock": {k: float(v) for k, v in ref_losses.items()},
            "lean": {k: float(v) for k, v in run["losses"].items()},
        },
    }


def evaluation(args, device, model, batches) -> dict:
    from spacy.training import Example

    from spacy_lean.streaming import StreamingEvaluator

    nlp = load(model, device)
    # The docs --eval-repeat times over: one batch of them needs far more than the room
    # left in the segments the process holds (a dev batch of the training batches'
    # 306 docs peaked at 67 MB on the H100), so that the cap can tell a whole batch
    # from a quarter.
    golds = [eg.reference for batch in batches for eg in batch] * args.eval_repeat

    def examples(docs):
        return [Example(nlp.make_doc(doc.text), doc) for doc in docs]

    events = []

    def evaluator(size):
        # One batch of `size` docs in the input order, no token budget: the cap alone
        # decides whether it fits.
        return StreamingEvaluator(
            nlp,
            batch_size=size,
            window_size=0,
            max_batch_tokens=10**9,
            on_oom=lambda failed, new: events.append((failed, new)),
        )

    stock_scores, stock_seconds, stock_peak = timed(
        device, nlp.evaluate, examples(golds), batch_size=len(golds)
    )
    # Again, warm: the first evaluation of the process also compiles kernels.
    _, stock_warm_seconds, _ = timed(device, nlp.evaluate, examples(golds), batch_size=len(golds))
    calls = WordpieceCounter(nlp)
    whole = evaluator(len(golds))
    device.release()
    slack = device.reserved_mb() - device.allocated_mb()
    _, whole_seconds, whole_peak = timed(device, whole.run, examples(golds))
    whole_need = device.reserved_growth
    reference = whole.state.result()
    calls.remove()
    quarter_golds = golds[: max(1, len(golds) // 4)]
    quarter_calls = WordpieceCounter(nlp)
    quarter = evaluator(len(quarter_golds))
    device.release()
    _, _, quarter_peak = timed(device, quarter.run, examples(quarter_golds))
    quarter_need = device.reserved_growth
    quarter_calls.remove()
    del whole, quarter
    # Halfway between the two needs; if the whole batch fitted there, a tenth of the way,
    # then at the quarter's need (as in training).
    attempts = []
    for at in cap_fractions(device):
        cap_mb, wordpieces = cap_between(
            device, quarter_need, whole_need, quarter_calls.sizes, calls.sizes, args, at
        )
        events.clear()
        capped, error = evaluator(len(golds)), None
        with Cap(device, cap_mb, wordpieces, [nlp]):
            try:
                _, capped_seconds, capped_peak = timed(device, capped.run, examples(golds))
            except Exception as err:  # one doc does not fit even alone
                error, capped_seconds, capped_peak = f"{type(err).__name__}: {err}"[:300], 0, 0
        attempts.append({"cap_mb": cap_mb, "at": at, "oom_backoffs": len(events), "error": error})
        if events or error:
            break
    scores = capped.state.result()
    differ = sorted(
        key
        for key in reference
        if key != "speed"
        and json.dumps(scores.get(key), sort_keys=True)
        != json.dumps(reference[key], sort_keys=True)
    )
    return {
        "docs": len(golds),
        "nlp_evaluate_peak_mb": stock_peak,
        "nlp_evaluate_seconds": stock_seconds,
        "nlp_evaluate_warm_seconds": stock_warm_seconds,
        "evaluator_under_cap": error or "finished",
        "uncapped_peak_mb": whole_peak,
        "uncapped_seconds": whole_seconds,
        "quarter_peak_mb": quarter_peak,
        "reserved_growth_mb": {"whole": whole_need, "quarter": quarter_need},
        # Free room in the segments held before the whole batch ran: what a batch may
        # use without growing the reserved memory, which is what the cap limits.
        "held_free_mb": slack,
        "cap_mb": cap_mb if device.cuda else None,
        "cap_attempts": attempts if device.cuda else None,
        "cpu_check_wordpiece_limit": None if device.cuda else wordpieces,
        "capped_peak_mb": capped_peak,
        "capped_seconds": capped_seconds,
        "oom_backoffs": [list(pair) for pair in events],
        "final_batch_size": capped.batch_size,
        "scores_differing_from_uncapped": differ,
        "scores_differing_from_nlp_evaluate": sorted(
            key
            for key in stock_scores
            if key != "speed"
            and json.dumps(reference.get(key), sort_keys=True)
            != json.dumps(stock_scores[key], sort_keys=True)
        ),
        "ents_f": scores.get("ents_f"),
        "ents_p": scores.get("ents_p"),
    }


def run(args, work: Path) -> dict:
    import torch

    from train_checkpointing import build_model, make_batches

    device = Device(args.cpu_check)
    model = build_model(work, overrides=DETERMINISTIC)
    nlp = load(model, device)
    batches = make_batches(nlp, args.batches, args.batch_tokens, seed=7)
    del nlp
    device.release()
    # Evaluation first: after training, the memory the process still holds has room in
    # its segments where a dev batch fits whatever the cap (the H100 run of 2026-11-27:
    # the whole dev set in one batch grew the reserved memory by 6 MB, a quarter of it by
    # 8 MB, and no cap made it back off).
    evaluated = evaluation(args, device, model, batches)
    device.release()
    return {
        "benchmark": "oom_gpu",
        "command": command_line(__file__),
        "device": device.name(),
        "cpu_check": args.cpu_check,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },
        "model": "BERT 4 layers x 256 (random init, local WordPiece vocab) + ner; spans of 128",
        "batches": [
            {
                "docs": len(b),
                "tokens": sum(len(eg.predicted) for eg in b),
                "longest": max(len(eg.predicted) for eg in b),
            }
            for b in batches
        ],
        "training": training(args, device, model, batches),
        "evaluation": evaluated,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=8000)
    parser.add_argument("--quick", action="store_true", help="batches of ~2,000 tokens")
    parser.add_argument(
        "--eval-repeat",
        type=int,
        default=8,
        help="the evaluation part's dev set: the training batches' docs this many times",
    )
    parser.add_argument(
        "--cpu-check",
        action="store_true",
        help="no GPU: a simulated out-of-memory error (checks the script; not saved)",
    )
    parser.add_argument(
        "--cpu-check-limit",
        type=int,
        default=0,
        help="--cpu-check: wordpieces per transformer call above which it "
        "raises (default: midway between the largest calls on a quarter and on "
        "the whole)",
    )
    parser.add_argument(
        "--work", default=None, help="folder for the model, kept (default: a temp dir, removed)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"where to write the JSON (default {RESULTS}; --cpu-check: nowhere)",
    )
    args = parser.parse_args()
    if args.quick:
        args.batch_tokens = 2000
    with work_folder(args.work, "oom_gpu_") as work:
        result = run(args, work)
    print(json.dumps(result, indent=2))
    output = args.output or (None if args.cpu_check else RESULTS)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2), encoding="utf8")


if __name__ == "__main__":
    main()
