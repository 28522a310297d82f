"""Streaming evaluation in spaCy memory zones (`spacy_lean.zones`): the vocab stops
growing with the dev set's distinct words, and the scores stay `nlp.evaluate`'s."""

import json
import random

import pytest
import spacy
import srsly
from spacy.scorer import Scorer
from spacy.tokens import DocBin, Span
from spacy.training import Example

from spacy_lean import evaluate, synthetic
from spacy_lean.corpus import LeanCorpus, read_examples
from spacy_lean.scoring.gold import build_scoring_pipeline, make_scoring_docs
from spacy_lean.scoring.testing import assert_scores_equal
from spacy_lean.streaming import StreamingEvaluator
from spacy_lean.zones import MemoryZones

from eval_util import record_evaluators


def without_speed(scores):
    scores = dict(scores)
    scores.pop("speed", None)
    return scores


@pytest.fixture(scope="module")
def rich_nlp():
    """Every trainable built-in component (tagger, morphologizer, lemmatizer, senter,
    parser, ner, spancat, textcat, entity_linker...) on a small tok2vec."""
    nlp = spacy.blank("en")
    return build_scoring_pipeline(nlp, make_scoring_docs(nlp, 40, seed=11), n_steps=15)


def new_word_docs(nlp, n, seed):
    """NER docs whose every doc has words no other doc has (numbers, handles, URLs):
    what makes a real dev set's vocab grow."""
    rng = random.Random(seed)
    docs = synthetic.make_ner_docs(nlp, n, seed=seed)
    out = []
    for doc in docs:
        extra = " ".join(
            f"@user{rng.randrange(10**9)} https://t.co/{rng.randrange(10**9):x} {rng.random():.6f}"
            for _ in range(rng.randrange(1, 4))
        )
        record = {
            "text": doc.text + " " + extra,
            "entities": [[e.start_char, e.end_char, e.label_] for e in doc.ents],
        }
        out.append(record)
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf8")
    return path


def evaluator_for(nlp, **kwargs):
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("window_size", 8)
    return StreamingEvaluator(nlp, copy_examples=False, **kwargs)


@pytest.fixture(scope="module")
def trained_ner(tiny_ner_config, tmp_path_factory):
    """A tok2vec + ner pipeline trained for a few steps on generated docs."""
    from thinc.api import fix_random_seed

    fix_random_seed(0)
    nlp = spacy.util.load_model_from_config(tiny_ner_config(), auto_fill=True)
    train = [
        Example(nlp.make_doc(d.text), d)
        for d in synthetic.make_ner_docs(spacy.blank("en"), 30, seed=41)
    ]
    optimizer = nlp.initialize(lambda: train)
    for _ in range(10):
        for start in range(0, len(train), 3):
            nlp.update(train[start : start + 3], sgd=optimizer)
    return nlp


def test_new_words_leave_the_vocab_as_it_was(trained_ner, tmp_path):
    """A .jsonl dev set of words the pipeline never saw: in zones the vocab ends as it
    began; without them it takes every new word (the control), and the scores of all
    three (zones, no zones, nlp.evaluate on the listed examples) are the same."""
    nlp = trained_ner
    records = new_word_docs(spacy.blank("en"), 60, seed=5)
    path = write_jsonl(tmp_path / "dev.jsonl", records)
    before = len(nlp.vocab.strings)
    ev = evaluator_for(nlp)
    zoned = ev.run(read_examples(nlp, [path])).result()
    assert ev.zones is not None and ev.zones.n_zones > 5  # 60 docs, windows of 8
    kept = len(nlp.vocab.strings) - before
    # Only the first window (8 docs, read outside any zone) and the doc read after it
    # left their words.
    handles = {w for r in records for w in r["text"].split() if w.startswith("@user")}
    first = {w for r in records[:9] for w in r["text"].split() if w.startswith("@user")}
    assert {s for s in nlp.vocab.strings if s.startswith("@user")} == first
    plain = evaluator_for(nlp, memory_zones=False)
    unzoned = plain.run(read_examples(nlp, [path])).result()
    assert plain.zones is None
    assert {s for s in nlp.vocab.strings if s.startswith("@user")} == handles  # the control
    assert len(nlp.vocab.strings) - before > 4 * kept
    expected = nlp.evaluate(list(read_examples(nlp, [path])), batch_size=4)
    assert expected["ents_f"] is not None and 0 < expected["ents_f"] < 1
    assert_scores_equal(without_speed(expected), without_speed(zoned))
    assert_scores_equal(without_speed(expected), without_speed(unzoned))


