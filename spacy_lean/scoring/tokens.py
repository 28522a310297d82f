"""Mergeable twins of spaCy's token-level scorers: tokenization, token attributes
(`tag_acc`, `pos_acc`, `morph_acc`, `lemma_acc`, ...) and morphological features per
field (`morph_micro_*`, `morph_per_feat`).

Counting works on whole-doc numpy arrays (`Doc.to_array` and the example's
alignment arrays); Python runs per distinct value, not per token, unless a custom
getter is configured.
"""

from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy
from spacy.attrs import IDX, IS_SPACE, LENGTH, LEMMA, MORPH, POS, TAG, DEP
from spacy.morphology import Morphology
from spacy.scorer import MISSING_VALUES, PRFScore
from spacy.tokens import Doc, Token
from spacy.training import Example

from .base import (
    aligned_x2y,
    ScoreState,
    merge_ordered_prf,
    per_type_from_list,
    per_type_to_list,
    prf_add_counts,
    prf_dicts,
    prf_from_list,
    prf_to_list,
)


def morph_key_getter(token: Token, attr: str) -> int:
    """The getter spaCy's morphologizer scorer uses: the hash of the morph."""
    return getattr(token, attr).key


# Attributes whose `getattr(token, attr)` equals `doc.to_array(ID)`.
_ARRAY_ATTRS = {"tag": TAG, "pos": POS, "lemma": LEMMA, "dep": DEP}


def _is_default_missing(missing_values: Any) -> bool:
    try:
        return set(missing_values) == set(MISSING_VALUES)
    except TypeError:  # pragma: no cover - unhashable custom values
        return False


def _array_id(attr: str, getter: Callable) -> Optional[int]:
    if getter is getattr and attr in _ARRAY_ATTRS:
        return _ARRAY_ATTRS[attr]
    if getter is morph_key_getter and attr == "morph":
        return MORPH
    return None


def token_values(
    doc: Doc, attr: str, getter: Callable, missing_values: Any
) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """Values of `getter(token, attr)` for every token and a mask of the tokens
    whose value is missing. Uses `Doc.to_array` when the getter allows it.

    RETURNS (Tuple[ndarray, ndarray]): values (uint64 or object) and missing mask.
    """
    attr_id = _array_id(attr, getter)
    if attr_id is not None and _is_default_missing(missing_values):
        values = doc.to_array(attr_id)
        if values.ndim == 0:  # pragma: no cover - empty docs
            values = values.reshape((0,))
        return values, values == 0
    values = numpy.empty(len(doc), dtype=object)
    missing = numpy.zeros(len(doc), dtype=bool)
    for i, token in enumerate(doc):
        value = getter(token, attr)
        values[i] = value
        missing[i] = value in missing_values
    return values, missing


def aligned_single(example: Example) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """For each predicted token: whether it aligns to exactly one reference token,
    and that reference token's index (-1 where it does not).

    RETURNS (Tuple[ndarray, ndarray]): bool mask and int64 gold indices.
    """
    x2y = aligned_x2y(example)
    n = len(example.predicted)
    single = predicted_lengths(example, x2y) == 1
    gold_i = numpy.full(n, -1, dtype=numpy.int64)
    if single.any():
        gold_i[single] = numpy.asarray(x2y.data)[numpy.asarray(x2y.starts)[:n][single]]
    return single, gold_i


def predicted_lengths(example: Example, x2y: Any = None) -> numpy.ndarray:
    """How many reference tokens each predicted token aligns to. spaCy's alignment can
    hold one entry more than the predicted doc has tokens (a reference ending in a
    whitespace token with a trailing space, merged into one token by the tokenizer:
    `["Hello", " "]` with spaces gives lengths [1, 1, 0]); spaCy's scorers index it by
    token, so the extra entry is never read, and it is cut off here."""
    x2y = aligned_x2y(example) if x2y is None else x2y
    return numpy.asarray(x2y.lengths)[: len(example.predicted)]


