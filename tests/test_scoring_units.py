"""Unit tests of single score states: spaCy's two scorer bugs (hand-computed
numbers), exact ROC AUC from counts, custom getters, and twins for custom scorers."""

import warnings

import pytest
import spacy
import srsly
from hypothesis import given, settings
from hypothesis import strategies as st
from spacy.scorer import Scorer
from spacy.tokens import Doc, Span
from spacy.training import Example

from spacy_lean.scoring import (
    CatsState,
    DepsState,
    ScoreState,
    SpansState,
    TokenAttrState,
    TokenizationState,
    make_pipeline_state,
    register_twin,
)
from spacy_lean.scoring.base import IdentityAlignment, aligned_x2y
from spacy_lean.scoring.deps import lower_dep_getter
from spacy_lean.scoring.testing import assert_scores_equal


@pytest.fixture(scope="module")
def nlp():
    return spacy.blank("en")


def _parsed(nlp, words, heads, deps):
    return Doc(nlp.vocab, words=words, heads=heads, deps=deps)


def test_deps_missing_labels_stay_in_their_doc(nlp):
    """spaCy 3.8 keeps missing indices across docs: doc 1's unlabelled token 2
    hides token 2 of doc 2. Hand-computed: doc 1 scores tokens 0-1 (2 correct),
    doc 2 tokens 0-2 (3 correct), so UAS = LAS = 5/5 = 1.0; spaCy gives 8/9."""
    words, heads = ["a", "b", "c"], [1, 1, 1]
    gold1 = _parsed(nlp, words, heads, ["det", "ROOT", ""])
    gold2 = _parsed(nlp, words, heads, ["det", "ROOT", "obj"])
    pred = _parsed(nlp, words, heads, ["det", "ROOT", "obj"])
    examples = [Example(pred, gold1), Example(pred.copy(), gold2)]
    state = DepsState("dep", getter=lower_dep_getter, ignore_labels=("p", "punct"))
    state.update(examples)
    res = state.result()
    assert res["dep_uas"] == 1.0 and res["dep_las"] == 1.0
    assert res["dep_las_per_type"]["obj"] == {"p": 1.0, "r": 1.0, "f": 1.0}
    spacy_res = Scorer.score_deps(examples, "dep", getter=lower_dep_getter)
    assert spacy_res["dep_uas"] == pytest.approx(8 / 9)  # the bug we fix
    # Per doc, spaCy agrees with us: the fix only removes the cross-doc leak.
    for eg in examples:
        one = DepsState("dep", getter=lower_dep_getter)
        one.update([eg])
        assert_scores_equal(Scorer.score_deps([eg], "dep", getter=lower_dep_getter), one.result())


def test_deps_unaligned_tokens_count_as_false_positives(nlp):
    gold = _parsed(nlp, ["ab", "c"], [1, 1], ["nsubj", "ROOT"])
    pred = Doc(
        nlp.vocab,
        words=["a", "b", "c"],
        spaces=[False, True, False],
        heads=[2, 2, 2],
        deps=["nsubj", "nsubj", "ROOT"],
    )
    eg = Example(pred, gold)
    state = DepsState("dep")
    state.update([eg])
    # both 'a' and 'b' align to 'ab' (a set: one pair counts once)
    assert_scores_equal(Scorer.score_deps([eg], "dep"), state.result())


def _cats_doc(nlp, cats):
    doc = Doc(nlp.vocab, words=["x"])
    doc.cats = cats
    return doc


