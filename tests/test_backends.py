"""Sparse (full KV) vs tiered backends on the real model: lookahead, index sharing,
policies and the model step against the library's, and the CLIs' contracts (the
per-selector parity tests are in test_backends_parity.py: a second file, so the two
test workers share the SmolLM2 runs)."""

import dataclasses
import functools
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax import decode as kv_decode
from kvtier_jax import driver
from kvtier_jax import selectors as sel_lib
from kvtier_jax.config import ImplConfig
from kvtier_jax.draft import ngram_match
from kvtier_jax.policies import PolicyConfig
from models import backends
from tests.util import default_codegen_env, smollm2_or_skip

transformer = pytest.importorskip("models.transformer")


def selector_for(name, cfg):
  heads = dict(num_kv_heads=cfg.num_kv_heads, q_per_kv=cfg.num_q_heads // cfg.num_kv_heads,
               head_dim=cfg.head_dim)
  if name == "quest":
    return sel_lib.QuestSelector(token_budget=64, page_size=16, **heads), None
  if name == "quest_kv":
    return sel_lib.QuestSelector(token_budget=64, page_size=16, granularity="kv_head",
                                 **heads), None
  if name == "nsa":
    return sel_lib.NSASelector(block_size=16, num_blocks=4, num_initial=1, num_local=1,
                               window=16, **heads), None
  if name == "oracle":
    return sel_lib.OracleSelector(top_k=48, **heads), None
  params = sel_lib.init_indexer_params(jax.random.key(1), cfg.num_layers, cfg.embed_dim,
                                       rope_theta=cfg.rope_theta)
  return sel_lib.DSASelector(top_k=48, index_dim=params.index_dim), params


def assert_bit_equal_logits(sparse, tiered, tokens, lens, steps):
  """Prefill and greedy steps of both runners: logits equal bit for bit."""
  ref = sparse.prefill(tokens, lens)
  np.testing.assert_array_equal(tiered.prefill(tokens, lens), ref)
  for _ in range(steps):
    token = jnp.argmax(ref, -1)
    ref = sparse.step(token)
    np.testing.assert_array_equal(np.asarray(tiered.step(token)), np.asarray(ref))


def test_dense_runner_matches_greedy_reference(model_and_prompt):
  from models import sampling
  model, ids = model_and_prompt
  runner = backends.Runner(model, "dense", len(ids) + 5)
  logits = runner.prefill(ids[None], [len(ids)])
  got = []
  for _ in range(4):
    token = jnp.argmax(logits, -1)
    got.append(int(token[0]))
    logits = runner.step(token)
  want = sampling.greedy_generate(model, ids[None], [len(ids)], 4)[0]
  np.testing.assert_array_equal(got, want)


def test_runner_rejects_bad_use(model_and_prompt):
  model, ids = model_and_prompt
  with pytest.raises(ValueError, match="needs a selector"):
    backends.Runner(model, "tiered", 100, hot_slots=64)
  selector, _ = selector_for("quest", model.cfg)
  runner = backends.Runner(model, "sparse", 100, selector=selector)
  with pytest.raises(ValueError, match="exceed max_len"):
    runner.prefill(ids[None], [len(ids)])
  # Lengths past the tokens given, or 0 (a padding position's logits), and token
  # ids the embedding gather would clamp: refused before any call.
  short = np.asarray(ids[:40])[None]
  for tokens, lens, match in ((short, [41], r"in \[1, 40\]"), (short, [0], r"in \[1, 40\]"),
                              (short, [20.0], "integers"),
                              (np.where(short == short[0, 3], -1, short), [40], "token ids"),
                              (short.astype(np.float32), [40], "integers")):
    with pytest.raises(ValueError, match=match):
      runner.prefill(tokens, lens)
  runner.prefill(short, [40])
  for token, match in (([model.cfg.vocab_size], "token ids"), ([3, 4], r"must be \(1,\)"),
                       ([2.0], "integers")):
    with pytest.raises(ValueError, match=match):
      runner.step(np.asarray(token))
  with pytest.warns(UserWarning, match="trained context of 8192"):
    backends.Runner(model, "dense", model.cfg.max_context + 1)
  # A selector of float positions: the sparse backend (as the tiered one, tested
  # in test_decode) refuses it at trace time instead of truncating them.
  floats = _FloatPositions(selector)
  for backend, extra in (("sparse", {}), ("tiered", dict(hot_slots=64))):
    runner = backends.Runner(model, backend, 100, selector=floats, **extra)
    runner.prefill(short, [40])
    with pytest.raises(ValueError, match="integers"):
      runner.step(np.asarray([3]))


