"""Training a character LM: the loss falls, checkpoints are Flair-format, resume
after an interruption is bitwise identical on CPU, and the CLI works."""

import os
import shutil
import signal

import numpy
import pytest
import torch
from typer.testing import CliRunner

from spacy_lean import synthetic
from spacy_lean.charlm import safe_torch
from spacy_lean.charlm.loader import CharLMLoader, EncodedText
from spacy_lean.charlm.model import CharDictionary, CharLM
from spacy_lean.charlm.train import MODEL_FILE, STATE_FILE, train_charlm

from stop_util import sigterm_on_call  # noqa: E402

# A tiny LSTM: a few hundred steps take about a second on one CPU thread.
TINY = dict(
    hidden_size=32,
    embedding_size=16,
    bptt=30,
    batch_size=8,
    gpu_id=-1,
    progress=False,
)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("charlm_text") / "train.txt"
    path.write_text("\n".join(synthetic.generated_sentences(400, seed=11)) + "\n", encoding="utf8")
    return path


# One torch thread (conftest's fixture).
pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("forward", [True, False])
def test_loss_falls(text_file, tmp_path, forward):
    result = train_charlm(
        [text_file],
        tmp_path,
        is_forward_lm=forward,
        lr=20.0,
        max_epochs=3,
        max_steps=240,
        log_every=20,
        **TINY,
    )
    assert result.step == 240
    first, last = result.losses[0][1], result.losses[-1][1]
    assert last < 0.7 * first, result.losses
    assert result.perplexities[-1][1] < 10.0
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    assert state["loader"]["reverse"] is (not forward)
    assert result.model.is_forward_lm is forward


def test_checkpoint_is_a_flair_lm_with_the_trained_weights(text_file, tmp_path):
    result = train_charlm([text_file], tmp_path, max_steps=20, nout=8, **TINY)
    loaded = CharLM.load(tmp_path / MODEL_FILE)
    assert _same_weights(loaded, result.model)
    assert loaded.nout == 8 and loaded.hidden_size == 32 and loaded.is_forward_lm
    assert loaded.dictionary == result.model.dictionary
    # The encoded corpus is stored once, as bytes (the dictionary has < 256 entries).
    assert (tmp_path / "corpus" / "ids.bin").stat().st_size == text_file.stat().st_size


@pytest.mark.parametrize("where", ["mid-epoch", "end-of-epoch", "next-epoch"])
def test_resume_after_interruption_is_bitwise_identical(text_file, tmp_path, where):
    """Adam (its state matters), 2 layers, dropout, random sequence lengths;
    interrupted in the first epoch, exactly after its last batch, or in the second."""
    kwargs = dict(
        nlayers=2,
        dropout=0.2,
        optimizer="adam",
        lr=0.01,
        max_epochs=3,
        log_every=10,
        checkpoint_every=25,
        **TINY,
    )
    full = train_charlm([text_file], tmp_path / "full", max_steps=160, **kwargs)
    encoded = EncodedText(tmp_path / "full" / "corpus")
    epoch_len = sum(1 for _ in CharLMLoader(encoded, TINY["batch_size"], TINY["bptt"], seed=0))
    assert 40 < epoch_len < 150
    stop_at = {"mid-epoch": 37, "end-of-epoch": epoch_len, "next-epoch": epoch_len + 3}[where]
    part = train_charlm([text_file], tmp_path / "part", max_steps=stop_at, **kwargs)
    assert part.step == stop_at and not _same_weights(part.model, full.model)
    resumed = train_charlm([text_file], tmp_path / "part", max_steps=160, resume=True, **kwargs)
    assert resumed.step == 160 and resumed.epoch == full.epoch
    assert _same_weights(resumed.model, full.model)
    assert resumed.losses == full.losses