@pytest.mark.parametrize("gold_preproc", [False, True])
def test_a_rich_pipeline_scores_the_same_from_a_spacy_file_in_zones(
    rich_nlp, tmp_path, gold_preproc
):
    """Every built-in scorer (tags, morphs, lemmas, sentences, dependencies, entities,
    spans, cats, links) on a .spacy file read in zones equals `nlp.evaluate`. With
    gold_preproc a doc gives one example per sentence: zones end only between docs.
    The file's strings stay (its later docs need them by hash)."""
    nlp = rich_nlp
    docs = make_scoring_docs(spacy.blank("en"), 40, seed=12)
    path = tmp_path / "dev.spacy"
    DocBin(docs=docs, store_user_data=True).to_disk(path)
    ev = evaluator_for(nlp)
    zoned = ev.run(read_examples(nlp, [path], gold_preproc=gold_preproc)).result()
    assert ev.zones.n_zones > 3
    if gold_preproc:
        assert ev.zones.n_kept > 0  # window ends between the sentences of a doc
    expected = nlp.evaluate(list(read_examples(nlp, [path], gold_preproc=gold_preproc)))
    assert expected["dep_las"] and expected["ents_per_type"] and expected["nel_f_per_type"]
    assert_scores_equal(without_speed(expected), without_speed(zoned))


@pytest.mark.parametrize(
    "settings",
    [
        {"max_length": 6},  # docs split into pieces across windows
        {"max_length": 6, "shuffle": True, "shuffle_buffer": 10, "seed": 3},
        {"compact": True, "compact_chunk": 5},  # DocBin chunks decoded across zones
    ],
    ids=["split", "shuffled", "compact"],
)
def test_a_corpus_stream_changes_zone_only_where_it_holds_no_doc(trained_ner, tmp_path, settings):
    """`spacy-lean.Corpus.v1` streams: the pieces of a split doc, a shuffle buffer and
    compact chunks span windows; the zones wait for them, and the scores equal
    `nlp.evaluate` of the same stream listed."""
    nlp = trained_ner
    path = write_jsonl(tmp_path / "dev.jsonl", new_word_docs(spacy.blank("en"), 40, seed=6))
    held = []
    corpus = LeanCorpus(path, **settings)
    stream = corpus(nlp)
    real = stream.holds_docs

    def holds_docs():
        held.append(real())
        return held[-1]

    stream.holds_docs = holds_docs
    ev = evaluator_for(nlp)
    zoned = ev.run(stream).result()
    assert ev.zones.n_zones > 1
    if "max_length" in settings:
        assert True in held  # a window ended inside a split doc or with a full buffer
    expected = nlp.evaluate(list(LeanCorpus(path, **settings)(nlp)), batch_size=4)
    assert_scores_equal(without_speed(expected), without_speed(zoned))


def test_an_augmenter_s_examples_stay_in_their_zone(trained_ner, tmp_path):
    """An augmenter that makes two examples of each: the second is used in the zone of
    the first."""
    nlp = trained_ner
    path = write_jsonl(tmp_path / "dev.jsonl", new_word_docs(spacy.blank("en"), 30, seed=7))

    def twice(nlp, eg):
        yield eg
        yield Example(eg.predicted.copy(), eg.reference)

    ev = evaluator_for(nlp, batch_size=3, window_size=3)
    zoned = ev.run(LeanCorpus(path, augmenter=twice)(nlp)).result()
    assert ev.zones.n_zones > 5 and ev.zones.n_kept > 5
    expected = nlp.evaluate(list(LeanCorpus(path, augmenter=twice)(nlp)), batch_size=3)
    assert_scores_equal(without_speed(expected), without_speed(zoned))


class OwnStream:
    """A stream of examples made one at a time, which holds none between them."""

    def __init__(self, nlp, records, user_data=None):
        self.nlp = nlp
        self.records = records
        self.user_data = user_data
        self.n_made = 0

    def __iter__(self):
        for record in self.records:
            doc = self.nlp.make_doc(record["text"])
            doc.ents = [doc.char_span(s, e, label=lab) for s, e, lab in record["entities"]]
            if self.user_data is not None:
                doc.user_data["extra"] = self.user_data
            self.n_made += 1
            yield Example(self.nlp.make_doc(record["text"]), doc)

    def holds_docs(self):
        return False


def test_a_look_ahead_example_is_made_again_in_the_next_zone(trained_ner):
    """The example read ahead at a window's end is made again in the next zone; one
    whose user data cannot be serialised keeps the zone open instead."""
    nlp = trained_ner
    records = new_word_docs(spacy.blank("en"), 24, seed=8)
    expected = nlp.evaluate(list(OwnStream(nlp, records)), batch_size=4)
    with pytest.raises(TypeError):
        srsly.msgpack_dumps({1, 2})
    for user_data, moved in ((["a", 1], True), ({1, 2}, False)):
        ev = evaluator_for(nlp)
        zoned = ev.run(OwnStream(nlp, records, user_data)).result()
        # 24 docs in windows of 8: the first outside any zone, then a zone per window
        # (else one), and a new one at the end
        assert ev.zones.n_zones == (3 if moved else 2)
        assert ev.zones.n_kept == (0 if moved else 1)
        assert_scores_equal(without_speed(expected), without_speed(zoned))


def test_where_zones_are_not_used(trained_ner, tmp_path):
    """A list, a plain generator, a caller's open zone (zones do not nest), and a
    Scorer subclass (which keeps the examples to the end) evaluate without zones, to
    the same scores."""
    nlp = trained_ner
    path = write_jsonl(tmp_path / "dev.jsonl", new_word_docs(spacy.blank("en"), 20, seed=9))
    examples = list(read_examples(nlp, [path]))
    expected = without_speed(nlp.evaluate(examples, batch_size=4))
    for make in (lambda: examples, lambda: (eg for eg in read_examples(nlp, [path]))):
        ev = StreamingEvaluator(nlp, batch_size=4, window_size=8)
        assert_scores_equal(expected, without_speed(ev.run(make()).result()))
        assert ev.zones is None
    with nlp.memory_zone():
        ev = evaluator_for(nlp)
        assert_scores_equal(expected, without_speed(ev.run(read_examples(nlp, [path])).result()))
        assert ev.zones is None

    class MyScorer(Scorer):
        pass

    with pytest.warns(UserWarning, match="subclass"):
        ev = evaluator_for(nlp, scorer=MyScorer(nlp))
    assert_scores_equal(expected, without_speed(ev.run(read_examples(nlp, [path])).result()))
    assert ev.zones is None
    assert MemoryZones.for_stream(nlp, read_examples(nlp, [path]), ev.state) is None


def test_evaluate_from_a_path_uses_zones_unless_told_not_to(trained_ner, tmp_path, monkeypatch):
    nlp = trained_ner
    path = write_jsonl(tmp_path / "dev.jsonl", new_word_docs(spacy.blank("en"), 20, seed=10))
    built = record_evaluators(monkeypatch)
    before = len(nlp.vocab.strings)
    zoned = evaluate(nlp, path, batch_size=4, window_size=4)
    kept = len(nlp.vocab.strings) - before
    assert built[-1].zones.n_zones > 1
    unzoned = evaluate(nlp, path, batch_size=4, window_size=4, memory_zones=False)
    assert built[-1].zones is None and len(nlp.vocab.strings) - before > 3 * kept
    assert_scores_equal(without_speed(unzoned), without_speed(zoned))


def test_the_config_setting_is_checked():
    from spacy_lean.streaming import make_streaming_evaluate_v1
    from spacy_lean.training.callbacks import make_lean_training_v1

    with pytest.raises(ValueError, match="memory_zones must be true or false, got 'yes'"):
        make_streaming_evaluate_v1(memory_zones="yes")
    with pytest.raises(ValueError, match="eval_memory_zones must be true or false, got 1"):
        make_lean_training_v1(eval_memory_zones=1)


@spacy.Language.factory("test_zones_custom_scored")
def make_custom_scored(nlp, name):
    return _CustomScored()


class _CustomScored:
    """A component with its own `score` method, which has no mergeable twin: its
    state keeps slim copies of the examples to the end."""

    def __call__(self, doc):
        return doc

    def score(self, examples, **kwargs):
        return {"custom_words": float(sum(len(eg.reference) for eg in examples))}


def test_a_component_without_a_twin_evaluates_without_zones(trained_ner, tmp_path):
    """Its kept docs would outlive their zone: no zones, and its score is right."""
    nlp = spacy.blank("en")
    nlp.add_pipe("test_zones_custom_scored")
    path = write_jsonl(tmp_path / "dev.jsonl", new_word_docs(spacy.blank("en"), 20, seed=11))
    ev = evaluator_for(nlp)
    assert not ev.state.zone_safe
    got = ev.run(read_examples(nlp, [path])).result()
    assert ev.zones is None
    expected = nlp.evaluate(list(read_examples(nlp, [path])))
    assert got["custom_words"] == expected["custom_words"] > 100


@pytest.mark.parametrize("zones", [True, False])
def test_spacy_train_s_dev_evaluation_leaves_no_dev_word_in_the_pipeline(
    tiny_ner_config, tmp_path, zones
):
    """`spacy train` with the streaming callback and a `spacy-lean.Corpus.v1` dev set:
    its words do not stay in the vocab the pipeline is saved with (they did without
    zones: the control), and training ends as it does without zones."""
    from spacy.cli.train import train
    from thinc.api import Config

    synthetic.write_ner_corpus(tmp_path / "train.spacy", 20, seed=51)
    records = new_word_docs(spacy.blank("en"), 40, seed=52)
    dev = write_jsonl(tmp_path / "dev.jsonl", records)
    config = tiny_ner_config()
    config["nlp"]["batch_size"] = 2  # windows of 16 docs: the first outside any zone
    config = config.merge(
        Config().from_str(
            f"""
            [nlp]

            [corpora]

            [nlp.after_pipeline_creation]
            @callbacks = "spacy-lean.streaming_evaluate.v1"
            memory_zones = {str(zones).lower()}

            [corpora.dev]
            @readers = "spacy-lean.Corpus.v1"
            path = ${{paths.dev}}
            """,
            interpolate=False,
        )
    )
    config["training"]["max_steps"] = 6
    config["training"]["eval_frequency"] = 3
    config.to_disk(tmp_path / "config.cfg")
    out = tmp_path / "out"
    train(
        tmp_path / "config.cfg",
        out,
        overrides={"paths.train": str(tmp_path / "train.spacy"), "paths.dev": str(dev)},
    )
    strings = set(srsly.read_json(out / "model-last" / "vocab" / "strings.json"))
    # The first window and the doc after it are read outside any zone.
    later = {w for r in records[17:] for w in r["text"].split() if w.startswith("@user")}
    assert bool(later & strings) is not zones
    train_words = {
        t.text for d in synthetic.make_ner_docs(spacy.blank("en"), 20, seed=51) for t in d
    }
    assert train_words <= strings  # the training data's words stay
    nlp = spacy.load(out / "model-last")
    assert set(nlp.get_pipe("ner").labels) == set(synthetic.LABELS)
    assert len(nlp(srsly.read_jsonl(dev).__next__()["text"]))
    meta = srsly.read_json(out / "model-last" / "meta.json")
    assert meta["performance"]["ents_f"] is not None


