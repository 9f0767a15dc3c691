r"""Can a kernel written in Triton itself (through jax-triton) replace Pallas Triton?
(issue 16, part 4: "can it be tested here ... does it fit the same kernel +
reference layout").

One representative kernel, in the Triton language (``triton_probe_kernel.py``): a per-row RESOLVE miss pass
(membership by a position table, compaction of the misses in selection order by
``tl.cumsum``, a miss counter by ``tl.atomic_add``) plus the zero-copy gather of the
missed rows from a host-tier array. Three checks need no GPU (``--check=all`` runs
the first two, each in its own process, and ``pallas`` with ``lower``); a fourth
times it on one:

* ``interpret``: Triton's own interpreter runs it on this CPU over numpy arrays
  (a small torch-free shim, ``HostTensor``), on fresh random inputs with
  NaN-poisoned outputs, against a numpy reference: integers equal, rows bitwise.
* ``lower``: ``jax_triton.triton_call(compute_capability=90)`` lowers it for CUDA
  and the deviceless H200 client (experiments/deviceless.py) compiles the jitted
  call, the rows' source in ``pinned_host``: one ``triton_kernel_call`` custom call
  and no whole-host-tier copy (the audit's counter).
* ``pallas`` (part of ``lower``): the library's Pallas Triton gather
  (``pallas_kernels/fetch``) through the same deviceless compile, for comparison.
* ``device`` (a CUDA GPU only; ``--check=device``, run by ``gpu_check``'s ``triton``
  section): the probe kernel and its Pallas twin (``miss_fetch_pallas``, the same
  algorithm in Pallas Triton), both compiled, their outputs checked against numpy,
  then timed interleaved (median after warm-up) with the host rows in ``pinned_host``:
  part 4's "how fast is it on the device". The GPU image has Triton; only jax-triton
  (a 17 kB wheel) has to be carried there.

Command (~10 s; needs ``pip install -e ".[audit,triton]"``, ~1 GB for Triton):
  python -m experiments.triton_probe
Writes config.json, rows.jsonl and table.md under results/triton_probe/<stamp>/.
What it decides is in WORKSPACE_NOTES.md ("A kernel in Triton itself").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import common, deviceless, hlo_audit, timing
from experiments.triton_probe_twin import (draw_inputs, miss_fetch_pallas, reference,
                                           written_lanes_match)

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 8, "Rows (request x unit) of the probe kernel.")
flags.DEFINE_integer("top_k", 64, "Selected positions per row (a power of 2).")
flags.DEFINE_integer("positions", 512, "Host-tier positions per row.")
flags.DEFINE_integer("head_dim", 64, "Elements per row (a power of 2).")
flags.DEFINE_integer("seed", None, "Input seed (default: drawn fresh).")
flags.DEFINE_string("out_root", None, "Results root (default: results/).")
flags.DEFINE_enum("check", "all", ["all", "interpret", "lower", "device"],
                  "all: interpret and lower, each in its own process (Triton's mode is "
                  "per process); device: compiled and timed on a CUDA GPU.")
flags.DEFINE_integer("warmup", 3, "device: untimed calls of each kernel.")
flags.DEFINE_integer("iters", 50, "device: timed rounds (the kernels alternate).")

_ROW = "PROBE_ROW "


class HostTensor:
  """Just enough of ``torch.Tensor`` for Triton's interpreter, over a numpy array.
  The interpreter copies "device" tensors to the host and back through their
  storage; these already are host memory, so the copies are the array itself."""

  def __init__(self, array):
    self.array = np.ascontiguousarray(array)
    self.dtype = f"torch.{self.array.dtype.name}"  # what Triton's type mangling reads

  def data_ptr(self):
    return self.array.ctypes.data

  def untyped_storage(self):
    return self

  def cpu(self):
    return self

  def new_empty(self, *args, **kwargs):
    return self

  def set_(self, *args):
    return self

  def copy_(self, other):
    return self

  def storage_offset(self):
    return 0

  def size(self):
    return self.array.shape

  def stride(self):
    return tuple(s // self.array.itemsize for s in self.array.strides)


def _kernel():
  """The probe kernel, decorated for Triton's interpreter or its compiler: Triton
  picks by ``TRITON_INTERPRET`` when it is first imported, and one process cannot
  switch (the interpreter's patched language leaks into a later compile), so each
  mode runs in its own process (``--check``)."""
  import triton

  from experiments.triton_probe_kernel import miss_fetch
  return triton.jit(miss_fetch)


def check_interpreted(kernel, sel, slot_of, host) -> dict:
  rows, top_k = sel.shape
  pos = np.full(sel.shape, -7, np.int32)  # poison: untouched lanes must stay
  out = np.full((rows, top_k, host.shape[-1]), np.nan, np.float32)
  want = reference(sel, slot_of, host, pos, out)
  got = [HostTensor(x) for x in (pos, out, np.zeros(1, np.int32))]
  start = time.perf_counter()
  kernel[(rows,)](HostTensor(sel), HostTensor(slot_of), HostTensor(host), *got,
                  K=top_k, D=host.shape[-1], P=host.shape[1])
  seconds = time.perf_counter() - start
  exact = (np.array_equal(got[0].array, want[0])
           and np.array_equal(got[1].array, want[1], equal_nan=True)
           and np.array_equal(got[2].array, want[2]))
  return dict(check="interpret", ok=bool(exact), misses=int(want[2][0]),
              seconds=round(seconds, 3))


def _triton_call(kernel, sel, slot_of, host, **kw):
  """The probe kernel through jax-triton: (pos, rows, count), count zeroed first."""
  import jax_triton
  rows, top_k = sel.shape
  return jax_triton.triton_call(
      sel, slot_of, host, kernel=kernel,
      out_shape=[jax.ShapeDtypeStruct(sel.shape, jnp.int32),
                 jax.ShapeDtypeStruct((rows, top_k, host.shape[-1]), jnp.float32),
                 jax.ShapeDtypeStruct((1,), jnp.int32)],
      grid=(rows,), zeroed_outputs=(2,), K=top_k, D=host.shape[-1], P=host.shape[1],
      **kw)


def check_lowered(kernel, sel, slot_of, host) -> dict:
  call = jax.jit(lambda *a: _triton_call(kernel, *a, compute_capability=90))
  hlo, row = _compiled("lower", call, (sel, slot_of, _on_host(host)), host.shape)
  calls = hlo.count('custom_call_target="triton_kernel_call"')
  return dict(row, ok=row["ok"] and calls == 1, triton_calls=calls)


def check_pallas(sel, host) -> dict:
  """The library's Pallas gather of the same rows, through the same compile."""
  from pallas_kernels.fetch import gather_rows_call
  rows, top_k = sel.shape
  host6 = host.reshape(1, rows, host.shape[1], 1, 1, host.shape[-1])  # [L, NH+1, Pg, U, Hg, D]
  lanes = -(-rows * top_k // 32) * 32  # the kernel's lanes come in blocks of 32
  src = np.zeros((lanes, 4), np.int32)  # (layer, page, offset, unit) per lane
  fn = jax.jit(lambda s, h: gather_rows_call(s, rows * top_k, h, h))
  return _compiled("pallas", fn, (src, _on_host(host6)), host6.shape)[1]


def check_twin_lowered(sel, slot_of, host) -> dict:
  """The probe's Pallas twin (the device check's other side) through the same
  compile: it lowers for sm_90 and reads its host operand in place."""
  return _compiled("pallas twin", jax.jit(miss_fetch_pallas),
                   (sel, slot_of, _on_host(host)), host.shape)[1]


def _compiled(check: str, fn, args, host_shape) -> tuple[str, dict]:
  """(HLO, row) of ``fn`` compiled deviceless for an H200: no whole-host copy, and
  the host operand's layout keeps the host memory space (``S(5)``)."""
  start = time.perf_counter()
  hlo = deviceless.compile_for_h200(deviceless.lower_for_cuda(fn, *args))
  seconds = time.perf_counter() - start
  copies = hlo_audit.count_whole_host_copies(hlo, host_shape, "f32")
  on_host = ":S(5)}" in hlo
  return hlo, dict(check=check, ok=copies == 0 and on_host, whole_host_copies=copies,
                   host_operand_in_host_memory=on_host, seconds=round(seconds, 1))


def check_device(sel, slot_of, host):
  """Both kernels compiled on this GPU: exact against numpy, then timed. Yields
  each row as it is known (main prints it at once: a run cut short by its
  caller's limit keeps the exactness rows)."""
  if jax.default_backend() != "gpu":
    yield dict(check="device", skipped="needs a CUDA GPU")
    return
  kernel = _kernel()
  triton_fn = jax.jit(lambda *a: _triton_call(kernel, *a))
  pallas_fn = jax.jit(miss_fetch_pallas)
  args = (jnp.asarray(sel), jnp.asarray(slot_of), _on_host(host, jax.devices()[0]))
  want = reference(sel, slot_of, host, np.full(sel.shape, -7, np.int32),
                   np.full(sel.shape + host.shape[-1:], np.nan, np.float32))
  exact = {}
  for name, fn in (("triton", triton_fn), ("pallas", pallas_fn)):
    exact[name] = written_lanes_match(fn(*args), want)
    yield dict(check="device exact", ok=exact[name], kernel=name, misses=int(want[2][0]),
               device=jax.devices()[0].device_kind)
  medians, ratios = timing.interleaved_ms(
      {"pallas": lambda: pallas_fn(*args), "triton": lambda: triton_fn(*args)},
      FLAGS.warmup, FLAGS.iters)
  moved = int(want[2][0]) * host.shape[-1] * host.itemsize  # missed rows' bytes
  for name in ("pallas", "triton"):
    yield dict(check="device", ok=exact[name], kernel=name, misses=int(want[2][0]),
               median_us=round(1e3 * medians[name], 2), vs_pallas=round(ratios[name], 3),
               host_gb_s=round(moved / (medians[name] * 1e-3) / 1e9, 1),
               device=jax.devices()[0].device_kind)


def _on_host(x, device=None):
  return jax.device_put(x, jax.sharding.SingleDeviceSharding(
      device or jax.devices("cpu")[0], memory_kind="pinned_host"))


def _in_child(check: str, seed: int) -> list[dict]:
  env = dict(os.environ, TRITON_INTERPRET="1" if check == "interpret" else "0")
  argv = [sys.executable, "-m", "experiments.triton_probe", f"--check={check}",
          f"--seed={seed}", f"--rows={FLAGS.rows}", f"--top_k={FLAGS.top_k}",
          f"--positions={FLAGS.positions}", f"--head_dim={FLAGS.head_dim}"]
  done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
  rows = [json.loads(line[len(_ROW):]) for line in done.stdout.splitlines()
          if line.startswith(_ROW)]
  if done.returncode or not rows:
    raise SystemExit(f"--check={check} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  return rows


def _run_check(check: str, seed: int):
  """The rows of ``check`` (an iterable: the device check's come as they are known)."""
  sel, slot_of, host = draw_inputs(np.random.default_rng(seed), FLAGS.rows, FLAGS.top_k,
                                   FLAGS.positions, FLAGS.head_dim)
  if check == "interpret":
    return [check_interpreted(_kernel(), sel, slot_of, host)]
  if check == "device":
    return check_device(sel, slot_of, host)
  if not deviceless.available():
    return [dict(check="lower", ok=False, note="no deviceless CUDA client: pip install -e '.[audit]'")]
  return [check_lowered(_kernel(), sel, slot_of, host), check_pallas(sel, host),
          check_twin_lowered(sel, slot_of, host)]


def main(argv):
  del argv
  try:
    import jax_triton
    import triton
  except ImportError as e:
    raise SystemExit(f"{e}: pip install -e '.[audit,triton]' first") from e
  seed = FLAGS.seed if FLAGS.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
  if FLAGS.check != "all":
    for row in _run_check(FLAGS.check, seed):
      print(_ROW + json.dumps(row), flush=True)
    return
  out = common.start_run("triton_probe", dict(FLAGS.flag_values_dict(), seed=seed,
                                              triton=triton.__version__,
                                              jax_triton=jax_triton.__version__),
                         FLAGS.out_root)
  rows = _in_child("interpret", seed) + _in_child("lower", seed)
  for row in rows:
    common.append_row(out, row)
  table = common.markdown_table(rows, ["check", "ok", "seconds", "misses",
                                       "whole_host_copies", "triton_calls",
                                       "host_operand_in_host_memory"])
  (out / "table.md").write_text(table + "\n")
  print(table)
  print(f"results: {out}")
  if not all(row["ok"] for row in rows):
    raise SystemExit(1)


if __name__ == "__main__":
  app.run(main)
