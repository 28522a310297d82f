"""Helpers shared by the evaluation tests (streaming loop, CLI, workers)."""

import pytest
import srsly

from spacy_lean import synthetic


def as_json(scores):
    return srsly.json_loads(srsly.json_dumps(scores))


def assert_same_scores(ours, theirs, path="scores", *, speed="skip", unordered_per_type=False):
    """Same keys in the same order, None where spaCy has None, floats to 1e-12.

    speed (str): "skip" (a timing, not compared) or "present" (only checked to be a float).
    unordered_per_type (bool): compare only the key sets of `*_per_type` dicts: spaCy's
        NER scorer orders labels first met as missed gold entities by iterating a set of
        (label, start, end), which follows the process's string-hash seed
        (PYTHONHASHSEED), so even `nlp.evaluate` orders them differently in two processes.
    """
    if unordered_per_type and path.endswith("_per_type"):
        assert sorted(ours) == sorted(theirs), f"{path}: keys differ"
    else:
        assert list(ours) == list(theirs), f"{path}: keys differ"
    for key, value in theirs.items():
        if key == "speed":
            if speed == "present":
                assert isinstance(ours[key], float)
        elif isinstance(value, dict):
            assert isinstance(ours[key], dict), f"{path}.{key}"
            assert_same_scores(
                ours[key],
                value,
                f"{path}.{key}",
                speed=speed,
                unordered_per_type=unordered_per_type,
            )
        elif isinstance(value, float):
            assert ours[key] == pytest.approx(value, abs=1e-12), f"{path}.{key}"
        else:
            assert ours[key] == value, f"{path}.{key}"


def ruler_patterns():
    """Entity patterns that get some entities right and some wrong, so that the
    scores compared are not all zero (the fixture's ner is barely trained)."""
    pats = [{"label": "PERSON", "pattern": p} for p in synthetic._PERSONS[:8]]
    pats += [{"label": "ORG", "pattern": p} for p in synthetic._ORGS[:6]]
    pats += [{"label": "ORG", "pattern": p} for p in synthetic._LOCS[:3]]  # wrong on purpose
    pats += [{"label": "MISC", "pattern": p} for p in synthetic._MISC[:3]]
    return pats


def add_ruler(nlp):
    nlp.add_pipe("entity_ruler", config={"overwrite_ents": True}).add_patterns(ruler_patterns())
    return nlp


def record_evaluators(monkeypatch):
    """Every `StreamingEvaluator` built from now on (this process, this test), and the
    heap trims they ask for counted in place of glibc's `malloc_trim` (so its count is
    `evaluator._trimmer.n_trims` on any platform).

    RETURNS (list): the evaluators, in the order they were built.
    """
    from spacy_lean import memory
    from spacy_lean.streaming import StreamingEvaluator

    built = []
    real_init = StreamingEvaluator.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(StreamingEvaluator, "__init__", init)
    monkeypatch.setattr(memory, "trim_host_memory", lambda: True)
    return built


def trim_policy(evaluator):
    """(trims at all, slack in MB) of an evaluator."""
    return evaluator.trim_heap, evaluator._trimmer.slack / 2**20
