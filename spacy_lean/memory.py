"""Giving memory back: the host heap (glibc) and the GPU allocators' caches.

Used by `lean_cleaner`, the streaming evaluation loop and the compact corpus reader."""
import ctypes
import sys

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
