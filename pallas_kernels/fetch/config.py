"""Block size of the zero-copy fetch kernel."""

from __future__ import annotations

import dataclasses

@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """block_rows: missed rows copied per program (power of 2)."""

  block_rows: int = 32
  num_warps: int = 4

  def __post_init__(self):
    if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
      raise ValueError(f"{self.block_rows=} must be a power of 2")
