"""Tests of ``kvtier_jax.cache_sim.replay`` against plain-loop oracles.

The oracles below are written from the policy definitions (sets, lists, linear
scans), not from the vectorised code; LRU is checked against the library's own
``resolve`` stepped one decode step at a time, since replay must agree with it.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from kvtier_jax.cache_sim import OFFLINE_POLICIES, POLICIES, replay
from kvtier_jax.resolve import resolve

ONLINE = tuple(p for p in POLICIES if p not in OFFLINE_POLICIES)
NO_NEWEST = 2**30  # a position never selected: disables resolve's reserved slot
SEEDS = (0, 1, 2, 3)
_resolve_jit = jax.jit(resolve)  # same function; compiled once per shape


def make_trace(seed, batch=(3,), steps=40, k=12, num_pos=64, reuse=0.7, pad=0.15):
  """i64[*batch, steps, k] selections with temporal locality and padding.

  Each row keeps a ``reuse`` fraction of the previous row and draws the rest fresh
  from ``[0, num_pos)``, so there are hits, capacity misses and reuse distances
  beyond the cache; ``pad`` of the entries are -1.
  """
  rng = np.random.default_rng(seed)
  out = np.empty((math.prod(batch), steps, k), np.int64)
  for s in range(out.shape[0]):
    prev = rng.choice(num_pos, k, replace=False)
    for t in range(steps):
      kept = prev[rng.random(k) < reuse]
      fresh = rng.permutation(np.setdiff1d(np.arange(num_pos), kept))
      row = rng.permutation(np.concatenate([kept, fresh[:k - kept.size]]))
      out[s, t] = row
      prev = row
  out[rng.random(out.shape) < pad] = -1
  return out.reshape(batch + (steps, k))


def valid_rows(stream):
  return [[int(p) for p in row if p >= 0] for row in stream]


# ----------------------------------------------------------------- oracles --


def resolve_misses(sel, capacity, *, jit=True):
  """i64[S, T]: fetches of ``resolve`` stepped over ``sel`` i64[S, T, k]."""
  num_streams, num_steps, _ = sel.shape
  step = _resolve_jit if jit else resolve
  slot_pos = np.full((num_streams, capacity), -1, np.int32)
  lru = np.tile(np.arange(capacity, dtype=np.int32), (num_streams, 1))
  newest = np.full(num_streams, NO_NEWEST, np.int32)
  out = np.zeros((num_streams, num_steps), np.int64)
  for t in range(num_steps):
    res = step(slot_pos, lru, sel[:, t].astype(np.int32), newest)
    slot_pos, lru = np.asarray(res.slot_pos), np.asarray(res.lru)
    out[:, t] = np.asarray(res.is_miss).sum(-1)
  return out


def fifo_oracle(stream, capacity):
  """Evict the earliest-inserted unpinned slot; empty slots count as earliest."""
  slots = [None] * capacity
  born = list(range(-capacity, 0))  # empties: earliest, in slot order
  clock, out = 0, []
  for want in valid_rows(stream):
    pinned = {slots.index(p) for p in want if p in slots}
    misses = [p for p in want if p not in slots]
    for p in misses:
      s = min((i for i in range(capacity) if i not in pinned), key=born.__getitem__)
      slots[s], born[s] = p, clock
      clock += 1
      pinned.add(s)
    out.append(len(misses))
  return out


def random_oracle(streams, capacity, seed):
  """Fill the lowest empty slot, else the unpinned slot with the smallest draw.

  Uses the documented draws: ``rng.random((S, capacity))`` once per step.
  """
  rng = np.random.default_rng(seed)
  slots = [[None] * capacity for _ in streams]
  rows = [valid_rows(s) for s in streams]
  out = np.zeros((len(streams), len(rows[0])), np.int64)
  for t in range(out.shape[1]):
    draws = rng.random((len(streams), capacity))
    for s, cache in enumerate(slots):
      want = rows[s][t]
      pinned = {cache.index(p) for p in want if p in cache}
      misses = [p for p in want if p not in cache]
      for p in misses:
        empty = [i for i in range(capacity) if cache[i] is None]
        v = empty[0] if empty else min(
            (i for i in range(capacity) if i not in pinned), key=lambda i: draws[s, i])
        cache[v] = p
        pinned.add(v)
      out[s, t] = len(misses)
  return out


def belady_oracle(stream, capacity, tie=1):
  """Brute-force furthest-in-future on sets; ``tie`` flips the tie-break.

  Why tie-breaking cannot change the count (so any rule may be compared with
  replay): two evictable entries x, y tied at next use u (or both never used again)
  are not requested before u and are both requested at u. Evicting y instead of x
  yields the state with x and y swapped; on the trace up to u that swap changes no
  request and no next-use key, so the swapped run is a valid run with the same
  misses, and after step u both x and y are resident in either run, so the states
  coincide from there on (for u = infinity the swap leaves the whole trace alone).
  """
  rows = [set(r) for r in valid_rows(stream)]

  def next_use(p, t):
    return next((u for u in range(t + 1, len(rows)) if p in rows[u]), math.inf)

  cache, out = set(), []
  for t, want in enumerate(rows):
    out.append(len(want - cache))
    over = len(cache | want) - capacity  # fill empty slots first
    if over > 0:
      cand = sorted(cache - want, key=lambda p: (next_use(p, t), tie * p))
      cache -= set(cand[-over:])
    cache |= want
  return out


# ------------------------------------------------------------------- tests --


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("factor", [1.0, 1.5, 2.0])
def test_lru_matches_resolve(seed, factor):
  k = 12
  capacity = int(factor * k)
  sel = make_trace(seed, batch=(3,), k=k)
  np.testing.assert_array_equal(replay(sel, capacity, "lru"),
                                resolve_misses(sel, capacity))


def test_lru_matches_eager_resolve():
  """The un-jitted resolve (with its concrete-input checks) agrees too."""
  sel = make_trace(7, batch=(2,), steps=8, k=6, num_pos=20)
  np.testing.assert_array_equal(replay(sel, 6, "lru"),
                                resolve_misses(sel, 6, jit=False))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 18, 24])
def test_fifo_matches_oracle(seed, capacity):
  sel = make_trace(seed + 10, k=12)
  want = [fifo_oracle(s, capacity) for s in sel]
  np.testing.assert_array_equal(replay(sel, capacity, "fifo"), want)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 18, 24])
def test_random_matches_oracle(seed, capacity):
  sel = make_trace(seed + 20, k=12)
  np.testing.assert_array_equal(replay(sel, capacity, "random", seed=seed),
                                random_oracle(sel, capacity, seed))


def test_random_deterministic_per_seed():
  sel = make_trace(5, batch=(4,), k=12)
  first = replay(sel, 16, "random", seed=3)
  np.testing.assert_array_equal(first, replay(sel, 16, "random", seed=3))
  assert any((replay(sel, 16, "random", seed=s) != first).any() for s in range(4, 8))


def test_random_evicts_uniformly():
  """Cache {0, 1} full, 2 evicts one of them: a later request for 0 misses w.p. 1/2."""
  streams = 4000
  sel = np.broadcast_to(np.array([[0], [1], [2], [0]]), (streams, 4, 1))
  rate = replay(sel, 2, "random", seed=11)[:, 3].mean()
  assert abs(rate - 0.5) < 4 * math.sqrt(0.25 / streams)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 18, 24])
def test_belady_matches_oracle(seed, capacity):
  sel = make_trace(seed + 30, k=12, num_pos=40)  # small space: many ties
  got = replay(sel, capacity, "belady")
  for s, stream in enumerate(sel):
    want = belady_oracle(stream, capacity)
    assert want == belady_oracle(stream, capacity, tie=-1)  # see its docstring
    np.testing.assert_array_equal(got[s], want)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 15, 30])
def test_invariants(seed, capacity):
  sel = make_trace(seed + 40, batch=(2, 2), k=12, num_pos=80, pad=0.3)
  num_valid = (sel >= 0).sum(-1)
  runs = {p: replay(sel, capacity, p, seed=seed) for p in POLICIES}
  for policy, misses in runs.items():
    assert misses.shape == sel.shape[:-1] and misses.dtype == np.int64, policy
    assert (misses >= 0).all() and (misses <= num_valid).all(), policy
    np.testing.assert_array_equal(misses[..., 0], num_valid[..., 0], policy)
  opt = runs["belady"].sum(-1)
  for policy in ONLINE:
    assert (opt <= runs[policy].sum(-1)).all(), policy


@pytest.mark.parametrize("policy", POLICIES)
def test_capacity_holding_everything_only_misses_first_uses(policy):
  sel = make_trace(50, batch=(2,), k=8, num_pos=30)
  misses = replay(sel, 30, policy)
  for s, stream in enumerate(sel):
    seen, first = set(), []
    for row in valid_rows(stream):
      first.append(len(set(row) - seen))
      seen |= set(row)
    np.testing.assert_array_equal(misses[s], first)


@pytest.mark.parametrize("policy", ONLINE)
def test_online_policies_are_causal(policy):
  sel = make_trace(60, batch=(3,), steps=40, k=12)
  other = sel.copy()
  other[:, 25:] = make_trace(61, batch=(3,), steps=15, k=12)
  full = replay(sel, 16, policy, seed=4)
  np.testing.assert_array_equal(full[:, :25], replay(other, 16, policy, seed=4)[:, :25])
  np.testing.assert_array_equal(full[:, :25], replay(sel[:, :25], 16, policy, seed=4))


@pytest.mark.parametrize("policy", ["lru", "fifo", "belady"])
def test_batch_dims_are_independent_streams(policy):
  sel = make_trace(70, batch=(2, 3), k=8, num_pos=40)
  got = replay(sel, 12, policy)
  assert got.shape == (2, 3, 40)
  for i in np.ndindex(2, 3):
    np.testing.assert_array_equal(got[i], replay(sel[i], 12, policy))


@pytest.mark.parametrize("policy", POLICIES)
def test_sparse_huge_positions_relabel_exactly(policy):
  """Positions offset by 2**40 (no dense table fits) replay identically."""
  sel = make_trace(80, batch=(3,), k=8, num_pos=40)
  far = np.where(sel >= 0, sel * 7919 + 2**40, -1)
  np.testing.assert_array_equal(replay(far, 10, policy, seed=1),
                                replay(sel, 10, policy, seed=1))


def test_empty_trace():
  assert replay(np.zeros((4, 0, 3), np.int32), 3, "lru").shape == (4, 0)


@pytest.mark.parametrize("selections, capacity, policy, match", [
    (np.zeros((3, 4), np.int32), 3, "lru", "capacity >= k"),
    (np.array([[0, 1], [2, 2]]), 4, "lru", "appears twice"),
    (np.array([[0, -2]]), 4, "fifo", "padding"),
    (np.array([[0, 1]]), 4, "mru", "unknown policy"),
    (np.array([[0.0, 1.0]]), 4, "lru", "integer"),
    (np.array([True, False]), 4, "lru", "integer"),
    (np.array([0, 1]), 4, "belady", r"\[\.\.\., T, k\]"),
    (np.array([[0, 1]]), 2.5, "random", "capacity must be an int"),
])
def test_bad_inputs_raise(selections, capacity, policy, match):
  with pytest.raises(ValueError, match=match):
    replay(selections, capacity, policy)


def test_padding_may_repeat():
  """-1 is padding, not a position: it may appear many times in a row."""
  sel = np.array([[-1, -1, 3], [3, -1, -1]])
  for policy in POLICIES:
    np.testing.assert_array_equal(replay(sel, 3, policy), [1, 0])
