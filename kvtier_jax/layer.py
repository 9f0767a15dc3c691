"""One layer of the tiered step: RESOLVE, fetch the misses, attend (docs/DESIGN.md,
"The decode step").

Per anchor layer:

  1. the newest token's K/V go into reserved slot B (the host tier gets them after
     the step, ``decode.append_newest``);
  2. RESOLVE maps the selected positions to slots; only misses are fetched;
  3. exact sparse attention over the named slots;
  4. if the unit has an empty slot, the newest token is kept there too (short
     contexts stay fully resident and never fetch);
  5. options: the anchor fetches the misses of the layers sharing its selection
     (``cfg.index_share``), and prefetches predicted positions for the next step.

A layer whose input is invalid (selection out of range or duplicated, host tier
full) refuses: it and every later layer change nothing; the status word, threaded
from layer to layer, says why. The layer functions here are called by
``decode.tiered_attend`` only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax import attention, fetch, lookup, policies, sharding
from kvtier_jax.config import TierConfig
from kvtier_jax.resolve import (STATUS_CAPACITY, install_newest, resolve_with_policy,
                                selection_errors)
from kvtier_jax.shapes import EMPTY
from kvtier_jax.state import TieredKVState
from pallas_kernels import common
from pallas_kernels.fused_resolve import (CacheArrays, effective_slot_pos,
                                          keyed_victim_order, native, resolve_fetch,
                                          victim_order)
from pallas_kernels.sparse_decode_attention import merge_partials


class AnchorResult(NamedTuple):
  """An anchor layer's RESOLVE, replayed by the layers sharing its selection.

  The lookahead prefetch's rows are fetched by each sharing layer after its own
  attention (the anchor's prefetch may refill a slot this step still reads), so
  the anchor hands on its plan (None without a prefetch).
  """

  slot: jax.Array  # i32[R, U, k]
  is_hit: jax.Array  # bool[R, U, k] served without a fetch (newest included)
  is_miss: jax.Array  # bool[R, U, k] fetched (by the anchor, for every layer)
  target: jax.Array  # i32[R, U] slot that also keeps the newest token, -1 none
  prefetch_pos: jax.Array | None = None  # i32[R, U, kp] predicted for the next step
  prefetch_slot: jax.Array | None = None  # i32[R, U, kp] the slot each one goes to
  prefetch_miss: jax.Array | None = None  # bool[R, U, kp] fetched ahead

  @classmethod
  def empty(cls, cfg: TierConfig, prefetch_width: int | None = None) -> "AnchorResult":
    shape = (cfg.num_requests, cfg.num_units, cfg.top_k)
    plan = ()
    if prefetch_width is not None:
      ahead = shape[:2] + (prefetch_width,)
      plan = (jnp.full(ahead, EMPTY, jnp.int32), jnp.full(ahead, EMPTY, jnp.int32),
              jnp.zeros(ahead, bool))
    return cls(jnp.full(shape, EMPTY, jnp.int32), jnp.zeros(shape, bool),
               jnp.zeros(shape, bool), jnp.full(shape[:2], EMPTY, jnp.int32), *plan)


def _or_reduce(x):
  return jax.lax.reduce(x.astype(jnp.int32), np.int32(0), jax.lax.bitwise_or,
                        tuple(range(x.ndim)))


def _positions(cfg: TierConfig) -> dict:
  # Positions are < max_len + 1 (the scratch row): the bound of the map lookup.
  return dict(method=cfg.impl.lookup, num_positions=cfg.max_len + 1)


def _unit_rows(cfg: TierConfig, x):
  return x.reshape(cfg.num_requests, cfg.num_units, cfg.heads_per_unit, cfg.head_dim)


def _newest_writes(cfg: TierConfig, layer, target, ok, k_new, v_new):
  """Scatter destinations and rows of the newest token: slot B and the install
  slot (``target``; dropped when -1 or not ``ok``)."""
  shape = (cfg.num_requests, cfg.num_units)
  layer_col = jnp.full(shape, layer, jnp.int32)
  r_col = jnp.broadcast_to(jnp.arange(shape[0], dtype=jnp.int32)[:, None], shape)
  u_col = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32)[None, :], shape)
  to_b = jnp.stack([layer_col, r_col, u_col, jnp.full_like(r_col, cfg.hot_slots)], -1)
  to_target = jnp.stack([layer_col, jnp.where(ok & (target >= 0), r_col, shape[0]),
                         u_col, target], -1)
  dest = jnp.concatenate([to_b.reshape(-1, 4), to_target.reshape(-1, 4)])
  rows = lambda x: jnp.concatenate([_unit_rows(cfg, x).reshape(
      -1, cfg.heads_per_unit, cfg.head_dim)] * 2)
  return dest, rows(k_new), rows(v_new)


def _resolve(cfg: TierConfig, slot_pos, lru, score, selected, newest, ranks=None):
  return resolve_with_policy(cfg.policy, slot_pos, lru, score, selected, newest, ranks,
                             impl=cfg.impl.resolve, interpret=cfg.impl.interpret,
                             lookup_method=cfg.impl.lookup,
                             num_positions=cfg.max_len + 1)


def ordered_after(layer, out, num_layers: int):
  """``layer`` (< ``num_layers``) as a value computed from ``out``: whatever ``out``
  holds, ``min(layer, num_layers - 1 + any(isnan(out)))`` is ``layer``, but XLA
  must wait for ``out`` to know it, so everything the layer index feeds runs after.

  For writes into the hot cache that must follow an attention's read of it: with
  nothing ordering the two, XLA keeps the version read by copying the whole
  cache, and XLA:CPU drops optimization barriers before it inserts copies."""
  if isinstance(layer, int) and not 0 <= layer < num_layers:
    raise ValueError(f"layer {layer} is outside [0, {num_layers})")
  late = jnp.isnan(out).any().astype(jnp.asarray(layer).dtype)
  return jnp.minimum(layer, num_layers - 1 + late)


def after_attention(cfg: TierConfig, layer, out):
  """The layer index for hot-cache writes after an attention whose output is
  ``out``: ``ordered_after`` off GPU; on a GPU, ``layer`` (there the prefetch's host
  gather should overlap the attention, and XLA:GPU copies nothing:
  experiments/hlo_audit.py)."""
  return layer if common.on_gpu() else ordered_after(layer, out, cfg.num_layers)


def has_page(cfg: TierConfig, page_table, positions):
  """bool[R, ...]: positions (i32[R, ...]) whose host page exists."""
  pos = jnp.clip(positions, 0, cfg.max_len - 1)
  row = jnp.arange(page_table.shape[0]).reshape((-1,) + (1,) * (positions.ndim - 1))
  return (positions >= 0) & (page_table[row, pos // cfg.page_size] >= 0)


def anchor_layer(cfg: TierConfig, state: TieredKVState, layer, q, k_new, v_new,
                 selected, prior_status, active, *, prefetch=None, ranks=None,
                 selected_leads_ranks: bool = False):
  """Sparse attention of one layer that selects (an anchor), through the cache.

  Args:
    state: the whole cache (all layers); only ``layer`` (.. ``layer +
      cfg.index_share - 1``) is touched.
    layer: i32[] layer index.
    q: [R, Hq, D] queries; k_new, v_new: [R, Hkv, D] the newest token's K/V.
    selected: i32[R, U, k] positions to attend (-1 padding); the newest position
      (``state.seq_len``) is served from reserved slot B.
    prior_status: i32[] the earlier layers' status word; nonzero (one refused the
      step) forbids any change.
    active: bool[R] requests that decode this step; the others' metadata, hot
      rows (but slot B) and counters stay as they are, and they never refuse.
    prefetch: i32[R, U, kp] positions predicted for the next step (-1 padding;
      kp <= B): after attention, up to ``cfg.lookahead_cap`` of them that are not
      resident are fetched, so the next RESOLVE finds them resident.
    ranks: i32[R, U, m] the selector's best-first ranking (policy "rank").
    selected_leads_ranks: ``selected`` is ``ranks[..., :k]`` (not capped): the
      fused kernels then read the selection in place, without the slice's launch.

  Returns:
    (out [R, Hq, D], lse f32[R, Hq], state, status i32[] (``prior_status`` OR this
    layer's word), AnchorResult; None on the fused path without index sharing:
    nothing reads it).
  """
  num_req, num_units, share = cfg.num_requests, cfg.num_units, cfg.index_share
  newest = state.seq_len  # [R]
  newest_u = jnp.broadcast_to(newest[:, None], (num_req, num_units))
  if selected.shape != (num_req, num_units, cfg.top_k):
    raise ValueError(f"selector returned {selected.shape}, expected "
                     f"{(num_req, num_units, cfg.top_k)} (R, U, k)")
  if cfg.impl.fused:
    return _fused_anchor_layer(cfg, state, layer, q, k_new, v_new, selected,
                               prior_status, active, ranks, prefetch,
                               selected_leads_ranks)
  selected = jnp.where(active[:, None, None], selected.astype(jnp.int32), EMPTY)
  pages = state.page_table

  row_errors = selection_errors(selected, newest_u, cfg.max_len + 1,
                                cfg.impl.lookup)  # [R, U]
  status = _or_reduce(row_errors)
  status |= jnp.where((active & (newest >= cfg.max_len)).any(), STATUS_CAPACITY, 0)
  ok = (prior_status == 0) & (status == 0)

  # RESOLVE; uncommitted positions left in the metadata by a refused step
  # (>= seq_len) count as empty.
  slot_pos = effective_slot_pos(state.slot_pos[layer], newest)
  res, new_score = _resolve(cfg, slot_pos, state.lru[layer], state.slot_score[layer],
                            selected, newest_u, ranks)
  # A miss must be read from a host page: one without a page refuses the step (a
  # malformed row's misses are not counted: it refuses for its own reason, as in
  # the fused kernel).
  unpaged = res.is_miss & ~has_page(cfg, pages, selected) & (row_errors == 0)[..., None]
  status |= jnp.where(unpaged.any(), STATUS_CAPACITY, 0)
  # On a mesh every device refuses the layer with the others, before any write
  # (the earlier word included: begin_step's is the device's own).
  status = sharding.agree_status(status | prior_status, cfg.mesh_axes)
  ok = ok & (status == 0)
  row_ok = ok & active  # [R]: rows whose metadata this step changes
  is_miss = res.is_miss & ok

  # Keep the newest token resident while the unit has an empty slot (after
  # RESOLVE, so the slot is neither a hit nor a victim of this step).
  new_slot_pos, new_lru, target = install_newest(res.slot_pos, res.lru, newest_u)
  target = jnp.where(active[:, None], target, EMPTY)
  new_score = jnp.where(jnp.arange(cfg.hot_slots) == target[..., None], 1.0, new_score)

  # The hot-cache writes before attention reads: fetched misses -> their victims,
  # then newest -> slot B and the install target (docs/DESIGN.md: a write after a
  # read with no data order copies the whole hot cache).
  dest, new_k, new_v = _newest_writes(cfg, layer, target, ok, k_new, v_new)
  host_k, host_v, hot_k, hot_v = state.host_k, state.host_v, state.hot_k, state.hot_v

  def fetch_for_sharing_layers(hot_k, hot_v, moved):
    # Index sharing: the next share - 1 layers' misses are fetched here, ahead of
    # their attention (their RESOLVE would pick the same slots).
    for j in range(1, share):
      hot_k, hot_v, shared_moved = _fetch_for_layer(cfg, host_k, host_v, pages, hot_k,
                                                    hot_v, layer + j, selected,
                                                    res.slot, is_miss)
      moved += shared_moved
    return hot_k, hot_v, moved

  # Where the sharing layers' fetch goes. Written after this layer's attention
  # read the cache, nothing orders the writes after the read by data and XLA
  # copies the whole hot cache to keep the version read. On a GPU it goes after
  # an optimization barrier on (output, cache), so its host gather can overlap
  # the attention; XLA:CPU expands barriers before copy insertion, so there it
  # goes first, before this layer's own writes.
  sharing_fetch_after = share > 1 and common.on_gpu()
  shared_moved = 0
  if not sharing_fetch_after:
    hot_k, hot_v, shared_moved = fetch_for_sharing_layers(hot_k, hot_v, 0)
  if cfg.overlap_hit_miss:
    out, lse, hot_k, hot_v, moved = _overlapped_attention(
        cfg, q, host_k, host_v, pages, hot_k, hot_v, layer, selected, res, is_miss,
        dest, new_k, new_v)
  else:
    if common.use_kernel(cfg.impl.fetch, "fetch"):
      hot_k, hot_v, moved = fetch.fetch_misses_kernel(
          cfg, host_k, host_v, pages, hot_k, hot_v, layer, selected, res.slot, is_miss)
    else:
      hot_k, hot_v, moved = fetch.fetch_misses(cfg, host_k, host_v, pages, hot_k, hot_v,
                                               layer, selected, res.slot, is_miss)
    hot_k = fetch.scatter_rows(hot_k, dest, new_k)
    hot_v = fetch.scatter_rows(hot_v, dest, new_v)
    out, lse = attention.hot_attention(cfg, q, hot_k, hot_v, layer, res.slot)
  moved += shared_moved

  if sharing_fetch_after:
    out, lse, hot_k, hot_v = jax.lax.optimization_barrier((out, lse, hot_k, hot_v))
    hot_k, hot_v, moved = fetch_for_sharing_layers(hot_k, hot_v, moved)

  # Lookahead prefetch for the next step (this layer's rows; the sharing layers
  # fetch theirs after their attention).
  prefetched = jnp.zeros((num_req, num_units), jnp.int32)
  plan = None
  if prefetch is not None:
    (new_slot_pos, new_lru, new_score, hot_k, hot_v, pf_moved, prefetched,
     plan) = _prefetch(cfg, host_k, host_v, pages, hot_k, hot_v,
                       after_attention(cfg, layer, out), new_slot_pos,
                       new_lru, new_score, prefetch, newest_u, row_ok[:, None, None],
                       ranks)
    moved += pf_moved

  is_hit = (selected >= 0) & ~res.is_miss
  span = lambda x: jnp.broadcast_to(x, (share,) + x.shape)
  old = lambda x: jax.lax.dynamic_slice_in_dim(x, layer, share)
  put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(x, new, layer, 0)
  keep = lambda new, x: put(x, jnp.where(row_ok[None, :, None, None], span(new), old(x)))
  count = lambda x, mask: put(x, old(x) + span(jnp.where(
      ok, mask.sum(-1, dtype=jnp.int32), 0)))
  state = state.replace(
      hot_k=hot_k, hot_v=hot_v,
      slot_pos=keep(new_slot_pos, state.slot_pos),
      lru=keep(new_lru, state.lru),
      slot_score=keep(new_score, state.slot_score),
      hits=count(state.hits, is_hit),
      misses=count(state.misses, is_miss),
      # Every layer sharing the selection gets the prefetched rows (shared_layer).
      prefetched=put(state.prefetched, old(state.prefetched) + span(prefetched)),
      # A refusing layer moves nothing the caller sees: its transfers (a GPU's first
      # chunk is gathered whatever the count) are not counted.
      fetched_rows=state.fetched_rows.at[layer].add(jnp.where(ok, moved, 0)),
  )
  anchor = AnchorResult(res.slot, is_hit, is_miss, target,
                        *(() if plan is None else (prefetch, *plan)))
  return out, lse, state, prior_status | status, anchor


def _fused_anchor_layer(cfg: TierConfig, state: TieredKVState, layer, q, k_new, v_new,
                        selected, prior_status, active, ranks=None, prefetch=None,
                        selected_leads_ranks=False):
  """``anchor_layer`` through the fused kernels: the same state, status and outputs
  (metadata and counters equal, integer for integer), in two launches and the
  attention. With index sharing the commit also fetches and writes the metadata of
  the layers sharing the selection. A keyed policy adds a kernel for its key (the
  rank lookup included) and one sort per row before them; a lookahead prefetch
  runs after the attention, as on the unfused path, over the committed metadata
  (XLA RESOLVE and fetch)."""
  fields = CacheArrays._fields
  cache = CacheArrays(*(getattr(state, name) for name in fields))
  run_native = native.use_native(cfg.impl.interpret)
  # The kernels read the ranking's first k in place: the slice that made
  # ``selected`` is then dead code, one launch per layer fewer.
  selection = ranks if selected_leads_ranks and ranks is not None else None
  order = None
  if cfg.policy.keyed:  # the victim order: one kernel (key, rank lookup) + one sort
    # Unmasked: the kernels skip inactive rows (their order is never read), and one
    # operand for both kernels is one XLA op, not two.
    ranking = selected if ranks is None else ranks
    if run_native:  # the XLA path's key (no interpreted kernel), the same sort
      slot_pos = effective_slot_pos(state.slot_pos[layer], state.seq_len)
      key = policies.victim_key(cfg.policy, slot_pos, state.slot_score[layer],
                                ranking.astype(jnp.int32), **_positions(cfg))
      order = victim_order(state.slot_pos[layer], state.lru[layer], key, state.seq_len)
    else:
      order = keyed_victim_order(
          layer, state.seq_len, state.slot_pos, state.lru, state.slot_score,
          ranking if cfg.policy.name == "rank" else None, max_len=cfg.max_len,
          rank_freq=cfg.policy.rank_freq, interpret=cfg.use_interpret)
    if ranks is None and prefetch is not None:  # the prefetch ranks as anchor_layer
      ranks = jnp.where(active[:, None, None], selected.astype(jnp.int32), EMPTY)
  step = dict(order=order, max_len=cfg.max_len, page_size=cfg.page_size,
              share=cfg.index_share,
              score_decay=cfg.policy.freq_alpha if cfg.policy.keyed else None)
  if not run_native:
    step["interpret"] = cfg.use_interpret
    if selection is not None:
      selected, step["num_sel"] = selection, cfg.top_k
  # Off GPU one native call (native_cpu.cc), else the two Pallas kernels.
  res = (native.resolve_fetch_native if run_native else resolve_fetch)(
      layer, prior_status, active, state.seq_len, selected, cache, state.page_table,
      state.host_k, state.host_v, k_new, v_new, **step)
  state = state.replace(**dict(zip(fields, res.cache)))
  out, lse = attention.hot_attention(cfg, q, state.hot_k, state.hot_v, layer, res.slot)
  plan = None
  if prefetch is not None:
    state, plan = _fused_prefetch(cfg, state, layer, prefetch, res.status == 0,
                                  (res.status == 0) & active, ranks, after=out)
  anchor = None if cfg.index_share == 1 else AnchorResult(
      res.slot, (res.slot >= 0) & ~res.is_miss, res.is_miss, res.target,
      *(() if plan is None else (prefetch, *plan)))
  return out, lse, state, res.status, anchor


def _fused_prefetch(cfg: TierConfig, state: TieredKVState, layer, prefetch, ok, row_ok,
                    ranks=None, *, after):
  """The lookahead prefetch after a fused commit: what ``anchor_layer`` does after
  its attention (output ``after``), from the metadata the commit wrote (rows not
  ``row_ok`` bool[R] keep theirs; a refused layer, not ``ok``, counts no rows).
  Returns (state, the plan for the sharing layers)."""
  share = cfg.index_share
  newest = jnp.broadcast_to(state.seq_len[:, None], (cfg.num_requests, cfg.num_units))
  slot_pos, lru, score, hot_k, hot_v, moved, prefetched, plan = _prefetch(
      cfg, state.host_k, state.host_v, state.page_table, state.hot_k, state.hot_v,
      after_attention(cfg, layer, after), state.slot_pos[layer], state.lru[layer],
      state.slot_score[layer], prefetch, newest, row_ok[:, None, None], ranks)
  old = lambda x: jax.lax.dynamic_slice_in_dim(x, layer, share)
  keep = lambda new, x: jax.lax.dynamic_update_slice_in_dim(
      x, jnp.where(row_ok[None, :, None, None], jnp.broadcast_to(new, (share,) + new.shape),
                   old(x)), layer, 0)
  return state.replace(
      hot_k=hot_k, hot_v=hot_v, slot_pos=keep(slot_pos, state.slot_pos),
      lru=keep(lru, state.lru), slot_score=keep(score, state.slot_score),
      prefetched=jax.lax.dynamic_update_slice_in_dim(  # as anchor_layer counts them
          state.prefetched, old(state.prefetched)
          + jnp.broadcast_to(prefetched, (share,) + prefetched.shape), layer, 0),
      fetched_rows=state.fetched_rows.at[layer].add(jnp.where(ok, moved, 0))), plan


def shared_layer(cfg: TierConfig, state: TieredKVState, layer, q, k_new, v_new,
                 anchor: AnchorResult, ok):
  """A layer that reuses its anchor's selection (index sharing).

  Its misses were fetched and its metadata set by the anchor (lockstep), so no
  RESOLVE happens here: the newest token goes to slot B (and the install slot),
  then attention over the anchor's slots; then the rows the anchor prefetched for
  the next step, if any, into the slots its plan names.

  Returns (out [R, Hq, D], lse f32[R, Hq], state).
  """
  dest, new_k, new_v = _newest_writes(cfg, layer, anchor.target, ok, k_new, v_new)
  hot_k = fetch.scatter_rows(state.hot_k, dest, new_k)
  hot_v = fetch.scatter_rows(state.hot_v, dest, new_v)
  out, lse = attention.hot_attention(cfg, q, hot_k, hot_v, layer, anchor.slot)
  fetched_rows = state.fetched_rows
  if anchor.prefetch_pos is not None:
    hot_k, hot_v, moved = _fetch_for_layer(
        cfg, state.host_k, state.host_v, state.page_table, hot_k, hot_v,
        after_attention(cfg, layer, out), anchor.prefetch_pos, anchor.prefetch_slot,
        anchor.prefetch_miss)
    fetched_rows = fetched_rows.at[layer].add(jnp.where(ok, moved, 0))
  return out, lse, state.replace(hot_k=hot_k, hot_v=hot_v, fetched_rows=fetched_rows)


def cap_misses(cfg: TierConfig, state: TieredKVState, layer, selected, cap: int):
  """Keep resident positions and the first ``cap`` others; drop the rest (-1).

  For an uncommitted look-ahead pass (a draft token): it reads what is resident and
  fetches at most ``cap`` rows per unit, so the traffic it adds is bounded.
  """
  newest = state.seq_len[:, None, None]
  resident = (lookup.resident_mask(state.slot_pos[layer], selected, **_positions(cfg))
              | (selected == newest))
  fetch_it = (selected >= 0) & ~resident
  fetch_it &= jnp.cumsum(fetch_it, axis=-1) <= cap
  return jnp.where(resident | fetch_it, selected, EMPTY)


def _fetch_for_layer(cfg, host_k, host_v, pages, hot_k, hot_v, layer, selected, slot,
                     is_miss):
  """Fetch ``is_miss`` rows of ``layer`` into ``slot`` (no attention, no metadata)."""
  if common.use_kernel(cfg.impl.fetch, "fetch"):
    return fetch.fetch_misses_kernel(cfg, host_k, host_v, pages, hot_k, hot_v, layer,
                                     selected, slot, is_miss)
  return fetch.fetch_misses(cfg, host_k, host_v, pages, hot_k, hot_v, layer, selected,
                            slot, is_miss, first_chunk_always=True)


def prefetch_resolve(cfg: TierConfig, slot_pos, lru, score, predicted, newest, ok=True,
                     ranks=None, page_table=None):
  """Which predicted positions to fetch ahead, and the metadata after it.

  A RESOLVE over the prediction: predicted positions already resident are hits
  (protected, promoted), the first ``cfg.lookahead_cap`` others become misses
  that take victims. Positions >= ``newest`` (not in the host tier yet) are
  skipped, and so are positions without a host page (``page_table``). Under a
  keyed policy the key picks the victims; the score only restarts at 1 in the
  refilled slots (``policies.prefetched_score``).
  Returns (ResolveOutputs, score).
  """
  if predicted.shape[-1] > cfg.hot_slots:
    raise ValueError(f"{predicted.shape[-1]} predicted positions exceed "
                     f"B={cfg.hot_slots}")
  resident = lookup.resident_mask(slot_pos, predicted, **_positions(cfg))
  usable = (predicted >= 0) & (predicted < newest[..., None]) & ok
  # A prediction is a guess, not a selection: a repeated position is fetched once
  # (twice, it would hold two slots), never refused.
  usable &= ~lookup.duplicate_mask(predicted, **_positions(cfg))
  if page_table is not None:
    usable &= has_page(cfg, page_table, predicted)
  wanted = usable & ~resident
  if cfg.lookahead_cap is not None:
    wanted &= jnp.cumsum(wanted, axis=-1) <= cfg.lookahead_cap
  res, _ = _resolve(cfg, slot_pos, lru, score,
                    jnp.where(wanted | (usable & resident), predicted, EMPTY),
                    jnp.full_like(newest, EMPTY), ranks)
  return res, policies.prefetched_score(cfg.policy, score, res.slot, res.is_miss)


def _prefetch(cfg, host_k, host_v, pages, hot_k, hot_v, layer, slot_pos, lru, score,
              predicted, newest, ok, ranks=None):
  """Fetch predicted, not-yet-resident positions of ``layer`` into victims (capped).

  Returns (slot_pos, lru, score, hot_k, hot_v, rows moved, prefetched per unit
  i32[R, U], the plan (slot i32[R, U, kp], fetched bool[R, U, kp]) that the layers
  sharing this selection replay after their attention).
  """
  res, score = prefetch_resolve(cfg, slot_pos, lru, score, predicted, newest, ok, ranks,
                                pages)
  hot_k, hot_v, moved = _fetch_for_layer(cfg, host_k, host_v, pages, hot_k, hot_v,
                                         layer, predicted, res.slot, res.is_miss)
  return (res.slot_pos, res.lru, score, hot_k, hot_v, moved,
          res.is_miss.sum(-1, dtype=jnp.int32), (res.slot, res.is_miss))


def _overlapped_attention(cfg, q, host_k, host_v, pages, hot_k, hot_v, layer, selected,
                          res, is_miss, dest, new_k, new_v):
  """Attention over resident rows while the misses are fetched, then over the
  misses, merged by log-sum-exp (SGLang PR #22313's split).

  The hit partial depends only on rows already in the hot cache (plus the newest
  token, written first), so on a GPU XLA can run it while the host gather is in
  flight (off GPU it runs after the fetched rows' writes, below); with the
  host-gather fetch, or the zero-copy gather on its own stream
  (``impl.fetch_stream``), the miss partial reads the fetched rows straight from
  the staging buffer. Exact to f32 rounding (only the summation order changes):
  both partials are computed and merged in f32 and rounded to q's dtype once.
  """
  q_dtype, q = q.dtype, q.astype(jnp.float32)
  hot_k = fetch.scatter_rows(hot_k, dest, new_k)  # newest -> slot B (+ install slot)
  hot_v = fetch.scatter_rows(hot_v, dest, new_v)
  hit_slot = jnp.where(res.is_miss, EMPTY, res.slot)
  zero_copy = common.use_kernel(cfg.impl.fetch, "fetch")
  streamed = zero_copy and cfg.impl.fetch_stream is not None
  # The hits are attended before the fetch, to overlap it, except off GPU:
  # nothing runs asynchronously there, and XLA:CPU copies the whole hot cache for
  # a write after a read (it expands barriers before copy insertion), so the hits
  # are attended after the fetched rows' writes. The misses land in victims,
  # never in a hit's slot: the hit partial is the same.
  hits_first = not streamed and common.on_gpu()
  if hits_first:
    out_h, lse_h = attention.hot_attention(cfg, q, hot_k, hot_v, layer, hit_slot)
  if zero_copy and not streamed:
    hot_k, hot_v, moved = fetch.fetch_misses_kernel(
        cfg, host_k, host_v, pages, hot_k, hot_v, layer, selected, res.slot, is_miss)
    out_m, lse_m = attention.hot_attention(cfg, q, hot_k, hot_v, layer,
                                           jnp.where(is_miss, res.slot, EMPTY))
    if not hits_first:
      out_h, lse_h = attention.hot_attention(cfg, q, hot_k, hot_v, layer, hit_slot)
  else:
    if streamed:  # staged, on its own stream (ImplConfig.fetch_stream)
      hits = lambda q_: attention.hot_attention(cfg, q_, hot_k, hot_v, layer, hit_slot)
      rows, (out_h, lse_h) = fetch.gather_misses_kernel(
          cfg, host_k, host_v, pages, layer, selected, res.slot, is_miss,
          during=(hits, q))
    else:
      rows = fetch.gather_misses(cfg, host_k, host_v, pages, layer, selected, res.slot,
                                 is_miss, first_chunk_always=True)
    lane = jnp.minimum(rows.lane, rows.k.shape[0] - 1)
    out_m, lse_m = attention.rows_attention(q, rows.k[lane], rows.v[lane], is_miss,
                                            cfg.row_tile)
    if hits_first:
      # The rows land in the cache the hit attention read, and nothing else orders
      # that read first: XLA 0.11.2 copied the whole cache for it beside index
      # sharing (deviceless H200). The streamed gather joins the two itself.
      out_h, lse_h, hot_k, hot_v = jax.lax.optimization_barrier(
          (out_h, lse_h, hot_k, hot_v))
    hot_k = fetch.scatter_rows(hot_k, rows.dest, rows.k)
    hot_v = fetch.scatter_rows(hot_v, rows.dest, rows.v)
    moved = rows.moved
    if not streamed and not hits_first:
      out_h, lse_h = attention.hot_attention(cfg, q, hot_k, hot_v, layer, hit_slot)
  out, lse = merge_partials(out_h, lse_h, out_m, lse_m)
  return out.astype(q_dtype), lse, hot_k, hot_v, moved
