"""The serving engine on SmolLM2 (real weights, its first ``SMOKE_LAYERS``): the
tiered engine yields the sparse engine's tokens and each request's solo tokens,
with staggered arrivals, mixed lengths, an abort, a seeded sampled request,
preemption under host-page pressure, misses served from the host tier, and no
recompilation as requests come and go."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax.serving import Engine, EngineConfig, SamplingParams, State, snapshot
from kvtier_jax.serving.bench import RequestSpec, decode_logits_among, random_others
from kvtier_jax import sharding
from kvtier_jax.config import ImplConfig
from kvtier_jax.driver import StepRefused
from models import backends, serving, setup, sharded_serving, text
from models.transformer import Transformer
from tests.util import SMOKE_LAYERS, smollm2_or_skip

pytest.importorskip("models.transformer")

# (offset in the text, prompt tokens, max_new_tokens, sampling, engine steps before
# it arrives); one sampled request truncates by top-p, one by top-k.
WORKLOAD = [(0, 150, 24, SamplingParams(), 0),
            (400, 20, 6, SamplingParams(), 0),  # fits the hot cache: no host pages
            (900, 200, 10, SamplingParams(temperature=0.8, top_p=0.9, seed=7), 2),
            (1500, 140, 12, SamplingParams(), 3),
            (2100, 90, 20, SamplingParams(temperature=1.0, top_k=40, seed=11), 5)]
ABORTED = 3  # aborted two steps after it arrives


@pytest.fixture(scope="module")
def model_and_ids():
  model, tokenizer = smollm2_or_skip(SMOKE_LAYERS)
  return model, text.tokenize_prompt(tokenizer, text.load_text(), 2400)


def backend(model, name, host_pages=None, chunk_size=64, **extra):
  selector, params = setup.build_selector("quest", model.cfg, 32)
  if name == "tiered":
    extra.update(hot_slots=48, host_pages=host_pages)
  return serving.ServingBackend(model, name, 3, 256, selector=selector,
                                selector_params=params, chunk_size=chunk_size,
                                page_size=16, **extra)


# Device bytes: with the full 30 layers, the staging buffer (11.8 MB) + ~13 MB of
# requests. Both scale with the layers, so does the cut model's budget: the same
# requests fit (the assertions on concurrency and preemption below hold).
BUDGET = 24 * 2**20 * SMOKE_LAYERS // 30


def serve(model, ids, name, workload, host_pages=None, abort=None, probe=None,
          logits=None, backend_args=None, refuse=None, **config):
  """Serves ``workload``; ``logits``: a dict that gets each request's logits (row
  bytes) at each position, in the order computed (decode steps, and the last
  position of each prefill chunk; a resumed request replays);
  ``refuse(engine, active)``: a slot whose host pages a decode step then loses (the
  step itself refuses, for want of a page; the pages come back with the refused
  state), or None."""
  engine = Engine(backend(model, name, host_pages, **(backend_args or {})),
                  EngineConfig(max_step_tokens=64, kv_budget_bytes=BUDGET, **config))
  if refuse is not None:
    model_decode, set_pages = engine.model.decode, engine.model.set_pages

    def refusing_decode(state, tokens, active):
      slot = refuse(engine, active)
      if slot is None:
        return model_decode(state, tokens, active)
      holed = engine.pool.table.copy()
      holed[slot] = -1
      try:
        model_decode(set_pages(state, holed), tokens, active)
      except StepRefused as err:
        raise StepRefused(str(err), set_pages(err.state, engine.pool.table)) from None
      raise AssertionError("a step without a slot's pages did not refuse")

    engine.model.decode = refusing_decode
  if logits is not None:
    decode = engine.model.decode

    def recording_decode(state, tokens, active):
      state, out = decode(state, tokens, active)
      rows = np.asarray(out)
      for req in engine.slots:
        if req is not None and active[req.slot]:
          logits.setdefault((req.id, req.cached), []).append(rows[req.slot].tobytes())
      return state, out

    engine.model.decode = recording_decode
    prefill = engine.model.prefill

    def recording_prefill(state, slot, tokens, start, count):
      state, out = prefill(state, slot, tokens, start, count)
      req = engine.slots[slot]
      logits.setdefault((req.id, start + count - 1), []).append(np.asarray(out).tobytes())
      return state, out

    engine.model.prefill = recording_prefill
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
  installs = lambda: (serving._selector_install._cache_size(),
                      serving._write_through._cache_size())
  installs_before = installs()

  def probe(engine, name="tiered"):
    running[name] = max(running[name], sum(r is not None for r in engine.slots))
    decoded = any(len(r.output) >= 2 for r in engine.requests.values())
    if name == "tiered" and decoded:  # the step and the prefill have compiled
      sizes.append((backends.tiered_step._cache_size(), serving._prefill._cache_size()))

  tiered, got = serve(model, ids, "tiered", WORKLOAD, host_pages=24, abort=ABORTED,
                      probe=probe)
  _, want = serve(model, ids, "sparse", WORKLOAD, abort=ABORTED,
                  probe=lambda e: probe(e, "sparse"))
  # Both engines' installs compiled once between them: their states are committed
  # from the start, as every step returns them (else once per committed-ness).
  assert all(n - b <= 1 for n, b in zip(installs(), installs_before)), installs()
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


def test_disk_tier_round_trips_host_pages_and_keeps_the_tokens(model_and_ids, tmp_path):
  """The prefix cache with a disk tier below it. Two 150-token prefixes take turns:
  the host pool (20 pages) cannot keep both cached while a third request runs, so
  each is spilled to the disk tier and read back (tensorstore) by its next sharer,
  and prefixes still on the host are restaged from their pages; requests sharing
  nothing run in between, so the staging buffer never holds a prefix a sharer needs.
  Tokens equal the sparse engine's (no cache). Then the host pages' bytes: read for
  the disk, stored, written to other pages, read again; and a snapshot taken mid-run
  restored into a new backend ends the same way."""
  model, ids = model_and_ids
  one, two = ids[:150].tolist(), ids[600:750].tolist()
  workload = [(one + ids[300:340].tolist(), 6, SamplingParams(), 0),
              (two + ids[900:940].tolist(), 6, SamplingParams(), 0),
              (one + ids[1300:1310].tolist(), 4, SamplingParams(), 6),  # one still on host
              (one + ids[1000:1040].tolist(), 6, SamplingParams(), 30),
              (two + ids[1100:1140].tolist(), 6, SamplingParams(temperature=0.7, seed=5), 31),
              (one + ids[1200:1240].tolist(), 6, SamplingParams(), 32)]
  flat, rows = [], []
  for prompt, new, sp, at in workload:
    rows.append((len(flat), len(prompt), new, sp, at))
    flat += list(prompt)
  config = dict(prefix_cache=True, disk_pages=32, disk_policy="load")
  snap = tmp_path / "snap"

  def save_once(engine):  # mid-run: requests decoding, prefixes on disk
    if engine.steps == 34:
      snapshot.save(engine, snap)

  engine, got = serve(model, flat, "tiered", rows, host_pages=20, probe=save_once,
                      disk_dir=str(tmp_path / "disk"), **config)
  _, want = serve(model, flat, "sparse", rows)
  for i in got:
    assert got[i].state is State.FINISHED, (i, got[i].reason)
    assert got[i].output == want[i].output, i
  assert engine.disk_loaded_tokens >= 2 * 128, "no prefix came back from disk"
  assert engine.cached_tokens > engine.disk_loaded_tokens, "none restaged from the host"
  # Not into a backend whose selection differs with the same array shapes (index
  # sharing: other positions attended, other tokens); it restored silently.
  selector, params = setup.build_selector("quest", model.cfg, 32)
  shared = serving.ServingBackend(model, "tiered", 3, 256, selector=selector,
                                  selector_params=params, chunk_size=64, page_size=16,
                                  hot_slots=48, host_pages=20, index_share=2)
  with pytest.raises(snapshot.SnapshotError, match="decode_id"):
    snapshot.restore(snap, shared, EngineConfig(
        max_step_tokens=64, kv_budget_bytes=BUDGET, disk_dir=str(tmp_path / "disk3"),
        **config))
  # Restored from the snapshot into a new backend, the run ends the same way.
  restored = snapshot.restore(snap, backend(model, "tiered", 20), EngineConfig(
      max_step_tokens=64, kv_budget_bytes=BUDGET, disk_dir=str(tmp_path / "disk2"),
      **config))
  assert restored.has_work and any(r.state is State.DECODING for r in restored.slots if r)
  restored.run()
  assert {i: r.output for i, r in restored.requests.items()} == {
      str(i): r.output for i, r in got.items()}

  from kvtier_jax.serving.disk import DiskTier
  tiered, state = engine.model, engine.state
  pages = engine.radix.held_pages()[:4]
  fields = tiered.read_pages(state, pages)
  host = [np.moveaxis(np.asarray(a)[:, pages], 1, 0) for a in
          (state.cache.tier.host_k, state.cache.tier.host_v)]
  assert [f.tobytes() for f in fields] == [h.tobytes() for h in host]
  empty = tiered.read_pages(state, [])
  assert [(f.shape, f.dtype) for f in empty] == [((0,) + f.shape[1:], f.dtype) for f in fields]
  disk = DiskTier(tmp_path / "again", 8)
  back = disk.read(disk.write(fields))
  others = [p for p in range(tiered.num_host_pages) if engine.pool.refs[p] == 0][:4]
  state = tiered.write_pages(state, others, back)
  assert [f.tobytes() for f in tiered.read_pages(state, others)] == [
      f.tobytes() for f in fields]


def test_handoff_continues_on_another_engine_with_the_same_tokens(model_and_ids):
  """PDD's relay: a request decodes a few tokens on one tiered engine and moves to
  another, either with the K/V pages the receiver lacks (it restages them and decodes
  on) or as token ids only (it prefills the prompt's tail and replays the relayed
  tokens through decode steps); greedy and seeded sampling yield the tokens of the
  sparse engine's uninterrupted run."""
  model, ids = model_and_ids
  prompt = ids[:170].tolist()
  # (The two-process test in test_handoff.py runs the other two combinations.)
  cases = [(SamplingParams(), 5, "all"), (SamplingParams(temperature=0.8, seed=9), 3, "none")]
  rows = [(0, 170, 14, sp, 0) for sp, _, _ in cases]
  _, want = serve(model, ids, "sparse", rows)
  config = EngineConfig(max_step_tokens=64, kv_budget_bytes=BUDGET, prefix_cache=True)
  relay = Engine(backend(model, "tiered"), config)
  main = Engine(backend(model, "tiered"), config)
  for i, (sp, relayed, kv) in enumerate(cases):
    req = relay.submit(prompt, 14, sp, request_id=str(i))
    while len(req.output) < relayed:
      relay.step()
    start = 0
    if kv == "all" and main.radix.num_pages:  # send only what the receiver lacks
      start = len(main.radix.match_prefix(prompt[:128])[0]) * 16
    moved = main.accept(relay.export(str(i), kv=kv, start=start))
    assert req.state is State.HANDED_OFF and moved.output == req.output
    assert (moved.imported is not None) == (kv == "all")  # one model_id: K/V taken
    main.run()
    assert moved.state is State.FINISHED and moved.output == want[i].output, i
  assert main.cached_tokens > 0  # the second handoff reuses the receiver's cached prompt
  # One element of one weight moved: another model, whose K/V are not taken.
  weights = model.weights()
  name = sorted(weights)[int(np.random.default_rng().integers(len(weights)))]
  moved_weights = {**weights, name: weights[name].ravel().at[0].add(1).reshape(
      weights[name].shape)}
  other = backend(Transformer.from_params(model.cfg, moved_weights), "tiered")
  assert other.model_id != relay.model.model_id == main.model.model_id
  relay.pool.check(relay.radix.held_pages())
  main.pool.check(main.radix.held_pages())


