"""Settings read from environment variables."""

import os


def positive_int_env(name: str, default: int, unit: str) -> int:
    """The value of the environment variable `name` as a positive int, or `default`
    where it is unset or empty. RAISES (ValueError): another value, naming the variable
    and what it must be (`unit`: "number of bytes", ...)."""
    value = os.environ.get(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ValueError(f"{name} must be a positive {unit}, got {value!r}.")
    return number
