"""Evaluation across workers: local processes or a Ray cluster.

The dev set is cut into units (one per shard; one file is cut into contiguous parts),
each worker evaluates its units with the streaming loop and sends back the score
state of each unit, and the driver merges the states in data order, so the numbers
(per-type order included) are those of a single worker. A unit is counted once: its
state is kept only when it finished, and a unit whose worker died is run again.
"""

import os
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ._compat import has_ray, require

BACKENDS = ("processes", "ray")


@dataclass(frozen=True)
class EvalUnit:
    """One piece of work: a data file, or the k-th of n contiguous parts of one."""

    index: int
    shard: str
    part: Tuple[int, int] = (0, 1)

    def describe(self) -> str:
        name = Path(self.shard).name
        return name if self.part == (0, 1) else f"{name} (part {self.part[0] + 1}/{self.part[1]})"


@dataclass
class WorkerSettings:
    """What a worker needs to load the pipeline and evaluate a unit (picklable)."""

    model: str
    gold_preproc: bool = False
    batch_size: Optional[int] = None
    window_size: Optional[int] = None
    max_batch_tokens: Optional[int] = None
    trim_slack_mb: Optional[float] = 0.0
    memory_zones: bool = True
    per_component: bool = False
    scorer_cfg: Optional[Dict[str, Any]] = None
    code_path: Optional[str] = None
    num_threads: Optional[int] = None
    use_gpu: bool = False


@dataclass
class UnitResult:
    index: int
    state: Dict[str, Any]
    n_examples: int
    n_words: int
    oom_events: List[Tuple[int, int]] = field(default_factory=list)
    pid: int = 0
    empty_docs: int = 0  # docs with no tokens, skipped


class WorkerDiedError(RuntimeError):
    """Units could not be evaluated because their workers kept dying."""


class BackendUnavailableError(RuntimeError):
    """The workers could not be started: e.g. no Ray cluster at the address given."""


def make_units(shards: Sequence[Union[str, Path]], workers: int) -> List[EvalUnit]:
    """Cut the data into units of work: one per file; a single file is cut into
    `workers` contiguous parts.

    shards (Sequence[Path]): the data files, in data order.
    workers (int): the number of workers.
    RETURNS (List[EvalUnit]): the units, in data order.
    """
    if len(shards) == 1 and workers > 1:
        return [EvalUnit(k, str(shards[0]), (k, workers)) for k in range(workers)]
    return [EvalUnit(i, str(shard)) for i, shard in enumerate(shards)]


# -- the worker side ----------------------------------------------------------

_WORKER: Dict[str, Any] = {}


def _load_worker_pipeline(settings: WorkerSettings, gpu_id: Optional[int] = None):
    """Load the pipeline once per worker process."""
    if _WORKER.get("model") == settings.model:
        return _WORKER["nlp"]
    import spacy
    from spacy.cli._util import import_code

    if settings.num_threads:
        try:
            import torch

            torch.set_num_threads(settings.num_threads)
        except ImportError:  # pragma: no cover
            pass
    if settings.code_path:
        import_code(Path(settings.code_path))
    if gpu_id is not None:  # pragma: no cover - needs a GPU
        spacy.require_gpu(gpu_id)
    nlp = spacy.load(settings.model)
    _WORKER.update(model=settings.model, nlp=nlp)
    return nlp


def _init_process_worker(settings: WorkerSettings, gpu_queue, started=None) -> None:
    gpu_id = gpu_queue.get() if gpu_queue is not None else None
    _WORKER["gpu_id"] = gpu_id
    _WORKER["started"] = started
    _load_worker_pipeline(settings, gpu_id)


def _evaluate_unit_in_pool(unit: EvalUnit, settings: WorkerSettings) -> UnitResult:
    """`evaluate_unit` in a process pool's worker, which first tells the parent that
    this unit started: when a worker dies, the pool fails every unit it had not
    finished, and only the started ones can be the cause."""
    started = _WORKER.get("started")
    if started is not None:
        started.put(unit.index)  # a pipe write, done before the unit can crash the process
    return evaluate_unit(unit, settings)


