"""DocBinReader: .spacy files read in bounded memory give exactly DocBin's docs."""

import random
import zlib
from pathlib import Path

import numpy
import pytest
import spacy
import srsly
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spacy.tokens import Doc, DocBin, Span, Token
from spacy.vocab import Vocab

import spacy_lean.corpus.docbin as docbin_module
from spacy_lean import synthetic
from spacy_lean.corpus import CorruptShardError, read_examples
from spacy_lean.corpus.docbin import DocBinReader
from spacy_lean.corpus.sources import count_shard_docs, iter_shard_docs

WORDS = "The cat sat on Mr. Smith 's mat in New York City , then left for Paris !".split()
LABELS = ["PERSON", "GPE", "ORG"]


def _install_extensions():
    if not Doc.has_extension("source"):
        Doc.set_extension("source", default=None)
    if not Token.has_extension("weight"):
        Token.set_extension("weight", default=0.0)
    if not Span.has_extension("note"):
        Span.set_extension("note", default=None)


def rich_doc(vocab: Vocab, rng: random.Random, n_tokens: int) -> Doc:
    """A doc with every DocBin attribute set (some left missing on purpose)."""
    words = [rng.choice(WORDS) for _ in range(n_tokens)]
    unknown_spaces = rng.random() < 0.2
    spaces = None if unknown_spaces else [rng.random() < 0.8 for _ in words]
    heads, deps, sent_starts = [], [], []
    start = 0
    for i in range(n_tokens):
        if i == start:  # a sentence of 1-6 tokens: its first token is the root
            end = min(n_tokens, i + rng.randint(1, 6))
            root = i
            sent_starts.append(True)
        else:
            sent_starts.append(False)
        heads.append(root if i != root else i)
        deps.append("ROOT" if i == root else rng.choice(["nsubj", "dobj", "amod", "punct"]))
        if i + 1 == end:
            start = end
    # Entities: some tokens missing (no annotation), some outside ("O"), some in ents.
    ents = []
    i = 0
    while i < n_tokens:
        choice = rng.random()
        if choice < 0.2:
            length = min(rng.randint(1, 3), n_tokens - i)
            ents.append(f"B-{rng.choice(LABELS)}")
            ents.extend(f"I-{ents[-1][2:]}" for _ in range(length - 1))
            i += length
        else:
            ents.append("O" if choice < 0.7 else None)  # None: missing annotation
            i += 1
    doc = Doc(
        vocab,
        words=words,
        spaces=spaces,
        tags=[rng.choice(["NN", "VB", "DT", "IN"]) for _ in words],
        pos=[rng.choice(["NOUN", "VERB", "DET", "ADP"]) for _ in words],
        morphs=[rng.choice(["", "Number=Sing", "Number=Plur|Person=3"]) for _ in words],
        lemmas=[w.lower() for w in words],
        heads=heads,
        deps=deps,
        sent_starts=sent_starts,
        ents=ents,
    )
    for token in doc:
        token.norm_ = token.lower_ + "_n"
        if rng.random() < 0.1:
            token._.weight = rng.random()
    for ent in doc.ents:
        if rng.random() < 0.5:
            ent.kb_id_ = f"Q{rng.randint(1, 99)}"
            ent.id_ = f"id{rng.randint(1, 9)}"
    if n_tokens >= 2 and rng.random() < 0.7:
        group = [Span(doc, 0, 1, label="FIRST"), Span(doc, 0, 2, label="PAIR", kb_id="KB1")]
        doc.spans["sc"] = group
        doc.spans["empty"] = []
        doc.spans["sc"][0]._.note = "first"
    doc.cats = {"POS": rng.random(), "NEG": rng.random()} if rng.random() < 0.7 else {}
    if rng.random() < 0.5:
        doc._.source = {"page": rng.randint(1, 9), "tags": ["a", "b"]}
        doc.user_data["array"] = numpy.arange(rng.randint(1, 4), dtype="int64")
    return doc


