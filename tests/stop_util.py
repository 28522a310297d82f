"""A fixed moment for a stop signal in tests: the n-th call of a method sends this
process SIGTERM."""

import os
import signal


def sigterm_on_call(monkeypatch, owner, name: str, n: int, signum=signal.SIGTERM) -> list:
    """Patch `owner.name` so that its `n`-th call sends this process SIGTERM (or
    `signum`) before it runs. RETURNS the list that counts the calls."""
    real = getattr(owner, name)
    calls: list = []

    def wrapper(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signum)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls
