"""The streaming evaluation loop: parity with `nlp.evaluate`, bounded memory,
out-of-memory back-off, checkpoints, and the `[nlp.after_pipeline_creation]` callback."""

import functools
import gc
import json
import re
import tracemalloc
import warnings

import pytest
import spacy
import srsly
from spacy.language import Language
from spacy.training import Example
from spacy.util import minibatch

from spacy_lean import synthetic
from spacy_lean.streaming import (
    CALLBACK_NAME,
    CheckpointMismatchError,
    EvalCheckpoint,
    StreamingEvaluator,
    evaluate,
    install_streaming_evaluate,
    is_streaming,
    make_streaming_evaluate_v1,
    make_strip_streaming_evaluate_v1,
)

import eval_util  # noqa: E402
from eval_util import add_ruler, record_evaluators, trim_policy  # noqa: E402

# "speed" is a timing: only checked to be there.
assert_same_scores = functools.partial(eval_util.assert_same_scores, speed="present")

torch = pytest.importorskip("torch")


def fresh_examples(nlp, docs):
    return [Example(nlp.make_doc(d.text), d) for d in docs]


@pytest.fixture(scope="module")
def gold_docs():
    return synthetic.make_ner_docs(spacy.blank("en"), 30, seed=11, long_doc_rate=0.1)


@pytest.mark.parametrize("window_size", [None, 0])
def test_parity_with_nlp_evaluate(trf_ner_nlp, gold_docs, window_size):
    expected = trf_ner_nlp.evaluate(fresh_examples(trf_ner_nlp, gold_docs), batch_size=4)
    assert expected["ents_per_type"]
    ours = evaluate(
        trf_ner_nlp, fresh_examples(trf_ner_nlp, gold_docs), batch_size=4, window_size=window_size
    )
    assert_same_scores(ours, expected)


def test_parity_with_nonzero_scores(trf_ner_nlp, gold_docs):
    nlp = add_ruler(trf_ner_nlp)
    expected = nlp.evaluate(fresh_examples(nlp, gold_docs), batch_size=4)
    assert 0 < expected["ents_p"] < 1 and 0 < expected["ents_r"] < 1
    ours = evaluate(nlp, fresh_examples(nlp, gold_docs), batch_size=4, window_size=8)
    assert_same_scores(ours, expected)
    assert_same_scores(
        evaluate(nlp, fresh_examples(nlp, gold_docs), batch_size=3, per_component=True),
        nlp.evaluate(fresh_examples(nlp, gold_docs), per_component=True),
    )


def test_parity_per_component_and_generator(trf_ner_nlp, gold_docs):
    expected = trf_ner_nlp.evaluate(fresh_examples(trf_ner_nlp, gold_docs), per_component=True)
    stream = (eg for eg in fresh_examples(trf_ner_nlp, gold_docs))
    ours = evaluate(trf_ner_nlp, stream, per_component=True, batch_size=3)
    assert_same_scores(ours, expected)
    assert list(ours)[-1] == "speed"


@pytest.mark.parametrize("as_str", [True, False])
def test_a_path_is_read_like_spacy_evaluate(trf_ner_nlp, gold_docs, tmp_path, as_str):
    from spacy.tokens import DocBin
    from spacy.training import Corpus

    nlp = add_ruler(trf_ner_nlp)
    path = tmp_path / "dev.spacy"
    DocBin(docs=gold_docs).to_disk(path)
    expected = nlp.evaluate(list(Corpus(path)(nlp)), batch_size=4)
    assert 0 < expected["ents_f"] < 1
    ours = evaluate(nlp, str(path) if as_str else tmp_path, batch_size=4)
    assert_same_scores(ours, expected)


def test_parity_with_scorer_cfg_and_scorer(trf_ner_nlp, gold_docs):
    from spacy.scorer import Scorer

    egs = fresh_examples(trf_ner_nlp, gold_docs)
    expected = trf_ner_nlp.evaluate(egs, scorer=Scorer(nlp=trf_ner_nlp))
    assert_same_scores(evaluate(trf_ner_nlp, egs, scorer=Scorer(nlp=trf_ner_nlp)), expected)


def test_empty_examples_like_spacy(trf_ner_nlp):
    expected = trf_ner_nlp.evaluate([])
    assert_same_scores(evaluate(trf_ner_nlp, []), expected)


def test_does_not_mutate_callers_examples(trf_ner_nlp, gold_docs):
    examples = fresh_examples(trf_ner_nlp, gold_docs[:6])
    predicted = [eg.predicted for eg in examples]
    evaluate(trf_ner_nlp, examples, batch_size=2)
    for eg, doc in zip(examples, predicted):
        assert eg.predicted is doc
        assert len(doc.ents) == 0
        assert doc._.trf_data is None


def test_validates_examples_like_spacy(trf_ner_nlp):
    with pytest.raises(TypeError, match="Language.evaluate"):
        evaluate(trf_ner_nlp, 42)
    with pytest.raises(TypeError, match="Language.evaluate"):
        evaluate(trf_ner_nlp, ["not an example"])
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        evaluate(trf_ner_nlp, [], batch_size=0)


def _peak_bytes(run):
    gc.collect()
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _tiled_stream(nlp, texts_and_docs, times):
    """A generator of `times` x the same gold docs (fresh Examples each time): the
    same doc lengths whatever the size, so only the count of examples changes."""
    for _ in range(times):
        for doc in texts_and_docs:
            yield Example(nlp.make_doc(doc.text), doc)


def test_peak_memory_does_not_grow_with_the_number_of_examples(trf_ner_nlp):
    nlp = trf_ner_nlp
    docs = synthetic.make_ner_docs(nlp, 12, seed=21, long_doc_rate=0.0)
    evaluate(nlp, _tiled_stream(nlp, docs, 1), batch_size=4)  # warm up caches and vocab
    nlp.evaluate(list(_tiled_stream(nlp, docs, 1)), batch_size=4)

    def streaming(times):
        return _peak_bytes(
            lambda: evaluate(nlp, _tiled_stream(nlp, docs, times), batch_size=4, window_size=4)
        )

    def stock(times):
        return _peak_bytes(lambda: nlp.evaluate(_tiled_stream(nlp, docs, times), batch_size=4))

    small, large = streaming(1), streaming(4)
    stock_small, stock_large = stock(1), stock(4)
    # The measurement sees growth where there is some: the stock loop keeps every doc.
    assert stock_large > 2.5 * stock_small, (stock_small, stock_large)
    assert large < 1.1 * small, (small, large)


