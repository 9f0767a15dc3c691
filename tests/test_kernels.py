"""Pallas kernels (interpret mode on CPU) against references and float64 oracles, and
their lowering for CUDA (Triton) without a GPU."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import deviceless
from pallas_kernels import common, fused_resolve
from pallas_kernels.cache_resolve import cache_resolve
from pallas_kernels.fetch import BlockSizes as FetchBlocks
from pallas_kernels.fetch import (fetch_rows, fetch_rows_reference, gather_rows,
                                  gather_rows_reference)
from pallas_kernels.fused_resolve import native
from pallas_kernels.sparse_decode_attention import (BlockSizes, gather_slots,
                                                    sparse_decode_attention,
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


def test_the_attention_over_row_tiles_gives_a_request_the_same_bits_at_any_batch():
  """``TierConfig.row_tile``: the XLA attention over tiles of requests gives each
  request the float64 oracle's output (to f32 rounding) and the same bits whatever
  the batch (1, 3 and a drawn R of requests; SmolLM2's heads, k = 256: untiled,
  XLA:CPU computes request 0 otherwise at 1 request than at 3); every path takes
  it: the hot cache's (``hot_attention``), given rows and the full-KV reference's."""
  from kvtier_jax import attention
  rng = np.random.default_rng()
  tile, num_sel, slots = int(rng.integers(2, 9)), 256, 300
  most = int(rng.integers(4, 12))
  q = jnp.asarray(rng.standard_normal((most, 9, 64)), jnp.float32)
  shape = (2, most, 1, slots + 1, 3, 64)  # [L, R, U, S, Hg, D]; slot S - 1: scratch
  hot_k, hot_v = (make_cache(rng, shape, jnp.float32, poison_slots=(slots,))
                  for _ in range(2))
  slot = np.stack([rng.permutation(slots)[:num_sel] for _ in range(most)])[:, None]
  slot[:, :, -int(rng.integers(1, 9)):] = -1  # padding
  cfg = util.tier_cfg("xla", num_layers=2, num_requests=most, max_len=slots,
                      num_q_heads=9, num_kv_heads=3, head_dim=64, hot_slots=slots,
                      top_k=num_sel, row_tile=tile)
  want = oracle_out(q, hot_k, hot_v, 1, slot)
  first = None
  for num_req in sorted({1, 3, most}):
    cut = lambda x: x[:, :num_req]
    small = dataclasses.replace(cfg, num_requests=num_req)
    hot, _ = jax.jit(lambda *a: attention.hot_attention(small, *a))(
        q[:num_req], cut(hot_k), cut(hot_v), 1, jnp.asarray(slot[:num_req]))
    rows = jax.jit(lambda q, k, v, m: attention.rows_attention(q, k, v, m, tile))(
        q[:num_req], *gather_slots(cut(hot_k), cut(hot_v), 1, jnp.asarray(slot[:num_req])))
    full = jax.jit(lambda q, k, v, p: attention.full_kv_attention(q, k, v, 1, p, tile))(
        q[:num_req], jnp.moveaxis(cut(hot_k)[..., :slots, :, :], 2, 3),
        jnp.moveaxis(cut(hot_v)[..., :slots, :, :], 2, 3), jnp.asarray(slot[:num_req]))
    np.testing.assert_allclose(np.asarray(hot), want[:num_req], rtol=0, atol=2e-5)
    for other in (rows[0], full[0]):
      np.testing.assert_array_equal(other, hot)
    first = np.asarray(hot[0]) if first is None else first
    np.testing.assert_array_equal(hot[0], first, err_msg=f"{num_req} requests, tile {tile}")


# (KV dtype, query dtype): bf16 KV under f32 queries must stay at f32 rounding (the
# kernel once rounded the softmax weights to bf16 for p @ V: 1.5e-3 off).
@pytest.mark.parametrize("dtype,q_dtype", [(jnp.float32, jnp.float32),
                                           (jnp.bfloat16, jnp.bfloat16),
                                           (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("units,heads,group,num_sel,blocks", [
    (1, 2, 4, 37, BlockSizes(16, 2)),   # G=4, k not a multiple of the block
    (2, 1, 3, 20, BlockSizes(16, 1)),   # per-KV-head units, G=3 (padded to 16)
    (1, 3, 3, 64, BlockSizes(32, 2)),   # SmolLM2-like heads: 9 q / 3 kv
])
def test_attention_kernel_matches_oracle(on_gpu, dtype, q_dtype, units, heads, group,
                                        num_sel, blocks):
  rng = np.random.default_rng(num_sel)
  L, R, S, D = 2, 3, 80, 64
  shape = (L, R, units, S, heads, D)
  slot = np.stack([[rng.permutation(77)[:num_sel] for _ in range(units)]
                   for _ in range(R)]).astype(np.int32)
  slot[..., -3:] = -1  # padding
  # Every slot a row does not select is NaN (slot 0 too, which padding lanes may
  # load): reading one would leak into the output.
  unread = np.ones((R, units, S), bool)
  for r, u in np.ndindex(R, units):
    unread[r, u, slot[r, u][slot[r, u] >= 0]] = False
  k_cache, v_cache = make_cache(rng, shape, dtype), make_cache(rng, shape, dtype)
  k_cache = k_cache.at[1].set(jnp.where(unread[..., None, None], jnp.nan, k_cache[1]))
  v_cache = v_cache.at[1].set(jnp.where(unread[..., None, None], jnp.nan, v_cache[1]))
  q = jnp.asarray(rng.standard_normal((R, units * heads * group, D)), q_dtype)
  slot = jnp.asarray(slot)
  want = oracle_out(q, k_cache, v_cache, 1, slot)
  got, lse = sparse_decode_attention(q, k_cache, v_cache, 1, slot, block_sizes=blocks,
                                     interpret=not on_gpu)
  ref, ref_lse = sparse_decode_attention_reference(q, k_cache, v_cache, 1, slot)
  assert got.dtype == ref.dtype == q_dtype
  atol = util.atol(q_dtype)  # the output's dtype: bf16 rounds it, f32 must not
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


@pytest.mark.parametrize("count", [0, 1, 13, 40])
def test_gather_kernel_stages_exactly_the_planned_rows(on_gpu, count):
  """The staging gather (the second-stream fetch): lanes < count hold their host
  rows, equal to the reference and to a numpy read row by row; lanes past count are
  unspecified (never read by the step) and not compared."""
  rng = np.random.default_rng(100 + count)
  L, NH, Pg, U, Hg, D, N = 2, 5, 8, 2, 3, 16, 40
  host = rng.standard_normal((L, NH, Pg, U, Hg, D)).astype(np.float32)
  host[:, 0] = np.nan  # rows no plan names: a stray read shows up as NaN
  src = np.stack([rng.integers(0, L, N), rng.integers(1, NH, N), rng.integers(0, Pg, N),
                  rng.integers(0, U, N)], -1).astype(np.int32)
  args = [jnp.asarray(x) for x in (src, count, host, host + 1)]
  want = gather_rows_reference(*args)
  got = gather_rows(*args, block_sizes=FetchBlocks(8), interpret=not on_gpu)
  assert got.shape == want.shape == (2, N, Hg, D)  # K then V
  for w, g, h in zip(want, got, (host, host + 1)):
    assert g.shape == (N, Hg, D)
    np.testing.assert_array_equal(np.asarray(g)[:count], np.asarray(w)[:count])
    for lane, (l, page, off, u) in enumerate(src[:count]):  # numpy, row by row
      np.testing.assert_array_equal(np.asarray(g)[lane], h[l, page, off, u])
  np.testing.assert_array_equal(np.asarray(want[0])[count:], 0.0)
  with pytest.raises(ValueError, match="multiple"):
    gather_rows(*[jnp.asarray(x) for x in (src[:36], count, host, host)],
                block_sizes=FetchBlocks(8), interpret=True)


def test_fetch_kernel_rejects_odd_head_dim():
  hot = jnp.zeros((1, 1, 1, 4, 1, 12))
  host = jnp.zeros((1, 1, 5, 1, 1, 12))
  z = jnp.zeros((4, 4), jnp.int32)
  with pytest.raises(ValueError, match="power of 2"):
    fetch_rows(z, z, 1, host, host, hot, hot, interpret=True)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="always a GPU there")
def test_tracing_for_gpu_picks_the_gpu_paths_until_it_exits():
  """The deviceless audit compiles what a GPU run traces (``on_gpu`` decides the
  fetch path, "auto" and interpret mode), and the CPU's choices come back after,
  an exception included."""
  assert not common.on_gpu() and common.interpret_mode()
  with pytest.raises(RuntimeError):
    with common.tracing_for_gpu():
      assert common.on_gpu() and not common.interpret_mode()
      assert common.use_kernel("auto", "fetch") == (common.GPU_AUTO["fetch"] == "pallas")
      with common.tracing_for_gpu():  # nested: the outer one still holds after
        pass
      assert common.on_gpu()
      raise RuntimeError
  assert not common.on_gpu() and common.interpret_mode()
  assert not common.use_kernel("auto", "fetch")


def _lower_for_cuda(fn, *args):
  return deviceless.lower_for_cuda(fn, *args).as_text()  # for an H200, no GPU


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
      "gather_rows": _lower_for_cuda(
          lambda *a: gather_rows(*a, interpret=False),
          f((64, 4), i32), f((), i32),
          f((2, 4, 65, 1, 3, 64), jnp.bfloat16), f((2, 4, 65, 1, 3, 64), jnp.bfloat16)),
      "fetch_rows": _lower_for_cuda(
          lambda *a: fetch_rows(*a, interpret=False),
          f((64, 4), i32), f((64, 4), i32), f((), i32),
          f((2, 4, 65, 1, 3, 64), jnp.bfloat16), f((2, 4, 65, 1, 3, 64), jnp.bfloat16),
          f((2, 4, 1, 33, 3, 64), jnp.bfloat16), f((2, 4, 1, 33, 3, 64), jnp.bfloat16)),
  }
  L, R, U, B, k, Hg, D, T = 2, 4, 1, 640, 512, 3, 64, 1024
  cache = fused_resolve.CacheArrays(
      f((L, R, U, B), i32), f((L, R, U, B), i32), f((L, R, U, B), jnp.float32),
      f((L, R, U), i32), f((L, R, U), i32), f((L,), i32),
      f((L, R, U, B + 1, Hg, D), jnp.bfloat16), f((L, R, U, B + 1, Hg, D), jnp.bfloat16))
  host = f((L, 65, 64, U, Hg, D), jnp.bfloat16)
  texts["fused_resolve"] = _lower_for_cuda(
      lambda *a: fused_resolve.resolve_fetch(*a, max_len=T, page_size=64),
      f((), i32), f((), i32), f((R,), bool), f((R,), i32), f((R, U, k), i32), cache,
      f((R, T // 64), i32), host, host, f((R, Hg, D), jnp.bfloat16),
      f((R, Hg, D), jnp.bfloat16))
  texts["fused_resolve_keyed"] = _lower_for_cuda(  # a keyed policy's victim order
      lambda *a: fused_resolve.resolve_fetch(*a, max_len=T, page_size=64,
                                             score_decay=0.9),
      f((), i32), f((), i32), f((R,), bool), f((R,), i32), f((R, U, k), i32), cache,
      f((R, T // 64), i32), host, host, f((R, Hg, D), jnp.bfloat16),
      f((R, Hg, D), jnp.bfloat16), f((R, U, B), jnp.float32))
  texts["fused_resolve_victim_key"] = _lower_for_cuda(  # the rank key, then the sort
      lambda *a: fused_resolve.keyed_victim_order(*a, max_len=T, rank_freq=0.3),
      f((), i32), f((R,), i32), cache.slot_pos, cache.lru, cache.slot_score,
      f((R, U, 2 * k), i32))
  assert texts["fused_resolve_victim_key"].count("__gpu$xla.gpu.triton") == 1
  for name in ("fused_resolve", "fused_resolve_keyed"):  # classify, commit
    assert texts[name].count("__gpu$xla.gpu.triton") == 2, name
  for name, text in texts.items():
    assert "__gpu$xla.gpu.triton" in text, f"{name} did not lower to a Triton call"


@pytest.mark.skipif(not deviceless.available(), reason="needs the CUDA plugin (audit)")
@pytest.mark.parametrize("head_dim,dtype", [(256, jnp.float32), (512, jnp.bfloat16),
                                             (512, jnp.float32)])
def test_the_attention_kernels_default_tiles_fit_an_h200(head_dim, dtype):
  """Compiled for an H200 without a GPU: the default blocks of head_dim 256 in f32
  and 512 asked 273-417 KiB of shared memory (227 KiB there) with two stages."""
  f = jax.ShapeDtypeStruct
  slots = (2, 2, 1, 4097, 1, head_dim)
  lowered = deviceless.lower_for_cuda(
      lambda *a: sparse_decode_attention(*a, interpret=False),
      f((2, 8, head_dim), dtype), f(slots, dtype), f(slots, dtype), f((), jnp.int32),
      f((2, 1, 2048), jnp.int32))
  assert "__gpu$xla.gpu.triton" in deviceless.compile_for_h200(lowered)


def _fused_problem(rng, scenario, layer=1, L=2, R=4, U=2, B=12, k=8, Hg=2, D=16, T=60,
                   Pg=8):
  """A random step of layer ``layer``: metadata with empty and uncommitted slots, a
  request that fits the hot cache, an inactive one, paged host rows, selections
  with padding."""
  pages_per_req = -(-T // Pg)
  num_pages = R * pages_per_req
  seq = rng.integers(B, T - 1, R)
  seq[0] = rng.integers(1, B // 2)  # fits: slot i holds position i, never fetches
  if scenario == "capacity":
    seq[3] = T  # an active request at max_len
  elif scenario in ("unpaged", "valid"):  # more positions than slots: one is not resident
    seq[1] = rng.integers(B + 1, T - 1)
  table = np.full((R, pages_per_req), -1, np.int32)
  physical = rng.permutation(num_pages)
  for r in range(R):
    used = min(-(-(seq[r] + 1) // Pg), pages_per_req)
    table[r, :used] = physical[r * pages_per_req:r * pages_per_req + used]
  slot_pos = np.full((L, R, U, B), -1, np.int32)
  for l, r, u in np.ndindex(L, R, U):
    if r == 0:
      slot_pos[l, r, u, :seq[0]] = np.arange(seq[0])
      continue
    n = rng.integers(B // 2, B + 1)  # some empty slots, some positions >= seq (uncommitted)
    slot_pos[l, r, u, rng.permutation(B)[:n]] = rng.permutation(min(seq[r] + 3, T))[:n]
  lru = np.stack([rng.permutation(B) for _ in range(L * R * U)]).reshape(L, R, U, B)
  sel = np.full((R, U, k), -1, np.int32)
  for r, u in np.ndindex(R, U):
    held = [p for p in slot_pos[layer, r, u] if 0 <= p < seq[r]]
    pool = list(dict.fromkeys(rng.permutation(held).tolist()[:k // 2]
                              + rng.permutation(seq[r] + 1).tolist()))
    row = pool[:rng.integers(k // 2, k + 1)]
    sel[r, u, rng.permutation(k)[:len(row)]] = row  # padding anywhere
  if scenario == "duplicate":
    lanes = np.flatnonzero(sel[1, 0] >= 0)
    sel[1, 0, lanes[0]] = sel[1, 0, lanes[1]]
  elif scenario == "out_of_range":
    sel[3, 1, 0] = seq[3] + 2
  elif scenario in ("unpaged", "valid"):  # a position no slot holds: a miss, certain
    missing = next(p for p in range(seq[1]) if p not in slot_pos[layer, 1, 0])
    sel[1, 0, 0] = missing
    sel[1, 0, 1:][sel[1, 0, 1:] == missing] = -1
    if scenario == "unpaged":  # and it has no page
      table[1, missing // Pg] = -1
  host = rng.standard_normal((L, num_pages + 1, Pg, U, Hg, D)).astype(np.float32)
  hot = np.full((L, R, U, B + 1, Hg, D), np.nan, np.float32)
  cache = fused_resolve.CacheArrays(
      jnp.asarray(slot_pos), jnp.asarray(lru),
      jnp.asarray(rng.random((L, R, U, B)), jnp.float32),
      jnp.asarray(rng.integers(0, 9, (L, R, U)), jnp.int32),
      jnp.asarray(rng.integers(0, 9, (L, R, U)), jnp.int32),
      jnp.asarray(rng.integers(0, 9, (L,)), jnp.int32), jnp.asarray(hot),
      jnp.asarray(hot))
  new_kv = rng.standard_normal((2, R, U * Hg, D)).astype(np.float32)
  active = np.array([True, True, False, True])
  # An earlier layer refused: its status word comes in (and goes out with this one's).
  prior = common.STATUS_DUPLICATE if scenario == "refused_earlier" else 0
  return dict(layer=layer, prior_status=jnp.int32(prior), active=jnp.asarray(active),
              seq_len=jnp.asarray(seq, jnp.int32), selected=jnp.asarray(sel),
              cache=cache, page_table=jnp.asarray(table), host_k=jnp.asarray(host),
              host_v=jnp.asarray(host * 3), k_new=jnp.asarray(new_kv[0]),
              v_new=jnp.asarray(new_kv[1]))


def _native_or_skip(on_gpu):
  if on_gpu:
    pytest.skip("the native fused step is the CPU's")
  if not native.available() and native.unavailable_reason().startswith("no C++ compiler"):
    pytest.skip(native.unavailable_reason())
  assert native.available(), native.unavailable_reason()  # a compiler that fails: fail


@pytest.mark.parametrize("impl", ["pallas", "native"])
@pytest.mark.parametrize("scenario,status,share,keyed", [
    ("valid", 0, 1, False), ("duplicate", 2, 1, False), ("out_of_range", 1, 1, False),
    ("unpaged", 4, 1, False), ("capacity", 4, 1, False), ("refused_earlier", 2, 1, False),
    ("valid", 0, 2, False), ("unpaged", 4, 2, False), ("valid", 0, 1, True),
    ("valid", 0, 2, True), ("past_the_layers", 1, 2, False)])
def test_fused_layer_kernels_match_reference(on_gpu, scenario, status, share, keyed, impl):
  """share=2: layer 0 resolves for layers 0 and 1 (index sharing). keyed: a
  retention key with many ties and the score EMA (a keyed policy). impl: the
  Pallas kernels (interpreted off GPU) or the native CPU call (native_cpu.cc).
  past_the_layers: layer 1 of 2 resolving for 2 layers (layer is traced: the step
  refuses; the Pallas commit counted layer 1's hits twice, clamped)."""
  seed = int(np.random.default_rng().integers(2**31))
  rng = np.random.default_rng(seed)
  args = _fused_problem(rng, scenario,
                        layer=0 if share == 2 and scenario != "past_the_layers" else 1)
  static = dict(max_len=60, page_size=8, share=share)
  if keyed:
    # Ties, and keys past the finite range: NaN and +inf rank as the largest
    # finite key, ties in LRU order (the reference's clamp).
    top = np.finfo(np.float32).max
    key = rng.integers(0, 4, (4, 2, 12)).astype(np.float32)
    key[1] = rng.choice(np.float32([top, np.inf, np.nan]), (2, 12))  # victims among them
    args["key"] = jnp.asarray(key, jnp.float32)
    static["score_decay"] = 0.75
  want = fused_resolve.resolve_fetch_reference(**args, **static)
  if impl == "native":
    _native_or_skip(on_gpu)
    if scenario == "past_the_layers":  # the native call refuses with an error
      with pytest.raises(Exception, match="layer \\+ share is outside the cache"):
        jax.block_until_ready(native.resolve_fetch_native(**args, **static))
      return
    got = native.resolve_fetch_native(**args, **static)
  else:
    # The position map may hold anything: stale lanes of other rows and steps.
    stale = jnp.asarray(rng.integers(-2, 10, (8, 61 + 8)), jnp.int32)
    got = fused_resolve.resolve_fetch(**args, scratch_map=stale, **static,
                                      block_sizes=fused_resolve.BlockSizes(fetch_rows=2),
                                      interpret=not on_gpu)
  for name, w, g in zip(want.cache._fields, want.cache, got.cache):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name} {seed=}")
  # A row with a duplicate has unspecified slots (the step refuses; what its
  # attention returns is discarded).
  for name in ("slot", "is_miss", "status", "target") if scenario != "duplicate" else (
      "is_miss", "status"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name),
                                  err_msg=f"{name} {seed=}")
  if scenario == "duplicate":  # the install slot of every row but the duplicated one
    keep = np.ones(np.shape(want.target), bool)
    keep[1, 0] = False
    np.testing.assert_array_equal(np.asarray(got.target)[keep],
                                  np.asarray(want.target)[keep], err_msg=f"target {seed=}")
  assert int(got.status) == status, seed
  before, after = args["cache"], got.cache
  hot_k, host_k = np.asarray(after.hot_k), np.asarray(args["host_k"])
  layer = args["layer"]
  # Slot B holds the newest token whatever happened.
  np.testing.assert_array_equal(hot_k[layer, :, :, -1].reshape(4, -1, 16), args["k_new"])
  unchanged = lambda name: np.testing.assert_array_equal(
      getattr(after, name), getattr(before, name), err_msg=f"{name} {seed=}")
  if scenario != "valid":  # refused: nothing but slot B changes
    for name in ("slot_pos", "lru", "slot_score", "hits", "misses", "fetched_rows"):
      unchanged(name)
    assert np.isnan(hot_k[:, :, :, :-1]).all() and not got.is_miss.any()
    return
  # Independent checks of the committed layer (brute force, numpy).
  sel, seq = np.asarray(args["selected"]), np.asarray(args["seq_len"])
  slot, miss = np.asarray(got.slot), np.asarray(got.is_miss)
  new_pos, new_lru = np.asarray(after.slot_pos), np.asarray(after.lru)
  table = np.asarray(args["page_table"])
  for l, r, u in np.ndindex(share, 4, 2):
    l += layer
    assert sorted(new_lru[l, r, u]) == list(range(12))
    if r == 2:  # inactive: metadata untouched, nothing fetched
      np.testing.assert_array_equal(new_pos[l, r, u], np.asarray(before.slot_pos)[l, r, u])
      assert not miss[r, u].any()
      continue
    np.testing.assert_array_equal(new_pos[l, r, u], new_pos[layer, r, u])  # lockstep
    for lane, pos in enumerate(sel[r, u]):
      if pos < 0:
        assert slot[r, u, lane] == -1
      elif pos == seq[r]:
        assert slot[r, u, lane] == 12  # the newest: reserved slot B
      else:
        assert new_pos[l, r, u, slot[r, u, lane]] == pos
    for lane in np.flatnonzero(miss[r, u]):
      pos = sel[r, u, lane]
      np.testing.assert_array_equal(
          hot_k[l, r, u, slot[r, u, lane]], host_k[l, table[r, pos // 8], pos % 8, u])
  assert miss.sum() > 0 and not miss[0].any()  # the short request never fetches
  moved = np.asarray(after.fetched_rows - before.fetched_rows)
  assert moved[layer] == share * miss.sum() and moved.sum() == moved[layer]
  if keyed:
    _check_keyed_victims_and_scores(args, before, after, slot, miss, layer, seed)


def test_native_scores_round_as_xla_does_on_a_cpu_without_fma(on_gpu):
  """Without FMA units (here XLA capped at AVX) XLA:CPU rounds the reference's
  ``decay * score + hit`` twice; the native call asks XLA and rounds alike (one
  FMA always left the last bit of some keyed scores off there)."""
  import platform  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  if on_gpu or platform.machine().lower() not in ("x86_64", "amd64"):
    pytest.skip("an x86 CPU's ISA cap")
  env = dict(os.environ, XLA_FLAGS="--xla_cpu_max_isa=AVX")
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
       "test_fused_layer_kernels_match_reference and native and True"],
      capture_output=True, text=True, timeout=600, env=env)
  last = proc.stdout.strip().splitlines()[-1]
  assert proc.returncode == 0 and last.startswith("2 passed"), proc.stdout[-3000:]


def test_fused_kernels_read_the_selection_in_place_from_a_deeper_ranking(on_gpu):
  """Policy "rank" hands the kernels the selector's whole ranking with ``num_sel=k``
  (no slice op): they read its first k columns only. The columns past k hold
  positions out of range, which refuse the step if read."""
  rng = np.random.default_rng()
  args = _fused_problem(rng, "valid", layer=1)
  static = dict(max_len=60, page_size=8)
  sel = np.asarray(args["selected"])
  k = sel.shape[-1]
  deeper = np.concatenate([sel, rng.integers(10**6, 2 * 10**6, sel.shape[:-1] + (3,))],
                          axis=-1).astype(np.int32)
  want = fused_resolve.resolve_fetch_reference(**args, **static)
  run = lambda **kw: fused_resolve.resolve_fetch(**dict(args, selected=jnp.asarray(
      deeper)), **static, **kw, interpret=not on_gpu)
  got = run(num_sel=k)
  assert int(want.status) == 0 and int(got.status) == 0
  for name, w, g in zip(want.cache._fields, want.cache, got.cache):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
  for name in ("slot", "is_miss", "target"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
  assert int(run().status) != 0  # every column read: the deeper ones refuse
  for bad in (0, k + 4):
    with pytest.raises(ValueError, match="num_sel"):
      run(num_sel=bad)


@pytest.mark.parametrize("dtype,slots", [(jnp.float32, 12), (jnp.bfloat16, 12),
                                         (jnp.float32, 8)])
def test_native_fused_step_follows_the_reference_step_after_step(on_gpu, dtype, slots):
  """Twelve chained steps of the native call, each against the reference from the
  same state (fresh selections over held and unheld positions, every layer in
  turn, a keyed policy on odd steps): every array equal, the hot cache bit for bit
  in ``dtype`` (rows are copied as bytes), never-written slots still NaN. B = k = 8:
  a row can take every evictable slot."""
  _native_or_skip(on_gpu)
  seed = int(np.random.default_rng().integers(2**31))
  rng = np.random.default_rng(seed)
  args = _fused_problem(rng, "valid", B=slots)
  for name in ("host_k", "host_v", "k_new", "v_new"):
    args[name] = args[name].astype(dtype)
  args["cache"] = args["cache"]._replace(hot_k=args["cache"].hot_k.astype(dtype),
                                         hot_v=args["cache"].hot_v.astype(dtype))
  seq = np.asarray(args["seq_len"])
  misses = 0
  for step in range(12):
    layer = step % 2
    sel = np.full((4, 2, 8), -1, np.int32)
    slot_pos = np.asarray(args["cache"].slot_pos)
    for r, u in np.ndindex(4, 2):
      held = [p for p in slot_pos[layer, r, u] if 0 <= p < seq[r]]
      pool = list(dict.fromkeys(rng.permutation(held).tolist()[:4]
                                + rng.permutation(seq[r] + 1).tolist()))[:8]
      sel[r, u, rng.permutation(8)[:len(pool)]] = pool
    args.update(layer=layer, selected=jnp.asarray(sel))
    static = dict(max_len=60, page_size=8)
    if step % 2:
      args["key"] = jnp.asarray(rng.integers(0, 3, (4, 2, slots)), jnp.float32)
      static["score_decay"] = 0.5
    else:
      args.pop("key", None)
    want = fused_resolve.resolve_fetch_reference(**args, **static)
    got = native.resolve_fetch_native(**args, **static)
    for name, w, g in zip(want.cache._fields, want.cache, got.cache):
      np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                    err_msg=f"{name} {step=} {seed=}")
    for name in ("slot", "is_miss", "status", "target"):
      np.testing.assert_array_equal(getattr(got, name), getattr(want, name),
                                    err_msg=f"{name} {step=} {seed=}")
    misses += int(np.asarray(got.is_miss).sum())
    args["cache"] = got.cache
  assert misses > 0, seed
  # Slots no step wrote (never fetched, never installed) keep their NaN poison.
  slot_pos = np.asarray(args["cache"].slot_pos)
  hot = np.asarray(args["cache"].hot_k, np.float32)[:, :, :, :-1]
  assert np.isnan(hot[slot_pos < 0]).all()


def test_native_fused_step_refuses_corrupt_metadata_with_an_error(on_gpu):
  """Metadata no step could have written (an LRU row or a victim order that is not
  a permutation, a page outside the host tier, a layer past the cache): an error,
  not a read or write out of bounds; operands of the wrong shape or dtype: a
  ValueError at trace time."""
  _native_or_skip(on_gpu)
  rng = np.random.default_rng()
  args = _fused_problem(rng, "valid")
  static = dict(max_len=60, page_size=8)
  for row in ([12] + list(range(1, 12)), [0, 0] + list(range(2, 12))):  # slot B; twice
    lru = np.asarray(args["cache"].lru).copy()
    lru[1, 1, 0] = row
    bad_lru = dict(args, cache=args["cache"]._replace(lru=jnp.asarray(lru)))
    with pytest.raises(Exception, match="not a permutation"):
      jax.block_until_ready(native.resolve_fetch_native(**bad_lru, **static))
  order = np.tile(np.arange(12, dtype=np.int32), (4, 2, 1))
  order[3, 1, 5] = 4  # slot 4 twice, slot 5 never
  with pytest.raises(Exception, match="not a permutation"):
    jax.block_until_ready(native.resolve_fetch_native(
        **args, order=jnp.asarray(order), score_decay=0.5, **static))
  table = np.asarray(args["page_table"]).copy()
  table[1] = np.where(table[1] >= 0, 10_000, -1)  # request 1 has a certain miss
  with pytest.raises(Exception, match="outside the host tier"):
    jax.block_until_ready(native.resolve_fetch_native(
        **dict(args, page_table=jnp.asarray(table)), **static))
  with pytest.raises(Exception, match="outside the cache's layers"):
    jax.block_until_ready(native.resolve_fetch_native(**dict(args, layer=1), **static,
                                                      share=2))
  # Shapes the call would index past: refused at trace time.
  for name, bad in (("seq_len", args["seq_len"][:3]), ("host_k", args["host_k"][:, :, :4]),
                    ("page_table", args["page_table"][:3]),
                    ("page_table", args["page_table"][:, :-1]),  # a page of max_len short
                    ("page_table", args["page_table"][0])):
    with pytest.raises(ValueError, match=name):
      native.resolve_fetch_native(**dict(args, **{name: bad}), **static)
  hot_v = args["cache"].hot_v.astype(jnp.bfloat16)  # one dtype for every KV array
  with pytest.raises(ValueError, match="one dtype"):
    native.resolve_fetch_native(**dict(args, cache=args["cache"]._replace(hot_v=hot_v)),
                                **static)


def test_fused_steps_fall_back_to_the_pallas_kernels_with_a_warning(monkeypatch):
  """Off GPU the fused step runs natively unless the interpreter is asked for; a
  machine where it cannot build warns once and runs the Pallas kernels, or, with
  KVTIER_REQUIRE_NATIVE=1 (CI), refuses."""
  if common.on_gpu():
    pytest.skip("the native fused step is the CPU's")
  assert native.use_native(True) is False
  assert native.use_native(None) is native.available()
  monkeypatch.setattr(native, "_load", lambda: "no C++ compiler ($CXX or c++) on PATH")
  monkeypatch.setenv("KVTIER_REQUIRE_NATIVE", "1")
  with pytest.raises(RuntimeError, match="KVTIER_REQUIRE_NATIVE"):
    native.use_native(None)
  monkeypatch.delenv("KVTIER_REQUIRE_NATIVE")
  native._warn_unavailable.cache_clear()
  with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
    assert native.use_native(None) is False
  with pytest.raises(RuntimeError, match="unavailable"):
    native.resolve_fetch_native.__wrapped__(**_fused_problem(
        np.random.default_rng(0), "valid"), max_len=60, page_size=8)


def test_a_native_build_clears_what_a_killed_build_left(monkeypatch, tmp_path):
  """A build killed mid-compile leaves its temporary directory in the cache; the
  next build of that library (holding its lock) removes it. Another library's
  build directory is left alone (it may be building). A stand-in compiler writes
  the ``-o`` file."""
  import sys  # noqa: PLC0415
  monkeypatch.setenv("KVTIER_JAX_CACHE", str(tmp_path))
  path = native.library_path()
  path.parent.mkdir(parents=True)
  orphan = path.parent / f"{path.stem}-build-killed"
  other = path.parent / "fused_resolve-0123456789abcdef-build-running"
  for folder in (orphan, other):
    folder.mkdir()
    (folder / path.name).write_bytes(b"half a library")
  compiler = tmp_path / "cc.py"
  compiler.write_text("import sys\n"
                      "open(sys.argv[sys.argv.index('-o') + 1], 'wb').write(b'built')\n")
  native._build(path, [sys.executable, str(compiler)])
  assert path.read_bytes() == b"built"
  assert not orphan.exists() and other.exists()
  assert sorted(p.name for p in path.parent.iterdir()) == sorted(
      [path.name, path.with_suffix(".lock").name, other.name])


def test_a_native_build_keeps_only_the_most_recently_loaded_other_libraries(
    monkeypatch, tmp_path):
  """Libraries of other sources pile up in the cache as checkouts change; a build
  keeps the ``_KEEP_LIBRARIES`` most recently loaded (touched) ones with their
  locks, whatever their names' order, and removes the rest."""
  import sys  # noqa: PLC0415
  monkeypatch.setenv("KVTIER_JAX_CACHE", str(tmp_path))
  path = native.library_path()
  path.parent.mkdir(parents=True)
  rng = np.random.default_rng()
  count = native._KEEP_LIBRARIES + int(rng.integers(1, 5))
  loaded_at = rng.permutation(count) * 100.0 + 1e9  # distinct times, random order
  others = [path.parent / f"fused_resolve-{i:016x}.so" for i in range(count)]
  for other, when in zip(others, loaded_at):
    other.write_bytes(b"old")
    other.with_suffix(".lock").write_bytes(b"")
    os.utime(other, (when, when))
  compiler = tmp_path / "cc.py"
  compiler.write_text("import sys\n"
                      "open(sys.argv[sys.argv.index('-o') + 1], 'wb').write(b'built')\n")
  native._build(path, [sys.executable, str(compiler)])
  newest = np.argsort(-loaded_at)[:native._KEEP_LIBRARIES]
  kept = {path.name, path.with_suffix(".lock").name}
  kept |= {others[i].name for i in newest} | {others[i].with_suffix(".lock").name
                                               for i in newest}
  assert {p.name for p in path.parent.iterdir()} == kept


def _ranking(rng, slot_pos, seq, m):
  """i32[R, U, m] distinct best-first positions per row: some held by the row's
  slots (committed or not), some not held, the newest, -1 padding anywhere."""
  num_req, num_units = slot_pos.shape[1:3]
  ranks = np.full((num_req, num_units, m), -1, np.int32)
  for r, u in np.ndindex(num_req, num_units):
    held = [p for p in slot_pos[1, r, u] if p >= 0]
    pool = list(dict.fromkeys(rng.permutation(held).tolist()[:m // 2] + [int(seq[r])]
                              + rng.permutation(seq[r] + 3).tolist()))
    row = pool[:rng.integers(m // 2, m + 1)]
    ranks[r, u, rng.permutation(m)[:len(row)]] = rng.permutation(row)
  return ranks


@pytest.mark.parametrize("policy", ["freq", "rank"])
def test_keyed_victim_order_matches_brute_force(on_gpu, policy):
  """The victim-key kernel + sort against numpy: empty slots (uncommitted ones
  too) first in LRU order, then by the key, ties in LRU order. Keys are exact
  (scores in quarters, m = 16, rank_freq = 1/2), so ties are many and real; the
  position table starts stale (indices of other rows), so a rank must be
  confirmed by reading the ranking back."""
  seed = int(np.random.default_rng().integers(2**31))
  rng = np.random.default_rng(seed)
  args = _fused_problem(rng, "valid")
  cache, seq = args["cache"], np.asarray(args["seq_len"])
  slot_pos, lru = np.asarray(cache.slot_pos), np.asarray(cache.lru)
  score = (rng.integers(0, 4, slot_pos.shape) / 4).astype(np.float32)
  m = 16
  ranks = _ranking(rng, slot_pos, seq, m) if policy == "rank" else None
  stale = jnp.asarray(rng.integers(-2, m + 2, (8, 61 + m)), jnp.int32)
  got = np.asarray(fused_resolve.keyed_victim_order(
      1, args["seq_len"], cache.slot_pos, cache.lru, jnp.asarray(score),
      None if ranks is None else jnp.asarray(ranks),
      None if ranks is None else stale, max_len=60, rank_freq=0.5,
      interpret=not on_gpu))
  for r, u in np.ndindex(4, 2):
    pos = slot_pos[1, r, u]
    filled = (pos >= 0) & (pos < seq[r])
    key = score[1, r, u].astype(np.float64)
    if ranks is not None:
      row = ranks[r, u].tolist()
      rank = np.array([row.index(p) if p in row else m for p in pos])
      key = (1 - rank / m) + 0.5 * key
    want = sorted(lru[1, r, u],
                  key=lambda s: (bool(filled[s]), key[s] if filled[s] else 0))
    np.testing.assert_array_equal(got[r, u], want, err_msg=f"{r=} {u=} {seed=}")


def test_keyed_victim_order_matches_reference_keys():
  """Inexact keys (m = 12, rank_freq = 0.3, random scores, some NaN, +inf and the
  largest finite float, which rank alike, ties in LRU order): the kernel's order is
  ``victim_order`` of the reference key, bit for bit."""
  seed = int(np.random.default_rng().integers(2**31))
  rng = np.random.default_rng(seed)
  args = _fused_problem(rng, "valid")
  cache, seq = args["cache"], args["seq_len"]
  score = np.asarray(cache.slot_score).copy()
  odd = rng.random(score.shape) < 0.3
  score[odd] = rng.choice([np.nan, np.inf, np.finfo(np.float32).max], odd.sum())
  cache = cache._replace(slot_score=jnp.asarray(score))
  ranks = jnp.asarray(_ranking(rng, np.asarray(cache.slot_pos), np.asarray(seq), 12))
  for given in (None, ranks):
    want = fused_resolve.victim_order(
        cache.slot_pos[1], cache.lru[1],
        fused_resolve.victim_key_reference(1, seq, cache.slot_pos, cache.slot_score,
                                           given, rank_freq=0.3), seq)
    got = fused_resolve.keyed_victim_order(1, seq, cache.slot_pos, cache.lru,
                                           cache.slot_score, given, max_len=60,
                                           rank_freq=0.3, interpret=True)
    np.testing.assert_array_equal(got, want, err_msg=f"{seed=}")


def _check_keyed_victims_and_scores(args, before, after, slot, miss, layer, seed):
  """Brute force, numpy: the misses take the evictable slots in selection order,
  empty ones first (in LRU order), then by key, ties in LRU order; every slot's
  score decays by 0.75, a
  hit adds 1, a refilled slot and the install slot restart at 1."""
  sel, seq = np.asarray(args["selected"]), np.asarray(args["seq_len"])
  key = np.asarray(args["key"], np.float32)
  top = np.finfo(np.float32).max  # NaN and +inf rank as the largest finite key
  key = np.where(np.isnan(key), top, np.minimum(key, top)).astype(np.float64)
  old_pos, old_lru = np.asarray(before.slot_pos)[layer], np.asarray(before.lru)[layer]
  old_score = np.asarray(before.slot_score)[layer].astype(np.float64)
  new_score = np.asarray(after.slot_score)[layer]
  new_pos = np.asarray(after.slot_pos)[layer]
  for r, u in np.ndindex(4, 2):
    if r == 2:
      continue  # inactive
    pos = np.where(old_pos[r, u] >= seq[r], -1, old_pos[r, u])
    wanted = {p for p in sel[r, u] if 0 <= p < seq[r]}
    hits = {s for s in range(12) if pos[s] in wanted}
    lru_index = {s: i for i, s in enumerate(old_lru[r, u])}
    evictable = sorted((s for s in range(12) if s not in hits),
                       key=lambda s: (pos[s] >= 0, key[r, u, s] if pos[s] >= 0 else 0,
                                      lru_index[s]))
    victims = slot[r, u][miss[r, u]].tolist()
    assert victims == evictable[:len(victims)], seed
    want = 0.75 * old_score[r, u] + np.isin(np.arange(12), list(hits))
    want[victims] = 1.0
    installed = [s for s in range(12) if pos[s] < 0 and s not in victims]
    if installed:  # the newest token takes the lowest-index empty slot left
      assert new_pos[r, u, installed[0]] == seq[r], seed
      want[installed[0]] = 1.0
    np.testing.assert_allclose(new_score[r, u], want, rtol=1e-6, err_msg=f"{seed=}")
