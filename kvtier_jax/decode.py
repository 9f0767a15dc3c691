"""The jitted tiered decode step, prefill, and the full-KV sparse reference step.

One decode step scans the layers (``lax.scan``) with the whole state in the carry,
so every write (hot slots, metadata, the host tier) is an in-place update of a
donated buffer. Per layer:

  1. the newest token's K/V go into reserved slot B (and, with
     ``host_append="in_scan"``, straight into the host tier);
  2. the selector names the positions to attend (``select(q, ctx)``);
  3. RESOLVE maps them to slots; only misses are fetched from the host tier;
  4. exact sparse attention over the named slots;
  5. if the unit has an empty slot, the newest token is kept there too (short
     contexts stay fully resident and never fetch).

A step whose inputs are invalid (selection out of range or duplicated, host tier
full) is refused: the refusing layer and all later layers change nothing, seq_len
does not advance, and the returned status says why (bits in resolve.STATUS_*).
Layers before it keep their (self-consistent) cache updates; positions >= seq_len
in slot metadata are uncommitted and dropped at the next step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax import attention, fetch
from kvtier_jax.config import TierConfig
from kvtier_jax.resolve import (STATUS_CAPACITY, STATUS_DUPLICATE, STATUS_OUT_OF_RANGE,
                                check_selection, install_newest, resolve, resolve_freq,
                                resolve_ranked, selection_errors)
from kvtier_jax.shapes import EMPTY
from kvtier_jax.selectors.synthetic import given_selection
from kvtier_jax.state import TieredKVState
from pallas_kernels import common
from pallas_kernels.cache_resolve.reference import (SEARCH_METHOD, position_table,
                                                   table_lookup)
from pallas_kernels.sparse_decode_attention import merge_partials


class SelectContext(NamedTuple):
  """What a selector sees at one layer of one step."""

  layer: jax.Array  # i32[]
  newest: jax.Array  # i32[R] position of the token being decoded
  aux: Any  # this layer's slice of the per-step selector inputs (any pytree)


# (q [R, Hq, D], ctx) -> i32[R, U, k] positions, -1 = padding.
SelectFn = Callable[[jax.Array, SelectContext], jax.Array]


def _or_reduce(x):
  return jax.lax.reduce(x.astype(jnp.int32), np.int32(0), jax.lax.bitwise_or,
                        tuple(range(x.ndim)))


class LayerPlan(NamedTuple):
  """An anchor layer's RESOLVE result, replayed by the layers sharing its index."""

  slot: jax.Array  # i32[R, U, k]
  is_hit: jax.Array  # bool[R, U, k] served without a fetch (newest included)
  is_miss: jax.Array  # bool[R, U, k] fetched (by the anchor, for every layer)
  target: jax.Array  # i32[R, U] slot that also keeps the newest token, -1 none


def _unit_rows(cfg: TierConfig, x):
  return x.reshape(cfg.num_requests, cfg.num_units, cfg.heads_per_unit, cfg.head_dim)


def _newest_dest(cfg: TierConfig, layer, target, ok):
  """Scatter destinations of the newest token: slot B, and the install slot."""
  shape = (cfg.num_requests, cfg.num_units)
  layer_col = jnp.full(shape, layer, jnp.int32)
  r_col = jnp.broadcast_to(jnp.arange(shape[0], dtype=jnp.int32)[:, None], shape)
  u_col = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32)[None, :], shape)
  to_b = jnp.stack([layer_col, r_col, u_col, jnp.full_like(r_col, cfg.hot_slots)], -1)
  to_target = jnp.stack([layer_col, jnp.where(ok & (target >= 0), r_col, shape[0]),
                         u_col, target], -1)
  return jnp.concatenate([to_b.reshape(-1, 4), to_target.reshape(-1, 4)])


