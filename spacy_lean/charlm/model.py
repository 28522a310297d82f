"""A character-level LSTM language model with the layout of Flair's `LanguageModel`.

The module names (`encoder`, `rnn`, `proj`, `decoder`) and state-dict keys are the
ones Flair uses, so a Flair checkpoint loads into `CharLM` and a `CharLM` saved with
`CharLM.save` loads into Flair. Tensors are time-major (`[seq_len, batch]`), as in
Flair.
"""

import math
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple, Union

import numpy
import torch
from torch import nn

from . import flair_format
from .safe_torch import CheckpointError

UNK = "<unk>"
_RNN_TYPES = {"lstm": (nn.LSTM, 2), "gru": (nn.GRU, 1)}


class CharDictionary:
    """A Flair-compatible character dictionary: item `i` is `idx2item[i]`.

    Unknown characters map to id 0, as in Flair's `Dictionary.get_idx_for_items`
    (which Flair's embeddings use), whatever item sits at 0.
    """

    def __init__(self, idx2item: Iterable[str] = (), add_unk: bool = True) -> None:
        self.idx2item: List[str] = []
        self.item2idx: Dict[str, int] = {}
        self.add_unk = add_unk
        self._table: Optional[numpy.ndarray] = None
        for item in idx2item:
            self.add_item(item)

    def add_item(self, item: str) -> int:
        """Add `item` if it is new. RETURNS (int): its id."""
        if item not in self.item2idx:
            self.item2idx[item] = len(self.idx2item)
            self.idx2item.append(item)
            self._table = None
        return self.item2idx[item]

    def get_idx(self, ch: str) -> int:
        """The id of `ch`; 0 for an unknown character."""
        return self.item2idx.get(ch, 0)

    def encode(self, text: str) -> List[int]:
        """Character ids of `text` (one per code point)."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> numpy.ndarray:
        """Character ids of `text` as an int64 array, looked up without a Python
        loop over the characters."""
        codes = numpy.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
        table = self.lookup_table
        ids = numpy.zeros(len(codes), dtype=numpy.int64)
        inside = codes < len(table)
        ids[inside] = table[codes[inside]]
        return ids

    @property
    def lookup_table(self) -> numpy.ndarray:
        """Dense code point -> id table over the dictionary's single characters."""
        if self._table is None:
            singles = [(ord(item), i) for i, item in enumerate(self.idx2item) if len(item) == 1]
            size = max((cp for cp, _ in singles), default=0) + 1
            table = numpy.zeros(size, dtype=numpy.int64)
            # Later duplicates cannot exist (item2idx is unique), so plain assignment.
            for cp, i in singles:
                table[cp] = i
            self._table = table
        return self._table

    def __len__(self) -> int:
        return len(self.idx2item)

    def __contains__(self, item: str) -> bool:
        return item in self.item2idx

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharDictionary) and self.idx2item == other.idx2item

    def __repr__(self) -> str:
        return f"CharDictionary({len(self)} items)"

    @classmethod
    def from_texts(cls, texts: Iterable[str], min_count: int = 1) -> "CharDictionary":
        """Build a dictionary from texts: `<unk>` at id 0, then the characters seen at
        least `min_count` times, most frequent first (ties: first seen first).

        texts (Iterable[str]): the training texts.
        min_count (int): minimum number of occurrences of a character.
        RETURNS (CharDictionary): the dictionary.
        """
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        counts: Counter = Counter()
        for text in texts:
            counts.update(text)
        dictionary = cls([UNK])
        # Counter.most_common keeps insertion order among equal counts.
        for ch, count in counts.most_common():
            if count >= min_count:
                dictionary.add_item(ch)
        return dictionary

    def to_flair_state(self) -> "flair_format.FlairDictionaryState":
        return flair_format.dictionary_state(self.idx2item, add_unk=self.add_unk)

    @classmethod
    def from_flair_state(cls, state) -> "CharDictionary":
        add_unk = getattr(state, "add_unk", True) if not isinstance(state, dict) else True
        return cls(flair_format.decode_items(state), add_unk=bool(add_unk))


