"""Recording what selectors pick while the model attends densely (analysis only).

Every selector absorbs each token and picks positions at every layer, its picks
are kept in the carry; attention itself is dense, so one pass serves any number of
selectors (REAL_MODEL.md §4: selections are recorded, not fed back).
"""

from __future__ import annotations

import functools

import flax.struct
import jax

from kvtier_jax.selectors.base import StepInputs, layer_slice
from models import cache as cache_lib
from models.transformer import apply_decode


@flax.struct.dataclass
class TraceCarry:
  kv: cache_lib.DenseKV
  states: tuple  # one resident state per selector
  params: tuple  # selector params (or None) per selector
  picks: tuple  # this step's positions per selector, i32[L, R, U, k]


@functools.cache
def trace_attend(selectors: tuple):
  """Dense attention; every selector also absorbs the token and picks positions."""

  def attend(layer, q, k_new, v_new, carry: TraceCarry, x):
    out, kv = cache_lib.dense_attend(layer, q, k_new, v_new, carry.kv)
    inputs = StepInputs(x, q, k_new, carry.kv.lens)
    states, picks = [], []
    for sel, state, params, buf in zip(selectors, carry.states, carry.params,
                                       carry.picks):
      p = None if params is None else layer_slice(params, layer)
      positions, state = sel.select(state, layer, inputs, p)
      states.append(state)
      picks.append(buf.at[layer].set(positions))
    return out, carry.replace(kv=kv, states=tuple(states), picks=tuple(picks))

  return attend


@functools.partial(jax.jit, static_argnames=("cfg", "selectors"),
                   donate_argnames=("carry",))
def trace_step(cfg, selectors, weights, tokens, carry: TraceCarry):
  _, carry = apply_decode(cfg, weights, tokens, carry.kv.lens, carry,
                          trace_attend(selectors))
  return carry.replace(kv=cache_lib.advance(carry.kv))




@functools.partial(jax.jit, static_argnames=("cfg", "selectors"))
def lookahead_picks(cfg, selectors, weights, tokens, carry: TraceCarry):
  """The picks a (draft) token one position ahead would make, committing nothing:
  the carry is not donated and the returned picks are the only result."""
  _, ahead = apply_decode(cfg, weights, tokens, carry.kv.lens, carry,
                          trace_attend(selectors))
  return ahead.picks
