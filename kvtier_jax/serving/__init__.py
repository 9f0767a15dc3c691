"""Serving: continuous batching of requests over a ``ServingModel`` (engine.py)."""

from kvtier_jax.serving.engine import Engine, EngineConfig, percentiles
from kvtier_jax.serving.model import ServingModel
from kvtier_jax.serving.pages import PagePool
from kvtier_jax.serving.request import Metrics, Request, SamplingParams, State

__all__ = ["Engine", "EngineConfig", "percentiles", "ServingModel", "PagePool", "Metrics",
           "Request", "SamplingParams", "State"]
