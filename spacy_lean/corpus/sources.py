"""The one place that reads data: finding the files of a corpus (a .spacy or .jsonl
file, or a folder of them), reading their docs one file at a time, making examples
from them, and fingerprinting them. Training (`spacy-lean.Corpus.v1`), evaluation
(`spacy lean evaluate`, `spacy_lean.evaluate`), its workers and checkpoints, and
`spacy lean shard` all read through here."""

import hashlib
import os
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

from spacy.language import Language
from spacy.tokens import Doc
from spacy.training import Corpus, Example
from spacy.vocab import Vocab

from .docbin import CorruptShardError, DocBinReader
from .jsonl import count_jsonl_docs, count_jsonl_records, iter_jsonl_docs

__all__ = [
    "CorruptShardError",
    "FORMATS",
    "count_shard_docs",
    "count_gold_docs",
    "detect_format",
    "iter_shard_docs",
    "list_shards",
    "MixedFormatsError",
    "path_fingerprint",
    "read_examples",
]

FORMATS = {".spacy": "spacy", ".jsonl": "jsonl"}


class MixedFormatsError(ValueError):
    """A corpus folder holds both .spacy and .jsonl files (which to read is a choice)."""


def check_regular_file(file_: Path, folder: Union[str, Path]) -> None:
    """Refuse a corpus file of `folder` that is not a regular file: a symbolic link to
    nothing, or a device, pipe or socket (a link to /dev/zero was read as one endless
    line). RAISES ValueError naming the file and the fix."""
    if file_.is_symlink() and not file_.exists():
        raise ValueError(
            f"Corpus folder '{folder}' holds '{file_}', a symbolic link to "
            f"'{os.readlink(file_)}', which does not exist. Remove the link, or restore the "
            "file it points to."
        )
    if not file_.is_file():
        raise ValueError(
            f"Corpus folder '{folder}' holds '{file_}', which is not a regular file (a "
            "device, pipe or socket, or a link to one). Remove it."
        )


def list_shards(path: Union[str, Path], suffix: Optional[str] = None) -> List[Path]:
    """The corpus files at `path`, in the order spaCy reads them: `path` itself when
    it is a file, else every file below it (recursively, skipping names that start
    with "."), sorted.

    path (str / Path): a .spacy or .jsonl file, or a folder of them.
    suffix (Optional[str]): ".spacy" or ".jsonl"; None infers it from what is there.
    RETURNS (List[Path]): the files.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"Corpus path not found: '{path}'. Check the path: the data argument of the "
            "command, or the reader's path in a training config ([paths.train], [paths.dev]; "
            "--paths.train on the command line)."
        )
    if not path.is_file() and not path.is_dir():
        raise ValueError(
            f"Corpus path '{path}' is not a regular file or a folder (a device, pipe or "
            "socket, or a link to one). Give a .spacy or .jsonl file, or a folder of them."
        )
    if path.is_file():
        fmt = detect_format(path)
        if suffix is not None and not path.name.endswith(suffix):
            raise ValueError(
                f"Corpus file '{path}' is {fmt}, but the reader was asked for {suffix} files."
            )
        return [path]
    found = {s: [] for s in FORMATS}  # type: dict
    # The real folders above each folder walked: a symbolic link back to one of them
    # would be walked again and again (about 40 times each, or forever with two).
    above = {str(path): {os.path.realpath(path)}}
    for root, dirs, files in os.walk(path, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        chain = above.pop(root)
        for d in dirs:
            real = os.path.realpath(os.path.join(root, d))
            if real in chain:
                raise ValueError(
                    f"Corpus folder '{path}' holds a symbolic link loop: "
                    f"'{os.path.join(root, d)}' leads back to '{real}'. Remove the link."
                )
            above[os.path.join(root, d)] = chain | {real}
        for name in files:
            if name.startswith("."):
                continue
            for s in FORMATS:
                if name.endswith(s):
                    file_ = Path(root) / name
                    check_regular_file(file_, path)
                    found[s].append(file_)
    if suffix is None:
        present = [s for s in FORMATS if found[s]]
        if not present:
            raise ValueError(
                f"No corpus files found in '{path}': expected .spacy or .jsonl files "
                "(folders are walked recursively; names starting with '.' are skipped)."
            )
        if len(present) > 1:
            raise MixedFormatsError(
                f"'{path}' holds both .spacy and .jsonl files. Set the reader's "
                "file_format to 'spacy' or 'jsonl' to say which to read (on the command "
                "line: give the path of one file, or of a folder holding one kind)."
            )
        suffix = present[0]
    elif suffix not in FORMATS:
        raise ValueError(f"Unknown corpus format {suffix!r}: use '.spacy' or '.jsonl'.")
    if not found[suffix]:
        raise ValueError(f"No {suffix} files found in '{path}'.")
    return sorted(found[suffix])


def detect_format(path: Union[str, Path]) -> str:
    """'spacy' or 'jsonl', from a file's suffix."""
    path = Path(path)
    for suffix, fmt in FORMATS.items():
        if path.name.endswith(suffix):
            return fmt
    raise ValueError(
        f"Unknown corpus format for '{path}': expected a .spacy file (DocBin), a .jsonl "
        'file (one JSON object with a "text" key per line) or a folder of them. '
        "Convert other formats with `python -m spacy convert`."
    )


