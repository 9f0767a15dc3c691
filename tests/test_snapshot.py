"""Snapshot and restore (kvtier_jax/serving/snapshot.py): an engine restored from a
snapshot, in this process or after the saving process was killed, yields every
request's tokens as the uninterrupted run does, with its page pool, radix tree and
disk tier intact; a missing, partial, corrupt or mismatched snapshot is refused."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvtier_jax.serving import Engine, EngineConfig, SamplingParams, State, snapshot
from tests.test_prefix_cache import PoisoningModel, TwoDeviceModel, shared_prefix_workload
from tests.test_serving import FakeModel

CONFIG = dict(max_step_tokens=20, prefix_cache=True, disk_pages=20)


def build(seed, disk_dir=None, config=CONFIG):
  """An engine with a disk tier under page pressure and its arrival schedule
  (engine step -> requests submitted before it)."""
  rng = np.random.default_rng(seed)
  engine = Engine(PoisoningModel(num_host_pages=24), EngineConfig(disk_dir=disk_dir, **config))
  schedule = {}
  for i, request in enumerate(shared_prefix_workload(rng, 40)):
    schedule.setdefault(int(rng.integers(0, 60)), []).append((f"r{i}", request))
  return engine, schedule


def feed(engine, schedule):
  for rid, (prompt, new, sp) in schedule.get(engine.steps, []):
    engine.submit(prompt, new, sp, request_id=rid)


def finish(engine, schedule, rows=None):
  """Runs to the end; each request's (state, output). ``rows``: a list that gets
  every step's row without its clock readings."""
  while engine.has_work or engine.steps <= max(schedule):
    feed(engine, schedule)
    row = engine.step()
    if rows is not None:
      rows.append({k: v for k, v in row.items() if k not in ("t", "seconds")})
    engine.pool.check(engine.radix.held_pages())
  return {rid: (r.state, r.output) for rid, r in engine.requests.items()}


def schedule_books(engine):
  """Each request's admission order, cached tokens, preemptions and overtakes, and
  the prefix tree's nodes (tree order) with their LRU stamps."""
  nodes = [(n.key, n.last_used, tuple(n.pages), tuple(n.disk))
           for n in engine.radix._nodes()]
  return nodes, {rid: (r.admit_order, r.metrics.cached_tokens, r.metrics.preemptions,
                       r.overtaken) for rid, r in engine.requests.items()}


def books(engine):
  return (engine.pool.table.tolist(), engine.pool.refs.tolist(), engine.radix.num_pages,
          sorted(engine.radix.disk_pages()), engine.disk.in_use, engine.cached_tokens,
          [(r.id, r.state, r.cached, r.slot) for r in engine.requests.values()])


def test_restored_engine_continues_exactly(tmp_path):
  seed = int(np.random.default_rng().integers(2**31))
  engine, schedule = build(seed, str(tmp_path / "disk"))
  stop = int(np.random.default_rng(seed).integers(20, 50))
  while engine.steps < stop:
    feed(engine, schedule)
    engine.step()
  snapshot.save(engine, tmp_path / "snap")
  saved = books(engine)
  want = finish(engine, schedule)
  assert engine.disk.pages_written > 0 and sum(s is State.FINISHED for s, _ in
                                               want.values()) > 20
  restored = snapshot.restore(tmp_path / "snap", PoisoningModel(num_host_pages=24),
                              EngineConfig(disk_dir=str(tmp_path / "disk2"), **CONFIG))
  assert books(restored) == saved and restored.steps == stop
  assert finish(restored, schedule) == want
  with pytest.raises(FileExistsError):
    snapshot.save(restored, tmp_path / "snap")


@pytest.mark.parametrize("schedule_name", ["fcfs", "lpm"])
def test_a_restored_engine_schedules_and_evicts_as_the_original(tmp_path, schedule_name):
  """Not only the tokens: after a restore every step admits, prefills, preempts,
  evicts and caches as the uninterrupted engine does (same step rows, admission
  order, cached tokens, overtakes): the tree's LRU clock, the waiting order and the
  overtake counts are restored, not rebuilt. The disk policy is "load" (auto's
  choice reads clocks)."""
  seed = int(np.random.default_rng().integers(2**31))
  config = dict(CONFIG, disk_policy="load", schedule=schedule_name)
  engine, schedule = build(seed, str(tmp_path / "disk"), config)
  stop = int(np.random.default_rng(seed).integers(20, 50))
  while engine.steps < stop:
    feed(engine, schedule)
    engine.step()
  saved_now = engine.now()
  snapshot.save(engine, tmp_path / "snap")
  want_rows = []
  want = finish(engine, schedule, want_rows)
  restored = snapshot.restore(tmp_path / "snap", PoisoningModel(num_host_pages=24),
                              EngineConfig(disk_dir=str(tmp_path / "disk2"), **config))
  assert restored.now() >= saved_now  # its clock goes on from the snapshot's
  got_rows = []
  assert finish(restored, schedule, got_rows) == want
  assert got_rows == want_rows, seed
  assert schedule_books(restored) == schedule_books(engine), seed
  assert sum(r["cached_pages"] for r in want_rows) > 0  # the tree was in use


