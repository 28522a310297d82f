"""`spacy evaluate` / `spacy benchmark accuracy` stream for pipelines whose config
names `spacy-lean.streaming_evaluate.v1` (spacy_lean/cli/spacy_evaluate.py), with
spaCy's own output, and behave exactly as before for the others."""

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import spacy
import typer
from typer.testing import CliRunner

import spacy_lean.cli  # noqa: F401  (wraps spaCy's evaluate commands, as `python -m spacy` does)
from spacy_lean import synthetic
from spacy_lean.cli import spacy_evaluate
from spacy_lean.streaming import CALLBACK_NAME, is_streaming

from eval_util import add_ruler

pytest.importorskip("torch")

from spacy.cli._util import app  # noqa: E402

runner = CliRunner()
stock_module = spacy_evaluate.spacy_evaluate_module
# spaCy's own command, not wrapped: the reference every output is compared with.
stock_app = typer.Typer(name="spacy", rich_markup_mode=None)
stock_app.callback()(lambda: None)
stock_app.command("evaluate")(stock_module.evaluate_cli)

SPEED_ROW = re.compile(r"^SPEED .*$", re.M)
SPEED_JSON = re.compile(r'^\s*"speed":.*$', re.M)
# The subprocesses' runs: hash seed fixed, since spaCy's NER scorer orders the labels
# it first meets as missed gold entities by iterating a set of strings.
ENV = dict(
    os.environ,
    PYTHONHASHSEED="0",
    OMP_NUM_THREADS="1",
    TOKENIZERS_PARALLELISM="false",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
)


@pytest.fixture(scope="module")
def models(trf_ner_dir, tmp_path_factory):
    """The trained transformer + ner fixture with an entity ruler (so the scores are
    not all zero), saved as is ("plain") and naming the streaming callback ("streaming")."""
    root = tmp_path_factory.mktemp("spacy_evaluate_models")
    nlp = add_ruler(spacy.load(trf_ner_dir))
    nlp.to_disk(root / "plain")
    nlp.config["nlp"]["after_pipeline_creation"] = {"@callbacks": CALLBACK_NAME}
    nlp.to_disk(root / "streaming")
    assert is_streaming(spacy.load(root / "streaming"))
    return {"plain": str(root / "plain"), "streaming": str(root / "streaming")}


@pytest.fixture(scope="module")
def plain_json(models, ner_corpus, tmp_path_factory):
    """spaCy's `evaluate --output` JSON for the plain pipeline on the dev set, without
    its speed line."""
    out = tmp_path_factory.mktemp("plain_scores") / "scores.json"
    stock_module.evaluate(models["plain"], ner_corpus["dev"], output=out)
    return SPEED_JSON.sub("", out.read_text(encoding="utf8"))


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    """Three .spacy shards (one in a sub-folder) and a .jsonl file spaCy ignores."""
    root = tmp_path_factory.mktemp("spacy_evaluate_shards")
    synthetic.write_ner_corpus(root / "b.spacy", 6, seed=41)
    synthetic.write_ner_corpus(root / "a" / "a.spacy", 5, seed=42)
    synthetic.write_ner_corpus(root / "c.spacy", 7, seed=43)
    (root / "notes.jsonl").write_text('{"text": "not read by spacy evaluate"}\n')
    return root


def make_recording(real, calls):
    """`_evaluate_rest_next` that also records, per call, how many examples the
    command kept (listed) and how many were streamed into nlp.evaluate."""

    def recording(nlp, kept, rest):
        call = {"kept": len(kept), "streamed": 0}
        calls.append(call)

        def counted():
            for eg in rest:
                call["streamed"] += 1
                yield eg

        real(nlp, kept, counted())

    return recording


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    recording = make_recording(spacy_evaluate._evaluate_rest_next, calls)
    monkeypatch.setattr(spacy_evaluate, "_evaluate_rest_next", recording)
    return calls


def invoke(cli_app, workdir: Path, *args):
    """Run `evaluate ARGS` in `workdir` (relative output paths), return the result."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        result = runner.invoke(cli_app, [str(a) for a in args])
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    return result


def outputs(workdir: Path):
    """(stdout without the SPEED row, --output JSON text without speed, displaCy HTML)."""
    html = {p.name: p.read_bytes() for p in sorted((workdir / "html").iterdir())}
    text = (workdir / "scores.json").read_text(encoding="utf8")
    return SPEED_JSON.sub("", text), html


def run_both(tmp_path, model, data, *args):
    """spaCy's own command and the wrapped one, same arguments, in two folders."""
    results = {}
    for name, cli_app, prefix in (("stock", stock_app, ["evaluate"]), ("ours", app, ["evaluate"])):
        workdir = tmp_path / name
        (workdir / "html").mkdir(parents=True)
        result = invoke(
            cli_app, workdir, *prefix, model, data, "-o", "scores.json", "-dp", "html", *args
        )
        results[name] = (SPEED_ROW.sub("", result.output), *outputs(workdir))
    return results


