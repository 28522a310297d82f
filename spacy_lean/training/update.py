"""Out-of-memory-safe updates with token-budget gradient accumulation.

`lean_update` is `nlp.update(examples, sgd=False)` that does not die of one large
batch. When the update runs out of GPU memory (torch's or cupy's OutOfMemoryError), the
gradients and losses the failed attempt left behind are put back as they were, the
GPU caches are emptied, and the batch is updated again as micro-batches of at most half
the failed micro-batch's padded size (halves, then quarters, ...), each without an
optimizer step, so the gradients add up to the whole batch's. The caller's optimizer
then steps once, as it would have after the whole batch. The working size is kept
(per padded size of the batch, rounded up to a power of two) for later batches, and
a ceiling in padded tokens per micro-batch can be set from the start
(`UpdatePolicy.max_padded_tokens`): an effective batch far larger than fits.

Why the micro-batches add up to the whole batch (checked in spaCy 3.8 and
spacy-transformers 1.3): every trainable component that spaCy and spacy-transformers
ship computes its gradient as a sum over the batch, never divided by the batch size
(ner/parser: `get_batch_loss` is "not normalized"; tagger, morphologizer, senter,
trainable_lemmatizer: `SequenceCategoricalCrossentropy(normalize=False)`; spancat,
textcat, textcat_multilabel: `scores - truths`; tok2vec and transformer: the sum of
their listeners' gradients). So no gradient needs rescaling. The reported loss of
textcat and textcat_multilabel is a mean over the batch (`(d_scores**2).mean()`); its
micro-batch losses are weighted by their share of the batch. entity_linker's gradient is
a sum too (`CosineDistance(normalize=False)`), its loss a mean over the batch's linked
entities: its micro-batch losses are weighted by their share of those; and where the
whole batch has a linkable entity (`use_gold_ents`), a micro-batch with linked entities
but no candidate is updated as it is within the whole batch, not skipped. Every other
loss is summed.
The parser's table of unseen classes (which masks scores during an update) is restored
before each micro-batch and merged afterwards, as the whole batch would have left it.
A ner or parser skips a (micro-)batch without its annotation; where it is the last
listener of a shared tok2vec or transformer (whose backward pass that listener's
gradient triggers), a zero gradient is relayed for it, so the other listeners'
gradients of the (micro-)batch are not dropped (`nlp.update` drops them).
One gradient is not a sum over the batch in spaCy 3: the parser/ner lower layer's W
gets a term from the batch's last token for every missing context feature;
`exact_parser_gradient` (on by default) removes that term (see `parser_grad`).

Exact only with dropout 0: dropout draws random masks per call, and a parser or ner
with `use_upper = true` draws its own (a rate of 0.1 on the hidden layer, spaCy's
ParserStepModel) whatever the dropout is. The parser's oracle cut
(`update_with_oracle_cut_size`) draws a random length per call too, which matters for
docs longer than half of it.
"""

import gc
import math
import sys
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import numpy
from spacy.language import Language
from spacy.pipeline import (
    EditTreeLemmatizer,
    EntityLinker,
    Morphologizer,
    SentenceRecognizer,
    SpanCategorizer,
    SpanFinder,
    Tagger,
    TextCategorizer,
    Tok2Vec,
)
from spacy.pipeline.transition_parser import Parser
from spacy.training import Example
from thinc.api import Model

from ..memory import DEFAULT_TRIM_SETTLE, DEFAULT_TRIM_SLACK_MB, HeapTrimmer, empty_gpu_caches
from ..streaming import cuda_oom_errors
from ..trf_align import fast_alignment
from ..trf_batching import sorted_span_groups
from ._nodes import enabled_grad_scalers, pipeline_nodes
from .grad_scaling import check_mixed_precision_device, install_mixed_precision_accumulation
from .parser_grad import install_exact_parser_gradient
from .torch_step import install_flat_torch_step

# Components whose update was checked: the gradient is a sum over the batch, the loss
# value too ("sum") or a mean over its docs ("mean"). A custom component can declare
# its own with a `lean_loss_reduction` attribute ("sum" or "mean").
_CHECKED_SUM: Tuple[type, ...] = (
    Parser,
    Tagger,
    Morphologizer,
    SentenceRecognizer,
    SpanCategorizer,
    SpanFinder,
    EditTreeLemmatizer,
    Tok2Vec,
)
_CHECKED_MEAN: Tuple[type, ...] = (TextCategorizer,)


def _checked_sum() -> Tuple[type, ...]:
    """`_CHECKED_SUM` and spacy-transformers' `Transformer`. Looked up, not imported:
    a pipeline with a transformer has imported the library, and importing it here cost
    every `spacy` command 2-3 s (spaCy imports spacy-lean's CLI for each)."""
    module = sys.modules.get("spacy_transformers")
    transformer = getattr(module, "Transformer", None)
    return _CHECKED_SUM + (transformer,) if isinstance(transformer, type) else _CHECKED_SUM


class OOMSplitWarning(UserWarning):
    """A batch ran out of memory and was updated in micro-batches."""


class BatchTooLargeError(RuntimeError):
    """A single doc runs out of memory: the batch cannot be split further."""