def docs_equal(ours: Doc, theirs: Doc) -> None:
    assert ours.to_bytes() == theirs.to_bytes()
    assert ours.has_unknown_spaces == theirs.has_unknown_spaces
    assert ours.cats == theirs.cats
    assert [
        (k, [(s.start, s.end, s.label_, s.kb_id_, s.id_) for s in g]) for k, g in ours.spans.items()
    ] == [
        (k, [(s.start, s.end, s.label_, s.kb_id_, s.id_) for s in g])
        for k, g in theirs.spans.items()
    ]
    assert [(e.start, e.end, e.label_, e.kb_id_, e.id_) for e in ours.ents] == [
        (e.start, e.end, e.label_, e.kb_id_, e.id_) for e in theirs.ents
    ]
    assert ours.to_json() == theirs.to_json()
    assert list(ours.user_data) == list(theirs.user_data)
    for key, value in theirs.user_data.items():
        if isinstance(value, numpy.ndarray):
            numpy.testing.assert_array_equal(ours.user_data[key], value)
        else:
            assert ours.user_data[key] == value


def assert_same_as_docbin(path: Path, start: int = 0, stop=None) -> int:
    theirs = list(DocBin().from_disk(path).get_docs(Vocab()))[start:stop]
    vocab = Vocab()
    with DocBinReader(path) as reader:
        ours = list(reader.get_docs(vocab, start, stop))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        docs_equal(a, b)
    return len(ours)


@pytest.fixture(scope="module")
def rich_file(tmp_path_factory):
    _install_extensions()
    rng = random.Random(0)
    vocab = Vocab()
    docs = [rich_doc(vocab, rng, rng.choice([0, 1, 2, 5, 17, 40, 300])) for _ in range(160)]
    path = tmp_path_factory.mktemp("docbin") / "rich.spacy"
    DocBin(store_user_data=True, docs=docs).to_disk(path)
    return path


def test_rich_docs_equal_docbins(rich_file):
    assert assert_same_as_docbin(rich_file) == 160


def test_ranges_equal_docbins_slices(rich_file):
    for start, stop in ((0, 1), (7, 59), (150, None), (159, 500), (160, None)):
        assert_same_as_docbin(rich_file, start, stop)


def test_small_chunks_cross_every_boundary(rich_file, monkeypatch):
    """Tiny read and inflate chunks: every value straddles chunk boundaries."""
    monkeypatch.setattr(docbin_module, "READ_CHUNK", 7)
    monkeypatch.setattr(docbin_module, "INFLATE_CHUNK", 13)
    assert_same_as_docbin(rich_file, 3, 40)


@pytest.mark.parametrize("store_user_data", [False, True])
def test_user_data_stored_or_not(tmp_path, store_user_data):
    _install_extensions()
    rng = random.Random(1)
    docs = [rich_doc(Vocab(), rng, 6) for _ in range(12)]
    path = tmp_path / "ud.spacy"
    DocBin(store_user_data=store_user_data, docs=docs).to_disk(path)
    assert assert_same_as_docbin(path) == 12
    with DocBinReader(path) as reader:
        got = [dict(doc.user_data) for doc in reader.get_docs(Vocab())]
    assert any(got) == store_user_data


def test_attribute_subset_and_empty_bins(tmp_path):
    _install_extensions()
    rng = random.Random(2)
    docs = [rich_doc(Vocab(), rng, n) for n in (3, 0, 9)]
    DocBin(attrs=["ORTH", "ENT_IOB", "ENT_TYPE"], docs=docs).to_disk(tmp_path / "sub.spacy")
    assert assert_same_as_docbin(tmp_path / "sub.spacy") == 3
    DocBin().to_disk(tmp_path / "empty.spacy")
    assert assert_same_as_docbin(tmp_path / "empty.spacy") == 0
    with DocBinReader(tmp_path / "empty.spacy") as reader:
        assert len(reader) == 0 and reader.n_tokens == 0
    DocBin(docs=[Doc(Vocab(), words=[])] * 3).to_disk(tmp_path / "empties.spacy")
    assert assert_same_as_docbin(tmp_path / "empties.spacy") == 3


