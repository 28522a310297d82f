"""Reading and writing Flair `LanguageModel` checkpoints without importing flair.

A Flair character-LM checkpoint is a `torch.save` of a plain dict: `state_dict`, the
settings of the model (`is_forward_lm`, `hidden_size`, `nlayers`, `embedding_size`,
`nout`, `document_delimiter`, `dropout`, `recurrent_type`, `has_decoder`; files
written by older Flair versions lack the last three) and `dictionary`, a pickled
`flair.data.Dictionary` whose `idx2item` holds UTF-8 encoded characters.

Loading goes through `torch.load` with a restricted unpickler: it accepts only the
globals such a file contains (tensor rebuild functions, `OrderedDict`,
`_codecs.encode`) and maps `flair.data.Dictionary` to the stand-in class below, so
reading a checkpoint cannot run code. (torch's own `weights_only` unpickler cannot
be used: it rejects the protocol-4 FRAME opcode of Flair's files.) Writing pickles the
stand-in as `flair.data.Dictionary` with Flair's attributes, so
`flair.models.LanguageModel.load_language_model` reads our files.
"""
import io
import pickle
import types
from pathlib import Path
from typing import Any, Dict, List, Union

import torch

FLAIR_DICTIONARY_GLOBAL = ("flair.data", "Dictionary")

# Defaults for keys that older Flair checkpoints do not carry.
_SETTING_DEFAULTS = {
    "document_delimiter": "\n",
    "dropout": 0.1,
    "recurrent_type": "lstm",
    "has_decoder": True,
    "nout": None,
}
_REQUIRED_KEYS = ("state_dict", "dictionary", "is_forward_lm", "hidden_size", "nlayers",
                  "embedding_size")


class FlairDictionaryState:
    """Stand-in for `flair.data.Dictionary` while unpickling and pickling.

    It only carries the attributes of the pickled object (`idx2item`, `item2idx`,
    `add_unk`, ...), exactly as Flair stores them (items as UTF-8 bytes).
    """

    def __init__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)


class _FlairPickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pure-Python pickler that writes `FlairDictionaryState` as `flair.data.Dictionary`."""

    def save_global(self, obj, name=None):  # noqa: D401
        if obj is FlairDictionaryState:
            module, qualname = FLAIR_DICTIONARY_GLOBAL
            if self.proto >= 4:
                self.save(module)
                self.save(qualname)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
            self.memoize(obj)
            return
        super().save_global(obj, name)


# torch.save only needs `pickle_module.Pickler` (and a `__name__`).
_flair_pickle_module = types.ModuleType("spacy_lean_flair_pickle")
_flair_pickle_module.Pickler = _FlairPickler  # type: ignore[attr-defined]
_flair_pickle_module.dump = pickle.dump  # type: ignore[attr-defined] # legacy-format headers


# Everything a Flair LanguageModel checkpoint names. Storage classes (`torch.FloatStorage`
# ...) are resolved by torch's own unpickler wrapper before `find_class` is reached.
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    # Protocol-2 pickles (torch.save's default, so older Flair files) store the
    # dictionary's bytes items as `_codecs.encode(text, "latin1")`.
    ("_codecs", "encode"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch", "Size"),
    ("torch", "device"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "dtype"),
}


class _FlairUnpickler(pickle.Unpickler):
    """Unpickler that maps `flair.data.Dictionary` to `FlairDictionaryState` and refuses
    every global a LanguageModel checkpoint has no reason to name."""

    def find_class(self, module: str, name: str):
        if (module, name) == FLAIR_DICTIONARY_GLOBAL:
            return FlairDictionaryState
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the checkpoint names '{module}.{name}', which a Flair LanguageModel file "
            "does not contain; refusing to load it"
        )


_flair_unpickle_module = types.ModuleType("spacy_lean_flair_unpickle")
_flair_unpickle_module.Unpickler = _FlairUnpickler  # type: ignore[attr-defined]
_flair_unpickle_module.load = pickle.load  # type: ignore[attr-defined] # legacy-format headers


def dictionary_state(idx2item: List[str], add_unk: bool = True) -> FlairDictionaryState:
    """Build the pickled form of a Flair character dictionary from `idx2item`."""
    items = [item.encode("utf-8", errors="surrogateescape") for item in idx2item]
    return FlairDictionaryState({
        "item2idx": {item: i for i, item in enumerate(items)},
        "idx2item": items,
        "add_unk": add_unk,
        "multi_label": False,
        "span_labels": False,
    })


def decode_items(state: Any) -> List[str]:
    """The characters of a pickled Flair dictionary (`idx2item`), as str."""
    if isinstance(state, dict):
        raw = state.get("idx2item")
    else:
        raw = getattr(state, "idx2item", None)
    if raw is None:
        raise ValueError(
            f"The checkpoint's 'dictionary' has no 'idx2item' (got {type(state).__name__}); "
            "is this a Flair LanguageModel file?"
        )
    return [
        item.decode("utf-8", errors="surrogateescape") if isinstance(item, bytes) else str(item)
        for item in raw
    ]


def save_checkpoint(checkpoint: Dict[str, Any], path: Union[str, Path]) -> None:
    """`torch.save` a checkpoint dict whose `dictionary` is a `FlairDictionaryState`,
    in the format Flair writes (pickle protocol 4, zip container)."""
    torch.save(checkpoint, str(path), pickle_module=_flair_pickle_module, pickle_protocol=4)


def checkpoint_to_bytes(checkpoint: Dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(checkpoint, buf, pickle_module=_flair_pickle_module, pickle_protocol=4)
    return buf.getvalue()


def load_checkpoint(
    path_or_bytes: Union[str, Path, bytes], map_location: Any = "cpu"
) -> Dict[str, Any]:
    """Read a Flair LanguageModel checkpoint (from a path or bytes) without flair.

    RETURNS (Dict[str, Any]): the checkpoint dict, with defaults filled in for keys
        older Flair versions did not write, and `dictionary` as a `FlairDictionaryState`.
    """
    if isinstance(path_or_bytes, bytes):
        source: Any = io.BytesIO(path_or_bytes)
    elif Path(path_or_bytes).exists():
        source = str(path_or_bytes)
    else:
        raise FileNotFoundError(f"Character LM checkpoint not found: {path_or_bytes}")
    try:
        checkpoint = torch.load(
            source, map_location=map_location, pickle_module=_flair_unpickle_module,
            weights_only=False,  # our restricted unpickler below does the checking
        )
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"Could not read {path_or_bytes!r} as a Flair LanguageModel checkpoint: {err}"
        ) from err
    if not isinstance(checkpoint, dict):
        raise ValueError(
            f"Expected a Flair LanguageModel checkpoint (a dict), got {type(checkpoint).__name__}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(
            f"Not a Flair LanguageModel checkpoint: missing keys {missing} "
            f"(found {sorted(checkpoint)})"
        )
    for key, value in _SETTING_DEFAULTS.items():
        checkpoint.setdefault(key, value)
    return checkpoint