def test_sigterm_stops_after_the_step_saved_and_resume_is_bitwise_identical(
    text_file, tmp_path, monkeypatch
):
    """SIGTERM during step 37 (sent by the optimizer's step, so the moment is fixed):
    the run ends after step 37 with it saved (no periodic checkpoint there) and
    `stopped_by` set; resuming gives the uninterrupted run's weights and losses."""
    kwargs = dict(optimizer="adam", lr=0.01, max_epochs=2, log_every=10, checkpoint_every=25)
    kwargs.update(TINY)
    full = train_charlm([text_file], tmp_path / "full", max_steps=60, **kwargs)
    handler = signal.getsignal(signal.SIGTERM)  # another library's, or the default
    sigterm_on_call(monkeypatch, torch.optim.Adam, "step", 37)
    part = train_charlm([text_file], tmp_path / "part", max_steps=60, **kwargs)
    monkeypatch.undo()
    assert part.step == 37 and part.stopped_by == signal.SIGTERM
    assert torch.load(tmp_path / "part" / STATE_FILE, weights_only=True)["step"] == 37
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    resumed = train_charlm([text_file], tmp_path / "part", max_steps=60, resume=True, **kwargs)
    assert resumed.step == 60 and resumed.stopped_by is None
    assert _same_weights(resumed.model, full.model)
    assert resumed.losses == full.losses


@pytest.mark.usefixtures("ctrl_c_as_in_a_terminal")
def test_ctrl_c_stops_after_the_step_saved(text_file, tmp_path, monkeypatch, capfd):
    """Ctrl-C (SIGINT) during step 37 stops as SIGTERM does: after step 37, saved, with
    `stopped_by` set and Python's own Ctrl-C handler back afterwards (before, the
    KeyboardInterrupt ended the run with the steps since the last checkpoint lost)."""
    kwargs = dict(optimizer="adam", lr=0.01, max_epochs=2, log_every=10, checkpoint_every=25)
    kwargs.update(TINY)
    handler = signal.getsignal(signal.SIGINT)
    sigterm_on_call(monkeypatch, torch.optim.Adam, "step", 37, signum=signal.SIGINT)
    part = train_charlm([text_file], tmp_path / "part", max_steps=60, **kwargs)
    monkeypatch.undo()
    assert part.step == 37 and part.stopped_by == signal.SIGINT
    assert torch.load(tmp_path / "part" / STATE_FILE, weights_only=True)["step"] == 37
    assert signal.getsignal(signal.SIGINT) is handler
    assert "Received SIGINT: training stops after this step" in capfd.readouterr().err


def test_resume_from_a_periodic_checkpoint(text_file, tmp_path):
    """A run killed after its last periodic checkpoint resumes from that checkpoint
    and ends where an uninterrupted run does."""
    kwargs = dict(max_epochs=2, log_every=10, checkpoint_every=30, **TINY)
    full = train_charlm([text_file], tmp_path / "full", max_steps=90, **kwargs)
    train_charlm([text_file], tmp_path / "killed", max_steps=60, **kwargs)
    # Simulate the crash: keep the checkpoint of step 60, as if it died at step 75.
    state = torch.load(tmp_path / "killed" / STATE_FILE, weights_only=True)
    assert state["step"] == 60
    resumed = train_charlm([text_file], tmp_path / "killed", max_steps=90, resume=True, **kwargs)
    assert _same_weights(resumed.model, full.model)


def test_dev_text_is_evaluated_at_checkpoints_and_best_model_kept(text_file, tmp_path):
    dev = tmp_path / "dev.txt"
    dev.write_text("\n".join(synthetic.generated_sentences(40, seed=99)) + "\n", encoding="utf8")
    result = train_charlm(
        [text_file],
        tmp_path / "run",
        max_steps=150,
        max_epochs=2,
        checkpoint_every=50,
        dev_texts=[dev],
        **TINY,
    )
    assert [step for step, _ in result.dev_losses] == [50, 100, 150]
    losses = [loss for _, loss in result.dev_losses]
    assert losses[-1] < losses[0] - 0.3, losses
    best_step = min(result.dev_losses, key=lambda item: item[1])[0]
    best = CharLM.load(tmp_path / "run" / "best-lm.pt")
    assert _same_weights(best, result.model) == (best_step == 150)
    # The dev loss is the mean cross-entropy per character of the dev text.
    encoded = EncodedText(tmp_path / "run" / "dev_corpus")
    model = CharLM.load(tmp_path / "run" / "lm.pt")
    ids = torch.from_numpy(encoded.ids.astype("int64"))
    with torch.no_grad():
        logits, _, _ = model(ids[:-1, None])
        direct = torch.nn.functional.cross_entropy(logits[:, 0], ids[1:]).item()
    # Evaluated in 8 streams with their own initial states: close to one pass.
    assert abs(direct - losses[-1]) < 0.05


