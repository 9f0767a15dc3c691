"""Launch parameters of the fused RESOLVE + fetch kernels."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """fetch_rows: missed rows one commit program copies (power of 2); the commit
  grid is (rows, ceil(k / fetch_rows)), so a row's misses are copied by several
  programs at once. num_warps: Triton launch parameter of the kernels."""

  fetch_rows: int = 64
  num_warps: int = 4

  def __post_init__(self):
    if self.fetch_rows < 1 or self.fetch_rows & (self.fetch_rows - 1):
      raise ValueError(f"{self.fetch_rows=} must be a power of 2")
