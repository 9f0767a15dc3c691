from pallas_kernels.sparse_decode_attention.config import BlockSizes
from pallas_kernels.sparse_decode_attention.kernel import sparse_decode_attention
from pallas_kernels.sparse_decode_attention.reference import (
    attend_rows, gather_slots, group_queries, merge_partials,
    sparse_decode_attention_reference)
