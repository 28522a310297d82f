"""`spacy lean train`: data-parallel training on 2 CPU processes (gloo) against one
process, dev scores against `spacy evaluate`, a dying rank, resuming (also on another
number of processes), only rank 0 writing. Every run is the real CLI in subprocesses
with the tiny local transformer."""

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter

import numpy
import pytest
import spacy
import srsly
from spacy.training import Example
from spacy.cli.init_config import fill_config
from thinc.api import Config

from spacy_lean import synthetic
from spacy_lean.training.stopping import STOPPED_EXIT_CODE

from eval_util import ruler_patterns  # noqa: E402
from linker_util import ADA, RAIN, ZED, make_linker_kb, set_links  # noqa: E402

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

# Every source of randomness in an update is off, so 2 ranks x B examples must give
# the update of 1 process x 2B: thinc dropout 0, the BERT's own dropout 0, no random
# oracle cut in the parser; plain SGD (no averages, no L2), so the scale of the summed
# gradient shows directly in the weights.
SETTINGS = {
    "components.transformer.model.transformer_config": {
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
    "training.optimizer": {
        "@optimizers": "SGD.v1",
        "learn_rate": 0.0002,
        "L2": 0.0,
        "grad_clip": 0.0,
        "use_averages": False,
    },
    "training.batcher": {"@batchers": "spacy.batch_by_sequence.v1", "size": 4, "get_length": None},
    # The barely trained ner finds no entities yet: a ruler makes the dev scores
    # compared with `spacy evaluate` non-zero.
    "components.entity_ruler": {"factory": "entity_ruler", "overwrite_ents": False},
    "initialize.components.entity_ruler.patterns": {
        "@readers": "srsly.read_json.v1",
        "path": "${paths.patterns}",
    },
    "training.before_to_disk": {"@callbacks": "test_ddp.record_writer.v1"},
    "training.before_update": {"@callbacks": "test_ddp.die_at.v1"},
}

# Registered in the training processes with --code: a before_to_disk callback that
# records which rank saves (only rank 0 may), and a before_update callback that makes
# one rank exit at one step (the test of a dying rank).
CODE = """
import os
import signal
from pathlib import Path
from spacy.util import registry


@registry.callbacks("test_ddp.record_writer.v1")
def record_writer():
    def before_to_disk(nlp):
        out = os.environ.get("DDP_TEST_WRITERS")
        if out:
            with open(out, "a", encoding="utf8") as file_:
                file_.write(os.environ.get("RANK", "none") + "\\n")
        # SIGTERM while the first evaluation's models are saved (after the step's update).
        if os.environ.pop("DDP_TEST_TERM_AT_SAVE", None):
            os.kill(os.getpid(), signal.SIGTERM)
        return nlp
    return before_to_disk


@registry.callbacks("test_ddp.die_at.v1")
def die_at():
    def before_update(nlp, info):
        rank, step = os.environ.get("DDP_TEST_DIE_RANK"), os.environ.get("DDP_TEST_DIE_STEP")
        if rank is not None and os.environ.get("RANK", "0") == rank and info["step"] == int(step):
            os._exit(3)
        # SIGTERM (or DDP_TEST_TERM_SIGNAL) at one step, from rank 0, to itself or to
        # its parent (the launcher).
        term = os.environ.get("DDP_TEST_TERM_STEP")
        if term is not None and os.environ.get("RANK", "0") == "0" and info["step"] == int(term):
            parent = os.environ.get("DDP_TEST_TERM_TARGET") == "parent"
            signum = getattr(signal, os.environ.get("DDP_TEST_TERM_SIGNAL", "SIGTERM"))
            os.kill(os.getppid() if parent else os.getpid(), signum)
    return before_update
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trf_ner_config):
    return make_setup(tmp_path_factory.mktemp("ddp"), trf_ner_config)


def make_setup(root, trf_ner_config):
    """Write the corpora, the filled config and the --code file into `root`."""
    # Short docs (no 60-sentence tail): small batches, quick steps.
    synthetic.write_ner_corpus(root / "train.spacy", 48, seed=21, long_doc_rate=0.0)
    synthetic.write_ner_corpus(root / "dev.spacy", 17, seed=22, long_doc_rate=0.0)
    config = Config().from_str(trf_ner_config, interpolate=False)
    for dotted, value in SETTINGS.items():
        *parents, last = dotted.split(".")
        section = config
        for name in parents:
            section = section.setdefault(name, {})
        section[last] = value
    config["training"].update(max_epochs=-1, dropout=0.0)
    config["components"]["ner"]["update_with_oracle_cut_size"] = 0
    config["nlp"]["pipeline"] = ["transformer", "ner", "entity_ruler"]
    config["paths"]["patterns"] = str(root / "patterns.json")
    srsly.write_json(root / "patterns.json", ruler_patterns())
    config.to_disk(root / "partial.cfg")
    fill_config(root / "config.cfg", root / "partial.cfg", silent=True)
    (root / "code.py").write_text(CODE, encoding="utf8")
    return root


# `spacy lean train` started by torchrun with 2 processes (its own rendezvous).
TORCHRUN = ["torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d"]
TORCHRUN += ["--rdzv-endpoint", "localhost:0"]


def run_train(setup, output, *args, env=None, timeout=240, stock=False, torchrun=False):
    """`spacy lean train` (or, with `stock`, spaCy's own `spacy train`) on the setup's
    config with max_steps 3 (4 SGD steps: steps 0 to 3, as in `spacy train`), evaluating at
    steps 0 and 2."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        "-m",
        *(TORCHRUN + ["-m"] if torchrun else []),
        "spacy",
        *(["train"] if stock else ["lean", "train"]),
        str(setup / "config.cfg"),
        "--output",
        str(output),
        "--code",
        str(setup / "code.py"),
        "--paths.train",
        str(setup / "train.spacy"),
        "--paths.dev",
        str(setup / "dev.spacy"),
        "--training.max_steps",
        "3",
        "--training.eval_frequency",
        "2",
        *[str(a) for a in args],
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.monotonic() - start
    return proc


def params_of(path):
    """Every trainable parameter of a saved pipeline, by stable name."""
    from spacy_lean.training.dist import collect_params

    nlp = spacy.load(path)
    return {e.name: e.get_value().detach().cpu().numpy().copy() for e in collect_params(nlp)}


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float(numpy.abs(a[k] - b[k]).max()) for k in a)


def largest_diffs(a, b, n=5):
    """For a failure message: the `n` parameters that differ most, with the largest
    difference and the largest magnitude of each."""
    rows = [
        (float(numpy.abs(a[k] - b[k]).max(initial=0.0)), k, float(numpy.abs(b[k]).max(initial=0.0)))
        for k in a
    ]
    return [f"{k}: diff {d:.3g}, max |value| {m:.3g}" for d, k, m in sorted(rows)[::-1][:n]]


def batch_8_run(setup, tmp_path_factory, name, *args, stock=False):
    """A run of `setup` with batches of 8 docs (one process) in a new folder `name`,
    which must succeed: (the folder, the process)."""
    out = tmp_path_factory.mktemp(name)
    proc = run_train(setup, out, "--training.batcher.size", "8", *args, stock=stock)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


@pytest.fixture(scope="module")
def one_rank(setup, tmp_path_factory):
    return batch_8_run(setup, tmp_path_factory, "one_rank")


@pytest.fixture(scope="module")
def two_ranks(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    writers = out.parent / (out.name + "-writers.txt")
    proc = run_train(setup, out, "--nproc", "2", env={"DDP_TEST_WRITERS": str(writers)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc, writers


# spaCy's parser computes the gradient of its precomputed hidden layer's W for
# missing state features (id -1) from X[-1], the last token vector of the batch
# (spacy/ml/_precomputable_affine.py), so that one gradient depends on how examples
# are grouped into (sub-)batches, in one process too (see the next test). `lean_update`
# (exact_parser_gradient, on by default) removes that term, which makes the rank split
# exact for every parameter.
GROUPING_DEPENDENT = ("precomputable_affine/W",)


def test_two_ranks_batch_b_equal_one_rank_batch_2b(one_rank, two_ranks):
    """After 4 SGD steps, 2 ranks with 4 docs each hold the weights of 1 process with
    8: the gradients are summed. Tolerance 1e-5 absolute (float32 sums in another
    order), while one step moves the weights by far more (an averaging loop would be
    off by half a step)."""
    single = params_of(one_rank[0] / "model-last")
    double = params_of(two_ranks[0] / "model-last")
    diff = max_diff(single, double)  # the parser's W included
    assert diff < 1e-5, (diff, largest_diffs(double, single))
    # model-best is the step-0 or step-2 pipeline: at least one step behind.
    moved = max_diff(double, params_of(two_ranks[0] / "model-best"))
    assert moved > 100 * 1e-5, moved
    # The resumable state holds the final (not averaged) weights.
    assert max_diff(params_of(two_ranks[0] / "training-state" / "model"), double) == 0.0


@pytest.fixture(scope="module")
def stock_one_rank(setup, tmp_path_factory):
    return batch_8_run(setup, tmp_path_factory, "stock_one_rank", stock=True)[0]


def without_grouping_dependent(params):
    return {k: v for k, v in params.items() if not k.endswith(GROUPING_DEPENDENT)}


def test_one_rank_gives_stock_spacy_trains_weights(one_rank, stock_one_rank):
    """`spacy lean train` on one process makes spaCy's own updates: after 4 SGD steps its
    weights are `spacy train`'s, within float noise (1e-5: its length-sorted span groups
    sum in another order), except the parser's W, whose stock gradient depends on the
    batch's last doc (GROUPING_DEPENDENT; the exact gradient moves it differently)."""
    lean = params_of(one_rank[0] / "model-last")
    stock = params_of(stock_one_rank / "model-last")
    diff = max_diff(without_grouping_dependent(lean), without_grouping_dependent(stock))
    assert diff < 1e-5, (diff, largest_diffs(lean, stock))
    # Not a trivial match: the steps moved the weights far more than that.
    initial = params_of(one_rank[0] / "model-best")
    assert max_diff(lean, initial) > 100 * 1e-5


# spaCy's parser/ner lower layer draws its initialisation from the device's generator
# (`ops.xp.random` in spacy/ml/_precomputable_affine.py: cupy's on a GPU, numpy's on the
# CPU), so a GPU run and a CPU run with the same seed start from other ner weights. To
# compare GPU training with CPU training, both start from one pipeline initialised on
# the CPU (`spacy init nlp`), every component sourced from it.
@pytest.fixture(scope="module")
def sourced_setup(setup, tmp_path_factory):
    """The setup's config with every component sourced from a pipeline that `spacy init
    nlp` initialised on the CPU (config.cfg there: the same training settings)."""
    root = tmp_path_factory.mktemp("sourced")
    init = root / "init"
    cmd = [sys.executable, "-m", "spacy", "init", "nlp", str(setup / "config.cfg"), str(init)]
    cmd += ["--code", str(setup / "code.py"), "--paths.train", str(setup / "train.spacy")]
    cmd += ["--paths.dev", str(setup / "dev.spacy")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = Config().from_disk(setup / "config.cfg", interpolate=False)
    for name in config["nlp"]["pipeline"]:
        config["components"][name] = {"source": str(init)}
    for file_ in ("train.spacy", "dev.spacy", "code.py", "patterns.json"):
        shutil.copy(setup / file_, root / file_)
    config.to_disk(root / "config.cfg")
    return root


@pytest.fixture(scope="module")
def cpu_sourced(sourced_setup, tmp_path_factory):
    return batch_8_run(sourced_setup, tmp_path_factory, "cpu_sourced")[0]


def test_a_run_from_a_sourced_initialisation_trains_as_one_that_initialises(
    one_rank, cpu_sourced, sourced_setup
):
    """On the CPU, training from the pipeline `spacy init nlp` saved (every component
    sourced) gives the weights of the run that initialised in-process: sourcing changes
    nothing but where the initial weights come from, so the GPU run can start from them
    (test_gpu_training_from_cpu_initialised_weights_gives_the_cpu_weights)."""
    sourced, initialised = params_of(cpu_sourced / "model-last"), params_of(
        one_rank[0] / "model-last"
    )
    diff = max_diff(sourced, initialised)
    assert diff < 1e-6, (diff, largest_diffs(sourced, initialised))
    assert max_diff(initialised, params_of(sourced_setup / "init")) > 100 * 1e-5  # it trained


def test_only_the_parser_hidden_w_gradient_depends_on_grouping_in_one_process(setup):
    """Why `lean_update`'s exact parser gradient matters here, shown with spaCy's own
    `nlp.update` in one process: the summed gradients of 2 x 4 examples equal those of
    8 examples except the parser's W."""
    from spacy.training import Corpus

    from spacy_lean.training.dist import collect_params

    def grads(groups):
        nlp = spacy.util.load_model_from_config(
            spacy.util.load_config(setup / "config.cfg"), auto_fill=True
        )
        nlp.initialize(lambda: examples)
        for group in groups:
            nlp.update(group, sgd=False, drop=0.0)
        return {
            e.name: e.grad_tensor().detach().numpy().copy()
            for e in collect_params(nlp)
            if e.grad_tensor() is not None
        }

    spacy.util.fix_random_seed(0)
    examples = list(Corpus(setup / "train.spacy")(spacy.blank("en")))[:8]
    whole = grads([examples])
    spacy.util.fix_random_seed(0)
    split = grads([examples[0::2], examples[1::2]])
    assert whole.keys() == split.keys()
    differ = {k for k in whole if not numpy.allclose(whole[k], split[k], rtol=1e-4, atol=1e-4)}
    assert differ == {k for k in whole if k.endswith(GROUPING_DEPENDENT)}


def test_only_rank_0_logs_and_writes(two_ranks):
    out, proc, writers = two_ranks
    assert writers.read_text().split() and set(writers.read_text().split()) == {"0"}
    assert proc.stdout.count("Initial learn rate") == 1
    assert "Data-parallel: 2 ranks (gloo)" in " ".join(proc.stdout.split())
    assert "use_upper = true" not in proc.stdout  # the transformer ner has no upper layer
    assert (out / "model-best").exists() and (out / "model-last").exists()
    state = srsly.read_json(out / "training-state" / "state.json")
    assert state["world_size"] == 2 and state["step"] == 3 and len(state["ranks"]) == 2


def test_dev_scores_equal_spacy_evaluate(setup, two_ranks):
    """The score rank 0 saved (from the two ranks' merged states) is what
    `spacy evaluate` computes on the saved pipeline, in one process."""
    from spacy.cli.evaluate import evaluate

    out = two_ranks[0]
    meta = srsly.read_json(out / "model-best" / "meta.json")
    scores = evaluate(str(out / "model-best"), setup / "dev.spacy", silent=True)
    for key in ("ents_f", "ents_p", "ents_r"):
        # meta.json holds 10 decimals.
        assert meta["performance"][key] == pytest.approx(scores[key], abs=1e-9), key
    assert 0.1 < scores["ents_f"] < 1.0
    ours, theirs = meta["performance"]["ents_per_type"], scores["ents_per_type"]
    assert sorted(ours) == sorted(theirs)
    for label, prf in theirs.items():
        assert ours[label] == pytest.approx(prf, abs=1e-9), label


@pytest.fixture(scope="module")
def died(setup, tmp_path_factory):
    """A 2-rank run whose rank 1 exits at step 3, after the checkpoint of step 2."""
    out = tmp_path_factory.mktemp("died") / "run"
    proc = run_train(
        setup,
        out,
        "--nproc",
        "2",
        "--timeout",
        "60",
        env={"DDP_TEST_DIE_RANK": "1", "DDP_TEST_DIE_STEP": "3"},
    )
    return out, proc


def test_a_dying_rank_stops_the_run(died):
    """The launcher stops rank 0 and says which rank died, in bounded time; the
    checkpoint of step 2 is there to resume from."""
    out, proc = died
    assert proc.returncode == 3
    assert "Rank 1 of 2 exited with code 3" in " ".join((proc.stdout + proc.stderr).split())
    assert proc.seconds < 120
    state = srsly.read_json(out / "training-state" / "state.json")
    assert state["step"] == 2
    # Each rank's update policy is saved with the checkpoint (its learned limits are
    # restored on resume).
    assert [r["update_policy"]["batches"] for r in state["ranks"]] == [3, 3]
    assert all(r["update_policy"]["learned_limits"] == {} for r in state["ranks"])


def test_resume_restores_the_smallest_learned_limits():
    """On resume, each padded size gets the smallest micro-batch limit any saved rank
    learned; the resumed run's settings are kept; states saved before the policy was
    saved (no entry) resume with nothing learned."""
    from spacy_lean.training import UpdatePolicy
    from spacy_lean.training.loop import restore_learned_limits

    saved = [
        {"update_policy": UpdatePolicy(learned_limits={1024: 512, 4096: 2048}).to_dict()},
        {"update_policy": UpdatePolicy(learned_limits={1024: 256}).to_dict()},
        {},
    ]
    policy = UpdatePolicy(max_padded_tokens=3000, learned_limits={4096: 1024})
    restore_learned_limits(policy, saved)
    assert policy.learned_limits == {1024: 256, 4096: 1024}
    assert policy.max_padded_tokens == 3000
    fresh = UpdatePolicy()
    restore_learned_limits(fresh, [{}])
    assert fresh.learned_limits == {}


def test_resume_past_max_steps_says_what_to_do(setup, died):
    """The died run's state is at step 2: resuming it with max_steps 2 has nothing left
    to train, and says how to go on instead of silently saving the same pipeline."""
    out, _ = died
    proc = run_train(setup, out, "--resume", "--training.max_steps", "2")
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0
    assert "at step 2, and this run's training.max_steps is 2" in text
    assert "--training.max_steps 4" in text


@pytest.mark.slow
def test_resume_on_the_same_and_another_number_of_processes(
    setup, one_rank, two_ranks, died, tmp_path
):
    """Resuming the died run with 2 processes gives the weights of the uninterrupted
    2-process run; resuming it with 1 process (8 docs a step) skips the examples the 2
    ranks trained on and gives the weights of the uninterrupted 1-process run. The
    resumed run takes its settings from the command line (--training.batcher.size)."""
    same_n, other_n = tmp_path / "same_n", tmp_path / "other_n"
    shutil.copytree(died[0], same_n)
    shutil.copytree(died[0], other_n)

    proc = run_train(setup, same_n, "--nproc", "2", "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = " ".join(proc.stdout.split())  # wasabi wraps long lines
    assert "Resuming at step 3, epoch 0 (saved with 2 rank(s), now 2)" in log
    assert "replays its first 3 batches" in log
    assert max_diff(params_of(same_n / "model-last"), params_of(two_ranks[0] / "model-last")) < 1e-6

    proc = run_train(setup, other_n, "--resume", "--training.batcher.size", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The 2 ranks trained on 3 x 4 examples each: the one process skips 24 and trains
    # step 3 on examples 24-31.
    log = " ".join(proc.stdout.split())
    assert "(saved with 2 rank(s), now 1): each rank skips the first 24 examples" in log
    state = srsly.read_json(other_n / "training-state" / "state.json")
    assert state["world_size"] == 1 and state["step"] == 3
    assert state["ranks"][0]["examples"] == 8 and state["ranks"][0]["batches"] == 1
    assert state["ranks"][0]["skipped"] == 24
    # Here the shares are interleaved (stock reader), so the examples are exactly those
    # of the uninterrupted 1-process run, and so are the weights.
    assert max_diff(params_of(other_n / "model-last"), params_of(one_rank[0] / "model-last")) < 1e-5


def resumes_to_the_uninterrupted_run(setup, out, args, one_rank):
    """`--resume` of the stopped run in `out` trains on to the uninterrupted run's weights."""
    proc = run_train(setup, out, "--resume", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert max_diff(params_of(out / "model-last"), params_of(one_rank[0] / "model-last")) < 1e-6


def test_sigterm_stops_one_process_after_its_step_and_resume_goes_on(setup, one_rank, tmp_path):
    """SIGTERM at step 1 (a scheduler's stop): the run finishes step 1, saves the state
    of step 1 (no evaluation there) and exits with 143; --resume then trains steps 2-3
    to the weights of the uninterrupted run. spaCy's loop dies at once, with only the
    step-0 state."""
    out = tmp_path / "run"
    args = ("--training.batcher.size", "8")
    proc = run_train(setup, out, *args, env={"DDP_TEST_TERM_STEP": "1"})
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == STOPPED_EXIT_CODE, log
    assert "Stopped by SIGTERM after step 1." in log
    assert f"saved in {out / 'training-state'}: continue with the same command and --resume" in log
    assert "Traceback" not in log
    state = srsly.read_json(out / "training-state" / "state.json")
    assert state["step"] == 1 and state["ranks"][0]["batches"] == 2
    assert (out / "model-last" / "meta.json").exists()
    assert not list(tmp_path.glob("run/*.tmp")) and not list(tmp_path.glob("run/*.old"))

    proc = run_train(setup, out, "--resume", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Resuming at step 2, epoch 0" in " ".join(proc.stdout.split())
    assert max_diff(params_of(out / "model-last"), params_of(one_rank[0] / "model-last")) < 1e-6


@pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")
def test_ctrl_c_stops_one_process_after_its_step_and_resume_goes_on(setup, one_rank, tmp_path):
    """Ctrl-C (SIGINT) at step 1 stops the run as SIGTERM does: it says at once what it
    will do, finishes step 1, saves its state and exits with 143, and --resume trains on
    to the uninterrupted run's weights. spaCy's loop (and this one before) died of it
    where it was, with the state of the last evaluation only (step 0)."""
    out = tmp_path / "run"
    args = ("--training.batcher.size", "8")
    env = {"DDP_TEST_TERM_STEP": "1", "DDP_TEST_TERM_SIGNAL": "SIGINT"}
    proc = run_train(setup, out, *args, env=env)
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == STOPPED_EXIT_CODE, log
    assert (
        "Received SIGINT: training stops after this step and saves its training state "
        "(continue with --resume). Press Ctrl-C again to stop at once" in log
    )
    assert "Stopped by SIGINT after step 1." in log
    assert "Traceback" not in log and "Aborted" not in log
    assert srsly.read_json(out / "training-state" / "state.json")["step"] == 1

    resumes_to_the_uninterrupted_run(setup, out, args, one_rank)


def test_a_stop_during_an_evaluation_ends_one_process_after_that_step(setup, one_rank, tmp_path):
    """SIGTERM while step 0's evaluation saves its models (after the step's gradient
    all-reduce, which carries the ranks' stop flags): one process stops after step 0, not
    after step 1 as ranks that must agree do, and --resume goes on to the uninterrupted
    run's weights."""
    out = tmp_path / "run"
    args = ("--training.batcher.size", "8")
    proc = run_train(setup, out, *args, env={"DDP_TEST_TERM_AT_SAVE": "1"})
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == STOPPED_EXIT_CODE, log
    assert "Stopped by SIGTERM after step 0." in log
    assert srsly.read_json(out / "training-state" / "state.json")["step"] == 0
    resumes_to_the_uninterrupted_run(setup, out, args, one_rank)


def test_sigterm_to_the_launcher_stops_every_rank_with_a_checkpoint(setup, two_ranks, tmp_path):
    """SIGTERM to `spacy lean train --nproc 2` (rank 0 sends it at step 0): the launcher
    passes it on, the ranks agree on the step to stop after, rank 0 saves its state,
    every process exits (143), and --resume gives the uninterrupted run's weights."""
    out = tmp_path / "run"
    env = {"DDP_TEST_TERM_STEP": "0", "DDP_TEST_TERM_TARGET": "parent"}
    proc = run_train(setup, out, "--nproc", "2", "--timeout", "60", env=env)
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == STOPPED_EXIT_CODE, log
    assert "Received SIGTERM: each rank finishes its step" in log
    assert "Every rank has stopped (exit code 143)." in log
    assert "Traceback" not in log
    state = srsly.read_json(out / "training-state" / "state.json")
    # The signal reaches the ranks in step 0 or, passed on by the launcher, in step 1 at the
    # latest (steps 2 and 3 are margin: a stop there would end as max_steps ends).
    assert state["step"] in (0, 1) and f"Stopped by SIGTERM after step {state['step']}." in log
    assert [r["batches"] for r in state["ranks"]] == [state["step"] + 1] * 2

    proc = run_train(setup, out, "--nproc", "2", "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert max_diff(params_of(out / "model-last"), params_of(two_ranks[0] / "model-last")) < 1e-6


@pytest.mark.slow
def test_torchrun_gives_the_launchers_run(setup, two_ranks, tmp_path):
    """The same command under torchrun (2 processes, its c10d rendezvous) trains the
    weights of `--nproc 2` (< 1e-6), and only rank 0 writes."""
    out = tmp_path / "run"
    writers = tmp_path / "writers.txt"
    proc = run_train(setup, out, torchrun=True, env={"DDP_TEST_WRITERS": str(writers)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert max_diff(params_of(out / "model-last"), params_of(two_ranks[0] / "model-last")) < 1e-6
    assert set(writers.read_text().split()) == {"0"}


def test_a_state_left_between_the_two_renames_is_resumed(died, tmp_path):
    """A run killed between `replace_dir`'s renames leaves training-state.old only:
    resuming reads it there."""
    from spacy_lean.training.loop import read_training_state

    out = tmp_path / "run"
    shutil.copytree(died[0], out)
    (out / "training-state").rename(out / "training-state.old")
    state = read_training_state(out)
    assert state["step"] == 2 and state["path"] == str(out / "training-state.old")


def test_optimizer_state_round_trips_by_name_without_pickle(tmp_path):
    """Adam's moments and update counts are saved by stable parameter names and load
    into a rebuilt pipeline whose model ids differ."""
    from thinc.api import Adam

    from spacy_lean.training.dist import collect_params, load_optimizer, save_optimizer

    def build():
        nlp = spacy.blank("en")
        nlp.add_pipe("textcat")
        nlp.initialize(
            lambda: [
                spacy.training.Example.from_dict(
                    nlp.make_doc("a b"), {"cats": {"A": 1.0, "B": 0.0}}
                )
            ]
        )
        return nlp

    nlp = build()
    eg = spacy.training.Example.from_dict(nlp.make_doc("a b c"), {"cats": {"A": 1.0, "B": 0.0}})
    optimizer = Adam(0.01)
    for _ in range(2):
        nlp.update([eg], sgd=optimizer)
    entries = collect_params(nlp)
    save_optimizer(optimizer, entries, tmp_path / "opt.npz")
    numpy.load(tmp_path / "opt.npz", allow_pickle=False).close()
    other = build()
    fresh = Adam(0.01)
    other_entries = collect_params(other)
    assert [e.key for e in other_entries] != [e.key for e in entries]
    assert load_optimizer(fresh, other_entries, tmp_path / "opt.npz") == len(entries)
    for a, b in zip(entries, other_entries):
        assert fresh.nr_update[b.key] == optimizer.nr_update[a.key] == 2
        numpy.testing.assert_array_equal(fresh.mom1[b.key], optimizer.mom1[a.key])
        numpy.testing.assert_array_equal(fresh.mom2[b.key], optimizer.mom2[a.key])
    with pytest.raises(ValueError, match="saved for another model"):
        load_optimizer(
            Adam(0.01),
            other_entries + [type(entries[0])("x/0:y/W", (0, "W"), (1,))],
            tmp_path / "opt.npz",
        )


def test_grad_scalers_finds_each_enabled_scaler_once(trf_ner_dir):
    from spacy_lean.training.dist import grad_scalers

    mixed_precision = {"components": {"transformer": {"model": {"mixed_precision": True}}}}
    mixed = spacy.load(trf_ner_dir, config=mixed_precision)
    scalers = grad_scalers(mixed)
    assert len(scalers) == 1 and scalers[0]._enabled
    assert grad_scalers(mixed, exclude=["transformer"]) == []
    assert grad_scalers(spacy.load(trf_ner_dir)) == []  # mixed precision off: nothing to agree on


def _overflow_worker(rank, world_size, store, result_dir):
    from thinc.shims.pytorch_grad_scaler import PyTorchGradScaler

    from spacy_lean.training.dist import DistContext, agree_on_overflow

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        ctx = DistContext(rank=rank, world_size=world_size, backend="gloo")
        scalers = [PyTorchGradScaler(enabled=True) for _ in range(3)]
        # Rank 0's first shim overflowed, rank 1's third; the second nowhere.
        scalers[0 if rank == 0 else 2]._found_inf = True
        skipped = agree_on_overflow(ctx, scalers)
        found = [s.found_inf for s in scalers]
        for s in scalers:
            s.update()  # the step's end: the flags reset, the scale backs off where skipped
        scales = [float(s._scale) for s in scalers]
        srsly.write_json(
            os.path.join(result_dir, f"rank{rank}.json"),
            {"skipped": skipped, "found": found, "scales": scales},
        )
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_ranks_skip_an_overflowed_mixed_precision_step_together(tmp_path):
    """A rank whose grad scaler found inf/NaN skips the step; the others must skip it
    too (they would step with the overflowed sum), and all scales back off alike."""
    import torch.multiprocessing as mp

    mp.spawn(
        _overflow_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True
    )
    results = [srsly.read_json(tmp_path / f"rank{r}.json") for r in range(2)]
    for result in results:
        assert result["skipped"] == [True, False, True]
        assert result["found"] == [True, False, True]
    assert results[0]["scales"] == results[1]["scales"]
    assert results[0]["scales"][0] < results[0]["scales"][1]  # backed off where skipped


def test_agree_on_overflow_in_one_process_keeps_the_local_flags():
    from thinc.shims.pytorch_grad_scaler import PyTorchGradScaler

    from spacy_lean.training.dist import DistContext, agree_on_overflow

    scalers = [PyTorchGradScaler(enabled=True), PyTorchGradScaler(enabled=True)]
    scalers[1]._found_inf = True
    assert agree_on_overflow(DistContext(), scalers) == [False, True]
    assert agree_on_overflow(DistContext(), []) == []


@pytest.mark.slow
def test_a_rank_left_without_training_docs_warns_and_the_run_goes_on(tmp_path, tiny_ner_config):
    """`spacy lean train --nproc 2` on a 1-doc corpus read by spacy-lean.Corpus.v1
    (share_by = "doc"): rank 1 gets no data. The gradient all-reduce does not hang on
    it (a rank without a batch sends zeros, see "Uneven shares"): the run trains on rank
    0's doc and ends normally, and rank 1 now says it has no data and why (it was
    silent). About 15 s: two fresh processes."""
    synthetic.write_ner_corpus(tmp_path / "train.spacy", 1, seed=51, long_doc_rate=0.0)
    synthetic.write_ner_corpus(tmp_path / "dev.spacy", 4, seed=52, long_doc_rate=0.0)
    config = tiny_ner_config()
    config["corpora"]["train"] = {"@readers": "spacy-lean.Corpus.v1", "path": "${paths.train}"}
    config["training"].update(max_steps=4, eval_frequency=2)
    config.to_disk(tmp_path / "config.cfg")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable, "-m", "spacy", "lean", "train", str(tmp_path / "config.cfg"),
        "--output", str(tmp_path / "out"), "--nproc", "2", "--timeout", "60",
        "--paths.train", str(tmp_path / "train.spacy"), "--paths.dev", str(tmp_path / "dev.spacy"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stderr.split())
    assert "share_by = 'doc' gives 1 doc(s) for 2 workers: worker 1 gets no data" in text
    assert "Rank 1 of 2: " in text  # a warning of rank 1 says whose it is
    assert str(tmp_path / "train.spacy") in text and "--nproc" in text
    assert "worker 0 gets no data" not in text
    state = srsly.read_json(tmp_path / "out" / "training-state" / "state.json")
    assert state["step"] == 4 and [r["examples"] for r in state["ranks"]] == [1, 0]


def test_dist_backend_is_checked_before_anything_starts(setup, tmp_path):
    proc = run_train(setup, tmp_path / "nccl", "--nproc", "2", "--dist-backend", "nccl")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1 and "--dist-backend nccl needs GPUs: give --gpu-ids" in out
    proc = run_train(setup, tmp_path / "mpi", "--dist-backend", "mpi")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1 and "must be one of auto, nccl, gloo, got 'mpi'" in out
    assert not (tmp_path / "nccl").exists() and not (tmp_path / "mpi").exists()


def test_context_backend_choice():
    from spacy_lean.training.dist import context_from_env

    auto = context_from_env([0])
    assert auto.backend is None and auto.gpu_id == 0  # init picks nccl for a GPU
    gloo = context_from_env([0], backend="gloo")
    # gloo with a GPU: the collectives' buffers live in host memory.
    assert gloo.backend == "gloo" and str(gloo.device) == "cpu"
    assert str(context_from_env([1], backend="nccl").device) == "cuda:1"
    with pytest.raises(ValueError, match="nccl needs GPUs"):
        context_from_env([], backend="nccl")


# On a GPU. With one GPU, two ranks share it over gloo (nccl refuses two ranks on one
# device); with two or more, nccl. Tolerance 1e-4 absolute on the weights after 4 SGD
# steps (GPU and CPU kernels sum in other orders), while the steps move them by more
# than 1e-3 (test_two_ranks_batch_b_equal_one_rank_batch_2b).
GPU_TOL = 1e-4


# First, as the most telling (the device's time is short).
@pytest.fixture(scope="module")
def gpu_sourced(sourced_setup, tmp_path_factory):
    return batch_8_run(sourced_setup, tmp_path_factory, "gpu_sourced", "--gpu-ids", "0")[0]


@pytest.mark.gpu
def test_gpu_training_from_cpu_initialised_weights_gives_the_cpu_weights(cpu_sourced, gpu_sourced):
    """From the same initial weights (initialised on the CPU: spaCy's ner initialises
    from the device's generator), `spacy lean train` on the GPU ends with the CPU run's
    weights, within GPU_TOL (GPU and CPU kernels sum in other orders)."""
    cpu, gpu = params_of(cpu_sourced / "model-last"), params_of(gpu_sourced / "model-last")
    diff = max_diff(cpu, gpu)
    assert diff < GPU_TOL, (diff, largest_diffs(gpu, cpu))


@pytest.fixture(scope="module")
def gpu_one_rank(setup, tmp_path_factory):
    return batch_8_run(setup, tmp_path_factory, "gpu_one_rank", "--gpu-ids", "0")[0]


@pytest.fixture(scope="module")
def gpu_stock_one_rank(setup, tmp_path_factory):
    out, _ = batch_8_run(setup, tmp_path_factory, "gpu_stock_one_rank", "--gpu-id", "0", stock=True)
    return out


@pytest.mark.gpu
def test_gpu_training_gives_stock_spacy_trains_gpu_weights(gpu_one_rank, gpu_stock_one_rank):
    """On the GPU as on the CPU (test_one_rank_gives_stock_spacy_trains_weights), the
    lean loop makes spaCy's updates."""
    lean = params_of(gpu_one_rank / "model-last")
    stock = params_of(gpu_stock_one_rank / "model-last")
    diff = max_diff(without_grouping_dependent(lean), without_grouping_dependent(stock))
    assert diff < GPU_TOL, (diff, largest_diffs(lean, stock))


@pytest.mark.gpu
def test_gpu_training_is_as_close_to_the_cpu_as_stock_spacy_is(
    one_rank, gpu_one_rank, stock_one_rank, gpu_stock_one_rank
):
    """The GPU run's weights against the CPU run's: GPU_TOL, or no further apart than
    spaCy's own `spacy train` on the GPU and on the CPU (the first GPU run, on an H100,
    found 0.025 between the lean runs, above GPU_TOL: this tells whether spaCy's own
    GPU kernels account for it)."""
    cpu, gpu = params_of(one_rank[0] / "model-last"), params_of(gpu_one_rank / "model-last")
    stock_cpu = params_of(stock_one_rank / "model-last")
    stock_gpu = params_of(gpu_stock_one_rank / "model-last")
    diff, stock_diff = max_diff(cpu, gpu), max_diff(stock_cpu, stock_gpu)
    assert diff < max(GPU_TOL, 2 * stock_diff), (
        diff,
        stock_diff,
        largest_diffs(gpu, cpu),
        largest_diffs(stock_gpu, stock_cpu),
    )


@pytest.mark.gpu
def test_two_gpu_ranks_batch_b_equal_one_gpu_rank_batch_2b(setup, gpu_one_rank, tmp_path):
    if torch.cuda.device_count() >= 2:
        args, backend = ["--gpu-ids", "0,1"], "nccl"
    else:
        args, backend = ["--gpu-ids", "0,0", "--dist-backend", "gloo"], "gloo"
    proc = run_train(setup, tmp_path / "two", "--nproc", "2", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Data-parallel: 2 ranks ({backend})" in " ".join(proc.stdout.split())
    single, two = params_of(gpu_one_rank / "model-last"), params_of(tmp_path / "two" / "model-last")
    diff = max_diff(single, two)
    assert diff < GPU_TOL, (diff, largest_diffs(two, single))


# -- a tiny tok2vec + ner pipeline with probes, on 1 and 2 processes -----------------

# Registered in the training processes with --code: a component that reports losses
# under names that are no pipe's name (one of them differs per rank), one that records
# the batches the dev evaluation pipes (docs' lengths, per rank), and a logger that
# records what rank 0 logs.
PROBE_CODE = """
import json
import os
from spacy.language import Language
from spacy.util import registry


class LossProbe:
    lean_loss_reduction = "sum"

    def __call__(self, doc):
        return doc

    def update(self, examples, *, drop=0.0, sgd=None, losses=None):
        rank = os.environ.get("RANK", "0")
        for name, value in (("probe_examples", len(examples)), (f"probe_rank{rank}", 1.0)):
            losses[name] = losses.get(name, 0.0) + value
        return losses


@Language.factory("test_ddp_loss_probe")
def make_loss_probe(nlp, name):
    return LossProbe()


class EvalProbe:
    def _record(self, docs):
        out = os.environ.get("DDP_TEST_EVAL_DIR")
        if out:
            path = os.path.join(out, "rank" + os.environ.get("RANK", "0") + ".jsonl")
            with open(path, "a", encoding="utf8") as file_:
                file_.write(json.dumps([len(doc) for doc in docs]) + "\\n")

    def __call__(self, doc):
        self._record([doc])
        return doc

    def pipe(self, docs, batch_size=1000):
        docs = list(docs)  # the streaming evaluator pipes one batch per call
        self._record(docs)
        yield from docs


@Language.factory("test_ddp_eval_probe")
def make_eval_probe(nlp, name):
    return EvalProbe()


@registry.loggers("test_ddp.losses_log.v1")
def losses_log():
    def setup_logger(nlp, stdout, stderr):
        if os.environ.get("DDP_TEST_LOGGER_FAILS"):
            raise RuntimeError("probe: the logger's setup failed")

        def log_step(info):
            if info is not None:
                with open(os.environ["DDP_TEST_LOSSES_LOG"], "a", encoding="utf8") as file_:
                    file_.write(json.dumps([info["step"], info["losses"]]) + "\\n")

        return log_step, lambda: None

    return setup_logger
"""

EVAL_BUDGET = 60  # padded tokens per dev batch (eval_max_batch_tokens)


def run_tiny(root, output, *args, env=None, timeout=240):
    """`spacy lean train` of `root`/config.cfg with `root`/probe_code.py as --code."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable, "-m", "spacy", "lean", "train", str(root / "config.cfg"),
        "--output", str(output), "--code", str(root / "probe_code.py"), "--timeout", "60",
        *[str(a) for a in args],
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, tiny_ner_config):
    """tok2vec + ner + the two probes, stock spacy.Corpus.v1 for train (8 docs) and dev
    (6 docs), batches of 2 docs per rank, 4 steps (0-3) with evaluations at 0 and 2, the
    dev evaluation's budget set in spacy-lean.lean_training.v1."""
    root = tmp_path_factory.mktemp("tiny_ddp")
    synthetic.write_ner_corpus(root / "train.spacy", 8, seed=61, long_doc_rate=0.0)
    synthetic.write_ner_corpus(root / "dev.spacy", 6, seed=62, long_doc_rate=0.0)
    config = tiny_ner_config()
    config["paths"]["train"] = str(root / "train.spacy")
    config["paths"]["dev"] = str(root / "dev.spacy")
    config["nlp"]["pipeline"] = ["tok2vec", "ner", "loss_probe", "eval_probe"]
    config["components"]["loss_probe"] = {"factory": "test_ddp_loss_probe"}
    config["components"]["eval_probe"] = {"factory": "test_ddp_eval_probe"}
    config["nlp"]["after_pipeline_creation"] = {
        "@callbacks": "spacy-lean.lean_training.v1",
        "eval_max_batch_tokens": EVAL_BUDGET,
    }
    config["training"]["batcher"] = {
        "@batchers": "spacy.batch_by_sequence.v1", "size": 2, "get_length": None,
    }  # fmt: skip
    config["training"]["logger"] = {"@loggers": "test_ddp.losses_log.v1"}
    config["training"].update(max_steps=3, eval_frequency=2, dropout=0.0)
    config.to_disk(root / "config.cfg")
    (root / "probe_code.py").write_text(PROBE_CODE, encoding="utf8")
    return root


def tiny_run(root, name, *args):
    """Run into root/name; RETURNS (process, {step: losses logged}, {rank: dev batches})."""
    out = root / name
    evals = root / (name + "-eval")
    evals.mkdir()
    log = root / (name + "-losses.jsonl")
    env = {"DDP_TEST_EVAL_DIR": str(evals), "DDP_TEST_LOSSES_LOG": str(log)}
    proc = run_tiny(root, out, *args, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logged = {step: losses for step, losses in map(json.loads, log.read_text().splitlines())}
    batches = {
        int(path.stem[len("rank") :]): [json.loads(line) for line in path.read_text().splitlines()]
        for path in evals.glob("rank*.jsonl")
    }
    return proc, logged, batches


@pytest.fixture(scope="module")
def tiny_two_ranks(tiny_setup):
    return tiny_run(tiny_setup, "two", "--nproc", "2")


@pytest.fixture(scope="module")
def tiny_one_rank(tiny_setup):
    return tiny_run(tiny_setup, "one", "--training.batcher.size", "4")


@pytest.mark.slow
def test_losses_under_other_names_are_summed_over_the_ranks(
    tiny_setup, tiny_two_ranks, tiny_one_rank
):
    """A component reports losses under names that are no pipe's name (the examples it
    updated on, and 1 per step under a name of its rank's). With 2 ranks x 2 docs,
    what rank 0 logs is the sum over both ranks (it was rank 0's alone, and rank 1's
    name was missing), as one process with 4 docs a step logs it; the state saved at
    step 3 holds step 3's sums. About 25 s: 3 fresh processes."""
    proc, two, _ = tiny_two_ranks
    _, one, _ = tiny_one_rank
    # `spacy init config`'s ner has an upper layer, whose dropout no setting turns off.
    assert "ner: with use_upper = true, spaCy's parser model drops 10%" in " ".join(
        proc.stdout.split()
    )
    assert sorted(two) == sorted(one) == [0, 2]
    expected = {0: {"probe_examples": 4.0, "probe_rank0": 1.0, "probe_rank1": 1.0},
                2: {"probe_examples": 8.0, "probe_rank0": 2.0, "probe_rank1": 2.0}}  # fmt: skip
    for step, sums in expected.items():
        assert {k: v for k, v in two[step].items() if k.startswith("probe")} == sums, step
        assert one[step]["probe_examples"] == sums["probe_examples"]
        assert one[step]["probe_rank0"] == sums["probe_rank0"]
        assert two[step]["ner"] > 0  # the pipes' losses are there too
    state = srsly.read_json(tiny_setup / "two" / "training-state" / "state.json")
    assert state["step"] == 3
    assert {k: v for k, v in state["losses"].items() if k.startswith("probe")} == {
        "probe_examples": 4.0, "probe_rank0": 1.0, "probe_rank1": 1.0,
    }  # fmt: skip


@pytest.mark.slow
def test_eval_max_batch_tokens_reaches_the_dev_evaluation(tiny_two_ranks, tiny_one_rank):
    """spacy-lean.lean_training.v1's eval_max_batch_tokens is the padded-token budget
    of every dev batch of `spacy lean train`, on one process and on each of 2 ranks
    (without it, the 6 dev docs were one batch of several hundred padded tokens)."""
    for _, _, batches in (tiny_one_rank, tiny_two_ranks):
        for rank, piped in batches.items():
            assert all(len(b) == 1 or len(b) * max(b) <= EVAL_BUDGET for b in piped), piped
        lengths = sorted(n for piped in batches.values() for b in piped for n in b)
        assert len(lengths) == 6 * 2  # evaluated at steps 0 and 2: every doc once each
        assert len(lengths) * max(lengths) > EVAL_BUDGET  # the budget binds
    assert sorted(tiny_two_ranks[2]) == [0, 1] and sorted(tiny_one_rank[2]) == [0]


def test_a_rank_the_loop_leaves_without_examples_warns(tmp_path):
    """A stock reader is shared by the loop (example i to rank i % N): with fewer
    examples than ranks, the rank left without any warns once, after a whole pass over
    the reader, naming the reader, its path, the counts and the fix; listed
    (max_epochs >= 0) or streamed (-1). The ranks with examples do not warn."""
    import warnings

    from spacy.training import Corpus

    from spacy_lean.training.dist import DistContext
    from spacy_lean.training.loop import RankBatches

    synthetic.write_ner_corpus(tmp_path / "train.spacy", 1, seed=71, long_doc_rate=0.0)
    nlp = spacy.blank("en")
    corpus = Corpus(tmp_path / "train.spacy")
    batcher = spacy.registry.batchers.get("spacy.batch_by_sequence.v1")(size=2, get_length=None)
    name = f"[corpora.train] (spacy.Corpus.v1, {tmp_path / 'train.spacy'})"
    for max_epochs in (0, -1):
        for rank, n_batches in ((0, 1), (1, 0)):
            ctx = DistContext(rank=rank, world_size=2)  # not joined: no collective runs
            batches = RankBatches(nlp, corpus, batcher, max_epochs, ctx, name=name)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for epoch in range(2):
                    assert len(list(batches.epoch(epoch))) == n_batches
            texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
            if rank == 0:
                assert texts == []
                continue
            assert len(texts) == 1, texts  # once, not every epoch
            text = texts[0]
            assert text.startswith(name)
            assert "shares the reader's 1 example(s) among 2 processes" in text
            assert "rank 1 gets no data" in text
            assert "at least 2 docs" in text and "--nproc" in text


@pytest.mark.slow
def test_a_rank_left_without_training_docs_by_the_stock_reader_warns(tmp_path, tiny_ner_config):
    """`spacy lean train --nproc 2` on a 1-doc corpus read by the stock spacy.Corpus.v1
    (shared among the ranks by the loop): the run ends normally on rank 0's doc, and
    rank 1 says that it has no data, naming the corpus and the fix (it was silent).
    About 20 s: two fresh processes."""
    synthetic.write_ner_corpus(tmp_path / "train.spacy", 1, seed=53, long_doc_rate=0.0)
    synthetic.write_ner_corpus(tmp_path / "dev.spacy", 4, seed=54, long_doc_rate=0.0)
    config = tiny_ner_config()
    config["training"].update(max_steps=4, eval_frequency=2)
    config.to_disk(tmp_path / "config.cfg")
    (tmp_path / "probe_code.py").write_text("", encoding="utf8")
    paths = ["--paths.train", tmp_path / "train.spacy", "--paths.dev", tmp_path / "dev.spacy"]
    proc = run_tiny(tmp_path, tmp_path / "out", "--nproc", "2", *paths)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stderr.split())
    assert f"[corpora.train] (spacy.Corpus.v1, {tmp_path / 'train.spacy'})" in text
    assert "shares the reader's 1 example(s) among 2 processes" in text
    assert "rank 1 gets no data" in text and "--nproc" in text
    assert "rank 0 gets no data" not in text
    state = srsly.read_json(tmp_path / "out" / "training-state" / "state.json")
    assert state["step"] == 4 and [r["examples"] for r in state["ranks"]] == [1, 0]
    # Resumed, rank 1 has no batch to replay and rank 0 one: the epoch is one some rank
    # trained in (rank 1 alone took it for an epoch without examples: E986, exit 1).
    proc = run_tiny(
        tmp_path, tmp_path / "out", "--nproc", "2", "--resume", *paths, "--training.max_steps", "6"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Rank 0's count was given as every rank's.
    log = " ".join(proc.stdout.split())
    assert "the ranks replay the first 1, 0 batches of the epoch unused, in rank order" in log
    state = srsly.read_json(tmp_path / "out" / "training-state" / "state.json")
    assert state["step"] == 6


def test_a_mean_loss_is_logged_as_one_process_logs_it(tmp_path):
    """textcat's loss is a mean over the batch's docs. Each rank's was summed, so 2
    ranks with 4 docs each logged twice the loss of 1 process with 8 (an untrained
    textcat's 0.25 as 0.50); each rank's is now weighted by its share of the step's
    docs. The weights were right before and after (the gradients are summed)."""
    from spacy.cli.init_config import init_config
    from spacy.tokens import DocBin

    nlp = spacy.blank("en")
    words = "good fine great bad poor awful the a film plot".split()
    rng = numpy.random.default_rng(3)
    for name, n in (("train", 32), ("dev", 8)):
        bin_ = DocBin(store_user_data=True)
        for _ in range(n):
            doc = nlp.make_doc(" ".join(rng.choice(words, size=int(rng.integers(3, 9)))))
            positive = sum(w.text in ("good", "fine", "great") for w in doc) >= 1
            doc.cats = {"POS": float(positive), "NEG": float(not positive)}
            bin_.add(doc)
        bin_.to_disk(tmp_path / f"{name}.spacy")
    config = init_config(lang="en", pipeline=["textcat"], optimize="efficiency")
    config["training"].update(max_steps=3, eval_frequency=1, dropout=0.0, max_epochs=-1)
    config["training"]["batcher"] = {
        "@batchers": "spacy.batch_by_sequence.v1",
        "size": 8,
        "get_length": None,
    }
    config.to_disk(tmp_path / "config.cfg")

    def run(output, *args):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        cmd = [sys.executable, "-m", "spacy", "lean", "train", str(tmp_path / "config.cfg")]
        cmd += ["--output", str(output), "--paths.train", str(tmp_path / "train.spacy")]
        cmd += ["--paths.dev", str(tmp_path / "dev.spacy"), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return srsly.read_json(output / "model-last" / "meta.json")["performance"]

    one = run(tmp_path / "one")
    two = run(tmp_path / "two", "--nproc", "2", "--training.batcher.size", "4")
    assert one["textcat_loss"] > 0
    assert two["textcat_loss"] == pytest.approx(one["textcat_loss"], rel=1e-4)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--timeout", "0"], "--timeout must be a number of seconds > 0, got 0.0"),
        (["--timeout", "-1"], "--timeout must be a number of seconds > 0, got -1.0"),
        (["--timeout", "nan"], "--timeout must be a number of seconds > 0, got nan"),
        (["--max-padded-tokens", "0"], "--max-padded-tokens must be a positive number"),
    ],
)
def test_bad_numbers_are_refused_before_anything_starts(setup, tmp_path, args, needle):
    """A timeout of 0, -1 or NaN reached torch's rendezvous, which failed with its own
    C++ trace ("client socket has timed out after 0ms"); --max-padded-tokens 0 was
    refused only after the pipeline was initialised."""
    from spacy.cli._util import app
    from typer.testing import CliRunner

    import spacy_lean.cli  # noqa: F401  (adds `lean` to spaCy's CLI app)

    command = ["lean", "train", str(setup / "config.cfg"), "--output", str(tmp_path / "out")]
    result = CliRunner().invoke(app, command + ["--nproc", "2", *args])
    assert result.exit_code == 1 and needle in " ".join(result.output.split()), result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        # Trained on GPU 0 only, silently: one process, and local rank 0 takes the first id.
        (["--gpu-ids", "0,1"], "--gpu-ids names 2 GPUs (0,1) for 1 process(es)"),
        (["--nproc", "2", "--gpu-ids", "0,1,2"], "so 1 would stay idle. Add --nproc 3"),
        # --gpu-id was ignored.
        (["--gpu-id", "0", "--gpu-ids", "1,2"], "--gpu-id 0 and --gpu-ids 1,2 both name GPUs"),
        # thinc's "Cannot use GPU, CuPy is not installed", as a traceback.
        (["--gpu-id", "0"], "GPU 0: cupy is not installed"),
        (["--nproc", "2", "--gpu-ids", "0,1"], "GPU 0,1: cupy is not installed"),
    ],
)
def test_gpu_options_that_cannot_work_are_refused_before_anything_starts(
    setup, tmp_path, args, needle
):
    from spacy.cli._util import app
    from thinc.util import has_cupy
    from typer.testing import CliRunner

    import spacy_lean.cli  # noqa: F401  (adds `lean` to spaCy's CLI app)

    if "cupy is not installed" in needle and has_cupy:
        pytest.skip("cupy is installed here")
    command = ["lean", "train", str(setup / "config.cfg"), "--output", str(tmp_path / "out")]
    result = CliRunner().invoke(app, command + args)
    assert result.exit_code == 1 and needle in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
    if "cupy" in needle:
        assert "pip install spacy-lean[cuda12x]" in " ".join(result.output.split())


def test_the_local_launcher_ignores_an_inherited_master_addr(tmp_path):
    """A job script that exported MASTER_ADDR for torchrun on another node: `--nproc`
    kept it with a port free on this machine, and the ranks waited for --timeout, then
    failed. The ranks run here, so they meet here."""
    from spacy_lean.training.launch import launch_local

    check = "import os, sys; sys.exit(os.environ['MASTER_ADDR'] != '127.0.0.1')"
    env = dict(os.environ, MASTER_ADDR="192.0.2.1")
    assert launch_local([sys.executable, "-c", check], 2, env=env) == 0


def test_a_missing_master_addr_is_refused_before_the_pipeline_is_built(monkeypatch):
    """RANK and WORLD_SIZE set by hand without MASTER_ADDR: refused when the context is
    read (it was refused after initialization, with a traceback)."""
    from spacy_lean.training.dist import context_from_env

    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not set \(RANK=0, WORLD_SIZE=2\)"):
        context_from_env()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        context_from_env()
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert context_from_env().world_size == 2


def test_a_refusal_on_another_node_is_printed_there(setup, tmp_path):
    """Local rank 0 of a node other than rank 0's (here RANK=1, LOCAL_RANK=0) fails
    where rank 0 may not (a node-local --output without a state): it says why, naming
    its rank (it exited 1 without a word, and rank 0 waited for --timeout)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="1", WORLD_SIZE="2", LOCAL_RANK="0")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    cmd = [sys.executable, "-m", "spacy", "lean", "train", str(setup / "config.cfg")]
    cmd += ["--output", str(tmp_path / "none"), "--resume", "--code", str(setup / "code.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1 and "Rank 1 of 2: Nothing to resume" in out, out
    env["LOCAL_RANK"] = "1"  # a second rank of that node: its local rank 0 says it
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and "Nothing to resume" not in proc.stdout + proc.stderr


def test_a_label_first_met_in_training(tiny_ner_config, tmp_path):
    """The ner initialized from a labels file without one label that the training data
    holds: spaCy grows its output layer when a batch meets it. One process: the
    parameter list is collected again, so the checkpoint's optimizer state is the new
    layer's and --resume works (it refused its own state: "saved for another model").
    Two ranks: the one that met it would train another model than the other (they
    drifted apart silently); the run stops naming the label and the fix."""
    from spacy.tokens import DocBin

    nlp = spacy.blank("en")
    docs = synthetic.make_ner_docs(nlp, 24, seed=61, long_doc_rate=0.0)
    counts = Counter(ent.label_ for doc in docs for ent in doc.ents)
    rare = min(counts, key=lambda label: (counts[label], label))
    ner = nlp.add_pipe("ner")
    known = [d for d in docs if all(e.label_ != rare for e in d.ents)]
    nlp.initialize(lambda: [Example(nlp.make_doc(d.text), d) for d in known])
    srsly.write_json(tmp_path / "ner.json", ner.label_data)
    assert rare not in ner.labels
    # Read in order (max_epochs -1): the label comes after the first steps, whose Adam
    # state the grown layer's replaces.
    with_rare = [d for d in docs if any(e.label_ == rare for e in d.ents)]
    assert len(known) >= 8 and with_rare
    docs = known[:8] + with_rare[:1] + known[8:15]
    DocBin(docs=docs).to_disk(tmp_path / "train.spacy")
    DocBin(docs=docs[:4]).to_disk(tmp_path / "dev.spacy")
    config = tiny_ner_config()
    config["initialize"]["components"]["ner"] = {
        "labels": {"@readers": "spacy.read_labels.v1", "path": str(tmp_path / "ner.json")}
    }
    config["training"].update(max_steps=3, eval_frequency=2, max_epochs=-1)
    config["training"]["batcher"] = {
        "@batchers": "spacy.batch_by_sequence.v1",
        "size": 4,
        "get_length": None,
    }
    config.to_disk(tmp_path / "config.cfg")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)

    def run(output, *args):
        cmd = [sys.executable, "-m", "spacy", "lean", "train", str(tmp_path / "config.cfg")]
        cmd += ["--output", str(output), "--paths.train", str(tmp_path / "train.spacy")]
        cmd += ["--paths.dev", str(tmp_path / "dev.spacy"), "--timeout", "60", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)

    one = run(tmp_path / "one", "--training.batcher.size", "4")
    assert one.returncode == 0, one.stdout + one.stderr
    assert rare in spacy.load(tmp_path / "one" / "model-last").get_pipe("ner").labels
    again = run(tmp_path / "one", "--resume", "--training.max_steps", "5")
    assert again.returncode == 0, again.stdout + again.stderr
    two = run(tmp_path / "two", "--nproc", "2", "--training.batcher.size", "2")
    out = " ".join((two.stdout + two.stderr).split())
    assert two.returncode == 1, out
    assert (
        f"held labels that the components' initialize data did not have ('ner': ['{rare}'])" in out
    )
    assert "spacy init labels" in out


def test_the_training_state_keeps_the_callback_that_saved_models_strip(tmp_path, tiny_ner_config):
    """spacy-lean.strip_streaming_evaluate.v1 removes the lean callback from the live
    config for model-best and model-last, and training-state/model was saved with it
    removed too: a resume with that config.cfg (which the resume error tells users to
    use) lost the callback's settings (max_padded_tokens) without a word. The state
    keeps the run's callback; the saved models stay portable."""
    synthetic.write_ner_corpus(tmp_path / "train.spacy", 6, seed=71, long_doc_rate=0.0)
    synthetic.write_ner_corpus(tmp_path / "dev.spacy", 4, seed=72, long_doc_rate=0.0)
    config = tiny_ner_config()
    config["paths"]["train"] = str(tmp_path / "train.spacy")
    config["paths"]["dev"] = str(tmp_path / "dev.spacy")
    config["nlp"]["after_pipeline_creation"] = {
        "@callbacks": "spacy-lean.lean_training.v1",
        "max_padded_tokens": 400,
    }
    config["training"]["before_to_disk"] = {"@callbacks": "spacy-lean.strip_streaming_evaluate.v1"}
    config["training"].update(max_steps=4, eval_frequency=2)
    config.to_disk(tmp_path / "config.cfg")
    (tmp_path / "probe_code.py").write_text("", encoding="utf8")
    proc = run_tiny(tmp_path, tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = spacy.util.load_config(tmp_path / "out" / "model-last" / "config.cfg")
    assert last["nlp"]["after_pipeline_creation"] is None
    state_cfg = tmp_path / "out" / "training-state" / "model" / "config.cfg"
    callback = spacy.util.load_config(state_cfg)["nlp"]["after_pipeline_creation"]
    assert callback["@callbacks"] == "spacy-lean.lean_training.v1"
    assert callback["max_padded_tokens"] == 400
    # A resume with that copy keeps the ceiling.
    shutil.copy(state_cfg, tmp_path / "config.cfg")
    proc = run_tiny(tmp_path, tmp_path / "out", "--resume", "--training.max_steps", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = srsly.read_json(tmp_path / "out" / "training-state" / "state.json")
    assert state["step"] == 6
    assert state["ranks"][0]["update_policy"]["max_padded_tokens"] == 400


@pytest.mark.parametrize(
    "callback,setting,message",
    [
        ("lean_training", "max_padded_tokens", "max_padded_tokens must be a positive number"),
        ("lean_training", "eval_max_batch_tokens", "eval_max_batch_tokens must be a whole number"),
        ("streaming_evaluate", "max_batch_tokens", "max_batch_tokens must be a whole number"),
    ],
)
def test_a_bad_callback_setting_fails_with_its_message(
    tmp_path, tiny_ner_config, callback, setting, message
):
    """A bad setting of spacy-lean.lean_training.v1 stopped `spacy lean train` with a
    traceback (and, for max_padded_tokens, a message without the callback's name): it
    fails with the message now, naming the config, the callback and the setting."""
    config = tiny_ner_config()
    config["paths"]["train"] = config["paths"]["dev"] = str(tmp_path / "none.spacy")
    config["nlp"]["after_pipeline_creation"] = {
        "@callbacks": f"spacy-lean.{callback}.v1",
        setting: 0,
    }
    config.to_disk(tmp_path / "config.cfg")
    (tmp_path / "probe_code.py").write_text("", encoding="utf8")
    proc = run_tiny(tmp_path, tmp_path / "out")
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, text
    assert "Traceback" not in text
    assert f"config.cfg: spacy-lean.{callback}.v1: {message}" in text


LINKER_CONFIG = """
[paths]
train = null
dev = null
kb = null
[system]
seed = 0
gpu_allocator = null
[nlp]
lang = "en"
pipeline = ["tok2vec","sentencizer","entity_linker"]
batch_size = 100
[components]
[components.tok2vec]
factory = "tok2vec"
[components.tok2vec.model]
@architectures = "spacy.HashEmbedCNN.v2"
pretrained_vectors = null
width = 16
depth = 1
embed_size = 200
window_size = 1
maxout_pieces = 2
subword_features = false
[components.sentencizer]
factory = "sentencizer"
[components.entity_linker]
factory = "entity_linker"
incl_prior = false
[components.entity_linker.model]
@architectures = "spacy.EntityLinker.v2"
nO = null
[components.entity_linker.model.tok2vec]
@architectures = "spacy.Tok2VecListener.v1"
width = 16
upstream = "*"
[corpora]
[corpora.train]
@readers = "spacy.Corpus.v1"
path = ${paths.train}
[corpora.dev]
@readers = "spacy.Corpus.v1"
path = ${paths.dev}
[training]
seed = 0
dropout = 0.0
max_steps = 4
max_epochs = -1
eval_frequency = 2
gpu_allocator = null
[training.batcher]
@batchers = "spacy.batch_by_sequence.v1"
size = 8
get_length = null
[training.optimizer]
@optimizers = "SGD.v1"
learn_rate = 0.01
L2 = 0.0
grad_clip = 0.0
use_averages = false
[training.score_weights]
nel_micro_f = 1.0
[initialize]
[initialize.components]
[initialize.components.entity_linker]
[initialize.components.entity_linker.kb_loader]
@misc = "spacy.KBFromFile.v1"
kb_path = ${paths.kb}
"""


# 5 tokens each: spaCy's subdivide_batch sorts by length, so equal lengths keep each
# rank's order and the ranks' j-th subbatches are together one process's j-th.
LONDON = ("London is big today .", [(0, 1, "Q2")])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_ranks_with_an_entity_linker_equal_one_process(tmp_path, accumulate):
    """An entity_linker (gold entities) on 2 ranks, rank 0's share of only docs whose
    linked entity has no KB candidate ("Zed Quux" is no alias): rank 0's linker
    skipped its share, where one process with both shares learns from it (weights off
    by up to 0.2), and the ranks' losses were summed (logged twice one process's). The
    ranks share whether the step's linker learns, and weight its loss by their linked
    entities: the weights and the logged losses are one process's. With
    accumulate_gradient = 2 the ranks share it per subbatch (before, each rank's
    subbatches decided alone: weights off by 0.2, the loss logged at a tenth)."""
    from spacy.tokens import DocBin

    nlp = spacy.blank("en")
    make_linker_kb(nlp.vocab).to_disk(tmp_path / "kb")

    def make(text, ents):
        doc = set_links(nlp.make_doc(text), ents)
        for token in doc:
            token.is_sent_start = token.i == 0
        return doc

    zed, ada, rain = ZED, ADA, RAIN
    # Streamed shares: rank r takes docs i % 2 == r, so rank 0 gets every "Zed Quux".
    if accumulate == 1:
        train = [make(*(zed if i % 2 == 0 else ada if i % 4 == 1 else rain)) for i in range(16)]
    else:
        train = [make(*(zed if i % 2 == 0 else LONDON)) for i in range(16)]
    DocBin(docs=train).to_disk(tmp_path / "train.spacy")
    DocBin(docs=[make(*ada), make(*rain), make(*zed)]).to_disk(tmp_path / "dev.spacy")
    (tmp_path / "config.cfg").write_text(LINKER_CONFIG, encoding="utf8")
    (tmp_path / "probe_code.py").write_text("", encoding="utf8")
    paths = ["--paths.train", tmp_path / "train.spacy", "--paths.dev", tmp_path / "dev.spacy"]
    paths += ["--paths.kb", tmp_path / "kb", "--training.accumulate_gradient", accumulate]
    one = run_tiny(tmp_path, tmp_path / "one", *paths)
    assert one.returncode == 0, one.stdout + one.stderr
    two = run_tiny(tmp_path, tmp_path / "two", "--nproc", "2", "--training.batcher.size", 4, *paths)
    assert two.returncode == 0, two.stdout + two.stderr
    single = params_of(tmp_path / "one" / "model-last")
    double = params_of(tmp_path / "two" / "model-last")
    assert max_diff(single, double) < 1e-5, largest_diffs(double, single)
    losses = [
        srsly.read_json(tmp_path / run / "model-last" / "meta.json")["performance"]
        for run in ("one", "two")
    ]
    assert losses[0]["entity_linker_loss"] > 0
    assert losses[1]["entity_linker_loss"] == pytest.approx(
        losses[0]["entity_linker_loss"], rel=1e-4
    )


def test_a_rank_without_cupy_says_how_to_train(setup, tmp_path, capsys):
    """A rank started by torchrun with --gpu-ids (the launcher's check is not made
    there) ended in thinc's traceback."""
    from thinc.util import has_cupy

    from spacy_lean.cli.train import train

    if has_cupy:
        pytest.skip("cupy is installed here")
    with pytest.raises(SystemExit) as info:
        train(setup / "config.cfg", tmp_path / "out", gpu_ids=[0])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 1
    assert "GPU 0: Cannot use GPU, CuPy is not installed. Leave out --gpu-id/--gpu-ids" in out


def test_resume_on_more_ranks_with_uneven_shares(tmp_path, tiny_ner_config):
    """spacy-lean.Corpus.v1 sharing by shard, shards of 10 and 2 docs: 1 process trains 10
    examples of epoch 0, then resumes on 2 ranks, each skipping 10 // 2 = 5 examples of
    its share, more than the 2-doc share holds. That is no damaged state (the check for
    one refused it); the small share's rank skips what it has and the run goes on."""
    (tmp_path / "train").mkdir()
    synthetic.write_ner_corpus(tmp_path / "train" / "a.spacy", 10, seed=1, long_doc_rate=0.0)
    synthetic.write_ner_corpus(tmp_path / "train" / "b.spacy", 2, seed=2, long_doc_rate=0.0)
    synthetic.write_ner_corpus(tmp_path / "dev.spacy", 4, seed=3, long_doc_rate=0.0)
    config = tiny_ner_config()
    config["paths"].update(train=str(tmp_path / "train"), dev=str(tmp_path / "dev.spacy"))
    reader = {"@readers": "spacy-lean.Corpus.v1", "path": "${paths.train}", "share_by": "shard"}
    config["corpora"]["train"] = reader
    config["training"].update(max_steps=0, max_epochs=3, eval_frequency=2)
    batcher = {"@batchers": "spacy.batch_by_sequence.v1", "size": 2, "get_length": None}
    config["training"]["batcher"] = batcher
    config.to_disk(tmp_path / "config.cfg")
    (tmp_path / "probe_code.py").write_text("", encoding="utf8")
    out = tmp_path / "out"
    proc = run_tiny(tmp_path, out, "--training.max_steps", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = srsly.read_json(out / "training-state" / "state.json")["ranks"]
    assert [(r["batches"], r["examples"]) for r in saved] == [(5, 10)]
    proc = run_tiny(tmp_path, out, "--resume", "--nproc", "2", "--training.max_steps", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = srsly.read_json(out / "training-state" / "state.json")
    assert state["world_size"] == 2 and state["step"] == 6


def test_a_rank_other_than_0_names_itself_in_its_warnings():
    """Every rank prints its warnings (a data file's, an out-of-memory split of its own
    batch): with --nproc 8 a data warning came 8 times with nothing to tell them apart.
    Ranks other than 0 now name themselves. (A fresh process: pytest records warnings
    in place of printing them.)"""
    code = (
        "import warnings; from spacy_lean.cli.train import _name_rank_in_warnings; "
        "_name_rank_in_warnings(1, 8); _name_rank_in_warnings(1, 8); "
        "warnings.warn(\"left out 1 'reject' record(s)\"); "
        "rec = warnings.catch_warnings(record=True); log = rec.__enter__(); "
        "warnings.simplefilter('always'); warnings.warn('x'); "
        "assert type(log[0].message) is UserWarning, log"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # Once (installed twice: said twice before), and handlers get the Warning itself.
    assert "UserWarning: Rank 1 of 8: left out 1 'reject' record(s)\n" in proc.stderr


def test_a_resumed_run_s_jsonl_log_goes_on_in_the_same_file(tmp_path, tiny_ner_config):
    """spaCy's ConsoleLogger refuses an output_file that exists, so the JSONL log of a
    resumed run stopped at the interruption ("Saving logs is disabled"). Now it goes on:
    after a run to step 10 and a resume to 20 the file has the lines of steps 0-20, as
    an uninterrupted run's, the first three as they were; a set-aside file a killed
    resume left is read first."""
    synthetic.write_ner_corpus(tmp_path / "train.spacy", 12, seed=71, long_doc_rate=0.0)
    synthetic.write_ner_corpus(tmp_path / "dev.spacy", 4, seed=72, long_doc_rate=0.0)
    config = tiny_ner_config()
    config["paths"].update(train=str(tmp_path / "train.spacy"), dev=str(tmp_path / "dev.spacy"))
    config["training"].update(max_steps=20, eval_frequency=5)
    log = tmp_path / "log.jsonl"
    config["training"]["logger"] = {
        "@loggers": "spacy.ChainLogger.v1",
        "logger1": {"@loggers": "spacy.ConsoleLogger.v3", "output_file": str(log)},
    }
    config.to_disk(tmp_path / "config.cfg")
    (tmp_path / "probe_code.py").write_text("", encoding="utf8")
    proc = run_tiny(tmp_path, tmp_path / "out", "--training.max_steps", "10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before = log.read_text(encoding="utf8").splitlines()
    assert [json.loads(line)["step"] for line in before] == [0, 5, 10]
    proc = run_tiny(tmp_path, tmp_path / "out", "--resume")
    out = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Saving logs is disabled" not in out
    assert f"The training log {log} goes on after step 10: its 3 earlier line(s)" in out
    after = log.read_text(encoding="utf8").splitlines()
    assert [json.loads(line)["step"] for line in after] == [0, 5, 10, 15, 20]
    assert after[:3] == before
    assert not (tmp_path / "log.jsonl.before-resume").exists()


def test_held_console_logs_keep_the_saved_steps_and_a_killed_resume_s_lines(tmp_path):
    """`hold_console_logs` keeps each line up to the saved step once, a set-aside file
    first (a resume killed before it put its lines back), and `restore_console_logs`
    puts them in front of what the new run wrote."""
    from spacy_lean.training.loop import hold_console_logs, restore_console_logs

    log = tmp_path / "log.jsonl"
    aside = tmp_path / "log.jsonl.before-resume"
    aside.write_text('{"step": 0}\n{"step": 5}\n', encoding="utf8")
    log.write_text('{"step": 5}\n{"step": 10}\n{"step": 15}\nnot json\n', encoding="utf8")
    logger = {"@loggers": "spacy.ConsoleLogger.v3", "output_file": str(log)}
    held = hold_console_logs({"@loggers": "spacy.ChainLogger.v1", "logger1": logger}, 10)
    assert held == [(log, 4)] and not log.exists()
    log.write_text('{"step": 15}\n', encoding="utf8")  # what the resumed run logs
    restore_console_logs(held)
    steps = log.read_text(encoding="utf8").splitlines()
    assert steps == ['{"step": 0}', '{"step": 5}', '{"step": 10}', "not json", '{"step": 15}']
    assert not aside.exists()
    assert hold_console_logs({"@loggers": "spacy.ConsoleLogger.v3"}, 3) == []


def test_verbose_debug_lines_come_from_rank_0_only(tiny_setup):
    """`-V --nproc 2`: spaCy's debug lines came from both ranks, twice each and with no
    rank named; only rank 0's print now (others keep warnings, named)."""
    proc, _, _ = tiny_run(tiny_setup, "verbose", "--nproc", "2", "-V")
    out = proc.stdout + proc.stderr
    assert out.count("Set up nlp object from config") == 1, out
    assert "Rank 1 of 2: Set up nlp object" not in out


def test_the_rank_whose_logger_fails_is_blamed_not_the_peer_that_exits_first(tiny_setup):
    """Rank 0's logger raises in its setup (only rank 0 sets one up); rank 1's collective
    breaks after it and its process, with less to tear down, often ended first: the
    launcher said rank 1 failed first (1 run in 3 in a probe). Each rank now reports when
    it failed, and the launcher blames the first."""
    out = tiny_setup / "logger-fails"
    evals = tiny_setup / "logger-fails-eval"
    evals.mkdir()
    env = {
        "DDP_TEST_EVAL_DIR": str(evals),
        "DDP_TEST_LOSSES_LOG": str(tiny_setup / "logger-fails.jsonl"),
        "DDP_TEST_LOGGER_FAILS": "1",
    }
    proc = run_tiny(tiny_setup, out, "--nproc", "2", env=env)
    log = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, log
    assert "Rank 0 of 2 stopped: RuntimeError: probe: the logger's setup failed" in log
    assert "Rank 0 of 2 failed first; stopped the other ranks" in log
