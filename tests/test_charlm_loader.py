"""The memory-mapped character-LM loader: encoding, dtypes, per-row continuity,
random sequence lengths, rank shares and exact resume."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spacy_lean import synthetic
from spacy_lean.charlm.loader import (
    CharLMLoader,
    EncodedText,
    encode_text,
    encode_texts,
    id_dtype,
    iter_text_chunks,
)
from spacy_lean.charlm.model import CharDictionary


@pytest.fixture(scope="module")
def text():
    return "\n".join(synthetic.generated_sentences(60, seed=7)) + "\n"


@pytest.fixture(scope="module")
def dictionary(text):
    return CharDictionary.from_texts([text])


@pytest.fixture(scope="module")
def encoded(text, dictionary, tmp_path_factory):
    return encode_text(text, dictionary, tmp_path_factory.mktemp("encoded"))


def _take(loader, n):
    """Copies of the next `n` batches (the loader reuses its buffer)."""
    out = []
    for x, y in loader:
        out.append((x.copy(), y.copy()))
        if len(out) == n:
            break
    return out


def _epoch(loader):
    return [(x.copy(), y.copy()) for x, y in loader]


@pytest.mark.parametrize(
    "size,dtype",
    [(1, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.int32)],
)
def test_id_dtype_is_the_smallest_that_fits(size, dtype):
    assert id_dtype(size) == np.dtype(dtype)


def test_id_dtype_rejects_empty_dictionary():
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        id_dtype(0)


def test_encoding_matches_dictionary_and_is_memory_mapped(encoded, text, dictionary):
    assert isinstance(encoded.ids, np.memmap)
    assert encoded.ids.dtype == np.uint8
    assert (encoded.path / "ids.bin").stat().st_size == len(text)  # 1 byte per character
    np.testing.assert_array_equal(encoded.ids, dictionary.encode(text))
    reopened = EncodedText(encoded.path)
    np.testing.assert_array_equal(reopened.ids, encoded.ids)
    assert reopened.matches(dictionary)


def test_large_dictionary_uses_uint16(tmp_path):
    chars = [chr(0x4E00 + i) for i in range(300)]  # 300 CJK characters: > 256 entries
    dictionary = CharDictionary(["<unk>"] + chars)
    text = "".join(chars[i % 300] for i in range(0, 3000, 7)) + "x"  # "x" is unknown
    enc = encode_text(text, dictionary, tmp_path)
    assert enc.ids.dtype == np.uint16
    assert (tmp_path / "ids.bin").stat().st_size == 2 * len(text)
    np.testing.assert_array_equal(enc.ids, dictionary.encode(text))
    assert enc.ids[-1] == 0


def test_streaming_encoding_across_chunk_boundaries(tmp_path):
    """Tiny chunks split multi-byte characters and CRLF pairs; files are joined with
    the document delimiter; unknown characters map to 0; a directory is read sorted."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "b.txt").write_bytes("zweite Zeile: ñandú 🐍\r\nEnde".encode("utf8"))
    (folder / "a.txt").write_bytes("Erste Datei, Größe\r\nzwei\n".encode("utf8"))
    expected = "Erste Datei, Größe\nzwei\n" + "zweite Zeile: ñandú 🐍\nEnde" + "\n"
    dictionary = CharDictionary.from_texts([expected.replace("🐍", "")])
    for chunk_size in (1, 2, 3, 5, 1 << 20):
        chunks = list(iter_text_chunks([folder], chunk_size=chunk_size))
        assert "".join(chunks) == expected
        out = tmp_path / f"enc{chunk_size}"
        enc = encode_texts([folder], dictionary, out, chunk_size=chunk_size)
        np.testing.assert_array_equal(enc.ids, dictionary.encode(expected))
        assert enc.ids[expected.index("🐍")] == 0


