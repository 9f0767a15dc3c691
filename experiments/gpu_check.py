r"""Device check on one CUDA GPU: the numerics tests compiled, then timings.

Paper reference: HiSparse (arXiv 2608.07009): the decode-step cost of the tiered
cache vs full-KV sparse attention, and throughput at a fixed device budget.

Command (from the repo root on the GPU machine; at most --deadline_s = 560 s of wall
time, every subprocess inside it; rows are appended to $OUT/gpu_check.jsonl as they
come):
  python -m experiments.gpu_check --out_dir=$OUT --sections=serve,fused,triton,sampler,graphs \
      --serve_budget_s=150 --budget_s=440 --iters=20 --warmup=3
(``triton`` needs jax-triton: carry its wheel and ``pip install --no-deps --target``
it first, joined with ``;`` not ``&&``: without it the section says so and the rest
runs; WORKSPACE_NOTES.md has the whole device call. ``graphs`` takes what is left,
so it goes last.)
Smoke run on CPU (kernels interpreted, tiny shapes, a few minutes):
  python -m experiments.gpu_check --smoke --sections=fused,serve,numerics,lookups,io

Sections, in the order given (the most wanted first): ``fused`` (the newest: the
fused layer kernels' tests compiled, then their step against the default step and
full KV per decode shape, with a device profile), ``graphs`` (the same step timings
in a subprocess whose XLA_FLAGS let command buffers capture the layer loop:
``+WHILE,+CONDITIONAL``), ``serve`` (the
serving engine with a Qwen3-8B-like dummy-weight model at a fixed HBM budget for
KV, sparse vs tiered, ``experiments.serve_sweep`` in a subprocess), ``numerics`` (``pytest --gpu``
over tests/test_device.py, tests/test_kernels.py and the tiered step with every
kernel vs full KV: each kernel compiled vs its reference, the zero-copy fetch from
pinned host memory also past 4 GiB), ``lookups`` (RESOLVE membership lookups and the kernel, checked
equal), ``lookup_decode`` (the step per lookup, with a device profile), ``io`` (TPOT
of the IO-hiding options), ``throughput`` (requests that fit a device KV budget, full
vs tiered, and tokens/s), ``kernels`` (kernel vs XLA per op), ``decode`` (the default
step per shape, and the keyed policies), ``triton`` (a kernel in the Triton language
through jax-triton against its Pallas twin, compiled and timed: needs the jax-triton
wheel carried), ``sampler`` (the serving sampler per row kind against the full
ranking it replaced, seconds). Timings: experiments/timing.py (median
after warm-up); variants are compared as ratios measured in the same run.
"""

from __future__ import annotations

import os

# Before jax initialises: let XLA:GPU overlap async host fetches with compute.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_gpu_enable_latency_hiding_scheduler=true").strip()
# The sections run subprocesses (pytest, the serve sweep, the graphs timings) beside
# this one: none may take 75% of HBM up front and leave the others a quarter.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import collections
import json
import math
import pathlib
import shlex
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import timing
from kvtier_jax.resolve import resolve
from kvtier_jax import state as kv_state
from kvtier_jax.config import ImplConfig, TierConfig
from kvtier_jax.policies import PolicyConfig
from pallas_kernels import common
from pallas_kernels.cache_resolve import cache_resolve
from pallas_kernels.fetch import fetch_rows
from pallas_kernels.sparse_decode_attention import (sparse_decode_attention,
                                                    sparse_decode_attention_reference)

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", os.environ.get("OUT", ""), "Where to write results.")
flags.DEFINE_bool("smoke", False, "Tiny shapes, CPU-friendly.")
flags.DEFINE_integer("warmup", 2, "Untimed steps per variant.")
flags.DEFINE_integer("iters", 10, "Timed steps per variant.")
flags.DEFINE_float("budget_s", 420.0, "Stop starting new timings after this.")
flags.DEFINE_float("deadline_s", 560.0, "The whole command's wall time: every "
                   "subprocess gets a timeout inside it and a section that cannot "
                   "fit is skipped (the device tool kills a command at 600 s).")
flags.DEFINE_float("churn", 0.134, "Per-step selection churn of the synthetic stream.")
flags.DEFINE_list("sections", ["fused", "graphs", "serve", "numerics", "kernels",
                                "decode"],
                  "What to run, in this order: fused, graphs, serve, triton, sampler, "
                  "numerics, lookups, lookup_decode, io, throughput, kernels, decode.")
