"""`spacy-lean.Corpus.v1`: a streaming, resumable, rank-aware corpus reader."""

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple, Union

import numpy
from spacy.language import Language
from spacy.tokens import Doc, DocBin
from spacy.training import Example
from spacy.training.augment import dont_augment
from spacy.util import registry

from ..memory import trim_host_memory
from .lengths import WordpieceCounter
from .docbin import docbin_add, docbin_docs
from .shards import check_rank, default_rank_and_size, split_among
from .sources import count_gold_docs, iter_shard_docs, list_shards
from .split import DocSplitter, SplitStats, check_max_length

logger = logging.getLogger("spacy_lean.corpus")
STATE_VERSION = 1
Ref = Tuple[int, int, int]  # (unit, doc index in the unit, piece index in the doc)


@dataclass
class CorpusStats(SplitStats):
    """What the reader did in its latest epoch: the `SplitStats` counts plus
    `examples` (examples yielded, before augmentation) and `max_buffered` (the most
    pieces held in the shuffle buffer at once)."""

    examples: int = 0
    max_buffered: int = 0


@registry.readers("spacy-lean.Corpus.v1")
def create_lean_corpus_v1(
    path: Optional[Union[str, Path]],
    gold_preproc: bool = False,
    max_length: int = 0,
    limit: int = 0,
    shuffle: bool = False,
    shuffle_buffer: int = 1000,
    seed: int = 0,
    augmenter: Optional[Callable] = None,
    compact: bool = False,
    compact_chunk: int = 256,
    wordpiece_tokenizer: Optional[str] = None,
    instance_rank: Optional[int] = None,
    num_instances: Optional[int] = None,
    share_by: str = "doc",
    file_format: str = "auto",
    jsonl_spans_key: str = "sc",
) -> "LeanCorpus":
    """Create a memory-lean corpus reader (see `LeanCorpus` for the arguments)."""
    if path is None:
        raise ValueError(
            "spacy-lean.Corpus.v1 needs a path, got None. Set it in the config (e.g. "
            '[paths] train = "corpus/train.spacy") or with --paths.train.'
        )
    return LeanCorpus(
        path,
        gold_preproc=gold_preproc,
        max_length=max_length,
        limit=limit,
        shuffle=shuffle,
        shuffle_buffer=shuffle_buffer,
        seed=seed,
        augmenter=augmenter,
        compact=compact,
        compact_chunk=compact_chunk,
        wordpiece_tokenizer=wordpiece_tokenizer,
        instance_rank=instance_rank,
        num_instances=num_instances,
        share_by=share_by,
        file_format=file_format,
        jsonl_spans_key=jsonl_spans_key,
    )


