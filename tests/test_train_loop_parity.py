"""`spacy_lean.training.loop.train` in one process against spaCy's own loop:
what `spacy.training.loop.train` does with a config that the lean loop must do too."""

import io

import pytest
from spacy.training.initialize import init_nlp
from thinc.api import Config

from spacy_lean import synthetic
from spacy_lean.training import loop as lean_loop
from spacy_lean.training.dist import DistContext


@pytest.fixture(scope="module")
def config(tmp_path_factory, tiny_ner_config):
    root = tmp_path_factory.mktemp("loop_parity")
    train = synthetic.write_ner_corpus(root / "train.spacy", 8, seed=41)
    dev = synthetic.write_ner_corpus(root / "dev.spacy", 4, seed=42)
    config = tiny_ner_config()
    config["paths"]["train"] = str(train)
    config["paths"]["dev"] = str(dev)
    config["training"]["max_steps"] = 2
    config["training"]["eval_frequency"] = 1
    return config


def test_meta_performance_is_set_without_an_output_path(config):
    # spaCy's loop calls update_meta at every evaluation, whether or not it saves.
    nlp = init_nlp(Config(config))
    nlp, path = lean_loop.train(nlp, None, stdout=io.StringIO(), stderr=io.StringIO())
    assert path is None
    assert set(nlp.meta["performance"]) >= {"ents_f", "ents_p", "ents_r", "ner_loss"}


def test_gpu_allocator_is_set_on_a_gpu(config, monkeypatch):
    # spaCy's loop sets [training] gpu_allocator itself (a resumed run skips init_nlp).
    nlp = init_nlp(Config(config))
    nlp.config["training"]["gpu_allocator"] = "pytorch"
    seen = []
    monkeypatch.setattr(lean_loop, "set_gpu_allocator", seen.append)
    lean_loop.train(
        nlp, None, ctx=DistContext(gpu_id=0), stdout=io.StringIO(), stderr=io.StringIO()
    )
    assert seen == ["pytorch"]
