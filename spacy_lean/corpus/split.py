"""Split documents longer than `max_length` into pieces, losing no annotation.

A long doc is cut at sentence boundaries, packing consecutive sentences into pieces of
at most `max_length` (inclusive). A sentence that is longer by itself is cut at a token
boundary. No cut ever falls inside an entity or inside a span of any span group; when
an entity or span is itself longer than `max_length`, its piece is kept whole and
counted as oversize. Everything else the doc carries goes with each piece: token
attributes, entities (missing vs. outside kept apart), span groups and their attrs,
doc cats, sentence starts, `user_data` and extension values.

Dependency arcs: a token whose head lies in another piece gets a *missing* head
(head = itself, dep = "") in its piece, which spaCy's parser treats as unannotated
rather than as a root. Cuts at sentence boundaries never cross an arc in a
well-formed parse; only cuts inside an over-long sentence can, and they are counted
(`cut_arcs`).
"""

import bisect
import copy
from dataclasses import asdict, dataclass, fields
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy
from spacy.attrs import DEP, ENT_IOB, HEAD, SENT_START
from spacy.tokens import Doc, Span, SpanGroup


@dataclass
class SplitStats:
    """Counts of what splitting did. Mergeable: `a.merge(b)` adds `b` into `a`.

    docs: source docs read (empty ones included).
    tokens: spaCy tokens in the docs read.
    empty_docs: empty docs skipped.
    docs_split: docs that became more than one piece.
    pieces: pieces produced (an unsplit doc is one piece).
    sentence_cuts: cuts made at a sentence boundary.
    token_cuts: cuts made inside a sentence, or in a doc without sentence boundaries.
    oversize_pieces: pieces still longer than max_length, because an entity, span or
        single token in them is longer than max_length (kept whole, never dropped).
    max_oversize: length of the longest oversize piece.
    cut_arcs: dependency arcs cut (the dependent's head is set missing).
    cut_span_values: span extension values (`doc.user_data`) of spans that a cut
        crosses, which no piece can hold (entities and span groups are never cut;
        spans known only to an extension are).
    """

    docs: int = 0
    tokens: int = 0
    empty_docs: int = 0
    docs_split: int = 0
    pieces: int = 0
    sentence_cuts: int = 0
    token_cuts: int = 0
    oversize_pieces: int = 0
    max_oversize: int = 0
    cut_arcs: int = 0
    cut_span_values: int = 0

    def merge(self, other: "SplitStats") -> "SplitStats":
        for f in fields(SplitStats):
            if f.name.startswith("max_"):
                setattr(self, f.name, max(getattr(self, f.name), getattr(other, f.name)))
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def reset(self) -> None:
        for f in fields(SplitStats):
            setattr(self, f.name, 0)

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)


def check_max_length(max_length: int) -> int:
    if not isinstance(max_length, int) or isinstance(max_length, bool):
        raise TypeError(f"max_length must be an int, got {max_length!r}.")
    if max_length < 0:
        raise ValueError(
            f"max_length must be >= 0, got {max_length}. Use 0 for no limit, or the "
            "longest piece (in tokens, inclusive) a document may be split into."
        )
    return max_length


