"""spaCy integration: the `spacy-lean.CharLMEmbed.v1` layer, the `char_lm` component,
and the memory they keep (weakref release tests)."""

import gc
import json
import re
import shutil
import warnings
import weakref
from pathlib import Path

import numpy
import pytest
import spacy
import torch
from spacy.language import Language
from spacy.tokens import Doc
from spacy.training import Example
from spacy.util import registry
from thinc.api import Adam, fix_random_seed

from spacy_lean.charlm import CharLM
from spacy_lean.charlm.embed import CharLMEmbedder
from spacy_lean.charlm.layer import build_charlm_embed_v1, get_pair

DATA = Path(__file__).parent / "data" / "charlm"
TOLERANCE = 1e-5


# One torch thread (conftest's fixture).
pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def sentences():
    return json.loads((DATA / "sentences.json").read_text(encoding="utf-8"))


@pytest.fixture
def docs(sentences):
    vocab = spacy.blank("en").vocab
    return [Doc(vocab, words=s["words"], spaces=s["spaces"]) for s in sentences]


@pytest.fixture
def lm_paths(tmp_path):
    """Copies of the h64 checkpoints that a test may delete."""
    paths = {}
    for direction in ("forward", "backward"):
        paths[direction] = tmp_path / f"{direction}.pt"
        shutil.copy(DATA / f"h64-{direction}.pt", paths[direction])
    return paths


def _watch_hidden_states(lms):
    """Weak references to every LM output tensor (`rnn_output`, [seq, batch, H])."""
    refs = []
    handles = [
        lm.register_forward_hook(lambda mod, inp, out: refs.append(weakref.ref(out[1])))
        for lm in lms
    ]
    return refs, handles


def _alive(refs):
    gc.collect()
    return sum(ref() is not None for ref in refs)


# --- release tests -------------------------------------------------------------------


def test_embedder_frees_hidden_states_and_returns_only_token_rows(docs):
    lms = [CharLM.load(DATA / f"h64-{d}.pt", has_decoder=False) for d in ("forward", "backward")]
    refs, _ = _watch_hidden_states(lms)
    vectors, n_tokens = CharLMEmbedder(*lms, batch_size=4)(docs)
    assert len(refs) == 2 * 5  # 20 texts in batches of 4, two LMs
    assert _alive(refs) == 0
    assert vectors.untyped_storage().nbytes() == int(n_tokens.sum()) * 128 * 4
    assert not vectors.requires_grad


def test_embedder_with_grad_keeps_autograd_then_frees(docs):
    lms = [CharLM.load(DATA / f"h64-{d}.pt", has_decoder=False) for d in ("forward", "backward")]
    refs, _ = _watch_hidden_states(lms)
    vectors, _ = CharLMEmbedder(*lms, batch_size=8)(docs, grad=True)
    assert vectors.requires_grad
    vectors.square().sum().backward()
    assert all(
        p.grad is not None and float(p.grad.abs().sum()) > 0
        for lm in lms
        for p in lm.rnn.parameters()
    )
    del vectors
    assert _alive(refs) == 0


def test_layer_frozen_frees_hidden_states_in_training_too(lm_paths, docs):
    model = build_charlm_embed_v1(str(lm_paths["forward"]), str(lm_paths["backward"]))
    model.initialize()
    pair = get_pair(model)
    refs, _ = _watch_hidden_states([pair.forward_lm, pair.backward_lm])
    Y, backprop = model.begin_update(docs)
    assert _alive(refs) == 0 and len(refs) > 0
    assert [y.shape for y in Y] == [(len(d), 128) for d in docs]
    assert backprop([model.ops.alloc2f(*y.shape) for y in Y]) == []
    assert all(p.grad is None and not p.requires_grad for p in pair.parameters())


def test_layer_fine_tune_keeps_autograd_and_frees_after_backprop(lm_paths, docs):
    model = build_charlm_embed_v1(
        str(lm_paths["forward"]), str(lm_paths["backward"]), fine_tune=True
    )
    model.initialize()
    pair = get_pair(model)
    before = pair.forward_lm.rnn.weight_hh_l0.detach().clone()
    refs, _ = _watch_hidden_states([pair.forward_lm, pair.backward_lm])
    Y, backprop = model.begin_update(docs)
    backprop([model.ops.xp.ones_like(y) for y in Y])
    assert float(pair.forward_lm.rnn.weight_hh_l0.grad.abs().sum()) > 0
    del Y, backprop
    assert _alive(refs) == 0
    model.finish_update(Adam(0.01))
    assert not torch.equal(before, pair.forward_lm.rnn.weight_hh_l0.detach())


