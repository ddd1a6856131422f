"""ShardedArray operators and methods: on the devices, against NumPy."""

import copy
import operator
import pickle

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax


@pytest.fixture(name="x")
def fixture_x():
  return np.arange(1, 25, dtype=np.float32).reshape(8, 3)


@pytest.fixture(name="out")
def fixture_out(x):
  return tfspmd.pmap(lambda v: v * 1)(x)


def on_devices(result, spec=("axis_0", None)):
  """The result is a ShardedArray still split as pmap left it."""
  assert isinstance(result, tfspmd.ShardedArray)
  assert result.placement.spec == spec
  return np.asarray(result)


BINARY = [operator.add, operator.sub, operator.mul, operator.truediv,
          operator.floordiv, operator.mod, operator.pow, operator.eq,
          operator.ne, operator.lt, operator.le, operator.gt, operator.ge]


@pytest.mark.parametrize("op", BINARY, ids=lambda op: op.__name__)
def test_binary_operators_with_every_kind_of_operand(op, x, out):
  other_row = np.linspace(1, 3, 3).astype(np.float32)
  cases = [
      (op(out, 2.0), op(x, np.float32(2.0))),
      (op(3.0, out), op(np.float32(3.0), x)),
      (op(out, other_row), op(x, other_row)),        # broadcast a row
      (op(other_row, out), op(other_row, x)),
      (op(out, tf.constant(other_row)), op(x, other_row)),
      (op(out, out), op(x, x)),
  ]
  for got, expected in cases:
    np.testing.assert_allclose(on_devices(got), expected, rtol=1e-6)


def test_unary_operators_and_matmul(x, out):
  np.testing.assert_array_equal(on_devices(-out), -x)
  np.testing.assert_array_equal(on_devices(abs(out - 12)), abs(x - 12))
  assert +out is out
  w = np.arange(6, dtype=np.float32).reshape(3, 2)
  np.testing.assert_allclose(on_devices(out @ w), x @ w)
  np.testing.assert_allclose(on_devices(out @ w[:, 0], ("axis_0",)),
                             x @ w[:, 0])
  rows = np.ones((2, 8), np.float32)
  np.testing.assert_allclose(np.asarray(rows @ out), rows @ x)


def test_methods(x, out):
  np.testing.assert_array_equal(on_devices(out.astype(np.int32)),
                                x.astype(np.int32))
  assert out.astype(tf.int64).dtype == tf.int64
  np.testing.assert_array_equal(on_devices(out.T, (None, "axis_0")), x.T)
  assert out.ndim == 2 and out.size == 24
  np.testing.assert_allclose(np.asarray(out.sum()), x.sum())
  np.testing.assert_allclose(np.asarray(out.sum(axis=0)), x.sum(0))
  np.testing.assert_allclose(np.asarray(out.mean(axis=1, keepdims=True)),
                             x.mean(1, keepdims=True))
  np.testing.assert_allclose(np.asarray(out.max(axis=1)), x.max(1))
  np.testing.assert_allclose(np.asarray(out.min()), x.min())
  ints = tfspmd.pmap(lambda v: v)(np.arange(8, dtype=np.int32))
  assert float(ints.mean()) == 3.5  # NumPy's mean of integers, not 3


def test_tensorflow_and_numpy_functions_take_results(x, out):
  np.testing.assert_allclose(tf.reduce_sum(out), x.sum())
  np.testing.assert_allclose(out + tf.ones((8, 3)), x + 1)
  np.testing.assert_allclose(np.mean(out), x.mean())
  np.testing.assert_allclose(np.sum(out, axis=0), x.sum(0))
  np.testing.assert_allclose(np.exp(out), np.exp(x), rtol=1e-6)


def test_equal_results_compare_elementwise(x, out):
  again = tfspmd.pmap(lambda v: v + 0)(x)
  assert bool(np.all(np.asarray(out == again)))
  assert (out == again).dtype == tf.bool
  with pytest.raises(TypeError, match="unhashable"):
    hash(out)
  assert (out == "text") is False  # not an array: Python's default