def space_mask(doc: Doc) -> numpy.ndarray:
    if len(doc) == 0:
        return numpy.zeros((0,), dtype=bool)
    return doc.to_array(IS_SPACE).reshape((len(doc),)) != 0


def _concat(arrays: List[numpy.ndarray]) -> numpy.ndarray:
    """Concatenate value arrays; object arrays stay object arrays."""
    if any(a.dtype == object for a in arrays):
        out = numpy.empty(sum(a.shape[0] for a in arrays), dtype=object)
        pos = 0
        for a in arrays:
            out[pos : pos + a.shape[0]] = a
            pos += a.shape[0]
        return out
    return numpy.concatenate(arrays)


def _unique_count(gold_i: numpy.ndarray) -> bool:
    return numpy.unique(gold_i).shape[0] == gold_i.shape[0]


class TokenizationState(ScoreState):
    """Mergeable twin of `Scorer.score_tokenization`: `token_acc`, `token_p/r/f`.
    Docs whose reference has unknown spaces are skipped, as in spaCy."""

    kind = "tokenization"
    _max_code = 2**62

    def __init__(self, **cfg) -> None:
        self.acc = PRFScore()
        self.prf = PRFScore()

    def update(self, examples: Iterable[Example]) -> None:
        # One set of numpy operations per batch: a token's (start, end) offsets
        # are coded together with its doc's position in the batch, so sets never
        # mix docs.
        gold_parts, pred_parts, lengths = [], [], []
        base = 1
        for eg in examples:
            if eg.reference.has_unknown_spaces:
                continue
            gold, _ = self._spans(eg.reference)
            pred, pred_keep = self._spans(eg.predicted)
            gold_parts.append(gold)
            pred_parts.append(pred)
            lengths.append(predicted_lengths(eg)[pred_keep])
            for spans in (gold, pred):
                if spans.shape[0]:
                    base = max(base, int(spans[:, 1].max()) + 1)
        if not lengths:
            return
        lengths_all = numpy.concatenate(lengths)
        n_one = int((lengths_all == 1).sum())
        prf_add_counts(self.acc, n_one, lengths_all.shape[0] - n_one, 0)
        # Keep codes (k * base + start) * base + end below _max_code.
        chunk = max(1, self._max_code // (base * base))
        for lo in range(0, len(gold_parts), chunk):
            gold_spans = self._codes(gold_parts[lo : lo + chunk], base)
            pred_spans = self._codes(pred_parts[lo : lo + chunk], base)
            tp = numpy.intersect1d(pred_spans, gold_spans, assume_unique=True).shape[0]
            prf_add_counts(self.prf, tp, pred_spans.shape[0] - tp, gold_spans.shape[0] - tp)

    @staticmethod
    def _spans(doc: Doc) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """(start, end) character offsets of the non-space tokens as (n, 2) int64,
        and the mask of non-space tokens."""
        if len(doc) == 0:
            return numpy.zeros((0, 2), dtype=numpy.int64), numpy.zeros((0,), dtype=bool)
        arr = doc.to_array([IDX, LENGTH, IS_SPACE]).astype(numpy.int64)
        keep = arr[:, 2] == 0
        arr = arr[keep]
        return numpy.stack([arr[:, 0], arr[:, 0] + arr[:, 1]], axis=1), keep

    @staticmethod
    def _codes(parts: List[numpy.ndarray], base: int) -> numpy.ndarray:
        codes = [(k * base + p[:, 0]) * base + p[:, 1] for k, p in enumerate(parts)]
        return numpy.unique(numpy.concatenate(codes))

    def _merge(self, other: "TokenizationState") -> None:
        self.acc += other.acc
        self.prf += other.prf

    def result(self) -> Dict[str, Any]:
        if len(self.acc) == 0:
            return {"token_acc": None, "token_p": None, "token_r": None, "token_f": None}
        return {
            "token_acc": self.acc.precision,
            "token_p": self.prf.precision,
            "token_r": self.prf.recall,
            "token_f": self.prf.fscore,
        }

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "acc": prf_to_list(self.acc), "prf": prf_to_list(self.prf)}

    def load_dict(self, data: Dict[str, Any]) -> "TokenizationState":
        self._check_kind(data)
        self.acc = prf_from_list(data["acc"], "acc")
        self.prf = prf_from_list(data["prf"], "prf")
        return self


