"""Pure-jnp RESOLVE: the reference for the kernel and the XLA fallback.

Semantics (SGLang HiSparse ``load_cache_to_device_buffer`` order, SPECS.md §1.5):

* a regular slot is a *hit* when the position it holds is selected (the newest
  position excluded: it always lives in the reserved slot ``B``);
* every other regular slot is *evictable*, in LRU order (empty slots included);
* the j-th miss, counted in ``selected`` order, takes the j-th least-recently-used
  evictable slot;
* new LRU order = [evictables not taken, old order] ++ [victims, miss order]
  ++ [hits, old relative order].

``cache_resolve_keyed_reference`` changes one rule: the misses take the evictable
slots with the lowest per-slot key (empty ones first, ties in LRU order), which is
how the "freq" and "rank" replacement policies plug in; outputs stay exact.

Everything is vectorised: a membership lookup (below), a few cumsums and scatters
per row; no loop over slots.

Membership lookups (``lookup``; same results, different cost per backend):

* ``"scan"``: sort the ``k`` selected positions, then a binary search per slot
  (``jnp.searchsorted``'s rolled loop; 3x slower than "unrolled" on an H200);
* ``"unrolled"``: the same binary search unrolled (no while loop on GPU);
* ``"sort"``: the same, with ``searchsorted(method="sort")``;
* ``"map"``: scatter the slots into a dense position -> slot map of
  ``num_positions`` entries per row, then gather the selected positions: no sort
  at all, O(num_positions) scratch per row; the fastest on CPU and GPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

LOOKUPS = ("scan", "unrolled", "sort", "map")
SEARCH_METHOD = {"scan": "scan", "unrolled": "scan_unrolled", "sort": "sort"}


class ResolveOutputs(NamedTuple):
  slot_pos: jax.Array  # i32[..., B]  position held by each regular slot, -1 empty
  lru: jax.Array  # i32[..., B]  slot ids, least recently used first
  slot: jax.Array  # i32[..., k]  slot serving each selected entry (B: newest, -1: pad)
  is_miss: jax.Array  # bool[..., k]


def _check_lookup(lookup, num_positions):
  if lookup not in LOOKUPS:
    raise ValueError(f"{lookup=} must be one of {LOOKUPS}")
  if lookup == "map" and (num_positions is None or num_positions < 1):
    raise ValueError("lookup='map' needs num_positions, a bound on every position")


def position_table(keys, values, num_positions: int, fill: int):
  """i32[..., P]: ``table[..., keys[..., j]] = values[..., j]`` per row, ``fill``
  elsewhere; keys outside ``[0, P)`` (-1 padding) are dropped. Duplicate keys
  keep one of their values."""
  rows = keys.shape[:-1]
  flat_keys = keys.reshape(-1, keys.shape[-1])
  row = jnp.arange(flat_keys.shape[0], dtype=jnp.int32)[:, None]
  col = jnp.where((flat_keys >= 0) & (flat_keys < num_positions), flat_keys,
                  num_positions)
  table = jnp.full((flat_keys.shape[0], num_positions), fill, jnp.int32).at[row, col].set(
      values.reshape(flat_keys.shape).astype(jnp.int32), mode="drop")
  return table.reshape(rows + (num_positions,))


def table_lookup(table, keys, fill: int):
  """i32[..., n]: ``table[..., keys]`` per row, ``fill`` for keys outside the table."""
  num_positions = table.shape[-1]
  flat_keys = keys.reshape(-1, keys.shape[-1])
  row = jnp.arange(flat_keys.shape[0], dtype=jnp.int32)[:, None]
  got = table.reshape(-1, num_positions)[row, jnp.clip(flat_keys, 0, num_positions - 1)]
  inside = (flat_keys >= 0) & (flat_keys < num_positions)
  return jnp.where(inside, got, fill).reshape(keys.shape)


def _lookup(slot_pos, selected, wanted, slot_ids, lookup, num_positions):
  """Which slot holds each wanted selected entry (-1: none), and each slot's hit flag.

  slot_pos: i32[B]; selected: i32[k]; wanted: bool[k]. Positions are distinct on
  both sides, so every match is one-to-one.
  """
  num_slots, num_sel = slot_pos.shape[0], selected.shape[0]
  if lookup == "map":
    # Dense position -> slot map; positions >= num_positions (caller's bound) and
    # empty slots drop out of the scatter.
    pos_map = position_table(slot_pos, slot_ids, num_positions, -1)
    hit_slot = jnp.where(wanted, table_lookup(pos_map, selected, -1), -1)
    is_hit_slot = jnp.zeros((num_slots,), bool).at[
        jnp.where(hit_slot >= 0, hit_slot, num_slots)].set(True, mode="drop")
    return hit_slot, is_hit_slot
  # One sort of the k selected positions (cheaper than sorting the B slots); each
  # slot looks its position up.
  masked = jnp.where(wanted, selected, jnp.iinfo(jnp.int32).max)
  order = jnp.argsort(masked)
  sel_sorted = masked[order]
  at = jnp.minimum(jnp.searchsorted(sel_sorted, slot_pos,
                                    method=SEARCH_METHOD[lookup]), num_sel - 1)  # [B]
  is_hit_slot = (slot_pos >= 0) & (sel_sorted[at] == slot_pos)
  held_sorted = jnp.full((num_sel,), -1, jnp.int32).at[
      jnp.where(is_hit_slot, at, num_sel)].set(slot_ids, mode="drop")
  hit_slot = jnp.zeros((num_sel,), jnp.int32).at[order].set(held_sorted)
  return jnp.where(wanted, hit_slot, -1), is_hit_slot


def _resolve_row(slot_pos, lru, selected, newest, key=None, *, lookup="scan",
                 num_positions=None):
  # slot_pos: i32[B], lru: i32[B], selected: i32[k], newest: i32[]
  # key: f[B] per-slot retention key (victims: lowest first), or None for LRU
  # returns (ResolveOutputs, is_hit_slot bool[B])
  num_slots = slot_pos.shape[0]
  valid = selected >= 0
  is_newest = valid & (selected == newest)
  wanted = valid & ~is_newest  # entries that must come from a regular slot
  slot_ids = jnp.arange(num_slots, dtype=jnp.int32)
  hit_slot, is_hit_slot = _lookup(slot_pos, selected, wanted, slot_ids, lookup,
                                  num_positions)
  held = wanted & (hit_slot >= 0)
  hit_lru = is_hit_slot[lru]  # bool[B]

  miss = wanted & ~held  # bool[k]
  num_miss = miss.sum(dtype=jnp.int32)
  miss_rank = jnp.cumsum(miss, dtype=jnp.int32) - 1

  hit_count = jnp.cumsum(hit_lru, dtype=jnp.int32)  # hits at or before each LRU index
  hit_rank = hit_count - 1
  evict_rank = slot_ids - hit_count  # = cumsum(~hit_lru) - 1, without a second scan
  num_evict = num_slots - hit_lru.sum(dtype=jnp.int32)

  if key is None:
    # LRU: the j-th miss takes the evictable of rank j; destination of every old
    # LRU entry in the new order.
    new_index = jnp.where(
        hit_lru, num_evict + hit_rank,
        jnp.where(evict_rank < num_miss, num_evict - num_miss + evict_rank,
                  evict_rank - num_miss))
    evict_by_rank = jnp.zeros_like(lru).at[
        jnp.where(hit_lru, num_slots, evict_rank)].set(lru, mode="drop")
    victim = evict_by_rank[jnp.where(miss, miss_rank, 0)]
  else:
    # Keyed: victims are the evictables with the lowest key (empty slots first),
    # ties in LRU order; the LRU list keeps its rule.
    key = jnp.where(slot_pos < 0, -jnp.inf, key)
    key_lru = jnp.where(hit_lru, jnp.inf, key[lru])
    order = jnp.argsort(key_lru, stable=True)  # evictables by (key, LRU)
    rank = jnp.zeros_like(lru).at[order].set(jnp.arange(num_slots, dtype=jnp.int32))
    taken = ~hit_lru & (rank < num_miss)
    kept_rank = jnp.cumsum(~hit_lru & ~taken, dtype=jnp.int32) - 1
    new_index = jnp.where(hit_lru, num_evict + hit_rank,
                          jnp.where(taken, num_evict - num_miss + rank, kept_rank))
    victim = lru[order[jnp.where(miss, miss_rank, 0)]]
  new_lru = jnp.zeros_like(lru).at[new_index].set(lru, unique_indices=True)

  slot = jnp.where(miss, victim,
                   jnp.where(held, hit_slot, jnp.where(is_newest, num_slots, -1)))
  new_slot_pos = slot_pos.at[jnp.where(miss, victim, num_slots)].set(
      selected, mode="drop")
  return ResolveOutputs(new_slot_pos, new_lru, slot.astype(jnp.int32), miss), is_hit_slot


@functools.partial(jax.jit, static_argnames=("lookup", "num_positions"))
def cache_resolve_keyed_reference(slot_pos, lru, key, selected, newest, *,
                                  lookup: str = "scan", num_positions: int | None = None):
  """RESOLVE whose victims are the evictable slots with the lowest ``key``.

  Hits, misses, served slots and the LRU rule are RESOLVE's; only the victims
  differ: empty slots first, then the lowest ``key`` f[..., B], ties in LRU
  order. Outputs stay exact. The policies built on it: "freq" (key = an EMA of
  selections, below) and "rank" (key = minus the selector's current rank of the
  slot's position; kvtier_jax.resolve.resolve_ranked).

  Returns (ResolveOutputs, is_hit_slot bool[..., B]).
  """
  _check_lookup(lookup, num_positions)
  return _keyed(slot_pos, lru, key, selected, newest, lookup, num_positions)


def _keyed(slot_pos, lru, key, selected, newest, lookup, num_positions):
  batch = slot_pos.shape[:-1]
  flat = lambda x: x.reshape((-1,) + x.shape[len(batch):])
  row = functools.partial(_resolve_row, lookup=lookup, num_positions=num_positions)
  out, hit = jax.vmap(lambda a, b, c, d, e: row(a, b, c, d, key=e))(
      flat(slot_pos), flat(lru), flat(selected), flat(newest), flat(key))
  unflat = lambda x: x.reshape(batch + x.shape[1:])
  return ResolveOutputs(*map(unflat, out)), unflat(hit)


@functools.partial(jax.jit, static_argnames=("alpha", "lookup", "num_positions"))
def cache_resolve_freq_reference(slot_pos, lru, score, selected, newest, *, alpha: float,
                                 lookup: str = "scan", num_positions: int | None = None):
  """RESOLVE with the frequency-aware victim order (``cache_sim`` policy "freq").

  Victims: the evictable slots with the lowest ``score`` (an exponential moving
  average of how often the slot's position was selected: ``score <- alpha * score
  + [hit]``, 1 when filled), empty slots first, ties in LRU order.

  Returns (ResolveOutputs, new score f[..., B]).
  """
  _check_lookup(lookup, num_positions)
  out, is_hit_slot = _keyed(slot_pos, lru, score, selected, newest, lookup,
                            num_positions)
  return out, freq_update(score, is_hit_slot, out, alpha)


def freq_update(score, is_hit_slot, out: ResolveOutputs, alpha: float):
  """The "freq" EMA after a RESOLVE: decay, +1 per hit, 1 for a filled victim."""
  new_score = jnp.where(is_hit_slot, alpha * score + 1, alpha * score)
  num_slots = score.shape[-1]
  victim = jnp.where(out.is_miss, out.slot, num_slots)  # B: not a victim (dropped)
  fill = jax.vmap(lambda s, v: s.at[v].set(1, mode="drop"))
  new_score = fill(new_score.reshape(-1, num_slots), victim.reshape(-1, victim.shape[-1]))
  return new_score.reshape(score.shape).astype(score.dtype)


@functools.partial(jax.jit, static_argnames=("lookup", "num_positions"))
def cache_resolve_reference(slot_pos, lru, selected, newest, *, lookup: str = "scan",
                            num_positions: int | None = None) -> ResolveOutputs:
  """RESOLVE over any leading batch dims; see the module docstring.

  Args:
    slot_pos: i32[..., B] position held by each regular slot, -1 when empty.
    lru: i32[..., B] permutation of slot ids, least recently used first.
    selected: i32[..., k] distinct positions wanted this step, -1 = padding.
    newest: i32[...] the newest position (served by reserved slot ``B``).
    lookup: membership lookup (module docstring); ``"map"`` needs
      ``num_positions`` > every position in ``slot_pos`` and ``selected``.
  """
  _check_lookup(lookup, num_positions)
  batch = slot_pos.shape[:-1]
  flat = lambda x: x.reshape((-1,) + x.shape[len(batch):])
  row = functools.partial(_resolve_row, lookup=lookup, num_positions=num_positions)
  out, _ = jax.vmap(row)(flat(slot_pos), flat(lru), flat(selected), flat(newest))
  return ResolveOutputs(*(x.reshape(batch + x.shape[1:]) for x in out))
