"""Incremental detokenization and stop strings.

Text is emitted only once it is final: a delta never ends in half a UTF-8 character (a byte-level
token can split one; the decoder then shows U+FFFD, and we wait for the next token), and text that
might be the start of a stop string is held back until it is known not to be one.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from cluster.engine.stop_matcher import StopMatcher

_CONTEXT = 6  # prompt tokens decoded as context so the first output token gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(stop)
        self._matcher = StopMatcher(self.stop) if self.stop else None
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
        end = len(self.text)
        if self._matcher is not None and not self.stopped:
            cut = self._matcher.feed(self.text)
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
                end = cut
            elif not final:
                end -= self._matcher.held_back    # it may yet become a stop string
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out
