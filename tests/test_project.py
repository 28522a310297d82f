"""The spaCy project (project.yml, configs/, scripts/): its conventions, its scripts,
and the `all` workflow run end to end with tiny settings in a copy of the project."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import srsly
import typer
from spacy.tokens import DocBin
from spacy.vocab import Vocab
from thinc.api import Config
from typer.testing import CliRunner

from spacy_lean import synthetic

ROOT = Path(__file__).parent.parent
PROJECT = srsly.read_yaml(ROOT / "project.yml")
COMMANDS = {cmd["name"]: cmd for cmd in PROJECT["commands"]}
# Tiny settings: a few docs, a narrow transformer, a few training steps.
TINY_VARS = {
    "n_train_docs": 40,
    "n_dev_docs": 12,
    "n_test_docs": 12,
    "long_doc_rate": 0.1,
    "docs_per_shard": 10,
    "tiny_vocab_size": 200,
    "tiny_hidden_size": 16,
    "tiny_layers": 1,
    "max_steps": 6,
    "eval_frequency": 3,
    "warmup_steps": 2,
    "batch_size": 400,
}
SCORE_KEYS = ("token_acc", "ents_p", "ents_r", "ents_f", "ents_per_type", "speed")


def _env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(args, cwd, timeout=300):
    result = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, result.stdout + result.stderr


def _copy_project(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "project.yml", dest / "project.yml")
    shutil.copytree(ROOT / "configs", dest / "configs")
    shutil.copytree(
        ROOT / "scripts", dest / "scripts", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


def _load_script(name: str):
    """Import scripts/<name>.py as a module (the scripts are not a package)."""
    path = ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"project_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _invoke(name: str, args):
    """Run a script's typer command in this process: (exit code, output)."""
    app = typer.Typer()
    app.command()(_load_script(name).main)
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def flat(out: str) -> str:
    """The output on one line: wasabi wraps messages at 80 columns, so where a line
    breaks depends on the length of the temporary paths printed before a phrase."""
    return " ".join(out.split())


def _script_vars(text: str):
    return set(re.findall(r"\$\{vars\.([A-Za-z0-9_]+)\}", text))


# --- project.yml conventions -------------------------------------------------------


def test_project_keys_in_order():
    expected = ["title", "description", "vars", "directories", "assets", "workflows", "commands"]
    assert list(PROJECT.keys()) == expected


def test_project_validates_against_weasel_schema():
    from weasel.schemas import ProjectConfigSchema, validate

    assert validate(ProjectConfigSchema, PROJECT) == []


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_has_help_script_deps_outputs(name):
    cmd = COMMANDS[name]
    for key in ("help", "script", "deps", "outputs"):
        assert cmd.get(key), f"command '{name}' has no {key}"
    for dep in cmd["deps"]:
        if dep.startswith(("scripts/", "configs/", "benchmarks/plot.py")):
            path = dep.replace("${vars.config}", PROJECT["vars"]["config"])
            path = path.replace("${vars.charlm_config}", PROJECT["vars"]["charlm_config"])
            assert (ROOT / path).exists(), f"command '{name}' depends on missing {path}"


def test_every_var_used_is_defined_and_every_var_defined_is_used():
    text = (ROOT / "project.yml").read_text(encoding="utf8")
    used = _script_vars(text)
    defined = set(PROJECT["vars"])
    assert used - defined == set()
    assert defined - used == set()


def test_benchmark_commands_depend_on_the_helpers_their_scripts_import():
    """A change to benchmarks/_procmem.py (how memory is measured) reruns every benchmark
    that imports it."""
    helpers = {p.stem for p in (ROOT / "benchmarks").glob("_*.py")}
    for name, cmd in COMMANDS.items():
        scripts = [d for d in cmd["deps"] if re.fullmatch(r"benchmarks/[a-z_]+\.py", d)]
        for script in scripts:
            text = (ROOT / script).read_text(encoding="utf8")
            imported = set(re.findall(r"^from (_[a-z_]+) import", text, flags=re.M))
            for helper in imported & helpers:
                assert f"benchmarks/{helper}.py" in cmd["deps"], (name, helper)


def test_workflows_name_commands():
    assert "all" in PROJECT["workflows"]
    assert PROJECT["workflows"]["all"] == ["corpus", "transformer", "shard", "train", "evaluate"]
    for name, steps in PROJECT["workflows"].items():
        for step in steps:
            assert step in COMMANDS, f"workflow '{name}' runs unknown command '{step}'"


def test_real_data_assets_are_optional_and_pinned():
    assets = PROJECT["assets"]
    assert {Path(a["dest"]).parent.name for a in assets} == {"conll2003", "wnut17"}
    make_corpus = _load_script("make_corpus")
    for asset in assets:
        assert asset["extra"] is True, "the offline workflow must never need a download"
        assert re.search(r"/[0-9a-f]{40}/", asset["url"]), "URLs are pinned to a commit"
        size, sha256 = make_corpus.ASSET_SHA256[asset["dest"]]
        assert f"{size:,} bytes" in asset["description"]
        assert sha256[:8] in asset["description"]


def test_train_command_uses_gpu_id_and_lean_paths():
    script = " ".join(COMMANDS["train"]["script"])
    assert "--gpu-id ${vars.gpu_id}" in script
    assert '--paths.transformer "${vars.transformer}"' in script
    assert "corpus/shards/train" in script
    evaluate = " ".join(COMMANDS["evaluate"]["script"])
    assert "spacy evaluate" in evaluate and "spacy lean evaluate" in evaluate


