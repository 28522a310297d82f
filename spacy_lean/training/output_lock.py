"""One run per output folder: `spacy lean train` holds a lock on `--output` while it
runs, so that a second run given the same folder (a `--resume` started while the run
is still going, a job scheduled twice) is refused at once instead of overwriting the
first run's model-best, model-last and training-state as they are written.

The lock is an advisory `flock` on a file in the folder, held by the process that
writes there (rank 0, or the launcher of `--nproc N`). The kernel lets go of it when
that process ends, however it ends (also SIGKILL, or the machine's crash for a local
file system), so a stale lock never blocks a `--resume`. Where the file system has no
locks (ENOLCK, EOPNOTSUPP) or the platform has no `fcntl`, the run goes on unlocked,
with a warning."""

import datetime
import errno
import json
import os
import socket
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Tuple

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".spacy-lean-train.lock"


class OutputInUseError(RuntimeError):
    """Another running process holds the lock on the output folder."""


def _holder(fd: int) -> str:
    """What the lock file says of the process that holds it, as words."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 65536).decode("utf8"))
        command = " ".join(str(part) for part in data.get("command", []))
        return f"process {int(data['pid'])} on {data['host']}, started {data['started']}" + (
            f": {command}" if command else ""
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "a process that has not written its details yet"


def _command() -> list:
    """This process's command line, `python -m spacy ...` as such."""
    if not sys.argv:
        return []
    first = Path(sys.argv[0])
    if first.name == "__main__.py":
        return ["python", "-m", first.parent.name, *sys.argv[1:]]
    return [first.name, *sys.argv[1:]]


def _open(path: Path) -> Tuple[Optional[int], bool]:
    """The lock file opened for writing (created readable and writable for all, less
    the umask: a folder shared by a group is locked by each of its users), else for
    reading (a file another user left, which a lock needs no write access to).
    RETURNS: (the descriptor, whether it is writable); (None, False) where neither
    opens, with a warning."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
    except PermissionError:
        pass
    try:
        return os.open(path, os.O_RDONLY), False
    except OSError as err:
        warnings.warn(
            f"Could not open {path} to lock the output folder ({err.strerror}): nothing stops "
            "a second run from writing to the same --output meanwhile.",
            stacklevel=4,
        )
        return None, False


@contextmanager
def output_lock(output_path: Optional[Path]) -> Iterator[Optional[int]]:
    """Hold the lock on `output_path` (created if missing) for the `with` block.

    output_path (Optional[Path]): the run's --output; None: nothing is locked.
    YIELDS (Optional[int]): the lock file's descriptor (None where nothing is locked):
        a process started with it open (`subprocess.Popen(pass_fds=...)`) holds the
        lock as long as it runs, also after this one ended.
    RAISES OutputInUseError: another live process holds it (the message names it, the
        folder and what to do).
    """
    if output_path is None or fcntl is None:
        yield None
        return
    output_path = Path(output_path)
    output_path.mkdir(parents=True, exist_ok=True)
    path = output_path / LOCK_FILE
    fd, writable = _open(path)
    if fd is None:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputInUseError(
                f"Another training run is writing to {output_path} ({_holder(fd)}). Two runs in "
                "one --output overwrite each other's model-best, model-last and "
                "training-state. Wait for it to end or stop it (SIGTERM or Ctrl+C saves its "
                "state, to continue with --resume), or give this run another --output."
            ) from None
        except OSError as err:
            # EBADF: a read-only descriptor, where the file system locks by writing.
            no_locks = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)
            if err.errno not in no_locks:
                raise
            warnings.warn(
                f"Could not lock {path} ({err.strerror}): the file system has no locks, so "
                "nothing stops a second run from writing to the same --output meanwhile.",
                stacklevel=3,
            )
            yield None
            return
        if not writable:  # locked; its details are another user's file's
            yield fd
            return
        details = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S UTC"
            ),
            "command": _command(),
        }
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(details).encode("utf8"))
        yield fd
    finally:
        os.close(fd)  # lets go of the lock
