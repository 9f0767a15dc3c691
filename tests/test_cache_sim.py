"""Tests of ``experiments.analysis.cache_sim.replay`` against plain-loop oracles.

The oracles below are written from the policy definitions (sets, lists, linear
scans), not from the vectorised code; LRU is checked against the library's own
``resolve`` stepped one decode step at a time, since replay must agree with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

from experiments.analysis.cache_sim import (CHURN_DECAY, LEARNED, LEARNED_FEATURES,
                                           OFFLINE_POLICIES, POLICIES, compare_policies,
                                           replay, synthetic_trace)
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


def lru_order(order, want, resident):
  """Resolve's recency update on a list (LRU first) of the resident entries.

  Misses become most recent in selection order; hits go above them, keeping their
  old relative order. ``order`` must already lack the step's evicted entries.
  """
  wset = set(want)
  hits = [p for p in order if p in wset]
  misses = [p for p in want if p not in resident]
  return [p for p in order if p not in wset] + misses + hits


def clock_oracle(stream, capacity):
  """A ring of slots, a hand and reference bits, one miss at a time."""
  slots, ref, hand, out = [None] * capacity, [False] * capacity, 0, []
  for want in valid_rows(stream):
    pinned = {slots.index(p) for p in want if p in slots}
    for s in pinned:
      ref[s] = True
    misses = [p for p in want if p not in slots]
    for p in misses:
      while hand in pinned or ref[hand]:
        if hand not in pinned:
          ref[hand] = False
        hand = (hand + 1) % capacity
      if slots[hand] is None:  # the documented claim: empties fill in slot order
        assert hand == slots.index(None)
      slots[hand], ref[hand] = p, False
      pinned.add(hand)
      hand = (hand + 1) % capacity
    out.append(len(misses))
  return out


def sieve_oracle(stream, capacity):
  """SIEVE on a Python list (tail = oldest first), hand = an entry or None."""
  queue, visited, hand, out = [], {}, None, []
  for want in valid_rows(stream):
    wset = set(want)
    misses = [p for p in want if p not in visited]
    for p in want:
      if p in visited:
        visited[p] = True
    for _ in range(max(0, len(queue) + len(misses) - capacity)):
      i = 0 if hand is None else queue.index(hand)
      while queue[i] in wset or visited[queue[i]]:
        if queue[i] not in wset:
          visited[queue[i]] = False
        i = (i + 1) % len(queue)
      del visited[queue.pop(i)]
      hand = queue[i] if i < len(queue) else None
    for p in misses:
      queue.append(p)
      visited[p] = False
    out.append(len(misses))
  return out


def twoq_oracle(stream, capacity, kin_frac=0.25, kout_frac=0.5):
  """Full 2Q with lists: A1in FIFO, Am LRU, A1out ghost FIFO (oldest first)."""
  kin = max(1, round(kin_frac * capacity))
  kout = max(1, round(kout_frac * capacity))
  a1in, am, a1out, out = [], [], [], []
  for want in valid_rows(stream):
    wset, resident = set(want), set(a1in) | set(am)
    misses = [p for p in want if p not in resident]
    ghost = [p for p in misses if p in a1out]
    admitted = len(misses) - len(ghost)
    for _ in range(max(0, len(resident) + len(misses) - capacity)):
      c_in = [p for p in a1in if p not in wset]
      c_m = [p for p in am if p not in wset]
      if c_in and (len(a1in) + admitted - (admitted > 0) > kin or not c_m):
        a1in.remove(c_in[0])
        a1out.append(c_in[0])
      else:
        am.remove(c_m[0])
    a1out = [p for p in a1out if p not in wset][-kout:]
    am = lru_order(am, [p for p in want if p in am or p in ghost], set(am))
    a1in += [p for p in misses if p not in ghost]
    out.append(len(misses))
  return out


def arc_oracle(stream, capacity):
  """ARC with sets/lists, one step = hits, p update, REPLACEs, insertions, trims."""
  c = capacity
  t1, t2, order, b1, b2, p, out = set(), set(), [], [], [], 0.0, []
  for want in valid_rows(stream):
    wset = set(want)
    misses = [x for x in want if x not in t1 and x not in t2]
    g1 = [x for x in misses if x in b1]
    g2 = [x for x in misses if x in b2]
    r1 = max(len(b2) / len(b1), 1.0) if b1 else 1.0
    r2 = max(len(b1) / len(b2), 1.0) if b2 else 1.0
    p = min(c, max(0.0, p + (len(g1) * r1 - len(g2) * r2)))
    hits = wset - set(misses)
    t1 -= hits
    t2 |= hits
    one_b2 = len(misses) == 1 and len(g2) == 1  # the paper's current miss, in B2
    for _ in range(max(0, len(t1) + len(t2) + len(misses) - c)):
      c1 = [x for x in order if x in t1]
      c2 = [x for x in order if x in t2 and x not in wset]
      if c1 and (len(t1) > p or (one_b2 and len(t1) == p) or not c2):
        t1.remove(c1[0])
        b1.append(c1[0])
        order.remove(c1[0])
      else:
        t2.remove(c2[0])
        b2.append(c2[0])
        order.remove(c2[0])
    b1 = [x for x in b1 if x not in wset]
    b2 = [x for x in b2 if x not in wset]
    order = lru_order(order, want, t1 | t2)
    t2 |= set(g1) | set(g2)
    t1 |= set(misses) - t2
    b1 = b1[max(0, len(b1) - (c - len(t1))):]
    b2 = b2[max(0, len(b2) - (2 * c - len(t1) - len(t2) - len(b1))):]
    out.append(len(misses))
  return out


def ranked_oracle(stream, capacity, kind, alpha=0.9, scores=None):
  """lru2 / freq / score: evict the smallest (key, LRU position), key per entry.

  lru2 key: second most recent request step (-1 if requested once); freq:
  f <- alpha*f + [requested]; score: e <- alpha*e + score (0 if not requested).
  """
  k = len(stream[0])
  order, key, last, out = [], {}, {}, []
  for t, row in enumerate(stream):
    want = [int(p) for p in row if p >= 0]
    gain = {int(p): (1 - r / k if scores is None else float(scores[t][r]))
            for r, p in enumerate(row) if p >= 0}
    wset, resident = set(want), set(order)
    misses = [p for p in want if p not in resident]
    for _ in range(max(0, len(order) + len(misses) - capacity)):
      cand = [p for p in order if p not in wset]
      order.remove(min(cand, key=lambda p: (key[p], order.index(p))))
    for p in order:
      if kind == "lru2" and p in wset:
        key[p], last[p] = last[p], t
      elif kind == "freq":
        key[p] = alpha * key[p] + 1.0 if p in wset else alpha * key[p]
      elif kind == "score":
        key[p] = alpha * key[p] + gain[p] if p in wset else alpha * key[p]
    for p in misses:
      key[p], last[p] = {"lru2": -1, "freq": 1.0, "score": gain.get(p)}[kind], t
    order = lru_order(order, want, resident)
    out.append(len(misses))
  return out


def rank_oracle(stream, ranks, capacity, rank_freq=0.0, alpha=0.9, foresight=None):
  """rank: evict the resident, unrequested entry with the smallest
  (1 - r/m) + rank_freq * f, r its index in this step's ``ranks`` row (m if absent),
  f <- alpha*f + [requested] (1 when fetched); ties by LRU position.

  ``foresight`` = h (the "foresight" policy): first evict the entries not requested
  in the next h steps (by the rank key), then those that are, the latest reuse
  first."""
  rows = [{int(p) for p in row if p >= 0} for row in stream]

  def reuse_in(p, t):  # steps to the next request within the horizon, else None
    return next((u - t for u in range(t + 1, min(t + foresight, len(rows) - 1) + 1)
                 if p in rows[u]), None)

  def evict_first(p, t, at, m, order):  # the smallest goes first
    soon = reuse_in(p, t) if foresight else None
    return (soon is not None, -(soon or 0),
            (1 - at.get(p, m) / m) + rank_freq * freq[p], order.index(p))

  order, freq, out = [], {}, []
  for t, (row, ranked) in enumerate(zip(stream, ranks)):
    want = [int(p) for p in row if p >= 0]
    m = len(ranked)
    at = {int(p): r for r, p in enumerate(ranked) if p >= 0}
    wset, resident = set(want), set(order)
    misses = [p for p in want if p not in resident]
    for _ in range(max(0, len(order) + len(misses) - capacity)):
      key = functools.partial(evict_first, t=t, at=at, m=m, order=order)
      order.remove(min((p for p in order if p not in wset), key=key))
    for p in order:
      freq[p] = alpha * freq[p] + (1.0 if p in wset else 0.0)
    for p in misses:
      freq[p] = 1.0
    order = lru_order(order, want, resident)
    out.append(len(misses))
  return out


def make_ranks(sel, seed, extra=10, num_pos=64):
  """Rows that start with the selection (shuffled) and go on with other positions."""
  rng = np.random.default_rng(seed)
  ranks = np.full(sel.shape[:-1] + (sel.shape[-1] + extra,), -1, np.int64)
  for idx in np.ndindex(*sel.shape[:-1]):
    row = sel[idx][sel[idx] >= 0]
    rest = rng.permutation(np.setdiff1d(np.arange(num_pos), row))[:extra]
    ranks[idx][:row.size + rest.size] = np.concatenate([rng.permutation(row), rest])
  return ranks


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


NEW_ORACLES = {"clock": clock_oracle, "sieve": sieve_oracle, "2q": twoq_oracle,
               "arc": arc_oracle}


@pytest.mark.parametrize("policy", sorted(NEW_ORACLES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 18, 24])
def test_queue_policies_match_oracles(policy, seed, capacity):
  sel = make_trace(seed + 90, k=12, num_pos=48)
  want = [NEW_ORACLES[policy](s, capacity) for s in sel]
  np.testing.assert_array_equal(replay(sel, capacity, policy), want)


@pytest.mark.parametrize("kind", ["lru2", "freq", "score"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 18, 24])
def test_ranked_policies_match_oracles(kind, seed, capacity):
  sel = make_trace(seed + 100, k=12, num_pos=48)
  want = [ranked_oracle(s, capacity, kind, 0.85) for s in sel]
  np.testing.assert_array_equal(
      replay(sel, capacity, kind, alpha=0.85, score_alpha=0.85), want)


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_decay_parameters_match_oracles(seed, alpha):
  sel = make_trace(seed + 110, k=12, num_pos=48)
  scores = np.random.default_rng(seed).random(sel.shape)
  for kind, kw in (("freq", dict(alpha=alpha)),
                   ("score", dict(score_alpha=alpha, scores=scores))):
    want = [ranked_oracle(s, 18, kind, alpha, kw.get("scores", [None] * 3)[i])
            for i, s in enumerate(sel)]
    np.testing.assert_array_equal(replay(sel, 18, kind, **kw), want, kind)


@pytest.mark.parametrize("kin, kout", [(0.1, 0.25), (0.5, 1.0)])
def test_2q_sizes_match_oracle(kin, kout):
  sel = make_trace(120, k=12, num_pos=48)
  want = [twoq_oracle(s, 18, kin, kout) for s in sel]
  np.testing.assert_array_equal(replay(sel, 18, "2q", twoq_in=kin, twoq_out=kout),
                                want)


def twoq_textbook(requests, capacity, kin, kout):
  """2Q as Johnson & Shasha (VLDB'94) give it, one request at a time: misses."""
  a1in, am, a1out, out = [], [], [], []
  for x in requests:
    if x in am:
      am.remove(x)
      am.append(x)
      out.append(0)
      continue
    if x in a1in:
      out.append(0)
      continue
    ghost = x in a1out  # admitted to Am (and no longer a ghost), else to A1in
    if ghost:
      a1out.remove(x)
    if len(a1in) + len(am) >= capacity:  # reclaimfor(x)
      if len(a1in) > kin or not am:
        a1out.append(a1in.pop(0))
        del a1out[:-kout]
      else:
        am.pop(0)
    (am if ghost else a1in).append(x)
    out.append(1)
  return out


@pytest.mark.parametrize("capacity", [4, 8, 16])
def test_2q_with_one_request_a_step_is_the_papers(capacity):
  """With k = 1 the step's admissions are one at a time, so the replay must be the
  paper's algorithm exactly (its reclaim takes from A1in when |A1in| > Kin)."""
  rng = np.random.default_rng()
  streams = rng.integers(0, 3 * capacity, (6, 300))  # hot and cold positions mixed
  streams = np.where(rng.random(streams.shape) < 0.5, streams % capacity, streams)
  kin, kout = max(1, round(0.25 * capacity)), max(1, round(0.5 * capacity))
  got = replay(streams[:, :, None].astype(np.int32), capacity, "2q", twoq_in=0.25,
               twoq_out=0.5)
  for s, stream in enumerate(streams):
    np.testing.assert_array_equal(got[s], twoq_textbook(stream.tolist(), capacity, kin,
                                                        kout), err_msg=f"stream {s}")


def arc_textbook(requests, c):
  """ARC as FAST'03's Figure 4 lists it, one request at a time (lists LRU first)."""
  t1, t2, b1, b2, p, out = [], [], [], [], 0.0, []

  def replace(x):
    if t1 and (len(t1) > p or (x in b2 and len(t1) == p)):
      b1.append(t1.pop(0))
    else:
      b2.append(t2.pop(0))

  for x in requests:
    if x in t1 or x in t2:  # case I
      (t1 if x in t1 else t2).remove(x)
      t2.append(x)
      out.append(0)
      continue
    out.append(1)
    if x in b1:  # case II
      p = min(c, p + max(len(b2) / len(b1), 1.0))
      replace(x)
      b1.remove(x)
      t2.append(x)
    elif x in b2:  # case III
      p = max(0.0, p - max(len(b1) / len(b2), 1.0))
      replace(x)
      b2.remove(x)
      t2.append(x)
    else:  # case IV
      if len(t1) + len(b1) == c:
        if len(t1) < c:
          b1.pop(0)
          replace(x)
        else:
          t1.pop(0)
      elif len(t1) + len(b1) + len(t2) + len(b2) >= c:
        if len(t1) + len(b1) + len(t2) + len(b2) == 2 * c:
          b2.pop(0)
        replace(x)
      t1.append(x)
  return out


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_arc_with_one_request_a_step_is_the_papers(capacity):
  """At k = 1 the replay is FAST'03's ARC exactly, its |T1| == p rule for a B2 miss
  included (dropped before: capacity 3, ``0 0 1 2 3 1 2 0 1`` took 8 misses for
  the paper's 7)."""
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  streams = rng.integers(0, 3 * capacity + 1, (8, 300))
  streams = np.where(rng.random(streams.shape) < 0.5, streams % (capacity + 1), streams)
  streams[0, :9] = [0, 0, 1, 2, 3, 1, 2, 0, 1]
  got = replay(streams[:, :, None].astype(np.int32), capacity, "arc")
  for s, stream in enumerate(streams):
    np.testing.assert_array_equal(got[s], arc_textbook(stream.tolist(), capacity),
                                  err_msg=f"seed {seed}, stream {s}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 18, 24])
def test_rank_matches_oracle(seed, capacity):
  sel = make_trace(seed + 150, k=12, num_pos=64)
  ranks = make_ranks(sel, seed)
  for rank_freq in (0.0, 0.3, 2.0):
    want = [rank_oracle(s, r, capacity, rank_freq, 0.85) for s, r in zip(sel, ranks)]
    np.testing.assert_array_equal(
        replay(sel, capacity, "rank", ranks=ranks, rank_freq=rank_freq, alpha=0.85),
        want, f"rank_freq={rank_freq}")
  # Default ranks: the selection's own row order.
  np.testing.assert_array_equal(replay(sel, capacity, "rank"),
                                [rank_oracle(s, s, capacity, 0.3) for s in sel])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 18])
