"""Tests for the `lean_cleaner` component, on the real trained transformer + ner
pipeline from the fixtures."""

import gc
import warnings
import weakref

import numpy
import pytest
import spacy
from numpy.testing import assert_allclose
from spacy.language import Language
from spacy.tokens import Doc
from spacy.training import Example

from spacy_lean import synthetic
from spacy_lean.cleaner import LeanCleaner, LeanCleanerWarning, _nbytes
from spacy_lean.consumers import find_consumers


@Language.component("lean_test_trf_reader", requires=["doc._.trf_data"])
def _trf_reader(doc):
    return doc


@pytest.fixture(scope="module")
def texts(blank_nlp):
    # Enough docs for several transformer batches at batch_size=8.
    return [d.text for d in synthetic.make_ner_docs(blank_nlp, 40, seed=11)]


def _ents(docs):
    return [[(e.start, e.end, e.label_) for e in doc.ents] for doc in docs]


def _record_batches(nlp):
    """Wrap the transformer's set_annotations to keep weakrefs to each batch's
    tensors: the FullTransformerBatch, its torch tensors and the numpy arrays that
    each doc's trf_data views point into."""
    trf = nlp.get_pipe("transformer")
    refs = []
    original = trf.set_annotations

    def set_annotations(docs, predictions):
        original(docs, predictions)
        refs.append(weakref.ref(predictions))
        for value in predictions.model_output.values():
            refs.append(weakref.ref(value))
        for doc in docs:
            hidden = doc._.trf_data.model_output["last_hidden_state"]
            assert hidden.base is not None  # a view of the batch
            base = hidden
            while base.base is not None and isinstance(base.base, numpy.ndarray):
                base = base.base
            refs.append(weakref.ref(base))

    trf.set_annotations = set_annotations
    return refs


def _alive(refs):
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_predictions_identical_and_trf_data_released(trf_ner_nlp, texts):
    expected = _ents(trf_ner_nlp.pipe(texts))
    assert any(expected), "the fixture pipeline should predict some entities"
    cleaner = trf_ner_nlp.add_pipe("lean_cleaner")
    assert trf_ner_nlp.pipe_names[-1] == "lean_cleaner"
    docs = list(trf_ner_nlp.pipe(texts))
    assert _ents(docs) == expected
    assert all(doc._.trf_data is None for doc in docs)
    assert all(doc.tensor.size == 0 for doc in docs)
    assert cleaner.stats["docs"] == len(texts)
    assert cleaner.stats["trf_data"] == len(texts)
    assert cleaner.stats["released_docs"] == len(texts)
    assert cleaner.stats["released_bytes"] > 0
    # nlp(text) goes through __call__
    doc = trf_ner_nlp(texts[0])
    assert doc._.trf_data is None
    assert _ents([doc]) == expected[:1]
    assert cleaner.stats["docs"] == len(texts) + 1


def test_released_bytes_counts_each_docs_views(trf_ner_nlp, texts):
    kept = list(trf_ner_nlp.pipe(texts[:10]))
    expected = sum(_nbytes(doc._.trf_data) for doc in kept)
    hidden = sum(doc._.trf_data.model_output["last_hidden_state"].nbytes for doc in kept)
    assert expected >= hidden > 0
    cleaner = trf_ner_nlp.add_pipe("lean_cleaner")
    list(trf_ner_nlp.pipe(texts[:10]))
    assert cleaner.stats["released_bytes"] == expected


def test_weakrefs_to_batch_tensors_are_dead(trf_ner_nlp, texts):
    # Control: without the cleaner, kept docs pin every batch.
    refs = _record_batches(trf_ner_nlp)
    docs = list(trf_ner_nlp.pipe(texts, batch_size=8))
    n_refs = len(refs)
    assert n_refs > len(texts)
    assert _alive(refs) > 0
    del docs
    assert _alive(refs) == 0
    # With the cleaner, no kept doc references the batches.
    refs.clear()
    trf_ner_nlp.add_pipe("lean_cleaner")
    docs = list(trf_ner_nlp.pipe(texts, batch_size=8))
    assert len(refs) == n_refs
    assert len(docs) == len(texts)
    assert _alive(refs) == 0


def test_weakrefs_dead_with_compact_vectors(trf_ner_nlp, texts):
    refs = _record_batches(trf_ner_nlp)
    trf_ner_nlp.add_pipe("lean_cleaner", config={"compact_vectors": "float16"})
    docs = list(trf_ner_nlp.pipe(texts, batch_size=8))
    assert all(doc.tensor.shape == (len(doc), 32) for doc in docs)
    assert all(doc.tensor.base is None for doc in docs)
    assert _alive(refs) == 0


def test_placement_before_listener_raises(trf_ner_nlp):
    trf_ner_nlp.add_pipe("lean_cleaner", before="ner")
    with pytest.raises(ValueError) as err:
        trf_ner_nlp("Ada Lindqvist visited Veldmark .")
    msg = str(err.value)
    assert "component 2 of 3" in msg
    assert "'ner'" in msg and "doc._.trf_data" in msg and "listens to 'transformer'" in msg
    assert "nlp.remove_pipe('lean_cleaner')" in msg
    with pytest.raises(ValueError, match="component 2 of 3"):
        list(trf_ner_nlp.pipe(["Ada Lindqvist visited Veldmark ."]))
    # The fix from the message works.
    trf_ner_nlp.remove_pipe("lean_cleaner")
    trf_ner_nlp.add_pipe("lean_cleaner")
    assert trf_ner_nlp("Ada Lindqvist visited Veldmark .")._.trf_data is None


def test_the_placement_fix_keeps_the_settings_and_the_warning_points_at_the_caller(trf_ner_nlp):
    """The suggested `add_pipe` left the cleaner's settings out, so following it
    dropped them; and the cleaner's warnings named a line of cleaner.py, not the
    user's call."""
    settings = {"compact_vectors": "float16", "trim_memory_every": 0}
    trf_ner_nlp.add_pipe("lean_cleaner", before="ner", config=settings)
    with pytest.raises(ValueError) as err:
        trf_ner_nlp("Ada Lindqvist visited Veldmark .")
    fix = f"nlp.add_pipe('lean_cleaner', name='lean_cleaner', config={settings!r})"
    assert fix in str(err.value)
    trf_ner_nlp.remove_pipe("lean_cleaner")
    cleaner = eval(fix.replace("nlp.", "trf_ner_nlp."))
    assert {k: cleaner.cfg[k] for k in settings} == settings
    trf_ner_nlp.add_pipe("lean_test_tensor_writer")  # sets doc.tensor after the cleaner
    with pytest.warns(LeanCleanerWarning, match="that data stays on the docs") as record:
        trf_ner_nlp("Ada Lindqvist visited Veldmark .")
    assert record[0].filename == __file__


def test_placement_in_config_raises(trf_ner_dir):
    nlp = spacy.load(trf_ner_dir)
    config = nlp.config.copy()
    config["nlp"]["pipeline"] = ["transformer", "lean_cleaner", "ner"]
    config["components"]["lean_cleaner"] = {"factory": "lean_cleaner"}
    nlp2 = spacy.util.load_model_from_config(config, auto_fill=True)
    with pytest.raises(ValueError, match="reads doc._.trf_data"):
        nlp2.initialize()


def test_unlinked_listener_is_found_by_walking_the_model(trf_ner_nlp):
    trf_ner_nlp.add_pipe("lean_cleaner", before="ner")
    # add_pipe re-links listeners; forget them, as after sourcing a component.
    trf_ner_nlp.get_pipe("transformer").listener_map = {}
    with pytest.raises(ValueError, match="transformer-listener layer.*listens to 'transformer'"):
        trf_ner_nlp("Ada Lindqvist visited Veldmark .")


