"""Read annotated .jsonl records into Docs.

One JSON object per line:

- "text" (str, required): the text, tokenized with the pipeline's tokenizer.
- "tokens" (list, optional): `[{"text": ..., "ws": bool}, ...]` (Prodigy's form) to
  use a given tokenization instead; it must reproduce "text" exactly.
- "entities" (list, optional): `[start_char, end_char, label]` triples or
  `{"start", "end", "label"}` objects: the doc's entities (`doc.ents`); every other
  token is outside an entity ("O"), so `[]` says the text has none. Without the key
  (or with null) the doc's entity annotation is missing (not scored, not trained).
- "missing" (list, optional): `[start_char, end_char]` pairs (or `{"start", "end"}`
  objects) whose tokens have *missing* entity annotation in a record that has some
  (spaCy's "-" tag: not trained on, neither entity nor "O"). Needs "entities" (or
  "spans" read as entities); may not overlap an entity.
- "spans" (list or dict, optional): a list in the same forms goes to the span group
  named by `spans_key` (default "sc"; `spans_key = "ents"` makes them the entities,
  as Prodigy's NER output needs); a dict maps span-group names to such lists. An
  empty list is annotation too: an empty span group (or, for "ents", no entities).
- "cats" (dict, optional): label -> score, the doc's categories.
- "meta" (dict, optional): kept in `doc.user_data["meta"]`.
- "answer" (str, optional): Prodigy's verdict. A record answered "reject" or "ignore"
  is not gold annotation (a rejected suggestion, a skipped example) and is not read;
  each file says how many it left out (`SkippedRecordsWarning`).

Offsets must fall on token boundaries; a record whose offsets do not raises an error
naming the file, the line and the span.
"""

import math
import warnings
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple, Union

import srsly
from spacy.language import Language
from spacy.tokens import Doc, Span


# Prodigy's answers that mark a record as not annotation to learn from.
NOT_GOLD_ANSWERS = ("reject", "ignore")


class SkippedRecordsWarning(UserWarning):
    """Records of a .jsonl file were left out (Prodigy's "reject"/"ignore" answers)."""


def iter_jsonl_docs(
    nlp: Language,
    path: Union[str, Path],
    *,
    spans_key: str = "sc",
    start: int = 0,
    stop: Optional[int] = None,
) -> Iterator[Doc]:
    """Yield one Doc per record (non-blank line) of a .jsonl file, streaming; records
    answered "reject" or "ignore" (Prodigy) are left out, with one warning per file.

    start, stop (int): read only records start..stop-1 (counted as `count_jsonl_records`
        counts them, left-out records included), for parts of a file.
    """
    skipped = {}
    for index, (line_no, line) in enumerate(_nonblank_lines(Path(path))):
        if index < start:  # not parsed: the lines before a part are only counted
            continue
        if stop is not None and index >= stop:
            break
        record = _parse(path, line_no, line)
        answer = _left_out(record)
        if answer is not None:
            skipped[answer] = skipped.get(answer, 0) + 1
            continue
        where = f"{path}:{line_no}"
        try:
            doc = doc_from_record(nlp, record, where=where, spans_key=spans_key)
        except (KeyError, TypeError, AttributeError, IndexError) as err:
            # A shape doc_from_record does not check: still name the line, not a traceback.
            raise ValueError(
                f"{where}: could not read the record ({type(err).__name__}: {err}). Check it "
                'against the .jsonl record format: "text", "tokens", "entities", "spans", '
                '"cats", "meta".'
            ) from err
        except UnicodeEncodeError as err:
            # A lone surrogate ("\ud83d" escaped alone) is valid JSON but no text.
            bad = err.object[err.start : err.end].encode("unicode_escape").decode("ascii")
            raise ValueError(
                f"{where}: the record holds {bad}, half of a UTF-16 surrogate pair (an "
                "escape such as \\ud83d without its partner), which is not text spaCy can "
                "store. Fix the record (write the character itself, or the whole pair)."
            ) from err
        yield doc
    if skipped:
        counts = " and ".join(f'{n} "{answer}"' for answer, n in sorted(skipped.items()))
        warnings.warn(
            f'{path}: left out {counts} record(s): Prodigy\'s "reject" and "ignore" answers are '
            "not gold annotation. To train on binary (accept/reject) annotation, export it with "
            "Prodigy's data-to-spacy first.",
            SkippedRecordsWarning,
        )


