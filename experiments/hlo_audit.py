r"""Deviceless H200 audit of the jitted tiered decode step (no GPU needed).

Compiles the tiered decode step (the one ``tiered_attend`` path, via
``decode.decode_step``) for an H200 target on this CPU machine
(experiments/deviceless.py) and reads the optimized XLA:GPU HLO for what CPU runs
cannot show (on CPU, memory kinds are annotations; docs/DESIGN.md, "The audit"):

* whole-host-tier copies (must be 0): any copy of a host-tier-shaped array, or any
  host-tier-shaped value materialised in device memory, an entry parameter
  included (a tier handed to the step in device memory);
* host->device bytes per miss, read off the HostExecute gathers (XLA fetch); for
  the zero-copy kernels, 2 rows (K and V) per miss by their construction (what a
  kernel reads is not in the HLO: the audit checks its host operands are the
  entry's, in host memory, ``:S(5)``);
* in-place aliasing of every state buffer (``input_output_alias`` of the entry);
* the Pallas (Triton) kernels present and the async host copies;
* SmolLM2-135M's whole decode step (weights, Quest selector; abstract inputs, no
  weights read): launches per layer and the copies inside the layer loop, for the
  sparse (full-KV) backend and the tiered one (default and fused kernels). A copy
  there runs every layer: one of the selector state once cost 1.4 GB per layer;
* the step sharded over an 8xH200 node (``shard_map``: requests over mesh axis
  ``data`` = 8, or 4 x KV heads over ``model`` = 2): whole-host copies by the
  step's operations and every collective (kvtier_jax/sharding.py: one per layer).
  The compile-only devices drop ``pinned_host`` from a sharding, so there the tier
  compiles in device memory (its row says so); the one-device audit checks that
  the tier enters the step in host memory;
* the serving sampler's draw: its ``lax.cond``s that stay conditionals the host
  waits on (outside CUDA graphs), a predicate copied to the host each.

Command (~2 min on 2 CPU cores; needs ``pip install -e .[audit]``):
  python -m experiments.hlo_audit
Prints one table row per variant (with the kernel launches of one trip of the layer
loop, and the same for the full-KV step) and a final line
``hlo_audit: whole_host_copies=N host_to_device_bytes_per_miss=M
kernels_per_layer=T/F fused_kernels_per_layer=X`` (T: the GPU default tiered step,
F: full KV, X: the tiered step through the fused layer kernels); exits 1 if N > 0,
if a state buffer is not aliased to its output, or if the negative control (the
whole host tier moved to the device) shows no copy.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import deviceless
from kvtier_jax import decode, full_kv, selectors, sharding
from kvtier_jax import state as kv_state
from kvtier_jax.config import ImplConfig, TierConfig
from kvtier_jax.policies import PolicyConfig
from kvtier_jax.selectors.base import prefill_state
from kvtier_jax.serving import sampling
from models import backends
from models import cache as cache_lib
from models.config import ModelConfig
from models.transformer import Transformer, apply_prefill_with_inputs
from pallas_kernels import common

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "Small shapes (tests).")

KERNEL_NAMES = ("cache_resolve", "sparse_decode_attention", "fetch_rows", "gather_rows",
                "fused_resolve_victim_key", "fused_resolve_classify",
                "fused_resolve_commit")
_PASSIVE = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "call",
            "conditional", "dynamic-update-slice-start", "dynamic-update-slice-done",
            "custom-call", "custom-call-start", "custom-call-done", "fusion"}


@dataclasses.dataclass
class Audit:
  variant: str
  whole_host_copies: int
  host_to_device_bytes_per_miss: float
  aliased_params: int
  state_params: int
  kernels: tuple[str, ...]
  host_executes: int
  async_host_writes: int
  overlapped_ops: int  # compute ops scheduled while a HostExecute fetch is in flight
  overlapped_kernels: int  # of which custom-call kernels (the Pallas hit attention)
  launches_per_layer: float  # kernel launches per layer (one trip of the layer loop)
  hot_cache_copies: int  # copies of the whole hot cache (K or V): 0 when in place


def _instructions(hlo: str):
  """(result type, opcode, line) of every instruction."""
  pat = re.compile(r"^\s*(?:ROOT )?%\S+ = (\S+?\]\{[^}]*\}|\S+) ([a-z\-]+)\(")
  for line in hlo.splitlines():
    m = pat.match(line)
    if m:
      yield m.group(1), m.group(2), line


def _entry_lines(hlo: str):
  """The lines of the module's entry computation."""
  lines = iter(hlo.splitlines())
  for line in lines:
    if line.startswith("ENTRY "):
      break
  for line in lines:
    if line.startswith("}"):
      return
    yield line


def count_whole_host_copies(hlo: str, host_shape: tuple[int, ...], dtype: str,
                            entry_params: bool = True) -> int:
  """Copies of a host-tier-shaped array, or such an array placed in device memory:
  an entry parameter too (a tier handed to the step in device memory; parameters
  are passive inside the computations, where they name the entry's), unless
  ``entry_params`` is False (a compile whose inputs could not be host-placed)."""
  shape = f"{dtype}[{','.join(map(str, host_shape))}]"
  n = sum(1 for typ, op, _ in _instructions("\n".join(_entry_lines(hlo)))
          if entry_params and op == "parameter" and typ.startswith(shape + "{")
          and ":S(5)" not in typ)
  for typ, op, _ in _instructions(hlo):
    if not typ.startswith(shape + "{"):
      continue
    on_host = ":S(5)" in typ
    if op in ("copy", "copy-start", "copy-done") or (not on_host and op not in _PASSIVE):
      n += 1
    elif not on_host and op == "fusion":  # a fusion materialising the tier on device
      n += 1
  return n


