"""`spacy lean evaluate MODEL DATA`: output like `spacy evaluate`, data formats, bad
input, checkpoints and out-of-memory back-off, run through the real CLI app."""

import json
import math
import signal
import warnings

import numpy
import pytest
import spacy
import srsly
from spacy.language import Language
from spacy.tokens import DocBin
from spacy.util import minibatch
from typer.testing import CliRunner

import spacy_lean.cli  # noqa: F401  (adds `lean` to spaCy's app)
from spacy_lean import synthetic
from spacy_lean.streaming import StreamingEvaluator

from eval_util import add_ruler, as_json, assert_same_scores  # noqa: E402
from eval_util import record_evaluators, trim_policy  # noqa: E402
from stop_util import sigterm_on_call  # noqa: E402

torch = pytest.importorskip("torch")

from spacy.cli._util import app  # noqa: E402

runner = CliRunner()


def lean_evaluate(*args):
    result = runner.invoke(app, ["lean", "evaluate", *[str(a) for a in args]])
    return result


def without_speed(scores):
    return {k: v for k, v in scores.items() if k != "speed"}


@pytest.fixture(scope="module")
def model_dir(trf_ner_dir, tmp_path_factory):
    """The trained transformer + ner fixture with an entity ruler after the ner, so the
    scores are not all zero."""
    path = tmp_path_factory.mktemp("scored_model") / "model"
    add_ruler(spacy.load(trf_ner_dir)).to_disk(path)
    return path


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    """Three .spacy shards (the middle one in a sub-folder)."""
    root = tmp_path_factory.mktemp("shards")
    synthetic.write_ner_corpus(root / "a.spacy", 7, seed=31)
    synthetic.write_ner_corpus(root / "b" / "b.spacy", 5, seed=32)
    synthetic.write_ner_corpus(root / "c.spacy", 6, seed=33)
    return root


def test_lean_help_lists_evaluate():
    result = runner.invoke(app, ["lean", "--help"])
    assert result.exit_code == 0
    assert "evaluate" in result.output
    # The group's summary names what its commands do (`train` included).
    assert "memory-lean training, evaluation" in result.output


