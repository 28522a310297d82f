"""Sharing corpus files out among workers, and writing a corpus as shards."""

import os
from pathlib import Path
from typing import List, Sequence, Tuple, TypeVar, Union

from spacy.tokens import DocBin

from .docbin import docbin_add
from .sources import CorruptShardError, iter_shard_docs, list_shards

T = TypeVar("T")


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
    one input file is open at a time, read a doc at a time (a .spacy file of any size
    in bounded memory, see `DocBinReader`), and at most one output shard is held in
    memory.

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
    if nlp is None and any(path.suffix == ".jsonl" for path in inputs):
        import spacy

        try:
            nlp = spacy.blank(lang)
        except ImportError as err:  # spaCy's E048: no such language
            raise ValueError(
                f"lang = {lang!r}: spaCy has no such language ({err}). Give a language code "
                "spaCy knows (e.g. en, de, xx for a multi-language tokenizer) for the "
                ".jsonl input."
            ) from None
    made_dir = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    existing = sorted(output_dir.glob(f"{prefix}-*.spacy"))
    if existing:
        raise ValueError(
            f"'{output_dir}' already holds shards ({existing[0].name}, ...). Write to an "
            "empty folder, or use another --prefix."
        )
    if nlp is None:  # only .spacy input: the vocab of any language reads it
        import spacy

        nlp = spacy.blank("xx")
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
    except BaseException as err:
        # A corrupt input file (or Ctrl-C) half-way would leave the shards of the docs
        # before it: a corpus that looks whole, and a folder a rerun refuses to write to.
        _remove_partial(written, output_dir, prefix, made_dir)
        if isinstance(err, ValueError):
            cls = CorruptShardError if isinstance(err, CorruptShardError) else ValueError
            raise cls(
                f"{err} Nothing was written: the {len(written)} shard(s) made before the "
                f"error were removed from '{output_dir}'."
            ) from err
        raise
    finally:
        if bar is not None:
            bar.close()
    if not written and made_dir:
        _remove_partial(written, output_dir, prefix, made_dir)  # no docs: no empty folder
    return written


def _remove_partial(written: List[Path], output_dir: Path, prefix: str, made_dir: bool) -> None:
    """Remove what an interrupted `write_shards` wrote (a shard being written included)."""
    unfinished = output_dir / f"{prefix}-{len(written):05d}.spacy"
    for path in [*written, unfinished]:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    if made_dir:
        try:
            output_dir.rmdir()  # only if empty: never anything but what this call made
        except OSError:
            pass