def count_copies(hlo: str, shape: tuple[int, ...], dtype: str) -> int:
  """Copy instructions (copy, copy-start) of a ``dtype[shape]`` array: a state array
  updated in place is never copied, and its in-place updates are not copies."""
  typ = f"{dtype}[{','.join(map(str, shape))}]" + "{"
  return sum(t.startswith(typ) and op in ("copy", "copy-start")
             for t, op, _ in _instructions(hlo))


def aliased_parameters(hlo: str) -> set[int]:
  header = hlo.splitlines()[0]
  m = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
  return {int(p) for p in re.findall(r"\(\s*(\d+),", m.group(1))} if m else set()


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}


def _array_bytes(dtype: str, dims: str) -> int:
  """Bytes of an HLO array type, e.g. ("f32", "4,576")."""
  return _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))


def host_execute_rows_bytes(hlo: str) -> list[tuple[int, int]]:
  """(rows, bytes) delivered to device by each HostExecute gather: every result
  is a block of K or of V rows, so rows = the results' rows / 2 (XLA may merge
  two gathers into one call, e.g. a sharing layer's fetch with a prefetch)."""
  out = []
  for line in hlo.splitlines():
    if 'custom_call_target="HostExecute"' not in line or "custom-call-start" not in line:
      continue
    results = re.sub(r"\{[^}]*\}", "", line.split(" = ")[1].split(" custom-call-start")[0])
    # ((operands...), (results...), u32[]): take the middle group.
    groups = re.findall(r"\((?:[^()]*)\)", results)
    res = groups[1] if len(groups) > 1 else groups[0]
    arrays = re.findall(r"(bf16|f16|f32)\[([\d,]+)\]", res)  # K and V rows
    nbytes = sum(_array_bytes(t, dims) for t, dims in arrays)
    rows = sum(int(dims.split(",")[0]) for _, dims in arrays) // 2
    out.append((rows, nbytes))
  return out


def pallas_kernels_in(hlo: str) -> tuple[str, ...]:
  """The library's Pallas kernels among the HLO's Triton calls, by the name in each
  call's config (not by a substring of the line: the embedded Triton IR carries
  source paths, such as pallas_kernels/cache_resolve/, and jax 0.11 keeps another
  kernel's there when a shared helper was first traced for it)."""
  names = {m for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line
           for m in re.findall(r'\bname = "(\w+)"', line)}
  return tuple(sorted(names & set(KERNEL_NAMES)))


def _is_fetch_start(line: str, comps: dict[str, str]) -> bool:
  """An async miss fetch: a HostExecute gather, or a call on its own CUDA stream
  that launches a kernel (XLA >= 0.11 also puts a streamed call's
  get-tuple-elements on the stream, each in an async pair of its own that moves
  no data: those do not count)."""
  if 'custom_call_target="HostExecute"' in line and "custom-call-start" in line:
    return True
  if " call-start(" not in line or "_xla_stream_annotation" not in line:
    return False
  called = re.search(r"to_apply=(%[\w.\-]+)", line)
  return bool(called) and "custom-call(" in comps.get(called.group(1), "")


def _fetch_windows(hlo: str):
  """The instruction lines scheduled between each async fetch's start and its done
  (a HostExecute gather, or the zero-copy gather on a second stream).

  The optimized HLO is scheduled (``is_scheduled=true``), so textual order within a
  computation is execution order on the stream: ops between the async start and
  done run while the fetch is in flight.
  """
  comps = _computations(hlo)
  for comp in re.split(r"\n(?=\S)", hlo):  # one block per computation
    lines = comp.splitlines()
    starts = {m.group(1): i for i, l in enumerate(lines)
              if _is_fetch_start(l, comps) and (m := re.match(r"\s*(%\S+) =", l))}
    for name, i in starts.items():
      for j in range(i + 1, len(lines)):
        if "call-done(" in lines[j] and f"({name})" in lines[j]:
          yield lines[i + 1:j]
          break


def ops_overlapping_host_fetch(hlo: str) -> int:
  """Compute instructions (fusions, dots, custom calls) in the widest fetch window."""
  return max((sum(1 for l in window
                  if re.search(r" (fusion|dot|custom-call|convolution)\(", l))
              for window in _fetch_windows(hlo)), default=0)


def kernels_overlapping_host_fetch(hlo: str) -> int:
  """Custom-call kernels (a Pallas attention) in the widest fetch window."""
  return max((sum(1 for l in window if " custom-call(" in l)
              for window in _fetch_windows(hlo)), default=0)


# Instructions that launch nothing on an XLA:GPU stream (bookkeeping, the ends of
# async pairs, and loops/calls, whose bodies are counted instead).
_NO_LAUNCH = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
              "after-all", "opt-barrier", "copy-done", "custom-call-done",
              "dynamic-update-slice-done", "all-reduce-done", "send-done", "recv-done",
              "async-done", "while", "call", "conditional"}


def _computations(hlo: str) -> dict[str, str]:
  """Computation name -> its text."""
  out = {}
  for block in re.split(r"\n(?=\S)", hlo):
    m = re.match(r"(?:ENTRY )?(%[\w.\-]+)", block)
    if m:
      out[m.group(1)] = block
  return out


