"""Training helpers: out-of-memory-safe updates with token-budget gradient
accumulation (`lean_update`, `UpdatePolicy`) and the data-parallel loop."""
from .update import UpdatePolicy, lean_update

__all__ = ["UpdatePolicy", "lean_update"]
