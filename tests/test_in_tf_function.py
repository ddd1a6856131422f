"""A pmapped function called from inside the user's own tf.function.

The pmap's program goes into the user's graph with no DTensor op of its
own, so the same function runs on plain tensors (on one device) and on
DTensors (on their devices, split as they are), and saves as a SavedModel
that TensorFlow alone loads and serves.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfspmd
from tfspmd import lax



@pytest.mark.parametrize("placed", [True, False], ids=["dtensors", "tensors"])
def test_a_pmap_with_its_own_loop_inside_a_tf_range_loop(placed):
  # The pmap's loop is nested in the user's; over DTensors, DTensor lowers
  # the whole function at once.
  def damped(x, passes):
    def body(k, v):
      return k + 1, v + lax.psum(v, "i") * 0.25
    return tf.while_loop(lambda k, v: k < passes, body, (0, x))[1]

  pdamped = tfspmd.pmap(damped, "i", in_axes=(0, None))

  @tf.function
  def outer(x, passes):
    for _ in tf.range(3):
      x = pdamped(x, passes) / 4.0
    return x

  x = np.arange(24, dtype=np.float32).reshape(8, 3) / 8
  given = tfspmd.pmap(lambda v: v)(x).dtensor_value if placed else x
  got = outer(given, tf.constant(2))
  expected = x.astype(np.float64)
  for _ in range(3):
    for _ in range(2):
      expected = expected + expected.sum(0) * 0.25
    expected = expected / 4.0
  if placed:
    got = np.concatenate([block.numpy() for block in dtensor.unpack(got)])
  np.testing.assert_allclose(got, expected, rtol=1e-5)

def test_training_loop_with_tf_range_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 16, 3)).astype(np.float32)
  y = x @ np.array([1., -2., .5], np.float32)

  def step(w, xb, yb):
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss = tf.reduce_mean((tf.linalg.matvec(xb, w) - yb) ** 2)
    return w - 0.1 * lax.pmean(tape.gradient(loss, w), "i"), lax.pmean(loss, "i")

  pstep = tfspmd.pmap(step, "i", in_axes=(None, 0, 0), out_axes=None)

  @tf.function
  def train(w, xb, yb):
    loss = tf.constant(0.)
    for _ in tf.range(20):
      w, loss = pstep(w, xb, yb)
    return w, loss

  w0, loss0 = pstep(np.zeros(3, np.float32), x, y)  # places everything once
  placed_x = tfspmd.pmap(lambda v: v)(x)
  placed_y = tfspmd.pmap(lambda v: v)(y)
  w, loss = train(w0.dtensor_value, placed_x.dtensor_value, placed_y.dtensor_value)

  expected = np.zeros(3)
  xs, ys = x.reshape(-1, 3).astype(np.float64), y.reshape(-1)
  for _ in range(21):
    loss_expected = np.mean((xs @ expected - ys) ** 2)
    expected = expected - 0.1 * 2 * xs.T @ (xs @ expected - ys) / len(ys)
  np.testing.assert_allclose(w.numpy(), expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(loss.numpy(), loss_expected, rtol=1e-4)
  assert float(loss0) > float(loss)


def test_sharded_results_of_a_users_function_go_back_into_pmap():
  double = tfspmd.pmap(lambda v: v * 2.)
  placed = tfspmd.pmap(lambda v: v + 0.)(np.arange(8, dtype=np.float32))
  twice = tf.function(lambda v: double(double(v)))(placed.dtensor_value)
  np.testing.assert_array_equal(double(twice), np.arange(8) * 8.)


def test_an_open_mapped_axis_is_a_clear_error():
  f = tfspmd.pmap(lambda v: v)
  g = tf.function(lambda v: f(v),
                  input_signature=[tf.TensorSpec([None], tf.float32)])
  with pytest.raises(ValueError, match="whose size is open"):
    g.get_concrete_function()


def test_reduce_retracing_opening_the_mapped_axis_names_the_pmap_and_the_fix():
  # A tf.function with reduce_retracing=True called with another mapped
  # size traces again with that size open (None).
  def total(v):
    return lax.psum(v, "i")

  summed = tfspmd.pmap(total, axis_name="i")

  @tf.function(reduce_retracing=True, autograph=False)
  def step(x):
    return summed(x)

  np.testing.assert_array_equal(step(np.ones((8, 2), np.float32)),
                                np.full((8, 2), 8.0))
  with pytest.raises(ValueError) as raised:
    step(np.ones((4, 2), np.float32))
  assert str(raised.value) == (
      "pmap of test_reduce_retracing_opening_the_mapped_axis_names_the_pmap_"
      "and_the_fix.<locals>.total inside a tf.function maps axis 0 of "
      "args[0], of shape (None, 2), whose size is open (None): it is the "
      "number of devices, which the program needs when it traces. The "
      "tf.function leaves it open where its input_signature does, or where "
      "reduce_retracing=True opened a size that changed between calls. "
      "Give the size: an input_signature of tf.TensorSpec([8, 2], "
      "tf.float32) for this argument (the other sizes may stay None), or no "
      "reduce_retracing=True, so that each size traces its own program.")


def test_a_sharded_array_given_to_a_users_function_stays_on_the_devices(dtensor_executor):
  del dtensor_executor  # unused: DTensor's route
  double = tfspmd.pmap(lambda v: v * 2.)
  out = tfspmd.pmap(lambda v: v + 0.)(np.arange(8, dtype=np.float32))
  traces = []

  @tf.function
  def twice(v):
    traces.append(v.shape)
    return double(double(v))

  result = twice(out)
  assert dtensor.is_dtensor(result)
  # Whole on every device of the array's mesh, so TensorFlow can read it.
  assert len(dtensor.unpack(result)) == 8
  np.testing.assert_array_equal(dtensor.unpack(result)[3], np.arange(8) * 4.)
  np.testing.assert_array_equal(result.numpy(), np.arange(8) * 4.)
  np.testing.assert_array_equal(double(result), np.arange(8) * 8.)
  twice(out)
  assert traces == [tf.TensorShape([8])]


def test_pmaps_over_two_device_counts_in_one_function():
  double = tfspmd.pmap(lambda v: v * 2.)
  eight = tfspmd.pmap(lambda v: v + 0.)(np.arange(8, dtype=np.float32))
  four = tfspmd.pmap(lambda v: v + 0.)(np.arange(4, dtype=np.float32))
  first, second = tf.function(lambda a, b: (double(a), double(b)))(eight, four)
  np.testing.assert_array_equal(double(first), np.arange(8) * 4.)
  np.testing.assert_array_equal(double(second), np.arange(4) * 4.)


def test_in_axes_1_on_dtensors_split_along_either_axis():
  x = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)
  centred = tfspmd.pmap(lambda v: v - lax.pmean(v, "i"), "i", in_axes=1)
  along_1 = tfspmd.pmap(lambda v: v, in_axes=1, out_axes=1)(x)
  along_0 = tfspmd.pmap(lambda v: v)(np.ascontiguousarray(x.transpose(1, 0, 2)))
  along_0_t = tf.function(lambda v: tf.transpose(v, [1, 0, 2]))(
      along_0.dtensor_value)
  expected = np.moveaxis(x - x.mean(1, keepdims=True), 1, 0)
  for placed in (along_1.dtensor_value, along_0_t):
    out = tf.function(centred)(placed)
    np.testing.assert_allclose(tfspmd.pmap(lambda v: v)(out), expected,
                               rtol=1e-6, atol=1e-5)


def _mean_free(v):
  return v - lax.pmean(v, "i")


def test_plain_tensors_go_through_a_pmap_inside_a_tf_function():
  x = np.arange(24, dtype=np.float32).reshape(8, 3) ** 1.5
  collectives = tfspmd.pmap(
      lambda v: (_mean_free(v), lax.psum(v, "i"), lax.pmax(v, "i"),
                 lax.all_gather(v, "i"),
                 lax.ppermute(v, "i", [(j, (j + 1) % 8) for j in range(8)]),
                 v * tf.cast(lax.axis_index("i"), tf.float32)), "i")
  serve = tf.function(collectives)
  centred, summed, largest, gathered, shifted, scaled = serve(tf.constant(x))
  assert not dtensor.is_dtensor(centred)
  np.testing.assert_allclose(centred.numpy(), x - x.mean(0), rtol=1e-5)
  np.testing.assert_allclose(summed.numpy(), np.tile(x.sum(0), (8, 1)),
                             rtol=1e-6)
  np.testing.assert_array_equal(largest.numpy(), np.tile(x.max(0), (8, 1)))
  np.testing.assert_array_equal(gathered.numpy(), np.tile(x, (8, 1, 1)))
  np.testing.assert_array_equal(shifted.numpy(), np.roll(x, 1, axis=0))
  np.testing.assert_array_equal(scaled.numpy(),
                                x * np.arange(8, dtype=np.float32)[:, None])


def test_plain_tensors_go_through_an_all_to_all_and_a_nested_pmap():
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  swap = tfspmd.pmap(lambda v: lax.all_to_all(v, "i", 0, 0), "i")
  np.testing.assert_array_equal(tf.function(swap)(tf.constant(x)).numpy(),
                                x.T)
  nested = tfspmd.pmap(tfspmd.pmap(lambda v: lax.psum(v, "j") - v, "j"), "i")
  y = x.reshape(2, 4, 8)
  np.testing.assert_array_equal(
      tf.function(nested)(tf.constant(y)).numpy(), y.sum(1, keepdims=True) - y)


def test_a_shard_map_inside_a_tf_function_takes_plain_tensors():
  mesh = tfspmd.make_mesh((2, 4), ("rows", "cols"))
  P = tfspmd.PartitionSpec
  total = tfspmd.shard_map(lambda b: lax.psum(b, "cols"), mesh=mesh,
                           in_specs=P("rows", "cols"), out_specs=P("rows"))
  x = np.arange(32, dtype=np.float32).reshape(4, 8)
  got = tf.function(total)(tf.constant(x)).numpy()
  expected = np.concatenate(
      [x[r * 2:(r + 1) * 2].reshape(2, 4, 2).sum(1) for r in range(2)])
  np.testing.assert_array_equal(got, expected)


def test_a_gradient_through_a_pmap_inside_a_tf_function_on_plain_tensors():
  x = np.linspace(-1., 1., 24, dtype=np.float32).reshape(8, 3)
  loss = tfspmd.pmap(lambda w, v: lax.psum(tf.reduce_sum((v * w) ** 2), "i"),
                     "i", in_axes=(None, 0), out_axes=None)

  @tf.function
  def gradient(w, v):
    with tf.GradientTape() as tape:
      tape.watch(w)
      value = loss(w, v)
    return value, tape.gradient(value, w)

  w = np.array([.5, -1., 2.], np.float32)
  value, grad = gradient(tf.constant(w), tf.constant(x))
  np.testing.assert_allclose(value.numpy(), np.sum((x * w) ** 2), rtol=1e-5)
  np.testing.assert_allclose(grad.numpy(), 2 * w * np.sum(x ** 2, 0),
                             rtol=1e-5)


@pytest.mark.parametrize("mesh_shape,names,spec", [
    ((8,), ("x",), ["x", dtensor.UNSHARDED]),
    ((2, 4), ("a", "b"), ["a", dtensor.UNSHARDED]),
    ((8,), ("x",), [dtensor.UNSHARDED, dtensor.UNSHARDED]),
    ((4,), ("x",), ["x", dtensor.UNSHARDED]),
])
def test_a_dtensor_on_the_users_own_mesh_stays_on_it(mesh_shape, names, spec):
  count = int(np.prod(mesh_shape))
  mesh = dtensor.create_mesh(list(zip(names, mesh_shape)),
                             devices=[f"CPU:{i}" for i in range(count)])
  layout = dtensor.Layout(spec, mesh)
  x = np.arange(16, dtype=np.float32).reshape(8, 2) ** 2
  value = dtensor.pack([tf.constant(x)] * count, dtensor.Layout.replicated(
      mesh, 2))
  value = dtensor.relayout(value, layout)
  centred = tf.function(tfspmd.pmap(_mean_free, "i"))(value)
  assert dtensor.fetch_layout(centred).mesh == mesh
  whole = dtensor.relayout(centred, dtensor.Layout.replicated(mesh, 2))
  np.testing.assert_allclose(whole.numpy(), x - x.mean(0), rtol=1e-5)


def test_a_pmap_result_goes_through_a_keras_model_in_a_tf_function():
  keras = pytest.importorskip("keras")
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  kernel, bias = (w.numpy() for w in model.weights)
  x = np.arange(24, dtype=np.float32).reshape(8, 3) / 10.
  doubled = tfspmd.pmap(lambda v: v * 2.)(x)
  predictions = tf.function(lambda v: model(v))(doubled)
  np.testing.assert_allclose(predictions.numpy(), (2 * x) @ kernel + bias,
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(predictions), (2 * x) @ kernel + bias,
                             rtol=1e-5)
  metric = tf.function(lambda v: tf.reduce_mean(tf.square(v)))(doubled)
  np.testing.assert_allclose(metric.numpy(), np.mean((2 * x) ** 2), rtol=1e-6)


def test_a_tf_function_of_sharded_arrays_traces_once_per_mesh(dtensor_executor):
  del dtensor_executor  # unused: DTensor's route
  # Arrays of 20 elements or more: DTensor folds smaller ones as constants,
  # which lie on no mesh (test_pmaps_over_two_device_counts_in_one_function).
  first_four = tfspmd.devices()[:4]
  on_four = [tfspmd.pmap(lambda x, k=k: x * k, devices=first_four)(
      np.ones((4, 8), np.float32)) for k in (2., 3.)]
  on_eight = [tfspmd.pmap(lambda x, k=k: x * k)(np.ones((8, 8), np.float32))
              for k in (5., 7.)]
  total = tf.function(lambda a, b: tf.reduce_sum(a) + tf.reduce_sum(b))
  assert total(*on_four).numpy() == 32 * 2. + 32 * 3.
  assert total(*on_eight).numpy() == 64 * 5. + 64 * 7.
  with pytest.raises(ValueError, match="ShardedArrays on different meshes"):
    total(on_four[0], on_eight[0])
  moved = tfspmd.device_put(on_eight[0], on_four[0].sharding)
  assert total(on_four[0], moved).numpy() == 32 * 2. + 64 * 5.


def test_plain_values_beside_a_sharded_array_arrive_whole_on_its_devices(dtensor_executor):
  del dtensor_executor  # unused: DTensor's route
  x = np.arange(48, dtype=np.float32).reshape(8, 6)
  doubled = tfspmd.pmap(lambda v: v * 2.)(x)
  traces = []

  @tf.function
  def combine(a, extra):
    traces.append(1)
    plain, array = extra["pair"]
    return a + plain * array

  plain = tf.fill([8, 6], 3.)
  array = np.linspace(0., 1., 48, dtype=np.float32).reshape(8, 6)
  result = combine(doubled, {"pair": (plain, array)})
  # Every device holds the result whole, so TensorFlow reads it.
  assert len(dtensor.unpack(result)) == 8
  np.testing.assert_allclose(result.numpy(), 2. * x + 3. * array, rtol=1e-6)
  # The array's DTensor, split over the devices, keeps its split, with
  # the same trace.
  split = combine(doubled.dtensor_value, {"pair": (plain, array)})
  assert len(dtensor.unpack(split)) == 8
  np.testing.assert_allclose(dtensor.unpack(split)[5].numpy(),
                             (2. * x + 3. * array)[5:6], rtol=1e-6)
  assert len(traces) == 1


def test_a_plain_tensor_beside_a_dtensor_goes_into_a_pmap_inside():
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  scaled_sum = tfspmd.pmap(lambda v, w: lax.psum(v * w, "i"), "i",
                           in_axes=(0, None))
  placed = tfspmd.pmap(lambda v: v + 0.)(x).dtensor_value
  run = tf.function(scaled_sum)
  for w in ([1., 2., 3., 4.], [0.5, -1., 2., 0.]):
    got = run(placed, tf.constant(w))
    np.testing.assert_allclose(
        np.stack([u.numpy()[0] for u in dtensor.unpack(got)]),
        np.tile((x * np.array(w, np.float32)).sum(0), (8, 1)), rtol=1e-6)


def test_a_small_sharded_array_beside_a_large_plain_tensor():
  # An array of under 20 elements DTensor folds as a constant of the
  # function: the plain tensor goes on the mesh of the array it came from.
  small = tfspmd.pmap(lambda v: v * 10.)(np.arange(8, dtype=np.float32))
  large = tf.reshape(tf.range(64, dtype=tf.float32), [8, 8])
  got = tf.function(lambda s, m: m * s[:, None])(small, large)
  np.testing.assert_array_equal(
      got.numpy(), np.arange(64.).reshape(8, 8) * 10. * np.arange(8.)[:, None])


def test_dtensors_on_two_meshes_name_their_arguments(dtensor_executor):
  del dtensor_executor  # unused: DTensor's route
  on_four = tfspmd.pmap(lambda v: v + 1., devices=tfspmd.devices()[:4])(
      np.zeros((4, 8), np.float32))
  on_eight = tfspmd.pmap(lambda v: v + 1.)(np.zeros((8, 4), np.float32))
  total = tf.function(lambda a, b: tf.reduce_sum(a) + tf.reduce_sum(b))
  message = (r"DTensors on different meshes: argument `a`, on a mesh "
             r"\(\w+=8\) of CPU:0, CPU:1, CPU:2, CPU:3, CPU:4, CPU:5, CPU:6, "
             r"CPU:7, and argument `b`, on a mesh \(\w+=4\) of CPU:0, CPU:1, "
             r"CPU:2, CPU:3\. DTensor runs a function on one mesh")
  with pytest.raises(ValueError, match=message):
    total(on_eight, on_four.dtensor_value)
  again = tf.function(lambda a, b: tf.reduce_sum(a) + tf.reduce_sum(b))
  with pytest.raises(ValueError, match=message):
    again(on_eight.dtensor_value, on_four)
  moved = tfspmd.device_put(on_four, tfspmd.NamedSharding(
      on_eight.sharding.mesh, tfspmd.PartitionSpec()))
  assert again(on_eight.dtensor_value, moved).numpy() == 64.
  # Their DTensors alone, in a function of TensorFlow's ops only.
  only_dtensors = tf.function(lambda a, b: tf.reduce_sum(a) + tf.reduce_sum(b))
  with pytest.raises(ValueError, match=message):
    only_dtensors(on_eight.dtensor_value, on_four.dtensor_value)


def test_a_plain_tensor_beside_a_dtensor_value_after_a_plain_trace(dtensor_executor):
  del dtensor_executor  # unused: DTensor's route
  # A function first traced for plain tensors is traced anew for an
  # array's DTensor, whose call then places the plain tensor beside it.
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  add = tf.function(lambda a, b: a + b)
  np.testing.assert_array_equal(add(tf.constant(x), tf.constant(x)).numpy(),
                                2 * x)
  placed = tfspmd.pmap(lambda v: v * 3.)(x).dtensor_value
  result = add(placed, tf.constant(x))
  np.testing.assert_array_equal(
      np.concatenate([c.numpy() for c in dtensor.unpack(result)]), 4 * x)
  assert add.experimental_get_tracing_count() == 2
  # The array itself, arriving whole on its devices, with no trip through
  # the host.
  whole = add(tfspmd.pmap(lambda v: v * 3.)(x), tf.constant(x))
  assert len(dtensor.unpack(whole)) == 8
  np.testing.assert_array_equal(dtensor.unpack(whole)[7].numpy(), 4 * x)
  assert add.experimental_get_tracing_count() == 3


def test_a_tape_outside_the_function_differentiates_reductions_on_dtensors():
  # DTensor cannot lay out the shape a reduction's gradient computes when
  # the reduced axes are not constants.
  rng = np.random.default_rng(3)
  x = rng.uniform(0.5, 2., (8, 3)).astype(np.float32)
  w = np.array([0.7, -1.3, 2.1], np.float32)

  def per_device(v, u):
    p = v * u
    return lax.psum(tf.reduce_mean(p) + tf.reduce_max(p, axis=-1) +
                    tf.reduce_sum(tf.square(p), axis=0, keepdims=True)[0],
                    "i")

  loss = tf.function(tfspmd.pmap(per_device, "i", in_axes=(0, None),
                                 out_axes=None))
  placed = tfspmd.pmap(lambda v: v + 0.)(x).dtensor_value
  weights = tf.constant(w)
  with tf.GradientTape() as tape:
    tape.watch(weights)
    value = loss(placed, weights)
  grad = tape.gradient(value, weights)
  p = x * w
  np.testing.assert_allclose(
      value.numpy(), (p.mean(1) + p.max(1) + (p ** 2).sum(1)).sum(),
      rtol=1e-5)
  largest = np.eye(3)[p.argmax(1)]
  np.testing.assert_allclose(
      grad.numpy(), (x / 3. + x * largest + 2. * x * p).sum(0), rtol=1e-5)


def test_a_training_step_takes_state_on_the_devices_and_batches_from_numpy(dtensor_executor):
  del dtensor_executor  # unused: DTensor's route
  # The state stays on the devices between steps; each step's batch comes
  # from the host, as a NumPy array, beside it.
  rng = np.random.default_rng(1)
  true_w = rng.standard_normal((5, 4)).astype(np.float32)

  def grads(w, xb, yb):
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss = tf.reduce_mean((xb @ w - yb) ** 2)
    return lax.pmean(tape.gradient(loss, w), "i"), lax.pmean(loss, "i")

  pgrads = tfspmd.pmap(grads, "i", in_axes=(None, 0, 0), out_axes=None)

  @tf.function
  def step(w, xb, yb):
    g, loss = pgrads(w, xb, yb)
    return w - 0.05 * g, loss

  w = tfspmd.device_put(np.zeros((5, 4), np.float32), tfspmd.NamedSharding(
      tfspmd.make_mesh((8,), ("i",)), tfspmd.PartitionSpec()))
  expected = np.zeros((5, 4))
  for _ in range(4):
    x = rng.standard_normal((8, 6, 5)).astype(np.float32)
    y = x @ true_w
    w, loss = step(w, x, y)
    xs, ys = x.reshape(-1, 5).astype(np.float64), y.reshape(-1, 4)
    loss_expected = np.mean((xs @ expected - ys) ** 2)
    expected = expected - 0.05 * 2 * xs.T @ (xs @ expected - ys) / ys.size
  assert dtensor.is_dtensor(w)
  np.testing.assert_allclose(w.numpy(), expected, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(loss.numpy(), loss_expected, rtol=1e-4)
  assert step.experimental_get_tracing_count() == 1


def test_arrays_the_function_closes_over_set_the_mesh_of_plain_arguments(dtensor_executor):
  del dtensor_executor  # unused: DTensor's route
  w = np.linspace(-1., 1., 32, dtype=np.float32).reshape(8, 4)
  params = tfspmd.pmap(lambda v: v + 0.)(w)
  scale = tfspmd.pmap(lambda p, x: p * x, in_axes=(0, None))

  @tf.function
  def apply(x):
    return scale(params, x)

  x = np.array([1., -2., 3., 0.5], np.float32)
  result = apply(tf.constant(x))
  np.testing.assert_allclose(
      np.concatenate([c.numpy() for c in dtensor.unpack(result)]), w * x,
      rtol=1e-6)
  # The array's trace type is made anew for each trace: capturing it does
  # not rename the argument of a later function given it.
  double = tf.function(lambda a: a * 2.)
  concrete = double.get_concrete_function(params.dtensor_value)
  assert concrete.inputs[0].name.startswith("a:")
  np.testing.assert_allclose(
      np.concatenate([c.numpy() for c in dtensor.unpack(
          double(params.dtensor_value))]), 2 * w, rtol=1e-6)
  # An argument on another mesh than the closed-over array is named.
  on_four = tfspmd.pmap(lambda v: v + 1., devices=tfspmd.devices()[:4])(
      np.zeros((4, 8), np.float32))
  shift = tf.function(lambda b: params.dtensor_value + tf.reduce_sum(b))
  with pytest.raises(ValueError, match=(
      r"a DTensor the function closes over, on a mesh \(\w+=8\) .*, and "
      r"argument `b`, on a mesh \(\w+=4\)")):
    shift(on_four)


def test_reduce_retracing_keeps_the_mesh_of_sharded_arrays():
  total = tf.function(tf.reduce_sum, reduce_retracing=True)
  for rows in (3, 5, 7):
    array = tfspmd.pmap(lambda v: v + 1.)(np.zeros((8, rows), np.float32))
    assert total(array).numpy() == 8. * rows
  # One trace for the first shape, one for every later one.
  assert total.experimental_get_tracing_count() == 2


# --- a user's tf.function given ShardedArrays: its state changes once --------


def test_variables_a_users_function_updates_change_once_per_call(
    host_executor):
  del host_executor  # unused
  import keras  # pylint: disable=g-import-not-at-top
  x = np.arange(24, dtype=np.float32).reshape(8, 3)
  array = tfspmd.pmap(lambda v: v * 2.)(x)
  counter = tf.Variable(0.)
  mean, reference = keras.metrics.Mean(), keras.metrics.Mean()

  @tf.function
  def count(a):
    counter.assign_add(1.)
    mean.update_state(a)
    return tf.reduce_sum(a)

  for calls in (1, 2):
    np.testing.assert_allclose(count(array), (2 * x).sum())
    reference.update_state(2 * x)
    assert counter.numpy() == calls
    np.testing.assert_allclose(mean.result(), reference.result())
    np.testing.assert_allclose(mean.count.numpy(), reference.count.numpy())


def test_a_keras_optimizer_in_a_users_function_trains_as_on_one_device(
    host_executor):
  del host_executor  # unused
  import keras  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  x = rng.standard_normal((64, 5)).astype(np.float32)
  y = (x @ rng.standard_normal((5, 1))).astype(np.float32)

  def trained(batches):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.1)

    @tf.function
    def step(xb, yb):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb) - yb))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    losses = [float(step(xb, yb)) for xb, yb in batches]
    return losses, [w.numpy() for w in model.weights]

  rows = tfspmd.sharding.NamedSharding(tfspmd.make_mesh((8,), ("d",)),
                                      tfspmd.P("d"))
  on_devices = [(tfspmd.device_put(x[k:k + 16], rows),
                 tfspmd.device_put(y[k:k + 16], rows))
                for k in range(0, 64, 16)]
  assert all(len(xb.addressable_shards) == 8 for xb, _ in on_devices)
  got_losses, got_weights = trained(on_devices)
  want_losses, want_weights = trained(
      [(x[k:k + 16], y[k:k + 16]) for k in range(0, 64, 16)])
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
  for got, want in zip(got_weights, want_weights):
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_variable_update_on_every_device_is_an_error_naming_it(
    dtensor_executor):
  del dtensor_executor  # unused
  array = tfspmd.pmap(lambda v: v * 2.)(np.ones((8, 3), np.float32))
  counter = tf.Variable(0., name="steps_taken")

  @tf.function
  def count(a):
    counter.assign_add(1.)
    return tf.reduce_sum(a)

  with pytest.raises(ValueError, match=(
      r"the tf.function 'count' was given ShardedArrays .* so its update of "
      r"'steps_taken:0' would happen once per device")):
    count(array)
  assert counter.numpy() == 0.


def test_a_tape_through_a_function_of_an_array_and_a_tensor(host_executor):
  del host_executor  # unused
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  array = tfspmd.pmap(lambda v: v + 0.)(x)
  w = tf.Variable(np.full((2,), 3., np.float32))
  scale = tf.function(lambda a, b: tf.reduce_sum(a * b * w))
  with tf.GradientTape() as tape:
    value = scale(array, tf.constant(2.))
  np.testing.assert_allclose(value, (x * 2. * 3.).sum())
  np.testing.assert_allclose(tape.gradient(value, w), 2. * x.sum(0))


def test_arrays_on_two_halves_of_the_devices_in_one_function(host_executor):
  del host_executor  # unused
  devices = tfspmd.local_devices()
  low = tfspmd.pmap(lambda v: v * 2., devices=devices[:4])(
      np.ones((4, 8), np.float32))
  high = tfspmd.pmap(lambda v: v * 3., devices=devices[4:])(
      np.ones((4, 8), np.float32))
  total = tf.function(lambda a, b: tf.reduce_sum(a) + tf.reduce_sum(b))
  assert total(low, high).numpy() == 32 * 2. + 32 * 3.


def test_a_function_of_plain_tensors_calling_a_pmap_updates_its_variables(
    each_executor):
  del each_executor  # unused
  total = tf.Variable(0.)
  summed = tfspmd.pmap(lambda v: lax.psum(v, "i"), "i", out_axes=None)

  @tf.function
  def accumulate(x):
    total.assign_add(tf.reduce_sum(summed(x)))
    return total.read_value()

  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  for calls in (1, 2):
    np.testing.assert_allclose(accumulate(tf.constant(x)), calls * x.sum())