@Language.factory("test_oom_above", default_config={"max_docs": 2, "count_empty": True})
def make_oom_above(nlp, name, max_docs, count_empty):
    return OOMAbove(max_docs, count_empty)


class OOMAbove:
    """Raises torch's CUDA out-of-memory error for batches larger than `max_docs`
    (`count_empty`: empty docs count), like a GPU component whose activations outgrow
    the device."""

    def __init__(self, max_docs, count_empty=True):
        self.max_docs = max_docs
        self.count_empty = count_empty
        self.batch_sizes = []

    def __call__(self, doc):
        return doc

    def pipe(self, docs, batch_size=128):
        for batch in minibatch(docs, batch_size):
            if sum(1 for doc in batch if self.count_empty or len(doc)) > self.max_docs:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (batch of {len(batch)})")
            self.batch_sizes.append(len(batch))
            yield from batch


@pytest.fixture(scope="module")
def textcat_nlp():
    """A multilabel textcat: spaCy's gives the docs of a batch of empty docs only
    zeros, and an empty doc batched with others its model's output."""
    nlp = spacy.blank("en")
    textcat = nlp.add_pipe("textcat_multilabel")
    for label in ("A", "B"):
        textcat.add_label(label)
    nlp.initialize()
    return nlp


def _empty_doc_examples(nlp, pattern):
    """Examples whose docs are empty where `pattern` has 0, with gold cats."""
    words = "the cat sat on a mat while it rained".split()
    examples = []
    for i, n in enumerate(pattern):
        reference = nlp.make_doc(" ".join(words[(i + k) % len(words)] for k in range(n)))
        reference.cats = {"A": float(i % 3 == 0), "B": float(i % 2 == 0)}
        examples.append(Example(nlp.make_doc(reference.text), reference))
    return examples


@pytest.mark.parametrize(
    "pattern",
    [
        [4, 0, 2, 0, 6, 0, 0, 1, 0, 3, 0, 0, 0, 0, 5, 0, 2],
        [0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2],
        [0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ],
)
def test_empty_docs_are_piped_as_nlp_evaluate_pipes_them(textcat_nlp, pattern):
    """Sorted by length, a window's empty docs made batches of their own, where spaCy's
    textcat gives zeros: with every other doc empty, cats_score was 0.5 against
    nlp.evaluate's 0.83. Now an empty doc is piped with a non-empty one, unless
    nlp.evaluate's batch of it holds empty docs only, at any batch size, window and
    token budget (a window ending in empty docs takes those after them in that
    batch, to know)."""
    differs = 0
    for batch_size in (1, 2, 3, 4, 5):
        expected = textcat_nlp.evaluate(
            _empty_doc_examples(textcat_nlp, pattern), batch_size=batch_size
        )
        for window_size in (None, 0, 2, 3, 7):
            for budget in (None, 6):
                ours = evaluate(
                    textcat_nlp,
                    _empty_doc_examples(textcat_nlp, pattern),
                    batch_size=batch_size,
                    window_size=window_size,
                    max_batch_tokens=budget,
                )
                assert_same_scores(ours, expected)
        whole = textcat_nlp.evaluate(
            _empty_doc_examples(textcat_nlp, pattern), batch_size=len(pattern)
        )
        differs += dict(expected, speed=0) != dict(whole, speed=0)
    assert differs  # the batches of empty docs matter: the test can tell


@pytest.mark.parametrize("max_docs", [1, 2])
def test_an_oom_retry_keeps_empty_docs_with_a_non_empty_one(textcat_nlp, max_docs):
    """A batch halved after running out of memory could leave a half of empty docs only
    (spaCy's textcat: zeros). Each half with empty docs keeps a non-empty doc; one alone
    runs out of memory by itself, and the empty docs get a 1-token doc for company."""
    pattern = [4, 0, 2, 0, 6, 0, 0, 1, 0, 3, 0, 0, 0, 0, 5, 0, 2]
    expected = textcat_nlp.evaluate(_empty_doc_examples(textcat_nlp, pattern), batch_size=8)
    textcat_nlp.add_pipe("test_oom_above", config={"max_docs": max_docs, "count_empty": False})
    try:
        with pytest.warns(ResourceWarning, match="Out of GPU memory"):
            ours = evaluate(textcat_nlp, _empty_doc_examples(textcat_nlp, pattern), batch_size=8)
    finally:
        textcat_nlp.remove_pipe("test_oom_above")
    assert_same_scores(ours, expected)


def test_oom_halves_the_batch_and_retries(trf_ner_nlp, gold_docs):
    expected = trf_ner_nlp.evaluate(fresh_examples(trf_ner_nlp, gold_docs), batch_size=8)
    oom = trf_ner_nlp.add_pipe("test_oom_above", config={"max_docs": 3})
    evaluator = StreamingEvaluator(trf_ner_nlp, batch_size=8, window_size=0)
    with pytest.warns(ResourceWarning, match="Out of GPU memory on a batch of 8 docs"):
        evaluator.run(fresh_examples(trf_ner_nlp, gold_docs))
    assert evaluator.oom_events[:2] == [(8, 4), (4, 2)]
    assert evaluator.batch_size == 2
    assert max(oom.batch_sizes) <= 3
    assert sum(oom.batch_sizes) == len(gold_docs)  # every doc scored once
    assert_same_scores(evaluator.state.result(), expected)


def _record_batches(nlp):
    """Add a pass-through component that records the doc lengths of each batch."""
    recorder = nlp.add_pipe("test_oom_above", config={"max_docs": 10**6})
    batches = []
    real_pipe = recorder.pipe
    recorder.pipe = lambda docs, batch_size=128: (
        batches.append([len(d) for d in docs]) or real_pipe(docs, batch_size)
    )
    return batches


@pytest.mark.parametrize("window_size", [None, 0])
def test_batches_and_windows_respect_the_token_budget(trf_ner_nlp, gold_docs, window_size):
    expected = trf_ner_nlp.evaluate(fresh_examples(trf_ner_nlp, gold_docs), batch_size=4)
    lengths = [len(d) for d in gold_docs]
    budget = 100
    over = [n for n in lengths if n > budget]
    assert over and max(lengths) > 2 * budget  # some docs alone exceed the budget
    batches = _record_batches(trf_ner_nlp)
    evaluator = StreamingEvaluator(
        trf_ner_nlp, batch_size=6, window_size=window_size, max_batch_tokens=budget
    )
    assert evaluator.max_batch_tokens == budget
    windows = []
    evaluator.run(
        fresh_examples(trf_ner_nlp, gold_docs),
        on_window=lambda ev: windows.append(ev.n_examples),
    )
    assert sorted(n for batch in batches for n in batch) == sorted(lengths)  # each doc once
    assert all(len(batch) <= 6 for batch in batches)
    assert all(len(batch) == 1 or len(batch) * max(batch) <= budget for batch in batches)
    assert sorted(n for batch in batches if len(batch) == 1 for n in batch)[-len(over) :] == sorted(
        over
    )
    assert any(len(batch) > 1 for batch in batches)
    # Windows: consecutive runs of the input, within the window's token budget.
    bounds = [0] + windows
    assert bounds[-1] == len(gold_docs)
    for start, end in zip(bounds, bounds[1:]):
        assert end - start <= evaluator.window_size
        assert end - start == 1 or sum(lengths[start:end]) <= evaluator.window_tokens
    assert evaluator.window_tokens == -(-evaluator.window_size // 6) * budget
    assert_same_scores(evaluator.state.result(), expected)


def test_one_doc_over_the_budget_is_evaluated_alone(trf_ner_nlp, gold_docs):
    longest = max(gold_docs, key=len)
    docs = [gold_docs[0], longest, gold_docs[1]]
    expected = trf_ner_nlp.evaluate(fresh_examples(trf_ner_nlp, docs))
    batches = _record_batches(trf_ner_nlp)
    budget = len(longest) - 1
    ours = evaluate(trf_ner_nlp, fresh_examples(trf_ner_nlp, docs), max_batch_tokens=budget)
    assert [len(longest)] in batches
    assert sorted(n for batch in batches for n in batch) == sorted(len(d) for d in docs)
    assert_same_scores(ours, expected)


def test_default_budget_comes_from_the_transformer(trf_ner_nlp):
    from spacy_lean.streaming import DEFAULT_MAX_BATCH_TOKENS, resolve_max_batch_tokens

    trf = trf_ner_nlp.get_pipe("transformer")
    trf.cfg["max_batch_items"] = 1000
    assert resolve_max_batch_tokens(trf_ner_nlp) == 1000
    assert StreamingEvaluator(trf_ner_nlp).window_tokens == 8 * 1000
    assert resolve_max_batch_tokens(trf_ner_nlp, 77) == 77
    assert resolve_max_batch_tokens(spacy.blank("en")) == DEFAULT_MAX_BATCH_TOKENS


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bad_window_is_refused_when_the_callback_is_made(bad):
    """A negative window_size passed the config and failed at the first evaluation, in
    `spacy train` after the first eval_frequency steps."""
    from spacy_lean.training.callbacks import make_lean_training_v1

    with pytest.raises(ValueError, match=f"window_size must be >= 0, got {bad}"):
        make_streaming_evaluate_v1(window_size=bad)
    with pytest.raises(
        ValueError, match=f"lean_training.v1: eval_window_size must be >= 0, got {bad}"
    ):
        make_lean_training_v1(eval_window_size=bad)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "4096", True])
