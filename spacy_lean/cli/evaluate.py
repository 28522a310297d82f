"""`spacy lean evaluate MODEL DATA`: streaming evaluation with checkpoints, out-of-memory
back-off and several workers."""

import contextlib
import hashlib
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy
import srsly
import typer
from spacy import util
from spacy.cli._util import Arg, Opt, import_code, setup_gpu
from wasabi import msg

from ..training.stopping import STOPPED_EXIT_CODE, StopRequest, signal_name
from . import lean_cli


class EvaluationStopped(KeyboardInterrupt):
    """A stop signal ended `spacy lean evaluate` with its progress (`n_examples` counted)
    saved in the checkpoint: in one process at a window's end; with --workers at once,
    keeping the finished units. A KeyboardInterrupt, so that it passes every `except
    Exception` and takes Ctrl-C's way out of the worker pool."""

    def __init__(self, signum: int, n_examples: int):
        self.signum, self.n_examples = signum, n_examples
        super().__init__(f"stopped by {signal_name(signum)} after {n_examples} examples")


# The summary table of `spacy evaluate`: label -> score key.
_METRICS = (
    ("TOK", "token_acc"),
    ("TAG", "tag_acc"),
    ("POS", "pos_acc"),
    ("MORPH", "morph_acc"),
    ("LEMMA", "lemma_acc"),
    ("UAS", "dep_uas"),
    ("LAS", "dep_las"),
    ("NER P", "ents_p"),
    ("NER R", "ents_r"),
    ("NER F", "ents_f"),
    ("TEXTCAT", "cats_score"),
    ("SENT P", "sents_p"),
    ("SENT R", "sents_r"),
    ("SENT F", "sents_f"),
    ("SPAN P", "spans_{key}_p"),
    ("SPAN R", "spans_{key}_r"),
    ("SPAN F", "spans_{key}_f"),
    ("SPEED", "speed"),
)


@lean_cli.command("evaluate")
def evaluate_cli(
    # fmt: off
    model: str = Arg(..., help="Pipeline name or path"),
    data_path: Path = Arg(..., help=(
        "Evaluation data: a .spacy file, a folder of .spacy shards, or a .jsonl file")),
    output: Optional[Path] = Opt(None, "--output", "-o", help=(
        "Output JSON file for the scores"), dir_okay=False),
    code_path: Optional[Path] = Opt(None, "--code", "-c", help=(
        "Path to Python file with additional code (registered functions) to be imported")),
    use_gpu: int = Opt(-1, "--gpu-id", "-g", help=(
        "GPU ID or -1 for CPU (with --workers: >= 0 uses every visible GPU)")),
    gold_preproc: bool = Opt(False, "--gold-preproc", "-G", help="Use gold preprocessing"),
    per_component: bool = Opt(False, "--per-component", "-P", help=(
        "Return scores per component (saved with --output)")),
    spans_key: str = Opt("sc", "--spans-key", "-sk", help=(
        "Spans key to use when evaluating Doc.spans")),
    batch_size: Optional[int] = Opt(None, "--batch-size", "-b", help=(
        "Docs per batch (default: the pipeline's batch_size)")),
    window_size: Optional[int] = Opt(None, "--window-size", help=(
        "Examples read ahead and sorted by length (default: 8 batches; 0 keeps the input order)")),
    max_batch_tokens: Optional[int] = Opt(None, "--max-batch-tokens", help=(
        "Memory budget of a batch in padded tokens, docs x longest doc (default: the transformer's "
        "max_batch_items, else 4096); a window holds at most as many tokens as its batches")),
    trim_slack_mb: float = Opt(0.0, "--trim-slack-mb", help=(
        "Hand the memory the C heap freed back to the OS only once resident memory has grown this "
        "many MB above its level right after the last trim (default 0: after every batch, the "
        "lowest peak; e.g. 16: less CPU time on many short docs, a slightly higher peak)")),
    trim_heap: bool = Opt(True, "--trim-heap/--no-trim-heap", help=(
        "Hand freed heap memory back to the OS at all (--no-trim-heap: never; the least CPU time, "
        "a peak that creeps up with the batches)")),
    memory_zones: bool = Opt(True, "--memory-zones/--no-memory-zones", help=(
        "Read the data in spaCy memory zones, so the vocab does not grow with its distinct words "
        "(--no-memory-zones: the vocab keeps every string read; the scores are the same)")),
    checkpoint: Optional[Path] = Opt(None, "--checkpoint", help=(
        "JSON file to save progress to; a rerun resumes from it"), dir_okay=False),
    checkpoint_every: int = Opt(50, "--checkpoint-every", help=(
        "Save the checkpoint every N batches (every N shards with --workers)")),
    workers: int = Opt(1, "--workers", "-w", help=(
        "Evaluate with N worker processes (or Ray actors), merging their scores")),
    backend: str = Opt("processes", "--backend", help=(
        "Where --workers run: 'processes' (this machine) or 'ray'")),
    ray_address: Optional[str] = Opt(None, "--ray-address", help=(
        "Ray cluster to join (default: RAY_ADDRESS, else a local one)")),
    max_retries: int = Opt(2, "--max-retries", help=(
        "Times a shard is retried when its worker dies")),
    progress: bool = Opt(True, "--progress/--no-progress", help="Show a progress bar"),
    # fmt: on
):
    """Evaluate a trained pipeline in bounded memory: the data is read a window at a
    time and reduced to mergeable counts, so the numbers are those of `spacy evaluate`
    whatever the size of the dev set. Resumable with --checkpoint; several workers with
    --workers (a folder of shards is shared out among them).
    """
    import_code(code_path)
    scores = evaluate_streaming_cli(
        model,
        data_path,
        output=output,
        code_path=code_path,
        use_gpu=use_gpu,
        gold_preproc=gold_preproc,
        per_component=per_component,
        spans_key=spans_key,
        batch_size=batch_size,
        window_size=window_size,
        max_batch_tokens=max_batch_tokens,
        trim_slack_mb=trim_slack_mb,
        trim_heap=trim_heap,
        memory_zones=memory_zones,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        workers=workers,
        backend=backend,
        ray_address=ray_address,
        max_retries=max_retries,
        progress=progress,
    )
    return scores


