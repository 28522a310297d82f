"""Make (or check) the transformer the project trains with.

`name` is what the config's `paths.transformer` gets. When it is a path inside the
project's assets/ folder that does not exist yet, or a folder this script made
before, a small BERT is made there: a WordPiece vocabulary trained on the
training corpus text and randomly initialised weights (no network needed). Any
other existing folder is used as it is, and anything else is taken for a Hugging
Face Hub name (e.g. roberta-base), which spacy-transformers downloads at training
time. A JSON card describing the choice is written to `card`.

The card is what the training commands depend on (project.yml), so for a folder it
holds a fingerprint of the folder's files (`files`: their count and bytes; `sha256`: of
every file's path, size and contents): other weights in the same folder make another
card, and `spacy project run` trains again.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Iterator

import typer
from spacy.tokens import DocBin
from spacy.vocab import Vocab
from wasabi import msg

from spacy_lean.synthetic import make_tiny_transformer

# Written into folders made here, so a later run knows it may replace them.
MARKER = "spacy_lean_tiny_transformer.json"


def main(
    name: str = typer.Argument(..., help="Local folder (made if under assets/) or Hub name"),
    corpus: Path = typer.Argument(
        ..., help="Training corpus (.spacy) for the WordPiece vocabulary"
    ),
    card: Path = typer.Argument(..., help="Where to write the JSON card"),
    vocab_size: int = typer.Option(1000, "--vocab-size", help="WordPiece vocabulary size"),
    hidden_size: int = typer.Option(64, "--hidden-size", help="Hidden width"),
    layers: int = typer.Option(2, "--layers", help="Number of layers"),
    heads: int = typer.Option(2, "--heads", help="Attention heads"),
    max_length: int = typer.Option(512, "--max-length", help="Maximum position embeddings"),
    seed: int = typer.Option(0, "--seed", help="Random seed of the initial weights"),
):
    """Make a small local BERT for the project, or record which transformer is used."""
    path = Path(name)
    info = {"name": name}
    if (path / MARKER).exists() or (not path.exists() and _in_assets(path)):
        settings = {
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "max_position_embeddings": max_length,
            "seed": seed,
        }
        if hidden_size % heads:
            msg.fail(
                f"--hidden-size ({hidden_size}) must be a multiple of --heads ({heads})", exits=1
            )
        make_tiny_transformer(
            path,
            _corpus_texts(corpus),
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden_size,
            max_position_embeddings=max_length,
            seed=seed,
        )
        (path / MARKER).write_text(json.dumps({"corpus": str(corpus), **settings}, indent=2))
        info.update(source="generated", corpus=str(corpus), **settings, **fingerprint(path))
        msg.good(
            f"Made a random-init BERT ({layers}x{hidden_size}) with a WordPiece vocab in {path}"
        )
    elif path.exists():
        info.update(source="local", **_hf_config(path), **fingerprint(path))
        msg.good(f"Using the local transformer in {path}")
    else:
        info.update(source="hub")
        offline = "1" in (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
        if offline:
            msg.warn(
                f"'{name}' is not a local folder and HF_HUB_OFFLINE is set: training only works "
                "if it is already in the Hugging Face cache."
            )
        msg.good(f"Using '{name}' from the Hugging Face Hub (downloaded by spacy-transformers)")
    card.parent.mkdir(parents=True, exist_ok=True)
    card.write_text(json.dumps(info, indent=2), encoding="utf8")


def _in_assets(path: Path) -> bool:
    """Whether `path` lies in the project's assets/ folder (relative to the cwd)."""
    assets = Path("assets").resolve()
    return assets in path.resolve().parents


def _corpus_texts(corpus: Path) -> Iterator[str]:
    for doc in DocBin().from_disk(corpus).get_docs(Vocab()):
        yield doc.text


def _hf_config(path: Path) -> dict:
    config = path / "config.json"
    if not config.exists():
        msg.fail(f"{path} exists but has no config.json: not a Hugging Face model folder", exits=1)
    data = json.loads(config.read_text(encoding="utf8"))
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    return {k: data[k] for k in keys if k in data}


def fingerprint(folder: Path, chunk_size: int = 2**20) -> Dict[str, object]:
    """`files` (count and bytes) and `sha256` (of each file's path, size and contents,
    read in chunks) of the files under `folder`. Hidden files and folders (a clone's .git,
    huggingface_hub's .cache: bookkeeping no model loader reads) are left out."""
    digest = hashlib.sha256()
    count = size = 0
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            file = Path(root) / name
            if not file.is_file():  # a broken link, a socket...
                continue
            rel = file.relative_to(folder).as_posix()
            file_digest = hashlib.sha256()
            n_bytes = 0
            with file.open("rb") as f:
                for chunk in iter(lambda: f.read(chunk_size), b""):
                    file_digest.update(chunk)
                    n_bytes += len(chunk)
            digest.update(f"{rel}\0{n_bytes}\0{file_digest.hexdigest()}\n".encode("utf8"))
            count += 1
            size += n_bytes
    return {"files": {"count": count, "bytes": size}, "sha256": digest.hexdigest()}


if __name__ == "__main__":
    typer.run(main)
