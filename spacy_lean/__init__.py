"""spacy-lean: memory-lean transformer training and evaluation for spaCy."""
from .about import __version__  # noqa: F401

# Importing the modules registers the components, readers, batchers and callbacks
# with spaCy's registries (they are also declared as entry points in setup.cfg, so
# configs resolve without this import).