def evaluate_streaming_cli(
    model: str,
    data_path: Path,
    *,
    output: Optional[Path] = None,
    code_path: Optional[Path] = None,
    use_gpu: int = -1,
    gold_preproc: bool = False,
    per_component: bool = False,
    spans_key: str = "sc",
    batch_size: Optional[int] = None,
    window_size: Optional[int] = None,
    max_batch_tokens: Optional[int] = None,
    trim_slack_mb: float = 0.0,
    trim_heap: bool = True,
    memory_zones: bool = True,
    checkpoint: Optional[Path] = None,
    checkpoint_every: int = 50,
    workers: int = 1,
    backend: str = "processes",
    ray_address: Optional[str] = None,
    max_retries: int = 2,
    progress: bool = True,
) -> Dict[str, Any]:
    """The body of `spacy lean evaluate`; every user error ends in `msg.fail`."""
    from ..distributed import BACKENDS
    from ..corpus.sources import CorruptShardError, list_shards
    from ..streaming import CheckpointMismatchError, check_trim_slack_mb

    for name, value, low in (
        ("--workers", workers, 1),
        ("--checkpoint-every", checkpoint_every, 1),
        ("--batch-size", batch_size, 1),
        ("--window-size", window_size, 0),
        ("--max-batch-tokens", max_batch_tokens, 1),
        ("--max-retries", max_retries, 0),
    ):
        if value is not None and value < low:
            msg.fail(f"{name} must be >= {low}, got {value}.", exits=1)
    try:
        check_trim_slack_mb(trim_slack_mb)
    except ValueError:  # negative, inf or nan
        msg.fail(
            f"--trim-slack-mb must be a number of MB >= 0, got {trim_slack_mb:g}.",
            "Use 0 to trim the heap after every batch (the default: the lowest peak), e.g. "
            "--trim-slack-mb 16 to trim only once resident memory has grown 16 MB above its "
            "level after the last trim (less CPU time), or --no-trim-heap never to trim.",
            exits=1,
        )
    if not trim_heap and trim_slack_mb:
        msg.warn(
            f"--no-trim-heap: the heap is never trimmed; --trim-slack-mb {trim_slack_mb:g} unused"
        )
    # The evaluator's setting: None never trims. It does not change the scores, so a
    # checkpoint does not record it and a resumed run may use another.
    slack = trim_slack_mb if trim_heap else None
    if backend not in BACKENDS:
        msg.fail(f"Unknown --backend {backend!r}: use one of {', '.join(BACKENDS)}.", exits=1)
    if backend == "ray" and workers == 1:
        msg.info("--backend ray with --workers 1: one Ray actor")
    if not Path(data_path).exists():  # list_shards' message names a training config too
        msg.fail(
            "Evaluation data not found",
            f"'{data_path}' does not exist. Give a .spacy or .jsonl file, or a folder of them.",
            exits=1,
        )
    try:
        shards = list_shards(data_path)
    except (FileNotFoundError, ValueError) as e:
        msg.fail("Evaluation data not usable", f"{e}", exits=1)
    for option, path in (("--output", output), ("--checkpoint", checkpoint)):
        if path is None:
            continue
        # Before the evaluation: a folder that cannot be made would lose its results.
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            msg.fail(
                f"Cannot write the {option} file {path}",
                f"{e}. Give a path in a folder that exists or can be created.",
                exits=1,
            )
    gpu_ids: List[int] = []
    if workers == 1 and backend == "processes":
        try:
            setup_gpu(use_gpu)
        except ValueError as e:  # thinc's require_gpu: no cupy, or no GPU visible
            msg.fail(
                f"--gpu-id {use_gpu}: {e}",
                "Use --gpu-id -1 for CPU, or install cupy for your CUDA version "
                "(pip install spacy-lean[cuda12x]).",
                exits=1,
            )
    elif use_gpu >= 0:
        gpu_ids = _visible_gpus(use_gpu)
    nlp = _load_pipeline(model)
    state = _make_state(nlp, per_component)
    ckpt = None
    resumed = None
    if checkpoint is not None:
        from ..distributed import make_units

        single = workers == 1 and backend == "processes"
        layout = "stream" if single else _layout(make_units(shards, workers), data_path)
        ckpt = _make_checkpoint(
            model, nlp, shards, gold_preproc, checkpoint, checkpoint_every, layout
        )
        try:
            resumed = ckpt.load(nlp, state.fingerprint, per_component=per_component)
        except CheckpointMismatchError as e:
            msg.fail("Cannot resume from the checkpoint", str(e), exits=1)
    if slack is None:
        msg.info("Heap trimming off (--no-trim-heap): freed heap memory stays with the process")
    elif slack:
        msg.info(
            f"Heap trimmed once resident memory has grown {slack:g} MB above its level after the "
            "last trim"
        )
    start = time.perf_counter()
    try:
        if workers == 1 and backend == "processes":
            state, n_examples, empty_docs = _run_single(
                nlp,
                shards,
                state,
                ckpt,
                resumed,
                gold_preproc=gold_preproc,
                batch_size=batch_size,
                window_size=window_size,
                max_batch_tokens=max_batch_tokens,
                trim_slack_mb=slack,
                memory_zones=memory_zones,
                per_component=per_component,
                progress=progress,
            )
        else:
            state, n_examples, empty_docs = _run_workers(
                model,
                nlp,
                shards,
                state,
                ckpt,
                resumed,
                workers=workers,
                backend=backend,
                gpu_ids=gpu_ids,
                ray_address=ray_address,
                max_retries=max_retries,
                code_path=code_path,
                gold_preproc=gold_preproc,
                batch_size=batch_size,
                window_size=window_size,
                max_batch_tokens=max_batch_tokens,
                trim_slack_mb=slack,
                memory_zones=memory_zones,
                per_component=per_component,
                progress=progress,
            )
    except CorruptShardError as e:
        hint = (
            f" The progress so far is saved in {checkpoint}, and resumes on the same data: "
            "after re-creating the file, delete the checkpoint and start again."
            if ckpt
            else ""
        )
        msg.fail("Could not read the evaluation data", f"{e}{hint}", exits=1)
    except CheckpointMismatchError as e:
        msg.fail("Cannot resume from the checkpoint", str(e), exits=1)
    except EvaluationStopped as e:
        msg.warn(
            f"Stopped by {signal_name(e.signum)} after {e.n_examples} examples, saved in "
            f"{checkpoint}: rerun the same command to resume from there."
        )
        raise typer.Exit(code=STOPPED_EXIT_CODE)
    except KeyboardInterrupt:
        if ckpt is not None:
            msg.warn(f"Interrupted. Rerun the same command to resume from {checkpoint}.")
        raise typer.Exit(code=130)
    elapsed = time.perf_counter() - start
    if n_examples == 0:
        msg.fail(
            "The evaluation data has no examples",
            f"{data_path} holds no non-empty docs. Check that it is the dev set you meant "
            "(spacy convert / DocBin.to_disk writes .spacy files).",
            exits=1,
        )
    before = int(resumed.get("n_examples") or 0) if resumed else 0
    if resumed and resumed.get("units"):  # --workers: the finished units hold the counts
        before = _counted(resumed["units"])
    # Done, or every unit finished before a stop that came ahead of the final save.
    if resumed and (resumed.get("done") or n_examples == before):
        msg.good(f"All {n_examples} examples were evaluated by an earlier run ({checkpoint})")
    elif before:
        rate = (n_examples - before) / max(elapsed, 1e-9)
        msg.good(
            f"Evaluated {n_examples - before} examples in {elapsed:.1f}s ({rate:.1f} examples/s); "
            f"{before} more before, from {checkpoint}"
        )
    else:
        rate = n_examples / max(elapsed, 1e-9)
        msg.good(f"Evaluated {n_examples} examples in {elapsed:.1f}s ({rate:.1f} examples/s)")
    if empty_docs:
        msg.info(
            f"Skipped {empty_docs} empty doc(s) (no tokens) in {data_path}, as `spacy "
            "evaluate` skips them: they count for no score"
        )
    scores = state.result()
    _print_scores(scores, per_component=per_component, spans_key=spans_key, output=output)
    if output is not None:
        _write_scores(output, scores)
        msg.good(f"Saved results to {output}")
    return scores


