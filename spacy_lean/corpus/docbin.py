"""Reading and writing .spacy files (spaCy's DocBin format)."""

import zlib
from pathlib import Path
from typing import Iterator, Union

import srsly
from spacy.tokens import Doc, DocBin
from spacy.vocab import Vocab


class CorruptShardError(ValueError):
    """A data file could not be read: it is corrupt, truncated or not in the format
    its name says. The message names the file."""


def read_docbin(path: Union[str, Path]) -> DocBin:
    """Load a .spacy file whole, with an error that names the file when it is not a
    DocBin. Note: DocBin reads and decompresses the whole file; docs are decoded lazily."""
    path = Path(path)
    try:
        return DocBin(store_user_data=True).from_disk(path)
    except (zlib.error, ValueError, KeyError, TypeError, EOFError) as err:
        raise CorruptShardError(
            f"Could not read '{path}' as a .spacy file (DocBin): {type(err).__name__}: "
            f"{err}. The file is corrupt or not a DocBin; re-create it with "
            "DocBin.to_disk, `python -m spacy convert` or `python -m spacy lean shard`."
        ) from err


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
