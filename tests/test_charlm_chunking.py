"""Time-chunked LM passes (`max_chunk_chars`) give the vectors of the whole-text pass.

The LMs here are built in the tests (random weights) over a dictionary of the test
texts, so the odd characters (astral-plane emoji, combining marks, right-to-left
letters, "İ", a lone surrogate) have ids of their own; one character is left out of
the dictionary to be unknown. The Flair-reference checks with chunking are in
test_charlm_parity.py.

Tolerance: max abs difference <= 1e-6 (CPU, float32). Observed: 0.0 for one-layer LMs
(the LSTM's steps are the same operations in the same order), a few 1e-7 for the
two-layer LM with a projection (matrix products over fewer rows round differently).
"""

import random

import numpy
import pytest
import spacy
import torch
from spacy.tokens import Doc

from spacy_lean.charlm import CharDictionary, CharLM
from spacy_lean.charlm.embed import DEFAULT_MAX_CHUNK_CHARS, CharLMEmbedder
from spacy_lean.charlm.layer import build_charlm_embed_v1, get_pair

TOLERANCE = 1e-6
ODD = [
    "🦜", "👩‍💻", "é", "tête-à-tête", "東京都", "שָׁלוֹם", "İstanbul", "ﬁne",
    "x\u200by", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ạ̈", "Ω≈ç√", "naïve", "☃",
]  # fmt: skip
UNKNOWN = "☃"  # left out of the dictionary: id 0
MODES = {
    "default": {},
    "nows": {"with_whitespace": False},
    "lower": {"is_lower": True},
    "plain": {"tokenized_lm": False},
}
ARCHS = {
    "lstm": dict(hidden_size=24, nlayers=1),
    "lstm2proj": dict(hidden_size=20, nlayers=2, nout=12),
    "gru": dict(hidden_size=24, nlayers=1, recurrent_type="gru"),
}


# One torch thread (conftest's fixture).
pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


def _words(rng: random.Random, n: int):
    """`n` generated words: lowercase and capitalised syllables, punctuation, the odd
    characters, now and then a token longer than several chunks."""
    syllables = ["ka", "lo", "men", "tra", "vi", "os", "qu", "ber", "ne", "sh"]
    words = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.15:
            words.append(rng.choice(ODD))
        elif roll < 0.2:
            words.append(rng.choice([".", ",", "!", "--", "(", ")"]))
        elif roll < 0.21:
            words.append("".join(rng.choice(syllables) for _ in range(40)))  # 80-ish chars
        else:
            word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
            words.append(word.capitalize() if rng.random() < 0.2 else word)
    return words


@pytest.fixture(scope="module")
def word_lists():
    """Texts of very different lengths, in no particular order: long (several
    thousand characters), medium, short, one character, empty."""
    rng = random.Random(7)
    lists = [_words(rng, n) for n in (400, 60, 3, 1, 0, 150, 12, 0, 2)]
    lists[3] = ["a"]
    return lists


@pytest.fixture(scope="module")
def docs(word_lists):
    vocab = spacy.blank("en").vocab
    rng = random.Random(3)
    out = []
    for words in word_lists:
        # Mostly spaces, sometimes none (plain mode reads the text as it is).
        spaces = [rng.random() < 0.8 for _ in words]
        out.append(Doc(vocab, words=words, spaces=spaces))
    return out


@pytest.fixture(scope="module")
def dictionary(word_lists):
    text = " ".join(w for words in word_lists for w in words) + "\n"
    chars = set(text) | set(text.lower())
    return CharDictionary(["<unk>"] + sorted(chars - {UNKNOWN}))


def _lms(dictionary, arch: str, seed: int = 0):
    lms = []
    for k, forward in enumerate((True, False)):
        torch.manual_seed(seed + k)
        lm = CharLM(dictionary, forward, embedding_size=8, has_decoder=False, **ARCHS[arch])
        lms.append(lm.eval())
    return lms


def _embed(lms, items, **settings):
    vectors, n_tokens = CharLMEmbedder(*lms, **settings)(items)
    return vectors, n_tokens


def _max_diff(a, b) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max()) if a.numel() else 0.0


