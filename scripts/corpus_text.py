"""Write the text of a .spacy corpus as plain text, one document per line, for
training character language models (`spacy lean train-charlm`).

Tokens are joined with single spaces, as the char-LM embeddings read them
(`tokenized_lm = true`), so the LMs are trained on the input they will see.
"""

from pathlib import Path

import typer
from spacy.tokens import DocBin
from spacy.vocab import Vocab
from wasabi import msg


def main(
    corpus: Path = typer.Argument(..., help="A .spacy file, or a folder of them"),
    output: Path = typer.Argument(..., help="Text file to write"),
    tokenized: bool = typer.Option(
        True,
        "--tokenized/--raw",
        help="Join tokens with single spaces (default) or keep the original text",
    ),
):
    """Write one line per document."""
    paths = sorted(corpus.rglob("*.spacy")) if corpus.is_dir() else [corpus]
    if not paths:
        msg.fail(f"No .spacy files in {corpus}", exits=1)
    output.parent.mkdir(parents=True, exist_ok=True)
    n_docs = n_chars = 0
    with output.open("w", encoding="utf8") as file_:
        for path in paths:
            for doc in DocBin().from_disk(path).get_docs(Vocab()):
                text = " ".join(t.text for t in doc) if tokenized else doc.text
                # One document per line: newlines inside a document become spaces.
                line = " ".join(text.split())
                if line:
                    file_.write(line + "\n")
                    n_docs += 1
                    n_chars += len(line) + 1
    msg.good(f"Wrote {n_docs} documents ({n_chars} characters) to {output}")


if __name__ == "__main__":
    typer.run(main)