@dataclass
class UpdatePolicy:
    """Settings, learned state and counters of `lean_update`. Keep one per training
    run and pass it to every call; `to_dict`/`from_dict` save and restore it.

    max_padded_tokens (Optional[int]): ceiling per micro-batch in padded tokens (docs x
        longest doc); None for no ceiling. A doc longer than it is updated alone.
    wordpiece_tokenizer (Optional[str]): measure lengths in this Hugging Face fast
        tokenizer's wordpieces (the transformer's `name`) instead of spaCy tokens.
    gradient_checkpointing (bool): turn on activation checkpointing in every Hugging
        Face model of the pipeline (recompute activations in the backward pass).
    exact_parser_gradient (bool): remove the batch-dependent term from the weight
        gradient of the parser/ner lower layer (see `parser_grad`), without which a
        split batch cannot give the whole batch's update for those components.
    learned_limits (Dict[int, int]): padded size of a batch, rounded up to a power of
        two -> micro-batch padded size that worked after running out of memory.
    trim_heap_slack_mb (Optional[float]): before an update, hand the host memory the
        earlier steps freed back to the OS once resident memory has crept more than
        this many MB above its working level (the highest resident memory at the 16
        updates after each trim: `spacy_lean.memory.HeapTrimmer`); 0 trims before every
        update (the lowest peak, ~20% fewer words/s on CPU), None never. Without it
        glibc keeps the freed pages and, as every batch has other tensor shapes,
        resident memory creeps up step after step (+58 MB from step 15 to 150 on a 2x64
        model, still rising), and the more distinct batch shapes, the faster: the peak
        grows with the steps and with the corpus. Measured on CPU (2x64 model,
        `benchmarks/train_memory.py`): 1x -> 16x corpus +3.0% with the default, +3.2%
        never trimming (3% more words/s), +1.8% with a 64 MB slack over the first
        update's level (2% fewer words/s).
    sort_spans (bool): run each spacy-transformers batch's spans through the model in
        length-sorted groups, each trimmed to its own longest span, in training as in
        evaluation (`spacy_lean.trf_batching.sorted_span_groups(train=True)`): less
        padding computed forward and backward; the same gradients up to float rounding,
        with the model's dropout drawn per group.
    """

    max_padded_tokens: Optional[int] = None
    wordpiece_tokenizer: Optional[str] = None
    gradient_checkpointing: bool = False
    exact_parser_gradient: bool = True
    learned_limits: Dict[int, int] = field(default_factory=dict)
    trim_heap_slack_mb: Optional[float] = DEFAULT_TRIM_SLACK_MB
    sort_spans: bool = True
    # Counters.
    batches: int = 0
    examples: int = 0
    micro_batches: int = 0
    split_batches: int = 0
    oom_errors: int = 0
    oom_splits: int = 0
    oversize_docs: int = 0
    _get_length: Optional[Callable[[Example], int]] = field(default=None, repr=False, compare=False)
    _warned: Set[str] = field(default_factory=set, repr=False, compare=False)
    _trimmer: Optional[HeapTrimmer] = field(default=None, repr=False, compare=False)
    _devices_checked: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ceiling = self.max_padded_tokens
        if ceiling is not None and (type(ceiling) is not int or ceiling < 1):
            raise ValueError(
                f"max_padded_tokens must be a positive number of padded tokens, got "
                f"{ceiling!r}. Use null (None) for no ceiling."
            )
        slack = self.trim_heap_slack_mb
        if slack is not None and (
            type(slack) not in (int, float) or not math.isfinite(slack) or slack < 0
        ):
            raise ValueError(
                f"trim_heap_slack_mb must be a finite number >= 0 (MB), got "
                f"{self.trim_heap_slack_mb!r}. Use "
                "0 to trim before every update, null (None) never to trim."
            )

    def trim_heap(self) -> bool:
        """Give freed host memory back per `trim_heap_slack_mb`. RETURNS whether it did."""
        if self.trim_heap_slack_mb is None:
            return False
        if self._trimmer is None:
            self._trimmer = HeapTrimmer(self.trim_heap_slack_mb, settle=DEFAULT_TRIM_SETTLE)
        return self._trimmer()

    @property
    def unit(self) -> str:
        return "wordpieces" if self.wordpiece_tokenizer else "tokens"

    def length(self, example: Example) -> int:
        """Length of an example's predicted doc, in the policy's unit."""
        if self._get_length is None:
            from ..corpus.lengths import get_length_function

            self._get_length = get_length_function(self.wordpiece_tokenizer)
        return self._get_length(example)

    def limit_for(self, padded: int) -> Optional[int]:
        """Micro-batch padded size to start a batch of this padded size with: the
        ceiling, lowered by what was learned for batches of this size or smaller."""
        bucket = _bucket(padded)
        limits = [v for b, v in self.learned_limits.items() if b <= bucket]
        if self.max_padded_tokens is not None:
            limits.append(self.max_padded_tokens)
        return min(limits) if limits else None

    def learn(self, padded: int, limit: int) -> bool:
        """Keep `limit` for batches of this padded size. RETURNS whether it is new."""
        bucket = _bucket(padded)
        known = self.learned_limits.get(bucket)
        if known is not None and known <= limit:
            return False
        self.learned_limits[bucket] = limit
        return True

    def stats(self) -> Dict[str, int]:
        """The counters: batches and examples updated, micro-batch updates, batches
        split (by the ceiling or after running out of memory), out-of-memory errors
        caught, batches split because of one, docs longer than the ceiling."""
        return {
            key: getattr(self, key)
            for key in (
                "batches",
                "examples",
                "micro_batches",
                "split_batches",
                "oom_errors",
                "oom_splits",
                "oversize_docs",
            )
        }

    def to_dict(self) -> Dict[str, Any]:
        """Settings, learned limits (JSON keys are strings) and counters."""
        out: Dict[str, Any] = {
            "max_padded_tokens": self.max_padded_tokens,
            "wordpiece_tokenizer": self.wordpiece_tokenizer,
            "gradient_checkpointing": self.gradient_checkpointing,
            "exact_parser_gradient": self.exact_parser_gradient,
            "trim_heap_slack_mb": self.trim_heap_slack_mb,
            "sort_spans": self.sort_spans,
            "learned_limits": {str(k): v for k, v in sorted(self.learned_limits.items())},
        }
        out.update(self.stats())
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "UpdatePolicy":
        data = dict(data)
        data["learned_limits"] = {int(k): int(v) for k, v in data.get("learned_limits", {}).items()}
        return cls(**data)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, OOMSplitWarning, stacklevel=3)


