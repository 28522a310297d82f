"""The `lean_cleaner` component: release heavy per-doc data once nothing needs it.

A spacy-transformers pipeline leaves `doc._.trf_data` on every doc it processes. That
object holds *views* of the transformer's whole output batch, so a single kept doc
pins the hidden states of every doc that was in its batch (on GPU too). Keep a few
thousand docs (as `nlp.evaluate` does) and the batches pile up.

`nlp.add_pipe("lean_cleaner")` drops that data (and `doc.tensor`, and any extension
or `user_data` key you name) from each doc as it leaves the pipeline. Unlike spaCy's
`doc_cleaner` it knows which components read the data, and raises an error instead
of silently breaking them when it is placed before one of them and nothing sets their
data again in between (a second transformer before its own listeners does).
"""

import sys
import warnings
import weakref
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy
import srsly
from spacy import util
from spacy.language import Language
from spacy.tokens import Doc
from spacy.util import SimpleFrozenList
from thinc.api import Config
from thinc.backends import get_array_ops
from thinc.types import Ragged

from ._warn import caller_stacklevel
from .consumers import (
    TENSOR,
    TRF_DATA,
    Consumer,
    Unmet,
    find_consumers,
    find_producers,
    unmet_consumers,
)
from .memory import empty_gpu_caches, trim_host_memory

DEFAULT_CLEANER_CONFIG_STR = """
[lean_cleaner]
trf_data = true
tensor = true
extensions = []
user_data_keys = []
consumers = []
compact_vectors = null
empty_cache_every = 0
trim_memory_every = 32
"""
DEFAULT_CLEANER_CONFIG = Config().from_str(DEFAULT_CLEANER_CONFIG_STR)["lean_cleaner"]

COMPACT_DTYPES = ("float16", "float32")
# The code of the `Language` methods that run components, looked for on the call stack
# (`LeanCleaner._follow_running_pipeline`), and how far up.
_LANGUAGE_CODES = frozenset({Language.__call__.__code__, Language.pipe.__code__})
_MAX_FRAMES = 64
_CFG_KEYS = tuple(DEFAULT_CLEANER_CONFIG.keys())


class LeanCleanerWarning(UserWarning):
    """Recoverable situations found by `lean_cleaner` (said once per component)."""


@Language.factory(
    "lean_cleaner",
    default_config=DEFAULT_CLEANER_CONFIG,
    # No `assigns`: spaCy's metadata has no "removes", and `nlp.analyze_pipes()` takes
    # `assigns` as "sets it", so a `requires=['doc._.trf_data']` component after the
    # cleaner was reported as fine. What it releases: `released_attrs`.
)
def make_lean_cleaner(
    nlp: Language,
    name: str,
    *,
    trf_data: bool = True,
    tensor: bool = True,
    extensions: List[str] = SimpleFrozenList(),
    user_data_keys: List[str] = SimpleFrozenList(),
    consumers: List[str] = SimpleFrozenList(),
    compact_vectors: Optional[str] = None,
    empty_cache_every: int = 0,
    trim_memory_every: int = 32,
) -> "LeanCleaner":
    """Build a `LeanCleaner`, which releases heavy per-doc data no later component
    needs.

    trf_data (bool): release `doc._.trf_data` (spacy-transformers' `TransformerData`
        or spacy-curated-transformers' `DocTransformerOutput`).
    tensor (bool): release `doc.tensor` (reset to an empty array).
    extensions (List[str]): further Doc extensions to reset to their default.
    user_data_keys (List[str]): further `doc.user_data` keys to remove.
    consumers (List[str]): further components that read the released data; the
        cleaner must run after them.
    compact_vectors (Optional[str]): "float16" or "float32" to keep, in `doc.tensor`,
        one vector per token: the mean of its wordpieces' last hidden layer rows, on
        CPU. None to keep nothing.
    empty_cache_every (int): every this many docs, give the GPU allocators' cached
        blocks back (torch's CUDA caching allocator, cupy's pools). 0 turns it off.
    trim_memory_every (int): every this many docs, give the free pages of the host
        heap back to the system (glibc's `malloc_trim`, Linux only). 0 turns it off.
    """
    return LeanCleaner(
        nlp,
        name,
        trf_data=trf_data,
        tensor=tensor,
        extensions=extensions,
        user_data_keys=user_data_keys,
        consumers=consumers,
        compact_vectors=compact_vectors,
        empty_cache_every=empty_cache_every,
        trim_memory_every=trim_memory_every,
    )


