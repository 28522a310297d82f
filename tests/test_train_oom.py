"""Out-of-memory-safe training (issue 10, part 1): a batch that runs out of memory is
updated in micro-batches and gives the same update as the whole batch.

The pipeline is real: the tiny local BERT (dropout 0) with ner, textcat and tagger
listening to it, and `lean_oom_probe` last, which raises torch's OutOfMemoryError when a
batch's padded size (docs x longest doc) is above its limit, i.e. after the
transformer's backward pass has already added gradients, as a real out-of-memory error
in a late component would. Tolerance: each gradient and parameter array equal to
|a - b| <= 1e-4 |b| + max(1e-6, 1e-5 max|b|) elementwise (float32 sums taken in
another order, so elements that cancel out get an absolute error on the scale of the
array's largest), losses to rel 1e-5. Parameters after Adam steps (lr 1e-3): the same
with an absolute 3e-5, since Adam turns gradient noise on parameters whose true gradient
is zero (BERT's attention key biases: ~1e-10) into steps of up to lr x noise / eps.

This module is also given to `spacy train --code` (it registers the probe), so it keeps
its module level light.
"""

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy
import pytest
import spacy
from spacy.language import Language
from spacy.tokens import Doc, Span
from spacy.training import Example
from spacy.util import fix_random_seed
from thinc.api import Adam, Config, Model

from spacy_lean import synthetic
from spacy_lean.memory import DEFAULT_TRIM_SLACK_MB
from spacy_lean.training import (
    BatchTooLargeError,
    OOMSplitWarning,
    UpdatePolicy,
    enable_gradient_checkpointing,
    get_update_policy,
    install_exact_parser_gradient,
    install_lean_update,
    lean_update,
    plan_micro_batches,
)
from spacy_lean.training.callbacks import CALLBACK_NAME
from spacy_lean.training.dist import grad_scalers

RTOL, ATOL, SCALE_TOL = 1e-4, 1e-6, 1e-5
PARAM_ATOL = 3e-5


@Language.factory("lean_oom_probe", default_config={"limit": 0})
def make_oom_probe(nlp, name, limit):
    return OOMProbe(name, limit)


class OOMProbe:
    """Raises torch's OutOfMemoryError in `update` when the batch's padded size is above
    `limit` (0: never); records the docs of the updates that went through."""

    lean_loss_reduction = "sum"

    def __init__(self, name, limit):
        self.name = name
        self.limit = limit
        self.seen = []
        self.raised = 0

    def __call__(self, doc):
        return doc

    def update(self, examples, *, drop=0.0, sgd=None, losses=None):
        import torch

        lengths = [len(eg.predicted) for eg in examples]
        padded = len(lengths) * max(lengths)
        if self.limit and padded > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated: {padded} padded tokens > {self.limit})"
            )
        self.seen.extend(eg.predicted.text for eg in examples)
        return losses


def pipeline_config(transformer):
    """synthetic.TRF_NER_CONFIG (transformer + ner) with textcat and tagger listening
    too, the probe last, dropout 0 everywhere (the transformer's too), the ner's oracle
    cut off (it draws a random length per call), batches of 8 docs."""
    config = Config().from_str(synthetic.TRF_NER_CONFIG, interpolate=False)
    config["paths"]["transformer"] = str(transformer)
    config["nlp"]["pipeline"] = ["transformer", "ner", "textcat", "tagger", "oom_probe"]
    components = config["components"]
    trf = components["transformer"]["model"]
    trf["transformer_config"] = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    trf["get_spans"].update({"window": 32, "stride": 24})
    components["ner"]["update_with_oracle_cut_size"] = 0
    components["ner"]["model"]["hidden_width"] = 16
    listener = components["ner"]["model"]["tok2vec"]
    components["textcat"] = {
        "factory": "textcat",
        "model": {
            "@architectures": "spacy.TextCatCNN.v2",
            "exclusive_classes": True,
            "nO": None,
            "tok2vec": copy.deepcopy(listener),
        },
    }
    components["tagger"] = {
        "factory": "tagger",
        "model": {
            "@architectures": "spacy.Tagger.v2",
            "nO": None,
            "tok2vec": copy.deepcopy(listener),
        },
    }
    components["oom_probe"] = {"factory": "lean_oom_probe", "limit": 0}
    config["training"].update({"dropout": 0.0, "max_steps": 4, "eval_frequency": 4})
    config["training"]["batcher"] = {"@batchers": "spacy.batch_by_sequence.v1", "size": 8}
    return config


def annotate(docs):
    """Give the generated NER docs a document class and tags (for textcat and tagger)."""
    for doc in docs:
        has_person = any(ent.label_ == "PERSON" for ent in doc.ents)
        doc.cats = {"PERSON": float(has_person), "OTHER": float(not has_person)}
        for token in doc:
            token.tag_ = token.ent_type_ or ("PUNCT" if token.is_punct else "O")
    return docs


def make_examples(nlp, n, seed):
    docs = annotate(synthetic.make_ner_docs(nlp, n, seed=seed, long_doc_rate=0.0))
    return [Example(nlp.make_doc(d.text), d) for d in docs]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The models are tiny: a second torch thread only waits on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory, tiny_transformer):
    fix_random_seed(0)
    config = pipeline_config(tiny_transformer)
    nlp = spacy.util.load_model_from_config(config, auto_fill=True, validate=True)
    examples = make_examples(nlp, 24, seed=11)
    nlp.initialize(lambda: examples)
    path = tmp_path_factory.mktemp("oom_pipeline") / "model"
    nlp.to_disk(path)
    return path


@pytest.fixture(scope="module")
def batches(pipeline_dir):
    nlp = spacy.load(pipeline_dir)
    examples = make_examples(nlp, 24, seed=12)
    return [examples[i : i + 8] for i in range(0, 24, 8)]


def fresh(pipeline_dir, limit=0, exact=True):
    """The saved pipeline, with the probe's limit and (by default) the ner's exact
    W gradient, which `lean_update` installs too: the stock one is not additive over
    sub-batches (see test_stock_parser_gradient_depends_on_the_last_token)."""
    nlp = spacy.load(pipeline_dir)
    nlp.get_pipe("oom_probe").limit = limit
    if exact:
        assert install_exact_parser_gradient(nlp) == 1
    return nlp


def arrays(nlp, grads=False, labels=False):
    """Every thinc parameter (or gradient) and torch parameter (or .grad), in a fixed
    order, as numpy arrays; absent gradients as None. labels: (layer, name) instead."""
    out = []
    seen = set()
    for _, proc in nlp.pipeline:
        model = getattr(proc, "model", None)
        if model is None:
            continue
        for node in model.walk():
            if id(node) in seen:
                continue
            seen.add(id(node))
            for name in node.param_names:
                if labels:
                    out.append((node.name, name))
                elif grads:
                    grad = node.get_grad(name) if node.has_grad(name) else None
                    out.append(None if grad is None else node.ops.to_numpy(grad))
                else:
                    out.append(node.ops.to_numpy(node.get_param(name)))
            for shim in node.shims:
                for pname, param in shim._model.named_parameters():
                    if labels:
                        out.append(("torch", pname))
                        continue
                    value = param.grad if grads else param
                    out.append(None if value is None else value.detach().cpu().numpy().copy())
    return out


def assert_same(got, expected, what, atol=ATOL):
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        if a is None or b is None:
            assert a is None and b is None, f"{what} {i}: present in one run only"
            continue
        tol = max(atol, SCALE_TOL * float(numpy.abs(b).max())) if b.size else atol
        numpy.testing.assert_allclose(a, b, rtol=RTOL, atol=tol, err_msg=f"{what} {i}")


def assert_same_losses(got, expected):
    assert set(got) == set(expected)
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


def finish(nlp, optimizer):
    for _, proc in nlp.pipeline:
        if getattr(proc, "is_trainable", False):
            proc.finish_update(optimizer)


def test_plan_micro_batches():
    lengths = [5, 3, 8, 0, 2, 2, 7]
    assert plan_micro_batches(lengths, None) == [list(range(7))]
    assert plan_micro_batches(lengths, 56) == [list(range(7))]  # fits: unchanged order
    groups = plan_micro_batches(lengths, 16)
    assert sorted(i for g in groups for i in g) == list(range(7))  # each doc exactly once
    for g in groups:
        nonempty = [lengths[i] for i in g if lengths[i]]
        assert len(nonempty) * max(nonempty) <= 16 or len(nonempty) == 1
    assert 3 in groups[-1]  # the empty doc rides with the shortest docs
    assert plan_micro_batches([40, 3], 10) == [[0], [1]]  # too long alone: alone


