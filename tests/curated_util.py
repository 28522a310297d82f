"""A tiny spacy-curated-transformers pipeline (spaCy's own `*_trf` pipelines since 3.7
use this library): a 2-layer, 32-wide BERT with the local WordPiece vocabulary of the
tiny transformer, and components listening to its last layer. Not trained here:
spacy-curated-transformers 0.3's own backward pass calls float() on a 1-element array,
which numpy 2 refuses."""

import json

import spacy
from thinc.api import Config

CURATED_TRANSFORMER = """
[nlp]
lang = "en"
pipeline = ["transformer"{listeners}]
batch_size = 8

[components]

[components.transformer]
factory = "curated_transformer"

[components.transformer.model]
@architectures = "spacy-curated-transformers.BertTransformer.v1"
vocab_size = null
num_hidden_layers = 2
hidden_width = 32
num_attention_heads = 2
intermediate_width = 64
attention_probs_dropout_prob = 0.0
hidden_dropout_prob = 0.0
piece_encoder = {{"@architectures":"spacy-curated-transformers.BertWordpieceEncoder.v1"}}

[components.transformer.model.with_spans]
@architectures = "spacy-curated-transformers.WithStridedSpans.v1"
stride = 48
window = 64

[initialize]

[initialize.components]

[initialize.components.transformer]

[initialize.components.transformer.piecer_loader]
@model_loaders = "spacy-curated-transformers.HFPieceEncoderLoader.v1"
name = null
"""

LISTENER = """
[components.{name}.model.tok2vec]
@architectures = "spacy-curated-transformers.LastTransformerLayerListener.v1"
width = 32
pooling = {{"@layers":"reduce_mean.v1"}}
"""

COMPONENTS = {
    "tagger": """
[components.tagger]
factory = "tagger"

[components.tagger.model]
@architectures = "spacy.Tagger.v2"
nO = null
""",
    "ner": """
[components.ner]
factory = "ner"

[components.ner.model]
@architectures = "spacy.TransitionBasedParser.v2"
state_type = "ner"
extra_state_tokens = false
hidden_width = 32
maxout_pieces = 2
use_upper = false
nO = null
""",
}


def curated_pipeline(tiny_transformer, listeners=("ner",)):
    """The pipeline (not initialized) of the curated transformer and `listeners`, each
    of "tagger" and "ner", in that order; `tiny_transformer` is the folder of the local
    tiny BERT (its vocabulary and size)."""
    text = CURATED_TRANSFORMER.format(listeners="".join(f',"{n}"' for n in listeners))
    for name in listeners:
        text += COMPONENTS[name] + LISTENER.format(name=name)
    vocab_size = json.loads((tiny_transformer / "config.json").read_text())["vocab_size"]
    overrides = {
        "components.transformer.model.vocab_size": vocab_size,
        "initialize.components.transformer.piecer_loader.name": str(tiny_transformer),
    }
    config = Config().from_str(text, overrides=overrides)
    return spacy.util.load_model_from_config(config, auto_fill=True, validate=True)