def test_mixed_precision_without_a_gpu_is_refused_before_training():
    """`--vars.mixed_precision true` on the CPU initialised the whole pipeline and then
    failed at the first update in thinc's gradient scaler, naming neither the var nor the
    fix. The training steps check it first."""
    for name, var in (("train", "gpu_id"), ("train-ddp", "gpu_ids")):
        first = COMMANDS[name]["script"][0]
        assert first.startswith("python scripts/check_device.py")
        assert "--mixed-precision ${vars.mixed_precision}" in first
        assert f"--gpu-ids ${{vars.{var}}}" in first
    code, out = _invoke("check_device", ["--mixed-precision", "true", "--gpu-ids", "-1"])
    assert code == 1
    assert "--vars.gpu_id is -1" in flat(out) and "Pass --vars.gpu_id 0" in flat(out)
    args = ["--mixed-precision", "true", "--gpu-ids", "-1", "--var", "gpu_ids"]
    code, out = _invoke("check_device", args)
    assert code == 1 and "Pass --vars.gpu_ids 0,1" in flat(out)
    for flag, ids in (("true", "0"), ("true", "0,1"), ("false", "-1"), ("False", "-1")):
        code, out = _invoke("check_device", ["--mixed-precision", flag, "--gpu-ids", ids])
        assert code == 0, (flag, ids, out)
    # The ids are read as `spacy lean train --gpu-ids` reads them: '-1,1' is refused
    # there, so it is not taken for GPU 1 here.
    for flag in ("true", "false"):
        code, out = _invoke("check_device", ["--mixed-precision", flag, "--gpu-ids", "-1,1"])
        assert code == 1 and "must be >= 0, got '-1,1'" in flat(out)
    code, out = _invoke("check_device", ["--mixed-precision", "yes", "--gpu-ids", "0"])
    assert code == 1 and "must be true or false, got 'yes'" in flat(out)
    code, out = _invoke("check_device", ["--mixed-precision", "true", "--gpu-ids", "a"])
    assert code == 1 and "got 'a'" in flat(out)


# Vars whose values are paths, or names that paths are made of.
PATH_VARS = ("dataset", "transformer", "flair_python", "config", "charlm_config")


def test_path_vars_holding_spaces_stay_one_argument():
    """weasel substitutes the vars into a script line, then splits it as a shell would:
    a folder named "my data" must reach the script as one argument, not two."""
    from weasel.util import parse_config_overrides, split_command
    from weasel.util.config import substitute_project_variables

    values = {name: f"/a b/{name} c" for name in PATH_VARS}
    overrides = parse_config_overrides([a for k, v in values.items() for a in (f"--vars.{k}", v)])
    project = substitute_project_variables(srsly.read_yaml(ROOT / "project.yml"), overrides)
    raw = {cmd["name"]: cmd["script"] for cmd in PROJECT["commands"]}
    checked = set()
    for cmd in project["commands"]:
        for line, template in zip(cmd["script"], raw[cmd["name"]]):
            args = split_command(line)
            for name in _script_vars(template) & set(PATH_VARS):
                assert any(values[name] in arg for arg in args), (cmd["name"], name, args)
                checked.add(name)
            # Every value starts with "/a b/": split, a piece would end with "/a".
            assert not any(arg.endswith("/a") for arg in args), (cmd["name"], args)
    assert checked == set(PATH_VARS)


def test_commands_that_use_the_transformer_depend_on_its_card():
    """training/transformer.json changes when the transformer does (its files'
    fingerprint): every command that reads ${vars.transformer} but does not make it must
    depend on the card, or it would skip after the weights changed."""
    users = [
        name
        for name, cmd in COMMANDS.items()
        if "transformer" in _script_vars(" ".join(cmd["script"])) and name != "transformer"
    ]
    assert {"train", "train-ddp"} <= set(users)
    for name in users:
        assert "training/transformer.json" in COMMANDS[name]["deps"], name
    assert "training/transformer.json" in COMMANDS["transformer"]["outputs"]


# --- configs ------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.cfg")), ids=lambda p: p.name)
def test_config_fills_and_resolves(path, tiny_transformer, ner_corpus):
    """Every config fills, validates and resolves its registered functions (which
    fails on a name that no entry point declares)."""
    import spacy

    overrides = {
        "paths.train": str(ner_corpus["train"]),
        "paths.dev": str(ner_corpus["dev"]),
        "paths.transformer": str(tiny_transformer),
    }
    config = Config().from_disk(path, overrides=overrides)
    nlp = spacy.util.load_model_from_config(config, auto_fill=True, validate=True)
    from spacy.schemas import ConfigSchemaTraining

    training = spacy.util.registry.resolve(
        nlp.config.interpolate()["training"], schema=ConfigSchemaTraining
    )
    assert training["max_steps"] > 0


def test_lean_config_uses_lean_parts():
    config = Config().from_disk(ROOT / "configs" / "ner_trf.cfg")
    assert config["nlp"]["pipeline"][-1] == "lean_cleaner"
    assert config["corpora"]["train"]["@readers"] == "spacy-lean.Corpus.v1"
    assert config["corpora"]["dev"]["@readers"] == "spacy-lean.Corpus.v1"
    assert config["training"]["batcher"]["@batchers"] == "spacy-lean.batch_by_tokens.v1"
    assert config["nlp"]["after_pipeline_creation"]["@callbacks"] == (
        "spacy-lean.streaming_evaluate.v1"
    )
    # Streamed, not listed: spaCy lists the whole corpus when max_epochs >= 0.
    assert config["training"]["max_epochs"] == -1


# --- scripts ------------------------------------------------------------------------


def test_make_corpus_generated(tmp_path):
    code, out = _invoke(
        "make_corpus",
        [
            "generated",
            tmp_path,
            "--n-train",
            "30",
            "--n-dev",
            "5",
            "--n-test",
            "6",
            "--long-doc-rate",
            "0.2",
        ],
    )
    assert code == 0, out
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert [stats[s]["docs"] for s in ("train", "dev", "test")] == [30, 5, 6]
    assert stats["dataset"] == "generated"
    assert set(stats["train"]["ents_per_label"]) == {"PERSON", "ORG", "LOC", "MISC"}
    assert stats["train"]["max_doc_tokens"] > 5 * stats["train"]["median_doc_tokens"]
    docs = list(DocBin().from_disk(tmp_path / "train.spacy").get_docs(Vocab()))
    assert len(docs) == 30
    assert any(len(list(d.sents)) > 1 for d in docs)


CONLL = """-DOCSTART- -X- -X- O

Ada NNP B-NP I-PER
Lindqvist NNP I-NP I-PER
visited VBD B-VP O
Veldmark NNP B-NP I-LOC
. . O O

She PRP B-NP O
left VBD B-VP O
. . O O

-DOCSTART- -X- -X- O

Quillon NNP B-NP I-ORG
Labs NNP I-NP I-ORG
grew VBD B-VP O
. . O O
"""


