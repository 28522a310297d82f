"""spacy-lean: memory-lean transformer training and evaluation for spaCy.

Importing the package registers its components (`lean_cleaner`, `char_lm`), reader
(`spacy-lean.Corpus.v1`), batcher (`spacy-lean.batch_by_tokens.v1`), architecture
(`spacy-lean.CharLMEmbed.v1`) and callbacks (`spacy-lean.streaming_evaluate.v1`,
`spacy-lean.strip_streaming_evaluate.v1`). Each is also declared as an entry point in
setup.cfg, so configs resolve them without this import.
"""

from .about import __version__
from . import cleaner, corpus, scoring  # noqa: F401
from .charlm import component as _charlm_component  # noqa: F401
from .charlm import layer as _charlm_layer  # noqa: F401
from .cleaner import LeanCleaner
from .corpus import LeanCorpus, TokenBudgetBatcher
from .scoring import PipelineScoreState, make_pipeline_state, register_twin
from .streaming import StreamingEvaluator, evaluate, install_streaming_evaluate

__all__ = [
    "__version__",
    "evaluate",
    "install_streaming_evaluate",
    "StreamingEvaluator",
    "LeanCleaner",
    "LeanCorpus",
    "TokenBudgetBatcher",
    "make_pipeline_state",
    "PipelineScoreState",
    "register_twin",
]
