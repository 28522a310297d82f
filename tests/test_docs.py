"""The documentation holds together: README.md and docs/*.md.

- every relative link (images included) points to a file that exists, and every `#anchor`
  into a markdown file (or into the same page) names a heading of that file;
- every `spacy lean <command>` named in them exists: its `--help` runs;
- every name registered in setup.cfg's entry points is documented on a page of docs/;
- every chart in benchmarks/results/ is shown on some page.
"""
import configparser
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README] + sorted(DOCS.glob("**/*.md"))
RESULTS = ROOT / "benchmarks" / "results"

FENCE = re.compile(r"^(```|~~~)")
# [text](target) and ![alt](target); target up to the first space or closing parenthesis.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# `spacy lean <command>`, also as `python -m spacy lean ...` and `torchrun ... -m spacy lean ...`.
LEAN_COMMAND = re.compile(r"\bspacy lean ([A-Za-z][\w-]*)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _split_code(text):
    """(prose lines, all lines): prose has fenced code blocks blanked out."""
    prose, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            in_code = not in_code
            prose.append("")
            continue
        prose.append("" if in_code else line)
    return prose


def github_slug(heading):
    """The anchor GitHub gives a heading: lower case, markup and punctuation removed
    (hyphens and underscores kept), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").strip().lower()
    kept = []
    for char in text:
        if char in "-_ " or char.isalnum() or unicodedata.category(char).startswith("M"):
            kept.append(char)
    return "".join(kept).replace(" ", "-")


def anchors(path):
    """Every anchor of a markdown file, with GitHub's -1, -2 ... for repeated headings."""
    seen = {}
    result = set()
    for line in _split_code(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        if slug in seen:
            seen[slug] += 1
            result.add(f"{slug}-{seen[slug]}")
        else:
            seen[slug] = 0
            result.add(slug)
    return result


def links(path):
    for number, line in enumerate(_split_code(path.read_text(encoding="utf-8")), 1):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def _is_external(target):
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None


def test_pages_exist():
    names = {p.name for p in DOCS.glob("*.md")}
    expected = {
        "lean_cleaner.md", "evaluation.md", "scoring.md", "corpus.md", "charlm.md",
        "charlm_training.md", "distributed.md", "training.md", "project.md", "benchmarks.md",
        "security.md",
    }
    assert expected <= names, f"missing pages: {sorted(expected - names)}"


def test_readme_is_short():
    n_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert n_lines <= 260, f"README.md has {n_lines} lines; move details to a page in docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    anchor_cache = {}
    broken = []
    n_links = 0
    for number, target in links(page):
        if _is_external(target):
            continue
        n_links += 1
        file_part, _, anchor = target.partition("#")
        dest = page if not file_part else (page.parent / file_part).resolve()
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no file {dest}")
            continue
        if anchor:
            if dest.suffix != ".md":
                broken.append(f"{where}: anchor into a file that is not markdown")
                continue
            if dest not in anchor_cache:
                anchor_cache[dest] = anchors(dest)
            if anchor not in anchor_cache[dest]:
                broken.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, "broken links:\n" + "\n".join(broken)
    if page == README:
        assert n_links > 10, "the README should link to its pages"


def test_github_slug():
    assert github_slug("`spacy lean evaluate MODEL DATA`") == "spacy-lean-evaluate-model-data"
    assert github_slug("Scores that merge (`spacy_lean.scoring`)") == "scores-that-merge-spacy_leanscoring"
    assert github_slug("Measured: loader memory on a 100 MB text") == (
        "measured-loader-memory-on-a-100-mb-text"
    )
    assert github_slug("In `spacy train` and `spacy evaluate`") == "in-spacy-train-and-spacy-evaluate"


def test_link_checker_finds_broken_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## A `b` c\n\n[ok](#a-b-c) [bad](#nope) ![img](missing.png)\n"
        "```\n[in code](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert anchors(page) == {"title", "a-b-c"}
    assert [t for _, t in links(page)] == ["#a-b-c", "#nope", "missing.png"]


def _named_lean_commands():
    named = {}
    for page in PAGES:
        for match in LEAN_COMMAND.finditer(page.read_text(encoding="utf-8")):
            named.setdefault(match.group(1), str(page.relative_to(ROOT)))
    return named


def test_named_lean_commands_run():
    """Each distinct `spacy lean <command>` named in the docs: `--help` runs, in one process
    that loads spaCy's CLI the way `python -m spacy` does (through the `spacy_cli` entry points)."""
    named = _named_lean_commands()
    assert "evaluate" in named and "shard" in named and "train-charlm" in named
    script = (
        "import sys\n"
        "from spacy.util import registry\n"
        "registry.cli.get_all()\n"  # what spacy.cli.setup_cli does: load `spacy_cli` entry points
        "from spacy.cli._util import app\n"
        "from typer.testing import CliRunner\n"
        "runner = CliRunner()\n"
        "failed = []\n"
        "for sub in sys.argv[1:]:\n"
        "    result = runner.invoke(app, ['lean', sub, '--help'])\n"
        "    if result.exit_code != 0 or 'Usage' not in result.output:\n"
        "        failed.append(f'{sub}: exit {result.exit_code}: {result.output[-500:]}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    subs = sorted(named)
    proc = subprocess.run(
        [sys.executable, "-c", script, *subs], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    where = ", ".join(f"{s} ({named[s]})" for s in subs)
    assert proc.returncode == 0, (
        f"`spacy lean <command> --help` failed for commands named in the docs ({where}):\n"
        f"{proc.stdout}\n{proc.stderr[-2000:]}"
    )


def _entry_points():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    for group, body in cfg["options.entry_points"].items():
        for line in body.strip().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                yield group, line.split("=", 1)[0].strip()


def test_every_entry_point_is_documented():
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("**/*.md")))
    missing = []
    for group, name in _entry_points():
        if group == "spacy_cli":
            needle = re.compile(rf"\bspacy {re.escape(name)}\b")
        else:
            needle = re.compile(rf"`{re.escape(name)}`|\"{re.escape(name)}\"")
        if not needle.search(text):
            missing.append(f"{group}: {name}")
    assert not missing, f"registered in setup.cfg but named on no page of docs/: {missing}"


def _charts():
    """The committed charts (git's index), or every PNG when this is no git checkout: a chart
    a benchmark is still drawing is not yet part of the documentation."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--", "benchmarks/results/*.png"],
            cwd=ROOT, capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        listed = None
    if listed is not None and listed.returncode == 0:
        return sorted(ROOT / line for line in listed.stdout.splitlines() if line.strip())
    return sorted(RESULTS.glob("*.png"))


def test_every_chart_is_shown():
    charts = _charts()
    assert charts, "no charts in benchmarks/results"
    shown = set()
    for page in PAGES:
        for _, target in links(page):
            if not _is_external(target) and target.endswith(".png"):
                shown.add((page.parent / target.partition("#")[0]).resolve())
    missing = [str(c.relative_to(ROOT)) for c in charts if c.resolve() not in shown]
    assert not missing, f"charts shown on no page (add them, with a caption, where their figures are): {missing}"
