"""max_length splitting loses no annotation: checked over many random docs."""

import random

import numpy
import pytest
import spacy
from spacy.tokens import Doc, Span, Token

from spacy_lean.corpus.lengths import WordpieceCounter
from spacy_lean.corpus.split import DocSplitter, SplitStats

LABELS = ["A", "B", "C"]

if not Doc.has_extension("lean_test_doc"):
    Doc.set_extension("lean_test_doc", default=None)
if not Token.has_extension("lean_test_tok"):
    Token.set_extension("lean_test_tok", default=None)
if not Span.has_extension("lean_test_span"):
    Span.set_extension("lean_test_span", default=None)


@pytest.fixture(scope="module")
def nlp():
    return spacy.blank("en")


def random_doc(nlp, rng: random.Random, with_parse: bool = True) -> Doc:
    """A doc with every kind of annotation: sentences (or none), entities (some across
    sentence boundaries, some long), missing entity annotation, two span groups
    with overlapping spans, cats, tags/pos/morph/lemmas, a parse per sentence, and
    user data and extension values on the doc, tokens and spans."""
    n_sents = rng.randint(1, 8)
    sent_lens = [rng.choice([1, 2, 3, 5, 8, 13, 30]) for _ in range(n_sents)]
    n = sum(sent_lens)
    words = [rng.choice(["w", "xy", "zzz", "Q", "ab.c", "Hello", "-"]) + str(i) for i in range(n)]
    spaces = [rng.random() < 0.8 for _ in range(n)]
    has_sents = rng.random() < 0.85
    sent_starts = []
    for length in sent_lens:
        sent_starts.extend([True] + [False] * (length - 1))
    heads, deps = [], []
    offset = 0
    for length in sent_lens:
        root = offset + rng.randrange(length)
        for i in range(offset, offset + length):
            if i == root:
                heads.append(i)
                deps.append("ROOT")
            else:
                # any earlier token of the sentence, or the root: always a tree
                heads.append(rng.choice([root] + list(range(offset, i))) if i > root else root)
                deps.append(rng.choice(["nsubj", "obj", "amod", None]))
        offset += length
    kwargs = {}
    if with_parse and has_sents:
        kwargs = {"heads": heads, "deps": deps}
    elif has_sents:
        kwargs = {"sent_starts": sent_starts}
    doc = Doc(
        nlp.vocab,
        words=words,
        spaces=spaces,
        tags=[rng.choice(["NN", "VB", "JJ"]) for _ in range(n)],
        pos=[rng.choice(["NOUN", "VERB", "ADJ"]) for _ in range(n)],
        morphs=[rng.choice(["", "Number=Sing", "Tense=Past|VerbForm=Fin"]) for _ in range(n)],
        lemmas=[w.lower() for w in words],
        **kwargs,
    )
    # entities: non-overlapping, random lengths (some long, some crossing sentences)
    ents, missing, i = [], [], 0
    while i < n:
        if rng.random() < 0.25:
            length = min(rng.choice([1, 2, 3, 7, 20]), n - i)
            span = Span(doc, i, i + length, label=rng.choice(LABELS), kb_id=rng.choice(["", "Q1"]))
            ents.append(span)
            i += length
        elif rng.random() < 0.05:
            missing.append(Span(doc, i, i + 1))
            i += 1
        else:
            i += 1
    doc.set_ents(ents, missing=missing, outside=[], default="outside")
    for key in ("sc", "other"):
        spans = []
        for _ in range(rng.randint(0, 6)):
            start = rng.randrange(n)
            end = min(n, start + rng.choice([0, 1, 2, 4, 9]))
            spans.append(
                Span(doc, start, end, label=rng.choice(LABELS), span_id=rng.choice(["", "s1"]))
            )
        doc.spans[key] = spans
        doc.spans[key].attrs["scores"] = [0.5] * len(spans)
    doc.cats = {"POS": rng.random(), "NEG": 1.0}
    doc.user_data["source"] = {"id": rng.randint(0, 999)}
    doc._.lean_test_doc = "doc-level"
    for token in doc:
        if rng.random() < 0.3:
            token._.lean_test_tok = token.i
    for span in doc.spans["sc"]:
        span._.lean_test_span = (span.start, span.end)
    return doc


