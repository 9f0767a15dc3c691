"""The jitted tiered decode step against full-KV sparse attention, and its contracts:
nothing lost in the host tier, no fetch while short, refused input leaves the cache
unchanged, donation and no retracing."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax import decode, driver, full_kv, selectors
from kvtier_jax import state as kv_state
from kvtier_jax.config import ImplConfig
from kvtier_jax.policies import PolicyConfig
from pallas_kernels import common
from pallas_kernels.fused_resolve import native
from tests.util import (Harness, assert_same, draw_selection, random_kv, snapshot,
                        step_inputs, tier_cfg)

make_cfg = tier_cfg


@pytest.mark.parametrize("per_kv_head", [False, True])
@pytest.mark.parametrize("slots_per_k", [1, 2])
def test_tiered_decode_equals_full_kv_sparse_attention(slots_per_k, per_kv_head):
  # Prompts from shorter than B to 16x B; 200 steps take the short one past B.
  cfg = make_cfg(hot_slots=16 * slots_per_k, per_kv_head=per_kv_head)
  lens = [10, 16 * slots_per_k * 8, 300]
  h = Harness(cfg, lens, seed=slots_per_k + 2 * per_kv_head)
  worst = 0.0
  for _ in range(200):
    out, ref = h.step()
    worst = max(worst, float(np.abs(out - ref).max()))
  assert worst <= 1e-5
  stats = kv_state.cache_stats(cfg, h.state)
  assert stats["misses"] > 0 and stats["hits"] > 0
  # Nothing lost: the host tier holds every committed position, bit for bit.
  full_k, full_v = np.asarray(h.full.k), np.asarray(h.full.v)
  for r, n in enumerate(h.decoder.seq_len):
    host_k, host_v = kv_state.host_rows(cfg, h.state, r, int(n))
    np.testing.assert_array_equal(host_k, full_k[:, r, :n])
    np.testing.assert_array_equal(host_v, full_v[:, r, :n])
  np.testing.assert_array_equal(np.asarray(h.state.seq_len), h.decoder.seq_len)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_kernel_paths_match_reference(impl, overlap):
  cfg = make_cfg(impl=impl, overlap_hit_miss=overlap)
  h = Harness(cfg, [40, 100, 7], seed=5)
  for _ in range(25):
    out, ref = h.step()
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-6)


def test_overlapped_attention_in_bf16_rounds_once():
  """bf16 queries and KV: the hit and miss partials are merged in f32 and rounded
  to bf16 once, as the full-KV reference rounds its f32 result once. Outputs then
  agree but for the odd 1-ulp flip of a sum taken in another order (the partials
  rounded to bf16 before the merge moved ~20% of them)."""
  cfg = make_cfg(impl="xla", overlap_hit_miss=True, dtype=jnp.bfloat16)
  h = Harness(cfg, [40, 100, 7], seed=int(np.random.default_rng().integers(2**31)))
  differ = total = 0
  for _ in range(25):
    out, ref = h.step()
    assert out.dtype == ref.dtype == jnp.bfloat16
    differ += int((out != ref).sum())
    total += out.size
  assert differ <= total // 200, (differ, total)


def test_streamed_zero_copy_gather_is_the_host_gather_path():
  """impl.fetch_stream (the zero-copy gather into a staging buffer; the kernel
  interpreted here, so inline): outputs bit-equal to the host-gather overlapped
  step, which attends over the same staged rows, and every cache array equal;
  both within tolerance of full-KV sparse attention. Bad configs refused."""
  seed = int(np.random.default_rng().integers(2**31))
  # The host gather in one chunk of every lane (3 x 16): it then counts the misses
  # as moved, as the kernel does (staged chunks count their padding).
  impls = (ImplConfig.every("xla", fetch_chunk=48),
           ImplConfig(resolve="xla", attention="xla", fetch="pallas", fetch_stream=1))
  harnesses = [Harness(make_cfg(impl=impl, overlap_hit_miss=True), [40, 100, 7],
                       seed=seed) for impl in impls]
  for _ in range(25):
    (out_a, ref), (out_b, _) = (h.step() for h in harnesses)
    np.testing.assert_allclose(out_a, ref, atol=1e-5, rtol=1e-6)
    np.testing.assert_array_equal(out_b, out_a)
  a, b = (h.state for h in harnesses)
  assert_same(snapshot(a), snapshot(b))
  assert int(np.asarray(a.misses).sum()) > 0
  with pytest.raises(ValueError, match="overlap_hit_miss"):
    make_cfg(impl=impls[1])
  with pytest.raises(ValueError, match="zero-copy"):
    ImplConfig(fetch="xla", fetch_stream=1)


@pytest.mark.parametrize("index_share", [1, 2])
def test_picked_layer_inputs_are_the_sliced_ones(index_share):
  """The layer loop's inputs picked by a masked integer sum (the default: one CUDA
  graph per layer) or sliced as ``lax.scan`` does (``slice_layer_inputs``): the
  same outputs and cache, bit for bit, with and without index sharing."""
  seed = int(np.random.default_rng().integers(2**31))
  harnesses = [Harness(make_cfg(index_share=index_share,
                                impl=ImplConfig(slice_layer_inputs=sliced)),
                       [40, 100, 7], seed=seed) for sliced in (False, True)]
  cfg, rng = harnesses[0].cfg, np.random.default_rng(seed + 1)
  for _ in range(12):
    sel = draw_selection(rng, cfg, harnesses[0].decoder.seq_len, harnesses[0].prev)
    for layer in range(cfg.num_layers):  # the shared layers attend their anchor's
      sel[layer] = sel[layer - layer % index_share]
    (out_a, ref), (out_b, _) = (h.step(sel.copy()) for h in harnesses)
    np.testing.assert_allclose(out_a, ref, atol=1e-5, rtol=1e-6)
    np.testing.assert_array_equal(out_b, out_a)
  assert_same(*(snapshot(h.state) for h in harnesses))


def test_resolve_lookup_changes_nothing_in_the_step():
  """The map and search lookups give the same metadata, exactly."""
  seed = int(np.random.default_rng().integers(2**31))
  harnesses = [Harness(make_cfg(impl=ImplConfig(resolve="xla", lookup=lk, fetch_chunk=8)),
                       [40, 100, 7], seed=seed) for lk in ("search", "map")]
  for _ in range(20):
    (out_a, ref_a), (out_b, _) = (h.step() for h in harnesses)
    np.testing.assert_allclose(out_b, ref_a, atol=1e-5, rtol=1e-6)
    np.testing.assert_array_equal(out_a, out_b)
  a, b = (h.state for h in harnesses)
  for name in ("slot_pos", "lru", "hits", "misses"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
  assert int(np.asarray(a.misses).sum()) > 0


def test_short_context_never_fetches():
  cfg = make_cfg(hot_slots=64, top_k=16)
  h = Harness(cfg, [5, 20, 30], seed=1)
  for _ in range(30):  # longest reaches 60 <= B
    out, ref = h.step()
    np.testing.assert_allclose(out, ref, atol=1e-6)
  stats = kv_state.cache_stats(cfg, h.state)
  assert stats["misses"] == 0 and stats["fetched_rows"] == 0
  # Every position is resident at slot == position.
  slot_pos = np.asarray(h.state.slot_pos)
  for r, n in enumerate(h.decoder.seq_len):
    np.testing.assert_array_equal(slot_pos[:, r, 0, :n], np.broadcast_to(np.arange(n), (4, n)))
  out, ref = h.step()  # the longest request passes B: fetching may begin
  np.testing.assert_allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("warm,expected", [
    ("first", [0, 1, 2, 3, 4, 5, 6, 7]),
    ("head_tail", [0, 1, 2, 3, 16, 17, 18, 19]),
    ("empty", [-1] * 8),
])
def test_prefill_warm_start(warm, expected):
  cfg = make_cfg(num_requests=2, hot_slots=8, top_k=4, warm_start=warm)
  pos = np.asarray(decode.warm_positions(cfg, jnp.array([20, 5])))
  np.testing.assert_array_equal(pos[0], expected)
  np.testing.assert_array_equal(pos[1], [0, 1, 2, 3, 4, -1, -1, -1])  # fits: resident
  exact = np.asarray(decode.warm_positions(cfg, jnp.array([8, 9])))  # B = 8 fits too
  np.testing.assert_array_equal(exact[0], np.arange(8))


@pytest.mark.parametrize("bad,match", [
    ("out_of_range", "out of range"), ("duplicate", "twice"), ("shape", "must be")])
def test_bad_selection_is_refused_before_any_change(bad, match):
  cfg = make_cfg()
  h = Harness(cfg, [40, 50, 60])
  h.step()
  sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
  if bad == "out_of_range":
    sel[2, 1, 0, 0] = h.decoder.seq_len[1] + 5
  elif bad == "duplicate":
    sel[1, 0, 0, :2] = sel[1, 0, 0, 2]
  else:
    sel = sel[..., :-1]
  before = snapshot(h.state)
  with pytest.raises(ValueError, match=match):
    h.decoder.step(h.state, jnp.zeros((4, 3, 4, 16)), jnp.zeros((4, 3, 2, 16)),
                   jnp.zeros((4, 3, 2, 16)), sel)
  assert_same(before, snapshot(h.state))


def test_a_stateless_selector_refuses_given_selections():
  """Selections given to a decoder whose selector picks its own would be ignored."""
  cfg = make_cfg(top_k=8)
  churn = selectors.ChurnSelector(40, cfg.select_width, cfg.num_units)
  decoder = driver.TieredDecoder(cfg, churn)
  rng = np.random.default_rng()
  kp, vp = random_kv(rng, cfg, 40)
  state = decoder.prefill(kv_state.init_state(cfg), kp, vp, [40, 40, 40])
  sel = np.zeros((cfg.num_layers, 3, cfg.num_units, 8), np.int32)
  with pytest.raises(ValueError, match="ChurnSelector picks the positions itself"):
    decoder.step(state, *step_inputs(rng, cfg), sel)
  out, state = decoder.step(state, *step_inputs(rng, cfg))  # state not donated
  assert decoder.seq_len.tolist() == [41, 41, 41] and np.isfinite(out).all()


def test_a_trace_time_error_leaves_the_callers_state():
  """Errors found while tracing the step (a prefetch wider than B, a query of
  another head count, float selections) are raised before the state is donated:
  it stays usable, and the next step is exact. A jax ``active`` mask given to the
  driver is copied into the donated carry, not consumed."""
  cfg = make_cfg()
  h = Harness(cfg, [40, 50, 60])
  h.step()
  sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
  q, kn, vn = step_inputs(h.rng, cfg)
  wide = jnp.zeros((cfg.num_layers, cfg.num_requests, 1, cfg.hot_slots + 1), jnp.int32)
  before = snapshot(h.state)
  for call, match in (
      (lambda: h.decoder.step(h.state, q, kn, vn, sel, prefetch=wide), "exceed B"),
      (lambda: h.decoder.step(h.state, q, kn, vn, sel, prefetch=wide[:2, ..., :4]),
       "prefetch"),
      (lambda: h.decoder.step(h.state, jnp.zeros((4, 3, 8, 16)), kn, vn, sel),
       "q / k_new / v_new have shapes"),
      (lambda: h.decoder.step(h.state, q, kn, vn, sel + 0.5), "integers")):
    with pytest.raises(ValueError, match=match):
      call()
    assert_same(before, snapshot(h.state))
  out, ref = h.step(sel, (q, kn, vn))
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
  # The driver underneath, with a jax mask.
  carry = decode.init_carry(cfg, h.state, jnp.asarray(sel), None)
  active = jnp.asarray([True, False, True])
  step = driver._decode_step
  drv = driver.TieredDriver(cfg, lambda c, *a: step(cfg, h.decoder.selector, c, *a))
  drv.start(h.decoder.seq_len)
  _, carry = drv.step(carry, q, kn, vn, active=active)
  np.testing.assert_array_equal(np.asarray(active), [True, False, True])
  np.testing.assert_array_equal(drv.seq_len, h.decoder.seq_len + [1, 0, 1])


def test_capacity_exceeded_is_refused():
  cfg = make_cfg(max_len=64)
  h = Harness(cfg, [60, 63, 10])
  h.step()  # request 1 reaches 64 = max_len
  before = snapshot(h.state)
  with pytest.raises(ValueError, match="exceeds max_len"):
    h.step()
  assert_same(before, snapshot(h.state))
  with pytest.raises(ValueError, match="exceed"):
    h.decoder.prefill(h.state, *random_kv(h.rng, cfg, 80), [70, 5, 5])
  # Inside jit too (the driver's host check aside): a request at max_len refuses
  # with the capacity bit and commits nothing.
  sel = np.full((cfg.num_layers, cfg.num_requests, 1, cfg.top_k), -1, np.int32)
  sel[..., 0] = 0
  carry = decode.init_carry(cfg, h.state, jnp.asarray(sel))
  _, carry = jax.jit(functools.partial(decode.decode_step, cfg, h.decoder.selector))(
      carry, *step_inputs(h.rng, cfg))
  assert int(carry.status) & decode.STATUS_CAPACITY
  np.testing.assert_array_equal(np.asarray(carry.tier.seq_len), before.seq_len)


# The fused layer step: off GPU the native call (pallas_kernels/fused_resolve/
# native.py), or the Pallas kernels interpreted.
FUSED = ImplConfig(attention="xla", fused=True)
FUSED_PALLAS = ImplConfig(attention="xla", fused=True, interpret=True)


@pytest.mark.parametrize("impl", ["auto", FUSED])
def test_a_miss_without_a_host_page_is_refused_not_read(impl):
  """A position whose page is missing from the page table is never read from the
  scratch page: the step refuses (capacity), and nothing is committed."""
  cfg = make_cfg(impl=impl)
  h = Harness(cfg, [200, 260, 300], seed=4)
  h.step()
  sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
  held = np.asarray(h.state.slot_pos)[0, 1, 0]
  missing = next(p for p in range(200) if p not in held)
  others = [p for p in sel[0, 1, 0] if p != missing][:cfg.top_k - 1]
  sel[0, 1, 0] = [missing] + others + [-1] * (cfg.top_k - 1 - len(others))
  table = np.asarray(h.state.page_table).copy()
  table[1, missing // cfg.page_size] = -1
  h.state = h.state.replace(page_table=jnp.asarray(table))
  before = snapshot(h.state)
  with pytest.raises(driver.StepRefused, match="host page") as err:
    h.decoder.step(h.state, *step_inputs(h.rng, cfg), sel)
  after = snapshot(err.value.state)
  np.testing.assert_array_equal(after.seq_len, before.seq_len)
  np.testing.assert_array_equal(after.misses, before.misses)


@pytest.mark.parametrize("impl", ["auto", FUSED])
def test_a_newest_row_that_would_exist_nowhere_is_refused(impl):
  """The newest token's row goes to slot B, its install slot and its host page.
  Without a page it survives only in an install slot, safe only for a request
  with no pages at all (its positions all resident): a paged request whose newest
  page is missing, or an unpaged one whose B slots are full, refuses before any
  change; with the page given, the retried step is exact. A prompt position
  without a page is refused at prefill."""
  cfg = make_cfg(impl=impl, host_pages=24, page_size=16, max_len=200)
  rng = np.random.default_rng()
  kp, vp = random_kv(rng, cfg, 40)
  table = np.full((cfg.num_requests, cfg.pages_per_request), -1, np.int32)
  table[0, :1] = [5]  # positions 0..15: the newest (16 < B) has no page
  table[2, :3] = [1, 2, 3]
  decoder = driver.TieredDecoder(cfg)
  base = kv_state.init_state(cfg, fill=np.nan)
  lens = [16, cfg.hot_slots, 40]  # request 1: no pages, its 32 slots full
  with pytest.raises(ValueError, match="needs 3 pages"):
    decoder.prefill(base.replace(page_table=jnp.asarray(table)), kp, vp, [40, 8, 40])
  last_missing = table.copy()
  last_missing[0, :2] = [5, 6]  # positions 32..39 would go to the scratch page
  with pytest.raises(ValueError, match="needs 3 pages"):
    decoder.prefill(base.replace(page_table=jnp.asarray(last_missing)), kp, vp,
                    [40, 8, 40])
  with pytest.raises(ValueError, match="no host pages"):
    decoder.prefill(base.replace(page_table=jnp.asarray(table)), kp, vp, [16, 33, 40])
  full = full_kv.init_full_kv(cfg, kp, vp, jnp.asarray(lens), fill=np.nan)
  state = decoder.prefill(base.replace(page_table=jnp.asarray(table)), kp, vp, lens)
  sel = np.full((cfg.num_layers, cfg.num_requests, 1, cfg.top_k), -1, np.int32)
  sel[..., 0, :3] = [[0, 7, 16], [1, 5, 32], [39, 3, 40]]
  inputs = step_inputs(rng, cfg)
  only_1, only_0 = table.copy(), table.copy()
  only_1[0, :2] = [5, 9]  # request 0 paged: request 1 alone has no slot left
  only_0[1, :3] = [12, 13, 14]  # request 1 paged: request 0 alone lacks its page
  for gaps in (only_1, only_0):
    state = state.replace(page_table=jnp.asarray(gaps))
    before = snapshot(state)
    with pytest.raises(driver.StepRefused, match="the newest") as err:
      decoder.step(state, *inputs, sel)
    state = err.value.state
    after = snapshot(state)
    rows = ("host_k", "host_v", "hot_k", "hot_v")
    assert_same(before, after, [f for f in before.__dataclass_fields__ if f not in rows])
    for name in rows:  # but the scratch page and reserved slot B, which a step writes
      keep = np.s_[:, :24] if name.startswith("host") else np.s_[..., :cfg.hot_slots, :, :]
      np.testing.assert_array_equal(getattr(after, name)[keep],
                                    getattr(before, name)[keep], err_msg=name)
  table[0, :2], table[1, :3] = [5, 9], [12, 13, 14]
  state = state.replace(page_table=jnp.asarray(table))
  out, state = decoder.step(state, *inputs, sel)
  ref, _ = full_kv.full_kv_decode_step(cfg, selectors.GivenSelector(cfg.top_k), full,
                                       *inputs, jnp.asarray(sel))
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(state.seq_len), [17, 33, 41])
  host_k, _ = kv_state.host_rows(cfg, state, 0, 17)  # the newest reached its page
  np.testing.assert_array_equal(host_k[:, 16], np.asarray(inputs[1][:, 0]).reshape(
      host_k[:, 16].shape))


@pytest.mark.parametrize("impl", ["auto", FUSED])
def test_selector_bug_inside_jit_is_refused_and_recoverable(impl):
  """A selector that goes out of range at layer 2: StepRefused, seq_len and the
  refusing layers unchanged, and decoding continues exactly afterwards."""
  cfg = make_cfg(impl=impl)
  h = Harness(cfg, [40, 50, 60])
  for _ in range(3):
    h.step()

  @dataclasses.dataclass(frozen=True)
  class Buggy(selectors.GivenSelector):
    def select(self, state, layer, inputs, params=None):
      sel = state[layer]  # layer indexes the state (a one-layer view here)
      return jnp.where(inputs.layer == 2, sel.at[..., 0].set(10_000), sel), state

  bad_decoder = driver.TieredDecoder(cfg, Buggy(cfg.top_k))
  bad_decoder.seq_len = h.decoder.seq_len.copy()
  sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
  before = snapshot(h.state)
  with pytest.raises(driver.StepRefused, match="out of range") as err:
    bad_decoder.step(h.state, jnp.ones((4, 3, 4, 16)), jnp.ones((4, 3, 2, 16)),
                     jnp.ones((4, 3, 2, 16)), sel)
  after = snapshot(err.value.state)
  np.testing.assert_array_equal(after.seq_len, before.seq_len)
  for name in ("slot_pos", "lru", "hits", "misses"):
    np.testing.assert_array_equal(getattr(after, name)[2:], getattr(before, name)[2:])
  for r, n in enumerate(h.decoder.seq_len):  # committed host rows untouched
    for a, b in zip(kv_state.host_rows(cfg, after, r, int(n)),
                    kv_state.host_rows(cfg, before, r, int(n))):
      np.testing.assert_array_equal(a, b)
  h.state = err.value.state
  for _ in range(20):
    out, ref = h.step()
    np.testing.assert_allclose(out, ref, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class _RefusesAtLayer2(selectors.GivenSelector):
  def select(self, state, layer, inputs, params=None):
    sel = state[layer]
    return jnp.where(inputs.layer == 2, sel.at[..., 0].set(10_000), sel), state


@pytest.mark.parametrize("overrides", [dict(overlap_hit_miss=True), dict(index_share=2),
                                       dict(index_share=2, prefetch=True)])
def test_a_refused_layer_counts_no_fetched_rows_on_the_gpu_paths(overrides):
  """A GPU's staged gathers run their first chunk whatever the count (the
  overlapped attention's, the sharing layers', and their lookahead prefetch's): a
  layer that refuses counts no rows moved, as it changes nothing else (the GPU's
  code paths traced here)."""
  overrides = dict(overrides)
  prefetch = overrides.pop("prefetch", False)
  cfg = make_cfg(impl="xla", **overrides)
  h = Harness(cfg, [40, 50, 60], seed=int(np.random.default_rng().integers(2**31)))
  for _ in range(3):
    h.step()
  sel = jnp.asarray(draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev))
  before = snapshot(h.state)
  inputs = step_inputs(h.rng, cfg)
  with common.tracing_for_gpu():  # a fresh jit: traced inside
    # A prediction: the selected positions already in the host tier.
    ahead = (jnp.where(sel < jnp.asarray(h.decoder.seq_len)[None, :, None, None], sel, -1)
             if prefetch else None)
    step = jax.jit(lambda st, s, q, k, v, p: decode.decode_step(
        cfg, _RefusesAtLayer2(cfg.top_k, cfg.num_units),
        decode.init_carry(cfg, st, s, prefetch=p), q, k, v))
    _, carry = step(h.state, sel, *inputs, ahead)
  assert int(carry.status) != 0
  after = snapshot(carry.tier)
  for name in ("fetched_rows", "hits", "misses", "prefetched"):
    np.testing.assert_array_equal(getattr(after, name)[2:], getattr(before, name)[2:],
                                  err_msg=name)
  assert (after.fetched_rows[:2] >= before.fetched_rows[:2]).all()


def test_a_selector_of_float_positions_or_queries_of_other_heads_are_refused():
  """Trace-time, on every path that consumes a selection (the tiered step, fused
  or not, the full-KV reference): float positions would be truncated where cast
  (1.9 attended as 1); and the tiered layer a model calls checks its q / k_new /
  v_new heads itself (a q of other heads would be regrouped silently)."""
  @dataclasses.dataclass(frozen=True)
  class Floats(selectors.GivenSelector):
    def select(self, state, layer, inputs, params=None):
      return state[layer].astype(jnp.float32) + 0.9, state

  for impl in ("xla", FUSED):
    cfg = make_cfg(impl=impl)
    h = Harness(cfg, [40, 50, 60])
    sel = jnp.asarray(draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev))
    q, kn, vn = step_inputs(h.rng, cfg)
    carry = decode.init_carry(cfg, h.state, sel)
    with pytest.raises(ValueError, match="integers"):
      jax.eval_shape(functools.partial(decode.decode_step, cfg,
                                       Floats(cfg.top_k, cfg.num_units)), carry, q, kn, vn)
    attend = decode.tiered_attend(cfg, selectors.GivenSelector(cfg.top_k, cfg.num_units))
    for bad in ((q[0, :, :2], kn[0], vn[0]), (q[0], kn[0, :, :1], vn[0]),
                (q[0], kn[0], vn[0, :2])):
      with pytest.raises(ValueError, match="q / k_new / v_new"):
        jax.eval_shape(lambda c, b=bad: attend(0, *b, c), carry)
  full = full_kv.init_full_kv(cfg, *random_kv(h.rng, cfg, 60), jnp.asarray([40, 50, 60]))
  with pytest.raises(ValueError, match="integers"):
    full_kv.full_kv_decode_step(cfg, Floats(cfg.top_k, cfg.num_units), full, q, kn, vn, sel)


def test_a_default_step_after_a_masked_one_decodes_every_row():
  """``TieredDriver.step(active=None)`` means all rows, whatever mask the carry
  kept from the call before: the host mirror and the device agree."""
  cfg = make_cfg(impl="xla")
  h = Harness(cfg, [40, 50, 60])
  sel = selectors.GivenSelector(cfg.top_k, cfg.num_units)
  drv = driver.TieredDriver(cfg, lambda c, *a: driver._decode_step(cfg, sel, c, *a))
  drv.start([40, 50, 60])
  carry = decode.init_carry(cfg, h.state, jnp.asarray(
      draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)))
  mask = np.array([True, False, True])
  _, carry = drv.step(carry, *step_inputs(h.rng, cfg), active=mask)
  assert drv.seq_len.tolist() == np.asarray(carry.tier.seq_len).tolist() == [41, 50, 61]
  _, carry = drv.step(carry, *step_inputs(h.rng, cfg))
  assert drv.seq_len.tolist() == np.asarray(carry.tier.seq_len).tolist() == [42, 51, 62]


@dataclasses.dataclass(frozen=True)
class MarkingSelector(selectors.GivenSelector):
  """The given selections, and a state update that marks every row of the layer it
  is called for; out of range at ``refuse_layer``."""
  refuse_layer: int = -1

  def select(self, state, layer, inputs, params=None):
    picked = jnp.where(inputs.layer == self.refuse_layer, 10_000, state[layer])
    return picked, state.at[layer].add(-1000)


def test_the_selector_updates_its_whole_state_in_place_as_in_the_sparse_backend():
  """The tiered step hands the selector its whole state with the true layer index
  and keeps what it returns, for inactive rows and for the refusing layer and those
  after it too: nothing is restored (selector updates are position-idempotent, so
  what they wrote at the uncommitted position is overwritten when it is decoded;
  a restore made XLA copy the state or cost launches per state array)."""
  cfg = make_cfg()
  h = Harness(cfg, [40, 50, 60], seed=int(np.random.default_rng().integers(2**31)))
  for _ in range(2):
    h.step()
  step = jax.jit(decode.decode_step, static_argnums=(0, 1))
  sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
  for refuse_layer, active in ((-1, np.array([True, False, True])), (2, None)):
    carry = decode.init_carry(cfg, h.state, jnp.asarray(sel), active=active)
    _, carry = step(cfg, MarkingSelector(cfg.top_k, refuse_layer=refuse_layer), carry,
                    *step_inputs(h.rng, cfg))
    assert (int(carry.status) != 0) == (refuse_layer >= 0)
    np.testing.assert_array_equal(np.asarray(carry.sel), sel - 1000)


@pytest.mark.parametrize("per_kv_head,share,policy,fused", [
    (False, 1, "lru", FUSED), (True, 1, "rank", FUSED),
    pytest.param(False, 2, "lru", FUSED, marks=pytest.mark.slow),
    (False, 2, "freq", FUSED), (False, 1, "lru", FUSED_PALLAS),
    pytest.param(True, 1, "rank", FUSED_PALLAS, marks=pytest.mark.slow),
    (False, 2, "freq", FUSED_PALLAS)],
    ids=["lru", "rank-per-head", "share2-lru", "share2-freq", "lru-pallas",
         "rank-per-head-pallas", "share2-freq-pallas"])
def test_fused_layer_kernels_are_the_unfused_step(per_kv_head, share, policy, fused):
  """impl.fused (off GPU one native call per layer, or with interpret=True the two
  Pallas kernels interpreted): outputs bit-equal to full-KV sparse attention (XLA
  attention on both sides), and every metadata array, counter and the hot cache
  equal to the unfused step's (XLA RESOLVE, zero-copy fetch kernel); with index
  sharing (share=2) the anchor's commit fetches for the layer sharing its
  selection. Under a keyed policy (freq, rank) the victims, the LRU order and the
  score EMA are the unfused keyed RESOLVE's."""
  seed = int(np.random.default_rng().integers(2**31))
  cfgs = [make_cfg(impl=impl, per_kv_head=per_kv_head, index_share=share, policy=policy)
          for impl in (fused, ImplConfig(resolve="xla", attention="xla", fetch="pallas"))]
  fused, unfused = (Harness(c, [40, 100, 7], seed=seed) for c in cfgs)
  for _ in range(25):
    sel = draw_selection(fused.rng, cfgs[0], fused.decoder.seq_len, fused.prev)
    if share == 2:
      sel[1], sel[3] = sel[0], sel[2]  # what the sharing layers attend
    inputs = step_inputs(fused.rng, cfgs[0])
    (out, ref), (out_u, _) = fused.step(sel, inputs), unfused.step(sel, inputs)
    np.testing.assert_array_equal(out, ref, err_msg=f"{seed=}")
    np.testing.assert_array_equal(out_u, ref, err_msg=f"{seed=}")
  for name in ("slot_pos", "lru", "slot_score", "hits", "misses", "fetched_rows",
               "seq_len", "hot_k", "hot_v"):
    np.testing.assert_array_equal(getattr(fused.state, name),
                                  getattr(unfused.state, name), err_msg=f"{name} {seed=}")
  assert kv_state.cache_stats(cfgs[0], fused.state)["misses"] > 0
  if share == 2:
    assert int(np.asarray(fused.state.fetched_rows)[1]) == 0  # fetched by the anchor
  # The EMA accumulates under a keyed policy (LRU keeps 0, or 1 for an install).
  assert (np.asarray(fused.state.slot_score).max() > 1.0) == (policy != "lru")


