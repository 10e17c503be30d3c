"""Incremental detokenization: a request's text grows by its new tokens' text at each step.

Contract: one ``Detokenizer`` per request. ``update(ids)`` appends to ``text`` the text of the
tokens of ``ids`` not read yet (``ids`` only ever grows at its end: the request's verified output
tokens), decoding a short window that starts at the tokens read last time rather than the whole
list, so a step costs O(new tokens), not O(output length) (decoding everything at every step cost
~0.1 ms per sequence at 1,000 tokens, and grew with every token). The window's first tokens are
decoded too and their text subtracted, so tokenizers whose pieces depend on the piece before
(SentencePiece's leading space) give what decoding the whole list gives. A character whose bytes
are split over tokens decodes to U+FFFD until its last byte arrives: ``text`` holds such a tail
back, and ``finish(ids)`` appends whatever is left (U+FFFD included), as a whole decode would.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass
class Detokenizer:
    tokenizer: PreTrainedTokenizerBase
    text: str = ""
    prefix_offset: int = 0  # first token of the decode window (context for the new tokens)
    read_offset: int = 0  # tokens whose text is in ``text``
    checked: int = 0  # characters of ``text`` already searched for stop strings

    def _window(self, ids: list[int]) -> tuple[str, str]:
        """(text of the window's context tokens, text of the window up to the end of ids)."""
        decode = self.tokenizer.decode
        prefix = str(decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True))
        whole = str(decode(ids[self.prefix_offset :], skip_special_tokens=True))
        return prefix, whole

    def update(self, ids: list[int]) -> None:
        """Append the text of ``ids[read_offset:]``, unless it ends in an incomplete character."""
        if len(ids) <= self.read_offset:
            return
        prefix, whole = self._window(ids)
        if len(whole) > len(prefix) and not whole.endswith("\ufffd"):
            self.text += whole[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def finish(self, ids: list[int]) -> None:
        """The final text: that of every token of ``ids``, an incomplete last character too."""
        self.update(ids)
        if len(ids) > self.read_offset:
            prefix, whole = self._window(ids)
            self.text += whole[len(prefix) :]
            self.prefix_offset = self.read_offset = len(ids)