def test_output_equals_spacy_evaluate(model_dir, ner_corpus, tmp_path):
    from spacy.cli.evaluate import evaluate as spacy_evaluate

    out = tmp_path / "scores.json"
    result = lean_evaluate(model_dir, ner_corpus["dev"], "--output", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "NER F" in result.output and "examples/s" in result.output
    # The budget used is printed: the transformer's max_batch_items (4096) by default.
    assert "batches of at most 4,096 padded tokens" in result.output
    theirs = spacy_evaluate(str(model_dir), ner_corpus["dev"])
    assert 0 < theirs["ents_f"] < 1
    # As `spacy evaluate --output` writes it (srsly keeps 10 significant digits).
    assert_same_scores(srsly.read_json(out), as_json(theirs))


def test_output_names_scores_that_are_not_finite_and_writes_them_as_null(tmp_path, capsys):
    """A custom scorer's NaN or infinite score is written as null and named (srsly,
    which `spacy evaluate` uses, fails on it, after the whole evaluation); numpy floats
    are written as numbers; finite scores as `spacy evaluate --output` writes them."""
    from spacy_lean.cli.evaluate import _write_scores

    out = tmp_path / "scores.json"
    scores = {
        "ents_f": 0.25,
        "my_score": float("nan"),
        "my_per_type": {"A": {"f": float("inf")}, "B": {"f": numpy.float32(0.5)}},
        "my_list": [1.0, -math.inf],
        "ents_p": None,
    }
    _write_scores(out, scores)
    read = json.loads(
        out.read_text(encoding="utf8"),
        parse_constant=lambda token: pytest.fail(f"not strict JSON: {token}"),
    )
    assert read == {
        "ents_f": 0.25,
        "my_score": None,
        "my_per_type": {"A": {"f": None}, "B": {"f": 0.5}},
        "my_list": [1.0, None],
        "ents_p": None,
    }
    said = " ".join(capsys.readouterr().out.split())
    assert "written as null in" in said and "scores.json" in said
    assert "my_score (nan)" in said and "my_per_type.A.f (inf)" in said
    assert "my_list[1] (-inf)" in said and "ents_f" not in said
    finite = {"ents_f": 1 / 3, "ents_per_type": {"A": {"p": 0.1}}}
    _write_scores(out, finite)
    assert out.read_text(encoding="utf8") == srsly.json_dumps(finite, indent=2)


@pytest.fixture(scope="module")
def dev_with_empty_docs(tmp_path_factory):
    """Two shards with 2 and 1 docs of no tokens among 7 and 5 with tokens."""
    root = tmp_path_factory.mktemp("with_empty")
    nlp = spacy.blank("en")
    for name, n_docs, seed, where in (("a.spacy", 7, 31, (0, 4)), ("b.spacy", 5, 32, (5,))):
        synthetic.write_ner_corpus(root / name, n_docs, seed=seed)
        docs = list(DocBin().from_disk(root / name).get_docs(nlp.vocab))
        for i in where:
            docs.insert(i, spacy.tokens.Doc(nlp.vocab, words=[]))
        DocBin(docs=docs, store_user_data=True).to_disk(root / name)
    return root


def test_empty_docs_are_skipped_and_said_so(model_dir, dev_with_empty_docs, shard_dir, tmp_path):
    """Empty docs are skipped, as `spacy evaluate` skips them (silently), and the run
    says how many, in one process and with workers (each counts its shard's); the
    scores are those of the data without them."""
    from spacy_lean.corpus.sources import list_shards, read_examples

    nlp = spacy.blank("en")
    counts = {}
    examples = list(read_examples(nlp, list_shards(dev_with_empty_docs), counts=counts))
    assert len(examples) == 12 and counts == {"empty_docs": 3}
    outputs = []
    for extra in ([], ["-w", "2"]):
        out = tmp_path / f"scores{len(extra)}.json"
        outputs.append(out)
        args = ["-o", out, "--no-progress", *extra]
        result = lean_evaluate(model_dir, dev_with_empty_docs, *args)
        assert result.exit_code == 0, result.output
        said = " ".join(result.output.split())
        assert "Evaluated 12 examples" in said
        assert "Skipped 3 empty doc(s) (no tokens)" in said, said
    assert without_speed(srsly.read_json(outputs[0])) == without_speed(srsly.read_json(outputs[1]))
    # Data without empty docs: no such line.
    plain = lean_evaluate(model_dir, shard_dir / "a.spacy", "--no-progress")
    assert plain.exit_code == 0 and "empty doc" not in " ".join(plain.output.split())


def test_folder_of_shards_per_component(model_dir, shard_dir, tmp_path):
    from spacy.training import Corpus

    out = tmp_path / "scores.json"
    result = lean_evaluate(
        model_dir, shard_dir, "-o", out, "--per-component", "-b", "4", "--no-progress"
    )
    assert result.exit_code == 0, result.output
    nlp = spacy.load(model_dir)
    expected = nlp.evaluate(list(Corpus(shard_dir)(nlp)), per_component=True)
    assert_same_scores(srsly.read_json(out), as_json(expected))


def test_jsonl_data(model_dir, shard_dir, tmp_path):
    from spacy_lean.corpus.jsonl import doc_to_record

    nlp = spacy.blank("en")
    docs = list(DocBin().from_disk(shard_dir / "a.spacy").get_docs(nlp.vocab))
    jsonl = tmp_path / "dev.jsonl"
    srsly.write_jsonl(jsonl, [doc_to_record(d) for d in docs])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert lean_evaluate(model_dir, jsonl, "-o", a, "--no-progress").exit_code == 0
    assert lean_evaluate(model_dir, shard_dir / "a.spacy", "-o", b, "--no-progress").exit_code == 0
    assert without_speed(srsly.read_json(a)) == without_speed(srsly.read_json(b))


def test_bad_input_gives_a_message_not_a_traceback(model_dir, tmp_path):
    missing = lean_evaluate(model_dir, tmp_path / "nope.spacy", "--no-progress")
    assert missing.exit_code == 1 and "not found" in missing.output
    assert "nope.spacy' does not exist" in " ".join(missing.output.split())
    assert "training config" not in missing.output  # (it named [paths.train])
    assert "Traceback" not in missing.output

    empty = tmp_path / "empty.spacy"
    DocBin().to_disk(empty)
    result = lean_evaluate(model_dir, empty, "--no-progress")
    assert result.exit_code == 1 and "no examples" in result.output

    corrupt_dir = tmp_path / "corrupt"
    corrupt_dir.mkdir()
    (corrupt_dir / "bad.spacy").write_bytes(b"this is not a DocBin")
    result = lean_evaluate(model_dir, corrupt_dir, "--no-progress")
    assert result.exit_code == 1 and "bad.spacy" in result.output and "re-create" in result.output

    no_data = tmp_path / "no_data"
    no_data.mkdir()
    result = lean_evaluate(model_dir, no_data, "--no-progress")
    assert result.exit_code == 1 and "No corpus files" in result.output

    result = lean_evaluate(tmp_path / "no_model", empty, "--no-progress")
    assert result.exit_code == 1 and "Could not load the pipeline" in result.output

    result = lean_evaluate(model_dir, empty, "--backend", "spark")
    assert result.exit_code == 1 and "Unknown --backend" in result.output


def test_output_in_a_new_folder_is_written_and_a_bad_one_fails_first(
    model_dir, shard_dir, tmp_path
):
    out = tmp_path / "results" / "run1" / "scores.json"
    result = lean_evaluate(model_dir, shard_dir / "a.spacy", "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert srsly.read_json(out)["ents_f"] is not None
    # A path that cannot be written fails before the evaluation, not after it.
    (tmp_path / "a_file").write_text("")
    bad = tmp_path / "a_file" / "scores.json"
    result = lean_evaluate(model_dir, shard_dir / "a.spacy", "-o", bad, "--no-progress")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert str(bad) in result.output and "Evaluated" not in result.output


def test_checkpoint_in_a_folder_that_cannot_be_made_fails_first(model_dir, shard_dir, tmp_path):
    (tmp_path / "a_file").write_text("")
    bad = tmp_path / "a_file" / "ckpt.json"
    result = lean_evaluate(model_dir, shard_dir / "a.spacy", "--checkpoint", bad, "--no-progress")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "--checkpoint" in result.output and str(bad) in result.output


def test_folder_with_both_formats_says_how_to_pick_one_on_the_command_line(
    model_dir, shard_dir, tmp_path
):
    # A .spacy file kept next to the .jsonl it was converted from.
    from spacy_lean.corpus.jsonl import doc_to_record

    data = tmp_path / "dev"
    data.mkdir()
    docs = list(DocBin().from_disk(shard_dir / "a.spacy").get_docs(spacy.blank("en").vocab))
    DocBin(docs=docs).to_disk(data / "dev.spacy")
    srsly.write_jsonl(data / "dev.jsonl", [doc_to_record(d) for d in docs])
    result = lean_evaluate(model_dir, data, "--no-progress")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    output = " ".join(result.output.split())  # wasabi wraps the message
    assert "both .spacy and .jsonl" in output and "give the path of one file" in output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_id_without_a_gpu_is_a_message_not_a_traceback(model_dir, shard_dir):
    result = lean_evaluate(model_dir, shard_dir, "--gpu-id", "0", "--no-progress")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "--gpu-id 0" in result.output and "--gpu-id -1" in result.output


def test_interrupted_run_resumes_with_the_same_numbers(
    model_dir, shard_dir, ner_corpus, tmp_path, monkeypatch
):
    full = tmp_path / "full.json"
    assert (
        lean_evaluate(model_dir, shard_dir, "-o", full, "-b", "2", "--no-progress").exit_code == 0
    )

    ckpt = tmp_path / "ckpt.json"
    real_window = StreamingEvaluator._evaluate_window
    calls = []

    def interrupted(self, window):
        calls.append(len(window))
        if len(calls) == 4:
            raise KeyboardInterrupt()
        return real_window(self, window)

    monkeypatch.setattr(StreamingEvaluator, "_evaluate_window", interrupted)
    args = ["-b", "2", "--checkpoint", ckpt, "--checkpoint-every", "1", "--no-progress"]
    result = lean_evaluate(model_dir, shard_dir, *args)
    assert result.exit_code == 130 and "resume" in result.output
    saved = srsly.read_json(ckpt)
    assert saved["n_examples"] == 6 and not saved["done"]
    monkeypatch.setattr(StreamingEvaluator, "_evaluate_window", real_window)

    resumed = tmp_path / "resumed.json"
    result = lean_evaluate(model_dir, shard_dir, *args, "-o", resumed)
    assert result.exit_code == 0, result.output
    assert "Resuming from the checkpoint: 6 examples" in result.output
    total = srsly.read_json(ckpt)["n_examples"]
    assert f"Evaluated {total - 6} examples in" in result.output
    assert f"6 more before, from {ckpt}" in " ".join(result.output.split())
    assert without_speed(srsly.read_json(resumed)) == without_speed(srsly.read_json(full))
    assert srsly.read_json(ckpt)["done"]
    again = lean_evaluate(model_dir, shard_dir, *args)
    assert again.exit_code == 0
    assert f"All {total} examples were evaluated by an earlier run" in again.output

    other = lean_evaluate(model_dir, ner_corpus["dev"], *args)
    assert (
        other.exit_code == 1
        and "other data" in other.output
        and "refusing to resume" in other.output
    )


def test_sigterm_ends_the_run_at_the_windows_end_saved_and_it_resumes(
    model_dir, shard_dir, tmp_path, monkeypatch
):
    """SIGTERM (a scheduler's stop) in the 4th window: that window is finished and saved
    (8 examples, where Ctrl-C keeps the 6 of the last save), the command exits with 143,
    and the rerun ends with the numbers of an uninterrupted run."""
    full = tmp_path / "full.json"
    assert (
        lean_evaluate(model_dir, shard_dir, "-o", full, "-b", "2", "--no-progress").exit_code == 0
    )
    ckpt = tmp_path / "ckpt.json"
    real_window = StreamingEvaluator._evaluate_window
    handler = signal.getsignal(signal.SIGTERM)  # another library's, or the default
    calls = sigterm_on_call(monkeypatch, StreamingEvaluator, "_evaluate_window", 4)
    args = ["-b", "2", "--checkpoint", ckpt, "--checkpoint-every", "1", "--no-progress"]
    result = lean_evaluate(model_dir, shard_dir, *args)
    assert result.exit_code == 143, result.output
    text = " ".join(result.output.split())
    assert f"Stopped by SIGTERM after 8 examples, saved in {ckpt}: rerun the same command" in text
    assert srsly.read_json(ckpt)["n_examples"] == 8 and len(calls) == 4
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    monkeypatch.setattr(StreamingEvaluator, "_evaluate_window", real_window)
    resumed = tmp_path / "resumed.json"
    result = lean_evaluate(model_dir, shard_dir, *args, "-o", resumed)
    assert result.exit_code == 0, result.output
    assert "Resuming from the checkpoint: 8 examples" in result.output
    assert without_speed(srsly.read_json(resumed)) == without_speed(srsly.read_json(full))


def test_resume_honours_this_runs_per_component_setting(model_dir, shard_dir, tmp_path):
    # The counts do not depend on --per-component, so a checkpoint resumes under either
    # setting; the scores must come out as this run asks, not as the checkpoint's run did.
    flat, nested = tmp_path / "flat.json", tmp_path / "nested.json"
    assert lean_evaluate(model_dir, shard_dir, "-o", flat, "--no-progress").exit_code == 0
    assert lean_evaluate(model_dir, shard_dir, "-P", "-o", nested, "--no-progress").exit_code == 0
    for first, then, expected in (("", "-P", nested), ("-P", "", flat)):
        ckpt, out = tmp_path / f"ckpt{first}.json", tmp_path / f"out{then}.json"
        args = ["--checkpoint", ckpt, "--no-progress"]
        assert lean_evaluate(model_dir, shard_dir, *args, *[a for a in [first] if a]).exit_code == 0
        result = lean_evaluate(model_dir, shard_dir, *args, *[a for a in [then] if a], "-o", out)
        assert result.exit_code == 0, result.output
        assert "finished evaluation" in result.output
        assert_same_scores(srsly.read_json(out), srsly.read_json(expected))


@Language.factory("test_cli_oom_above", default_config={"max_docs": 2})
def make_cli_oom_above(nlp, name, max_docs):
    return _OOMAbove(max_docs)


class _OOMAbove:
    def __init__(self, max_docs):
        self.max_docs = max_docs

    def __call__(self, doc):
        return doc

    def pipe(self, docs, batch_size=128):
        for batch in minibatch(docs, batch_size):
            if len(batch) > self.max_docs:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
            yield from batch


def test_token_budget_option(model_dir, shard_dir, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    result = lean_evaluate(
        model_dir, shard_dir, "--max-batch-tokens", "150", "-o", a, "--no-progress"
    )
    assert result.exit_code == 0, result.output
    assert "batches of at most 150 padded tokens" in result.output
    assert "windows of at most 1,200 tokens" in result.output  # 8 batches' worth
    assert lean_evaluate(model_dir, shard_dir, "-o", b, "--no-progress").exit_code == 0
    assert without_speed(srsly.read_json(a)) == without_speed(srsly.read_json(b))
    for bad in ("0", "-3"):
        result = lean_evaluate(model_dir, shard_dir, "--max-batch-tokens", bad)
        assert (
            result.exit_code == 1 and f"--max-batch-tokens must be >= 1, got {bad}" in result.output
        )
    result = lean_evaluate(model_dir, shard_dir, "--max-batch-tokens", "lots")
    assert result.exit_code != 0 and "Traceback" not in result.output


def test_cli_reports_out_of_memory_back_off(model_dir, shard_dir, tmp_path):
    nlp = spacy.load(model_dir)
    nlp.add_pipe("test_cli_oom_above", config={"max_docs": 3})
    model = tmp_path / "model"
    nlp.to_disk(model)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    args = ["-b", "7", "--window-size", "0", "-o", a, "--no-progress"]
    result = lean_evaluate(model, shard_dir / "a.spacy", *args)
    assert result.exit_code == 0, result.output
    assert "Out of GPU memory on a batch of 7 docs" in result.output
    assert "--batch-size 2" in result.output
    assert lean_evaluate(model_dir, shard_dir / "a.spacy", "-o", b, "--no-progress").exit_code == 0
    assert without_speed(srsly.read_json(a)) == without_speed(srsly.read_json(b))


@Language.factory("test_cli_custom_scored")
def make_custom_scored(nlp, name):
    return _CustomScored()


class _CustomScored:
    """A component with its own `score` method, which has no mergeable twin."""

    def __call__(self, doc):
        return doc

    def score(self, examples, **kwargs):
        return {"custom_docs": float(len(list(examples)))}


def test_component_without_twin_is_named_with_the_fix(shard_dir, tmp_path):
    nlp = spacy.blank("en")
    nlp.add_pipe("test_cli_custom_scored")
    nlp.to_disk(tmp_path / "model")
    out = tmp_path / "scores.json"
    result = lean_evaluate(tmp_path / "model", shard_dir, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "test_cli_custom_scored" in result.output and "register_twin" in result.output
    assert srsly.read_json(out)["custom_docs"] == 18.0


def test_trim_options_reach_the_evaluator_and_keep_the_scores(
    model_dir, shard_dir, tmp_path, monkeypatch
):
    """`--trim-slack-mb N` and `--no-trim-heap` build the evaluator with that heap-trimming
    policy (the default trims after every batch), with the same scores."""
    from spacy_lean.memory import resident_bytes

    if resident_bytes() is None:
        pytest.skip("a slack needs the resident memory (/proc/self/statm)")
    built = record_evaluators(monkeypatch)
    runs = {
        "default": ((), (True, 0), None),
        "slack": (("--trim-slack-mb", "10000"), (True, 10_000), "grown 10000 MB above"),
        "never": (("--no-trim-heap",), (False, 0), "Heap trimming off (--no-trim-heap)"),
    }
    scores = {}
    for name, (args, policy, said) in runs.items():
        out = tmp_path / f"{name}.json"
        result = lean_evaluate(model_dir, shard_dir, "-b", "4", "-o", out, "--no-progress", *args)
        assert result.exit_code == 0, result.output
        evaluator = built[-1]
        assert trim_policy(evaluator) == policy and evaluator.n_batches > 1
        # A 10 GB slack: only the first batch trims (it sets the level); never: none.
        expected = {"default": evaluator.n_batches, "slack": 1}.get(name, 0)
        assert evaluator._trimmer.n_trims == expected
        assert said is None or said in " ".join(result.output.split())
        scores[name] = without_speed(srsly.read_json(out))
    assert scores["default"]["ents_f"] > 0
    assert scores["default"] == scores["slack"] == scores["never"]
    both = lean_evaluate(model_dir, shard_dir, "--no-trim-heap", "--trim-slack-mb", "16", "-b", "8")
    assert both.exit_code == 0 and "--trim-slack-mb 16 unused" in " ".join(both.output.split())
    assert trim_policy(built[-1]) == (False, 0)


def test_bad_trim_slack_is_refused_with_the_fix(model_dir, shard_dir):
    for bad, shown in (("-1", "-1"), ("-0.5", "-0.5"), ("nan", "nan"), ("inf", "inf")):
        result = lean_evaluate(model_dir, shard_dir, "--trim-slack-mb", bad, "--no-progress")
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        text = " ".join(result.output.split())
        assert f"--trim-slack-mb must be a number of MB >= 0, got {shown}." in text
        assert "Use 0 to trim the heap after every batch" in text and "--no-trim-heap" in text
        assert "Traceback" not in result.output
    result = lean_evaluate(model_dir, shard_dir, "--trim-slack-mb", "lots")
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_resumed_run_may_trim_otherwise(model_dir, shard_dir, tmp_path, monkeypatch):
    """Heap trimming does not change the counts, so the checkpoint does not record it: a
    run resumed with another `--trim-slack-mb` is accepted, trims by its own setting and
    ends with the numbers of an uninterrupted run."""
    from spacy_lean.memory import resident_bytes

    if resident_bytes() is None:
        pytest.skip("a slack needs the resident memory (/proc/self/statm)")
    full = tmp_path / "full.json"
    result = lean_evaluate(model_dir, shard_dir, "-o", full, "-b", "2", "--no-progress")
    assert result.exit_code == 0, result.output
    ckpt = tmp_path / "ckpt.json"
    real_window = StreamingEvaluator._evaluate_window
    calls = []

    def interrupted(self, window):
        calls.append(len(window))
        if len(calls) == 3:
            raise KeyboardInterrupt()
        return real_window(self, window)

    monkeypatch.setattr(StreamingEvaluator, "_evaluate_window", interrupted)
    args = ["-b", "2", "--checkpoint", ckpt, "--checkpoint-every", "1", "--no-progress"]
    assert lean_evaluate(model_dir, shard_dir, *args).exit_code == 130
    assert not srsly.read_json(ckpt)["done"]
    monkeypatch.setattr(StreamingEvaluator, "_evaluate_window", real_window)
    built = record_evaluators(monkeypatch)
    resumed = tmp_path / "resumed.json"
    result = lean_evaluate(model_dir, shard_dir, *args, "--trim-slack-mb", "10000", "-o", resumed)
    assert result.exit_code == 0, result.output
    assert "Resuming from the checkpoint: 4 examples" in result.output
    assert trim_policy(built[-1]) == (True, 10_000) and built[-1]._trimmer.n_trims == 1
    assert without_speed(srsly.read_json(resumed)) == without_speed(srsly.read_json(full))


def test_a_pipeline_without_files_is_fingerprinted_by_its_exact_config_and_meta():
    """`blank:en` has no files to hash: its config and meta identify it, every float to
    the last digit (srsly's JSON, used before, kept 10)."""
    from spacy_lean.cli.evaluate import _model_fingerprint

    def blank(score):
        nlp = spacy.blank("en")
        nlp.meta["performance"] = {"ents_f": score}
        return _model_fingerprint("blank:en", nlp)

    assert blank(0.123456789012) == blank(0.123456789012)
    assert blank(0.123456789012) != blank(0.123456789013)


def test_a_unit_does_not_repeat_the_drivers_warning(shard_dir, tmp_path):
    """With --workers 2 the "no mergeable twin" warning came once from the driver and
    again from every unit (4 times for 3 shards): the units keep quiet about it."""
    from spacy_lean.distributed import WorkerSettings, _WORKER, evaluate_unit, make_units

    nlp = spacy.blank("en")
    nlp.add_pipe("test_cli_custom_scored")
    nlp.to_disk(tmp_path / "model")
    settings = WorkerSettings(model=str(tmp_path / "model"))
    unit = make_units([shard_dir / "a.spacy"], 1)[0]
    _WORKER.clear()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            result = evaluate_unit(unit, settings)
    finally:
        _WORKER.clear()
    assert result.n_examples > 0
    assert not [w for w in record if "no mergeable twin" in str(w.message)]


def test_a_workers_checkpoint_with_every_unit_finished_says_so(model_dir, shard_dir, tmp_path):
    """A stop between the last unit and the final save leaves every unit finished and
    `done` false: the rerun said "Evaluated 0 examples in 0.0s ... 18 more before"; it
    says they were all evaluated by the earlier run, with the same scores."""
    ckpt = tmp_path / "ckpt.json"
    args = ["--workers", "2", "--checkpoint", ckpt, "--no-progress"]
    first = tmp_path / "first.json"
    result = lean_evaluate(model_dir, shard_dir, *args, "-o", first)
    assert result.exit_code == 0, result.output
    saved = srsly.read_json(ckpt)
    assert saved["done"] and len(saved["units"]) == 3
    saved["done"] = False
    srsly.write_json(ckpt, saved)
    again = tmp_path / "again.json"
    result = lean_evaluate(model_dir, shard_dir, *args, "-o", again)
    assert result.exit_code == 0, result.output
    assert "All 18 examples were evaluated by an earlier run" in result.output
    assert without_speed(srsly.read_json(again)) == without_speed(srsly.read_json(first))