def test_a_head_dim_that_is_not_a_power_of_2_takes_xla_on_a_gpu():
  """The Pallas fetch and attention kernels need a power-of-2 head_dim. Under
  "auto" a GPU would pick them and fail at trace time: the config takes XLA for
  them instead (the GPU's code paths traced here), and refuses them when asked."""
  from pallas_kernels import common  # noqa: PLC0415
  for head_dim in (64, 80):
    cfg = make_cfg(impl="auto", head_dim=head_dim)
    assert (cfg.impl.fetch, cfg.impl.attention) == (
        ("auto", "auto") if head_dim == 64 else ("xla", "xla"))
    sel = selectors.GivenSelector(cfg.top_k, cfg.num_units)
    state = jax.eval_shape(lambda: kv_state.init_state(cfg))  # noqa: B023
    shape = (cfg.num_layers, cfg.num_requests)
    args = (jax.ShapeDtypeStruct(shape + (cfg.num_units, cfg.top_k), jnp.int32),
            jax.ShapeDtypeStruct(shape + (cfg.num_q_heads, head_dim), cfg.dtype),
            *[jax.ShapeDtypeStruct(shape + (cfg.num_kv_heads, head_dim), cfg.dtype)] * 2)
    step = lambda st, s, q, k, v: decode.decode_step(  # noqa: B023
        cfg, sel, decode.init_carry(cfg, st, s), q, k, v)
    with common.tracing_for_gpu():
      out, _ = jax.eval_shape(step, state, *args)
    assert out.shape == shape + (cfg.num_q_heads, head_dim)
  for impl in (ImplConfig(attention="pallas"), ImplConfig(fetch="pallas"),
               ImplConfig(fetch="pallas", fetch_stream=1)):
    with pytest.raises(ValueError, match="power of 2"):
      make_cfg(impl=impl, head_dim=80, overlap_hit_miss=impl.fetch_stream is not None)


