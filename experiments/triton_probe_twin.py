"""The probe kernel's numpy reference, and its twin in Pallas Triton
(``experiments.triton_probe``): the same algorithm as ``triton_probe_kernel.miss_fetch``,
so that a device can time the two languages on one kernel. No absl flags here: the
tests import it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common as kernel_common


def reference(sel, slot_of, host, pos, rows):
  """numpy: (pos, rows, count) after the kernel, from the poisoned ``pos``/``rows``."""
  pos, rows, count = pos.copy(), rows.copy(), 0
  for r in range(sel.shape[0]):
    missed = [s for s in sel[r] if s >= 0 and slot_of[r, s] < 0]
    pos[r, :len(missed)] = missed
    rows[r, :len(missed)] = host[r, missed]
    count += len(missed)
  return pos, rows, np.array([count], np.int32)


def draw_inputs(rng, rows, top_k, positions, head_dim):
  """(sel i32[R, K] with -1 padding, slot_of i32[R, P] half resident, host f32[R, P, D])."""
  sel = np.stack([rng.permutation(positions)[:top_k] for _ in range(rows)]).astype(np.int32)
  sel[rng.random(sel.shape) < 0.1] = -1
  slot_of = np.where(rng.random((rows, positions)) < 0.5, -1,
                     rng.integers(0, top_k, (rows, positions))).astype(np.int32)
  host = rng.standard_normal((rows, positions, head_dim)).astype(np.float32)
  return sel, slot_of, host


def _miss_fetch_kernel(sel_ref, slot_of_ref, host_ref, _count_in, pos_ref, rows_ref,
                       count_ref, *, top_k, head_dim):
  # sel_ref: i32[R, K]; slot_of_ref: i32[R, P]; host_ref: f32[R, P, D] (pinned host)
  # pos_ref: i32[R, K]; rows_ref: f32[R, K, D]: lanes >= the row's misses unwritten
  # count_ref: i32[1] (zeroed by the caller)
  r = pl.program_id(0)
  lane = jnp.arange(top_k)
  sel = sel_ref[r, lane]  # [K]
  wanted = sel >= 0
  safe = jnp.where(wanted, sel, 0)
  held = pltriton.load(slot_of_ref.at[r, safe], mask=wanted, other=0)
  miss = wanted & (held < 0)
  rank = jnp.cumsum(miss.astype(jnp.int32)) - 1  # compaction index
  num_miss = jnp.sum(miss.astype(jnp.int32))
  # Lanes that store nothing still get distinct places (after the misses): no two
  # lanes of a scatter share an address, masked or not (interpret mode writes the
  # old value back where the mask is off).
  dest = jnp.where(miss, rank, num_miss + lane - rank - 1)
  pltriton.store(pos_ref.at[r, dest], sel, mask=miss)
  d = jnp.arange(head_dim)
  row = pltriton.load(host_ref.at[r, safe[:, None], d[None, :]], mask=miss[:, None],
                      other=0.0)  # [K, D]: the zero-copy gather
  pltriton.store(rows_ref.at[r, dest[:, None], d[None, :]], row, mask=miss[:, None])
  pltriton.atomic_add(count_ref, (pl.ds(0, 1),), num_miss[None])


def miss_fetch_pallas(sel, slot_of, host, *, interpret: bool = False):
  """The probe kernel's algorithm in Pallas Triton (its twin, for timing the two
  languages on one device): (pos i32[R, K], rows f32[R, K, D], count i32[1]); of
  row r only the first (its misses) lanes of pos and rows are written."""
  num_rows, top_k = sel.shape
  whole = pl.no_block_spec
  out = [jax.ShapeDtypeStruct(sel.shape, jnp.int32),
         jax.ShapeDtypeStruct((num_rows, top_k, host.shape[-1]), host.dtype),
         jax.ShapeDtypeStruct((1,), jnp.int32)]
  return pl.pallas_call(
      functools.partial(_miss_fetch_kernel, top_k=top_k, head_dim=host.shape[-1]),
      grid=(num_rows,), in_specs=[whole] * 4, out_specs=[whole] * 3, out_shape=out,
      input_output_aliases={3: 2}, compiler_params=kernel_common.triton_params(4, 1),
      interpret=interpret, name="miss_fetch_pallas",
  )(sel, slot_of, host, jnp.zeros((1,), jnp.int32))


def written_lanes_match(got, want) -> bool:
  """``got`` (pos, rows, count) equals the numpy reference ``want`` on the lanes the
  kernel writes: each row's misses, and the count."""
  pos, rows, count = (np.asarray(x) for x in got)
  want_pos, want_rows, want_count = want
  for r in range(pos.shape[0]):
    m = int((want_pos[r] != -7).sum())  # the reference leaves the poison past them
    if not (np.array_equal(pos[r, :m], want_pos[r, :m])
            and np.array_equal(rows[r, :m], want_rows[r, :m])):
      return False
  return bool(np.array_equal(count, want_count))