def test_foresight_matches_oracle_and_spans_rank_to_belady(seed, capacity):
  sel = make_trace(seed + 155, k=12, num_pos=48)
  ranks = make_ranks(sel, seed, num_pos=48)
  for horizon in (1, 3):
    want = [rank_oracle(s, r, capacity, 0.3, foresight=horizon)
            for s, r in zip(sel, ranks)]
    np.testing.assert_array_equal(
        replay(sel, capacity, "foresight", ranks=ranks, foresight=horizon), want,
        f"foresight={horizon}")
  np.testing.assert_array_equal(replay(sel, capacity, "foresight", ranks=ranks,
                                       foresight=0),
                                replay(sel, capacity, "rank", ranks=ranks))
  np.testing.assert_array_equal(replay(sel, capacity, "foresight", ranks=ranks,
                                       foresight=sel.shape[-2]),
                                replay(sel, capacity, "belady"))
  totals = [replay(sel, capacity, "foresight", ranks=ranks, foresight=h).sum()
            for h in (0, 2, 8, sel.shape[-2])]
  assert totals[0] > totals[-1]  # the trace leaves a gap to close


def test_foresight_bad_horizon_raises():
  sel = make_trace(175, batch=(2,), steps=5, k=4)
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="foresight"):
      replay(sel, 8, "foresight", foresight=bad)


