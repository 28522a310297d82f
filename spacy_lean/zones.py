"""Streaming evaluation in spaCy memory zones, so the vocab stops growing with the data.

Every doc spaCy makes adds its new strings to `nlp.vocab.strings` and a lexeme for
each new word to `nlp.vocab` (with its norm, shape, prefix and suffix strings: about
430 bytes per distinct word), and the tokenizer caches every new whitespace-separated
chunk. None of it is ever freed. A dev set rich in distinct words (numbers, names,
URLs, user handles, typos) grows the process with its size, however little the
evaluator itself holds: +423 MB per million distinct words.

spaCy 3.8's `Language.memory_zone` frees what was added to the vocab inside the zone
when the zone ends; whatever was made inside it must not be used after (its strings
are gone; spaCy calls such use undefined). The streaming evaluator reads and scores a
stream in zones, one after another, switching at the end of a window, when:

- the stream says it holds no doc it made (`holds_docs()` is false): between the
  pieces of a split doc, or with a shuffle buffer, it holds some, and the zone goes
  on to the next window end;
- the one example the evaluator read ahead can be made again in the next zone (its
  two docs go through `Doc.to_bytes`; user data msgpack cannot encode keeps the zone).

The first window is read outside any zone: its words stay in the vocab, and spaCy's
tokenizer caches them (in a zone it caches nothing: tokenizing there took 3.3x the time
without that first window, 1.0x with it, on 6,000 tweet-like docs). A window is bounded
(`window_tokens`), so what stays is too, whatever the size of the data.

Only streams that say when they hold docs are read in zones: spacy-lean's readers
(`read_examples`, `spacy-lean.Corpus.v1`'s streams). Any other iterable (a list, a
generator) is read as before, as is a stream evaluated inside a zone of the caller's
(zones do not nest). A .spacy file stores its docs as hashes with one string table:
the streams tell its reader (`use_memory_zones`), which then keeps the table as a
compact index (`StringIndex`) and adds each doc's own strings as the doc is read, so
they go with its zone too. Where a table is read whole in a zone (compact chunks of
`spacy-lean.Corpus.v1`), its strings are kept (`add_file_strings`). The score states
hold counts keyed by Python strings, never docs or hashes, so the scores are those of
an evaluation without zones.

spaCy's morphology table has no zones: an analysis added in a zone stays in it, keyed
by the hash of its string, and `Morphology.add` adds its strings as permanent, unless
one of them was already in the vocab as a transient string (a .spacy doc's own string,
a word of the zone), which spaCy keeps as it is. The zone then takes the string and
leaves the analysis, and a later `token.morph` of it (`str`, `to_dict`, `get`: a
lemmatizer's rules, a component setting analyses by string, the per-feature scorer)
raised E018. The zones note the analyses of the docs they score and skip (`note`) and
add their strings again once each zone has ended, as spaCy meant them: permanent, as
the table is (a bounded set: the tagset's analyses).
"""

from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import numpy
from spacy.attrs import MORPH
from spacy.language import Language
from spacy.morphology import Morphology
from spacy.strings import get_string_id
from spacy.tokens import Doc
from spacy.training import Example
from spacy.vocab import Vocab


# Strings of a data file's table that were in the vocab before the table was read in a
# memory zone, per vocab (by id) while `MemoryZones` has a zone open: those may be
# transient (added earlier in the zone), and adding them again kept them so (spaCy
# keeps the first entry), so they are added again once the zone has ended.
_MAYBE_TRANSIENT: Dict[int, List[str]] = {}
# How many of `MemoryZones`' zones have ended, per vocab (by id): a `StringIndex` knows
# that the strings it added before then may be gone.
_ENDED: Dict[int, int] = {}


