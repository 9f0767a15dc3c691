"""The radix prefix cache (kvtier_jax/serving/radix.py) against a brute-force
dictionary of cached prefixes, and the engine with it on: shared pages are never
written, nothing leaks, and every request's tokens equal its solo run without a
cache (FakeModel reads a cached prefix back from its "host pages", so a wrong or
overwritten shared page changes the tokens)."""

import copy as copy_module
import dataclasses
import functools
import gc
import itertools
import os

import numpy as np
import pytest

from kvtier_jax.serving import Engine, EngineConfig, PagePool, SamplingParams, State
from kvtier_jax.serving import snapshot
from kvtier_jax.serving.disk import DiskTier
from kvtier_jax.serving.radix import RadixCache
from tests.test_serving import POISON, VOCAB, FakeModel, solo

UNIT, PAGE = 4, 2


def tree_state(tree):
  """Every node's edge, pages and LRU stamp, depth first."""
  out, stack = [], [tree.root]
  while stack:
    node = stack.pop()
    out.append((node.key, tuple(node.pages), node.last_used, node.lock))
    stack.extend(node.children[key] for key in sorted(node.children))
  return out


def test_radix_matches_the_longest_cached_prefix_brute_force():
  rng = np.random.default_rng()
  tree, page_ids = RadixCache(UNIT, PAGE), itertools.count()
  cached: dict[tuple, list[int]] = {}  # every cached unit-prefix -> its last unit's pages
  bases = [rng.integers(0, 3, 24).tolist() for _ in range(3)]

  def draw():
    base = bases[int(rng.integers(3))]
    cut = int(rng.integers(0, len(base) + 1))
    return base[:cut] + rng.integers(0, 3, int(rng.integers(0, 12))).tolist()

  def expected(tokens):
    pages, k = [], 0
    while tuple(tokens[:(k + 1) * UNIT]) in cached and (k + 1) * UNIT <= len(tokens):
      k += 1
      pages += cached[tuple(tokens[:k * UNIT])]
    return pages

  for _ in range(200):
    tokens = draw()
    if rng.random() < 0.5:
      whole = tokens[:len(tokens) // UNIT * UNIT]
      pages = [next(page_ids) for _ in range(len(whole) // PAGE)]
      want_adopted = [p for k in range(len(whole) // UNIT)
                      if tuple(whole[:(k + 1) * UNIT]) not in cached
                      for p in pages[k * UNIT // PAGE:(k + 1) * UNIT // PAGE]]
      adopted, _ = tree.insert(whole, pages)
      assert adopted == want_adopted
      for k in range(len(whole) // UNIT):
        cached.setdefault(tuple(whole[:(k + 1) * UNIT]),
                          pages[k * UNIT // PAGE:(k + 1) * UNIT // PAGE])
    else:
      before = tree_state(tree)
      measured = tree.prefix_length(tokens)
      peeked = tree.peek(tokens)
      assert tree_state(tree) == before  # measuring touches nothing
      got, _ = tree.match_prefix(tokens)
      assert got == expected(tokens)
      assert measured == len(got) * PAGE
      assert peeked == (measured, got, False)  # nothing on disk in this tree
  assert sorted(tree.held_pages()) == sorted(p for v in cached.values() for p in v)
  with pytest.raises(ValueError, match="whole units"):
    tree.insert([1, 2, 3], [0])


def test_radix_evicts_unlocked_leaves_lru_first_and_shared_prefixes_last():
  pool = PagePool(16, num_slots=1, pages_per_slot=8)
  tree = RadixCache(UNIT, PAGE)

  def cache(tokens):
    assert pool.grow(0, len(tokens) // PAGE)
    adopted, node = tree.insert(tokens, pool.table[0, :len(tokens) // PAGE].tolist())
    pool.retain(adopted)
    pool.release(0)
    return adopted, node

  prefix = [7, 7, 7, 7]
  _, a = cache(prefix + [1, 1, 1, 1])
  _, b = cache(prefix + [2, 2, 2, 2])
  _, c = cache([5, 5, 5, 5])
  pool.check(tree.held_pages())
  assert pool.in_use == 8 and tree.num_pages == 8
  tree.match_prefix(prefix + [1, 1, 1, 1])  # a is now the most recently used
  tree.lock(b)
  assert tree.evict(2, pool.drop) == 2  # the LRU unlocked leaf: c
  assert tree.match_prefix([5, 5, 5, 5])[0] == []
  assert tree.evict(100, pool.drop) == 2  # a goes; the prefix is b's (locked)
  assert tree.match_prefix(prefix + [2, 2, 2, 2])[0] and not tree.match_prefix(
      prefix + [1, 1, 1, 1])[0][2:]
  pool.check(tree.held_pages())
  tree.unlock(b)
  assert tree.evict(100, pool.drop) == 4 and pool.in_use == 0 and tree.num_pages == 0
  pool.check(tree.held_pages())
  with pytest.raises(AssertionError, match="unlock"):
    tree.unlock(b)


def evict_all(tree, where):
  """The host pages of group ``where`` that ``tree.evict`` gives up when asked for
  all of them (it may give up other groups' pages below them too)."""
  freed = []
  got = tree.evict(10**9, lambda pages: freed.extend(pages) or sum(where([p]) for p in pages),
                   where=where)
  mine = [p for p in freed if where([p])]
  assert got == len(mine)
  return mine


def test_radix_evictable_pages_are_what_eviction_gives_up_per_group():
  """``evictable_pages(group)`` against evicting a copy of the tree with
  ``where=<that group>`` until nothing is left: the same pages, group by group, on
  random trees whose paths cross groups (as a prefix on one device extended from
  another does: a node can be held up only by another group's suffix) and with
  random nodes locked; what is left of the group is locked."""
  rng = np.random.default_rng()
  for _ in range(20):
    tree, ids = RadixCache(UNIT, PAGE), itertools.count()
    group = lambda pages: pages[0] % 2
    inserted = []
    for _ in range(int(rng.integers(1, 12))):
      tokens = rng.integers(0, 3, UNIT * int(rng.integers(1, 5))).tolist()
      if inserted and rng.random() < 0.5:  # a cached prompt extended, maybe elsewhere
        tokens = inserted[int(rng.integers(len(inserted)))] + tokens
      inserted.append(tokens)
      parity = int(rng.integers(2))  # the inserting "device": its page ids' parity
      pages = [2 * next(ids) + parity for _ in range(len(tokens) // PAGE)]
      _, node = tree.insert(tokens, pages)
      if rng.random() < 0.3:
        tree.lock(node)
    got = tree.evictable_pages(group)
    for g in (0, 1):
      emptied = copy_module.deepcopy(tree)
      assert sorted(got.get(g, [])) == sorted(evict_all(emptied,
                                                        lambda pages, g=g: pages[0] % 2 == g))
      assert all(n.lock for n in emptied._nodes() if n.pages and n.pages[0] % 2 == g)
    assert sorted(tree.evictable_pages().get(0, [])) == sorted(
        p for n in tree._nodes() if not n.lock for p in n.pages)  # one group: every unlocked page


def shared_prefix_workload(rng, num, groups=3):
  prefixes = [rng.integers(0, VOCAB - 1, int(rng.integers(8, 40))).tolist()
              for _ in range(groups)]
  out = []
  for _ in range(num):
    prompt = prefixes[int(rng.integers(groups))] + rng.integers(
        0, VOCAB - 1, int(rng.integers(1, 12))).tolist()
    sp = SamplingParams() if rng.random() < 0.5 else SamplingParams(
        temperature=1.0, top_k=5, seed=int(rng.integers(1000)))
    out.append((prompt, int(rng.integers(1, 20)), sp))
  return out


def run_with_prefix_cache(rng, num, pages, abort_rate=0.0, model=FakeModel, **config):
  factory = lambda: model(num_host_pages=pages)
  engine = Engine(factory(), EngineConfig(max_step_tokens=20, prefix_cache=True, **config))
  pending, reqs, kept_answers = shared_prefix_workload(rng, num), [], []
  while pending or engine.has_work:
    for _ in range(min(len(pending), int(rng.integers(0, 3)))):
      prompt, new, sp = pending.pop()
      reqs.append(engine.submit(prompt, new, sp))
    live = [r for r in reqs if not r.state.done]
    if live and rng.random() < abort_rate:
      engine.abort(live[int(rng.integers(len(live)))].id)
    step = engine.step()
    assert step["cached_pages"] == engine.radix.num_pages
    for req in engine.waiting:  # "lpm"'s kept answers are the tree's answers now
      if req.prefix_seen[0] == engine.radix.version:
        assert req.prefix_seen[1] == engine.radix.prefix_length(engine._shareable(req))
        kept_answers.append(req.id)
    engine.pool.check(engine.radix.held_pages())
    if engine.disk is not None:
      held = engine.radix.disk_pages()
      assert step["disk_pages"] == len(held) == len(set(held)) == engine.disk.in_use
  for req in reqs:
    if req.state is State.FINISHED:
      assert req.output == solo(factory, req.prompt, req.max_new_tokens, req.sampling), req.id
  assert bool(kept_answers) == (engine.config.schedule == "lpm")
  return engine, reqs


def test_prefix_cache_reuses_prompt_chunks_and_tokens_equal_solo_runs():
  rng = np.random.default_rng()
  engine, reqs = run_with_prefix_cache(rng, 40, pages=200)
  assert all(r.state is State.FINISHED for r in reqs)
  assert engine.cached_tokens > 0.3 * engine.prompt_tokens  # groups share their prefixes
  computed = engine.prompt_tokens - engine.cached_tokens
  assert sum(r.metrics.cached_tokens for r in reqs) == engine.cached_tokens
  # Nothing running: only the cache holds pages, and it can give them all back.
  assert engine.pool.in_use == engine.radix.num_pages > 0
  engine.radix.evict(10**9, engine.pool.drop)
  assert engine.pool.in_use == 0 and computed > 0


@pytest.mark.parametrize("schedule", ["fcfs", "lpm"])
def test_prefix_cache_under_page_pressure_with_aborts_and_preemptions(schedule):
  rng = np.random.default_rng()
  # 20 pages: some preemption in 400 of 400 draws (24 pages: 8 draws in 400 had none).
  engine, reqs = run_with_prefix_cache(rng, 120, pages=20, abort_rate=0.05,
                                       schedule=schedule, max_overtakes=3)
  states = [r.state for r in reqs]
  assert states.count(State.FINISHED) > 60 and State.FAILED not in states
  assert sum(r.metrics.preemptions for r in reqs) > 0, "no page pressure"
  assert engine.cached_tokens > 0
  assert engine.slots == [None] * len(engine.slots) and engine._device_in_use == 0
  engine.pool.check(engine.radix.held_pages())


@pytest.mark.parametrize("schedule,max_overtakes,window,order", [
    ("fcfs", 16, 128, "xwzy"), ("lpm", 16, 128, "zywx"), ("lpm", 1, 128, "zxwy"),
    ("lpm", 0, 128, "xwzy"), ("lpm", 16, 2, "wzyx"), ("lpm", 16, 1, "xwzy")])
def test_lpm_admits_the_longest_cached_prefix_first_and_bounds_overtakes(
    schedule, max_overtakes, window, order):
  """A cached 16-token prefix P; then x (no prefix), w (the first chunk of P + 12),
  z (P + 3) and y (P + 10) arrive together, one slot. LPM admits by cached tokens
  (z and y 16, w 8, x 0; ties in arrival order), FCFS by arrival; with
  max_overtakes=1, x and w have been overtaken once z goes, so they go next, in
  arrival order; max_overtakes=0 is FCFS; lpm_window=2 ranks only the first two
  waiting ([x, w], then [x, z], then [x, y]); a window of 1 is FCFS. Every
  request's tokens are its solo run's."""
  rng = np.random.default_rng()
  prefix = rng.integers(0, VOCAB - 1, 16).tolist()
  factory = lambda: FakeModel(num_slots=1, num_host_pages=60)
  engine = Engine(factory(), EngineConfig(max_step_tokens=8, prefix_cache=True,
                                          schedule=schedule,
                                          max_overtakes=max_overtakes,
                                          lpm_window=window))
  first = engine.submit(prefix + [1, 2, 3], 2)
  engine.run()
  assert first.metrics.cached_tokens == 0 and engine.radix.prefix_length(prefix) == 16
  tail = lambda n: rng.integers(0, VOCAB - 1, n).tolist()
  prompts = {"x": tail(20), "w": prefix[:8] + tail(12), "z": prefix + tail(3),
             "y": prefix + tail(10)}
  reqs = {name: engine.submit(p, 3, request_id=name) for name, p in prompts.items()}
  engine.run()
  assert "".join(sorted(reqs, key=lambda n: reqs[n].admit_order)) == order
  want_cached = {"x": 0, "y": 16, "z": 16, "w": 8}
  for name, req in reqs.items():
    assert req.metrics.cached_tokens == want_cached[name], name
    assert req.output == solo(factory, req.prompt, 3), name  # no token moves


def test_a_cached_prompt_of_whole_chunks_pins_no_copy_of_its_last_chunk():
  """A prompt of whole chunks, all cached: the request shares all but its last
  chunk (one token must be computed) and computes that chunk into pages of its
  own. The tree's copy of it must stay evictable: locked, it left a pool that
  fits the request exactly (9 pages) one page short, and the request preempted
  itself forever. It finishes without a preemption, with its solo tokens."""
  factory = lambda **kw: FakeModel(**{**dict(max_len=33, num_host_pages=9, num_slots=2),
                                      **kw})
  engine = Engine(factory(), EngineConfig(max_step_tokens=9, prefix_cache=True))
  prompt = list(range(1, 17))  # 2 chunks of 8
  first = engine.submit(prompt, 33 - 16)
  engine.run()
  again = engine.submit(prompt, 33 - 16)
  while again.state is not State.DECODING:
    engine.step()
  mine = engine.pool.table[again.slot, :4].tolist()
  assert again.metrics.cached_tokens == 8 and engine.radix.holds(again.radix_node, mine)
  engine.run(until=lambda: engine.steps > 500)
  assert again.state is State.FINISHED and again.metrics.preemptions == 0
  assert again.output == first.output == solo(factory, prompt, 33 - 16)
  engine.pool.check(engine.radix.held_pages())
  # With room, both whole chunks stay cached: a prompt extending it shares all 16.
  roomy = Engine(factory(num_host_pages=20), EngineConfig(prefix_cache=True))
  roomy.submit(prompt, 4)
  roomy.run()
  longer = roomy.submit(prompt + [5, 6, 7], 4)
  roomy.run()
  assert longer.metrics.cached_tokens == 16
  assert longer.output == solo(factory, prompt + [5, 6, 7], 4)


def test_lpm_does_not_rank_a_request_by_a_prefix_it_cannot_use():
  """A request short enough to stay on the device (hot cache, no host pages) never
  shares the cached prefix, so LPM ranks it as uncached: arrival order decides."""
  factory = lambda: FakeModel(num_slots=1, num_host_pages=60)
  engine = Engine(factory(), EngineConfig(max_step_tokens=8, prefix_cache=True,
                                          schedule="lpm"))
  prefix = list(range(1, 9))  # one chunk
  engine.submit(prefix + [40] * 8, 2)
  engine.run()
  long = engine.submit([50] * 20, 3, request_id="long")
  short = engine.submit(prefix + [60], 2, request_id="short")  # 11 <= hot_slots
  engine.run()
  assert short.metrics.cached_tokens == 0 and long.admit_order < short.admit_order
  assert short.output == solo(factory, short.prompt, 2)


def test_an_admission_eviction_cannot_help_keeps_the_cached_prefixes():
  """A request whose prompt needs more pages than the free ones and every evictable
  cached page together waits without evicting: the cached prefixes stayed for later
  requests (they were given up for an admission that failed anyway)."""
  rng = np.random.default_rng()
  model = FakeModel(num_host_pages=40)  # pages of 4 tokens
  engine = Engine(model, EngineConfig(prefix_cache=True))
  prompt = lambda n: rng.integers(1, VOCAB - 1, n).tolist()
  engine.submit(prompt(21), 2)
  engine.run()
  cached = engine.radix.held_pages()
  assert len(cached) == 4  # two chunks of 8 tokens
  running = engine.submit(prompt(80), 16)  # 20 pages (its prompt's, cached: locked)
  while running.state is not State.DECODING:
    engine.step()
  big = engine.submit(prompt(84), 4)  # 21 pages > 16 free + 4 evictable
  waited = 0
  while running.state is State.DECODING:
    evictable = sum(map(len, engine.radix.evictable_pages().values()))
    short = engine.pool.free_in(0) + evictable < 21
    engine.step()
    if big.state is State.WAITING and short:
      assert set(cached) <= set(engine.radix.held_pages()), engine.steps
      waited += 1
  assert waited > 0
  engine.run()
  assert big.state is State.FINISHED and big.output == solo(FakeModel, big.prompt, 4)
  engine.pool.check(engine.radix.held_pages())


def test_schedule_is_checked():
  with pytest.raises(ValueError, match="schedule"):
    EngineConfig(prefix_cache=True, schedule="sjf")
  with pytest.raises(ValueError, match="prefix_cache"):
    EngineConfig(schedule="lpm")
  with pytest.raises(ValueError, match="max_overtakes"):
    EngineConfig(prefix_cache=True, schedule="lpm", max_overtakes=-1)
  with pytest.raises(ValueError, match="lpm_window"):
    EngineConfig(prefix_cache=True, schedule="lpm", lpm_window=0)


@dataclasses.dataclass
class TwoDeviceModel(FakeModel):
  """FakeModel as a data-parallel model: slots 0-1 and the first half of the host
  pages on "device" 0, the rest on device 1."""

  num_slots: int = 4
  num_partitions: int = 2


def test_an_admission_counts_only_the_pages_eviction_would_free():
  """Data parallel: a request placed away from its prefix's device hangs its own
  chunks below that device's node, unlocked, though it holds their pages. An
  admission short of pages must not count them as evictable: it evicted a real
  cached prefix (another request's) and then waited anyway."""
  rng = np.random.default_rng()
  model = TwoDeviceModel(num_host_pages=40, hot_slots=40)  # 20 pages a device, of 4
  engine = Engine(model, EngineConfig(prefix_cache=True, max_step_tokens=64))
  a, b, c, f = (rng.integers(1, 30, 8).tolist() for _ in range(4))  # one chunk each
  e = rng.integers(30, VOCAB - 1, 16).tolist()
  device = lambda req: engine.pool.slot_partition(req.slot)
  for prompt, new, on in ((a + b + c + [5], 16, 0), (e + [5], 25, 1)):
    req = engine.submit(prompt, new)
    engine.step()
    assert device(req) == on
    engine.run()
  kept = engine.radix.match_prefix(e)[0]  # cached on device 1
  short = [engine.submit([7, 7], n) for n in (8, 38, 8, 38)]  # device-resident
  while short[0].state is not State.FINISHED or short[2].state is not State.FINISHED:
    engine.step()
  placed = engine.submit(a + b + f + [5], 16)  # its prefix on device 0, no slot there
  while placed.state is not State.DECODING:
    engine.step()
  node = engine.radix.match_prefix(a + b + f)[1]
  assert device(placed) == 1 and node.lock == 0
  assert (engine.pool.refs[node.pages] == 2).all()  # the cache's and placed's
  free = engine.pool.free_in(1)
  evictable = engine.radix.evictable_pages(
      lambda pages: engine.pool.page_partition(pages[0]))[1]
  freeable = sum(engine.pool.refs[p] == 1 for p in evictable)
  assert free + freeable < free + len(evictable)
  # Pages for more than free + freeable, fewer than free + the evictable pages.
  waits = engine.submit(rng.integers(1, VOCAB - 1, 4 * (free + freeable + 1) - 2).tolist(), 2)
  assert 4 * (free + freeable + 1) <= 4 * (free + len(evictable))
  engine.step()
  assert waits.state is State.WAITING and engine.radix.match_prefix(e)[0] == kept
  engine.run()
  assert waits.state is State.FINISHED and waits.output == solo(FakeModel, waits.prompt, 2)
  engine.pool.check(engine.radix.held_pages())


def test_eviction_ties_go_deepest_first_whatever_the_objects_addresses():
  """One match stamps a whole path alike (a split's upper node copies the stamp):
  data-parallel eviction of device 0's nodes A -> B (C below B is device 1's) must
  give up B's subtree, not A's, in every tree built alike; a tie broken by the
  nodes' addresses made it differ from run to run (and after a restore)."""
  rng = np.random.default_rng()
  clutter = []
  outcomes = set()
  for _ in range(40):
    clutter.extend(object() for _ in range(int(rng.integers(0, 50))))
    rng.shuffle(clutter)  # fragment the allocator: new nodes land anywhere
    del clutter[:len(clutter) // 2]
    tree = RadixCache(2, 2)
    tree.insert([1, 1, 2, 2], [0, 1])  # A + B on device 0 (pages < 10)
    tree.insert([1, 1, 2, 2, 3, 3], [0, 1, 10])  # C on device 1
    tree.match_prefix([1, 1])  # splits A | B
    tree.match_prefix([1, 1, 2, 2, 3, 3])  # one stamp for A, B and C
    freed = tree.evict(1, lambda pages: sum(p < 10 for p in pages),
                       where=lambda pages: pages[0] < 10)
    assert freed == 1
    outcomes.add(tuple(sorted(tree.held_pages())))
  assert outcomes == {(0,)}


def test_data_parallel_partitions_keep_pages_on_their_device_and_tokens_exact():
  """With one host tier per device a slot only ever holds its device's pages (the
  pool's check), prefixes are shared within a device, and under page pressure
  with aborts every token still equals the solo run."""
  rng = np.random.default_rng()
  engine, reqs = run_with_prefix_cache(rng, 80, pages=40, abort_rate=0.05,
                                       model=TwoDeviceModel)
  assert sum(r.state is State.FINISHED for r in reqs) > 40
  assert engine.cached_tokens > 0
  assert {engine.pool.page_partition(p) for p in engine.radix.held_pages()} <= {0, 1}


def test_data_parallel_engine_places_a_request_with_its_cached_prefix():
  """A request goes to the device holding its cached prefix (and shares it), a new
  one to the least loaded device."""
  engine = Engine(TwoDeviceModel(num_host_pages=40),
                  EngineConfig(max_step_tokens=64, prefix_cache=True))
  prefix = list(range(1, 25))  # three chunks of 8
  first = engine.submit(prefix + [30, 31], 30)
  while first.state is not State.DECODING:
    engine.step()
  assert first.slot == 0
  other = engine.submit([40] * 20, 30)  # nothing cached: the idle device 1
  again = engine.submit(prefix + [50], 4)  # the prefix lives on device 0
  engine.step()
  engine.step()
  assert engine.pool.slot_partition(other.slot) == 1
  assert engine.pool.slot_partition(again.slot) == 0 and again.metrics.cached_tokens == 24
  engine.run()
  assert again.output == solo(TwoDeviceModel, again.prompt, 4)


@pytest.mark.parametrize("more_chunks", [0, 1])
def test_a_request_placed_off_its_prefix_device_pins_none_of_its_pages(more_chunks):
  """The prefix lives on device 0 but its slots are taken: the request goes to
  device 1 and shares nothing. From admission on it must not lock the prefix's
  node (device 0's pages, which it does not use), so device 0 can still evict it:
  checked while its prompt is still prefilling, a chunk a step, and after. With a
  whole chunk more than the prefix, the request's own chunk is cached below the
  prefix's nodes: locking it would pin them (a lock pins every ancestor)."""
  engine = Engine(TwoDeviceModel(num_host_pages=40),
                  EngineConfig(max_step_tokens=8, prefix_cache=True))
  prefix = list(range(1, 25))  # three chunks of 8: 6 pages on device 0
  engine.submit(prefix + [30], 2)
  engine.run()
  held = engine.radix.held_pages()
  fillers = [engine.submit(prefix + [31 + i], 20) for i in range(2)]  # device 0
  while any(f.state is State.WAITING for f in fillers):
    engine.step()
  away = engine.submit(prefix + list(range(40, 40 + 8 * more_chunks)) + [50], 30)
  while away.state is State.WAITING:
    engine.step()
  assert engine.pool.slot_partition(away.slot) == 1 and away.metrics.cached_tokens == 0
  assert away.state is State.PREFILLING
  for f in fillers:
    engine.abort(f.id)
  def locked(node):
    return node is not None and (node.lock > 0 or any(map(locked, node.children.values())))
  def prefix_locked():
    return any(locked(n) for n in engine.radix._nodes() if set(n.pages) & set(held))
  assert not prefix_locked()
  while away.state is State.PREFILLING:
    engine.step()
    assert not prefix_locked()
  if more_chunks:  # its own chunk is cached, below the prefix
    assert any(engine.pool.page_partition(p) == 1 for p in engine.radix.held_pages())
  freed = engine.radix.evict(100, functools.partial(engine.pool.drop, partition=0))
  assert freed == len(held)
  engine.run()
  assert away.output == solo(TwoDeviceModel, away.prompt, 30)
  engine.pool.check(engine.radix.held_pages())


def test_data_parallel_waits_for_the_prefix_device_when_it_has_a_free_slot():
  """The prefix lives on device 0, which has a free slot but no pages left (a
  running request holds them and the prefix). The request waits for device 0 and
  then shares the prefix, rather than recomputing it on the idle device 1 (the
  placement measured in WORKSPACE_NOTES.md: backfilling it lost cached tokens and
  shortened no queue)."""
  engine = Engine(TwoDeviceModel(num_host_pages=40),
                  EngineConfig(max_step_tokens=128, prefix_cache=True))
  prefix = list(range(1, 25))  # three chunks of 8: 6 pages on device 0
  engine.submit(prefix + [30], 2)
  engine.run()
  hog = engine.submit(prefix + [60] * 36, 20)  # 60 + 20 positions: all 20 pages of device 0
  while len(hog.output) < 13:  # 18 pages held, 2 free on device 0
    engine.step()
  assert engine.pool.slot_partition(hog.slot) == 0 and engine.pool.free_in(0) == 2
  again = engine.submit(prefix + [50] * 12, 8)  # 9 pages: the prefix's 6 and 3 more
  while again.state is State.WAITING:
    engine.step()
  assert hog.state is State.FINISHED
  assert engine.pool.slot_partition(again.slot) == 0 and again.metrics.cached_tokens == 24
  engine.run()
  assert again.output == solo(TwoDeviceModel, again.prompt, 8)
  assert hog.output == solo(TwoDeviceModel, hog.prompt, 20)
  engine.pool.check(engine.radix.held_pages())


def test_data_parallel_sends_a_request_where_its_pages_fit():
  """Device 0 runs one request that holds nearly all its pages, device 1 two small
  ones: the next request goes to device 1, which has the room, not to device 0,
  which runs fewer requests but would make it wait."""
  factory = lambda: TwoDeviceModel(num_slots=6, num_host_pages=40)
  engine = Engine(factory(), EngineConfig(max_step_tokens=128))
  big = engine.submit([40] * 70, 10)  # 18 pages now: device 0 (both idle, the lowest)
  engine.step()
  small = [engine.submit([41 + i] * 20, 12) for i in range(2)]  # 5 pages each
  while any(r.state is State.WAITING for r in small):
    engine.step()
  assert [engine.pool.slot_partition(r.slot) for r in (big, *small)] == [0, 1, 1]
  assert engine.pool.free_in(0) < 5
  late = engine.submit([44] * 20, 12)
  engine.step()
  assert late.state is not State.WAITING and engine.pool.slot_partition(late.slot) == 1
  engine.run()
  for r in (big, *small, late):
    assert r.state is State.FINISHED and r.output == solo(factory, r.prompt, r.max_new_tokens)
  engine.pool.check()


def test_data_parallel_eviction_frees_only_the_device_that_needs_pages():
  """Making room on device 0 evicts device 0's cached prefixes only: device 1's
  stay cached (they would free nothing there)."""
  engine = Engine(TwoDeviceModel(num_host_pages=40),
                  EngineConfig(max_step_tokens=128, prefix_cache=True))
  first = engine.submit([6] * 33, 2)  # 4 chunks cached on device 0 (8 pages)
  second = engine.submit([5] * 33, 2)  # the idle device 1
  engine.run()
  engine.submit([6] * 33, 2)  # device 0's prefix again: now the more recently used
  engine.run()
  part = engine.pool.page_partition
  cached_one = [p for p in engine.radix.held_pages() if part(p) == 1]
  assert len(cached_one) == 8 and first.metrics.cached_tokens == second.metrics.cached_tokens == 0
  # Device 0 has 12 free pages; this prompt needs 19 there: the cache gives up 7.
  hog = engine.submit([7] * 76, 4)
  engine.step()
  assert engine.pool.slot_partition(hog.slot) == 0
  assert set(cached_one) <= set(engine.radix.held_pages())
  engine.run()
  assert hog.output == solo(TwoDeviceModel, hog.prompt, 4)
  engine.pool.check(engine.radix.held_pages())


def test_data_parallel_eviction_takes_a_prefix_held_up_by_another_devices_suffix():
  """A prefix C cached on device 0 whose suffix E ran, and is cached, on device 1
  (device 0's slots were busy). C is no leaf, and E is device 1's: evicting only
  device 0's leaves could never free C. A request that shares C's first chunk waits
  on device 0 (its prefix's device, a free slot) for pages only that unlocked prefix
  holds: C goes, with E. (It stalled for good before: nothing ran anywhere.) A
  request that grows past device 0's free pages while decoding is not preempted
  over and over."""
  engine = Engine(TwoDeviceModel(num_host_pages=40),
                  EngineConfig(max_step_tokens=128, prefix_cache=True))
  pool, part = engine.pool, engine.pool.page_partition
  prefix = list(range(1, 57))  # 7 chunks, 14 pages
  engine.submit(prefix + [57], 2)
  engine.run()  # cached on device 0
  fillers = [engine.submit(prefix + [58 + i], 3) for i in range(2)]  # both device 0 slots
  while any(f.state is State.WAITING for f in fillers):
    engine.step()
  away = engine.submit(prefix + [60] * 8 + [61] * 8 + [1], 2)  # + 2 chunks: device 1
  while away.state is State.WAITING:
    engine.step()
  assert pool.slot_partition(away.slot) == 1
  engine.run()
  held = {n.key[:1]: sorted({part(p) for p in n.pages}) for n in engine.radix._nodes()}
  assert sorted(held.values()) == [[0], [1]]  # C on device 0, E below it on device 1
  assert pool.free_in(0) < 12 <= pool.free_in(0) + 14
  waiting = engine.submit(prefix[:8] + [62] * 40, 2)  # 12 pages, 2 of them C's
  grows = engine.submit(prefix[:8] + [44] * 4, 40)  # 3 pages, then 13 while decoding
  for _ in range(400):
    if not engine.has_work:
      break
    engine.step()
    engine.pool.check(engine.radix.held_pages())
  assert waiting.state is grows.state is State.FINISHED, (waiting.reason, grows.reason)
  assert grows.metrics.preemptions <= 1
  assert waiting.output == solo(TwoDeviceModel, waiting.prompt, 2)
  assert grows.output == solo(TwoDeviceModel, grows.prompt, 40)


@dataclasses.dataclass
class ThreeDeviceModel(FakeModel):
  """FakeModel on three "devices": two slots and 20 host pages each."""

  num_slots: int = 6
  num_partitions: int = 3
  num_host_pages: int = 60


def test_data_parallel_room_counts_the_requests_own_match_on_other_devices():
  """A request matches C (cached on device 0, whose slots are busy) and E below it
  (cached on device 1). It will share neither elsewhere, so device 1's room
  counts E's pages, which admission evicts there: it runs on device 1 at once.
  (Its match was locked before the device was picked: device 1 had no room then,
  and it waited on device 2, which has more free pages but not enough.)"""
  engine = Engine(ThreeDeviceModel(), EngineConfig(max_step_tokens=128, prefix_cache=True))
  pool, part = engine.pool, engine.pool.page_partition
  prefix, suffix = list(range(1, 17)), list(range(20, 36))  # C, E: 2 chunks, 4 pages each
  engine.submit(prefix + [57], 2)
  engine.run()  # C cached on device 0
  fillers = [engine.submit(prefix + [58 + i], 24) for i in range(2)]  # device 0's slots
  while any(f.state is State.WAITING for f in fillers):
    engine.step()
  away = engine.submit(prefix + suffix + [1], 2)
  while away.state is State.WAITING:
    engine.step()
  assert pool.slot_partition(away.slot) == 1
  while away.state is not State.FINISHED:
    engine.step()
  held = {n.key[:1]: sorted({part(p) for p in n.pages}) for n in engine.radix._nodes()}
  assert held == {(1,): [0], (20,): [1]}  # E on device 1, below C on device 0
  hogs = [engine.submit([50] * 41, 20), engine.submit([51] * 29, 3)]  # 11 and 8 pages
  for hog in hogs:
    while hog.state is State.WAITING:
      engine.step()
  assert [pool.slot_partition(h.slot) for h in hogs] == [2, 1]
  assert [pool.free_in(p) for p in (1, 2)] == [8, 9]  # both short of 10, device 1 has E's 4
  late = engine.submit(prefix + suffix + [60] * 7 + [1], 2)  # 10 pages
  engine.step()
  assert late.state is not State.WAITING and pool.slot_partition(late.slot) == 1
  assert late.metrics.cached_tokens == 0
  engine.run()
  for r in (*fillers, away, *hogs, late):
    assert r.state is State.FINISHED
    assert r.output == solo(ThreeDeviceModel, r.prompt, r.max_new_tokens)
  engine.pool.check(engine.radix.held_pages())


def test_data_parallel_ties_in_running_requests_go_to_the_most_free_pages():
  """No prefix to follow: a request goes to the device running the fewest
  requests, and among equals to the one with the most free host pages (not the
  lowest index, not the fullest)."""
  engine = Engine(ThreeDeviceModel(max_len=128), EngineConfig(max_step_tokens=128))
  pool = engine.pool
  reqs = [engine.submit([7] * n, 20) for n in (40, 9, 56)]  # 15, 8 and 19 pages at most
  while any(r.state is not State.DECODING for r in reqs):
    engine.step()
  assert sorted(pool.slot_partition(r.slot) for r in reqs) == [0, 1, 2]
  free = [pool.free_in(p) for p in range(3)]
  assert len(set(free)) == 3 and np.argmax(free) not in (0, np.argmin(free))
  late = engine.submit([9] * 9, 3)
  engine.step()
  assert late.state is State.DECODING
  assert pool.slot_partition(late.slot) == np.argmax(free)
  engine.run()
  for r in (*reqs, late):
    assert r.output == solo(ThreeDeviceModel, r.prompt, r.max_new_tokens)


def test_data_parallel_engine_refuses_a_request_no_device_can_hold():
  """40 pages over 2 devices: a request needing 21 fits the pool but no device's
  host tier; it is refused at submit (it would wait forever)."""
  engine = Engine(TwoDeviceModel(num_host_pages=40, max_len=128),
                  EngineConfig(max_step_tokens=64))
  with pytest.raises(ValueError, match="per device"):
    engine.submit([1] * 80, 4)  # 84 positions: 21 pages of 4
  engine.submit([1] * 76, 4)  # 20 pages: fits one device
  engine.run()


def test_page_pool_partitions_hand_out_their_own_pages():
  pool = PagePool(8, num_slots=4, pages_per_slot=4, partitions=2)
  assert pool.grow(0, 3) and pool.table[0, :3].tolist() == [0, 1, 2]
  assert pool.grow(2, 2) and pool.table[2, :2].tolist() == [4, 5]
  assert not pool.grow(1, 2) and pool.free_in(0) == 1  # device 0 has one page left
  with pytest.raises(ValueError, match="another partition"):
    pool.share(3, [0])
  with pytest.raises(ValueError, match="nobody holds"):  # page 3: free
    pool.share(1, [3])
  with pytest.raises(ValueError, match="retaining a free page"):
    pool.retain([2, 3])
  pool.release(0)
  assert pool.free_in(0) == 4 and pool.num_free == 6
  pool.check()
  # Dropping pages of both devices (a tree's references): each device counts only
  # its own pages that became free (eviction for one device must not stop early).
  pool.retain([4, 5])  # (the tree's references beside slot 2's)
  pool.release(2)
  assert pool.drop([4, 5], partition=0) == 0 and pool.free_in(1) == 4
  assert pool.grow(0, 2)
  held = pool.table[0, :2].tolist()
  pool.retain(held)
  pool.release(0)
  assert pool.drop(held, partition=0) == 2 and pool.free_in(0) == 4
  pool.check()
  with pytest.raises(ValueError, match="partitions must divide"):
    PagePool(7, num_slots=4, pages_per_slot=4, partitions=2)


def test_prefix_cache_needs_a_model_that_loads_prefixes():
  with pytest.raises(ValueError, match="prefix_cache"):
    Engine(FakeModel(supports_prefix_cache=False), EngineConfig(prefix_cache=True))


# The disk tier ---------------------------------------------------------------


def test_disk_tier_reads_back_every_byte(tmp_path):
  import ml_dtypes
  rng = np.random.default_rng()
  disk = DiskTier(tmp_path, 6)
  k = rng.standard_normal((4, 2, 3, 5)).astype(ml_dtypes.bfloat16)
  k.view(np.uint16).reshape(-1)[rng.integers(k.size, size=3)] = 0x7FC1  # NaN payloads
  tokens = rng.integers(-1, VOCAB, (4, 7))
  ids = disk.write([k, tokens])
  assert ids == [0, 1, 2, 3] and disk.num_free == 2
  order = rng.permutation(4)
  back_k, back_t = disk.read([ids[i] for i in order])
  assert back_k.dtype == k.dtype and back_k.tobytes() == k[order].tobytes()
  assert (back_t == tokens[order]).all() and back_t.dtype == tokens.dtype
  with pytest.raises(ValueError, match="do not fit"):
    disk.write([k[:3], tokens[:3]])
  assert disk.num_free == 2  # refused: nothing taken
  with pytest.raises(ValueError, match="do not match"):
    disk.write([k[:1].astype(np.float32), tokens[:1]])
  disk.free(ids[1:3])
  with pytest.raises(ValueError, match="hold nothing"):
    disk.read([ids[1]])
  with pytest.raises(AssertionError, match="freed twice"):
    disk.free([ids[1]])
  def failing_write(ids, fields):
    raise OSError("disk full")
  disk.write_at, free = failing_write, disk.num_free
  with pytest.raises(OSError):  # an I/O error loses no ids
    disk.write([k[:2], tokens[:2]])
  assert disk.num_free == free
  assert os.listdir(tmp_path)


def test_radix_spills_leaves_to_disk_and_takes_them_back(tmp_path):
  pool = PagePool(16, num_slots=1, pages_per_slot=8)
  disk = DiskTier(tmp_path, 6)
  tree = RadixCache(UNIT, PAGE, disk)
  contents = {}  # host page -> what it holds; the spill writes it to disk
  spilled = {}

  def spill(pages):
    ids = disk.write([np.asarray([contents[p] for p in pages])])
    spilled.update(zip(ids, (contents[p] for p in pages)))
    return ids

  def cache(tokens):
    assert pool.grow(0, len(tokens) // PAGE)
    pages = pool.table[0, :len(tokens) // PAGE].tolist()
    for i, p in enumerate(pages):
      contents[p] = tuple(tokens[i * PAGE:(i + 1) * PAGE])
    adopted, node = tree.insert(tokens, pages)
    pool.retain(adopted)
    pool.release(0)
    return node

  prefix = [7, 7, 7, 7]
  a = cache(prefix + [1, 1, 1, 1])
  cache(prefix + [2, 2, 2, 2])
  tree.match_prefix(prefix + [2, 2, 2, 2])  # b's branch is the most recent
  assert tree.evict(2, pool.drop, spill) == 2  # a's leaf moves to disk
  assert a.disk and not a.pages and tree.num_disk_pages == 2 and tree.num_pages == 4
  pages, node = tree.match_prefix(prefix + [1, 1, 1, 1, 9])
  assert node is a and len(pages) == 2 and tree.disk_path(node) == [a]
  assert [spilled[i] for i in a.disk] == [(1, 1), (1, 1)]
  # Everything goes: the shared prefix last, after both its children are on disk.
  assert tree.evict(100, pool.drop, spill) == 4 and pool.in_use == 0
  assert disk.in_use == 6 == tree.num_disk_pages and len(tree.disk_path(a)) == 2
  pool.check(tree.held_pages())
  # Insert takes the path back with fresh host pages and frees its disk pages.
  tree.lock(a)
  node = cache(prefix + [1, 1, 1, 1])
  assert node is a and a.pages and not a.disk and tree.num_disk_pages == 2
  assert disk.in_use == 2 and sorted(tree.disk_pages()) == sorted(
      set(range(6)) - set(disk._free))
  pool.check(tree.held_pages())
  # A full disk forgets its least recently used unlocked leaves for good.
  tree.unlock(a)
  cache([5, 5, 5, 5, 6, 6, 6, 6])
  assert tree.evict(100, pool.drop, spill) == 8 and pool.in_use == 0
  assert disk.in_use <= 6 and tree.num_disk_pages == disk.in_use
  assert sorted(tree.disk_pages()) == sorted(set(range(6)) - set(disk._free))


@dataclasses.dataclass
class PoisoningModel(FakeModel):
  """FakeModel whose host pages read for the disk tier are poisoned at once (the
  pool reuses them): a prefix that was not truly read back fails the request."""

  def read_pages(self, state, pages):
    fields = super().read_pages(state, pages)
    for page in pages:
      state["pages"][int(page)] = {o: POISON for o in range(self.page_size)}
    return fields


@pytest.mark.parametrize("policy", ["load", "recompute", "auto"])
def test_disk_tier_under_page_pressure_keeps_every_token(policy, tmp_path):
  rng = np.random.default_rng()
  engine, reqs = run_with_prefix_cache(rng, 90, pages=24, abort_rate=0.03,
                                       model=PoisoningModel, disk_pages=20,
                                       disk_dir=str(tmp_path), disk_policy=policy)
  states = [r.state for r in reqs]
  assert states.count(State.FINISHED) > 50 and State.FAILED not in states
  assert engine.disk.pages_written > 0, "nothing reached the disk"
  if policy == "recompute":
    assert engine.disk_loaded_tokens == 0 < engine.disk_recomputed_tokens
  else:
    assert engine.disk_loaded_tokens > 0
  if policy == "load":
    assert engine.disk_recomputed_tokens == 0
  assert engine.cached_tokens >= engine.disk_loaded_tokens
  # The loads of a page count seen before are measured ("auto" weighs them).
  assert engine.disk.pages_loaded * FakeModel.page_size <= engine.disk_loaded_tokens
  assert (engine.disk.seconds_per_page is None) == (engine.disk.pages_loaded == 0)


@pytest.fixture
def virtual_clock(monkeypatch):
  """The engine's cost timer reads a clock that only the model moves: what it
  measures is exact, however loaded the machine (a wall-clock bound failed CI)."""
  import types

  from kvtier_jax.serving import engine as engine_module
  now = [0.0]
  monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
      perf_counter=lambda: now[0]))
  return now


@dataclasses.dataclass
class CompilingModel(PoisoningModel):
  """Its first run of each shape (a write's page count, a prefill's chunk length:
  the serving backend pads every chunk to one shape, its count traced) takes
  ``compile_s`` on the virtual clock, as a jit compile does; a later run takes
  ``unit_s`` a page or token. ``runs[kind]`` keeps (compiled, pages or tokens)."""

  clock: list = dataclasses.field(default_factory=lambda: [0.0])
  compile_s: float = 0.3
  unit_s: float = 1e-3
  runs: dict = dataclasses.field(default_factory=dict)

  def _run(self, state, kind, shape, size):
    seen = state.setdefault(kind, set())
    compiled = shape not in seen
    seen.add(shape)
    self.clock[0] += self.compile_s if compiled else self.unit_s * size
    self.runs.setdefault(kind, []).append((compiled, size))

  def write_pages(self, state, pages, fields):
    self._run(state, "write", len(pages), len(pages))
    return super().write_pages(state, pages, fields)

  def prefill(self, state, slot, tokens, start, count):
    self._run(state, "prefill", len(tokens), count)
    return super().prefill(state, slot, tokens, start, count)


def test_a_disk_loads_compile_is_not_its_measured_cost(tmp_path, virtual_clock):
  """``disk_policy="auto"`` weighs the measured seconds per page against prefill:
  the first write of a page count (a compile: 136 of a 152 ms load on SmolLM2) was
  in the measure, and "auto" then recomputed where loading wins."""
  rng = np.random.default_rng()
  engine, _ = run_with_prefix_cache(
      rng, 60, pages=24, disk_pages=20, disk_dir=str(tmp_path), disk_policy="load",
      model=functools.partial(CompilingModel, clock=virtual_clock))
  runs = engine.model.runs["write"]
  assert engine.disk_loaded_tokens > 0 and any(c for c, _ in runs)
  later = [pages for compiled, pages in runs if not compiled]
  assert later, "no page count was loaded twice: nothing measured"
  assert engine.disk.pages_loaded == sum(later)
  assert engine.disk.load_seconds == pytest.approx(1e-3 * sum(later), rel=1e-9)


def test_a_prefills_compile_is_not_its_measured_cost(tmp_path, virtual_clock):
  """The prefill cost "auto" weighs a disk load against skips a chunk shape's
  first run (a compile): with it, the measure read a 0.3 s stall spread over the
  tokens timed, and "auto" loaded where recomputing wins."""
  rng = np.random.default_rng()
  model = functools.partial(CompilingModel, clock=virtual_clock)
  engine, _ = run_with_prefix_cache(rng, 60, pages=24, model=model, disk_pages=20,
                                    disk_dir=str(tmp_path), disk_policy="auto")
  runs = engine.model.runs["prefill"]
  later = [count for compiled, count in runs if not compiled]
  assert [c for c, _ in runs].count(True) == 1 and later
  assert engine._prefill_timed_tokens == sum(later)
  assert engine._prefill_seconds == pytest.approx(1e-3 * sum(later), rel=1e-9)
  # A fixed policy weighs nothing: no chunk waits for the device to be timed.
  for policy in ("load", "recompute"):
    engine, _ = run_with_prefix_cache(rng, 8, pages=24, model=model, disk_pages=20,
                                      disk_dir=str(tmp_path / policy),
                                      disk_policy=policy)
    assert engine.model.runs["prefill"] and engine._prefill_timed_tokens == 0


def test_a_requests_cached_tokens_are_its_first_admissions():
  """Under page pressure requests are preempted and admitted again: the metric
  keeps what the first admission found cached (observed the step it was set), not
  what a re-admission finds (its own prompt, cached meanwhile)."""
  rng = np.random.default_rng()
  engine = Engine(FakeModel(num_host_pages=20),
                  EngineConfig(max_step_tokens=20, prefix_cache=True, max_overtakes=3))
  pending, reqs, first = shared_prefix_workload(rng, 120), [], {}
  while pending or engine.has_work:
    for _ in range(min(len(pending), int(rng.integers(0, 3)))):
      prompt, new, sp = pending.pop()
      reqs.append(engine.submit(prompt, new, sp))
    engine.step()
    for req in reqs:
      if req.metrics.cached_tokens is not None:
        first.setdefault(req.id, req.metrics.cached_tokens)
  preempted = [r for r in reqs if r.metrics.preemptions]
  assert preempted
  assert all(r.metrics.cached_tokens == first[r.id] for r in reqs if r.id in first)


def test_engine_removes_the_disk_tier_it_created():
  engine, reqs = run_with_prefix_cache(np.random.default_rng(), 40, pages=24,
                                       model=PoisoningModel, disk_pages=20)
  assert State.FAILED not in [r.state for r in reqs] and engine.disk.pages_written > 0
  path = engine.disk.path
  assert os.path.basename(path).startswith("kvtier-disk-") and os.listdir(path)
  del engine
  gc.collect()
  assert not os.path.exists(path), "the engine's temporary disk tier was left behind"


def test_a_disk_directory_serves_one_engine_at_a_time(tmp_path):
  """A second engine (or a snapshot restored) on a live engine's disk directory
  is refused: its first write would delete the live engine's pages. The live
  engine then loads its prefix back intact; once it is gone the directory is free
  again."""
  model = lambda: PoisoningModel(num_host_pages=20)
  config = EngineConfig(max_step_tokens=20, prefix_cache=True, disk_pages=20,
                        disk_dir=str(tmp_path), disk_policy="load")
  engine = Engine(model(), config)
  prefix = list(range(1, 25))  # 3 chunks
  engine.submit(prefix + [60, 61], 2)
  engine.run()
  engine.submit([50 + i % 10 for i in range(70)], 10)  # pushes the prefix to disk
  engine.run()
  assert engine.radix.num_disk_pages == 6
  with pytest.raises(ValueError, match="in use by another engine"):
    Engine(model(), config)
  snap = tmp_path.parent / f"{tmp_path.name}-snap"
  snapshot.save(engine, snap)
  with pytest.raises(ValueError, match="in use by another engine"):
    snapshot.restore(snap, model(), config)
  again = engine.submit(prefix + [1], 3)
  engine.run()  # PoisoningModel: pages not truly read back change the tokens
  assert again.metrics.cached_tokens == len(prefix) and engine.disk_loaded_tokens == 24
  assert again.output == solo(model, prefix + [1], 3)
  del engine
  gc.collect()
  tier = Engine(model(), config).disk
  tier.close()
  with pytest.raises(ValueError, match="closed"):  # it no longer holds the directory
    tier.write([np.zeros((1, 2))])
  DiskTier(str(tmp_path), 4)
  # An engine dropped inside a reference cycle (an on_token closure over it) is not
  # freed until a collection: the next engine collects it rather than refuse.
  gc.disable()
  try:
    cyclic = Engine(model(), config)
    cyclic.submit([1, 2, 3], 2, on_token=lambda req, token, engine=cyclic: engine.steps)
    del cyclic
    Engine(model(), config)
  finally:
    gc.enable()


def test_disk_tier_needs_the_prefix_cache():
  with pytest.raises(ValueError, match="prefix_cache"):
    EngineConfig(disk_pages=8)
  with pytest.raises(ValueError, match="disk_policy"):
    EngineConfig(prefix_cache=True, disk_pages=8, disk_policy="sometimes")


def test_data_parallel_a_request_off_its_prefix_device_leaves_the_disk_part_alone():
  """Prefix P cached on device 0 with its second half spilled to disk; a request
  for P placed on device 1 shares nothing. It must not lock the disk node (the lock
  reached device 0's pages above it, which then could not be evicted), and its
  pages must not be adopted by that node: P's path would mix the two devices, and
  device 0 could never cache its own copy of P's second half."""
  engine = Engine(TwoDeviceModel(num_host_pages=40),
                  EngineConfig(prefix_cache=True, disk_pages=8, disk_policy="recompute"))
  part = engine.pool.page_partition
  prefix = list(range(1, 33))  # 4 chunks of 8: 8 pages

  def until_decoding(*reqs):
    while any(r.state is not State.DECODING for r in reqs):
      engine.step()

  first = engine.submit(prefix + [40], 20)
  until_decoding(first)
  engine.abort(first.id)
  split = engine.submit(prefix[:16] + [60] * 10, 20)  # splits P's node at 16
  until_decoding(split)
  engine.abort(split.id)
  engine._evict(1, 0)  # device 0's least recently used leaf: P[16:32] to disk
  pages, node = engine.radix.match_prefix(prefix)
  assert len(pages) == 4 and node.disk and not node.pages and {part(p) for p in pages} == {0}
  assert engine.radix.peek(prefix) == (32, pages, True)
  fillers = [engine.submit(prefix[:8] + [46 + i] * 12, 60) for i in range(2)]
  until_decoding(*fillers)
  assert {engine.pool.slot_partition(f.slot) for f in fillers} == {0}
  evictable = engine.radix.evictable_pages(lambda p: part(p[0])).get(0, [])
  away = engine.submit(prefix + [41], 5)
  engine.step()
  assert engine.pool.slot_partition(away.slot) == 1 and away.metrics.cached_tokens == 0
  assert engine.radix.evictable_pages(lambda p: part(p[0])).get(0, []) == evictable
  engine.run(lambda: away.state.done)
  assert away.output == solo(TwoDeviceModel, away.prompt, 5)
  pages, node = engine.radix.match_prefix(prefix)
  assert {part(p) for p in pages} == {0} and node.disk  # P's path is device 0's
  engine.pool.check(engine.radix.held_pages())
