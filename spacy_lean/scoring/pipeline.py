"""Score state of a whole pipeline: the mergeable twin of `Scorer(nlp).score`
plus `speed`, i.e. of what `nlp.evaluate` returns."""

import base64
import hashlib
import warnings
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy
import srsly
from spacy.language import Language
from spacy.pipeline import Pipe
from spacy.tokenizer import Tokenizer
from spacy.tokens import Doc, DocBin
from spacy.training import Example

from .._warn import caller_stacklevel
from .base import (
    ScoreState,
    StateFieldError,
    callable_name,
    count_from_json,
    describe_value,
    float_from_json,
    float_to_json,
)
from .twins import find_twin, make_tokenization_twin, unwrap_scorer

# Keys of `scorer_cfg` that `Scorer.__init__` takes itself (not passed to scorers).
_SCORER_INIT_KEYS = ("nlp", "default_lang", "default_pipeline")
# `Doc.user_data` keys of transformer outputs (spacy-transformers and
# spacy-curated-transformers both use the `trf_data` extension).
_HEAVY_EXTENSIONS = ("trf_data",)

STATE_FORMAT_VERSION = 1


class EmptyState(ScoreState):
    """A component with a `score` method but no scorer: it scores `{}`."""

    kind = "empty"

    def __init__(self, **cfg) -> None:
        pass

    def update(self, examples: Iterable[Example]) -> None:
        pass

    def _merge(self, other: "EmptyState") -> None:
        pass

    def result(self) -> Dict[str, Any]:
        return {}

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind}

    def load_dict(self, data: Dict[str, Any]) -> "EmptyState":
        self._check_kind(data)
        return self


def slim_doc(doc: Doc) -> Doc:
    """A copy of a doc without its tensor and transformer output, so it pins
    no model activations."""
    data = doc.to_bytes(exclude=["tensor", "user_data"])
    new = Doc(doc.vocab).from_bytes(data)
    for key, value in doc.user_data.items():
        if isinstance(key, tuple) and len(key) == 4 and key[1] in _HEAVY_EXTENSIONS:
            continue
        new.user_data[key] = value
    return new


class SlimExamplesState(ScoreState):
    """Fallback for a scorer without a mergeable twin: keeps slim copies of the
    examples (docs without tensors or `trf_data`) and runs the scorer itself on
    all of them in `result()`. Memory grows with the number of examples.

    score (Callable[[List[Example]], Dict[str, Any]]): Scores a list of examples.
    vocab (Vocab): Vocab for restoring saved docs.
    """

    kind = "slim_examples"
    # It keeps docs to the end: an evaluation with it uses no memory zones.
    zone_safe = False

    def __init__(self, score: Callable[[List[Example]], Dict[str, Any]], vocab) -> None:
        self.score = score
        self.vocab = vocab
        self.examples: List[Example] = []

    def update(self, examples: Iterable[Example]) -> None:
        for eg in examples:
            self.examples.append(Example(slim_doc(eg.predicted), slim_doc(eg.reference)))

    def _merge(self, other: "SlimExamplesState") -> None:
        self.examples.extend(other.examples)

    def result(self) -> Dict[str, Any]:
        return self.score(self.examples)

    def to_dict(self) -> Dict[str, Any]:
        pred = DocBin(store_user_data=True, docs=[eg.predicted for eg in self.examples])
        ref = DocBin(store_user_data=True, docs=[eg.reference for eg in self.examples])
        return {
            "kind": self.kind,
            "predicted": base64.b64encode(pred.to_bytes()).decode("ascii"),
            "reference": base64.b64encode(ref.to_bytes()).decode("ascii"),
        }

    def load_dict(self, data: Dict[str, Any]) -> "SlimExamplesState":
        self._check_kind(data)
        pred = _docbin_from_json(data.get("predicted"), "predicted")
        ref = _docbin_from_json(data.get("reference"), "reference")
        self.examples = [
            Example(p, r) for p, r in zip(pred.get_docs(self.vocab), ref.get_docs(self.vocab))
        ]
        return self


def release_activations(doc: Doc) -> None:
    """Drop what pins a batch's activations: transformer output and `doc.tensor`."""
    for name in _HEAVY_EXTENSIONS:
        if Doc.has_extension(name) and doc._.get(name) is not None:
            doc._.set(name, None)
    if getattr(doc.tensor, "size", 0):
        doc.tensor = numpy.zeros((0,), dtype="float32")