class CharLM(nn.Module):
    """A character-level RNN language model, layout-compatible with Flair's
    `flair.models.LanguageModel`.

    dictionary (CharDictionary): the character vocabulary.
    is_forward_lm (bool): reads left to right (True) or right to left (False).
    hidden_size (int): width of the recurrent layers.
    nlayers (int): number of recurrent layers.
    embedding_size (int): width of the character embeddings.
    nout (Optional[int]): if set, a linear projection of the top layer to `nout`.
    document_delimiter (str): the marker put before every text.
    dropout (float): dropout on the embeddings and outputs (and between layers).
    recurrent_type (str): "lstm" or "gru".
    has_decoder (bool): whether to keep the output layer over the characters.
    """

    def __init__(
        self,
        dictionary: CharDictionary,
        is_forward_lm: bool,
        hidden_size: int,
        nlayers: int = 1,
        embedding_size: int = 100,
        nout: Optional[int] = None,
        document_delimiter: str = "\n",
        dropout: float = 0.1,
        recurrent_type: str = "lstm",
        has_decoder: bool = True,
    ) -> None:
        super().__init__()
        rnn_type = recurrent_type.lower()
        if rnn_type not in _RNN_TYPES:
            raise ValueError(
                f"recurrent_type must be one of {sorted(_RNN_TYPES)}, got {recurrent_type!r}"
            )
        if hidden_size < 1 or nlayers < 1 or embedding_size < 1:
            raise ValueError(
                "hidden_size, nlayers and embedding_size must be >= 1, got "
                f"{hidden_size}, {nlayers}, {embedding_size}"
            )
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            # NaN passes torch's own range check and fails at the first forward pass.
            raise ValueError(f"dropout must be a number >= 0 and < 1, got {dropout}")
        if nout is not None and (type(nout) is not int or nout < 1):
            # A saved model with nout 0 is refused when loaded: refused here, before training.
            raise ValueError(f"nout must be >= 1 (or None: no projection), got {nout}")
        if len(dictionary) == 0:
            raise ValueError("The character dictionary is empty.")
        self.dictionary = dictionary
        self.is_forward_lm = bool(is_forward_lm)
        self.hidden_size = hidden_size
        self.nlayers = nlayers
        self.embedding_size = embedding_size
        self.nout = nout
        self.document_delimiter = document_delimiter
        self.dropout = dropout
        self.recurrent_type = recurrent_type
        rnn_cls, self.state_count = _RNN_TYPES[rnn_type]

        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(len(dictionary), embedding_size)
        self.rnn = rnn_cls(
            embedding_size, hidden_size, nlayers, dropout=dropout if nlayers > 1 else 0.0
        )
        out_size = hidden_size
        if nout is not None:
            self.proj: Optional[nn.Linear] = nn.Linear(hidden_size, nout)
            bound = math.sqrt(3.0 / (hidden_size + nout))
            with torch.no_grad():
                self.proj.weight.uniform_(-bound, bound)
            out_size = nout
        else:
            self.proj = None
        if has_decoder:
            self.decoder: Optional[nn.Linear] = nn.Linear(out_size, len(dictionary))
        else:
            self.decoder = None
        with torch.no_grad():
            self.encoder.weight.uniform_(-0.1, 0.1)
            if self.decoder is not None:
                self.decoder.bias.zero_()
                self.decoder.weight.uniform_(-0.1, 0.1)

    @property
    def output_size(self) -> int:
        """Width of the vectors `forward` returns as `rnn_output`."""
        return self.nout if self.nout is not None else self.hidden_size

    @property
    def has_decoder(self) -> bool:
        return self.decoder is not None

    def init_hidden(self, bsz: int) -> Tuple[torch.Tensor, ...]:
        """Zero initial state: `(h, c)` for an LSTM, `(h,)` for a GRU, each
        `[nlayers, bsz, hidden_size]`."""
        weight = next(self.parameters())
        return tuple(
            weight.new_zeros(self.nlayers, bsz, self.hidden_size) for _ in range(self.state_count)
        )

    def forward(
        self,
        input: torch.Tensor,
        hidden: Optional[Tuple[torch.Tensor, ...]] = None,
        decode: bool = True,
    ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Tuple[torch.Tensor, ...]]:
        """Run the LM over time-major character ids.

        input (torch.LongTensor): `[seq_len, batch]` character ids.
        hidden (Tuple[Tensor, ...]): the state to start from (`init_hidden` if None).
        decode (bool): compute the logits (False skips the decoder, for embeddings).
        RETURNS (Tuple): logits `[seq, batch, V]` (None without a decoder or with
            `decode=False`), the top-layer output `[seq, batch, output_size]` (after
            `proj`), and the final state.
        """
        if hidden is None:
            hidden = self.init_hidden(input.shape[1])
        emb = self.drop(self.encoder(input))
        if self.state_count == 1:
            output, h = self.rnn(emb, hidden[0])
            hidden = (h,)
        else:
            output, hidden = self.rnn(emb, tuple(hidden))
        if self.proj is not None:
            output = self.proj(output)
        output = self.drop(output)
        decoded = self.decoder(output) if decode and self.decoder is not None else None
        return decoded, output, hidden

    def settings(self) -> Dict[str, object]:
        """The constructor settings, as stored in a Flair checkpoint."""
        return {
            "is_forward_lm": self.is_forward_lm,
            "hidden_size": self.hidden_size,
            "nlayers": self.nlayers,
            "embedding_size": self.embedding_size,
            "nout": self.nout,
            "document_delimiter": self.document_delimiter,
            "dropout": self.dropout,
            "recurrent_type": self.recurrent_type,
            "has_decoder": self.decoder is not None,
        }

    def to_checkpoint(self) -> Dict[str, object]:
        """The Flair checkpoint dict (state dict on CPU, dictionary, settings)."""
        state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        return {
            "state_dict": state,
            "dictionary": self.dictionary.to_flair_state(),
            **self.settings(),
        }

    def save(self, path: Union[str, Path]) -> None:
        """Write a Flair-format checkpoint (`flair.models.LanguageModel` reads it)."""
        flair_format.save_checkpoint(self.to_checkpoint(), path)

    def to_bytes(self) -> bytes:
        """The Flair-format checkpoint as bytes."""
        return flair_format.checkpoint_to_bytes(self.to_checkpoint())

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Dict[str, object], has_decoder: bool = True, name: str = "the checkpoint"
    ) -> "CharLM":
        has_decoder = bool(checkpoint.get("has_decoder", True)) and has_decoder
        try:
            dictionary = CharDictionary.from_flair_state(checkpoint["dictionary"])
        except ValueError as err:
            raise CheckpointError(f"{name}: {err}") from None
        _check_settings(checkpoint, len(dictionary), name)
        settings = dict(
            dictionary=dictionary,
            is_forward_lm=bool(checkpoint["is_forward_lm"]),
            hidden_size=int(checkpoint["hidden_size"]),
            nlayers=int(checkpoint["nlayers"]),
            embedding_size=int(checkpoint["embedding_size"]),
            nout=checkpoint.get("nout"),
            document_delimiter=checkpoint.get("document_delimiter", "\n"),
            dropout=float(checkpoint.get("dropout", 0.1)),
            recurrent_type=str(checkpoint.get("recurrent_type", "lstm")),
            has_decoder=has_decoder,
        )
        state_dict = checkpoint["state_dict"]
        if not has_decoder:
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith("decoder.")}
        # Every tensor the model would make must be in the file with its shape (so the
        # model is no larger than the file): compared on the meta device, before
        # anything is allocated.
        try:
            with torch.device("meta"):
                shapes = {k: tuple(v.shape) for k, v in cls(**settings).state_dict().items()}
        except ValueError as err:  # e.g. an unknown recurrent_type
            raise CheckpointError(f"{name}: {err}") from None
        for key, shape in shapes.items():
            got = tuple(state_dict[key].shape) if key in state_dict else "missing"
            if got != shape:
                raise CheckpointError(
                    f"{name}: the settings (hidden_size={settings['hidden_size']}, nlayers="
                    f"{settings['nlayers']}, embedding_size={settings['embedding_size']}, nout="
                    f"{settings['nout']}, {len(dictionary)} characters) do not match the tensor "
                    f"'{key}' ({got}), the model's is {shape}."
                )
        extra = sorted(set(state_dict) - set(shapes))
        if extra:
            raise CheckpointError(
                f"{name}: the state_dict has tensors the model does not: {extra[:5]}."
            )
        model = cls(**settings)
        model.load_state_dict(state_dict, strict=True)
        model.eval()
        return model

    @classmethod
    def load(cls, path: Union[str, Path], map_location="cpu", has_decoder: bool = True) -> "CharLM":
        """Read a Flair `LanguageModel` checkpoint (or one we wrote), without flair.

        path (Union[str, Path]): the checkpoint file.
        map_location: where to put the tensors (as for `torch.load`).
        has_decoder (bool): False drops the output layer (not needed for embeddings).
        RETURNS (CharLM): the model, in eval mode.
        """
        checkpoint = flair_format.load_checkpoint(path, map_location)
        return cls.from_checkpoint(checkpoint, has_decoder, name=str(path))

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        map_location="cpu",
        has_decoder: bool = True,
        name: str = "the character LM bytes",
    ) -> "CharLM":
        """Read a checkpoint from bytes (`to_bytes`); `name` is how errors call it."""
        checkpoint = flair_format.load_checkpoint(data, map_location, name=name)
        return cls.from_checkpoint(checkpoint, has_decoder, name=name)


