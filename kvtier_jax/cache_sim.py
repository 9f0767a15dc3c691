"""Trace replay of hot-cache replacement policies (pure numpy).

Questions like "how many fetches would a bigger hot cache, or another policy, save
on this selection trace?" need many replays of long traces, so ``replay`` runs on
the host in numpy rather than stepping the jitted ``resolve``. It is vectorised
across independent streams (layers, requests, units): each step is a handful of
``[S, B]`` array ops, with one Python iteration per step.

``"lru"`` reproduces ``kvtier_jax.resolve.resolve`` miss for miss (the newest-token
slot aside), so replayed counts are what the decode loop would fetch. ``"belady"``
is the offline optimum, a lower bound for every policy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["POLICIES", "OFFLINE_POLICIES", "replay"]

POLICIES = ("lru", "fifo", "random", "belady")
OFFLINE_POLICIES = ("belady",)  # these read the future of the trace

_PAD = -1


def _validate(selections, capacity, policy) -> np.ndarray:
  """Checks every documented precondition; returns the selections as an array."""
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
  sel = np.asarray(selections)
  if not np.issubdtype(sel.dtype, np.integer):
    raise ValueError(f"selections must be an integer array, got dtype {sel.dtype}")
  if sel.ndim < 2:
    raise ValueError(f"selections must have shape [..., T, k], got {sel.shape}")
  if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
    raise ValueError(f"capacity must be an int, got {capacity!r}")
  k = sel.shape[-1]
  if capacity < max(k, 1):
    raise ValueError(f"capacity={capacity} slots cannot hold the k={k} positions "
                     "one step requests at once: need capacity >= k (and >= 1)")
  if (sel < _PAD).any():
    where = tuple(int(i) for i in np.argwhere(sel < _PAD)[0])
    raise ValueError(f"selections{list(where)} = {int(sel[where])}: entries must "
                     "be positions >= 0 or -1 (padding)")
  srt = np.sort(sel, axis=-1)
  dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
  if dup.any():
    where = tuple(int(i) for i in np.argwhere(dup)[0])
    raise ValueError(f"position {int(srt[where])} appears twice in selections row "
                     f"{list(where[:-1])}; a step's positions must be distinct")
  return sel


def _dense_ids(sel: np.ndarray) -> tuple[np.ndarray, int]:
  """Relabels positions per stream so the position->slot tables stay small.

  Every policy only compares positions for equality, so any injective relabeling
  leaves the miss counts unchanged. Sparse position spaces (say offsets of 2**40)
  would otherwise need a huge table; dense ones are kept as they are.

  Args:
    sel: i64[T, S, k] positions, -1 padding.

  Returns:
    (ids, num_pos): i64[T, S, k] with ids in [0, num_pos) and padding mapped to
    ``num_pos``, a column of the tables that never holds a slot.
  """
  num_steps, num_streams, k = sel.shape
  top = int(sel.max(initial=_PAD)) + 1
  if top <= 4 * num_steps * k + 1024:
    return np.where(sel >= 0, sel, top), top
  flat = np.moveaxis(sel, 1, 0).reshape(num_streams, -1)  # i64[S, T*k]
  order = np.argsort(flat, axis=1)
  srt = np.take_along_axis(flat, order, axis=1)
  new = np.zeros(srt.shape, np.int64)
  new[:, 1:] = np.cumsum(srt[:, 1:] != srt[:, :-1], axis=1)
  ids = np.empty_like(new)
  np.put_along_axis(ids, order, new, axis=1)
  ids = np.moveaxis(ids.reshape(num_streams, num_steps, k), 0, 1)
  num_pos = int(new[:, -1].max()) + 1
  return np.where(sel >= 0, ids, num_pos), num_pos


def _next_use(sel: np.ndarray, num_pos: int) -> np.ndarray:
  """i32[T, S, k]: the next step that requests each entry again, T for never.

  One reverse scan with a per-stream "last seen" table; padding entries share the
  padding column and get meaningless values that are never read.
  """
  num_steps, num_streams, _ = sel.shape
  rows = np.arange(num_streams)[:, None]
  last = np.full((num_streams, num_pos + 1), num_steps, np.int32)
  nxt = np.empty(sel.shape, np.int32)
  for t in range(num_steps - 1, -1, -1):
    nxt[t] = last[rows, sel[t]]
    last[rows, sel[t]] = t
  return nxt


def _queue_step(order, hit_slot, num_miss, lru: bool):
  """Advances an LRU/FIFO queue by one step; returns (new order, victims' start).

  ``order[s]`` is a permutation of slot ids, front evicted first (initially slot
  order, all empty). Evictable slots are the non-hits; the j-th miss takes the
  j-th evictable in queue order. Both policies are a *stable* partition of the old
  queue, so keying a stable sort by group reproduces the resolve rule exactly:

  * lru:  [evictables not taken] ++ [victims] ++ [hits]
  * fifo: [everything not taken, hits staying in place] ++ [victims]

  Victims keep their old relative order, which is miss order (the j-th miss took
  the j-th), so the fetched positions sit in selection order, and the j-th miss's
  slot is ``new_order[start + j]``.
  """
  hit_q = np.take_along_axis(hit_slot, order, axis=1)  # bool[S, B] in queue order
  ev_rank = np.cumsum(~hit_q, axis=1) - 1  # rank among evictables
  victim_q = ~hit_q & (ev_rank < num_miss[:, None])
  group = victim_q.astype(np.int8)
  if lru:
    group += 2 * hit_q
  new_order = np.take_along_axis(
      order, np.argsort(group, axis=1, kind="stable"), axis=1)
  num_slots = order.shape[1]
  start = num_slots - num_miss
  if lru:
    start -= hit_q.sum(axis=1)
  return new_order, start


def replay(selections, capacity: int, policy: str, *, seed: int = 0) -> np.ndarray:
  """Misses per step of a hot cache of ``capacity`` slots replaying a trace.

  Demand paging: every step's positions must be resident together, so nothing the
  current step requests is evicted; the cache starts empty.

  Policies (``POLICIES``):

  * ``"lru"``: exactly ``resolve``'s order (see ``_queue_step``); hits are promoted
    above the freshly fetched misses.
  * ``"fifo"``: evict the earliest inserted (empty slots first, in slot order);
    misses are inserted in selection order, hits do not reorder.
  * ``"random"``: fill empty slots in slot order, then evict uniformly at random.
    Draws: each step takes ``rng.random((S, capacity))`` from
    ``np.random.default_rng(seed)`` (S = the batch dims flattened in C order) and
    a miss takes the untaken evictable filled slot with the smallest key; so
    counts are deterministic per seed and a prefix never depends on the future.
  * ``"belady"`` (offline, ``OFFLINE_POLICIES``): fill empty slots, then evict the
    entry requested again furthest in the future (never = infinitely far).

  Args:
    selections: int[..., T, k] positions requested at each step, distinct within a
      row, -1 = padding. Leading dims are independent streams (e.g. layers).
    capacity: hot slots per stream, >= k.
    policy: one of ``POLICIES``.
    seed: seeds the ``"random"`` policy; ignored otherwise.

  Returns:
    i64[..., T] misses (fetches) per stream and step.

  Raises:
    ValueError: on a non-integer dtype, rank < 2, entries < -1, a position twice in
      a row, ``capacity < k`` or an unknown policy.
  """
  sel = _validate(selections, capacity, policy)
  batch, (num_steps, k) = sel.shape[:-2], sel.shape[-2:]
  num_streams, num_slots = int(np.prod(batch, dtype=np.int64)), int(capacity)
  out = np.zeros((num_steps, num_streams), np.int64)  # i64[T, S]
  if num_steps == 0 or k == 0 or num_streams == 0:
    return np.moveaxis(out, 0, -1).reshape(batch + (num_steps,))
  sel = np.moveaxis(sel.reshape(num_streams, num_steps, k).astype(np.int64), 1, 0)
  sel, num_pos = _dense_ids(sel)  # i64[T, S, k], padding = num_pos

  rows = np.arange(num_streams)[:, None]
  slot_ids = np.arange(num_slots)
  slot_pos = np.full((num_streams, num_slots), _PAD, np.int64)  # slot -> position
  slot_of = np.full((num_streams, num_pos + 1), _PAD, np.int64)  # position -> slot
  order = np.broadcast_to(slot_ids, slot_pos.shape).copy()  # lru/fifo queue
  if policy == "belady":
    nxt = _next_use(sel, num_pos)  # i32[T, S, k]
    slot_next = np.zeros(slot_pos.shape, np.int64)  # next use of each slot's entry
  rng = np.random.default_rng(seed)

  for t in range(num_steps):
    cur = sel[t]  # i64[S, k]
    valid = cur < num_pos
    held = slot_of[rows, cur]  # i64[S, k] slot of each entry, -1 if not resident
    miss = valid & (held < 0)
    hit = valid & ~miss
    num_miss = miss.sum(axis=1)  # i64[S]
    out[t] = num_miss
    hit_slot = np.zeros((num_streams, num_slots + 1), bool)
    hit_slot[rows, np.where(hit, held, num_slots)] = True
    hit_slot = hit_slot[:, :num_slots]  # bool[S, B] pinned this step

    if policy in ("lru", "fifo"):
      order, start = _queue_step(order, hit_slot, num_miss, policy == "lru")
      pick = order  # i64[S, B]; the j-th miss takes pick[start + j]
    else:
      # Keys sorted ascending give the eviction preference: empty slots first in
      # slot order (keys below every filled key), then filled ones, hits last.
      empty = slot_pos < 0
      if policy == "random":
        draws = rng.random(slot_pos.shape)  # every step: draws depend on shape only
        keys = np.where(empty, slot_ids - num_slots, draws)
        keys[hit_slot] = 2.0
      else:
        # Furthest next use first. Ties (entries wanted together at the same
        # later step, or never again) do not change the count, see the tests.
        keys = np.where(empty, slot_ids - num_slots - num_steps - 1, -slot_next)
        keys[hit_slot] = num_steps + 1
      pick = np.argsort(keys, axis=1)
      start = np.zeros(num_streams, np.int64)
    rank = np.cumsum(miss, axis=1) - 1 + start[:, None]  # i64[S, k]
    victim = np.take_along_axis(pick, np.where(miss, rank, 0), axis=1)

    rr, cc = np.nonzero(miss)
    slot = victim[rr, cc]
    old = slot_pos[rr, slot]  # a victim never holds a requested position
    slot_of[rr, np.where(old >= 0, old, num_pos)] = _PAD
    slot_of[rr, cur[rr, cc]] = slot
    slot_pos[rr, slot] = cur[rr, cc]
    if policy == "belady":
      vr, vc = np.nonzero(valid)
      slot_next[vr, np.where(miss, victim, held)[vr, vc]] = nxt[t][vr, vc]

  return np.moveaxis(out, 0, -1).reshape(batch + (num_steps,))