def test_bad_budget_is_a_clear_error(trf_ner_nlp, bad):
    with pytest.raises(ValueError, match=f"max_batch_tokens must be .* got {bad!r}"):
        evaluate(trf_ner_nlp, [], max_batch_tokens=bad)
    with pytest.raises(ValueError, match="max_batch_tokens must be"):
        make_streaming_evaluate_v1(max_batch_tokens=bad)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "4096", True])
def test_lean_training_eval_budget_is_checked_like_the_streaming_callbacks(bad):
    """`eval_max_batch_tokens` of spacy-lean.lean_training.v1 is refused as
    `max_batch_tokens` of spacy-lean.streaming_evaluate.v1 is, when the config is
    resolved (not at the first evaluation)."""
    from spacy.util import registry

    from spacy_lean.training.callbacks import make_lean_training_v1

    message = f"lean_training.v1: eval_max_batch_tokens must be .* got {re.escape(repr(bad))}"
    with pytest.raises(ValueError, match=message):
        make_lean_training_v1(eval_max_batch_tokens=bad)
    if isinstance(bad, str):  # the config's type check reads "4096" as 4096
        return
    cfg = {"cb": {"@callbacks": "spacy-lean.lean_training.v1", "eval_max_batch_tokens": bad}}
    # Whole numbers < 1 by our check; the rest by the config's type check (Optional[int]).
    expected = "max_batch_tokens must be" if type(bad) is int else "eval_max_batch_tokens"
    with pytest.raises(ValueError, match=expected):
        registry.resolve(cfg)


@pytest.mark.parametrize(
    "setting",
    [("eval_window_size", 4), ("eval_max_batch_tokens", 64), ("eval_trim_slack_mb", None)],
)
def test_lean_training_eval_settings_without_streaming_evaluate_are_refused(setting):
    """With streaming_evaluate = false nothing would take the eval_* settings: refused
    when the config is resolved, naming them and the fix, not silently ignored."""
    from spacy.util import registry

    name, value = setting
    cfg = {"cb": {"@callbacks": "spacy-lean.lean_training.v1", "streaming_evaluate": False}}
    registry.resolve(cfg)  # the defaults are fine
    cfg["cb"][name] = value
    with pytest.raises(ValueError, match=f"{name} set .* streaming_evaluate = true, or remove"):
        registry.resolve(cfg)


