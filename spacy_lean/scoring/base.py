"""Building blocks shared by the mergeable score states.

A score state reduces examples to counts (`update`), adds another state's counts
to its own (`merge`), turns its counts into the numbers spaCy's scorer reports
(`result`) and round-trips through JSON (`to_dict` / `load_dict`).
"""

from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy
from spacy.attrs import LENGTH, ORTH
from spacy.scorer import PRFScore
from spacy.training import Example


class ScoreState:
    """Base class of every mergeable score state.

    Subclasses keep only counts (no docs, no examples) and implement `update`,
    `_merge`, `result`, `to_dict` and `load_dict`.
    """

    #: A short name stored in `to_dict`, checked on `load_dict`.
    kind: str = "state"
    #: The settings that make two states of one class count different things (the
    #: attribute scored, ...): `merge` refuses another state whose settings differ,
    #: and `load_dict` counts whose saved settings do.
    settings: Tuple[str, ...] = ()

    def update(self, examples: Iterable[Example]) -> None:
        """Reduce examples whose `.predicted` is already processed to counts.

        examples (Iterable[Example]): The examples to count.
        """
        raise NotImplementedError

    def prepare(self, examples: Sequence[Example]) -> None:
        """Called with each batch's examples right after the pipeline made them, while
        their docs still hold the batch's activations (`doc.tensor`, `doc._.trf_data`),
        which the streaming evaluator releases next. A state whose scorer runs a
        component again (an entity_linker's scorer with `use_gold_ents`) does that here;
        `update` comes later, with the whole read-ahead window in data order.

        examples (Sequence[Example]): One batch, its `.predicted` docs processed.
        """

    def merge(self, other: "ScoreState") -> "ScoreState":
        """Add the counts of `other` to this state, in place. `other` is taken to
        hold examples that come *after* this state's examples: where a result keeps
        first-appearance order (per-type dicts), merging in data order reproduces
        the order a single pass gives.

        other (ScoreState): A state of the same kind and configuration.
        RETURNS (ScoreState): self.
        """
        if type(other) is not type(self):
            raise TypeError(
                f"Cannot merge a {type(other).__name__} into a {type(self).__name__}: "
                "states must come from the same scorer and configuration."
            )
        differ = [k for k in self.settings if not _same(getattr(self, k), getattr(other, k))]
        if differ:
            theirs = ", ".join(f"{k}={getattr(other, k)!r}" for k in differ)
            mine = ", ".join(f"{k}={getattr(self, k)!r}" for k in differ)
            raise ValueError(
                f"Cannot merge a {type(other).__name__} with {theirs} into one with "
                f"{mine}: states must come from the same scorer and configuration."
            )
        self._merge(other)
        return self

    def _merge(self, other: "ScoreState") -> None:
        raise NotImplementedError

    def result(self) -> Dict[str, Any]:
        """RETURNS (Dict[str, Any]): The scores, as spaCy's scorer reports them."""
        raise NotImplementedError

    def to_dict(self) -> Dict[str, Any]:
        """RETURNS (Dict[str, Any]): The counts, JSON-serialisable."""
        raise NotImplementedError

    def _saved_settings(self) -> Dict[str, Any]:
        """The `settings`, as `to_dict` saves them (checked by `load_dict`)."""
        return {key: _jsonable(getattr(self, key)) for key in self.settings}

    def load_dict(self, data: Dict[str, Any]) -> "ScoreState":
        """Replace this state's counts by those in `data` (from `to_dict`).

        data (Dict[str, Any]): The output of `to_dict` of a state of the same kind.
        RETURNS (ScoreState): self.
        """
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: Dict[str, Any], **cfg) -> "ScoreState":
        """Build a state with the scorer settings `cfg` and load counts into it.

        data (Dict[str, Any]): The output of `to_dict`.
        **cfg: The scorer settings the state was created with.
        RETURNS (ScoreState): The restored state.
        """
        return cls(**cfg).load_dict(data)

    def _check_kind(self, data: Dict[str, Any]) -> None:
        kind = data.get("kind") if isinstance(data, dict) else None
        if kind != self.kind:
            raise ValueError(
                f"Cannot load counts of kind {kind!r} into a {type(self).__name__} "
                f"(kind {self.kind!r}). Restore the state with the pipeline and scorer "
                "settings it was saved with."
            )
        for key in self.settings:  # those `to_dict` saves (states saved before not)
            if key in data and not _same(data[key], _jsonable(getattr(self, key))):
                saved = data[key]
                if isinstance(getattr(self, key), float) and isinstance(saved, str):
                    try:
                        saved = float.fromhex(saved)
                    except ValueError:
                        pass
                raise ValueError(
                    f"Cannot load counts of {key} {saved!r} into a "
                    f"{type(self).__name__} of {key} {getattr(self, key)!r}. Restore the "
                    "state with the pipeline and scorer settings it was saved with."
                )


