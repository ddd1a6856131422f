"""pmap(debug=True): each device's program runs eagerly in its own thread.

Every collective is checked in debug mode against a NumPy reference written
out per device below and against the compiled program, on 8 devices and on
a 2 x 4 mesh of nested pmaps. Calls that could hang if debug mode were
wrong run under `within`, which fails the test instead.
"""

import functools
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

import numpy_reference
from numpy_reference import data


def within(seconds, function, *args, **kwargs):
  """Calls `function(*args, **kwargs)` in a thread; fails if it hangs."""
  outcome = {}

  def target():
    try:
      outcome["value"] = function(*args, **kwargs)
    except BaseException as error:  # pylint: disable=broad-except
      outcome["error"] = error

  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(seconds)
  assert not thread.is_alive(), f"the call hangs (no result after {seconds} s)"
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


# Each collective, called on a per-device value of shape (n, 2) where n is
# the size of the group, with its per-device NumPy reference: given the
# values of the device's group in linear order and the device's position
# `me` in it, what the device gets.


def ring(n):
  return [(k, (k + 1) % n) for k in range(n)]


def partial(n):
  return [(0, n - 1), (n - 1, 1)] if n > 2 else [(0, 1)]


def shuffle(n):
  return [(3 * k + 1) % n for k in range(n)]


def received(pairs):
  source_of = {d: s for s, d in pairs}
  return lambda values, me: (values[source_of[me]] if me in source_of
                             else np.zeros_like(values[0]))


COLLECTIVES = {
    "psum": (lambda v, a, n: lax.psum(v, a),
             lambda values, me: np.sum(values, 0)),
    "pmean": (lambda v, a, n: lax.pmean(v, a),
              lambda values, me: np.mean(values, 0)),
    "pmax": (lambda v, a, n: lax.pmax(v, a),
             lambda values, me: np.max(values, 0)),
    "pmin": (lambda v, a, n: lax.pmin(v, a),
             lambda values, me: np.min(values, 0)),
    "all_gather": (lambda v, a, n: lax.all_gather(v, a, axis=1),
                   lambda values, me: np.stack(values, 1)),
    "all_gather_tiled": (
        lambda v, a, n: lax.all_gather(v, a, axis=-1, tiled=True),
        lambda values, me: np.concatenate(values, -1)),
    "psum_scatter": (lambda v, a, n: lax.psum_scatter(v, a),
                     lambda values, me: np.sum(values, 0)[me]),
    "psum_scatter_tiled": (
        lambda v, a, n: lax.psum_scatter(v, a, tiled=True),
        lambda values, me: np.sum(values, 0)[me:me + 1]),
    "ppermute_ring": (lambda v, a, n: lax.ppermute(v, a, ring(n)),
                      lambda values, me: received(ring(len(values)))(values, me)),
    "ppermute_partial": (
        lambda v, a, n: lax.ppermute(v, a, partial(n)),
        lambda values, me: received(partial(len(values)))(values, me)),
    "pshuffle": (lambda v, a, n: lax.pshuffle(v, a, shuffle(n)),
                 lambda values, me: values[shuffle(len(values))[me]]),
    "all_to_all": (lambda v, a, n: lax.all_to_all(v, a, 0, 1),
                   lambda values, me: np.stack([v[me] for v in values], 1)),
    "all_to_all_tiled": (
        lambda v, a, n: lax.all_to_all(v, a, 0, 1, tiled=True),
        lambda values, me: np.concatenate([v[me:me + 1] for v in values], 1)),
    "pswapaxes": (lambda v, a, n: lax.pswapaxes(v, a, 0),
                  lambda values, me: np.stack([v[me] for v in values], 0)),
    "axis_index": (lambda v, a, n: lax.axis_index(a),
                   lambda values, me: np.int32(me)),
    "axis_size": (lambda v, a, n: lax.axis_size(a),
                  lambda values, me: np.int32(len(values))),
}


def every_collective(v, axis_name, n):
  return {name: f(v, axis_name, n) for name, (f, _) in COLLECTIVES.items()}


def reference(x, mesh_names, names, name):
  """The NumPy result of collective `name` over `names` on a mesh."""
  return numpy_reference.over_axes(x, mesh_names, names, COLLECTIVES[name][1])


def nested(function):
  return tfspmd.pmap(tfspmd.pmap(function, axis_name="c"), axis_name="r")


def nested_debug(function):
  return tfspmd.pmap(tfspmd.pmap(function, axis_name="c", debug=True),
                     axis_name="r", debug=True)


N = 8
X_1D = data(N, N, 2)
MESH_2X4 = (("r", "c"), (2, 4))
GROUP_SIZE = {("r",): 2, ("c",): 4, ("r", "c"): 8, ("c", "r"): 8}
X_2X4 = {names: data(2, 4, size, 2, seed=size)
         for names, size in GROUP_SIZE.items()}


