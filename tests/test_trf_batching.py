"""Length-sorted span groups in prediction (spacy_lean.trf_batching): the same
predictions and the same hidden states for every real wordpiece, less padding run."""

import numpy
import pytest
import spacy
from hypothesis import given, settings
from hypothesis import strategies as st
from spacy.training import Example
from thinc.api import fix_random_seed, get_current_ops

from eval_util import add_ruler  # noqa: E402
from spacy_lean import synthetic
from spacy_lean.streaming import evaluate
from spacy_lean.trf_batching import plan_groups, sorted_span_groups


def plan_cost(lengths, groups, group_cost, step):
    return sum(len(g) * -(-max(lengths[i] for i in g) // step) * step + group_cost for g in groups)


def brute_force_best(lengths, group_cost, step):
    """The least cost over every cut of the rows sorted longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = None
    for mask in range(1 << max(0, len(order) - 1)):
        groups, group = [], [order[0]]
        for k in range(1, len(order)):
            if mask >> (k - 1) & 1:
                groups.append(group)
                group = []
            group.append(order[k])
        groups.append(group)
        cost = plan_cost(lengths, groups, group_cost, step)
        best = cost if best is None else min(best, cost)
    return best


@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=60),
    st.sampled_from([0, 64, 256, 2000]),
    st.sampled_from([1, 8, 16]),
)
@settings(max_examples=200, deadline=None)
def test_plan_groups_covers_every_row_once(lengths, group_cost, step):
    groups = plan_groups(lengths, group_cost, step)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    widths = [-(-max(lengths[i] for i in g) // step) * step for g in groups]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)
    # never worse than one group, or than one group per row
    cost = plan_cost(lengths, groups, group_cost, step)
    assert cost <= plan_cost(lengths, [list(range(len(lengths)))], group_cost, step)
    assert cost <= plan_cost(lengths, [[i] for i in range(len(lengths))], group_cost, step)


@given(st.lists(st.integers(1, 200), min_size=1, max_size=9), st.sampled_from([0, 30, 256]))
@settings(max_examples=150, deadline=None)
def test_plan_groups_is_optimal(lengths, group_cost):
    groups = plan_groups(lengths, group_cost, 16)
    assert plan_cost(lengths, groups, group_cost, 16) == brute_force_best(lengths, group_cost, 16)


def test_plan_groups_examples():
    assert plan_groups([100, 98, 60, 20, 19, 5], group_cost=0) == [[0, 1], [2], [3, 4], [5]]
    assert plan_groups([100, 98, 60, 20, 19, 5], group_cost=256) == [[0, 1, 2, 3, 4, 5]]
    assert plan_groups([130, 120], group_cost=0, max_width=128) == [
        [0, 1]
    ]  # both clipped: one width
    assert plan_groups([]) == []
    with pytest.raises(ValueError):
        plan_groups([3], group_cost=-1)


@pytest.fixture(scope="module")
def texts():
    docs = synthetic.make_ner_docs(spacy.blank("en"), 24, seed=5, long_doc_rate=0.3)
    return [d.text for d in docs]


def hf_layer(nlp):
    return nlp.get_pipe("transformer").model.layers[0]


def count_wordpieces(nlp):
    counts = {"run": 0, "real": 0, "calls": 0}

    def hook(module, args, kwargs):
        counts["calls"] += 1
        counts["run"] += int(kwargs["input_ids"].numel())
        counts["real"] += int(kwargs["attention_mask"].sum())

    model = hf_layer(nlp).shims[0]._hfmodel.transformer
    return counts, model.register_forward_pre_hook(hook, with_kwargs=True)


def aligned_rows(doc):
    data = doc._.trf_data
    hidden = get_current_ops().to_numpy(data.model_output.last_hidden_state)
    return hidden.reshape(-1, hidden.shape[-1])[data.align.data.ravel()]


def test_same_predictions_less_padding(trf_ner_nlp, texts):
    nlp = trf_ner_nlp
    counts, handle = count_wordpieces(nlp)
    try:
        stock = list(nlp.pipe(texts, batch_size=12))
        stock_counts = dict(counts)
        counts.update(run=0, real=0, calls=0)
        forward = hf_layer(nlp)._func
        with sorted_span_groups(nlp, group_cost=0) as changed:
            assert changed == 1 and hf_layer(nlp)._func is not forward
            with sorted_span_groups(nlp) as again:  # nested: nothing wrapped twice
                assert again == 0
            ours = list(nlp.pipe(texts, batch_size=12))
        assert hf_layer(nlp)._func is forward  # restored
    finally:
        handle.remove()
    assert counts["real"] == stock_counts["real"]
    assert counts["run"] < stock_counts["run"]  # less padding computed
    assert counts["calls"] > stock_counts["calls"]
    for a, b in zip(stock, ours):
        assert [(e.start, e.end, e.label_) for e in a.ents] == [
            (e.start, e.end, e.label_) for e in b.ents
        ]
        numpy.testing.assert_allclose(aligned_rows(a), aligned_rows(b), rtol=0, atol=1e-5)
        assert (
            a._.trf_data.model_output.last_hidden_state.shape
            == b._.trf_data.model_output.last_hidden_state.shape
        )


def test_training_is_not_changed(trf_ner_nlp, texts):
    """In training (is_train=True) the original forward runs: the output and its
    backprop callback are spacy-transformers' own."""
    nlp = trf_ner_nlp
    trf = nlp.get_pipe("transformer")
    docs = [nlp.make_doc(t) for t in texts[:6]]
    fix_random_seed(0)  # the same dropout masks in both
    out_a, _ = trf.model.begin_update(docs)
    with sorted_span_groups(nlp):
        fix_random_seed(0)
        out_b, backprop = trf.model.begin_update(docs)
        backprop(out_b)  # would raise in the grouped forward
    a = out_a.model_output.last_hidden_state.detach().cpu().numpy()
    b = out_b.model_output.last_hidden_state.detach().cpu().numpy()
    numpy.testing.assert_array_equal(a, b)


def test_evaluate_scores_equal_with_and_without_sorting(trf_ner_nlp):
    nlp = add_ruler(trf_ner_nlp)
    gold = synthetic.make_ner_docs(spacy.blank("en"), 30, seed=12, long_doc_rate=0.3)

    def examples():
        return [Example(nlp.make_doc(d.text), d) for d in gold]

    expected = nlp.evaluate(examples(), batch_size=8)
    for sort in (True, False):
        scores = evaluate(nlp, examples(), batch_size=8, sort_spans=sort)
        assert {k: v for k, v in scores.items() if k != "speed"} == {
            k: v for k, v in expected.items() if k != "speed"
        }


def test_bad_group_cost(trf_ner_nlp):
    with pytest.raises(ValueError, match="group_cost"):
        with sorted_span_groups(trf_ner_nlp, group_cost=-1):
            pass
