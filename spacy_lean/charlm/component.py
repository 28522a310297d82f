"""Pipeline component `char_lm`: Flair-style character-LM vectors on your docs.

    nlp.add_pipe("char_lm", config={"model": {
        "forward_lm": "lm/forward.pt", "backward_lm": "lm/backward.pt"}})
    doc = nlp("Ada met Tomas in Port Ambrel.")
    doc.tensor.shape  # (n_tokens, forward width + backward width)

Each doc gets a compact copy of just its own rows, so nothing it keeps refers to the
batch's LM hidden states (or to the other docs of the batch).
"""

import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Union

import srsly
from spacy.language import Language
from spacy.pipeline import Pipe
from spacy.tokens import Doc
from spacy.training import Example
from spacy.util import SimpleFrozenList, minibatch
from thinc.api import Config, Model
from thinc.types import Floats2d

from .embed import DEFAULT_MAX_CHUNK_CHARS
from .layer import get_pair
from .safe_torch import CheckpointError

DEFAULT_CHAR_LM_CONFIG = f"""
[char_lm]
store = "tensor"

[char_lm.model]
@architectures = "spacy-lean.CharLMEmbed.v1"
forward_lm = null
backward_lm = null
fine_tune = false
with_whitespace = true
tokenized_lm = true
is_lower = false
batch_size = 32
threads = null
concurrent = false
max_chunk_chars = {DEFAULT_MAX_CHUNK_CHARS}
"""
DEFAULT_CHAR_LM_MODEL = Config().from_str(DEFAULT_CHAR_LM_CONFIG)["char_lm"]


@Language.factory(
    "char_lm",
    default_config=DEFAULT_CHAR_LM_MODEL,
    assigns=["doc.tensor"],
)
def make_char_lm(nlp: Language, name: str, model: Model, store: str) -> "CharLMComponent":
    """Create a `char_lm` component.

    model (Model[List[Doc], List[Floats2d]]): the embedding model, by default
        `spacy-lean.CharLMEmbed.v1` (set `forward_lm`/`backward_lm` to checkpoint paths).
    store (str): "tensor" for `doc.tensor`, or the name of a Doc extension
        (`doc._.<store>`, registered if needed).
    """
    if model.attrs.get("fine_tune"):
        warnings.warn(
            f"char_lm '{name}': fine_tune = true has no effect here: the char_lm component "
            "is not trained (nlp.update skips it), so its LMs stay as loaded. To fine-tune "
            "the LMs, use the spacy-lean.CharLMEmbed.v1 layer inside a trained component's "
            "model (e.g. the ner's tok2vec), see docs/charlm.md; or set fine_tune = false.",
            UserWarning,
            stacklevel=2,
        )
    return CharLMComponent(nlp.vocab, model, name=name, store=store)