def test_cats_exclusive_without_prediction(nlp):
    """spaCy 3.8 raises a ValueError when exclusive labels have a reference label
    and no prediction. Hand-computed: POSITIVE has 1 false negative, NEGATIVE 1
    true positive."""
    labels = ["POSITIVE", "NEGATIVE"]
    examples = [
        Example(_cats_doc(nlp, {}), _cats_doc(nlp, {"POSITIVE": 1.0, "NEGATIVE": 0.0})),
        Example(
            _cats_doc(nlp, {"POSITIVE": 0.3, "NEGATIVE": 0.7}),
            _cats_doc(nlp, {"POSITIVE": 0.0, "NEGATIVE": 1.0}),
        ),
    ]
    with pytest.raises(ValueError):
        Scorer.score_cats(examples, "cats", labels=labels, multi_label=False)
    state = CatsState("cats", labels=labels, multi_label=False)
    state.update(examples)
    res = state.result()
    assert res["cats_f_per_type"] == {
        "POSITIVE": {"p": 0.0, "r": 0.0, "f": 0.0},
        "NEGATIVE": {"p": 1.0, "r": 1.0, "f": 1.0},
    }
    assert res["cats_micro_p"] == 1.0
    assert res["cats_micro_r"] == 0.5
    assert res["cats_micro_f"] == pytest.approx(2 / 3)
    assert res["cats_macro_f"] == pytest.approx(0.5)
    assert res["cats_score"] == res["cats_macro_f"] and res["cats_score_desc"] == "macro F"
    # POSITIVE: the positive doc scored 0.0 (no prediction), the negative 0.3.
    assert res["cats_auc_per_type"] == {"POSITIVE": 0.0, "NEGATIVE": 1.0}
    assert res["cats_macro_auc"] == pytest.approx(0.5)


def test_auc_counts_hand_computed(nlp):
    # scores (gold): 0.9 (1), 0.5 (0), 0.5 (1), 0.1 (0): 3 of 4 pairs ranked
    # right, one tie counted half -> AUC = 3.5 / 4.
    data = [(0.9, 1.0), (0.5, 0.0), (0.5, 1.0), (0.1, 0.0)]
    examples = [Example(_cats_doc(nlp, {"A": p}), _cats_doc(nlp, {"A": g})) for p, g in data]
    state = CatsState("cats", labels=["A"], multi_label=True)
    state.update(examples)
    assert state.result()["cats_auc_per_type"]["A"] == pytest.approx(0.875)
    assert len(state.auc_per_type["A"].counts) == 3  # one entry per distinct score


_BLANK = spacy.blank("en")
_SCORES = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5000000001, 0.75, 0.9, 1.0])


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(_SCORES, min_size=3, max_size=3),
            st.lists(st.sampled_from([0.0, 1.0, None]), min_size=3, max_size=3),
        ),
        min_size=0,
        max_size=25,
    ),
    multi_label=st.booleans(),
    threshold=st.sampled_from([None, 0.3, 0.5]),
    positive=st.booleans(),
    cut=st.integers(min_value=0, max_value=25),
)
def test_cats_state_equals_score_cats(rows, multi_label, threshold, positive, cut):
    nlp = _BLANK
    labels = ["AA", "BB", "CC"] if multi_label or not positive else ["AA", "BB"]
    examples = []
    for scores, golds in rows:
        pred = dict(zip(labels, scores))
        if multi_label:
            gold = {k: g for k, g in zip(labels, golds) if g is not None}
        else:  # exactly one positive reference label
            gold = {k: 0.0 for k in labels}
            gold[labels[int(scores[0] * 10) % len(labels)]] = 1.0
        examples.append(Example(_cats_doc(nlp, pred), _cats_doc(nlp, gold)))
    cfg = dict(labels=labels, multi_label=multi_label, threshold=threshold)
    if positive and not multi_label:
        cfg["positive_label"] = "AA"
    expected = Scorer.score_cats(examples, "cats", **cfg)
    first, second = CatsState("cats", **cfg), CatsState("cats", **cfg)
    first.update(examples[:cut])
    second.update(examples[cut:])
    second = CatsState.from_dict(srsly.json_loads(srsly.json_dumps(second.to_dict())), **cfg)
    assert_scores_equal(expected, first.merge(second).result())


def test_token_attr_custom_getter_and_missing_values(nlp):
    gold = Doc(nlp.vocab, words=["Alpha", "beta", "Gamma", "d"])
    pred = Doc(nlp.vocab, words=["Alpha", "beta", "Gamma", "d"])

    def getter(token, attr):
        return "up" if token.text[0].isupper() else ("skip" if token.text == "d" else "low")

    eg = Example(pred, gold)
    kwargs = dict(getter=getter, missing_values={"skip"})
    state = TokenAttrState("shape", **kwargs)
    state.update([eg])
    assert_scores_equal(Scorer.score_token_attr([eg], "shape", **kwargs), state.result())
    assert state.result() == {"shape_acc": 1.0}


