"""One layer's cache step in two Pallas (Triton) kernels: classify, then commit.

The contract is ``reference.py``'s. Why two launches and not one: a refused layer
must change nothing, and whether it refuses depends on every row (a duplicate in
row 5 stops row 0's fetch), while a Triton grid has no barrier across programs.
So *classify* decides everything per row without touching the cache, and
*commit* reads every row's verdict before it writes. Both take the whole cache
arrays and the layer as a scalar and update in place (no per-layer slices).

classify, grid (rows,), one program per (request, unit) row, O(B + k):
  1. validate the selection; scatter ``map[pos] = lane`` into a dense position
     map (its contents need no reset: a hit is confirmed by reading the
     selection back, so stale entries are harmless); read it back for duplicates;
  2. walk the B slots in LRU order, probe the map: a slot is a hit when its
     position is selected; cumsums rank hits and evictables (SGLang's order);
  3. the j-th miss (selection order) takes the j-th evictable; the newest token
     takes the lowest-index empty slot left; write the new LRU order and slot
     positions, the slot serving each entry, and the compacted misses' host
     (page, offset) and victim slot; a miss without a page is a capacity refusal.
  Under a keyed replacement policy each row's slots are sorted by key once
  (XLA: empty first, then the key, ties in LRU order; a Triton program has no
  sort) and step 2 also walks that *victim order*, so the j-th miss takes the
  j-th evictable in it; the new LRU order keeps its rule. The score EMA of the
  policies is updated in the same walk. ``keyed_victim_order`` builds that order
  for the library's keyed policies in a third kernel (the key, with the rank
  lookup by another never-cleared position map, in LRU order) and the sort.
commit, grid (rows, ceil(k / fetch_rows)):
  ok = no earlier refusal (the status word passed in is 0) and no row's status
  set; then each program copies its block of the row's compacted misses from the
  host tier (zero-copy on a GPU: the kernel reads ``pinned_host`` memory itself);
  block 0 also writes the newest
  token (slot B always, its install slot when ok) and, for an active row, the
  metadata and counters; program (0, 0) writes the status word: the one passed in
  OR this layer's (the layer loop threads it, no XLA op between layers). With
  ``share`` > 1 (index sharing) the fetch, metadata and counters also go to the
  ``share - 1`` layers after ``layer``, in lockstep.

Vectors are padded to powers of 2 (Triton tensors): padded lanes read a clamped
index and write the same value to the same place, or a scratch column past the
real ones, so no load or store needs a mask. Scratch outputs are sliced off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common
from pallas_kernels.fused_resolve.config import BlockSizes
from pallas_kernels.fused_resolve.reference import (CacheArrays, LayerResult,
                                                    check_share, check_victim_inputs,
                                                    effective_slot_pos)

_STATUS_BITS = (common.STATUS_OUT_OF_RANGE, common.STATUS_DUPLICATE,
                common.STATUS_CAPACITY)


def _barrier(interpret: bool):
  if not interpret:
    pltriton.debug_barrier()


def _any(x):
  return jnp.max(x.astype(jnp.int32)) > 0


def _classify_kernel(layer_ref, active_ref, seq_len_ref, sel_ref, slot_pos_ref, lru_ref,
                     score_ref, order_ref, page_table_ref, *refs, given_map, **static):
  # A given scratch map is an extra input aliased to the first output.
  _classify(layer_ref, active_ref, seq_len_ref, sel_ref, slot_pos_ref, lru_ref,
            score_ref, order_ref, page_table_ref, *refs[given_map:], **static)


def _classify(layer_ref, active_ref, seq_len_ref, sel_ref, slot_pos_ref, lru_ref,
              score_ref, order_ref, page_table_ref, map_ref, new_pos_ref, new_lru_ref,
              new_score_ref, slot_ref, miss_ref, plan_page_ref, plan_off_ref,
              plan_slot_ref, info_ref, held_ref, evict_ref, rank_ref, *, num_units,
              num_slots, num_sel, slots_pad, sel_pad, max_len, page_size, score_decay,
              interpret):
  # layer_ref: i32[1]  active_ref: bool[R]  seq_len_ref: i32[R]
  # sel_ref: i32[rows, m >= k] (the first k columns are the selection)
  # slot_pos_ref, lru_ref: i32[L, rows, B]  score_ref: f32[L, rows, B]
  # order_ref: i32[rows, B] victim order (keyed policies; unread under LRU)
  # page_table_ref: i32[R, MP]
  # map_ref: i32[rows, T+1 + kp] (scratch)  new_pos_ref: i32[rows, Bp + kp]
  # new_lru_ref: i32[rows, Bp]  new_score_ref: f32[rows, Bp]
  # slot_ref, miss_ref: i32[rows, kp]
  # plan_*_ref: i32[rows, 2 kp]  info_ref: i32[rows, 4] (status, target, hits, misses)
  # held_ref: i32[rows, kp + Bp]  evict_ref, rank_ref: i32[rows, 2 Bp] (scratch)
  keyed = score_decay is not None
  row = pl.program_id(0)
  req = row // num_units
  layer = layer_ref[0]
  newest = seq_len_ref[req]
  active = active_ref[req]
  num_positions = max_len + 1
  lane_b = jnp.arange(slots_pad)
  lane_k = jnp.arange(sel_pad)
  in_b = lane_b < num_slots
  in_k = lane_k < num_sel
  clamp_b = jnp.minimum(lane_b, num_slots - 1)

  # 1. Validate; index the selection by position.
  raw = sel_ref[row, jnp.minimum(lane_k, num_sel - 1)]
  sel = jnp.where(in_k & active, raw, -1)  # [kp]; an inactive row selects nothing
  bad = (sel < -1) | (sel > newest) | (sel > max_len)
  sel = jnp.where(bad, -1, sel)
  valid = sel >= 0
  is_newest = valid & (sel == newest)
  wanted = valid & ~is_newest
  col = jnp.where(valid, sel, num_positions + lane_k)
  map_ref[row, col] = lane_k
  held_ref[row, lane_k] = jnp.full((sel_pad,), -1, jnp.int32)
  _barrier(interpret)
  dup = valid & (map_ref[row, col] != lane_k)

  # 2. Membership in LRU order (padded lanes carry their own lane id, never a slot).
  def walk(order):  # slot ids [Bp] -> (their positions, -1 empty; hit; selection lane)
    pos = slot_pos_ref[layer, row, jnp.where(in_b, order, 0)]
    pos = jnp.where(in_b & (pos >= 0) & (pos < newest), pos, -1)
    probe = pos >= 0  # (< newest <= max_len: inside the map)
    owner = jnp.where(probe, map_ref[row, jnp.where(probe, pos, 0)], -1)
    owner_ok = (owner >= 0) & (owner < num_sel)
    owner = jnp.where(owner_ok, owner, 0)
    return pos, probe & active & owner_ok & (sel_ref[row, owner] == pos), owner

  lru = jnp.where(in_b, lru_ref[layer, row, clamp_b], lane_b)  # [Bp]
  pos_lru, hit, owner = walk(lru)
  held_ref[row, jnp.where(hit, owner, sel_pad + lane_b)] = lru
  hit_count = jnp.cumsum(hit.astype(jnp.int32))
  hit_rank = hit_count - 1
  evict_rank = lane_b - hit_count  # rank among the evictables, for those
  evictable = in_b & ~hit
  num_evict = num_slots - jnp.sum(hit.astype(jnp.int32))
  if keyed:  # the victims' ranks come from the victim order, walked the same way
    order = jnp.where(in_b, order_ref[row, clamp_b], lane_b)
    _, hit_order, _ = walk(order)
    victim_rank = lane_b - jnp.cumsum(hit_order.astype(jnp.int32))
    evict_ref[row, jnp.where(in_b & ~hit_order, victim_rank, slots_pad + lane_b)] = order
    rank_ref[row, jnp.where(in_b, order, slots_pad + lane_b)] = victim_rank
  else:
    evict_ref[row, jnp.where(evictable, evict_rank, slots_pad + lane_b)] = lru
  _barrier(interpret)
  # Each LRU lane's rank in the victim order (LRU: the order itself).
  victim_rank = rank_ref[row, lru] if keyed else evict_rank

  # 3. Victims, the install slot, the new LRU order.
  held = held_ref[row, lane_k]
  miss = wanted & (held < 0)
  miss_rank = jnp.cumsum(miss.astype(jnp.int32)) - 1
  num_miss = jnp.sum(miss.astype(jnp.int32))
  victim = evict_ref[row, jnp.where(miss, jnp.minimum(miss_rank, 2 * slots_pad - 1), 0)]
  victim = jnp.where(miss, jnp.clip(victim, 0, num_slots - 1), 0)
  taken = evictable & (victim_rank < num_miss)
  empty_left = evictable & (pos_lru < 0) & ~taken & active
  target = jnp.min(jnp.where(empty_left, lru, slots_pad))
  has_target = target < num_slots
  target = jnp.where(has_target, target, -1)
  # [evictables kept, LRU order] ++ [victims, miss order] ++ [hits, LRU order].
  kept_rank = (jnp.cumsum((evictable & ~taken).astype(jnp.int32)) - 1 if keyed
               else evict_rank - num_miss)  # (LRU: the victims are a prefix)
  new_index = jnp.where(hit, num_evict + hit_rank,
                        jnp.where(taken, num_evict - num_miss + victim_rank, kept_rank))
  is_target = lru == target  # never for padded lanes (ids >= B)
  target_index = jnp.max(jnp.where(is_target, new_index, -1))
  new_index = jnp.where(is_target, num_slots - 1,
                        jnp.where(has_target & (new_index > target_index), new_index - 1,
                                  new_index))
  new_lru_ref[row, jnp.where(in_b, new_index, lane_b)] = lru
  score = score_ref[layer, row, jnp.where(in_b, lru, 0)]
  if keyed:  # the policies' EMA: decay, a hit adds 1, a refilled slot restarts at 1
    score = jnp.where(taken, 1.0, score_decay * score + hit.astype(jnp.float32))
  new_score_ref[row, lru] = score  # (padded lanes: their own ids, past B)

  base = slot_pos_ref[layer, row, clamp_b]
  new_pos_ref[row, lane_b] = jnp.where(in_b & (base >= 0) & (base < newest), base, -1)
  slot = jnp.where(miss, victim, jnp.where(wanted & (held >= 0), held,
                                           jnp.where(is_newest, num_slots, -1)))
  slot_ref[row, lane_k] = slot
  miss_ref[row, lane_k] = miss.astype(jnp.int32)

  # Host location of each miss, compacted to the front of the plan.
  pos = jnp.clip(sel, 0, max_len - 1)
  page = page_table_ref[req, pos // page_size]
  to = jnp.where(miss, miss_rank, sel_pad + lane_k)
  plan_page_ref[row, to] = page
  plan_off_ref[row, to] = pos % page_size
  plan_slot_ref[row, to] = victim
  _barrier(interpret)
  new_pos_ref[row, jnp.where(miss, victim, slots_pad + lane_k)] = sel

  @pl.when(has_target)
  def _install():
    new_pos_ref[row, target] = newest

  row_bad, row_dup = _any(bad), _any(dup)
  unpaged = _any(miss & (page < 0)) & ~row_bad & ~row_dup
  status = (jnp.where(row_bad, common.STATUS_OUT_OF_RANGE, 0)
            | jnp.where(row_dup, common.STATUS_DUPLICATE, 0)
            | jnp.where((active & (newest >= max_len)) | unpaged,
                        common.STATUS_CAPACITY, 0))
  info_ref[row, 0] = status.astype(jnp.int32)
  info_ref[row, 1] = target.astype(jnp.int32)
  info_ref[row, 2] = jnp.sum((valid & ~miss).astype(jnp.int32))
  info_ref[row, 3] = num_miss


def _commit_kernel(layer_ref, prior_status_ref, active_ref, info_ref, new_pos_ref,
                   new_lru_ref, new_score_ref, plan_page_ref, plan_off_ref,
                   plan_slot_ref, k_new_ref, v_new_ref, host_k_ref, host_v_ref,
                   _slot_pos_in, _lru_in, _score_in, _hits_in, _misses_in, _fetched_in,
                   _hot_k_in, _hot_v_in,
                   slot_pos_ref, lru_ref, score_ref, hits_ref, misses_ref, fetched_ref,
                   hot_k_ref, hot_v_ref, status_ref, *,
                   num_units, num_rows, rows_pad, num_slots, slots_pad, fetch_rows,
                   heads, head_dim, share):
  # info_ref: i32[rows, 4]  new_pos_ref: i32[rows, Bp + kp]  new_lru_ref: i32[rows, Bp]
  # new_score_ref: f32[rows, Bp]
  # plan_*_ref: i32[rows, 2 kp]  k_new_ref, v_new_ref: [rows, Hg, D]
  # host_*_ref: [L, NH+1, Pg, U, Hg, D] (host memory on a GPU)
  # slot_pos_ref, lru_ref, score_ref: [L, rows, B]  hits_ref, misses_ref: i32[L, rows]
  # fetched_ref: i32[L]  hot_*_ref: [L, rows, B+1, Hg, D] (all aliased in place)
  # prior_status_ref, status_ref: i32[1]  active_ref: bool[R]
  row = pl.program_id(0)
  block = pl.program_id(1)
  unit = row % num_units
  layer = layer_ref[0]
  every_row = jnp.minimum(jnp.arange(rows_pad), num_rows - 1)
  statuses = info_ref[every_row, 0]  # padded lanes repeat the last row
  prior_status = prior_status_ref[0]
  # layer .. layer + share - 1 must be the cache's (layer is traced: a status bit).
  layer_ok = (layer >= 0) & (layer + share <= hits_ref.shape[0])
  ok = (prior_status == 0) & (jnp.max(statuses) == 0) & layer_ok
  count = info_ref[row, 3]
  first = block * fetch_rows
  d_row = jnp.arange(head_dim)

  @pl.when(ok & (first < count))
  def _fetch():
    lane = jnp.minimum(first + jnp.arange(fetch_rows), count - 1)  # [F]
    page = plan_page_ref[row, lane][:, None]  # [F, 1]
    off = plan_off_ref[row, lane][:, None]
    slot = plan_slot_ref[row, lane][:, None]
    d = d_row[None, :]  # [1, D]
    for j in range(share):  # the layers sharing this selection get the rows too
      for h in range(heads):
        hot_k_ref[layer + j, row, slot, h, d] = host_k_ref[layer + j, page, off, unit,
                                                           h, d]
        hot_v_ref[layer + j, row, slot, h, d] = host_v_ref[layer + j, page, off, unit,
                                                           h, d]

  @pl.when(block == 0)
  def _row():
    target = info_ref[row, 1]

    @pl.when((layer >= 0) & (layer < hits_ref.shape[0]))
    def _newest():
      for h in range(heads):
        hot_k_ref[layer, row, num_slots, h, d_row] = k_new_ref[row, h, d_row]
        hot_v_ref[layer, row, num_slots, h, d_row] = v_new_ref[row, h, d_row]

    @pl.when(ok & (target >= 0))
    def _install():
      for h in range(heads):
        hot_k_ref[layer, row, target, h, d_row] = k_new_ref[row, h, d_row]
        hot_v_ref[layer, row, target, h, d_row] = v_new_ref[row, h, d_row]

    @pl.when(ok & active_ref[row // num_units])
    def _metadata():
      lane = jnp.minimum(jnp.arange(slots_pad), num_slots - 1)
      new_pos, new_lru = new_pos_ref[row, lane], new_lru_ref[row, lane]
      score = jnp.where(lane == target, 1.0, new_score_ref[row, lane])
      for j in range(share):  # lockstep: the sharing layers get the anchor's
        slot_pos_ref[layer + j, row, lane] = new_pos
        lru_ref[layer + j, row, lane] = new_lru
        score_ref[layer + j, row, lane] = score

    @pl.when(ok)
    def _count():
      for j in range(share):
        hits_ref[layer + j, row] = hits_ref[layer + j, row] + info_ref[row, 2]
        misses_ref[layer + j, row] = misses_ref[layer + j, row] + count

  @pl.when((row == 0) & (block == 0))
  def _layer():
    # The OR of the rows' words, one bit at a time (the bits are distinct).
    status_ref[0] = (prior_status | sum(
        jnp.max(((statuses & bit) != 0).astype(jnp.int32)) * bit for bit in _STATUS_BITS)
                     | (1 - layer_ok.astype(jnp.int32)) * common.STATUS_OUT_OF_RANGE)
    real = jnp.arange(rows_pad) < num_rows
    moved = jnp.sum(jnp.where(real, info_ref[every_row, 3], 0))

    @pl.when(ok)
    def _moved():
      fetched_ref[layer] = fetched_ref[layer] + share * moved


def _victim_key_kernel(layer_ref, seq_len_ref, ranks_ref, slot_pos_ref, lru_ref,
                       score_ref, *refs, given_table, **static):
  # A given scratch table is an extra input aliased to the first output.
  _victim_key(layer_ref, seq_len_ref, ranks_ref, slot_pos_ref, lru_ref, score_ref,
              *refs[given_table:], **static)


def _victim_key(layer_ref, seq_len_ref, ranks_ref, slot_pos_ref, lru_ref, score_ref,
                table_ref, key_ref, lru_out_ref, *, num_units, num_slots, num_ranked,
                slots_pad, ranked_pad, max_len, rank_freq, ranked, interpret):
  # layer_ref: i32[1]  seq_len_ref: i32[R]
  # ranks_ref: i32[rows, m] (read only when ranked)
  # slot_pos_ref, lru_ref: i32[L, rows, B]  score_ref: f32[L, rows, B]
  # table_ref: i32[rows, T+1 + mp] (scratch)  key_ref: f32[rows, Bp]
  # lru_out_ref: i32[rows, Bp]
  row = pl.program_id(0)
  layer = layer_ref[0]
  newest = seq_len_ref[row // num_units]
  lane_b = jnp.arange(slots_pad)
  in_b = lane_b < num_slots
  lru = jnp.where(in_b, lru_ref[layer, row, jnp.minimum(lane_b, num_slots - 1)], lane_b)
  slot = jnp.where(in_b, lru, 0)
  pos = slot_pos_ref[layer, row, slot]
  filled = in_b & (pos >= 0) & (pos < newest)  # uncommitted positions count as empty
  key = score_ref[layer, row, slot]
  if ranked:  # the rank lookup: scatter table[pos] = index, probe, confirm
    lane_m = jnp.arange(ranked_pad)
    ranks = jnp.where(lane_m < num_ranked,
                      ranks_ref[row, jnp.minimum(lane_m, num_ranked - 1)], -1)
    col = jnp.where((ranks >= 0) & (ranks <= max_len), ranks, max_len + 1 + lane_m)
    table_ref[row, col] = lane_m
    _barrier(interpret)
    index = table_ref[row, jnp.where(filled, pos, 0)]
    index_ok = (index >= 0) & (index < num_ranked)
    index = jnp.where(index_ok, index, 0)
    found = filled & index_ok & (ranks_ref[row, index] == pos)
    rank = jnp.where(found, index, num_ranked).astype(key.dtype)
    key = (1.0 - rank / num_ranked) + rank_freq * key
  top = jnp.finfo(key.dtype).max  # NaN and +inf rank as the largest finite key
  key = jnp.where(jnp.isnan(key), top, jnp.minimum(key, top))  # (as victim_order)
  key_ref[row, lane_b] = jnp.where(filled, key, -jnp.inf)
  lru_out_ref[row, lane_b] = lru


@functools.partial(jax.jit, static_argnames=("max_len", "rank_freq", "num_warps",
                                             "interpret"))
def keyed_victim_order(layer, seq_len, slot_pos, lru, score, ranks=None,
                       scratch_table=None, *, max_len: int, rank_freq: float = 0.0,
                       num_warps: int = 4, interpret: bool = False):
  """i32[R, U, B] ``victim_order`` of layer ``layer`` under a keyed policy, its key
  ``victim_key_reference``'s (``freq`` with ``ranks`` None, else ``rank``), in
  one kernel and one XLA sort: the kernel reads the whole arrays with the layer a
  scalar, looks each slot's position up in the ranking by a dense position table
  (never cleared: a found index is confirmed by reading the ranking back) and
  writes the keys in LRU order, which the sort consumes as they are. The XLA key
  and its lookup (a table fill and a scatter) would be three launches, not one.

  ``slot_pos``, ``lru``: i32[L, R, U, B]; ``score``: f32[L, R, U, B]; ``ranks``:
  i32[R, U, m] distinct positions (a position twice gets either index), -1 padding.
  ``scratch_table``: optional i32[R*U, max_len + 1 + next_pow2(m)] the position
  table starts from (any contents; tests fill it with stale indices); by default a
  fresh, uninitialised buffer.
  """
  num_layers, num_req, num_units, num_slots = slot_pos.shape
  rows = num_req * num_units
  slots_pad = common.next_power_of_2(num_slots)
  ranked = ranks is not None
  num_ranked = ranks.shape[-1] if ranked else 1
  ranked_pad = common.next_power_of_2(num_ranked)
  if ranked and ranks.shape[:2] != (num_req, num_units):
    raise ValueError(f"ranks {ranks.shape} must be (R, U, m) with (R, U) = "
                     f"{(num_req, num_units)}")
  per_row = lambda x: x.reshape((num_layers, rows, num_slots))
  # Without a ranking any existing operand will do: it is never read (a fresh
  # array would cost an op to fill).
  ranks_rows = (ranks.astype(jnp.int32).reshape(rows, num_ranked) if ranked
                else per_row(lru))
  whole = pl.no_block_spec
  table_shape = (rows, max_len + 1 + ranked_pad if ranked else 1)
  given_table = scratch_table is not None
  if given_table and scratch_table.shape != table_shape:
    raise ValueError(f"scratch_table {scratch_table.shape} must be {table_shape}")
  kernel = functools.partial(
      _victim_key_kernel, num_units=num_units, num_slots=num_slots,
      num_ranked=num_ranked, slots_pad=slots_pad, ranked_pad=ranked_pad,
      max_len=max_len, rank_freq=rank_freq, ranked=ranked, interpret=interpret,
      given_table=given_table)
  _, key_lru, lru_row = pl.pallas_call(
      kernel,
      grid=(rows,),
      in_specs=[whole] * (6 + given_table),
      out_specs=[whole] * 3,
      input_output_aliases={6: 0} if given_table else {},
      out_shape=[jax.ShapeDtypeStruct(table_shape, jnp.int32),
                 jax.ShapeDtypeStruct((rows, slots_pad), score.dtype),
                 jax.ShapeDtypeStruct((rows, slots_pad), jnp.int32)],
      compiler_params=common.triton_params(num_warps, 1),
      interpret=interpret,
      name="fused_resolve_victim_key",
  )(jnp.asarray(layer, jnp.int32).reshape((1,)), jnp.asarray(seq_len, jnp.int32),
    ranks_rows, per_row(slot_pos), per_row(lru), per_row(score),
    *([scratch_table] if given_table else []))
  shape = (num_req, num_units, num_slots)
  _, order = jax.lax.sort((key_lru[:, :num_slots].reshape(shape),
                           lru_row[:, :num_slots].reshape(shape)),
                          dimension=-1, is_stable=True, num_keys=1)
  return order


def victim_order(slot_pos, lru, key, seq_len):
  """i32[R, U, B] each row's slot ids in the order misses take them: empty slots
  (uncommitted included) first, then by ``key`` ascending, ties in LRU order; hits
  are skipped by the kernel. One stable sort per row, in XLA. A NaN or +inf key
  ranks as the largest finite one (ties in LRU order), as in the reference."""
  empty = effective_slot_pos(slot_pos, seq_len) < 0
  key = key.astype(jnp.promote_types(key.dtype, jnp.float32))
  top = jnp.finfo(key.dtype).max
  key = jnp.where(jnp.isnan(key), top, jnp.minimum(key, top))
  key_lru = jnp.take_along_axis(jnp.where(empty, -jnp.inf, key), lru, axis=-1)
  # One sort carrying the slot ids (no argsort + gather: one launch fewer).
  _, order = jax.lax.sort((key_lru, lru), dimension=-1, is_stable=True, num_keys=1)
  return order


@functools.partial(jax.jit, static_argnames=("max_len", "page_size", "share",
                                             "score_decay", "num_sel", "block_sizes",
                                             "interpret"))
def resolve_fetch(layer, prior_status, active, seq_len, selected, cache: CacheArrays,
                  page_table, host_k, host_v, k_new, v_new, key=None, scratch_map=None, *,
                  order=None, max_len: int, page_size: int, share: int = 1,
                  score_decay: float | None = None, num_sel: int | None = None,
                  block_sizes: BlockSizes = BlockSizes(),
                  interpret: bool = False) -> LayerResult:
  """Same contract as ``resolve_fetch_reference``; ``cache`` is updated in place.

  ``key`` (a keyed policy) needs ``score_decay``: the kernels then take the victims
  in the order of one XLA sort per row. ``order`` instead of ``key``: that victim
  order itself, i32[R, U, B] (``keyed_victim_order``). ``scratch_map``: optional
  i32[R*U, max_len + 1 + next_pow2(k)] the position map starts from (any contents:
  tests fill it with stale lanes); by default a fresh, uninitialised buffer.
  ``num_sel``: the selection is the first ``num_sel`` of each row of ``selected``
  (a deeper best-first ranking, policy "rank", read in place: slicing it would
  be one more launch per layer); default every column.
  """
  num_layers, num_req, num_units, num_slots = cache.slot_pos.shape
  heads, head_dim = cache.hot_k.shape[-2:]
  check_share(share, num_layers)
  width = selected.shape[-1]
  num_sel = width if num_sel is None else num_sel
  if not 1 <= num_sel <= width:
    raise ValueError(f"{num_sel=} must be in [1, {width}] (the columns of selected)")
  common.check_slots(num_slots, num_sel)
  if head_dim & (head_dim - 1):
    raise ValueError(f"{head_dim=} must be a power of 2 for the fused kernels")
  check_victim_inputs(key, order, score_decay, (num_req, num_units, num_slots))
  rows = num_req * num_units
  slots_pad = common.next_power_of_2(num_slots)
  sel_pad = common.next_power_of_2(num_sel)
  rows_pad = common.next_power_of_2(rows)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  as_i32 = lambda x, n: jnp.asarray(x, jnp.int32).reshape((n,))
  # Bool and i32 operands as they come (no convert ops between the layers).
  layer, prior_status = as_i32(layer, 1), as_i32(prior_status, 1)
  active = jnp.asarray(active, bool).reshape((num_req,))
  per_row = lambda x: x.reshape((num_layers, rows) + x.shape[3:])
  whole = pl.no_block_spec
  params = common.triton_params(block_sizes.num_warps, 1)

  map_shape = (rows, max_len + 1 + sel_pad)
  given_map = scratch_map is not None
  if given_map and scratch_map.shape != map_shape:
    raise ValueError(f"scratch_map {scratch_map.shape} must be {map_shape}")
  sel_rows = selected.reshape(rows, width)
  if order is not None:
    order = order.astype(jnp.int32).reshape(rows, num_slots)
  elif key is None:
    order = sel_rows  # unread under LRU (an operand that costs no op to build)
  else:
    order = victim_order(cache.slot_pos[layer[0]], cache.lru[layer[0]], key,
                         seq_len).reshape(rows, num_slots)
  classify = functools.partial(
      _classify_kernel, num_units=num_units, num_slots=num_slots, num_sel=num_sel,
      slots_pad=slots_pad, sel_pad=sel_pad, max_len=max_len, page_size=page_size,
      score_decay=score_decay, interpret=interpret, given_map=given_map)
  (_, new_pos, new_lru, new_score, slot, miss, plan_page, plan_off, plan_slot, info, _,
   _, _) = pl.pallas_call(
       classify,
       grid=(rows,),
       in_specs=[whole] * (9 + given_map),
       out_specs=[whole] * 13,
       input_output_aliases={9: 0} if given_map else {},
       out_shape=[i32(*map_shape), i32(rows, slots_pad + sel_pad),
                  i32(rows, slots_pad),
                  jax.ShapeDtypeStruct((rows, slots_pad), cache.slot_score.dtype),
                  i32(rows, sel_pad), i32(rows, sel_pad),
                  i32(rows, 2 * sel_pad), i32(rows, 2 * sel_pad), i32(rows, 2 * sel_pad),
                  i32(rows, 4), i32(rows, sel_pad + slots_pad), i32(rows, 2 * slots_pad),
                  i32(rows, 2 * slots_pad)],
       compiler_params=params,
       interpret=interpret,
       name="fused_resolve_classify",
   )(layer, active, as_i32(seq_len, num_req), sel_rows,
     per_row(cache.slot_pos), per_row(cache.lru), per_row(cache.slot_score), order,
     page_table, *([scratch_map] if given_map else []))

  commit = functools.partial(
      _commit_kernel, num_units=num_units, num_rows=rows, rows_pad=rows_pad,
      num_slots=num_slots, slots_pad=slots_pad, fetch_rows=block_sizes.fetch_rows,
      heads=heads, head_dim=head_dim, share=share)
  rows_new = lambda x: x.reshape(rows, heads, head_dim).astype(cache.hot_k.dtype)
  state = [per_row(cache.slot_pos), per_row(cache.lru), per_row(cache.slot_score),
           per_row(cache.hits), per_row(cache.misses), cache.fetched_rows,
           per_row(cache.hot_k), per_row(cache.hot_v)]
  *updated, status = pl.pallas_call(
      commit,
      grid=(rows, common.cdiv(num_sel, block_sizes.fetch_rows)),
      in_specs=[whole] * 22,
      out_specs=[whole] * 9,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state] + [i32(1)],
      # The status word in place too (no copy into the layer loop's carry). Other
      # programs may read it before or after program (0, 0) writes prior | this
      # layer's: either way their ok is the same, as both words are zero exactly
      # when prior and this layer's word are.
      input_output_aliases={1: 8, **{14 + i: i for i in range(8)}},
      compiler_params=params,
      interpret=interpret,
      name="fused_resolve_commit",
  )(layer, prior_status, active, info, new_pos, new_lru, new_score, plan_page, plan_off,
    plan_slot, rows_new(k_new), rows_new(v_new), host_k, host_v, *state)

  ok_all = status[0] == 0
  unflat = lambda x, old: x.reshape(old.shape)
  new_cache = CacheArrays(*(unflat(x, old) for x, old in zip(updated, cache)))
  sel_shape = (num_req, num_units, num_sel)
  return LayerResult(new_cache, slot[:, :num_sel].reshape(sel_shape),
                     (miss[:, :num_sel] != 0).reshape(sel_shape) & ok_all, status[0],
                     info[:, 1].reshape(sel_shape[:2]))