def test_oom_on_a_single_doc_is_raised(trf_ner_nlp, gold_docs):
    trf_ner_nlp.add_pipe("test_oom_above", config={"max_docs": 0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            evaluate(trf_ner_nlp, fresh_examples(trf_ner_nlp, gold_docs[:3]), batch_size=2)


class Interrupt(Exception):
    pass


def _interrupted(examples, after):
    for i, eg in enumerate(examples):
        if i == after:
            raise Interrupt()
        yield eg


def test_interrupted_and_resumed_equals_uninterrupted(trf_ner_nlp, gold_docs, tmp_path):
    nlp = trf_ner_nlp
    expected = evaluate(nlp, fresh_examples(nlp, gold_docs), batch_size=4)
    ckpt = EvalCheckpoint(
        tmp_path / "ckpt.json", model_fingerprint="m", data_fingerprint="d", every=2
    )
    first = StreamingEvaluator(nlp, batch_size=4, window_size=0)  # a window is a batch
    with pytest.raises(Interrupt):
        first.run(_interrupted(fresh_examples(nlp, gold_docs), 19), on_window=ckpt.on_window)
    assert ckpt.n_saves == 2
    ckpt2 = EvalCheckpoint(
        tmp_path / "ckpt.json", model_fingerprint="m", data_fingerprint="d", every=2
    )
    second = StreamingEvaluator(nlp, batch_size=4, window_size=0)
    resumed = ckpt2.load(nlp, second.state.fingerprint)
    assert resumed["n_examples"] == 16 and not resumed["done"]
    second = StreamingEvaluator(nlp, batch_size=4, window_size=8, state=resumed["state"])
    second.run(fresh_examples(nlp, gold_docs), skip=resumed["n_examples"])
    assert second.n_examples == len(gold_docs)
    assert_same_scores(second.state.result(), expected)


def test_checkpoint_refuses_other_model_or_data(trf_ner_nlp, tmp_path):
    nlp = trf_ner_nlp
    state = StreamingEvaluator(nlp).state
    EvalCheckpoint(tmp_path / "c.json", model_fingerprint="m", data_fingerprint="d").save(
        state, n_examples=3
    )
    with pytest.raises(CheckpointMismatchError, match="another model"):
        EvalCheckpoint(tmp_path / "c.json", model_fingerprint="x", data_fingerprint="d").load(
            nlp, state.fingerprint
        )
    with pytest.raises(CheckpointMismatchError, match="other data"):
        EvalCheckpoint(tmp_path / "c.json", model_fingerprint="m", data_fingerprint="x").load(
            nlp, state.fingerprint
        )
    with pytest.raises(CheckpointMismatchError, match="scorer"):
        EvalCheckpoint(tmp_path / "c.json", model_fingerprint="m", data_fingerprint="d").load(
            nlp, "other"
        )
    # One process against work units: named as a layout, not as a number of workers.
    with pytest.raises(CheckpointMismatchError, match="another layout of the work"):
        EvalCheckpoint(
            tmp_path / "c.json", model_fingerprint="m", data_fingerprint="d", layout="units:2"
        ).load(nlp, state.fingerprint)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(CheckpointMismatchError, match="not a spacy-lean evaluation checkpoint"):
        EvalCheckpoint(tmp_path / "bad.json", model_fingerprint="m", data_fingerprint="d").load(
            nlp, "x"
        )
    # Fewer examples in the data than the checkpoint counted: other data.
    with pytest.raises(CheckpointMismatchError, match="has only 1"):
        StreamingEvaluator(nlp).run([Example(nlp.make_doc("a b"), nlp.make_doc("a b"))], skip=3)


def test_checkpoint_whose_state_cannot_be_restored_is_refused_with_its_path(trf_ner_nlp, tmp_path):
    # Written by another spacy-lean version (another state format), one state per unit
    # (--workers) or one for the stream: refused when loaded, not a traceback later.
    nlp = trf_ner_nlp
    state = StreamingEvaluator(nlp).state
    path = tmp_path / "c.json"
    for units in (None, {0: {"state": state.to_dict(), "n_examples": 2}}):
        ckpt = EvalCheckpoint(path, model_fingerprint="m", data_fingerprint="d")
        ckpt.save(state, n_examples=2, units=units)
        data = srsly.read_json(path)
        if units is None:
            data["state"]["format"] = 99
        else:
            data["units"]["0"]["state"]["format"] = 99
        srsly.write_json(path, data)
        with pytest.raises(CheckpointMismatchError, match="could not be restored") as err:
            ckpt.load(nlp, state.fingerprint)
        assert str(path) in str(err.value) and "start over" in str(err.value)


def test_callback_makes_nlp_evaluate_streaming(trf_ner_nlp, gold_docs, monkeypatch):
    calls = []
    import spacy_lean.streaming as module

    real = module.evaluate
    monkeypatch.setattr(module, "evaluate", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    expected = trf_ner_nlp.evaluate(fresh_examples(trf_ner_nlp, gold_docs))
    nlp = make_streaming_evaluate_v1(window_size=0)(trf_ner_nlp)
    assert nlp is trf_ner_nlp and is_streaming(nlp)
    assert_same_scores(nlp.evaluate(fresh_examples(nlp, gold_docs), batch_size=5), expected)
    assert calls and calls[0]["batch_size"] == 5 and calls[0]["window_size"] == 0


def test_streaming_pipeline_still_pickles(trf_ner_nlp, gold_docs):
    # nlp.pipe(n_process=2) pickles the pipeline where processes are spawned (macOS,
    # Windows, forkserver); a pipeline made streaming must survive it, still streaming.
    import pickle

    nlp = make_streaming_evaluate_v1(window_size=0)(trf_ner_nlp)
    expected = nlp.evaluate(fresh_examples(nlp, gold_docs))
    copy = pickle.loads(pickle.dumps(nlp))
    assert is_streaming(copy)
    assert copy.evaluate.__doc__ == evaluate.__doc__
    assert_same_scores(copy.evaluate(fresh_examples(copy, gold_docs)), expected)


def test_strip_callback_removes_only_ours(trf_ner_nlp):
    nlp = install_streaming_evaluate(trf_ner_nlp)
    nlp.config["nlp"]["after_pipeline_creation"] = {
        "@callbacks": CALLBACK_NAME,
        "window_size": None,
    }
    make_strip_streaming_evaluate_v1()(nlp)
    assert nlp.config["nlp"]["after_pipeline_creation"] is None
    other = {"@callbacks": "someone.else.v1"}
    nlp.config["nlp"]["after_pipeline_creation"] = other
    make_strip_streaming_evaluate_v1()(nlp)
    assert nlp.config["nlp"]["after_pipeline_creation"] == other


TRAIN_OVERRIDES = {
    "training.max_steps": 4,
    "training.eval_frequency": 2,
    "nlp.after_pipeline_creation": {"@callbacks": CALLBACK_NAME, "window_size": None},
}


def _filled_config(config_text, tmp_path):
    from spacy.cli.init_config import fill_config

    base = tmp_path / "base.cfg"
    base.write_text(config_text)
    filled = tmp_path / "config.cfg"
    fill_config(filled, base, silent=True)
    return filled


@pytest.fixture
def recorded_streaming(monkeypatch):
    import spacy_lean.streaming as module

    calls = []
    real = module.evaluate

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "evaluate", recording)
    return calls


@pytest.fixture(scope="module")
def small_dev(tmp_path_factory):
    return synthetic.write_ner_corpus(
        tmp_path_factory.mktemp("small_dev") / "dev.spacy", 10, seed=7
    )


def test_spacy_train_and_spacy_evaluate_stream(
    trf_ner_config, ner_corpus, small_dev, tmp_path, recorded_streaming
):
    from spacy.cli.evaluate import evaluate as spacy_evaluate
    from spacy.cli.train import train
    from spacy.training import Corpus

    config_path = _filled_config(trf_ner_config, tmp_path)
    out = tmp_path / "out"
    overrides = {
        "paths.train": str(ner_corpus["train"]),
        "paths.dev": str(small_dev),
        **TRAIN_OVERRIDES,
    }
    train(config_path, out, overrides=overrides)
    assert len(recorded_streaming) >= 2  # the dev evaluations of `spacy train`
    saved = (out / "model-last" / "config.cfg").read_text()
    assert CALLBACK_NAME in saved
    nlp = spacy.load(out / "model-last")
    assert is_streaming(nlp)
    n_calls = len(recorded_streaming)
    scores = spacy_evaluate(str(out / "model-last"), small_dev)
    assert len(recorded_streaming) == n_calls + 1  # `spacy evaluate` streamed
    stock = Language.evaluate(nlp, list(Corpus(small_dev)(nlp)))
    assert_same_scores(scores, stock)


def test_strip_callback_saves_a_portable_pipeline(trf_ner_nlp, tmp_path):
    nlp = make_streaming_evaluate_v1()(trf_ner_nlp)
    nlp.config["nlp"]["after_pipeline_creation"] = {
        "@callbacks": CALLBACK_NAME,
        "window_size": None,
    }
    nlp.to_disk(tmp_path / "with")
    assert is_streaming(spacy.load(tmp_path / "with"))
    # What `spacy train` does with `[training.before_to_disk]` set to the strip callback.
    make_strip_streaming_evaluate_v1()(nlp).to_disk(tmp_path / "without")
    assert CALLBACK_NAME not in (tmp_path / "without" / "config.cfg").read_text()
    assert not is_streaming(spacy.load(tmp_path / "without"))


def test_checkpoint_file_is_json(trf_ner_nlp, tmp_path):
    state = StreamingEvaluator(trf_ner_nlp).state
    ckpt = EvalCheckpoint(tmp_path / "c.json", model_fingerprint="m", data_fingerprint="d")
    ckpt.save(state, n_examples=0, done=True)
    data = srsly.read_json(tmp_path / "c.json")
    assert data["format"] == "spacy-lean.eval-checkpoint.v1" and data["done"] is True
    assert not (tmp_path / "c.json.tmp").exists()


def _save_points(ckpt, saved):
    """An on_window hook that records the state's seconds and words at each save."""

    def on_window(ev):
        before = ckpt.n_saves
        ckpt.on_window(ev)
        if ckpt.n_saves > before:
            saved.append((ev.state.seconds, ev.state.n_words))

    return on_window


def test_checkpoint_round_trip_keeps_floats_exactly(trf_ner_nlp, gold_docs, tmp_path):
    # The resumed state's timing (and so its speed) is the one saved, to the last bit;
    # a plain float field in the file (here an extra one in a unit) too: written with
    # Python's json, not srsly (which keeps 10 digits: 1/3 would read 0.3333333333).
    nlp = trf_ner_nlp
    path = tmp_path / "ckpt.json"
    ckpt = EvalCheckpoint(path, model_fingerprint="m", data_fingerprint="d", every=2)
    first = StreamingEvaluator(nlp, batch_size=4, window_size=0)
    saved = []
    with pytest.raises(Interrupt):
        first.run(
            _interrupted(fresh_examples(nlp, gold_docs), 19), on_window=_save_points(ckpt, saved)
        )
    seconds, n_words = saved[-1]
    resumed = EvalCheckpoint(path, model_fingerprint="m", data_fingerprint="d").load(
        nlp, first.state.fingerprint
    )
    assert resumed["state"].seconds == seconds and resumed["state"].n_words == n_words
    assert resumed["state"].speed == n_words / seconds
    assert resumed["state"].result()["speed"] == n_words / seconds

    state = StreamingEvaluator(nlp).state
    state.add_speed(10, 0.1 + 0.2)
    units = {0: {"state": state.to_dict(), "n_examples": 2, "extra": 1 / 3}}
    ckpt.save(state, units=units)
    assert json.loads(path.read_text())["units"]["0"]["extra"] == 1 / 3
    resumed = ckpt.load(nlp, state.fingerprint)
    assert resumed["units"][0]["extra"] == 1 / 3
    restored = resumed["units"][0]["state"]
    assert restored == state.to_dict() and float.fromhex(restored["seconds"]) == 0.1 + 0.2


def test_checkpoint_written_by_srsly_still_resumes(trf_ner_nlp, gold_docs, tmp_path):
    # spacy-lean before this version wrote the file with srsly.json_dumps: still read.
    nlp = trf_ner_nlp
    expected = evaluate(nlp, fresh_examples(nlp, gold_docs), batch_size=4)
    path = tmp_path / "ckpt.json"
    ckpt = EvalCheckpoint(path, model_fingerprint="m", data_fingerprint="d", every=2)
    first = StreamingEvaluator(nlp, batch_size=4, window_size=0)
    saved = []
    with pytest.raises(Interrupt):
        first.run(
            _interrupted(fresh_examples(nlp, gold_docs), 19), on_window=_save_points(ckpt, saved)
        )
    path.write_text(srsly.json_dumps(json.loads(path.read_text())), encoding="utf8")
    assert "\n" not in path.read_text() and srsly.read_json(path)["n_examples"] == 16
    resumed = EvalCheckpoint(path, model_fingerprint="m", data_fingerprint="d").load(
        nlp, first.state.fingerprint
    )
    assert resumed["n_examples"] == 16 and resumed["state"].seconds == saved[-1][0]
    second = StreamingEvaluator(nlp, batch_size=4, window_size=8, state=resumed["state"])
    second.run(fresh_examples(nlp, gold_docs), skip=resumed["n_examples"])
    assert second.n_examples == len(gold_docs)
    assert_same_scores(second.state.result(), expected)


def _checkpoint_data(nlp, tmp_path, units=False):
    state = StreamingEvaluator(nlp).state
    state.add_speed(5, 0.25)
    path = tmp_path / "c.json"
    ckpt = EvalCheckpoint(path, model_fingerprint="m", data_fingerprint="d")
    ckpt.save(
        state,
        n_examples=3,
        units={0: {"state": state.to_dict(), "n_examples": 3}} if units else None,
    )
    return ckpt, state, json.loads(path.read_text())


@pytest.mark.parametrize(
    "where,value,field,shown",
    [
        ("n_examples", float("nan"), "n_examples", "NaN"),
        ("n_batches", float("inf"), "n_batches", "Infinity"),
        ("state.seconds", float("-inf"), "state.seconds", "-Infinity"),
        ("state.seconds", "nan", "state.seconds", "nan"),  # hex strings: valid JSON
        ("state.seconds", "inf", "state.seconds", "inf"),
        ("state.seconds", "-0x1p+0", "state.seconds", "-1.0"),
        ("units.0.state.seconds", "nan", "units.0.state.seconds", "nan"),
        ("units.0.n_examples", float("nan"), "units.0.n_examples", "NaN"),
        ("units.0.empty_docs", float("nan"), "units.0.empty_docs", "NaN"),
    ],
)
def test_checkpoint_with_a_non_finite_number_is_refused_naming_the_field(
    trf_ner_nlp, tmp_path, where, value, field, shown
):
    # Strict JSON has no NaN or Infinity: spacy-lean never writes them, and a file that
    # holds them (Python's json would read them) is refused, as is a non-finite or
    # negative time in a score state (its speed would be NaN, and --output would fail).
    ckpt, state, data = _checkpoint_data(trf_ner_nlp, tmp_path, units=where.startswith("units"))
    *parents, key = where.split(".")
    target = data
    for part in parents:
        target = target[part]
    target[key] = value
    ckpt.path.write_text(json.dumps(data), encoding="utf8")  # allow_nan: writes NaN
    with pytest.raises(CheckpointMismatchError) as err:
        ckpt.load(trf_ner_nlp, state.fingerprint)
    text = str(err.value)
    assert str(ckpt.path) in text and f"{field} = {shown}" in text and "start over" in text


def test_checkpoint_save_refuses_a_non_finite_float_and_keeps_the_last_save(trf_ner_nlp, tmp_path):
    ckpt, state, _ = _checkpoint_data(trf_ner_nlp, tmp_path)
    before = ckpt.path.read_text()
    units = {0: {"state": state.to_dict(), "n_examples": 3, "extra": float("nan")}}
    with pytest.raises(ValueError, match=r"units\.0\.extra = nan.*strict JSON"):
        ckpt.save(state, units=units)
    assert ckpt.path.read_text() == before and not ckpt.path.with_name("c.json.tmp").exists()


@pytest.mark.parametrize(
    "change,field,shown",
    [
        ({"n_examples": -1}, "n_examples", "-1"),
        ({"n_examples": "3"}, "n_examples", "'3'"),
        ({"n_batches": 2.5}, "n_batches", "2.5"),
        ({"n_batches": True}, "n_batches", "True"),
        ({"done": "yes"}, "done", "'yes'"),
        ({"state": [1, 2]}, "state", "[1, 2]"),
        ({"units": [1]}, "units", "[1]"),
        ({"units": {"x": {}}}, "units key 'x'", "'x'"),
        ({"units": {"0": {"n_examples": 1}}}, "units.0", "{'n_examples': 1}"),
        ({"format": "x" * 200}, "'format'", "'xxx"),
    ],
)
def test_damaged_checkpoint_names_the_file_field_value_and_fix(
    trf_ner_nlp, tmp_path, change, field, shown
):
    ckpt, state, data = _checkpoint_data(trf_ner_nlp, tmp_path)
    data.update(change)
    ckpt.path.write_text(json.dumps(data), encoding="utf8")
    with pytest.raises(CheckpointMismatchError) as err:
        ckpt.load(trf_ner_nlp, state.fingerprint)
    text = str(err.value)
    assert str(ckpt.path) in text and field in text and shown in text
    assert "start over" in text and len(text) < 400  # a long value is cut short


def _ner_entry(data):
    return dict(data["state"]["components"])["ner"]


_NER = "state.components.ner."


@pytest.mark.parametrize(
    "edit,field,shown,expected",
    [
        (
            lambda d: _ner_entry(d)["per_type"][0].__setitem__(1, -500),
            "per_type[0][1]",
            "-500",
            ">= 0",
        ),
        (
            lambda d: _ner_entry(d)["per_type"][0].__setitem__(3, 1.5),
            "per_type[0][3]",
            "1.5",
            ">= 0",
        ),
        (
            lambda d: _ner_entry(d)["per_type"][0].__setitem__(0, None),
            "per_type[0][0]",
            "None",
            "label",
        ),
        # A row added at the end (index n): a label listed twice, a row of 3 values.
        (
            lambda d: _ner_entry(d)["per_type"].append(list(_ner_entry(d)["per_type"][0])),
            "per_type[",
            "",
            "a label not listed before",
        ),
        (lambda d: _ner_entry(d)["per_type"].append(["X", 10**9, 0]), "per_type[", "", "list of 4"),
        (lambda d: d["state"].__setitem__("n_words", -3), "n_words", "-3", ">= 0"),
        (lambda d: d["state"].__setitem__("n_examples", True), "n_examples", "True", ">= 0"),
        (
            lambda d: dict(d["state"]["components"])["tokenizer"].__setitem__("acc", [1, 2]),
            "tokenizer.acc",
            "",
            "list of 3",
        ),
    ],
)
def test_edited_counts_in_a_checkpoint_are_refused_naming_the_field(
    trf_ner_nlp, gold_docs, tmp_path, edit, field, shown, expected
):
    """Each count and label of a saved score state is checked as it is restored: an
    edited true-positive count of -500 resumed to an F-score of -7.6, with exit 0."""
    evaluator = StreamingEvaluator(trf_ner_nlp)
    examples = fresh_examples(trf_ner_nlp, gold_docs[:6])
    for eg, doc in zip(examples, trf_ner_nlp.pipe(eg.predicted for eg in examples)):
        eg.predicted = doc
    evaluator.state.update(examples)
    ckpt = EvalCheckpoint(tmp_path / "c.json", model_fingerprint="m", data_fingerprint="d")
    ckpt.save(evaluator.state, n_examples=6)
    data = json.loads(ckpt.path.read_text())
    assert _ner_entry(data)["per_type"], "the state must hold an entity type to edit"
    ckpt.load(trf_ner_nlp, evaluator.state.fingerprint)  # as saved: restored
    edit(data)
    ckpt.path.write_text(json.dumps(data), encoding="utf8")
    with pytest.raises(CheckpointMismatchError) as err:
        ckpt.load(trf_ner_nlp, evaluator.state.fingerprint)
    text = str(err.value)
    where = {"tokenizer.acc": "state.components.tokenizer.acc"}.get(field)
    where = where or (_NER + field if field.startswith("per_type") else "state." + field)
    assert str(ckpt.path) in text and f"has {where}" in text and expected in text, text
    assert f"= {shown}" in text and "edited or damaged" in text


def test_checkpoint_nested_too_deep_is_refused(trf_ner_nlp, tmp_path):
    ckpt, state, _ = _checkpoint_data(trf_ner_nlp, tmp_path)
    ckpt.path.write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}", encoding="utf8")
    with pytest.raises(CheckpointMismatchError, match="Could not read the checkpoint"):
        ckpt.load(trf_ner_nlp, state.fingerprint)


@pytest.mark.gpu
def test_parity_on_gpu(trf_ner_dir, gold_docs):
    from thinc.api import require_cpu, require_gpu

    require_gpu(0)
    try:
        nlp = spacy.load(trf_ner_dir)
        expected = nlp.evaluate(fresh_examples(nlp, gold_docs), batch_size=4)
        ours = evaluate(nlp, fresh_examples(nlp, gold_docs), batch_size=4)
        assert_same_scores(ours, expected)
    finally:
        # The CPU's ops and torch's CPU tensors again. (This called use_ops("numpy"),
        # a context manager, bare: it changed nothing, and the module's later tests ran
        # on the GPU's ops.)
        require_cpu()


def test_evaluation_leaves_the_global_random_state_alone(trf_ner_nlp, gold_docs):
    """spacy-transformers draws from `random` on every forward pass, so stock
    `nlp.evaluate` moves the global state by its number of batches (and with it every
    later training shuffle); the streaming evaluation leaves it where it was."""
    import random

    import numpy

    random.seed(3)
    numpy.random.seed(3)
    trf_ner_nlp.evaluate(fresh_examples(trf_ner_nlp, gold_docs), batch_size=2)
    assert random.random() != random.Random(3).random()  # stock moved it
    random.seed(3)
    numpy.random.seed(3)
    evaluate(trf_ner_nlp, fresh_examples(trf_ner_nlp, gold_docs), batch_size=2)
    assert random.random() == random.Random(3).random()
    assert numpy.random.random() == numpy.random.RandomState(3).random_sample()


def test_heap_is_trimmed_after_every_batch_unless_given_a_slack(trf_ner_nlp, gold_docs):
    """The flattest peak is the default: freed heap pages go back after every batch; a
    slack (`trim_slack_mb`) trims only past it, `trim_heap=False` never."""
    import sys

    from spacy_lean.memory import trim_host_memory

    if not sys.platform.startswith("linux") or not trim_host_memory():
        pytest.skip("needs glibc's malloc_trim")
    every = StreamingEvaluator(trf_ner_nlp, batch_size=2)
    every.run(fresh_examples(trf_ner_nlp, gold_docs))
    assert every.n_batches > 1 and every._trimmer.n_trims == every.n_batches
    slack = StreamingEvaluator(trf_ner_nlp, batch_size=2, trim_slack_mb=10_000)
    slack.run(fresh_examples(trf_ner_nlp, gold_docs))
    # The first batch trims and sets the level (resident memory right after it); nothing
    # grows 10 GB past it.
    assert slack._trimmer.n_trims == 1 and slack._trimmer.floor is not None
    never = StreamingEvaluator(trf_ner_nlp, batch_size=2, trim_heap=False)
    never.run(fresh_examples(trf_ner_nlp, gold_docs))
    assert never._trimmer.n_trims == 0
    scores = [
        {k: v for k, v in e.state.result().items() if k != "speed"} for e in (never, every, slack)
    ]
    assert scores[0] == scores[1] == scores[2]


def without_speed(scores):
    return {k: v for k, v in scores.items() if k != "speed"}


def needs_resident_memory():
    from spacy_lean.memory import resident_bytes

    if resident_bytes() is None:
        pytest.skip("a slack needs the resident memory (/proc/self/statm)")


def test_trim_slack_reaches_the_evaluator_from_evaluate_and_the_callback(
    trf_ner_nlp, gold_docs, monkeypatch
):
    """`evaluate(trim_slack_mb=...)` and the callback's `trim_slack_mb` (as a config
    gives it) build the evaluator with that policy: 0 trims after every batch, a slack
    only past it, None never; the scores are the same."""
    from spacy.util import registry

    needs_resident_memory()
    built = record_evaluators(monkeypatch)
    nlp = add_ruler(trf_ner_nlp)
    docs = gold_docs[:16]
    expected = without_speed(nlp.evaluate(fresh_examples(nlp, docs), batch_size=4))
    for slack, policy in ((0, (True, 0)), (10_000, (True, 10_000)), (None, (False, 0))):
        scores = evaluate(nlp, fresh_examples(nlp, docs), batch_size=4, trim_slack_mb=slack)
        assert without_speed(scores) == expected
        assert trim_policy(built[-1]) == policy
        # 0: after every batch; 10 GB: the first batch only (it sets the level); never: none.
        expected_trims = {0: built[-1].n_batches, 10_000: 1}.get(slack, 0)
        assert built[-1]._trimmer.n_trims == expected_trims
        cfg = {"cb": {"@callbacks": CALLBACK_NAME, "trim_slack_mb": slack}}
        registry.resolve(cfg)["cb"](nlp)
        assert without_speed(nlp.evaluate(fresh_examples(nlp, docs), batch_size=4)) == expected
        assert trim_policy(built[-1]) == policy
    assert built[-1].n_batches > 1
    # Left out of the config: after every batch, as before the setting existed.
    registry.resolve({"cb": {"@callbacks": CALLBACK_NAME}})["cb"](nlp)
    nlp.evaluate(fresh_examples(nlp, docs[:4]))
    assert trim_policy(built[-1]) == (True, 0)


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "16", True])
def test_bad_trim_slack_is_a_clear_error(trf_ner_nlp, bad):
    from spacy.util import registry

    from spacy_lean.training.callbacks import make_lean_training_v1

    message = f"trim_slack_mb must be a number of MB >= 0, got {re.escape(repr(bad))}"
    with pytest.raises(ValueError, match=message) as err:
        evaluate(trf_ner_nlp, [], trim_slack_mb=bad)
    assert "0 to trim the heap after every batch" in str(err.value)
    assert "null (None in Python) never to trim" in str(err.value)
    for make in (
        lambda: StreamingEvaluator(trf_ner_nlp, trim_slack_mb=bad),
        lambda: install_streaming_evaluate(trf_ner_nlp, trim_slack_mb=bad),
        lambda: make_streaming_evaluate_v1(trim_slack_mb=bad),
    ):
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(ValueError, match="lean_training.v1: eval_" + message):
        make_lean_training_v1(eval_trim_slack_mb=bad)
    if not isinstance(bad, (str, bool)):  # a config's own types: refused when resolved
        with pytest.raises(ValueError, match="trim_slack_mb must be"):
            registry.resolve({"cb": {"@callbacks": CALLBACK_NAME, "trim_slack_mb": bad}})


