"""How a benchmark reports and where it works: the command that ran it, its JSON printed
and saved where it was asked to be, and a work folder that is removed afterwards unless
the user named one."""

import contextlib
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union


def command_line(
    script: Union[str, Path], argv: Optional[Sequence[str]] = None, python: str = "python"
) -> str:
    """The command that runs `script` (a file in benchmarks/) as this process was run:
    `python benchmarks/<script> ARGS`, each argument quoted as a shell needs it, and
    `nice -n N` before it when this process runs at niceness N (not 0). `argv`: the
    arguments (default: sys.argv[1:]); `python`: the interpreter, where it matters which
    (sys.executable for one with Flair)."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join([python, f"benchmarks/{Path(script).name}", *args])
    niceness = os.nice(0) if hasattr(os, "nice") else 0
    return f"nice -n {niceness} {command}" if niceness else command


@contextlib.contextmanager
def work_folder(path: Optional[Union[str, Path]], prefix: str) -> Iterator[Path]:
    """`path` (made if missing, and kept), or when it is None a new temporary folder whose
    name starts with `prefix`, removed with everything in it when the block ends (also on
    an error or Ctrl-C)."""
    if path is not None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def print_and_save(report: Any, path: Optional[Union[str, Path]]) -> None:
    """Print `report` as indented JSON and, unless `path` is None, write the same text
    there (its folder made if missing)."""
    text = json.dumps(report, indent=2)
    print(text)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf8")
