"""Work out which pipeline components produce and read a Doc attribute.

spaCy has no registry of "who reads what" at prediction time, so this module puts
together what a pipeline does say:

- components that other components listen to (spacy-transformers' `Transformer`,
  spacy-curated-transformers' `CuratedTransformer`, spaCy's `Tok2Vec`) keep a
  `listener_map`; the listening components read what the producer assigns
  (`doc._.trf_data`, or `doc.tensor` for `tok2vec`) when they predict;
- the listener layers themselves, found by walking each component's model, which
  also catches listeners that `listener_map` has not been linked to yet (a component
  sourced or added after the last `nlp.initialize`/`spacy.load`);
- spaCy's factory metadata: `assigns=[...]` names producers, `requires=[...]`
  names consumers.

A listener reads its field at prediction time, whoever set it last, but it was
trained on the output of one component: the one its `upstream` names, or, with
`upstream = "*"`, every listened-to component before it that spaCy links it to
(`Language._link_components`), of which the nearest one is the last to hand it
outputs in training and the last to set the field at prediction time.
`Consumer.upstream` keeps that name; `unmet_consumers` says which consumers after a
cleaner would read what the cleaner released.

Attributes are written as in spaCy's factory metadata: `"doc._.trf_data"`,
`"doc.tensor"`.
"""

from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from spacy import ty
from spacy.language import Language
from thinc.api import Model

TRF_DATA = "doc._.trf_data"
TENSOR = "doc.tensor"


ANY_UPSTREAM = "*"


class Consumer(NamedTuple):
    """A component that reads `attr` when it predicts, and why we think so.

    `upstream` is the component it listens to: a name, "*" (any listened-to
    component before it, as spaCy and spacy-transformers resolve it), or None for a
    component that reads the attribute whoever set it (`requires`, `consumers`).
    """

    component: str
    attr: str
    reason: str
    upstream: Optional[str] = None


class Unmet(NamedTuple):
    """A consumer after the cleaner that would read what the cleaner released.

    `producer` is the component whose data that is (None when no component of the
    pipeline sets it before the cleaner); `detail` says why no producer between the
    cleaner and the consumer counts.
    """

    consumer: Consumer
    producer: Optional[str]
    detail: str


def _factory_meta(nlp: Language, name: str):
    try:
        return nlp.get_pipe_meta(name)
    except (KeyError, ValueError):  # a component added without a registered factory
        return None


def _listener_attr_and_upstream(node: Model) -> Optional[Tuple[str, str]]:
    """If `node` is a listener layer, return (attribute it reads, upstream name)."""
    # spacy-transformers' TransformerListener and spaCy's Tok2VecListener carry an
    # `upstream_name` attribute; spacy-curated-transformers keeps it in attrs.
    upstream = getattr(node, "upstream_name", None)
    if upstream is None:
        upstream = node.attrs.get("_upstream_name") if hasattr(node, "attrs") else None
    if not isinstance(upstream, str):
        return None
    if node.name == "tok2vec-listener":
        return TENSOR, upstream
    if "listener" in node.name:
        return TRF_DATA, upstream
    return None


def component_assigns(nlp: Language, name: str) -> List[str]:
    """What a component sets on each doc: its `lean_assigns` where it has one (a
    component whose output depends on its settings, such as `char_lm` with `store`),
    else its factory's `assigns`."""
    try:
        declared = getattr(nlp.get_pipe(name), "lean_assigns", None)
    except KeyError:
        declared = None
    if isinstance(declared, (list, tuple)) and all(isinstance(a, str) for a in declared):
        return list(declared)
    meta = _factory_meta(nlp, name)
    return list(meta.assigns) if meta is not None else []


def find_producers(
    nlp: Language, attrs: Iterable[str], names: Optional[Sequence[str]] = None
) -> Dict[str, List[str]]:
    """Map each attribute to the enabled components that set it, in pipeline order.

    A component counts as a producer when its factory declares the attribute in
    `assigns` (spacy-transformers' `transformer` and spacy-curated-transformers'
    `curated_transformer` declare `doc._.trf_data`; `tok2vec` declares `doc.tensor`),
    or, where the component has a `lean_assigns` list, when that names it.

    nlp (Language): the pipeline.
    attrs (Iterable[str]): attributes such as "doc._.trf_data".
    names (Optional[Sequence[str]]): the components to look at, in pipeline order;
        None for the enabled ones (`nlp.pipe_names`).
    RETURNS (Dict[str, List[str]]): attribute -> producer names.
    """
    attrs = list(attrs)
    producers: Dict[str, List[str]] = {attr: [] for attr in attrs}
    for name in nlp.pipe_names if names is None else names:
        assigns = set(component_assigns(nlp, name))
        for attr in attrs:
            if attr in assigns:
                producers[attr].append(name)
    return producers