def test_the_texts_cover_the_cases(docs, dictionary):
    lengths = sorted(len(d.text) for d in docs)
    assert lengths[-1] > 2000 and lengths[0] == 0 and 0 in [len(d) for d in docs]
    text = " ".join(d.text for d in docs)
    assert "🦜" in text and "İ" in text and len("İ".lower()) == 2
    assert dictionary.get_idx(UNKNOWN) == 0 and UNKNOWN in text
    assert dictionary.get_idx("🦜") > 0  # one code point above U+FFFF, its own id
    assert max(len(w) for d in docs for w in (t.text for t in d)) > 64


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize(
    "mode,chunk",
    # One-character chunks (every position a boundary) in the default mode only: slow.
    [("default", 1)] + [(mode, chunk) for mode in sorted(MODES) for chunk in (16, 97, 1000)],
)
def test_chunked_vectors_equal_the_whole_text_pass(dictionary, docs, arch, mode, chunk):
    """Long texts over many chunks, texts shorter than a chunk, empty docs, and LM
    batches (of 4) whose texts end in different chunks."""
    lms = _lms(dictionary, arch)
    whole, n_whole = _embed(lms, docs, batch_size=4, max_chunk_chars=None, **MODES[mode])
    chunked, n_chunked = _embed(lms, docs, batch_size=4, max_chunk_chars=chunk, **MODES[mode])
    assert n_chunked.tolist() == n_whole.tolist() == [len(d) for d in docs]
    assert _max_diff(chunked, whole) <= TOLERANCE


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("with_whitespace", [True, False])
def test_every_chunk_length_on_short_texts(dictionary, word_lists, arch, with_whitespace):
    """Every chunk length from 1 to past the longest text: a chunk boundary falls at
    every position once, so before, at, after and inside every token, in both
    directions. Word lists (not Docs) so a lone surrogate can be in a word."""
    items = [["ab", "cde", "f"], ["🦜", "x\ud800y", "İ", UNKNOWN], [], word_lists[6]]
    lms = _lms(dictionary, arch)
    whole, _ = _embed(lms, items, max_chunk_chars=None, with_whitespace=with_whitespace)
    longest = max(len(" ".join(words)) for words in items) + 2
    for chunk in range(1, longest + 2):
        chunked, _ = _embed(lms, items, max_chunk_chars=chunk, with_whitespace=with_whitespace)
        assert _max_diff(chunked, whole) <= TOLERANCE, chunk


def _record_calls(lm):
    """(input ids, state in, output, state out) of each LSTM call of `lm`."""
    calls = []

    def hook(module, args, output):
        calls.append((args[0].clone(), args[1], output[1].shape, output[2]))

    return calls, lm.register_forward_hook(hook)


def test_chunks_follow_each_lms_reading_direction_and_carry_the_state(dictionary):
    """ "ab men o" in chunks of 3. The forward LM reads "\\nab| me|n o| " and takes its
    rows at 3 ("ab": first position of chunk 2), 7 ("men": inside chunk 3) and 9 ("o":
    the one position of chunk 4); the backward LM reads the reversed text "\\no |nem|
    ba| " and takes them at 2 ("o": last of chunk 1), 6 ("men": first of chunk 3) and 9
    ("ab": chunk 4). A boundary falls inside "men" forward and inside "ab" backward.
    Each chunk starts from the state the chunk before it ended with."""
    fw, bw = _lms(dictionary, "lstm")
    whole, _ = _embed([fw, bw], [["ab", "men", "o"]], max_chunk_chars=None)
    fw_calls, _ = _record_calls(fw)
    bw_calls, _ = _record_calls(bw)
    chunked, _ = _embed([fw, bw], [["ab", "men", "o"]], max_chunk_chars=3)
    assert _max_diff(chunked, whole) <= TOLERANCE
    expected = {"forward": ["\nab", " me", "n o", " "], "backward": ["\no ", "nem", " ba", " "]}
    for calls, pieces in ((fw_calls, expected["forward"]), (bw_calls, expected["backward"])):
        read = ["".join(dictionary.idx2item[int(i)] for i in ids[:, 0]) for ids, *_ in calls]
        assert read == pieces
        assert all(float(h.abs().sum()) == 0 for h in calls[0][1])  # starts from zeros
        for before, after in zip(calls, calls[1:]):
            assert all(torch.equal(a, b) for a, b in zip(after[1], before[3]))