def test_install_wraps_evaluate_and_benchmark_accuracy_once():
    assert spacy_evaluate.install(app) == ["evaluate", "benchmark accuracy"]
    assert spacy_evaluate.install(app) == ["evaluate", "benchmark accuracy"]  # idempotent
    wrapped = [c.callback for c in app.registered_commands if c.name == "evaluate"]
    assert len(wrapped) == 1 and wrapped[0].__wrapped__ is stock_module.evaluate_cli
    # spaCy's options and help, unchanged.
    ours = runner.invoke(app, ["evaluate", "--help"], terminal_width=100)
    theirs = runner.invoke(stock_app, ["evaluate", "--help"], terminal_width=100)
    assert ours.exit_code == 0 and ours.output == theirs.output


def test_without_the_callback_output_is_unchanged(models, ner_corpus, tmp_path, recorded):
    results = run_both(tmp_path, models["plain"], ner_corpus["dev"], "-dl", "4")
    assert results["ours"] == results["stock"]
    assert recorded == []  # nothing streamed: spaCy's Corpus read the data
    assert "NER F" in results["ours"][0] and set(results["ours"][2]) == {"entities.html"}


def test_with_the_callback_same_output_and_streaming(
    models, ner_corpus, plain_json, tmp_path, recorded
):
    results = run_both(tmp_path, models["streaming"], ner_corpus["dev"], "-dl", "4")
    assert results["ours"] == results["stock"]
    # The stock run lists all 40 examples; ours keeps the 4 displaCy renders.
    assert recorded == [{"kept": 4, "streamed": 36}]
    # And the scores are those of spaCy's Language.evaluate on the plain pipeline.
    assert results["ours"][1] == plain_json


@pytest.mark.parametrize(
    "args",
    [["-G", "-P", "-dl", "1000"], ["-dl", "-3"]],
    ids=["gold-preproc-per-component-limit-above-size", "negative-limit"],
)
def test_options_same_as_stock(models, shard_dir, tmp_path, recorded, args):
    results = run_both(tmp_path, models["streaming"], shard_dir, *args)
    assert results["ours"] == results["stock"]
    if args == ["-dl", "-3"]:
        assert recorded == []  # spaCy slices from the end: it needs every example
        return
    nlp = spacy.blank("en")
    total = sum(1 for _ in spacy.training.Corpus(shard_dir, gold_preproc="-G" in args)(nlp))
    limit = int(args[args.index("-dl") + 1])
    assert total > 18  # -G: one example per sentence
    assert recorded == [{"kept": min(limit, total), "streamed": total - min(limit, total)}]


def test_benchmark_accuracy_without_displacy_keeps_nothing(models, shard_dir, tmp_path, recorded):
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    invoke(app, tmp_path, "benchmark", "accuracy", models["streaming"], shard_dir, "-o", ours)
    assert recorded == [{"kept": 0, "streamed": 18}]
    stock_module.evaluate(models["plain"], shard_dir, output=theirs)
    assert SPEED_JSON.sub("", ours.read_text()) == SPEED_JSON.sub("", theirs.read_text())


def test_python_function(models, ner_corpus, plain_json, tmp_path, recorded):
    out = tmp_path / "scores.json"
    ours = spacy_evaluate.evaluate(models["streaming"], ner_corpus["dev"], output=out)
    assert recorded == [{"kept": 0, "streamed": 40}]
    assert SPEED_JSON.sub("", out.read_text(encoding="utf8")) == plain_json
    assert 0 < ours["ents_f"] < 1  # the returned scores are the ones written
    assert stock_module.Corpus is spacy.training.Corpus  # put back