class LeanCorpus:
    """Iterate Examples from .spacy or .jsonl files, one shard at a time.

    Each call `corpus(nlp)` reads one epoch and returns a `CorpusStream` (an iterator
    of Examples with a `.state()`); like spaCy's `Corpus` it can be listed.

    path (str / Path): a .spacy or .jsonl file, or a folder of them (walked
        recursively, sorted).
    gold_preproc (bool): predicted docs use the gold tokens, and docs are cut at every
        sentence boundary no entity or span crosses (as spaCy's gold_preproc does,
        without its losses); max_length still applies.
    max_length (int): longest example in tokens (or wordpieces), inclusive; longer
        docs are split (see `spacy_lean.corpus.split`). 0: no limit.
    limit (int): read only the first `limit` stored docs of the corpus (in file
        order, empty ones included), before shuffling and sharing. 0: no limit.
    shuffle (bool): shuffle the shard order and the examples (bounded buffer).
    shuffle_buffer (int): pieces the shuffle buffer holds at most.
    seed (int): seed of the shuffle; epoch e uses (seed, e).
    augmenter (Optional[Callable]): spaCy augmenter applied to every example.
    compact (bool): on the first call, read the corpus once and keep it in memory
        as compressed DocBin chunks (already split and shared), decoded a chunk at a
        time; later epochs read no files.
    compact_chunk (int): pieces per compact chunk.
    wordpiece_tokenizer (Optional[str]): count max_length in this Hugging Face
        tokenizer's wordpieces (special tokens included) instead of spaCy tokens.
    instance_rank (Optional[int]): this worker's rank; None: from torch.distributed
        or the RANK environment variable, else 0.
    num_instances (Optional[int]): number of workers; None: from torch.distributed or
        WORLD_SIZE, else 1.
    share_by (str): "doc" (doc i of shard s goes to rank (s + i) % n; every worker
        reads every shard) or "shard" (whole shards, `split_among`).
    file_format (str): "auto", "spacy" or "jsonl".
    jsonl_spans_key (str): span group a .jsonl "spans" list fills ("ents": entities).
    """

    def __init__(
        self,
        path: Union[str, Path],
        *,
        gold_preproc: bool = False,
        max_length: int = 0,
        limit: int = 0,
        shuffle: bool = False,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        augmenter: Optional[Callable] = None,
        compact: bool = False,
        compact_chunk: int = 256,
        wordpiece_tokenizer: Optional[str] = None,
        instance_rank: Optional[int] = None,
        num_instances: Optional[int] = None,
        share_by: str = "doc",
        file_format: str = "auto",
        jsonl_spans_key: str = "sc",
    ) -> None:
        self.max_length = check_max_length(max_length)
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}. Use 0 for no limit.")
        if shuffle and shuffle_buffer < 1:
            raise ValueError(
                f"shuffle_buffer must be >= 1 when shuffle is on, got {shuffle_buffer}."
            )
        if compact_chunk < 1:
            raise ValueError(f"compact_chunk must be >= 1, got {compact_chunk}.")
        if share_by not in ("doc", "shard"):
            raise ValueError(f"share_by must be 'doc' or 'shard', got {share_by!r}.")
        suffixes = {"auto": None, "spacy": ".spacy", "jsonl": ".jsonl"}
        if file_format not in suffixes:
            raise ValueError(
                f"file_format must be 'auto', 'spacy' or 'jsonl', got {file_format!r}."
            )
        if (instance_rank is None) != (num_instances is None):
            raise ValueError(
                "Set both instance_rank and num_instances, or neither (then they come from "
                "torch.distributed or RANK/WORLD_SIZE); got "
                f"{instance_rank} and {num_instances}."
            )
        if num_instances is not None:
            check_rank(instance_rank, num_instances)  # type: ignore[arg-type]
        self.path = Path(path)
        self.shards: List[Path] = list_shards(self.path, suffixes[file_format])
        self.gold_preproc = gold_preproc
        self.limit = limit
        self.shuffle = shuffle
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.augmenter = augmenter if augmenter is not None else dont_augment
        self.compact = compact
        self.compact_chunk = compact_chunk
        self.wordpiece_tokenizer = wordpiece_tokenizer
        self.instance_rank = instance_rank
        self.num_instances = num_instances
        self.share_by = share_by
        self.jsonl_spans_key = jsonl_spans_key
        self.file_format = file_format
        self.epoch = 0
        self.stats = CorpusStats()
        self._splitter: Optional[DocSplitter] = None
        self._limit_plan: Optional[Dict[int, int]] = None
        self._compact_chunks: Optional[List[bytes]] = None
        self._compact_stats: Optional[CorpusStats] = None
        self._compact_share: Optional[Tuple[int, int]] = None  # (rank, size) built for
        self._resume: Optional[Dict[str, Any]] = None
        self._last_stream: Optional["CorpusStream"] = None
        self._warned_oversize = False
        self._warned_share = False

    # ----- public API -----

    def __call__(self, nlp: Language) -> "CorpusStream":
        """Read the next epoch (resuming from `set_state` when one was given).

        nlp (Language): supplies the vocab and tokenizer.
        RETURNS (CorpusStream): iterator of Examples.
        """
        state, self._resume = self._resume, None
        if state is not None:
            epoch = int(state["epoch"])
        else:
            epoch = self.epoch
        self.epoch = epoch + 1
        return self.stream(nlp, epoch=epoch, state=state)

    def stream(
        self, nlp: Language, *, epoch: int = 0, state: Optional[Dict[str, Any]] = None
    ) -> "CorpusStream":
        """Examples of one epoch, from its start or from a saved `state`."""
        if state is not None:
            self._check_state(state)
            epoch = int(state["epoch"])
        stream = CorpusStream(self, nlp, epoch, state)
        self._last_stream = stream
        return stream

    @property
    def state(self) -> Optional[Dict[str, Any]]:
        """The position after the latest example the latest stream yielded."""
        return None if self._last_stream is None else self._last_stream.state()

    def set_state(self, state: Dict[str, Any]) -> None:
        """Make the next call `corpus(nlp)` continue from `state` (from `.state`)."""
        self._check_state(state)
        self._resume = state
        self.epoch = int(state["epoch"])

    @property
    def rank_and_size(self) -> Tuple[int, int]:
        if self.num_instances is not None:
            return int(self.instance_rank), int(self.num_instances)  # type: ignore[arg-type]
        rank, size = default_rank_and_size()
        check_rank(rank, size)
        return rank, size

    def compact_nbytes(self) -> int:
        """Bytes held by the compact chunks (0 before the first call)."""
        return sum(len(c) for c in self._compact_chunks or [])

    # ----- internals -----

    def _fingerprint(self) -> Dict[str, Any]:
        rank, size = self.rank_and_size
        return {
            "shards": len(self.shards),
            "max_length": self.max_length,
            "limit": self.limit,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "seed": self.seed,
            "gold_preproc": self.gold_preproc,
            "compact": self.compact,
            "compact_chunk": self.compact_chunk if self.compact else None,
            "rank": rank,
            "size": size,
            "share_by": self.share_by,
            # They change the pieces (a state taken with them resumed elsewhere, and
            # without a tokenizer crashed). States saved before they were listed
            # are still read: only the settings a state names are compared.
            "wordpiece_tokenizer": self.wordpiece_tokenizer,
            "jsonl_spans_key": self.jsonl_spans_key,
            "file_format": self.file_format,
        }

    def _check_state(self, state: Dict[str, Any]) -> None:
        """Refuse (ValueError naming the field and its value) a state the reader could
        not have written for this corpus and these settings, before anything is
        changed. What needs the corpus's pieces (a doc or piece index past the doc's)
        is checked when the stream reaches it (`CorpusStream._pieces`); with compact,
        so is the shard index until the compact chunks are built."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"Not a spacy-lean corpus state (version {STATE_VERSION}): {str(state)[:80]!r}."
            )
        refuse = _refuse_state
        for key in ("epoch", "pos", "done", "yielded", "buffer", "rng", "settings"):
            if key not in state:
                refuse(key, "nothing (the field is missing)", "the field the reader writes")
        if not isinstance(state["settings"], dict):
            refuse("settings", state["settings"], "the reader's settings (an object)")
        ours = self._fingerprint()
        diff = {k: (v, ours.get(k)) for k, v in state["settings"].items() if ours.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"The saved corpus state was taken with other settings ({detail}). "
                "Resume with the settings it was saved with."
            )
        for key in ("epoch", "yielded"):
            if not _whole(state[key]):
                refuse(key, state[key], "a whole number >= 0")
        if type(state["done"]) is not bool:
            refuse("done", state["done"], "true or false")
        pos, buffer = state["pos"], state["buffer"]
        if not (isinstance(pos, list) and len(pos) == 3 and all(_whole(v) for v in pos)):
            refuse("pos", pos, "[shard, doc, piece]: three whole numbers >= 0")
        if not isinstance(buffer, list):
            refuse("buffer", buffer, "a list of [shard, doc, piece] references")
        size = self.shuffle_buffer if self.shuffle else 0
        if len(buffer) > size:  # before reading them: a huge list is refused at once
            refuse(
                "len(buffer)",
                len(buffer),
                f"at most shuffle_buffer = {size}" if self.shuffle else "0 (shuffle is off)",
            )
        seen: Dict[Tuple[int, ...], int] = {}
        for i, ref in enumerate(buffer):
            if not (isinstance(ref, list) and len(ref) == 3 and all(_whole(v) for v in ref)):
                refuse(f"buffer[{i}]", ref, "[shard, doc, piece]: three whole numbers >= 0")
            j = seen.setdefault(tuple(ref), i)
            if j != i:
                refuse(
                    f"buffer[{i}]",
                    ref,
                    f"a piece not already in the buffer (buffer[{j}] is the same: it would be "
                    "yielded twice)",
                )
        if self.shuffle and not state["done"] and len(buffer) < size and state["yielded"]:
            # The buffer is filled before the first example is yielded, and stays full
            # until the epoch's shards are read (done).
            refuse(
                "len(buffer)",
                len(buffer),
                f"shuffle_buffer = {size} (a full buffer) once examples were yielded "
                f"(yielded = {state['yielded']}) and the shards are not all read (done = false)",
            )
        rng = state["rng"]
        if rng is None:
            # Only a stream that has not started has no RNG state.
            if pos != [0, 0, 0] or buffer or state["done"] or state["yielded"]:
                refuse(
                    "rng",
                    None,
                    "the RNG state of a stream that has started (pos, buffer, done and yielded "
                    "say it has)",
                )
        else:
            _check_rng_state(rng)
        if not self.compact or (
            self._compact_chunks is not None and self._compact_share == self.rank_and_size
        ):
            self._check_position(state, self._epoch_order(state["epoch"], warn=False)[0])

    def _epoch_order(
        self, epoch: int, warn: bool = True
    ) -> Tuple[List[int], numpy.random.Generator]:
        """The units epoch `epoch` reads, in order, and the RNG that shuffled them."""
        rng = numpy.random.Generator(numpy.random.PCG64([self.seed, epoch]))
        order = self._units(warn=warn)
        if self.shuffle:
            order = [order[i] for i in rng.permutation(len(order))]
        return order, rng

    def _check_position(self, state: Dict[str, Any], order: Sequence[int]) -> None:
        """Refuse a state (checked by `_check_state`) whose position or buffer does not
        fit the epoch's `order` of units: a position past them, or a buffered piece not
        read before the position (it would be yielded twice)."""
        refuse = _refuse_state
        n, pos = len(order), state["pos"]
        p, d, k = pos
        what = "compact chunk(s)" if self.compact else "shard(s)"
        end = [n, 0, 0]
        if state["done"] and pos != end:
            refuse("pos", pos, f"{end} (the end of this worker's {n} {what}): done is true")
        if p > n or (p == n and pos != end):
            refuse(
                "pos",
                pos,
                f"[shard, doc, piece] with shard < {n} (this worker reads {n} {what}), or "
                f"{end} (the end)",
            )
        if k == 0 and pos not in ([0, 0, 0], end):
            refuse(
                "pos",
                pos,
                "a piece >= 1 ([shard, doc, pieces of the doc read]) after the first example",
            )
        rank, size = self.rank_and_size
        by_doc = not self.compact and self.share_by == "doc" and size > 1
        if by_doc and k and p < n and (order[p] + d) % size != rank:
            refuse(
                "pos",
                pos,
                f"a doc of worker {rank} of {size} (doc i of shard s is read by "
                "worker (s + i) % workers)",
            )
        at = {u: i for i, u in enumerate(order)}
        for i, ref in enumerate(state["buffer"]):
            u, rd, rk = ref
            if u not in at:  # not a shard of the corpus: "Could not restore the buffer"
                continue
            if (at[u], rd, rk + 1) > (p, d, k):
                refuse(
                    f"buffer[{i}]",
                    ref,
                    f"a piece read before pos = {pos} (one read after it would be yielded twice)",
                )
            if by_doc and (u + rd) % size != rank:
                refuse(
                    f"buffer[{i}]",
                    ref,
                    f"a doc of worker {rank} of {size} (doc i of shard s is read by worker "
                    "(s + i) % workers)",
                )

    def _refuse_position(
        self, pos: Sequence[int], unit: int, doc: int, found: Optional[int], pieces: List[Doc]
    ) -> NoReturn:
        """Refuse a resumed position [shard, doc, piece] that the unit's docs do not
        have (`found`: the first doc from `doc` on that this worker reads, or None)."""
        where = f"compact chunk {unit}" if self.compact else f"'{self.shards[unit]}'"
        if found == doc:
            has = f"doc {doc} of {where} has {len(pieces)} piece(s)"
        else:
            has = f"{where} has no doc {doc} that this worker reads"
        _refuse_state("pos", list(pos), f"a piece of a doc this worker reads ({has})")

    def _get_splitter(self) -> DocSplitter:
        if self._splitter is None:
            kwargs: Dict[str, Any] = {}
            if self.wordpiece_tokenizer:
                counter = WordpieceCounter(self.wordpiece_tokenizer)
                kwargs = {
                    "get_token_lengths": counter.token_lengths,
                    "n_special": counter.n_special,
                }
            self._splitter = DocSplitter(
                self.max_length, split_sentences=self.gold_preproc, **kwargs
            )
        return self._splitter

    def _get_limit_plan(self) -> Optional[Dict[int, int]]:
        """shard index -> how many of its stored docs fall within `limit`."""
        if not self.limit:
            return None
        if self._limit_plan is None:
            plan, left = {}, self.limit
            for i, shard in enumerate(self.shards):
                if left <= 0:
                    break
                # Docs as read: a .jsonl file's rejected records are not docs.
                plan[i] = count_gold_docs(shard, stop=left)
                left -= plan[i]
            self._limit_plan = plan
        return self._limit_plan

    def _units(self, warn: bool = True) -> List[int]:
        """The units this worker reads: shard indices, or compact chunk indices (`warn`:
        warn when share_by = 'shard' leaves this worker none)."""
        if self.compact:
            return list(range(len(self._compact_chunks or [])))
        units = list(range(len(self.shards)))
        plan = self._get_limit_plan()
        if plan is not None:
            units = [u for u in units if u in plan]
        if self.share_by == "shard":
            rank, size = self.rank_and_size
            if rank >= len(units) and warn:
                self._warn_left_out(
                    f"{len(units)} shard(s)",
                    "Use share_by = 'doc' (every worker takes its share of the docs of every "
                    "shard), or write at least as many shards as workers with `python -m "
                    "spacy lean shard`.",
                )
            units = split_among(units, rank, size)
        return units

    def _warn_left_out(self, given: str, fix: str) -> None:
        """Warn once (a UserWarning) that `share_by` leaves this worker without data."""
        if self._warned_share:
            return
        self._warned_share = True
        rank, size = self.rank_and_size
        warnings.warn(
            f"spacy-lean.Corpus.v1 ({self.path}): share_by = '{self.share_by}' gives {given} "
            f"for {size} workers: worker {rank} gets no data. {fix}",
            UserWarning,
        )

    def _check_doc_share(self, stats: SplitStats) -> None:
        """After a whole pass over the corpus with share_by = 'doc' that gave this
        worker no piece (`stats`: the pass's counts): warn, with the corpus's doc count,
        unless it has no docs. When this worker's share was only empty docs (which are
        skipped), say so: more docs would not help where the empty ones stay."""
        rank, size = self.rank_and_size
        if stats.pieces or self.share_by != "doc" or size < 2 or self._warned_share:
            return
        plan = self._get_limit_plan()
        # No doc of any shard came here only when each holds fewer docs than workers
        # (or this worker's are all empty): counting them is cheap.
        counts = (
            plan if plan is not None else {i: count_gold_docs(s) for i, s in enumerate(self.shards)}
        )
        n_docs = sum(counts.values())
        if not n_docs:
            return
        given = f"{n_docs} doc(s)" + (f" (limit = {self.limit})" if plan is not None else "")
        if self.path.is_dir():  # the files that hold them
            files = [f"'{self.shards[i]}'" for i, n in counts.items() if n]
            more = f" and {len(files) - 3} more" if len(files) > 3 else ""
            given += f" in {', '.join(files[:3])}{more}"
        if stats.empty_docs and n_docs >= size:
            self._warn_left_out(
                given,
                f"Its share, {stats.empty_docs} doc(s) (doc i of file s goes to worker "
                "(s + i) % workers), is only empty docs (0 tokens), which are skipped: "
                "remove the empty docs from the corpus, or train on fewer processes "
                "(--nproc).",
            )
            return
        self._warn_left_out(
            given,
            "A doc goes to one worker whole (with every piece max_length cuts it into), "
            f"so each needs docs of its own: give the corpus at least {size} docs (split "
            "long docs into several), or train on fewer processes (--nproc).",
        )

    def _unit_docs(self, nlp: Language, unit: int, strings_per_doc: bool = False) -> Iterator[Doc]:
        if self.compact:
            data = self._compact_chunks[unit]  # type: ignore[index]
            chunk = DocBin(store_user_data=True).from_bytes(data)
            return docbin_docs(chunk, nlp.vocab)
        return iter_shard_docs(
            self.shards[unit],
            nlp.vocab,
            {"spans_key": self.jsonl_spans_key},
            nlp=nlp,
            strings_per_doc=strings_per_doc,
        )

    def _unit_pieces(
        self,
        nlp: Language,
        unit: int,
        stats: SplitStats,
        skip_docs: int = 0,
        strings_per_doc: bool = False,
    ) -> Iterator[Tuple[int, List[Doc]]]:
        """(doc index, pieces) for this worker's docs of one unit."""
        if self.compact:
            for d, doc in enumerate(self._unit_docs(nlp, unit)):
                if d >= skip_docs:
                    yield d, [doc]
            return
        plan = self._get_limit_plan()
        allowed = plan[unit] if plan is not None else None
        rank, size = self.rank_and_size
        by_doc = self.share_by == "doc" and size > 1
        splitter = self._get_splitter()
        for d, doc in enumerate(self._unit_docs(nlp, unit, strings_per_doc)):
            if allowed is not None and d >= allowed:
                break
            if d < skip_docs or (by_doc and (unit + d) % size != rank):
                continue
            yield d, splitter(doc, stats)

    def _build_compact(self, nlp: Language) -> None:
        stats = CorpusStats()
        chunks: List[bytes] = []
        doc_bin = DocBin(store_user_data=True)
        self._compact_chunks = None
        self._compact_share = self.rank_and_size
        self.compact = False  # read the files while building
        try:
            for unit in self._units():
                for d, pieces in self._unit_pieces(nlp, unit, stats):
                    self._note_oversize(stats, unit, d)
                    for piece in pieces:
                        docbin_add(doc_bin, piece)
                        if len(doc_bin) >= self.compact_chunk:
                            chunks.append(doc_bin.to_bytes())
                            doc_bin = DocBin(store_user_data=True)
        finally:
            self.compact = True
        if len(doc_bin):
            chunks.append(doc_bin.to_bytes())
        self._check_doc_share(stats)
        self._compact_chunks = chunks
        self._compact_stats = stats
        self._report(stats)
        # Give the heap the build pass freed back, so the compact corpus's resident
        # size is what it holds, not what it once used.
        trim_host_memory()

    def _restore_buffer(
        self, nlp: Language, refs: Sequence[Sequence[int]]
    ) -> List[Tuple[Ref, Doc]]:
        by_unit: Dict[int, Dict[int, List[int]]] = {}
        for u, d, k in refs:
            by_unit.setdefault(u, {}).setdefault(d, []).append(k)
        found: Dict[Ref, Doc] = {}
        units = set(self._units())
        for u, wanted in by_unit.items():
            if u not in units:  # a shard (or compact chunk) the corpus does not have
                continue
            last = max(wanted)
            for d, pieces in self._unit_pieces(nlp, u, SplitStats()):
                if d in wanted:
                    for k in wanted[d]:
                        if k < len(pieces):  # else the doc has fewer pieces now: missing
                            found[(u, d, k)] = pieces[k]
                if d >= last:
                    break
        missing = [tuple(r) for r in refs if tuple(r) not in found]
        if missing:
            raise ValueError(
                f"Could not restore the shuffle buffer: {len(missing)} examples (e.g. "
                f"{missing[0]}) are not in the corpus any more. Was it changed since the "
                "state was saved?"
            )
        return [((u, d, k), found[(u, d, k)]) for u, d, k in refs]

    def _make_example(self, nlp: Language, ref: Doc) -> Example:
        if self.gold_preproc or ref.has_unknown_spaces:
            words = [t.text for t in ref]
            spaces = [bool(t.whitespace_) for t in ref]
            return Example(Doc(nlp.vocab, words=words, spaces=spaces), ref)
        return Example(nlp.make_doc(ref.text), ref)

    def _note_oversize(
        self, stats: SplitStats, unit: Optional[int] = None, doc: Optional[int] = None
    ) -> None:
        """Warn once, at the first piece longer than max_length (`unit` and `doc`: the
        shard and the doc just split, which the warning names)."""
        if stats.oversize_pieces and not self._warned_oversize:
            self._warned_oversize = True
            where = f" ({self.path}): a piece"
            if unit is not None:
                length = "wordpieces" if self.wordpiece_tokenizer else "tokens"
                where = (
                    f": doc {doc} of '{self.shards[unit]}' has a piece of "
                    f"{stats.max_oversize} {length},"
                )
            warnings.warn(
                f"spacy-lean.Corpus.v1{where} longer than max_length={self.max_length} "
                "because an entity, span or token in it is longer; it is kept whole, not "
                "dropped. See corpus.stats.oversize_pieces (and give the batcher a budget "
                "that fits it).",
                UserWarning,
            )

    def _report(self, stats: SplitStats) -> None:
        self._note_oversize(stats)
        if stats.docs_split or stats.empty_docs:
            logger.info(
                "spacy-lean.Corpus.v1 %s: %d docs (%d empty, skipped), %d split into %d "
                "pieces (%d cuts at sentences, %d inside sentences, %d oversize pieces, "
                "%d dependency arcs cut, %d span extension values of cut spans left out)",
                self.path,
                stats.docs,
                stats.empty_docs,
                stats.docs_split,
                stats.pieces,
                stats.sentence_cuts,
                stats.token_cuts,
                stats.oversize_pieces,
                stats.cut_arcs,
                stats.cut_span_values,
            )


