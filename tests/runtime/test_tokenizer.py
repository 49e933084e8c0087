"""Incremental detokenisation: pieces never split a UTF-8 character and add up to the whole text."""
from uacompile.runtime.loader import load
from uacompile.runtime.tokenizer import IncrementalDecoder

from server_helpers import stories_path


def test_incremental_pieces_never_split_a_character_and_add_up():
    tok = load(stories_path()).tokenizer
    for text in ("Once upon a time, there was a café", "中文 and 日本語 😀 mixed", "  two  spaces", "é"):
        ids = tok.encode(text)
        multibyte = any(tok.types[i] == 6 for i in ids)  # characters outside the vocab: UTF-8 byte tokens
        for prompt_len in (1, 3):
            if prompt_len >= len(ids):
                continue
            dec = IncrementalDecoder(tok, ids[:prompt_len])
            pieces = [dec.add([t]) for t in ids[prompt_len:]]
            assert all("\ufffd" not in p for p in pieces)
            assert "".join(pieces) == dec.text == tok.decode_continuation(ids[:prompt_len], ids[prompt_len:])
            if multibyte:
                assert "" in pieces  # some byte tokens were held back until their character completed