def _bucket(padded: int) -> int:
    """The padded size rounded up to a power of two."""
    return 1 << max(0, int(padded) - 1).bit_length()


def padded_size(lengths: Sequence[int]) -> int:
    """Padded size of a batch: count x longest."""
    return len(lengths) * max(lengths) if lengths else 0


def plan_micro_batches(lengths: Sequence[int], limit: Optional[int]) -> List[List[int]]:
    """Cut a batch into micro-batches of at most `limit` padded tokens.

    The docs are taken longest first, so each micro-batch holds docs of similar length;
    a doc longer than the limit is a micro-batch alone. Empty docs join the last
    micro-batch (a micro-batch of only empty docs would skip updates that the whole
    batch makes). Without a limit, or when the batch fits, the batch is one micro-batch
    in its own order.

    lengths (Sequence[int]): length of each doc.
    limit (Optional[int]): padded tokens per micro-batch.
    RETURNS (List[List[int]]): indices into `lengths`, per micro-batch.
    """
    n = len(lengths)
    if limit is None or n <= 1 or padded_size(lengths) <= limit:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -lengths[i])
    groups: List[List[int]] = []
    current: List[int] = []
    empty: List[int] = []
    for i in order:
        if lengths[i] == 0:
            empty.append(i)
            continue
        if current and (len(current) + 1) * lengths[current[0]] > limit:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    if not groups:
        return [list(range(n))]
    groups[-1].extend(empty)
    return groups


# ---------------------------------------------------------------------------------
# The state an update changes besides the parameters, saved so a failed attempt can be
# undone: gradients (thinc's and torch's) and the parser's unseen classes.

_ABSENT = "absent"
_ZERO = "zero"


def _torch_modules(nodes: Iterable[Model]) -> List[Any]:
    modules: List[Any] = []
    seen: Set[int] = set()
    for node in nodes:
        for shim in node.shims:
            module = getattr(shim, "_model", None)
            if module is not None and hasattr(module, "parameters") and id(module) not in seen:
                seen.add(id(module))
                modules.append(module)
    return modules


class _UpdateState:
    """A snapshot of the gradients and unseen-class tables of a pipeline. All-zero
    gradients (the usual state right after an optimizer step) are only marked, not
    copied. Gradients accumulated by earlier calls before a step (accumulate_gradient
    > 1) are copied to host memory, so the snapshot takes no device memory."""

    def __init__(self, nlp: Language):
        nodes = pipeline_nodes(nlp)
        self.thinc: List[Tuple[Model, str, Any]] = []
        for node in nodes:
            for name in node.param_names:
                if not node.has_grad(name):
                    self.thinc.append((node, name, _ABSENT))
                    continue
                grad = node.get_grad(name)
                saved = numpy.array(node.ops.to_numpy(grad), copy=True) if grad.any() else _ZERO
                self.thinc.append((node, name, saved))
        params = []
        seen: Set[int] = set()
        for module in _torch_modules(nodes):
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
        with_grad = [p for p in params if p.grad is not None]
        nonzero: List[bool] = []
        if with_grad:
            import torch

            nonzero = torch.stack([p.grad.any() for p in with_grad]).tolist()
        flags = dict(zip(map(id, with_grad), nonzero))
        self.torch: List[Tuple[Any, Any]] = []
        for p in params:
            if p.grad is None:
                self.torch.append((p, _ABSENT))
            else:
                saved = p.grad.detach().to("cpu", copy=True) if flags[id(p)] else _ZERO
                self.torch.append((p, saved))
        # Mixed precision: whether each grad scaler had found an overflow before this
        # update (a failed attempt's overflow must not skip the retried step).
        self.scalers = [(s, s._found_inf) for s in enabled_grad_scalers(nodes)]
        # Listeners keep the last batch's upstream outputs and backprop callback (the
        # whole failed batch's activations) until the next batch arrives.
        self.listeners = [n for n in nodes if hasattr(n, "receive") and hasattr(n, "_backprop")]
        # spacy-curated-transformers' listeners keep the same in attrs["_state"].
        self.listener_states = [s for s in map(_curated_listener_state, nodes) if s is not None]
        self.unseen: List[Tuple[Set[int], frozenset]] = [
            (node.attrs["unseen_classes"], frozenset(node.attrs["unseen_classes"]))
            for node in nodes
            if isinstance(node.attrs.get("unseen_classes"), set)
        ]

    def restore_unseen(self) -> None:
        for table, saved in self.unseen:
            table.clear()
            table.update(saved)

    def read_unseen(self) -> List[frozenset]:
        return [frozenset(table) for table, _ in self.unseen]

    def merge_unseen(self, after: List[List[frozenset]]) -> None:
        """Leave each table as the whole batch would have: a class stays unseen only
        if no micro-batch saw it. (A label new to the pipeline grows its parser before
        the snapshot, see `_add_new_labels`, so its classes are in the saved table.)"""
        for k, (table, saved) in enumerate(self.unseen):
            merged = set(saved)
            for tables in after:
                merged &= tables[k]
            table.clear()
            table.update(merged)

    def release_listeners(self) -> None:
        for listener in self.listeners:
            listener._batch_id = None
            listener._outputs = None
            listener._backprop = None
        for state in self.listener_states:
            state.batch_id = state.outputs = state.backprop = None

    def restore(self) -> None:
        """Put every gradient back as it was at the snapshot."""
        for node, name, saved in self.thinc:
            if saved is _ABSENT:
                node._params._grads.pop((node.id, name), None)
            elif not node.has_grad(name):
                shape = node.get_param(name).shape
                zeros = saved is _ZERO
                node.set_grad(name, node.ops.alloc(shape) if zeros else node.ops.xp.array(saved))
            elif saved is _ZERO:
                node.get_grad(name).fill(0)
            else:
                node.get_grad(name)[...] = node.ops.asarray(saved)
        for param, saved in self.torch:
            if saved is _ABSENT:
                param.grad = None
            elif param.grad is None:
                param.grad = param.detach().new_zeros(param.shape)
                if saved is not _ZERO:
                    param.grad.copy_(saved)
            elif saved is _ZERO:
                param.grad.zero_()
            else:
                param.grad.copy_(saved)
        for scaler, found_inf in self.scalers:
            scaler._found_inf = found_inf
        self.restore_unseen()


