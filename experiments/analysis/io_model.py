"""Exposed host IO per decode step: one model for every runner that needs it.

A synchronous tiered step moves each layer's misses over the host link before that
layer attends: ``misses x row bytes / bandwidth`` plus a fixed per-call latency per
layer; a mechanism that overlaps part of a layer's fetch with other work hides up
to ``hidden_s_per_layer`` of it. Defaults: the zero-copy fetch measured on an H200
(54 GB/s over PCIe Gen5, WORKSPACE_NOTES.md) and GH200's NVLink-C2C (~450 GB/s).
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Link:
  bandwidth: float  # bytes/s
  latency: float  # s per layer call

  @classmethod
  def parse(cls, spec: str) -> tuple[str, "Link"]:
    """``name:GB/s:latency_us`` -> (name, Link)."""
    name, gbps, latency_us = spec.split(":")
    return name, cls(float(gbps) * 1e9, float(latency_us) * 1e-6)


LINKS = {"h200_pcie5": Link(54e9, 20e-6), "gh200_c2c": Link(450e9, 5e-6)}


def miss_bytes_per_layer(cfg: ModelConfig, batch: int, miss_rate: float) -> float:
  """Bytes one layer fetches per step: batch x miss rate x k rows."""
  return batch * miss_rate * cfg.top_k * cfg.kv_bytes_per_token_per_layer


def exposed_io_ms(cfg: ModelConfig, batch: int, miss_rate: float, link: Link,
                  hidden_s_per_layer: float = 0.0, fetching_layers: int | None = None
                  ) -> float:
  """Milliseconds of host IO on the critical path of one decode step, over the
  ``fetching_layers`` (default: every layer) that fetch on it at ``miss_rate``."""
  layer_s = (miss_bytes_per_layer(cfg, batch, miss_rate) / link.bandwidth + link.latency
             - hidden_s_per_layer)
  layers = cfg.num_layers if fetching_layers is None else fetching_layers
  if not 0 <= layers <= cfg.num_layers:
    raise ValueError(f"fetching_layers={layers} outside [0, {cfg.num_layers}]")
  return 1e3 * layers * max(0.0, layer_s)