def iter_shard_docs(
    path: Union[str, Path],
    vocab: Vocab,
    jsonl_options: Optional[dict] = None,
    nlp: Optional[Language] = None,
    *,
    part: Tuple[int, int] = (0, 1),
    strings_per_doc: bool = False,
) -> Iterator[Doc]:
    """Yield the docs of one data file, in stored order (empty docs included), one at
    a time: a .spacy file of any size is read in bounded memory (`DocBinReader`).

    path (str / Path): a .spacy or .jsonl file.
    vocab (Vocab): the vocab the docs are made with.
    jsonl_options (Optional[dict]): keyword arguments for `iter_jsonl_docs`.
    nlp (Optional[Language]): the tokenizer, needed for .jsonl files.
    part (Tuple[int, int]): (k, n): only the k-th of n contiguous, near-equal parts
        of the file's stored docs (the parts of k = 0..n-1 hold every doc once).
    strings_per_doc (bool): a .spacy file's docs bring only their own strings into the
        vocab, as they are read (`DocBinReader.get_docs`), for memory zones.
    RAISES (CorruptShardError): the file cannot be read; the message names it.
    """
    path = Path(path)
    k, n = part
    if not 0 <= k < n:
        raise ValueError(f"part must be (k, n) with 0 <= k < n, got {part}.")
    if detect_format(path) == "jsonl" and nlp is None:
        raise ValueError("Reading .jsonl needs the nlp object (for its tokenizer).")
    docs = _raw_docs(path, vocab, jsonl_options, nlp, part, strings_per_doc)
    while True:
        try:
            doc = next(docs)
        except StopIteration:
            return
        except CorruptShardError:
            raise
        except (ValueError, OSError) as err:
            raise CorruptShardError(str(err)) from err
        yield doc


def _part_bounds(n_docs: int, part: Tuple[int, int]) -> Tuple[int, int]:
    k, n = part
    return (n_docs * k) // n, (n_docs * (k + 1)) // n


def _raw_docs(
    path: Path,
    vocab: Vocab,
    jsonl_options: Optional[dict],
    nlp: Optional[Language],
    part: Tuple[int, int],
    strings_per_doc: bool = False,
) -> Iterator[Doc]:
    if detect_format(path) == "jsonl":
        # Parts are cut in records as stored (left-out ones included), as counted.
        start, stop = _part_bounds(count_shard_docs(path), part) if part != (0, 1) else (0, None)
        yield from iter_jsonl_docs(
            nlp, path, **(jsonl_options or {}), start=start, stop=stop  # type: ignore[arg-type]
        )
        return
    with DocBinReader(path) as reader:
        start, stop = _part_bounds(len(reader), part)
        yield from reader.get_docs(vocab, start, stop, strings_per_doc=strings_per_doc)


def count_gold_docs(path: Union[str, Path], stop: Optional[int] = None) -> int:
    """How many docs reading a data file gives (`iter_shard_docs`), empty ones
    included: a .jsonl file's records less those left out (Prodigy's "reject" and
    "ignore"). Counts no further than `stop`."""
    path = Path(path)
    if detect_format(path) == "spacy":
        n = count_shard_docs(path)
        return n if stop is None else min(n, stop)
    return count_jsonl_docs(path, stop)


def count_shard_docs(path: Union[str, Path]) -> int:
    """How many docs (records) a data file holds, empty ones included. A .spacy file
    is inflated (not decoded) to find out; a .jsonl file's lines are counted."""
    path = Path(path)
    if detect_format(path) == "spacy":
        with DocBinReader(path) as reader:
            return len(reader)
    return count_jsonl_records(path)


