"""Docs shaped unlike the generated corpora, for the audit's regression tests: an
empty doc, whitespace-only docs, one long doc with no sentence boundaries and
entities near a cut, missing ("-") and unset entity annotation, overlapping spans,
cats, and CJK, right-to-left, emoji and combining-character text."""

from typing import List

from spacy.language import Language
from spacy.tokens import Doc, Span

from spacy_lean import synthetic


def make_messy_docs(nlp: Language) -> List[Doc]:
    docs = []
    for doc in synthetic.make_ner_docs(nlp, 4, seed=11):
        doc.cats = {"POS": 1.0, "NEG": 0.0}
        doc.spans["sc"] = [Span(doc, e.start, e.end, label=e.label_) for e in doc.ents]
        doc.spans["sc"].append(Span(doc, 0, 3, label="OVER"))  # overlaps an entity span
        docs.append(doc)
    docs.append(Doc(nlp.vocab, words=[]))  # empty
    docs.append(nlp.make_doc("   \n\n  \t "))  # whitespace only
    long_doc = Doc(nlp.vocab, words=[f"w{i}" for i in range(300)])  # no sentence boundaries
    long_doc.ents = [Span(long_doc, 125, 131, label="ORG"), Span(long_doc, 250, 252, label="PER")]
    long_doc.spans["sc"] = [Span(long_doc, 120, 135, label="LONG")]
    long_doc.cats = {"POS": 0.0, "NEG": 1.0}
    docs.append(long_doc)
    words = "Alice went to Paris and met Bob there .".split()
    iob = ["B-PER", "O", "O", None, None, "O", "B-PER", None, "O"]  # None: missing ("-")
    docs.append(Doc(nlp.vocab, words=words, ents=iob))
    docs.append(Doc(nlp.vocab, words="No annotation here at all .".split()))  # unset
    for text, ents in [
        ("東京 は 日本 の 首都 です 。", [("東京", "LOC"), ("日本", "LOC")]),
        ("שלום עולם من القاهرة إلى تل أبيب", [("القاهرة", "LOC"), ("تل أبيب", "LOC")]),
        ("Family 👩‍👩‍👧 went to Café Zoë ’s place 🎉🎉", [("Café Zoë", "ORG")]),
        (
            "Rene\u0301 Ma\u0308gritte painted in Bruxelles",
            [("Rene\u0301 Ma\u0308gritte", "PER"), ("Bruxelles", "LOC")],
        ),
    ]:
        doc = nlp.make_doc(text)
        doc.ents = [
            doc.char_span(text.find(w), text.find(w) + len(w), label=label) for w, label in ents
        ]
        doc.cats = {"POS": 0.0, "NEG": 1.0}
        docs.append(doc)
    return docs


def signature(doc: Doc) -> dict:
    """Everything the audit compares: tokens, whitespace, entity annotation (missing
    included), span groups, cats, sentence starts."""
    return {
        "words": [t.text for t in doc],
        "ws": [t.whitespace_ for t in doc],
        "iob": [(t.ent_iob_, t.ent_type_, t.ent_kb_id_) for t in doc],
        "spans": {k: [(s.start, s.end, s.label_) for s in g] for k, g in doc.spans.items()},
        "cats": dict(doc.cats),
        "sents": [t.is_sent_start for t in doc],
    }