def test_make_corpus_converts_conll_folder(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.txt", "valid.txt", "test.txt"):
        (data / name).write_text(CONLL, encoding="utf8")
    out_dir = tmp_path / "corpus"
    code, out = _invoke("make_corpus", [data, out_dir])
    assert code == 0, out
    docs = list(DocBin().from_disk(out_dir / "dev.spacy").get_docs(Vocab()))
    # -DOCSTART- lines written with 4 columns are document boundaries, not tokens.
    assert len(docs) == 2
    ents = [(e.text, e.label_) for e in docs[0].ents]
    assert ents == [("Ada Lindqvist", "PER"), ("Veldmark", "LOC")]
    assert [s.text for s in docs[0].sents] == ["Ada Lindqvist visited Veldmark .", "She left ."]
    assert [(e.text, e.label_) for e in docs[1].ents] == [("Quillon Labs", "ORG")]


# Shaped like WNUT-17's files (assets/wnut17/*): word<TAB>tag, sentences separated by lines
# holding a tab, no -DOCSTART- lines. The text is made up for this test.
WNUT = (
    "@tovadrift\tO\nthat\tO\n's\tO\nthe\tO\nbridge\tO\n.\tO\nHalvern\tB-location\n"
    "Tide\tI-location\nTower\tI-location\n.\tO\n\t\nVia\tO\nthe\tO\nwire\tO\n"
    ":\tO\nQORV\tB-group\nexpands\tO\n\t\nBrindlewick\tB-corporation\nTop\tO\n20\tO\n\t\n"
    "tonight\tO\nis\tO\nmy\tO\nfirst\tO\nshow\tO\n.\tO\n\t\n"
)


def test_make_corpus_converts_wnut17_sentences(tmp_path):
    """The tab-only lines end sentences, and --n-sents groups them into documents (spaCy's
    converter splits on empty lines only: each file became one sentence, one document)."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.conll", "dev.conll", "test.annotated"):
        (data / name).write_text(WNUT, encoding="utf8")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus", "--n-sents", "2"])
    assert code == 0, out
    docs = list(DocBin().from_disk(tmp_path / "corpus" / "test.spacy").get_docs(Vocab()))
    assert [len(list(d.sents)) for d in docs] == [2, 2]
    assert [s.text for s in docs[1].sents] == ["Brindlewick Top 20", "tonight is my first show ."]
    assert [(e.text, e.label_) for e in docs[0].ents] == [
        ("Halvern Tide Tower", "location"),
        ("QORV", "group"),
    ]


def test_make_corpus_reads_a_byte_order_mark_and_names_bad_lines(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    # A byte order mark (Windows editors) is no part of the first -DOCSTART- line.
    for name in ("train.txt", "valid.txt", "test.txt"):
        (data / name).write_text("\ufeff" + CONLL, encoding="utf8")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 0, out
    docs = list(DocBin().from_disk(tmp_path / "corpus" / "train.spacy").get_docs(Vocab()))
    assert [t.text for t in docs[0]][:2] == ["Ada", "Lindqvist"]
    # Blank lines holding spaces or tabs (some exporters write them) still end sentences:
    # spaCy's converter splits on "\n\n" only, and made one sentence of the whole file.
    (data / "train.txt").write_text(CONLL.replace("\n\n", "\n \t\n"), encoding="utf8")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 0, out
    spaced = list(DocBin().from_disk(tmp_path / "corpus" / "train.spacy").get_docs(Vocab()))
    assert [[s.text for s in d.sents] for d in spaced] == [[s.text for s in d.sents] for d in docs]
    bad = {
        "a token without a tag": "Ada B-PER\nleft\n. O\n",
        "a whitespace token": "Ada B-PER\n\u00a0 O\n",
        "ragged columns": "Ada NNP B-NP B-PER\nleft O\n",
    }
    for problem, text in bad.items():
        (data / "test.txt").write_text(text, encoding="utf8")
        code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
        assert code == 1, problem
        assert "test.txt" in flat(out) and "line 2" in flat(out), (problem, out)
    (data / "test.txt").write_bytes("Zo\u00eb B-PER\n".encode("latin-1"))
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 1 and "test.txt" in flat(out) and "UTF-8" in flat(out), out
    (data / "test.txt").write_text("-DOCSTART- -X- -X- O\n\n", encoding="utf8")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 1 and "No documents in" in flat(out) and "test.txt" in flat(out), out
    (data / "test.txt").unlink()
    DocBin().to_disk(data / "test.spacy")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 1 and "No documents in" in flat(out) and "test.spacy" in flat(out), out
    (data / "test.spacy").write_text("not a DocBin", encoding="utf8")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 1 and "Could not read" in flat(out) and "test.spacy" in flat(out), out


def _corpus_folder(tmp_path, **files):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for name, text in {"train.txt": CONLL, "valid.txt": CONLL, "test.txt": CONLL}.items():
        (data / name).write_text(text, encoding="utf8")
    for name, text in files.items():
        (data / name.replace("__", ".")).write_text(text, encoding="utf8")
    return data


def test_make_corpus_reads_bioes_and_refuses_tags_it_cannot_read(tmp_path):
    """spaCy's converter cuts every tag to its label after two characters: IO tags
    ("PER") became one-token entities labelled "R", a POS column last ("NNP") entities
    labelled "P", and BIOES's E- tags split entities, all with a success line. BIOES
    and BILUO are converted now; anything else is refused naming the line."""
    bioes = "Ada B-PER\nLindqvist E-PER\nmet O\nBo S-PER\nin O\nNew B-LOC\nHal I-LOC\nCity L-LOC\n"
    data = _corpus_folder(tmp_path, test__txt=bioes + "\nQuill U-ORG\n")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 0, out
    docs = list(DocBin().from_disk(tmp_path / "corpus" / "test.spacy").get_docs(Vocab()))
    ents = [(e.text, e.label_) for d in docs for e in d.ents]
    assert ents == [
        ("Ada Lindqvist", "PER"),
        ("Bo", "PER"),
        ("New Hal City", "LOC"),
        ("Quill", "ORG"),
    ]
    for text, tag in (("Ada PER\nLindqvist PER\n. O\n", "PER"), ("Ada NNP\nleft VBD\n", "NNP")):
        (data / "test.txt").write_text(text, encoding="utf8")
        code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
        assert code == 1, tag
        assert f"test.txt, line 1: '{tag}' is not an NER tag" in flat(out), out


def test_make_corpus_refuses_two_files_for_a_split_and_reads_jsonl(tmp_path):
    """A leftover train.iob next to the curated train.spacy: the .iob was read (it sorts
    first), silently. Refused now, naming both. A .jsonl file is read as the training
    reader reads it (docs/corpus.md); a joined .spacy file is refused by name, not one
    step later; a negative --n-sents is refused, not a traceback."""
    data = _corpus_folder(tmp_path)
    synthetic.write_ner_corpus(data / "train.spacy", 5, seed=1)
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 1 and "2 train files in" in flat(out)
    assert "train.spacy, train.txt" in flat(out), out
    (data / "train.txt").unlink()
    joined = data / "train.spacy"
    joined.write_bytes(joined.read_bytes() * 2)
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 1 and "train.spacy" in flat(out) and "joined" in flat(out), out
    joined.unlink()
    record = {"text": "Ada Lindqvist visited Veldmark .", "entities": [[0, 13, "PER"]]}
    (data / "train.jsonl").write_text(json.dumps(record) + "\n", encoding="utf8")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 0, out
    (doc,) = DocBin().from_disk(tmp_path / "corpus" / "train.spacy").get_docs(Vocab())
    assert [(e.text, e.label_) for e in doc.ents] == [("Ada Lindqvist", "PER")]
    record["entities"] = [[0, 12, "PER"]]  # not on a token boundary
    (data / "train.jsonl").write_text(json.dumps(record) + "\n", encoding="utf8")
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 1 and "train.jsonl" in flat(out), out
    (data / "train.jsonl").unlink()
    (data / "train").mkdir()
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus"])
    assert code == 1 and "No train file" in flat(out) and "A folder of shards (train)" in flat(out)
    code, out = _invoke("make_corpus", [data, tmp_path / "corpus", "--n-sents", "-1"])
    assert code == 1 and "must be >= 0, got -1" in flat(out), out


def test_make_corpus_replaces_no_split_when_one_fails_and_warns_of_one_sentence(tmp_path):
    """The splits were written one by one: a dev file that failed left the new
    train.spacy beside the old dev and test. And a file without empty lines became one
    sentence, with spaCy's warning hidden."""
    data = _corpus_folder(tmp_path)
    out_dir = tmp_path / "corpus"
    code, out = _invoke("make_corpus", [data, out_dir])
    assert code == 0, out
    before = {p.name: p.read_bytes() for p in out_dir.glob("*.spacy")}
    (data / "train.txt").write_text("Bo B-PER\nran O\n\nBo B-PER\nsat O\n", encoding="utf8")
    (data / "valid.txt").write_text("Bo PER\n", encoding="utf8")
    code, out = _invoke("make_corpus", [data, out_dir])
    assert code == 1 and "valid.txt, line 1" in flat(out), out
    assert {p.name: p.read_bytes() for p in out_dir.glob("*.spacy")} == before
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "dev.spacy",
        "stats.json",
        "test.spacy",
        "train.spacy",
    ]
    (data / "valid.txt").write_text("Bo B-PER\nran O\nBo B-PER\nsat O\n", encoding="utf8")
    code, out = _invoke("make_corpus", [data, out_dir])
    assert code == 0, out
    said = flat(out)
    assert "valid.txt has no empty line between sentences: its 4 tokens are one sentence" in said
    assert "train.txt has no empty line" not in said and "test.txt has no empty line" not in said
    # --n-sents 0 without -DOCSTART-: spaCy's converter finds the sentences itself.
    code, out = _invoke("make_corpus", [data, out_dir, "--n-sents", "0"])
    assert code == 0 and "has no empty line" not in flat(out), out
    code, out = _invoke("make_corpus", [data, data])
    assert code == 1 and "is the folder this step writes to" in flat(out), out


