"""Indexer distillation (kvtier_jax/selectors/distill.py) on small random arrays.

Targets and recall against float64 numpy brute force written from the
definitions; the KL loss is zero exactly when the indexer reproduces the target;
training lowers it; the distilled scores are the ones ``DSASelector`` ranks; the
checkpoint round trip is exact. No model is needed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax.selectors import distill
from kvtier_jax.selectors.base import PrefillInputs, StepInputs, layer_slice
from kvtier_jax.selectors.dsa import DSASelector, init_indexer_params

R, T, HQ, HKV, D = 2, 12, 4, 2, 8
DM, H_I, D_I, ROPE = 16, 2, 8, 4


def softmax64(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def one_layer(seed=0, **kwargs):
  return layer_slice(init_indexer_params(jax.random.PRNGKey(seed), 1, DM, H_I, D_I,
                                         ROPE, **kwargs), 0)


def rand(*shape):
  """Fresh standard normals (numpy: a jax.random draw compiles per shape, ~1-3 s)."""
  return jnp.asarray(np.random.default_rng().standard_normal(shape, np.float32))


# ---------------------------------------------------------------------------------
# attention_targets
# ---------------------------------------------------------------------------------


def targets_brute_force(q, k, positions, lens):
  """Per query row: mean over query heads of the causal softmax, float64."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  group = q.shape[2] // k.shape[2]
  out = np.zeros(q.shape[:2] + (k.shape[1],))
  for r in range(q.shape[0]):
    for i, pos in enumerate(np.asarray(positions)[r]):
      if pos >= lens[r]:
        continue  # a padding query sees nothing
      visible = np.arange(min(pos + 1, lens[r]))
      for h in range(q.shape[2]):
        logits = k[r, visible, h // group] @ q[r, i, h] / np.sqrt(q.shape[-1])
        out[r, i, visible] += softmax64(logits) / q.shape[2]
  return out


def test_attention_targets_all_positions_match_brute_force():
  q, k = rand(R, T, HQ, D), rand(R, T, HKV, D)
  got = distill.attention_targets(q, k)
  want = targets_brute_force(q, k, np.tile(np.arange(T), (R, 1)), [T] * R)
  np.testing.assert_allclose(got, want, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got).sum(-1), 1.0, atol=1e-5)


def test_attention_targets_subset_rows_and_padding_match_brute_force():
  q, k = rand(R, 3, HQ, D), rand(R, T, HKV, D)
  positions = jnp.array([[0, 5, 11], [2, 7, 9]], jnp.int32)
  lens = np.array([T, 8])  # request 1: keys >= 8 are padding, query 9 is padding
  got = np.asarray(distill.attention_targets(q, k, positions, jnp.asarray(lens)))
  want = targets_brute_force(q, k, positions, lens)
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert np.all(np.isfinite(got))
  assert np.all(got[1, 2] == 0)  # the padding query
  np.testing.assert_allclose(got[1, :2].sum(-1), 1.0, atol=1e-5)


def test_attention_targets_rejects_bad_gqa():
  with pytest.raises(ValueError, match="multiple"):
    distill.attention_targets(rand(1, 4, 3, D), rand(1, 4, 2, D))


# ---------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------


def rows_and_mask(lens=None):
  positions = jnp.array([[1, 4, 8, 11], [0, 3, 6, 10]], jnp.int32)
  return positions, distill.causal_mask(positions, T, lens)


def test_loss_zero_iff_indexer_matches_target():
  params, x = one_layer(0), rand(R, T, DM)
  positions, mask = rows_and_mask()
  scores = distill.prompt_index_scores(params, x, positions, mask)
  target = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
  assert abs(float(distill.distill_loss(params, x, positions, target, mask))) < 1e-6
  # Any other indexer (or the same one against another target) pays a positive KL.
  other = one_layer(1)
  assert float(distill.distill_loss(other, x, positions, target, mask)) > 1e-3
  shifted = jnp.where(mask, jax.nn.softmax(2.0 * scores, axis=-1), 0.0)
  assert float(distill.distill_loss(params, x, positions, shifted, mask)) > 1e-4


def test_loss_matches_numpy_kl_and_ignores_padding_rows():
  params, x = one_layer(0), rand(R, T, DM)
  lens = jnp.array([T, 7])
  positions, mask = rows_and_mask(lens)  # request 1's query at 10 is padding
  target = jax.nn.softmax(jnp.where(mask, rand(R, 4, T), -jnp.inf), -1)
  target = jnp.where(mask, jnp.nan_to_num(target), 0.0)
  scores = np.asarray(distill.prompt_index_scores(params, x, positions, mask),
                      np.float64)
  kls = []
  for r in range(R):
    for i in range(4):
      vis = np.asarray(mask[r, i])
      if vis.any():
        p, logq = np.asarray(target[r, i], np.float64)[vis], scores[r, i, vis]
        logq = logq - logq.max() - np.log(np.exp(logq - logq.max()).sum())
        kls.append(np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - logq),
                                   0.0)))
  got = distill.distill_loss(params, x, positions, target, mask)
  np.testing.assert_allclose(float(got), np.mean(kls), rtol=1e-4, atol=1e-6)
  grads = jax.grad(distill.distill_loss)(params, x, positions, target, mask)
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_training_reduces_loss_on_random_data():
  layers = 2
  x = rand(layers, R, T, DM)
  positions, mask = rows_and_mask()
  target = jax.nn.softmax(jnp.where(mask, 3.0 * rand(layers, R, 4, T), -jnp.inf), -1)
  init = init_indexer_params(jax.random.PRNGKey(9), layers, DM, H_I, D_I, ROPE)
  before = distill.layer_losses(init, x, positions, target, mask)
  result = distill.train_indexer(jax.random.PRNGKey(10), x, target, 40, 3e-2,
                                 query_positions=positions, query_batch=3,
                                 init_params=init)
  after = distill.layer_losses(result.params, x, positions, target, mask)
  assert result.losses.shape == (40, layers)
  assert np.all(np.isfinite(result.losses))
  assert np.all(np.asarray(after) < 0.8 * np.asarray(before)), (before, after)
  # Static fields survive training (they are not trained).
  assert (result.params.rope_dim, result.params.rope_theta) == (ROPE, init.rope_theta)


