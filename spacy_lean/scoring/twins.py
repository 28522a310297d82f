"""Which mergeable state stands in for which scorer ("twins"), and how to
register one for a custom scorer.

A twin factory is called with the keyword arguments spaCy would pass to the
scorer (the component's `cfg`, its `labels`, then the `scorer_cfg`), and returns a
`ScoreState` whose `result()` equals the scorer's output for the same examples.

Lookup order for a component: (1) the name of its scorer in spaCy's `@scorers`
registry (from the pipeline config) in `twin_registry`, (2) the scorer function
itself (after unwrapping `functools.partial`) in the table filled by
`register_twin(func)`. Built-in scorers are registered both ways.
"""

import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import catalogue
from spacy.scorer import get_ner_prf
from spacy.training import Example

from .base import ScoreState
from .cats import CatsState
from .deps import DepsState, lower_dep_getter
from .links import LinksState
from .spans import NERState, SpansState
from .tokens import TokenAttrPerFeatState, TokenAttrState, TokenizationState, morph_key_getter

TwinFactory = Callable[..., ScoreState]

#: Twins keyed by the scorer's name in spaCy's `@scorers` registry. Packages can
#: add to it through the `spacy_lean_scoring_twins` entry-point group.
twin_registry = catalogue.create("spacy_lean", "scoring_twins", entry_points=True)

_twins_by_function: Dict[Callable, TwinFactory] = {}
#: spaCy's `@scorers` names whose twins spacy-lean registers: the function each
#: name's factory returns, and the twin.
_builtin_names: Dict[str, Tuple[Callable, TwinFactory]] = {}


def register_twin(scorer: Union[str, Callable], factory: Optional[TwinFactory] = None) -> Any:
    """Register a mergeable twin for a scorer. Use as a decorator or call directly.

    scorer (Union[str, Callable]): The scorer's name in spaCy's `@scorers`
        registry (e.g. "my_project.my_scorer.v1"), or the scorer function itself.
    factory (Optional[Callable[..., ScoreState]]): Called with the scorer's keyword
        arguments; returns a fresh state. If omitted, a decorator is returned.
    RETURNS: The factory, or a decorator.
    """

    def decorate(func: TwinFactory) -> TwinFactory:
        if isinstance(scorer, str):
            twin_registry.register(scorer, func=func)
        elif callable(scorer):
            _twins_by_function[scorer] = func
        else:
            raise TypeError(
                f"register_twin expects a registered scorer name or the scorer "
                f"function, got {type(scorer).__name__}: {scorer!r}"
            )
        return func

    if factory is not None:
        return decorate(factory)
    return decorate


def unwrap_scorer(scorer: Any) -> Tuple[Any, Dict[str, Any]]:
    """The function behind a scorer and the keyword arguments bound to it
    (`functools.partial`; entity_linker's wrapper that sets gold entities)."""
    kwargs: Dict[str, Any] = {}
    while isinstance(scorer, functools.partial):
        kwargs = {**scorer.keywords, **kwargs}
        scorer = scorer.func
    code = getattr(scorer, "__code__", None)
    if (
        code is not None
        and getattr(scorer, "__name__", "") == "_score_with_ents_set"
        and "scorer" in code.co_freevars
    ):
        inner = scorer.__closure__[code.co_freevars.index("scorer")].cell_contents
        inner, inner_kwargs = unwrap_scorer(inner)
        return inner, {**inner_kwargs, **kwargs}
    return scorer, kwargs


def find_twin(scorer: Any, scorer_name: Optional[str]) -> Optional[TwinFactory]:
    """The twin factory for a scorer, or None.

    scorer (Any): The scorer function (possibly a partial or wrapper).
    scorer_name (Optional[str]): Its name in `@scorers`, if known.
    """
    func, _ = unwrap_scorer(scorer)
    if scorer_name is not None:
        try:
            twin = twin_registry.get(scorer_name)
        except catalogue.RegistryError:
            twin = None
        builtin = _builtin_names.get(scorer_name)
        # A twin registered for the name by a user is trusted. A built-in name's twin
        # mirrors spaCy's function only: where the component runs another scorer
        # (replaced at runtime, or wrapped by its factory), the config's name is not
        # what runs, and the function decides.
        if twin is not None and (builtin is None or builtin[1] is not twin or builtin[0] is func):
            return twin
    try:
        return _twins_by_function.get(func)
    except TypeError:  # unhashable callable
        return None