def _left_out(record: Any) -> Optional[str]:
    """The answer ("reject", "ignore") for which a record is not read, else None."""
    answer = record.get("answer") if isinstance(record, dict) else None
    return answer if answer in NOT_GOLD_ANSWERS else None


# The longest line (one record) read: a file without line ends (or a link to a
# device such as /dev/zero) would otherwise be read whole as one line.
MAX_LINE_CHARS = 1 << 26


def _nonblank_lines(path: Path) -> Iterator[Tuple[int, str]]:
    """(line number, line) for each non-blank line, read as text (universal line ends).
    utf-8-sig: a byte order mark (files saved by Windows tools) is not part of line 1."""
    i = 0
    try:
        with Path(path).open("r", encoding="utf-8-sig") as f:
            for i, line in enumerate(iter(lambda: f.readline(MAX_LINE_CHARS + 1), ""), start=1):
                if len(line) > MAX_LINE_CHARS:
                    raise ValueError(
                        f"{path}:{i}: the line is longer than {MAX_LINE_CHARS:,} characters. "
                        "A .jsonl corpus holds one JSON object per line: is this a .jsonl "
                        "file? Split a longer text into several records."
                    )
                if line.strip():
                    yield i, line
    except UnicodeDecodeError as err:
        raise ValueError(_not_utf8(Path(path), err, after=i)) from None


def _not_utf8(path: Path, err: UnicodeDecodeError, after: int) -> str:
    """The message for a file that is not UTF-8, naming the first bad line (found
    again in binary: text mode decodes blocks ahead of the lines it gives)."""
    line_no, bad = after + 1, err.object[err.start : err.end]
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if n > after:
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as line_err:
                    line_no, bad = n, raw[line_err.start : line_err.end]
                    break
    return (
        f"{path}:{line_no}: not valid UTF-8 (byte(s) {bad!r}). A .jsonl corpus must be UTF-8 "
        "text: re-encode the file (e.g. `iconv -f latin1 -t utf-8`)."
    )


def count_jsonl_records(path: Union[str, Path]) -> int:
    """How many records `read_jsonl_lines` yields (non-blank lines), without parsing."""
    return sum(1 for _ in _nonblank_lines(Path(path)))


def count_jsonl_docs(path: Union[str, Path], stop: Optional[int] = None) -> int:
    """How many docs `iter_jsonl_docs` yields: the records less those answered
    "reject" or "ignore" (only lines that mention an answer are parsed), counting no
    further than `stop`."""
    n = 0
    for line_no, line in _nonblank_lines(Path(path)):
        if stop is not None and n >= stop:
            break
        if "answer" in line:
            if _left_out(_parse(path, line_no, line)) is not None:
                continue
        n += 1
    return n


def read_jsonl_lines(path: Path) -> Iterator[Tuple[int, dict]]:
    """(line number, record) for each non-blank line, with errors that name the line."""
    for i, line in _nonblank_lines(path):
        yield i, _parse(path, i, line)


def _parse(path: Union[str, Path], line_no: int, line: str) -> Any:
    try:
        return srsly.json_loads(line)
    except ValueError as err:
        raise ValueError(
            f"{path}:{line_no}: not valid JSON ({err}). Each line of a .jsonl corpus "
            "must be one JSON object."
        ) from err


