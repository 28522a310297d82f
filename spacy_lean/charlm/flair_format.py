"""Reading and writing Flair `LanguageModel` checkpoints without importing flair.

A Flair character-LM checkpoint is a `torch.save` of a plain dict: `state_dict`, the
settings of the model (`is_forward_lm`, `hidden_size`, `nlayers`, `embedding_size`,
`nout`, `document_delimiter`, `dropout`, `recurrent_type`, `has_decoder`; files
written by older Flair versions lack the last three) and `dictionary`, a pickled
`flair.data.Dictionary` whose `idx2item` holds UTF-8 encoded characters.

Loading goes through `safe_torch.load`: `torch.load` reads the container, but every
pickle in the file (legacy-format headers included) goes through a restricted
unpickler that accepts only the globals such a file contains (tensor rebuild
functions, `OrderedDict`, `_codecs.encode`, ..., each checking its arguments) and maps
`flair.data.Dictionary` to the stand-in class below, so reading a checkpoint cannot
run code. (torch's own `weights_only` unpickler cannot be used: it rejects the
protocol-4 FRAME opcode of Flair's files.) Writing pickles the
stand-in as `flair.data.Dictionary` with Flair's attributes, so
`flair.models.LanguageModel.load_language_model` reads our files.
"""

import io
import pickle
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from . import safe_torch

FLAIR_DICTIONARY_GLOBAL = ("flair.data", "Dictionary")

# Defaults for keys that older Flair checkpoints do not carry.
_SETTING_DEFAULTS = {
    "document_delimiter": "\n",
    "dropout": 0.1,
    "recurrent_type": "lstm",
    "has_decoder": True,
    "nout": None,
}
_REQUIRED_KEYS = (
    "state_dict",
    "dictionary",
    "is_forward_lm",
    "hidden_size",
    "nlayers",
    "embedding_size",
)


class FlairDictionaryState:
    """Stand-in for `flair.data.Dictionary` while unpickling and pickling.

    It only carries the attributes of the pickled object (`idx2item`, `item2idx`,
    `add_unk`, ...), exactly as Flair stores them (items as UTF-8 bytes).
    """

    def __init__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __setstate__(self, state: Any) -> None:
        # Called by the restricted unpickler: keep plain attributes only.
        if type(state) is tuple and len(state) == 2 and state[1] is None:
            state = state[0]
        if type(state) is not dict or not all(type(key) is str for key in state):
            raise safe_torch.RefusedPickle(
                f"the pickled flair.data.Dictionary is given a state of "
                f"{type(state).__name__}, not a dict of attributes"
            )
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


# What a Flair LanguageModel checkpoint may name: tensors and plain containers, and
# Flair's character dictionary (read into the stand-in above, never importing flair).
_FLAIR_GLOBALS = safe_torch.allowed_globals({FLAIR_DICTIONARY_GLOBAL: FlairDictionaryState})
CHECKPOINT_KIND = "a Flair LanguageModel checkpoint"


def dictionary_state(idx2item: List[str], add_unk: bool = True) -> FlairDictionaryState:
    """Build the pickled form of a Flair character dictionary from `idx2item`."""
    items = [item.encode("utf-8", errors="surrogateescape") for item in idx2item]
    return FlairDictionaryState(
        {
            "item2idx": {item: i for i, item in enumerate(items)},
            "idx2item": items,
            "add_unk": add_unk,
            "multi_label": False,
            "span_labels": False,
        }
    )


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
    if not isinstance(raw, (list, tuple)) or not all(isinstance(i, (bytes, str)) for i in raw):
        raise ValueError(
            "The checkpoint's dictionary 'idx2item' must be a list of characters (bytes or "
            f"str), got {type(raw).__name__}; is this a Flair LanguageModel file?"
        )
    return [
        item.decode("utf-8", errors="surrogateescape") if isinstance(item, bytes) else item
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
    path_or_bytes: Union[str, Path, bytes],
    map_location: Any = "cpu",
    name: Optional[str] = None,
) -> Dict[str, Any]:
    """Read a Flair LanguageModel checkpoint (from a path or bytes) without flair,
    and without running code from it.

    path_or_bytes (Union[str, Path, bytes]): the checkpoint file or its content.
    map_location: where to put the tensors (a device or its name).
    name (Optional[str]): how to call the checkpoint in errors (default: its path).
    RETURNS (Dict[str, Any]): the checkpoint dict, with defaults filled in for keys
        older Flair versions did not write, and `dictionary` as a `FlairDictionaryState`.
    """
    if not isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        name = name or str(path_or_bytes)
        if not Path(path_or_bytes).exists():
            raise FileNotFoundError(f"Character LM checkpoint not found: {path_or_bytes}")
    checkpoint = safe_torch.load(
        path_or_bytes,
        _FLAIR_GLOBALS,
        what=CHECKPOINT_KIND,
        name=name,
        map_location=map_location,
    )
    shown = name or "the checkpoint"
    if not isinstance(checkpoint, dict):
        raise safe_torch.CheckpointError(
            f"{shown} is not {CHECKPOINT_KIND}: expected a dict, got "
            f"{type(checkpoint).__name__}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in checkpoint]
    if missing:
        raise safe_torch.CheckpointError(
            f"{shown} is not {CHECKPOINT_KIND}: missing keys {missing} "
            f"(found {sorted(map(str, checkpoint))})"
        )
    for key, value in _SETTING_DEFAULTS.items():
        checkpoint.setdefault(key, value)
    return checkpoint
