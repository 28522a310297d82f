"""`spacy lean shard`: .spacy and .jsonl in, .spacy shards out, nothing lost."""

import spacy
import srsly
from spacy.cli._util import app
from spacy.tokens import DocBin
from typer.testing import CliRunner

import spacy_lean.cli  # noqa: F401  (adds `lean` to spaCy's CLI app)
from spacy_lean import synthetic
from spacy_lean.corpus import LeanCorpus
from spacy_lean.corpus.jsonl import doc_to_record
from spacy_lean.corpus.shards import write_shards

runner = CliRunner()


def flat(result):
    """The command's output with wasabi's line wrapping undone."""
    return " ".join(result.output.split())


def docs_of(path, nlp):
    return [eg.reference for eg in LeanCorpus(path)(nlp)]


def summary(docs):
    return [
        (d.text, [(e.start, e.end, e.label_) for e in d.ents], [t.is_sent_start for t in d])
        for d in docs
    ]


def test_shard_spacy_input(tmp_path):
    nlp = spacy.blank("en")
    synthetic.write_ner_corpus(tmp_path / "in" / "a.spacy", 23, seed=1)
    synthetic.write_ner_corpus(tmp_path / "in" / "b.spacy", 9, seed=2)
    result = runner.invoke(
        app,
        ["lean", "shard", str(tmp_path / "in"), str(tmp_path / "out"), "--docs-per-shard", "10"],
    )
    assert result.exit_code == 0, result.output
    assert "Wrote 4 shards" in result.output
    shards = sorted((tmp_path / "out").glob("*.spacy"))
    assert [len(DocBin().from_disk(s)) for s in shards] == [10, 10, 10, 2]
    assert summary(docs_of(tmp_path / "out", nlp)) == summary(docs_of(tmp_path / "in", nlp))


def test_shard_jsonl_input(tmp_path):
    nlp = spacy.blank("en")
    docs = synthetic.make_ner_docs(nlp, 15, seed=3)
    records = [doc_to_record(d) for d in docs]
    for r in records:
        del r["tokens"]  # tokenized by the --lang tokenizer
        r["cats"] = {"NEWS": 1.0}
    srsly.write_jsonl(tmp_path / "in.jsonl", records)
    written = write_shards(tmp_path / "in.jsonl", tmp_path / "out", 4, lang="en")
    assert len(written) == 4
    got = docs_of(tmp_path / "out", nlp)
    assert [d.text for d in got] == [d.text for d in docs]
    assert [[e.text for e in d.ents] for d in got] == [[e.text for e in d.ents] for d in docs]
    assert all(d.cats == {"NEWS": 1.0} for d in got)


def test_shard_errors(tmp_path):
    result = runner.invoke(app, ["lean", "shard", str(tmp_path / "missing"), str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "not found" in flat(result) and "missing" in flat(result)
    synthetic.write_ner_corpus(tmp_path / "a.spacy", 3, seed=1)
    assert (
        runner.invoke(
            app, ["lean", "shard", str(tmp_path / "a.spacy"), str(tmp_path / "o")]
        ).exit_code
        == 0
    )
    again = runner.invoke(app, ["lean", "shard", str(tmp_path / "a.spacy"), str(tmp_path / "o")])
    assert again.exit_code == 1 and "already holds shards" in flat(again)
    bad = runner.invoke(
        app, ["lean", "shard", str(tmp_path / "a.spacy"), str(tmp_path / "p"), "-n", "0"]
    )
    assert bad.exit_code == 1 and "docs_per_shard must be >= 1, got 0" in flat(bad)


def test_shard_lang_is_checked_for_jsonl_and_not_needed_for_spacy(tmp_path):
    """--lang names the tokenizer of .jsonl input: an unknown one is a one-line error
    (it was spaCy's ImportError traceback) that leaves no output folder; .spacy input
    needs no tokenizer, so the option does not stop it."""
    srsly.write_jsonl(tmp_path / "a.jsonl", [{"text": "Ada met Bo."}])
    bad = runner.invoke(
        app, ["lean", "shard", str(tmp_path / "a.jsonl"), str(tmp_path / "o"), "--lang", "zz"]
    )
    assert bad.exit_code == 1 and "lang = 'zz': spaCy has no such language" in flat(bad)
    assert bad.exception is None or isinstance(bad.exception, SystemExit)
    assert not (tmp_path / "o").exists()
    synthetic.write_ner_corpus(tmp_path / "b.spacy", 3, seed=1)
    args = ["lean", "shard", str(tmp_path / "b.spacy"), str(tmp_path / "p"), "--lang", "zz"]
    assert runner.invoke(app, args).exit_code == 0
    nlp = spacy.blank("en")
    assert summary(docs_of(tmp_path / "p", nlp)) == summary(docs_of(tmp_path / "b.spacy", nlp))


def test_shard_truncated_file_fails_naming_it(tmp_path):
    """A truncated .spacy input stops the command with the file named, before any
    shard is written (the reader checks the whole file when it opens it)."""
    path = synthetic.write_ner_corpus(tmp_path / "big.spacy", 40, seed=4)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4])
    result = runner.invoke(app, ["lean", "shard", str(path), str(tmp_path / "out"), "-n", "10"])
    assert result.exit_code == 1
    assert "big.spacy" in flat(result) and "truncated" in flat(result)
    assert not list((tmp_path / "out").glob("*.spacy"))


