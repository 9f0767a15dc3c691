r"""Device check on one CUDA GPU: numerics vs reference, then timings and a profile.

Paper reference: HiSparse (arXiv 2608.07009) decode-step cost of the tiered cache
vs full-KV sparse attention and its throughput table (SPECS.md §1.9).

Command (from the repo root, on the GPU machine; 2-5 min on one H200 depending on
``--sections``; rows are appended to $OUT/gpu_check.jsonl as they come):
  python -m experiments.gpu_check --out_dir=$OUT \
      --sections=numerics,lookups,lookup_decode,io,throughput --numerics=fetch_over_4gib
Smoke run on CPU (kernels interpreted, tiny shapes, about a minute):
  python -m experiments.gpu_check --smoke --sections=numerics,lookups,io

Sections, run in the order given: ``numerics`` (kernels vs references, exact for
integers, tolerance table for floats; zero-copy fetch, also from a >4 GiB host
tier; tiered decode vs full KV), ``lookups`` (RESOLVE membership lookups and the
kernel, checked equal), ``lookup_decode`` (the step per lookup, with a device
profile), ``io`` (TPOT of the IO-hiding options), ``throughput`` (requests that fit
a device KV budget, full vs tiered, and tokens/s), ``kernels``, ``decode`` (the
default step per shape). Timings: wall clock around ``block_until_ready`` of single
decode steps, median of ``--iters`` after ``--warmup`` (jax has no public
device-event API; the profile section gives device-side kernel times). Variants are
compared as ratios measured in the same run.
"""

from __future__ import annotations

import os

# Before jax initialises: let XLA:GPU overlap async host fetches with compute.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_enable_latency_hiding_scheduler=true").strip()

import json
import pathlib
import time
import traceback

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import median_ms
from kvtier_jax import decode, full_kv, selectors
from kvtier_jax import state as kv_state
from kvtier_jax.config import TierConfig
from pallas_kernels import common
from pallas_kernels.cache_resolve import cache_resolve_reference
from pallas_kernels.cache_resolve.kernel import cache_resolve
from pallas_kernels.fetch import fetch_rows, fetch_rows_reference
from pallas_kernels.sparse_decode_attention import (sparse_decode_attention,
                                                    sparse_decode_attention_reference)

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", os.environ.get("OUT", ""), "Where to write results.")
flags.DEFINE_bool("smoke", False, "Tiny shapes, CPU-friendly.")
flags.DEFINE_integer("warmup", 2, "Untimed steps per variant.")
flags.DEFINE_integer("iters", 10, "Timed steps per variant.")
flags.DEFINE_float("budget_s", 420.0, "Stop starting new timings after this.")
flags.DEFINE_float("churn", 0.134, "Per-step selection churn of the synthetic stream.")
flags.DEFINE_list("sections", ["numerics", "kernels", "decode"],
                  "What to run, in this order: numerics, lookups, lookup_decode, io, "
                  "throughput, kernels, decode.")
flags.DEFINE_list("numerics", ["resolve", "fetch"], "Optional numerics checks to add to "
                  "attention and decode parity (resolve, fetch, fetch_over_4gib).")
flags.DEFINE_list("decode_shapes", ["32768:8", "131072:8", "32768:32"],
                  "context:requests of the decode timings (all variants for the first).")
flags.DEFINE_float("kv_budget_gb", 8.0, "throughput section: device bytes for KV "
                   "(full KV or hot cache + metadata) per configuration.")
flags.DEFINE_float("host_budget_gb", 24.0, "throughput section: pinned host bytes "
                   "for the tiered configuration's host tier.")

ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
T0 = time.perf_counter()


def log(section, **row):
  """Print a result row and append it to $OUT/gpu_check.jsonl at once (a run cut
  short by the device time limit keeps every row it got to)."""
  row = {"section": section, **row}
  line = json.dumps(row, default=str)
  print(line, flush=True)
  if FLAGS.out_dir:
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_check.jsonl", "a") as f:
      f.write(line + "\n")


