"""A real (tiny) `spacy train` run with spacy-lean.Corpus.v1 and batch_by_tokens.v1."""

import pytest
import spacy
from spacy.cli.train import train
from thinc.api import Config

from spacy_lean import synthetic
from spacy_lean.corpus import LeanCorpus

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
size = 1000
window = 64
max_padding = 1.0
"""


@pytest.fixture(scope="module")
def train_config(tmp_path_factory, tiny_ner_config):
    root = tmp_path_factory.mktemp("lean_train")
    synthetic.write_ner_corpus(root / "train" / "a.spacy", 12, seed=31)
    synthetic.write_ner_corpus(root / "train" / "b.spacy", 12, seed=32)
    synthetic.write_ner_corpus(root / "dev.spacy", 8, seed=33)
    config = tiny_ner_config()
    for section in ("corpora.train", "corpora.dev", "training.batcher"):
        parent, child = section.split(".")
        del config[parent][child]
    config = config.merge(Config().from_str(LEAN_SECTIONS, interpolate=False))
    config["training"]["max_steps"] = 12
    config["training"]["eval_frequency"] = 6
    path = root / "config.cfg"
    config.to_disk(path)
    return {"config": path, "train": root / "train", "dev": root / "dev.spacy", "root": root}


def run_train(train_config, max_epochs, output):
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


def test_spacy_train_listed_and_streamed(train_config, tmp_path, monkeypatch):
    """max_epochs = 0 lists the corpus once; -1 calls the reader once per epoch (the
    12 steps span several epochs of this small corpus). Both make the same calls
    while initializing, so -1 makes more."""
    calls = []
    original = LeanCorpus.__call__

    def counting_call(self, nlp):
        calls.append(self.path)
        return original(self, nlp)

    monkeypatch.setattr(LeanCorpus, "__call__", counting_call)
    counts = {}
    for max_epochs in (0, -1):
        calls.clear()
        run_train(train_config, max_epochs, tmp_path / f"out{max_epochs}")
        counts[max_epochs] = calls.count(train_config["train"])
        assert calls.count(train_config["dev"]) >= 2  # every evaluation reads the dev corpus
    assert counts[-1] >= counts[0] + 2


def test_spacy_train_fixed_epochs(train_config, tmp_path):
    run_train(train_config, 2, tmp_path / "out")


@pytest.mark.parametrize("max_epochs", [0, -1])
def test_rank_batches_replay_a_later_epoch_exactly(train_config, max_epochs):
    """`spacy lean train --resume` replays the saved epoch from its start (with the
    random and batcher states saved at that start) and skips the batches trained. With
    max_epochs >= 0 the listed examples were shuffled in place every epoch, so an epoch
    after the first depended on every earlier shuffle, not only on the saved state: the
    replay made other batches, training some examples of the epoch twice and others
    not at all."""
    import random

    from spacy_lean.corpus import TokenBudgetBatcher
    from spacy_lean.training.dist import DistContext
    from spacy_lean.training.loop import RankBatches, _tupled

    nlp = spacy.blank("en")

    def rank_batches():
        corpus = LeanCorpus(train_config["train"], max_length=25, shuffle=True, shuffle_buffer=8)
        batcher = TokenBudgetBatcher(size=100, window=32, seed=0)
        return RankBatches(nlp, corpus, batcher, max_epochs, DistContext())

    def texts(batches):
        return [[eg.reference.text for eg in batch] for batch in batches]

    random.seed(0)
    run = rank_batches()
    texts(run.epoch(0))
    batches = run.epoch(1)
    saved = (run.epoch_random, run.batcher_rng)
    uninterrupted = texts(batches)
    assert len(uninterrupted) > 4
    resumed = rank_batches()
    random.setstate(_tupled(saved[0]))
    resumed.batcher.rng.setstate(_tupled(saved[1]))
    assert texts(resumed.epoch(1, skip_batches=3)) == uninterrupted[3:]
