"""Mergeable score states: incremental, serialisable twins of spaCy's scorers.

>>> state = make_pipeline_state(nlp)
>>> state.update(processed_examples)   # counts only; docs can be dropped
>>> state.merge(other_state)           # other holds the examples that come after
>>> state.result()                     # == nlp.evaluate(...) for all examples
"""

from .base import ScoreState  # noqa: F401
from .cats import CatsState, ScoreCounts  # noqa: F401
from .deps import DepsState  # noqa: F401
from .links import LinksState  # noqa: F401
from .pipeline import (  # noqa: F401
    EmptyState,
    EntityLinkerGoldEntsState,
    PipelineScoreState,
    SlimExamplesState,
    make_pipeline_state,
)
from .spans import NERState, SpansState  # noqa: F401
from .tokens import TokenAttrPerFeatState, TokenAttrState, TokenizationState  # noqa: F401
from .twins import CompositeState, find_twin, register_twin, twin_registry  # noqa: F401
