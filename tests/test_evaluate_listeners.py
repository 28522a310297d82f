"""An entity_linker scored with gold entities (`use_gold_ents`, the default) runs again
at scoring time, on copies of the predicted docs, and reads its tok2vec's or
transformer's output from them (a listener's `doc.tensor` / `doc._.trf_data`). The
streaming evaluator releases that output batch by batch: the linker must run again
before it does, or its listener gives zeros and the `nel_*` scores are wrong (they
were, by 0.07 micro-F on the tok2vec pipeline below). A transformer listener reads
`doc._.trf_data`, released by the same code after the same call; spaCy's
EntityLinker.v2 cannot be built on spacy-transformers' listener (its width is unknown
when the model is made), so that case has no test here."""

import random

import pytest
import spacy
from spacy.training import Example
from thinc.api import fix_random_seed

from spacy_lean import evaluate
from spacy_lean.scoring import gold

from eval_util import assert_same_scores  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]

_NER = {
    "@architectures": "spacy.TransitionBasedParser.v2",
    "state_type": "ner",
    "extra_state_tokens": False,
    "hidden_width": 16,
    "maxout_pieces": 2,
    "use_upper": False,
    "nO": None,
}


def _linker_pipeline(listener, first_component, first_config):
    fix_random_seed(0)
    nlp = spacy.blank("en")
    nlp.add_pipe(first_component, config=first_config)
    nlp.add_pipe("sentencizer")
    nlp.add_pipe("ner", config={"model": dict(_NER, tok2vec=listener)})
    el = nlp.add_pipe(
        "entity_linker",
        config={
            "incl_prior": False,
            "model": {"@architectures": "spacy.EntityLinker.v2", "nO": None, "tok2vec": listener},
        },
    )
    el.set_kb(gold._create_kb)
    train = gold.make_scoring_docs(nlp, 40, seed=1, missing=False)
    examples = [Example(nlp.make_doc(d.text), d) for d in train]
    optimizer = nlp.initialize(lambda: examples)
    rng = random.Random(0)
    for _ in range(6):
        nlp.update(rng.sample(examples, 12), sgd=optimizer)
    assert el.use_gold_ents
    return nlp


@pytest.fixture(scope="module")
def dev_docs():
    return gold.make_scoring_docs(spacy.blank("en"), 24, seed=5, missing=False)


def _check(nlp, dev_docs):
    def examples():
        return [Example(nlp.make_doc(d.text), d) for d in dev_docs]

    expected = nlp.evaluate(examples(), batch_size=4)
    assert expected["nel_f_per_type"], "the dev set must have linked entities"
    # Batches of 4 in windows of 2 batches: each window's scoring comes after
    # its batches' activations were released.
    ours = evaluate(nlp, examples(), batch_size=4, window_size=8)
    assert_same_scores(ours, expected)


def test_entity_linker_listening_to_a_tok2vec(dev_docs):
    listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 32, "upstream": "*"}
    nlp = _linker_pipeline(listener, "tok2vec", {"model": dict(gold._SMALL_TOK2VEC)})
    _check(nlp, dev_docs)