def test_corpus_step_sees_edits_to_a_dataset_folder(tmp_path):
    """The files of --vars.dataset are no deps of the `corpus` step (deps cannot name a
    folder that "generated" does not have): it runs every time, writing the same bytes
    for the same data, so the steps after it skip unless the data changed."""
    project = _copy_project(tmp_path / "project")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.iob", "dev.iob", "test.iob"):
        (data / name).write_text(CONLL, encoding="utf8")
    command = ["-m", "spacy", "project", "run", "corpus", str(project), "--vars.dataset", str(data)]
    train = project / "corpus" / "train.spacy"
    code, out = _run(command, cwd=tmp_path)
    assert code == 0, out[-4000:]
    first = train.read_bytes()
    assert len(list(DocBin().from_disk(train).get_docs(Vocab()))) == 2
    code, out = _run(command, cwd=tmp_path)
    assert code == 0, out[-4000:]
    assert train.read_bytes() == first
    (data / "train.iob").write_text(CONLL + "\n" + CONLL, encoding="utf8")
    code, out = _run(command, cwd=tmp_path)
    assert code == 0, out[-4000:]
    assert len(list(DocBin().from_disk(train).get_docs(Vocab()))) == 4


def test_corpus_step_reads_a_dataset_folder_whose_path_holds_spaces(tmp_path):
    """--vars.dataset "/x/my data" (in a project whose own path holds a space) is one
    argument of the script: weasel splits the line after putting the value in."""
    project = _copy_project(tmp_path / "p sp" / "project")
    data = tmp_path / "my data"
    data.mkdir()
    for name in ("train.iob", "dev.iob", "test.iob"):
        (data / name).write_text(CONLL, encoding="utf8")
    command = ["-m", "spacy", "project", "run", "corpus", str(project), "--vars.dataset", str(data)]
    code, out = _run(command, cwd=tmp_path)
    assert code == 0, out[-4000:]
    stats = json.loads((project / "corpus" / "stats.json").read_text())
    assert [stats[s]["docs"] for s in ("train", "dev", "test")] == [2, 2, 2]


def test_make_corpus_missing_assets_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = _invoke("make_corpus", ["wnut17", "corpus"])
    assert code == 1
    assert "assets/wnut17/wnut17train.conll" in out
    assert "spacy project assets --extra" in flat(out)
    code, out = _invoke("make_corpus", ["no_such_dir", "corpus"])
    assert code == 1 and "Unknown dataset 'no_such_dir'" in flat(out)
    assert str(tmp_path) in out.replace("\n", "")  # where a relative folder was looked for


