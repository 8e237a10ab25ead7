"""The built-in character tokenizer, tokenizer loading and response decoding."""

import pytest
from transformers import AutoTokenizer

from spmd_rl.model.tokenizer import build_char_tokenizer, decode_response, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_size_and_special_ids(tok):
    assert len(tok) <= 64
    assert (tok.pad_token, tok.pad_token_id) == ("<pad>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<eos>", 1)


def test_one_id_per_character(tok):
    ids = tok.encode("384=")
    assert len(ids) == 4
    assert tok.convert_ids_to_tokens(ids) == ["3", "8", "4", "="]
    assert len(set(tok.encode("0123456789"))) == 10


@pytest.mark.parametrize("text", [
    "Tom has 3 apples and buys 4 more. How many apples does Tom have?",
    "a . b , c\n#### 1,234 (x) 'y' \"z\" $5 50% 2*3/4-1+0=5; ok: yes!",
    "  leading and trailing spaces  ",
])
def test_decode_round_trips_plain_text(tok, text):
    ids = tok.encode(text)
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_unknown_characters_become_unk(tok):
    assert tok.encode("é") == [tok.unk_token_id]


def test_chat_template_renders_generation_prompt(tok):
    messages = [{"role": "user", "content": "384"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "384="
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == tok.encode("384=")
    multi = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1"},
             {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2"}]
    assert tok.apply_chat_template(multi, add_generation_prompt=True, tokenize=False) == "add\n1+1=2\n2+2="


def test_save_pretrained_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Sam has 12 pens. How many?"
    assert len(loaded) == len(tok)
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 1)
    messages = [{"role": "user", "content": "7"}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "7="


def test_load_tokenizer_specs(tmp_path):
    assert len(load_tokenizer("char", "")) <= 64
    build_char_tokenizer().save_pretrained(tmp_path / "model")
    assert load_tokenizer("", str(tmp_path / "model")).encode("12") == [4, 5]
    assert load_tokenizer(str(tmp_path / "model"), "ignored").encode("12") == [4, 5]
    with pytest.raises(ValueError, match="model.tokenizer"):
        load_tokenizer(str(tmp_path / "missing"), "")


def test_load_tokenizer_falls_back_to_eos_as_pad(tmp_path):
    tok = build_char_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path), "")
    assert loaded.pad_token == "<eos>"


def test_decode_response_drops_unknown_ids_and_specials(tok):
    ids = tok.encode("42") + [tok.eos_token_id, 63 + 1000, tok.pad_token_id, 64]
    assert decode_response(tok, ids) == "42"
    assert decode_response(tok, [500, 70000]) == ""


def test_stop_token_ids_are_printed_as_the_override(tok, capsys):
    """`python -m spmd_rl.model.tokenizer char ? 0 ... 9` gives the ids tests/e2e/test_multiturn_e2e.py's
    hidden-digit task stops at, each decoding to its text; a text of two tokens is refused."""
    from spmd_rl.model.tokenizer import main

    texts = ["?", *"0123456789"]
    assert main(["char", *texts]) == 0
    line = capsys.readouterr().out.strip()
    assert line == "rollout.stop_token_ids=[48,3,4,5,6,7,8,9,10,11,12]"
    ids = [int(i) for i in line.split("=[")[1].rstrip("]").split(",")]
    assert [tok.decode([i]) for i in ids] == texts
    assert main(["char", "?a"]) == 2
    assert "error: '?a' is 2 tokens [48, 13] of this tokenizer, not one" in capsys.readouterr().err
