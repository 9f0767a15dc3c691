"""Fused RESOLVE kernel: one program per (request, unit) row.

Phases (HiSparse's Stage/Mark -> Scan -> victims -> Publish; docs/DESIGN.md, "RESOLVE"):

  1. *Mark*: tile-by-tile equality of the row's slot positions against the
     selected positions (excluding the newest) gives each slot's hit flag and, for
     each selected entry, the slot holding it.
  2. *Scan*: in LRU order, cumsums rank hits and evictables; the new LRU order is
     written by scatter: [evictables not taken] ++ [victims] ++ [hits].
  3. *Victims*: the j-th miss (selection order) takes the evictable of rank j.
  4. *Publish*: slot per selected entry, miss flags, updated slot positions.

Vectors are padded to powers of 2 (Triton tensors); padded lanes write to distinct
scratch columns past B (or k) that the wrapper slices off, so no store needs a
mask and no two lanes share an address. Bit-identical to ``reference.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common
from pallas_kernels.cache_resolve.config import BlockSizes
from pallas_kernels.cache_resolve.reference import ResolveOutputs


def _barrier(interpret: bool):
  if not interpret:
    pltriton.debug_barrier()


def _resolve_kernel(slot_pos_ref, lru_ref, sel_ref, newest_ref,
                    slot_pos_out, lru_out, slot_out, miss_out, hit_tmp, held_tmp,
                    evict_tmp, *, num_slots, num_sel, slots_pad, sel_pad,
                    block_slots, block_sel, interpret):
  # slot_pos_ref, lru_ref: i32[rows, B]    sel_ref: i32[rows, k]   newest_ref: i32[rows]
  # slot_pos_out: i32[rows, Bp + kp]       lru_out: i32[rows, Bp]
  # slot_out, miss_out: i32[rows, kp]
  # hit_tmp: i32[rows, Bp]  held_tmp: i32[rows, kp]  evict_tmp: i32[rows, 2 Bp]
  row = pl.program_id(0)
  newest = newest_ref[row]
  lane_b = jnp.arange(slots_pad)
  lane_k = jnp.arange(sel_pad)
  in_b = lane_b < num_slots
  in_k = lane_k < num_sel

  def load_padded(ref, lanes, valid, other):
    return jnp.where(valid, ref[row, jnp.where(valid, lanes, 0)], other)

  slot_pos = load_padded(slot_pos_ref, lane_b, in_b, -1)  # [Bp]
  sel = load_padded(sel_ref, lane_k, in_k, -1)  # [kp]
  wanted = (sel >= 0) & (sel != newest)
  held_tmp[row, :] = jnp.full((sel_pad,), -1, jnp.int32)
  slot_pos_out[row, pl.ds(0, slots_pad)] = slot_pos
  _barrier(interpret)

  # 1. Mark: slot tiles x selection tiles.
  def mark_slots(t, _):
    tile_pos = slot_pos_ref[row, jnp.minimum(t * block_slots + jnp.arange(block_slots),
                                             num_slots - 1)]
    tile_ids = t * block_slots + jnp.arange(block_slots)
    tile_pos = jnp.where(tile_ids < num_slots, tile_pos, -1)

    def mark_sel(j, hit):
      cols = pl.ds(j * block_sel, block_sel)
      s = sel_ref[row, jnp.minimum(j * block_sel + jnp.arange(block_sel), num_sel - 1)]
      s_ids = j * block_sel + jnp.arange(block_sel)
      w = (s_ids < num_sel) & (s >= 0) & (s != newest)
      eq = (tile_pos[:, None] == s[None, :]) & w[None, :]  # [bS, bK]
      found = jnp.max(jnp.where(eq, tile_ids[:, None], -1), axis=0)  # [bK]
      held_tmp[row, cols] = jnp.maximum(held_tmp[row, cols], found)
      return hit | (jnp.max(eq.astype(jnp.int32), axis=1) > 0)

    hit = jax.lax.fori_loop(0, sel_pad // block_sel, mark_sel,
                            jnp.zeros((block_slots,), jnp.bool_))
    hit_tmp[row, pl.ds(t * block_slots, block_slots)] = hit.astype(jnp.int32)
    # The next slot tile reads held_tmp back: its loads must see these stores,
    # whichever threads of the program made them.
    _barrier(interpret)
    return 0

  jax.lax.fori_loop(0, slots_pad // block_slots, mark_slots, 0)
  _barrier(interpret)

  # 2. Scan in LRU order (padded lanes carry their own lane id, never a real slot).
  lru = load_padded(lru_ref, lane_b, in_b, lane_b)  # [Bp]
  hit_lru = (hit_tmp[row, lru] > 0) & in_b
  evictable = in_b & ~hit_lru
  hit_rank = jnp.cumsum(hit_lru.astype(jnp.int32)) - 1
  evict_rank = jnp.cumsum(evictable.astype(jnp.int32)) - 1
  num_evict = num_slots - jnp.sum(hit_lru.astype(jnp.int32))
  held = held_tmp[row, :]  # [kp]
  miss = wanted & (held < 0)
  miss_rank = jnp.cumsum(miss.astype(jnp.int32)) - 1
  num_miss = jnp.sum(miss.astype(jnp.int32))
  new_index = jnp.where(
      hit_lru, num_evict + hit_rank,
      jnp.where(evict_rank < num_miss, num_evict - num_miss + evict_rank,
                evict_rank - num_miss))
  lru_out[row, jnp.where(in_b, new_index, lane_b)] = lru
  evict_tmp[row, jnp.where(evictable, evict_rank, slots_pad + lane_b)] = lru
  _barrier(interpret)

  # 3-4. Victims and publish.
  victim = evict_tmp[row, jnp.where(miss, miss_rank, 0)]
  is_newest = (sel >= 0) & (sel == newest)
  slot = jnp.where(miss, victim, jnp.where(wanted & (held >= 0), held,
                                           jnp.where(is_newest, num_slots, -1)))
  slot_out[row, :] = slot
  miss_out[row, :] = miss.astype(jnp.int32)
  slot_pos_out[row, jnp.where(miss, victim, slots_pad + lane_k)] = sel


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def cache_resolve(slot_pos, lru, selected, newest, *,
                  block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
                  ) -> ResolveOutputs:
  """Same contract as ``cache_resolve_reference`` (any leading batch dims)."""
  batch = slot_pos.shape[:-1]
  num_slots, num_sel = slot_pos.shape[-1], selected.shape[-1]
  common.check_slots(num_slots, num_sel)
  slots_pad = max(common.next_power_of_2(num_slots), block_sizes.block_slots)
  sel_pad = max(common.next_power_of_2(num_sel), block_sizes.block_sel)
  rows = 1
  for d in batch:
    rows *= d
  flat = lambda x, n: x.reshape(rows, n)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  kernel = functools.partial(
      _resolve_kernel, num_slots=num_slots, num_sel=num_sel, slots_pad=slots_pad,
      sel_pad=sel_pad, block_slots=block_sizes.block_slots,
      block_sel=block_sizes.block_sel, interpret=interpret)
  whole = pl.no_block_spec
  outs = pl.pallas_call(
      kernel,
      grid=(rows,),
      in_specs=[whole] * 4,
      out_specs=[whole] * 7,
      out_shape=[i32(rows, slots_pad + sel_pad), i32(rows, slots_pad),
                 i32(rows, sel_pad), i32(rows, sel_pad), i32(rows, slots_pad),
                 i32(rows, sel_pad), i32(rows, 2 * slots_pad)],
      compiler_params=common.triton_params(block_sizes.num_warps, 1),
      interpret=interpret,
      name="cache_resolve",
  )(flat(slot_pos, num_slots), flat(lru, num_slots), flat(selected, num_sel),
    newest.reshape(rows))
  new_slot_pos, new_lru, slot, miss = outs[:4]
  unflat = lambda x, n: x[:, :n].reshape(batch + (n,))
  return ResolveOutputs(unflat(new_slot_pos, num_slots), unflat(new_lru, num_slots),
                        unflat(slot, num_sel), unflat(miss, num_sel).astype(bool))
