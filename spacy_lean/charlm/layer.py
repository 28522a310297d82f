"""thinc architecture `spacy-lean.CharLMEmbed.v1`: character-LM token vectors.

`List[Doc] -> List[Floats2d]`, so it can stand wherever spaCy expects an embedding
layer, e.g. as a whole tok2vec followed by a projection:

    [components.ner.model.tok2vec]
    @layers = "chain.v1"

    [components.ner.model.tok2vec.*.charlm]
    @architectures = "spacy-lean.CharLMEmbed.v1"
    forward_lm = "lm/forward.pt"
    backward_lm = "lm/backward.pt"

    [components.ner.model.tok2vec.*.proj]
    @layers = "with_array.v1"

    [components.ner.model.tok2vec.*.proj.layer]
    @layers = "Linear.v1"
    nO = 96

The LMs sit in a `PyTorchWrapper`; they are read from the checkpoint paths when the
model is initialized (`nlp.initialize()`), and from then on travel inside the
pipeline: `to_disk`/`to_bytes` write both LMs (Flair format, without the decoder),
and `from_disk`/`from_bytes` rebuild them without looking at the paths.

Frozen (the default), the LMs run in eval mode without autograd, also during
training; each LM batch's hidden states are freed as soon as the token rows are
gathered. With `fine_tune = true` the LMs train with the rest of the model (thinc's
optimizer updates them through the wrapper), with LM dropout, as Flair does.

Texts longer than `max_chunk_chars` are read in chunks with the LSTM state carried
over (the same vectors): frozen, the peak is then one chunk's hidden states per LM
batch, however long a doc. Fine-tuned, autograd keeps what every chunk needs for
the backward pass, so chunking does not lower that peak (the gradients are the
same; LM dropout draws its masks chunk by chunk).
"""

from typing import Callable, List, Optional, Tuple

import numpy
import srsly
import torch
from spacy.tokens import Doc
from spacy.util import registry
from thinc.api import ArgsKwargs, Model, PyTorchWrapper_v3, torch2xp, xp2torch
from thinc.types import Floats2d

from .embed import DEFAULT_MAX_CHUNK_CHARS, CharLMEmbedder, check_max_chunk_chars
from .model import CharLM

InT = List[Doc]
OutT = List[Floats2d]


class CharLMPair(torch.nn.Module):
    """The forward and backward LMs with the settings that turn them into token
    vectors. Empty (no LMs) until the layer is initialized or deserialized.
    """

    def __init__(
        self,
        forward_lm: Optional[CharLM] = None,
        backward_lm: Optional[CharLM] = None,
        *,
        fine_tune: bool = False,
        embedder_settings: Optional[dict] = None,
    ) -> None:
        super().__init__()
        self.forward_lm = forward_lm
        self.backward_lm = backward_lm
        self.fine_tune = fine_tune
        self.embedder_settings = dict(embedder_settings or {})
        self.embedder: Optional[CharLMEmbedder] = None
        if self.is_loaded:
            self.embedder = CharLMEmbedder(forward_lm, backward_lm, **self.embedder_settings)
            for param in self.parameters():
                param.requires_grad_(fine_tune)

    @property
    def is_loaded(self) -> bool:
        return self.forward_lm is not None or self.backward_lm is not None

    @property
    def width(self) -> int:
        return self.embedder.width if self.embedder is not None else 0

    def forward(self, docs: InT) -> Tuple[torch.Tensor, List[int]]:
        if self.embedder is None:
            raise ValueError(
                "The CharLMEmbed layer has no language models yet: initialize it "
                "(nlp.initialize()) with `forward_lm`/`backward_lm` paths set, or load a "
                "trained pipeline."
            )
        grad = self.fine_tune and torch.is_grad_enabled()
        vectors, n_tokens = self.embedder(docs, grad=grad)
        return vectors, n_tokens.tolist()

    def to_bytes(self) -> bytes:
        """Both LMs as Flair checkpoints, without decoders."""
        return srsly.msgpack_dumps(
            {
                "forward": self.forward_lm.to_bytes() if self.forward_lm is not None else None,
                "backward": self.backward_lm.to_bytes() if self.backward_lm is not None else None,
            }
        )

    def with_lms_from_bytes(self, data: bytes, device: Optional[torch.device]) -> "CharLMPair":
        msg = srsly.msgpack_loads(data)
        if not isinstance(msg, dict) or not all(
            isinstance(msg.get(key), (bytes, type(None))) for key in ("forward", "backward")
        ):
            raise ValueError(
                "The CharLMEmbed weights in this pipeline are not what to_bytes writes "
                "(a map of 'forward'/'backward' to checkpoint bytes)."
            )
        lms = [
            (
                CharLM.from_bytes(
                    msg[key],
                    map_location=device or "cpu",
                    has_decoder=False,
                    name=f"the {key} character LM in the pipeline's CharLMEmbed weights",
                )
                if msg.get(key) is not None
                else None
            )
            for key in ("forward", "backward")
        ]
        pair = CharLMPair(*lms, fine_tune=self.fine_tune, embedder_settings=self.embedder_settings)
        return pair.to(device) if device is not None else pair


def _serialize_pair(pair: CharLMPair) -> bytes:
    return pair.to_bytes()


def _deserialize_pair(pair: CharLMPair, data: bytes, device) -> CharLMPair:
    return pair.with_lms_from_bytes(data, device)


def _convert_inputs(model: Model, docs: InT, is_train: bool) -> Tuple[ArgsKwargs, Callable]:
    return ArgsKwargs(args=(docs,), kwargs={}), lambda d_inputs: []