def test_tokenization_skips_unknown_spaces(nlp):
    gold = Doc(nlp.vocab, words=["a", "b"])  # spaces unknown
    pred = Doc(nlp.vocab, words=["a", "b"], spaces=[True, False])
    eg = Example(pred, gold)
    state = TokenizationState()
    state.update([eg])
    assert_scores_equal(Scorer.score_tokenization([eg]), state.result())
    assert state.result()["token_acc"] is None


def test_merge_refuses_other_kinds():
    with pytest.raises(TypeError, match="Cannot merge"):
        TokenizationState().merge(CatsState(labels=["A"]))
    with pytest.raises(ValueError, match="kind"):
        TokenizationState().load_dict({"kind": "cats"})


def test_states_of_other_settings_are_refused(nlp):
    """A tag state loaded the counts of a pos state (its tag_acc was pos's), and merged
    one; a multi-label cats state merged an exclusive one; a spans state loaded
    another key's counts. The settings that decide what a state counts are checked
    on merge and load now (docs/scoring.md says so)."""
    pos = TokenAttrState("pos")
    pos.update([Example.from_dict(nlp.make_doc("a b"), {"pos": ["NOUN", "VERB"]})])
    with pytest.raises(ValueError, match="attr 'pos' into a TokenAttrState of attr 'tag'"):
        TokenAttrState("tag").load_dict(pos.to_dict())
    with pytest.raises(ValueError, match="attr='pos' into one with attr='tag'"):
        TokenAttrState("tag").merge(pos)
    with pytest.raises(ValueError, match="multi_label=False.*multi_label=True"):
        CatsState(labels=["A"], multi_label=True).merge(CatsState(labels=["A"], multi_label=False))
    with pytest.raises(ValueError, match="attr 'sents'"):
        SpansState("spans_sc").load_dict(SpansState("sents").to_dict())
    with pytest.raises(ValueError, match="allow_overlap"):
        SpansState("spans_sc").merge(SpansState("spans_sc", allow_overlap=True))
    merged = TokenAttrState("pos").merge(pos)  # the same settings still merge
    assert merged.result() == pos.result()
    # Loading checks what merging checks: the settings are saved with the counts.
    cats = CatsState(labels=["A"], multi_label=True, threshold=0.5).to_dict()
    with pytest.raises(ValueError, match="threshold 0.5 into a CatsState of threshold 0.9"):
        CatsState(labels=["A"], multi_label=True, threshold=0.9).load_dict(cats)
    with pytest.raises(ValueError, match="multi_label True"):
        CatsState(labels=["A"], multi_label=False).load_dict(cats)
    with pytest.raises(ValueError, match="labeled True into a SpansState of labeled False"):
        SpansState("spans_sc", labeled=False).load_dict(SpansState("spans_sc").to_dict())
    # A state saved without its settings (before they were saved) still loads.
    old = {k: v for k, v in cats.items() if k not in ("multi_label", "threshold", "attr")}
    CatsState(labels=["A"], multi_label=True).load_dict(old)
    # One setting, NaN included, is the same setting.
    nan = float("nan")
    CatsState(labels=["A"], threshold=nan).merge(CatsState(labels=["A"], threshold=nan))
    saved = srsly.json_loads(srsly.json_dumps(CatsState(labels=["A"], threshold=nan).to_dict()))
    CatsState(labels=["A"], threshold=nan).load_dict(saved)


# -- custom scorers --------------------------------------------------------------


def _count_ents(examples, **kwargs):
    n_pred = sum(len(eg.predicted.ents) for eg in examples)
    n_gold = sum(len(eg.reference.ents) for eg in examples)
    return {"n_pred_ents": n_pred, "ents_ratio": n_pred / n_gold if n_gold else None}


