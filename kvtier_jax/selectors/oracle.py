"""The oracle selector: the true top-k positions by attention probability.

For analysis only (upper bounds on selection quality, reference traces for cache
policies): it keeps its own copy of every key, ``Hkv * D * 4`` bytes per token,
as much as the K half of the KV it is meant to offload.

Score of position s for a unit: ``sum_h softmax_s(q_h . k_s / sqrt(D))`` over the
unit's query heads h, the attention mass the unit's heads put on s, with s ranging
over ``0..newest``. Granularity "layer" sums all Hq heads (U = 1), "kv_head" the G
heads of each KV head (U = Hkv).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvtier_jax.batch_invariance import in_row_tiles
from kvtier_jax.selectors.base import (PrefillInputs, StepInputs, check_prefill_shapes,
                                       check_step_shapes, masked_top_k)
from kvtier_jax.selectors.quest import GRANULARITIES

_PRECISION = jax.lax.Precision.HIGHEST


class OracleState(NamedTuple):
  keys: jax.Array  # f32[L, R, T, Hkv, D]; zero where nothing was written


@dataclasses.dataclass(frozen=True, kw_only=True)
class OracleSelector:
  """True top-k by attention probability (see the module docstring).

  Attributes:
    top_k: k positions per unit and step; shorter contexts are -1 padded.
    num_kv_heads / q_per_kv / head_dim: Hkv, G, D (the key copy needs them).
    granularity: "layer" (U = 1) or "kv_head" (U = Hkv).
    row_tile: score over tiles of this many requests (``batch_invariance``: a
      request's selection the same bits whatever the batch; the model's
      ``decode_row_tile``). None: over the whole batch.
  """

  top_k: int
  num_kv_heads: int
  q_per_kv: int
  head_dim: int
  granularity: str = "layer"
  row_tile: int | None = None

  def __post_init__(self):
    for name in ("top_k", "num_kv_heads", "q_per_kv", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"granularity={self.granularity!r} must be one of {GRANULARITIES}")

  @property
  def num_units(self) -> int:  # U
    return self.num_kv_heads if self.granularity == "kv_head" else 1

  def init_state(self, num_layers: int, num_requests: int, max_len: int) -> OracleState:
    if self.top_k > max_len:
      raise ValueError(f"top_k={self.top_k} exceeds max_len={max_len}")
    return OracleState(jnp.zeros((num_layers, num_requests, max_len, self.num_kv_heads,
                                  self.head_dim), jnp.float32))

  def prefill(self, state: OracleState, layer, inputs: PrefillInputs,
              params=None) -> OracleState:
    """Copies the prompt keys (zero at positions >= lens and past the prompt)."""
    del params
    check_prefill_shapes(inputs, self.num_kv_heads, self.head_dim, state.keys.shape[2],
                         state.keys.shape[1])
    plen = inputs.k.shape[1]
    valid = (jnp.arange(plen) < inputs.lens[:, None])[..., None, None]
    keys = jnp.where(valid, inputs.k.astype(jnp.float32), 0.0)
    row = jax.lax.dynamic_update_slice(jnp.zeros(state.keys.shape[1:], jnp.float32),
                                       keys, (0,) * 4)
    return OracleState(state.keys.at[layer].set(row))

  def attention_scores(self, keys, q, newest):
    """Per-unit attention mass f32[R, U, T] and causal mask bool[R, T]."""
    num_req, max_len = keys.shape[:2]
    qg = q.astype(jnp.float32).reshape(num_req, self.num_kv_heads, self.q_per_kv,
                                       self.head_dim)
    logits = jnp.einsum("rhgd,rthd->rhgt", qg, keys,
                        precision=_PRECISION) / math.sqrt(self.head_dim)
    causal = jnp.arange(max_len) <= newest[:, None]  # [R, T]
    probs = jax.nn.softmax(jnp.where(causal[:, None, None], logits, -jnp.inf), axis=-1)
    scores = probs.sum(2)  # [R, Hkv, T]
    if self.granularity == "layer":
      scores = scores.sum(1, keepdims=True)
    return scores, causal

  def tiled_scores(self, keys, q, newest):
    """``attention_scores`` over tiles of ``row_tile`` requests."""
    return in_row_tiles(self.row_tile, self.attention_scores, keys, q, newest)

  def select(self, state: OracleState, layer, inputs: StepInputs, params=None):
    """Stores ``k_new``, then returns (positions i32[R, U, top_k] best first, -1
    padded; state)."""
    del params
    check_step_shapes(inputs, self.num_kv_heads, self.q_per_kv, self.head_dim)
    newest = inputs.newest.astype(jnp.int32)
    keys = state.keys.at[layer, jnp.arange(newest.shape[0]), newest].set(
        inputs.k_new.astype(jnp.float32))
    scores, causal = self.tiled_scores(keys[layer], inputs.q, newest)
    return masked_top_k(scores, causal[:, None], self.top_k), OracleState(keys)

  def state_capacity(self, state: OracleState) -> int:
    return state.keys.shape[2]

  def ranks_best_first(self, top_k: int) -> bool:
    return True  # masked_top_k: the top-m's first k are the top-k

  def state_bytes_per_token(self) -> int:
    """A full f32 copy of the keys."""
    return 4 * self.num_kv_heads * self.head_dim
