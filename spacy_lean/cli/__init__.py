"""`spacy lean ...`: spacy-lean's commands, added to spaCy's CLI through the
`spacy_cli` entry point. Each command lives in its own module; importing them here
registers them on the `lean` sub-app."""

import typer
from spacy.cli._util import app

lean_cli = typer.Typer(
    name="lean",
    help="spacy-lean: memory-lean training, evaluation, corpora and character-LM embeddings.",
    no_args_is_help=True,
)
app.add_typer(lean_cli)

# Command modules register themselves on `lean_cli` when imported.
from . import commands  # noqa: E402,F401

# `spacy evaluate` / `spacy benchmark accuracy` stream for pipelines that opt in.
from . import spacy_evaluate  # noqa: E402

spacy_evaluate.install(app)