def test_make_transformer_kinds(tmp_path, ner_corpus, tiny_transformer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus = ner_corpus["train"]
    # Under assets/: made here, with a vocabulary trained on the corpus.
    code, out = _invoke(
        "make_transformer",
        ["assets/bert", corpus, "card.json", "--vocab-size", "150", "--hidden-size", "16"],
    )
    assert code == 0, out
    card = json.loads((tmp_path / "card.json").read_text())
    assert card["source"] == "generated" and card["hidden_size"] == 16
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(tmp_path / "assets/bert").hidden_size == 16
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "assets/bert")
    assert "[UNK]" not in tokenizer.tokenize("Ada Lindqvist visited Veldmark")
    # An existing folder not made here is used as it is.
    code, out = _invoke("make_transformer", [tiny_transformer, corpus, "card.json"])
    assert code == 0, out
    assert json.loads((tmp_path / "card.json").read_text())["source"] == "local"
    # Anything else is a Hub name, left to spacy-transformers.
    code, out = _invoke("make_transformer", ["roberta-base", corpus, "card.json"])
    assert code == 0, out
    card = json.loads((tmp_path / "card.json").read_text())
    assert card == {"name": "roberta-base", "source": "hub"}
    assert "HF_HUB_OFFLINE" in flat(out)
    assert not (tmp_path / "roberta-base").exists()


def test_make_transformer_card_changes_with_the_weights(tmp_path, monkeypatch):
    """The card (what `train` depends on) holds a fingerprint of a local folder's files:
    other weights with the same config make another card; the same files the same bytes,
    so a run that changed nothing still skips."""
    from spacy_lean import synthetic

    monkeypatch.chdir(tmp_path)
    corpus = synthetic.write_ner_corpus(tmp_path / "train.spacy", 4, seed=0)
    bert = tmp_path / "my bert"

    def card():
        code, out = _invoke("make_transformer", [bert, corpus, "card.json"])
        assert code == 0, out
        return (tmp_path / "card.json").read_bytes()

    synthetic.make_tiny_transformer(bert, vocab_size=200, hidden_size=16, num_hidden_layers=1)
    first = card()
    info = json.loads(first)
    assert info["source"] == "local" and info["hidden_size"] == 16
    files = [p for p in bert.rglob("*") if p.is_file()]
    assert info["files"] == {"count": len(files), "bytes": sum(p.stat().st_size for p in files)}
    assert card() == first
    # The user's model changed: other weights, the same config.
    weights = bert / "model.safetensors"
    synthetic.make_tiny_transformer(
        tmp_path / "other", vocab_size=200, hidden_size=16, num_hidden_layers=1, seed=1
    )
    shutil.copy(tmp_path / "other" / "model.safetensors", weights)
    assert (bert / "config.json").read_bytes() == (tmp_path / "other/config.json").read_bytes()
    other = card()
    assert other != first and json.loads(other)["sha256"] != info["sha256"]
    # Hidden bookkeeping (a clone's .git, huggingface_hub's .cache) is no part of the model.
    (bert / ".git").mkdir()
    (bert / ".git" / "FETCH_HEAD").write_text("abc")
    assert card() == other
    # One byte of the weights changed, the size the same.
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert card() != other


def test_compare_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = {"ents_f": 0.5, "ents_per_type": {"ORG": {"p": 1.0}}, "speed": 100.0}
    b = {"ents_f": 0.5, "ents_per_type": {"ORG": {"p": 1.0}}, "speed": 300.0}
    srsly.write_json(tmp_path / "a.json", a)
    srsly.write_json(tmp_path / "b.json", b)
    code, out = _invoke("compare_metrics", ["a.json", "b.json", "s.json"])
    assert code == 0, out
    summary = srsly.read_json(tmp_path / "s.json")
    assert summary["agree"] and summary["compared"] == 2
    assert summary["speed"] == {"spacy_evaluate": 100.0, "lean_evaluate": 300.0}
    assert summary["only_in_spacy_evaluate"] == summary["only_in_lean_evaluate"] == []
    b["ents_per_type"]["ORG"]["p"] = 0.9
    srsly.write_json(tmp_path / "b.json", b)
    code, out = _invoke("compare_metrics", ["a.json", "b.json", "s.json"])
    assert code == 1 and "ents_per_type.ORG.p" in flat(out)
    # A score that one evaluation leaves out (None) and the other gives is a disagreement;
    # None on both sides is not compared.
    a.update(ents_per_type={"ORG": {"p": 1.0}}, token_acc=None, ents_r=None)
    b.update(ents_per_type={"ORG": {"p": 1.0}}, token_acc=None, ents_r=0.0)
    srsly.write_json(tmp_path / "a.json", a)
    srsly.write_json(tmp_path / "b.json", b)
    code, out = _invoke("compare_metrics", ["a.json", "b.json", "s.json"])
    assert code == 1 and "ents_r" in flat(out), out
    summary = srsly.read_json(tmp_path / "s.json")
    assert summary["agree"] is False and summary["compared"] == 3


def test_compare_metrics_fails_on_a_score_only_one_file_has(tmp_path, monkeypatch):
    """ "checks that every score agrees": a score that one evaluation writes and the other
    lacks is a disagreement (it compared only the scores both had, and agreed with an
    output that lacked most of them); speed, no score of the pipeline, may be one-sided."""
    monkeypatch.chdir(tmp_path)
    stock = {
        "token_acc": 1.0,
        "ents_p": 0.5,
        "ents_r": 0.5,
        "ents_f": 0.5,
        "ents_per_type": {"PER": {"p": 1.0, "r": 1.0, "f": 1.0}, "LOC": {"p": 0.0}},
        "speed": 100.0,
    }
    srsly.write_json(tmp_path / "stock.json", stock)
    srsly.write_json(tmp_path / "lean.json", {"token_acc": 1.0, "speed": 120.0})
    code, out = _invoke("compare_metrics", ["stock.json", "lean.json", "s.json"])
    assert code == 1, out
    assert "ents_f" in flat(out) and "ents_per_type.LOC.p" in flat(out) and "stock.json" in out
    summary = srsly.read_json(tmp_path / "s.json")
    assert summary["agree"] is False
    assert summary["only_in_spacy_evaluate"] == sorted(
        ["ents_p", "ents_r", "ents_f", "ents_per_type.PER.p", "ents_per_type.PER.r"]
        + ["ents_per_type.PER.f", "ents_per_type.LOC.p"]
    )
    # A label that only one evaluation scored, and a score only the other writes.
    lean = json.loads(json.dumps(stock))
    del lean["ents_per_type"]["LOC"]
    lean["extra"] = 1.0
    srsly.write_json(tmp_path / "lean.json", lean)
    code, out = _invoke("compare_metrics", ["stock.json", "lean.json", "s.json"])
    assert code == 1 and "ents_per_type.LOC.p" in flat(out) and "extra" in flat(out), out
    summary = srsly.read_json(tmp_path / "s.json")
    assert summary["only_in_spacy_evaluate"] == ["ents_per_type.LOC.p"]
    assert summary["only_in_lean_evaluate"] == ["extra"]
    # The same scores, speed written by one side only: they agree.
    lean = {k: v for k, v in stock.items() if k != "speed"}
    srsly.write_json(tmp_path / "lean.json", lean)
    code, out = _invoke("compare_metrics", ["stock.json", "lean.json", "s.json"])
    assert code == 0, out
    summary = srsly.read_json(tmp_path / "s.json")
    assert summary["agree"] and summary["compared"] == 8
    assert summary["speed"] == {"spacy_evaluate": 100.0, "lean_evaluate": None}