def _opcodes(text: str):
  """(opcode, line) of every instruction, whatever its result type (tuples too)."""
  for line in text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%\S+ = (.*)", line)
    if not m:
      continue
    rest, depth = m.group(1), 0
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
      for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
          rest = rest[i + 1:]
          break
    op = re.match(r"\s*(?:\S+\s)?([a-z][a-z0-9\-]*)\(", rest)
    if op:
      yield op.group(1), line


def launches(comps: dict[str, str], name: str) -> int:
  """Kernel launches of one run of computation ``name``: every instruction that
  launches (fusions, custom calls: Triton kernels, cuBLAS; copies, sorts, async
  starts), plus one pass of each loop / called computation inside it (a nested
  loop counts once, not per trip)."""
  total = 0
  for op, line in _opcodes(comps[name]):
    if op == "while":
      for key in ("condition", "body"):
        total += launches(comps, re.search(key + r"=(%[\w.\-]+)", line).group(1))
    elif op in ("call", "conditional"):
      # Every branch (branch_computations={%a, %b, ...}); the dearest one counts.
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      called = re.findall(r"(?:to_apply|true_computation|false_computation)=(%[\w.\-]+)",
                          line)
      called += re.findall(r"%[\w.\-]+", branches.group(1)) if branches else []
      total += max((launches(comps, c) for c in called), default=0)
    elif op not in _NO_LAUNCH and not op.endswith("-done"):  # a done only waits
      total += 1
  return total


def _layer_loop(comps: dict[str, str], num_layers: int) -> tuple[int, str] | None:
  """(trip count, instruction) of the entry's loop over the layers: the longest of
  its loops whose trip count divides ``num_layers``; None if XLA unrolled it."""
  entry_name = next(n for n, b in comps.items() if b.startswith("ENTRY"))
  loops = []
  for op, line in _opcodes(comps[entry_name]):
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    if op == "while" and trips and num_layers % int(trips.group(1)) == 0:
      loops.append((int(trips.group(1)), line))
  return max(loops, key=lambda t: t[0]) if loops else None


def layer_loop_launches(hlo: str, num_layers: int) -> float:
  """Launches per layer: one trip of the entry's loop over the layers (its body
  and its condition) over the layers one trip covers. With index sharing the loop
  runs over groups of layers (trip count L / N); a loop XLA unrolled away leaves
  the whole entry, divided by L."""
  comps = _computations(hlo)
  loop = _layer_loop(comps, num_layers)
  if loop is None:
    entry_name = next(n for n, b in comps.items() if b.startswith("ENTRY"))
    return launches(comps, entry_name) / num_layers
  trips, line = loop
  per_trip = sum(launches(comps, re.search(key + r"=(%[\w.\-]+)", line).group(1))
                 for key in ("condition", "body"))
  return per_trip * trips / num_layers


def layer_loop_copies(hlo: str, num_layers: int) -> list[int]:
  """Bytes of each copy in the body of the loop over the layers: each runs once per
  trip (a layer, or a group of layers with index sharing)."""
  comps = _computations(hlo)
  loop = _layer_loop(comps, num_layers)
  if loop is None:
    return []
  sizes = []
  for op, line in _opcodes(comps[re.search(r"body=(%[\w.\-]+)", loop[1]).group(1)]):
    if op in ("copy", "copy-start"):
      m = re.search(r"= \(?(\w+)\[([\d,]*)\]", line)
      sizes.append(_array_bytes(m.group(1), m.group(2)))
  return sizes


_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")


def layer_loop_graph_launches(thunks: str) -> tuple[int, int]:
  """(launches, kernels captured) of one trip of the first top-level loop of a thunk
  sequence (``deviceless.thunk_sequence``): every thunk at the top level of the
  loop's condition and body is one launch, a command buffer (CUDA graph) included,
  whose own kernels count as captured instead; an async done (XLA >= 0.11 runs
  dynamic slices on other streams) only waits. Outside a loop: the whole
  sequence."""
  lines = thunks.splitlines()
  start = next((i for i, l in enumerate(lines) if re.match(r"^\d+: kWhile", l)), None)
  if start is None:
    body, depth = lines, 0
  else:
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^\d", lines[i])),
               len(lines))
    body = [l for l in lines[start + 1:end] if _THUNK.match(l)]
    depth = min(len(_THUNK.match(l).group(1)) for l in body)
  launches = captured = 0
  in_graph = False
  for line in body:
    m = _THUNK.match(line)
    if not m:
      continue
    indent, kind = len(m.group(1)), m.group(2)
    if indent == depth:
      launches += kind != "kAsyncDone"  # a done waits on its start's stream
      in_graph = kind == "kCommandBuffer"
    elif in_graph and indent > depth and kind != "kCommandBuffer":
      captured += 1
  return launches, captured


def host_waited_conditionals(thunks: str) -> int:
  """Conditional thunks at the top level of a thunk sequence (outside any command
  buffer): on a GPU each copies its predicate to the host and waits for it before
  it launches a branch."""
  return sum(1 for line in thunks.splitlines() if re.match(r"^\d+: kConditional\b", line))


def audit_sampler(smoke: bool) -> tuple[int, int, int]:
  """The serving sampler (``sampling.sample``, one engine step's draw) compiled for
  an H200: (its lax.conds, the conditionals the host waits on with XLA's default
  command buffers, the same with conditionals allowed into them)."""
  rows, vocab = (2, 1024) if smoke else (8, 49152)  # SmolLM2's vocabulary
  args = [jax.ShapeDtypeStruct((rows, vocab), jnp.float32)] + [
      jax.ShapeDtypeStruct((rows,), dtype) for dtype in
      (jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.int32)]
  lowered = deviceless.lower_for_cuda(sampling.sample, *args)
  conds = len(sampling.CANDIDATES) + len(sampling.NUCLEUS_WINDOWS)
  return conds, *(host_waited_conditionals(deviceless.thunk_sequence(lowered, options))
                  for options in (deviceless.GPU_OPTIONS, GRAPH_OPTIONS))


