"""Exact sparse decode attention over the hot cache, and over a full KV (reference).

Both gather the selected rows in selection order and run the same float operations
(``attend_rows``), so tiered attention equals full-KV sparse attention to the bit
with the XLA path, and to f32 rounding with the Pallas kernel.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvtier_jax.batch_invariance import in_row_tiles
from kvtier_jax.config import TierConfig
from pallas_kernels import common
from pallas_kernels.sparse_decode_attention import (
    attend_rows, gather_slots, group_queries, sparse_decode_attention,
    sparse_decode_attention_reference)


def hot_attention(cfg: TierConfig, q, hot_k, hot_v, layer, slot):
  """Attention of q [R, Hq, D] over hot[layer] slots ``slot`` i32[R, U, k].

  Returns (out [R, Hq, D], lse f32[R, Hq]).
  """
  if common.use_kernel(cfg.impl.attention, "attention"):  # a program per request
    return sparse_decode_attention(q, hot_k, hot_v, layer, slot,
                                   interpret=cfg.use_interpret)
  if cfg.row_tile is None:
    return sparse_decode_attention_reference(q, hot_k, hot_v, layer, slot)
  return rows_attention(q, *gather_slots(hot_k, hot_v, layer, slot), cfg.row_tile)


def rows_attention(q, k_rows, v_rows, valid, row_tile: int | None = None):
  """Attention of q [R, Hq, D] over given rows [R, U, k, Hg, D] (valid bool[R, U, k]);
  ``row_tile``: over tiles of that many requests (``TierConfig.row_tile``).

  Returns (out [R, Hq, D], lse f32[R, Hq]).
  """
  num_units, heads_per_unit = k_rows.shape[1], k_rows.shape[3]

  def attend(q, k_rows, v_rows, valid):
    out, lse = attend_rows(group_queries(q, num_units, heads_per_unit), k_rows, v_rows,
                           valid)
    return out.reshape(q.shape), lse.reshape(q.shape[:2])

  return in_row_tiles(row_tile, attend, q, k_rows, v_rows, valid)


def full_kv_attention(q, full_k, full_v, layer, positions, row_tile: int | None = None):
  """Sparse attention over a full KV cache: the exactness reference.

  Args:
    q: [R, Hq, D].
    full_k, full_v: [L, R, T, U, Hg, D] every position of every request.
    layer: i32[].
    positions: i32[R, U, k] selected positions, -1 = padding.
    row_tile: attend over tiles of that many requests (``TierConfig.row_tile``).

  Returns:
    (out [R, Hq, D], lse f32[R, Hq]).
  """
  num_req, num_units = full_k.shape[1], full_k.shape[3]
  valid = positions >= 0
  pos = jnp.where(valid, positions, 0)
  r = jnp.arange(num_req)[:, None, None]
  u = jnp.arange(num_units)[None, :, None]
  k_rows = full_k[layer, r, pos, u]  # [R, U, k, Hg, D]
  v_rows = full_v[layer, r, pos, u]
  return rows_attention(q, k_rows, v_rows, valid, row_tile)
