"""Run a spacy-transformers model's spans in length-sorted groups (prediction; training on request).

spacy-transformers cuts each doc into spans (strided windows of spaCy tokens), turns
every span of a batch into wordpieces and runs them through the Hugging Face model as
one tensor padded to the batch's longest span. The spans of a window have ragged
wordpiece lengths (a doc's last window is short, and words split into more or fewer
pieces), so a large share of what the model computes is padding: 20-35% on the news-like
benchmark data, whatever order the docs come in (sorting docs by length does not sort
their spans).

`sorted_span_groups(nlp)` is a context manager that, while it is active, replaces the
forward pass of the Hugging Face layer of every spacy-transformers `Transformer` in the
pipeline, in prediction (`is_train=False`; in training too with `train=True`): the
batch's rows are sorted by their real length, cut into the groups that minimise the
wordpieces computed plus a cost per model call (`plan_groups`), each group run trimmed
to its own longest row (rounded up to a multiple of 16), and the outputs put back in the
original row order at the original padded width (positions past a row's length are zeros
instead of the model's values for padding, which nothing reads: the alignment only
points at real wordpieces). What the listeners and `doc._.trf_data` see for real
wordpieces is what the model computes for them; the only difference is float rounding
from tensors of other shapes (below 1e-5 in the tests). Training is changed only with
`train=True` (what `lean_update` does): then each group keeps its own backward pass.
"""

import contextlib
import sys
from typing import Any, Iterator, List, Optional, Sequence, Set, Tuple

import numpy
from spacy.language import Language

__all__ = ["sorted_span_groups", "plan_groups", "DEFAULT_GROUP_COST", "WIDTH_STEP"]

# What one more transformer call costs, in wordpieces of work: measured on CPU, a call
# costs about as much as 150 (4-layer 256-wide BERT) to 400 (2-layer 64-wide)
# wordpieces (benchmarks/eval_batch_budget.py); a group must save more padding than this.
DEFAULT_GROUP_COST = 256
# Group widths are rounded up to a multiple of this, so that the allocator sees a few
# tensor shapes again and again rather than a new one per group (with one width per
# group, the heap fragmented and resident memory crept up by ~5 KB per evaluated doc).
WIDTH_STEP = 16
# ids of the layers whose forward is replaced now (nested use changes nothing twice).
_ACTIVE: Set[int] = set()


def plan_groups(
    lengths: Sequence[int],
    group_cost: float = DEFAULT_GROUP_COST,
    width_step: int = WIDTH_STEP,
    max_width: Optional[int] = None,
) -> List[List[int]]:
    """Cut rows, sorted longest first, into contiguous groups that minimise the
    wordpieces computed plus `group_cost` per group: each group is run padded to its
    longest row rounded up to `width_step` (at most `max_width`). Exact (dynamic
    programming over the sorted rows, O(n^2) in numpy).

    lengths (Sequence[int]): the real length of each row.
    group_cost (float): the cost of one more group (one more model call), in wordpieces.
    width_step (int): group widths are multiples of this.
    max_width (Optional[int]): the widest a group may be run (the batch's width).
    RETURNS (List[List[int]]): row indices per group, widest group first; no two
        groups have the same width.
    """
    return [group for group, _ in _plan(lengths, group_cost, width_step, max_width)]


