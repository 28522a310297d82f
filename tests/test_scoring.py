"""Parity and property tests of the mergeable score states against spaCy's own
scorer, on a small pipeline with every trainable built-in component."""

import gc
import os
import random
import warnings
import weakref

import pytest
import spacy
import srsly
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spacy.scorer import Scorer
from spacy.training import Example

from spacy_lean.scoring import PipelineScoreState, make_pipeline_state
from spacy_lean.scoring.gold import (
    PIPELINE_COMPONENTS,
    build_scoring_pipeline,
    make_scoring_docs,
)
from spacy_lean.scoring.testing import assert_scores_equal

SETTINGS = settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def retokenize_gold(doc, rng):
    """Give a reference doc a tokenization the pipeline will not reproduce: merge a
    multi-token entity and split a plural noun, so predicted tokens map to
    one-of-many and many-to-one reference tokens."""
    ents = [e for e in doc.ents if len(e) > 1]
    if ents and rng.random() < 0.5:
        with doc.retokenize() as retok:
            retok.merge(rng.choice(ents))
    nouns = [t for t in doc if t.tag_ == "NNS" and t.head.i != t.i]
    if nouns:
        tok = rng.choice(nouns)
        with doc.retokenize() as retok:
            retok.split(
                tok,
                [tok.text[:-1], tok.text[-1]],
                heads=[(tok, 1), tok.head],
                attrs={
                    "DEP": ["compound", tok.dep_],
                    "TAG": ["NN", tok.tag_],
                    "POS": ["NOUN", tok.pos_],
                    "LEMMA": [tok.lemma_, "s"],
                    "MORPH": ["Number=Sing", str(tok.morph)],
                },
            )
    return doc


@pytest.fixture(scope="session")
def scoring_nlp():
    nlp = spacy.blank("en")
    train = make_scoring_docs(nlp, 40, seed=11)
    return build_scoring_pipeline(nlp, train, n_steps=15, seed=0)


@pytest.fixture(scope="session")
def gold_examples(scoring_nlp):
    """Unprocessed dev examples (some with a different reference tokenization)."""
    nlp = scoring_nlp
    rng = random.Random(5)
    docs = make_scoring_docs(nlp, 48, seed=12)
    docs = [retokenize_gold(d, rng) if i % 3 == 0 else d for i, d in enumerate(docs)]
    return [Example(nlp.make_doc(d.text), d) for d in docs]


@pytest.fixture(scope="session")
def processed(scoring_nlp, gold_examples):
    """The dev examples with their predicted docs processed by the pipeline."""
    docs = scoring_nlp.pipe([eg.predicted.copy() for eg in gold_examples])
    return [Example(doc, eg.reference) for doc, eg in zip(docs, gold_examples)]


@pytest.fixture(scope="session")
def expected_scores(scoring_nlp, processed):
    """spaCy's scores of the processed examples, flat and per component."""
    return {pc: Scorer(scoring_nlp).score(processed, per_component=pc) for pc in (False, True)}


def state_over(nlp, batches, per_component=False, scorer_cfg=None):
    states = []
    for batch in batches:
        state = make_pipeline_state(nlp, scorer_cfg=scorer_cfg, per_component=per_component)
        state.update(batch)
        states.append(state)
    return states


def without_speed(scores):
    scores = dict(scores)
    scores.pop("speed")
    return scores


def test_pipeline_has_every_component(scoring_nlp):
    assert tuple(scoring_nlp.pipe_names) == PIPELINE_COMPONENTS


@pytest.mark.parametrize("per_component", [False, True])
def test_parity_with_scorer(scoring_nlp, processed, expected_scores, per_component):
    expected = expected_scores[per_component]
    state = make_pipeline_state(scoring_nlp, per_component=per_component)
    state.update(processed)
    got = state.result()
    assert list(got)[-1] == "speed"
    assert_scores_equal(expected, without_speed(got))
    # The data exercise the interesting branches.
    flat = expected_scores[False]
    assert flat["token_acc"] < 1.0  # reference tokenization differs sometimes
    assert 0 < flat["tag_acc"] < 1
    assert flat["ents_per_type"] and flat["spans_sc_per_type"] and flat["dep_las_per_type"]
    assert flat["nel_f_per_type"] and len(flat["morph_per_feat"]) > 3