def add_file_strings(vocab: Vocab, strings: Iterable[str]) -> None:
    """Add a data file's string table to the vocab as `DocBin.get_docs` does (a
    lexeme per string), keeping the strings past the end of a memory zone: the file's
    docs, made later (in later zones), find their words by hash."""
    if not vocab.in_memory_zone:
        for string in strings:
            vocab[string]
        return
    store = vocab.strings
    strings = list(strings)
    present = [string for string in strings if string in store]
    # Every string first: a lexeme adds its norm, prefix, suffix and shape strings
    # (transient in a zone), and the table holds some of those ("Zorblax" comes before
    # "zorblax", its norm, in the table's sorted order).
    for string in strings:
        store.add(string, allow_transient=False)
    for string in strings:
        vocab[string]
    kept = _MAYBE_TRANSIENT.get(id(vocab))
    if kept is not None:
        kept.extend(present)


class StringIndex:
    """A data file's string table kept compact, for reading its docs in memory zones:
    the strings' hashes (sorted) and their UTF-8 bytes, about 26 bytes a string against
    ~240 in spaCy's string store. `add(vocab, keys)` adds the strings of the hashes a
    doc uses (its token table, its spans' labels and ids) to the vocab, so each doc
    brings its own strings into the zone it is read in, and the table itself never
    enters the vocab.

    strings (Iterable[str]): the table.
    """

    def __init__(self, strings: Iterable[str]) -> None:
        hashes: List[int] = []
        ends: List[int] = []
        blob = bytearray()
        for string in strings:
            hashes.append(get_string_id(string))
            blob += string.encode("utf8")
            ends.append(len(blob))
        keys = numpy.array(hashes, dtype=numpy.uint64)
        order = numpy.argsort(keys, kind="stable")
        stops = numpy.array(ends, dtype=numpy.int64)
        starts = numpy.concatenate([numpy.zeros(1, numpy.int64), stops[:-1]])
        self.keys = keys[order]
        self.starts = starts[order]
        self.stops = stops[order]
        self.blob = bytes(blob)
        # The strings added since the last zone ended (still in the vocab): skipped
        # without a lookup, so a doc costs about its new strings only.
        self._added = numpy.zeros(len(hashes), dtype=bool)
        self._ended: Optional[int] = None

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.starts.nbytes + self.stops.nbytes + len(self.blob)

    def add(self, vocab: Vocab, keys: Any) -> None:
        """Add the table's strings whose hashes are among `keys` (any shape) and not in
        the vocab yet; other values (0, numbers, unknown hashes) are ignored."""
        if not len(self):
            return
        ended = _ENDED.get(id(vocab), 0)
        if ended != self._ended:
            self._added[:] = False
            self._ended = ended
        keys = numpy.unique(numpy.asarray(keys, dtype=numpy.uint64))
        pos = numpy.minimum(numpy.searchsorted(self.keys, keys), len(self) - 1)
        pos = pos[self.keys[pos] == keys]
        pos = pos[~self._added[pos]]
        if not len(pos):
            return
        self._added[pos] = True
        store = vocab.strings
        blob, starts, stops = self.blob, self.starts, self.stops
        for key, i in zip(self.keys[pos].tolist(), pos.tolist()):
            if key not in store:
                store.add(blob[starts[i] : stops[i]].decode("utf8"))


