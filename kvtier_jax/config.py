"""Static configuration of a tiered KV cache, by concern.

``TierConfig`` holds the shapes (everything that fixes an array size) and the
behaviour of the step (warm start, index sharing, lookahead); ``PolicyConfig``
(kvtier_jax/policies.py) the replacement policy; ``ImplConfig`` which
implementation runs each op. All are frozen and hashable: they are static
arguments of the jitted step. Glossary of the letters: shapes.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kvtier_jax import lookup
from kvtier_jax.policies import PolicyConfig
from pallas_kernels import common
from pallas_kernels.fused_resolve import map_scratch_bytes

WARM_STARTS = ("first", "head_tail", "empty")


@dataclasses.dataclass(frozen=True)
class ImplConfig:
  """Which implementation runs each op; results never depend on it.

  Attributes:
    resolve / attention / fetch: "xla", "pallas" or "auto" (on a GPU the faster
      one as measured there, XLA elsewhere: pallas_kernels/common.py). fetch
      "xla" is the host gather (compute_on), "pallas" the zero-copy kernel.
    lookup: membership lookup of the XLA RESOLVE and the residency tests: "auto",
      "map" or "search" (kvtier_jax/lookup.py).
    interpret: force Pallas interpret mode on/off (None: interpret off GPU only).
    fetch_chunk: rows per host gather of the XLA fetch; misses take
      ``ceil(misses / fetch_chunk)`` gathers. None: on a GPU ``max(16, k // 8)``
      (an eighth of a selection; staged, then scattered). Off GPU the fetch
      scatters each gather straight into the hot cache (``fetch.fetch_misses``),
      ``min(max(16, R * U * k // 8), R * U * k)`` rows, an eighth of a layer's
      lanes (miss rates of 5-15% take one or two gathers; one gather of every
      lane cost the CPU step ~7% more); the overlapped attention's staged fetch
      gathers every lane there (a loop into a staging buffer cost ~15%).
    fused: validation, RESOLVE, the zero-copy miss fetch, the newest token's
      writes and the metadata commit of a layer in two Pallas kernels
      (``pallas_kernels/fused_resolve``) instead of ~40 XLA ops; on the CPU in one
      native call per layer (``fused_resolve/native.py``, built on first use;
      ``interpret=True`` runs the Pallas kernels interpreted instead, as does a
      machine without a C++ compiler, with a warning); ``resolve``, ``fetch``
      and ``lookup`` are then unused. Every policy (a keyed one adds a
      victim-key kernel, natively XLA's key, and one XLA sort per row), index
      sharing (the commit kernel fetches for the sharing layers too) and the
      lookahead prefetch; not the overlapped attention or a mesh.
    fetch_stream: with ``overlap_hit_miss`` and the zero-copy fetch, gather the
      misses into a staging buffer with a kernel on CUDA stream N (an async call,
      ``fetch.on_stream``; XLA schedules the attention over the resident rows
      between its start and done); the rows then go to their slots as the
      host-gather path's do. Interpreted (off GPU) the same staging kernel runs
      inline. None: the in-place zero-copy fetch.
    slice_layer_inputs: ``decode_step`` slices each layer's inputs (q / k / v,
      the layer index, x) as ``lax.scan`` does, which splits a layer's CUDA graph
      (``kvtier_jax/layer_scan.py``), instead of picking them; for measuring that
      split on a device. Always so with ``fetch_stream``.
  """

  resolve: str = "auto"
  attention: str = "auto"
  fetch: str = "auto"
  lookup: str = "auto"
  interpret: bool | None = None
  fetch_chunk: int | None = None
  fused: bool = False
  fetch_stream: int | None = None
  slice_layer_inputs: bool = False

  def __post_init__(self):
    for name in ("resolve", "attention", "fetch"):
      common.check_impl(getattr(self, name))
    if self.lookup not in ("auto",) + lookup.METHODS:
      raise ValueError(f"{self.lookup=} must be 'auto' or one of {lookup.METHODS}")
    if self.fetch_chunk is not None and self.fetch_chunk < 1:
      raise ValueError(f"{self.fetch_chunk=} must be >= 1 (or None)")
    if self.fetch_stream is not None and (self.fetch_stream < 0 or self.fetch == "xla"):
      raise ValueError(f"{self.fetch_stream=} needs a stream id >= 0 and the zero-copy "
                       f"fetch (fetch='pallas' or 'auto'), got fetch={self.fetch!r}")

  @classmethod
  def every(cls, impl: str, **kw) -> "ImplConfig":
    """The same implementation for resolve, attention and fetch."""
    return cls(resolve=impl, attention=impl, fetch=impl, **kw)


@dataclasses.dataclass(frozen=True)
class TierConfig:
  """Shapes and behaviour of one tiered cache (glossary: shapes.py).

  Attributes:
    num_layers: L, layers with a tiered cache.
    num_requests: R, request slots decoded together.
    max_len: T, positions per request (the longest context a request may reach).
    num_q_heads / num_kv_heads / head_dim: Hq, Hkv, D.
    hot_slots: B, regular hot slots per (layer, request, unit); ``B >= top_k``.
    top_k: k, positions attended per (layer, request, unit) and step.
    per_kv_head: one cache unit per KV head (U = Hkv) instead of per request.
    dtype: KV dtype (host tier and hot cache); bf16, as served.
    page_size: Pg, positions per host page. The host tier is a pool of pages; a
      request's page table maps its logical pages to physical ones.
    host_pages: NH, pages in the host pool. None: every request slot owns the
      pages of ``max_len`` positions (a fixed batch); the serving engine sizes the
      pool by a host budget and hands pages out as requests grow.
    warm_start: hot-cache content after a prefill longer than B: ``"first"``
      (positions 0..B-1, SGLang CUDA), ``"head_tail"`` (first B//2 and last
      B - B//2, SGLang NPU) or ``"empty"`` (the first decode step misses all).
    index_share: N layers per selection (IndexShare / IndexCache): only every
      N-th layer (the anchor) selects and resolves; it also fetches the misses of
      the N - 1 layers after it, whose metadata stays in lockstep.
    overlap_hit_miss: attend over resident rows while the misses are fetched,
      then over the misses, merged by log-sum-exp (exact to f32 rounding).
    lookahead_cap: rows per (layer, request, unit) a lookahead may fetch ahead of
      need (a ``prefetch`` of predicted positions, or an uncommitted draft
      pass); None: no cap.
    policy: the replacement policy (a name or a ``PolicyConfig``).
    impl: the implementations (an ``ImplConfig``, or one name for every op).
    mesh_axes: the mesh axes this (per-device) step runs sharded over, inside
      ``shard_map`` (sharding.py): each layer agrees its refusal status over them
      before it writes, so a refusal anywhere stops every device's writes, as on one
      device. () off a mesh.
    row_tile: the XLA attention runs over tiles of this many requests
      (batch_invariance.py), so a request's outputs do not depend on R; with the
      model's ``decode_row_tile`` the whole step's. None: over all R at once (the
      kernels run a program per request either way).
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
  dtype: Any = jnp.bfloat16
  page_size: int = 64
  host_pages: int | None = None
  warm_start: str = "head_tail"
  index_share: int = 1
  overlap_hit_miss: bool = False
  lookahead_cap: int | None = None
  policy: PolicyConfig = PolicyConfig()
  impl: ImplConfig = ImplConfig()
  mesh_axes: tuple[str, ...] = ()
  row_tile: int | None = None

  def __post_init__(self):
    if isinstance(self.policy, str):
      object.__setattr__(self, "policy", PolicyConfig(self.policy))
    if isinstance(self.impl, str):
      object.__setattr__(self, "impl", ImplConfig.every(self.impl))
    for name in ("num_layers", "num_requests", "max_len", "num_q_heads",
                 "num_kv_heads", "head_dim", "hot_slots", "top_k", "index_share",
                 "page_size"):
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
    if self.host_pages is not None and self.host_pages < 1:
      raise ValueError(f"host_pages={self.host_pages} must be >= 1 (or None)")
    if self.warm_start not in WARM_STARTS:
      raise ValueError(f"{self.warm_start=} must be one of {WARM_STARTS}")
    if self.num_layers % self.index_share:
      raise ValueError(f"index_share={self.index_share} must divide "
                       f"num_layers={self.num_layers}")
    if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
      raise ValueError(f"dtype={self.dtype} must be a floating KV dtype (K/V are cast)")
    if isinstance(self.mesh_axes, str) or not all(isinstance(a, str) for a in self.mesh_axes):
      raise ValueError(f"mesh_axes={self.mesh_axes!r} must be a tuple of axis names")
    if self.lookahead_cap is not None and self.lookahead_cap < 0:
      raise ValueError(f"{self.lookahead_cap=} must be >= 0 (or None)")
    if self.row_tile is not None and self.row_tile <= 0:
      raise ValueError(f"{self.row_tile=} must be positive (or None)")
    if self.policy.keyed and self.impl.resolve == "pallas":
      raise ValueError(f"the {self.policy.name} policy has no Pallas RESOLVE kernel: "
                       "impl.resolve='xla'")
    if self.head_dim & (self.head_dim - 1):
      self._kernels_off_for_head_dim()
    if self.impl.fetch_stream is not None and not self.overlap_hit_miss:
      raise ValueError("impl.fetch_stream overlaps the miss fetch with the attention "
                       "over resident rows: it needs overlap_hit_miss=True")
    if self.impl.fused:
      self._check_fused()

  def _kernels_off_for_head_dim(self):
    """The Pallas fetch and attention kernels load rows as power-of-2 blocks of
    head_dim: "auto" takes XLA for them (on a GPU it would pick the kernels and
    fail at trace time); asking for a kernel is refused here."""
    asked = [op for op in ("fetch", "attention") if getattr(self.impl, op) == "pallas"]
    if asked or self.impl.fetch_stream is not None:
      raise ValueError(f"head_dim={self.head_dim} is not a power of 2: the Pallas "
                       f"{asked or ['fetch']} kernels (and fetch_stream) need one")
    object.__setattr__(self, "impl", dataclasses.replace(self.impl, fetch="xla",
                                                         attention="xla"))

  def _check_fused(self):
    unsupported = {"overlap_hit_miss": self.overlap_hit_miss,
                   "a mesh (mesh_axes)": bool(self.mesh_axes)}
    for what, present in unsupported.items():
      if present:
        raise ValueError(f"the fused layer kernels (impl.fused) do not support {what}")
    if self.head_dim & (self.head_dim - 1):
      raise ValueError(f"impl.fused needs a power-of-2 head_dim, got {self.head_dim}")
    # The position map has a column per selected lane, the rank table per ranked one.
    scratch = map_scratch_bytes(self.num_requests * self.num_units, self.max_len,
                                self.select_width)
    if scratch > lookup.MAP_SCRATCH_BYTES:
      raise ValueError(f"impl.fused's position map needs {scratch} bytes (> "
                       f"{lookup.MAP_SCRATCH_BYTES}): use the unfused path")

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
    return max(self.top_k, self.policy.rank_depth)

  @property
  def row_bytes(self) -> int:
    """Bytes of one row (one position, one unit) of K *or* V."""
    return self.heads_per_unit * self.head_dim * jnp.dtype(self.dtype).itemsize

  @property
  def pages_per_request(self) -> int:  # MP: a page table row
    return -(-self.max_len // self.page_size)

  @property
  def num_host_pages(self) -> int:  # NH; page NH is the scratch page
    if self.host_pages is None:
      return self.num_requests * self.pages_per_request
    return self.host_pages

  @property
  def page_bytes(self) -> int:
    """Host bytes of one page: K and V of Pg positions, every layer."""
    return 2 * self.num_layers * self.page_size * self.num_units * self.row_bytes

  @property
  def fetch_rows_per_chunk(self) -> int:
    """Rows per gather of the staged XLA fetch (``fetch.gather_misses``: a GPU's,
    and the overlapped attention's everywhere); off GPU by default every lane,
    one gather with no loop or staging buffer."""
    lanes = self.num_requests * self.num_units * self.top_k
    if self.impl.fetch_chunk is None and not common.on_gpu():
      return lanes
    return min(self.impl.fetch_chunk or max(16, self.top_k // 8), lanes)

  @property
  def direct_fetch_rows_per_chunk(self) -> int:
    """Rows per gather + scatter of the direct XLA fetch off GPU
    (``fetch.fetch_misses``); by default an eighth of the layer's lanes."""
    lanes = self.num_requests * self.num_units * self.top_k
    return min(self.impl.fetch_chunk or max(16, lanes // 8), lanes)

  @property
  def use_interpret(self) -> bool:
    return common.interpret_mode() if self.impl.interpret is None else self.impl.interpret

  # Memory accounting (bytes) -------------------------------------------------
  def host_bytes_per_request(self, length: int | None = None) -> int:
    """Host bytes a request of ``length`` positions (default ``max_len``) holds:
    its positions rounded up to whole pages."""
    length = self.max_len if length is None else length
    return -(-length // self.page_size) * self.page_bytes

  def device_bytes_per_request(self) -> int:
    """Hot K+V plus slot_pos/lru/slot_score metadata, per request (selector state
    excluded)."""
    hot = 2 * self.num_layers * self.num_units * (self.hot_slots + 1) * self.row_bytes
    meta = 3 * self.num_layers * self.num_units * self.hot_slots * 4
    return hot + meta

  def check_step_inputs(self, q, k_new, v_new, per_layer: bool = False) -> None:
    """Trace-time: q [L, R, Hq, D] and k_new / v_new [L, R, Hkv, D] (without L
    ``per_layer``). Another head count would regroup the queries silently."""
    lead = () if per_layer else (self.num_layers,)
    want_q = (*lead, self.num_requests, self.num_q_heads, self.head_dim)
    want_kv = (*lead, self.num_requests, self.num_kv_heads, self.head_dim)
    if q.shape != want_q or k_new.shape != want_kv or v_new.shape != want_kv:
      raise ValueError(f"q / k_new / v_new have shapes {q.shape} / {k_new.shape} / "
                       f"{v_new.shape}, expected {want_q} / {want_kv} / {want_kv}")

  def replace(self, **changes) -> "TierConfig":
    return dataclasses.replace(self, **changes)
