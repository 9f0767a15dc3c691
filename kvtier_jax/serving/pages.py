"""The host page pool's allocator (host side) and the slots' page table."""

from __future__ import annotations

import numpy as np

from kvtier_jax.shapes import EMPTY


class PagePool:
  """Free pages of a host tier of ``num_pages`` pages, and each slot's table.

  Pages are handed out lowest id first (deterministic); ``table`` i32[S, MP] is
  what the device state's page table must equal (``dirty`` until uploaded).
  """

  def __init__(self, num_pages: int, num_slots: int, pages_per_slot: int):
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() = lowest id
    self.table = np.full((num_slots, pages_per_slot), EMPTY, np.int32)
    self.dirty = True

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def in_use(self) -> int:
    return self.num_pages - len(self._free)

  def grow(self, slot: int, num_pages: int) -> bool:
    """Give ``slot`` pages until it holds ``num_pages``; False (and nothing
    changed) when the pool cannot."""
    row = self.table[slot]
    held = int((row >= 0).sum())
    need = num_pages - held
    if need <= 0:
      return True
    if need > len(self._free) or num_pages > row.shape[0]:
      return False
    for j in range(held, num_pages):
      row[j] = self._free.pop()
    self.dirty = True
    return True

  def release(self, slot: int) -> None:
    row = self.table[slot]
    held = row[row >= 0]
    self._free.extend(sorted(held.tolist(), reverse=True))
    self._free.sort(reverse=True)
    row[:] = EMPTY
    self.dirty = True

  def check(self) -> None:
    """No page lost or held twice (tests, soak)."""
    held = self.table[self.table >= 0].tolist()
    if len(held) != len(set(held)) or set(held) & set(self._free):
      raise AssertionError("a page is held twice")
    if len(held) + len(self._free) != self.num_pages:
      raise AssertionError(f"{self.num_pages - len(held) - len(self._free)} pages lost")