def test_kv_from_a_sender_with_other_chunks_never_enters_the_prefix_cache(model_and_ids):
  """A prompt's K/V depend on its chunk boundaries in the last bits (XLA blocks a
  [C, E] matmul by C). A receiver with chunks of 64 that took K/V prefilled in
  chunks of 32 would cache numbers it never computes itself, and later requests
  would read them: it replays the request instead, and its cached prompt pages are
  bit for bit those of its own cold run."""
  model, ids = model_and_ids
  prompt = ids[:170].tolist()
  config = EngineConfig(max_step_tokens=64, kv_budget_bytes=BUDGET, prefix_cache=True)

  def cached_pages(engine):
    pages = engine.radix.match_prefix(prompt)[0]
    assert len(pages) == 128 // 16  # the prompt's whole chunks of 64
    return engine.model.read_pages(engine.state, pages)

  cold = Engine(backend(model, "tiered"), config)
  alone = cold.submit(prompt, 8)
  cold.run()
  relay = Engine(backend(model, "tiered", chunk_size=32), config)
  req = relay.submit(prompt, 8)
  while len(req.output) < 3:
    relay.step()
  handoff = relay.export(req.id, kv="all")
  assert handoff.chunk_size == 32 and handoff.kv_end > len(prompt)
  main = Engine(backend(model, "tiered"), config)
  moved = main.accept(handoff)
  assert moved.imported is None  # replayed: the KV is not this engine's numbers
  main.run()
  assert main.imported_tokens == 0 and moved.output[:3] == req.output
  for got, want in zip(cached_pages(main), cached_pages(cold)):
    np.testing.assert_array_equal(got, want)
  # The cut is real: the sender's pages differ from the receiver's in some bits.
  sent = [f[:8] for f in handoff.kv]
  assert any((a != b).any() for a, b in zip(sent, cached_pages(cold)))
  assert moved.output == alone.output  # (greedy: no last-bit flip moved a token)


