"""Per-request memory of full-KV vs tiered decoding, and what fits a device budget.

The tier's arrays are counted as this project allocates them (kvtier_jax.state):
a hot cache of ``B + 1`` rows per layer (slot B holds the newest token), int32
``slot_pos`` and ``lru`` and a float32 ``slot_score`` per slot and selection unit.
The host tier holds every position, in whole pages (the pool's one scratch page is
not per request). The selector's resident state, which grows with the context and
is never offloaded (docs/DESIGN.md, "Invariants"), is the preset's as its paper
keeps it (``ModelConfig.selector_bytes_per_token_per_layer``: model dtype, no
rings); this project's selectors keep f32 state and say what they hold with
``kvtier_jax.selectors.state_bytes``, which the serving engine's admission charges.
"""

from __future__ import annotations

import dataclasses
import math

from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RequestBytes:
  """Bytes one request of ``context`` tokens keeps where."""

  context: int
  full_kv: int  # device, full-KV decoding (KV only)
  selector_state: int  # device, both ways (indexer keys / page summaries)
  hot_kv: int  # device, tiered: B + 1 rows per layer
  metadata: int  # device, tiered: slot_pos + lru (int32) + slot_score (f32)
  host: int  # host tier: the context rounded up to whole pages

  @property
  def full_device(self) -> int:
    return self.full_kv + self.selector_state

  @property
  def tiered_device(self) -> int:
    return self.hot_kv + self.metadata + self.selector_state

  @property
  def reduction(self) -> float:
    return self.full_device / self.tiered_device


def request_bytes(cfg: ModelConfig, context: int, hot_slots: int,
                  page_size: int = 64, units: int = 1) -> RequestBytes:
  """``units``: selections per request and layer, 1 (DSA, SGLang's Quest) or the KV
  heads (original Quest, NSA): each unit has its own B slots of metadata; the hot
  rows are the same bytes, split by head."""
  row = cfg.kv_bytes_per_token_per_layer
  layers = cfg.num_layers
  return RequestBytes(
      context=context,
      full_kv=layers * context * row,
      selector_state=math.ceil(layers * context * cfg.selector_bytes_per_token_per_layer),
      hot_kv=layers * (hot_slots + 1) * row,
      metadata=layers * units * hot_slots * 3 * 4,
      host=layers * -(-context // page_size) * page_size * row,  # whole pages
  )


def concurrency(budget_bytes: float, per_request: int, max_batch: int) -> int:
  """Requests that fit a device KV budget (capped by the serving batch limit)."""
  return int(min(max_batch, budget_bytes // per_request))


# Weight bytes every decode step reads, over all devices: GLM-5.1 in FP8 (~750B
# parameters, the paper's deployment), DeepSeek-V3.2 in FP8 (671B), Qwen3-30B-A3B in
# BF16 (30.5B), SmolLM2-135M in f32 (our port).
WEIGHT_BYTES = {"glm_5_1": 750e9, "deepseek_v3_2": 671e9, "qwen3_30b_a3b": 30.5e9 * 2,
                "smollm2_135m": 134.5e6 * 4}


def weight_bytes_per_device(name: str, devices: int = 8) -> float:
  """A preset's weights over ``devices`` (tensor / expert parallel)."""
  if name not in WEIGHT_BYTES:
    raise ValueError(f"no weight size for {name!r}; known: {sorted(WEIGHT_BYTES)}")
  return WEIGHT_BYTES[name] / devices


@dataclasses.dataclass(frozen=True)
class ThroughputModel:
  """Per-device roofline decode throughput (every request lives on one device, as
  with DP attention; each device has its own host link).

  One step reads the device's weights once (shared by its batch) and, per
  request, from HBM the k selected rows of every layer and the selector's state
  over the whole context (the DSA indexer keys, Quest's page bounds: scanned every
  step and layer to pick the k); the tiered cache adds each miss's host->device
  copy, of which ``exposed_io`` is on the critical path (1 = synchronous fetch;
  prefetch hides the rest). Tokens/s = batch / step.
  """

  hbm_bandwidth: float = 4.8e12  # bytes/s, H200
  link_bandwidth: float = 54e9  # bytes/s, PCIe Gen5 zero-copy as measured here
  weight_bytes: float = 750e9 / 8  # per device (GLM-5.1 FP8 over 8 GPUs)
  exposed_io: float = 1.0  # fraction of miss traffic on the critical path

  def step_seconds(self, cfg: ModelConfig, batch: int, miss_rate: float | None, *,
                   context: int) -> float:
    """One decode step of ``batch`` requests of ``context`` tokens each."""
    rows = rows_read(cfg)
    t = (self.weight_bytes + batch * (rows + selector_scan(cfg, context))) \
        / self.hbm_bandwidth
    if miss_rate:
      t += self.exposed_io * batch * miss_rate * rows / self.link_bandwidth
    return t

  def tokens_per_second(self, cfg: ModelConfig, batch: int, miss_rate: float | None, *,
                        context: int) -> float:
    return (batch / self.step_seconds(cfg, batch, miss_rate, context=context)
            if batch else 0.0)


def rows_read(cfg: ModelConfig) -> int:
  """KV bytes one request's step attends to: k rows in every layer."""
  if cfg.top_k <= 0:
    raise ValueError(f"{cfg.name} attends every token (top_k={cfg.top_k}): the "
                     "roofline models sparse attention")
  return cfg.num_layers * cfg.top_k * cfg.kv_bytes_per_token_per_layer


def selector_scan(cfg: ModelConfig, context: int) -> float:
  """Selector-state bytes one request's step reads to pick its k rows: every
  position's (DSA's indexer key; Quest's page bounds, per token), every layer."""
  if context < 1:
    raise ValueError(f"{context=} must be >= 1")
  return cfg.num_layers * context * cfg.selector_bytes_per_token_per_layer