def _jsonable(value: Any) -> Any:
    """A setting as JSON keeps it: tuples as lists, floats exactly (hex strings, NaN
    and infinities included)."""
    if isinstance(value, float):
        return float_to_json(value)
    return list(value) if isinstance(value, tuple) else value


def _same(a: Any, b: Any) -> bool:
    """Equal settings, NaN equal to NaN (a threshold of NaN is one setting)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


# -- PRF counts ---------------------------------------------------------------


def prf_copy(prf: PRFScore) -> PRFScore:
    return PRFScore(tp=prf.tp, fp=prf.fp, fn=prf.fn)


def prf_to_list(prf: PRFScore) -> List[int]:
    return [int(prf.tp), int(prf.fp), int(prf.fn)]


# -- Loading saved counts --------------------------------------------------------
# A saved state is data from a file (an evaluation checkpoint): each value is checked
# as it is loaded, and a bad one raises `StateFieldError` naming the field, so that an
# edited or damaged checkpoint is refused instead of giving impossible scores (a
# negative true-positive count gave an F-score of -7.6).


class StateFieldError(ValueError):
    """A saved score state holds a value `to_dict` never writes."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        shown = repr(value) if isinstance(value, (bool, int, float, str, type(None))) else None
        shown = shown[:60] if shown is not None else f"a {type(value).__name__}"
        super().__init__(f"{field} = {shown}, expected {expected}")
        self.field = field
        self.value = value
        self.expected = expected

    def within(self, prefix: str) -> "StateFieldError":
        """The same error, its field named from an enclosing state."""
        return StateFieldError(f"{prefix}.{self.field}", self.value, self.expected)


def count_from_json(value: Any, field: str) -> int:
    """A saved count: a whole number >= 0 (a bool is not one)."""
    if type(value) is not int or value < 0:
        raise StateFieldError(field, value, "a whole number >= 0")
    return value


def list_from_json(value: Any, field: str, length: Optional[int] = None) -> List[Any]:
    """A saved JSON array (of `length` items when given)."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        expected = f"a list of {length} values" if length is not None else "a list"
        raise StateFieldError(field, value, expected)
    return value


def label_from_json(value: Any, field: str) -> Any:
    """A saved label: a string, or an int where the scorer's getter gives hashes."""
    if type(value) not in (str, int):
        raise StateFieldError(field, value, "a label (a string or an int)")
    return value


def prf_from_list(values: Sequence[int], field: str = "counts") -> PRFScore:
    tp, fp, fn = (
        count_from_json(v, f"{field}[{i}]") for i, v in enumerate(list_from_json(values, field, 3))
    )
    return PRFScore(tp=tp, fp=fp, fn=fn)


def prf_add_counts(prf: PRFScore, tp: int, fp: int, fn: int) -> None:
    prf.tp += int(tp)
    prf.fp += int(fp)
    prf.fn += int(fn)


def merge_ordered_prf(mine: Dict[Any, PRFScore], theirs: Dict[Any, PRFScore]) -> None:
    """Add `theirs` into `mine`: shared keys are summed, keys new to `mine` are
    appended in `theirs`' order (an ordered union, which is associative)."""
    for key, prf in theirs.items():
        if key in mine:
            mine[key] += prf
        else:
            mine[key] = prf_copy(prf)


def per_type_to_list(per_type: Dict[str, PRFScore]) -> List[List[Any]]:
    return [[key, *prf_to_list(prf)] for key, prf in per_type.items()]


def labelled_rows(rows: Any, field: str, width: int) -> Iterator[Tuple[str, Any, List[Any]]]:
    """(where, label, row) for each saved `[label, ...]` row of `width` values, each
    label listed once (as in the dict the rows were written from)."""
    seen = set()
    for i, row in enumerate(list_from_json(rows, field)):
        where = f"{field}[{i}]"
        label = label_from_json(list_from_json(row, where, width)[0], f"{where}[0]")
        if label in seen:
            raise StateFieldError(f"{where}[0]", label, "a label not listed before")
        seen.add(label)
        yield where, label, row


