"""Pointing warnings at the user's code."""

import os
import sys
from pathlib import Path

import spacy

_INTERNAL_DIRS = tuple(str(Path(path).parent) + os.sep for path in (spacy.__file__, __file__))


def caller_stacklevel() -> int:
    """The `stacklevel` for `warnings.warn` (called by this function's caller) that
    points the warning at the first frame outside spaCy and spacy-lean: the user's
    `nlp(...)`, `nlp.pipe`, `nlp.initialize` or `spacy_lean.evaluate` call."""
    frame = sys._getframe(1)  # the function that calls warnings.warn
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame = frame.f_back
        level += 1
    return level
