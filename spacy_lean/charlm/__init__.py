"""Flair-style contextual string embeddings (character-LM embeddings) for spaCy.

`model` holds the character LM and its Flair-compatible dictionary, `flair_format`
reads and writes Flair checkpoints without flair, `embed` computes token vectors,
`layer` is the thinc architecture `spacy-lean.CharLMEmbed.v1` and `component` the
`char_lm` pipeline component. `safe_torch` reads torch files without running code
from them (`CheckpointError` when it refuses one).
"""

from .model import CharDictionary, CharLM  # noqa: F401
from .safe_torch import CheckpointError  # noqa: F401

__all__ = ["CharDictionary", "CharLM", "CheckpointError"]
