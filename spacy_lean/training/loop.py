"""The training loop of `spacy lean train`: spaCy's `train` / `train_while_improving`
(spacy/training/loop.py) made data-parallel and resumable.

Per global step every rank takes its next batch from its own share of the training
corpus, runs `lean_update` (gradients accumulate, no optimizer step), the gradients of
every parameter are summed over the ranks (`GradientReducer`), and every rank steps
its optimizer with the same gradients, so all ranks keep identical weights. The dev
set is scored in shares with the streaming evaluator and the score states are merged,
so the score is the one of a single process. Only rank 0 logs and writes.
"""

import copy
import functools
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from timeit import default_timer as timer
from typing import (
    IO,
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    NoReturn,
    Optional,
    Sequence,
    Tuple,
)

import numpy
from spacy.errors import Errors
from spacy.language import Language
from spacy.pipeline import EntityLinker
from spacy.pipeline.transition_parser import Parser
from spacy.schemas import ConfigSchemaTraining
from spacy.training import Example
from spacy.training.loop import (
    DIR_MODEL_BEST,
    DIR_MODEL_LAST,
    clean_output_dir,
    create_before_to_disk_callback,
    subdivide_batch,
    update_meta,
)
from spacy.util import registry, resolve_dot_names
from thinc.api import constant, fix_random_seed, set_gpu_allocator
from wasabi import Printer

from ..corpus.batcher import TokenBudgetBatcher
from .dist import (
    OPTIMIZER_FILE,
    STATE_FIX,
    DistContext,
    GradientReducer,
    ParamEntry,
    TrainingStateError,
    agree_on_overflow,
    collect_params,
    grad_scalers,
    load_optimizer,
    save_optimizer,
    trainable_components,
)
from .callbacks import get_update_policy
from .launch import launched_by_us
from .stopping import TRAINING_STOP_SIGNALS, StopRequest, TrainingStopped, say_stopping
from .update import (
    UpdatePolicy,
    lean_update,
    linker_learns,
    linkers_learn_linked_entities,
    loss_denominator,
    loss_reduction,
)

DIR_STATE = "training-state"
STATE_FILE = "state.json"
STATE_FORMAT = "spacy-lean.train-state.v1"
# The highest step a saved state may be at. A resumed run replays the schedules (learn
# rate, dropout) step by step, about 0.7 microseconds a step: 10**9 steps take some
# 12 minutes, far more steps than any run makes.
MAX_RESUMED_STEP = 10**9


# -- data: each rank's share ------------------------------------------------------


def _reader_shares_itself(corpus, ctx: DistContext, what: str) -> bool:
    """Whether the reader already yields only this rank's share
    (`spacy-lean.Corpus.v1` reads torch.distributed's rank); else the loop keeps every
    world-size-th example itself."""
    from ..corpus.reader import LeanCorpus

    if not isinstance(corpus, LeanCorpus) or not ctx.active:
        return False
    rank, size = corpus.rank_and_size
    if (rank, size) == (ctx.rank, ctx.world_size):
        return True
    if size == 1:
        return False
    raise ValueError(
        f"[{what}] sets instance_rank={rank}, num_instances={size}, but this run has "
        f"{ctx.world_size} ranks (this is rank {ctx.rank}). Set both to null: the reader "
        "then takes its share from torch.distributed."
    )


def _share(
    examples,
    ctx: DistContext,
    shares_itself: bool,
    on_pass: Optional[Callable[[int, int], None]] = None,
):
    """This rank's examples: every world-size-th one, unless the reader shares itself.
    `on_pass(n_read, n_kept)` is called once a whole pass of the reader is read."""
    if shares_itself or not ctx.active:
        yield from examples
        return
    n_read = n_kept = 0
    for i, eg in enumerate(examples):
        n_read += 1
        if i % ctx.world_size == ctx.rank:
            n_kept += 1
            yield eg
    if on_pass is not None:
        on_pass(n_read, n_kept)


def _corpus_name(corpus, config: Optional[Dict[str, Any]], dotted: str) -> str:
    """How a message names a reader: its registered name and path, e.g.
    `[corpora.train] (spacy.Corpus.v1, corpus/train.spacy)`."""
    section: Any = config
    for key in dotted.split("."):
        section = section.get(key) if isinstance(section, dict) else None
    reader = section.get("@readers") if isinstance(section, dict) else None
    details = [str(x) for x in (reader, getattr(corpus, "path", None)) if x is not None]
    return f"[{dotted}]" + (f" ({', '.join(details)})" if details else "")


def _corpus_fingerprint(corpus) -> Optional[str]:
    """The training corpus's files by name, size and contents (samples of 64 KB at the
    start, middle and end of a file over 512 KB: `path_fingerprint`), for a resume on
    another corpus; None where the reader reads no path on disk."""
    from ..corpus.sources import path_fingerprint

    path = getattr(corpus, "path", None)
    paths = list(path) if isinstance(path, (list, tuple)) else [path]
    if not paths or not all(isinstance(p, (str, Path)) and Path(p).exists() for p in paths):
        return None
    try:
        return path_fingerprint(paths, sample_bytes=1 << 16)
    except OSError:
        return None


class _SizeDraws:
    """A batch-size schedule that is a generator (thinc's `compounding`, `decaying`):
    spaCy's batchers and `batch_by_tokens` call `iter(size)` once per epoch and so go
    on drawing from it across epochs. Counted, a resumed run draws as many as the saved
    run had before the epoch it resumes in; a look-ahead's draws are given back."""

    def __init__(self, schedule: Iterator) -> None:
        self._schedule = schedule
        self.drawn = 0
        self._given_back: List[Any] = []
        self._log: Optional[List[Any]] = None

    def __iter__(self) -> "_SizeDraws":
        return self

    def __next__(self) -> Any:
        value = self._given_back.pop() if self._given_back else next(self._schedule)
        self.drawn += 1
        if self._log is not None:
            self._log.append(value)
        return value

    def skip(self, n: int) -> None:
        for _ in range(n):
            next(self)

    @contextmanager
    def look_ahead(self) -> Iterator[None]:
        log: List[Any] = []
        drawn, self._log = self.drawn, log
        try:
            yield
        finally:
            self._log = None
            self._given_back.extend(reversed(log))
            self.drawn = drawn


def _count_size_draws(batcher) -> Tuple[Any, Optional[_SizeDraws]]:
    """The batcher with its `size` counted where that is a generator (a list or an int
    starts afresh every epoch: nothing to count), found on a spaCy batcher
    (`functools.partial(..., size=...)`) or `batch_by_tokens`' `size`; any other batcher
    is left as it is (a custom one may hold its schedule where setting it would fail)."""
    if isinstance(batcher, functools.partial):
        size = batcher.keywords.get("size")
        if _is_generator_like(size):
            draws = _SizeDraws(size)
            kwargs = {**batcher.keywords, "size": draws}
            return functools.partial(batcher.func, *batcher.args, **kwargs), draws
    elif isinstance(batcher, TokenBudgetBatcher) and _is_generator_like(batcher.size):
        draws = _SizeDraws(batcher.size)
        batcher.size = draws
        return batcher, draws
    return batcher, None


def _is_generator_like(size: Any) -> bool:
    """An iterator (its own `iter`): an int or None is not iterable, a list is not its
    own iterator."""
    try:
        return iter(size) is size
    except TypeError:
        return False