def guarded(fn):
  def run(*a, **k):
    try:
      return fn(*a, **k)
    except Exception as e:  # noqa: BLE001 - a failed check must not hide the rest
      log(fn.__name__, error=f"{type(e).__name__}: {e}"[:2000],
          trace=traceback.format_exc()[-3000:])
  return run


# ----------------------------------------------------------------------------- numerics


@guarded
def check_resolve(rows, slots, sel, steps, interpret):
  rng = np.random.default_rng(0)
  slot_pos = jnp.full((rows, slots), -1, jnp.int32)
  lru = jnp.tile(jnp.arange(slots, dtype=jnp.int32), (rows, 1))
  ctx = 4 * slots
  mism = 0
  for step in range(steps):
    newest = jnp.full((rows,), ctx + step, jnp.int32)
    centre = rng.integers(0, ctx, (rows, 1))
    cand = np.stack([rng.permutation(np.arange(max(0, c - sel), min(ctx, c + sel)))[:sel]
                     for c in centre[:, 0]])
    cand[:, 0] = ctx + step
    pad = rng.random(cand.shape) < 0.05
    cand = np.where(pad, -1, cand).astype(np.int32)
    ref = cache_resolve_reference(slot_pos, lru, jnp.asarray(cand), newest)
    got = cache_resolve(slot_pos, lru, jnp.asarray(cand), newest, interpret=interpret)
    mism += sum(int(jnp.sum(a != b)) for a, b in zip(ref, got))
    slot_pos, lru = ref.slot_pos, ref.lru
  log("numerics/resolve", rows=rows, B=slots, k=sel, steps=steps, mismatches=mism,
      ok=mism == 0)


@guarded
def check_attention(dtype, interpret):
  rng = np.random.default_rng(1)
  L, R, U, S, Hg, D, Hq, k = 2, 8, 1, 1025, 4, 128, 32, 512
  kc = jnp.asarray(rng.standard_normal((L, R, U, S, Hg, D)), dtype)
  vc = jnp.asarray(rng.standard_normal((L, R, U, S, Hg, D)), dtype)
  q = jnp.asarray(rng.standard_normal((R, Hq, D)), dtype)
  slot = np.stack([rng.permutation(S)[:k] for _ in range(R)])[:, None].astype(np.int32)
  slot[:, :, -7:] = -1
  ref = sparse_decode_attention_reference(q, kc, vc, 1, jnp.asarray(slot))
  got = sparse_decode_attention(q, kc, vc, 1, jnp.asarray(slot), interpret=interpret)
  err = float(jnp.max(jnp.abs(ref[0].astype(jnp.float32) - got[0].astype(jnp.float32))))
  lse_err = float(jnp.max(jnp.abs(ref[1] - got[1])))
  log("numerics/attention", dtype=jnp.dtype(dtype).name, max_abs_err=err,
      lse_err=lse_err, atol=ATOL[dtype], ok=err <= ATOL[dtype])


@guarded
def check_fetch(interpret):
  rng = np.random.default_rng(2)
  L, R, T1, U, Hg, D, S, N = 2, 4, 4097, 1, 4, 128, 257, 1000
  host = np.asarray(rng.standard_normal((L, R, T1, U, Hg, D)), np.float32)
  hs = kv_state.host_sharding()
  hk, hv = jax.device_put(host, hs), jax.device_put(host + 1, hs)
  hot = jnp.full((L, R, U, S, Hg, D), jnp.nan, jnp.float32)
  src = np.stack([rng.integers(0, L, N), rng.integers(0, R, N), rng.integers(0, T1, N),
                  np.zeros(N)], -1).astype(np.int32)
  cells = [(l, r, 0, s) for l in range(L) for r in range(R) for s in range(S)]
  dest = np.array([cells[i] for i in rng.permutation(len(cells))[:N]], np.int32)
  count = 777
  ref = fetch_rows_reference(jnp.asarray(src), jnp.asarray(dest), count,
                             jnp.asarray(host), jnp.asarray(host + 1), hot, hot)
  got = fetch_rows(jnp.asarray(src), jnp.asarray(dest), count, hk, hv, jnp.array(hot),
                   jnp.array(hot), interpret=interpret)
  same = all(bool(jnp.array_equal(a, b, equal_nan=True)) for a, b in zip(ref, got))
  log("numerics/fetch_zero_copy", host_memory_kind=hk.sharding.memory_kind,
      rows=count, exact=same, ok=same)