def per_type_from_list(
    rows: Iterable[Sequence[Any]], field: str = "per_type"
) -> Dict[str, PRFScore]:
    per_type: Dict[str, PRFScore] = {}
    for where, label, row in labelled_rows(rows, field, 4):
        tp, fp, fn = (count_from_json(row[j], f"{where}[{j}]") for j in (1, 2, 3))
        per_type[label] = PRFScore(tp=tp, fp=fp, fn=fn)
    return per_type


def prf_dicts(per_type: Dict[str, PRFScore]) -> Dict[str, Dict[str, float]]:
    return {key: prf.to_dict() for key, prf in per_type.items()}


# -- Floats in JSON ------------------------------------------------------------
# srsly.json_dumps keeps 10 significant digits, so floats whose exact value
# matters (scores for ROC AUC, timings) travel as hex strings (which also hold inf
# and nan, where strict JSON cannot).


def float_to_json(value: float) -> str:
    return float(value).hex()


def float_from_json(value: Any, field: str = "value") -> float:
    if isinstance(value, str):
        try:
            return float.fromhex(value)
        except ValueError:
            raise StateFieldError(field, value, "a float (hex string)") from None
    if type(value) not in (int, float):
        raise StateFieldError(field, value, "a float")
    return float(value)


def callable_name(obj: Any) -> str:
    """A stable description of a callable, for fingerprints and messages."""
    func = getattr(obj, "func", None)  # functools.partial
    if func is not None and hasattr(obj, "keywords"):
        kw = ", ".join(f"{k}={v!r}" for k, v in sorted(obj.keywords.items()))
        return f"partial({callable_name(func)}, {kw})"
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if name is None:
        return type(obj).__qualname__
    return f"{module}.{name}" if module else name


def describe_value(value: Any) -> Any:
    """A JSON-friendly, stable description of a scorer setting."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return float_to_json(value)
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return {str(k): describe_value(v) for k, v in items}
    if isinstance(value, (list, tuple)):
        return [describe_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((describe_value(v) for v in value), key=repr)
    if callable(value):
        return f"<callable {callable_name(value)}>"
    text = repr(value)
    if " at 0x" in text:  # a default repr: the address differs between runs
        return f"<{type(value).__module__}.{type(value).__qualname__}>"
    return f"<{type(value).__qualname__} {text}>"


def is_default_getter(getter: Optional[Any]) -> bool:
    return getter is None or getter is getattr


class IdentityAlignment:
    """The `x2y` (or `y2x`) alignment array of an example whose predicted and
    reference docs have the same tokens: token i aligns with token i alone. Indexes
    like spaCy's `AlignmentArray` (an int or a slice gives an int32 array)."""

    def __init__(self, n: int) -> None:
        self.data = numpy.arange(n, dtype="int32")
        self.lengths = numpy.ones((n,), dtype="int32")
        self.starts = self.data
        self.ends = self.data + 1

    def __getitem__(self, idx: Any) -> numpy.ndarray:
        if isinstance(idx, slice):
            if not (idx.step is None or idx.step == 1):
                raise ValueError("Only slices with step 1 are supported.")
            return self.data[idx]
        return self.data[idx : idx + 1] if idx != -1 else self.data[idx:]

    def __len__(self) -> int:
        return self.data.shape[0]


def aligned_x2y(example: Example) -> Any:
    """`example.alignment.x2y`, without aligning when the predicted and reference docs
    have the same tokens (the usual case: the pipeline's tokenizer made both), which
    spaCy would find by walking both docs' characters in Python.

    Tokens are the same when both docs have the same token strings (their ORTH ids)
    and none is empty; spaCy's character alignment is then the identity.
    """
    pred, ref = example.predicted, example.reference
    if len(pred) == len(ref):
        if len(pred) == 0:
            return IdentityAlignment(0)
        ours = pred.to_array([ORTH, LENGTH])
        if numpy.array_equal(ours, ref.to_array([ORTH, LENGTH])) and ours[:, 1].min() > 0:
            return IdentityAlignment(len(pred))
    return example.alignment.x2y


Counts = Tuple[int, int, int]
