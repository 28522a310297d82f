"""A tiny knowledge base for entity_linker tests: Q1-Q3, where "Ada Lovelace" and
"London" are aliases and "Zed Quux" (Q3) is not, so a doc of only "Zed Quux" has a
linked entity but no KB candidate."""

from spacy.kb import InMemoryLookupKB
from spacy.tokens import Span

ZED = ("Zed Quux waved again .", [(0, 2, "Q3")])
ADA = ("Ada Lovelace met a friend in London .", [(0, 2, "Q1"), (6, 7, "Q2")])
RAIN = ("Rain fell on London all day .", [(3, 4, "Q2")])


def make_linker_kb(vocab):
    kb = InMemoryLookupKB(vocab, entity_vector_length=4)
    for i, vector in enumerate(([1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0])):
        kb.add_entity(entity=f"Q{i + 1}", freq=10, entity_vector=vector)
    kb.add_alias(alias="Ada Lovelace", entities=["Q1", "Q2"], probabilities=[0.6, 0.3])
    kb.add_alias(alias="London", entities=["Q2"], probabilities=[0.9])
    return kb


def set_links(doc, ents, label="PERSON"):
    """Set `ents` ((start, end, KB id) triples) as the doc's entities."""
    doc.ents = [Span(doc, s, e, label=label, kb_id=kb_id) for s, e, kb_id in ents]
    return doc