def test_run_benchmark_checks_the_results_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bench = tmp_path / "benchmarks"
    (bench / "results").mkdir(parents=True)
    writes = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "out = Path(__file__).parent / 'results' / 'writes.json'\n"
        "out.write_text(json.dumps({'quick': '--quick' in sys.argv}))\n"
    )
    (bench / "writes.py").write_text(writes)
    (bench / "silent.py").write_text("print('no results')\n")
    (bench / "fails.py").write_text("raise SystemExit(3)\n")
    code, out = _invoke("run_benchmark", ["writes", "--size", "quick"])
    assert code == 0, out
    assert json.loads((bench / "results/writes.json").read_text()) == {"quick": True}
    code, out = _invoke("run_benchmark", ["writes"])
    assert code == 0 and json.loads((bench / "results/writes.json").read_text()) == {"quick": False}
    code, out = _invoke("run_benchmark", ["silent"])
    assert code == 1 and "did not write" in flat(out)
    code, out = _invoke("run_benchmark", ["silent", "--size", "quick"])
    assert code == 0 and "left" in flat(out)
    code, out = _invoke("run_benchmark", ["fails"])
    assert code == 3 and "exit code 3" in flat(out)
    code, out = _invoke("run_benchmark", ["missing"])
    assert code == 1 and "No benchmark script" in flat(out)
    code, out = _invoke("run_benchmark", ["writes", "--size", "huge"])
    assert code == 1 and "--size must be one of" in flat(out)


# --- the `all` workflow, end to end -----------------------------------------------------


def test_all_workflow_runs_offline_end_to_end(tmp_path):
    _check_all_workflow(tmp_path, TINY_VARS)


@pytest.mark.gpu
def test_all_workflow_runs_on_gpu(tmp_path):
    pytest.importorskip("cupy", reason="GPU training needs spacy-lean[cuda12x]")
    # float16 kernels on batches of other shapes: the two evaluations may differ slightly.
    gpu_vars = {"gpu_id": 0, "mixed_precision": "true", "compare_tolerance": 0.05}
    _check_all_workflow(tmp_path, {**TINY_VARS, **gpu_vars})


def _check_all_workflow(tmp_path, tiny_vars):
    project = _copy_project(tmp_path / "project")
    overrides = [arg for k, v in tiny_vars.items() for arg in (f"--vars.{k}", str(v))]
    command = ["-m", "spacy", "project", "run", "all", str(project), *overrides]
    code, out = _run(command, cwd=tmp_path)
    assert code == 0, out[-4000:]
    card = json.loads((project / "training/transformer.json").read_text())
    assert card["source"] == "generated" and card["hidden_size"] == 16
    shards = sorted((project / "corpus/shards/train").glob("*.spacy"))
    assert len(shards) == 4  # 40 docs, 10 per shard
    config = Config().from_disk(project / "training/ner_trf/model-best/config.cfg")
    assert config["nlp"]["pipeline"] == ["transformer", "ner", "lean_cleaner"]
    assert config["corpora"]["train"]["@readers"] == "spacy-lean.Corpus.v1"
    assert config["training"]["batcher"]["@batchers"] == "spacy-lean.batch_by_tokens.v1"
    # Streaming in training, stripped from the saved pipeline (see ner_trf.cfg).
    assert config["nlp"]["after_pipeline_creation"] is None
    metrics = project / "metrics"
    for name in ("ner_trf_spacy_evaluate.json", "ner_trf_lean_evaluate.json"):
        scores = json.loads((metrics / name).read_text())
        for key in SCORE_KEYS:
            assert key in scores, f"{name} has no '{key}'"
        assert 0.0 <= scores["ents_f"] <= 1.0
    summary = json.loads((metrics / "ner_trf_summary.json").read_text())
    assert summary["agree"] is True
    assert "ents_f" in summary["scores"]
    # Nothing changed: a second run skips every step but `corpus`, which always runs
    # (no_skip) and writes the same files again.
    code, out = _run(command, cwd=tmp_path)
    assert code == 0, out[-4000:]
    assert out.count("nothing changed") == len(PROJECT["workflows"]["all"]) - 1
    assert "Skipping 'corpus'" not in out
    # The transformer made under assets/ is an output: deleted, it is made again.
    shutil.rmtree(project / "assets" / "tiny_bert")
    remake = ["-m", "spacy", "project", "run", "transformer", str(project), *overrides]
    code, out = _run(remake, cwd=tmp_path)
    assert code == 0, out[-4000:]
    assert "nothing changed" not in out
    assert (project / "assets" / "tiny_bert" / "config.json").exists()
    # Other settings: the shards are written again, none left from before.
    reshard = [
        "-m",
        "spacy",
        "project",
        "run",
        "shard",
        str(project),
        *overrides,
        "--vars.docs_per_shard",
        "20",
    ]
    code, out = _run(reshard, cwd=tmp_path)
    assert code == 0, out[-4000:]
    assert len(list((project / "corpus/shards/train").glob("*.spacy"))) == 2


