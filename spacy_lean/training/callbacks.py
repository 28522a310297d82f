"""spaCy integration: make `nlp.update` out-of-memory-safe on an instance, so stock
`spacy train config.cfg` trains with `lean_update` (an `[nlp.after_pipeline_creation]`
callback, like the streaming evaluation's)."""

import functools
import inspect
from typing import Any, Callable, Dict, Iterable, Optional

from spacy.language import Language
from spacy.training import Example
from spacy.util import registry
from thinc.api import Optimizer

from ..memory import DEFAULT_TRIM_SLACK_MB
from ..streaming import (
    check_max_batch_tokens,
    check_trim_slack_mb,
    check_window_size,
    install_streaming_evaluate,
)
from ..corpus.lengths import get_length_function
from .update import UpdatePolicy, lean_update

CALLBACK_NAME = "spacy-lean.lean_training.v1"


def install_lean_update(nlp: Language, policy: Optional[UpdatePolicy] = None) -> Language:
    """Replace `nlp.update` on this instance by `lean_update` with one policy (see
    `get_update_policy`). With `sgd=False` (as spaCy's training loop calls it) the
    gradients are only accumulated; with an optimizer (or None, spaCy's default one)
    every updated component steps after the whole batch, as in spaCy's training loop.
    (`Language.update` steps each component right after its own update, so a
    transformer or tok2vec steps before its listeners' gradients arrive and applies
    them one call later.)

    nlp (Language): the pipeline; modified in place.
    policy (Optional[UpdatePolicy]): settings and state; None for the defaults.
    RETURNS (Language): the same pipeline.
    """
    if policy is None:
        policy = UpdatePolicy()
    # A partial of a module-level function, not a method bound to a local function, so
    # the pipeline still pickles (`nlp.pipe(n_process=2)` where processes are spawned).
    method = functools.partial(_lean_training_update, nlp, policy=policy)
    method.__doc__ = lean_update.__doc__
    nlp.update = method  # type: ignore[method-assign]
    return nlp


def _lean_training_update(
    self: Language,
    examples: Iterable[Example],
    _: Optional[Any] = None,
    *,
    drop: float = 0.0,
    sgd: Optional[Optimizer] = None,
    losses: Optional[Dict[str, float]] = None,
    component_cfg: Optional[Dict[str, Dict[str, Any]]] = None,
    exclude: Iterable[str] = (),
    annotates: Iterable[str] = (),
    policy: UpdatePolicy,
) -> Dict[str, float]:
    """`nlp.update` of a pipeline given `lean_update` by `install_lean_update`."""
    if _ is not None:  # the same guard as Language.update
        return Language.update(self, examples, _, drop=drop, sgd=sgd, losses=losses)
    exclude = list(exclude)
    losses = lean_update(
        self,
        examples,
        drop=drop,
        losses=losses,
        exclude=exclude,
        annotates=annotates,
        component_cfg=component_cfg,
        policy=policy,
    )
    if sgd is not False:
        if sgd is None:
            if self._optimizer is None:
                self._optimizer = self.create_optimizer()
            sgd = self._optimizer
        for name, proc in self.pipeline:
            if (
                name not in exclude
                and getattr(proc, "is_trainable", False)
                and getattr(proc, "model", None) not in (True, False, None)
            ):
                proc.finish_update(sgd)
    return losses


def get_update_policy(nlp: Language) -> Optional[UpdatePolicy]:
    """The policy of an `nlp.update` installed by `install_lean_update`, else None."""
    method = nlp.__dict__.get("update")
    if isinstance(method, functools.partial) and method.func is _lean_training_update:
        return method.keywords["policy"]
    return None