def _check_settings(checkpoint: Dict[str, object], n_chars: int, name: str) -> None:
    """The settings must be numbers that agree with the tensors in the file, so that a
    hostile file cannot make us allocate a model far larger than itself."""
    state = checkpoint["state_dict"]
    if not isinstance(state, dict) or not all(
        type(k) is str and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"{name}: 'state_dict' must map parameter names to tensors.")
    sizes = {key: checkpoint.get(key) for key in ("hidden_size", "nlayers", "embedding_size")}
    nout = checkpoint.get("nout")
    if not all(type(v) is int and v >= 1 for v in sizes.values()) or not (
        nout is None or (type(nout) is int and nout >= 1)
    ):
        raise CheckpointError(
            f"{name}: the settings {sizes} (nout={nout!r}) must be positive ints."
        )
    hidden, nlayers, emb = sizes["hidden_size"], sizes["nlayers"], sizes["embedding_size"]
    expected = {
        "encoder.weight": (n_chars, emb),
        "proj.weight": (nout, hidden) if nout is not None else None,
    }
    for layer in range(min(nlayers, len(state) + 1)):
        expected[f"rnn.weight_hh_l{layer}"] = (None, hidden)
    for key, shape in expected.items():
        tensor = state.get(key)
        if shape is None or (
            tensor is not None
            and tensor.dim() == 2
            and all(want is None or want == got for want, got in zip(shape, tensor.shape))
        ):
            continue
        got = tuple(tensor.shape) if tensor is not None else "missing"
        raise CheckpointError(
            f"{name}: the settings (hidden_size={hidden}, nlayers={nlayers}, "
            f"embedding_size={emb}, nout={nout}, {n_chars} characters) do not match the "
            f"tensor '{key}' ({got})."
        )
