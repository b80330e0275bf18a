"""Token id -> the text a response shows for it (``logprobs`` entries), as ``tokenizer.decode([id])`` gives it.

Memoised per id, and `warm()` decodes the whole vocabulary once (the server runs it on a worker thread at start, a
fraction of a second for 150k ids), so building a response is a dictionary lookup per token rather than a decode
call per id not seen before. ``return_tokens_as_token_ids`` labels are vLLM's ``token_id:<id>``.
"""

from __future__ import annotations


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