def test_operands_follow_tensorflow_dtypes(out):
  ints = tfspmd.pmap(lambda v: v)(np.arange(8, dtype=np.int32))
  assert (ints + 1).dtype == tf.int32   # a Python number takes the array's
  assert (out * 2).dtype == tf.float32
  for other in (1.5, np.float64(1.5), np.array([1.5] * 8)):
    # No promotion, and above all no silent truncation of 1.5 to 1.
    with pytest.raises(TypeError, match="int32"):
      ints + other  # pylint: disable=pointless-statement


def test_results_of_a_nested_pmap_keep_both_splits():
  inner = tfspmd.pmap(
      lambda v: v + tf.cast(lax.axis_index("c"), tf.float32), axis_name="c")
  out = tfspmd.pmap(inner, axis_name="r")(np.zeros((2, 4), np.float32))
  np.testing.assert_array_equal(on_devices(out * 10, ("axis_0", "axis_1")),
                                np.tile(np.arange(4) * 10.0, (2, 1)))
  other = tfspmd.pmap(lambda v: v * 1)(np.ones(4, np.float32))
  with pytest.raises(ValueError, match="same devices"):
    out + other  # pylint: disable=pointless-statement


def test_a_shard_map_result_meets_a_pmap_result_on_the_same_8_devices():
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  mesh = tfspmd.make_mesh((2, 4), ("r", "c"))
  doubled = tfspmd.shard_map(lambda v: v * 2., mesh=mesh,
                             in_specs=tfspmd.P(("r", "c")),
                             out_specs=tfspmd.P(("r", "c")))(x)
  plus_one = tfspmd.pmap(lambda v: v + 1.)(x)
  np.testing.assert_array_equal(np.asarray(doubled + plus_one), 3 * x + 1)
  np.testing.assert_array_equal(np.asarray(plus_one - doubled), 1 - x)
  np.testing.assert_array_equal(np.asarray(plus_one * doubled[0]),
                                (x + 1) * (2 * x[0]))
  both = tfspmd.pmap(lambda u, v: u * v)(doubled, plus_one)
  np.testing.assert_array_equal(np.asarray(both), 2 * x * (x + 1))


def test_arrays_on_different_devices_name_both_device_lists():
  x = np.ones((4, 2), np.float32)
  first = tfspmd.pmap(lambda v: v, devices=tfspmd.devices()[:4])(x)
  last = tfspmd.pmap(lambda v: v, devices=tfspmd.devices()[4:])(x)
  with pytest.raises(ValueError, match=r"one lies on 4 \w+ devices \[0, 1, 2, "
                     r"3\], the other on 4 \w+ devices \[4, 5, 6, 7\]"):
    first + last  # pylint: disable=pointless-statement


def test_copies_stay_on_the_devices_and_pickles_hold_the_values(x, out):
  for duplicate in (copy.copy(out), copy.deepcopy(out), copy.deepcopy([out])[0]):
    assert duplicate is not out
    assert duplicate.dtensor_value is not out.dtensor_value
    np.testing.assert_array_equal(on_devices(duplicate), x)
  loaded = pickle.loads(pickle.dumps({"out": out}))["out"]
  assert isinstance(loaded, np.ndarray)
  np.testing.assert_array_equal(loaded, x)


def test_reshape_of_the_axes_after_the_mapped_one(x, out):
  np.testing.assert_array_equal(
      on_devices(out.reshape(8, 3, 1), ("axis_0", None, None)),
      x.reshape(8, 3, 1))
  np.testing.assert_array_equal(
      on_devices(out.reshape((8, -1, 1, 1)), ("axis_0", None, None, None)),
      x.reshape(8, 3, 1, 1))
  wide = tfspmd.pmap(lambda v: v)(np.arange(48.).reshape(8, 6))
  np.testing.assert_array_equal(on_devices(wide.reshape(8, 3, 2),
                                           ("axis_0", None, None)),
                                np.arange(48.).reshape(8, 3, 2))
  for bad in [(8, 4), (8.0, 3), (-1, -1), (-1, 5), (0, -1), (8, -2)]:
    with pytest.raises(ValueError, match=r"ShardedArray.reshape"):
      out.reshape(*bad)


def test_reshape_across_devices_as_numpy_reshapes_the_whole_array():
  # As jax.Array.reshape of a pmap result: the elements in row-major order.
  x = np.arange(64.).reshape(8, 4, 2)
  out = tfspmd.pmap(lambda v: v * 2)(x)
  # Each device keeps its own elements where its block is a run of rows.
  for shape, spec in [((-1, 2), ("axis_0", None)), ((64,), ("axis_0",)),
                      ((1, 16, 4), (None, "axis_0", None)),
                      ((2, 32), (None, None)), ((4, -1), (None, None))]:
    np.testing.assert_array_equal(on_devices(out.reshape(*shape), spec),
                                  (x * 2).reshape(shape))


