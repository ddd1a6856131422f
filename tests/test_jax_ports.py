"""Programs written for jax.pmap, ported to tfspmd, against JAX's numbers.

Each program below is a faithful TensorFlow port of a jax.pmap program; the
expected numbers are what JAX 0.10.2 printed for the same inputs on 8 CPU
devices (`jax.pmap` with `lax.fori_loop` / `lax.while_loop`), recorded here.
The programs that use `lax.scan` and `jax.value_and_grad` port by renaming
`jax` to `tfspmd` (and `jnp` to `tf`).
"""

import functools

import numpy as np
import tensorflow as tf

import tfspmd
from tfspmd import lax

N = 8


def inputs():
  rng = np.random.default_rng(42)
  lhs = rng.standard_normal((N * 2, 6)).astype(np.float32)
  rhs = rng.standard_normal((6, N * 3)).astype(np.float32)
  a = rng.standard_normal((N * 2, N * 2)).astype(np.float32)
  return lhs, rhs, (a + a.T) / 2


def test_collective_matmul_with_a_ppermute_ring_in_a_loop():
  # JAX: shard_map docs' all-gather collective matmul, with lax.fori_loop
  # and lax.dynamic_update_slice, under jax.pmap.
  lhs, rhs, _ = inputs()

  def collective_matmul(lhs_block, rhs_block):
    rows = lhs_block.shape[0]
    index = lax.axis_index("i")
    ring = [(j, (j + 1) % N) for j in range(N)]

    def body(t, out, block):
      source = (index - t) % N
      positions = tf.range(rows) + source * rows
      out = tf.tensor_scatter_nd_update(out, positions[:, None],
                                        block @ rhs_block)
      return t + 1, out, lax.ppermute(block, "i", ring)

    out = tf.zeros([rows * N, rhs_block.shape[1]])
    return tf.while_loop(lambda t, *_: t < N, body, (0, out, lhs_block))[1]

  out = np.asarray(tfspmd.pmap(collective_matmul, "i")(
      lhs.reshape(N, 2, 6), rhs.reshape(6, N, 3).transpose(1, 0, 2)))
  # JAX printed: sum 11.012269973754883, device 3 row 5
  # [1.1801538467407227, 1.1458632946014404, 1.210768461227417].
  np.testing.assert_allclose(out.sum(), 11.012269973754883, rtol=1e-5)
  np.testing.assert_allclose(
      out[3, 5], [1.1801538467407227, 1.1458632946014404, 1.210768461227417],
      rtol=1e-5)
  np.testing.assert_allclose(out[3], lhs @ rhs[:, 9:12], rtol=1e-4, atol=1e-5)


def test_power_iteration_with_a_psum_convergence_test():
  # JAX: lax.while_loop whose condition reads a psum of the change.
  _, _, a = inputs()

  def power(rows, v0):
    def not_converged(k, v, delta):
      return tf.logical_and(delta > 1e-6, k < 500)

    def step(k, v, delta):
      full = tf.reshape(lax.all_gather(v, "i"), [-1])
      w = tf.linalg.matvec(rows, full)
      w = w / tf.sqrt(lax.psum(tf.reduce_sum(w * w), "i"))
      return k + 1, w, lax.psum(tf.reduce_sum((w - v) ** 2), "i")

    k, v, _ = tf.while_loop(not_converged, step, (0, v0, tf.constant(1.)))
    full = tf.reshape(lax.all_gather(v, "i"), [-1])
    return k, lax.psum(tf.reduce_sum(v * tf.linalg.matvec(rows, full)), "i")

  steps, eigenvalue = tfspmd.pmap(power, "i")(
      a.reshape(N, 2, N * 2), np.ones((N, 2), np.float32) / 4)
  # JAX printed: 39 steps, eigenvalue 5.531209468841553.
  np.testing.assert_array_equal(steps, np.full(N, 39))
  np.testing.assert_allclose(eigenvalue, np.full(N, 5.531209468841553),
                             rtol=1e-5)


