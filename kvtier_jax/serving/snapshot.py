"""Snapshot and restore a serving engine (orbax): stop anywhere between steps, go on
later (another process) with every request yielding the tokens it would have.

A snapshot holds the model's state (``ServingModel.snapshot``: the host tier's
pages, hot caches, metadata, selector state, staging buffer, host-side mirrors),
the disk tier's pages in use, and the engine's books as JSON: requests (prompt,
outputs, sampling parameters, metrics, slot, progress), the waiting queue, the page
pool (table, reference counts, free list) and the radix tree. Sampling needs no RNG
state: a draw depends on (seed, position, logits) only.

Refusing bad input: orbax writes a snapshot under a temporary name and renames it
when complete, and marks it committed; on top of that every array and the JSON are
checksummed (sha256) at save and verified at restore, before anything is built. A
missing, partial or corrupt snapshot, or one of another model shape or identity
(``ServingModel.model_id``: its K/V would be another model's numbers; ``decode_id``:
another selection would decode other tokens), or one saved by a sampler of other
draws (``request.DRAWS``) with sampled requests to continue, raises
``SnapshotError``; nothing half-loaded is ever returned.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import time
from typing import Callable

import numpy as np
import orbax.checkpoint as ocp

from kvtier_jax.serving.engine import Engine, EngineConfig
from kvtier_jax.serving.radix import Node
from kvtier_jax.serving.request import DRAWS, Metrics, Request, SamplingParams, State

FORMAT = 2  # 2: records the sampler's draws (``request.DRAWS``)
_SHAPE_FIELDS = ("num_slots", "max_len", "chunk_size", "page_size", "num_host_pages",
                 "vocab_size")


_DONE = {s.value for s in State if s.done}


class SnapshotError(ValueError):
  """A snapshot that cannot be restored (missing, partial, corrupt, mismatched)."""


def _digest(array: np.ndarray) -> str:
  array = np.ascontiguousarray(array)
  head = f"{array.dtype.str}{array.dtype.name}{array.shape}".encode()
  return hashlib.sha256(head + array.view(np.uint8).tobytes()).hexdigest()


def _json_digest(meta: dict) -> str:
  return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def save(engine: Engine, path: str | os.PathLike) -> None:
  """Write ``engine`` (between steps) to the new directory ``path``."""
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path):
    raise FileExistsError(f"{path} exists; a snapshot goes to a new directory")
  leaves = list(engine.model.snapshot(engine.state))
  disk_ids = [] if engine.disk is None else engine.radix.disk_pages()
  disk_fields = engine.disk.read(disk_ids, count=False) if disk_ids else []
  groups = [("model", leaves), ("disk", disk_fields)]
  groups += [(f"imported:{r.id}", r.imported[2]) for r in engine.requests.values()
             if r.imported is not None and not r.state.done]
  arrays, specs = {}, []
  for kind, group in groups:
    for i, leaf in enumerate(group):
      leaf = np.asarray(leaf)
      name = f"{kind}_{i:05d}"
      specs.append(dict(name=name, kind=kind, shape=list(leaf.shape), dtype=leaf.dtype.name,
                        sha256=_digest(leaf)))
      if leaf.size:  # orbax stores no empty arrays; they are rebuilt from the spec
        arrays[name] = leaf
  meta = dict(format=FORMAT, draws=DRAWS, arrays=specs, books=_books(engine, disk_ids))
  manifest = dict(meta_sha256=_json_digest(meta))
  items = dict(meta=ocp.args.JsonSave(meta), manifest=ocp.args.JsonSave(manifest))
  if arrays:
    items["arrays"] = ocp.args.PyTreeSave(arrays)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(path, ocp.args.Composite(**items))


def restore(path: str | os.PathLike, model, config: EngineConfig = EngineConfig(), *,
            clock: Callable[[], float] = time.perf_counter,
            on_step: Callable[[dict], None] | None = None) -> Engine:
  """A new engine over ``model`` (built like the saved one) continuing the
  snapshot at ``path``; raises ``SnapshotError`` if it cannot, touching nothing."""
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise SnapshotError(f"no snapshot at {path}")
  if not os.path.exists(os.path.join(path, "commit_success.txt")):
    raise SnapshotError(f"{path} is a partial snapshot (never committed)")
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      head = checkpointer.restore(path, ocp.args.Composite(
          meta=ocp.args.JsonRestore(), manifest=ocp.args.JsonRestore()))
      meta, manifest = head["meta"], head["manifest"]
      if not isinstance(meta, dict) or _json_digest(meta) != manifest.get("meta_sha256"):
        raise SnapshotError(f"{path}: the engine's books do not match their checksum")
      names = [s["name"] for s in meta["arrays"] if np.prod(s["shape"]) > 0]
      stored = {}
      if names:
        restore_args = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
        stored = checkpointer.restore(path, ocp.args.Composite(
            arrays=ocp.args.PyTreeRestore(restore_args=restore_args)))["arrays"]
  except SnapshotError:
    raise
  except Exception as err:  # noqa: BLE001 - orbax / tensorstore / json failures
    raise SnapshotError(f"{path} is corrupt or partial: {type(err).__name__}: {err}") from err
  if meta.get("format") not in (1, FORMAT):
    raise SnapshotError(f"{path}: snapshot format {meta.get('format')} is not 1 or {FORMAT}")
  groups = collections.defaultdict(list)
  for spec in meta["arrays"]:
    array = stored.get(spec["name"])
    if array is None:
      array = np.zeros(spec["shape"], spec["dtype"])
    if (list(array.shape) != spec["shape"] or array.dtype.name != spec["dtype"]
        or _digest(array) != spec["sha256"]):
      raise SnapshotError(f"{path}: array {spec['name']} is corrupt (checksum mismatch)")
    groups[spec["kind"]].append(array)
  books = meta["books"]
  saved = dict(books["model"])
  # Older snapshots did not name their partitions: their pool's free lists do.
  saved.setdefault("num_partitions", len(books["pool"]["free"]))
  for field in (*_SHAPE_FIELDS, "num_partitions"):
    here = getattr(model, field, 1) if field == "num_partitions" else getattr(model, field)
    if saved[field] != here:
      raise SnapshotError(f"{path}: saved with {field}={saved[field]}, the model "
                          f"has {here}")
  # The host tier's K/V are the saved model's numbers, its requests' tokens those
  # of the saved selection (older snapshots: unnamed, not checked).
  for field in ("model_id", "decode_id"):
    if field in saved and saved[field] != getattr(model, field, None):
      raise SnapshotError(f"{path}: saved with {field}={saved[field]}, the model "
                          f"has {getattr(model, field, None)}")
  if bool(books["radix"]) != config.prefix_cache or (
      bool(books["disk"]) != bool(config.disk_pages)):
    raise SnapshotError(f"{path}: saved with prefix_cache={bool(books['radix'])}, disk tier "
                        f"{bool(books['disk'])}; the config differs")
  if books["disk"] and books["disk"]["num_pages"] != config.disk_pages:
    raise SnapshotError(f"{path}: saved with {books['disk']['num_pages']} disk pages; the "
                        f"config has {config.disk_pages}")
  if meta.get("draws") != DRAWS:  # (format 1: none recorded)
    sampled = [r["id"] for r in books["requests"] if r["state"] not in _DONE
               and r["sampling"]["temperature"] > 0]
    if sampled:
      raise SnapshotError(f"{path}: saved by a sampler of other draws (version "
                          f"{meta.get('draws')}, this one's is {DRAWS}); its sampled "
                          f"requests {sampled[:3]} would go on with other tokens")
  try:
    state = model.restore_state(groups["model"])
  except ValueError as err:
    raise SnapshotError(f"{path}: the model refused its state: {err}") from err
  try:
    engine = Engine(model, config, clock=clock, on_step=on_step)
  except (ValueError, OSError) as err:  # (a model without a prefix cache, a disk in use)
    raise SnapshotError(f"{path}: the engine cannot be built: {err}") from err
  _load_books(engine, books, groups)
  engine.state = state
  engine._last_stats = model.stats(state)
  engine.pool.dirty = True
  return engine


# The engine's books <-> JSON ----------------------------------------------------


def _books(engine: Engine, disk_ids: list[int]) -> dict:
  nodes, index = [], {}
  if engine.radix is not None:
    stack = [engine.radix.root]
    while stack:  # parents before children
      node = stack.pop()
      index[id(node)] = len(nodes)
      nodes.append(dict(parent=index.get(id(node.parent)), key=list(node.key),
                        pages=list(map(int, node.pages)), disk=list(map(int, node.disk)),
                        lock=node.lock, last_used=node.last_used))
      stack.extend(reversed(node.children.values()))  # restored in this order
  requests = []
  for req in engine.requests.values():
    requests.append(dict(
        id=req.id, prompt=req.prompt, max_new_tokens=req.max_new_tokens,
        sampling=dataclasses.asdict(req.sampling), stop_ids=sorted(req.stop_ids),
        metrics=dataclasses.asdict(req.metrics), state=req.state.value, output=req.output,
        logprobs=req.logprobs, top_logprobs=req.top_logprobs,
        reason=req.reason, slot=req.slot, device_bytes=req.device_bytes, cached=req.cached,
        staged=req.staged, admit_order=req.admit_order, overtaken=req.overtaken,
        relayed=req.relayed,
        radix_node=None if req.radix_node is None else index[id(req.radix_node)],
        imported=None if req.imported is None or req.state.done else list(req.imported[:2])))
  pool = engine.pool
  disk = engine.disk
  return dict(
      model={**{f: getattr(engine.model, f) for f in _SHAPE_FIELDS},
             "num_partitions": engine.pool.partitions,
             "model_id": getattr(engine.model, "model_id", None),
             "decode_id": getattr(engine.model, "decode_id", None)},
      now=engine.now(), steps=engine.steps, admitted=engine._admitted,
      device_in_use=engine._device_in_use, prompt_tokens=engine.prompt_tokens,
      cached_tokens=engine.cached_tokens, disk_loaded_tokens=engine.disk_loaded_tokens,
      disk_recomputed_tokens=engine.disk_recomputed_tokens,
      imported_tokens=engine.imported_tokens,
      prefill_timing=[engine._prefill_seconds, engine._prefill_timed_tokens],
      requests=requests, waiting=[r.id for r in engine.waiting],
      pool=dict(table=pool.table.tolist(), refs=pool.refs.tolist(), free=pool._free),
      radix=nodes and dict(nodes=nodes, clock=engine.radix._next_stamp),
      disk=disk and dict(num_pages=disk.num_pages, ids=disk_ids, free=disk._free,
                         counters=[disk.pages_written, disk.pages_read, disk.load_seconds,
                                   disk.pages_loaded]))


def _load_books(engine: Engine, books: dict, groups: dict[str, list[np.ndarray]]) -> None:
  nodes = []
  if books["radix"]:
    radix = engine.radix
    for spec in books["radix"]["nodes"]:
      if spec["parent"] is None:
        node = radix.root
      else:
        parent = nodes[spec["parent"]]
        node = Node(tuple(spec["key"]), spec["pages"], parent, disk=spec["disk"])
        parent.children[tuple(node.key[:radix.unit])] = node
      node.lock, node.last_used = spec["lock"], spec["last_used"]
      nodes.append(node)
    radix._next_stamp = books["radix"]["clock"]
    radix.version += 1
    radix.num_pages = len(radix.held_pages())
    radix.num_disk_pages = len(radix.disk_pages())
  if books["disk"]:
    spec, disk = books["disk"], engine.disk  # its size was checked by restore
    if spec["ids"]:
      disk.write_at(spec["ids"], groups["disk"])
    disk._free = list(spec["free"])
    disk.pages_written, disk.pages_read, disk.load_seconds, disk.pages_loaded = (
        spec["counters"])
  pool = engine.pool
  pool.table[...] = np.asarray(books["pool"]["table"], np.int32)
  pool.refs[...] = np.asarray(books["pool"]["refs"], np.int64)
  free = books["pool"]["free"]  # one list per partition (checked by restore)
  pool._free = [sorted(stack) for stack in free]  # a heap (older snapshots: a stack)
  for spec in books["requests"]:
    metrics = Metrics(**spec["metrics"])
    req = Request(spec["id"], spec["prompt"], spec["max_new_tokens"],
                  SamplingParams(**spec["sampling"]), frozenset(spec["stop_ids"]), metrics,
                  state=State(spec["state"]), output=spec["output"], reason=spec["reason"],
                  logprobs=spec.get("logprobs", []),
                  top_logprobs=[[tuple(pair) for pair in top]
                                for top in spec.get("top_logprobs", [])],
                  slot=spec["slot"], device_bytes=spec["device_bytes"],
                  cached=spec["cached"], staged=spec["staged"],
                  admit_order=spec["admit_order"], overtaken=spec.get("overtaken", 0),
                  relayed=spec.get("relayed", 0),
                  radix_node=None if spec["radix_node"] is None else nodes[spec["radix_node"]])
    if spec["imported"]:
      req.imported = (*spec["imported"], groups[f"imported:{req.id}"])
    engine.requests[req.id] = req
    if req.slot is not None:
      engine.slots[req.slot] = req
  engine.waiting.extend(engine.requests[i] for i in books["waiting"])
  engine.steps, engine._admitted = books["steps"], books["admitted"]
  engine._device_in_use = books["device_in_use"]
  engine.prompt_tokens, engine.cached_tokens = books["prompt_tokens"], books["cached_tokens"]
  engine.disk_loaded_tokens = books["disk_loaded_tokens"]
  engine.disk_recomputed_tokens = books["disk_recomputed_tokens"]
  engine.imported_tokens = books["imported_tokens"]
  engine._prefill_seconds, engine._prefill_timed_tokens = books["prefill_timing"]
  engine._t0 = engine._clock() - books["now"]
