"""One layer's cache step in pure jnp: the reference of the fused kernels.

Per (request, unit) row of layer ``layer`` (docs/DESIGN.md, "The fused layer step"):

1. *validate*: an active row's selection must name distinct positions in
   ``[0, newest]`` (``-1`` padding); a request at ``max_len`` cannot grow;
2. *RESOLVE* over the valid entries, slot positions at or past ``newest``
   counting as empty (uncommitted): misses take the evictable slots in LRU order,
   or, given a per-slot retention ``key`` (a replacement policy), the lowest key
   first (empty slots first, ties in LRU order); then the newest token also takes
   the lowest-index empty slot, if any (``install_newest``);
3. a miss whose position has no host page makes the row refuse (capacity);
4. *commit*, only when no earlier layer refused (``prior_status`` 0) and no row
   of this layer refused: the missed rows are
   copied from the host tier into their victims, the newest token into its install
   slot, and the metadata and counters of the active rows are written. The newest
   token always goes to reserved slot ``B`` (its row is rewritten every step).
   With ``score_decay`` alpha the per-slot score is the policies' EMA (every slot
   decays by alpha, a hit adds 1, a refilled slot restarts at 1); the install
   slot's score is 1 in every case.

Inactive rows select nothing, refuse nothing and keep their metadata. The status
word says why the step refused (bits of ``pallas_kernels.common``): the word passed
in OR this layer's, so a layer loop threads it from layer to layer; the unpaged
check only looks at rows whose selection is valid, so the word is the same
whichever implementation resolved a malformed row.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.cache_resolve.reference import cache_resolve_reference, install_newest


class CacheArrays(NamedTuple):
  """The cache arrays one layer step reads and updates (every layer)."""

  slot_pos: jax.Array  # i32[L, R, U, B]
  lru: jax.Array  # i32[L, R, U, B]
  slot_score: jax.Array  # f32[L, R, U, B]
  hits: jax.Array  # i32[L, R, U]
  misses: jax.Array  # i32[L, R, U]
  fetched_rows: jax.Array  # i32[L]
  hot_k: jax.Array  # [L, R, U, B+1, Hg, D]
  hot_v: jax.Array  # [L, R, U, B+1, Hg, D]


class LayerResult(NamedTuple):
  cache: CacheArrays
  # i32[R, U, k] slot serving each selected entry (B newest, -1 pad); unspecified
  # in a row whose selection is malformed (the layer refuses).
  slot: jax.Array
  is_miss: jax.Array  # bool[R, U, k] fetched this step (False unless committed)
  status: jax.Array  # i32[] prior_status | this layer's word (0: nothing wrong)
  # i32[R, U] slot that also keeps the newest token, -1 none; unspecified in a row
  # whose selection is malformed, as ``slot``.
  target: jax.Array


def map_scratch_bytes(rows: int, max_len: int, top_k: int) -> int:
  """Bytes of the fused kernel's position map: one entry per position per row."""
  return rows * (max_len + 1 + common.next_power_of_2(top_k)) * 4


def check_victim_inputs(key, order, score_decay, shape) -> None:
  """The fused steps' keyed-policy inputs: a retention ``key`` or its victim
  ``order`` (each of ``shape`` (R, U, B)), given with ``score_decay``, or none."""
  if key is not None and order is not None:
    raise ValueError("give a retention key or its victim order, not both")
  if (key is None and order is None) != (score_decay is None):
    raise ValueError("a retention key (or victim order) and score_decay go together "
                     "(a keyed policy)")
  for name, x in (("key", key), ("order", order)):
    if x is not None and x.shape != shape:
      raise ValueError(f"{name} {x.shape} must be {shape} (R, U, B)")


def check_share(share: int, num_layers: int) -> None:
  """Index sharing: the layers ``layer .. layer + share - 1`` take one selection."""
  if not 0 < share <= num_layers:
    raise ValueError(f"{share=} must be in [1, L={num_layers}]")


def _duplicates(sel):
  srt = jnp.sort(sel, axis=-1)
  return ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(-1)