@spacy.registry.scorers("spacy_lean_test.count_ents.v1")
def make_count_ents_scorer():
    return _count_ents


@spacy.registry.scorers("spacy_lean_test.count_ents_twinned.v1")
def make_count_ents_scorer_twinned():
    return lambda examples, **kwargs: _count_ents(examples)


class CountEntsState(ScoreState):
    """A twin of `_count_ents`, as a user would write one."""

    kind = "count_ents"

    def __init__(self, **cfg):
        self.n_pred = self.n_gold = 0

    def update(self, examples):
        for eg in examples:
            self.n_pred += len(eg.predicted.ents)
            self.n_gold += len(eg.reference.ents)

    def _merge(self, other):
        self.n_pred += other.n_pred
        self.n_gold += other.n_gold

    def result(self):
        ratio = self.n_pred / self.n_gold if self.n_gold else None
        return {"n_pred_ents": self.n_pred, "ents_ratio": ratio}

    def to_dict(self):
        return {"kind": self.kind, "n": [self.n_pred, self.n_gold]}

    def load_dict(self, data):
        self._check_kind(data)
        self.n_pred, self.n_gold = data["n"]
        return self


def _ruler_pipeline(scorer_name):
    nlp = spacy.blank("en")
    ruler = nlp.add_pipe("entity_ruler", config={"scorer": {"@scorers": scorer_name}})
    ruler.add_patterns([{"label": "ORG", "pattern": "Acme"}, {"label": "LOC", "pattern": "Oslo"}])
    texts = ["Acme moved to Oslo .", "Nothing here .", "Oslo and Acme and Oslo ."]
    examples = []
    for text in texts:
        gold = nlp.make_doc(text)
        gold.ents = [gold.char_span(0, 4, label="ORG")] if text.startswith("Acme") else []
        examples.append(Example(nlp(text), gold))
    return nlp, examples


def test_custom_scorer_without_twin_keeps_slim_examples():
    nlp, examples = _ruler_pipeline("spacy_lean_test.count_ents.v1")
    if not Doc.has_extension("trf_data"):
        Doc.set_extension("trf_data", default=None)
    for eg in examples:
        eg.predicted._.trf_data = object()  # stands in for transformer output
    # ... and it says that the copies hold no vectors for the scorer to read.
    match = "'entity_ruler'.*no mergeable twin.*register_twin.*no doc.tensor.*prepare"
    with pytest.warns(UserWarning, match=match):
        state = make_pipeline_state(nlp)
    assert state.fallbacks == ["entity_ruler"]
    state.update(examples[:2])
    kept = state.states[-1][1].examples
    assert all(eg.predicted._.trf_data is None for eg in kept)
    assert all(eg.predicted is not orig.predicted for eg, orig in zip(kept, examples))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = make_pipeline_state(nlp)
    other.update(examples[2:])
    other = type(other).from_dict(srsly.json_loads(srsly.json_dumps(other.to_dict())), nlp)
    expected = Scorer(nlp).score(examples)
    got = state.merge(other).result()
    got.pop("speed")
    assert_scores_equal(expected, got)
    assert got["n_pred_ents"] == 5


