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

Attributes are written as in spaCy's factory metadata: `"doc._.trf_data"`,
`"doc.tensor"`.
"""

from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from spacy.language import Language
from thinc.api import Model

TRF_DATA = "doc._.trf_data"
TENSOR = "doc.tensor"


class Consumer(NamedTuple):
    """A component that reads `attr` when it predicts, and why we think so."""

    component: str
    attr: str
    reason: str


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


def find_producers(nlp: Language, attrs: Iterable[str]) -> Dict[str, List[str]]:
    """Map each attribute to the enabled components that set it, in pipeline order.

    A component counts as a producer when its factory declares the attribute in
    `assigns` (spacy-transformers' `transformer` and spacy-curated-transformers'
    `curated_transformer` declare `doc._.trf_data`; `tok2vec` declares `doc.tensor`).

    nlp (Language): the pipeline.
    attrs (Iterable[str]): attributes such as "doc._.trf_data".
    RETURNS (Dict[str, List[str]]): attribute -> producer names.
    """
    attrs = list(attrs)
    producers: Dict[str, List[str]] = {attr: [] for attr in attrs}
    for name in nlp.pipe_names:
        meta = _factory_meta(nlp, name)
        assigns = set(meta.assigns) if meta is not None else set()
        for attr in attrs:
            if attr in assigns:
                producers[attr].append(name)
    return producers


def find_consumers(
    nlp: Language, attrs: Iterable[str], extra: Sequence[str] = ()
) -> List[Consumer]:
    """Find the enabled components that read any of `attrs` when they predict.

    nlp (Language): the pipeline.
    attrs (Iterable[str]): attributes such as "doc._.trf_data", "doc.tensor".
    extra (Sequence[str]): component names the user says read the data.
    RETURNS (List[Consumer]): one entry per (component, attribute), in pipeline order.
    """
    attrs = list(attrs)
    wanted = set(attrs)
    pipeline: List[Tuple[str, Any]] = list(nlp.pipeline)
    producers = find_producers(nlp, attrs)
    producer_attr = {name: attr for attr, names in producers.items() for name in names}
    found: Dict[Tuple[str, str], str] = {}

    def add(component: str, attr: str, reason: str) -> None:
        found.setdefault((component, attr), reason)

    for name, proc in pipeline:
        # 1. Producers that keep a listener map (Transformer, CuratedTransformer, Tok2Vec).
        listener_map = getattr(proc, "listener_map", None)
        if isinstance(listener_map, dict) and name in producer_attr:
            for listening in listener_map:
                add(listening, producer_attr[name], f"it listens to '{name}'")
        # 2. Listener layers inside the component's model, linked or not.
        model = getattr(proc, "model", None)
        if isinstance(model, Model):
            for node in model.walk():
                hit = _listener_attr_and_upstream(node)
                if hit is not None and hit[0] in wanted:
                    attr, upstream = hit
                    source = "any upstream component" if upstream == "*" else f"'{upstream}'"
                    add(name, attr, f"its model has a {node.name} layer listening to {source}")
        # 3. Factory metadata.
        meta = _factory_meta(nlp, name)
        if meta is not None:
            for attr in meta.requires:
                if attr in wanted:
                    add(name, attr, f"its factory declares requires=['{attr}']")
    for name in extra:
        for attr in attrs:
            add(name, attr, "it is named in the cleaner's `consumers` setting")
    order = {name: i for i, name in enumerate(nlp.component_names)}
    consumers = [Consumer(c, a, r) for (c, a), r in found.items()]
    consumers.sort(key=lambda c: (order.get(c.component, len(order)), attrs.index(c.attr)))
    return consumers