def test_an_empty_dev_text_is_named_as_the_dev_text(text_file, tmp_path):
    """An empty --dev file was reported as "The text is empty ... give text files with
    the training text", and an empty --dev folder as "No text files found", naming
    neither --dev nor the dev text."""
    empty = tmp_path / "dev.txt"
    empty.write_text("")
    with pytest.raises(ValueError) as err:
        train_charlm([text_file], tmp_path / "a", max_steps=1, dev_texts=[empty], **TINY)
    assert "The dev text (--dev) is empty: " in str(err.value)
    assert "give text files with the dev text (--dev)" in str(err.value)
    folder = tmp_path / "dev"
    folder.mkdir()
    with pytest.raises(ValueError) as err:
        train_charlm([text_file], tmp_path / "b", max_steps=1, dev_texts=[folder], **TINY)
    assert "No files of the dev text (--dev) found in: " in str(err.value)
    # The training text's own messages still name the training text.
    with pytest.raises(ValueError, match="The training text is empty"):
        train_charlm([empty], tmp_path / "c", max_steps=1, **TINY)


def test_given_dictionary_is_used(text_file, tmp_path):
    dictionary = CharDictionary(["<unk>"] + [chr(c) for c in range(32, 127)] + ["\n"])
    result = train_charlm([text_file], tmp_path, max_steps=5, dictionary=dictionary, **TINY)
    assert result.model.dictionary == dictionary
    assert CharLM.load(tmp_path / MODEL_FILE).dictionary == dictionary


def test_resume_errors(text_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="Cannot resume"):
        train_charlm([text_file], tmp_path / "nothing", resume=True, **TINY)
    train_charlm([text_file], tmp_path / "fw", max_steps=3, **TINY)
    with pytest.raises(ValueError, match="forward LM"):
        train_charlm([text_file], tmp_path / "fw", resume=True, is_forward_lm=False, **TINY)
    with pytest.raises(ValueError, match="optimizer"):
        train_charlm([text_file], tmp_path / "x", optimizer="lamb", **TINY)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
        ({"clip": -1.0}, "clip must be a finite number >= 0 (0 turns clipping off), got -1.0"),
        ({"seed": -1}, "seed must be a whole number >= 0 and < 2**63, got -1"),
        (
            {"seed": 2**70},
            "seed must be a whole number >= 0 and < 2**63, got 1180591620717411303424",
        ),
        ({"max_epochs": 0}, "max_epochs (--epochs) must be a whole number >= 1, got 0"),
        ({"dropout": float("nan")}, "dropout must be a number >= 0 and < 1, got nan"),
        ({"dropout": 1.0}, "dropout must be a number >= 0 and < 1, got 1.0"),
        ({"batch_size": 0}, "batch_size and bptt must be >= 1, got 0 and 30"),
        ({"nout": 0}, "nout must be >= 1 (or None: no projection), got 0"),
        ({"bptt": 3_000_000}, "ids a batch, more than 10,000,000"),
        ({"min_char_count": 10**9}, "keeps no character of the training text"),
    ],
)
def test_settings_a_resume_would_refuse_are_refused_before_training(
    text_file, tmp_path, settings, message
):
    """Each was trained, saved, and then refused by --resume as an "edited or damaged"
    state (lr 0, clip -1, a huge bptt), or by every load (nout 0); a batch size of 0
    divided by zero; a min_char_count above every count trained a model of <unk> alone.
    Now each stops before anything is written."""
    with pytest.raises(ValueError) as err:
        train_charlm([text_file], tmp_path / "run", max_steps=2, **dict(TINY, **settings))
    assert message in str(err.value)
    assert not (tmp_path / "run" / MODEL_FILE).exists()


