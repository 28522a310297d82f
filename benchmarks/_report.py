"""How a benchmark reports: its JSON printed, and saved where it was asked to be."""

import json
from pathlib import Path
from typing import Any, Optional, Union


def print_and_save(report: Any, path: Optional[Union[str, Path]]) -> None:
    """Print `report` as indented JSON and, unless `path` is None, write the same text
    there (its folder made if missing)."""
    text = json.dumps(report, indent=2)
    print(text)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf8")
