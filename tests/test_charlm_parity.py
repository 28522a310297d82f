"""Same vectors as Flair's FlairEmbeddings for the same checkpoints and sentences.

The reference vectors in tests/data/charlm were computed by flair 0.15.1 (see
scripts/make_flair_reference.py); flair itself is not needed to run these tests.
"""

import json
from pathlib import Path

import numpy
import pytest
import spacy
import torch
from spacy.tokens import Doc

from spacy_lean.charlm import CharLM
from spacy_lean.charlm.embed import CharLMEmbedder

DATA = Path(__file__).parent / "data" / "charlm"
MODES = {
    "default": {},
    "nows": {"with_whitespace": False},
    "lower": {"is_lower": True},
    "plain": {"tokenized_lm": False},
}
CASES = [("h64", m) for m in ("default", "nows", "lower", "plain")] + [
    ("proj", "default"),
    ("proj", "nows"),
    ("flairwritten", "default"),
]
TOLERANCE = 1e-5


# One torch thread (conftest's fixture).
pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def sentences():
    return json.loads((DATA / "sentences.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def docs(sentences):
    vocab = spacy.blank("en").vocab
    return [Doc(vocab, words=s["words"], spaces=s["spaces"]) for s in sentences]


def _lms(pair):
    return (
        CharLM.load(DATA / f"{pair}-forward.pt", has_decoder=False),
        CharLM.load(DATA / f"{pair}-backward.pt", has_decoder=False),
    )


def test_fixture_sentences_cover_the_tricky_cases(sentences):
    text = " ".join(" ".join(s["words"]) for s in sentences)
    forward, _ = _lms("h64")
    assert "☃" in text and forward.dictionary.get_idx("☃") == 0  # an unknown character
    assert "İ" in text and len("İ".lower()) == 2  # lowercasing lengthens the text
    assert max(len(w) for s in sentences for w in s["words"]) > 60  # a long token
    assert any(not all(s["spaces"][:-1]) for s in sentences)  # tokens without a space


@pytest.mark.parametrize("pair,mode", CASES)
@pytest.mark.parametrize("batch_size,concurrent", [(32, False), (3, True)])
def test_vectors_equal_flair(docs, pair, mode, batch_size, concurrent):
    embedder = CharLMEmbedder(
        *_lms(pair), batch_size=batch_size, concurrent=concurrent, **MODES[mode]
    )
    vectors, n_tokens = embedder(docs)
    reference = numpy.load(DATA / f"ref_{pair}_{mode}.npy")
    assert n_tokens.tolist() == [len(d) for d in docs]
    assert vectors.shape == reference.shape
    assert float(numpy.abs(vectors.numpy() - reference).max()) <= TOLERANCE


@pytest.mark.parametrize("pair,mode", CASES)
@pytest.mark.parametrize("max_chunk_chars", [1, 7, 64])
def test_vectors_equal_flair_when_read_in_chunks(docs, pair, mode, max_chunk_chars):
    """The sentences (up to 95 LM characters) read in chunks of 1, 7 and 64 characters,
    the LSTM state carried over: still Flair's vectors."""
    embedder = CharLMEmbedder(
        *_lms(pair), batch_size=8, max_chunk_chars=max_chunk_chars, **MODES[mode]
    )
    vectors, _ = embedder(docs)
    reference = numpy.load(DATA / f"ref_{pair}_{mode}.npy")
    assert float(numpy.abs(vectors.numpy() - reference).max()) <= TOLERANCE


def test_batches_of_one_text(docs):
    embedder = CharLMEmbedder(*_lms("h64"), batch_size=1)
    vectors, _ = embedder(docs)
    reference = numpy.load(DATA / "ref_h64_default.npy")
    assert float(numpy.abs(vectors.numpy() - reference).max()) <= TOLERANCE


def _cuda_noise(lms, docs):
    """How far the LMs' own top-layer outputs on CUDA are from the CPU's, for the docs'
    texts in one padded batch (torch's embedding and LSTM modules, which the LM holds:
    cuDNN's kernels sum in other orders, and a rounding difference grows along the
    recurrence), apart from the embedder's own work: positions, chunks, the carried
    state, the batching."""
    noise = 0.0
    for lm in lms:
        rows = [lm.dictionary.encode(doc.text) for doc in docs]
        width = max(len(row) for row in rows)
        ids = torch.tensor([row + [0] * (width - len(row)) for row in rows]).t()
        with torch.no_grad():
            _, on_cpu, _ = lm.to("cpu")(ids, decode=False)
            _, on_gpu, _ = lm.to("cuda")(ids.to("cuda"), decode=False)
        noise = max(noise, float((on_gpu.cpu() - on_cpu).abs().max()))
    return noise


def _gpu_tolerance(lms, docs):
    """TOLERANCE, or four times the LMs' own CUDA-vs-CPU difference where that is
    larger, never above 2e-4: on the H100 (2026-11-27) the h64 pair's vectors were
    5.2e-5 from Flair's (CPU) reference with TF32 off, the proj pair's within 1e-5. The
    LMs' own difference must stay below 1e-4 (far more would be no rounding); a wrong
    position or a lost state is off by ~0.1 and still fails."""
    noise = _cuda_noise(lms, docs)
    assert noise < 1e-4, f"the LMs alone differ by {noise} between CUDA and the CPU"
    return max(TOLERANCE, min(4 * noise, 2e-4))


@pytest.mark.gpu
@pytest.mark.parametrize("pair,mode", [("h64", "default"), ("proj", "nows")])
def test_vectors_equal_flair_on_gpu(docs, pair, mode):
    """The reference comes from CPU; cuDNN must not use TF32 for the comparison."""
    lms = _lms(pair)
    allow = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        tolerance = _gpu_tolerance(lms, docs)
        fw, bw = (lm.to("cuda") for lm in lms)
        vectors, _ = CharLMEmbedder(fw, bw, **MODES[mode])(docs)
    finally:
        torch.backends.cudnn.allow_tf32 = allow
    assert vectors.device.type == "cuda"
    reference = numpy.load(DATA / f"ref_{pair}_{mode}.npy")
    difference = float(numpy.abs(vectors.cpu().numpy() - reference).max())
    assert difference <= tolerance, (difference, tolerance)


@pytest.mark.gpu
def test_vectors_equal_flair_on_gpu_in_chunks(docs):
    """Chunks of 7 characters on CUDA (the carried state stays on the GPU)."""
    lms = _lms("proj")
    allow = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        tolerance = _gpu_tolerance(lms, docs)
        fw, bw = (lm.to("cuda") for lm in lms)
        vectors, _ = CharLMEmbedder(fw, bw, batch_size=8, max_chunk_chars=7)(docs)
    finally:
        torch.backends.cudnn.allow_tf32 = allow
    reference = numpy.load(DATA / "ref_proj_default.npy")
    difference = float(numpy.abs(vectors.cpu().numpy() - reference).max())
    assert difference <= tolerance, (difference, tolerance)


def test_plain_mode_ignores_trailing_whitespace_like_flair(docs, sentences):
    """Flair's `to_plain_string()` strips the text's end: a doc whose last token has
    a trailing space gets the vectors of the same doc without it."""
    vocab = docs[0].vocab
    trailing = [Doc(vocab, words=s["words"], spaces=s["spaces"][:-1] + [True]) for s in sentences]
    vectors, _ = CharLMEmbedder(*_lms("h64"), tokenized_lm=False)(trailing)
    reference = numpy.load(DATA / "ref_h64_plain.npy")
    assert float(numpy.abs(vectors.numpy() - reference).max()) <= TOLERANCE


def test_word_lists_and_docs_give_the_same_vectors(docs, sentences):
    embedder = CharLMEmbedder(*_lms("h64"))
    from_docs, _ = embedder(docs)
    from_words, _ = embedder([s["words"] for s in sentences])
    assert numpy.array_equal(from_docs.numpy(), from_words.numpy())


def test_one_direction_is_half_of_the_pair(docs):
    forward, backward = _lms("h64")
    reference = numpy.load(DATA / "ref_h64_default.npy")
    only_fw, _ = CharLMEmbedder(forward)(docs)
    only_bw, _ = CharLMEmbedder(backward_lm=backward)(docs)
    assert float(numpy.abs(only_fw.numpy() - reference[:, :64]).max()) <= TOLERANCE
    assert float(numpy.abs(only_bw.numpy() - reference[:, 64:]).max()) <= TOLERANCE


def test_order_and_batching_do_not_change_vectors(docs):
    """Sorting by length and batching are internal: shuffled input gives the same
    rows for each doc."""
    embedder = CharLMEmbedder(*_lms("proj"), batch_size=4)
    reference = embedder.split(docs)
    perm = numpy.random.RandomState(0).permutation(len(docs))
    shuffled = embedder.split([docs[i] for i in perm])
    for k, i in enumerate(perm):
        assert float((shuffled[k] - reference[i]).abs().max()) <= TOLERANCE


def test_empty_docs_and_empty_input(docs):
    vocab = docs[0].vocab
    embedder = CharLMEmbedder(*_lms("h64"))
    vectors, n_tokens = embedder([Doc(vocab, words=[]), docs[5], Doc(vocab, words=[])])
    assert n_tokens.tolist() == [0, len(docs[5]), 0]
    alone, _ = embedder([docs[5]])
    assert numpy.array_equal(vectors.numpy(), alone.numpy())
    vectors, n_tokens = embedder([])
    assert vectors.shape == (0, 128) and n_tokens.tolist() == []


def test_threads_setting_is_restored(docs):
    import torch

    before = torch.get_num_threads()
    embedder = CharLMEmbedder(*_lms("h64"), threads=1)
    reference = numpy.load(DATA / "ref_h64_default.npy")
    vectors, _ = embedder(docs)
    assert torch.get_num_threads() == before
    assert float(numpy.abs(vectors.numpy() - reference).max()) <= TOLERANCE


def test_embedder_errors():
    forward, backward = _lms("h64")
    with pytest.raises(ValueError, match="needs a forward LM, a backward LM, or both"):
        CharLMEmbedder()
    with pytest.raises(ValueError, match="forward LM slot got a backward LM"):
        CharLMEmbedder(backward, forward)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        CharLMEmbedder(forward, batch_size=0)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        CharLMEmbedder(forward, threads=0)


@pytest.mark.parametrize("text", ["A short note.\n", "Two lines.\n\n", " \t ", "\n"])
def test_plain_mode_keeps_trailing_whitespace_tokens(text):
    """spaCy keeps whitespace as tokens ("\\n" at the end of a text read from a file):
    in plain mode only the last token's trailing space is dropped (what Flair's
    `rstrip` drops, Flair tokens never being whitespace), not the token itself, so its
    rows are real LM states, alone or next to a longer doc."""
    nlp = spacy.blank("en")
    doc, longer = nlp(text), nlp("A much longer sentence that sets the padded length here.")
    embedder = CharLMEmbedder(*_lms("h64"), tokenized_lm=False)
    alone, _ = embedder([doc])
    batched, _ = embedder([doc, longer])
    assert alone.shape == (len(doc), 128)
    assert float((alone - batched[: len(doc)]).abs().max()) <= TOLERANCE
    # Plain mode on a doc of single-spaced tokens is the tokenized input.
    tokenized, _ = CharLMEmbedder(*_lms("h64"))([doc])
    if all(t.whitespace_ for t in doc[:-1]):
        assert float((alone - tokenized).abs().max()) <= TOLERANCE


def _pipe_char_lm(sentences):
    """Fresh docs through a `char_lm` component with the h64 LMs (read from their
    checkpoints by the layer, onto the device of thinc's current ops), in batches of 8.
    RETURNS the docs and the component's LM pair."""
    from spacy_lean.charlm.layer import get_pair

    nlp = spacy.blank("en")
    lms = {"forward_lm": str(DATA / "h64-forward.pt"), "backward_lm": str(DATA / "h64-backward.pt")}
    nlp.add_pipe("char_lm", config={"model": lms})
    nlp.initialize()
    docs = [Doc(nlp.vocab, words=s["words"], spaces=s["spaces"]) for s in sentences]
    return list(nlp.pipe(docs, batch_size=8)), get_pair(nlp.get_pipe("char_lm").model)


@pytest.mark.gpu
def test_the_char_lm_component_on_the_gpu_gives_flairs_vectors(docs, sentences):
    """The `char_lm` component in nlp.pipe with thinc's ops on cupy (only the embedder
    had run on CUDA): the layer loads the LMs onto the GPU (its shim's device), each doc
    gets a compact cupy array of its own rows (a copy, not a view of the batch's), and
    the vectors are Flair's (CPU) reference within the calibrated tolerance."""
    cupy = pytest.importorskip("cupy")
    from thinc.api import require_cpu, require_gpu

    allow = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    require_gpu(0)
    try:
        tolerance = _gpu_tolerance(_lms("h64"), docs)
        out, pair = _pipe_char_lm(sentences)
        assert next(pair.forward_lm.parameters()).is_cuda
        for doc in out:
            assert isinstance(doc.tensor, cupy.ndarray) and doc.tensor.base is None
            assert doc.tensor.shape == (len(doc), 128) and doc.tensor.dtype == "float32"
        got = numpy.concatenate([cupy.asnumpy(doc.tensor) for doc in out])
    finally:
        require_cpu()
        torch.backends.cudnn.allow_tf32 = allow
    reference = numpy.load(DATA / "ref_h64_default.npy")
    difference = float(numpy.abs(got - reference).max())
    assert difference <= tolerance, (difference, tolerance)
