"""Reading `torch.save` files without running code from them.

A pickle can name any importable callable and call it with arguments of its
choosing (`os.system`, `builtins.open`, ...), so `torch.load` with an ordinary
unpickler runs whatever a file asks for. torch's own `weights_only=True` mode
restricts that, but its unpickler cannot read pickle protocol 4 (the `FRAME` opcode),
which Flair writes. `load` therefore still lets `torch.load` read the container (zip
archive or legacy stream, tensor storages), but hands it an unpickler of our own for
every pickle in the file, the legacy format's header records included:

- a global must be in the caller's allow-list; callables are replaced by checked
  stand-ins that accept only what `torch.save` writes (`_codecs.encode` only encodes
  text as latin-1, the tensor rebuild functions take only storages this load created,
  with in-bounds sizes and strides, no hooks, and all tensors together no larger than
  the file, ...);
- `NEWOBJ` and `BUILD` only for the plain-data classes the caller names (through the
  class's own `__setstate__`), for `OrderedDict`'s `_metadata` (module versions only)
  and for numpy dtypes left as they are;
  `INST`, `OBJ`, `EXT*`, `NEWOBJ_EX`, `PERSID` and out-of-band buffers are refused;
- a persistent id must be a storage record as torch writes it ("storage", a storage
  type of a known dtype, a key, a location, a size that fits in the file);
- `APPEND`/`SETITEM`/`ADDITEMS` only fill real lists, dicts and sets.

The file is handed to torch as a stream without a file descriptor, so torch never
takes its tar-archive or memory-map paths, and TorchScript archives (which
`torch.load` would pass to `torch.jit.load`) and zip records that would unpack to
more than the file are refused before torch reads them.
"""

import io
import math
import os
import pickle
import re
import types
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple, Union

import _compat_pickle
import numpy
import torch

from .._env import positive_int_env

# Files larger than this are refused before anything is read (override with the
# environment variable below, in bytes).
MAX_BYTES_ENV = "SPACY_LEAN_MAX_CHECKPOINT_BYTES"
DEFAULT_MAX_BYTES = 4 * 1024**3

_ZIP_MAGIC = b"PK\x03\x04"
_ALLOWED_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)
_PLAIN_KEY_TYPES = (str, bytes, int, float, bool, type(None), tuple)
_STORAGE_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")
_LOCATION = re.compile(r"[a-z_]{1,16}(:[0-9]{1,4})?")
_NUMPY_DTYPE = re.compile(r"[biufc][0-9]{1,2}")
_MAX_DIMS = 32
# The object tree a file may unpickle to, counting a shared object each time it is
# reached: a few nodes per byte of the file (each node of a pickle written without
# sharing takes at least a byte), never less than the budget below.
_NODES_PER_BYTE = 4
_MIN_NODE_BUDGET = 1_000_000


class CheckpointError(ValueError):
    """A file spacy-lean refuses to read as a checkpoint: it asks for something a
    checkpoint has no reason to contain (and could run code), or it is not a
    checkpoint at all (truncated, corrupt, too large)."""


class RefusedPickle(pickle.UnpicklingError):
    """Raised inside the unpickler (also by the `__setstate__` of an allowed class
    that is given a state it does not accept); `load` turns it into a
    `CheckpointError`."""


class StandIn:
    """A callable a pickle may name: checks its arguments, then builds the value."""

    def __init__(self, name: str, func: Callable[..., Any]) -> None:
        self.name = name
        self.func = func

    def __call__(self, *args: Any) -> Any:
        return self.func(*args)

    def __repr__(self) -> str:
        return f"<stand-in for {self.name}>"


