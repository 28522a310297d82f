"""Streaming evaluation: take a window of examples, pipe it in batches, reduce the
predictions to mergeable score states, drop the docs.

`Language.evaluate` lists and copies the whole dev set and keeps every predicted doc
(with its transformer output) alive until scoring. `evaluate` here gives the same
numbers with memory bounded by one read-ahead window of examples plus one batch of
activations, whatever the size of the dev set. The same loop backs the
`[nlp.after_pipeline_creation]` callback (so `spacy train` and `spacy evaluate` stream),
the `spacy lean evaluate` command, its checkpoints and its workers.
"""

import contextlib
import functools
import itertools
import json
import math
import os
import random
import warnings
from pathlib import Path
from timeit import default_timer as timer
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import numpy
from spacy.errors import Errors
from spacy.language import Language
from spacy.scorer import Scorer
from spacy.training import Example, validate_examples
from spacy.util import registry

from ._compat import has_cupy, has_torch

# Data is read by spacy_lean.corpus.sources; its error stays importable from here.
from .corpus.sources import CorruptShardError  # noqa: F401
from .memory import HeapTrimmer, empty_gpu_caches
from .scoring.pipeline import release_activations
from .trf_align import fast_alignment
from .trf_batching import sorted_span_groups
from .zones import MemoryZones

CALLBACK_NAME = "spacy-lean.streaming_evaluate.v1"
STRIP_CALLBACK_NAME = "spacy-lean.strip_streaming_evaluate.v1"
# `[nlp.after_pipeline_creation]` callbacks that only matter in training, removed by
# the strip callback (spacy-lean.lean_training.v1 also installs the streaming evaluate).
STRIPPED_CALLBACKS = (CALLBACK_NAME, "spacy-lean.lean_training.v1")
CHECKPOINT_FORMAT = "spacy-lean.eval-checkpoint.v1"
# Read-ahead window, in batches, when no window size is given: the window is sorted by
# length before it is cut into batches, which cuts padding in the transformer.
DEFAULT_WINDOW_BATCHES = 8
# The memory budget of a batch, in padded tokens (docs x the longest doc's spaCy
# tokens), when neither the caller nor the pipeline's transformer says otherwise. The
# activations of every component scale with it; spacy-transformers cuts its own
# batches by the same measure (`max_batch_items`, 4096 by default).
DEFAULT_MAX_BATCH_TOKENS = 4096


class CheckpointMismatchError(ValueError):
    """A checkpoint was written for another model, other data or another scorer."""


def cuda_oom_errors() -> Tuple[type, ...]:
    """The out-of-memory exception classes of the installed GPU libraries.

    RETURNS (Tuple[type, ...]): torch's and cupy's OutOfMemoryError, where installed.
    """
    errors: List[type] = []
    if has_torch:
        import torch

        oom = getattr(torch.cuda, "OutOfMemoryError", None)
        if oom is not None:
            errors.append(oom)
    if has_cupy:  # pragma: no cover - needs cupy
        import cupy

        errors.append(cupy.cuda.memory.OutOfMemoryError)
    return tuple(errors)


class _ScorerFallbackState:
    """Score state for a custom `Scorer` subclass: its `score` method cannot be
    reduced batch by batch, so it keeps slim copies of the examples (predicted docs
    without activations) and scores them at the end (so not in memory zones)."""

    zone_safe = False

    def __init__(self, scorer: Scorer, per_component: bool):
        self.scorer = scorer
        self.per_component = per_component
        self.examples: List[Example] = []
        self.n_words = 0
        self.seconds = 0.0

    def prepare(self, examples: Sequence[Example]) -> None:
        """Nothing to run again: the scorer reads the slim copies at the end."""

    def update(self, examples: Sequence[Example]) -> None:
        for eg in examples:
            release_activations(eg.predicted)
            self.examples.append(eg)

    def add_speed(self, n_words: int, seconds: float) -> None:
        self.n_words += n_words
        self.seconds += seconds

    def result(self) -> Dict[str, Any]:
        scores = self.scorer.score(self.examples, per_component=self.per_component)
        scores["speed"] = self.n_words / self.seconds if self.seconds else 0.0
        return scores


def make_score_state(
    nlp: Language,
    *,
    scorer: Optional[Scorer] = None,
    scorer_cfg: Optional[Dict[str, Any]] = None,
    per_component: bool = False,
):
    """The mergeable score state that `evaluate` updates, built like
    `Language.evaluate` builds its `Scorer`.

    nlp (Language): the pipeline.
    scorer (Optional[Scorer]): a `Scorer`; its `nlp` and `cfg` are used. A subclass of
        `Scorer` cannot be streamed: its examples are kept (slimmed) and it is called
        once at the end, with a warning.
    scorer_cfg (Optional[dict]): keyword arguments for the scorers (ignored when
        `scorer` is given, as in `Language.evaluate`).
    per_component (bool): key the scores by component name.
    RETURNS (PipelineScoreState): the state.
    """
    from .scoring import make_pipeline_state

    if scorer is None:
        cfg = dict(scorer_cfg or {})
        score_nlp = cfg.pop("nlp", nlp)
        return make_pipeline_state(score_nlp, scorer_cfg=cfg, per_component=per_component)
    if type(scorer) is Scorer:
        return make_pipeline_state(
            scorer.nlp, scorer_cfg=dict(scorer.cfg), per_component=per_component
        )
    warnings.warn(
        f"The scorer {type(scorer).__name__} is a subclass of spacy.scorer.Scorer, whose "
        "results cannot be computed batch by batch: spacy-lean keeps a slim copy of every "
        "example and calls its score() once at the end, so memory grows with the data. "
        "Pass scorer=None (and scorer_cfg) to stream, or register mergeable twins for "
        "your components' scorers (see spacy_lean.scoring).",
        UserWarning,
    )
    return _ScorerFallbackState(scorer, per_component)