def test_rechecks_when_pipeline_changes(trf_ner_nlp):
    trf_ner_nlp.add_pipe("lean_cleaner")
    trf_ner_nlp("Ada Lindqvist visited Veldmark .")
    trf_ner_nlp.add_pipe("lean_test_trf_reader")
    with pytest.raises(ValueError, match="requires=\\['doc._.trf_data'\\]"):
        trf_ner_nlp("Ada Lindqvist visited Veldmark .")
    # Disabling the consumer makes the placement fine again.
    with trf_ner_nlp.select_pipes(disable=["lean_test_trf_reader"]):
        assert trf_ner_nlp("Ada Lindqvist visited Veldmark .")._.trf_data is None


def test_user_named_consumers(trf_ner_nlp):
    trf_ner_nlp.add_pipe("lean_cleaner", config={"consumers": ["sentencizer"]})
    trf_ner_nlp.add_pipe("sentencizer")
    with pytest.raises(ValueError, match="'sentencizer' runs after it.*`consumers` setting"):
        trf_ner_nlp("Ada Lindqvist visited Veldmark .")
    trf_ner_nlp.remove_pipe("lean_cleaner")
    trf_ner_nlp.add_pipe("lean_cleaner", config={"consumers": ["no_such_pipe"]})
    with pytest.raises(ValueError, match="no_such_pipe"):
        trf_ner_nlp("Ada Lindqvist visited Veldmark .")


@Language.component("lean_test_user_data_writer")
def _user_data_writer(doc):
    doc.user_data["k"] = [1, 2, 3]
    return doc


def test_consumers_read_the_released_user_data_keys():
    """A component named in `consumers` reads every field the cleaner releases, its
    user_data keys too: a cleaner that releases only a user_data key used to let the
    consumer after it find the key gone, silently."""
    nlp = spacy.blank("en")
    nlp.add_pipe("lean_test_user_data_writer")
    config = {"trf_data": False, "tensor": False, "user_data_keys": ["k"]}
    nlp.add_pipe("lean_cleaner", config=dict(config, consumers=["sentencizer"]))
    nlp.add_pipe("sentencizer")
    with pytest.raises(ValueError, match="'sentencizer' runs after it and reads doc.user_data"):
        nlp("Ada met Bo")
    nlp.remove_pipe("lean_cleaner")
    nlp.add_pipe("lean_cleaner", config=dict(config, consumers=["sentencizer"]))
    assert "k" not in nlp("Ada met Bo").user_data


def _initialize_with_a_listening_tagger_after_the_cleaner(nlp):
    """Add a tagger listening to the tok2vec (after the cleaner) and initialize: the
    cleaner must refuse the placement."""
    listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": "*"}
    nlp.add_pipe("tagger", config={"model": {"tok2vec": listener}})
    doc = nlp.make_doc("A short example")
    example = Example.from_dict(doc, {"tags": ["X", "Y", "Z"]})
    with pytest.raises(ValueError, match="'tagger' runs after it and reads doc.tensor"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LeanCleanerWarning)
            nlp.initialize(lambda: [example])


def test_tok2vec_listener_reads_doc_tensor():
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("lean_cleaner")
    _initialize_with_a_listening_tagger_after_the_cleaner(nlp)
    consumers = find_consumers(nlp, ["doc.tensor"])
    assert [c.component for c in consumers] == ["tagger"]


def test_sourced_cleaner_checks_the_pipeline_it_is_initialized_in():
    # Sourcing shares the component object, whose `nlp` is the source pipeline;
    # `nlp.initialize()` hands it the pipeline it now runs in.
    source = spacy.blank("en")
    source.add_pipe("lean_cleaner")
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("lean_cleaner", source=source)
    _initialize_with_a_listening_tagger_after_the_cleaner(nlp)