def test_rank_is_causal_in_its_ranks():
  sel = make_trace(160, batch=(3,), k=12)
  ranks = make_ranks(sel, 1)
  other = ranks.copy()
  other[:, 25:] = ranks[:, 25:, ::-1]
  np.testing.assert_array_equal(replay(sel, 16, "rank", ranks=ranks)[:, :25],
                                replay(sel, 16, "rank", ranks=other)[:, :25])


def test_rank_bad_ranks_raise():
  sel = make_trace(170, batch=(2,), steps=5, k=4)
  with pytest.raises(ValueError, match="leading"):
    replay(sel, 8, "rank", ranks=np.zeros((2, 4, 6), np.int64))
  with pytest.raises(ValueError, match="twice"):
    replay(sel, 8, "rank", ranks=np.zeros((2, 5, 6), np.int64))
  with pytest.raises(ValueError, match="rank_freq"):
    replay(sel, 8, "rank", rank_freq=-1.0)


def test_score_causal_with_explicit_scores():
  sel = make_trace(130, batch=(3,), k=12)
  scores = np.random.default_rng(0).random(sel.shape)
  other = scores.copy()
  other[:, 25:] = 1.0 - other[:, 25:]
  full = replay(sel, 16, "score", scores=scores)
  np.testing.assert_array_equal(full[:, :25],
                                replay(sel, 16, "score", scores=other)[:, :25])


