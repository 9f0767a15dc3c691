"""RESOLVE: map a step's selected positions onto hot slots (public contract).

``resolve`` finds hits, picks LRU victims for misses, updates the slot metadata and
says which slot serves each selected entry; the caller fetches the misses. The
algorithm lives beside its kernel in ``pallas_kernels/cache_resolve`` (the jnp
reference doubles as the XLA path); this module validates and dispatches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax.shapes import EMPTY, LruOrder, Newest, Selected, SlotPos
from pallas_kernels import common
from pallas_kernels.cache_resolve import (ResolveOutputs, cache_resolve_freq_reference,
                                          cache_resolve_keyed_reference,
                                          cache_resolve_reference)
from pallas_kernels.cache_resolve.reference import (SEARCH_METHOD, freq_update,
                                                   position_table, table_lookup)

__all__ = ["ResolveOutputs", "resolve", "resolve_freq", "resolve_ranked", "rank_of",
           "install_newest",
           "selection_errors", "check_selection"]

# Bits of the status word a decode step returns.
STATUS_OUT_OF_RANGE = 1
STATUS_DUPLICATE = 2
STATUS_CAPACITY = 4


def _is_concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_shapes(slot_pos, lru, selected, newest):
  for name, x in (("slot_pos", slot_pos), ("lru", lru), ("selected", selected),
                  ("newest", newest)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array, got {x.dtype}")
  if slot_pos.ndim < 1 or slot_pos.shape != lru.shape:
    raise ValueError(f"slot_pos {slot_pos.shape} and lru {lru.shape} must have the "
                     "same shape [..., B]")
  if selected.shape[:-1] != slot_pos.shape[:-1] or selected.ndim != slot_pos.ndim:
    raise ValueError(f"selected {selected.shape} must be [..., k] with the batch "
                     f"dims of slot_pos {slot_pos.shape}")
  if newest.shape != slot_pos.shape[:-1]:
    raise ValueError(f"newest {newest.shape} must have shape {slot_pos.shape[:-1]}")
  num_slots, num_sel = slot_pos.shape[-1], selected.shape[-1]
  if num_slots < num_sel:
    raise ValueError(f"B={num_slots} hot slots cannot serve k={num_sel} selected "
                     "positions in one step: B must be >= k")


def check_selection(selected, newest) -> None:
  """Raise ``ValueError`` on out-of-range or duplicate selections (concrete values).

  Valid entries are ``-1`` (padding) or positions in ``[0, newest]`` (no upper
  bound where ``newest < 0``), distinct within a row.
  """
  selected = np.asarray(selected)
  newest = np.broadcast_to(np.asarray(newest), selected.shape[:-1])[..., None]
  bad = (selected < EMPTY) | ((newest >= 0) & (selected > newest))
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"selected position {int(selected[where])} at index {where} is "
                     f"out of range (valid: -1 or 0..newest={int(newest[where[:-1]][0])})")
  srt = np.sort(selected, axis=-1)
  dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
  if dup.any():
    where = tuple(int(i) for i in np.argwhere(dup)[0])
    raise ValueError(f"selected position {int(srt[where])} appears twice in row "
                     f"{where[:-1]}; selections must be distinct")


def _check_metadata(slot_pos, lru) -> None:
  slot_pos, lru = np.asarray(slot_pos), np.asarray(lru)
  num_slots = lru.shape[-1]
  if not (np.sort(lru, axis=-1) == np.arange(num_slots)).all():
    raise ValueError("lru must be a permutation of 0..B-1 in every row")
  if (slot_pos < EMPTY).any():
    raise ValueError("slot_pos entries must be -1 (empty) or positions >= 0")
  srt = np.sort(slot_pos, axis=-1)
  if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
    raise ValueError("a position is held by two slots of the same row")


def selection_errors(selected, newest, num_positions: int | None = None):
  """In-jit counterpart of ``check_selection``: status bits per row, i32[...].

  With ``num_positions`` (a bound on valid positions) and room under
  ``common.MAP_SCRATCH_BYTES``, duplicates are found by scattering each entry's
  lane into a position map and reading it back (a lane that reads another lane's
  index shares its position), instead of sorting the selection.
  """
  bad_range = (selected < EMPTY) | ((newest[..., None] >= 0) &
                                     (selected > newest[..., None]))
  rows = int(np.prod(selected.shape[:-1]))
  if common.xla_lookup("auto", num_positions, rows) == "map":
    lane = jnp.broadcast_to(jnp.arange(selected.shape[-1], dtype=jnp.int32),
                            selected.shape)
    owner = table_lookup(position_table(selected, lane, num_positions, -1), selected, -1)
    dup = (owner >= 0) & (owner != lane)
  else:
    srt = jnp.sort(selected, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
  return (jnp.where(bad_range.any(-1), STATUS_OUT_OF_RANGE, 0)
          | jnp.where(dup.any(-1), STATUS_DUPLICATE, 0)).astype(jnp.int32)


def resolve(slot_pos: SlotPos, lru: LruOrder, selected: Selected, newest: Newest, *,
            impl: str = "xla", interpret: bool | None = None, lookup: str = "auto",
            num_positions: int | None = None) -> ResolveOutputs:
  """One RESOLVE step over any leading batch dims ``...``.

  Args:
    slot_pos: i32[..., B] position held by each regular slot, -1 empty.
    lru: i32[..., B] slot ids, least recently used first.
    selected: i32[..., k] distinct positions wanted now, -1 = padding.
    newest: i32[...] the newest position; it is always served by reserved slot B.
    impl: "xla" (jnp), "pallas" (the fused kernel; interpreted off GPU) or "auto".
    interpret: override Pallas interpret mode.
    lookup: membership lookup of the XLA path ("auto", "scan", "unrolled", "sort"
      or "map"; pallas_kernels/cache_resolve/reference.py); results are identical.
    num_positions: a bound on every position (``"map"`` allocates this many
      entries per row), e.g. the host tier length.

  Returns:
    ``ResolveOutputs(slot_pos, lru, slot, is_miss)``: updated metadata, the slot that
    holds each selected entry after the step (B for the newest, -1 for padding) and
    whether it must be fetched from the host tier.

  Raises:
    ValueError: at trace time on malformed shapes/dtypes or ``B < k``; and, when the
      inputs are concrete, on out-of-range or duplicate selections and invalid
      metadata.
  """
  slot_pos, lru, selected, newest = map(jnp.asarray, (slot_pos, lru, selected, newest))
  _check_shapes(slot_pos, lru, selected, newest)
  if _is_concrete(slot_pos, lru, selected, newest):
    check_selection(selected, newest)
    _check_metadata(slot_pos, lru)
  args = tuple(x.astype(jnp.int32) for x in (slot_pos, lru, selected, newest))
  if common.use_kernel(impl, "resolve"):
    from pallas_kernels.cache_resolve.kernel import cache_resolve
    interp = common.interpret_mode() if interpret is None else interpret
    return cache_resolve(*args, interpret=interp)
  rows = int(np.prod(slot_pos.shape[:-1]))
  return cache_resolve_reference(
      *args, lookup=common.xla_lookup(lookup, num_positions, rows),
      num_positions=num_positions)


def resolve_freq(slot_pos: SlotPos, lru: LruOrder, score, selected: Selected,
                 newest: Newest, *, alpha: float = 0.9, lookup: str = "auto",
                 num_positions: int | None = None):
  """RESOLVE with the frequency-aware victim order (policy ``"freq"``).

  Same contract, validation and ``lookup`` as ``resolve`` plus ``score`` f[..., B], the
  per-slot selection frequency (start from zeros); only the victims differ: the
  evictable slots with the lowest score, empty ones first, ties in LRU order
  (exactly ``cache_sim.replay(..., "freq", alpha=alpha)``).

  Returns (ResolveOutputs, new score).
  """
  slot_pos, lru, selected, newest = map(jnp.asarray, (slot_pos, lru, selected, newest))
  score = jnp.asarray(score)
  _check_shapes(slot_pos, lru, selected, newest)
  if score.shape != slot_pos.shape:
    raise ValueError(f"score {score.shape} must match slot_pos {slot_pos.shape}")
  if _is_concrete(slot_pos, lru, selected, newest):
    check_selection(selected, newest)
    _check_metadata(slot_pos, lru)
  args = tuple(x.astype(jnp.int32) for x in (slot_pos, lru))
  return cache_resolve_freq_reference(*args, score, selected.astype(jnp.int32),
                                      newest.astype(jnp.int32), alpha=alpha,
                                      lookup=common.xla_lookup(
                                          lookup, num_positions,
                                          int(np.prod(slot_pos.shape[:-1]))),
                                      num_positions=num_positions)


def rank_of(slot_pos, ranks, num_positions: int | None = None):
  """i32[..., B]: each slot's position's index in ``ranks`` i32[..., m] (best
  first, -1 padding); m for empty slots and positions not ranked.

  A dense position map where it fits (``num_positions`` bounds positions), else one
  sort of the ranking and a binary search per slot.
  """
  num_ranked = ranks.shape[-1]
  rows = int(np.prod(slot_pos.shape[:-1]))
  lookup = common.xla_lookup("auto", num_positions, rows)
  if lookup == "map":
    order = jnp.broadcast_to(jnp.arange(num_ranked, dtype=jnp.int32), ranks.shape)
    table = position_table(ranks, order, num_positions, num_ranked)
    return table_lookup(table, slot_pos, num_ranked)
  flat_pos, flat_ranks = slot_pos.reshape(rows, -1), ranks.reshape(rows, -1)
  masked = jnp.where(flat_ranks >= 0, flat_ranks, jnp.iinfo(jnp.int32).max)
  srt_at = jnp.argsort(masked, axis=-1)
  srt = jnp.take_along_axis(masked, srt_at, axis=-1)
  search = jax.vmap(lambda a, v: jnp.searchsorted(a, v, method=SEARCH_METHOD[lookup]))
  at = jnp.minimum(search(srt, flat_pos), num_ranked - 1)
  hit = (flat_pos >= 0) & (jnp.take_along_axis(srt, at, axis=-1) == flat_pos)
  found = jnp.take_along_axis(srt_at, at, axis=-1).astype(jnp.int32)
  return jnp.where(hit, found, num_ranked).reshape(slot_pos.shape)


def resolve_ranked(slot_pos: SlotPos, lru: LruOrder, score, ranks, selected: Selected,
                   newest: Newest, *, alpha: float = 0.9, rank_freq: float = 0.3,
                   lookup: str = "auto", num_positions: int | None = None):
  """RESOLVE with the rank-aware victim order (policy ``"rank"``).

  Same contract, validation and ``lookup`` as ``resolve``, plus ``score`` f[..., B]
  (the "freq" EMA of each slot, as in ``resolve_freq``; start from zeros) and
  ``ranks`` i32[..., m]: the selector's current preference order (best first, -1
  padding, m >= 1; a top-m ranking whose first k entries are ``selected``, for
  instance). Only the victims differ: empty slots first, then the lowest
  ``(1 - r / m) + rank_freq * score``, r the slot position's index in ``ranks`` (m
  if absent), ties in LRU order (exactly ``cache_sim.replay(..., "rank",
  ranks=..., rank_freq=..., alpha=...)``).

  Returns (ResolveOutputs, new score).
  """
  slot_pos, lru, selected, newest, ranks, score = map(
      jnp.asarray, (slot_pos, lru, selected, newest, ranks, score))
  _check_shapes(slot_pos, lru, selected, newest)
  if ranks.ndim != slot_pos.ndim or ranks.shape[:-1] != slot_pos.shape[:-1]:
    raise ValueError(f"ranks {ranks.shape} must be [..., m] with the batch dims of "
                     f"slot_pos {slot_pos.shape}")
  if score.shape != slot_pos.shape:
    raise ValueError(f"score {score.shape} must match slot_pos {slot_pos.shape}")
  if _is_concrete(slot_pos, lru, selected, newest, ranks):
    check_selection(selected, newest)
    _check_metadata(slot_pos, lru)
  rows = int(np.prod(slot_pos.shape[:-1]))
  num_ranked = ranks.shape[-1]
  rank = rank_of(slot_pos, ranks.astype(jnp.int32), num_positions)
  key = (1.0 - rank.astype(score.dtype) / num_ranked) + rank_freq * score
  out, is_hit_slot = cache_resolve_keyed_reference(
      slot_pos.astype(jnp.int32), lru.astype(jnp.int32), key,
      selected.astype(jnp.int32), newest.astype(jnp.int32),
      lookup=common.xla_lookup(lookup, num_positions, rows), num_positions=num_positions)
  return out, freq_update(score, is_hit_slot, out, alpha)


def install_newest(slot_pos, lru, newest):
  """Also keep the newest position in a regular slot when one is empty.

  While a request is shorter than B this keeps every position resident (slot i
  holds position i), so short contexts never fetch. The lowest-index empty slot is
  used and becomes most recently used. Rows without an empty slot are unchanged.

  Returns:
    (slot_pos, lru, target) with target i32[...] the slot written, -1 for none.
  """
  num_slots = slot_pos.shape[-1]
  empty = slot_pos == EMPTY
  has_empty = empty.any(-1)
  target = jnp.where(has_empty, jnp.argmax(empty, axis=-1), EMPTY).astype(jnp.int32)
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