def test_strings_go_to_the_vocab_as_docbin_puts_them(rich_file):
    theirs, ours = Vocab(), Vocab()
    list(DocBin().from_disk(rich_file).get_docs(theirs))
    with DocBinReader(rich_file) as reader:
        list(reader.get_docs(ours))
    assert sorted(ours.strings) == sorted(theirs.strings)
    assert len(ours) == len(theirs)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(min_value=0, max_value=30), max_size=12), st.integers(0, 2**16))
def test_random_docs_equal_docbins(tmp_path, lengths, seed):
    _install_extensions()
    rng = random.Random(seed)
    docs = [rich_doc(Vocab(), rng, n) for n in lengths]
    path = tmp_path / f"h{seed}-{len(lengths)}.spacy"
    DocBin(store_user_data=rng.random() < 0.5, docs=docs).to_disk(path)
    assert assert_same_as_docbin(path) == len(lengths)


def test_lengths_without_decoding(rich_file):
    theirs = [len(d) for d in DocBin().from_disk(rich_file).get_docs(Vocab())]
    with DocBinReader(rich_file) as reader:
        ours = numpy.concatenate(list(reader.iter_lengths())).tolist()
        assert reader.n_tokens == sum(theirs) and reader.max_length == max(theirs)
    assert ours == theirs
    assert count_shard_docs(rich_file) == 160


# -- damaged files ---------------------------------------------------------------


def _spacy_fails(path: Path) -> None:
    with pytest.raises(Exception):
        list(DocBin().from_disk(path).get_docs(Vocab()))


@pytest.mark.parametrize("cut", [0, 1, 10, 0.5, -5, -1])
def test_truncated_file_names_the_file(rich_file, tmp_path, cut):
    data = rich_file.read_bytes()
    end = int(len(data) * cut) if isinstance(cut, float) else (cut if cut >= 0 else len(data) + cut)
    bad = tmp_path / "truncated.spacy"
    bad.write_bytes(data[:end])
    _spacy_fails(bad)
    with pytest.raises(CorruptShardError, match="truncated.spacy"):
        with DocBinReader(bad) as reader:
            list(reader.get_docs(Vocab()))


def test_damaged_bytes_and_other_formats(rich_file, tmp_path):
    data = bytearray(rich_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "flipped.spacy"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="flipped.spacy"):
        DocBinReader(bad)
    not_docbin = tmp_path / "list.spacy"
    not_docbin.write_bytes(zlib.compress(srsly.msgpack_dumps([1, 2, 3])))
    with pytest.raises(CorruptShardError, match="list.spacy.*not a msgpack map"):
        DocBinReader(not_docbin)
    text = tmp_path / "text.spacy"
    text.write_bytes(b"this is not a DocBin")
    with pytest.raises(CorruptShardError, match="text.spacy.*damaged"):
        DocBinReader(text)


