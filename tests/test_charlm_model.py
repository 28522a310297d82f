"""The character LM, its dictionary, and the Flair checkpoint format."""

import pickletools
import zipfile
from pathlib import Path

import numpy
import pytest
import torch

from spacy_lean.charlm import CharDictionary, CharLM
from spacy_lean.charlm import flair_format, safe_torch

DATA = Path(__file__).parent / "data" / "charlm"


@pytest.fixture
def dictionary():
    return CharDictionary.from_texts(["hello world", "hold the line!"])


def _lm(dictionary, **kwargs):
    torch.manual_seed(0)
    settings = dict(is_forward_lm=True, hidden_size=12, nlayers=1, embedding_size=6)
    settings.update(kwargs)
    return CharLM(dictionary, **settings).eval()


def _pickle_globals(path) -> set:
    """The (module, name) pairs a torch zip checkpoint's pickle refers to."""
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        data = zf.read(name)
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
    return found


def test_dictionary_from_texts_order_and_unk():
    d = CharDictionary.from_texts(["aab", "ba c"])
    assert d.idx2item[0] == "<unk>"
    # most frequent first; ties keep first-seen order
    assert d.idx2item[1:] == ["a", "b", " ", "c"]
    assert d.item2idx["b"] == 2
    assert len(d) == 5


def test_dictionary_min_count():
    d = CharDictionary.from_texts(["aab"], min_count=2)
    assert d.idx2item == ["<unk>", "a"]
    with pytest.raises(ValueError, match="min_count must be >= 1"):
        CharDictionary.from_texts(["a"], min_count=0)


def test_dictionary_unknown_maps_to_zero(dictionary):
    assert dictionary.get_idx("☃") == 0
    assert dictionary.get_idx("<unk>") == 0
    assert dictionary.get_idx("h") != 0


@pytest.mark.parametrize("text", ["hello world", "", "☃ hé 👍 𝔘 l", "x" * 300 + "!"])
def test_encode_matches_per_character_lookup(dictionary, text):
    expected = [dictionary.get_idx(ch) for ch in text]
    assert dictionary.encode(text) == expected
    arr = dictionary.encode_array(text)
    assert arr.dtype == numpy.int64 and arr.tolist() == expected


def test_dictionary_with_astral_item_encodes_it():
    d = CharDictionary(["<unk>", "👍", "a"])
    assert d.encode("a👍b") == [2, 1, 0]


def test_forward_is_time_major_with_logits(dictionary):
    lm = _lm(dictionary)
    ids = torch.tensor([dictionary.encode("hello"), dictionary.encode("world")]).T  # [5, 2]
    logits, output, hidden = lm(ids, lm.init_hidden(2))
    assert logits.shape == (5, 2, len(dictionary))
    assert output.shape == (5, 2, 12)
    assert [h.shape for h in hidden] == [(1, 2, 12), (1, 2, 12)]
    no_logits, same, _ = lm(ids, decode=False)
    assert no_logits is None
    assert torch.equal(same, output)


def test_projection_and_no_decoder(dictionary):
    lm = _lm(dictionary, nout=5, has_decoder=False, nlayers=2)
    assert lm.output_size == 5 and not lm.has_decoder
    logits, output, hidden = lm(torch.zeros((3, 4), dtype=torch.long))
    assert logits is None and output.shape == (3, 4, 5) and hidden[0].shape == (2, 4, 12)
    assert "proj.weight" in lm.state_dict() and "decoder.weight" not in lm.state_dict()


def test_gru_variant(dictionary):
    lm = _lm(dictionary, recurrent_type="gru")
    assert len(lm.init_hidden(3)) == 1
    _, output, hidden = lm(torch.zeros((2, 3), dtype=torch.long))
    assert output.shape == (2, 3, 12) and len(hidden) == 1


def test_bad_settings_raise(dictionary):
    with pytest.raises(ValueError, match="recurrent_type must be one of"):
        CharLM(dictionary, True, 8, recurrent_type="transformer")
    with pytest.raises(ValueError, match="must be >= 1"):
        CharLM(dictionary, True, 0)
    with pytest.raises(ValueError, match="dictionary is empty"):
        CharLM(CharDictionary(), True, 8)


def test_state_dict_keys_are_flairs(dictionary):
    lm = _lm(dictionary, nout=4)
    assert set(lm.state_dict()) == {
        "encoder.weight",
        "rnn.weight_ih_l0",
        "rnn.weight_hh_l0",
        "rnn.bias_ih_l0",
        "rnn.bias_hh_l0",
        "proj.weight",
        "proj.bias",
        "decoder.weight",
        "decoder.bias",
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"nout": 5, "nlayers": 2},
        {"recurrent_type": "gru"},
        {"is_forward_lm": False, "document_delimiter": "\t"},
    ],
)
def test_save_load_round_trip(tmp_path, dictionary, kwargs):
    lm = _lm(dictionary, **kwargs)
    path = tmp_path / "lm.pt"
    lm.save(path)
    loaded = CharLM.load(path)
    assert loaded.settings() == lm.settings()
    assert loaded.dictionary == lm.dictionary
    for key, value in lm.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    ids = torch.tensor(dictionary.encode("hold the world")).unsqueeze(1)
    assert torch.equal(loaded(ids)[1], lm(ids)[1])
    from_bytes = CharLM.from_bytes(lm.to_bytes())
    assert torch.equal(from_bytes(ids)[1], lm(ids)[1])


