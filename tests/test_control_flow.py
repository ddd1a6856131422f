"""Loops and conditionals around collectives inside the mapped function.

Each expectation is NumPy arithmetic written here, device by device.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd._src.core import tf_internal

import numpy_reference

N = 8


def data(*shape, seed=0):
  return np.random.default_rng(seed).standard_normal((N,) + shape).astype(
      np.float32)


def run(fun, *args, debug=False, **kwargs):
  out = tfspmd.pmap(fun, "i", debug=debug, **kwargs)(*args)
  return tf.nest.map_structure(np.asarray, out)


def test_psum_of_the_carry_in_a_while_loop():
  x = data(3)
  out = run(lambda v: tf.while_loop(
      lambda k, c: k < 3, lambda k, c: (k + 1, lax.psum(c, "i")), (0, v))[1], x)
  np.testing.assert_allclose(out, np.broadcast_to(x.sum(0) * N * N, x.shape),
                             rtol=1e-5)


def test_ring_all_reduce_with_ppermute_in_a_loop():
  x = data(4)
  ring = [(k, (k + 1) % N) for k in range(N)]

  def ring_sum(v):
    def step(k, total, passing):
      passing = lax.ppermute(passing, "i", ring)
      return k + 1, total + passing, passing
    return tf.while_loop(lambda k, *_: k < N - 1, step, (0, v, v))[1]

  np.testing.assert_allclose(run(ring_sum, x),
                             np.broadcast_to(x.sum(0), x.shape), rtol=1e-5)


def _jacobi_numpy(a, b, tol):
  x = np.zeros_like(b)
  steps = 0
  while np.sum((a @ x - b) ** 2) >= tol:
    x = x + (b - a @ x) / np.diag(a)
    steps += 1
  return x, steps


def test_jacobi_solver_stops_on_a_psum_of_the_residual():
  rng = np.random.default_rng(1)
  size = N * 2
  a = rng.standard_normal((size, size)).astype(np.float32) * 0.1
  a += np.diag(np.full(size, 4.0, np.float32))
  b = rng.standard_normal(size).astype(np.float32)
  tol = 1e-8
  expected_x, expected_steps = _jacobi_numpy(a.astype(np.float64),
                                             b.astype(np.float64), tol)

  def solve(rows, rhs, diagonal):
    # Each device owns two rows of A and the matching entries of x.
    def residual(x_local):
      x_full = tf.reshape(lax.all_gather(x_local, "i"), [-1])
      return tf.linalg.matvec(rows, x_full) - rhs

    def not_done(k, x_local):
      return lax.psum(tf.reduce_sum(residual(x_local) ** 2), "i") >= tol

    def step(k, x_local):
      return k + 1, x_local - residual(x_local) / diagonal

    return tf.while_loop(not_done, step, (0, tf.zeros_like(rhs)))

  steps, x = run(solve, a.reshape(N, 2, size), b.reshape(N, 2),
                 np.diag(a).reshape(N, 2).copy())
  np.testing.assert_array_equal(steps, np.full(N, expected_steps))
  np.testing.assert_allclose(x.reshape(-1), expected_x, atol=1e-5)


def _wave_numpy(u, v, steps, c2):
  for _ in range(steps):
    lap = np.roll(u, 1) + np.roll(u, -1) - 2 * u
    v = v + c2 * lap
    u = u + v
  return u


def test_wave_equation_with_halo_exchange_over_slices_of_the_state():
  cells = 6
  grid = np.linspace(0, 2 * np.pi, N * cells, endpoint=False)
  u0 = np.sin(grid).astype(np.float32)
  v0 = np.zeros_like(u0)
  steps, c2 = 20, 0.1
  right = [(k, (k + 1) % N) for k in range(N)]
  left = [(k, (k - 1) % N) for k in range(N)]

  def simulate(u, v):
    def step(k, u, v):
      from_left = lax.ppermute(u[-1:], "i", right)
      from_right = lax.ppermute(u[:1], "i", left)
      padded = tf.concat([from_left, u, from_right], 0)
      lap = padded[:-2] + padded[2:] - 2 * u
      v = v + c2 * lap
      return k + 1, u + v, v
    return tf.while_loop(lambda k, *_: k < steps, step, (0, u, v))[1]

  out = run(simulate, u0.reshape(N, cells), v0.reshape(N, cells))
  np.testing.assert_allclose(out.reshape(-1), _wave_numpy(
      u0.astype(np.float64), v0.astype(np.float64), steps, c2), atol=1e-4)


def test_scan_with_a_psum_in_its_body():
  x = data(5, 3)
  out = run(lambda v: tf.scan(lambda c, e: c + lax.psum(e, "i"), v), x)
  # Without an initializer, scan starts from the first element as it is.
  later = np.cumsum(x.sum(0)[1:], axis=0)
  expected = x[:, :1] + np.concatenate([np.zeros((1, 3)), later])[None]
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fold", [tf.foldl, tf.foldr])
def test_fold_adds_axis_index(fold):
  x = data(4)
  out = run(lambda v: fold(
      lambda c, e: c + e + tf.cast(lax.axis_index("i"), tf.float32), v,
      initializer=tf.constant(0.)), x)
  np.testing.assert_allclose(out, x.sum(1) + 4 * np.arange(N), rtol=1e-5)


def test_map_fn_with_a_pmean():
  x = data(3, 2)
  out = run(lambda v: tf.map_fn(lambda row: lax.pmean(row, "i") * 2., v), x)
  np.testing.assert_allclose(out, np.broadcast_to(x.mean(0) * 2, x.shape),
                             rtol=1e-5)


def test_tensor_array_written_in_a_loop():
  x = data(3)

  def powers(v):
    def body(k, acc, out):
      acc = acc * v
      return k + 1, acc, out.write(k, lax.psum(acc, "i"))
    out = tf.TensorArray(tf.float32, size=3)
    return tf.while_loop(lambda k, *_: k < 3, body,
                         (0, tf.ones_like(v), out))[2].stack()

  expected = np.stack([(x ** p).sum(0) for p in (1, 2, 3)])
  np.testing.assert_allclose(run(powers, x),
                             np.broadcast_to(expected, (N, 3, 3)), rtol=1e-4)


def test_cond_with_the_same_predicate_everywhere_around_a_psum():
  x = data(3)
  f = lambda v, flag: tf.cond(flag > 0, lambda: lax.psum(v, "i"), lambda: v)
  taken = run(f, x, np.float32(1.), in_axes=(0, None))
  skipped = run(f, x, np.float32(-1.), in_axes=(0, None))
  np.testing.assert_allclose(taken, np.broadcast_to(x.sum(0), x.shape),
                             rtol=1e-5)
  np.testing.assert_array_equal(skipped, x)


def test_cond_on_a_psum_predicate():
  x = data(3)
  out = run(lambda v: tf.cond(lax.psum(tf.reduce_sum(v), "i") > 0,
                              lambda: lax.pmax(v, "i"), lambda: lax.pmin(v, "i")),
            x)
  expected = x.max(0) if x.sum() > 0 else x.min(0)
  np.testing.assert_array_equal(out, np.broadcast_to(expected, x.shape))


def test_cond_on_a_psum_predicate_in_a_while_loop():
  x = data(3)

  def f(v):
    def body(k, c):
      c = tf.cond(lax.psum(tf.reduce_sum(c), "i") > 3.,
                  lambda: c * 0.5, lambda: c + 1.)
      return k + 1, c
    return tf.while_loop(lambda k, c: k < 4, body, (0, v))[1]

  expected = x.astype(np.float64)
  for _ in range(4):
    expected = expected * 0.5 if expected.sum() > 3. else expected + 1.
  np.testing.assert_allclose(run(f, x), expected, rtol=1e-5)


def test_autograph_break_on_a_psum_in_a_tf_function():
  x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)

  @tf.function
  def accumulate(v):
    total = tf.zeros_like(v)
    for _ in tf.range(5):
      if lax.psum(tf.reduce_sum(total), "i") > 150.:
        break
      total += v
    return total

  # Every device adds its row until the sum over all devices passes 150.
  expected = np.zeros_like(x)
  for _ in range(5):
    if expected.sum() > 150.:
      break
    expected += x
  np.testing.assert_allclose(run(accumulate, x), expected, rtol=1e-6)


def test_cond_per_device_takes_each_devices_branch():
  x = data(3)
  out = run(lambda v: tf.cond(tf.reduce_sum(v) > 0, lambda: v * 10., lambda: -v),
            x)
  expected = np.where(x.sum(1, keepdims=True) > 0, x * 10, -x)
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_switch_case_per_device_and_out_of_range():
  x = data(2)

  def f(v):
    index = lax.axis_index("i") - 1  # -1 and 7 are out of range: last branch
    return tf.switch_case(index, [lambda: v, lambda: v * 2., lambda: v * 3.])

  scale = np.array([3, 1, 2, 3, 3, 3, 3, 3], np.float32)[:, None]
  np.testing.assert_allclose(run(f, x), x * scale, rtol=1e-6)


def test_tf_case_with_the_same_predicate_everywhere():
  x = data(2)
  out = run(lambda v, t: tf.case([(t < 0., lambda: -v), (t < 1., lambda: v * 5.)],
                                 default=lambda: v), x, np.float32(0.5),
            in_axes=(0, None))
  np.testing.assert_allclose(out, x * 5, rtol=1e-6)


def test_while_with_a_trip_count_per_device():
  x = data(2)
  out = run(lambda v: tf.while_loop(
      lambda k, c: k < lax.axis_index("i"), lambda k, c: (k + 1, c * 2.),
      (0, v)), x)
  np.testing.assert_array_equal(out[0], np.arange(N))
  np.testing.assert_allclose(out[1], x * (2. ** np.arange(N))[:, None],
                             rtol=1e-6)


def test_while_condition_per_device_on_the_state():
  x = np.abs(data(1)) + 1.

  def halvings(v):
    return tf.while_loop(lambda k, c: tf.reduce_sum(c) > 0.1,
                         lambda k, c: (k + 1, c / 2.), (0, v))[0]

  expected = [int(np.ceil(np.log2(float(v[0]) / 0.1))) for v in x]
  np.testing.assert_array_equal(run(halvings, x), expected)


def test_tf_function_with_a_collective_called_in_a_loop():
  x = data(3)

  @tf.function
  def smooth(c):
    return lax.pmean(c, "i") + 1.

  out = run(lambda v: tf.while_loop(lambda k, c: k < 2,
                                    lambda k, c: (k + 1, smooth(c)), (0, v))[1],
            x)
  np.testing.assert_allclose(out, np.broadcast_to(x.mean(0) + 2., x.shape),
                             rtol=1e-5)


def test_collective_over_the_outer_axis_in_a_loop_of_the_inner_pmap():
  x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)

  def inner(v):
    return tf.while_loop(lambda k, c: k < 2,
                         lambda k, c: (k + 1, lax.psum(c, "rows") + 1.),
                         (0, v))[1]

  out = np.asarray(tfspmd.pmap(tfspmd.pmap(inner, "cols"), "rows")(x))
  once = x.sum(0, keepdims=True) + 1.
  expected = np.broadcast_to(2 * once + 1., x.shape)
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_loop_with_a_collective_under_vmap():
  x = data(3)
  out = np.asarray(tfspmd.vmap(lambda v: tf.while_loop(
      lambda k, c: k < 2, lambda k, c: (k + 1, lax.psum(c, "v")), (0, v))[1],
                               axis_name="v")(x))
  np.testing.assert_allclose(out, np.broadcast_to(x.sum(0) * N, x.shape),
                             rtol=1e-5)


@pytest.mark.parametrize("name", ["scan", "cond_per_device", "while_per_device",
                                  "ring", "lax_scan", "lax_cond_per_device"])
def test_debug_mode_gives_the_compiled_numbers(name):
  x = data(3)
  ring = [(k, (k + 1) % N) for k in range(N)]
  programs = {
      "scan": lambda v: tf.scan(lambda c, e: c + lax.psum(e, "i"), v),
      "cond_per_device": lambda v: tf.cond(
          tf.reduce_sum(v) > 0, lambda: v * 10., lambda: -v),
      "while_per_device": lambda v: tf.while_loop(
          lambda k, c: k < lax.axis_index("i"), lambda k, c: (k + 1, c + 1.),
          (0, v))[1],
      "ring": lambda v: tf.while_loop(
          lambda k, c: k < 3, lambda k, c: (k + 1, lax.ppermute(c, "i", ring)),
          (0, v))[1],
      "lax_scan": lambda v: lax.scan(
          lambda c, e: (c + lax.psum(e, "i"), c * e), 0., v)[1],
      "lax_cond_per_device": lambda v: lax.cond(
          tf.reduce_sum(v) > 0, lambda a: a * 10., lambda a: -a, v),
  }
  np.testing.assert_allclose(run(programs[name], x),
                             run(programs[name], x, debug=True), rtol=1e-6)


def test_gradient_through_a_cond_with_a_psum():
  x = data(3)

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = tf.cond(tf.constant(True), lambda: lax.psum(v * v, "i"), lambda: v)
      loss = tf.reduce_sum(y)
    return tape.gradient(loss, v)

  # d/dv_i of sum_j sum_k v_k^2 (the same on all N devices) = N * 2 v_i.
  np.testing.assert_allclose(run(grad, x), 2. * N * x, rtol=1e-5)


def test_gradient_through_a_per_device_cond():
  x = data(3)

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = tf.cond(tf.reduce_sum(v) > 0, lambda: v * v, lambda: 3. * v)
      loss = tf.reduce_sum(y)
    return tape.gradient(loss, v)

  expected = np.where(x.sum(1, keepdims=True) > 0, 2. * x, 3.)
  np.testing.assert_allclose(run(grad, x), expected, rtol=1e-6)


def test_gradient_through_scan():
  x = np.abs(data(4)) + 0.5

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      loss = tf.reduce_sum(tf.scan(lambda c, e: c * e, v,
                                   initializer=tf.constant(1.)))
    return tape.gradient(loss, v)

  def loss_numpy(v):
    return np.cumprod(v).sum()

  expected = np.stack([numpy_reference.finite_difference(
      loss_numpy, row.astype(np.float64), eps=1e-4) for row in x])
  np.testing.assert_allclose(run(grad, x), expected, rtol=1e-4)


def test_gradient_through_a_loop_with_a_psum():
  x = data(3) * 0.5
  steps = 3

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = tf.while_loop(lambda k, c: k < steps,
                        lambda k, c: (k + 1, lax.psum(c * c, "i") * 0.1),
                        (0, v), maximum_iterations=steps)[1]
      loss = tf.reduce_sum(tf.sin(y))
    return tape.gradient(loss, v)

  def total_loss(flat):
    # Every device's loss, summed: psum's transpose is psum, so each
    # device's gradient is that of the sum over devices.
    c = flat.reshape(x.shape)
    for _ in range(steps):
      c = np.broadcast_to((c * c).sum(0) * 0.1, c.shape)
    return np.sin(c).sum()

  expected = numpy_reference.finite_difference(
      total_loss, x.astype(np.float64).reshape(-1), eps=1e-5).reshape(x.shape)
  np.testing.assert_allclose(run(grad, x), expected, rtol=1e-3, atol=1e-6)


def test_gradient_through_a_loop_per_device_matches_debug_mode():
  x = data(3)

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = tf.while_loop(lambda k, c: k < 4,
                        lambda k, c: (k + 1, tf.sin(c) * c + 1.),
                        (0, v), maximum_iterations=4)[1]
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, v)

  # Debug mode runs TensorFlow's kernels; XLA's sin differs in the last bits.
  np.testing.assert_allclose(run(grad, x), run(grad, x, debug=True),
                             rtol=1e-4)


@pytest.mark.parametrize("how", ["tape", "tf.gradients"])
def test_gradient_through_a_loop_whose_trip_count_differs_per_device(how):
  # Device i multiplies by v for i + 1 steps: d(v ** (i + 1))/dv. The
  # backward loop reads each device's own steps back from its list.
  x = np.linspace(0.5, 1.5, N * 2, dtype=np.float32).reshape(N, 2)

  def power(v):
    steps = tf.cast(lax.axis_index("i"), tf.int32) + 1
    return tf.while_loop(lambda k, c: k < steps, lambda k, c: (k + 1, c * v),
                         (0, tf.ones_like(v)), maximum_iterations=N)[1]

  def grad(v):
    if how == "tf.gradients":
      return power(v), tf.gradients(power(v), v)[0]
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = power(v)
    return y, tape.gradient(y, v)

  value, gradient = run(grad, x)
  steps = np.arange(1, N + 1, dtype=np.float64)[:, None]
  np.testing.assert_allclose(value, x.astype(np.float64) ** steps, rtol=1e-5)
  np.testing.assert_allclose(gradient, steps * x.astype(np.float64) ** (
      steps - 1), rtol=1e-5)


def test_tensor_array_read_at_a_per_device_index():
  x = data(4)

  def pick(v):
    rows = tf.TensorArray(tf.float32, size=4).unstack(
        tf.stack([v * k for k in (1., 2., 3., 4.)]))
    return rows.read(lax.axis_index("i") % 4)

  expected = x * (np.arange(N) % 4 + 1.)[:, None]
  np.testing.assert_allclose(run(pick, x), expected, rtol=1e-6)


def test_loop_in_a_loop_with_a_psum_in_the_inner_one():
  x = data(3)

  def f(v):
    def outer(k, c):
      inner = tf.while_loop(lambda j, d: j < 2,
                            lambda j, d: (j + 1, lax.psum(d, "i") / N),
                            (0, c))[1]
      return k + 1, inner + tf.cast(k, tf.float32)
    return tf.while_loop(lambda k, c: k < 3, outer, (0, v))[1]

  c = x.astype(np.float64)
  for k in range(3):
    for _ in range(2):
      c = np.broadcast_to(c.sum(0) / N, c.shape)
    c = c + k
  np.testing.assert_allclose(run(f, x), c, rtol=1e-5, atol=1e-6)


def test_scan_inside_a_loop_and_a_per_device_loop_inside_a_loop():
  x = data(4)

  def f(v):
    def outer(k, c):
      c = tf.scan(lambda a, e: a + e, c)
      c = tf.while_loop(lambda j, d: j < lax.axis_index("i"),
                        lambda j, d: (j + 1, d + 1.), (0, c))[1]
      return k + 1, c
    return tf.while_loop(lambda k, c: k < 2, outer, (0, v))[1]

  c = x.astype(np.float64)
  for _ in range(2):
    c = np.cumsum(c, axis=1) + np.arange(N)[:, None]
  np.testing.assert_allclose(run(f, x), c, rtol=1e-5)


def test_loops_three_deep_convert_the_innermost_body_a_few_times(monkeypatch):
  """Each loop's per-device variables are found once per stacked inputs.

  The outer loop's body is converted 3 times (two passes find that `a`
  becomes per-device, then the loop is built), each converting the middle
  loop; its passes run once for `a` the same everywhere and once for `a`
  per device, so its body is converted 2 + 2 + 1 = 5 times, each
  converting the inner loop: 2 passes (one per stacking of `a`) and 5
  builds make 7. Finding every loop's stacking anew would convert the
  innermost body 3 * 2 * 2 = 12 times, growing with each level of nesting.
  """
  x = data(3)
  innermost = []
  conversions = []
  convert_graph_inline = tf_internal.convert_graph_inline

  def counted(pfor_input, graph, inputs, prepare):
    conversions.append(graph)
    return convert_graph_inline(pfor_input, graph, inputs, prepare)

  monkeypatch.setattr(tf_internal, "convert_graph_inline", counted)

  def f(v):
    index = tf.cast(lax.axis_index("i"), tf.float32)

    def outer(k, a, b):
      def middle(j, a, b):
        def inner(m, a, b):
          innermost.append(tf.compat.v1.get_default_graph())
          return m + 1, a + 1., b + a * 0.5
        _, a, b = tf.while_loop(lambda m, *_: m < 2, inner, (0, a, b))
        return j + 1, a, b + index
      _, a, b = tf.while_loop(lambda j, *_: j < 2, middle, (0, a, b))
      return k + 1, a + b, b
    return tf.while_loop(lambda k, *_: k < 2, outer, (0, tf.zeros(3), v))[1]

  a = np.zeros_like(x, np.float64)
  b = x.astype(np.float64)
  for _ in range(2):
    for _ in range(2):
      for _ in range(2):
        a, b = a + 1, b + a * 0.5
      b = b + np.arange(N)[:, None]
    a = a + b
  np.testing.assert_allclose(run(f, x), a, rtol=1e-5)
  assert len(innermost) == 1
  assert sum(graph is innermost[0] for graph in conversions) == 7


def test_loops_inside_a_pmap_with_steps():
  x = data(3)

  def step(carry, t):
    carry = tf.while_loop(lambda j, c: j < 2,
                          lambda j, c: (j + 1, c + lax.pmean(c, "i") * t),
                          (0, carry))[1]
    return carry, tf.reduce_sum(carry)

  ts = np.tile(np.array([0.5, 1., 2.], np.float32), (N, 1))
  carry, sums = tfspmd.pmap(step, "i", steps=3)(x, ts)
  c = x.astype(np.float64)
  expected_sums = []
  for t in (0.5, 1., 2.):
    for _ in range(2):
      c = c + c.mean(0) * t
    expected_sums.append(c.sum(1))
  np.testing.assert_allclose(carry, c, rtol=1e-5)
  np.testing.assert_allclose(sums, np.stack(expected_sums, 1), rtol=1e-5)


def test_gradient_through_a_loop_in_a_loop():
  x = data(3) * 0.5

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      def outer(k, c):
        inner = tf.while_loop(lambda j, d: j < 2,
                              lambda j, d: (j + 1, tf.sin(d) + d),
                              (0, c), maximum_iterations=2)[1]
        return k + 1, inner * lax.pmean(c, "i")
      y = tf.while_loop(lambda k, c: k < 2, outer, (0, v),
                        maximum_iterations=2)[1]
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, v)

  def total_loss(flat):
    # Every device's loss, summed (pmean's transpose is pmean).
    c = flat.reshape(x.shape)
    for _ in range(2):
      inner = c
      for _ in range(2):
        inner = np.sin(inner) + inner
      c = inner * c.mean(0)
    return (c * c).sum()

  expected = numpy_reference.finite_difference(
      total_loss, x.astype(np.float64).reshape(-1), eps=1e-6).reshape(x.shape)
  np.testing.assert_allclose(run(grad, x), expected, rtol=1e-3, atol=1e-5)


def test_gradient_through_a_scan_inside_a_loop():
  x = data(3) * 0.3

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      def outer(k, c):
        scanned = tf.scan(lambda a, e: a * 0.5 + lax.psum(e, "i") * a, c)
        return k + 1, scanned + c
      y = tf.while_loop(lambda k, c: k < 2, outer, (0, v),
                        maximum_iterations=2)[1]
      loss = tf.reduce_sum(tf.sin(y))
    return tape.gradient(loss, v)

  def total_loss(flat):
    c = flat.reshape(x.shape)
    for _ in range(2):
      totals = c.sum(0)
      scanned = [c[:, 0]]
      for t in range(1, c.shape[1]):
        scanned.append(scanned[-1] * 0.5 + totals[t] * scanned[-1])
      c = np.stack(scanned, 1) + c
    return np.sin(c).sum()

  expected = numpy_reference.finite_difference(
      total_loss, x.astype(np.float64).reshape(-1), eps=1e-6).reshape(x.shape)
  np.testing.assert_allclose(run(grad, x), expected, rtol=1e-3, atol=1e-5)


PERMUTATION = [3, 0, 7, 1, 2, 6, 4, 5]
COLLECTIVES = {
    # name: (per-device collective, NumPy over the stacked [N, ...] input)
    "psum": (lambda v: lax.psum(v, "i"),
             lambda x: np.broadcast_to(x.sum(0), x.shape)),
    "pmax": (lambda v: lax.pmax(v, "i"),
             lambda x: np.broadcast_to(x.max(0), x.shape)),
    "all_gather": (lambda v: lax.all_gather(v, "i"),
                   lambda x: np.broadcast_to(x, (N,) + x.shape)),
    "psum_scatter": (lambda v: lax.psum_scatter(v, "i"),
                     lambda x: x.sum(0)),
    "all_to_all": (lambda v: lax.all_to_all(v, "i", 0, 0),
                   lambda x: np.swapaxes(x, 0, 1)),
    "pswapaxes": (lambda v: lax.pswapaxes(v, "i", 0),
                  lambda x: np.swapaxes(x, 0, 1)),
    "pshuffle": (lambda v: lax.pshuffle(v, "i", PERMUTATION),
                 lambda x: x[PERMUTATION]),
    "ppermute": (lambda v: lax.ppermute(v, "i", [(k, (k + 1) % N)
                                                 for k in range(N)]),
                 lambda x: np.roll(x, 1, axis=0)),
}


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_every_collective_in_a_loop_and_a_cond(name):
  collective, reference = COLLECTIVES[name]
  x = data(N, 2)
  shape = reference(x).shape[1:]

  def in_loop(v):
    def body(k, total):
      return k + 1, total + collective(v + tf.cast(k, tf.float32))
    return tf.while_loop(lambda k, _: k < 2, body, (0, tf.zeros(shape)))[1]

  def in_cond(v, flag):
    return tf.cond(flag > 0, lambda: collective(v), lambda: collective(-v))

  np.testing.assert_allclose(run(in_loop, x), reference(x) + reference(x + 1),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(run(in_cond, x, np.float32(-1.),
                                 in_axes=(0, None)), reference(-x),
                             rtol=1e-5, atol=1e-5)


def test_gradient_through_a_psum_in_a_cond_in_a_while_loop():
  x = data(3)

  def body(i, carry):
    return i + 1, tf.cond(i % 2 == 0, lambda: lax.psum(carry, "i") * 0.5,
                          lambda: carry * carry)

  def gradient(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      _, y = tf.while_loop(lambda i, c: i < 3, body, (0, v),
                           maximum_iterations=3)
      loss = tf.reduce_sum(y)
    return tape.gradient(loss, v)

  # y = 0.5 * psum((0.5 * S)^2) = S^2 with S = psum(v) (8 devices): each
  # device's loss sum(S^2) gives 2 S, and psum's transpose sums 8 of them.
  expected = np.broadcast_to(16 * x.sum(0), x.shape)
  np.testing.assert_allclose(np.asarray(run(gradient, x)), expected,
                             rtol=1e-5)


@pytest.mark.parametrize("flag", [1., -1.])
def test_gradient_through_a_cond_on_a_broadcast_flag(flag):
  x = data(3)

  def gradient(v, on):
    with tf.GradientTape() as tape:
      tape.watch(v)
      y = tf.cond(on > 0, lambda: lax.psum(v * v, "i"), lambda: v * 3.)
      index = tf.cast(lax.axis_index("i"), tf.float32)
      loss = tf.reduce_sum(y * index)
    return tape.gradient(loss, v)

  out = np.asarray(tfspmd.pmap(gradient, "i", in_axes=(0, None))(
      x, np.float32(flag)))
  index = np.arange(N, dtype=np.float32)[:, None]
  # psum's transpose sums the devices' cotangents 0 + 1 + ... + 7 = 28.
  expected = 2 * 28 * x if flag > 0 else 3 * index * np.ones_like(x)
  np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_the_gradient_of_a_softmax_over_an_inner_axis_in_a_scan():
  # softmax on a non-last axis transposes by a permutation computed from
  # the rank; DTensor lays out a transpose only with a constant one.
  x = data(3, 4)
  w = np.array([[1.], [0.5]], np.float32)

  def gradient(v, weights):
    with tf.GradientTape() as tape:
      tape.watch(weights)
      y = tf.scan(lambda c, wi: tf.nn.softmax(c * wi, axis=0), weights,
                  initializer=v)[-1]
      loss = tf.reduce_sum(y * v)
    return tape.gradient(loss, weights)

  def one_device(v):
    # The same loss in NumPy, differentiated by central differences.
    def loss(weights):
      c = v.astype(np.float64)
      for wi in weights:
        e = np.exp(c * wi - (c * wi).max(0))
        c = e / e.sum(0)
      return (c * v).sum()
    return numpy_reference.finite_difference(loss, w.astype(np.float64),
                                             eps=1e-4)

  out = run(gradient, x, w, in_axes=(0, None))
  np.testing.assert_allclose(out, np.stack([one_device(v) for v in x]),
                             rtol=1e-3, atol=1e-4)


# A loop that counts (`lax.fori_loop` with per-device bounds): each device
# runs its own passes, in every form of the comparison.
COUNTING_LOOPS = {
    "i < n": (lambda i, n: i < n, lambda i: i + 1, range),
    "n > i": (lambda i, n: n > i, lambda i: 1 + i, range),
    "i <= n": (lambda i, n: i <= n, lambda i: i + 1,
               lambda lo, hi: range(lo, hi + 1)),
    "i < n by 3": (lambda i, n: i < n, lambda i: i + 3,
                   lambda lo, hi: range(lo, hi, 3)),
    "i > n down": (lambda i, n: i > n, lambda i: i - 1,
                   lambda lo, hi: range(lo, hi, -1)),
    "i >= n down by 2": (lambda i, n: i >= n, lambda i: i - 2,
                         lambda lo, hi: range(lo, hi - 1, -2)),
}


@pytest.mark.parametrize("form", sorted(COUNTING_LOOPS))
def test_a_counting_loop_runs_each_devices_own_passes(form):
  keep_going, step, passes = COUNTING_LOOPS[form]
  start = np.array([0, 3, 9, 2, 5, 5, 1, 7], np.int32)
  bound = np.array([4, 3, 0, 9, 6, 1, 8, 2], np.int32)
  x = data(2)

  def loop(i, n, v):
    return tf.while_loop(
        lambda i, total, v: keep_going(i, n),
        lambda i, total, v: (step(i), total + i, v * 0.5 + tf.cast(i, v.dtype)),
        (i, tf.constant(0), v))

  counter, total, value = run(loop, start, bound, x)
  for d in range(N):
    visited = list(passes(int(start[d]), int(bound[d])))
    want_value = x[d]
    for i in visited:
      want_value = want_value * 0.5 + i
    assert total[d] == sum(visited), (form, d)
    assert counter[d] == (step(visited[-1]) if visited else start[d])
    np.testing.assert_allclose(value[d], want_value, rtol=1e-6)


def test_a_counting_loop_with_a_constant_bound_and_per_device_start():
  start = np.arange(N, dtype=np.int32) - 2
  out = run(lambda i: tf.while_loop(
      lambda i, s: i < 5, lambda i, s: (i + 1, s + i * i), (i, 0))[1], start)
  np.testing.assert_array_equal(
      out, [sum(k * k for k in range(s, 5)) for s in start])


@pytest.mark.parametrize("counting", [True, False])
def test_a_loop_in_a_branch_a_device_does_not_take_runs_no_passes(counting):
  # Where the branch is not taken the bound is endless; the devices that
  # take it stop after their own passes.
  bound = np.where(np.arange(N) < 4, np.arange(N) + 1, 2 ** 31 - 1).astype(
      np.float32 if not counting else np.int32)

  def f(n):
    if counting:
      loop = lambda: tf.while_loop(lambda i, s: i < n,
                                   lambda i, s: (i + 1, s + 1), (0, 0))[1]
    else:
      loop = lambda: tf.while_loop(
          lambda x, s: x < n, lambda x, s: (x + 1., s + 1),
          (tf.constant(0.), 0))[1]
    return tf.cond(lax.axis_index("i") < 4, loop, lambda: -1)

  np.testing.assert_array_equal(run(f, bound), [1, 2, 3, 4, -1, -1, -1, -1])


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int64])
def test_a_counting_loop_over_a_narrow_or_wide_counter(dtype):
  start = np.array([5, 0, 1, 2, 3, 9, 0, 1]).astype(dtype)
  out = run(lambda i: tf.while_loop(
      lambda i, s: i < tf.constant(3, i.dtype),
      lambda i, s: (i + tf.constant(1, i.dtype), s + 1), (i, 0))[1], start)
  np.testing.assert_array_equal(out, [max(3 - int(s), 0) for s in start])


# --- tfspmd.lax's control flow over pytrees (jax.lax's names) ----------------


def _numpy_scan(f, carry, xs, reverse=False):
  """lax.scan's meaning, in Python over NumPy rows."""
  order = range(len(xs))
  ys = [None] * len(xs)
  for k in (reversed(order) if reverse else order):
    carry, ys[k] = f(carry, xs[k])
  return carry, np.stack(ys)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("in_function", [False, True])
