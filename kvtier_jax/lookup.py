"""Membership lookups: where a position sits in a row of positions (the one module).

RESOLVE (which slot holds each selected position), the in-step duplicate check,
residency tests (lookahead prefetch, the draft pass's cap) and the rank policy (a
slot's position's rank in the selector's ranking) all ask the same question: for
each query position, its index in a row of distinct key positions. Two methods
give identical answers at different costs (docs/DESIGN.md, "Membership lookups"):

* ``"map"``: scatter the keys into a dense position -> index table of
  ``num_positions`` entries per row, then gather the queries: no sort, O(keys +
  queries) work, ``rows x num_positions x 4`` bytes of scratch. The fastest on CPU
  (3.6x a binary search at B=4096, k=2048, 32K positions) and on an H200.
* ``"search"``: sort the keys, then an unrolled binary search per query (no scratch
  beyond the row; ``jnp.searchsorted``'s rolled loop is 3x slower on an H200).

``"auto"`` picks the map wherever its scratch fits ``MAP_SCRATCH_BYTES``.
Positions are ``>= 0``; ``-1`` is padding and is never found.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvtier_jax.shapes import EMPTY

METHODS = ("map", "search")
# Scratch bound of the map lookups per call (rows x positions x 4 bytes).
MAP_SCRATCH_BYTES = 256 * 2**20


def choose(method: str, num_positions: int | None, rows: int) -> str:
  """The method ``method`` ("auto" or a name) resolves to for ``rows`` rows."""
  if method not in ("auto",) + METHODS:
    raise ValueError(f"lookup {method=} must be 'auto' or one of {METHODS}")
  if method == "map" and (num_positions is None or num_positions < 1):
    raise ValueError("lookup='map' needs num_positions, a bound on every position")
  if method != "auto":
    return method
  fits = num_positions is not None and rows * num_positions * 4 <= MAP_SCRATCH_BYTES
  return "map" if fits else "search"


def _rows(x) -> int:
  return math.prod(x.shape[:-1])


def position_table(keys, values, num_positions: int, fill: int, *, smallest=False):
  """i32[..., P]: ``table[..., keys[..., j]] = values[..., j]`` per row, ``fill``
  elsewhere; keys outside ``[0, P)`` (-1 padding) are dropped. Duplicate keys keep
  one of their values (which one, the backend's scatter decides), or the smallest
  with ``smallest`` (a scatter-min, deterministic on every backend; ``fill`` must
  then exceed every value)."""
  flat_keys = keys.reshape(-1, keys.shape[-1])
  row = jnp.arange(flat_keys.shape[0], dtype=jnp.int32)[:, None]
  # Padding goes to P, past the end, and is dropped (-1 would wrap to P - 1).
  col = jnp.where((flat_keys >= 0) & (flat_keys < num_positions), flat_keys,
                  num_positions)
  values = values.reshape(flat_keys.shape).astype(jnp.int32)
  table = jnp.full((flat_keys.shape[0], num_positions), fill, jnp.int32).at[row, col]
  table = (table.min(values, mode="drop") if smallest
           else table.set(values, mode="drop"))
  return table.reshape(keys.shape[:-1] + (num_positions,))


def table_lookup(table, queries, fill: int):
  """i32[..., n]: ``table[..., queries]`` per row, ``fill`` outside the table."""
  num_positions = table.shape[-1]
  flat = queries.reshape(-1, queries.shape[-1])
  row = jnp.arange(flat.shape[0], dtype=jnp.int32)[:, None]
  got = table.reshape(-1, num_positions)[row, jnp.clip(flat, 0, num_positions - 1)]
  inside = (flat >= 0) & (flat < num_positions)
  return jnp.where(inside, got, fill).reshape(queries.shape)


def index_in(keys, queries, *, method: str = "auto", num_positions: int | None = None,
             repeats: bool = False):
  """i32[..., n]: the index of each query in its row of ``keys`` (-1: absent).

  Args:
    keys: i32[..., m] positions, distinct within a row (-1 padding), or with
      ``repeats`` possibly not: a repeated key's first index, whichever the method
      (the search's stable sort finds it; the map keeps it by a scatter-min).
    queries: i32[..., n] positions (-1 never found).
    method: "auto", "map" or "search" (module docstring).
    num_positions: a bound on every position (the map's table size).
  """
  method = choose(method, num_positions, _rows(keys))
  lane = jnp.broadcast_to(jnp.arange(keys.shape[-1], dtype=jnp.int32), keys.shape)
  if method == "map":
    if not repeats:
      return table_lookup(position_table(keys, lane, num_positions, EMPTY), queries,
                          EMPTY)
    # The smallest lane: a scatter-min over a table of "none" above every lane,
    # read back as -1 after the gather (a pass over the whole table would be a
    # kernel of its own).
    none = jnp.iinfo(jnp.int32).max
    got = table_lookup(position_table(keys, lane, num_positions, none, smallest=True),
                       queries, EMPTY)
    return jnp.where(got == none, EMPTY, got)
  masked = jnp.where(keys >= 0, keys, jnp.iinfo(jnp.int32).max)
  order = jnp.argsort(masked, axis=-1)
  srt = jnp.take_along_axis(masked, order, axis=-1)
  search = lambda a, v: jnp.searchsorted(a, v, method="scan_unrolled")
  for _ in range(keys.ndim - 1):
    search = jax.vmap(search)
  at = jnp.minimum(search(srt, queries), keys.shape[-1] - 1)
  found = (queries >= 0) & (jnp.take_along_axis(srt, at, axis=-1) == queries)
  return jnp.where(found, jnp.take_along_axis(order, at, axis=-1), EMPTY).astype(jnp.int32)


def find_held(slot_pos, selected, wanted, *, method: str = "auto",
              num_positions: int | None = None):
  """i32[..., k]: the slot holding each wanted selected position (-1: a miss).

  RESOLVE's membership test. The map indexes the B slots and reads the k
  selected positions; the search sorts the k selected positions (cheaper than
  sorting B slots: XLA:CPU's sort is slow) and searches each slot.
  """
  method = choose(method, num_positions, _rows(slot_pos))
  if method == "map":
    held = index_in(slot_pos, selected, method="map", num_positions=num_positions)
    return jnp.where(wanted, held, EMPTY)
  lane_of_slot = index_in(jnp.where(wanted, selected, EMPTY), slot_pos, method="search")
  num_sel = selected.shape[-1]
  slot_ids = jnp.broadcast_to(jnp.arange(slot_pos.shape[-1], dtype=jnp.int32),
                              slot_pos.shape)
  # Scatter each hit slot's id to its selected lane; misses keep -1.
  flat_lane = lane_of_slot.reshape(-1, slot_pos.shape[-1])
  row = jnp.arange(flat_lane.shape[0], dtype=jnp.int32)[:, None]
  held = jnp.full((flat_lane.shape[0], num_sel), EMPTY, jnp.int32).at[
      row, jnp.where(flat_lane >= 0, flat_lane, num_sel)].set(
          slot_ids.reshape(flat_lane.shape), mode="drop")
  return held.reshape(selected.shape)


def resident_mask(slot_pos, positions, *, method: str = "auto",
                  num_positions: int | None = None):
  """bool[..., n]: which ``positions`` some slot of ``slot_pos`` [..., B] holds."""
  return index_in(slot_pos, positions, method=method, num_positions=num_positions) >= 0


def duplicate_mask(selected, *, method: str = "auto", num_positions: int | None = None):
  """bool[..., k]: entries whose position an earlier lane of the row also holds
  (every repeat after a position's first lane, whichever the method: the lookahead
  fetches the first, best-ranked, lane; padding never, nor a position >=
  ``num_positions``, which the map cannot hold: out of range, not a repeat)."""
  lane = jnp.broadcast_to(jnp.arange(selected.shape[-1], dtype=jnp.int32),
                          selected.shape)
  owner = index_in(selected, selected, method=method, num_positions=num_positions,
                   repeats=True)
  counted = selected >= 0
  if num_positions is not None:
    counted &= selected < num_positions
  return counted & (owner != lane)


def rank_of(slot_pos, ranks, *, method: str = "auto", num_positions: int | None = None):
  """i32[..., B]: each slot's position's index in ``ranks`` [..., m] (best first,
  -1 padding; a position ranked twice: its best rank); m for empty slots and
  positions not ranked."""
  got = index_in(ranks, slot_pos, method=method, num_positions=num_positions,
                 repeats=True)
  return jnp.where(got >= 0, got, ranks.shape[-1])