class _Load:
    """What one `load` call allows and has handed out (shared by all the unpicklers
    torch creates for the file)."""

    def __init__(
        self,
        allowed: Dict[Tuple[str, str], Any],
        max_storage_bytes: int,
        what: str,
        legacy: bool,
    ) -> None:
        self.what = what
        self.legacy = legacy
        self.max_storage_bytes = max_storage_bytes
        self.storage_bytes: Dict[str, int] = {}  # root key -> bytes
        self.tensor_bytes = 0  # of all the tensors rebuilt so far
        self.storages: List[Any] = []
        self.records: List[Any] = []  # what the module-level `load` returned (legacy headers)
        # A pickle can share one object many times through its memo, so a file of a
        # hundred bytes can build a tuple that holds itself 2**60 times over: hashing it
        # (a dict key) or printing it would never end. Each tuple's size as a tree is
        # noted when it is built (tuples are immutable) and limited, and so is the
        # hashing work of all the keys (`hash_work`, in tree nodes).
        self.tuple_sizes: Dict[int, Tuple[tuple, int]] = {}
        self.max_nodes = _MIN_NODE_BUDGET + _NODES_PER_BYTE * max_storage_bytes
        self.hash_work = 0
        self.classes: FrozenSet[type] = frozenset(
            v for v in allowed.values() if isinstance(v, type)
        )
        self.globals: Dict[Tuple[str, str], Any] = {}
        for key, value in allowed.items():
            if isinstance(value, type):
                self.globals[key] = value
            else:
                self.globals[key] = StandIn(".".join(key), value(self))

    def is_our_storage(self, obj: Any) -> bool:
        return any(obj is storage for storage in self.storages)

    def tree_size(self, value: Any) -> int:
        """How many nodes hashing or printing `value` visits: 1 for anything but a
        tuple, whose size was noted when the unpickler built it."""
        if type(value) is not tuple:
            return 1
        noted = self.tuple_sizes.get(id(value))
        if noted is not None and noted[0] is value:
            return noted[1]
        return 1 + sum(self.tree_size(item) for item in value)  # () or a stand-in's

    def note_tuple(self, value: tuple) -> tuple:
        size = 1 + sum(self.tree_size(item) for item in value)
        if size > self.max_nodes:
            raise RefusedPickle(
                f"it builds a tuple that holds {size:,} values once its shared parts are "
                f"counted each time they occur (at most {self.max_nodes:,} for a file of "
                f"this size)"
            )
        if value:
            self.tuple_sizes[id(value)] = (value, size)
        return value

    def note_keys(self, keys: Iterable[Any]) -> None:
        """Count the work of hashing `keys` (dict keys, set items) before it is done."""
        self.hash_work += sum(self.tree_size(key) for key in keys)
        if self.hash_work > self.max_nodes:
            raise RefusedPickle(
                f"hashing its dict keys and set items would visit {self.hash_work:,} values "
                f"(shared tuples used over and over), more than a file of this size needs "
                f"({self.max_nodes:,})"
            )


# --- stand-ins: each takes the `_Load` and returns the checked callable -------------


def _refuse_args(what: str, args: Tuple[Any, ...]) -> "RefusedPickle":
    shown = ", ".join(type(arg).__name__ for arg in args)
    return RefusedPickle(f"{what} is called with unexpected arguments ({shown})")


def _is_int(value: Any) -> bool:
    return type(value) is int


def _int_tuple(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) <= _MAX_DIMS
        and all(_is_int(v) and v >= 0 for v in value)
    )


def _no_hooks(value: Any) -> bool:
    return value is None or (type(value) in (dict, OrderedDict) and not value)


def _check_view(load: _Load, name: str, storage: Any, offset: Any, size: Any, stride: Any) -> None:
    if not load.is_our_storage(storage):
        raise RefusedPickle(f"{name} is given {type(storage).__name__}, not a storage of this file")
    if type(size) is torch.Size:
        size = tuple(size)
    if not (
        _is_int(offset)
        and offset >= 0
        and _int_tuple(size)
        and _int_tuple(stride)
        and len(size) == len(stride)
    ):
        raise _refuse_args(name, (storage, offset, size, stride))
    if 0 not in size:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage._size():
            raise RefusedPickle(
                f"{name}: a tensor of size {size}, stride {stride} at offset {offset} "
                f"does not fit in its storage of {storage._size()} elements"
            )
    # An expanded tensor (stride 0) of any size fits in one element: the tensors
    # together may not hold more than the file (torch.save of states writes none).
    load.tensor_bytes += math.prod(size) * torch._utils._element_size(storage.dtype)
    if load.tensor_bytes > load.max_storage_bytes:
        raise RefusedPickle(
            f"{name}: its tensors would hold {load.tensor_bytes:,} bytes, more than the whole "
            f"file ({load.max_storage_bytes:,} bytes); expanded or overlapping views are not "
            "part of a checkpoint"
        )


