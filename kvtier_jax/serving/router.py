"""Routing requests over engine replicas: to the one holding the longest cached
prefix, else the least loaded (SGLang's cache-aware router, KV-aware routers).

The router never asks a replica what it caches: like SGLang's router it keeps, per
replica, an approximate index of the prompts it sent there, at the replicas' prefix
granularity (whole chunks of ``chunk_size`` tokens, what a replica's radix cache
can share), forgetting the least recently routed chunks past ``max_chunks``, a
prompt's last chunks before its first (a match stops at the first missing chunk, so
a forgotten first chunk would make the rest unreachable). A prompt its replica
refused is forgotten (``forget``): each chunk counts the routed prompts holding it,
so a chunk another prompt also brought stays.
A request goes to the replica with the longest match when that replica is not
overloaded (at most ``balance_abs`` more outstanding requests than the least loaded
one), else to the least loaded replica (ties: the lowest index). ``round_robin`` and
``least_loaded`` are the baselines.
"""

from __future__ import annotations

import collections
from typing import Sequence

from kvtier_jax.serving.request import is_int

POLICIES = ("prefix", "round_robin", "least_loaded")


class Router:
  """Picks a replica per request; ``done`` when a routed request finishes."""

  def __init__(self, num_replicas: int, chunk_size: int, policy: str = "prefix", *,
               balance_abs: int = 2, max_chunks: int = 1 << 16):
    if policy not in POLICIES:
      raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
    if num_replicas < 1 or chunk_size < 1:
      raise ValueError(f"{num_replicas=} and {chunk_size=} must be >= 1")
    if balance_abs < 0 or max_chunks < 0:
      raise ValueError(f"{balance_abs=} and {max_chunks=} must be >= 0")
    self.num_replicas, self.chunk_size, self.policy = num_replicas, chunk_size, policy
    self.balance_abs, self.max_chunks = balance_abs, max_chunks
    self.load = [0] * num_replicas  # outstanding requests
    # Per replica, key -> routed prompts holding that chunk, least recent first.
    self._chunks = [collections.OrderedDict() for _ in range(num_replicas)]
    self._next = 0
    self.routed_by_prefix = 0

  def _keys(self, prompt: Sequence[int]) -> list[int]:
    """One key per whole chunk of ``prompt``: the hash of every token up to its end
    (chained, so equal keys mean equal prefixes up to hash collisions)."""
    keys, key = [], 0
    for end in range(self.chunk_size, len(prompt) + 1, self.chunk_size):
      key = hash((key, tuple(prompt[end - self.chunk_size:end])))
      keys.append(key)
    return keys

  def _replica(self, replica: int) -> int:
    """``replica`` checked (a negative index would book another replica's)."""
    if not (is_int(replica) and 0 <= replica < self.num_replicas):
      raise ValueError(f"replica={replica!r} must be an int in [0, {self.num_replicas})")
    return replica

  def match(self, replica: int, prompt: Sequence[int]) -> int:
    """Tokens of ``prompt``'s longest whole-chunk prefix routed to ``replica`` that
    its cache can serve: a prompt's last token is always prefilled (its logits give
    the first output), so a prompt of whole chunks can reuse all but its last."""
    chunks, matched = self._chunks[self._replica(replica)], 0
    shareable = (len(prompt) - 1) // self.chunk_size * self.chunk_size
    for key in self._keys(prompt[:max(shareable, 0)]):
      if key not in chunks:
        break
      matched += self.chunk_size
    return matched

  def route(self, prompt: Sequence[int]) -> int:
    n = self.num_replicas
    least = min(range(n), key=lambda r: (self.load[r], r))
    if self.policy == "round_robin":
      pick, self._next = self._next, (self._next + 1) % n
    elif self.policy == "least_loaded":
      pick = least
    else:
      matches = [self.match(r, prompt) for r in range(n)]
      best = max(range(n), key=lambda r: (matches[r], -self.load[r], -r))
      if matches[best] and self.load[best] - self.load[least] <= self.balance_abs:
        pick = best
        self.routed_by_prefix += 1
      else:
        pick = least
    self.load[pick] += 1
    self._remember(pick, prompt)
    return pick

  def _remember(self, replica: int, prompt: Sequence[int]) -> None:
    chunks = self._chunks[replica]
    for key in reversed(self._keys(prompt)):  # the first chunk ends most recent
      chunks[key] = chunks.get(key, 0) + 1
      chunks.move_to_end(key)
    while len(chunks) > self.max_chunks:
      chunks.popitem(last=False)

  def forget(self, replica: int, prompt: Sequence[int]) -> None:
    """``replica`` refused ``prompt`` (routed there, never cached): its chunks no
    longer count for it (those other routed prompts hold stay)."""
    chunks = self._chunks[self._replica(replica)]
    for key in self._keys(prompt):
      if key in chunks:
        chunks[key] -= 1
        if not chunks[key]:
          del chunks[key]

  def done(self, replica: int) -> None:
    if self.load[self._replica(replica)] <= 0:
      raise ValueError(f"replica {replica} has no outstanding request")
    self.load[replica] -= 1