@pytest.mark.parametrize("slack,policy", [(16, (True, 16)), (None, (False, 0))])
def test_callback_trim_setting_reaches_spacy_evaluate(
    models, ner_corpus, plain_json, tmp_path, recorded, monkeypatch, slack, policy
):
    """A pipeline saved with the callback's `trim_slack_mb` (in its config.cfg) is
    evaluated by `spacy evaluate` with that heap trimming, to the same scores."""
    from eval_util import record_evaluators, trim_policy

    nlp = spacy.load(models["plain"])
    nlp.config["nlp"]["after_pipeline_creation"] = {
        "@callbacks": CALLBACK_NAME,
        "trim_slack_mb": slack,
    }
    nlp.to_disk(tmp_path / "model")
    saved = (tmp_path / "model" / "config.cfg").read_text()
    assert f"trim_slack_mb = {'null' if slack is None else slack}" in saved
    built = record_evaluators(monkeypatch)
    invoke(app, tmp_path, "evaluate", tmp_path / "model", ner_corpus["dev"], "-o", "scores.json")
    assert recorded == [{"kept": 0, "streamed": 40}]
    assert len(built) == 1 and trim_policy(built[0]) == policy and built[0].n_batches >= 1
    assert SPEED_JSON.sub("", (tmp_path / "scores.json").read_text(encoding="utf8")) == plain_json


# A --code file that records what the streaming path kept and streamed, when the
# command was wrapped (spacy-lean's CLI module was loaded at start-up).
RECORDER = inspect.getsource(make_recording) + textwrap.dedent(
    """
    import atexit, json, os, sys

    calls = []
    atexit.register(lambda: open(os.environ["RECORD"], "w").write(json.dumps(calls)))
    spacy_evaluate = sys.modules.get("spacy_lean.cli.spacy_evaluate")
    if spacy_evaluate is not None:
        real = spacy_evaluate._evaluate_rest_next
        spacy_evaluate._evaluate_rest_next = make_recording(real, calls)
"""
)

STOCK_RUNNER = textwrap.dedent(
    """
    # spaCy's CLI without its `spacy_cli` entry points: spaCy's own evaluate command.
    import sys
    from spacy.cli._util import app
    from spacy.cli.evaluate import evaluate_cli
    from typer.main import get_command

    assert [c.callback for c in app.registered_commands if c.name == "evaluate"] == [evaluate_cli]
    try:
        get_command(app)(sys.argv[1:], prog_name="python -m spacy")
    finally:
        assert "spacy_lean.cli" not in sys.modules
"""
)


