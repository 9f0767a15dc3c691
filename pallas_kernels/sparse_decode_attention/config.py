"""Block sizes of the sparse decode attention kernel."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tuning knobs (static).

  block_k: selected rows gathered per inner iteration (power of 2, >= 16 for
    Triton's dot).
  k_splits: programs splitting one (request, KV head)'s k rows (flash-decoding),
    merged by log-sum-exp outside the kernel; raises occupancy at small batch.
  num_warps / num_stages: Triton launch parameters.
  """

  block_k: int = 64
  k_splits: int = 4
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.block_k < 16 or self.block_k & (self.block_k - 1):
      raise ValueError(f"{self.block_k=} must be a power of 2 >= 16")
    if self.k_splits < 1:
      raise ValueError(f"{self.k_splits=} must be >= 1")

  @classmethod
  def get_default(cls, top_k: int, head_dim: int = 128, itemsize: int = 2
                  ) -> "BlockSizes":
    """Fewer splits for small k, so that each split still has a full block. The K
    and V tiles (``block_k x head_dim`` each, ``num_stages`` deep) fit an H100 /
    H200's 227 KiB of shared memory: at most 64 KiB a tile, one stage above 32 KiB
    (head_dim 256 in f32 or 512 in bf16 asked 273-277 KiB with two)."""
    block_k = 64 if top_k >= 64 else 16
    block_k = max(16, min(block_k, _TILE_BYTES // (head_dim * itemsize)))
    splits = max(1, min(4, top_k // (2 * block_k)))
    stages = 1 if block_k * head_dim * itemsize > _TILE_BYTES // 2 else 2
    return cls(block_k=block_k, k_splits=splits, num_stages=stages)


_TILE_BYTES = 64 * 1024  # the largest K (or V) tile a program keeps
