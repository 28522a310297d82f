"""Make the project's NER corpus: train, dev and test .spacy files.

The default dataset, "generated", writes a synthetic corpus with spacy-lean's
generator (multi-sentence documents, long-tailed lengths, 4 entity types, a few
very long documents), so the project runs offline. "conll2003" and "wnut17"
convert the optional assets (fetch them first with
`spacy project assets --extra`); any other value is read as a directory that
holds train/dev/test files: .spacy, .jsonl (spacy-lean's reader's formats:
docs/corpus.md) or CoNLL/IOB columns (IOB tags; BIOES/BILUO tags are converted).
"""

import hashlib
import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Dict, List

import spacy
import typer
from spacy.tokens import DocBin
from spacy.training.converters import conll_ner_to_docs
from spacy.vocab import Vocab
from wasabi import msg

from spacy_lean.corpus.sources import iter_shard_docs
from spacy_lean.synthetic import write_ner_corpus

SPLITS = ("train", "dev", "test")
# Files of the optional project assets, by dataset and split (see project.yml),
# with the size and SHA-256 of the files at the pinned URLs.
ASSET_FILES = {
    "conll2003": {
        "train": "assets/conll2003/train.txt",
        "dev": "assets/conll2003/valid.txt",
        "test": "assets/conll2003/test.txt",
    },
    "wnut17": {
        "train": "assets/wnut17/wnut17train.conll",
        "dev": "assets/wnut17/emerging.dev.conll",
        "test": "assets/wnut17/emerging.test.annotated",
    },
}
ASSET_SHA256 = {
    "assets/conll2003/train.txt": (
        3283418,
        "c99b26852dabf57ca9d30a0e892b84544cc8962003151e14a71077c55dc66db5",
    ),
    "assets/conll2003/valid.txt": (
        827441,
        "f1f6469322876887de1d04acd43c59b02f59d5b02acf42c027132fa1bf349cb2",
    ),
    "assets/conll2003/test.txt": (
        748093,
        "82e0c72d262f86ad3e78b15c5d980bbf87cb205aa4bf6d2d97643f463f8d7ff7",
    ),
    "assets/wnut17/wnut17train.conll": (
        493781,
        "731820e13f71af324c6b55a1575ec2ce59fbaa2a0806f8f0400b98d56cd6a7a5",
    ),
    "assets/wnut17/emerging.dev.conll": (
        114749,
        "e053b752b8155113ca66e7db08af5f2f5f43ab993694e4774f1ec5bad42312d8",
    ),
    "assets/wnut17/emerging.test.annotated": (
        192425,
        "2aa79b764e56ec9264a1b30fdd9b70195bd00ff400b62edd8f399d5f13c178f0",
    ),
}
# What spaCy's CoNLL converter takes as a document boundary.
DOC_DELIMITER = "-DOCSTART- -X- O O"
COLUMN_SUFFIXES = (".iob", ".iob2", ".conll", ".txt", ".tsv", ".annotated")
DATA_SUFFIXES = (".spacy", ".jsonl", *COLUMN_SUFFIXES)
# An NER tag spaCy's converter reads (IOB: O, B-X, I-X), or one of BIOES / BILUO, which
# is converted to IOB first (E- and L- continue an entity, S- and U- are one alone).
IOB_TAG = re.compile(r"^(O|[BI]-\S+)$")
TO_IOB = {"E": "I", "L": "I", "S": "B", "U": "B"}
OTHER_TAG = re.compile(r"^([ELSU])-(\S+)$")


