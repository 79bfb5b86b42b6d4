"""Prompt lookup: draft the tokens that followed the last time the context's ending appeared in it. No model.

The context's last n tokens (n from prompt_lookup_max down to prompt_lookup_min: the longest that matches) are
looked for earlier in the prompt and output; the tokens that followed the latest such occurrence are the drafts:

    context:  The cat sat on the mat . The cat sat | ?        last 3 tokens "The cat sat" occurred at 0-2
    drafts:   on the mat                           (k = 3: the 3 tokens after that occurrence)

It pays where outputs copy their input (summaries, edits, answers quoting a document) and costs little
elsewhere: no match, no drafts. Pure Python over token ids.

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedlab.core.speculation import DraftRequest


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram of `token_ids`
    with min_n <= n <= max_n; () when none occurs."""
    num_tokens = len(token_ids)
    last = token_ids[-1] if token_ids else None
    best_n, best_end = 0, -1
    for end in range(num_tokens - 2, -1, -1):  # an earlier occurrence ends at `end`; latest first
        if token_ids[end] != last:
            continue
        n = 1
        while n < max_n and n <= end and token_ids[end - n] == token_ids[num_tokens - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return ()
    return tuple(token_ids[best_end + 1 : best_end + 1 + k])


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """Drafts for the running decodes that have a match (the others are left out)."""
        drafts = {}
        for request in requests:
            found = propose_ngram(request.token_ids, self.min_n, self.max_n, min(self.k, request.max_num_draft_tokens))
            if found:
                drafts[request.request_id] = found
        return drafts