def test_a_resume_on_another_text_of_the_same_length_is_refused(text_file, tmp_path):
    """The loader state records the text's length only: another text of as many
    characters was re-encoded and trained on from the old positions, hidden states and
    optimizer, silently (the loss jumped from 0.87 to 2.88). A fresh run into a folder
    with an earlier run's best-lm.pt removes it (without --dev this run writes none)."""
    train_charlm([text_file], tmp_path / "run", max_steps=3, **TINY)
    text = text_file.read_text(encoding="utf8")
    other = tmp_path / "other.txt"
    other.write_text(text[::-1], encoding="utf8")  # the same characters, another order
    with pytest.raises(ValueError, match=r"Cannot resume: the training text .*other\.txt"):
        train_charlm([other], tmp_path / "run", max_steps=6, resume=True, **TINY)
    again = train_charlm([text_file], tmp_path / "run", max_steps=6, resume=True, **TINY)
    assert again.step == 6
    # Written over the old file, keeping its modification time (cp -p, rsync -t): the
    # cached encoding would be reused, so the files' bytes are what is compared.
    copy = tmp_path / "copy.txt"
    copy.write_text(text, encoding="utf8")
    train_charlm([copy], tmp_path / "copied", max_steps=3, **TINY)
    stat = copy.stat()
    copy.write_text(text[::-1], encoding="utf8")
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ValueError, match=r"Cannot resume: the training text"):
        train_charlm([copy], tmp_path / "copied", max_steps=6, resume=True, **TINY)
    best = tmp_path / "run" / "best-lm.pt"
    best.write_bytes(b"an earlier run's")
    with pytest.raises(ValueError, match="Lower --bptt or --batch-size"):  # the folder stays
        train_charlm([text_file], tmp_path / "run", max_steps=2, **dict(TINY, batch_size=10**6))
    assert best.read_bytes() == b"an earlier run's"
    train_charlm([text_file], tmp_path / "run", max_steps=2, **TINY)
    assert not best.exists()
    with pytest.raises(ValueError, match="Not enough memory for a model of hidden size 2000000"):
        train_charlm(
            [text_file], tmp_path / "huge", max_steps=2, **dict(TINY, hidden_size=2_000_000)
        )
    output_file = tmp_path / "a_file"
    output_file.write_text("x", encoding="utf8")
    with pytest.raises(ValueError, match="is a file: give a folder's path"):
        train_charlm([text_file], output_file, max_steps=2, **TINY)


def test_a_model_from_another_save_is_not_resumed(text_file, tmp_path):
    """lm.pt and training_state.pt are renamed one after the other: a run stopped
    between the two renames leaves a model and a state of different saves, which must
    not be resumed together (newer weights with an older optimizer and position)."""
    train_charlm([text_file], tmp_path / "run", max_steps=3, **TINY)
    train_charlm([text_file], tmp_path / "later", max_steps=5, **TINY)
    shutil.copy(tmp_path / "later" / MODEL_FILE, tmp_path / "run" / MODEL_FILE)
    with pytest.raises(ValueError, match="is not the model that .* was saved with") as info:
        train_charlm([text_file], tmp_path / "run", max_steps=6, resume=True, **TINY)
    assert str(tmp_path / "run" / STATE_FILE) in str(info.value)
    # The matching pair resumes.
    result = train_charlm([text_file], tmp_path / "later", max_steps=6, resume=True, **TINY)
    assert result.step == 6


# Edits of a training state, each refused naming its field before anything is built
# from it (train-charlm's state is data: a 3 KB file with bptt 10**15 asked for
# petabytes of loader buffers).
_STATE_EDITS = {
    "config.bptt": lambda st: st["config"].update(bptt=10**15),
    "config.lr": lambda st: st["config"].update(lr=float("nan")),
    "config.clip": lambda st: st["config"].update(clip=-1.0),
    "config.seed": lambda st: st["config"].update(seed="x"),
    "config.randomize": lambda st: st["config"].update(randomize=2),
    "config.optimizer": lambda st: st["config"].update(optimizer="lamb"),
    "loader.offset": lambda st: st["loader"].update(offset=10**12),
    "loader.epoch": lambda st: st["loader"].update(epoch=-1),
    "step": lambda st: st.update(step=1.5),
    "losses": lambda st: st.update(losses=[[1, 2, 3]]),
    "hidden": lambda st: st.update(hidden=(torch.zeros(1, 999, 32), torch.zeros(1, 999, 32))),
}


@pytest.mark.parametrize("field", sorted(_STATE_EDITS))
def test_an_edited_training_state_is_refused_naming_the_field(text_file, tmp_path, field):
    run = tmp_path / "run"
    train_charlm([text_file], run, max_steps=2, **TINY)
    state = safe_torch.load(run / STATE_FILE, safe_torch.allowed_globals(), what="a state")
    _STATE_EDITS[field](state)
    torch.save(state, run / STATE_FILE)
    with pytest.raises(ValueError, match="edited or damaged") as info:
        train_charlm([text_file], run, max_steps=3, resume=True, **TINY)
    assert f"{run / STATE_FILE}: {field} = " in str(info.value)