def test_lax_scan_of_pytrees_eagerly_and_in_a_tf_function(reverse, in_function):
  x = data(2)[:, 0]  # 8 steps of a scalar
  w = np.float32(0.5)

  def step(carry, xs):
    total = carry["total"] * xs[1] + xs[0]
    return {"total": total, "count": carry["count"] + 1}, (total, None)

  def f(x):
    return lax.scan(step, {"total": tf.constant(1.), "count": 0},
                    (x, tf.fill([N], w)), reverse=reverse)

  run_it = tf.function(f) if in_function else f
  carry, (ys, none) = run_it(tf.constant(x))
  want_total, want_ys = _numpy_scan(
      lambda c, e: (c * w + e, c * w + e), np.float64(1.), x, reverse)
  np.testing.assert_allclose(carry["total"], want_total, rtol=1e-5)
  assert int(carry["count"]) == N and none is None
  np.testing.assert_allclose(ys, want_ys, rtol=1e-5)


def test_lax_scan_with_length_and_no_xs_and_lax_map():
  carry, ys = lax.scan(lambda c, _: (c * 2, c), 1, None, length=4)
  assert int(carry) == 16
  np.testing.assert_array_equal(ys, [1, 2, 4, 8])
  x = data(3)
  np.testing.assert_allclose(
      lax.map(lambda row: {"s": tf.reduce_sum(row["a"])}, {"a": x})["s"],
      x.sum(1), rtol=1e-6)
  # An empty scan still knows its ys, as JAX's does.
  _, ys = tf.function(lambda: lax.scan(
      lambda c, e: (c, tf.stack([e, e])), 0., tf.zeros([0])))()
  assert ys.shape == (0, 2)