def _resolve(cfg: TierConfig, slot_pos, lru, score, selected, newest, ranks=None):
  """RESOLVE under ``cfg.policy``: (ResolveOutputs, new per-slot score)."""
  # Positions are < max_len + 1 (the scratch row): the bound of the "map" lookup.
  lookup = dict(lookup=cfg.resolve_lookup, num_positions=cfg.max_len + 1)
  if cfg.policy == "rank":
    return resolve_ranked(slot_pos, lru, score, selected if ranks is None else ranks,
                          selected, newest, alpha=cfg.freq_alpha,
                          rank_freq=cfg.rank_freq, **lookup)
  if cfg.policy == "freq":
    return resolve_freq(slot_pos, lru, score, selected, newest, alpha=cfg.freq_alpha,
                        **lookup)
  return resolve(slot_pos, lru, selected, newest, impl=cfg.resolve_impl,
                 interpret=cfg.interpret, **lookup), score


def _append_newest_in_scan(cfg, state, layer, k_rows, v_rows, ok):
  if not cfg.append_in_scan:
    return state.host_k, state.host_v
  write_pos = jnp.where(ok, state.seq_len, cfg.max_len)  # max_len: the scratch row
  return fetch.append_rows(state.host_k, state.host_v, layer, write_pos, k_rows, v_rows)