def test_a_file_that_unpacks_too_far_is_refused(tmp_path, monkeypatch):
    """A 250 KB .spacy file held one doc of 20 million tokens (2.7 GB to read); files
    that unpack to more than SPACY_LEAN_MAX_INFLATE_RATIO (500) times what was read
    are refused, past INFLATE_FLOOR. Here the floor is 1 MB and the ratio 100: a doc of
    one word 200,000 times unpacks ~300 times, a generated corpus ~20 times."""
    monkeypatch.setattr(docbin_module, "INFLATE_FLOOR", 1 << 20)
    monkeypatch.setenv("SPACY_LEAN_MAX_INFLATE_RATIO", "100")
    vocab = Vocab()
    bomb = tmp_path / "bomb.spacy"
    DocBin(docs=[Doc(vocab, words=["the"] * 200_000)]).to_disk(bomb)
    with pytest.raises(CorruptShardError, match=r"bomb\.spacy' unpacks to more than 100 times"):
        list(iter_shard_docs(bomb, Vocab()))
    nlp = spacy.blank("en")
    fine = tmp_path / "fine.spacy"
    DocBin(docs=synthetic.make_ner_docs(nlp, 300, seed=3)).to_disk(fine)
    assert len(zlib.decompress(fine.read_bytes())) > 1 << 20
    assert len(list(iter_shard_docs(fine, Vocab()))) == 300
    monkeypatch.setenv("SPACY_LEAN_MAX_INFLATE_RATIO", "1000")
    assert len(list(iter_shard_docs(bomb, Vocab()))[0]) == 200_000
    monkeypatch.setenv("SPACY_LEAN_MAX_INFLATE_RATIO", "lots")
    with pytest.raises(ValueError, match="SPACY_LEAN_MAX_INFLATE_RATIO must be a positive"):
        list(iter_shard_docs(bomb, Vocab()))


def test_a_span_past_the_docs_end_is_refused(tmp_path):
    """Span groups are stored without checks: a 246-byte file with a span ending at
    token 50,000,000 of a 3-token doc was read, and failed later, in whatever touched
    the span, with spaCy's IndexError and no file named."""
    import struct

    vocab = Vocab()
    doc = Doc(vocab, words=["a", "b", "c"])
    doc.spans["sc"] = [Span(doc, 0, 1, label="X")]
    msg = srsly.msgpack_loads(zlib.decompress(DocBin(docs=[doc]).to_bytes()))
    groups = srsly.msgpack_loads(msg["span_groups"][0])
    ((key, value),) = groups.items()
    group = srsly.msgpack_loads(key)
    fields = list(struct.unpack(">QQQllll", group["spans"][0]))
    fields[4] = 50_000_000  # the end token
    group["spans"][0] = struct.pack(">QQQllll", *fields)
    msg["span_groups"][0] = srsly.msgpack_dumps({srsly.msgpack_dumps(group): value})
    bad = tmp_path / "span.spacy"
    bad.write_bytes(zlib.compress(srsly.msgpack_dumps(msg)))
    with pytest.raises(CorruptShardError, match=r"doc 0 of '.*span\.spacy'.*E035"):
        list(iter_shard_docs(bad, Vocab()))


@pytest.mark.parametrize("small_chunks", [False, True])
def test_concatenated_files_are_refused(tmp_path, monkeypatch, small_chunks):
    """`cat a.spacy b.spacy > all.spacy` makes a file whose first DocBin DocBin.from_disk
    and the reader read without a word: every doc of b was silently lost. The reader
    refuses data after the compressed DocBin, naming the file."""
    if small_chunks:  # the first DocBin ends inside a chunk, or at a chunk's end
        monkeypatch.setattr(docbin_module, "READ_CHUNK", 7)
    nlp = spacy.blank("en")
    first = DocBin(docs=synthetic.make_ner_docs(nlp, 5, seed=1)).to_bytes()
    second = DocBin(docs=synthetic.make_ner_docs(nlp, 3, seed=2)).to_bytes()
    joined = tmp_path / "joined.spacy"
    joined.write_bytes(first + second)
    assert len(DocBin().from_disk(joined)) == 5  # spaCy drops the second DocBin
    with pytest.raises(CorruptShardError, match=r"joined.spacy.*after its compressed data"):
        DocBinReader(joined)
    single = tmp_path / "single.spacy"
    single.write_bytes(first)
    with DocBinReader(single) as reader:
        assert len(list(reader.get_docs(nlp.vocab))) == 5


