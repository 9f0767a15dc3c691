"""Greedy generation and teacher-forced decoding with the dense cache backend.

Small drivers over ``Transformer.prefill`` / ``decode`` and ``cache.DenseKV``:
the reference path the tiered backends are compared against, and what the
correctness tests run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import cache as cache_lib
from models.config import ModelConfig
from models.transformer import Transformer, apply_decode


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("kv",))
def _dense_step(cfg: ModelConfig, weights, tokens, kv: cache_lib.DenseKV):
  # The cache is donated so XLA updates the [L, R, T, Hkv, D] buffers in place
  # instead of copying them every step.
  logits, kv = apply_decode(cfg, weights, tokens, kv.lens, kv,
                            cache_lib.dense_attend)
  return logits, cache_lib.advance(kv)


def dense_step(model: Transformer, tokens: jax.Array,
               kv: cache_lib.DenseKV) -> tuple[jax.Array, cache_lib.DenseKV]:
  """Decodes ``tokens`` i32[R] at positions ``kv.lens`` and advances ``lens``.

  ``kv`` is donated: use only the returned cache afterwards.

  Returns:
    (logits f32[R, V], cache).
  """
  return _dense_step(model.cfg, model.weights(), jnp.asarray(tokens, jnp.int32), kv)


def _check_room(kv: cache_lib.DenseKV, steps: int) -> None:
  # dense_attend cannot raise inside jit, so overflow is refused here, once.
  longest = int(np.max(np.asarray(kv.lens)))
  if longest + steps > kv.max_len:
    raise ValueError(f"{steps} decode steps after {longest} cached positions "
                     f"exceed the cache's max_len={kv.max_len}")


def prefill_dense(model: Transformer, tokens, lens,
                  max_len: int) -> tuple[jax.Array, cache_lib.DenseKV]:
  """Prefill into a dense cache of ``max_len`` positions; returns (logits
  f32[R, V] at lens - 1, cache)."""
  logits, k, v = model.prefill(tokens, lens)
  return logits, cache_lib.dense_from_prefill(k, v, jnp.asarray(lens, jnp.int32),
                                              max_len)


def greedy_generate(model: Transformer, tokens, lens, num_new: int,
                    max_len: int | None = None) -> np.ndarray:
  """Greedy continuation of right-padded prompts via prefill + dense decode.

  Args:
    tokens: i32[R, P] prompts; lens: i32[R] their lengths.
    num_new: tokens to generate per request.
    max_len: cache positions (default: just enough, P + num_new).

  Returns:
    i32[R, num_new] generated tokens (the first comes from prefill's logits).
  """
  tokens = np.asarray(tokens, np.int32)
  if num_new < 1:
    raise ValueError(f"num_new={num_new} must be >= 1")
  max_len = max_len or tokens.shape[1] + num_new
  logits, kv = prefill_dense(model, tokens, lens, max_len)
  _check_room(kv, num_new - 1)
  out = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
  for _ in range(num_new - 1):
    logits, kv = dense_step(model, out[-1], kv)
    out.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
  return np.stack([np.asarray(t) for t in out], axis=1)


def teacher_forced_logits(model: Transformer, kv: cache_lib.DenseKV,
                          next_tokens) -> tuple[np.ndarray, cache_lib.DenseKV]:
  """Decodes given tokens one step at a time (no sampling).

  Args:
    kv: cache after prefill (donated).
    next_tokens: i32[R, S]: the token fed at step s, for every request.

  Returns:
    (logits f32[R, S, V] of every step, the final cache).
  """
  next_tokens = np.asarray(next_tokens, np.int32)
  _check_room(kv, next_tokens.shape[1])
  steps = []
  for s in range(next_tokens.shape[1]):
    logits, kv = dense_step(model, next_tokens[:, s], kv)
    steps.append(np.asarray(logits))
  return np.stack(steps, axis=1), kv