def find_consumers(
    nlp: Language,
    attrs: Iterable[str],
    extra: Sequence[str] = (),
    names: Optional[Sequence[str]] = None,
) -> List[Consumer]:
    """Find the components that read any of `attrs` when they predict.

    nlp (Language): the pipeline.
    attrs (Iterable[str]): attributes such as "doc._.trf_data", "doc.tensor".
    extra (Sequence[str]): component names the user says read the data.
    names (Optional[Sequence[str]]): the components to look at, in pipeline order;
        None for the enabled ones (`nlp.pipe_names`).
    RETURNS (List[Consumer]): one entry per (component, attribute, upstream), in
        pipeline order.
    """
    attrs = list(attrs)
    wanted = set(attrs)
    if names is None:
        pipeline: List[Tuple[str, Any]] = list(nlp.pipeline)
    else:
        pipeline = [(name, nlp.get_pipe(name)) for name in names]
    producers = find_producers(nlp, attrs, names=[name for name, _ in pipeline])
    producer_attrs: Dict[str, List[str]] = {}
    for attr, names in producers.items():
        for name in names:
            producer_attrs.setdefault(name, []).append(attr)
    found: Dict[Tuple[str, str, Optional[str]], str] = {}

    def add(component: str, attr: str, upstream: Optional[str], reason: str) -> None:
        found.setdefault((component, attr, upstream), reason)

    # 1. Listener layers inside each component's model, linked or not: they say
    # which component they listen to.
    for name, proc in pipeline:
        model = getattr(proc, "model", None)
        if isinstance(model, Model):
            for node in model.walk():
                hit = _listener_attr_and_upstream(node)
                if hit is not None and hit[0] in wanted:
                    attr, upstream = hit
                    if upstream == ANY_UPSTREAM:
                        source = "any upstream component ('*')"
                    else:
                        source = f"'{upstream}'"
                    add(
                        name,
                        attr,
                        upstream,
                        f"its model has a {node.name} layer listening to {source}",
                    )
    walked = {(component, attr) for component, attr, _ in found}
    # 2. Producers that keep a listener map (Transformer, CuratedTransformer, Tok2Vec),
    # for listening components whose listener layers the walk did not find.
    for name, proc in pipeline:
        listener_map = getattr(proc, "listener_map", None)
        if isinstance(listener_map, dict):
            for attr in producer_attrs.get(name, []):
                for listening in listener_map:
                    if (listening, attr) not in walked:
                        add(listening, attr, name, f"it listens to '{name}'")
    # 3. Factory metadata, and the names the user gave: they read the attribute
    # whoever set it.
    for name, _ in pipeline:
        meta = _factory_meta(nlp, name)
        if meta is not None:
            for attr in meta.requires:
                if attr in wanted:
                    add(name, attr, None, f"its factory declares requires=['{attr}']")
    for name in extra:
        for attr in attrs:
            add(name, attr, None, "it is named in the cleaner's `consumers` setting")
    order = {name: i for i, name in enumerate(nlp.component_names)}
    consumers = [Consumer(c, a, r, u) for (c, a, u), r in found.items()]
    consumers.sort(key=lambda c: (order.get(c.component, len(order)), attrs.index(c.attr)))
    return consumers


def is_listened_to(proc: Any) -> bool:
    """Whether a component hands its output to listeners (spaCy's
    `ListenedToComponent`: `Tok2Vec`, spacy-transformers' `Transformer`,
    spacy-curated-transformers' `CuratedTransformer`)."""
    return isinstance(proc, ty.ListenedToComponent)


def resolve_any_upstream(
    nlp: Language, consumer: str, attr: str, before: Sequence[str], producers: Sequence[str]
) -> Optional[str]:
    """The component a listener with `upstream = "*"` gets its data from: the nearest
    component before it that spaCy links it to. That is a listened-to component that
    sets `attr` (its factory's `assigns`) or already lists, in its `listener_map`, a
    listener of the consumer that reads `attr`. spaCy links a "*" listener to every
    such component before it; in training the nearest one hands it outputs last, and
    at prediction time it sets the attribute last.

    nlp (Language): the pipeline.
    consumer (str): the listening component.
    attr (str): the attribute the listener reads.
    before (Sequence[str]): the components that run before the consumer, in order.
    producers (Sequence[str]): the components that set `attr`.
    RETURNS (Optional[str]): the component, or None when there is none.
    """
    for name in reversed(before):
        proc = nlp.get_pipe(name)
        if not is_listened_to(proc):
            continue
        if name in producers:
            return name
        listener_map = getattr(proc, "listener_map", None)
        linked = listener_map.get(consumer, []) if isinstance(listener_map, dict) else []
        if any((_listener_attr_and_upstream(node) or ("",))[0] == attr for node in linked):
            return name
    return None