def _plan(
    lengths: Sequence[int], group_cost: float, width_step: int, max_width: Optional[int]
) -> List[Tuple[List[int], int]]:
    """`plan_groups`, with the width each group runs at."""
    if group_cost < 0 or width_step < 1:
        raise ValueError(
            f"group_cost must be >= 0 and width_step >= 1, got {group_cost}, {width_step}."
        )
    n = len(lengths)
    if n == 0:
        return []
    order = numpy.argsort(-numpy.asarray(lengths, dtype="int64"), kind="stable")
    widths = -(-numpy.asarray(lengths, dtype="int64")[order] // width_step) * width_step
    # A row with no wordpieces (whitespace, from a tokenizer that adds no [CLS]/[SEP])
    # still runs at a width of at least one step: a model cannot run at width 0.
    widths = numpy.maximum(widths, width_step)
    if max_width is not None:
        widths = numpy.minimum(widths, max(int(max_width), 1))
    # best[j]: the least cost of the first j sorted rows; cut[j]: where its last group starts.
    best = numpy.zeros(n + 1)
    cut = numpy.zeros(n + 1, dtype="int64")
    starts = numpy.arange(n)
    for j in range(1, n + 1):
        costs = best[:j] + (j - starts[:j]) * widths[:j] + group_cost
        i = int(numpy.argmin(costs))
        best[j], cut[j] = costs[i], i
    bounds = []
    j = n
    while j > 0:
        bounds.append((int(cut[j]), j))
        j = int(cut[j])
    groups: List[Tuple[List[int], int]] = []
    for i, j in reversed(bounds):
        width = int(widths[i])
        if groups and groups[-1][1] == width:  # the same width: one group (only with group_cost 0)
            groups[-1][0].extend(order[i:j].tolist())
        else:
            groups.append((order[i:j].tolist(), width))
    return groups


def _hf_layers(nlp: Language) -> List[Any]:
    """The Hugging Face layer of each spacy-transformers Transformer in the pipeline.
    The class is looked up, not imported: a pipeline holding one has imported it."""
    Transformer = getattr(sys.modules.get("spacy_transformers"), "Transformer", None)
    if not isinstance(Transformer, type):
        return []
    layers = []
    for _, proc in nlp.pipeline:
        if isinstance(proc, Transformer) and proc.model.layers:
            layers.append(proc.model.layers[0])
    return layers


def _take(wps: Any, rows: numpy.ndarray, width: int) -> Any:
    """The wordpieces of `rows`, trimmed to `width` (the arrays may live on a GPU)."""
    from spacy_transformers.data_classes import WordpieceBatch
    from thinc.api import get_array_module

    index = get_array_module(wps.input_ids).asarray(rows)
    picked = rows.tolist()
    return WordpieceBatch(
        strings=[wps.strings[i] for i in picked],
        input_ids=wps.input_ids[index, :width],
        attention_mask=wps.attention_mask[index, :width],
        lengths=[wps.lengths[i] for i in picked],
        token_type_ids=(
            wps.token_type_ids[index, :width] if wps.token_type_ids is not None else None
        ),
    )


@contextlib.contextmanager
def sorted_span_groups(
    nlp: Language, group_cost: float = DEFAULT_GROUP_COST, train: bool = False
) -> Iterator[int]:
    """While active, every spacy-transformers Transformer of `nlp` predicts its
    batches' spans in length-sorted groups (see the module's docstring).

    nlp (Language): the pipeline.
    group_cost (float): what one more model call costs, in wordpieces (see `plan_groups`).
    train (bool): in training passes too: each group keeps its own backward pass, and
        the gradient of the combined output is cut back into the groups' rows and
        widths (the positions past a group's width are padding, whose gradient is zero:
        the alignment points at real wordpieces only). The parameters' gradients are
        the whole batch's, up to float rounding, with dropout drawn per group.
    YIELDS (int): how many transformer layers were changed (0: nothing to do).
    """
    if not group_cost >= 0:
        raise ValueError(f"group_cost must be >= 0, got {group_cost!r}.")
    layers = [layer for layer in _hf_layers(nlp) if id(layer) not in _ACTIVE]
    originals = []
    for layer in layers:
        originals.append(layer._func)
        layer._func = _sorted_forward(layer._func, group_cost, train)
        _ACTIVE.add(id(layer))
    try:
        yield len(layers)
    finally:
        for layer, func in zip(layers, originals):
            layer._func = func
            _ACTIVE.discard(id(layer))


def _right_padded(mask: Any) -> bool:
    """Whether every row's real wordpieces come first (padding on the right, as BERT's
    and RoBERTa's tokenizers pad). A tokenizer with padding_side = "left" (XLNet's)
    puts them last: a group trimmed to its width would keep only padding, so such
    batches run whole, as in spacy-transformers."""
    if mask.shape[1] < 2:
        return True
    return not bool((mask[:, 1:] > mask[:, :-1]).any())


def _sorted_forward(forward, group_cost: float, train: bool = False):
    def sorted_forward(model, wps, is_train):
        if (is_train and not train) or len(wps) < 2 or not _right_padded(wps.attention_mask):
            return forward(model, wps, is_train)
        real = [int(x) for x in wps.attention_mask.sum(axis=1).tolist()]
        width = int(wps.input_ids.shape[1])
        plan = _plan(real, group_cost, WIDTH_STEP, width)
        if len(plan) == 1:
            return forward(model, wps, is_train)
        rows = [numpy.asarray(g, dtype="int64") for g, _ in plan]
        results = [forward(model, _take(wps, g, w), is_train) for g, (_, w) in zip(rows, plan)]
        outputs = [(output, w) for (output, _), (_, w) in zip(results, plan)]
        if not is_train:
            return _combine(outputs, rows, len(wps), width), _no_backprop
        import torch

        with torch.no_grad():  # a copy for the listeners; each group keeps its own graph
            combined = _combine(outputs, rows, len(wps), width)

        def backprop(d_output: Any) -> Any:
            d_inputs = None
            for (output, _), (_, group_backprop), g in zip(outputs, results, rows):
                d_inputs = group_backprop(_split(d_output, output, g))
            return d_inputs

        return combined, backprop

    return sorted_forward


def _group_index(rows: numpy.ndarray, shape: Sequence[int], device: Any) -> Tuple[Any, ...]:
    """Index of a group's block in a whole-batch tensor: its rows, and the group's
    extent on every later axis."""
    import torch

    return (torch.as_tensor(rows, device=device),) + tuple(slice(0, s) for s in shape[1:])


def _split(d_output: Any, like: Any, rows: numpy.ndarray) -> Any:
    """The gradient of one group's output `like`: its rows of `d_output`, cut to the
    group output's extent on every later axis."""
    import torch

    def cut(value, shaped):
        if not isinstance(value, torch.Tensor) or not isinstance(shaped, torch.Tensor):
            return value
        return value[_group_index(rows, shaped.shape, value.device)]

    # spacy-transformers' gradient names its fields by position ("output_0" for
    # last_hidden_state): match them to the output's by name, else by position.
    shaped = list(like.values())
    fields = {
        key: cut(value, like[key] if key in like else shaped[i] if i < len(shaped) else None)
        for i, (key, value) in enumerate(d_output.items())
    }
    return type(d_output)(**fields)


def _combine(outputs, rows: List[numpy.ndarray], n_rows: int, width: int) -> Any:
    """One model output with every group's tensors back at their rows."""
    first = outputs[0][0]
    widths = [w for _, w in outputs]
    fields = {
        key: _merge([out[key] for out, _ in outputs], widths, rows, n_rows, width)
        for key in first.keys()
    }
    return type(first)(**fields)


def _merge(values, widths, rows, n_rows, width):
    import torch

    first = values[0]
    if isinstance(first, tuple):
        return tuple(
            _merge([v[k] for v in values], widths, rows, n_rows, width) for k in range(len(first))
        )
    if not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] != len(rows[0]):
        return first
    # Axes that follow the group's padded length hold the group's width in every group.
    length_axes = [
        a for a in range(1, first.dim()) if all(v.shape[a] == w for v, w in zip(values, widths))
    ]
    shape = [n_rows] + [
        width if a in length_axes else first.shape[a] for a in range(1, first.dim())
    ]
    out = first.new_zeros(shape)
    for value, g in zip(values, rows):
        out[_group_index(g, value.shape, value.device)] = value
    return out


def _no_backprop(d_output: Any) -> Any:
    raise RuntimeError("This pass ran with is_train=False: it has no backward pass.")