def test_shard_keeps_every_messy_doc(tmp_path):
    """Empty and whitespace-only docs, an empty shard, missing ("-") and unset entity
    annotation, overlapping spans, cats and non-ASCII text: every stored doc (the empty
    one included) comes out of `spacy lean shard`, in order, with all of it."""
    from messy_data import make_messy_docs, signature

    nlp = spacy.blank("en")
    docs = make_messy_docs(nlp)
    (tmp_path / "in").mkdir()
    DocBin(docs=docs[:5], store_user_data=True).to_disk(tmp_path / "in" / "a.spacy")
    DocBin().to_disk(tmp_path / "in" / "b.spacy")  # no docs
    DocBin(docs=docs[5:], store_user_data=True).to_disk(tmp_path / "in" / "c.spacy")
    result = runner.invoke(
        app, ["lean", "shard", str(tmp_path / "in"), str(tmp_path / "out"), "-n", "3"]
    )
    assert result.exit_code == 0, result.output
    shards = sorted((tmp_path / "out").glob("*.spacy"))
    got = [d for s in shards for d in DocBin().from_disk(s).get_docs(nlp.vocab)]
    assert [signature(d) for d in got] == [signature(d) for d in docs]


def test_shard_a_corrupt_input_leaves_no_partial_shards(tmp_path):
    """A truncated file (or a bad .jsonl line) after some docs were sharded left the
    shards written so far: a corpus that looked whole, and a folder the rerun refused
    ("already holds shards"). They are removed, and the message says so."""
    synthetic.write_ner_corpus(tmp_path / "in" / "a.spacy", 5, seed=1)
    good = (tmp_path / "in" / "a.spacy").read_bytes()
    (tmp_path / "in" / "b.spacy").write_bytes(good[: len(good) // 2])
    out = tmp_path / "new" / "out"
    result = runner.invoke(app, ["lean", "shard", str(tmp_path / "in"), str(out), "-n", "2"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    text = flat(result)
    assert "b.spacy" in text and "truncated" in text and "Nothing was written" in text
    assert not out.exists()  # made by the command, removed with its shards
    (tmp_path / "in" / "b.spacy").unlink()
    result = runner.invoke(app, ["lean", "shard", str(tmp_path / "in"), str(out), "-n", "2"])
    assert result.exit_code == 0, result.output

    srsly.write_jsonl(tmp_path / "bad.jsonl", [{"text": "a b"}] * 3)
    with (tmp_path / "bad.jsonl").open("a") as f:
        f.write('{"text": "broken\n')
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("kept")
    result = runner.invoke(
        app, ["lean", "shard", str(tmp_path / "bad.jsonl"), str(existing), "-n", "1"]
    )
    assert result.exit_code == 1 and "bad.jsonl:4" in flat(result)
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]


def test_shard_an_empty_or_mixed_input_leaves_nothing_and_says_what_to_do(tmp_path):
    """A .spacy file of 0 docs left an empty output folder; a folder of both kinds
    pointed at the reader's file_format setting, which this command does not have."""
    DocBin().to_disk(tmp_path / "empty.spacy")
    result = runner.invoke(
        app, ["lean", "shard", str(tmp_path / "empty.spacy"), str(tmp_path / "o")]
    )
    assert result.exit_code == 0 and "nothing written" in flat(result)
    assert not (tmp_path / "o").exists()
    mixed = tmp_path / "mixed"
    synthetic.write_ner_corpus(mixed / "a.spacy", 2, seed=1)
    srsly.write_jsonl(mixed / "b.jsonl", [{"text": "x"}])
    result = runner.invoke(app, ["lean", "shard", str(mixed), str(tmp_path / "p")])
    assert result.exit_code == 1 and "file_format" not in flat(result)
    assert "holds both .spacy and .jsonl files: give the path of one file" in flat(result)
    assert not (tmp_path / "p").exists()
