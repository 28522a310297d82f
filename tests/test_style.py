"""The code is formatted with black (settings in pyproject.toml), as spaCy's own is:
`python -m black spacy_lean tests benchmarks scripts setup.py` formats it; and it passes
flake8 (settings in setup.cfg): `python -m flake8 spacy_lean tests benchmarks scripts setup.py`."""

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


def test_code_passes_flake8():
    pytest.importorskip("flake8", reason="flake8 is in the dev extra")
    proc = subprocess.run(
        [sys.executable, "-m", "flake8", *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    findings = proc.stdout.splitlines()
    assert proc.returncode == 0, (
        f"flake8 reports {len(findings)} finding(s) (run `python -m flake8 spacy_lean tests "
        "benchmarks scripts setup.py`; settings in setup.cfg):\n"
        + "\n".join(findings[:30])
        + f"\n{proc.stderr[-3000:]}"
    )