class MemoryZones:
    """The memory zones of one streaming evaluation (see the module's docs).

    nlp (Language): the pipeline, whose `memory_zone` is entered.
    source (Any): the stream; its `holds_docs()` says whether a zone may end.
    """

    def __init__(self, nlp: Language, source: Any) -> None:
        self.nlp = nlp
        self.source = source
        self.n_zones = 0  # zones entered
        self.n_kept = 0  # window ends where the zone went on (the stream held docs)
        self._zone: Any = None
        # Morphological analyses (keys) met in the open zone, and those whose strings
        # are permanent already (see the module's docs).
        self._morphs: Set[int] = set()
        self._kept_morphs: Set[int] = {0}

    @classmethod
    def for_stream(cls, nlp: Language, examples: Any, state: Any) -> Optional["MemoryZones"]:
        """Zones for evaluating `examples` into `state`, or None where they cannot be
        used: a stream that does not say when it holds docs, a caller's zone already
        open, or a state that keeps the examples (a custom `Scorer` subclass)."""
        if not callable(getattr(examples, "holds_docs", None)):
            return None
        if not hasattr(nlp, "memory_zone") or nlp.vocab.in_memory_zone:
            return None
        if not getattr(state, "zone_safe", True):
            return None
        use = getattr(examples, "use_memory_zones", None)
        if callable(use):  # e.g. read .spacy files' strings doc by doc (`StringIndex`)
            use()
        return cls(nlp, examples)

    @property
    def in_zone(self) -> bool:
        """Whether one of these zones is open."""
        return self._zone is not None

    def open(self) -> None:
        """Enter a new zone."""
        zone = self.nlp.memory_zone()
        zone.__enter__()
        self._zone = zone
        _MAYBE_TRANSIENT[id(self.nlp.vocab)] = []
        self.n_zones += 1

    def note(self, examples: Iterable[Optional[Example]]) -> None:
        """Note the morphological analyses of these examples' docs (read or scored in
        the open zone), whose strings `close` keeps."""
        if self._zone is None:
            return
        for eg in examples:
            if eg is None:
                continue
            for doc in (eg.predicted, eg.reference):
                if doc.has_annotation("MORPH"):
                    self._morphs.update(numpy.unique(doc.to_array(MORPH)).tolist())

    def _morph_strings(self) -> List[str]:
        """The strings of the analyses noted in the open zone that are not kept yet:
        each analysis's and those of its fields and features (`Morphology.add`'s),
        read leniently (a value may hold "=": `set_morph({"Foo": "a=b"})`)."""
        new = self._morphs - self._kept_morphs
        self._morphs = set()
        strings: List[str] = []
        morphology = self.nlp.vocab.morphology
        for key in new:
            try:
                feats = morphology.get(key)
            except KeyError:  # its string went with an earlier zone (not noted there)
                continue
            if not feats:
                continue
            strings.append(feats)
            for feat in feats.split(Morphology.FEATURE_SEP):
                field, sep, values = feat.partition(Morphology.FIELD_SEP)
                if not sep:
                    continue
                strings.append(field)
                strings.extend(
                    f"{field}{sep}{value}" for value in values.split(Morphology.VALUE_SEP)
                )
        self._kept_morphs.update(new)
        return strings

    def close(self) -> None:
        """End the current zone, if one is open; the strings of the file tables read in
        it that it may have removed are added again (`add_file_strings`), and those of
        the morphological analyses noted in it (`note`)."""
        zone, self._zone = self._zone, None
        if zone is None:
            return
        kept = _MAYBE_TRANSIENT.pop(id(self.nlp.vocab), [])
        try:
            kept += self._morph_strings()
        finally:  # the zone ends whatever happened
            zone.__exit__(None, None, None)
        _ENDED[id(self.nlp.vocab)] = _ENDED.get(id(self.nlp.vocab), 0) + 1
        store = self.nlp.vocab.strings
        for string in kept:
            if string not in store:
                store.add(string)

    def next_zone(self, pending: Optional[Example]) -> Optional[Example]:
        """At a window's end: end the zone and enter the next where nothing made in it
        is used later. `pending` is the example read ahead; RETURNS it, made again in
        the new zone if the zone changed."""
        if self._zone is None:  # after a window read outside any zone (the first)
            self.open()
            return pending  # made outside any zone: usable in all
        if self.source.holds_docs():
            self.n_kept += 1
            return pending
        data = None
        if pending is not None:
            try:
                data = example_to_bytes(pending)
            except (TypeError, ValueError):  # user data msgpack cannot encode
                self.n_kept += 1
                return pending
        self.close()
        self.open()
        return example_from_bytes(self.nlp.vocab, data) if data is not None else None


def example_to_bytes(eg: Example) -> Tuple[bytes, bytes]:
    """An example's two docs, serialised with their strings."""
    return eg.predicted.to_bytes(), eg.reference.to_bytes()


def example_from_bytes(vocab: Vocab, data: Tuple[bytes, bytes]) -> Example:
    """The example `example_to_bytes` serialised, made with `vocab`."""
    predicted, reference = data
    return Example(Doc(vocab).from_bytes(predicted), Doc(vocab).from_bytes(reference))