def test_reshape_of_a_result_mapped_along_axis_1():
  out = tfspmd.pmap(lambda v: v, out_axes=1)(np.arange(24.).reshape(4, 3, 2))
  expected = np.moveaxis(np.arange(24.).reshape(4, 3, 2), 0, 1)
  np.testing.assert_array_equal(
      on_devices(out.reshape(3, 4, 2, 1), (None, "axis_0", None, None)),
      expected.reshape(3, 4, 2, 1))
  np.testing.assert_array_equal(on_devices(out.reshape(12, 2), (None, None)),
                                expected.reshape(12, 2))


def test_repr_shows_values_dtype_and_how_the_array_lies():
  out = tfspmd.pmap(lambda v: v * 2)(np.arange(4, dtype=np.int32))
  assert repr(out) == ("ShardedArray([0, 2, 4, 6], dtype=int32, axis 0 over 4 "
                       "devices)")
  total = tfspmd.pmap(lambda v: lax.psum(v, "i"), "i", out_axes=None)(
      np.ones(8, np.float32))
  assert repr(total) == "ShardedArray(8., dtype=float32, replicated on 8 devices)"
  inner = tfspmd.pmap(lambda v: v, axis_name="c")
  nested = tfspmd.pmap(inner, axis_name="r")(np.zeros((2, 4), np.float32))
  assert repr(nested).endswith(
      "dtype=float32, axis 0 over 2 devices, axis 1 over 4 devices)")


@pytest.fixture(name="without_x64")
def fixture_without_x64():
  tfspmd.config.update("tfspmd_enable_x64", False)
  yield
  tfspmd.config.update("tfspmd_enable_x64", True)


def test_float64_numpy_inputs_arrive_as_float32_without_x64(without_x64):
  del without_x64  # unused
  w = tf.constant([0.5, 0.25])  # float32 parameters, as Keras makes them
  batch = np.arange(8.).reshape(4, 2)  # float64, as NumPy makes it
  out = tfspmd.pmap(lambda p, v: v * p, in_axes=(None, 0))(w, batch)
  assert out.dtype == tf.float32
  np.testing.assert_array_equal(out, (batch * [0.5, 0.25]).astype(np.float32))
  assert tfspmd.vmap(lambda v: v)(np.ones(3)).dtype == tf.float32
  assert tfspmd.pmap(lambda v: v)(np.ones(2, np.complex128)).dtype == tf.complex64
  assert (out + np.ones(2)).dtype == tf.float32
  # Integers keep their width (no wrapping of large values), tensors their dtype.
  big = np.array([2**40, 1], np.int64)
  np.testing.assert_array_equal(tfspmd.pmap(lambda v: v)(big), big)
  assert tfspmd.pmap(lambda v: v)(tf.ones(2, tf.float64)).dtype == tf.float64


def test_float64_stays_by_default_and_config_checks_its_input():
  assert tfspmd.pmap(lambda v: v)(np.ones(2)).dtype == tf.float64
  assert tfspmd.config.tfspmd_enable_x64 is True
  with pytest.raises(AttributeError, match="no setting 'jax_debug_nans'"):
    tfspmd.config.update("jax_debug_nans", False)
  with pytest.raises(TypeError, match="must be True or False, got int 0"):
    tfspmd.config.update("tfspmd_enable_x64", 0)


def test_config_takes_a_numpy_bool_and_refuses_attribute_assignment():
  try:
    tfspmd.config.update("jax_enable_x64", np.bool_(False))
    assert tfspmd.config.tfspmd_enable_x64 is False
    assert tfspmd.pmap(lambda v: v)(np.ones(2)).dtype == tf.float32
    with pytest.raises(AttributeError, match="cannot be assigned"):
      tfspmd.config.tfspmd_enable_x64 = True
    assert tfspmd.config.tfspmd_enable_x64 is False
  finally:
    tfspmd.config.update("tfspmd_enable_x64", True)
  assert tfspmd.pmap(lambda v: v)(np.ones(2)).dtype == tf.float64
