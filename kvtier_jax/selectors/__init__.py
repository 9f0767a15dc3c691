"""Selectors: functions ``select(q, ctx) -> i32[R, U, k]`` naming the positions each
layer attends (-1 padding). Real sparse-attention selectors (Quest, DSA, NSA) plug
in here; this package also holds the synthetic ones used by tests and benchmarks.
"""

from kvtier_jax.selectors.synthetic import churn_selector, given_selection

__all__ = ["churn_selector", "given_selection"]
