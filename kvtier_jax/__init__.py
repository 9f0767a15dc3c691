"""kvtier_jax: host-authoritative KV, device hot cache, exact RESOLVE, jitted decode."""

# Configuration and state
from kvtier_jax.config import ImplConfig, TierConfig
from kvtier_jax.policies import PolicyConfig
from kvtier_jax.state import TieredKVState, cache_stats, init_state
# Cache resolution
from kvtier_jax.resolve import ResolveOutputs, install_newest, resolve, resolve_with_policy
# The tiered step and its host driver
from kvtier_jax.decode import (TieredCarry, commit_step, decode_step, finish_draft,
                               init_carry, prefill, tiered_attend)
from kvtier_jax.driver import StepRefused, TieredDecoder, TieredDriver
from kvtier_jax import selectors

__all__ = [
    "ImplConfig", "PolicyConfig", "TierConfig", "TieredKVState", "cache_stats",
    "init_state", "ResolveOutputs", "install_newest", "resolve", "resolve_with_policy",
    "TieredCarry", "commit_step", "decode_step", "finish_draft", "init_carry", "prefill",
    "tiered_attend", "StepRefused", "TieredDecoder", "TieredDriver", "selectors",
]