def test_stock_parser_gradient_depends_on_the_last_token(pipeline_dir, batches):
    """Why `exact_parser_gradient` exists: with spaCy's own ner, a batch updated in
    two halves gives the whole batch's gradient for every parameter but the lower
    layer's W; with the exact gradient, W adds up too, and only W changed."""
    batch = batches[0]
    grads = {}
    for exact in (False, True):
        whole, halves = fresh(pipeline_dir, exact=exact), fresh(pipeline_dir, exact=exact)
        whole.update(batch, sgd=False)
        halves.update(batch[:3], sgd=False)
        halves.update(batch[3:], sgd=False)
        grads[exact] = (arrays(whole, grads=True), arrays(halves, grads=True))
    w = arrays(spacy.load(pipeline_dir), labels=True).index(("precomputable_affine", "W"))
    whole, halves = grads[False]
    with pytest.raises(AssertionError):
        assert_same([halves[w]], [whole[w]], "stock W grad")
    assert_same(halves[:w] + halves[w + 1 :], whole[:w] + whole[w + 1 :], "stock grad")
    whole_exact, halves_exact = grads[True]
    assert_same(halves_exact, whole_exact, "exact grad")
    assert_same(whole_exact[:w] + whole_exact[w + 1 :], whole[:w] + whole[w + 1 :], "grad")


def test_policy_settings_and_round_trip():
    with pytest.raises(ValueError, match="max_padded_tokens must be a positive"):
        UpdatePolicy(max_padded_tokens=0)
    policy = UpdatePolicy(max_padded_tokens=512)
    assert policy.learn(1000, 256) and not policy.learn(900, 300)
    assert policy.limit_for(1000) == 256 and policy.limit_for(4000) == 256
    assert policy.limit_for(500) == 512  # a smaller batch size learned nothing yet
    again = UpdatePolicy.from_dict(policy.to_dict())
    assert again.to_dict() == policy.to_dict()
    off = UpdatePolicy.from_dict({**policy.to_dict(), "trim_heap_slack_mb": None})
    assert off.trim_heap_slack_mb is None
    for bad in (-1, float("inf"), float("nan"), "8"):
        # inf and NaN passed, then crashed in the first update's int(slack * 2**20)
        with pytest.raises(ValueError, match="trim_heap_slack_mb must be a finite number >= 0"):
            UpdatePolicy(trim_heap_slack_mb=bad)
    with pytest.raises(ValueError, match="max_padded_tokens must be a positive.*got '4096'"):
        UpdatePolicy(max_padded_tokens="4096")  # a raw TypeError from `<` before


def test_updates_give_freed_host_memory_back(pipeline_dir, batches):
    """Before each update the previous step's freed heap pages go back to the OS (per
    the slack): training's resident memory does not creep up with the batches seen."""
    import sys

    from spacy_lean.memory import trim_host_memory

    if not sys.platform.startswith("linux") or not trim_host_memory():
        pytest.skip("needs glibc's malloc_trim")
    nlp = fresh(pipeline_dir)
    every = UpdatePolicy(trim_heap_slack_mb=0)
    for batch in batches:
        lean_update(nlp, batch, policy=every)
    assert every._trimmer.n_trims == len(batches)
    never = UpdatePolicy(trim_heap_slack_mb=None)
    for batch in batches:
        lean_update(nlp, batch, policy=never)
    assert never._trimmer is None and not never.trim_heap()
    slack = UpdatePolicy(trim_heap_slack_mb=10_000)  # far more than these steps free
    for batch in batches:
        lean_update(nlp, batch, policy=slack)
    assert slack._trimmer.n_trims == 0  # the first call measures the level; nothing grows 10 GB


def test_oom_split_gives_the_whole_batch_update(pipeline_dir, batches):
    """Two sub-batches per step (accumulate_gradient = 2), three steps, Adam: the run
    whose batches run out of memory ends with the same weights, gradients and losses
    as the run whose batches fit, and every example was updated exactly once."""
    whole = fresh(pipeline_dir)
    split = fresh(pipeline_dir, limit=150)
    assert_same(arrays(split), arrays(whole), "initial param")
    opt_whole, opt_split = Adam(0.001), Adam(0.001)
    policy = UpdatePolicy()
    sub_batches = [half for batch in batches for half in (batch[:4], batch[4:])]
    with pytest.warns(OOMSplitWarning, match="Out of memory on a batch of 4 docs") as record:
        for step in range(3):
            losses_whole, losses_split = {}, {}
            for sub in sub_batches[2 * step : 2 * step + 2]:
                whole.update(sub, sgd=False, losses=losses_whole)
                lean_update(split, sub, losses=losses_split, policy=policy)
            assert_same(arrays(split, grads=True), arrays(whole, grads=True), f"step {step} grad")
            assert_same_losses(losses_split, losses_whole)
            finish(whole, opt_whole)
            finish(split, opt_split)
    assert_same(arrays(split), arrays(whole), "param after 3 steps", atol=PARAM_ATOL)
    probe = split.get_pipe("oom_probe")
    texts = sorted(eg.predicted.text for batch in batches for eg in batch)
    assert sorted(probe.seen) == texts  # nothing skipped, nothing twice
    assert sorted(whole.get_pipe("oom_probe").seen) == texts
    stats = policy.stats()
    assert stats["batches"] == 6 and stats["examples"] == 24
    assert stats["oom_errors"] == probe.raised > 0
    assert stats["oom_splits"] >= 1 and stats["split_batches"] >= stats["oom_splits"]
    assert stats["micro_batches"] > stats["batches"]
    assert policy.learned_limits and all(v <= 150 for v in policy.learned_limits.values())
    # One warning per newly learned size, not one per batch.
    messages = [str(w.message) for w in record if issubclass(w.category, OOMSplitWarning)]
    assert len(messages) == len(set(messages)) == len(policy.learned_limits)


def fresh_mixed_precision(pipeline_dir, init_scale=None):
    model = {"mixed_precision": True}
    if init_scale is not None:
        model["grad_scaler_config"] = {"init_scale": init_scale}
    config = {"components": {"transformer": {"model": model}}}
    nlp = spacy.load(pipeline_dir, config=config)
    install_exact_parser_gradient(nlp)
    (scaler,) = grad_scalers(nlp)
    return nlp, scaler


def test_mixed_precision_off_the_gpu_is_refused_before_the_first_update(pipeline_dir, batches):
    """Mixed precision on the CPU failed at the first backward pass, after the pipeline
    was initialised, in thinc's grad scaler, naming neither the component nor the
    setting (the project's `--vars.mixed_precision true` without a GPU). Now refused
    before anything is updated, with the fix; prediction still runs."""
    nlp, scaler = fresh_mixed_precision(pipeline_dir)
    assert scaler._enabled
    before = arrays(nlp, grads=True)
    with pytest.raises(ValueError) as err:
        lean_update(nlp, batches[0])
    message = " ".join(str(err.value).split())
    assert "'transformer' trains with mixed precision" in message and "on the CPU" in message
    assert "--gpu-id 0" in message
    assert "components.transformer.model.mixed_precision = false" in message
    after = arrays(nlp, grads=True)
    assert all((a is None and b is None) or (a == b).all() for a, b in zip(after, before))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        assert len(list(nlp.pipe(eg.text for eg in batches[0]))) == len(batches[0])
        # Frozen (excluded), the transformer's backward pass never runs: trains as stock.
        losses = lean_update(nlp, batches[0], exclude=["transformer"], annotates=["transformer"])
    assert losses["ner"] > 0


def test_mixed_precision_micro_batches_give_the_whole_batch_update(
    pipeline_dir, batches, mixed_precision_on_the_cpu
):
    """With mixed precision, thinc's shim unscales every .grad of the torch model after
    each backward pass, the gradients accumulated by earlier passes too, so the
    transformer's gradient of every micro-batch but the last was divided by the scale
    (2^16) again: micro-batches (and lean_update's length-sorted span groups, one
    backward pass each) lost all but the last one's transformer gradient. Accumulated,
    they must give the whole batch's update, through optimizer steps (whose scale updates
    stay in step too)."""
    whole, whole_scaler = fresh_mixed_precision(pipeline_dir)
    split, split_scaler = fresh_mixed_precision(pipeline_dir)
    assert whole_scaler._enabled and float(whole_scaler._scale) == 2.0**16
    opt_whole, opt_split = Adam(0.001), Adam(0.001)
    policy = UpdatePolicy(max_padded_tokens=60)
    for step, batch in enumerate(batches[:2]):
        losses_whole, losses_split = {}, {}
        whole.update(batch, sgd=False, losses=losses_whole)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OOMSplitWarning)  # an oversize doc
            lean_update(split, batch, losses=losses_split, policy=policy)
        assert_same(arrays(split, grads=True), arrays(whole, grads=True), f"step {step} grad")
        assert_same_losses(losses_split, losses_whole)
        assert not split_scaler.found_inf and not whole_scaler.found_inf
        finish(whole, opt_whole)
        finish(split, opt_split)
    assert policy.micro_batches > policy.batches == 2
    assert_same(arrays(split), arrays(whole), "param after 2 steps", atol=PARAM_ATOL)
    assert float(split_scaler._scale) == float(whole_scaler._scale)


def test_an_overflow_in_a_failed_attempt_does_not_skip_the_retried_step(
    pipeline_dir, batches, mixed_precision_on_the_cpu, monkeypatch
):
    """Mixed precision: the whole batch's first attempt overflowed (thinc's scaler found
    an infinity, so the optimizer step would be skipped) and then ran out of memory.
    The retry in micro-batches overflows nowhere: the undo restores the scaler's flag
    with the gradients, and the step is not skipped."""
    from thinc.shims.pytorch_grad_scaler import PyTorchGradScaler

    overflow_next = [True]
    unscale = PyTorchGradScaler.unscale

    def unscale_overflowing_once(self, tensors):
        found = unscale(self, tensors)
        if overflow_next[0]:
            overflow_next[0] = False
            self._found_inf = found = True
        return found

    monkeypatch.setattr(PyTorchGradScaler, "unscale", unscale_overflowing_once)
    nlp, scaler = fresh_mixed_precision(pipeline_dir)
    nlp.get_pipe("oom_probe").limit = 150
    policy = UpdatePolicy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OOMSplitWarning)
        lean_update(nlp, batches[0], policy=policy)
    assert not overflow_next[0] and policy.oom_errors >= 1  # it overflowed, then split
    assert scaler.found_inf is False


