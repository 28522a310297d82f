"""Shared fixtures: a tiny local transformer, a generated NER corpus, a trained
transformer + ner pipeline. Everything is built locally; nothing is downloaded."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import spacy  # noqa: E402
from spacy.training import Example  # noqa: E402

from spacy_lean import synthetic  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="run slow tests")


def pytest_configure(config):
    # torch's default of one thread per core oversubscribes a 2-core CI machine.
    try:
        import torch

        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    except ImportError:  # pragma: no cover
        pass


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    skip_slow = pytest.mark.skip(reason="slow test: run with --slow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_transformer(tmp_path_factory):
    """Folder of a random-init 2-layer, 32-wide BERT with a WordPiece vocab trained
    on generated sentences. Use it as `name = "<folder>"` in configs."""
    return synthetic.make_tiny_transformer(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def blank_nlp():
    return spacy.blank("en")


@pytest.fixture(scope="session")
def ner_docs(blank_nlp):
    """60 generated multi-sentence NER docs (long-tailed lengths, 4 labels)."""
    return synthetic.make_ner_docs(blank_nlp, 60, seed=1)


@pytest.fixture(scope="session")
def ner_corpus(tmp_path_factory):
    """Paths of a generated train (80 docs) and dev (40 docs) .spacy corpus."""
    root = tmp_path_factory.mktemp("ner_corpus")
    train = synthetic.write_ner_corpus(root / "train.spacy", 80, seed=2)
    dev = synthetic.write_ner_corpus(root / "dev.spacy", 40, seed=3)
    return {"train": train, "dev": dev, "dir": root}


@pytest.fixture(scope="session")
def tiny_ner_config():
    """A function that makes a fresh tok2vec + ner config (`spacy init config`, en,
    efficiency) shrunk so that a training step takes milliseconds: tok2vec width 16,
    depth 1, hash embeddings of 200/100 rows, ner hidden width 16. No paths are set."""

    def make():
        from spacy.cli.init_config import init_config

        config = init_config(lang="en", pipeline=["ner"], optimize="efficiency")
        tok2vec = config["components"]["tok2vec"]["model"]
        tok2vec["encode"]["width"] = 16
        tok2vec["encode"]["depth"] = 1
        tok2vec["embed"]["rows"] = [200, 100, 100, 100]
        config["components"]["ner"]["model"]["hidden_width"] = 16
        return config

    return make


@pytest.fixture(scope="session")
def trf_ner_config(tiny_transformer):
    """The transformer + ner config text (see `synthetic.TRF_NER_CONFIG`) pointing at
    the tiny transformer."""
    return synthetic.TRF_NER_CONFIG.replace(
        "transformer = null", f'transformer = "{tiny_transformer}"', 1
    )


@pytest.fixture(scope="session")
def trf_ner_dir(tmp_path_factory, tiny_transformer, blank_nlp):
    """A transformer + ner pipeline, trained for a few steps, saved to disk."""
    train_docs = synthetic.make_ner_docs(blank_nlp, 40, seed=4)
    nlp = synthetic.build_trf_ner_pipeline(tiny_transformer, train_docs, n_steps=8)
    path = tmp_path_factory.mktemp("trf_ner") / "model"
    nlp.to_disk(path)
    return path


@pytest.fixture
def trf_ner_nlp(trf_ner_dir):
    """A fresh copy of the trained transformer + ner pipeline (safe to modify)."""
    return spacy.load(trf_ner_dir)


@pytest.fixture(scope="session")
def dev_examples(blank_nlp):
    """Generated gold examples for evaluation (fresh predicted docs)."""
    docs = synthetic.make_ner_docs(blank_nlp, 30, seed=5)
    return [Example(blank_nlp.make_doc(d.text), d) for d in docs]


@pytest.fixture
def ctrl_c_as_in_a_terminal():
    """Ctrl-C handled as Python does by default, in this process and in the processes a
    test starts: a test run started in the background by a shell without job control
    (`cmd &` in a script, as CI may run) inherits Ctrl-C ignored, which training keeps
    (spacy_lean.training.stopping.StopRequest), so its Ctrl-C tests would see nothing."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: the models are tiny, and on a shared 2-core
    machine a second intra-op thread only adds contention (it made the char-LM tests
    up to 50x slower). Modules use it with `pytest.mark.usefixtures`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def mixed_precision_on_the_cpu():
    """thinc's gradient scaler (mixed precision) refuses tensors that are not on a GPU,
    but its arithmetic is the same on the CPU: scale the gradient flowing into the
    torch model by 2^16, let torch accumulate, unscale the model's .grad with torch's
    own kernel (which runs on the CPU too), check for infinities, update the scale. For
    the test, its scaling step is let through on the CPU; the forward stays in float32
    (autocast for "cuda" does nothing here), so the scaled and unscaled gradients are
    exact."""
    import warnings
    from unittest import mock

    from thinc.shims.pytorch_grad_scaler import PyTorchGradScaler

    def scale_tensor(self, tensor, scale_per_device, inplace):
        scale = self._scale.to(tensor.device)
        return tensor.mul_(scale) if inplace else tensor * scale

    # ... and lean_update's refusal of mixed precision off the GPU lets it through too.
    no_check = mock.patch("spacy_lean.training.update.check_mixed_precision_device")
    with mock.patch.object(PyTorchGradScaler, "_scale_tensor", scale_tensor), no_check:
        with warnings.catch_warnings():
            # torch.autocast("cuda") without CUDA: it says it is disabled
            warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
            yield
