"""Requests over a mesh (kvtier_jax/sharding.py, models/sharded_serving.py) on fake
CPU devices, each in a subprocess (jax fixes its device count when it starts): the
sharded tiered step equals the one-device step in every array, refusals included,
and the data-parallel engine on SmolLM2 yields each request's one-device tokens."""

import json
import re

import pytest

from kvtier_jax import sharding
from tests.test_experiments import only_run, run


def test_parse_mesh_and_clear_errors():
  assert sharding.parse_mesh("data:2,model:2") == {"data": 2, "model": 2}
  assert sharding.parse_mesh(None) == {"data": 1, "model": 1}
  for bad in ("data", "rows:2", "data:0", "data:x"):
    with pytest.raises(ValueError, match="axis"):
      sharding.parse_mesh(bad)
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    sharding.make_mesh({"data": 64})


def test_sharded_step_equals_the_one_device_step_on_4_devices():
  """4 devices x 2 requests vs 8 requests on one device, 12 steps with random
  selections, NaN-poisoned memory and two refused steps (one request on one device
  repeats a position): outputs bit-equal, every device's hot cache, metadata,
  counters and host pages equal the one-device arrays of its requests."""
  out = run("tests.sharding_worker")
  result = json.loads(out.strip().splitlines()[-1])
  assert result["refused"] == 2 and result["misses"] > 0, result


def test_serve_data_parallel_smoke_is_exact(tmp_path):
  """``serve --mesh=data:2``: SmolLM2 requests over 2 devices (each with its own host
  tier), every request's tokens equal to its one-device sparse run."""
  out = run("experiments.serve", "--smoke", "--mesh=data:2", "--check_exact",
            f"--out_root={tmp_path}")
  last = out.strip().splitlines()[-1]
  match = re.search(r"requests=(\d+) .* exact=(\d+)/(\d+)", last)
  assert match, last
  requests, matched, finished = map(int, match.groups())
  assert matched == finished == requests == 4, last
  _, rows = only_run(tmp_path, "serve")
  assert rows[0]["misses"] > 0
  assert "mesh={'data': 2, 'model': 1}" in out