def test_python_m_spacy_evaluate_streams_with_spacy_output(models, ner_corpus, tmp_path):
    """The real command, in fresh processes: `python -m spacy evaluate` (spacy-lean's
    entry point loaded) against spaCy's own command, on the pipeline with the callback."""
    (tmp_path / "recorder.py").write_text(RECORDER)
    (tmp_path / "stock.py").write_text(STOCK_RUNNER)
    args = [
        "evaluate",
        models["streaming"],
        str(ner_corpus["dev"]),
        "-o",
        "scores.json",
        "-dp",
        "html",
        "-dl",
        "5",
        "-c",
        str(tmp_path / "recorder.py"),
    ]
    procs = {}
    for name, cmd in (
        ("ours", [sys.executable, "-m", "spacy"]),
        ("stock", [sys.executable, str(tmp_path / "stock.py")]),
    ):
        workdir = tmp_path / name
        (workdir / "html").mkdir(parents=True)
        env = dict(ENV, RECORD=str(workdir / "record.json"))
        procs[name] = subprocess.Popen(
            cmd + args,
            cwd=workdir,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        workdir = tmp_path / name
        results[name] = (SPEED_ROW.sub("", stdout), *outputs(workdir))
        results[name + "_record"] = json.loads((workdir / "record.json").read_text())
    assert results["ours"] == results["stock"]
    assert "NER F" in results["ours"][0] and results["ours"][2]
    assert results["ours_record"] == [{"kept": 5, "streamed": 35}]
    assert results["stock_record"] == []  # spaCy's own command listed all 40


@pytest.fixture(scope="module")
def messy_models(trf_ner_dir, tmp_path_factory):
    """The trained transformer + ner + ruler with a textcat_multilabel and a spancat
    added (initialized on the messy docs, so cats and spans are scored too), saved
    plain and naming the callback; and the messy docs (tests/messy_data.py) as a folder
    of three shards, the middle one holding no docs."""
    from spacy.tokens import DocBin
    from spacy.training import Example

    from messy_data import make_messy_docs

    root = tmp_path_factory.mktemp("messy")
    nlp = add_ruler(spacy.load(trf_ner_dir))
    docs = make_messy_docs(nlp)
    examples = [Example(nlp.make_doc(d.text), d) for d in docs if len(d)]
    for name in ("textcat_multilabel", "spancat"):
        nlp.add_pipe(name).initialize(lambda: examples, nlp=nlp)
    nlp.add_pipe("sentencizer", first=True)
    nlp.to_disk(root / "plain")
    nlp.config["nlp"]["after_pipeline_creation"] = {"@callbacks": CALLBACK_NAME}
    nlp.to_disk(root / "streaming")
    data = root / "data"
    (data / "sub").mkdir(parents=True)
    DocBin(docs=docs[:5], store_user_data=True).to_disk(data / "a.spacy")
    DocBin().to_disk(data / "b.spacy")
    DocBin(docs=docs[5:], store_user_data=True).to_disk(data / "sub" / "c.spacy")
    return {
        "plain": str(root / "plain"),
        "streaming": str(root / "streaming"),
        "data": data,
        "n_docs": len(docs),
    }


@pytest.mark.parametrize("args", [[], ["-G"]], ids=["default", "gold-preproc"])
def test_messy_data_same_scores_in_all_three_commands(messy_models, tmp_path, recorded, args):
    """Empty and whitespace-only docs, an empty shard, a 300-token doc with no sentence
    boundaries, missing ("-") and unset entity annotation, overlapping spans, cats, CJK,
    right-to-left, emoji and combining characters: `spacy evaluate` (spaCy's own
    command), the streaming `spacy evaluate` and `spacy lean evaluate` write the same
    --output JSON, and each evaluates every non-empty doc (the empty one is skipped by
    all three, as spaCy's Corpus skips it)."""
    from spacy.cli.evaluate import evaluate as stock_evaluate

    data = messy_models["data"]
    gold_preproc = bool(args)
    stock_evaluate(
        messy_models["plain"], data, output=tmp_path / "stock.json", gold_preproc=gold_preproc
    )
    invoke(
        app, tmp_path, "evaluate", messy_models["streaming"], data, "-o", "streaming.json", *args
    )
    corpus = spacy.training.Corpus(data, gold_preproc=gold_preproc)
    n_examples = sum(1 for _ in corpus(spacy.blank("en")))
    assert recorded == [{"kept": 0, "streamed": n_examples}]
    result = runner.invoke(
        app,
        [
            "lean",
            "evaluate",
            messy_models["plain"],
            str(data),
            "-o",
            str(tmp_path / "lean.json"),
            "--no-progress",
            *args,
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"Evaluated {n_examples} examples" in result.output
    stock = SPEED_JSON.sub("", (tmp_path / "stock.json").read_text(encoding="utf8"))
    scores = json.loads((tmp_path / "stock.json").read_text(encoding="utf8"))
    assert scores["ents_f"] and None not in (scores["cats_macro_auc"], scores["spans_sc_f"])
    assert SPEED_JSON.sub("", (tmp_path / "streaming.json").read_text(encoding="utf8")) == stock
    assert SPEED_JSON.sub("", (tmp_path / "lean.json").read_text(encoding="utf8")) == stock
    if not args:
        assert n_examples == messy_models["n_docs"] - 1  # only the empty doc is skipped


def test_corrupt_shard_is_a_message_not_a_traceback(models, shard_dir, tmp_path):
    """A truncated shard in the dev folder: the streaming `spacy evaluate` read it with
    spacy-lean's reader, whose error (file named, how to re-create it) came out as a
    traceback. Now it is spaCy's CLI style: a message and exit code 1. A pipeline
    without the callback still gets spaCy's own behaviour."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(shard_dir, data)
    good = (data / "c.spacy").read_bytes()
    (data / "c.spacy").write_bytes(good[: len(good) // 2])
    result = runner.invoke(app, ["evaluate", models["streaming"], str(data)])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "Could not read the evaluation data" in text and "c.spacy" in text
    assert "truncated" in text and "re-create it" in text
    assert not isinstance(result.exception, ValueError)  # a clean exit, not an error
    stock = runner.invoke(app, ["evaluate", models["plain"], str(data)])
    assert isinstance(stock.exception, ValueError)  # spaCy's E1014, as before
    # A link to nothing in the folder: named as one, with what to do (it gave the OS's
    # "No such file or directory" only).
    (data / "c.spacy").unlink()
    (data / "d.spacy").symlink_to(tmp_path / "gone.spacy")
    result = runner.invoke(app, ["evaluate", models["streaming"], str(data)])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Could not read the evaluation data" in text, text
    assert "d.spacy', a symbolic link to" in text and "Remove the link" in text