def _or_reduce(x):
  return jax.lax.reduce(x.astype(jnp.int32), jnp.int32(0), jax.lax.bitwise_or,
                        tuple(range(x.ndim)))


def effective_slot_pos(slot_pos, seq_len):
  """i32[R, U, B] one layer's slot positions with uncommitted ones (at or past the
  newest position, left by a refused step) as empty: what RESOLVE reads."""
  newest = seq_len[:, None, None]
  return jnp.where(slot_pos >= newest, -1, slot_pos)


def victim_key_reference(layer, seq_len, slot_pos, score, ranks=None, *,
                         rank_freq: float = 0.0):
  """f32[R, U, B] the keyed policies' retention key of layer ``layer``'s slots
  (higher keeps longer; empty slots' keys are never read): the score EMA
  (``freq``, ``ranks`` None), or with the selector's ranking ``ranks`` i32[R, U, m]
  (distinct positions, -1 padding) ``(1 - r / m) + rank_freq * score``, r the
  slot position's index in it, m when absent (``rank``). Brute force, O(B * m)."""
  pos = effective_slot_pos(slot_pos[layer], seq_len)
  score = score[layer]
  if ranks is None:
    return score
  num_ranked = ranks.shape[-1]
  eq = (ranks[..., None, :] == pos[..., :, None]) & (pos[..., :, None] >= 0)
  rank = jnp.where(eq.any(-1), jnp.argmax(eq, axis=-1), num_ranked).astype(score.dtype)
  return (1.0 - rank / num_ranked) + rank_freq * score


def updated_score(score, slot, is_miss, decay: float):
  """f32[..., B] the EMA after a RESOLVE served ``slot`` i32[..., k] (``is_miss``
  the refilled lanes): decay all, +1 per hit slot, 1 for a refilled one."""
  num_slots = score.shape[-1]
  lanes = jnp.arange(num_slots)
  regular = (slot >= 0) & (slot < num_slots)
  marks = lambda where: (jnp.where(where, slot, num_slots)[..., None] == lanes).any(-2)
  score = decay * score + marks(regular & ~is_miss)
  return jnp.where(marks(is_miss), 1.0, score).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("max_len", "page_size", "share",
                                             "score_decay"))