def test_a_chinese_pipeline_streams_its_tokenization_scores(tmp_path):
    """spaCy's Chinese tokenizer scores as `Tokenizer.score` does (its own method): its
    twin is the tokenization state, so nothing is kept (before, every example was kept
    with a warning, and no memory zone was used)."""
    import warnings

    from spacy_lean.scoring.pipeline import SlimExamplesState

    nlp = spacy.blank("zh")
    nlp.add_pipe("entity_ruler").add_patterns([{"label": "ORG", "pattern": "北京大学"}])
    texts = ["我在北京大学学习。", "他去了北京大学。", "今天天气很好。"] * 8
    records = []
    for i, text in enumerate(texts):
        start = text.find("北京大学")
        ents = [[start, start + 4, "ORG"]] if start >= 0 else []
        records.append({"text": text + f" 第{i}号", "entities": ents})
    path = write_jsonl(tmp_path / "dev.jsonl", records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ev = evaluator_for(nlp)
    assert not any(isinstance(state, SlimExamplesState) for _, state in ev.state.states)
    zoned = ev.run(read_examples(nlp, [path])).result()
    assert ev.zones.n_zones > 1
    expected = nlp.evaluate(list(read_examples(nlp, [path])))
    assert expected["token_acc"] == 1.0 and expected["ents_f"] == 1.0
    assert_scores_equal(without_speed(expected), without_speed(zoned))


def test_each_shard_s_string_table_outlives_the_zone_it_is_read_in(tmp_path):
    """A folder of shards: the second .spacy file's table is read inside a zone, where
    some of its strings are already transient: "zorblax" is the norm of "Zorblax",
    which comes first in the table's sorted order; "quux" came from a .jsonl shard read
    in the same zone. Adding them again kept them transient (spaCy keeps the first
    entry): the zone's end removed them and a later doc of the file failed with E018,
    reported as a corrupt file."""
    make = spacy.blank("en")
    folder = tmp_path / "dev"
    folder.mkdir()
    fillers = [make(f"filler {i} here .") for i in range(3)]
    DocBin(docs=fillers).to_disk(folder / "a.spacy")
    write_jsonl(folder / "b.jsonl", [{"text": "Quux says hi .", "entities": []}])
    docs = [make("Zorblax came .")] + fillers + [make("the zorblax and quux left .")]
    DocBin(docs=docs).to_disk(folder / "c.spacy")
    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    shards = [folder / "a.spacy", folder / "b.jsonl", folder / "c.spacy"]
    ev = StreamingEvaluator(nlp, batch_size=1, window_size=1, copy_examples=False)
    got = ev.run(read_examples(nlp, shards)).result()
    assert ev.zones.n_zones >= 7
    expected = nlp.evaluate(list(read_examples(nlp, shards)))
    assert got["token_acc"] == expected["token_acc"] == 1.0
    assert_scores_equal(without_speed(expected), without_speed(got))


def test_a_resumed_evaluation_frees_the_words_of_the_examples_it_skips(tmp_path):
    """`skip` (a checkpoint's resume) reads the examples already counted in zones too:
    their words do not stay (they all did when the skipped ones were read outside any
    zone, as the first window is)."""
    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    records = [{"text": f"word{i}a word{i}b .", "entities": []} for i in range(300)]
    path = write_jsonl(tmp_path / "dev.jsonl", records)
    before = len(nlp.vocab.strings)
    ev = StreamingEvaluator(nlp, batch_size=8, window_size=8, copy_examples=False)
    ev.run(read_examples(nlp, [path]), skip=250)
    assert ev.n_examples == 300
    # The 50 examples evaluated: the first 8 (and the one after) outside any zone.
    assert len(nlp.vocab.strings) - before < 60


def test_spacy_lean_evaluate_and_its_workers_take_the_setting(trained_ner, tmp_path, monkeypatch):
    """`spacy lean evaluate` uses zones unless `--no-memory-zones`; a worker's unit
    (`--workers`) keeps to the setting it is given. The scores are the same."""
    from spacy.cli._util import app
    from typer.testing import CliRunner

    import spacy_lean.cli  # noqa: F401  (adds `lean` to spaCy's app)
    from spacy_lean.distributed import _WORKER, WorkerSettings, evaluate_unit, make_units

    model = tmp_path / "model"
    trained_ner.to_disk(model)
    data = write_jsonl(tmp_path / "dev.jsonl", new_word_docs(spacy.blank("en"), 30, seed=12))
    built = record_evaluators(monkeypatch)
    scores = {}
    for flag, used in (("--memory-zones", True), ("--no-memory-zones", False)):
        out = tmp_path / f"{flag}.json"
        args = ["lean", "evaluate", str(model), str(data), "-b", "4", "-o", str(out), flag]
        result = CliRunner().invoke(app, args + ["--no-progress"])
        assert result.exit_code == 0, result.output
        assert (built[-1].zones is not None) is used
        scores[flag] = without_speed(srsly.read_json(out))
    assert scores["--memory-zones"] == scores["--no-memory-zones"]
    for zones in (True, False):
        _WORKER.clear()
        try:
            settings = WorkerSettings(model=str(model), batch_size=4, memory_zones=zones)
            evaluate_unit(make_units([data], 1)[0], settings)
        finally:
            _WORKER.clear()
        assert (built[-1].zones is not None) is zones


def test_a_spacy_file_read_doc_by_doc_gives_the_docs_docbin_gives(tmp_path):
    """`strings_per_doc`: each doc brings its own strings (token table, span labels and
    ids) from the file's compact index; the docs are those of `DocBin.get_docs` (tags,
    morphs, lemmas, heads, entities with kb ids, span groups, cats), and the vocab takes
    only the strings of the docs read."""
    from spacy_lean.corpus.docbin import DocBinReader
    from spacy_lean.zones import StringIndex

    docs = make_scoring_docs(spacy.blank("en"), 12, seed=21)
    docs[0].spans["other"] = [
        Span(docs[0], 0, 2, label="ONLY_IN_A_SPAN", kb_id="Q_ONLY_IN_A_SPAN", span_id="ID_X")
    ]
    path = tmp_path / "dev.spacy"
    DocBin(docs=docs, store_user_data=True).to_disk(path)
    expected = [d.to_json() for d in DocBin().from_disk(path).get_docs(spacy.blank("en").vocab)]
    vocab = spacy.blank("en").vocab
    before = len(vocab.strings)
    with DocBinReader(path) as reader:
        got = list(reader.get_docs(vocab, strings_per_doc=True))
        n_table = reader.n_strings
    assert [d.to_json() for d in got] == expected
    span = got[0].spans["other"][0]
    assert (span.label_, span.kb_id_, span.id_) == ("ONLY_IN_A_SPAN", "Q_ONLY_IN_A_SPAN", "ID_X")
    assert n_table > 50
    grown = {}
    for per_doc in (True, False):  # only the first doc read: its strings, or the table
        vocab = spacy.blank("en").vocab
        before = len(vocab.strings)
        with DocBinReader(path) as reader:
            first = list(reader.get_docs(vocab, 0, 1, strings_per_doc=per_doc))
        assert first[0].to_json() == expected[0]
        grown[per_doc] = len(vocab.strings) - before
    assert grown[True] < grown[False] / 2
    index = StringIndex(["a", "b", "Zorblax"])
    assert len(index) == 3 and index.nbytes < 100


def test_a_spacy_file_s_strings_go_with_the_zones(trained_ner, tmp_path):
    """A .spacy dev set read in zones: its string table no longer enters the vocab
    whole; the words of the docs after the first window go (the control: without zones
    every one stays), with the same scores."""
    nlp = trained_ner
    records = new_word_docs(spacy.blank("en"), 60, seed=13)
    make = spacy.blank("en")
    from spacy_lean.corpus.jsonl import doc_from_record

    path = tmp_path / "dev.spacy"
    DocBin(docs=[doc_from_record(make, r, where="test") for r in records]).to_disk(path)
    later = {w for r in records[9:] for w in r["text"].split() if w.startswith("@user")}
    ev = evaluator_for(nlp)
    zoned = ev.run(read_examples(nlp, [path])).result()
    assert ev.zones.n_zones > 5
    assert not later & set(nlp.vocab.strings)
    unzoned = evaluator_for(nlp, memory_zones=False).run(read_examples(nlp, [path])).result()
    assert later <= set(nlp.vocab.strings)
    expected = nlp.evaluate(list(read_examples(nlp, [path])), batch_size=4)
    assert_scores_equal(without_speed(expected), without_speed(zoned))
    assert_scores_equal(without_speed(expected), without_speed(unzoned))


# A morphology dictionary: the analyses a component sets by string.
FEATS = {
    "owls": "Animacy=Anim|Number=Plur",
    "hens": "Animacy=Anim|Number=Plur",
    "slept": "Tense=Past|VerbForm=Fin",
    "sleeps": "Number=Sing|Person=3|Tense=Pres",
    "this": "Number=Sing|PronType=Dem",
    "tall": "Degree=Pos",
}


@spacy.Language.component("test_zones_feats_lookup")
def feats_lookup(doc):
    """Sets the dictionary's analyses by string and reads each back, as a rule
    lemmatizer or a tagger wrapper does."""
    for token in doc:
        feats = FEATS.get(token.text)
        if feats:
            token.set_morph(feats)
            assert str(token.morph) == feats
            token.morph.get("Number")
    return doc


@spacy.Language.component("test_zones_feats_setter")
def feats_setter(doc):
    """Sets the dictionary's analyses by string and reads none."""
    for token in doc:
        if token.text in FEATS:
            token.set_morph(FEATS[token.text])
    return doc


def feats_docs(nlp, n, seed):
    """Gold docs whose analyses first come on other words (docs 3-5), then on the
    dictionary's words (from doc 6 on, half of them with a gold analysis of their
    own, docs 6 and 7 among those), after a first window with none of them."""
    from spacy.tokens import Doc

    rng = random.Random(seed)
    docs = []
    for i in range(n):
        if i < 3:
            words, morphs = ["a", "wren", "sang"], ["Definite=Ind", "Number=Sing", "Tense=Past"]
        elif i < 6:
            words = ["few", "moles", "dug", "deep"]
            morphs = ["Degree=Pos", "Animacy=Anim|Number=Plur", "Tense=Past|VerbForm=Fin", ""]
        else:
            words = ["this", rng.choice(["owls", "hens"]), rng.choice(["slept", "sleeps"]), "tall"]
            morphs = [FEATS[w] for w in words]
            if rng.random() < 0.5 or i in (6, 7):  # gold without the analysis
                morphs[1] = "Number=Plur"
        docs.append(Doc(nlp.vocab, words=words, morphs=morphs))
    return docs


def feats_pipeline():
    nlp = spacy.blank("en")
    nlp.add_pipe("test_zones_feats_lookup")
    nlp.add_pipe("attribute_ruler")  # scores pos, morph and lemma
    return nlp


def write_feats_dev(tmp_path):
    path = tmp_path / "dev.spacy"
    DocBin(docs=feats_docs(spacy.blank("en"), 30, seed=5)).to_disk(path)
    return path


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_analyses_first_met_in_an_earlier_zone_keep_their_strings(tmp_path):
    """A gold analysis of an earlier zone (its string a .spacy doc's own, transient in
    that zone) stays in spaCy's morphology table, which has no zones, while the zone
    took its string: a component setting it by string in a later zone, then reading
    `token.morph`, raised E018 (so did spaCy's rule lemmatizer). Now the zones keep
    the strings of the analyses they met: the scores are `nlp.evaluate`'s."""
    path = write_feats_dev(tmp_path)
    nlp = feats_pipeline()
    expected = without_speed(nlp.evaluate(list(read_examples(nlp, [path])), batch_size=1))
    assert 0 < expected["morph_acc"] < 1
    nlp = feats_pipeline()
    evaluator = evaluator_for(nlp, batch_size=1, window_size=1)
    got = evaluator.run(read_examples(nlp, [path])).result()
    assert evaluator.zones is not None and evaluator.zones.n_zones > 20
    assert_scores_equal(without_speed(got), expected)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_resume_keeps_the_strings_of_the_analyses_it_skips(tmp_path):
    """The examples a resume skips are read in zones too: the per-feature scorer met
    their analyses later, set by a component that reads none, without their strings
    (E018). Now: `nlp.evaluate` of the rest."""
    path = write_feats_dev(tmp_path)

    def setter_pipeline():
        nlp = spacy.blank("en")
        nlp.add_pipe("test_zones_feats_setter")
        nlp.add_pipe("attribute_ruler")
        return nlp

    nlp = setter_pipeline()
    expected = without_speed(nlp.evaluate(list(read_examples(nlp, [path]))[6:], batch_size=1))
    nlp = setter_pipeline()  # a vocab without the file's strings
    evaluator = evaluator_for(nlp, batch_size=1, window_size=1)
    got = evaluator.run(read_examples(nlp, [path]), skip=6).result()
    assert_scores_equal(without_speed(got), expected)


class _HoldsNothing:
    def holds_docs(self):
        return False


@pytest.mark.parametrize("feats", [{"Foo": "a=b"}, {"Foo": "a|b"}, {"Note": "x,y"}])
def test_a_zone_ends_after_analyses_of_any_value(feats):
    """An analysis whose value holds "=" or "|" (legal, set by dict) made the zone's
    end raise while reading its features, and left the zone open for good (every
    later string transient, no later zone). Read leniently now; the analysis is kept."""
    nlp = spacy.blank("en")
    zones = MemoryZones(nlp, _HoldsNothing())
    zones.open()
    doc = nlp.make_doc("hello world")
    doc[0].set_morph(feats)
    analysis = str(doc[0].morph)
    zones.note([Example(doc, doc.copy())])
    zones.close()
    assert not nlp.vocab.in_memory_zone
    assert analysis in nlp.vocab.strings


def test_a_zone_ends_even_where_keeping_its_analyses_fails(monkeypatch):
    nlp = spacy.blank("en")
    zones = MemoryZones(nlp, _HoldsNothing())
    zones.open()

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(zones, "_morph_strings", broken)
    with pytest.raises(RuntimeError):
        zones.close()
    assert not nlp.vocab.in_memory_zone
