"""Generated gold data with every annotation spaCy's built-in scorers read, and a
small tok2vec pipeline with every trainable built-in component, for parity tests
and benchmarks of the score states. Nothing is downloaded."""

import random
from typing import Dict, List, Optional, Sequence, Tuple

from spacy.language import Language
from spacy.tokens import Doc, Span
from spacy.training import Example

# (word, tag, pos, morph, lemma); sentences add (entity label, entity text).
_DETS = [
    ("the", "DT", "DET", "Definite=Def|PronType=Art", "the"),
    ("a", "DT", "DET", "Definite=Ind|PronType=Art", "a"),
]
_NOUNS = [
    ("report", "NN", "NOUN", "Number=Sing", "report"),
    ("reports", "NNS", "NOUN", "Number=Plur", "report"),
    ("council", "NN", "NOUN", "Number=Sing", "council"),
    ("prices", "NNS", "NOUN", "Number=Plur", "price"),
    ("meeting", "NN", "NOUN", "Number=Sing", "meeting"),
    ("teams", "NNS", "NOUN", "Number=Plur", "team"),
]
_VERBS = [
    ("praised", "VBD", "VERB", "Tense=Past|VerbForm=Fin", "praise"),
    ("visits", "VBZ", "VERB", "Number=Sing|Person=3|Tense=Pres|VerbForm=Fin", "visit"),
    ("joined", "VBD", "VERB", "Tense=Past|VerbForm=Fin", "join"),
    ("criticise", "VBP", "VERB", "Tense=Pres|VerbForm=Fin", "criticise"),
    ("left", "VBD", "VERB", "Tense=Past|VerbForm=Fin", "leave"),
]
_ADVS = [
    ("today", "NN", "NOUN", "Number=Sing", "today"),
    ("again", "RB", "ADV", "", "again"),
    ("quietly", "RB", "ADV", "Degree=Pos", "quietly"),
]
_ENTS = {
    "PERSON": ["Ada Lindqvist", "Tomas Okafor", "Mira Sandoval", "Ravi Menon"],
    "ORG": ["Northwind Analytics", "Bluefield Bank", "Quillon Labs"],
    "LOC": ["Veldmark", "Port Ambrel", "Kestrel Bay"],
}
#: The KB id of each entity text (20% of reference entities get "NIL" instead).
ENTITY_IDS = {text: f"Q{i + 1}" for i, text in enumerate(t for ts in _ENTS.values() for t in ts)}
TEXTCAT_LABELS = ("POSITIVE", "NEGATIVE")
MULTILABEL_LABELS = ("SPORT", "POLITICS", "FINANCE")
SPAN_LABELS = ("SUBJ_NP", "OBJ_NP", "EVENT")
SPANS_KEY = "sc"


def _np(rng: random.Random, label: Optional[str]) -> List[Tuple]:
    """A noun phrase: an entity (PROPN tokens) or determiner + noun."""
    if label is not None:
        text = rng.choice(_ENTS[label])
        return [(w, "NNP", "PROPN", "Number=Sing", w, label, text) for w in text.split()]
    det, noun = rng.choice(_DETS), rng.choice(_NOUNS)
    return [det + (None, None), noun + (None, None)]


def _sentence(rng: random.Random):
    """Tokens of one sentence: subject NP, verb, object NP, optional adverb, '.'."""
    subj = _np(rng, rng.choice([None, "PERSON", "ORG"]))
    obj = _np(rng, rng.choice([None, "LOC", "ORG", "PERSON"]))
    verb = rng.choice(_VERBS)
    toks = subj + [verb + (None, None)] + obj
    if rng.random() < 0.5:
        toks.append(rng.choice(_ADVS) + (None, None))
    toks.append((".", ".", "PUNCT", "PunctType=Peri", ".", None, None))
    v = len(subj)
    heads, deps = [], []
    for i, tok in enumerate(toks):
        if i == v:
            heads.append(v)
            deps.append("ROOT")
        elif i < v:
            last = v - 1
            heads.append(v if i == last else last)
            deps.append("nsubj" if i == last else ("det" if tok[2] == "DET" else "compound"))
        elif i <= v + len(obj):
            last = v + len(obj)
            heads.append(v if i == last else last)
            deps.append("dobj" if i == last else ("det" if tok[2] == "DET" else "compound"))
        else:
            heads.append(v)
            deps.append("punct" if tok[0] == "." else "advmod")
    return toks, heads, deps, (0, v), (v + 1, v + 1 + len(obj))


