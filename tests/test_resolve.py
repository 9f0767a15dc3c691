"""RESOLVE (XLA reference and Pallas kernel) against the numpy oracle, invariants,
hand-worked cases and bad input."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvtier_jax.policies import PolicyConfig
from kvtier_jax.resolve import install_newest, resolve, resolve_with_policy
from tests.oracles import resolve_oracle

IMPLS = ["xla", "pallas"]  # pallas runs in interpret mode on CPU
# XLA membership lookups (identical results by contract); "map" with a position bound.
LOOKUPS = [dict(lookup_method="search"), dict(lookup_method="map", num_positions=6 * 40)]


def random_selection(rng, batch, num_sel, newest, pad_prob=0.1, local=True):
  """Distinct positions in [0, newest] with locality, some padding, newest often."""
  sel = np.full(batch + (num_sel,), -1, np.int32)
  for idx in np.ndindex(*batch):
    top = int(newest[idx])
    n = min(num_sel, top + 1)
    if local:
      centre = rng.integers(0, top + 1)
      pool = np.arange(max(0, centre - 2 * num_sel), min(top + 1, centre + 2 * num_sel))
    else:
      pool = np.arange(top + 1)
    picks = rng.choice(pool, size=min(n, len(pool)), replace=False)
    if rng.random() < 0.5:
      picks[0] = top  # the newest position
      picks = np.unique(picks)
    row = np.full(num_sel, -1, np.int32)
    row[:len(picks)] = picks
    row[rng.random(num_sel) < pad_prob] = -1
    sel[idx] = rng.permutation(row)
  return sel


def check_invariants(before_pos, out, selected, newest):
  slot_pos, lru, slot, is_miss = (np.asarray(x) for x in out)
  num_slots = slot_pos.shape[-1]
  assert (np.sort(lru, -1) == np.arange(num_slots)).all(), "lru is not a permutation"
  for idx in np.ndindex(*slot_pos.shape[:-1]):
    held = slot_pos[idx][slot_pos[idx] >= 0]
    assert len(np.unique(held)) == len(held), "a position is held twice"
    for p, s, m in zip(selected[idx], slot[idx], is_miss[idx]):
      if p < 0:
        assert s == -1 and not m
      elif p == newest[idx]:
        assert s == num_slots and not m
      else:
        assert slot_pos[idx][s] == p, "selected position not where resolve says"
        assert m == (p not in before_pos[idx]), "miss flag disagrees with residency"
    # A slot that held a selected position keeps it (hits are never evicted).
    wanted = set(selected[idx][selected[idx] >= 0].tolist()) - {int(newest[idx])}
    for s, p in enumerate(before_pos[idx]):
      if p in wanted:
        assert slot_pos[idx][s] == p


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch,num_slots,num_sel,seed", [
    ((3,), 32, 16, 0), ((2, 2), 20, 20, 1), ((1, 3, 2), 24, 7, 2), ((4,), 40, 33, 3)])
def test_resolve_matches_oracle_over_many_steps(impl, batch, num_slots, num_sel, seed):
  rng = np.random.default_rng(seed)
  slot_pos = np.full(batch + (num_slots,), -1, np.int32)
  lru = np.broadcast_to(np.arange(num_slots, dtype=np.int32), slot_pos.shape).copy()
  steps = 12 if impl == "pallas" else 40
  for step in range(steps):
    newest = rng.integers(3 * num_slots, 6 * num_slots, size=batch).astype(np.int32)
    sel = random_selection(rng, batch, num_sel, newest, local=step % 3 != 0)
    want = resolve_oracle(slot_pos, lru, sel, newest)
    got = resolve(slot_pos, lru, sel, newest, impl=impl)
    for name, w, g in zip(("slot_pos", "lru", "slot", "is_miss"), want, got):
      np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name}, step {step}")
    check_invariants(slot_pos, got, sel, newest)
    slot_pos, lru = want[0], want[1]
  assert (slot_pos >= 0).any()


@pytest.mark.parametrize("lookup", LOOKUPS, ids=lambda d: d["lookup_method"])
def test_resolve_lookups_match_oracle(lookup):
  rng = np.random.default_rng()  # fresh draws each run
  batch, num_slots, num_sel = (2, 3), 40, 33
  slot_pos = np.full(batch + (num_slots,), -1, np.int32)
  lru = np.broadcast_to(np.arange(num_slots, dtype=np.int32), slot_pos.shape).copy()
  for step in range(20):
    newest = rng.integers(3 * num_slots, 6 * num_slots - 1, size=batch).astype(np.int32)
    sel = random_selection(rng, batch, num_sel, newest, local=step % 3 != 0)
    want = resolve_oracle(slot_pos, lru, sel, newest)
    got = resolve(slot_pos, lru, sel, newest, impl="xla", **lookup)
    for name, w, g in zip(("slot_pos", "lru", "slot", "is_miss"), want, got):
      np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name}, step {step}")
    slot_pos, lru = want[0], want[1]
  assert (slot_pos >= 0).any()


def test_position_table_and_its_lookup_match_numpy():
  """The map's two halves against dicts: keys past either end of the table
  (padding -1, or past ``P``) are dropped, queries past either end read ``fill``,
  and ``index_in``'s two methods agree with the brute-force index on queries in
  and out of range."""
  from kvtier_jax import lookup
  rng = np.random.default_rng()
  rows, width, num_positions, fill = (2, 3), 12, 20, -7
  keys = np.stack([rng.permutation(num_positions + 8)[:width] - 4
                   for _ in range(np.prod(rows))]).reshape(rows + (width,)).astype(np.int32)
  values = rng.integers(0, 100, size=keys.shape).astype(np.int32)
  queries = rng.integers(-3, num_positions + 4, size=rows + (15,)).astype(np.int32)
  table = np.asarray(lookup.position_table(jnp.asarray(keys), jnp.asarray(values),
                                           num_positions, fill))
  got = np.asarray(lookup.table_lookup(jnp.asarray(table), jnp.asarray(queries), fill))
  for r in np.ndindex(*rows):
    held = {int(p): int(x) for p, x in zip(keys[r], values[r]) if 0 <= p < num_positions}
    np.testing.assert_array_equal(
        table[r], [held.get(p, fill) for p in range(num_positions)])
    np.testing.assert_array_equal(got[r], [held.get(int(q), fill) for q in queries[r]])
  in_range = np.where((keys >= 0) & (keys < num_positions), keys, -1)
  want = np.array([[list(in_range[r]).index(q) if 0 <= q and q in in_range[r] else -1
                    for q in queries[r]] for r in np.ndindex(*rows)]).reshape(queries.shape)
  for method in ("map", "search"):
    np.testing.assert_array_equal(
        lookup.index_in(jnp.asarray(in_range), jnp.asarray(queries), method=method,
                        num_positions=num_positions), want, err_msg=method)


def test_repeated_keys_are_found_at_their_first_lane_by_both_methods():
  """Keys that repeat (a prediction, a ranking): ``index_in(repeats=True)``, and so
  ``duplicate_mask`` and ``rank_of``, answer with the first lane on both methods
  (the map's plain scatter kept whichever lane the backend wrote last)."""
  from kvtier_jax import lookup
  rng = np.random.default_rng()
  num_positions, width = 12, 10  # few positions: many repeats
  keys = rng.integers(-1, num_positions, size=(3, 4, width)).astype(np.int32)
  queries = rng.integers(-1, num_positions, size=(3, 4, 7)).astype(np.int32)
  first = lambda row, q: list(row).index(q) if q >= 0 and q in row else -1
  want = np.array([[first(keys[r], q) for q in queries[r]]
                   for r in np.ndindex(3, 4)]).reshape(queries.shape)
  dup = np.array([[k >= 0 and first(keys[r], k) != j for j, k in enumerate(keys[r])]
                  for r in np.ndindex(3, 4)]).reshape(keys.shape)
  rank = np.where(want >= 0, want, width)
  for method in ("map", "search"):
    args = dict(method=method, num_positions=num_positions)
    np.testing.assert_array_equal(lookup.index_in(keys, queries, repeats=True, **args),
                                  want, err_msg=method)
    np.testing.assert_array_equal(lookup.duplicate_mask(keys, **args), dup, err_msg=method)
    np.testing.assert_array_equal(lookup.rank_of(queries, keys, **args), rank,
                                  err_msg=method)


def test_map_lookup_needs_a_position_bound():
  with pytest.raises(ValueError, match="num_positions"):
    resolve([[1, -1]], [[0, 1]], [[1]], [3], lookup_method="map")
  with pytest.raises(ValueError, match="lookup"):
    resolve([[1, -1]], [[0, 1]], [[1]], [3], lookup_method="hash")


def test_map_lookup_refuses_positions_past_its_bound():
  """The map drops positions past ``num_positions``: a held one would read as a
  miss and be fetched into a second slot. Concrete inputs are checked."""
  args = (np.array([[100, 5, -1]]), np.array([[0, 1, 2]]), np.array([[100, 5]]),
          np.array([200]))
  for method in ("map", "auto", "search"):
    for bound in (64, 200):  # (200: the newest position equals it, outside)
      with pytest.raises(ValueError, match=f"outside num_positions={bound}"):
        resolve(*args, lookup_method=method, num_positions=bound)
  out = resolve(*args, lookup_method="map", num_positions=201)
  np.testing.assert_array_equal(out.is_miss, [[False, False]])


def test_a_non_finite_key_never_evicts_a_hit():
  """Keyed RESOLVE ranks the evictables by key with the hits at +inf: an evictable
  keyed +inf or NaN used to tie with the hits and take a hit's slot. Against the
  kernel and the oracle, random positions of the non-finite keys."""
  from pallas_kernels.cache_resolve import cache_resolve_reference
  rng = np.random.default_rng()
  for _ in range(20):
    held = rng.permutation(50)[:6]
    hits = rng.permutation(6)[:rng.integers(1, 4)]  # slots of the wanted positions
    key = rng.choice(np.array([np.inf, np.nan], np.float32), 6)  # every evictable
    key[hits] = rng.random(len(hits))
    lru = np.concatenate([hits[:1], rng.permutation(np.setdiff1d(np.arange(6), hits[:1]))])
    want = held[hits].tolist()  # a hit is least recently used: first in a tie
    selected = np.array(want + [60, 61], np.int32)
    out = cache_resolve_reference(jnp.asarray(held, jnp.int32), jnp.asarray(lru, jnp.int32),
                                  jnp.asarray(selected), jnp.int32(70), key=jnp.asarray(key))
    slot_pos = np.asarray(out.slot_pos)
    slots = np.asarray(out.slot)
    assert sorted(slots.tolist()) == sorted(set(slots.tolist())), (key, slots)
    for lane, pos in enumerate(want):  # each hit keeps its slot and its row
      assert slots[lane] == held.tolist().index(pos) and slot_pos[slots[lane]] == pos
    assert set(slot_pos.tolist()) >= set(selected.tolist())


def test_exported_kernels_refuse_fewer_slots_than_selections():
  from pallas_kernels.cache_resolve import cache_resolve, cache_resolve_reference
  args = (jnp.array([[1, 2]]), jnp.array([[0, 1]]), jnp.array([[1, 9, 3]]),
          jnp.array([10]))
  for fn in (cache_resolve_reference, lambda *a: cache_resolve(*a, interpret=True)):
    with pytest.raises(ValueError, match="B must be >= k"):
      fn(*args)


@given(st.sampled_from([1, 5, 12]), st.sampled_from([0, 3, 20]),
       st.integers(0, 2**31 - 1), st.sampled_from(["search", "map"]))
def test_resolve_property(num_sel, extra_slots, seed, lookup):
  rng = np.random.default_rng(seed)
  num_slots = num_sel + extra_slots
  slot_pos = np.full((2, num_slots), -1, np.int32)
  held = [rng.choice(60, size=rng.integers(0, num_slots + 1), replace=False)
          for _ in range(2)]
  for r, h in enumerate(held):
    slot_pos[r, rng.permutation(num_slots)[:len(h)]] = h
  lru = np.stack([rng.permutation(num_slots) for _ in range(2)]).astype(np.int32)
  newest = rng.integers(0, 60, size=2).astype(np.int32)
  sel = random_selection(rng, (2,), num_sel, newest, local=False)
  want = resolve_oracle(slot_pos, lru, sel, newest)
  got = resolve(slot_pos, lru, sel, newest, lookup_method=lookup, num_positions=60)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(g), w)
  check_invariants(slot_pos, got, sel, newest)


