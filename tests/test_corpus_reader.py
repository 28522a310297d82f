"""spacy-lean.Corpus.v1: sources, limit, shuffle, compact mode, resume, ranks, errors."""

import json
import re
import warnings
from pathlib import Path

import pytest
import spacy
import srsly
from spacy.tokens import Doc, DocBin, Span
from spacy.training import Corpus, Example
from spacy.training.augment import create_lower_casing_augmenter
from spacy.util import registry

import spacy_lean.corpus.reader as reader_module
from spacy_lean import synthetic
from spacy_lean.corpus import CorruptShardError, LeanCorpus, list_shards, split_among
from spacy_lean.corpus.jsonl import SkippedRecordsWarning, doc_to_record


def key(eg):
    """What identifies an example: its source doc's id, text and entities."""
    ref = eg.reference
    ents = tuple((e.start_char, e.end_char, e.label_) for e in ref.ents)
    return (ref.user_data.get("uid"), ref.text, ents)


def write_shard(path: Path, n: int, seed: int) -> Path:
    """A generated NER shard whose docs carry a unique id in user_data."""
    docs = synthetic.make_ner_docs(spacy.blank("en"), n, seed=seed)
    for i, doc in enumerate(docs):
        doc.user_data["uid"] = f"{path.name}-{i}"
    path.parent.mkdir(parents=True, exist_ok=True)
    DocBin(docs=docs, store_user_data=True).to_disk(path)
    return path


@pytest.fixture(scope="module")
def nlp():
    return spacy.blank("en")


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    """Three shards (one nested, one hidden file that must be skipped)."""
    root = tmp_path_factory.mktemp("shards")
    write_shard(root / "b.spacy", 23, seed=11)
    write_shard(root / "a.spacy", 17, seed=12)
    write_shard(root / "sub" / "c.spacy", 30, seed=13)
    write_shard(root / ".hidden.spacy", 5, seed=14)
    return root


def test_walks_shards_as_spacy_does(nlp, shard_dir):
    assert [p.name for p in list_shards(shard_dir)] == ["a.spacy", "b.spacy", "c.spacy"]
    ours = [key(eg) for eg in LeanCorpus(shard_dir)(nlp)]
    theirs = [key(eg) for eg in Corpus(shard_dir)(nlp)]
    assert len(ours) == 70
    assert ours == theirs


