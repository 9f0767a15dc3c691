from pallas_kernels.fetch.config import BlockSizes
from pallas_kernels.fetch.kernel import fetch_rows
from pallas_kernels.fetch.reference import fetch_rows_reference