def test_fused_layer_kernels_reject_what_they_do_not_do():
  for bad in (dict(overlap_hit_miss=True), dict(head_dim=24), dict(mesh_axes=("data",))):
    with pytest.raises(ValueError, match="fused"):
      make_cfg(impl=FUSED, **bad)


def test_fused_path_prefetches_like_the_unfused_step():
  """A lookahead prefetch on the fused path (index sharing by 2, the freq policy):
  outputs bit-equal to full KV, every array equal to the unfused step's, and the
  prefetched rows are hits next step."""
  seed = int(np.random.default_rng().integers(2**31))
  cfgs = [make_cfg(impl=impl, index_share=2, policy="freq", hot_slots=24, top_k=12,
                   lookahead_cap=6)
          for impl in (FUSED, ImplConfig(resolve="xla", attention="xla", fetch="pallas"))]
  fused, unfused = (Harness(c, [40, 100, 70], seed=seed) for c in cfgs)
  nxt = draw_selection(fused.rng, cfgs[0], fused.decoder.seq_len, fused.prev)
  for _ in range(10):
    sel, fused.prev = nxt, nxt
    nxt = draw_selection(fused.rng, cfgs[0], fused.decoder.seq_len + 1, sel)
    for x in (sel, nxt):
      x[1], x[3] = x[0], x[2]  # what the sharing layers attend
    ahead = np.where(nxt == fused.decoder.seq_len[None, :, None, None], -1, nxt)
    inputs = step_inputs(fused.rng, cfgs[0])
    (out, ref), (out_u, _) = (h.step(sel, inputs, prefetch=ahead)
                              for h in (fused, unfused))
    np.testing.assert_array_equal(out, ref, err_msg=f"{seed=}")
    np.testing.assert_array_equal(out_u, ref, err_msg=f"{seed=}")
  for name in ("slot_pos", "lru", "slot_score", "hits", "misses", "prefetched",
               "fetched_rows", "seq_len", "hot_k", "hot_v"):
    np.testing.assert_array_equal(getattr(fused.state, name),
                                  getattr(unfused.state, name), err_msg=f"{name} {seed=}")
  assert int(np.asarray(fused.state.prefetched).sum()) > 0


