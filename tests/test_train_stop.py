"""Stopping `spacy lean train` on request (training/stopping.py): the stop flag, the
local launcher passing SIGTERM on to its ranks and waiting while they save, ranks that
stop when their launcher dies (even of SIGKILL), and folders swapped in whole. The
runs of the real training command are in test_train_ddp.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spacy_lean
from spacy_lean.training.launch import stop_with_launcher
from spacy_lean.training.loop import replace_dir
from spacy_lean.training.stopping import STOPPED_EXIT_CODE, TRAINING_STOP_SIGNALS, StopRequest

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
    # Ctrl-C handled by default here and in the processes started (not an inherited ignore).
    pytest.mark.usefixtures("ctrl_c_as_in_a_terminal"),
]

# launch.py and stopping.py use the standard library only. The processes below import
# them without the package's __init__ modules (spaCy, torch: ~6 s a process on 2 cores).
LIGHT_IMPORT = f"""
import sys, types
for name, path in (("spacy_lean", {spacy_lean.__path__[0]!r}),
                   ("spacy_lean.training", {spacy_lean.__path__[0] + "/training"!r})):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
"""

# The launcher with 2 ranks of CHILD; argv: the child's code, the grace in seconds.
LAUNCHER = (
    LIGHT_IMPORT
    + """
from spacy_lean.training.launch import launch_local

poll_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
code = launch_local(
    [sys.executable, "-c", sys.argv[1]], 2, poll_s=poll_s, grace_s=float(sys.argv[2]),
    log=print, warn=print,
)
print("launcher exit", code, flush=True)
sys.exit(code)
"""
)

# A rank: waits for a stop signal (those of training: SIGTERM and Ctrl-C), "saves" (rank 1
# takes STOP_TEST_SAVE_S seconds to), writes saved<rank> and exits as a stopped training
# rank does.
CHILD = (
    LIGHT_IMPORT
    + """
import os, time
from pathlib import Path
from spacy_lean.training.launch import stop_with_launcher
from spacy_lean.training.stopping import STOPPED_EXIT_CODE, TRAINING_STOP_SIGNALS, StopRequest

out, rank = Path(os.environ["STOP_TEST_DIR"]), os.environ["RANK"]
stop_with_launcher()
with StopRequest(TRAINING_STOP_SIGNALS) as stop:
    (out / f"ready{rank}").write_text(str(os.getpid()))
    while not stop.requested:
        time.sleep(0.01)
    time.sleep(float(os.environ.get("STOP_TEST_SAVE_S", "0")) * int(rank))
    (out / f"saved{rank}").write_text(str(stop.signum))
sys.exit(STOPPED_EXIT_CODE)
"""
)


@pytest.fixture(autouse=True)
def no_rank_left(tmp_path):
    """After each test, kill any rank still running (when a test fails, its ranks would
    otherwise go on forever)."""
    yield
    for ready in tmp_path.glob("ready*"):
        pid = ready.read_text()
        try:  # only if the pid is still one of our ranks (not reused since)
            if b"stop_with_launcher" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def wait_for(paths, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, [p.name for p in paths if not p.exists()]
        time.sleep(0.02)


def start_launcher(tmp_path, grace_s=10.0, save_s=0.0, poll_s=0.05, child=None):
    """The launcher (of CHILD ranks) in a session of its own, as a terminal starts a
    command: a signal to its process group is what Ctrl-C sends."""
    env = dict(os.environ, STOP_TEST_DIR=str(tmp_path), STOP_TEST_SAVE_S=str(save_s))
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, child or CHILD, str(grace_s), str(poll_s)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_for([tmp_path / "ready0", tmp_path / "ready1"])
    return proc


def test_the_launcher_passes_sigterm_on_and_waits_for_its_ranks(tmp_path):
    """SIGTERM to the launcher reaches every rank, and the launcher waits while they
    save (rank 1 takes 1 s), then exits with 143."""
    proc = start_launcher(tmp_path, save_s=1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == STOPPED_EXIT_CODE, out
    assert "Received SIGTERM: each rank finishes its step" in out
    # A signal before the loop began saves nothing, which the message said it would.
    assert "a rank still starting, before its first step, exits at once" in " ".join(out.split())
    assert "Every rank has stopped (exit code 143)." in out
    for rank in (0, 1):
        assert (tmp_path / f"saved{rank}").read_text() == str(int(signal.SIGTERM))


def test_ctrl_c_stops_the_ranks_after_their_step_as_sigterm_does(tmp_path):
    """Ctrl-C in the terminal (SIGINT to the launcher's process group, which the ranks
    share): the ranks, started with Ctrl-C ignored, keep ignoring it although they stop on
    it when they run alone; the launcher passes it on as SIGTERM and waits while they
    save, as for a scheduler's stop. Before, every rank got the SIGINT and died of it
    wherever it was, and the launcher exited 130 with nothing saved."""
    proc = start_launcher(tmp_path, save_s=1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == STOPPED_EXIT_CODE, out
    out = " ".join(out.split())
    assert "Received SIGINT: each rank finishes its step" in out
    assert "Press Ctrl-C again to stop every rank at once." in out
    assert "Every rank has stopped (exit code 143)." in out
    for rank in (0, 1):
        assert (tmp_path / f"saved{rank}").read_text() == str(int(signal.SIGTERM))


def test_a_second_ctrl_c_stops_every_rank_at_once(tmp_path):
    """Ctrl-C twice: the launcher does not wait for rank 1's save (60 s) nor for the
    grace of a failure (30 s): it kills the ranks and exits 130."""
    proc = start_launcher(tmp_path, grace_s=30.0, save_s=60.0)
    os.killpg(proc.pid, signal.SIGINT)
    wait_for([tmp_path / "saved0"])  # the first was passed on: rank 0 has saved
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130, out
    assert time.monotonic() - started < 10
    assert "Interrupted again; stopped every rank at once." in " ".join(out.split())
    assert not (tmp_path / "saved1").exists()
    pid = int((tmp_path / "ready1").read_text())
    with pytest.raises(OSError):  # rank 1 is gone (killed, and reaped by the launcher)
        os.kill(pid, 0)


def proc_state(pid: int) -> str:
    """The process's state letter (/proc/PID/stat): "T" when stopped."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def wait_state(pid: int, states: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while proc_state(pid) not in states and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc_state(pid)


