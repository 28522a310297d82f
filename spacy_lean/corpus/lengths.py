"""Length functions: how long a doc or example is, in spaCy tokens or in the
wordpieces of a transformer tokenizer."""

from pathlib import Path
from typing import Callable, List, Optional, Union

from spacy.tokens import Doc
from spacy.training import Example


def _as_doc(item: Union[Doc, Example]) -> Doc:
    if isinstance(item, Example):
        return item.predicted
    if isinstance(item, Doc):
        return item
    raise TypeError(f"Expected a Doc or an Example, got {type(item).__name__}.")


class WordpieceCounter:
    """Count the wordpieces a Hugging Face fast tokenizer makes of spaCy tokens.

    path (str / Path): folder (or hub name, when online) of the tokenizer, the same
        value as the transformer's `name` setting in the config.
    add_special_tokens (bool): whether a sequence's length includes the special
        tokens the tokenizer adds around it ([CLS] and [SEP] for BERT).
    """

    def __init__(self, path: Union[str, Path], *, add_special_tokens: bool = True) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:  # pragma: no cover - transformers is a dependency
            raise ImportError(
                "Counting wordpieces needs 'transformers': pip install transformers"
            ) from err
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), use_fast=True)
            if getattr(tokenizer, "add_prefix_space", None) is False:
                # Byte-level BPE (RoBERTa, GPT-2) takes pre-split words only with a prefix
                # space: each word is then counted as the model sees it after a space.
                tokenizer = AutoTokenizer.from_pretrained(
                    str(path), use_fast=True, add_prefix_space=True
                )
        except (OSError, ValueError) as err:
            raise ValueError(
                f"Could not load a tokenizer from '{path}' ({err}). Give the folder "
                "(or name) of a Hugging Face tokenizer, as in the transformer's `name`."
            ) from err
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"The tokenizer at '{path}' is not a fast tokenizer; counting wordpieces "
                "per spaCy token needs one (it maps wordpieces back to words)."
            )
        self.path = str(path)
        self.tokenizer = tokenizer
        self.n_special = tokenizer.num_special_tokens_to_add() if add_special_tokens else 0

    def token_lengths(self, doc: Doc) -> List[int]:
        """Wordpieces per spaCy token (whitespace tokens get 0)."""
        words = [t.text for t in doc]
        counts = [0] * len(words)
        if not words:
            return counts
        # verbose=False: a doc longer than the model's maximum is measured to be split,
        # not run through the model (transformers would warn of "indexing errors").
        enc = self.tokenizer(
            words, is_split_into_words=True, add_special_tokens=False, verbose=False
        )
        for word_id in enc.word_ids():
            if word_id is not None:
                counts[word_id] += 1
        return counts

    def __call__(self, item: Union[Doc, Example]) -> int:
        """Length of a doc or example in wordpieces, special tokens included."""
        return sum(self.token_lengths(_as_doc(item))) + self.n_special


def token_length(item: Union[Doc, Example]) -> int:
    """Length of a doc or example in spaCy tokens (for an Example, of its predicted
    doc: the one the model runs on, as spaCy's batchers count it)."""
    return len(_as_doc(item))


def get_length_function(wordpiece_tokenizer: Optional[Union[str, Path]]) -> Callable:
    """`token_length`, or a `WordpieceCounter` when a tokenizer path is given."""
    if wordpiece_tokenizer:
        return WordpieceCounter(wordpiece_tokenizer)
    return token_length
