"""Sparse attention over a full KV cache on device: the exactness reference and the
speed baseline of the tiered decode step (same selector, same float operations)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvtier_jax import attention
from kvtier_jax.config import TierConfig
from kvtier_jax.selectors.base import StepInputs


class FullKVState(NamedTuple):
  k: jax.Array  # [L, R, T, U, Hg, D] on device
  v: jax.Array
  seq_len: jax.Array  # i32[R]


def init_full_kv(cfg: TierConfig, k_prompt, v_prompt, prompt_lens, *, fill=0.0):
  shape = (cfg.num_layers, cfg.num_requests, cfg.max_len, cfg.num_units,
           cfg.heads_per_unit, cfg.head_dim)
  k = jnp.full(shape, fill, cfg.dtype)
  v = jnp.full(shape, fill, cfg.dtype)
  plen = k_prompt.shape[2]
  k = k.at[:, :, :plen].set(k_prompt.reshape(shape[:2] + (plen,) + shape[3:]))
  v = v.at[:, :, :plen].set(v_prompt.reshape(shape[:2] + (plen,) + shape[3:]))
  return FullKVState(k, v, jnp.array(prompt_lens, dtype=jnp.int32))  # a copy: donated


def full_kv_decode_step(cfg: TierConfig, selector, state: FullKVState, q, k_new, v_new,
                        sel: Any = None):
  """``decode.decode_step``'s contract with every position resident on device.

  ``sel``: the selector's state (for ``GivenSelector``, the step's selections
  i32[L, R, U, k]). Returns (out [L, R, Hq, D], state).
  """
  num_req = cfg.num_requests
  r = jnp.arange(num_req)
  shape = (num_req, cfg.num_units, cfg.heads_per_unit, cfg.head_dim)

  def body(carry, xs):
    k_all, v_all, sel = carry
    layer, q_l, k_l, v_l = xs
    k_all = k_all.at[layer, r, state.seq_len].set(k_l.reshape(shape).astype(k_all.dtype))
    v_all = v_all.at[layer, r, state.seq_len].set(v_l.reshape(shape).astype(v_all.dtype))
    picked, sel = selector.select(sel, layer, StepInputs(None, q_l, k_l, state.seq_len,
                                                          layer))
    out, _ = attention.full_kv_attention(q_l, k_all, v_all, layer,
                                         picked[..., :cfg.top_k])
    return (k_all, v_all, sel), out

  layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
  (k_all, v_all, _), out = jax.lax.scan(body, (state.k, state.v, sel),
                                        (layers, q, k_new, v_new))
  return out, FullKVState(k_all, v_all, state.seq_len + 1)
