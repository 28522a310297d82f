from spacy_lean import synthetic


def test_generated_docs_are_deterministic_and_annotated(blank_nlp):
    a = synthetic.make_ner_docs(blank_nlp, 20, seed=7)
    b = synthetic.make_ner_docs(blank_nlp, 20, seed=7)
    assert [d.text for d in a] == [d.text for d in b]
    assert sum(len(d.ents) for d in a) > 20
    assert all(d.has_annotation("SENT_START") for d in a)
    assert {e.label_ for d in a for e in d.ents} <= set(synthetic.LABELS)


def test_tiny_transformer_loads_in_spacy(trf_ner_nlp):
    doc = trf_ner_nlp("Ada Lindqvist visited Port Ambrel on Tuesday .")
    assert doc._.trf_data is not None
    assert len(doc) == 8