def doc_from_record(
    nlp: Language, record: Any, *, where: str = "record", spans_key: str = "sc"
) -> Doc:
    """Make a Doc from one JSONL record (see the module docstring for the keys).

    where (str): names the record in error messages (file:line).
    """
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(
            f'{where}: each record must be a JSON object with a string "text" key, '
            f"got {str(record)[:80]!r}."
        )
    text = record["text"]
    tokens = record.get("tokens")
    if tokens == [] and text:
        raise ValueError(
            f'{where}: "tokens" is an empty list, which cannot reproduce the text '
            f'{text[:60]!r}. Give the record\'s tokens, or drop "tokens" to use the '
            "pipeline's tokenizer."
        )
    if tokens:
        if not isinstance(tokens, list) or not all(
            isinstance(t, dict) and isinstance(t.get("text"), str) for t in tokens
        ):
            raise ValueError(
                f'{where}: "tokens" must be a list of {{"text": ..., "ws": true/false}} '
                f'objects, got {str(tokens)[:80]!r}. Fix them, or drop "tokens" to use '
                "the pipeline's tokenizer."
            )
        words = [t["text"] for t in tokens]
        spaces = [bool(t.get("ws", True)) for t in tokens]
        doc = Doc(nlp.vocab, words=words, spaces=spaces)
        if doc.text != text:
            raise ValueError(
                f'{where}: the "tokens" do not reproduce "text" (got {doc.text[:60]!r}). '
                'Fix their "ws" flags, or drop "tokens" to use the pipeline\'s tokenizer.'
            )
    else:
        doc = nlp.make_doc(text)
    # An entity list that is there, even empty, is annotation: every token outside an
    # entity is "O" (as spaCy's Example.from_dict reads "entities": []). Only a record
    # without one leaves the entity annotation missing.
    ents: Optional[List[Span]] = None
    if record.get("entities") is not None:
        ents = _spans(doc, record["entities"], where, "entities")
    spans = record.get("spans")
    if isinstance(spans, dict):
        for key, items in spans.items():
            doc.spans[key] = _spans(doc, items, where, f"spans.{key}")
    elif spans is not None:
        items = _spans(doc, spans, where, "spans")
        if spans_key == "ents":
            ents = (ents or []) + items
        else:
            doc.spans[spans_key] = items
    missing = _missing(doc, record.get("missing"), where)
    if missing and ents is None:
        raise ValueError(
            f'{where}: "missing" marks tokens without entity annotation in a record that has '
            'some, but the record has no "entities": without them every token\'s annotation '
            'is missing already. Add "entities" (an empty list if there are none; or "spans" '
            'read as entities, jsonl_spans_key = "ents"), or drop "missing".'
        )
    for i, span in enumerate(missing):
        for other in missing[:i]:
            if span.start < other.end and other.start < span.end:
                raise ValueError(
                    f"{where}: the missing spans [{other.start_char}, {other.end_char}] and "
                    f"[{span.start_char}, {span.end_char}] overlap. List each run of tokens "
                    'without annotation once in "missing".'
                )
    if ents is not None:
        for span in missing:
            for ent in ents:
                if span.start < ent.end and ent.start < span.end:
                    raise ValueError(
                        f"{where}: the missing span [{span.start_char}, {span.end_char}] "
                        f"({span.text!r}) overlaps the entity [{ent.start_char}, "
                        f"{ent.end_char}, {ent.label_!r}]. A token is either annotated or "
                        "missing: fix the offsets."
                    )
        try:
            doc.set_ents(ents, missing=missing)
        except ValueError as err:
            raise ValueError(
                f"{where}: overlapping entities ({err}). Entities may not overlap; put "
                'overlapping annotation in "spans" instead.'
            ) from err
    cats = record.get("cats")
    if cats is not None:
        if not isinstance(cats, dict):
            raise ValueError(
                f'{where}: "cats" must be an object of label -> score, got {str(cats)[:80]!r}.'
            )
        for label, score in cats.items():
            # A JSON number (true/false read as 1.0/0.0); not a string such as "nan" or
            # "0.5", which float() would take; finite.
            if not isinstance(score, (int, float)) or not math.isfinite(score):
                raise ValueError(
                    f'{where}: "cats" must map each label to a finite number (a score, e.g. '
                    f"1.0 or 0.0), got {score!r} for {label!r}."
                )
        doc.cats.update({str(k): float(v) for k, v in cats.items()})
    if "meta" in record:
        doc.user_data["meta"] = record["meta"]
    return doc


