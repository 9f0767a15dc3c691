from pallas_kernels.cache_resolve.kernel import cache_resolve
from pallas_kernels.cache_resolve.reference import (ResolveOutputs, cache_resolve_reference,
                                                    install_newest)