def protected_ok(doc: Doc) -> numpy.ndarray:
    """valid[i]: cutting before token i splits no entity and no span."""
    valid = numpy.ones(len(doc) + 1, dtype=bool)
    spans = list(doc.ents) + [s for g in doc.spans.values() for s in g]
    for span in spans:
        valid[span.start + 1 : span.end] = False
    return valid


def check_pieces(doc: Doc, pieces, max_length: int, stats: SplitStats):
    """Every annotation of `doc` is in exactly one place in `pieces`."""
    assert pieces, "no piece for a non-empty doc"
    assert "".join(p.text for p in pieces) == doc.text
    assert [t.text for p in pieces for t in p] == [t.text for t in doc]
    bounds = numpy.cumsum([0] + [len(p) for p in pieces])
    valid = protected_ok(doc)
    for piece, a in zip(pieces, bounds[:-1]):
        b = a + len(piece)
        if max_length and len(piece) > max_length:
            # oversize only when no valid cut lies inside the piece
            assert not valid[a + 1 : b].any(), (a, b)
    # cuts never split a protected span
    assert all(valid[c] for c in bounds[1:-1])
    # token attributes
    for attr in (
        "tag_",
        "pos_",
        "lemma_",
        "norm_",
        "whitespace_",
        "ent_iob_",
        "ent_type_",
        "ent_kb_id_",
    ):
        assert [getattr(t, attr) for p in pieces for t in p] == [
            getattr(t, attr) for t in doc
        ], attr
    assert [str(t.morph) for p in pieces for t in p] == [str(t.morph) for t in doc]
    # entities with char offsets and kb ids
    got = set()
    for piece, a in zip(pieces, bounds[:-1]):
        off = doc[int(a)].idx
        got |= {(e.start_char + off, e.end_char + off, e.label_, e.kb_id_) for e in piece.ents}
    assert got == {(e.start_char, e.end_char, e.label_, e.kb_id_) for e in doc.ents}
    # span groups
    for key, group in doc.spans.items():
        got_spans = []
        for piece, a in zip(pieces, bounds[:-1]):
            off = int(a)
            got_spans.extend(
                (s.start + off, s.end + off, s.label_, s.id_) for s in piece.spans[key]
            )
            assert piece.spans[key].attrs == group.attrs
        assert sorted(got_spans) == sorted((s.start, s.end, s.label_, s.id_) for s in group)
    # sentence starts: same, except that every piece starts a sentence
    if doc.has_annotation("SENT_START"):
        got_starts = [t.is_sent_start for p in pieces for t in p]
        want = [t.is_sent_start for t in doc]
        for i, (g, w) in enumerate(zip(got_starts, want)):
            if i in set(bounds[:-1].tolist()):
                assert g
            else:
                assert g == w, i
    # dependency arcs: kept inside a piece, missing where the head is in another piece
    cut = 0
    if doc.has_annotation("DEP"):
        for piece, a in zip(pieces, bounds[:-1]):
            a = int(a)
            for t in piece:
                orig = doc[a + t.i]
                if a <= orig.head.i < a + len(piece):
                    assert (t.head.i + a, t.dep_) == (orig.head.i, orig.dep_)
                else:
                    assert t.head.i == t.i and t.dep_ == ""
                    cut += int(orig.dep_ != "")
    assert cut == stats.cut_arcs
    # cats and user data
    for piece in pieces:
        assert piece.cats == doc.cats
        assert piece.user_data["source"] == doc.user_data["source"]
        assert piece._.lean_test_doc == "doc-level"
    assert [t._.lean_test_tok for p in pieces for t in p] == [t._.lean_test_tok for t in doc]
    got_ext = []
    for piece, a in zip(pieces, bounds[:-1]):
        got_ext.extend(s._.lean_test_span for s in piece.spans["sc"])
    assert sorted(got_ext) == sorted(s._.lean_test_span for s in doc.spans["sc"])


@pytest.mark.parametrize("seed", range(6))
def test_split_loses_nothing(nlp, seed):
    rng = random.Random(seed)
    for _ in range(60):
        doc = random_doc(nlp, rng, with_parse=rng.random() < 0.5)
        max_length = rng.choice([0, 1, 2, 3, 5, 10, 25])
        stats = SplitStats()
        pieces = DocSplitter(max_length)(doc, stats)
        check_pieces(doc, pieces, max_length, stats)
        assert stats.pieces == len(pieces)
        assert stats.docs_split == int(len(pieces) > 1)
        n_over = sum(1 for p in pieces if max_length and len(p) > max_length)
        assert stats.oversize_pieces == n_over
        if max_length:
            assert all(
                len(p) <= max_length or p.ents or p.spans["sc"] or p.spans["other"] for p in pieces
            )


