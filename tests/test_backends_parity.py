"""Sparse (full KV) vs tiered backends on the real model: identical logits for every
selector, unfused and with the fused layer kernels."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax.config import ImplConfig
from models import backends
from tests.test_backends import assert_bit_equal_logits, selector_for


# Quest, DSA and NSA here; the per-KV-head Quest and the oracle in the slow tier.
@pytest.mark.parametrize("name,slots_per_k", [
    ("quest", 1), pytest.param("quest_kv", 2, marks=pytest.mark.slow), ("dsa", 1),
    ("nsa", 1), pytest.param("oracle", 2, marks=pytest.mark.slow)])
def test_tiered_equals_sparse_on_smollm2(model_and_prompt, name, slots_per_k):
  model, ids = model_and_prompt
  selector, params = selector_for(name, model.cfg)
  steps, lens = 6, np.array([len(ids), len(ids) - 150])
  tokens = np.stack([ids, np.roll(ids, 7)])
  max_len = len(ids) + steps + 1
  sparse = backends.Runner(model, "sparse", max_len, selector=selector,
                           selector_params=params)
  tiered = backends.Runner(model, "tiered", max_len, selector=selector,
                           selector_params=params, hot_slots=slots_per_k * selector.top_k)
  ref, got = sparse.prefill(tokens, lens), tiered.prefill(tokens, lens)
  np.testing.assert_array_equal(ref, got)
  for step in range(steps):
    token = jnp.argmax(ref, axis=-1)
    ref, got = sparse.step(token), tiered.step(token)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    if step == 0:  # the step compiles once: later calls (committed tokens) reuse it
      compiled = backends.tiered_step._cache_size()
  assert backends.tiered_step._cache_size() == compiled
  stats = tiered.cache_stats()
  assert stats["misses"] > 0, "the test must exercise fetches"
  assert stats["device_kv_bytes_per_request"] < sparse.cache_stats()[
      "device_kv_bytes_per_request"]


@pytest.mark.parametrize("name", ["quest", pytest.param("quest_kv", marks=pytest.mark.slow)])
def test_fused_layer_kernels_on_smollm2_give_the_sparse_logits(model_and_prompt, name):
  """impl.fused (on CPU the native call) on real weights: logits bit-equal to
  sparse attention over the full KV (XLA attention on both sides), with misses."""
  model, ids = model_and_prompt
  selector, params = selector_for(name, model.cfg)
  steps, tokens, lens = 5, np.stack([ids, np.roll(ids, 5)]), [len(ids), len(ids) - 90]
  max_len = len(ids) + steps + 1
  sparse = backends.Runner(model, "sparse", max_len, selector=selector)
  fused = backends.Runner(model, "tiered", max_len, selector=selector,
                          hot_slots=selector.top_k,
                          impl=ImplConfig(attention="xla", fused=True))
  assert_bit_equal_logits(sparse, fused, tokens, lens, steps)
  assert fused.cache_stats()["misses"] > 0