def test_parity_with_nlp_evaluate(scoring_nlp, gold_examples):
    """End to end: nlp.evaluate on fresh examples equals the state over the same
    examples piped batch by batch (speed aside)."""
    nlp = scoring_nlp
    expected = nlp.evaluate(gold_examples, batch_size=8)
    state = make_pipeline_state(nlp)
    for start in range(0, len(gold_examples), 8):
        batch = gold_examples[start : start + 8]
        docs = nlp.pipe([eg.predicted.copy() for eg in batch])
        state.update([Example(d, eg.reference) for d, eg in zip(docs, batch)])
        state.add_speed(sum(len(eg.predicted) for eg in batch), 0.5)
    got = state.result()
    assert list(got) == list(expected)
    assert got["speed"] == pytest.approx(sum(len(eg.predicted) for eg in gold_examples) / 3.0)
    assert_scores_equal(without_speed(expected), without_speed(got))


def _cuts(n):
    return st.lists(st.integers(min_value=0, max_value=n), max_size=6).map(
        lambda xs: [0] + sorted(set(xs)) + [n]
    )


def _batches(examples, cuts):
    return [examples[a:b] for a, b in zip(cuts, cuts[1:])]


@SETTINGS
@given(data=st.data())
def test_merge_in_data_order_equals_whole(scoring_nlp, processed, expected_scores, data):
    per_component = data.draw(st.booleans())
    cuts = data.draw(_cuts(len(processed)))
    expected = expected_scores[per_component]
    states = state_over(scoring_nlp, _batches(processed, cuts), per_component)
    if data.draw(st.booleans()):
        merged = states[0]
        for other in states[1:]:
            merged.merge(other)
    else:  # a tree of merges, still in data order (merge is associative)
        while len(states) > 1:
            states = [
                states[i].merge(states[i + 1]) if i + 1 < len(states) else states[i]
                for i in range(0, len(states), 2)
            ]
        merged = states[0]
    assert_scores_equal(expected, without_speed(merged.result()))


@SETTINGS
@given(data=st.data())
def test_merge_in_any_order_gives_same_numbers(scoring_nlp, processed, expected_scores, data):
    cuts = data.draw(_cuts(len(processed)))
    states = state_over(scoring_nlp, _batches(processed, cuts))
    order = data.draw(st.permutations(range(len(states))))
    merged = states[order[0]]
    for i in order[1:]:
        merged.merge(states[i])
    expected = expected_scores[False]
    got = without_speed(merged.result())
    # Top-level keys and every value agree; per-type dicts may list their keys in
    # another order (first appearance in the merge order).
    assert list(got) == list(expected)
    assert_scores_equal(expected, got, ordered=False)
    # Per-type dicts of textcat have a fixed order: equal even in key order.
    assert_scores_equal(expected["cats_f_per_type"], got["cats_f_per_type"])
    assert_scores_equal(expected["cats_auc_per_type"], got["cats_auc_per_type"])


@SETTINGS
@given(data=st.data())
def test_json_round_trip_mid_stream(scoring_nlp, processed, expected_scores, data):
    cut = data.draw(st.integers(min_value=0, max_value=len(processed)))
    first = make_pipeline_state(scoring_nlp)
    first.update(processed[:cut])
    first.add_speed(123, 0.1 + 0.2)
    text = srsly.json_dumps(first.to_dict())
    restored = PipelineScoreState.from_dict(srsly.json_loads(text), scoring_nlp)
    assert restored.to_dict() == first.to_dict()
    assert restored.seconds == first.seconds  # exact, not 10 digits
    assert restored.n_examples == cut
    restored.update(processed[cut:])
    assert_scores_equal(expected_scores[False], without_speed(restored.result()))


def test_empty_state_matches_spacy_on_no_examples(scoring_nlp):
    for per_component in (False, True):
        expected = Scorer(scoring_nlp).score([], per_component=per_component)
        got = make_pipeline_state(scoring_nlp, per_component=per_component).result()
        assert got["speed"] == 0.0
        assert_scores_equal(expected, without_speed(got))
    flat = make_pipeline_state(scoring_nlp).result()
    assert flat["ents_p"] is None and flat["tag_acc"] is None and flat["dep_uas"] is None


def test_scorer_cfg_is_passed_to_every_scorer(scoring_nlp, processed):
    cfg = {"threshold": 0.2, "ignore_labels": ["det"]}
    expected = Scorer(scoring_nlp, **cfg).score(processed)
    state = make_pipeline_state(scoring_nlp, scorer_cfg=cfg)
    state.update(processed)
    got = without_speed(state.result())
    assert_scores_equal(expected, got)
    assert "det" not in got["dep_las_per_type"]
    assert state.fingerprint != make_pipeline_state(scoring_nlp).fingerprint


