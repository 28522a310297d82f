"""`spacy-lean.batch_by_tokens.v1`: batches within a token budget, from a read-ahead
window sorted by length, never dropping anything."""

import itertools
import random
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union

from spacy.tokens import Doc
from spacy.training import Example
from spacy.util import registry

from .lengths import WordpieceCounter, token_length

Sizing = Union[int, Sequence[int], Iterable[int]]


@dataclass
class BatchStats:
    """Counts over the batches a batcher made. `padding_fraction` is the share of the
    padded batch (longest x count, summed over batches) that is padding."""

    batches: int = 0
    items: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    oversize: int = 0
    max_padded: int = 0

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0

    def add(self, lengths: Sequence[int], oversize: bool = False) -> None:
        padded = max(lengths) * len(lengths)
        self.batches += 1
        self.items += len(lengths)
        self.tokens += sum(lengths)
        self.padded_tokens += padded
        self.max_padded = max(self.max_padded, padded)
        self.oversize += int(oversize)

    def merge(self, other: "BatchStats") -> "BatchStats":
        for key in ("batches", "items", "tokens", "padded_tokens", "oversize"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.max_padded = max(self.max_padded, other.max_padded)
        return self

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["padding_fraction"] = self.padding_fraction
        return out


def _default_length(item: Any) -> int:
    if isinstance(item, (Doc, Example)):
        return token_length(item)
    return len(item)


@registry.batchers("spacy-lean.batch_by_tokens.v1")
def configure_batch_by_tokens_v1(
    *,
    size: Sizing = 2000,
    window: int = 5000,
    max_padding: float = 0.05,
    count: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    wordpiece_tokenizer: Optional[str] = None,
    get_length: Optional[Callable[[Any], int]] = None,
) -> "TokenBudgetBatcher":
    """Create a batcher that fills batches up to a padded-token budget.

    size (int / Sequence[int] / schedule): the budget, longest x count, per batch.
    window (int): items read ahead and sorted by length before batching.
    max_padding (float): close a batch early rather than let padding exceed this
        share of it (1.0: fill every batch up to the budget).
    count (int): if > 0, fixed-count mode: batches of `count` items of similar length,
        and `size` is ignored.
    shuffle (bool): shuffle the order of the batches made from one window.
    seed (int): seed of that shuffle.
    wordpiece_tokenizer (Optional[str]): measure lengths in this tokenizer's wordpieces.
    get_length (Optional[Callable]): length of an item; default: tokens of the
        predicted doc of an Example, or len().
    """
    if wordpiece_tokenizer and get_length is not None:
        raise ValueError("Give either wordpiece_tokenizer or get_length, not both.")
    if wordpiece_tokenizer:
        get_length = WordpieceCounter(wordpiece_tokenizer)
    return TokenBudgetBatcher(
        size=size,
        window=window,
        max_padding=max_padding,
        count=count,
        shuffle=shuffle,
        seed=seed,
        get_length=get_length,
    )


class TokenBudgetBatcher:
    """Bucketed read-ahead batching. Reads `window` items, sorts them by length, and
    cuts the sorted run into batches whose padded size (longest x count) stays within
    the budget; a batch whose padded size equals the budget is kept. A batch is also
    closed when the next item would make its padding exceed `max_padding`. An item longer
    than the budget by itself becomes a batch alone (counted in `stats.oversize`).
    Nothing is dropped. `stats` accumulates over calls (`reset_stats()` clears it).
    """

    def __init__(
        self,
        *,
        size: Sizing = 2000,
        window: int = 5000,
        max_padding: float = 0.05,
        count: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        get_length: Optional[Callable[[Any], int]] = None,
    ) -> None:
        if isinstance(size, int) and size < 1:
            raise ValueError(f"size (the padded-token budget) must be >= 1, got {size}.")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}.")
        if not 0.0 <= max_padding <= 1.0:
            raise ValueError(f"max_padding must be in [0, 1], got {max_padding}.")
        if count < 0:
            raise ValueError(f"count must be >= 0 (0: batch by tokens), got {count}.")
        self.size = size
        self.window = window
        self.max_padding = max_padding
        self.count = count
        self.shuffle = shuffle
        self.rng = random.Random(seed)
        self.get_length = get_length if get_length is not None else _default_length
        self.stats = BatchStats()

    def reset_stats(self) -> None:
        self.stats = BatchStats()

    def __call__(self, items: Iterable[Any]) -> Iterator[List[Any]]:
        sizes = itertools.repeat(self.size) if isinstance(self.size, int) else iter(self.size)
        it = iter(items)
        while True:
            window = list(itertools.islice(it, self.window))
            if not window:
                return
            batches = self._batch_window(window, sizes)
            if self.shuffle:
                self.rng.shuffle(batches)
            for batch in batches:
                yield [window[i] for i in batch]

    def _batch_window(self, window: List[Any], sizes: Iterator[int]) -> List[List[int]]:
        lengths = [self.get_length(item) for item in window]
        order = sorted(range(len(window)), key=lengths.__getitem__)
        batches: List[List[int]] = []
        if self.count:
            for i in range(0, len(order), self.count):
                batch = order[i : i + self.count]
                batches.append(batch)
                self.stats.add([lengths[j] for j in batch])
            return batches
        budget = next(sizes)
        batch: List[int] = []
        total = 0
        for i in order:
            length = lengths[i]
            if length > budget:
                if batch:
                    batches.append(batch)
                    self.stats.add([lengths[j] for j in batch])
                    budget = next(sizes)
                batches.append([i])
                self.stats.add([length], oversize=True)
                batch = []
                total = 0
                budget = next(sizes)
            elif not batch or self._fits(length, len(batch), total, budget):
                batch.append(i)
                total += length
            else:
                batches.append(batch)
                self.stats.add([lengths[j] for j in batch])
                budget = next(sizes)
                batch = [i] if length <= budget else []
                total = length if batch else 0
                if not batch:
                    batches.append([i])
                    self.stats.add([length], oversize=True)
                    budget = next(sizes)
        if batch:
            batches.append(batch)
            self.stats.add([lengths[j] for j in batch])
        return batches

    def _fits(self, length: int, count: int, total: int, budget: int) -> bool:
        """Whether an item of `length` (the longest so far) joins a batch of `count`
        items of `total` length: within the budget and the padding tolerance."""
        padded = length * (count + 1)
        return padded <= budget and padded - (total + length) <= self.max_padding * padded