class TokenAttrState(ScoreState):
    """Mergeable twin of `Scorer.score_token_attr`: `{attr}_acc`.

    attr (str): The token attribute, e.g. "tag".
    getter (Callable[[Token, str], Any]): Returns a token's value. Defaults to getattr.
    missing_values (Set[Any]): Reference values that mean "not annotated".
    """

    kind = "token_attr"
    settings = ("attr",)

    def __init__(
        self,
        attr: str,
        *,
        getter: Callable[[Token, str], Any] = getattr,
        missing_values: Set[Any] = MISSING_VALUES,
        **cfg,
    ) -> None:
        self.attr = attr
        self.getter = getter
        self.missing_values = missing_values
        self.score = PRFScore()

    def update(self, examples: Iterable[Example]) -> None:
        # Per doc: arrays only. Per batch: the counting, with reference indices
        # offset by doc so that (index, value) pairs never mix docs.
        gold_vals, gold_missing, pred_gi, pred_vals = [], [], [], []
        offset = 0
        for eg in examples:
            g_vals, g_missing = token_values(
                eg.reference, self.attr, self.getter, self.missing_values
            )
            single, gold_i = aligned_single(eg)
            sel = single & ~space_mask(eg.predicted)
            if sel.any():
                p_vals, _ = token_values(eg.predicted, self.attr, self.getter, self.missing_values)
                gi = gold_i[sel]
                keep = ~g_missing[gi]
                pred_gi.append(gi[keep] + offset)
                pred_vals.append(p_vals[sel][keep])
            gold_vals.append(g_vals)
            gold_missing.append(g_missing)
            offset += len(eg.reference)
        if not gold_vals:
            return
        n_gold = int(sum(int((~m).sum()) for m in gold_missing))
        if not pred_gi:
            prf_add_counts(self.score, 0, 0, n_gold)
            return
        g_all = _concat(gold_vals)
        gi = numpy.concatenate(pred_gi)
        pv = _concat(pred_vals)
        if _unique_count(gi):
            n_pred = gi.shape[0]
            tp = int((pv == g_all[gi]).sum()) if n_pred else 0
        else:
            # Two predicted tokens inside one reference token: the pairs form
            # a set, as in spaCy, so equal pairs count once.
            pairs = set(zip(gi.tolist(), pv.tolist()))
            n_pred = len(pairs)
            gold_list = g_all.tolist()
            tp = sum(1 for i, v in pairs if gold_list[i] == v)
        prf_add_counts(self.score, tp, n_pred - tp, n_gold - tp)

    def _merge(self, other: "TokenAttrState") -> None:
        self.score += other.score

    def result(self) -> Dict[str, Any]:
        key = f"{self.attr}_acc"
        return {key: None if len(self.score) == 0 else self.score.fscore}

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "attr": self.attr, "score": prf_to_list(self.score)}

    def load_dict(self, data: Dict[str, Any]) -> "TokenAttrState":
        self._check_kind(data)
        self.score = prf_from_list(data["score"], "score")
        return self


