"""Batched contextual string embeddings: texts -> character ids -> LMs -> token rows.

For every text the forward LM reads `delimiter + " ".join(words) + " "` and the
backward LM `delimiter + reversed(" ".join(words)) + " "` (Flair's input). A token's
vector is the forward LM's output after the token (at the whitespace that follows it,
or at its last character with `with_whitespace=False`) concatenated with the
backward LM's output before it, exactly as Flair's `FlairEmbeddings` computes it.

What makes it fast and lean:
- texts are sorted by character length before they are cut into LM batches, so
  almost no padded positions go through the LSTM;
- character ids come from one vectorised lookup over all the texts of a call, and
  the padded, time-major id matrix of a batch is filled by one numpy assignment;
- the rows of the tokens are gathered from an LM batch's output with one index op
  per batch and written into one compact `[n_tokens, width]` tensor; the batch's
  hidden states are then free (outside of autograd nothing else refers to them);
- the forward and backward LMs can run at the same time in two threads, and the
  number of torch threads can be set for the call;
- an LM batch longer than `max_chunk_chars` characters is read in time chunks of
  that length, the LSTM state carried from one chunk to the next (in the LM's
  reading direction: the backward LM's input is already reversed), so a long doc
  never has all its characters' hidden states at once; the texts that have ended
  drop out of the batch at a chunk boundary. Shorter batches take one LSTM call,
  as before.
"""

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, List, Optional, Sequence, Tuple, Union

import numpy
import torch

from .model import CharLM

if TYPE_CHECKING:  # for the annotation below
    import spacy

# A spaCy Doc (anything iterable over tokens with `.text` and `.whitespace_`), or a
# list or tuple of words.
WordsInput = Union["spacy.tokens.Doc", Sequence[str]]

# Characters an LM reads in one LSTM call (per text of its LM batch). Frozen, a batch's
# peak is then about batch_size x this x the LM's width floats (x ~7 on torch's CPU LSTM,
# which also holds its gates), not batch_size x its longest text x the width; and no call
# comes near the length torch's CPU LSTM refuses ("could not create a primitive" from
# about 2**27 / hidden steps: at hidden 2048 65,000 ran and 65,535 failed). Sentences and
# paragraphs are shorter and take one call, as without chunks. On one 200,000-character
# doc, chunks of 256-2048 were ~20% faster than one call and 8192 only 4%
# (benchmarks/charlm_long_doc.py, docs/charlm.md).
DEFAULT_MAX_CHUNK_CHARS = 2048


@dataclass
class _Texts:
    """Token offsets of a call's texts (all arrays concatenated over the texts)."""

    texts: List[str]  # the text the offsets refer to (tokenized or plain)
    n_tokens: numpy.ndarray  # [n_texts] tokens per text
    starts: numpy.ndarray  # [total_tokens] token start in its text
    ends: numpy.ndarray  # [total_tokens] token end in its text
    text_len: numpy.ndarray  # [total_tokens] len() of the token's text


def _words_and_spaces(item) -> Tuple[List[str], Optional[List[bool]]]:
    if isinstance(item, (list, tuple)):
        return list(item), None
    return [t.text for t in item], [bool(t.whitespace_) for t in item]


def _layout(items: Sequence[WordsInput], tokenized_lm: bool) -> _Texts:
    texts: List[str] = []
    all_words: List[str] = []
    all_spaces: List[bool] = []
    n_tokens = numpy.zeros(len(items), dtype=numpy.int64)
    for i, item in enumerate(items):
        words, spaces = _words_and_spaces(item)
        n_tokens[i] = len(words)
        all_words.extend(words)
        if tokenized_lm or spaces is None:
            texts.append(" ".join(words))
            all_spaces.extend([True] * len(words))
        else:
            # Flair's `Sentence.to_plain_string()` strips trailing whitespace: the last
            # token's space (Flair tokens are never whitespace; spaCy's "\n" tokens stay).
            last = len(words) - 1
            texts.append(
                "".join(
                    w + " " if s and j < last else w for j, (w, s) in enumerate(zip(words, spaces))
                )
            )
            all_spaces.extend(spaces)
    total = len(all_words)
    lens = numpy.fromiter(map(len, all_words), dtype=numpy.int64, count=total)
    gaps = numpy.fromiter(all_spaces, dtype=numpy.int64, count=total)
    ends_of_texts = numpy.cumsum(n_tokens)
    gaps[ends_of_texts[n_tokens > 0] - 1] = 0  # nothing follows a text's last token
    # Start of each token = cumulative (len + gap) of the tokens before it in its text.
    step = lens + gaps
    csum = numpy.cumsum(step) - step
    first = numpy.repeat(ends_of_texts - n_tokens, n_tokens)
    starts = csum - csum[first]
    text_len = numpy.repeat(numpy.fromiter(map(len, texts), numpy.int64, len(texts)), n_tokens)
    return _Texts(texts, n_tokens, starts, starts + lens, text_len)


