"""The long description PyPI shows (README.md, built by setup.py) has no relative link: they
would break on PyPI. The metadata is built as a wheel build would (setuptools' PEP 517
`prepare_metadata_for_build_wheel`) from a copy of the packaging files."""

import email
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = "https://example.org/owner/spacy-lean/blob/main"

# Link targets in markdown prose: [text](target), [id]: target, href="target", src="target".
INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HTML = re.compile(r"\b(?:href|src)\s*=\s*[\"']([^\"']+)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose(markdown):
    """The text outside fenced code blocks and inline code."""
    lines, in_code = [], False
    for line in markdown.splitlines():
        if re.match(r"\s*(```|~~~)", line):
            in_code = not in_code
        elif not in_code:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def link_targets(markdown):
    prose = _prose(markdown)
    return [t for pattern in (INLINE, REFERENCE, HTML) for t in pattern.findall(prose)]


def relative_links(markdown):
    return [t for t in link_targets(markdown) if not SCHEME.match(t)]


def _setup_module():
    spec = importlib.util.spec_from_file_location("spacy_lean_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: setup() is not called
    return module


def build_metadata(tmp_path, base_url=None):
    """The METADATA a wheel of this checkout would carry (a copy of its packaging files;
    `base_url` replaces setup.cfg's [pypi_links] base_url)."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    (src / "spacy_lean").mkdir(parents=True)
    (src / "spacy_lean" / "__init__.py").write_text("")
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    if base_url is not None:
        cfg = (src / "setup.cfg").read_text(encoding="utf8")
        cfg, n = re.subn(r"(?m)^base_url =.*$", f"base_url = {base_url}", cfg)
        assert n == 1, "setup.cfg declares [pypi_links] base_url once"
        (src / "setup.cfg").write_text(cfg, encoding="utf8")
    (src / "meta").mkdir()
    code = (
        "from setuptools import build_meta; "
        "print(build_meta.prepare_metadata_for_build_wheel('meta'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist_info = proc.stdout.strip().splitlines()[-1]
    return email.message_from_string((src / "meta" / dist_info / "METADATA").read_text("utf8"))


def test_published_long_description_has_no_relative_link(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf8")
    assert relative_links(readme), "README.md has relative links: the check below means something"
    meta = build_metadata(tmp_path)
    text = meta.get_payload()
    assert meta["Description-Content-Type"].startswith("text/markdown")
    assert not relative_links(text)
    # Nothing else lost: with no base URL the links become their text, naming the file.
    for target in relative_links(readme):
        path = target.partition("#")[0]
        assert not path or path in text, f"{path} is no longer named"
    headings = [line for line in readme.splitlines() if line.startswith("#")]
    assert headings and all(h in text.splitlines() for h in headings)


def test_with_a_base_url_every_relative_link_points_there(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf8")
    text = build_metadata(tmp_path, base_url=BASE + "/").get_payload()
    assert not relative_links(text)
    expected = {
        f"{BASE}/README.md{t}" if t.startswith("#") else f"{BASE}/{t}"
        for t in relative_links(readme)
    }
    assert {t for t in link_targets(text) if t.startswith(BASE)} == expected
    # The absolute links README.md already had are kept.
    assert {t for t in link_targets(readme) if SCHEME.match(t)} <= set(link_targets(text))


def test_links_in_code_images_and_absolute_links_are_left_alone():
    rewrite = _setup_module().pypi_long_description
    text = (
        "See [the docs](docs/a.md#x), [`code` in text](docs/b.md), [a.md](docs/a.md),\n"
        "[above](#top), ![chart](benchmarks/c.png), [site](https://example.org/a.md)\n"
        "and `[not a link](docs/a.md)`.\n"
        "```\n[in a fence](docs/a.md)\n```\n"
    )
    assert rewrite(text, "") == (
        "See the docs (docs/a.md), `code` in text (docs/b.md), docs/a.md,\n"
        "above, chart, [site](https://example.org/a.md)\n"
        "and `[not a link](docs/a.md)`.\n"
        "```\n[in a fence](docs/a.md)\n```\n"
    )
    assert rewrite(text, "https://h/r") == (
        "See [the docs](https://h/r/docs/a.md#x), [`code` in text](https://h/r/docs/b.md), "
        "[a.md](https://h/r/docs/a.md),\n"
        "[above](https://h/r/README.md#top), ![chart](https://h/r/benchmarks/c.png), "
        "[site](https://example.org/a.md)\n"
        "and `[not a link](docs/a.md)`.\n"
        "```\n[in a fence](docs/a.md)\n```\n"
    )


def test_base_url_is_read_from_setup_cfg(tmp_path):
    module = _setup_module()
    assert module.base_url() == ""  # no public repository yet: see docs/development.md
    cfg = tmp_path / "setup.cfg"
    cfg.write_text(f"[pypi_links]\nbase_url = {BASE}/\n")
    assert module.base_url(cfg) == BASE


def test_the_sdist_carries_the_project_the_tests_and_a_license(tmp_path):
    """The README's two commands need the spaCy project (project.yml, configs/, scripts/,
    benchmarks/) and the tests with their data: the sdist carried the package, README
    and test_*.py alone, so neither ran from it; and setup.cfg said MIT with no license
    file. The wheel stays the package alone."""
    pytest.importorskip("setuptools")
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout to know the tracked files")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode("utf8")
    src = tmp_path / "src"
    for name in filter(None, tracked.split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, src / name)
    code = (
        "import tarfile; from setuptools import build_meta; "
        "name = build_meta.build_sdist('dist'); "
        "print('\\n'.join(tarfile.open('dist/' + name).getnames()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {n.partition("/")[2] for n in proc.stdout.split()}
    for needed in (
        "LICENSE",
        "project.yml",
        "configs/ner_trf.cfg",
        "scripts/make_corpus.py",
        "benchmarks/cleaner_memory.py",
        "docs/training.md",
        "tests/conftest.py",
        "tests/eval_util.py",
        "tests/data/charlm/h64-forward.pt",
        "spacy_lean/cleaner.py",
    ):
        assert needed in names, f"the sdist has no {needed}"
    assert not [n for n in names if n.endswith((".pyc", ".pyo")) or "__pycache__" in n]
    # Every tracked file the project or the tests use is in it.
    missing = [
        n
        for n in filter(None, tracked.split("\0"))
        if n.startswith(("configs/", "scripts/", "tests/", "benchmarks/")) and n not in names
    ]
    assert not missing, missing