def _rebuild_tensor_v2(load: _Load) -> Callable[..., torch.Tensor]:
    name = "torch._utils._rebuild_tensor_v2"

    def rebuild(*args: Any) -> torch.Tensor:
        if len(args) not in (6, 7):
            raise _refuse_args(name, args)
        storage, offset, size, stride, requires_grad, hooks = args[:6]
        metadata = args[6] if len(args) == 7 else None
        _check_view(load, name, storage, offset, size, stride)
        if type(requires_grad) is not bool or not _no_hooks(hooks) or metadata not in (None, {}):
            raise _refuse_args(name, args)
        return torch._utils._rebuild_tensor_v2(
            storage, offset, tuple(size), tuple(stride), requires_grad, OrderedDict()
        )

    return rebuild


def _rebuild_tensor(load: _Load) -> Callable[..., torch.Tensor]:
    name = "torch._utils._rebuild_tensor"

    def rebuild(*args: Any) -> torch.Tensor:
        if len(args) != 4:
            raise _refuse_args(name, args)
        _check_view(load, name, *args)
        storage, offset, size, stride = args
        return torch._utils._rebuild_tensor(storage, offset, tuple(size), tuple(stride))

    return rebuild


def _rebuild_parameter(load: _Load) -> Callable[..., torch.nn.Parameter]:
    def rebuild(*args: Any) -> torch.nn.Parameter:
        if (
            len(args) != 3
            or type(args[0]) is not torch.Tensor
            or type(args[1]) is not bool
            or not _no_hooks(args[2])
        ):
            raise _refuse_args("torch._utils._rebuild_parameter", args)
        return torch.nn.Parameter(args[0], args[1])

    return rebuild


def _ordered_dict(load: _Load) -> Callable[..., OrderedDict]:
    def build(*args: Any) -> OrderedDict:
        if not args:
            return OrderedDict()
        items = args[0]
        if (
            len(args) == 1
            and type(items) in (list, tuple)
            and all(
                type(item) in (list, tuple)
                and len(item) == 2
                and isinstance(item[0], _PLAIN_KEY_TYPES)
                for item in items
            )
        ):
            load.note_keys(item[0] for item in items)
            return OrderedDict(items)
        raise _refuse_args("collections.OrderedDict", args)

    return build


def _size(load: _Load) -> Callable[..., torch.Size]:
    def build(*args: Any) -> torch.Size:
        if len(args) == 1 and type(args[0]) in (list, tuple) and _int_tuple(tuple(args[0])):
            return torch.Size(args[0])
        raise _refuse_args("torch.Size", args)

    return build


def _device(load: _Load) -> Callable[..., torch.device]:
    def build(*args: Any) -> torch.device:
        if (
            len(args) in (1, 2)
            and type(args[0]) is str
            and _LOCATION.fullmatch(args[0])
            and (len(args) == 1 or (_is_int(args[1]) and 0 <= args[1] < 10_000))
        ):
            return torch.device(*args)
        raise _refuse_args("torch.device", args)

    return build


def _codecs_encode(load: _Load) -> Callable[..., bytes]:
    # Protocol-2 pickles store bytes as `_codecs.encode(text, "latin1")`.
    def encode(*args: Any) -> bytes:
        if (
            len(args) == 2
            and type(args[0]) is str
            and type(args[1]) is str
            and args[1].lower().replace("-", "").replace("_", "") == "latin1"
        ):
            return args[0].encode("latin-1")
        raise _refuse_args("_codecs.encode", args)

    return encode


