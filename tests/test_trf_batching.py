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


def _gradients(nlp):
    """Every gradient of the pipeline, torch's and thinc's, as numpy arrays."""
    from spacy_lean.training._nodes import pipeline_nodes
    from spacy_lean.training.update import _torch_modules

    nodes = pipeline_nodes(nlp)
    torch_params = [p for module in _torch_modules(nodes) for p in module.parameters()]
    thinc = [
        get_current_ops().to_numpy(node.get_grad(name)).copy()
        for node in nodes
        for name in node.param_names
        if node.has_grad(name)
    ]
    return [p.grad.detach().cpu().numpy().copy() for p in torch_params if p.grad is not None], thinc


def _zero_gradients(nlp):
    from spacy_lean.training._nodes import pipeline_nodes
    from spacy_lean.training.update import _torch_modules

    nodes = pipeline_nodes(nlp)
    for module in _torch_modules(nodes):
        for p in module.parameters():
            p.grad = None
    for node in nodes:
        for name in node.param_names:
            if node.has_grad(name):
                node.get_grad(name).fill(0)


def _no_model_dropout(nlp):
    """Zero the Hugging Face model's own dropout (other masks per group otherwise)."""
    import torch

    for module in hf_layer(nlp).shims[0]._hfmodel.transformer.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "dropout_prob", None), float):  # SDPA attention's own
            module.dropout_prob = 0.0


def test_training_groups_backprop_the_whole_batchs_gradients(trf_ner_nlp):
    """With train=True the transformer's training pass runs in length-sorted groups:
    the same hidden states for every real wordpiece, and for the same output gradient
    (zero on padding, as the listeners give it) the same parameter gradients."""
    import torch
    from spacy_transformers.data_classes import FullTransformerBatch
    from transformers.utils import ModelOutput

    nlp = trf_ner_nlp
    _no_model_dropout(nlp)
    trf = nlp.get_pipe("transformer")
    gold = synthetic.make_ner_docs(spacy.blank("en"), 16, seed=7, long_doc_rate=0.4)
    docs = [nlp.make_doc(d.text) for d in gold]
    counts, handle = count_wordpieces(nlp)
    results = []
    try:
        for grouped in (False, True):
            _zero_gradients(nlp)
            counts.update(run=0, real=0, calls=0)
            ctx = sorted_span_groups(nlp, group_cost=0, train=True) if grouped else None
            if ctx is not None:
                ctx.__enter__()
            try:
                out, backprop = trf.model.begin_update(docs)
                hidden = out.model_output.last_hidden_state.detach().cpu().numpy().copy()
                mask = numpy.asarray(out.wordpieces.attention_mask, dtype="float32")
                d_hidden = numpy.random.RandomState(0).normal(size=hidden.shape).astype("float32")
                d_hidden *= mask[:, :, None]
                backprop(
                    FullTransformerBatch(
                        spans=out.spans,
                        wordpieces=out.wordpieces,
                        align=out.align,
                        model_output=ModelOutput(output_0=torch.from_numpy(d_hidden)),
                    )
                )
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            results.append((hidden, mask, _gradients(nlp)[0], dict(counts)))
    finally:
        handle.remove()
    (h_whole, mask, g_whole, c_whole), (h_grouped, _, g_grouped, c_grouped) = results
    assert c_grouped["calls"] > c_whole["calls"] == 1 and c_grouped["run"] < c_whole["run"]
    real = mask.astype(bool)
    numpy.testing.assert_allclose(h_grouped[real], h_whole[real], rtol=0, atol=1e-5)
    assert len(g_whole) == len(g_grouped) > 0
    for a, b in zip(g_whole, g_grouped):  # float32 sums in another order: 1e-5 of the scale
        numpy.testing.assert_allclose(
            b, a, rtol=1e-4, atol=1e-5 * max(1.0, float(numpy.abs(a).max()))
        )
    assert max(numpy.abs(a).max() for a in g_whole) > 0.1


def test_training_groups_in_a_pipeline_update(trf_ner_nlp):
    """Through `nlp.update` (the ner's listener gradient flowing back): the same loss
    and gradients as the whole batch, up to the ner's sensitivity to float rounding
    (its oracle follows its own predictions, so a rounding difference in the scores can
    change which states are trained on)."""
    nlp = trf_ner_nlp
    _no_model_dropout(nlp)
    gold = synthetic.make_ner_docs(spacy.blank("en"), 16, seed=7, long_doc_rate=0.4)
    examples = [Example(nlp.make_doc(d.text), d) for d in gold]
    results = []
    for grouped in (False, True):
        _zero_gradients(nlp)
        fix_random_seed(0)  # the ner's oracle cuts are random
        if grouped:
            with sorted_span_groups(nlp, group_cost=0, train=True):
                losses = nlp.update(examples, sgd=False, drop=0.0)
        else:
            losses = nlp.update(examples, sgd=False, drop=0.0)
        results.append((_gradients(nlp), losses["ner"]))
    (whole, loss_whole), (grouped, loss_grouped) = results
    assert loss_grouped == pytest.approx(loss_whole, rel=1e-4)
    for kind in (0, 1):  # torch's parameters, thinc's
        assert len(whole[kind]) == len(grouped[kind]) > 0
        for a, b in zip(whole[kind], grouped[kind]):
            assert numpy.linalg.norm(b - a) <= 0.02 * numpy.linalg.norm(a) + 1e-6


