"""The probe kernel of ``experiments.triton_probe``, in the Triton language (Triton
reads a kernel's source and globals, so it sits in a module that imports triton)."""

import triton.language as tl


def miss_fetch(sel_ptr, slot_of_ptr, host_ptr, pos_ptr, rows_ptr, count_ptr,
               K: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
  """One program per row r (decorated by the caller: interpreted or compiled).

  sel i32[R, K] (-1 padding); slot_of i32[R, P] (-1: not resident); host f32[R, P,
  D]. Writes pos i32[R, K] (the misses in selection order; later lanes untouched)
  and rows f32[R, K, D] (their host rows), and adds the misses to count i32[1].
  """
  r = tl.program_id(0)
  lane = tl.arange(0, K)
  sel = tl.load(sel_ptr + r * K + lane)  # i32[K]
  wanted = sel >= 0
  safe = tl.where(wanted, sel, 0)
  held = tl.load(slot_of_ptr + r * P + safe, mask=wanted, other=0)
  miss = wanted & (held < 0)
  rank = tl.cumsum(miss.to(tl.int32), 0) - 1  # i32[K]: compaction index
  tl.store(pos_ptr + r * K + rank, sel, mask=miss)
  d = tl.arange(0, D)
  src = host_ptr + (r * P + safe)[:, None] * D + d[None, :]
  row = tl.load(src, mask=miss[:, None], other=0.0)  # f32[K, D]: the zero-copy gather
  tl.store(rows_ptr + (r * K + rank)[:, None] * D + d[None, :], row, mask=miss[:, None])
  tl.atomic_add(count_ptr, tl.sum(miss.to(tl.int32), 0))
