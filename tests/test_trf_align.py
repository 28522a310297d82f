"""The numpy token-to-wordpiece alignment (spacy_lean.trf_align) against
spacy-transformers' own, value for value, and the context that installs it."""

import numpy
import pytest
import spacy
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from spacy.tokens import Doc
from spacy_transformers.align import get_alignment_via_offset_mapping
from spacy_transformers.layers import transformer_model
from spacy_transformers.layers.transformer_model import huggingface_tokenize
from spacy_transformers.span_getters import get_doc_spans, get_strided_spans
from transformers import AutoTokenizer

from spacy_lean import synthetic
from spacy_lean.trf_align import align_offsets, fast_alignment

# Words a tokenizer splits oddly: accents, CJK, emoji, special-token look-alikes,
# punctuation runs, whitespace tokens, a long word, a word its vocabulary lacks.
WORDS = [
    "the",
    "Bank",
    "of",
    "Paris",
    "said",
    ",",
    ".",
    "don't",
    "café",
    "東京",
    "🙂🙂",
    "[CLS]",
    "[SEP]",
    "##ing",
    "--",
    "...",
    " ",
    "\n",
    "\n\n",
    "\t",
    "x" * 40,
    "Zürich-Nord",
    "ﬁ",
    "İstanbul",
    "e\u0301",
    "3.14",
    "$",
    "(",
    ")",
    "qqqqzzzz",
]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_transformer):
    return AutoTokenizer.from_pretrained(str(tiny_transformer))


@pytest.fixture(scope="module")
def vocab():
    return spacy.blank("en").vocab


def both(spans, tokenizer):
    encoding = huggingface_tokenize(tokenizer, [span.text for span in spans])
    try:
        theirs = get_alignment_via_offset_mapping(spans, encoding["offset_mapping"])
    except ValueError:
        # spacy-transformers fails on some batches (e.g. a 1-d offset mapping when no
        # text has a wordpiece): nothing to compare with.
        assume(False)
    ours = align_offsets(spans, encoding["offset_mapping"])
    return ours, theirs


def assert_same(ours, theirs):
    assert ours.data.dtype == theirs.data.dtype
    assert ours.lengths.dtype == theirs.lengths.dtype
    numpy.testing.assert_array_equal(ours.lengths, theirs.lengths)
    numpy.testing.assert_array_equal(ours.data, theirs.data)


doc_words = st.lists(st.tuples(st.sampled_from(WORDS), st.booleans()), min_size=0, max_size=40)


@given(st.lists(doc_words, min_size=1, max_size=5), st.sampled_from([(4, 3), (8, 6), (16, 16)]))
@settings(max_examples=120, deadline=None)
def test_same_alignment_as_spacy_transformers(hf_tokenizer, vocab, docs_words, window):
    docs = []
    for words in docs_words:
        spaces = [space and not w.isspace() for w, space in words]
        docs.append(Doc(vocab, words=[w for w, _ in words], spaces=spaces))
    docs = [doc for doc in docs if len(doc)] or [Doc(vocab, words=["a"])]
    # Overlapping strided windows: tokens covered by several spans.
    spans = [s for doc_spans in get_strided_spans(docs, *window) for s in doc_spans]
    assert_same(*both(spans, hf_tokenizer))
    # Whole docs, a doc named twice, and docs in another order.
    doc_spans = [s for doc_spans in get_doc_spans(docs) for s in doc_spans]
    assert_same(*both(doc_spans, hf_tokenizer))
    assert_same(*both(doc_spans[::-1] + doc_spans[:1], hf_tokenizer))


def test_tokens_outside_every_span_and_generated_news(hf_tokenizer, vocab):
    nlp = spacy.blank("en")
    docs = synthetic.make_ner_docs(nlp, 12, seed=3)
    # Spans that leave tokens out: those tokens are there with no wordpieces.
    spans = [doc[2 : min(len(doc), 30)] for doc in docs if len(doc) > 3]
    ours, theirs = both(spans, hf_tokenizer)
    assert_same(ours, theirs)
    assert (ours.lengths == 0).any()
    assert_same(*both([s for d in get_strided_spans(docs, 128, 96) for s in d], hf_tokenizer))


def test_mismatched_sizes(vocab):
    doc = Doc(vocab, words=["a", "b", "c"])
    with pytest.raises(ValueError, match="different sizes"):
        align_offsets([doc[0:1]], numpy.zeros((2, 3, 2), dtype="int64"))


def test_fast_alignment_is_installed_only_inside_and_nests():
    original = transformer_model.get_alignment_via_offset_mapping
    assert original is get_alignment_via_offset_mapping
    with fast_alignment():
        assert transformer_model.get_alignment_via_offset_mapping is align_offsets
        with fast_alignment():
            assert transformer_model.get_alignment_via_offset_mapping is align_offsets
        assert transformer_model.get_alignment_via_offset_mapping is align_offsets
    assert transformer_model.get_alignment_via_offset_mapping is original
    with pytest.raises(RuntimeError):
        with fast_alignment():
            raise RuntimeError("boom")
    assert transformer_model.get_alignment_via_offset_mapping is original


def test_pipeline_output_unchanged(trf_ner_nlp):
    nlp = trf_ner_nlp
    texts = [d.text for d in synthetic.make_ner_docs(nlp, 8, seed=9)]
    stock = list(nlp.pipe(texts))
    with fast_alignment():
        fast = list(nlp.pipe(texts))
    for a, b in zip(stock, fast):
        assert [(e.start, e.end, e.label_) for e in a.ents] == [
            (e.start, e.end, e.label_) for e in b.ents
        ]
        assert_same(b._.trf_data.align, a._.trf_data.align)