def _bytes(load: _Load) -> Callable[..., bytes]:
    # Protocol-2 pickles store b"" as `bytes()`.
    def build(*args: Any) -> bytes:
        if args:
            raise _refuse_args("builtins.bytes", args)
        return b""

    return build


def _plain_collection(kind: type) -> Callable[[_Load], Callable[..., Any]]:
    def make(load: _Load) -> Callable[..., Any]:
        def build(*args: Any) -> Any:
            if not args:
                return kind()
            if (
                len(args) == 1
                and type(args[0]) in (list, tuple)
                and all(isinstance(item, _PLAIN_KEY_TYPES) for item in args[0])
            ):
                load.note_keys(args[0])
                return kind(args[0])
            raise _refuse_args(f"builtins.{kind.__name__}", args)

        return build

    return make


def _numpy_dtype(load: _Load) -> Callable[..., numpy.dtype]:
    def build(*args: Any) -> numpy.dtype:
        if (
            1 <= len(args) <= 3
            and type(args[0]) is str
            and _NUMPY_DTYPE.fullmatch(args[0])
            and all(type(flag) is bool for flag in args[1:])
        ):
            try:
                dtype = numpy.dtype(args[0])
            except TypeError:
                dtype = None
            if dtype is not None and dtype.kind in "biufc" and dtype.str[1:] == args[0]:
                return dtype
        raise _refuse_args("numpy.dtype", args)

    return build


def _numpy_scalar(load: _Load) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        if (
            len(args) == 2
            and isinstance(args[0], numpy.dtype)
            and args[0].kind in "biufc"
            and not args[0].hasobject
            and type(args[1]) is bytes
            and len(args[1]) == args[0].itemsize
        ):
            return numpy.frombuffer(args[1], dtype=args[0])[0].copy()
        raise _refuse_args("numpy scalar", args)

    return build


# The globals a `torch.save` of tensors and plain containers names.
TENSOR_GLOBALS: Dict[Tuple[str, str], Callable[[_Load], Callable[..., Any]]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch", "Size"): _size,
    ("torch", "device"): _device,
    ("_codecs", "encode"): _codecs_encode,
    ("builtins", "bytes"): _bytes,
    ("builtins", "set"): _plain_collection(set),
    ("builtins", "frozenset"): _plain_collection(frozenset),
    ("numpy", "dtype"): _numpy_dtype,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
}


# --- the unpickler ------------------------------------------------------------------


def _refuse_opcode(name: str) -> Callable[[Any], None]:
    def refuse(self: Any) -> None:
        raise RefusedPickle(f"the pickle uses the {name} opcode, which a checkpoint does not need")

    return refuse


