"""Kernels and the tiered step at device shapes: what a lent GPU must confirm first.

On CPU these run small, with the Pallas kernels interpreted. Under ``pytest --gpu``
(``experiments/gpu_check.py`` runs them so) they run compiled at the shapes the
benchmarks use, the host tier in ``pinned_host`` memory: RESOLVE kernel vs its
reference (exact), attention kernel vs reference (tolerance table), and the
zero-copy fetch reading the pinned host tier (exact, also past a 4 GiB offset).
The tiered step with every kernel vs full KV is
``test_decode.py::test_kernel_paths_match_reference`` (compiled under ``--gpu``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax import state as kv_state
from pallas_kernels.cache_resolve import cache_resolve, cache_resolve_reference
from pallas_kernels.fetch import fetch_rows, fetch_rows_reference
from pallas_kernels.sparse_decode_attention import (sparse_decode_attention,
                                                    sparse_decode_attention_reference)
from tests.util import atol


@pytest.mark.parametrize("scale", ["big", "small"])
def test_resolve_kernel_equals_reference(on_gpu, scale):
  if not on_gpu and scale == "small":
    pytest.skip("one CPU shape (interpreted)")
  rows, slots, sel, steps = {("big", True): (64, 4096, 2048, 8),
                             ("small", True): (8, 640, 512, 4)}.get(
                                 (scale, on_gpu), (8, 40, 24, 4))
  rng = np.random.default_rng()
  slot_pos = jnp.full((rows, slots), -1, jnp.int32)
  lru = jnp.tile(jnp.arange(slots, dtype=jnp.int32), (rows, 1))
  ctx = 4 * slots
  for step in range(steps):
    newest = jnp.full((rows,), ctx + step, jnp.int32)
    centre = rng.integers(0, ctx, rows)
    cand = np.stack([rng.permutation(np.arange(max(0, c - sel), min(ctx, c + sel)))[:sel]
                     for c in centre])
    cand[:, 0] = ctx + step
    cand = np.where(rng.random(cand.shape) < 0.05, -1, cand).astype(np.int32)
    want = cache_resolve_reference(slot_pos, lru, jnp.asarray(cand), newest)
    got = cache_resolve(slot_pos, lru, jnp.asarray(cand), newest, interpret=not on_gpu)
    for name, w, g in zip(want._fields, want, got):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    slot_pos, lru = want.slot_pos, want.lru
  assert (np.asarray(slot_pos) >= 0).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_kernel_at_device_shape(on_gpu, dtype):
  rng = np.random.default_rng()
  L, R, U, S, Hg, D, Hq, k = (2, 8, 1, 1025, 4, 128, 32, 512) if on_gpu else (
      2, 2, 1, 65, 2, 32, 4, 24)
  kc, vc = (jnp.asarray(rng.standard_normal((L, R, U, S, Hg, D)), dtype) for _ in "kv")
  q = jnp.asarray(rng.standard_normal((R, Hq, D)), dtype)
  slot = np.stack([rng.permutation(S)[:k] for _ in range(R)])[:, None].astype(np.int32)
  slot[:, :, -7:] = -1
  ref, ref_lse = sparse_decode_attention_reference(q, kc, vc, 1, jnp.asarray(slot))
  got, lse = sparse_decode_attention(q, kc, vc, 1, jnp.asarray(slot),
                                     interpret=not on_gpu)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                             atol=atol(dtype), rtol=atol(dtype) / 10)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5 if dtype == jnp.float32 else 1e-2)


def test_zero_copy_fetch_reads_the_host_tier(on_gpu):
  rng = np.random.default_rng()
  L, R, T1, U, Hg, D, S, N = (2, 4, 4097, 1, 4, 128, 257, 1000) if on_gpu else (
      2, 3, 129, 1, 2, 16, 33, 100)
  host = np.asarray(rng.standard_normal((L, R, T1, U, Hg, D)), np.float32)
  hs = kv_state.host_sharding()
  hk, hv = jax.device_put(host, hs), jax.device_put(host + 1, hs)
  hot = jnp.full((L, R, U, S, Hg, D), jnp.nan, jnp.float32)
  src = np.stack([rng.integers(0, L, N), rng.integers(0, R, N), rng.integers(0, T1, N),
                  np.zeros(N)], -1).astype(np.int32)
  cells = [(l, r, 0, s) for l in range(L) for r in range(R) for s in range(S)]
  dest = np.array([cells[i] for i in rng.permutation(len(cells))[:N]], np.int32)
  count = 7 * N // 9
  want = fetch_rows_reference(jnp.asarray(src), jnp.asarray(dest), count,
                              jnp.asarray(host), jnp.asarray(host + 1), hot, hot)
  got = fetch_rows(jnp.asarray(src), jnp.asarray(dest), count, hk, hv, jnp.array(hot),
                   jnp.array(hot), interpret=not on_gpu)
  assert hk.sharding.memory_kind == kv_state.host_memory_kind()
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_zero_copy_fetch_past_4gib(on_gpu):
  """A pinned host tier over 4 GiB (Pallas Triton's 64-bit offsets) on a GPU; the
  same code path at a small size on CPU."""
  R, T1, Hg, D = (3, 2**20 + 1, 4, 128) if on_gpu else (2, 1025, 2, 8)
  shape = (1, R, T1, 1, Hg, D)
  ident = lambda: (jnp.arange(R, dtype=jnp.float32)[:, None] * T1
                   + jnp.arange(T1, dtype=jnp.float32)[None, :])  # exact below 2**24
  make = jax.jit(lambda: jnp.broadcast_to(ident()[None, :, :, None, None, None], shape))
  hs = kv_state.host_sharding()
  hk, hv = jax.device_put(make(), hs), jax.device_put(-make(), hs)
  rng = np.random.default_rng()
  N, S = 4096, 4097
  r = rng.integers(0, R, N)
  t = np.where(rng.random(N) < 0.8, rng.integers(T1 // 2, T1, N), rng.integers(0, T1, N))
  src = np.stack([np.zeros(N), r, t, np.zeros(N)], -1).astype(np.int32)
  dest = np.stack([np.zeros(N), np.zeros(N), np.zeros(N),
                   rng.permutation(S)[:N]], -1).astype(np.int32)
  hot = jnp.full((1, 1, 1, S, Hg, D), jnp.nan, jnp.float32)
  got_k, got_v = fetch_rows(jnp.asarray(src), jnp.asarray(dest), N, hk, hv, hot,
                            jnp.array(hot), interpret=not on_gpu)
  want = np.full((S,), np.nan, np.float32)
  want[dest[:, 3]] = r * T1 + t
  want = np.broadcast_to(want[:, None, None], (S, Hg, D))
  np.testing.assert_array_equal(np.asarray(got_k[0, 0, 0]), want)
  np.testing.assert_array_equal(np.asarray(got_v[0, 0, 0]), -want)
  if on_gpu:
    assert ((r * T1 + t) * Hg * D * 4 >= 2**32).any(), "no row past the 4 GiB offset"