class _FloatPositions:
  """A selector whose positions come back as floats (1.9 would be attended as 1)."""

  def __init__(self, inner):
    self._inner = inner

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def select(self, *args, **kwargs):
    picked, state = self._inner.select(*args, **kwargs)
    return picked.astype(jnp.float32) + 0.5, state


@pytest.mark.parametrize("impl", ["auto", pytest.param("fused", marks=pytest.mark.slow)])
def test_parity_cli_prints_the_contract_line(impl):
  """The parity runner on XLA:CPU's default codegen (the rest of the suite compiles
  with the faster elemental emitters): tiered equals sparse there too, with the
  default step and the fused one (``--impl=fused``: the native call here)."""
  env = default_codegen_env()
  assert "fusion_emitters" not in env["XLA_FLAGS"]
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.parity", "--prompt_tokens=200", "--steps=3",
       "--selector=quest", "--top_k=32", "--hot_slots=32", f"--impl={impl}"],
      capture_output=True, text=True, timeout=600, env=env)
  if "SmolLM2" in proc.stderr and "not installed" in proc.stderr:
    pytest.skip("model not installed")
  last = proc.stdout.strip().splitlines()[-1]
  assert last == "parity: 4/4 tokens, max_abs_logit_diff=0", proc.stdout + proc.stderr
  assert proc.returncode == 0


def test_index_sharing_and_draft_lookahead_keep_parity(model_and_prompt):
  """Index sharing every 3 layers (sparse and tiered select on anchors only) and
  the uncommitted draft-token pass: logits still equal the sparse run's, and the
  prefetch takes misses off the real steps."""
  model, ids = model_and_prompt
  selector, _ = selector_for("quest", model.cfg)
  steps, tokens, lens = 8, ids[None], [len(ids)]
  max_len = len(ids) + steps + 2
  common = dict(selector=selector, index_share=3)
  sparse = backends.Runner(model, "sparse", max_len, **common)
  plain = backends.Runner(model, "tiered", max_len, hot_slots=128, **common)
  ahead = backends.Runner(model, "tiered", max_len, hot_slots=128, lookahead="draft",
                          lookahead_cap=16, **common)
  ref = sparse.prefill(tokens, lens)
  for runner in (plain, ahead):
    np.testing.assert_array_equal(runner.prefill(tokens, lens), ref)
  for _ in range(steps):
    token = jnp.argmax(ref, -1)
    ref = sparse.step(token)
    for runner in (plain, ahead):
      np.testing.assert_array_equal(np.asarray(runner.step(token)), np.asarray(ref))
  plain_stats, ahead_stats = plain.cache_stats(), ahead.cache_stats()
  assert ahead_stats["prefetched"] > 0
  assert ahead_stats["misses"] < plain_stats["misses"]
  # Shared layers are in lockstep with their anchors.
  slot_pos = np.asarray(ahead.carry.tier.slot_pos)
  np.testing.assert_array_equal(slot_pos[1], slot_pos[0])
  np.testing.assert_array_equal(slot_pos[5], slot_pos[3])