def test_lax_scan_with_collectives_in_its_body(each_executor):
  x = data(5, 3)

  def f(v):
    def step(carry, row):
      total = carry + lax.psum(row, "i")
      return total, lax.pmax(row, "i") * tf.cast(lax.axis_index("i"),
                                                  tf.float32)
    return lax.scan(step, tf.zeros(3), v, reverse=True)

  carry, ys = run(f, x)
  np.testing.assert_allclose(carry, np.broadcast_to(x.sum((0, 1)), (N, 3)),
                             rtol=1e-5)
  np.testing.assert_allclose(
      ys, x.max(0)[None] * np.arange(N)[:, None, None], rtol=1e-6)


def test_lax_fori_loop_and_while_loop_with_collectives(each_executor):
  x = data(4)
  ring = [(k, (k + 1) % N) for k in range(N)]

  def f(v):
    # fori_loop: a ring all-reduce; while_loop: halve until the psum of the
    # carry is small, a predicate the same on every device.
    _, total = lax.fori_loop(
        0, N - 1, lambda i, c: (lax.ppermute(c[0], "i", ring), c[1] + lax.
                                ppermute(c[0], "i", ring)), (v, v))
    halved = lax.while_loop(
        lambda c: lax.psum(tf.reduce_sum(tf.abs(c["x"])), "i") > 1.,
        lambda c: {"x": c["x"] / 2., "n": c["n"] + 1}, {"x": v, "n": 0})
    return total, halved["x"], halved["n"]

  total, halved, count = run(f, x)
  np.testing.assert_allclose(total, np.broadcast_to(x.sum(0), x.shape),
                             rtol=1e-5)
  n = 0
  while np.abs(x).sum() / 2. ** n > 1.:
    n += 1
  np.testing.assert_array_equal(count, [n] * N)
  np.testing.assert_allclose(halved, x / 2. ** n, rtol=1e-6)