def test_component_keeps_a_compact_copy_per_doc(lm_paths, docs):
    nlp = spacy.blank("en")
    nlp.add_pipe(
        "char_lm",
        config={
            "model": {
                "forward_lm": str(lm_paths["forward"]),
                "backward_lm": str(lm_paths["backward"]),
            }
        },
    )
    nlp.initialize()
    pair = get_pair(nlp.get_pipe("char_lm").model)
    refs, _ = _watch_hidden_states([pair.forward_lm, pair.backward_lm])
    out = list(nlp.pipe(docs, batch_size=8))
    assert _alive(refs) == 0 and len(refs) > 0
    for doc in out:
        assert isinstance(doc.tensor, numpy.ndarray)
        assert doc.tensor.base is None  # owns its memory: not a view of the batch
        assert doc.tensor.nbytes == len(doc) * 128 * 4
    reference = numpy.load(DATA / "ref_h64_default.npy")
    got = numpy.concatenate([doc.tensor for doc in out])
    assert float(numpy.abs(got - reference).max()) <= TOLERANCE


# --- the component ---------------------------------------------------------------------


def test_component_extension_store_and_lazy_load(lm_paths, docs):
    nlp = spacy.blank("en")
    nlp.add_pipe(
        "char_lm",
        config={
            "store": "charlm_vectors",
            "model": {"forward_lm": str(lm_paths["forward"]), "backward_lm": None},
        },
    )
    doc = nlp(docs[0])  # no nlp.initialize(): the checkpoint is read on first use
    assert doc._.charlm_vectors.shape == (len(doc), 64)
    assert doc.tensor.size == 0
    reference = numpy.load(DATA / "ref_h64_default.npy")[: len(doc), :64]
    assert float(numpy.abs(doc._.charlm_vectors - reference).max()) <= TOLERANCE


def test_component_round_trips_without_the_checkpoints(lm_paths, docs, tmp_path):
    nlp = spacy.blank("en")
    nlp.add_pipe(
        "char_lm",
        config={
            "model": {
                "forward_lm": str(lm_paths["forward"]),
                "backward_lm": str(lm_paths["backward"]),
            }
        },
    )
    nlp.initialize()
    expected = nlp(docs[3]).tensor.copy()
    data = nlp.to_bytes()
    nlp.to_disk(tmp_path / "pipeline")
    for path in lm_paths.values():
        path.unlink()  # the weights must travel with the pipeline
    loaded = spacy.load(tmp_path / "pipeline")
    assert numpy.array_equal(loaded(docs[3]).tensor, expected)
    blank = spacy.blank("en")
    blank.add_pipe("char_lm")
    blank.from_bytes(data)
    assert numpy.array_equal(blank(docs[3]).tensor, expected)


def test_component_errors(docs):
    nlp = spacy.blank("en")
    with pytest.raises(ValueError, match="store must be a valid extension name"):
        nlp.add_pipe("char_lm", name="bad", config={"store": "not valid"})
    # An extension with a getter (or a method) would drop the vectors in silence:
    # doc._.set writes user_data, which the getter never reads.
    if not Doc.has_extension("charlm_with_getter"):
        Doc.set_extension("charlm_with_getter", getter=lambda doc: "computed")
    with pytest.raises(ValueError, match="already registered with a getter"):
        nlp.add_pipe("char_lm", name="getter", config={"store": "charlm_with_getter"})
    with pytest.raises(ValueError, match="names a method of spaCy's doc._ namespace"):
        nlp.add_pipe("char_lm", name="method", config={"store": "set"})
    nlp.add_pipe("char_lm")
    with pytest.raises(ValueError, match="no language models to load"):
        nlp(docs[0])
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        spacy.blank("en").add_pipe(
            "char_lm", config={"model": {"forward_lm": "missing.pt"}}
        ).initialize()