@guarded
def check_fetch_over_4gib(interpret, smoke):
  """Zero-copy fetch from a pinned_host tier larger than 4 GiB (64-bit offsets)."""
  R, T1, Hg, D = (2, 1025, 2, 8) if smoke else (3, 2**20 + 1, 4, 128)
  shape = (1, R, T1, 1, Hg, D)
  ident = lambda: (jnp.arange(R, dtype=jnp.float32)[:, None] * T1
                   + jnp.arange(T1, dtype=jnp.float32)[None, :])  # exact below 2**24
  make = jax.jit(lambda: jnp.broadcast_to(ident()[None, :, :, None, None, None], shape))
  hs = kv_state.host_sharding()
  hk = jax.device_put(make(), hs)
  hv = jax.device_put(-make(), hs)
  rng = np.random.default_rng(7)
  N, S = 4096, 4097
  r = rng.integers(0, R, N)
  t = np.where(rng.random(N) < 0.8, rng.integers(T1 // 2, T1, N), rng.integers(0, T1, N))
  src = np.stack([np.zeros(N), r, t, np.zeros(N)], -1).astype(np.int32)
  dest = np.stack([np.zeros(N), np.zeros(N), np.zeros(N),
                   rng.permutation(S)[:N]], -1).astype(np.int32)
  hot = jnp.full((1, 1, 1, S, Hg, D), jnp.nan, jnp.float32)
  got_k, got_v = fetch_rows(jnp.asarray(src), jnp.asarray(dest), N, hk, hv, hot,
                            jnp.array(hot), interpret=interpret)
  want = np.full((S,), np.nan, np.float32)
  want[dest[:, 3]] = r * T1 + t
  got_k, got_v = np.asarray(got_k[0, 0, 0]), np.asarray(got_v[0, 0, 0])
  ok = (np.array_equal(got_k, np.broadcast_to(want[:, None, None], got_k.shape),
                       equal_nan=True) and
        np.array_equal(got_v, np.broadcast_to(-want[:, None, None], got_v.shape),
                       equal_nan=True))
  above = int(((r * T1 + t) * Hg * D * 4 >= 2**32).sum())
  log("numerics/fetch_over_4gib", host_gib=round(hk.nbytes / 2**30, 2), rows=N,
      rows_past_4gib=above, exact=bool(ok), ok=bool(ok))


def tiny_cfg(**kw):
  base = dict(num_layers=3, num_requests=3, max_len=600, num_q_heads=8, num_kv_heads=2,
              head_dim=64, hot_slots=96, top_k=48, dtype=jnp.float32, fetch_chunk=32)
  base.update(kw)
  return TierConfig(**base)


@guarded
def check_decode_parity(fetch_impl, kernel_impl, interpret):
  cfg = tiny_cfg(fetch_impl=fetch_impl, attention_impl=kernel_impl,
                 resolve_impl=kernel_impl, interpret=interpret)
  rng = np.random.default_rng(3)
  prompt = 400
  lens = np.array([400, 90, 250])
  shape = (cfg.num_layers, cfg.num_requests, prompt, cfg.num_kv_heads, cfg.head_dim)
  kp = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  vp = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  dec = decode.TieredDecoder(cfg)
  st = dec.prefill(kv_state.init_state(cfg, fill=np.nan), kp, vp, lens)
  full = full_kv.init_full_kv(cfg, kp, vp, jnp.asarray(lens), fill=np.nan)
  full_step = jax.jit(lambda f, q, k, v, a: full_kv.full_kv_decode_step(
      cfg, f, q, k, v, selectors.given_selection, a))
  worst = 0.0
  for _ in range(6):
    q = jnp.asarray(rng.standard_normal((cfg.num_layers, cfg.num_requests,
                                         cfg.num_q_heads, cfg.head_dim)), jnp.float32)
    kn = jnp.asarray(rng.standard_normal(shape[:2] + shape[3:]), jnp.float32)
    sel = np.full((cfg.num_layers, cfg.num_requests, 1, cfg.top_k), -1, np.int32)
    for l in range(cfg.num_layers):
      for r in range(cfg.num_requests):
        n = int(dec.seq_len[r]) + 1
        c = rng.choice(n, size=min(cfg.top_k, n), replace=False)
        sel[l, r, 0, :len(c)] = c
    out, st = dec.step(st, q, kn, -kn, sel)
    ref, full = full_step(full, q, kn, -kn, sel)
    worst = max(worst, float(jnp.max(jnp.abs(out - ref))))
  stats = kv_state.cache_stats(cfg, st)
  log("numerics/decode_parity", fetch=fetch_impl, kernels=kernel_impl,
      max_abs_diff=worst, miss_rate=stats["miss_rate"], ok=worst <= 1e-5)


# ------------------------------------------------------------------------------ timings


def bench_cfg(ctx, req, smoke):
  if smoke:
    return TierConfig(num_layers=2, num_requests=req, max_len=ctx + 64, num_q_heads=8,
                      num_kv_heads=2, head_dim=64, hot_slots=128, top_k=64,
                      dtype=jnp.bfloat16, fetch_chunk=64)
  # Attention shape of Qwen3-30B-A3B (32 q heads, 4 KV heads, D=128), bf16,
  # k=2048, B=2k=4096 (the paper's robust default), 4 layers.
  return TierConfig(num_layers=4, num_requests=req, max_len=ctx + 64, num_q_heads=32,
                    num_kv_heads=4, head_dim=128, hot_slots=4096, top_k=2048,
                    dtype=jnp.bfloat16, fetch_chunk=4096)


def _next_selection(select, num_layers):
  """Lookahead predictor for the synthetic stream: its exact next-step selection
  (an upper bound, like OasisKV's 98.7%-agreement EAGLE draft), newest dropped."""
  def predict(state):
    ctx = lambda l: decode.SelectContext(jnp.int32(l), state.seq_len + 1, None)
    return jnp.stack([select(None, ctx(l))[..., :-1] for l in range(num_layers)])
  return predict


@guarded
def bench_decode(ctx, req, variants, smoke, profile=()):
  """Times decode-step variants on one shape; returns {variant: median ms}.

  variants: (name, TierConfig overrides or None for full KV, step options) with
  options ``share`` (index_share_every) and ``prefetch_cap`` (lookahead prefetch of
  the exact next selection, at most this many rows per layer and unit).
  """
  cfg0 = bench_cfg(ctx, req, smoke)
  key = jax.random.key(0)
  shape = (cfg0.num_layers, req, ctx, cfg0.num_kv_heads, cfg0.head_dim)
  make = jax.jit(lambda key: jax.random.normal(key, shape, cfg0.dtype))
  kp = make(key)
  vp = make(jax.random.fold_in(key, 1))
  lens = jnp.full((req,), ctx, jnp.int32)
  select = selectors.churn_selector(ctx, cfg0.top_k, cfg0.num_units, FLAGS.churn)
  qshape = (cfg0.num_layers, req, cfg0.num_q_heads, cfg0.head_dim)
  q = jax.random.normal(jax.random.fold_in(key, 2), qshape, cfg0.dtype)
  kn = jax.random.normal(jax.random.fold_in(key, 3),
                         (cfg0.num_layers, req, cfg0.num_kv_heads, cfg0.head_dim), cfg0.dtype)
  results = {}
  for variant in variants:
    name = variant[0]
    if time.perf_counter() - T0 > FLAGS.budget_s:
      log("timing", ctx=ctx, R=req, variant=name, skipped="time budget")
      continue
    ms = guarded(_time_variant)(cfg0, ctx, req, variant, select, (kp, vp, lens, q, kn),
                                results, profile)
    if ms is not None:
      results[name] = ms
  return results


def _time_variant(cfg0, ctx, req, variant, select, arrays, results, profile):
  name, overrides, opts = (tuple(variant) + ({},))[:3]
  kp, vp, lens, q, kn = arrays
  t_build = time.perf_counter()
  miss = None
  if overrides is None:
    holder = [full_kv.init_full_kv(cfg0, kp, vp, lens)]
    step = jax.jit(lambda s, q, kn: full_kv.full_kv_decode_step(cfg0, s, q, kn, kn, select),
                   donate_argnums=(0,))
    after_step = None
  else:
    cfg = cfg0.replace(**overrides)
    holder = [jax.jit(lambda s, kp, vp, lens: decode.prefill(cfg, s, kp, vp, lens),
                      donate_argnums=(0,))(kv_state.init_state(cfg), kp, vp, lens)]
    predict = _next_selection(select, cfg.num_layers)
    share, cap = opts.get("share", 1), opts.get("prefetch_cap")

    def tiered(s, q, kn, cfg=cfg, share=share, cap=cap, predict=predict):
      return decode.decode_step(
          cfg, s, q, kn, kn, select, index_share_every=share,
          prefetch=None if cap is None else predict(s), prefetch_cap=cap)
    step = jax.jit(tiered, donate_argnums=(0,))
    append = jax.jit(lambda s, c: decode.append_newest(cfg, s, c), donate_argnums=(0,))
    after_step = None if cfg.append_in_scan else append

  def run():
    res = step(holder[0], q, kn)
    out, holder[0] = res[0], res[1]
    if after_step is not None:
      holder[0] = after_step(holder[0], res[3])
    return out

  for _ in range(FLAGS.warmup):
    jax.block_until_ready(run())
  if overrides is not None:
    before = kv_state.cache_stats(cfg, holder[0])
  ms = median_ms(run, 0, FLAGS.iters)
  extra = {}
  if overrides is None:
    device_bytes = holder[0].k.nbytes + holder[0].v.nbytes
  else:
    after = kv_state.cache_stats(cfg, holder[0])
    misses = after["misses"] - before["misses"]
    miss = misses / max(1, misses + after["hits"] - before["hits"])
    fetched = int(np.asarray(holder[0].fetched_rows).sum()) - before.get("fetched_rows", 0)
    extra = dict(rows_fetched_per_step=round(fetched / FLAGS.iters))
    device_bytes = kv_state.array_bytes_by_memory_kind(holder[0]).get("device", 0)
  if name in profile:
    device_profile(f"{name}@{ctx}:{req}", run)
  holder[0] = None  # free the state before the next variant allocates
  log("timing", ctx=ctx, R=req, variant=name, median_ms=round(ms, 3),
      vs_full_kv=round(ms / results["full_kv"], 3) if "full_kv" in results else None,
      tokens_per_s=round(1e3 * req / ms), miss_rate=None if miss is None else round(miss, 4),
      device_gb=round(device_bytes / 2**30, 3), **extra,
      build_and_time_s=round(time.perf_counter() - t_build, 1))
  return ms


@guarded
def device_profile(label, run, steps=5, top=14):
  """Per-step device time by op/kernel name from a jax.profiler trace."""
  import collections
  import glob
  import tempfile
  from jax._src.lib import _profile_data
  trace_dir = tempfile.mkdtemp()
  jax.block_until_ready(run())
  with jax.profiler.trace(trace_dir):
    for _ in range(steps):
      jax.block_until_ready(run())
  path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
  data = _profile_data.ProfileData.from_file(path)
  planes = [pl for pl in data.planes if pl.name.startswith("/device:GPU")]
  cpu = not planes
  if cpu:  # smoke runs: XLA:CPU thunks on the host client threads
    planes = [pl for pl in data.planes if pl.name == "/host:CPU"]
  for plane in planes:
    for line in plane.lines:
      if cpu and not line.name.startswith("tf_XLA"):
        continue
      total = collections.Counter()
      count = collections.Counter()
      for ev in line.events:
        total[ev.name] += ev.duration_ns
        count[ev.name] += 1
      if not total:
        continue
      log("profile", variant=label, plane=plane.name, line=line.name,
          busy_us_per_step=round(sum(total.values()) / steps / 1e3, 1),
          events_per_step=round(sum(count.values()) / steps, 1),
          top=[(name[:80], round(ns / steps / 1e3, 1), round(count[name] / steps, 1))
               for name, ns in total.most_common(top)])


@guarded
def bench_kernels(smoke):
  rng = np.random.default_rng(4)
  rows, slots, sel = (8, 128, 64) if smoke else (32, 4096, 2048)
  slot_pos = jnp.asarray(np.stack([rng.permutation(8 * slots)[:slots]
                                   for _ in range(rows)]).astype(np.int32))
  lru = jnp.asarray(np.stack([rng.permutation(slots) for _ in range(rows)]).astype(np.int32))
  cand = jnp.asarray(np.stack([rng.permutation(8 * slots)[:sel]
                               for _ in range(rows)]).astype(np.int32))
  newest = jnp.full((rows,), 8 * slots, jnp.int32)
  interp = common.interpret_mode()
  xla = jax.jit(cache_resolve_reference)
  ker = jax.jit(lambda *a: cache_resolve(*a, interpret=interp))
  a = median_ms(lambda: xla(slot_pos, lru, cand, newest), 2, 20)
  b = median_ms(lambda: ker(slot_pos, lru, cand, newest), 2, 20)
  log("kernel_timing", op="resolve", rows=rows, B=slots, k=sel, xla_ms=round(a, 4),
      pallas_ms=round(b, 4), pallas_over_xla=round(b / a, 3))

  L, R, U, S, Hg, D, Hq = (1, 4, 1, 129, 2, 64, 8) if smoke else (1, 32, 1, 4097, 4, 128, 32)
  kc = jnp.asarray(rng.standard_normal((L, R, U, S, Hg, D)), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((R, Hq, D)), jnp.bfloat16)
  slot = jnp.asarray(np.stack([rng.permutation(S - 1)[:sel] for _ in range(R)])[:, None]
                     .astype(np.int32))
  xla = jax.jit(sparse_decode_attention_reference)
  ker = jax.jit(lambda *x: sparse_decode_attention(*x, interpret=interp))
  a = median_ms(lambda: xla(q, kc, kc, 0, slot), 2, 20)
  b = median_ms(lambda: ker(q, kc, kc, 0, slot), 2, 20)
  log("kernel_timing", op="attention", R=R, k=sel, Hq=Hq, xla_ms=round(a, 4),
      pallas_ms=round(b, 4), pallas_over_xla=round(b / a, 3))

  # Host -> device row fetch bandwidth: HostExecute gather vs zero-copy kernel.
  from kvtier_jax.fetch import _gather_rows
  T1, N = (1025, 256) if smoke else (32769, 65536)
  hs = kv_state.host_sharding()
  host = jax.device_put(np.zeros((1, R, T1, 1, Hg, D), np.float32).astype(jnp.bfloat16), hs)
  src = jnp.asarray(np.stack([np.zeros(N), rng.integers(0, R, N), rng.integers(0, T1, N),
                              np.zeros(N)], -1).astype(np.int32))
  dest = jnp.asarray(np.stack([np.zeros(N), np.arange(N) % R, np.zeros(N),
                               np.arange(N) // R % S], -1).astype(np.int32))
  hot = jnp.zeros((1, R, 1, S, Hg, D), jnp.bfloat16)
  gath = jax.jit(_gather_rows)
  zc = jax.jit(lambda s, d, c, a, b, x, y: fetch_rows(s, d, c, a, b, x, y,
                                                      interpret=interp),
               donate_argnums=(5, 6))
  a = median_ms(lambda: gath(host, host, src), 2, 10)
  holder = [hot, jnp.array(hot)]

  def run_zc():
    holder[0], holder[1] = zc(src, dest, N, host, host, holder[0], holder[1])
    return holder[0]
  b = median_ms(run_zc, 2, 10)
  nbytes = 2 * N * Hg * D * 2
  log("kernel_timing", op="fetch", rows=N, row_bytes=Hg * D * 2, host_execute_ms=round(a, 4),
      zero_copy_ms=round(b, 4), host_execute_gbps=round(nbytes / a / 1e6, 2),
      zero_copy_gbps=round(nbytes / b / 1e6, 2))


@guarded
def bench_lookups(smoke):
  """XLA RESOLVE membership lookups (and the kernel) at decode shapes, checked equal."""
  rng = np.random.default_rng(5)
  slots, sel = (128, 64) if smoke else (4096, 2048)
  interp = common.interpret_mode()
  for rows, ctx in ([(8, 1024)] if smoke else [(8, 32768), (32, 32768), (8, 131072)]):
    slot_pos = jnp.asarray(np.stack([rng.permutation(ctx)[:slots]
                                     for _ in range(rows)]).astype(np.int32))
    lru = jnp.asarray(np.stack([rng.permutation(slots) for _ in range(rows)])
                      .astype(np.int32))
    # 87% of the selection resident (the paper's LRU hit rate at B=2k), rest new.
    cand = np.stack([np.concatenate([rng.permutation(np.asarray(slot_pos[i]))[:sel * 87 // 100],
                                     np.setdiff1d(rng.permutation(ctx), slot_pos[i])
                                     [:sel - sel * 87 // 100]]) for i in range(rows)])
    cand = jnp.asarray(cand.astype(np.int32))
    newest = jnp.full((rows,), ctx, jnp.int32)
    want = None
    row = dict(rows=rows, B=slots, k=sel, positions=ctx + 1)
    for lookup in ("scan", "unrolled", "sort", "map", "pallas"):
      if lookup == "pallas":
        fn = jax.jit(lambda *a: cache_resolve(*a, interpret=interp))
      else:
        fn = jax.jit(lambda *a, lookup=lookup: cache_resolve_reference(
            *a, lookup=lookup, num_positions=ctx + 1))
      got = fn(slot_pos, lru, cand, newest)
      want = got if want is None else want
      same = all(bool(jnp.array_equal(a, b)) for a, b in zip(want, got))
      row[f"{lookup}_ms"] = round(median_ms(lambda: fn(slot_pos, lru, cand, newest), 3, 30), 4)
      row[f"{lookup}_exact"] = same
    log("kernel_timing", op="resolve_lookups", **row)


def run_io(smoke):
  """Issue 7 on the device: TPOT of the IO-hiding options vs the synchronous step."""
  ctx, req = (1024, 2) if smoke else (32768, 8)
  cap = 64 if smoke else 512
  variants = [("full_kv", None)]
  for fetch_impl, tag in (("pallas", "zero_copy"), ("xla", "host_exec")):
    base = dict(fetch_impl=fetch_impl)
    variants += [
        (f"{tag}_sync", base),
        (f"{tag}_overlap_hit_miss", dict(base, overlap_hit_miss=True)),
        *[(f"{tag}_index_share_{n}", base, dict(share=n)) for n in (2, 4)
          if bench_cfg(ctx, req, smoke).num_layers % n == 0],
        (f"{tag}_lookahead_cap{cap}", base, dict(prefetch_cap=cap)),
    ]
  bench_decode(ctx, req, variants, smoke)


def run_lookup_decode(smoke):
  """The decode step with each RESOLVE lookup, profiled (scan vs the default)."""
  ctx, req = (1024, 2) if smoke else (32768, 8)
  variants = [("full_kv", None)] + [
      (f"tiered_{lk}", dict(resolve_lookup=lk, resolve_impl="xla"))
      for lk in ("scan", "unrolled", "sort", "map")] + [
      ("tiered_pallas_resolve", dict(resolve_impl="pallas"))]
  bench_decode(ctx, req, variants, smoke, profile=("full_kv", "tiered_scan", "tiered_map"))


def run_throughput(smoke):
  """Issue 6 table 6 measured: requests that fit a fixed device KV budget, full KV
  vs tiered (host tier capped by pinned host memory), and decode tokens/s of the
  attention + cache step (the model's weights and MLPs are not part of it)."""
  budget, host_budget = FLAGS.kv_budget_gb * 2**30, FLAGS.host_budget_gb * 2**30
  if smoke:
    budget, host_budget = 16 * 2**20, 64 * 2**20
  for ctx in ([1024] if smoke else [32768, 131072]):
    cfg = bench_cfg(ctx, 1, smoke)
    full_req = 2 * cfg.num_layers * ctx * cfg.num_kv_heads * cfg.head_dim * \
        jnp.dtype(cfg.dtype).itemsize
    r_full = int(budget // full_req)
    r_tier = int(min(budget // cfg.device_bytes_per_request(),
                     host_budget // cfg.host_bytes_per_request(), 256))
    log("throughput_plan", ctx=ctx, full_kv_requests=r_full, tiered_requests=r_tier,
        full_bytes_per_request=full_req, tiered_device_bytes_per_request=
        cfg.device_bytes_per_request(), host_bytes_per_request=cfg.host_bytes_per_request())
    full = bench_decode(ctx, r_full, [("full_kv", None)], smoke) or {}
    tier = bench_decode(ctx, r_tier, [("tiered", {})], smoke) or {}
    if "full_kv" in full and "tiered" in tier:
      tput_full, tput_tier = r_full / full["full_kv"], r_tier / tier["tiered"]
      log("throughput", ctx=ctx, full_kv_requests=r_full, tiered_requests=r_tier,
          full_kv_tokens_per_s=round(1e3 * tput_full), tiered_tokens_per_s=round(1e3 * tput_tier),
          tiered_over_full=round(tput_tier / tput_full, 3))


def main(argv):
  del argv
  dev = jax.devices()[0]
  info = {"jax": jax.__version__, "device": dev.device_kind, "platform": dev.platform,
          "memories": [m.kind for m in dev.addressable_memories()]}
  log("env", **info)
  out = pathlib.Path(FLAGS.out_dir) if FLAGS.out_dir else None
  if out and dev.platform == "gpu":
    try:
      from jax._src.lib import xla_client as xc
      (out / "target_config.txtpb").write_text(
          xc.get_topology_for_devices(jax.devices()).target_config)
    except Exception as e:  # noqa: BLE001
      log("env", target_config_error=str(e))

  interpret = common.interpret_mode()
  smoke = FLAGS.smoke
  sections = {
      "numerics": lambda: run_numerics(smoke, interpret, FLAGS.numerics),
      "lookups": lambda: bench_lookups(smoke),
      "lookup_decode": lambda: run_lookup_decode(smoke),
      "io": lambda: run_io(smoke),
      "throughput": lambda: run_throughput(smoke),
      "kernels": lambda: bench_kernels(smoke),
      "decode": lambda: run_decode(smoke),
  }
  unknown = set(FLAGS.sections) - set(sections)
  if unknown:
    raise app.UsageError(f"unknown --sections {sorted(unknown)}; known: {list(sections)}")
  for name in FLAGS.sections:  # in the order given: the most wanted first
    sections[name]()
  print(f"gpu_check done in {time.perf_counter() - T0:.0f}s")


def run_numerics(smoke, interpret, checks):
  if "resolve" in checks:
    _run_resolve_checks(smoke, interpret)
  check_attention(jnp.float32, interpret)
  check_attention(jnp.bfloat16, interpret)
  if "fetch" in checks:
    check_fetch(interpret)
  if "fetch_over_4gib" in checks:
    check_fetch_over_4gib(interpret, smoke)
  for fetch_impl in ("xla", "pallas"):
    check_decode_parity(fetch_impl, "pallas", interpret)
  check_decode_parity("xla", "xla", interpret)


def _run_resolve_checks(smoke, interpret):
  check_resolve(8 if smoke else 64, 40 if smoke else 4096, 24 if smoke else 2048,
                4 if smoke else 8, interpret)
  check_resolve(8, 40 if smoke else 640, 24 if smoke else 512, 4, interpret)


def run_decode(smoke):
  """The default step against full KV per shape, plus the in-scan append and the
  keyed-victim policies (their RESOLVE cost; outputs are identical)."""
  variants = [
      ("full_kv", None),
      ("tiered", {}),
      ("tiered_in_scan_append", dict(host_append="in_scan")),
      ("tiered_policy_freq", dict(policy="freq", resolve_impl="xla")),
      ("tiered_policy_rank", dict(policy="rank", resolve_impl="xla")),
  ]
  shapes = ([(512, 2), (1024, 2)] if smoke else
            [tuple(map(int, s.split(":"))) for s in FLAGS.decode_shapes])
  for ctx, req in shapes:
    bench_decode(ctx, req, variants, smoke)


if __name__ == "__main__":
  app.run(main)