def test_score_default_is_row_order():
  sel = make_trace(140, batch=(3,), k=12)
  rank = np.broadcast_to(1.0 - np.arange(12) / 12, sel.shape)
  np.testing.assert_array_equal(replay(sel, 18, "score"),
                                replay(sel, 18, "score", scores=rank))


@pytest.mark.parametrize("kw, match", [
    (dict(scores=np.zeros((2, 3))), "shape"),
    (dict(scores=-np.ones((2, 2))), ">= 0"),
    (dict(scores=np.full((2, 2), np.nan)), "finite"),
    (dict(alpha=1.5), "alpha"),
    (dict(twoq_in=0.0), "twoq_in"),
])
def test_bad_policy_arguments_raise(kw, match):
  with pytest.raises(ValueError, match=match):
    replay(np.array([[0, 1], [2, 3]]), 2, "score", **kw)


@pytest.mark.parametrize("policy", ["freq", "2q", "lru"])
def test_bad_parameters_raise_for_every_policy(policy):
  with pytest.raises(ValueError, match="twoq_out"):
    replay(np.array([[0, 1]]), 2, policy, twoq_out=1.5)
  with pytest.raises(ValueError, match="score_alpha"):
    replay(np.array([[0, 1]]), 2, policy, score_alpha=-0.1)


def test_synthetic_trace_is_a_valid_trace():
  sel, scores = synthetic_trace(3, streams=2, steps=20, k=32, context=1024, facts=64)
  assert sel.shape == scores.shape == (2, 20, 32)
  srt = np.sort(sel, axis=-1)
  assert (srt[..., 1:] > srt[..., :-1]).all() and (sel >= 0).all()
  assert (sel < 1024 - 20 + np.arange(20)[:, None]).all()  # newest never selected
  assert (sel[..., :4] < 4).all()  # sinks first, every step
  np.testing.assert_allclose(scores.sum(-1), 1.0)
  assert (np.diff(scores, axis=-1) <= 0).all()  # best first
  np.testing.assert_array_equal(synthetic_trace(3, streams=2, steps=20, k=32,
                                                context=1024, facts=64)[0], sel)
  # A window wider than 128 (k = 512: up to 192) once reached into the pool of
  # facts and noise: rows repeated positions.
  wide, _ = synthetic_trace(0, streams=2, steps=8, k=512, context=8192, facts=1024)
  srt = np.sort(wide, axis=-1)
  assert (srt[..., 1:] > srt[..., :-1]).all()


