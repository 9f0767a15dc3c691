"""Replacement policies: which evictable slots a RESOLVE refills (the one module).

RESOLVE's hits, misses and outputs never depend on the policy; only the victims do
(docs/DESIGN.md, "Replacement policies"). A policy is a per-slot *retention key*:
misses take the evictable slots with the lowest key (empty slots first, ties in LRU
order), or HiSparse's plain LRU order when there is no key.

* ``"lru"``: no key (SGLang HiSparse's order; the Pallas kernel implements it).
* ``"freq"``: key = an exponential moving average of how often the slot's
  position was selected (``score <- alpha * score + [hit]``, 1 when filled).
* ``"rank"``: key = ``(1 - r / m) + rank_freq * score``, r the slot position's
  index in the selector's current best-first ranking of m positions (m if
  absent), score the ``"freq"`` EMA: evict what the selector ranks worst now.

The formulas (``decayed``, ``filled``, ``rank_key``) take numpy or jax arrays, so
the jitted RESOLVE and the numpy trace replay (``experiments/analysis/cache_sim``)
share them.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvtier_jax import lookup

NAMES = ("lru", "freq", "rank")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """A replacement policy and its parameters.

  Attributes:
    name: "lru", "freq" or "rank".
    freq_alpha: decay of the selection-frequency EMA ("freq", "rank"), in (0, 1).
    rank_depth: m, positions per row of the selector's ranking ("rank"); the
      selector then returns ``max(top_k, m)`` best-first positions per row, the
      first ``top_k`` of which are the selection. 0: the selection itself, where
      an evictable slot is never ranked, so "rank" evicts as "freq" does (the
      synthetic benchmarks time its code path so; ``models.backends.tier_config``
      refuses it for a model: the tables' "rank" ranks 1024 at k = 256).
    rank_freq: weight of the EMA in the "rank" key, >= 0.
  """

  name: str = "lru"
  freq_alpha: float = 0.9
  rank_depth: int = 0
  rank_freq: float = 0.3

  def __post_init__(self):
    if self.name not in NAMES:
      raise ValueError(f"policy name={self.name!r} must be one of {NAMES}")
    if not 0.0 < self.freq_alpha < 1.0:
      raise ValueError(f"{self.freq_alpha=} must be in (0, 1)")
    if not self.rank_freq >= 0:
      raise ValueError(f"{self.rank_freq=} must be >= 0")
    if self.rank_depth < 0 or (self.rank_depth and self.name != "rank"):
      raise ValueError(f"rank_depth={self.rank_depth} needs policy 'rank' (and >= 0)")

  @property
  def keyed(self) -> bool:
    return self.name != "lru"


def _xp(x):
  return np if isinstance(x, np.ndarray) else jnp


def decayed(score, is_hit, alpha: float):
  """The EMA after one step: every slot decays, a hit adds 1."""
  return alpha * score + is_hit


def filled(score, is_filled):
  """A slot refilled with a new position restarts at 1."""
  return _xp(score).where(is_filled, 1.0, score)


def rank_key(rank, num_ranked: int, score, rank_freq: float):
  """The "rank" retention key: higher keeps the slot longer."""
  return (1.0 - rank / num_ranked) + rank_freq * score


def victim_key(policy: PolicyConfig, slot_pos, score, ranks=None, *,
               method: str = "auto", num_positions: int | None = None):
  """f[..., B] retention key of each slot under ``policy`` (None for LRU).

  ``ranks`` i32[..., m]: the selector's best-first ranking ("rank" only).
  """
  if policy.name == "lru":
    return None
  if policy.name == "freq":
    return score
  rank = lookup.rank_of(slot_pos, ranks.astype(jnp.int32), method=method,
                        num_positions=num_positions)
  return rank_key(rank.astype(score.dtype), ranks.shape[-1], score, policy.rank_freq)


def _slot_mask(score, slot, where):
  """bool[..., B]: the slots ``slot`` i32[..., k] names where ``where``."""
  num_slots = score.shape[-1]
  flat_slot = slot.reshape(-1, slot.shape[-1])
  row = jnp.arange(flat_slot.shape[0], dtype=jnp.int32)[:, None]
  return jnp.zeros((flat_slot.shape[0], num_slots), bool).at[
      row, jnp.where(where.reshape(flat_slot.shape), flat_slot, num_slots)].set(
          True, mode="drop").reshape(score.shape)


def next_score(policy: PolicyConfig, score, slot, is_miss):
  """The per-slot EMA after a RESOLVE that served ``slot`` i32[..., k] (B: the
  newest token's reserved slot, -1 padding; ``is_miss`` the refilled ones)."""
  if policy.name == "lru":
    return score
  regular = (slot >= 0) & (slot < score.shape[-1])
  score = decayed(score, _slot_mask(score, slot, regular & ~is_miss), policy.freq_alpha)
  return filled(score, _slot_mask(score, slot, is_miss)).astype(score.dtype)


def prefetched_score(policy: PolicyConfig, score, slot, is_miss):
  """The EMA after a lookahead prefetch: the refilled slots restart at 1, and
  nothing decays or counts as a hit (the EMA moves once per decode step, with what
  was selected, not predicted)."""
  if policy.name == "lru":
    return score
  return filled(score, _slot_mask(score, slot, is_miss)).astype(score.dtype)
