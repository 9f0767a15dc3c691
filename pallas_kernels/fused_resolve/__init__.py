from pallas_kernels.fused_resolve.config import BlockSizes
from pallas_kernels.fused_resolve.kernel import resolve_fetch
from pallas_kernels.fused_resolve.reference import (CacheArrays, LayerResult,
                                                    map_scratch_bytes,
                                                    resolve_fetch_reference)
