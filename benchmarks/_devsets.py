"""Dev sets for the evaluation benchmarks: a base set of docs tiled to each size,
written as one .spacy file and as a folder of shards (each written only once)."""

import shutil
from pathlib import Path
from typing import Dict, Sequence


def write_tiled(
    base, sizes: Sequence[int], work: Path, stem: str, shard_docs: int
) -> Dict[int, Dict[str, Path]]:
    """Write `dev_{size}_{stem}.spacy` and `dev_{size}_{stem}_shards/` for each size.

    base (List[Doc]): the docs to tile (doc i of a set is base[i % len(base)]).
    RETURNS (Dict[int, Dict[str, Path]]): {size: {"file": Path, "shards": Path}}.
    """
    from spacy.tokens import DocBin

    out: Dict[int, Dict[str, Path]] = {}
    for size in sizes:
        docs = [base[i % len(base)] for i in range(size)]
        single = work / f"dev_{size}_{stem}.spacy"
        if not single.exists():
            DocBin(docs=docs).to_disk(single)
        folder = work / f"dev_{size}_{stem}_shards"
        if not folder.exists():
            tmp = folder.with_name(folder.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for k in range(0, size, shard_docs):
                DocBin(docs=docs[k : k + shard_docs]).to_disk(tmp / f"{k // shard_docs:05d}.spacy")
            tmp.rename(folder)
        out[size] = {"file": single, "shards": folder}
    return out
