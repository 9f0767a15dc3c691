"""Timing the decode step: the harness ``bench_decode`` and ``gpu_check`` share.

Both sides of a comparison run the library's own paths: full-KV sparse attention
(``full_kv.full_kv_decode_step``) and the tiered step through ``TieredDecoder``
(the one per-layer ``tiered_attend`` + the host driver: append, refusal check).
Selections come from ``ChurnSelector``, a stream whose step-to-step churn equals
a chosen LRU miss rate. Timing: wall clock around ``block_until_ready`` of single
steps, median after warm-up. Flag-free, so any runner can import it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from kvtier_jax import driver, full_kv, selectors
from kvtier_jax import state as kv_state
from kvtier_jax.config import TierConfig


def median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
  """Median wall time of ``fn`` (blocked until ready) after ``warmup`` calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def run_rounds(runs: dict[str, Callable[[], object]], rounds: int) -> None:
  """``rounds`` untimed calls of every variant, alternating (each blocked on)."""
  for _ in range(rounds):
    for fn in runs.values():
      jax.block_until_ready(fn())


def interleaved_ms(runs: dict[str, Callable[[], object]], warmup: int, iters: int
                   ) -> tuple[dict[str, float], dict[str, float]]:
  """Median wall time of each variant, the variants alternating step by step (a
  drifting machine then moves them together), and the median of the per-round
  ratios to the first variant. Returns (medians ms, ratios)."""
  run_rounds(runs, warmup)
  times = {name: [] for name in runs}
  for _ in range(iters):
    for name, fn in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  first = times[next(iter(runs))]
  medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
  ratios = {name: statistics.median(a / b for a, b in zip(t, first))
            for name, t in times.items()}
  return medians, ratios


@dataclasses.dataclass
class StepInputs:
  """A prompt's K/V and one step's q/k/v for every layer (device arrays)."""

  context: int
  k_prompt: jax.Array  # [L, R, P, Hkv, D]
  v_prompt: jax.Array
  q: jax.Array  # [L, R, Hq, D]
  k_new: jax.Array  # [L, R, Hkv, D]


def make_inputs(cfg: TierConfig, context: int, seed: int = 0) -> StepInputs:
  """Random inputs drawn on the device (never closed over as jit constants)."""
  key = jax.random.key(seed)
  shape = (cfg.num_layers, cfg.num_requests, context, cfg.num_kv_heads, cfg.head_dim)
  draw = jax.jit(lambda key, shape: jax.random.normal(key, shape, cfg.dtype),
                 static_argnums=1)
  new = shape[:2] + shape[3:]
  # Committed to the device, as a model's activations are: the tiered driver
  # commits an uncommitted step input (a copy, ~0.15 ms each on this CPU) every
  # step, which full KV's step does not.
  commit = lambda x: jax.device_put(x, jax.devices()[0])
  return StepInputs(context, draw(key, shape), draw(jax.random.fold_in(key, 1), shape),
                    commit(draw(jax.random.fold_in(key, 2), (
                        cfg.num_layers, cfg.num_requests, cfg.num_q_heads, cfg.head_dim))),
                    commit(draw(jax.random.fold_in(key, 3), new)))


def churn(cfg: TierConfig, context: int, rate: float) -> selectors.ChurnSelector:
  return selectors.ChurnSelector(context, cfg.top_k, cfg.num_units, rate,
                                 rank_depth=cfg.policy.rank_depth)


def time_full_kv(cfg: TierConfig, selector, inputs: StepInputs, warmup: int,
                 iters: int) -> dict:
  lens = jnp.full((cfg.num_requests,), inputs.context, jnp.int32)
  holder = [full_kv.init_full_kv(cfg, inputs.k_prompt, inputs.v_prompt, lens)]
  step = jax.jit(lambda s, q, k: full_kv.full_kv_decode_step(cfg, selector, s, q, k, k),
                 donate_argnums=(0,))

  def run():
    out, holder[0] = step(holder[0], inputs.q, inputs.k_new)
    return out

  ms = median_ms(run, warmup, iters)
  return dict(median_ms=ms, device_bytes=holder[0].k.nbytes + holder[0].v.nbytes,
              host_bytes=0, miss_rate=None, run=run)


def time_tiered(cfg: TierConfig, selector, inputs: StepInputs, warmup: int, iters: int,
                lookahead: bool = False) -> dict:
  """The tiered step; ``lookahead`` prefetches the selector's exact next selection
  (newest dropped), capped at ``cfg.lookahead_cap``: an upper bound on any
  predictor (OasisKV's EAGLE draft agrees 98.7%)."""
  decoder = driver.TieredDecoder(cfg, selector)
  holder = [decoder.prefill(kv_state.init_state(cfg), inputs.k_prompt, inputs.v_prompt,
                            [inputs.context] * cfg.num_requests)]
  predict = jax.jit(lambda seq_len: jnp.stack([
      selector.select(None, layer, _position_only(seq_len + 1))[0][..., :-1]
      for layer in range(cfg.num_layers)]))

  def run():
    prefetch = predict(holder[0].seq_len) if lookahead else None
    out, holder[0] = decoder.step(holder[0], inputs.q, inputs.k_new, inputs.k_new,
                                  prefetch=prefetch)
    return out

  for _ in range(warmup):
    jax.block_until_ready(run())
  before = kv_state.cache_stats(cfg, holder[0])
  ms = median_ms(run, 0, iters)
  after = kv_state.cache_stats(cfg, holder[0])
  misses = after["misses"] - before["misses"]
  lookups = misses + after["hits"] - before["hits"]
  by_kind = kv_state.array_bytes_by_memory_kind(holder[0])
  host = kv_state.host_memory_kind()
  return dict(median_ms=ms, miss_rate=misses / max(1, lookups),
              host_bytes=by_kind.get(host, 0),
              device_bytes=sum(v for k, v in by_kind.items() if k != host),
              rows_fetched_per_step=(after["fetched_rows"] - before["fetched_rows"]) / iters,
              run=run, stats=lambda: kv_state.cache_stats(cfg, holder[0]))


def _position_only(newest):
  """The step inputs a stateless synthetic selector reads (only ``newest``)."""
  return selectors.StepInputs(None, None, None, newest)
