"""Every name declared in setup.cfg resolves through spaCy's registries.

A config name resolves only through an entry point of exactly that name, so a typo in
setup.cfg (or a module that moved) must fail here, not in a user's `spacy train`."""

import configparser
from importlib.metadata import distribution
from pathlib import Path

import pytest
from spacy.util import registry

SETUP_CFG = Path(__file__).parent.parent / "setup.cfg"
GROUP_TO_REGISTRY = {
    "spacy_factories": "factories",
    "spacy_architectures": "architectures",
    "spacy_readers": "readers",
    "spacy_batchers": "batchers",
    "spacy_callbacks": "callbacks",
    "spacy_scorers": "scorers",
    "spacy_misc": "misc",
    "spacy_cli": "cli",
}


def _declared():
    cfg = configparser.ConfigParser()
    cfg.read(SETUP_CFG)
    entries = []
    for group, body in cfg["options.entry_points"].items():
        for line in body.strip().splitlines():
            if line.strip() and not line.strip().startswith("#"):
                name, value = (part.strip() for part in line.split("=", 1))
                entries.append((group, name, value))
    return entries


DECLARED = _declared()


def test_every_group_is_known():
    assert DECLARED, "setup.cfg declares no entry points"
    assert {group for group, _, _ in DECLARED} <= set(GROUP_TO_REGISTRY)


def test_installed_metadata_matches_setup_cfg():
    installed = {(ep.group, ep.name, ep.value) for ep in distribution("spacy-lean").entry_points}
    missing = set(DECLARED) - installed
    assert not missing, f"reinstall with `pip install -e .`: not installed: {sorted(missing)}"


@pytest.mark.parametrize("group,name,value", DECLARED, ids=[f"{g}:{n}" for g, n, _ in DECLARED])
def test_entry_point_resolves(group, name, value):
    reg = getattr(registry, GROUP_TO_REGISTRY[group])
    if group == "spacy_factories":
        # spaCy resolves factories by name when building a pipeline.
        import spacy
        from spacy.language import Language

        spacy.blank("en")  # loads the factories' entry points
        assert Language.has_factory(name), f"factory {name!r} is not registered"
        meta = Language.get_factory_meta(name)
        assert meta.factory == name
        return
    func = reg.get(name)
    assert callable(func) or hasattr(func, "registered_commands")


def test_the_cli_entry_point_imports_no_transformer_library():
    """spaCy imports every `spacy_cli` entry point for each `spacy` command (`spacy info`
    too): spacy-lean's imported spacy-transformers (so transformers, torch._dynamo), 2-3 s
    added to every command, where a pipeline with a transformer imports it when built."""
    import subprocess
    import sys

    heavy = ("transformers", "spacy_transformers", "ray")
    code = (
        "import sys; from spacy.util import registry; registry.cli.get('lean'); "
        "import spacy_lean, spacy_lean.cli, spacy_lean.training; "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
