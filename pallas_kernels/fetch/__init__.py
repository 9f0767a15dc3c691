from pallas_kernels.fetch.config import BlockSizes
from pallas_kernels.fetch.kernel import fetch_rows, gather_rows, gather_rows_call
from pallas_kernels.fetch.reference import fetch_rows_reference, gather_rows_reference
