"""Per-request sampling on the device: greedy, temperature, top-k, top-p, seeded.

Every row draws with its own key, ``fold_in(fold_in(key(0), seed), position)``, and
its own parameters, so a request's tokens depend on nothing else in the batch.

A sampled row draws ``categorical(key, masked)`` (``masked``: its scaled logits,
-inf where top-k or top-p drop a token) over candidates of one of five kinds
(``CANDIDATES``), chosen by the row's own parameters and logits, so that no row
pays for a sort it does not need (a full argsort of SmolLM2's 49,152 logits per
row, greedy rows too, took 95 ms at 8 rows on the CPU, beside a 57 ms model step):

* ``whole`` (top_k = 0, top_p = 1): every token, in id order, nothing sorted;
* ``window`` (0 < top_k <= ``TOP_K_WINDOW``): ``lax.top_k``'s best, best first;
* ``nucleus_256``, ``nucleus_4096`` (top_k = 0, top_p < 1, and the smallest
  prefix reaching top_p lies within the best 256, else 4096, ``NUCLEUS_WINDOWS``):
  those, best first, their mass under the whole vocabulary's softmax (SmolLM2's
  nucleus at temperature 1, top-p 0.95 fits 256 at 74% of positions, 4096 at
  99.7%: each row of a batch must fit for the batch to skip the next kind; a
  window computed to learn which rows fit is the one they draw from);
* ``ranked`` (the rest: a larger top-k, or a nucleus past its window): every
  token, best first (a stable argsort).

Each kind runs under a ``lax.cond`` on whether any row of the batch is of it, so a
greedy batch runs an argmax only. Threefry is partitionable (jax's default), so a
window's noise is the first entries of the full ranking's: the windows draw the
token the ranking would, and only ``whole`` (id order) draws otherwise. The
processed log-probabilities use the same candidates, so they describe exactly the
distribution a row draws from.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits over a smaller
# one would tell apart logits that differ in their last f32 bits, not a choice.
GREEDY_BELOW = 1e-5
TOP_K_WINDOW = 64  # rows with 0 < top_k <= this draw from a lax.top_k window
NUCLEUS_WINDOWS = (256, 4096)  # top-p rows whose nucleus fits draw from a window


def kept(ranked, top_k, top_p):
  """bool[V]: which of the best-first scaled logits ``ranked`` f32[V] may be drawn:
  the ``top_k`` first (0: all), then the smallest prefix whose mass reaches
  ``top_p`` (the first token always, even where top_p rounds to 0 in f32; top_p =
  1 keeps them all, though the f32 cumsum can reach 1 before the tail)."""
  vocab = ranked.shape[0]
  index = jnp.arange(vocab)
  keep = index < jnp.where(top_k > 0, top_k, vocab)
  probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf))
  return keep & ((index == 0) | (top_p >= 1.0) | ((jnp.cumsum(probs) - probs) < top_p))


# Candidates per row: (logits f32[V], scale, top_k, top_p) -> (ids i32[C], masked
# f32[C]): the token ids a row may draw among and their scaled logits, -inf where
# top-k or top-p drop them.
def _whole(logits, scale, top_k, top_p):
  del top_k, top_p  # (0 and 1: nothing dropped)
  return jnp.arange(logits.shape[0], dtype=jnp.int32), logits / scale


def _best(logits, width: int):
  """``lax.top_k`` ranked as the stable argsort ranks: ties to the lower id, -0.0
  tied with 0.0 (top_k alone puts 0.0 first, argsort and argmax do not)."""
  return jax.lax.top_k(jnp.where(logits == 0, 0.0, logits), min(width, logits.shape[0]))


def _window(logits, scale, top_k, top_p):
  values, ids = _best(logits, TOP_K_WINDOW)
  ranked = values / scale
  return ids.astype(jnp.int32), jnp.where(kept(ranked, top_k, top_p), ranked, -jnp.inf)


def _nucleus_window(logits, scale, top_p, width: int):
  """The best ``width`` ids, their scaled logits, -inf past the smallest prefix
  whose mass (under the whole vocabulary) reaches ``top_p`` (the first one
  always), and whether that prefix ends inside the window."""
  values, ids = _best(logits, width)
  ranked = values / scale
  # As jax.nn.softmax computes it (what ``kept`` uses): exp(x - max) / sum; the
  # log-sum-exp form rounds below it and kept a token past an exact top_p.
  probs = jnp.exp(ranked - ranked[0]) / jnp.exp(logits / scale - ranked[0]).sum()
  reached = jnp.cumsum(probs)
  first = jnp.arange(ranked.shape[0]) == 0
  masked = jnp.where(first | ((reached - probs) < top_p), ranked, -jnp.inf)
  return ids.astype(jnp.int32), masked, reached[-1] >= top_p


def _nucleus(width: int):
  def candidates(logits, scale, top_k, top_p):
    del top_k  # (0)
    ids, masked, _ = _nucleus_window(logits, scale, top_p, width)
    return ids, masked
  return candidates


def _ranked(logits, scale, top_k, top_p):
  order = jnp.argsort(-logits, stable=True)  # best first, ties to the lower id
  ranked = logits[order] / scale
  return order.astype(jnp.int32), jnp.where(kept(ranked, top_k, top_p), ranked, -jnp.inf)


CANDIDATES = {"whole": _whole, "window": _window,
              **{f"nucleus_{width}": _nucleus(width) for width in NUCLEUS_WINDOWS},
              "ranked": _ranked}


def candidate_kind(rows, logits, scale, top_k, top_p):
  """Each row's index into ``CANDIDATES`` i32[S] (read where ``rows`` bool[S]), by
  its own parameters and, for a top-p row, its logits; and the nucleus windows'
  candidates, {kind: (ids i32[S, W], masked f32[S, W])}, computed to learn which
  rows fit (each window only where some row fits no smaller one)."""
  num, vocab = logits.shape
  whole = (top_k == 0) & (top_p >= 1.0)
  window = (top_k > 0) & (top_k <= min(TOP_K_WINDOW, vocab))
  kind = jnp.where(whole, 0, jnp.where(window, 1, len(CANDIDATES) - 1))
  unplaced = rows & (top_k == 0) & (top_p < 1.0)
  nucleus = {}
  for index, width in enumerate(NUCLEUS_WINDOWS, start=2):
    empty = (jnp.zeros((num, min(width, vocab)), jnp.int32),
             jnp.full((num, min(width, vocab)), -jnp.inf, logits.dtype), unplaced)
    ids, masked, fits = jax.lax.cond(
        unplaced.any(),
        lambda w=width: jax.vmap(functools.partial(_nucleus_window, width=w))(
            logits, scale, top_p),
        lambda e=empty: e)
    nucleus[f"nucleus_{width}"] = (ids, masked)
    kind = jnp.where(unplaced & fits, index, kind)
    unplaced &= ~fits
  return kind.astype(jnp.int32), nucleus


def _sampled(temperature):
  """bool[S]: the rows that draw (the rest take the argmax)."""
  return temperature >= GREEDY_BELOW


def _scale(temperature):
  """What a row's logits are divided by: its temperature (1 when greedy)."""
  return jnp.where(_sampled(temperature), temperature, 1.0)