@functools.lru_cache(maxsize=None)
def results_1d(debug):
  f = tfspmd.pmap(lambda v: every_collective(v, "i", N), axis_name="i",
                  debug=debug)
  return {name: np.asarray(value) for name, value in f(X_1D).items()}


@functools.lru_cache(maxsize=None)
def results_2x4(names, debug):
  axis_name = names[0] if len(names) == 1 else names
  function = functools.partial(every_collective, axis_name=axis_name,
                               n=GROUP_SIZE[names])
  f = nested_debug(function) if debug else nested(function)
  return {name: np.asarray(value) for name, value in f(X_2X4[names]).items()}


def assert_close(actual, expected, what):
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6,
                             err_msg=what)
  assert actual.dtype == expected.dtype, what


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_collective_on_8_devices_matches_numpy_and_the_compiled_path(name):
  debug = within(30, results_1d, True)[name]
  assert_close(debug, reference(X_1D, ("i",), ("i",), name), "NumPy")
  assert_close(debug, results_1d(False)[name], "compiled")


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
@pytest.mark.parametrize("names", sorted(GROUP_SIZE), ids="".join)
def test_collective_on_a_2x4_mesh_matches_numpy(names, name):
  debug = within(30, results_2x4, names, True)[name]
  assert_close(debug, reference(X_2X4[names], MESH_2X4[0], names, name),
               "NumPy")


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_collective_over_a_tuple_of_nested_axes_matches_the_compiled_path(name):
  # One compiled program of a 2 x 4 mesh takes seconds to trace: the axes
  # in the order that is not the mesh's stand for the others.
  names = ("c", "r")
  assert_close(within(30, results_2x4, names, True)[name],
               results_2x4(names, False)[name], "compiled")


def test_collectives_over_each_axis_from_the_inner_pmap_match_the_compiled_path():
  x = data(2, 4, 4, 2, seed=3)

  def f(v):
    return (lax.psum(v, "r"), lax.all_gather(v, "r"),
            lax.ppermute(v, "c", ring(4)), lax.all_to_all(v, "c", 0, 0),
            lax.axis_index(("c", "r")))

  debug = within(30, nested_debug(f), x)
  compiled = nested(f)(x)
  by_row = x.sum(0, keepdims=True)
  expected = (np.broadcast_to(by_row, x.shape),
              np.broadcast_to(np.moveaxis(x, 0, 1)[None], (2, 4, 2, 4, 2)),
              np.roll(x, 1, axis=1), np.swapaxes(x, 1, 2),
              np.array([[0, 2, 4, 6], [1, 3, 5, 7]], np.int32))
  for k, (d, c, e) in enumerate(zip(debug, compiled, expected)):
    assert_close(np.asarray(d), e, f"output {k} vs NumPy")
    assert_close(np.asarray(d), np.asarray(c), f"output {k} vs compiled")


def test_gradient_tape_inside_the_function():
  n = 4
  pairs = [(0, 2), (2, 3), (3, 0)]
  x = data(n, n, seed=1)
  w = {"psum": data(n, n, seed=2), "all_gather": data(n, n, n, seed=3),
       "ppermute": data(n, n, seed=4), "all_to_all": data(n, n, n, seed=5),
       "psum_scatter": data(n, seed=6), "pmax": data(n, n, seed=7)}

  def f(v, weights):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = {"psum": lax.psum(v, "i"), "all_gather": lax.all_gather(v, "i"),
           "ppermute": lax.ppermute(v, "i", pairs),
           "all_to_all": lax.all_to_all(tf.ones([n, 1]) * v, "i", 0, 0),
           "psum_scatter": lax.psum_scatter(v, "i"), "pmax": lax.pmax(v, "i")}
      objective = sum(tf.reduce_sum(weights[k] * y[k]) for k in y)
    return tape.gradient(objective, v)

  # d/dx_j of sum_i objective_i, by the transpose of each collective.
  expected = np.broadcast_to(w["psum"].sum(0), (n, n)).copy()
  expected += w["all_gather"].sum(0)
  for source, destination in pairs:
    expected[source] += w["ppermute"][destination]
  expected += w["all_to_all"].sum(0)
  expected += np.broadcast_to(w["psum_scatter"], (n, n))
  expected += (x == x.max(0)) * w["pmax"].sum(0)

  debug = within(30, tfspmd.pmap(f, "i", debug=True), x, w)
  assert_close(np.asarray(debug), expected, "NumPy")
  assert_close(np.asarray(debug), np.asarray(tfspmd.pmap(f, "i")(x, w)),
               "compiled")


