"""Out-of-memory-safe updates (interface first; the splitting lands next)."""
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional

from spacy.language import Language
from spacy.training import Example


@dataclass
class UpdatePolicy:
    """Settings, learned state and counters of `lean_update`.

    max_padded_tokens (Optional[int]): ceiling in padded tokens per micro-batch
        (docs x longest doc, in spaCy tokens); None for no ceiling.
    """

    max_padded_tokens: Optional[int] = None
    parts: Dict[int, int] = field(default_factory=dict)
    oom_splits: int = 0
    micro_batches: int = 0
    batches: int = 0
    examples: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return {
            "max_padded_tokens": self.max_padded_tokens,
            "parts": {str(k): v for k, v in self.parts.items()},
            "oom_splits": self.oom_splits,
            "micro_batches": self.micro_batches,
            "batches": self.batches,
            "examples": self.examples,
        }


def lean_update(
    nlp: Language,
    examples: Iterable[Example],
    *,
    drop: float = 0.0,
    losses: Optional[Dict[str, float]] = None,
    exclude: Iterable[str] = (),
    annotates: Iterable[str] = (),
    policy: Optional[UpdatePolicy] = None,
) -> Dict[str, float]:
    """Like `nlp.update(..., sgd=False)`: accumulates gradients, never steps the optimizer."""
    examples = list(examples)
    if losses is None:
        losses = {}
    if policy is not None:
        policy.batches += 1
        policy.micro_batches += 1
        policy.examples += len(examples)
    return nlp.update(
        examples, drop=drop, losses=losses, sgd=False, exclude=exclude, annotates=annotates
    )
