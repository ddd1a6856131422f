"""tfspmd.jit: JAX's jit around shard_map, against NumPy and shard_map.

A training step that builds its shard_map on every call, as JAX code under
`jax.jit` does, traced once; arguments placed as their shardings say; the
results left on the devices for the next call.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd import NamedSharding
from tfspmd import P
from tfspmd._src.core import tf_internal


@pytest.fixture(name="mesh")
def fixture_mesh():
  return tfspmd.make_mesh((4, 2), ("data", "model"))


def per_device_step(state, x):
  w = state["w"]
  with tf.GradientTape() as tape:
    tape.watch(w)
    loss = tf.reduce_mean((x @ w) ** 2)
  grad = lax.pmean(tape.gradient(loss, w), "data")
  return ({"w": w - 0.1 * grad, "count": state["count"] + 1},
          lax.pmean(loss, "data"))


def numpy_steps(w, x, steps):
  """The same steps in float64: 4 blocks of rows, gradients averaged."""
  w, losses = w.astype(np.float64), []
  blocks = x.astype(np.float64).reshape(4, -1, x.shape[1])
  for _ in range(steps):
    y = blocks @ w
    losses.append(np.mean([np.mean(b ** 2) for b in y]))
    grads = [2 * b.T @ yb / yb.size for b, yb in zip(blocks, y)]
    w = w - 0.1 * np.mean(grads, axis=0)
  return losses, w


def test_a_step_building_its_shard_map_each_call_compiles_once(mesh):
  traces = []

  @tfspmd.jit
  def step(state, x):
    traces.append(1)
    return tfspmd.shard_map(per_device_step, mesh=mesh,
                            in_specs=(P(), P("data")),
                            out_specs=(P(), P()))(state, x)

  rng = np.random.default_rng(0)
  w = rng.standard_normal((4, 3)).astype(np.float32)
  data = rng.standard_normal((16, 4)).astype(np.float32)
  x = tfspmd.device_put(data, NamedSharding(mesh, P("data")))
  state, losses = {"w": w, "count": np.int32(0)}, []
  for number in range(10):
    if number == 1:
      before = tf_internal.dtensor_lowerings_and_kernels()
    state, loss = step(state, x)
    losses.append(float(loss))
  made = np.subtract(tf_internal.dtensor_lowerings_and_kernels(), before)
  expected_losses, expected_w = numpy_steps(w, data, 10)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(state["w"]), expected_w, rtol=1e-5)
  assert int(state["count"]) == 10
  assert isinstance(state["w"], tfspmd.ShardedArray)
  assert state["w"].sharding == NamedSharding(mesh, P())
  assert len(traces) == 1 and tuple(made) == (0, 0)


def test_arguments_go_where_their_shardings_say(mesh):
  x = np.arange(16.).reshape(8, 2)
  double = tfspmd.jit(lambda v: v * 2,
                      in_shardings=NamedSharding(mesh, P("data")))
  out = double(x)
  np.testing.assert_array_equal(np.asarray(out), x * 2)
  assert out.sharding == NamedSharding(mesh, P("data"))
  again = tfspmd.jit(lambda v: v + 1,
                     out_shardings=NamedSharding(mesh, P()))(out)
  np.testing.assert_array_equal(np.asarray(again), x * 2 + 1)
  assert again.sharding == NamedSharding(mesh, P())


def test_host_arguments_take_the_context_mesh_or_every_device(mesh):
  add = tfspmd.jit(lambda a, b: a + b)
  out = add(np.ones(24, np.float32), np.full(24, 2.0, np.float32))
  np.testing.assert_array_equal(np.asarray(out), np.full(24, 3.0))
  assert out.sharding.mesh.shape == {"i": 8}
  with mesh:
    assert add(np.ones(24, np.float32),
               np.ones(24, np.float32)).sharding.mesh == mesh



def test_plain_tensors_beside_a_sharded_array_go_onto_its_devices(mesh):
  # A plain tf.function refuses this mix when it runs (DTensor expects
  # every argument on the mesh); jit sees every argument and places them.
  x = np.arange(24, dtype=np.float32).reshape(8, 3)
  split = tfspmd.device_put(x, NamedSharding(mesh, P("data")))
  add = tfspmd.jit(lambda a, b, c: a * b + c)
  out = add(split, tf.fill((8, 3), 2.0), np.ones((8, 3), np.float32))
  np.testing.assert_array_equal(np.asarray(out), x * 2.0 + 1.0)
  assert out.sharding.mesh == mesh

def test_static_arguments_are_traced_once_per_value():
  traces = []

  def scale(x, factor):
    traces.append(factor)
    return x * factor

  scaled = tfspmd.jit(scale, static_argnums=1)
  x = np.arange(24, dtype=np.float32)
  for factor in (2, 3, 2, 3):
    np.testing.assert_array_equal(np.asarray(scaled(x, factor)), x * factor)
  assert traces == [2, 3]


def test_static_values_equal_across_types_trace_apart_as_in_jax():
  # 1, 1.0 and True are equal and hash alike (so do (1,) and (1.0,)); JAX
  # traces each anew, positional or by keyword.
  traces = []

  def filled(x, value, kind=0):
    traces.append((value, kind))
    value = value[0] if isinstance(value, tuple) else value
    return tf.fill(tf.shape(x), value), tf.fill(tf.shape(x), kind)

  x = np.zeros(8, np.float32)
  jitted = tfspmd.jit(filled, static_argnums=1, static_argnames="kind")
  for value, dtype in ((1, np.int32), (1.0, np.float32), (True, np.bool_),
                       ((1,), np.int32), ((1.0,), np.float32)):
    out, _ = jitted(x, value)
    assert np.asarray(out).dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), np.ones(8, dtype))
  for kind, dtype in ((1, np.int32), (1.0, np.float32), (True, np.bool_)):
    _, out = jitted(x, 2, kind=kind)
    assert np.asarray(out).dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), np.ones(8, dtype))
  assert len(traces) == 8


def test_static_argnames_and_argnums_complete_each_other_as_in_jax():
  traces = []

  def scale(x, factor, mode="times"):
    traces.append((factor, mode))
    return x * factor if mode == "times" else x + factor

  x = np.arange(24, dtype=np.float32)
  by_name = tfspmd.jit(scale, static_argnames=("factor", "mode"))
  # A static name passed by keyword or by position is one trace per value.
  for args, kwargs, expected in [
      ((x,), {"factor": 2}, x * 2), ((x, 2), {}, x * 2),
      ((x, 2, "plus"), {}, x + 2), ((x,), {"factor": 2, "mode": "plus"},
                                    x + 2)]:
    np.testing.assert_array_equal(np.asarray(by_name(*args, **kwargs)),
                                  expected)
  assert sorted(set(traces)) == [(2, "plus"), (2, "times")]
  traces.clear()
  by_position = tfspmd.jit(scale, static_argnums=(1, 2))
  np.testing.assert_array_equal(
      np.asarray(by_position(x, factor=3, mode="plus")), x + 3)
  np.testing.assert_array_equal(np.asarray(by_position(x, 3, "plus")), x + 3)
  np.testing.assert_array_equal(np.asarray(by_position(x, 3)), x * 3)
  assert sorted(set(traces)) == [(3, "plus"), (3, "times")]


def test_donated_arrays_are_freed(mesh):
  x = tfspmd.device_put(np.ones(8, np.float32), NamedSharding(mesh, P()))
  out = tfspmd.jit(lambda v: v + 1, donate_argnums=0)(x)
  np.testing.assert_array_equal(np.asarray(out), 2.0)
  assert x.is_deleted()


@pytest.mark.parametrize("call, error, words", [
    (lambda mesh: tfspmd.jit(lambda x, n: x, static_argnums=1)(
        np.ones(8), [1]), TypeError,
     "the static argument args[1] must be hashable, as it keys the traces; "
     "got a list"),
    (lambda mesh: tfspmd.jit(lambda x, n: x, static_argnames="n")(
        np.ones(8), n={}), TypeError,
     "the static argument kwargs['n'] must be hashable"),
    (lambda mesh: tfspmd.jit(lambda x: x, static_argnames=3), TypeError,
     "`static_argnames` must be a str or a sequence of strs, got 3"),
    (lambda mesh: tfspmd.jit(lambda x: x, in_shardings=P("data"))(
        np.ones(8)), TypeError, "`in_shardings` holds PartitionSpec"),
    (lambda mesh: tfspmd.jit(lambda a, b: a + b, in_shardings=(
        NamedSharding(mesh, P()), NamedSharding(tfspmd.make_mesh(
            (8,), ("i",)), P())))(np.ones(8), np.ones(8)), ValueError,
     "one function runs on one mesh"),
    (lambda mesh: tfspmd.jit(lambda x: x, static_argnums=3)(np.ones(8)),
     ValueError, "`static_argnums` holds 3, but the function was called "
     "with 1 positional arguments"),
    (lambda mesh: tfspmd.jit(3), TypeError, "`fun` must be callable"),
])
def test_bad_arguments_name_what_was_expected(mesh, call, error, words):
  with pytest.raises(error) as raised:
    call(mesh)
  assert words in str(raised.value)


def test_small_results_split_or_constant_come_back_whole(mesh):
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  placed = tfspmd.device_put(x, NamedSharding(mesh, P("data")))
  same, three, head = tfspmd.jit(lambda v: (v, 3.0, v[:1]))(placed)
  np.testing.assert_array_equal(np.asarray(same), x)
  np.testing.assert_array_equal(np.asarray(three), 3.0)
  np.testing.assert_array_equal(np.asarray(head), x[:1])
  # Held whole on each device (a small array goes in and out padded).
  assert same.sharding == NamedSharding(mesh, P())
  ones = tfspmd.jit(lambda: tf.ones(3))()
  np.testing.assert_array_equal(np.asarray(ones), np.ones(3))


def test_pmaps_inside_jit_run_over_the_functions_mesh(mesh):
  x = np.arange(16, dtype=np.float32).reshape(8, 2)

  @tfspmd.jit
  def doubled_total(v):
    return tfspmd.pmap(lambda row: lax.psum(row, "i") * 2, "i")(v)

  for given in (x, tfspmd.device_put(x, NamedSharding(mesh, P("data")))):
    np.testing.assert_array_equal(np.asarray(doubled_total(given)),
                                  np.broadcast_to(x.sum(0) * 2, x.shape))

  @tfspmd.jit
  def then_mean(v):
    y = tfspmd.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P("data"),
                         out_specs=P("data"))(v)
    return tfspmd.pmap(lambda row: lax.pmean(row, "i"), "i")(y)

  np.testing.assert_allclose(np.asarray(then_mean(x)),
                             np.broadcast_to(x.mean(0) * 2, x.shape))
  grid = tfspmd.make_mesh((2, 4), ("a", "b"))
  blocks = np.arange(24, dtype=np.float32).reshape(2, 4, 3)

  @tfspmd.jit
  def nested(v):
    return tfspmd.pmap(tfspmd.pmap(
        lambda b: lax.psum(b, "b") + tf.cast(lax.axis_index("a"), tf.float32),
        "b"), "a")(v)

  with grid:
    out = nested(blocks)
  assert out.sharding.mesh == grid
  np.testing.assert_array_equal(
      np.asarray(out), np.broadcast_to(
          blocks.sum(1, keepdims=True) + np.arange(2.)[:, None, None],
          blocks.shape))


def test_a_sharding_constraint_lays_a_value_out_inside_jit(mesh):
  x = np.arange(32, dtype=np.float32).reshape(8, 4)

  @tfspmd.jit
  def f(v):
    h = lax.with_sharding_constraint(v * 2., P("model", "data"))
    return lax.with_sharding_constraint(h + 1., NamedSharding(mesh, P()))

  @tfspmd.jit
  def g(v):
    return {"h": lax.with_sharding_constraint(v * 2., P(None, "model"))}

  with tfspmd.set_mesh(mesh):
    out = f(x)
    split = g(x)["h"]
  np.testing.assert_array_equal(out, x * 2 + 1)
  assert out.sharding == NamedSharding(mesh, P())
  np.testing.assert_array_equal(split, x * 2)
  assert split.sharding == NamedSharding(mesh, P(None, "model"))
  # Outside jit it is device_put.
  placed = lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
  assert placed.sharding == NamedSharding(mesh, P("data"))
  np.testing.assert_array_equal(placed, x)


def test_a_sharding_constraint_refuses_what_it_cannot_lay_out(mesh):
  x = np.ones((8, 4), np.float32)
  other = tfspmd.make_mesh((8,), ("i",))
  for sharding, error, words in [
      (NamedSharding(other, P("i")), ValueError, "jitted function runs on"),
      (P(("data", "model")), ValueError, "over several mesh axes"),
      ("data", TypeError, "must be a NamedSharding or a PartitionSpec")]:
    with tfspmd.set_mesh(mesh), pytest.raises(error, match=words):
      tfspmd.jit(lambda v, s=sharding: lax.with_sharding_constraint(v, s))(x)
  with pytest.raises(ValueError, match="inside a pmap or shard_map"):
    tfspmd.pmap(lambda v: lax.with_sharding_constraint(v, P()))(x)
  with pytest.raises(TypeError, match="which needs a mesh: set one first"):
    lax.with_sharding_constraint(x, P("data"))


def test_a_sharding_constraint_outside_jit_or_in_a_mapped_function_is_refused(
    mesh):
  x = np.ones((8, 4), np.float32)
  with tfspmd.set_mesh(mesh):
    with pytest.raises(ValueError, match="not a tfspmd.jit function"):
      tf.function(lambda v: lax.with_sharding_constraint(v, P("data")))(x)
    with pytest.raises(ValueError, match="inside a pmap or shard_map"):
      tfspmd.pmap(lambda v: lax.with_sharding_constraint(v, P()),
                  debug=True)(x)


def test_a_jit_called_while_tracing_is_inlined_as_in_jax(mesh):
  # Inside another jit, a shard_map's function or a user's tf.function, a
  # jitted function is called as the plain function, as JAX inlines it.
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  scale = tfspmd.jit(lambda v, k: v * k + 1., static_argnums=1)

  @tfspmd.jit
  def outer(v):
    row_sums = tfspmd.shard_map(
        lambda b: scale(lax.psum(b, "data"), 2.), mesh=mesh,
        in_specs=P("data"), out_specs=P())(v)
    return scale(v, 3.), row_sums

  tripled, sums = outer(x)
  np.testing.assert_array_equal(tripled, x * 3 + 1)
  block_sum = x.reshape(4, 2, 2).sum(0)
  np.testing.assert_array_equal(sums, block_sum * 2 + 1)
  np.testing.assert_array_equal(
      tf.function(lambda v: scale(v, 4.))(tf.constant(x)), x * 4 + 1)
  np.testing.assert_array_equal(
      tfspmd.jit(lambda v: tfspmd.jit(lambda w: w - 1.)(v) * 2)(x),
      (x - 1) * 2)
  # An inner jit's shardings are constraints on its arguments and result.
  split = tfspmd.jit(lambda v: tfspmd.jit(
      lambda w: w + 1., out_shardings=NamedSharding(mesh, P("model")))(v))
  with tfspmd.set_mesh(mesh):
    out = split(np.ones((8, 4), np.float32))
  np.testing.assert_array_equal(out, np.full((8, 4), 2.))
  assert out.sharding == NamedSharding(mesh, P("model"))


def test_device_put_inside_jit_is_a_sharding_constraint(mesh):
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  by_model = tfspmd.jit(lambda v: tfspmd.device_put(
      v * 2., NamedSharding(mesh, P("model"))))(
          tfspmd.device_put(x, NamedSharding(mesh, P("data"))))
  np.testing.assert_array_equal(by_model, x * 2)
  assert by_model.sharding == NamedSharding(mesh, P("model"))
  # A bare spec is over the function's mesh; None leaves the value as is.
  with tfspmd.set_mesh(mesh):
    tree = tfspmd.jit(lambda v: tfspmd.device_put(
        {"a": v + 1., "b": v}, {"a": P(None, "model"), "b": None}))(x)
  np.testing.assert_array_equal(tree["a"], x + 1)
  np.testing.assert_array_equal(tree["b"], x)
  assert tree["a"].sharding == NamedSharding(mesh, P(None, "model"))


def test_a_gradient_tape_around_a_jit_call_differentiates_it(mesh):
  # loss = k * sum(sin(w) * x): d/dw = k cos(w) x, d/dx = k sin(w); the
  # ShardedArray `b` lies on the devices, a constant to the tape.
  @functools.partial(tfspmd.jit, static_argnums=3)
  def loss(w, x, b, k):
    per_row = tfspmd.shard_map(
        lambda wb, xb: lax.psum(tf.reduce_sum(tf.sin(wb) * xb, 0), "data"),
        mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())(w, x)
    return k * tf.reduce_sum(per_row) + tf.reduce_sum(b)

  rng = np.random.default_rng(1)
  w0 = rng.standard_normal((8, 3)).astype(np.float32)
  x0 = rng.standard_normal((8, 3)).astype(np.float32)
  b = tfspmd.device_put(np.ones((8, 3), np.float32),
                        NamedSharding(mesh, P("data")))
  w = tf.Variable(w0)
  for k in (2.0, 2.0, 3.0):
    x = tf.constant(x0 * k)
    with tf.GradientTape() as tape:
      tape.watch(x)
      value = loss(w, x, b, k)
    grad_w, grad_x = tape.gradient(value, [w, x])
    np.testing.assert_allclose(float(value),
                               k * np.sum(np.sin(w0) * x0 * k) + 24.,
                               rtol=1e-5)
    np.testing.assert_allclose(grad_w, k * np.cos(w0) * x0 * k, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(grad_x, k * np.sin(w0), rtol=1e-5, atol=1e-6)


def test_results_keep_the_shardings_jax_jit_gives_them():
  # Each spec is what jax.jit gives (JAX 0.10.2, 8 CPU devices): a
  # shard_map's out_specs, a sharding constraint, and an input's sharding
  # through elementwise ops.
  line = tfspmd.make_mesh((8,), ("i",))
  grid = tfspmd.make_mesh((2, 4), ("dp", "tp"))
  x = np.arange(64, dtype=np.float32).reshape(16, 4)
  split = tfspmd.device_put(x, NamedSharding(line, P("i")))

  def doubled(mesh, in_specs, out_specs):
    return tfspmd.jit(lambda v: tfspmd.shard_map(
        lambda b: b * 2, mesh=mesh, in_specs=in_specs,
        out_specs=out_specs)(v))

  cases = [
      (doubled(line, P("i"), P("i")), x, x * 2, line, P("i")),
      (doubled(line, P("i"), P("i")), split, x * 2, line, P("i")),
      (tfspmd.jit(lambda v: doubled(line, P("i"), P("i"))(v) + 1), x,
       x * 2 + 1, line, P("i")),
      (doubled(line, P(None, "i"), P(None, "i")), np.tile(x, (1, 2)),
       np.tile(x, (1, 2)) * 2, line, P(None, "i")),
      (doubled(grid, P("dp", "tp"), P("dp", "tp")), x, x * 2, grid,
       P("dp", "tp")),
      (doubled(grid, P(("dp", "tp")), P(("dp", "tp"))), x, x * 2, grid,
       P(("dp", "tp"))),
      (tfspmd.jit(lambda v: tfspmd.shard_map(
          lambda b: lax.psum(b, "i"), mesh=line, in_specs=P("i"),
          out_specs=P())(v)), x, x.reshape(8, 2, 4).sum(0), line, P()),
      (tfspmd.jit(lambda v: lax.with_sharding_constraint(
          v * 2, NamedSharding(line, P("i")))), x, x * 2, line, P("i")),
      (tfspmd.jit(lambda v: v * 2 + 1), split, x * 2 + 1, line, P("i")),
  ]
  for k, (function, argument, expected, mesh, spec) in enumerate(cases):
    out = function(argument)
    np.testing.assert_array_equal(np.asarray(out), expected, err_msg=str(k))
    assert out.sharding == NamedSharding(mesh, spec), (k, out.sharding)
