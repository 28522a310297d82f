"""`spacy lean train` on messy data that the generated corpora do not have: empty docs,
docs of whitespace tokens only, docs with no entities (all "O") or with the entity
annotation missing, an entity longer than the reader's `max_length`, a long doc
without sentence boundaries, and a `--max-padded-tokens` below the longest piece; dev
sets with only empty docs or no entities. The real CLI function, one process, a tiny
tok2vec + ner pipeline."""

import warnings

import pytest
import spacy
import srsly
from spacy.tokens import Doc, DocBin, Span

from spacy_lean import synthetic
from spacy_lean.cli.train import train
from spacy_lean.corpus import LeanCorpus

MAX_LENGTH = 16


def messy_docs(nlp):
    empty = Doc(nlp.vocab, words=[])
    blank = Doc(nlp.vocab, words=[" ", "\n", "  "], spaces=[False, False, False])
    no_ents = nlp.make_doc("Nothing to see here at all .")
    no_ents.ents = []  # annotated: every token outside an entity
    unset = nlp.make_doc("This one has no entity annotation .")  # missing, not "O"
    long_ent = Doc(nlp.vocab, words=["The"] + ["Big"] * 20 + ["Company", "said", "."])
    long_ent.ents = [Span(long_ent, 1, 22, label="ORG")]  # 21 tokens > MAX_LENGTH
    run_on = Doc(nlp.vocab, words=["word"] * 120)  # no sentence boundaries
    run_on.ents = [Span(run_on, 5, 7, label="PER")]
    return [empty, blank, no_ents, unset, long_ent, run_on]


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_ner_config):
    root = tmp_path_factory.mktemp("messy")
    nlp = spacy.blank("en")
    docs = synthetic.make_ner_docs(nlp, 6, seed=61, long_doc_rate=0.0)
    DocBin(docs=docs + messy_docs(nlp), store_user_data=True).to_disk(root / "train.spacy")
    synthetic.write_ner_corpus(root / "dev.spacy", 4, seed=62, long_doc_rate=0.0)
    DocBin(docs=[Doc(nlp.vocab, words=[]) for _ in range(3)]).to_disk(root / "dev_empty.spacy")
    none = [nlp.make_doc("no entities here ."), nlp.make_doc("none here either .")]
    for doc in none:
        doc.ents = []
    DocBin(docs=none).to_disk(root / "dev_no_ents.spacy")
    config = tiny_ner_config()
    for name in ("train", "dev"):
        config["corpora"][name] = {
            "@readers": "spacy-lean.Corpus.v1",
            "path": "${paths.%s}" % name,
            "max_length": MAX_LENGTH if name == "train" else 0,
        }
    config["paths"]["train"] = str(root / "train.spacy")
    config["paths"]["dev"] = str(root / "dev.spacy")
    config["training"].update(max_steps=0, max_epochs=1, eval_frequency=3)
    config.to_disk(root / "config.cfg")
    return root


def test_every_piece_of_a_messy_corpus_is_trained_on(root, tmp_path):
    """Every non-empty doc's pieces are updated on, the oversize ones too (a piece
    longer than --max-padded-tokens is a micro-batch alone, counted, not dropped)."""
    nlp = spacy.blank("en")
    corpus = LeanCorpus(root / "train.spacy", max_length=MAX_LENGTH)
    pieces = list(corpus(nlp))
    assert corpus.stats.docs == 12 and corpus.stats.empty_docs == 1
    longest = max(len(eg.predicted) for eg in pieces)
    assert longest == 21  # the entity kept whole
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match="piece of 21 tokens"):
        train(root / "config.cfg", out, max_padded_tokens=12)
    state = srsly.read_json(out / "training-state" / "state.json")
    policy = state["ranks"][0]["update_policy"]
    assert policy["examples"] == len(pieces)
    oversize = sum(len(eg.predicted) > 12 for eg in pieces)
    assert oversize and policy["oversize_docs"] == oversize


@pytest.mark.parametrize("dev", ["dev_empty", "dev_no_ents"])
def test_a_dev_set_without_scores(root, tmp_path, dev):
    """A dev set of only empty docs, or without entities where the pipeline predicts
    none: spaCy's scorer gives None, shown and saved as 0 (as `spacy train` does, where
    `spacy evaluate` shows '-'); it was silent, one warning now names the dev set. Where
    the scores have values, they are what `spacy evaluate` gives on the saved model, and
    nothing warns."""
    from spacy.training import Corpus

    out = tmp_path / "out"
    path = root / f"{dev}.spacy"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(root / "config.cfg", out, overrides={"paths.dev": str(path)})
    texts = [str(w.message) for w in caught if "gave no value" in str(w.message)]
    meta = srsly.read_json(out / "model-last" / "meta.json")["performance"]
    nlp = spacy.load(out / "model-last")
    scores = nlp.evaluate(Corpus(str(path))(nlp))
    if dev == "dev_empty":
        assert scores["ents_f"] is None
    if scores["ents_f"] is None:
        assert meta["ents_f"] == meta["ents_p"] == meta["ents_r"] == 0.0
        assert len(texts) == 1, texts
        assert f"The dev set [corpora.dev] (spacy-lean.Corpus.v1, {path})" in texts[0]
        assert "(ents_f, ents_p, ents_r)" in texts[0] and "--paths.dev" in texts[0]
    else:
        assert texts == []
        assert all(scores[k] == meta[k] for k in ("ents_f", "ents_p", "ents_r"))


