"""Selectors name the positions each layer attends (-1 padding).

Every selector implements the ``Selector`` protocol of ``base.py``: per layer and
step, ``select(state, layer, StepInputs, params) -> (positions i32[R, U, k], state)``,
with resident state (page bounds, index keys, compressed keys) threaded through the
layer scan. Quest, DSA and NSA are the sparse-attention rules; the oracle top-k is
for analysis; ``ChurnSelector`` and ``GivenSelector`` drive tests and benchmarks.
"""

from kvtier_jax.selectors.base import (PrefillInputs, Selector, StepInputs,
                                       blocks_to_positions, layer_slice, layer_update,
                                       masked_top_k, prefill_state)
from kvtier_jax.selectors.dsa import (DSASelector, DSAState, IndexerParams, index_keys,
                                      index_query, index_scores, init_indexer_params)
from kvtier_jax.selectors.nsa import (NSASelector, NSAState, nsa_attention_reference,
                                      window_union)
from kvtier_jax.selectors.oracle import OracleSelector, OracleState
from kvtier_jax.selectors.quest import QuestSelector, QuestState
from kvtier_jax.selectors.synthetic import ChurnSelector, GivenSelector

__all__ = [
    "ChurnSelector", "GivenSelector",
    "Selector", "StepInputs", "PrefillInputs", "blocks_to_positions", "layer_slice",
    "layer_update", "masked_top_k", "prefill_state",
    "QuestSelector", "QuestState",
    "DSASelector", "DSAState", "IndexerParams", "init_indexer_params", "index_query",
    "index_keys", "index_scores",
    "NSASelector", "NSAState", "nsa_attention_reference", "window_union",
    "OracleSelector", "OracleState",
]
