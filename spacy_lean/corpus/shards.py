"""Finding corpus files, reading them one shard at a time, and sharing them out
among workers."""

import os
import zlib
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import srsly
from spacy.tokens import Doc, DocBin
from spacy.vocab import Vocab

FORMATS = {".spacy": "spacy", ".jsonl": "jsonl"}
T = TypeVar("T")


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
            f"Corpus path not found: '{path}'. Check the path (e.g. [paths.train] in "
            "your config, or --paths.train on the command line)."
        )
    if path.is_file():
        fmt = detect_format(path)
        if suffix is not None and not path.name.endswith(suffix):
            raise ValueError(
                f"Corpus file '{path}' is {fmt}, but the reader was asked for {suffix} files."
            )
        return [path]
    found = {s: [] for s in FORMATS}  # type: dict
    for root, dirs, files in os.walk(path, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            for s in FORMATS:
                if name.endswith(s):
                    found[s].append(Path(root) / name)
    if suffix is None:
        present = [s for s in FORMATS if found[s]]
        if not present:
            raise ValueError(
                f"No corpus files found in '{path}': expected .spacy or .jsonl files "
                "(folders are walked recursively; names starting with '.' are skipped)."
            )
        if len(present) > 1:
            raise ValueError(
                f"'{path}' holds both .spacy and .jsonl files. Set the reader's "
                "file_format to 'spacy' or 'jsonl' to say which to read."
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


def split_among(items: Sequence[T], rank: int, n: int) -> List[T]:
    """The share of `items` that worker `rank` of `n` takes: every n-th item, starting
    at `rank`. The shares of ranks 0..n-1 are disjoint and together hold every item,
    in the original order within each share; their sizes differ by at most one.

    items (Sequence): e.g. the shard files from `list_shards`.
    rank (int): this worker, 0 <= rank < n.
    n (int): the number of workers.
    RETURNS (List): this worker's items.
    """
    check_rank(rank, n)
    return list(items[rank::n])


def check_rank(rank: int, n: int) -> None:
    if n < 1:
        raise ValueError(f"num_instances must be >= 1, got {n}.")
    if not 0 <= rank < n:
        raise ValueError(f"instance_rank must be in [0, {n - 1}] for {n} instances, got {rank}.")


def default_rank_and_size() -> Tuple[int, int]:
    """This worker's rank and the number of workers: from torch.distributed when it is
    initialised, else from the RANK and WORLD_SIZE environment variables when set,
    else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover
        pass
    rank = os.environ.get("RANK")
    size = os.environ.get("WORLD_SIZE")
    if rank is not None and size is not None:
        try:
            return int(rank), int(size)
        except ValueError:
            raise ValueError(
                f"RANK={rank!r} and WORLD_SIZE={size!r} must be integers, or set "
                "instance_rank and num_instances in the reader's config."
            ) from None
    return 0, 1


def read_docbin(path: Union[str, Path]) -> DocBin:
    """Load a .spacy file, with an error that names the file when it is not a DocBin.
    Note: DocBin reads and decompresses the whole file; docs are decoded lazily."""
    path = Path(path)
    try:
        return DocBin(store_user_data=True).from_disk(path)
    except (zlib.error, ValueError, KeyError, TypeError, EOFError) as err:
        raise ValueError(
            f"Could not read '{path}' as a .spacy file (DocBin): {type(err).__name__}: "
            f"{err}. The file is corrupt or not a DocBin; re-create it with "
            "DocBin.to_disk, `python -m spacy convert` or `python -m spacy lean shard`."
        ) from err


def iter_shard_docs(
    path: Path, vocab: Vocab, jsonl_options: Optional[dict] = None, nlp=None
) -> Iterator[Doc]:
    """Yield the docs of one shard, in stored order (empty docs included)."""
    fmt = detect_format(path)
    if fmt == "spacy":
        doc_bin = read_docbin(path)
        try:
            yield from docbin_docs(doc_bin, vocab)
        except (KeyError, ValueError, IndexError) as err:
            raise ValueError(
                f"Could not decode a doc in '{path}' ({type(err).__name__}: {err}). The "
                "file is corrupt or was written with a different spaCy version."
            ) from err
    else:
        from .jsonl import iter_jsonl_docs

        if nlp is None:
            raise ValueError("Reading .jsonl needs the nlp object (for its tokenizer).")
        yield from iter_jsonl_docs(nlp, path, **(jsonl_options or {}))


_EMPTY_MSGPACK_MAP = b"\x80"


def docbin_docs(doc_bin: DocBin, vocab: Vocab) -> Iterator[Doc]:
    """`doc_bin.get_docs(vocab)` with the docs' user data, decoding only the user data
    of docs that have some (srsly's decoder costs ~2 ms a call, even for an empty map:
    more than decoding the doc)."""
    user_data = doc_bin.user_data
    if not user_data:
        yield from doc_bin.get_docs(vocab)
        return
    doc_bin.user_data = []
    try:
        for i, doc in enumerate(doc_bin.get_docs(vocab)):
            data = user_data[i] if i < len(user_data) else None
            if data and data != _EMPTY_MSGPACK_MAP:
                doc.user_data.update(srsly.msgpack_loads(data, use_list=False))
            yield doc
    finally:
        doc_bin.user_data = user_data


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


def count_shard_docs(path: Path) -> int:
    """How many docs (records) a shard holds."""
    if detect_format(path) == "spacy":
        return len(read_docbin(path))
    n = 0
    with Path(path).open("rb") as f:
        for line in f:
            if line.strip():
                n += 1
    return n


def read_jsonl_lines(path: Path) -> Iterator[Tuple[int, dict]]:
    """(line number, record) for each non-blank line, with errors that name the line."""
    with Path(path).open("r", encoding="utf8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = srsly.json_loads(line)
            except ValueError as err:
                raise ValueError(
                    f"{path}:{i}: not valid JSON ({err}). Each line of a .jsonl corpus "
                    "must be one JSON object."
                ) from err
            yield i, record


def write_shards(
    input_path: Union[str, Path],
    output_dir: Union[str, Path],
    docs_per_shard: int,
    *,
    nlp=None,
    lang: str = "en",
    prefix: str = "shard",
    jsonl_spans_key: str = "sc",
    progress: bool = False,
) -> List[Path]:
    """Re-shard a corpus into .spacy files of `docs_per_shard` docs each, streaming:
    one input file is open at a time and at most one output shard is held in memory
    (a single .spacy input is read whole by DocBin, its docs decoded one by one).

    input_path (str / Path): a .spacy or .jsonl file, or a folder of them.
    output_dir (str / Path): where to write `{prefix}-00000.spacy`, ...; created if
        missing; must not already hold shards with this prefix.
    docs_per_shard (int): docs per output shard (the last may hold fewer).
    nlp (Optional[Language]): tokenizer for .jsonl input; default `spacy.blank(lang)`.
    RETURNS (List[Path]): the shards written, in order.
    """
    if docs_per_shard < 1:
        raise ValueError(f"docs_per_shard must be >= 1, got {docs_per_shard}.")
    inputs = list_shards(input_path)
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"Output path '{output_dir}' exists and is not a folder.")
    output_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(output_dir.glob(f"{prefix}-*.spacy"))
    if existing:
        raise ValueError(
            f"'{output_dir}' already holds shards ({existing[0].name}, ...). Write to an "
            "empty folder, or use another --prefix."
        )
    if nlp is None:
        import spacy

        nlp = spacy.blank(lang)
    written: List[Path] = []
    doc_bin = DocBin(store_user_data=True)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit="doc", desc="Sharding")

    def flush() -> None:
        nonlocal doc_bin
        out = output_dir / f"{prefix}-{len(written):05d}.spacy"
        doc_bin.to_disk(out)
        written.append(out)
        doc_bin = DocBin(store_user_data=True)

    try:
        for path in inputs:
            for doc in iter_shard_docs(path, nlp.vocab, {"spans_key": jsonl_spans_key}, nlp=nlp):
                docbin_add(doc_bin, doc)
                if bar is not None:
                    bar.update(1)
                if len(doc_bin) >= docs_per_shard:
                    flush()
        if len(doc_bin):
            flush()
    finally:
        if bar is not None:
            bar.close()
    return written
