r"""Greedy generation with SmolLM2-135M over a chosen cache backend.

Shows the three backends on the real model: ``dense`` (full KV, full attention),
``sparse`` (full KV + a selector) and ``tiered`` (host tier + hot cache + the same
selector), with decode speed, cache traffic and the KV each keeps on the device.

Command (~1 min on a 2-core CPU at the defaults):
  python -m experiments.generate --cache=tiered --selector=quest --prompt_tokens=1024 \
      --steps=32 --hot_slots=512
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import model_setup  # also the shared flags
from models import backends, setup

FLAGS = flags.FLAGS
flags.DEFINE_enum("cache", "tiered", list(backends.BACKENDS), "Cache backend.")
flags.DEFINE_integer("steps", 32, "Tokens to generate.")
flags.DEFINE_integer("hot_slots", None, "B for the tiered cache (default 2k).")


def main(argv):
  del argv
  if FLAGS.lookahead != "none" and FLAGS.cache != "tiered":
    raise ValueError("--lookahead needs --cache=tiered")
  if FLAGS.draft_ckpt and FLAGS.lookahead == "none":
    raise ValueError("--draft_ckpt drafts for --lookahead=draft")
  if FLAGS["lookahead_cap"].present and FLAGS.lookahead == "none":
    raise ValueError("--lookahead_cap caps --lookahead=draft's prefetch")
  model_setup.check_draft_ckpt()
  model, tokenizer, ids = model_setup.load_model_and_prompt(
      FLAGS.prompt_file, FLAGS.prompt_tokens, FLAGS.offset)
  selector = params = None
  kwargs = {}
  if FLAGS.cache != "dense":
    selector, params = setup.build_selector(FLAGS.selector, model.cfg,
                                                  FLAGS.top_k, FLAGS.indexer_ckpt)
    kwargs = dict(selector=selector, selector_params=params)
    if FLAGS.cache == "tiered":
      kwargs.update(hot_slots=FLAGS.hot_slots or 2 * selector.top_k,
                    impl=model_setup.tier_impl())
  if FLAGS.lookahead != "none":
    kwargs.update(lookahead=FLAGS.lookahead, lookahead_cap=FLAGS.lookahead_cap)
    if FLAGS.draft_ckpt:
      kwargs["draft_head"] = model_setup.load_draft_head(model.cfg, model.weights())
  runner = backends.Runner(model, FLAGS.cache, FLAGS.prompt_tokens + FLAGS.steps,
                           **kwargs)
  start = time.perf_counter()
  logits = runner.prefill(np.asarray(ids, np.int32)[None], [FLAGS.prompt_tokens])
  jax.block_until_ready(logits)
  prefill_s = time.perf_counter() - start
  out, times, accepted = [], [], []
  for step in range(FLAGS.steps):
    token = jnp.argmax(logits, axis=-1)
    out.append(int(token[0]))
    if runner.last_draft is not None and step > 0:
      accepted.append(runner.last_draft[0] == out[-1])
    if step + 1 == FLAGS.steps:
      break
    start = time.perf_counter()
    logits = jax.block_until_ready(runner.step(token))
    times.append(time.perf_counter() - start)
    print(f"\r[{step + 2}/{FLAGS.steps}] {1 / times[-1]:.1f} tok/s", end="", flush=True)
  print()
  print("continuation:", repr(tokenizer.decode(out)))
  # The first step compiles; report the median of the rest.
  steady = np.median(times[1:]) if len(times) > 1 else float("nan")
  print(f"cache={FLAGS.cache} selector={FLAGS.selector if selector else '-'} "
        f"prompt={FLAGS.prompt_tokens} tokens")
  print(f"prefill {prefill_s:.2f} s, its compile included "
        f"({FLAGS.prompt_tokens / prefill_s:.0f} tok/s); "
        f"decode {1 / steady:.2f} tok/s (median {1e3 * steady:.0f} ms/step)")
  stats = runner.cache_stats()
  if FLAGS.cache == "tiered":
    print(f"hits {stats['hits']}, misses {stats['misses']} "
          f"(miss rate {stats['miss_rate']:.3f}), host->device "
          f"{stats['host_to_device_bytes'] / 2**20:.2f} MiB "
          f"({stats['fetched_rows']} rows incl. any gather padding)")
  if FLAGS.lookahead != "none":
    draft = "lookup, else head" if FLAGS.draft_ckpt else "prompt lookup"
    print(f"lookahead ({draft}): draft accepted {sum(accepted)}/{len(accepted)}; "
          f"{stats['prefetched']} rows prefetched off the critical path, "
          f"{stats['misses']} misses on it")
  print("device KV bytes per request: "
        f"{stats['device_kv_bytes_per_request'] / 2**20:.2f} MiB"
        + (f" (+ selector state {stats['selector_state_bytes_per_request'] / 2**20:.2f}"
           " MiB)" if "selector_state_bytes_per_request" in stats else ""))


if __name__ == "__main__":
  app.run(main)