def test_encode_errors(tmp_path, dictionary):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        encode_texts([empty], dictionary, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        encode_texts([tmp_path / "missing.txt"], dictionary, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="encode_texts"):
        EncodedText(tmp_path)


def test_batches_are_views_of_one_preallocated_buffer(encoded):
    loader = CharLMLoader(encoded, batch_size=4, bptt=12, seed=0)
    for i, (x, y) in enumerate(loader):
        assert x.shape == y.shape and x.shape[1] == 4
        assert np.shares_memory(x, loader.buffer) and np.shares_memory(y, loader.buffer)
        assert x.dtype == encoded.ids.dtype
        np.testing.assert_array_equal(x[1:], y[:-1])  # y is x shifted by one character
        if i == 5:
            break


@pytest.mark.parametrize("reverse", [False, True])
def test_rows_continue_across_batches_and_cover_the_text(encoded, reverse):
    """Row i of batch k+1 continues row i of batch k; over an epoch each row reads its
    own contiguous stream of the (possibly reversed) text."""
    bs = 5
    loader = CharLMLoader(encoded, batch_size=bs, bptt=16, seed=3, reverse=reverse)
    batches = _epoch(loader)
    assert loader.epoch == 1 and loader.offset == 0
    xs = np.concatenate([x for x, _ in batches])
    ys = np.concatenate([y for _, y in batches])
    ids = np.asarray(encoded.ids)
    if reverse:
        ids = ids[::-1]
    L = loader.stream_len
    assert L == (len(ids) - 1) // bs
    assert xs.shape == (L, bs)
    for i in range(bs):
        np.testing.assert_array_equal(xs[:, i], ids[i * L : (i + 1) * L])
        np.testing.assert_array_equal(ys[:, i], ids[i * L + 1 : (i + 1) * L + 1])
    # The last target of batch k is the first input of batch k+1, row by row.
    for (_, y0), (x1, _) in zip(batches, batches[1:]):
        np.testing.assert_array_equal(y0[-1], x1[0])


def test_sequence_lengths_are_random_around_bptt_and_seeded(encoded):
    def lengths(seed, **kwargs):
        loader = CharLMLoader(encoded, batch_size=2, bptt=40, seed=seed, **kwargs)
        return [len(x) for x, _ in loader][:-1]  # the last batch is cut by the text's end

    a, b, c = lengths(0), lengths(0), lengths(1)
    assert a == b and a != c
    assert len(set(a)) > 3
    loader = CharLMLoader(encoded, batch_size=2, bptt=40)
    assert all(loader.min_len <= n <= loader.max_len for n in a)
    assert abs(np.mean(a) - 40) < 8
    assert set(lengths(0, randomize=False)) == {40}


@settings(max_examples=25, deadline=None)
@given(
    n_before=st.integers(0, 40),
    seed=st.integers(0, 2**32 - 1),
    bs=st.integers(1, 6),
    reverse=st.booleans(),
)
def test_resume_from_state_gives_the_exact_sequence(encoded, n_before, seed, bs, reverse):
    """Stop after any number of batches (also past an epoch's end), save the small
    state as JSON, restore it in a new loader: the rest is identical."""
    kwargs = dict(batch_size=bs, bptt=20, seed=seed, reverse=reverse)
    full = CharLMLoader(encoded, **kwargs)
    reference = _epoch(full) + _epoch(full)
    interrupted = CharLMLoader(encoded, **kwargs)
    done = []
    while len(done) < n_before and len(done) < len(reference):
        got = _take(interrupted, n_before - len(done))
        if not got:  # an epoch ended exactly: the next call starts a new one
            continue
        done.extend(got)
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert len(json.dumps(state)) < 1000
    resumed = CharLMLoader(encoded, **kwargs)
    resumed.load_state_dict(state)
    rest = []
    while resumed.epoch < 2:
        rest.extend(_epoch(resumed))
    both = done + rest
    assert len(both) == len(reference)
    for (x0, y0), (x1, y1) in zip(both, reference):
        np.testing.assert_array_equal(x0, x1)
        np.testing.assert_array_equal(y0, y1)


def test_rank_shares_are_disjoint_streams_in_lockstep(encoded):
    """Two workers with 3 streams each read exactly what one worker with 6 streams
    reads: worker r gets columns [3r, 3r + 3), with the same sequence lengths."""
    single = _epoch(CharLMLoader(encoded, batch_size=6, bptt=10, seed=5))
    shares = [
        _epoch(CharLMLoader(encoded, batch_size=3, bptt=10, seed=5, rank=r, world_size=2))
        for r in range(2)
    ]
    assert len(shares[0]) == len(shares[1]) == len(single)
    for k, (x, y) in enumerate(single):
        np.testing.assert_array_equal(np.concatenate([shares[0][k][0], shares[1][k][0]], 1), x)
        np.testing.assert_array_equal(np.concatenate([shares[0][k][1], shares[1][k][1]], 1), y)


def test_resume_on_a_different_number_of_workers(encoded):
    """A state saved by 2 workers x 2 streams resumes on 1 worker x 4 streams (and on
    4 x 1) with the same batches: the global stream count is what the state fixes."""
    reference = _epoch(CharLMLoader(encoded, batch_size=4, bptt=10, seed=9))
    two = [
        CharLMLoader(encoded, batch_size=2, bptt=10, seed=9, rank=r, world_size=2) for r in range(2)
    ]
    for loader in two:
        _take(loader, 7)
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    for world in (1, 4):
        bs = CharLMLoader.batch_size_for(state, world)
        assert bs == 4 // world
        parts = []
        for r in range(world):
            loader = CharLMLoader(encoded, batch_size=bs, bptt=10, seed=9, rank=r, world_size=world)
            loader.load_state_dict(state)
            parts.append(_epoch(loader))
        for k, (x, _) in enumerate(reference[7:]):
            np.testing.assert_array_equal(np.concatenate([p[k][0] for p in parts], 1), x)
    with pytest.raises(ValueError, match="must divide"):
        CharLMLoader.batch_size_for(state, 3)


def test_load_state_errors(encoded, tmp_path, dictionary):
    state = CharLMLoader(encoded, batch_size=4, bptt=10).state_dict()
    with pytest.raises(ValueError, match="4 streams"):
        CharLMLoader(encoded, batch_size=2, bptt=10).load_state_dict(state)
    with pytest.raises(ValueError, match="other direction"):
        CharLMLoader(encoded, batch_size=4, bptt=10, reverse=True).load_state_dict(state)
    other = encode_text("a shorter text\n" * 20, dictionary, tmp_path)
    with pytest.raises(ValueError, match="characters"):
        CharLMLoader(other, batch_size=4, bptt=10).load_state_dict(state)


def test_loader_argument_errors(encoded):
    with pytest.raises(ValueError, match="too short"):
        CharLMLoader(encoded.ids[:5], batch_size=8, bptt=4)
    with pytest.raises(ValueError, match="batch_size"):
        CharLMLoader(encoded, batch_size=0, bptt=4)
    with pytest.raises(ValueError, match="rank"):
        CharLMLoader(encoded, batch_size=2, bptt=4, rank=2, world_size=2)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1 << 20])
