"""Arrays split over several mesh axes in one dimension (`P(('a', 'b'))`).

As in JAX, such a dimension is split over the product of the axes, the
first named major: the device at mesh position c holds, along it, block
sum_k c[axis_k] * (size of the axes after axis_k). Every expectation below
is that rule in NumPy (8 logical CPU devices).
"""

import math

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfspmd
from tfspmd import lax
from tfspmd._src.runtime import placement as placement_lib
from tfspmd.sharding import NamedSharding
from tfspmd.sharding import PartitionSpec as P


def _axes(spec, dimension):
  entry = spec[dimension] if dimension < len(spec) else None
  if entry is None:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def jax_index(mesh, spec, coords, shape):
  """The NumPy index of the block JAX gives the device at `coords`."""
  position = dict(zip(mesh.axis_names, coords))
  index = []
  for dimension, extent in enumerate(shape):
    block, count = 0, 1
    for name in _axes(spec, dimension):  # major to minor
      block = block * mesh.shape[name] + position[name]
      count *= mesh.shape[name]
    step = extent // count
    index.append(slice(block * step, (block + 1) * step)
                 if count > 1 else slice(None))
  return tuple(index)


def check_lies_as_jax_lays_it(out, mesh, spec, expected):
  """`out` has `expected`'s values, JAX's sharding and JAX's blocks."""
  np.testing.assert_allclose(out, expected, rtol=1e-6)
  assert out.sharding == NamedSharding(mesh, spec)
  shards = out.addressable_shards
  assert [shard.device for shard in shards] == list(mesh.devices.flat)
  for coords, device in np.ndenumerate(mesh.devices):
    (shard,) = [s for s in shards if s.device == device]
    index = jax_index(mesh, spec, coords, expected.shape)
    assert shard.index == index, (coords, shard.index, index)
    np.testing.assert_allclose(shard.data, expected[index], rtol=1e-6)


CASES = [
    ((2, 4), ("a", "b"), P(("a", "b")), (16, 1)),
    ((2, 4), ("a", "b"), P(("b", "a")), (16, 1)),
    ((2, 4), ("a", "b"), P(None, ("a", "b")), (3, 16)),
    ((2, 4), ("a", "b"), P(None, ("b", "a")), (3, 16)),
    ((2, 2, 2), ("a", "b", "c"), P(("a", "b", "c")), (16, 2)),
    ((2, 2, 2), ("a", "b", "c"), P(("c", "a", "b")), (8, 2)),
    ((2, 2, 2), ("a", "b", "c"), P(("a", "c"), "b"), (8, 4)),
    ((2, 2, 2), ("a", "b", "c"), P("b", ("c", "a")), (4, 8)),
    ((2, 2, 2), ("a", "b", "c"), P(("c", "a")), (8, 3)),  # 'b' left out
]


@pytest.mark.parametrize("shape, names, spec, x_shape", CASES, ids=str)
def test_results_and_placed_inputs_lie_as_in_jax(shape, names, spec, x_shape):
  mesh = tfspmd.make_mesh(shape, names)
  x = np.arange(math.prod(x_shape), dtype=np.float32).reshape(x_shape)
  double = tfspmd.shard_map(lambda b: b * 2, mesh=mesh, in_specs=spec,
                            out_specs=spec)
  check_lies_as_jax_lays_it(double(x), mesh, spec, x * 2)
  placed = tfspmd.device_put(x, NamedSharding(mesh, spec))
  check_lies_as_jax_lays_it(placed, mesh, spec, x)
  check_lies_as_jax_lays_it(double(placed), mesh, spec, x * 2)


def test_each_device_gets_its_block_by_its_mesh_position():
  mesh = tfspmd.make_mesh((2, 2, 2), ("a", "b", "c"))
  spec = P(("c", "a"), "b")
  rows = tfspmd.shard_map(
      lambda b: tf.zeros_like(b) + tf.cast(
          100 * lax.axis_index("a") + 10 * lax.axis_index("b") +
          lax.axis_index("c"), b.dtype),
      mesh=mesh, in_specs=spec, out_specs=spec)(np.zeros((4, 2), np.float32))
  # Rows: block 2 c + a of one row; columns: block b of one column.
  expected = np.array([[100 * a + 10 * b + c for b in range(2)]
                       for c in range(2) for a in range(2)], np.float32)
  check_lies_as_jax_lays_it(rows, mesh, spec, expected)


