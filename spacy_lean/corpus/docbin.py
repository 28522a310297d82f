"""Reading .spacy files (spaCy's DocBin format) in bounded memory, and small
DocBin helpers.

`DocBin.from_disk` reads the whole file, inflates it and unpacks every doc's arrays
into Python objects before the first doc comes out. `DocBinReader` reads the same
bytes as a stream: one pass inflates the file in chunks and walks its msgpack
structure without keeping it, noting where each section (token table, spaces,
lengths, strings, cats, flags, span groups, user data) starts as a copy of the zlib
decompressor at that point; reading the docs then runs one decompressor per section
from its mark, side by side, and decodes one doc at a time exactly as
`DocBin.get_docs` does. Memory is a few buffers (tens of KiB each, or one doc's
token table when that is larger), whatever the file's size; nothing is written to
disk. The vocab still takes every string of the file, as with DocBin.
"""

import functools
import os
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy
import srsly
from spacy.attrs import ENT_IOB, HEAD, ORTH, POS, SENT_START, SPACY
from spacy.tokens import Doc, DocBin
from spacy.vocab import Vocab
from srsly.msgpack import _Unpacker, _unpackb, msgpack_decoders
from srsly.msgpack.exceptions import OutOfData

from .._env import positive_int_env
from ..zones import StringIndex, add_file_strings

try:
    from spacy.tokens._dict_proxies import SpanGroups

    _EMPTY_SPAN_GROUPS = SpanGroups._EMPTY_BYTES
except (ImportError, AttributeError):  # pragma: no cover - other spaCy versions
    _EMPTY_SPAN_GROUPS = srsly.msgpack_dumps([])


class CorruptShardError(ValueError):
    """A data file could not be read: it is corrupt, truncated or not in the format
    its name says. The message names the file."""


_EMPTY_MSGPACK_MAP = b"\x80"


def _object_hook() -> Any:
    """The object hook srsly's msgpack functions build on every call (its registered
    decoders: numpy arrays), built once: listing the decoders costs ~0.5 ms."""
    hook = None
    for decoder in msgpack_decoders.get_all().values():
        hook = functools.partial(decoder, chain=hook)
    return hook


def docbin_docs(doc_bin: DocBin, vocab: Vocab) -> Iterator[Doc]:
    """`doc_bin.get_docs(vocab)` with the docs' user data, decoded without
    `srsly.msgpack_loads`, which lists srsly's registered decoders (entry points) on
    every call: ~0.5-2 ms, more than decoding the doc."""
    if vocab.in_memory_zone:  # the strings outlive the zone (`spacy_lean.zones`)
        add_file_strings(vocab, doc_bin.strings)
    user_data = doc_bin.user_data
    if not user_data:
        yield from doc_bin.get_docs(vocab)
        return
    hook = _object_hook()
    doc_bin.user_data = []
    try:
        for i, doc in enumerate(doc_bin.get_docs(vocab)):
            data = user_data[i] if i < len(user_data) else None
            _load_user_data(doc, data, hook)
            yield doc
    finally:
        doc_bin.user_data = user_data


def _load_user_data(doc: Doc, data: Optional[bytes], hook: Any) -> None:
    """What `DocBin.get_docs` does with a doc's stored user data
    (`srsly.msgpack_loads(data, use_list=False)`), with the decoders' hook built once."""
    if data is not None and data != _EMPTY_MSGPACK_MAP:
        doc.user_data.update(_unpackb(data, raw=False, use_list=False, object_hook=hook))


def docbin_add(doc_bin: DocBin, doc: Doc) -> None:
    """`doc_bin.add(doc)`, encoding the user data only when there is some."""
    if not doc_bin.store_user_data or doc.user_data:
        doc_bin.add(doc)
        return
    doc_bin.store_user_data = False
    try:
        doc_bin.add(doc)
    finally:
        doc_bin.store_user_data = True
    doc_bin.user_data.append(_EMPTY_MSGPACK_MAP)


# Compressed bytes read from the file at a time, and decompressed bytes made per zlib
# call: each cursor holds about one of each.
READ_CHUNK = 1 << 16
INFLATE_CHUNK = 1 << 16
# msgpack's Unpacker reads ahead by at most this much; a cursor keeps as much behind
# its position, so what the Unpacker read but did not use can be given back.
_UNPACK_READ = 1 << 14
# A cursor that has made more than INFLATE_FLOOR bytes may have made at most this many
# times the compressed bytes it read (SPACY_LEAN_MAX_INFLATE_RATIO): DocBins of text
# unpack to about 5-30 times their size (a doc of one word repeated: 300), while a
# crafted one unpacks to ~1000 times, a doc of millions of tokens in a few KB.
MAX_INFLATE_RATIO_ENV = "SPACY_LEAN_MAX_INFLATE_RATIO"
DEFAULT_MAX_INFLATE_RATIO = 500
INFLATE_FLOOR = 64 << 20
_ARRAY_SECTIONS = ("strings", "cats", "flags", "span_groups", "user_data")
_BIN_SECTIONS = ("tokens", "spaces", "lengths")
_State = Tuple[Any, int, bytes, bytes, int]


