"""Memory-lean data for training character language models.

A text is encoded once, streaming, into a flat file of character ids in the smallest
integer type that holds the dictionary (uint8 up to 256 entries, uint16 up to 65,536,
int32 beyond), and read back through `np.memmap`. The whole corpus therefore costs
`n_chars * itemsize` bytes of (evictable, file-backed) memory, never a Python list.

`CharLMLoader` cuts that array into `n_streams` contiguous streams, as in truncated
backpropagation through time: row i of batch k+1 continues row i of batch k, so the
LSTM's hidden state carries over from one batch to the next. Sequence lengths are drawn
around `bptt` with a seeded generator. Each batch is written into one preallocated
buffer, `x` and `y` are views of it. The loader's position is a small dict (epoch,
offset into the streams, generator state) that restores the exact sequence of batches.

Several workers (DDP) split the streams: with `world_size` W and `batch_size` b per
worker there are S = b * W streams, and worker r reads streams [r * b, (r + 1) * b).
All workers draw the same sequence lengths, so they take the same number of steps.
"""

import codecs
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

PathLike = Union[str, Path]

IDS_FILE = "ids.bin"
META_FILE = "ids.json"
FORMAT = "spacy-lean.charlm-ids.v1"
LOADER_STATE_VERSION = 1
_N_CODEPOINTS = 0x110000
# The dtypes `id_dtype` chooses (stored by name in the metadata).
_ID_DTYPES = frozenset({"uint8", "uint16", "int32"})


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest integer dtype that holds the ids of a dictionary.

    vocab_size (int): Number of entries in the character dictionary.
    RETURNS (np.dtype): uint8 (<= 256 entries), uint16 (<= 65,536) or int32.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
    if vocab_size <= 2**8:
        return np.dtype(np.uint8)
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**31:
        return np.dtype(np.int32)
    raise ValueError(f"A dictionary of {vocab_size} entries is too large for int32 ids.")


def dictionary_fingerprint(dictionary: Any) -> str:
    """A short hash of a character dictionary's entries, in id order."""
    h = hashlib.sha1()
    for item in dictionary.idx2item:
        if isinstance(item, bytes):
            item = item.decode("utf-8", errors="surrogateescape")
        h.update(item.encode("utf-8", errors="surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


def iter_text_chunks(
    paths: Sequence[PathLike],
    *,
    chunk_size: int = 1 << 20,
    document_delimiter: str = "\n",
    progress: Any = None,
) -> Iterator[str]:
    """Read text files as a stream of string chunks of about `chunk_size` bytes.

    Files are decoded as UTF-8 with universal newlines (as `open(path)` does); a file
    that does not end with `document_delimiter` is followed by one, so documents of
    consecutive files never run into each other. A directory is read as its files in
    sorted order.

    paths (Sequence[PathLike]): Text files or directories of text files.
    chunk_size (int): Bytes read at a time.
    document_delimiter (str): Appended after a file that does not end with it.
    progress (Optional[tqdm]): Updated with the number of bytes read.
    YIELDS (str): Chunks of text.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    for path in expand_paths(paths):
        utf8 = codecs.getincrementaldecoder("utf-8")()
        decoder = io.IncrementalNewlineDecoder(utf8, True)
        last = ""
        offset = 0  # bytes of the file read before `data`
        with open(path, "rb") as file_:
            while True:
                data = file_.read(chunk_size)
                final = not data
                pending = len(utf8.getstate()[0])  # bytes held back from earlier reads
                try:
                    text = decoder.decode(data, final=final)
                except UnicodeDecodeError as err:
                    raise ValueError(
                        f"{path} is not valid UTF-8: {err.reason} at byte "
                        f"{offset - pending + err.start:,} "
                        f"({err.object[err.start:err.end]!r}). Fix or re-encode the file."
                    ) from None
                offset += len(data)
                if progress is not None and data:
                    progress.update(len(data))
                if text:
                    last = text
                    yield text
                if final:
                    break
        if document_delimiter and last and not last.endswith(document_delimiter):
            yield document_delimiter


def expand_paths(paths: Sequence[PathLike], what: str = "training text") -> List[Path]:
    """Files to read: each path itself, or a directory's files in sorted order. `what`
    names the text in the messages (e.g. "dev text (--dev)")."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: List[Path] = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.is_file()))
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"{what[0].upper() + what[1:]} file not found: {path}")
    if not files:
        raise ValueError(
            f"No files of the {what} found in: {', '.join(str(p) for p in paths)} "
            "(an empty folder)."
        )
    return files


def build_dictionary(
    paths: Sequence[PathLike],
    *,
    min_count: int = 1,
    chunk_size: int = 1 << 20,
    progress: bool = False,
) -> Any:
    """Build a `CharDictionary` from text files, reading them chunk by chunk.

    paths (Sequence[PathLike]): Text files (UTF-8) or directories of them.
    min_count (int): Keep characters seen at least this often.
    chunk_size (int): Bytes read at a time.
    progress (bool): Show a progress bar (bytes read).
    RETURNS (CharDictionary): `<unk>` at 0, then the characters by frequency.
    """
    from .model import CharDictionary

    files = expand_paths(paths)
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(p.stat().st_size for p in files)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="Counting characters", leave=False)
    try:
        chunks = iter_text_chunks(files, chunk_size=chunk_size, progress=bar)
        return CharDictionary.from_texts(chunks, min_count=min_count)
    finally:
        if bar is not None:
            bar.close()