@pytest.mark.parametrize("in_spec, out_spec, x_shape, expected", [
    # Rows over (a, c), columns over b; the psum over b leaves it out.
    (P(("a", "c"), "b"), P(("a", "c")), (8, 4),
     lambda x: x[:, :2] + x[:, 2:]),
    (P("b", ("c", "a")), P(None, ("c", "a")), (4, 8),
     lambda x: x[:2] + x[2:]),
], ids=["rows_over_a_c", "columns_over_c_a"])
def test_an_output_leaving_an_axis_out_lies_over_the_others(
    in_spec, out_spec, x_shape, expected):
  mesh = tfspmd.make_mesh((2, 2, 2), ("a", "b", "c"))
  x = np.arange(math.prod(x_shape), dtype=np.float32).reshape(x_shape)
  out = tfspmd.shard_map(lambda b: lax.psum(b, "b"), mesh=mesh,
                         in_specs=in_spec, out_specs=out_spec)(x)
  check_lies_as_jax_lays_it(out, mesh, out_spec, expected(x))


@pytest.fixture(name="calls")
def fixture_calls(monkeypatch):
  """Counts DTensor relayouts from here on; packing from the host raises."""
  counts = {"relayout": 0}
  original = dtensor.relayout

  def counted(*args, **kwargs):
    counts["relayout"] += 1
    return original(*args, **kwargs)

  def no_host_packing(*args, **kwargs):
    raise AssertionError("a device-resident value was packed from the host")

  monkeypatch.setattr(dtensor, "relayout", counted)
  monkeypatch.setattr(placement_lib, "pack_host_array", no_host_packing)
  monkeypatch.setattr(placement_lib, "pack_global_array", no_host_packing)
  return counts


@pytest.mark.parametrize("spec", [P(("a", "b")), P(None, ("b", "a"))],
                         ids=str)
def test_a_result_goes_back_in_with_no_data_moving(request, spec,
                                                   dtensor_executor):
  # DTensor's executor moves blocks between layouts; the host's takes whole arrays.
  del dtensor_executor  # unused
  mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
  x_shape = (16, 3) if spec == P(("a", "b")) else (3, 16)
  x = np.arange(48, dtype=np.float32).reshape(x_shape)
  add_one = tfspmd.shard_map(lambda b: b + 1, mesh=mesh, in_specs=spec,
                             out_specs=spec)
  out = add_one(x)
  placed = tfspmd.device_put(x, NamedSharding(mesh, spec))
  add_one(out)  # traced here; the calls below run the program only
  calls = request.getfixturevalue("calls")
  for value, expected in ((out, x + 2), (out.dtensor_value, x + 2),
                          (placed, x + 1)):
    again = add_one(value)
    check_lies_as_jax_lays_it(again, mesh, spec, expected)
  assert calls == {"relayout": 0}
  assert tfspmd.device_put(out, out.sharding) is out


def test_arithmetic_keeps_the_sharding():
  mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
  spec = P(("b", "a"))
  x = np.arange(16, dtype=np.float32)
  placed = tfspmd.device_put(x, NamedSharding(mesh, spec))
  check_lies_as_jax_lays_it(placed * 3 + placed, mesh, spec, x * 4)


@pytest.mark.parametrize("spec", [P(("a", "b")), P(("b", "a"))], ids=str)
def test_gradients_through_the_shard_map(spec):
  mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
  x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(16, 2)
  cotangent = np.arange(32, dtype=np.float32).reshape(16, 2) / 10

  def scaled_sin(b):
    return tf.sin(b) * tf.cast(1 + lax.axis_index("b"), b.dtype)

  fun = tfspmd.shard_map(scaled_sin, mesh=mesh, in_specs=spec,
                         out_specs=spec)
  # Row r lies in block r // 2; its device's 'b' position from the spec.
  block = np.arange(16) // 2
  b_position = block % 4 if spec == P(("a", "b")) else block // 2
  scale = (1 + b_position)[:, None].astype(np.float32)
  x_var = tf.constant(x)
  with tf.GradientTape() as tape:
    tape.watch(x_var)
    out = tf.convert_to_tensor(fun(x_var))
    loss = tf.reduce_sum(out * cotangent)
  np.testing.assert_allclose(out, np.sin(x) * scale, rtol=1e-5)
  np.testing.assert_allclose(tape.gradient(loss, x_var),
                             np.cos(x) * scale * cotangent, rtol=1e-5)


def test_a_dimension_split_over_two_axes_inside_a_users_tf_function():
  mesh = tfspmd.make_mesh((2, 4), ("dp", "tp"))
  x = np.arange(64, dtype=np.float32).reshape(16, 4)
  doubled = tfspmd.shard_map(lambda b: b * 2, mesh=mesh,
                             in_specs=P(("dp", "tp")),
                             out_specs=P(("dp", "tp")))
  np.testing.assert_array_equal(np.asarray(tf.function(doubled)(x)), x * 2)
