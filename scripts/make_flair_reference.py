"""Regenerate the Flair parity fixtures in tests/data/charlm/.

Run it with a Python that has flair installed (flair is not a dependency of
spacy-lean; give it its own environment):

    python3 -m venv /work/flair-venv
    /work/flair-venv/bin/pip install torch==2.13.0 flair==0.15.1
    HF_HUB_OFFLINE=1 /work/flair-venv/bin/python scripts/make_flair_reference.py

What it does:
1. writes the test sentences (words + whitespace flags) to `sentences.json`;
2. builds random-weight forward/backward character LMs with spacy-lean's own `CharLM`
   and saves them with `CharLM.save` (so the files also test that Flair reads what we
   write): pair `h64` (1 layer, hidden 64, embedding 16) and pair `proj` (2 layers,
   hidden 32, embedding 16, `nout` 24);
3. loads each checkpoint in Flair as `FlairEmbeddings(path)` and saves the stacked
   (forward then backward) token vectors of all sentences as
   `ref_<pair>_<mode>.npy`, one row per token in sentence order, for the modes
   `default`, `nows` (`with_whitespace=False`), `lower` (`is_lower=True`) and
   `plain` (`tokenized_lm=False`). Each mode is also run with `chars_per_chunk=7`
   and must give the same vectors;
4. builds a small pair with Flair's own classes (`flairwritten-*.pt`, hidden 24) and
   saves its reference vectors, to check that files Flair writes load in spacy-lean.
spacy_lean is imported from this repository (only `spacy_lean.charlm.model`, which
needs torch and numpy, not spaCy).
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy  # noqa: E402
import torch  # noqa: E402

from spacy_lean.charlm.model import CharDictionary, CharLM  # noqa: E402

# (words, whitespace-after flags). Unicode, an unknown character (☃ is left out of the
# dictionary), punctuation without spaces, a long token, "İ" (lowercases to 2 chars),
# a one-token sentence, digits, an emoji.
SENTENCES = [
    ("Ada Lindqvist met with Northwind Analytics on Tuesday .", None),
    ("Prices rose slightly in the last quarter , according to officials .", None),
    ("Müller and Dvořák visited Kraków and São Paulo .", None),
    ("The snowman ☃ melted quickly !", None),
    ("İstanbul and İzmir are in Türkiye .", None),
    ("Hello", None),
    ("Call 555-0199 now , or e-mail info@example.org today !", None),
    (
        "See https://example.org/a/very/long/path/with/many/segments/and-a-query?x=1&y=2&z=three",
        None,
    ),
    ("東京 と 大阪 は 日本 の 都市 です 。", None),
    ("Nobody expected the meeting to last so long ...", None),
    ("Grace Abernathy wrote to the Harbor Council after a long delay .", None),
    ('"Quoted" words ( and brackets ) [ too ] { and braces } .', None),
    ("Great job 👍 team !", None),
    ("Pavel Ionescu joined Meridian Rail in Port Ambrel ahead of the Harvest Cup .", None),
    ("a", None),
    (
        "Supercalifragilisticexpialidocious antidisestablishmentarianism "
        "floccinaucinihilipilification",
        None,
    ),
    ("Tabs\tand odd ~ ^ | characters # % $ 42 3.14 .", None),
    ("Lower-case words only here", None),
    ("MIXED case WORDS and NUMBERS 2026 .", None),
    ("Final sentence , with a comma and a full stop .", None),
]
# Plain-text whitespace for the `plain` mode: no space before . , ! ? ) and after (.
_NO_SPACE_BEFORE = {".", ",", "!", "?", ")", "]", "}", "...", "。"}
_NO_SPACE_AFTER = {"(", "[", "{"}


def sentences():
    out = []
    for text, _ in SENTENCES:
        words = text.split(" ")
        spaces = []
        for i, w in enumerate(words):
            nxt = words[i + 1] if i + 1 < len(words) else None
            spaces.append(
                nxt is not None and nxt not in _NO_SPACE_BEFORE and w not in _NO_SPACE_AFTER
            )
        out.append({"words": words, "spaces": spaces})
    return out


PAIRS = {
    "h64": dict(hidden_size=64, nlayers=1, embedding_size=16, nout=None),
    "proj": dict(hidden_size=32, nlayers=2, embedding_size=16, nout=24),
}
MODES = {
    "default": dict(),
    "nows": dict(with_whitespace=False),
    "lower": dict(is_lower=True),
    "plain": dict(tokenized_lm=False),
}
PAIR_MODES = {"h64": ["default", "nows", "lower", "plain"], "proj": ["default", "nows"]}


def make_checkpoints(out_dir: Path, sents) -> None:
    texts = [" ".join(s["words"]) for s in sents]
    # Characters seen once stay out (unknown), and so does the snowman.
    dictionary = CharDictionary.from_texts([t.replace("☃", "") for t in texts], min_count=2)
    for name, settings in PAIRS.items():
        for seed, forward in ((1, True), (2, False)):
            torch.manual_seed(seed + (10 if name == "proj" else 0))
            lm = CharLM(dictionary, is_forward_lm=forward, dropout=0.1, **settings)
            with torch.no_grad():
                # Larger random weights than the default init so the states vary a lot.
                for param in lm.rnn.parameters():
                    param.uniform_(-0.5, 0.5)
            lm.save(out_dir / f"{name}-{'forward' if forward else 'backward'}.pt")


def flair_vectors(out_dir: Path, pair: str, mode: str, sents, chars_per_chunk: int):
    from flair.data import Sentence, Token
    from flair.embeddings import FlairEmbeddings, StackedEmbeddings

    embs = [
        FlairEmbeddings(
            str(out_dir / f"{pair}-{d}.pt"), chars_per_chunk=chars_per_chunk, **MODES[mode]
        )
        for d in ("forward", "backward")
    ]
    stacked = StackedEmbeddings(embs)
    flair_sents = [
        Sentence([Token(w, whitespace_after=int(sp)) for w, sp in zip(s["words"], s["spaces"])])
        for s in sents
    ]
    stacked.embed(flair_sents)
    return numpy.concatenate(
        [numpy.stack([t.get_embedding().detach().cpu().numpy() for t in s]) for s in flair_sents]
    ).astype(numpy.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "charlm")
    args = parser.parse_args()
    import flair

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    sents = sentences()
    (args.out / "sentences.json").write_text(
        json.dumps(sents, ensure_ascii=False, indent=1), encoding="utf-8"
    )
    make_checkpoints(args.out, sents)
    for pair, modes in PAIR_MODES.items():
        for mode in modes:
            ref = flair_vectors(args.out, pair, mode, sents, chars_per_chunk=512)
            chunked = flair_vectors(args.out, pair, mode, sents, chars_per_chunk=7)
            diff = float(numpy.abs(ref - chunked).max())
            assert diff <= 1e-5, (pair, mode, diff)
            numpy.save(args.out / f"ref_{pair}_{mode}.npy", ref)
            print(f"{pair}/{mode}: {ref.shape} (chars_per_chunk 7 vs 512: max diff {diff:.2e})")
    # A pair written by Flair itself (flair's own Dictionary and LanguageModel.save), to
    # check that spacy-lean reads real Flair files.
    from flair.data import Dictionary
    from flair.models import LanguageModel

    flair_dict = Dictionary(add_unk=True)
    for ch in "".join(" ".join(s["words"]) for s in sents):
        flair_dict.add_item(ch)
    for seed, forward in ((3, True), (4, False)):
        torch.manual_seed(seed)
        lm = LanguageModel(
            flair_dict,
            is_forward_lm=forward,
            hidden_size=24,
            nlayers=1,
            embedding_size=8,
            nout=None,
        )
        lm.save(args.out / f"flairwritten-{'forward' if forward else 'backward'}.pt")
    ref = flair_vectors(args.out, "flairwritten", "default", sents, chars_per_chunk=512)
    numpy.save(args.out / "ref_flairwritten_default.npy", ref)
    print(f"flairwritten/default: {ref.shape}")
    (args.out / "README.md").write_text(
        "Random-weight character LMs written by `spacy_lean.charlm.CharLM.save` (and\n"
        "`flairwritten-*.pt`, written by Flair's `LanguageModel.save`), and the\n"
        f"token vectors flair {flair.__version__} (torch {torch.__version__}) computes from\n"
        "them for `sentences.json`. Regenerate with `scripts/make_flair_reference.py`.\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    main()
