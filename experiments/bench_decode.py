r"""Decode-step time: tiered cache vs full-KV sparse attention (same selections).

Paper table: HiSparse (arXiv 2608.07009) claims the resolution mechanism has "no
measurable per-token cost" next to sparse attention over a full HBM KV (SPECS.md
§1.9). This runner measures the step time of both paths on this machine, on a
synthetic selection stream whose step-to-step churn equals the paper's LRU miss rate
at B=2k (13.4%), and the memory each keeps on the accelerator.

Command (the README's main job; ~1-2 min on a 2-core CPU):
  python -m experiments.bench_decode
Defaults: 4 requests, 4 layers, 32K context, B=2048, k=512, 8 q / 2 KV heads, D=128,
f32. ``--smoke`` runs in seconds. Results: results/bench_decode/<time>/.
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp

from experiments import common
from kvtier_jax import decode, full_kv, selectors
from kvtier_jax import state as kv_state
from kvtier_jax.config import TierConfig

FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 4, "R, requests decoded together.")
flags.DEFINE_integer("layers", 4, "L.")
flags.DEFINE_list("contexts", ["32768"], "Prompt lengths to measure.")
flags.DEFINE_integer("hot_slots", 2048, "B.")
flags.DEFINE_integer("top_k", 512, "k.")
flags.DEFINE_integer("q_heads", 8, "Hq.")
flags.DEFINE_integer("kv_heads", 2, "Hkv.")
flags.DEFINE_integer("head_dim", 128, "D.")
flags.DEFINE_float("churn", 0.134, "Per-step selection churn (paper's LRU miss rate).")
flags.DEFINE_integer("warmup", 3, "Untimed steps.")
flags.DEFINE_integer("iters", 10, "Timed steps (median).")
flags.DEFINE_list("variants", ["full_kv", "tiered"], "full_kv, tiered, tiered_pallas.")
flags.DEFINE_bool("smoke", False, "Tiny shapes, seconds.")
flags.DEFINE_string("out_root", None, "Results root (default ./results).")

COLUMNS = ["context", "variant", "median_ms", "vs_full_kv", "miss_rate",
           "device_MiB", "host_MiB"]


def measure(cfg: TierConfig, variant: str, context: int, kp, vp, q, kn) -> dict:
  lens = jnp.full((cfg.num_requests,), context, jnp.int32)
  select = selectors.churn_selector(context, cfg.top_k, cfg.num_units, FLAGS.churn)
  if variant == "full_kv":
    holder = [full_kv.init_full_kv(cfg, kp, vp, lens)]
    step = jax.jit(lambda s, q, kn: full_kv.full_kv_decode_step(cfg, s, q, kn, kn, select),
                   donate_argnums=(0,))

    def run():
      out, holder[0] = step(holder[0], q, kn)
      return out
    ms = common.median_ms(run, FLAGS.warmup, FLAGS.iters)
    return dict(median_ms=ms, miss_rate=None, host_MiB=0.0,
                device_MiB=(holder[0].k.nbytes + holder[0].v.nbytes) / 2**20)

  if variant == "tiered_pallas":
    cfg = cfg.replace(resolve_impl="pallas", attention_impl="pallas", fetch_impl="pallas")
  decoder = decode.TieredDecoder(cfg, select=select)
  holder = [decoder.prefill(kv_state.init_state(cfg), kp, vp, [context] * cfg.num_requests)]

  def run():
    out, holder[0] = decoder.step(holder[0], q, kn, kn)
    return out
  for _ in range(FLAGS.warmup):
    jax.block_until_ready(run())
  before = kv_state.cache_stats(cfg, holder[0])
  ms = common.median_ms(run, 0, FLAGS.iters)
  after = kv_state.cache_stats(cfg, holder[0])
  misses = after["misses"] - before["misses"]
  lookups = misses + after["hits"] - before["hits"]
  by_kind = kv_state.array_bytes_by_memory_kind(holder[0])
  host_kind = kv_state.host_memory_kind()
  return dict(median_ms=ms, miss_rate=misses / max(1, lookups),
              host_MiB=by_kind.get(host_kind, 0) / 2**20,
              device_MiB=sum(v for k, v in by_kind.items() if k != host_kind) / 2**20)


def render(out, rows) -> str:
  table = common.markdown_table(rows, COLUMNS)
  (out / "table.md").write_text(table + "\n")
  common.bar_plot(out / "plot.png", [f"{r['variant']}@{r['context']}" for r in rows],
                  [r["median_ms"] for r in rows], "ms / decode step",
                  f"decode step, R={FLAGS.requests} L={FLAGS.layers} "
                  f"B={FLAGS.hot_slots} k={FLAGS.top_k}")
  return table


def main(argv):
  del argv
  if FLAGS.smoke:
    FLAGS.contexts, FLAGS.hot_slots, FLAGS.top_k = ["1024"], 128, 64
    FLAGS.head_dim, FLAGS.iters, FLAGS.warmup = 64, 3, 1
  out = common.start_run("bench_decode", FLAGS.flag_values_dict(), FLAGS.out_root)
  rows = []
  for context in map(int, FLAGS.contexts):
    cfg = TierConfig(num_layers=FLAGS.layers, num_requests=FLAGS.requests,
                     max_len=context + 4 * (FLAGS.warmup + FLAGS.iters),
                     num_q_heads=FLAGS.q_heads, num_kv_heads=FLAGS.kv_heads,
                     head_dim=FLAGS.head_dim, hot_slots=FLAGS.hot_slots, top_k=FLAGS.top_k)
    key = jax.random.key(0)
    shape = (cfg.num_layers, cfg.num_requests, context, cfg.num_kv_heads, cfg.head_dim)
    kp = jax.random.normal(key, shape, cfg.dtype)
    vp = jax.random.normal(jax.random.fold_in(key, 1), shape, cfg.dtype)
    q = jax.random.normal(jax.random.fold_in(key, 2), (cfg.num_layers, cfg.num_requests,
                                                       cfg.num_q_heads, cfg.head_dim))
    kn = jax.random.normal(jax.random.fold_in(key, 3), shape[:2] + shape[3:])
    base = None
    for variant in FLAGS.variants:
      row = dict(context=context, variant=variant, **measure(cfg, variant, context, kp, vp,
                                                              q, kn))
      base = row["median_ms"] if variant == "full_kv" else base
      row["vs_full_kv"] = row["median_ms"] / base if base else None
      rows.append(row)
      common.append_row(out, row)
      print(f"  {variant} @ {context}: {row['median_ms']:.2f} ms", flush=True)
  print(render(out, rows))
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
