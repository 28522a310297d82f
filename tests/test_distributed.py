"""Evaluation across workers: 2 spawned CPU processes and a local Ray cluster give
the numbers of one process; a worker that dies has its shards retried, counted once."""

import functools
import os
import signal

import pytest
import spacy
import srsly
from spacy.language import Language
from spacy.tokens import DocBin
from spacy.util import minibatch
from typer.testing import CliRunner

import spacy_lean.cli  # noqa: F401
from spacy_lean import synthetic
from spacy_lean._compat import has_ray
from spacy_lean.distributed import (
    EvalUnit,
    WorkerDiedError,
    WorkerSettings,
    evaluate_distributed,
    evaluate_unit,
    make_units,
)
from spacy_lean.corpus.sources import list_shards, read_examples
from spacy_lean.streaming import evaluate

import eval_util  # noqa: E402

# Workers run in other processes: per-type label order follows their hash seed.
assert_same_scores = functools.partial(eval_util.assert_same_scores, unordered_per_type=True)

from spacy.cli._util import app  # noqa: E402

# A component that kills its worker process the first time it sees a doc (the marker
# file says it already did), like a worker lost to a crash or a pre-empted node.
CRASH_ONCE_CODE = """
import os
from pathlib import Path

from spacy.language import Language
from spacy.tokens import DocBin


@Language.factory("test_crash_once", default_config={"marker": ""})
def make_crash_once(nlp, name, marker):
    return CrashOnce(marker)


class CrashOnce:
    def __init__(self, marker):
        self.marker = marker

    def __call__(self, doc):
        if self.marker and not Path(self.marker).exists():
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(3)
        return doc
"""


@pytest.fixture(scope="module")
def code_file(tmp_path_factory):
    from spacy.cli._util import import_code

    path = tmp_path_factory.mktemp("code") / "crash_once.py"
    path.write_text(CRASH_ONCE_CODE)
    import_code(path)
    return path


@pytest.fixture(scope="module")
def model_dir(trf_ner_dir, tmp_path_factory):
    """The trained trf + ner fixture, with an entity ruler (so the scores are not all
    zero) and a crash-once component whose marker path is set per test."""
    nlp = spacy.load(trf_ner_dir)
    ruler = nlp.add_pipe("entity_ruler", config={"overwrite_ents": True})
    ruler.add_patterns(
        [{"label": "PERSON", "pattern": p} for p in synthetic._PERSONS[:8]]
        + [{"label": "ORG", "pattern": p} for p in synthetic._LOCS[:3]]
    )
    path = tmp_path_factory.mktemp("dist_model") / "model"
    nlp.to_disk(path)
    return path


def with_crash_once(model_dir, code_file, marker, out):
    """A copy of the model whose crash-once component kills a worker once."""
    nlp = spacy.load(model_dir)
    nlp.add_pipe("test_crash_once", config={"marker": str(marker)})
    nlp.to_disk(out)
    return out


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_shards")
    for i, n in enumerate((6, 4, 5)):
        synthetic.write_ner_corpus(root / f"dev-{i}.spacy", n, seed=40 + i)
    return root


def single_process(model, data):
    nlp = spacy.load(model)
    return evaluate(nlp, read_examples(nlp, list_shards(data)))


def test_make_units():
    assert make_units(["a", "b", "c"], 2) == [EvalUnit(0, "a"), EvalUnit(1, "b"), EvalUnit(2, "c")]
    assert make_units(["a"], 3) == [EvalUnit(k, "a", (k, 3)) for k in range(3)]
    assert make_units(["a"], 1) == [EvalUnit(0, "a")]


def test_read_examples_parts_cover_the_file_once(shard_dir):
    nlp = spacy.blank("en")
    shard = list_shards(shard_dir)[0]
    whole = [eg.reference.text for eg in read_examples(nlp, [shard])]
    parts = [eg.reference.text for k in range(4) for eg in read_examples(nlp, [shard], part=(k, 4))]
    assert parts == whole


def test_two_processes_equal_one(model_dir, shard_dir):
    expected = single_process(model_dir, shard_dir)
    assert 0 < expected["ents_f"] < 1
    ours = evaluate_distributed(model_dir, shard_dir, workers=2, batch_size=4)
    assert_same_scores(ours, expected)