def test_lax_cond_and_switch_per_device_and_on_a_psum(each_executor):
  x = data(3)

  def f(v):
    index = lax.axis_index("i")
    # Per device, pytree operands: each device takes its own branch.
    per_device = lax.cond(index % 2 == 0, lambda a, b: {"y": a["v"] * b},
                          lambda a, b: {"y": -a["v"]}, {"v": v}, 10.)
    # The same predicate everywhere, a collective in the branch.
    same = lax.cond(lax.psum(tf.reduce_sum(v), "i") > 0.,
                    lambda a: lax.pmax(a, "i"), lambda a: lax.pmin(a, "i"), v)
    # Clamped as JAX clamps it: -1 takes the first branch, 6 and 7 the last.
    chosen = lax.switch(index - 1, [lambda a: a, lambda a: a * 2.,
                                    lambda a: a * 3.], v)
    return per_device["y"], same, chosen

  per_device, same, chosen = run(f, x)
  even = (np.arange(N) % 2 == 0)[:, None]
  np.testing.assert_allclose(per_device, np.where(even, 10. * x, -x), rtol=1e-6)
  want = x.max(0) if x.sum() > 0 else x.min(0)
  np.testing.assert_array_equal(same, np.broadcast_to(want, x.shape))
  scale = np.clip(np.arange(N) - 1, 0, 2) + 1.
  np.testing.assert_allclose(chosen, x * scale[:, None], rtol=1e-6)


