"""The optimizer step of torch models without a chain that grows each step.

thinc 8.3's `PyTorchShim.finish_update` (every spacy-transformers and
spacy-curated-transformers model steps through it) hands each parameter to the
optimizer as an array view of its tensor (`torch2xp`: numpy's `.numpy()`, cupy's
dlpack), which the optimizer updates in place, and then sets the parameter's data to
a new tensor made from that array (`xp2torch`). The new tensor holds the array, the
array holds the tensor it viewed, which held the previous step's array: each step
adds one tensor and one array per parameter to a chain that is never freed (the
memory they view is the parameter's own, so it is the objects that pile up: 457 bytes
of heap per parameter per step on the CPU, and RSS ten times as fast; a BERT-base has
199 parameters: +1.7 GB of heap over 20,000 steps; `benchmarks/torch_step_memory.py`).
Stock `spacy train` has it as well.

`install_flat_torch_step()` gives `PyTorchShim` a `finish_update` that is thinc's,
except that it does not set the data again where the optimizer returned the
parameter's own memory (updated in place: thinc's Adam and SGD, on numpy and cupy); a
new array (an optimizer of another kind) is still set. The weights are the same, bit
for bit. It is installed when spacy-lean updates a pipeline (`lean_update`: `spacy
lean train`, `spacy train` with the `spacy-lean.lean_training.v1` callback) and by the
`spacy-lean.streaming_evaluate.v1` callback of a pipeline with a torch model (`spacy
train` of a lean config), once per process, and only over thinc's own method: where
another package replaced it, it is left as it is."""

from typing import Any

from thinc.api import PyTorchShim
from thinc.util import torch2xp, xp2torch

# thinc's own method, as imported: the one replaced, and the one `restore` puts back.
_THINC_FINISH_UPDATE = PyTorchShim.finish_update


def _views(array: Any, tensor: Any) -> bool:
    """Whether `array` (numpy or cupy) is the memory of `tensor`, as it is laid out."""
    if tuple(array.shape) != tuple(tensor.shape):
        return False
    data = getattr(array, "data", None)
    pointer = getattr(data, "ptr", None)  # cupy
    if pointer is None:
        interface = getattr(array, "__array_interface__", None)
        if interface is None:
            return False
        pointer = interface["data"][0]
    return pointer == tensor.data_ptr()


def _flat_finish_update(self: PyTorchShim, optimizer: Any) -> None:
    """thinc 8.3's `PyTorchShim.finish_update`, without setting a parameter's data
    again where the optimizer updated it in place."""
    for name, torch_data in self._model.named_parameters():
        if torch_data.grad is not None:
            if not self._grad_scaler.found_inf:  # skip the update if a gradient overflowed
                param, grad = optimizer(
                    (self.id, name), torch2xp(torch_data.data), torch2xp(torch_data.grad)
                )
                if not _views(param, torch_data.data):
                    torch_data.data = xp2torch(param, requires_grad=True, device=torch_data.device)
            torch_data.grad.zero_()
    self._grad_scaler.update()


def install_flat_torch_step() -> bool:
    """Give `PyTorchShim` the `finish_update` above (see the module's docs).
    Idempotent.

    RETURNS (bool): whether it is installed (False where another package replaced
        thinc's method).
    """
    current = PyTorchShim.finish_update
    if current is _flat_finish_update:
        return True
    if current is not _THINC_FINISH_UPDATE:
        return False
    PyTorchShim.finish_update = _flat_finish_update  # type: ignore[method-assign]
    return True


def restore_thinc_torch_step() -> None:
    """Put thinc's own `PyTorchShim.finish_update` back (for comparisons)."""
    if PyTorchShim.finish_update is _flat_finish_update:
        PyTorchShim.finish_update = _THINC_FINISH_UPDATE  # type: ignore[method-assign]