# ---------------------------------------------------------------------------------


def loss_reduction(proc: Any) -> Optional[str]:
    """How a component reduces its loss over a batch's docs: "sum", "mean", or None
    where spacy-lean has not checked it (and the component declares nothing)."""
    declared = getattr(proc, "lean_loss_reduction", None)
    if declared in ("sum", "mean"):
        return declared
    if isinstance(proc, Parser) and _beam_width(proc) > 1:
        return None  # beam search: see _loss_weights
    if isinstance(proc, _CHECKED_MEAN):
        return "mean"
    if isinstance(proc, EntityLinker):
        return "entities"  # a mean over the linked entities: see linked_entities
    if isinstance(proc, _checked_sum()):
        return "sum"
    return None


def linked_entities(proc: EntityLinker, examples: Sequence[Example]) -> int:
    """How many entities an entity_linker's loss of these examples is a mean over, as
    its `get_loss` counts them: predicted entities (gold ones with `use_gold_ents`)
    that match a gold entity with a KB id."""
    n = 0
    for eg in proc._ensure_ents(examples):
        kb_ids = eg.get_aligned("ENT_KB_ID", as_string=True)
        n += sum(1 for ent in eg.get_matching_ents() if kb_ids[ent.start])
    return n


def loss_denominator(
    nlp: Language, name: str, reduction: str, examples: Sequence[Example]
) -> float:
    """What component `name`'s loss of these (updated) examples is a mean over, for
    `reduction` "mean" (its docs) or "entities" (an entity_linker's linked entities,
    as its loss counted them): a part's loss weighs by its share of the whole's."""
    if reduction == "entities":
        return float(linked_entities(nlp.get_pipe(name), examples))
    return float(len(examples))


def linker_learns(proc: Any, examples: Sequence[Example]) -> bool:
    """Whether an entity_linker with `use_gold_ents` learns from these examples (some
    gold entity has a KB candidate): known before the update. False for any other
    component, and for a linker whose entities come from annotating components."""
    if not isinstance(proc, EntityLinker) or not proc.use_gold_ents or not examples:
        return False
    return bool(proc.batch_has_learnable_example(proc._ensure_ents(examples)))


@contextmanager
def linkers_learn_linked_entities(linkers: Iterable[EntityLinker]) -> Iterator[None]:
    """An entity_linker skips a batch with no entity that has a KB candidate, but a
    batch that has one learns from every linked entity in it, candidates or not. So a
    micro-batch (or a rank's share) of the latter kind whose entities have none (a KB
    id whose entity text is no alias) was skipped, where the whole batch learned from
    it. Within this context, these linkers (those that `linker_learns` from the whole
    batch) learn from a micro-batch with a linked entity, as the whole batch does."""
    patched = []
    for proc in linkers:
        own = proc.batch_has_learnable_example

        def learnable(batch: Sequence[Example], own: Callable = own, proc=proc) -> bool:
            return own(batch) or linked_entities(proc, batch) > 0

        patched.append((proc, "batch_has_learnable_example" in vars(proc), own))
        proc.batch_has_learnable_example = learnable
    try:
        yield
    finally:
        for proc, was_set, own in reversed(patched):
            if was_set:
                proc.batch_has_learnable_example = own
            else:
                del proc.batch_has_learnable_example