def test_inconsistent_sections_are_refused(tmp_path):
    doc_bin = DocBin(docs=[Doc(Vocab(), words=["a", "b"])])
    msg = srsly.msgpack_loads(zlib.decompress(doc_bin.to_bytes()))
    msg["lengths"] = numpy.asarray([3], dtype="int32").tobytes()
    path = tmp_path / "lengths.spacy"
    path.write_bytes(zlib.compress(srsly.msgpack_dumps(msg)))
    with pytest.raises(CorruptShardError, match="lengths.spacy.*'tokens' has"):
        DocBinReader(path)
    del msg["cats"]
    path.write_bytes(zlib.compress(srsly.msgpack_dumps(msg)))
    with pytest.raises(CorruptShardError, match="no 'cats'"):
        DocBinReader(path)


def test_undecodable_doc_names_file_and_doc(tmp_path):
    """A token hash with no string: DocBin fails too; we say which doc."""
    doc_bin = DocBin(docs=[Doc(Vocab(), words=["a"]), Doc(Vocab(), words=["b"])])
    msg = srsly.msgpack_loads(zlib.decompress(doc_bin.to_bytes()))
    msg["strings"] = ["a"]
    path = tmp_path / "strings.spacy"
    path.write_bytes(zlib.compress(srsly.msgpack_dumps(msg)))
    _spacy_fails(path)
    with DocBinReader(path) as reader:
        docs = reader.get_docs(Vocab())
        assert next(docs).text == "a "
        with pytest.raises(CorruptShardError, match=r"doc 1 of '.*strings.spacy'"):
            next(docs)


# -- through the corpus sources ---------------------------------------------------


def test_parts_cover_a_file_once(tmp_path):
    path = synthetic.write_ner_corpus(tmp_path / "dev.spacy", 23, seed=3)
    nlp = spacy.blank("en")
    whole = [d.text for d in iter_shard_docs(path, nlp.vocab)]
    for n in (1, 2, 5, 30):
        parts = [[d.text for d in iter_shard_docs(path, nlp.vocab, part=(k, n))] for k in range(n)]
        assert [t for p in parts for t in p] == whole
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    examples = [
        eg.reference.text for k in range(3) for eg in read_examples(nlp, [path], part=(k, 3))
    ]
    assert examples == [d for d in whole if d]
    with pytest.raises(ValueError, match="part must be"):
        next(iter_shard_docs(path, nlp.vocab, part=(3, 3)))


def test_reader_closes_its_file(rich_file, monkeypatch):
    import spacy_lean.corpus.sources as sources

    opened = []

    class Recording(DocBinReader):
        def __init__(self, path):
            super().__init__(path)
            opened.append(self)

    monkeypatch.setattr(sources, "DocBinReader", Recording)
    docs = iter_shard_docs(rich_file, Vocab())
    next(docs)
    assert not opened[0].closed
    docs.close()  # the generator's `with` closes the reader
    assert opened[0].closed
    list(iter_shard_docs(rich_file, Vocab()))
    assert opened[1].closed
    with pytest.raises(ValueError, match="is closed"):
        next(opened[1].get_docs(Vocab()))


def test_no_reading_path_loads_a_whole_docbin(rich_file, tmp_path, monkeypatch):
    """Training, evaluation and sharding read .spacy files through DocBinReader, never
    through DocBin.from_bytes (which holds the whole file); the docs stay exact."""
    from spacy_lean.corpus import LeanCorpus, write_shards

    want = [d.to_bytes() for d in DocBin().from_disk(rich_file).get_docs(Vocab())]

    def whole_file(*args, **kwargs):
        raise AssertionError("DocBin.from_bytes was called")

    monkeypatch.setattr(DocBin, "from_bytes", whole_file)
    nlp = spacy.blank("en")
    written = write_shards(rich_file, tmp_path / "out", 50, nlp=nlp)
    assert len(written) == 4
    got = [d.to_bytes() for shard in written for d in iter_shard_docs(shard, Vocab())]
    assert got == want
    refs = [eg.reference.to_bytes() for eg in LeanCorpus(rich_file)(nlp)]
    assert refs == [b for b, d in zip(want, DocBinReader(rich_file).get_docs(Vocab())) if len(d)]
    assert len(list(read_examples(nlp, [rich_file]))) == len(refs)