# A saved DocBin may inflate to at most this many times its size (plus 1 MB): zlib can
# inflate a few KB to GBs, and DocBin.from_bytes inflates it whole. DocBins of docs
# compress 3-20 times.
_MAX_INFLATION = 200


def _docbin_from_json(value: Any, field: str) -> DocBin:
    """A DocBin saved as base64 text, checked before it is inflated and decoded."""
    if not isinstance(value, str):
        raise StateFieldError(field, value, "a DocBin as base64 text")
    try:
        raw = base64.b64decode(value, validate=True)
        inflater = zlib.decompressobj()
        inflater.decompress(raw, _MAX_INFLATION * len(raw) + 2**20)
        too_large = bool(inflater.unconsumed_tail)
    except (ValueError, zlib.error):
        raise StateFieldError(field, value[:40], "a DocBin as base64 text") from None
    if too_large:
        raise StateFieldError(
            field,
            f"{len(raw):,} bytes",
            f"a DocBin that inflates to at most {_MAX_INFLATION} times its size",
        )
    try:
        return DocBin().from_bytes(raw)
    except Exception as err:
        raise StateFieldError(field, type(err).__name__, "a DocBin spaCy can read") from None


class EntityLinkerGoldEntsState(ScoreState):
    """Twin of an entity_linker with `use_gold_ents = true`, whose scorer copies
    the reference entities onto copies of the predicted docs and re-runs the
    linker on them before scoring; done here batch by batch.

    The linker reads its tok2vec's or transformer's output from the docs (a
    listener's `doc.tensor` or `doc._.trf_data`), so it runs again in `prepare`,
    while the batch's docs still hold it; without it, a listener gives zeros and the
    scores are wrong. `update` uses what `prepare` made (and runs the linker itself
    for examples `prepare` did not see, as when called directly with processed docs)."""

    kind = "entity_linker_gold_ents"

    @property
    def zone_safe(self) -> bool:
        return getattr(self.inner, "zone_safe", True)

    def __init__(self, component: Any, inner: ScoreState) -> None:
        self.component = component
        self.inner = inner
        # id(example) -> (example, its copy with the gold entities, linked again)
        self._linked: Dict[int, Tuple[Example, Example]] = {}

    def _link(self, examples: List[Example]) -> List[Example]:
        copies = self.component._ensure_ents(examples)
        docs = self.component.pipe(eg.predicted for eg in copies)
        for eg, doc in zip(copies, docs):
            release_activations(doc)  # the copy holds its own (deep) copy of them
            eg.predicted = doc
        return copies

    def prepare(self, examples: Sequence[Example]) -> None:
        examples = list(examples)
        for eg, linked in zip(examples, self._link(examples)):
            self._linked[id(eg)] = (eg, linked)

    def update(self, examples: Iterable[Example]) -> None:
        examples = list(examples)
        linked: List[Optional[Example]] = []
        for eg in examples:
            found = self._linked.pop(id(eg), None)
            linked.append(found[1] if found is not None and found[0] is eg else None)
        missing = [i for i, eg in enumerate(linked) if eg is None]
        if missing:
            for i, eg in zip(missing, self._link([examples[i] for i in missing])):
                linked[i] = eg
        self.inner.update(linked)

    def _merge(self, other: "EntityLinkerGoldEntsState") -> None:
        self.inner.merge(other.inner)

    def result(self) -> Dict[str, Any]:
        return self.inner.result()

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "inner": self.inner.to_dict()}

    def load_dict(self, data: Dict[str, Any]) -> "EntityLinkerGoldEntsState":
        self._check_kind(data)
        self.inner.load_dict(data["inner"])
        return self


