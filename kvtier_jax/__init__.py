"""kvtier_jax: host-authoritative KV, device hot cache, exact RESOLVE, jitted decode."""

# Configuration and state
from kvtier_jax.config import TierConfig
from kvtier_jax.state import TieredKVState, cache_stats, init_state
# Cache resolution and the decode step
from kvtier_jax.resolve import ResolveOutputs, install_newest, resolve
from kvtier_jax.decode import (LayerPlan, SelectContext, StepRefused, TieredDecoder,
                               decode_step, prefill, tiered_layer, tiered_shared_layer)
from kvtier_jax import selectors

__all__ = [
    "TierConfig", "TieredKVState", "cache_stats", "init_state", "ResolveOutputs",
    "install_newest", "resolve", "LayerPlan", "SelectContext", "StepRefused",
    "TieredDecoder", "decode_step", "prefill", "tiered_layer", "tiered_shared_layer",
    "selectors",
]