def tiered_layer(cfg: TierConfig, state: TieredKVState, layer, q, k_new, v_new,
                 selected, ok=True, *, share: int = 1, prefetch=None,
                 prefetch_cap: int | None = None, ranks=None):
  """Sparse attention of one layer through the tiered cache.

  Args:
    state: the whole cache (all layers); only ``layer`` (.. ``layer + share - 1``)
      is touched.
    layer: i32[] layer index.
    q: [R, Hq, D] queries; k_new, v_new: [R, Hkv, D] the newest token's K/V.
    selected: i32[R, U, k] positions to attend (-1 padding); the newest position
      (``state.seq_len``) is served from reserved slot B.
    ok: bool[] False forbids any change (an earlier layer refused the step).
    share: layers served by this selection (index sharing, IndexShare /
      IndexCache): this anchor layer also fetches the misses of the next
      ``share - 1`` layers and sets their metadata, which stays in lockstep;
      those layers then call ``tiered_shared_layer`` with the returned plan.
    prefetch: i32[R, U, kp] positions predicted for the next step (-1 padding;
      kp <= B): after attention, up to ``prefetch_cap`` of them (default all) that
      are not resident are fetched now, so the next RESOLVE finds them resident.
      A wrong prediction costs bandwidth only.
    ranks: i32[R, U, m] the selector's current best-first ranking (policy
      ``"rank"``; None: the selection's own order).

  Returns:
    (out [R, Hq, D], lse f32[R, Hq], state, status i32[], plan LayerPlan).
  """
  num_req, num_units = cfg.num_requests, cfg.num_units
  k_rows, v_rows = _unit_rows(cfg, k_new), _unit_rows(cfg, v_new)
  newest = state.seq_len  # [R]
  newest_u = jnp.broadcast_to(newest[:, None], (num_req, num_units))
  if selected.shape != (num_req, num_units, cfg.top_k):
    raise ValueError(f"selector returned {selected.shape}, expected "
                     f"{(num_req, num_units, cfg.top_k)} (R, U, k)")
  selected = selected.astype(jnp.int32)

  status = _or_reduce(selection_errors(selected, newest_u, cfg.max_len + 1))
  status |= jnp.where((newest >= cfg.max_len).any(), STATUS_CAPACITY, 0)
  ok = ok & (status == 0)

  # 1. The newest token's K/V go to the host tier now (in-scan append) and to
  #    reserved slot B below (scratch until the step commits).
  host_k, host_v = _append_newest_in_scan(cfg, state, layer, k_rows, v_rows, ok)

  # 2. Resolve; uncommitted positions left in the metadata by a refused step
  #    (>= seq_len) count as empty.
  slot_pos = state.slot_pos[layer]
  slot_pos = jnp.where(slot_pos >= newest_u[..., None], EMPTY, slot_pos)
  res, new_score = _resolve(cfg, slot_pos, state.lru[layer], state.slot_score[layer],
                            selected, newest_u, ranks)
  is_miss = res.is_miss & ok

  # 3. Keep the newest token resident while the unit has an empty slot (after
  #    RESOLVE, so the slot is neither a hit nor a victim of this step).
  new_slot_pos, new_lru, target = install_newest(res.slot_pos, res.lru, newest_u)
  new_score = jnp.where(jnp.arange(cfg.hot_slots) == target[..., None], 1.0, new_score)

  # 4. All hot-cache writes of the layer in one scatter: newest -> slot B and the
  #    install target, fetched misses -> their victims. Then attention reads.
  dest = [_newest_dest(cfg, layer, target, ok)]
  new_k = [k_rows.reshape(-1, *k_rows.shape[2:])] * 2
  new_v = [v_rows.reshape(-1, *v_rows.shape[2:])] * 2
  hot_k, hot_v = state.hot_k, state.hot_v
  if cfg.overlap_hit_miss:
    out, lse, hot_k, hot_v, moved = _overlapped_attention(
        cfg, q, host_k, host_v, hot_k, hot_v, layer, selected, res, is_miss,
        jnp.concatenate(dest), jnp.concatenate(new_k), jnp.concatenate(new_v))
  else:
    if common.use_kernel(cfg.fetch_impl, "fetch"):
      hot_k, hot_v, moved = fetch.fetch_misses_kernel(
          cfg, host_k, host_v, hot_k, hot_v, layer, selected, res.slot, is_miss)
    else:
      rows = fetch.gather_misses(cfg, host_k, host_v, layer, selected, res.slot,
                                 is_miss)
      dest.append(rows.dest)
      new_k.append(rows.k)
      new_v.append(rows.v)
      moved = rows.moved
    dest = jnp.concatenate(dest)
    hot_k = fetch.scatter_rows(hot_k, dest, jnp.concatenate(new_k))
    hot_v = fetch.scatter_rows(hot_v, dest, jnp.concatenate(new_v))
    # 5. Attention over the slots RESOLVE named.
    out, lse = attention.hot_attention(cfg, q, hot_k, hot_v, layer, res.slot)

  # 6. Index sharing: the next share-1 layers' misses are fetched here, ahead of
  #    their attention (their RESOLVE would pick the same slots).
  for j in range(1, share):
    hot_k, hot_v, shared_moved = _fetch_for_layer(cfg, host_k, host_v, hot_k, hot_v,
                                                  layer + j, selected, res.slot,
                                                  is_miss)
    moved += shared_moved

  # 7. Lookahead prefetch for the next step.
  prefetched = jnp.zeros((num_req, num_units), jnp.int32)
  if prefetch is not None:
    new_slot_pos, new_lru, new_score, hot_k, hot_v, pf_moved, prefetched = _prefetch(
        cfg, host_k, host_v, hot_k, hot_v, layer, new_slot_pos, new_lru, new_score,
        prefetch, newest_u, ok, prefetch_cap, ranks)
    moved += pf_moved

  valid = selected >= 0
  is_hit = valid & ~res.is_miss
  span = lambda x: jnp.broadcast_to(x, (share,) + x.shape)
  keep = lambda new, old: jnp.where(ok, new, old)
  old_pos = jax.lax.dynamic_slice_in_dim(state.slot_pos, layer, share)
  old_lru = jax.lax.dynamic_slice_in_dim(state.lru, layer, share)
  old_score = jax.lax.dynamic_slice_in_dim(state.slot_score, layer, share)
  count = lambda mask: span(jnp.where(ok, mask.sum(-1, dtype=jnp.int32), 0))
  state = state.replace(
      host_k=host_k, host_v=host_v, hot_k=hot_k, hot_v=hot_v,
      slot_pos=jax.lax.dynamic_update_slice_in_dim(
          state.slot_pos, keep(span(new_slot_pos), old_pos), layer, 0),
      lru=jax.lax.dynamic_update_slice_in_dim(
          state.lru, keep(span(new_lru), old_lru), layer, 0),
      slot_score=jax.lax.dynamic_update_slice_in_dim(
          state.slot_score, keep(span(new_score), old_score), layer, 0),
      hits=jax.lax.dynamic_update_slice_in_dim(
          state.hits, jax.lax.dynamic_slice_in_dim(state.hits, layer, share)
          + count(is_hit), layer, 0),
      misses=jax.lax.dynamic_update_slice_in_dim(
          state.misses, jax.lax.dynamic_slice_in_dim(state.misses, layer, share)
          + count(is_miss), layer, 0),
      prefetched=state.prefetched.at[layer].add(prefetched),
      fetched_rows=state.fetched_rows.at[layer].add(moved),
  )
  return out, lse, state, status, LayerPlan(res.slot, is_hit, is_miss, target)


