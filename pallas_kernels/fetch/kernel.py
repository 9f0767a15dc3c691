"""Zero-copy miss fetch: kernels that read missed rows from the host tier itself.

``fetch_rows`` copies them into their hot-cache slots in place; ``gather_rows``
writes them to a small staging buffer instead, so that it can run on a second
stream while attention reads the hot cache (a kernel writing the hot cache in
place cannot overlap a reader of it without a copy of the whole cache).

On a GPU the host tier is a ``pinned_host`` buffer, which XLA hands to the Triton
custom call without a copy (docs/DESIGN.md, "Host memory in XLA"); under unified virtual
addressing the kernel's loads then travel over PCIe / NVLink-C2C directly, and
exactly the missed rows move. Grid: one program per ``block_rows`` lanes of the
compacted plan; programs past the miss count return at once. Lanes past the count
inside the last busy block repeat the last valid lane (the same value to the same
place), so no load or store needs a mask. Host tiers over 4 GiB are fine: Pallas
Triton computes pointer offsets in 64 bits for such arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.fetch.config import BlockSizes


def _fetch_kernel(src_ref, dest_ref, count_ref, host_k_ref, host_v_ref, _hot_k_in,
                  _hot_v_in, hot_k_ref, hot_v_ref, *, block_rows, heads, head_dim):
  # src_ref, dest_ref: i32[N, 4]; count_ref: i32[1]
  # host_*_ref: [L, NH+1, Pg, U, Hg, D] (host memory on GPU)
  # hot_*_ref:  [L, R, U, S, Hg, D] (aliased to the _hot_*_in inputs)
  first = pl.program_id(0) * block_rows
  count = count_ref[0]

  @pl.when(first < count)
  def _copy():
    lane = jnp.minimum(first + jnp.arange(block_rows), count - 1)  # [bR]
    col = lambda ref, j: ref[lane, j][:, None]  # [bR, 1]
    sl, sr, sp, su = (col(src_ref, j) for j in range(4))
    dl, dr, du, ds = (col(dest_ref, j) for j in range(4))
    d = jnp.arange(head_dim)[None, :]  # [1, D]
    for h in range(heads):
      hot_k_ref[dl, dr, du, ds, h, d] = host_k_ref[sl, sr, sp, su, h, d]
      hot_v_ref[dl, dr, du, ds, h, d] = host_v_ref[sl, sr, sp, su, h, d]


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"),
                   donate_argnums=(5, 6))
def fetch_rows(src, dest, count, host_k, host_v, hot_k, hot_v, *,
               block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
  """Same contract as ``fetch_rows_reference``; updates hot_k/hot_v in place."""
  heads, head_dim = hot_k.shape[-2:]
  if head_dim & (head_dim - 1):
    raise ValueError(f"{head_dim=} must be a power of 2 for the fetch kernel")
  bs = block_sizes
  whole = pl.no_block_spec
  kernel = functools.partial(_fetch_kernel, block_rows=bs.block_rows, heads=heads,
                             head_dim=head_dim)
  return pl.pallas_call(
      kernel,
      grid=(common.cdiv(src.shape[0], bs.block_rows),),
      in_specs=[whole] * 7,
      out_specs=[whole, whole],
      out_shape=[jax.ShapeDtypeStruct(hot_k.shape, hot_k.dtype),
                 jax.ShapeDtypeStruct(hot_v.shape, hot_v.dtype)],
      input_output_aliases={5: 0, 6: 1},
      compiler_params=common.triton_params(bs.num_warps, 1),
      interpret=interpret,
      name="fetch_rows",
  )(src, dest, jnp.asarray(count, jnp.int32).reshape((1,)), host_k, host_v, hot_k,
    hot_v)


def _gather_kernel(src_ref, count_ref, host_k_ref, host_v_ref, rows_ref,
                   *, block_rows, heads, head_dim):
  # src_ref: i32[N, 4]; count_ref: i32[1]
  # host_*_ref: [L, NH+1, Pg, U, Hg, D] (host memory on GPU)
  # rows_ref: [2, N, Hg, D] staging rows, K then V; lanes >= count are left unwritten
  first = pl.program_id(0) * block_rows
  count = count_ref[0]

  @pl.when(first < count)
  def _copy():
    lane = first + jnp.arange(block_rows)  # [bR]; N is a multiple of bR
    read = jnp.minimum(lane, count - 1)
    col = lambda j: src_ref[read, j][:, None]  # [bR, 1]
    sl, sr, sp, su = (col(j) for j in range(4))
    out = jnp.where(lane < count, lane, read)[:, None]  # past count: repeat the last
    d = jnp.arange(head_dim)[None, :]  # [1, D]
    for h in range(heads):
      rows_ref[0, out, h, d] = host_k_ref[sl, sr, sp, su, h, d]
      rows_ref[1, out, h, d] = host_v_ref[sl, sr, sp, su, h, d]


def gather_rows_call(src, count, host_k, host_v, *, block_sizes: BlockSizes = BlockSizes(),
                     interpret: bool = False):
  """``gather_rows`` without its ``jax.jit``: for callers that must place the
  kernel directly inside their own jitted function (a ``compute_on`` stream)."""
  heads, head_dim = host_k.shape[-2:]
  if head_dim & (head_dim - 1):
    raise ValueError(f"{head_dim=} must be a power of 2 for the gather kernel")
  bs = block_sizes
  if src.shape[0] % bs.block_rows:
    raise ValueError(f"{src.shape[0]} lanes must be a multiple of {bs.block_rows=}")
  whole = pl.no_block_spec
  kernel = functools.partial(_gather_kernel, block_rows=bs.block_rows, heads=heads,
                             head_dim=head_dim)
  # One output, not a (K, V) pair: a call on its own CUDA stream that returns a
  # tuple gets each element's get-tuple-element wrapped in an async pair of its
  # own (XLA >= 0.11), and the scheduler then overlaps those, not the gather.
  rows = jax.ShapeDtypeStruct((2, src.shape[0], heads, head_dim), host_k.dtype)
  return pl.pallas_call(
      kernel,
      grid=(src.shape[0] // bs.block_rows,),
      in_specs=[whole] * 4,
      out_specs=whole,
      out_shape=rows,
      compiler_params=common.triton_params(bs.num_warps, 1),
      interpret=interpret,
      name="gather_rows",
  )(src, jnp.asarray(count, jnp.int32).reshape((1,)), host_k, host_v)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def gather_rows(src, count, host_k, host_v, *, block_sizes: BlockSizes = BlockSizes(),
                interpret: bool = False):
  """Same contract as ``gather_rows_reference`` on lanes < count (the others are
  left unwritten: never read them): rows [2, N, Hg, D], K then V."""
  return gather_rows_call(src, count, host_k, host_v, block_sizes=block_sizes,
                          interpret=interpret)