@pytest.mark.parametrize("seed", range(3))
def test_split_gold_preproc_cuts_every_free_sentence_boundary(nlp, seed):
    rng = random.Random(100 + seed)
    for _ in range(60):
        doc = random_doc(nlp, rng, with_parse=False)
        max_length = rng.choice([0, 4, 25])
        stats = SplitStats()
        pieces = DocSplitter(max_length, split_sentences=True)(doc, stats)
        check_pieces(doc, pieces, max_length, stats)
        if doc.has_annotation("SENT_START"):
            valid = protected_ok(doc)
            cuts = set(numpy.cumsum([len(p) for p in pieces])[:-1].tolist())
            free = {t.i for t in doc if t.i > 0 and t.is_sent_start and valid[t.i]}
            assert free <= cuts


def test_split_packs_sentences_and_is_inclusive(nlp):
    doc = Doc(nlp.vocab, words=list("abcdefgh"), sent_starts=[1, 0, 0, 1, 0, 1, 0, 0])
    pieces = DocSplitter(5)(doc)
    assert [len(p) for p in pieces] == [5, 3]  # sentences 3+2 packed, exactly max_length
    assert DocSplitter(8)(doc) == [doc]  # inclusive: a doc of exactly max_length is not split


def test_split_long_sentence_at_token_boundary_outside_entities(nlp):
    doc = Doc(nlp.vocab, words=list("abcdefghij"))
    doc.ents = [Span(doc, 2, 5, label="X")]
    stats = SplitStats()
    pieces = DocSplitter(4)(doc, stats)
    assert [p.text.strip() for p in pieces] == ["a b", "c d e f", "g h i j"]
    assert stats.token_cuts == 2 and stats.sentence_cuts == 0


def test_split_keeps_long_entity_whole(nlp):
    doc = Doc(nlp.vocab, words=list("abcdefghij"))
    doc.ents = [Span(doc, 1, 8, label="LONG")]
    stats = SplitStats()
    pieces = DocSplitter(3)(doc, stats)
    assert [len(p) for p in pieces] == [1, 7, 2]
    assert pieces[1].ents[0].label_ == "LONG" and len(pieces[1].ents[0]) == 7
    assert stats.oversize_pieces == 1 and stats.max_oversize == 7


def test_split_cross_sentence_entity_kept(nlp):
    doc = Doc(nlp.vocab, words=list("abcdef"), sent_starts=[1, 0, 0, 1, 0, 0])
    doc.ents = [Span(doc, 2, 4, label="X")]  # spans the sentence boundary
    pieces = DocSplitter(3)(doc)
    assert all(len(p) <= 3 for p in pieces)
    assert [e.text for p in pieces for e in p.ents] == ["c d"]


def test_split_empty_doc_counted(nlp):
    stats = SplitStats()
    assert DocSplitter(3)(Doc(nlp.vocab, words=[]), stats) == []
    assert stats.empty_docs == 1


@pytest.mark.parametrize("bad", [-1, -100])
def test_negative_max_length_names_value(bad):
    with pytest.raises(ValueError, match=f"max_length must be >= 0, got {bad}"):
        DocSplitter(bad)


def test_split_in_wordpieces(nlp, tiny_transformer):
    counter = WordpieceCounter(tiny_transformer)
    # the tiny tokenizer adds no special tokens; real BERT tokenizers add 2
    assert counter.n_special == counter.tokenizer.num_special_tokens_to_add()
    rng = random.Random(7)
    splitter = DocSplitter(24, get_token_lengths=counter.token_lengths, n_special=counter.n_special)
    n_split = 0
    for _ in range(30):
        doc = random_doc(nlp, rng, with_parse=False)
        stats = SplitStats()
        pieces = splitter(doc, stats)
        n_split += len(pieces) > 1
        lengths = numpy.asarray(counter.token_lengths(doc))
        assert (lengths >= 1).all()
        check_pieces(doc, pieces, 0, stats)
        bounds = numpy.cumsum([0] + [len(p) for p in pieces])
        valid = protected_ok(doc)
        for a, b, piece in zip(bounds[:-1], bounds[1:], pieces):
            assert counter(piece) == int(lengths[a:b].sum()) + counter.n_special
            if counter(piece) > 24:
                assert not valid[a + 1 : b].any() or b - a == 1
    assert n_split > 5


