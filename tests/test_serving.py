"""The serving engine: scheduling, paging, preemption, sampling, bad input, and
exactness on SmolLM2 (tiered == sparse == the same request alone).

Most engine properties are checked against ``FakeModel``, a numpy model whose next
token is a pure function of the request's own sequence: any bookkeeping error of
the engine (a wrong token fed, a position skipped, one slot's state leaking into
another, a replay that re-samples) changes the tokens. The real model checks the
cache backends."""

import collections
import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvtier_jax.driver import StepRefused
from kvtier_jax.serving import Engine, EngineConfig, PagePool, SamplingParams, State
from kvtier_jax.serving import handoff as handoff_lib
from kvtier_jax.serving import sampling, snapshot
from kvtier_jax.serving.request import is_int
from tests.oracles import prompt_lookup_oracle

VOCAB = 64
POISON = VOCAB - 1  # FakeModel's logits turn NaN once this token is in a sequence


@dataclasses.dataclass
class FakeModel:
  """A ``ServingModel`` in numpy: logits hash the slot's whole sequence."""

  num_slots: int = 3
  max_len: int = 96
  chunk_size: int = 8
  page_size: int = 4
  num_host_pages: int = 40
  host_page_bytes: int = 100
  hot_slots: int = 12
  vocab_size: int = VOCAB

  def device_bytes(self, length):
    return 10 * length

  staging: int = 0  # device bytes of the prefill staging buffer

  def staging_bytes(self):
    return self.staging

  def host_pages(self, length):
    return 0 if length <= self.hot_slots else -(-length // self.page_size)

  supports_prefix_cache: bool = True

  def init(self):
    # "host pages": page -> {offset: token}, written by prefill and decode through
    # the page table, read back by load_prefix (a wrong or overwritten shared page
    # changes the tokens).
    return dict(seq=[[] for _ in range(self.num_slots)], table=None, pages={})

  def set_pages(self, state, table):
    return dict(state, table=np.array(table))

  def _logits(self, seq):
    if POISON in seq:
      return np.full((VOCAB,), np.nan, np.float32)
    digest = hashlib.sha256(np.asarray(seq, np.int64).tobytes()).digest()
    logits = np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(
        VOCAB).astype(np.float32)
    logits[POISON] = -1e9  # only a prompt can carry it
    return logits

  def _write(self, state, slot, position, token):
    if state["table"] is None or (state["table"][slot] < 0).all():
      return  # a device-resident request
    page = state["table"][slot, position // self.page_size]
    assert page >= 0, (slot, position)
    state["pages"].setdefault(int(page), {})[position % self.page_size] = token

  def prefill(self, state, slot, tokens, start, count):
    seq = state["seq"][slot]
    if start == 0:
      seq.clear()
    assert start == len(seq) and start % self.chunk_size == 0 and len(tokens) == self.chunk_size
    for i, t in enumerate(tokens[:count]):
      self._write(state, slot, start + i, int(t))
    seq.extend(int(t) for t in tokens[:count])
    return state, jnp.asarray(self._logits(seq))

  def load_prefix(self, state, slot, length):
    assert 0 < length <= self.max_len  # whole chunks, or all of a handed-off request
    table = state["table"][slot]
    state["seq"][slot] = [state["pages"][int(table[p // self.page_size])][p % self.page_size]
                          for p in range(length)]
    return state

  def start_decoding(self, state, slot, length):
    assert len(state["seq"][slot]) == length
    return state

  def read_pages(self, state, pages):
    """A page's tokens by offset (-1: never written): what a disk tier stores."""
    out = np.full((len(pages), self.page_size), -1, np.int64)
    for row, page in zip(out, pages):
      for offset, token in state["pages"].get(int(page), {}).items():
        row[offset] = token
    return [out]

  def snapshot(self, state):
    seq = np.full((self.num_slots, self.max_len + 1), -1, np.int64)
    for row, tokens in zip(seq, state["seq"]):
      row[0] = len(tokens)
      row[1:1 + len(tokens)] = tokens
    table = (np.full((self.num_slots, 1), -2, np.int32) if state["table"] is None
             else state["table"])
    return [seq, table, FakeModel.read_pages(self, state, range(self.num_host_pages))[0]]

  def restore_state(self, arrays):
    seq, table, pages = arrays
    state = self.init()
    state["seq"] = [row[1:1 + row[0]].tolist() for row in seq]
    state["table"] = None if (table == -2).all() else table.copy()
    return self.write_pages(state, range(self.num_host_pages), [pages])

  def write_pages(self, state, pages, fields):
    for page, row in zip(pages, fields[0]):
      state["pages"][int(page)] = {o: int(t) for o, t in enumerate(row) if t >= 0}
    return state

  def decode(self, state, tokens, active):
    logits = np.zeros((self.num_slots, VOCAB), np.float32)
    for slot in np.flatnonzero(active):
      seq = state["seq"][slot]
      if len(seq) > self.hot_slots and state["table"] is not None:
        # A host-backed request writes position len(seq): its page must exist.
        assert state["table"][slot, len(seq) // self.page_size] >= 0
      self._write(state, slot, len(seq), int(tokens[slot]))
      seq.append(int(tokens[slot]))
      logits[slot] = self._logits(seq)
    return state, jnp.asarray(logits)

  def stats(self, state):
    return {}


def solo(model_factory, prompt, new, sp=SamplingParams()):
  engine = Engine(model_factory())
  req = engine.submit(prompt, new, sp)
  engine.run()
  return req.output


def test_page_pool_hands_out_and_takes_back_every_page():
  pool = PagePool(10, num_slots=3, pages_per_slot=6)
  assert pool.grow(0, 4) and pool.grow(1, 5)
  assert not pool.grow(2, 2) and pool.num_free == 1  # refused: nothing changed
  assert pool.table[0].tolist()[:4] == [0, 1, 2, 3]
  pool.release(0)
  assert pool.grow(2, 5) and pool.num_free == 0
  pool.check()
  pool.release(1)
  pool.release(2)
  assert pool.num_free == 10 and (pool.table == -1).all()
  pool.check()


def test_page_pool_hands_out_the_lowest_free_ids_after_any_drops():
  """Random grows, shares and releases on two partitions against a brute-force
  free set: every page handed out is its partition's lowest free id (the order
  snapshots and tests rely on), whatever order pages came back in."""
  rng = np.random.default_rng()
  pool = PagePool(40, num_slots=4, pages_per_slot=12, partitions=2)
  free = [set(range(20)), set(range(20, 40))]
  for _ in range(300):
    slot = int(rng.integers(4))
    part = pool.slot_partition(slot)
    row = pool.table[slot]
    if rng.random() < 0.4 and (row >= 0).any():
      pages = row[row >= 0].tolist()
      pool.release(slot)
      free[part] |= {p for p in pages if pool.refs[p] == 0}
      continue
    held = int((row >= 0).sum())
    want = held + int(rng.integers(1, 4))
    expected = sorted(free[part])[:want - held]
    if pool.grow(slot, want):
      assert row[held:want].tolist() == expected
      free[part] -= set(expected)
    else:
      assert len(expected) < want - held or want > row.shape[0]
    pool.check()


def test_sampling_draws_depend_on_seed_and_position_not_on_the_batch():
  rng = np.random.default_rng()
  logits = rng.standard_normal((4, 300)).astype(np.float32)
  params = dict(temperature=np.float32([0.0, 0.8, 1.3, 0.7]), top_k=np.int32([0, 0, 5, 0]),
                top_p=np.float32([1.0, 0.9, 1.0, 1.0]), seed=np.int32([1, 2, 3, 4]),
                position=np.int32([10, 11, 12, 13]))
  tokens, finite = (np.asarray(x) for x in sampling.sample(jnp.asarray(logits), **params))
  assert finite.all() and tokens[0] == logits[0].argmax()
  assert tokens[2] in np.argsort(-logits[2])[:5]
  # Row 1 alone, in another batch position, with different neighbours: same draw.
  perm = [3, 1, 0, 2]
  moved = {k: v[perm] for k, v in params.items()}
  other = logits[perm].copy()
  other[[0, 2, 3]] = rng.standard_normal((3, 300))
  again, _ = sampling.sample(jnp.asarray(other), **moved)
  assert int(np.asarray(again)[1]) == tokens[1]


def reference_candidates(logits, temperature, top_k, top_p):
  """numpy: a sampled row's kind, candidate ids and scaled f32 logits (-inf where
  dropped) as ``sampling``'s docstring defines them (kept sets in float64), and
  the distance from top_p of the nearest mass the kind or the kept set hinges on."""
  vocab = len(logits)
  scaled = logits / max(np.float32(temperature), np.float32(1e-6))
  order = np.argsort(-logits, kind="stable")
  if top_k == 0 and top_p >= 1:
    return "whole", np.arange(vocab), scaled, np.inf
  window = min(sampling.TOP_K_WINDOW, vocab)
  wide = scaled.astype(np.float64)
  if 0 < top_k <= window:
    kind, ids, normal = "window", order[:window], order[:top_k]
  else:
    kind, ids, normal = "ranked", order, order[:top_k or vocab]
  lse = wide[normal].max() + np.log(np.exp(wide[normal] - wide[normal].max()).sum())
  mass = np.exp(wide[order] - lse)
  mass[len(normal):] = 0
  reached = np.cumsum(mass)
  margin = np.abs(reached - top_p).min() if top_p < 1 else np.inf
  if top_k == 0 and top_p < 1:
    for width in sampling.NUCLEUS_WINDOWS:  # the first window the nucleus fits
      if reached[min(width, vocab) - 1] >= top_p:
        kind, ids = f"nucleus_{width}", order[:min(width, vocab)]
        break
  kept = np.zeros(vocab, bool)
  kept[:len(normal)] = True if top_p >= 1 else (reached - mass)[:len(normal)] < top_p
  return kind, ids, np.where(kept[:len(ids)], scaled[ids], -np.inf), margin


def test_sampling_flags_any_non_finite_logit_and_draws_with_the_documented_key():
  """One NaN or inf among finite logits marks the row (a whole-row poison is not
  the only failure); a row's draw is ``categorical(fold_in(fold_in(key(0), seed),
  position))`` over its kind's candidates (whole vocabulary in id order, or the
  top-k window, a nucleus window, or the whole ranking best first), the
  documented key and candidates (snapshots and handoffs rely on them: a reordered
  fold would change every sampled stream). Checked against ``reference_candidates``
  on a vocabulary past both windows, every kind present; a window's draw is the
  one over the whole ranking (partitionable noise)."""
  rng = np.random.default_rng()
  vocab = 200
  logits = rng.standard_normal((4, vocab)).astype(np.float32)
  where = rng.integers(vocab, size=3)
  logits[0, where[0]], logits[1, where[1]], logits[2, where[2]] = np.nan, np.inf, -np.inf
  zeros = np.zeros(4, np.float32)
  _, finite = sampling.sample(jnp.asarray(logits), zeros, np.zeros(4, np.int32),
                              zeros + 1, np.zeros(4, np.int32), np.zeros(4, np.int32))
  np.testing.assert_array_equal(np.asarray(finite), [False, False, False, True])
  rows, vocab = 128, 5000
  nucleus = rng.uniform(0.3, 0.95, rows)
  # (top_k, top_p, logit scale) per row in turn: whole, three windows, a peaked
  # nucleus (inside 256), a flat one (inside 4096 below top-p 0.82, else ranked),
  # two larger top-ks.
  cases = np.array([(0, 1.0, 1.0), (1, 1.0, 1.0), (7, -1, 1.0),
                    (sampling.TOP_K_WINDOW, 1.0, 1.0), (0, -1, 6.0), (0, -1, 0.05),
                    (65, -1, 1.0), (300, 1.0, 1.0)])[np.arange(rows) % 8]
  top_k = cases[:, 0].astype(np.int32)
  top_p = np.where(cases[:, 1] < 0, nucleus, cases[:, 1]).astype(np.float32)
  logits = (rng.standard_normal((rows, vocab)) * cases[:, 2:]).astype(np.float32)
  # Every other row in halves of a unit, ties everywhere, zeros of both signs.
  logits[1::2] = np.round(logits[1::2] * 2) / 2 * rng.choice([-1, 1], (rows // 2, vocab))
  temperature = rng.uniform(0.2, 1.5, rows).astype(np.float32)
  seed = rng.integers(0, 2**31, rows).astype(np.int32)
  position = rng.integers(0, 2**20, rows).astype(np.int32)
  params = (temperature, top_k, top_p, seed, position)
  tokens = np.asarray(sampling.sample(jnp.asarray(logits), *params)[0])
  # Five rows with other neighbours, fewer of them: the same draws.
  some = rng.choice(rows, 5, replace=False)
  again = sampling.sample(jnp.asarray(logits[some]), *(p[some] for p in params))[0]
  np.testing.assert_array_equal(np.asarray(again), tokens[some])
  kinds = collections.Counter()
  for row in range(rows):
    kind, ids, masked, margin = reference_candidates(logits[row], temperature[row],
                                                     top_k[row], top_p[row])
    if margin < 1e-5:  # f32 and float64 may cut at another token
      continue
    kinds[kind] += 1
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), int(seed[row])),
                             int(position[row]))
    pick = int(jax.random.categorical(key, jnp.asarray(masked.astype(np.float32))))
    assert int(tokens[row]) == ids[pick], (row, kind)
    if kind != "whole":  # the token a draw over the whole ranking gives
      ranking = np.full(vocab, -np.inf, np.float32)
      ranking[:len(masked)] = masked
      assert ids[int(jax.random.categorical(key, jnp.asarray(ranking)))] == ids[pick]
  assert set(kinds) == set(sampling.CANDIDATES), kinds


def test_tied_logits_rank_and_cut_as_the_full_ranking_does():
  """The windows rank ties as the stable argsort does (the lower id first, -0.0
  tied with 0.0: ``lax.top_k`` alone put 0.0 first, so a greedy request's processed
  log-probability was -inf), and a nucleus of equal logits stops where its mass
  reaches top_p exactly (its mass rounded low and kept one token more)."""
  for vocab, top_p in ((2, 0.5), (10, 0.1), (10, 0.5), (1000, 0.1)):
    flat = jnp.full((vocab,), 3.7, jnp.float32)
    kept = [int(np.isfinite(np.asarray(sampling.CANDIDATES[kind](
        flat, 1.0, 0, np.float32(top_p))[1])).sum()) for kind in sampling.CANDIDATES
        if kind.startswith("nucleus") or kind == "ranked"]
    assert kept == [round(vocab * top_p)] * 3, (vocab, top_p, kept)
  zeros = np.full(VOCAB, -3.0, np.float32)
  zeros[5], zeros[9] = -0.0, 0.0
  for kind in set(sampling.CANDIDATES) - {"whole"}:
    ids, _ = sampling.CANDIDATES[kind](jnp.asarray(zeros), 1.0, 2, np.float32(0.9))
    assert np.asarray(ids)[:2].tolist() == [5, 9], kind

  class SignedZeros(FakeModel):
    def _logits(self, seq):
      return zeros.copy()

  engine = Engine(SignedZeros())
  req = engine.submit([1, 2, 3], 3, SamplingParams(top_k=1, logprobs=1,
                                                   logprobs_mode="processed"))
  engine.run()
  assert req.output == [5] * 3 and req.logprobs == [0.0] * 3
  assert req.top_logprobs == [[(5, 0.0)]] * 3


def test_sampling_frequencies_follow_the_truncated_softmax():
  """top_k, top_p and temperature give the renormalised distribution (2000 draws
  per case, every count within 5 sigma of its expectation)."""
  logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
  cases = [(1.0, 0, 1.0, [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]),
           (1.0, 3, 1.0, np.array([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),
           (1.0, 0, 0.7, np.array([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),  # mass 0.65 < 0.7
           (0.5, 0, 1.0, np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]) ** 2)]
  n = 2000
  for temperature, top_k, top_p, want in cases:
    want = np.asarray(want, np.float64) / np.sum(want)
    draw = sampling.sample(jnp.asarray(np.tile(logits, (n, 1))),
                           np.full(n, temperature, np.float32), np.full(n, top_k, np.int32),
                           np.full(n, top_p, np.float32), np.arange(n, dtype=np.int32),
                           np.zeros(n, np.int32))[0]
    counts = np.bincount(np.asarray(draw), minlength=6)
    sigma = np.sqrt(n * want * (1 - want)) + 1e-9
    assert (np.abs(counts - n * want) <= 5 * sigma + (want == 0) * 0).all(), (
        temperature, top_k, top_p, counts)


def test_the_kept_tokens_are_the_smallest_prefix_reaching_top_p_in_float64():
  """``sampling.kept`` against float64 brute force on a large vocabulary with a
  long tail: top_p = 1 keeps every token (an f32 cumsum reaches 1 some 30 tokens
  before the end of 32000), top_k first, then the smallest prefix whose mass
  reaches top_p."""
  rng = np.random.default_rng()
  vocab = 32000
  ranked = np.sort(rng.standard_normal(vocab) * 2)[::-1].astype(np.float32)
  for top_k, top_p in [(0, 1.0), (100, 1.0), (0, 0.9), (0, 0.5), (50, 0.8), (0, 1e-6)]:
    got = np.asarray(sampling.kept(jnp.asarray(ranked), top_k, np.float32(top_p)))
    limit = top_k or vocab
    p = np.exp(ranked[:limit].astype(np.float64) - ranked[0])
    before = np.cumsum(p / p.sum()) - p / p.sum()  # mass ranked above each token
    want = np.zeros(vocab, bool)
    want[:limit] = True if top_p >= 1 else before < top_p
    if top_p < 1:  # f32 and f64 may disagree on a token at the boundary only
      edge = np.abs(before - top_p) < 1e-5
      want[:limit][edge] = got[:limit][edge]
    np.testing.assert_array_equal(got, want, err_msg=f"{top_k=} {top_p=}")
    assert got[0]
  # Exactly at the boundary (exact in f32): two equal logits of mass 1/2 each; the
  # first reaches top_p = 1/2, so the second is not kept; 3/4 needs both.
  pair = jnp.asarray([1.0, 1.0, -jnp.inf, -jnp.inf], jnp.float32)
  for top_p, want in ((0.5, [True, False, False, False]), (0.75, [True, True, False, False])):
    np.testing.assert_array_equal(sampling.kept(pair, 0, np.float32(top_p)), want)


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
  """top_p > 0 may round to 0 in f32 (the engine's cast): the most likely token is
  still kept, on every candidate kind that truncates (a nucleus window, top-k's
  window, the full ranking), so the draw is the argmax and its processed
  log-probability 0, not NaN over an empty set."""
  rng = np.random.default_rng()
  vocab = 300  # > the first nucleus window (256)
  # kinds: nucleus, window, ranked; 8 rows each (whether the unfixed sampler's f32
  # cumsum kept the first token was a coin flip per row)
  cases = [(0, 1e-50), (0, 1e-40), (5, 1e-50), (100, 1e-50)] * 8
  logits = rng.standard_normal((len(cases), vocab)).astype(np.float32)
  top_k = np.int32([k for k, _ in cases])
  top_p = np.float32([p for _, p in cases])
  temperature = np.full(len(cases), 0.7, np.float32)
  tokens, finite = sampling.sample(logits, temperature, top_k, top_p,
                                   rng.integers(0, 2**31, len(cases)).astype(np.int32),
                                   np.zeros(len(cases), np.int32))
  assert np.asarray(finite).all()
  np.testing.assert_array_equal(tokens, logits.argmax(-1))
  chosen, ids, top = sampling.logprobs(logits, tokens, temperature, top_k, top_p,
                                       np.ones(len(cases), bool), top_n=3)
  np.testing.assert_array_equal(chosen, 0.0)
  np.testing.assert_array_equal(np.asarray(ids)[:, 0], logits.argmax(-1))
  np.testing.assert_array_equal(np.asarray(top)[:, 1:], -np.inf)
  ranked = jnp.sort(jnp.asarray(logits[0]))[::-1]
  np.testing.assert_array_equal(sampling.kept(ranked, 0, np.float32(0.0)),
                                np.arange(vocab) == 0)


def test_a_temperature_below_the_greedy_bound_takes_the_argmax():
  """Below ``GREEDY_BELOW`` (1e-5, vLLM's) a row is greedy: two logits 1e-6
  apart are not a choice to sample (at temperature 1e-6 the lower one would be
  drawn about a quarter of the time); its processed log-probabilities are the raw
  softmax's (no temperature). Above it, the same logits are sampled."""
  n, vocab = 64, 16
  rng = np.random.default_rng()
  row = rng.uniform(-2.0, 0.5, vocab).astype(np.float32)
  row[3], row[9] = np.float32(1.0), np.float32(1.000001)
  logits = np.tile(row, (n, 1))
  seeds = rng.integers(0, 2**31, n).astype(np.int32)
  for temperature, greedy in ((1e-6, True), (1e-30, True), (1e-4, False)):
    args = (np.full(n, temperature, np.float32), np.zeros(n, np.int32),
            np.ones(n, np.float32))
    tokens = np.asarray(sampling.sample(logits, *args, seeds, np.arange(n, dtype=np.int32))[0])
    if greedy:
      np.testing.assert_array_equal(tokens, 9)
      chosen = sampling.logprobs(logits, tokens, *args, np.ones(n, bool), top_n=2)[0]
      want = row.astype(np.float64)[9] - np.log(np.exp(row.astype(np.float64)).sum())
      np.testing.assert_allclose(chosen, want, rtol=0, atol=1e-6)
    else:
      assert set(tokens.tolist()) == {3, 9}, tokens


def test_sampling_params_refuse_bools_and_strings_and_take_numpy_scalars():
  for sp in (SamplingParams(top_k=True), SamplingParams(seed=False),
             SamplingParams(temperature=True), SamplingParams(temperature="0.7"),
             SamplingParams(top_p=None), SamplingParams(top_k=5.0),
             # past what the engine's f32 / i32 arrays hold: inf, or an OverflowError
             # mid-step (after the batch's positions advanced)
             SamplingParams(temperature=1e39), SamplingParams(temperature=float("inf")),
             SamplingParams(temperature=float("nan")), SamplingParams(top_k=2**31)):
    with pytest.raises(ValueError, match="must be"):
      sp.check()
  SamplingParams(temperature=float(np.finfo(np.float32).max), top_k=2**31 - 1).check()
  sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float64(0.9),
                      seed=np.int32(3), logprobs=np.int16(2))
  sp.check()
  assert [type(v) for v in dataclasses.astuple(sp)] == [float, int, float, int, int, str]


def test_submit_rejects_bad_input_and_the_engine_carries_on():
  engine = Engine(FakeModel(), EngineConfig(kv_budget_bytes=500))
  bad = [(([], 4), "empty"), (([1, 2], 0), "max_new_tokens"),
         (([1, VOCAB], 4), "vocabulary"), (([1, 61.9], 4), "not integer ids"),
         (([True, 2], 4), "not integer ids"), (([1] * 90, 10), "exceeds the context"),
         (([1] * 80, 15), "device bytes"), (([1, 2], 4.0), "max_new_tokens"),
         (([1, 2], True), "max_new_tokens")]
  for (prompt, new), match in bad:
    with pytest.raises(ValueError, match=match):
      engine.submit(prompt, new)
  with pytest.raises(ValueError, match="stop ids"):  # not truncated to the id 2
    engine.submit([1, 2], 4, stop_ids=[2.7])
  with pytest.raises(ValueError, match="eos_ids"):
    EngineConfig(eos_ids=(2.7,))
  for eos in (VOCAB, -1):  # at construction, not at every submit after
    with pytest.raises(ValueError, match="eos_ids .* outside the model's vocabulary"):
      Engine(FakeModel(), EngineConfig(eos_ids=(3, eos)))
  for sp, match in [(SamplingParams(temperature=-1), "temperature"),
                    (SamplingParams(top_p=0.0), "top_p"), (SamplingParams(top_k=-2), "top_k"),
                    # vLLM's "no limit" (-1) is 0 here: refused, not read as a limit
                    (SamplingParams(top_k=-1), r"top_k=-1 must be an int in \[0, 2\*\*31\) \(0: no limit\)"),
                    (SamplingParams(seed=2**40), "seed")]:
    with pytest.raises(ValueError, match=match):
      engine.submit([1, 2, 3], 4, sp)
  with pytest.raises(ValueError, match="host pages"):
    Engine(FakeModel(num_host_pages=5)).submit([1] * 30, 4)
  # Exactly hot_slots (12) positions stay on the device: no host page needed.
  tight = Engine(FakeModel(num_host_pages=2))
  resident = tight.submit([1] * 8, 4)
  with pytest.raises(ValueError, match="13 positions need 4 host pages"):
    tight.submit([1] * 9, 4)
  tight.run()
  assert resident.state is State.FINISHED and tight.pool.in_use == 0
  with pytest.raises(ValueError, match="stop ids"):
    engine.submit([1, 2], 4, stop_ids=[VOCAB])
  for sp, match in [(SamplingParams(temperature=float("inf")), "temperature"),
                    (SamplingParams(seed=2**31), "seed")]:  # int32 would wrap it
    with pytest.raises(ValueError, match=match):
      engine.submit([1, 2, 3], 4, sp)
  engine.submit([1, 2, 3], 1, SamplingParams(seed=2**31 - 1), request_id="top seed")
  # A request is named by a str: another could not be handed off (a receiver
  # refuses it) nor seed a draw (seed=None draws from its id's hash).
  for name in (5, b"five", ("a",)):
    with pytest.raises(ValueError, match="request_id=.* must be a str"):
      engine.submit([1, 2, 3], 1, SamplingParams(temperature=1.0), request_id=name)
  # The context's last position is usable; one more is refused as such (not as
  # the device bytes it would also exceed).
  Engine(FakeModel()).submit([1] * 90, 6)
  with pytest.raises(ValueError, match="exceeds the context"):
    engine.submit([1] * 90, 7)
  for config, match in [(dict(prefix_cache=True, disk_pages=-1), "disk_pages"),
                        (dict(max_step_tokens=0), "max_step_tokens")]:
    with pytest.raises(ValueError, match=match):
      EngineConfig(**config)
  req = engine.submit([5, 6, 7], np.int64(4))  # a numpy count is an int
  assert type(req.max_new_tokens) is int
  with pytest.raises(ValueError, match="already exists"):
    engine.submit([1], 1, request_id=req.id)
  engine.run()
  assert req.state is State.FINISHED and len(req.output) == 4
  assert not engine.waiting and engine.requests.keys() == {req.id, "top seed"}


def test_the_prefill_staging_buffer_counts_against_the_device_budget():
  """The staging buffer (one prompt at a time) is device memory beside the
  requests' own: a budget below it is refused, a request whose bytes fit only
  without it is refused, and a second request waits while the two of them and
  the staging buffer would not fit (FakeModel: 10 bytes per position)."""
  with pytest.raises(ValueError, match="staging"):
    Engine(FakeModel(staging=50), EngineConfig(kv_budget_bytes=49))
  engine = Engine(FakeModel(staging=50), EngineConfig(kv_budget_bytes=500))
  with pytest.raises(ValueError, match="device bytes"):
    engine.submit([1] * 40, 6)  # 460 + 50 > 500
  engine.submit([1] * 39, 6, request_id="fits")  # 450 + 50 = 500
  engine.run()
  rng = np.random.default_rng()
  first = engine.submit(rng.integers(1, POISON, 20).tolist(), 4)  # 240 bytes
  second = engine.submit(rng.integers(1, POISON, 18).tolist(), 4)  # 220: 510 with staging
  for _ in range(2):  # prefilled, then decoding: the second still waits
    assert engine.step()["peak_running"] == 1 and second.state is State.WAITING
  assert first.state is State.DECODING
  engine.run()
  for req in (first, second):
    assert req.output == solo(FakeModel, req.prompt, 4), req.id


def test_non_finite_logits_fail_one_request_and_the_others_finish():
  model = FakeModel()
  engine = Engine(model)
  streamed = []
  good = engine.submit([3, 4, 5, 6, 7, 8, 9, 10, 11], 6,
                       on_token=lambda req, token: streamed.append((req.id, token)))
  poisoned = engine.submit([2, POISON, 4], 6)
  engine.run()
  assert poisoned.state is State.FAILED and "non-finite" in poisoned.reason
  assert good.state is State.FINISHED and good.output == solo(FakeModel, good.prompt, 6)
  assert streamed == [(good.id, t) for t in good.output]  # streamed as sampled
  engine.pool.check()


def test_abort_frees_the_slot_and_pages_at_once():
  engine = Engine(FakeModel(num_slots=1))
  first = engine.submit(list(range(1, 40)), 20)
  second = engine.submit([7, 8, 9], 5)
  for _ in range(8):
    engine.step()
  assert first.state is State.DECODING and engine.pool.in_use > 0
  engine.abort(first.id)
  assert first.state is State.ABORTED and engine.pool.in_use == 0
  assert engine.slots == [None]
  engine.run()
  assert second.state is State.FINISHED and second.output == solo(FakeModel, [7, 8, 9], 5)
  # Aborting a request that has ended (a client's late cancel) changes nothing.
  ended = [(r.state, r.reason, list(r.output)) for r in (first, second)]
  engine.abort(second.id)
  engine.abort(first.id)
  assert [(r.state, r.reason, list(r.output)) for r in (first, second)] == ended
  assert engine.pool.in_use == 0 and engine.slots == [None]
  engine.pool.check()


def test_on_token_may_end_its_own_request_and_a_later_one_of_the_batch():
  """Streaming clients end requests from ``on_token``: one aborts its own request
  at its last token, another aborts a request sampled after it in the same batch.
  Both end there (no token after the abort), every page stays accounted for, and
  the others' tokens are their solo runs'."""
  factory = lambda: FakeModel(num_slots=4)
  engine = Engine(factory())
  at_abort = []

  def abort_self(req, token):
    if len(req.output) == req.max_new_tokens:
      engine.abort(req.id)

  def abort_later(req, token):
    if len(req.output) == 5:
      at_abort.append((later.state, len(later.output)))
      engine.abort(later.id)

  survivor = engine.submit(list(range(1, 30)), 10)  # slot 0, holds host pages
  own = engine.submit(list(range(2, 30)), 3, on_token=abort_self)  # slot 1
  first = engine.submit([5, 6, 7], 8, on_token=abort_later)  # slot 2
  later = engine.submit([8, 9, 10], 8)  # slot 3: sampled after slot 2
  while engine.has_work:
    engine.step()
    engine.pool.check()
  assert own.state is State.ABORTED and len(own.output) == 3
  assert at_abort[0][0] is State.DECODING  # in the batch when it was aborted
  assert later.state is State.ABORTED and len(later.output) == at_abort[0][1]
  for req in (survivor, first):
    assert req.output == solo(factory, req.prompt, req.max_new_tokens), req.id
  assert engine.pool.in_use == 0 and engine._device_in_use == 0


def test_a_model_serves_the_newest_engine_built_on_it():
  """A second engine on one model: the model keeps bookkeeping beside the engine's
  state (the tiered backend's per-slot length mirror), which the two would share.
  The first refuses to step on; the second serves as an engine on a model of its
  own."""
  rng = np.random.default_rng()
  prompt = rng.integers(1, POISON, int(rng.integers(5, 40))).tolist()
  shared = FakeModel()
  first = Engine(shared)
  first.submit(rng.integers(1, POISON, 30).tolist(), 20)
  for _ in range(3):
    first.step()
  second = Engine(shared)
  with pytest.raises(RuntimeError, match="another Engine was built on this model"):
    first.step()
  got = second.submit(prompt, 12)
  while second.has_work:
    second.step()
  solo = Engine(FakeModel())
  want = solo.submit(prompt, 12)
  while solo.has_work:
    solo.step()
  assert got.state is State.FINISHED and got.output == want.output


def test_an_on_token_that_raises_fails_its_request_and_leaves_the_engine_consistent():
  """A streaming client gone mid-batch (its callback raises): its request fails and
  lets go; the step still samples every other request of the batch, and raises the
  callback's exception after. Before, later requests of the batch had advanced
  without a token and every later step raised IndexError; a callback raising on a
  first token sampled by prefill skipped the length check (2 tokens of 1)."""
  factory = lambda: FakeModel(num_slots=4)
  engine = Engine(factory())
  at = int(np.random.default_rng().integers(1, 6))

  raising_steps = set()  # the steps in which a callback raised

  def gone(req, token):
    if len(req.output) == at:
      raising_steps.add(engine.steps)
      raise ConnectionResetError("client went away")

  def gone_at_once(req, token):
    raising_steps.add(engine.steps)
    raise ConnectionResetError("client went away")

  before = engine.submit(list(range(1, 30)), 8)  # slot 0, sampled before the failure
  failing = engine.submit([5, 6, 7], 8, on_token=gone)  # slot 1
  after = engine.submit([8, 9, 10], 8)  # slot 2: sampled after it in the batch
  single = engine.submit([3, 4], 1, on_token=gone_at_once)  # its one token, in prefill
  raised = set()  # one exception a step, however many callbacks raised in it
  while engine.has_work:
    try:
      engine.step()
    except ConnectionResetError as err:
      raised.add(engine.steps - 1)
      assert "now failed" in "".join(getattr(err, "__notes__", [])), err
    engine.pool.check()
  assert raised == raising_steps and raised
  assert failing.state is State.FAILED and "client went away" in failing.reason
  assert len(failing.output) == at
  assert single.state is State.FAILED and len(single.output) == 1
  for req in (before, after):
    assert req.state is State.FINISHED
    assert req.output == solo(factory, req.prompt, req.max_new_tokens), req.id
  assert engine.pool.in_use == 0 and engine._device_in_use == 0


def test_an_aborted_waiting_request_stays_aborted():
  """Aborted while it waits for a slot: it leaves the queue at once, is never
  admitted later and keeps no output."""
  engine = Engine(FakeModel(num_slots=1))
  running = engine.submit(list(range(1, 20)), 6)
  waiting = engine.submit([4, 5, 6], 5)
  engine.step()
  assert waiting.state is State.WAITING
  engine.abort(waiting.id)
  assert waiting not in engine.waiting
  engine.run()
  assert waiting.state is State.ABORTED and waiting.output == []
  assert waiting.metrics.first_token is None
  assert running.output == solo(FakeModel, running.prompt, 6)


@pytest.mark.parametrize("schedule", ["fcfs", "lpm"])
def test_a_preempted_request_resumes_before_those_waiting(schedule):
  """Preempted under page pressure, a request goes back to the head of the queue:
  it is admitted again before a request that was already waiting (it had waited
  behind it), under FCFS, and under LPM, whose key puts readmissions first even
  before a request with a longer cached prefix."""
  rng = np.random.default_rng()
  engine = Engine(FakeModel(num_slots=2, num_host_pages=24),
                  EngineConfig(prefix_cache=schedule == "lpm", schedule=schedule))
  prompt = lambda n: rng.integers(1, VOCAB - 1, n).tolist()
  first = engine.submit(prompt(44), 20)  # grows to 16 of the 24 pages
  second = engine.submit(prompt(24), 40)  # to 16: the newer one is preempted
  while second.state is not State.DECODING:
    engine.step()
  # Waits (both slots taken); shares first's 40 cached tokens, second only its 24.
  newcomer = engine.submit(first.prompt[:40] + prompt(2), 4)
  admitted = second.metrics.admitted
  for _ in range(40):  # bounded: preempting the older request instead would livelock
    if second.metrics.preemptions:
      break
    engine.step()
    assert first.state is not State.FINISHED, "no page pressure"
  assert second.metrics.preemptions == 1 and first.metrics.preemptions == 0
  assert list(engine.waiting)[:2] == [second, newcomer]
  engine.run()
  assert second.admit_order < newcomer.admit_order
  assert second.metrics.admitted == admitted  # its queue time ends at the first admission
  for req in (first, second, newcomer):
    assert req.output == solo(FakeModel, req.prompt, req.max_new_tokens), req.id


def test_prefill_spends_the_step_budget_in_whole_chunks():
  """A step budget of whole chunks is prefilled to its last token (a chunk that
  exactly fits the rest of the budget runs): 16 then 16 then the prompt's last 8
  at max_step_tokens = 16 and chunks of 8."""
  engine = Engine(FakeModel(num_slots=1), EngineConfig(max_step_tokens=16))
  req = engine.submit(list(range(1, 41)), 2)
  rows = [engine.step()["prefill_tokens"] for _ in range(3)]
  assert rows == [16, 16, 8] and req.state is State.DECODING
  # A decoding request takes its token from the budget: 15 left, one chunk.
  engine = Engine(FakeModel(num_slots=2), EngineConfig(max_step_tokens=16))
  decoding = engine.submit([1, 2, 3], 6)
  while decoding.state is not State.DECODING:
    engine.step()
  waiting = engine.submit(list(range(1, 25)), 2)
  row = engine.step()
  assert (row["decode_batch"], row["prefill_tokens"]) == (1, 8)
  engine.run()
  assert waiting.output == solo(FakeModel, waiting.prompt, 2)


def test_auto_ids_skip_ids_callers_chose():
  engine = Engine(FakeModel())
  engine.submit([1, 2, 3], 2, request_id="req-1")
  ids = [engine.submit([4, 5, 6], 2).id for _ in range(3)]
  assert len(set(ids + ["req-1"])) == 4 and all(i.startswith("req-") for i in ids)
  # Counted from the requests held (one submit does not scan every id from 0).
  engine = Engine(FakeModel())
  engine.submit([1, 2, 3], 2, request_id="x")
  assert engine.submit([1, 2, 3], 2).id == "req-1"


def test_requests_end_for_their_reason_in_the_lowest_free_slots():
  prompt = [3, 4, 5]
  ref = solo(FakeModel, prompt, 6)
  engine = Engine(FakeModel())
  stopped = engine.submit(prompt, 6, stop_ids=[ref[2]])
  full = engine.submit(prompt, 6)
  engine.step()
  engine.step()  # (one prompt at a time is prefilled)
  assert (stopped.slot, full.slot) == (0, 1)  # one device: the lowest free slot
  engine.run()
  end = ref.index(ref[2]) + 1  # its first occurrence
  assert (stopped.reason, stopped.output) == ("stop id", ref[:end])
  assert (full.reason, full.output) == ("length", ref)


def random_workload(rng, num, vocab=VOCAB - 1):
  out = []
  for _ in range(num):
    plen = int(rng.integers(1, 50))
    new = int(rng.integers(1, 30))
    sp = SamplingParams() if rng.random() < 0.5 else SamplingParams(
        temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.integers(0, 10)),
        top_p=float(rng.uniform(0.5, 1.0)), seed=int(rng.integers(1000)))
    out.append((rng.integers(0, vocab, plen).tolist(), new, sp, int(rng.integers(0, 6))))
  return out


def soak(num, seed, pages=24):
  """Random arrivals, lengths, sampling, aborts and page pressure; returns the
  engine and {id: (request, solo output)}."""
  rng = np.random.default_rng(seed)
  factory = lambda: FakeModel(num_host_pages=pages)
  engine = Engine(factory(), EngineConfig(max_step_tokens=20))
  pending = random_workload(rng, num)
  reqs = []
  while pending or engine.has_work:
    for _ in range(min(len(pending), int(rng.integers(0, 3)))):
      prompt, new, sp, _ = pending.pop()
      reqs.append(engine.submit(prompt, new, sp))
    live = [r for r in reqs if not r.state.done]
    if live and rng.random() < 0.05:
      engine.abort(live[int(rng.integers(len(live)))].id)
    engine.step()
    engine.pool.check()
  return engine, {r.id: (r, solo(factory, r.prompt, r.max_new_tokens, r.sampling))
                  for r in reqs if r.state is State.FINISHED}


def check_soak(engine, done):
  assert engine.pool.in_use == 0 and engine.pool.num_free == engine.pool.num_pages
  assert engine.slots == [None] * len(engine.slots) and not engine.waiting
  assert engine._device_in_use == 0
  for req, alone in done.values():
    assert req.output == alone, req.id
  assert sum(r.metrics.preemptions for r, _ in done.values()) > 0, "no page pressure"


def test_soak_nothing_leaks_and_every_request_equals_its_solo_run():
  engine, done = soak(120, seed=1)
  check_soak(engine, done)
  states = [r.state for r in engine.requests.values()]
  assert states.count(State.FINISHED) == len(done) > 60
  assert states.count(State.ABORTED) + len(done) == len(states)


@pytest.mark.slow
def test_long_soak():
  for seed in range(5):
    check_soak(*soak(400, seed=100 + seed))


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_random_schedules_equal_solo_runs(seed):
  rng = np.random.default_rng(seed)
  engine = Engine(FakeModel(num_host_pages=int(rng.integers(20, 40))),
                  EngineConfig(max_step_tokens=int(rng.integers(8, 40))))
  work = random_workload(rng, 10)
  reqs = []
  for prompt, new, sp, delay in work:
    for _ in range(delay):
      engine.step()
    reqs.append(engine.submit(prompt, new, sp))
  engine.run()
  for req in reqs:
    assert req.state is State.FINISHED
    assert req.output == solo(lambda: FakeModel(num_host_pages=40), req.prompt,
                              req.max_new_tokens, req.sampling)


def reference_log_probs(logits, sampling):
  """float64 log-probabilities of every token under ``sampling``'s logprobs mode
  (-inf for tokens the sampler cannot draw) and the kept mass's distance from
  ``top_p`` at the nearest token (where f32 and float64 may keep different sets)."""
  logits = logits.astype(np.float64)
  if sampling.logprobs_mode == "raw":
    return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum())), np.inf
  scaled = logits / (sampling.temperature if sampling.temperature > 0 else 1.0)
  order = np.argsort(-logits, kind="stable")
  top_k = sampling.top_k or len(logits)
  ranked = scaled[order][:top_k]
  probs = np.exp(ranked - ranked.max())
  probs /= probs.sum()
  before = np.cumsum(probs) - probs  # the mass ranked above each token
  count = top_k if sampling.top_p >= 1 else max(1, int((before < sampling.top_p).sum()))
  margin = np.inf if sampling.top_p >= 1 else np.abs(before - sampling.top_p).min()
  kept = order[:count]
  out = np.full(len(logits), -np.inf)
  lse = scaled[kept].max() + np.log(np.exp(scaled[kept] - scaled[kept].max()).sum())
  out[kept] = scaled[kept] - lse
  return out, margin


def check_logprobs(req):
  """``req``'s log-probabilities against a float64 computation from the logits
  FakeModel gave each output's position (raw: a log-softmax; processed: over the
  temperature, renormalised over what top-k and top-p keep), within f32
  rounding; the N best in order (processed: the kept ones among them)."""
  top_n = req.sampling.logprobs
  if top_n is None:
    assert req.logprobs == [] and req.top_logprobs == [], req.id
    return
  assert len(req.logprobs) == len(req.top_logprobs) == len(req.output), req.id
  scale = req.sampling.temperature if req.sampling.logprobs_mode == "processed" else 0
  for i, token in enumerate(req.output):
    logits = FakeModel._logits(None, req.prompt + req.output[:i])
    want, margin = reference_log_probs(logits, req.sampling)
    if margin < 1e-5:  # f32's cumulative sum may draw the top-p line elsewhere
      continue
    # f32 rounding of the (scaled) logit, the log-sum-exp and their difference, per
    # entry (one bound for all would be set by the -1e9 logit FakeModel gives POISON).
    finite = np.isfinite(want)
    assert finite[token], (req.id, i)  # the drawn token was one the sampler could draw
    scaled = logits.astype(np.float64) / (scale or 1)
    tol = 4 * np.finfo(np.float32).eps * (np.abs(scaled) + abs(scaled[token] - want[token]))
    assert abs(req.logprobs[i] - want[token]) <= tol[token], (req.id, i)
    best = np.argsort(-want, kind="stable")[:min(top_n, finite.sum())]
    assert [t for t, _ in req.top_logprobs[i]] == best.tolist(), (req.id, i)
    got = np.array([x for _, x in req.top_logprobs[i]])
    assert (np.abs(got - want[best]) <= tol[best]).all(), (req.id, i)


def test_logprobs_are_each_sampled_tokens_and_travel_with_the_request(tmp_path):
  """``SamplingParams(logprobs=N)``: each output token's log-probability and the N
  most likely tokens', as a float64 computation from its logits gives them (raw
  and processed, greedy and sampled requests, with preemption); a snapshot
  restores them bit for bit and the restored engine goes on as the original; a
  handoff, through its wire format, carries them to the receiver, which goes on
  recording."""
  rng = np.random.default_rng()
  factory = lambda: FakeModel(num_host_pages=24)
  engines = [Engine(factory(), EngineConfig(max_step_tokens=20))]
  reqs = []
  for i, (prompt, new, sp, delay) in enumerate(random_workload(rng, 16)):
    for _ in range(delay):
      engines[0].step()
    top_n = [None, 0, 3, 20][i % 4]
    sp = dataclasses.replace(sp, logprobs=top_n)
    if i % 8 >= 4:  # processed: untruncated (whole), top-k past 64 (ranked), else
      # as drawn (window or nucleus_256; greedy ones with a top-k the draw ignores)
      sp = dataclasses.replace(sp, logprobs_mode="processed", **(
          dict(top_k=0, top_p=1.0) if i % 8 == 5 else dict(top_k=100) if i % 8 == 6
          else dict(top_k=sp.top_k or (3 if sp.temperature == 0 else 0))))
    reqs.append(engines[0].submit(prompt, new + 4, sp, request_id=f"r{i}"))
  snapshot.save(engines[0], tmp_path / "snap")
  engines.append(snapshot.restore(tmp_path / "snap", factory(),
                                  EngineConfig(max_step_tokens=20)))
  for engine in engines:
    engine.run()
  assert sum(r.metrics.preemptions for r in reqs) > 0, "no page pressure"
  restored = engines[1].requests
  for req in reqs:
    assert req.state is State.FINISHED
    check_logprobs(req)
    again = restored[req.id]
    assert (again.output, again.logprobs, again.top_logprobs) == (
        req.output, req.logprobs, req.top_logprobs), req.id
  # A handoff mid-decode, over the wire: the receiver keeps the relayed entries.
  sender, receiver = Engine(factory()), Engine(factory())
  moving = sender.submit(reqs[7].prompt, reqs[7].max_new_tokens, reqs[7].sampling)
  while len(moving.output) < 3:
    sender.step()
  wire = handoff_lib.Handoff.from_bytes(sender.export(moving.id, kv="none").to_bytes())
  moved = receiver.accept(wire)
  receiver.run()
  assert moved.relayed == 3 and moved.logprobs[:3] == moving.logprobs
  assert (moved.output, moved.logprobs) == (reqs[7].output, reqs[7].logprobs)
  check_logprobs(moved)


def test_logprobs_are_refused_out_of_range_and_in_a_handoff_that_disagrees():
  for bad in (dict(logprobs=-1), dict(logprobs=21), dict(logprobs=2.0),
              dict(logprobs=True), dict(logprobs_mode="processed_logprobs"),
              dict(logprobs_mode=None)):
    with pytest.raises(ValueError, match="logprobs"):
      Engine(FakeModel()).submit([1, 2], 3, SamplingParams(**bad))
  sender = Engine(FakeModel())
  req = sender.submit([1, 2, 3], 8, SamplingParams(logprobs=2))
  while len(req.output) < 2:
    sender.step()
  good = sender.export(req.id, kv="none")
  (a, x), (b, y) = good.top_logprobs[1]
  for change in (dict(logprobs=good.logprobs[:1]), dict(logprobs=None),
                 dict(logprobs=[good.logprobs[0], "x"]),
                 dict(logprobs=[good.logprobs[0], float("nan")]),
                 dict(logprobs=[good.logprobs[0], 0.5]),
                 dict(logprobs=[good.logprobs[0], -10**400]),  # no float holds it
                 dict(top_logprobs=[good.top_logprobs[0], good.top_logprobs[1][:1]]),
                 dict(top_logprobs=[good.top_logprobs[0], [(VOCAB, -1.0), (0, -2.0)]]),
                 dict(top_logprobs=[good.top_logprobs[0], [(b, y), (a, x)]]),  # worst first
                 dict(sampling=SamplingParams(seed=1)),
                 dict(sampling=SamplingParams(logprobs="2"))):
    receiver = Engine(FakeModel())
    with pytest.raises(ValueError, match="logprobs"):
      receiver.accept(dataclasses.replace(good, **change))
    assert not receiver.requests and not receiver.waiting  # untouched
  wire = dataclasses.replace(good, sampling=SamplingParams(logprobs="2")).to_bytes()
  with pytest.raises(ValueError, match="logprobs"):  # a frame's JSON: not a TypeError
    Engine(FakeModel()).accept(handoff_lib.Handoff.from_bytes(wire))
  Engine(FakeModel()).accept(good)
  # Processed, greedy with top-k 1: lists of one (fewer than N), but never none.
  req = sender.submit([1, 2, 3], 8, SamplingParams(top_k=1, logprobs=2,
                                                   logprobs_mode="processed"))
  while len(req.output) < 2:
    sender.step()
  kept_one = sender.export(req.id, kv="none")
  assert [len(top) for top in kept_one.top_logprobs] == [1, 1]
  assert kept_one.logprobs == [0.0, 0.0]  # all the mass on the one kept token
  too_long = good.top_logprobs[1] + [(0, -30.0)]  # 3 pairs for N = 2
  for tops in ([[], kept_one.top_logprobs[1]], [kept_one.top_logprobs[0], too_long]):
    with pytest.raises(ValueError, match="logprobs"):
      Engine(FakeModel()).accept(dataclasses.replace(kept_one, top_logprobs=tops))
  Engine(FakeModel()).accept(handoff_lib.Handoff.from_bytes(kept_one.to_bytes()))
  # Built by hand before any output: no lists needed.
  Engine(FakeModel()).accept(handoff_lib.Handoff("h", [1, 2, 3], [], 8,
                                                 SamplingParams(logprobs=2)))


class TinyVocabModel(FakeModel):
  """FakeModel's logits cut to 8 tokens: fewer than ``MAX_LOGPROBS``."""

  vocab_size: int = 8

  def prefill(self, state, slot, tokens, start, count):
    state, logits = super().prefill(state, slot, tokens, start, count)
    return state, logits[:8]

  def decode(self, state, tokens, active):
    state, logits = super().decode(state, tokens, active)
    return state, logits[:, :8]


def test_logprobs_of_a_vocabulary_smaller_than_asked_rank_all_of_it():
  engine = Engine(TinyVocabModel())
  req = engine.submit([1, 2, 3], 5, SamplingParams(temperature=1.0, logprobs=20))
  engine.run()
  assert req.state is State.FINISHED and len(req.top_logprobs) == 5
  for token, chosen, top in zip(req.output, req.logprobs, req.top_logprobs):
    assert sorted(t for t, _ in top) == list(range(8))
    assert dict(top)[token] == chosen
    np.testing.assert_allclose(np.exp([x for _, x in top]).sum(), 1.0, rtol=1e-5)


DOOMED = VOCAB - 2  # RefusingModel refuses a step that feeds such a request far


class RefusingModel(FakeModel):
  """A FakeModel that refuses a decode step (its state untouched) in which an
  active slot's sequence starts with DOOMED and reaches ``doom_len`` tokens."""

  doom_len: int = 20

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.shared_refusals = 0  # refused steps that other requests were in
    self.decoded_rows = 0  # rows of the steps it took

  def decode(self, state, tokens, active):
    doomed = [s for s in np.flatnonzero(active) if state["seq"][s][:1] == [DOOMED]
              and len(state["seq"][s]) + 1 >= self.doom_len]
    if doomed:
      self.shared_refusals += int(active.sum()) > len(doomed)
      raise StepRefused(f"slots {doomed} refused", state)
    self.decoded_rows += int(active.sum())
    return super().decode(state, tokens, active)


def test_a_refused_step_fails_only_the_requests_refused_alone():
  """A decode step the model refuses is retried request by request: each request
  ends as its solo run does (a doomed one fails at the same token, the others
  finish with the same tokens), although the refused steps held other requests;
  nothing leaks; the step rows count only the requests that decoded. Three
  workloads: one alone (in one of seven runs by hand) retried no request outside
  slot 0, where a mixed-up row goes unseen."""
  rng = np.random.default_rng()
  factory = lambda: RefusingModel(num_host_pages=24)
  for _ in range(3):
    rows = []
    engine = Engine(factory(), EngineConfig(max_step_tokens=20), on_step=rows.append)
    reqs = []
    for prompt, new, sp, delay in random_workload(rng, 30):
      for _ in range(delay):
        engine.step()
      prompt[0] = DOOMED if rng.random() < 0.3 else prompt[0] % DOOMED
      reqs.append(engine.submit(prompt, new, sp))
    engine.run()
    assert engine.model.shared_refusals > 0, "no refused step held another request"
    assert sum(row["decode_batch"] for row in rows) == engine.model.decoded_rows
    assert engine.pool.in_use == 0 and engine._device_in_use == 0
    assert engine.slots == [None] * len(engine.slots)
    states = [r.state for r in reqs]
    assert State.FAILED in states and State.FINISHED in states
    for req in reqs:
      alone = Engine(factory())
      want = alone.submit(req.prompt, req.max_new_tokens, req.sampling)
      alone.run()
      assert (req.state, req.output) == (want.state, want.output), req.id
      if req.state is State.FAILED:
        assert "refused" in req.reason, req.reason


def step_noting(engine, raised, kind):
  """One step; an exception of ``kind`` it raises is noted in ``raised``."""
  try:
    engine.step()
  except kind as err:
    raised.append(err)
  engine.pool.check()


@pytest.mark.parametrize("failing_call", ["first", "later", "replaying"])
def test_a_sampler_that_raises_fails_only_the_requests_left_without_a_token(
    monkeypatch, failing_call):
  """A fault inside the sampler (none known): the requests of its batch left
  without the token their next step feeds fail, the step completes and raises it
  once, every other request (one replaying after a preemption included) ends with
  its solo tokens, nothing leaks. Before, they had advanced without a token and
  every later step raised IndexError. The first call samples a prefill's first
  token; a later one, mostly a decode batch; "replaying", the first call a
  preempted request replays its known outputs in."""
  rng = np.random.default_rng()
  factory = lambda: FakeModel(num_host_pages=24)
  engine = Engine(factory(), EngineConfig(max_step_tokens=20))
  at = 1 if failing_call == "first" else int(rng.integers(2, 30))
  real_sample, engine_sample = sampling.sample, engine._sample
  calls, batch, stranded, replaying = [0], [], [], []

  def watched(reqs, logits, rows, positions):  # the batch the sampler samples
    batch[:] = [(req, p) for req, p in zip(reqs, positions) if not req.state.done]
    return engine_sample(reqs, logits, rows, positions)

  def faulty(*args, **kwargs):
    calls[0] += 1
    known = [req for req, p in batch if p - len(req.prompt) < len(req.output)]
    if calls[0] == at if failing_call != "replaying" else (known and not replaying):
      stranded.extend(req for req, _ in batch if req not in known)
      replaying.extend(known)
      raise FloatingPointError("sampler fault")
    return real_sample(*args, **kwargs)

  monkeypatch.setattr(engine, "_sample", watched)
  monkeypatch.setattr(sampling, "sample", faulty)
  raised, reqs = [], []
  for prompt, new, sp, delay in random_workload(rng, 8):
    for _ in range(delay):
      step_noting(engine, raised, FloatingPointError)
    reqs.append(engine.submit(prompt, new, sp))
  while engine.has_work:
    step_noting(engine, raised, FloatingPointError)
  assert len(raised) == 1 and (replaying if failing_call == "replaying" else stranded)
  assert "completed the step" in "".join(raised[0].__notes__)
  for req in reqs:
    if req in stranded:
      assert req.state is State.FAILED and "sampling raised FloatingPointError" in req.reason
    else:
      assert req.state is State.FINISHED, (req.id, req.reason)
      assert req.output == solo(factory, req.prompt, req.max_new_tokens, req.sampling)
  assert engine.pool.in_use == 0 and engine._device_in_use == 0


class FaultingModel(RefusingModel):
  """A RefusingModel whose decode of a doomed request alone faults: it raises an
  error that is not a refusal."""

  def decode(self, state, tokens, active):
    try:
      return super().decode(state, tokens, active)
    except StepRefused as err:
      if active.sum() == 1:
        raise RuntimeError("device fault") from err
      raise


def test_a_fault_in_a_decode_alone_fails_its_request_and_keeps_the_others_exact():
  """After a refused step, the retry alone of one request faults: it fails, the
  requests decoded alone before it keep their step (sampled), those after it
  decode next step, and every one of them ends with its solo tokens. Before, the
  fault left the earlier ones advanced in the model but not in the engine, which
  fed them the same token again."""
  factory = lambda: FaultingModel(num_slots=3, num_host_pages=24)
  engine = Engine(factory())
  before = engine.submit(list(range(1, 9)), 24)  # slot 0: decoded alone first
  doomed = engine.submit([DOOMED, 5, 6], 24)  # slot 1: faults alone
  after = engine.submit(list(range(9, 14)), 24)  # slot 2: untouched by the retry
  raised = []
  while engine.has_work:
    step_noting(engine, raised, RuntimeError)
  assert len(raised) == 1 and engine.model.shared_refusals == 1
  assert doomed.state is State.FAILED and "decode step alone raised" in doomed.reason
  for req in (before, after):
    assert req.state is State.FINISHED
    assert req.output == solo(factory, req.prompt, req.max_new_tokens), req.id
  assert engine.pool.in_use == 0 and engine._device_in_use == 0


class DraftingModel(FakeModel):
  """A FakeModel with a look-ahead: each draft pass is checked against the slots
  the step before it decoded and the tokens they were fed."""

  lookahead = "draft"

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.engine, self.decoded, self.drafted, self.rows = None, None, 0, 0

  def decode(self, state, tokens, active):
    self.decoded = np.array(active)
    self.rows += int(self.decoded.sum())
    return super().decode(state, tokens, active)

  def draft_pass(self, state, drafts, active):
    for slot, req in enumerate(self.engine.slots):
      goes_on = bool(self.decoded[slot]) and req is not None and (
          req.state is State.DECODING)
      assert active[slot] == goes_on, (slot, req)
      if goes_on:  # the prompt lookup over what the slot was fed, by brute force
        fed = state["seq"][slot]
        assert drafts[slot] == prompt_lookup_oracle(fed)[0], (slot, fed)
        self.drafted += 1
    self.decoded = None  # one pass per step
    return state


def test_the_look_ahead_drafts_each_request_that_decodes_on_from_what_it_was_fed():
  """``lookahead == "draft"``: after each decode step the engine passes the model
  the prompt-lookup draft of every request that decodes on (not one that finished,
  was aborted or waits), drawn from the tokens fed so far, not the one just sampled;
  with preemption and aborts the tokens are the solo runs'."""
  rng = np.random.default_rng()
  model = DraftingModel(num_host_pages=24)
  engine = Engine(model, EngineConfig(max_step_tokens=20))
  model.engine = engine
  reqs = []
  for prompt, new, sp, delay in random_workload(rng, 30, vocab=6):
    for _ in range(delay):
      engine.step()
    reqs.append(engine.submit(prompt, new, sp))
    if rng.random() < 0.1:
      engine.abort(reqs[int(rng.integers(len(reqs)))].id)
  engine.run()
  assert 0 < model.drafted < model.rows  # (a request's last step drafts nothing)
  assert sum(r.metrics.preemptions for r in reqs) > 0, "no page pressure"
  for req in reqs:
    if req.state is State.FINISHED:
      assert req.output == solo(FakeModel, req.prompt, req.max_new_tokens, req.sampling)


def test_engine_books_at_their_boundaries():
  """Values at the edges of the engine's rules, each a mutant a wider test passed:
  a request charging exactly the device budget runs; one whose whole life is B
  positions holds no host page; a refused decode step frees its requests' slots
  and pages; a request that takes a page and finishes in one step peaks with it;
  the first token's time is the first token's; a stop id past the
  vocabulary is refused; the page pool hands out its lowest free page."""
  engine = Engine(FakeModel(), EngineConfig(kv_budget_bytes=500))
  exact = engine.submit([1] * 45, 5)  # 50 positions x 10 bytes: the whole budget
  for _ in range(100):  # bounded: a request never admitted would wait for good
    if engine.has_work:
      engine.step()
  assert exact.state is State.FINISHED and len(exact.output) == 5
  engine = Engine(FakeModel())
  fits = engine.submit([1] * 8, 4)  # 12 positions = B: never leaves the hot cache
  engine.step()
  assert engine.pool.in_use == 0 and not fits.state.done
  engine = Engine(FakeModel())
  grows = engine.submit([1] * 16, 2)  # the decode step writes position 16: a fifth page
  rows = []
  while engine.has_work:
    rows.append(engine.step())
  assert grows.state is State.FINISHED and engine.pool.in_use == 0
  assert rows[-1]["decode_batch"] == 1 and rows[-1]["host_pages_in_use"] == 0
  assert rows[-1]["peak_host_pages"] == 5  # held while it decoded, then let go

  class Refusing(FakeModel):
    def decode(self, state, tokens, active):
      raise StepRefused("refused", state)

  engine = Engine(Refusing())
  failed = engine.submit([1] * 16, 4)
  for _ in range(4):
    engine.step()
  assert failed.state is State.FAILED
  assert all(slot is None for slot in engine.slots) and engine.pool.in_use == 0
  times = iter(range(10**6))
  engine = Engine(FakeModel(), clock=lambda: float(next(times)))
  timed = engine.submit([1, 2, 3], 5)
  engine.run()
  assert timed.metrics.first_token == timed.metrics.token_times[0] < timed.metrics.token_times[-1]
  with pytest.raises(ValueError, match="stop"):
    Engine(FakeModel()).submit([1, 2], 2, stop_ids=[VOCAB])
  pool = PagePool(8, 2, 4)
  pool.grow(0, 3)
  pool.grow(1, 2)  # slot 0: pages 0, 1, 2; slot 1: 3, 4
  pool.release(0)
  pool.grow(1, 3)
  assert pool.table[1, :3].tolist() == [3, 4, 0]


def test_sampled_requests_without_a_seed_draw_differently_and_repeat_by_id():
  """``seed=None`` (the default) is derived from the request id at submission:
  four requests with one prompt at temperature 1 do not all draw alike (with
  seed 0 for all they did), the same ids repeat the same tokens in a fresh
  engine, and the request keeps the derived seed (a handoff carries it, so a
  receiver that renames the request continues the same stream)."""
  prompt, sp = list(range(1, 20)), SamplingParams(temperature=1.0)
  def run(ids):
    engine = Engine(FakeModel())
    reqs = [engine.submit(prompt, 8, sp, request_id=i) for i in ids]
    engine.run()
    return engine, reqs
  ids = ["a", "b", "c", "d"]
  engine, reqs = run(ids)
  assert len({tuple(r.output) for r in reqs}) > 1
  assert all(is_int(r.sampling.seed) for r in reqs)
  assert [r.output for r in run(ids)[1]] == [r.output for r in reqs]
  sender = Engine(FakeModel())
  moved = sender.submit(prompt, 8, sp, request_id="a")
  while len(moved.output) < 3:
    sender.step()
  handoff = sender.export("a", kv="none")
  receiver = Engine(FakeModel())
  renamed = receiver.accept(handoff, request_id="renamed")
  receiver.run()
  assert renamed.sampling.seed == reqs[0].sampling.seed
  assert renamed.output == reqs[0].output