class _RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's reference unpickler with every opcode that can call or import
    something replaced by a checked version. `_load` is set per `load` call."""

    _load: _Load
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        found = self._load.globals.get((module, name))
        if found is None:
            raise RefusedPickle(
                f"the pickle names '{module}.{name}', which {self._load.what} does not contain"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:  # replaced by torch for its main pickle
        raise RefusedPickle("the pickle has a persistent id where torch writes none")

    def load_binpersid(self) -> None:
        pid = self.stack.pop()
        if "persistent_load" not in self.__dict__:  # torch sets it for the main pickle only
            self.persistent_load(pid)
        _check_storage_record(self._load, pid)
        storage = self.persistent_load(pid)
        if type(storage) is not torch.storage.TypedStorage:
            raise RefusedPickle(f"a storage record gave {type(storage).__name__}")
        self._load.storages.append(storage)
        self.append(storage)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if type(func) is not StandIn or type(args) is not tuple:
            raise RefusedPickle(f"the pickle calls {_describe(func)}")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if (
            type(args) is not tuple
            or args
            or not isinstance(cls, type)
            or cls not in self._load.classes
        ):
            raise RefusedPickle(f"the pickle creates an object of {_describe(cls)}")
        self.append(cls.__new__(cls))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) in self._load.classes:
            # The class's own, never one an earlier BUILD put in the instance's attributes.
            type(inst).__setstate__(inst, state)
        elif type(inst) is OrderedDict:
            _build_ordered_dict(inst, state)
        elif isinstance(inst, numpy.dtype):
            _check_dtype_state(inst, state)
        else:
            raise RefusedPickle(f"the pickle sets the state of {_describe(inst)}")

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target(list, "APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target(list, "APPENDS").extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        target = self._target(dict, "SETITEM")
        self._load.note_keys((key,))
        target[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target(dict, "SETITEMS")
        self._load.note_keys(items[0 : len(items) - 1 : 2])
        for i in range(0, len(items) - 1, 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self._target(set, "ADDITEMS")
        self._load.note_keys(items)
        target.update(items)

    # Tuples: built as the reference unpickler builds them, their tree size noted.
    def load_tuple(self) -> None:
        items = self.pop_mark()
        self.append(self._load.note_tuple(tuple(items)))

    def load_tuple1(self) -> None:
        self.stack[-1] = self._load.note_tuple((self.stack[-1],))

    def load_tuple2(self) -> None:
        self.stack[-2:] = [self._load.note_tuple((self.stack[-2], self.stack[-1]))]

    def load_tuple3(self) -> None:
        built = (self.stack[-3], self.stack[-2], self.stack[-1])
        self.stack[-3:] = [self._load.note_tuple(built)]

    def _target(self, kind: type, opcode: str) -> Any:
        target = self.stack[-1]
        if not (type(target) is kind or (kind is dict and type(target) is OrderedDict)):
            raise RefusedPickle(f"the pickle's {opcode} targets {_describe(target)}")
        return target

    dispatch[pickle.BINPERSID[0]] = load_binpersid
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.TUPLE[0]] = load_tuple
    dispatch[pickle.TUPLE1[0]] = load_tuple1
    dispatch[pickle.TUPLE2[0]] = load_tuple2
    dispatch[pickle.TUPLE3[0]] = load_tuple3
    for _opcode in (
        "INST",
        "OBJ",
        "EXT1",
        "EXT2",
        "EXT4",
        "NEWOBJ_EX",
        "PERSID",
        "NEXT_BUFFER",
        "READONLY_BUFFER",
    ):
        dispatch[getattr(pickle, _opcode)[0]] = _refuse_opcode(_opcode)
    del _opcode


def _describe(obj: Any) -> str:
    if isinstance(obj, StandIn):
        return repr(obj)
    if isinstance(obj, type):
        return f"'{obj.__module__}.{obj.__qualname__}'"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} value"


def _brief(value: Any) -> str:
    """A short description of a value from the file that never walks it (its repr
    could be astronomically long: see `_Load.tuple_sizes`)."""
    if type(value) in (str, bytes):
        return repr(value[:60]) + ("..." if len(value) > 60 else "")
    if type(value) is int:
        return str(value) if value.bit_length() <= 64 else f"an int of {value.bit_length()} bits"
    if type(value) in (float, bool, type(None)):
        return repr(value)
    if type(value) is tuple:
        shown = ", ".join(
            _brief(item) if type(item) is not tuple else "tuple" for item in value[:6]
        )
        return f"({shown}{', ...' if len(value) > 6 else ''})"
    return f"a {type(value).__name__}"


def _check_storage_record(load: _Load, pid: Any) -> None:
    """A persistent id must be a storage record exactly as torch writes it: zip format
    ("storage", type, key, location, numel), legacy format the same plus a view
    (None or (key, offset, size))."""
    ok = (
        type(pid) is tuple
        and len(pid) == (6 if load.legacy else 5)
        and pid[0] == "storage"
        and isinstance(pid[1], torch.serialization.StorageType)
        and pid[1].dtype in _ALLOWED_DTYPES
        and type(pid[2]) is str
        and _STORAGE_KEY.fullmatch(pid[2]) is not None
        and type(pid[3]) is str
        and _LOCATION.fullmatch(pid[3]) is not None
        and _is_int(pid[4])
        and pid[4] >= 0
    )
    if ok and len(pid) == 6 and pid[5] is not None:
        view = pid[5]
        ok = (
            type(view) is tuple
            and len(view) == 3
            and type(view[0]) is str
            and _STORAGE_KEY.fullmatch(view[0]) is not None
            and _is_int(view[1])
            and _is_int(view[2])
            and view[1] >= 0
            and view[2] >= 0
            and view[1] + view[2] <= pid[4]
        )
    if not ok:
        raise RefusedPickle(f"the pickle has a persistent id torch does not write: {_brief(pid)}")
    # torch makes a storage the first time a key is named and hands it out again after
    # that, whatever a later record says: count each key as it was first named.
    load.storage_bytes.setdefault(pid[2], pid[4] * torch._utils._element_size(pid[1].dtype))
    total = sum(load.storage_bytes.values())
    if total > load.max_storage_bytes:
        # Not allocated: torch would make the storages before reading their data.
        raise pickle.UnpicklingError(
            f"its storages would hold {total} bytes, more than the whole file "
            f"({load.max_storage_bytes} bytes)"
        )


def _build_ordered_dict(inst: OrderedDict, state: Any) -> None:
    # A module's state dict carries its `_metadata`: {submodule: {"version": int}}.
    # `load_state_dict` reads more from it (`assign_to_params_buffers` would make the
    # file's tensors the parameters as they are), so only versions are kept, copied:
    # the pickle could still reach the dicts it built through the memo.
    if state is None or (type(state) is dict and not state):
        return
    metadata = (
        state.get("_metadata") if type(state) is dict and set(state) == {"_metadata"} else None
    )
    if type(metadata) in (dict, OrderedDict) and all(
        type(key) is str
        and type(value) is dict
        and set(value) <= {"version"}
        and all(_is_int(v) for v in value.values())
        for key, value in metadata.items()
    ):
        inst._metadata = OrderedDict((key, dict(value)) for key, value in metadata.items())
        return
    raise RefusedPickle(
        "the pickle sets attributes of an OrderedDict other than the module versions in _metadata"
    )


def _check_dtype_state(dtype: numpy.dtype, state: Any) -> None:
    # Leave the dtype as `numpy.dtype(name)` made it; only accept the state it pickles.
    expected = dtype.__reduce__()[2]
    if (
        type(state) is tuple
        and len(state) == len(expected)
        and state[0] == expected[0]
        and state[2:] == expected[2:]
        and (state[1] == expected[1] or state[1] in ("|", "=") or dtype.itemsize == 1)
    ):
        return
    raise RefusedPickle(f"the pickle gives numpy.dtype('{dtype.str}') the state {_brief(state)}")


def _pickle_module(load: _Load) -> types.ModuleType:
    """The `pickle_module` for `torch.load`: its `Unpickler` (which torch subclasses
    for the main pickle) and `load` (which it calls for legacy header records)."""
    unpickler = type("Unpickler", (_RestrictedUnpickler,), {"_load": load})
    module = types.ModuleType("spacy_lean_restricted_pickle")
    module.Unpickler = unpickler  # type: ignore[attr-defined]

    def load_one(file: Any, **kwargs: Any) -> Any:
        record = unpickler(file, **kwargs).load()
        load.records.append(record)
        return record

    module.load = load_one  # type: ignore[attr-defined]
    return module


class _NoDescriptor(io.BufferedReader):
    """A file read only through `read`/`seek`: without a descriptor, torch neither
    tries its tar-archive reader nor memory-maps storages."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")