def _loss_weights(nlp: Language, policy: UpdatePolicy, exclude: Iterable[str]) -> Dict[str, str]:
    """How each updated component reduces its loss: "sum", "mean" (over docs) or
    "entities" (entity_linker: a mean over linked entities)."""
    reductions: Dict[str, str] = {}
    excluded = set(exclude)
    for name, proc in nlp.pipeline:
        if name in excluded or not hasattr(proc, "update"):
            continue
        reduction = loss_reduction(proc)
        if reduction is not None:
            reductions[name] = reduction
        elif isinstance(proc, Parser) and _beam_width(proc) > 1:
            reductions[name] = "sum"
            policy.warn_once(
                f"beam:{name}",
                f"Splitting a batch for component '{name}', a parser with beam_width = "
                f"{_beam_width(proc)}: each micro-batch draws its own beam_update_prob "
                "(beam or greedy update) and its beam loss is a mean over the step's "
                "states, so the micro-batches' update is not the whole batch's (the same "
                "only with beam_update_prob 0). Raise max_padded_tokens to split less.",
            )
        else:
            reductions[name] = "sum"
            factory = nlp.get_pipe_meta(name).factory
            policy.warn_once(
                f"unchecked:{name}",
                f"Splitting a batch for component '{name}' (factory '{factory}'), whose loss "
                "normalisation spacy-lean has not checked: the micro-batches' gradients are "
                "summed, which equals the whole batch's update only if its gradient is a sum "
                "over the batch's docs (not normalised by the batch's size). If it is, set "
                '`lean_loss_reduction = "sum"` on the component (or "mean" where its loss '
                "value, not its gradient, is averaged over docs) to declare it.",
            )
    return reductions


def _relays_zeros(proc: Any) -> bool:
    """Whether a component's skipped update can be relayed with a zero gradient:
    spaCy's and spacy-transformers' own components skip an update (a ner or parser
    without gold, a spancat with no suggested span, an entity_linker with no
    entity) by returning before they backpropagate, and never call the listener's
    callback after `update` returns, so a zero gradient is exactly "nothing from this
    component". A component of another package may keep the callback for later."""
    module = type(proc).__module__ or ""
    return isinstance(proc, Parser) or module.startswith(("spacy.", "spacy_transformers."))


class _ListenerRelay:
    """Keep the shared backward pass: spaCy's tok2vec and spacy-transformers run it
    when their *last* listener backpropagates. A component skips an update with
    nothing to learn from (a ner without gold, a spancat with no suggested span), so
    where it is that last listener, a (micro-)batch it skips would drop the other
    listeners' gradients. The relay watches each such listener's callback and, when an
    update did not call it, calls it with a zero gradient, which runs the producer's
    backward pass on what the other listeners accumulated.

    So a micro-batch, or a rank's share of a data-parallel batch, that the last
    listener skips keeps the other listeners' gradients, as the whole batch does. A
    whole batch it skips keeps them too, where `nlp.update` drops them. Components of
    other packages (`_relays_zeros`) and the listeners of spacy-curated-transformers
    are not relayed: an update where one of them skipped warns once."""

    def __init__(self, nlp: Language, policy: UpdatePolicy, exclude: Iterable[str]):
        self.policy = policy
        self._nlp = nlp
        # (producer name, listener, owner name, relay zeros?)
        self.watched: List[Tuple[str, Model, str, bool]] = []
        excluded = set(exclude)
        for producer_name, producer in nlp.pipeline:
            listener_map = getattr(producer, "listener_map", None)
            listeners = getattr(producer, "listeners", None)
            if not isinstance(listener_map, dict) or not listeners or len(listeners) < 2:
                continue
            if producer_name in excluded:
                continue
            last = listeners[-1]
            owner = next((n for n, ms in listener_map.items() if any(m is last for m in ms)), None)
            if owner is None or owner in excluded or owner not in nlp.pipe_names:
                continue
            relay = _relays_zeros(nlp.get_pipe(owner))
            self.watched.append((producer_name, last, owner, relay))
        self.called: Dict[str, List[bool]] = {owner: [] for _, _, owner, _ in self.watched}

    def update(self, update: Callable[[], Any]) -> None:
        """Run one micro-batch's update, relaying where the last listener skipped."""
        records: List[Dict[str, Any]] = []
        for _, listener, _, _ in self.watched:
            record: Dict[str, Any] = {}
            records.append(record)
            state = _curated_listener_state(listener)
            if state is not None:
                # spacy-curated-transformers: its transformer calls a class method to
                # hand the outputs over, and the listener clears its state when it
                # backpropagates. Not relayed (its backward pass takes per-layer
                # gradients): a callback still held after the update was skipped.
                state.batch_id = state.outputs = state.backprop = None
                record["curated"] = state
                continue
            try:
                listener.receive = _watching_receive(listener, record)
            except AttributeError:  # a listener class with __slots__: not watched
                pass
        try:
            update()
            # Downstream producers first: a producer that listens to another (a stacked
            # tok2vec) passes its relayed backward pass on to the one upstream, whose
            # callback is then called and must not be relayed again (its backward pass
            # would run twice, counting the other listeners' gradients twice).
            for (producer_name, listener, owner, relay), record in reversed(
                list(zip(self.watched, records))
            ):
                curated = record.get("curated")
                if curated is not None:
                    if curated.backprop is not None and not self._frozen(producer_name):
                        self.called[owner].append(None)  # type: ignore[arg-type]
                        curated.batch_id = curated.outputs = curated.backprop = None
                    continue
                if "backprop" not in record:  # the producer did not run (frozen, no docs)
                    continue
                self.called[owner].append(record["called"])
                if record["called"] or not relay:
                    continue
                zeros = _zero_gradient(record["outputs"], listener.ops.xp)
                if zeros is None:
                    self.called[owner][-1] = None  # type: ignore[call-overload]
                    continue
                if all(hasattr(z, "shape") and not z.shape[0] for z in zeros):
                    # Only empty docs (or none): nothing to pass back, as in `nlp.update`.
                    # tok2vec's gradient is then arrays of no rows, on which its backward
                    # pass fails (thinc's maxout); spacy-transformers' is an empty list.
                    continue
                record["backprop"](zeros)
                # As spacy-transformers' listener does after its backprop: let go of
                # the micro-batch's outputs and callback.
                if hasattr(listener, "backprop_and_clear"):
                    listener._batch_id = listener._outputs = listener._backprop = None
        finally:
            for (_, listener, _, _), record in zip(self.watched, records):
                getattr(listener, "__dict__", {}).pop("receive", None)
                record.clear()

    def _frozen(self, producer_name: str) -> bool:
        return bool(getattr(self._nlp.get_pipe(producer_name), "frozen", False))

    def finish(self) -> None:
        """Warn where an update's gradients were dropped: a (micro-)batch that a last
        listener not relayed skipped (in a data-parallel run, one rank's share may be
        all it sees), or a gradient that could not be relayed."""
        for producer_name, _, owner, relay in self.watched:
            called = self.called[owner]
            dropped = any(c is None for c in called) or (not relay and not all(called))
            if dropped:
                self.policy.warn_once(
                    f"skipped-listener:{owner}",
                    f"'{owner}', the last listener of '{producer_name}', skipped the "
                    "update of some (micro-)batches (nothing in them to learn from), or its "
                    f"gradient could not be relayed: '{producer_name}' runs its backward "
                    "pass when that listener's gradient arrives, so the other listeners' "
                    "gradients of those batches are dropped. Put "
                    f"'{owner}' before the other components listening to "
                    f"'{producer_name}' in the pipeline.",
                )


