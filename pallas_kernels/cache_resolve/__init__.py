from pallas_kernels.cache_resolve.reference import (ResolveOutputs,
                                                   cache_resolve_freq_reference,
                                                   cache_resolve_keyed_reference,
                                                   cache_resolve_reference)
