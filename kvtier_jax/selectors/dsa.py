"""DSA's lightning indexer: learned token-level top-k (DeepSeek-V3.2's ``Indexer``).

Per layer, a few cheap index heads score every earlier position:

  q^I_j = rope((x @ wq)_j)               j = 1..H_I index heads, [d_I] each
  k^I_s = rope(LayerNorm(x_s @ wk))      one key per position (MQA-style)
  w_j   = (x @ ww)_j * H_I**-0.5 * d_I**-0.5
  I_s   = sum_j w_j * relu(q^I_j . k^I_s)

and the ``top_k`` positions ``s <= newest`` by ``I_s`` are attended by every head
(one selection per request and layer, U = 1). RoPE is the rotate-half form on the
first ``rope_dim`` features of each index query and key.

Simplifications against DeepSeek-V3.2: the index query is projected from the
layer's normalised hidden state ``x`` (V3.2 uses the MLA query latent), there is
no Hadamard rotation, and keys stay float32 (V3.2 FP8-quantises them with a
per-token scale): exact index arithmetic for a study of the cache, at 4 bytes per
feature of resident state instead of about 1. The defaults (4 heads x 64) are
small because the indexer is distilled onto a 135M dense model, not read from a
checkpoint.

The pure functions ``index_query``, ``index_keys`` and ``index_scores`` are what a
distillation loop (KL to the dense model's attention) trains through.

Extra shape letters: ``Dm`` model width, ``H_I`` index heads, ``d_I`` index dim,
``Q`` / ``S`` query / key positions of a scoring call.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvtier_jax.batch_invariance import in_row_tiles
from kvtier_jax.selectors.base import PrefillInputs, StepInputs, masked_top_k

_PRECISION = jax.lax.Precision.HIGHEST  # f32 scores on GPU too (no TF32)


@struct.dataclass
class IndexerParams:
  """Lightning-indexer weights. Arrays carry a leading ``[L]`` axis when stacked
  for all layers (``init_indexer_params``) and none for one layer's slice
  (``selectors.base.layer_slice``), which is what the scoring functions take.
  The RoPE and LayerNorm constants are static (not trained, not traced)."""

  wq: jax.Array  # [L, Dm, H_I * d_I]
  wk: jax.Array  # [L, Dm, d_I]
  k_norm_scale: jax.Array  # [L, d_I]
  k_norm_bias: jax.Array  # [L, d_I]
  ww: jax.Array  # [L, Dm, H_I]
  rope_dim: int = struct.field(pytree_node=False, default=32)
  rope_theta: float = struct.field(pytree_node=False, default=10000.0)
  norm_eps: float = struct.field(pytree_node=False, default=1e-6)

  @property
  def num_index_heads(self) -> int:  # H_I
    return self.ww.shape[-1]

  @property
  def index_dim(self) -> int:  # d_I
    return self.wk.shape[-1]


def init_indexer_params(key, num_layers: int, model_dim: int, num_index_heads: int = 4,
                        index_dim: int = 64, rope_dim: int = 32,
                        rope_theta: float = 10000.0) -> IndexerParams:
  """Random indexer weights for ``num_layers`` layers (LeCun-normal projections,
  identity LayerNorm), the starting point of a distillation.

  Pass the host model's ``rope_theta`` so index keys rotate like its keys.
  """
  for name, value in (("num_layers", num_layers), ("model_dim", model_dim),
                      ("num_index_heads", num_index_heads), ("index_dim", index_dim)):
    if value < 1:
      raise ValueError(f"{name}={value} must be >= 1")
  if rope_dim < 0 or rope_dim % 2 or rope_dim > index_dim:
    raise ValueError(f"rope_dim={rope_dim} must be even and in 0..index_dim={index_dim}")
  if rope_theta <= 0:
    raise ValueError(f"rope_theta={rope_theta} must be positive")
  key_q, key_k, key_w = jax.random.split(key, 3)
  scale = model_dim ** -0.5
  normal = lambda k, *shape: scale * jax.random.normal(k, (num_layers, model_dim) + shape,
                                                       jnp.float32)
  return IndexerParams(
      wq=normal(key_q, num_index_heads * index_dim),
      wk=normal(key_k, index_dim),
      k_norm_scale=jnp.ones((num_layers, index_dim), jnp.float32),
      k_norm_bias=jnp.zeros((num_layers, index_dim), jnp.float32),
      ww=normal(key_w, num_index_heads),
      rope_dim=rope_dim, rope_theta=float(rope_theta))


def rope_leading(x, positions, rope_dim: int, theta: float):
  """Rotate-half RoPE on the first ``rope_dim`` features; the rest pass through.

  Args:
    x: [*positions.shape, *heads, d] (any number of head axes).
    positions: i32[...].
  """
  if rope_dim == 0:
    return x
  half = rope_dim // 2
  exponents = np.arange(half, dtype=np.float32) * 2 / rope_dim
  inv_freq = (1.0 / np.float32(theta) ** exponents).astype(np.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., half]
  head_axes = (1,) * (x.ndim - positions.ndim - 1)
  angles = angles.reshape(positions.shape + head_axes + (half,))
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = x[..., :half], x[..., half:rope_dim]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rope_dim:]],
                         axis=-1)


def _check_layer_params(params: IndexerParams) -> None:
  if not isinstance(params, IndexerParams):
    raise ValueError(f"expected IndexerParams, got {type(params).__name__}")
  if params.wk.ndim != 2:
    raise ValueError(f"indexer params must be one layer's (wk [Dm, d_I]); got wk "
                     f"{params.wk.shape}: slice them with selectors.base.layer_slice")


def index_query(params: IndexerParams, x, positions):
  """Index queries and head weights of tokens at ``positions``.

  Args:
    params: one layer's indexer weights.
    x: [..., Dm] normalised hidden states.
    positions: i32[...] their positions (RoPE).

  Returns:
    (q f32[..., H_I, d_I], w f32[..., H_I]).
  """
  _check_layer_params(params)
  num_heads, dim = params.num_index_heads, params.index_dim
  x = x.astype(jnp.float32)
  q = jnp.matmul(x, params.wq, precision=_PRECISION)
  q = rope_leading(q.reshape(x.shape[:-1] + (num_heads, dim)), positions,
                   params.rope_dim, params.rope_theta)
  w = jnp.matmul(x, params.ww, precision=_PRECISION) * (num_heads ** -0.5 * dim ** -0.5)
  return q, w


def index_keys(params: IndexerParams, x, positions):
  """Index keys f32[..., d_I] of tokens ``x`` [..., Dm] at ``positions`` i32[...]."""
  _check_layer_params(params)
  k = jnp.matmul(x.astype(jnp.float32), params.wk, precision=_PRECISION)
  mean = k.mean(-1, keepdims=True)
  var = jnp.square(k - mean).mean(-1, keepdims=True)
  k = (k - mean) * jax.lax.rsqrt(var + params.norm_eps)
  k = k * params.k_norm_scale + params.k_norm_bias
  return rope_leading(k, positions, params.rope_dim, params.rope_theta)


def index_scores(params: IndexerParams, x, query_positions, keys, key_mask):
  """Lightning-indexer scores ``I_s`` of each query token over cached index keys.

  Args:
    params: one layer's indexer weights.
    x: [R, Q, Dm] the query tokens' normalised hidden states.
    query_positions: i32[R, Q].
    keys: [R, S, d_I] index keys (``index_keys``).
    key_mask: bool[R, Q, S] which keys each query may score (causality).

  Returns:
    f32[R, Q, S]; masked entries are -inf (a softmax over S gives the indexer's
    distribution for a KL distillation loss).
  """
  q, w = index_query(params, x, query_positions)  # [R, Q, H_I, d_I], [R, Q, H_I]
  logits = jnp.einsum("rqjd,rsd->rqjs", q, keys.astype(jnp.float32),
                      precision=_PRECISION)
  scores = jnp.einsum("rqj,rqjs->rqs", w, jax.nn.relu(logits), precision=_PRECISION)
  return jnp.where(key_mask, scores, -jnp.inf)


class DSAState(NamedTuple):
  keys: jax.Array  # f32[L, R, T, d_I] index keys; zero where nothing was written


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSASelector:
  """Top-k positions by the lightning indexer, shared by all heads (U = 1).

  Attributes:
    top_k: k, positions per step (DeepSeek-V3.2: 2048). While the context is
      shorter, every position is returned and the row is padded with -1.
    index_dim: d_I of the indexer whose params ``select``/``prefill`` receive.
    row_tile: score over tiles of this many requests (``batch_invariance``: a
      request's selection the same bits whatever the batch; the model's
      ``decode_row_tile``). None: over the whole batch.
  """

  top_k: int = 2048
  index_dim: int = 64
  row_tile: int | None = None

  num_units = 1  # U
  reads_hidden = True  # the indexer keys come from the hidden inputs

  def __post_init__(self):
    for name in ("top_k", "index_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

  def _check_params(self, params) -> None:
    if params is None:
      raise ValueError("DSASelector needs this layer's IndexerParams")
    _check_layer_params(params)
    if params.index_dim != self.index_dim:
      raise ValueError(f"indexer params have index_dim={params.index_dim}, the "
                       f"selector index_dim={self.index_dim}")

  def init_state(self, num_layers: int, num_requests: int, max_len: int) -> DSAState:
    if self.top_k > max_len:
      raise ValueError(f"top_k={self.top_k} exceeds max_len={max_len}")
    return DSAState(jnp.zeros((num_layers, num_requests, max_len, self.index_dim),
                              jnp.float32))

  def prefill(self, state: DSAState, layer, inputs: PrefillInputs,
              params: IndexerParams | None = None) -> DSAState:
    """Writes the prompt's index keys (``inputs.x``); the rest of the row is zeroed."""
    self._check_params(params)
    self._check_hidden(inputs.x)
    num_req, plen = inputs.x.shape[:2]
    max_len = state.keys.shape[2]
    if inputs.x.ndim != 3 or inputs.lens.shape != (num_req,):
      raise ValueError(f"prompt x {inputs.x.shape} / lens {inputs.lens.shape} must be "
                       "(R, P, Dm) / (R,)")
    if num_req != state.keys.shape[1]:
      raise ValueError(f"prompts for {num_req} requests; the state holds "
                       f"{state.keys.shape[1]}")
    if plen > max_len:
      raise ValueError(f"prompt length {plen} exceeds the state's max_len={max_len}")
    positions = jnp.broadcast_to(jnp.arange(plen, dtype=jnp.int32), (num_req, plen))
    keys = index_keys(params, inputs.x, positions)  # [R, P, d_I]
    keys = jnp.where((positions < inputs.lens[:, None])[..., None], keys, 0.0)
    row = jax.lax.dynamic_update_slice(jnp.zeros(state.keys.shape[1:], jnp.float32),
                                       keys, (0, 0, 0))
    return DSAState(state.keys.at[layer].set(row))

  def tiled_scores(self, params: IndexerParams, x, newest, keys):
    """(scores f32[R, T] of the newest tokens x [R, Dm] over one layer's index keys
    [R, T, d_I], causal bool[R, T]) over tiles of ``row_tile`` requests."""
    causal = jnp.arange(keys.shape[1]) <= newest[:, None]  # [R, T]
    scores = in_row_tiles(
        self.row_tile, lambda x, p, k, c: index_scores(params, x[:, None], p[:, None], k,
                                                       c[:, None])[:, 0],
        x, newest, keys, causal)
    return scores, causal

  def select(self, state: DSAState, layer, inputs: StepInputs,
             params: IndexerParams | None = None):
    """Writes the newest token's index key, then picks the top-k positions.

    Returns (positions i32[R, 1, top_k] best first, -1 padded; state). The newest
    position competes like any other (it is not forced in).
    """
    self._check_params(params)
    self._check_hidden(inputs.x)
    newest = inputs.newest.astype(jnp.int32)
    num_req = newest.shape[0]
    if inputs.x.shape[:1] != (num_req,) or inputs.x.ndim != 2:
      raise ValueError(f"x has shape {inputs.x.shape}, expected (R={num_req}, Dm)")
    keys = state.keys.at[layer, jnp.arange(num_req), newest].set(in_row_tiles(
        self.row_tile, lambda x, p: index_keys(params, x, p), inputs.x, newest))
    scores, causal = self.tiled_scores(params, inputs.x, newest, keys[layer])  # [R, T]
    positions = masked_top_k(scores, causal, self.top_k)  # [R, k]
    return positions[:, None, :], DSAState(keys)

  @staticmethod
  def _check_hidden(x) -> None:
    if x is None:
      raise ValueError("DSASelector reads the layer's hidden inputs x (reads_hidden): "
                       "pass them in StepInputs / PrefillInputs")

  def state_capacity(self, state: DSAState) -> int:
    return state.keys.shape[2]

  def ranks_best_first(self, top_k: int) -> bool:
    return True  # masked_top_k: the top-m's first k are the top-k

  def state_bytes_per_token(self) -> int:
    """One f32 index key per position (FP8 + scale would be d_I + 4 bytes)."""
    return 4 * self.index_dim
