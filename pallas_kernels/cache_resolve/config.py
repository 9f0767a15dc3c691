"""Tile sizes of the cache_resolve kernel."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """block_slots x block_sel is the tile of the slot/selection equality test (the
  kernel compares every slot with every selected position: B*k compares per row,
  no sort, no hash table). Powers of 2; num_warps: Triton launch parameter."""

  block_slots: int = 64
  block_sel: int = 32
  num_warps: int = 4

  def __post_init__(self):
    for name in ("block_slots", "block_sel"):
      v = getattr(self, name)
      if v < 1 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of 2")