def main(
    dataset: str = typer.Argument(..., help="'generated', 'conll2003', 'wnut17' or a directory"),
    output_dir: Path = typer.Argument(..., help="Where to write {train,dev,test}.spacy"),
    n_train: int = typer.Option(800, "--n-train", help="Generated train documents"),
    n_dev: int = typer.Option(150, "--n-dev", help="Generated dev documents"),
    n_test: int = typer.Option(150, "--n-test", help="Generated test documents"),
    long_doc_rate: float = typer.Option(
        0.03, "--long-doc-rate", help="Share of very long generated documents"
    ),
    n_sents: int = typer.Option(
        10, "--n-sents", help="Sentences per document when converting files without -DOCSTART-"
    ),
    seed: int = typer.Option(0, "--seed", help="Random seed of the generator"),
    lang: str = typer.Option("en", "--lang", help="Language of the generated corpus"),
):
    """Write train/dev/test .spacy files and corpus statistics (stats.json)."""
    if n_sents < 0:
        msg.fail(
            f"--n-sents (--vars.n_sents_per_doc) must be >= 0, got {n_sents} (0: as the "
            "files' -DOCSTART- lines, or one document per file without them)",
            exits=1,
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    outputs = {split: output_dir / f"{split}.spacy" for split in SPLITS}
    if dataset == "generated":
        sizes = {"train": n_train, "dev": n_dev, "test": n_test}
        for i, split in enumerate(SPLITS):
            if sizes[split] < 1:
                msg.fail(f"--n-{split} must be >= 1, got {sizes[split]}", exits=1)
            write_ner_corpus(
                outputs[split], sizes[split], seed=seed + i, lang=lang, long_doc_rate=long_doc_rate
            )
    else:
        if Path(dataset).is_dir() and Path(dataset).resolve() == output_dir.resolve():
            msg.fail(
                f"The dataset folder {dataset} is the folder this step writes to: its "
                "train/dev/test .spacy files would sit beside your files (and be read as "
                "a second file for each split next time). Put your files in another folder.",
                exits=1,
            )
        sources = _find_sources(dataset)
        # Every split converted before any is replaced: a file that fails leaves the
        # corpus as it was, not a new train.spacy beside the old dev and test.
        pending = {split: output_dir / f".{split}.spacy.part" for split in SPLITS}
        try:
            for split in SPLITS:
                _convert(sources[split], pending[split], n_sents, lang)
            for split in SPLITS:
                pending[split].replace(outputs[split])
        finally:
            for path in pending.values():
                path.unlink(missing_ok=True)
    stats = {split: _stats(outputs[split]) for split in SPLITS}
    stats["dataset"] = dataset
    (output_dir / "stats.json").write_text(json.dumps(stats, indent=2), encoding="utf8")
    for split in SPLITS:
        s = stats[split]
        msg.good(
            f"{split}: {s['docs']} docs, {s['tokens']} tokens, {s['ents']} entities, "
            f"longest doc {s['max_doc_tokens']} tokens -> {outputs[split]}"
        )


def _find_sources(dataset: str) -> Dict[str, Path]:
    if dataset in ASSET_FILES:
        sources = {split: Path(path) for split, path in ASSET_FILES[dataset].items()}
        missing = [str(p) for p in sources.values() if not p.exists()]
        if missing:
            msg.fail(
                f"Dataset '{dataset}' needs the optional assets {', '.join(missing)}",
                "Fetch them with: python -m spacy project assets --extra "
                "(needs network access), then run this step again.",
                exits=1,
            )
        for path in ASSET_FILES[dataset].values():
            _check_asset(path)
        return sources
    root = Path(dataset)
    if not root.is_dir():
        msg.fail(
            f"Unknown dataset '{dataset}'",
            "Use 'generated', 'conll2003', 'wnut17' or a directory with train/dev/test "
            f".spacy (or CoNLL/IOB) files; a relative path is read from {Path.cwd()} "
            "(the project directory, under `spacy project run`).",
            exits=1,
        )
    sources = {}
    for split in SPLITS:
        names = [split] + (["valid", "validation"] if split == "dev" else [])
        entries = [p for p in sorted(root.iterdir()) if p.stem in names or p.name in names]
        found = [p for p in entries if p.is_file() and p.suffix in DATA_SUFFIXES]
        if len(found) > 1:
            msg.fail(
                f"{len(found)} {split} files in {root}: {', '.join(p.name for p in found)}",
                "Keep one of them there (move the others out): this step would not know "
                "which to read.",
                exits=1,
            )
        if not found:
            folders = [p.name for p in entries if p.is_dir()]
            hint = (
                f" A folder of shards ({', '.join(folders)}) is read by the training "
                "reader, not by this step: point a config's [paths] at it with `spacy "
                "train` or `spacy lean train` yourself, or put its docs in one file."
                if folders
                else ""
            )
            msg.fail(
                f"No {split} file in {root} (expected one of {', '.join(names)} ending in "
                f"{', '.join(DATA_SUFFIXES)}).{hint}",
                exits=1,
            )
        sources[split] = found[0]
    return sources


def _check_asset(path: str) -> None:
    """Warn when an asset is not the file the project lists (another copy may be fine)."""
    size, sha256 = ASSET_SHA256[path]
    data = Path(path).read_bytes()
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        msg.warn(
            f"{path} differs from the listed asset ({size} bytes, sha256 {sha256[:12]}...): "
            "results will not be comparable with published ones."
        )
    else:
        msg.good(f"Checked {path} (sha256 {sha256[:12]}...)")


def _convert(source: Path, output: Path, n_sents: int, lang: str) -> None:
    if source.suffix in (".spacy", ".jsonl"):
        # Read as the training reader reads it, strictly: a .spacy file with data after
        # its DocBin (two files joined) or a .jsonl record that does not align fails
        # here, naming the file, not one step later naming the project's copy.
        nlp = spacy.blank(lang) if source.suffix == ".jsonl" else None
        vocab = nlp.vocab if nlp is not None else Vocab()
        doc_bin = DocBin(store_user_data=True) if nlp is not None else None
        n_docs = 0
        try:
            for doc in iter_shard_docs(source, vocab, nlp=nlp):
                n_docs += 1
                if doc_bin is not None:
                    doc_bin.add(doc)
        except (ValueError, OSError) as err:
            # The reader's messages name the file themselves.
            message = str(err) if str(source) in str(err) else f"Could not read {source}: {err}"
            msg.fail(message, exits=1)
        if not n_docs:
            msg.fail(f"No documents in {source}", exits=1)
        if doc_bin is not None:
            doc_bin.to_disk(output)
        else:
            shutil.copyfile(source, output)
        return
    try:
        # utf-8-sig: a byte order mark (Windows editors) is not part of the first line.
        text = source.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        msg.fail(f"{source} is not UTF-8 text: {err}", exits=1)
    # CoNLL-2003 files write the boundary with 4 columns ("-DOCSTART- -X- -X- O");
    # spaCy's converter only knows its own spelling of it. It also ends sentences at
    # empty lines only: a blank line holding spaces or tabs is made empty.
    lines = [
        DOC_DELIMITER if ln.startswith("-DOCSTART-") else ln if ln.strip() else ""
        for ln in text.split("\n")
    ]
    _check_columns(source, lines)
    lines = _to_iob(source, lines)
    doc_bin = DocBin(store_user_data=True)
    try:
        for doc in conll_ner_to_docs("\n".join(lines), n_sents=n_sents, no_print=True):
            doc_bin.add(doc)
    except ValueError as err:
        msg.fail(f"Could not convert {source}: {err}", exits=1)
    if not len(doc_bin):
        msg.fail(f"No documents in {source}", exits=1)
    # With --n-sents 0 and no -DOCSTART- line, spaCy's converter finds the sentences
    # itself (its sentencizer); otherwise a file without empty lines is one sentence.
    segmented = n_sents == 0 and DOC_DELIMITER not in lines
    if not segmented and not _has_sentence_breaks(lines):
        # spaCy's converter says so too, but only where it may print (not here).
        n_tokens = sum(1 for ln in lines if ln and ln != DOC_DELIMITER)
        msg.warn(
            f"{source} has no empty line between sentences: its {n_tokens:,} tokens are one "
            "sentence (the training reader cuts long docs at max_length, not at sentence "
            "ends). Separate sentences with empty lines if the data has them."
        )
    doc_bin.to_disk(output)


def _check_columns(source: Path, lines: List[str]) -> None:
    """Fail naming the line where spaCy's converter would fail without saying where:
    a token line needs a word and a tag, and the lines of a sentence the same columns
    (the converter zips them: past a shorter line it reads another column as the tags)."""
    first = None
    for i, line in enumerate(lines, start=1):
        n_cols = len(line.split())
        if n_cols == 0 or line == DOC_DELIMITER:
            first = None
            continue
        if n_cols < 2:
            msg.fail(
                f"{source}, line {i}: a token line needs the word and its tag, "
                f"separated by whitespace (a word that is whitespace cannot be read): {line!r}",
                exits=1,
            )
        if first is None:
            first = (i, n_cols)
        elif n_cols != first[1]:
            msg.fail(
                f"{source}, line {i}: {n_cols} columns, but line {first[0]} of the same "
                f"sentence has {first[1]}: {line!r}",
                exits=1,
            )


def _has_sentence_breaks(lines: List[str]) -> bool:
    """Whether an empty line stands between two token lines of one document."""
    token_before = blank_after_token = False
    for line in lines:
        if line == DOC_DELIMITER:
            token_before = blank_after_token = False
        elif not line:
            blank_after_token = token_before
        elif blank_after_token:
            return True
        else:
            token_before = True
    return False


def _to_iob(source: Path, lines: List[str]) -> List[str]:
    """The token lines' NER tags (the last column, as spaCy's converter reads it) in
    IOB: BIOES / BILUO tags converted, anything else refused naming the line. spaCy's
    converter cuts every tag to its label after two characters: tags without a B-/I-
    prefix ("PER", IO tagging) or a POS column last ("NNP") became entities labelled
    "R" or "P", and E- tags split entities, with nothing said."""
    out = []
    for i, line in enumerate(lines, start=1):
        cols = line.split()
        if not cols or line == DOC_DELIMITER:
            out.append(line)
            continue
        tag = cols[-1]
        if IOB_TAG.match(tag):
            out.append(line)
            continue
        other = OTHER_TAG.match(tag)
        if other is None:
            msg.fail(
                f"{source}, line {i}: {tag!r} is not an NER tag this step reads: the last "
                "column must be O, B-LABEL or I-LABEL (IOB), or E-/S- (BIOES) or L-/U- "
                f"(BILUO), which are converted: {line!r}",
                "Tags without a prefix (IO tagging: PER PER O) need one: B- for an "
                "entity's first token, I- for the others. A file whose last column is not "
                "the NER tag needs its columns reordered.",
                exits=1,
            )
        out.append(" ".join([*cols[:-1], f"{TO_IOB[other.group(1)]}-{other.group(2)}"]))
    return out


def _stats(path: Path) -> Dict[str, object]:
    lengths: List[int] = []
    labels: Counter = Counter()
    for doc in DocBin().from_disk(path).get_docs(Vocab()):
        lengths.append(len(doc))
        labels.update(ent.label_ for ent in doc.ents)
    lengths.sort()
    return {
        "docs": len(lengths),
        "tokens": sum(lengths),
        "ents": sum(labels.values()),
        "ents_per_label": dict(sorted(labels.items())),
        "median_doc_tokens": lengths[len(lengths) // 2] if lengths else 0,
        "max_doc_tokens": lengths[-1] if lengths else 0,
    }


if __name__ == "__main__":
    typer.run(main)