class _CharEncoder:
    """Vectorised text -> id mapping through a lookup table over all code points."""

    def __init__(self, dictionary: Any, dtype: np.dtype) -> None:
        self.dictionary = dictionary
        self.dtype = dtype
        self.table = np.full(_N_CODEPOINTS, -1, dtype=np.int32)
        for item, idx in dictionary.item2idx.items():
            if isinstance(item, bytes):
                item = item.decode("utf-8", errors="surrogateescape")
            if len(item) == 1:
                self.table[ord(item)] = idx

    def __call__(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
        ids = self.table[codes]
        missing = ids < 0
        if missing.any():
            # Characters outside the dictionary: ask the dictionary once per distinct
            # character (unknown -> its unknown id, as Flair does) and remember.
            for code in np.unique(codes[missing]):
                self.table[code] = self.dictionary.get_idx(chr(code))
            ids = self.table[codes]
        return ids.astype(self.dtype, copy=False)


class EncodedText:
    """A text's character ids, stored once on disk and memory-mapped.

    path (PathLike): Directory written by `encode_texts`.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.exists():
            raise FileNotFoundError(
                f"No encoded text in {self.path} (missing {META_FILE}). "
                "Create one with spacy_lean.charlm.loader.encode_texts."
            )
        try:
            meta = json.loads(meta_path.read_text(encoding="utf8"))
        except (ValueError, RecursionError) as err:
            # RecursionError: JSON nested deeper than Python's decoder can follow.
            raise ValueError(
                f"Could not read {meta_path} ({type(err).__name__}): it is damaged. Delete "
                f"{self.path} to encode the text again."
            ) from None
        if not isinstance(meta, dict):
            raise ValueError(
                f"{meta_path} holds a JSON {type(meta).__name__}, not the object encode_texts "
                f"writes. Delete {self.path} to encode the text again."
            )
        self.meta: Dict[str, Any] = meta
        if self.meta.get("format") != FORMAT:
            raise ValueError(
                f"Unknown encoded-text format in {meta_path}: {self.meta.get('format')!r}"
            )
        # The ids are memory-mapped with this dtype: only plain unsigned/signed ints
        # (an object dtype would read file bytes as pointers).
        dtype_name = self.meta.get("dtype")
        ok = isinstance(dtype_name, str) and dtype_name in _ID_DTYPES
        self.dtype = np.dtype(dtype_name) if ok else None
        if self.dtype is None:
            raise ValueError(
                f"Unsupported id dtype {dtype_name!r} in {meta_path}; expected one of "
                f"{sorted(_ID_DTYPES)}. Delete {self.path} to encode the text again."
            )
        # The number of ids sizes the memory map: it must be what encode_texts wrote.
        n_chars, vocab_size = self.meta.get("n_chars"), self.meta.get("vocab_size")
        if not all(type(v) is int and v >= 1 for v in (n_chars, vocab_size)):
            raise ValueError(
                f"{meta_path}: n_chars and vocab_size must be positive whole numbers, got "
                f"{n_chars!r} and {vocab_size!r}. Delete {self.path} to encode the text again."
            )
        ids_path = self.path / IDS_FILE
        size = ids_path.stat().st_size
        if size != n_chars * self.dtype.itemsize:
            raise ValueError(
                f"{ids_path} holds {size:,} bytes, but {meta_path} describes {n_chars:,} ids "
                f"of {self.dtype.itemsize} bytes. Delete {self.path} to encode the text again."
            )
        self.n_chars = n_chars
        self.vocab_size = vocab_size
        self.ids = np.memmap(ids_path, dtype=self.dtype, mode="r", shape=(self.n_chars,))

    def __len__(self) -> int:
        return self.n_chars

    @property
    def fingerprint(self) -> str:
        return self.meta["dictionary"]

    def matches(self, dictionary: Any, sources: Optional[Sequence[PathLike]] = None) -> bool:
        """Whether this encoding was made with `dictionary` (and from `sources`, by
        path, size and modification time)."""
        if self.meta.get("dictionary") != dictionary_fingerprint(dictionary):
            return False
        if sources is not None and self.meta.get("sources") != _describe_sources(sources):
            return False
        return True

    def check_ids(self, vocab_size: int, chunk: int = 1 << 24) -> None:
        """Check that every id is below `vocab_size` (one pass over the file, a chunk
        at a time). RAISES (ValueError): an id is not, naming the file."""
        for start in range(0, self.n_chars, chunk):
            top = int(self.ids[start : start + chunk].max())
            if top >= vocab_size:
                raise ValueError(
                    f"{self.path / IDS_FILE} holds the id {top}, but the dictionary has "
                    f"{vocab_size} characters: it was changed after encode_texts wrote it. "
                    f"Delete {self.path} to encode the text again."
                )


def _describe_sources(paths: Sequence[PathLike]) -> List[Dict[str, Any]]:
    out = []
    for path in expand_paths(paths):
        stat = path.stat()
        out.append(
            {"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        )
    return out


def encode_texts(
    paths: Sequence[PathLike],
    dictionary: Any,
    output_dir: PathLike,
    *,
    chunk_size: int = 1 << 20,
    document_delimiter: str = "\n",
    progress: bool = False,
    what: str = "training text",
) -> EncodedText:
    """Encode text files into a memory-mapped id file, one chunk at a time.

    At no point does the text live in memory as a whole: each chunk of `chunk_size`
    bytes is decoded, mapped to ids through a lookup table and appended to the file.

    paths (Sequence[PathLike]): Text files (UTF-8) or directories of them.
    dictionary (CharDictionary): Maps characters to ids (unknown -> its unknown id).
    output_dir (PathLike): Directory for `ids.bin` and `ids.json`.
    chunk_size (int): Bytes read at a time.
    document_delimiter (str): Appended after a file that does not end with it.
    progress (bool): Show a progress bar (bytes read).
    what (str): What the text is, for the messages (e.g. "dev text (--dev)").
    RETURNS (EncodedText): The memory-mapped ids.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    dtype = id_dtype(len(dictionary))
    encoder = _CharEncoder(dictionary, dtype)
    files = expand_paths(paths, what=what)
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(p.stat().st_size for p in files)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="Encoding text", leave=False)
    tmp_path = output_dir / (IDS_FILE + ".tmp")
    n_chars = 0
    try:
        with open(tmp_path, "wb") as out:
            for chunk in iter_text_chunks(
                files, chunk_size=chunk_size, document_delimiter=document_delimiter, progress=bar
            ):
                ids = encoder(chunk)
                out.write(ids.tobytes())
                n_chars += len(ids)
    finally:
        if bar is not None:
            bar.close()
    if n_chars == 0:
        tmp_path.unlink()
        raise ValueError(
            f"The {what} is empty: {', '.join(str(p) for p in files)} (no characters at "
            f"all). Check the path, or give text files with the {what}."
        )
    os.replace(tmp_path, output_dir / IDS_FILE)
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "n_chars": n_chars,
        "vocab_size": len(dictionary),
        "dictionary": dictionary_fingerprint(dictionary),
        "sources": _describe_sources(files),
    }
    (output_dir / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf8")
    return EncodedText(output_dir)


def encode_text(text: str, dictionary: Any, output_dir: PathLike) -> EncodedText:
    """Encode one in-memory string (small texts, tests) into `output_dir`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    source = output_dir / "text.txt"
    source.write_text(text, encoding="utf8")
    return encode_texts([source], dictionary, output_dir, document_delimiter="")


Batch = Tuple[np.ndarray, np.ndarray]


class CharLMLoader:
    """Batches of parallel character streams for truncated BPTT, resumable.

    ids (Union[np.ndarray, EncodedText]): The character ids (a memmap, usually).
    batch_size (int): Streams (rows) per batch on this worker.
    bptt (int): Mean sequence length (time steps per batch).
    reverse (bool): Read the text backwards (the backward LM, as Flair trains it:
        the whole id sequence reversed).
    seed (int): Seed of the sequence-length generator.
    randomize (bool): Draw sequence lengths around `bptt` (with probability
        `p_half` around `bptt / 2`, normal with standard deviation `bptt_std`,
        clipped to [min_len, max_len]); False: always `bptt`.
    rank (int): This worker's index.
    world_size (int): Number of workers; the text has `batch_size * world_size`
        streams and this worker reads its own `batch_size` of them.
    """

    def __init__(
        self,
        ids: Union[np.ndarray, EncodedText],
        batch_size: int,
        bptt: int,
        *,
        reverse: bool = False,
        seed: int = 0,
        randomize: bool = True,
        bptt_std: float = 5.0,
        p_half: float = 0.05,
        min_len: int = 5,
        max_len: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if isinstance(ids, EncodedText):
            ids = ids.ids
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-dimensional, got shape {ids.shape}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if bptt < 1:
            raise ValueError(f"bptt must be >= 1, got {bptt}.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"Need 0 <= rank < world_size, got rank={rank}, world_size={world_size}."
            )
        self.ids = ids
        self.n_chars = int(ids.shape[0])
        self.batch_size = batch_size
        self.bptt = bptt
        self.reverse = reverse
        self.seed = seed
        self.randomize = randomize
        self.bptt_std = bptt_std
        self.p_half = p_half
        self.min_len = max(1, min(min_len, bptt))
        self.max_len = max_len if max_len is not None else bptt + int(np.ceil(3 * bptt_std))
        if not randomize:
            self.max_len = bptt
        if self.max_len < bptt:
            raise ValueError(f"max_len ({self.max_len}) must be >= bptt ({bptt}).")
        self.rank = rank
        self.world_size = world_size
        self.n_streams = batch_size * world_size
        self.stream_len = (self.n_chars - 1) // self.n_streams
        if self.stream_len < 1:
            raise ValueError(
                f"The text ({self.n_chars} characters) is too short for {self.n_streams} "
                f"streams (batch_size {batch_size} x world_size {world_size}): it needs at "
                f"least {self.n_streams + 1} characters. Use a smaller batch size."
            )
        first = rank * batch_size
        rows = np.arange(first, first + batch_size, dtype=np.int64)
        self._starts = (rows * self.stream_len)[None, :]
        self._steps = np.arange(self.max_len + 1, dtype=np.int64)[:, None]
        self._index = np.empty((self.max_len + 1, batch_size), dtype=np.int64)
        self.buffer = np.empty((self.max_len + 1, batch_size), dtype=ids.dtype)
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.epoch = 0
        self.offset = 0
        self.n_batches = 0

    @property
    def approx_batches_per_epoch(self) -> int:
        """Expected number of batches in one pass (exact when `randomize` is False)."""
        mean = self.bptt
        if self.randomize:
            mean = (1 - self.p_half) * self.bptt + self.p_half * self.bptt / 2
        return int(np.ceil(self.stream_len / max(1.0, mean)))

    def _draw_len(self) -> int:
        if not self.randomize:
            return self.bptt
        centre = self.bptt if self._rng.random() >= self.p_half else self.bptt / 2
        seq_len = int(self._rng.normal(centre, self.bptt_std))
        return int(min(self.max_len, max(self.min_len, seq_len)))

    def _fill(self, seq_len: int) -> Batch:
        index = self._index[: seq_len + 1]
        np.add(self._steps[: seq_len + 1], self._starts + self.offset, out=index)
        if self.reverse:
            np.subtract(self.n_chars - 1, index, out=index)
        buf = self.buffer[: seq_len + 1]
        np.take(self.ids, index, out=buf, mode="clip")
        return buf[:-1], buf[1:]

    def __iter__(self) -> Iterator[Batch]:
        """Batches from the current position to the end of the current epoch.

        YIELDS (Tuple[np.ndarray, np.ndarray]): `x` and `y`, both `[seq_len,
            batch_size]` (time-major) views of one buffer that the next batch
            overwrites; `y[t] == x[t + 1]` and `y` is `x` shifted by one character.
        """
        while True:
            remaining = self.stream_len - self.offset
            if remaining < 1:
                break
            seq_len = min(self._draw_len(), remaining)
            batch = self._fill(seq_len)
            self.offset += seq_len
            self.n_batches += 1
            yield batch
        self.epoch += 1
        self.offset = 0

    def state_dict(self) -> Dict[str, Any]:
        """The loader's position: a small JSON-serialisable dict."""
        return {
            "version": LOADER_STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "n_batches": self.n_batches,
            "rng": self._rng.bit_generator.state,
            "n_streams": self.n_streams,
            "n_chars": self.n_chars,
            "reverse": self.reverse,
            "bptt": self.bptt,
            "seed": self.seed,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a position saved by `state_dict`, possibly by a different
        number of workers: the stream layout depends only on the global number of
        streams, which must be the same (`batch_size * world_size` here equals
        `state["n_streams"]`)."""
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"Unsupported loader state version: {state.get('version')!r}")
        if state["n_chars"] != self.n_chars:
            raise ValueError(
                f"The loader state is for a text of {state['n_chars']} characters, this "
                f"text has {self.n_chars}. Resume on the same encoded text."
            )
        if state["n_streams"] != self.n_streams:
            raise ValueError(
                f"The loader state has {state['n_streams']} streams, this loader "
                f"{self.n_streams} (batch_size {self.batch_size} x world_size "
                f"{self.world_size}). Use batch_size = n_streams / world_size "
                f"(see CharLMLoader.batch_size_for)."
            )
        if bool(state["reverse"]) != self.reverse:
            raise ValueError("The loader state is for the other direction (reverse).")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.n_batches = int(state["n_batches"])
        self._rng.bit_generator.state = state["rng"]

    @staticmethod
    def batch_size_for(state: Dict[str, Any], world_size: int) -> int:
        """Per-worker batch size that resumes `state` on `world_size` workers."""
        n_streams = int(state["n_streams"])
        if n_streams % world_size:
            raise ValueError(
                f"Cannot resume {n_streams} streams on {world_size} workers: the number of "
                f"workers must divide the number of streams."
            )
        return n_streams // world_size

    def rows(self, rank: Optional[int] = None) -> slice:
        """The global stream indices read by `rank` (default: this worker)."""
        rank = self.rank if rank is None else rank
        return slice(rank * self.batch_size, (rank + 1) * self.batch_size)
