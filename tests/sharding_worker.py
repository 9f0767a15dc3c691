"""The data-parallel tiered step on fake CPU devices against the one-device step
(run by tests/test_sharding.py in a subprocess: the device count is fixed when jax
starts). Prints one JSON line of results; any mismatch raises."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4").strip()

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kvtier_jax import decode, selectors, sharding  # noqa: E402
from kvtier_jax import state as kv_state  # noqa: E402
from kvtier_jax.config import TierConfig  # noqa: E402

DEVICES, PER_DEVICE = 4, 2
CFG = TierConfig(num_layers=2, num_requests=DEVICES * PER_DEVICE, max_len=64,
                 num_q_heads=4, num_kv_heads=2, head_dim=16, hot_slots=12, top_k=8,
                 dtype=jnp.float32, page_size=8, per_kv_head=True, impl="xla")
LOCAL = CFG.replace(num_requests=PER_DEVICE, mesh_axes=(sharding.DATA,))


def step_fn(cfg, selector):
  def step(carry, q, k, v):
    out, carry = decode.decode_step(cfg, selector, carry, q, k, v)
    committed = carry.ok & carry.active
    return out, carry.replace(tier=decode.append_newest(cfg, carry.tier, committed))
  return step


def to_local(tier_np, device):
  """Device ``device``'s part of the one-device state (numpy): its requests and the
  host pages they own (a fixed page table: contiguous), plus a scratch page."""
  rows = slice(device * PER_DEVICE, (device + 1) * PER_DEVICE)
  per = LOCAL.num_host_pages
  out = {}
  for name, x in tier_np.items():
    if name in ("host_k", "host_v"):
      out[name] = np.concatenate([x[:, device * per:(device + 1) * per], x[:, -1:]], 1)
    elif name == "page_table":
      out[name] = x[rows] - device * per
    elif name == "seq_len":
      out[name] = x[rows]
    elif name == "fetched_rows":
      out[name] = np.zeros_like(x)
    else:
      out[name] = x[:, rows]
  return out


def with_table(carry, sharded_carry, table):
  """Both carries with the global page table ``table`` (-1: no page); each device
  holds its requests' rows in its own page ids."""
  owner = np.repeat(np.arange(DEVICES), PER_DEVICE)[:, None]
  local = np.where(table >= 0, table - owner * LOCAL.num_host_pages, -1).astype(np.int32)
  old = sharded_carry.tier.page_table
  return (carry.replace(tier=carry.tier.replace(page_table=jnp.asarray(table))),
          sharded_carry.replace(tier=sharded_carry.tier.replace(
              page_table=jax.device_put(local, old.sharding))))


