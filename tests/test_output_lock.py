"""One run per output folder: `spacy lean train` locks its --output while it runs. A
second run given a folder another live process holds (a `--resume` started while the
run still goes, a job scheduled twice) is refused before it builds anything, naming
the process; a lock whose holder died (SIGKILL) does not block; a file system without
locks warns and trains. The holder is a real second process; the runs are the real
CLI function on a tiny tok2vec + ner pipeline."""

import errno
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from spacy_lean import synthetic
from spacy_lean.cli.train import train
from spacy_lean.training import output_lock as lock_module
from spacy_lean.training.output_lock import LOCK_FILE, OutputInUseError, output_lock

HOLD = textwrap.dedent(
    """
    import sys, time
    from spacy_lean.training.output_lock import output_lock
    with output_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(120)
    """
)


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_ner_config):
    """config.cfg training on 8 generated docs for 2 steps, 4 dev docs."""
    root = tmp_path_factory.mktemp("lock")
    synthetic.write_ner_corpus(root / "train.spacy", 8, seed=41)
    synthetic.write_ner_corpus(root / "dev.spacy", 4, seed=42)
    config = tiny_ner_config()
    config["paths"]["train"] = str(root / "train.spacy")
    config["paths"]["dev"] = str(root / "dev.spacy")
    config["training"].update(max_steps=2, max_epochs=0, eval_frequency=2)
    config.to_disk(root / "config.cfg")
    return root


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock on tmp_path / "out"; killed at the end."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    proc.kill()
    proc.wait()


def _refused(capsys, *args, **kwargs):
    with pytest.raises(SystemExit) as info:
        train(*args, **kwargs)
    assert info.value.code == 1
    return " ".join(capsys.readouterr().out.split())


def test_a_second_run_in_a_locked_output_is_refused_naming_the_holder(root, holder, capsys):
    out, proc = holder
    started = time.perf_counter()
    text = _refused(capsys, root / "config.cfg", out)
    assert time.perf_counter() - started < 5  # before the pipeline is built
    assert f"Another training run is writing to {out} (process {proc.pid} on " in text
    assert "give this run another --output" in text and "--resume" in text
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written
    # A resume is refused alike (the run it would continue is still going).
    assert "Another training run is writing to" in _refused(
        capsys, root / "config.cfg", out, resume=True
    )


def test_the_lock_of_a_killed_run_does_not_block_the_next(root, holder):
    out, proc = holder
    proc.kill()
    proc.wait()
    train(root / "config.cfg", out)  # trains, and lets go of the lock when it ends
    assert (out / "model-last").is_dir()
    details = json.loads((out / LOCK_FILE).read_text(encoding="utf8"))
    assert details["pid"] == os.getpid()
    train(root / "config.cfg", out, resume=False)  # the same process again: unlocked


def test_the_launcher_of_nproc_holds_the_lock_and_is_refused_before_starting(
    root, holder, tmp_path
):
    out, proc = holder
    result = subprocess.run(
        [sys.executable, "-m", "spacy", "lean", "train", str(root / "config.cfg")]
        + ["--output", str(out), "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = " ".join(result.stdout.split())
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert f"(process {proc.pid} on " in text and "Rank" not in text, text
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


@pytest.mark.parametrize(
    "content", [b"", b"\x80\x81not json", b'{"pid": "x"}', b"[1, 2]", b"7" * 100_000]
)
def test_a_lock_file_of_any_content_is_only_read_as_words(tmp_path, content):
    """Whatever the lock file holds (written by hand, truncated, hostile), what the
    refusal says of its holder is words, never an error of its own."""
    path = tmp_path / LOCK_FILE
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert lock_module._holder(fd) == "a process that has not written its details yet"
    finally:
        os.close(fd)


def test_the_lock_is_refused_while_held_and_taken_again_after(tmp_path):
    out = tmp_path / "out"
    with output_lock(out):
        with pytest.raises(OutputInUseError, match=f"process {os.getpid()} on "):
            with output_lock(out):  # another open of the file: refused as another process
                pass
    with output_lock(out):  # let go of: taken again
        pass


def test_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="the file system has no locks"):
        with output_lock(tmp_path / "out"):
            ran = True
    assert ran


LAUNCHER = textwrap.dedent(
    """
    import sys
    from spacy_lean.training.launch import launch_local
    from spacy_lean.training.output_lock import output_lock
    with output_lock(sys.argv[1]) as fd:
        print("held", flush=True)
        rank = [sys.executable, "-c", f"import time; time.sleep({sys.argv[2]})"]
        launch_local(rank, 1, pass_fds=(fd,))
    """
)


def test_the_ranks_hold_the_lock_after_their_launcher_is_killed(tmp_path):
    """A launcher killed by SIGKILL leaves its ranks running (they save a checkpoint when
    they notice); the lock file, open in them too, stays locked until they end."""
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(out), "8"], stdout=subprocess.PIPE, text=True
    )
    assert launcher.stdout.readline().strip() == "held"
    time.sleep(1.5)  # the rank started
    launcher.kill()
    launcher.wait()
    with pytest.raises(OutputInUseError):
        with output_lock(out):
            pass
    deadline = time.monotonic() + 30
    while True:  # the rank ends after its sleep: the lock is let go of
        try:
            with output_lock(out):
                break
        except OutputInUseError:
            assert time.monotonic() < deadline, "still locked after the rank ended"
            time.sleep(0.5)


def test_a_lock_file_this_user_cannot_write_still_locks(tmp_path, monkeypatch):
    """Another user's run left the lock file (0644): it is opened for reading, which
    locks as well (a PermissionError stopped the run before)."""
    out = tmp_path / "out"
    with output_lock(out):
        pass
    real_open = os.open

    def open_read_only(path, flags, *args):
        if str(path).endswith(LOCK_FILE) and flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(lock_module.os, "open", open_read_only)
    with output_lock(out) as fd:
        assert fd is not None
        monkeypatch.setattr(lock_module.os, "open", real_open)
        with pytest.raises(OutputInUseError):
            with output_lock(out):
                pass