def test_train_indexer_rejects_mismatched_targets():
  positions, _ = rows_and_mask()
  with pytest.raises(ValueError, match="targets"):
    distill.train_indexer(jax.random.PRNGKey(0), rand(2, R, T, DM),
                          jnp.zeros((2, R, 3, T)), 1, 1e-3, query_positions=positions)


def test_distilled_scores_are_what_dsa_selector_ranks():
  """Scores trained by the loss rank positions exactly as DSASelector.select does."""
  params, x = one_layer(3, rope_theta=100000.0), rand(1, T, DM)
  newest = T - 1
  selector = DSASelector(top_k=5, index_dim=D_I)
  state = selector.init_state(1, 1, T)
  state = selector.prefill(state, 0, PrefillInputs(
      x=x[:, :newest], k=jnp.zeros((1, newest, 1, 1)), lens=jnp.array([newest])),
      params)
  step = StepInputs(x=x[:, newest], q=jnp.zeros((1, 1, 1)), k_new=jnp.zeros((1, 1, 1)),
                    newest=jnp.array([newest]))
  chosen, _ = selector.select(state, 0, step, params)
  positions = jnp.array([[newest]], jnp.int32)
  scores = distill.prompt_index_scores(params, x, positions, distill.causal_mask(
      positions, T))
  _, want = jax.lax.top_k(scores[0, 0], 5)
  np.testing.assert_array_equal(np.asarray(chosen[0, 0]), np.asarray(want))


# ---------------------------------------------------------------------------------
# recall
# ---------------------------------------------------------------------------------


def recall_brute_force(scores, target, k):
  """Mass of ``target`` on the k best ``scores`` (ties to the lower index)."""
  order = np.lexsort((np.arange(scores.size), -scores))  # by score desc, index asc
  return float(target[order[:k]].sum())


@pytest.mark.parametrize("k", [1, 3, 7, T, T + 5])
def test_topk_recall_matches_brute_force(k):
  positions, mask = rows_and_mask()
  target = jnp.where(mask, jax.nn.softmax(jnp.where(mask, rand(R, 4, T), -jnp.inf),
                                          -1), 0.0)
  scores = jnp.where(mask, rand(R, 4, T), -jnp.inf)
  got = np.asarray(distill.topk_recall(scores, target, k))
  want = np.array([[recall_brute_force(np.asarray(scores[r, i]), np.asarray(target[r, i]),
                                       k) for i in range(4)] for r in range(R)])
  np.testing.assert_allclose(got, want, atol=1e-6)
  # Rows with at most k visible positions keep all their mass.
  full = np.asarray(mask.sum(-1)) <= k
  np.testing.assert_allclose(got[full], 1.0, atol=1e-5)


@pytest.mark.parametrize("draw", range(5))  # five fresh targets, ten scores each
def test_oracle_recall_bounds_any_scores(draw):
  del draw
  positions, mask = rows_and_mask()
  target = jnp.where(mask, jax.nn.softmax(
      jnp.where(mask, 3.0 * rand(R, 4, T), -jnp.inf), -1), 0.0)
  oracle = {k: np.asarray(distill.oracle_recall(target, k)) for k in (1, 2, 4, 8)}
  for other in range(10):
    scores = jnp.where(mask, rand(R, 4, T), -jnp.inf)
    for k, best in oracle.items():
      assert np.all(best >= np.asarray(distill.topk_recall(scores, target, k)) - 1e-6)
  assert np.all(np.diff(np.stack(list(oracle.values())), axis=0) >= -1e-6)  # k up


# ---------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------


def test_save_load_round_trip_is_exact(tmp_path):
  params = init_indexer_params(jax.random.PRNGKey(14), 3, DM, H_I, D_I, ROPE,
                               rope_theta=123456.7)
  params = params.replace(k_norm_scale=rand(3, D_I), k_norm_bias=rand(3, D_I),
                          norm_eps=3e-7)
  path = distill.save_indexer(tmp_path / "ckpt", params, metadata={"note": "x"})
  loaded = distill.load_indexer(path)
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (loaded.rope_dim, loaded.rope_theta, loaded.norm_eps) == (ROPE, 123456.7, 3e-7)
  assert distill.load_indexer_config(path)["metadata"] == {"note": "x"}
  # Saving again overwrites in place.
  distill.save_indexer(path, params.replace(wq=params.wq + 1))
  np.testing.assert_array_equal(np.asarray(distill.load_indexer(path).wq),
                                np.asarray(params.wq + 1))


def test_load_rejects_foreign_directory(tmp_path):
  (tmp_path / "indexer.json").write_text('{"format": "other"}')
  with pytest.raises(ValueError, match="format"):
    distill.load_indexer(tmp_path)
