"""The local launcher of `spacy lean train --nproc N`: starts the ranks (torchrun's
variables set), watches them, stops the others when one fails, passes a stop signal on,
and makes the ranks stop when it dies. Standard library only: it imports quickly."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .stopping import STOPPED_EXIT_CODE, TRAINING_STOP_SIGNALS, StopRequest, signal_name

# Set by `launch_local` in the environment of the processes it starts: that it started
# them, and its process id.
LAUNCHED_ENV = "SPACY_LEAN_LAUNCHED"
LAUNCHER_PID_ENV = "SPACY_LEAN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The folder where the ranks of the local launcher report their failures.
FAILURE_DIR_ENV = "SPACY_LEAN_FAILURE_DIR"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_local(
    argv: Sequence[str],
    nproc: int,
    *,
    gpu_ids: Sequence[int] = (),
    grace_s: float = 10.0,
    poll_s: float = 0.2,
    env: Optional[Dict[str, str]] = None,
    log=None,
    warn=None,
    pass_fds: Sequence[int] = (),
) -> int:
    """Start `nproc` ranks of a command on this machine (torchrun's variables set) and
    watch them: when one exits with an error, the others are stopped (SIGTERM, then
    SIGKILL after `grace_s`) and the exit code of the first failure is returned.

    A stop signal (SIGTERM, or a first Ctrl-C: the ranks start with Ctrl-C ignored) sent
    to the launcher is passed on to every rank as SIGTERM; each finishes its step, saves
    the state and exits (`stopping.STOPPED_EXIT_CODE`); the launcher waits for them and
    returns that code. A second Ctrl-C kills the ranks at once (130). Ranks that stop so
    by themselves
    (a scheduler signals every process) are waited for, not taken for failures. The
    ranks stop the same way when the launcher dies (`stop_with_launcher`).

    argv (Sequence[str]): the command each rank runs.
    nproc (int): number of processes.
    gpu_ids (Sequence[int]): GPUs handed out by local rank (informational here; each
        rank picks its own from LOCAL_RANK).
    log (Optional[Callable[[str], None]]): says why the run failed.
    warn (Optional[Callable[[str], None]]): says that the run is stopping, and stopped.
    pass_fds (Sequence[int]): file descriptors the ranks keep open (the output folder's
        lock: held while any rank runs, also after the launcher died).
    RETURNS (int): 0 when every rank succeeded, STOPPED_EXIT_CODE when the ranks
        stopped on request, else the code of the rank that failed first (128 + S for
        a rank killed by signal S).
    """
    # A rank that fails notes when it did in this folder (`report_failure`).
    with tempfile.TemporaryDirectory(prefix="spacy-lean-failures-") as failures:
        base = dict(os.environ if env is None else env)
        base.update(
            # The ranks run on this machine, and the port is free here: an inherited
            # MASTER_ADDR (exported for torchrun on another node) would point them elsewhere.
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            **{LAUNCHED_ENV: "1", LAUNCHER_PID_ENV: str(os.getpid())},
        )
        if "OMP_NUM_THREADS" not in base:
            base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        procs: List[subprocess.Popen] = []
        # Ranks in the order they exited, each noted by a thread that waits for it: a
        # rank that fails makes the others fail soon after (their collectives break),
        # often within one poll, and the first to exit is the one to blame.
        exited: List[int] = []
        exit_times: Dict[int, float] = {}
        exited_lock = threading.Lock()
        # A rank that fails writes when it did there (`report_failure`): its traceback and
        # teardown can take longer than a peer's exit, the peer failing of the broken
        # collective.
        base[FAILURE_DIR_ENV] = failures

        def note_exit(rank: int, proc: subprocess.Popen) -> None:
            proc.wait()
            with exited_lock:
                exited.append(rank)
                exit_times[rank] = time.time()

        failure: Optional[Tuple[int, int]] = None
        stopping: Optional[int] = None  # the signal the launcher received

        def pass_on(signum: int) -> None:  # at once: a rank may be one step from its end
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

        def ended() -> Optional[int]:
            """The launcher's exit code once every rank started has ended (all of them, or
            those started before a stop request), else None."""
            with exited_lock:
                done = len(exited)
            if done < len(procs) or (len(procs) < nproc and stopping is None):
                return None
            codes = [p.returncode for p in procs]
            if codes and all(c == 0 for c in codes):
                return 0
            if STOPPED_EXIT_CODE not in codes:  # every rank ended before its training loop
                if warn is not None:
                    warn("Every rank has stopped before training: nothing was saved.")
                return 128 + int(stopping or signal.SIGTERM)
            if warn is not None:
                warn(f"Every rank has stopped (exit code {STOPPED_EXIT_CODE}).")
            return STOPPED_EXIT_CODE

        with StopRequest(TRAINING_STOP_SIGNALS, on_signal=pass_on) as stop:
            try:
                for rank in range(nproc):
                    if stop.requested:  # no more ranks to start: the ones started stop
                        break
                    child_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
                    with _ctrl_c_held_off():
                        procs.append(
                            subprocess.Popen(list(argv), env=child_env, pass_fds=tuple(pass_fds))
                        )
                    threading.Thread(target=note_exit, args=(rank, procs[-1]), daemon=True).start()
                while True:
                    if stop.requested and stopping is None:
                        stopping = stop.signum
                        if warn is not None:
                            again = (
                                " Press Ctrl-C again to stop every rank at once."
                                if stopping == signal.SIGINT
                                else ""
                            )
                            warn(
                                f"Received {signal_name(stopping)}: each rank finishes its "
                                "step, saves the training state and exits (a rank still starting, "
                                f"before its first step, exits at once: nothing is saved).{again}"
                            )
                        pass_on(stopping)  # again: for a rank started after the signal
                    with exited_lock:
                        order = list(exited)
                    codes = [p.returncode if r in order else None for r, p in enumerate(procs)]
                    # A rank killed by the forwarded signal before its training loop began
                    # (nothing to save yet) stopped as asked too.
                    stopped = (STOPPED_EXIT_CODE,) + ((-signal.SIGTERM,) if stopping else ())
                    failed = [(r, codes[r]) for r in order if codes[r] not in (0,) + stopped]
                    if failed:
                        failure = failed[0]
                        break
                    result = ended()
                    if result is not None:
                        return result
                    time.sleep(poll_s)
            except KeyboardInterrupt:  # Ctrl-C a second time (the first set stop.requested)
                if stop.requested:
                    stopping = stopping or stop.signum
                    result = ended()  # the ranks may all have saved and exited by now
                    if result is not None:
                        return result
                failure = (-1, 130)
            # Stop the ranks still running: they would wait for the dead one until timeout.
            # A second Ctrl-C asked not to wait: they are killed (each folder is swapped in
            # whole, so none is left half-written), also when it comes during the wait.
            alive = [p for p in procs if p.poll() is None]
            for p in alive:
                p.send_signal(signal.SIGTERM if failure[0] >= 0 else signal.SIGKILL)
            deadline = time.monotonic() + grace_s
            try:
                for p in alive:
                    try:
                        p.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            except KeyboardInterrupt:
                for p in alive:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        reported = False
        if failure[0] >= 0:
            blamed, blamed_code, reported = _first_to_fail(procs, exit_times, failures, failure)
            failure = (blamed, blamed_code)
        rank, code = failure
        if log is not None:
            if rank >= 0:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                how = "failed" if reported else how
                log(
                    f"Rank {rank} of {nproc} {how} first; stopped the other ranks "
                    f"({len(alive)} still running). See rank {rank}'s output above for the cause. "
                    "If it failed while training, the last checkpoint resumes with --resume."
                )
            else:
                log(
                    "Interrupted again; stopped every rank at once. The last training state "
                    "saved, if any, continues with --resume."
                )
        # A rank killed by signal S exits the launcher with 128 + S, as a shell reports it
        # (137: SIGKILL, e.g. the kernel's out-of-memory killer).
        return code if code > 0 else 128 - code


@contextlib.contextmanager
def _ctrl_c_held_off() -> Iterator[None]:
    """While active, this process holds a Ctrl-C back (blocked: Linux keeps it pending,
    delivered when this ends) and a process started now begins with Ctrl-C ignored.
    The ranks share the launcher's process group, so Ctrl-Z pauses the whole job and a
    closed terminal ends it as before, but the terminal's Ctrl-C is the launcher's: it
    passes it on as SIGTERM, so each rank finishes its step and saves, instead of each
    dying of it wherever it is (Python keeps an inherited "ignored"; so does
    `StopRequest`)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "pthread_sigmask"
    ):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def report_failure(rank: int) -> None:
    """Called by a rank of the local launcher as it fails: notes the time for the
    launcher, which blames the rank that failed first."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return
    try:
        with open(os.path.join(folder, f"rank{int(rank)}"), "w", encoding="utf8") as file_:
            file_.write(repr(time.time()))
    except (OSError, ValueError):
        pass


def _first_to_fail(
    procs: Sequence[subprocess.Popen],
    exit_times: Dict[int, float],
    folder: str,
    first_exit: Tuple[int, int],
) -> Tuple[int, int, bool]:
    """(rank, exit code, whether it reported) of the rank that failed first: by the time
    each failed rank reported (`report_failure`), else the time it exited (a rank killed
    by a signal reports nothing). `first_exit`, the first failed rank to exit, where none
    is known."""
    ok = (0, STOPPED_EXIT_CODE, -signal.SIGTERM)
    when: List[Tuple[float, int]] = []
    for rank, proc in enumerate(procs):
        try:  # a rank that reported, however it ended (stopped by us while it exited)
            with open(os.path.join(folder, f"rank{rank}"), encoding="utf8") as file_:
                when.append((float(file_.read()), rank))
        except (OSError, ValueError):
            if proc.returncode not in ok and rank in exit_times:
                when.append((exit_times[rank], rank))
    if not when:
        return first_exit + (False,)
    rank = min(when)[1]
    code = procs[rank].returncode
    reported = os.path.exists(os.path.join(folder, f"rank{rank}"))
    # A rank that failed but was stopped while it exited: the code of an error.
    return rank, int(code) if code not in (None,) + ok else 1, reported


def launched_by_us() -> bool:
    return os.environ.get(LAUNCHED_ENV) == "1"


def stop_with_launcher(
    launcher_pid: Optional[int] = None,
    *,
    poll_s: float = 1.0,
    send: Callable[[int, int], None] = os.kill,
) -> bool:
    """Make this process receive SIGTERM when the launcher that started it (`launcher_pid`,
    default the LAUNCHER_PID_ENV variable) dies, however it dies. Returns False when
    there is no launcher to watch. When the launcher is already gone, the signal is
    sent at once."""
    if launcher_pid is None:
        value = os.environ.get(LAUNCHER_PID_ENV, "")
        if not value.isdigit():
            return False
        launcher_pid = int(value)
    me = os.getpid()
    if sys.platform.startswith("linux") and _set_parent_death_signal(signal.SIGTERM):
        # The parent may have died before the call: then it is no longer our parent.
        if os.getppid() != launcher_pid:
            send(me, signal.SIGTERM)
        return True

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(poll_s)
        send(me, signal.SIGTERM)

    threading.Thread(target=watch, name="spacy-lean-launcher-watch", daemon=True).start()
    return True


def _set_parent_death_signal(signum: int) -> bool:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