class TokenAttrPerFeatState(ScoreState):
    """Mergeable twin of `Scorer.score_token_attr_per_feat`: micro P/R/F over
    UFEATS features and P/R/F per feature field (`{attr}_per_feat`, in order of
    first appearance).

    attr (str): The token attribute, e.g. "morph".
    getter (Callable[[Token, str], Any]): Returns the hash or string of a token's
        features. Defaults to getattr.
    missing_values (Set[Any]): Reference values that mean "not annotated".
    """

    kind = "token_attr_per_feat"
    settings = ("attr",)

    def __init__(
        self,
        attr: str,
        *,
        getter: Callable[[Token, str], Any] = getattr,
        missing_values: Set[Any] = MISSING_VALUES,
        **cfg,
    ) -> None:
        self.attr = attr
        self.getter = getter
        self.missing_values = missing_values
        self.micro = PRFScore()
        self.per_feat: Dict[str, PRFScore] = {}
        self._feats_cache: Dict[Any, Optional[Tuple[Tuple[str, str], ...]]] = {}

    def _feats(self, doc: Doc, value: Any) -> Optional[Tuple[Tuple[str, str], ...]]:
        """(field, feat) pairs of a value, or None where it counts as missing."""
        cached = self._feats_cache.get(value, False)
        if cached is not False:
            return cached
        if value in self.missing_values:
            feats = None
        else:
            morph = doc.vocab.strings[value]
            if morph == Morphology.EMPTY_MORPH:
                feats = None
            else:
                feats = tuple(
                    (feat.split(Morphology.FIELD_SEP)[0], feat)
                    for feat in morph.split(Morphology.FEATURE_SEP)
                )
        self._feats_cache[value] = feats
        return feats

    def update(self, examples: Iterable[Example]) -> None:
        # Per doc: arrays. Per batch: one coding of the distinct values, counts per
        # distinct (predicted, reference) pair, Python per distinct value only.
        examples = list(examples)
        if not examples:
            return
        gold_vals, gold_doc, pred_vals, pred_gi, pred_doc = [], [], [], [], []
        offset = 0
        for k, eg in enumerate(examples):
            g_vals, _ = token_values(eg.reference, self.attr, self.getter, self.missing_values)
            gold_vals.append(g_vals)
            gold_doc.append(numpy.full(g_vals.shape[0], k, dtype=numpy.int64))
            single, gold_i = aligned_single(eg)
            sel = single & ~space_mask(eg.predicted)
            if sel.any():
                p_vals, _ = token_values(eg.predicted, self.attr, self.getter, self.missing_values)
                pred_vals.append(p_vals[sel])
                pred_gi.append(gold_i[sel] + offset)
                pred_doc.append(numpy.full(int(sel.sum()), k, dtype=numpy.int64))
            offset += len(eg.reference)
        n_gold_tokens = offset
        codes, feats = self._code_values(gold_vals + pred_vals, examples[0].reference)
        valid = numpy.array([f is not None for f in feats], dtype=bool)
        g_codes = codes[:n_gold_tokens]
        p_codes = codes[n_gold_tokens:]
        g_valid = valid[g_codes]
        if pred_vals:
            gi = numpy.concatenate(pred_gi)
            p_doc = numpy.concatenate(pred_doc)
            keep = g_valid[gi] & valid[p_codes]
            gi, p_codes, p_doc = gi[keep], p_codes[keep], p_doc[keep]
        else:
            gi = p_doc = numpy.zeros((0,), dtype=numpy.int64)
        g_doc = numpy.concatenate(gold_doc)
        # New fields in spaCy's order: doc by doc, reference tokens then predictions.
        seq_codes = numpy.concatenate([g_codes[g_valid], p_codes])
        seq_doc = numpy.concatenate([g_doc[g_valid], p_doc])
        seq_side = numpy.concatenate(
            [
                numpy.zeros(int(g_valid.sum()), numpy.int64),
                numpy.ones(p_codes.shape[0], numpy.int64),
            ]
        )
        order = numpy.lexsort((numpy.arange(seq_codes.shape[0]), seq_side, seq_doc))
        for code, _ in self._first_appearance(seq_codes[order]):
            for field, _ in feats[code]:
                if field not in self.per_feat:
                    self.per_feat[field] = PRFScore()
        counts: Dict[str, List[int]] = {}  # field -> [tp, n_pred, n_gold]
        for code, count in self._first_appearance(g_codes[g_valid]):
            for field, _ in feats[code]:
                counts.setdefault(field, [0, 0, 0])[2] += count
        if _unique_count(gi):
            combos, combo_counts = self._combos(p_codes, g_codes[gi])
            for (p_code, g_code), count in zip(combos, combo_counts):
                g_set = {feat for _, feat in feats[g_code]}
                for field, feat in feats[p_code]:
                    entry = counts.setdefault(field, [0, 0, 0])
                    entry[1] += count
                    if feat in g_set:
                        entry[0] += count
        else:
            # Several predicted tokens inside one reference token: (index,
            # feature) pairs form sets, so a repeated pair counts once (spaCy).
            pred_pairs: Dict[Tuple[int, str], str] = {}
            for i, code in zip(gi.tolist(), p_codes.tolist()):
                for field, feat in feats[code]:
                    pred_pairs.setdefault((i, feat), field)
            for (i, feat), field in pred_pairs.items():
                entry = counts.setdefault(field, [0, 0, 0])
                entry[1] += 1
                if feat in {f for _, f in feats[g_codes[i]]}:
                    entry[0] += 1
        for field, (tp, n_pred, n_gold) in counts.items():
            prf_add_counts(self.per_feat[field], tp, n_pred - tp, n_gold - tp)
            prf_add_counts(self.micro, tp, n_pred - tp, n_gold - tp)

    def _code_values(self, parts: List[numpy.ndarray], doc: Doc):
        """Code every value by its distinct value; the feats of each code."""
        values = _concat(parts) if parts else numpy.zeros((0,), dtype=numpy.uint64)
        if values.dtype == object:
            distinct: Dict[Any, int] = {}
            codes = numpy.fromiter(
                (distinct.setdefault(v, len(distinct)) for v in values),
                dtype=numpy.int64,
                count=values.shape[0],
            )
            return codes, [self._feats(doc, v) for v in distinct]
        uniq, codes = numpy.unique(values, return_inverse=True)
        return codes.reshape((-1,)), [self._feats(doc, int(v)) for v in uniq]

    @staticmethod
    def _first_appearance(codes: numpy.ndarray) -> List[Tuple[int, int]]:
        """Distinct codes in order of first appearance, with their counts."""
        if codes.shape[0] == 0:
            return []
        uniq, first, counts = numpy.unique(codes, return_index=True, return_counts=True)
        order = numpy.argsort(first, kind="stable")
        return list(zip(uniq[order].tolist(), counts[order].tolist()))

    @staticmethod
    def _combos(p_codes: numpy.ndarray, g_codes: numpy.ndarray):
        """Distinct (predicted, reference) code pairs and their counts."""
        if p_codes.shape[0] == 0:
            return [], []
        pairs = numpy.stack([p_codes, g_codes], axis=1)
        uniq, counts = numpy.unique(pairs, axis=0, return_counts=True)
        return uniq.tolist(), counts.tolist()

    def _merge(self, other: "TokenAttrPerFeatState") -> None:
        self.micro += other.micro
        merge_ordered_prf(self.per_feat, other.per_feat)

    def result(self) -> Dict[str, Any]:
        a = self.attr
        if len(self.micro) == 0:
            return {
                f"{a}_micro_p": None,
                f"{a}_micro_r": None,
                f"{a}_micro_f": None,
                f"{a}_per_feat": None,
            }
        return {
            f"{a}_micro_p": self.micro.precision,
            f"{a}_micro_r": self.micro.recall,
            f"{a}_micro_f": self.micro.fscore,
            f"{a}_per_feat": prf_dicts(self.per_feat),
        }

    def to_dict(self) -> Dict[str, Any]:
        return {
            "kind": self.kind,
            "attr": self.attr,
            "micro": prf_to_list(self.micro),
            "per_feat": per_type_to_list(self.per_feat),
        }

    def load_dict(self, data: Dict[str, Any]) -> "TokenAttrPerFeatState":
        self._check_kind(data)
        self.micro = prf_from_list(data["micro"], "micro")
        self.per_feat = per_type_from_list(data["per_feat"], "per_feat")
        return self
