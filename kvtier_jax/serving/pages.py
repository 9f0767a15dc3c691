"""The host page pool's allocator (host side) and the slots' page table."""

from __future__ import annotations

import heapq

import numpy as np

from kvtier_jax.shapes import EMPTY


class PagePool:
  """Free pages of a host tier of ``num_pages`` pages, and each slot's table.

  Pages are handed out lowest id first (deterministic); ``table`` i32[S, MP] is
  what the device state's page table must equal (``dirty`` until uploaded). A page
  may be shared (a cached prefix): ``refs`` counts the slots listing it plus the
  prefix cache's reference, and a page is free again when its count reaches 0.

  With ``partitions`` P > 1 (a data-parallel mesh: one host tier per device) slots
  and pages split into P equal ranges, and a slot's pages come from its own range.
  """

  def __init__(self, num_pages: int, num_slots: int, pages_per_slot: int,
               partitions: int = 1):
    if partitions < 1 or num_slots % partitions or num_pages % partitions:
      raise ValueError(f"{partitions} partitions must divide the {num_slots} slots and "
                       f"the {num_pages} host pages")
    self.num_pages, self.partitions = num_pages, partitions
    self._slots_per, self._pages_per = num_slots // partitions, num_pages // partitions
    # One min-heap per partition: heappop() = its lowest id (a sorted list is a heap).
    self._free = [list(range(p * self._pages_per, (p + 1) * self._pages_per))
                  for p in range(partitions)]
    self.table = np.full((num_slots, pages_per_slot), EMPTY, np.int32)
    self.refs = np.zeros((num_pages,), np.int64)
    self.dirty = True

  def slot_partition(self, slot: int) -> int:
    return slot // self._slots_per

  def page_partition(self, page: int) -> int:
    return int(page) // self._pages_per

  @property
  def num_free(self) -> int:
    return sum(map(len, self._free))

  def free_in(self, partition: int) -> int:
    return len(self._free[partition])

  @property
  def in_use(self) -> int:
    return self.num_pages - self.num_free

  def grow(self, slot: int, num_pages: int) -> bool:
    """Give ``slot`` pages until it holds ``num_pages``; False (and nothing
    changed) when the pool cannot."""
    row = self.table[slot]
    free = self._free[self.slot_partition(slot)]
    held = int((row >= 0).sum())
    need = num_pages - held
    if need <= 0:
      return True
    if need > len(free) or num_pages > row.shape[0]:
      return False
    for j in range(held, num_pages):
      row[j] = heapq.heappop(free)
      self.refs[row[j]] = 1
    self.dirty = True
    return True

  def share(self, slot: int, pages: list[int]) -> None:
    """``slot`` (holding nothing) starts with the shared ``pages``."""
    row = self.table[slot]
    if (row >= 0).any():
      raise ValueError(f"slot {slot} already holds pages")
    if any(self.page_partition(p) != self.slot_partition(slot) for p in pages):
      raise ValueError(f"slot {slot} cannot share pages of another partition")
    if pages and self.refs[pages].min() <= 0:
      raise ValueError("sharing a page nobody holds")
    row[:len(pages)] = pages
    self.refs[pages] += 1
    self.dirty = True

  def retain(self, pages: list[int]) -> None:
    """One more reference to each of ``pages`` (the prefix cache adopts them)."""
    if pages and self.refs[pages].min() <= 0:
      raise ValueError("retaining a free page")
    self.refs[pages] += 1

  def drop(self, pages, partition: int | None = None) -> int:
    """One reference fewer to each of ``pages``; returns how many became free (in
    ``partition`` only, when given)."""
    freed = []
    for page in pages:
      if self.refs[page] <= 0:
        raise AssertionError(f"page {page} dropped more often than held")
      self.refs[page] -= 1
      if self.refs[page] == 0:
        freed.append(int(page))
    for page in freed:  # O(log n) each: no re-sort of a million-page list per drop
      heapq.heappush(self._free[self.page_partition(page)], page)
    return sum(partition is None or self.page_partition(p) == partition for p in freed)

  def release(self, slot: int) -> None:
    if not isinstance(slot, (int, np.integer)):  # table[None] would be every row
      raise TypeError(f"slot {slot!r} is not a slot index")
    row = self.table[slot]
    self.drop(row[row >= 0].tolist())
    row[:] = EMPTY
    self.dirty = True

  def check(self, cached: list[int] = ()) -> None:
    """Every page is free or referenced exactly by the slots listing it and the
    prefix cache (``cached``: the pages it holds); none lost (tests, soak)."""
    counts = np.bincount(np.concatenate([self.table[self.table >= 0],
                                         np.asarray(cached, np.int32)]).astype(np.int64),
                         minlength=self.num_pages)
    if (counts != self.refs).any():
      bad = np.flatnonzero(counts != self.refs)[:5].tolist()
      raise AssertionError(f"pages {bad}: references {self.refs[bad].tolist()} != "
                           f"holders {counts[bad].tolist()}")
    for row in self.table:
      held = row[row >= 0]
      if len(set(held.tolist())) != held.size:
        raise AssertionError("a slot lists a page twice")
    free = [p for stack in self._free for p in stack]
    if len(set(free)) != len(free) or set(free) != set(np.flatnonzero(self.refs == 0).tolist()):
      raise AssertionError("the free list disagrees with the reference counts")
    for part, stack in enumerate(self._free):
      if any(self.page_partition(p) != part for p in stack):
        raise AssertionError("a free page is in another partition's list")
    for slot, row in enumerate(self.table):
      if any(self.page_partition(p) != self.slot_partition(slot) for p in row[row >= 0]):
        raise AssertionError(f"slot {slot} holds a page of another partition")