def test_rank_policy_on_smollm2_keeps_parity(model_and_prompt):
  """policy="rank": the oracle selector built at top-96 ranks, the tiered cache
  attends its first 48 (= the top-48 selection) and evicts by rank; logits equal
  the sparse top-48 run's bit for bit, unfused and through the fused layer kernels
  (whose victims, LRU order and scores are then the unfused run's)."""
  model, ids = model_and_prompt
  heads = dict(num_kv_heads=model.cfg.num_kv_heads,
               q_per_kv=model.cfg.num_q_heads // model.cfg.num_kv_heads,
               head_dim=model.cfg.head_dim)
  top48, top96 = (sel_lib.OracleSelector(top_k=k, **heads) for k in (48, 96))
  steps, tokens, lens = 6, ids[None], [len(ids)]
  max_len = len(ids) + steps + 1
  sparse = backends.Runner(model, "sparse", max_len, selector=top48)
  runs = [backends.Runner(model, "tiered", max_len, selector=top96, hot_slots=64,
                          policy=PolicyConfig("rank", rank_depth=96), top_k=48,
                          impl=impl)
          for impl in (ImplConfig(resolve="xla", attention="xla"),
                       ImplConfig(attention="xla", fused=True))]
  for ranked in runs:
    assert_bit_equal_logits(sparse, ranked, tokens, lens, steps)
    assert ranked.cache_stats()["misses"] > 0
  unfused, fused = (r.carry.tier for r in runs)
  for name in ("slot_pos", "lru", "slot_score", "hits", "misses"):
    np.testing.assert_array_equal(getattr(fused, name), getattr(unfused, name),
                                  err_msg=name)
  with pytest.raises(ValueError, match="rank_depth"):
    backends.Runner(model, "tiered", max_len, selector=top96, hot_slots=64,
                    policy=PolicyConfig("rank", rank_depth=80), top_k=48).prefill(
                        tokens, lens)
  # Ranked no deeper than its selection, "rank" would evict as "freq" does.
  for depth in (0, 48):
    with pytest.raises(ValueError, match="deeper than the selection"):
      backends.Runner(model, "tiered", max_len, selector=top48, hot_slots=64,
                      policy=PolicyConfig("rank", rank_depth=depth)).prefill(tokens, lens)


@dataclasses.dataclass(frozen=True)
class RefuseAt:
  """``inner``'s selection, out of range at ``layer`` (a selector bug)."""
  inner: Any
  layer: int

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def select(self, state, layer, inputs, params=None):
    picked, state = self.inner.select(state, layer, inputs, params)
    return jnp.where(inputs.layer == self.layer, picked.at[..., 0].set(10_000),
                     picked), state


@pytest.mark.parametrize("name", ["nsa", pytest.param("quest", marks=pytest.mark.slow)])
def test_a_refused_step_retried_keeps_parity(model_and_prompt, name):
  """Every step first refused at layer 1 (layer 0 has moved its selector state,
  decoding another token), then retried: logits and selector state bit-equal to
  sparse attention's run, which never refused. NSA's block sums and Quest's bounds
  of a partial block or page are what a retry used to fold in twice."""
  _, ids = model_and_prompt
  model, _ = smollm2_or_skip(num_layers=3)
  selector, _ = selector_for(name, model.cfg)
  steps, tokens, lens = 5, np.stack([ids, np.roll(ids, 7)]), [len(ids), len(ids) - 150]
  max_len = len(ids) + steps + 1
  sparse = backends.Runner(model, "sparse", max_len, selector=selector)
  tiered = backends.Runner(model, "tiered", max_len, selector=selector,
                           hot_slots=selector.top_k,
                           impl=ImplConfig(resolve="xla", attention="xla"))
  ref = sparse.prefill(tokens, lens)
  np.testing.assert_array_equal(tiered.prefill(tokens, lens), ref)
  refusing = driver.TieredDriver(tiered.tier_cfg, functools.partial(
      backends._run_tiered, model.cfg, tiered.tier_cfg, RefuseAt(selector, 1),
      tiered.weights))
  for _ in range(steps):
    token = jnp.argmax(ref, -1)
    refusing.start(tiered.seq_len)
    with pytest.raises(driver.StepRefused, match="out of range") as err:
      refusing.step(tiered.carry, (token + 1) % model.cfg.vocab_size)
    tiered.carry = err.value.state
    ref = sparse.step(token)
    np.testing.assert_array_equal(np.asarray(tiered.step(token)), np.asarray(ref))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(tiered.carry.sel),
                 jax.device_get(sparse.carry.sel))
  assert tiered.cache_stats()["misses"] > 0