def _short_run_warnings(root, output, **overrides):
    """The warnings of a 2-step run of the messy corpus's config."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(
            root / "config.cfg",
            output,
            overrides={
                "training.max_epochs": 0,
                "training.max_steps": 2,
                "corpora.train.max_length": 0,
                **overrides,
            },
        )
    return caught


def test_a_dev_set_with_scores_does_not_warn(root, tmp_path):
    """The warning is for dev sets without scores only."""
    caught = _short_run_warnings(root, tmp_path / "out")
    assert not [w for w in caught if "gave no value" in str(w.message)]
    assert not [w for w in caught if "reports a score named" in str(w.message)]


def test_a_misspelt_score_weight_is_named_not_blamed_on_the_dev_set(root, tmp_path):
    """A [training.score_weights] key that no component reports (`ents_fscore` for
    `ents_f`) counted as 0 with a warning that blamed the dev set ("every doc is empty
    ... Point --paths.dev at annotated docs"). The warning names the key and the
    pipeline's scores now, and the dev set is not blamed."""
    # pos_acc: weighted 0 (as spaCy's tagger does by default): not named.
    weights = {"ents_fscore": 1.0, "ents_f": None, "pos_acc": 0.0}
    caught = _short_run_warnings(root, tmp_path / "out", **{"training.score_weights": weights})
    texts = [str(w.message) for w in caught]
    named = [t for t in texts if "reports a score named 'ents_fscore'" in t]
    assert len(named) == 1 and "ents_f, ents_p" in named[0] and "pos_acc" not in named[0]
    assert not [t for t in texts if "gave no value" in t]


@pytest.mark.parametrize("name", ["bad.jsonl", "truncated.spacy"])
def test_a_damaged_training_file_stops_with_its_message(root, tmp_path, capsys, name):
    """A .jsonl record whose entity offsets miss the token boundaries, a truncated
    .spacy file: the run stopped with a traceback (the reader's message on its last
    line); it now exits 1 with the message, naming the file (and line), and the fix."""
    path = tmp_path / name
    if name == "bad.jsonl":
        path.write_text(
            '{"text": "Ann Lee met Bob ."}\n{"text": "Hi Bob", "entities": [[1, 4, "PER"]]}\n'
        )
    else:
        path.write_bytes((root / "train.spacy").read_bytes()[:300])
    with pytest.raises(SystemExit) as info:
        train(root / "config.cfg", tmp_path / "out", overrides={"paths.train": str(path)})
    assert info.value.code == 1
    text = " ".join(capsys.readouterr().out.split())
    if name == "bad.jsonl":
        assert f"{path}:2: entities span [1, 4, 'PER']" in text and "token boundaries" in text
    else:
        assert f"'{path}'" in text and "truncated" in text


def test_a_disabled_components_default_score_weights_are_not_named(tmp_path):
    """spaCy's default weights name every key of a disabled component (not scored, but
    its defaults are in the config's weights: here the tagger's tag_acc): the warning
    for unknown keys named them and said to fix them. (The tagger's pos_acc, weighted
    0.0, is left out too: see the test above.)"""
    from spacy.cli.init_config import init_config

    from spacy_lean import synthetic

    synthetic.write_ner_corpus(tmp_path / "train.spacy", 8, seed=1, long_doc_rate=0.0)
    synthetic.write_ner_corpus(tmp_path / "dev.spacy", 4, seed=2, long_doc_rate=0.0)
    config = init_config(lang="en", pipeline=["ner", "tagger"], optimize="efficiency")
    tok2vec = config["components"]["tok2vec"]["model"]
    tok2vec["encode"]["width"], tok2vec["encode"]["depth"] = 16, 1
    tok2vec["embed"]["rows"] = [200, 100, 100, 100]
    config["components"]["ner"]["model"]["hidden_width"] = 16
    config["nlp"]["disabled"] = ["tagger"]
    config["paths"]["train"] = str(tmp_path / "train.spacy")
    config["paths"]["dev"] = str(tmp_path / "dev.spacy")
    config["training"].update(max_steps=2, max_epochs=0, eval_frequency=1)
    assert config["training"]["score_weights"]["pos_acc"] == 0.0
    config.to_disk(tmp_path / "config.cfg")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path / "config.cfg", tmp_path / "out")
    assert not [w for w in caught if "reports a score named" in str(w.message)]
