"""Quest, DSA, NSA and oracle selectors against float64 numpy brute force written
from the selectors' papers, the decode contract on every row, incremental state == prefill
state, exact tiered decoding over their selections, bad configurations, and the
resident-state byte counts.

Brute force scores a position/page/block set as correct when it is a top-n set up
to f32 ties: the chosen ones all score at least the best unchosen one minus a
tolerance (the plain top-n set whenever there is no near-tie)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax import driver, full_kv, selectors
from kvtier_jax import state as kv_state
from kvtier_jax.config import TierConfig
from kvtier_jax.selectors import (DSASelector, NSASelector, OracleSelector,
                                  PrefillInputs, QuestSelector, StepInputs)
from tests.oracles import sparse_attention_oracle

NUM_LAYERS, LAYER = 2, 1  # selector state for 2 layers; tests drive layer 1
MAX_LEN = 128
HKV, G, D = 2, 2, 8
HQ = HKV * G
MODEL_DIM = 16
LENS = (5, 45, 64)  # shorter than any budget, a partial page/block, a boundary
STEPS = 12


# ---------------------------------------------------------------------------------
# float64 brute force, from the formulas
# ---------------------------------------------------------------------------------


def softmax64(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def check_top(chosen, scores, candidates, count, tol, what=""):
  """``chosen`` is a top-``count`` subset of ``candidates`` by ``scores``, up to ties
  within ``tol``."""
  chosen, candidates = [int(c) for c in chosen], {int(c) for c in candidates}
  assert len(chosen) == len(set(chosen)), f"{what}: repeated {chosen}"
  assert set(chosen) <= candidates, f"{what}: {set(chosen) - candidates} not allowed"
  assert len(chosen) == min(count, len(candidates)), f"{what}: {len(chosen)} chosen"
  rest = candidates - set(chosen)
  if chosen and rest:
    worst_in = min(scores[c] for c in chosen)
    best_out = max(scores[c] for c in rest)
    assert worst_in >= best_out - tol, f"{what}: {worst_in} < {best_out} (unchosen)"


def assert_contract(positions, newest):
  """decode.py's contract: -1 or 0..newest, distinct within a row."""
  positions = np.asarray(positions)
  for idx in np.ndindex(*positions.shape[:-1]):
    row = positions[idx]
    top = int(newest[idx[0]])
    assert ((row == -1) | ((row >= 0) & (row <= top))).all(), (idx, row, top)
    real = row[row >= 0]
    assert len(np.unique(real)) == len(real), (idx, row)


def quest_brute(q, keys, newest, page_size, granularity):
  """Page scores f64[U, pages] of the Quest bounds + the per-head softmax rule."""
  num_pages = newest // page_size + 1
  bound = np.zeros((HQ, num_pages))
  for p in range(num_pages):
    page = keys[p * page_size:min((p + 1) * page_size, newest + 1)]
    hi, lo = page.max(0), page.min(0)
    for h in range(HQ):
      kv = h // G
      bound[h, p] = np.maximum(q[h] * hi[kv], q[h] * lo[kv]).sum() / math.sqrt(D)
  probs = np.stack([softmax64(b) for b in bound])
  if granularity == "layer":
    return probs.sum(0)[None]
  return probs.reshape(HKV, G, num_pages).sum(1)


def layer_norm64(x, scale, bias, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale + bias


def rope64(x, pos, rope_dim, theta):
  half = rope_dim // 2
  ang = pos * theta ** (-2.0 * np.arange(half) / rope_dim)
  x1, x2 = x[..., :half], x[..., half:rope_dim]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                         x2 * np.cos(ang) + x1 * np.sin(ang), x[..., rope_dim:]], -1)


def dsa_brute(p, xs, newest, rope_dim, theta, eps):
  """(index keys f64[newest+1, d_I], scores I_s f64[newest+1]) for the token at
  ``newest`` (hidden states xs[0..newest])."""
  num_heads, dim = p["ww"].shape[1], p["wk"].shape[1]
  keys = np.stack([rope64(layer_norm64(xs[s] @ p["wk"], p["k_norm_scale"],
                                       p["k_norm_bias"], eps), s, rope_dim, theta)
                   for s in range(newest + 1)])
  x = xs[newest]
  q = np.stack([rope64(qj, newest, rope_dim, theta)
                for qj in (x @ p["wq"]).reshape(num_heads, dim)])
  w = (x @ p["ww"]) * num_heads ** -0.5 * dim ** -0.5
  scores = np.array([sum(w[j] * max(q[j] @ keys[s], 0.0) for j in range(num_heads))
                     for s in range(newest + 1)])
  return keys, scores


