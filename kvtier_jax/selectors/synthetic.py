"""Selectors with no model behind them (tests, benchmarks), as ``Selector``s.

Both plug into the same tiered step as Quest, DSA and NSA: their state (if any)
rides in the step's carry like any selector state.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kvtier_jax.shapes import EMPTY


@dataclasses.dataclass(frozen=True)
class GivenSelector:
  """Returns precomputed positions: its state is the step's selections.

  The caller puts i32[L, R, U, top_k] (-1 padding) into the carry's selector state
  before each step (``TieredDecoder.step(..., selections=...)``); layer l reads
  its slice. Under the "rank" policy ``top_k`` is the ranking's width.
  """

  top_k: int
  num_units: int = 1

  def init_state(self, num_layers: int, num_requests: int, max_len: int):
    del max_len
    return jnp.full((num_layers, num_requests, self.num_units, self.top_k), EMPTY,
                    jnp.int32)

  def prefill(self, state, layer, inputs, params=None):
    del layer, inputs, params
    return state

  def select(self, state, layer, inputs, params=None):
    del inputs, params
    return state[layer], state

  def ranks_best_first(self, top_k: int) -> bool:
    return True  # the caller's rows, ranked as the "rank" policy documents

  def state_bytes_per_token(self) -> int:
    return 0

  def state_bytes_per_request(self) -> int:
    """One step's selections, per layer (``top_k`` is the row width)."""
    return self.num_units * self.top_k * 4


@dataclasses.dataclass(frozen=True)
class ChurnSelector:
  """A selection stream with a controlled step-to-step churn, computed in-jit.

  Each (layer, request, unit) walks a sliding window over a fixed pseudo-random
  permutation of the prompt positions ``pi(i) = (a*i + b) mod prompt_len``: every
  step ``round(churn * k)`` positions leave and as many never-seen ones enter, so an
  LRU cache of B >= k slots misses about ``churn`` of the selection each step (the
  HiSparse paper measured 13.4% with LRU at B=2k). Positions are distinct by
  construction; with ``include_newest`` the selection's last entry is the newest
  position. ``rank_depth`` > ``top_k``: each row is a ranking for the "rank" policy
  (``PolicyConfig("rank", rank_depth=m)``), the selection first, then the
  ``m - top_k`` positions the walk reaches next (best first: the sooner one
  enters, the better it ranks), so the benchmarks time the rank lookup at depth.
  Stateless: the step counter is the position being decoded. Positions are prompt
  positions, so they are valid from ``newest >= prompt_len`` on (decoding after
  the prompt); earlier, some lie past ``newest``, or the newest is in the window
  twice, and the step refuses.
  """

  prompt_len: int
  top_k: int
  num_units: int = 1
  churn: float = 0.134
  include_newest: bool = True
  rank_depth: int = 0

  def __post_init__(self):
    if not 0.0 <= self.churn <= 1.0:
      raise ValueError(f"churn={self.churn} must be in [0, 1]")
    if max(self.top_k, self.rank_depth) > self.prompt_len:
      raise ValueError(f"top_k={self.top_k} or rank_depth={self.rank_depth} exceeds "
                       f"prompt_len={self.prompt_len}")

  def ranks_best_first(self, top_k: int) -> bool:
    return top_k == self.top_k  # the selection leads every row

  def init_state(self, num_layers: int, num_requests: int, max_len: int):
    return None

  def prefill(self, state, layer, inputs, params=None):
    return state

  def state_bytes_per_token(self) -> int:
    return 0

  def select(self, state, layer, inputs, params=None):
    del params
    prompt_len = self.prompt_len
    window = self.top_k - 1 if self.include_newest else self.top_k
    shift = round(self.churn * window)
    ahead = max(self.rank_depth - self.top_k, 0)  # the ranking's tail
    mult = next(a for a in range(7919, 1, -1)
                if math.gcd(a, prompt_len) == 1 and a * prompt_len < 2**31)
    newest = inputs.newest
    num_req = newest.shape[0]
    step = jnp.maximum(newest - prompt_len, 0)  # [R]
    r = jnp.arange(num_req)[:, None, None]
    u = jnp.arange(self.num_units)[None, :, None]
    salt = (layer * 7 + r * 131 + u * 17) * 40503  # per-stream window offset
    start = (salt + step[:, None, None] * shift) % prompt_len
    cols = jnp.arange(window + ahead + (self.include_newest and ahead > 0))
    # With a ranking's tail the newest takes column ``window`` and the tail follows
    # it (one elementwise select); without one it is appended (the full-KV step's
    # compile fuses that concatenation: a select there cost it one launch more).
    walk = cols - (cols > window) if self.include_newest and ahead else cols
    idx = (start + walk[None, None, :]) % prompt_len
    # One permutation for every stream, each at its own offset. (An offset added
    # after the multiplication too cancelled the window's when mult = -1 mod
    # prompt_len: every stream then selected the same positions.)
    pos = (mult * idx) % prompt_len
    if self.include_newest and ahead:
      pos = jnp.where(cols == window, newest[:, None, None], pos)
    elif self.include_newest:
      last = jnp.broadcast_to(newest[:, None, None], (num_req, self.num_units, 1))
      pos = jnp.concatenate([pos, last], axis=-1)
    return pos.astype(jnp.int32), state
