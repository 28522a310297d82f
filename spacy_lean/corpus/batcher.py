"""`spacy-lean.batch_by_tokens.v1`: batches within a token budget, from a read-ahead
window sorted by length, never dropping anything.

Batches are filled up to the budget; the padding tolerance (`max_padding`) applies to
the window's batches together by default (`padding_scope = "window"`), so the sparse
long tail of a window does not become many tiny batches: on a news-like corpus a
per-batch cap made one step in ten carry ~150 real tokens of a 2,000 budget, and
~20% fewer real tokens per step than spaCy's `batch_by_padded` (issue 15,
benchmarks/train_accuracy.py).
"""

import itertools
import numbers
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
    padding_scope: str = "window",
) -> "TokenBudgetBatcher":
    """Create a batcher that fills batches up to a padded-token budget.

    size (int / Sequence[int] / schedule): the budget, longest x count, per batch.
    window (int): items read ahead and sorted by length before batching.
    max_padding (float): close a batch early rather than let padding exceed this
        share (of the window's batches together, or of each batch: `padding_scope`);
        1.0: fill every batch up to the budget.
    count (int): if > 0, fixed-count mode: batches of `count` items of similar length,
        and `size` is ignored.
    shuffle (bool): shuffle each window before sorting it (items of equal length are
        batched together at random) and the order of the batches made from it.
    seed (int): seed of those shuffles.
    wordpiece_tokenizer (Optional[str]): measure lengths in this tokenizer's wordpieces.
    get_length (Optional[Callable]): length of an item; default: tokens of the
        predicted doc of an Example, or len().
    padding_scope (str): "window" (default): `max_padding` bounds the padding of a
        window's batches together, and batches fill up to the budget unless that
        share would be exceeded; "batch": it bounds each batch (more, smaller batches
        in the long tail: fewer real tokens per step).
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
        padding_scope=padding_scope,
    )


class TokenBudgetBatcher:
    """Bucketed read-ahead batching. Reads `window` items, sorts them by length, and
    cuts the sorted run into batches whose padded size (longest x count) stays within
    the budget; a batch whose padded size equals the budget is kept. A batch is also
    closed when the next item would make its padding exceed a cap: `max_padding` with
    `padding_scope = "batch"`; with "window", the largest cap for which the padding of
    the window's batches together stays within `max_padding`. With `shuffle`, the
    window is shuffled before the (stable) sort and its batches after it, both from
    one seeded generator. An item longer than the budget by itself becomes a batch
    alone (counted in `stats.oversize`).
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
        padding_scope: str = "window",
    ) -> None:
        if isinstance(size, numbers.Integral) and not isinstance(size, bool):
            size = int(size)  # numpy's ints too
        if isinstance(size, (str, bytes, float, bool)) or not (
            isinstance(size, int) or hasattr(size, "__iter__")
        ):
            raise TypeError(
                "size (the padded-token budget) must be an int, a list of ints or a "
                f"schedule, got {size!r}."
            )
        if isinstance(size, int) and size < 1:
            raise ValueError(f"size (the padded-token budget) must be >= 1, got {size}.")
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be a whole number of items, got {window!r}.")
        window = int(window)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}.")
        if not 0.0 <= max_padding <= 1.0:
            raise ValueError(f"max_padding must be in [0, 1], got {max_padding}.")
        if count < 0:
            raise ValueError(f"count must be >= 0 (0: batch by tokens), got {count}.")
        if padding_scope not in ("window", "batch"):
            raise ValueError(f"padding_scope must be 'window' or 'batch', got {padding_scope!r}.")
        self.padding_scope = padding_scope
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
        sizes = _Budgets(self.size)
        it = iter(items)
        while True:
            window = list(itertools.islice(it, self.window))
            if not window:
                return
            if self.shuffle:
                self.rng.shuffle(window)
            batches = self._batch_window(window, sizes)
            if self.shuffle:
                if sizes.fixed or self.count:  # (batches of `count` items: no budget)
                    self.rng.shuffle(batches)
                else:
                    # Batch k was cut within the k-th budget of the schedule: shuffled
                    # only among batches of the same budget, so the batch yielded k-th
                    # stays within it (a warm-up's small first budgets too).
                    n = len(batches)
                    budgets = [sizes.budget_of(k - n) for k in range(n)]
                    batches = _shuffled_within_budgets(batches, budgets, self.rng)
            for batch in batches:
                yield [window[i] for i in batch]

    def _batch_window(self, window: List[Any], sizes: "_Budgets") -> List[List[int]]:
        lengths = [self.get_length(item) for item in window]
        order = sorted(range(len(window)), key=lengths.__getitem__)
        if self.count:
            batches = [order[i : i + self.count] for i in range(0, len(order), self.count)]
        elif self.padding_scope == "batch" or self.max_padding >= 1.0:
            batches = self._cut(order, lengths, sizes, self.max_padding)
        else:
            batches = self._cut_window(order, lengths, sizes)
        sizes.consume(len(batches))
        for k, batch in enumerate(batches):
            oversize = not self.count and lengths[batch[0]] > sizes.budget_of(k - len(batches))
            self.stats.add([lengths[j] for j in batch], oversize=oversize)
        return batches

    def _cut_window(
        self, order: List[int], lengths: List[int], sizes: "_Budgets"
    ) -> List[List[int]]:
        """The fewest batches whose padding, together, stays within `max_padding`: the
        sorted run cut with the largest per-batch cap that keeps the window's padding
        within it (bisection; the cap `max_padding` itself always does)."""
        best = self._cut(order, lengths, sizes, self.max_padding)
        lo, hi = self.max_padding, 1.0
        for step in range(11):
            cap = 1.0 if step == 0 else (lo + hi) / 2
            batches = self._cut(order, lengths, sizes, cap)
            if _padding(batches, lengths) <= self.max_padding:
                if len(batches) < len(best):
                    best = batches
                if cap == 1.0:
                    break
                lo = cap
            else:
                hi = cap
        return best

    def _cut(
        self, order: List[int], lengths: List[int], sizes: "_Budgets", cap: float
    ) -> List[List[int]]:
        """Cut the sorted run into batches within budget k (for batch k) whose padding
        is at most `cap` of each; an item over its budget is a batch alone."""
        batches: List[List[int]] = []
        batch: List[int] = []
        total = 0
        for i in order:
            length = lengths[i]
            if batch:
                padded = length * (len(batch) + 1)
                if padded <= sizes.peek(len(batches)) and (padded - total - length <= cap * padded):
                    batch.append(i)
                    total += length
                    continue
                batches.append(batch)
            if length > sizes.peek(len(batches)):
                batches.append([i])
                batch, total = [], 0
            else:
                batch, total = [i], length
        if batch:
            batches.append(batch)
        return batches


