"""Mergeable twins of spaCy's span scorers: `Scorer.score_spans` (sentences,
spancat `spans_<key>_*`, span_finder, span_ruler) and `get_ner_prf` (`ents_*`)."""

from typing import Any, Callable, Dict, Iterable, Optional, Set

import numpy
from spacy.attrs import ENT_IOB
from spacy.scorer import PRFScore
from spacy.tokens import Doc
from spacy.training import Example

from .base import (
    aligned_x2y,
    ScoreState,
    merge_ordered_prf,
    per_type_from_list,
    per_type_to_list,
    prf_dicts,
    prf_from_list,
    prf_to_list,
)


class SpansState(ScoreState):
    """Mergeable twin of `Scorer.score_spans`: `{attr}_p/r/f` and, when labeled,
    `{attr}_per_type` (labels in order of first appearance).

    attr (str): The attribute to score, e.g. "sents" or "spans_sc".
    getter (Callable[[Doc, str], Iterable[Span]]): Returns a doc's spans.
    has_annotation (Optional[Callable[[Doc], bool]]): Whether a doc is annotated;
        reference docs without annotation are skipped.
    labeled (bool): Whether labels must match.
    allow_overlap (bool): Whether aligned predicted spans may overlap.
    """

    kind = "spans"
    settings = ("attr", "labeled", "allow_overlap")

    def __init__(
        self,
        attr: str,
        *,
        getter: Callable[[Doc, str], Iterable[Any]] = getattr,
        has_annotation: Optional[Callable[[Doc], bool]] = None,
        labeled: bool = True,
        allow_overlap: bool = False,
        **cfg,
    ) -> None:
        self.attr = attr
        self.getter = getter
        self.has_annotation = has_annotation
        self.labeled = labeled
        self.allow_overlap = allow_overlap
        self.score = PRFScore()
        self.per_type: Dict[str, PRFScore] = {}

    def update(self, examples: Iterable[Example]) -> None:
        attr, getter, has_annotation = self.attr, self.getter, self.has_annotation
        for eg in examples:
            gold_doc, pred_doc = eg.reference, eg.predicted
            if has_annotation is not None and not has_annotation(gold_doc):
                continue
            gold = list(getter(gold_doc, attr))
            use_pred = has_annotation is None or has_annotation(pred_doc)
            # The labels seen in this doc, built as a set exactly the way spaCy
            # builds it, so new labels enter the per-type dict in spaCy's order.
            labels = set([span.label_ for span in gold])
            if use_pred:
                labels |= set([span.label_ for span in getter(pred_doc, attr)])
            for label in labels:
                if label not in self.per_type:
                    self.per_type[label] = PRFScore()
            gold_keys = {self._key(span) for span in gold}
            pred_keys: Set[Any] = set()
            if use_pred:
                aligned = eg.get_aligned_spans_x2y(getter(pred_doc, attr), self.allow_overlap)
                pred_keys = {self._key(span) for span in aligned}
            self.score.score_set(pred_keys, gold_keys)
            if self.labeled:
                for label in labels:
                    self.per_type[label].score_set(
                        {k for k in pred_keys if k[0] == label},
                        {k for k in gold_keys if k[0] == label},
                    )

    def _key(self, span) -> tuple:
        if self.labeled:
            return (span.label_, span.start, span.end - 1)
        return (span.start, span.end - 1)

    def _merge(self, other: "SpansState") -> None:
        self.score += other.score
        merge_ordered_prf(self.per_type, other.per_type)

    def result(self) -> Dict[str, Any]:
        a = self.attr
        res: Dict[str, Any] = {f"{a}_p": None, f"{a}_r": None, f"{a}_f": None}
        if self.labeled:
            res[f"{a}_per_type"] = None
        if len(self.score) > 0:
            res[f"{a}_p"] = self.score.precision
            res[f"{a}_r"] = self.score.recall
            res[f"{a}_f"] = self.score.fscore
            if self.labeled:
                res[f"{a}_per_type"] = prf_dicts(self.per_type)
        return res

    def to_dict(self) -> Dict[str, Any]:
        return {
            **self._saved_settings(),
            "kind": self.kind,
            "score": prf_to_list(self.score),
            "per_type": per_type_to_list(self.per_type),
        }

    def load_dict(self, data: Dict[str, Any]) -> "SpansState":
        self._check_kind(data)
        self.score = prf_from_list(data["score"], "score")
        self.per_type = per_type_from_list(data["per_type"])
        return self


class NERState(ScoreState):
    """Mergeable twin of `spacy.scorer.get_ner_prf` (the ner and entity_ruler
    scorer): `ents_p/r/f` and `ents_per_type`. A predicted entity over reference
    tokens with missing entity annotation counts neither way; reference docs
    without entity annotation are skipped."""

    kind = "ner"

    def __init__(self, **cfg) -> None:
        self.per_type: Dict[str, PRFScore] = {}

    def update(self, examples: Iterable[Example]) -> None:
        per_type = self.per_type
        for eg in examples:
            gold_doc = eg.reference
            if not gold_doc.has_annotation("ENT_IOB"):
                continue
            # Built as spaCy builds it (a set of tuples, items removed as they are
            # matched), so unmatched labels are met in the same order.
            golds = {(e.label_, e.start, e.end) for e in gold_doc.ents}
            iob = gold_doc.to_array(ENT_IOB).reshape((len(gold_doc),))
            x2y = aligned_x2y(eg)
            for ent in eg.predicted.ents:
                label = ent.label_
                prf = per_type.get(label)
                if prf is None:
                    prf = per_type[label] = PRFScore()
                indices = x2y[ent.start : ent.end]
                if len(indices) == 0:
                    continue
                first, last = int(indices[0]), int(indices[-1])
                if not numpy.all(iob[first : last + 1] != 0):
                    continue  # unannotated reference tokens: neither right nor wrong
                key = (label, first, last + 1)
                if key in golds:
                    prf.tp += 1
                    golds.remove(key)
                else:
                    prf.fp += 1
            for label, _, _ in golds:
                if label not in per_type:
                    per_type[label] = PRFScore()
                per_type[label].fn += 1

    def _merge(self, other: "NERState") -> None:
        merge_ordered_prf(self.per_type, other.per_type)

    def result(self) -> Dict[str, Any]:
        totals = PRFScore()
        for prf in self.per_type.values():
            totals += prf
        if len(totals) == 0:
            return {"ents_p": None, "ents_r": None, "ents_f": None, "ents_per_type": None}
        return {
            "ents_p": totals.precision,
            "ents_r": totals.recall,
            "ents_f": totals.fscore,
            "ents_per_type": prf_dicts(self.per_type),
        }

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "per_type": per_type_to_list(self.per_type)}

    def load_dict(self, data: Dict[str, Any]) -> "NERState":
        self._check_kind(data)
        self.per_type = per_type_from_list(data["per_type"])
        return self