def make_scoring_doc(nlp: Language, rng: random.Random, *, missing: bool = True) -> Doc:
    """A doc of 1-4 sentences with tags, POS, morphs, lemmas, a full parse,
    entities (with KB ids), doc.cats for both textcat kinds and a span group.
    With `missing`, some annotation is left out as real corpora do (never the
    parse: see spaCy's `score_deps` bug in docs/scoring.md)."""
    words, tags, pos, morphs, lemmas, heads, deps = [], [], [], [], [], [], []
    ents, spans = [], []
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        toks, s_heads, s_deps, subj, obj = _sentence(rng)
        off = len(words)
        for tok in toks:
            words.append(tok[0])
            tags.append(tok[1])
            pos.append(tok[2])
            morphs.append(tok[3])
            lemmas.append(tok[4])
        heads.extend(h + off for h in s_heads)
        deps.extend(s_deps)
        i = 0
        while i < len(toks):
            if toks[i][5] is not None:
                j = i
                while j < len(toks) and toks[j][6] == toks[i][6]:
                    j += 1
                ents.append((off + i, off + j, toks[i][5], toks[i][6]))
                i = j
            else:
                i += 1
        spans.append((off + subj[0], off + subj[1], "SUBJ_NP"))
        spans.append((off + obj[0], off + obj[1], "OBJ_NP"))
        if rng.random() < 0.4:  # overlapping span over verb + object
            spans.append((off + subj[1], off + obj[1], "EVENT"))
    spaces = [True] * len(words)
    for k in range(len(words) - 1):
        if words[k + 1] == ".":
            spaces[k] = False
    spaces[-1] = False
    doc = Doc(
        nlp.vocab,
        words=words,
        spaces=spaces,
        tags=tags,
        pos=pos,
        morphs=morphs,
        lemmas=lemmas,
        heads=heads,
        deps=deps,
    )
    doc.ents = [
        Span(doc, s, e, label=label, kb_id=ENTITY_IDS[text] if rng.random() < 0.8 else "NIL")
        for s, e, label, text in ents
    ]
    doc.spans[SPANS_KEY] = [Span(doc, s, e, label=label) for s, e, label in spans]
    pos_label = rng.choice(TEXTCAT_LABELS)
    cats: Dict[str, float] = {label: float(label == pos_label) for label in TEXTCAT_LABELS}
    for label in MULTILABEL_LABELS:
        cats[label] = float(rng.random() < 0.4)
    if missing:
        for tok in doc:
            r = rng.random()
            if r < 0.04:
                tok.tag_ = ""
            elif r < 0.08:
                tok.set_morph(None)
            elif r < 0.10:
                tok.pos_ = ""
            elif r < 0.12:
                tok.lemma_ = ""
        if rng.random() < 0.15:
            del cats[rng.choice(MULTILABEL_LABELS)]
        if rng.random() < 0.1:
            del doc.spans[SPANS_KEY]
        if rng.random() < 0.15 and len(doc.ents):
            ent = doc.ents[0]
            doc.set_ents([e for e in doc.ents if e != ent], missing=[ent])
    doc.cats = cats
    return doc


def make_scoring_docs(nlp: Language, n: int, seed: int = 0, *, missing: bool = True) -> List[Doc]:
    rng = random.Random(seed)
    return [make_scoring_doc(nlp, rng, missing=missing) for _ in range(n)]


def _create_kb(vocab):
    from spacy.kb import InMemoryLookupKB

    kb = InMemoryLookupKB(vocab, entity_vector_length=4)
    rng = random.Random(7)
    for text, qid in ENTITY_IDS.items():
        kb.add_entity(entity=qid, freq=10, entity_vector=[rng.random() for _ in range(4)])
    ids = list(ENTITY_IDS.values())
    for k, (text, qid) in enumerate(ENTITY_IDS.items()):
        other = ids[(k + 1) % len(ids)]
        kb.add_alias(alias=text, entities=[qid, other], probabilities=[0.5, 0.4])
    return kb


def _with_cats(eg: Example, labels: Sequence[str]) -> Example:
    ref = eg.reference.copy()
    ref.cats = {k: v for k, v in eg.reference.cats.items() if k in labels}
    return Example(eg.predicted, ref)


_SMALL_TOK2VEC = {
    "@architectures": "spacy.HashEmbedCNN.v2",
    "pretrained_vectors": None,
    "width": 32,
    "depth": 1,
    "embed_size": 300,
    "window_size": 1,
    "maxout_pieces": 2,
    "subword_features": False,
}