def unmet_consumers(
    nlp: Language,
    running: Sequence[str],
    position: int,
    consumers: Iterable[Consumer],
    producers: Dict[str, List[str]],
) -> List[Unmet]:
    """The consumers after a cleaner that would read data the cleaner released.

    A consumer after the cleaner is fine when its data is set again between the
    cleaner and itself: for a listener, by the component it listens to (by name, or
    "*" resolved as spaCy does, see `resolve_any_upstream`); for a component that
    reads the attribute whoever set it (`requires`, `consumers`), by any producer.

    nlp (Language): the pipeline.
    running (Sequence[str]): the components that run, in pipeline order.
    position (int): the cleaner's index in `running`.
    consumers (Iterable[Consumer]): the consumers (of the attributes it releases).
    producers (Dict[str, List[str]]): attribute -> the components in `running` that
        set it (the cleaners left out).
    RETURNS (List[Unmet]): the consumers whose data the cleaner would release, in
        pipeline order.
    """
    index = {name: i for i, name in enumerate(running)}
    unmet: List[Unmet] = []
    for consumer in consumers:
        j = index.get(consumer.component)
        if j is None or j <= position:
            continue
        attr = consumer.attr
        setters = producers.get(attr, [])
        before = [p for p in setters if index[p] < position]
        last_before = before[-1] if before else None
        between = [p for p in setters if position < index[p] < j]
        upstream = consumer.upstream
        if upstream is None:
            if not between:
                detail = _nothing_between(consumer.component, attr, last_before)
                unmet.append(Unmet(consumer, last_before, detail))
            continue
        if upstream == ANY_UPSTREAM:
            resolved = resolve_any_upstream(nlp, consumer.component, attr, running[:j], setters)
            if resolved is None:
                detail = (
                    "No component before it that it can listen to sets "
                    f"{attr} (a component with a listener map whose factory declares "
                    f"assigns=['{attr}'])" + _others(consumer.component, attr, between)
                )
                if not between:
                    detail += "; " + _nothing_between(consumer.component, attr, last_before)
                unmet.append(Unmet(consumer, last_before, detail))
            elif index[resolved] < position:
                detail = (
                    f"That is, it listens to '{resolved}', the last component before it that "
                    f"it can listen to, which sets {attr} before the cleaner"
                    + _others(consumer.component, attr, between)
                )
                unmet.append(Unmet(consumer, resolved, detail))
            continue
        # A named upstream.
        k = index.get(upstream)
        if k is not None and position < k < j:
            # A listened-to component whose factory declares nothing is given the
            # benefit of the doubt (a Tok2Vec made by a factory of one's own).
            declared = bool(component_assigns(nlp, upstream))
            if upstream in setters or (is_listened_to(nlp.get_pipe(upstream)) and not declared):
                continue
            where = (
                f"runs between the cleaner and '{consumer.component}' but does not set {attr} "
                f"(its factory declares no assigns=['{attr}'])"
            )
        elif k is not None and k < position:
            detail = f"'{upstream}' sets {attr} before the cleaner" + _others(
                consumer.component, attr, between
            )
            unmet.append(Unmet(consumer, upstream, detail))
            continue
        elif k is not None:
            where = f"runs after '{consumer.component}'"
        elif upstream in nlp.component_names:
            where = "is disabled"
        else:
            where = "is not in the pipeline"
        detail = f"'{upstream}' {where}" + _others(consumer.component, attr, between)
        if not between:
            detail += "; " + _nothing_between(consumer.component, attr, last_before)
        unmet.append(Unmet(consumer, last_before, detail))
    return unmet


def _nothing_between(component: str, attr: str, last_before: Optional[str]) -> str:
    if last_before is None:
        return (
            f"no component of the pipeline sets {attr} before the cleaner or between the "
            f"cleaner and '{component}' (it comes with the docs)"
        )
    return (
        f"'{last_before}' sets {attr} before the cleaner and no component between the "
        f"cleaner and '{component}' sets it again"
    )


def _others(component: str, attr: str, between: Sequence[str]) -> str:
    if not between:
        return ""
    return (
        f"; {between} set(s) {attr} again between the cleaner and '{component}', but "
        f"'{component}' does not listen to {'it' if len(between) == 1 else 'them'}"
    )