flags.DEFINE_string("tag", "", "Added to every row (the graphs section's subprocess).")
flags.DEFINE_bool("fused_tests", True, "fused: run the fused kernels' tests first.")
flags.DEFINE_list("decode_shapes", ["32768:8", "131072:8", "32768:32"],
                  "context:requests of the decode timings.")
flags.DEFINE_float("kv_budget_gb", 8.0, "throughput: device bytes for KV (full KV, or "
                   "hot cache + metadata).")
flags.DEFINE_string("numerics_filter", None, "numerics: a pytest -k expression.")
flags.DEFINE_float("host_budget_gb", 24.0, "throughput: pinned host bytes for the "
                   "tiered configuration's host tier.")
# A Qwen3-8B-like model (16 GB of bf16 weights, 144 KiB of KV per token) with dummy
# weights; 24 GiB of HBM for KV: full KV holds 4 requests at 32K and none at 128K,
# the tiered cache 13 / 3 (host-bound by a 56 GiB pinned pool: XLA caps pinned host
# memory at 64 GiB by default, and K + V of a 64 GiB pool came to 65,538 MiB). The
# prefill chunk is 2048 tokens: an 8192-token chunk's dense scores at 128K need
# ~138 GiB of temporaries (deviceless H200 compile).
# Long outputs so that decode, the phase HiSparse serves, dominates. Sized by
# estimate: see WORKSPACE_NOTES.md, "Serving benchmark".
SERVE_ARGS = ("--model=qwen3_8b_like --contexts=32768,131072 --concurrency=16 "
              "--num_requests=16 --output_len=512 --kv_budget_mib=24576 "
              "--host_budget_mib=57344 --max_batch=16 --hot_slots=4096 --page_size=64 "
              "--chunk_size=2048 --max_step_tokens=8192")
SERVE_SMOKE_ARGS = ("--model=smollm2_135m --model_layers=2 --contexts=256 --concurrency=3 "
                    "--num_requests=3 --output_len=4 --kv_budget_mib=2 --max_batch=3 "
                    "--hot_slots=64 --chunk_size=64 --max_step_tokens=128")
flags.DEFINE_string("serve_args", SERVE_ARGS, "serve: experiments.serve_sweep flags.")
flags.DEFINE_float("serve_budget_s", 300.0, "serve: start no new point after this.")

T0 = time.perf_counter()


def remaining() -> float:
  """Seconds left of --deadline_s."""
  return FLAGS.deadline_s - (time.perf_counter() - T0)


def log(section, **row):
  """Print a row and append it to $OUT/gpu_check.jsonl at once (a run cut short by
  the device time limit keeps every row it got to)."""
  line = json.dumps({"section": section, **({"tag": FLAGS.tag} if FLAGS.tag else {}),
                     **row}, default=str)
  print(line, flush=True)
  if FLAGS.out_dir:
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_check.jsonl", "a") as f:
      f.write(line + "\n")


def _text(output) -> str:
  """A subprocess's captured output as text (a timeout may leave bytes or None)."""
  return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def guarded(fn):
  def run(*a, **k):
    try:
      return fn(*a, **k)
    except Exception as e:  # noqa: BLE001 - a failed check must not hide the rest
      log(fn.__name__, error=f"{type(e).__name__}: {e}"[:2000],
          trace=traceback.format_exc()[-3000:])
  return run


def run_numerics(section="numerics", tests=("tests/test_device.py",
                                             "tests/test_kernels.py",
                                             "tests/test_decode.py::test_kernel_paths_match_reference"),
                 filter_=None, cap_s=None):
  """The device tests, compiled on the GPU (interpreted at small shapes off it);
  ``cap_s``: at most that long (a slow or hung run would take the later sections'
  time)."""
  report = pathlib.Path(FLAGS.out_dir or "/tmp") / f"{section}.xml"
  filter_ = filter_ or FLAGS.numerics_filter
  args = (["--gpu"] if common.on_gpu() else []) + (["-k", filter_] if filter_ else [])
  report.unlink(missing_ok=True)
  try:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args, f"--junitxml={report}", *tests],
                          capture_output=True, text=True,
                          timeout=max(30.0, min(cap_s or math.inf, remaining() - 20)))
  except subprocess.TimeoutExpired:
    log(section, error="timed out", seconds_left=round(remaining()))
    return
  if not report.exists():  # pytest died before writing it (a crashed kernel)
    log(section, error=f"exit {proc.returncode}, no report",
        tail=(proc.stdout + proc.stderr)[-3000:])
    return
  for case in ET.parse(report).getroot().iter("testcase"):
    failed = case.find("failure") is not None or case.find("error") is not None
    skipped = case.find("skipped") is not None
    log(section, test=f"{case.get('classname')}::{case.get('name')}",
        ok=not failed, skipped=skipped, seconds=float(case.get("time", 0)))
  log(section, summary=proc.stdout.strip().splitlines()[-1:], ok=proc.returncode == 0)