def _spans(doc: Doc, items: Any, where: str, field: str) -> List[Span]:
    if not isinstance(items, list):
        raise ValueError(f'{where}: "{field}" must be a list of [start, end, label].')
    spans = []
    for item in items:
        start, end, label = _triple(item, where, field)
        span: Optional[Span] = doc.char_span(start, end, label=label, alignment_mode="strict")
        if span is None:
            raise ValueError(
                f"{where}: {field} span [{start}, {end}, {label!r}] "
                f"({doc.text[start:end]!r}) does not fall on token boundaries. Fix the "
                'character offsets, or give the record "tokens" that match them.'
            )
        spans.append(span)
    return spans


def _missing(doc: Doc, items: Any, where: str) -> List[Span]:
    """The spans of a record's "missing" list ([start, end] pairs)."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise ValueError(f'{where}: "missing" must be a list of [start, end] pairs.')
    spans = []
    for item in items:
        if isinstance(item, dict) and {"start", "end"} <= set(item):
            start, end = _offset(item["start"]), _offset(item["end"])
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            start, end = _offset(item[0]), _offset(item[1])
        else:
            start = end = None
        if start is None or end is None:
            raise ValueError(
                f'{where}: each item of "missing" must be [start, end] or {{"start", "end"}} '
                f"with whole-number character offsets, got {item!r}."
            )
        span: Optional[Span] = doc.char_span(start, end, alignment_mode="strict")
        if span is None:
            raise ValueError(
                f"{where}: missing span [{start}, {end}] ({doc.text[start:end]!r}) does not "
                "fall on token boundaries. Fix the character offsets, or give the record "
                '"tokens" that match them.'
            )
        spans.append(span)
    return spans


def _triple(item: Any, where: str, field: str):
    if isinstance(item, dict) and {"start", "end", "label"} <= set(item):
        start, end, label = item["start"], item["end"], item["label"]
    elif isinstance(item, (list, tuple)) and len(item) == 3:
        start, end, label = item
    else:
        start = end = None
    start, end = _offset(start), _offset(end)
    if start is not None and end is not None:
        if type(label) is int:  # a numeric label, as written by some tools
            label = str(label)
        if not isinstance(label, str) or not label.strip():
            # spaCy drops a span with label "" from the entities (its tokens become "O",
            # negative training data), and null became the label "None".
            raise ValueError(
                f"{where}: {field} span [{start}, {end}] has the label {label!r}: each span "
                "needs a label (a non-empty string). Fix the label, or drop the span."
            )
        return start, end, label
    raise ValueError(
        f'{where}: each item of "{field}" must be [start, end, label] or '
        f'{{"start", "end", "label"}} with whole-number character offsets, got {item!r}.'
    )


def _offset(value: Any) -> Optional[int]:
    """A character offset: an int, a whole float (3.0) or a string of digits ("3")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value)  # not "²", which isdigit() accepts and int() does not
    return None


def doc_to_record(doc: Doc) -> dict:
    """The JSONL record for a doc (text, tokens, entities, span groups, cats): the
    inverse of `doc_from_record`, for tests and conversions. A doc without entity
    annotation gets no "entities" key; tokens whose annotation is missing in a doc that
    has some (spaCy's "-") go to "missing", one [start, end] pair per run of them."""
    record: dict = {
        "text": doc.text,
        "tokens": [{"text": t.text, "ws": bool(t.whitespace_)} for t in doc],
    }
    if doc.has_annotation("ENT_IOB"):
        record["entities"] = [[e.start_char, e.end_char, e.label_] for e in doc.ents]
        runs: List[List[int]] = []
        for token in doc:
            if token.ent_iob == 0:  # missing
                if runs and runs[-1][2] == token.i - 1:
                    runs[-1][1:] = [token.idx + len(token), token.i]
                else:
                    runs.append([token.idx, token.idx + len(token), token.i])
        if runs:
            record["missing"] = [[start, end] for start, end, _ in runs]
    if doc.spans:
        record["spans"] = {
            key: [[s.start_char, s.end_char, s.label_] for s in group]
            for key, group in doc.spans.items()
        }
    if doc.cats:
        record["cats"] = {k: v for k, v in doc.cats.items() if isinstance(k, str)}
    return record