def test_the_draft_pass_leaves_the_score_ema_to_the_real_step(model_and_prompt):
  """The look-ahead's uncommitted draft pass under the freq policy: the score EMA
  moves once per step, with what the step selected. After the pass every slot it
  did not refill keeps its score bit for bit; the refilled ones restart as a
  prefetch does."""
  _, ids = model_and_prompt
  model, _ = smollm2_or_skip(num_layers=3)
  selector, _ = selector_for("quest", model.cfg)
  runner = backends.Runner(model, "tiered", len(ids) + 8, selector=selector,
                           hot_slots=selector.top_k, lookahead="draft", policy="freq")
  logits = runner.prefill(ids[None], [len(ids)])
  for _ in range(3):
    logits = runner.step(jnp.argmax(logits, -1))
  before = jax.device_get(runner.carry.tier)
  copy = jax.tree.map(jnp.copy, runner.carry)
  after = jax.device_get(backends.tiered_draft_pass(
      model.cfg, runner.tier_cfg, selector, runner.weights,
      jnp.asarray([ids[5]], jnp.int32), copy).tier)
  refilled = after.slot_pos != before.slot_pos
  assert refilled.any() and (np.asarray(after.prefetched) > np.asarray(before.prefetched)).any()
  np.testing.assert_array_equal(after.slot_score[~refilled], before.slot_score[~refilled])
  np.testing.assert_array_equal(after.slot_score[refilled], 1.0)


def test_a_request_without_its_next_page_sits_the_draft_pass_out(model_and_prompt):
  """A serving batch drafts while some request's next position has no host page
  yet (the engine allocates it before the real step): that request's row is left
  out of the pass, untouched, and the others still fetch ahead (the whole pass
  refused, before)."""
  _, ids = model_and_prompt
  model, _ = smollm2_or_skip(num_layers=3)
  selector, _ = selector_for("quest", model.cfg)
  runner = backends.Runner(model, "tiered", len(ids) + 8, selector=selector,
                           hot_slots=selector.top_k)
  logits = runner.prefill(np.stack([ids, np.roll(ids, 7)]), [len(ids), len(ids)])
  for _ in range(2):
    logits = runner.step(jnp.argmax(logits, -1))
  carry, cfg = runner.carry, runner.tier_cfg
  table = np.asarray(carry.tier.page_table).copy()
  table[1, int(runner.seq_len[1]) // cfg.page_size] = -1
  carry = carry.replace(tier=carry.tier.replace(page_table=jnp.asarray(table)))
  before = jax.device_get(carry.tier)
  after = backends.tiered_draft_pass(model.cfg, cfg, selector, runner.weights,
                                     jnp.asarray([ids[5], ids[9]], jnp.int32),
                                     jax.tree.map(jnp.copy, carry))
  assert int(after.status) == 0
  tier = jax.device_get(after.tier)
  assert (tier.prefetched[:, 0] > before.prefetched[:, 0]).any()
  for name in ("slot_pos", "prefetched", "hits", "misses"):  # [L, R, ...]
    np.testing.assert_array_equal(getattr(tier, name)[:, 1], getattr(before, name)[:, 1],
                                  name)
  assert tier.seq_len.tolist() == before.seq_len.tolist()


@pytest.mark.parametrize("name", ["dsa"])  # the selector that also reads x
def test_model_step_is_the_library_step(model_and_prompt, name):
  """The model's tiered step and ``decode.decode_step`` run the same per-layer
  path: fed the layers' inputs the model computed, the library step returns the
  model's attention outputs and the same carry (cache, selector state), bit for
  bit, with index sharing and a keyed policy on."""
  model, ids = model_and_prompt
  selector, params = selector_for(name, model.cfg)
  lens = np.array([len(ids), len(ids) - 100])
  tokens = np.stack([ids, np.roll(ids, 5)])
  runner = backends.Runner(model, "tiered", len(ids) + 4, selector=selector,
                           selector_params=params, hot_slots=selector.top_k,
                           index_share=3, policy="freq", impl=ImplConfig(resolve="xla"))
  logits = runner.prefill(tokens, lens)
  runner.step(jnp.argmax(logits, -1))  # both sides start from a decoded step
  cfg, tier_cfg = model.cfg, runner.tier_cfg
  copy = lambda: jax.tree.map(jnp.copy, runner.carry)
  token = jnp.asarray([11, 22], jnp.int32)
  start = kv_decode.begin_step(tier_cfg, copy())
  _, model_carry, trace = transformer.apply_decode(
      cfg, runner.weights, token, start.tier.seq_len, start,
      kv_decode.tiered_attend(tier_cfg, selector), return_trace=True)
  model_carry = kv_decode.commit_step(model_carry)
  out, lib_carry = kv_decode.decode_step(tier_cfg, selector, copy(), trace.q,
                                         trace.k_new, trace.v_new, trace.x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(trace.out))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(lib_carry),
               jax.device_get(model_carry))
  assert int(lib_carry.tier.misses.sum()) > int(runner.carry.tier.misses.sum())