def max_bytes() -> int:
    """The size limit for checkpoint files (`SPACY_LEAN_MAX_CHECKPOINT_BYTES`)."""
    return positive_int_env(MAX_BYTES_ENV, DEFAULT_MAX_BYTES, "number of bytes")


def load(
    source: Union[str, Path, bytes],
    allowed: Dict[Tuple[str, str], Any],
    *,
    what: str,
    name: Optional[str] = None,
    map_location: Any = "cpu",
) -> Any:
    """Read a `torch.save` file (path or bytes) with the restricted unpickler.

    source (Union[str, Path, bytes]): the file or its content.
    allowed (Dict[Tuple[str, str], Any]): the globals the file may name: a stand-in
        factory (see `TENSOR_GLOBALS`) or a plain-data class (created empty with
        `NEWOBJ`, filled by its own checking `__setstate__`).
    what (str): what the file should be, for errors ("a Flair LanguageModel checkpoint").
    name (Optional[str]): how to call the source in errors (default: the path).
    map_location: where the tensors go (a device or its name; the file's is ignored).
    RETURNS (Any): the unpickled object.
    """
    if map_location is None:
        map_location = "cpu"
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError(f"map_location must be a device or its name, got {map_location!r}")
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        # torch then refuses any pickle module, ours included.
        raise RuntimeError(
            f"TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, so torch will not use spacy-lean's "
            f"restricted unpickler, which {what} needs (torch's weights_only reader cannot "
            "read pickle protocol 4). Unset it: spacy-lean's reader never runs code from a file."
        )
    limit = max_bytes()
    if isinstance(source, (bytes, bytearray, memoryview)):
        shown = name or f"{what} ({len(source)} bytes)"
        size = len(source)
        if size > limit:
            raise _too_large(shown, size, limit)
        stream: Any = io.BytesIO(source)
    else:
        path = Path(source)
        shown = name or str(path)
        if path.is_dir():
            found = sorted(p.name for p in path.glob("*.pt"))[:5]
            held = f" (it holds {', '.join(found)})" if found else ""
            raise IsADirectoryError(
                f"{path} is a folder{held}, but {what} is a file: give the path of the file"
            )
        if not path.is_file():
            raise FileNotFoundError(f"{what[0].upper()}{what[1:]} not found: {path}")
        size = path.stat().st_size
        if size > limit:
            raise _too_large(shown, size, limit)
        stream = _NoDescriptor(io.FileIO(str(path), "rb"))
    with stream:
        head = stream.read(4)
        stream.seek(0)
        if head == _ZIP_MAGIC:
            _check_zip(stream, shown, what, size)
            stream.seek(0)
        elif not head.startswith(pickle.PROTO):
            raise CheckpointError(
                f"Could not read {shown} as {what}: it is neither a torch zip archive nor "
                f"a legacy torch file (it starts with {head!r})."
            )
        load_state = _Load(allowed, size, what, legacy=head != _ZIP_MAGIC)
        try:
            result = torch.load(
                stream,
                map_location=map_location,
                pickle_module=_pickle_module(load_state),
                weights_only=False,  # the restricted unpickler does the checking
                mmap=False,
            )
            if load_state.legacy:
                _check_legacy_storages_filled(load_state)
            _check_tree_size(result, load_state)
            return result
        except RefusedPickle as err:
            raise CheckpointError(
                f"Refusing to load {shown}: {err}. spacy-lean reads checkpoints without "
                "running code from them; this file was not written by Flair, spacy-lean or "
                "torch.save of plain tensors, and may be malicious."
            ) from None
        except RecursionError:
            raise CheckpointError(
                f"Refusing to load {shown}: its pickle is nested too deeply for {what}."
            ) from None
        except Exception as err:  # whatever torch or pickle raise on a broken file
            raise CheckpointError(
                f"Could not read {shown} as {what}: the file is truncated or corrupt "
                f"({type(err).__name__}: {str(err)[:300]})"
            ) from err