# ------------------------------------------------------------------------------ timings


def bench_top_k() -> int:
  return 64 if FLAGS.smoke else 2048


def rank_policy() -> PolicyConfig:
  """"rank" over a ranking 4k deep (the policy tables' 1024 at k = 256), which the
  benchmarks' ChurnSelector then returns: the rank lookup timed at depth."""
  return PolicyConfig("rank", rank_depth=4 * bench_top_k())


def bench_cfg(ctx, req, **overrides) -> TierConfig:
  if FLAGS.smoke:
    base = dict(num_layers=2, num_requests=req, max_len=ctx + 64, num_q_heads=8,
                num_kv_heads=2, head_dim=64, hot_slots=128, top_k=bench_top_k())
  else:  # Qwen3-30B-A3B's attention (32 q / 4 KV heads, D=128), k=2048, B=2k, 4 layers
    base = dict(num_layers=4, num_requests=req, max_len=ctx + 64, num_q_heads=32,
                num_kv_heads=4, head_dim=128, hot_slots=4096, top_k=bench_top_k())
  return TierConfig(**{**base, **overrides}, dtype=jnp.bfloat16)


@guarded
def bench_step(ctx, req, variants, profile=()):
  """Times step variants on one shape; returns {variant: median ms}.

  variants: (name, TierConfig overrides, or None for full KV, lookahead?) where
  lookahead prefetches the exact next selection (capped at ``lookahead_cap``).
  """
  inputs = timing.make_inputs(bench_cfg(ctx, req), ctx)
  results, full_kv_run = {}, None
  for name, overrides, *lookahead in variants:
    if time.perf_counter() - T0 > FLAGS.budget_s:
      log("timing", ctx=ctx, R=req, variant=name, skipped="time budget")
      continue
    start = time.perf_counter()
    cfg = bench_cfg(ctx, req, **(overrides or {}))
    selector = timing.churn(cfg, ctx, FLAGS.churn)
    if overrides is None:
      got = guarded(timing.time_full_kv)(cfg, selector, inputs, FLAGS.warmup, FLAGS.iters)
    else:
      got = guarded(timing.time_tiered)(cfg, selector, inputs, FLAGS.warmup, FLAGS.iters,
                                        lookahead=bool(lookahead and lookahead[0]))
    if got is None:
      continue
    results[name] = ms = got["median_ms"]
    if overrides is None:
      full_kv_run = got["run"]  # kept: timed again after the variants (drift)
    log("timing", ctx=ctx, R=req, variant=name, median_ms=round(ms, 3),
        vs_full_kv=round(ms / results["full_kv"], 3) if "full_kv" in results else None,
        tokens_per_s=round(1e3 * req / ms), miss_rate=got["miss_rate"],
        rows_fetched_per_step=got.get("rows_fetched_per_step"),
        device_gb=round(got["device_bytes"] / 2**30, 3),
        build_and_time_s=round(time.perf_counter() - start, 1))
    if name in profile:  # after the row: a profiler failure loses no median
      device_profile(f"{name}@{ctx}:{req}", got["run"])
  if "full_kv" in results and len(results) > 1:
    # The ratios divide by a median timed minutes earlier: full KV again bounds
    # the drift between (a ratio far from 1 says to distrust vs_full_kv).
    again = timing.median_ms(full_kv_run, FLAGS.warmup, FLAGS.iters)
    log("timing", ctx=ctx, R=req, variant="full_kv_again", median_ms=round(again, 3),
        full_kv_drift=round(again / results["full_kv"], 3))
  return results


