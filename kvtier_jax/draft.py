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


class PromptLookup:
  """``ngram_match`` over a sequence that grows, in O(max_n) per token and per
  query (``ngram_match`` rescans the whole sequence: ~9 ms per query at 8K tokens
  in Python, paid by every decoding request on every engine step).

  It keeps, for each n-gram (n <= max_n) whose next token is known, the start of
  its latest occurrence; the tail n-gram is looked up there.
  """

  def __init__(self, max_n: int = 3):
    self.max_n = max_n
    self.tokens: list[int] = []
    self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest

  def extend(self, tokens) -> None:
    for token in tokens:
      self.tokens.append(int(token))
      follower = len(self.tokens) - 1  # the n-grams just before it gain a next token
      for n in range(1, self.max_n + 1):
        if follower - n >= 0:
          self._latest[tuple(self.tokens[follower - n:follower])] = follower - n

  def match(self) -> tuple[int, int]:
    """``ngram_match(self.tokens, max_n)``."""
    tokens = self.tokens
    for n in range(self.max_n, 0, -1):
      if len(tokens) <= n:
        continue
      start = self._latest.get(tuple(tokens[-n:]))
      if start is not None:
        return tokens[start + n], n
    return tokens[-1], 0