def _check_legacy_storages_filled(load: _Load) -> None:
    # The legacy format lists the storages whose data follows the pickle; torch
    # allocates every storage the pickle names, so one left off would keep whatever
    # the memory held.
    keys = load.records[-1] if load.records else None
    if type(keys) is not list or not set(load.storage_bytes) <= set(keys):
        raise pickle.UnpicklingError("the file names storages whose data it does not contain")


def _check_tree_size(value: Any, load: _Load) -> None:
    """Refuse a result whose tree, a shared list or dict counted each time it is
    reached, is larger than the file could hold without sharing: whoever walks or
    prints it (an error message naming a setting, say) would never finish. The walk
    stops at the budget, so it is never longer than that itself."""
    stack = [value]
    seen = 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > load.max_nodes:
            raise RefusedPickle(
                f"it unpickles to more than {load.max_nodes:,} values once its shared lists "
                "and dicts are counted each time they occur, more than a file of this size "
                "holds"
            )
        kind = type(item)
        if kind in (list, tuple, set, frozenset):
            stack.extend(item)
        elif kind in (dict, OrderedDict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif kind in load.classes:
            stack.extend(vars(item).values())


def _too_large(shown: str, size: int, limit: int) -> CheckpointError:
    return CheckpointError(
        f"Refusing to load {shown}: it is {size:,} bytes, more than the limit of "
        f"{limit:,} bytes for checkpoints. If the file is what you expect, raise the limit "
        f"with the environment variable {MAX_BYTES_ENV}."
    )


def _check_zip(stream: Any, shown: str, what: str, size: int) -> None:
    """Refuse TorchScript archives (torch.load hands them to torch.jit.load), zip files
    without a pickle and records that would unpack to more than the whole file
    (torch.save stores them uncompressed; torch reads each record whole), reading the
    index with torch's own zip reader."""
    try:
        reader = _open_reader(stream)
        records = reader.get_all_records()
        unpacked = _unpacked_size(reader, records, stream)
    except (RuntimeError, OSError, ValueError, zipfile.BadZipFile) as err:
        raise CheckpointError(
            f"Could not read {shown} as {what}: the zip archive is truncated or corrupt "
            f"({str(err).splitlines()[0][:300]})"
        ) from err
    if "constants.pkl" in records or any(r.endswith("/constants.pkl") for r in records):
        raise CheckpointError(
            f"Refusing to load {shown}: it is a TorchScript archive (code), not {what}."
        )
    if unpacked > size:
        raise CheckpointError(
            f"Refusing to load {shown}: its zip records would unpack to {unpacked:,} bytes, "
            f"more than the whole file ({size:,} bytes); torch.save stores them uncompressed."
        )
    if "data.pkl" not in records:
        raise CheckpointError(
            f"Could not read {shown} as {what}: the zip archive has no data.pkl record."
        )


def _open_reader(stream: Any) -> Any:
    return torch._C.PyTorchFileReader(stream)


def _unpacked_size(reader: Any, records: List[str], stream: Any) -> int:
    """What the archive's records would unpack to. Newer torch's reader tells each
    record's size (`get_record_size`: torch 2.13 has it, 2.11 has not); otherwise the
    same central directory is read with Python's zip reader (sizes only: nothing is
    decompressed)."""
    size_of = getattr(reader, "get_record_size", None)
    if size_of is not None:
        return sum(size_of(record) for record in records)
    stream.seek(0)
    with zipfile.ZipFile(stream) as archive:
        return sum(info.file_size for info in archive.infolist())


def allowed_globals(
    extra: Optional[Dict[Tuple[str, str], type]] = None,
    names: Optional[Iterable[Tuple[str, str]]] = None,
) -> Dict[Tuple[str, str], Any]:
    """`TENSOR_GLOBALS` (or the named subset of it) plus plain-data classes.

    A class given here may be created empty (`NEWOBJ` without arguments) and then
    receives the pickled state through its own `__setstate__`, which must check it
    and raise `RefusedPickle` for anything unexpected (see
    `flair_format.FlairDictionaryState`).
    """
    chosen = dict(TENSOR_GLOBALS) if names is None else {k: TENSOR_GLOBALS[k] for k in names}
    chosen.update(extra or {})
    return chosen


__all__ = [
    "CheckpointError",
    "RefusedPickle",
    "load",
    "allowed_globals",
    "TENSOR_GLOBALS",
    "max_bytes",
    "MAX_BYTES_ENV",
    "DEFAULT_MAX_BYTES",
    "StandIn",
]