def test_resolve_hand_worked():
  # slots:        0   1   2   3      LRU (least recent first): [2, 0, 3, 1]
  slot_pos = [[10, 11, 12, -1]]
  lru = [[2, 0, 3, 1]]
  # Select 11 (hit, slot 1), 40 (newest -> slot B=4), 30 and 31 (misses).
  with pytest.raises(ValueError, match="B must be >= k"):
    resolve(slot_pos, lru, [[30, 11, 40, -1, 31]], [40])
  out = resolve(slot_pos, lru, [[30, 11, 40, 31]], [40])
  # Evictables in LRU order: 2, 0, 3. Misses 30 -> slot 2, 31 -> slot 0.
  np.testing.assert_array_equal(out.slot, [[2, 1, 4, 0]])
  np.testing.assert_array_equal(out.is_miss, [[True, False, False, True]])
  np.testing.assert_array_equal(out.slot_pos, [[31, 11, 30, -1]])
  # [untaken evictables] ++ [victims in miss order] ++ [hits]
  np.testing.assert_array_equal(out.lru, [[3, 2, 0, 1]])


def test_slot_holding_newest_is_not_a_hit():
  out = resolve([[5, 7]], [[0, 1]], [[7, 5]], [7])
  np.testing.assert_array_equal(out.slot, [[2, 0]])  # 7 -> reserved slot B=2
  np.testing.assert_array_equal(out.lru, [[1, 0]])  # slot 1 stays evictable