def test_changed_text_is_reencoded_and_refuses_to_resume(text_file, tmp_path):
    text = tmp_path / "t.txt"
    shutil.copy(text_file, text)
    train_charlm([text], tmp_path / "run", max_steps=3, **TINY)
    text.write_text(text.read_text() + "more text\n")
    with pytest.raises(ValueError, match="characters"):
        train_charlm([text], tmp_path / "run", max_steps=6, resume=True, **TINY)


def _ids_out_of_range(corpus):
    dtype = EncodedText(corpus).dtype
    ids = numpy.memmap(corpus / "ids.bin", dtype=dtype, mode="r+")
    ids[:] = 250
    ids.flush()


@pytest.mark.parametrize(
    "tamper",
    [
        _ids_out_of_range,
        lambda corpus: (corpus / "ids.json").write_text("[]"),
        lambda corpus: (corpus / "ids.json").write_text("[" * 100_000 + "]" * 100_000),
    ],
    ids=["ids-past-the-dictionary", "json-list", "json-too-deep"],
)
def test_a_damaged_encoding_is_encoded_again(text_file, tmp_path, tamper):
    """The encoded text of a run is reused only if it is what encode_texts wrote: ids
    past the dictionary (an IndexError in the embedding, a device assert on CUDA) or
    unreadable metadata make train-charlm encode the text again, and the resumed run
    is the one an untouched run gives."""
    kwargs = dict(TINY, max_steps=3)
    train_charlm([text_file], tmp_path / "good", **kwargs)
    train_charlm([text_file], tmp_path / "bad", **kwargs)
    corpus = tmp_path / "bad" / "corpus"
    assert (corpus / "ids.json").exists()
    tamper(corpus)
    kwargs["max_steps"] = 6
    good = train_charlm([text_file], tmp_path / "good", resume=True, **kwargs)
    bad = train_charlm([text_file], tmp_path / "bad", resume=True, **kwargs)
    assert _same_weights(good.model, bad.model)
    assert int(EncodedText(corpus).ids.max()) < len(good.model.dictionary)


def test_cli_trains_and_resumes(text_file, tmp_path):
    from spacy.cli._util import app

    import spacy_lean.cli  # noqa: F401  (adds `lean` to spaCy's CLI app)

    out = tmp_path / "cli"
    args = [
        "lean",
        "train-charlm",
        str(text_file),
        str(out),
        "--direction",
        "backward",
        "--hidden-size",
        "16",
        "--embedding-size",
        "8",
        "--bptt",
        "20",
        "-b",
        "4",
        "--gpu-id",
        "-1",
        "--threads",
        "1",
        "--log-every",
        "5",
    ]
    runner = CliRunner()
    result = runner.invoke(app, args + ["--max-steps", "10"])
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output
    lm = CharLM.load(out / MODEL_FILE)
    assert not lm.is_forward_lm and lm.hidden_size == 16
    result = runner.invoke(app, args + ["--max-steps", "20", "--resume"])
    assert result.exit_code == 0, result.output
    assert torch.load(out / STATE_FILE, weights_only=True)["step"] == 20
    result = runner.invoke(app, args[:-2] + ["--resume", "--direction", "forward"])
    assert result.exit_code == 1
    assert "backward LM" in " ".join(result.output.split())  # wasabi wraps lines


def test_cli_says_a_stop_and_exits_143(text_file, tmp_path, monkeypatch):
    from spacy.cli._util import app

    import spacy_lean.cli  # noqa: F401  (adds `lean` to spaCy's CLI app)

    sigterm_on_call(monkeypatch, torch.optim.SGD, "step", 7)
    out = tmp_path / "cli"
    args = ["lean", "train-charlm", str(text_file), str(out), "--hidden-size", "16"]
    args += ["--embedding-size", "8", "--bptt", "20", "-b", "4", "--gpu-id", "-1"]
    result = CliRunner().invoke(app, args + ["--max-steps", "20"])
    assert result.exit_code == 143, result.output
    text = " ".join(result.output.split())
    assert f"Stopped by SIGTERM after step 7, with that step saved in {out}" in text
    assert "continue with the same command and --resume" in text
    assert torch.load(out / STATE_FILE, weights_only=True)["step"] == 7


