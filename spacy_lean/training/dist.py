"""Data-parallel plumbing for `spacy lean train`: the process group, a fixed list of
every trainable parameter, the gradient all-reduce, JSON collectives, the optimizer
state on disk (numpy .npz, no pickle). The local launcher is in launch.py.

One code path for 1 and N processes: with one process the collectives do nothing.
"""

import datetime
import json
import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy

from ._nodes import enabled_grad_scalers

# Elements per all-reduce call: large parameter sets are reduced in buckets of this
# size, so the flat copy never holds more than one bucket beyond the gradients.
DEFAULT_BUCKET_ELEMENTS = 1 << 24
DEFAULT_TIMEOUT_S = 600.0


class RankFailedError(RuntimeError):
    """A rank of a data-parallel run died or failed."""


class TrainingStateError(ValueError):
    """A saved training state (`training-state/state.json` or `optimizer.npz`) that a
    resumed run cannot use: missing, damaged, edited, or not what `spacy lean train`
    writes. The message names the file, the value and what to do."""


# What to do with a training state that cannot be used.
STATE_FIX = (
    "Restore training-state/ from a copy of the run, or train again without --resume "
    "(into another --output folder to keep this one)."
)


@dataclass
class DistContext:
    """Where this process stands in the run: rank, world size, local rank and device.

    With `world_size == 1` every collective returns its input unchanged.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    gpu_id: int = -1
    backend: Optional[str] = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def device(self):
        import torch

        if self.gpu_id >= 0 and self.backend == "nccl":
            return torch.device("cuda", self.gpu_id)
        return torch.device("cpu")

    def init(self) -> "DistContext":
        """Join the process group (env:// rendezvous: MASTER_ADDR/MASTER_PORT, RANK,
        WORLD_SIZE), with a timeout so a dead rank ends the run instead of hanging it."""
        if not self.active:
            return self
        import torch.distributed as dist

        if not dist.is_available():  # pragma: no cover - every torch wheel has it
            raise RuntimeError("torch.distributed is not available in this torch build.")
        if dist.is_initialized():
            return self
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise ValueError(
                    f"{name} is not set: start the run with `spacy lean train --nproc N` or "
                    "under torchrun, which set it."
                )
        self.backend = self.backend or ("nccl" if self.gpu_id >= 0 else "gloo")
        kwargs: Dict[str, Any] = {}
        if self.backend == "nccl":  # pragma: no cover - needs GPUs
            import torch

            kwargs["device_id"] = torch.device("cuda", self.gpu_id)
        dist.init_process_group(
            self.backend,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            **kwargs,
        )
        self.initialized_here = True
        return self

    def close(self) -> None:
        if self.initialized_here:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.initialized_here = False

    # -- collectives --------------------------------------------------------------

    def all_reduce_sum(self, values: Sequence[float]) -> numpy.ndarray:
        """Sum a short vector of numbers over the ranks (float64 on the CPU side)."""
        array = numpy.asarray(values, dtype="float64")
        if not self.active:
            return array
        import torch
        import torch.distributed as dist

        tensor = torch.as_tensor(array, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.cpu().numpy()

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def all_gather_json(self, obj: Any) -> List[Any]:
        """Gather one JSON-serialisable object from every rank, in rank order.

        The objects travel as UTF-8 JSON in byte tensors: nothing is unpickled.
        """
        if not self.active:
            return [obj]
        import torch
        import torch.distributed as dist

        data = json.dumps(obj).encode("utf8")
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        return [
            json.loads(bytes(t[: int(s.item())].cpu().numpy()).decode("utf8"))
            for t, s in zip(gathered, sizes)
        ]


BACKENDS = ("auto", "nccl", "gloo")


def check_backend(backend: str, gpu_ids: Sequence[int]) -> None:
    """Raise ValueError unless `backend` is one of BACKENDS and fits the devices."""
    if backend not in BACKENDS:
        raise ValueError(f"--dist-backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")
    if backend == "nccl" and not gpu_ids:
        raise ValueError(
            "--dist-backend nccl needs GPUs: give --gpu-ids (e.g. 0,1), or use gloo (or auto) "
            "on the CPU."
        )


def context_from_env(
    gpu_ids: Sequence[int] = (), timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "auto"
) -> DistContext:
    """Read torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK); (0, 1, 0) when unset.

    gpu_ids (Sequence[int]): the GPUs of this machine's ranks; local rank i uses
        gpu_ids[i % len(gpu_ids)]. Empty: CPU.
    backend (str): "auto" (nccl with GPUs, gloo on the CPU), "nccl" or "gloo". gloo with
        GPUs trains on the GPUs and sums the gradients through host memory: slower than
        nccl, but it works where nccl does not, e.g. several ranks sharing one GPU.
    """
    check_backend(backend, gpu_ids)

    def read(name: str, default: int) -> int:
        value = os.environ.get(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} must be an integer.") from None

    world = read("WORLD_SIZE", 1)
    rank = read("RANK", 0)
    local_rank = read("LOCAL_RANK", rank if world > 1 else 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"RANK={rank} and WORLD_SIZE={world} do not fit: need 0 <= RANK < WORLD_SIZE."
        )
    if world > 1:  # checked before the pipeline is initialized (minutes with a transformer)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise ValueError(
                    f"{name} is not set (RANK={rank}, WORLD_SIZE={world}): start the run with "
                    "`spacy lean train --nproc N` or under torchrun, which set it, or set "
                    "MASTER_ADDR and MASTER_PORT to rank 0's address and a free port there."
                )
    gpu_id = gpu_ids[local_rank % len(gpu_ids)] if gpu_ids else -1
    chosen = None if backend == "auto" else backend
    return DistContext(rank, world, local_rank, gpu_id, backend=chosen, timeout_s=timeout_s)


# -- parameters ---------------------------------------------------------------------


@dataclass
class ParamEntry:
    """One trainable parameter: a thinc parameter of a node, or a torch parameter
    inside a PyTorchShim. `name` is stable across processes and runs of one config."""

    name: str
    key: Tuple[int, str]  # the optimizer's key for it
    shape: Tuple[int, ...]
    node: Any = None
    param_name: str = ""
    torch_param: Any = None

    @property
    def size(self) -> int:
        return int(numpy.prod(self.shape)) if self.shape else 1

    def grad_tensor(self):
        """The gradient as a torch tensor (a view where possible), or None."""
        if self.torch_param is not None:
            return self.torch_param.grad
        if not self.node.has_grad(self.param_name):
            return None
        return _as_torch(self.node.get_grad(self.param_name))

    def set_grad(self, flat) -> None:
        """Write a reduced gradient (a flat torch tensor) back."""
        if self.torch_param is not None:
            param = self.torch_param
            if param.grad is None:
                param.grad = flat.view(param.shape).to(param.device, param.dtype).clone()
            else:
                param.grad.copy_(flat.view(param.shape))
            return
        node, name = self.node, self.param_name
        if node.has_grad(name):
            grad = node.get_grad(name)
            if isinstance(grad, numpy.ndarray):
                grad[...] = flat.view(self.shape).cpu().numpy()
            else:  # pragma: no cover - cupy
                import cupy

                grad[...] = cupy.from_dlpack(flat.view(self.shape).to(f"cuda:{grad.device.id}"))
        else:
            value = flat.view(self.shape).cpu().numpy().copy()
            param = node.get_param(name)
            if not isinstance(param, numpy.ndarray):  # pragma: no cover - cupy
                value = node.ops.asarray(value)
            node.set_grad(name, value.astype(param.dtype, copy=False))

    def get_value(self):
        if self.torch_param is not None:
            return self.torch_param.data
        return _as_torch(self.node.get_param(self.param_name))

    def set_value(self, flat) -> None:
        if self.torch_param is not None:
            self.torch_param.data.copy_(flat.view(self.shape))
            return
        value = self.node.get_param(self.param_name)
        if isinstance(value, numpy.ndarray):
            value = value.copy()
            value[...] = flat.view(self.shape).cpu().numpy()
        else:  # pragma: no cover - cupy
            import cupy

            value = cupy.from_dlpack(flat.view(self.shape).to(f"cuda:{value.device.id}")).copy()
        self.node.set_param(self.param_name, value)


def trainable_components(nlp, exclude: Iterable[str] = ()) -> List[Tuple[str, Any]]:
    """The components whose `finish_update` the loop calls (as spaCy's loop picks them)."""
    exclude = set(exclude)
    return [
        (name, proc)
        for name, proc in nlp.pipeline
        if name not in exclude
        and getattr(proc, "is_trainable", False)
        and getattr(proc, "model", None) not in (True, False, None)
    ]


def grad_scalers(nlp, exclude: Iterable[str] = ()) -> List[Any]:
    """The enabled gradient scalers (mixed precision) of the trainable components'
    PyTorchShims, each once, in pipeline and walk order (the same on every rank)."""
    components = trainable_components(nlp, exclude)
    return enabled_grad_scalers(node for _, proc in components for node in proc.model.walk())


def agree_on_overflow(ctx: DistContext, scalers: Sequence[Any]) -> List[bool]:
    """Mixed precision: thinc's grad scaler skips a shim's step when its gradients
    overflowed on this rank. After the gradients are summed every rank must skip that
    step, or ranks whose own gradients were finite would step with the overflowed sum
    (and the weights would differ from then on). One small all-reduce of a flag per
    scaler; a scaler that overflowed anywhere is marked as overflowed everywhere, as
    one process that saw every rank's examples would have found.

    RETURNS (List[bool]): per scaler, whether its step is skipped.
    """
    if not scalers:
        return []
    flags = ctx.all_reduce_sum([1.0 if scaler.found_inf else 0.0 for scaler in scalers])
    skipped = []
    for scaler, flag in zip(scalers, flags):
        if flag > 0:
            scaler._found_inf = True  # thinc's PyTorchGradScaler has no setter
        skipped.append(bool(flag > 0))
    return skipped


def collect_params(nlp, exclude: Iterable[str] = ()) -> List[ParamEntry]:
    """Every parameter the optimizer can update, in a fixed order: per trainable
    component, its model's nodes in walk order; per node its PyTorchShims' torch
    parameters, then its thinc parameters. A node or shim shared by two components is
    listed once.

    RETURNS (List[ParamEntry]): the parameters.
    """
    from thinc.shims import PyTorchShim

    entries: List[ParamEntry] = []
    seen_nodes, seen_shims = set(), set()
    for comp, proc in trainable_components(nlp, exclude):
        for i, node in enumerate(proc.model.walk()):
            if node.id in seen_nodes:
                continue
            seen_nodes.add(node.id)
            prefix = f"{comp}/{i}:{node.name}"
            for j, shim in enumerate(node.shims):
                if shim.id in seen_shims or not isinstance(shim, PyTorchShim):
                    continue
                seen_shims.add(shim.id)
                for tname, tparam in shim._model.named_parameters():
                    if not tparam.requires_grad:
                        continue
                    entries.append(
                        ParamEntry(
                            f"{prefix}/shim{j}/{tname}",
                            (shim.id, tname),
                            tuple(tparam.shape),
                            torch_param=tparam,
                        )
                    )
            for pname in node.param_names:
                if not node.has_param(pname):
                    continue
                entries.append(
                    ParamEntry(
                        f"{prefix}/{pname}",
                        (node.id, pname),
                        tuple(node.get_param(pname).shape),
                        node=node,
                        param_name=pname,
                    )
                )
    return entries


def _buckets(entries: Sequence[ParamEntry], cap: int) -> List[List[ParamEntry]]:
    buckets: List[List[ParamEntry]] = [[]]
    filled = 0
    for entry in entries:
        if buckets[-1] and filled + entry.size > cap:
            buckets.append([])
            filled = 0
        buckets[-1].append(entry)
        filled += entry.size
    return buckets


class GradientReducer:
    """Sums the gradients of a fixed parameter list over the ranks.

    Every rank reduces the same buckets in the same order, with zeros where it has no
    gradient and one flag per parameter saying whether it had one, so ranks that
    disagree on which parameters have gradients cannot hang or misalign a collective.
    After the reduction a parameter has a gradient on every rank iff it had one on some
    rank, as in one process that saw every rank's examples. Numbers summed along
    (`extras`: words, losses...) ride in the last bucket.

    The gradients are SUMMED, not averaged: spaCy's losses are sums over the examples
    of a batch (the parser's and tagger's gradients are not divided by the batch size),
    so N ranks with batches of B examples make the update of one process with N x B.
    """

    def __init__(
        self,
        ctx: DistContext,
        entries: Sequence[ParamEntry],
        bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
    ):
        self.ctx = ctx
        self.entries = list(entries)
        self.buckets = _buckets(self.entries, max(1, bucket_elements))

    def reduce(self, extras: Sequence[float]) -> numpy.ndarray:
        """All-reduce the gradients and `extras`; RETURNS the summed extras."""
        extras = numpy.asarray(extras, dtype="float64")
        if not self.ctx.active:
            return extras
        import torch
        import torch.distributed as dist

        device = self.ctx.device
        flags = torch.zeros(len(self.entries), dtype=torch.float32)
        reduced = []
        index = 0
        for b, bucket in enumerate(self.buckets):
            last = b == len(self.buckets) - 1
            n_grad = sum(e.size for e in bucket)
            n_tail = len(self.entries) + len(extras) if last else 0
            flat = torch.zeros(n_grad + n_tail, dtype=torch.float32, device=device)
            offset = 0
            for entry in bucket:
                grad = entry.grad_tensor()
                if grad is not None:
                    flat[offset : offset + entry.size].copy_(grad.reshape(-1))
                    flags[index] = 1.0
                offset += entry.size
                index += 1
            if last:
                # The flags of every parameter (all buckets), then the extras.
                tail = torch.cat([flags, torch.as_tensor(extras, dtype=torch.float32)])
                flat[n_grad:] = tail.to(device)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            reduced.append(flat)
        tail = reduced[-1][n_grad:].cpu().numpy()
        all_flags = tail[: len(self.entries)]
        summed = tail[len(self.entries) :].astype("float64")
        # Write back once every bucket is reduced (the flags come with the last one).
        index = 0
        for bucket, flat in zip(self.buckets, reduced):
            offset = 0
            for entry in bucket:
                if all_flags[index] > 0:
                    entry.set_grad(flat[offset : offset + entry.size])
                offset += entry.size
                index += 1
        return summed

    def broadcast_values(self, src: int = 0) -> None:
        """Give every rank rank `src`'s parameter values."""
        if not self.ctx.active:
            return
        import torch
        import torch.distributed as dist

        for bucket in self.buckets:
            flat = torch.zeros(
                sum(e.size for e in bucket), dtype=torch.float32, device=self.ctx.device
            )
            offset = 0
            for entry in bucket:
                flat[offset : offset + entry.size].copy_(entry.get_value().reshape(-1))
                offset += entry.size
            dist.broadcast(flat, src)
            offset = 0
            for entry in bucket:
                entry.set_value(flat[offset : offset + entry.size])
                offset += entry.size

    def check_same_params(self) -> None:
        """Raise on every rank when the ranks built different parameter lists (e.g.
        different labels), before any gradient collective could misalign."""
        layout = [[e.name, list(e.shape)] for e in self.entries]
        layouts = self.ctx.all_gather_json(layout)
        for rank, other in enumerate(layouts):
            if other != layout:
                diff = next(
                    (f"{a} vs {b}" for a, b in zip(layout, other) if a != b),
                    f"{len(layout)} vs {len(other)} parameters",
                )
                raise RankFailedError(
                    f"Rank {rank} built a different model than rank {self.ctx.rank} "
                    f"(first difference: {diff}). Every rank must initialize the pipeline "
                    "from the same config and data; check [initialize] labels and that "
                    "every rank reads the same files."
                )


# -- optimizer state ----------------------------------------------------------------

OPTIMIZER_FILE = "optimizer.npz"


def save_optimizer(
    optimizer, entries: Sequence[ParamEntry], path: Union[str, Path]
) -> Dict[str, Any]:
    """Write the optimizer's per-parameter state (Adam moments, averages, update
    counts) to a .npz file keyed by stable parameter names (arrays only, no pickle).

    RETURNS (dict): JSON-able scalars of the optimizer (learn rate and friends).
    """
    arrays: Dict[str, numpy.ndarray] = {}
    names = []
    counts = []
    for i, entry in enumerate(entries):
        names.append(entry.name)
        counts.append(int(optimizer.nr_update.get(entry.key, 0)))
        for prefix, table in (
            ("mom1", optimizer.mom1),
            ("mom2", optimizer.mom2),
            ("avg", optimizer.averages or {}),
        ):
            if entry.key in table:
                value = table[entry.key]
                arrays[f"{prefix}_{i}"] = (
                    value.get() if hasattr(value, "get") else numpy.asarray(value)
                )
    arrays["names"] = numpy.array(names, dtype=str)
    arrays["nr_update"] = numpy.array(counts, dtype="int64")
    path = Path(path)
    with path.open("wb") as file_:
        numpy.savez(file_, **arrays)
    return {
        key: getattr(optimizer, key)
        for key in ("learn_rate", "b1", "b2", "eps", "L2", "grad_clip")
        if isinstance(getattr(optimizer, key, None), (int, float))
    }


def load_optimizer(optimizer, entries: Sequence[ParamEntry], path: Union[str, Path]) -> int:
    """Restore what `save_optimizer` wrote into `optimizer`, mapping the stable names
    to this process's parameter keys. RETURNS the number of parameters restored.

    RAISES (TrainingStateError): the file is missing, is not an .npz archive of plain
        arrays (no pickle is ever loaded: an object array is refused unread), or its
        arrays are not the ones `save_optimizer` writes for these parameters; the
        message names the file and what to do.
    """
    path = Path(path)
    if not path.is_file():
        raise TrainingStateError(
            f"The optimizer state {path} is missing: the training state in {path.parent} "
            f"is incomplete (every checkpoint writes it). {STATE_FIX}"
        )
    _check_npz_members(path, entries)
    try:
        data = numpy.load(path, allow_pickle=False)
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as err:
        raise TrainingStateError(
            f"Could not read the optimizer state {path} ({type(err).__name__}: {err}): it is "
            f"truncated, damaged or not the .npz archive `spacy lean train` writes. {STATE_FIX}"
        ) from err
    with data:
        return _restore_optimizer(optimizer, entries, path, data)


def _check_npz_members(path: Path, entries: Sequence[ParamEntry]) -> None:
    """Check an optimizer state's members before any is read: each .npy header (read
    without its data) must declare a plain dtype and exactly the member's size in the
    archive, and together the members may hold no more than this pipeline's optimizer
    state can (3 float64 tables, names and counts). zipfile stops a member at its
    declared size, so a small file cannot make the reader inflate or allocate more."""
    with path.open("rb") as file_:
        if file_.read(6) == b"\x93NUMPY":
            raise TrainingStateError(
                f"The optimizer state {path} is one .npy array, not the .npz archive "
                f"`spacy lean train` writes. {STATE_FIX}"
            )
    longest = max((len(e.name) for e in entries), default=1)
    limit = 24 * sum(e.size for e in entries) + len(entries) * (8 + 4 * longest) + (1 << 20)
    total = 0
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if len(members) > 3 * len(entries) + 2:
                raise TrainingStateError(
                    f"The optimizer state {path} holds {len(members):,} arrays, more than "
                    f"`spacy lean train` writes for the {len(entries):,} parameters of this "
                    f"pipeline: it was saved for another model, or is not such a state. "
                    f"{STATE_FIX}"
                )
            for info in members:
                with archive.open(info) as member:
                    version = numpy.lib.format.read_magic(member)
                    if version == (1, 0):
                        shape, _, dtype = numpy.lib.format.read_array_header_1_0(member)
                    elif version == (2, 0):
                        shape, _, dtype = numpy.lib.format.read_array_header_2_0(member)
                    else:
                        raise ValueError(f".npy format {version} in '{info.filename}'")
                    declared = math.prod(shape) * dtype.itemsize + member.tell()
                if dtype.hasobject:
                    raise ValueError(f"'{info.filename}' holds Python objects (a pickle)")
                if declared != info.file_size:
                    raise ValueError(
                        f"'{info.filename}' declares {declared:,} bytes but holds "
                        f"{info.file_size:,}"
                    )
                total += info.file_size
                if total > limit:
                    raise TrainingStateError(
                        f"The optimizer state {path} unpacks to more than {limit:,} bytes, "
                        f"more than `spacy lean train` writes for the {len(entries):,} "
                        "parameters of this pipeline: it was saved for another model, or "
                        f"is not such a state. {STATE_FIX}"
                    )
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as err:
        if isinstance(err, TrainingStateError):
            raise
        raise TrainingStateError(
            f"Could not read the optimizer state {path} ({type(err).__name__}: {err}): it is "
            f"truncated, damaged or not the .npz archive `spacy lean train` writes. {STATE_FIX}"
        ) from None


def _optimizer_array(data, path: Path, key: str, kinds: str, ndim: Optional[int] = None):
    """One array of an optimizer state, checked: of a dtype kind in `kinds` (and of
    `ndim` dimensions); never unpickled."""
    try:
        array = data[key]
    except KeyError:
        raise TrainingStateError(
            f"The optimizer state {path} has no array '{key}': it is not the archive "
            f"`spacy lean train` writes. {STATE_FIX}"
        ) from None
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as err:
        # numpy refuses object arrays (pickles) with allow_pickle=False: ValueError.
        raise TrainingStateError(
            f"Could not read the array '{key}' of the optimizer state {path} "
            f"({type(err).__name__}: {err}): the file is damaged, or holds something else "
            f"than the plain arrays `spacy lean train` writes. {STATE_FIX}"
        ) from err
    if array.dtype.kind not in kinds or (ndim is not None and array.ndim != ndim):
        raise TrainingStateError(
            f"The optimizer state {path} holds '{key}' as a {array.ndim}-d {array.dtype} "
            f"array, which `spacy lean train` does not write. {STATE_FIX}"
        )
    return array


def _restore_optimizer(optimizer, entries: Sequence[ParamEntry], path: Path, data) -> int:
    names = [str(n) for n in _optimizer_array(data, path, "names", "U", ndim=1)]
    counts = _optimizer_array(data, path, "nr_update", "iu", ndim=1)
    if len(counts) != len(names) or (counts < 0).any():
        raise TrainingStateError(
            f"The optimizer state {path} holds {len(names)} parameter names but "
            f"{len(counts)} update counts{' (some negative)' if (counts < 0).any() else ''}: "
            f"it is damaged. {STATE_FIX}"
        )
    ours = {e.name: e for e in entries}
    missing = sorted(set(ours) - set(names))
    if missing:
        raise TrainingStateError(
            f"The optimizer state {path} has no entry for {len(missing)} parameters of "
            f"this pipeline (e.g. {missing[0]!r}): it was saved for another model. "
            "Resume with the config the run was started with."
        )
    # Every array is read and checked before the optimizer is changed.
    restored: List[Tuple[ParamEntry, int, Dict[str, numpy.ndarray]]] = []
    for i, name in enumerate(names):
        entry = ours.get(name)
        if entry is None:
            continue
        arrays = {}
        for prefix in ("mom1", "mom2", "avg"):
            key = f"{prefix}_{i}"
            if key in data.files:
                array = _optimizer_array(data, path, key, "f")
                if array.size != entry.size:
                    raise TrainingStateError(
                        f"The optimizer state {path} holds {array.size} values in '{key}' "
                        f"for the parameter {name!r} of {entry.size}: it was saved for "
                        "another model. Resume with the config the run was started with."
                    )
                arrays[prefix] = array
        restored.append((entry, int(counts[i]), arrays))
    for entry, count, arrays in restored:
        ops_array = entry.node.ops.asarray if entry.node is not None else _like_torch(entry)
        if count:
            optimizer.nr_update[entry.key] = count
        for prefix, table in (("mom1", optimizer.mom1), ("mom2", optimizer.mom2)):
            if prefix in arrays:
                table[entry.key] = ops_array(arrays[prefix])
        if "avg" in arrays and optimizer.averages is not None:
            optimizer.averages[entry.key] = ops_array(arrays["avg"])
    return len(restored)


def _like_torch(entry: ParamEntry):
    """How thinc's optimizer holds the state of a torch parameter: as the arrays it is
    given (PyTorchShim.finish_update passes torch2xp of the parameter): numpy on the
    CPU, cupy on the parameter's GPU. (numpy moments of a CUDA parameter stopped a
    resumed run at its first step: cupy's Adam kernel takes no numpy arrays.)"""
    param = entry.torch_param
    if not param.is_cuda:
        return numpy.asarray
    import cupy

    def on_its_device(array: numpy.ndarray):
        with cupy.cuda.Device(param.device.index):
            return cupy.asarray(array)

    return on_its_device


def _as_torch(array):
    """A thinc array as a torch tensor sharing its memory (numpy, or cupy through dlpack)."""
    import torch

    if isinstance(array, numpy.ndarray):
        return torch.from_numpy(numpy.ascontiguousarray(array))
    return torch.utils.dlpack.from_dlpack(array)  # pragma: no cover - cupy