@pytest.mark.parametrize("policy", ["load", "recompute"])
def test_a_restored_engine_keeps_its_disk_and_prefix_counters(tmp_path, policy):
  """The disk tier's counters (pages written, read, loaded and their seconds, which
  ``auto`` weighs) and the engine's token counters go on from the snapshot's (the
  restore writes the disk pages back: not counted again)."""
  counters = lambda e: (e.disk.pages_written, e.disk.pages_read, e.disk.load_seconds,
                        e.disk.pages_loaded, e.disk_loaded_tokens,
                        e.disk_recomputed_tokens, e.prompt_tokens, e.cached_tokens,
                        e.imported_tokens)
  config = dict(CONFIG, disk_policy=policy)
  engine, schedule = build(int(np.random.default_rng().integers(2**31)),
                           str(tmp_path / "disk"), config)
  used = (lambda e: e.disk_loaded_tokens) if policy == "load" else (
      lambda e: e.disk_recomputed_tokens)
  while not used(engine) and engine.steps < 200:
    feed(engine, schedule)
    engine.step()
  assert used(engine) > 0
  snapshot.save(engine, tmp_path / "snap")
  restored = snapshot.restore(tmp_path / "snap", PoisoningModel(num_host_pages=24),
                              EngineConfig(disk_dir=str(tmp_path / "disk2"), **config))
  assert counters(restored) == counters(engine)


def test_killed_process_resumes_from_its_last_snapshot(tmp_path):
  seed = int(np.random.default_rng().integers(2**31))
  worker = subprocess.Popen([sys.executable, "-m", "tests.snapshot_worker", str(tmp_path),
                             str(seed)], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)),
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
  deadline = time.time() + 120
  for line in worker.stdout:
    if int(line) >= 25 or time.time() > deadline:
      break
  worker.send_signal(signal.SIGKILL)  # mid-run, maybe mid-save
  worker.wait()
  snaps = sorted(p for p in os.listdir(tmp_path) if p.startswith("step-"))
  assert snaps, "the worker saved nothing"
  engine, schedule = build(seed, str(tmp_path / "disk"))
  want = finish(engine, schedule)
  restored = snapshot.restore(tmp_path / snaps[-1], PoisoningModel(num_host_pages=24),
                              EngineConfig(disk_dir=str(tmp_path / "disk2"), **CONFIG))
  assert restored.steps >= 25
  assert finish(restored, schedule) == want