class RankBatches:
    """The batches of this rank, epoch by epoch, as spaCy's `create_train_batches`
    makes them from this rank's share of the corpus; an epoch can be replayed from its
    start, skipping what a previous run trained on."""

    def __init__(
        self, nlp, corpus, batcher, max_epochs: int, ctx: DistContext, name: str = "corpora.train"
    ):
        self.nlp = nlp
        self.corpus = corpus
        self.batcher, self.size_draws = _count_size_draws(batcher)
        self.max_epochs = max_epochs
        self.ctx = ctx
        self.name = name  # how a message names the reader
        self.shares_itself = _reader_shares_itself(corpus, ctx, "corpora.train")
        self._warned_empty = False
        self.examples: Optional[List] = None
        # Per epoch: what resuming needs to replay it.
        self.epoch_random: Any = None
        self.batcher_rng: Any = None
        self.size_drawn: Optional[int] = None  # the schedule's draws before this epoch
        self.batches = 0
        self.n_examples = 0
        self.skipped = 0
        self.replay_differed = False
        self.replayed_examples = 0
        self.short_by = 0  # examples a resume was to skip that the epoch does not have

    def epoch(
        self,
        epoch: int,
        *,
        skip_batches: int = 0,
        skip_examples: int = 0,
        expect_examples: Optional[int] = None,
    ) -> Iterator[List]:
        """Start epoch `epoch`; shuffling happens now, so the caller can set the global
        random state afterwards. A resumed run replays the `skip_batches` batches the
        saved run trained, after `skip_examples` examples; if they do not hold the
        `expect_examples` examples the saved run counted (the batcher's settings
        changed), the epoch restarts and skips that many examples instead
        (`self.replay_differed`)."""
        self.epoch_random = _jsonable(random.getstate())
        rng = getattr(self.batcher, "rng", None)
        self.batcher_rng = _jsonable(rng.getstate()) if isinstance(rng, random.Random) else None
        self.size_drawn = None if self.size_draws is None else self.size_draws.drawn
        if self.max_epochs >= 0:
            # A shuffled copy of the listed order (spaCy shuffles the list in place), so
            # the epoch's order depends only on the random state saved at its start and
            # a resumed run replays it exactly.
            listed = list(self._listed())
            random.shuffle(listed)
            examples: Any = iter(listed)
        else:
            if hasattr(self.corpus, "set_state") and hasattr(self.corpus, "epoch"):
                self.corpus.epoch = epoch  # spacy-lean.Corpus.v1 shuffles by (seed, epoch)
            examples = _share(self.corpus(self.nlp), self.ctx, self.shares_itself, self._check_pass)
        self.skipped = 0
        self.replay_differed = False
        if skip_examples:
            for _ in zip(range(skip_examples), examples):
                self.skipped += 1
        self.short_by = skip_examples - self.skipped
        batches = iter(self.batcher(examples))
        self.batches = 0
        self.n_examples = 0
        for _ in range(skip_batches):
            batch = next(batches, None)
            if batch is None:
                break
            self.batches += 1
            self.n_examples += len(batch)
        self.replayed_examples = self.n_examples
        if expect_examples is not None and self.n_examples != expect_examples:
            # Other batches than the saved run's: skip the examples it trained on.
            self.replay_differed = True
            if self.max_epochs >= 0:
                examples = iter(listed)
            else:
                examples = _share(self.corpus(self.nlp), self.ctx, self.shares_itself)
            self.skipped = 0
            for _ in zip(range(skip_examples + expect_examples), examples):
                self.skipped += 1
            self.short_by = skip_examples + expect_examples - self.skipped
            batches = iter(self.batcher(examples))
            self.batches = 0
            self.n_examples = 0
        return self._count(batches)

    def has_batch_left(
        self,
        epoch: int,
        *,
        skip_batches: int = 0,
        skip_examples: int = 0,
        expect_examples: Optional[int] = None,
    ) -> bool:
        """Whether epoch `epoch`, started from the current random states as `epoch`
        starts it, has a batch after the skipped ones. The Python and numpy random
        states and the batcher's are put back; the next `epoch` call starts it afresh."""
        saved = random.getstate(), numpy.random.get_state()
        rng = getattr(self.batcher, "rng", None)
        rng_state = rng.getstate() if isinstance(rng, random.Random) else None
        sizes = self.size_draws.look_ahead() if self.size_draws is not None else nullcontext()
        try:
            with sizes:
                left = self.epoch(
                    epoch,
                    skip_batches=skip_batches,
                    skip_examples=skip_examples,
                    expect_examples=expect_examples,
                )
                return next(left, None) is not None
        finally:
            random.setstate(saved[0])
            numpy.random.set_state(saved[1])
            if rng_state is not None:
                rng.setstate(rng_state)

    def _listed(self) -> List:
        if self.examples is None:
            self.examples = list(
                _share(self.corpus(self.nlp), self.ctx, self.shares_itself, self._check_pass)
            )
        return self.examples

    def _check_pass(self, n_read: int, n_kept: int) -> None:
        """After a whole pass over a reader the loop shares (every world-size-th
        example to each rank): warn once if it gave examples, but none to this rank.
        The run goes on (this rank sends zeros, the others train); a reader with no
        example at all fails as in spaCy (E986)."""
        if n_kept or not n_read or self._warned_empty:
            return
        self._warned_empty = True
        size, rank = self.ctx.world_size, self.ctx.rank
        warnings.warn(
            f"{self.name}: the training loop shares the reader's {n_read} example(s) among "
            f"{size} processes (example i goes to rank i % {size}): rank {rank} gets no data "
            f"and only adds zeros to the others' gradients. Give the corpus at least {size} "
            "docs (split long docs into several), or train on fewer processes (--nproc); "
            "spacy-lean.Corpus.v1 reads only each rank's share.",
            UserWarning,
        )

    def count_examples(self, limit: int) -> int:
        """This rank's examples in an epoch, counted up to `limit`: a listed corpus
        (max_epochs >= 0) is listed now, as its first epoch would list it; a streamed
        one is read until `limit` examples."""
        if self.max_epochs >= 0:
            return min(len(self._listed()), limit)
        examples = _share(self.corpus(self.nlp), self.ctx, self.shares_itself)
        return sum(1 for _ in zip(range(limit), examples))

    def _count(self, batches) -> Iterator[List]:
        for batch in batches:
            self.batches += 1
            self.n_examples += len(batch)
            yield batch