def tape_gradient(function, *inputs, variables=()):
  """The gradient of sum(function(*inputs)) by a tape around the call."""
  inputs = [tf.constant(x) for x in inputs]
  with tf.GradientTape() as tape:
    tape.watch(inputs)
    loss = tf.reduce_sum(function(*inputs))
  return [np.asarray(g) for g in tape.gradient(loss, inputs + list(variables))]


def test_gradient_tape_around_the_call_with_a_broadcast_input_and_a_variable():
  x, w = data(4, 3), data(3, seed=1)
  v = tf.Variable(data(3, seed=2))
  f = tfspmd.pmap(lambda a, b: a * lax.psum(a, "i") * b * v, "i",
                  in_axes=(0, None), debug=True)
  grad_x, grad_w, grad_v = within(30, tape_gradient, f, x, w, variables=[v])
  # loss = sum_k S_k^2 w_k v_k with S = x.sum(0).
  total = x.sum(0)
  assert_close(grad_x, np.broadcast_to(2 * total * w * v.numpy(), x.shape), "x")
  assert_close(grad_w, total ** 2 * v.numpy(), "w")
  assert_close(grad_v, total ** 2 * w, "v")


def test_gradient_tape_around_nested_debug_pmaps():
  x = data(2, 4, 3)
  f = nested_debug(lambda v: lax.pmax(v, "r") * v)
  top = x.max(0)
  [grad] = within(30, tape_gradient, f, x)
  assert_close(grad, top + (x == top) * x.sum(0), "NumPy")


def test_gradient_tape_inside_the_outer_function_around_the_inner_pmap():
  def outer(row):
    with tf.GradientTape() as tape:
      tape.watch(row)
      inner = tfspmd.pmap(lambda e: e * lax.psum(e, ("r", "c")) ** 2, "c")
      loss = tf.reduce_sum(inner(row))
    return tape.gradient(loss, row)

  x = data(2, 4)
  debug = within(30, tfspmd.pmap(outer, "r", debug=True), x)
  # Every device seeds its own loss, and psum's transpose sums the
  # cotangents of all: d/dx of sum_r sum_c x_rc S^2 = S^2 + 2 S^2.
  expected = np.full(x.shape, 3 * x.sum() ** 2, np.float32)
  assert_close(np.asarray(debug), expected, "NumPy")
  assert_close(np.asarray(debug), np.asarray(tfspmd.pmap(outer, "r")(x)),
               "compiled")


def test_print_inside_the_function_prints_each_device_value(capsys):
  def f(x):
    print(f"device {int(lax.axis_index('i'))} has {x.numpy()}")
    return lax.psum(x, "i")

  within(30, tfspmd.pmap(f, "i", debug=True), np.arange(4) * 10)
  lines = sorted(capsys.readouterr().out.splitlines())
  assert lines == [f"device {k} has {k * 10}" for k in range(4)]


def test_an_exception_on_one_device_is_raised_in_the_caller():
  def f(x):
    if lax.axis_index("i") == 5:
      raise ValueError("bad value on one device")
    return lax.psum(x, "i")

  with pytest.raises(ValueError, match="bad value on one device") as raised:
    within(30, tfspmd.pmap(f, "i", debug=True), np.zeros(8))
  assert "{'i': 5}" in " ".join(raised.value.__notes__)


def test_an_exception_in_a_nested_pmap_names_the_device_on_every_axis():
  def f(x):
    if lax.axis_index(("r", "c")) == 6:
      raise KeyError("missing")
    return lax.all_gather(x, "r")

  with pytest.raises(KeyError) as raised:
    within(30, nested_debug(f), np.zeros((2, 4)))
  assert "{'r': 1, 'c': 2}" in " ".join(raised.value.__notes__)


def test_devices_waiting_at_different_collectives_raise_instead_of_hanging():
  def f(x):
    if lax.axis_index("i") != 2:
      x = lax.psum(x, "i")
    return x

  with pytest.raises(RuntimeError, match="psum over 'i' waits for 4 devices"):
    within(30, tfspmd.pmap(f, "i", debug=True), np.zeros(4))


def test_devices_calling_different_collectives_at_one_point_is_an_error():
  def f(x):
    if lax.axis_index("i") == 0:
      return lax.pmax(x, "i")
    return lax.psum(x, "i")

  with pytest.raises(RuntimeError, match="met at different collectives"):
    within(30, tfspmd.pmap(f, "i", debug=True), np.zeros(4))


def test_values_of_different_shapes_on_the_devices_are_an_error():
  def f(x):
    return lax.psum(tf.zeros([lax.axis_index("i") + 1]) + x, "i")

  with pytest.raises(ValueError, match="different shapes or dtypes"):
    within(30, tfspmd.pmap(f, "i", debug=True), np.zeros(2, np.float32))


