"""psum, pmean, pmax and pmin of Python numbers and NumPy values.

As in JAX, a reduction of a constant is known while tracing and comes back
as a host value of the constant's type: `psum(1, 'i')` is the axis size as a
Python int. Each value the mapped function saw is recorded in `seen` while
it traces and compared with numbers worked out by hand.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax


def traced(function, *args, **map_options):
  """Runs `function` under a pmap over 'i'; returns (result, what it saw)."""
  seen = {}
  result = tfspmd.pmap(lambda *a: function(seen, *a), "i", **map_options)(
      *args)
  return result, seen


def seen_of(function):
  """What `function` saw under a pmap over 'i' of 4 devices."""
  return traced(function, np.zeros(4, np.float32))[1]


def assert_same_host_value(value, expected):
  assert type(value) is type(expected), (type(value), type(expected))
  np.testing.assert_array_equal(value, expected)
  if isinstance(expected, (np.ndarray, np.generic)):
    assert value.dtype == expected.dtype


def test_psum_of_python_int_is_the_axis_size_as_an_int():
  def f(seen, x):
    seen["size"] = lax.psum(1, "i")
    seen["big"] = lax.psum(2 ** 40 + 1, "i")
    return x * seen["size"]

  result, seen = traced(f, np.arange(4, dtype=np.float32))
  assert_same_host_value(seen["size"], 4)
  assert_same_host_value(seen["big"], 4 * 2 ** 40 + 4)
  np.testing.assert_array_equal(result, [0., 4., 8., 12.])


@pytest.mark.parametrize("operand, expected", [
    (2.0, 16.0),
    (0.5j, 4j),
    (-3, -24),
])
def test_psum_of_python_number_keeps_its_type(operand, expected):
  def f(seen, x):
    seen["sum"] = lax.psum(operand, "i")
    return x

  _, seen = traced(f, np.zeros(8, np.float32))
  assert_same_host_value(seen["sum"], expected)


@pytest.mark.parametrize("operand, expected", [
    (np.float32(2.5), np.float32(10.)),
    (np.int32(3), np.int32(12)),
    (np.uint8(7), np.uint8(28)),
    (np.array([1, -2], np.int64), np.array([4, -8], np.int64)),
    (np.array([[0.5]], np.float16), np.array([[2.]], np.float16)),
])
def test_psum_of_numpy_value_gives_numpy_of_its_dtype(operand, expected):
  def f(seen, x):
    seen["sum"] = lax.psum(operand, "i")
    return x

  assert_same_host_value(seen_of(f)["sum"], expected)


@pytest.mark.parametrize("operand, expected", [
    (1, 1.0),             # int / int: a Python float, as in JAX
    (6, 6.0),
    (2.5, 2.5),
    (1 + 2j, 1 + 2j),
    (np.int32(3), np.float64(3.)),  # NumPy's int32 / int is float64
    (np.array([2., 4.], np.float32), np.array([2., 4.], np.float32)),
])
def test_pmean_of_constant_is_psum_over_axis_size(operand, expected):
  def f(seen, x):
    seen["mean"] = lax.pmean(operand, "i")
    return x

  assert_same_host_value(seen_of(f)["mean"], expected)


@pytest.mark.parametrize("collective", [lax.pmax, lax.pmin])
@pytest.mark.parametrize("operand", [
    5, -2.5, np.int32(7), np.array([3., -1.], np.float32)])
def test_pmax_and_pmin_of_constant_is_the_constant(collective, operand):
  def f(seen, x):
    seen["extremum"] = collective(operand, "i")
    return x

  assert_same_host_value(seen_of(f)["extremum"], operand)


def test_pytree_of_constants_is_reduced_leafwise():
  def f(seen, x):
    seen["sum"] = lax.psum({"a": 1, "b": (2.0, np.int32(3))}, "i")
    seen["mean"] = lax.pmean([1, 0.5], "i")
    seen["max"] = lax.pmax((4, [1.5]), "i")
    return x

  seen = seen_of(f)
  assert seen["sum"]["a"] == 4 and type(seen["sum"]["a"]) is int
  assert_same_host_value(seen["sum"]["b"][0], 8.0)
  assert_same_host_value(seen["sum"]["b"][1], np.int32(12))
  assert seen["mean"] == [1.0, 0.5]
  assert all(type(v) is float for v in seen["mean"])
  assert seen["max"] == (4, [1.5])


def test_tensor_leaves_beside_constants_are_still_reduced():
  x = np.arange(4, dtype=np.float32)

  def f(seen, v):
    total, count = lax.psum((v, 1), "i")
    seen["count"] = count
    return total / count

  result, seen = traced(f, x)
  assert_same_host_value(seen["count"], 4)
  np.testing.assert_allclose(result, np.full(4, x.sum() / 4))


def test_tensor_operand_gives_a_tensor_as_before():
  def f(seen, x):
    seen["sum"] = lax.psum(tf.constant(1), "i")
    seen["max"] = lax.pmax(tf.constant(2.), "i")
    return x * tf.cast(seen["sum"], x.dtype) + seen["max"]

  result, seen = traced(f, np.ones(4, np.float32))
  assert isinstance(seen["sum"], tf.Tensor)
  assert isinstance(seen["max"], tf.Tensor)
  np.testing.assert_array_equal(result, np.full(4, 6.))


def test_ring_sum_over_range_of_axis_size_matches_numpy_sum():
  x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)

  def ring_sum(v):
    n = lax.psum(1, "i")
    perm = [(k, (k + 1) % n) for k in range(n)]
    total = v
    for _ in range(n - 1):
      v = lax.ppermute(v, "i", perm)
      total += v
    return total

  result = tfspmd.pmap(ring_sum, "i")(x)
  np.testing.assert_allclose(result, np.broadcast_to(x.sum(0), (8, 3)),
                             rtol=1e-5)


def test_nested_pmaps_and_tuple_of_axes_multiply_the_sizes():
  seen = {}

  def inner(v):
    seen["rows"] = lax.psum(1, "rows")
    seen["cols"] = lax.psum(1, "cols")
    seen["both"] = lax.psum(1, ("rows", "cols"))
    seen["mean"] = lax.pmean(3, ("cols", "rows"))
    return v * seen["both"]

  outer = tfspmd.pmap(tfspmd.pmap(inner, "cols"), "rows")
  result = outer(np.ones((2, 4), np.float32))
  assert_same_host_value(seen["rows"], 2)
  assert_same_host_value(seen["cols"], 4)
  assert_same_host_value(seen["both"], 8)
  assert_same_host_value(seen["mean"], 3.0)
  np.testing.assert_array_equal(result, np.full((2, 4), 8.))


def test_vmap_axis_size_alone_and_inside_pmap():
  seen = {}

  def per_slice(v):
    seen["v"] = lax.psum(1, "v")
    return v + lax.psum(2.0, "v")

  result = tfspmd.vmap(per_slice, axis_name="v")(np.zeros(3, np.float32))
  assert_same_host_value(seen["v"], 3)
  np.testing.assert_array_equal(result, [6., 6., 6.])

  def per_device(v):
    seen["both"] = lax.psum(1, ("i", "v"))
    return v

  tfspmd.pmap(tfspmd.vmap(per_device, axis_name="v"), "i")(
      np.zeros((4, 5), np.float32))
  assert_same_host_value(seen["both"], 20)


def test_shard_map_mesh_axes_on_a_two_dimensional_mesh():
  mesh = tfspmd.make_mesh((2, 4), ("data", "model"))
  seen = {}

  def block(v):
    seen["data"] = lax.psum(1, "data")
    seen["model"] = lax.psum(1, "model")
    seen["both"] = lax.psum(1, ("data", "model"))
    return v * seen["model"]

  f = tfspmd.shard_map(block, mesh=mesh, in_specs=tfspmd.P("data", "model"),
                       out_specs=tfspmd.P("data", "model"))
  result = f(np.ones((4, 8), np.float32))
  assert_same_host_value(seen["data"], 2)
  assert_same_host_value(seen["model"], 4)
  assert_same_host_value(seen["both"], 8)
  np.testing.assert_array_equal(result, np.full((4, 8), 4.))


def test_steps_loop_body_sees_the_axis_size():
  seen = {}

  def step(carry, v):
    seen["size"] = lax.psum(1, "i")
    return carry + v * seen["size"], v

  carry, _ = tfspmd.pmap(step, "i", steps=3)(
      np.zeros(4, np.float32), np.ones((4, 3), np.float32))
  assert_same_host_value(seen["size"], 4)
  np.testing.assert_array_equal(carry, np.full(4, 12.))


def test_debug_mode_gives_host_values_and_runs_the_ring():
  x = np.arange(4, dtype=np.float32)
  seen = {}

  def ring_sum(v):
    n = lax.psum(1, "i")
    seen["size"], seen["mean"] = n, lax.pmean(1, "i")
    total = v
    for _ in range(n - 1):
      v = lax.ppermute(v, "i", [(k, (k + 1) % n) for k in range(n)])
      total += v
    return total

  result = tfspmd.pmap(ring_sum, "i", debug=True)(x)
  assert_same_host_value(seen["size"], 4)
  assert_same_host_value(seen["mean"], 1.0)
  np.testing.assert_array_equal(result, np.full(4, 6.))


def test_inside_while_loop_and_cond_bodies():
  x = np.arange(4, dtype=np.float32)
  seen = {}

  def f(v):
    def body(k, total):
      seen["loop"] = lax.psum(1, "i")
      return k + 1, total + v * seen["loop"]

    _, total = tf.while_loop(lambda k, _: k < 2, body, (0, tf.zeros_like(v)))

    def large():
      seen["cond"] = lax.psum(1.5, "i")
      return total + seen["cond"]

    return tf.cond(tf.constant(True), large, lambda: total)

  result = tfspmd.pmap(f, "i")(x)
  assert_same_host_value(seen["loop"], 4)
  assert_same_host_value(seen["cond"], 6.0)
  np.testing.assert_array_equal(result, x * 4 * 2 + 6.)


def test_unbound_axis_name_is_still_a_name_error():
  with pytest.raises(NameError, match="psum: unbound axis name: 'unbound'"):
    tfspmd.pmap(lambda x: x * lax.psum(1, "unbound"), "i")(np.zeros(2))
  with pytest.raises(NameError, match="pmax: unbound axis name: 'j'"):
    tfspmd.pmap(lambda x: x + lax.pmax(1, ("i", "j")), "i")(np.zeros(2))
  with pytest.raises(NameError, match="No axis is bound here"):
    lax.psum(1, "i")


def test_constants_the_collective_refuses_are_still_refused():
  # A bool constant is reduced as an int32 tensor, as in JAX
  # (test_jax_names.py).
  with pytest.raises(TypeError, match="pmax: x has dtype complex128"):
    tfspmd.pmap(lambda x: x + lax.pmax(1j, "i"), "i")(np.zeros(2))
