"""Gradients accumulated over several backward passes under mixed precision.

With mixed precision (spacy-transformers' `mixed_precision = true`), thinc's PyTorchShim
multiplies the gradient flowing into the torch model by its grad scaler's scale (2^16 to
start) so that float16 gradients do not underflow, and after the backward pass unscales
*every* `.grad` of the model (and checks them for infinities). A `.grad` that already
held the gradient of an earlier backward pass, accumulated before the optimizer step, is
divided by the scale a second time. With more than one backward pass per optimizer step,
every pass but the last thus loses its share of the torch model's gradient (it is
divided by 65,536 or more), while thinc's own layers keep theirs. That happens with
spaCy's `accumulate_gradient` > 1, on micro-batches, and on every `lean_update` (its
length-sorted span groups run one backward pass each).

`install_mixed_precision_accumulation(nlp)` replaces the forward function of every node
that runs a PyTorchShim (`thinc.layers.pytorchwrapper.forward`: `PyTorchWrapper` and
spacy-transformers' Hugging Face layer) so that, before each backward pass, the gradients
the shim's model already holds are multiplied by the current scale. The shim's unscale
then brings them back (times S, divided by S: exact, the scale being a power of two with
thinc's default growth and backoff factors) and adds the new pass's unscaled gradient. In
place, so no copy of the gradients is made. Without an enabled grad scaler (no mixed
precision, or no GPU) nothing changes. Nor is anything saved with the pipeline.
"""

from typing import Any, Callable, Iterable, Tuple

from spacy.language import Language
from thinc.api import Model
from thinc.layers import pytorchwrapper

from ._nodes import enabled_grad_scaler, replace_forward

_THINC_FORWARD = pytorchwrapper.forward


def _prescale_accumulated(shim: Any) -> None:
    """Multiply the gradients `shim`'s model holds by its scaler's scale, when the
    scaler is enabled, so that the unscale after the next backward pass restores them."""
    scaler = enabled_grad_scaler(shim)
    if scaler is None:
        return
    scales = {}
    for param in shim._model.parameters():
        grad = param.grad
        if grad is None:
            continue
        device = grad.device
        if device not in scales:
            scales[device] = scaler._scale.to(device=device, dtype=grad.dtype)
        grad.mul_(scales[device])


def check_mixed_precision_device(nlp: Language, exclude: Iterable[str] = ()) -> None:
    """Mixed precision trains on a CUDA GPU only: thinc's grad scaler refuses tensors
    elsewhere, but only at the first backward pass, after the pipeline was initialised,
    with a message that names neither the component nor the setting (on a CPU-only
    torch: "Gradient scaling is not supported, requires capable GPU"). Refused before
    the first update instead, naming both and the fix. Prediction is not affected (its
    autocast is off without CUDA).

    nlp (Language): the pipeline.
    exclude (Iterable[str]): components not updated (frozen): their backward pass never
        runs, so their scalers never fail.
    RAISES ValueError: an updated component's torch model has an enabled grad scaler
        and is not on a CUDA device.
    """
    excluded = set(exclude)
    for name, proc in nlp.pipeline:
        if name in excluded:
            continue
        model = getattr(proc, "model", None)
        if not isinstance(model, Model):
            continue
        for node in model.walk():
            for shim in node.shims:
                if enabled_grad_scaler(shim) is None:
                    continue
                param = next(shim._model.parameters(), None)
                if param is not None and not param.is_cuda:
                    raise ValueError(
                        f"'{name}' trains with mixed precision (mixed_precision = true in "
                        "its model's config), which runs on a CUDA GPU only, but its "
                        f"torch model is on the {param.device.type.upper()}: thinc's "
                        "gradient scaler would fail at the first update. Train on a GPU "
                        "(--gpu-id 0; in the project --vars.gpu_id 0), or set "
                        f"components.{name}.model.mixed_precision = false (in the "
                        "project: --vars.mixed_precision false)."
                    )


def _accumulating_forward(model: Model, X: Any, is_train: bool) -> Tuple[Any, Callable]:
    Y, backprop = _THINC_FORWARD(model, X, is_train)

    def backward(dY: Any) -> Any:
        for shim in model.shims:
            _prescale_accumulated(shim)
        return backprop(dY)

    return Y, backward


def install_mixed_precision_accumulation(nlp: Language) -> int:
    """Make the torch models' gradients add up over several backward passes before an
    optimizer step under mixed precision, as they do without it (see the module
    docstring). Idempotent; changes nothing where no grad scaler is enabled; not saved
    with the pipeline.

    nlp (Language): the pipeline.
    RETURNS (int): how many nodes run a PyTorchShim with the accumulating backward pass.
    """
    return replace_forward(nlp, _THINC_FORWARD, _accumulating_forward)