@pytest.mark.parametrize("index_share, overlap, fused", [
    (1, False, False), (2, False, False), (1, True, False), (2, True, False),
    (1, False, True), (2, False, True)])
def test_cpu_model_step_writes_the_hot_cache_in_place(index_share, overlap, fused):
  """SmolLM2's tiered step (4 layers, abstract weights) compiled for this CPU copies
  no whole hot cache, with index sharing and the overlapped hit/miss attention:
  off GPU their writes go before the attention reads (a write after a read, with
  no data order, made XLA:CPU keep the read version by copying the cache: 4
  copies per step); nor does the fused step (the native call, in place)."""
  from experiments import hlo_audit
  from kvtier_jax import state as kv_state
  from models.config import ModelConfig
  from models.transformer import Transformer
  cfg = ModelConfig.smollm2_135m().replace(num_layers=4)
  num_req, max_len = 2, 1024
  selector = sel_lib.QuestSelector(token_budget=64, num_kv_heads=cfg.num_kv_heads,
                                   q_per_kv=cfg.q_per_kv, head_dim=cfg.head_dim)
  tier_cfg = backends.tier_config(cfg, selector, num_req, max_len, 128,
                                  impl=ImplConfig(resolve="xla", attention="xla",
                                                  fetch="xla", fused=fused),
                                  index_share=index_share, overlap_hit_miss=overlap)
  weights = {name: jax.ShapeDtypeStruct(dims, jnp.dtype(cfg.dtype))
             for name, dims in Transformer.param_shapes(cfg).items()}
  hlo = backends.tiered_step.lower(
      cfg, tier_cfg, selector, weights, jax.ShapeDtypeStruct((num_req,), jnp.int32),
      hlo_audit.abstract_tiered_carry(cfg, tier_cfg, selector, weights)
  ).compile().as_text()
  if fused:  # off GPU the native call, where it builds
    from pallas_kernels.fused_resolve import native
    assert ("kvtier_resolve_fetch" in hlo) == native.available()
  shape = kv_state.hot_cache_shape(tier_cfg)
  dtype = hlo_audit.hlo_dtype(tier_cfg)
  assert hlo_audit.count_copies(hlo, shape, dtype) == 0
  assert f"{dtype}[{','.join(map(str, shape))}]" in hlo  # the shape is matched at all


def test_draft_lookahead_without_a_cap_fetches_every_miss():
  """``lookahead_cap=None`` means no cap (TierConfig's docstring), not a cap of 0:
  the draft pass then prefetches what a cap of k would, and more than a cap of 1.
  Random weights: this checks the traffic, not the numbers."""
  from flax import nnx
  from models import transformer as tfm
  from models.config import ModelConfig
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=2,
                                 num_q_heads=4, num_kv_heads=2, head_dim=16,
                                 ffn_hidden_dim=48, name="tiny")
  model = tfm.Transformer(cfg, rngs=nnx.Rngs(0))
  selector, _ = selector_for("quest", cfg)
  rng = np.random.default_rng()
  tokens = rng.integers(0, cfg.vocab_size, (2, 200))
  # Random tokens fed (not the argmax): a random model's greedy output can settle
  # so that each draft selects only what is resident and the newest position (one
  # row per step whatever the cap: seen once in CI).
  feed = rng.integers(0, cfg.vocab_size, (6, 2))
  prefetched = {}
  for cap in (None, selector.top_k, 1):
    runner = backends.Runner(model, "tiered", 216, selector=selector, hot_slots=96,
                             lookahead="draft", lookahead_cap=cap)
    runner.prefill(tokens, [200, 180])
    for step_tokens in feed:
      runner.step(step_tokens)
    prefetched[cap] = runner.cache_stats()["prefetched"]
  assert prefetched[None] == prefetched[selector.top_k] > prefetched[1] > 0, prefetched