class DocSplitter:
    """Cut docs into pieces of at most `max_length`.

    max_length (int): the longest piece, inclusive; 0 for no limit.
    get_token_lengths (Optional[Callable[[Doc], Sequence[int]]]): length of each token,
        e.g. its number of wordpieces. Default: 1 per token.
    n_special (int): length added to every piece (a transformer's special tokens).
    split_sentences (bool): cut at every sentence boundary that no entity or span
        crosses (gold_preproc), then apply max_length to each segment.
    """

    def __init__(
        self,
        max_length: int,
        *,
        get_token_lengths: Optional[Callable[[Doc], Sequence[int]]] = None,
        n_special: int = 0,
        split_sentences: bool = False,
    ) -> None:
        self.max_length = check_max_length(max_length)
        self.get_token_lengths = get_token_lengths
        self.n_special = n_special
        self.split_sentences = split_sentences

    def __call__(self, doc: Doc, stats: Optional[SplitStats] = None) -> List[Doc]:
        """Split one doc. An empty doc gives no pieces.

        doc (Doc): the doc to split; it is not modified.
        stats (Optional[SplitStats]): counters to add to.
        RETURNS (List[Doc]): the pieces, in order; `[doc]` itself when no cut is needed.
        """
        if stats is None:
            stats = SplitStats()
        stats.docs += 1
        stats.tokens += len(doc)
        if len(doc) == 0:
            stats.empty_docs += 1
            return []
        cuts, lengths, n_sent, n_tok = self.cut_points(doc)
        stats.sentence_cuts += n_sent
        stats.token_cuts += n_tok
        bounds = [0] + cuts + [len(doc)]
        for i in range(len(bounds) - 1):
            length = int(lengths[bounds[i + 1]] - lengths[bounds[i]]) + self.n_special
            if self.max_length and length > self.max_length:
                stats.oversize_pieces += 1
                stats.max_oversize = max(stats.max_oversize, length)
        stats.pieces += len(bounds) - 1
        if not cuts:
            return [doc]
        stats.docs_split += 1
        return make_pieces(doc, bounds, stats)

    def cut_points(self, doc: Doc) -> Tuple[List[int], numpy.ndarray, int, int]:
        """Where to cut `doc`.

        RETURNS (Tuple): the cut positions (a cut at i starts a piece at token i), the
            cumulative token lengths (n + 1 values), the number of cuts at sentence
            boundaries and the number inside sentences.
        """
        n = len(doc)
        if self.get_token_lengths is None:
            cum = numpy.arange(n + 1, dtype="int64")
        else:
            tok_lengths = numpy.asarray(self.get_token_lengths(doc), dtype="int64")
            cum = numpy.zeros(n + 1, dtype="int64")
            numpy.cumsum(tok_lengths, out=cum[1:])
        total = int(cum[n]) + self.n_special
        if not self.split_sentences and (self.max_length == 0 or total <= self.max_length):
            return [], cum, 0, 0
        # valid[i]: a cut before token i splits no entity and no span.
        diff = numpy.zeros(n + 2, dtype="int64")
        for start, end in _protected(doc):
            if end - start >= 2:
                diff[start + 1] += 1
                diff[end] -= 1
        valid = numpy.cumsum(diff)[: n + 1] == 0
        valid[0] = valid[n] = False
        if doc.has_annotation("SENT_START"):
            sent = doc.to_array([SENT_START]).astype("int64") == 1
            sent = numpy.append(sent, False)
            sent[0] = False
        else:
            sent = numpy.zeros(n + 1, dtype=bool)
        sent_ok = valid & sent
        if self.split_sentences:
            segments = [0] + list(numpy.flatnonzero(sent_ok)) + [n]
        else:
            segments = [0, n]
        cuts: List[int] = []
        n_sent = len(segments) - 2
        n_tok = 0
        budget = self.max_length - self.n_special
        for seg_start, seg_end in zip(segments[:-1], segments[1:]):
            if seg_start != 0:
                cuts.append(int(seg_start))
            start = int(seg_start)
            while self.max_length and int(cum[seg_end] - cum[start]) > budget:
                # The furthest end that keeps the piece within budget.
                end = int(numpy.searchsorted(cum, cum[start] + budget, side="right")) - 1
                end = min(max(end, start), seg_end)
                window = slice(start + 1, end + 1)
                at_sent = numpy.flatnonzero(sent_ok[window])
                at_tok = numpy.flatnonzero(valid[window])
                if len(at_sent):
                    cut = start + 1 + int(at_sent[-1])
                    n_sent += 1
                elif len(at_tok):
                    cut = start + 1 + int(at_tok[-1])
                    n_tok += 1
                else:
                    # Nothing fits: something longer than the budget is in the way.
                    # Keep it whole and cut at the first place after it.
                    after = numpy.flatnonzero(valid[end + 1 : seg_end])
                    if not len(after):
                        break
                    cut = end + 1 + int(after[0])
                    if sent[cut]:
                        n_sent += 1
                    else:
                        n_tok += 1
                cuts.append(cut)
                start = cut
        return cuts, cum, n_sent, n_tok


def _protected(doc: Doc):
    """(start, end) of every entity and every span of every span group."""
    for ent in doc.ents:
        yield ent.start, ent.end
    for group in doc.spans.values():
        for span in group:
            yield span.start, span.end


def make_pieces(doc: Doc, bounds: Sequence[int], stats: Optional[SplitStats] = None) -> List[Doc]:
    """Copy `doc` into pieces `doc[bounds[i]:bounds[i+1]]` with all their annotation."""
    attrs = Doc._get_array_attrs()
    array = doc.to_array(attrs)
    head_col = attrs.index(HEAD)
    dep_col = attrs.index(DEP)
    iob_col = attrs.index(ENT_IOB)
    sent_col = attrs.index(SENT_START)
    n = len(doc)
    text_len = len(doc.text)
    # Read once per doc, then found per piece by bisection: walking every span and
    # every user data key for every piece took 15 s for a doc of 40k tokens with 10k
    # spans (667 pieces).
    groups = _span_groups(doc)
    user_data = _UserData(doc)
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        sub = array[a:b].copy()
        # Heads outside the piece become missing: head = self, dep = "".
        rel = sub[:, head_col].astype("int64")
        absolute = numpy.arange(a, b) + rel
        outside = (absolute < a) | (absolute >= b)
        if outside.any():
            if stats is not None:
                stats.cut_arcs += int((outside & (sub[:, dep_col] != 0)).sum())
            sub[outside, head_col] = 0
            sub[outside, dep_col] = 0
        if sub[0, iob_col] == 1:  # "I" cannot start a doc
            sub[0, iob_col] = 3
        if sub[0, sent_col] != 0:
            sub[0, sent_col] = 1
        span = doc[a:b]
        piece = Doc(
            doc.vocab,
            words=[t.text for t in span],
            spaces=[bool(t.whitespace_) for t in span],
        )
        piece.from_array(attrs, sub)
        if outside.any() and sub[:, dep_col].any():
            # The piece's parse no longer implies every sentence start (a head was
            # cut): set them as they were, without re-deriving them from the heads.
            piece.from_array([SENT_START], sub[:, sent_col : sent_col + 1].copy())
        piece.has_unknown_spaces = doc.has_unknown_spaces
        a_char = doc[a].idx
        b_char = doc[b].idx if b < n else text_len
        _copy_span_groups(groups, piece, a, b, n)
        _copy_cats(doc, piece, a_char, b_char)
        piece.user_data = user_data.piece(a_char, b_char)
        pieces.append(piece)
    if stats is not None:
        stats.cut_span_values += user_data.n_span_values - user_data.n_span_values_copied
    return pieces


