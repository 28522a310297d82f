"""Memory-lean corpora: the one place that reads data (`sources`), a streaming,
resumable reader that splits long documents without losing annotation, a
token-budget batcher, and shard helpers."""

from .batcher import BatchStats, TokenBudgetBatcher, configure_batch_by_tokens_v1  # noqa: F401
from .lengths import WordpieceCounter, token_length  # noqa: F401
from .reader import CorpusStats, CorpusStream, LeanCorpus, create_lean_corpus_v1  # noqa: F401
from .shards import default_rank_and_size, split_among, write_shards  # noqa: F401
from .sources import (  # noqa: F401
    CorruptShardError,
    count_shard_docs,
    iter_shard_docs,
    list_shards,
    path_fingerprint,
    read_examples,
)
from .split import DocSplitter, SplitStats  # noqa: F401
