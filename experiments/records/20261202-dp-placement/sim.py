"""Data-parallel placement in the engine, measured on FakeModel (2 devices, host
pages per device, prefix cache): engine steps to drain 150 requests, queue wait in
steps, cached prompt tokens; paired over seeds (same workload per seed).

  JAX_PLATFORMS=cpu PYTHONPATH=. SEED0=100 python experiments/records/20261202-dp-placement/sim.py 80,8,0.2 80,8,0.35

(2026-12-02, 2-core CPU, ~4 min per seed block.) Variants:
  old       before 2026-12-02: the prefix's device if it has a free slot, else the
            fewest running requests (no look at pages);
  backfill  the prefix's device only if it also has room for the prompt's pages,
            else the least loaded device with room;
  engine    the engine now (kvtier_jax.serving.engine.Engine._pick_slot): the
            prefix's device if it has a free slot, else the least loaded with room.
The files beside this one are its outputs (backfill_*.txt: the "new" rows are
backfill; roomonly_*.txt: the "roomonly" rows are the engine's rule)."""
import collections
import os
import sys

import numpy as np

from kvtier_jax.serving import Engine, EngineConfig, State
from kvtier_jax.serving import engine as engine_mod
from tests.test_prefix_cache import TwoDeviceModel

engine_pick = engine_mod.Engine._pick_slot


def old_pick(self, free, shared, num_pages=0):
  pool = self.pool
  open_parts = sorted({pool.slot_partition(s) for s in free})
  if shared and pool.page_partition(shared[0]) in open_parts:
    part = pool.page_partition(shared[0])
  else:
    running = collections.Counter(pool.slot_partition(r.slot) for r in self.slots
                                  if r is not None)
    part = min(open_parts, key=lambda p: (running[p], -pool.free_in(p), p))
  return next(s for s in free if pool.slot_partition(s) == part)


def backfill_pick(self, free, shared, num_pages):
  pool = self.pool
  home = pool.page_partition(shared[0]) if shared else None
  open_parts = sorted({pool.slot_partition(s) for s in free})
  if home in open_parts:
    reused = sum(pool.page_partition(p) == home for p in shared)
    evictable = self.radix.evictable_pages(lambda pages: pool.page_partition(pages[0]))
    room = pool.free_in(home) + sum(pool.refs[p] == 1 for p in evictable.get(home, []))
    if num_pages - reused <= room:
      return next(s for s in free if pool.slot_partition(s) == home)
    free = [s for s in free if pool.slot_partition(s) != home] or free
  return engine_pick(self, free, [], num_pages)


def run(pick, seed, pages, slots, rate, n=150):
  engine_mod.Engine._pick_slot = pick
  rng = np.random.default_rng(seed)
  prefixes = [rng.integers(0, 60, int(rng.integers(24, 48))).tolist() for _ in range(4)]
  weights = np.array([0.55, 0.25, 0.15, 0.05])
  engine = Engine(TwoDeviceModel(num_slots=slots, num_host_pages=pages, max_len=128),
                  EngineConfig(max_step_tokens=64, prefix_cache=True))
  reqs, submitted, admitted, step = [], {}, {}, 0
  while len(reqs) < n or engine.has_work:
    for _ in range(rng.poisson(rate) if len(reqs) < n else 0):
      prompt = prefixes[rng.choice(4, p=weights)] + rng.integers(
          0, 60, int(rng.integers(4, 24))).tolist()
      r = engine.submit(prompt, int(rng.integers(8, 40)))
      reqs.append(r)
      submitted[r.id] = step
    engine.step()
    step += 1
    for r in reqs:
      if r.id not in admitted and r.state is not State.WAITING:
        admitted[r.id] = step
  waits = [admitted[r.id] - submitted[r.id] for r in reqs]
  return dict(steps=step, mean_wait=np.mean(waits), p90_wait=np.percentile(waits, 90),
              cached=engine.cached_tokens)


VARIANTS = [("old", old_pick), ("backfill", backfill_pick), ("engine", engine_pick)]
SEEDS = int(os.environ.get("SEEDS", 8))
SEED0 = int(os.environ.get("SEED0", 100))
for arg in sys.argv[1:]:
  pages, slots, rate = int(arg.split(",")[0]), int(arg.split(",")[1]), float(arg.split(",")[2])
  agg = collections.defaultdict(list)
  for seed in range(SEED0, SEED0 + SEEDS):
    for name, pick in VARIANTS:
      for k, v in run(pick, seed, pages, slots, rate).items():
        agg[(name, k)].append(v)
  for name, _ in VARIANTS[1:]:
    for k in ("steps", "mean_wait", "cached"):
      d = np.array(agg[(name, k)]) - np.array(agg[("old", k)])
      print(f"  {name} - old {k}: {d.mean():+.1f} +- {d.std(ddof=1) / np.sqrt(len(d)):.1f}")
  for name, _ in VARIANTS:
    print(f"pages={pages} slots={slots} rate={rate} {name:8s}: " + "  ".join(
        f"{k} {np.mean(agg[(name, k)]):.1f}" for k in ("steps", "mean_wait", "p90_wait", "cached")),
        flush=True)
