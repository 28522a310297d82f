"""Giving memory back: the host heap (glibc) and the GPU allocators' caches.

Used by `lean_cleaner`, the streaming evaluation loop and the compact corpus reader."""

import ctypes
import os
import sys
from typing import Optional

_malloc_trim = None


def _get_malloc_trim():
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            try:
                _malloc_trim = ctypes.CDLL(None).malloc_trim
                _malloc_trim.argtypes = [ctypes.c_size_t]
                _malloc_trim.restype = ctypes.c_int
            except (OSError, AttributeError):  # not glibc (e.g. musl)
                _malloc_trim = False
    return _malloc_trim


def trim_host_memory() -> bool:
    """Give the free pages of the host heap back to the system (glibc's
    `malloc_trim(0)`). Freed batch tensors otherwise stay in the process, fragmented
    by the small allocations of what is kept, and resident memory creeps up batch
    after batch although nothing is alive.

    RETURNS (bool): whether it could be done (False off glibc).
    """
    trim = _get_malloc_trim()
    if trim:
        trim(0)
        return True
    return False


# The training updates' defaults (`UpdatePolicy.trim_heap_slack_mb`, and the updates over
# which the working level is measured after each trim); the evaluator trims after every
# batch unless given a slack.
DEFAULT_TRIM_SLACK_MB = 32.0
DEFAULT_TRIM_SETTLE = 16
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> Optional[int]:
    """The process's resident memory in bytes (Linux's `/proc/self/statm`), or None
    where that cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Calls `trim_host_memory` after every call (`slack_mb` 0), or only once resident
    memory has crept more than `slack_mb` megabytes above its working level. The working
    level is the highest resident memory measured at the first `settle` calls after a
    trim (or after the start; at least one call), when a loop's step has run and its
    freed pages are held for the next step to reuse. A loop whose steps reuse the
    same pages then never pays for handing them back and faulting them in again; what
    fragmentation adds step after step goes back once it exceeds the slack, so the peak
    stays within the working level + the slack, however many steps run.

    Measured, trimming after every call: `spacy lean evaluate` (2x64 model, 4,800
    docs, `benchmarks/eval_heap_trim.py`) 2.6M minor page faults against 0.1M
    untrimmed and 6% more CPU time than with fewer trims. In `spacy lean train` (2x64
    model, 150 steps, `benchmarks/train_memory.py --trim-arms`), a 64 MB slack over the
    first call's level trims every 5-10 steps, at 2-4x the page faults of never
    trimming; a 32 MB slack over the level of 16 calls (`settle=16`, the training
    default) trims a third as often, for 2-6% more words/s, and lets the peak grow a
    little more with the variety of batch shapes (1x -> 16x corpus: +3.0-3.2% against
    +1.8-2.1% and never trimming's +3.2-3.6%; before the transformer's spans ran in
    sorted groups in training, +7-9%, +3% and +10-11%). Never trimming lets the peak
    creep up with the number of batches (+58 MB from step 15 to 150 there, still rising).

    `settle=0` (what the evaluator uses) takes as the level the resident memory right
    after each trim (the first call trims): whatever a step frees beyond the slack goes
    back after that step, so a loop whose steps each free more than the slack trims
    after every step and peaks as if it trimmed always, while a loop of small steps
    trims once their freed pages add up past the slack. Measured in process (2x64 model,
    13,848 tweet-length docs in 433 batches): 89 trims instead of 433, 0.41M minor
    faults instead of 0.81M, peak +9 MB; on CoNLL-style groups and long docs it still
    trimmed after 83-100% of the batches, peaks within 3 MB; with a 4x256 model on the
    CoNLL-style groups, after every batch, peak 630 MB against 627 trimming always
    (where `settle=1` held a batch's freed pages and peaked at 711 MB).

    slack_mb (float): 0 trims on every call.
    settle (int): calls after a trim over which the working level is measured; 0 for
        the resident memory right after each trim.
    """

    def __init__(self, slack_mb: float = 0.0, settle: int = 1):
        if slack_mb < 0:
            raise ValueError(f"slack_mb must be >= 0, got {slack_mb}.")
        if settle < 0:
            raise ValueError(f"settle must be >= 0 calls, got {settle}.")
        self.slack = int(slack_mb * 2**20)
        self.settle = settle
        self.floor: Optional[int] = None
        self._measured = 0  # calls that measured the working level since the last trim
        self.n_trims = 0

    def __call__(self) -> bool:
        """Trim if due. RETURNS whether it trimmed."""
        if self.slack:
            now = resident_bytes()
            if now is not None:
                if self._measured < self.settle:  # still measuring the working level
                    self.floor = now if self.floor is None else max(self.floor, now)
                    self._measured += 1
                    return False
                if self.floor is not None and now <= self.floor + self.slack:
                    return False
        if not trim_host_memory():
            return False
        self.n_trims += 1
        self.floor = resident_bytes() if self.settle == 0 and self.slack else None
        self._measured = 0
        return True


def empty_gpu_caches() -> None:
    """Give the GPU allocators' cached blocks back: torch's CUDA caching allocator and
    cupy's default memory pools, when those are in use. Never imports torch or cupy."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:  # pragma: no cover - cupy installed without a usable device
            pass