@pytest.mark.slow
def test_all_workflow_trains_again_after_a_local_transformers_weights_change(tmp_path):
    """`train` depends on training/transformer.json, which holds a fingerprint of the
    folder's files: new weights in the same folder (same config) train and evaluate
    again. The project and the folder have spaces in their paths (quoted in project.yml)."""
    from spacy_lean import synthetic

    project = _copy_project(tmp_path / "p sp" / "project")
    bert = tmp_path / "my models" / "bert"
    tiny = dict(vocab_size=200, hidden_size=16, num_hidden_layers=1)
    synthetic.make_tiny_transformer(bert, **tiny)
    overrides = [arg for k, v in TINY_VARS.items() for arg in (f"--vars.{k}", str(v))]
    command = ["-m", "spacy", "project", "run", "all", str(project), *overrides]
    command += ["--vars.transformer", str(bert)]
    code, out = _run(command, cwd=tmp_path, timeout=600)
    assert code == 0, out[-4000:]
    assert json.loads((project / "training/transformer.json").read_text())["source"] == "local"
    model = project / "training/ner_trf/model-best/transformer/model"
    trained = model.read_bytes()
    synthetic.make_tiny_transformer(tmp_path / "other", seed=1, **tiny)
    shutil.copy(tmp_path / "other/model.safetensors", bert / "model.safetensors")
    code, out = _run(command, cwd=tmp_path, timeout=600)
    assert code == 0, out[-4000:]
    for step in ("transformer", "train", "evaluate"):
        assert f"Skipping '{step}'" not in out, step
    assert model.read_bytes() != trained
    assert json.loads((project / "metrics/ner_trf_summary.json").read_text())["agree"]


@pytest.mark.slow
def test_charlm_workflow_runs_offline_end_to_end(tmp_path):
    """Character LMs trained by `spacy lean train-charlm`, NER on their embeddings."""
    project = _copy_project(tmp_path / "project")
    tiny = {
        **TINY_VARS,
        "charlm_hidden_size": 32,
        "charlm_steps": 10,
        "charlm_bptt": 50,
        "charlm_batch_size": 4,
    }
    overrides = [arg for k, v in tiny.items() for arg in (f"--vars.{k}", str(v))]
    code, out = _run(
        ["-m", "spacy", "project", "run", "charlm", str(project), *overrides],
        cwd=tmp_path,
        timeout=900,
    )
    assert code == 0, out[-4000:]
    for direction in ("forward", "backward"):
        assert (project / f"training/charlm/{direction}/lm.pt").exists()
    config = Config().from_disk(project / "training/ner_charlm/model-best/config.cfg")
    charlm = config["components"]["ner"]["model"]["tok2vec"]["*"]["charlm"]
    assert charlm["@architectures"] == "spacy-lean.CharLMEmbed.v1"
    for name in ("ner_charlm_spacy_evaluate.json", "ner_charlm_lean_evaluate.json"):
        scores = json.loads((project / "metrics" / name).read_text())
        assert all(key in scores for key in SCORE_KEYS)
    assert json.loads((project / "metrics/ner_charlm_summary.json").read_text())["agree"]


# --- benchmarks: the command they record, their work folders ----------------------------

BENCHMARK_SCRIPTS = sorted(
    p
    for p in (ROOT / "benchmarks").glob("*.py")
    if not p.name.startswith("_") and p.name != "plot.py"
)