def _write_scores(output: Path, scores: Dict[str, Any]) -> None:
    """Write --output as `spacy evaluate --output` does (srsly's JSON, byte for byte),
    except that a score that is not finite, on which srsly fails after the whole
    evaluation has run, is written as null (as spaCy writes a score it could not
    compute) and named in a warning."""
    not_finite: List[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, numpy.generic):
            value = value.item()  # a numpy scalar from a custom scorer
        if isinstance(value, float) and not math.isfinite(value):
            not_finite.append(f"{key} ({value})")
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{key}[{i}]") for i, v in enumerate(value)]
        return value

    srsly.write_json(output, clean(scores, ""))
    if not_finite:
        msg.warn(
            f"Scores that are not finite, written as null in {output}: " + ", ".join(not_finite)
        )


def _visible_gpus(use_gpu: int) -> List[int]:
    try:
        import torch

        n = torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        n = 0
    if n == 0:
        msg.fail(
            f"--gpu-id {use_gpu} with --workers: no CUDA GPU is visible.",
            "Use --gpu-id -1 for CPU workers.",
            exits=1,
        )
    return list(range(n))


def _load_pipeline(model: str):
    try:
        return util.load_model(model)
    except (IOError, OSError, ValueError) as e:
        msg.fail(f"Could not load the pipeline {model!r}", f"{e}", exits=1)


