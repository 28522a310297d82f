"""Generated data and tiny local transformers, for tests, benchmarks and the project.

Nothing here downloads anything: the NER corpus is generated from small word lists
written for this package, and the transformer is a randomly initialised BERT with a
WordPiece vocabulary trained on the generated text.
"""

import random
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from spacy.language import Language
from spacy.tokens import Doc, DocBin, Span

# Word lists written for spacy-lean. Entities are multi-token where it is natural.
_PERSONS = [
    "Ada Lindqvist",
    "Tomas Okafor",
    "Mira Sandoval",
    "Jun Hartmann",
    "Leila Moreau",
    "Pavel Ionescu",
    "Grace Abernathy",
    "Oskar Venn",
    "Nadia Kowal",
    "Elio Brandt",
    "Hana Duarte",
    "Ravi Menon",
    "Ines Calloway",
    "Bram Oduya",
    "Sofia Tarrant",
]
_ORGS = [
    "Northwind Analytics",
    "Bluefield Bank",
    "the Harbor Council",
    "Quillon Labs",
    "Meridian Rail",
    "Ostrava Steelworks",
    "Copperleaf Media",
    "Lumen Health",
    "the Fenwick Trust",
    "Arcadia Motors",
    "Tallis University",
    "Greyhaven Press",
]
_LOCS = [
    "Veldmark",
    "Port Ambrel",
    "the Sorrel Valley",
    "Kestrel Bay",
    "Lower Hesk",
    "Marrow Hill",
    "Caldera City",
    "the Isle of Wren",
    "Dunmore",
    "New Halvard",
    "Eastbridge",
    "the Tamsin Coast",
]
_MISC = [
    "Harvest Cup",
    "Solace Prize",
    "Brightline Act",
    "Winter Accord",
    "Pell Festival",
    "Orbis Summit",
]
_SUBJ_VERBS = [
    "met with",
    "criticised",
    "praised",
    "visited",
    "wrote to",
    "signed a deal with",
    "spoke about",
    "joined",
    "left",
    "announced a partnership with",
]
_FILLERS = [
    "on Tuesday",
    "after a long delay",
    "according to officials",
    "in a short statement",
    "for the second time this year",
    "despite strong objections",
    "late last night",
    "during the morning session",
    "without further comment",
    "as expected",
]
_PLAIN = [
    "The weather stayed mild for most of the week .",
    "Prices rose slightly in the last quarter .",
    "Nobody expected the meeting to last so long .",
    "The report will be published next month .",
    "Several questions remain open .",
    "Traffic was heavy on the main roads .",
]

LABELS = ("PERSON", "ORG", "LOC", "MISC")


def _entity(rng: random.Random) -> Tuple[str, str]:
    label = rng.choice(LABELS)
    pool = {"PERSON": _PERSONS, "ORG": _ORGS, "LOC": _LOCS, "MISC": _MISC}[label]
    return rng.choice(pool), label


def _sentence(rng: random.Random) -> List[Tuple[str, Optional[str]]]:
    """One sentence as (chunk, label-or-None) pieces; chunks are space-separated words."""
    kind = rng.random()
    if kind < 0.15:
        return [(rng.choice(_PLAIN), None)]
    a_text, a_label = _entity(rng)
    b_text, b_label = _entity(rng)
    pieces: List[Tuple[str, Optional[str]]] = [(a_text, a_label), (rng.choice(_SUBJ_VERBS), None)]
    pieces.append((b_text, b_label))
    if rng.random() < 0.5:
        where_text, _ = rng.choice(_LOCS), "LOC"
        pieces.append(("in", None))
        pieces.append((where_text, "LOC"))
    if rng.random() < 0.6:
        pieces.append((rng.choice(_FILLERS), None))
    if rng.random() < 0.3:
        pieces.append(("ahead of the", None))
        pieces.append((rng.choice(_MISC), "MISC"))
    pieces.append((".", None))
    return pieces


def _num_sentences(rng: random.Random, long_doc_rate: float) -> int:
    """A long-tailed number of sentences: mostly short docs, a few very long ones."""
    if rng.random() < long_doc_rate:
        return rng.randint(20, 60)
    return min(1 + int(rng.expovariate(1 / 2.5)), 15)


def make_ner_doc(nlp: Language, rng: random.Random, long_doc_rate: float = 0.03) -> Doc:
    """Generate one multi-sentence doc with entities and sentence boundaries."""
    words: List[str] = []
    sent_starts: List[bool] = []
    ents: List[Tuple[int, int, str]] = []
    for _ in range(_num_sentences(rng, long_doc_rate)):
        first = True
        for chunk, label in _sentence(rng):
            toks = chunk.split(" ")
            start = len(words)
            words.extend(toks)
            sent_starts.extend([first] + [False] * (len(toks) - 1))
            first = False
            if label is not None:
                ents.append((start, len(words), label))
    spaces = [True] * len(words)
    for i in range(len(words) - 1):
        if words[i + 1] == ".":
            spaces[i] = False
    spaces[-1] = False
    doc = Doc(nlp.vocab, words=words, spaces=spaces, sent_starts=sent_starts)
    doc.ents = [Span(doc, s, e, label=lab) for s, e, lab in ents]
    return doc


