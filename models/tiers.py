"""Tier economics: what a concurrent long-context request and a million decoded
tokens cost when the authoritative KV lives in HBM, host DDR5, CXL-attached DDR4 or
NVMe, and where each link's bandwidth starts to bound the decode step.

Per accelerator: its price buys the HBM that holds the per-request device state
(full KV, or the hot cache + metadata + selector state) up to a KV budget; the
tier below holds each request's full KV (less what requests share through the
prefix cache) at that tier's price per GB, up to its capacity; every decode step
moves each request's misses over that tier's link (the throughput roofline of
``models.capacity.ThroughputModel``). The system's price over its amortisation
period, divided by the concurrency it reaches and the tokens it decodes, gives
the cost per concurrent request and per million tokens.
"""

from __future__ import annotations

import dataclasses

from models import capacity
from models.config import ModelConfig

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Tier:
  """A memory tier below the accelerator."""

  name: str
  usd_per_gb: float
  link_gbps: float  # GB/s from the tier to the accelerator (the miss fetch's link)
  latency_us: float  # extra latency of one dependent access
  gb_per_accelerator: float  # capacity one accelerator can use
  source: str  # where the figures come from
  iops: float | None = None  # random reads/s (block devices; None: byte-addressable)
  block_bytes: int = 4096  # a random read's size on a block device

  def replace(self, **kw) -> "Tier":
    return dataclasses.replace(self, **kw)

  def miss_bandwidth(self, row_bytes: int) -> float:
    """Useful bytes/s of scattered ``row_bytes`` miss reads: the link rate, or on a
    block device the IOPS times the row (each row costs a whole block read)."""
    rate = self.link_gbps * GB
    if self.iops:
      rate = min(rate, self.iops * row_bytes, self.link_gbps * GB * row_bytes /
                 max(row_bytes, self.block_bytes))
    return rate


# Defaults: each figure's source in ``source``; all are flags of experiments.tiers.
TIERS = {
    "ddr5": Tier(
        "host DDR5", usd_per_gb=12.0, link_gbps=54.0, latency_us=0.0,
        gb_per_accelerator=256.0,
        source="54 GB/s: the zero-copy miss fetch measured on an H200 over PCIe Gen5 "
        "(WORKSPACE_NOTES.md, GPU runs 4-5); $12/GB: ~$4/GB DDR5 RDIMM in 2023 x ~3 "
        "(DRAM ~3x since late 2023 per SemiAnalysis, Aug 2026; DDR5 contract "
        "prices doubled, industry reports Sep 2026; the $4 base is assumed); 2 TB per 8-GPU node"),
    "cxl_ddr4": Tier(
        "CXL DDR4 (Vistara)", usd_per_gb=3.0, link_gbps=38.4, latency_us=0.05,
        gb_per_accelerator=512.0,
        source="Meta's Vistara (SemiAnalysis, Aug 2026): a CXL 2.0 Type-3 expander bridging 2 "
        "channels of DDR4-2400 (2 x 19.2 = 38.4 GB/s) over PCIe 5.0 x16 (64 GB/s), "
        "128 GB per chip from recycled 32 GB DIMMs, ~50 ns idle round trip; price "
        "assumed $3/GB all-in (recycled DIMMs ~$1/GB plus the expander and board); "
        "4 TB per 8-GPU node assumed"),
    "nvme": Tier(
        "NVMe SSD", usd_per_gb=0.08, link_gbps=7.0, latency_us=80.0,
        gb_per_accelerator=4000.0, iops=1.5e6,
        source="PCIe 4.0 x4 drive: ~7 GB/s sequential read, ~1.5M random 4 KiB reads/s, "
        "~80 us access, ~$0.08/GB (assumed retail); 32 TB per node; a miss row "
        "(~1 KiB) costs a 4 KiB read"),
}


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str = "H200"
  usd: float = 32000.0  # assumed street price of one H200 (with its share of the node)
  hbm_bandwidth: float = 4.8e12  # bytes/s
  kv_budget_gb: float = 30.0  # HBM left for KV after weights (8 x H200, GLM-5.1 FP8)
  weight_bytes: float = 750e9 / 8  # read once per step
  max_batch: int = 64
  years: float = 4.0  # amortisation period