def test_compare_policies_pools_traces_and_measures_the_gap():
  a = make_trace(150, batch=(2,), k=12)
  b = make_trace(151, batch=(3,), steps=30, k=8)
  scores = np.random.default_rng(0).random(b.shape)
  policies = ["lru", "belady", "fifo", "score"]
  rows = compare_policies([a, (b, scores)], [18, 1.5], policies)
  assert [(r["policy"], r["capacity"]) for r in rows] == [
      (p, c) for c in (18, 1.5) for p in policies]
  valid = (a >= 0).sum() + (b >= 0).sum()
  for r in rows:
    size_b = 18 if r["capacity"] == 18 else 12  # 1.5 * k with k = 8
    kw = dict(scores=scores) if r["policy"] == "score" else {}
    misses = (replay(a, 18, r["policy"]).sum()
              + replay(b, size_b, r["policy"], **kw).sum())
    assert r["miss_rate"] == pytest.approx(misses / valid)
  for cap in (18, 1.5):
    got = {r["policy"]: r for r in rows if r["capacity"] == cap}
    assert got["lru"]["gap_closed"] == 0.0 and got["belady"]["gap_closed"] == 1.0
    lru, opt = got["lru"]["miss_rate"], got["belady"]["miss_rate"]
    assert got["fifo"]["gap_closed"] == pytest.approx(
        (lru - got["fifo"]["miss_rate"]) / (lru - opt))
  # A learned key with bounded history: its parameters reach it, not the gap's
  # ends (they were passed to LRU and Belady too, which refuse ``history``).
  key = linear_key(5)
  ranks = make_ranks(a, 5)
  (row,) = compare_policies([(a, None, ranks)], [18], [LEARNED], key_fn=key, history=4)
  want = replay(a, 18, LEARNED, ranks=ranks, key_fn=key, history=4).sum()
  assert row["miss_rate"] == pytest.approx(want / (a >= 0).sum())


# ---------------------------------------------------------- learned key --


def learned_oracle(stream, ranks, capacity, key_fn, alpha=0.9, log=None, num_pos=64,
                   history=None, drafted=None):
  """learned: evict the resident, unrequested entries with the smallest
  key_fn(features) (LEARNED_FEATURES from their definitions, on dicts), ties by
  LRU position; ``log`` gets (t, position, features, steps to its next request)
  of every candidate. ``history`` G: a miss on a position not among the last G
  evicted ones forgets its history first. ``drafted``: rows of positions the
  draft names at each step (None: none)."""
  order, out, top, churn, evicted = [], [], 0, 0.0, []
  last, count, ema, prev_rank, fetched, hits = {}, {}, {}, {}, {}, {}
  rank_ema, ranked_freq = [1.0] * num_pos, [0.0] * num_pos
  rows = [[int(p) for p in row if p >= 0] for row in stream]
  for t, (want, ranked) in enumerate(zip(rows, ranks)):
    m = len(ranked)
    at = {int(p): r for r, p in enumerate(ranked) if p >= 0}
    top = max([top, *want])
    for p in range(num_pos):
      rank_ema[p] = 0.5 * rank_ema[p] + 0.5 * (at.get(p, m) / m)
      ranked_freq[p] = alpha * ranked_freq[p] + (p in at)
    wset, resident = set(want), set(order)
    misses = [p for p in want if p not in resident]

    def feats(p):
      since = t - last[p]
      return np.array([at.get(p, m) / m, prev_rank.get(p, 1.0),
                       ema[p] * alpha ** since, np.log1p(since), np.log1p(count[p]),
                       np.log1p(t - fetched[p]), np.log1p(hits[p]), p / (top + 1.0),
                       rank_ema[p], ranked_freq[p], churn,
                       float(drafted is not None and p in set(drafted[t].tolist()))])

    ghosts = set(evicted[-history:]) if history else set()  # before this step evicts
    cands = [p for p in order if p not in wset]
    keys = {p: float(key_fn(feats(p))) for p in cands}
    if log is not None:
      for p in cands:
        later = [u for u in range(t + 1, len(rows)) if p in rows[u]]
        log.append((t, p, feats(p), (later[0] if later else len(rows)) - t))
    for _ in range(max(0, len(order) + len(misses) - capacity)):
      cand = [p for p in order if p not in wset]
      victim = min(cand, key=lambda p: (keys[p], order.index(p)))
      order.remove(victim)
      evicted.append(victim)
    if history is not None:
      for p in misses:
        if p not in ghosts:
          for table in (last, count, ema):
            table.pop(p, None)
          # As first seen now: the EMAs from their start, this step's ranking in.
          rank_ema[p], ranked_freq[p] = 0.5 + 0.5 * at.get(p, m) / m, float(p in at)
    for p in want:
      ema[p] = (ema[p] * alpha ** (t - last[p]) if p in count else 0.0) + 1.0
      count[p] = count.get(p, 0) + 1
      last[p] = t
      if p in resident:
        hits[p] += 1
      else:
        fetched[p], hits[p] = t, 0
    prev_rank = {p: r / m for p, r in at.items()}
    churn = CHURN_DECAY * churn + (1 - CHURN_DECAY) * len(misses) / len(stream[t])
    order = lru_order(order, want, resident)
    out.append(len(misses))
  return out


def linear_key(seed):
  """A key that mixes every feature with random signs (elementwise, so the scalar
  oracle and the batched replay round alike)."""
  w = np.random.default_rng(seed).normal(size=len(LEARNED_FEATURES))
  return lambda f: sum(w[i] * f[..., i] for i in range(len(w)))


