"""The documentation holds together: README.md and docs/*.md.

- every relative link (images included) points to a file that exists, and every `#anchor`
  into a markdown file (or into the same page) names a heading of that file;
- every `spacy lean <command>` named in them exists: its `--help` runs;
- every name registered in setup.cfg's entry points is documented on a page of docs/;
- every chart in benchmarks/results/ is shown on some page;
- every `spacy_lean.x.y` named exists; every settings table of a registered function and
  every options table of a `spacy lean` command lists exactly the real settings / flags, with
  the real defaults where a cell holds a plain value.
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
        "lean_cleaner.md",
        "evaluation.md",
        "scoring.md",
        "corpus.md",
        "charlm.md",
        "charlm_training.md",
        "distributed.md",
        "training.md",
        "project.md",
        "benchmarks.md",
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
    assert (
        github_slug("Scores that merge (`spacy_lean.scoring`)")
        == "scores-that-merge-spacy_leanscoring"
    )
    assert github_slug("Measured: loader memory on a 100 MB text") == (
        "measured-loader-memory-on-a-100-mb-text"
    )
    assert (
        github_slug("In `spacy train` and `spacy evaluate`") == "in-spacy-train-and-spacy-evaluate"
    )


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
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
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
    assert (
        not missing
    ), f"charts shown on no page (add them, with a caption, where their figures are): {missing}"


# --- the pages against the code ---------------------------------------------------------

DOTTED_NAME = re.compile(r"\bspacy_lean(?:\.[A-Za-z_]\w*)+")


def _resolve(dotted):
    """The object a dotted name names: the longest importable module, then attributes."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


MODULE_TABLE = re.compile(r"^\| [A-Za-z]+ \(`(spacy_lean(?:\.\w+)*)`\) \|")


def _names_in_module_tables(text):
    """`module.name` for each row of a table headed "| Function (`module`) | ...", whose
    first cells name functions or classes (`name(...)` or `Name`)."""
    module = None
    for line in text.splitlines():
        match = MODULE_TABLE.match(line)
        if match:
            module = match.group(1)
        elif module and line.startswith("| `"):
            yield module + "." + re.match(r"[|] `(\w+)", line).group(1)
        elif module and not line.startswith("|"):
            module = None


def test_named_python_objects_exist():
    """Every `spacy_lean.x.y` a page names imports, or is an attribute of what does; so
    does every name in a table headed with its module ("Function (`spacy_lean.corpus`)")."""
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for name in sorted(set(DOTTED_NAME.findall(text)) | set(_names_in_module_tables(text))):
            try:
                _resolve(name)
            except (ImportError, AttributeError) as e:
                missing.append(f"{page.relative_to(ROOT)}: {name} ({e})")
    assert not missing, "names on the pages that the code does not have:\n" + "\n".join(missing)


