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


def test_tiny_transformer_tokenizer_adds_special_tokens_like_bert(tiny_transformer, tmp_path):
    """As BERT's own tokenizers: [CLS] ... [SEP] around every text, so a text of only
    whitespace has two wordpieces (none without them: spacy-transformers then fails)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_transformer))
    ids = tok("Ada visited Port Ambrel .")["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok.convert_ids_to_tokens(tok("   ")["input_ids"]) == ["[CLS]", "[SEP]"]
    bare = synthetic.make_tiny_transformer(tmp_path / "bare", special_tokens=False)
    assert AutoTokenizer.from_pretrained(str(bare))("   ")["input_ids"] == []
