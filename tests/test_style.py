"""The code is formatted with black (settings in pyproject.toml), as spaCy's own is:
`python -m black spacy_lean tests benchmarks scripts setup.py` formats it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["spacy_lean", "tests", "benchmarks", "scripts", "setup.py"]


def test_code_is_black_formatted():
    pytest.importorskip("black", reason="black is in the dev extra")
    proc = subprocess.run(
        [sys.executable, "-m", "black", "--check", "--quiet", *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (
        "Not formatted with black (run `python -m black spacy_lean tests benchmarks scripts "
        f"setup.py`):\n{proc.stderr[-3000:]}"
    )