# (key, name, attrs, spans as (start, end, label, kb_id, id), their starts sorted, the
# spans' indices in that order)
_GroupRows = Tuple[
    str, str, dict, List[Tuple[int, int, int, int, int]], numpy.ndarray, numpy.ndarray
]


def _span_groups(doc: Doc) -> List[_GroupRows]:
    rows = []
    for key, group in doc.spans.items():
        spans = [(s.start, s.end, s.label, s.kb_id, s.id) for s in group]
        starts = numpy.asarray([span[0] for span in spans], dtype="int64")
        order = numpy.argsort(starts, kind="stable")
        rows.append((key, group.name, group.attrs, spans, starts[order], order))
    return rows


def _copy_span_groups(groups: List[_GroupRows], piece: Doc, a: int, b: int, n: int) -> None:
    for key, name, attrs, spans, starts, order in groups:
        lo = int(numpy.searchsorted(starts, a, side="left"))
        hi = int(numpy.searchsorted(starts, b, side="right"))
        chosen = []
        for j in sorted(order[lo:hi].tolist()):  # the group's own order
            start, end, label, kb_id, span_id = spans[j]
            if start == end:  # an empty span goes to one piece only
                inside = start < b or start == b == n
            else:
                inside = end <= b
            if inside:
                chosen.append(
                    Span(piece, start - a, end - a, label=label, kb_id=kb_id, span_id=span_id)
                )
        piece.spans[key] = SpanGroup(piece, name=name, attrs=copy.deepcopy(attrs), spans=chosen)


def _copy_cats(doc: Doc, piece: Doc, a_char: int, b_char: int) -> None:
    for key, value in doc.cats.items():
        if isinstance(key, tuple) and len(key) == 3:
            start, end, label = key
            if a_char <= start and end <= b_char:
                piece.cats[(start - a_char, end - a_char, label)] = value
        else:
            piece.cats[key] = value


class _UserData:
    """A doc's `user_data`, indexed once for its pieces: doc-level extension values
    and other keys go to every piece; token and span extension values (keyed by
    character offsets) to the piece that holds their token or span, re-keyed to its
    offsets, found by bisection."""

    def __init__(self, doc: Doc) -> None:
        self.items = list(doc.user_data.items())
        self.text_len = len(doc.text)
        self.shared: List[int] = []
        placed: List[Tuple[int, int]] = []  # (start char, index in items)
        self.n_span_values = 0
        for i, (key, _) in enumerate(self.items):
            if isinstance(key, tuple) and len(key) == 4 and key[0] == "._.":
                start, end = key[2], key[3]
                if start is None and end is None:  # doc extension
                    self.shared.append(i)
                    continue
                if isinstance(start, int):
                    placed.append((start, i))
                    self.n_span_values += end is not None
                    continue
            self.shared.append(i)
        placed.sort()
        self.placed = placed
        self.starts = [start for start, _ in placed]
        self.n_span_values_copied = 0

    def piece(self, a_char: int, b_char: int) -> Dict:
        lo = bisect.bisect_left(self.starts, a_char)
        # An empty span at the very end belongs to the last piece.
        end_of_text = b_char >= self.text_len
        hi = (bisect.bisect_right if end_of_text else bisect.bisect_left)(self.starts, b_char)
        chosen = list(self.shared)
        for _, i in self.placed[lo:hi]:
            end = self.items[i][0][3]
            if end is None or end <= b_char:  # a token's, or a span's within the piece
                chosen.append(i)
                self.n_span_values_copied += end is not None
        user_data = {}
        for i in sorted(chosen):  # the doc's own order
            key, value = self.items[i]
            if isinstance(key, tuple) and len(key) == 4 and key[0] == "._.":
                kind, name, start, end = key
                if start is not None:
                    key = (kind, name, start - a_char, None if end is None else end - a_char)
            user_data[key] = copy.copy(value)
        return user_data