def test_wordpiece_counter_with_a_byte_level_bpe_tokenizer(nlp, tmp_path):
    """RoBERTa's and GPT-2's tokenizers (byte-level BPE, the default transformer of
    configs/ner_trf.cfg is roberta-base) refuse pre-split words unless loaded with
    add_prefix_space=True: counting wordpieces raised an AssertionError."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    from spacy_lean.synthetic import generated_sentences

    bpe = ByteLevelBPETokenizer()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    texts = generated_sentences(200, seed=0)
    bpe.train_from_iterator(texts, vocab_size=300, special_tokens=special, show_progress=False)
    bpe.save_model(str(tmp_path))
    files = {
        "vocab_file": str(tmp_path / "vocab.json"),
        "merges_file": str(tmp_path / "merges.txt"),
    }
    RobertaTokenizerFast(**files).save_pretrained(str(tmp_path))
    counter = WordpieceCounter(tmp_path)
    assert counter.n_special == 2  # <s> and </s>
    doc = nlp("Anna Berg visited the Norsk Hydro plant in Oslo, Norway.")
    lengths = counter.token_lengths(doc)
    assert len(lengths) == len(doc) and min(lengths) >= 1
    # Each word counted as the model sees it after a space: close to the text's count.
    n_text = len(counter.tokenizer(doc.text, add_special_tokens=False)["input_ids"])
    assert abs(sum(lengths) - n_text) <= 2
    pieces = DocSplitter(8, get_token_lengths=counter.token_lengths, n_special=2)(doc)
    assert len(pieces) > 1 and sum(len(p) for p in pieces) == len(doc)


def test_counting_a_long_doc_does_not_warn_of_indexing_errors(nlp, tiny_transformer):
    """Measuring a doc longer than the model's maximum (to split it) logged
    transformers' "Token indices sequence length is longer than the specified maximum
    sequence length for this model ... will result in indexing errors"."""
    import logging

    counter = WordpieceCounter(tiny_transformer)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        doc = nlp(" ".join(["word"] * (counter.tokenizer.model_max_length + 10)))
        assert sum(counter.token_lengths(doc)) > counter.tokenizer.model_max_length
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "indexing errors" in r.getMessage()]


def test_span_values_a_cut_crosses_are_counted(nlp):
    """A span known only to an extension value (not an entity, not in a span group)
    does not stop a cut: its value fits in no piece, and was dropped without a trace.
    Now it is counted in `cut_span_values`."""
    if not Span.has_extension("lean_test_cut"):
        Span.set_extension("lean_test_cut", default=None)
    doc = nlp.make_doc("one two three four five six")
    doc[1:4]._.lean_test_cut = "crossed"  # tokens 1-3: cut at 3 with max_length 3
    doc[0:2]._.lean_test_cut = "kept"
    stats = SplitStats()
    pieces = DocSplitter(3)(doc, stats)
    assert [len(p) for p in pieces] == [3, 3]
    assert pieces[0][0:2]._.lean_test_cut == "kept"
    assert stats.cut_span_values == 1


def test_span_groups_keep_their_order_in_each_piece(nlp):
    """Spans are found per piece by their start (a doc of 40k tokens with 10k spans
    took 15 s to split when every piece walked every span); each piece's group keeps
    the group's own order, which need not be sorted."""
    rng = random.Random(4)
    doc = nlp.make_doc(" ".join(f"w{i}" for i in range(400)))
    spans = []
    for _ in range(300):
        start = rng.randrange(400)
        spans.append(Span(doc, start, start + rng.choice([0, 1]), label=f"L{len(spans)}"))
    doc.spans["sc"] = spans
    pieces = DocSplitter(7)(doc)
    got = [s.label_ for p in pieces for s in p.spans["sc"]]
    assert sorted(got) == sorted(s.label_ for s in spans)  # each span once
    order = {s.label_: i for i, s in enumerate(spans)}
    for piece in pieces:
        labels = [order[s.label_] for s in piece.spans["sc"]]
        assert labels == sorted(labels)
