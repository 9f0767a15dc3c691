from pallas_kernels.fused_resolve.config import BlockSizes
from pallas_kernels.fused_resolve.kernel import (keyed_victim_order, resolve_fetch,
                                                 victim_order)
from pallas_kernels.fused_resolve.reference import (CacheArrays, LayerResult,
                                                    effective_slot_pos,
                                                    map_scratch_bytes,
                                                    resolve_fetch_reference,
                                                    updated_score, victim_key_reference)
