"""Pallas sparse decode attention over hot-cache slots (split-k, online softmax).

Grid ``(R, U * Hg, k_splits)``: one program per (request, KV head, split) gathers
``block_k`` selected rows at a time straight from the whole hot cache (vector-index
loads, like jax's GPU paged_attention), runs an online softmax, and writes a partial
(out, max, sum); the splits are merged by log-sum-exp outside the kernel. The
log-sum-exp is returned so that partial attentions (e.g. hits vs misses) can be
merged exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.sparse_decode_attention.config import BlockSizes

HIGHEST = jax.lax.Precision.HIGHEST
_MIN_DOT = 16  # Triton's tl.dot needs every dimension >= 16.


def _attention_kernel(layer_ref, slot_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref,
                      *, heads_per_unit, group_pad, block_k, blocks_per_split, scale):
  # layer_ref: i32[1]         slot_ref: i32[R, U, k_pad]
  # q_ref: [R, Hkv, G, D] (whole: this program loads its G rows, padded to Gp)
  # k_ref, v_ref: [L, R, U, S, Hg, D] (whole hot cache, never blocked)
  # o_ref: f32[Gp, D]; m_ref, l_ref: f32[Gp] (this split's partials)
  r = pl.program_id(0)
  u = pl.program_id(1) // heads_per_unit
  h = pl.program_id(1) % heads_per_unit
  split = pl.program_id(2)
  layer = layer_ref[0]
  # Rows past G repeat the last query (no padded copy of q, one XLA op fewer); their
  # outputs are dropped. Each output row depends on its own query row only.
  group = q_ref.shape[2]
  q = q_ref[r, pl.program_id(1), jnp.minimum(jnp.arange(group_pad), group - 1), :]
  num_q, head_dim = q.shape  # [Gp, D]
  # Logits: bf16 q and K use tensor cores (exact products, f32 accumulation); an
  # f32 operand makes both f32 with IEEE dots. The weights p stay f32 for p @ V
  # (IEEE, V upcast), as in the reference: rounding p to bf16 for tensor cores
  # moved bf16-KV outputs by ~1e-3, past f32 rounding (a small dot: decode is
  # bound by the row loads).
  qk_dtype = jnp.promote_types(q.dtype, k_ref.dtype)
  precision = HIGHEST if qk_dtype == jnp.float32 else None
  q = q.astype(qk_dtype)

  def body(i, carry):
    o, m, l = carry
    start = (split * blocks_per_split + i) * block_k
    slots = slot_ref[r, u, pl.ds(start, block_k)]  # i32[bk]
    valid = slots >= 0
    idx = jnp.where(valid, slots, 0)
    k = k_ref[layer, r, u, idx, h, :]  # [bk, D]
    v = v_ref[layer, r, u, idx, h, :]
    k = jnp.where(valid[:, None], k, jnp.zeros_like(k))
    v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
    s = jax.lax.dot_general(q, k.astype(qk_dtype), (((1,), (1,)), ((), ())),
                            precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [Gp, bk]
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l = alpha * l + p.sum(axis=1)
    o = alpha[:, None] * o + jax.lax.dot_general(
        p, v.astype(jnp.float32), (((1,), (0,)), ((), ())), precision=HIGHEST,
        preferred_element_type=jnp.float32)
    return o, m_new, l

  init = (jnp.zeros((num_q, head_dim), jnp.float32),
          jnp.full((num_q,), -jnp.inf, jnp.float32),
          jnp.zeros((num_q,), jnp.float32))
  o, m, l = jax.lax.fori_loop(0, blocks_per_split, body, init)
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def sparse_decode_attention(q, k_cache, v_cache, layer, slot, *,
                            block_sizes: BlockSizes | None = None,
                            interpret: bool = False):
  """Same contract as ``sparse_decode_attention_reference``: (out [R, Hq, D], lse)."""
  num_req, num_q_heads, head_dim = q.shape
  _, _, num_units, _, heads_per_unit, _ = k_cache.shape
  num_sel = slot.shape[-1]
  bs = block_sizes or BlockSizes.get_default(num_sel, head_dim, k_cache.dtype.itemsize)
  num_kv = num_units * heads_per_unit
  group = num_q_heads // num_kv
  group_pad = max(_MIN_DOT, common.next_power_of_2(group))

  per_split = common.cdiv(common.cdiv(num_sel, bs.k_splits), bs.block_k)
  k_pad = per_split * bs.block_k * bs.k_splits
  slot = jnp.pad(slot, ((0, 0), (0, 0), (0, k_pad - num_sel)), constant_values=-1)
  qg = q.reshape(num_req, num_kv, group, head_dim)
  layer = jnp.asarray(layer, jnp.int32).reshape((1,))

  kernel = functools.partial(
      _attention_kernel, heads_per_unit=heads_per_unit, group_pad=group_pad,
      block_k=bs.block_k, blocks_per_split=per_split, scale=head_dim ** -0.5)
  whole = pl.no_block_spec  # the whole array: rows are gathered by index in the kernel
  part = lambda *tail: pl.BlockSpec((None, None, None, *tail),
                                    lambda r, g, s: (s, r, g) + (0,) * len(tail))
  o, m, l = pl.pallas_call(
      kernel,
      grid=(num_req, num_kv, bs.k_splits),
      in_specs=[whole] * 5,
      out_specs=[part(group_pad, head_dim), part(group_pad), part(group_pad)],
      out_shape=[
          jax.ShapeDtypeStruct((bs.k_splits, num_req, num_kv, group_pad, head_dim),
                               jnp.float32),
          jax.ShapeDtypeStruct((bs.k_splits, num_req, num_kv, group_pad), jnp.float32),
          jax.ShapeDtypeStruct((bs.k_splits, num_req, num_kv, group_pad), jnp.float32),
      ],
      compiler_params=common.triton_params(bs.num_warps, bs.num_stages),
      interpret=interpret,
      name="sparse_decode_attention",
  )(layer, slot, qg, k_cache, v_cache)

  # Merge the splits by log-sum-exp (flash-decoding).
  m_all = m.max(axis=0)
  m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  w = jnp.exp(m - m_safe)  # [splits, R, Hkv, Gp]
  l_all = (w * l).sum(axis=0)
  o_all = (w[..., None] * o).sum(axis=0)
  out = jnp.where(l_all[..., None] > 0, o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None],
                  0.0)
  lse = jnp.where(l_all > 0, m_safe + jnp.log(jnp.where(l_all > 0, l_all, 1.0)), -jnp.inf)
  out = out[:, :, :group].reshape(num_req, num_q_heads, head_dim).astype(q.dtype)
  return out, lse[:, :, :group].reshape(num_req, num_q_heads)
