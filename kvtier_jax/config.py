"""Static configuration of a tiered KV cache (everything that fixes a shape)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.cache_resolve.reference import LOOKUPS

WARM_STARTS = ("first", "head_tail", "empty")
HOST_APPENDS = ("auto", "in_scan", "separate")
POLICIES = ("lru", "freq", "rank")


@dataclasses.dataclass(frozen=True)
class TierConfig:
  """Shapes and implementation choices of one tiered cache (glossary: shapes.py).

  Attributes:
    num_layers: L, layers with a tiered cache.
    num_requests: R, request slots decoded together.
    max_len: T, positions per request the host tier holds.
    num_q_heads / num_kv_heads / head_dim: Hq, Hkv, D.
    hot_slots: B, regular hot slots per (layer, request, unit); ``B >= top_k``.
    top_k: k, positions a selector may return per (layer, request, unit).
    per_kv_head: one cache unit per KV head (U = Hkv) instead of per request.
    dtype: KV dtype (host tier and hot cache).
    warm_start: hot-cache content after a prefill longer than B: ``"first"``
      (positions 0..B-1, SGLang CUDA), ``"head_tail"`` (first B//2 and last B - B//2,
      SGLang NPU) or ``"empty"`` (first decode step misses everything).
    fetch_chunk: rows per host gather of the XLA fetch path; misses are fetched in
      ``ceil(misses / fetch_chunk)`` gathers, so padding costs at most a chunk per
      layer. 0 picks ``max(16, k // 8)`` (an eighth of a selection: typical miss
      rates of 5-15% take one or two gathers per request).
    resolve_impl / attention_impl / fetch_impl: "xla", "pallas" or "auto" (on GPU
      the faster one as measured there, XLA elsewhere; pallas_kernels/common.py).
      fetch "xla" is the host gather (compute_on), "pallas" the zero-copy kernel.
    resolve_lookup: membership lookup of the XLA RESOLVE: "auto" (per backend,
      pallas_kernels/common.py), "scan", "unrolled", "sort" or "map" (a dense
      position -> slot map of max_len + 1 entries per row, no sort). Same results.
    interpret: force Pallas interpret mode on/off (None: interpret off GPU only).
    host_append: where the newest token's KV is written to the host tier:
      ``"separate"`` (the ``"auto"`` choice) in its own donated jit after the step,
      one strided write per request for all layers; ``"in_scan"`` inside the layer
      scan, 2R tiny writes per layer (also copy-free on XLA:GPU, but measured
      slower on an H200: 3.0 vs 2.5 ms per step at 32K, R=8).
    overlap_hit_miss: attend over resident rows while the misses are fetched, then
      over the misses, merged by log-sum-exp (exact to f32 rounding).
    policy: victim choice: ``"lru"`` (HiSparse's RESOLVE order) or ``"freq"``
      (lowest exponential moving average of selections, ``freq_alpha`` decay; the
      best online policy on our traces, experiments/policies.py). Outputs are the
      same either way; only which slots get evicted differs.
      ``"rank"``: evict the slots whose positions the selector ranks worst at this
      step, softened by the ``freq`` EMA (``rank_freq`` weight; the best online
      policy on our traces); the selector then returns ``rank_depth`` best-first
      positions per row, the first ``top_k`` of which are the selection.
    rank_depth: m, positions per row of the selector's ranking under ``"rank"``
      (0 or <= top_k: the selection itself).
    rank_freq: weight of the frequency EMA in the ``"rank"`` key, >= 0.
  """

  num_layers: int
  num_requests: int
  max_len: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  hot_slots: int
  top_k: int
  per_kv_head: bool = False
  dtype: Any = jnp.float32
  warm_start: str = "head_tail"
  fetch_chunk: int = 0
  resolve_impl: str = "auto"
  attention_impl: str = "auto"
  fetch_impl: str = "auto"
  resolve_lookup: str = "auto"
  interpret: bool | None = None
  host_append: str = "auto"
  overlap_hit_miss: bool = False
  policy: str = "lru"
  freq_alpha: float = 0.9
  rank_depth: int = 0
  rank_freq: float = 0.3

  def __post_init__(self):
    for name in ("num_layers", "num_requests", "max_len", "num_q_heads",
                 "num_kv_heads", "head_dim", "hot_slots", "top_k"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name}={getattr(self, name)} must be positive")
    if self.hot_slots < self.top_k:
      raise ValueError(
          f"hot_slots (B={self.hot_slots}) must be >= top_k (k={self.top_k}): "
          "every selected position needs a slot in the same step")
    if self.top_k > self.max_len:
      raise ValueError(f"top_k={self.top_k} exceeds max_len={self.max_len}")
    if self.num_q_heads % self.num_kv_heads:
      raise ValueError(f"{self.num_q_heads=} must be a multiple of {self.num_kv_heads=}")
    if self.warm_start not in WARM_STARTS:
      raise ValueError(f"{self.warm_start=} must be one of {WARM_STARTS}")
    if self.host_append not in HOST_APPENDS:
      raise ValueError(f"{self.host_append=} must be one of {HOST_APPENDS}")
    if self.policy not in POLICIES:
      raise ValueError(f"{self.policy=} must be one of {POLICIES}")
    if self.policy != "lru" and self.resolve_impl == "pallas":
      raise ValueError(f"the {self.policy} policy has no Pallas RESOLVE kernel: "
                       "resolve_impl='xla'")
    if not self.rank_freq >= 0:
      raise ValueError(f"{self.rank_freq=} must be >= 0")
    if self.rank_depth < 0 or (self.rank_depth and self.policy != "rank"):
      raise ValueError(f"rank_depth={self.rank_depth} needs policy='rank' (and >= 0)")
    if not 0.0 < self.freq_alpha < 1.0:
      raise ValueError(f"{self.freq_alpha=} must be in (0, 1)")
    if self.resolve_lookup not in ("auto",) + LOOKUPS:
      raise ValueError(f"{self.resolve_lookup=} must be 'auto' or one of {LOOKUPS}")
    if self.fetch_chunk < 0:
      raise ValueError(f"{self.fetch_chunk=} must be >= 0")
    for name in ("resolve_impl", "attention_impl", "fetch_impl"):
      common.check_impl(getattr(self, name))

  # Derived sizes -------------------------------------------------------------
  @property
  def num_units(self) -> int:  # U
    return self.num_kv_heads if self.per_kv_head else 1

  @property
  def heads_per_unit(self) -> int:  # Hg
    return self.num_kv_heads // self.num_units

  @property
  def q_per_kv(self) -> int:  # G
    return self.num_q_heads // self.num_kv_heads

  @property
  def select_width(self) -> int:
    """Positions per row a selector returns: the selection, or the ranking."""
    return max(self.top_k, self.rank_depth)

  @property
  def row_bytes(self) -> int:
    """Bytes of one row (one position, one unit) of K *or* V."""
    return self.heads_per_unit * self.head_dim * jnp.dtype(self.dtype).itemsize

  @property
  def fetch_rows_per_chunk(self) -> int:
    lanes = self.num_requests * self.num_units * self.top_k
    return min(self.fetch_chunk or max(16, self.top_k // 8), lanes)

  @property
  def append_in_scan(self) -> bool:
    return self.host_append == "in_scan"

  @property
  def use_interpret(self) -> bool:
    return common.interpret_mode() if self.interpret is None else self.interpret

  # Memory accounting (bytes) -------------------------------------------------
  def host_bytes_per_request(self) -> int:
    """K+V of every position, plus the one scratch row per layer."""
    return 2 * self.num_layers * (self.max_len + 1) * self.num_units * self.row_bytes

  def device_bytes_per_request(self) -> int:
    """Hot K+V plus slot_pos/lru/slot_score metadata, per request (selector state
    excluded)."""
    hot = 2 * self.num_layers * self.num_units * (self.hot_slots + 1) * self.row_bytes
    meta = 3 * self.num_layers * self.num_units * self.hot_slots * 4
    return hot + meta

  def replace(self, **changes) -> "TierConfig":
    return dataclasses.replace(self, **changes)