def tiered_shared_layer(cfg: TierConfig, state: TieredKVState, layer, q, k_new, v_new,
                        plan: LayerPlan, ok=True):
  """A layer that reuses its anchor's selection (index sharing).

  Its misses were fetched and its metadata set by the anchor's ``tiered_layer``
  (lockstep), so no RESOLVE and no host read happen here: the newest token goes
  to slot B (and the install slot), then attention over the anchor's slots.

  Returns (out [R, Hq, D], lse f32[R, Hq], state).
  """
  k_rows, v_rows = _unit_rows(cfg, k_new), _unit_rows(cfg, v_new)
  host_k, host_v = _append_newest_in_scan(cfg, state, layer, k_rows, v_rows, ok)
  dest = _newest_dest(cfg, layer, plan.target, ok)
  hot_k = fetch.scatter_rows(state.hot_k, dest,
                             jnp.concatenate([k_rows.reshape(-1, *k_rows.shape[2:])] * 2))
  hot_v = fetch.scatter_rows(state.hot_v, dest,
                             jnp.concatenate([v_rows.reshape(-1, *v_rows.shape[2:])] * 2))
  out, lse = attention.hot_attention(cfg, q, hot_k, hot_v, layer, plan.slot)
  return out, lse, state.replace(host_k=host_k, host_v=host_v, hot_k=hot_k, hot_v=hot_v)


def resident_mask(slot_pos, positions, num_positions: int | None = None):
  """bool[..., k]: which ``positions`` (i32[..., k]) some slot of ``slot_pos``
  (i32[..., B]) holds. ``num_positions`` bounds positions: then a dense position
  map replaces the sort where it fits (``common.xla_lookup``)."""
  rows = int(np.prod(slot_pos.shape[:-1]))
  lookup = common.xla_lookup("auto", num_positions, rows)
  if lookup == "map":
    table = position_table(slot_pos, jnp.ones_like(slot_pos), num_positions, 0)
    return table_lookup(table, positions, 0) > 0
  held = jnp.sort(slot_pos, axis=-1)
  search = functools.partial(jnp.searchsorted, method=SEARCH_METHOD[lookup])
  for _ in range(held.ndim - 1):
    search = jax.vmap(search)
  at = jnp.minimum(search(held, positions), held.shape[-1] - 1)
  return (positions >= 0) & (jnp.take_along_axis(held, at, axis=-1) == positions)


def cap_misses(state: TieredKVState, layer, selected, cap: int):
  """Keep resident positions and the first ``cap`` others; drop the rest (-1).

  For an uncommitted look-ahead pass (a draft token): it reads what is resident and
  fetches at most ``cap`` rows per unit, so the traffic it adds is bounded.
  """
  newest = state.seq_len[:, None, None]
  resident = (resident_mask(state.slot_pos[layer], selected, state.host_k.shape[2])
              | (selected == newest))
  fetch_it = (selected >= 0) & ~resident
  fetch_it &= jnp.cumsum(fetch_it, axis=-1) <= cap
  return jnp.where(resident | fetch_it, selected, EMPTY)


