"""The incremental detokenizer (`pagedlab.detokenizer`) over `ByteTokenizer`, whose ids 96-103 are pieces of
multi-byte characters: text at the prompt's edge, stop strings against min_tokens, and the final flush."""

from __future__ import annotations

from pagedlab.detokenizer import IncrementalDetokenizer
from tests.helpers import ByteTokenizer

TOKENIZER = ByteTokenizer()
A, B, C, X = (ord(c) - 32 for c in "abcx")
NI_1, NI_2, NI_3 = 98, 99, 100  # b"\xe6", b"\x97", b"\xa5": the three bytes of "日"
SMILE_1 = 101  # b"\xf0\x9f": the first half of "🙂"


def run(prompt, steps, **kwargs) -> tuple[IncrementalDetokenizer, str | None, str]:
    """Feed `steps` (lists of token ids, one per engine step; the last finishes); return the detokenizer, the
    stop string that matched, and the streamed text (the growth of `streamable_text` at each step)."""
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt, **kwargs)
    hit, streamed = None, ""
    for i, tokens in enumerate(steps):
        finished = i == len(steps) - 1
        hit = detokenizer.update(tokens, finished=finished)
        text = detokenizer.streamable_text(finished or hit is not None)
        assert text.startswith(streamed), "streamed text is never taken back"
        streamed = text
        if hit is not None:
            break
    return detokenizer, hit, streamed


def test_a_character_begun_in_the_prompt_and_completed_by_the_output():
    """issue 31: the prompt's last token is the first byte of "日"; the output's first two complete it. The
    output's text holds the whole character ('A' came out alone, the deltas adding up to the same wrong text)."""
    detokenizer, _, streamed = run([X, NI_1], [[NI_2], [NI_3], [ord("A") - 32]])
    assert detokenizer.text == streamed == "日A"


def test_a_character_the_prompt_leaves_unfinished_stays_the_prompts():
    detokenizer, _, streamed = run([X, NI_1], [[A], [B]])
    assert detokenizer.text == streamed == "ab"


def test_a_stop_string_completed_by_the_min_tokens_th_token_stops():
    """issue 31: min_tokens=3 and "bc" completed by the 3rd token: a stop (vLLM checks once len >= min_tokens)."""
    detokenizer, hit, _ = run([X], [[A], [B], [C], [A]], stop=["bc"], min_tokens=3)
    assert (hit, detokenizer.text, detokenizer.num_output_tokens) == ("bc", "a", 3)
    detokenizer, hit, _ = run([X], [[A], [B], [C], [A]], stop=["bc"], min_tokens=4)
    assert (hit, detokenizer.text) == (None, "abca")


def test_a_stop_string_matched_at_the_final_flush_ends_at_its_token():
    """The last two tokens are halves of characters, decoded only when the sequence finishes; the stop string
    "\\ufffd" is completed by the first of them, so the output ends there (issue 31: the tokens after it stayed)."""
    for steps in ([[A], [SMILE_1], [NI_1]], [[A, SMILE_1, NI_1]]):  # one token a step, or a verified chunk
        detokenizer, hit, streamed = run([X], steps, stop=["\ufffd"])
        assert (hit, detokenizer.text, streamed, detokenizer.num_output_tokens) == ("\ufffd", "a", "a", 2), steps


def test_the_final_flush_decodes_unfinished_characters_as_before():
    detokenizer, hit, _ = run([X], [[A], [SMILE_1], [NI_1]])
    assert (hit, detokenizer.text) == (None, "a\ufffd\ufffd")