def _table_after(page, anchor, header):
    """The rows (lists of cells) of the first table whose header starts with `header`,
    after the first heading of `page` that contains `anchor` (else its first line that
    does)."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    marks = [i for i, line in enumerate(lines) if anchor in line]
    headings = [i for i in marks if HEADING.match(lines[i])]
    assert marks, f"{page} does not name {anchor}"
    start = (headings or marks)[0]
    rows, in_table = [], False
    for line in lines[start:]:
        if not in_table:
            in_table = line.startswith(header)
            continue
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not set(cells[0]) <= set("-: "):
            rows.append(cells)
    assert rows, f"no table '{header} ...' after {anchor!r} in {page}"
    return rows


def _doc_default(cell):
    """A default cell as a value: its first `code` span read as JSON (`null`, `true`,
    `2000`, `"doc"`, `[]`), else None with `False` for "not comparable"."""
    import json

    match = re.match(r"`([^`]*)`", cell)
    if not match:
        return None, False
    try:
        return json.loads(match.group(1)), True
    except ValueError:
        return None, False


# Registered name -> (page, text the settings table follows).
SETTINGS_TABLES = {
    "lean_cleaner": ("lean_cleaner.md", "`lean_cleaner`"),
    "char_lm": ("charlm.md", "`char_lm` component"),
    "spacy-lean.CharLMEmbed.v1": ("charlm.md", "`spacy-lean.CharLMEmbed.v1`"),
    "spacy-lean.Corpus.v1": ("corpus.md", "`spacy-lean.Corpus.v1` settings"),
    "spacy-lean.batch_by_tokens.v1": ("corpus.md", "`spacy-lean.batch_by_tokens.v1` settings"),
    "spacy-lean.streaming_evaluate.v1": ("evaluation.md", "`spacy-lean.streaming_evaluate.v1`:"),
    "spacy-lean.strip_streaming_evaluate.v1": None,  # no settings (said on evaluation.md)
    "spacy-lean.lean_training.v1": ("training.md", "### Settings"),
}


def test_settings_tables_match_the_signatures():
    """Both ways: every setting of a registered function has a row in its table, with
    the real default where the cell is a literal, and every row names a real setting."""
    import importlib
    import inspect

    from spacy.language import Language

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    problems = []
    for group, body in cfg["options.entry_points"].items():
        if group == "spacy_cli":
            continue
        for line in body.strip().splitlines():
            name, target = (x.strip() for x in line.split("=", 1))
            assert name in SETTINGS_TABLES, f"{name}: add its settings table to SETTINGS_TABLES"
            module, attr = target.split(":")
            params = {
                p.name: p
                for p in inspect.signature(
                    getattr(importlib.import_module(module), attr)
                ).parameters.values()
                if p.name not in ("nlp", "name")
            }
            if SETTINGS_TABLES[name] is None:
                assert not params, f"{name} takes settings now: document them"
                continue
            page, anchor = SETTINGS_TABLES[name]
            defaults = (
                Language.get_factory_meta(name).default_config if group == "spacy_factories" else {}
            )
            documented = {}
            for cells in _table_after(page, anchor, "| Setting"):
                for setting in re.findall(r"`(\w+)`", cells[0]):
                    documented[setting] = cells[2]
            for setting in sorted(set(documented) - set(params)):
                problems.append(f"{name}: {page} documents `{setting}`, which it does not take")
            for setting, param in params.items():
                if setting not in documented:
                    problems.append(f"{name}: `{setting}` has no row in {page}")
                    continue
                real = defaults.get(setting, param.default)
                if real is inspect.Parameter.empty:
                    continue
                value, comparable = _doc_default(documented[setting])
                if comparable and value != (
                    list(real) if isinstance(real, (list, tuple)) else real
                ):
                    problems.append(
                        f"{name}: `{setting}` defaults to {real!r}; "
                        f"{page} says {documented[setting]}"
                    )
    assert not problems, "\n".join(problems)


# `spacy lean` command -> the page with its options table, and the table's header.
COMMAND_PAGES = {
    "evaluate": ("evaluation.md", "| Option"),
    "shard": ("corpus.md", "| Argument / flag"),
    "train": ("training.md", "| Option"),
    "train-charlm": ("charlm_training.md", "| Option"),
}


def test_command_options_tables_match_the_cli():
    """Both ways: every option of a `spacy lean` command has a row in its page's table,
    listing all its flags (short ones included), with the real default where the cell is
    a plain value; every flag in the table is one of the command's."""
    import typer

    from spacy_lean.cli import lean_cli

    group = typer.main.get_command(lean_cli)
    assert set(group.commands) == set(COMMAND_PAGES), "add the command's page to COMMAND_PAGES"
    problems = []
    for command_name, command in group.commands.items():
        page, header = COMMAND_PAGES[command_name]
        rows = [
            cells
            for cells in _table_after(page, f"spacy lean {command_name}", header)
            if cells[0].startswith("`-")
        ]
        flags_of_rows = [re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", cells[0]) for cells in rows]
        real_flags = set()
        for param in command.params:
            if param.param_type_name != "option":
                continue
            flags = param.opts + param.secondary_opts
            real_flags |= set(flags)
            matching = [(cells, f) for cells, f in zip(rows, flags_of_rows) if flags[0] in f]
            if not matching:
                problems.append(f"spacy lean {command_name} {flags[0]}: no row in {page}")
                continue
            cells, listed = matching[0]
            missing = [f for f in flags if f not in listed]
            if missing:
                problems.append(
                    f"spacy lean {command_name} {flags[0]}: {page} does not list {missing}"
                )
            doc = cells[2].strip("` ")
            if param.is_flag:
                real = "on" if param.default else "off"
            elif param.default is None or isinstance(param.default, bool):
                continue
            else:
                real = str(getattr(param.default, "value", param.default))
            if re.fullmatch(r"-?[\d.]+", doc) and re.fullmatch(r"-?[\d.]+", real):
                same = float(doc) == float(real)
            elif re.fullmatch(r"[\w-]+", doc) and doc not in ("auto",):
                same = doc == real
            else:
                continue
            if not same:
                problems.append(
                    f"spacy lean {command_name} {flags[0]}: default {real}; {page} says {cells[2]}"
                )
        for listed in flags_of_rows:
            for flag in listed:
                if flag not in real_flags and not flag.startswith("--section"):
                    problems.append(
                        f"spacy lean {command_name}: {page} lists {flag}, which it lacks"
                    )
    assert not problems, "\n".join(problems)


def _ini_blocks(page):
    """(line number, text) of each ```ini block of a page."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(page.read_text(encoding="utf8").splitlines(), start=1):
        stripped = line.strip()
        if current is None and stripped.startswith("```ini"):
            current, start = [], number + 1
        elif current is not None and FENCE.match(stripped):
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_config_snippets_parse_as_spacy_reads_them(page):
    """Every ```ini block parses with spaCy's config parser, and no value holds a '#':
    spaCy does not strip comments after a value, so `@callbacks = "x"   # note` (pasted
    from training.md) named a function '"x"   # note' that no registry has."""
    from spacy.util import load_config_from_str

    for start, text in _ini_blocks(page):
        # Blocks show sections without their parents ([nlp.after_pipeline_creation]):
        # the parents are added, empty, as a full config has them.
        sections = re.findall(r"^\[([^\]]+)\]", text, flags=re.M)
        parents = {".".join(s.split(".")[:k]) for s in sections for k in range(1, s.count(".") + 1)}
        missing = sorted(
            (p for p in parents - set(sections) if not p.endswith("*")),  # [x.*]: positional
            key=lambda name: name.count("."),
        )
        header = "".join(f"[{name}]\n" for name in missing)
        config = load_config_from_str(header + text, interpolate=False)

        def values(node, path):
            for key, value in node.items():
                if isinstance(value, dict):
                    yield from values(value, f"{path}.{key}" if path else key)
                else:
                    yield f"{path}.{key}", value

        for key, value in values(config, ""):
            assert not (isinstance(value, str) and "#" in value), (
                f"{page.name}: the ```ini block from line {start} gives {key} the value "
                f"{value!r}: a comment after a value is part of it; put it on its own line"
            )