# XLA options that let command buffers capture loops and conditionals too (the
# default captures fusions, cuBLAS and custom kernels only).
GRAPH_OPTIONS = deviceless.GPU_OPTIONS + (
    ("xla_gpu_enable_command_buffer",
     "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"),)


def _shardings():
  """(host, device) shardings of a one-device mesh, for abstract H200 inputs."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
  spec = jax.sharding.PartitionSpec()
  return (jax.sharding.NamedSharding(mesh, spec, memory_kind="pinned_host"),
          jax.sharding.NamedSharding(mesh, spec))


def _abstract_state(cfg: TierConfig, carry: bool = True):
  """(the step's carry (or the bare cache) as arrays, the same as ShapeDtypeStructs
  placed like the real state: host tier in pinned_host, the rest on the device).

  A config with ``lookahead_cap`` gets a lookahead prefetch of that many predicted
  positions per (layer, request, unit) in its carry: the step compiles one."""
  host, dev = _shardings()
  prefetch = None
  if carry and cfg.lookahead_cap is not None:
    prefetch = jnp.zeros((cfg.num_layers, cfg.num_requests, cfg.num_units,
                          cfg.lookahead_cap), jnp.int32)
  abstract = jax.eval_shape(
      lambda: decode.init_carry(cfg, kv_state.init_state(cfg), prefetch=prefetch)
      if carry else kv_state.init_state(cfg))
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=host if "host" in jax.tree_util.keystr(path) else dev),
      abstract)
  return abstract, state


_HLO_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int32": "s32"}


def hlo_dtype(cfg: TierConfig) -> str:
  """The HLO spelling of the cache's dtype (f32, bf16, ...)."""
  return _HLO_DTYPES[jnp.dtype(cfg.dtype).name]


def lower_step(cfg: TierConfig):
  """The tiered decode step lowered for CUDA on abstract H200 inputs."""
  _, dev = _shardings()
  _, state = _abstract_state(cfg)
  sds = lambda shape, dt=cfg.dtype: jax.ShapeDtypeStruct(shape, dt, sharding=dev)
  L, R = cfg.num_layers, cfg.num_requests
  selector = selectors.ChurnSelector(cfg.max_len // 2, cfg.top_k, cfg.num_units,
                                     rank_depth=cfg.policy.rank_depth)
  step = jax.jit(functools.partial(decode.decode_step, cfg, selector), donate_argnums=(0,))
  return deviceless.lower_for_cuda(
      step, state, sds((L, R, cfg.num_q_heads, cfg.head_dim)),
      sds((L, R, cfg.num_kv_heads, cfg.head_dim)), sds((L, R, cfg.num_kv_heads, cfg.head_dim)))


def audit_graphs(cfg: TierConfig, full_kv_step: bool = False
                 ) -> dict[str, tuple[int, int]]:
  """Graph launches per layer of the compiled step (or of the full-KV step),
  (launches, captured kernels), with XLA's default command buffers and with loops
  allowed into them."""
  lowered = lower_full_kv(cfg) if full_kv_step else lower_step(cfg)
  return {name: layer_loop_graph_launches(deviceless.thunk_sequence(lowered, options))
          for name, options in (("default", deviceless.GPU_OPTIONS),
                                ("while", GRAPH_OPTIONS))}


def audit_config(cfg: TierConfig, variant: str) -> Audit:
  """Lower + compile one decode step for an H200 and read its HLO."""
  abstract, _ = _abstract_state(cfg)
  hlo = deviceless.compile_for_h200(lower_step(cfg))
  copies = count_whole_host_copies(hlo, kv_state.host_tier_shape(cfg), hlo_dtype(cfg))
  gathers = host_execute_rows_bytes(hlo)
  kernels = pallas_kernels_in(hlo)
  if gathers:
    per_miss = max(nbytes / rows for rows, nbytes in gathers)
  else:  # zero-copy kernels: each missed row is read once for K and once for V
    zero_copy = {"fetch_rows", "gather_rows", "fused_resolve_commit"} & set(kernels)
    per_miss = 2 * cfg.row_bytes if zero_copy else 0.0
  # The cache's buffers lead the carry's leaves; each must be updated in place.
  num_state = len(jax.tree.leaves(abstract.tier))
  aliased = aliased_parameters(hlo) & set(range(num_state))
  return Audit(variant, copies, per_miss, len(aliased), num_state, kernels,
               len(gathers), hlo.count("dynamic-update-slice-start"),
               ops_overlapping_host_fetch(hlo), kernels_overlapping_host_fetch(hlo),
               layer_loop_launches(hlo, cfg.num_layers),
               count_copies(hlo, kv_state.hot_cache_shape(cfg), hlo_dtype(cfg)))


def audit_full_kv(cfg: TierConfig) -> float:
  """Kernel launches per layer of the full-KV sparse-attention step (the same
  selector and shapes, every position resident on the device)."""
  return layer_loop_launches(deviceless.compile_for_h200(lower_full_kv(cfg)),
                             cfg.num_layers)