PIPELINE_COMPONENTS = (
    "tagger",
    "morphologizer",
    "trainable_lemmatizer",
    "senter",
    "parser",
    "ner",
    "entity_linker",
    "textcat",
    "textcat_multilabel",
    "spancat",
)


def build_scoring_pipeline(
    nlp: Language, train_docs: Sequence[Doc], n_steps: int = 3, seed: int = 0
) -> Language:
    """Add every trainable built-in component with a small tok2vec to a blank
    `nlp`, initialize on `train_docs` and update `n_steps` times.

    RETURNS (Language): The trained pipeline.
    """
    from thinc.api import fix_random_seed

    fix_random_seed(seed)
    small = {"tok2vec": dict(_SMALL_TOK2VEC)}
    nlp.add_pipe("tagger", config={"model": {"@architectures": "spacy.Tagger.v2", **small}})
    nlp.add_pipe("morphologizer", config={"model": {"@architectures": "spacy.Tagger.v2", **small}})
    nlp.add_pipe(
        "trainable_lemmatizer",
        config={"backoff": "orth", "model": {"@architectures": "spacy.Tagger.v2", **small}},
    )
    nlp.add_pipe("senter", config={"model": {"@architectures": "spacy.Tagger.v2", **small}})
    parser_model = {
        "@architectures": "spacy.TransitionBasedParser.v2",
        "state_type": "parser",
        "extra_state_tokens": False,
        "hidden_width": 16,
        "maxout_pieces": 2,
        "use_upper": True,
        "nO": None,
        **small,
    }
    nlp.add_pipe("parser", config={"model": parser_model})
    ner_model = dict(parser_model, state_type="ner")
    nlp.add_pipe("ner", config={"model": ner_model})
    el = nlp.add_pipe(
        "entity_linker",
        config={
            "incl_prior": True,
            "model": {"@architectures": "spacy.EntityLinker.v2", "nO": None, **small},
        },
    )
    el.set_kb(_create_kb)
    nlp.add_pipe(
        "textcat",
        config={
            "model": {
                "@architectures": "spacy.TextCatBOW.v3",
                "exclusive_classes": True,
                "ngram_size": 1,
                "no_output_layer": False,
                "length": 4096,
                "nO": None,
            }
        },
    )
    nlp.add_pipe(
        "textcat_multilabel",
        config={
            "model": {
                "@architectures": "spacy.TextCatBOW.v3",
                "exclusive_classes": False,
                "ngram_size": 1,
                "no_output_layer": False,
                "length": 4096,
                "nO": None,
            }
        },
    )
    nlp.add_pipe(
        "spancat",
        config={
            "spans_key": SPANS_KEY,
            "model": {
                "@architectures": "spacy.SpanCategorizer.v1",
                "reducer": {"@layers": "spacy.mean_max_reducer.v1", "hidden_size": 16},
                "scorer": {"@layers": "spacy.LinearLogistic.v1", "nO": None, "nI": None},
                "tok2vec": dict(_SMALL_TOK2VEC),
            },
        },
    )
    nlp.config["initialize"]["components"] = {
        "textcat": {"labels": list(TEXTCAT_LABELS), "positive_label": TEXTCAT_LABELS[0]},
    }
    # textcat refuses docs whose cats have several positive labels, so the two
    # classifiers are initialized and updated on their own views of doc.cats.
    examples = [Example(nlp.make_doc(d.text), d) for d in train_docs]
    exclusive = [_with_cats(eg, TEXTCAT_LABELS) for eg in examples]
    multi = [_with_cats(eg, MULTILABEL_LABELS) for eg in examples]
    with nlp.select_pipes(disable=["textcat_multilabel"]):
        optimizer = nlp.initialize(lambda: exclusive)
    multilabel = nlp.get_pipe("textcat_multilabel")
    multilabel.initialize(lambda: multi, nlp=nlp, labels=list(MULTILABEL_LABELS))
    rng = random.Random(seed)
    for _ in range(n_steps):
        idx = rng.sample(range(len(examples)), min(16, len(examples)))
        nlp.update(
            [exclusive[i] for i in idx], sgd=optimizer, drop=0.0, exclude=["textcat_multilabel"]
        )
        multilabel.update([multi[i] for i in idx], sgd=optimizer, drop=0.0)
    return nlp