@pytest.mark.parametrize("write", [
    lambda v, x: v.assign_add(tf.reduce_sum(x, keepdims=True)),
    lambda v, x: v.assign(x),
    lambda v, x: v.scatter_add(tf.IndexedSlices(x, [0])),
    lambda v, x: tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=x),
], ids=["assign_add", "assign", "scatter_add", "raw_op"])
def test_a_refused_variable_write_takes_effect_on_no_device(write):
  variable = tf.Variable([5.])
  with pytest.raises(ValueError, match="writes to a tf.Variable"):
    within(30, tfspmd.pmap(lambda x: write(variable, x), "i", debug=True),
           np.arange(4, dtype=np.float32).reshape(4, 1))
  np.testing.assert_array_equal(variable.numpy(), [5.])


def test_a_variable_created_on_each_device_may_take_its_initial_value():
  def f(x):
    return tf.Variable(tf.ones([2])).read_value() * x

  out = within(30, tfspmd.pmap(f, "i", debug=True),
               np.arange(4, dtype=np.float32).reshape(4, 1))
  np.testing.assert_array_equal(np.asarray(out),
                                np.arange(4.).reshape(4, 1) * np.ones((1, 2)))


def test_debug_must_be_a_bool():
  with pytest.raises(TypeError, match="`debug` must be True or False, got str"):
    tfspmd.pmap(lambda x: x, debug="yes")


def test_arguments_and_results_are_handled_as_in_the_compiled_path():
  def f(scale, x, w, *, bias):
    return {"y": scale * x["a"] @ w + bias, "total": lax.psum(x["b"], "i")}

  x = {"a": data(2, 4, 3), "b": data(3, 4, seed=1)}
  w = data(3, 5, seed=2)
  bias = data(4, 5, seed=3)
  options = dict(axis_name="i", in_axes=(None, 1, None),
                 out_axes={"y": 1, "total": None},
                 static_broadcasted_argnums=0)
  debug = within(30, tfspmd.pmap(f, debug=True, **options), 2.0, x, w,
                 bias=bias)
  compiled = tfspmd.pmap(f, **options)(2.0, x, w, bias=bias)
  expected = {"y": np.stack([2.0 * x["a"][:, k] @ w + bias[k]
                             for k in range(4)], 1),
              "total": x["b"].sum(1)}
  for key in ("y", "total"):
    assert isinstance(debug[key], tf.Tensor)
    assert debug[key].shape == compiled[key].shape
    assert debug[key].dtype == compiled[key].dtype
    assert_close(np.asarray(debug[key]), expected[key], key)


def test_out_axes_none_for_an_output_that_differs_between_devices_is_an_error():
  f = tfspmd.pmap(lambda x: x, "i", out_axes=None, debug=True)
  with pytest.raises(ValueError, match="varies across the devices"):
    within(30, f, np.arange(4))


def test_debug_mode_context_runs_every_pmap_eagerly_nested_ones_too():
  def inner(x):
    return tf.constant(tf.executing_eagerly()) & (lax.psum(x, "r") > 0)

  f = nested(inner)

  def in_debug_mode(x):
    with tfspmd.debug_mode():
      return f(x)

  out = within(30, in_debug_mode, np.ones((2, 4)))
  np.testing.assert_array_equal(out, np.ones((2, 4), bool))
  np.testing.assert_array_equal(f(np.ones((2, 4))), np.zeros((2, 4), bool))


def test_a_debug_pmap_inside_a_compiled_pmap_is_an_error():
  inner = tfspmd.pmap(lambda x: x, axis_name="c", debug=True)
  with pytest.raises(RuntimeError, match="outermost pmap"):
    tfspmd.pmap(inner, axis_name="r")(np.zeros((2, 4)))


def test_a_vmap_inside_still_vectorizes_with_collectives_over_its_axis():
  def f(x):
    per_row = tfspmd.vmap(
        lambda row: lax.psum(row, "b") + tf.cast(lax.axis_index("b"), tf.float32),
        axis_name="b")
    return per_row(x) * lax.axis_size("i")

  x = data(4, 3, 2)
  expected = (np.broadcast_to(x.sum(1, keepdims=True), x.shape) +
              np.arange(3)[:, None]) * 4
  debug = within(30, tfspmd.pmap(f, "i", debug=True), x)
  assert_close(np.asarray(debug), expected.astype(np.float32), "NumPy")


def test_a_collective_over_the_debug_axis_inside_a_vmap_is_an_error():
  def f(x):
    return tfspmd.vmap(lambda row: lax.psum(row, "i"))(x)

  with pytest.raises(RuntimeError, match="Call the collective outside the vmap"):
    within(30, tfspmd.pmap(f, "i", debug=True), np.zeros((4, 3)))


def test_steps_are_not_run_in_debug_mode():
  f = tfspmd.pmap(lambda c, x: (c + x, c), steps=2, debug=True)
  with pytest.raises(ValueError, match="does not run steps=2"):
    f(np.zeros(2), np.ones((2, 2)))
