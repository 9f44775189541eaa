"""Incremental detokenization and stop strings.

Text is emitted only once it is final: a delta never ends in half a UTF-8 character (a byte-level
token can split one; the decoder then shows U+FFFD, and we wait for the next token), and text that
might be the start of a stop string is held back until it is known not to be one.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_CONTEXT = 6  # prompt tokens decoded as context so the first output token gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(stop)
        self.text = ""        # all final output text so far
        self.emitted = 0      # chars of `text` already returned to the caller
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Feed new tokens; return the text that became final. `final` flushes everything."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(final)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
        end = len(self.text)
        if self.stop and not self.stopped and not final:
            end -= self._held_back()
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