def _fetch_for_layer(cfg, host_k, host_v, hot_k, hot_v, layer, selected, slot,
                     is_miss):
  """Fetch ``is_miss`` rows of ``layer`` into ``slot`` (no attention, no metadata)."""
  if common.use_kernel(cfg.fetch_impl, "fetch"):
    return fetch.fetch_misses_kernel(cfg, host_k, host_v, hot_k, hot_v, layer,
                                     selected, slot, is_miss)
  rows = fetch.gather_misses(cfg, host_k, host_v, layer, selected, slot, is_miss,
                             first_chunk_always=True)
  return (fetch.scatter_rows(hot_k, rows.dest, rows.k),
          fetch.scatter_rows(hot_v, rows.dest, rows.v), rows.moved)


def _prefetch(cfg, host_k, host_v, hot_k, hot_v, layer, slot_pos, lru, score,
              predicted, newest, ok, cap, ranks=None):
  """Fetch predicted, not-yet-resident positions into LRU victims (capped).

  A RESOLVE over the prediction: predicted positions already resident are hits
  (protected, promoted), the first ``cap`` others are fetched into LRU victims.
  Positions >= the newest (not in the host tier yet) are skipped.

  Returns (slot_pos, lru, score, hot_k, hot_v, rows moved, prefetched per unit
  i32[R, U]).
  """
  num_pred = predicted.shape[-1]
  if num_pred > cfg.hot_slots:
    raise ValueError(f"{num_pred} predicted positions exceed B={cfg.hot_slots}")
  resident = resident_mask(slot_pos, predicted, cfg.max_len + 1)
  usable = (predicted >= 0) & (predicted < newest[..., None]) & ok
  wanted = usable & ~resident
  if cap is not None:
    wanted &= jnp.cumsum(wanted, axis=-1) <= cap
  res, score = _resolve(cfg, slot_pos, lru, score,
                        jnp.where(wanted | (usable & resident), predicted, EMPTY),
                        jnp.full_like(newest, EMPTY), ranks)
  hot_k, hot_v, moved = _fetch_for_layer(cfg, host_k, host_v, hot_k, hot_v, layer,
                                         predicted, res.slot, res.is_miss)
  return (res.slot_pos, res.lru, score, hot_k, hot_v, moved,
          res.is_miss.sum(-1, dtype=jnp.int32))


def _overlapped_attention(cfg, q, host_k, host_v, hot_k, hot_v, layer, selected, res,
                          is_miss, dest, new_k, new_v):
  """Attention over resident rows while the misses are fetched, then over the
  misses, merged by log-sum-exp (SGLang PR #22313's split; SPECS.md §1.7c).

  The hit partial depends only on rows already in the hot cache (plus the newest
  token, written first), so XLA can run it while the host gather is in flight;
  with the host-gather fetch the miss partial reads the fetched rows straight from
  the transfer buffer. Exact to f32 rounding (only the summation order changes).
  """
  hot_k = fetch.scatter_rows(hot_k, dest, new_k)  # newest -> slot B (+ install slot)
  hot_v = fetch.scatter_rows(hot_v, dest, new_v)
  hit_slot = jnp.where(res.is_miss, EMPTY, res.slot)
  out_h, lse_h = attention.hot_attention(cfg, q, hot_k, hot_v, layer, hit_slot)
  if common.use_kernel(cfg.fetch_impl, "fetch"):
    hot_k, hot_v, moved = fetch.fetch_misses_kernel(
        cfg, host_k, host_v, hot_k, hot_v, layer, selected, res.slot, is_miss)
    out_m, lse_m = attention.hot_attention(cfg, q, hot_k, hot_v, layer,
                                           jnp.where(is_miss, res.slot, EMPTY))
  else:
    rows = fetch.gather_misses(cfg, host_k, host_v, layer, selected, res.slot, is_miss,
                               first_chunk_always=True)
    lane = jnp.minimum(rows.lane, rows.k.shape[0] - 1)
    out_m, lse_m = attention.rows_attention(q, rows.k[lane], rows.v[lane], is_miss)
    hot_k = fetch.scatter_rows(hot_k, rows.dest, rows.k)
    hot_v = fetch.scatter_rows(hot_v, rows.dest, rows.v)
    moved = rows.moved
  out, lse = merge_partials(out_h, lse_h, out_m, lse_m)
  return out, lse, hot_k, hot_v, moved