def test_load_without_decoder(tmp_path, dictionary):
    lm = _lm(dictionary)
    lm.save(tmp_path / "lm.pt")
    loaded = CharLM.load(tmp_path / "lm.pt", has_decoder=False)
    assert loaded.decoder is None
    assert loaded.settings()["has_decoder"] is False


def test_saved_file_names_only_flair_globals(tmp_path, dictionary):
    """The pickle is what Flair writes: a plain dict, tensors, flair.data.Dictionary."""
    _lm(dictionary).save(tmp_path / "lm.pt")
    found = _pickle_globals(tmp_path / "lm.pt")
    assert ("flair.data", "Dictionary") in found
    assert not any(module.startswith("spacy_lean") for module, _ in found)
    checkpoint = flair_format.load_checkpoint(tmp_path / "lm.pt")
    items = checkpoint["dictionary"].idx2item
    assert all(isinstance(item, bytes) for item in items)  # Flair stores UTF-8 bytes
    assert items[0] == b"<unk>" and checkpoint["dictionary"].add_unk is True


def test_reads_a_checkpoint_written_by_flair():
    """flairwritten-*.pt were written by flair 0.15.1's LanguageModel.save."""
    found = _pickle_globals(DATA / "flairwritten-forward.pt")
    assert ("flair.data", "Dictionary") in found
    lm = CharLM.load(DATA / "flairwritten-forward.pt")
    assert lm.is_forward_lm and lm.hidden_size == 24 and lm.embedding_size == 8
    assert lm.dictionary.idx2item[0] == "<unk>" and "ü" in lm.dictionary


def test_old_flair_checkpoint_without_newer_keys(tmp_path, dictionary):
    """Files from old Flair versions lack document_delimiter, recurrent_type,
    has_decoder and dropout-era keys; the dictionary has no add_unk attribute."""
    lm = _lm(dictionary)
    checkpoint = lm.to_checkpoint()
    for key in ("document_delimiter", "recurrent_type", "has_decoder"):
        del checkpoint[key]
    del checkpoint["dictionary"].__dict__["add_unk"]
    path = tmp_path / "old.pt"
    # The pre-1.6 torch container, as old Flair models were saved.
    torch.save(
        checkpoint,
        str(path),
        pickle_module=flair_format._flair_pickle_module,
        _use_new_zipfile_serialization=False,
    )
    loaded = CharLM.load(path)
    assert loaded.document_delimiter == "\n" and loaded.recurrent_type == "lstm"
    ids = torch.tensor(dictionary.encode("hello")).unsqueeze(1)
    assert torch.equal(loaded(ids)[1], lm(ids)[1])


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_refuses_unexpected_globals(tmp_path, dictionary):
    path = tmp_path / "evil.pt"
    checkpoint = _lm(dictionary).to_checkpoint()
    checkpoint["payload"] = _Evil()
    torch.save(
        checkpoint, str(path), pickle_module=flair_format._flair_pickle_module, pickle_protocol=4
    )
    with pytest.raises(ValueError, match="builtins.print"):
        CharLM.load(path)


def test_not_a_language_model(tmp_path):
    torch.save({"weights": torch.zeros(2)}, str(tmp_path / "x.pt"))
    with pytest.raises(ValueError, match="missing keys"):
        CharLM.load(tmp_path / "x.pt")
    torch.save([1, 2], str(tmp_path / "y.pt"))
    with pytest.raises(ValueError, match="got list"):
        CharLM.load(tmp_path / "y.pt")
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        CharLM.load(tmp_path / "nowhere.pt")
    # A training output folder, not the checkpoint in it: say so, and name the file.
    with pytest.raises(IsADirectoryError, match=r"is a folder \(it holds x.pt, y.pt\)"):
        CharLM.load(tmp_path)


def test_pickled_dictionary_round_trips_through_plain_pickle(dictionary):
    """The stand-in class pickles as flair.data.Dictionary and reads back through
    the restricted unpickler."""
    data = flair_format.checkpoint_to_bytes({"dictionary": dictionary.to_flair_state()})
    assert b"flair.data" in data and b"Dictionary" in data
    loaded = safe_torch.load(data, flair_format._FLAIR_GLOBALS, what="a dictionary")
    assert CharDictionary.from_flair_state(loaded["dictionary"]) == dictionary
    evil = flair_format.checkpoint_to_bytes({"dictionary": _Evil()})
    with pytest.raises(safe_torch.CheckpointError, match="builtins.print"):
        safe_torch.load(evil, flair_format._FLAIR_GLOBALS, what="a dictionary")
