"""Resident-memory readings for the benchmarks (Linux /proc; each benchmark measures in
a fresh child process)."""

from pathlib import Path


def proc_status(key: str) -> int:
    """A memory field of /proc/self/status (e.g. "VmRSS", "VmHWM"), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process to the current RSS.

    RETURNS (bool): whether the kernel allowed it.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