class CompositeState(ScoreState):
    """Several states whose results are joined in order, like a scorer that calls
    several `Scorer` methods and `dict.update`s their results.

    parts (Sequence[ScoreState]): The states, in the order results are joined.
    drop (Sequence[str]): Keys removed from the joined result.
    """

    kind = "composite"

    def __init__(self, parts: Sequence[ScoreState], drop: Sequence[str] = ()) -> None:
        self.parts = list(parts)
        self.drop = list(drop)

    def update(self, examples: Iterable[Example]) -> None:
        examples = examples if isinstance(examples, (list, tuple)) else list(examples)
        for part in self.parts:
            part.update(examples)

    def prepare(self, examples: Sequence[Example]) -> None:
        for part in self.parts:
            part.prepare(examples)

    def _merge(self, other: "CompositeState") -> None:
        if len(other.parts) != len(self.parts):
            raise ValueError("Cannot merge composite states with different parts.")
        for mine, theirs in zip(self.parts, other.parts):
            mine.merge(theirs)

    def result(self) -> Dict[str, Any]:
        res: Dict[str, Any] = {}
        for part in self.parts:
            res.update(part.result())
        for key in self.drop:
            res.pop(key, None)
        return res

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "parts": [p.to_dict() for p in self.parts]}

    def load_dict(self, data: Dict[str, Any]) -> "CompositeState":
        self._check_kind(data)
        if len(data["parts"]) != len(self.parts):
            raise ValueError(
                f"Saved state has {len(data['parts'])} parts, this scorer has "
                f"{len(self.parts)}: restore it with the pipeline it was made with."
            )
        for part, part_data in zip(self.parts, data["parts"]):
            part.load_dict(part_data)
        return self


# -- Built-in twins --------------------------------------------------------------


def _has_sents(doc) -> bool:
    return doc.has_annotation("SENT_START")


class _SpanGroupGetter:
    """Spans of the group named by an attribute "spans_<key>" (spancat's getter)."""

    prefix = "spans_"

    def __call__(self, doc, attr: str):
        return doc.spans.get(attr[len(self.prefix) :], [])


class _HasSpanGroup:
    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, doc) -> bool:
        return self.key in doc.spans


def make_tokenization_twin(**kwargs) -> ScoreState:
    """Twin of `Tokenizer.score` (`token_acc/p/r/f`)."""
    return TokenizationState()


def make_ner_twin(**kwargs) -> ScoreState:
    """Twin of the ner and entity_ruler scorers (`ents_*`)."""
    return NERState()


def make_tagger_twin(**kwargs) -> ScoreState:
    """Twin of the tagger scorer (`tag_acc`)."""
    return TokenAttrState("tag", **kwargs)


def make_lemmatizer_twin(**kwargs) -> ScoreState:
    """Twin of the lemmatizer scorers (`lemma_acc`)."""
    return TokenAttrState("lemma", **kwargs)


def make_morphologizer_twin(**kwargs) -> ScoreState:
    """Twin of the morphologizer scorer (`pos_acc`, `morph_acc`, `morph_micro_*`,
    `morph_per_feat`)."""
    return CompositeState(
        [
            TokenAttrState("pos", **kwargs),
            TokenAttrState("morph", getter=morph_key_getter, **kwargs),
            TokenAttrPerFeatState("morph", getter=morph_key_getter, **kwargs),
        ]
    )


def make_attribute_ruler_twin(**kwargs) -> ScoreState:
    """Twin of the attribute_ruler scorer."""
    return CompositeState(
        [
            TokenAttrState("tag", **kwargs),
            TokenAttrState("pos", **kwargs),
            TokenAttrState("morph", getter=morph_key_getter, **kwargs),
            TokenAttrPerFeatState("morph", getter=morph_key_getter, **kwargs),
            TokenAttrState("lemma", **kwargs),
        ]
    )


def make_senter_twin(**kwargs) -> ScoreState:
    """Twin of the senter scorer (`sents_p/r/f`)."""
    return CompositeState(
        [SpansState("sents", has_annotation=_has_sents, **kwargs)], drop=["sents_per_type"]
    )


def make_parser_twin(**kwargs) -> ScoreState:
    """Twin of the parser scorer (`sents_p/r/f`, `dep_uas`, `dep_las`,
    `dep_las_per_type`)."""
    sents = SpansState("sents", has_annotation=_has_sents, **kwargs)
    kwargs = dict(kwargs)
    kwargs.setdefault("getter", lower_dep_getter)
    kwargs.setdefault("ignore_labels", ("p", "punct"))
    return CompositeState([sents, DepsState("dep", **kwargs)], drop=["sents_per_type"])