def test_gradient_through_lax_scan_and_fori_loop(each_executor):
  x = np.abs(data(4)) + 0.5

  def grad(v):
    with tf.GradientTape() as tape:
      tape.watch(v)
      _, products = lax.scan(lambda c, e: (c * e, c * e), tf.constant(1.), v)
      squared = lax.fori_loop(0, 2, lambda i, c: c * v[i], tf.constant(1.))
      loss = tf.reduce_sum(products) + squared + lax.psum(v[0], "i")
    return tape.gradient(loss, v)

  def loss_numpy(v):
    return np.cumprod(v).sum() + v[0] * v[1]

  expected = np.stack([numpy_reference.finite_difference(
      loss_numpy, row.astype(np.float64), eps=1e-4) for row in x])
  # psum's transpose is psum: v[0] of every device reaches each one N times.
  expected[:, 0] += N
  np.testing.assert_allclose(run(grad, x), expected, rtol=1e-4)


@pytest.mark.parametrize("how, error, match", [
    ("scan dtype", TypeError,
     r"lax.scan: f must return a carry like init, as in jax.lax.scan, but "
     r"init\['w'\] is float32\[2\] and f's carry\['w'\] is "
     r"float64\[2\]"),
    ("scan tree", TypeError,
     r"lax.scan: f must return a carry like init, as in jax.lax.scan, but "
     r"init has the structure \(\*, \*\) and f's carry has \[\*, \*\]"),
    ("scan pair", TypeError, r"lax.scan: f must return a pair \(carry, y\)"),
    ("scan lengths", ValueError,
     r"lax.scan: the leaves of xs must share their leading axis size, and "
     r"length must equal it, as in jax.lax.scan; got xs\[0\] 3, xs\[1\] 4"),
    ("scan no length", ValueError, r"pass length=n"),
    ("fori shape", TypeError,
     r"lax.fori_loop: body_fun must return a carry like init_val, as in "
     r"jax.lax.fori_loop, but init_val is float32\[2\] and body_fun's "
     r"result is float32\[4\]"),
    ("fori float bound", TypeError,
     r"lax.fori_loop: upper must be an integer"),
    ("while predicate", TypeError,
     r"lax.while_loop: cond_fun must return a scalar bool"),
    ("cond branches", TypeError,
     r"lax.cond: every branch must return the same structure, dtypes and "
     r"shapes, as in jax.lax.cond, but true_fun's result has the structure "
     r"\* and false_fun's result has \(\*, \*\)"),
    ("switch index", TypeError, r"lax.switch: index must be an integer scalar"),
])
def test_lax_control_flow_says_what_differs(how, error, match):
  v = tf.ones(2)
  programs = {
      "scan dtype": lambda: lax.scan(
          lambda c, e: ({"w": tf.cast(c["w"], tf.float64)}, None), {"w": v},
          tf.zeros(3)),
      "scan tree": lambda: lax.scan(lambda c, e: (list(c), None), (v, v),
                                    tf.zeros(3)),
      "scan pair": lambda: lax.scan(lambda c, e: c, v, tf.zeros(3)),
      "scan lengths": lambda: lax.scan(lambda c, e: (c, None), v,
                                       (tf.zeros(3), tf.zeros(4))),
      "scan no length": lambda: lax.scan(lambda c, e: (c, None), v, None),
      "fori shape": lambda: lax.fori_loop(0, 2, lambda i, c: tf.concat(
          [c, c], 0), v),
      "fori float bound": lambda: lax.fori_loop(0, 2.5, lambda i, c: c, v),
      "while predicate": lambda: lax.while_loop(lambda c: c < 3., lambda c: c,
                                                v),
      "cond branches": lambda: lax.cond(tf.reduce_sum(v) > 0.,
                                        lambda: v, lambda: (v, v)),
      "switch index": lambda: lax.switch(1.5, [lambda: v]),
  }
  # Inside a tf.function, where TensorFlow traces every branch, and in a pmap.
  with pytest.raises(error, match=match):
    tf.function(programs[how])()
  with pytest.raises(error, match=match):
    tfspmd.pmap(lambda _: programs[how](), "i")(np.zeros(N))
