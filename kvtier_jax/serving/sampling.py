"""Per-request sampling on the device: greedy, temperature, top-k, top-p, seeded.

Every row draws with its own key, ``fold_in(fold_in(key(0), seed), position)``, and
its own parameters, so a request's tokens depend on nothing else in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def kept(ranked, top_k, top_p):
  """bool[V]: which of the best-first scaled logits ``ranked`` f32[V] may be drawn:
  the ``top_k`` first (0: all), then the smallest prefix whose mass reaches
  ``top_p`` (the first token always; top_p = 1 keeps them all, though the f32
  cumsum can reach 1 before the tail)."""
  vocab = ranked.shape[0]
  keep = jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab)
  probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf))
  return keep & ((top_p >= 1.0) | ((jnp.cumsum(probs) - probs) < top_p))


def _sample_row(logits, temperature, top_k, top_p, seed, position):
  # logits: f32[V]; the rest are scalars. Returns (token i32[], finite bool[]).
  logits = logits.astype(jnp.float32)
  finite = jnp.isfinite(logits).all()
  greedy = jnp.argmax(logits).astype(jnp.int32)
  order = jnp.argsort(-logits, stable=True)  # best first, ties to the lower id
  ranked = logits[order] / jnp.maximum(temperature, 1e-6)
  keep = kept(ranked, top_k, top_p)
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed), position)
  pick = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf))
  sampled = order[pick].astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy), finite


@functools.partial(jax.jit)
def sample(logits, temperature, top_k, top_p, seed, position):
  """tokens i32[S] and finite bool[S] from logits f32[S, V] and per-row
  parameters f32/i32[S] (``position``: where the sampled token will sit)."""
  return jax.vmap(_sample_row)(logits, temperature, top_k, top_p, seed, position)


def _processed_row(logits, temperature, top_k, top_p):
  # logits: f32[V]; the rest are scalars. Returns f32[V]: the log-probabilities
  # the sampler draws from (-inf where top-k or top-p drop the token), in id order.
  order = jnp.argsort(-logits, stable=True)  # as _sample_row ranks them
  scale = jnp.where(temperature > 0, jnp.maximum(temperature, 1e-6), 1.0)
  ranked = logits[order] / scale
  ranked_log_probs = jax.nn.log_softmax(
      jnp.where(kept(ranked, top_k, top_p), ranked, -jnp.inf))
  return jnp.zeros_like(ranked_log_probs).at[order].set(ranked_log_probs)


@functools.partial(jax.jit, static_argnames=("top_n", "processed"))
def logprobs(logits, tokens, temperature, top_k, top_p, processed_rows, top_n: int,
             processed: bool):
  """The log-probability of ``tokens`` i32[S] under each row's distribution, f32[S],
  and the ``top_n`` most likely tokens' ids i32[S, N] and log-probabilities f32[S,
  N], best first. A row's distribution is softmax(logits f32[S, V]) (raw), or,
  where ``processed_rows`` bool[S] (read only when ``processed``, a static flag so
  raw-only batches skip the sort), the one ``sample`` draws from: the logits over
  the temperature (1 when greedy), -inf outside top-k and top-p (per-row
  parameters as ``sample``'s)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  if processed:
    drawn_from = jax.vmap(_processed_row)(logits.astype(jnp.float32), temperature,
                                          top_k, top_p)
    log_probs = jnp.where(processed_rows[:, None], drawn_from, log_probs)
  chosen = jnp.take_along_axis(log_probs, tokens[:, None].astype(jnp.int32), -1)[:, 0]
  top, ids = jax.lax.top_k(log_probs, top_n)
  return chosen, ids.astype(jnp.int32), top
