"""Token id -> the text a response shows for it (``logprobs`` entries), as ``tokenizer.decode([id])`` gives it.

Memoised per id, and `warm()` decodes the whole vocabulary once (the server runs it on a worker thread at start, a
fraction of a second for 150k ids), so building a response is a dictionary lookup per token rather than a decode
call per id not seen before. ``return_tokens_as_token_ids`` labels are vLLM's ``token_id:<id>``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, calling the Rust tokenizer straight where that is
    what ``decode`` does.

    A fast tokenizer's ``decode`` converts its argument (``to_py_obj``), checks for a batch, then calls the Rust
    ``decode`` and, with ``clean_up_tokenization_spaces``, cleans the text: 6.5 us a call for 4 ids, of which the
    Rust decode is 2 (SmolLM2's tokenizer, this CPU). A streamed choice decodes twice per token on the event loop
    (`stream_text`): the largest item of the loop's chunk building in a streamed c=64 wave (cProfile,
    `benchmarks/serving_intake.py --profile`). The Rust call is used only where it is the same function: a
    `TokenizersBackend` whose ``decode`` and ``_decode`` are the library's own and that does not clean up spaces; any
    other tokenizer keeps its ``decode``."""
    decode = _DECODERS.get(tokenizer)
    if decode is None:
        # the cached value must not refer to the tokenizer (its key): the direct call holds the Rust object only
        decode = _DECODERS[tokenizer] = _direct(tokenizer) or False
    return decode or (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def _direct(tokenizer) -> Callable[[list[int]], str] | None:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode
        return None
    kind = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend) and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces):
        return None
    rust = tokenizer._tokenizer
    return lambda ids: rust.decode(ids, skip_special_tokens=True)


class TokenText:
    """Token id -> its text and its UTF-8 bytes (as the list of ints the chat format shows), memoised."""

    def __init__(self, tokenizer, vocab: int | None = None):
        self.tokenizer = tokenizer
        self.vocab = vocab if vocab is not None else len(tokenizer)
        self._text: dict[int, str] = {}
        self._entry: dict[tuple[int, bool], tuple[str, list[int]]] = {}

    def warm(self) -> None:
        """Decode every id of the vocabulary now."""
        for token in range(self.vocab):
            self.text(token)

    def text(self, token: int) -> str:
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = self.tokenizer.decode([token])
        return text

    def label(self, token: int, as_ids: bool) -> str:
        """What a logprobs entry names the token by: its text, or ``token_id:<id>``."""
        return f"token_id:{token}" if as_ids else self.text(token)

    def entry(self, token: int, as_ids: bool) -> tuple[str, list[int]]:
        """(label, its UTF-8 bytes as ints), shared between responses: never mutate them."""
        key = (token, as_ids)
        entry = self._entry.get(key)
        if entry is None:
            label = self.label(token, as_ids)
            entry = self._entry[key] = (label, list(label.encode("utf-8")))
        return entry