def _make_state(nlp, per_component: bool):
    from ..streaming import make_score_state

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = make_score_state(nlp, per_component=per_component)
    for warning in caught:
        msg.warn(str(warning.message))
    return state


def _model_fingerprint(model: str, nlp) -> str:
    from ..corpus.sources import path_fingerprint

    path = Path(model)
    if not path.exists():
        try:
            path = util.get_package_path(model)
        except Exception:  # not an installed package: config and meta identify it
            # Python's json writes every float exactly (srsly's keeps 10 digits).
            cfg = {"config": nlp.config.to_str(), "meta": nlp.meta}
            text = json.dumps(cfg, sort_keys=True, default=str)
            return hashlib.sha256(text.encode("utf8")).hexdigest()
    return path_fingerprint([path])


def _make_checkpoint(model, nlp, shards, gold_preproc, path, every, layout):
    from ..corpus.sources import path_fingerprint
    from ..streaming import EvalCheckpoint

    data_fp = path_fingerprint(shards) + (":gold_preproc" if gold_preproc else "")
    return EvalCheckpoint(
        path,
        model_fingerprint=_model_fingerprint(model, nlp),
        data_fingerprint=data_fp,
        layout=layout,
        every=every,
    )


def _layout(units, data_path: Path) -> str:
    """The units, named relative to the data path: the same data given as another path
    (relative, from another directory) has the same layout."""
    root = Path(data_path)

    def name(shard: str) -> str:
        path = Path(shard)
        return path.name if path == root else path.relative_to(root).as_posix()

    return "units:" + "|".join(f"{name(u.shard)}#{u.part[0]}/{u.part[1]}" for u in units)


def _progress_bar(progress: bool, unit: str, total: Optional[int] = None, initial: int = 0):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit=unit,
        disable=not progress,
        leave=False,
        dynamic_ncols=True,
    )