@registry.callbacks(CALLBACK_NAME)
def make_lean_training_v1(
    max_padded_tokens: Optional[int] = None,
    wordpiece_tokenizer: Optional[str] = None,
    gradient_checkpointing: bool = False,
    streaming_evaluate: bool = True,
    eval_window_size: Optional[int] = None,
    eval_max_batch_tokens: Optional[int] = None,
    eval_trim_slack_mb: Optional[float] = 0.0,
    eval_memory_zones: bool = True,
    exact_parser_gradient: bool = True,
    trim_heap_slack_mb: Optional[float] = DEFAULT_TRIM_SLACK_MB,
    sort_spans: bool = True,
) -> Callable[[Language], Language]:
    """An `[nlp.after_pipeline_creation]` callback for `spacy train`: batches that
    run out of GPU memory are updated in micro-batches (the same update), an optional
    ceiling in padded tokens per micro-batch, optional activation checkpointing of the
    Hugging Face models, and (by default) the streaming dev evaluation of
    `spacy-lean.streaming_evaluate.v1`, since both need this one config slot.

    A pipeline saved with it names it in its config and needs spacy-lean to load; add
    `spacy-lean.strip_streaming_evaluate.v1` as `[training.before_to_disk]` to save
    pipelines that load without spacy-lean.

    max_padded_tokens (Optional[int]): ceiling per micro-batch, docs x longest doc
        (in spaCy tokens, or wordpieces with `wordpiece_tokenizer`); null for none.
    wordpiece_tokenizer (Optional[str]): measure lengths in this tokenizer's wordpieces.
    gradient_checkpointing (bool): recompute the transformer's activations in the
        backward pass instead of keeping them.
    streaming_evaluate (bool): also make `nlp.evaluate` streaming.
    eval_window_size (Optional[int]): its read-ahead window (see `spacy_lean.evaluate`).
    eval_max_batch_tokens (Optional[int]): its padded tokens per batch, the memory
        budget (see `spacy_lean.evaluate`); null for the transformer's
        `max_batch_items`, else 4096.
    eval_trim_slack_mb (Optional[float]): its heap trimming: after every batch (0), only
        past this many MB above the working level, or never (null); see
        `spacy_lean.evaluate` (`trim_slack_mb`).
    eval_memory_zones (bool): read a `spacy-lean.Corpus.v1` dev set in spaCy memory
        zones, so the vocab does not grow with its distinct words (see
        `spacy_lean.zones`).
    exact_parser_gradient (bool): drop the batch-dependent term spaCy 3.8's ner/parser
        lower layer adds to its weight gradient, so split batches give the same update.
    trim_heap_slack_mb (Optional[float]): before an update, give the host memory the
        earlier steps freed back to the OS once resident memory has crept more than this
        many MB above its working level (0: before every update; null: never). See
        `UpdatePolicy`.
    sort_spans (bool): run the transformer's spans in length-sorted groups in
        training (less padding computed; the same gradients up to float rounding).
    RETURNS (Callable[[Language], Language]): the callback.
    """
    # Validate the settings when the config is resolved, not at the first batch.
    if not isinstance(eval_memory_zones, bool):
        raise ValueError(
            f"{CALLBACK_NAME}: eval_memory_zones must be true or false, got "
            f"{eval_memory_zones!r}."
        )
    try:
        UpdatePolicy(max_padded_tokens=max_padded_tokens, trim_heap_slack_mb=trim_heap_slack_mb)
    except ValueError as err:
        raise ValueError(f"{CALLBACK_NAME}: {err}") from None
    # The streaming evaluator's checks, their messages naming this callback's settings.
    for name, value, check in (
        ("max_batch_tokens", eval_max_batch_tokens, check_max_batch_tokens),
        ("window_size", eval_window_size, check_window_size),
        ("trim_slack_mb", eval_trim_slack_mb, check_trim_slack_mb),
    ):
        if value is None and name != "trim_slack_mb":
            continue
        try:
            check(value)
        except ValueError as err:
            message = str(err).replace(name, f"eval_{name}", 1)
            raise ValueError(f"{CALLBACK_NAME}: {message}") from None
    # A tokenizer that does not load fails here, not at the first update.
    get_length = get_length_function(wordpiece_tokenizer) if wordpiece_tokenizer else None
    given = {
        "eval_window_size": eval_window_size,
        "eval_max_batch_tokens": eval_max_batch_tokens,
        "eval_trim_slack_mb": eval_trim_slack_mb,
        "eval_memory_zones": eval_memory_zones,
    }
    defaults = inspect.signature(make_lean_training_v1).parameters
    ignored = [name for name, value in given.items() if value != defaults[name].default]
    if not streaming_evaluate and ignored:
        raise ValueError(
            f"{CALLBACK_NAME}: {', '.join(ignored)} set the streaming evaluation's settings, "
            "but streaming_evaluate = false installs none (nlp.evaluate stays spaCy's, and "
            "`spacy lean train` evaluates with the defaults). Set streaming_evaluate = true, "
            "or remove them."
        )

    def after_pipeline_creation(nlp: Language) -> Language:
        policy = UpdatePolicy(
            max_padded_tokens=max_padded_tokens,
            wordpiece_tokenizer=wordpiece_tokenizer,
            gradient_checkpointing=gradient_checkpointing,
            exact_parser_gradient=exact_parser_gradient,
            trim_heap_slack_mb=trim_heap_slack_mb,
            sort_spans=sort_spans,
        )
        policy._get_length = get_length
        install_lean_update(nlp, policy)
        if streaming_evaluate:
            install_streaming_evaluate(
                nlp,
                window_size=eval_window_size,
                max_batch_tokens=eval_max_batch_tokens,
                trim_slack_mb=eval_trim_slack_mb,
                memory_zones=eval_memory_zones,
            )
        return nlp

    return after_pipeline_creation