def test_backend_refuses_what_would_corrupt_it_silently(model_and_ids):
  """A prefill chunk off the chunk grid (its staging and host writes would be
  clamped onto other rows), and a snapshot whose host length mirror is not the
  state's own, a page table with a page twice in a slot or out of range: clear
  errors. The dense backend charges no selector state."""
  model, _ = model_and_ids
  # An index sharing that does not divide the layers: refused when built (the
  # sparse backend prefilled, then failed its first decode step).
  selector, params = setup.build_selector("quest", model.cfg, 32)
  share = model.cfg.num_layers + 1
  for name in ("sparse", "tiered"):
    with pytest.raises(ValueError, match=f"index_share={share} must divide"):
      serving.ServingBackend(model, name, 3, 256, selector=selector, selector_params=params,
                             hot_slots=48, chunk_size=64, page_size=16, index_share=share)
    with pytest.raises(ValueError, match=f"index_share={share} must divide"):
      backends.Runner(model, name, 256, selector=selector, selector_params=params,
                      hot_slots=48, index_share=share)
  tiered = backend(model, "tiered")
  state = tiered.init()
  tokens = np.zeros((64,), np.int32)
  for start, count in ((48, 12), (0, 0), (0, 65)):
    with pytest.raises(ValueError, match="chunk_size=64"):
      tiered.prefill(state, 0, tokens, start, count)
  leaves = tiered.snapshot(state)
  for bad in (np.array([5, 0, 0]), np.array([0.0, 0.0, 0.0]), np.array([0, 0])):
    with pytest.raises(ValueError, match="length mirror"):
      tiered.restore_state(leaves[:-1] + [bad])
  tiered.restore_state(leaves)  # the mirror as saved
  # Page tables the step would read through silently: a page twice in a slot, an id
  # past the host tier (or below -1), another shape. Slots may share a page.
  num_pages = tiered.tier_cfg.num_host_pages
  table = np.full(state.cache.tier.page_table.shape, -1, np.int32)
  table[0, :2] = table[1, :2] = [3, 4]  # a shared prefix
  assert (np.asarray(tiered.set_pages(state, table).cache.tier.page_table) == table).all()
  for bad, match in (([5, 5], "twice"), ([num_pages, 0], "page ids"),
                     ([-2, 0], "page ids"),
                     ([6, 3], "page 3 is shared at another position: page index 0 of "
                      "slot 1, 1 of slot 2")):
    wrong = table.copy()
    wrong[2, :2] = bad
    with pytest.raises(ValueError, match=match):
      tiered.set_pages(state, wrong)
  with pytest.raises(ValueError, match="page table is int"):
    tiered.set_pages(state, table[:, :-1])
  # A slot, position, page or content out of range (a clamped index would write
  # another slot's rows or drop the write): refused before any donated call.
  for call, match in ((lambda: tiered.prefill(state, 3, tokens, 0, 64), "slot=3"),
                      (lambda: tiered.prefill(state, 0, tokens, 256, 64), "pass max_len"),
                      (lambda: tiered.prefill(state, 0, tokens, -64, 64), "start=-64"),
                      (lambda: tiered.prefill(state, 0, tokens, 0.0, 64), "start=0.0"),
                      (lambda: tiered.prefill(state, 0, tokens[:32], 0, 32), "one chunk"),
                      (lambda: tiered.prefill(state, 0, tokens + model.cfg.vocab_size,
                                              0, 8), "token ids"),
                      (lambda: tiered.start_decoding(state, -1, 10), "slot=-1"),
                      (lambda: tiered.start_decoding(state, 0, 257), "length=257"),
                      (lambda: tiered.load_prefix(state, 0, 300), "length=300"),
                      (lambda: tiered.read_pages(state, [-1]), "outside"),
                      (lambda: tiered.read_pages(state, [num_pages]), "outside")):
    with pytest.raises(ValueError, match=match):
      call()
  # A cached prefix longer than the slot's pages: its staged rows would keep the
  # previous request's K/V.
  state = tiered.set_pages(state, table)  # slot 0 holds 2 pages: 32 positions
  with pytest.raises(ValueError, match="needs 3 pages"):
    tiered.load_prefix(state, 0, 33)
  with pytest.raises(ValueError, match="needs 1 pages"):
    tiered.load_prefix(state, 2, 5)
  state = tiered.load_prefix(state, 0, 32)
  page = tiered.read_pages(state, [3])
  with pytest.raises(ValueError, match="contents"):  # one page's contents for two
    tiered.write_pages(state, [3, 4], page)
  with pytest.raises(ValueError, match="outside"):
    tiered.write_pages(state, [num_pages], page)
  with pytest.raises(ValueError, match="token ids"):
    tiered.decode(state, np.array([model.cfg.vocab_size, 0, 0]), np.array([1, 0, 0], bool))
  assert all((a == b).all() for a, b in zip(tiered.read_pages(state, [3]), page))
  # A prompt row written through without its page went to the scratch page (lost
  # once evicted; the decode later read the page it should have been in): a slot
  # with pages needs them all, one without must fit its 48 hot slots.
  with pytest.raises(ValueError, match="no host pages"):
    tiered.prefill(tiered.init(), 0, tokens, 0, 49)
  state = tiered.prefill(tiered.init(), 0, tokens, 0, 48)[0]  # (donated)
  short = np.full(state.cache.tier.page_table.shape, -1, np.int32)
  short[0, :3] = [7, 8, 9]  # positions 0..47 of slot 0
  paged = tiered.set_pages(state, short)
  with pytest.raises(ValueError, match=r"need pages 0..3; its page table row is "
                     r"\[7, 8, 9, -1\]"):
    tiered.prefill(paged, 0, tokens, 0, 64)
  paged = tiered.prefill(paged, 0, tokens, 0, 48)[0]
  # The staging buffer holds slot 0's 48 positions: another slot or length would
  # install them as its own (slot 1's host pages never got them), and a chunk of
  # another slot would go on after them.
  for call, match in ((lambda: tiered.start_decoding(paged, 1, 48), "not slot 1's 48"),
                      (lambda: tiered.start_decoding(paged, 0, 40), "not slot 0's 40"),
                      (lambda: tiered.prefill(paged, 1, tokens, 64, 8), "does not follow")):
    with pytest.raises(ValueError, match=match):
      call()
  tiered.start_decoding(paged, 0, 48)
  selector, _ = setup.build_selector("quest", model.cfg, 32)
  dense = serving.ServingBackend(model, "dense", 3, 256, selector=selector)
  # Pages are the tiered backend's: any chunk size serves a full-KV backend.
  serving.ServingBackend(model, "sparse", 3, 256, selector=selector, chunk_size=24)
  assert dense.device_bytes(100) == serving.ServingBackend(model, "dense", 3,
                                                           256).device_bytes(100)