def make_drafted(sel, seed, num_pos=64):
  """Draft picks: per step, the next step's row (a right draft) or other positions
  (a wrong one), a different width than the selections, -1 padding."""
  rng = np.random.default_rng(seed)
  nxt = np.concatenate([sel[..., 1:, :], np.full_like(sel[..., :1, :], -1)], axis=-2)
  other = make_trace(seed + 700, batch=sel.shape[:-2], steps=sel.shape[-2],
                     k=sel.shape[-1], num_pos=num_pos)
  right = rng.random(sel.shape[:-1] + (1,)) < 0.5
  return np.concatenate([np.where(right, nxt, other),
                         np.full(sel.shape[:-1] + (3,), -1)], axis=-1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", [12, 18])
def test_learned_matches_oracle(seed, capacity):
  sel = make_trace(seed + 180, k=12, num_pos=64)
  ranks = make_ranks(sel, seed)
  key_fn = linear_key(seed)
  want = [learned_oracle(s, r, capacity, key_fn, 0.8) for s, r in zip(sel, ranks)]
  np.testing.assert_array_equal(
      replay(sel, capacity, LEARNED, ranks=ranks, key_fn=key_fn, alpha=0.8), want)
  # With a draft's next-step picks (the "drafted" feature: its weight moves the keys).
  drafted = make_drafted(sel, seed)
  want = [learned_oracle(s, r, capacity, key_fn, 0.8, drafted=d)
          for s, r, d in zip(sel, ranks, drafted)]
  got = replay(sel, capacity, LEARNED, ranks=ranks, key_fn=key_fn, alpha=0.8,
               drafted=drafted)
  np.testing.assert_array_equal(got, want)


def test_the_drafted_feature_is_checked_and_read_at_its_step():
  """``drafted`` is validated as ranks are, belongs to the learned policy, and a key
  that reads it needs it. A key on the feature alone, given the next step's own
  selection as the draft, keeps what the next step requests: it misses less than
  with the draft one step late."""
  sel = make_trace(260, k=12, num_pos=64)
  ranks = make_ranks(sel, 1)
  key = lambda f: f[..., LEARNED_FEATURES.index("drafted")]
  nxt = np.concatenate([sel[..., 1:, :], np.full_like(sel[..., :1, :], -1)], axis=-2)
  late = np.concatenate([np.full_like(sel[..., :1, :], -1), sel[..., :-1, :]], axis=-2)
  now = replay(sel, 14, LEARNED, ranks=ranks, key_fn=key, drafted=nxt).sum()
  assert now < replay(sel, 14, LEARNED, ranks=ranks, key_fn=key, drafted=late).sum()
  bad = [(nxt.astype(float), "integer"), (nxt[..., :-1, :], "leading dims"),
         (np.where(nxt == nxt[..., :1], -2, nxt), ">= 0 or -1"),
         (np.concatenate([nxt, nxt[..., :1]], -1), "twice in a drafted row")]
  for drafted, match in bad:
    with pytest.raises(ValueError, match=match):
      replay(sel, 14, LEARNED, ranks=ranks, key_fn=key, drafted=drafted)
  with pytest.raises(ValueError, match="drafted needs policy"):
    replay(sel, 14, "rank", ranks=ranks, drafted=nxt)
  key.uses = ("drafted",)
  with pytest.raises(ValueError, match="pass drafted"):
    replay(sel, 14, LEARNED, ranks=ranks, key_fn=key)


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("history", [0, 3, 20])
def test_learned_with_bounded_history_matches_oracle(seed, history):
  sel = make_trace(seed + 210, k=12, num_pos=64)
  ranks = make_ranks(sel, seed)
  key_fn = linear_key(seed + 1)
  want = [learned_oracle(s, r, 14, key_fn, 0.8, history=history)
          for s, r in zip(sel, ranks)]
  got = replay(sel, 14, LEARNED, ranks=ranks, key_fn=key_fn, alpha=0.8, history=history)
  np.testing.assert_array_equal(got, want)
  # The bound matters on this trace (a position's first entry forgets its ranking
  # history even under a bound past every eviction: nothing tracked it before).
  if history == 0:
    assert (got != replay(sel, 14, LEARNED, ranks=ranks, key_fn=key_fn, alpha=0.8)).any()


def test_learned_history_needs_the_learned_policy_and_a_count():
  sel = make_trace(230, k=12, num_pos=64)
  for policy, history in (("rank", 4), (LEARNED, -1), (LEARNED, 2.5), (LEARNED, True)):
    with pytest.raises(ValueError, match="history"):
      replay(sel, 14, policy, key_fn=linear_key(0), history=history)


def test_learned_collects_the_candidates_and_their_next_request():
  sel = make_trace(190, batch=(2,), k=12, num_pos=48)
  ranks = make_ranks(sel, 3, num_pos=48)
  key_fn, got = linear_key(7), []

  def collect(t, feats, cand, reuse_in):
    for s, b in zip(*np.nonzero(cand)):
      got.append((s, t, feats[s, b].copy(), int(reuse_in[s, b])))

  replay(sel, 14, LEARNED, ranks=ranks, key_fn=key_fn, collect=collect)
  for s in range(2):
    log = []
    learned_oracle(sel[s], ranks[s], 14, key_fn, log=log, num_pos=48)
    rel = LEARNED_FEATURES.index("rel_pos")
    mine = sorted(((t, f, d) for g, t, f, d in got if g == s),
                  key=lambda e: (e[0], e[1][rel]))  # by (step, rel_pos): one order
    want = sorted(((t, f, d) for t, _, f, d in log), key=lambda e: (e[0], e[1][rel]))
    assert len(mine) == len(want) > 0
    for (t, f, d), (t2, f2, d2) in zip(mine, want):
      assert (t, d) == (t2, d2)
      np.testing.assert_array_equal(f, f2)


def test_collected_samples_are_grouped_by_eviction():
  """``learned_policy.collect``'s groups are each one stream's candidates at one
  step, numbered in (step, stream) order: with room for every candidate, each
  group holds exactly what the replay offered there (features and reuse)."""
  from experiments.analysis import learned_policy as lp
  seed = int(np.random.default_rng().integers(1 << 30))
  sel = make_trace(seed, batch=(3,), k=8, num_pos=40)
  ranks = make_ranks(sel, 3, num_pos=40)
  key_fn, offered = linear_key(seed % 97), []

  def record(t, feats, cand, reuse_in):
    for s in range(cand.shape[0]):
      if cand[s].any():
        offered.append(sorted((int(reuse_in[s, b]), feats[s, b].astype(np.float32).tobytes())
                              for b in np.flatnonzero(cand[s])))

  replay(sel, 12, LEARNED, ranks=ranks, key_fn=key_fn, collect=record)
  got = lp.collect(sel, ranks, 12, key_fn, per_step=12, seed=seed)
  assert got.group[0] == 0 and (np.diff(got.group) >= 0).all(), seed
  assert (np.unique(got.group) == np.arange(len(offered))).all(), seed
  for g, want in enumerate(offered):
    these = got.group == g
    assert sorted(zip(got.reuse_in[these].tolist(),
                      (f.tobytes() for f in got.features[these]))) == want, (seed, g)
    assert len(set(got.steps_left[these].tolist())) == 1, (seed, g)
  both = lp.Samples.concatenate([got, got])
  np.testing.assert_array_equal(both.group, np.r_[got.group, got.group + len(offered)])
  np.testing.assert_array_equal(both.reuse_in, np.r_[got.reuse_in, got.reuse_in])


def test_pairwise_key_orders_each_eviction_as_belady_would(tmp_path):
  """train(loss="pairwise") on ragged groups whose reuse distances two features
  decide (censored at the trace's end): within each group it keys the sooner reuse
  higher, on the pairs the discount weighs; the group layout and the pair weights
  match brute force; the loss is saved with the model."""
  from experiments.analysis import learned_policy as lp
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  num_groups, most = 300, 16
  sizes = rng.integers(1, most + 1, num_groups)
  group = np.repeat(np.arange(num_groups), sizes)
  feats = rng.random((group.size, len(LEARNED_FEATURES)))
  rank, since = (feats[:, LEARNED_FEATURES.index(n)] for n in ("rank_now", "since_request"))
  left = np.repeat(rng.integers(10, 60, num_groups), sizes)
  reuse = np.minimum(1 + np.floor(40 * (rank + 0.5 * since)), left).astype(np.int32)

  rows = lp.padded_groups(group)
  want = np.full((num_groups, most), -1)
  for g in range(num_groups):
    members = np.flatnonzero(group == g)
    want[g, :members.size] = members
  np.testing.assert_array_equal(rows, want[:, :rows.shape[1]])
  assert (want[:, rows.shape[1]:] == -1).all() and rows.shape[1] == sizes.max()

  valid = rows >= 0
  d = np.where(valid, reuse[rows], 0)
  weights = np.asarray(lp.pair_weights(d, valid, 8))
  brute = np.zeros(weights.shape)
  for g, i, j in np.ndindex(*weights.shape):
    if valid[g, i] and valid[g, j] and d[g, i] < d[g, j]:
      brute[g, i, j] = np.exp(-d[g, i] / 8) - np.exp(-d[g, j] / 8)
  np.testing.assert_allclose(weights, brute, rtol=1e-5, atol=1e-7)
  assert ((weights > 0) == (brute > 0)).all(), seed

  model = lp.train(lp.Samples(feats, reuse, left, group), 8, steps=300, seed=seed % 7)
  key = model(feats)
  keys = np.where(valid, key[rows], 0.0)
  right = (keys[:, :, None] > keys[:, None, :]) & (brute > 0)
  accuracy = (brute * right).sum() / brute.sum()
  assert accuracy > 0.97, (seed, accuracy)
  model.save(tmp_path / "pairwise.npz")
  again = lp.KeyModel.load(tmp_path / "pairwise.npz")
  assert (again.loss, again.horizon) == ("pairwise", 8)
  np.testing.assert_array_equal(again(feats), key)
  with pytest.raises(ValueError, match="too few"):  # one candidate per group
    lp.train(lp.Samples(feats, reuse, left, np.arange(group.size)), 8, steps=1)


def test_learned_is_causal_and_needs_a_key():
  """A trace that changes from step 25 on changes nothing before it: not the
  misses, and not what each eviction sees (the features and candidates ``collect``
  gets, with and without a bounded history); only the labels (steps to the next
  request) may differ there."""
  sel = make_trace(200, batch=(3,), k=12)
  ranks = make_ranks(sel, 2)
  other, other_ranks = sel.copy(), ranks.copy()
  other[:, 25:] = make_trace(201, batch=(3,), steps=15, k=12)
  other_ranks[:, 25:] = ranks[:, 25:, ::-1]
  key_fn = linear_key(1)
  for history in (None, 5):
    seen = []
    for trace, trace_ranks in ((sel, ranks), (other, other_ranks)):
      steps = {}
      misses = replay(trace, 16, LEARNED, ranks=trace_ranks, key_fn=key_fn,
                      history=history,
                      collect=lambda t, f, c, r, steps=steps: steps.setdefault(
                          t, (f.copy(), c.copy(), r.copy())))
      seen.append((misses[:, :25], steps))
    np.testing.assert_array_equal(seen[0][0], seen[1][0])
    before = sorted(t for t in seen[0][1] if t < 25)
    assert len(before) > 5 and before == sorted(t for t in seen[1][1] if t < 25)
    relabeled = 0
    for t in before:
      (f0, c0, r0), (f1, c1, r1) = seen[0][1][t], seen[1][1][t]
      np.testing.assert_array_equal(f0, f1, err_msg=f"features at step {t}")
      np.testing.assert_array_equal(c0, c1, err_msg=f"candidates at step {t}")
      relabeled += int((r0 != r1)[c0].any())
    assert relabeled > 0  # the future did change: the labels see it
  with pytest.raises(ValueError, match="key_fn"):
    replay(sel, 16, LEARNED)
  with pytest.raises(ValueError, match="finite keys"):
    replay(sel, 16, LEARNED, key_fn=lambda f: f[..., 0] / 0.0)


def test_learned_key_fits_a_learnable_rule_and_round_trips(tmp_path):
  """train(loss="binary") on labels that a threshold of two features decides: its
  logit ranks them (AUC ~1), the saved model gives the same keys, a model trained
  on other features is refused, and so are one-class labels."""
  from experiments.analysis import learned_policy as lp
  rng = np.random.default_rng(0)
  feats = rng.random((6000, len(LEARNED_FEATURES)))
  rank, since = (feats[:, LEARNED_FEATURES.index(n)] for n in ("rank_now", "since_request"))
  reuse_in = np.where(rank + 0.5 * since < 0.7, 2, 40)  # reused soon iff low rank, recent

  def samples(features, reuse, left):
    return lp.Samples(features, reuse, left, np.arange(len(reuse)) // 32)

  model = lp.train(samples(feats, reuse_in, np.full(6000, 100)), 4, loss="binary",
                   steps=300)
  key = model(feats)
  soon = reuse_in <= 4
  auc = (key[soon][:, None] > key[~soon][None, :]).mean()
  assert auc > 0.99, auc
  model.save(tmp_path / "key.npz")
  again = lp.KeyModel.load(tmp_path / "key.npz")
  np.testing.assert_array_equal(again(feats), key)
  assert again.history is None and again.loss == "binary"
  dataclasses.replace(model, history=7).save(tmp_path / "bounded.npz")
  assert lp.KeyModel.load(tmp_path / "bounded.npz").history == 7
  slot = lp.train(samples(feats, reuse_in, np.full(6000, 100)), 4, loss="binary",
                  steps=50, uses=lp.SLOT_FEATURES)
  assert slot.uses == lp.SLOT_FEATURES and slot(feats).shape == (6000,)
  np.savez(tmp_path / "other.npz", **{**dict(np.load(tmp_path / "key.npz")),
                                      "features": np.array(["a", "b"])})
  with pytest.raises(ValueError, match="trained on features"):
    lp.KeyModel.load(tmp_path / "other.npz")
  # A key saved before a feature was appended (the 11 before "drafted") still loads.
  np.savez(tmp_path / "older.npz", **{**dict(np.load(tmp_path / "key.npz")),
                                      "features": np.array(LEARNED_FEATURES[:-1])})
  older = lp.KeyModel.load(tmp_path / "older.npz")
  np.testing.assert_array_equal(older(feats), lp.KeyModel.load(tmp_path / "key.npz")(feats))
  np.savez(tmp_path / "reordered.npz", **{**dict(np.load(tmp_path / "key.npz")),
                                          "features": np.array(LEARNED_FEATURES[::-1])})
  with pytest.raises(ValueError, match="trained on features"):
    lp.KeyModel.load(tmp_path / "reordered.npz")
  with pytest.raises(ValueError, match="one class"):
    lp.train(samples(feats, np.full(6000, 2), np.full(6000, 100)), 4, loss="binary")
  # Unknown label (trace ends before the horizon, not reused): dropped, not negative.
  with pytest.raises(ValueError, match="too few"):
    lp.train(samples(feats[:300], reuse_in[:300], np.full(300, 3)), 4, loss="binary")
  # Never reused near the end: reuse_in == steps_left (T - t) is no reuse, even
  # within the horizon. Those samples are unknown, so only the earlier ones, all
  # negative, are left: one class.
  left = np.where(np.arange(6000) < 3000, 3, 100)
  with pytest.raises(ValueError, match="one class"):
    lp.train(samples(feats, left, left), 4, loss="binary")
  with pytest.raises(ValueError, match="loss="):
    lp.train(samples(feats, reuse_in, np.full(6000, 100)), 4, loss="hinge")