def test_compact_vectors_equal_wordpiece_means(trf_ner_nlp, texts):
    # Keep trf_data (trf_data=false) so the same docs carry both, then compare.
    trf_ner_nlp.add_pipe("lean_cleaner", config={"trf_data": False, "compact_vectors": "float32"})
    docs = list(trf_ner_nlp.pipe(texts[:20]))
    checked = 0
    for doc in docs:
        trf_data = doc._.trf_data
        hidden = trf_data.model_output["last_hidden_state"]
        flat = hidden.reshape(-1, hidden.shape[-1])
        assert doc.tensor.shape == (len(doc), flat.shape[1])
        assert doc.tensor.dtype == numpy.float32
        for i in range(len(doc)):
            rows = flat[trf_data.align[i].dataXd.reshape(-1)]
            expected = rows.mean(axis=0) if len(rows) else numpy.zeros(flat.shape[1])
            assert_allclose(doc.tensor[i], expected, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == sum(len(doc) for doc in docs)
    # Token vectors now come from the compact tensor.
    assert_allclose(docs[0][0].vector, docs[0].tensor[0])


def test_compact_vectors_float16(trf_ner_nlp, texts):
    reference = LeanCleaner(None, compact_vectors="float32", trf_data=False)
    cleaner = trf_ner_nlp.add_pipe("lean_cleaner", config={"compact_vectors": "float16"})
    docs = list(trf_ner_nlp.pipe(texts[:10]))
    assert all(doc.tensor.dtype == numpy.float16 for doc in docs)
    assert all(doc._.trf_data is None for doc in docs)
    assert cleaner.stats["compact_bytes"] == sum(doc.tensor.nbytes for doc in docs)
    trf_ner_nlp.remove_pipe("lean_cleaner")
    for doc16, doc in zip(docs, trf_ner_nlp.pipe(texts[:10])):
        reference(doc)
        assert_allclose(doc16.tensor.astype("f"), doc.tensor, rtol=2e-3, atol=2e-3)


def test_compact_vectors_whitespace_token_gets_zeros(trf_ner_nlp):
    trf_ner_nlp.add_pipe("lean_cleaner", config={"compact_vectors": "float32"})
    doc = trf_ner_nlp("Ada Lindqvist   visited Veldmark .")
    space = [t.i for t in doc if t.is_space]
    assert space, "the tokenizer should make a whitespace token"
    # spacy-transformers aligns no wordpiece to a whitespace token
    assert not doc.tensor[space[0]].any()
    assert doc.tensor[0].any()


def test_compact_vectors_doc_of_only_whitespace_gets_zeros(trf_ner_nlp):
    # A blank line of a real corpus: one whitespace token, no wordpiece to pool. In a
    # batch with other docs spacy-transformers handles it; the cleaner must too.
    trf_ner_nlp.add_pipe("lean_cleaner", config={"compact_vectors": "float32"})
    docs = list(trf_ner_nlp.pipe(["Ada Lindqvist visited Veldmark .", "   ", "\n"]))
    width = docs[0].tensor.shape[1]
    for doc in docs[1:]:
        assert doc.tensor.shape == (1, width)
        assert not doc.tensor.any()
        assert doc._.trf_data is None


@pytest.mark.parametrize("first", [True, False])
def test_compact_vectors_empty_doc_has_the_width_of_the_others(trf_ner_nlp, first):
    # An empty doc gets no transformer output at all (not even its width): its
    # compact tensor must still be (0, width), or stacking the docs' tensors fails.
    trf_ner_nlp.add_pipe("lean_cleaner", config={"compact_vectors": "float16"})
    texts = ["", "Ada Lindqvist visited Veldmark ."]
    docs = list(trf_ner_nlp.pipe(texts if first else texts[::-1]))
    docs.append(trf_ner_nlp(""))
    assert {doc.tensor.shape[1] for doc in docs} == {32}
    assert [doc.tensor.shape[0] for doc in docs] == [len(doc) for doc in docs]
    assert numpy.concatenate([doc.tensor for doc in docs]).shape == (sum(map(len, docs)), 32)


def test_messy_docs_as_tuples_and_select_pipes(trf_ner_nlp, texts):
    # Empty docs and docs of only whitespace (spaCy makes "\n\n"-like tokens) next to
    # real ones: the same entities as without the cleaner, all trf_data released, the
    # context of as_tuples kept. (spacy-transformers itself fails on a batch made only
    # of whitespace docs, so each batch of 3 here has a real doc.)
    messy = [texts[0], "", "   ", "\n\n", texts[1] + "\n\n   ", " \t\n ", "", "👋🏽 Ada"]
    messy.append(texts[2])
    expected = _ents(trf_ner_nlp.pipe(messy, batch_size=3))
    assert any(expected)
    trf_ner_nlp.add_pipe("lean_cleaner")
    pairs = [(t, i) for i, t in enumerate(messy)]
    out = list(trf_ner_nlp.pipe(pairs, as_tuples=True, batch_size=3))
    assert [i for _, i in out] == list(range(len(messy)))
    docs = [doc for doc, _ in out]
    assert _ents(docs) == expected
    assert all(doc._.trf_data is None and doc.tensor.size == 0 for doc in docs)
    with trf_ner_nlp.select_pipes(disable=["lean_cleaner"]):
        kept = list(trf_ner_nlp.pipe(messy[:3]))
    assert all(doc._.trf_data is not None for doc in kept)
    # Enabled again: the cleaner runs (and is checked) as before.
    docs = list(trf_ner_nlp.pipe(messy, batch_size=3))
    assert _ents(docs) == expected and all(doc._.trf_data is None for doc in docs)


def test_no_op_in_update(trf_ner_dir, blank_nlp):
    train_docs = synthetic.make_ner_docs(blank_nlp, 4, seed=21)
    losses = []
    for with_cleaner in (False, True):
        nlp = spacy.load(trf_ner_dir)
        if with_cleaner:
            cleaner = nlp.add_pipe("lean_cleaner")
        examples = [Example(nlp.make_doc(d.text), d) for d in train_docs]
        spacy.util.fix_random_seed(0)
        optimizer = nlp.resume_training()
        step_losses = {}
        nlp.update(examples, sgd=optimizer, losses=step_losses)
        losses.append(step_losses)
        if with_cleaner:
            assert cleaner.stats["docs"] == 0
    assert losses[0] == losses[1]
    assert losses[0]["ner"] > 0


def test_evaluate_with_cleaner(trf_ner_nlp, dev_examples):
    expected = trf_ner_nlp.evaluate(dev_examples)
    trf_ner_nlp.add_pipe("lean_cleaner")
    scores = trf_ner_nlp.evaluate(dev_examples)
    assert scores["ents_f"] == expected["ents_f"]
    assert scores["ents_per_type"] == expected["ents_per_type"]


def test_n_process_2(trf_ner_nlp, texts):
    sample = texts[:8]
    expected = _ents(trf_ner_nlp.pipe(sample))
    trf_ner_nlp.add_pipe("lean_cleaner", config={"compact_vectors": "float16"})
    # torch's OpenMP thread pool deadlocks in forked workers once the parent used
    # it with several threads (independent of the cleaner): run them single-threaded.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        docs = list(trf_ner_nlp.pipe(sample, n_process=2, batch_size=2))
    finally:
        torch.set_num_threads(threads)
    assert _ents(docs) == expected
    assert all(doc._.trf_data is None for doc in docs)
    assert all(doc.tensor.shape == (len(doc), 32) for doc in docs)
    assert all(doc.tensor.dtype == numpy.float16 for doc in docs)


def test_to_from_bytes_and_disk(trf_ner_nlp, texts, tmp_path):
    Doc.set_extension("lean_test_blob", default=None, force=True)
    config = {
        "extensions": ["lean_test_blob"],
        "user_data_keys": ["blob"],
        "compact_vectors": "float16",
        "empty_cache_every": 50,
        "trim_memory_every": 0,
        "consumers": ["ner"],
    }
    cleaner = trf_ner_nlp.add_pipe("lean_cleaner", config=config)
    other = LeanCleaner(None)
    other.from_bytes(cleaner.to_bytes())
    assert other.cfg == cleaner.cfg
    assert cleaner.cfg["compact_vectors"] == "float16"
    other = LeanCleaner(None)
    cleaner.to_disk(tmp_path / "cleaner")
    other.from_disk(tmp_path / "cleaner")
    assert other.cfg == cleaner.cfg
    # The whole pipeline round-trips, and the loaded cleaner works.
    expected = _ents(trf_ner_nlp.pipe(texts[:5]))
    trf_ner_nlp.to_disk(tmp_path / "model")
    nlp2 = spacy.load(tmp_path / "model")
    loaded = nlp2.get_pipe("lean_cleaner")
    assert loaded.cfg == cleaner.cfg
    docs = list(nlp2.pipe(texts[:5]))
    assert _ents(docs) == expected
    assert all(doc._.trf_data is None and doc.tensor.dtype == numpy.float16 for doc in docs)
    nlp3 = spacy.load(tmp_path / "model")
    nlp3.from_bytes(trf_ner_nlp.to_bytes())
    assert nlp3.get_pipe("lean_cleaner").cfg == cleaner.cfg
    Doc.remove_extension("lean_test_blob")


def test_a_loaded_cleaner_takes_the_settings_of_the_config(trf_ner_nlp, tmp_path):
    """The saved `cfg` file replaced the settings the cleaner was built with, so a
    load-time override (`spacy.load(path, config=...)`) did nothing while
    `nlp.config` said otherwise, and a pipeline saved with a consumer could not be
    loaded with that consumer excluded, even with `consumers` overridden. The config
    being loaded wins; a pipeline built first and then filled with `from_disk` still
    gets the saved settings (they are in the saved config.cfg)."""
    trf_ner_nlp.add_pipe("lean_test_trf_reader")
    settings = {"compact_vectors": "float16", "consumers": ["lean_test_trf_reader"]}
    trf_ner_nlp.add_pipe("lean_cleaner", config=settings)
    trf_ner_nlp.to_disk(tmp_path / "model")
    text = "Ada Lindqvist visited Veldmark ."
    override = {"components": {"lean_cleaner": {"compact_vectors": None, "consumers": []}}}
    nlp = spacy.load(tmp_path / "model", config=override)
    cleaner = nlp.get_pipe("lean_cleaner")
    assert cleaner.cfg["compact_vectors"] is None and cleaner.cfg["consumers"] == []
    assert nlp.config["components"]["lean_cleaner"]["compact_vectors"] is None
    assert nlp(text).tensor.size == 0
    nlp = spacy.load(tmp_path / "model", exclude=["lean_test_trf_reader"], config=override)
    assert nlp(text)._.trf_data is None
    with pytest.raises(ValueError, match="'consumers' names \\['lean_test_trf_reader'\\]"):
        spacy.load(tmp_path / "model", exclude=["lean_test_trf_reader"])(text)
    # A variable in the config, also inside a list, is resolved.
    config_path = tmp_path / "model" / "config.cfg"
    text_cfg = config_path.read_text(encoding="utf8")
    text_cfg = text_cfg.replace(
        'consumers = ["lean_test_trf_reader"]', 'consumers = ["${vars.reader}"]'
    ).replace("[paths]", '[vars]\nreader = "lean_test_trf_reader"\n\n[paths]', 1)
    assert "${vars.reader}" in text_cfg
    config_path.write_text(text_cfg, encoding="utf8")
    nlp = spacy.load(tmp_path / "model")
    assert nlp.get_pipe("lean_cleaner").cfg["consumers"] == ["lean_test_trf_reader"]
    assert nlp(text)._.trf_data is None
    # Built with the defaults, then filled from disk: the saved settings.
    nlp = spacy.load(tmp_path / "model", config=override)
    nlp.from_disk(tmp_path / "model")
    assert nlp.get_pipe("lean_cleaner").cfg["compact_vectors"] == "float16"
    assert nlp(text).tensor.dtype == numpy.float16


def test_from_bytes_rejects_bad_cfg():
    import srsly
    from spacy import util

    data = util.to_bytes({"cfg": lambda: srsly.json_dumps({"compact_vectors": "int8"})}, [])
    with pytest.raises(ValueError, match="'int8'"):
        LeanCleaner(None).from_bytes(data)


@pytest.mark.parametrize(
    "config,error,match",
    [
        ({"extensions": ["no_such_ext"]}, ValueError, "'no_such_ext'.*names nothing"),
        ({"extensions": "no_such_ext"}, TypeError, "'extensions' must be a list"),
        ({"compact_vectors": "float8"}, ValueError, "'float8'"),
        ({"empty_cache_every": -1}, ValueError, "'empty_cache_every'.*-1"),
        ({"trim_memory_every": 1.5}, ValueError, "'trim_memory_every'.*1.5"),
        ({"trf_data": "yes"}, TypeError, "'trf_data'.*'yes'"),
        ({"user_data_keys": [3]}, TypeError, "got the item 3"),
    ],
)
def test_bad_config_is_an_error_at_construction(config, error, match):
    with pytest.raises(error, match=match):
        LeanCleaner(None, **config)


def test_bad_config_through_add_pipe():
    nlp = spacy.blank("en")
    with pytest.raises(ValueError, match="'missing_ext'"):
        nlp.add_pipe("lean_cleaner", config={"extensions": ["missing_ext"]})
    with pytest.raises(ValueError, match="'bf16'"):
        nlp.add_pipe("lean_cleaner", config={"compact_vectors": "bf16"})


def test_getter_extension_is_rejected():
    Doc.set_extension("lean_test_getter", getter=lambda doc: len(doc), force=True)
    try:
        with pytest.raises(ValueError, match="'lean_test_getter'.*getter"):
            LeanCleaner(None, extensions=["lean_test_getter"])
    finally:
        Doc.remove_extension("lean_test_getter")


def test_pipeline_without_transformer_warns_once_and_releases_what_there_is():
    Doc.set_extension("lean_test_cache", default=None, force=True)
    try:
        nlp = spacy.blank("en")
        nlp.add_pipe("sentencizer")
        cleaner = nlp.add_pipe(
            "lean_cleaner",
            config={"extensions": ["doc._.lean_test_cache"], "user_data_keys": ["scratch"]},
        )
        doc = nlp.make_doc("One sentence here . And another one .")
        doc.tensor = numpy.ones((len(doc), 4), dtype="f")
        doc._.lean_test_cache = numpy.ones(100, dtype="f")
        doc.user_data["scratch"] = numpy.ones(10, dtype="f")
        with pytest.warns(LeanCleanerWarning, match="no component that sets doc._.trf_data"):
            doc = nlp(doc)
        assert doc.tensor.size == 0
        assert doc._.lean_test_cache is None
        assert "scratch" not in doc.user_data
        assert cleaner.stats["released_bytes"] == len(doc) * 16 + 400 + 40
        assert (cleaner.stats["tensor"], cleaner.stats["extensions"]) == (1, 1)
        assert cleaner.stats["user_data"] == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            docs = list(nlp.pipe(["More text .", "Even more ."]))
        assert len(docs) == 2 and cleaner.stats["docs"] == 3
        assert cleaner.stats["released_docs"] == 1
    finally:
        Doc.remove_extension("lean_test_cache")


def test_producer_after_the_cleaner_warns(trf_ner_nlp):
    trf_ner_nlp.add_pipe("lean_cleaner", first=True)
    trf_ner_nlp.remove_pipe("ner")
    with pytest.warns(LeanCleanerWarning, match="runs before \\['transformer'\\]"):
        trf_ner_nlp("Ada Lindqvist visited Veldmark .")


def test_analyze_pipes_does_not_take_the_cleaner_for_a_producer(trf_ner_nlp):
    """The factory declares no `assigns`: analyze_pipes read them as "sets", and a
    component requiring trf_data with only the cleaner before it was reported as fine."""
    trf_ner_nlp.add_pipe("lean_cleaner")
    summary = trf_ner_nlp.analyze_pipes(pretty=False)["summary"]
    assert summary["lean_cleaner"]["assigns"] == []
    cleaner = trf_ner_nlp.get_pipe("lean_cleaner")
    assert cleaner.released_attrs == ["doc._.trf_data", "doc.tensor"]

    @Language.component("needs_trf_data_after_cleaner", requires=["doc._.trf_data"])
    def needs_trf_data(doc):
        return doc

    nlp = spacy.blank("en")
    nlp.add_pipe("lean_cleaner")
    nlp.add_pipe("needs_trf_data_after_cleaner")
    problems = nlp.analyze_pipes(pretty=False)["problems"]
    assert problems["needs_trf_data_after_cleaner"] == ["doc._.trf_data"]


def test_empty_cache_and_trim_every(trf_ner_nlp, texts):
    config = {"empty_cache_every": 7, "trim_memory_every": 10}
    cleaner = trf_ner_nlp.add_pipe("lean_cleaner", config=config)
    list(trf_ner_nlp.pipe(texts[:30]))
    assert cleaner.stats["cache_empties"] == 30 // 7
    assert cleaner.stats["memory_trims"] == 3
    off = LeanCleaner(None, trim_memory_every=0)
    for doc in trf_ner_nlp.tokenizer.pipe(texts[:30]):
        off(doc)
    assert off.stats["cache_empties"] == off.stats["memory_trims"] == 0
    assert LeanCleaner(None).cfg["trim_memory_every"] == 32


def test_trim_host_memory_gives_pages_back():
    import sys

    from spacy_lean.cleaner import trim_host_memory

    if not sys.platform.startswith("linux") or not trim_host_memory():
        pytest.skip("needs glibc's malloc_trim")

    def rss_kb():
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

    # Many mid-sized blocks (below glibc's mmap threshold, so on the heap), with
    # small long-lived ones between them, as batch tensors and kept docs are.
    # Every page is written: a fresh heap's zeroed blocks may never be touched (calloc),
    # and then there is nothing resident to give back (the test failed when run alone).
    blocks, keep = [], []
    for _ in range(400):
        block = bytearray(100_000)
        block[::4096] = b"x" * len(block[::4096])
        blocks.append(block)
        keep.append(bytearray(64))
    del blocks
    before = rss_kb()
    assert trim_host_memory()
    assert rss_kb() < before - 10_000  # at least ~10 MB of the ~40 MB came back


def test_heap_trimmer_trims_only_past_its_slack():
    import sys

    from spacy_lean.memory import HeapTrimmer, resident_bytes, trim_host_memory

    if not sys.platform.startswith("linux") or not trim_host_memory():
        pytest.skip("needs glibc's malloc_trim and /proc")
    assert resident_bytes() > 0
    with pytest.raises(ValueError, match="slack_mb"):
        HeapTrimmer(-1)
    trimmer = HeapTrimmer(slack_mb=32)
    assert not trimmer()  # the first call measures the working level
    assert trimmer.floor is not None and trimmer.n_trims == 0
    assert not trimmer()  # nothing grew
    # 48 MB held in heap blocks between small live ones, then freed: resident memory
    # stays above the floor + 32 MB until the trimmer hands it back.
    blocks, keep = [], []
    for _ in range(480):
        block = bytearray(100_000)
        block[::4096] = b"x" * len(block[::4096])  # touch every page
        blocks.append(block)
        keep.append(bytearray(64))
    del blocks
    held = resident_bytes()
    assert held > trimmer.floor + 32 * 2**20
    assert trimmer()
    assert trimmer.n_trims == 1 and trimmer.floor is None
    assert resident_bytes() < held - 16 * 2**20
    assert not trimmer() and trimmer.floor is not None  # the next call re-measures the level
    every = HeapTrimmer(slack_mb=0)
    assert every() and every() and every.n_trims == 2


def test_heap_trimmer_settles_on_the_highest_level_of_its_first_calls(monkeypatch):
    """With `settle` N, the working level is the highest resident memory of the N calls
    after a trim: a larger step among them raises the level instead of causing a trim;
    growth past level + slack after them trims, and the level is measured again."""
    from spacy_lean import memory

    mb = 2**20
    readings = iter([500, 560, 540, 590, 580, 620, 600, 640, 650])
    monkeypatch.setattr(memory, "resident_bytes", lambda: next(readings) * mb)
    trims = []
    monkeypatch.setattr(memory, "trim_host_memory", lambda: trims.append(1) or True)
    with pytest.raises(ValueError, match="settle"):
        memory.HeapTrimmer(32, settle=-1)
    trimmer = memory.HeapTrimmer(32, settle=3)
    assert [trimmer() for _ in range(3)] == [False] * 3  # 500, 560, 540: measuring
    assert trimmer.floor == 560 * mb and not trims
    assert not trimmer()  # 590 <= 560 + 32
    assert not trimmer()  # 580
    assert trimmer()  # 620 > 592: trims, and measures again
    assert trimmer.floor is None and trimmer.n_trims == 1 and len(trims) == 1
    assert [trimmer() for _ in range(3)] == [False] * 3  # 600, 640, 650
    assert trimmer.floor == 650 * mb
    # settle=1 (the default): the level is the first call's, as before.
    readings = iter([500, 560])
    once = memory.HeapTrimmer(32)
    assert not once() and once() and len(trims) == 2


def test_heap_trimmer_settle_0_measures_the_level_right_after_each_trim(monkeypatch):
    """With `settle=0` (the evaluator's), the first call trims and the level is the
    resident memory right after a trim: a step that frees more than the slack is trimmed
    after at once; small steps are trimmed when what they hold adds up past it."""
    from spacy_lean import memory

    mb = 2**20
    # Readings: one per call, and one more right after each trim.
    readings = iter([600, 500, 560, 503, 510, 515, 530, 501])
    monkeypatch.setattr(memory, "resident_bytes", lambda: next(readings) * mb)
    trims = []
    monkeypatch.setattr(memory, "trim_host_memory", lambda: trims.append(1) or True)
    trimmer = memory.HeapTrimmer(16, settle=0)
    assert trimmer() and trimmer.floor == 500 * mb  # first call: 600, trims down to 500
    assert trimmer() and trimmer.floor == 503 * mb  # a step held 60 MB > 16: trims at once
    assert not trimmer()  # 510 <= 503 + 16
    assert not trimmer()  # 515
    assert trimmer() and trimmer.floor == 501 * mb  # 530 > 519: what small steps held
    assert trimmer.n_trims == 3 and len(trims) == 3
    assert next(readings, None) is None
    # No slack: every call trims, reading nothing.
    every = memory.HeapTrimmer(0, settle=0)
    assert every() and every() and every.n_trims == 2 and every.floor is None


@pytest.mark.gpu
def test_empty_cache_every_frees_cuda_cache(trf_ner_dir, texts):
    import torch
    from thinc.api import require_cpu, require_gpu, set_gpu_allocator

    set_gpu_allocator("pytorch")
    require_gpu(0)

    def cached_after(config):
        nlp = spacy.load(trf_ner_dir)
        nlp.add_pipe("lean_cleaner", config=config)
        docs = list(nlp.pipe(texts))
        gc.collect()
        torch.cuda.synchronize()
        assert all(doc._.trf_data is None for doc in docs)
        if config.get("compact_vectors"):
            assert all(isinstance(doc.tensor, numpy.ndarray) for doc in docs)
        return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()

    try:
        kept_cached = cached_after({})
        emptied = cached_after({"empty_cache_every": 1, "compact_vectors": "float16"})
        assert kept_cached > 0
        assert emptied < kept_cached
    finally:
        require_cpu()


# -- placement: who sets each field between the cleaner and its readers ------

TAGS = {"tags": ["X", "Y", "Z", "X", "Y"]}
SENTENCE = "Ada visited Veldmark last spring"


@Language.component("lean_test_tensor_writer", assigns=["doc.tensor"])
def _tensor_writer(doc):
    doc.tensor = numpy.ones((len(doc), 4), dtype="f")
    return doc


TENSOR_SIZES_SEEN = []


@Language.component("lean_test_tensor_reader", requires=["doc.tensor"])
def _tensor_reader(doc):
    TENSOR_SIZES_SEEN.append(doc.tensor.size)
    return doc


def _tagger_config(upstream):
    listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": upstream}
    return {"model": {"tok2vec": listener}}


def _two_tok2vec_blocks(upstream, cleaners=(), initialize=True):
    """[tok2vec, tagger, tok2vec2, tagger2], tagger listening to "*" and tagger2 to
    `upstream`, with the cleaners (name, before) added, all initialized."""
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("tagger", config=_tagger_config("*"))
    nlp.add_pipe("tok2vec", name="tok2vec2")
    nlp.add_pipe("tagger", name="tagger2", config=_tagger_config(upstream))
    for name, before in cleaners:
        where = {"before": before} if before else {}
        nlp.add_pipe("lean_cleaner", name=name, config={"trf_data": False}, **where)
    if initialize:
        example = Example.from_dict(nlp.make_doc(SENTENCE), TAGS)
        nlp.initialize(lambda: [example])
    return nlp


def _tags(docs):
    return [[t.tag_ for t in doc] for doc in docs]


@pytest.mark.parametrize("upstream", ["tok2vec2", "*"])
def test_cleaner_between_two_tok2vec_blocks(upstream):
    """A cleaner before a second tok2vec and its listener is safe: tok2vec2 sets
    doc.tensor again before tagger2 reads it (by name, or as the tok2vec "*" resolves
    to, the last one before tagger2)."""
    texts = [SENTENCE, "Veldmark is far", "Ada"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeanCleanerWarning)
        nlp = _two_tok2vec_blocks(
            upstream, [("lean_cleaner", "tok2vec2"), ("lean_cleaner_end", None)]
        )
        docs = list(nlp.pipe(texts))
    assert nlp.pipe_names == [
        "tok2vec",
        "tagger",
        "lean_cleaner",
        "tok2vec2",
        "tagger2",
        "lean_cleaner_end",
    ]
    assert all(doc.tensor.size == 0 for doc in docs)
    assert nlp.get_pipe("lean_cleaner").stats["tensor"] == len(texts)
    assert nlp.get_pipe("lean_cleaner_end").stats["tensor"] == len(texts)
    # tagger2 predicted from tok2vec2's tensor: the same tags as without the cleaners.
    with nlp.select_pipes(disable=["lean_cleaner", "lean_cleaner_end"]):
        assert _tags(nlp.pipe(texts)) == _tags(docs)
    # Without the last cleaner, tok2vec2's tensor stays on the docs: said once.
    nlp.remove_pipe("lean_cleaner_end")
    with pytest.warns(LeanCleanerWarning, match="runs before \\['tok2vec2'\\].*stays on the docs"):
        doc = nlp(SENTENCE)
    assert doc.tensor.shape == (5, 96)


def test_listener_of_a_tok2vec_before_the_cleaner_is_refused():
    """tagger2 listens to 'tok2vec' by name: tok2vec2 sets doc.tensor again after the
    cleaner, but tagger2 was not trained on it; the error says so, and where the
    cleaner can go."""
    nlp = _two_tok2vec_blocks("tok2vec")
    nlp.add_pipe("sentencizer")
    nlp.add_pipe("lean_cleaner", before="tok2vec2")
    with pytest.raises(ValueError) as err:
        nlp(SENTENCE)
    msg = str(err.value)
    assert "'tagger2' runs after it and reads doc.tensor" in msg
    assert "tok2vec-listener layer listening to 'tok2vec'" in msg
    assert "listening to 'tok2vec'. 'tok2vec' sets doc.tensor before the cleaner" in msg
    assert "['tok2vec2'] set(s) doc.tensor again between the cleaner and 'tagger2'" in msg
    assert "but 'tagger2' does not listen to it" in msg
    assert "release the data of 'tok2vec' before 'tagger2' reads it" in msg
    fix = "nlp.add_pipe('lean_cleaner', name='lean_cleaner', after='tagger2')"
    assert "Put the cleaner after 'tagger2': nlp.remove_pipe('lean_cleaner') then " + fix in msg
    # The fix from the message works.
    nlp.remove_pipe("lean_cleaner")
    nlp.add_pipe("lean_cleaner", after="tagger2", config={"trf_data": False})
    assert nlp(SENTENCE).tensor.size == 0


@pytest.mark.parametrize("upstream", ["tok2vec2", "*"])
@pytest.mark.filterwarnings("ignore::spacy_lean.cleaner.LeanCleanerWarning")
def test_placement_rechecked_when_producers_come_and_go(upstream):
    """Components added after the cleaner later, disabled, removed: the check runs
    again at the next call, per field and producer."""
    nlp = _two_tok2vec_blocks(upstream)
    source = nlp
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec", source=source)
    nlp.add_pipe("tagger", source=source)
    cleaner = nlp.add_pipe("lean_cleaner", config={"trf_data": False})
    assert nlp(SENTENCE).tensor.size == 0
    # A second block added after the cleaner later: fine.
    nlp.add_pipe("tok2vec2", source=source)
    nlp.add_pipe("tagger2", source=source)
    expected = _tags([source(SENTENCE)])
    doc = nlp(SENTENCE)
    assert _tags([doc]) == expected
    assert cleaner.stats["tensor"] == 2
    # tok2vec2 disabled: tagger2 would read what tok2vec set, released by the cleaner.
    with nlp.select_pipes(disable=["tok2vec2"]):
        with pytest.raises(ValueError) as err:
            nlp(SENTENCE)
    msg = str(err.value)
    assert "'tagger2' runs after it and reads doc.tensor" in msg
    if upstream == "*":
        assert "That is, it listens to 'tok2vec', the last component before it" in msg
    else:
        assert (
            "listening to 'tok2vec2'. 'tok2vec2' is disabled; 'tok2vec' sets doc.tensor before "
            "the cleaner and no component between the cleaner and 'tagger2' sets it again"
        ) in msg
    assert "release the data of 'tok2vec' before 'tagger2' reads it" in msg
    assert "Put the cleaner last" in msg
    assert _tags([nlp(SENTENCE)]) == expected  # enabled again: fine again
    nlp.remove_pipe("tok2vec2")
    with pytest.raises(ValueError, match="'tagger2' runs after it and reads doc.tensor") as err:
        nlp(SENTENCE)
    if upstream == "tok2vec2":
        assert "'tok2vec2' is not in the pipeline; 'tok2vec' sets doc.tensor" in str(err.value)


@pytest.mark.filterwarnings("ignore::spacy_lean.cleaner.LeanCleanerWarning")
def test_a_component_that_sets_the_field_again_before_its_reader():
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    nlp.add_pipe("tagger", config=_tagger_config("*"))
    nlp.add_pipe("lean_cleaner", config={"trf_data": False})
    nlp.add_pipe("lean_test_tensor_writer")
    nlp.add_pipe("lean_test_tensor_reader")
    example = Example.from_dict(nlp.make_doc(SENTENCE), TAGS)
    nlp.initialize(lambda: [example])
    TENSOR_SIZES_SEEN.clear()
    doc = nlp(SENTENCE)
    assert TENSOR_SIZES_SEEN == [len(doc) * 4]
    with nlp.select_pipes(disable=["lean_test_tensor_writer"]):
        with pytest.raises(ValueError) as err:
            nlp(SENTENCE)
    msg = str(err.value)
    assert (
        "'lean_test_tensor_reader' runs after it and reads doc.tensor: its factory declares "
        "requires=['doc.tensor']. 'tok2vec' sets doc.tensor before the cleaner and no "
        "component between the cleaner and 'lean_test_tensor_reader' sets it again."
    ) in msg
    assert "would find an empty array there" in msg and "Put the cleaner last" in msg


def test_cleaner_checks_only_what_it_releases():
    """tensor=false: a tok2vec listener after the cleaner is fine; trf_data=false with
    "trf_data" named in `extensions` still releases doc._.trf_data, and says so."""
    nlp = spacy.blank("en")
    nlp.add_pipe("tok2vec")
    cleaner = nlp.add_pipe("lean_cleaner", config={"tensor": False})
    nlp.add_pipe("tagger", config=_tagger_config("*"))
    example = Example.from_dict(nlp.make_doc(SENTENCE), TAGS)
    with pytest.warns(LeanCleanerWarning, match="no component that sets doc._.trf_data"):
        nlp.initialize(lambda: [example])
        doc = nlp(SENTENCE)
    assert doc.tensor.shape == (5, 96)
    assert cleaner.released_attrs == ["doc._.trf_data"]
    if not Doc.has_extension("trf_data"):  # as spacy-transformers registers it
        Doc.set_extension("trf_data", default=None)
    named = LeanCleaner(None, trf_data=False, tensor=False, extensions=["trf_data"])
    assert named.released_attrs == ["doc._.trf_data"]


def _two_block_source_and_corpus(tmp_path, annotation, corpus_name):
    """A pipeline with an initialized tok2vec2 to source (tmp_path/source), and a
    two-doc training corpus with `annotation` (tmp_path/corpus_name)."""
    from spacy.tokens import DocBin

    source = spacy.blank("en")
    source.add_pipe("tok2vec", name="tok2vec2")
    source.initialize()
    source.to_disk(tmp_path / "source")
    nlp = spacy.blank("en")
    texts = [SENTENCE, "Veldmark is far away now"]
    docs = [Example.from_dict(nlp.make_doc(t), annotation).reference for t in texts]
    DocBin(docs=docs).to_disk(tmp_path / corpus_name)


def test_training_initialize_with_a_frozen_sourced_tok2vec_after_the_cleaner(tmp_path):
    """`spacy train` initializes with its frozen and sourced components disabled
    (`init_nlp`): a frozen tok2vec2 between the cleaner and the tagger2 being trained
    on it is no reason to refuse."""
    from spacy.training.initialize import init_nlp

    _two_block_source_and_corpus(tmp_path, TAGS, "tags.spacy")
    config = spacy.util.load_config_from_str(TWO_BLOCK_TRAINING_CONFIG)
    config["paths"]["train"] = config["paths"]["dev"] = str(tmp_path / "tags.spacy")
    config["components"]["tok2vec2"]["source"] = str(tmp_path / "source")
    nlp = init_nlp(config)
    assert nlp.pipe_names[2:4] == ["lean_cleaner", "tok2vec2"]
    doc = nlp(SENTENCE)
    assert doc.tensor.size == 0
    with nlp.select_pipes(disable=["lean_cleaner", "lean_cleaner_end"]):
        assert _tags([nlp(SENTENCE)]) == _tags([doc])


def test_training_initialize_refuses_a_frozen_reader_after_the_cleaner(tmp_path):
    """`spacy train` initializes with its frozen components disabled, and the check
    at initialize left disabled readers out: a frozen tagger reading the tok2vec's
    doc.tensor after the cleaner passed initialize, and training failed at its first
    evaluation. A frozen reader counts now: refused before training starts."""
    from spacy.training.initialize import init_nlp

    source = spacy.blank("en")
    source.add_pipe("tok2vec")
    listener = {"@architectures": "spacy.Tok2VecListener.v1", "width": 96, "upstream": "*"}
    source.add_pipe("tagger", config={"model": {"tok2vec": listener}})
    _two_block_source_and_corpus(tmp_path, TAGS, "tags.spacy")
    examples = [Example.from_dict(source.make_doc(SENTENCE), TAGS)]
    source.initialize(lambda: examples)
    source.to_disk(tmp_path / "frozen_source")
    config = spacy.util.load_config_from_str(TWO_BLOCK_TRAINING_CONFIG)
    config["nlp"]["pipeline"] = ["tok2vec", "lean_cleaner", "tagger", "tok2vec2", "tagger2"]
    for name in ("tok2vec", "tagger"):
        config["components"][name] = {"source": str(tmp_path / "frozen_source")}
    del config["components"]["lean_cleaner_end"]
    config["components"]["tok2vec2"]["source"] = str(tmp_path / "source")
    config["paths"]["train"] = config["paths"]["dev"] = str(tmp_path / "tags.spacy")
    config["training"]["frozen_components"] = ["tok2vec", "tagger", "tok2vec2"]
    config["training"]["annotating_components"] = ["tok2vec2"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # spaCy's W086/W087 on sourced listeners
        with pytest.raises(ValueError, match="'tagger' runs after it and reads doc.tensor"):
            init_nlp(config)


def test_training_initialize_with_a_frozen_sourced_tok2vec_before_a_ner(tmp_path):
    """The same with a ner reading tok2vec2: a ner (or parser) runs the components
    before it on sample docs while it initializes, the cleaner included, whose first
    call used to check the pipeline strictly, tok2vec2 disabled: `spacy train` could
    not start. The pipeline is checked as initialize saw it until it changes, then
    strictly: with tok2vec2 disabled after training, the cleaner refuses."""
    from spacy.training.initialize import init_nlp

    annotation = dict(TAGS, entities=["U-PER", "O", "U-LOC", "O", "O"])
    _two_block_source_and_corpus(tmp_path, annotation, "ents.spacy")
    text = TWO_BLOCK_TRAINING_CONFIG.replace('"tagger2"', '"ner2"')
    text = text.replace(
        '[components.tagger2]\nfactory = "tagger"', '[components.ner2]\nfactory = "ner"'
    )
    text = text.replace(
        '[components.tagger2.model]\n@architectures = "spacy.Tagger.v2"',
        '[components.ner2.model]\n@architectures = "spacy.TransitionBasedParser.v2"\n'
        'state_type = "ner"\nhidden_width = 16\nmaxout_pieces = 2\nuse_upper = true',
    )
    text = text.replace("[components.tagger2.model.tok2vec]", "[components.ner2.model.tok2vec]")
    config = spacy.util.load_config_from_str(text)
    assert config["nlp"]["pipeline"][4] == "ner2" and "tagger2" not in config["components"]
    config["paths"]["train"] = config["paths"]["dev"] = str(tmp_path / "ents.spacy")
    config["components"]["tok2vec2"]["source"] = str(tmp_path / "source")
    nlp = init_nlp(config)
    assert nlp.pipe_names[2:5] == ["lean_cleaner", "tok2vec2", "ner2"]
    doc = nlp(SENTENCE)
    assert doc.tensor.size == 0
    with nlp.select_pipes(disable=["tok2vec2"]):
        with pytest.raises(ValueError, match="'ner2' runs after it and reads doc.tensor"):
            nlp(SENTENCE)


TWO_BLOCK_TRAINING_CONFIG = """
[paths]
train = null
dev = null

[nlp]
lang = "en"
pipeline = ["tok2vec","tagger","lean_cleaner","tok2vec2","tagger2","lean_cleaner_end"]

[components]

[components.tok2vec]
factory = "tok2vec"

[components.tagger]
factory = "tagger"

[components.tagger.model]
@architectures = "spacy.Tagger.v2"

[components.tagger.model.tok2vec]
@architectures = "spacy.Tok2VecListener.v1"
width = 96
upstream = "*"

[components.lean_cleaner]
factory = "lean_cleaner"
trf_data = false

[components.tok2vec2]
source = null

[components.tagger2]
factory = "tagger"

[components.tagger2.model]
@architectures = "spacy.Tagger.v2"

[components.tagger2.model.tok2vec]
@architectures = "spacy.Tok2VecListener.v1"
width = 96
upstream = "tok2vec2"

[components.lean_cleaner_end]
factory = "lean_cleaner"
trf_data = false

[corpora]

[corpora.train]
@readers = "spacy.Corpus.v1"
path = ${paths.train}

[corpora.dev]
@readers = "spacy.Corpus.v1"
path = ${paths.dev}

[training]
seed = 0
gpu_allocator = null
frozen_components = ["tok2vec2"]
annotating_components = ["tok2vec2"]
"""


def _source_second_transformer_block(nlp, trf_ner_dir, upstream):
    """Add a second transformer + ner (a copy of the first), as 'transformer2' and
    'ner2', ner2's listener listening to `upstream`. RETURNS the listener layer."""
    source = spacy.load(trf_ner_dir)
    source.rename_pipe("transformer", "transformer2")
    source.rename_pipe("ner", "ner2")
    listener = next(n for n in source.get_pipe("ner2").model.walk() if n.name.endswith("listener"))
    listener.upstream_name = upstream
    nlp.add_pipe("transformer2", source=source)
    nlp.add_pipe("ner2", source=source)
    return listener


@pytest.mark.parametrize("upstream", ["transformer2", "*"])
def test_cleaner_between_two_transformer_blocks(trf_ner_nlp, trf_ner_dir, texts, upstream):
    """[transformer, ner, lean_cleaner, transformer2, ner2, lean_cleaner_end]: ner2
    reads what transformer2 set after the first cleaner released transformer's batch."""
    nlp = trf_ner_nlp
    listener = _source_second_transformer_block(nlp, trf_ner_dir, upstream)
    sample = texts[:6]
    expected = _ents(nlp.pipe(sample))
    seen = []
    forward = listener._func

    def spy(model, docs, is_train):
        seen.extend(doc._.trf_data is not None for doc in docs)
        return forward(model, docs, is_train)

    listener._func = spy
    first = nlp.add_pipe("lean_cleaner", before="transformer2")
    last = nlp.add_pipe("lean_cleaner", name="lean_cleaner_end")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeanCleanerWarning)
        docs = list(nlp.pipe(sample))
    assert nlp.pipe_names == [
        "transformer",
        "ner",
        "lean_cleaner",
        "transformer2",
        "ner2",
        "lean_cleaner_end",
    ]
    assert _ents(docs) == expected
    assert seen == [True] * len(sample)
    assert all(doc._.trf_data is None for doc in docs)
    assert first.stats["trf_data"] == last.stats["trf_data"] == len(sample)


def test_ner2_listening_to_the_first_transformer_is_refused(trf_ner_nlp, trf_ner_dir):
    nlp = trf_ner_nlp
    _source_second_transformer_block(nlp, trf_ner_dir, "transformer")
    nlp.add_pipe("lean_cleaner", before="transformer2")
    with pytest.raises(ValueError) as err:
        nlp("Ada Lindqvist visited Veldmark .")
    msg = str(err.value)
    assert "'ner2' runs after it and reads doc._.trf_data" in msg
    assert "listening to 'transformer'. 'transformer' sets doc._.trf_data before the" in msg
    assert "['transformer2'] set(s) doc._.trf_data again between the cleaner and 'ner2'" in msg
    assert "Put the cleaner last" in msg


# -- spacy-curated-transformers (its DocTransformerOutput) -------------------


@pytest.fixture(scope="module")
def curated_nlp(tiny_transformer, blank_nlp):
    pytest.importorskip("spacy_curated_transformers")
    from curated_util import curated_pipeline

    nlp = curated_pipeline(tiny_transformer)
    docs = synthetic.make_ner_docs(blank_nlp, 16, seed=31)
    examples = [Example(nlp.make_doc(d.text), d) for d in docs]
    # Initialized, not trained: spacy-curated-transformers 0.3's update fails under
    # numpy 2 (it calls float() on a 1-element array); predictions need no training.
    nlp.initialize(lambda: examples)
    return nlp


def test_curated_transformer_output(curated_nlp, texts):
    nlp = curated_nlp
    trf = nlp.get_pipe("transformer")
    original = trf.set_annotations
    refs = []

    def set_annotations(docs, trf_output):
        original(docs, trf_output)
        for doc in docs:
            for layer in doc._.trf_data.all_outputs:
                base = layer.dataXd
                while isinstance(base.base, numpy.ndarray):
                    base = base.base
                refs.append(weakref.ref(base))

    trf.set_annotations = set_annotations
    try:
        sample = texts[:16]
        kept = list(nlp.pipe(sample))
        expected = _ents(kept)
        assert type(kept[0]._.trf_data).__name__ == "DocTransformerOutput"
        assert _alive(refs) > 0  # control: kept docs pin the outputs
        # Compact vectors (keeping trf_data to compare) are the per-token means.
        nlp.add_pipe("lean_cleaner", config={"trf_data": False, "compact_vectors": "float32"})
        for doc in nlp.pipe(sample[:4]):
            layer = doc._.trf_data.last_hidden_layer_state
            starts = numpy.concatenate([[0], numpy.cumsum(layer.lengths)[:-1]])
            for i, (start, length) in enumerate(zip(starts, layer.lengths)):
                rows = layer.dataXd[start : start + length]
                want = rows.mean(axis=0) if length else numpy.zeros(rows.shape[1])
                assert_allclose(doc.tensor[i], want, rtol=1e-5, atol=1e-6)
        nlp.remove_pipe("lean_cleaner")
        del kept
        refs.clear()
        cleaner = nlp.add_pipe("lean_cleaner")
        docs = list(nlp.pipe(sample))
        assert _ents(docs) == expected
        assert all(doc._.trf_data is None for doc in docs)
        assert cleaner.stats["trf_data"] == len(sample) and cleaner.stats["released_bytes"] > 0
        assert refs and _alive(refs) == 0
        # Placement before the curated listener is an error too.
        nlp.remove_pipe("lean_cleaner")
        nlp.add_pipe("lean_cleaner", before="ner")
        with pytest.raises(ValueError, match="'ner' runs after it and reads doc._.trf_data"):
            nlp(sample[0])
    finally:
        trf.set_annotations = original
        if "lean_cleaner" in nlp.component_names:
            nlp.remove_pipe("lean_cleaner")


def _user_data_cleaner_source(tmp_path):
    """A saved pipeline: the user-data writer, a sentencizer, then a cleaner of the
    writer's key that names the sentencizer as a consumer (well placed there)."""
    source = spacy.blank("en")
    source.add_pipe("lean_test_user_data_writer")
    source.add_pipe("sentencizer")
    config = {"trf_data": False, "tensor": False, "user_data_keys": ["k"]}
    source.add_pipe("lean_cleaner", config=dict(config, consumers=["sentencizer"]))
    assert "k" not in source("Ada met Bo").user_data
    source.to_disk(tmp_path / "source")
    return tmp_path / "source"


def test_a_cleaner_sourced_in_a_config_is_checked_where_it_runs(tmp_path):
    """A cleaner sourced from another pipeline (`source = ...`, as `spacy train`
    builds it) is the source's object, made for the source pipeline: its placement
    was checked in the source's order (the cleaner last: fine), not the running
    pipeline's (before its consumer), and it kept the whole source pipeline alive.
    Now it is checked where it runs, and the source is let go of."""
    path = _user_data_cleaner_source(tmp_path)
    config = spacy.util.load_config_from_str(
        f"""
        [nlp]
        lang = "en"
        pipeline = ["lean_test_user_data_writer", "lean_cleaner", "sentencizer"]
        [components]
        [components.lean_test_user_data_writer]
        source = "{path}"
        [components.lean_cleaner]
        source = "{path}"
        [components.sentencizer]
        source = "{path}"
        """
    )
    sources = []
    real_load = spacy.util.load_model

    def load_model(*args, **kwargs):
        nlp = real_load(*args, **kwargs)
        sources.append(weakref.ref(nlp))
        return nlp

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spacy.util, "load_model", load_model)
        nlp = spacy.util.load_model_from_config(config, auto_fill=True)
    gc.collect()
    assert sources and all(ref() is None for ref in sources)  # the source pipeline is gone
    with pytest.raises(ValueError, match="'sentencizer' runs after it and reads doc.user_data"):
        nlp("Ada met Bo")
    with pytest.raises(ValueError, match="'sentencizer' runs after it"):
        list(nlp.pipe(["Ada met Bo"]))


def test_a_cleaner_in_two_live_pipelines_is_checked_in_each(tmp_path):
    """`add_pipe(source=other)` shares the cleaner with a pipeline that is still used:
    each pipeline's order is the one checked while it runs."""
    source = spacy.load(_user_data_cleaner_source(tmp_path))
    nlp = spacy.blank("en")
    nlp.add_pipe("lean_test_user_data_writer")
    nlp.add_pipe("lean_cleaner", source=source)
    nlp.add_pipe("sentencizer")
    assert nlp.get_pipe("lean_cleaner") is source.get_pipe("lean_cleaner")
    with pytest.raises(ValueError, match="'sentencizer' runs after it"):
        nlp("Ada met Bo")
    assert "k" not in source("Ada met Bo").user_data  # well placed there
    with pytest.raises(ValueError, match="'sentencizer' runs after it"):
        list(nlp.pipe(["Ada met Bo"]))
    assert ["k" in doc.user_data for doc in source.pipe(["Ada met Bo", "Bo met Ada"])] == [
        False,
        False,
    ]