def read_examples(
    nlp: Language,
    shards: Iterable[Union[str, Path]],
    *,
    gold_preproc: bool = False,
    part: Tuple[int, int] = (0, 1),
    counts: Optional[Dict[str, int]] = None,
) -> "ExampleStream":
    """Yield evaluation examples from data files, reading one file at a time, made as
    `spacy evaluate` makes them (`spacy.Corpus`, no length limit; empty docs skipped).

    nlp (Language): the pipeline (vocab and tokenizer).
    shards (Iterable[Path]): files from `list_shards`.
    gold_preproc (bool): use gold tokens and sentences, as `spacy evaluate -G`.
    part (Tuple[int, int]): (k, n): yield only the examples of the k-th of n
        contiguous, near-equal parts of each file's stored docs (splits one file among
        workers; each part is read in bounded memory, the parts hold every example once).
    counts (Optional[Dict[str, int]]): if given, "empty_docs" counts the docs skipped
        for having no tokens, as they are read (so that the caller can say so: spaCy
        skips them in silence).
    RETURNS (ExampleStream): an iterator of the examples, which says when it holds
        docs (the streaming evaluator then reads it in memory zones).
    """
    return ExampleStream(nlp, shards, gold_preproc=gold_preproc, part=part, counts=counts)


class ExampleStream:
    """The examples `read_examples` yields, one stored doc at a time; `holds_docs()`
    is true while examples of the latest doc are still to come (`gold_preproc` makes
    one per sentence), so a memory zone may end only between docs."""

    def __init__(
        self,
        nlp: Language,
        shards: Iterable[Union[str, Path]],
        *,
        gold_preproc: bool = False,
        part: Tuple[int, int] = (0, 1),
        counts: Optional[Dict[str, int]] = None,
    ) -> None:
        if counts is not None:
            counts.setdefault("empty_docs", 0)
        self._held = 0
        self._strings_per_doc = False
        self._iter = self._examples(nlp, shards, gold_preproc, part, counts)

    def __iter__(self) -> "ExampleStream":
        return self

    def __next__(self) -> Example:
        return next(self._iter)

    def holds_docs(self) -> bool:
        """Whether examples made from an already-read doc are still to come."""
        return self._held > 0

    def use_memory_zones(self) -> None:
        """Called by the streaming evaluator before it reads in memory zones: .spacy
        files opened from now on bring each doc's own strings into the vocab as it is
        read, not the whole string table first (`DocBinReader.get_docs`)."""
        self._strings_per_doc = True

    def _examples(self, nlp, shards, gold_preproc, part, counts) -> Iterator[Example]:
        for shard in shards:
            shard = Path(shard)
            corpus = Corpus(shard, gold_preproc=gold_preproc)
            make = corpus.make_examples_gold_preproc if gold_preproc else corpus.make_examples
            docs = iter_shard_docs(
                shard, nlp.vocab, nlp=nlp, part=part, strings_per_doc=self._strings_per_doc
            )
            for doc in docs:
                if not len(doc):
                    if counts is not None:
                        counts["empty_docs"] += 1
                    continue
                examples = list(make(nlp, [doc]))
                del doc
                while examples:
                    self._held = len(examples) - 1
                    yield examples.pop(0)
                self._held = 0


def path_fingerprint(paths: Iterable[Union[str, Path]], sample_bytes: int = 1 << 20) -> str:
    """A hash of files (or folders, walked) from their names, sizes and contents, for
    checkpoints: resuming on other data is refused.

    Files up to 8 x `sample_bytes` are hashed whole; larger ones by their size and
    their first, middle and last `sample_bytes`.

    paths (Iterable[Path]): files or folders.
    sample_bytes (int): bytes hashed per sample of a large file.
    RETURNS (str): a hex digest.
    """
    digest = hashlib.sha256()
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            rel = path.name if path == root else path.relative_to(root).as_posix()
            size = path.stat().st_size
            digest.update(f"{rel}\0{size}\0".encode("utf8"))
            with path.open("rb") as file_:
                if size <= 8 * sample_bytes:
                    for chunk in iter(lambda: file_.read(sample_bytes), b""):
                        digest.update(chunk)
                else:
                    for offset in (0, size // 2, size - sample_bytes):
                        file_.seek(offset)
                        digest.update(file_.read(sample_bytes))
    return digest.hexdigest()
