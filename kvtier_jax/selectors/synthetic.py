"""Synthetic selectors with no model behind them (tests, benchmarks)."""

from __future__ import annotations

import math

import jax.numpy as jnp


def given_selection(q, ctx):
  """Returns the precomputed positions passed as ``ctx.aux`` (i32[R, U, k])."""
  del q
  return ctx.aux


def churn_selector(prompt_len: int, top_k: int, num_units: int, churn: float,
                   include_newest: bool = True):
  """A selection stream with a controlled step-to-step churn, computed in-jit.

  Each (layer, request, unit) walks a sliding window over a fixed pseudo-random
  permutation of the prompt positions ``pi(i) = (a*i + b) mod prompt_len``: every
  step ``round(churn * k)`` positions leave and as many never-seen ones enter, so an
  LRU cache of B >= k slots misses about ``churn`` of the selection each step (the
  HiSparse paper measured 13.4% with LRU at B=2k). Positions are distinct by
  construction; the last entry is the newest position.

  Returns ``select(q, ctx)``; ``ctx.newest`` i32[R] drives the step counter.
  """
  if not 0.0 <= churn <= 1.0:
    raise ValueError(f"{churn=} must be in [0, 1]")
  if top_k > prompt_len:
    raise ValueError(f"{top_k=} exceeds {prompt_len=}")
  window = top_k - 1 if include_newest else top_k
  shift = round(churn * window)
  mult = next(a for a in range(7919, 1, -1)
              if math.gcd(a, prompt_len) == 1 and a * prompt_len < 2**31)

  def select(q, ctx):
    del q
    num_req = ctx.newest.shape[0]
    step = jnp.maximum(ctx.newest - prompt_len, 0)  # [R]
    r = jnp.arange(num_req)[:, None, None]
    u = jnp.arange(num_units)[None, :, None]
    salt = (ctx.layer * 7 + r * 131 + u * 17) * 40503  # per-stream offset
    start = (salt + step[:, None, None] * shift) % prompt_len
    idx = (start + jnp.arange(window)[None, None, :]) % prompt_len
    pos = (mult * idx + salt % prompt_len) % prompt_len
    if include_newest:
      newest = jnp.broadcast_to(ctx.newest[:, None, None], (num_req, num_units, 1))
      pos = jnp.concatenate([pos, newest], axis=-1)
    return pos.astype(jnp.int32)

  return select