def test_dead_worker_is_retried_and_counted_once(model_dir, code_file, shard_dir, tmp_path):
    model = with_crash_once(model_dir, code_file, tmp_path / "crashed", tmp_path / "model")
    expected = single_process(model_dir, shard_dir)
    out = tmp_path / "scores.json"
    args = [
        "lean",
        "evaluate",
        str(model),
        str(shard_dir),
        "--workers",
        "2",
        "--code",
        str(code_file),
    ]
    result = CliRunner().invoke(app, args + ["-o", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "crashed").exists()
    assert "worker process died" in result.output and "evaluating again" in result.output
    assert "Evaluated 15 examples" in result.output
    assert_same_scores(srsly.read_json(out), srsly.json_loads(srsly.json_dumps(expected)))


def test_a_dead_worker_is_blamed_on_the_unit_it_ran(model_dir, code_file, shard_dir, tmp_path):
    """A worker that dies breaks the pool, which fails every unit it had not finished,
    the queued ones too: each was charged a retry and named as the cause ("while
    evaluating dev-0.spacy, dev-1.spacy, dev-2.spacy"). Only the unit that had started
    is, and "1 time" is singular."""
    model = with_crash_once(model_dir, code_file, tmp_path / "crashed", tmp_path / "model")
    with pytest.raises(WorkerDiedError) as info:
        evaluate_distributed(
            model, list_shards(shard_dir), workers=1, max_retries=0, code_path=code_file
        )
    text = str(info.value)
    assert "Workers died 1 time while evaluating dev-0.spacy (a worker" in text, text
    assert "dev-1.spacy" not in text and "dev-2.spacy" not in text


@pytest.mark.slow
def test_worker_that_keeps_dying_fails_with_a_message(model_dir, code_file, shard_dir, tmp_path):
    model = with_crash_once(model_dir, code_file, tmp_path / "crashed", tmp_path / "model")
    with pytest.raises(WorkerDiedError, match="raise --max-retries"):
        evaluate_distributed(
            model, list_shards(shard_dir)[:1], workers=1, max_retries=0, code_path=code_file
        )


@pytest.mark.skipif(not has_ray, reason="needs ray (pip install 'spacy-lean[ray]')")
def test_ray_local_cluster_equals_one_process(model_dir, code_file, ner_corpus, tmp_path):
    import ray

    model = with_crash_once(model_dir, code_file, tmp_path / "crashed", tmp_path / "model")
    expected = single_process(model_dir, ner_corpus["dev"])
    retries = []
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ours = evaluate_distributed(
            model,
            ner_corpus["dev"],
            workers=2,
            backend="ray",
            code_path=code_file,
            batch_size=8,
            on_retry=lambda units, why: retries.append((units, why)),
        )
    finally:
        ray.shutdown()
    assert retries and "Ray worker died" in retries[0][1]
    assert_same_scores(ours, expected)


# Records the padded size (docs x longest doc) of every batch a pipeline runs.
PADDED_SIZES = []


@Language.factory("test_record_padded")
def make_record_padded(nlp, name):
    return _RecordPadded()


class _RecordPadded:
    def __call__(self, doc):
        PADDED_SIZES.append(len(doc))
        return doc

    def pipe(self, docs, batch_size=128):
        for batch in minibatch(docs, batch_size):
            PADDED_SIZES.append(len(batch) * max(len(d) for d in batch))
            yield from batch


@pytest.mark.parametrize("budget", [None, 60])
def test_worker_keeps_to_the_token_budget(model_dir, shard_dir, tmp_path, budget):
    """A worker builds its evaluator with the budget it is given (processes and Ray
    workers run `evaluate_unit`), and scores the same with any budget."""
    nlp = spacy.load(model_dir)
    nlp.add_pipe("test_record_padded")
    path = tmp_path / "model"
    nlp.to_disk(path)
    shard = list_shards(shard_dir)[0]
    longest = max(len(eg.reference) for eg in read_examples(nlp, [shard]))
    PADDED_SIZES.clear()
    result = evaluate_unit(
        EvalUnit(0, shard), WorkerSettings(model=str(path), max_batch_tokens=budget)
    )
    assert result.n_examples == 6 and PADDED_SIZES
    if budget is None:
        assert max(PADDED_SIZES) > 60  # the default budget lets batches grow past 60
    else:
        assert all(size <= max(budget, longest) for size in PADDED_SIZES)
        assert longest <= budget or max(PADDED_SIZES) == longest


def test_cli_passes_the_token_budget_to_workers(model_dir, shard_dir, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    args = ["lean", "evaluate", str(model_dir), str(shard_dir), "--no-progress"]
    result = CliRunner().invoke(
        app, args + ["--max-batch-tokens", "100", "--workers", "2", "-o", str(a)]
    )
    assert result.exit_code == 0, result.output
    assert "Memory budget per worker: batches of at most 100 padded tokens" in result.output
    assert CliRunner().invoke(app, args + ["-o", str(b)]).exit_code == 0
    assert_same_scores(srsly.read_json(a), srsly.read_json(b))


def test_checkpoint_resumes_with_the_data_path_given_another_way(
    model_dir, shard_dir, tmp_path, monkeypatch
):
    # The same folder, named relative to another working directory: the same data and
    # the same workers, so the finished checkpoint is used, not refused.
    ckpt, a, b = tmp_path / "ckpt.json", tmp_path / "a.json", tmp_path / "b.json"
    args = ["lean", "evaluate", str(model_dir), "--no-progress", "-w", "2"]
    args += ["--checkpoint", str(ckpt)]
    result = CliRunner().invoke(app, args + [str(shard_dir), "-o", str(a)])
    assert result.exit_code == 0, result.output
    monkeypatch.chdir(shard_dir.parent)
    result = CliRunner().invoke(app, args + [shard_dir.name, "-o", str(b)])
    assert result.exit_code == 0, result.output
    assert "3 of 3 shards already evaluated" in result.output
    assert srsly.read_json(a) == srsly.read_json(b)


# A component that stops its worker with a KeyboardInterrupt (as Ctrl-C does) the first
# time it sees a doc of the given text (the marker file says it already did).
INTERRUPT_ONCE_CODE = """
from pathlib import Path

from spacy.language import Language
from spacy.tokens import DocBin


@Language.factory("test_interrupt_once", default_config={"marker": "", "text": ""})
def make_interrupt_once(nlp, name, marker, text):
    return InterruptOnce(marker, text)


class InterruptOnce:
    def __init__(self, marker, text):
        self.marker = marker
        self.text = text

    def __call__(self, doc):
        if self.text in doc.text and not Path(self.marker).exists():
            Path(self.marker).write_text("")
            raise KeyboardInterrupt()
        return doc
"""


def test_interrupted_workers_keep_their_finished_shards(model_dir, shard_dir, tmp_path):
    from spacy.cli._util import import_code

    code = tmp_path / "interrupt_once.py"
    code.write_text(INTERRUPT_ONCE_CODE)
    import_code(code)
    nlp = spacy.load(model_dir)
    nlp.add_pipe("test_interrupt_once", config={"marker": str(tmp_path / "hit"), "text": "Ctrl-C"})
    nlp.to_disk(tmp_path / "model")
    # The third shard is reached once a worker has finished one of the first two.
    data = tmp_path / "data"
    data.mkdir()
    for path in list_shards(shard_dir)[:2]:
        (data / path.name).write_bytes(path.read_bytes())
    synthetic.write_ner_corpus(data / "z.spacy", 3, seed=44)
    docs = list(DocBin().from_disk(data / "z.spacy").get_docs(nlp.vocab))
    DocBin(docs=docs + [nlp.make_doc("Ctrl-C pressed here .")]).to_disk(data / "z.spacy")
    ckpt = tmp_path / "ckpt.json"
    args = [
        "lean",
        "evaluate",
        str(tmp_path / "model"),
        str(data),
        "-w",
        "2",
        "--code",
        str(code),
        "--checkpoint",
        str(ckpt),
        "--no-progress",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130 and "resume" in result.output, result.output
    # Saved on the interrupt, although --checkpoint-every (50 shards) was not reached.
    assert srsly.read_json(ckpt)["units"] and not srsly.read_json(ckpt)["done"]
    result = CliRunner().invoke(app, args + ["-o", str(tmp_path / "out.json")])
    assert result.exit_code == 0, result.output
    assert "of 3 shards already evaluated" in result.output
    expected = single_process(tmp_path / "model", data)
    expected = srsly.json_loads(srsly.json_dumps(expected))
    assert_same_scores(srsly.read_json(tmp_path / "out.json"), expected)


# A --code file that logs, from every process but the test's own, the heap-trimming
# policy of each evaluator built and each trim asked for (glibc's trim is not run).
TRIM_LOG_CODE = """
import json
import os

from spacy_lean import memory, streaming

LOG = {log!r}
MAIN = {main}


def log(**entry):
    if os.getpid() != MAIN:
        with open(LOG, "a") as f:
            f.write(json.dumps(dict(entry, pid=os.getpid())) + "\\n")


if not getattr(streaming.StreamingEvaluator, "_trim_logged", False):
    real_init = streaming.StreamingEvaluator.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        log(trim_heap=self.trim_heap, slack_mb=self._trimmer.slack / 2**20)

    def trim():
        log(trim=True)
        return True

    streaming.StreamingEvaluator.__init__ = init
    streaming.StreamingEvaluator._trim_logged = True
    memory.trim_host_memory = trim
"""


@pytest.fixture
def trim_log(tmp_path, monkeypatch):
    """(code file, log path): the code file given to `--code` / `code_path` is also
    imported here; what it patches is put back after the test."""
    import os

    from spacy_lean import memory
    from spacy_lean.streaming import StreamingEvaluator

    monkeypatch.setattr(StreamingEvaluator, "__init__", StreamingEvaluator.__init__)
    monkeypatch.setattr(StreamingEvaluator, "_trim_logged", False, raising=False)
    monkeypatch.setattr(memory, "trim_host_memory", memory.trim_host_memory)
    log = tmp_path / "trims.jsonl"
    code = tmp_path / "trim_log.py"
    code.write_text(TRIM_LOG_CODE.format(log=str(log), main=os.getpid()))
    return code, log


def memory_readable():
    from spacy_lean.memory import resident_bytes

    return resident_bytes() is not None


def read_trim_log(log):
    entries = list(srsly.read_jsonl(log)) if log.exists() else []
    built = [e for e in entries if "trim_heap" in e]
    return built, [e for e in entries if e.get("trim")]


@pytest.mark.parametrize(
    "option,policy", [("--trim-slack-mb=16", (True, 16)), ("--no-trim-heap", (False, 0))]
)
def test_cli_passes_the_trim_setting_to_workers(
    model_dir, shard_dir, tmp_path, monkeypatch, option, policy
):
    """What `--workers 2` hands its workers (`WorkerSettings`) builds every unit's
    evaluator with the command's heap trimming. The units run here, one after the
    other, through `evaluate_unit`, as a worker process runs them (fast; the real
    processes: `test_workers_trim_as_the_cli_says`, slow)."""
    import spacy_lean.distributed as distributed

    def run_here(units, settings, *, on_result, **kwargs):
        for unit in units:
            on_result(unit, evaluate_unit(unit, settings))

    monkeypatch.setattr(distributed, "run_units", run_here)
    built = eval_util.record_evaluators(monkeypatch)
    out = tmp_path / "scores.json"
    args = ["lean", "evaluate", str(model_dir), str(shard_dir), "-w", "2", option, "-o", str(out)]
    result = CliRunner().invoke(app, args + ["--no-progress"])
    assert result.exit_code == 0, result.output
    assert len(built) == 3 and all(eval_util.trim_policy(e) == policy for e in built)
    expected = srsly.json_loads(srsly.json_dumps(single_process(model_dir, shard_dir)))
    assert_same_scores(srsly.read_json(out), expected)


@pytest.mark.slow
def test_workers_trim_as_the_cli_says(model_dir, shard_dir, tmp_path, trim_log):
    """`--trim-slack-mb` reaches the evaluator of every worker process (one per shard
    here), with the scores of one process."""
    import os

    code, log = trim_log
    out = tmp_path / "scores.json"
    args = ["lean", "evaluate", str(model_dir), str(shard_dir), "-w", "2", "--code", str(code)]
    args += ["--trim-slack-mb", "10000", "-o", str(out), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    built, trims = read_trim_log(log)
    assert len(built) == 3 and os.getpid() not in {e["pid"] for e in built}
    assert all((e["trim_heap"], e["slack_mb"]) == (True, 10_000) for e in built)
    if memory_readable():
        # Each unit's evaluator trims after its first batch (that sets its level) and
        # never again: nothing grows 10 GB.
        assert len(trims) == len(built)
    expected = srsly.json_loads(srsly.json_dumps(single_process(model_dir, shard_dir)))
    assert_same_scores(srsly.read_json(out), expected)


@pytest.mark.parametrize("slack", [0.0, 16.0, None])
def test_worker_builds_its_evaluator_with_the_trim_setting(
    model_dir, shard_dir, slack, monkeypatch
):
    """`evaluate_unit` (what process workers and Ray actors run) trims per
    `WorkerSettings.trim_slack_mb`; the counts are the same."""
    built = eval_util.record_evaluators(monkeypatch)
    shard = list_shards(shard_dir)[0]
    settings = WorkerSettings(model=str(model_dir), batch_size=2, trim_slack_mb=slack)
    result = evaluate_unit(EvalUnit(0, shard), settings)
    assert result.n_examples == 6 and built[-1].n_batches == 3
    assert eval_util.trim_policy(built[-1]) == ((False, 0) if slack is None else (True, slack))
    if slack == 0:
        assert built[-1]._trimmer.n_trims == 3
    baseline = evaluate_unit(EvalUnit(0, shard), WorkerSettings(model=str(model_dir), batch_size=2))
    counts = [{k: v for k, v in r.state.items() if k != "seconds"} for r in (result, baseline)]
    assert counts[0] == counts[1]


def test_bad_trim_slack_is_refused_before_any_worker_starts(model_dir, shard_dir):
    with pytest.raises(ValueError, match="trim_slack_mb must be a number of MB >= 0, got -2"):
        evaluate_distributed(model_dir, shard_dir, workers=2, trim_slack_mb=-2)


@pytest.mark.skipif(not has_ray, reason="needs ray (pip install 'spacy-lean[ray]')")
def test_ray_address_without_a_cluster_says_how_to_start_one(monkeypatch):
    """`--backend ray --ray-address auto` with no cluster running ended in Ray's
    ConnectionError traceback, whose advice names a flag this command does not have."""
    import ray

    from spacy_lean.distributed import BackendUnavailableError, _run_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    with pytest.raises(BackendUnavailableError, match="No Ray cluster at --ray-address auto") as e:
        _run_ray([], None, 2, False, 0, "auto", None, None)
    assert "ray start --head" in str(e.value) and "--ray-address HOST:6379" in str(e.value)


@pytest.mark.slow
@pytest.mark.skipif(not has_ray, reason="needs ray (pip install 'spacy-lean[ray]')")
def test_ray_actors_trim_as_the_cli_says(model_dir, shard_dir, tmp_path, trim_log):
    """`--backend ray --no-trim-heap`: every actor's evaluator never trims; the scores
    are those of one process."""
    import ray

    code, log = trim_log
    out = tmp_path / "scores.json"
    args = [
        "lean",
        "evaluate",
        str(model_dir),
        str(shard_dir),
        "-w",
        "2",
        "--backend",
        "ray",
        "--code",
        str(code),
        "--no-trim-heap",
        "-o",
        str(out),
        "--no-progress",
    ]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        ray.shutdown()
    assert result.exit_code == 0, result.output
    built, trims = read_trim_log(log)
    assert len(built) == 3 and all(not e["trim_heap"] for e in built) and not trims
    expected = srsly.json_loads(srsly.json_dumps(single_process(model_dir, shard_dir)))
    assert_same_scores(srsly.read_json(out), expected)


def test_sigterm_with_workers_keeps_the_finished_shards_and_resumes(
    model_dir, shard_dir, tmp_path, monkeypatch
):
    """SIGTERM (a scheduler's stop) once the first shard is saved: the run ends at once
    (the shards still running are ended, not waited for), exits with 143 and keeps the
    finished shards; the rerun evaluates the rest, to a single process's scores."""
    from spacy_lean.streaming import EvalCheckpoint as Checkpoint

    real_save, saves = Checkpoint.save, []

    def save(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        saves.append(len(kwargs.get("units") or {}))
        if len(saves) == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)  # another library's, or the default
    monkeypatch.setattr(Checkpoint, "save", save)
    ckpt, out = tmp_path / "ckpt.json", tmp_path / "scores.json"
    args = ["lean", "evaluate", str(model_dir), str(shard_dir), "--workers", "2", "--no-progress"]
    args += ["--checkpoint", str(ckpt), "--checkpoint-every", "1"]
    result = CliRunner().invoke(app, args)
    text = " ".join(result.output.split())
    assert result.exit_code == 143, result.output
    assert f"saved in {ckpt}: rerun the same command to resume from there" in text
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    kept = srsly.read_json(ckpt)
    assert not kept["done"] and 1 <= len(kept["units"]) < len(list_shards(shard_dir))
    monkeypatch.setattr(Checkpoint, "save", real_save)
    result = CliRunner().invoke(app, args + ["-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"{len(kept['units'])} of" in result.output  # "Resuming ...: k of n shards"
    # The rerun's count and rate are its own (it claimed every example before).
    before = sum(unit["n_examples"] for unit in kept["units"].values())
    text = " ".join(result.output.split())
    assert f"Evaluated {15 - before} examples in" in text and f"; {before} more before" in text
    expected = single_process(model_dir, shard_dir)
    assert_same_scores(srsly.read_json(out), srsly.json_loads(srsly.json_dumps(expected)))


# Registered in the test process and, with --code, in the workers: a component that
# writes which ops its process runs on (thinc's current ops) to a file named by its pid.
DEVICE_PROBE_CODE = """
import os
from pathlib import Path

from spacy.language import Language


@Language.factory("test_device_probe", default_config={"folder": ""})
def make_device_probe(nlp, name, folder):
    return DeviceProbe(folder)


class DeviceProbe:
    def __init__(self, folder):
        self.folder = folder

    def __call__(self, doc):
        from thinc.api import get_current_ops

        if self.folder:
            ops = type(get_current_ops()).__name__
            Path(self.folder, str(os.getpid())).write_text(ops, encoding="utf8")
        return doc
"""


@pytest.mark.gpu
def test_workers_on_the_gpu_give_the_scores_of_one_gpu_process(model_dir, shard_dir, tmp_path):
    """`spacy lean evaluate --workers 2 --gpu-id 0`: the workers are spawned (CUDA in a
    forked child fails), each takes a visible GPU (round-robin: here both may share GPU
    0) and loads the pipeline there (thinc's ops are cupy's in every worker, a probe
    component records them), and the merged scores are one GPU process's. Never run on
    a GPU before."""
    pytest.importorskip("cupy")
    from spacy.cli._util import import_code
    from thinc.api import require_cpu, require_gpu

    code = tmp_path / "probe.py"
    code.write_text(DEVICE_PROBE_CODE, encoding="utf8")
    import_code(code)
    probes = tmp_path / "probes"
    probes.mkdir()
    nlp = spacy.load(model_dir)
    nlp.add_pipe("test_device_probe", config={"folder": str(probes)})
    nlp.to_disk(tmp_path / "model")
    require_gpu(0)
    try:
        expected = single_process(model_dir, shard_dir)
    finally:
        require_cpu()
    out = tmp_path / "scores.json"
    args = ["lean", "evaluate", str(tmp_path / "model"), str(shard_dir), "--workers", "2"]
    args += ["--gpu-id", "0", "--code", str(code), "-o", str(out), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Evaluating 3 shard(s) on 2 worker process(es)" in text and "GPU(s)" in text
    seen = {path.name: path.read_text(encoding="utf8") for path in probes.iterdir()}
    assert seen and set(seen.values()) == {"CupyOps"}, seen
    assert str(os.getpid()) not in seen  # the workers evaluated, not this process
    assert_same_scores(srsly.read_json(out), srsly.json_loads(srsly.json_dumps(expected)))
