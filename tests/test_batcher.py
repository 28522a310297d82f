"""spacy-lean.batch_by_tokens.v1: budget, nothing dropped, padding, fixed count."""

import random

import pytest
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


@pytest.mark.parametrize("seed", range(4))
def test_nothing_dropped_budget_kept(seed):
    items = long_tailed(3000, seed)
    batcher = TokenBudgetBatcher(size=2000, window=500, seed=seed)
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
    tight = TokenBudgetBatcher(size=2000, window=3000)
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
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenBudgetBatcher(**kwargs)
