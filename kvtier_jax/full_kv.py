"""Sparse attention over a full KV cache on device: the exactness reference and the
speed baseline of the tiered decode step (same selector, same float operations)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvtier_jax import attention, layer_scan
from kvtier_jax.config import TierConfig
from kvtier_jax.selectors.base import (StepInputs, check_picked, check_state_capacity,
                                       check_state_layout)
from kvtier_jax.state import committed


class FullKVState(NamedTuple):
  k: jax.Array  # [L, R, T, U, Hg, D] on device
  v: jax.Array
  seq_len: jax.Array  # i32[R]


def init_full_kv(cfg: TierConfig, k_prompt, v_prompt, prompt_lens, *, fill=0.0):
  """The full cache after prompts k/v_prompt [L, R, P, Hkv, D] of ``prompt_lens``
  i32[R] positions each (checked, as ``TieredDecoder.prefill`` checks them).
  Committed to its device, as the state a jitted step returns is: else the step's
  second call compiles it again."""
  shape = (cfg.num_layers, cfg.num_requests, cfg.max_len, cfg.num_units,
           cfg.heads_per_unit, cfg.head_dim)
  plen = k_prompt.shape[2]
  want = (cfg.num_layers, cfg.num_requests, plen, cfg.num_kv_heads, cfg.head_dim)
  if k_prompt.shape != want or v_prompt.shape != want:
    raise ValueError(f"prompt K/V have shapes {k_prompt.shape} / {v_prompt.shape}, "
                     f"expected {want} (L, R, P, Hkv, D)")
  if plen > cfg.max_len:
    raise ValueError(f"a {plen}-position prompt exceeds max_len={cfg.max_len}")
  if not isinstance(prompt_lens, jax.core.Tracer):
    lens = np.asarray(prompt_lens)
    if lens.shape != (cfg.num_requests,) or (lens < 0).any() or (lens > plen).any():
      raise ValueError(f"prompt_lens {lens.tolist()} must be {cfg.num_requests} lengths "
                       f"in [0, {plen}] (the prompt's positions)")
  k = jnp.full(shape, fill, cfg.dtype)
  v = jnp.full(shape, fill, cfg.dtype)
  k = k.at[:, :, :plen].set(k_prompt.reshape(shape[:2] + (plen,) + shape[3:]))
  v = v.at[:, :, :plen].set(v_prompt.reshape(shape[:2] + (plen,) + shape[3:]))
  # jnp.array: a copy of prompt_lens (the state is donated)
  return committed(FullKVState(k, v, jnp.array(prompt_lens, dtype=jnp.int32)))


def full_kv_decode_step(cfg: TierConfig, selector, state: FullKVState, q, k_new, v_new,
                        sel: Any = None):
  """``decode.decode_step``'s contract with every position resident on device.

  ``sel``: the selector's state (for ``GivenSelector``, the step's selections
  i32[L, R, U, k]). Returns (out [L, R, Hq, D], state). Shapes are checked at
  trace time; traced values are not: this reference assumes seq_len < max_len and
  valid selections (the tiered step refuses others, with its status word).
  """
  num_req = cfg.num_requests
  cfg.check_step_inputs(q, k_new, v_new)
  check_state_capacity(selector, sel, cfg.max_len)
  check_state_layout(sel, None, cfg.num_layers, num_req)
  r = jnp.arange(num_req)
  shape = (num_req, cfg.num_units, cfg.heads_per_unit, cfg.head_dim)

  def body(carry, xs):
    k_all, v_all, sel = carry
    layer, q_l, k_l, v_l = xs
    k_all = k_all.at[layer, r, state.seq_len].set(k_l.reshape(shape).astype(k_all.dtype))
    v_all = v_all.at[layer, r, state.seq_len].set(v_l.reshape(shape).astype(v_all.dtype))
    picked, sel = selector.select(sel, layer, StepInputs(None, q_l, k_l, state.seq_len,
                                                          layer))
    check_picked(picked)
    if picked.shape[:2] != (num_req, cfg.num_units) or picked.shape[2] < cfg.top_k:
      raise ValueError(f"the selector picked {picked.shape} positions, expected "
                       f"({num_req}, {cfg.num_units}, >= {cfg.top_k}) (R, U, k)")
    out, _ = attention.full_kv_attention(q_l, k_all, v_all, layer,
                                         picked[..., :cfg.top_k], cfg.row_tile)
    return (k_all, v_all, sel), out

  layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
  (k_all, v_all, _), out = layer_scan.scan_layers(body, (state.k, state.v, sel),
                                                  (layers, q, k_new, v_new))
  return out, FullKVState(k_all, v_all, state.seq_len + 1)