def test_learned_size_is_kept(pipeline_dir, batches):
    nlp = fresh(pipeline_dir, limit=150)
    policy = UpdatePolicy()
    batch = batches[0]
    with pytest.warns(OOMSplitWarning):
        lean_update(nlp, batch, policy=policy)
    raised = nlp.get_pipe("oom_probe").raised
    assert raised >= 1 and policy.oom_splits == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", OOMSplitWarning)
        lean_update(nlp, batch, policy=policy)  # starts split: no new error, no warning
    assert nlp.get_pipe("oom_probe").raised == raised
    assert policy.oom_splits == 1 and policy.split_batches == 2


def test_token_ceiling_gives_the_whole_batch_update(pipeline_dir, batches):
    whole = fresh(pipeline_dir)
    capped = fresh(pipeline_dir)
    batch = batches[1]
    losses_whole, losses_capped = {}, {}
    whole.update(batch, sgd=False, losses=losses_whole)
    policy = UpdatePolicy(max_padded_tokens=60)
    longest = max(len(eg.predicted) for eg in batch)
    assert longest > 60  # an oversize doc: updated alone, counted, and said once
    with pytest.warns(OOMSplitWarning, match=f"A doc of {longest} tokens is longer than"):
        lean_update(capped, batch, losses=losses_capped, policy=policy)
    assert_same(arrays(capped, grads=True), arrays(whole, grads=True), "grad")
    assert_same_losses(losses_capped, losses_whole)
    assert policy.split_batches == 1 and policy.micro_batches > 2 and policy.oom_errors == 0
    assert policy.oversize_docs == sum(len(eg.predicted) > 60 for eg in batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OOMSplitWarning)
        lean_update(fresh(pipeline_dir), batch, policy=policy)  # once per policy


def test_ceiling_in_wordpieces(pipeline_dir, batches, tiny_transformer):
    """Lengths measured in the transformer's wordpieces (every word is at least one
    piece, and the tokenizer adds [CLS] and [SEP])."""
    whole = fresh(pipeline_dir)
    capped = fresh(pipeline_dir)
    batch = batches[2]
    policy = UpdatePolicy(max_padded_tokens=200, wordpiece_tokenizer=str(tiny_transformer))
    pieces = [policy.length(eg) for eg in batch]
    assert all(p >= len(eg.predicted) for p, eg in zip(pieces, batch))
    assert sum(pieces) > sum(len(eg.predicted) for eg in batch)
    whole.update(batch, sgd=False)
    lean_update(capped, batch, policy=policy)
    assert policy.micro_batches == len(plan_micro_batches(pieces, 200)) > 1
    assert_same(arrays(capped, grads=True), arrays(whole, grads=True), "grad")


def test_one_doc_too_large_is_a_clear_error(pipeline_dir, batches):
    nlp = fresh(pipeline_dir)
    batch = batches[2]
    longest = max(len(eg.predicted) for eg in batch)
    nlp.get_pipe("oom_probe").limit = longest - 1
    before = arrays(nlp, grads=True)
    losses = {"ner": 1.5}
    with pytest.raises(BatchTooLargeError, match=f"one doc alone.*{longest} tokens long") as info:
        lean_update(nlp, batch, losses=losses, policy=UpdatePolicy())
    assert "torch" in type(info.value.__cause__).__module__
    # Nothing half-done: the gradients and losses are as before the call.
    assert_same(arrays(nlp, grads=True), before, "grad after the error")
    assert losses == {"ner": 1.5}


def test_oom_inside_the_transformer_forward(pipeline_dir, batches):
    """A real torch forward hook on the Hugging Face model raises when the wordpiece
    batch (spans x longest span) is too large: the split update equals the whole."""
    import torch

    whole = fresh(pipeline_dir)
    split = fresh(pipeline_dir)
    hf = split.get_pipe("transformer").model.transformer
    sizes = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        sizes.append(ids.numel())
        if ids.numel() > 200:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated in BertModel.forward)")

    handle = hf.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        batch = batches[0]
        losses_whole, losses_split = {}, {}
        whole.update(batch, sgd=False, losses=losses_whole)
        policy = UpdatePolicy()
        with pytest.warns(OOMSplitWarning):
            lean_update(split, batch, losses=losses_split, policy=policy)
    finally:
        handle.remove()
    assert max(sizes) > 200 and policy.oom_errors >= 1
    assert_same(arrays(split, grads=True), arrays(whole, grads=True), "grad")
    assert_same_losses(losses_split, losses_whole)


def test_gradient_checkpointing_same_gradients(pipeline_dir, batches):
    plain = fresh(pipeline_dir)
    ckpt = fresh(pipeline_dir)
    hf = ckpt.get_pipe("transformer").model.transformer
    assert not hf.is_gradient_checkpointing
    batch = batches[0]
    plain.update(batch, sgd=False)
    lean_update(ckpt, batch, policy=UpdatePolicy(gradient_checkpointing=True))
    assert hf.is_gradient_checkpointing
    assert enable_gradient_checkpointing(ckpt) == 1
    assert_same(arrays(ckpt, grads=True), arrays(plain, grads=True), "grad")


def test_installed_update_steps_like_the_training_loop(pipeline_dir, batches):
    """`nlp.update(batch, sgd=optimizer)` with the installed update steps every updated
    component after the whole batch, as spaCy's training loop does (update with
    sgd=False, then finish_update), not interleaved as `Language.update` does."""
    stock = fresh(pipeline_dir)
    lean = install_lean_update(fresh(pipeline_dir, limit=150))
    policy = get_update_policy(lean)
    assert isinstance(policy, UpdatePolicy) and get_update_policy(stock) is None
    opt_stock, opt_lean = Adam(0.001), Adam(0.001)
    losses_stock, losses_lean = {}, {}
    with pytest.warns(OOMSplitWarning):
        lean.update(batches[0], sgd=opt_lean, losses=losses_lean)
    stock.update(batches[0], sgd=False, losses=losses_stock)
    finish(stock, opt_stock)
    assert_same(arrays(lean), arrays(stock), "param", atol=PARAM_ATOL)
    assert_same_losses(losses_lean, losses_stock)
    assert policy.oom_splits == 1
    with pytest.raises(torch_oom()):  # the stock update dies of it
        fresh(pipeline_dir, limit=150).update(batches[0], sgd=False)


def torch_oom():
    import torch

    return torch.OutOfMemoryError


