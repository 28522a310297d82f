"""Imports every command module so that its `@lean_cli.command` runs.

Add one line per command module; a module that is missing is a bug, not optional."""
