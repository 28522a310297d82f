"""Mergeable twin of `Scorer.score_cats` (textcat and textcat_multilabel).

ROC AUC is exact without keeping one entry per example: per label, the state
counts positive and negative references per distinct predicted score. The ROC
curve only changes at distinct scores, so these counts rebuild it point for point.
"""

from typing import Any, Callable, Dict, Iterable, List, Optional, Set

import numpy
from spacy.scorer import PRFScore, trapezoid
from spacy.tokens import Doc
from spacy.training import Example

from .base import (
    ScoreState,
    StateFieldError,
    count_from_json,
    float_from_json,
    float_to_json,
    labelled_rows,
    list_from_json,
    per_type_from_list,
    per_type_to_list,
    prf_dicts,
)


class ScoreCounts:
    """Counts of positive and negative references per distinct predicted score,
    for one label: enough for an exact ROC AUC, and mergeable."""

    def __init__(self) -> None:
        self.counts: Dict[float, List[int]] = {}  # score -> [n_pos, n_neg]
        self.gold_values: Set[float] = set()

    def add(self, score: float, gold: float) -> None:
        gold = float(gold)
        self.gold_values.add(gold)
        entry = self.counts.get(score)
        if entry is None:
            entry = self.counts[score] = [0, 0]
        entry[0 if gold == 1.0 else 1] += 1

    def merge(self, other: "ScoreCounts") -> None:
        self.gold_values |= other.gold_values
        for score, (pos, neg) in other.counts.items():
            entry = self.counts.get(score)
            if entry is None:
                self.counts[score] = [pos, neg]
            else:
                entry[0] += pos
                entry[1] += neg

    def is_binary(self) -> bool:
        """Whether exactly two distinct reference values were seen (spaCy's test)."""
        return len(self.gold_values) == 2

    def auc(self) -> float:
        """ROC AUC with the same curve and trapezoid rule spaCy's scorer uses."""
        scores = numpy.fromiter(self.counts.keys(), dtype=numpy.float64)
        pos_neg = numpy.array(list(self.counts.values()), dtype=numpy.float64)
        order = numpy.argsort(scores, kind="mergesort")[::-1]
        tps = numpy.cumsum(pos_neg[order, 0])
        fps = numpy.cumsum(pos_neg[order, 1])
        tps = numpy.concatenate([[0.0], tps])
        fps = numpy.concatenate([[0.0], fps])
        fpr = fps / fps[-1] if fps[-1] > 0 else numpy.repeat(numpy.nan, fps.shape)
        tpr = tps / tps[-1] if tps[-1] > 0 else numpy.repeat(numpy.nan, tps.shape)
        return float(trapezoid(tpr, fpr))

    def to_list(self) -> Dict[str, Any]:
        return {
            "golds": sorted(float_to_json(g) for g in self.gold_values),
            "counts": [[float_to_json(s), pos, neg] for s, (pos, neg) in self.counts.items()],
        }

    @classmethod
    def from_list(cls, data: Dict[str, Any], field: str = "auc") -> "ScoreCounts":
        obj = cls()
        if not isinstance(data, dict):
            raise StateFieldError(field, data, "an object with 'golds' and 'counts'")
        golds = list_from_json(data.get("golds"), f"{field}.golds")
        obj.gold_values = {float_from_json(g, f"{field}.golds[{i}]") for i, g in enumerate(golds)}
        for i, row in enumerate(list_from_json(data.get("counts"), f"{field}.counts")):
            where = f"{field}.counts[{i}]"
            score, pos, neg = list_from_json(row, where, 3)
            score = float_from_json(score, f"{where}[0]")
            if score in obj.counts:
                raise StateFieldError(f"{where}[0]", row[0], "a score not listed before")
            obj.counts[score] = [
                count_from_json(pos, f"{where}[1]"),
                count_from_json(neg, f"{where}[2]"),
            ]
        return obj