def decode_step(cfg: TierConfig, state: TieredKVState, q, k_new, v_new,
                select: SelectFn, select_aux=None, *, index_share_every: int = 1,
                prefetch=None, prefetch_cap: int | None = None):
  """One decode step over all layers (q/k/v given per layer).

  Args:
    q: [L, R, Hq, D]; k_new, v_new: [L, R, Hkv, D] (the newest token, every layer).
    select: selector ``select(q_layer, SelectContext) -> i32[R, U, k]`` (under
      policy ``"rank"``: i32[R, U, cfg.select_width], best first; the first k
      positions are the selection, the whole row ranks the resident ones).
    select_aux: pytree whose leaves have a leading L axis, sliced per layer into
      ``ctx.aux`` (e.g. precomputed selections [L, R, U, k]).
    index_share_every: N > 1 selects only on anchor layers (0, N, 2N, ...); the
      N - 1 layers after an anchor reuse its selection, and their misses are
      fetched at the anchor, ahead of their attention (HiSparse's exact prefetch).
    prefetch: optional i32[L, R, U, kp] positions predicted for the next step
      (lookahead prefetch); ``prefetch_cap`` bounds rows per layer and unit.

  Returns:
    (out [L, R, Hq, D], state, status i32[], committed bool[]). With
    ``cfg.append_in_scan`` False the caller must then run ``append_newest``.
  """
  num_layers, share = cfg.num_layers, index_share_every
  if share < 1 or num_layers % share:
    raise ValueError(f"{index_share_every=} must divide num_layers={num_layers}")
  group = lambda x: jax.tree.map(
      lambda a: a.reshape((num_layers // share, share) + a.shape[1:]), x)

  def body(carry, xs):
    state, ok, status = carry
    anchor, q_g, k_g, v_g, aux_g, pf_g = xs
    pick = lambda tree, j: jax.tree.map(lambda a: a[j], tree)
    picked = select(q_g[0], SelectContext(anchor, state.seq_len, pick(aux_g, 0)))
    if picked.shape[-1] != cfg.select_width:
      raise ValueError(f"selector returned {picked.shape}, expected rows of "
                       f"{cfg.select_width} (top_k={cfg.top_k}, "
                       f"rank_depth={cfg.rank_depth})")
    selected = picked[..., :cfg.top_k]
    out0, _, state, layer_status, plan = tiered_layer(
        cfg, state, anchor, q_g[0], k_g[0], v_g[0], selected, ok, share=share,
        prefetch=None if pf_g is None else pf_g[0], prefetch_cap=prefetch_cap,
        ranks=picked if cfg.policy == "rank" else None)
    ok = ok & (layer_status == 0)
    outs = [out0]
    for j in range(1, share):
      out_j, _, state = tiered_shared_layer(cfg, state, anchor + j, q_g[j], k_g[j],
                                            v_g[j], plan, ok)
      outs.append(out_j)
    return (state, ok, status | layer_status), jnp.stack(outs)

  anchors = jnp.arange(0, num_layers, share, dtype=jnp.int32)
  xs = (anchors, group(q), group(k_new), group(v_new), group(select_aux),
        None if prefetch is None else group(prefetch))
  (state, committed, status), out = jax.lax.scan(
      body, (state, jnp.bool_(True), jnp.int32(0)), xs)
  state = state.replace(seq_len=state.seq_len + committed.astype(jnp.int32))
  return out.reshape((num_layers,) + out.shape[2:]), state, status, committed


def append_newest(cfg: TierConfig, state: TieredKVState, committed):
  """Copy every layer's newest rows (reserved slot B) into the host tier.

  The separate-jit form of the host append (``host_append="separate"``); writes go
  to position seq_len-1 (just committed) or the scratch row when not committed.
  """
  rows_k = state.hot_k[:, :, :, cfg.hot_slots]  # [L, R, U, Hg, D]
  rows_v = state.hot_v[:, :, :, cfg.hot_slots]
  positions = jnp.where(committed, state.seq_len - 1, cfg.max_len)
  host_k, host_v = fetch.append_rows(state.host_k, state.host_v, None, positions,
                                     rows_k, rows_v)
  return state.replace(host_k=host_k, host_v=host_v)


def warm_positions(cfg: TierConfig, prompt_lens):
  """Positions a prefill leaves in slots 0..B-1, i32[R, B] (-1 empty)."""
  slots = jnp.arange(cfg.hot_slots, dtype=jnp.int32)[None, :]
  lens = prompt_lens.astype(jnp.int32)[:, None]
  if cfg.warm_start == "empty":
    pos = jnp.full((cfg.num_requests, cfg.hot_slots), EMPTY, jnp.int32)
  elif cfg.warm_start == "first":
    pos = slots
  else:  # head_tail: first B//2 positions, then the most recent ones
    head = cfg.hot_slots // 2
    pos = jnp.where((lens <= cfg.hot_slots) | (slots < head), slots,
                    lens - cfg.hot_slots + slots)
  # Whatever the warm start, a prompt that fits stays fully resident.
  pos = jnp.where(lens <= cfg.hot_slots, slots, pos)
  return jnp.where(pos < lens, pos, EMPTY)


def prefill(cfg: TierConfig, state: TieredKVState, k_prompt, v_prompt, prompt_lens):
  """Write prompts into the host tier and warm the hot cache from device KV.

  Args:
    k_prompt, v_prompt: [L, R, P, Hkv, D] the prompts' K/V (device), P <= T.
    prompt_lens: i32[R], each <= P. Positions past a request's length are written
      but never read.

  Returns the state with seq_len = prompt_lens, metadata reset (LRU = slot order).
  """
  num_layers, num_req, plen = k_prompt.shape[:3]
  if plen > cfg.max_len:
    raise ValueError(f"prompt length {plen} exceeds the host tier (max_len={cfg.max_len})")
  shape6 = (num_layers, num_req, plen, cfg.num_units, cfg.heads_per_unit, cfg.head_dim)
  k6 = k_prompt.reshape(shape6).astype(state.host_k.dtype)
  v6 = v_prompt.reshape(shape6).astype(state.host_v.dtype)
  to_host = ((lambda x: jax.device_put(x, jax.memory.Space.Host))
             if fetch.is_host_array(state.host_k) else (lambda x: x))
  zeros = (0,) * 6
  host_k = jax.lax.dynamic_update_slice(state.host_k, to_host(k6), zeros)
  host_v = jax.lax.dynamic_update_slice(state.host_v, to_host(v6), zeros)

  pos = warm_positions(cfg, prompt_lens)  # [R, B]
  r = jnp.arange(num_req)[:, None]
  src = jnp.clip(pos, 0, plen - 1)
  warm_k = jnp.moveaxis(k6[:, r, src], 3, 2)  # [L, R, U, B, Hg, D]
  warm_v = jnp.moveaxis(v6[:, r, src], 3, 2)
  valid = (pos >= 0)[None, :, None, :, None, None]
  hot_k = state.hot_k.at[:, :, :, :cfg.hot_slots].set(
      jnp.where(valid, warm_k, state.hot_k[:, :, :, :cfg.hot_slots]))
  hot_v = state.hot_v.at[:, :, :, :cfg.hot_slots].set(
      jnp.where(valid, warm_v, state.hot_v[:, :, :, :cfg.hot_slots]))
  meta_shape = state.slot_pos.shape
  slot_pos = jnp.broadcast_to(pos[None, :, None, :], meta_shape)
  lru = jnp.broadcast_to(jnp.arange(cfg.hot_slots, dtype=jnp.int32), meta_shape)
  return state.replace(host_k=host_k, host_v=host_v, hot_k=hot_k, hot_v=hot_v,
                       slot_pos=slot_pos, lru=lru,
                       slot_score=jnp.zeros_like(state.slot_score),
                       seq_len=prompt_lens.astype(jnp.int32))


# ---------------------------------------------------------------------------------
# Driver: jitted, donated entry points with eager error reporting.
# ---------------------------------------------------------------------------------


def describe_status(status: int) -> str:
  reasons = []
  if status & STATUS_OUT_OF_RANGE:
    reasons.append("a selected position is out of range (not -1 and not in 0..newest)")
  if status & STATUS_DUPLICATE:
    reasons.append("a selection repeats a position")
  if status & STATUS_CAPACITY:
    reasons.append("a request's context exceeds the host tier (max_len)")
  return "; ".join(reasons) or "ok"


class StepRefused(ValueError):
  """A decode step refused its input; ``state`` is the (unchanged) returned state."""

  def __init__(self, message: str, state):
    super().__init__(message)
    self.state = state


class TieredDecoder:
  """Jitted prefill/step with donation; refuses bad input with ``ValueError``.

  The driver mirrors ``seq_len`` on the host (it advances deterministically), so the
  capacity check needs no device sync; the step's status word is read once per
  step (a serving loop reads its sampled tokens anyway).
  """

  def __init__(self, cfg: TierConfig, select: SelectFn = given_selection, *,
               index_share_every: int = 1, prefetch_cap: int | None = None):
    self.cfg = cfg
    self.select = select
    self._step = jax.jit(functools.partial(decode_step, cfg, select=select,
                                           index_share_every=index_share_every,
                                           prefetch_cap=prefetch_cap),
                         donate_argnums=(0,))
    self._append = jax.jit(functools.partial(append_newest, cfg), donate_argnums=(0,))
    self._prefill = jax.jit(functools.partial(prefill, cfg), donate_argnums=(0,))
    self.seq_len = np.zeros((cfg.num_requests,), np.int64)

  def prefill(self, state, k_prompt, v_prompt, prompt_lens):
    lens = np.asarray(prompt_lens)
    if (lens > self.cfg.max_len).any() or (lens > k_prompt.shape[2]).any():
      raise ValueError(f"prompt_lens {lens} exceed the prompt ({k_prompt.shape[2]}) "
                       f"or the host tier (max_len={self.cfg.max_len})")
    state = self._prefill(state, k_prompt, v_prompt, jnp.asarray(lens, jnp.int32))
    self.seq_len = lens.astype(np.int64).copy()
    return state

  def step(self, state, q, k_new, v_new, select_aux=None, prefetch=None):
    """One step; ``prefetch`` i32[L, R, U, kp] optionally names next-step positions."""
    if (self.seq_len >= self.cfg.max_len).any():
      raise ValueError(describe_status(STATUS_CAPACITY) +
                       f": seq_len={self.seq_len.tolist()}, max_len={self.cfg.max_len}")
    if self.select is given_selection and not isinstance(select_aux, jax.core.Tracer):
      sel = np.asarray(select_aux)
      width = self.cfg.select_width
      if sel.shape[1:] != (self.cfg.num_requests, self.cfg.num_units, width):
        raise ValueError(f"selections {sel.shape} must be [L, R, U, {width}] (rows of "
                         f"top_k={self.cfg.top_k}, rank_depth={self.cfg.rank_depth})")
      check_selection(sel, np.broadcast_to(self.seq_len[None, :, None], sel.shape[:-1]))
    out, state, status, committed = self._step(state, q, k_new, v_new,
                                               select_aux=select_aux, prefetch=prefetch)
    if not self.cfg.append_in_scan:
      state = self._append(state, committed)
    status = int(status)
    if status:
      raise StepRefused(f"decode step refused, cache unchanged: {describe_status(status)}",
                        state)
    self.seq_len += 1
    return out, state
