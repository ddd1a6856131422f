"""pmap's arguments, pytrees, tracing and caching, against NumPy expectations."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd._src.runtime import placement as placement_lib

from child_process import run_python

Pair = collections.namedtuple("Pair", ["a", "b"])


def test_decorator_forms_agree():
  x = np.arange(4.)

  @tfspmd.pmap
  def plain(v):
    return v + 1

  @functools.partial(tfspmd.pmap, axis_name="i")
  def partial_form(v):
    return v + lax.psum(v, "i")

  @tfspmd.pmap(axis_name="i")
  def called_form(v):
    return v + lax.psum(v, "i")

  np.testing.assert_allclose(plain(x), x + 1)
  np.testing.assert_allclose(partial_form(x), x + x.sum())
  np.testing.assert_allclose(called_form(x), x + x.sum())


def test_global_arg_shapes_is_not_accepted():
  with pytest.raises(TypeError, match="global_arg_shapes"):
    tfspmd.pmap(lambda x: x, global_arg_shapes=None)  # pylint: disable=unexpected-keyword-arg


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_in_axes_maps_any_axis(axis):
  x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
  size = x.shape[axis]
  out = tfspmd.pmap(lambda v: v * 10, in_axes=axis)(x)
  expected = np.moveaxis(x, axis, 0) * 10
  np.testing.assert_allclose(out, expected)
  assert out.shape == (size,) + expected.shape[1:]


@pytest.mark.parametrize("out_axis", [0, 1, 2, -1])
def test_out_axes_places_the_mapped_axis(out_axis):
  x = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)
  out = tfspmd.pmap(lambda v: v - 1, out_axes=out_axis)(x)
  np.testing.assert_allclose(out, np.moveaxis(x - 1, 0, out_axis))


def test_in_axes_none_broadcasts_and_out_axes_none_returns_one_copy():
  x = np.arange(4.)
  w = np.array([[1., 2.], [3., 4.]])

  def f(v, m):
    return v * m, lax.psum(v, "i") * m

  scaled, total = tfspmd.pmap(f, "i", in_axes=(0, None),
                              out_axes=(0, None))(x, w)
  np.testing.assert_allclose(scaled, x[:, None, None] * w)
  assert total.shape == (2, 2)
  np.testing.assert_allclose(total, x.sum() * w)


def test_in_axes_as_a_tree_prefix_of_dicts_and_namedtuples():
  params = {"w": np.ones((3,), np.float32), "b": np.float32(2.)}
  batch = Pair(a=np.arange(8, dtype=np.float32).reshape(4, 2),
               b=np.arange(4 * 3, dtype=np.float32).reshape(3, 4))

  def f(p, d):
    return {"sum": tf.reduce_sum(d.a) * p["b"] + tf.reduce_sum(p["w"]),
            "col": d.b * p["b"]}

  out = tfspmd.pmap(f, in_axes=(None, Pair(a=0, b=1)))(params, batch)
  assert set(out) == {"sum", "col"}
  np.testing.assert_allclose(out["sum"], batch.a.sum(1) * 2. + 3.)
  np.testing.assert_allclose(out["col"], batch.b.T * 2.)


def test_outputs_keep_the_tree_structure():
  x = np.arange(4, dtype=np.int32)
  out = tfspmd.pmap(lambda v: {"p": Pair(v, [v * 2, None]), "q": (v,)})(x)
  assert isinstance(out["p"], Pair)
  assert out["p"].b[1] is None
  np.testing.assert_array_equal(out["p"].b[0], x * 2)
  np.testing.assert_array_equal(out["q"][0], x)


def test_out_axes_tree_prefix():
  x = np.arange(4.)
  out = tfspmd.pmap(lambda v: (v, {"s": lax.psum(v, "i"), "v": v * 2}), "i",
                    out_axes=(0, {"s": None, "v": 0}))(x)
  np.testing.assert_allclose(out[1]["s"], x.sum())
  assert out[1]["s"].shape == ()
  np.testing.assert_allclose(out[1]["v"], x * 2)


def test_keyword_arguments_are_mapped_over_axis_zero():
  x = np.arange(6, dtype=np.float32).reshape(3, 2)
  out = tfspmd.pmap(lambda a, scale: a * scale, in_axes=(None,))(
      np.float32(2.), scale=x)
  np.testing.assert_allclose(out, 2. * x)


def test_python_scalars_numpy_and_tensors_mix():
  out = tfspmd.pmap(lambda a, b, c: a + b + c, in_axes=(0, 0, None))(
      tf.constant([1., 2.]), np.array([10., 20.], np.float32), 0.5)
  np.testing.assert_allclose(out, [11.5, 22.5])


def test_dtypes_are_kept():
  x = np.arange(4, dtype=np.float64)
  out = tfspmd.pmap(lambda v: v / 3)(x)
  assert out.dtype == tf.float64
  np.testing.assert_array_equal(out, x / 3)
  flags = tfspmd.pmap(lambda v: tf.logical_not(v))(np.array([True, False]))
  np.testing.assert_array_equal(flags, [False, True])


def test_static_arguments_retrace_only_when_they_change():
  traces = []

  def f(x, power):
    traces.append(power)
    return x ** power

  g = tfspmd.pmap(f, static_broadcasted_argnums=1)
  x = np.arange(4.)
  np.testing.assert_allclose(g(x, 2), x ** 2)
  np.testing.assert_allclose(g(x, 2), x ** 2)
  np.testing.assert_allclose(g(x, 3), x ** 3)
  np.testing.assert_allclose(g(x, 2), x ** 2)
  assert traces == [2, 3]


def test_static_arguments_of_other_types_trace_apart():
  # 1, 1.0, True and np.int32(1) are equal with one hash; JAX traces each
  # apart, and so must tfspmd, or f(x, 1.0) would reuse f(x, 1)'s int32.
  g = tfspmd.pmap(lambda x, c: (x, tf.fill([2], c)),
                  static_broadcasted_argnums=1)
  x = np.zeros(2, np.float32)
  results = {type(c).__name__: g(x, c)[1]
             for c in (1, 1.0, True, np.int32(1))}
  assert {name: r.dtype for name, r in results.items()} == {
      "int": tf.int32, "float": tf.float32, "bool": tf.bool,
      "int32": tf.int32}
  np.testing.assert_array_equal(results["float"], [[1., 1.], [1., 1.]])
  assert len(g._programs) == 4  # pylint: disable=protected-access
  # So are (1,) and (1.0,).
  h = tfspmd.pmap(lambda x, c: (x, tf.fill([2], c[0])),
                  static_broadcasted_argnums=1)
  assert [h(x, c)[1].dtype for c in ((1,), (1.0,))] == [tf.int32,
                                                        tf.float32]


def test_static_argument_with_in_axes_tuple_and_negative_argnum():
  g = tfspmd.pmap(lambda op, x: op(x), in_axes=(None, 0),
                  static_broadcasted_argnums=-2)
  np.testing.assert_allclose(g(tf.math.square, np.arange(3.)), np.arange(3.) ** 2)
  np.testing.assert_allclose(g(tf.math.negative, np.arange(3.)), -np.arange(3.))


def test_side_effects_happen_once_per_trace():
  printed = []
  g = tfspmd.pmap(lambda x: printed.append("traced") or x * 2)
  for _ in range(3):
    g(np.arange(4.))
  assert printed == ["traced"]
  g(np.arange(8.))
  g(np.arange(4, dtype=np.int32))
  assert printed == ["traced"] * 3


def test_a_result_goes_back_in_without_a_host_round_trip(monkeypatch,
                                                        each_executor):
  step = tfspmd.pmap(lambda x: x + 1.0)
  first = step(np.zeros(8, np.float32))

  def no_host_packing(*args, **kwargs):
    raise AssertionError("a device-resident input was packed from the host")

  def no_gathering(*args, **kwargs):
    raise AssertionError("a result was gathered into one host array")

  monkeypatch.setattr(placement_lib, "pack_host_array", no_host_packing)
  monkeypatch.setattr(placement_lib, "assemble", no_gathering)
  second = step(first)
  third = step(second)
  monkeypatch.undo()
  np.testing.assert_allclose(third, np.full(8, 3.))
  if each_executor == "dtensor":
    assert third.dtensor_value is not first.dtensor_value


def test_a_result_moves_to_another_pmap_on_the_same_devices(monkeypatch):
  produced = tfspmd.pmap(lambda x: x * 2, axis_name="a")(np.arange(4.))

  def no_host_packing(*args, **kwargs):
    raise AssertionError("packed from the host")

  monkeypatch.setattr(placement_lib, "pack_host_array", no_host_packing)
  consumed = tfspmd.pmap(lambda x: x + lax.psum(x, "b"), axis_name="b")(produced)
  np.testing.assert_allclose(consumed, np.arange(4.) * 2 + 12.)


def test_a_result_on_other_devices_is_moved():
  devices = tfspmd.devices()
  produced = tfspmd.pmap(lambda x: x * 2, devices=devices[4:])(np.arange(4.))
  consumed = tfspmd.pmap(lambda x: x + 1)(produced)
  np.testing.assert_allclose(consumed, np.arange(4.) * 2 + 1)
  assert [d.id for d in consumed.devices()] == [0, 1, 2, 3]


def test_axis_size_when_nothing_is_mapped():
  f = tfspmd.pmap(lambda: lax.axis_index("i") * 3, axis_name="i", axis_size=5)
  np.testing.assert_array_equal(f(), np.arange(5) * 3)
  g = tfspmd.pmap(lambda w: w * tf.cast(lax.psum(1, "i"), w.dtype), "i",
                  in_axes=None,
                  axis_size=3)
  np.testing.assert_allclose(g(np.float32(2.)), [6., 6., 6.])


def test_psum_of_a_constant_is_the_axis_size():
  out = tfspmd.pmap(lambda x: (lax.psum(1, "i"), lax.psum(2., "i")), "i")(
      np.zeros(6))
  np.testing.assert_array_equal(out[0], np.full(6, 6))
  np.testing.assert_allclose(out[1], np.full(6, 12.))


def test_backend_cpu_and_devices_order():
  devices = tfspmd.devices("cpu")
  order = [devices[5], devices[2], devices[7]]
  f = tfspmd.pmap(lambda x: x + 100 * lax.axis_index("i"), "i",
                  devices=order, backend="cpu")
  out = f(np.arange(3, dtype=np.int32))
  np.testing.assert_array_equal(out, np.arange(3) + 100 * np.arange(3))
  assert list(out.devices()) == order
  assert [s.device for s in out.addressable_shards] == order


def test_donated_argument_cannot_be_used_again():
  step = tfspmd.pmap(lambda x: x * 2, donate_argnums=0)
  x = tfspmd.pmap(lambda v: v + 1)(np.arange(4.))
  y = step(x)
  np.testing.assert_allclose(y, (np.arange(4.) + 1) * 2)
  assert x.is_deleted()
  with pytest.raises(RuntimeError, match="donated"):
    step(x)
  with pytest.raises(RuntimeError, match="deleted"):
    np.asarray(x)


def test_methods_are_mapped_with_self_bound():

  class Scaler:
    def __init__(self, factor):
      self.factor = factor

    @functools.partial(tfspmd.pmap, in_axes=(None, 0), static_broadcasted_argnums=0)
    def scale(self, x):
      return x * self.factor

  Scaler.__hash__ = lambda self: hash(self.factor)
  np.testing.assert_allclose(Scaler(3.).scale(np.arange(4.)), np.arange(4.) * 3)


def test_gradient_tape_inside_the_mapped_function():
  def loss_grad(w, x):
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss = tf.reduce_sum((x * w) ** 2)
    return lax.pmean(tape.gradient(loss, w), "i")

  x = np.arange(8., dtype=np.float32).reshape(4, 2)
  w = np.float32(0.5)
  grads = tfspmd.pmap(loss_grad, "i", in_axes=(None, 0))(w, x)
  expected = np.mean([np.sum(2 * r ** 2 * w) for r in x])
  np.testing.assert_allclose(grads, np.full(4, expected), rtol=1e-6)


def test_gradient_of_psum_inside_is_psum():
  def f(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = x * lax.psum(x, "i")
    return tape.gradient(y, x)

  x = np.arange(4.)
  # d/dx_k of x_k * sum_j x_j (tape seeded with ones on every device, the
  # cotangents psum'ed back): sum(x) + sum over devices of x_i.
  np.testing.assert_allclose(tfspmd.pmap(f, "i")(x), x.sum() + x.sum())


def test_a_closed_over_tensor_reaches_every_device():
  # DTensor takes only scalars and small integer tensors that are not
  # DTensors; pmap copies a closed-over array to the mesh when it traces.
  offset = tf.constant([[1., 2.], [3., 4.]])
  table = tf.range(8) * 10
  f = tfspmd.pmap(lambda v: (v + offset, tf.gather(table, lax.axis_index("i"))),
                  axis_name="i")
  shifted, picked = f(np.zeros((8, 2, 2), np.float32))
  np.testing.assert_array_equal(shifted, np.broadcast_to([[1., 2.], [3., 4.]],
                                                         (8, 2, 2)))
  np.testing.assert_array_equal(picked, np.arange(8) * 10)


def test_a_zero_argument_pmap_prints_no_deprecation_warning():
  program = ("import tfspmd\n"
             "f = tfspmd.pmap(lambda: tfspmd.lax.axis_index('i'), 'i', "
             "axis_size=4)\n"
             "print(f())\n")
  result = run_python(program, devices=None, TF_CPP_MIN_LOG_LEVEL="0")
  assert result.stdout.splitlines()[-1] == "[0 1 2 3]"
  assert "deprecat" not in result.stderr.lower()


def test_numpy_bfloat16_arguments_are_mapped(each_executor):
  # ml_dtypes' bfloat16 is of NumPy's kind "V", as untyped bytes are.
  bfloat16 = tf.bfloat16.as_numpy_dtype
  x = (np.arange(16, dtype=np.float32) / 4).reshape(8, 2).astype(bfloat16)
  out = tfspmd.pmap(lambda v: v * 2)(x)
  assert out.dtype == tf.bfloat16
  np.testing.assert_array_equal(np.asarray(out).astype(np.float32),
                                (x * bfloat16(2)).astype(np.float32))