class CatsState(ScoreState):
    """Mergeable twin of `Scorer.score_cats`: `{attr}_score`, `{attr}_score_desc`,
    micro and macro P/R/F, `{attr}_macro_auc`, `{attr}_f_per_type` and
    `{attr}_auc_per_type` (labels in the order given).

    Unlike spaCy 3.8, exclusive labels (multi_label=False) with a reference label
    and no prediction count a false negative for the reference's top label, where
    spaCy raises a ValueError.

    attr (str): The doc attribute, "cats".
    getter (Callable[[Doc, str], Dict[str, float]]): Returns a doc's label scores.
    labels (Iterable[str]): The labels.
    multi_label (bool): Whether labels are independent.
    positive_label (Optional[str]): The positive label of a binary exclusive task.
    threshold (Optional[float]): Cut-off for multi-label predictions (0.5 default).
    """

    kind = "cats"
    settings = ("attr", "labels", "multi_label", "positive_label", "threshold")

    def __init__(
        self,
        attr: str = "cats",
        *,
        getter: Callable[[Doc, str], Any] = getattr,
        labels: Iterable[str] = (),
        multi_label: bool = True,
        positive_label: Optional[str] = None,
        threshold: Optional[float] = None,
        **cfg,
    ) -> None:
        self.attr = attr
        self.getter = getter
        self.labels = list(labels)
        self.label_set = set(self.labels)
        self.multi_label = multi_label
        self.positive_label = positive_label
        if threshold is None or not multi_label:
            threshold = 0.5 if multi_label else 0.0
        self.threshold = threshold
        self.f_per_type: Dict[str, PRFScore] = {label: PRFScore() for label in self.labels}
        self.auc_per_type: Dict[str, ScoreCounts] = {label: ScoreCounts() for label in self.labels}

    def update(self, examples: Iterable[Example]) -> None:
        labels = self.label_set
        for eg in examples:
            pred = {k: v for k, v in self.getter(eg.predicted, self.attr).items() if k in labels}
            gold = {k: v for k, v in self.getter(eg.reference, self.attr).items() if k in labels}
            if self.multi_label:
                self._update_multi(pred, gold)
            else:
                self._update_exclusive(pred, gold)

    def _update_multi(self, pred: Dict[str, float], gold: Dict[str, float]) -> None:
        for label in self.label_set:
            g = gold.get(label)
            if g is None:
                continue  # missing reference value: not counted
            p = pred.get(label, 0.0)
            self.auc_per_type[label].add(p, g)
            prf = self.f_per_type[label]
            if p >= self.threshold:
                if g > 0:
                    prf.tp += 1
                elif g == 0:
                    prf.fp += 1
            elif g > 0:
                prf.fn += 1

    def _update_exclusive(self, pred: Dict[str, float], gold: Dict[str, float]) -> None:
        for label in self.label_set:
            g = gold.get(label)
            self.auc_per_type[label].add(pred.get(label, 0.0), g if g else 0.0)
        # The top label of each side; ties go to the first in dict order.
        top_pred = max(pred.items(), key=lambda kv: kv[1]) if pred else None
        top_gold = max(gold.items(), key=lambda kv: kv[1]) if gold else None
        if top_pred is not None and top_gold is not None:
            if top_pred[0] == top_gold[0]:
                self.f_per_type[top_pred[0]].tp += 1
            else:
                self.f_per_type[top_gold[0]].fn += 1
                self.f_per_type[top_pred[0]].fp += 1
        elif top_gold is not None:
            # spaCy 3.8 raises here (it unpacks a label string); the reference's
            # top label was missed.
            if top_gold[1] > 0:
                self.f_per_type[top_gold[0]].fn += 1
        elif top_pred is not None:
            self.f_per_type[top_pred[0]].fp += 1

    def _merge(self, other: "CatsState") -> None:
        if other.labels != self.labels:
            raise ValueError(
                f"Cannot merge cats states with different labels: {self.labels} "
                f"and {other.labels}."
            )
        for label in self.labels:
            self.f_per_type[label] += other.f_per_type[label]
            self.auc_per_type[label].merge(other.auc_per_type[label])

    def result(self) -> Dict[str, Any]:
        a = self.attr
        micro = PRFScore()
        for prf in self.f_per_type.values():
            micro += prf
        n_cats = len(self.f_per_type) + 1e-100
        macro_p = sum(prf.precision for prf in self.f_per_type.values()) / n_cats
        macro_r = sum(prf.recall for prf in self.f_per_type.values()) / n_cats
        macro_f = sum(prf.fscore for prf in self.f_per_type.values()) / n_cats
        aucs = {
            label: (counts.auc() if counts.is_binary() else None)
            for label, counts in self.auc_per_type.items()
        }
        # Labels without two reference values add 0 but still count in the mean.
        macro_auc = sum(v if v is not None else 0.0 for v in aucs.values()) / n_cats
        res: Dict[str, Any] = {
            f"{a}_score": None,
            f"{a}_score_desc": None,
            f"{a}_micro_p": micro.precision,
            f"{a}_micro_r": micro.recall,
            f"{a}_micro_f": micro.fscore,
            f"{a}_macro_p": macro_p,
            f"{a}_macro_r": macro_r,
            f"{a}_macro_f": macro_f,
            f"{a}_macro_auc": macro_auc,
            f"{a}_f_per_type": prf_dicts(self.f_per_type),
            f"{a}_auc_per_type": aucs,
        }
        if len(self.label_set) == 2 and not self.multi_label and self.positive_label:
            res[f"{a}_score"] = res[f"{a}_f_per_type"][self.positive_label]["f"]
            res[f"{a}_score_desc"] = f"F ({self.positive_label})"
        elif not self.multi_label:
            res[f"{a}_score"] = macro_f
            res[f"{a}_score_desc"] = "macro F"
        else:
            res[f"{a}_score"] = macro_auc
            res[f"{a}_score_desc"] = "macro AUC"
        return res

    def to_dict(self) -> Dict[str, Any]:
        return {
            **self._saved_settings(),  # attr, labels, multi_label, ...: checked on load
            "kind": self.kind,
            "f_per_type": per_type_to_list(self.f_per_type),
            "auc_per_type": [[k, v.to_list()] for k, v in self.auc_per_type.items()],
        }

    def load_dict(self, data: Dict[str, Any]) -> "CatsState":
        self._check_kind(data)  # the labels too
        self.f_per_type = per_type_from_list(data["f_per_type"], "f_per_type")
        self.auc_per_type = {
            label: ScoreCounts.from_list(row[1], f"{where}[1]")
            for where, label, row in labelled_rows(data["auc_per_type"], "auc_per_type", 2)
        }
        return self