def lower_full_kv(cfg: TierConfig):
  """The full-KV sparse-attention step lowered for CUDA on abstract H200 inputs."""
  _, dev = _shardings()
  sds = lambda shape, dt=cfg.dtype: jax.ShapeDtypeStruct(shape, dt, sharding=dev)
  L, R = cfg.num_layers, cfg.num_requests
  state_shape = (L, R, cfg.max_len, cfg.num_units, cfg.heads_per_unit, cfg.head_dim)
  state = full_kv.FullKVState(sds(state_shape), sds(state_shape), sds((R,), jnp.int32))
  selector = selectors.ChurnSelector(cfg.max_len // 2, cfg.top_k, cfg.num_units,
                                     rank_depth=cfg.policy.rank_depth)
  step = jax.jit(lambda s, q, k, v: full_kv.full_kv_decode_step(cfg, selector, s, q, k, v),
                 donate_argnums=(0,))
  heads = lambda h: sds((L, R, h, cfg.head_dim))
  return deviceless.lower_for_cuda(step, state, heads(cfg.num_q_heads),
                                   heads(cfg.num_kv_heads), heads(cfg.num_kv_heads))


def audit_separate_append(cfg: TierConfig) -> tuple[int, int, int]:
  """The separate-jit host append (the default): (whole-tier copies, async host
  writes, aliased state buffers)."""
  _, dev = _shardings()
  _, state = _abstract_state(cfg, carry=False)
  append = jax.jit(functools.partial(decode.append_newest, cfg), donate_argnums=(0,))
  hlo = deviceless.compile_for_h200(deviceless.lower_for_cuda(
      append, state, jax.ShapeDtypeStruct((), bool, sharding=dev)))
  return (count_whole_host_copies(hlo, kv_state.host_tier_shape(cfg), hlo_dtype(cfg)),
          hlo.count("dynamic-update-slice-start"), len(aliased_parameters(hlo)))


def audit_prompt_write(cfg: TierConfig, chunk: int = 128) -> tuple[int, int, int]:
  """The serving engine's write-through of one prompt chunk into a request's host
  pages: (whole-tier copies, async host writes, aliased state buffers)."""
  _, dev = _shardings()
  _, state = _abstract_state(cfg, carry=False)
  rows = jax.ShapeDtypeStruct((cfg.num_layers, 1, chunk, cfg.num_kv_heads, cfg.head_dim),
                              cfg.dtype, sharding=dev)
  index = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=dev)
  write = jax.jit(functools.partial(decode.write_prompt_pages, cfg), donate_argnums=(0,))
  hlo = deviceless.compile_for_h200(deviceless.lower_for_cuda(
      write, state, index((1,)), index(()), rows, rows))
  return (count_whole_host_copies(hlo, kv_state.host_tier_shape(cfg), hlo_dtype(cfg)),
          hlo.count("dynamic-update-slice-start"), len(aliased_parameters(hlo)))


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
               "all-to-all")


def collectives(hlo: str) -> list[str]:
  """``op shape`` of every collective in the HLO (async pairs counted once, by
  their start, whose result type is a tuple with the result second: ``(operand,
  result)`` in XLA 0.10, ``((operands), result[, contexts])`` in XLA 0.11)."""
  found = []
  names = "|".join(COLLECTIVES)
  for line in hlo.splitlines():
    m = re.search(r"= (.+?) (" + names + r")(-start)?\(", line)
    if not m:
      continue
    shape = re.sub(r"{[^}]*}", "", m.group(1))  # no layout
    if m.group(3) and shape.startswith("("):
      shape = _tuple_elements(shape)[1]
    found.append(f"{m.group(2)} {shape}")
  return found


def _tuple_elements(text: str) -> list[str]:
  """The top-level elements of an HLO tuple type ``(a, (b, c), d[1,2])``."""
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
    if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
      parts.append(text[start:i].strip())
      start = i + 1
  return parts


def audit_sharded(cfg: TierConfig, data: int = 8, model: int = 1):
  """The tiered step under shard_map over ``data`` x ``model`` H200s of one node:
  each device runs ``cfg.num_requests`` requests (and, with ``model`` > 1, its
  ``cfg.num_kv_heads`` KV heads as per-KV-head units: tensor parallel) with its own
  host tier, asked for in its pinned host memory; compiled SPMD-partitioned
  deviceless.
  Returns (whole-host copies of the per-device or the global tier, the collectives
  inside the layer loop (each runs once per layer), the collectives of the whole
  step, launches per layer, whether the tier was placed in host memory).

  The compile-only topology's devices report no memories, so a ``NamedSharding``
  over them drops ``pinned_host`` (silently): the tier compiles in device memory
  here, and the copies counted are the step's operations only (the one-device
  audit checks the host placement)."""
  devices = np.array(deviceless.h200_node(data * model)).reshape(data, model)
  mesh = jax.sharding.Mesh(devices, sharding.AXES)
  local = cfg.replace(mesh_axes=sharding.AXES, per_kv_head=cfg.per_kv_head or model > 1)
  probe = lambda c: jax.eval_shape(lambda: decode.init_carry(c, kv_state.init_state(c)))
  small = probe(local)
  data_axes = sharding.request_axes(small, probe(local.replace(
      num_requests=2 * cfg.num_requests)))
  model_axes = None
  if model > 1:
    model_axes = sharding.request_axes(small, probe(local.replace(
        num_kv_heads=2 * cfg.num_kv_heads, num_q_heads=2 * cfg.num_q_heads)))
  specs = sharding.mesh_specs(data_axes, model_axes,
                              sharding.per_device_leaves(data_axes, ("fetched_rows",)))
  state = sharding.global_abstract(small, specs, mesh,
                                   lambda path: "pinned_host" if "host" in path else None)
  on_host = state.tier.host_k.sharding.memory_kind == "pinned_host"
  rows = jax.sharding.PartitionSpec(None, sharding.DATA, sharding.MODEL)
  L, R, D = cfg.num_layers, cfg.num_requests * data, cfg.head_dim
  sds = lambda heads: jax.ShapeDtypeStruct(
      (L, R, heads * model, D), cfg.dtype, sharding=jax.sharding.NamedSharding(mesh, rows))
  selector = selectors.ChurnSelector(cfg.max_len // 2, cfg.top_k, local.num_units,
                                     rank_depth=cfg.policy.rank_depth)
  step = jax.shard_map(functools.partial(decode.decode_step, local, selector), mesh=mesh,
                       in_specs=(specs, rows, rows, rows), out_specs=(rows, specs),
                       check_vma=False)
  with common.tracing_for_gpu():
    hlo = jax.jit(step, donate_argnums=(0,)).trace(
        state, sds(cfg.num_q_heads), sds(cfg.num_kv_heads), sds(cfg.num_kv_heads)).lower(
            lowering_platforms=("cuda",)).compile().as_text()
  shape = kv_state.host_tier_shape(local)
  whole = list(shape)
  whole[1] *= data
  whole[3] *= model
  copies = sum(count_whole_host_copies(hlo, tuple(s), hlo_dtype(cfg), on_host)
               for s in (shape, whole))
  comps = _computations(hlo)
  bodies = set(re.findall(r"body=(%[\w.\-]+)", hlo))
  in_loop = [c for name, text in comps.items() if name in bodies for c in collectives(text)]
  return (copies, in_loop, len(collectives(hlo)), layer_loop_launches(hlo, cfg.num_layers),
          on_host)


