r"""Decode step time and host IO: measured on SmolLM2 here, modelled for the paper.

Paper figures (HiSparse): GLM-5.2-FP8 on 8xH200 at concurrency 8,
exposed IO per token vs a no-IO oracle: 7.7 ms synchronous, 3.0 ms with prefetch;
RESOLVE's IO phase 112 us per call on H200 PCIe5 vs 29 us on GH200 NVLink-C2C
(GLM-5.1, B=2k, batch 16).

Part 1 (measured, this machine): step time of the dense, sparse and tiered backends
on SmolLM2-135M vs context, with the tiered cache's miss rate and bytes moved per
token. Part 2 (model): exposed IO per decode step for GLM-5.1 at a given batch,
from a miss rate (default: LRU at B=2k on our DSA trace, from the latest
experiments/miss_rate run; else the paper's 13.4%), for H200 PCIe Gen5 and GH200
NVLink-C2C: ``misses x row bytes / bandwidth + layers x per-call latency``.

Command (~5 min on a 2-core CPU):
  python -m experiments.step_time
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, model_setup
from experiments.analysis import io_model
from models import backends, setup
from models.config import ModelConfig

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["1024", "2048", "4096"], "Prompt lengths to time.")
flags.DEFINE_integer("steps", 8, "Timed decode steps per backend (after 2 warm-up).")
flags.DEFINE_list("links", ["h200_pcie5:54:20", "gh200_c2c:450:5"],
                  "name:GB/s:per-call latency us (54 GB/s: our zero-copy fetch on an "
                  "H200; GH200 C2C ~450 GB/s).")
flags.DEFINE_integer("batch", 8, "Concurrency for the IO model (the paper's 8).")
flags.DEFINE_float("miss_rate", None, "Override the miss rate for the IO model.")
flags.DEFINE_string("out_root", None, "Results root.")


def timed_cache_stats(before: dict, after: dict, steps: int, row_bytes: int) -> dict:
  """The tiered cache's counters over the timed steps only, per step (one request:
  per token), as the step time is: the warm-up steps right after prefill carry
  most of the misses."""
  hits, misses, moved = (after[k] - before[k]
                         for k in ("hits", "misses", "host_to_device_bytes"))
  return dict(miss_rate=misses / max(1, hits + misses), misses_per_token=misses / steps,
              useful_kib_per_token=misses * 2 * row_bytes / steps / 1024,
              moved_kib_per_token=moved / steps / 1024)


def time_backend(model, ids, backend, context, selector, params):
  kwargs = {} if backend == "dense" else dict(selector=selector, selector_params=params)
  if backend == "tiered":
    kwargs.update(hot_slots=2 * selector.top_k, impl=model_setup.tier_impl())
  runner = backends.Runner(model, backend, context + FLAGS.steps + 3, **kwargs)
  tokens = np.asarray(ids[:context], np.int32)[None]
  logits = runner.prefill(tokens, [context])
  step = lambda logits: jax.block_until_ready(runner.step(jnp.argmax(logits, -1)))
  for _ in range(2):  # warm-up: compiles (and the hot cache fills after prefill)
    logits = step(logits)
  before = runner.cache_stats() if backend == "tiered" else None
  times = []
  for _ in range(FLAGS.steps):
    start = time.perf_counter()
    logits = step(logits)
    times.append(time.perf_counter() - start)
  row = dict(context=context, backend=backend, ms_per_step=1e3 * float(np.median(times)))
  if backend == "tiered":
    row.update(timed_cache_stats(before, runner.cache_stats(), FLAGS.steps,
                                 runner.tier_cfg.row_bytes))
  return row


def latest_lru_miss_rate(root=None) -> tuple[float, str]:
  """The newest full miss_rate run's warm LRU rate at B = 2k on the DSA trace of
  the pydoc text (not the held-out or test text, nor a --smoke run), under the
  results root ``root`` (default ``results/``)."""
  runs = sorted(pathlib.Path(root or common.RESULTS, "miss_rate").glob("*/rows.jsonl"))
  for run in reversed(runs):
    smoke = json.loads((run.parent / "config.json").read_text())["flags"].get("smoke")
    if smoke or common.run_text(run.parent) != (True, None):
      continue
    rows = [json.loads(l) for l in run.read_text().splitlines() if l.strip()]
    for r in rows:
      if r["selector"] == "dsa" and r["policy"] == "lru" and r["B_over_k"] == 2.0:
        return r["warm"], f"LRU B=2k on our DSA trace ({run.parent.name})"
  return 0.134, "the paper's LRU B=2k (no trace run found)"


def io_rows():
  miss, source = ((FLAGS.miss_rate, "flag") if FLAGS.miss_rate is not None
                  else latest_lru_miss_rate(FLAGS.out_root))
  cfg = ModelConfig.glm_5_1()
  rows = []
  for spec in FLAGS.links:
    name, link = io_model.Link.parse(spec)
    transfer = cfg.num_layers * io_model.miss_bytes_per_layer(cfg, FLAGS.batch, miss)
    rows.append(dict(link=name, GBps=link.bandwidth / 1e9, miss_rate=miss,
                     miss_source=source, transfer_ms=1e3 * transfer / link.bandwidth,
                     latency_ms=1e3 * cfg.num_layers * link.latency,
                     exposed_io_ms=io_model.exposed_io_ms(cfg, FLAGS.batch, miss, link),
                     paper_sync_ms=7.7, paper_prefetch_ms=3.0))
  return rows


def main(argv):
  del argv
  model_setup.refuse_given(model_setup.NO_LOOKAHEAD, "this runner runs no look-ahead "
                           "(generate, serve and prefetch do)")
  if FLAGS["prompt_tokens"].present:
    raise app.UsageError("--prompt_tokens: not used here (the context lengths are "
                         "--contexts)")
  out = common.start_run("step_time", FLAGS.flag_values_dict(), FLAGS.out_root)
  contexts = list(map(int, FLAGS.contexts))
  model, _, ids = model_setup.load_model_and_prompt(FLAGS.prompt_file, max(contexts) + 8,
                                                    FLAGS.offset)
  selector, params = setup.build_selector(FLAGS.selector, model.cfg, FLAGS.top_k,
                                                FLAGS.indexer_ckpt)
  measured = []
  for context in contexts:
    for backend in backends.BACKENDS:
      row = time_backend(model, ids, backend, context, selector, params)
      row["selector"] = FLAGS.selector if backend != "dense" else "-"
      measured.append(row)
      common.append_row(out, dict(table="measured", **row))
      print(f"{backend} @ {context}: {row['ms_per_step']:.1f} ms", flush=True)
  modelled = io_rows()
  for row in modelled:
    common.append_row(out, dict(table="io_model", **row))
  text = [f"## Measured on SmolLM2-135M, this CPU (median of {FLAGS.steps} steps "
          "after 2 warm-up; cache counters per step over the same steps; "
          f"selector {FLAGS.selector}, k={selector.top_k}, B=2k)",
          common.markdown_table(measured, ["context", "backend", "ms_per_step",
                                           "miss_rate", "misses_per_token",
                                           "useful_kib_per_token",
                                           "moved_kib_per_token"]),
          "", f"## Modelled exposed IO per decode step, GLM-5.1 (k=2048, 78 layers, "
          f"1152 B rows), batch {FLAGS.batch}, synchronous fetch; miss rate: "
          f"{modelled[0]['miss_source']}",
          common.markdown_table(modelled, ["link", "GBps", "miss_rate", "transfer_ms",
                                           "latency_ms", "exposed_io_ms",
                                           "paper_sync_ms", "paper_prefetch_ms"])]
  (out / "table.md").write_text("\n".join(text) + "\n")
  labels = [f"{r['backend']}@{r['context']}" for r in measured]
  common.bar_plot(out / "plot.png", labels, [r["ms_per_step"] for r in measured],
                  "ms / decode step", "SmolLM2-135M decode step (CPU)")
  print("\n".join(text))
  print(f"results: {out}")


if __name__ == "__main__":
  app.run(main)
