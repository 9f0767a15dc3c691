"""Prompt-lookup drafting: the next token guessed from the request's own tokens.

The look-ahead (OasisKV) runs a draft of the next token one step early, so the
rows the next step will select are fetched off its critical path. Prompt lookup
needs no model: the token that followed the latest earlier occurrence of the
sequence's last few tokens. The serving engine drafts with it for every decoding
request; ``models.backends.Runner`` too, or falls back to a trained draft head.
"""

from __future__ import annotations


def ngram_match(history, max_n: int = 3) -> tuple[int, int]:
  """Prompt lookup: (the token that followed the latest earlier occurrence of the
  longest recent n-gram, n <= max_n; that n), or (the last token, 0) when not even
  the last token occurred before."""
  tokens = list(history)
  for n in range(max_n, 0, -1):
    if len(tokens) <= n:
      continue
    tail = tokens[-n:]
    for start in range(len(tokens) - n - 1, -1, -1):
      if tokens[start:start + n] == tail:
        return tokens[start + n], n
  return tokens[-1], 0


def ngram_draft(history, max_n: int = 3) -> int:
  """Prompt-lookup drafting: ``ngram_match``'s token."""
  return ngram_match(history, max_n)[0]