@pytest.mark.parametrize("name", ["dense", "sparse"])
def test_full_kv_backends_refuse_a_step_past_max_len(model_and_ids, name):
  """A dense or sparse slot at max_len: inside jit its K/V write would be dropped
  and it would attend without its own token. Refused before the donated step (the
  state stays usable), and after a snapshot is restored."""
  model, ids = model_and_ids
  full = backend(model, name)
  state = full.start_decoding(full.init(), 1, 255)
  tokens = np.array([ids[0], ids[1], 0], np.int32)
  last = np.array([False, True, False])
  state, _ = full.decode(state, tokens, last)  # position 255, the last one
  with pytest.raises(ValueError, match=r"slots \[1\] reached max_len=256"):
    full.decode(state, tokens, np.array([True, True, False]))
  state = full.start_decoding(state, 0, 10)
  state, logits = full.decode(state, tokens, np.array([True, False, False]))
  assert np.isfinite(np.asarray(logits)[0]).all()
  again = backend(model, name)
  restored = again.restore_state(full.snapshot(state))
  with pytest.raises(ValueError, match="reached max_len"):
    again.decode(restored, tokens, last)
  again.decode(restored, tokens, np.array([True, False, False]))  # slot 0: at 11


def test_a_max_len_off_the_chunk_grid_prefills_as_one_on_it(model_and_ids):
  """The staging buffer is whole chunks long: with max_len = 230 (chunks of 64) the
  last chunk's write at 192 would be clamped to 166 in a buffer of 230 rows, and
  the prompt attended shifted K/V. Its logits are bit for bit those of max_len 256."""
  model, ids = model_and_ids
  selector, params = setup.build_selector("quest", model.cfg, 32)
  logits = {}
  for max_len in (230, 256):
    b = serving.ServingBackend(model, "sparse", 1, max_len, selector=selector,
                               selector_params=params, chunk_size=64, page_size=16)
    state = b.init()
    for start in range(0, 200, 64):
      count = min(64, 200 - start)
      chunk = np.zeros(64, np.int32)
      chunk[:count] = ids[start:start + count]
      state, out = b.prefill(state, 0, chunk, start, count)
    logits[max_len] = np.asarray(out)
  np.testing.assert_array_equal(logits[230], logits[256])