# --- the layer inside a trained pipeline ----------------------------------------------


NER_CONFIG = """
[nlp]
lang = "en"
pipeline = ["ner"]

[components]

[components.ner]
factory = "ner"

[components.ner.model]
@architectures = "spacy.TransitionBasedParser.v2"
state_type = "ner"
extra_state_tokens = false
hidden_width = 32
maxout_pieces = 2
use_upper = true

[components.ner.model.tok2vec]
@layers = "chain.v1"

[components.ner.model.tok2vec.*.charlm]
@architectures = "spacy-lean.CharLMEmbed.v1"
forward_lm = "FORWARD"
backward_lm = "BACKWARD"
fine_tune = FINE_TUNE

[components.ner.model.tok2vec.*.proj]
@layers = "with_array.v1"

[components.ner.model.tok2vec.*.proj.layer]
@layers = "Linear.v1"
nO = 32
"""


def _ner_nlp(lm_paths, fine_tune=False):
    config = spacy.util.load_config_from_str(
        NER_CONFIG.replace("FORWARD", str(lm_paths["forward"]))
        .replace("BACKWARD", str(lm_paths["backward"]))
        .replace("FINE_TUNE", "true" if fine_tune else "false")
    )
    return spacy.util.load_model_from_config(config, auto_fill=True, validate=True)


def _charlm_layer(nlp):
    return next(node for node in nlp.get_pipe("ner").model.walk() if node.name == "charlm_embed")


@pytest.mark.parametrize("fine_tune", [False, True])
def test_ner_trains_and_serialises_with_charlm_tok2vec(
    lm_paths, ner_docs, tmp_path, fine_tune, seed=0
):
    # Seeded: the weights' initialisation must not depend on what earlier tests left in
    # the global random states (unseeded, 1 run in ~10 diverged at learn rate 0.01).
    fix_random_seed(seed)
    nlp = _ner_nlp(lm_paths, fine_tune)
    short = [d for d in ner_docs if len(d) < 40][:8]
    examples = [Example(nlp.make_doc(d.text), d) for d in short]
    nlp.initialize(lambda: examples)
    optimizer = Adam(0.01)
    pair = get_pair(_charlm_layer(nlp))
    lm_before = pair.forward_lm.rnn.weight_ih_l0.detach().clone()
    losses = []
    for _ in range(20):
        step = {}
        nlp.update(examples, sgd=optimizer, losses=step)
        losses.append(step["ner"])
    assert all(numpy.isfinite(losses))
    assert numpy.mean(losses[-3:]) < 0.8 * losses[0]
    changed = not torch.equal(lm_before, pair.forward_lm.rnn.weight_ih_l0.detach())
    assert changed is fine_tune  # frozen by default; fine-tuning updates the LM

    texts = [d.text for d in ner_docs[10:14]]
    before = [[(e.start, e.end, e.label_) for e in doc.ents] for doc in nlp.pipe(texts)]
    tok2vec_before = (
        nlp.get_pipe("ner").model.get_ref("tok2vec").predict([nlp.make_doc(t) for t in texts])
    )
    nlp.to_disk(tmp_path / "ner")
    for path in lm_paths.values():
        path.unlink()  # the LM weights travel inside the pipeline, not as a path
    loaded = spacy.load(tmp_path / "ner")
    after = [[(e.start, e.end, e.label_) for e in doc.ents] for doc in loaded.pipe(texts)]
    tok2vec_after = (
        loaded.get_pipe("ner").model.get_ref("tok2vec").predict([loaded.make_doc(t) for t in texts])
    )
    assert after == before
    for a, b in zip(tok2vec_before, tok2vec_after):
        assert numpy.allclose(a, b, atol=1e-6)
    assert torch.equal(
        get_pair(_charlm_layer(loaded)).forward_lm.rnn.weight_ih_l0.detach(),
        pair.forward_lm.rnn.weight_ih_l0.detach(),
    )