def test_a_repeated_prefetch_position_takes_one_slot_on_every_path():
  """Predicted positions are a guess: a repeat is fetched once, never into two
  slots (a position held twice made the XLA, Pallas and fused RESOLVE disagree on
  the next hit), at its first lane, whichever the lookup (the map kept the last
  lane, the search the first: under a cap they fetched other positions). Every
  metadata array equal across the paths, outputs exact."""
  seed = int(np.random.default_rng().integers(2**31))
  impls = (ImplConfig.every("xla", fetch_chunk=3),
           ImplConfig.every("xla", lookup="search"),
           ImplConfig(resolve="pallas", attention="xla", fetch="pallas"), FUSED,
           FUSED_PALLAS)
  cfgs = [make_cfg(impl=impl, lookahead_cap=3) for impl in impls]
  runs = [Harness(c, [60, 90, 70], seed=seed) for c in cfgs]
  for step in range(6):
    sel = draw_selection(runs[0].rng, cfgs[0], runs[0].decoder.seq_len, runs[0].prev)
    ahead = draw_selection(runs[0].rng, cfgs[0], runs[0].decoder.seq_len, sel)[..., :6]
    # A repeat two or more lanes on (and -1 with -1 where empty): the lanes between
    # shift under the cap when the later lane is the one kept.
    ahead[..., int(runs[0].rng.integers(2, 6))] = ahead[..., 0]
    inputs = step_inputs(runs[0].rng, cfgs[0])
    for h in runs:
      h.prev = runs[0].prev
      out, ref = h.step(sel, inputs, prefetch=ahead)
      np.testing.assert_array_equal(out, ref, err_msg=f"{seed=} {step=}")
  for h in runs:
    slot_pos = np.asarray(h.state.slot_pos)
    for row in slot_pos.reshape(-1, slot_pos.shape[-1]):
      held = row[row >= 0]
      assert len(held) == len(set(held.tolist())), (seed, row)
  for name in ("slot_pos", "lru", "slot_score", "hits", "misses", "prefetched"):
    for h in runs[1:]:
      np.testing.assert_array_equal(getattr(h.state, name), getattr(runs[0].state, name),
                                    err_msg=f"{name} {seed=}")
  assert int(np.asarray(runs[0].state.prefetched).sum()) > 0


def test_a_malformed_row_refuses_with_the_same_status_word_on_every_path():
  """A row whose selection repeats a position (or leaves the range) and also misses
  a position without a host page: both paths refuse for its own reason only (the
  unfused one added "no host page"); and the map and search lookups agree that a
  position past the range is out of range, not a repeat."""
  from kvtier_jax import layer as layer_lib
  from kvtier_jax.resolve import (STATUS_DUPLICATE, STATUS_OUT_OF_RANGE,
                                  selection_errors)
  words = {}
  for name, impl in (("xla", ImplConfig.every("xla")), ("fused", FUSED)):
    cfg = make_cfg(impl=impl, num_requests=3, max_len=128, host_pages=12, page_size=16)
    state = kv_state.init_state(cfg, fill=0.0)
    table = np.full((3, cfg.pages_per_request), -1, np.int32)
    table[:, :2] = np.arange(6).reshape(3, 2)  # pages only for positions 0..31
    state = state.replace(page_table=jnp.asarray(table),
                          seq_len=jnp.full((3,), 60, jnp.int32))
    q, kn = jnp.zeros((3, 4, 16)), jnp.zeros((3, 2, 16))
    status = jax.jit(lambda st, s: layer_lib.anchor_layer(
        cfg, st, jnp.int32(0), q, kn, kn, s, jnp.int32(0), jnp.ones(3, bool))[3])
    for bad in ([50, 3, 3], [50, 3, 99]):  # 50 has no page
      sel = np.full((3, 1, cfg.top_k), -1, np.int32)
      sel[0, 0, :3], sel[1, 0, :2], sel[2, 0, :2] = bad, [1, 2], [4, 5]
      words[name, bad[-1]] = int(status(state, jnp.asarray(sel)))
  assert words == {("xla", 3): STATUS_DUPLICATE, ("fused", 3): STATUS_DUPLICATE,
                   ("xla", 99): STATUS_OUT_OF_RANGE, ("fused", 99): STATUS_OUT_OF_RANGE}, words
  sel = jnp.asarray([[3, 128 + 7, -1]], jnp.int32)
  for method in ("map", "search"):
    got = int(selection_errors(sel, jnp.asarray([60]), 129, method)[0])
    assert got == STATUS_OUT_OF_RANGE, method


@pytest.mark.parametrize("fetch, fetch_chunk, overlap, share, ahead, fused", [
    # The direct fetch: an eighth of the lanes per chunk, or 8.
    pytest.param("xla", None, False, 1, False, False, id="direct"),
    pytest.param("xla", 8, False, 1, False, False, id="direct-chunk8"),
    # The overlapped attention: staged in one gather, a loop; the zero-copy kernel.
    pytest.param("xla", None, True, 1, False, False, id="overlap"),
    pytest.param("xla", 8, True, 1, False, False, id="overlap-chunk8"),
    pytest.param("pallas", None, True, 1, False, False, id="overlap-zero-copy"),
    pytest.param("xla", None, False, 2, False, False, id="share2"),
    pytest.param("xla", None, True, 2, False, False, id="share2-overlap"),
    # The lookahead prefetch, which writes after the attention.
    pytest.param("xla", None, False, 1, True, False, id="prefetch"),
    pytest.param("xla", None, True, 2, True, False, id="prefetch-share2-overlap"),
    pytest.param("xla", None, False, 1, False, True, id="fused"),
    pytest.param("xla", None, False, 2, False, True, id="fused-share2"),
    pytest.param("xla", None, False, 1, True, True, id="prefetch-fused"),
    pytest.param("xla", None, False, 2, True, True, id="prefetch-fused-share2")])
def test_cpu_step_writes_the_hot_cache_in_place(fetch, fetch_chunk, overlap, share,
                                                ahead, fused):
  """The compiled CPU step never copies the whole hot cache (a write after a read
  of it, with nothing ordering the two, makes XLA:CPU keep the version read; a
  copy per layer would cost more than the tiered step's overhead), nor the host
  tier."""
  impl = ImplConfig(resolve="xla", fetch=fetch, fetch_chunk=fetch_chunk, fused=fused)
  cfg = make_cfg(impl=impl, overlap_hit_miss=overlap, index_share=share,
                 lookahead_cap=4 if ahead else None)
  selector = selectors.GivenSelector(cfg.top_k)
  prefetch = (jax.ShapeDtypeStruct((4, 3, cfg.num_units, 6), jnp.int32) if ahead
              else None)
  state = jax.eval_shape(lambda: kv_state.init_state(cfg))
  selections = jax.eval_shape(lambda: selector.init_state(4, 3, 0))
  q, kv = (jax.ShapeDtypeStruct((4, 3, h, 16), jnp.float32) for h in (4, 2))
  # The program TieredDecoder.step runs (the carry built inside it).
  hlo = driver._decoder_step.lower(cfg, selector, state, q, kv, kv, selections,
                                   prefetch).compile().as_text()
  if fused:  # off GPU the fused step is the native call, where it builds
    assert ("kvtier_resolve_fetch" in hlo) == native.available()
  for shape in (kv_state.hot_cache_shape(cfg), kv_state.host_tier_shape(cfg)):
    typ = f"f32[{','.join(map(str, shape))}]"
    copies = [l for l in hlo.splitlines() if f"= {typ}" in l and " copy(" in l]
    assert not copies, copies[:2]
    assert f"= {typ}" in hlo  # the shape is matched at all


def test_ordered_after_is_the_layer_whatever_the_output_holds():
  """The layer index the off-GPU writes take after an attention: traced, with a
  finite output, a NaN in it, or every entry NaN, it is the layer itself."""
  from kvtier_jax.layer import ordered_after
  rng = np.random.default_rng()
  num_layers = int(rng.integers(1, 9))
  got = jax.jit(ordered_after, static_argnums=2)
  for layer in range(num_layers):
    out = rng.standard_normal((3, 4, 8)).astype(np.float32)
    for poison in (None, (1, 2, 3), ...):
      if poison is not None:
        out[poison] = np.nan
      assert int(got(jnp.int32(layer), jnp.asarray(out), num_layers)) == layer
  with pytest.raises(ValueError, match="outside"):
    ordered_after(num_layers, jnp.zeros(3), num_layers)


