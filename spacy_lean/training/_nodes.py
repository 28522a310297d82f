"""The thinc nodes of a pipeline, their mixed-precision grad scalers, and replacing a
layer's forward function in all of them (how `parser_grad` and `grad_scaling` change a
layer's backward pass)."""

from typing import Any, Callable, Iterable, List, Optional, Set

from spacy.language import Language
from thinc.api import Model


def pipeline_nodes(nlp: Language) -> List[Model]:
    """Every node of every component's model, each once, in pipeline and walk order."""
    models: List[Model] = []
    seen: Set[int] = set()
    for _, proc in nlp.pipeline:
        model = getattr(proc, "model", None)
        if isinstance(model, Model):
            for node in model.walk():
                if id(node) not in seen:
                    seen.add(id(node))
                    models.append(node)
    return models


def replace_forward(nlp: Language, original: Callable, replacement: Callable) -> int:
    """Give every node of the pipeline whose forward function is `original` the forward
    function `replacement` instead (thinc keeps it in `Model._func`). Idempotent; a
    module-level `replacement` keeps the pipeline picklable; not saved with it.

    RETURNS (int): how many nodes run `replacement`.
    """
    count = 0
    for node in pipeline_nodes(nlp):
        if getattr(node, "_func", None) is original:
            node._func = replacement
        if getattr(node, "_func", None) is replacement:
            count += 1
    return count


def enabled_grad_scaler(shim: Any) -> Optional[Any]:
    """The grad scaler of a PyTorchShim with mixed precision on (thinc's
    PyTorchGradScaler, enabled), else None."""
    scaler = getattr(shim, "_grad_scaler", None)
    return scaler if getattr(scaler, "_enabled", False) else None


def enabled_grad_scalers(nodes: Iterable[Model]) -> List[Any]:
    """The enabled grad scalers of the nodes' shims, each once, in node order."""
    seen: Set[int] = set()
    scalers: List[Any] = []
    for node in nodes:
        for shim in node.shims:
            scaler = enabled_grad_scaler(shim)
            if scaler is not None and id(scaler) not in seen:
                seen.add(id(scaler))
                scalers.append(scaler)
    return scalers