def test_registered_twin_is_used_by_scorer_name():
    register_twin("spacy_lean_test.count_ents_twinned.v1", CountEntsState)
    nlp, examples = _ruler_pipeline("spacy_lean_test.count_ents_twinned.v1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = make_pipeline_state(nlp)
    assert state.fallbacks == []
    state.update(examples)
    got = state.result()
    got.pop("speed")
    assert_scores_equal(Scorer(nlp).score(examples), got)


def test_registered_twin_is_used_by_function():
    def my_scorer(examples, **kwargs):
        return _count_ents(examples)

    register_twin(my_scorer, CountEntsState)
    nlp, examples = _ruler_pipeline("spacy_lean_test.count_ents.v1")
    nlp.get_pipe("entity_ruler").scorer = my_scorer
    # the config still names a scorer without a twin; the function has one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = make_pipeline_state(nlp)
    state.update(examples)
    assert state.result()["n_pred_ents"] == 5


def test_a_built_in_scorer_name_is_not_trusted_where_another_scorer_runs():
    """The twin was chosen by the config's `@scorers` name: an entity_ruler whose
    scorer was replaced (or wrapped by its factory) was scored with the ner twin,
    giving other keys and numbers than `nlp.evaluate`, with nothing said. A built-in
    name's twin is used only where spaCy's function runs; otherwise the function
    decides (here: none, so the exact fallback, with its warning)."""

    def wrapped(examples, **kwargs):
        from spacy.pipeline.entityruler import entity_ruler_score

        return {**entity_ruler_score(examples, **kwargs), **_count_ents(examples)}

    nlp, examples = _ruler_pipeline("spacy.entity_ruler_scorer.v1")
    nlp.get_pipe("entity_ruler").scorer = wrapped
    with pytest.warns(UserWarning, match="'entity_ruler'.*no mergeable twin") as record:
        state = make_pipeline_state(nlp)
    assert record[0].filename == __file__  # the warning points at the caller
    assert state.fallbacks == ["entity_ruler"]
    state.update(examples)
    got = state.result()
    got.pop("speed")
    assert got["n_pred_ents"] == 5
    assert_scores_equal(Scorer(nlp).score(examples), got)
    # spaCy's own function under its own name: the twin, no warning.
    nlp, examples = _ruler_pipeline("spacy.entity_ruler_scorer.v1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_pipeline_state(nlp).fallbacks == []


class _NoneResultState(CountEntsState):
    kind = "none_result"

    def result(self):
        return None


def test_a_twin_of_the_wrong_type_is_named():
    """A twin factory returning something else than a ScoreState failed with
    "'dict' object has no attribute 'prepare'", and a result() of None with
    "'NoneType' object is not iterable", naming neither the component nor the twin."""

    def returns_dict(**kwargs):
        return {}

    def my_scorer(examples, **kwargs):
        return _count_ents(examples)

    nlp, examples = _ruler_pipeline("spacy_lean_test.count_ents.v1")
    nlp.get_pipe("entity_ruler").scorer = my_scorer
    register_twin(my_scorer, returns_dict)
    with pytest.raises(TypeError, match="twin .*returns_dict of component 'entity_ruler'.*dict"):
        make_pipeline_state(nlp)
    register_twin(my_scorer, _NoneResultState)
    state = make_pipeline_state(nlp)
    state.update(examples)
    with pytest.raises(TypeError, match="component 'entity_ruler' .*NoneType from result"):
        state.result()


def test_register_twin_rejects_bad_keys():
    with pytest.raises(TypeError, match="registered scorer name or the scorer function"):
        register_twin(42, CountEntsState)


def test_tokenization_codes_split_into_chunks(nlp, monkeypatch):
    texts = ["Hello world .", "Mr. Smith's dog", "a-b c", "", "x"]
    examples = []
    for text in texts:
        gold = Doc(nlp.vocab, words=text.replace("-", " - ").split() or ["."])
        pred = nlp.make_doc(gold.text)
        examples.append(Example(pred, gold))
    whole = TokenizationState()
    whole.update(examples)
    monkeypatch.setattr(TokenizationState, "_max_code", 1)  # one doc per chunk
    chunked = TokenizationState()
    chunked.update(examples)
    assert chunked.to_dict() == whole.to_dict()
    assert_scores_equal(Scorer.score_tokenization(examples), chunked.result())


_DEPS = ["nsubj", "dobj", "det", "punct", "ROOT", "Compound"]
_TAGS = ["NN", "VB", "DT", ""]
_MORPHS = ["Number=Sing", "Number=Plur|Person=3", "Tense=Past|VerbForm=Fin", "", "_"]


@st.composite
def _token_examples(draw, allow_missing_deps_in_last=True):
    """Examples with random tokenization differences, tags, morphs and parses;
    missing dependency labels only in the last doc (where spaCy is right)."""
    n_docs = draw(st.integers(min_value=1, max_value=4))
    examples = []
    for k in range(n_docs):
        n = draw(st.integers(min_value=1, max_value=8))
        words = [draw(st.sampled_from(["ab", "c", "de", "f", "ghi", "."])) for _ in range(n)]
        spaces = [draw(st.booleans()) for _ in range(n - 1)] + [False]
        last = k == n_docs - 1 and allow_missing_deps_in_last

        def annotate(n_tok, missing_ok):
            heads = [0] + [draw(st.integers(min_value=0, max_value=i)) for i in range(1, n_tok)]
            labels = _DEPS + ([""] if missing_ok else [])
            deps = [draw(st.sampled_from(labels)) for _ in range(n_tok)]
            tags = [draw(st.sampled_from(_TAGS)) for _ in range(n_tok)]
            morphs = [draw(st.sampled_from(_MORPHS)) for _ in range(n_tok)]
            return heads, deps, tags, morphs

        heads, deps, tags, morphs = annotate(n, last)
        gold = Doc(
            _BLANK.vocab,
            words=words,
            spaces=spaces,
            heads=heads,
            deps=deps,
            tags=tags,
            morphs=morphs,
        )
        # Predicted tokenization: split some words, merge some unspaced neighbours.
        p_words, p_spaces = [], []
        i = 0
        while i < n:
            w, sp = words[i], spaces[i]
            if not sp and i + 1 < n and draw(st.booleans()):
                w, sp = w + words[i + 1], spaces[i + 1]
                i += 1
            if len(w) >= 2 and draw(st.integers(0, 3)) == 0:
                p_words += [w[:1], w[1:]]
                p_spaces += [False, sp]
            else:
                p_words.append(w)
                p_spaces.append(sp)
            i += 1
        heads, deps, tags, morphs = annotate(len(p_words), False)
        pred = Doc(
            _BLANK.vocab,
            words=p_words,
            spaces=p_spaces,
            heads=heads,
            deps=deps,
            tags=tags,
            morphs=morphs,
        )
        examples.append(Example(pred, gold))
    return examples


@settings(max_examples=120, deadline=None)
@given(examples=_token_examples(), cut=st.integers(min_value=0, max_value=4))
def test_token_level_states_equal_spacy_on_misaligned_docs(examples, cut):
    from spacy_lean.scoring import TokenAttrPerFeatState
    from spacy_lean.scoring.tokens import morph_key_getter

    def twins():
        return [
            (TokenizationState(), lambda egs: Scorer.score_tokenization(egs)),
            (TokenAttrState("tag"), lambda egs: Scorer.score_token_attr(egs, "tag")),
            (
                TokenAttrState("morph", getter=morph_key_getter),
                lambda egs: Scorer.score_token_attr(egs, "morph", getter=morph_key_getter),
            ),
            (
                TokenAttrPerFeatState("morph", getter=morph_key_getter),
                lambda egs: Scorer.score_token_attr_per_feat(egs, "morph", getter=morph_key_getter),
            ),
            (
                DepsState("dep", getter=lower_dep_getter, ignore_labels=("punct",)),
                lambda egs: Scorer.score_deps(
                    egs, "dep", getter=lower_dep_getter, ignore_labels=("punct",)
                ),
            ),
            (DepsState("dep"), lambda egs: Scorer.score_deps(egs, "dep")),
        ]

    for (first, spacy_score), (second, _) in zip(twins(), twins()):
        first.update(examples[:cut])
        second.update(examples[cut:])
        merged = first.merge(type(second).from_dict(second.to_dict(), **_cfg_of(second)))
        assert_scores_equal(spacy_score(examples), merged.result())


def _cfg_of(state):
    cfg = {k: getattr(state, k) for k in ("attr", "getter", "ignore_labels") if hasattr(state, k)}
    if isinstance(state, TokenizationState):
        return {}
    return cfg


def _random_spans(draw, n, max_spans, overlap):
    spans, taken = [], set()
    for _ in range(draw(st.integers(min_value=0, max_value=max_spans))):
        start = draw(st.integers(min_value=0, max_value=n - 1))
        end = draw(st.integers(min_value=start + 1, max_value=min(n, start + 3)))
        if not overlap and taken & set(range(start, end)):
            continue
        taken |= set(range(start, end))
        spans.append((start, end, draw(st.sampled_from(["AA", "BB", "CC"]))))
    return spans


@st.composite
def _span_examples(draw):
    """Examples with random (mis)tokenization, entities with KB ids and missing
    entity annotation, and span groups that may be absent."""
    examples = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        n = draw(st.integers(min_value=1, max_value=8))
        words = [draw(st.sampled_from(["ab", "c", "de", "f"])) for _ in range(n)]
        spaces = [draw(st.booleans()) for _ in range(n - 1)] + [False]
        gold = Doc(_BLANK.vocab, words=words, spaces=spaces)
        p_words, p_spaces, i = [], [], 0
        while i < n:
            w, sp = words[i], spaces[i]
            if len(w) >= 2 and draw(st.integers(0, 3)) == 0:
                p_words += [w[:1], w[1:]]
                p_spaces += [False, sp]
            else:
                p_words.append(w)
                p_spaces.append(sp)
            i += 1
        pred = Doc(_BLANK.vocab, words=p_words, spaces=p_spaces)
        for doc in (gold, pred):
            ents = [
                Span(doc, s, e, label=lab, kb_id=draw(st.sampled_from(["Q1", "Q2", "NIL", ""])))
                for s, e, lab in _random_spans(draw, len(doc), 3, overlap=False)
            ]
            missing = []
            if doc is gold and draw(st.booleans()):
                free = [i for i in range(len(doc)) if not any(e.start <= i < e.end for e in ents)]
                missing = [doc[i : i + 1] for i in free[:1]]
            if doc is pred or draw(st.integers(0, 5)) > 0:
                doc.set_ents(ents, missing=missing, default="outside")
            if draw(st.integers(0, 4)) > 0:
                doc.spans["sc"] = [
                    Span(doc, s, e, label=lab)
                    for s, e, lab in _random_spans(draw, len(doc), 4, overlap=True)
                ]
        examples.append(Example(pred, gold))
    return examples


@settings(max_examples=120, deadline=None)
@given(
    examples=_span_examples(),
    cut=st.integers(min_value=0, max_value=4),
    labeled=st.booleans(),
    allow_overlap=st.booleans(),
)
def test_span_states_equal_spacy(examples, cut, labeled, allow_overlap):
    from spacy_lean.scoring import LinksState, NERState, SpansState
    from spacy_lean.scoring.twins import _HasSpanGroup, _SpanGroupGetter
    from spacy.scorer import get_ner_prf

    span_cfg = dict(
        getter=_SpanGroupGetter(),
        has_annotation=_HasSpanGroup("sc"),
        labeled=labeled,
        allow_overlap=allow_overlap,
    )
    cases = [
        (lambda: NERState(), get_ner_prf),
        (
            lambda: SpansState("spans_sc", **span_cfg),
            lambda egs: Scorer.score_spans(egs, "spans_sc", **span_cfg),
        ),
        (
            lambda: LinksState(negative_labels=["NIL"]),
            lambda egs: Scorer.score_links(egs, negative_labels=["NIL"]),
        ),
    ]
    for make, spacy_score in cases:
        first, second = make(), make()
        first.update(examples[:cut])
        second.update(examples[cut:])
        first.merge(make().load_dict(srsly.json_loads(srsly.json_dumps(second.to_dict()))))
        assert_scores_equal(spacy_score(examples), first.result())


@spacy.registry.scorers("spacy_lean_test.ner_prf_entry_point.v1")
def make_ner_prf_scorer_ep():
    from spacy.scorer import get_ner_prf

    return lambda examples, **kwargs: get_ner_prf(examples)


def test_twin_from_entry_point_group(monkeypatch):
    """Packages can declare twins in the `spacy_lean_scoring_twins` group."""
    import importlib.metadata

    import catalogue

    ep = importlib.metadata.EntryPoint(
        name="spacy_lean_test.ner_prf_entry_point.v1",
        value="spacy_lean.scoring.spans:NERState",
        group="spacy_lean_scoring_twins",
    )
    monkeypatch.setattr(catalogue, "AVAILABLE_ENTRY_POINTS", importlib.metadata.EntryPoints([ep]))
    nlp, examples = _ruler_pipeline("spacy_lean_test.ner_prf_entry_point.v1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = make_pipeline_state(nlp)
    assert state.fallbacks == []
    assert type(state.states[-1][1]).__name__ == "NERState"
    state.update(examples)
    got = state.result()
    got.pop("speed")
    assert_scores_equal(Scorer(nlp).score(examples), got)
    assert got["ents_per_type"]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "Bank", "İ", "é", " ", "\n", ",", "don't", "x" * 9]),
            st.booleans(),
        ),
        min_size=0,
        max_size=25,
    ),
    st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_aligned_x2y_is_spacys_alignment(words, merge):
    """The identity shortcut (same tokens on both sides) gives what spaCy's character
    alignment gives, and other tokenizations fall back to spaCy's."""
    vocab = spacy.blank("en").vocab
    texts = [w for w, _ in words]
    spaces = [s and not w.isspace() for w, s in words]
    reference = Doc(vocab, words=texts, spaces=spaces)
    predicted = Doc(vocab, words=texts, spaces=spaces)
    if merge and len(reference) > 1:
        with reference.retokenize() as retok:
            retok.merge(reference[0:2])
    eg = Example(predicted, reference)
    ours = aligned_x2y(eg)
    assert isinstance(ours, IdentityAlignment) == (not merge or len(predicted) <= 1)
    theirs = eg.alignment.x2y
    assert list(ours.lengths) == list(theirs.lengths)
    assert list(ours.data) == list(theirs.data)
    for start in range(len(predicted)):
        assert list(ours[start]) == list(theirs[start])
        for end in range(start, len(predicted) + 1):
            assert list(ours[start:end]) == list(theirs[start:end])