class _Source:
    """The compressed file, read at given offsets (cursors share one handle)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("rb")

    @property
    def closed(self) -> bool:
        return self._file.closed

    def read_at(self, offset: int, size: int) -> bytes:
        if self._file.closed:
            raise ValueError(f"The DocBinReader of '{self.path}' is closed.")
        self._file.seek(offset)
        return self._file.read(size)

    def close(self) -> None:
        self._file.close()

    def size(self) -> int:
        return os.fstat(self._file.fileno()).st_size

    def error(self, what: str) -> CorruptShardError:
        return CorruptShardError(
            f"Could not read '{self.path}' as a .spacy file (DocBin): {what}. The file is "
            "corrupt, truncated or not a DocBin; re-create it with DocBin.to_disk, "
            "`python -m spacy convert` or `python -m spacy lean shard`."
        )


class _Inflater:
    """A forward-only reader of the decompressed bytes of the file, from its start or
    from a saved state (`state()`), holding a chunk of output at a time."""

    def __init__(self, source: _Source, state: Optional[_State] = None):
        self.source = source
        if state is None:
            self._zlib, self._offset, self._tail, buf, self.pos = (
                zlib.decompressobj(),
                0,
                b"",
                b"",
                0,
            )
        else:
            decomp, self._offset, self._tail, buf, self.pos = state
            self._zlib = decomp.copy()
        self._buf = bytearray(buf)
        self._at = 0  # position of `pos` in `_buf`
        self._ended = False
        # For the inflation limit: where this cursor began reading, what it has made.
        self._started_at = self._offset - len(self._tail)
        self._made = 0
        self._max_ratio = max_inflate_ratio()

    def state(self) -> _State:
        """Where this reader is, to start other readers from (the zlib state is copied)."""
        return (self._zlib.copy(), self._offset, self._tail, bytes(self._buf[self._at :]), self.pos)

    def _fill(self) -> bool:
        """Decompress some more; False at the end of the compressed stream."""
        if self._ended:
            return False
        if self._at > _UNPACK_READ + INFLATE_CHUNK:
            del self._buf[: self._at - _UNPACK_READ]
            self._at = _UNPACK_READ
        data = self._tail
        if not data:
            data = self.source.read_at(self._offset, READ_CHUNK)
            self._offset += len(data)
        try:
            if data:
                out = self._zlib.decompress(data, INFLATE_CHUNK)
                self._tail = self._zlib.unconsumed_tail
            else:
                out = self._zlib.flush()
                self._ended = True
        except zlib.error as err:
            raise self.source.error(f"the compressed data is damaged ({err})") from err
        if self._zlib.eof:
            self._ended = True
        elif self._ended:
            raise self.source.error("the compressed data ends early (the file is truncated)")
        self._made += len(out)
        if self._made > INFLATE_FLOOR:
            read = max(1, self._offset - len(self._tail) - self._started_at)
            if self._made > self._max_ratio * read:
                raise CorruptShardError(
                    f"'{self.source.path}' unpacks to more than {self._max_ratio} times its "
                    f"size ({self._made:,} bytes from {read:,}), which no DocBin of text "
                    "does (they unpack to 5-30 times their size): refused as a "
                    "decompression bomb. If the file is genuine, set the environment "
                    f"variable {MAX_INFLATE_RATIO_ENV} to a larger ratio."
                )
        self._buf += out
        return True

    def trailing_bytes(self) -> int:
        """At the end of the compressed stream: how many bytes of the file follow it."""
        return len(self._zlib.unused_data) + max(0, self.source.size() - self._offset)

    def read(self, size: int) -> bytes:
        """Up to `size` bytes (fewer at the end): the file interface Unpacker reads."""
        while self._at >= len(self._buf):
            if not self._fill():
                return b""
        data = bytes(self._buf[self._at : self._at + size])
        self._at += len(data)
        self.pos += len(data)
        return data

    def take(self, size: int, what: str) -> bytes:
        """Exactly `size` bytes."""
        while len(self._buf) - self._at < size:
            if not self._fill():
                raise self.source.error(f"the data ends inside {what}")
        data = bytes(self._buf[self._at : self._at + size])
        self._at += size
        self.pos += size
        return data

    def skip(self, size: int, what: str) -> None:
        while size > 0:
            if self._at >= len(self._buf) and not self._fill():
                raise self.source.error(f"the data ends inside {what}")
            step = min(size, len(self._buf) - self._at)
            self._at += step
            self.pos += step
            size -= step

    def unread(self, size: int) -> None:
        """Step back `size` bytes (at most `_UNPACK_READ`): what an Unpacker read ahead."""
        if size > self._at:  # pragma: no cover - guarded by the buffer's reserve
            raise RuntimeError(f"Cannot step back {size} bytes, only {self._at} are kept.")
        self._at -= size
        self.pos -= size


def max_inflate_ratio() -> int:
    """The inflation limit of .spacy files (`SPACY_LEAN_MAX_INFLATE_RATIO`)."""
    return positive_int_env(
        MAX_INFLATE_RATIO_ENV, DEFAULT_MAX_INFLATE_RATIO, "whole number (a ratio)"
    )


def _unpacker(stream: _Inflater, hook: Any = None) -> _Unpacker:
    # The settings `srsly.msgpack_loads` uses: str, lists, srsly's decoders.
    return _Unpacker(stream, raw=False, use_list=True, read_size=_UNPACK_READ, object_hook=hook)


# DocBin attributes whose values are not string hashes (POS holds symbol ids).
_NON_STRING_ATTRS = {ENT_IOB, HEAD, POS, SENT_START, SPACY}


class _Items:
    """The elements of one msgpack array section, unpacked one at a time."""

    def __init__(self, source: _Source, state: _State, what: str, hook: Any):
        self.stream = _Inflater(source, state)
        self.unpacker = _unpacker(self.stream, hook)
        self.what = what

    def next(self) -> Any:
        try:
            return self.unpacker.unpack()
        except OutOfData:
            raise self.stream.source.error(f"the data ends inside {self.what}") from None

    def skip(self, n: int) -> None:
        try:
            for _ in range(n):
                self.unpacker.skip()
        except OutOfData:
            raise self.stream.source.error(f"the data ends inside {self.what}") from None


def _one_value(stream: _Inflater, skip: bool = False, count: int = 1) -> Any:
    """Unpack (or skip) `count` msgpack values at the stream's position, leaving the
    stream just after them."""
    start = stream.pos
    unpacker = _unpacker(stream)
    value = None
    try:
        for _ in range(count):
            if skip:
                unpacker.skip()
            else:
                value = unpacker.unpack()
    except OutOfData:
        raise stream.source.error("the msgpack data ends early") from None
    stream.unread(stream.pos - start - unpacker.tell())
    return value


def _header(stream: _Inflater, kind: str, what: str) -> int:
    """Read a msgpack map, array or bin header; return its size."""
    code = stream.take(1, what)[0]
    if kind == "map" and 0x80 <= code <= 0x8F:
        return code & 0x0F
    if kind == "array" and 0x90 <= code <= 0x9F:
        return code & 0x0F
    widths = {
        "map": {0xDE: 2, 0xDF: 4},
        "array": {0xDC: 2, 0xDD: 4},
        "bin": {0xC4: 1, 0xC5: 2, 0xC6: 4},
    }[kind]
    if code not in widths:
        raise stream.source.error(f"{what} is not a msgpack {kind} (type byte {code:#04x})")
    return int.from_bytes(stream.take(widths[code], what), "big")


class DocBinReader:
    """Read the docs of a .spacy file one at a time, in memory independent of the
    file's size. The docs equal those of `DocBin(store_user_data=True).from_disk(path)
    .get_docs(vocab)`: attributes, sentence boundaries, entities, span groups, cats,
    flags and user data.

    Opening the reader inflates the file once to check it and find its sections (a
    damaged or truncated file raises `CorruptShardError` here, naming the file);
    `get_docs` inflates it again, one section beside the other. Close the reader (or
    use it as a context manager) to close the file.

    path (str / Path): the .spacy file.
    """

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self._source = _Source(self.path)
        self._hook = _object_hook()
        try:
            self._index()
        except BaseException:
            self._source.close()
            raise

    def __len__(self) -> int:
        """RETURNS (int): the number of docs."""
        return self.n_docs

    def __enter__(self) -> "DocBinReader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the file; docs being read stop with an error."""
        self._source.close()

    @property
    def closed(self) -> bool:
        return self._source.closed

    def _index(self) -> None:
        source = self._source
        stream = _Inflater(source)
        self.attrs: List[int] = []
        self._marks: Dict[str, Tuple[_State, int]] = {}
        self.n_tokens = 0
        self.max_length = 0
        n_keys = _header(stream, "map", "the top-level object")
        for _ in range(n_keys):
            key = _one_value(stream)
            if key in _BIN_SECTIONS:
                size = _header(stream, "bin", f"'{key}'")
                self._marks[key] = (stream.state(), size)
                if key == "lengths":
                    self._sum_lengths(stream, size)
                else:
                    stream.skip(size, f"'{key}'")
            elif key in _ARRAY_SECTIONS:
                count = _header(stream, "array", f"'{key}'")
                self._marks[key] = (stream.state(), count)
                if count:
                    _one_value(stream, skip=True, count=count)
            elif key == "attrs":
                self.attrs = _one_value(stream)
            else:
                _one_value(stream, skip=True)
        if stream.read(1):  # inflates to the end: the zlib checksum is checked too
            raise source.error("there is data after the DocBin's map")
        extra = stream.trailing_bytes()
        if extra:  # DocBin.from_disk ignores it: its docs would be lost without a word
            raise source.error(
                f"it has {extra} bytes after its compressed data (several .spacy files "
                "joined into one? Keep them as separate files in a folder, or merge them "
                "with DocBin.merge)"
            )
        for key in ("tokens", "spaces", "lengths", "strings", "cats"):
            if key not in self._marks:
                raise source.error(f"it has no '{key}'")
        if not isinstance(self.attrs, list) or ORTH not in self.attrs:
            raise source.error(f"its attrs {str(self.attrs)[:80]} do not include ORTH")
        self.n_docs = self._marks["lengths"][1] // 4
        row = 8 * len(self.attrs)
        checks = [
            ("tokens", self._marks["tokens"][1], self.n_tokens * row, "bytes"),
            ("spaces", self._marks["spaces"][1], self.n_tokens, "bytes"),
        ]
        for key in ("cats", "flags", "span_groups"):
            if key in self._marks:
                checks.append((key, self._marks[key][1], self.n_docs, "items"))
        for key, got, want, unit in checks:
            # An empty DocBin stores an empty float64 token table: no bytes either way.
            if got != want and not (unit == "items" and got > want):
                raise source.error(
                    f"'{key}' has {got} {unit} for {self.n_docs} docs of {self.n_tokens} "
                    f"tokens (expected {want})"
                )
        self.n_strings = self._marks["strings"][1]

    def _sum_lengths(self, stream: _Inflater, size: int) -> None:
        if size % 4:
            raise self._source.error(f"'lengths' has {size} bytes, not a multiple of 4")
        left = size
        while left:
            step = min(left, 1 << 16)
            lengths = numpy.frombuffer(stream.take(step, "'lengths'"), dtype="int32")
            if lengths.size and lengths.min() < 0:
                raise self._source.error("'lengths' holds a negative doc length")
            self.n_tokens += int(lengths.sum(dtype="int64"))
            if lengths.size:
                self.max_length = max(self.max_length, int(lengths.max()))
            left -= step

    def _open(self, key: str) -> _Inflater:
        return _Inflater(self._source, self._marks[key][0])

    def _items(self, key: str) -> Optional[_Items]:
        if key not in self._marks:
            return None
        return _Items(self._source, self._marks[key][0], f"'{key}'", self._hook)

    def iter_lengths(self, start: int = 0, stop: Optional[int] = None) -> Iterator[numpy.ndarray]:
        """The docs' lengths in tokens, in blocks (int32 arrays), without decoding docs.

        start (int): first doc.
        stop (Optional[int]): end (exclusive); None for the last doc.
        YIELDS (numpy.ndarray): consecutive blocks of lengths.
        """
        start, stop = self._bounds(start, stop)
        stream = self._open("lengths")
        stream.skip(4 * start, "'lengths'")
        pos = start
        while pos < stop:
            n = min(stop - pos, 1 << 14)
            yield numpy.frombuffer(stream.take(4 * n, "'lengths'"), dtype="int32")
            pos += n

    def _bounds(self, start: int, stop: Optional[int]) -> Tuple[int, int]:
        stop = self.n_docs if stop is None else min(stop, self.n_docs)
        if not 0 <= start:
            raise ValueError(f"start must be >= 0, got {start}.")
        return min(start, stop), stop

    def add_strings(self, vocab: Vocab) -> None:
        """Add the file's strings to the vocab, as `DocBin.get_docs` does first (kept
        past the end of a memory zone: later docs find their words by hash)."""
        items = self._items("strings")
        add_file_strings(vocab, (items.next() for _ in range(self.n_strings)))  # type: ignore

    def get_docs(
        self,
        vocab: Vocab,
        start: int = 0,
        stop: Optional[int] = None,
        *,
        strings_per_doc: bool = False,
    ) -> Iterator[Doc]:
        """Yield the docs, decoded one at a time as `DocBin.get_docs` decodes them
        (with their user data, whether or not it was stored).

        vocab (Vocab): the shared vocab; every string of the file is added to it.
        start (int): first doc to yield (the ones before are skipped undecoded).
        stop (Optional[int]): end (exclusive); None for the last doc.
        strings_per_doc (bool): add to the vocab only each doc's own strings, as it is
            decoded (its token table's, its spans' labels and ids), from a compact
            index of the table (`spacy_lean.zones.StringIndex`), not the whole table
            first: for reading in memory zones, where each doc's strings then go with
            the zone it is read in. Strings kept as hashes in user data are not added.
        YIELDS (Doc): the docs.
        RAISES (CorruptShardError): a doc cannot be decoded; the message names the file.
        """
        start, stop = self._bounds(start, stop)
        if self.closed:
            raise ValueError(f"The DocBinReader of '{self.path}' is closed.")
        index: Optional[StringIndex] = None
        if strings_per_doc:
            items = self._items("strings")
            index = StringIndex(items.next() for _ in range(self.n_strings))  # type: ignore
        else:
            self.add_strings(vocab)
        attrs = self.attrs
        n_attrs = len(attrs)
        orth_col = attrs.index(ORTH)
        # The columns whose values are string hashes (not heads, flags or IOB codes).
        string_cols = [i for i, attr in enumerate(attrs) if attr not in _NON_STRING_ATTRS]
        lengths = self.iter_lengths(start, stop)
        tokens = self._open("tokens")
        spaces = self._open("spaces")
        sections = {key: self._items(key) for key in ("cats", "flags", "span_groups", "user_data")}
        n_user_data = self._marks["user_data"][1] if "user_data" in self._marks else 0
        hook = self._hook
        if start:
            offset = sum(int(block.sum(dtype="int64")) for block in self.iter_lengths(0, start))
            tokens.skip(offset * 8 * n_attrs, "'tokens'")
            spaces.skip(offset, "'spaces'")
            for key, items in sections.items():
                if items is not None:
                    items.skip(start if key != "user_data" else min(start, n_user_data))
        cats, flags_items, span_groups, user_data = (
            sections["cats"],
            sections["flags"],
            sections["span_groups"],
            sections["user_data"],
        )
        i = start
        for block in lengths:
            for n in block.tolist():
                try:
                    table = numpy.frombuffer(
                        tokens.take(8 * n_attrs * n, "'tokens'"), dtype="uint64"
                    ).reshape((n, n_attrs))
                    doc_spaces: Optional[numpy.ndarray] = numpy.frombuffer(
                        spaces.take(n, "'spaces'"), dtype=bool
                    ).reshape((n, 1))
                    flags = flags_items.next() if flags_items is not None else {}
                    if flags.get("has_unknown_spaces"):
                        doc_spaces = None
                    if index is not None:
                        index.add(vocab, table[:, string_cols])
                    doc = Doc(
                        vocab, words=table[:, orth_col], spaces=doc_spaces  # type: ignore[arg-type]
                    )
                    doc = doc.from_array(attrs, table)
                    doc.cats = cats.next()  # type: ignore[union-attr]
                    groups = span_groups.next() if span_groups is not None else b""
                    if groups and groups != _EMPTY_SPAN_GROUPS:
                        doc.spans.from_bytes(groups)
                        # Spans are stored unchecked: making each one checks its
                        # bounds (IndexError E035 for a span past the doc's end).
                        span_keys: List[int] = []
                        for group in doc.spans.values():
                            for span in group:
                                if index is not None:
                                    span_keys += (span.label, span.kb_id, span.id)
                        if index is not None and span_keys:
                            index.add(vocab, span_keys)  # once per doc, not per span
                    else:
                        doc.spans.clear()
                    data = user_data.next() if user_data is not None and i < n_user_data else None
                    _load_user_data(doc, data, hook)
                except CorruptShardError:
                    raise
                except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
                    why = "The file is corrupt or was written by another spaCy version."
                    if isinstance(err, KeyError) and vocab.in_memory_zone:
                        why = (
                            "A string it needs is missing from the vocab, which is in a spaCy "
                            "memory zone: if the file reads without one (memory_zones=False, "
                            "`--no-memory-zones`), please report it."
                        )
                    raise CorruptShardError(
                        f"Could not decode doc {i} of '{self.path}' ({type(err).__name__}: "
                        f"{err}). {why}"
                    ) from err
                yield doc
                i += 1