def oracle_brute(q, keys, newest, granularity):
  probs = np.zeros((HQ, newest + 1))
  for h in range(HQ):
    probs[h] = softmax64(keys[:newest + 1, h // G] @ q[h] / math.sqrt(D))
  return probs.sum(0)[None] if granularity == "layer" else probs.reshape(
      HKV, G, -1).sum(1)


def nsa_brute(sel, q, keys, newest):
  """Block importance f64[Hkv, blocks <= current] of the NSA paper (with the
  selector's offset convention) and the forced block set."""
  l, d, lp = sel.cmp_block, sel.cmp_stride, sel.block_size
  complete = [i for i in range(newest + 1) if i * d + l - 1 <= newest]
  cmp_keys = [keys[i * d:i * d + l].mean(0) for i in complete]  # [Hkv, D] each
  current = newest // lp
  importance = np.zeros((HKV, current + 1))
  for h in range(HQ):
    kv = h // G
    p_cmp = (softmax64(np.array([ck[kv] @ q[h] for ck in cmp_keys]) / math.sqrt(D))
             if complete else np.zeros(0))
    for j in range(current + 1):
      for m in range(lp // d):
        for n in range(l // d):
          idx = (lp // d) * j + (-m - n if sel.importance == "paper" else m - n)
          if 0 <= idx < len(complete):
            importance[kv, j] += p_cmp[idx]
  forced = {j for j in range(current + 1)
            if j < sel.num_initial or j > current - sel.num_local}
  return importance, forced


# ---------------------------------------------------------------------------------
# Driving a selector: prefill, then STEPS decode steps, against brute force
# ---------------------------------------------------------------------------------


class Run:
  """Random prompt + continuation for LENS; prefill inputs poisoned past lens."""

  def __init__(self, seed):
    rng = np.random.default_rng(seed)
    self.lens = np.array(LENS)
    total = self.lens + STEPS
    plen = int(total.max())
    self.keys = rng.standard_normal((len(LENS), plen, HKV, D)).astype(np.float32)
    self.x = rng.standard_normal((len(LENS), plen, MODEL_DIM)).astype(np.float32)
    self.q = rng.standard_normal((STEPS, len(LENS), HQ, D)).astype(np.float32)
    for r, n in enumerate(total):  # never-written positions
      self.keys[r, n:] = np.nan
      self.x[r, n:] = np.nan

  def prompt(self, lens):
    keys, x = self.keys.copy(), self.x.copy()
    for r, n in enumerate(lens):
      keys[r, n:] = np.nan
      x[r, n:] = np.nan
    return PrefillInputs(jnp.asarray(x), jnp.asarray(keys), jnp.asarray(lens, jnp.int32))

  def step_inputs(self, i):
    newest = self.lens + i
    r = np.arange(len(LENS))
    return StepInputs(jnp.asarray(self.x[r, newest]), jnp.asarray(self.q[i]),
                      jnp.asarray(self.keys[r, newest]), jnp.asarray(newest, jnp.int32))


def run_selector(sel, seed, step_fn, check_step, params=None):
  """Prefill at LENS, STEPS selects (each checked), then the state must equal a
  prefill of the whole continuation. Returns (incremental, prefilled) states."""
  run = Run(seed)
  prefill = jax.jit(sel.prefill)
  state = prefill(sel.init_state(NUM_LAYERS, len(LENS), MAX_LEN), LAYER,
                  run.prompt(run.lens), params)
  step = jax.jit(step_fn)
  for i in range(STEPS):
    inputs = run.step_inputs(i)
    old_state = state
    out = step(old_state, inputs)
    state = out[1]
    assert_contract(out[0], np.asarray(inputs.newest))
    check_step(run, i, inputs, jax.tree.map(np.asarray, out))
  longer = prefill(sel.init_state(NUM_LAYERS, len(LENS), MAX_LEN), LAYER,
                   run.prompt(run.lens + STEPS), params)
  return state, longer


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
def test_quest_matches_brute_force(granularity):
  sel = QuestSelector(token_budget=32, page_size=8, num_kv_heads=HKV, q_per_kv=G,
                      head_dim=D, granularity=granularity)
  size = sel.page_size

  def step_fn(state, inputs):
    positions, new_state = sel.select(state, LAYER, inputs)
    scores, _ = sel.page_scores(new_state, LAYER, inputs.q, inputs.newest)
    return positions, new_state, scores

  def check_step(run, i, inputs, out):
    positions, _, scores = out
    assert positions.shape == (len(LENS), sel.num_units, 32)
    for r, newest in enumerate(np.asarray(inputs.newest)):
      want = quest_brute(run.q[i, r].astype(np.float64),
                         run.keys[r, :newest + 1].astype(np.float64), newest, size,
                         granularity)
      num_pages = want.shape[1]
      np.testing.assert_allclose(scores[r, :, :num_pages], want, rtol=1e-5, atol=1e-6)
      current = newest // size
      for u in range(sel.num_units):
        row = positions[r, u]
        page_pos = np.arange(current * size, (current + 1) * size)
        np.testing.assert_array_equal(row[:size],
                                      np.where(page_pos <= newest, page_pos, -1))
        pages = []
        for chunk in row[size:].reshape(-1, size):
          if (chunk == -1).all():
            continue
          np.testing.assert_array_equal(chunk, chunk[0] + np.arange(size))
          assert chunk[0] % size == 0
          pages.append(chunk[0] // size)
        check_top(pages, want[u], set(range(num_pages)) - {current},
                  sel.num_pages - 1, 1e-5, f"quest r={r} newest={newest}")

  state, longer = run_selector(sel, 0, step_fn, check_step)
  for got, want in zip(state, longer):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def random_indexer_params(seed):
  params = selectors.init_indexer_params(jax.random.key(seed), NUM_LAYERS, MODEL_DIM,
                                         num_index_heads=2, index_dim=8, rope_dim=4,
                                         rope_theta=500.0)
  rng = np.random.default_rng(seed)
  return params.replace(
      k_norm_scale=jnp.asarray(rng.uniform(0.5, 1.5, params.k_norm_scale.shape),
                               jnp.float32),
      k_norm_bias=jnp.asarray(rng.normal(0, 0.3, params.k_norm_bias.shape), jnp.float32))


def test_dsa_matches_brute_force():
  sel = DSASelector(top_k=24, index_dim=8)
  params = random_indexer_params(3)
  params_l = selectors.layer_slice(params, LAYER)
  p64 = {name: np.asarray(getattr(params_l, name), np.float64)
         for name in ("wq", "wk", "k_norm_scale", "k_norm_bias", "ww")}

  def step_fn(state, inputs):
    positions, new_state = sel.select(state, LAYER, inputs, params_l)
    return positions, new_state

  def check_step(run, i, inputs, out):
    positions, state = out
    assert positions.shape == (len(LENS), 1, 24)
    for r, newest in enumerate(np.asarray(inputs.newest)):
      keys, scores = dsa_brute(p64, run.x[r].astype(np.float64), newest,
                               params.rope_dim, params.rope_theta, params.norm_eps)
      np.testing.assert_allclose(state.keys[LAYER, r, :newest + 1], keys, rtol=1e-4,
                                 atol=1e-5)
      row = positions[r, 0]
      if newest + 1 < sel.top_k:  # everything, then padding
        assert (row[newest + 1:] == -1).all()
      check_top(row[row >= 0], scores, range(newest + 1), sel.top_k,
                1e-4 * (1 + np.abs(scores).max()), f"dsa r={r} newest={newest}")

  state, longer = run_selector(sel, 1, step_fn, check_step, params_l)
  np.testing.assert_allclose(np.asarray(state.keys), np.asarray(longer.keys), rtol=1e-5,
                             atol=1e-6)


def test_dsa_index_scores_are_the_selection_scores():
  """The pure functions the distillation trains through give the brute-force I_s."""
  params = selectors.layer_slice(random_indexer_params(4), 0)
  p64 = {name: np.asarray(getattr(params, name), np.float64)
         for name in ("wq", "wk", "k_norm_scale", "k_norm_bias", "ww")}
  rng = np.random.default_rng(4)
  x = rng.standard_normal((1, 20, MODEL_DIM)).astype(np.float32)
  pos = jnp.arange(20)[None]
  keys = selectors.index_keys(params, jnp.asarray(x), pos)
  causal = pos[:, :, None] >= pos[:, None, :]  # [1, Q, S]
  scores = np.asarray(selectors.index_scores(params, jnp.asarray(x), pos, keys, causal))
  for t in (0, 7, 19):
    _, want = dsa_brute(p64, x[0].astype(np.float64), t, params.rope_dim,
                        params.rope_theta, params.norm_eps)
    np.testing.assert_allclose(scores[0, t, :t + 1], want, rtol=1e-4, atol=1e-5)
    assert np.isneginf(scores[0, t, t + 1:]).all()


NSA_CONFIGS = {
    "paper": dict(block_size=8, num_blocks=4, num_initial=1, num_local=2, window=8,
                  cmp_block=4, cmp_stride=2, importance="paper"),
    "overlap": dict(block_size=8, num_blocks=4, num_initial=1, num_local=2, window=8,
                    cmp_block=4, cmp_stride=2, importance="overlap"),
    "fla_no_window": dict(block_size=8, num_blocks=3, num_initial=0, num_local=1,
                          window=0, cmp_block=8, cmp_stride=8),
    # l/d = 3: a block sums three stride chunks (ring sums once differed from
    # prefill's in the last bits at l/d > 2).
    "ratio_3": dict(block_size=8, num_blocks=4, num_initial=1, num_local=1, window=4,
                    cmp_block=6, cmp_stride=2, importance="paper"),
}


def make_nsa(name):
  return NSASelector(num_kv_heads=HKV, q_per_kv=G, head_dim=D, **NSA_CONFIGS[name])


@pytest.mark.parametrize("name", list(NSA_CONFIGS))
def test_nsa_matches_brute_force(name):
  sel = make_nsa(name)
  size, window = sel.block_size, sel.window

  def step_fn(state, inputs):
    positions, new_state = sel.select(state, LAYER, inputs)
    blocks, _ = sel.select_blocks(state, LAYER, inputs)
    importance = sel.block_importance(new_state, LAYER, inputs.q, inputs.newest)
    return positions, new_state, blocks, importance

  def check_step(run, i, inputs, out):
    positions, _, blocks, importance = out
    assert positions.shape == (len(LENS), HKV, sel.top_k)
    for r, newest in enumerate(np.asarray(inputs.newest)):
      want, forced = nsa_brute(sel, run.q[i, r].astype(np.float64),
                               run.keys[r, :newest + 1].astype(np.float64), newest)
      current = newest // size
      np.testing.assert_allclose(importance[r, :, :current + 1], want, rtol=1e-5,
                                 atol=1e-6)
      for u in range(HKV):
        chosen = [int(b) for b in blocks[r, u] if b >= 0]
        assert (blocks[r, u, len(chosen):] == -1).all()
        assert forced <= set(chosen), (forced, chosen)
        check_top(set(chosen) - forced, want[u], set(range(current + 1)) - forced,
                  sel.num_blocks - len(forced), 1e-5, f"nsa r={r} newest={newest}")
        # Row = chosen blocks' positions outside the window, then the window.
        block_pos = (blocks[r, u, :, None] * size + np.arange(size)).reshape(-1)
        keep = np.repeat(blocks[r, u] >= 0, size) & (block_pos <= newest - window)
        win = newest - window + 1 + np.arange(window)
        np.testing.assert_array_equal(
            positions[r, u], np.concatenate([np.where(keep, block_pos, -1),
                                             np.where(win >= 0, win, -1)]))

  state, longer = run_selector(sel, 2, step_fn, check_step)
  # Step by step as prefilled, bit for bit (a handoff rebuilds it by prefill).
  np.testing.assert_array_equal(np.asarray(state.cmp_key_sum),
                                np.asarray(longer.cmp_key_sum))
  np.testing.assert_array_equal(np.asarray(state.recent), np.asarray(longer.recent))


def test_nsa_importance_reduces_to_p_cmp_when_block_sizes_agree():
  for importance in ("paper", "overlap"):
    np.testing.assert_array_equal(
        selectors.nsa.importance_offsets(16, 16, 16, importance), [0])
  # l=32, d=16, l'=64: the spec's formula sums cmp blocks 4j-4..4j, the overlap
  # form the blocks overlapping [64j, 64j+64): 4j-1..4j+3.
  assert sorted(set(selectors.nsa.importance_offsets(64, 32, 16, "paper"))) == [
      -4, -3, -2, -1, 0]
  assert sorted(set(selectors.nsa.importance_offsets(64, 32, 16, "overlap"))) == [
      -1, 0, 1, 2, 3]


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
def test_oracle_matches_brute_force(granularity):
  sel = OracleSelector(top_k=16, num_kv_heads=HKV, q_per_kv=G, head_dim=D,
                       granularity=granularity)

  def step_fn(state, inputs):
    return sel.select(state, LAYER, inputs)

  def check_step(run, i, inputs, out):
    positions, _ = out
    assert positions.shape == (len(LENS), sel.num_units, 16)
    for r, newest in enumerate(np.asarray(inputs.newest)):
      want = oracle_brute(run.q[i, r].astype(np.float64),
                          run.keys[r].astype(np.float64), newest, granularity)
      for u in range(sel.num_units):
        row = positions[r, u]
        check_top(row[row >= 0], want[u], range(newest + 1), 16, 1e-5,
                  f"oracle r={r} newest={newest}")

  state, longer = run_selector(sel, 3, step_fn, check_step)
  np.testing.assert_array_equal(np.asarray(state.keys), np.asarray(longer.keys))


# ---------------------------------------------------------------------------------
# NSA's three-branch output against a numpy brute force
# ---------------------------------------------------------------------------------


def nsa_output_brute(q, k, v, newest, blocks, gates, size, window, l, d):
  head_dim = q.shape[-1]

  def attend(qh, keys, values):
    if not len(keys):
      return np.zeros(head_dim)
    w = softmax64(np.array([qh @ key for key in keys]) / math.sqrt(head_dim))
    return (w[:, None] * np.array(values)).sum(0)

  out = np.zeros_like(q)
  for h in range(q.shape[0]):
    kv = h // G
    cmp_ids = [i for i in range(newest + 1) if i * d + l - 1 <= newest]
    o_cmp = attend(q[h], [k[i * d:i * d + l, kv].mean(0) for i in cmp_ids],
                   [v[i * d:i * d + l, kv].mean(0) for i in cmp_ids])
    slc = sorted({p for b in blocks[kv] if b >= 0
                  for p in range(b * size, (b + 1) * size) if p <= newest})
    o_slc = attend(q[h], [k[p, kv] for p in slc], [v[p, kv] for p in slc])
    win = range(max(0, newest - window + 1), newest + 1) if window else []
    o_win = attend(q[h], [k[p, kv] for p in win], [v[p, kv] for p in win])
    out[h] = gates[h, 0] * o_cmp + gates[h, 1] * o_slc + gates[h, 2] * o_win
  return out


def test_nsa_attention_reference_matches_brute_force():
  rng = np.random.default_rng(7)
  num_req, max_len = 3, 64
  size, window, l, d = 8, 12, 8, 4
  newest = np.array([2, 30, 63])  # no complete cmp block / partial / full
  k = rng.standard_normal((num_req, max_len, HKV, D))
  v = rng.standard_normal((num_req, max_len, HKV, D))
  for r, n in enumerate(newest):
    k[r, n + 1:] = np.nan
    v[r, n + 1:] = np.nan
  q = rng.standard_normal((num_req, HQ, D))
  gates = rng.uniform(size=(num_req, HQ, 3))
  blocks = np.full((num_req, HKV, 3), -1)
  for r, n in enumerate(newest):
    for u in range(HKV):
      pick = rng.choice(n // size + 1, size=min(2, n // size + 1), replace=False)
      blocks[r, u, :len(pick)] = pick
  ref = jax.jit(functools.partial(selectors.nsa_attention_reference, block_size=size,
                                  window=window, cmp_block=l, cmp_stride=d))
  out = np.asarray(ref(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
                       jnp.asarray(newest), jnp.asarray(blocks),
                       jnp.asarray(gates, jnp.float32)))
  assert np.isfinite(out).all()
  for r in range(num_req):
    want = nsa_output_brute(q[r], k[r], v[r], int(newest[r]), blocks[r], gates[r], size,
                            window, l, d)
    np.testing.assert_allclose(out[r], want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------
# Plugging into the tiered decode step
# ---------------------------------------------------------------------------------

DECODE_LENS = [20, 70]


def decode_cases():
  quest = dict(token_budget=32, page_size=8, num_kv_heads=HKV, q_per_kv=G, head_dim=D)
  return {
      "quest_layer": (QuestSelector(**quest), None),
      "quest_kv_head": (QuestSelector(granularity="kv_head", **quest), None),
      "dsa": (DSASelector(top_k=24, index_dim=8), random_indexer_params(5)),
      "nsa": (make_nsa("paper"), None),
  }


@pytest.mark.parametrize("name", list(decode_cases()))
def test_selections_decode_exactly_through_the_tiered_cache(name):
  sel, params = decode_cases()[name]
  cfg = TierConfig(num_layers=NUM_LAYERS, num_requests=len(DECODE_LENS), max_len=MAX_LEN,
                   num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, hot_slots=sel.top_k,
                   top_k=sel.top_k, per_kv_head=sel.num_units == HKV, dtype=jnp.float32)
  rng = np.random.default_rng(11)
  plen = max(DECODE_LENS)
  lens = jnp.asarray(DECODE_LENS, jnp.int32)
  kv_shape = (NUM_LAYERS, len(DECODE_LENS), plen, HKV, D)
  kp = jnp.asarray(rng.standard_normal(kv_shape), jnp.float32)
  vp = jnp.asarray(rng.standard_normal(kv_shape), jnp.float32)
  xp = jnp.asarray(rng.standard_normal(kv_shape[:3] + (MODEL_DIM,)), jnp.float32)

  decoder = driver.TieredDecoder(cfg)
  tiered = decoder.prefill(kv_state.init_state(cfg, fill=np.nan), kp, vp, DECODE_LENS)
  full = full_kv.init_full_kv(cfg, kp, vp, lens, fill=np.nan)
  given = selectors.GivenSelector(cfg.top_k, cfg.num_units)
  full_step = jax.jit(functools.partial(full_kv.full_kv_decode_step, cfg, given))
  sel_state = sel.init_state(NUM_LAYERS, len(DECODE_LENS), MAX_LEN)
  prefill = jax.jit(sel.prefill)  # traced layer index
  for l in range(NUM_LAYERS):
    sel_state = prefill(sel_state, l, PrefillInputs(xp[l], kp[l], lens),
                        None if params is None else selectors.layer_slice(params, l))

  @jax.jit
  def select_all(sel_state, x, q, k_new, newest):
    """Selections [L, R, U, k] from a layer scan carrying the selector state, as a
    model's decode step runs it (traced layer index, per-layer params sliced by
    the scan)."""

    def layer_step(sel_state, xs):
      layer, x_l, q_l, k_l, params_l = xs
      pos, sel_state = sel.select(sel_state, layer, StepInputs(x_l, q_l, k_l, newest),
                                  params_l)
      return sel_state, pos

    sel_state, positions = jax.lax.scan(
        layer_step, sel_state, (jnp.arange(NUM_LAYERS), x, q, k_new, params))
    return positions, sel_state

  for _ in range(16):
    newest = np.asarray(decoder.seq_len)
    q = jnp.asarray(rng.standard_normal((NUM_LAYERS, len(DECODE_LENS), HQ, D)),
                    jnp.float32)
    kn = jnp.asarray(rng.standard_normal((NUM_LAYERS, len(DECODE_LENS), HKV, D)),
                     jnp.float32)
    vn = jnp.asarray(rng.standard_normal(kn.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((NUM_LAYERS, len(DECODE_LENS), MODEL_DIM)),
                    jnp.float32)
    sel_pos, sel_state = select_all(sel_state, x, q, kn, jnp.asarray(newest, jnp.int32))
    out, tiered = decoder.step(tiered, q, kn, vn, sel_pos)  # validates the selection
    ref, full = full_step(full, q, kn, vn, sel_pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    # And against float64 attention over the selected positions.
    k_all, v_all = np.asarray(full.k), np.asarray(full.v)
    for l in (0, NUM_LAYERS - 1):
      for r in range(len(DECODE_LENS)):
        want = sparse_attention_oracle(
            np.asarray(q[l, r]), k_all[l, r].reshape(MAX_LEN, HKV, D),
            v_all[l, r].reshape(MAX_LEN, HKV, D), np.asarray(sel_pos[l, r]))
        np.testing.assert_allclose(np.asarray(out[l, r]), want, atol=1e-5, rtol=1e-5)
  stats = kv_state.cache_stats(cfg, tiered)
  assert stats["misses"] > 0  # the long request's selections left the hot cache


# ---------------------------------------------------------------------------------
# Configuration errors and memory accounting
# ---------------------------------------------------------------------------------

HEADS = dict(num_kv_heads=HKV, q_per_kv=G, head_dim=D)


@pytest.mark.parametrize("make,match", [
    (lambda: QuestSelector(token_budget=30, page_size=8, **HEADS), "multiple of"),
    (lambda: QuestSelector(token_budget=0, **HEADS), "token_budget"),
    (lambda: QuestSelector(token_budget=32, granularity="head", **HEADS), "granularity"),
    (lambda: QuestSelector(token_budget=32, page_size=8, **HEADS).init_state(1, 1, 16),
     "exceeds max_len"),
    (lambda: DSASelector(top_k=0), "top_k"),
    (lambda: DSASelector(top_k=64).init_state(1, 1, 32), "exceeds max_len"),
    (lambda: selectors.init_indexer_params(jax.random.key(0), 1, 16, index_dim=8,
                                           rope_dim=16), "rope_dim"),
    (lambda: selectors.init_indexer_params(jax.random.key(0), 1, 16, rope_dim=3),
     "rope_dim"),
    (lambda: NSASelector(cmp_block=24, cmp_stride=16, **HEADS), "multiples of"),
    (lambda: NSASelector(block_size=40, cmp_stride=16, **HEADS), "multiples of"),
    (lambda: NSASelector(num_blocks=2, num_initial=1, num_local=2, **HEADS), "forced"),
    (lambda: NSASelector(window=-1, **HEADS), "window"),
    (lambda: NSASelector(importance="mean", **HEADS), "importance"),
    (lambda: NSASelector(**HEADS).init_state(1, 1, 1024), "exceeds max_len"),
    (lambda: OracleSelector(top_k=0, **HEADS), "top_k"),
    (lambda: OracleSelector(top_k=8, **HEADS).init_state(1, 1, 4), "exceeds max_len"),
])
def test_bad_configuration_raises(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_inputs_raise_at_trace_time():
  sel = QuestSelector(token_budget=16, page_size=8, **HEADS)
  state = sel.init_state(1, 2, 32)
  newest = jnp.array([3, 4])
  bad_q = StepInputs(None, jnp.zeros((2, HQ + 1, D)), jnp.zeros((2, HKV, D)), newest)
  with pytest.raises(ValueError, match="q has shape"):
    sel.select(state, 0, bad_q)
  with pytest.raises(ValueError, match="exceeds the state's max_len"):
    sel.prefill(state, 0, PrefillInputs(None, jnp.zeros((2, 40, HKV, D)), newest))
  # Quest's and NSA's states round max_len up to whole pages / blocks (28 -> 32):
  # prefill_state checks the prompt against max_len itself.
  for rounded in (sel, NSASelector(block_size=16, num_blocks=1, num_initial=0,
                                   num_local=1, window=8, **HEADS)):
    with pytest.raises(ValueError, match="prompt length 30 exceeds max_len=28"):
      selectors.prefill_state(rounded, 1, 28, None, None, jnp.zeros((1, 2, 30, HKV, D)),
                              jnp.array([30, 30]))
  dsa = DSASelector(top_k=8, index_dim=8)
  dsa_state = dsa.init_state(1, 2, 32)
  good = StepInputs(jnp.zeros((2, MODEL_DIM)), jnp.zeros((2, HQ, D)),
                    jnp.zeros((2, HKV, D)), newest)
  with pytest.raises(ValueError, match="IndexerParams"):
    dsa.select(dsa_state, 0, good)
  with pytest.raises(ValueError, match="layer_slice"):
    dsa.select(dsa_state, 0, good, random_indexer_params(0))  # stacked, not sliced


@pytest.mark.parametrize("sel", [
    QuestSelector(token_budget=32, page_size=8, **HEADS),
    QuestSelector(token_budget=32, page_size=8, granularity="kv_head", **HEADS),
    DSASelector(top_k=24, index_dim=8),
    *(make_nsa(name) for name in NSA_CONFIGS),
    OracleSelector(top_k=16, granularity="kv_head", **HEADS),
], ids=["quest", "quest_kv", "dsa", *NSA_CONFIGS, "oracle"])
def test_a_step_run_twice_at_one_position_is_the_second_run(sel):
  """The protocol's update rule: from the committed state, a select at position p
  with one token and then again at p with another gives the positions and the
  state (every leaf, bit for bit) of the second alone; the steps after it agree
  too. This is what lets a refused step be retried and the look-ahead's draft
  pass skip restoring the state. Poisoned prompts, several p (a page or block
  starting, ending, in the middle)."""
  seed = int(np.random.default_rng().integers(2**31))
  rng = np.random.default_rng(seed)
  run = Run(seed)
  params = (selectors.layer_slice(random_indexer_params(seed % 1000), LAYER)
            if isinstance(sel, DSASelector) else None)
  state = jax.jit(sel.prefill)(sel.init_state(NUM_LAYERS, len(LENS), MAX_LEN), LAYER,
                               run.prompt(run.lens), params)
  step = jax.jit(lambda st, inputs: sel.select(st, LAYER, inputs, params))
  for i in range(STEPS):
    inputs = run.step_inputs(i)
    other = inputs._replace(**{  # another token at the same position
        name: jnp.asarray(rng.standard_normal(getattr(inputs, name).shape), jnp.float32)
        for name in ("x", "q", "k_new")})
    _, first = step(state, other)
    twice, state_twice = step(first, inputs)
    once, state = step(state, inputs)
    np.testing.assert_array_equal(np.asarray(twice), np.asarray(once),
                                  err_msg=f"{seed=} step {i}")
    for got, want in zip(jax.tree.leaves(state_twice), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                    err_msg=f"{seed=} step {i}")


@pytest.mark.parametrize("sel", [
    QuestSelector(token_budget=32, page_size=8, **HEADS),
    QuestSelector(token_budget=64, page_size=32, num_kv_heads=3, q_per_kv=1, head_dim=6),
    DSASelector(top_k=16, index_dim=8),
    make_nsa("paper"),
    NSASelector(num_kv_heads=3, q_per_kv=1, head_dim=6, block_size=16, num_blocks=3,
                window=16, cmp_block=16, cmp_stride=16),
    QuestSelector(token_budget=34, page_size=17, num_kv_heads=3, q_per_kv=3, head_dim=64),
    NSASelector(num_kv_heads=3, q_per_kv=3, head_dim=64, block_size=17, num_blocks=1,
                num_initial=0, num_local=1, window=0, cmp_block=17, cmp_stride=17),
    OracleSelector(top_k=16, granularity="kv_head", **HEADS),
], ids=["quest", "quest_fractional", "dsa", "nsa", "nsa_fractional", "quest_page_17",
        "nsa_stride_17", "oracle"])
def test_state_bytes_match_init_state(sel):
  """What admission charges a request (``state_bytes``: per token in whole pages
  or strides, plus the rings) is what ``init_state`` allocates for it, at lengths
  on and off the page grid. Pages of 17 tokens: 1536/17 bytes per token as a
  float times 85 held tokens rounded up to one byte too many."""
  num_layers, num_req = 2, 3
  rng = np.random.default_rng()
  for max_len in (85, 96, 192, *rng.integers(97, 400, 3)):
    max_len = int(max_len)
    state = sel.init_state(num_layers, num_req, max_len)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    assert all(leaf.shape[0] == num_layers for leaf in jax.tree.leaves(state))
    assert total == num_layers * num_req * selectors.base.state_bytes(sel, max_len)


def test_the_tiered_step_refuses_a_ranking_or_a_state_it_cannot_use():
  """Trace-time refusals of what would attend or select wrongly with status 0:
  the "rank" policy attends a row's first top_k, which must be the rule's own
  selection (NSA's rows end with its window, the newest token included; a Quest
  prefix of a partial page is no Quest selection); a selector state shorter than
  the cache's max_len drops the later positions' state writes; a stateful rule
  in TieredDecoder would never be prefilled; a prompt batch of another size than
  the state's would rewrite the other requests' rows."""
  from kvtier_jax import decode
  from kvtier_jax.policies import PolicyConfig

  def trace(sel, top_k, depth, state_len=MAX_LEN):
    policy = PolicyConfig("rank", rank_depth=depth) if depth > top_k else PolicyConfig()
    cfg = TierConfig(num_layers=NUM_LAYERS, num_requests=2, max_len=MAX_LEN,
                     num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, hot_slots=48,
                     top_k=top_k, per_kv_head=sel.num_units == HKV, dtype=jnp.float32,
                     policy=policy)
    carry = decode.init_carry(cfg, jax.eval_shape(lambda: kv_state.init_state(cfg)),
                              jax.eval_shape(lambda: sel.init_state(NUM_LAYERS, 2,
                                                                    state_len)))
    q = jnp.zeros((NUM_LAYERS, 2, HQ, D))
    k = jnp.zeros((NUM_LAYERS, 2, HKV, D))
    return jax.eval_shape(lambda c: decode.decode_step(cfg, sel, c, q, k, k), carry)

  nsa = NSASelector(block_size=8, num_blocks=4, num_initial=1, num_local=1, window=8,
                    cmp_block=8, cmp_stride=8, num_kv_heads=HKV, q_per_kv=G,
                    head_dim=D)  # rows of 40 = 4 blocks of 8 + a window of 8
  with pytest.raises(ValueError, match="not ranked best first"):
    trace(nsa, 32, 40)
  trace(nsa, 40, 40)  # no deeper ranking: attended as selected
  quest = functools.partial(QuestSelector, page_size=8, num_kv_heads=HKV, q_per_kv=G,
                            head_dim=D)
  with pytest.raises(ValueError, match="not ranked best first"):
    trace(quest(token_budget=48), 36, 48)
  trace(quest(token_budget=48), 32, 48)  # whole pages: the budget-32 selection
  trace(OracleSelector(top_k=48, granularity="kv_head", num_kv_heads=HKV, q_per_kv=G,
                       head_dim=D), 20, 48)
  with pytest.raises(ValueError, match="holds 64 positions, the cache max_len=128"):
    trace(quest(token_budget=32), 32, 32, state_len=64)
  with pytest.raises(ValueError, match="holds 64 positions"):
    trace(OracleSelector(top_k=32, num_kv_heads=HKV, q_per_kv=G, head_dim=D), 32, 32,
          state_len=64)
  with pytest.raises(ValueError, match=f"holds {MAX_LEN - 1} positions"):  # one short
    trace(OracleSelector(top_k=32, num_kv_heads=HKV, q_per_kv=G, head_dim=D), 32, 32,
          state_len=MAX_LEN - 1)
  cfg = TierConfig(num_layers=NUM_LAYERS, num_requests=2, max_len=MAX_LEN,
                   num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, hot_slots=48, top_k=32,
                   dtype=jnp.float32)
  with pytest.raises(ValueError, match="not QuestSelector"):
    driver.TieredDecoder(cfg, quest(token_budget=32))
  one = PrefillInputs(jnp.zeros((1, 10, MODEL_DIM)), jnp.zeros((1, 10, HKV, D)),
                      jnp.array([10]))
  for sel, params in ((quest(token_budget=32), None), (nsa, None),
                      (OracleSelector(top_k=32, num_kv_heads=HKV, q_per_kv=G,
                                      head_dim=D), None),
                      (DSASelector(top_k=32, index_dim=8), random_indexer_params(0))):
    with pytest.raises(ValueError, match="prompts for 1 requests; the state holds 3"):
      sel.prefill(sel.init_state(1, 3, MAX_LEN), 0, one,
                  None if params is None else selectors.layer_slice(params, 0))
  dsa = DSASelector(top_k=32, index_dim=8)
  with pytest.raises(ValueError, match="hidden inputs x"):
    dsa.select(dsa.init_state(1, 2, MAX_LEN), 0,
               StepInputs(None, jnp.zeros((2, HQ, D)), jnp.zeros((2, HKV, D)),
                          jnp.array([3, 4])),
               selectors.layer_slice(random_indexer_params(0), 0))


def test_a_state_or_params_of_other_layers_are_refused_at_trace_time():
  """A selector state stacked for fewer layers (or requests) than the step runs,
  or indexer params of fewer layers, was read at its last layer and written
  nowhere (the traced layer index clamps): every layer past it selected from
  stale state with status 0. Refused by the tiered step, the full-KV reference
  and ``prefill_state``."""
  from kvtier_jax import decode  # noqa: PLC0415
  rng = np.random.default_rng()
  cfg = TierConfig(num_layers=NUM_LAYERS, num_requests=1, max_len=MAX_LEN,
                   num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, hot_slots=16, top_k=16,
                   dtype=jnp.float32)
  quest = QuestSelector(token_budget=16, page_size=4, num_kv_heads=HKV, q_per_kv=G,
                        head_dim=D)
  dsa = DSASelector(top_k=16, index_dim=8)
  kp = jnp.asarray(rng.standard_normal((NUM_LAYERS, 1, 30, HKV, D)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((NUM_LAYERS, 1, 30, MODEL_DIM)), jnp.float32)
  lens = jnp.asarray([30])
  tier = decode.prefill(cfg, kv_state.init_state(cfg), kp, kp, lens)
  q = jnp.asarray(rng.standard_normal((NUM_LAYERS, 1, HQ, D)), jnp.float32)
  kn = jnp.asarray(rng.standard_normal((NUM_LAYERS, 1, HKV, D)), jnp.float32)
  params = random_indexer_params(int(rng.integers(2**31)))
  one_layer = jax.tree.map(lambda a: a[:1], params)
  cases = [(quest, quest.init_state(1, 1, MAX_LEN), None),  # too few layers
           (quest, quest.init_state(NUM_LAYERS, 2, MAX_LEN), None),  # requests
           (dsa, dsa.init_state(NUM_LAYERS, 1, MAX_LEN), one_layer)]  # params
  for sel, state, p in cases:
    carry = decode.init_carry(cfg, tier, state, p)
    with pytest.raises(ValueError, match=r"\[L=2"):
      jax.eval_shape(functools.partial(decode.decode_step, cfg, sel), carry, q, kn, kn,
                     x[:, :, 0])
  full = full_kv.init_full_kv(cfg, kp, kp, lens)
  with pytest.raises(ValueError, match=r"\[L=2"):
    full_kv.full_kv_decode_step(cfg, quest, full, q, kn, kn, quest.init_state(1, 1, MAX_LEN))
  for args, match in (((None, None, kp[:1]), "k stacks 1"), ((params, x[:1], kp), "x stacks"),
                      ((one_layer, x, kp), r"\[L=2")):
    with pytest.raises(ValueError, match=match):
      selectors.base.prefill_state(dsa if args[0] is not None else quest, NUM_LAYERS,
                                   MAX_LEN, *args, lens)
  # The right stacks pass.
  good = selectors.base.prefill_state(dsa, NUM_LAYERS, MAX_LEN, params, x, kp, lens)
  jax.eval_shape(functools.partial(decode.decode_step, cfg, dsa),
                 decode.init_carry(cfg, tier, good, params), q, kn, kn, x[:, :, 0])


@pytest.mark.parametrize("prompt_len", [16, 100, 4096])
def test_churn_selector_slides_a_window_of_distinct_positions(prompt_len):
  """``ChurnSelector`` (the benchmarks' selection stream), brute force: from
  ``newest = prompt_len`` on, each row is k distinct prompt positions plus the
  newest; from one step to the next exactly ``round(churn * (k - 1))`` positions
  leave and as many enter; streams of other layers and requests differ (at
  prompt_len 16 they all coincided once)."""
  k, churn = 8, 0.25
  sel = selectors.ChurnSelector(prompt_len, k, num_units=2, churn=churn)
  shift = round(churn * (k - 1))
  def picks(layer, newest):
    inputs = selectors.StepInputs(None, None, None, jnp.asarray(newest, jnp.int32))
    return np.asarray(sel.select(None, layer, inputs)[0])
  rows = {}
  for layer in range(3):
    before = picks(layer, [prompt_len] * 4)
    after = picks(layer, [prompt_len + 1] * 4)
    for r, u in np.ndindex(4, 2):
      old, new = before[r, u], after[r, u]
      assert old[-1] == prompt_len and new[-1] == prompt_len + 1
      assert len(set(old)) == k and ((0 <= old[:-1]) & (old[:-1] < prompt_len)).all()
      assert len(set(old[:-1]) - set(new[:-1])) == shift
      rows[layer, r, u] = tuple(old[:-1])
  assert len(set(rows.values())) > len(rows) // 2


def test_churn_selector_ranks_the_positions_its_walk_reaches_next():
  """With ``rank_depth`` m > k, each row is the same selection (the newest last)
  followed by the m - k positions its window reaches next, in the order they enter
  (brute force: the windows of the following steps); all m distinct; the "rank"
  policy may attend its first k."""
  rng = np.random.default_rng()
  prompt_len, k = int(rng.integers(64, 200)), int(rng.integers(4, 12))
  depth, churn = int(rng.integers(k + 1, 4 * k)), 0.5
  plain = selectors.ChurnSelector(prompt_len, k, num_units=2, churn=churn)
  ranked = selectors.ChurnSelector(prompt_len, k, num_units=2, churn=churn,
                                   rank_depth=depth)
  assert ranked.ranks_best_first(k) and not ranked.ranks_best_first(k - 1)
  picks = lambda sel, newest: np.asarray(sel.select(None, 1, selectors.StepInputs(
      None, None, None, jnp.full((3,), newest, jnp.int32)))[0])
  newest = prompt_len + int(rng.integers(0, 50))
  rows, now = picks(ranked, newest), picks(plain, newest)
  assert rows.shape == (3, 2, depth)
  np.testing.assert_array_equal(rows[..., :k], now)
  for r, u in np.ndindex(3, 2):
    row = rows[r, u]
    assert len(set(row.tolist())) == depth
    entering = []  # the prompt positions later windows bring, in order
    for ahead in range(1, prompt_len):
      for p in picks(plain, newest + ahead)[r, u, :-1]:
        if p not in now[r, u] and p not in entering:
          entering.append(p)
      if len(entering) >= depth - k:
        break
    np.testing.assert_array_equal(row[k:], entering[:depth - k])
  with pytest.raises(ValueError, match="rank_depth"):
    selectors.ChurnSelector(prompt_len, k, rank_depth=prompt_len + 1)


@pytest.mark.parametrize("kind", ["quest", "oracle", "nsa", "dsa"])
def test_a_selectors_scores_over_row_tiles_are_a_requests_whatever_the_batch(kind):
  """``row_tile``: each selector's scores of request 0 are the same bits with 1, 3
  and a drawn number of requests, over contexts of 256 and 4096 (untiled, XLA:CPU
  scores request 0 otherwise at 1 request: Quest at 4096 pages' worth, the oracle
  at 256 positions), and equal the untiled scores to f32 rounding. (One tile ran
  inlined, outside its loop, and rounded otherwise than two.)"""
  rng = np.random.default_rng()
  tile, most = int(rng.integers(2, 9)), int(rng.integers(4, 12))
  heads, group, dim, model_dim = 3, 3, 64, 96
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  for length in (256, 4096):
    q, x = arr(most, heads * group, dim), arr(most, model_dim)
    newest = jnp.asarray(rng.integers(length // 2, length, most), jnp.int32)
    if kind == "quest":
      page_max = arr(1, most, length // 16, heads, dim)
      state = selectors.quest.QuestState(page_max, page_max - jnp.abs(page_max), None)
      make = lambda t: QuestSelector(token_budget=64, num_kv_heads=heads, q_per_kv=group,
                                     head_dim=dim, row_tile=t)
      score = lambda sel, n: sel.page_scores(jax.tree.map(lambda a: a[:, :n], state), 0,
                                             q[:n], newest[:n])[0]
    elif kind == "oracle":
      keys = arr(most, length, heads, dim)
      make = lambda t: OracleSelector(top_k=64, num_kv_heads=heads, q_per_kv=group,
                                      head_dim=dim, row_tile=t)
      score = lambda sel, n: sel.tiled_scores(keys[:n], q[:n], newest[:n])[0]
    elif kind == "nsa":
      state = selectors.nsa.NSAState(arr(1, most, length // 16, heads, dim), None)
      make = lambda t: NSASelector(num_kv_heads=heads, q_per_kv=group, head_dim=dim,
                                   row_tile=t)
      score = lambda sel, n: sel.block_importance(
          jax.tree.map(lambda a: a[:, :n], state), 0, q[:n], newest[:n])
    else:
      params = selectors.base.layer_slice(selectors.init_indexer_params(
          jax.random.key(int(rng.integers(2**31))), 1, model_dim), 0)
      keys = arr(most, length, 64)
      make = lambda t: DSASelector(top_k=64, row_tile=t)
      score = lambda sel, n: sel.tiled_scores(params, x[:n], newest[:n], keys[:n])[0]
    first = None
    for num_req in sorted({1, 3, most}):
      got = np.asarray(jax.jit(functools.partial(score, make(tile), num_req))())
      want = np.asarray(jax.jit(functools.partial(score, make(None), num_req))())
      finite = np.isfinite(want)
      np.testing.assert_array_equal(np.isfinite(got), finite)
      # f32 rounding of sums whose terms reach the largest score's size (DSA's
      # weighted ReLU logits cancel towards 0).
      np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5,
                                 atol=8 * np.finfo(np.float32).eps * np.abs(want[finite]).max())
      first = got[0] if first is None else first
      np.testing.assert_array_equal(got[0], first,
                                    err_msg=f"{num_req} requests, tile {tile}, {length}")