def _curated_listener_state(node: Model) -> Optional[Any]:
    """The state spacy-curated-transformers keeps in a listener's `attrs["_state"]` (the
    batch id, the upstream outputs and the backprop callback, which spacy-transformers'
    listener keeps as attributes); None for other nodes."""
    state = node.attrs.get("_state")
    if all(hasattr(state, name) for name in ("batch_id", "outputs", "backprop")):
        return state
    return None


def _watching_receive(listener: Model, record: Dict[str, Any]) -> Callable[..., None]:
    receive = type(listener).receive

    def watching_receive(batch_id: int, outputs: Any, backprop: Callable) -> None:
        def watched_backprop(*args: Any, **kwargs: Any) -> Any:
            record["called"] = True
            return backprop(*args, **kwargs)

        record.update(outputs=outputs, backprop=watched_backprop, called=False)
        receive(listener, batch_id, outputs, watched_backprop)

    return watching_receive


def _zero_gradient(outputs: Any, xp: Any) -> Optional[List[Any]]:
    """A zero gradient for a listener's outputs, shaped as its component's backward
    pass gives it: an array per doc (tok2vec), or per non-empty doc a TransformerData
    holding only `last_hidden_state` (spacy-transformers' pooling). None if unknown."""
    zeros: List[Any] = []
    for out in outputs:
        if hasattr(out, "shape"):
            zeros.append(xp.zeros_like(out))
            continue
        model_output = getattr(out, "model_output", None)
        if model_output is None or not hasattr(out, "align"):
            return None
        hidden = getattr(model_output, "last_hidden_state", None)
        if hidden is None:
            # An empty doc has no outputs: spacy-transformers' pooling leaves its
            # gradient out of the list, and so does this.
            continue
        grad = type(model_output)(last_hidden_state=xp.zeros_like(hidden))
        zeros.append(type(out)(wordpieces=out.wordpieces, model_output=grad, align=out.align))
    return zeros


def _add_new_labels(nlp: Language, examples: List[Example], exclude: Iterable[str]) -> None:
    """Add the labels of `examples` that the parsers and ners of the pipeline do not
    have yet, as their update would (spaCy's `_ensure_labels_are_added`)."""
    excluded = set(exclude)
    docs = None
    for name, proc in nlp.pipeline:
        ensure = getattr(proc, "_ensure_labels_are_added", None)
        if name in excluded or not isinstance(proc, Parser) or not callable(ensure):
            continue
        if docs is None:
            docs = [eg.x for eg in examples] + [eg.y for eg in examples]
        ensure(docs)


def _beam_width(proc: Any) -> int:
    width = getattr(proc, "cfg", {}).get("beam_width", 1)
    return width if isinstance(width, int) else 1