class CorpusStream:
    """One epoch of a `LeanCorpus`: an iterator of Examples whose position after the
    latest example is `state()`, a small JSON-serialisable dict. Resuming a stream from
    that state (`corpus.stream(nlp, state=...)` or `corpus.set_state(...)`) yields
    exactly what this stream would have yielded next. With an augmenter that yields
    several examples per source example, the state is exact between source examples."""

    def __init__(
        self, corpus: LeanCorpus, nlp: Language, epoch: int, state: Optional[Dict[str, Any]]
    ) -> None:
        self.corpus = corpus
        self.nlp = nlp
        self.epoch = epoch
        self._start = state
        self._pos: Tuple[int, int, int] = (0, 0, 0)
        self._done = False
        self._yielded = 0
        self._buffer: List[Tuple[Ref, Doc]] = []
        self._rng: Optional[numpy.random.Generator] = None
        self._held = 0  # examples to come from docs already read (`holds_docs`)
        self._strings_per_doc = False  # set by `use_memory_zones`
        if state is not None:
            self._pos = tuple(state["pos"])  # type: ignore[assignment]
            self._done = bool(state["done"])
            self._yielded = int(state["yielded"])
        self._iter = self._augmented()

    def __iter__(self) -> "CorpusStream":
        return self

    def __next__(self) -> Example:
        return next(self._iter)

    def holds_docs(self) -> bool:
        """Whether the stream holds docs it has read for later examples: the shuffle
        buffer, the pieces of a split doc, an augmenter's further examples. The
        streaming evaluator ends a memory zone only where it holds none."""
        return bool(self._buffer) or self._held > 0

    def use_memory_zones(self) -> None:
        """Called by the streaming evaluator before it reads in memory zones: .spacy
        shards opened from now on bring each doc's own strings into the vocab as it is
        read, not the whole string table first (`DocBinReader.get_docs`)."""
        self._strings_per_doc = True

    def state(self) -> Dict[str, Any]:
        """The position after the latest yielded example, as a JSON-serialisable dict."""
        rng = self._rng.bit_generator.state if self._rng is not None else None
        if rng is None and self._start is not None:
            rng = self._start["rng"]
        buffer = [list(ref) for ref, _ in self._buffer]
        if self._rng is None and self._start is not None:
            buffer = self._start["buffer"]
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "pos": list(self._pos),
            "done": self._done,
            "yielded": self._yielded,
            "buffer": buffer,
            "rng": _jsonable_rng(rng),
            "settings": self.corpus._fingerprint(),
        }

    def _augmented(self) -> Iterator[Example]:
        corpus, nlp = self.corpus, self.nlp
        for ref in self._pieces():
            example = corpus._make_example(nlp, ref)
            held = self._held  # the pieces of the doc still to come
            if corpus.augmenter is dont_augment:
                yield example
                continue
            # Listed, so that the stream knows whether it holds more (`holds_docs`).
            examples = list(corpus.augmenter(nlp, example))  # type: ignore[operator]
            del example, ref
            while examples:
                self._held = held + len(examples) - 1
                yield examples.pop(0)
            self._held = held

    def _pieces(self) -> Iterator[Doc]:
        corpus, nlp = self.corpus, self.nlp
        # Built on the first call, and again when this worker's share changed (spacy
        # lean train initializes the pipeline, which reads the corpus, as one worker).
        if corpus.compact and (
            corpus._compact_chunks is None or corpus._compact_share != corpus.rank_and_size
        ):
            corpus._build_compact(nlp)
        stats = CorpusStats()
        corpus.stats = stats
        if corpus.compact:
            stats.merge(corpus._compact_stats)  # type: ignore[arg-type]
        order, rng = corpus._epoch_order(self.epoch)
        self._rng = rng
        pos, doc_start, piece_start = self._pos
        if self._start is not None:
            # With compact, the units are known only now; the rest is checked again.
            corpus._check_position(self._start, order)
            if self._start["rng"] is not None:
                rng.bit_generator.state = _rng_from_json(self._start["rng"])
            self._buffer = corpus._restore_buffer(nlp, self._start["buffer"])
        buffer = self._buffer
        stats.max_buffered = len(buffer)  # a resumed stream's restored buffer counts
        size = corpus.shuffle_buffer
        split_stats = stats if not corpus.compact else SplitStats()
        if not self._done:
            for p in range(pos, len(order)):
                unit = order[p]
                skip = doc_start if p == pos else 0
                # Resuming inside a doc: it must be this worker's next doc, with that
                # many pieces (else pieces would be skipped, or the shard's docs).
                resuming = p == pos and piece_start > 0
                pieces_of = corpus._unit_pieces(
                    nlp, unit, split_stats, skip, strings_per_doc=self._strings_per_doc
                )
                for d, pieces in pieces_of:
                    if resuming:
                        resuming = False
                        if d != doc_start or piece_start > len(pieces):
                            corpus._refuse_position(self._pos, unit, doc_start, d, pieces)
                    corpus._note_oversize(split_stats, unit, d)
                    first = piece_start if (p == pos and d == doc_start) else 0
                    for k in range(first, len(pieces)):
                        self._pos = (p, d, k + 1)
                        self._held = len(pieces) - k - 1
                        item = ((unit, d, k), pieces[k])
                        if not corpus.shuffle:
                            stats.examples += 1
                            self._yielded += 1
                            yield item[1]
                        elif len(buffer) < size:
                            buffer.append(item)
                            stats.max_buffered = max(stats.max_buffered, len(buffer))
                        else:
                            j = int(rng.integers(size))
                            out, buffer[j] = buffer[j], item
                            stats.examples += 1
                            self._yielded += 1
                            yield out[1]
                if resuming:  # the shard ended before the doc
                    corpus._refuse_position(self._pos, unit, doc_start, None, [])
            if self._start is None and not corpus.compact:  # a whole pass: all is counted
                corpus._check_doc_share(split_stats)
            self._done = True
            self._pos = (len(order), 0, 0)
        self._held = 0
        while buffer:
            j = int(rng.integers(len(buffer)))
            out = buffer[j]
            buffer[j] = buffer[-1]
            buffer.pop()
            stats.examples += 1
            self._yielded += 1
            yield out[1]
        if not corpus.compact:
            corpus._report(stats)