def test_install_newest_fills_lowest_empty_slot_as_mru():
  slot_pos = np.array([[0, 1, -1, -1], [4, 5, 6, 7]], np.int32)
  lru = np.array([[3, 0, 2, 1], [0, 1, 2, 3]], np.int32)
  new_pos, new_lru, target = install_newest(slot_pos, lru, np.array([2, 8], np.int32))
  np.testing.assert_array_equal(target, [2, -1])
  np.testing.assert_array_equal(new_pos, [[0, 1, 2, -1], [4, 5, 6, 7]])
  np.testing.assert_array_equal(new_lru, [[3, 0, 1, 2], [0, 1, 2, 3]])


@pytest.mark.parametrize("bad,match", [
    (dict(selected=[[1, 1, -1]]), "appears twice"),
    (dict(selected=[[1, 9, -1]]), "out of range"),
    (dict(selected=[[1, 6, -1]]), "out of range"),  # newest + 1: not written yet
    (dict(selected=[[1, -3, -1]]), "out of range"),
    (dict(lru=[[0, 0, 1, 2]]), "permutation"),
    (dict(slot_pos=[[1, 1, -1, -1]]), "held by two slots"),
    (dict(selected=[[1.0, 2.0, 3.0]]), "integer"),
    (dict(newest=[[5]]), "newest"),
    (dict(lru=[[0, 1, 2]]), "same shape"),
])
def test_resolve_rejects_bad_input(bad, match):
  args = dict(slot_pos=[[1, 2, -1, -1]], lru=[[0, 1, 2, 3]], selected=[[1, 3, -1]],
              newest=[5])
  args.update(bad)
  with pytest.raises(ValueError, match=match):
    resolve(np.asarray(args["slot_pos"]), np.asarray(args["lru"]),
            np.asarray(args["selected"]), np.asarray(args["newest"]))