def test_layer_resolves_from_registry_and_infers_width(lm_paths, docs):
    make = registry.architectures.get("spacy-lean.CharLMEmbed.v1")
    model = make(forward_lm=str(lm_paths["forward"]), backward_lm=None)
    assert not model.has_dim("nO") or model.get_dim("nO") is None
    model.initialize(X=docs[:2])
    assert model.get_dim("nO") == 64
    assert [y.shape for y in model.predict(docs[:3])] == [(len(d), 64) for d in docs[:3]]
    assert model.predict([]) == []


TOK2VEC_CONFIG = """
[model]
@architectures = "spacy.Tok2Vec.v2"

[model.embed]
@layers = "chain.v1"

[model.embed.*.concat]
@layers = "concatenate.v1"

[model.embed.*.concat.*.charlm]
@architectures = "spacy-lean.CharLMEmbed.v1"
forward_lm = "FORWARD"
backward_lm = "BACKWARD"

[model.embed.*.concat.*.hash]
@architectures = "spacy.MultiHashEmbed.v2"
width = 16
attrs = ["NORM", "SHAPE"]
rows = [500, 50]
include_static_vectors = false

[model.embed.*.proj]
@layers = "with_array.v1"

[model.embed.*.proj.layer]
@layers = "Maxout.v1"
nO = 24
nP = 2

[model.encode]
@architectures = "spacy.MaxoutWindowEncoder.v2"
width = 24
depth = 1
window_size = 1
maxout_pieces = 2
"""


def test_inside_a_spacy_tok2vec_next_to_hash_embeddings(lm_paths, docs):
    config = spacy.util.load_config_from_str(
        TOK2VEC_CONFIG.replace("FORWARD", str(lm_paths["forward"])).replace(
            "BACKWARD", str(lm_paths["backward"])
        )
    )
    model = registry.resolve(config)["model"]
    model.initialize(X=docs[:4])
    charlm = next(node for node in model.walk() if node.name == "charlm_embed")
    assert charlm.get_dim("nO") == 128
    Y, backprop = model.begin_update(docs[:5])
    assert [y.shape for y in Y] == [(len(d), 24) for d in docs[:5]]
    backprop([model.ops.xp.ones_like(y) for y in Y])
    model.finish_update(Adam(0.001))


def test_component_from_bytes_and_disk_use_the_saved_store(lm_paths, docs, tmp_path):
    """The loaded cfg says where the vectors go, and the component puts them there (it
    wrote doc.tensor while its cfg said the extension)."""
    nlp = spacy.blank("en")
    nlp.add_pipe(
        "char_lm",
        config={
            "store": "charlm_saved_store",
            "model": {"forward_lm": str(lm_paths["forward"]), "backward_lm": None},
        },
    )
    nlp.initialize()
    expected = nlp(docs[2])._.charlm_saved_store
    nlp.to_disk(tmp_path / "pipeline")
    for load in ("bytes", "disk"):
        blank = spacy.blank("en")
        pipe = blank.add_pipe("char_lm")
        # Built with the default store: the saved one replaces it, and that is said.
        with pytest.warns(UserWarning, match="stores its vectors in doc._.charlm_saved_store"):
            if load == "bytes":
                blank.from_bytes(nlp.to_bytes())
            else:
                blank.from_disk(tmp_path / "pipeline")
        doc = blank(docs[2])
        assert pipe.store == pipe.cfg["store"] == "charlm_saved_store"
        assert pipe.lean_assigns == ["doc._.charlm_saved_store"]
        assert numpy.array_equal(doc._.charlm_saved_store, expected)
        assert doc.tensor.size == 0


def test_a_load_time_store_override_is_said_and_can_be_set(lm_paths, docs, tmp_path):
    """spacy.load with a config override of store: the saved store is restored (as
    spaCy restores a component's saved settings), the user is told, and setting
    `store` afterwards puts the vectors where they were asked for."""
    nlp = spacy.blank("en")
    config = {"model": {"forward_lm": str(lm_paths["forward"]), "backward_lm": None}}
    nlp.add_pipe("char_lm", config=config)
    nlp.initialize()
    expected = nlp(docs[1]).tensor
    nlp.to_disk(tmp_path / "pipeline")
    override = {"components": {"char_lm": {"store": "charlm_override"}}}
    with pytest.warns(UserWarning, match=r"store = 'charlm_override'.*\.store = 'charlm_override'"):
        loaded = spacy.load(tmp_path / "pipeline", config=override)
    pipe = loaded.get_pipe("char_lm")
    assert pipe.store == "tensor"
    pipe.store = "charlm_override"
    words = [t.text for t in docs[1]]
    doc = loaded(Doc(loaded.vocab, words=words, spaces=[bool(t.whitespace_) for t in docs[1]]))
    assert doc.tensor.size == 0 and numpy.array_equal(doc._.charlm_override, expected)
    with warnings.catch_warnings():  # same store saved and built: nothing to say
        warnings.simplefilter("error")
        spacy.load(tmp_path / "pipeline")


