"""Recall bookkeeping of the trace runner against a float64 numpy computation."""

import jax.numpy as jnp
import numpy as np

from experiments.analysis.tracing import attention_mass, covered_mass


def test_attention_mass_and_covered_mass_match_numpy():
  rng = np.random.default_rng(0)
  R, T, Hkv, G, D = 2, 12, 3, 2, 8
  q = rng.standard_normal((R, Hkv * G, D))
  k = rng.standard_normal((R, T, Hkv, D))
  k[0, 9:] = np.nan  # past lens: never read
  lens = np.array([8, 11])
  mass = np.asarray(attention_mass(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                   jnp.asarray(lens)))
  want = np.zeros((R, T))
  for r in range(R):
    for h in range(Hkv * G):
      logits = np.array([q[r, h] @ k[r, t, h // G] for t in range(lens[r] + 1)]) / np.sqrt(D)
      p = np.exp(logits - logits.max())
      want[r, :lens[r] + 1] += p / p.sum() / (Hkv * G)
  np.testing.assert_allclose(mass, want, atol=1e-6)
  positions = np.array([[[0, 3, -1], [3, 5, 7]], [[10, -1, -1], [2, 1, -1]]])
  got = np.asarray(covered_mass(jnp.asarray(mass), jnp.asarray(positions)))
  np.testing.assert_allclose(got, [want[0, [0, 3, 5, 7]].sum(), want[1, [10, 2, 1]].sum()],
                             atol=1e-6)