def make_ner_docs(
    nlp: Language, n_docs: int, seed: int = 0, long_doc_rate: float = 0.03
) -> List[Doc]:
    """Generate `n_docs` annotated NER docs, deterministically from `seed`.

    nlp (Language): supplies the vocab.
    n_docs (int): how many docs.
    seed (int): random seed.
    long_doc_rate (float): share of very long (20-60 sentence) documents.
    RETURNS (List[Doc]): docs with `ents` and sentence starts set.
    """
    rng = random.Random(seed)
    return [make_ner_doc(nlp, rng, long_doc_rate) for _ in range(n_docs)]


def write_ner_corpus(
    path: Union[str, Path],
    n_docs: int,
    seed: int = 0,
    lang: str = "en",
    long_doc_rate: float = 0.03,
) -> Path:
    """Write a generated NER corpus as a .spacy file and return its path."""
    import spacy

    nlp = spacy.blank(lang)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    DocBin(docs=make_ner_docs(nlp, n_docs, seed, long_doc_rate), store_user_data=True).to_disk(path)
    return path


def generated_sentences(n: int, seed: int = 0) -> Iterator[str]:
    """Plain generated sentences (for tokenizer and LM training)."""
    rng = random.Random(seed)
    for _ in range(n):
        yield " ".join(chunk for chunk, _ in _sentence(rng))


def make_tiny_transformer(
    path: Union[str, Path],
    texts: Optional[Iterable[str]] = None,
    *,
    vocab_size: int = 400,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 512,
    seed: int = 0,
    special_tokens: bool = True,
) -> Path:
    """Train a WordPiece tokenizer and save a randomly initialised BERT to `path`.

    The folder is loadable with `name = "<path>"` in spacy-transformers' configs and
    with `transformers.AutoModel.from_pretrained(path)`, with no network.
    special_tokens (bool): wrap every text in [CLS] ... [SEP], as BERT's own tokenizers
        do (so a text of only whitespace still has two wordpieces); False for a
        tokenizer that adds nothing, which gives such a text none.
    RETURNS (Path): the folder.
    """
    import torch
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if texts is None:
        texts = generated_sentences(600, seed=seed)
    texts = list(texts)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if special_tokens:
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
        )
    tok_file = path / "tokenizer.json"
    tok.save(str(tok_file))
    fast = BertTokenizerFast(
        tokenizer_file=str(tok_file), do_lower_case=False, model_max_length=max_position_embeddings
    )
    fast.save_pretrained(str(path))
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    BertModel(config).save_pretrained(str(path))
    return path


TRF_NER_CONFIG = """
[paths]
train = null
dev = null
transformer = null

[system]
gpu_allocator = null
seed = 0

[nlp]
lang = "en"
pipeline = ["transformer","ner"]
batch_size = 32

[components]

[components.transformer]
factory = "transformer"
max_batch_items = 4096

[components.transformer.model]
@architectures = "spacy-transformers.TransformerModel.v3"
name = ${paths.transformer}
mixed_precision = false

[components.transformer.model.get_spans]
@span_getters = "spacy-transformers.strided_spans.v1"
window = 64
stride = 48

[components.transformer.model.tokenizer_config]
use_fast = true

[components.ner]
factory = "ner"

[components.ner.model]
@architectures = "spacy.TransitionBasedParser.v2"
state_type = "ner"
extra_state_tokens = false
hidden_width = 32
maxout_pieces = 2
use_upper = false
nO = null

[components.ner.model.tok2vec]
@architectures = "spacy-transformers.TransformerListener.v1"
grad_factor = 1.0
upstream = "*"

[components.ner.model.tok2vec.pooling]
@layers = "reduce_mean.v1"

[corpora]

[corpora.train]
@readers = "spacy.Corpus.v1"
path = ${paths.train}

[corpora.dev]
@readers = "spacy.Corpus.v1"
path = ${paths.dev}

[training]
seed = ${system.seed}
dropout = 0.1
max_epochs = 0
max_steps = 20
eval_frequency = 10
patience = 0

[training.batcher]
@batchers = "spacy.batch_by_words.v1"
size = 500
discard_oversize = false
tolerance = 0.2

[training.optimizer]
@optimizers = "Adam.v1"
learn_rate = 0.001
"""


def build_trf_ner_pipeline(
    transformer_path: Union[str, Path],
    train_docs: Optional[Sequence[Doc]] = None,
    n_steps: int = 0,
    seed: int = 0,
) -> Language:
    """Build (and optionally briefly train) a transformer + ner pipeline in memory.

    transformer_path (Path): a folder made by `make_tiny_transformer`.
    train_docs (Sequence[Doc]): gold docs; when given, the pipeline is initialised on them.
    n_steps (int): number of `nlp.update` steps over `train_docs`.
    RETURNS (Language): the pipeline.
    """
    import spacy
    from spacy.training import Example
    from spacy.util import fix_random_seed
    from thinc.api import Config

    fix_random_seed(seed)
    config = Config().from_str(
        TRF_NER_CONFIG, overrides={"paths.transformer": str(transformer_path)}
    )
    nlp = spacy.util.load_model_from_config(config, auto_fill=True, validate=True)
    if train_docs is None:
        train_docs = make_ner_docs(nlp, 40, seed=seed)
    examples = [Example(nlp.make_doc(d.text), d) for d in train_docs]
    optimizer = nlp.initialize(lambda: examples)
    for step in range(n_steps):
        batch = examples[(step * 8) % len(examples) :][:8] or examples[:8]
        nlp.update(batch, sgd=optimizer)
    return nlp
