"""Comparing score dicts the way the parity tests do: useful to check a streaming
or merged evaluation against `nlp.evaluate`."""

import math
from typing import Any


def assert_scores_equal(
    expected: Any, got: Any, *, ordered: bool = True, tol: float = 1e-12, path: str = "scores"
) -> None:
    """Assert two score dicts agree: the same keys (in the same order where
    `ordered`), `None` where `expected` has `None`, floats within `tol`
    (NaN equals NaN), other values equal and of the same type.

    expected (Any): The reference scores (e.g. from `nlp.evaluate`).
    got (Any): The scores to check.
    ordered (bool): Whether dict key order must match too.
    tol (float): Absolute tolerance for floats.
    path (str): Name of the value, for the error message.
    """
    if isinstance(expected, dict):
        assert isinstance(got, dict), f"{path}: {got!r} is not a dict"
        if ordered:
            assert list(got) == list(expected), f"{path}: key order {list(got)} != {list(expected)}"
        else:
            assert set(got) == set(expected), f"{path}: keys {set(got)} != {set(expected)}"
        for key in expected:
            assert_scores_equal(
                expected[key], got[key], ordered=ordered, tol=tol, path=f"{path}.{key}"
            )
    elif isinstance(expected, float):
        assert isinstance(got, float), f"{path}: {got!r} is not a float"
        if math.isnan(expected):
            assert math.isnan(got), f"{path}: {got} != nan"
        else:
            assert abs(expected - got) <= tol, f"{path}: {got} != {expected}"
    else:
        assert got == expected and type(got) is type(expected), f"{path}: {got!r} != {expected!r}"