def _jsonable_rng(state: Any) -> Any:
    if state is None:
        return None
    inner = state["state"]
    return {
        "bit_generator": state["bit_generator"],
        "state": {"state": str(inner["state"]), "inc": str(inner["inc"])},
        "has_uint32": int(state["has_uint32"]),
        "uinteger": int(state["uinteger"]),
    }


def _rng_from_json(state: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "bit_generator": state["bit_generator"],
        "state": {"state": int(state["state"]["state"]), "inc": int(state["state"]["inc"])},
        "has_uint32": state["has_uint32"],
        "uinteger": state["uinteger"],
    }


def _whole(value: Any) -> bool:
    return type(value) is int and value >= 0


def _refuse_state(field: str, value: Any, expected: str) -> NoReturn:
    """Refuse an edited or damaged corpus state, naming the field and its value."""
    try:
        shown = str(value)[:80]
    except ValueError:  # an int with more digits than Python prints
        shown = f"a {type(value).__name__} too large to print"
    raise ValueError(
        f"The saved corpus state has {field} = {shown}, expected {expected}: "
        "it was edited or damaged (the reader never writes that). Start the epoch "
        "again without the state."
    )


_RNG_KEYS = {"bit_generator", "state", "has_uint32", "uinteger"}


def _check_rng_state(rng: Any) -> None:
    """Refuse an RNG state (as `_jsonable_rng` writes it) numpy's PCG64 would not take
    as the reader's: each field within its bit width, then set on a fresh generator."""
    refuse = _refuse_state
    if not (isinstance(rng, dict) and set(rng) == _RNG_KEYS):
        refuse("rng", rng, f"null or a PCG64 state (an object of {sorted(_RNG_KEYS)})")
    if rng["bit_generator"] != "PCG64":
        refuse("rng.bit_generator", rng["bit_generator"], "'PCG64' (the reader's generator)")
    inner = rng["state"]
    if not (isinstance(inner, dict) and set(inner) == {"state", "inc"}):
        refuse("rng.state", inner, "an object of 'state' and 'inc'")
    for key in ("state", "inc"):
        value = inner[key]
        if not (
            isinstance(value, str)
            and 0 < len(value) <= 39
            and value.isascii()
            and value.isdigit()
            and int(value) < 2**128
        ):
            refuse(f"rng.state.{key}", value, "a whole number below 2**128, in decimal digits")
    if int(inner["inc"]) % 2 == 0:
        refuse("rng.state.inc", inner["inc"], "an odd number (PCG64's increment is odd)")
    if type(rng["has_uint32"]) is not int or rng["has_uint32"] not in (0, 1):
        refuse("rng.has_uint32", rng["has_uint32"], "0 or 1")
    if not (_whole(rng["uinteger"]) and rng["uinteger"] < 2**32):
        refuse("rng.uinteger", rng["uinteger"], "a whole number below 2**32")
    try:
        numpy.random.PCG64().state = _rng_from_json(rng)
    except (TypeError, ValueError, OverflowError) as err:
        refuse("rng", rng, f"a PCG64 state numpy takes ({err})")