def _convert_outputs(model: Model, inputs_outputs, is_train: bool):
    _, (vectors, n_tokens) = inputs_outputs
    flat = torch2xp(vectors.detach() if vectors.requires_grad else vectors)
    # Host-side lengths: splitting needs plain ints (no device sync per doc on GPU).
    Y = model.ops.unflatten(flat, numpy.asarray(n_tokens, dtype="int32")) if n_tokens else []

    def convert_for_torch_backward(dY: OutT) -> ArgsKwargs:
        dY_flat = xp2torch(model.ops.flatten(dY), device=vectors.device)
        return ArgsKwargs(args=(vectors,), kwargs={"grad_tensors": (dY_flat,)})

    return Y, convert_for_torch_backward


@registry.architectures("spacy-lean.CharLMEmbed.v1")
def build_charlm_embed_v1(
    forward_lm: Optional[str] = None,
    backward_lm: Optional[str] = None,
    fine_tune: bool = False,
    with_whitespace: bool = True,
    tokenized_lm: bool = True,
    is_lower: bool = False,
    batch_size: int = 32,
    threads: Optional[int] = None,
    concurrent: bool = False,
    max_chunk_chars: Optional[int] = DEFAULT_MAX_CHUNK_CHARS,
) -> Model[InT, OutT]:
    """Contextual string embeddings (Flair-style) from a forward and/or backward
    character LM. A token's vector is the forward LM's output after the token
    concatenated with the backward LM's output before it.

    forward_lm (Optional[str]): path of the forward LM checkpoint (Flair format).
    backward_lm (Optional[str]): path of the backward LM checkpoint (Flair format).
    fine_tune (bool): train the LMs too (default: frozen).
    with_whitespace (bool): state at the whitespace after a token (Flair's default)
        instead of at its last character.
    tokenized_lm (bool): feed the LMs `" ".join(words)` (Flair's default) instead of
        the text with its original whitespace.
    is_lower (bool): lowercase the LM input (LMs trained on lowercased text).
    batch_size (int): texts per LM batch.
    threads (Optional[int]): torch threads during a call (None: torch's setting).
    concurrent (bool): run the two LMs side by side in two threads.
    max_chunk_chars (Optional[int]): characters an LM reads in one LSTM call; longer
        texts are read in chunks, the state carried (same vectors, a peak memory that
        does not grow with a doc's length). None: each LM batch in one call.
    RETURNS (Model[List[Doc], List[Floats2d]]): the layer; `nO` is known after
        initialization (the sum of the LMs' output sizes).
    """
    settings = dict(
        with_whitespace=with_whitespace,
        tokenized_lm=tokenized_lm,
        is_lower=is_lower,
        batch_size=batch_size,
        threads=threads,
        concurrent=concurrent,
        max_chunk_chars=max_chunk_chars,
    )
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size}")
    if threads is not None and (type(threads) is not int or threads < 1):
        # Checked when the model is built, as batch_size is (it was at the first call).
        raise ValueError(f"threads must be a whole number >= 1 or null, got {threads}")
    check_max_chunk_chars(max_chunk_chars)
    for key, path in (("forward_lm", forward_lm), ("backward_lm", backward_lm)):
        if isinstance(path, str) and not path.strip():
            raise ValueError(
                f"{key} is an empty string: give the path of a Flair LanguageModel "
                "checkpoint (.pt), or null for no LM in that direction."
            )
    wrapper = PyTorchWrapper_v3(
        CharLMPair(fine_tune=fine_tune, embedder_settings=settings),
        convert_inputs=_convert_inputs,
        convert_outputs=_convert_outputs,
        serialize_model=_serialize_pair,
        deserialize_model=_deserialize_pair,
    )
    return Model(
        "charlm_embed",
        forward,
        init=init,
        layers=[wrapper],
        dims={"nO": None},
        attrs={"forward_lm": forward_lm, "backward_lm": backward_lm, "fine_tune": fine_tune},
    )


def get_pair(model: Model) -> CharLMPair:
    """The `CharLMPair` inside a CharLMEmbed layer."""
    return model.layers[0].shims[0]._model


def load_lms(model: Model) -> None:
    """Read the LM checkpoints named in the layer's settings into the layer."""
    wrapper = model.layers[0]
    shim = wrapper.shims[0]
    device = shim.device
    if model.attrs["forward_lm"] is None and model.attrs["backward_lm"] is None:
        raise ValueError(
            "spacy-lean.CharLMEmbed.v1 has no language models to load: set forward_lm, "
            "backward_lm or both to the paths of Flair LanguageModel checkpoints."
        )
    lms = []
    for key in ("forward_lm", "backward_lm"):
        path = model.attrs[key]
        lms.append(
            CharLM.load(path, map_location=device, has_decoder=False) if path is not None else None
        )
    old = shim._model
    shim._model = CharLMPair(
        *lms, fine_tune=old.fine_tune, embedder_settings=old.embedder_settings
    ).to(device)


def init(model: Model, X: Optional[InT] = None, Y=None) -> Model:
    if not get_pair(model).is_loaded:
        load_lms(model)
    model.set_dim("nO", get_pair(model).width, force=True)
    return model


def forward(model: Model, docs: InT, is_train: bool) -> Tuple[OutT, Callable]:
    wrapper = model.layers[0]
    if not docs:
        return [], lambda dY: []
    # Docs without tokens send nothing through the LMs: nothing to backpropagate.
    if is_train and model.attrs["fine_tune"] and any(len(doc) for doc in docs):
        Y, backprop_lms = wrapper(docs, is_train=True)

        def backprop(dY: OutT) -> InT:
            backprop_lms(dY)
            return []

        return Y, backprop
    # Frozen: eval mode, no autograd, hidden states freed batch by batch.
    Y = wrapper.predict(docs)
    return Y, lambda dY: []