def evaluate_unit(
    unit: EvalUnit, settings: WorkerSettings, gpu_id: Optional[int] = None
) -> UnitResult:
    """Evaluate one unit with the streaming loop; runs in a worker.

    RETURNS (UnitResult): the unit's score state (as a dict) and counts.
    """
    from .corpus.sources import read_examples
    from .streaming import StreamingEvaluator

    nlp = _load_worker_pipeline(settings, gpu_id if gpu_id is not None else _WORKER.get("gpu_id"))
    oom_events: List[Tuple[int, int]] = []
    with warnings.catch_warnings():
        # The driver made the same score state and said it once: not once per unit.
        warnings.filterwarnings("ignore", message="spacy-lean: the scorer of component")
        evaluator = StreamingEvaluator(
            nlp,
            batch_size=settings.batch_size,
            window_size=settings.window_size,
            max_batch_tokens=settings.max_batch_tokens,
            trim_slack_mb=settings.trim_slack_mb,
            memory_zones=settings.memory_zones,
            per_component=settings.per_component,
            scorer_cfg=settings.scorer_cfg,
            on_oom=lambda failed, new: oom_events.append((failed, new)),
            copy_examples=False,  # read here, seen by no one else
        )
    counts: Dict[str, int] = {}
    examples = read_examples(
        nlp, [unit.shard], gold_preproc=settings.gold_preproc, part=unit.part, counts=counts
    )
    state = evaluator.run(examples)
    return UnitResult(
        unit.index,
        state.to_dict(),
        evaluator.n_examples,
        evaluator.n_words,
        oom_events,
        os.getpid(),
        counts["empty_docs"],
    )


class _RayEvalWorker:
    """A Ray actor: loads the pipeline once and evaluates the units sent to it."""

    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        _load_worker_pipeline(settings, 0 if settings.use_gpu else None)

    def evaluate(self, unit: EvalUnit) -> UnitResult:
        return evaluate_unit(unit, self.settings, 0 if self.settings.use_gpu else None)


# -- the driver side ----------------------------------------------------------


