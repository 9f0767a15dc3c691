"""A disk tier below the host page pool (HiCache's L3), in TensorStore.

Cached prefixes the host pool has to give up (``RadixCache.evict`` with a disk
tier) are written here page by page and read back when a later request matches
them, instead of being recomputed. A page is whatever arrays the model's
``read_pages`` returns for it (the tiered backend: every layer's K and V of
``page_size`` positions); they are stored raw (no compression, no dtype change),
so a page reads back byte for byte.

The engine decides per request whether loading beats recomputing, from what it
measured: ``seconds_per_page`` here (read + write into the host pool) against its
prefill seconds per token (HiCache users found an L3 hit can cost as much as the
recompute on a fast accelerator).
"""

from __future__ import annotations

import fcntl
import gc
import os
import weakref
from typing import Sequence

import numpy as np
import tensorstore as ts


class DiskTier:
  """``num_pages`` page slots in a zarr array per page field, under ``path``.

  The arrays are created on the first write, shaped from the pages written
  (``[num_pages, *page_shape]``, one chunk per page). Slots are handed out lowest
  id first; ``free`` returns them.

  One tier per directory: the first write deletes what the directory held, so a
  second tier there (another engine, a snapshot restored into a live engine's
  directory) would destroy the first one's pages. An exclusive lock on
  ``path/.lock``, held until ``close`` (or collection, or the process's end),
  refuses it with a ``ValueError``.
  """

  def __init__(self, path: str | os.PathLike, num_pages: int):
    if num_pages <= 0:
      raise ValueError(f"num_pages={num_pages} must be positive")
    self.path, self.num_pages = os.fspath(path), num_pages
    os.makedirs(self.path, exist_ok=True)
    self._lock = open(os.path.join(self.path, ".lock"), "a")  # noqa: SIM115
    if not self._try_lock():
      gc.collect()  # a tier no one holds, not collected yet, lets go
      if not self._try_lock():
        self._lock.close()
        raise ValueError(f"the disk tier {self.path} is in use by another engine "
                         "(one directory per engine; DiskTier.close frees it)")
    weakref.finalize(self, self._lock.close)  # collected: the lock goes, no warning
    self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() = lowest id
    self._stores: list[ts.TensorStore] | None = None
    self.pages_written = self.pages_read = 0
    # Engine-measured: reading pages back into the host pool, over the loads timed
    # (not a page count's first, which compiles the model's write).
    self.load_seconds = 0.0
    self.pages_loaded = 0

  def _try_lock(self) -> bool:
    try:
      fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return True
    except BlockingIOError:
      return False

  def close(self) -> None:
    """Let the directory go (its pages stay on disk, not usable by this tier)."""
    self._stores = None
    self._lock.close()

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def in_use(self) -> int:
    return self.num_pages - len(self._free)

  @property
  def seconds_per_page(self) -> float | None:
    """Measured cost of bringing one page back to the host pool (None: no load yet)."""
    return self.load_seconds / self.pages_loaded if self.pages_loaded else None

  def _open(self, fields: Sequence[np.ndarray]) -> None:
    stores = []
    for i, field in enumerate(fields):
      page_shape = list(field.shape[1:])
      spec = {"driver": "zarr",
              "kvstore": {"driver": "file", "path": os.path.join(self.path, f"field{i}")},
              "metadata": {"shape": [self.num_pages] + page_shape,
                           "chunks": [1] + page_shape,
                           "dtype": _zarr_dtype(field.dtype), "compressor": None}}
      stores.append(ts.open(spec, create=True, delete_existing=True).result())
    self._stores = stores

  def write(self, fields: Sequence[np.ndarray]) -> list[int]:
    """Store pages (each field [n, ...], page i in row i); returns their disk ids.
    Raises ``ValueError`` when fewer than n slots are free (nothing written)."""
    count = fields[0].shape[0]
    if any(f.shape[0] != count for f in fields):
      raise ValueError(f"fields disagree on the page count: {[f.shape for f in fields]}")
    if count > len(self._free):
      raise ValueError(f"{count} pages do not fit the disk tier ({len(self._free)} free)")
    self._check(fields)
    ids = [self._free.pop() for _ in range(count)]
    try:
      self.write_at(ids, fields)
    except BaseException:  # an I/O error: the ids are free again, none lost
      self._free.extend(reversed(ids))
      raise
    return ids

  def _check_open(self) -> None:
    if self._lock.closed:
      raise ValueError(f"the disk tier {self.path} is closed")

  def _check(self, fields: Sequence[np.ndarray]) -> None:
    self._check_open()
    if self._stores is None:
      self._open(fields)
    if len(fields) != len(self._stores) or any(
        tuple(f.shape[1:]) != tuple(s.shape[1:]) or np.dtype(f.dtype) != s.dtype.numpy_dtype
        for f, s in zip(fields, self._stores)):
      raise ValueError("pages do not match the disk tier's fields "
                       f"{[(s.shape[1:], s.dtype) for s in self._stores]}")

  def write_at(self, ids: Sequence[int], fields: Sequence[np.ndarray]) -> None:
    """Store pages at the given disk ids (``write`` picks them; a restored
    snapshot puts its pages back where they were)."""
    self._check(fields)
    futures = [store.oindex[np.asarray(ids)].write(np.ascontiguousarray(f))
               for store, f in zip(self._stores, fields)]
    for future in futures:
      future.result()
    self.pages_written += len(ids)

  def read(self, ids: Sequence[int], *, count: bool = True) -> list[np.ndarray]:
    """The pages stored at ``ids``, each field [len(ids), ...]; ``count=False``: a
    read that is not the engine's (a snapshot's) leaves ``pages_read`` alone."""
    self._check_open()
    if self._stores is None or not ids:
      raise ValueError("nothing to read")
    free = set(self._free)
    bad = [i for i in ids if not 0 <= i < self.num_pages or i in free]
    if bad:
      raise ValueError(f"disk pages {bad[:5]} hold nothing")
    index = np.asarray(ids)
    futures = [store.oindex[index].read() for store in self._stores]
    self.pages_read += len(ids) if count else 0
    return [future.result() for future in futures]

  def free(self, ids: Sequence[int]) -> None:
    if set(ids) & set(self._free) or len(set(ids)) != len(ids):
      raise AssertionError(f"disk pages {list(ids)[:5]} freed twice")
    self._free.extend(int(i) for i in ids)
    self._free.sort(reverse=True)


def _zarr_dtype(dtype) -> str:
  dtype = np.dtype(dtype)
  return "bfloat16" if dtype.name == "bfloat16" else dtype.str
