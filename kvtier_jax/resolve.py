"""RESOLVE: map a step's selected positions onto hot slots (the public contract).

``resolve`` finds hits, picks victims for misses, updates the slot metadata and
says which slot serves each selected entry; the caller fetches the misses. The
algorithm is the kernel's reference (``pallas_kernels/cache_resolve``); the XLA
path feeds it the membership lookup of ``lookup.py`` and, under a keyed policy,
the retention key of ``policies.py``. This module validates and dispatches.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax import lookup, policies
from kvtier_jax.policies import PolicyConfig
from kvtier_jax.shapes import EMPTY, LruOrder, Newest, Selected, SlotPos
from pallas_kernels import common
from pallas_kernels.cache_resolve import (ResolveOutputs, cache_resolve_reference,
                                          install_newest)
# Bits of the status word a decode step returns (defined beside the kernels that
# compute them).
from pallas_kernels.common import STATUS_CAPACITY, STATUS_DUPLICATE, STATUS_OUT_OF_RANGE

__all__ = ["ResolveOutputs", "resolve", "resolve_with_policy", "install_newest",
           "selection_errors", "check_selection", "STATUS_OUT_OF_RANGE",
           "STATUS_DUPLICATE", "STATUS_CAPACITY"]


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
  common.check_slots(slot_pos.shape[-1], selected.shape[-1])


def check_selection(selected, newest) -> None:
  """Raise ``ValueError`` on out-of-range or duplicate selections (concrete values).

  Valid entries are ``-1`` (padding) or positions in ``[0, newest]`` (no upper
  bound where ``newest < 0``), distinct within a row.
  """
  selected = np.asarray(selected)
  if selected.dtype.kind not in "iu":  # int32() would truncate 1.9 to 1
    raise ValueError(f"selections must be integers, not {selected.dtype}")
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


def _validated(slot_pos, lru, selected, newest, num_positions=None):
  slot_pos, lru, selected, newest = map(jnp.asarray, (slot_pos, lru, selected, newest))
  _check_shapes(slot_pos, lru, selected, newest)
  if _is_concrete(slot_pos, lru, selected, newest):
    check_selection(selected, newest)
    _check_metadata(slot_pos, lru)
    # The map lookup drops positions past its table: a held one would read as a miss.
    top = max(int(np.max(x, initial=-1)) for x in (slot_pos, selected, newest))
    if num_positions is not None and top >= num_positions:
      raise ValueError(f"position {top} is outside num_positions={num_positions}")
  return tuple(x.astype(jnp.int32) for x in (slot_pos, lru, selected, newest))


def selection_errors(selected, newest, num_positions: int | None = None,
                     method: str = "auto"):
  """In-jit counterpart of ``check_selection``: status bits per row, i32[...].

  ``num_positions`` bounds valid positions (the map lookup's table size).
  """
  bad_range = (selected < EMPTY) | ((newest[..., None] >= 0) &
                                     (selected > newest[..., None]))
  dup = lookup.duplicate_mask(selected, method=method, num_positions=num_positions)
  return (jnp.where(bad_range.any(-1), STATUS_OUT_OF_RANGE, 0)
          | jnp.where(dup.any(-1), STATUS_DUPLICATE, 0)).astype(jnp.int32)


def resolve(slot_pos: SlotPos, lru: LruOrder, selected: Selected, newest: Newest, *,
            impl: str = "xla", interpret: bool | None = None, lookup_method: str = "auto",
            num_positions: int | None = None) -> ResolveOutputs:
  """One LRU RESOLVE step over any leading batch dims ``...``.

  Args:
    slot_pos: i32[..., B] position held by each regular slot, -1 empty.
    lru: i32[..., B] slot ids, least recently used first.
    selected: i32[..., k] distinct positions wanted now, -1 = padding.
    newest: i32[...] the newest position; it is always served by reserved slot B.
    impl: "xla" (jnp), "pallas" (the fused kernel; interpreted off GPU) or "auto".
    interpret: override Pallas interpret mode.
    lookup_method: membership lookup of the XLA path ("auto", "map", "search";
      lookup.py); results are identical.
    num_positions: a bound on every position (the "map" lookup's table size),
      e.g. the host tier length.

  Returns:
    ``ResolveOutputs(slot_pos, lru, slot, is_miss)``: updated metadata, the slot that
    holds each selected entry after the step (B for the newest, -1 for padding) and
    whether it must be fetched from the host tier.

  Raises:
    ValueError: at trace time on malformed shapes/dtypes or ``B < k``; and, when the
      inputs are concrete, on out-of-range or duplicate selections and invalid
      metadata.
  """
  args = _validated(slot_pos, lru, selected, newest, num_positions)
  if common.use_kernel(impl, "resolve"):
    from pallas_kernels.cache_resolve import cache_resolve
    interp = common.interpret_mode() if interpret is None else interpret
    return cache_resolve(*args, interpret=interp)
  return _resolve_xla(*args, method=lookup_method, num_positions=num_positions)


@functools.partial(jax.jit, static_argnames=("method", "num_positions"))
def _resolve_xla(slot_pos, lru, selected, newest, key=None, *, method, num_positions):
  wanted = (selected >= 0) & (selected != newest[..., None])
  held = lookup.find_held(slot_pos, selected, wanted, method=method,
                          num_positions=num_positions)
  return cache_resolve_reference(slot_pos, lru, selected, newest, held, key)


def resolve_with_policy(policy: PolicyConfig, slot_pos: SlotPos, lru: LruOrder, score,
                        selected: Selected, newest: Newest, ranks=None, *,
                        impl: str = "xla", interpret: bool | None = None,
                        lookup_method: str = "auto",
                        num_positions: int | None = None):
  """RESOLVE under a replacement policy: same contract and validation as
  ``resolve``; only the victims differ (policies.py).

  Args:
    policy: the policy (its name and parameters).
    score: f[..., B] the per-slot selection EMA ("freq", "rank"; start from
      zeros); passed through unchanged under "lru".
    ranks: i32[..., m] the selector's best-first ranking ("rank"; default: the
      selection's own order).

  Returns:
    (ResolveOutputs, new score). Under "freq" the victims equal
    ``cache_sim.replay(..., "freq", alpha=...)``'s and under "rank"
    ``cache_sim.replay(..., "rank", ranks=..., rank_freq=..., alpha=...)``'s.
  """
  if not policy.keyed:
    return resolve(slot_pos, lru, selected, newest, impl=impl, interpret=interpret,
                   lookup_method=lookup_method, num_positions=num_positions), score
  args = _validated(slot_pos, lru, selected, newest, num_positions)
  score = jnp.asarray(score)
  if score.shape != args[0].shape:
    raise ValueError(f"score {score.shape} must match slot_pos {args[0].shape}")
  ranks = args[2] if ranks is None else jnp.asarray(ranks)
  if ranks.ndim != args[0].ndim or ranks.shape[:-1] != args[0].shape[:-1]:
    raise ValueError(f"ranks {ranks.shape} must be [..., m] with the batch dims of "
                     f"slot_pos {args[0].shape}")
  method = lookup.choose(lookup_method, num_positions, math.prod(args[0].shape[:-1]))
  key = policies.victim_key(policy, args[0], score, ranks, method=method,
                            num_positions=num_positions)
  out = _resolve_xla(*args, key, method=method, num_positions=num_positions)
  return out, policies.next_score(policy, score, out.slot, out.is_miss)