def _run_single(
    nlp,
    shards,
    state,
    ckpt,
    resumed,
    *,
    gold_preproc,
    batch_size,
    window_size,
    max_batch_tokens,
    trim_slack_mb,
    memory_zones,
    per_component,
    progress,
):
    from ..corpus.sources import read_examples
    from ..streaming import StreamingEvaluator

    skip = 0
    n_batches = 0
    if resumed is not None:
        state = resumed["state"]
        skip = resumed["n_examples"]
        n_batches = resumed["n_batches"]
        if resumed["done"]:
            msg.info(
                f"The checkpoint holds a finished evaluation of {skip} examples: showing "
                "its scores"
            )
            return state, skip, None
        msg.info(f"Resuming from the checkpoint: {skip} examples already counted")
    if ckpt is not None and window_size is None:
        # Save points fall at window ends: keep a window within one save interval.
        size = batch_size or nlp.batch_size
        window_size = min(8 * size, ckpt.every * size)

    def on_oom(failed: int, new: int) -> None:
        msg.warn(
            f"Out of GPU memory on a batch of {failed} docs: retrying it as batches of "
            f"{new} (and using {new} from now on)"
        )

    evaluator = StreamingEvaluator(
        nlp,
        batch_size=batch_size,
        window_size=window_size,
        max_batch_tokens=max_batch_tokens,
        per_component=per_component,
        state=state,
        on_oom=on_oom,
        trim_slack_mb=trim_slack_mb,
        memory_zones=memory_zones,
        copy_examples=False,  # the examples are made here and seen by no one else
    )
    msg.info(
        f"Memory budget: batches of at most {evaluator.max_batch_tokens:,} padded tokens "
        f"(docs x longest doc) and {evaluator.batch_size:,} docs; read-ahead windows of at "
        f"most {evaluator.window_tokens:,} tokens and {evaluator.window_size:,} docs"
    )
    evaluator.n_batches = n_batches
    bar = _progress_bar(progress, "doc", initial=skip)

    # With a checkpoint, SIGTERM (a scheduler's stop) ends the run at the end of the
    # current window, a save point, with the progress saved; without one it ends it at once.
    stop = StopRequest() if ckpt is not None else contextlib.nullcontext()

    def on_window(ev) -> None:
        bar.update(ev.n_examples - bar.n)
        if ckpt is not None:
            ckpt.on_window(ev)
            if stop.requested:
                ckpt.save(ev.state, n_examples=ev.n_examples, n_batches=ev.n_batches)
                raise EvaluationStopped(stop.signum, ev.n_examples)

    counts: Dict[str, int] = {}
    try:
        with stop:
            # Read from the start when resuming too (the skipped examples are read, not
            # scored): the count of empty docs covers all the data.
            examples = read_examples(nlp, shards, gold_preproc=gold_preproc, counts=counts)
            evaluator.run(examples, skip=skip, on_window=on_window)
    finally:
        bar.close()
    if evaluator.oom_events:
        msg.warn(
            f"{len(evaluator.oom_events)} out-of-memory retries: finished with batch size "
            f"{evaluator.batch_size} and {evaluator.max_batch_tokens} padded tokens. Pass "
            f"--batch-size {evaluator.batch_size} --max-batch-tokens "
            f"{evaluator.max_batch_tokens} next time."
        )
    if ckpt is not None:
        ckpt.save(
            evaluator.state,
            n_examples=evaluator.n_examples,
            n_batches=evaluator.n_batches,
            done=True,
        )
    return evaluator.state, evaluator.n_examples, counts["empty_docs"]


