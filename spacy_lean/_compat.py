"""Availability flags for optional dependencies, in one place."""

import importlib.util

try:  # pragma: no cover - depends on the environment
    import torch  # noqa: F401

    has_torch = True
    has_torch_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    torch = None
    has_torch = False
    has_torch_cuda = False

try:  # pragma: no cover
    import cupy  # noqa: F401

    has_cupy = True
except ImportError:  # pragma: no cover
    cupy = None
    has_cupy = False

try:  # pragma: no cover
    import spacy_transformers  # noqa: F401

    has_spacy_transformers = True
except ImportError:  # pragma: no cover
    has_spacy_transformers = False

try:  # pragma: no cover
    import spacy_curated_transformers  # noqa: F401

    has_curated_transformers = True
except ImportError:  # pragma: no cover
    has_curated_transformers = False

# Ray is found, not imported: importing it takes about a second, and spaCy imports
# this package for every `spacy` command (through the `spacy_cli` entry point).
has_ray = importlib.util.find_spec("ray") is not None


def require(flag: bool, package: str, extra: str) -> None:
    """Raise an ImportError that says which extra to install."""
    if not flag:
        raise ImportError(
            f"This feature needs '{package}', which is not installed. "
            f"Install it with: pip install 'spacy-lean[{extra}]'"
        )