def test_entity_linker_without_gold_ents(scoring_nlp, processed):
    el = scoring_nlp.get_pipe("entity_linker")
    el.use_gold_ents = False
    try:
        expected = Scorer(scoring_nlp).score(processed)
        state = make_pipeline_state(scoring_nlp)
        state.update(processed[:20])
        other = make_pipeline_state(scoring_nlp)
        other.update(processed[20:])
        assert_scores_equal(expected, without_speed(state.merge(other).result()))
    finally:
        el.use_gold_ents = True


def test_state_keeps_no_docs(scoring_nlp, processed):
    docs = [eg.predicted.copy() for eg in processed[:6]]
    refs = [weakref.ref(d) for d in docs]
    state = make_pipeline_state(scoring_nlp)
    state.update([Example(d, eg.reference) for d, eg in zip(docs, processed)])
    del docs
    gc.collect()
    assert all(r() is None for r in refs)
    assert state.fallbacks == []


def test_from_dict_refuses_another_pipeline(scoring_nlp, processed):
    state = make_pipeline_state(scoring_nlp)
    state.update(processed[:4])
    data = srsly.json_loads(srsly.json_dumps(state.to_dict()))
    other = spacy.blank("en")
    other.add_pipe("tagger").add_label("NN")
    with pytest.raises(ValueError, match="another pipeline or scorer config"):
        PipelineScoreState.from_dict(data, other)
    with pytest.raises(ValueError, match="scorer config"):
        PipelineScoreState.from_dict(data, scoring_nlp, scorer_cfg={"threshold": 0.9})
    with pytest.raises(ValueError, match="Cannot merge score states"):
        state.merge(make_pipeline_state(scoring_nlp, scorer_cfg={"threshold": 0.9}))
    with pytest.raises(ValueError, match="Not a spacy-lean pipeline score state"):
        PipelineScoreState.from_dict({"format": 99}, scoring_nlp)


def test_fingerprint_is_stable_across_loads_and_sees_weights(scoring_nlp, processed, tmp_path):
    scoring_nlp.to_disk(tmp_path / "model")
    loaded = spacy.load(tmp_path / "model")
    assert make_pipeline_state(loaded).fingerprint == make_pipeline_state(scoring_nlp).fingerprint
    # The same pipeline with other weights (e.g. trained further) is another model.
    data = make_pipeline_state(scoring_nlp).to_dict()
    tagger_model = loaded.get_pipe("tagger").model
    node = next(n for n in tagger_model.walk() if n.has_param("W"))
    node.set_param("W", node.get_param("W") + 1.0)
    with pytest.raises(ValueError, match="another pipeline"):
        PipelineScoreState.from_dict(data, loaded)


def test_fingerprint_sees_transformer_weights(trf_ner_dir):
    first, second = spacy.load(trf_ner_dir), spacy.load(trf_ner_dir)
    assert make_pipeline_state(first).fingerprint == make_pipeline_state(second).fingerprint
    trf_model = second.get_pipe("transformer").model
    shim = next(s for n in trf_model.walk() for s in n.shims)
    import torch

    with torch.no_grad():
        next(shim._model.parameters()).add_(1.0)
    assert make_pipeline_state(first).fingerprint != make_pipeline_state(second).fingerprint


def test_transformer_pipeline_parity_without_fallbacks(trf_ner_nlp, dev_examples):
    """The transformer has no scorer (an empty twin, no warning); ner parity."""
    nlp = trf_ner_nlp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = make_pipeline_state(nlp, per_component=True)
    assert state.fallbacks == []
    expected = nlp.evaluate(dev_examples, per_component=True)
    for start in range(0, len(dev_examples), 7):
        batch = dev_examples[start : start + 7]
        docs = nlp.pipe([eg.predicted.copy() for eg in batch])
        state.update([Example(d, eg.reference) for d, eg in zip(docs, batch)])
    got = state.result()
    assert list(got) == list(expected)
    assert got["transformer"] == {}
    assert_scores_equal(without_speed(expected), without_speed(got))