def _load_report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks/_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_command_line_is_the_command_as_run(tmp_path):
    """The recorded command is how the script was run: every argument (quoted where a
    shell needs it), `nice -n N` only when it ran at niceness N."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "from _report import command_line\n"
        "print(command_line(__file__))\n"
    )
    args = ["--batches", "3", "--work-dir", "/tmp/my work", "--configs", ""]
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, check=True
    ).stdout.strip()
    expected = "python benchmarks/probe.py --batches 3 --work-dir '/tmp/my work' --configs ''"
    base = os.nice(0)  # the niceness pytest runs at
    assert out == (f"nice -n {base} {expected}" if base else expected)
    if shutil.which("nice") and base + 5 <= 19:
        niced = subprocess.run(
            ["nice", "-n", "5", sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert niced == f"nice -n {base + 5} {expected}"
    report = _load_report()
    assert report.command_line("benchmarks/x.py", ["a b"], python="/v env/python").endswith(
        "'/v env/python' benchmarks/x.py 'a b'"
    )


def test_report_work_folder_is_removed_unless_named(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    report = _load_report()
    with report.work_folder(None, "bench_") as work:
        assert work.parent == tmp_path and work.name.startswith("bench_")
        (work / "model").mkdir()
        (work / "model" / "weights").write_bytes(b"x" * 1000)
    assert not work.exists()
    with pytest.raises(KeyboardInterrupt):
        with report.work_folder(None, "bench_") as work:
            (work / "data").write_text("x")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    named = tmp_path / "kept" / "work"
    with report.work_folder(named, "bench_") as work:
        (work / "model").write_text("x")
    assert work == named and (named / "model").exists()


@pytest.mark.parametrize("path", BENCHMARK_SCRIPTS, ids=lambda p: p.name)
def test_benchmark_records_its_command_and_removes_its_temporary_folders(path):
    """Each benchmark records the command it was run with through _report.command_line
    (not a hand-made string: one wrote `nice -n 10` when not run under nice, others left
    arguments out), and makes no temporary folder it leaves behind (tempfile.mkdtemp:
    gradient_noise.py left 27 MB in /tmp on every run)."""
    text = path.read_text(encoding="utf8")
    assert '"command": ' in text, f"{path.name} records no command"
    for match in re.finditer(r'"command": (.*)', text):
        assert "command_line(" in match.group(1) or match.group(1).strip() == "(", (
            path.name,
            match.group(0),
        )
    assert "command_line(__file__" in text
    assert "mkdtemp(" not in text, f"{path.name}: use _report.work_folder"


@pytest.mark.slow
def test_gradient_noise_records_its_command_and_leaves_no_folder(tmp_path):
    """The smallest real run: every argument recorded, nothing left in the temp dir."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out.json"
    args = ["--batches", "1", "--batch-tokens", "300", "--show", "2", "--output", str(out)]
    env = {**_env(), "TMPDIR": str(tmp)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gradient_noise.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    command = json.loads(out.read_text())["command"]
    assert command.endswith("python benchmarks/gradient_noise.py " + " ".join(args))
    assert list(tmp.iterdir()) == []


# --- benchmarks/plot.py ---------------------------------------------------------------


def _load_plot():
    spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "benchmarks" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SAMPLE_RESULTS = {
    "eval_memory": {
        "command": "python benchmarks/eval_memory.py --quick",
        "summary": {
            "per_size": [
                {
                    "size": n,
                    "stock_peak_rss_mb": 500 + n,
                    "streaming_peak_rss_mb": 480.0,
                    "stock_docs_per_s": 50.0,
                    "streaming_docs_per_s": 60.0,
                }
                for n in (25, 100, 400)
            ]
        },
    },
    "cleaner_memory": {
        "points": {
            mode: [{"n_docs": n, "peak_rss_growth_kb": n * k} for n in (25, 100, 400)]
            for mode, k in (("stock", 300), ("lean_cleaner", 20))
        }
    },
    "padding": {
        "size": 2000,
        "docs": {
            "items": 100,
            "mean_length": 40.0,
            "max_length": 700,
            "spacy_batch_by_padded_buffer256": {"batches": 30, "padding_fraction": 0.19},
            "lean_batch_by_tokens_default": {"batches": 25, "padding_fraction": 0.01},
            "ratio_padding_lean_vs_spacy": 0.06,
        },
    },
    "reader_memory": {
        "corpus_tokens": 1000,
        "results": {
            "spacy_listed": {
                "peak_mb": 100.0,
                "held_bytes_per_token": 500.0,
                "docs_per_second": 5.0,
            },
            "lean_streaming": {
                "peak_mb": 20.0,
                "held_bytes_per_token": 0.0,
                "docs_per_second": 6.0,
            },
        },
    },
    "charlm_loader_memory": {
        "text_mb": 10,
        "results": {
            "lean": {"peak_rss_mb": 10.0, "rss_after_epoch_mb": 9.0, "data_seconds": 1.0},
            "int64_tensor": {"peak_rss_mb": 160.0, "rss_after_epoch_mb": 80.0, "data_seconds": 2.0},
        },
    },
    "charlm_speed": {
        "results": [
            {
                "device": "cpu",
                "hidden_size": h,
                "threads": 1,
                "sides": {
                    "flair": {"tokens_per_s_median": 1000.0, "peak_rss_increase_mb_median": 90.0},
                    "ours": {"tokens_per_s_median": 3000.0, "peak_rss_increase_mb_median": 30.0},
                },
            }
            for h in (256, 1024)
        ]
    },
    "charlm_long_doc": {
        "results": [
            {
                "hidden_size": 64,
                "chars": 20000,
                "vector_mb": 2.0,
                "arms": {
                    "unchunked": {
                        "max_chunk_chars": None,
                        "seconds_median": 1.0,
                        "peak_rss_increase_mb_median": 40.0,
                    },
                    "chunked-64": {
                        "max_chunk_chars": 64,
                        "seconds_median": 1.1,
                        "peak_rss_increase_mb_median": 3.0,
                    },
                    "chunked-2048": {
                        "max_chunk_chars": 2048,
                        "seconds_median": 0.9,
                        "peak_rss_increase_mb_median": 10.0,
                    },
                },
            },
            {
                "hidden_size": 1024,
                "chars": 200000,
                "vector_mb": 270.0,
                "arms": {
                    "unchunked": {"max_chunk_chars": None, "error": "could not create a primitive"},
                    "chunked-2048": {
                        "max_chunk_chars": 2048,
                        "seconds_median": 90.0,
                        "peak_rss_increase_mb_median": 340.0,
                    },
                },
            },
        ]
    },
    # Not a known benchmark: drawn from its named groups of measurements.
    "someone_elses": {
        "settings": [
            {"whole": {"spacy_s": 2.0, "lean_s": 1.0}, "parts": {"spacy_s": 1.0, "lean_s": 0.5}}
        ]
    },
    # Nothing to draw.
    "notes": {"text": "no numbers here", "n": 3},
}


def test_plot_draws_every_known_benchmark_and_skips_what_it_cannot(tmp_path):
    plot = _load_plot()
    for name, data in SAMPLE_RESULTS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "broken.json").write_text("{not json")
    report = plot.main(str(tmp_path), str(tmp_path / "png"))
    drawn = {name for name in SAMPLE_RESULTS if name not in ("notes",)}
    assert set(report["plots"]) == {f"{name}.json" for name in drawn}
    assert set(report["skipped"]) == {"notes.json", "broken.json"}
    for png in report["plots"].values():
        assert (tmp_path / "png" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "png" / "plots.json").read_text()) == report


def test_plot_falls_back_when_a_known_benchmark_changes_format(tmp_path):
    plot = _load_plot()
    changed = {"results": {"a": {"peak_mb": 1.0}, "b": {"peak_mb": 2.0}}}
    (tmp_path / "eval_memory.json").write_text(json.dumps(changed))
    report = plot.main(str(tmp_path), str(tmp_path))
    assert list(report["plots"]) == ["eval_memory.json"]


def test_plot_draws_the_recorded_results(tmp_path):
    """Every results file the benchmarks have written in this repository is drawn."""
    recorded = [
        p
        for p in sorted((ROOT / "benchmarks" / "results").glob("*.json"))
        if p.name != "plots.json"
    ]
    if not recorded:
        pytest.skip("no recorded benchmark results")
    for path in recorded:
        shutil.copy(path, tmp_path / path.name)
    report = _load_plot().main(str(tmp_path), str(tmp_path))
    assert report["skipped"] == {}
    assert len(report["plots"]) == len(recorded)


def test_dedicated_plotters_draw_the_recorded_results_without_falling_back():
    """A dedicated plotter that breaks on its own benchmark's file would be hidden by the
    generic fallback; each is called directly on the recorded file."""
    plot = _load_plot()
    results = ROOT / "benchmarks" / "results"
    drawn = []
    for name, plotter in plot.PLOTTERS.items():
        path = results / f"{name}.json"
        if path.exists():
            fig = plotter(json.loads(path.read_text(encoding="utf8")))
            assert fig.axes
            plot.plt.close(fig)
            drawn.append(name)
    if not drawn:
        pytest.skip("no recorded results of a benchmark with its own plotter")
