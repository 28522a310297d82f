"""A real (tiny) `spacy train` run with spacy-lean.Corpus.v1 and batch_by_tokens.v1."""

import pytest
import spacy
from spacy.cli.init_config import init_config
from spacy.cli.train import train
from thinc.api import Config

from spacy_lean import synthetic

LEAN_SECTIONS = """
[corpora]

[training]

[corpora.train]
@readers = "spacy-lean.Corpus.v1"
path = ${paths.train}
max_length = 25
shuffle = true
shuffle_buffer = 16
seed = 1

[corpora.dev]
@readers = "spacy-lean.Corpus.v1"
path = ${paths.dev}
max_length = 0

[training.batcher]
@batchers = "spacy-lean.batch_by_tokens.v1"
size = 300
window = 64
"""


@pytest.fixture(scope="module")
def train_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean_train")
    synthetic.write_ner_corpus(root / "train" / "a.spacy", 12, seed=31)
    synthetic.write_ner_corpus(root / "train" / "b.spacy", 12, seed=32)
    synthetic.write_ner_corpus(root / "dev.spacy", 8, seed=33)
    config = init_config(lang="en", pipeline=["ner"], optimize="efficiency")
    for section in ("corpora.train", "corpora.dev", "training.batcher"):
        parent, child = section.split(".")
        del config[parent][child]
    config = config.merge(Config().from_str(LEAN_SECTIONS, interpolate=False))
    config["components"]["tok2vec"]["model"]["encode"]["width"] = 16
    config["components"]["tok2vec"]["model"]["encode"]["depth"] = 1
    config["components"]["tok2vec"]["model"]["embed"]["rows"] = [200, 100, 100, 100]
    config["components"]["ner"]["model"]["hidden_width"] = 16
    config["training"]["max_steps"] = 12
    config["training"]["eval_frequency"] = 6
    path = root / "config.cfg"
    config.to_disk(path)
    return {"config": path, "train": root / "train", "dev": root / "dev.spacy", "root": root}


@pytest.mark.parametrize("max_epochs", [0, 2, -1])
def test_spacy_train_runs(train_config, max_epochs, tmp_path):
    output = tmp_path / "out"
    train(
        train_config["config"],
        output,
        overrides={
            "paths.train": str(train_config["train"]),
            "paths.dev": str(train_config["dev"]),
            "training.max_epochs": max_epochs,
        },
    )
    nlp = spacy.load(output / "model-last")
    assert nlp.pipe_names == ["tok2vec", "ner"]
    assert set(nlp.get_pipe("ner").labels) == set(synthetic.LABELS)
    cfg = nlp.config
    assert cfg["corpora"]["train"]["@readers"] == "spacy-lean.Corpus.v1"
    assert cfg["training"]["batcher"]["@batchers"] == "spacy-lean.batch_by_tokens.v1"