class CharLMComponent(Pipe):
    """Sets character-LM token vectors on docs (`doc.tensor` or an extension)."""

    def __init__(
        self,
        vocab,
        model: Model,
        name: str = "char_lm",
        *,
        store: str = "tensor",
    ):
        self.vocab = vocab
        self.model = model
        self.name = name
        self.cfg = {}
        self._set_store(store)
        # What the pipeline's config says (`store` may be set at runtime): saved with the
        # component, so that a load tells a config override from a store set at runtime.
        self.cfg["built_store"] = store

    def _set_store(self, store: str) -> None:
        """Validate `store`, register its extension if needed, and use it."""
        if not isinstance(store, str) or not store:
            raise ValueError(
                f"store must be 'tensor' or the name of a Doc extension, got {store!r}"
            )
        if store != "tensor" and not store.isidentifier():
            raise ValueError(f"store must be a valid extension name, got {store!r}")
        if store in ("set", "get", "has"):  # doc._.set is spaCy's method, not a value
            raise ValueError(
                f"store = {store!r} names a method of spaCy's doc._ namespace: choose another "
                "extension name."
            )
        if store != "tensor" and Doc.has_extension(store):
            default, method, getter, setter = Doc.get_extension(store)
            if method is not None or (getter is not None and setter is None):
                # doc._.set would write user_data, which the getter (or method) ignores:
                # the vectors were lost without a word.
                raise ValueError(
                    f"store = {store!r}: the Doc extension '{store}' is already registered with "
                    f"a {'method' if method is not None else 'getter'}, so vectors stored there "
                    "could not be read back. Choose another name, or register it with a "
                    "default (Doc.set_extension(name, default=None))."
                )
        self._store = store
        self.cfg["store"] = store
        if store != "tensor" and not Doc.has_extension(store):
            Doc.set_extension(store, default=None)

    @property
    def store(self) -> str:
        """Where the vectors go: "tensor" (`doc.tensor`) or the name of a Doc
        extension (`doc._.<store>`). Settable; saved with the component."""
        return self._store

    @store.setter
    def store(self, store: str) -> None:
        self._set_store(store)

    @property
    def lean_assigns(self) -> List[str]:
        """What the component sets on each doc, for `lean_cleaner`'s check: the
        factory's `assigns` can only name the default (`doc.tensor`)."""
        return ["doc.tensor" if self._store == "tensor" else f"doc._.{self._store}"]

    def _load_cfg(self, saved: dict) -> None:
        """Take the saved settings. Like spaCy's components, the saved `store` wins
        over the one the component was built with; where that came from a load-time
        override of the config, say so. (A store set at runtime is saved with the
        component while the config keeps the one it was built with: not an override.)"""
        store = saved.get("store", self._store)
        # Saved pipelines of earlier versions have no built_store: any difference warns.
        overridden = saved.get("built_store", store) != self.cfg["built_store"]
        if store != self._store and overridden:
            warnings.warn(
                f"char_lm '{self.name}': the saved pipeline stores its vectors in "
                f"{_where(store)}, which replaces store = {self._store!r} that it was built "
                "with (a component's saved settings are restored when it is loaded, so a "
                "load-time config override of store is not used, and nlp.config no longer "
                f"says where they go). To store them elsewhere, set "
                f"nlp.get_pipe({self.name!r}).store = {self._store!r} after loading.",
                UserWarning,
                stacklevel=3,
            )
        built = self.cfg["built_store"]
        self.cfg.update(saved)
        self.cfg["built_store"] = built  # this pipeline's config
        self._set_store(self.cfg["store"])

    def __call__(self, doc: Doc) -> Doc:
        self.set_annotations([doc], self.predict([doc]))
        return doc

    def pipe(self, stream: Iterable[Doc], *, batch_size: int = 128) -> Iterator[Doc]:
        # As spaCy's TrainablePipe.pipe: an error goes to the pipeline's error handler
        # (nlp.set_error_handler), which re-raises by default.
        error_handler = self.get_error_handler()
        for docs in minibatch(stream, size=batch_size):
            try:
                self.set_annotations(docs, self.predict(docs))
                yield from docs
            except Exception as err:
                error_handler(self.name, self, docs, err)

    def predict(self, docs: List[Doc]) -> List[Floats2d]:
        """The vectors of the docs' tokens (views of one compact batch array)."""
        self._ensure_initialized()
        return self.model.predict(docs)

    def set_annotations(self, docs: List[Doc], vectors: List[Floats2d]) -> None:
        """Store a compact copy of each doc's rows on the doc."""
        for doc, rows in zip(docs, vectors):
            own = rows.copy()
            if self._store == "tensor":
                doc.tensor = own
            else:
                doc._.set(self._store, own)

    def initialize(
        self,
        get_examples: Optional[Callable[[], Iterable[Example]]] = None,
        *,
        nlp: Optional[Language] = None,
    ) -> None:
        """Load the LMs from the checkpoint paths in the model's settings."""
        self.model.initialize()

    def _ensure_initialized(self) -> None:
        if not get_pair(self.model).is_loaded:
            # Convenience for `nlp.add_pipe(...)` followed by `nlp(text)`: read the
            # checkpoints on first use, as `initialize` would.
            self.model.initialize()

    @property
    def width(self) -> int:
        return get_pair(self.model).width

    def to_bytes(self, *, exclude=SimpleFrozenList()) -> bytes:
        return srsly.msgpack_dumps({"cfg": self.cfg, "model": self.model.to_bytes()})

    def from_bytes(self, bytes_data: bytes, *, exclude=SimpleFrozenList()) -> "CharLMComponent":
        msg = srsly.msgpack_loads(bytes_data)
        self._load_cfg(msg.get("cfg", {}))
        self.model.from_bytes(msg["model"])
        return self

    def to_disk(self, path: Union[str, Path], *, exclude=SimpleFrozenList()) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        srsly.write_json(path / "cfg", self.cfg)
        self.model.to_disk(path / "model")

    def from_disk(self, path: Union[str, Path], *, exclude=SimpleFrozenList()) -> "CharLMComponent":
        path = Path(path)
        if (path / "cfg").exists():
            self._load_cfg(srsly.read_json(path / "cfg"))
        try:
            self.model.from_disk(path / "model")
        except CheckpointError as err:
            raise CheckpointError(f"{path / 'model'}: {err}") from None
        return self


def _where(store: str) -> str:
    return "doc.tensor" if store == "tensor" else f"doc._.{store}"