# A shell's part in job control: the command in a process group of its own in the
# shell's session (so that the group is not orphaned, and SIGTSTP is not discarded).
SHELL = """
import subprocess, sys
job = subprocess.Popen(sys.argv[1:], process_group=0)
print(job.pid, flush=True)
sys.exit(job.wait())
"""


def start_job(tmp_path):
    """The launcher as a shell's job. RETURNS (the shell, the launcher's pid, the ranks' pids)."""
    env = dict(os.environ, STOP_TEST_DIR=str(tmp_path), STOP_TEST_SAVE_S="0")
    shell = subprocess.Popen(
        [sys.executable, "-c", SHELL, sys.executable, "-c", LAUNCHER, CHILD, "10"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    launcher = int(shell.stdout.readline())
    wait_for([tmp_path / "ready0", tmp_path / "ready1"])
    return shell, launcher, [int((tmp_path / f"ready{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")
@pytest.mark.skipif(sys.version_info < (3, 11), reason="Popen(process_group=)")
def test_ctrl_z_pauses_the_ranks_with_the_launcher_and_fg_continues_them(tmp_path):
    """Ctrl-Z (SIGTSTP to the job's process group, which the ranks share) stops the
    launcher and the ranks, and the shell's SIGCONT continues them (ranks in sessions of
    their own, tried for Ctrl-C, went on training, and stayed stopped for good if the
    launcher died while paused); a stop then ends the run as usual."""
    shell, launcher, ranks = start_job(tmp_path)
    os.killpg(launcher, signal.SIGTSTP)
    assert wait_state(launcher, "T") == "T"
    assert [wait_state(pid, "T") for pid in ranks] == ["T", "T"]
    os.killpg(launcher, signal.SIGCONT)  # fg
    assert all(wait_state(pid, "RS") in "RS" for pid in ranks)
    os.kill(launcher, signal.SIGTERM)
    out, _ = shell.communicate(timeout=30)
    assert shell.returncode == STOPPED_EXIT_CODE, out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")
@pytest.mark.skipif(sys.version_info < (3, 11), reason="Popen(process_group=)")
def test_ranks_paused_with_a_launcher_that_dies_do_not_stay_paused(tmp_path):
    """Ctrl-Z, then the launcher is killed (SIGKILL): the ranks, in its process group,
    are an orphaned group with stopped members, which the kernel continues with SIGHUP:
    they end. In sessions of their own they stayed stopped for good, holding their
    memory and the output folder's lock."""
    shell, launcher, ranks = start_job(tmp_path)
    os.killpg(launcher, signal.SIGTSTP)
    assert [wait_state(pid, "T") for pid in ranks] == ["T", "T"]
    os.kill(launcher, signal.SIGKILL)
    shell.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        states = []
        for pid in ranks:
            try:
                states.append(proc_state(pid))
            except OSError:
                states.append("gone")
        if all(state in ("gone", "Z") for state in states):
            break
        time.sleep(0.05)
    assert all(state in ("gone", "Z") for state in states), states


# A rank that is still starting (no StopRequest yet): SIGTERM ends it where it is. (The
# name stop_with_launcher, in this comment, lets `no_rank_left` kill one left running.)
STARTING_CHILD = """
import os, time  # not yet stop_with_launcher
from pathlib import Path
(Path(os.environ["STOP_TEST_DIR"]) / f"ready{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(60)
"""


def test_ctrl_c_before_any_rank_trains_says_that_nothing_was_saved(tmp_path):
    """Every rank ends before its training loop: the launcher says nothing was saved
    and exits 130 for a Ctrl-C, not 143, which scripts read as a resumable stop."""
    proc = start_launcher(tmp_path, child=STARTING_CHILD)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "Every rank has stopped before training: nothing was saved." in out


def test_a_second_ctrl_c_after_every_rank_saved_keeps_the_stop_s_exit_code(tmp_path):
    """Ctrl-C, the ranks save and exit 143, then Ctrl-C again before the launcher's next
    poll (3 s here): the run stopped as asked (143), and nothing is killed. It said
    "Interrupted again" and exited 130."""
    proc = start_launcher(tmp_path, poll_s=3.0)
    ranks = [int((tmp_path / f"ready{rank}").read_text()) for rank in (0, 1)]
    os.killpg(proc.pid, signal.SIGINT)
    wait_for([tmp_path / "saved0", tmp_path / "saved1"])
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.02)  # reaped by the launcher's threads
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == STOPPED_EXIT_CODE, out
    assert "Every rank has stopped (exit code 143)." in out
    assert "Interrupted again" not in out


def test_an_inherited_ignored_ctrl_c_stays_ignored():
    """A process started with Ctrl-C ignored (the launcher's ranks; a job that a shell
    without job control starts with `&`) is not stopped by one in training either."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest(TRAINING_STOP_SIGNALS):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_once_a_stop_is_saved_ctrl_c_does_not_change_the_exit_code():
    """After the stop is saved the process exits (~2 s of interpreter shutdown with
    torch and spaCy); a Ctrl-C then made the exit code -2 instead of 143."""
    code = LIGHT_IMPORT + (
        "import os, signal, time\n"
        "from spacy_lean.training.stopping import STOPPED_EXIT_CODE, ignore_ctrl_c\n"
        "ignore_ctrl_c()\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.1)\n"
        "sys.exit(STOPPED_EXIT_CODE)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == STOPPED_EXIT_CODE, proc.stderr


def test_under_torchrun_the_stop_message_offers_no_second_ctrl_c(capfd, monkeypatch, tmp_path):
    """torchrun's agent turns a second Ctrl-C into SIGTERM for its workers (and kills them
    30 s after the first): "press Ctrl-C again to stop at once" would not be true there."""
    from spacy_lean.training.stopping import say_stopping

    say_stopping(tmp_path)(signal.SIGINT)
    assert "Press Ctrl-C again to stop at once" in capfd.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    say_stopping(tmp_path)(signal.SIGINT)
    err = capfd.readouterr().err
    assert "Received SIGINT: training stops after this step" in err
    assert "Ctrl-C again" not in err


def test_ranks_a_scheduler_stops_are_waited_for_not_killed(tmp_path):
    """A scheduler signals the ranks themselves: rank 0 exits first with 143, which is
    no failure, so rank 1 may go on saving past the failure path's grace (0.5 s)."""
    proc = start_launcher(tmp_path, grace_s=0.5, save_s=2.0)
    for rank in (0, 1):
        os.kill(int((tmp_path / f"ready{rank}").read_text()), signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == STOPPED_EXIT_CODE, out
    assert (tmp_path / "saved1").exists(), out
    assert "Received" not in out  # the launcher itself got no signal


# Rank 1 fails; rank 0 fails after it, as a rank whose collective breaks does.
FAILING_CHILD = """
import os, signal, sys, time
from pathlib import Path
out, rank, how = Path(os.environ["STOP_TEST_DIR"]), os.environ["RANK"], sys.argv[1]
if rank == "1":
    time.sleep(0.3)
    (out / "failed1").write_text("")
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
while not (out / "failed1").exists():
    time.sleep(0.005)
time.sleep(0.05 if how == "error" else 60)
sys.exit(1)
"""


@pytest.mark.parametrize(
    "how,code,says",
    [("error", 3, "exited with code 3 first"), ("killed", 137, "was killed by signal 9 first")],
)
def test_the_launcher_blames_the_rank_that_failed_first(tmp_path, how, code, says):
    """Rank 1 fails and rank 0 follows 50 ms later, within one poll (1 s here): the
    launcher blamed the lowest rank it found dead, rank 0, and returned its code. It
    now blames the first to exit. A rank killed by SIGKILL (the out-of-memory killer)
    made the launcher exit 1; now 137, as a shell says."""
    launcher = LIGHT_IMPORT + (
        "from spacy_lean.training.launch import launch_local\n"
        "sys.exit(launch_local([sys.executable, '-c', sys.argv[1], sys.argv[2]], 2, "
        "poll_s=1.0, grace_s=5.0, log=print))\n"
    )
    env = dict(os.environ, STOP_TEST_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", launcher, FAILING_CHILD, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert f"Rank 1 of 2 {says}" in proc.stdout


# Rank 0 fails first and reports it, but takes 1 s to exit (its traceback, its
# teardown); rank 1, its collective broken by then, fails and exits at once.
SLOW_FAILING_CHILD = (
    LIGHT_IMPORT
    + """
import os, time
from spacy_lean.training.launch import FAILURE_DIR_ENV, report_failure
rank = int(os.environ["RANK"])
reported = os.path.join(os.environ[FAILURE_DIR_ENV], "rank0")
if rank == 0:
    time.sleep(0.2)
    report_failure(0)
    time.sleep(1.0)
    sys.exit(1)
while not os.path.exists(reported):
    time.sleep(0.01)
time.sleep(0.05)
report_failure(1)
sys.exit(2)
"""
)


def test_the_launcher_blames_the_rank_that_reported_its_failure_first(tmp_path):
    """Rank 0 fails (a logger's setup raised, say) and rank 1's collective breaks after
    it, but rank 1's process ends first: the launcher blamed rank 1 ("See rank 1's
    output above for the cause"); it now goes by the time each rank failed."""
    launcher = LIGHT_IMPORT + (
        "from spacy_lean.training.launch import launch_local\n"
        "sys.exit(launch_local([sys.executable, '-c', sys.argv[1]], 2, "
        "poll_s=0.05, grace_s=5.0, log=print))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", launcher, SLOW_FAILING_CHILD],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Rank 0 of 2 failed first; stopped the other ranks" in proc.stdout


def test_ranks_stop_when_their_launcher_is_killed(tmp_path):
    """SIGKILL leaves the launcher no chance to pass anything on: the ranks get SIGTERM
    anyway (parent-death signal) and stop as asked, instead of training on alone."""
    proc = start_launcher(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()
    wait_for([tmp_path / "saved0", tmp_path / "saved1"], timeout=20)


def test_stop_with_launcher_signals_at_once_when_the_launcher_is_gone():
    """Started after its launcher died: SIGTERM at once. (In a subprocess: the call sets
    this process's parent-death signal.)"""
    code = LIGHT_IMPORT + (
        "import signal; from spacy_lean.training.launch import stop_with_launcher\n"
        "sent = []\n"
        "assert stop_with_launcher(2**22 + 7, send=lambda pid, sig: sent.append(sig))\n"
        "import time; time.sleep(1.5)\n"  # the thread that watches, where prctl is missing
        "print(sent == [signal.SIGTERM])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stdout + out.stderr


def test_stop_with_launcher_needs_a_launcher(monkeypatch):
    monkeypatch.delenv("SPACY_LEAN_LAUNCHER_PID", raising=False)
    assert stop_with_launcher() is False


def test_a_stop_request_records_the_first_signal_and_restores_the_handler():
    previous = signal.getsignal(signal.SIGTERM)
    calls = []
    with StopRequest(on_signal=calls.append) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one changes nothing
        time.sleep(0.01)
        assert stop.requested and stop.signum == signal.SIGTERM
    assert calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_first_ctrl_c_asks_training_to_stop_and_a_second_raises():
    """In training, Ctrl-C is a stop request (the step is finished and saved); a SIGTERM
    after it changes nothing; Ctrl-C again raises KeyboardInterrupt, as Python's own
    handler does. Outside training (the default signals) Ctrl-C is left alone."""
    previous = signal.getsignal(signal.SIGINT)
    calls = []
    with StopRequest(TRAINING_STOP_SIGNALS, on_signal=calls.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.requested and stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert calls == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is previous
    with StopRequest():
        assert signal.getsignal(signal.SIGINT) is previous


def test_replace_dir_keeps_the_previous_folder_when_writing_fails(tmp_path):
    path = tmp_path / "model-last"

    def write(text):
        def to(tmp):
            tmp.mkdir()
            (tmp / "weights").write_text(text)
            if text == "broken":
                raise KeyboardInterrupt

        return to

    replace_dir(path, write("first"))
    with pytest.raises(KeyboardInterrupt):
        replace_dir(path, write("broken"))
    assert (path / "weights").read_text() == "first"
    # Nothing half-written is left behind (before, model-last.tmp stayed until the next save).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-last"]
    replace_dir(path, write("second"))
    assert (path / "weights").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-last"]