def resolve_max_batch_tokens(nlp: Language, max_batch_tokens: Optional[int] = None) -> int:
    """The padded-token budget of the evaluation batches.

    A batch's padded size is its number of docs times its longest doc's tokens: the
    size the transformer pads its input to, and what every component's activations
    grow with. It bounds the peak memory of a batch whatever the data (one doc longer
    than the budget is evaluated alone).

    nlp (Language): the pipeline.
    max_batch_tokens (Optional[int]): the budget; None for the `max_batch_items` of
        the pipeline's spacy-transformers component (the largest padded batch it
        runs at once), else `DEFAULT_MAX_BATCH_TOKENS` (4096).
    RETURNS (int): the budget.
    """
    if max_batch_tokens is None:
        for _, proc in nlp.pipeline:
            cfg = getattr(proc, "cfg", None)
            value = cfg.get("max_batch_items") if isinstance(cfg, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                return value
        return DEFAULT_MAX_BATCH_TOKENS
    return check_max_batch_tokens(max_batch_tokens)


def check_window_size(value: Any) -> int:
    """Validate a read-ahead window given by a user (examples; 0 keeps the order).

    RETURNS (int): the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"window_size must be >= 0, got {value}. Use 0 to keep the input order.")
    return value


def check_max_batch_tokens(value: Any) -> int:
    """Validate a padded-token budget given by a user.

    RETURNS (int): the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"max_batch_tokens must be a whole number of padded tokens >= 1 (docs x the "
            f"longest doc's tokens in a batch), got {value!r}. Use e.g. 4096, or leave it "
            "unset (null in a config) for the pipeline's default."
        )
    return value


