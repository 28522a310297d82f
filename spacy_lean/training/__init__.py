"""Training helpers: out-of-memory-safe updates with token-budget gradient
accumulation (`lean_update`, `UpdatePolicy`), their `spacy train` callback
(`spacy-lean.lean_training.v1`) and the data-parallel loop."""

from .callbacks import get_update_policy, install_lean_update, make_lean_training_v1
from .grad_scaling import install_mixed_precision_accumulation
from .parser_grad import install_exact_parser_gradient
from .update import (
    BatchTooLargeError,
    OOMSplitWarning,
    UpdatePolicy,
    enable_gradient_checkpointing,
    lean_update,
    plan_micro_batches,
)

__all__ = [
    "BatchTooLargeError",
    "OOMSplitWarning",
    "UpdatePolicy",
    "enable_gradient_checkpointing",
    "get_update_policy",
    "install_exact_parser_gradient",
    "install_lean_update",
    "install_mixed_precision_accumulation",
    "lean_update",
    "make_lean_training_v1",
    "plan_micro_batches",
]