class LeanCleaner:
    """Release `doc._.trf_data`, `doc.tensor` and named extensions/`user_data` keys
    from each doc, after the last component that reads them.

    The placement is checked on first use and again whenever the pipeline's
    components change (spaCy has no hook for that, so the cleaner compares the
    pipeline's names at each call). What was released is counted in `self.stats`.
    """

    def __init__(
        self,
        nlp: Optional[Language],
        name: str = "lean_cleaner",
        *,
        trf_data: bool = True,
        tensor: bool = True,
        extensions: Sequence[str] = (),
        user_data_keys: Sequence[str] = (),
        consumers: Sequence[str] = (),
        compact_vectors: Optional[str] = None,
        empty_cache_every: int = 0,
        trim_memory_every: int = 32,
    ):
        """Initialize the cleaner.

        nlp (Optional[Language]): the pipeline, used to check the placement. With
            None (a cleaner used on its own) nothing is checked.
        name (str): the component name.
        Other arguments: see `make_lean_cleaner`.
        """
        self.name = name
        self._nlp_ref: Optional["weakref.ReferenceType[Language]"] = None
        self._nlp = nlp
        self.cfg: Dict[str, Any] = self._validate_cfg(
            {
                "trf_data": trf_data,
                "tensor": tensor,
                "extensions": extensions,
                "user_data_keys": user_data_keys,
                "consumers": consumers,
                "compact_vectors": compact_vectors,
                "empty_cache_every": empty_cache_every,
                "trim_memory_every": trim_memory_every,
            }
        )
        self.stats: Dict[str, int] = {}
        self.reset_stats()
        self._checked: Optional[Tuple[Tuple[str, int, Any], ...]] = None
        # The pipeline as `initialize` saw it: checked leniently until it changes.
        self._initialize_signature: Optional[Tuple[Tuple[str, int, Any], ...]] = None
        self._warned: set = set()
        self._since_empty = 0
        self._since_trim = 0
        # Width of the last compact vectors made: an empty doc gets (0, width) too.
        self._compact_width: Optional[int] = None

    # -- configuration -------------------------------------------------------

    @staticmethod
    def _validate_cfg(cfg: Dict[str, Any]) -> Dict[str, Any]:
        unknown = sorted(set(cfg) - set(_CFG_KEYS))
        if unknown:
            raise ValueError(
                f"Unknown lean_cleaner setting(s): {unknown}. Known settings: {list(_CFG_KEYS)}."
            )
        cfg = {**DEFAULT_CLEANER_CONFIG, **cfg}
        for key in ("trf_data", "tensor"):
            if not isinstance(cfg[key], bool):
                raise TypeError(f"lean_cleaner: '{key}' must be true or false, got {cfg[key]!r}.")
        for key in ("extensions", "user_data_keys", "consumers"):
            value = cfg[key]
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise TypeError(f"lean_cleaner: '{key}' must be a list of strings, got {value!r}.")
            for item in value:
                if not isinstance(item, str) or not item:
                    raise TypeError(
                        f"lean_cleaner: '{key}' must be a list of non-empty strings, "
                        f"got the item {item!r}."
                    )
        extensions = []
        for ext in cfg["extensions"]:
            bare = ext[len("doc._.") :] if ext.startswith("doc._.") else ext
            bare = bare[len("_.") :] if bare.startswith("_.") else bare
            if not Doc.has_extension(bare):
                raise ValueError(
                    f"lean_cleaner: the extension {ext!r} in 'extensions' names nothing: "
                    f"no Doc extension '{bare}' is registered. Register it first "
                    f"(Doc.set_extension('{bare}', default=None)) or remove it from 'extensions'."
                )
            default, method, getter, setter = Doc.get_extension(bare)
            if method is not None or getter is not None:
                kind = "method" if method is not None else "getter"
                raise ValueError(
                    f"lean_cleaner: the extension {ext!r} in 'extensions' is a {kind}, so "
                    "docs store nothing for it that could be released. Name an extension "
                    "registered with a default instead."
                )
            extensions.append(bare)
        cfg["extensions"] = extensions
        cfg["user_data_keys"] = list(cfg["user_data_keys"])
        cfg["consumers"] = list(cfg["consumers"])
        if cfg["compact_vectors"] not in (None,) + COMPACT_DTYPES:
            raise ValueError(
                f'lean_cleaner: \'compact_vectors\' must be null, "float16" or "float32", '
                f"got {cfg['compact_vectors']!r}."
            )
        for key in ("empty_cache_every", "trim_memory_every"):
            every = cfg[key]
            if isinstance(every, bool) or not isinstance(every, int) or every < 0:
                raise ValueError(
                    f"lean_cleaner: '{key}' must be an integer >= 0 (0 turns it off), "
                    f"got {every!r}."
                )
        return cfg

    @property
    def lean_assigns(self) -> List[str]:
        """The attributes the cleaner resets (or, with `compact_vectors`, replaces), as
        the placement check and the listener lookup in `consumers` know it."""
        return [TRF_DATA, TENSOR]

    @property
    def released_attrs(self) -> List[str]:
        """RETURNS (List[str]): the attributes this cleaner releases, in spaCy's
        notation ("doc._.trf_data", "doc.tensor", "doc._.my_ext",
        "doc.user_data['key']")."""
        attrs = []
        if self.cfg["trf_data"] or "trf_data" in self.cfg["extensions"]:
            attrs.append(TRF_DATA)
        if self.cfg["tensor"] or self.cfg["compact_vectors"]:
            attrs.append(TENSOR)
        attrs.extend(f"doc._.{ext}" for ext in self.cfg["extensions"] if ext != "trf_data")
        attrs.extend(f"doc.user_data[{key!r}]" for key in self.cfg["user_data_keys"])
        return attrs

    def reset_stats(self) -> None:
        """Set the counters in `self.stats` back to zero."""
        self.stats = {
            "docs": 0,  # docs that passed through the cleaner
            "released_docs": 0,  # docs from which something was released
            "released_bytes": 0,  # bytes of the arrays released (each doc's share)
            "trf_data": 0,  # docs whose doc._.trf_data was released
            "tensor": 0,  # docs whose doc.tensor was released
            "extensions": 0,  # extension values released
            "user_data": 0,  # user_data values released
            "compact_bytes": 0,  # bytes kept as compact vectors
            "cache_empties": 0,  # times the GPU allocators' caches were emptied
            "memory_trims": 0,  # times the host heap's free pages were given back
        }

    # -- placement -----------------------------------------------------------

    # The pipeline is held by a weak reference: a cleaner sourced from another
    # pipeline (`source = ...` in a config, `add_pipe(source=...)`) is the source's
    # own object, and a strong one kept that whole pipeline (its transformer too) alive
    # for as long as the cleaner, e.g. for a whole `spacy train`.

    @property
    def _nlp(self) -> Optional[Language]:
        return self._nlp_ref() if self._nlp_ref is not None else None

    @_nlp.setter
    def _nlp(self, nlp: Optional[Language]) -> None:
        self._nlp_ref = weakref.ref(nlp) if nlp is not None else None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_nlp_ref"] = self._nlp  # pickled with its pipeline, as before
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        nlp = state.pop("_nlp_ref", None)
        self.__dict__.update(state)
        self._nlp_ref = None
        self._nlp = nlp

    def _follow_running_pipeline(self) -> None:
        """Check the placement in the pipeline that runs the cleaner. spaCy tells a
        component its pipeline only when its factory makes it (and at `initialize`); a
        sourced cleaner was made for its source pipeline, whose order was checked
        instead of the running one's (or none, once the source is gone). The running
        pipeline is the `Language` whose `__call__` or `pipe` is on the call stack and
        holds this cleaner: a look at a few frames per call of the cleaner."""
        frame = sys._getframe(2)
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return
            if frame.f_code in _LANGUAGE_CODES:
                nlp = frame.f_locals.get("self")
                if isinstance(nlp, Language) and nlp is not self._nlp:
                    if any(proc is self for _, proc in nlp.components):
                        self._nlp = nlp
                        self._checked = None
                        self._initialize_signature = None
                return
            frame = frame.f_back

    def _pipeline_signature(self) -> Optional[Tuple[Tuple[str, int, Any], ...]]:
        if self._nlp is None:
            return None
        # A component's `lean_assigns` (char_lm's `store`) can change in place.
        return tuple(
            (name, id(proc), _assigns_key(getattr(proc, "lean_assigns", None)))
            for name, proc in self._nlp.pipeline
        )

    def check_placement(self) -> None:
        """Raise a ValueError if the cleaner runs before a component that reads what
        it releases, and nothing sets that data again between the cleaner and that
        component; warn (once) about data it will not see. Called automatically on
        first use and whenever the pipeline changes."""
        signature = self._pipeline_signature()
        if signature is None or signature == self._checked:
            return
        # While the pipeline is as `initialize` saw it (spaCy's training disables its
        # frozen and sourced components then, and a ner or parser runs the components
        # before it on sample docs), the check is initialize's; after any change, it
        # is the strict one for good.
        lenient = signature == self._initialize_signature and bool(self._nlp.disabled)
        self._check(lenient=lenient)
        if not lenient:
            self._initialize_signature = None
        self._checked = signature

    def _check(self, lenient: bool) -> None:
        """The placement check. `lenient` (at `initialize`): disabled components count
        as producers that may run, since spaCy's training disables its frozen and
        sourced components while it initializes the others; disabled readers count
        where they are [training] frozen_components (they run when training
        evaluates); nothing is warned about."""
        nlp = self._nlp
        assert nlp is not None
        pipeline = list(nlp.pipeline)
        position = next((i for i, (_, proc) in enumerate(pipeline) if proc is self), None)
        if position is None:  # not (or no longer) part of this pipeline, or disabled
            return
        my_name = pipeline[position][0]
        names = [name for name, _ in pipeline]
        unknown = [c for c in self.cfg["consumers"] if c not in nlp.component_names]
        if unknown:
            raise ValueError(
                f"lean_cleaner '{my_name}': 'consumers' names {unknown}, which "
                f"{'is' if len(unknown) == 1 else 'are'} not in the pipeline "
                f"{nlp.component_names}. Fix the names or remove them from 'consumers'."
            )
        attrs = self._checked_attrs()
        running = readers = names
        if lenient:
            # Disabled producers may run; of disabled readers, the training's frozen
            # components will (a disabled reader otherwise may stay off for good).
            running = list(nlp.component_names)
            frozen = set(nlp.config.get("training", {}).get("frozen_components") or [])
            readers = [n for n in running if n in names or n in frozen]
        extra = [c for c in self.cfg["consumers"] if c in readers]
        # Disabled components do not run: a listener map may still name them.
        consumers = [
            c
            for c in find_consumers(nlp, attrs, extra=extra, names=running)
            if c.component in readers
        ]
        producers = self._producers(running, attrs)
        unmet = unmet_consumers(nlp, running, running.index(my_name), consumers, producers)
        if unmet:
            raise ValueError(self._misplaced_message(my_name, running, unmet, consumers))
        if lenient:
            return
        if self.cfg["trf_data"] or self.cfg["compact_vectors"]:
            if not self._producers(names, [TRF_DATA])[TRF_DATA]:
                what = ", ".join(a for a in self.released_attrs if a != TRF_DATA) or "nothing"
                self._warn_once(
                    "no-transformer",
                    f"lean_cleaner '{my_name}': the pipeline {names} has no component that "
                    f"sets doc._.trf_data (no spacy-transformers or spacy-curated-transformers "
                    f"transformer), so there is no transformer output to release"
                    + (" or to pool into compact vectors" if self.cfg["compact_vectors"] else "")
                    + f". It releases what there is: {what}.",
                )
        # Producers after the cleaner leave their data on the docs, unless another
        # cleaner that releases it runs after them.
        cleaners = [
            (i, proc) for i, (_, proc) in enumerate(pipeline) if isinstance(proc, LeanCleaner)
        ]
        late = set()
        for attr in attrs:
            for producer in producers[attr]:
                k = names.index(producer)
                if k > position and not any(
                    i > k and attr in proc._checked_attrs() for i, proc in cleaners
                ):
                    late.add(producer)
        if late:
            late_names = sorted(late)
            self._warn_once(
                f"late:{','.join(late_names)}",
                f"lean_cleaner '{my_name}' runs before {late_names}, which set(s) data it "
                "would release; that data stays on the docs. Put the cleaner last to release "
                "it, or add another lean_cleaner after them.",
            )

    def _checked_attrs(self) -> List[str]:
        """The attributes whose readers the placement check looks for."""
        attrs = [a for a in self.released_attrs if a in (TRF_DATA, TENSOR)]
        attrs += [f"doc._.{ext}" for ext in self.cfg["extensions"]]
        # Only `consumers` (or a factory's `requires` in this notation) read these.
        attrs += [f"doc.user_data[{key!r}]" for key in self.cfg["user_data_keys"]]
        return list(dict.fromkeys(attrs))

    def _producers(self, running: Sequence[str], attrs: Sequence[str]) -> Dict[str, List[str]]:
        """Attribute -> the components of `running` that set it. Cleaners are left out:
        their `lean_assigns` names what they reset, but they release data."""
        nlp = self._nlp
        assert nlp is not None
        found = find_producers(nlp, attrs, names=running)
        return {
            attr: [p for p in ps if not isinstance(nlp.get_pipe(p), LeanCleaner)]
            for attr, ps in found.items()
        }

    def _misplaced_message(
        self, my_name: str, names: List[str], unmet: List[Unmet], consumers: List[Consumer]
    ) -> str:
        first = unmet[0]
        consumer = first.consumer
        others = sorted({u.consumer.component for u in unmet} - {consumer.component})
        also = f" (and {others} too)" if others else ""
        if consumer.upstream is not None:
            effect = (
                f"'{consumer.component}' would predict from empty features (spaCy's and "
                "spacy-transformers' listeners silently fall back to zeros)"
            )
        else:
            empty = {TENSOR: "an empty array", TRF_DATA: "None"}.get(consumer.attr, "its default")
            effect = f"'{consumer.component}' would find {empty} there"
        # The first place after the last unmet consumer where nothing is unmet.
        target = self._safe_after(my_name, names, consumers, unmet)
        place = f"after '{target}'" if target else "last"
        changed = {k: v for k, v in self.cfg.items() if v != DEFAULT_CLEANER_CONFIG[k]}
        keep = f", config={changed!r}" if changed else ""
        how = (
            f"nlp.remove_pipe('{my_name}') then nlp.add_pipe('lean_cleaner', name='{my_name}'"
            + keep
            + (f", after='{target}')" if target else ") (it goes last by default)")
        )
        return (
            f"lean_cleaner '{my_name}' is component {names.index(my_name) + 1} of {len(names)} "
            f"in the pipeline {names}, but '{consumer.component}' runs after it and reads "
            f"{consumer.attr}: {consumer.reason}{also}. {first.detail[0].upper()}"
            f"{first.detail[1:]}. The cleaner would release "
            + (f"the data of '{first.producer}'" if first.producer else "it")
            + f" before '{consumer.component}' reads it: {effect}. Put the cleaner {place}: "
            f"{how}, or move it there in [nlp] pipeline in your config."
        )

    def _safe_after(
        self, my_name: str, names: List[str], consumers: List[Consumer], unmet: List[Unmet]
    ) -> Optional[str]:
        """The component after which the cleaner would be well placed, the first such
        place after the last unmet consumer; None for the end of the pipeline."""
        nlp = self._nlp
        assert nlp is not None
        last = max(names.index(u.consumer.component) for u in unmet)
        attrs = self._checked_attrs()
        others = [n for n in names if n != my_name]
        for anchor in names[last:]:
            if anchor == my_name:
                continue
            order = list(others)
            order.insert(order.index(anchor) + 1, my_name)
            producers = self._producers(order, attrs)
            if not unmet_consumers(nlp, order, order.index(my_name), consumers, producers):
                return None if anchor == others[-1] else anchor
        return None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, LeanCleanerWarning, stacklevel=caller_stacklevel())

    # -- processing ----------------------------------------------------------

    def __call__(self, doc: Doc) -> Doc:
        """Release the configured data from one doc, in place.

        doc (Doc): the doc.
        RETURNS (Doc): the same doc.
        """
        self._follow_running_pipeline()
        self.check_placement()
        self._clean(doc)
        return doc

    def pipe(self, stream: Iterable[Doc], *, batch_size: int = 128) -> Iterator[Doc]:
        """Release the configured data from a stream of docs, in place.

        stream (Iterable[Doc]): the docs.
        batch_size (int): unused; the cleaner works doc by doc.
        YIELDS (Doc): the docs, in order.
        """
        self._follow_running_pipeline()
        self.check_placement()
        for doc in stream:
            self._clean(doc)
            yield doc

    def initialize(self, get_examples=None, *, nlp: Optional[Language] = None) -> None:
        """Check the placement when the pipeline is initialized (`nlp.initialize`).
        Disabled components count as components that may run (spaCy's training
        disables its frozen and sourced ones while it initializes the others); the
        first call checks the pipeline as it runs.

        nlp (Optional[Language]): the pipeline being initialized; it becomes the one
            the cleaner checks (a sourced cleaner was made for its source pipeline).
        """
        if nlp is not None:
            self._nlp = nlp
        # spaCy's training initializes with the frozen and sourced components disabled
        # (`init_nlp`): they count as running here, and the first call checks the
        # pipeline as it runs.
        self._checked = None
        if self._nlp is not None:
            self._check(lenient=True)
            self._initialize_signature = self._pipeline_signature()

    def _clean(self, doc: Doc) -> None:
        cfg = self.cfg
        stats = self.stats
        user_data = doc.user_data
        released = 0
        nbytes = 0
        compact = None
        trf_key = ("._.", "trf_data", None, None)
        trf_value = user_data.get(trf_key)
        if trf_value is not None and cfg["compact_vectors"]:
            compact = self._pool(doc, trf_value)
        if trf_value is not None and cfg["trf_data"]:
            # Removing the key brings back the extension's default (None).
            del user_data[trf_key]
            nbytes += _nbytes(trf_value)
            stats["trf_data"] += 1
            released += 1
        if cfg["tensor"] or compact is not None:
            tensor = doc.tensor
            if tensor is not None and getattr(tensor, "size", 0):
                nbytes += _nbytes(tensor)
                stats["tensor"] += 1
                released += 1
            doc.tensor = compact if compact is not None else numpy.zeros((0,), dtype="float32")
            if compact is not None:
                stats["compact_bytes"] += compact.nbytes
        for ext in cfg["extensions"]:
            value = user_data.pop(("._.", ext, None, None), None)
            if value is not None:
                nbytes += _nbytes(value)
                stats["extensions"] += 1
                released += 1
        for key in cfg["user_data_keys"]:
            value = user_data.pop(key, None)
            if value is not None:
                nbytes += _nbytes(value)
                stats["user_data"] += 1
                released += 1
        del trf_value
        stats["docs"] += 1
        stats["released_bytes"] += nbytes
        if released:
            stats["released_docs"] += 1
        every = cfg["empty_cache_every"]
        if every:
            self._since_empty += 1
            if self._since_empty >= every:
                self._since_empty = 0
                empty_gpu_caches()
                stats["cache_empties"] += 1
        every = cfg["trim_memory_every"]
        if every:
            self._since_trim += 1
            if self._since_trim >= every:
                self._since_trim = 0
                trim_host_memory()
                stats["memory_trims"] += 1

    def _pool(self, doc: Doc, data: Any) -> Optional[numpy.ndarray]:
        """Mean of each token's wordpiece rows of the last hidden layer, on CPU."""
        dtype = self.cfg["compact_vectors"]
        rows_lengths = _token_rows(data)
        if rows_lengths is None:
            self._warn_once(
                f"unknown:{type(data).__name__}",
                f"lean_cleaner '{self.name}': doc._.trf_data holds a "
                f"{type(data).__module__}.{type(data).__name__}, which it cannot pool into "
                "compact vectors; no compact vectors are kept for such docs.",
            )
            return None
        rows, lengths = rows_lengths
        if rows is None:
            # An empty doc: the transformer produced nothing for it, not even its
            # width. Give it the width of the other docs, so that every doc's tensor
            # has the same number of columns (numpy.concatenate, stacking).
            return numpy.zeros((len(doc), self._output_width()), dtype=dtype)
        self._compact_width = int(rows.shape[-1])
        if rows.shape[0] == 0:  # only whitespace tokens: no wordpiece to pool (zeros)
            return numpy.zeros((len(doc), rows.shape[-1]), dtype=dtype)
        ops = get_array_ops(rows)
        pooled = ops.reduce_mean(ops.asarray2f(rows), ops.asarray1i(lengths))
        return numpy.ascontiguousarray(ops.to_numpy(pooled), dtype=dtype)

    def _output_width(self) -> int:
        """Width of the compact vectors: that of the last doc pooled, else the `nO`
        of the nearest transformer before the cleaner (0 when neither is known)."""
        if self._compact_width is not None:
            return self._compact_width
        nlp = self._nlp
        if nlp is None:
            return 0
        names = [name for name, _ in nlp.pipeline]
        mine = next((i for i, (_, proc) in enumerate(nlp.pipeline) if proc is self), len(names))
        producers = set(self._producers(names[:mine], [TRF_DATA])[TRF_DATA])
        for name in reversed(names[:mine]):
            model = getattr(nlp.get_pipe(name), "model", None)
            if name in producers and model is not None and model.has_dim("nO"):
                try:
                    width = model.get_dim("nO")
                except ValueError:  # declared but not set
                    continue
                if width:
                    return int(width)
        return 0

    # -- serialization -------------------------------------------------------

    def to_bytes(self, *, exclude: Iterable[str] = tuple()) -> bytes:
        """Serialize the settings to a bytestring.

        RETURNS (bytes): the serialized settings.
        """
        serializers = {"cfg": lambda: srsly.json_dumps(self.cfg)}
        return util.to_bytes(serializers, exclude)

    def from_bytes(self, bytes_data: bytes, *, exclude: Iterable[str] = tuple()) -> "LeanCleaner":
        """Load the settings from a bytestring.

        RETURNS (LeanCleaner): the cleaner.
        """
        deserializers = {"cfg": lambda b: self._load_cfg(srsly.json_loads(b))}
        util.from_bytes(bytes_data, deserializers, exclude)
        return self

    def to_disk(self, path: Union[str, Path], *, exclude: Iterable[str] = tuple()) -> None:
        """Save the settings to a directory.

        path (str / Path): the directory.
        """
        path = util.ensure_path(path)
        serializers = {"cfg": lambda p: srsly.write_json(p, self.cfg)}
        util.to_disk(path, serializers, exclude)

    def from_disk(
        self, path: Union[str, Path], *, exclude: Iterable[str] = tuple()
    ) -> "LeanCleaner":
        """Load the settings from a directory.

        path (str / Path): the directory.
        RETURNS (LeanCleaner): the cleaner.
        """
        path = util.ensure_path(path)
        deserializers = {"cfg": lambda p: self._load_cfg(srsly.read_json(p))}
        util.from_disk(path, deserializers, exclude)
        return self

    def _load_cfg(self, saved: Dict[str, Any]) -> None:
        """Take the settings of the config.cfg being loaded, where it has this
        component: `Language.from_disk`/`from_bytes` read config.cfg (with a load's
        overrides) before the components, so a load-time override (`spacy.load(path,
        config=...)`) or an edited config.cfg is used, as `nlp.config` says. The saved
        `cfg` file serves where there is no such block (a cleaner used on its own)."""
        settings = self._loaded_config_settings()
        self.cfg = self._validate_cfg(dict(saved if settings is None else settings))
        self._checked = None

    def _loaded_config_settings(self) -> Optional[Dict[str, Any]]:
        """This component's settings in the config its pipeline holds: the config.cfg
        just read by `from_disk`/`from_bytes`. Read from `Language._config`, not the
        `config` property, which rebuilds the components' blocks from the settings
        they were made with."""
        config = getattr(self._nlp, "_config", None)
        try:
            block = config["components"][self.name]
        except (KeyError, TypeError):
            return None
        if not isinstance(block, dict) or block.get("factory") != "lean_cleaner":
            return None
        settings = {k: block[k] for k in _CFG_KEYS if k in block}
        if "${" in srsly.json_dumps(settings):  # a variable, also inside a list
            try:  # read with interpolate=False: resolve the variables
                block = Config(config).interpolate()["components"][self.name]
            except Exception:  # noqa: BLE001 - unresolvable: the saved settings
                return None
            settings = {k: block[k] for k in _CFG_KEYS if k in block}
        return settings