class CharLMEmbedder:
    """Computes Flair-identical token vectors from a forward and/or backward `CharLM`.

    forward_lm (Optional[CharLM]): the forward LM.
    backward_lm (Optional[CharLM]): the backward LM.
    with_whitespace (bool): take the state at the whitespace after a token (Flair's
        default) rather than at its last character.
    tokenized_lm (bool): feed `" ".join(words)` (Flair's default) rather than the
        text with its original whitespace.
    is_lower (bool): lowercase the LM input (offsets still come from the original
        text, as in Flair).
    batch_size (int): texts per LM batch.
    threads (Optional[int]): torch threads to use during a call, in total (None: leave
        torch's setting as it is). With `concurrent`, each LM gets half of them.
    concurrent (bool): run the forward and backward LMs at the same time, in two
        Python threads (torch releases the GIL inside its ops).
    max_chunk_chars (Optional[int]): read LM batches longer than this many characters
        in chunks of this length, carrying the LSTM state (same vectors, a peak that
        does not grow with the length of a doc); None: whole batches at once.
    """

    def __init__(
        self,
        forward_lm: Optional[CharLM] = None,
        backward_lm: Optional[CharLM] = None,
        *,
        with_whitespace: bool = True,
        tokenized_lm: bool = True,
        is_lower: bool = False,
        batch_size: int = 32,
        threads: Optional[int] = None,
        concurrent: bool = False,
        max_chunk_chars: Optional[int] = DEFAULT_MAX_CHUNK_CHARS,
    ) -> None:
        if forward_lm is None and backward_lm is None:
            raise ValueError("CharLMEmbedder needs a forward LM, a backward LM, or both.")
        for lm, want in ((forward_lm, True), (backward_lm, False)):
            if lm is not None and lm.is_forward_lm != want:
                direction = "forward" if lm.is_forward_lm else "backward"
                raise ValueError(
                    f"The {'forward' if want else 'backward'} LM slot got a {direction} LM: "
                    "check which checkpoint goes where."
                )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        check_max_chunk_chars(max_chunk_chars)
        self.lms = [lm for lm in (forward_lm, backward_lm) if lm is not None]
        self.with_whitespace = with_whitespace
        self.tokenized_lm = tokenized_lm
        self.is_lower = is_lower
        self.batch_size = batch_size
        self.threads = threads
        self.concurrent = concurrent
        self.max_chunk_chars = max_chunk_chars

    @property
    def width(self) -> int:
        """Width of a token vector (sum over the LMs)."""
        return sum(lm.output_size for lm in self.lms)

    def __call__(
        self, items: Sequence[WordsInput], grad: bool = False
    ) -> Tuple[torch.Tensor, numpy.ndarray]:
        """Embed the tokens of `items` (spaCy Docs or lists of words).

        items (Sequence): the texts.
        grad (bool): keep autograd through the LMs (fine-tuning).
        RETURNS (Tuple[Tensor, ndarray]): the `[n_tokens, width]` vectors of all
            tokens in order, and the number of tokens of each item.
        """
        layout = _layout(items, self.tokenized_lm)
        total = int(layout.n_tokens.sum())
        param = next(self.lms[0].parameters())
        widths = [lm.output_size for lm in self.lms]
        with self._thread_limit(), torch.set_grad_enabled(grad):
            if grad:
                # Autograd: one tensor per LM, concatenated at the end.
                outs = [param.new_empty((total, w)) for w in widths]
                vectors = None
            else:
                # No autograd: each LM writes its rows straight into its columns of
                # the result, so the vectors exist once.
                vectors = param.new_empty((total, sum(widths)))
                offsets = numpy.cumsum([0] + widths)
                outs = [vectors[:, offsets[k] : offsets[k + 1]] for k in range(len(widths))]
            if self.concurrent and len(self.lms) == 2 and total:
                errors: List[BaseException] = []

                def run(k: int) -> None:
                    try:
                        with torch.set_grad_enabled(grad):
                            outs[k] = self._embed_one(self.lms[k], layout, outs[k])
                    except BaseException as err:  # pragma: no cover - re-raised below
                        errors.append(err)

                worker = threading.Thread(target=run, args=(1,))
                worker.start()
                run(0)
                worker.join()
                if errors:
                    raise errors[0]
            else:
                outs = [self._embed_one(lm, layout, out) for lm, out in zip(self.lms, outs)]
            if vectors is None:
                vectors = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return vectors, layout.n_tokens

    def split(self, items: Sequence[WordsInput], grad: bool = False) -> List[torch.Tensor]:
        """Like `__call__`, but one `[len(item), width]` tensor (a view) per item."""
        vectors, n_tokens = self(items, grad=grad)
        return list(torch.split(vectors, n_tokens.tolist(), dim=0))

    @contextlib.contextmanager
    def _thread_limit(self) -> Iterator[None]:
        if self.threads is None:
            yield
            return
        before = torch.get_num_threads()
        # `threads` is the total: with the two LMs running side by side, each gets half.
        per_lm = self.threads // 2 if self.concurrent and len(self.lms) == 2 else self.threads
        torch.set_num_threads(max(1, per_lm))
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _embed_one(self, lm: CharLM, layout: _Texts, out: torch.Tensor) -> torch.Tensor:
        """Write the rows of `lm` for all tokens into `out` ([n_tokens, output_size])."""
        device = out.device
        n_texts = len(layout.texts)
        if out.shape[0] == 0:
            return out
        delim = lm.document_delimiter
        m = len(delim)
        texts = [t.lower() for t in layout.texts] if self.is_lower else layout.texts
        if lm.is_forward_lm:
            lm_texts = [f"{delim}{t} " for t in texts]
        else:
            lm_texts = [f"{delim}{t[::-1]} " for t in texts]
        seq_len = numpy.fromiter(map(len, lm_texts), numpy.int64, n_texts)
        ids = lm.dictionary.encode_array("".join(lm_texts))
        seq_start = numpy.cumsum(seq_len) - seq_len
        # Position of each token's vector in its LM input (Flair's offsets, taken from
        # the original, not the lowercased, text).
        if lm.is_forward_lm:
            pos = m + layout.ends
        else:
            pos = m + layout.text_len - layout.starts
        if not self.with_whitespace:
            pos = pos - 1
        tok_first = numpy.cumsum(layout.n_tokens) - layout.n_tokens
        pad_id = lm.dictionary.get_idx(" ")
        # Longest texts first; texts without tokens need no LM pass.
        order = numpy.argsort(-seq_len, kind="stable")
        order = order[layout.n_tokens[order] > 0]
        for b0 in range(0, len(order), self.batch_size):
            batch = order[b0 : b0 + self.batch_size]
            b = len(batch)
            lens = seq_len[batch]
            T = int(lens.max())
            # Padded, time-major ids: one gather from the flat ids, one scatter.
            col = numpy.repeat(numpy.arange(b), lens)
            t = numpy.arange(int(lens.sum())) - numpy.repeat(numpy.cumsum(lens) - lens, lens)
            src = numpy.repeat(seq_start[batch], lens) + t
            mat = numpy.full((T, b), pad_id, dtype=numpy.int64)
            mat[t, col] = ids[src]
            # This batch's tokens: where each goes in the result, its column and its
            # position in the LM input.
            ntok = layout.n_tokens[batch]
            tok_col = numpy.repeat(numpy.arange(b), ntok)
            tok_idx = numpy.repeat(tok_first[batch], ntok) + (
                numpy.arange(int(ntok.sum())) - numpy.repeat(numpy.cumsum(ntok) - ntok, ntok)
            )
            tok_pos = pos[tok_idx]
            inp = torch.from_numpy(mat).to(device, non_blocking=True)
            chunk = T if self.max_chunk_chars is None else min(T, self.max_chunk_chars)
            starts = range(0, T, chunk)
            if chunk < T:
                # Tokens in the order of their positions: each chunk's are a slice.
                by_pos = numpy.argsort(tok_pos, kind="stable")
                tok_idx, tok_col, tok_pos = tok_idx[by_pos], tok_col[by_pos], tok_pos[by_pos]
                bounds = numpy.searchsorted(tok_pos, list(starts) + [T]).tolist()
            else:
                bounds = [0, len(tok_pos)]
            hidden = lm.init_hidden(b)
            for k, t0 in enumerate(starts):
                # The batch's texts are sorted longest first, so the ones still being
                # read at t0 are its first `active` columns; the others (all padding
                # from here on) leave the batch.
                active = int(numpy.count_nonzero(lens > t0))
                if active < hidden[0].shape[1]:
                    hidden = tuple(h[:, :active].contiguous() for h in hidden)
                _, states, hidden = lm(inp[t0 : t0 + chunk, :active], hidden, decode=False)
                lo, hi = bounds[k], bounds[k + 1]
                rows = None
                if hi > lo:
                    # The chunk's token rows: one gather from its [len * active, H]
                    # output, which is then freed before the next chunk runs.
                    flat = (tok_pos[lo:hi] - t0) * active + tok_col[lo:hi]
                    rows = states.reshape(-1, states.shape[-1]).index_select(
                        0, torch.from_numpy(flat).to(device)
                    )
                del states
                if rows is not None:
                    out[torch.from_numpy(tok_idx[lo:hi]).to(device)] = rows
        return out


def check_max_chunk_chars(value: Optional[int]) -> None:
    """`max_chunk_chars` must be a positive int or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_chunk_chars must be an int >= 1 or None, got {value!r}")
