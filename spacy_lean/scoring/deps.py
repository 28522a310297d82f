"""Mergeable twin of `Scorer.score_deps` (parser: `dep_uas`, `dep_las`,
`dep_las_per_type`).

Unlike spaCy 3.8, reference tokens with a missing dependency label are excluded
from their own doc only: spaCy keeps one set of missing indices for the whole
list of examples, so a missing label at index i in one doc also hides index i in
every later doc, and the result depends on how docs are grouped.
"""

from typing import Any, Callable, Dict, Iterable, List, Set, Tuple

import numpy
from spacy.attrs import DEP, HEAD, LENGTH
from spacy.scorer import MISSING_VALUES, PRFScore
from spacy.tokens import Doc, Token
from spacy.training import Example

from .base import (
    ScoreState,
    merge_ordered_prf,
    per_type_from_list,
    per_type_to_list,
    prf_add_counts,
    prf_dicts,
    prf_from_list,
    prf_to_list,
)
from .tokens import _concat, _is_default_missing, aligned_single, space_mask


def lower_dep_getter(token: Token, attr: str) -> str:
    """The label getter spaCy's parser scorer uses: the lower-cased label string."""
    return token.vocab.strings.as_string(getattr(token, attr)).lower()


class DepsState(ScoreState):
    """Mergeable twin of `Scorer.score_deps`.

    attr (str): The attribute holding the label, "dep".
    getter (Callable[[Token, str], Any]): Returns a token's label.
    head_attr (str): The attribute holding the head, "head".
    head_getter (Callable[[Token, str], Token]): Returns a token's head.
    ignore_labels (Iterable[str]): Labels not scored (e.g. punctuation).
    missing_values (Set[Any]): Reference labels that mean "not annotated".
    """

    kind = "deps"
    settings = ("attr", "head_attr")

    def __init__(
        self,
        attr: str = "dep",
        *,
        getter: Callable[[Token, str], Any] = getattr,
        head_attr: str = "head",
        head_getter: Callable[[Token, str], Token] = getattr,
        ignore_labels: Iterable[str] = (),
        missing_values: Set[Any] = MISSING_VALUES,
        **cfg,
    ) -> None:
        self.attr = attr
        self.getter = getter
        self.head_attr = head_attr
        self.head_getter = head_getter
        self.ignore_labels = set(ignore_labels)
        self.missing_values = missing_values
        self.unlabelled = PRFScore()
        self.labelled = PRFScore()
        self.per_dep: Dict[Any, PRFScore] = {}
        self._fast = (
            attr == "dep"
            and getter in (getattr, lower_dep_getter)
            and head_attr == "head"
            and head_getter is getattr
            and _is_default_missing(missing_values)
        )
        self._label_cache: Dict[int, Any] = {}

    def _doc_arrays(self, doc: Doc) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """Each token's label value (a hash, or any object from a custom getter)
        and its head's index."""
        n = len(doc)
        if self._fast:
            if n == 0:
                return numpy.zeros((0,), numpy.uint64), numpy.zeros((0,), numpy.int64)
            arr = doc.to_array([DEP, HEAD])
            heads = numpy.arange(n, dtype=numpy.int64) + arr[:, 1].view(numpy.int64)
            return arr[:, 0].copy(), heads
        values = numpy.empty(n, dtype=object)
        heads = numpy.zeros(n, dtype=numpy.int64)
        for token in doc:
            values[token.i] = self.getter(token, self.attr)
            heads[token.i] = self.head_getter(token, self.head_attr).i
        return values, heads

    def _code_labels(self, values: numpy.ndarray, doc: Doc) -> Tuple[numpy.ndarray, List[Any]]:
        """Code label values by their label (lower-casing can merge hashes)."""
        index: Dict[Any, int] = {}
        if values.dtype == object:
            codes = numpy.fromiter(
                (index.setdefault(v, len(index)) for v in values),
                dtype=numpy.int64,
                count=values.shape[0],
            )
            return codes, list(index)
        uniq, inverse = numpy.unique(values, return_inverse=True)
        to_name = numpy.array(
            [index.setdefault(self._label(doc, int(h)), len(index)) for h in uniq],
            dtype=numpy.int64,
        )
        return to_name[inverse.reshape((-1,))], list(index)

    def _label(self, doc: Doc, key: int) -> Any:
        label = self._label_cache.get(key)
        if label is None:
            if self.getter is lower_dep_getter:
                label = doc.vocab.strings.as_string(key).lower()
            else:
                label = key
            self._label_cache[key] = label
        return label

    def update(self, examples: Iterable[Example]) -> None:
        # Per doc: arrays. Per batch: the counting, with reference indices offset
        # by doc, so nothing (including missing labels) leaks between docs.
        examples = list(examples)
        if not examples:
            return
        g_vals, g_heads, g_doc = [], [], []
        p_vals, p_plain, p_single, p_gi, p_gh, p_doc = [], [], [], [], [], []
        offset = 0
        for k, eg in enumerate(examples):
            gold_doc, pred_doc = eg.reference, eg.predicted
            values, heads = self._doc_arrays(gold_doc)
            g_vals.append(values)
            g_heads.append(heads + offset)
            g_doc.append(numpy.full(len(gold_doc), k, dtype=numpy.int64))
            n_pred = len(pred_doc)
            if n_pred:
                values, heads = self._doc_arrays(pred_doc)
                single, gold_i = aligned_single(eg)
                lengths = pred_doc.to_array(LENGTH).reshape((n_pred,))
                p_vals.append(values)
                p_plain.append(~space_mask(pred_doc) & (lengths > 0))
                p_single.append(single)
                p_gi.append(numpy.where(single, gold_i + offset, -1))
                p_gh.append(numpy.where(single[heads], gold_i[heads] + offset, -1))
                p_doc.append(numpy.full(n_pred, k, dtype=numpy.int64))
            offset += len(gold_doc)
        n_gold_tokens = offset
        codes, names = self._code_labels(_concat(g_vals + p_vals), examples[0].reference)
        missing = numpy.array([n in self.missing_values for n in names], dtype=bool)
        ignored = numpy.array([n in self.ignore_labels for n in names], dtype=bool)
        g_codes, p_codes = codes[:n_gold_tokens], codes[n_gold_tokens:]
        g_heads_all = numpy.concatenate(g_heads)
        g_doc_all = numpy.concatenate(g_doc)
        g_missing = missing[g_codes]
        g_valid = ~g_missing & ~ignored[g_codes]
        if p_vals:
            single = numpy.concatenate(p_single)
            gi = numpy.concatenate(p_gi)
            gh = numpy.concatenate(p_gh)
            pd = numpy.concatenate(p_doc)
            in_missing = single & g_missing[numpy.where(single, gi, 0)]
            scored = numpy.concatenate(p_plain) & ~ignored[p_codes] & ~in_missing
            aligned = scored & single & (gh >= 0)
            n_unaligned = int((scored & ~aligned).sum())
            gi, gh, pc, pd = gi[aligned], gh[aligned], p_codes[aligned], pd[aligned]
        else:
            gi = gh = pc = pd = numpy.zeros((0,), dtype=numpy.int64)
            n_unaligned = 0
        # New labels in spaCy's order: doc by doc, reference tokens then predictions.
        n_valid = int(g_valid.sum())
        seq = numpy.concatenate([g_codes[g_valid], pc])
        order = numpy.lexsort(
            (
                numpy.arange(seq.shape[0]),
                numpy.concatenate(
                    [numpy.zeros(n_valid, numpy.int64), numpy.ones(pc.shape[0], numpy.int64)]
                ),
                numpy.concatenate([g_doc_all[g_valid], pd]),
            )
        )
        for code in self._first_seen(seq[order]):
            if names[code] not in self.per_dep:
                self.per_dep[names[code]] = PRFScore()
        n_names = len(names)
        g_label_counts = numpy.bincount(g_codes[g_valid], minlength=n_names)
        if numpy.unique(gi).shape[0] == gi.shape[0]:
            head_ok = g_valid[gi] & (g_heads_all[gi] == gh)
            label_ok = head_ok & (g_codes[gi] == pc)
            n_aligned = n_aligned_u = gi.shape[0]
            tp_u = int(head_ok.sum())
            tp_l = int(label_ok.sum())
            p_label_counts = numpy.bincount(pc, minlength=n_names)
            tp_label_counts = numpy.bincount(pc[label_ok], minlength=n_names)
        else:
            # Several predicted tokens inside one reference token: triples form
            # sets, as in spaCy, so a repeated triple counts once.
            triples = set(zip(gi.tolist(), gh.tolist(), pc.tolist()))
            n_aligned = len(triples)
            pairs = {(i, h) for i, h, _ in triples}
            n_aligned_u = len(pairs)
            tp_u = sum(1 for i, h in pairs if g_valid[i] and g_heads_all[i] == h)
            p_label_counts = numpy.zeros(n_names, dtype=numpy.int64)
            tp_label_counts = numpy.zeros(n_names, dtype=numpy.int64)
            tp_l = 0
            for i, h, c in triples:
                p_label_counts[c] += 1
                if g_valid[i] and g_heads_all[i] == h and g_codes[i] == c:
                    tp_label_counts[c] += 1
                    tp_l += 1
        n_gold = n_valid
        prf_add_counts(self.labelled, tp_l, n_aligned - tp_l + n_unaligned, n_gold - tp_l)
        prf_add_counts(self.unlabelled, tp_u, n_aligned_u - tp_u + n_unaligned, n_gold - tp_u)
        for code in numpy.flatnonzero(g_label_counts + p_label_counts).tolist():
            tp = int(tp_label_counts[code])
            prf_add_counts(
                self.per_dep[names[code]],
                tp,
                int(p_label_counts[code]) - tp,
                int(g_label_counts[code]) - tp,
            )

    @staticmethod
    def _first_seen(codes: numpy.ndarray) -> List[int]:
        if codes.shape[0] == 0:
            return []
        uniq, first = numpy.unique(codes, return_index=True)
        return uniq[numpy.argsort(first, kind="stable")].tolist()

    def _merge(self, other: "DepsState") -> None:
        self.unlabelled += other.unlabelled
        self.labelled += other.labelled
        merge_ordered_prf(self.per_dep, other.per_dep)

    def result(self) -> Dict[str, Any]:
        a = self.attr
        if len(self.unlabelled) == 0:
            return {f"{a}_uas": None, f"{a}_las": None, f"{a}_las_per_type": None}
        return {
            f"{a}_uas": self.unlabelled.fscore,
            f"{a}_las": self.labelled.fscore,
            f"{a}_las_per_type": prf_dicts(self.per_dep),
        }

    def to_dict(self) -> Dict[str, Any]:
        return {
            "kind": self.kind,
            "attr": self.attr,
            "unlabelled": prf_to_list(self.unlabelled),
            "labelled": prf_to_list(self.labelled),
            "per_dep": per_type_to_list(self.per_dep),
        }

    def load_dict(self, data: Dict[str, Any]) -> "DepsState":
        self._check_kind(data)
        self.unlabelled = prf_from_list(data["unlabelled"], "unlabelled")
        self.labelled = prf_from_list(data["labelled"], "labelled")
        self.per_dep = per_type_from_list(data["per_dep"], "per_dep")
        return self
