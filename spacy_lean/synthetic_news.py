"""A generated news-like NER corpus, for accuracy benchmarks that should behave like
CoNLL-2003 rather than like a toy.

What makes it look real (and makes the task learnable but not trivial):

- documents of several sentences, 100-400 tokens for most, with a long tail (a few
  over 1,000), an optional all-caps headline and a dateline, short score lines
  ("Kestrel 3 Dunmore 1") as well as long reported-speech sentences;
- four entity types at CoNLL-like rates (LOC > PER ~ ORG > MISC), about one entity
  every 6-7 tokens, 1-8 tokens long (long organisation and event names);
- names built from syllables, so the vocabulary is large, with Zipf-distributed
  mention frequencies: a few names are everywhere, most are rare, and dev/test have
  names never seen in training;
- ambiguity: surnames that are also place names, clubs and companies named after
  places ("Dunmore United" is an ORG), nationality adjectives (MISC) derived from
  place names, capitalised non-entities (days, months, titles, sentence starts),
  all-caps headlines.

Everything is generated from word parts written for this module; nothing is read
or downloaded. `make_news_docs(nlp, n, seed)` is deterministic in `seed`.
"""

import bisect
import itertools
import random
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from spacy.language import Language
from spacy.tokens import Doc, DocBin, Span

LABELS = ("LOC", "PER", "ORG", "MISC")
Chunk = Tuple[str, Optional[str]]  # (space-separated words, entity label or None)

_ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "st",
    "t",
    "tr",
    "v",
    "w",
    "z",
    "sh",
    "ch",
    "j",
]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "k", "m", "nd", "rt", "st", "th"]
_PLACE_SUFFIXES = ["ton", "burg", "ford", "ville", "stad", "mouth", "holm", "grad", "ia", "land"]
_ORG_SUFFIXES = [
    "Corp",
    "Group",
    "Holdings",
    "Bank",
    "Airlines",
    "Motors",
    "Systems",
    "Energy",
    "Partners",
    "Insurance",
    "Telecom",
    "Mining",
]
_CLUB_SUFFIXES = ["United", "City", "Rovers", "Athletic", "Wanderers", "FC"]
_ORG_NOUNS = ["Workers", "Farmers", "Teachers", "Exporters", "Miners", "Doctors", "Traders"]
_ORG_BODIES = ["Union", "Federation", "Association", "Council", "Ministry", "Commission"]
_EVENTS = ["Open", "Grand Prix", "Cup", "Games", "Championship", "Masters", "Classic"]
_MISC_NOUNS = ["Accord", "Treaty", "Declaration", "Charter", "Summit"]
_TITLES = ["President", "Minister", "Chairman", "Director", "Coach", "spokesman", "analyst"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = ["January", "February", "March", "April", "June", "July", "August", "October"]
_TOPICS = ["SOCCER", "TENNIS", "MARKETS", "POLITICS", "BUSINESS", "CRICKET", "GOLF"]
_COMMON = (
    "the a an of to in on for with by from at as about after before over under against "
    "and but or that which while because although if when since year week month day "
    "government company team market shares prices talks deal season match goal result "
    "police court report plan budget election vote troops border trade bank rate "
    "percent points minutes record loss profit growth fell rose said expected agreed "
    "announced denied won lost beat drew signed rejected increased cut reached opened "
    "closed warned told added new first last second final early late strong weak high "
    "low major local foreign national several three two four ten million billion "
    "officials players investors analysts voters leaders fans workers people sources"
).split()
_VERBS = ["said", "told reporters", "said in a statement", "added", "warned", "confirmed"]


def _zipf_picker(items: Sequence[str], s: float = 1.05) -> Callable[[random.Random], str]:
    """Draw from `items` with P(i) ~ 1 / (i + 1)^s: a few frequent, a long tail."""
    cum = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(len(items))))

    def pick(rng: random.Random) -> str:
        return items[bisect.bisect(cum, rng.random() * cum[-1])]

    return pick


