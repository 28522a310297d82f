"""Mergeable twin of `Scorer.score_links` (entity_linker, `nel_*`)."""

from typing import Any, Dict, Iterable

from spacy.scorer import PRFScore
from spacy.training import Example

from .base import (
    ScoreState,
    merge_ordered_prf,
    per_type_from_list,
    per_type_to_list,
    prf_dicts,
)


class LinksState(ScoreState):
    """Mergeable twin of `Scorer.score_links`: P/R/F of the KB ids of predicted
    entities whose character offsets match a reference entity, per reference label
    (in order of first appearance) and micro/macro over labels.

    negative_labels (Iterable[str]): KB ids that mean "no link" (e.g. "NIL").
    """

    kind = "links"

    def __init__(self, *, negative_labels: Iterable[str] = (), **cfg) -> None:
        self.negative_labels = set(negative_labels)
        self.per_type: Dict[str, PRFScore] = {}

    def update(self, examples: Iterable[Example]) -> None:
        negative = self.negative_labels
        for eg in examples:
            gold_by_offset = {(e.start_char, e.end_char): e for e in eg.reference.ents}
            for pred_ent in eg.predicted.ents:
                gold_ent = gold_by_offset.get((pred_ent.start_char, pred_ent.end_char))
                if gold_ent is None:
                    continue  # only entities both sides agree on are scored
                label = gold_ent.label_
                prf = self.per_type.get(label)
                if prf is None:
                    prf = self.per_type[label] = PRFScore()
                gold, pred = gold_ent.kb_id_, pred_ent.kb_id_
                gold_neg, pred_neg = gold in negative, pred in negative
                if gold_neg and pred_neg:
                    continue  # a true negative is not counted
                if gold == pred:
                    prf.tp += 1
                elif gold_neg:
                    prf.fp += 1
                elif pred_neg:
                    prf.fn += 1
                else:  # a wrong link is a false positive and a false negative
                    prf.fp += 1
                    prf.fn += 1

    def _merge(self, other: "LinksState") -> None:
        merge_ordered_prf(self.per_type, other.per_type)

    def result(self) -> Dict[str, Any]:
        micro = PRFScore()
        for prf in self.per_type.values():
            micro += prf
        n = len(self.per_type) + 1e-100
        return {
            "nel_score": micro.fscore,
            "nel_score_desc": "micro F",
            "nel_micro_p": micro.precision,
            "nel_micro_r": micro.recall,
            "nel_micro_f": micro.fscore,
            "nel_macro_p": sum(p.precision for p in self.per_type.values()) / n,
            "nel_macro_r": sum(p.recall for p in self.per_type.values()) / n,
            "nel_macro_f": sum(p.fscore for p in self.per_type.values()) / n,
            "nel_f_per_type": prf_dicts(self.per_type),
        }

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "per_type": per_type_to_list(self.per_type)}

    def load_dict(self, data: Dict[str, Any]) -> "LinksState":
        self._check_kind(data)
        self.per_type = per_type_from_list(data["per_type"])
        return self