def test_shard_map_design_doc_examples():
  # JAX's shard_map design doc (JEP 14273): matmul_basic and f1, f3, f4, f5
  # on a (4, 2) ('i', 'j') mesh, and a closure returned with three out
  # specs. JAX 0.10.2 printed (jax.shard_map, 8 CPU devices):
  #   matmul_basic (8, 32) sum 69239808.0, c[0, :4] [39680. 39800. 39920.
  #   40040.], c[7, -3:] [525208. 527120. 529032.]; f1 (12, 24) sum 20592
  #   (printing block shape (3, 12)); closure (4, 2), (4, 1), (1, 1);
  #   f3 (12, 6) row 0 [6, 8, 10, 12, 14, 16]; f4 (3, 12) row 0 [216, 220,
  #   ..., 260]; f5 (3, 6) row 0 [456, 464, 472, 480, 488, 496].
  m = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(4, 2), ("i", "j"))
  P = tfspmd.P
  a = np.arange(8 * 16.).reshape(8, 16).astype(np.float32)
  b = np.arange(16 * 32.).reshape(16, 32).astype(np.float32)

  def matmul_basic(a_block, b_block):
    assert a_block.shape == (2, 8) and b_block.shape == (8, 32)
    z_partialsum = a_block @ b_block
    return lax.psum(z_partialsum, "j")

  c = np.asarray(tfspmd.shard_map(matmul_basic, mesh=m,
                                  in_specs=(P("i", "j"), P("j", None)),
                                  out_specs=P("i", None))(a, b))
  assert c.shape == (8, 32) and float(c.sum()) == 69239808.0
  np.testing.assert_array_equal(c[0, :4], [39680., 39800., 39920., 40040.])
  np.testing.assert_array_equal(c[7, -3:], [525208., 527120., 529032.])

  shapes = []

  def f1(x_block):
    shapes.append(tuple(x_block.shape))
    return x_block

  x1 = np.arange(12 * 12).reshape(12, 12).astype(np.int32)
  y = np.asarray(tfspmd.shard_map(f1, mesh=m, in_specs=P("i", None),
                                  out_specs=P("i", "j"))(x1))
  assert shapes == [(3, 12)] and y.shape == (12, 24) and y.sum() == 20592

  x = tf.constant([[3.]])
  for spec, shape in [(P("i", "j"), (4, 2)), (P("i", None), (4, 1)),
                      (P(None, None), (1, 1))]:
    z = tfspmd.shard_map(lambda: x, mesh=m, in_specs=(), out_specs=spec)()
    np.testing.assert_array_equal(z, np.full(shape, 3.))

  x = np.arange(12 * 12).reshape(12, 12).astype(np.int32)
  f3 = tfspmd.shard_map(lambda blk: lax.psum(blk, "j"), mesh=m,
                        in_specs=P("i", "j"), out_specs=P("i", None))
  f4 = tfspmd.shard_map(lambda blk: lax.psum(blk, "i"), mesh=m,
                        in_specs=P("i", "j"), out_specs=P(None, "j"))
  f5 = tfspmd.shard_map(lambda blk: lax.psum(blk, ("i", "j")), mesh=m,
                        in_specs=P("i", "j"), out_specs=P(None, None))
  for f, shape, row in [(f3, (12, 6), [6, 8, 10, 12, 14, 16]),
                        (f4, (3, 12), list(range(216, 261, 4))),
                        (f5, (3, 6), [456, 464, 472, 480, 488, 496])]:
    r = np.asarray(f(x))
    assert r.shape == shape
    np.testing.assert_array_equal(r[0], row)