class _Lexicon:
    """Name pools, built once per seed (train/dev/test share them when the corpus is
    generated with the same `lexicon_seed`, so frequent names recur across splits and
    the tail differs)."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        seen: set = set()

        def word(n_syll: int) -> str:
            while True:
                w = "".join(
                    rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                    for _ in range(n_syll)
                ).capitalize()
                if w not in seen and len(w) > 2:
                    seen.add(w)
                    return w

        firsts = [word(rng.choice((1, 2, 2))) for _ in range(400)]
        surnames = [word(rng.choice((2, 2, 3))) for _ in range(1200)]
        places = [word(rng.choice((1, 2))) + rng.choice(_PLACE_SUFFIXES) for _ in range(500)]
        places += [word(2) for _ in range(300)]
        # Ambiguity: some surnames are place names too.
        surnames[::9] = places[: len(surnames[::9])]
        locs = places + [f"New {p}" for p in places[:40]] + [f"{p} City" for p in places[40:70]]
        rng.shuffle(locs)
        self.first = _zipf_picker(firsts, 0.9)
        self.surname = _zipf_picker(surnames)
        self.loc = _zipf_picker(locs)
        orgs: List[str] = []
        for i in range(700):
            kind = rng.random()
            if kind < 0.35:
                orgs.append(f"{rng.choice(surnames)} {rng.choice(_ORG_SUFFIXES)}")
            elif kind < 0.55:
                orgs.append(f"{rng.choice(places)} {rng.choice(_CLUB_SUFFIXES)}")
            elif kind < 0.7:
                orgs.append("".join(rng.choice("ABCDEFGHKLMNPRSTUVW") for _ in range(3)))
            elif kind < 0.85:
                orgs.append(f"{word(2)} {rng.choice(_ORG_SUFFIXES)}")
            else:  # long names
                orgs.append(
                    f"{rng.choice(['National', 'Federal', 'United', 'Central'])} "
                    f"{rng.choice(_ORG_BODIES)} of {rng.choice(_ORG_NOUNS)}"
                    + (f" of {rng.choice(places)}" if rng.random() < 0.5 else "")
                )
        rng.shuffle(orgs)
        self.org = _zipf_picker(orgs)
        adjectives = [p.rstrip("aeiou") + rng.choice(["ian", "ish", "ese", "i"]) for p in places]
        miscs = (
            adjectives[:200]
            + [f"{rng.choice(places)} {rng.choice(_EVENTS)}" for _ in range(150)]
            + [
                f"{rng.randint(1990, 2026)} {rng.choice(places)} {rng.choice(_EVENTS)}"
                for _ in range(40)
            ]
            + [f"{rng.choice(places)} {rng.choice(_MISC_NOUNS)}" for _ in range(60)]
        )
        rng.shuffle(miscs)
        self.misc = _zipf_picker(miscs)

    def person(self, rng: random.Random, short_ok: bool = True) -> str:
        if short_ok and rng.random() < 0.3:
            return self.surname(rng)
        if rng.random() < 0.05:
            return f"{self.first(rng)} {rng.choice('ABCDEFGHJKLMNPRSTW')}. {self.surname(rng)}"
        return f"{self.first(rng)} {self.surname(rng)}"


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_COMMON) for _ in range(rng.randint(lo, hi)))


def _clause(lex: _Lexicon, rng: random.Random) -> List[Chunk]:
    """Lower-case words with 0-2 entity mentions in them."""
    out: List[Chunk] = [(_words(rng, 2, 6), None)]
    for _ in range(rng.choice((0, 1, 1, 2))):
        kind = rng.random()
        if kind < 0.35:
            out += [(rng.choice(["in", "near", "from"]), None), (lex.loc(rng), "LOC")]
        elif kind < 0.6:
            out += [(rng.choice(["with", "against", "by"]), None), (lex.org(rng), "ORG")]
        elif kind < 0.8:
            out += [(rng.choice(["for", "and", "with"]), None), (lex.person(rng), "PER")]
        else:
            out += [("the", None), (lex.misc(rng), "MISC"), (rng.choice(_COMMON), None)]
        out.append((_words(rng, 1, 5), None))
    return out


def _sentence(lex: _Lexicon, rng: random.Random) -> List[Chunk]:
    kind = rng.random()
    per, org, loc = lex.person, lex.org, lex.loc
    if kind < 0.18:  # score or result line: two clubs, or two countries
        side, label = (org, "ORG") if kind < 0.09 else (loc, "LOC")
        return [
            (side(rng), label),
            (str(rng.randint(0, 5)), None),
            (side(rng), label),
            (str(rng.randint(0, 5)), None),
        ]
    if kind < 0.35:  # reported speech with a title
        out: List[Chunk] = [('"', None)] + _clause(lex, rng) + [(', "', None)]
        out += [(per(rng, short_ok=False), "PER"), (",", None)]
        if rng.random() < 0.6:
            out += [(rng.choice(_TITLES), None), ("of", None), (org(rng), "ORG"), (",", None)]
        return out + [(rng.choice(_VERBS), None), (".", None)]
    if kind < 0.5:
        out = [
            (rng.choice(_TITLES).capitalize(), None),
            (per(rng), "PER"),
            (rng.choice(_VERBS), None),
            ("on", None),
            (rng.choice(_DAYS), None),
            ("that", None),
        ]
        return out + _clause(lex, rng) + [(".", None)]
    if kind < 0.62:
        out = [(org(rng), "ORG"), (rng.choice(["shares", "said", "profit", "officials"]), None)]
        out += [(_words(rng, 1, 4), None), ("in", None), (rng.choice(_MONTHS), None)]
        return out + _clause(lex, rng) + [(".", None)]
    if kind < 0.74:
        out = [("The", None), (lex.misc(rng), "MISC"), (rng.choice(_COMMON), None)]
        out += _clause(lex, rng) + [(",", None), ("said", None), (per(rng), "PER")]
        return out + [("in", None), (loc(rng), "LOC"), (".", None)]
    if kind < 0.86:  # a place name as a person, a club named after a place
        out = [(loc(rng), "LOC"), ("'s", None), (org(rng), "ORG")]
        return out + _clause(lex, rng) + [(".", None)]
    first = _words(rng, 1, 2).capitalize()  # a capitalised non-entity opening
    return [(first, None)] + _clause(lex, rng) + _clause(lex, rng) + [(".", None)]


def _doc_chunks(lex: _Lexicon, rng: random.Random) -> List[List[Chunk]]:
    """The sentences of one doc, until a drawn token target is reached."""
    target = min(60 + int(rng.lognormvariate(4.9, 0.6)), 2000)
    sents: List[List[Chunk]] = []
    if rng.random() < 0.5:  # headline and dateline
        head = [(rng.choice(_TOPICS), None), ("-", None)]
        for chunk, label in _clause(lex, rng)[:3]:
            head.append((chunk.upper(), label))
        sents.append(head)
        sents.append(
            [
                (lex.loc(rng).upper(), "LOC"),
                (f"{rng.randint(1, 28)}-{rng.randint(1, 12)}", None),
                ("-", None),
            ]
        )
    n = sum(len(c.split(" ")) for s in sents for c, _ in s)
    while n < target:
        sent = _sentence(lex, rng)
        sents.append(sent)
        n += sum(len(c.split(" ")) for c, _ in sent)
    return sents


def make_news_doc(nlp: Language, lex: "_Lexicon", rng: random.Random) -> Doc:
    """One news-like document with entities and sentence starts."""
    words: List[str] = []
    starts: List[bool] = []
    ents: List[Tuple[int, int, str]] = []
    for sent in _doc_chunks(lex, rng):
        first = True
        for chunk, label in sent:
            toks = chunk.split(" ")
            if first and toks[0][:1].islower():
                toks[0] = toks[0].capitalize()
            begin = len(words)
            words += toks
            starts += [first] + [False] * (len(toks) - 1)
            first = False
            if label is not None:
                ents.append((begin, len(words), label))
    spaces = [words[i + 1] not in {".", ",", "'s"} for i in range(len(words) - 1)] + [False]
    doc = Doc(nlp.vocab, words=words, spaces=spaces, sent_starts=starts)
    doc.ents = [Span(doc, s, e, label=lab) for s, e, lab in ents]
    return doc


def make_news_docs(nlp: Language, n_docs: int, seed: int = 0, lexicon_seed: int = 0) -> List[Doc]:
    """Generate `n_docs` news-like NER docs, deterministically.

    nlp (Language): supplies the vocab.
    n_docs (int): how many docs.
    seed (int): seed of the documents (use different seeds for train, dev, test).
    lexicon_seed (int): seed of the name pools (keep it the same across splits).
    RETURNS (List[Doc]): docs with `ents` and sentence starts set.
    """
    lex = _Lexicon(lexicon_seed)
    rng = random.Random(seed * 7919 + 1)
    return [make_news_doc(nlp, lex, rng) for _ in range(n_docs)]


def write_news_corpus(
    path: Union[str, Path], n_docs: int, seed: int = 0, lang: str = "en", lexicon_seed: int = 0
) -> Path:
    """Write a generated news-like NER corpus as a .spacy file and return its path."""
    import spacy

    nlp = spacy.blank(lang)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = make_news_docs(nlp, n_docs, seed=seed, lexicon_seed=lexicon_seed)
    DocBin(docs=docs, store_user_data=True).to_disk(path)
    return path


def corpus_stats(docs: Sequence[Doc]) -> Dict[str, object]:
    """Lengths, entity counts and density of a list of docs."""
    lengths = sorted(len(d) for d in docs)
    labels: Dict[str, int] = {}
    ent_lens: List[int] = []
    for d in docs:
        for e in d.ents:
            labels[e.label_] = labels.get(e.label_, 0) + 1
            ent_lens.append(len(e))
    n_tok, n_ent = sum(lengths), len(ent_lens)
    pct = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return {
        "docs": len(docs),
        "tokens": n_tok,
        "sentences": sum(1 for d in docs for _ in d.sents),
        "doc_tokens_p10_p50_p90_max": [pct(0.1), pct(0.5), pct(0.9), lengths[-1]],
        "entities": n_ent,
        "tokens_per_entity": round(n_tok / max(1, n_ent), 2),
        "entities_per_label": dict(sorted(labels.items(), key=lambda kv: -kv[1])),
        "entity_tokens_max": max(ent_lens, default=0),
        "entities_over_3_tokens": sum(1 for n in ent_lens if n > 3),
    }