@dataclasses.dataclass
class ModelAudit:
  variant: str
  launches_per_layer: float
  loop_copies: list[int]  # bytes of each copy in the layer loop (once per layer)
  whole_host_copies: int
  selector_state_bytes: int  # of one layer-stacked selector state array
  state_copies: int  # copies anywhere in the step of a selector state array


def model_audit_shape(smoke: bool) -> dict:
  """Shapes of the model audit (num_layers None: all of SmolLM2's 30)."""
  if smoke:
    return {"num_layers": 2, "num_requests": 2, "max_len": 1024, "hot_slots": 128,
            "top_k": 64}
  return {"num_layers": None, "num_requests": 8, "max_len": 32768, "hot_slots": 2048,
          "top_k": 512}


_MODEL_PROMPT = 16  # prompt positions before the audited model step: only shapes matter


def _prefilled(cfg: ModelConfig, selector, weights, num_req: int, max_len: int):
  """(k, v, selector state) after a prompt of ``_MODEL_PROMPT`` zeros per request."""
  lens = jnp.full((num_req,), _MODEL_PROMPT, jnp.int32)
  _, k, v, h = apply_prefill_with_inputs(
      cfg, weights, jnp.zeros((num_req, _MODEL_PROMPT), jnp.int32), lens)
  return k, v, prefill_state(selector, cfg.num_layers, max_len, None, h, k, lens)


def abstract_tiered_carry(cfg: ModelConfig, tier_cfg: TierConfig, selector, weights):
  """The model's tiered carry after a short prompt, as ShapeDtypeStructs (not
  placed: the caller puts the host tier where it compiles for)."""
  def carry(w):
    sel = _prefilled(cfg, selector, w, tier_cfg.num_requests, tier_cfg.max_len)[2]
    return decode.init_carry(tier_cfg, kv_state.init_state(tier_cfg), sel)
  return jax.eval_shape(carry, weights)


def audit_model(smoke: bool) -> list[ModelAudit]:
  """SmolLM2-135M's decode step (``models.backends``) compiled for an H200 on
  abstract weights and state (f32, the model's dtype; Quest): the sparse backend
  (every position's K/V on the device) and the tiered one, default and fused."""
  shape = model_audit_shape(smoke)
  cfg = ModelConfig.smollm2_135m()
  if shape["num_layers"]:
    cfg = cfg.replace(num_layers=shape["num_layers"])
  num_req, max_len, top_k = shape["num_requests"], shape["max_len"], shape["top_k"]
  host, dev = _shardings()
  selector = selectors.QuestSelector(token_budget=top_k, num_kv_heads=cfg.num_kv_heads,
                                     q_per_kv=cfg.q_per_kv, head_dim=cfg.head_dim)
  weights = {name: jax.ShapeDtypeStruct(dims, jnp.dtype(cfg.dtype), sharding=dev)
             for name, dims in Transformer.param_shapes(cfg).items()}
  tokens = jax.ShapeDtypeStruct((num_req,), jnp.int32, sharding=dev)
  place = lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, x: jax.ShapeDtypeStruct(
          x.shape, x.dtype,
          sharding=host if "host" in jax.tree_util.keystr(path) else dev), tree)

  lens = jnp.full((num_req,), _MODEL_PROMPT, jnp.int32)

  def sparse_carry(w):
    k, v, sel = _prefilled(cfg, selector, w, num_req, max_len)
    shared = jnp.full((num_req, selector.num_units, top_k), -1, jnp.int32)
    return backends.SparseCarry(cache_lib.dense_from_prefill(k, v, lens, max_len), sel,
                                None, shared)

  sparse = place(jax.eval_shape(sparse_carry, weights))
  state_leaves = jax.tree.leaves(sparse.sel)
  state_bytes = max(x.size * x.dtype.itemsize for x in state_leaves)

  def audit(variant, lowered, tier_cfg=None):
    hlo = deviceless.compile_for_h200(lowered)
    copies = 0 if tier_cfg is None else count_whole_host_copies(
        hlo, kv_state.host_tier_shape(tier_cfg), hlo_dtype(tier_cfg))
    state_copies = sum(count_copies(hlo, x.shape, _HLO_DTYPES[x.dtype.name])
                       for x in state_leaves)
    return ModelAudit(variant, layer_loop_launches(hlo, cfg.num_layers),
                      layer_loop_copies(hlo, cfg.num_layers), copies, state_bytes,
                      state_copies)

  rows = [audit("sparse (every position on the device)", deviceless.lower_for_cuda(
      backends._sparse_step, cfg, selector, 1, weights, tokens, sparse))]
  gpu = gpu_impl(top_k, "xla", "pallas", "pallas")
  for variant, impl in (("tiered, GPU default", gpu),
                        ("tiered, fused layer kernels", dataclasses.replace(gpu, fused=True))):
    tier_cfg = backends.tier_config(cfg, selector, num_req, max_len, shape["hot_slots"],
                                    impl=impl)
    carry = place(abstract_tiered_carry(cfg, tier_cfg, selector, weights))
    rows.append(audit(variant, deviceless.lower_for_cuda(
        backends.tiered_step, cfg, tier_cfg, selector, weights, tokens, carry), tier_cfg))
  # The look-ahead's uncommitted pass of a draft token (Runner(lookahead="draft")).
  tier_cfg = backends.tier_config(cfg, selector, num_req, max_len, shape["hot_slots"],
                                  impl=gpu, lookahead_cap=64)
  carry = place(abstract_tiered_carry(cfg, tier_cfg, selector, weights))
  rows.append(audit("tiered, GPU default, draft pass (look-ahead)",
                    deviceless.lower_for_cuda(backends.tiered_draft_pass, cfg, tier_cfg,
                                              selector, weights, tokens, carry), tier_cfg))
  return rows