def sum_losses(per_rank: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """The losses of every rank summed by name, in order of first appearance (rank
    order); a name only some ranks report is summed over those."""
    summed: Dict[str, float] = {}
    for losses in per_rank:
        for name, value in losses.items():
            summed[name] = summed.get(name, 0.0) + float(value)
    return summed


def _jsonable(state: Any) -> Any:
    """random.Random.getstate() as nested lists (JSON has no tuples)."""
    if isinstance(state, tuple):
        return [_jsonable(s) for s in state]
    return state


def _tupled(state: Any) -> Any:
    if isinstance(state, list):
        return tuple(_tupled(s) for s in state)
    return state


def _rng_states() -> Dict[str, Any]:
    import torch

    np_state = numpy.random.get_state()
    states = {
        "random": _jsonable(random.getstate()),
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "torch": torch.get_rng_state().tolist(),
    }
    if _torch_cuda_in_use():
        # The Hugging Face model's dropout on a GPU draws from torch's CUDA generator of
        # the rank's device (the current one: thinc's require_gpu sets it).
        states["torch_cuda"] = _torch_cuda_rng_state()
    return states


def _set_rng_states(states: Dict[str, Any]) -> None:
    import torch

    random.setstate(_tupled(states["random"]))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    numpy.random.set_state((kind, numpy.asarray(keys, dtype="uint32"), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))
    if "torch_cuda" in states and (_on_cupy() or _torch_cuda_in_use()):
        _set_torch_cuda_rng_state(states["torch_cuda"])


# -- the GPU's random generators ---------------------------------------------------
#
# On a GPU thinc's dropout masks come from cupy's global generator (CupyOps'
# get_dropout_mask: cupy.random.uniform), which has no state to save or restore (a
# cuRAND generator: cupy can seed it, not read it). So on the GPU every step reseeds it,
# from a base seed saved with the state, the step and the rank: a step's masks are
# those of the uninterrupted run whatever ran before it, resumed or not. On the CPU the
# masks come from numpy's generator, which is saved; nothing is reseeded there.

# cupy seeds are uint64; the bases and step seeds spacy-lean draws stay below 2**63.
CUPY_SEED_LIMIT = 2**63


def _on_cupy() -> bool:
    """Whether thinc's current ops are cupy's (training on a CUDA GPU)."""
    from thinc.api import CupyOps, get_current_ops

    return isinstance(get_current_ops(), CupyOps)


def _torch_cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


def _torch_cuda_rng_state() -> List[int]:
    import torch

    return torch.cuda.get_rng_state().tolist()  # the current device's


def _set_torch_cuda_rng_state(state: List[int]) -> None:
    import torch

    torch.cuda.set_rng_state(torch.tensor(state, dtype=torch.uint8))


def _mixed_seed(*parts: Any) -> int:
    digest = hashlib.sha256(" ".join(["spacy-lean cupy", *map(str, parts)]).encode("utf8"))
    return int.from_bytes(digest.digest()[:8], "little") % CUPY_SEED_LIMIT


def cupy_base_seed(seed: Optional[int]) -> int:
    """The base of a run's cupy seeds: from `training.seed`, or drawn at random for a
    run without one (saved with the state, so its resume draws the same masks)."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") % CUPY_SEED_LIMIT
    return _mixed_seed("base", seed)


def cupy_step_seed(base: int, step: int, rank: int) -> int:
    """The seed of cupy's generator for `step` on `rank`."""
    return _mixed_seed(base, step, rank)


def _reseed_cupy(seed: int) -> None:
    import cupy

    cupy.random.seed(seed)  # the current device's generator: the rank's GPU


def _device_changed(on_gpu: bool) -> str:
    """The warning of a resume on another kind of device than the saved run's."""
    if on_gpu:
        saved = (
            "was saved by a run on the CPU (or by a spacy-lean version that saved no GPU "
            "random state), and this run is on a GPU"
        )
    else:
        saved = "was saved by a run on a GPU, and this run is on the CPU"
    return (
        f"The training state {saved}: the dropout masks are drawn by another device's "
        "generator from here on, so the run does not go on exactly as the saved one "
        "would have (the device's arithmetic differs too). Resume on the kind of device "
        "the run was started on for an exact resume."
    )


# -- evaluation --------------------------------------------------------------------


def weighted_score(
    scores: Dict[str, Any], weights: Dict[str, Optional[float]]
) -> Tuple[float, Dict[str, Any]]:
    """The main score as spaCy's training computes it: the weighted sum of the scores
    named in [training.score_weights] (None scores dropped)."""
    scores = {key: value for key, value in scores.items() if value is not None}
    weights = {k: v for k, v in weights.items() if v is not None and k in scores}
    for key in weights:
        if not isinstance(scores[key], (int, float)):
            raise ValueError(Errors.E915.format(name=key, score_type=type(scores[key])))
    return sum(scores[k] * w for k, w in weights.items()), scores


def make_distributed_evaluation(
    nlp: Language,
    dev_corpus: Callable,
    weights: Dict[str, Optional[float]],
    ctx: DistContext,
    name: str = "[corpora.dev]",
) -> Callable[[], Tuple[float, Dict[str, Any]]]:
    """Each rank scores its share of the dev set with the streaming evaluator; the
    states are gathered (as JSON) and merged in rank order on every rank, so every rank
    gets the single-process scores and can take the same stopping decision. The
    evaluator takes the settings of the config's streaming-evaluation callback
    (`window_size`, `max_batch_tokens`, `trim_slack_mb`), where it has one. When no
    score of [training.score_weights] has a value (a dev set of only empty docs), rank
    0 warns once, naming the dev set (`name`): the scores then read 0 in the table and
    meta.json, as in `spacy train`, where `spacy evaluate` shows '-'."""
    from ..distributed import merge_states
    from ..streaming import StreamingEvaluator, make_score_state, streaming_settings

    shares_itself = _reader_shares_itself(dev_corpus, ctx, "corpora.dev")
    settings = streaming_settings(nlp)
    defaults = {
        key
        for name in nlp.component_names
        for key in (nlp.get_pipe_meta(name).default_score_weights or {})
    }

    def evaluate() -> Tuple[float, Dict[str, Any]]:
        evaluator = StreamingEvaluator(nlp, **settings)
        examples = dev_corpus(nlp)
        if ctx.active and not shares_itself:
            examples = _share(examples, ctx, shares_itself)
        # else the reader's own stream, which may say when it holds docs (memory zones)
        try:
            state = evaluator.run(examples)
        except KeyError as e:
            raise KeyError(Errors.E900.format(pipeline=nlp.pipe_names)) from e
        states = ctx.all_gather_json(state.to_dict())
        merged = merge_states(dict(enumerate(states)), nlp, template=make_score_state(nlp))
        result = merged.result()
        score, scores = weighted_score(result, weights)
        keys = [k for k, v in weights.items() if v is not None]
        # A weighted key no scorer reports and no component's defaults name (those of
        # a disabled component, or the tagger's pos_acc = 0.0, are spaCy's own).
        unknown = [k for k in keys if weights[k] and k not in result and k not in defaults]
        if unknown and "unknown" not in warned and ctx.rank == 0:
            # No scorer reports it (a misspelt key): not the dev set's doing.
            warned.append("unknown")
            known = sorted(k for k, v in result.items() if not isinstance(v, dict))
            warnings.warn(
                f"No component of the pipeline reports a score named "
                f"{', '.join(repr(k) for k in unknown)}, which [training.score_weights] "
                f"weights: it counts as 0, as in `spacy train`. The pipeline's scores: "
                f"{', '.join(known)}. Fix the name in [training.score_weights].",
                UserWarning,
            )
        keys = [k for k in keys if k not in unknown]
        if keys and not any(k in scores for k in keys) and "none" not in warned and ctx.rank == 0:
            warned.append("none")
            warnings.warn(
                f"The dev set {name} gave no value for any score of "
                f"[training.score_weights] ({', '.join(keys)}): spaCy's scorer gives None "
                "where there is nothing to score: every doc is empty (0 tokens), or no doc "
                "has the annotation (e.g. no entity) and the pipeline predicts none. "
                "The table and meta.json show them as 0, as `spacy train` does, and "
                "`spacy evaluate` shows '-'; best-model selection has nothing to go by. "
                "Point --paths.dev at annotated, non-empty docs.",
                UserWarning,
            )
        return score, scores

    warned: List[str] = []
    return evaluate


# -- checkpoints -------------------------------------------------------------------


def _old_dir(path: Path) -> Path:
    # Where replace_dir keeps the previous folder while it swaps the new one in.
    return path.with_name(path.name + ".old")


def replace_dir(path: Path, write: Callable[[Path], None]) -> None:
    """Replace the folder `path` by what `write(tmp)` writes into a new folder `tmp`,
    swapped in by renames once written: a run killed while writing leaves the previous
    folder (as `path`, or as `path.old` between the two renames) and never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        write(tmp)
    except BaseException:  # an error, or Ctrl-C: nothing half-written is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = _old_dir(path)
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)


# Where a resumed run keeps the lines of a ConsoleLogger's output_file from before it
# until it has finished (`hold_console_logs`, `restore_console_logs`).
HELD_LOG_SUFFIX = ".before-resume"


def _console_log_files(logger_config: Any) -> List[Path]:
    """The output_file of every spacy.ConsoleLogger in a [training.logger] block (also
    inside a spacy.ChainLogger)."""
    found: List[Path] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            name = str(node.get("@loggers", ""))
            if name.startswith("spacy.ConsoleLogger") and node.get("output_file"):
                found.append(Path(node["output_file"]))
            for value in node.values():
                walk(value)

    walk(logger_config)
    return found


def _log_step(line: str) -> Optional[int]:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def hold_console_logs(logger_config: Any, step: int) -> List[Tuple[Path, int]]:
    """Before a resumed run builds its loggers. spaCy's ConsoleLogger refuses an
    output_file that exists ("Saving logs is disabled because ... already exists") and
    logs to the console only, so the JSONL log of a resumed run stopped at the
    interruption. Here each such file's lines up to `step` (the saved step; later lines
    are of steps the run trains again) are set aside in FILE.before-resume and the file
    is removed, so the logger writes it anew; `restore_console_logs` puts the lines back
    in front of the new ones. A run killed in between leaves FILE.before-resume, which
    the next resume reads first. RETURNS the files held, with their lines kept."""
    held: List[Tuple[Path, int]] = []
    for path in _console_log_files(logger_config):
        aside = path.with_name(path.name + HELD_LOG_SUFFIX)
        if not path.exists() and not aside.exists():
            continue
        lines: List[str] = []
        for source in (aside, path):
            if source.exists():
                lines += source.read_text(encoding="utf8").splitlines()
        kept, seen = [], set()
        for line in lines:
            line_step = _log_step(line)
            if line_step is not None and (line_step > step or line_step in seen):
                continue
            seen.add(line_step)
            kept.append(line)
        tmp = aside.with_name(aside.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf8")
        os.replace(tmp, aside)
        if path.exists():
            path.unlink()
        held.append((path, len(kept)))
    return held


def restore_console_logs(held: Sequence[Tuple[Path, int]]) -> None:
    """Put the lines `hold_console_logs` set aside back in front of each file."""
    for path, _ in held:
        aside = path.with_name(path.name + HELD_LOG_SUFFIX)
        if not aside.exists():
            continue
        new = path.read_text(encoding="utf8") if path.exists() else ""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(aside.read_text(encoding="utf8") + new, encoding="utf8")
        os.replace(tmp, path)
        aside.unlink()


def save_training_state(
    path: Path,
    nlp: Language,
    optimizer,
    entries: Sequence[ParamEntry],
    state: Dict[str, Any],
    nlp_settings: Optional[Dict[str, Any]] = None,
) -> None:
    """Write the resumable state (rank 0): the pipeline with its current (not averaged)
    weights, the optimizer's state as .npz, and the loop's position as JSON, swapped in
    whole (`replace_dir`). `nlp_settings`: [nlp] settings the saved config.cfg gets
    (the run's, where a before_to_disk callback changed the live config)."""

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        block = nlp.config["nlp"]
        live = {key: block.get(key) for key in nlp_settings or {}}
        block.update(nlp_settings or {})
        try:
            nlp.to_disk(tmp / "model")
        finally:
            block.update(live)
        saved = dict(state, optimizer=save_optimizer(optimizer, entries, tmp / OPTIMIZER_FILE))
        # The standard library's JSON writes every float exactly (repr); srsly's keeps 10
        # decimals, which changed the saved losses, scores and cached gaussians. Strict
        # JSON: a non-finite float (the losses of a diverged run) is written as a string.
        text = json.dumps(_strict_json(saved), indent=2, allow_nan=False)
        (tmp / STATE_FILE).write_text(text + "\n", encoding="utf8")

    replace_dir(path, write)


# How state.json writes the floats strict JSON has no number for (Python's json and
# older states write them as the bare tokens NaN, Infinity and -Infinity, which strict
# readers refuse). float() reads each back.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _strict_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by its NON_FINITE string."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(item) for item in value]
    return value


def _is_float(value: Any) -> bool:
    # A loss or a dev score: a number (a bare NaN or Infinity in a state written before
    # strict JSON), or the string a non-finite one is written as now.
    return type(value) in (int, float) or (type(value) is str and value in NON_FINITE)


def _from_strict_json(value: Any) -> Any:
    # What _strict_json wrote for a non-finite float, read back.
    return NON_FINITE[value] if isinstance(value, str) else value


def read_training_state(output_path: Path) -> Dict[str, Any]:
    """Read `output_path/training-state/state.json` and check every field against
    what `spacy lean train` writes (types, ranges, and what the steps allow).

    RAISES (FileNotFoundError): nothing was saved.
    RAISES (TrainingStateError): a field is not what a run writes; the message names
        the file, the field, the value and what to do.
    """
    path = output_path / DIR_STATE
    file_ = path / STATE_FILE
    old = _old_dir(path) / STATE_FILE
    if not path.exists() and old.exists():
        # Killed between replace_dir's two renames: the previous state is whole there.
        path, file_ = old.parent, old
    if not file_.exists():
        raise FileNotFoundError(
            f"Nothing to resume in {output_path}: {file_} does not exist. The state is "
            "written at every evaluation; start without --resume."
        )
    try:
        state = json.loads(file_.read_text(encoding="utf8"))
    except (ValueError, RecursionError) as err:
        # RecursionError: nested deeper than Python's JSON decoder can follow.
        raise TrainingStateError(
            f"{file_} is not valid JSON ({type(err).__name__}: {err}). {STATE_FIX}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        said = f"its format is {found!r}" if isinstance(found, str) else "it names no format"
        raise TrainingStateError(
            f"{file_} is not a spacy-lean training state of the format this version "
            f"reads ({STATE_FORMAT}): {said}. A state another spacy-lean version wrote is "
            f"resumed with that version. {STATE_FIX}"
        )
    _check_state(state, file_)
    # A diverged run's dev score or loss may be NaN or infinite: the resumed run logs
    # and compares them as the uninterrupted run would have.
    state["results"] = [[_from_strict_json(score), step] for score, step in state["results"]]
    state["path"] = str(path)
    if "losses" in state:
        state["losses"] = {
            name: _from_strict_json(value) for name, value in state["losses"].items()
        }
    return state


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _is_random_state(value: Any) -> bool:
    # random.getstate() as JSON: version 3, 624 key words and a position, cached gauss.
    return (
        isinstance(value, list)
        and len(value) == 3
        and value[0] == 3
        and isinstance(value[1], list)
        and len(value[1]) == 625
        and all(type(k) is int and 0 <= k < 2**32 for k in value[1])
        and value[1][-1] <= 624
        and (value[2] is None or _is_number(value[2]))
    )


def _is_torch_state(value: Any) -> bool:
    import torch

    return (
        isinstance(value, list)
        and len(value) == torch.get_rng_state().numel()
        and all(type(b) is int and 0 <= b < 256 for b in value)
    )


def _is_torch_cuda_state(value: Any) -> bool:
    # torch.cuda.get_rng_state() (torch 2.1+): the Philox seed and offset, 8 bytes each
    # (little-endian); torch.cuda.set_rng_state refuses an offset that is not a multiple
    # of 4, and torch writes none.
    if not (
        isinstance(value, list)
        and len(value) == 16
        and all(type(b) is int and 0 <= b < 256 for b in value)
    ):
        return False
    offset = int.from_bytes(bytes(value[8:]), "little", signed=True)
    return offset >= 0 and offset % 4 == 0


def _is_learned_limits(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and k.isdigit() and int(k) >= 1 and type(v) is int and v >= 1
        for k, v in value.items()
    )


def _check_state(state: Dict[str, Any], file_: Path) -> None:
    """Raise TrainingStateError at the first field of `state` that no run writes."""

    def fail(field: str, value: Any, what: str) -> NoReturn:
        raise TrainingStateError(
            f"{file_}: {field} must be {what}, got {_shown(value)}. {STATE_FIX}"
        )

    for key in ("step", "epoch", "results", "words", "seconds", "world_size", "ranks"):
        if key not in state:
            raise TrainingStateError(f"{file_} has no '{key}': it is damaged. {STATE_FIX}")
    seed = state.get("seed")
    if seed is not None and type(seed) is not int:
        fail("seed", seed, "a whole number or null (the run's training.seed)")
    corpus = state.get("corpus")
    if corpus is not None and not (isinstance(corpus, str) and len(corpus) == 64):
        fail("corpus", corpus, "a SHA-256 in hex or null (the training corpus's fingerprint)")
    step = state["step"]
    if not _is_count(step):
        fail("step", step, "a whole number >= 0 (the last step trained)")
    if step > MAX_RESUMED_STEP:
        raise TrainingStateError(
            f"{file_}: step is {step:,}, more steps than any run makes: a resumed run "
            f"replays the learn-rate and dropout schedules step by step, and at most "
            f"{MAX_RESUMED_STEP:,} steps are replayed. {STATE_FIX}"
        )
    if not (_is_count(state["epoch"]) and state["epoch"] <= step + 1):
        fail(
            "epoch",
            state["epoch"],
            f"a whole number from 0 to step + 1 = {step + 1} (an epoch takes a step)",
        )
    results = state["results"]
    if not isinstance(results, list):
        fail("results", results, "a list of [score, step] pairs")
    for i, pair in enumerate(results):
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and _is_float(pair[0])
            and _is_count(pair[1])
            and pair[1] <= step
        ):
            fail(
                f"results[{i}]",
                pair,
                f"a [score, step] pair with a step from 0 to {step} (the score a number, or "
                '"NaN", "Infinity" or "-Infinity" for one that is not finite)',
            )
    if not _is_count(state["words"]):
        fail("words", state["words"], "a whole number >= 0")
    if not (_is_number(state["seconds"]) and state["seconds"] >= 0):
        fail("seconds", state["seconds"], "a number >= 0")
    world_size = state["world_size"]
    if not (type(world_size) is int and world_size >= 1):
        fail("world_size", world_size, "a whole number >= 1 (the ranks of the run)")
    ranks = state["ranks"]
    if not (isinstance(ranks, list) and len(ranks) == world_size):
        fail("ranks", ranks, f"a list of one entry per rank (world_size = {world_size})")
    for i, rank in enumerate(ranks):
        where = f"ranks[{i}]"
        if not isinstance(rank, dict):
            fail(where, rank, "an object")
        if not (_is_count(rank.get("batches")) and rank["batches"] <= step + 1):
            fail(
                f"{where}.batches",
                rank.get("batches"),
                f"a whole number from 0 to step + 1 = {step + 1}",
            )
        if not _is_count(rank.get("examples")):
            fail(f"{where}.examples", rank.get("examples"), "a whole number >= 0")
        if not _is_count(rank.get("skipped", 0)):
            fail(f"{where}.skipped", rank.get("skipped"), "a whole number >= 0")
        if not _is_random_state(rank.get("epoch_random")):
            fail(
                f"{where}.epoch_random",
                rank.get("epoch_random"),
                "a state random.getstate() writes",
            )
        drawn = rank.get("size_drawn")
        if not (drawn is None or (_is_count(drawn) and drawn <= MAX_RESUMED_STEP)):
            fail(
                f"{where}.size_drawn",
                drawn,
                f"null or a whole number from 0 to {MAX_RESUMED_STEP:,}",
            )
        if not (rank.get("batcher_rng") is None or _is_random_state(rank["batcher_rng"])):
            fail(
                f"{where}.batcher_rng",
                rank["batcher_rng"],
                "null or a state random.getstate() writes",
            )
        rng = rank.get("rng")
        if not isinstance(rng, dict):
            fail(f"{where}.rng", rng, "an object of random, numpy and torch states")
        if not _is_numpy_state(rng.get("numpy")):
            raise TrainingStateError(
                f"{file_}: the numpy random state of rank {i} is not one "
                "numpy.random.get_state() writes (MT19937, 624 key words, a position "
                f"within them). {STATE_FIX}"
            )
        if not _is_random_state(rng.get("random")):
            fail(f"{where}.rng.random", rng.get("random"), "a state random.getstate() writes")
        if not _is_torch_state(rng.get("torch")):
            fail(
                f"{where}.rng.torch",
                rng.get("torch"),
                "a state torch.get_rng_state() writes (bytes)",
            )
        # Written by runs on a GPU only (absent in states of the CPU and older ones).
        if "torch_cuda" in rng and not _is_torch_cuda_state(rng["torch_cuda"]):
            fail(
                f"{where}.rng.torch_cuda",
                rng["torch_cuda"],
                "a state torch.cuda.get_rng_state() writes (16 bytes: a seed, then an "
                "offset >= 0 that is a multiple of 4)",
            )
        if "cupy" in rng and not (type(rng["cupy"]) is int and 0 <= rng["cupy"] < CUPY_SEED_LIMIT):
            fail(
                f"{where}.rng.cupy",
                rng["cupy"],
                f"a whole number from 0 to {CUPY_SEED_LIMIT - 1} (the base of the run's "
                "cupy seeds)",
            )
        policy = rank.get("update_policy")
        if policy is not None and not (
            isinstance(policy, dict) and _is_learned_limits(policy.get("learned_limits", {}))
        ):
            fail(
                f"{where}.update_policy",
                policy,
                "an object whose learned_limits map padded sizes to limits (whole numbers >= 1)",
            )
    params = state.get("params", [])
    if not (isinstance(params, list) and all(isinstance(p, str) for p in params)):
        fail("params", params, "a list of parameter names")
    optimizer = state.get("optimizer", {})
    if not (isinstance(optimizer, dict) and all(_is_number(v) for v in optimizer.values())):
        fail("optimizer", optimizer, "an object of numbers (the optimizer's settings)")
    scalers = state.get("grad_scalers", [])  # absent in states saved before it was
    if not (
        isinstance(scalers, list)
        and all(
            isinstance(s, dict)
            and _is_number(s.get("scale"))
            and s["scale"] > 0
            and _is_count(s.get("growth_tracker"))
            for s in scalers
        )
    ):
        fail(
            "grad_scalers",
            scalers,
            "a list of {scale, growth_tracker} objects (a number > 0, a whole number >= 0)",
        )
    # Absent in states saved before the losses were: none carried over. A loss may be
    # NaN or infinite (a diverged run logs it so, and its resume logs it alike): written
    # as "NaN", "Infinity" or "-Infinity" (strict JSON), or bare in older states.
    losses = state.get("losses", {})
    if not (isinstance(losses, dict) and all(_is_float(v) for v in losses.values())):
        fail(
            "losses",
            losses,
            "an object of numbers by component (the losses summed since the last "
            'evaluation; "NaN", "Infinity" or "-Infinity" for one that is not finite)',
        )


class LabelsGrewError(ValueError):
    """A parser or ner met a label in data-parallel training that its initialize data
    did not have: it grew its output layer on one rank only."""


def _parser_labels(nlp: Language, frozen: Iterable[str]) -> Dict[str, List[str]]:
    """The labels of each trained parser and ner. A label met in training that the
    component was not initialized with grows it: spaCy replaces its output layer by a
    larger one."""
    return {
        name: list(proc.labels)
        for name, proc in nlp.pipeline
        if name not in frozen and isinstance(proc, Parser)
    }


def _loss_weight(
    nlp: Language, name: str, reduction: Optional[str], batch: Optional[List[Example]]
) -> float:
    """What a rank's loss of component `name` is a mean over, for the mean over every
    rank's (`reduction`: "mean", its docs; "entities", an entity_linker's linked
    entities, counted after the update as its loss counted them); 1 for a sum."""
    if reduction is None:
        return 1.0
    return loss_denominator(nlp, name, reduction, batch) if batch else 0.0


def _new_labels(nlp: Language, before: Dict[str, List[str]]) -> Dict[str, List[str]]:
    new = {name: sorted(set(nlp.get_pipe(name).labels) - set(old)) for name, old in before.items()}
    return {name: labels for name, labels in new.items() if labels}


class NothingToTrainError(ValueError):
    """A saved state has no step left under the resumed run's max_steps or max_epochs;
    the message says which override goes on."""


def check_steps_left(
    state: Dict[str, Any],
    max_steps: int,
    max_epochs: int = 0,
    *,
    epoch_trained: bool = False,
    patience: int = 0,
) -> None:
    """Raise NothingToTrainError when a saved state has no step left under `max_steps`
    (0: no limit), `max_epochs` (0 or -1: no limit) or `patience` (0: none), saying how
    to go on. `epoch_trained`: the state's epoch has no batch left (the caller replayed
    it)."""
    done = int(state["step"])
    if max_steps and done >= max_steps:
        raise NothingToTrainError(
            f"The saved state is at step {done}, and this run's training.max_steps is "
            f"{max_steps}: nothing is left to train. Resume with a larger max_steps "
            f"(e.g. --training.max_steps {done + max_steps})."
        )
    results = state.get("results") or []
    if patience and results:
        # The loop stops after step `done` when it is `patience` steps past the best
        # score (the first of equal best ones): a run stopped early is finished.
        best = -max((float(score), -int(at)) for score, at in results)[1]
        if done - best >= patience:
            raise NothingToTrainError(
                f"The saved state is at step {done}, {done - best} steps after its best "
                f"score (step {best}), and this run's training.patience is {patience}: the "
                "run stopped early there, and nothing is left to train. Resume with a "
                f"larger patience (e.g. --training.patience {done - best + patience}), or "
                "0 to train until max_steps or max_epochs."
            )
    epoch = int(state["epoch"])
    if epoch_trained:
        where = f"at step {done}, the last step of epoch {epoch} (its epochs 0 to {epoch}"
        epoch += 1  # trained as far as a state at the next epoch's start
    else:
        where = f"at epoch {epoch} (its epochs 0 to {epoch - 1}"
    if max_epochs > 0 and epoch >= max_epochs:
        raise NothingToTrainError(
            f"The saved state is {where} are trained), and this run's "
            f"training.max_epochs is {max_epochs}: nothing is left to train. Resume with "
            f"a larger max_epochs (e.g. --training.max_epochs {epoch + max_epochs})."
        )


def check_state_against_corpus(
    state: Dict[str, Any], batches: "RankBatches", ctx: DistContext
) -> None:
    """Raise TrainingStateError (on every rank) when the saved step is more than the
    training corpus could have given: every global step trains a batch of at least one
    example on some rank, so `step + 1` steps in `epoch + 1` epochs need at least
    `ceil((step + 1) / (epoch + 1))` examples per epoch. Each rank counts its share,
    reading no further than that."""
    step, epoch = int(state["step"]), int(state["epoch"])
    needed = -(-(step + 1) // (epoch + 1))
    have = int(ctx.all_reduce_sum([batches.count_examples(needed)])[0])
    if have < needed:
        file_ = Path(state["path"]) / STATE_FILE if state.get("path") else STATE_FILE
        raise TrainingStateError(
            f"{file_}: step {step:,} at epoch {epoch} is more than the training corpus can "
            f"give: {step + 1:,} steps in {epoch + 1} epoch(s) need at least {needed:,} "
            f"examples per epoch, and [corpora.train] gives {have:,}. The state was edited "
            "or damaged, or the corpus changed since it was saved: resume on the corpus "
            f"the run was trained on. {STATE_FIX}"
        )


def _upper_dropout_parsers(nlp: Language, frozen: Sequence[str]) -> List[str]:
    """The trained parsers and ners with an upper layer: spaCy's ParserStepModel is built
    with a hidden-layer dropout of 0.1 in training, not the update's `drop`."""
    return [
        name
        for name, proc in nlp.pipeline
        if name not in frozen
        and isinstance(proc, Parser)
        and getattr(proc, "model", None) is not None
        and proc.model.attrs.get("has_upper")
    ]


def check_skipped_examples(
    state: Dict[str, Any], epoch: int, short_by: float, world_size: int
) -> None:
    """Raise TrainingStateError when the ranks' replay of the saved epoch ran out of
    examples before it had skipped what the state says was trained or skipped in it
    (`short_by`: those missing, summed over the ranks)."""
    if not short_by:
        return
    file_ = Path(state["path"]) / STATE_FILE if state.get("path") else STATE_FILE
    raise TrainingStateError(
        f"{file_}: the saved run trained or skipped more examples in epoch {epoch} than "
        f"[corpora.train] gives in an epoch ({int(short_by):,} more, over {world_size} "
        "rank(s)). The state was edited or damaged, or the corpus changed since it was "
        f"saved: resume on the corpus the run was trained on. {STATE_FIX}"
    )


def _is_numpy_state(value: Any) -> bool:
    # numpy's legacy `set_state` takes the position unchecked: one outside the key
    # would read other memory. (torch and Python check their generators' states.)
    return (
        isinstance(value, list)
        and len(value) == 5
        and value[0] == "MT19937"
        and isinstance(value[1], list)
        and len(value[1]) == 624
        and all(type(k) is int and 0 <= k < 2**32 for k in value[1])
        and type(value[2]) is int
        and 0 <= value[2] <= 624
    )


def restore_learned_limits(policy: UpdatePolicy, ranks: Sequence[Dict[str, Any]]) -> None:
    """Give a resumed run the micro-batch limits the saved ranks learned after running
    out of memory: for each padded size, the smallest any rank learned (on any number of
    ranks, each rank then starts where the most constrained one was). The settings stay
    those of the resumed run's config and command line.

    policy (UpdatePolicy): the resumed run's policy; modified in place.
    ranks (Sequence[dict]): the saved state's per-rank entries.
    """
    for saved in ranks:
        learned = (saved.get("update_policy") or {}).get("learned_limits") or {}
        for bucket, limit in learned.items():
            policy.learn(int(bucket), int(limit))  # keeps the smaller of two limits


def grad_scaler_states(scalers: Sequence[Any]) -> List[Dict[str, Any]]:
    """Mixed precision: each enabled grad scaler's loss scale and the steps since it
    last changed (the same on every rank: their overflows are agreed on)."""
    return [
        {"scale": float(s._scale.item()), "growth_tracker": int(s._growth_tracker.item())}
        for s in scalers
    ]


def restore_grad_scalers(scalers: Sequence[Any], saved: Optional[Sequence[Dict[str, Any]]]) -> str:
    """Give a resumed run the loss scales of the saved one (else a scale that had backed
    off after overflows would start again at its initial value, and overflow again).

    RETURNS (str): "" when restored or when there is nothing to restore, else why not.
    """
    if not scalers:
        return ""
    if not saved:
        return (
            "The saved state has no mixed-precision loss scale (saved without mixed "
            "precision, or by an older version): the scale starts again at its initial value."
        )
    if len(saved) != len(scalers):
        return (
            f"The saved state has {len(saved)} mixed-precision loss scale(s) and this "
            f"pipeline {len(scalers)}: the scales start again at their initial values."
        )
    for scaler, state in zip(scalers, saved):
        scaler._scale.fill_(float(state["scale"]))
        scaler._growth_tracker.fill_(int(state["growth_tracker"]))
    return ""


# -- the loop ----------------------------------------------------------------------


def train(
    nlp: Language,
    output_path: Optional[Path] = None,
    *,
    ctx: Optional[DistContext] = None,
    resume: Optional[Dict[str, Any]] = None,
    policy=None,
    stdout: IO = sys.stdout,
    stderr: IO = sys.stderr,
) -> Tuple[Language, Optional[Path]]:
    """Train a pipeline on this rank, in step with the other ranks.

    nlp (Language): the initialized pipeline with the full config (identical on all ranks).
    output_path (Optional[Path]): where rank 0 writes model-best, model-last and the
        resumable training-state.
    ctx (DistContext): this rank's place in the run (None: one process).
    resume (Optional[dict]): a state from `read_training_state` (its model already
        loaded into `nlp`).
    policy (Optional[UpdatePolicy]): settings and learned state of `lean_update`; None
        for the one a `spacy-lean.lean_training.v1` callback installed on `nlp`, else
        the defaults. Its learned micro-batch limits are saved with each checkpoint
        and restored on resume.
    RETURNS (Tuple[Language, Optional[Path]]): the pipeline and model-last's path.
    """
    ctx = ctx if ctx is not None else DistContext()
    # The run's [nlp] callback, as it started: a [training.before_to_disk] such as
    # spacy-lean.strip_streaming_evaluate.v1 removes it from the live config for the
    # saved models, and the training state must keep it (a resume is told to use its
    # config.cfg, which would lose the callback's settings).
    run_nlp_settings = {
        "after_pipeline_creation": copy.deepcopy(nlp.config["nlp"].get("after_pipeline_creation"))
    }
    if policy is None:
        policy = get_update_policy(nlp) or UpdatePolicy()
    msg = Printer(no_print=True)
    config = nlp.config.interpolate()
    if config["training"]["seed"] is not None:
        fix_random_seed(config["training"]["seed"])
    # On a GPU each step reseeds cupy's generator (see cupy_base_seed); None on the CPU.
    cupy_base = cupy_base_seed(config["training"]["seed"]) if _on_cupy() else None
    allocator = config["training"]["gpu_allocator"]
    if ctx.gpu_id >= 0 and allocator:  # as spaCy's loop (a resumed run skips init_nlp)
        set_gpu_allocator(allocator)
    # A resumed run's JSONL log goes on in the same file (rank 0 writes it).
    held_logs = (
        hold_console_logs(config["training"].get("logger"), int(resume["step"]))
        if resume is not None and ctx.is_main
        else []
    )
    T = registry.resolve(config["training"], schema=ConfigSchemaTraining)  # type: ignore[arg-type]
    train_corpus, dev_corpus = resolve_dot_names(config, [T["train_corpus"], T["dev_corpus"]])
    optimizer = T["optimizer"]
    score_weights = T["score_weights"]
    before_to_disk = create_before_to_disk_callback(T["before_to_disk"])
    before_update = T["before_update"]
    frozen = T["frozen_components"]
    annotating = T["annotating_components"]
    max_steps, eval_frequency, patience = T["max_steps"], T["eval_frequency"], T["patience"]
    dropouts = constant(T["dropout"]) if isinstance(T["dropout"], float) else T["dropout"]

    entries = collect_params(nlp, exclude=frozen)
    reducer = GradientReducer(ctx, entries)
    labels_before = _parser_labels(nlp, frozen)
    reducer.check_same_params()
    reducer.broadcast_values(0)  # identical start, whatever each rank's init did
    loss_names = list(nlp.pipe_names)
    # A loss that is a mean over the batch's docs (textcat's) is the mean over every
    # rank's docs: each rank's is weighted by its share of the step's docs; one that is
    # a mean over linked entities (entity_linker's), by its share of those. (Summed, it
    # was N times one process's on N ranks.) One process keeps its own value, as stock.
    # Entity linkers whose decision to learn is shared among the ranks (a rank's share
    # with linked entities but no candidate is skipped otherwise, where one process
    # learns from it): per step, or with accumulate_gradient per subbatch, the ranks'
    # j-th subbatches taken together as one process's j-th.
    linkers = (
        [
            proc
            for name, proc in nlp.pipeline
            if name not in frozen and isinstance(proc, EntityLinker) and proc.use_gold_ents
        ]
        if ctx.world_size > 1
        else []
    )
    # subdivide_batch yields up to accumulate_gradient + 1 subbatches (the remainder).
    n_slots = T["accumulate_gradient"] + 1 if T["accumulate_gradient"] > 1 else 1
    mean_losses = (
        {
            name: how
            for name, proc in nlp.pipeline
            if (how := loss_reduction(proc)) in ("mean", "entities")
        }
        if ctx.world_size > 1
        else {}
    )
    trainable = trainable_components(nlp, exclude=frozen)
    scalers = grad_scalers(nlp, exclude=frozen)  # mixed precision: steps skipped together
    batches = RankBatches(
        nlp,
        train_corpus,
        T["batcher"],
        T["max_epochs"],
        ctx,
        name=_corpus_name(train_corpus, config, T["train_corpus"]),
    )
    evaluate = make_distributed_evaluation(
        nlp, dev_corpus, score_weights, ctx, _corpus_name(dev_corpus, config, T["dev_corpus"])
    )

    # For the saved state and a resume's comparison only (it reads the corpus's files).
    wants_fp = ctx.is_main and (output_path is not None or resume is not None)
    corpus_fp = _corpus_fingerprint(train_corpus) if wants_fp else None
    step, epoch, results, words_seen, seconds_before = 0, 0, [], 0, 0.0
    done_step = -1  # the last step whose update every rank has made
    skip_batches = skip_examples = 0
    expect_examples: Optional[int] = None  # in the batches replayed (same world size)
    # The losses summed since the last evaluation (each evaluation logs, then resets them).
    losses: Dict[str, float] = {}
    rank_resume: Optional[Dict[str, Any]] = None
    # Resumed on as many ranks as it was saved with: each rank replays its own batches.
    same_ranks = resume is not None and int(resume["world_size"]) == ctx.world_size
    if resume is not None:
        check_steps_left(resume, T["max_steps"], T["max_epochs"])
        check_state_against_corpus(resume, batches, ctx)  # before the schedules' replay
        check_steps_left(resume, 0, patience=patience)  # a step the corpus could give
        done_step = int(resume["step"])
        step = done_step + 1
        epoch = int(resume["epoch"])
        results = [(float(s), int(k)) for s, k in resume["results"]]
        words_seen = int(resume["words"])
        seconds_before = float(resume["seconds"])
        losses = {str(name): float(value) for name, value in resume.get("losses", {}).items()}
        load_optimizer(optimizer, entries, Path(resume["path"]) / OPTIMIZER_FILE)
        not_restored = restore_grad_scalers(scalers, resume.get("grad_scalers"))
        if not_restored and ctx.is_main:
            stdout.write(msg.warn(not_restored) + "\n")
        saved_seed = resume.get("seed", T["seed"])  # states before 0.1 have none
        if saved_seed != T["seed"] and ctx.is_main:
            stdout.write(
                msg.warn(
                    f"This run's training.seed is {T['seed']}, the saved run's {saved_seed}: "
                    "a resumed run restores the saved run's random states, so it goes on "
                    "as that run would, and the new seed changes nothing. Train again "
                    "without --resume (into another --output folder) to use it."
                )
                + "\n"
            )
        saved_corpus = resume.get("corpus")  # states before 0.2 have none
        if ctx.is_main and None not in (saved_corpus, corpus_fp) and saved_corpus != corpus_fp:
            stdout.write(
                msg.warn(
                    f"The training corpus ({batches.name}) is not the one the saved run "
                    "trained on: a file was added, removed or changed since. The run "
                    "resumes at the saved position in the epoch, which was a position in "
                    "the old corpus, so it goes on with other examples than the saved run "
                    "would have. Resume on the same corpus, or train again without --resume "
                    "(into another --output folder)."
                )
                + "\n"
            )
        for _ in range(step):  # the schedules (learn rate...) continue per global step
            next(dropouts)
            optimizer.step_schedules()
        ranks = resume["ranks"]
        if same_ranks:
            rank_resume = ranks[ctx.rank]
            skip_batches = int(rank_resume["batches"])
            skip_examples = int(rank_resume.get("skipped", 0))
            expect_examples = int(rank_resume["examples"])
        else:
            # Another number of ranks: the shares differ; each rank skips its part of
            # the examples the old ranks trained on in this epoch.
            done = sum(int(r["examples"]) + int(r.get("skipped", 0)) for r in ranks)
            skip_examples = done // ctx.world_size
            rank_resume = ranks[ctx.rank] if ctx.rank < len(ranks) else ranks[0]
        restore_learned_limits(policy, ranks)
        saved_rng = rank_resume["rng"]
        if cupy_base is not None and "cupy" in saved_rng:
            cupy_base = saved_rng["cupy"]  # the saved run's masks, whatever the seed now
        if ctx.is_main and same_ranks and ("cupy" in saved_rng) != (cupy_base is not None):
            stdout.write(msg.warn(_device_changed(cupy_base is not None)) + "\n")
        random.setstate(_tupled(rank_resume["epoch_random"]))
        rng = getattr(T["batcher"], "rng", None)
        if rank_resume.get("batcher_rng") is not None and isinstance(rng, random.Random):
            rng.setstate(_tupled(rank_resume["batcher_rng"]))
        if rank_resume.get("size_drawn") is not None and batches.size_draws is not None:
            # A batch-size schedule goes on across epochs: where it stood at the epoch's start.
            batches.size_draws.skip(int(rank_resume["size_drawn"]))
        if T["max_epochs"] > 0 and epoch == T["max_epochs"] - 1:
            # A state saved at an evaluation on the last batch of the last epoch (a run
            # stopped there by max_steps or patience, or killed before its final
            # checkpoint) has every batch of it trained, which only replaying it shows.
            left = batches.has_batch_left(
                epoch,
                skip_batches=skip_batches,
                skip_examples=skip_examples,
                expect_examples=expect_examples,
            )
            left, short_by = ctx.all_reduce_sum([left, batches.short_by])
            if same_ranks:
                check_skipped_examples(resume, epoch, short_by, ctx.world_size)
            if not left:
                check_steps_left(resume, T["max_steps"], T["max_epochs"], epoch_trained=True)
    elif ctx.is_main:
        clean_output_dir(output_path)
        # An earlier run's training state too: until this run's first checkpoint, a
        # --resume (a requeued job's) would continue that run, not this one.
        if output_path is not None:
            state_dir = output_path / DIR_STATE
            for stale in (state_dir, _old_dir(state_dir)):
                if stale.exists():
                    shutil.rmtree(stale)
                    stdout.write(
                        msg.info(f"Removed the training state of an earlier run: {stale}") + "\n"
                    )

    def save_model(is_best: bool) -> None:
        # Swapped in whole (a run stopped while saving keeps the previous pipelines).
        last = output_path / DIR_MODEL_LAST
        with nlp.use_params(optimizer.averages):
            replace_dir(last, before_to_disk(nlp).to_disk)
        if is_best:
            replace_dir(output_path / DIR_MODEL_BEST, lambda tmp: shutil.copytree(last, tmp))

    saved_at: Optional[Tuple[int, int]] = None  # (step, epoch) of the last checkpoint

    def checkpoint(seconds: float, since_eval: Dict[str, float]) -> None:
        # Collective: every rank sends where it stands; rank 0 writes. `since_eval`: the
        # losses summed since the last evaluation, which the resumed run goes on summing.
        nonlocal saved_at
        saved_at = (done_step, epoch)
        mine = {
            "batches": batches.batches,
            "examples": batches.n_examples,
            "skipped": batches.skipped,
            "epoch_random": batches.epoch_random,
            "batcher_rng": batches.batcher_rng,
            "size_drawn": batches.size_drawn,
            "rng": _rng_states(),
            "update_policy": policy.to_dict(),
        }
        if cupy_base is not None:
            mine["rng"]["cupy"] = cupy_base
        ranks = ctx.all_gather_json(mine)
        if ctx.is_main and output_path is not None:
            state = {
                "format": STATE_FORMAT,
                "step": done_step,
                "epoch": epoch,
                "results": results,
                "words": words_seen,
                "seconds": seconds,
                "world_size": ctx.world_size,
                "ranks": ranks,
                "params": [e.name for e in entries],
                "losses": {name: float(value) for name, value in since_eval.items()},
                "grad_scalers": grad_scaler_states(scalers),
                "seed": T["seed"],
                "corpus": corpus_fp,
            }
            save_training_state(
                output_path / DIR_STATE,
                nlp,
                optimizer,
                entries,
                state,
                nlp_settings=run_nlp_settings,
            )

    if ctx.is_main:
        stdout.write(msg.info(f"Pipeline: {nlp.pipe_names}") + "\n")
        if frozen:
            stdout.write(msg.info(f"Frozen components: {frozen}") + "\n")
        if annotating:
            stdout.write(msg.info(f"Set annotations on update for: {annotating}") + "\n")
        stdout.write(msg.info(f"Initial learn rate: {optimizer.learn_rate}") + "\n")
        if ctx.active:
            stdout.write(
                msg.info(
                    f"Data-parallel: {ctx.world_size} ranks ({ctx.backend}), gradients summed "
                    f"over {len(entries)} parameters"
                )
                + "\n"
            )
            for name in _upper_dropout_parsers(nlp, frozen):
                stdout.write(
                    msg.info(
                        f"{name}: with use_upper = true, spaCy's parser model drops 10% of "
                        "the hidden layer in every training step whatever [training] dropout "
                        "is, so the output layer's weights on several ranks come close to one "
                        "process's, not equal (use_upper = false makes them equal)"
                    )
                    + "\n"
                )
        if resume is not None:
            replayed = [int(r["batches"]) for r in resume["ranks"]]
            where = (
                (
                    f"each rank replays its first {skip_batches} batches of the epoch unused"
                    if len(set(replayed)) == 1
                    else f"the ranks replay the first {', '.join(map(str, replayed))} batches "
                    "of the epoch unused, in rank order"
                )
                if same_ranks
                else f"each rank skips the first {skip_examples} examples of its share of the epoch"
                + (
                    " (the right number; with a listed epoch, max_epochs >= 0, not exactly the "
                    "examples the saved run trained: see distributed.md)"
                    if T["max_epochs"] >= 0
                    else ""
                )
            )
            stdout.write(
                msg.info(
                    f"Resuming at step {step}, epoch {epoch} (saved with "
                    f"{resume['world_size']} rank(s), now {ctx.world_size}): {where}"
                )
                + "\n"
            )
        with nlp.select_pipes(disable=frozen):
            log_step, finalize_logger = T["logger"](nlp, stdout, stderr)
        for path, kept in held_logs:
            stdout.write(
                msg.info(
                    f"The training log {path} goes on after step "
                    f"{int(resume['step']) if resume is not None else 0}: its {kept} earlier "
                    "line(s) are put back in front of it when the run ends."
                )
                + "\n"
            )
    else:
        log_step, finalize_logger = (lambda info: None), (lambda: None)

    start_time = timer()
    batch_iter = batches.epoch(
        epoch,
        skip_batches=skip_batches,
        skip_examples=skip_examples,
        expect_examples=expect_examples,
    )
    if rank_resume is not None and same_ranks:
        _set_rng_states(rank_resume["rng"])
    if resume is not None:
        differed, short_by = ctx.all_reduce_sum([batches.replay_differed, batches.short_by])
        if same_ranks:  # on other shares a rank may hold less than it is to skip
            check_skipped_examples(resume, epoch, short_by, ctx.world_size)
        if differed and ctx.is_main:
            stdout.write(
                msg.warn(
                    f"The {skip_batches} batches replayed on rank 0 hold "
                    f"{batches.replayed_examples} examples, the saved run trained "
                    f"{expect_examples} in them (on {int(differed)} of {ctx.world_size} rank(s) "
                    "they differ): the batcher's settings changed since the state was "
                    "saved, or it draws its sizes from a schedule spacy-lean does not count "
                    "(a custom batcher's). Each rank skips the examples it "
                    "trained on in this epoch instead, and batches the rest as it now does."
                )
                + "\n"
            )
    # Whether some rank trained in this epoch already (a rank without data skips
    # nothing): an epoch no rank trains in has no examples (E986).
    steps_this_epoch = ctx.all_reduce_sum([skip_batches + skip_examples])[0]
    finished = False
    # SIGTERM or Ctrl-C: stop after the step in which some rank has it (stopping.py).
    stopped = False
    # The local launcher says it for its ranks; rank 0 says it for a run of its own, or
    # under torchrun.
    on_signal = None if not ctx.is_main or launched_by_us() else say_stopping(output_path)
    with StopRequest(TRAINING_STOP_SIGNALS, on_signal=on_signal) as stop:
        try:
            while True:
                batch = next(batch_iter, None)
                subbatches = (
                    list(subdivide_batch(batch, T["accumulate_gradient"]))
                    if batch is not None
                    else []
                )
                # Whether each entity_linker (with gold entities) learns from the step's
                # batch (its j-th subbatch), as one process would: it does where some
                # rank's share has a KB candidate; then every rank's linked entities count.
                learns = [
                    j < len(subbatches) and linker_learns(proc, subbatches[j])
                    for j in range(n_slots if linkers else 0)
                    for proc in linkers
                ]
                reduced = ctx.all_reduce_sum([batch is not None] + learns)
                n_with_batch = reduced[0]
                learners = [
                    [proc for i, proc in enumerate(linkers) if reduced[1 + j * len(linkers) + i]]
                    for j in range(len(subbatches))
                ]
                if n_with_batch == 0:
                    if steps_this_epoch == 0:
                        raise ValueError(Errors.E986)
                    epoch += 1
                    # The next epoch starts (its order drawn) also when it is past
                    # max_epochs: the final checkpoint then resumes at its start.
                    batch_iter = batches.epoch(epoch)
                    steps_this_epoch = 0
                    if T["max_epochs"] > 0 and epoch == T["max_epochs"]:
                        break
                    continue
                steps_this_epoch += 1
                if before_update:
                    before_update(nlp, {"step": step, "epoch": epoch})
                dropout = next(dropouts)
                if cupy_base is not None:  # the step's dropout masks on the GPU
                    _reseed_cupy(cupy_step_seed(cupy_base, step, ctx.rank))
                step_losses: Dict[str, float] = {}
                words = 0
                if batch is not None:
                    for subbatch, subbatch_learners in zip(subbatches, learners):
                        with linkers_learn_linked_entities(subbatch_learners):
                            lean_update(
                                nlp,
                                subbatch,
                                drop=dropout,
                                losses=step_losses,
                                exclude=frozen,
                                annotates=annotating,
                                policy=policy,
                            )
                    words = sum(len(eg) for eg in batch)
                # Losses under names that are no pipe's name (a component may report
                # several): their names can differ per rank, so they are gathered as JSON
                # after the all-reduce, in a step where some rank has one (a flag says so).
                other_losses = {k: v for k, v in step_losses.items() if k not in loss_names}
                weights = [
                    _loss_weight(nlp, name, mean_losses.get(name), batch) for name in loss_names
                ]
                extras = [words, 1.0 if other_losses else 0.0]
                extras += [1.0 if name in step_losses else 0.0 for name in loss_names]
                extras += [step_losses.get(name, 0.0) * w for name, w in zip(loss_names, weights)]
                extras += weights
                # A parser or ner that met a new label replaced its output layer: the
                # parameter list must be collected again (one process), or the ranks
                # would hold different layers (several: refused).
                grew = bool(_new_labels(nlp, labels_before))
                extras.append(1.0 if grew else 0.0)
                extras.append(1.0 if stop.requested else 0.0)  # last: ranks asked to stop
                if grew and not ctx.active:
                    entries = collect_params(nlp, exclude=frozen)
                    reducer = GradientReducer(ctx, entries)
                    labels_before = _parser_labels(nlp, frozen)
                summed = reducer.reduce(extras)
                if ctx.active and summed[-2] > 0:
                    new = {}
                    for rank_new in ctx.all_gather_json(_new_labels(nlp, labels_before)):
                        for name, labels in rank_new.items():
                            new[name] = sorted(set(new.get(name, [])) | set(labels))
                    found = "; ".join(f"'{name}': {labels}" for name, labels in new.items())
                    raise LabelsGrewError(
                        f"At step {step}, a training batch held labels that the components' "
                        f"initialize data did not have ({found}). spaCy adds such a label by "
                        "growing the component's output layer, on the rank that met it only, "
                        "so the ranks would train different models. Give every label at "
                        "initialization: leave [initialize.components.<name>.labels] out, "
                        "so that initialization reads the whole training corpus, or write "
                        "the labels file with `spacy init labels` from the whole training "
                        "corpus; then train again."
                    )
                if summed[1] > 0:
                    other_losses = sum_losses(ctx.all_gather_json(other_losses))
                agree_on_overflow(ctx, scalers)
                for name, proc in trainable:
                    proc.finish_update(optimizer)
                optimizer.step_schedules()
                done_step = step
                words_seen += int(round(summed[0]))
                n = len(loss_names)
                for i, name in enumerate(loss_names):
                    if summed[2 + i] > 0:
                        value = float(summed[2 + n + i])
                        if name in mean_losses and summed[2 + 2 * n + i] > 0:
                            value /= float(summed[2 + 2 * n + i])
                        losses[name] = losses.get(name, 0.0) + value
                for name, value in other_losses.items():  # summed over the ranks
                    losses[name] = losses.get(name, 0.0) + value
                if not (step % eval_frequency):
                    with nlp.use_params(optimizer.averages):
                        score, other_scores = evaluate()
                    results.append((score, step))
                    is_best: Optional[bool] = score == max(results)[0]
                else:
                    score, other_scores, is_best = None, None, None
                seconds = seconds_before + timer() - start_time
                info = {
                    "epoch": epoch,
                    "step": step,
                    "score": score,
                    "other_scores": other_scores,
                    "losses": losses,
                    "checkpoints": results,
                    "seconds": int(seconds),
                    "words": words_seen,
                }
                if is_best is not None:
                    with nlp.select_pipes(disable=frozen):
                        update_meta(T, nlp, info)
                    if ctx.is_main and output_path is not None:
                        save_model(is_best)
                        info["output_path"] = str(output_path / DIR_MODEL_LAST)
                    checkpoint(seconds, {})  # the losses logged now start again from zero
                log_step(info if is_best is not None else None)
                if is_best is not None:
                    losses = {}
                best_step = -max((s, -k) for s, k in results)[1]
                if patience and (step - best_step) >= patience:
                    break
                if max_steps and step >= max_steps:
                    break
                # Some rank had a stop request by the step's all-reduce; one process also
                # stops for one that came after it (in the step's evaluation, say).
                if summed[-1] > 0 or (not ctx.active and stop.requested):
                    stopped = True
                    break
                step += 1
            finished = True
        except Exception as e:
            if ctx.is_main and output_path is not None:
                stdout.write(
                    msg.warn(
                        f"Aborting and saving the final best model. Encountered exception: {e!r}"
                    )
                    + "\n"
                )
            raise
        finally:
            finalize_logger()
            restore_console_logs(held_logs)
            if ctx.is_main and output_path is not None:
                save_model(False)
        if finished and output_path is not None:
            # Not saved here yet: the last step was no evaluation, or the run went on to the
            # start of the epoch past max_epochs after it (a resume then starts there).
            if saved_at != (done_step, epoch):
                checkpoint(seconds_before + timer() - start_time, losses)
    if stopped:
        raise TrainingStopped(done_step, int(stop.signum or signal.SIGTERM))
    if optimizer.averages:
        nlp.use_params(optimizer.averages)
    if output_path is not None:
        if ctx.is_main:
            stdout.write(
                msg.good("Saved pipeline to output directory", output_path / DIR_MODEL_LAST) + "\n"
            )
        return nlp, output_path / DIR_MODEL_LAST
    return nlp, None
