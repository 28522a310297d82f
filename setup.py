"""Everything is declared in setup.cfg but the long description: PyPI shows README.md, whose
links are relative (docs/x.md, docs/x.md#anchor, #anchor) and work on a checkout or a source
browser, not on PyPI. Here they are made absolute on `base_url` of setup.cfg's
[pypi_links] section, or, while that is empty (no public repository yet), turned into
plain text naming the file, so the published page has no broken link. Links in code are left
alone. tests/test_packaging.py builds the metadata and checks it.
"""

import configparser
import posixpath
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target "title") and ![alt](target); the same pattern tests/test_docs.py checks.
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?((?:\s+\"[^\"]*\")?)\s*\)")
ABSOLUTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # https:, mailto:, ...


def base_url(setup_cfg: Path = HERE / "setup.cfg") -> str:
    """The [pypi_links] base_url of setup.cfg, without a trailing slash ("" if unset)."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg, encoding="utf8")
    return cfg.get("pypi_links", "base_url", fallback="").strip().rstrip("/")


def pypi_long_description(text: str, base: str, page: str = "README.md") -> str:
    """`text` (the markdown of `page`) with every relative link made absolute on `base`, or,
    with no base, replaced by its text (and the file it named, if another one)."""

    def link(match: "re.Match[str]", code: "list[tuple[int, int]]") -> str:
        bang, label, target, title = match.groups()
        if ABSOLUTE.match(target) or any(a <= match.start() < b for a, b in code):
            return match.group(0)  # absolute, or inside `code`
        path, _, anchor = target.partition("#")
        path = posixpath.normpath(path) if path else page
        if base:
            url = f"{base}/{path}" + (f"#{anchor}" if anchor else "")
            return f"{bang}[{label}]({url}{title})"
        if bang:  # an image with nowhere to load it from: its alt text
            return label
        if path == page:
            return label
        return path if label == posixpath.basename(path) else f"{label} ({path})"

    def prose(line: str) -> str:
        code = [m.span() for m in INLINE_CODE.finditer(line)]
        return LINK.sub(lambda m: link(m, code), line)

    out, in_code = [], False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line.lstrip()):
            in_code = not in_code
            out.append(line)
        else:
            out.append(line if in_code else prose(line))
    return "".join(out)


if __name__ == "__main__":
    from setuptools import setup

    readme = (HERE / "README.md").read_text(encoding="utf8")
    setup(long_description=pypi_long_description(readme, base_url()))