def enable_gradient_checkpointing(nlp: Language) -> int:
    """Turn on activation checkpointing in every Hugging Face model of the pipeline
    that supports it (`gradient_checkpointing_enable`, non-reentrant). A transformer
    loads its Hugging Face model in `initialize`, so call this afterwards (the
    `lean_update` policy setting does it at the first update). Only training is
    affected: Hugging Face models skip checkpointing in eval mode.

    nlp (Language): the pipeline.
    RETURNS (int): how many models have it on.
    """
    count = 0
    for module in _torch_modules(pipeline_nodes(nlp)):
        if not getattr(module, "supports_gradient_checkpointing", False):
            continue
        if not getattr(module, "is_gradient_checkpointing", False):
            kwargs = {"use_reentrant": False}
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        count += 1
    return count


def lean_update(
    nlp: Language,
    examples: Iterable[Example],
    *,
    drop: float = 0.0,
    losses: Optional[Dict[str, float]] = None,
    exclude: Iterable[str] = (),
    annotates: Iterable[str] = (),
    component_cfg: Optional[Dict[str, Dict[str, Any]]] = None,
    policy: Optional[UpdatePolicy] = None,
) -> Dict[str, float]:
    """Like `nlp.update(examples, sgd=False, ...)`: accumulate the batch's gradients
    on the models, never step the optimizer, and survive running out of GPU memory.

    The batch is cut into micro-batches within the policy's padded-token limit (none by
    default: one call, `nlp.update`, except that a ner or parser without annotation in
    the batch that is the last listener of a shared tok2vec or transformer does not
    drop the other listeners' gradients). When an update runs out of memory, what
    the failed attempt accumulated is undone and the batch is updated again in
    micro-batches of half the failed one's padded size, until it fits.

    nlp (Language): the pipeline.
    examples (Iterable[Example]): the batch.
    drop (float): dropout rate (use 0 where a split must give the exact same update).
    losses (Optional[Dict[str, float]]): updated with the whole batch's losses.
    exclude (Iterable[str]): components not to update.
    annotates (Iterable[str]): components that set annotations during the update.
    component_cfg (Optional[dict]): extra keyword arguments per component.
    policy (Optional[UpdatePolicy]): settings, learned limits and counters; keep one
        per training run. None: a fresh default policy.
    RETURNS (Dict[str, float]): the losses.
    RAISES BatchTooLargeError: one doc alone runs out of memory.
    """
    examples = list(examples)
    if losses is None:
        losses = {}
    if policy is None:
        policy = UpdatePolicy()
    # The previous step's tensors are freed by now (its optimizer step included).
    policy.trim_heap()
    exclude = list(exclude)
    annotates = list(annotates)
    if policy.gradient_checkpointing and enable_gradient_checkpointing(nlp) == 0:
        curated = [
            name
            for name, proc in nlp.pipeline
            if (type(proc).__module__ or "").startswith("spacy_curated_transformers.")
        ]
        why = (
            f"{curated} are spacy-curated-transformers components, whose models are not "
            "Hugging Face models"
            if curated
            else "or none is loaded yet"
        )
        policy.warn_once(
            "checkpointing",
            "gradient_checkpointing is on but no Hugging Face model in the pipeline "
            f"supports it ({why}); training without it.",
        )
    # A parser or ner meeting a label it was not initialized with grows its output
    # layer at the start of its update: grown here, for the whole batch, it grows once
    # before any micro-batch (and before a failed attempt), as in the whole batch.
    _add_new_labels(nlp, examples, exclude)
    if policy.exact_parser_gradient:
        install_exact_parser_gradient(nlp)  # again after a growth: a new layer
    # Mixed precision: the torch models' gradients of several backward passes (span
    # groups, micro-batches, accumulate_gradient) add up, as without it.
    install_mixed_precision_accumulation(nlp)
    install_flat_torch_step()  # thinc's optimizer step of torch models grows a chain
    if not policy._devices_checked:
        check_mixed_precision_device(nlp, exclude)
        policy._devices_checked = True
    if not examples:
        return losses
    lengths = [policy.length(eg) for eg in examples]
    padded = padded_size(lengths)
    limit = policy.limit_for(padded)
    oom_errors = cuda_oom_errors()
    state = _UpdateState(nlp)

    saved_losses = dict(losses)
    retried = False
    while True:
        groups = plan_micro_batches(lengths, limit)
        failed: Optional[List[int]] = None
        progress: Dict[str, List[int]] = {}
        try:
            spans = sorted_span_groups(nlp, train=True) if policy.sort_spans else nullcontext()
            with fast_alignment(), spans:
                _update_groups(
                    nlp,
                    examples,
                    groups,
                    state,
                    losses,
                    policy,
                    progress,
                    drop=drop,
                    exclude=exclude,
                    annotates=annotates,
                    component_cfg=component_cfg,
                )
        except oom_errors as err:
            # Empty docs ride along with the last micro-batch: they cannot be the cause.
            failed = [i for i in progress["group"] if lengths[i] > 0] or progress["group"]
            policy.oom_errors += 1
            if lengths[failed[0]] == 0:  # only empty docs: nothing of theirs to split
                _undo(state, losses, saved_losses)
                raise BatchTooLargeError(
                    f"Out of memory updating {len(failed)} empty doc(s) (no {policy.unit}) of "
                    f"a batch of {len(examples)}: what ran out is not the batch's own memory "
                    "but what was left beside it (the model, its optimizer state, other "
                    "processes on the GPU). Use less memory per step (mixed precision, a "
                    "smaller model) or free the GPU."
                ) from err
            if len(failed) == 1:
                _undo(state, losses, saved_losses)
                i = failed[0]
                text = examples[i].predicted.text
                unit = policy.unit if lengths[i] != 1 else policy.unit.rstrip("s")
                raise BatchTooLargeError(
                    f"Out of memory updating on one doc alone: doc {i} of a batch of "
                    f"{len(examples)}, {lengths[i]} {unit} long (starts "
                    f"{text[:60]!r}). It cannot be split further. Split long docs before "
                    "training: spacy-lean.Corpus.v1's max_length does it without losing "
                    "annotation (e.g. --corpora.train.max_length 128); or use less memory "
                    "per doc (gradient_checkpointing, a shorter transformer window, mixed "
                    "precision)."
                ) from err
        if failed is None:
            break
        # Outside the except block, so the failed attempt's frames are gone.
        _undo(state, losses, saved_losses)
        failed_padded = padded_size([lengths[i] for i in failed])
        limit = max(1, failed_padded // 2)
        retried = True
    n_micro = len(groups)
    policy.batches += 1
    policy.examples += len(examples)
    policy.micro_batches += n_micro
    if n_micro > 1:
        policy.split_batches += 1
    if policy.max_padded_tokens is not None:
        oversize = [n for n in lengths if n > policy.max_padded_tokens]
        policy.oversize_docs += len(oversize)
        if oversize:
            policy.warn_once(
                "oversize",
                f"A doc of {max(oversize):,} {policy.unit} is longer than max_padded_tokens = "
                f"{policy.max_padded_tokens:,}: it is updated alone, in a micro-batch of its own "
                "size (never cut or dropped), so the ceiling does not bound its memory. Such "
                "docs are counted in the update policy's oversize_docs; cut long docs with the "
                "reader's max_length, or raise max_padded_tokens.",
            )
    if retried:
        policy.oom_splits += 1
        if policy.learn(padded, limit):
            largest = max(padded_size([lengths[i] for i in group]) for group in groups)
            alone = f" (a doc longer than that alone: {largest:,})" if largest > limit else ""
            policy.warn_once(
                f"learned:{_bucket(padded)}:{limit}",
                f"Out of memory on a batch of {len(examples)} docs ({padded:,} padded "
                f"{policy.unit}, longest {max(lengths)}): updated it in {n_micro} "
                f"micro-batches of at most {limit:,} padded {policy.unit}{alone} with the "
                "gradients accumulated (the same update). Batches of more than "
                f"{_bucket(padded) // 2:,} padded {policy.unit} are split this way from now "
                "on. Set max_padded_tokens to split before running out.",
            )
    for key, value in losses.items():  # numpy scalars (ner's loss) to floats
        losses[key] = float(value)
    return losses


def _undo(state: _UpdateState, losses: Dict[str, float], saved_losses: Dict[str, float]) -> None:
    """Undo a failed attempt and free what it held, so the retry has the memory."""
    state.release_listeners()
    state.restore()
    losses.clear()
    losses.update(saved_losses)
    # A full collection can take a second in a large process: only where the memory
    # is a device's (whose allocator caches are emptied next).
    torch = sys.modules.get("torch")
    on_gpu = "cupy" in sys.modules or (torch is not None and torch.cuda.is_initialized())
    gc.collect(2 if on_gpu else 1)
    empty_gpu_caches()


def _update_groups(
    nlp: Language,
    examples: List[Example],
    groups: List[List[int]],
    state: _UpdateState,
    losses: Dict[str, float],
    policy: UpdatePolicy,
    progress: Dict[str, List[int]],
    **kwargs: Any,
) -> None:
    """Update on each micro-batch, adding the losses up as the whole batch would.
    `progress["group"]` names the micro-batch being updated."""
    # The class's update: `nlp.update` may be this module's, installed on the instance.
    update = type(nlp).update
    relay = _ListenerRelay(nlp, policy, kwargs["exclude"])
    if len(groups) == 1:
        progress["group"] = groups[0]
        relay.update(lambda: update(nlp, examples, sgd=False, losses=losses, **kwargs))
        relay.finish()
        return
    reductions = _loss_weights(nlp, policy, kwargs["exclude"])
    means = {name: how for name, how in reductions.items() if how in ("mean", "entities")}
    unseen_after = []
    parts: List[Tuple[Dict[str, float], Dict[str, float]]] = []
    learners = [
        nlp.get_pipe(name)
        for name, how in means.items()
        if how == "entities" and linker_learns(nlp.get_pipe(name), examples)
    ]
    with linkers_learn_linked_entities(learners):
        for group in groups:
            part_losses: Dict[str, float] = {}
            state.restore_unseen()
            progress["group"] = group
            part = [examples[i] for i in group]
            relay.update(lambda: update(nlp, part, sgd=False, losses=part_losses, **kwargs))
            unseen_after.append(state.read_unseen())
            # After the update: the entities the linker saw (annotating components').
            over = {name: loss_denominator(nlp, name, how, part) for name, how in means.items()}
            parts.append((part_losses, over))
    totals = {name: sum(over[name] for _, over in parts) for name in means}
    for part_losses, over in parts:
        for key, value in part_losses.items():
            weight = over[key] / totals[key] if key in means and totals[key] else 1.0
            losses[key] = losses.get(key, 0.0) + weight * value
    state.merge_unseen(unseen_after)
    relay.finish()
