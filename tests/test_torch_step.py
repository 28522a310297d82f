"""thinc 8.3's optimizer step of torch models (`PyTorchShim.finish_update`) leaves one
tensor and one array per parameter behind at every step, chained to the previous
step's; spacy-lean's updates install a step that does not (`training.torch_step`),
with the same weights. The real tiny BERT + ner pipeline, real Adam."""

import gc

import numpy
import pytest
import spacy
import torch
from spacy.training import Example
from spacy.util import fix_random_seed
from thinc.api import Adam, PyTorchShim, PyTorchWrapper

from spacy_lean import synthetic
from spacy_lean.training import lean_update
from spacy_lean.training.torch_step import (
    _flat_finish_update,
    install_flat_torch_step,
    restore_thinc_torch_step,
)


def n_tensors():
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def torch_params(nlp):
    shim = next(node for node in nlp.get_pipe("transformer").model.walk() if node.shims).shims[0]
    return list(shim._model.parameters())


def run(trf_ner_dir, steps, flat):
    """`steps` updates (Adam) of the tiny BERT + ner pipeline with spacy-lean's step
    (flat) or thinc's. RETURNS the pipeline and how many tensors the steps after the
    first two left behind."""
    install_flat_torch_step() if flat else restore_thinc_torch_step()
    try:
        fix_random_seed(0)  # the BERT's dropout, the ner's oracle cut
        nlp = spacy.load(trf_ner_dir)
        docs = synthetic.make_ner_docs(nlp, 8, seed=3)
        examples = [Example(nlp.make_doc(d.text), d) for d in docs]
        optimizer = Adam(1e-3)
        for step in range(2):  # the optimizer's state made
            nlp.update(examples[step % 2 :: 2], sgd=optimizer)
        before = n_tensors()
        for step in range(2, steps):
            nlp.update(examples[step % 2 :: 2], sgd=optimizer)
        return nlp, n_tensors() - before
    finally:
        install_flat_torch_step()


def test_training_steps_leave_no_tensors_behind(trf_ner_dir):
    _, grown = run(trf_ner_dir, 14, flat=True)
    assert grown <= 0, grown


def test_thinc_s_own_step_leaves_a_tensor_per_parameter_and_step(trf_ner_dir):
    """What the fix is for (this test fails once the leak is gone upstream)."""
    nlp, grown = run(trf_ner_dir, 14, flat=False)
    n_stepped = sum(1 for p in torch_params(nlp) if p.grad is not None)
    assert n_stepped > 30 and grown >= 12 * n_stepped, (grown, n_stepped)


def test_the_weights_are_thinc_s_bit_for_bit(trf_ner_dir):
    ours, _ = run(trf_ner_dir, 6, flat=True)
    thincs, _ = run(trf_ner_dir, 6, flat=False)
    for a, b in zip(torch_params(ours), torch_params(thincs)):
        numpy.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())
    assert any(
        not numpy.array_equal(a.detach().numpy(), b.detach().numpy())
        for a, b in zip(torch_params(ours), torch_params(spacy.load(trf_ner_dir)))
    )  # the steps moved the weights


def test_lean_update_installs_it(trf_ner_dir):
    restore_thinc_torch_step()
    nlp = spacy.load(trf_ner_dir)
    docs = synthetic.make_ner_docs(nlp, 2, seed=3)
    lean_update(nlp, [Example(nlp.make_doc(d.text), d) for d in docs])
    assert PyTorchShim.finish_update is _flat_finish_update


def test_an_optimizer_that_returns_a_new_array_is_still_applied():
    model = PyTorchWrapper(torch.nn.Linear(4, 2))
    X = numpy.ones((3, 4), dtype="f")
    Y, backprop = model.begin_update(X)
    backprop(numpy.ones_like(Y))
    weight = model.shims[0]._model.weight
    expected = weight.detach().numpy() - 1.0
    install_flat_torch_step()
    model.finish_update(lambda key, param, grad: (param - 1.0, grad))
    numpy.testing.assert_array_equal(weight.detach().numpy(), expected)


def test_another_package_s_step_is_left_as_it_is(monkeypatch):
    def theirs(self, optimizer):
        pass

    monkeypatch.setattr(PyTorchShim, "finish_update", theirs)
    assert install_flat_torch_step() is False
    assert PyTorchShim.finish_update is theirs


@pytest.mark.gpu
def test_on_the_gpu_the_steps_leave_no_tensors_behind_and_give_thinc_s_weights(trf_ner_dir):
    """On cupy the parameter goes to the optimizer through dlpack and comes back the
    same way: the same chain, the same fix (the memory compared by device pointer)."""
    pytest.importorskip("cupy", reason="GPU training needs spacy-lean[cuda12x]")
    from thinc.api import require_cpu, require_gpu

    require_gpu(0)
    try:
        ours, grown = run(trf_ner_dir, 14, flat=True)
        thincs, thinc_grown = run(trf_ner_dir, 14, flat=False)
        assert grown <= 0 and thinc_grown >= 12 * 30, (grown, thinc_grown)
        for a, b in zip(torch_params(ours), torch_params(thincs)):
            assert a.is_cuda
            # Two GPU runs add in another order where a kernel uses atomics.
            numpy.testing.assert_allclose(
                a.detach().cpu().numpy(), b.detach().cpu().numpy(), rtol=0, atol=1e-5
            )
    finally:
        require_cpu()


def test_the_streaming_callback_of_a_lean_config_installs_it(trf_ner_config, tiny_ner_config):
    """`spacy train` of a lean config (the streaming evaluation callback, no lean_update)
    gets the step too, where the pipeline has a torch model; a tok2vec one has none."""
    callback = {"@callbacks": "spacy-lean.streaming_evaluate.v1"}
    restore_thinc_torch_step()
    try:
        config = tiny_ner_config()
        config["nlp"]["after_pipeline_creation"] = callback
        spacy.util.load_model_from_config(config, auto_fill=True)
        assert PyTorchShim.finish_update is not _flat_finish_update
        config = spacy.util.load_config_from_str(trf_ner_config)
        config["nlp"]["after_pipeline_creation"] = callback
        spacy.util.load_model_from_config(config, auto_fill=True)
        assert PyTorchShim.finish_update is _flat_finish_update
    finally:
        install_flat_torch_step()