def _scorer_kwargs(component: Any, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments `Pipe.score` passes to the component's scorer."""
    kwargs: Dict[str, Any] = {}
    if isinstance(getattr(component, "cfg", None), dict):
        kwargs.update(component.cfg)
    if hasattr(component, "labels"):
        kwargs["labels"] = component.labels
    kwargs.update(cfg)
    return kwargs


def _scorer_name(nlp: Language, name: str) -> Optional[str]:
    try:
        block = nlp.config["components"][name].get("scorer")
    except (KeyError, AttributeError, TypeError):
        return None
    if isinstance(block, dict):
        return block.get("@scorers")
    return None


def weights_digest(component: Any, n_values: int = 8) -> Optional[str]:
    """A cheap digest of a component's weights: shapes and a few values of every
    thinc parameter and of the first tensors of wrapped PyTorch models. Two
    differently trained copies of the same pipeline differ here.

    RETURNS (Optional[str]): A hex digest, or None if the component has no model.
    """
    model = getattr(component, "model", None)
    if model is None or not hasattr(model, "walk"):
        return None
    digest = hashlib.sha256()
    for node in model.walk():
        for name in node.param_names:
            if not node.has_param(name):
                continue
            param = node.get_param(name)
            flat = param.reshape((-1,))
            digest.update(f"{node.name}.{name}{tuple(param.shape)}".encode("utf8"))
            for part in (flat[:n_values], flat[-n_values:]):
                digest.update(numpy.ascontiguousarray(node.ops.to_numpy(part)).tobytes())
        for shim in getattr(node, "shims", []):
            torch_model = getattr(shim, "_model", None)
            params = getattr(torch_model, "parameters", None)
            if params is None:
                continue
            for i, tensor in enumerate(params()):
                if i >= 4:
                    break
                flat = tensor.detach().reshape(-1)
                digest.update(str(tuple(tensor.shape)).encode("utf8"))
                for part in (flat[:n_values], flat[-n_values:]):
                    digest.update(part.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _replace_numpy_floats(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _replace_numpy_floats(v) for k, v in value.items()}
    if isinstance(value, numpy.floating):
        return float(value)
    return value


# spaCy's own tokenizers whose `score` is `Tokenizer.score`'s: `Scorer.score_tokenization`
# of the examples (Chinese, Japanese, Korean), by module and qualified name, so that
# checking needs none of them imported.
_TOKENIZATION_SCORERS = {
    ("spacy.lang.zh", "ChineseTokenizer.score"),
    ("spacy.lang.ja", "JapaneseTokenizer.score"),
    ("spacy.lang.ko", "KoreanTokenizer.score"),
}


def _scores_tokenization(tokenizer: Any) -> bool:
    """Whether the tokenizer's scorer is spaCy's tokenization scorer, which the
    mergeable tokenization twin reproduces."""
    score = type(tokenizer).score
    if score is Tokenizer.score:
        return True
    where = (getattr(score, "__module__", None), getattr(score, "__qualname__", None))
    return where in _TOKENIZATION_SCORERS


class PipelineScoreState:
    """Mergeable score state of a pipeline: counts for every scoring component
    (and the tokenizer), plus words and seconds for `speed` and the number of
    examples counted (`n_examples`).

    nlp (Language): The pipeline whose scorers are mirrored.
    scorer_cfg (Optional[Dict[str, Any]]): As `nlp.evaluate(scorer_cfg=...)`.
    per_component (bool): As `nlp.evaluate(per_component=...)`.
    warn (bool): Warn about components that fall back to keeping examples.
    """

    def __init__(
        self,
        nlp: Language,
        scorer_cfg: Optional[Dict[str, Any]] = None,
        per_component: bool = False,
        *,
        warn: bool = True,
    ) -> None:
        scorer_cfg = dict(scorer_cfg or {})
        score_nlp = scorer_cfg.get("nlp") or nlp
        cfg = {k: v for k, v in scorer_cfg.items() if k not in _SCORER_INIT_KEYS}
        self.per_component = bool(per_component)
        self.n_examples = 0
        self.n_words = 0
        self.seconds = 0.0
        self.states: List[Tuple[str, ScoreState]] = []
        self.fallbacks: List[str] = []
        description: List[Any] = [score_nlp.lang, describe_value(cfg)]
        tokenizer = score_nlp.tokenizer
        if hasattr(tokenizer, "score"):
            if _scores_tokenization(tokenizer):
                state: ScoreState = make_tokenization_twin()
                how = "twin:tokenization"
            else:
                state = self._fallback(
                    "tokenizer", lambda egs, t=tokenizer: t.score(egs, **cfg), score_nlp, warn
                )
                how = f"fallback:{callable_name(type(tokenizer).score)}"
            self.states.append(("tokenizer", state))
            description.append(["tokenizer", type(tokenizer).__qualname__, how])
        for name, component in score_nlp.pipeline:
            if not hasattr(component, "score"):
                continue
            state, how, kwargs = self._component_state(score_nlp, name, component, cfg, warn)
            self.states.append((name, state))
            factory = score_nlp.get_pipe_meta(name).factory
            weights = weights_digest(component)
            description.append([name, factory, how, describe_value(kwargs), weights])
        self.fingerprint = hashlib.sha256(
            srsly.json_dumps(description, sort_keys=False).encode("utf8")
        ).hexdigest()[:16]

    def _component_state(self, nlp, name, component, cfg, warn):
        kwargs = _scorer_kwargs(component, cfg)
        overridden = type(component).score is not Pipe.score
        scorer = getattr(component, "scorer", None)
        if not overridden and scorer is None:
            return EmptyState(), "empty", kwargs
        twin = None if overridden else find_twin(scorer, _scorer_name(nlp, name))
        if twin is None:
            what = f"{type(component).__name__}.score" if overridden else callable_name(scorer)
            state = self._fallback(
                name, lambda egs, c=component: c.score(egs, **cfg), nlp, warn, what
            )
            return state, f"fallback:{what}", kwargs
        _, bound = unwrap_scorer(scorer)
        kwargs = {**bound, **kwargs}
        state = twin(**kwargs)
        if not isinstance(state, ScoreState):
            raise TypeError(
                f"The mergeable twin {callable_name(twin)} of component '{name}' (scorer "
                f"{callable_name(scorer)}) returned a {type(state).__name__}, not a "
                "spacy_lean.scoring.ScoreState: a twin factory must return a fresh state "
                "(see docs/scoring.md, Custom scorers)."
            )
        if getattr(component, "use_gold_ents", False) and hasattr(component, "_ensure_ents"):
            state = EntityLinkerGoldEntsState(component, state)
        return state, f"twin:{callable_name(twin)}", kwargs

    def _fallback(self, name, score, nlp, warn, what: str = "") -> ScoreState:
        self.fallbacks.append(name)
        if warn:
            warnings.warn(
                f"spacy-lean: the scorer of component '{name}' ({what or 'custom'}) has "
                "no mergeable twin, so slim copies of every evaluated example are kept "
                "for this component until scoring (memory grows with the dev set). "
                "Register one with spacy_lean.scoring.register_twin('<@scorers name>', "
                "make_state) or the 'spacy_lean_scoring_twins' entry-point group; see "
                "docs/scoring.md (Custom scorers). The copies hold no doc.tensor and no "
                "transformer output: a scorer that reads token or doc vectors (token.vector, "
                "doc.similarity) gets no doc.tensor there; a twin reads it in its prepare().",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )
        return SlimExamplesState(score, nlp.vocab)

    @property
    def zone_safe(self) -> bool:
        """Whether every component's state holds counts only, no docs, from one
        update to the next (a fallback keeps slim copies of the examples): the
        streaming evaluator then may read in memory zones (`spacy_lean.zones`)."""
        return all(getattr(state, "zone_safe", True) for _, state in self.states)

    def prepare(self, examples: Sequence[Example]) -> None:
        """Let the states that run a component again do so while one batch's docs
        still hold its activations (see `ScoreState.prepare`).

        examples (Sequence[Example]): One batch, its `.predicted` docs processed.
        """
        for _, state in self.states:
            state.prepare(examples)

    def update(self, examples: Iterable[Example]) -> None:
        """Count examples whose `.predicted` docs are already processed. No
        reference to the examples is kept (except by fallback components).

        examples (Iterable[Example]): The processed examples.
        """
        examples = examples if isinstance(examples, list) else list(examples)
        for _, state in self.states:
            state.update(examples)
        self.n_examples += len(examples)

    def add_speed(self, n_words: int, seconds: float) -> None:
        """Add the number of words processed and the seconds it took."""
        self.n_words += int(n_words)
        self.seconds += float(seconds)

    @property
    def speed(self) -> Optional[float]:
        if self.seconds > 0:
            return self.n_words / self.seconds
        return 0.0 if self.n_words == 0 else None

    def merge(self, other: "PipelineScoreState") -> "PipelineScoreState":
        """Add another state's counts (of examples that come after this state's).

        other (PipelineScoreState): A state of the same pipeline and scorer config.
        RETURNS (PipelineScoreState): self.
        """
        if not isinstance(other, PipelineScoreState):
            raise TypeError(f"Cannot merge {type(other).__name__} into a PipelineScoreState.")
        if other.fingerprint != self.fingerprint:
            raise ValueError(
                "Cannot merge score states of different pipelines or scorer configs "
                f"(fingerprints {self.fingerprint} and {other.fingerprint})."
            )
        for (_, mine), (_, theirs) in zip(self.states, other.states):
            mine.merge(theirs)
        self.n_examples += other.n_examples
        self.n_words += other.n_words
        self.seconds += other.seconds
        return self

    def result(self) -> Dict[str, Any]:
        """RETURNS (Dict[str, Any]): What `nlp.evaluate` returns for all examples
        counted so far; "speed" is words per second from `add_speed`."""
        scores: Dict[str, Any] = {}
        for name, state in self.states:
            result = state.result()
            try:  # what dict.update takes, as nlp.evaluate takes a scorer's result
                result = result if isinstance(result, dict) else dict(result)
            except (TypeError, ValueError):
                raise TypeError(
                    f"The score state of component '{name}' ({type(state).__name__}) "
                    f"returned a {type(result).__name__} from result(), not a dict of "
                    "scores as the scorer's: check its twin's result() (see "
                    "docs/scoring.md, Custom scorers)."
                ) from None
            if self.per_component:
                scores[name] = result
            else:
                scores.update(result)
        scores["speed"] = self.speed
        return _replace_numpy_floats(scores)

    def to_dict(self) -> Dict[str, Any]:
        """RETURNS (Dict[str, Any]): The counts, JSON-serialisable."""
        return {
            "format": STATE_FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "per_component": self.per_component,
            "n_examples": self.n_examples,
            "n_words": self.n_words,
            "seconds": float_to_json(self.seconds),
            "components": [[name, state.to_dict()] for name, state in self.states],
        }

    @classmethod
    def from_dict(
        cls,
        data: Dict[str, Any],
        nlp: Language,
        scorer_cfg: Optional[Dict[str, Any]] = None,
        per_component: Optional[bool] = None,
    ) -> "PipelineScoreState":
        """Restore a state saved with `to_dict`.

        data (Dict[str, Any]): The output of `to_dict`.
        nlp (Language): The same pipeline the state was made with.
        scorer_cfg (Optional[Dict[str, Any]]): The same scorer config.
        per_component (Optional[bool]): Override the saved setting.
        RETURNS (PipelineScoreState): The restored state.
        """
        if not isinstance(data, dict) or data.get("format") != STATE_FORMAT_VERSION:
            raise ValueError(
                "Not a spacy-lean pipeline score state (or one from another version): "
                f"expected format {STATE_FORMAT_VERSION}, got "
                f"{data.get('format') if isinstance(data, dict) else type(data).__name__}."
            )
        if per_component is None:
            per_component = bool(data.get("per_component", False))
        state = cls(nlp, scorer_cfg, per_component, warn=False)
        if data.get("fingerprint") != state.fingerprint:
            saved = [name for name, _ in data.get("components", [])]
            now = [name for name, _ in state.states]
            hint = (
                f"saved components {saved}, this pipeline has {now}"
                if saved != now
                else "same component names, but different component settings, labels or scorer_cfg"
            )
            raise ValueError(
                "This score state was saved with another pipeline or scorer config "
                f"({hint}; fingerprint {data.get('fingerprint')} != {state.fingerprint}). "
                "Load it with the same model and scorer_cfg, or start a fresh evaluation."
            )
        for (name, comp_state), (saved_name, saved) in zip(state.states, data["components"]):
            try:
                comp_state.load_dict(saved)
            except StateFieldError as err:
                raise err.within(f"components.{name}") from None
        state.n_examples = count_from_json(data.get("n_examples", 0), "n_examples")
        state.n_words = count_from_json(data.get("n_words"), "n_words")
        state.seconds = float_from_json(data.get("seconds"), "seconds")
        return state


def make_pipeline_state(
    nlp: Language,
    scorer_cfg: Optional[Dict[str, Any]] = None,
    per_component: bool = False,
) -> PipelineScoreState:
    """Make an empty mergeable score state mirroring `nlp.evaluate`'s scoring.

    nlp (Language): The pipeline.
    scorer_cfg (Optional[Dict[str, Any]]): As for `nlp.evaluate`.
    per_component (bool): As for `nlp.evaluate`.
    RETURNS (PipelineScoreState): The state.
    """
    return PipelineScoreState(nlp, scorer_cfg, per_component)
