"""``layer_scan``: the layer loop's inputs picked without dynamic slices, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvtier_jax import layer_scan


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int32, jnp.int8,
                                   jnp.bool_])
def test_pick_layer_is_indexing_bit_for_bit(dtype):
  """Every layer's pick equals ``xs[i]`` in its bits: NaNs with payloads, -0.0 and
  infinities included (a float sum or a where over the values would turn -0.0
  into 0.0)."""
  rng = np.random.default_rng()
  shape = (5, 3, 4)
  if dtype == jnp.bool_:
    xs = rng.random(shape) < 0.5
  elif jnp.issubdtype(dtype, jnp.integer):
    info = jnp.iinfo(dtype)
    xs = rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
  else:
    xs = np.array(jnp.asarray(rng.standard_normal(shape), dtype))
    flat = xs.reshape(-1)
    special = np.array([np.nan, -0.0, np.inf, -np.inf], np.float32)
    flat[rng.choice(flat.size, 4, replace=False)] = special.astype(xs.dtype)
    bits = flat.view(np.uint16 if xs.dtype.itemsize == 2 else np.uint32)
    bits[np.isnan(flat)] |= 1  # a NaN payload
  pick = jax.jit(layer_scan.pick_layer)
  as_bits = lambda a: np.asarray(a).view(np.uint8)
  for i in rng.permutation(shape[0]):
    np.testing.assert_array_equal(as_bits(pick(jnp.asarray(xs), jnp.int32(i))),
                                  as_bits(xs[i]))  # numpy's indexing


def test_scan_layers_is_lax_scan():
  """Same carry and outputs as ``jax.lax.scan`` over the same inputs, a pytree with
  a None leaf (an absent input) included."""
  rng = np.random.default_rng()
  xs = (jnp.arange(4, dtype=jnp.int32), jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
        None)

  def body(carry, x):
    index, row, absent = x
    assert absent is None
    return carry * 2 + row.sum() + index, row * index

  want = jax.lax.scan(body, jnp.float32(1), xs)
  got = jax.jit(lambda c, x: layer_scan.scan_layers(body, c, x))(jnp.float32(1), xs)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.complex64])
def test_pick_layer_refuses_what_it_cannot_pick_bit_for_bit(dtype):
  with pytest.raises(TypeError, match="whole-byte"):
    layer_scan.pick_layer(jnp.zeros((3, 2), dtype), 1)


def test_scan_layers_refuses_inputs_of_different_layer_counts():
  """``lax.scan`` refuses them; picking by the first input's count would drop a
  longer input's last layers or read zeros past a shorter one's."""
  with pytest.raises(ValueError, match="layers"):
    layer_scan.scan_layers(lambda c, x: (c, x[0]), 0, (jnp.zeros(4), jnp.zeros(3)))
