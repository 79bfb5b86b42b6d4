"""Text from a growing list of token ids, a few tokens at a time, with stop strings.

Decoding all of a sequence's tokens again at every step costs time quadratic in its length, and slicing the new
text off by character count breaks on byte-level tokenizers, where one character can span several tokens: the
first of them decodes to U+FFFD ("unknown") and the next to the whole character. Like vLLM's detokenizer and
Hugging Face's `TextStreamer`, this decodes only a short window of recent tokens and emits text once it is
complete:

    tokens        ... ' thank' | 'ã'  '‚'  'Ĭ'          window = tokens[prefix_offset:]
    text so far   ... ' thank'                          decoded(window) - decoded(tokens[prefix_offset:read_offset])
    after 'ã'     ' thank' + '\ufffd'   -> incomplete, wait
    after 'Ĭ'     ' thank' + 'あ'        -> emit 'あ', move both offsets on

A character that the prompt's last tokens begin and the output completes is output text. Stop strings are
searched in the new text (once `min_tokens` tokens exist, the token that completes a match included, as vLLM);
text is cut before a match. While a stop string could still be forming, the last `len(longest stop) - 1`
characters are held back from streams. When the sequence finishes, tokens still held back (halves of characters)
are decoded with U+FFFD, one at a time, so a stop string they complete ends the output at its token.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (a leading space needs a left side)


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
        stop: Sequence[str] = (), min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])  # context, then the output tokens
        self.num_context = len(self.tokens)
        self.prefix_offset = 0  # the window starts here
        self.read_offset = self.num_context  # tokens before this are already text
        self.text = ""
        self.stop_reason: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_context

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens) if token_ids else ""

    def update(self, new_token_ids: Iterable[int], finished: bool = False) -> str | None:
        """Add tokens and decode what they complete; `finished` flushes an incomplete character too. Returns the
        stop string that matched (the text then ends before it), or None."""
        for token_id in new_token_ids:
            self.tokens.append(token_id)
            if self._read(flush=False):
                return self.stop_reason
        if finished:
            return self._flush()
        return None

    def _flush(self) -> str | None:
        """Decode the tokens still held back (halves of characters), one at a time, so that a stop string they
        complete cuts the output at the token that completed it."""
        pending = self.tokens[self.read_offset :]
        del self.tokens[self.read_offset :]
        for token_id in pending:
            self.tokens.append(token_id)
            if self._read(flush=True):
                return self.stop_reason
        return None

    def _read(self, flush: bool) -> bool:
        """Turn complete new text into `text`; True if a stop string matched."""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if new_text.endswith("\ufffd") and not flush:
            return False  # a character still split across tokens
        # A character the prompt began (prefix_text ends in U+FFFD) and the new tokens complete is new text.
        known = len(prefix_text) if new_text.startswith(prefix_text) else len(prefix_text.rstrip("\ufffd"))
        if len(new_text) <= known:
            return False  # nothing yet
        start = len(self.text)
        self.text += new_text[known:]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._check_stop(start)

    def _check_stop(self, start: int) -> bool:
        if not self.stop or self.num_output_tokens < self.min_tokens:
            return False
        for stop in self.stop:
            index = self.text.find(stop, max(0, start - len(stop) + 1))
            if index != -1:
                self.text, self.stop_reason = self.text[:index], stop
                return True
        return False

    def streamable_text(self, finished: bool) -> str:
        """The text that can be sent now: all of it once finished, else all but what may start a stop string."""
        if finished or not self.stop:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[: len(self.text) - hold] if hold else self.text