def _span_group_kwargs(spans_key: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    kwargs = dict(kwargs)
    kwargs.setdefault("attr", f"spans_{spans_key}")
    kwargs.setdefault("allow_overlap", True)
    kwargs.setdefault("getter", _SpanGroupGetter())
    kwargs.setdefault("has_annotation", _HasSpanGroup(spans_key))
    return kwargs


def make_spancat_twin(**kwargs) -> ScoreState:
    """Twin of the spancat scorer (`spans_<key>_p/r/f`, `spans_<key>_per_type`)."""
    return SpansState(**_span_group_kwargs(kwargs["spans_key"], kwargs))


def make_span_finder_twin(**kwargs) -> ScoreState:
    """Twin of the span_finder scorer (unlabeled `spans_<key>_p/r/f`)."""
    kwargs = _span_group_kwargs(kwargs["spans_key"], kwargs)
    kwargs.setdefault("labeled", False)
    return CompositeState([SpansState(**kwargs)], drop=[f"{kwargs['attr']}_per_type"])


def make_overlapping_spans_twin(*, spans_key: str = "ruler", **kwargs) -> ScoreState:
    """Twin of the span_ruler scorer."""
    kwargs = _span_group_kwargs(spans_key, kwargs)
    kwargs.setdefault("labeled", True)
    return SpansState(**kwargs)


def make_textcat_twin(**kwargs) -> ScoreState:
    """Twin of the textcat scorer (exclusive labels)."""
    return CatsState("cats", multi_label=False, **kwargs)


def make_textcat_multilabel_twin(**kwargs) -> ScoreState:
    """Twin of the textcat_multilabel scorer."""
    return CatsState("cats", multi_label=True, **kwargs)


def make_entity_linker_twin(**kwargs) -> ScoreState:
    """Twin of the entity_linker scorer (`nel_*`)."""
    from spacy.pipeline.entity_linker import EntityLinker

    return LinksState(negative_labels=[EntityLinker.NIL], **kwargs)


def _register_builtins() -> None:
    from spacy.pipeline import attributeruler, entity_linker, entityruler, lemmatizer
    from spacy.pipeline import span_finder, span_ruler, spancat, textcat
    from spacy.pipeline import textcat_multilabel
    from spacy.pipeline.dep_parser import parser_score
    from spacy.pipeline.morphologizer import morphologizer_score
    from spacy.pipeline.ner import ner_score
    from spacy.pipeline.senter import senter_score
    from spacy.pipeline.tagger import tagger_score

    table: List[Tuple[Optional[str], Callable, TwinFactory]] = [
        ("spacy.ner_scorer.v1", ner_score, make_ner_twin),
        ("spacy.entity_ruler_scorer.v1", entityruler.entity_ruler_score, make_ner_twin),
        (None, get_ner_prf, make_ner_twin),
        ("spacy.parser_scorer.v1", parser_score, make_parser_twin),
        ("spacy.senter_scorer.v1", senter_score, make_senter_twin),
        ("spacy.tagger_scorer.v1", tagger_score, make_tagger_twin),
        ("spacy.morphologizer_scorer.v1", morphologizer_score, make_morphologizer_twin),
        ("spacy.lemmatizer_scorer.v1", lemmatizer.lemmatizer_score, make_lemmatizer_twin),
        (
            "spacy.attribute_ruler_scorer.v1",
            attributeruler.attribute_ruler_score,
            make_attribute_ruler_twin,
        ),
        ("spacy.textcat_scorer.v2", textcat.textcat_score, make_textcat_twin),
        (
            "spacy.textcat_multilabel_scorer.v2",
            textcat_multilabel.textcat_multilabel_score,
            make_textcat_multilabel_twin,
        ),
        ("spacy.spancat_scorer.v1", spancat.spancat_score, make_spancat_twin),
        ("spacy.span_finder_scorer.v1", span_finder.span_finder_score, make_span_finder_twin),
        (
            "spacy.overlapping_labeled_spans_scorer.v1",
            span_ruler.overlapping_labeled_spans_score,
            make_overlapping_spans_twin,
        ),
        (
            "spacy.entity_linker_scorer.v1",
            entity_linker.entity_linker_score,
            make_entity_linker_twin,
        ),
    ]
    for name, func, factory in table:
        _twins_by_function[func] = factory
        if name is not None and name not in twin_registry:
            twin_registry.register(name, func=factory)
            _builtin_names[name] = (func, factory)


_register_builtins()
