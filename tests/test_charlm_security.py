"""Reading a character-LM checkpoint never runs code from it (issue #14).

Every hostile file must be refused with an error that names it, and the payload's
side effect (a marker file) must never appear: `__reduce__` payloads in the legacy
and zip formats, at the top level and nested; the allowed globals called with
arguments torch.save never writes; persistent ids that are not torch's storage
records; truncated, garbage and oversized files; the char-LM weights inside a saved
pipeline; and a `train-charlm --resume` directory.
"""

import codecs
import io
import json
import os
import pickle
import pickletools
import shutil
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy
import pytest
import spacy
import srsly
import torch

from spacy_lean.charlm import CharLM, flair_format, safe_torch
from spacy_lean.charlm.flair_format import FlairDictionaryState
from spacy_lean.charlm.loader import EncodedText
from spacy_lean.charlm.safe_torch import MAX_BYTES_ENV, CheckpointError
from spacy_lean.charlm.train import MODEL_FILE, STATE_FILE, TRAIN_STATE_VERSION, train_charlm

DATA = Path(__file__).parent / "data" / "charlm"
FLAIR_FILE = DATA / "flairwritten-forward.pt"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # TypedStorage deprecation


class _System:
    """Unpickling it runs a shell command (pickled as `posix.system`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


class _Open:
    """Unpickling it creates a file (pickled as `io.open`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


class _Call:
    """Pickles as `func(*args)` (REDUCE), then BUILD with `state` if given."""

    def __init__(self, func, args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        if self.state is None:
            return (self.func, self.args)
        return (self.func, self.args, self.state)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "PAYLOAD_RAN"
    yield path
    assert not path.exists(), "the payload ran"


@pytest.fixture(scope="module")
def checkpoint():
    return CharLM.load(FLAIR_FILE).to_checkpoint()


def _save(obj, path: Path, fmt: str, protocol: int) -> Path:
    torch.save(
        obj,
        str(path),
        pickle_module=flair_format._flair_pickle_module,
        pickle_protocol=protocol,
        _use_new_zipfile_serialization=fmt == "zip",
    )
    return path


def _refused(path, *needles):
    with pytest.raises(CheckpointError) as info:
        CharLM.load(path)
    text = str(info.value)
    assert str(path) in text
    for needle in needles:
        assert needle in text, text
    return text


def test_issue_14_plain_pickle_payload_does_not_run(tmp_path, marker):
    """The report: a protocol-2 plain pickle whose payload runs a command."""
    for payload, name in ((_System(marker), "system"), (_Open(marker), "io.open")):
        path = tmp_path / "evil.pt"
        with path.open("wb") as file_:
            pickle.dump(payload, file_, protocol=2)
        text = _refused(path, name, "Refusing to load")
        assert "may be malicious" in text
        assert not marker.exists()


def test_issue_14_through_the_component(tmp_path, marker):
    path = tmp_path / "evil.pt"
    with path.open("wb") as file_:
        pickle.dump(_System(marker), file_, protocol=2)
    nlp = spacy.blank("en")
    nlp.add_pipe("char_lm", config={"model": {"forward_lm": str(path), "backward_lm": str(path)}})
    with pytest.raises(CheckpointError, match="evil.pt"):
        nlp.initialize()


def _nest(checkpoint, where, payload):
    ck = dict(checkpoint)
    if where == "top":
        return payload
    if where == "dictionary":
        ck["dictionary"] = FlairDictionaryState({**checkpoint["dictionary"].__dict__, "x": payload})
    elif where == "idx2item":
        state = dict(checkpoint["dictionary"].__dict__)
        state["idx2item"] = list(state["idx2item"]) + [payload]
        ck["dictionary"] = FlairDictionaryState(state)
    elif where == "state_dict":
        ck["state_dict"] = {**checkpoint["state_dict"], "encoder.weight": payload}
    elif where == "setting":
        ck["dropout"] = payload
    return ck


@pytest.mark.parametrize("fmt,protocol", [("zip", 4), ("zip", 2), ("legacy", 4), ("legacy", 2)])
@pytest.mark.parametrize("where", ["top", "dictionary", "idx2item", "state_dict", "setting"])
def test_reduce_payloads_are_refused(tmp_path, marker, checkpoint, fmt, protocol, where):
    for payload in (_System(marker), _Open(marker)):
        path = _save(_nest(checkpoint, where, payload), tmp_path / "evil.pt", fmt, protocol)
        _refused(path, "which a Flair LanguageModel checkpoint does not contain")


def test_legacy_header_records_are_restricted(tmp_path, marker, checkpoint):
    """torch's legacy reader unpickles the magic number, protocol version and system
    info before the data, and the storage keys after it: each goes through the
    restricted unpickler."""
    good = tmp_path / "good.pt"
    _save(checkpoint, good, "legacy", 2)
    data = good.read_bytes()
    evil = pickle.dumps(_System(marker), protocol=2)
    stream = io.BytesIO(data)
    records = []
    for _ in range(5):  # magic, protocol, sys info, data, storage keys
        start = stream.tell()
        for _ in pickletools.genops(stream):  # reads up to the record's STOP
            pass
        records.append((start, stream.tell()))
    for i, (start, end) in enumerate(records):
        path = tmp_path / f"evil{i}.pt"
        path.write_bytes(data[:start] + evil + data[end:])
        _refused(path, "posix.system")


# --- the allowed globals, called with arguments torch.save never writes ------------

_scalar = numpy.float64(1.0).__reduce__()[0]  # numpy(._core).multiarray.scalar


def _storage(n=4):
    # A TypedStorage, pickled as torch's storage record (warns that TypedStorage is
    # deprecated: imported at collection time, before the module's filter applies).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.arange(n, dtype=torch.float32).storage()


_HOSTILE_CALLS = {
    "codecs-rot13": (_Call(codecs.encode, ("abc", "rot13")), "_codecs.encode"),
    "codecs-bytes": (_Call(codecs.encode, (b"abc", "latin1")), "_codecs.encode"),
    "bytes-bomb": (_Call(bytes, (10**12,)), "builtins.bytes"),
    "set-of-lists": (_Call(set, ([[1, 2]],)), "builtins.set"),
    "frozenset-int": (_Call(frozenset, (5,)), "builtins.frozenset"),
    "ordereddict-args": (_Call(OrderedDict, ("not pairs",)), "collections.OrderedDict"),
    "ordereddict-state": (_Call(OrderedDict, (), {"__class__": 1, "x": 2}), "OrderedDict"),
    "size": (_Call(torch.Size, (("a",),)), "torch.Size"),
    "device": (_Call(torch.device, ("cpu; rm -rf ~",)), "torch.device"),
    "dtype-object": (numpy.dtype(object), "numpy.dtype"),
    "dtype-state": (
        _Call(numpy.dtype, ("f8", False, True), (3, "<", None, ("a",), {"a": (1, 0)}, 8, 1, 0)),
        "numpy.dtype",
    ),
    "scalar-short": (_Call(_scalar, (numpy.dtype("f8"), b"abc")), "scalar"),
    "scalar-str-dtype": (_Call(_scalar, ("f8", b"12345678")), "scalar"),
    "tensor-out-of-bounds": (
        _Call(
            torch._utils._rebuild_tensor_v2, (_storage(), 0, (1000,), (1,), False, OrderedDict())
        ),
        "does not fit",
    ),
    "tensor-offset": (
        _Call(
            torch._utils._rebuild_tensor_v2, (_storage(), 10**9, (2,), (1,), False, OrderedDict())
        ),
        "does not fit",
    ),
    "tensor-negative-stride": (
        _Call(torch._utils._rebuild_tensor_v2, (_storage(), 3, (2,), (-1,), False, OrderedDict())),
        "_rebuild_tensor_v2",
    ),
    "tensor-not-a-storage": (
        _Call(torch._utils._rebuild_tensor_v2, ([1, 2], 0, (2,), (1,), False, OrderedDict())),
        "not a storage of this file",
    ),
    "tensor-hooks": (
        _Call(
            torch._utils._rebuild_tensor_v2, (_storage(), 0, (2,), (1,), False, OrderedDict(hook=1))
        ),
        "_rebuild_tensor_v2",
    ),
    "tensor-metadata": (
        _Call(
            torch._utils._rebuild_tensor_v2,
            (_storage(), 0, (2,), (1,), False, OrderedDict(), {"conj": True}),
        ),
        "_rebuild_tensor_v2",
    ),
    "tensor-v1": (_Call(torch._utils._rebuild_tensor, (_storage(), 0, (9,), (1,))), "does not fit"),
    "parameter-list": (
        _Call(torch._utils._rebuild_parameter, ([1.0], False, OrderedDict())),
        "_rebuild_parameter",
    ),
    "parameter-flag": (
        _Call(torch._utils._rebuild_parameter, (torch.zeros(2), "yes", OrderedDict())),
        "_rebuild_parameter",
    ),
    "dictionary-called": (_Call(FlairDictionaryState, ({},)), "calls"),
}


@pytest.mark.parametrize("fmt,protocol", [("zip", 4), ("legacy", 2)])
@pytest.mark.parametrize("case", sorted(_HOSTILE_CALLS))
def test_allowed_globals_refuse_unexpected_arguments(tmp_path, checkpoint, case, fmt, protocol):
    value, needle = _HOSTILE_CALLS[case]
    path = _save({**checkpoint, "extra": value}, tmp_path / f"{case}.pt", fmt, protocol)
    _refused(path, needle)


def test_allowed_globals_with_the_arguments_torch_writes(tmp_path, checkpoint):
    """The stand-ins still build what they should (numpy values, sets, sizes, ...)."""
    extra = {
        "np": numpy.float32(1.5),
        "set": {1, 2},
        "frozen": frozenset(["a"]),
        "bytes": b"",
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "param": torch.nn.Parameter(torch.ones(2)),
        "view": torch.arange(6.0)[2:5],
    }
    for fmt, protocol in (("zip", 4), ("zip", 2), ("legacy", 2), ("legacy", 4)):
        path = _save({**checkpoint, "extra": extra}, tmp_path / "ok.pt", fmt, protocol)
        loaded = flair_format.load_checkpoint(path)["extra"]
        assert loaded["np"] == numpy.float32(1.5) and loaded["np"].dtype == numpy.float32
        assert loaded["set"] == {1, 2} and loaded["frozen"] == frozenset(["a"])
        assert loaded["bytes"] == b"" and loaded["size"] == torch.Size([2, 3])
        assert loaded["device"] == torch.device("cpu")
        assert isinstance(loaded["param"], torch.nn.Parameter)
        assert torch.equal(loaded["view"], torch.arange(2.0, 5.0))


# Hand-written pickles (protocol 2 opcodes) that a pickler would not write for us.
_RAW = {
    "newobj-stand-in": (b"ccollections\nOrderedDict\n)\x81.", "creates an object"),
    "newobj-args": (b"cflair.data\nDictionary\nX\x01\x00\x00\x00x\x85\x81.", "creates an object"),
    "build-dictionary-list": (
        b"cflair.data\nDictionary\n)\x81(K\x01K\x02lb.",
        "flair.data.Dictionary",
    ),
    "build-tuple-of-str": (b"c__builtin__\nset\n)R}X\x01\x00\x00\x00aK\x01sb.", "state of"),
    "append-to-stand-in": (b"c_codecs\nencode\nK\x01a.", "APPEND targets"),
    "setitem-on-tensor": (b"ctorch\nSize\n]K\x02a\x85R" b"K\x00K\x01s.", "SETITEM targets"),
    "inst": (b"(X\x01\x00\x00\x00aiposix\nsystem\n.", "INST"),
    "obj": (b"(ccollections\nOrderedDict\no.", "OBJ"),
    "ext1": (b"\x82\x01.", "EXT1"),
    "persid-text": (b"P0\n.", "PERSID"),
}


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("case", sorted(_RAW))
def test_hand_written_opcodes_are_refused(tmp_path, marker, case, fmt):
    body, needle = _RAW[case]
    _refused(_hand_written(tmp_path / f"{case}.pt", body, fmt), needle)


def _hand_written(path: Path, body: bytes, fmt: str, keys=("0",)) -> Path:
    """A protocol-2 pickle `body` in a torch file of format `fmt` (zip or legacy, whose
    trailing record lists the storage `keys`)."""
    data = b"\x80\x02" + body
    if fmt == "zip":
        return _zip_file(path, data)
    return _legacy_file(path, data, keys=keys)


# Pickles whose objects share parts through the memo (or DUP), so that a file of a few
# hundred bytes unpickles to a tree of 2**N values: hashing, printing or walking it would
# never end (N is kept small enough here that a regression fails in seconds instead of
# hanging). `)` + `2\x86` * N: the empty tuple, then N times (DUP, TUPLE2).
def _tuple_tree(n: int) -> bytes:
    return b")" + b"2\x86" * n


def _list_tree(n: int) -> bytes:
    # L0 = []; L(k+1) = [Lk, Lk], Lk in memo slot 10 + k.
    body = b"]q\x0a0"
    for k in range(10, 10 + n):
        body += b"](h" + bytes([k]) + b"h" + bytes([k]) + b"eq" + bytes([k + 1]) + b"0"
    return body + b"h" + bytes([10 + n])


_SHARED = {
    # A dict key: SETITEM hashes it.
    "tuple-as-key": (b"}" + _tuple_tree(26) + b"Ns.", "builds a tuple that holds"),
    # numpy.dtype's BUILD state, which the refusal used to print with repr().
    "tuple-as-dtype-state": (
        b"cnumpy\ndtype\nX\x02\x00\x00\x00f8\x85R" + _tuple_tree(22) + b"b.",
        "builds a tuple that holds",
    ),
    # A tuple under the size limit, hashed as a key again and again (SETITEMS).
    "tuple-key-repeated": (
        b"}(" + _tuple_tree(17) + b"q\x01N" + b"h\x01N" * 40 + b"u.",
        "hashing its dict keys",
    ),
    # The same through frozenset's stand-in.
    "tuple-in-frozenset": (
        b"c__builtin__\nfrozenset\n](" + _tuple_tree(17) + b"q\x01" + b"h\x01" * 40 + b"e\x85R.",
        "hashing its dict keys",
    ),
    # Lists cannot be hashed, but printing or walking the result never ends.
    "list-tree": (b"}X\x06\x00\x00\x00hiddenq\x02" + _list_tree(40) + b"s.", "unpickles to more"),
}


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("case", sorted(_SHARED))
def test_shared_structure_bombs_are_refused_at_once(tmp_path, case, fmt):
    """A ~150-byte file whose shared tuples hashed as a dict key (2**26 visits) or
    printed in a refusal took from seconds to forever; shared lists unpickled to a
    result no caller could print. Each is refused while the file is read."""
    body, needle = _SHARED[case]
    path = _hand_written(tmp_path / f"{case}.pt", body, fmt, keys=())  # no storages
    pickletools.dis(b"\x80\x02" + body, out=io.StringIO())  # well-formed: refused for its shape
    _refused(path, needle)


def test_shared_parts_of_a_normal_size_are_read(tmp_path):
    """Sharing itself is fine (torch's pickles reuse strings and tuples through the
    memo): a tree of 2**12 values from a 60-byte file loads, with its keys."""
    data = b"\x80\x02}(" + _tuple_tree(12) + _list_tree(12) + b"u."
    path = _zip_file(tmp_path / "shared.pt", data)
    loaded = safe_torch.load(path, safe_torch.allowed_globals(), what="a test file")
    [(key, value)] = loaded.items()
    assert key[0] is key[1] and len(value) == 2 and value[0] is value[1]


class _PlainData:
    """A plain-data class a caller may allow: created empty, filled by BUILD."""

    def __setstate__(self, state):
        self.__dict__.update(state)


def test_build_calls_the_class_setstate_not_one_the_pickle_planted(tmp_path):
    """A first BUILD may put a `__setstate__` key in an allowed object's attributes; the
    next BUILD must still call the class's `__setstate__`, not whatever the pickle put
    there (here the `builtins.bytes` stand-in: a call REDUCE would refuse)."""
    from spacy_lean.charlm import safe_torch

    data = (
        b"\x80\x02ctest\nPlainData\n)\x81"
        b"}X\x0c\x00\x00\x00__setstate__cbuiltins\nbytes\nsb"
        b"}X\x01\x00\x00\x00aK\x07sb."
    )
    path = _zip_file(tmp_path / "planted.pt", data)
    allowed = safe_torch.allowed_globals({("test", "PlainData"): _PlainData})
    loaded = safe_torch.load(path, allowed, what="a test file")
    assert type(loaded) is _PlainData and loaded.a == 7


def test_state_dict_metadata_holds_module_versions_only(tmp_path, checkpoint):
    """A state dict's `_metadata` is read by `load_state_dict`: a key other than the
    module version there (`assign_to_params_buffers`) made the file's tensors the
    parameters as they were (any float dtype, several parameters sharing memory)."""
    state = OrderedDict(checkpoint["state_dict"])
    state["encoder.weight"] = state["encoder.weight"].double()
    state._metadata = OrderedDict({"encoder": {"version": 1, "assign_to_params_buffers": True}})
    path = _save({**checkpoint, "state_dict": state}, tmp_path / "assign.pt", "zip", 4)
    _refused(path, "_metadata")
    state._metadata = OrderedDict({"": {"version": 1}, "encoder": {"version": 1}})
    path = _save({**checkpoint, "state_dict": state}, tmp_path / "versions.pt", "zip", 4)
    assert CharLM.load(path).encoder.weight.dtype == torch.float32


def test_state_dict_metadata_cannot_be_changed_after_it_is_checked(tmp_path):
    """The pickle can fetch a dict it built from the memo and add to it later: the
    versions are copied when `_metadata` is set, so what the check saw is what stays."""
    from spacy_lean.charlm import safe_torch

    data = (
        b"\x80\x02ccollections\nOrderedDict\n)R"
        b"}X\t\x00\x00\x00_metadata}X\x07\x00\x00\x00encoder}q\x02X\x07\x00\x00\x00versionK\x01sssb"
        b"h\x02X\x18\x00\x00\x00assign_to_params_buffers\x88s0."
    )
    path = _zip_file(tmp_path / "later.pt", data)
    loaded = safe_torch.load(path, safe_torch.allowed_globals(), what="a test file")
    assert loaded._metadata == {"encoder": {"version": 1}}


# --- persistent ids ----------------------------------------------------------------


class _Pid:
    def __init__(self, pid):
        self.pid = pid


class _PidPickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _Pid) else None


def _with_pid(pid, protocol=2) -> bytes:
    pids = pid if isinstance(pid, list) else [pid]
    buf = io.BytesIO()
    _PidPickler(buf, protocol=protocol).dump({"state_dict": [_Pid(p) for p in pids]})
    return buf.getvalue()


def _zip_file(path: Path, data_pkl: bytes, records=None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
        for name, content in (records or {}).items():
            archive.writestr(f"archive/{name}", content)
    return path


def _legacy_file(path: Path, data_pkl: bytes, keys=("0",)) -> Path:
    head = b"".join(
        pickle.dumps(x, protocol=2)
        for x in (
            torch.serialization.MAGIC_NUMBER,
            torch.serialization.PROTOCOL_VERSION,
            {
                "protocol_version": 1001,
                "little_endian": True,
                "type_sizes": {"short": 2, "int": 4, "long": 4},
            },
        )
    )
    path.write_bytes(head + data_pkl + pickle.dumps(list(keys), protocol=2) + b"\0" * 64)
    return path


_NOT_TORCH = "persistent id torch does not write"
_BAD_PIDS = {
    "module": (("module", OrderedDict, "source.py", "class X: pass"), _NOT_TORCH),
    "not-a-type": (("storage", "FloatStorage", "0", "cpu", 4), _NOT_TORCH),
    "object-type": (
        ("storage", torch.serialization.StorageType, "0", "cpu", 4),
        "torch.serialization.StorageType",
    ),
    "path-key": (("storage", torch.FloatStorage, "../../etc/passwd", "cpu", 4), _NOT_TORCH),
    "location": (("storage", torch.FloatStorage, "0", "cpu; rm -rf ~", 4), _NOT_TORCH),
    "negative": (("storage", torch.FloatStorage, "0", "cpu", -1), _NOT_TORCH),
    "not-a-tuple": ("storage", _NOT_TORCH),
    "huge": (("storage", torch.FloatStorage, "0", "cpu", 10**12), "more than the whole file"),
}
# The legacy format's records carry a view (None, or key, offset, size) as a sixth item.
_LEGACY_ONLY = {
    "view": (("storage", torch.FloatStorage, "0", "cpu", 4, ("1", 3, 10)), _NOT_TORCH),
    "zip-record": (("storage", torch.FloatStorage, "0", "cpu", 4), _NOT_TORCH),
    # Each fits in the file, all together do not: refused before torch allocates them.
    "many": (
        [("storage", torch.FloatStorage, str(i), "cpu", 1000, None) for i in range(1000)],
        "more than the whole file",
    ),
    # The same, each key named again with no elements: torch keeps the storage it made
    # the first time, so the later record must not lower the count.
    "many-renamed": (
        [
            ("storage", torch.FloatStorage, str(i // 2), "cpu", 1000 * (1 - i % 2), None)
            for i in range(2000)
        ],
        "more than the whole file",
    ),
}
_ZIP_ONLY = {
    "legacy-record": (("storage", torch.FloatStorage, "0", "cpu", 4, None), _NOT_TORCH),
}


def _legacy_pid(pid):
    if isinstance(pid, tuple) and pid[0] == "storage" and len(pid) == 5:
        return pid + (None,)
    return pid


@pytest.mark.parametrize(
    "fmt,case",
    [("zip", c) for c in sorted({**_BAD_PIDS, **_ZIP_ONLY})]
    + [("legacy", c) for c in sorted({**_BAD_PIDS, **_LEGACY_ONLY})],
)
def test_persistent_ids_must_be_torch_storage_records(tmp_path, case, fmt):
    path = tmp_path / f"{case}.pt"
    if fmt == "zip":
        pid, needle = {**_BAD_PIDS, **_ZIP_ONLY}[case]
        _zip_file(path, _with_pid(pid), {"data/0": b"\0" * 16})
    else:
        pid, needle = _LEGACY_ONLY[case] if case in _LEGACY_ONLY else _BAD_PIDS[case]
        pid = pid if case == "zip-record" else _legacy_pid(pid)
        _legacy_file(path, _with_pid(pid))
    _refused(path, needle)


def test_legacy_storage_without_data(tmp_path):
    """A storage the legacy format's key list leaves off would keep uninitialised memory."""
    buf = io.BytesIO()
    _PidPickler(buf, protocol=2).dump(
        _Call(
            torch._utils._rebuild_tensor_v2,
            (
                _Pid(("storage", torch.FloatStorage, "7", "cpu", 4, None)),
                0,
                (4,),
                (1,),
                False,
                OrderedDict(),
            ),
        )
    )
    path = _legacy_file(tmp_path / "nodata.pt", buf.getvalue(), keys=())
    _refused(path, "storages whose data it does not contain")


def test_persistent_id_outside_the_main_pickle(tmp_path):
    path = tmp_path / "header.pt"
    header = _with_pid(("storage", "FloatStorage", "0", "cpu", 4))
    path.write_bytes(header)
    _refused(path, "persistent id where torch writes none")


def test_hand_built_zip_with_a_good_storage_record_loads(tmp_path):
    """The record checks accept what torch writes (so the refusals above are about
    the records, not about hand-built files)."""
    buf = io.BytesIO()
    _PidPickler(buf, protocol=2).dump(
        _Call(
            torch._utils._rebuild_tensor_v2,
            (
                _Pid(("storage", torch.FloatStorage, "0", "cpu", 4)),
                0,
                (4,),
                (1,),
                False,
                OrderedDict(),
            ),
        )
    )
    data = numpy.arange(4, dtype="<f4").tobytes()
    path = _zip_file(tmp_path / "good.pt", buf.getvalue(), {"data/0": data})
    from spacy_lean.charlm import safe_torch

    tensor = safe_torch.load(path, safe_torch.allowed_globals(), what="a tensor")
    assert torch.equal(tensor, torch.arange(4.0))


def test_torchscript_archive_is_refused(tmp_path, marker):
    """torch.load hands TorchScript archives to torch.jit.load (code): refused first."""
    path = _zip_file(
        tmp_path / "script.pt",
        pickle.dumps({}, protocol=2),
        {"constants.pkl": pickle.dumps((), protocol=2), "code/x.py": b"..."},
    )
    _refused(path, "TorchScript")


# --- broken files --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_truncated_files(tmp_path, checkpoint, fmt):
    good = _save(checkpoint, tmp_path / "good.pt", fmt, 4)
    data = good.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 40):
        path = tmp_path / f"cut{cut}.pt"
        path.write_bytes(data[:cut])
        _refused(path, "truncated or corrupt")


def test_garbage_and_empty_files(tmp_path):
    path = tmp_path / "garbage.pt"
    path.write_bytes(os.urandom(1000).replace(b"\x80", b"x").replace(b"PK", b"xx"))
    _refused(path, "neither a torch zip archive nor a legacy torch file")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    _refused(empty, "neither a torch zip archive")
    not_lm = tmp_path / "list.pt"
    torch.save([1, 2], str(not_lm))
    _refused(not_lm, "expected a dict, got list")


def test_oversized_file(tmp_path, monkeypatch):
    path = tmp_path / "big.pt"
    shutil.copy(FLAIR_FILE, path)
    monkeypatch.setenv(MAX_BYTES_ENV, "1000")
    _refused(path, "more than the limit of 1,000 bytes", MAX_BYTES_ENV)
    with pytest.raises(CheckpointError, match="more than the limit"):
        CharLM.from_bytes(FLAIR_FILE.read_bytes())
    monkeypatch.setenv(MAX_BYTES_ENV, "lots")
    with pytest.raises(ValueError, match=MAX_BYTES_ENV):
        CharLM.load(path)
    monkeypatch.delenv(MAX_BYTES_ENV)
    assert CharLM.load(path).hidden_size == 24


def test_settings_must_match_the_tensors(tmp_path, checkpoint):
    """A file cannot make us build a model far larger than itself."""
    for key, value in (
        ("hidden_size", 10**6),
        ("nlayers", 10**6),
        ("embedding_size", 3),
        ("nout", 10**6),
        ("hidden_size", "24"),
    ):
        path = _save({**checkpoint, key: value}, tmp_path / "sizes.pt", "zip", 4)
        with pytest.raises(ValueError, match="sizes.pt"):
            CharLM.load(path)


def test_zip_records_that_unpack_beyond_the_file(tmp_path):
    """torch.save stores zip records uncompressed; a deflated record could unpack to far
    more than the size limit allows (a 1 MB file to 1 GB): refused before torch reads it."""
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02" + b"N0" * 1_000_000 + b"}.")
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    assert path.stat().st_size < 10_000
    _refused(path, "zip records would unpack to 2,000,", "more than the whole file")


class _ReaderWithoutSizes:
    """torch's zip reader as torch 2.11 has it: no get_record_size (seen on a GPU
    machine: every checkpoint load failed with an AttributeError)."""

    def __init__(self, stream):
        self._reader = torch._C.PyTorchFileReader(stream)

    def get_all_records(self):
        return self._reader.get_all_records()


def test_zip_check_without_torchs_record_sizes(tmp_path, monkeypatch):
    """Older torch's zip reader cannot tell a record's size: the sizes come from the
    archive's central directory instead, with the same verdicts."""
    assert CharLM.load(FLAIR_FILE).hidden_size == 24
    expected = sum(info.file_size for info in zipfile.ZipFile(FLAIR_FILE).infolist())
    reader = torch._C.PyTorchFileReader(str(FLAIR_FILE))
    if hasattr(reader, "get_record_size"):  # this torch: both ways agree
        records = reader.get_all_records()
        assert sum(reader.get_record_size(r) for r in records) == expected
    monkeypatch.setattr(safe_torch, "_open_reader", _ReaderWithoutSizes)
    assert CharLM.load(FLAIR_FILE).hidden_size == 24
    test_zip_records_that_unpack_beyond_the_file(tmp_path)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(FLAIR_FILE.read_bytes()[:-40])
    _refused(truncated, "truncated or corrupt")


def test_expanded_tensors_cannot_make_a_model_far_larger_than_the_file(tmp_path, checkpoint):
    """An expanded tensor (stride 0) of any size fits in a storage of one element, so
    the settings-match-the-tensors check alone let a 4 KB file build a model of
    millions of parameters (hidden and embedding size 2048: 34M from 4,228 bytes)."""
    n_chars = checkpoint["state_dict"]["encoder.weight"].shape[0]
    size = 512

    def zeros(*shape):
        return torch.zeros(1).expand(*shape)

    hostile = {
        **checkpoint,
        "hidden_size": size,
        "embedding_size": size,
        "state_dict": {
            "encoder.weight": zeros(n_chars, size),
            "rnn.weight_ih_l0": zeros(4 * size, size),
            "rnn.weight_hh_l0": zeros(4 * size, size),
            "rnn.bias_ih_l0": zeros(4 * size),
            "rnn.bias_hh_l0": zeros(4 * size),
            "decoder.weight": zeros(n_chars, size),
            "decoder.bias": zeros(n_chars),
        },
    }
    path = _save(hostile, tmp_path / "expanded.pt", "zip", 4)
    assert path.stat().st_size < 10_000
    _refused(path, "tensors would hold", "more than the whole file")


def test_every_tensor_must_match_the_model_before_it_is_built(tmp_path, checkpoint):
    """The model is built from the settings before the weights are loaded: a tensor
    the settings check does not look at (here `rnn.weight_ih_l0`, whose model
    counterpart is 4 x hidden_size x embedding_size) must not let it grow beyond the
    file either; the shapes are compared with the model's before it is made."""
    state = dict(checkpoint["state_dict"], **{"rnn.weight_ih_l0": torch.zeros(96, 1)})
    path = _save({**checkpoint, "state_dict": state}, tmp_path / "shapes.pt", "zip", 4)
    _refused(path, "do not match the tensor 'rnn.weight_ih_l0' ((96, 1)), the model's is (96, 8)")


def test_bad_dictionary_or_settings_name_the_file(tmp_path, checkpoint):
    """What the pickle holds is checked after loading: those errors name the file too."""
    for key, value, needle in (
        ("dictionary", FlairDictionaryState({"idx2item": 5}), "idx2item"),
        ("dictionary", {"x": 1}, "idx2item"),
        ("recurrent_type", "transformer", "recurrent_type"),
    ):
        path = _save({**checkpoint, key: value}, tmp_path / "bad.pt", "zip", 4)
        _refused(path, needle)


# --- a pipeline directory and a training run -------------------------------------------


def _swap_forward_lm(model_bytes: bytes, new: bytes) -> bytes:
    """Replace the forward LM's checkpoint bytes inside a CharLMEmbed model's bytes."""
    msg = srsly.msgpack_loads(model_bytes)
    for node_shims in msg["shims"]:
        for i, shim_bytes in enumerate(node_shims):
            shim = srsly.msgpack_loads(shim_bytes)
            pair = srsly.msgpack_loads(shim["state"])
            pair["forward"] = new
            shim["state"] = srsly.msgpack_dumps(pair)
            node_shims[i] = srsly.msgpack_dumps(shim)
    return srsly.msgpack_dumps(msg)


def test_hostile_pipeline_char_lm_weights(tmp_path, marker, checkpoint):
    torch.set_num_threads(1)
    nlp = spacy.blank("en")
    nlp.add_pipe(
        "char_lm",
        config={
            "model": {
                "forward_lm": str(DATA / "flairwritten-forward.pt"),
                "backward_lm": str(DATA / "flairwritten-backward.pt"),
            }
        },
    )
    nlp.initialize()
    evil_lm = tmp_path / "evil-lm.pt"
    _save(_nest(checkpoint, "dictionary", _System(marker)), evil_lm, "zip", 4)
    legacy = io.BytesIO()
    pickle.dump(_Open(marker), legacy, protocol=2)
    for evil in (evil_lm.read_bytes(), legacy.getvalue()):
        # from_disk: the component's model file
        nlp.to_disk(tmp_path / "pipeline")
        model_file = tmp_path / "pipeline" / "char_lm" / "model"
        model_file.write_bytes(_swap_forward_lm(model_file.read_bytes(), evil))
        with pytest.raises(CheckpointError) as info:
            spacy.load(tmp_path / "pipeline")
        assert str(model_file) in str(info.value) and "forward character LM" in str(info.value)
        # from_bytes: the pipeline's bytes
        msg = srsly.msgpack_loads(nlp.to_bytes())
        component = srsly.msgpack_loads(msg["char_lm"])
        component["model"] = _swap_forward_lm(component["model"], evil)
        msg["char_lm"] = srsly.msgpack_dumps(component)
        blank = spacy.blank("en")
        blank.add_pipe("char_lm")
        with pytest.raises(CheckpointError, match="forward character LM"):
            blank.from_bytes(srsly.msgpack_dumps(msg))
    assert len(spacy.load(_fresh_copy(nlp, tmp_path))("a b").tensor) == 2


def _fresh_copy(nlp, tmp_path):
    nlp.to_disk(tmp_path / "clean")
    return tmp_path / "clean"


def test_hostile_train_charlm_resume(tmp_path, marker):
    text = tmp_path / "train.txt"
    text.write_text("abc def ghi\n" * 50, encoding="utf8")
    run = tmp_path / "run"
    run.mkdir()
    tiny = dict(
        hidden_size=8,
        embedding_size=4,
        bptt=10,
        batch_size=2,
        gpu_id=-1,
        progress=False,
        max_steps=2,
    )
    # A hostile training state (zip and plain pickle).
    shutil.copy(FLAIR_FILE, run / MODEL_FILE)
    torch.save({"version": TRAIN_STATE_VERSION, "x": _System(marker)}, run / STATE_FILE)
    with pytest.raises(CheckpointError, match=STATE_FILE):
        train_charlm([text], run, resume=True, **tiny)
    with (run / STATE_FILE).open("wb") as file_:
        pickle.dump(_Open(marker), file_, protocol=2)
    with pytest.raises(CheckpointError, match=STATE_FILE):
        train_charlm([text], run, resume=True, **tiny)
    # A plain state, and a hostile model checkpoint.
    torch.save({"version": TRAIN_STATE_VERSION, "config": {"optimizer": "sgd"}}, run / STATE_FILE)
    with (run / MODEL_FILE).open("wb") as file_:
        pickle.dump(_System(marker), file_, protocol=2)
    with pytest.raises(CheckpointError, match=MODEL_FILE):
        train_charlm([text], run, resume=True, **tiny)


def test_hostile_resume_through_the_cli(tmp_path, marker):
    from spacy.cli._util import app
    from typer.testing import CliRunner

    import spacy_lean.cli  # noqa: F401

    text = tmp_path / "train.txt"
    text.write_text("abc def\n" * 20, encoding="utf8")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FLAIR_FILE, run / MODEL_FILE)
    with (run / STATE_FILE).open("wb") as file_:
        pickle.dump(_System(marker), file_, protocol=2)
    args = [
        "lean",
        "train-charlm",
        str(text),
        str(run),
        "--resume",
        "--gpu-id",
        "-1",
        "--threads",
        "1",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert "Refusing to load" in result.output and STATE_FILE in result.output
    result = CliRunner().invoke(app, args[:4] + ["--dictionary-from", str(run / STATE_FILE)])
    assert result.exit_code == 1 and "Refusing to load" in result.output


def test_encoded_text_refuses_object_ids(tmp_path):
    """The encoded corpus of a run is memory-mapped with the dtype in its metadata:
    an object dtype would read file bytes as pointers."""
    (tmp_path / "ids.bin").write_bytes(b"A" * 64)
    meta = {
        "format": "spacy-lean.charlm-ids.v1",
        "dtype": "object",
        "n_chars": 8,
        "vocab_size": 3,
        "dictionary": "x",
        "sources": [],
    }
    (tmp_path / "ids.json").write_text(srsly.json_dumps(meta), encoding="utf8")
    with pytest.raises(ValueError, match="Unsupported id dtype 'object'"):
        EncodedText(tmp_path)
    meta["dtype"] = ["uint8"]
    (tmp_path / "ids.json").write_text(srsly.json_dumps(meta), encoding="utf8")
    with pytest.raises(ValueError, match="Unsupported id dtype"):
        EncodedText(tmp_path)


def test_encoded_text_sizes_must_match_the_id_file(tmp_path):
    """The number of ids in the metadata sizes the memory map: a negative, huge,
    non-integer or wrong one (or an id file that is not what it says) is refused with
    an error naming the files, which train-charlm answers by encoding the text again."""
    (tmp_path / "ids.bin").write_bytes(b"\x01" * 16)
    meta = {
        "format": "spacy-lean.charlm-ids.v1",
        "dtype": "uint16",
        "n_chars": 8,
        "vocab_size": 3,
        "dictionary": "x",
        "sources": [],
    }
    (tmp_path / "ids.json").write_text(srsly.json_dumps(meta), encoding="utf8")
    assert len(EncodedText(tmp_path)) == 8
    for key, value in (
        ("n_chars", -5),
        ("n_chars", 0),
        ("n_chars", 10**30),
        ("n_chars", 9),
        ("n_chars", 7),
        ("n_chars", 8.0),
        ("n_chars", "8"),
        ("vocab_size", -1),
        ("vocab_size", None),
    ):
        (tmp_path / "ids.json").write_text(json.dumps({**meta, key: value}), encoding="utf8")
        with pytest.raises(ValueError, match="ids.json") as info:
            EncodedText(tmp_path)
        assert str(tmp_path) in str(info.value)
    text = json.dumps(meta).replace('"n_chars": 8', '"n_chars": 1e999')
    assert "1e999" in text
    (tmp_path / "ids.json").write_text(text, encoding="utf8")
    with pytest.raises(ValueError, match="ids.json"):
        EncodedText(tmp_path)
    (tmp_path / "ids.json").write_text(srsly.json_dumps(meta), encoding="utf8")
    (tmp_path / "ids.bin").unlink()
    (tmp_path / "ids.bin").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="ids.bin"):
        EncodedText(tmp_path)


def test_torch_forced_weights_only_is_explained(monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(RuntimeError, match="Unset it"):
        CharLM.load(FLAIR_FILE)