def test_spacy_train_survives_oom(tmp_path, tiny_transformer, pipeline_dir):
    """Stock `python -m spacy train` with the callback: batches above the probe's limit
    run out of memory, and the run still finishes and saves a pipeline that loads
    without the callback."""
    from spacy.tokens import DocBin

    nlp = spacy.blank("en")
    for name, n, seed in (("train", 16, 21), ("dev", 8, 22)):
        docs = annotate(synthetic.make_ner_docs(nlp, n, seed=seed, long_doc_rate=0.0))
        DocBin(docs=docs, store_user_data=True).to_disk(tmp_path / f"{name}.spacy")
    config = pipeline_config(tiny_transformer)
    config["nlp"]["after_pipeline_creation"] = {
        "@callbacks": CALLBACK_NAME,
        "max_padded_tokens": None,
        "gradient_checkpointing": False,
    }
    config["training"]["before_to_disk"] = {"@callbacks": "spacy-lean.strip_streaming_evaluate.v1"}
    config["components"]["oom_probe"]["limit"] = 200
    # Filled as `spacy init fill-config` would.
    filled = spacy.util.load_model_from_config(config, auto_fill=True, validate=True).config
    filled.to_disk(tmp_path / "config.cfg")
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="always::UserWarning")
    cmd = [
        sys.executable,
        "-m",
        "spacy",
        "train",
        str(tmp_path / "config.cfg"),
        "--output",
        str(out),
        "--code",
        __file__,
        "--paths.train",
        str(tmp_path / "train.spacy"),
        "--paths.dev",
        str(tmp_path / "dev.spacy"),
        "--paths.transformer",
        str(tiny_transformer),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "Out of memory on a batch of 8 docs" in log
    saved = Path(out / "model-last")
    assert (saved / "config.cfg").exists()
    saved_config = Config().from_disk(saved / "config.cfg", interpolate=False)
    assert saved_config["nlp"]["after_pipeline_creation"] is None


@pytest.mark.parametrize("exact", [True, False])
def test_callback_settings_reach_the_policy(pipeline_dir, exact):
    """The `[nlp.after_pipeline_creation]` callback's settings are the policy's."""
    from spacy.util import registry

    make = registry.callbacks.get(CALLBACK_NAME)
    nlp = spacy.load(pipeline_dir)
    make(
        max_padded_tokens=300,
        gradient_checkpointing=False,
        exact_parser_gradient=exact,
        trim_heap_slack_mb=None if exact else 8.0,
    )(nlp)
    policy = get_update_policy(nlp)
    assert policy.max_padded_tokens == 300 and policy.exact_parser_gradient is exact
    assert policy.trim_heap_slack_mb == (None if exact else 8.0)


def test_pipeline_with_the_callback_pickles_and_still_updates_lean(pipeline_dir, batches):
    """nlp.pipe(n_process=2) pickles the pipeline where processes are spawned (macOS,
    Windows, forkserver): `nlp.update` was a method bound to a local function, which
    pickle refuses. The copy keeps its own policy (settings and counters) and updates
    with lean_update."""
    import pickle

    from spacy.util import registry

    nlp = fresh(pipeline_dir, limit=150)
    registry.callbacks.get(CALLBACK_NAME)(max_padded_tokens=10**6)(nlp)
    with pytest.warns(OOMSplitWarning):
        nlp.update(batches[0], sgd=False)
    copy = pickle.loads(pickle.dumps(nlp))
    policy = get_update_policy(copy)
    assert policy is not get_update_policy(nlp) and policy.max_padded_tokens == 10**6
    # The counters and the learned limits came along: the next batch is split at once.
    assert policy.batches == 1 and policy.learned_limits == get_update_policy(nlp).learned_limits
    micro_before = policy.micro_batches
    copy.update(batches[1], sgd=False)
    assert policy.batches == 2 and policy.micro_batches - micro_before > 1
    probe = copy.get_pipe("oom_probe")
    assert sorted(probe.seen[-len(batches[1]) :]) == sorted(eg.predicted.text for eg in batches[1])
    assert copy.update.__doc__ == lean_update.__doc__


def test_spacy_lean_train_uses_the_config_callbacks_policy():
    """`spacy lean train` updates with the policy a config's lean_training.v1 callback
    installed (all its settings), `--max-padded-tokens` replacing only the ceiling;
    without the callback, a default policy with that ceiling."""
    from spacy_lean.cli.train import update_policy

    config = Config().from_str(
        f"""
        [nlp]
        lang = "en"
        pipeline = []

        [nlp.after_pipeline_creation]
        @callbacks = "{CALLBACK_NAME}"
        max_padded_tokens = 300
        exact_parser_gradient = false
        trim_heap_slack_mb = null
        streaming_evaluate = false

        [components]
        """
    )
    nlp = spacy.util.load_model_from_config(config, auto_fill=True)
    installed = get_update_policy(nlp)
    policy = update_policy(nlp)
    assert policy is installed
    assert (policy.max_padded_tokens, policy.exact_parser_gradient, policy.trim_heap_slack_mb) == (
        300,
        False,
        None,
    )
    policy = update_policy(nlp, 128)
    assert policy is installed and policy.max_padded_tokens == 128
    assert policy.exact_parser_gradient is False and policy.trim_heap_slack_mb is None
    with pytest.raises(ValueError, match="max_padded_tokens must be a positive"):
        update_policy(nlp, 0)
    assert installed.max_padded_tokens == 128

    fresh = update_policy(spacy.blank("en"), 64)
    assert fresh is not installed and fresh.max_padded_tokens == 64
    assert fresh.exact_parser_gradient is True and fresh.trim_heap_slack_mb == DEFAULT_TRIM_SLACK_MB
    assert update_policy(spacy.blank("en")).max_padded_tokens is None


def test_oom_benchmark_compares_noise_gradients_with_the_scale():
    """oom_gpu.py's gradient comparison: a key bias (zero in exact arithmetic, rounding
    noise in practice) whose noise differs entirely between two runs is within float
    noise of the scale, not 100% off; an array of real gradients off by 1% is
    reported as such; an array missing in one run is infinitely off."""
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "oom_gpu.py"
    spec = importlib.util.spec_from_file_location("oom_gpu_for_test", script)
    oom_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oom_gpu)
    rng = numpy.random.default_rng(0)
    weight = rng.normal(size=(8, 8)).astype("f") * 1000
    key_bias, query_bias = rng.normal(size=8).astype("f") * 1e-5, rng.normal(size=8).astype("f")
    name = "transformer/1:hf-pytorch/shim0/encoder.layer.0.attention.self."
    expected = [(name + "query.weight", weight), (name + "query.bias", query_bias)]
    expected += [(name + "key.bias", key_bias), ("ner/tiny", numpy.full(3, 1e-6, "f"))]
    got = [(n, a.copy()) for n, a in expected]
    got[2] = (got[2][0], -key_bias)  # another noise
    got[3] = (got[3][0], numpy.zeros(3, "f"))  # below 1e-7 of the scale: noise too
    same = oom_gpu.gradient_differences(got, expected)
    assert same["relative"] == 0.0 and same["scale"] == float(numpy.abs(weight).max())
    assert 0 < same["near_zero_relative_to_scale"] < 1e-6
    assert [r["name"] for r in same["worst_near_zero"]] == [name + "key.bias", "ner/tiny"]
    got[1] = (got[1][0], query_bias * 1.01)
    off = oom_gpu.gradient_differences(got, expected)
    assert off["relative"] == pytest.approx(0.01, rel=1e-3)
    assert off["worst"][0]["name"] == name + "query.bias"
    got[1] = (got[1][0], None)
    assert oom_gpu.gradient_differences(got, expected)["relative"] == float("inf")


