"""A batch-independent weight gradient for the parser and ner's lower layer.

spaCy 3's transition-based parser (`ner`, `parser`) scores a state from the vectors of a
few context tokens (nF features). A missing context token has id -1 and takes the
layer's "pad" vector in the forward pass. The layer's backward pass, though, gathers the
input rows with those ids to build the weight gradient, so each missing feature adds
dY x X[-1] to the gradient of W, X[-1] being the vector of the last token of the batch:
a term that depends on which doc happens to be last. It makes the gradient of W
non-additive over sub-batches (a batch split in two, or over data-parallel ranks, gives
another W gradient than the whole), although every other gradient adds up.

`install_exact_parser_gradient` wraps the layer's backward pass so that term is taken
back out (the "pad" gradient, which is right, is left alone). The forward pass, and the
gradients of every other parameter and of the input, are unchanged.
"""

from typing import Any, Callable, Tuple

from spacy.language import Language
from spacy.ml import _precomputable_affine
from thinc.api import Model

from ._nodes import replace_forward

_SPACY_FORWARD = _precomputable_affine.forward


def _exact_forward(model: Model, X: Any, is_train: bool) -> Tuple[Any, Callable]:
    Y, backprop = _SPACY_FORWARD(model, X, is_train)

    def backward(dY_ids: Tuple[Any, Any]) -> Any:
        dX = backprop(dY_ids)
        dY, ids = dY_ids
        xp = model.ops.xp
        missing = xp.asarray(ids) < 0
        if X.shape[0] and bool(missing.any()):
            # Per feature: the sum of dY over the states missing it, times the last row.
            # (one BLAS product: half einsum's time)
            n_states, n_features = missing.shape
            per_feature = (missing.astype(dY.dtype).T @ dY.reshape((n_states, -1))).reshape(
                (n_features,) + dY.shape[1:]
            )
            model.inc_grad("W", -(per_feature[..., None] * X[-1]))
        return dX

    return Y, backward


def install_exact_parser_gradient(nlp: Language) -> int:
    """Make the W gradient of every parser/ner lower layer in the pipeline
    independent of how examples are grouped into batches (see the module docstring).
    Idempotent; the change is not saved with the pipeline.

    nlp (Language): the pipeline.
    RETURNS (int): how many layers have the exact gradient.
    """
    return replace_forward(nlp, _SPACY_FORWARD, _exact_forward)