def misses_of_keyed_resolve(step, streams, steps, slots):
  """Steps a jitted keyed RESOLVE from an empty cache in float64 (so its keys round
  like cache_sim's); ``step(slot_pos, lru, score, t) -> (out, score)``. Returns the
  misses per stream and step, i64[streams, steps]."""
  import jax
  with jax.enable_x64(True):
    slot_pos = np.full((streams, slots), -1, np.int32)
    lru = np.tile(np.arange(slots, dtype=np.int32), (streams, 1))
    score = np.zeros((streams, slots), np.float64)
    got = []
    for t in range(steps):
      out, score = step(slot_pos, lru, score, t)
      got.append(np.asarray(out.is_miss).sum(-1))
      slot_pos, lru = np.asarray(out.slot_pos), np.asarray(out.lru)
  return np.stack(got, 1)


def test_freq_policy_matches_cache_sim_replay():
  """The jitted frequency-aware RESOLVE evicts exactly as cache_sim's "freq"."""
  from experiments.analysis import cache_sim
  rng = np.random.default_rng(5)
  streams, steps, num_sel, slots = 5, 60, 10, 16
  sel = np.full((streams, steps, num_sel), -1, np.int64)
  for s, t in np.ndindex(streams, steps):
    row = rng.choice(np.arange(t, t + 30), num_sel, replace=False)
    row[rng.random(num_sel) < 0.1] = -1
    sel[s, t] = row
  want = cache_sim.replay(sel, slots, "freq", alpha=0.9)
  step = lambda slot_pos, lru, score, t: resolve_with_policy(
      PolicyConfig("freq", freq_alpha=0.9), slot_pos, lru, score,
      sel[:, t].astype(np.int32), np.full(streams, 10**6, np.int32))
  np.testing.assert_array_equal(misses_of_keyed_resolve(step, streams, steps, slots),
                                want)
  assert (want != cache_sim.replay(sel, slots, "lru")).any()  # the policy matters


