import pytest
import torch

from glm_lightning.tokenizer import ByteTokenizer

tok = ByteTokenizer()


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x + 1\n", "héllo wörld", "数字 7 ✓", "emoji 🐍🔥", "\x00\xff"])
def test_round_trip(text):
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_specials_distinct_and_outside_bytes():
    specials = tok.special_ids
    assert set(specials) == {"pad", "bos", "eos", "image_start", "image", "image_end"}
    assert len(set(specials.values())) == len(specials)
    assert min(specials.values()) == 256 and tok.vocab_size == 256 + len(specials)
    assert specials["eos"] == tok.eos_id and specials["image"] == tok.image_id


def test_decode_stops_at_eos_and_never_raises():
    ids = tok.encode("ab") + [tok.eos_id] + tok.encode("cd")
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, stop_at_eos=False) == "abcd"
    assert tok.decode([0xFF, 0xFE, ord("a")]).endswith("a")  # invalid UTF-8 is replaced
    assert tok.decode(torch.tensor([104, 105, tok.pad_id])) == "hi"


def test_encode_batch_left_pads():
    ids, valid = tok.encode_batch(["a", "abc"])
    assert ids.shape == (2, 4) and valid.dtype == torch.bool and valid.sum(1).tolist() == [2, 4]
    assert ids[0, :2].tolist() == [tok.pad_id, tok.pad_id] and ids[0, 2].item() == tok.bos_id
    assert valid[0].tolist() == [False, False, True, True] and valid[1].all()


def test_encode_rejects_non_str():
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
