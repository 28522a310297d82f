"""spacy-lean.batch_by_tokens.v1: budget, nothing dropped, padding, fixed count."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import spacy
from spacy.training import Example
from spacy.training.batchers import minibatch_by_padded_size
from spacy.util import registry
from thinc.api import compounding

from spacy_lean import synthetic
from spacy_lean.corpus import TokenBudgetBatcher, WordpieceCounter, configure_batch_by_tokens_v1


def long_tailed(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [["x"] * min(1 + int(rng.lognormvariate(3, 0.9)), 1500) for _ in range(n)]


def check_batches(items, batches, budget):
    assert sorted(map(id, items)) == sorted(id(x) for b in batches for x in b)
    for batch in batches:
        padded = max(len(x) for x in batch) * len(batch)
        assert padded <= budget or len(batch) == 1


def window_of(items, window):
    """Index of the read-ahead window each item falls in, by identity."""
    return {id(x): i // window for i, x in enumerate(items)}


def padding(batches):
    padded = sum(max(len(x) for x in b) * len(b) for b in batches)
    return 1 - sum(len(x) for b in batches for x in b) / padded


@pytest.mark.parametrize("seed", range(4))
def test_nothing_dropped_budget_kept(seed):
    items = long_tailed(3000, seed)
    batcher = TokenBudgetBatcher(size=2000, window=500, seed=seed, padding_scope="batch")
    batches = list(batcher(items))
    check_batches(items, batches, 2000)
    stats = batcher.stats
    assert stats.items == 3000 and stats.batches == len(batches)
    assert stats.tokens == sum(len(x) for x in items)
    padded = sum(max(len(x) for x in b) * len(b) for b in batches)
    assert stats.padded_tokens == padded
    assert stats.padding_fraction == pytest.approx(1 - stats.tokens / padded)
    assert stats.oversize == sum(1 for x in items if len(x) > 2000)
    for batch in batches:  # each batch within the padding tolerance
        padded = max(len(x) for x in batch) * len(batch)
        assert padded - sum(len(x) for x in batch) <= 0.05 * padded


def test_max_padding_one_fills_batches():
    items = long_tailed(3000, 5)
    tight = TokenBudgetBatcher(size=2000, window=3000, padding_scope="batch")
    full = TokenBudgetBatcher(size=2000, window=3000, max_padding=1.0)
    check_batches(items, list(full(items)), 2000)
    list(tight(items))
    assert full.stats.batches < tight.stats.batches
    assert full.stats.padding_fraction > tight.stats.padding_fraction


def test_batch_equal_to_budget_is_kept_where_spacy_drops_it():
    items = [["x"] * 10 for _ in range(20)]  # every batch of 10 is exactly 100
    ours = list(TokenBudgetBatcher(size=100, window=20, shuffle=False)(items))
    assert [len(b) for b in ours] == [10, 10]
    theirs = list(minibatch_by_padded_size(items, size=100, buffer=20, discard_oversize=True))
    assert sum(len(b) for b in theirs) < 20


def test_oversize_alone_and_counted():
    items = [["x"] * 5, ["x"] * 300, ["x"] * 6, ["x"] * 7]
    batcher = TokenBudgetBatcher(size=100, window=10, shuffle=False)
    batches = list(batcher(items))
    assert [len(x) for x in batches[-1]] == [300]  # the sorted window's last
    assert batcher.stats.oversize == 1
    check_batches(items, batches, 100)


def test_fixed_count_mode():
    items = long_tailed(103, seed=1)
    batcher = TokenBudgetBatcher(count=10, window=50, shuffle=False)
    batches = list(batcher(items))
    assert sorted(len(b) for b in batches) == [3] + [10] * 10
    for b in batches:  # similar lengths together
        lens = sorted(len(x) for x in b)
        assert lens == [len(x) for x in b]


def test_sorted_window_pads_less_than_batch_by_padded():
    items = long_tailed(6000, seed=2)
    ours = configure_batch_by_tokens_v1()  # the defaults
    list(ours(items))
    theirs = list(minibatch_by_padded_size(items, size=2000, buffer=256))
    real = sum(len(x) for x in items)
    their_pad = 1 - real / sum(max(len(x) for x in b) * len(b) for b in theirs)
    assert ours.stats.padding_fraction < 0.05 < their_pad


def test_size_schedule():
    items = long_tailed(500, seed=3)
    batches = list(TokenBudgetBatcher(size=compounding(100, 1000, 1.5), window=100)(items))
    assert sum(len(b) for b in batches) == 500


def test_a_list_of_sizes_keeps_its_last_budget():
    """The docs allow a list: once it ran out, its StopIteration surfaced as
    "RuntimeError: generator raised StopIteration". Its last budget now goes on."""
    batcher = TokenBudgetBatcher(size=[50, 100], window=100, get_length=lambda x: x)
    batches = list(batcher([10] * 400))
    assert sum(len(b) for b in batches) == 400
    assert max(len(b) for b in batches) == 10 and min(len(b) for b in batches) >= 5
    assert sum(len(b) == 10 for b in batches) >= 38  # 100 went on after the list's end
    with pytest.raises(ValueError, match="size is an empty list"):
        list(TokenBudgetBatcher(size=[], window=100, get_length=lambda x: x)([10] * 4))


def test_shuffle_seeded():
    items = long_tailed(400, seed=4)
    a = [[len(x) for x in b] for b in TokenBudgetBatcher(size=500, window=400, seed=1)(items)]
    b = [[len(x) for x in b] for b in TokenBudgetBatcher(size=500, window=400, seed=1)(items)]
    c = [
        [len(x) for x in b] for b in TokenBudgetBatcher(size=500, window=400, shuffle=False)(items)
    ]
    assert a == b and a != c and sorted(map(tuple, a)) == sorted(map(tuple, c))


def test_examples_and_wordpiece_lengths(tiny_transformer):
    nlp = spacy.blank("en")
    docs = synthetic.make_ner_docs(nlp, 40, seed=3)
    examples = [Example(nlp.make_doc(d.text), d) for d in docs]
    counter = WordpieceCounter(tiny_transformer)
    batcher = configure_batch_by_tokens_v1(
        size=800, window=40, wordpiece_tokenizer=str(tiny_transformer)
    )
    batches = list(batcher(examples))
    assert sum(len(b) for b in batches) == 40
    for batch in batches:
        assert max(counter(eg) for eg in batch) * len(batch) <= 800 or len(batch) == 1
    assert batcher.stats.tokens == sum(counter(eg) for eg in examples)
    assert batcher.stats.tokens > sum(len(eg) for eg in examples)


def test_registered_and_resolves_from_config():
    cfg = {"b": {"@batchers": "spacy-lean.batch_by_tokens.v1", "size": 1000, "window": 100}}
    batcher = registry.resolve(cfg)["b"]
    assert isinstance(batcher, TokenBudgetBatcher) and batcher.window == 100


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"size": 0}, "size .* must be >= 1, got 0"),
        ({"window": 0}, "window must be >= 1"),
        ({"count": -1}, "count must be >= 0"),
        ({"max_padding": 1.5}, "max_padding must be in"),
        ({"padding_scope": "epoch"}, "padding_scope must be 'window' or 'batch', got 'epoch'"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenBudgetBatcher(**kwargs)


@pytest.mark.parametrize("seed", range(3))
def test_window_scope_keeps_each_windows_padding(seed):
    items = long_tailed(3000, seed)
    batcher = TokenBudgetBatcher(size=2000, window=700, seed=seed)
    batches = list(batcher(items))
    check_batches(items, batches, 2000)
    where = window_of(items, 700)
    by_window = {}
    for batch in batches:
        windows = {where[id(x)] for x in batch}
        assert len(windows) == 1  # a batch never mixes windows
        by_window.setdefault(windows.pop(), []).append(batch)
    assert sorted(by_window) == list(range(5))
    for window_batches in by_window.values():
        assert padding(window_batches) <= 0.05 + 1e-9
    assert batcher.stats.padding_fraction <= 0.05


def test_window_scope_fills_the_long_tail():
    """The per-batch cap makes many tiny batches where lengths are sparse; the window
    scope fills them, and a step carries at least as many real tokens as spaCy's
    batch_by_padded (same budget) while padding stays within the cap."""
    items = long_tailed(4000, seed=7)
    per_batch = TokenBudgetBatcher(size=2000, window=2000, padding_scope="batch")
    per_window = TokenBudgetBatcher(size=2000, window=2000)
    small = [list(per_batch(items)), list(per_window(items))]
    real = [sum(len(x) for x in items) / len(b) for b in small]
    tiny = [sum(1 for b in bs if sum(len(x) for x in b) < 500) for bs in small]
    theirs = list(minibatch_by_padded_size(items, size=2000, buffer=256))
    assert real[1] > 1.2 * real[0] and tiny[1] < 0.6 * tiny[0]
    assert real[1] >= sum(len(x) for x in items) / len(theirs)
    assert per_window.stats.padding_fraction <= 0.05 < padding(theirs)


def test_window_shuffled_before_sorting_reproducibly():
    """Items of equal length are batched at random (not in arrival order), the same
    way for the same seed; nothing is lost or duplicated."""
    items = [["x"] * 10 for _ in range(200)]

    def members(seed):
        batcher = TokenBudgetBatcher(size=100, window=200, seed=seed)
        batches = list(batcher(items))
        check_batches(items, batches, 100)
        return [sorted(map(id, b)) for b in batches]

    first = members(1)
    assert first == members(1)
    assert sorted(map(tuple, first)) != sorted(map(tuple, members(2)))
    in_order = [sorted(map(id, items[i : i + 10])) for i in range(0, 200, 10)]
    assert sorted(map(tuple, first)) != sorted(map(tuple, in_order))
    unshuffled = list(TokenBudgetBatcher(size=100, window=200, shuffle=False)(items))
    assert [sorted(map(id, b)) for b in unshuffled] == in_order


def test_epochs_differ_and_replay_from_the_seed():
    """The batcher's only state is its generator: a second call (the next epoch)
    shuffles differently, and a new batcher with the same seed replays both epochs."""
    items = long_tailed(800, seed=8)

    def two_epochs():
        batcher = TokenBudgetBatcher(size=1000, window=300, seed=5)
        return [[[id(x) for x in b] for b in batcher(items)] for _ in range(2)]

    a, b = two_epochs(), two_epochs()
    assert a == b and a[0] != a[1]
    for epoch in a:
        assert sorted(i for batch in epoch for i in batch) == sorted(map(id, items))


def check_schedule_kept(items, budgets, batches):
    """Nothing lost, and batch k within budget k (or alone)."""
    check_batches(items, batches, max(budgets))
    for budget, batch in zip(budgets, batches):
        assert max(len(x) for x in batch) * len(batch) <= budget or len(batch) == 1


def test_schedule_budget_per_batch_across_windows():
    items = long_tailed(900, seed=9)
    budgets = list(itertools.islice(compounding(300, 3000, 1.05), 2000))
    batcher = TokenBudgetBatcher(size=iter(budgets), window=200, shuffle=False)
    check_schedule_kept(items, budgets, list(batcher(items)))
    assert batcher.stats.padding_fraction <= 0.05


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_schedule_is_kept_in_step_order_when_shuffled(seed):
    """With `shuffle` (the default), a window's batches were shuffled after being cut
    within the budgets of steps k, k+1, ...: a batch cut within a late, large budget
    came out at an early step (the first step of a warm-up padded to 1,000 against a
    budget of 100). They are shuffled only among batches of the same budget now."""
    items = long_tailed(900, seed=9)
    budgets = list(itertools.islice(compounding(100, 1000, 1.5), 2000))
    batcher = TokenBudgetBatcher(size=iter(budgets), window=300, seed=seed)
    check_schedule_kept(items, budgets, list(batcher(items)))
    # Past the warm-up (one budget), the batches are still shuffled.
    plain = TokenBudgetBatcher(size=[100, 1000], window=300, seed=seed, get_length=len)
    late = list(plain(items))[1:]
    longest = [max(len(x) for x in b) for b in late[: len(late) // 2]]
    assert longest != sorted(longest)


@pytest.mark.parametrize("size", [[0, 2000], [-5], [100, float("nan")]])
def test_a_bad_budget_in_a_list_or_schedule_is_refused(size):
    """A list or schedule's budgets were not checked: 0 or -5 made every item a batch
    of its own, counted as oversize, with nothing said."""
    batcher = TokenBudgetBatcher(size=size, window=100, get_length=lambda x: x)
    with pytest.raises(ValueError, match="must be >= 1 for every batch, but its list or schedule"):
        list(batcher([10] * 40))


@pytest.mark.parametrize("size", ["2000", 1.5, True, None])
def test_a_size_of_another_type_is_refused(size):
    """size="2000" was read as the budgets 2, 0, 0, 0 and 1.5 failed deep inside."""
    with pytest.raises(TypeError, match="must be an int, a list of ints or a schedule"):
        TokenBudgetBatcher(size=size)
    with pytest.raises(TypeError, match="window must be a whole number"):
        TokenBudgetBatcher(window=2.5)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=300),
    size=st.integers(20, 2000),
    window=st.integers(1, 120),
    max_padding=st.sampled_from([0.0, 0.05, 0.2, 1.0]),
    scope=st.sampled_from(["window", "batch"]),
    seed=st.integers(0, 3),
)
def test_property_nothing_lost_budget_and_padding_kept(
    lengths, size, window, max_padding, scope, seed
):
    items = [["x"] * n for n in lengths]
    batcher = TokenBudgetBatcher(
        size=size, window=window, max_padding=max_padding, padding_scope=scope, seed=seed
    )
    batches = list(batcher(items))
    check_batches(items, batches, size)
    assert batcher.stats.items == len(items) and batcher.stats.batches == len(batches)
    groups = [[b] for b in batches]
    if scope == "window":
        where = window_of(items, window)
        by_window = {}
        for b in batches:
            by_window.setdefault(where[id(b[0])], []).append(b)
        groups = list(by_window.values())
    for group in groups:
        assert padding(group) <= max_padding + 1e-9