def audit_config_bad_pattern(cfg: TierConfig) -> int:
  """Negative control: move the whole host tier to device, then gather (must be > 0)."""
  host, _ = _shardings()
  shape = kv_state.host_tier_shape(cfg)
  tier = jax.ShapeDtypeStruct(shape, cfg.dtype, sharding=host)
  idx = jax.ShapeDtypeStruct((16,), jnp.int32)
  bad = lambda h, i: jax.device_put(h, jax.memory.Space.Device)[0, 0, i]
  hlo = deviceless.compile_for_h200(deviceless.lower_for_cuda(bad, tier, idx))
  return count_whole_host_copies(hlo, shape, hlo_dtype(cfg))


def gpu_impl(top_k: int, resolve: str, attention: str, fetch: str) -> ImplConfig:
  """The implementations as a GPU run picks them (kernels compiled, not interpreted)."""
  return ImplConfig(resolve=resolve, attention=attention, fetch=fetch, interpret=False,
                    fetch_chunk=top_k)


def audit_configs(smoke: bool):
  """(variant, TierConfig) pairs: the GPU default first, then the alternatives."""
  shape = (dict(num_layers=2, num_requests=2, max_len=1024, num_q_heads=4, num_kv_heads=2,
                head_dim=64, hot_slots=128, top_k=64) if smoke else
           dict(num_layers=4, num_requests=4, max_len=32768, num_q_heads=8,
                num_kv_heads=2, head_dim=128, hot_slots=2048, top_k=512))
  impl = functools.partial(gpu_impl, shape["top_k"])
  base = TierConfig(**shape, dtype=jnp.bfloat16, impl=impl("xla", "xla", "xla"))
  fused = dataclasses.replace(impl("xla", "pallas", "pallas"), fused=True)
  ahead = dict(lookahead_cap=shape["top_k"] // 4, overlap_hit_miss=True, index_share=2)
  return [
      ("GPU default: xla resolve, pallas attention, zero-copy fetch",
       base.replace(impl=impl("xla", "pallas", "pallas"))),
      ("fused layer kernels (resolve + zero-copy fetch + commit), pallas attention",
       base.replace(impl=fused)),
      ("xla kernels, host-gather fetch", base),
      ("pallas kernels, zero-copy fetch", base.replace(impl=impl("pallas", "pallas",
                                                                  "pallas"))),
      ("pallas kernels, host-gather fetch, per-KV-head units",
       base.replace(impl=impl("pallas", "pallas", "xla"), per_kv_head=True)),
      ("xla kernels, host-gather fetch, overlapped hit/miss attention",
       base.replace(overlap_hit_miss=True)),
      ("xla kernels, host-gather fetch, index shared by 2 layers",
       base.replace(index_share=2)),
      ("GPU default, zero-copy gather on CUDA stream 1, overlapped hit/miss attention",
       base.replace(impl=dataclasses.replace(impl("xla", "pallas", "pallas"),
                                             fetch_stream=1), overlap_hit_miss=True)),
      ("fused layer kernels, freq policy (victim-key kernel + one sort per row)",
       base.replace(impl=fused, policy=PolicyConfig("freq"))),
      (("fused layer kernels, rank policy (victim-key kernel with the rank lookup + "
        "one sort per row)"),
       base.replace(impl=fused,
                    policy=PolicyConfig("rank", rank_depth=4 * shape["top_k"]))),
      # Writes after reads of the hot cache (the prefetch after the attention, the
      # sharing layers' fetch): each of these copied the whole hot cache once.
      ("GPU default, lookahead prefetch, overlapped hit/miss attention, index "
       "shared by 2 layers", base.replace(impl=impl("xla", "pallas", "pallas"),
                                          **ahead)),
      ("xla kernels, host-gather fetch, lookahead prefetch, overlapped hit/miss "
       "attention, index shared by 2 layers", base.replace(**ahead)),
  ]


def main(argv):
  del argv
  # Compile-only: never try to open a GPU (without a driver the CUDA plugin's
  # initialisation fails); the H200 target comes from deviceless.py.
  jax.config.update("jax_platforms", "cpu")
  if not deviceless.available():
    print("hlo_audit: no compile-only CUDA client (pip install -e .[audit])")
    sys.exit(2)
  configs = audit_configs(FLAGS.smoke)
  rows = [audit_config(cfg, name) for name, cfg in configs]
  control = audit_config_bad_pattern(configs[0][1])
  app_copies, app_writes, app_aliased = audit_separate_append(configs[0][1])
  pw_copies, pw_writes, pw_aliased = audit_prompt_write(configs[0][1])
  full_launches = audit_full_kv(configs[0][1])
  print("| variant | whole-host copies | H2D bytes/miss | aliased state | kernels | "
        "HostExecute | async host writes | ops (kernels) overlapping the fetch | "
        "launches/layer | hot-cache copies |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for a in rows:
    print(f"| {a.variant} | {a.whole_host_copies} | {a.host_to_device_bytes_per_miss:.0f} | "
          f"{a.aliased_params}/{a.state_params} | {', '.join(a.kernels) or '-'} | "
          f"{a.host_executes} | {a.async_host_writes} | {a.overlapped_ops} "
          f"({a.overlapped_kernels}) | "
          f"{a.launches_per_layer:g} | {a.hot_cache_copies} |")
  print(f"| full-KV sparse attention (the reference step) | - | - | - | - | - | - | - | "
        f"{full_launches:g} | - |")
  print(f"separate host append jit (the default): {app_copies} whole-host copies, "
        f"{app_writes} async host writes, {app_aliased} state buffers aliased")
  print(f"negative control (device_put of the whole tier, then gather): "
        f"{control} whole-host copies detected")
  print(f"prompt write-through (serving): {pw_copies} whole-host copies, {pw_writes} "
        f"async host writes, {pw_aliased} state buffers aliased")
  graph_rows = [(name, audit_graphs(cfg)) for name, cfg in configs[:2]]
  graph_rows.append(("full-KV sparse attention", audit_graphs(configs[0][1], True)))
  for name, graphs in graph_rows:
    print(f"command buffers, {name}: launches per layer (kernels captured in CUDA "
          "graphs) " + ", ".join(f"{flags_} flags {n} ({c})"
                                 for flags_, (n, c) in graphs.items()))
  conds, waited, waited_graphs = audit_sampler(FLAGS.smoke)
  print(f"serving sampler (one step's draw): {conds} lax.conds; conditionals the host "
        f"waits on (a predicate copied to it): {waited} with default command buffers, "
        f"{waited_graphs} with conditionals allowed into them")
  dp_copies = 0
  for data, model in ((8, 1), (4, 2)):
    copies_, in_loop, total, launches_, on_host = audit_sharded(configs[0][1], data, model)
    dp_copies += copies_
    where = ("in pinned host memory" if on_host else "compiled in device memory: the "
             "compile-only devices drop pinned_host, so only the step's own copies count")
    print(f"sharded over 8 H200s (shard_map, data={data}, model={model}; "
          f"{configs[0][0]}; tier {where}): {copies_} whole-host copies, "
          "collectives per layer: "
          f"{', '.join(in_loop) or 'none'}; collectives per step: {total}; "
          f"launches per layer {launches_:g}")
  model_rows = audit_model(FLAGS.smoke)
  shape = model_audit_shape(FLAGS.smoke)
  print(f"\nSmolLM2-135M decode step (f32, Quest, R={shape['num_requests']}, "
        f"T={shape['max_len']}, B={shape['hot_slots']}, k={shape['top_k']}; selector "
        f"state {model_rows[0].selector_state_bytes / 2**20:.1f} MiB per array):")
  print("| backend | launches/layer | copies in the layer loop | copied MiB per layer | "
        "selector-state copies | whole-host copies |")
  print("|---|---|---|---|---|---|")
  for m in model_rows:
    print(f"| {m.variant} | {m.launches_per_layer:g} | {len(m.loop_copies)} | "
          f"{sum(m.loop_copies) / 2**20:.2f} | {m.state_copies} | "
          f"{m.whole_host_copies} |")
  copies = (sum(a.whole_host_copies for a in rows) + app_copies + pw_copies + dp_copies
            + sum(m.whole_host_copies for m in model_rows))
  per_miss = max(a.host_to_device_bytes_per_miss for a in rows)
  unaliased = sum(a.state_params - a.aliased_params for a in rows)
  chunk = configs[1][1].fetch_rows_per_chunk
  print(f"host->device bytes per layer per step: host-gather fetch "
        f"ceil(misses/{chunk})*{chunk}*{configs[0][1].row_bytes * 2} (+{chunk}*16 index "
        f"bytes device->host per gather); zero-copy fetch misses*{per_miss:.0f}")
  fused = next(a for (_, cfg), a in zip(configs, rows) if cfg.impl.fused)
  print(f"hlo_audit: whole_host_copies={copies} host_to_device_bytes_per_miss={per_miss:.0f}"
        f" kernels_per_layer={rows[0].launches_per_layer:g}/{full_launches:g}"
        f" fused_kernels_per_layer={fused.launches_per_layer:g}")
  if copies or unaliased or control == 0:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
