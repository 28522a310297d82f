"""The token-to-wordpiece alignment of spacy-transformers, computed with numpy.

Every forward pass of a spacy-transformers `Transformer` (prediction and training)
aligns the batch's spaCy tokens with the wordpieces of their spans:
`spacy_transformers.align.get_alignment_via_offset_mapping` walks every token of every
span in Python (a `Token` object per token, a set of wordpiece indices per token), which
costs about as much as the whole forward pass of a 2-layer, 64-wide model on CPU
(0.8 s per 270k tokens, against 1.3 s to tokenize them into wordpieces).

`align_offsets(spans, offset_mapping)` returns the same `Ragged`, value for value and
in the same order, from a handful of array operations per batch. `fast_alignment()`
is a context manager under which spacy-transformers' forward pass uses it; spacy-lean
enters it while it evaluates (`StreamingEvaluator`) and while `lean_update` updates.
Nothing is changed outside it.

What spacy-transformers computes, and so this: tokens are numbered over the *whole*
docs of the batch (each doc once, in the order the spans first name it), so a token
outside every span is there with no wordpieces; the wordpieces of span `i` are numbered
from `i * width` (`width`: the padded width of the batch's offset mapping); wordpiece
`j` of a span, with character offsets `[s, e)` in the span's text, is aligned with every
token that one of the characters `s .. e-1` belongs to, where a character belongs to
the last span token that starts at or before it and ends at most one character before
it (so a token owns the one whitespace character after it); the wordpiece indices of a
token are sorted and unique.
"""

import contextlib
import sys
import threading
from typing import Any, Dict, Iterator, Sequence

import numpy
from spacy.attrs import IDX, LENGTH
from spacy.tokens import Span
from thinc.types import Ragged

__all__ = ["align_offsets", "fast_alignment"]

# How many `fast_alignment` contexts are open (nested or in several threads at once),
# and the function they replaced.
_LOCK = threading.Lock()
_STATE: Dict[str, Any] = {"depth": 0}


def align_offsets(spans: Sequence[Span], offset_mapping: Any) -> Ragged:
    """The alignment `spacy_transformers.align.get_alignment_via_offset_mapping`
    gives for the same arguments (same data, lengths and dtypes).

    spans (Sequence[Span]): the batch's spans, in the order of the offset mapping's rows.
    offset_mapping (array): (n_spans, width, 2) character offsets of each wordpiece in
        its span's text; padding and special tokens are (0, 0).
    RETURNS (Ragged): for every token of the spans' docs, the indices of its wordpieces
        in the flattened (n_spans * width) wordpiece array.
    """
    offsets = numpy.asarray(offset_mapping)
    n_spans = len(spans)
    if n_spans != offsets.shape[0]:
        raise ValueError("Cannot align batches of different sizes.")
    # Every doc once, in the order the spans name it. Its tokens are numbered from the
    # tokens of the docs before it, and its characters put after theirs (with a gap),
    # so that one sorted array of token starts serves the whole batch.
    docs = {}
    starts_parts, ends_parts = [], []
    n_tokens = n_chars = 0
    span_rows = numpy.zeros((n_spans, 3), dtype="int64")  # first token, end token, doc base
    for i, span in enumerate(spans):
        doc = span.doc
        base = docs.get(doc)
        if base is None:
            arr = doc.to_array([IDX, LENGTH]).astype("int64").reshape((-1, 2))
            starts_parts.append(arr[:, 0] + n_chars)
            ends_parts.append(arr[:, 0] + arr[:, 1] + n_chars)
            base = docs[doc] = n_tokens
            n_tokens += arr.shape[0]
            n_chars += int(ends_parts[-1][-1]) - n_chars + 2 if arr.shape[0] else 2
        span_rows[i] = (span.start, span.end, base)
    width = offsets.shape[1] if offsets.ndim == 3 and n_spans else 0
    if n_tokens == 0 or width == 0:
        return Ragged(numpy.zeros((0,), dtype="i"), numpy.zeros((n_tokens,), dtype="i"))
    tok_starts = numpy.concatenate(starts_parts)
    tok_ends = numpy.concatenate(ends_parts)
    nonempty = span_rows[:, 1] > span_rows[:, 0]
    first = span_rows[:, 2] + span_rows[:, 0]
    last = numpy.where(nonempty, span_rows[:, 2] + span_rows[:, 1] - 1, first)
    first = numpy.minimum(first, n_tokens - 1)
    last = numpy.minimum(last, n_tokens - 1)
    origin = tok_starts[first]
    # A span's characters are 0 .. len(text): its text and one position past it.
    span_chars = numpy.where(nonempty, tok_ends[last] - origin + 1, 0)[:, None]
    rows = offsets.astype("int64", copy=False)
    lo = numpy.clip(rows[:, :, 0], 0, span_chars).ravel()
    counts = numpy.maximum(numpy.clip(rows[:, :, 1], 0, span_chars).ravel() - lo, 0)
    total = int(counts.sum())
    data = numpy.zeros((0,), dtype="int64")
    lengths = numpy.zeros((n_tokens,), dtype="int64")
    if total:
        # One entry per character of each wordpiece (pieces numbered span * width + j).
        pieces = numpy.repeat(numpy.arange(n_spans * width, dtype="int64"), counts)
        span_of = pieces // width
        chars = (
            numpy.arange(total, dtype="int64")
            + numpy.repeat(lo - (numpy.cumsum(counts) - counts), counts)
            + origin[span_of]
        )
        # The last token of the span that starts at or before a character owns it if
        # the character is at most one past that token's end.
        k = numpy.minimum(numpy.searchsorted(tok_starts, chars, side="right") - 1, last[span_of])
        owned = chars <= tok_ends[k]
        k, pieces = k[owned], pieces[owned]
        # Within a wordpiece the owners are non-decreasing and each owner's characters
        # are contiguous: keeping an entry where the pair changes makes pairs unique.
        changed = numpy.empty(k.shape[0], dtype=bool)
        changed[:1] = True
        changed[1:] = (k[1:] != k[:-1]) | (pieces[1:] != pieces[:-1])
        # Sorted by token, then by wordpiece (overlapping spans share tokens).
        stride = n_spans * width
        pairs = numpy.sort(k[changed] * stride + pieces[changed])
        tokens, data = numpy.divmod(pairs, stride)
        lengths = numpy.bincount(tokens, minlength=n_tokens)
    return Ragged(data.astype("i"), lengths.astype("i"))


@contextlib.contextmanager
def fast_alignment() -> Iterator[None]:
    """While active, spacy-transformers' forward pass aligns tokens and wordpieces with
    `align_offsets` (the same alignment, computed with numpy). Re-entrant, and safe to
    enter from several threads: the original function is back once the last exits."""
    # Looked up, not imported: a spacy-transformers model was built only if its module
    # is imported, and importing it costs 2-3 s in a pipeline that has none.
    transformer_model = sys.modules.get("spacy_transformers.layers.transformer_model")
    if transformer_model is None:
        yield
        return
    with _LOCK:
        if _STATE["depth"] == 0:
            _STATE["original"] = transformer_model.get_alignment_via_offset_mapping
            transformer_model.get_alignment_via_offset_mapping = align_offsets
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0:
                transformer_model.get_alignment_via_offset_mapping = _STATE.pop("original")