def placement(cfg: ModelConfig, context: int, acc: Accelerator, tier: Tier | None, *,
              hot_slots: int, miss_rate: float, shared_fraction: float = 0.0,
              exposed_io: float = 1.0) -> dict:
  """One placement at ``context`` tokens: ``tier`` None keeps the full KV in HBM
  (sparse attention over the full KV); else the tiered cache over ``tier``.
  ``shared_fraction``: the part of a request's KV every other running request
  shares (one prefix in the prefix cache): each request holds the rest, and the
  shared part is held once, where the KV lives (``shared_GB``)."""
  b = capacity.request_bytes(cfg, context, hot_slots)
  unique = 1.0 - shared_fraction
  if tier is None:
    device, below, link, miss = b.full_device, 0.0, None, None
    shared = shared_fraction * b.full_kv  # a radix cache in HBM shares too
    device -= shared
    room = {"HBM": acc.kv_budget_gb * GB - shared}
  else:
    device, below = b.tiered_device, unique * b.host
    shared = shared_fraction * b.host
    link = tier.miss_bandwidth(cfg.kv_bytes_per_token_per_layer)
    miss = miss_rate if context > hot_slots else 0.0
    room = {"HBM": acc.kv_budget_gb * GB, tier.name: tier.gb_per_accelerator * GB - shared}
  per_request = {"HBM": device, **({} if tier is None else {tier.name: below})}
  bounds = {"batch": acc.max_batch}
  for where, left in room.items():
    if left < 0:  # the shared copy alone does not fit
      bounds[where] = 0
    elif per_request[where] > 0:  # every prefix shared: the tier bounds nothing more
      bounds[where] = int(left // per_request[where])
  bound = min(bounds, key=bounds.get)
  batch = bounds[bound]
  model = capacity.ThroughputModel(hbm_bandwidth=acc.hbm_bandwidth,
                                   link_bandwidth=link or 1.0,
                                   weight_bytes=acc.weight_bytes, exposed_io=exposed_io)
  tokens_s = model.tokens_per_second(cfg, batch, miss, context=context)
  system_usd = acc.usd + (0.0 if tier is None else
                          (batch * below + shared) / GB * tier.usd_per_gb)
  seconds = acc.years * 365 * 24 * 3600
  row = dict(context=context, placement="HBM (full KV)" if tier is None else
             f"HBM hot + {tier.name}", device_GB=device / GB, below_GB=below / GB,
             shared_GB=shared / GB,
             requests=batch, bound=bound, tok_s=tokens_s, system_usd=system_usd,
             usd_per_request=system_usd / batch if batch else None,
             usd_per_mtok=(system_usd / seconds) / tokens_s * 1e6 if tokens_s else None)
  row["link_bound_batch"] = None
  if tier is not None and miss:
    row["link_bound_batch"] = link_bound_batch(cfg, acc, link, miss, exposed_io,
                                               context=context)
  return row


def link_bound_batch(cfg: ModelConfig, acc: Accelerator, link_bandwidth: float,
                     miss_rate: float, exposed_io: float = 1.0, *, context: int) -> float:
  """The batch above which a step's exposed miss traffic takes longer than its HBM
  reads (weights once + per request k rows and the selector's scan of its
  ``context``): the link bounds the step (inf: never)."""
  read = capacity.rows_read(cfg)
  io = exposed_io * miss_rate * read / link_bandwidth  # seconds per request
  hbm = (read + capacity.selector_scan(cfg, context)) / acc.hbm_bandwidth
  if io <= hbm:
    return float("inf")
  return (acc.weight_bytes / acc.hbm_bandwidth) / (io - hbm)


def load_or_recompute(cfg: ModelConfig, tier: Tier, prefix_tokens: int,
                      prefill_tok_s: float) -> dict:
  """A cached prefix of ``prefix_tokens`` on ``tier``: seconds to load it back vs
  to recompute it, and the link bandwidth where the two are equal."""
  per_token = cfg.num_layers * cfg.kv_bytes_per_token_per_layer
  load = prefix_tokens * per_token / (tier.link_gbps * GB) + tier.latency_us * 1e-6
  recompute = prefix_tokens / prefill_tok_s
  return dict(tier=tier.name, prefix_tokens=prefix_tokens, load_s=load,
              recompute_s=recompute, load_wins=load < recompute,
              breakeven_gbps=per_token * prefill_tok_s / GB)
