"""Serving: continuous batching over a ``ServingModel`` (engine.py), the host page
pool and its prefix cache (pages.py, radix.py), a benchmark client (bench.py), and
engine replicas in processes behind a prefix-aware router (replica.py, router.py)."""

from kvtier_jax.serving.engine import Engine, EngineConfig
from kvtier_jax.serving.model import ServingModel
from kvtier_jax.serving.pages import PagePool
from kvtier_jax.serving.request import Metrics, Request, SamplingParams, State

__all__ = ["Engine", "EngineConfig", "ServingModel", "PagePool", "Metrics",
           "Request", "SamplingParams", "State"]
