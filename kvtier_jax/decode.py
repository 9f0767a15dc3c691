"""The tiered decode step: one per-layer ``attend`` that every caller runs.

``tiered_attend(cfg, selector)`` is the tiered backend of a model's layer scan:
``out, carry = attend(layer, q, k_new, v_new, carry, x, member)``. The Flax model
(models/transformer.py ``apply_decode``) calls it from its own layer scan;
``decode_step`` calls it from a scan over precomputed per-layer q/k/v (tests,
benchmarks, the H200 audit). The step's state is a ``TieredCarry``: the cache, the
selector's state, and the step's status word (0: no layer refused). After the scan
``commit_step`` advances ``seq_len`` if no layer refused; the host append
(``append_newest``) and the refusal check run in the host driver (driver.py).

The whole state is in the carry, so every write (hot slots, metadata) is an
in-place update of a donated buffer.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax import fetch, layer as layer_lib, layer_scan
from kvtier_jax.config import TierConfig
from kvtier_jax.layer import AnchorResult
from kvtier_jax.resolve import STATUS_CAPACITY
from kvtier_jax.selectors.base import (StepInputs, check_picked, check_ranking,
                                       check_state_capacity, check_state_layout,
                                       layer_slice)
from kvtier_jax.shapes import EMPTY
from kvtier_jax.state import TieredKVState, committed


@flax.struct.dataclass
class TieredCarry:
  """Everything one tiered step reads and writes, threaded through the layers."""

  tier: TieredKVState
  sel: Any  # selector state, leaves [L, ...]
  params: Any  # selector params, leaves [L, ...] (DSA indexer) or None
  status: jax.Array  # i32[] OR of the layers' status words (0: none refused)
  anchor: AnchorResult  # the current anchor's RESOLVE (index sharing)
  active: jax.Array  # bool[R] requests that decode this step (a serving batch)
  prefetch: Any = None  # i32[L, R, U, kp] positions predicted for the next step

  @property
  def ok(self) -> jax.Array:
    """bool[]: no layer refused the step so far. Derived, not carried: each layer
    (the fused commit kernel itself) threads one word, no flag beside it."""
    return self.status == 0


def init_carry(cfg: TierConfig, tier: TieredKVState, sel=None, params=None,
               prefetch=None, active=None) -> TieredCarry:
  active = jnp.ones((cfg.num_requests,), bool) if active is None else jnp.asarray(active)
  width = None if prefetch is None else prefetch.shape[-1]
  return committed(TieredCarry(tier, sel, params, jnp.int32(0),
                               AnchorResult.empty(cfg, width), active, prefetch))


@functools.cache
def tiered_attend(cfg: TierConfig, selector, draft: bool = False):
  """The tiered backend's ``attend`` (cached: a static argument of the step).

  With ``cfg.index_share`` N > 1 the caller runs groups of N layers and passes the
  static ``member`` (0 = the anchor, which selects and resolves). ``draft``: an
  uncommitted look-ahead pass; each anchor reads what is resident plus at most
  ``cfg.lookahead_cap`` fetched rows per unit (``layer.cap_misses``; None: no
  cap); finish it with ``finish_draft``.
  """

  def attend(layer, q, k_new, v_new, carry: TieredCarry, x=None, member: int = 0):
    if member > 0:
      out, _, tier = layer_lib.shared_layer(cfg, carry.tier, layer, q, k_new, v_new,
                                            carry.anchor, carry.ok)
      return out, carry.replace(tier=tier)
    tier = carry.tier
    cfg.check_step_inputs(q, k_new, v_new, per_layer=True)
    check_state_capacity(selector, carry.sel, cfg.max_len)
    check_state_layout(carry.sel, carry.params, cfg.num_layers, cfg.num_requests)
    check_ranking(selector, cfg.top_k, cfg.select_width)
    params = None if carry.params is None else layer_slice(carry.params, layer)
    # The selector updates its state in place, as in the sparse backend, even for
    # inactive rows and on a layer that refuses: an update is position-idempotent
    # (selectors.base), so what it wrote at the uncommitted position is overwritten
    # when the row decodes that position (a retry, the next step after a draft).
    # Nothing is restored, so nothing reads old values after the update (a restore
    # made XLA copy the state: the whole [L, ...] state, Quest at 32K, R=8: 4 x 377
    # MB per layer; then a one-layer view, 2 x 12 MiB; then the view's slices and
    # scatters, 2 launches per state array and layer).
    picked, sel = selector.select(carry.sel, layer,
                                  StepInputs(x, q, k_new, tier.seq_len, layer), params)
    check_picked(picked)
    if picked.shape[-1] != cfg.select_width:
      raise ValueError(f"selector returned {picked.shape}, expected rows of "
                       f"{cfg.select_width} (top_k={cfg.top_k}, "
                       f"rank_depth={cfg.policy.rank_depth})")
    # Policy "rank": the selector ranks cfg.select_width positions, best first; the
    # first top_k are attended, the whole row steers victims.
    ranks = picked if cfg.policy.name == "rank" else None
    selected = picked[..., :cfg.top_k]
    capped = draft and cfg.lookahead_cap is not None  # None: every miss is fetched
    if capped:
      selected = layer_lib.cap_misses(cfg, tier, layer, selected, cfg.lookahead_cap)
    if carry.prefetch is not None and carry.prefetch.shape[:3] != (
        cfg.num_layers, cfg.num_requests, cfg.num_units):  # [layer] would clamp
      raise ValueError(f"prefetch {carry.prefetch.shape} must be [L={cfg.num_layers}, "
                       f"R={cfg.num_requests}, U={cfg.num_units}, kp]")
    prefetch = None if carry.prefetch is None else carry.prefetch[layer]
    out, _, tier, status, anchor = layer_lib.anchor_layer(
        cfg, tier, layer, q, k_new, v_new, selected, carry.status, carry.active,
        prefetch=prefetch, ranks=ranks, selected_leads_ranks=not capped)
    anchor = carry.anchor if anchor is None else anchor
    return out, carry.replace(tier=tier, sel=sel, status=status, anchor=anchor)

  attend.index_share = cfg.index_share
  return attend


def begin_step(cfg: TierConfig, carry: TieredCarry) -> TieredCarry:
  """A fresh status word, or the capacity bit when a row would be lost: the newest
  token goes to slot B and its install slot, and its host row to its page. With no
  page it survives the next step only in an install slot, and only a request with
  no pages at all (its whole life in B) never evicts: its positions are all
  resident, so an empty slot is left while ``newest < B``. Otherwise the row would
  exist nowhere (invariant 1); the engine allocates the page first. On a mesh the
  first layer agrees on it with the other devices (no collective of its own)."""
  width = lambda x: None if x is None else np.shape(x)[-1]
  if width(carry.prefetch) != width(carry.anchor.prefetch_pos):
    raise ValueError(f"the carry's prefetch ({width(carry.prefetch)} positions) does "
                     f"not fit the anchor it was built with "
                     f"({width(carry.anchor.prefetch_pos)}): build it with "
                     "init_carry(..., prefetch=) of this width")
  lost = carry.active & rows_without_room(cfg, carry.tier)
  return carry.replace(status=jnp.where(lost.any(), STATUS_CAPACITY, 0).astype(jnp.int32))


def rows_without_room(cfg: TierConfig, tier: TieredKVState) -> jax.Array:
  """bool[R]: the requests whose next token would exist nowhere if they decoded
  now (no page for it, and not a request that lives in its B slots; see
  ``begin_step``). A draft pass leaves them out instead of refusing the others."""
  newest = tier.seq_len
  unpaged = ~layer_lib.has_page(cfg, tier.page_table, newest)
  paged_request = (tier.page_table >= 0).any(-1)
  return (newest < cfg.max_len) & unpaged & (paged_request | (newest >= cfg.hot_slots))


def commit_step(carry: TieredCarry) -> TieredCarry:
  """After all layers: the decoded position joins the context of every active
  request, unless a layer refused. A committed step has used its prefetch (a
  prediction for the step after it): it is emptied, so a carry stepped again
  without a new one does not fetch a stale prediction; a refused step keeps it for
  the retry."""
  tier = carry.tier
  step = (carry.ok & carry.active).astype(jnp.int32)
  prefetch = carry.prefetch
  if prefetch is not None:
    prefetch = jnp.where(carry.ok, EMPTY, prefetch)
  return carry.replace(tier=tier.replace(seq_len=tier.seq_len + step), prefetch=prefetch)


def finish_draft(before: TieredCarry, after: TieredCarry) -> TieredCarry:
  """Undo what a draft pass would commit; keep what it fetched (the prefetch).

  seq_len and the hit/miss counters are restored (the rows it fetched count as
  prefetched), and so is the keyed policies' score EMA, but in the slots the pass
  refilled (they restart as a prefetch does): the EMA moves once per step, with
  what the step selected. Its KV went only to reserved slot B and the install
  slot, and its selector state moved only at the uncommitted position seq_len: the
  next step overwrites both (selector updates are position-idempotent,
  selectors.base), and RESOLVE treats that position as empty. Keeping ``before``'s
  selector state instead would make XLA copy all of it. The LRU order keeps the
  pass's promotions of the rows it read: what the draft predicts the next step
  reads is protected from that step's evictions, as ``layer.prefetch_resolve``
  protects a predicted position already resident.
  """
  fetched = after.tier.misses - before.tier.misses
  refilled = after.tier.slot_pos != before.tier.slot_pos
  tier = after.tier.replace(seq_len=before.tier.seq_len, hits=before.tier.hits,
                            misses=before.tier.misses,
                            prefetched=after.tier.prefetched + fetched,
                            slot_score=jnp.where(refilled, after.tier.slot_score,
                                                 before.tier.slot_score))
  return after.replace(tier=tier)


def decode_step(cfg: TierConfig, selector, carry: TieredCarry, q, k_new, v_new, x=None):
  """One decode step over all layers from precomputed per-layer inputs.

  Runs the same ``tiered_attend`` as the model's layer scan, grouped by
  ``cfg.index_share`` as the model groups its layers.

  Args:
    q: [L, R, Hq, D]; k_new, v_new: [L, R, Hkv, D] (the newest token, every layer).
    x: optional [L, R, Dm] the layers' normalised inputs (selectors that read the
      hidden state, DSA's indexer).

  Returns:
    (out [L, R, Hq, D], carry committed; run ``append_newest`` next).
  """
  cfg.check_step_inputs(q, k_new, v_new)
  attend = tiered_attend(cfg, selector)
  share = cfg.index_share
  group = lambda a: None if a is None else a.reshape(
      (cfg.num_layers // share, share) + a.shape[1:])

  def body(carry, xs):
    first, q_g, k_g, v_g, x_g = xs
    outs = []
    for member in range(share):
      layer = first + member
      if outs:
        # A sharing layer writes the hot cache that the layer before it read. In a
        # model its inputs come from that layer's output, which orders the two;
        # here they are given, and XLA:CPU (whose optimization barriers are gone
        # by copy insertion) copied the whole hot cache to keep the version read.
        layer = layer_lib.after_attention(cfg, layer, outs[-1])
      out, carry = attend(layer, q_g[member], k_g[member], v_g[member], carry,
                          None if x_g is None else x_g[member], member)
      outs.append(out)
    return carry, jnp.stack(outs)

  firsts = jnp.arange(0, cfg.num_layers, share, dtype=jnp.int32)
  carry, out = layer_scan.scan_layers(
      body, begin_step(cfg, carry), (firsts, group(q), group(k_new), group(v_new),
                                     group(x)),
      pick=not cfg.impl.slice_layer_inputs and cfg.impl.fetch_stream is None)
  return out.reshape((cfg.num_layers,) + out.shape[2:]), commit_step(carry)


def append_newest(cfg: TierConfig, tier: TieredKVState, committed):
  """Copy every layer's newest rows (reserved slot B) into the host tier.

  Runs as its own donated jit after the step (one strided write per request for
  all layers: faster on an H200 than 2R writes per layer inside the scan, and
  copy-free; docs/DESIGN.md). ``committed`` bool[R] (or []): rows whose position
  seq_len - 1 was just committed go to its page; the others, and positions
  without a page, go to the scratch page.
  """
  rows_k = tier.hot_k[:, :, :, cfg.hot_slots]  # [L, R, U, Hg, D]
  rows_v = tier.hot_v[:, :, :, cfg.hot_slots]
  positions = jnp.where(committed, tier.seq_len - 1, EMPTY)
  pages, offsets = fetch.host_location(cfg, tier.page_table, positions)
  host_k, host_v = fetch.append_rows(tier.host_k, tier.host_v, pages, offsets, rows_k,
                                     rows_v)
  return tier.replace(host_k=host_k, host_v=host_v)


def write_prompt_pages(cfg: TierConfig, tier: TieredKVState, requests, start, k, v):
  """Write prompt positions ``start .. start + n - 1`` of each request in
  ``requests`` (i32[R']) to its host pages; ``start`` is page-aligned.

  k, v: [L, R', n, Hkv, D] with n a multiple of the page size. Pages the
  requests lack (past their length) go to the scratch page.
  """
  num_layers, num_req, length = k.shape[:3]
  size = cfg.page_size
  if length % size:
    raise ValueError(f"{length} positions are not whole pages of {size}")
  if not isinstance(start, jax.core.Tracer) and int(start) % size:
    # A traced start is the caller's to align (the serving backend's chunks are).
    raise ValueError(f"prompt pages start at position {int(start)}, not at a page "
                     f"boundary (page size {size})")
  num_pages = length // size
  logical = start // size + jnp.arange(num_pages)  # [n / Pg]
  table = tier.page_table[requests][:, jnp.minimum(logical, cfg.pages_per_request - 1)]
  table = jnp.where(logical < cfg.pages_per_request, table, EMPTY)
  pages = jnp.where(table >= 0, table, cfg.num_host_pages).reshape(-1)
  shape = (num_layers, num_req * num_pages, size, cfg.num_units, cfg.heads_per_unit,
           cfg.head_dim)
  host_k, host_v = fetch.write_pages(tier.host_k, tier.host_v, pages, k.reshape(shape),
                                     v.reshape(shape))
  return tier.replace(host_k=host_k, host_v=host_v)


def warm_positions(cfg: TierConfig, prompt_lens):
  """Positions a prefill leaves in slots 0..B-1, i32[R', B] (-1 empty) for
  prompt_lens i32[R']."""
  slots = jnp.arange(cfg.hot_slots, dtype=jnp.int32)[None, :]
  lens = prompt_lens.astype(jnp.int32)[:, None]
  if cfg.warm_start == "empty":
    pos = jnp.full((lens.shape[0], cfg.hot_slots), EMPTY, jnp.int32)
  elif cfg.warm_start == "first":
    pos = slots
  else:  # head_tail: first B//2 positions, then the most recent ones
    head = cfg.hot_slots // 2
    pos = jnp.where((lens <= cfg.hot_slots) | (slots < head), slots,
                    lens - cfg.hot_slots + slots)
  # Whatever the warm start, a prompt that fits stays fully resident.
  pos = jnp.where(lens <= cfg.hot_slots, slots, pos)
  return jnp.where(pos < lens, pos, EMPTY)


def check_prompt(cfg: TierConfig, k_prompt, v_prompt, prompt_lens) -> None:
  """``prefill``'s inputs against ``cfg``: K/V [L, R, P, Hkv, D] with P <= max_len,
  lengths i32[R]; their values too where they are concrete (not traced)."""
  want = (cfg.num_layers, cfg.num_requests, "P", cfg.num_kv_heads, cfg.head_dim)
  for name, x in (("k_prompt", k_prompt), ("v_prompt", v_prompt)):
    if (np.ndim(x) != 5 or np.shape(x) != np.shape(k_prompt)
        or any(w != "P" and n != w for n, w in zip(np.shape(x), want))):
      raise ValueError(f"{name} {np.shape(x)} must be [L, R, P, Hkv, D] = "
                       f"{list(want)}, as k_prompt {np.shape(k_prompt)}")
  plen = np.shape(k_prompt)[2]
  if plen > cfg.max_len:
    raise ValueError(f"prompt length {plen} exceeds the host tier (max_len={cfg.max_len})")
  if plen == 0:  # (requests of length 0 are fine, in a batch of P >= 1)
    raise ValueError("the prompts' K/V hold P = 0 positions; give at least one")
  dtype = (prompt_lens if hasattr(prompt_lens, "dtype") else np.asarray(prompt_lens)).dtype
  if np.shape(prompt_lens) != (cfg.num_requests,) or np.dtype(dtype).kind not in "iu":
    raise ValueError(f"prompt_lens {dtype}{list(np.shape(prompt_lens))} must be "
                     f"{cfg.num_requests} integers (R)")
  if not isinstance(prompt_lens, jax.core.Tracer):
    lens = np.asarray(prompt_lens)
    if ((lens < 0) | (lens > plen)).any():
      raise ValueError(f"prompt_lens {lens.tolist()} must be in [0, {plen}] (the "
                       "prompt K/V given)")


def prefill(cfg: TierConfig, state: TieredKVState, k_prompt, v_prompt, prompt_lens):
  """Write prompts into the host tier and warm the hot cache from device KV.

  Args:
    k_prompt, v_prompt: [L, R, P, Hkv, D] the prompts' K/V (device), P <= T.
    prompt_lens: i32[R], each <= P. Positions past a request's length are written
      but never read.

  Returns the state with seq_len = prompt_lens, metadata reset (LRU = slot order).
  Raises ValueError on shapes that do not fit ``cfg`` and, where ``prompt_lens`` is
  concrete, on a length outside [0, P]: a longer one would mark slots resident
  that hold copies of the prompt's last row.
  """
  check_prompt(cfg, k_prompt, v_prompt, prompt_lens)
  prompt_lens = jnp.asarray(prompt_lens)  # (a list passes the check)
  num_layers, num_req, plen = k_prompt.shape[:3]
  shape6 = (num_layers, num_req, plen, cfg.num_units, cfg.heads_per_unit, cfg.head_dim)
  k6 = k_prompt.reshape(shape6).astype(state.host_k.dtype)
  v6 = v_prompt.reshape(shape6).astype(state.host_v.dtype)
  padded = -(-plen // cfg.page_size) * cfg.page_size
  pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, padded - plen), (0, 0), (0, 0)])
  state = write_prompt_pages(cfg, state, jnp.arange(num_req), 0, pad(k_prompt),
                             pad(v_prompt))

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
  return state.replace(hot_k=hot_k, hot_v=hot_v, slot_pos=slot_pos, lru=lru,
                       slot_score=jnp.zeros_like(state.slot_score),
                       seq_len=prompt_lens.astype(jnp.int32))


def check_install(cfg: TierConfig, slot, k, v, length) -> None:
  """``install_request``'s inputs against ``cfg``: K/V [L, T', Hkv, D], a scalar
  integer slot and length; their values too where they are concrete."""
  want = (cfg.num_layers, "T'", cfg.num_kv_heads, cfg.head_dim)
  for name, x in (("k", k), ("v", v)):
    if (np.ndim(x) != 4 or np.shape(x) != np.shape(k)
        or any(w != "T'" and n != w for n, w in zip(np.shape(x), want))):
      raise ValueError(f"{name} {np.shape(x)} must be [L, T', Hkv, D] = {list(want)}, "
                       f"as k {np.shape(k)}")
  for name, x in (("slot", slot), ("length", length)):
    dtype = (x if hasattr(x, "dtype") else np.asarray(x)).dtype
    if np.ndim(x) != 0 or np.dtype(dtype).kind not in "iu":
      raise ValueError(f"{name} {dtype}{list(np.shape(x))} must be one integer")
  if not isinstance(slot, jax.core.Tracer) and not 0 <= int(slot) < cfg.num_requests:
    raise ValueError(f"slot {int(slot)} is outside [0, {cfg.num_requests}) (R)")
  most = min(np.shape(k)[1], cfg.max_len)
  if not isinstance(length, jax.core.Tracer) and not 0 <= int(length) <= most:
    raise ValueError(f"length {int(length)} must be in [0, {most}] (the K/V given, "
                     f"max_len={cfg.max_len})")


def install_request(cfg: TierConfig, state: TieredKVState, slot, k, v, length):
  """Make request slot ``slot`` decode after a prompt of ``length`` positions.

  Its host pages must hold the prompt already (``write_prompt_pages``); ``k``,
  ``v`` [L, T', Hkv, D] are the prompt's K/V on the device (T' >= length), from
  which the hot cache is warmed per ``cfg.warm_start``; the slot's metadata
  restarts (LRU = slot order, scores 0) and ``seq_len[slot] = length``. The
  counters stay cumulative. Raises ValueError on shapes that do not fit ``cfg``
  and, where ``slot`` / ``length`` are concrete, on a slot outside [0, R) or a
  length outside [0, min(T', max_len)]: a longer one would mark slots resident
  that hold copies of the last row given.
  """
  check_install(cfg, slot, k, v, length)
  num_layers, length_all = k.shape[:2]
  pos = warm_positions(cfg, jnp.reshape(length, (1,)))[0]  # [B]
  src = jnp.clip(pos, 0, length_all - 1)
  shape = (num_layers, length_all, cfg.num_units, cfg.heads_per_unit, cfg.head_dim)
  valid = (pos >= 0)[None, None, :, None, None]

  def warm(hot, rows):
    rows = jnp.moveaxis(rows.reshape(shape)[:, src], 2, 1).astype(hot.dtype)  # [L,U,B,..]
    old = hot[:, slot, :, :cfg.hot_slots]
    return hot.at[:, slot, :, :cfg.hot_slots].set(jnp.where(valid, rows, old))

  meta = (num_layers, cfg.num_units, cfg.hot_slots)
  return state.replace(
      hot_k=warm(state.hot_k, k), hot_v=warm(state.hot_v, v),
      slot_pos=state.slot_pos.at[:, slot].set(jnp.broadcast_to(pos, meta)),
      lru=state.lru.at[:, slot].set(
          jnp.broadcast_to(jnp.arange(cfg.hot_slots, dtype=jnp.int32), meta)),
      slot_score=state.slot_score.at[:, slot].set(0.0),
      seq_len=state.seq_len.at[slot].set(length))
