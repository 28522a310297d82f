"""Imports every command module so that its `@lean_cli.command` runs.

Add one line per command module; a module that is missing is a bug, not optional."""

from . import train_charlm  # noqa: F401
from . import evaluate  # noqa: F401
from . import shard  # noqa: F401
from . import train  # noqa: F401
