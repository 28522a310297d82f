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

# Found, not imported: spaCy imports this package for every `spacy` command (through the
# `spacy_cli` entry point), and importing ray takes about a second. (spacy-transformers
# and spacy-curated-transformers are not imported here either: a pipeline with a
# transformer imports its library when spaCy builds the component, and the code that
# needs their classes looks them up in sys.modules.)
has_ray = importlib.util.find_spec("ray") is not None


def require(flag: bool, package: str, extra: str) -> None:
    """Raise an ImportError that says which extra to install."""
    if not flag:
        raise ImportError(
            f"This feature needs '{package}', which is not installed. "
            f"Install it with: pip install 'spacy-lean[{extra}]'"
        )