def check_trim_slack_mb(value: Any) -> Optional[float]:
    """Validate a heap-trimming slack given by a user (see `StreamingEvaluator`).

    RETURNS (Optional[float]): the value; None never trims.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"trim_slack_mb must be a number of MB >= 0, got {value!r}. Use 0 to trim the "
            "heap after every batch (the default: the lowest peak), e.g. 16 to trim only once "
            "resident memory has grown 16 MB above its level after the last trim (less CPU "
            "time), or null (None in Python) never to trim."
        )
    return value


@contextlib.contextmanager
def _global_rng_untouched() -> Iterator[None]:
    """Leave Python's and numpy's global random states as they were found.

    spacy-transformers draws `random.random()` on every forward pass
    (`maybe_flush_pytorch_cache`), so an evaluation during `spacy train` would shift
    every later shuffle of the training data by how many batches it happened to
    run: training would depend on the dev set's size and batching. With the states
    restored, the dev evaluation never changes what is trained.
    """
    py_state = random.getstate()
    np_state = numpy.random.get_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        numpy.random.set_state(np_state)


class _ReaderRandom:
    """An example stream read with random states of its own: those of the evaluation's
    start, going on from read to read. `Language.evaluate` lists the examples before any
    forward pass, so a reader's random augmenter draws one run of numbers; read window
    by window, the forward passes' draws (spacy-transformers draws one per batch) fell
    in between, and every window after the first was augmented otherwise. Swapped at
    the first read after `leave()` and at `leave()`: once per window."""

    def __init__(self, stream: Iterator[Any]) -> None:
        self._stream = stream
        self._reader = (random.getstate(), numpy.random.get_state())
        self._other: Any = None

    def __iter__(self) -> "_ReaderRandom":
        return self

    def __next__(self) -> Any:
        if self._other is None:
            self._other = (random.getstate(), numpy.random.get_state())
            random.setstate(self._reader[0])
            numpy.random.set_state(self._reader[1])
        return next(self._stream)

    def leave(self) -> None:
        """Back to the forward passes' states, the reader's kept for its next read."""
        if self._other is not None:
            self._reader = (random.getstate(), numpy.random.get_state())
            random.setstate(self._other[0])
            numpy.random.set_state(self._other[1])
            self._other = None


class StreamingEvaluator:
    """Evaluates a pipeline over a stream of examples in bounded memory.

    It reads a window of examples, sorts it by length, pipes it in batches, updates
    the score state with the window in the original order (so per-type dicts are
    ordered as `Language.evaluate` orders them), and drops the docs. The memory bound:
    a batch holds at most `batch_size` docs and `max_batch_tokens` padded tokens (docs
    x the longest doc's tokens), a window at most as many tokens as its batches would
    hold (`window_size / batch_size` x `max_batch_tokens`); a single doc longer than
    that is a batch (and a window) of its own. A batch that runs out of GPU memory is
    halved and retried; later batches keep the smaller size and budget. Empty docs are
    piped as `Language.evaluate` pipes them (`_empty_docs`): with a non-empty doc, over
    `batch_size`, unless their batch there holds only empty docs.
    """

    def __init__(
        self,
        nlp: Language,
        *,
        batch_size: Optional[int] = None,
        component_cfg: Optional[Dict[str, Dict[str, Any]]] = None,
        scorer: Optional[Scorer] = None,
        scorer_cfg: Optional[Dict[str, Any]] = None,
        per_component: bool = False,
        window_size: Optional[int] = None,
        max_batch_tokens: Optional[int] = None,
        state: Any = None,
        on_oom: Optional[Callable[[int, int], None]] = None,
        trim_heap: bool = True,
        trim_slack_mb: Optional[float] = 0.0,
        copy_examples: bool = True,
        sort_spans: bool = True,
        memory_zones: bool = True,
    ):
        """Initialise the evaluator.

        nlp (Language): the pipeline to evaluate.
        batch_size (Optional[int]): docs per `nlp.pipe` batch; defaults to `nlp.batch_size`.
        component_cfg (Optional[dict]): extra keyword arguments per component, as in
            `Language.evaluate`.
        scorer (Optional[Scorer]): see `make_score_state`.
        scorer_cfg (Optional[dict]): keyword arguments for the scorers.
        per_component (bool): key the scores by component name.
        window_size (Optional[int]): examples read ahead and sorted by length before
            batching; 0 or 1 keeps the input order. Defaults to 8 batches.
        max_batch_tokens (Optional[int]): padded tokens per batch (see
            `resolve_max_batch_tokens`); also caps the window's tokens.
        state (Optional[PipelineScoreState]): a state to continue (from a checkpoint).
        on_oom (Optional[Callable[[int, int], None]]): called with (failed batch size,
            new batch size) when a batch ran out of GPU memory. Defaults to a warning.
        trim_heap (bool): after each batch, give the memory the C heap freed back to
            the OS (`spacy_lean.memory.trim_host_memory`), so resident memory stays flat
            (never trimming, or trimming every 4 batches, let the peak creep up with the
            number of batches: +4.6% and +5.8% from 1,200 to 4,800 docs).
        trim_slack_mb (Optional[float]): trim only once resident memory has grown more
            than this many MB above its level right after the last trim
            (`spacy_lean.memory.HeapTrimmer` with `settle=0`): a batch that frees more
            than the slack is trimmed after, as without a slack; small batches are
            trimmed once what they freed adds up past it. 0 (the default) trims after
            every batch: the lowest and flattest peak, at the cost of faulting every
            batch's memory in again. None never trims (as `trim_heap=False`). Measured
            in process (2x64 model, 13,848 tweet-length docs): 16 MB trimmed after 89 of
            433 batches, half the page faults, peak +9 MB; 4x256 model on CoNLL-style
            groups: after every batch, the same peak. (Before, the level was measured at
            the batch after each trim, which held that batch's freed pages: 16 MB then
            raised a 4x256 model's peak from 632 to 689-700 MB; `eval_heap_trim.py`.)
        copy_examples (bool): pipe copies of the predicted docs, as `Language.evaluate`
            does, so the caller's examples are left untouched. False saves a copy per
            doc where the examples belong to the evaluator alone (as those made by
            `read_examples`); their predicted docs are then replaced.
        sort_spans (bool): run each spacy-transformers batch's spans in length-sorted
            groups (`spacy_lean.trf_batching.sorted_span_groups`): the same predictions
            with much less wordpiece padding computed.
        memory_zones (bool): where the stream says when it holds no doc (`holds_docs`:
            spacy-lean's readers), read and score it in spaCy memory zones
            (`Language.memory_zone`), one after another, so that the strings and
            lexemes its docs add to the vocab are freed as it goes: the vocab (and
            spaCy's tokenizer cache) stop growing with the number of distinct words.
            The scores are the same (see `MemoryZones`).
        """
        if batch_size is None:
            batch_size = nlp.batch_size
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if window_size is None:
            window_size = DEFAULT_WINDOW_BATCHES * batch_size
        check_window_size(window_size)
        self.nlp = nlp
        self.batch_size = batch_size
        self.sort_window = window_size > 1
        self.window_size = max(window_size, batch_size)
        self.max_batch_tokens = resolve_max_batch_tokens(nlp, max_batch_tokens)
        # The window holds at most the tokens its batches would hold when full.
        self.window_tokens = -(-self.window_size // batch_size) * self.max_batch_tokens
        self.component_cfg = component_cfg if component_cfg is not None else {}
        if state is None:
            state = make_score_state(
                nlp, scorer=scorer, scorer_cfg=scorer_cfg, per_component=per_component
            )
        self.state = state
        self.on_oom = on_oom if on_oom is not None else _warn_oom
        check_trim_slack_mb(trim_slack_mb)
        self.trim_heap = trim_heap and trim_slack_mb is not None
        # The level: resident memory right after each trim (settle=0), so that a batch
        # that frees more than the slack is trimmed after, as with no slack.
        self._trimmer = HeapTrimmer(trim_slack_mb or 0.0, settle=0)
        self.copy_examples = copy_examples
        self.sort_spans = sort_spans
        self.memory_zones = memory_zones
        self.zones: Optional[MemoryZones] = None  # those of the latest `run`
        self._pending: Optional[Example] = None  # read ahead: the next window's first
        self._oom_types = cuda_oom_errors()
        self.n_examples = 0  # examples consumed from the stream, skipped ones included
        # Empty docs are piped as `Language.evaluate` pipes them: in a batch with a
        # non-empty doc unless their batch of `batch_size` there holds only empty docs
        # (spaCy's textcat gives those zeros, the others its model's output).
        self._stock_batch_size = batch_size
        self._empty_run = 0  # empty docs right before the window, at most a batch's
        self._window_followed = False  # a non-empty doc ends the window's last batch
        self.n_batches = 0
        self.n_words = 0
        self.oom_events: List[Tuple[int, int]] = []

    def run(
        self,
        examples: Iterable[Example],
        *,
        skip: int = 0,
        on_window: Optional[Callable[["StreamingEvaluator"], None]] = None,
    ):
        """Evaluate every example of `examples`, lazily.

        examples (Iterable[Example]): gold examples; any iterable, consumed once.
        skip (int): examples at the start of the stream that were already counted
            (resuming from a checkpoint); they are read and dropped, not piped.
        on_window (Optional[Callable]): called with the evaluator after each window.
        RETURNS (PipelineScoreState): the updated state.

        Python's and numpy's global random states are left as they were found, so an
        evaluation during training never changes what is trained afterwards.
        """
        if not isinstance(examples, Iterable):
            raise TypeError(Errors.E978.format(name="Language.evaluate", types=type(examples)))
        groups = sorted_span_groups(self.nlp) if self.sort_spans else contextlib.nullcontext()
        with _global_rng_untouched(), fast_alignment(), groups:
            return self._run(examples, skip, on_window)

    def _run(self, examples, skip, on_window):
        zones = (
            MemoryZones.for_stream(self.nlp, examples, self.state) if self.memory_zones else None
        )
        self.zones = zones
        if zones is None:
            return self._read(examples, skip, on_window, None)
        try:  # the first window outside any zone (`spacy_lean.zones`)
            return self._read(examples, skip, on_window, zones)
        finally:
            self._pending = None
            zones.close()

    def _read(self, examples, skip, on_window, zones):
        stream = _ReaderRandom(iter(examples))
        if skip:
            skipped = self._skip(stream, skip, zones)
            if skipped < skip:
                raise CheckpointMismatchError(
                    f"The checkpoint has {skip} examples counted, but the data has only "
                    f"{skipped}: it was made with other data. Delete the checkpoint to start "
                    "over."
                )
            self.n_examples += skip
        for window in self._windows(stream):
            stream.leave()
            self._evaluate_window(window)
            self.n_examples += len(window)
            window.clear()  # its docs are not used again (the reader's list too)
            if on_window is not None:
                on_window(self)
            if zones is not None:
                self._pending = zones.next_zone(self._pending)
        return self.state

    def _skip(self, stream: Iterator[Any], skip: int, zones: Optional[MemoryZones]) -> int:
        """Read and drop `skip` examples (counted before a resume); in memory zones, a
        window's worth per zone, so what they add to the vocab goes too."""
        if zones is None:
            return sum(1 for _ in itertools.islice(stream, skip))
        zones.open()
        skipped = 0
        for eg in itertools.islice(stream, skip):
            skipped += 1
            zones.note((eg,))
            if skipped % self.window_size == 0 and not zones.source.holds_docs():
                zones.close()
                zones.open()
        if not zones.source.holds_docs():
            zones.close()  # the next window outside any zone, as a first window
        return skipped

    def _windows(self, stream: Iterator[Any]) -> Iterator[List[Example]]:
        """Cut the stream into windows of at most `window_size` examples and
        `window_tokens` tokens; an example longer than that is a window of its own.
        A window that ends in empty docs takes the empty docs after them in their
        `Language.evaluate` batch too (they hold no tokens), and notes whether a
        non-empty doc follows in that batch (`_window_followed`)."""
        size = self._stock_batch_size
        g = self.n_examples  # the stream position of the next example
        window: List[Example] = []
        n_tokens = 0
        while True:
            eg = _next_example(stream)
            if eg is None:
                break
            length = len(eg.predicted)
            if window and (
                len(window) >= self.window_size or n_tokens + length > self.window_tokens
            ):
                followed = False
                if len(window[-1].predicted) == 0:
                    while g % size and len(eg.predicted) == 0:
                        window.append(eg)
                        g += 1
                        eg = _next_example(stream)
                        if eg is None:
                            break
                    followed = eg is not None and g % size != 0
                self._window_followed = followed
                # The example read ahead waits in `_pending`, where `_read` may make it
                # again in the next memory zone (`MemoryZones.next_zone`).
                self._pending, eg = eg, None
                yield window
                window, n_tokens = [], 0
                eg, self._pending = self._pending, None
                if eg is None:
                    return
                length = len(eg.predicted)
            window.append(eg)
            g += 1
            n_tokens += length
        if window:
            self._window_followed = False
            yield window

    def _evaluate_window(self, window: List[Example]) -> None:
        lengths = [len(eg.predicted) for eg in window]
        order: Iterable[int] = [i for i, n in enumerate(lengths) if n]
        if self.sort_window:
            order = sorted(order, key=lengths.__getitem__)
        batches = list(self._batches(order, lengths))
        alone, joined = self._empty_docs(lengths)
        n = len(window)
        if joined:
            if not batches:  # a doc to pipe them with, whose output is not scored
                window = window + [self._partner()]
                batches = [[n]]
            batches[0] = joined + batches[0]
        size = self._stock_batch_size
        batches += [alone[k : k + size] for k in range(0, len(alone), size)]
        scored: List[Optional[Example]] = [None] * len(window)
        for indices in batches:
            for i, eg in zip(indices, self._pipe_batch([window[i] for i in indices])):
                scored[i] = eg
        self.state.update(scored[:n])
        if self.zones is not None:  # their analyses' strings outlive the zone
            self.zones.note(scored[:n])
        trailing = next((k for k, length in enumerate(reversed(lengths)) if length), n)
        run = trailing + (self._empty_run if trailing == n else 0)
        self._empty_run = min(run, size)

    def _partner(self) -> Example:
        """A 1-token example piped with empty docs that have no non-empty doc to go
        with; its output is not scored."""
        return Example(self.nlp.make_doc("x"), self.nlp.make_doc("x"))

    def _empty_docs(self, lengths: List[int]) -> Tuple[List[int], List[int]]:
        """The window's empty docs: those `Language.evaluate` pipes in a batch of empty
        docs only, and the others (piped with a non-empty doc)."""
        size, start, n = self._stock_batch_size, self.n_examples, len(lengths)
        alone: List[int] = []
        joined: List[int] = []
        for i, length in enumerate(lengths):
            if length:
                continue
            first = start + i - (start + i) % size  # its batch in Language.evaluate
            end = first + size
            nonempty = (
                (first < start and start - first > self._empty_run)
                or any(lengths[max(first - start, 0) : min(end - start, n)])
                or (end > start + n and self._window_followed)
            )
            (joined if nonempty else alone).append(i)
        return alone, joined

    def _batches(self, order: Iterable[int], lengths: List[int]) -> Iterator[List[int]]:
        """Cut `order` into batches of at most `batch_size` docs and `max_batch_tokens`
        padded tokens (docs x the longest doc); a longer doc is a batch of its own.
        Both limits are read per batch: an out-of-memory retry lowers them."""
        batch: List[int] = []
        longest = 0
        for i in order:
            longer = max(longest, lengths[i])
            if batch and (
                len(batch) >= self.batch_size or (len(batch) + 1) * longer > self.max_batch_tokens
            ):
                yield batch
                batch, longer = [], lengths[i]
            batch.append(i)
            longest = longer
        if batch:
            yield batch

    def _pipe_batch(self, batch: List[Example]) -> List[Example]:
        """Pipe one batch's predicted docs; on OOM, halve and retry."""
        try:
            return self._pipe(batch)
        except self._oom_types:
            if len(batch) <= 1:
                raise
        # Outside the except block, so the failed attempt's frames (and tensors) are freed.
        empty_gpu_caches()
        half = (len(batch) + 1) // 2
        longest = max(len(eg.predicted) for eg in batch)
        # Empty docs piped with non-empty ones stay with one (`_empty_docs`): they go
        # to the first half, which keeps at least one non-empty doc.
        full = [i for i, eg in enumerate(batch) if len(eg.predicted)]
        empty = [i for i, eg in enumerate(batch) if not len(eg.predicted)]
        partner = None
        if full and empty:
            keep = (len(full) + 1) // 2
            if len(full) == 1:  # the one doc with tokens goes alone; a 1-token doc,
                # whose output is not scored, keeps the empty ones company
                partner = self._partner()
                parts = [full, [len(batch)] + empty]
            else:
                parts = [empty + full[:keep], full[keep:]]
            half = keep
        else:
            parts = [list(range(half)), list(range(half, len(batch)))]
        self.oom_events.append((len(batch), half))
        self.batch_size = min(self.batch_size, half)
        self.max_batch_tokens = max(1, min(self.max_batch_tokens, half * longest))
        self.on_oom(len(batch), half)
        pool = batch + ([partner] if partner is not None else [])
        out: List[Example] = list(pool)
        for part in parts:
            for i, eg in zip(part, self._pipe_batch([pool[i] for i in part])):
                out[i] = eg
        return out[: len(batch)]

    def _pipe(self, batch: List[Example]) -> List[Example]:
        if self.copy_examples:
            # Copies, as Language.evaluate makes: the caller's predicted docs stay untouched.
            batch = [Example(eg.predicted.copy(), eg.reference) for eg in batch]
        # Unlike Language.evaluate, the reference texts are not tokenized again "for
        # timing": `speed` counts the pipeline's time only.
        start = timer()
        docs = list(
            self.nlp.pipe(
                (eg.predicted for eg in batch),
                batch_size=len(batch),
                component_cfg=self.component_cfg,
            )
        )
        seconds = timer() - start
        n_words = 0
        for eg, doc in zip(batch, docs):
            eg.predicted = doc
            n_words += len(doc)
        # A doc's transformer output and tensor pin the whole batch's activations: they
        # are released now, once the states that read them (an entity_linker scored with
        # gold entities runs again) have done so.
        self.state.prepare(batch)
        for doc in docs:
            release_activations(doc)
        self.state.add_speed(n_words, seconds)
        self.n_words += n_words
        self.n_batches += 1
        if self.trim_heap:
            self._trimmer()
        return batch


def _next_example(stream: Iterator[Any]) -> Optional[Example]:
    """The next example of the stream (None at its end), validated as spaCy does."""
    eg = next(stream, None)
    if eg is not None and not isinstance(eg, Example):
        validate_examples([eg], "Language.evaluate")  # raises spaCy's TypeError
    return eg


def _warn_oom(failed: int, new: int) -> None:
    warnings.warn(
        f"Out of GPU memory on a batch of {failed} docs: retrying it in batches of "
        f"{new}, and using that batch size from now on. Pass a smaller batch_size to "
        "avoid the retry.",
        ResourceWarning,
    )


def evaluate(
    nlp: Language,
    examples: Union[Iterable[Example], str, Path],
    *,
    batch_size: Optional[int] = None,
    scorer: Optional[Scorer] = None,
    component_cfg: Optional[Dict[str, Dict[str, Any]]] = None,
    scorer_cfg: Optional[Dict[str, Any]] = None,
    per_component: bool = False,
    window_size: Optional[int] = None,
    max_batch_tokens: Optional[int] = None,
    sort_spans: bool = True,
    trim_slack_mb: Optional[float] = 0.0,
    memory_zones: bool = True,
) -> Dict[str, Any]:
    """Evaluate a pipeline like `Language.evaluate`, streaming.

    The examples are consumed lazily, a window at a time; the predicted docs are
    reduced to counts and dropped, so memory does not grow with the number of examples.
    The caller's examples are not modified.

    nlp (Language): the pipeline.
    examples (Iterable[Example] / str / Path): gold examples (a list, a generator, a
        corpus...), or the path of a .spacy/.jsonl file or a folder of them, read in
        bounded memory by `spacy_lean.corpus.read_examples` as `spacy evaluate` reads it.
    batch_size (Optional[int]): docs per batch; defaults to `nlp.batch_size`.
    scorer (Optional[Scorer]): as in `Language.evaluate`.
    component_cfg (Optional[dict]): extra keyword arguments per component.
    scorer_cfg (Optional[dict]): extra keyword arguments for the scorers.
    per_component (bool): key the scores by component name.
    window_size (Optional[int]): examples read ahead and sorted by length; 0 keeps the
        input order (the scores are the same either way). Defaults to 8 batches.
    max_batch_tokens (Optional[int]): the memory budget of a batch in padded tokens
        (docs x the longest doc's tokens); the window holds at most as many tokens as
        its batches. Defaults to the transformer's `max_batch_items`, else 4096.
    sort_spans (bool): run the transformer's spans in length-sorted groups (the same
        predictions, less padding computed; see `spacy_lean.trf_batching`).
    trim_slack_mb (Optional[float]): hand the memory the C heap freed back to the OS
        after every batch (0, the default: the lowest peak), only once resident memory
        has grown more than this many MB above its level right after the last trim
        (less CPU time, a higher peak), or never (None). The scores are the same (see
        `StreamingEvaluator`).
    memory_zones (bool): read and score a stream of spacy-lean's readers (a path given
        here, `spacy-lean.Corpus.v1`) in spaCy memory zones, so the vocab does not grow
        with the data's distinct words (`spacy_lean.zones`); the scores are the same.
    RETURNS (Dict[str, Any]): the scores, as `Language.evaluate` returns them.
    """
    from_path = isinstance(examples, (str, Path))
    if from_path:
        from .corpus.sources import list_shards, read_examples

        examples = read_examples(nlp, list_shards(examples))
    evaluator = StreamingEvaluator(
        nlp,
        batch_size=batch_size,
        component_cfg=component_cfg,
        scorer=scorer,
        scorer_cfg=scorer_cfg,
        per_component=per_component,
        window_size=window_size,
        max_batch_tokens=max_batch_tokens,
        sort_spans=sort_spans,
        trim_slack_mb=trim_slack_mb,
        copy_examples=not from_path,  # examples read here are seen by no one else
        memory_zones=memory_zones,
    )
    return evaluator.run(examples).result()


# ---------------------------------------------------------------------------------
# spaCy integration: make `nlp.evaluate` streaming on an instance.


def install_streaming_evaluate(
    nlp: Language,
    *,
    window_size: Optional[int] = None,
    max_batch_tokens: Optional[int] = None,
    trim_slack_mb: Optional[float] = 0.0,
    memory_zones: bool = True,
) -> Language:
    """Replace `nlp.evaluate` on this instance by the streaming `evaluate`.

    nlp (Language): the pipeline; modified in place.
    window_size (Optional[int]): default read-ahead window (see `evaluate`).
    max_batch_tokens (Optional[int]): padded tokens per batch (see `evaluate`).
    trim_slack_mb (Optional[float]): heap trimming (see `evaluate`).
    memory_zones (bool): memory zones for spacy-lean's readers (see `evaluate`).
    RETURNS (Language): the same pipeline.
    """
    if max_batch_tokens is not None:
        check_max_batch_tokens(max_batch_tokens)
    check_trim_slack_mb(trim_slack_mb)
    # A partial of a module-level function, not a method bound to a local function, so
    # the pipeline still pickles (`nlp.pipe(n_process=2)` where processes are spawned).
    method = functools.partial(
        evaluate,
        nlp,
        window_size=window_size,
        max_batch_tokens=max_batch_tokens,
        trim_slack_mb=trim_slack_mb,
        memory_zones=memory_zones,
    )
    method.__doc__ = evaluate.__doc__
    nlp.evaluate = method  # type: ignore[method-assign]
    return nlp


def is_streaming(nlp: Language) -> bool:
    """Whether `nlp.evaluate` was made streaming by `install_streaming_evaluate`."""
    method = nlp.__dict__.get("evaluate")
    return isinstance(method, functools.partial) and method.func is evaluate


def streaming_settings(nlp: Language) -> Dict[str, Any]:
    """The settings `install_streaming_evaluate` gave the pipeline's `nlp.evaluate`
    (`window_size`, `max_batch_tokens`, `trim_slack_mb`, `memory_zones`), for a loop
    that builds its own `StreamingEvaluator`; {} where `nlp.evaluate` is not streaming."""
    return dict(nlp.__dict__["evaluate"].keywords) if is_streaming(nlp) else {}


@registry.callbacks(CALLBACK_NAME)
def make_streaming_evaluate_v1(
    window_size: Optional[int] = None,
    max_batch_tokens: Optional[int] = None,
    trim_slack_mb: Optional[float] = 0.0,
    memory_zones: bool = True,
) -> Callable[[Language], Language]:
    """An `[nlp.after_pipeline_creation]` callback that makes `nlp.evaluate` streaming,
    so `spacy train`'s dev evaluation and `spacy evaluate` use bounded memory.

    A pipeline saved with it names it in its config and needs spacy-lean to load; add
    `spacy-lean.strip_streaming_evaluate.v1` as `[training.before_to_disk]` to save
    pipelines that load without spacy-lean.

    window_size (Optional[int]): examples read ahead and sorted by length (see
        `spacy_lean.evaluate`); null for 8 batches, 0 to keep the input order.
    max_batch_tokens (Optional[int]): padded tokens per batch, the memory budget (see
        `spacy_lean.evaluate`); null for the transformer's `max_batch_items`, else 4096.
    trim_slack_mb (Optional[float]): hand freed heap memory back to the OS after every
        batch (0), only past this many MB above the level after the last trim, or never
        (null); see `spacy_lean.evaluate`. The scores are the same.
    memory_zones (bool): read spacy-lean's readers in spaCy memory zones, so the vocab
        does not grow with the dev set's distinct words (see `spacy_lean.zones`). The
        scores are the same.
    RETURNS (Callable[[Language], Language]): the callback.
    """
    if not isinstance(memory_zones, bool):
        raise ValueError(
            f"{CALLBACK_NAME}: memory_zones must be true or false, got {memory_zones!r}."
        )
    try:  # checked when the config is read, not at the first evaluation
        if max_batch_tokens is not None:
            check_max_batch_tokens(max_batch_tokens)
        if window_size is not None:
            check_window_size(window_size)
        check_trim_slack_mb(trim_slack_mb)
    except ValueError as err:
        raise ValueError(f"{CALLBACK_NAME}: {err}") from None

    def after_pipeline_creation(nlp: Language) -> Language:
        # `spacy train` of a lean config: its torch models' optimizer step without
        # thinc's chain that grows each step (`training.torch_step`).
        from .training._nodes import pipeline_nodes
        from .training.torch_step import install_flat_torch_step

        if any(node.shims for node in pipeline_nodes(nlp)):
            install_flat_torch_step()
        return install_streaming_evaluate(
            nlp,
            window_size=window_size,
            max_batch_tokens=max_batch_tokens,
            trim_slack_mb=trim_slack_mb,
            memory_zones=memory_zones,
        )

    return after_pipeline_creation


@registry.callbacks(STRIP_CALLBACK_NAME)
def make_strip_streaming_evaluate_v1() -> Callable[[Language], Language]:
    """A `[training.before_to_disk]` callback that removes
    `spacy-lean.streaming_evaluate.v1` (or `spacy-lean.lean_training.v1`) from the
    config of the pipeline being saved, so
    the saved pipeline loads where spacy-lean is not installed (and evaluates with
    spaCy's own `Language.evaluate` there). Training keeps streaming.

    RETURNS (Callable[[Language], Language]): the callback.
    """

    def before_to_disk(nlp: Language) -> Language:
        nlp_cfg = nlp.config["nlp"]
        callback = nlp_cfg.get("after_pipeline_creation") or {}
        if isinstance(callback, dict) and callback.get("@callbacks") in STRIPPED_CALLBACKS:
            nlp_cfg["after_pipeline_creation"] = None
        return nlp

    return before_to_disk


class _NonFinite(str):
    """A NaN, Infinity or -Infinity token read from a checkpoint (json's parse_constant)."""

    def __repr__(self) -> str:
        return str(self)


def _find_in_json(value: Any, bad: Callable[[Any], bool]) -> Optional[Tuple[str, Any]]:
    """The first (field, value) in decoded JSON for which `bad` holds, the field as a
    dotted path ("units.0.state.seconds", "state.components[1]"); None if none.
    Iterative: a deeply nested file cannot exhaust the stack."""
    stack: List[Tuple[str, Any]] = [("the whole file", value)]
    while stack:
        where, item = stack.pop()
        if bad(item):
            return where, item
        top = where == "the whole file"
        if isinstance(item, dict):
            children = [(k if top else f"{where}.{k}", v) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            children = [(f"{where}[{i}]", v) for i, v in enumerate(item)]
        else:
            continue
        stack.extend(reversed(children))  # depth first, in file order
    return None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------
# Checkpoints: the score state and the position in the stream, saved atomically.


class EvalCheckpoint:
    """Saves an evaluation's state every N batches and resumes from it.

    The file holds the score state, the number of examples counted (or, with several
    workers, the state of each finished unit) and the fingerprints of the model, the
    data, the scorer and the work layout; resuming with any of them changed is refused.
    """

    def __init__(
        self,
        path: Union[str, Path],
        *,
        model_fingerprint: str,
        data_fingerprint: str,
        layout: str = "stream",
        every: int = 50,
    ):
        """Initialise the checkpoint.

        path (Union[str, Path]): the JSON file.
        model_fingerprint (str): identifies the pipeline (see
            `spacy_lean.corpus.sources.path_fingerprint`).
        data_fingerprint (str): identifies the data.
        layout (str): "stream" for one process, else a description of the units.
        every (int): save every `every` batches (at the end of a window).
        """
        if every < 1:
            raise ValueError(f"Checkpoint every must be >= 1 batch, got {every}.")
        self.path = Path(path)
        self.model_fingerprint = model_fingerprint
        self.data_fingerprint = data_fingerprint
        self.layout = layout
        self.every = every
        self._saved_at_batch = 0
        self.n_saves = 0

    def load(
        self,
        nlp: Language,
        state_fingerprint: str,
        scorer_cfg: Optional[Dict[str, Any]] = None,
        per_component: Optional[bool] = None,
    ) -> Optional[Dict[str, Any]]:
        """Read the checkpoint, if there is one, and check it fits this run.

        nlp (Language): the pipeline, to restore the states.
        state_fingerprint (str): the fingerprint of this run's score state.
        scorer_cfg (Optional[dict]): the scorer settings of this run.
        per_component (Optional[bool]): this run's setting (the counts do not depend
            on it, so the restored state reports as this run asks); None keeps the
            checkpoint's.
        RETURNS (Optional[dict]): None when there is no file; else a dict with the
            restored "state" (or None), "units" (index -> state), "n_examples",
            "n_batches" and "done".
        """
        if not self.path.exists():
            return None
        try:
            # Strict JSON, written with `json` (earlier spacy-lean wrote it with srsly:
            # read the same). NaN and Infinity, which Python's json would accept, are
            # kept as markers and refused below, naming the field.
            data = json.loads(self.path.read_text(encoding="utf8"), parse_constant=_NonFinite)
        except Exception as e:
            raise CheckpointMismatchError(
                f"Could not read the checkpoint {self.path} ({e}). Delete it to start over."
            ) from e
        if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointMismatchError(
                f"{self.path} is not a spacy-lean evaluation checkpoint (its 'format' is "
                f"{_short(found)}, expected {CHECKPOINT_FORMAT!r}). Give another "
                "--checkpoint path, or delete the file to start over."
            )
        bad = _find_in_json(data, lambda v: isinstance(v, _NonFinite))
        if bad is not None:
            self._refuse(bad[0], bad[1], "a finite number (strict JSON has no NaN or Infinity)")
        for what, key, value in (
            ("another model", "model", self.model_fingerprint),
            ("other data (or another --gold-preproc setting)", "data", self.data_fingerprint),
            ("another scorer configuration", "scorer", state_fingerprint),
            (
                "another layout of the work (one process against --workers, or the data cut "
                "into other work units)",
                "layout",
                self.layout,
            ),
        ):
            if data.get(key) != value:
                raise CheckpointMismatchError(
                    f"The checkpoint {self.path} was made with {what}: refusing to resume, "
                    "the scores would mix two evaluations. Rerun with the same model, data "
                    "and options, give another --checkpoint path, or delete the file to "
                    "start over."
                )
        from .scoring import PipelineScoreState
        from .scoring.base import StateFieldError

        counts = {key: self._count(data, key) for key in ("n_examples", "n_batches")}
        done = data.get("done", False)
        if not isinstance(done, bool):
            self._refuse("done", done, "true or false")
        state = data.get("state")
        if state is not None and not isinstance(state, dict):
            self._refuse("state", state, "a score state (an object) or null")
        units = data.get("units") or {}
        if not isinstance(units, dict):
            self._refuse("units", units, "an object of finished work units")
        for key, unit in units.items():
            if not (key.isascii() and key.isdigit()):
                self._refuse(f"units key {key!r}", key, "a work unit's number")
            if not isinstance(unit, dict) or not isinstance(unit.get("state"), dict):
                self._refuse(f"units.{key}", unit, "an object with a 'state' and 'n_examples'")
            self._count(unit, "n_examples", f"units.{key}.")
            if "empty_docs" in unit:  # absent in checkpoints written before it was counted
                self._count(unit, "empty_docs", f"units.{key}.")

        def restore(where: str, data: Dict[str, Any], *args: Any) -> PipelineScoreState:
            try:
                return PipelineScoreState.from_dict(data, nlp, scorer_cfg, *args)
            except StateFieldError as err:  # a count or label no state holds
                self._refuse(f"{where}{err.field}", err.value, err.expected)
                raise  # not reached: _refuse raises

        try:
            resumed = {
                "state": (restore("state.", state, per_component) if state is not None else None),
                "units": {int(k): v for k, v in units.items()},
                "n_examples": counts["n_examples"],
                "n_batches": counts["n_batches"],
                "done": done,
            }
            # Merged at the end: check them now.
            restored = [("state.", resumed["state"])] + [
                (f"units.{k}.state.", restore(f"units.{k}.state.", v["state"]))
                for k, v in units.items()
            ]
        except CheckpointMismatchError:
            raise
        except Exception as e:  # any damage in a state: named, with the fix
            raise CheckpointMismatchError(
                f"The checkpoint {self.path} could not be restored ({type(e).__name__}: {e}): it "
                "was written by another version of spacy-lean, or edited. Delete it (or give "
                "another --checkpoint path) to start over."
            ) from e
        for where, restored_state in restored:
            seconds = getattr(restored_state, "seconds", 0.0)
            if not (math.isfinite(seconds) and seconds >= 0):  # the speed would be NaN
                self._refuse(f"{where}seconds", seconds, "a finite number of seconds >= 0")
        self._saved_at_batch = resumed["n_batches"]
        return resumed

    def _count(self, data: Dict[str, Any], key: str, where: str = "") -> int:
        value = data.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self._refuse(f"{where}{key}", value, "a whole number >= 0")
        return value

    def _refuse(self, field: str, value: Any, expected: str) -> None:
        raise CheckpointMismatchError(
            f"The checkpoint {self.path} has {field} = {_short(value)}, expected {expected}: it "
            "was edited or damaged (spacy-lean never writes that). Delete it (or give another "
            "--checkpoint path) to start over."
        )

    def save(
        self,
        state: Any,
        *,
        n_examples: int = 0,
        n_batches: int = 0,
        done: bool = False,
        units: Optional[Dict[int, Dict[str, Any]]] = None,
    ) -> None:
        """Write the checkpoint atomically (a crash mid-write leaves the old one).

        state (PipelineScoreState): the merged state; with `units`, only its
            fingerprint is stored.
        units (Optional[Dict[int, dict]]): finished units, by index, as
            {"state": state.to_dict(), "n_examples": n}.
        """
        data = {
            "format": CHECKPOINT_FORMAT,
            "model": self.model_fingerprint,
            "data": self.data_fingerprint,
            "scorer": state.fingerprint,
            "layout": self.layout,
            "n_examples": n_examples,
            "n_batches": n_batches,
            "done": done,
            "state": state.to_dict() if units is None else None,
            "units": {str(k): v for k, v in (units or {}).items()},
        }
        # Python's json writes floats exactly (shortest repr; srsly keeps 10 digits) and,
        # with allow_nan=False, strict JSON. The score states carry their floats as hex
        # strings (inf and nan included), so a non-finite float here is a bug: refused
        # before anything is written, so the last save stays. The data is walked to name
        # the field only then, not on every save.
        try:
            text = json.dumps(data, allow_nan=False)
        except ValueError:
            bad = _find_in_json(data, lambda v: isinstance(v, float) and not math.isfinite(v))
            if bad is None:
                raise
            raise ValueError(
                f"Cannot save the checkpoint {self.path}: {bad[0]} = {bad[1]!r}, which strict "
                "JSON cannot hold (the last save is kept). Please report this as a bug."
            ) from None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text, encoding="utf8")
        os.replace(tmp, self.path)
        self.n_saves += 1

    def on_window(self, evaluator: StreamingEvaluator) -> None:
        """`StreamingEvaluator.run` hook: save once `every` batches have passed."""
        if evaluator.n_batches - self._saved_at_batch >= self.every:
            self.save(
                evaluator.state, n_examples=evaluator.n_examples, n_batches=evaluator.n_batches
            )
            self._saved_at_batch = evaluator.n_batches