def test_jax_issue_804_scan_with_a_psum_under_pmap(each_executor):
  # JAX's tests/lax_control_flow_test.py, testIssue804 (github.com/jax-ml/jax
  # issue 804), renamed: partial(lax.scan, ...) is the mapped function. JAX
  # printed, for ones((8, 4)): carry [32.] * 8, ys rows [0, 8, 16, 24]; for
  # arange(32.).reshape(8, 4): carry [496.] * 8, ys rows [0, 112, 232, 360].
  f = functools.partial(lax.scan, lambda c, x: (c + lax.psum(x, "i"), c), 0.)
  for x, total, row in [(np.ones((N, 4), np.float32), 32., [0., 8., 16., 24.]),
                        (np.arange(32.).reshape(N, 4).astype(np.float32), 496.,
                         [0., 112., 232., 360.])]:
    carry, ys = tfspmd.pmap(f, axis_name="i")(x)
    np.testing.assert_array_equal(carry, np.full(N, total))
    np.testing.assert_array_equal(ys, np.broadcast_to(row, (N, 4)))


def test_jax_axis_index_in_initial_style(each_executor):
  # JAX's tests/pmap_test.py, testAxisIndexInInitialStyle, renamed. JAX
  # printed [10 20 30 40 50 60 70 80] for ones((8, 10), int32) and [45 155
  # 265 375 485 595 705 815] for arange(80).reshape(8, 10).
  @functools.partial(tfspmd.pmap, axis_name="i")
  def f(x):
    def body(carry, i):
      return carry + i + lax.axis_index("i"), None
    return lax.scan(body, 0, x)[0]

  np.testing.assert_array_equal(f(np.ones((N, 10), np.int32)),
                                [10, 20, 30, 40, 50, 60, 70, 80])
  np.testing.assert_array_equal(
      f(np.arange(80, dtype=np.int32).reshape(N, 10)),
      [45, 155, 265, 375, 485, 595, 705, 815])


def test_data_parallel_epoch_as_a_scan_of_value_and_grad_steps(each_executor):
  # A jax.pmap training epoch: lax.scan over 4 microbatches, each step
  # jax.value_and_grad(has_aux=True), lax.pmean of the grads inside the
  # scan body, an SGD update of the params carried. JAX 0.10.2 printed
  # (8 CPU devices) losses [1.584468126296997, 1.1548433303833008,
  # 1.2223907709121704, 1.4850610494613647], w [[0.055165719240903854,
  # -0.1994790881872177], [0.4371718764305115, 0.6836323142051697],
  # [-0.10481833666563034, 0.2419150322675705]], b [-0.012634014710783958,
  # -0.07682952284812927], the same on every device.
  rng = np.random.default_rng(3)
  x = rng.standard_normal((N, 4, 6, 3)).astype(np.float32)
  y = rng.standard_normal((N, 4, 6, 2)).astype(np.float32)
  w0 = (0.5 * rng.standard_normal((3, 2))).astype(np.float32)
  b0 = np.zeros(2, np.float32)

  def loss_fn(params, xb, yb):
    pred = tf.tanh(xb @ params["w"] + params["b"])
    return tf.reduce_mean((pred - yb) ** 2), pred

  @functools.partial(tfspmd.pmap, axis_name="batch", in_axes=(None, 0, 0))
  def train_epoch(params, xs, ys):
    def step(params, batch):
      (loss, _), grads = tfspmd.value_and_grad(loss_fn, has_aux=True)(
          params, *batch)
      grads = lax.pmean(grads, axis_name="batch")
      params = tfspmd.tree.map(lambda p, g: p - 0.3 * g, params, grads)
      return params, lax.pmean(loss, "batch")
    return lax.scan(step, params, (xs, ys))

  params, losses = train_epoch({"w": w0, "b": b0}, x, y)
  np.testing.assert_allclose(
      losses, np.broadcast_to([1.584468126296997, 1.1548433303833008,
                               1.2223907709121704, 1.4850610494613647],
                              (N, 4)), rtol=1e-5)
  np.testing.assert_allclose(
      params["w"], np.broadcast_to(
          [[0.055165719240903854, -0.1994790881872177],
           [0.4371718764305115, 0.6836323142051697],
           [-0.10481833666563034, 0.2419150322675705]], (N, 3, 2)),
      rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      params["b"], np.broadcast_to(
          [-0.012634014710783958, -0.07682952284812927], (N, 2)),
      rtol=1e-5, atol=1e-6)