def test_lean_update_sorts_spans_unless_told_not_to(trf_ner_nlp):
    """`lean_update` runs the transformer in length-sorted groups (`sort_spans`, on by
    default) and in one call with `sort_spans=False`; the layer is put back after (as
    lean_update leaves it: with the mixed-precision accumulation it installs for good)."""
    from spacy_lean.training import UpdatePolicy, install_mixed_precision_accumulation, lean_update

    nlp = trf_ner_nlp
    gold = synthetic.make_ner_docs(spacy.blank("en"), 16, seed=7, long_doc_rate=0.4)
    examples = [Example(nlp.make_doc(d.text), d) for d in gold]
    assert install_mixed_precision_accumulation(nlp) == 1
    forward = hf_layer(nlp)._func
    counts, handle = count_wordpieces(nlp)
    try:
        calls = {}
        for sort in (True, False):
            counts.update(run=0, real=0, calls=0)
            losses = lean_update(nlp, examples, policy=UpdatePolicy(sort_spans=sort))
            calls[sort] = (counts["calls"], counts["run"], counts["real"])
            assert losses["ner"] > 0 and hf_layer(nlp)._func is forward
    finally:
        handle.remove()
    assert calls[False][0] == 1 and calls[True][0] > 1
    assert calls[True][1] < calls[False][1] and calls[True][2] == calls[False][2]
    assert UpdatePolicy.from_dict(UpdatePolicy(sort_spans=False).to_dict()).sort_spans is False


def test_rows_without_wordpieces_run_in_a_group(tmp_path, blank_nlp):
    """A tokenizer that adds no [CLS]/[SEP] gives a whitespace-only doc no wordpieces;
    sorted into a group of their own, such rows ran the model at width 0 (an IndexError
    deep in BERT) where spaCy's one batch ran them beside the others."""
    from spacy_lean.trf_align import fast_alignment

    bare = synthetic.make_tiny_transformer(tmp_path / "bare", special_tokens=False)
    nlp = synthetic.build_trf_ner_pipeline(
        bare, synthetic.make_ner_docs(blank_nlp, 12, seed=4), n_steps=2
    )
    texts = [d.text for d in synthetic.make_ner_docs(blank_nlp, 6, seed=9)]
    texts = texts[:3] + ["   ", "\n\n", " \t "] * 4 + texts[3:]
    expected = [
        [(e.start, e.end, e.label_) for e in d.ents] for d in nlp.pipe(texts, batch_size=64)
    ]
    with fast_alignment(), sorted_span_groups(nlp) as changed:
        assert changed == 1
        got = [[(e.start, e.end, e.label_) for e in d.ents] for d in nlp.pipe(texts, batch_size=64)]
    assert got == expected
    assert plan_groups([0, 0, 40, 0], 0, 16)[-1] == [0, 1, 3]  # the empty rows, together


def test_a_left_padding_tokenizer_runs_whole_batches(tmp_path, blank_nlp, texts):
    """A tokenizer that pads on the left (padding_side = "left", XLNet's default) puts
    each row's wordpieces last: a group trimmed to its first `width` columns kept only
    padding, and short docs got zero vectors and other entities. Such batches run
    whole now, as in spacy-transformers."""
    import json
    import shutil

    from spacy_lean.trf_align import fast_alignment

    left = tmp_path / "left"
    shutil.copytree(synthetic.make_tiny_transformer(tmp_path / "tiny"), left)
    config_path = left / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf8"))
    config["padding_side"] = "left"
    config_path.write_text(json.dumps(config), encoding="utf8")
    nlp = synthetic.build_trf_ner_pipeline(
        left, synthetic.make_ner_docs(blank_nlp, 12, seed=4), n_steps=4
    )
    assert nlp.get_pipe("transformer").model.tokenizer.padding_side == "left"
    docs = ["Paris .", "Bank of Paris said so ."] + texts[:6]
    counts, handle = count_wordpieces(nlp)
    try:
        stock = list(nlp.pipe(docs, batch_size=64))
        stock_calls = counts["calls"]
        with fast_alignment(), sorted_span_groups(nlp, group_cost=0) as changed:
            assert changed == 1
            ours = list(nlp.pipe(docs, batch_size=64))
    finally:
        handle.remove()
    for a, b in zip(stock, ours):
        numpy.testing.assert_allclose(aligned_rows(a), aligned_rows(b), rtol=0, atol=1e-5)
        assert [(e.start, e.end, e.label_) for e in a.ents] == [
            (e.start, e.end, e.label_) for e in b.ents
        ]
    assert counts["calls"] == 2 * stock_calls  # the batches were not cut into groups