def run_units(
    units: Sequence[EvalUnit],
    settings: WorkerSettings,
    *,
    workers: int,
    backend: str = "processes",
    gpu_ids: Sequence[int] = (),
    max_retries: int = 2,
    ray_address: Optional[str] = None,
    on_result: Optional[Callable[[EvalUnit, UnitResult], None]] = None,
    on_retry: Optional[Callable[[List[EvalUnit], str], None]] = None,
) -> Dict[int, UnitResult]:
    """Evaluate units on `workers` workers and return the result of each.

    units (Sequence[EvalUnit]): the units still to evaluate.
    settings (WorkerSettings): how workers load and run the pipeline.
    workers (int): number of worker processes (or Ray actors).
    backend (str): "processes" (spawned local processes) or "ray".
    gpu_ids (Sequence[int]): GPUs for local workers, handed out round-robin; empty
        for CPU. With Ray, any non-empty value asks one GPU per actor.
    max_retries (int): how many times a unit is run again after its worker died.
    ray_address (Optional[str]): the Ray cluster to join (default: RAY_ADDRESS or a
        local one).
    on_result (Optional[Callable]): called on the driver with each finished unit.
    on_retry (Optional[Callable]): called with the units to run again and why.
    RETURNS (Dict[int, UnitResult]): results by unit index.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}: use one of {', '.join(BACKENDS)}.")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}.")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}.")
    if backend == "ray":
        return _run_ray(
            units, settings, workers, bool(gpu_ids), max_retries, ray_address, on_result, on_retry
        )
    return _run_processes(units, settings, workers, list(gpu_ids), max_retries, on_result, on_retry)


def _check_retries(
    attempts: Dict[int, int], units: List[EvalUnit], max_retries: int, why: str
) -> None:
    for unit in units:
        attempts[unit.index] = attempts.get(unit.index, 0) + 1
    failed = [u for u in units if attempts[u.index] > max_retries]
    if failed:
        names = ", ".join(u.describe() for u in failed)
        times = f"{max_retries + 1} time{'s' if max_retries else ''}"
        raise WorkerDiedError(
            f"Workers died {times} while evaluating {names} ({why}). Look "
            "for the cause in the worker's output (out of memory? a crash in a component?), "
            "or raise --max-retries."
        )


def _run_processes(units, settings, workers, gpu_ids, max_retries, on_result, on_retry):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    ctx = multiprocessing.get_context("spawn")
    pending = {unit.index: unit for unit in units}
    results: Dict[int, UnitResult] = {}
    attempts: Dict[int, int] = {}
    n_workers = min(workers, len(pending)) or 1
    while pending:
        started = ctx.SimpleQueue()  # the units a worker began (see _evaluate_unit_in_pool)
        gpu_queue = None
        if gpu_ids:
            gpu_queue = ctx.Queue()
            for i in range(n_workers):
                gpu_queue.put(gpu_ids[i % len(gpu_ids)])
        executor = ProcessPoolExecutor(
            max_workers=n_workers,
            mp_context=ctx,
            initializer=_init_process_worker,
            initargs=(settings, gpu_queue, started),
        )
        broken = None
        try:
            futures = {
                executor.submit(_evaluate_unit_in_pool, unit, settings): unit
                for unit in pending.values()
            }
            for future in as_completed(futures):
                unit = futures[future]
                try:
                    result = future.result()
                except BrokenProcessPool as e:
                    broken = e
                    continue
                results[unit.index] = result
                del pending[unit.index]
                if on_result is not None:
                    on_result(unit, result)
        except BaseException:
            # Ctrl-C or a stop signal: end the units still running instead of waiting for
            # them (their results would be dropped: nothing of an unfinished unit counts).
            _terminate_workers(executor)
            raise
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
        if pending:
            retry = sorted(pending.values(), key=lambda u: u.index)
            began = set()
            while not started.empty():
                began.add(started.get())
            # A broken pool fails every unit it had not finished, those still queued
            # too: only the units that had started (the one that crashed its worker,
            # and any running beside it) are charged an attempt and named.
            suspects = [u for u in retry if u.index in began] or retry
            died = f"a worker process died: {broken}" if broken else "a worker process died"
            _check_retries(attempts, suspects, max_retries, died)
            if on_retry is not None:
                names = ", ".join(u.describe() for u in suspects)
                on_retry(retry, f"{died} (while evaluating {names})")
    return results


def _terminate_workers(executor) -> None:
    terminate = getattr(executor, "terminate_workers", None)  # Python 3.14
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        if process.is_alive():
            process.terminate()


def _run_ray(units, settings, workers, use_gpu, max_retries, ray_address, on_result, on_retry):
    require(has_ray, "ray", "ray")
    import ray
    from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False)
        except ConnectionError as err:
            where = f"at --ray-address {ray_address}" if ray_address else "to start"
            raise BackendUnavailableError(
                f"No Ray cluster {where} ({err}). Start one on this machine with "
                "`ray start --head` and pass --ray-address auto, pass the address of a "
                "running cluster's head (--ray-address HOST:6379), or leave --ray-address "
                "out to start Ray inside this command."
            ) from None
    settings = WorkerSettings(**{**settings.__dict__, "use_gpu": use_gpu})
    actor_cls = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0, max_restarts=0)(_RayEvalWorker)
    queue = deque(sorted(units, key=lambda u: u.index))
    results: Dict[int, UnitResult] = {}
    attempts: Dict[int, int] = {}
    actors = [actor_cls.remote(settings) for _ in range(min(workers, len(queue)) or 1)]
    idle = list(actors)
    in_flight: Dict[Any, Tuple[EvalUnit, Any]] = {}
    try:
        while queue or in_flight:
            while queue and idle:
                actor = idle.pop()
                unit = queue.popleft()
                in_flight[actor.evaluate.remote(unit)] = (unit, actor)
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            unit, actor = in_flight.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except (RayActorError, WorkerCrashedError) as e:
                why = f"a Ray worker died: {type(e).__name__}"
                _check_retries(attempts, [unit], max_retries, why)
                if on_retry is not None:
                    on_retry([unit], why)
                queue.appendleft(unit)
                ray.kill(actor, no_restart=True)
                actors.remove(actor)
                replacement = actor_cls.remote(settings)
                actors.append(replacement)
                idle.append(replacement)
                continue
            except RayTaskError as e:
                raise e.as_instanceof_cause()
            results[unit.index] = result
            idle.append(actor)
            if on_result is not None:
                on_result(unit, result)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if started_here:
            ray.shutdown()
    return results


def merge_states(
    states: Dict[int, Dict[str, Any]],
    nlp,
    template=None,
    scorer_cfg: Optional[Dict[str, Any]] = None,
):
    """Merge the units' states in data order (so per-type dicts are ordered as one
    pass orders them).

    states (Dict[int, dict]): each unit's state (`to_dict`), by unit index.
    nlp (Language): the pipeline, to restore the states.
    template (Optional[PipelineScoreState]): an empty state to merge into.
    scorer_cfg (Optional[dict]): the scorer settings the states were made with.
    RETURNS (PipelineScoreState): the merged state.
    """
    from .scoring import PipelineScoreState

    merged = template
    for index in sorted(states):
        state = PipelineScoreState.from_dict(states[index], nlp, scorer_cfg)
        merged = state if merged is None else merged.merge(state)
    return merged


def evaluate_distributed(
    model: Union[str, Path],
    data: Union[str, Path, Sequence[Union[str, Path]]],
    *,
    workers: int = 2,
    backend: str = "processes",
    gold_preproc: bool = False,
    batch_size: Optional[int] = None,
    window_size: Optional[int] = None,
    max_batch_tokens: Optional[int] = None,
    trim_slack_mb: Optional[float] = 0.0,
    memory_zones: bool = True,
    per_component: bool = False,
    scorer_cfg: Optional[Dict[str, Any]] = None,
    code_path: Optional[Union[str, Path]] = None,
    gpu_ids: Sequence[int] = (),
    max_retries: int = 2,
    ray_address: Optional[str] = None,
    on_retry: Optional[Callable[[List[EvalUnit], str], None]] = None,
) -> Dict[str, Any]:
    """Evaluate a saved pipeline on sharded data across workers; the scores equal
    those of `spacy_lean.evaluate` in one process ("speed" is words per second of
    pipeline time, summed over workers, so it is per worker).

    model (Union[str, Path]): a pipeline name or path every worker can load.
    data: a .spacy/.jsonl file, a folder of shards, or a list of files; every worker
        must be able to read them (on a cluster: a shared file system).
    workers (int): processes or Ray actors.
    backend (str): "processes" or "ray".
    max_batch_tokens (Optional[int]): each worker's memory budget per batch in padded
        tokens (docs x longest doc); default the transformer's max_batch_items, else 4096.
    trim_slack_mb (Optional[float]): each worker's heap trimming: after every batch (0),
        only past this many MB above its working level, or never (None); see
        `spacy_lean.evaluate`.
    memory_zones (bool): each worker reads its share in spaCy memory zones (see
        `spacy_lean.evaluate`).
    RETURNS (Dict[str, Any]): the scores, as `Language.evaluate` returns them.
    """
    import spacy

    from .corpus.sources import list_shards
    from .streaming import check_trim_slack_mb, make_score_state

    check_trim_slack_mb(trim_slack_mb)  # here, not in every worker

    if isinstance(data, (str, Path)):
        shards = list_shards(data)
    else:
        shards = [Path(p) for p in data]
    nlp = spacy.load(model)
    state = make_score_state(nlp, scorer_cfg=scorer_cfg, per_component=per_component)
    settings = WorkerSettings(
        model=str(model),
        gold_preproc=gold_preproc,
        batch_size=batch_size,
        window_size=window_size,
        max_batch_tokens=max_batch_tokens,
        trim_slack_mb=trim_slack_mb,
        memory_zones=memory_zones,
        per_component=per_component,
        scorer_cfg=scorer_cfg,
        code_path=str(code_path) if code_path else None,
        num_threads=max(1, (os.cpu_count() or 1) // max(1, workers)),
    )
    results = run_units(
        make_units(shards, workers),
        settings,
        workers=workers,
        backend=backend,
        gpu_ids=gpu_ids,
        max_retries=max_retries,
        ray_address=ray_address,
        on_retry=on_retry,
    )
    states = {i: r.state for i, r in results.items()}
    return merge_states(states, nlp, template=state, scorer_cfg=scorer_cfg).result()