def test_step_donates_state_and_does_not_retrace():
  cfg = make_cfg()
  h = Harness(cfg, [40, 50, 60])
  h.step()
  compiled = h.decoder.compiled_steps()  # after the first step: one compile, not two
  old = h.state
  h.step()
  assert old.host_k.is_deleted() and old.hot_k.is_deleted() and old.lru.is_deleted()
  for _ in range(5):
    h.step()
  assert h.decoder.compiled_steps() == compiled >= 1


@pytest.mark.parametrize("impl, overlap", [("xla", False), ("pallas", False),
                                           ("xla", True), ("pallas", True)])
def test_index_sharing_is_exact_and_prefetches_shared_layers(impl, overlap):
  """index_share=2: layers 1 and 3 reuse the anchors' selections; their misses
  are fetched at the anchor, and their metadata stays in lockstep. Beside the
  overlapped hit/miss attention too (off GPU the sharing layers' fetch goes
  first and the hits are attended after the fetched rows land)."""
  cfg = make_cfg(impl=ImplConfig(fetch=impl, fetch_chunk=8), index_share=2,
                 overlap_hit_miss=overlap)
  h = Harness(cfg, [40, 120, 200], seed=7)
  for _ in range(25):
    sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
    sel[1], sel[3] = sel[0], sel[2]  # what the shared layers attend
    out, ref = h.step(sel)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
  st = jax.device_get(h.state)
  np.testing.assert_array_equal(st.slot_pos[1], st.slot_pos[0])
  np.testing.assert_array_equal(st.lru[3], st.lru[2])
  np.testing.assert_array_equal(st.misses[1], st.misses[0])
  assert st.misses[0].sum() > 0
  assert st.fetched_rows[1] == st.fetched_rows[3] == 0  # fetched by the anchors
  assert st.fetched_rows[0] >= 2 * st.misses[0].sum()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_prefetched_positions_are_hits_next_step(impl):
  cfg = make_cfg(impl=ImplConfig(fetch=impl, fetch_chunk=8), hot_slots=32, top_k=16)
  h = Harness(cfg, [300, 250, 400], seed=3)
  h.step()
  sels = [draw_selection(h.rng, cfg, h.decoder.seq_len + t, h.prev) for t in range(2)]
  # Next step's selection avoids the position being decoded now (not in the host
  # tier yet, so not prefetchable).
  sels[1] = np.where(sels[1] == h.decoder.seq_len[None, :, None, None], -1, sels[1])
  before = kv_state.cache_stats(cfg, h.state)
  q, k, v = (jnp.asarray(h.rng.standard_normal(s), jnp.float32) for s in (
      (4, 3, 4, 16), (4, 3, 2, 16), (4, 3, 2, 16)))
  out, h.state = h.decoder.step(h.state, q, k, v, sels[0], prefetch=sels[1])
  ref, h.full = h.full_step(h.full, q, k, v, jnp.asarray(sels[0]))
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
  mid = kv_state.cache_stats(cfg, h.state)
  assert mid["prefetched"] > before["prefetched"]
  h.prev = sels[0]
  out, ref = h.step(sels[1])
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
  after = kv_state.cache_stats(cfg, h.state)
  assert after["misses"] == mid["misses"], "prefetched positions must all be hits"