def _run_workers(
    model,
    nlp,
    shards,
    state,
    ckpt,
    resumed,
    *,
    workers,
    backend,
    gpu_ids,
    ray_address,
    max_retries,
    code_path,
    gold_preproc,
    batch_size,
    window_size,
    max_batch_tokens,
    trim_slack_mb,
    memory_zones,
    per_component,
    progress,
):
    import os

    from ..distributed import BackendUnavailableError, WorkerDiedError, WorkerSettings
    from ..distributed import make_units, merge_states, run_units

    units = make_units(shards, workers)
    done: Dict[int, Dict[str, Any]] = dict(resumed["units"]) if resumed else {}
    if done:
        msg.info(
            f"Resuming from the checkpoint: {len(done)} of {len(units)} shards already " "evaluated"
        )
    todo = [u for u in units if u.index not in done]
    from ..streaming import resolve_max_batch_tokens

    msg.info(
        f"Memory budget per worker: batches of at most "
        f"{resolve_max_batch_tokens(nlp, max_batch_tokens):,} "
        "padded tokens (docs x longest doc)"
    )
    n_workers = min(workers, len(todo)) if todo else 0
    where = f"{len(gpu_ids)} GPU(s)" if gpu_ids else "CPU"
    if todo:
        how = "Ray actor(s)" if backend == "ray" else "worker process(es)"
        msg.info(f"Evaluating {len(todo)} shard(s) on {n_workers} {how}, {where}")
    settings = WorkerSettings(
        model=str(model),
        gold_preproc=gold_preproc,
        batch_size=batch_size,
        window_size=window_size,
        max_batch_tokens=max_batch_tokens,
        trim_slack_mb=trim_slack_mb,
        memory_zones=memory_zones,
        per_component=per_component,
        code_path=str(code_path) if code_path else None,
        num_threads=max(1, (os.cpu_count() or 1) // max(1, n_workers)),
    )
    bar = _progress_bar(progress, "doc")
    since_save = 0

    def on_result(unit, result) -> None:
        nonlocal since_save
        done[unit.index] = {
            "state": result.state,
            "n_examples": result.n_examples,
            "empty_docs": result.empty_docs,
        }
        bar.update(result.n_examples)
        for failed, new in result.oom_events:
            msg.warn(
                f"{unit.describe()}: out of GPU memory on a batch of {failed} docs, retried "
                f"as batches of {new}"
            )
        since_save += 1
        if ckpt is not None and since_save >= ckpt.every:
            ckpt.save(state, units=done)
            since_save = 0

    def on_retry(retry, why) -> None:
        names = ", ".join(u.describe() for u in retry)
        msg.warn(f"{why}; evaluating again: {names} (nothing from them was counted)")

    def stop_now(signum: int) -> None:  # raised in the signal handler: at once
        raise EvaluationStopped(signum, 0)

    # With a checkpoint, SIGTERM ends the run at once keeping the finished units (a unit
    # is a whole file or part: waiting for the next one could take long).
    stop = StopRequest(on_signal=stop_now) if ckpt is not None else contextlib.nullcontext()
    try:
        with stop:
            run_units(
                todo,
                settings,
                workers=max(1, n_workers),
                backend=backend,
                gpu_ids=gpu_ids,
                max_retries=max_retries,
                ray_address=ray_address,
                on_result=on_result,
                on_retry=on_retry,
            )
    except (WorkerDiedError, BackendUnavailableError) as e:
        if ckpt is not None:
            ckpt.save(state, units=done)
        msg.fail("Evaluation failed", str(e), exits=1)
    except KeyboardInterrupt as e:
        # Finished units are whole: keep them, whether or not a save was due.
        if ckpt is not None:
            ckpt.save(state, units=done)
        if isinstance(e, EvaluationStopped):
            counted = _counted(done)
            raise EvaluationStopped(e.signum, counted) from None
        raise
    finally:
        bar.close()
    if ckpt is not None:
        ckpt.save(state, units=done, done=True)
    merged = merge_states({i: unit["state"] for i, unit in done.items()}, nlp, template=state)
    n_examples = _counted(done)
    # Unknown (None) where a unit was finished by a version that did not count them.
    known = all("empty_docs" in unit for unit in done.values())
    empty_docs = sum(unit.get("empty_docs", 0) for unit in done.values()) if known else None
    return merged, n_examples, empty_docs


def _counted(units: Dict[int, Dict[str, Any]]) -> int:
    """The examples counted in finished work units (as saved in a checkpoint)."""
    return sum(int(unit.get("n_examples", 0)) for unit in units.values())


def _print_scores(
    scores: Dict[str, Any], *, per_component: bool, spans_key: str, output: Optional[Path]
) -> None:
    from spacy.cli.evaluate import handle_scores_per_type

    if per_component:
        if output is None:
            msg.warn(
                "The per-component option is enabled but there is no output JSON file "
                "provided to save the scores to."
            )
        else:
            msg.info("Per-component scores will be saved to output JSON file.")
        return
    table = {}
    for label, key in _METRICS:
        key = key.format(key=spans_key)
        if key not in scores:
            continue
        value = scores[key]
        if key == "cats_score":
            label = f"{label} ({scores.get('cats_score_desc', 'unk')})"
        if isinstance(value, (int, float)):
            table[label] = f"{value:.0f}" if key == "speed" else f"{value * 100:.2f}"
        else:
            table[label] = "-"
    msg.table(table, title="Results")
    handle_scores_per_type(scores, {}, spans_key=spans_key, silent=False)