@pytest.mark.parametrize("num_positions", [None, 64])  # search path, map path
def test_selection_errors_flags_duplicates_and_range(num_positions):
  from kvtier_jax.resolve import (STATUS_DUPLICATE, STATUS_OUT_OF_RANGE,
                                  selection_errors)
  rng = np.random.default_rng()
  for _ in range(100):  # both kinds of error present (1 draw in ~10^4 lacked one)
    rows, k = 40, 9
    newest = rng.integers(10, 60, rows).astype(np.int32)
    sel = np.stack([rng.choice(n + 1, k, replace=False) for n in newest]).astype(np.int32)
    sel[rng.random(sel.shape) < 0.2] = -1
    dup_rows = rng.random(rows) < 0.3
    for r in np.flatnonzero(dup_rows):  # copy one live entry over another
      live = np.flatnonzero(sel[r] >= 0)
      if len(live) >= 2:
        sel[r, live[1]] = sel[r, live[0]]
      else:
        dup_rows[r] = False
    far_rows = rng.random(rows) < 0.2
    sel[far_rows, 0] = newest[far_rows] + 1
    want = np.where(far_rows, STATUS_OUT_OF_RANGE, 0) | np.where(
        [len(set(r[r >= 0].tolist())) < (r >= 0).sum() for r in sel], STATUS_DUPLICATE, 0)
    if (want & STATUS_DUPLICATE).any() and (want & STATUS_OUT_OF_RANGE).any():
      break
  got = np.asarray(selection_errors(sel, newest, num_positions))
  np.testing.assert_array_equal(got, want)
  assert (want & STATUS_DUPLICATE).any() and (want & STATUS_OUT_OF_RANGE).any()


@pytest.mark.parametrize("num_positions", [None, 200])
def test_resident_mask_matches_membership(num_positions):
  from kvtier_jax.lookup import resident_mask
  rng = np.random.default_rng()
  slot_pos = np.stack([rng.choice(200, 16, replace=False) for _ in range(6)])
  slot_pos[rng.random(slot_pos.shape) < 0.25] = -1
  positions = rng.integers(-1, 200, (6, 12))
  want = np.array([[p >= 0 and p in set(s) for p in ps]
                   for s, ps in zip(slot_pos, positions)])
  got = resident_mask(jnp.asarray(slot_pos.reshape(2, 3, 16), jnp.int32),
                      jnp.asarray(positions.reshape(2, 3, 12), jnp.int32),
                      num_positions=num_positions)
  np.testing.assert_array_equal(np.asarray(got).reshape(6, 12), want)


@pytest.mark.parametrize("num_positions", [None, 128])  # search path, map path
def test_rank_policy_matches_cache_sim_replay(num_positions):
  """The jitted rank-aware RESOLVE evicts exactly as cache_sim's "rank"."""
  from experiments.analysis import cache_sim
  rng = np.random.default_rng()
  streams, steps, num_sel, slots, extra = 5, 50, 10, 16, 12
  sel = np.full((streams, steps, num_sel), -1, np.int64)
  ranks = np.full((streams, steps, num_sel + extra), -1, np.int64)
  for s, t in np.ndindex(streams, steps):
    pool = rng.permutation(np.arange(t, t + 40))
    row = pool[:num_sel].copy()
    row[rng.random(num_sel) < 0.1] = -1
    sel[s, t] = row
    ranks[s, t] = np.concatenate([row, pool[num_sel:num_sel + extra]])
  want = cache_sim.replay(sel, slots, "rank", ranks=ranks, rank_freq=0.3, alpha=0.9)
  newest = np.full(streams, 10**6 if num_positions is None else 127, np.int32)
  step = lambda slot_pos, lru, score, t: resolve_with_policy(
      PolicyConfig("rank", freq_alpha=0.9, rank_freq=0.3), slot_pos, lru, score,
      sel[:, t].astype(np.int32), newest, ranks[:, t].astype(np.int32),
      num_positions=num_positions)
  np.testing.assert_array_equal(misses_of_keyed_resolve(step, streams, steps, slots),
                                want)
  assert (want != cache_sim.replay(sel, slots, "lru")).any()  # the policy matters


def test_rank_of_both_paths_agree():
  from kvtier_jax.lookup import rank_of
  rng = np.random.default_rng()
  slot_pos = np.stack([rng.choice(100, 20, replace=False) for _ in range(4)])
  slot_pos[rng.random(slot_pos.shape) < 0.2] = -1
  ranks = np.stack([rng.choice(100, 30, replace=False) for _ in range(4)])
  ranks[:, -3:] = -1
  want = np.array([[list(r).index(p) if p >= 0 and p in r else 30 for p in s]
                   for s, r in zip(slot_pos, ranks)])
  for bound in (None, 100):
    got = rank_of(jnp.asarray(slot_pos, jnp.int32), jnp.asarray(ranks, jnp.int32),
                  num_positions=bound)
    np.testing.assert_array_equal(np.asarray(got), want)
