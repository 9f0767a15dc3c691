"""Pure-jnp sparse decode attention: the reference and the XLA fallback.

One query token per request attends (GQA) over the ``k`` rows a selection names.
Every path in the project (hot-cache XLA, full-KV sparse reference, the Pallas kernel's
tests) funnels through ``attend_rows`` so that "tiered == full-KV sparse" is an
equality of identical float operations on identical rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def attend_rows(q, k_rows, v_rows, valid, *, scale: float | None = None):
  """Softmax attention over gathered rows.

  Args:
    q: [R, U, Hg, G, D] query heads, grouped by unit and KV head.
    k_rows, v_rows: [R, U, k, Hg, D] the selected rows.
    valid: bool[R, U, k]; invalid rows (padding) get zero weight and are never
      multiplied in (a NaN in them cannot leak).
    scale: logit scale, default 1/sqrt(D).

  Returns:
    out: [R, U, Hg, G, D] in q.dtype; lse: f32[R, U, Hg, G] (log-sum-exp of the
    scaled logits, -inf where no row is valid; out is 0 there).
  """
  head_dim = q.shape[-1]
  scale = head_dim ** -0.5 if scale is None else scale
  mask = valid[:, :, None, None, :]  # [R, U, 1, 1, k]
  k32 = jnp.where(valid[..., None, None], k_rows.astype(jnp.float32), 0.0)
  v32 = jnp.where(valid[..., None, None], v_rows.astype(jnp.float32), 0.0)
  logits = jnp.einsum("ruhgd,rukhd->ruhgk", q.astype(jnp.float32), k32,
                      precision=HIGHEST) * scale
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(logits - m_safe[..., None])
  l = jnp.sum(p, axis=-1)
  out = jnp.einsum("ruhgk,rukhd->ruhgd", p, v32, precision=HIGHEST)
  out = jnp.where(l[..., None] > 0, out / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return out.astype(q.dtype), lse


def merge_partials(out_a, lse_a, out_b, lse_b):
  """Exact softmax attention over the union of two disjoint row sets, from each
  set's normalised output and log-sum-exp (flash-decoding's merge).

  Shapes: out [..., D], lse [...]; a set with no rows has lse = -inf.
  """
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.exp(lse_a - safe)[..., None]
  w_b = jnp.exp(lse_b - safe)[..., None]
  out = w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)
  return out.astype(out_a.dtype), lse


def group_queries(q, num_units: int, heads_per_unit: int):
  """[R, Hq, D] -> [R, U, Hg, G, D] (query head h uses KV head h // G)."""
  r, hq, d = q.shape
  return q.reshape(r, num_units, heads_per_unit, hq // (num_units * heads_per_unit), d)


def sparse_decode_attention_reference(q, k_cache, v_cache, layer, slot):
  """Attention of one token per request over the slots ``slot`` names.

  Args:
    q: [R, Hq, D].
    k_cache, v_cache: [L, R, U, S, Hg, D] (the hot cache, S = B + 1).
    layer: i32[] layer index.
    slot: i32[R, U, k], -1 = padding.

  Returns:
    out [R, Hq, D] (q.dtype), lse f32[R, Hq].
  """
  _, _, num_units, _, heads_per_unit, _ = k_cache.shape
  k_rows, v_rows, valid = gather_slots(k_cache, v_cache, layer, slot)
  out, lse = attend_rows(group_queries(q, num_units, heads_per_unit), k_rows, v_rows,
                         valid)
  return out.reshape(q.shape), lse.reshape(q.shape[:2])


def gather_slots(k_cache, v_cache, layer, slot):
  """The rows [R, U, k, Hg, D] of ``k_cache`` / ``v_cache`` [L, R, U, S, Hg, D] that
  ``slot`` i32[R, U, k] names at ``layer``, and valid bool[R, U, k] (padding -1
  reads slot 0, masked)."""
  num_req, num_units = k_cache.shape[1:3]
  valid = slot >= 0
  idx = jnp.where(valid, slot, 0)
  r = jnp.arange(num_req)[:, None, None]
  u = jnp.arange(num_units)[None, :, None]
  return k_cache[layer, r, u, idx], v_cache[layer, r, u, idx], valid