@pytest.mark.parametrize(
    "data,field",
    [
        ({"golds": ["0x1p+0"], "counts": [["0x1p-1", -1, 0]]}, "auc.counts[0][1]"),
        ({"golds": ["0x1p+0"], "counts": [["0x1p-1", 1, 0], ["0x1p-1", 0, 1]]}, "auc.counts[1][0]"),
        ({"golds": ["half"], "counts": []}, "auc.golds[0]"),
        ({"golds": [], "counts": [["0x1p-1", 1]]}, "auc.counts[0]"),
        ([], "auc"),
    ],
)
def test_saved_roc_counts_are_checked_as_they_load(data, field):
    from spacy_lean.scoring.base import StateFieldError
    from spacy_lean.scoring.cats import ScoreCounts

    with pytest.raises(StateFieldError) as err:
        ScoreCounts.from_list(data)
    assert err.value.field == field


def test_slim_examples_from_a_checkpoint_are_checked_before_they_inflate():
    """A custom scorer's slim examples travel in a checkpoint as a base64 DocBin, which
    DocBin.from_bytes inflated whole: 10 KB of zlib made 10 MB (and 1 MB, a GB)."""
    import base64
    import zlib

    from spacy.tokens import DocBin

    from spacy_lean.scoring.base import StateFieldError
    from spacy_lean.scoring.pipeline import SlimExamplesState

    nlp = spacy.blank("en")
    state = SlimExamplesState(lambda examples: {}, nlp.vocab)
    good = DocBin(docs=[nlp("A short doc.")]).to_bytes()
    data = {"kind": "slim_examples", "predicted": base64.b64encode(good).decode()}
    data["reference"] = data["predicted"]
    assert len(state.load_dict(data).examples) == 1
    bomb = base64.b64encode(zlib.compress(b"\0" * 10**7, 9)).decode()
    for field, value, needle in (
        ("predicted", bomb, "inflates to at most 200 times its size"),
        ("reference", "not base64!", "a DocBin as base64 text"),
        ("reference", 5, "a DocBin as base64 text"),
        ("reference", base64.b64encode(zlib.compress(b"junk")).decode(), "a DocBin spaCy can"),
    ):
        with pytest.raises(StateFieldError, match=needle) as err:
            state.load_dict(dict(data, **{field: value}))
        assert err.value.field == field
