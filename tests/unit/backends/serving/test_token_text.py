"""token_text.text_decoder: the Rust tokenizer called straight gives what ``decode(ids, skip_special_tokens=True)``
gives, and a tokenizer whose decode is its own keeps it."""

from __future__ import annotations

import copy
import random

from backends.serving import token_text
from backends.serving.token_text import text_decoder


def test_the_direct_decoder_is_the_tokenizers_decode(tiny_hf):
    _, tok = tiny_hf
    decode = text_decoder(tok)
    assert token_text._direct(tok) is not None and text_decoder(tok) is decode  # one per tokenizer, cached
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(2000):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randrange(6))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)
    text = "Grüße, 世界! 🎉 naïve"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_or_decodes_its_own_way_keeps_its_decode(tiny_hf):
    _, tok = tiny_hf
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert token_text._direct(cleaning) is None

    class Own(type(tok)):
        def decode(self, ids, skip_special_tokens=False, **kwargs):
            return "own"

    own = copy.deepcopy(tok)
    own.__class__ = Own
    assert token_text._direct(own) is None and text_decoder(own)([1, 2]) == "own"