def _assigns_key(declared: Any) -> Any:
    """A hashable form of a component's `lean_assigns` (None where it has none)."""
    if isinstance(declared, (list, tuple)):
        return tuple(str(a) for a in declared)
    return None


def _token_rows(data: Any) -> Optional[Tuple[Any, Any]]:
    """Return (wordpiece rows, wordpieces per token) for the last hidden layer of a
    doc's transformer output; (None, None) when the doc got no output; None for an
    unknown type. Duck-typed, so neither transformer package has to be imported."""
    if hasattr(data, "model_output") and hasattr(data, "align"):
        # spacy-transformers' TransformerData: the last hidden state has shape
        # (n_spans, n_wordpieces, width); `align` maps each token to rows of it
        # flattened to (n_spans * n_wordpieces, width).
        if "last_hidden_state" not in data.model_output:
            return None, None
        hidden = data.model_output["last_hidden_state"]
        if hidden.size == 0:
            return None, None
        flat = hidden.reshape(-1, hidden.shape[-1])
        ops = get_array_ops(flat)
        rows = flat[ops.asarray1i(data.align.dataXd.reshape(-1))]
        return rows, data.align.lengths
    if hasattr(data, "last_hidden_layer_state") and hasattr(data, "all_outputs"):
        # spacy-curated-transformers' DocTransformerOutput: a Ragged with one
        # segment of piece rows per token.
        if not data.all_outputs:
            return None, None
        layer = data.last_hidden_layer_state
        return layer.dataXd, layer.lengths
    return None


def _nbytes(obj: Any, _depth: int = 0) -> int:
    """Bytes held in the arrays of `obj` (numpy, cupy, torch, Ragged, and containers
    and dataclasses of them). Views count their own size, not their base's."""
    if obj is None or _depth > 8:
        return 0
    if isinstance(obj, Ragged):
        return _nbytes(obj.data, _depth + 1) + _nbytes(obj.lengths, _depth + 1)
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if hasattr(obj, "element_size") and hasattr(obj, "nelement"):  # torch.Tensor
        return int(obj.element_size() * obj.nelement())
    if isinstance(obj, (str, bytes, int, float, bool)):
        return 0
    if isinstance(obj, dict):
        return sum(_nbytes(v, _depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v, _depth + 1) for v in obj)
    fields = getattr(obj, "__dataclass_fields__", None)
    if fields is not None:
        return sum(_nbytes(getattr(obj, f, None), _depth + 1) for f in fields)
    if hasattr(obj, "__dict__"):
        return sum(_nbytes(v, _depth + 1) for v in vars(obj).values())
    return 0