@guarded
def device_profile(label, run, steps=5, top=14):
  """Per-step device time by kernel name from a jax.profiler trace."""
  import collections
  import glob
  import tempfile
  from jax._src.lib import _profile_data
  jax.block_until_ready(run())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(steps):
        jax.block_until_ready(run())
    data = _profile_data.ProfileData.from_file(
        glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
  planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
  for plane in planes or [p for p in data.planes if p.name == "/host:CPU"]:
    for line in plane.lines:
      total, count = collections.Counter(), collections.Counter()
      for ev in line.events:
        total[ev.name] += ev.duration_ns
        count[ev.name] += 1
      if total and (planes or line.name.startswith("tf_XLA")):
        log("profile", variant=label, plane=plane.name, line=line.name,
            busy_us_per_step=round(sum(total.values()) / steps / 1e3, 1),
            events_per_step=round(sum(count.values()) / steps, 1),
            top=[(n[:80], round(ns / steps / 1e3, 1), round(count[n] / steps, 1))
                 for n, ns in total.most_common(top)])


@guarded
def bench_lookups():
  """RESOLVE membership lookups (and the kernel) at decode shapes, checked equal."""
  rng = np.random.default_rng(5)
  slots, sel = (128, 64) if FLAGS.smoke else (4096, 2048)
  interpret = common.interpret_mode()
  for rows, ctx in ([(8, 1024)] if FLAGS.smoke else [(8, 32768), (32, 32768), (8, 131072)]):
    slot_pos = np.stack([rng.permutation(ctx)[:slots] for _ in range(rows)])
    lru = jnp.asarray(np.stack([rng.permutation(slots) for _ in range(rows)]), jnp.int32)
    # 87% of the selection resident (the paper's LRU hit rate at B=2k), rest new.
    cand = np.stack([np.concatenate([rng.permutation(p)[:sel * 87 // 100],
                                     np.setdiff1d(rng.permutation(ctx), p)
                                     [:sel - sel * 87 // 100]]) for p in slot_pos])
    args = (jnp.asarray(slot_pos, jnp.int32), lru, jnp.asarray(cand, jnp.int32),
            jnp.full((rows,), ctx, jnp.int32))
    row, want = dict(rows=rows, B=slots, k=sel, positions=ctx + 1), None
    for method in ("search", "map", "pallas"):
      fn = jax.jit(lambda *a, m=method: cache_resolve(*a, interpret=interpret)
                   if m == "pallas" else resolve(
                       *a, lookup_method=m, num_positions=ctx + 1))
      got = fn(*args)
      want = got if want is None else want
      row[f"{method}_exact"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(want, got))
      row[f"{method}_ms"] = round(timing.median_ms(lambda: fn(*args), 3, 30), 4)
    log("kernel_timing", op="resolve_lookups", **row)


@guarded
def bench_kernels():
  rng = np.random.default_rng(4)
  interpret = common.interpret_mode()
  R, S, Hg, D, Hq, k = (4, 129, 2, 64, 8, 64) if FLAGS.smoke else (32, 4097, 4, 128, 32, 2048)
  kc = jnp.asarray(rng.standard_normal((1, R, 1, S, Hg, D)), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((R, Hq, D)), jnp.bfloat16)
  slot = jnp.asarray(np.stack([rng.permutation(S - 1)[:k] for _ in range(R)])[:, None],
                     jnp.int32)
  xla = jax.jit(sparse_decode_attention_reference)
  ker = jax.jit(lambda *x: sparse_decode_attention(*x, interpret=interpret))
  a = timing.median_ms(lambda: xla(q, kc, kc, 0, slot), 2, 20)
  b = timing.median_ms(lambda: ker(q, kc, kc, 0, slot), 2, 20)
  log("kernel_timing", op="attention", R=R, k=k, Hq=Hq, xla_ms=round(a, 4),
      pallas_ms=round(b, 4), pallas_over_xla=round(b / a, 3))
  # Host -> device rows: HostExecute gather vs the zero-copy kernel.
  from kvtier_jax.fetch import gather_rows
  T1, N = (1025, 256) if FLAGS.smoke else (32769, 65536)
  host = jax.device_put(np.zeros((1, R, T1, 1, Hg, D), np.float32).astype(jnp.bfloat16),
                        kv_state.host_sharding())
  src = jnp.asarray(np.stack([np.zeros(N), rng.integers(0, R, N), rng.integers(0, T1, N),
                              np.zeros(N)], -1), jnp.int32)
  dest = jnp.asarray(np.stack([np.zeros(N), np.arange(N) % R, np.zeros(N),
                               np.arange(N) // R % S], -1), jnp.int32)
  gather = jax.jit(gather_rows)
  zero_copy = jax.jit(lambda *x: fetch_rows(*x, interpret=interpret), donate_argnums=(5, 6))
  hot = [jnp.zeros((1, R, 1, S, Hg, D), jnp.bfloat16) for _ in "kv"]

  def run_zero_copy():
    hot[:] = zero_copy(src, dest, N, host, host, *hot)
    return hot[0]
  a = timing.median_ms(lambda: gather(host, host, src), 2, 10)
  b = timing.median_ms(run_zero_copy, 2, 10)
  nbytes = 2 * N * Hg * D * 2
  log("kernel_timing", op="fetch", rows=N, host_execute_gbps=round(nbytes / a / 1e6, 2),
      zero_copy_gbps=round(nbytes / b / 1e6, 2))


def run_io():
  """TPOT of the IO-hiding options vs the synchronous step (32K, R=8)."""
  ctx, req = (1024, 2) if FLAGS.smoke else (32768, 8)
  cap = 64 if FLAGS.smoke else 512
  variants = [("full_kv", None)]
  for fetch, tag in (("pallas", "zero_copy"), ("xla", "host_exec")):
    impl = ImplConfig(fetch=fetch)
    variants += [(f"{tag}_sync", dict(impl=impl)),
                 (f"{tag}_overlap_hit_miss", dict(impl=impl, overlap_hit_miss=True)),
                 *[(f"{tag}_index_share_{n}", dict(impl=impl, index_share=n))
                   for n in (2, 4) if bench_cfg(ctx, req).num_layers % n == 0],
                 (f"{tag}_lookahead_cap{cap}", dict(impl=impl, lookahead_cap=cap), True)]
  if FLAGS.smoke:  # each fetch and each IO option once (CPU compiles are slow)
    variants = [v for v in variants if v[0] in (
        "full_kv", "zero_copy_sync",
        "host_exec_index_share_2", f"host_exec_lookahead_cap{cap}")]
  bench_step(ctx, req, variants)


def run_lookup_decode():
  ctx, req = (1024, 2) if FLAGS.smoke else (32768, 8)
  variants = [("full_kv", None)] + [
      (f"tiered_{m}", dict(impl=ImplConfig(resolve="xla", lookup=m)))
      for m in ("search", "map")] + [("tiered_pallas_resolve",
                                      dict(impl=ImplConfig(resolve="pallas")))]
  bench_step(ctx, req, variants, profile=("full_kv", "tiered_map"))


def run_throughput():
  """Requests that fit a fixed device KV budget, full KV vs tiered (host tier capped
  by pinned host memory), and tokens/s of the attention + cache step (no weights)."""
  budget, host_budget = FLAGS.kv_budget_gb * 2**30, FLAGS.host_budget_gb * 2**30
  if FLAGS.smoke:
    budget, host_budget = 16 * 2**20, 64 * 2**20
  for ctx in ([1024] if FLAGS.smoke else [32768, 131072]):
    cfg = bench_cfg(ctx, 1)
    full_req = 2 * cfg.num_layers * ctx * cfg.num_kv_heads * cfg.head_dim * 2
    r_full = int(budget // full_req)
    r_tier = int(min(budget // cfg.device_bytes_per_request(),
                     host_budget // cfg.host_bytes_per_request(), 256))
    full = bench_step(ctx, r_full, [("full_kv", None)]) or {}
    tier = bench_step(ctx, r_tier, [("tiered", {})]) or {}
    if "full_kv" in full and "tiered" in tier:
      tput_full, tput_tier = r_full / full["full_kv"], r_tier / tier["tiered"]
      log("throughput", ctx=ctx, full_kv_requests=r_full, tiered_requests=r_tier,
          full_kv_tokens_per_s=round(1e3 * tput_full),
          tiered_tokens_per_s=round(1e3 * tput_tier),
          tiered_over_full=round(tput_tier / tput_full, 3))


def run_serve():
  """Serving at a fixed HBM budget for KV, weights included: a Qwen3-8B-like model
  with dummy weights, sparse vs tiered, closed loop (experiments/serve_sweep.py in a
  subprocess; it appends each point to points.jsonl as it ends, so a run cut short
  keeps what it measured)."""
  import tarfile
  import tempfile
  args = shlex.split(SERVE_SMOKE_ARGS if FLAGS.smoke else FLAGS.serve_args)
  if remaining() < 120:
    log("serve", skipped=f"{remaining():.0f} s left of --deadline_s")
    return
  # New points start until --serve_budget_s; a running one stops at its deadline (its
  # row marked cut), and the subprocess is killed a minute past that.
  deadline = min(FLAGS.serve_budget_s + 60, remaining() - 30)
  with tempfile.TemporaryDirectory(prefix="gpu_check_serve") as tmp:
    out = pathlib.Path(tmp)
    cmd = [sys.executable, "-m", "experiments.serve_sweep", f"--out_root={out}",
           f"--budget_s={min(FLAGS.serve_budget_s, remaining() - 90):.0f}",
           f"--deadline_s={deadline:.0f}", *args]
    print(" ".join(cmd), flush=True)
    try:
      proc = subprocess.run(cmd, timeout=min(remaining() - 10, deadline + 60),
                            capture_output=True, text=True)
      tail = (proc.stdout + proc.stderr)[-3000:]
      if proc.returncode:
        log("serve", error=f"exit {proc.returncode}", tail=tail)
    except subprocess.TimeoutExpired:
      log("serve", error="timed out")
    for points in sorted(out.glob("serve_sweep/*/points.jsonl")):
      # A complete run's rows carry the ratios to sparse (points.jsonl: as they came).
      rows = points.parent / "rows.jsonl"
      for line in (rows if rows.exists() else points).read_text().splitlines():
        log("serve", **json.loads(line))
      table = points.parent / "table.md"
      if table.exists():
        print(table.read_text(), flush=True)
    # The run's files as one archive: the device returns 8 files, 2 folders deep.
    runs = sorted(out.glob("serve_sweep/*"))
    if FLAGS.out_dir and runs:
      with tarfile.open(pathlib.Path(FLAGS.out_dir, "serve_sweep.tar.gz"), "w:gz") as tar:
        for run in runs:
          tar.add(run, arcname=run.name)


FUSED_TESTS = ("tests/test_kernels.py::test_fused_layer_kernels_match_reference",
               "tests/test_kernels.py::test_keyed_victim_order_matches_brute_force",
               "tests/test_decode.py::test_fused_layer_kernels_are_the_unfused_step")


def _decode_shapes():
  return ([(1024, 2)] if FLAGS.smoke else
          [tuple(map(int, s.split(":"))) for s in FLAGS.decode_shapes])


def run_fused():
  """The fused layer kernels: their tests compiled, then the step per shape against
  the default tiered step and full KV (issue 16's target: <= 1.2x full KV); and the
  overlapped hit/miss attention with and without the miss gather on its own CUDA
  stream (``ImplConfig.fetch_stream``)."""
  if FLAGS.fused_tests:
    run_numerics("fused", FUSED_TESTS, filter_="fused or keyed_victim_order", cap_s=150)
  variants = [("full_kv", None), ("tiered", {}),
              ("tiered_fused", dict(impl=ImplConfig(fused=True))),
              ("tiered_fused_xla_attention",
               dict(impl=ImplConfig(fused=True, attention="xla"))),
              ("tiered_fused_index_share_2",
               dict(impl=ImplConfig(fused=True), index_share=2)),
              ("tiered_fused_rank",  # a keyed policy: the victim-key kernel + a sort
               dict(impl=ImplConfig(fused=True), policy=rank_policy())),
              ("tiered_overlap", dict(overlap_hit_miss=True)),
              ("tiered_overlap_fetch_stream_1",
               dict(overlap_hit_miss=True, impl=ImplConfig(fetch_stream=1)))]
  # The layer's inputs sliced as lax.scan does (a CUDA graph split per layer,
  # deviceless) against the default pick (one graph): the newest, timed right
  # after the default and fused steps.
  variants[3:3] = [
      ("tiered_sliced_inputs", dict(impl=ImplConfig(slice_layer_inputs=True))),
      ("tiered_fused_sliced_inputs",
       dict(impl=ImplConfig(fused=True, slice_layer_inputs=True)))]
  if FLAGS.smoke:  # every variant's config is built; the kernel paths timed once each
    for name, overrides in variants[1:]:
      bench_cfg(1024, 2, **overrides)
      log("timing", variant=name, config="valid")
    variants = [v for v in variants if v[0] in (
        "full_kv", "tiered", "tiered_fused", "tiered_overlap_fetch_stream_1")]
  for i, (ctx, req) in enumerate(_decode_shapes()):
    bench_step(ctx, req, variants, profile=("tiered_fused",) if i == 0 else ())


def run_graphs():
  """The fused section's timings with command buffers allowed to capture the layer
  loop (WHILE, CONDITIONAL), in a subprocess (XLA_FLAGS are read at start-up)."""
  if remaining() < 90:
    log("graphs", skipped=f"{remaining():.0f} s left of --deadline_s")
    return
  argv = [sys.executable, "-m", "experiments.gpu_check", "--sections=fused",
          "--tag=command_buffers_while", f"--out_dir={FLAGS.out_dir}",
          f"--warmup={FLAGS.warmup}", f"--iters={FLAGS.iters}",
          f"--decode_shapes={','.join(FLAGS.decode_shapes)}", "--nofused_tests",
          f"--budget_s={remaining() - 60:.0f}", f"--deadline_s={remaining() - 15:.0f}"]
  argv += ["--smoke"] if FLAGS.smoke else []
  # jax-ml/jax#27988 names Pallas Triton calls to command buffers with
  # --legacy_command_buffer_custom_call_targets; jaxlib 0.10.2 and 0.11.2 both
  # abort on it (an unknown flag: the option is gone), so it is not tried.
  env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
         + " --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"}
  try:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                          timeout=max(10.0, remaining() - 5))
  except subprocess.TimeoutExpired as err:  # (its rows went to gpu_check.jsonl as they came)
    log("graphs", error="timed out", xla_flags=env["XLA_FLAGS"],
        tail=_text(err.stderr)[-3000:])
    return
  log("graphs", ok=proc.returncode == 0, xla_flags=env["XLA_FLAGS"],
      tail=proc.stderr.strip().splitlines()[-3:] if proc.returncode else None)


# The triton section's probe size: 32 rows (e.g. 8 requests x 4 units) selecting 2048
# of 32K positions, rows of 128 floats: 512 MiB of pinned host rows.
TRITON_ARGS = "--rows=32 --top_k=2048 --positions=32768 --head_dim=128"
TRITON_SMOKE_ARGS = "--rows=3 --top_k=16 --positions=64 --head_dim=8"


def run_sampler():
  """The serving sampler per row kind against drawing every row from the full
  ranking (the sampler before the thirty-sixth session), same tokens checked."""
  from kvtier_jax.serving import sampling  # noqa: PLC0415
  rng = np.random.default_rng(6)
  vocab = 4096 if FLAGS.smoke else 151936  # Qwen3's vocabulary
  cases = {"greedy": (0.0, 0, 1.0, 1.0), "whole": (1.0, 0, 1.0, 1.0),
           "top_k_50": (0.8, 50, 0.9, 1.0), "nucleus": (0.8, 0, 0.9, 4.0),
           "ranked": (0.8, 0, 0.9, 0.05)}  # (temperature, top_k, top_p, logit scale)

  @jax.jit
  def ranking(logits, temperature, top_k, top_p, seed, position):
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(
        jax.random.key(0), s), p))(seed, position)
    ids, masked = jax.vmap(sampling.CANDIDATES["ranked"])(
        logits, sampling._scale(temperature), top_k, top_p)
    return jax.vmap(lambda i, m, k: i[jax.random.categorical(k, m)])(ids, masked, keys)

  for rows in (8, 64):
    for name, (temperature, top_k, top_p, scale) in cases.items():
      if remaining() < 45:  # a case compiles two programs over the vocabulary
        log("sampler", rows=rows, kind=name,
            skipped=f"{remaining():.0f} s left of --deadline_s")
        continue
      logits = jnp.asarray(rng.standard_normal((rows, vocab)) * scale, jnp.float32)
      args = (logits, jnp.full(rows, temperature, jnp.float32), jnp.full(rows, top_k,
              jnp.int32), jnp.full(rows, top_p, jnp.float32),
              jnp.arange(rows, dtype=jnp.int32), jnp.zeros(rows, jnp.int32))
      got = np.asarray(sampling.sample(*args)[0])
      # The candidate kinds the rows really took (a nucleus case may spill into the
      # next window): the timing is of those.
      kinds, _ = sampling.candidate_kind(args[1] >= sampling.GREEDY_BELOW, logits,
                                         sampling._scale(args[1]), args[2], args[3])
      names = list(sampling.CANDIDATES)
      took = collections.Counter(names[k] for k in np.asarray(kinds)) if temperature else {}
      row = dict(rows=rows, vocab=vocab, kind=name, took=dict(took),
                 sample_ms=round(timing.median_ms(lambda: sampling.sample(*args), 3,
                                                  FLAGS.iters), 4),
                 ranking_ms=round(timing.median_ms(lambda: ranking(*args), 3,
                                                   FLAGS.iters), 4))
      if name not in ("greedy", "whole"):  # (those draw otherwise by design)
        row["same_tokens"] = bool((got == np.asarray(ranking(*args))).all())
      log("sampler", **row)


def probe_rows(stdout: str) -> list[dict]:
  """The rows ``experiments.triton_probe --check=...`` printed."""
  return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines()
          if line.startswith("PROBE_ROW ")]


def run_triton():
  """Issue 16 part 4: the probe kernel written in the Triton language (through
  jax-triton) against the same algorithm in Pallas Triton, both compiled on this
  GPU, checked against numpy and timed (``experiments.triton_probe --check=device``,
  in a subprocess: Triton fixes its mode at import). The GPU image has Triton;
  jax-triton (17 kB, pure Python) is carried as a wheel (WORKSPACE_NOTES.md)."""
  import importlib.util
  if importlib.util.find_spec("jax_triton") is None:
    log("triton", skipped="jax_triton is not installed: carry its wheel "
        "(.whl/jax_triton-0.3.1-py3-none-any.whl, pip install --target)")
    return
  if remaining() < 60:
    log("triton", skipped=f"{remaining():.0f} s left of --deadline_s")
    return
  args = shlex.split(TRITON_SMOKE_ARGS if FLAGS.smoke else TRITON_ARGS)
  cmd = [sys.executable, "-m", "experiments.triton_probe", "--check=device",
         f"--warmup={FLAGS.warmup}", f"--iters={max(FLAGS.iters, 20)}", *args]
  try:
    proc = subprocess.run(cmd, env=dict(os.environ, TRITON_INTERPRET="0"),
                          timeout=min(180.0, remaining() - 10), capture_output=True,
                          text=True)
  except subprocess.TimeoutExpired as err:  # the rows it printed, and where it was
    for row in probe_rows(_text(err.stdout)):
      log("triton", **row)
    log("triton", error="timed out", tail=_text(err.stderr)[-3000:])
    return
  rows = probe_rows(proc.stdout)
  for row in rows:
    log("triton", **row)
  if proc.returncode or not rows:
    log("triton", error=f"exit {proc.returncode}", tail=proc.stderr[-3000:])


def run_decode():
  """The default step against full KV per shape, plus the keyed policies' cost."""
  variants = [("full_kv", None), ("tiered", {}),
              ("tiered_policy_freq", dict(policy="freq", impl=ImplConfig(resolve="xla"))),
              ("tiered_policy_rank", dict(policy=rank_policy(),
                                          impl=ImplConfig(resolve="xla")))]
  for ctx, req in _decode_shapes():
    bench_step(ctx, req, variants)


def write_target_config():
  from jax._src.lib import xla_client as xc  # noqa: PLC0415
  pathlib.Path(FLAGS.out_dir, "target_config.txtpb").write_text(
      xc.get_topology_for_devices(jax.devices()).target_config)


def main(argv):
  del argv
  dev = jax.devices()[0]
  log("env", jax=jax.__version__, device=dev.device_kind, platform=dev.platform,
      memories=[m.kind for m in dev.addressable_memories()])
  if FLAGS.out_dir and dev.platform == "gpu":  # the device's own compile target
    guarded(write_target_config)()
  sections = {"fused": run_fused, "graphs": run_graphs,
              "numerics": run_numerics, "lookups": bench_lookups,
              "lookup_decode": run_lookup_decode, "io": run_io,
              "throughput": run_throughput, "kernels": bench_kernels, "decode": run_decode,
              "serve": run_serve, "triton": run_triton, "sampler": run_sampler}
  unknown = set(FLAGS.sections) - set(sections)
  if unknown:
    raise app.UsageError(f"unknown --sections {sorted(unknown)}; known: {list(sections)}")
  for name in FLAGS.sections:  # one failing section must not cost the others
    guarded(sections[name])()
  print(f"gpu_check done in {time.perf_counter() - T0:.0f}s")


if __name__ == "__main__":
  app.run(main)