def resolve_fetch_reference(layer, prior_status, active, seq_len, selected,
                            cache: CacheArrays, page_table, host_k, host_v, k_new, v_new,
                            key=None, *,
                            max_len: int, page_size: int, share: int = 1,
                            score_decay: float | None = None) -> LayerResult:
  """One layer's validate + RESOLVE + fetch + commit (module docstring).

  Args:
    layer: i32[]; prior_status: i32[] the earlier layers' status word (nonzero:
      one refused, commit nothing).
    active: bool[R]; seq_len: i32[R] (the newest position of each request).
    selected: i32[R, U, k] positions to attend, -1 padding.
    cache: the arrays of every layer (``CacheArrays``).
    page_table: i32[R, MP]; host_k, host_v: [L, NH+1, Pg, U, Hg, D].
    k_new, v_new: [R, Hkv, D] the newest token's K/V.
    max_len: T, positions per request; page_size: Pg.
    key: optional f32[R, U, B] retention key of the layer's slots (a keyed
      replacement policy); None: LRU.
    share: layers ``layer .. layer + share - 1`` use this selection (index
      sharing): each gets the misses fetched into the same slots, the same
      metadata, scores and counts (lockstep); the newest token is written for
      ``layer`` only (the sharing layers write their own).
    score_decay: alpha of the score EMA (keyed policies); None keeps the scores.
  """
  num_layers, num_req, num_units, num_slots = cache.slot_pos.shape
  heads, head_dim = cache.hot_k.shape[-2:]
  check_share(share, num_layers)
  newest = jnp.broadcast_to(seq_len[:, None], (num_req, num_units))
  act = active[:, None]
  sel = jnp.where(act[..., None], selected.astype(jnp.int32), -1)
  bad = (sel < -1) | (sel > newest[..., None]) | (sel > max_len)
  row_bad = bad.any(-1)
  sel = jnp.where(bad, -1, sel)
  row_dup = _duplicates(sel)

  slot_pos = effective_slot_pos(cache.slot_pos[layer], seq_len)
  res = cache_resolve_reference(slot_pos, cache.lru[layer], sel, newest, None, key)
  new_slot_pos, new_lru, target = install_newest(res.slot_pos, res.lru, newest)
  target = jnp.where(act, target, -1)

  r = jnp.arange(num_req)[:, None, None]
  u = jnp.arange(num_units)[None, :, None]
  pos = jnp.clip(sel, 0, max_len - 1)
  page = page_table[r, pos // page_size]
  unpaged = (res.is_miss & (page < 0)).any(-1) & ~row_bad & ~row_dup
  row_status = (jnp.where(row_bad, common.STATUS_OUT_OF_RANGE, 0)
                | jnp.where(row_dup, common.STATUS_DUPLICATE, 0)
                | jnp.where(act & (newest >= max_len), common.STATUS_CAPACITY, 0)
                | jnp.where(unpaged, common.STATUS_CAPACITY, 0))
  # layer .. layer + share - 1 must be the cache's (layer is traced: a status bit).
  layer_ok = (layer >= 0) & (layer + share <= num_layers)
  status = _or_reduce(row_status) | jnp.where(layer_ok, 0, common.STATUS_OUT_OF_RANGE)
  ok = (prior_status == 0) & (status == 0)
  row_ok = ok & act
  is_miss = res.is_miss & ok

  # Hot rows: the newest to slot B (always) and its install slot; misses from host.
  rows_new = lambda x: x.reshape(num_req, num_units, heads, head_dim)
  fetch_from = lambda host, l: host[l, jnp.where(is_miss, page, 0), pos % page_size, u]
  rr, uu = jnp.arange(num_req)[:, None], jnp.arange(num_units)[None, :]
  to_target = jnp.where(ok & (target >= 0), rr, num_req)
  to_victim = jnp.where(is_miss, r, num_req)

  def write_hot(hot, new, host):
    new = rows_new(new).astype(hot.dtype)
    hot = hot.at[layer, :, :, num_slots].set(new)
    hot = hot.at[layer, to_target, uu, target].set(new, mode="drop")
    for j in range(share):
      hot = hot.at[layer + j, to_victim, u, res.slot].set(
          fetch_from(host, layer + j).astype(hot.dtype), mode="drop")
    return hot

  keep = lambda new, old: jnp.where(row_ok[..., None], new, old)
  is_target = jnp.arange(num_slots) == target[..., None]
  score = cache.slot_score[layer]
  if score_decay is not None:
    score = updated_score(score, res.slot, res.is_miss, score_decay)
  new_score = jnp.where(is_target, 1.0, score)
  counted = lambda mask: jnp.where(ok, mask.sum(-1, dtype=jnp.int32), 0)
  per_layer = lambda x, new: functools.reduce(
      lambda acc, j: acc.at[layer + j].set(new(x[layer + j])), range(share), x)
  new_cache = CacheArrays(
      slot_pos=per_layer(cache.slot_pos, lambda old: keep(new_slot_pos, old)),
      lru=per_layer(cache.lru, lambda old: keep(new_lru, old)),
      slot_score=per_layer(cache.slot_score, lambda old: keep(new_score, old)),
      hits=per_layer(cache.hits, lambda old: old + counted((sel >= 0) & ~res.is_miss)),
      misses=per_layer(cache.misses, lambda old: old + counted(is_miss)),
      fetched_rows=cache.fetched_rows.at[layer].add(
          share * is_miss.sum(dtype=jnp.int32)),
      hot_k=write_hot(cache.hot_k, k_new, host_k),
      hot_v=write_hot(cache.hot_v, v_new, host_v),
  )
  return LayerResult(new_cache, res.slot, is_miss, prior_status | status, target)