def test_a_store_set_at_runtime_loads_without_an_override_warning(lm_paths, docs, tmp_path):
    """Setting `store` after loading, as the docs advise, is saved with the component
    while config.cfg keeps the store it was built with: a plain spacy.load restores it
    without a word (it warned of a load-time override no one had made), a real
    override is still said. The component holds no reference to its pipeline (a
    sourced one would have pointed at, and kept alive, the source pipeline)."""
    nlp = spacy.blank("en")
    config = {"model": {"forward_lm": str(lm_paths["forward"]), "backward_lm": None}}
    pipe = nlp.add_pipe("char_lm", config=config)
    nlp.initialize()
    pipe.store = "charlm_runtime_store"
    assert not any(v is nlp for v in vars(pipe).values())
    nlp.to_disk(tmp_path / "pipeline")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = spacy.load(tmp_path / "pipeline")
    assert loaded.get_pipe("char_lm").store == "charlm_runtime_store"
    assert loaded(docs[0])._.charlm_runtime_store.shape[0] == len(docs[0])
    loaded.to_disk(tmp_path / "again")  # and so on, save after save
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spacy.load(tmp_path / "again").get_pipe("char_lm").store == "charlm_runtime_store"
    override = {"components": {"char_lm": {"store": "charlm_other"}}}
    with pytest.warns(UserWarning, match="stores its vectors in doc._.charlm_runtime_store"):
        overridden = spacy.load(tmp_path / "pipeline", config=override)
    assert overridden.get_pipe("char_lm").store == "charlm_runtime_store"


def test_pipe_errors_go_to_the_error_handler(lm_paths, docs):
    """nlp.pipe passes a char_lm error to nlp.set_error_handler's handler, as spaCy's
    own components do (it was raised past the handler)."""
    nlp = spacy.blank("en")
    config = {"model": {"forward_lm": str(lm_paths["forward"]), "backward_lm": None}}
    pipe = nlp.add_pipe("char_lm", config=config)
    nlp.initialize()
    predict = pipe.predict

    def failing_predict(batch):
        if any(doc.text.startswith("BOOM") for doc in batch):
            raise RuntimeError("boom")
        return predict(batch)

    pipe.predict = failing_predict
    seen = []
    nlp.set_error_handler(lambda name, proc, batch, err: seen.append((name, len(batch), err)))
    texts = ["Ada met Tomas .", "BOOM went the drum .", "Port Ambrel is far ."]
    out = list(nlp.pipe(texts, batch_size=1))
    assert [doc.text for doc in out] == [texts[0], texts[2]]
    assert [(name, n, str(err)) for name, n, err in seen] == [("char_lm", 1, "boom")]
    nlp.set_error_handler(spacy.util.raise_error)
    with pytest.raises(RuntimeError, match="boom"):
        list(nlp.pipe(texts, batch_size=1))


def test_fine_tune_on_the_component_says_it_does_nothing(lm_paths):
    """The char_lm component is not trained: fine_tune = true there is said to have no
    effect (it was silently ignored)."""
    nlp = spacy.blank("en")
    config = {"model": {"forward_lm": str(lm_paths["forward"]), "fine_tune": True}}
    with pytest.warns(UserWarning, match="fine_tune = true has no effect here"):
        nlp.add_pipe("char_lm", config=config)