def test_a_resume_with_nothing_left_to_train_says_how_to_go_on(text_file, tmp_path):
    """The limits count from the start of training: a run of 2 epochs stopped at step
    120, resumed with the default of one epoch, trained nothing and returned the
    checkpoint silently (the GPU test met it on the H100). Now refused, with the fix;
    with the fix, it goes on."""
    kwargs = {**TINY, "gpu_id": -1}
    first = train_charlm([text_file], tmp_path, max_steps=120, max_epochs=2, **kwargs)
    assert first.step == 120
    state = (tmp_path / STATE_FILE).read_bytes()
    with pytest.raises(ValueError) as err:
        train_charlm([text_file], tmp_path, max_steps=130, resume=True, **kwargs)
    message = " ".join(str(err.value).split())
    assert f"{tmp_path} is at step 120 after 1 full pass(es)" in message
    assert "max_epochs (--epochs) is 1" in message and "--epochs 2 or more" in message
    with pytest.raises(ValueError, match=r"max_steps \(--max-steps\) is 120: .*--max-steps 240"):
        train_charlm([text_file], tmp_path, max_steps=120, max_epochs=2, resume=True, **kwargs)
    assert (tmp_path / STATE_FILE).read_bytes() == state  # nothing written by a refusal
    resumed = train_charlm(
        [text_file], tmp_path, max_steps=130, max_epochs=2, resume=True, **kwargs
    )
    assert resumed.step == 130
    # A checkpoint saved after an epoch's last batch holds that epoch at its end (the
    # loader moves on only when asked for the next batch): a finished pass all the same.
    out = tmp_path / "boundary"
    one = train_charlm(
        [text_file], out, max_epochs=1, checkpoint_every=1, randomize_bptt=False, **kwargs
    )
    saved = torch.load(out / STATE_FILE, weights_only=True)["loader"]
    assert saved["epoch"] == 0 and saved["offset"] > 0  # the boundary case
    with pytest.raises(ValueError, match=r"after 1 full pass\(es\).*--epochs 2 or more"):
        train_charlm([text_file], out, max_epochs=1, resume=True, **kwargs)
    more = train_charlm(
        [text_file], out, max_epochs=2, max_steps=one.step + 3, resume=True, **kwargs
    )
    assert more.step == one.step + 3


@pytest.mark.gpu
def test_trains_on_gpu_and_checkpoint_loads_on_cpu(text_file, tmp_path):
    kwargs = {**TINY, "gpu_id": 0}
    result = train_charlm(
        [text_file], tmp_path, max_steps=120, max_epochs=2, log_every=20, **kwargs
    )
    assert next(result.model.parameters()).is_cuda
    assert result.losses[-1][1] < 0.8 * result.losses[0][1]
    loaded = CharLM.load(tmp_path / MODEL_FILE, map_location="cpu")
    assert _same_weights(loaded, result.model.cpu())
    resumed = train_charlm(
        [text_file], tmp_path, max_steps=130, max_epochs=2, resume=True, **kwargs
    )
    assert resumed.step == 130


def test_messy_text_files_train_or_fail_naming_the_file_and_the_fix(tmp_path):
    # Empty lines and a file of only whitespace are text like any other; a tiny file,
    # an empty one, a non-UTF-8 byte and a short dev text stop with the file and the fix.
    def write(name, data: bytes):
        path = tmp_path / name
        path.write_bytes(data)
        return path

    small = dict(TINY, batch_size=2, bptt=5, max_steps=2)
    blank_lines = write("blank_lines.txt", b"Ada met Bo.\n\n\n\nThen left.\r\n\n")
    spaces = write("spaces.txt", b"   \n\n \t \n")
    for i, path in enumerate((blank_lines, spaces)):
        result = train_charlm([path], tmp_path / f"ok{i}", **small)
        assert result.step >= 1 and (tmp_path / f"ok{i}" / MODEL_FILE).exists()
    tiny = write("tiny.txt", b"tiny\n")
    with pytest.raises(ValueError) as err:
        train_charlm([tiny], tmp_path / "tiny", **dict(small, batch_size=8))
    message = str(err.value)
    assert str(tiny) in message and "5 characters" in message
    assert "--batch-size 4 or less" in message
    with pytest.raises(ValueError, match=r"empty\.txt \(no characters at all\)"):
        train_charlm([write("empty.txt", b"")], tmp_path / "empty", **small)
    bad = write("latin1.txt", "caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not valid UTF-8: .* at byte 3"):
        train_charlm([bad], tmp_path / "bad", **small)
    with pytest.raises(ValueError) as err:
        train_charlm([blank_lines], tmp_path / "dev", dev_texts=[write("d.txt", b"\n")], **small)
    assert "d.txt" in str(err.value) and "--dev" in str(err.value)
