"""Stopping `spacy lean train` on request, without losing the work done.

SIGTERM is how a scheduler stops a job (Slurm at its time limit or on preemption,
Kubernetes before it evicts a pod, `kill`, `timeout`), and how `spacy lean train
--nproc N` stops its ranks. spaCy's loop dies of it at once, with nothing saved since
the last evaluation. Here a rank that receives it finishes its current step; the ranks
agree on the step to stop after (a flag summed in that step's gradient all-reduce, so
no collective is added), save the resumable state there, and exit with
`STOPPED_EXIT_CODE`; `--resume` continues from the next step as if nothing happened.

Ctrl-C (SIGINT) in a terminal stops training the same way: the step is finished and its
state saved (with `--nproc` the ranks start with Ctrl-C ignored, so it is the launcher's,
which passes it on as SIGTERM). A second Ctrl-C stops at once, as Python
does (KeyboardInterrupt), keeping the last state saved; once the stop is saved, Ctrl-C
is ignored while the process exits. spaCy's loop stops at the first Ctrl-C, with the
state of the last evaluation only.

A rank started by the local launcher (launch.py) also stops this way when the launcher
dies, even of SIGKILL, so no rank is left training on its own.
"""

import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Set

# Signals that ask a run to stop after its current step.
STOP_SIGNALS = (signal.SIGTERM,)
# What stops training after its current step (`spacy lean train`, the launcher of its
# ranks, `spacy lean train-charlm`): a stop signal, or a first Ctrl-C.
TRAINING_STOP_SIGNALS = STOP_SIGNALS + (signal.SIGINT,)
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


def say_at_once(text: str, fd: int = 2) -> None:
    """Write `text` on a line of its own to the file descriptor `fd` (stderr), from a
    signal handler: with os.write, not print (a handler that prints while the code it
    interrupted prints to the same buffered stream raises "reentrant call")."""
    try:
        os.write(fd, ("\n" + text + "\n").encode("utf8", "replace"))
    except OSError:
        pass


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def ignore_ctrl_c() -> None:
    """Ignore Ctrl-C from now on (a stop is saved, and the process exits: a Ctrl-C
    pressed while it shuts down would only turn its exit code into 130)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def say_stopping(output_path: Optional[Path]) -> Callable[[int], None]:
    """A StopRequest's `on_signal` that says at once what the signal will do (the step
    can take a while, and an evaluation after it longer). Under torchrun, a second
    Ctrl-C reaches the workers as SIGTERM from its agent, which kills them 30 s after
    the first: no "again" there."""

    def on_signal(signum: int) -> None:
        saved = (
            "saves its training state (continue with --resume)"
            if output_path is not None
            else "saves nothing (no --output)"
        )
        text = f"Received {signal_name(signum)}: training stops after this step and {saved}."
        if signum == signal.SIGINT and not under_torchrun():
            text += " Press Ctrl-C again to stop at once (the last state saved is kept)."
        say_at_once(text)

    return on_signal


class StopRequest:
    """While installed (a context manager), the stop signals set `signum` instead of
    ending the process; the training loop reads `requested` once per step. A second
    signal changes nothing (a scheduler and the launcher may both send one), except a
    second SIGINT: Ctrl-C pressed again raises KeyboardInterrupt, as Python's own handler
    does, for a user who will not wait for the step. Outside the main thread (where
    Python cannot handle signals) it installs nothing.

    on_signal (Optional[Callable[[int], None]]): called with the first signal, at once
        (in the handler: the launcher passes the signal on to its ranks with it).
    """

    def __init__(self, signals=STOP_SIGNALS, on_signal: Optional[Callable[[int], None]] = None):
        self.signals = tuple(signals)
        self.on_signal = on_signal
        self.signum: Optional[int] = None
        self._received: Set[int] = set()
        self._previous: Dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and signum in self._received:
            raise KeyboardInterrupt
        self._received.add(signum)
        if self.signum is None:
            self.signum = signum
            if self.on_signal is not None:
                self.on_signal(signum)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                # An inherited "ignore Ctrl-C" (a rank of the local launcher, a job a
                # shell without job control started with `&`) stays: it is not ours.
                if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