def test_prefetch_with_index_sharing_fetches_for_the_sharing_layers():
  """index_share=2 with a lookahead prefetch: the prefetched rows go to the anchor
  and to the layer sharing its selection (both get the anchor's metadata), so the
  sharing layer never attends a slot whose row was not fetched."""
  cfg = make_cfg(impl=ImplConfig(fetch="xla", fetch_chunk=8), hot_slots=32, top_k=16,
                 index_share=2)
  h = Harness(cfg, [300, 250, 400], seed=int(np.random.default_rng().integers(2**31)))
  for _ in range(12):
    sels = [draw_selection(h.rng, cfg, h.decoder.seq_len + t, h.prev) for t in range(2)]
    for sel in sels:
      sel[1], sel[3] = sel[0], sel[2]  # what the sharing layers attend
    sels[1] = np.where(sels[1] == h.decoder.seq_len[None, :, None, None], -1, sels[1])
    inputs = step_inputs(h.rng, cfg)
    out, h.state = h.decoder.step(h.state, *inputs, sels[0], prefetch=sels[1])
    ref, h.full = h.full_step(h.full, *inputs, jnp.asarray(sels[0]))
    h.prev = sels[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
  stats = kv_state.cache_stats(cfg, h.state)
  assert stats["prefetched"] > 0
  st = jax.device_get(h.state)
  np.testing.assert_array_equal(st.slot_pos[1], st.slot_pos[0])  # lockstep
  # Counted for each layer that got them, as its misses are (only the anchor's were).
  for name in ("misses", "prefetched"):
    np.testing.assert_array_equal(getattr(st, name)[1::2], getattr(st, name)[::2], name)


def test_host_tier_lives_in_host_memory_and_is_accounted():
  cfg = make_cfg()
  state = kv_state.init_state(cfg)
  assert state.host_k.sharding.memory_kind == kv_state.host_memory_kind()
  by_kind = kv_state.array_bytes_by_memory_kind(state)
  host = cfg.num_requests * cfg.host_bytes_per_request() + cfg.page_bytes  # + scratch
  assert by_kind[kv_state.host_memory_kind()] == host
  device = sum(v for k, v in by_kind.items() if k != kv_state.host_memory_kind())
  counters = (3 * cfg.num_layers * cfg.num_requests * cfg.num_units + cfg.num_layers +
              cfg.num_requests) * 4
  counters += cfg.num_requests * cfg.pages_per_request * 4  # the page table
  assert device == cfg.num_requests * cfg.device_bytes_per_request() + counters


def test_config_rejects_bad_shapes():
  with pytest.raises(ValueError, match="must be >= top_k"):
    make_cfg(hot_slots=8, top_k=16)
  with pytest.raises(ValueError, match="multiple"):
    make_cfg(num_q_heads=5)
  with pytest.raises(ValueError, match="impl"):
    make_cfg(impl=ImplConfig(fetch="cuda"))
  with pytest.raises(ValueError, match="index_share"):
    make_cfg(index_share=3)
  with pytest.raises(ValueError, match="floating"):  # K/V would be cast to ints
    make_cfg(dtype=jnp.int8)
  with pytest.raises(ValueError, match="mesh_axes"):  # not the axes "d", "a", "t", "a"
    make_cfg(mesh_axes="data")
  for alpha in (0.0, 1.0):  # an EMA that never decays, or forgets at once
    with pytest.raises(ValueError, match="freq_alpha"):
      PolicyConfig("freq", freq_alpha=alpha)
  # Each bound at its edge: the value refused and the one beside it taken.
  for bad, good, match in [
      (dict(hot_slots=15, top_k=16), dict(hot_slots=16, top_k=16), "must be >= top_k"),
      (dict(max_len=16, top_k=17, hot_slots=17), dict(max_len=16, top_k=16, hot_slots=17),
       "exceeds max_len"),
      (dict(host_pages=0), dict(host_pages=1), "host_pages"),
      (dict(lookahead_cap=-1), dict(lookahead_cap=0), "lookahead_cap")]:
    with pytest.raises(ValueError, match=match):
      make_cfg(**bad)
    make_cfg(**good)
  with pytest.raises(ValueError, match="fetch_chunk"):
    ImplConfig(fetch_chunk=0)
  with pytest.raises(ValueError, match="rank_freq"):  # NaN is not >= 0 either
    PolicyConfig("rank", rank_freq=float("nan"))
  with pytest.raises(ValueError, match="no Pallas RESOLVE"):
    make_cfg(impl=ImplConfig(resolve="pallas"), policy=PolicyConfig("freq"))
  # A streamed fetch alone (the kernels left on "auto") on a head_dim the kernels
  # cannot load: refused for the stream, naming the power of 2.
  with pytest.raises(ValueError, match="power of 2"):
    make_cfg(impl=ImplConfig(fetch_stream=1), head_dim=80, overlap_hit_miss=True)


def test_the_direct_fetch_chunk_is_an_eighth_of_the_lanes_but_16_at_least():
  for requests, top_k, want in ((3, 16, 16), (4, 64, 32)):  # 48 lanes; 256 lanes
    cfg = make_cfg(impl=ImplConfig(fetch_chunk=None), num_requests=requests, top_k=top_k,
                   hot_slots=top_k)
    lanes = requests * cfg.num_units * top_k
    assert cfg.direct_fetch_rows_per_chunk == min(max(16, lanes // 8), lanes) == want


def test_prefill_refuses_page_tables_that_would_put_rows_where_others_are_read():
  """A page past the pool or the scratch page (the prompt's rows land there, or
  clamp there), or a page at two positions (one's rows overwrite the other's),
  was prefilled and its later misses read wrong rows: refused before any change.
  Requests may share a page at one position (a cached prefix)."""
  cfg = make_cfg(host_pages=24, page_size=16, max_len=200)
  rng = np.random.default_rng()
  kp, vp = random_kv(rng, cfg, 40)
  table = np.full((cfg.num_requests, cfg.pages_per_request), -1, np.int32)
  table[:, :3] = np.arange(9).reshape(3, 3)
  decoder = driver.TieredDecoder(cfg)
  base = kv_state.init_state(cfg, fill=np.nan)
  nh = cfg.num_host_pages
  for bad, match in ((dict(at=(1, 1), page=nh), f"in \\[0, {nh}\\)"),
                     (dict(at=(1, 1), page=nh + 3), f"in \\[0, {nh}\\)"),
                     (dict(at=(1, 2), page=3), "lists a page twice"),
                     (dict(at=(2, 1), page=0), "shared at another position")):
    wrong = table.copy()
    wrong[bad["at"]] = bad["page"]
    state = base.replace(page_table=jnp.asarray(wrong))
    with pytest.raises(ValueError, match=match):
      decoder.prefill(state, kp, vp, [40, 40, 40])
    assert not state.host_k.is_deleted(), bad  # nothing donated
  shared = table.copy()
  shared[2, 0] = 0  # request 2's first page is request 0's: a prefix both hold
  decoder.prefill(base.replace(page_table=jnp.asarray(shared)), kp, vp, [40, 40, 40])


def test_a_step_refuses_an_active_mask_of_another_shape():
  """A one-flag mask broadcast over every request: all decoded, or none, silently."""
  cfg = make_cfg()
  h = Harness(cfg, [11, 11, 11], seed=int(np.random.default_rng().integers(2**31)))
  sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
  for active in ([True], [False], np.ones((1, 3), bool), [1, 0, 1]):
    with pytest.raises(ValueError, match="active must be bool\\[3\\]"):
      h.decoder._driver.step(h.state, *step_inputs(h.rng, cfg), jnp.asarray(sel), None,
                             active=active)
  assert h.decoder.seq_len.tolist() == [11, 11, 11]


def test_index_sharing_refuses_rows_the_sharing_layers_would_not_attend():
  """Layer 1 takes layer 0's selection (index_share=2): another row given for it
  was checked and then ignored (its output was the anchor's positions', 1.8 off
  the full-KV reference over its own), as was its prefetch row."""
  cfg = make_cfg(index_share=2)
  h = Harness(cfg, [40, 50, 60], seed=int(np.random.default_rng().integers(2**31)))
  h.step()
  sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
  other = sel.copy()
  other[3, 1, 0, 0] = -1 if other[3, 1, 0, 0] >= 0 else 0
  with pytest.raises(ValueError, match="layer 3 takes layer 2's selections"):
    h.step(other)
  ahead = np.where(sel < h.decoder.seq_len[None, :, None, None], sel, -1)
  wrong_ahead = ahead.copy()
  wrong_ahead[1] = -1
  if (wrong_ahead == ahead).all():
    wrong_ahead[1, 0, 0, 0] = 0
  with pytest.raises(ValueError, match="layer 1 takes layer 0's prefetch"):
    h.step(sel, prefetch=jnp.asarray(wrong_ahead))
  out, ref = h.step(sel, prefetch=jnp.asarray(ahead))
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_prompt_pages_off_a_page_boundary_are_refused():
  """``write_prompt_pages`` writes whole pages from ``start // page_size``: a start
  inside a page would shift the chunk onto the page's earlier positions."""
  cfg = make_cfg()
  h = Harness(cfg, [40, 40, 40], seed=3)
  size = cfg.page_size
  shape = (cfg.num_layers, 1, size, cfg.num_kv_heads, cfg.head_dim)
  k = v = jnp.zeros(shape, jnp.float32)
  with pytest.raises(ValueError, match="page boundary"):
    decode.write_prompt_pages(cfg, h.state, jnp.array([0]), size // 2, k, v)
  decode.write_prompt_pages(cfg, h.state, jnp.array([0]), size, k, v)  # aligned: fine


@pytest.mark.parametrize("policy", ["lru", "freq"])
def test_replacement_policy_changes_victims_not_outputs(policy):
  cfg = make_cfg(policy=policy, hot_slots=24, top_k=16)
  h = Harness(cfg, [200, 260, 300], seed=11)
  for _ in range(40):
    out, ref = h.step()
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
  misses = kv_state.cache_stats(cfg, h.state)["misses"]
  scores = np.asarray(h.state.slot_score)
  if policy == "freq":
    assert scores.max() > 1.0  # repeated hits accumulate
  else:
    assert (scores == 0).all()
  assert misses > 0


def test_a_carry_given_a_prefetch_it_was_not_built_for_is_refused_clearly():
  """The anchor's plan is sized by ``init_carry``'s prefetch: a prefetch put into a
  carry built without one (or of another width) failed deep in the layer scan
  ("anchor.slot is NoneType"); it is a ValueError naming the fix."""
  cfg = make_cfg(impl="xla")
  h = Harness(cfg, [60, 90, 70], seed=5)
  selector = selectors.GivenSelector(cfg.top_k, cfg.num_units)
  rng = np.random.default_rng()
  sel = jnp.asarray(draw_selection(rng, cfg, h.decoder.seq_len, h.prev))
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (
      (cfg.num_layers, cfg.num_requests, cfg.num_q_heads, cfg.head_dim),
      (cfg.num_layers, cfg.num_requests, cfg.num_kv_heads, cfg.head_dim),
      (cfg.num_layers, cfg.num_requests, cfg.num_kv_heads, cfg.head_dim)))
  ahead = lambda width: jnp.full(sel.shape[:-1] + (width,), 3, jnp.int32)
  for built, given in ((None, 2), (2, 3), (2, None)):
    carry = decode.init_carry(cfg, h.state, sel, prefetch=None if built is None
                              else ahead(built)).replace(
                                  prefetch=None if given is None else ahead(given))
    with pytest.raises(ValueError, match=r"init_carry\(\.\.\., prefetch=\)"):
      decode.decode_step(cfg, selector, carry, q, k, v)
  carry = decode.init_carry(cfg, h.state, sel, prefetch=ahead(2))
  decode.decode_step(cfg, selector, carry, q, k, v)  # built for it: runs


@pytest.mark.parametrize("idle_len", [10, 260])  # idle row: empty slots / full, misses
@pytest.mark.parametrize("prefetch", [False, True])
def test_an_inactive_row_keeps_its_cache_and_counters(idle_len, prefetch):
  """An inactive row (a serving slot not decoding) has a real selection and maybe a
  prediction, but the step changes nothing of it: not its slots, LRU order,
  counters or hot rows (it fetched into victims, installed its newest token into an
  empty slot, or prefetched, while its metadata stayed)."""
  cfg = make_cfg(impl="xla")
  h = Harness(cfg, [200, idle_len, 300])
  for _ in range(2):
    h.step()
  sel = draw_selection(h.rng, cfg, h.decoder.seq_len, h.prev)
  ahead = None
  if prefetch:
    nxt = draw_selection(h.rng, cfg, h.decoder.seq_len + 1, sel)
    ahead = jnp.asarray(np.where(nxt >= h.decoder.seq_len[None, :, None, None], -1, nxt))
  before = jax.device_get(h.state)
  carry = decode.init_carry(cfg, h.state, jnp.asarray(sel), prefetch=ahead,
                            active=np.array([True, False, True]))
  _, carry = jax.jit(functools.partial(decode.decode_step, cfg, h.decoder.selector))(
      carry, *step_inputs(h.rng, cfg))
  assert int(carry.status) == 0
  after = jax.device_get(carry.tier)
  for name in ("slot_pos", "lru", "hits", "misses", "prefetched"):
    np.testing.assert_array_equal(getattr(after, name)[:, 1], getattr(before, name)[:, 1],
                                  err_msg=name)
  B = cfg.hot_slots
  np.testing.assert_array_equal(after.hot_k[:, 1, :, :B], before.hot_k[:, 1, :, :B])
  np.testing.assert_array_equal(after.hot_v[:, 1, :, :B], before.hot_v[:, 1, :, :B])
  assert after.seq_len[1] == before.seq_len[1]


def test_cache_stats_are_the_counters_sums():
  """Per layer and in total, against numpy sums of the [L, R, U] counters (L != R)."""
  cfg = make_cfg(hot_slots=24, top_k=16)
  assert cfg.num_layers != cfg.num_requests
  h = Harness(cfg, [200, 260, 300])
  for _ in range(3):
    h.step()
  st = jax.device_get(h.state)
  hits, misses = np.asarray(st.hits, np.int64), np.asarray(st.misses, np.int64)
  stats = kv_state.cache_stats(cfg, h.state)
  np.testing.assert_array_equal(stats["hits_per_layer"], hits.reshape(cfg.num_layers, -1).sum(1))
  np.testing.assert_array_equal(stats["misses_per_layer"],
                                misses.reshape(cfg.num_layers, -1).sum(1))
  assert stats["misses"] == misses.sum() > 0 and stats["hits"] == hits.sum() > 0
  assert stats["miss_rate"] == misses.sum() / (hits.sum() + misses.sum())
  rows = int(np.asarray(st.fetched_rows, np.int64).sum())
  assert stats["host_to_device_bytes"] == rows * 2 * cfg.row_bytes


def test_an_idle_row_at_max_len_does_not_refuse_the_others():
  cfg = make_cfg(max_len=64)
  h = Harness(cfg, [60, 63, 10])
  h.step()  # request 1 reaches max_len
  sel = np.full((cfg.num_layers, cfg.num_requests, cfg.num_units, cfg.top_k), -1, np.int32)
  sel[..., 0] = 0
  carry = decode.init_carry(cfg, h.state, jnp.asarray(sel),
                            active=np.array([True, False, True]))
  _, carry = jax.jit(functools.partial(decode.decode_step, cfg, h.decoder.selector))(
      carry, *step_inputs(h.rng, cfg))
  assert int(carry.status) == 0


def test_the_draft_cap_counts_real_misses_not_padding():
  """``cap_misses`` keeps the first ``cap`` non-resident positions of a row: its -1
  padding is no miss and spends none of the cap."""
  from kvtier_jax import layer as layer_lib
  cfg = make_cfg()
  rng = np.random.default_rng()
  kp, vp = random_kv(rng, cfg, 200)
  st = decode.prefill(cfg, kv_state.init_state(cfg), kp, vp, jnp.array([200] * 3))
  held = np.asarray(st.slot_pos[0])
  draft = np.full((cfg.num_requests, cfg.num_units, 8), -1, np.int32)
  for r, u in np.ndindex(draft.shape[:2]):
    out = [p for p in rng.permutation(200) if p not in held[r, u]][:4]
    draft[r, u, 4:] = out  # padding first, then 4 non-resident
  capped = np.asarray(layer_lib.cap_misses(cfg, st, 0, jnp.asarray(draft), 2))
  np.testing.assert_array_equal(capped[..., :4], -1)
  np.testing.assert_array_equal(capped[..., 4:6], draft[..., 4:6])
  np.testing.assert_array_equal(capped[..., 6:], -1)


def test_a_predicted_position_without_a_host_page_is_not_prefetched():
  """The prefetch never reads the scratch page: a predicted position whose page is
  missing is left out (the step itself, selecting resident rows, goes on)."""
  cfg = make_cfg(impl="xla")
  h = Harness(cfg, [200, 260, 300])
  h.step()
  held = np.asarray(h.state.slot_pos)
  sel = np.full((cfg.num_layers, cfg.num_requests, cfg.num_units, cfg.top_k), -1, np.int32)
  sel[..., :4] = held[..., :4]  # resident only: no miss
  missing = next(p for p in h.rng.permutation(200)
                 if (held[:, 1] != p).all() and p // cfg.page_size != 0)
  ahead = np.full(sel.shape[:3] + (2,), -1, np.int32)
  ahead[:, 1, :, 0] = missing
  table = np.asarray(h.state.page_table).copy()
  table[1, missing // cfg.page_size] = -1
  state = h.state.replace(page_table=jnp.asarray(table))
  before = jax.device_get(state)
  carry = decode.init_carry(cfg, state, jnp.asarray(sel), prefetch=jnp.asarray(ahead))
  _, carry = jax.jit(functools.partial(decode.decode_step, cfg, h.decoder.selector))(
      carry, *step_inputs(h.rng, cfg))
  assert int(carry.status) == 0
  after = jax.device_get(carry.tier)
  assert (after.slot_pos[:, 1] != missing).all()
  np.testing.assert_array_equal(after.prefetched[:, 1], before.prefetched[:, 1])


def test_a_refusal_names_each_of_its_reasons():
  """The status word is a bit set: each reason is described, and only those set."""
  from kvtier_jax.resolve import STATUS_CAPACITY, STATUS_DUPLICATE, STATUS_OUT_OF_RANGE
  reasons = {STATUS_OUT_OF_RANGE: "out of range", STATUS_DUPLICATE: "repeats",
             STATUS_CAPACITY: "max_len"}
  assert driver.describe_status(0) == "ok"
  for mask in range(1, 8):
    status = sum(bit for i, bit in enumerate(reasons) if mask >> i & 1)
    text = driver.describe_status(status)
    for bit, words in reasons.items():
      assert (words in text) == bool(status & bit), (status, text)


def test_a_carrys_prefetch_serves_one_step():
  """A prefetch predicts the step after the one it is given to: a carry stepped on
  without a new one fetched the stale prediction again, every step (rows the
  selection no longer asked for, evicting ones it did). The committed step empties
  it; a refused one keeps it for the retry."""
  cfg = make_cfg(impl="xla", hot_slots=32, top_k=16)
  h = Harness(cfg, [300, 250, 400])
  selector = selectors.GivenSelector(cfg.top_k, cfg.num_units)
  step = jax.jit(functools.partial(decode.decode_step, cfg, selector))
  rng = h.rng
  ahead = np.asarray(draw_selection(rng, cfg, h.decoder.seq_len - 1, h.prev))[..., :4]
  sel = jnp.asarray(draw_selection(rng, cfg, h.decoder.seq_len, h.prev))
  carry = decode.init_carry(cfg, h.state, sel, prefetch=jnp.asarray(ahead))
  inputs = step_inputs(rng, cfg)
  _, carry = step(carry, *inputs)
  assert int(np.asarray(carry.tier.prefetched).sum()) > 0
  np.testing.assert_array_equal(np.asarray(carry.prefetch), -1)
  # Stepping on is stepping with no prediction: the same slots, LRU order and
  # counters as a carry whose prefetch is emptied by hand (a stale one re-promoted
  # its rows to MRU every step, or fetched them again once evicted).
  emptied = jax.tree.map(jnp.copy, carry.replace(prefetch=jnp.full(ahead.shape, -1, jnp.int32)))
  for _ in range(4):
    sel = jnp.asarray(draw_selection(rng, cfg, np.asarray(carry.tier.seq_len), h.prev))
    inputs = step_inputs(rng, cfg)
    _, carry = step(carry.replace(sel=sel), *inputs)
    _, emptied = step(emptied.replace(sel=sel), *inputs)
    for name in ("slot_pos", "lru", "misses", "prefetched"):
      np.testing.assert_array_equal(np.asarray(getattr(carry.tier, name)),
                                    np.asarray(getattr(emptied.tier, name)), err_msg=name)
  # A refused step (a selection past the context) keeps the prefetch it was given.
  bad = np.asarray(draw_selection(rng, cfg, np.asarray(carry.tier.seq_len), h.prev))
  bad[0, 0, 0, 0] = int(np.asarray(carry.tier.seq_len)[0]) + 5
  _, refused = step(carry.replace(sel=jnp.asarray(bad), prefetch=jnp.asarray(ahead)),
                    *step_inputs(rng, cfg))
  assert int(refused.status) != 0
  np.testing.assert_array_equal(np.asarray(refused.prefetch), ahead)


def test_install_request_refuses_inputs_that_do_not_fit():
  """A slot past R would drop every write (a silent no-op admission); a length
  past the K/V given would mark resident slots holding copies of its last row."""
  cfg = make_cfg(hot_slots=24, top_k=16)
  h = Harness(cfg, [200, 260, 300], seed=3)
  rng = np.random.default_rng()
  shape = (cfg.num_layers, 40, cfg.num_kv_heads, cfg.head_dim)
  k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
  install = functools.partial(decode.install_request, cfg, h.state)
  install(0, k, v, 40)  # fits
  for args, match in [((cfg.num_requests, k, v, 10), "slot"), ((-1, k, v, 10), "slot"),
                      ((0, k, v, 41), "length"), ((0, k, v, -1), "length"),
                      ((0, k, v, 2.0), "length"), ((0, k, v[:, :39], 10), "v"),
                      ((0, k[:-1], v[:-1], 10), "k"), ((0, k[..., :-1], v, 10), "k"),
                      ((jnp.arange(2), k, v, 10), "slot")]:
    with pytest.raises(ValueError, match=match):
      install(*args)
  # Traced slot and length: the shapes are still checked at trace time.
  jitted = jax.jit(install)
  jitted(0, k, v, 40)
  with pytest.raises(ValueError, match="k"):
    jitted(0, k[:, :, :, :-1], v[:, :, :, :-1], 10)


@pytest.mark.parametrize("warm_start,length", [("head_tail", 150), ("first", 150),
                                               ("head_tail", 20)])
def test_install_request_restarts_one_slot_and_leaves_the_rest(warm_start, length):
  """The serving backend's admission into a used slot under a keyed policy: the
  slot's positions, LRU order (slot order) and scores (0) restart, its hot rows are
  the prompt's at those positions; every other slot, and the slot's rows a short
  prompt leaves empty, are kept bit for bit."""
  cfg = make_cfg(policy="freq", hot_slots=24, top_k=16, warm_start=warm_start)
  h = Harness(cfg, [200, 260, 300], seed=13)
  for _ in range(6):
    h.step()
  before = snapshot(h.state)
  assert (before.slot_score[:, 1] > 0).any()
  rng = np.random.default_rng()
  L, U, B = cfg.num_layers, cfg.num_units, cfg.hot_slots
  shape = (L, length + 5, cfg.num_kv_heads, cfg.head_dim)
  k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
  after = snapshot(decode.install_request(cfg, h.state, 1, jnp.asarray(k), jnp.asarray(v),
                                          length))
  slots = np.arange(B)
  if length <= B:
    pos = np.where(slots < length, slots, -1)
  elif warm_start == "first":
    pos = slots
  else:
    pos = np.where(slots < B // 2, slots, length - B + slots)
  others = np.arange(cfg.num_requests) != 1
  for name in ("slot_pos", "lru", "slot_score", "hot_k", "hot_v"):
    np.testing.assert_array_equal(getattr(after, name)[:, others],
                                  getattr(before, name)[:, others], err_msg=name)
  np.testing.assert_array_equal(after.slot_pos[:, 1], np.broadcast_to(pos, (L, U, B)))
  np.testing.assert_array_equal(after.lru[:, 1], np.broadcast_to(slots, (L, U, B)))
  np.testing.assert_array_equal(after.slot_score[:, 1], 0.0)
  assert after.seq_len.tolist() == [int(before.seq_len[0]), length, int(before.seq_len[2])]
  for hot, rows in ((after.hot_k, k), (after.hot_v, v)):
    units = rows.reshape(L, length + 5, U, -1, cfg.head_dim)
    got = hot[:, 1, :, :B]  # [L, U, B, Hg, D]
    for b in slots:
      want = (units[:, pos[b]] if pos[b] >= 0 else
              getattr(before, "hot_k" if hot is after.hot_k else "hot_v")[:, 1, :, b])
      np.testing.assert_array_equal(got[:, :, b], want)
  np.testing.assert_array_equal(after.hot_k[:, 1, :, B:], before.hot_k[:, 1, :, B:])


def test_rank_policy_reads_the_selector_ranking_and_keeps_outputs_exact():
  """policy="rank": the selector returns rank_depth best-first positions; the first
  top_k are attended, the rest only steer victims. Outputs equal full KV."""
  lru_cfg = make_cfg(hot_slots=24, top_k=16, impl="xla")
  rank_cfg = lru_cfg.replace(policy=PolicyConfig("rank", rank_depth=40))
  lens = [200, 260, 300]
  runs = {name: Harness(c, lens, seed=12) for name, c in
          (("lru", lru_cfg), ("rank", rank_cfg))}
  rng = np.random.default_rng()
  L, R, Hq, Hkv, D = (lru_cfg.num_layers, lru_cfg.num_requests, lru_cfg.num_q_heads,
                      lru_cfg.num_kv_heads, lru_cfg.head_dim)
  prev = np.full((L, R, 1, 16), -1)
  differs = False
  for _ in range(40):
    seq_len = runs["lru"].decoder.seq_len
    sel = draw_selection(rng, lru_cfg, seq_len, prev)
    ranked = np.full(sel.shape[:-1] + (40,), -1, np.int32)
    ranked[..., :16] = sel
    for l, r, u in np.ndindex(*sel.shape[:3]):
      # Rank recently selected (likely resident) positions first, then others.
      recent = rng.permutation(np.setdiff1d(prev[l, r, u], sel[l, r, u]))
      recent = recent[recent >= 0]
      rest = rng.permutation(np.setdiff1d(np.arange(seq_len[r]),
                                          np.concatenate([sel[l, r, u], recent])))
      ranked[l, r, u, 16:] = np.concatenate([recent, rest])[:24]
    prev = sel
    for name, h in runs.items():
      q = jnp.asarray(rng.standard_normal((L, R, Hq, D)), jnp.float32)
      kn = jnp.asarray(rng.standard_normal((L, R, Hkv, D)), jnp.float32)
      out, h.state = h.decoder.step(h.state, q, kn, -kn,
                                    ranked if name == "rank" else sel)
      ref, h.full = h.full_step(h.full, q, kn, -kn, jnp.asarray(sel))
      np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    differs |= not np.array_equal(np.asarray(runs["lru"].state.slot_pos),
                                  np.asarray(runs["rank"].state.slot_pos))
  assert differs  # victims differ, outputs do not
  with pytest.raises(ValueError, match="select_width|rows of"):
    runs["rank"].decoder.step(runs["rank"].state, q, kn, -kn, sel)
  with pytest.raises(ValueError, match="rank_depth"):
    make_cfg(policy=PolicyConfig(rank_depth=8))


def test_the_full_kv_reference_refuses_what_the_tiered_path_refuses():
  """The reference checks its input as ``TieredDecoder`` does: prompt lengths past
  the prompt, a prompt past max_len, wrong shapes, a selector with other units."""
  from kvtier_jax import full_kv  # noqa: PLC0415
  from kvtier_jax.config import TierConfig  # noqa: PLC0415
  cfg = TierConfig(num_layers=1, num_requests=2, max_len=16, num_q_heads=4, num_kv_heads=2,
                   head_dim=4, hot_slots=4, top_k=4, per_kv_head=True, dtype=jnp.float32)
  rng = np.random.default_rng()
  kp = jnp.asarray(rng.standard_normal((1, 2, 8, 2, 4)), jnp.float32)
  for lens, match in (([9, 3], "prompt_lens"), ([3, -1], "prompt_lens"), ([3], "prompt_lens")):
    with pytest.raises(ValueError, match=match):
      full_kv.init_full_kv(cfg, kp, kp, lens)
  long = jnp.zeros((1, 2, 17, 2, 4), jnp.float32)
  with pytest.raises(ValueError, match="max_len"):
    full_kv.init_full_kv(cfg, long, long, [3, 3])
  with pytest.raises(ValueError, match="expected"):
    full_kv.init_full_kv(cfg, kp[:, :1], kp[:, :1], [3, 3])
  state = full_kv.init_full_kv(cfg, kp, kp, [8, 5])
  q, k_new = jnp.ones((1, 2, 4, 4)), jnp.ones((1, 2, 2, 4))
  with pytest.raises(ValueError, match="q / k_new / v_new"):
    full_kv.full_kv_decode_step(cfg, selectors.GivenSelector(4, 2), state, q[:, :, :2],
                                k_new, k_new, jnp.zeros((1, 2, 2, 4), jnp.int32))
  with pytest.raises(ValueError, match="picked"):  # one unit where the config has two
    full_kv.full_kv_decode_step(cfg, selectors.GivenSelector(4, 1), state, q, k_new, k_new,
                                jnp.zeros((1, 2, 1, 4), jnp.int32))
  with pytest.raises(ValueError, match="picked"):  # 3 positions where top_k is 4
    full_kv.full_kv_decode_step(cfg, selectors.GivenSelector(3, 2), state, q, k_new, k_new,
                                jnp.zeros((1, 2, 2, 3), jnp.int32))
  picks = jnp.asarray(np.stack([rng.choice(8, 4, replace=False) for _ in range(4)])
                      .reshape(1, 2, 2, 4).astype(np.int32))
  out, after = full_kv.full_kv_decode_step(cfg, selectors.GivenSelector(4, 2), state, q,
                                           k_new, k_new, picks)
  assert out.shape == (1, 2, 4, 4) and after.seq_len.tolist() == [9, 6]


def test_a_jitted_full_kv_step_compiles_once_from_the_initial_state():
  """``init_full_kv``'s state is committed like the state the step returns, so the
  donated step's second call reuses its first compile (an uncommitted initial state
  compiled it again: gpu_check's full-KV median at two timed steps held a compile)."""
  from kvtier_jax.config import TierConfig  # noqa: PLC0415
  cfg = TierConfig(num_layers=1, num_requests=2, max_len=16, num_q_heads=4, num_kv_heads=2,
                   head_dim=4, hot_slots=4, top_k=4, per_kv_head=True, dtype=jnp.float32)
  rng = np.random.default_rng()
  kp = jnp.asarray(rng.standard_normal((1, 2, 8, 2, 4)), jnp.float32)
  q, k_new = (jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32),
                             jax.devices()[0]) for s in ((1, 2, 4, 4), (1, 2, 2, 4)))
  selector = selectors.GivenSelector(4, 2)
  picks = lambda step: jnp.asarray(np.stack([
      rng.choice(8 + step, 4, replace=False) for _ in range(4)]).reshape(1, 2, 2, 4)
      .astype(np.int32))
  step = jax.jit(lambda s, p: full_kv.full_kv_decode_step(cfg, selector, s, q, k_new, k_new, p),
                 donate_argnums=(0,))
  state = full_kv.init_full_kv(cfg, kp, kp, [8, 8])
  for i in range(3):
    _, state = step(state, jax.device_put(picks(i), jax.devices()[0]))
  assert step._cache_size() == 1 and state.seq_len.tolist() == [11, 11]


def test_tiered_prefill_refuses_what_the_reference_refuses_before_any_donation():
  """``TieredDecoder.prefill`` and ``decode.prefill`` refuse lengths outside [0, P],
  a count that is not R and K/V of other shapes; the donated state is untouched.
  (A length past P marked slots resident that held copies of the last row.)"""
  from kvtier_jax.config import TierConfig  # noqa: PLC0415
  cfg = TierConfig(num_layers=1, num_requests=2, max_len=16, num_q_heads=4, num_kv_heads=2,
                   head_dim=4, hot_slots=4, top_k=4, per_kv_head=True, dtype=jnp.float32)
  rng = np.random.default_rng()
  kp = jnp.asarray(rng.standard_normal((1, 2, 8, 2, 4)), jnp.float32)
  decoder = driver.TieredDecoder(cfg)
  state = kv_state.init_state(cfg)
  bad = [(kp, kp, [9, 3]), (kp, kp, [3, -1]), (kp, kp, [3]), (kp, kp, [3.0, 2.0]),
         (kp[:, :1], kp[:, :1], [3, 3]), (kp, kp[..., :2], [3, 3]),
         (kp[:, :, :, :1], kp[:, :, :, :1], [3, 3])]
  for k, v, lens in bad:
    with pytest.raises(ValueError, match="prompt_lens|k_prompt|v_prompt"):
      decoder.prefill(state, k, v, lens)
    with pytest.raises(ValueError, match="prompt_lens|k_prompt|v_prompt"):
      decode.prefill(cfg, state, k, v, np.asarray(lens))
  empty = kp[:, :, :0]  # P = 0: nothing to write or warm (it crashed in tracing)
  for prefill in (decoder.prefill, functools.partial(decode.prefill, cfg)):
    with pytest.raises(ValueError, match="P = 0"):
      prefill(state, empty, empty, [0, 0])
  state = decoder.prefill(state, kp, kp, [8, 0])  # not donated by the refusals
  assert decoder.seq_len.tolist() == [8, 0] and state.seq_len.tolist() == [8, 0]
  state = decode.prefill(cfg, state, kp, kp, [5, 2])  # a list of lengths passes
  assert state.seq_len.tolist() == [5, 2]


def test_counters_and_the_prefetch_cap_from_hand_worked_values():
  """Values both sides of a comparison would share, checked from their definitions:
  a staged chunked fetch (the overlapped attention's host gather, first chunk
  always) counts whole chunks (padding crosses the link too), the direct one
  (off GPU) the misses, the bytes are K and V rows, the lookahead fetches
  exactly ``lookahead_cap`` of more predicted rows, and a keyed policy restarts
  a refilled slot's score at 1."""
  from kvtier_jax import layer as layer_lib
  for staged in (True, False):
    cfg = make_cfg(impl="xla", fetch_chunk=8, overlap_hit_miss=staged)
    h = Harness(cfg, [200, 260, 300], seed=1)
    want = np.zeros(cfg.num_layers, np.int64)
    for _ in range(4):
      before = np.asarray(h.state.misses).sum((1, 2))
      out, ref = h.step()
      np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
      misses = np.asarray(h.state.misses).sum((1, 2)) - before  # per layer, this step
      if staged:  # first chunk always
        want += np.maximum(1, -(-misses // 8)) * 8
      elif common.on_gpu():  # every XLA fetch is staged there (fetch.fetch_misses)
        want += -(-misses // 8) * 8
      else:
        want += misses
    stats = kv_state.cache_stats(cfg, h.state)
    assert stats["misses"] > 0 and stats["misses"] % 8  # some padding crossed
    np.testing.assert_array_equal(np.asarray(h.state.fetched_rows), want, f"{staged=}")
    assert stats["host_to_device_bytes"] == 2 * int(want.sum()) * cfg.row_bytes
  for policy in ("lru", "freq"):
    keyed = make_cfg(lookahead_cap=4, policy=PolicyConfig(policy))
    kp, vp = random_kv(np.random.default_rng(), keyed, 200)
    st = decode.prefill(keyed, kv_state.init_state(keyed), kp, vp, jnp.array([200] * 3))
    held = np.asarray(st.slot_pos[0])
    pred = np.full((keyed.num_requests, keyed.num_units, 8), -1, np.int32)
    for r, u in np.ndindex(pred.shape[:2]):  # 8 positions, 6 of them not resident
      out = [p for p in range(200) if p not in held[r, u]][:6]
      pred[r, u] = out[:3] + [held[r, u, 0], held[r, u, 1]] + out[3:]
    res, score = layer_lib.prefetch_resolve(
        keyed, st.slot_pos[0], st.lru[0], st.slot_score[0] + 0.25, jnp.asarray(pred),
        jnp.broadcast_to(st.seq_len[:, None], pred.shape[:2]))
    is_miss, slot = np.asarray(res.is_miss), np.asarray(res.slot)
    np.testing.assert_array_equal(is_miss.sum(-1), 4)  # the cap, not 3 or 6
    np.testing.assert_array_equal(is_miss[..., :6], [[[1, 1, 1, 0, 0, 1]]] * 3)
    refilled = np.take_along_axis(np.asarray(score), np.where(is_miss, slot, 0), -1)
    np.testing.assert_array_equal(refilled[is_miss], 1.0 if policy == "freq" else 0.25)
    # The draft pass's cap: the resident ones and the newest kept, then the first
    # 4 of the 6 others; the last 2 dropped.
    draft = np.concatenate([pred, np.broadcast_to(np.asarray(st.seq_len)[:, None, None],
                                                  pred.shape[:2] + (1,))], -1)
    capped = np.asarray(layer_lib.cap_misses(keyed, st, 0, jnp.asarray(draft), 4))
    np.testing.assert_array_equal(capped[..., :8] >= 0, [[[1, 1, 1, 1, 1, 1, 0, 0]]] * 3)
    np.testing.assert_array_equal(capped[..., 8], np.asarray(st.seq_len)[:, None])
