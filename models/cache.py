"""The ``dense`` cache backend: every position's K/V on device, attended in full.

It is the exactness reference for the tiered backends (kvtier_jax): same model,
same ``Transformer.decode`` call, only the ``attend`` function and its carry
differ. A step is:

  logits, cache = model.decode(tokens, cache.lens, dense_attend, cache)
  cache = advance(cache)

``dense_attend`` writes the new token's K/V at position ``lens`` and attends
over positions ``0..lens`` inclusive; ``lens`` moves only in ``advance``, after
all layers ran, because every layer must write at the same position.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.transformer import decode_attention


@flax.struct.dataclass
class DenseKV:
  """Full KV cache of R requests with room for T positions each."""

  k: jax.Array  # [L, R, T, Hkv, D] post-RoPE keys
  v: jax.Array  # [L, R, T, Hkv, D]
  lens: jax.Array  # i32[R] positions filled (= position of the next token)

  @property
  def max_len(self) -> int:  # T
    return self.k.shape[2]


def init_dense(cfg: ModelConfig, num_requests: int, max_len: int) -> DenseKV:
  """An empty cache: zeros, ``lens = 0``."""
  shape = (cfg.num_layers, num_requests, max_len, cfg.num_kv_heads, cfg.head_dim)
  # Two separate buffers: the decode step donates both, and one buffer cannot
  # be donated twice.
  dtype = jnp.dtype(cfg.dtype)
  return DenseKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 lens=jnp.zeros((num_requests,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("max_len",))
def dense_from_prefill(k: jax.Array, v: jax.Array, lens: jax.Array,
                       max_len: int) -> DenseKV:
  """A cache holding ``Transformer.prefill``'s K/V.

  Args:
    k, v: [L, R, P, Hkv, D] with P <= max_len.
    lens: i32[R] valid prompt lengths; positions >= lens (prompt padding) are
      zeroed so the cache content does not depend on the padding tokens.
    max_len: T, positions per request.
  """
  length = k.shape[2]
  if length > max_len:
    raise ValueError(f"prefill length {length} exceeds max_len {max_len}")
  valid = jnp.arange(length)[None, :] < lens[:, None]  # [R, P]
  valid = valid[None, :, :, None, None]

  def place(x):
    x = jnp.where(valid, x, 0)
    return jnp.pad(x, [(0, 0), (0, 0), (0, max_len - length), (0, 0), (0, 0)])

  return DenseKV(k=place(k), v=place(v), lens=lens.astype(jnp.int32))


def dense_attend(layer: jax.Array, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                 cache: DenseKV, x: jax.Array | None = None) -> tuple[jax.Array, DenseKV]:
  """The ``attend`` of ``Transformer.decode`` for the dense backend.

  Writes ``k_new``/``v_new`` at position ``cache.lens`` of ``layer`` and attends
  causally over positions ``0..lens`` (the new one included).

  The caller must keep ``lens < T``: a write past the end is dropped by the
  scatter (no error inside jit), and the step would silently miss its own token.
  Every step reads all T rows (masked), so its cost follows T, not ``lens``:
  size T to the longest request (8K context: ~100 ms/step on 2 CPU cores).

  Args:
    layer: i32[] layer index.
    q: [R, Hq, D] post-RoPE queries; k_new, v_new: [R, Hkv, D].
    cache: the whole cache (all layers).
    x: the layer's normalised input (unused: dense attention selects nothing).

  Returns:
    (out [R, Hq, D], cache with the new K/V written; lens unchanged).
  """
  del x
  k, v = write_newest(cache, layer, k_new, v_new)
  k_layer = jax.lax.dynamic_index_in_dim(k, layer, keepdims=False)  # [R, T, Hkv, D]
  v_layer = jax.lax.dynamic_index_in_dim(v, layer, keepdims=False)
  visible = jnp.arange(k.shape[2])[None, :] <= cache.lens[:, None]  # [R, T]
  out = decode_attention(q, k_layer, v_layer, visible)
  return out, cache.replace(k=k, v=v)


def write_newest(cache: DenseKV, layer, k_new, v_new):
  """The cache's k, v with the new token's K/V written at position ``lens``."""
  requests = jnp.arange(k_new.shape[0])
  k = cache.k.at[layer, requests, cache.lens].set(k_new.astype(cache.k.dtype))
  v = cache.v.at[layer, requests, cache.lens].set(v_new.astype(cache.v.dtype))
  return k, v


def advance(cache: DenseKV, num: int | jax.Array = 1) -> DenseKV:
  """``lens += num`` after a decode step (``num`` may be i32[R], e.g. 0 for
  requests that did not step)."""
  return cache.replace(lens=cache.lens + jnp.asarray(num, jnp.int32))
