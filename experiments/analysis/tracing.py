"""Recording what selectors pick while the model attends densely (analysis only).

Every selector absorbs each token and picks positions at every layer, its picks
are kept in the carry; attention itself is dense, so one pass serves any number of
selectors (selections are recorded, not fed back).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from kvtier_jax.selectors.base import StepInputs, layer_slice
from models import cache as cache_lib
from models.transformer import apply_decode


@flax.struct.dataclass
class TraceCarry:
  kv: cache_lib.DenseKV
  states: tuple  # one resident state per selector
  params: tuple  # selector params (or None) per selector
  picks: tuple  # this step's positions per selector, i32[L, R, U, k]
  recall: jax.Array  # f32[S, L, R] this step's attention mass each selector covered


def attention_mass(q, k_layer, lens):
  """f32[R, T]: the model's attention over positions 0..lens, averaged over query
  heads (each head's row sums to 1), from q [R, Hq, D] and keys [R, T, Hkv, D]."""
  num_req, num_q, head_dim = q.shape
  group = num_q // k_layer.shape[2]
  scores = jnp.einsum("rkgd,rtkd->rkgt", q.reshape(num_req, -1, group, head_dim),
                      k_layer, precision=jax.lax.Precision.HIGHEST) * head_dim ** -0.5
  visible = jnp.arange(k_layer.shape[1])[None, :] <= lens[:, None]
  probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), axis=-1)
  return probs.mean(axis=(1, 2))


def covered_mass(mass, positions):
  """f32[R]: attention mass of the positions a selector named (any unit), [R, U, k]."""
  num_req, length = mass.shape
  named = jnp.zeros((num_req, length + 1), bool).at[
      jnp.arange(num_req)[:, None, None], jnp.where(positions >= 0, positions, length)
  ].set(True)[:, :length]
  return (mass * named).sum(-1)


@functools.cache
def trace_attend(selectors: tuple, select_k: tuple | None = None):
  """Dense attention; every selector also absorbs the token and picks positions.

  ``select_k``: per selector, how many leading picks form the selection (the rest
  of a longer, best-first row is its ranking); recall counts those only.
  """

  def attend(layer, q, k_new, v_new, carry: TraceCarry, x):
    out, kv = cache_lib.dense_attend(layer, q, k_new, v_new, carry.kv)
    inputs = StepInputs(x, q, k_new, carry.kv.lens)
    mass = attention_mass(q, kv.k[layer], carry.kv.lens)  # [R, T]
    states, picks, recall = [], [], carry.recall
    for i, (sel, state, params, buf) in enumerate(zip(selectors, carry.states,
                                                      carry.params, carry.picks)):
      p = None if params is None else layer_slice(params, layer)
      positions, state = sel.select(state, layer, inputs, p)
      states.append(state)
      picks.append(buf.at[layer].set(positions))
      chosen = positions if select_k is None else positions[..., :select_k[i]]
      recall = recall.at[i, layer].set(covered_mass(mass, chosen))
    return out, carry.replace(kv=kv, states=tuple(states), picks=tuple(picks),
                              recall=recall)

  return attend


@functools.partial(jax.jit, static_argnames=("cfg", "selectors", "select_k"),
                   donate_argnames=("carry",))
def trace_step(cfg, selectors, weights, tokens, carry: TraceCarry, select_k=None):
  _, carry = apply_decode(cfg, weights, tokens, carry.kv.lens, carry,
                          trace_attend(selectors, select_k))
  return carry.replace(kv=cache_lib.advance(carry.kv))




@functools.partial(jax.jit, static_argnames=("cfg", "selectors"))
def lookahead_picks(cfg, selectors, weights, tokens, carry: TraceCarry):
  """The picks a (draft) token one position ahead would make, committing nothing:
  the carry is not donated and the returned picks are the only result."""
  _, ahead = apply_decode(cfg, weights, tokens, carry.kv.lens, carry,
                          trace_attend(selectors))
  return ahead.picks