def test_draft_head_lookahead_drafts_lookup_else_head_from_causal_features():
  """``Runner(lookahead="draft", draft_head=...)``: each step's draft is
  ``lookup_or_head(ngram_match(history), head token)`` (without a head, prompt
  lookup's), the head fed the features of the position before the one decoded and
  that position's token (known as the step begins), checked against features from
  a teacher-forced forward pass (``apply_features``); logits stay those of the
  plain tiered run. Random weights and a random head: this checks the plumbing,
  not the draft's quality."""
  from flax import nnx
  from models import draft_head as draft_lib
  from models import transformer as tfm
  from models.config import ModelConfig
  cfg = ModelConfig.smollm2_135m(vocab_size=64, embed_dim=32, num_layers=2,
                                 num_q_heads=4, num_kv_heads=2, head_dim=16,
                                 ffn_hidden_dim=48, name="tiny")
  model = tfm.Transformer(cfg, rngs=nnx.Rngs(0))
  head = draft_lib.DraftHead(cfg.embed_dim, 24, rngs=nnx.Rngs(1))
  head.down.kernel[...] = jax.random.normal(jax.random.key(2), head.down.kernel.shape)
  # The oracle over k >= every position: sparse attention is dense (to f32
  # rounding), so teacher-forced dense features are the decode's.
  selector = sel_lib.OracleSelector(top_k=128, num_kv_heads=2, q_per_kv=2, head_dim=16)
  rng = np.random.default_rng()
  prompt = rng.integers(0, cfg.vocab_size, (2, 120))
  lens = [120, 97]
  runners = [backends.Runner(model, "tiered", 140, selector=selector, hot_slots=128,
                             lookahead="draft", **extra)
             for extra in ({}, dict(draft_head=head))]
  for r in runners:
    r.prefill(prompt, lens)
  weights = model.weights()
  # Random tokens (teacher forcing): a random model's greedy text loops, and its
  # loops are prompt lookup's.
  fed = rng.integers(0, cfg.vocab_size, (6, 2))
  # Teacher-forced features of both whole sequences in one causal pass (one
  # compile): f_p depends on tokens <= p only, so the shorter row's random tail
  # (padding it to the longer row's length) is never read.
  whole = np.concatenate([prompt, rng.integers(0, cfg.vocab_size, (2, 12))], axis=1)
  for r, n in enumerate(lens):
    whole[r, n:n + len(fed)] = fed[:, r]
  feats = tfm.apply_features(cfg, weights, jnp.asarray(whole))
  seqs = [list(prompt[r, :n]) for r, n in enumerate(lens)]
  from_head = 0
  for tokens in fed:
    logits = [r.step(tokens) for r in runners]
    np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(logits[0]), atol=1e-5,
                               rtol=0)
    for r in range(2):
      seqs[r].append(int(tokens[r]))
    # f_{p-1} is the feature before the token just decoded (at p = len - 1).
    want = []
    for r, seq in enumerate(seqs):
      assert list(whole[r, :len(seq)]) == seq
      head_token = int(draft_lib.draft_tokens(cfg, weights, head, feats[r, len(seq) - 2],
                                              jnp.asarray(seq[-1])))
      from_head += ngram_match(seq)[1] < 2
      want.append(backends.lookup_or_head(ngram_match(seq), head_token))
    assert runners[1].last_draft == want
    assert runners[0].last_draft == [ngram_match(seq)[0] for seq in seqs]
  assert from_head > 6, from_head  # most drafts were the head's
  with pytest.raises(ValueError, match="draft_head"):
    backends.Runner(model, "tiered", 140, selector=selector, hot_slots=128, draft_head=head)