def _per_kind(rows, use, default, logits, scale, top_k, top_p, *extra):
  """``default`` f[S, ...] with each row in ``rows`` bool[S] replaced by
  ``use(ids, masked, *its extra)`` over its kind's candidates, each kind computed
  only when some such row is of it."""
  kind, nucleus = candidate_kind(rows, logits, scale, top_k, top_p)
  out = default
  for index, (name, candidates) in enumerate(CANDIDATES.items()):
    these = rows & (kind == index)

    def computed(name=name, candidates=candidates):
      ids, masked = nucleus[name] if name in nucleus else jax.vmap(candidates)(
          logits, scale, top_k, top_p)
      return jax.vmap(use)(ids, masked, *extra)

    chosen = jax.lax.cond(these.any(), computed, lambda: default)
    out = jnp.where(these.reshape(these.shape + (1,) * (out.ndim - 1)), chosen, out)
  return out


@functools.partial(jax.jit)
def sample(logits, temperature, top_k, top_p, seed, position):
  """tokens i32[S] and finite bool[S] from logits f32[S, V] and per-row
  parameters f32/i32[S] (``position``: where the sampled token will sit; a
  temperature below ``GREEDY_BELOW`` takes the argmax)."""
  logits = logits.astype(jnp.float32)
  finite = jnp.isfinite(logits).all(axis=-1)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(
      jax.random.key(0), s), p))(seed, position)
  draw = lambda ids, masked, key: ids[jax.random.categorical(key, masked)]
  tokens = _per_kind(_sampled(temperature), draw, greedy, logits, _scale(temperature),
                     top_k, top_p, keys)
  return tokens, finite


@functools.partial(jax.jit, static_argnames=("top_n",))
def logprobs(logits, tokens, temperature, top_k, top_p, processed_rows, top_n: int):
  """The log-probability of ``tokens`` i32[S] under each row's distribution, f32[S],
  and the ``top_n`` most likely tokens' ids i32[S, N] and log-probabilities f32[S,
  N], best first. A row's distribution is softmax(logits f32[S, V]) (raw), or,
  where ``processed_rows`` bool[S], the one ``sample`` draws from: the logits over
  the temperature (1 when greedy), -inf outside top-k and top-p, from the same
  candidates (per-row parameters as ``sample``'s)."""
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)

  def processed(ids, masked):  # -inf where the sampler cannot draw
    return jnp.full(logits.shape[-1:], -jnp.inf, logits.dtype).at[ids].set(
        jax.nn.log_softmax(masked))

  log_probs = _per_kind(processed_rows, processed, log_probs, logits,
                        _scale(temperature), top_k, top_p)
  chosen = jnp.take_along_axis(log_probs, tokens[:, None].astype(jnp.int32), -1)[:, 0]
  top, ids = jax.lax.top_k(log_probs, top_n)
  return chosen, ids.astype(jnp.int32), top