def test_symbolic_link_loops_in_a_corpus_folder_are_refused(tmp_path):
    """Folders are walked following symbolic links (as spaCy does): a link to the
    folder itself (or a pair pointing at each other) listed each file about 40 times,
    until the OS gave up, and two such links made the walk run forever (2**40 paths)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jsonl").write_text('{"text": "a"}\n', encoding="utf8")
    (tmp_path / "a" / "self").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match="symbolic link") as info:
        list_shards(tmp_path)
    assert str(tmp_path / "a" / "self") in str(info.value)
    (tmp_path / "a" / "self").unlink()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "to_b").symlink_to(tmp_path / "b")
    assert [p.name for p in list_shards(tmp_path)] == ["x.jsonl"]
    (tmp_path / "b" / "to_a").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match="symbolic link"):
        list_shards(tmp_path)


def test_devices_in_a_corpus_are_refused(tmp_path):
    """A .jsonl name linked to /dev/zero was listed, then read as one endless line
    until memory ran out (2.5 GB under a 3 GB ulimit, an empty MemoryError)."""
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n', encoding="utf8")
    (tmp_path / "b.jsonl").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="not a regular file") as info:
        list_shards(tmp_path)
    assert str(tmp_path / "b.jsonl") in str(info.value)
    with pytest.raises(ValueError, match="not a regular file or a folder"):
        list_shards(tmp_path / "b.jsonl")
    # A link to nothing is said to be one (it was called a device, pipe or socket).
    (tmp_path / "b.jsonl").unlink()
    (tmp_path / "c.jsonl").symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(ValueError, match=r"c\.jsonl', a symbolic link to .*gone\.jsonl"):
        list_shards(tmp_path)


def test_a_jsonl_line_longer_than_the_limit_is_refused(nlp, tmp_path, monkeypatch):
    """Lines are read up to MAX_LINE_CHARS: a file without line ends is not read whole
    as one line. Lines of exactly the limit are read."""
    import spacy_lean.corpus.jsonl as jsonl_module

    monkeypatch.setattr(jsonl_module, "MAX_LINE_CHARS", 100)
    path = tmp_path / "long.jsonl"
    fits = srsly.json_dumps({"text": "x" * 88})
    assert len(fits) + 1 == 100  # with its line end
    path.write_text(fits + "\n" + srsly.json_dumps({"text": "y" * 200}), encoding="utf8")
    with pytest.raises(CorruptShardError, match=r"long\.jsonl:2: the line is longer than 100"):
        list(LeanCorpus(path)(nlp))
    path.write_text(fits + "\n" + fits, encoding="utf8")
    assert len(list(LeanCorpus(path)(nlp))) == 2


def test_max_length_keeps_every_entity_spacy_drops_some(nlp, shard_dir):
    corpus = LeanCorpus(shard_dir, max_length=12)
    examples = list(corpus(nlp))
    assert all(len(eg.reference) <= 12 or corpus.stats.oversize_pieces for eg in examples)
    n_ents = sum(len(eg.reference.ents) for eg in examples)
    all_docs = [eg.reference for eg in LeanCorpus(shard_dir)(nlp)]
    assert n_ents == sum(len(d.ents) for d in all_docs)
    assert sum(len(eg.reference) for eg in examples) == sum(len(d) for d in all_docs)
    assert corpus.stats.docs == 70 and corpus.stats.pieces == len(examples)
    assert corpus.stats.docs_split > 0
    spacy_examples = list(Corpus(shard_dir, max_length=12)(nlp))
    assert sum(len(eg.reference) for eg in spacy_examples) < sum(len(d) for d in all_docs)


def test_limit_exact_across_shards(nlp, shard_dir):
    all_keys = [key(eg) for eg in LeanCorpus(shard_dir)(nlp)]
    for limit in (1, 16, 17, 18, 41, 500):
        got = [key(eg) for eg in LeanCorpus(shard_dir, limit=limit)(nlp)]
        assert got == all_keys[:limit]
    # spaCy's Corpus yields more than `limit` docs over several files
    assert len(list(Corpus(shard_dir, limit=18)(nlp))) > 18


def test_limit_same_subset_when_shuffled(nlp, shard_dir):
    want = sorted([key(eg) for eg in LeanCorpus(shard_dir)(nlp)][:30])
    corpus = LeanCorpus(shard_dir, limit=30, shuffle=True, shuffle_buffer=8, seed=3)
    for _ in range(2):
        assert sorted(key(eg) for eg in corpus(nlp)) == want


def test_shuffle_is_seeded_permutation(nlp, shard_dir):
    plain = [key(eg) for eg in LeanCorpus(shard_dir)(nlp)]
    a = LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=10, seed=1)
    b = LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=10, seed=1)
    a1, a2 = [key(e) for e in a(nlp)], [key(e) for e in a(nlp)]
    b1 = [key(e) for e in b(nlp)]
    assert a1 == b1  # same seed, same epoch
    assert a1 != a2  # next epoch, another order
    assert a1 != plain and sorted(a1) == sorted(plain)


def test_shard_order_is_shuffled(nlp, shard_dir):
    """With a buffer of 1, only the shard order changes."""
    by_shard = {}
    for i, path in enumerate(list_shards(shard_dir)):
        for eg in LeanCorpus(path)(nlp):
            by_shard[key(eg)] = i
    corpus = LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=1, seed=0)
    orders = set()
    for _ in range(6):
        seq = [by_shard[key(eg)] for eg in corpus(nlp)]
        orders.add(tuple(dict.fromkeys(seq)))
    assert len(orders) > 1


def test_shuffle_buffer_bounds_docs_read_ahead(nlp, shard_dir, monkeypatch):
    read = []
    original = reader_module.iter_shard_docs

    def counting(*args, **kwargs):
        for doc in original(*args, **kwargs):
            read.append(1)
            yield doc

    monkeypatch.setattr(reader_module, "iter_shard_docs", counting)
    corpus = LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=5, seed=0)
    stream = corpus(nlp)
    next(stream)
    assert len(read) == 6  # the buffer's 5, then one more to yield the first
    for i, _ in enumerate(stream, start=2):
        assert len(read) - i <= 5
    assert corpus.stats.max_buffered == 5


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_yields_the_same_sequence(nlp, shard_dir, shuffle, compact):
    settings = dict(
        max_length=15, shuffle=shuffle, shuffle_buffer=7, seed=5, compact=compact, compact_chunk=9
    )
    corpus = LeanCorpus(shard_dir, **settings)
    full = [key(eg) for eg in corpus.stream(nlp, epoch=2)]
    for stop in (0, 1, 6, 7, 8, 40, len(full) - 1, len(full)):
        stream = LeanCorpus(shard_dir, **settings).stream(nlp, epoch=2)
        head = [key(next(stream)) for _ in range(stop)]
        state = json.loads(json.dumps(stream.state()))
        assert len(json.dumps(state)) < 2000
        fresh = LeanCorpus(shard_dir, **settings)
        tail = [key(eg) for eg in fresh.stream(nlp, state=state)]
        assert head + tail == full, stop
        if shuffle and 7 <= stop <= len(full) - 7:  # the restored buffer is full (said 0)
            assert fresh.stats.max_buffered == 7, stop


def test_resume_through_call_and_set_state(nlp, shard_dir):
    corpus = LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=4, seed=9)
    epoch0 = [key(eg) for eg in corpus(nlp)]
    epoch1 = [key(eg) for eg in corpus(nlp)]
    again = LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=4, seed=9)
    assert [key(eg) for eg in again(nlp)] == epoch0
    stream = again(nlp)
    head = [key(next(stream)) for _ in range(11)]
    saved = again.state
    resumed = LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=4, seed=9)
    resumed.set_state(saved)
    assert head + [key(eg) for eg in resumed(nlp)] == epoch1
    assert resumed.epoch == 2


def test_resume_rejects_other_settings(nlp, shard_dir):
    stream = LeanCorpus(shard_dir, shuffle=True, seed=1)(nlp)
    next(stream)
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        LeanCorpus(shard_dir, shuffle=True, seed=2).stream(nlp, state=stream.state())
    # Settings that change the pieces, listed since: a state without them still loads.
    with pytest.raises(ValueError, match="jsonl_spans_key: saved 'sc', now 'ents'"):
        LeanCorpus(shard_dir, shuffle=True, seed=1, jsonl_spans_key="ents").set_state(
            stream.state()
        )
    older = stream.state()
    del older["settings"]["wordpiece_tokenizer"], older["settings"]["jsonl_spans_key"]
    LeanCorpus(shard_dir, shuffle=True, seed=1).set_state(older)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("pos", [0, -1, 0], "pos = [0, -1, 0], expected [shard, doc, piece]"),
        ("pos", [0, 1], "pos = [0, 1], expected"),
        ("buffer", [[0, 0, "1"]], "buffer[0] = [0, 0, '1'], expected"),
        ("yielded", -2, "yielded = -2"),
    ],
)
def test_resume_refuses_an_edited_state_naming_the_field(nlp, shard_dir, field, value, message):
    stream = LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=4, seed=1)(nlp)
    next(stream)
    state = dict(stream.state(), **{field: value})
    with pytest.raises(ValueError, match=re.escape(message)):
        LeanCorpus(shard_dir, shuffle=True, shuffle_buffer=4, seed=1).set_state(state)


def test_resume_of_a_piece_the_doc_no_longer_has_names_the_change(nlp, tmp_path):
    """A buffered piece past the pieces its doc now has (the file was rewritten with
    the same number of docs, shorter) raised a bare IndexError; now the reader's own
    message."""
    path = tmp_path / "c.spacy"
    synthetic.write_ner_corpus(path, 6, seed=3, long_doc_rate=0.5)
    corpus = LeanCorpus(path, max_length=8, shuffle=True, shuffle_buffer=30, seed=1)
    stream = corpus(nlp)
    next(stream)
    state = stream.state()
    assert max(ref[2] for ref in state["buffer"]) > 0
    synthetic.write_ner_corpus(path, 6, seed=3, long_doc_rate=0.0)  # shorter docs
    resumed = LeanCorpus(path, max_length=8, shuffle=True, shuffle_buffer=30, seed=1)
    with pytest.raises(ValueError, match="Could not restore the shuffle buffer"):
        list(resumed.stream(nlp, state=state))
    state["buffer"][0] = [7, 0, 0]  # a shard the corpus does not have
    with pytest.raises(ValueError, match=r"e\.g\. \(7, 0, 0\)\) are not in the corpus"):
        list(
            LeanCorpus(path, max_length=8, shuffle=True, shuffle_buffer=30, seed=1).stream(
                nlp, state=state
            )
        )


def _edit(state, path, value):
    """`state` with the field at `path` (keys) set to `value`, or deleted (`...`)."""
    state = json.loads(json.dumps(state))
    *parents, last = path
    target = state
    for part in parents:
        target = target[part]
    if value is ...:
        del target[last]
    else:
        target[last] = value(target[last]) if callable(value) else value
    return state


@pytest.mark.parametrize(
    "path,value,message",
    [
        # The buffer: a reference twice (yielded twice), more than shuffle_buffer (50
        # copies were read: one example 50 times), a million (read in seconds), fewer
        # than a full buffer once examples were yielded, a piece after the position.
        (("buffer", 1), [0, 8, 0], "buffer[1] = [0, 8, 0], expected a piece not already in"),
        (("buffer",), lambda b: b * 50, "len(buffer) = 200, expected at most shuffle_buffer = 4"),
        (("buffer",), [[0, 0, 0]] * 10**6, "len(buffer) = 1000000, expected at most"),
        (("buffer",), lambda b: b[:2], "len(buffer) = 2, expected shuffle_buffer = 4 (a full"),
        (("buffer", 2), [0, 10**15, 0], "buffer[2] = [0, 1000000000000000, 0], expected a piece"),
        # The position: a shard past the corpus's (it ended the epoch), the end of the
        # shards before they are read, a doc's 0 pieces read after the first example.
        (("pos",), [5, 0, 0], "pos = [5, 0, 0], expected [shard, doc, piece] with shard < 3"),
        (("pos",), [3, 1, 0], "pos = [3, 1, 0], expected"),
        (("done",), True, "pos = [0, 9, 1], expected [3, 0, 0] (the end of this worker's 3"),
        (("done",), "yes", "done = yes, expected true or false"),
        (("pos",), [0, 9, 0], "pos = [0, 9, 0], expected a piece >= 1"),
        (("done",), ..., "done = nothing (the field is missing)"),
        # The RNG state, as numpy's PCG64 takes it (numpy took has_uint32 = 7; the
        # others failed on the first example, with errors that named no field).
        (("rng",), None, "rng = None, expected the RNG state of a stream that has started"),
        (("rng", "has_uint32"), 7, "rng.has_uint32 = 7, expected 0 or 1"),
        (("rng", "uinteger"), -5, "rng.uinteger = -5, expected a whole number below 2**32"),
        (("rng", "uinteger"), 2**32, "rng.uinteger = 4294967296, expected"),
        (("rng", "state", "state"), "1" * 5000, "rng.state.state = 11111111"),
        (("rng", "state", "state"), str(2**128), f"rng.state.state = {2**128}, expected"),
        (("rng", "state", "inc"), "-3", "rng.state.inc = -3, expected a whole number"),
        (("rng", "state", "inc"), "4", "rng.state.inc = 4, expected an odd number"),
        (("rng", "bit_generator"), "MT19937", "rng.bit_generator = MT19937, expected 'PCG64'"),
        (("rng", "state"), "0", "rng.state = 0, expected an object of 'state' and 'inc'"),
        (("rng", "extra"), 1, "rng = {'bit_generator'"),
    ],
)
def test_set_state_refuses_a_state_the_reader_never_writes(nlp, shard_dir, path, value, message):
    """An edited state that the reader could not have written is refused by set_state,
    before anything changes, with the field and its value named; before, these were
    accepted (and yielded examples twice, skipped or ended the epoch, or raised bare
    numpy errors on the first example)."""
    settings = dict(shuffle=True, shuffle_buffer=4, seed=1)
    stream = LeanCorpus(shard_dir, **settings)(nlp)
    for _ in range(6):
        next(stream)
    state = stream.state()
    assert state["pos"] == [0, 9, 1] and state["buffer"][0] == [0, 8, 0]
    edited = _edit(state, path, value)
    corpus = LeanCorpus(shard_dir, **settings)
    with pytest.raises(ValueError, match=re.escape(message) + ".*it was edited or damaged"):
        corpus.set_state(edited)
    assert corpus.epoch == 0 and corpus._resume is None
    with pytest.raises(ValueError, match=re.escape(message)):
        corpus.stream(nlp, state=edited)
    corpus.set_state(state)  # the state as written still resumes
    rest = [key(eg) for eg in corpus(nlp)]
    assert len(rest) == 70 - 6 and len(set(rest)) == len(rest)


def test_set_state_refuses_a_buffer_when_shuffle_is_off(nlp, shard_dir):
    stream = LeanCorpus(shard_dir)(nlp)
    next(stream)
    state = dict(stream.state(), buffer=[[0, 0, 0]])
    with pytest.raises(ValueError, match=re.escape("len(buffer) = 1, expected 0 (shuffle is off)")):
        LeanCorpus(shard_dir).set_state(state)


@pytest.mark.parametrize("compact", [False, True])
def test_resume_refuses_a_position_the_shard_does_not_have(nlp, tmp_path, compact):
    """A doc or piece index past the shard's (or a shard index past the compact chunks,
    which are built on the first call) is refused when the stream reaches it, naming
    the position; before, the pieces up to it were skipped without a word."""
    path = write_shard(tmp_path / "one.spacy", 12, seed=5)
    settings = dict(max_length=15, compact=compact, compact_chunk=100)
    full = [key(eg) for eg in LeanCorpus(path, **settings)(nlp)]
    stream = LeanCorpus(path, **settings)(nlp)
    for _ in range(5):
        next(stream)
    state = stream.state()
    p, d, k = state["pos"]
    doc = "compact chunk 0" if compact else f"'{path}'"
    edits = [
        ([p, d, k + 10**6], f"expected a piece of a doc this worker reads (doc {d} of {doc} has"),
        ([p, d + 10**6, 1], f"({doc} has no doc {d + 10**6} that this worker reads)"),
    ]
    if compact:  # doc d of a compact chunk is piece d, of one piece
        edits.append(([p, d, 2], f"(doc {d} of compact chunk 0 has 1 piece(s))"))
        edits.append(([5, 0, 1], "expected [shard, doc, piece] with shard < 1"))
    for pos, message in edits:
        corpus = LeanCorpus(path, **settings)
        corpus.set_state(dict(state, pos=pos))  # the pieces are known when they are read
        with pytest.raises(ValueError, match=re.escape(f"pos = {pos}, expected ")) as info:
            list(corpus(nlp))
        assert message in str(info.value)
    corpus = LeanCorpus(path, **settings)
    corpus.set_state(state)
    assert full[:5] + [key(eg) for eg in corpus(nlp)] == full


@pytest.mark.parametrize("share_by", ["doc", "shard"])
def test_resume_of_a_workers_share_refuses_another_workers_docs(nlp, shard_dir, share_by):
    """Every state a worker's stream writes (with limit, shuffled, docs split) resumes
    exactly; a position past the worker's shards (share_by = "shard": it ended the
    epoch), or a position or buffered piece edited to another worker's doc (doc i of
    shard s is worker (s + i) % workers'), is refused."""
    settings = dict(
        max_length=15,
        limit=50,
        shuffle=True,
        shuffle_buffer=3,
        seed=2,
        instance_rank=1,
        num_instances=2,
        share_by=share_by,
    )
    full = [key(eg) for eg in LeanCorpus(shard_dir, **settings)(nlp)]
    assert full
    states = []
    for stop in range(0, len(full) + 1, 7):
        stream = LeanCorpus(shard_dir, **settings)(nlp)
        head = [key(next(stream)) for _ in range(stop)]
        states.append(json.loads(json.dumps(stream.state())))
        corpus = LeanCorpus(shard_dir, **settings)
        corpus.set_state(states[-1])
        assert head + [key(eg) for eg in corpus(nlp)] == full, stop
    state = next(s for s in states if s["yielded"] and not s["done"])
    p, d, k = state["pos"]
    if share_by == "shard":  # worker 1 of 2 reads one of the 3 shards limit leaves
        message = f"pos = [1, {d}, {k}], expected [shard, doc, piece] with shard < 1"
        with pytest.raises(ValueError, match=re.escape(message)):
            LeanCorpus(shard_dir, **settings).set_state(dict(state, pos=[1, d, k]))
        return
    with pytest.raises(ValueError, match=re.escape(f"pos = {[p, d + 1, 1]}, expected a doc of")):
        LeanCorpus(shard_dir, **settings).set_state(dict(state, pos=[p, d + 1, 1]))
    i, (u, rd, rk) = next((i, r) for i, r in enumerate(state["buffer"]) if r[1] >= 1)
    other = list(state["buffer"])
    other[i] = [u, rd - 1, 0]
    message = f"buffer[{i}] = {[u, rd - 1, 0]}, expected a doc of worker 1 of 2"
    with pytest.raises(ValueError, match=re.escape(message)):
        LeanCorpus(shard_dir, **settings).set_state(dict(state, buffer=other))