def main():
  rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else None)
  mesh = sharding.make_mesh({sharding.DATA: DEVICES})
  selector = selectors.GivenSelector(CFG.top_k, CFG.num_units)
  L, R, D = CFG.num_layers, CFG.num_requests, CFG.head_dim
  lens = rng.integers(CFG.top_k + 1, 40, R)
  k_prompt = rng.standard_normal((L, R, 48, CFG.num_kv_heads, D)).astype(np.float32)
  v_prompt = rng.standard_normal(k_prompt.shape).astype(np.float32)
  tier = kv_state.init_state(CFG, fill=np.nan)  # never-written memory poisons
  tier = jax.jit(functools.partial(decode.prefill, CFG))(tier, k_prompt, v_prompt,
                                                         jnp.asarray(lens, jnp.int32))
  tier_np = {n: np.asarray(x) for n, x in vars(jax.device_get(tier)).items()}

  # The same state, split over the mesh: device d holds requests 2d, 2d+1.
  probe = lambda c: jax.eval_shape(lambda: decode.init_carry(
      c, kv_state.init_state(c), selector.init_state(L, c.num_requests, c.max_len)))
  axes = sharding.request_axes(probe(LOCAL), probe(LOCAL.replace(num_requests=2 * PER_DEVICE)))
  specs = sharding.mesh_specs(axes, per_device=sharding.per_device_leaves(axes, ("fetched_rows",)))
  locals_ = []
  for d, device in enumerate(mesh.devices.flat):
    part = to_local(tier_np, d)
    host = kv_state.host_sharding(device)
    local_tier = kv_state.TieredKVState(**{
        n: jax.device_put(x, host if n.startswith("host") else device)
        for n, x in part.items()})
    sel = jax.device_put(selector.init_state(CFG.num_layers, PER_DEVICE, CFG.max_len),
                         device)
    with jax.default_device(device):
      locals_.append(decode.init_carry(LOCAL, local_tier, sel))
  sharded_carry = sharding.assemble(mesh, specs, locals_)
  assert sharded_carry.tier.host_k.sharding.memory_kind == "pinned_host"

  one_step = jax.jit(step_fn(CFG, selector), donate_argnums=(0,))
  rows = P(None, sharding.DATA)
  sharded_step = jax.jit(jax.shard_map(
      step_fn(LOCAL, selector), mesh=mesh, in_specs=(specs, rows, rows, rows),
      out_specs=(rows, specs), check_vma=False), donate_argnums=(0,))
  carry = decode.init_carry(CFG, tier, selector.init_state(CFG.num_layers,
                                                          CFG.num_requests, CFG.max_len))
  seq = lens.copy()
  refused = 0
  for step in range(12):
    sel = np.full((L, R, CFG.num_units, CFG.top_k), -1,
                  np.int32)
    for idx in np.ndindex(sel.shape[:3]):
      count = int(rng.integers(1, CFG.top_k + 1))
      sel[idx][:count] = rng.choice(seq[idx[1]] + 1, count, replace=False)
    if step in (4, 9):  # one request on one device repeats a position: all refuse
      r = int(rng.integers(R))
      sel[1, r, 0, :2] = sel[1, r, 0, 0]
    q, k, v = (rng.standard_normal((L, R, h, D)).astype(np.float32)
               for h in (CFG.num_q_heads, CFG.num_kv_heads, CFG.num_kv_heads))
    carry = carry.replace(sel=jnp.asarray(sel))
    sharded_carry = sharded_carry.replace(sel=jax.device_put(
        sel, jax.sharding.NamedSharding(mesh, P(None, sharding.DATA))))
    table = np.asarray(carry.tier.page_table)
    if step == 7:  # one request's newest position has no page: every device refuses
      gap = table.copy()
      r = int(rng.integers(R))
      gap[r, seq[r] // CFG.page_size] = -1
      carry, sharded_carry = with_table(carry, sharded_carry, gap)
    want, carry = one_step(carry, q, k, v)
    got, sharded_carry = sharded_step(sharded_carry, q, k, v)
    if step == 7:
      carry, sharded_carry = with_table(carry, sharded_carry, table)
    status, got_status = int(carry.status), int(sharded_carry.status)
    if status != got_status:
      raise AssertionError(f"step {step}: status {got_status} != one device's {status}")
    refused += bool(status)
    if not status:
      seq += 1
      if not np.array_equal(np.asarray(got), np.asarray(want)):
        raise AssertionError(f"step {step}: outputs differ")
    one = {n: np.asarray(x) for n, x in vars(jax.device_get(carry.tier)).items()}
    split = sharding.split(sharded_carry.tier, mesh)
    for d in range(DEVICES):
      mine = {n: np.asarray(x) for n, x in vars(jax.device_get(split[d])).items()}
      for name, x in to_local(one, d).items():
        if name == "fetched_rows":
          continue
        if name.startswith("host"):  # the scratch page absorbs writes, never read
          mine[name], x = mine[name][:, :-1], x[:, :-1]
        if not np.array_equal(mine[name], x, equal_nan=True):
          raise AssertionError(f"step {step}: device {d}'s {name} differs")
  rows_moved = int(np.asarray(sharded_carry.tier.fetched_rows).sum())
  print(json.dumps(dict(steps=12, refused=refused, seq=seq.tolist(),
                        fetched_rows=rows_moved,
                        misses=int(np.asarray(carry.tier.misses).sum()))))


if __name__ == "__main__":
  main()