def test_spacy_lean_train_dev_evaluation_takes_the_callbacks_settings(
    trf_ner_nlp, gold_docs, monkeypatch
):
    """The training loop of `spacy lean train` builds its own evaluator: it takes the
    settings of the streaming evaluation the config's callback installed (either
    callback), the defaults without one; the dev scores are the same."""
    from spacy.util import registry

    from spacy_lean.streaming import resolve_max_batch_tokens
    from spacy_lean.training.dist import DistContext
    from spacy_lean.training.loop import make_distributed_evaluation

    needs_resident_memory()
    built = record_evaluators(monkeypatch)
    nlp = add_ruler(trf_ner_nlp)
    dev = gold_docs[:12]
    weights = {"ents_f": 1.0}
    results = []
    for callback, policy, window in (
        (None, (True, 0), True),
        ({"@callbacks": CALLBACK_NAME, "trim_slack_mb": None, "window_size": 0}, (False, 0), False),
        (
            {"@callbacks": "spacy-lean.lean_training.v1", "eval_trim_slack_mb": 10_000},
            (True, 10_000),
            True,
        ),
        (
            {"@callbacks": "spacy-lean.lean_training.v1", "eval_max_batch_tokens": 64},
            (True, 0),
            True,
        ),
    ):
        if callback is not None:
            registry.resolve({"cb": callback})["cb"](nlp)
        evaluate_dev = make_distributed_evaluation(
            nlp, lambda nlp: fresh_examples(nlp, dev), weights, DistContext()
        )
        score, scores = evaluate_dev()
        assert trim_policy(built[-1]) == policy and built[-1].sort_window is window
        # After every batch; a 10 GB slack: the first batch only (it sets the level); never.
        expected_trims = {(True, 0): built[-1].n_batches, (True, 10_000): 1}.get(policy, 0)
        assert built[-1]._trimmer.n_trims == expected_trims
        budget = (callback or {}).get("eval_max_batch_tokens")
        # The budget reaches the evaluator (the default: the transformer's max_batch_items).
        assert built[-1].max_batch_tokens == (budget or resolve_max_batch_tokens(nlp))
        results.append((score, without_speed(scores)))
    assert 0 < results[0][0] < 1
    assert results[0] == results[1] == results[2] == results[3]
    assert built[-1].n_batches > built[-2].n_batches  # 64 padded tokens: more, smaller batches