def test_invalid_utf8_names_the_file_and_byte(tmp_path, chunk_size):
    """One bad byte in one file of a folder: the error says which file and where (it
    was codec's 'position 804' of some chunk of some file)."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("Gut. Größe\n", encoding="utf8")
    (folder / "b.txt").write_bytes("Straße und ".encode("utf8") + b"\xff" + b" mehr\n")
    with pytest.raises(ValueError, match=r"b\.txt is not valid UTF-8.* at byte 12\b"):
        list(iter_text_chunks([folder], chunk_size=chunk_size))
    # A file cut inside a multi-byte character fails the same way, at its end.
    (folder / "b.txt").write_bytes("Straß".encode("utf8")[:-1])
    with pytest.raises(ValueError, match=r"b\.txt is not valid UTF-8.* at byte 4\b"):
        list(iter_text_chunks([folder], chunk_size=chunk_size))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_ids_reach_the_model_as_int64_copies_whatever_their_dtype(monkeypatch, dtype):
    """torch before 2.3 has no uint16: torch.from_numpy refuses such an array (the
    package allows torch>=2.1), so the trainer converts uint16 ids with numpy."""
    import torch

    from spacy_lean.charlm import train

    from_numpy = torch.from_numpy

    def old_from_numpy(array):
        if array.dtype == np.uint16:
            raise TypeError("can't convert np.ndarray of type numpy.uint16")
        return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", old_from_numpy)
    ids = np.array([[0, 5, 255], [7, 1, 2]], dtype=dtype)
    tensor = train._to_device(ids, torch.device("cpu"))
    assert tensor.dtype == torch.int64
    np.testing.assert_array_equal(tensor.numpy(), ids.astype(np.int64))
    ids[0, 0] = 9  # the loader reuses its buffer: the tensor must not see that
    assert int(tensor[0, 0]) == 0
