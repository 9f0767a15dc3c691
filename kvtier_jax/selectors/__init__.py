"""Selectors name the positions each layer attends (-1 padding).

Two forms coexist. The decode step takes a function ``select(q, ctx) -> i32[R, U, k]``
(the synthetic ones here, or ``given_selection`` fed precomputed positions). The
sparse-attention rules (Quest, DSA, NSA, and the analysis-only oracle) implement the
``Selector`` protocol of ``base.py``: they keep resident state (page bounds, index
keys, compressed keys) that a model's layer scan threads through ``select``.
"""

from kvtier_jax.selectors.base import (PrefillInputs, Selector, StepInputs,
                                       blocks_to_positions, layer_slice, layer_update,
                                       masked_top_k)
from kvtier_jax.selectors.dsa import (DSASelector, DSAState, IndexerParams, index_keys,
                                      index_query, index_scores, init_indexer_params)
from kvtier_jax.selectors.nsa import (NSASelector, NSAState, nsa_attention_reference,
                                      window_union)
from kvtier_jax.selectors.oracle import OracleSelector, OracleState
from kvtier_jax.selectors.quest import QuestSelector, QuestState
from kvtier_jax.selectors.synthetic import churn_selector, given_selection

__all__ = [
    "churn_selector", "given_selection",
    "Selector", "StepInputs", "PrefillInputs", "blocks_to_positions", "layer_slice",
    "layer_update", "masked_top_k",
    "QuestSelector", "QuestState",
    "DSASelector", "DSAState", "IndexerParams", "init_indexer_params", "index_query",
    "index_keys", "index_scores",
    "NSASelector", "NSAState", "nsa_attention_reference", "window_union",
    "OracleSelector", "OracleState",
]
