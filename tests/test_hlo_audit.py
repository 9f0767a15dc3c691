"""Deviceless H200 compile of the decode step: no whole-host-tier copy, every state
buffer aliased in place, the kernels present. Needs the CUDA plugin (the `audit`
extra, installed by CI); skipped without it."""

import jax.numpy as jnp
import pytest

from experiments import deviceless, hlo_audit
from kvtier_jax.state import TieredKVState

# The cache's buffers (host tier K/V, page table, hot cache, metadata, counters).
NUM_STATE = len(TieredKVState.__dataclass_fields__)

pytestmark = pytest.mark.skipif(not deviceless.available(),
                                reason="needs jax-cuda12-plugin (pip install -e .[audit])")


@pytest.mark.parametrize("variant", range(6))
def test_decode_step_compiles_for_h200_without_whole_tier_copies(variant):
  name, cfg = hlo_audit.audit_configs(smoke=True)[variant]
  audit = hlo_audit.audit_config(cfg, name)
  assert audit.whole_host_copies == 0
  assert audit.aliased_params == audit.state_params == NUM_STATE
  assert audit.host_to_device_bytes_per_miss == 2 * cfg.row_bytes
  if cfg.impl.fetch == "pallas":
    assert "fetch_rows" in audit.kernels and audit.host_executes == 0
  else:
    assert audit.host_executes >= 1
  assert ("cache_resolve" in audit.kernels) == (cfg.impl.resolve == "pallas")
  assert ("sparse_decode_attention" in audit.kernels) == (cfg.impl.attention == "pallas")
  # Overlapped hit/miss attention, and the shared layers' fetch issued at the
  # anchor: compute is scheduled while a host gather is in flight (with the
  # latency-hiding scheduler the audit enables).
  assert (audit.overlapped_ops > 0) == (cfg.overlap_hit_miss or cfg.index_share > 1)


def test_separate_append_writes_in_place():
  _, cfg = hlo_audit.audit_configs(smoke=True)[0]
  copies, writes, aliased = hlo_audit.audit_separate_append(cfg)
  assert copies == 0 and writes > 0 and aliased == NUM_STATE


def test_prompt_write_through_writes_pages_in_place():
  _, cfg = hlo_audit.audit_configs(smoke=True)[0]
  copies, writes, aliased = hlo_audit.audit_prompt_write(cfg, chunk=2 * cfg.page_size)
  assert copies == 0 and writes > 0 and aliased == NUM_STATE


def test_audit_detects_a_whole_tier_copy():
  """The negative control: the counter is not blind."""
  _, cfg = hlo_audit.audit_configs(smoke=True)[0]
  assert hlo_audit.audit_config_bad_pattern(cfg) > 0


def test_f32_tier_shape_is_matched():
  _, cfg = hlo_audit.audit_configs(smoke=True)[0]
  assert hlo_audit.audit_config_bad_pattern(cfg.replace(dtype=jnp.float32)) > 0