def test_a_random_dev_augmenter_draws_as_under_nlp_evaluate(trf_ner_nlp, dev_examples, tmp_path):
    """A dev reader with a random augmenter (spaCy's lower_case, half the docs): read
    window by window, its draws were interleaved with spacy-transformers' (one per
    forward pass), so every window after the first was augmented otherwise than under
    `Language.evaluate`, which lists the examples first (ents_f 0.217 against 0.233 on
    45k tokens). The stream now draws from random states of its own."""
    import random

    from spacy.tokens import DocBin
    from spacy.training import Corpus

    DocBin(docs=[eg.reference for eg in dev_examples]).to_disk(tmp_path / "dev.spacy")
    augmenter = spacy.registry.augmenters.get("spacy.lower_case.v1")(level=0.5)
    reader = Corpus(tmp_path / "dev.spacy", augmenter=augmenter)

    def lowered(evaluate, **settings):
        seen = []

        def recorded():
            for eg in reader(trf_ner_nlp):
                seen.append(eg.reference.text == eg.reference.text.lower())
                yield eg

        random.seed(0)
        evaluate(trf_ner_nlp, recorded(), **settings)
        return seen

    stock = lowered(Language.evaluate)
    assert len(stock) == len(dev_examples) and 0 < sum(stock) < len(stock)
    assert lowered(evaluate, batch_size=4, window_size=4) == stock