def test_layer_fine_tune_batch_of_empty_docs(lm_paths, docs):
    """A training batch whose docs have no tokens: nothing ran through the LMs, so
    there is nothing to backpropagate (torch raised 'does not require grad')."""
    model = build_charlm_embed_v1(
        str(lm_paths["forward"]), str(lm_paths["backward"]), fine_tune=True
    )
    model.initialize()
    empty = Doc(docs[0].vocab, words=[])
    for batch in ([empty], [empty, empty], [empty, docs[1]]):
        Y, backprop = model.begin_update(batch)
        assert [y.shape for y in Y] == [(len(d), 128) for d in batch]
        assert backprop([model.ops.xp.ones_like(y) for y in Y]) == []


# Docs our generated corpora do not have: empty, whitespace-only (spaCy makes "\n\n"
# and "  " tokens), one token longer than a chunk, emoji (astral plane), combining
# marks, characters unknown to the LM, "İ" (two characters lowercased), CJK.
MESSY_TEXTS = [
    "Ada met Bo.",
    "",
    "\n\n",
    "  ",
    "   \n  \t ",
    "a" * 40,
    "Héllo 👋🏽 wörld e\u0301 𝔘𝔫𝔦 İstanbul",
    "Ünknown ψ ß 中文\u200b",
    "word\n\nnext  word   end  ",
]


@pytest.mark.parametrize("tokenized_lm", [True, False])
@pytest.mark.parametrize("is_lower", [False, True])
def test_messy_docs_one_row_per_token_alone_batched_and_chunked(tokenized_lm, is_lower):
    lms = [CharLM.load(DATA / f"proj-{d}.pt", has_decoder=False) for d in ("forward", "backward")]
    vocab = spacy.blank("en").vocab
    nlp = spacy.blank("en")
    docs = [nlp.make_doc(t) for t in MESSY_TEXTS]
    assert [t.text for t in docs[4]] == ["   \n  \t "] and len(docs[1]) == 0
    settings = dict(tokenized_lm=tokenized_lm, is_lower=is_lower)
    whole = CharLMEmbedder(*lms, max_chunk_chars=None, **settings).split(docs)
    for chunk, batch_size in ((None, 1), (3, 32), (3, 2), (7, 1)):
        embedder = CharLMEmbedder(*lms, max_chunk_chars=chunk, batch_size=batch_size, **settings)
        batched = embedder.split(docs)
        for doc, rows, ref in zip(docs, batched, whole):
            assert rows.shape == (len(doc), 48)
            alone = embedder.split([doc])[0]
            # Alone, in a batch, in chunks: the same vectors (2-layer LMs: within 1e-6).
            assert torch.allclose(rows, ref, atol=1e-6, rtol=0)
            assert torch.allclose(alone, ref, atol=1e-6, rtol=0)
    # A batch of empty docs only, and no docs at all.
    empties = CharLMEmbedder(*lms).split([Doc(vocab, words=[]), nlp.make_doc("")])
    assert [tuple(e.shape) for e in empties] == [(0, 48), (0, 48)]
    assert CharLMEmbedder(*lms).split([]) == []


def test_component_on_messy_docs_pipe_batch_size_1_and_all_empty(lm_paths):
    nlp = spacy.blank("en")
    nlp.add_pipe(
        "char_lm",
        config={
            "store": "charlm_messy",
            "model": {
                "forward_lm": str(lm_paths["forward"]),
                "backward_lm": str(lm_paths["backward"]),
                "max_chunk_chars": 16,
            },
        },
    )
    nlp.initialize()
    alone = [nlp(t)._.charlm_messy for t in MESSY_TEXTS]
    for batch_size in (1, 4, 100):
        docs = list(nlp.pipe(MESSY_TEXTS, batch_size=batch_size))
        for doc, ref in zip(docs, alone):
            assert doc._.charlm_messy.shape == (len(doc), 128)
            numpy.testing.assert_allclose(doc._.charlm_messy, ref, atol=1e-6, rtol=0)
    docs = list(nlp.pipe(["", "", ""], batch_size=2))
    assert [d._.charlm_messy.shape for d in docs] == [(0, 128)] * 3
    out = list(nlp.pipe([("", 0), ("\n\n", 1)], as_tuples=True))
    assert [(d._.charlm_messy.shape, i) for d, i in out] == [((0, 128), 0), ((1, 128), 1)]