@pytest.mark.parametrize("share_by", ["doc", "shard"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_rank_shares_disjoint_and_complete(nlp, shard_dir, share_by, n):
    everything = [key(eg) for eg in LeanCorpus(shard_dir, max_length=20)(nlp)]
    shares = [
        [
            key(eg)
            for eg in LeanCorpus(
                shard_dir,
                max_length=20,
                instance_rank=r,
                num_instances=n,
                share_by=share_by,
                shuffle=True,
                seed=4,
            )(nlp)
        ]
        for r in range(n)
    ]
    assert len(set(everything)) == len(everything)
    assert sorted(k for share in shares for k in share) == sorted(everything)
    for i in range(n):
        for j in range(i + 1, n):
            assert not set(shares[i]) & set(shares[j])
    if share_by == "doc" and n > 1:
        assert all(share for share in shares)


def test_rank_defaults_from_environment(nlp, shard_dir, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    corpus = LeanCorpus(shard_dir)
    assert corpus.rank_and_size == (1, 2)
    explicit = LeanCorpus(shard_dir, instance_rank=1, num_instances=2)
    assert [key(e) for e in corpus(nlp)] == [key(e) for e in explicit(nlp)]
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="instance_rank must be in"):
        LeanCorpus(shard_dir).rank_and_size


def test_split_among():
    items = list(range(11))
    shares = [split_among(items, r, 3) for r in range(3)]
    assert sorted(sum(shares, [])) == items
    assert [len(s) for s in shares] == [4, 4, 3]
    with pytest.raises(ValueError, match="instance_rank must be in"):
        split_among(items, 3, 3)


def test_compact_mode_same_examples_and_small(nlp, shard_dir):
    streamed = [key(eg) for eg in LeanCorpus(shard_dir, max_length=30)(nlp)]
    corpus = LeanCorpus(shard_dir, max_length=30, compact=True, compact_chunk=16)
    assert [key(eg) for eg in corpus(nlp)] == streamed
    assert [key(eg) for eg in corpus(nlp)] == streamed  # from memory, not files
    n_tokens = corpus.stats.tokens
    assert corpus.compact_nbytes() / n_tokens <= 25
    examples = list(corpus(nlp))
    assert examples[0].reference.ents and examples[0].reference.has_annotation("SENT_START")


def test_gold_preproc(nlp, tmp_path):
    doc = Doc(
        nlp.vocab,
        words=["A", "b", ".", "C", "d", "."],
        spaces=[True, False, True, True, False, False],
        sent_starts=[1, 0, 0, 1, 0, 0],
    )
    doc.ents = [Span(doc, 1, 4, label="X")]  # crosses the sentence boundary
    doc2 = Doc(nlp.vocab, words=["E", "f", ".", "G", "."], sent_starts=[1, 0, 0, 1, 0])
    DocBin(docs=[doc, doc2]).to_disk(tmp_path / "g.spacy")
    examples = list(LeanCorpus(tmp_path / "g.spacy", gold_preproc=True)(nlp))
    assert [eg.reference.text for eg in examples] == [doc.text, "E f . ", "G . "]
    for eg in examples:
        assert [t.text for t in eg.predicted] == [t.text for t in eg.reference]
    assert examples[0].reference.ents[0].text == "b. C"
    # spaCy's gold_preproc loses the cross-sentence entity
    theirs = list(Corpus(tmp_path / "g.spacy", gold_preproc=True)(nlp))
    assert sum(len(eg.reference.ents) for eg in theirs) == 0


def test_augmenter_applied(nlp, shard_dir):
    aug = create_lower_casing_augmenter(level=1.0)
    examples = list(LeanCorpus(shard_dir, limit=5, augmenter=aug)(nlp))
    assert len(examples) == 5
    assert all(eg.reference.text == eg.reference.text.lower() for eg in examples)


def test_jsonl_source(nlp, tmp_path):
    records = [
        {
            "text": "Ada Lindqvist met Quillon Labs .",
            "entities": [[0, 13, "PERSON"], [18, 30, "ORG"]],
            "cats": {"NEWS": 1.0},
        },
        {
            "text": "Nobody came .",
            "spans": [{"start": 0, "end": 6, "label": "X"}],
            "meta": {"id": 7},
        },
        {"text": "in Veldmark", "spans": {"loc": [[3, 11, "LOC"]]}},
    ]
    path = tmp_path / "c.jsonl"
    srsly.write_jsonl(path, records)
    with path.open("a") as f:
        f.write("\n")  # blank lines are skipped
    examples = list(LeanCorpus(path)(nlp))
    assert len(examples) == 3
    assert [e.label_ for e in examples[0].reference.ents] == ["PERSON", "ORG"]
    assert examples[0].reference.cats == {"NEWS": 1.0}
    assert [s.text for s in examples[1].reference.spans["sc"]] == ["Nobody"]
    assert examples[1].reference.user_data["meta"] == {"id": 7}
    assert [s.label_ for s in examples[2].reference.spans["loc"]] == ["LOC"]
    as_ents = list(LeanCorpus(path, jsonl_spans_key="ents")(nlp))
    assert [e.text for e in as_ents[1].reference.ents] == ["Nobody"]


def test_jsonl_with_a_byte_order_mark(nlp, tmp_path):
    """A .jsonl file saved by Windows tools starts with a UTF-8 byte order mark (and
    has CRLF line ends): its first line was refused as "not valid JSON", though it
    looks valid in any editor."""
    path = tmp_path / "bom.jsonl"
    lines = ['{"text": "Ada met Bo", "entities": [[0, 3, "PER"]]}', '{"text": "in Oslo"}']
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode("utf8") + b"\r\n")
    examples = list(LeanCorpus(path, limit=2)(nlp))
    assert [eg.reference.text for eg in examples] == ["Ada met Bo", "in Oslo"]
    assert [e.text for e in examples[0].reference.ents] == ["Ada"]


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_jsonl_count_is_what_is_read(nlp, tmp_path, end):
    """`limit` and the parts of `spacy lean evaluate --workers` count a .jsonl file's
    records; the count read the bytes (skipping ASCII-blank lines, splitting at "\\n"
    only) while the reader reads text (skipping Unicode-blank lines, splitting at "\\r"
    too): a line holding a no-break space, or old Mac line ends, made them disagree,
    and a part could miss the file's last docs."""
    from spacy_lean.corpus.sources import count_shard_docs, iter_shard_docs

    path = tmp_path / "c.jsonl"
    lines = ["\ufeff", '{"text": "a b"}', "\u00a0", '{"text": "c"}', "  ", '{"text": "d e f"}']
    path.write_bytes(end.join(lines).encode("utf8") + end.encode("utf8"))
    docs = list(iter_shard_docs(path, nlp.vocab, nlp=nlp))
    assert [d.text for d in docs] == ["a b", "c", "d e f"]
    assert count_shard_docs(path) == 3
    parts = [iter_shard_docs(path, nlp.vocab, nlp=nlp, part=(k, 2)) for k in range(2)]
    assert [d.text for part in parts for d in part] == ["a b", "c", "d e f"]


def test_prodigy_rejects_and_ignores_are_not_read_as_gold(nlp, tmp_path):
    """Prodigy's output holds every answer: a "reject" from binary ner.teach is a wrong
    span, an "ignore" a skipped example. They were read as gold entities; now they are
    left out, with a warning that counts them, and the parts of the file (as
    `spacy lean evaluate --workers` cuts it) still hold every accepted record once."""
    from spacy_lean.corpus.sources import count_shard_docs, iter_shard_docs

    def record(text, label, answer):
        return {
            "text": text,
            "spans": [{"start": 0, "end": 3, "label": label}],
            "answer": answer,
            "_input_hash": len(text),
        }

    records = [
        record("Ada met Bo", "PER", "accept"),
        record("Oslo is far", "PER", "reject"),
        record("Kim ran home", "PER", "accept"),
        record("The end now", "ORG", "ignore"),
        record("Lea sang loud", "PER", "reject"),
        record("Max won it", "PER", "accept"),
        {"text": "no answer key"},
    ]
    path = tmp_path / "prodigy.jsonl"
    srsly.write_jsonl(path, records)
    accepted = ["Ada met Bo", "Kim ran home", "Max won it", "no answer key"]
    with pytest.warns(SkippedRecordsWarning, match='left out 1 "ignore" and 2 "reject" record'):
        examples = list(LeanCorpus(path, jsonl_spans_key="ents")(nlp))
    assert [eg.reference.text for eg in examples] == accepted
    assert [ent.label_ for eg in examples for ent in eg.reference.ents] == ["PER"] * 3
    assert count_shard_docs(path) == len(records)  # stored records, as the parts count them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedRecordsWarning)
        for n in (2, 3, 7):
            parts = [list(iter_shard_docs(path, nlp.vocab, nlp=nlp, part=(k, n))) for k in range(n)]
            assert [d.text for part in parts for d in part] == accepted


def test_jsonl_empty_entity_list_is_annotation_not_missing(nlp, tmp_path):
    """`"entities": []` says a text has no entities: every token is "O" (as spaCy's
    Example.from_dict reads it), so a prediction there is a false positive and training
    learns "O". It was read as *missing* annotation: a .jsonl dev set scored higher
    precision than the same docs as .spacy. No key (or null) stays missing; an empty
    "spans" list is an empty span group (or, with jsonl_spans_key = "ents", no entities)."""
    from spacy_lean.corpus.sources import iter_shard_docs

    records = [
        {"text": "Nothing to see here .", "entities": []},
        {"text": "Nothing annotated here ."},
        {"text": "Nothing annotated here either .", "entities": None},
        {"text": "No spans here .", "spans": []},
        {"text": "Ada is here .", "entities": [[0, 3, "PER"]]},
    ]
    path = tmp_path / "e.jsonl"
    srsly.write_jsonl(path, records)
    docs = list(iter_shard_docs(path, nlp.vocab, nlp=nlp))
    assert [d.has_annotation("ENT_IOB") for d in docs] == [True, False, False, False, True]
    assert {t.ent_iob_ for t in docs[0]} == {"O"}
    assert {t.ent_iob_ for t in docs[1]} == {""}
    assert "sc" in docs[3].spans and len(docs[3].spans["sc"]) == 0
    assert [t.ent_iob_ for t in docs[4]] == ["B", "O", "O", "O"]
    as_ents = list(iter_shard_docs(path, nlp.vocab, {"spans_key": "ents"}, nlp=nlp))
    assert {t.ent_iob_ for t in as_ents[3]} == {"O"}  # Prodigy's accepted "no entities"
    # Through the reader, cut by max_length: every piece keeps the "O" annotation.
    pieces = [eg.reference for eg in LeanCorpus(path, max_length=2)(nlp)]
    assert {t.ent_iob_ for p in pieces if p.text.startswith("Nothing to") for t in p} == {"O"}
    # doc_to_record writes the difference back: no key for a doc without entity annotation.
    assert "entities" not in doc_to_record(docs[1])
    assert doc_to_record(docs[0])["entities"] == []
    again = tmp_path / "again.jsonl"
    srsly.write_jsonl(again, [doc_to_record(d) for d in docs])
    redone = list(iter_shard_docs(again, nlp.vocab, nlp=nlp))
    assert [[t.ent_iob_ for t in d] for d in redone] == [[t.ent_iob_ for t in d] for d in docs]


def test_jsonl_missing_marks_single_tokens_without_annotation(nlp, tmp_path):
    """ "missing" gives tokens spaCy's "-" (missing) entity tag in a record that has
    entity annotation, as a .spacy file can: not "O", so neither trained nor scored as
    outside. Before, .jsonl could only make a whole record missing, and `doc_to_record`
    wrote such tokens back as "O"; a .spacy file with them now round-trips through
    .jsonl, also through the reader's max_length pieces."""
    from spacy_lean.corpus.sources import iter_shard_docs

    text = "Ada met Bo in Paris yesterday ."
    records = [
        {"text": text, "entities": [[0, 3, "PER"]], "missing": [[8, 10], [14, 29]]},
        {"text": text, "entities": [], "missing": [{"start": 0, "end": 3}]},
    ]
    path = tmp_path / "m.jsonl"
    srsly.write_jsonl(path, records)
    prodigy = tmp_path / "prodigy.jsonl"  # entities as "spans" (jsonl_spans_key = "ents")
    srsly.write_jsonl(prodigy, [{"text": text, "spans": [[14, 19, "LOC"]], "missing": [[0, 3]]}])
    docs = list(iter_shard_docs(path, nlp.vocab, nlp=nlp))
    assert [t.ent_iob_ for t in docs[0]] == ["B", "O", "", "O", "", "", "O"]
    assert [t.ent_iob_ for t in docs[1]] == ["", "O", "O", "O", "O", "O", "O"]
    # In training and scoring the tokens are missing (None), not outside ("O").
    ner = Example(nlp.make_doc(text), docs[0]).get_aligned_ner()
    assert ner == ["U-PER", "O", None, "O", None, None, "O"]
    as_ents = list(iter_shard_docs(prodigy, nlp.vocab, {"spans_key": "ents"}, nlp=nlp))
    assert [t.ent_iob_ for t in as_ents[0]] == ["", "O", "O", "O", "B", "O", "O"]
    # Written back: one [start, end] pair per run of missing tokens, read back the same,
    # from .spacy through .jsonl too.
    assert doc_to_record(docs[0])["missing"] == [[8, 10], [14, 29]]
    assert "missing" not in doc_to_record(synthetic.make_ner_docs(nlp, 1, seed=3)[0])
    DocBin(docs=docs).to_disk(tmp_path / "m.spacy")
    from_spacy = list(iter_shard_docs(tmp_path / "m.spacy", nlp.vocab, nlp=nlp))
    srsly.write_jsonl(tmp_path / "again.jsonl", [doc_to_record(d) for d in from_spacy])
    for source in (tmp_path / "again.jsonl", tmp_path / "m.spacy"):
        pieces = [eg.reference for eg in LeanCorpus(source, max_length=3)(nlp)]
        iobs = [t.ent_iob_ for p in pieces[:3] for t in p]
        assert iobs == [t.ent_iob_ for t in docs[0]], source


def test_jsonl_roundtrip_of_generated_docs(nlp, tmp_path):
    docs = synthetic.make_ner_docs(nlp, 20, seed=3)
    srsly.write_jsonl(tmp_path / "g.jsonl", [doc_to_record(d) for d in docs])
    got = [eg.reference for eg in LeanCorpus(tmp_path / "g.jsonl", max_length=25)(nlp)]
    assert sum(len(d.ents) for d in got) == sum(len(d.ents) for d in docs)
    assert "".join(d.text for d in got) == "".join(d.text for d in docs)


def test_registered_and_resolves_from_config(shard_dir):
    cfg = {"corpus": {"@readers": "spacy-lean.Corpus.v1", "path": str(shard_dir), "max_length": 10}}
    resolved = registry.resolve(cfg)["corpus"]
    assert isinstance(resolved, LeanCorpus) and resolved.max_length == 10


# ----- bad input -----


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.spacy"):
        LeanCorpus(tmp_path / "nope.spacy")
    with pytest.raises(ValueError, match="needs a path"):
        registry.resolve({"c": {"@readers": "spacy-lean.Corpus.v1", "path": None}})


def test_corrupt_shard_names_file(nlp, tmp_path):
    synthetic.write_ner_corpus(tmp_path / "a.spacy", 3, seed=1)
    (tmp_path / "b.spacy").write_bytes(b"this is not a docbin")
    corpus = LeanCorpus(tmp_path)
    with pytest.raises(CorruptShardError, match=r"b\.spacy.*corrupt, truncated or not a DocBin"):
        list(corpus(nlp))


def test_negative_max_length_names_value(tmp_path):
    synthetic.write_ner_corpus(tmp_path / "a.spacy", 3, seed=1)
    with pytest.raises(ValueError, match="max_length must be >= 0, got -5"):
        LeanCorpus(tmp_path, max_length=-5)


def test_unknown_format(tmp_path):
    (tmp_path / "data.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"Unknown corpus format for '.*data\.txt'.*spacy convert"):
        LeanCorpus(tmp_path / "data.txt")
    with pytest.raises(ValueError, match="No corpus files found"):
        LeanCorpus(tmp_path)
    with pytest.raises(ValueError, match="file_format must be"):
        LeanCorpus(tmp_path, file_format="conllu")


def test_mixed_formats_need_file_format(nlp, tmp_path):
    synthetic.write_ner_corpus(tmp_path / "a.spacy", 3, seed=1)
    srsly.write_jsonl(tmp_path / "b.jsonl", [{"text": "hi there"}])
    with pytest.raises(ValueError, match="both .spacy and .jsonl"):
        LeanCorpus(tmp_path)
    assert len(list(LeanCorpus(tmp_path, file_format="jsonl")(nlp))) == 1
    assert len(list(LeanCorpus(tmp_path, file_format="spacy")(nlp))) == 3


def test_bad_jsonl_names_line(nlp, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "Ada met", "entities": [[1, 5, "X"]]}\n')
    with pytest.raises(
        ValueError, match=r"bad\.jsonl:2: entities span \[1, 5, 'X'\].*token boundaries"
    ):
        list(LeanCorpus(path)(nlp))
    path.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        list(LeanCorpus(path)(nlp))
    path.write_text('{"txt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: .*string \"text\" key"):
        list(LeanCorpus(path)(nlp))


@pytest.mark.parametrize(
    "record,message",
    [
        ({"text": "y z", "tokens": [{"ws": True}]}, r'"tokens" must be a list of'),
        ({"text": "y z", "tokens": "y z"}, r'"tokens" must be a list of'),
        ({"text": "y", "cats": {"A": "high"}}, r'"cats" must map each label to a finite number'),
        ({"text": "y", "cats": {"A": "nan"}}, r"finite number .*got 'nan' for 'A'"),
        ({"text": "y", "cats": {"A": 1, "B": "1e999"}}, r"finite number .*got '1e999' for 'B'"),
        ({"text": "y", "cats": []}, r'"cats" must be an object of label -> score, got'),
        ({"text": "y", "cats": ""}, r'"cats" must be an object of label -> score, got'),
        ({"text": "y", "entities": [["a", 1, "X"]]}, r"whole-number character offsets"),
        ({"text": "y z", "entities": [[0, 1.5, "X"]]}, r"whole-number character offsets"),
        ({"text": "y", "entities": [{"start": 0, "label": "X"}]}, r"must be \[start, end, label\]"),
        ({"text": "y z", "missing": [[0, 1]]}, r'the record has no "entities"'),
        ({"text": "y z", "entities": [[0, 1, "X"]], "missing": [[0, 3]]}, r"overlaps the entity"),
        ({"text": "y z", "entities": [], "missing": [[0, 2]]}, r"does not fall on token bound"),
        ({"text": "y z", "entities": [], "missing": [[0, "a"]]}, r"must be \[start, end\]"),
        ({"text": "y z", "entities": [], "missing": {"0": 1}}, r'"missing" must be a list'),
        ({"text": "y z", "entities": [[0, 1, ""]]}, r"has the label '': each span needs a label"),
        ({"text": "y z", "entities": [[0, 1, None]]}, r"has the label None"),
        ({"text": "y z", "spans": [[0, 1, " "]]}, r"spans span \[0, 1\] has the label ' '"),
        ({"text": "y z", "entities": [["0", "\u00b2", "X"]]}, r"whole-number character offsets"),
        ({"text": "y z", "entities": [], "missing": [[0, 1], [0, 1]]}, r"missing spans .* overlap"),
        ({"text": "y z", "tokens": []}, r'"tokens" is an empty list'),
    ],
    ids=[
        "token-without-text",
        "tokens-not-a-list",
        "cat-not-a-number",
        "cat-nan-string",
        "cat-inf-string",
        "cats-empty-list",
        "cats-empty-string",
        "offset-not-a-number",
        "offset-not-whole",
        "offset-missing",
        "missing-without-entities",
        "missing-overlaps-entity",
        "missing-not-on-tokens",
        "missing-not-a-number",
        "missing-not-a-list",
        "label-empty",
        "label-null",
        "label-blank-span",
        "offset-superscript",
        "missing-twice",
        "tokens-empty",
    ],
)
def test_malformed_jsonl_record_names_the_line(nlp, tmp_path, record, message):
    """Records of the wrong shape came out as a bare KeyError traceback ("tokens"
    without "text") or a message without the file and line ("could not convert string
    to float", "invalid literal for int()"). Each now names file:line and the fix, as
    a CorruptShardError (a ValueError) that `spacy lean evaluate` prints; offsets given
    as 3.0 or "3" are still read."""
    path = tmp_path / "bad.jsonl"
    srsly.write_jsonl(path, [{"text": "fine"}, record])
    with pytest.raises(CorruptShardError, match=r"bad\.jsonl:2: .*" + message):
        list(LeanCorpus(path)(nlp))
    srsly.write_jsonl(path, [{"text": "Ada met Bo", "entities": [[0.0, "3", "PER"]]}])
    assert [e.text for e in next(iter(LeanCorpus(path)(nlp))).reference.ents] == ["Ada"]


def test_jsonl_that_is_not_utf8_names_the_file_and_line(nlp, tmp_path):
    """A Latin-1 file gave "'utf-8' codec can't decode byte 0xe9 in position 28", with
    no file, and a position in a 64 KiB read block. Now the first bad line is named,
    found again in binary even when it is far past the lines read so far."""
    path = tmp_path / "latin.jsonl"
    lines = [srsly.json_dumps({"text": f"line {i}"}).encode() for i in range(3000)]
    lines[2500] = '{"text": "caf\u00e9"}'.encode("latin-1")
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(
        CorruptShardError, match=r"latin\.jsonl:2501: not valid UTF-8 \(byte\(s\) b'\\xe9'\)"
    ):
        list(LeanCorpus(path)(nlp))


def test_limit_counts_docs_not_rejected_records(nlp, tmp_path):
    """`limit` planned each .jsonl file's share with its record count, rejected
    records included, then counted the docs it read: limit 1 gave two docs, limit 3
    the same two. Rejected records are no docs and count toward nothing."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    first = [{"text": "r0", "answer": "reject"}, {"text": "r1", "answer": "ignore"}]
    first += [{"text": "a0"}, {"text": "a1", "answer": "accept"}]
    srsly.write_jsonl(folder / "1.jsonl", first)
    srsly.write_jsonl(folder / "2.jsonl", [{"text": f"b{i}"} for i in range(5)])
    expected = ["a0", "a1", "b0", "b1", "b2", "b3", "b4"]
    for limit in range(1, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedRecordsWarning)
            texts = [eg.reference.text for eg in LeanCorpus(folder, limit=limit)(nlp)]
        assert texts == expected[:limit], limit


def test_oversize_entity_warns_and_is_counted(nlp, tmp_path):
    doc = Doc(nlp.vocab, words=list("abcdefghij"))
    doc.ents = [Span(doc, 1, 8, label="LONG")]
    DocBin(docs=[doc]).to_disk(tmp_path / "o.spacy")
    corpus = LeanCorpus(tmp_path / "o.spacy", max_length=3)
    with pytest.warns(UserWarning, match="kept whole, not dropped"):
        examples = list(corpus(nlp))
    assert [len(eg.reference) for eg in examples] == [1, 7, 2]
    assert corpus.stats.oversize_pieces == 1


@pytest.mark.parametrize("compact", [False, True])
def test_oversize_warning_names_the_file_the_doc_and_the_length(nlp, tmp_path, compact):
    """In a folder of shards, the warning named only the folder: it now names the
    file, the doc (its index in the file) and the piece's length."""
    docs = [Doc(nlp.vocab, words=list("abcdef")) for _ in range(3)]
    docs[2].ents = [Span(docs[2], 0, 5, label="LONG")]
    DocBin(docs=[Doc(nlp.vocab, words=["x"])]).to_disk(tmp_path / "a.spacy")
    DocBin(docs=docs).to_disk(tmp_path / "b.spacy")
    corpus = LeanCorpus(tmp_path, max_length=3, compact=compact)
    where = re.escape(f"doc 2 of '{tmp_path / 'b.spacy'}' has a piece of 5 tokens")
    with pytest.warns(UserWarning, match=where + ".*max_length=3.*kept whole, not dropped"):
        list(corpus(nlp))


@pytest.mark.filterwarnings("ignore:spacy-lean.Corpus.v1")
def test_random_docs_through_reader_lose_nothing(nlp, tmp_path):
    docs = synthetic.make_ner_docs(nlp, 40, seed=21, long_doc_rate=0.2)
    DocBin(docs=docs[:25]).to_disk(tmp_path / "1.spacy")
    DocBin(docs=docs[25:]).to_disk(tmp_path / "2.spacy")
    for max_length in (3, 8, 40, 200):
        corpus = LeanCorpus(tmp_path, max_length=max_length)
        got = [eg.reference for eg in corpus(nlp)]
        assert "".join(d.text for d in got) == "".join(d.text for d in docs)
        assert sum(len(d.ents) for d in got) == sum(len(d.ents) for d in docs)
        assert corpus.stats.pieces == len(got) and corpus.stats.docs == 40


def test_rank_defaults_from_torch_distributed(shard_dir, monkeypatch):
    """An initialised process group wins over the environment variables."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert LeanCorpus(shard_dir).rank_and_size == (0, 1)
    finally:
        dist.destroy_process_group()
    assert LeanCorpus(shard_dir).rank_and_size == (1, 2)


def test_max_length_in_wordpieces(nlp, shard_dir, tiny_transformer):
    from spacy_lean.corpus import WordpieceCounter

    counter = WordpieceCounter(tiny_transformer)
    corpus = LeanCorpus(shard_dir, max_length=40, wordpiece_tokenizer=str(tiny_transformer))
    examples = list(corpus(nlp))
    lengths = [counter(eg.reference) for eg in examples]
    assert max(lengths) <= 40 or corpus.stats.oversize_pieces
    by_tokens = list(LeanCorpus(shard_dir, max_length=40)(nlp))
    assert len(examples) > len(by_tokens)  # wordpieces outnumber tokens
    assert "".join(eg.reference.text for eg in examples) == "".join(
        eg.reference.text for eg in by_tokens
    )


@pytest.mark.parametrize("compact", [False, True])
def test_user_data_and_extensions_survive_reading(nlp, tmp_path, compact):
    from spacy.tokens import Token

    if not Token.has_extension("lean_reader_tok"):
        Token.set_extension("lean_reader_tok", default=None)
    docs = synthetic.make_ner_docs(nlp, 12, seed=8)
    want = []
    for i, doc in enumerate(docs):
        if i % 3 == 0:  # some docs carry data, most none (the fast path)
            doc.user_data["source"] = f"doc-{i}"
            for token in list(doc)[::5]:
                token._.lean_reader_tok = f"{i}:{token.i}"
        want.extend(t._.lean_reader_tok for t in doc)
    DocBin(docs=docs, store_user_data=True).to_disk(tmp_path / "u.spacy")
    corpus = LeanCorpus(tmp_path / "u.spacy", max_length=9, compact=compact, compact_chunk=5)
    refs = [eg.reference for eg in corpus(nlp)]
    assert len(refs) > len(docs)
    assert [t._.lean_reader_tok for d in refs for t in d] == want
    sources = [d.user_data.get("source") for d in refs]
    assert set(sources) == {None} | {f"doc-{i}" for i in range(0, 12, 3)}


@pytest.mark.parametrize(
    "group,name,func",
    [
        ("spacy_readers", "spacy-lean.Corpus.v1", "create_lean_corpus_v1"),
        ("spacy_batchers", "spacy-lean.batch_by_tokens.v1", "configure_batch_by_tokens_v1"),
    ],
)
def test_entry_points_declared(group, name, func):
    """A config name resolves without importing spacy_lean only through an entry point."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=group) if ep.name == name]
    assert len(found) == 1 and found[0].load().__name__ == func


def test_share_by_shard_warns_a_worker_left_without_shards(nlp, shard_dir):
    """One big .spacy file (or fewer shards than workers) with share_by = "shard": a
    worker got no data at all and `spacy lean train --nproc 2` silently trained on one
    rank's data, at one rank's speed. The worker left out now warns, naming the fix."""
    single = shard_dir / "b.spacy"
    left_out = LeanCorpus(single, share_by="shard", instance_rank=1, num_instances=2)
    with pytest.warns(UserWarning, match=r"1 shard\(s\) for 2 workers.*share_by = 'doc'"):
        assert list(left_out(nlp)) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(LeanCorpus(single, share_by="shard", instance_rank=0, num_instances=2)(nlp))
        assert list(LeanCorpus(single, share_by="doc", instance_rank=1, num_instances=2)(nlp))


def test_compact_chunks_follow_the_workers_share(nlp, shard_dir, monkeypatch):
    """`spacy lean train --nproc 2` initializes the pipeline with RANK/WORLD_SIZE hidden,
    and spaCy's initialize reads the train corpus: the compact chunks were built then,
    with the whole corpus, and every rank then trained on all of it (each doc N times
    per epoch). The chunks are rebuilt when the worker's share changes."""
    corpus = LeanCorpus(shard_dir, compact=True, max_length=20)
    everything = [key(eg) for eg in corpus(nlp)]  # the initialize call: one worker
    shares = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        expected = [key(eg) for eg in LeanCorpus(shard_dir, max_length=20)(nlp)]
        shares.append([key(eg) for eg in corpus(nlp)])
        assert shares[-1] == expected
    assert sorted(shares[0] + shares[1]) == sorted(everything)


@pytest.mark.parametrize("compact", [False, True])
def test_share_by_doc_names_a_share_of_only_empty_docs(nlp, tmp_path, compact):
    """A 3-doc corpus whose middle doc is empty, on 2 workers: worker 1's share is that
    doc, which is skipped. The warning told the user to "give the corpus at least 2
    docs" (it has 3); it now says that the worker's share is only empty docs and to
    remove them. Worker 0 trains on both other docs and does not warn."""
    docs = synthetic.make_ner_docs(nlp, 2, seed=24)
    path = tmp_path / "three.spacy"
    DocBin(docs=[docs[0], Doc(nlp.vocab, words=[]), docs[1]]).to_disk(path)
    corpus = LeanCorpus(path, instance_rank=1, num_instances=2, compact=compact)
    with pytest.warns(UserWarning) as record:
        assert list(corpus(nlp)) == []
    assert len(record) == 1
    text = str(record[0].message)
    assert "3 doc(s) for 2 workers: worker 1 gets no data" in text
    assert "only empty docs (0 tokens)" in text and "remove the empty docs" in text
    assert "at least 2 docs" not in text and "--nproc" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = LeanCorpus(path, instance_rank=0, num_instances=2, compact=compact)
        assert [eg.reference.text for eg in first(nlp)] == [docs[0].text, docs[1].text]


@pytest.mark.parametrize("compact", [False, True])
def test_share_by_doc_warns_a_worker_left_without_docs(nlp, tmp_path, compact):
    """share_by = "doc" with fewer docs than workers: doc i of shard s goes to worker
    (s + i) % n, so with one 1-doc file worker 1 of 2 got nothing, silently (a doc goes
    whole, with every piece max_length cuts it into). It now warns once, as share_by =
    "shard" does, naming the corpus, the counts and the fix; worker 0 and workers that
    get a doc do not warn, nor does an empty corpus."""
    one = write_shard(tmp_path / "one.spacy", 1, seed=21)
    left_out = LeanCorpus(one, share_by="doc", instance_rank=1, num_instances=2, compact=compact)
    with pytest.warns(UserWarning) as record:
        assert list(left_out(nlp)) == []
        assert list(left_out(nlp)) == []  # once
    assert len(record) == 1
    text = str(record[0].message)
    assert f"({one})" in text and "1 doc(s) for 2 workers: worker 1 gets no data" in text
    assert "at least 2 docs" in text and "--nproc" in text
    # A folder: the files holding the docs are named; two 1-doc files feed 2 workers
    # ((s + i) % n), not 3.
    folder = tmp_path / "folder"
    write_shard(folder / "a.spacy", 1, seed=22)
    write_shard(folder / "b.spacy", 1, seed=23)
    with pytest.warns(UserWarning, match=r"2 doc\(s\) in '.*a.spacy', '.*b.spacy' for 3"):
        list(LeanCorpus(folder, instance_rank=2, num_instances=3, compact=compact)(nlp))
    with pytest.warns(UserWarning, match=r"1 doc\(s\) \(limit = 1\) in '[^']*a.spacy' for 2"):
        list(LeanCorpus(folder, limit=1, instance_rank=1, num_instances=2)(nlp))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(LeanCorpus(one, instance_rank=0, num_instances=2, compact=compact)(nlp))
        for rank in (0, 1):
            assert list(LeanCorpus(folder, instance_rank=rank, num_instances=2)(nlp))
        empty = tmp_path / "empty.spacy"
        DocBin().to_disk(empty)
        assert list(LeanCorpus(empty, instance_rank=1, num_instances=2)(nlp)) == []


@pytest.mark.parametrize("max_length", [1, 8, 128])
def test_max_length_loses_nothing_on_messy_docs(nlp, tmp_path, max_length):
    """The audit's messy docs (tests/messy_data.py) cut at several max_length: the
    pieces of each doc, in order, give back its tokens, its entity annotation (missing
    "-" and unset included), every span (offsets shifted back) and its cats; the empty
    doc is skipped and counted; the 15-token span stays whole in one oversize piece."""
    from messy_data import make_messy_docs, signature

    docs = make_messy_docs(nlp)
    path = tmp_path / "messy.spacy"
    DocBin(docs=docs, store_user_data=True).to_disk(path)
    corpus = LeanCorpus(path, max_length=max_length)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pieces = iter([eg.reference for eg in corpus(nlp)])
    assert corpus.stats.empty_docs == 1
    assert any("longer than max_length" in str(w.message) for w in caught) == (max_length < 15)
    for doc in docs:
        if not len(doc):
            continue
        got, n = [], 0
        while n < len(doc):
            got.append(next(pieces))
            n += len(got[-1])
        want = signature(doc)
        assert sum((signature(p)["words"] for p in got), []) == want["words"]
        assert sum((signature(p)["iob"] for p in got), []) == want["iob"]
        spans, offset = {}, 0
        for p in got:
            assert set(p.spans) == set(doc.spans) and p.cats == doc.cats
            for key, group in p.spans.items():
                spans.setdefault(key, []).extend(
                    (s.start + offset, s.end + offset, s.label_) for s in group
                )
            offset += len(p)
        assert {k: sorted(v) for k, v in spans.items()} == {
            k: sorted(v) for k, v in want["spans"].items()
        }
        for p in got:  # longer only to keep an entity or a span whole
            longest = max(
                [len(s) for g in p.spans.values() for s in g] + [len(e) for e in p.ents], default=0
            )
            assert len(p) <= max(max_length, longest)
    assert next(pieces, None) is None


@pytest.mark.parametrize("field", ["text", "label"])
def test_a_lone_surrogate_is_named_with_its_line(tmp_path, field):
    """A lone UTF-16 surrogate escape is valid JSON but no text spaCy can hash: the
    error names the file and line and says what to fix (before: only Python's
    "'utf-8' codec can't encode character '\\ud83d'", with no place)."""
    bad = {"text": "Bad \ud83d text"}
    if field == "label":
        bad = {"text": "Bad text", "entities": [[0, 3, "P\ud83d"]]}
    path = tmp_path / "s.jsonl"
    path.write_text(
        json.dumps({"text": "Ada met Bo", "entities": [[0, 3, "PER"]]})
        + "\n"
        + json.dumps(bad)
        + "\n",
        encoding="utf8",
    )
    with pytest.raises(
        CorruptShardError, match=r"s\.jsonl:2: .*\\ud83d, half of a UTF-16 surrogate"
    ):
        list(LeanCorpus(path)(spacy.blank("en")))
