"""Pallas kernels (interpret mode on CPU) against references and float64 oracles, and
their lowering for CUDA (Triton) without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cache_resolve import cache_resolve
from pallas_kernels.fetch import BlockSizes as FetchBlocks
from pallas_kernels.fetch import fetch_rows, fetch_rows_reference
from pallas_kernels.sparse_decode_attention import (BlockSizes, sparse_decode_attention,
                                                    sparse_decode_attention_reference)
from tests import util
from tests.oracles import sparse_attention_oracle

# Tolerances: tests/util.py (one table by dtype).


def make_cache(rng, shape, dtype, poison_slots=()):
  x = rng.standard_normal(shape).astype(np.float32)
  for s in poison_slots:
    x[..., s, :, :] = np.nan
  return jnp.asarray(x, dtype)


def oracle_out(q, k_cache, v_cache, layer, slot):
  """float64 oracle per request via positions == slots of that layer."""
  num_req = q.shape[0]
  _, _, num_units, _, heads, head_dim = k_cache.shape
  outs = []
  for r in range(num_req):
    # [S, U, Hg, D] -> [S, Hkv, D]: unit u owns KV heads u*Hg..(u+1)*Hg-1.
    k = np.asarray(k_cache[layer, r], np.float64).transpose(1, 0, 2, 3).reshape(
        -1, num_units * heads, head_dim)
    v = np.asarray(v_cache[layer, r], np.float64).transpose(1, 0, 2, 3).reshape(
        -1, num_units * heads, head_dim)
    outs.append(sparse_attention_oracle(np.asarray(q[r], np.float64), k, v,
                                        np.asarray(slot[r])))
  return np.stack(outs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("units,heads,group,num_sel,blocks", [
    (1, 2, 4, 37, BlockSizes(16, 2)),   # G=4, k not a multiple of the block
    (2, 1, 3, 20, BlockSizes(16, 1)),   # per-KV-head units, G=3 (padded to 16)
    (1, 3, 3, 64, BlockSizes(32, 2)),   # SmolLM2-like heads: 9 q / 3 kv
])
def test_attention_kernel_matches_oracle(on_gpu, dtype, units, heads, group, num_sel,
                                        blocks):
  rng = np.random.default_rng(num_sel)
  L, R, S, D = 2, 3, 80, 64
  poison = (77, 78, 79)  # never selected: reading them would leak NaN
  shape = (L, R, units, S, heads, D)
  k_cache, v_cache = make_cache(rng, shape, dtype, poison), make_cache(rng, shape, dtype, poison)
  q = jnp.asarray(rng.standard_normal((R, units * heads * group, D)), dtype)
  slot = np.stack([[rng.permutation(77)[:num_sel] for _ in range(units)]
                   for _ in range(R)]).astype(np.int32)
  slot[..., -3:] = -1  # padding
  slot = jnp.asarray(slot)
  want = oracle_out(q, k_cache, v_cache, 1, slot)
  got, lse = sparse_decode_attention(q, k_cache, v_cache, 1, slot, block_sizes=blocks,
                                     interpret=not on_gpu)
  ref, ref_lse = sparse_decode_attention_reference(q, k_cache, v_cache, 1, slot)
  atol = util.atol(dtype)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=atol / 10)
  np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=atol, rtol=atol / 10)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
  again, _ = sparse_decode_attention(q, k_cache, v_cache, 1, slot, block_sizes=blocks,
                                     interpret=not on_gpu)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(again))  # deterministic


def test_attention_with_no_valid_row_is_zero(on_gpu):
  k = jnp.ones((1, 1, 1, 4, 1, 16))
  q = jnp.ones((1, 2, 16))
  slot = jnp.full((1, 1, 3), -1, jnp.int32)
  out, lse = sparse_decode_attention(q, k, k, 0, slot, interpret=not on_gpu)
  np.testing.assert_array_equal(out, 0.0)
  assert np.isneginf(np.asarray(lse)).all()
  ref, _ = sparse_decode_attention_reference(q, k, k, 0, slot)
  np.testing.assert_array_equal(ref, 0.0)


@pytest.mark.parametrize("count", [0, 1, 13, 40])
def test_fetch_kernel_copies_exactly_the_planned_rows(on_gpu, count):
  rng = np.random.default_rng(count)
  L, R, T1, U, Hg, D, S, N = 2, 3, 50, 2, 3, 16, 9, 40
  host = rng.standard_normal((L, R, T1, U, Hg, D)).astype(np.float32)
  hot = np.full((L, R, U, S, Hg, D), np.nan, np.float32)
  src = np.stack([rng.integers(0, L, N), rng.integers(0, R, N), rng.integers(0, T1, N),
                  rng.integers(0, U, N)], -1).astype(np.int32)
  cells = [(l, r, u, s) for l in range(L) for r in range(R) for u in range(U)
           for s in range(S)]
  dest = np.array([cells[i] for i in rng.permutation(len(cells))[:N]], np.int32)
  args = [jnp.asarray(x) for x in (src, dest, count, host, host + 1)]
  want = fetch_rows_reference(*args, jnp.asarray(hot), jnp.asarray(hot))
  got = fetch_rows(*args, jnp.asarray(hot), jnp.asarray(hot), block_sizes=FetchBlocks(8),
                   interpret=not on_gpu)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # Independent check: exactly `count` rows are finite, equal to their sources.
  got_k = np.asarray(got[0])
  assert np.isfinite(got_k).all(axis=(-1, -2)).sum() == count
  for (l, r, p, u), (dl, dr, du, ds) in zip(src[:count], dest[:count]):
    np.testing.assert_array_equal(got_k[dl, dr, du, ds], host[l, r, p, u])


def test_fetch_kernel_rejects_odd_head_dim():
  hot = jnp.zeros((1, 1, 1, 4, 1, 12))
  host = jnp.zeros((1, 1, 5, 1, 1, 12))
  z = jnp.zeros((4, 4), jnp.int32)
  with pytest.raises(ValueError, match="power of 2"):
    fetch_rows(z, z, 1, host, host, hot, hot, interpret=True)


def _lower_for_cuda(fn, *args):
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


def test_every_kernel_lowers_for_cuda_via_triton():
  """A kernel that Triton cannot express fails here, on a CPU-only machine."""
  f = jax.ShapeDtypeStruct
  i32 = jnp.int32
  texts = {
      "cache_resolve": _lower_for_cuda(
          lambda *a: cache_resolve(*a, interpret=False),
          f((6, 640), i32), f((6, 640), i32), f((6, 512), i32), f((6,), i32)),
      "sparse_decode_attention": _lower_for_cuda(
          lambda *a: sparse_decode_attention(*a, interpret=False),
          f((4, 9, 64), jnp.bfloat16), f((2, 4, 1, 129, 3, 64), jnp.bfloat16),
          f((2, 4, 1, 129, 3, 64), jnp.bfloat16), f((), i32), f((4, 1, 100), i32)),
      "fetch_rows": _lower_for_cuda(
          lambda *a: fetch_rows(*a, interpret=False),
          f((64, 4), i32), f((64, 4), i32), f((), i32),
          f((2, 4, 65, 1, 3, 64), jnp.bfloat16), f((2, 4, 65, 1, 3, 64), jnp.bfloat16),
          f((2, 4, 1, 33, 3, 64), jnp.bfloat16), f((2, 4, 1, 33, 3, 64), jnp.bfloat16)),
  }
  for name, text in texts.items():
    assert "__gpu$xla.gpu.triton" in text, f"{name} did not lower to a Triton call"
