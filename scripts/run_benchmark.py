"""Run one benchmark script (benchmarks/<name>.py) and check that it wrote its
results (benchmarks/results/<name>.json; with --size quick a script may leave the
recorded results alone).

Exists so project.yml can choose the size with a plain var (`--vars.bench_size
quick`): a var's value cannot start with "--" on spaCy's command line.
"""

import subprocess
import sys
import time
from pathlib import Path

import typer
from wasabi import msg

SIZES = ("default", "quick")


def main(
    name: str = typer.Argument(..., help="Benchmark name: runs benchmarks/<name>.py"),
    size: str = typer.Option(
        "default", "--size", help="'default' sizes or 'quick' (the script's --quick)"
    ),
    python: str = typer.Option(
        sys.executable, "--python", help="Python to run it with (e.g. one with Flair)"
    ),
    benchmarks_dir: Path = typer.Option(
        Path("benchmarks"), "--benchmarks-dir", help="Folder of the benchmark scripts"
    ),
):
    """Run benchmarks/<name>.py [--quick] and check benchmarks/results/<name>.json."""
    if size not in SIZES:
        msg.fail(f"--size must be one of {', '.join(SIZES)}, got '{size}'", exits=1)
    script = benchmarks_dir / f"{name}.py"
    if not script.exists():
        msg.fail(f"No benchmark script {script}", exits=1)
    results = benchmarks_dir / "results" / f"{name}.json"
    cmd = [python, str(script)] + (["--quick"] if size == "quick" else [])
    msg.info("Running " + " ".join(cmd))
    start = time.time()
    code = subprocess.call(cmd)
    if code != 0:
        msg.fail(f"{script} failed with exit code {code}", exits=code)
    if not results.exists() or results.stat().st_mtime < start:
        # Some scripts keep the recorded results when run with --quick.
        if size == "quick":
            msg.warn(f"{script} --quick left {results} as it was")
            return
        msg.fail(f"{script} did not write {results}", exits=1)
    msg.good(f"{name}: {time.time() - start:.0f}s -> {results}")


if __name__ == "__main__":
    typer.run(main)