def damage_array_files(path, how):
  """Flip one byte in (or truncate) every data file of the stored arrays."""
  files = [os.path.join(root, f) for root, _, names in os.walk(path / "arrays")
           for f in names if os.path.basename(root) == "d"]
  assert files
  rng = np.random.default_rng()
  for target in files:
    data = bytearray(open(target, "rb").read())
    if how == "flip":
      data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    else:
      del data[len(data) // 2:]
    open(target, "wb").write(bytes(data))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax
@pytest.mark.parametrize("damage", ["flip", "truncate", "uncommitted", "books", "missing",
                                    "swapped"])
def test_damaged_snapshots_are_refused(tmp_path, damage):
  engine, schedule = build(0)
  for _ in range(30):
    feed(engine, schedule)
    engine.step()
  path = tmp_path / "snap"
  snapshot.save(engine, path)
  if damage in ("flip", "truncate"):
    damage_array_files(path, damage)
  elif damage == "swapped":  # well-formed arrays of another step: only checksums see it
    engine.step()
    snapshot.save(engine, tmp_path / "later")
    shutil.rmtree(path / "arrays")
    shutil.copytree(tmp_path / "later" / "arrays", path / "arrays")
  elif damage == "uncommitted":
    os.remove(path / "commit_success.txt")
  elif damage == "books":
    meta = path / "meta" / "metadata"
    text = open(meta).read()
    open(meta, "w").write(text.replace('"cached": ', '"cached": 1', 1))
  else:
    path = tmp_path / "nothing"
  with pytest.raises(snapshot.SnapshotError):
    snapshot.restore(path, PoisoningModel(num_host_pages=24), EngineConfig(**CONFIG))


def test_a_snapshot_of_another_shape_is_refused(tmp_path):
  engine, _ = build(0)
  snapshot.save(engine, tmp_path / "snap")
  with pytest.raises(snapshot.SnapshotError, match="num_host_pages"):
    snapshot.restore(tmp_path / "snap", PoisoningModel(num_host_pages=30),
                     EngineConfig(**CONFIG))
  with pytest.raises(snapshot.SnapshotError, match="config"):
    snapshot.restore(tmp_path / "snap", PoisoningModel(num_host_pages=24),
                     EngineConfig(prefix_cache=True))
  with pytest.raises(snapshot.SnapshotError, match="arrays"):
    snapshot.restore(tmp_path / "snap", ShortModel(num_host_pages=24),
                     EngineConfig(**CONFIG))


def test_a_snapshot_of_another_model_identity_is_refused(tmp_path):
  """A host tier saved by one model's weights would decode another's requests with
  the first one's K/V: another ``model_id`` (or none where one was saved) is a
  ``SnapshotError``; the same one restores."""
  import dataclasses

  @dataclasses.dataclass
  class Named(FakeModel):
    model_id: str = "a"
    decode_id: str = "x"

  engine = Engine(Named(), EngineConfig(prefix_cache=True))
  engine.submit(list(range(1, 30)), 5)
  engine.step()
  snapshot.save(engine, tmp_path / "snap")
  for model in (Named(model_id="b"), FakeModel()):
    with pytest.raises(snapshot.SnapshotError, match="model_id=a"):
      snapshot.restore(tmp_path / "snap", model, EngineConfig(prefix_cache=True))
  # The same weights selecting otherwise (another selector or index sharing).
  with pytest.raises(snapshot.SnapshotError, match="decode_id=x"):
    snapshot.restore(tmp_path / "snap", Named(decode_id="y"), EngineConfig(prefix_cache=True))
  again = snapshot.restore(tmp_path / "snap", Named(), EngineConfig(prefix_cache=True))
  again.run()
  engine.run()
  assert [r.output for r in again.requests.values()] == [
      r.output for r in engine.requests.values()]


@pytest.mark.parametrize("saved_as", ["format_1", "other_draws"])
def test_a_snapshot_of_other_draws_goes_on_only_with_greedy_requests(
    tmp_path, monkeypatch, saved_as):
  """A sampler whose draws changed (``request.DRAWS``; format 1 recorded none) would
  continue a saved sampled request with other tokens: such a snapshot is refused
  while it holds an unfinished sampled request (one that finished does not count),
  and restores, with the uninterrupted run's tokens, when the rest are greedy."""
  seed = int(np.random.default_rng().integers(1000))
  for temperature in (0.7, 0.0):
    engine = Engine(FakeModel())
    ended = engine.submit([7, 8], 1, SamplingParams(temperature=0.9, seed=seed))
    while not ended.state.done:
      engine.step()
    engine.submit(list(range(1, 30)), 6, SamplingParams(temperature=temperature, seed=seed))
    engine.submit([4, 5, 6], 6)
    engine.step()
    path = tmp_path / f"snap{temperature}"
    with monkeypatch.context() as patch:
      if saved_as == "format_1":
        patch.setattr(snapshot, "FORMAT", 1)
        patch.setattr(snapshot, "DRAWS", None)
      else:
        patch.setattr(snapshot, "DRAWS", snapshot.DRAWS + 1)
      snapshot.save(engine, path)
    if temperature > 0:
      with pytest.raises(snapshot.SnapshotError,
                         match=r"\[.req-1.\] would go on with other tokens"):
        snapshot.restore(path, FakeModel())
      continue
    restored = snapshot.restore(path, FakeModel())
    restored.run()
    engine.run()
    assert [r.output for r in restored.requests.values()] == [
        r.output for r in engine.requests.values()]


def test_a_restored_stream_reattaches_its_callback(tmp_path):
  """Callbacks are not saved; one set on the restored request gets every token
  generated after the restore, in order."""
  engine = Engine(FakeModel())
  req = engine.submit(list(range(1, 20)), 9)
  while len(req.output) < 3:
    engine.step()
  snapshot.save(engine, tmp_path / "snap")
  engine.run()
  restored = snapshot.restore(tmp_path / "snap", FakeModel())
  again = restored.requests[req.id]
  assert again.on_token is None
  streamed = []
  again.on_token = lambda r, token: streamed.append(token)
  restored.run()
  assert again.output == req.output and streamed == req.output[3:]


def test_an_engine_that_cannot_be_built_is_a_snapshot_error(tmp_path):
  """Restoring onto a model that cannot serve the snapshot's config (no prefix
  cache): a ``SnapshotError``, as every other refusal (it was a bare ValueError)."""
  import dataclasses  # noqa: PLC0415

  @dataclasses.dataclass
  class NoPrefixCache(FakeModel):
    supports_prefix_cache: bool = False

  engine = Engine(FakeModel(), EngineConfig(prefix_cache=True))
  engine.submit(list(range(1, 30)), 5)
  engine.step()
  snapshot.save(engine, tmp_path / "snap")
  with pytest.raises(snapshot.SnapshotError, match="cannot be built: prefix_cache needs"):
    snapshot.restore(tmp_path / "snap", NoPrefixCache(), EngineConfig(prefix_cache=True))


def test_a_snapshot_of_another_partitioning_or_disk_size_is_refused_before_any_build(
    tmp_path):
  """Data-parallel partitions and the disk tier's size are the snapshot's shape
  too: another count is a ``SnapshotError`` before the engine is built (no disk
  directory written), both ways."""
  two = Engine(TwoDeviceModel(), EngineConfig(prefix_cache=True))
  one = Engine(FakeModel(num_slots=4), EngineConfig(prefix_cache=True))
  for name, engine in (("two", two), ("one", one)):
    engine.submit(list(range(1, 30)), 5)
    engine.step()
    snapshot.save(engine, tmp_path / name)
  with pytest.raises(snapshot.SnapshotError, match="num_partitions=2"):
    snapshot.restore(tmp_path / "two", FakeModel(num_slots=4), EngineConfig(prefix_cache=True))
  with pytest.raises(snapshot.SnapshotError, match="num_partitions=1"):
    snapshot.restore(tmp_path / "one", TwoDeviceModel(), EngineConfig(prefix_cache=True))
  engine, _ = build(0, str(tmp_path / "disk"))
  snapshot.save(engine, tmp_path / "snap")
  other = dict(CONFIG, disk_pages=CONFIG["disk_pages"] + 4, disk_dir=str(tmp_path / "d2"))
  with pytest.raises(snapshot.SnapshotError, match="disk pages"):
    snapshot.restore(tmp_path / "snap", PoisoningModel(num_host_pages=24),
                     EngineConfig(**other))
  assert not (tmp_path / "d2").exists()


def test_a_restored_tree_keeps_its_children_order_and_spills_alike(tmp_path):
  """Data-parallel eviction spills a subtree in its children's order: restored in
  reverse, the same nodes went to other disk ids. Saving reads the disk without
  counting it as the engine's reads."""
  def cache(engine, slot, tokens, before):
    pool = engine.pool
    n = len(tokens) // 4 - len(before)
    assert pool.grow(slot, n)
    pages = before + pool.table[slot, :n].tolist()
    adopted, _ = engine.radix.insert(tokens, pages)
    pool.retain(adopted)
    pool.release(slot)
    return pages
  config = lambda d: EngineConfig(prefix_cache=True, disk_pages=20,
                                  disk_dir=str(tmp_path / d))
  engine = Engine(TwoDeviceModel(), config("d0"))
  a = cache(engine, 0, [1] * 8, [])  # A on device 0
  for fill in range(2, 2 + int(np.random.default_rng().integers(2, 5))):
    cache(engine, 2, [1] * 8 + [fill] * 8, a)  # children of A on device 1
  engine._evict(1, 1)  # one child of A to disk: the save reads it back
  read = engine.disk.pages_read
  snapshot.save(engine, tmp_path / "snap")
  assert engine.disk.pages_read == read
  restored = snapshot.restore(tmp_path / "snap", TwoDeviceModel(), config("d1"))
  assert restored.disk.pages_read == read
  spilled = []
  for eng in (engine, restored):
    (node_a,) = eng.radix.root.children.values()
    order = list(node_a.children)
    eng._evict(1, 0)  # device 0 needs a page: A and its subtree go to disk
    spilled.append((order, [node_a.children[k].disk for k in order], node_a.disk))
  assert spilled[0] == spilled[1]


class ShortModel(FakeModel):
  def restore_state(self, arrays):
    if len(arrays) != 2:
      raise ValueError(f"{len(arrays)} arrays for a state of 2")
