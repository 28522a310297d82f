"""Stopping `spacy lean train` on request, without losing the work done.

SIGTERM is how a scheduler stops a job (Slurm at its time limit or on preemption,
Kubernetes before it evicts a pod, `kill`, `timeout`), and how `spacy lean train
--nproc N` stops its ranks. spaCy's loop dies of it at once, with nothing saved since
the last evaluation. Here a rank that receives it finishes its current step; the ranks
agree on the step to stop after (a flag summed in that step's gradient all-reduce, so
no collective is added), save the resumable state there, and exit with
`STOPPED_EXIT_CODE`; `--resume` continues from the next step as if nothing happened.

A rank started by the local launcher (launch.py) also stops this way when the launcher
dies, even of SIGKILL, so no rank is left training on its own.
"""

import signal
import threading
from typing import Any, Callable, Dict, Optional

# Signals that ask a run to stop after its current step.
STOP_SIGNALS = (signal.SIGTERM,)
# The exit code of a run stopped by a signal (the shell's 128 + SIGTERM): not 0, so a
# scheduler or script does not take a stopped run for a finished one.
STOPPED_EXIT_CODE = 128 + int(signal.SIGTERM)


class TrainingStopped(Exception):
    """The run stopped on request (a stop signal) after `step`; the resumable state of
    that step is saved (when the run has an output folder)."""

    def __init__(self, step: int, signum: int):
        self.step = step
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)} after step {step}")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """While installed (a context manager), the stop signals set `signum` instead of
    ending the process; the training loop reads `requested` once per step. A second
    signal changes nothing: a scheduler and the launcher may both send one. Outside the
    main thread (where Python cannot handle signals) it installs nothing.

    on_signal (Optional[Callable[[int], None]]): called with the first signal, at once
        (in the handler: the launcher passes the signal on to its ranks with it).
    """

    def __init__(self, signals=STOP_SIGNALS, on_signal: Optional[Callable[[int], None]] = None):
        self.signals = tuple(signals)
        self.on_signal = on_signal
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            if self.on_signal is not None:
                self.on_signal(signum)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
