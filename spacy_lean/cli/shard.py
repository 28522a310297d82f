"""`spacy lean shard`: split a corpus into .spacy shards, streaming."""

from pathlib import Path

import typer
from wasabi import msg

from . import lean_cli


@lean_cli.command("shard")
def shard_cli(
    # fmt: off
    input_path: Path = typer.Argument(..., help="A .spacy or .jsonl file, or a folder of them"),
    output_dir: Path = typer.Argument(..., help=(
        "Folder to write the shards to (created if missing)")),
    docs_per_shard: int = typer.Option(1000, "--docs-per-shard", "-n", help="Docs per shard"),
    lang: str = typer.Option("en", "--lang", "-l", help=(
        "Language of the tokenizer for .jsonl input")),
    prefix: str = typer.Option("shard", "--prefix", help="Shard file name prefix"),
    spans_key: str = typer.Option("sc", "--spans-key", help=(
        "Span group a .jsonl \"spans\" list fills ('ents': entities)")),
    # fmt: on
):
    """Write a corpus as .spacy shards of N docs each, for `spacy-lean.Corpus.v1`.
    Streams: the input is read a doc at a time (a single .spacy file of any size
    in bounded memory), and one output shard is held in memory at a time."""
    from ..corpus import write_shards
    from ..corpus.sources import MixedFormatsError

    try:
        written = write_shards(
            input_path,
            output_dir,
            docs_per_shard,
            lang=lang,
            prefix=prefix,
            jsonl_spans_key=spans_key,
            progress=True,
        )
    except MixedFormatsError:  # its message names the reader's setting: this command has none
        msg.fail(
            f"'{input_path}' holds both .spacy and .jsonl files: give the path of one file, or "
            "of a folder holding one kind (shard each kind on its own).",
            exits=1,
        )
    except (FileNotFoundError, ValueError) as err:
        msg.fail(str(err), exits=1)
    if not written:
        msg.warn(f"No docs in '{input_path}': nothing written.")
    else:
        msg.good(f"Wrote {len(written)} shards to '{output_dir}'")