@pytest.mark.parametrize(
    "setting,value,message",
    [
        ("threads", 0, "threads must be a whole number >= 1 or null, got 0"),
        ("threads", True, "threads must be a whole number >= 1 or null, got True"),
        ("batch_size", True, "batch_size must be a whole number >= 1, got True"),
        ("batch_size", 0, "batch_size must be a whole number >= 1, got 0"),
        ("forward_lm", "", "forward_lm is an empty string"),
        ("backward_lm", " ", "backward_lm is an empty string"),
    ],
)
def test_layer_settings_are_checked_when_it_is_built(setting, value, message):
    """threads = 0 was refused only at the first call; true passed as 1."""
    from spacy_lean.charlm.layer import build_charlm_embed_v1

    with pytest.raises(ValueError, match=re.escape(message)):
        build_charlm_embed_v1(**{setting: value})


@Language.component("charlm_test_tensor_reader", requires=["doc.tensor"])
def _tensor_reader(doc):
    return doc


@Language.component("charlm_test_vecs_reader", requires=["doc._.charlm_test_vecs"])
def _vecs_reader(doc):
    return doc


@pytest.mark.parametrize("store", ["tensor", "charlm_test_vecs"])
def test_the_cleaner_knows_where_char_lm_stores(lm_paths, docs, store):
    """lean_cleaner asks char_lm where its vectors go (the factory's assigns can only
    name doc.tensor): a doc.tensor reader after a cleaner and a char_lm that stores in
    an extension is refused (it read an empty tensor), and one storing in doc.tensor
    sets it again, so the placement is fine."""
    config = {"store": store, "model": {"forward_lm": str(lm_paths["forward"])}}
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("lean_cleaner")
    nlp.add_pipe("char_lm", config={**config, "model": {**config["model"], "backward_lm": None}})
    nlp.add_pipe("charlm_test_tensor_reader")
    if store == "tensor":
        nlp.initialize()
        assert nlp(docs[0]).tensor.shape[0] == len(docs[0])
    else:
        with pytest.raises(ValueError, match="'charlm_test_tensor_reader' runs after it"):
            nlp.initialize()


def test_the_cleaner_checks_again_when_char_lm_changes_its_store(lm_paths, docs):
    """Setting `store` on a running char_lm changes what it sets (`lean_assigns`) but
    not the pipeline: the cleaner's cached check let a doc.tensor reader after it read
    an empty tensor, with nothing said. It checks again now."""
    model = {"forward_lm": str(lm_paths["forward"]), "backward_lm": None}
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("lean_cleaner")
    nlp.add_pipe("char_lm", config={"store": "tensor", "model": model})
    nlp.add_pipe("charlm_test_tensor_reader")
    nlp.initialize()
    assert nlp(docs[0]).tensor.shape[0] == len(docs[0])
    nlp.get_pipe("char_lm").store = "charlm_test_vecs"
    with pytest.raises(ValueError, match="'charlm_test_tensor_reader' runs after it"):
        nlp(docs[0])
    nlp.get_pipe("char_lm").store = "tensor"
    assert nlp(docs[0]).tensor.shape[0] == len(docs[0])


def test_the_cleaner_sees_a_second_char_lm_set_the_extension_again(lm_paths, docs):
    """char_lm(ext), cleaner releasing ext, char_lm(ext) again, a reader of ext: the
    second char_lm sets it again, so the placement is accepted (it was refused: no
    component was known to set doc._.<store>); without the second one it is refused,
    naming the first char_lm as the setter."""
    model = {"forward_lm": str(lm_paths["forward"]), "backward_lm": None}
    for again in (True, False):
        nlp = spacy.blank("en")
        nlp.add_pipe("char_lm", name="first", config={"store": "charlm_test_vecs", "model": model})
        nlp.add_pipe("lean_cleaner", config={"extensions": ["charlm_test_vecs"]})
        if again:
            nlp.add_pipe(
                "char_lm", name="again", config={"store": "charlm_test_vecs", "model": model}
            )
        nlp.add_pipe("charlm_test_vecs_reader")
        if again:
            nlp.initialize()
            assert nlp(docs[0])._.charlm_test_vecs.shape[0] == len(docs[0])
        else:
            with pytest.raises(ValueError, match="'first' sets doc._.charlm_test_vecs before"):
                nlp.initialize()