def test_chunk_outputs_are_bounded_and_ended_texts_leave_the_batch(dictionary, docs):
    """No LSTM call outputs more than `max_chunk_chars` steps, and once a text of the
    batch has ended its column no longer goes through the LSTM."""
    fw, bw = _lms(dictionary, "lstm")
    fw_calls, _ = _record_calls(fw)
    long_doc, medium = docs[0], docs[1]
    _embed([fw, bw], [medium, long_doc], max_chunk_chars=50)
    steps = [shape[0] for _, _, shape, _ in fw_calls]
    columns = [shape[1] for _, _, shape, _ in fw_calls]
    # The LM input: "\n" + the words joined by spaces + " ".
    long_len, medium_len = (len(" ".join(t.text for t in d)) + 2 for d in (long_doc, medium))
    assert max(steps) == 50 and len(fw_calls) == -(-long_len // 50)
    n_both = -(-medium_len // 50)  # the chunks that still hold the medium text
    assert columns == [2] * n_both + [1] * (len(fw_calls) - n_both)


def test_texts_up_to_a_chunk_take_one_lstm_call(dictionary, docs):
    fw, bw = _lms(dictionary, "lstm")
    fw_calls, _ = _record_calls(fw)
    _embed([fw, bw], docs[1:], batch_size=32)  # all under DEFAULT_MAX_CHUNK_CHARS
    assert max(len(d.text) for d in docs[1:]) + 2 <= DEFAULT_MAX_CHUNK_CHARS
    assert len(fw_calls) == 1


def test_a_doc_gets_the_same_rows_alone_and_in_a_chunked_mixed_batch(dictionary, docs):
    lms = _lms(dictionary, "lstm2proj")
    batched = CharLMEmbedder(*lms, batch_size=3, max_chunk_chars=33).split(docs)
    whole = CharLMEmbedder(*lms, batch_size=1, max_chunk_chars=None)
    for doc, rows in zip(docs, batched):
        alone, _ = whole([doc])
        assert _max_diff(rows, alone) <= TOLERANCE


def test_gradients_through_chunks_equal_the_whole_text_pass(dictionary, docs):
    """Fine-tuning (grad=True): the state is carried with autograd, so the LM's
    gradients are those of the whole-text pass (eval mode: no dropout masks)."""
    grads = {}
    for chunk in (None, 29):
        lms = _lms(dictionary, "lstm")
        vectors, _ = CharLMEmbedder(*lms, batch_size=2, max_chunk_chars=chunk)(docs[:4], grad=True)
        vectors.square().sum().backward()
        grads[chunk] = [p.grad.clone() for lm in lms for p in lm.parameters()]
    for whole, chunked in zip(grads[None], grads[29]):
        assert torch.allclose(chunked, whole, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "64"])
def test_invalid_max_chunk_chars(dictionary, bad):
    fw, _ = _lms(dictionary, "lstm")
    with pytest.raises(ValueError, match="max_chunk_chars must be an int >= 1 or None"):
        CharLMEmbedder(fw, max_chunk_chars=bad)
    with pytest.raises(ValueError, match="max_chunk_chars must be an int >= 1 or None"):
        build_charlm_embed_v1(forward_lm="unused.pt", max_chunk_chars=bad)


def test_the_component_passes_max_chunk_chars_to_the_embedder(dictionary, docs, tmp_path):
    fw, bw = _lms(dictionary, "lstm")
    fw.save(tmp_path / "fw.pt")
    bw.save(tmp_path / "bw.pt")
    paths = {"forward_lm": str(tmp_path / "fw.pt"), "backward_lm": str(tmp_path / "bw.pt")}
    nlp = spacy.blank("en")
    default = nlp.add_pipe("char_lm", name="default", config={"model": paths})
    chunked = nlp.add_pipe(
        "char_lm", name="chunked", config={"model": {**paths, "max_chunk_chars": 40}}
    )
    nlp.initialize()
    assert get_pair(default.model).embedder.max_chunk_chars == DEFAULT_MAX_CHUNK_CHARS
    assert get_pair(chunked.model).embedder.max_chunk_chars == 40
    whole, _ = _embed([fw, bw], docs, max_chunk_chars=None)
    for name in ("default", "chunked"):
        pipe = nlp.get_pipe(name)
        got = numpy.concatenate([v for v in pipe.predict(docs)])
        assert float(numpy.abs(got - whole.numpy()).max()) <= TOLERANCE