def run_oom_benchmark(tmp_path, *args):
    """benchmarks/oom_gpu.py --quick in a fresh process (it calls require_gpu, or
    replaces the cap with a hook: nothing of it may leak into this process)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "oom_gpu.py"
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--quick",
            "--work",
            str(tmp_path / "work"),
            "--output",
            str(out),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    return json.loads(out.read_text())


def check_oom_benchmark(result):
    """Training: a whole batch ran out of memory, lean_update split it and gave the same
    gradients (relative 1e-3 of each array's largest value: GPU kernels sum in other
    orders; the arrays whose gradient is zero in exact arithmetic, BERT's key biases,
    within 1e-6 of the gradient's scale: their values are rounding noise), every example
    once; stock nlp.update died of the same batch. Evaluation:
    the streaming evaluator halved its batch and gave the uncapped scores, which are
    nlp.evaluate's."""
    training = result["training"]
    assert training["lean_update_under_cap"] == "finished", training["cap_attempts"]
    policy = training["policy"]
    assert policy["oom_errors"] >= 1 and policy["oom_splits"] >= 1
    assert policy["examples"] == sum(b["docs"] for b in result["batches"])
    assert policy["micro_batches"] > policy["batches"]
    assert training["stock_update_under_cap"].endswith("OutOfMemoryError")
    # On failure: the arrays that differ most, and how far two identical stock runs
    # differ on this device (float noise).
    diagnosis = (training["gradient_differences"], training["stock_rerun_gradient_differences"])
    assert training["max_relative_gradient_difference"] < 1e-3, diagnosis
    assert training["near_zero_gradient_difference_relative_to_scale"] < 1e-6, diagnosis
    for key, value in training["losses"]["stock"].items():
        assert training["losses"]["lean"][key] == pytest.approx(value, rel=1e-4), key
    evaluation = result["evaluation"]
    assert evaluation["evaluator_under_cap"] == "finished", evaluation["cap_attempts"]
    assert evaluation["oom_backoffs"] and evaluation["oom_backoffs"][0][0] == evaluation["docs"]
    assert evaluation["final_batch_size"] < evaluation["docs"]
    assert evaluation["scores_differing_from_uncapped"] == []
    assert evaluation["scores_differing_from_nlp_evaluate"] == []
    assert evaluation["ents_f"] > 0  # the untrained ner finds some entities: scores to compare


@pytest.mark.slow
def test_oom_benchmark_script_on_the_cpu(tmp_path):
    """The script's --cpu-check (a hook raises torch's error instead of a cap), so that
    the GPU session's run of it does not fail on the script."""
    result = run_oom_benchmark(tmp_path, "--cpu-check")
    assert result["cpu_check"] and result["training"]["cap_mb"] is None
    check_oom_benchmark(result)


@pytest.mark.gpu
def test_mixed_precision_micro_batches_on_the_gpu(pipeline_dir, batches):
    """The same on a GPU with float16 autocast (thinc's scaler unpatched): lean_update
    in micro-batches against nlp.update on the whole batch. The float16 forward runs on
    tensors of other shapes, so the gradients agree to float16 rounding, not float32's:
    each array's difference within 2% of its norm (without the accumulation fix every
    micro-batch but the last lost its transformer gradient: differences of the order
    of the gradient itself). BERT's key biases are rounding noise and left out.

    The scaler starts at 2^4, not thinc's 2^16: at 2^16 some gradients on the H100
    (2026-11-27) were not finite (numpy warned of an invalid subtraction; float16
    overflows above 65,504), and this comparison skipped them silently (NaN > x is
    false). 2^4 keeps them finite and still
    shows the lost gradients (divided by 16 again). A gradient that is not finite now
    fails the test, naming the array."""
    from thinc.api import require_cpu, require_gpu, set_gpu_allocator

    set_gpu_allocator("pytorch")
    require_gpu(0)
    try:
        whole, scaler = fresh_mixed_precision(pipeline_dir, init_scale=2.0**4)
        split, _ = fresh_mixed_precision(pipeline_dir, init_scale=2.0**4)
        assert scaler._enabled and float(scaler._scale) == 2.0**4
        batch = batches[0]
        whole.update(batch, sgd=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OOMSplitWarning)
            lean_update(split, batch, policy=UpdatePolicy(max_padded_tokens=60))
        labels = arrays(whole, labels=True)
        far, compared = [], 0
        for label, a, b in zip(labels, arrays(split, grads=True), arrays(whole, grads=True)):
            assert (a is None) == (b is None), label
            if a is None:
                continue
            if not (numpy.isfinite(a).all() and numpy.isfinite(b).all()):
                far.append((label, "not finite"))
                continue
            if "key.bias" in label[1]:
                continue
            norm = float(numpy.linalg.norm(b))
            compared += norm > 0
            if norm and float(numpy.linalg.norm(a - b)) > 0.02 * norm:
                far.append((label, float(numpy.linalg.norm(a - b)) / norm))
        assert compared and not far, far
    finally:
        require_cpu()


@pytest.mark.gpu
def test_real_cuda_out_of_memory_is_split(tmp_path):
    """A real CUDA out-of-memory error: the process capped with
    torch.cuda.set_per_process_memory_fraction below a whole batch's need, in training
    and in evaluation."""
    result = run_oom_benchmark(tmp_path)
    assert not result["cpu_check"] and result["training"]["cap_mb"] > 0
    check_oom_benchmark(result)


def test_running_out_on_only_empty_docs_says_what_ran_out(pipeline_dir):
    """A micro-batch of only empty docs that runs out of memory was reported as "one
    doc alone ... 0 tokens long ... Split long docs": there is nothing of theirs to
    split, what ran out is the memory beside the batch."""
    nlp = fresh(pipeline_dir, limit=-1)  # the probe runs out whatever the size

    def example(text):
        return Example(nlp.make_doc(text), annotate([nlp.make_doc(text)])[0])

    losses = {"ner": 1.0}
    with pytest.raises(BatchTooLargeError, match=r"updating 2 empty doc\(s\) \(no tokens\)"):
        lean_update(nlp, [example(""), example("")], losses=losses, policy=UpdatePolicy())
    assert losses == {"ner": 1.0}
    with pytest.raises(
        BatchTooLargeError, match="one doc alone: doc 1 of a batch of 2, 1 token long"
    ):
        lean_update(nlp, [example(""), example(" \n ")], policy=UpdatePolicy())


def test_a_beam_parser_split_says_it_is_not_the_same_update():
    """spaCy's beam_ner draws beam_update_prob per update call and averages its beam
    loss over a step's states: micro-batches mix beam and greedy updates (weights 0.7
    of the update off, on 12 docs in 4 micro-batches). It counted as a checked "sum"
    component, silently; now it is unchecked, with a warning that says why."""
    from spacy_lean.training.update import loss_reduction

    nlp = spacy.blank("en")
    nlp.add_pipe("beam_ner")
    nlp.add_pipe("ner", name="greedy")
    docs = synthetic.make_ner_docs(nlp, 6, seed=5, long_doc_rate=0.0)
    examples = [Example(nlp.make_doc(d.text), d) for d in docs]
    nlp.initialize(lambda: examples)
    assert loss_reduction(nlp.get_pipe("beam_ner")) is None
    assert loss_reduction(nlp.get_pipe("greedy")) == "sum"
    longest = max(len(eg.predicted) for eg in examples)
    with pytest.warns(OOMSplitWarning) as record:
        lean_update(nlp, examples, policy=UpdatePolicy(max_padded_tokens=2 * longest))
    messages = [str(w.message) for w in record]
    assert any("'beam_ner', a parser with beam_width = " in m for m in messages), messages
    assert not any("'greedy'" in m for m in messages), messages


def _partly_annotated_pipeline(producer, order, tiny_transformer):
    """`producer` (tok2vec or the tiny transformer, dropout 0, the ner without its
    upper layer: see training.md) with tagger and ner listening in `order`, and 8
    examples sorted by length: all have tags, only the 4 short ones have entities (the
    long ones' entity annotation is missing, not "O"). One optimizer step taken."""
    if producer == "tok2vec":
        nlp = spacy.blank("en")
        nlp.add_pipe("tok2vec")
        listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": "*"}
        for name in order:
            model = {"tok2vec": listener}
            if name == "ner":  # use_upper = true always drops out 10% of the hidden layer
                model.update({"use_upper": False, "hidden_width": 32})
            nlp.add_pipe(name, config={"model": model})
    else:
        config = pipeline_config(tiny_transformer)
        config["nlp"]["pipeline"] = ["transformer", *order]
        for name in ("textcat", "oom_probe"):
            del config["components"][name]
        nlp = spacy.util.load_model_from_config(config, auto_fill=True, validate=True)
    docs = sorted(synthetic.make_ner_docs(nlp, 8, seed=9, long_doc_rate=0.0), key=len)
    examples = []
    for i, doc in enumerate(docs):
        tags = ["N" if t.is_alpha else "P" for t in doc]
        if i < 4:  # the short docs: tags and entities
            examples.append(Example(nlp.make_doc(doc.text), _with_tags(doc, tags)))
        else:  # the long ones: tags only, the entities missing (not "O")
            examples.append(Example.from_dict(nlp.make_doc(doc.text), {"tags": tags}))
    assert [eg.reference.has_annotation("ENT_IOB") for eg in examples] == [True] * 4 + [False] * 4
    fix_random_seed(0)
    optimizer = nlp.initialize(lambda: examples)
    # The tagger's softmax starts at zero, passing no gradient back: one step first.
    nlp.update(examples, sgd=optimizer)
    return nlp, examples


@pytest.mark.parametrize("producer", ["tok2vec", "transformer"])
@pytest.mark.parametrize("order", [("tagger", "ner"), ("ner", "tagger")])
def test_a_split_keeps_the_gradients_of_a_skipped_last_listener(producer, order, tiny_transformer):
    """A micro-batch without ner annotation skips the ner's update. Where ner is the
    last listener of the shared tok2vec or transformer, whose backward pass its gradient
    triggers, the split relays a zero gradient for it, so the tagger's gradients of that
    micro-batch reach the producer as in the whole batch (without the relay: 12 of 19
    tok2vec parameters off by up to 2% of the update). Nothing is warned."""
    nlp, examples = _partly_annotated_pipeline(producer, order, tiny_transformer)
    whole, _ = _partly_annotated_pipeline(producer, order, tiny_transformer)
    assert_same(arrays(nlp), arrays(whole), "initial param", atol=0)
    longest = max(len(eg.predicted) for eg in examples)
    policy = UpdatePolicy(max_padded_tokens=longest)
    losses_whole, losses_split = {}, {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lean_update(whole, examples, losses=losses_whole)
        lean_update(nlp, examples, losses=losses_split, policy=policy)
    assert policy.split_batches == 1 and policy.micro_batches >= 3
    assert not [str(w.message) for w in record if "skipped the update" in str(w.message)]
    expected = arrays(whole, grads=True)
    assert any(g is not None and g.any() for g in expected)
    assert_same(arrays(nlp, grads=True), expected, f"{producer} {order} grad")
    assert_same_losses(losses_split, losses_whole)


@pytest.mark.gpu
@pytest.mark.parametrize("producer", ["tok2vec", "transformer"])
def test_a_split_keeps_the_gradients_of_a_skipped_last_listener_on_the_gpu(
    producer, tiny_transformer
):
    """The same on a GPU (cupy through torch's allocator): the relay's zero gradient is
    made with the producer's ops there. Another grouping on CUDA kernels rounds
    otherwise, so each array is compared by the norm of its difference, within 1e-3 of
    its own norm (without the relay the tok2vec's are off by up to 2%); BERT's key
    biases, rounding noise in both runs, are left out."""
    from thinc.api import require_cpu, require_gpu, set_gpu_allocator

    set_gpu_allocator("pytorch")
    require_gpu(0)
    try:
        order = ("tagger", "ner")
        nlp, examples = _partly_annotated_pipeline(producer, order, tiny_transformer)
        whole, _ = _partly_annotated_pipeline(producer, order, tiny_transformer)
        longest = max(len(eg.predicted) for eg in examples)
        policy = UpdatePolicy(max_padded_tokens=longest)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            lean_update(whole, examples)
            lean_update(nlp, examples, policy=policy)
        assert policy.split_batches == 1 and policy.micro_batches >= 3
        assert not [str(w.message) for w in record if "skipped the update" in str(w.message)]
        assert_close_by_norm(nlp, whole)
    finally:
        require_cpu()


def assert_close_by_norm(nlp, whole, rel=1e-3):
    """On a GPU another grouping rounds otherwise: each gradient array of `nlp` within
    `rel` of its norm in `whole`, all finite, some non-zero; BERT's key biases (rounding
    noise in both) left out."""
    far, compared = [], 0
    labels = arrays(whole, labels=True)
    for label, a, b in zip(labels, arrays(nlp, grads=True), arrays(whole, grads=True)):
        assert (a is None) == (b is None), label
        if a is None or "key.bias" in label[1]:
            continue
        assert numpy.isfinite(a).all() and numpy.isfinite(b).all(), label
        norm = float(numpy.linalg.norm(b))
        compared += norm > 0
        if float(numpy.linalg.norm(a - b)) > rel * norm + 1e-7:
            far.append((label, float(numpy.linalg.norm(a - b)) / max(norm, 1e-30)))
    assert compared and not far, far


class _OtherPackagesTagger(spacy.pipeline.Tagger):
    """A tagger as another package would subclass it: the relay does not know when it
    calls its listener's callback (`_relays_zeros`)."""


def test_a_split_where_another_last_listener_skips_says_so(tiny_transformer):
    """A component the relay does not know (here another package's tagger, made to
    skip micro-batches) that skips some micro-batches as the last listener: the other
    listeners' gradients of those micro-batches are dropped, and the split says so."""
    nlp, examples = _partly_annotated_pipeline("tok2vec", ("ner", "tagger"), tiny_transformer)
    tagger = nlp.get_pipe("tagger")
    tagger.__class__ = _OtherPackagesTagger
    update = tagger.update

    def skipping_update(batch, **kwargs):
        if len(batch[0].predicted) > 20:
            return kwargs.get("losses", {})
        return update(batch, **kwargs)

    tagger.update = skipping_update
    longest = max(len(eg.predicted) for eg in examples)
    assert len(examples[0].predicted) <= 20 < longest
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lean_update(nlp, examples, policy=UpdatePolicy(max_padded_tokens=longest))
    said = [str(w.message) for w in record if "skipped the update" in str(w.message)]
    assert len(said) == 1 and "Put 'tagger' before" in said[0], said


# 4 docs of 6-12 tokens, 4 of 2 tokens.
SPAN_TEXTS = [
    "Ada Lovelace met Charles Babbage in London yesterday .",
    "The old bridge over the river Thames was closed .",
    "Grace Hopper wrote the first compiler .",
    "They walked north along the coast for days .",
    "Hello there",
    "Thanks !",
    "See you",
    "Good night",
]


def _spancat_last_pipeline():
    """tok2vec shared by a tagger and a spancat, the spancat last and suggesting only
    3-grams: a doc of 2 tokens gives it no span, and it skips an update of such docs
    before its model runs. 4 docs of 6-12 tokens with a span each, 4 of 2 tokens; all
    tagged. One optimizer step taken (the softmax layers start at zero)."""
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": "*"}
    nlp.add_pipe("tagger", config={"model": {"tok2vec": listener}})
    suggester = {"@misc": "spacy.ngram_suggester.v1", "sizes": [3]}
    spancat_model = {
        "@architectures": "spacy.SpanCategorizer.v1",
        "tok2vec": listener,
        "reducer": {"@layers": "spacy.mean_max_reducer.v1", "hidden_size": 32},
        "scorer": {"@layers": "spacy.LinearLogistic.v1"},
    }
    nlp.add_pipe("spancat", config={"suggester": suggester, "model": spancat_model})
    examples = []
    for text in SPAN_TEXTS:
        doc = nlp.make_doc(text)
        tags = ["N" if t.is_alpha else "P" for t in doc]
        ref = Example.from_dict(doc, {"tags": tags}).reference
        ref.spans["sc"] = [Span(ref, 0, 3, label="THING")] if len(doc) > 3 else []
        examples.append(Example(nlp.make_doc(text), ref))
    return _initialized_with_a_step(nlp, examples)


def _initialized_with_a_step(nlp, examples):
    """The pipeline initialized on the examples (seed 0), one optimizer step taken."""
    fix_random_seed(0)
    optimizer = nlp.initialize(lambda: examples)
    nlp.update(examples, sgd=optimizer)
    return nlp, examples


def test_shares_a_spancat_last_listener_skips_add_up_to_the_whole_batch():
    """A data-parallel rank's share (or a micro-batch) of only docs too short for the
    spancat's suggester: the spancat, last listener of the tok2vec, skips it, so the
    tok2vec's backward never ran and the tagger's gradients of that share were lost,
    with nothing said (`spacy lean train --nproc 2` trained other weights than one
    process: up to 10% of an array's size). Relayed now: two shares accumulated give
    the whole batch's gradients, and so does a split."""
    nlp, examples = _spancat_last_pipeline()
    whole, _ = _spancat_last_pipeline()
    assert_same(arrays(nlp), arrays(whole), "initial param", atol=0)
    long_docs, short_docs = examples[:4], examples[4:]
    assert not whole.get_pipe("spancat").suggester([eg.predicted for eg in short_docs]).data.size
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lean_update(whole, examples)
        lean_update(nlp, long_docs)
        lean_update(nlp, short_docs)
    assert not [str(w.message) for w in record if "skipped the update" in str(w.message)]
    expected = arrays(whole, grads=True)
    assert_same(arrays(nlp, grads=True), expected, "two shares grad")
    split, _ = _spancat_last_pipeline()
    policy = UpdatePolicy(max_padded_tokens=2 * 4)  # the short docs in micro-batches of their own
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OOMSplitWarning)  # the long docs: one each
        lean_update(split, examples, policy=policy)
    assert policy.split_batches == 1
    assert_same(arrays(split, grads=True), expected, "split grad")


@pytest.mark.parametrize("last", ["textcat", "ner"])
def test_a_batch_of_only_empty_docs_is_no_update(last):
    """spaCy's tok2vec hands its listeners arrays of no rows for a batch of only empty
    docs, and every listener skips it: the relay ran the tok2vec's backward pass on
    them, which failed in thinc's maxout (IndexError), with or without a split. Stock
    `nlp.update` does nothing there, and so does `lean_update` now."""
    listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": "*"}
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("tagger", config={"model": {"tok2vec": listener}})
    nlp.add_pipe(last, config={"model": {"tok2vec": listener}})
    words, tags = ["Bo", "ran", "."], ["N", "V", "P"]
    init = [Example(Doc(nlp.vocab, words=words), Doc(nlp.vocab, words=words, tags=tags))]
    init[0].reference.cats = {"A": 1.0, "B": 0.0}
    nlp.initialize(lambda: init)
    empty = []
    for _ in range(4):
        reference = Doc(nlp.vocab, words=[])
        reference.cats = {"A": 1.0, "B": 0.0}
        empty.append(Example(Doc(nlp.vocab, words=[]), reference))
    before = arrays(nlp, grads=True)
    losses = lean_update(nlp, empty)
    assert losses == nlp.update(empty, sgd=False) == {"tok2vec": 0.0, "tagger": 0.0, last: 0.0}
    after = arrays(nlp, grads=True)
    assert all((a is None and b is None) or (a == b).all() for a, b in zip(after, before))


def test_a_stacked_tok2vec_runs_its_backward_pass_once(monkeypatch):
    """A tok2vec listening to another (tok2vec -> tagger1 + tok2vec2; tok2vec2 ->
    tagger2 + ner, last) and a batch the ner skips: the relay sent zeros into the
    upstream tok2vec's backward pass, then into tok2vec2's, which passed its own on to
    the upstream one's callback, so that ran twice (counting tagger1's gradient twice).
    Downstream first, the upstream backward pass runs once."""
    from spacy.ml.models.tok2vec import Tok2VecListener
    from thinc.api import Maxout, chain, with_array

    @spacy.registry.architectures("test_stacked_tok2vec.v1")
    def stacked(width: int, upstream: str):
        listener = Tok2VecListener(upstream_name=upstream, width=width)
        return chain(listener, with_array(Maxout(width, width, nP=2)))

    def listener(upstream):
        return {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": upstream}

    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("tagger", name="tagger1", config={"model": {"tok2vec": listener("tok2vec")}})
    model = {"@architectures": "test_stacked_tok2vec.v1", "width": 96, "upstream": "tok2vec"}
    nlp.add_pipe("tok2vec", name="tok2vec2", config={"model": model})
    nlp.add_pipe("tagger", name="tagger2", config={"model": {"tok2vec": listener("tok2vec2")}})
    nlp.add_pipe("ner", config={"model": {"tok2vec": listener("tok2vec2")}})
    words = ["Ada", "Lind", "runs", "in", "Oslo", "."]
    tags, ents = ["N", "N", "V", "P", "N", "X"], ["B-PER", "I-PER", "O", "O", "B-LOC", "O"]
    gold = Doc(nlp.vocab, words=words, tags=tags, ents=ents)
    nlp.initialize(lambda: [Example(Doc(nlp.vocab, words=words), gold)])
    upstream = nlp.get_pipe("tok2vec").model
    passes = []
    begin_update = Model.begin_update

    def counting_begin_update(self, X):
        Y, backprop = begin_update(self, X)
        if self is not upstream:
            return Y, backprop

        def counted(dY):
            passes.append(1)
            return backprop(dY)

        return Y, counted

    monkeypatch.setattr(Model, "begin_update", counting_begin_update)
    no_entities = Doc(nlp.vocab, words=words, tags=tags)  # the ner skips the batch
    lean_update(nlp, [Example(Doc(nlp.vocab, words=words), no_entities)] * 2)
    assert len(passes) == 1


def _with_tags(doc, tags):
    doc = copy.deepcopy(doc)
    for token, tag in zip(doc, tags):
        token.tag_ = tag
    return doc


@pytest.mark.parametrize("oom", [False, True])
def test_a_label_first_seen_in_a_split_update_stays_masked_where_unseen(oom):
    """A label first met in a split update grows the ner's output layer, whose new
    classes start unseen; the classes no micro-batch saw stay unseen afterwards (masked
    in later updates), as after the whole batch (they were dropped from the table).
    With `oom`, the whole batch runs out of memory after the ner grew: the retry (which
    does not grow it again) starts the new layer's gradients afresh and keeps its new
    classes (they were doubled, and lost), so the update is the whole batch's."""
    nlp = spacy.blank("en")
    model = {"use_upper": False, "hidden_width": 32}  # no random cut: the same update
    nlp.add_pipe("ner", config={"model": model, "update_with_oracle_cut_size": 0})
    nlp.add_pipe("lean_oom_probe", name="oom_probe")
    docs = sorted(synthetic.make_ner_docs(nlp, 40, seed=3, long_doc_rate=0.0), key=len)
    labels = sorted({ent.label_ for doc in docs for ent in doc.ents})
    new = labels[-1]
    # initialize without the new label; the update batch: the new label in its first
    # docs only (one micro-batch sees it, the others do not)
    known = [d for d in docs if all(e.label_ != new for e in d.ents)]
    with_new = [d for d in docs if any(e.label_ == new for e in d.ents)]
    assert len(known) >= 6 and with_new
    nlp.initialize(lambda: [Example(nlp.make_doc(d.text), d) for d in known[:20]])
    batch = [Example(nlp.make_doc(d.text), d) for d in with_new[:1] + known[-5:]]
    whole = copy.deepcopy(nlp)
    lean_update(whole, batch)
    longest = max(len(eg.predicted) for eg in batch)
    if oom:  # the whole batch runs out in the probe, after the ner's update
        nlp.get_pipe("oom_probe").limit = len(batch) * longest - 1
        policy = UpdatePolicy()
        with pytest.warns(OOMSplitWarning):
            lean_update(nlp, batch, policy=policy)
        assert policy.oom_errors == 1
    else:
        policy = UpdatePolicy(max_padded_tokens=longest)
        lean_update(nlp, batch, policy=policy)
        assert policy.micro_batches >= 3
    # The labels are added before the first micro-batch (and before a failed attempt),
    # so every micro-batch updates the grown layer: before, the micro-batches before
    # the one meeting the label updated the old layer, whose gradients were lost, and
    # after running out of memory the grown layer's gradient was doubled. Within 5e-3
    # of each array's largest value, not exactly: while a new label's classes are unseen
    # (masked), spaCy unmasks one for the rest of a batch's update once a doc of it has
    # that class, which the other micro-batches do not see (measured: 2e-4 to 2.5e-3).
    for i, (a, b) in enumerate(zip(arrays(nlp, grads=True), arrays(whole, grads=True))):
        assert (a is None) == (b is None), i
        if b is not None and b.size:
            assert numpy.abs(a - b).max() <= 5e-3 * numpy.abs(b).max(), i
    table = nlp.get_pipe("ner").model.attrs["unseen_classes"]
    expected = whole.get_pipe("ner").model.attrs["unseen_classes"]
    assert new in nlp.get_pipe("ner").labels
    assert expected, "some of the new label's classes stay unseen after the whole batch"
    assert table == expected


@pytest.mark.parametrize("empty", [False, True])
@pytest.mark.parametrize("producer", ["tok2vec", "transformer"])
def test_a_share_without_annotation_keeps_the_other_listeners_gradients(
    producer, empty, tiny_transformer
):
    """Data-parallel ranks each update their share: a share without ner annotation
    (ner the last listener) kept none of the tagger's gradients for the producer, so 2
    ranks differed from 1 rank with the whole batch. With the relay, the shares'
    gradients add up to the whole batch's (and a batch without any ner annotation
    keeps the tagger's gradients, which `nlp.update` drops). With `empty`, that share
    also holds an empty doc, whose transformer output has no hidden state (the relay
    gave up on the whole share, and the tagger's gradients were dropped silently)."""
    nlp, examples = _partly_annotated_pipeline(producer, ("tagger", "ner"), tiny_transformer)
    if empty:
        examples.append(Example.from_dict(nlp.make_doc(""), {"tags": []}))
    whole, _ = _partly_annotated_pipeline(producer, ("tagger", "ner"), tiny_transformer)
    stock, _ = _partly_annotated_pipeline(producer, ("tagger", "ner"), tiny_transformer)
    losses_whole, losses_shares = {}, {}
    lean_update(whole, examples, losses=losses_whole)
    for share in (examples[:4], examples[4:]):  # the second share: no entities
        lean_update(nlp, share, losses=losses_shares)
    assert_same(arrays(nlp, grads=True), arrays(whole, grads=True), f"{producer} grad")
    assert losses_shares == pytest.approx(losses_whole, rel=1e-5)
    stock.update(examples[:4], sgd=False)
    stock.update(examples[4:], sgd=False)
    producer_grads = arrays(whole, grads=True)
    differs = [
        i
        for i, (a, b) in enumerate(zip(arrays(stock, grads=True), producer_grads))
        if a is not None and b is not None and not numpy.allclose(a, b, rtol=RTOL, atol=1e-5)
    ]
    assert differs, "stock nlp.update drops the tagger's gradients of the share without ner"


def test_a_wordpiece_tokenizer_that_does_not_load_fails_when_the_config_is_resolved(tmp_path):
    """It failed at the first update, after the pipeline was initialized (minutes
    with a real transformer); now when the callback is made, as the batcher's does."""
    from spacy.util import registry

    cfg = {"cb": {"@callbacks": CALLBACK_NAME, "wordpiece_tokenizer": str(tmp_path / "none")}}
    with pytest.raises(ValueError, match="Could not load a tokenizer from"):
        registry.resolve(cfg)


def _linker_pipeline():
    """tok2vec shared by a tagger and an entity_linker (last listener, gold entities).
    The KB knows Q1-Q3; "Ada Lovelace" and "London" are aliases, "Zed Quux" (Q3) is
    not, so a doc of only "Zed Quux" has a linked entity but no candidate. One
    optimizer step taken (the tagger's softmax starts at zero)."""
    # Imported here: `spacy train --code` loads this file where tests/ is not on the path.
    from linker_util import make_linker_kb, set_links

    fix_random_seed(0)
    listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": "*"}
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("sentencizer")
    nlp.add_pipe("tagger", config={"model": {"tok2vec": listener}})
    model = {"@architectures": "spacy.EntityLinker.v2", "nO": None, "tok2vec": listener}
    linker = nlp.add_pipe("entity_linker", config={"incl_prior": False, "model": model})
    linker.set_kb(make_linker_kb)
    texts = [
        ("Ada Lovelace met a friend in London .", [(0, 2, "Q1"), (6, 7, "Q2")]),
        ("They saw Ada Lovelace again .", [(2, 4, "Q2")]),
        ("Rain fell on London all day .", [(3, 4, "Q2")]),
        ("Ada Lovelace wrote notes on London and Ada Lovelace .", [(0, 2, "Q1"), (5, 6, "Q2")]),
        ("Zed Quux waved .", [(0, 2, "Q3")]),
        ("Zed Quux sang .", [(0, 2, "Q3")]),
    ]
    examples = []
    for text, ents in texts:
        doc = nlp.make_doc(text)
        tags = ["N" if t.is_alpha else "P" for t in doc]
        ref = Example.from_dict(doc, {"tags": tags}).reference
        set_links(ref, ents)
        examples.append(Example(nlp.make_doc(text), ref))
    optimizer = nlp.initialize(lambda: examples)
    nlp.update(examples, sgd=optimizer)
    return nlp, examples


def test_an_entity_linker_split_gives_the_whole_batch_update_and_loss():
    """entity_linker's loss is a mean over the batch's linked entities: summed over
    micro-batches it was over-reported (up to the number of micro-batches times). And a
    micro-batch whose linked entities have no KB candidate ("Zed Quux", no alias) was
    skipped, where the whole batch (which has candidates) learns from them: its
    gradients were lost from the linker and, relayed as zeros, from the tok2vec."""
    whole, examples = _linker_pipeline()
    expected_losses = lean_update(whole, examples)
    expected = arrays(whole, grads=True)
    assert expected_losses["entity_linker"] > 0
    split, examples = _linker_pipeline()
    policy = UpdatePolicy(max_padded_tokens=12)  # the two "Zed Quux" docs together
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        losses = lean_update(split, examples, policy=policy)
    assert not [str(w.message) for w in record if "not checked" in str(w.message)]
    assert policy.split_batches == 1 and policy.micro_batches >= 3
    assert_same_losses(losses, expected_losses)
    assert_same(arrays(split, grads=True), expected, "split grad")
    linker = split.get_pipe("entity_linker")
    assert "batch_has_learnable_example" not in vars(linker)  # restored
    # Without candidates anywhere, the whole batch is no update of the linker, and nor
    # is a split of it (the tagger's gradients are kept: the relay's zero gradient).
    split, examples = _linker_pipeline()
    lean_update(split, examples[4:], policy=UpdatePolicy(max_padded_tokens=4))
    whole, examples = _linker_pipeline()
    lean_update(whole, examples[4:])
    assert_same(arrays(split, grads=True), arrays(whole, grads=True), "no-candidates grad")
    linker = split.get_pipe("entity_linker").model
    grads = [n.get_grad(p) for n in linker.walk() for p in n.param_names if n.has_grad(p)]
    assert grads and not any(g.any() for g in grads)


@pytest.mark.gpu
def test_an_entity_linker_split_gives_the_whole_batch_update_on_the_gpu():
    """The same on a GPU: the micro-batches without a KB candidate are updated, the
    loss weighted by linked entities (compared by norm, as CUDA rounds another grouping
    otherwise)."""
    from thinc.api import require_cpu, require_gpu, set_gpu_allocator

    set_gpu_allocator("pytorch")
    require_gpu(0)
    try:
        whole, examples = _linker_pipeline()
        expected_losses = lean_update(whole, examples)
        split, examples = _linker_pipeline()
        policy = UpdatePolicy(max_padded_tokens=12)
        losses = lean_update(split, examples, policy=policy)
        assert policy.split_batches == 1 and policy.micro_batches >= 3
        assert expected_losses["entity_linker"] > 0
        for name, value in expected_losses.items():
            assert losses[name] == pytest.approx(value, rel=1e-4), name
        assert_close_by_norm(split, whole)
    finally:
        require_cpu()


def test_an_entity_linker_loss_over_ranks_is_weighted_by_their_linked_entities():
    """Data-parallel training logs the mean of the ranks' entity_linker losses weighted
    by each rank's linked entities (`_loss_weight`), as one process with every rank's
    docs logs it; summed, the 2 shares below logged twice it."""
    from spacy_lean.training.loop import _loss_weight

    whole, examples = _linker_pipeline()
    expected = lean_update(whole, examples)["entity_linker"]
    nlp, examples = _linker_pipeline()
    shares = [examples[:1], examples[1:]]
    losses = [lean_update(nlp, share)["entity_linker"] for share in shares]
    weights = [_loss_weight(nlp, "entity_linker", "entities", share) for share in shares]
    assert weights == [2.0, 6.0]
    assert sum(losses) > 1.9 * expected
    assert sum(a * w for a, w in zip(losses, weights)) / sum(weights) == pytest.approx(expected)
    assert _loss_weight(nlp, "entity_linker", "entities", None) == 0.0
    assert _loss_weight(nlp, "tagger", None, shares[0]) == 1.0
    assert _loss_weight(nlp, "textcat", "mean", shares[1]) == 5.0


def test_an_entity_linker_share_without_candidates_learns_as_the_whole_step():
    """A data-parallel rank's share whose linked entities have no KB candidate was
    skipped by the entity_linker, where one process with every rank's docs learns from
    it. The ranks now share whether the step's linkers learn (`linker_learns`, reduced
    with the step's batch flag) and a rank learns from its linked entities where some
    rank has a candidate: 2 shares add up to the whole batch's gradients."""
    from spacy_lean.training import update as update_module

    whole, examples = _linker_pipeline()
    lean_update(whole, examples)
    expected = arrays(whole, grads=True)
    nlp, examples = _linker_pipeline()
    linker = nlp.get_pipe("entity_linker")
    shares = [examples[:4], examples[4:]]
    flags = [update_module.linker_learns(linker, share) for share in shares]
    assert flags == [True, False]
    for share in shares:
        with update_module.linkers_learn_linked_entities([linker] if any(flags) else []):
            lean_update(nlp, share)
    assert "batch_has_learnable_example" not in vars(linker)
    assert_same(arrays(nlp, grads=True), expected, "two shares grad")
    # Without it, the second share is skipped (the first share's gradients only).
    alone, examples = _linker_pipeline()
    for share in (examples[:4], examples[4:]):
        lean_update(alone, share)
    with pytest.raises(AssertionError):
        assert_same(arrays(alone, grads=True), expected, "skipped share")


# -- spacy-curated-transformers listeners ----------------------------------------------


def _curated_tagger_ner(tiny_transformer):
    """A spacy-curated-transformers transformer with a tagger and a ner (the last
    listener) listening, initialized (not trained: spacy-curated-transformers 0.3's own
    backward pass calls float() on a 1-element array, which numpy 2 refuses), and 8
    examples with tags and no entity annotation, so the ner skips every update."""
    pytest.importorskip("spacy_curated_transformers")
    from curated_util import curated_pipeline  # here: `spacy train --code` loads this file

    nlp = curated_pipeline(tiny_transformer, ("tagger", "ner"))
    docs = synthetic.make_ner_docs(nlp, 8, seed=9, long_doc_rate=0.0)
    examples = []
    for doc in docs:
        tags = ["N" if t.is_alpha else "P" for t in doc]
        examples.append(Example.from_dict(nlp.make_doc(doc.text), {"tags": tags}))
    fix_random_seed(0)
    nlp.initialize(lambda: examples)
    return nlp, examples


def _curated_states(nlp):
    from spacy_lean.training.update import _curated_listener_state

    states = []
    for name in ("tagger", "ner"):
        for node in nlp.get_pipe(name).model.walk():
            state = _curated_listener_state(node)
            if state is not None:
                states.append(state)
    assert len(states) == 2
    return states


def test_a_failed_attempt_lets_go_of_curated_listeners_outputs(tiny_transformer):
    """After an out-of-memory error the retry starts with the curated listeners holding
    nothing of the failed attempt (they held its outputs and backprop callback, the
    whole failed batch's activations, while the retry ran: spacy-lean released only
    spacy-transformers' listeners)."""
    nlp, examples = _curated_tagger_ner(tiny_transformer)
    states = _curated_states(nlp)
    tagger = nlp.get_pipe("tagger")
    update = tagger.update
    attempts = []

    def failing_update(batch, **kwargs):
        attempts.append(len(batch))
        if len(attempts) == 1:  # after the transformer's forward pass, as a late OOM
            raise torch_oom()("CUDA out of memory (simulated in the tagger)")
        return update(batch, **kwargs)

    transformer = nlp.get_pipe("transformer")
    transformer_update = transformer.update
    held = []

    def recording_update(batch, **kwargs):
        held.append([state.outputs is not None for state in states])
        return transformer_update(batch, **kwargs)

    tagger.update = failing_update
    transformer.update = recording_update
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lean_update(nlp, examples, policy=UpdatePolicy())
    assert attempts[0] == 8 and len(attempts) > 1
    # The first attempt starts clean; every retry too (it held [True, True]).
    assert held[0] == [False, False]
    assert all(h == [False, False] for h in held[1:]), held


def test_a_curated_last_listener_that_skips_says_the_gradients_are_dropped(tiny_transformer):
    """The ner, the curated transformer's last listener, skips a batch without entity
    annotation, so the tagger's gradient for the transformer is dropped (the
    transformer runs its backward pass in the last listener's callback). The relay does
    not pass zeros to curated listeners; it said nothing at all."""
    nlp, examples = _curated_tagger_ner(tiny_transformer)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lean_update(nlp, examples, policy=UpdatePolicy())
    said = [str(w.message) for w in record if "skipped the update" in str(w.message)]
    assert len(said) == 1 and "'ner', the last listener of 'transformer'" in said[0], said
    assert all(state.backprop is None for state in _curated_states(nlp))


def test_gradient_checkpointing_on_a_curated_transformer_says_why_it_is_off(tiny_transformer):
    """The warning named "no Hugging Face model ... (or none is loaded yet)", where the
    curated transformer is loaded and will never be checkpointed."""
    nlp, examples = _curated_tagger_ner(tiny_transformer)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lean_update(nlp, examples, policy=UpdatePolicy(gradient_checkpointing=True))
    said = [str(w.message) for w in record if "gradient_checkpointing is on" in str(w.message)]
    assert len(said) == 1 and "['transformer'] are spacy-curated-transformers" in said[0], said


def _span_finder_pipeline():
    """tok2vec + span_finder (the spancat's usual suggester), 4 docs with a span each
    and 2 too short for one; one optimizer step taken."""
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": "*"}
    model = {
        "@architectures": "spacy.SpanFinder.v1",
        "tok2vec": listener,
        "scorer": {"@layers": "spacy.LinearLogistic.v1", "nO": 2},
    }
    nlp.add_pipe("span_finder", config={"spans_key": "sc", "model": model})
    examples = []
    for text in SPAN_TEXTS[:6]:
        ref = nlp.make_doc(text)
        ref.spans["sc"] = [Span(ref, 0, 2, label="THING")] if len(ref) > 3 else []
        examples.append(Example(nlp.make_doc(text), ref))
    return _initialized_with_a_step(nlp, examples)


def test_a_span_finder_split_is_the_whole_batch_update_without_a_warning():
    """span_finder's gradient is a sum over the batch's tokens: a split gives the whole
    batch's gradients and loss, and does not warn that its normalisation is unchecked
    (it did: span_finder was missing from the checked components)."""
    whole, examples = _span_finder_pipeline()
    split, _ = _span_finder_pipeline()
    whole_losses = lean_update(whole, examples, losses={})
    policy = UpdatePolicy(max_padded_tokens=12)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        split_losses = lean_update(split, examples, policy=policy, losses={})
    assert policy.split_batches == 1
    assert not [str(w.message) for w in record if "not checked" in str(w.message)]
    assert_same(arrays(split, grads=True), arrays(whole, grads=True), "span_finder grad")
    assert_same_losses(split_losses, whole_losses)