def _shuffled_within_budgets(
    batches: List[List[int]], budgets: List[int], rng: random.Random
) -> List[List[int]]:
    """The batches, each moved only to a place whose budget is its own."""
    out = list(batches)
    places: Dict[int, List[int]] = {}
    for k, budget in enumerate(budgets):
        places.setdefault(budget, []).append(k)
    for where in places.values():
        group = [batches[k] for k in where]
        rng.shuffle(group)
        for k, batch in zip(where, group):
            out[k] = batch
    return out


def _padding(batches: List[List[int]], lengths: List[int]) -> float:
    """Padding share of batches of sorted indices (the last of each is its longest)."""
    padded = sum(lengths[b[-1]] * len(b) for b in batches)
    real = sum(lengths[i] for b in batches for i in b)
    return 1.0 - real / padded if padded else 0.0


class _Budgets:
    """The per-batch budgets (an int, or a schedule drawn once per batch), readable
    ahead of use so a window can be cut several ways before its batches are taken."""

    def __init__(self, size: Sizing) -> None:
        self._fixed = size if isinstance(size, int) else None
        self._iter = None if isinstance(size, int) else iter(size)
        self._ahead: List[int] = []
        self._last: List[int] = []
        self._drawn: Optional[int] = None  # the latest budget drawn from `size`

    def peek(self, k: int) -> int:
        """The budget of the k-th batch from now."""
        if self._fixed is not None:
            return self._fixed
        while len(self._ahead) <= k:
            value = next(self._iter, None)  # type: ignore[arg-type]
            if value is None:
                # A list ran out (a schedule does not): its last budget from then on.
                # Before, its StopIteration ended the batcher as a RuntimeError.
                if self._drawn is None:
                    raise ValueError("batch_by_tokens: size is an empty list: give a budget.")
                value = self._drawn
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 1:
                raise ValueError(
                    "size (the padded-token budget) must be >= 1 for every batch, but its "
                    f"list or schedule gave {value!r}. Give budgets of at least 1."
                )
            self._drawn = int(value)
            self._ahead.append(self._drawn)
        return self._ahead[k]

    @property
    def fixed(self) -> bool:
        """One budget for every batch (an int)."""
        return self._fixed is not None

    def consume(self, n: int) -> None:
        """Take the next `n` budgets (for `budget_of`)."""
        self._last = [self.peek(k) for k in range(n)]
        del self._ahead[:n]

    def budget_of(self, k: int) -> int:
        """The budget of a batch taken by the latest `consume` (negative index)."""
        return self._fixed if self._fixed is not None else self._last[k]