def test_backend_refuses_host_contents_of_another_dtype(model_and_ids):
  """Pages read back (the disk tier) must be the host tier's dtype as well as its
  shape: a cast would store other numbers. A context within the hot cache needs
  no host pages; one past it needs its pages."""
  model, _ = model_and_ids
  tiered = backend(model, "tiered")
  state = tiered.init()
  k, v = tiered.read_pages(state, [3])
  with pytest.raises(ValueError, match="contents"):
    tiered.write_pages(state, [3], [k.astype(np.float16), v])
  tiered.write_pages(state, [3], [k, v])  # its own dtype: fine
  assert tiered.host_pages(tiered.hot_slots) == 0
  assert tiered.host_pages(tiered.hot_slots + 1) == -(-(tiered.hot_slots + 1) // 16)


def test_dense_install_leaves_no_earlier_staging_rows(model_and_ids):
  """Staging rows past a prompt hold an earlier request's prompt (NaN here): the
  dense install writes zeros there, so attention's 0 * V stays 0 and the decode
  logits are the clean run's."""
  import jax.numpy as jnp
  model, ids = model_and_ids
  dense = backend(model, "dense")
  logits = []
  for poison in (False, True):
    state = dense.init()
    if poison:
      staging = state.staging
      state = state.replace(staging=staging.replace(k=jnp.full_like(staging.k, jnp.nan),
                                                    v=jnp.full_like(staging.v, jnp.nan)))
    tokens = np.zeros((64,), np.int32)
    tokens[:20] = ids[:20]
    state, _ = dense.prefill(state, 0, tokens, 0, 20)
    state = dense.start_decoding(state, 0, 20)
    state, out = dense.decode(state, np.array([ids[20], 0, 0], np.int32),
                              np.array([True, False, False]))
    logits.append(np.asarray(out)[0])
  assert np.isfinite(logits[1]).all()
  np.testing.assert_array_equal(logits[1], logits[0])


@pytest.mark.parametrize("extra", [
    {}, pytest.param(dict(index_share=SMOKE_LAYERS // 2, policy="freq",
                          impl=ImplConfig(fused=True)), marks=pytest.mark.slow)])
def test_the_look_ahead_fetches_ahead_and_keeps_every_logit(model_and_ids, extra):
  """``lookahead="draft"``: after each step the engine drafts every decoding
  request's next token by prompt lookup and the backend runs it uncommitted. With
  preemption, a sampled request and an abort on the way, every decode logit is the
  plain tiered engine's, bit for bit (the sparse engine's tokens, test above; the
  schedule is the same); the misses left on the steps fall, the rows fetched ahead
  count as prefetched, and the draft pass compiles once. Also with index sharing,
  a keyed policy and the fused layer step (slow tier)."""
  model, ids = model_and_ids
  want_logits, got_logits = {}, {}
  plain, want = serve(model, ids, "tiered", WORKLOAD, host_pages=24, abort=ABORTED,
                      logits=want_logits, backend_args=extra)
  compiled = backends.tiered_draft_pass._cache_size()
  ahead, got = serve(model, ids, "tiered", WORKLOAD, host_pages=24, abort=ABORTED,
                     logits=got_logits, backend_args=dict(extra, lookahead="draft"))
  assert got_logits.keys() == want_logits.keys() and len(got_logits) > 50
  assert all(got_logits[key] == want_logits[key] for key in want_logits)
  for i, req in got.items():
    assert req.state is want[i].state, (i, req.reason)
    assert req.output == want[i].output, i
  assert sum(r.metrics.preemptions for r in got.values()) > 0, "no preemption"
  assert backends.tiered_draft_pass._cache_size() == compiled + 1
  plain_stats, ahead_stats = (e.model.stats(e.state) for e in (plain, ahead))
  assert plain_stats["prefetched"] == 0 < ahead_stats["prefetched"]
  assert ahead_stats["misses"] < plain_stats["misses"] / 2, (ahead_stats, plain_stats)
  assert ahead_stats["fetched_rows"] == ahead_stats["misses"] + ahead_stats["prefetched"]


def test_a_refused_step_keeps_the_logits_of_the_requests_it_did_not_refuse(model_and_ids):
  """A decode step the tiered backend refuses (request 0's host pages taken away
  once it has 8 outputs) is retried request by request: request 0 fails (refused
  alone too), and every other request's logits are the plain tiered engine's, bit
  for bit, those of the step retried alone, after the refused step's returned
  state, included."""
  model, ids = model_and_ids
  want_logits, got_logits, shared = {}, {}, []

  def refuse(engine, active):
    doomed = engine.requests.get("0")
    if doomed is None or doomed.slot is None or not active[doomed.slot]:
      return None
    if len(doomed.output) < 8:
      return None
    shared.append(int(active.sum()) > 1)
    return doomed.slot

  _, want = serve(model, ids, "tiered", WORKLOAD, host_pages=24, abort=ABORTED,
                  logits=want_logits)
  _, got = serve(model, ids, "tiered", WORKLOAD, host_pages=24, abort=ABORTED,
                 logits=got_logits, refuse=refuse)
  assert any(shared), "no refused step held another request"
  assert got[0].state is State.FAILED and len(got[0].output) == 8, got[0].reason
  assert "host page" in got[0].reason, got[0].reason  # the backend's own refusal
  assert got[0].output == want[0].output[:8]
  others = {key for key in want_logits if key[0] != "0"}
  assert {key for key in got_logits if key[0] != "0"} == others and len(others) > 30
  # One row per position, in both runs: a replay (request 0's pages freed, fewer
  # preemptions here) repeats its first decode's bits.
  assert all(len(set(got_logits[key] + want_logits[key])) == 1 for key in others)
  for i, req in got.items():
    if i != 0:
      assert (req.state, req.output) == (want[i].state, want[i].output), i


def test_logprobs_on_smollm2_are_the_log_softmax_of_the_served_logits(model_and_ids):
  """Two sampled requests with ``logprobs=5`` in one batch on the tiered engine,
  one raw and one processed (top-k 40, top-p 0.8): each output's log-probability
  and the 5 best are those a float64 computation gives from the logits its step
  returned (49,152 entries; within f32 rounding), the first output's from the
  prefill's."""
  from tests.test_serving import reference_log_probs
  model, ids = model_and_ids
  raw = SamplingParams(temperature=0.9, seed=3, logprobs=5)
  processed = dataclasses.replace(raw, top_k=40, top_p=0.8, logprobs_mode="processed")
  rows = {}
  _, reqs = serve(model, ids, "tiered", [(100, 90, 6, raw, 0), (300, 90, 6, processed, 0)],
                  host_pages=24, logits=rows)
  short = 0
  for req in reqs.values():
    assert len(req.logprobs) == len(req.top_logprobs) == len(req.output) == 6
    for i, token in enumerate(req.output):
      logits = np.frombuffer(rows[req.id, 89 + i][0], np.float32)
      want, margin = reference_log_probs(logits, req.sampling)
      assert margin > 1e-5, "f32 and float64 may draw the top-p line apart"
      scaled = logits.astype(np.float64)
      if req.sampling.logprobs_mode == "processed":
        scaled /= req.sampling.temperature
      tol = 4 * np.finfo(np.float32).eps * (np.abs(scaled) + abs(scaled[token] - want[token]))
      assert abs(req.logprobs[i] - want[token]) <= tol[token], (req.id, i)
      best = np.argsort(-want, kind="stable")[:min(5, np.isfinite(want).sum())]
      assert [t for t, _ in req.top_logprobs[i]] == best.tolist(), (req.id, i)
      assert all(abs(x - want[t]) <= tol[t] for t, x in req.top_logprobs[i]), (req.id, i)
      short += len(best) < 5
  assert short, "top-p cut no processed list short"


def test_the_look_ahead_is_refused_where_nothing_would_run_it(model_and_ids):
  model, _ = model_and_ids
  for name in ("dense", "sparse"):
    with pytest.raises(ValueError, match="'draft' on the tiered backend"):
      backend(model, name, lookahead="draft")
  with pytest.raises(ValueError, match="lookahead='ahead'"):
    backend(model, "tiered", lookahead="ahead")
  plain = backend(model, "tiered")
  with pytest.raises(ValueError, match="lookahead='draft'"):
    plain.draft_pass(plain.init(), np.zeros(3, np.int32), np.ones(3, bool))
  ahead = backend(model, "tiered", lookahead="draft")
  with pytest.raises(ValueError, match="must be \\(3,\\)"):
    ahead.draft_pass(ahead.init(), np.zeros(2, np.int32), np.ones(3, bool))
  with pytest.raises(ValueError, match=r"must be in \[0, "):
    ahead.draft_pass(ahead.init(), np.full(3, model.cfg.vocab_size, np.int32),
                     np.ones(3, bool))
  selector, params = setup.build_selector("quest", model.cfg, 32)
  with pytest.raises(ValueError, match="not over a mesh"):
    sharded_serving.MeshServingBackend(
        model, "tiered", 3, 256, mesh=sharding.make_mesh({"data": 1}), selector=selector,
        selector_params=params, hot_slots=48, chunk_size=64, page_size=16,
        lookahead="draft")


def test_step_counters_stay_exact_when_the_device_counters_wrap(model_and_ids):
  """The device counters are int32 per (layer, request, unit) and per layer: in a
  long-lived engine they wrap (hits after ~1M steps at k = 2048). An engine whose
  counters start 3 short of 2^31 reports every step's hits, misses and bytes as
  one starting at 0 does (a negative delta at the wrap, before)."""
  model, ids = model_and_ids
  prompt = ids[:150].tolist()
  rows = {}
  for start in (0, 2**31 - 3):
    engine = Engine(backend(model, "tiered"), EngineConfig(max_step_tokens=64))
    tier = engine.state.cache.tier
    near = lambda x: x + jnp.asarray(start, x.dtype)
    tier = tier.replace(hits=near(tier.hits), misses=near(tier.misses),
                        fetched_rows=near(tier.fetched_rows))
    engine.state = engine.state.replace(cache=engine.state.cache.replace(tier=tier))
    engine._last_stats = engine.model.stats(engine.state)
    engine.submit(prompt, 12)
    rows[start] = []
    while engine.has_work:
      step = engine.step()
      rows[start].append({k: step[k] for k in ("hits", "misses", "fetched_rows",
                                               "host_to_device_bytes")})
  assert rows[0] == rows[2**31 - 3]
  assert sum(r["misses"] for r in rows[0]) > 0
  wrapped = engine.state.cache.tier
  assert (np.asarray(wrapped.hits) < 0).any()  # the counters did wrap


# Three engines each (~30 s): the default tier checks the tiles op by op
# (test_model, test_kernels, test_selectors); CI runs these (--runslow).
@pytest.mark.slow
@pytest.mark.parametrize("name,kind", [("tiered", "quest"), ("sparse", "quest"),
                                       ("tiered", "quest_kv"), ("tiered", "dsa"),
                                       ("tiered", "nsa"), ("sparse", "oracle")])
def test_a_row_tiled_decode_gives_a_request_the_same_logits_at_any_slot_count(
    model_and_ids, name, kind):
  """``ModelConfig.decode_row_tile``: a request's decode logits are the same bits
  on engines of 1, 3 and 4-12 slots (drawn), among requests of random prompts and
  arrivals, so a handoff between engines of other sizes continues exactly. The
  step's row-wise work (the model's, the attention's, the selector's scoring) runs
  over tiles of 8 requests whatever the batch; untiled, XLA:CPU blocks a matmul
  (and vectorises a norm) by its shape, and 1 slot and 3 differ by ~1e-4 here
  (DESIGN, "Moving a request between engines"). The selector, built untiled, is
  given the model's tile; the decode's K/V are the tile's: it is part of
  ``model_id``."""
  model, ids = model_and_ids
  tiled = Transformer.from_params(dataclasses.replace(model.cfg, decode_row_tile=8),
                                  model.weights())
  rng = np.random.default_rng()
  vocab = model.cfg.vocab_size
  # k = 256: XLA:CPU's attention over 256 rows computes request 0 otherwise at 1
  # request than at 3 (at k = 32 it does not: the tiles there would be untested).
  selector, params = setup.build_selector(kind, tiled.cfg, 256)
  assert getattr(selector, "row_tile", None) is None
  extra = dict(hot_slots=selector.top_k) if name == "tiered" else {}
  offset = int(rng.integers(0, len(ids) - 200))
  prompt = ids[offset:offset + 200].tolist()
  max_len = 400  # NSA reads 16 blocks of 64 and a window of 512 at most: 320 here

  def run(slots):
    backend = serving.ServingBackend(tiled, name, slots, max_len, selector=selector,
                                     selector_params=params, chunk_size=64,
                                     page_size=16, **extra)
    assert backend.selector.row_tile == 8
    others = random_others(rng, slots + 1, vocab, (20, 240), (1, 8))
    target, rows = decode_logits_among(Engine(backend, EngineConfig(max_step_tokens=64)),
                                       RequestSpec("target", tuple(prompt), 6), others)
    assert target.state is State.FINISHED and len(rows) == 5
    return target.output, rows, backend

  (want, want_rows, one), *more = [run(slots) for slots in (1, 3, int(rng.integers(4, 13)))]
  for output, rows, _ in more:
    assert output == want
    np.testing.assert_array_equal(rows, want_rows)
  untiled = serving.ServingBackend(model, name, 1, max_len, selector=selector,
                                   selector_params=params, chunk_size=64, page_size=16,
                                   **extra)
  assert one.model_id == f"{untiled.model_id}/rows8"


@pytest.mark.parametrize("name", ["sparse", "tiered"])
def test_a_requests_logits_do_not_depend_on_its_slot(model_and_ids, name):
  """A preempted or restored request may come back in another slot: at one slot
  count its logits are the same bits in any row, whatever the other rows hold
  (across slot counts they are not: DESIGN, "Moving a request between engines")."""
  model, ids = model_and_ids
  rng = np.random.default_rng()
  vocab = model.cfg.vocab_size
  selector, params = setup.build_selector("quest", model.cfg, 32)
  prompt, feed = np.asarray(ids[:160]), rng.integers(0, vocab, 4)
  extra = dict(hot_slots=48) if name == "tiered" else {}
  runs = []
  for row in (0, 2):
    runner = backends.Runner(model, name, max_len=192, selector=selector,
                             selector_params=params, **extra)
    tokens, lens = rng.integers(0, vocab, (3, 160)), rng.integers(100, 161, 3)
    tokens[row], lens[row] = prompt, 160
    logits = [np.asarray(runner.prefill(tokens, lens))[row]]
    for token in feed:
      step = rng.integers(0, vocab, 3)
      step[row] = token
      logits.append(np.asarray(runner.step(step))[row])
    runs.append(np.stack(logits))
  np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("name", ["dense", "sparse", "tiered"])
def test_a_step_leaves_an_inactive_decoding_rows_state_as_it_was(model_and_ids, name):
  """A decode step in which a decoding row sits out changes nothing that row's later
  steps read: after one real step its selector state and its logits are those of a
  run without the idle step. The sparse step used to update an inactive row's
  selector at position T (its K/V write is dropped there), and Quest's ring entry
  T % page is one of the row's real positions in its partial page."""
  model, ids = model_and_ids
  rng = np.random.default_rng()
  vocab = model.cfg.vocab_size
  length = int(rng.choice([n for n in range(70, 127) if n % 16]))  # a partial page
  feed = rng.integers(0, vocab, (4, 3)).astype(np.int32)
  runs = []
  for idle in (False, True):
    b = backend(model, name)
    state = b.init()
    if name == "tiered":
      per = b.tier_cfg.pages_per_request
      state = b.set_pages(state, np.arange(3 * per, dtype=np.int32).reshape(3, per))
    for slot, prompt in ((0, ids[:90]), (1, ids[200:200 + length])):
      for start in range(0, len(prompt), b.chunk_size):
        chunk = np.zeros((b.chunk_size,), np.int32)
        count = min(b.chunk_size, len(prompt) - start)
        chunk[:count] = prompt[start:start + count]
        state, _ = b.prefill(state, slot, chunk, start, count)
      state = b.start_decoding(state, slot, len(prompt))
    if idle:  # slot 1 sits out; slot 0 decodes
      state, _ = b.decode(state, rng.integers(0, vocab, 3).astype(np.int32),
                          np.array([True, False, False]))
    logits, sel = [], None
    for step in feed:
      state, out = b.decode(state, step, np.array([False, True, False]))
      logits.append(np.asarray(out[1]))
      if sel is None and name != "dense":
        sel = [np.asarray(leaf[:, 1]) for leaf in jax.tree.leaves(state.cache.sel)]
    runs.append((np.stack(logits), sel))
  np.testing.assert_array_equal(runs[0][0], runs[1][0])
  for without, with_idle in zip(runs[0][1] or [], runs[1][1] or []):
    np.testing.assert_array_equal(without, with_idle)
