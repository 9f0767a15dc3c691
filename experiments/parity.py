r"""Exactness of the tiered cache on the real model: tiered vs sparse over a full KV.

The project's central claim (HiSparse; docs/DESIGN.md, "Invariants"): moving KV
between a host tier and a hot cache changes placement only, never outputs. Both runs use
the same selector on SmolLM2-135M over real text; the tiered run is teacher-forced
on the sparse run's greedy tokens; every step's logits are compared.

Command (~2-3 min on a 2-core CPU at the defaults):
  python -m experiments.parity --prompt_tokens=4096 --steps=128 --selector=quest \
      --hot_slots=512
``--policy=rank --rank_depth=1024`` runs the tiered side with the rank-aware
victims (the selector ranks 1024 positions; the first --top_k are attended);
``--impl=fused`` with the fused layer step (on a CPU one native call per layer).
Last line: ``parity: TOKENS_MATCHED/TOKENS_TOTAL tokens, max_abs_logit_diff=X``;
exit status 1 unless every token matches and X <= 1e-4.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from experiments import model_setup
from kvtier_jax.policies import PolicyConfig
from models import backends, setup

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 128, "Decode steps.")
flags.DEFINE_integer("hot_slots", None, "B (default 2k).")
flags.DEFINE_enum("policy", "lru", ["lru", "freq", "rank"], "Tiered replacement policy.")
flags.DEFINE_integer("rank_depth", 1024, "policy=rank: positions the selector ranks "
                     "(it is built at this top_k; the first --top_k are attended).")
TOLERANCE = 1e-4


def main(argv):
  del argv
  model_setup.refuse_given(model_setup.NO_LOOKAHEAD, "this runner runs no look-ahead "
                           "(generate, serve and prefetch do)")
  model, _, ids = model_setup.load_model_and_prompt(FLAGS.prompt_file, FLAGS.prompt_tokens,
                                                    FLAGS.offset)
  selector, params = setup.build_selector(FLAGS.selector, model.cfg, FLAGS.top_k,
                                                FLAGS.indexer_ckpt)
  hot_slots = FLAGS.hot_slots or 2 * selector.top_k
  max_len = FLAGS.prompt_tokens + FLAGS.steps + 1
  tokens, lens = np.asarray(ids, np.int32)[None], np.array([FLAGS.prompt_tokens])
  options = dict(impl=model_setup.tier_impl(FLAGS.policy != "lru"),
                 policy=PolicyConfig(FLAGS.policy))
  tiered_selector = selector
  if FLAGS.policy == "rank":  # the same selector, ranking rank_depth positions
    tiered_selector, _ = setup.build_selector(FLAGS.selector, model.cfg,
                                              FLAGS.rank_depth, FLAGS.indexer_ckpt)
    options.update(top_k=selector.top_k,
                   policy=PolicyConfig("rank", rank_depth=FLAGS.rank_depth))
  sparse = backends.Runner(model, "sparse", max_len, selector=selector,
                           selector_params=params)
  tiered = backends.Runner(model, "tiered", max_len, selector=tiered_selector,
                           selector_params=params, hot_slots=hot_slots, **options)
  start = time.perf_counter()
  ref = sparse.prefill(tokens, lens)
  got = tiered.prefill(tokens, lens)
  print(f"prefill {FLAGS.prompt_tokens} tokens x2: {time.perf_counter() - start:.1f} s; "
        f"selector={FLAGS.selector} k={selector.top_k} B={hot_slots} "
        f"policy={FLAGS.policy}", flush=True)
  matched, worst = 0, float(jnp.max(jnp.abs(ref - got)))
  for step in range(FLAGS.steps):
    token = jnp.argmax(ref, axis=-1)  # the sparse run's greedy token, fed to both
    matched += int(token[0] == jnp.argmax(got, axis=-1)[0])
    ref, got = sparse.step(token), tiered.step(token)
    worst = max(worst, float(jnp.max(jnp.abs(ref - got))))
    print(f"\rstep {step + 1}/{FLAGS.steps}  max_abs_logit_diff={worst:.3g}", end="",
          flush=True)
  matched += int(jnp.argmax(ref, -1)[0] == jnp.argmax(got, -1)[0])
  total = FLAGS.steps + 1
  stats = tiered.cache_stats()
  print(f"\ntiered: miss rate {stats['miss_rate']:.3f}, {stats['misses']} misses, "
        f"{stats['host_to_device_bytes'] / 2**20:.1f} MiB host->device")
  print(f"parity: {matched}/{total} tokens, max_abs_logit_diff={worst:.3g}")
  sys.exit(0 if matched == total and worst <= TOLERANCE else 1)


if __name__ == "__main__":
  app.run(main)
