"""Pure-jnp RESOLVE: the reference of the kernel (and the algorithm of the XLA path).

Semantics (SGLang HiSparse ``load_cache_to_device_buffer`` order; docs/DESIGN.md,
"RESOLVE"):

* a regular slot is a *hit* when the position it holds is selected (the newest
  position excluded: it always lives in the reserved slot ``B``);
* every other regular slot is *evictable*, in LRU order (empty slots included);
* the j-th miss, counted in ``selected`` order, takes the j-th least-recently-used
  evictable slot;
* new LRU order = [evictables not taken, old order] ++ [victims, miss order]
  ++ [hits, old relative order].

Two optional inputs let a caller plug in the rest of the library without this
module knowing it: ``held`` (which slot holds each selected position, from any
membership lookup; by default a B x k compare, as the kernel does) and ``key`` (a
per-slot retention key: the misses then take the evictable slots with the lowest
key, empty ones first, ties in LRU order; replacement policies are built on it).
Vectorised per row: a few cumsums and scatters, no loop over slots.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import common


class ResolveOutputs(NamedTuple):
  slot_pos: jax.Array  # i32[..., B]  position held by each regular slot, -1 empty
  lru: jax.Array  # i32[..., B]  slot ids, least recently used first
  slot: jax.Array  # i32[..., k]  slot serving each selected entry (B: newest, -1: pad)
  is_miss: jax.Array  # bool[..., k]


def _compare_held(slot_pos, selected, wanted):
  # slot_pos: i32[B], selected, wanted: [k] -> i32[k] slot holding each entry, -1 none
  eq = (slot_pos[None, :] == selected[:, None]) & wanted[:, None]  # [k, B]
  return jnp.where(eq.any(-1), jnp.argmax(eq, axis=-1), -1).astype(jnp.int32)


def _resolve_row(slot_pos, lru, selected, newest, held, key):
  # slot_pos, lru: i32[B]; selected: i32[k]; newest: i32[]; held: i32[k] or None;
  # key: f[B] retention key (victims: lowest first) or None for LRU.
  num_slots = slot_pos.shape[0]
  valid = selected >= 0
  is_newest = valid & (selected == newest)
  wanted = valid & ~is_newest  # entries that must come from a regular slot
  slot_ids = jnp.arange(num_slots, dtype=jnp.int32)
  hit_slot = _compare_held(slot_pos, selected, wanted) if held is None else jnp.where(
      wanted, held, -1)
  is_held = wanted & (hit_slot >= 0)
  is_hit_slot = jnp.zeros((num_slots,), bool).at[
      jnp.where(is_held, hit_slot, num_slots)].set(True, mode="drop")
  hit_lru = is_hit_slot[lru]  # bool[B]

  miss = wanted & ~is_held  # bool[k]
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
    # Hits sort last at +inf: an evictable's key is clamped below it (+inf, NaN),
    # so no hit is ever taken (a tie with the hits would be ordered among them).
    key = key.astype(jnp.promote_types(key.dtype, jnp.float32))
    top = jnp.finfo(key.dtype).max
    key = jnp.where(slot_pos < 0, -jnp.inf, jnp.where(jnp.isnan(key), top,
                                                      jnp.minimum(key, top)))
    key_lru = jnp.where(hit_lru, jnp.inf, key[lru])
    order = jnp.argsort(key_lru, stable=True)  # evictables by (key, LRU)
    rank = jnp.zeros_like(lru).at[order].set(slot_ids)
    taken = ~hit_lru & (rank < num_miss)
    kept_rank = jnp.cumsum(~hit_lru & ~taken, dtype=jnp.int32) - 1
    new_index = jnp.where(hit_lru, num_evict + hit_rank,
                          jnp.where(taken, num_evict - num_miss + rank, kept_rank))
    victim = lru[order[jnp.where(miss, miss_rank, 0)]]
  new_lru = jnp.zeros_like(lru).at[new_index].set(lru, unique_indices=True)

  slot = jnp.where(miss, victim,
                   jnp.where(is_held, hit_slot, jnp.where(is_newest, num_slots, -1)))
  new_slot_pos = slot_pos.at[jnp.where(miss, victim, num_slots)].set(
      selected, mode="drop")
  return ResolveOutputs(new_slot_pos, new_lru, slot.astype(jnp.int32), miss)


@jax.jit
def cache_resolve_reference(slot_pos, lru, selected, newest, held=None,
                            key=None) -> ResolveOutputs:
  """RESOLVE over any leading batch dims ``...``; see the module docstring.

  Args:
    slot_pos: i32[..., B] position held by each regular slot, -1 when empty.
    lru: i32[..., B] permutation of slot ids, least recently used first.
    selected: i32[..., k] distinct positions wanted this step, -1 = padding.
    newest: i32[...] the newest position (served by reserved slot ``B``).
    held: optional i32[..., k]: the slot holding each selected position (-1 none),
      from the caller's membership lookup; read only where an entry is wanted.
    key: optional f[..., B] per-slot retention key (victims: lowest first).
  """
  common.check_slots(slot_pos.shape[-1], selected.shape[-1])
  batch = slot_pos.shape[:-1]
  flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[len(batch):])
  out = jax.vmap(_resolve_row)(flat(slot_pos), flat(lru), flat(selected), flat(newest),
                      flat(held), flat(key))
  return ResolveOutputs(*(x.reshape(batch + x.shape[1:]) for x in out))


def install_newest(slot_pos, lru, newest):
  """Also keep the newest position in a regular slot when one is empty.

  While a request is shorter than B this keeps every position resident (slot i
  holds position i), so short contexts never fetch. The lowest-index empty slot is
  used and becomes most recently used. Rows without an empty slot are unchanged.

  Returns:
    (slot_pos, lru, target) with target i32[...] the slot written, -1 for none.
  """
  num_slots = slot_pos.shape[-1]
  empty = slot_pos == -1
  has_empty = empty.any(-1)
  target = jnp.where(has_empty, jnp.argmax(empty, axis=-1), -1).astype(jnp.int32)
  is_target = lru == target[..., None]  # no match when target == -1
  # The target moves to the back; entries after it shift forward by one.
  index = jnp.arange(num_slots, dtype=jnp.int32)
  after = index > jnp.argmax(is_target, axis=-1)[..., None]
  dest = jnp.where(is_target, num_slots - 1, index - after)
  moved = jnp.put_along_axis(jnp.zeros_like(lru), dest, lru, axis=-1, inplace=False)
  new_lru = jnp.where(has_empty[..., None], moved, lru)
  new_slot_pos = jnp.where(
      jnp.arange(num_slots) == target[..., None], newest[..., None], slot_pos)
  return new_slot_pos, new_lru, target