@pytest.fixture(scope="module")
def rule_nlp_examples():
    """A pipeline of rule-based components plus a span_finder (initialized only),
    and processed examples for it."""
    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    ruler = nlp.add_pipe("attribute_ruler")
    ruler.add(
        [[{"LOWER": "the"}]],
        {"TAG": "DT", "POS": "DET", "LEMMA": "the", "MORPH": "Definite=Def|PronType=Art"},
    )
    ruler.add(
        [[{"LOWER": "reports"}]],
        {"TAG": "NNS", "POS": "NOUN", "LEMMA": "report", "MORPH": "Number=Plur"},
    )
    ruler.add([[{"TEXT": "."}]], {"TAG": ".", "POS": "PUNCT", "MORPH": "PunctType=Peri"})
    ent_ruler = nlp.add_pipe("entity_ruler")
    ent_ruler.add_patterns(
        [
            {"label": "PERSON", "pattern": "Ada Lindqvist"},
            {"label": "ORG", "pattern": "Quillon Labs"},
            {"label": "LOC", "pattern": "Veldmark"},
            {"label": "PERSON", "pattern": "Veldmark"},
        ]
    )
    span_ruler = nlp.add_pipe("span_ruler")
    span_ruler.add_patterns(
        [
            {"label": "SUBJ_NP", "pattern": [{"LOWER": "the"}, {"POS": "NOUN"}]},
            {"label": "EVENT", "pattern": [{"LOWER": "joined"}, {"OP": "+", "IS_PUNCT": False}]},
        ]
    )
    finder = nlp.add_pipe("span_finder", config={"spans_key": "sc"})
    docs = make_scoring_docs(nlp, 36, seed=21)
    for doc in docs:
        if "sc" in doc.spans:
            doc.spans["ruler"] = list(doc.spans["sc"])
    train = [Example(nlp.make_doc(d.text), d) for d in docs[:12]]
    finder.initialize(lambda: train, nlp=nlp)
    examples = [Example(nlp.make_doc(d.text), d) for d in docs[12:]]
    docs = nlp.pipe(eg.predicted for eg in examples)
    processed = [Example(doc, eg.reference) for doc, eg in zip(docs, examples)]
    return nlp, processed


@pytest.mark.parametrize("cuts", [[0, 24], [0, 1, 7, 24], [0, 5, 6, 13, 20, 24]])
def test_rule_based_and_span_finder_scorers(rule_nlp_examples, cuts):
    nlp, processed = rule_nlp_examples
    for per_component in (False, True):
        expected = Scorer(nlp).score(processed, per_component=per_component)
        states = state_over(nlp, _batches(processed, cuts), per_component)
        merged = states[0]
        for other in states[1:]:
            merged.merge(other)
        assert merged.fallbacks == []
        assert_scores_equal(expected, without_speed(merged.result()))
    flat = Scorer(nlp).score(processed)
    assert flat["ents_per_type"] and flat["spans_ruler_per_type"] and flat["tag_acc"] is not None
    assert "spans_sc_f" in flat and "spans_sc_per_type" not in flat


@pytest.mark.slow
def test_fingerprint_is_stable_across_processes(scoring_nlp, tmp_path):
    """A resumed run happens in a new process, with another hash seed."""
    import subprocess
    import sys

    scoring_nlp.to_disk(tmp_path / "model")
    code = (
        "import spacy, warnings; from spacy_lean.scoring import make_pipeline_state; "
        f"print(make_pipeline_state(spacy.load({str(tmp_path / 'model')!r})).fingerprint)"
    )
    prints = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        prints.add(out.stdout.strip())
    assert prints == {make_pipeline_state(scoring_nlp).fingerprint}


def test_references_ending_in_a_whitespace_token_score_as_spacy(scoring_nlp, gold_examples):
    """A reference doc whose last token is whitespace with a trailing space of its own
    ("... world" + " " + " "): the tokenizer makes one token of the two, and spaCy's
    alignment then has one entry more than the predicted doc has tokens. The token
    scores indexed the predicted tokens with it and raised an IndexError (every entry
    point crashed on such a dev doc, where nlp.evaluate scores it)."""
    from spacy.tokens import Doc

    nlp = scoring_nlp
    endings = [["Hello", "world", " "], [" "], ["Ada", "met", "Bo", "\n"]]
    odd = []
    for words in endings:
        ref = Doc(nlp.vocab, words=words, spaces=[True] * len(words))
        eg = Example(nlp.make_doc(ref.text), ref)
        assert len(eg.alignment.x2y.lengths) == len(eg.predicted) + 1
        odd.append(eg)
    examples = gold_examples[:8] + odd
    expected = nlp.evaluate(examples)
    state = make_pipeline_state(nlp)
    docs = nlp.pipe([eg.predicted.copy() for eg in examples])
    state.update([Example(d, eg.reference) for d, eg in zip(docs, examples)])
    assert_scores_equal(without_speed(expected), without_speed(state.result()))
