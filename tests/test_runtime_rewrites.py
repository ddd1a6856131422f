"""Programs that once stopped while DTensor ran them, against NumPy.

TensorFlow's CPU kernel of tf.where refuses results of rank 9 or more, which
a per-device rank of 8 reaches once stacked over the devices (ring
attention's blocks); a psum_scatter's result next to an all_gather's on a
(4, 2) mesh asked DTensor for a transpose it does not expand (the shard_map
tutorial's FSDP + TP network); a select whose scalar condition and operands
are the same on every device crashed the process in DTensor's layout
propagation, and so did a scatter_nd with int64 indices.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax

from numpy_reference import data

N = 8
RING = [(j, (j + 1) % N) for j in range(N)]


# --- tf.where at rank 9 --------------------------------------------------------


def test_where_of_rank_nine_with_a_broadcast_condition():
  x = data(N, 1, 2, 1, 1, 1, 4, 2, 4)

  def f(block):
    keep = tf.reduce_sum(block, [-1, -2, -3], keepdims=True) > 0
    return tf.where(keep, block, -block), tf.where(block > 0, block, 0.)

  flipped, clipped = tfspmd.pmap(f, "i")(x)
  np.testing.assert_array_equal(
      flipped, np.where(x.sum((-1, -2, -3), keepdims=True) > 0, x, -x))
  np.testing.assert_array_equal(clipped, np.where(x > 0, x, 0))


def test_rank_nine_selects_of_loops_conditionals_and_ppermute():
  x = data(N, 1, 2, 1, 1, 1, 4, 2, 4)
  partial_ring = [(j, j + 1) for j in range(N - 1)]

  def f(block):
    index = lax.axis_index("i")
    branch = tf.cond(index > 3, lambda: block * 2, lambda: block - 1)

    def body(t, total, moving):
      keep = tf.reduce_sum(moving, [-1, -2, -3], keepdims=True) > 0
      total = tf.where(keep, total + moving, total)
      return t + 1, total, lax.ppermute(moving, "i", RING)

    total = tf.while_loop(lambda t, *_: t < N, body,
                          (0, tf.zeros_like(block), block))[1]
    return branch, total, lax.ppermute(block, "i", partial_ring)

  branch, total, shifted = tfspmd.pmap(f, "i")(x)
  late = (np.arange(N) > 3).reshape((N,) + (1,) * 8)
  np.testing.assert_array_equal(branch, np.where(late, x * 2, x - 1))
  expected = np.zeros_like(x)
  for device in range(N):
    for t in range(N):
      moving = x[(device - t) % N]
      keep = moving.sum((-1, -2, -3), keepdims=True) > 0
      expected[device] = np.where(keep, expected[device] + moving,
                                  expected[device])
  np.testing.assert_allclose(total, expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(shifted[0], np.zeros_like(x[0]))
  np.testing.assert_array_equal(shifted[1:], x[:-1])


# --- ring attention ------------------------------------------------------------

B, H, G, C, T, D = 1, 2, 1, 2, 2, 4  # per device: C chunks of T positions


def ring_attention(causal_by):
  """Causal attention over the ring; q, k, v per device [B, H, G, C, T, D]."""
  scale = 1 / np.sqrt(D)
  position = (np.arange(C)[:, None] * T + np.arange(T)[None, :])
  # [cq, ck, tq, tk]: a query sees the keys at or before it in the block.
  diagonal = (position[:, None, :, None] >= position[None, :, None, :])

  def attend(q, k, v):
    index = lax.axis_index("i")
    # [B, H, G, cq, ck, tq, tk, D]: rank 8 per device, 9 stacked.

    def scores(keys, masked):
      products = tf.einsum("bhgqtd,bhgkjd->bhgqktjd", q, keys)
      if masked is not None:
        products = tf.where(masked[..., None], products, 0.)
        return tf.where(masked, tf.reduce_sum(products, -1) * scale, -1e30)
      return tf.reduce_sum(products, -1) * scale

    def step(t, best, total, out, keys, values):
      source = (index - t) % N
      if causal_by == "cond":
        s = tf.cond(source == index,
                    lambda: scores(keys, tf.constant(diagonal)),
                    lambda: scores(keys, None))
      else:
        s = scores(keys, tf.logical_or(source < index, diagonal))
      s = tf.where(source > index, tf.fill(tf.shape(s), -1e30), s)
      # [B, H, G, cq, tq, ck, tk]
      s = tf.transpose(s, [0, 1, 2, 3, 5, 4, 6])
      new_best = tf.maximum(best, tf.reduce_max(s, [-2, -1]))
      p = tf.exp(s - new_best[..., None, None])
      correction = tf.exp(best - new_best)
      total = total * correction + tf.reduce_sum(p, [-2, -1])
      out = (out * correction[..., None] +
             tf.einsum("bhgqtkj,bhgkjd->bhgqtd", p, values))
      return (t + 1, new_best, total, out, lax.ppermute(keys, "i", RING),
              lax.ppermute(values, "i", RING))

    start = (0, tf.fill([B, H, G, C, T], -1e30), tf.zeros([B, H, G, C, T]),
             tf.zeros([B, H, G, C, T, D]), k, v)
    _, _, total, out, _, _ = tf.while_loop(lambda t, *_: t < N, step, start)
    return out / total[..., None]

  return attend


def numpy_causal_attention(q, k, v):
  """Plain causal softmax attention over the sequence of all devices' blocks."""
  def sequence(x):  # [N, B, H, G, C, T, D] -> [B, H, G, N*C*T, D]
    return x.transpose(1, 2, 3, 0, 4, 5, 6).reshape(B, H, G, N * C * T, D)

  qs, ks, vs = sequence(q), sequence(k), sequence(v)
  s = qs @ ks.swapaxes(-1, -2) / np.sqrt(D)
  length = N * C * T
  s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  out = (p / p.sum(-1, keepdims=True)) @ vs
  return out.reshape(B, H, G, N, C, T, D).transpose(3, 0, 1, 2, 4, 5, 6)


@pytest.mark.parametrize("causal_by", ["cond", "where"])
def test_ring_attention_forward_on_rank_six_blocks(causal_by):
  q, k, v = (data(N, B, H, G, C, T, D, seed=s) for s in range(3))
  out = tfspmd.pmap(ring_attention(causal_by), "i")(q, k, v)
  np.testing.assert_allclose(out, numpy_causal_attention(q, k, v),
                             rtol=2e-5, atol=2e-6)


# --- psum_scatter next to all_gather on a 2-D mesh ------------------------------


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)], ids=str)
def test_psum_scatter_result_added_to_an_all_gather_result(shape):
  mesh = tfspmd.make_mesh(shape, ("batch", "feats"))
  x, w = data(16, 32), data(32, 16, seed=1)
  b, t = data(16, seed=2), data(16, 16, seed=3)

  def f(x, w, b, t):
    product = tf.matmul(x, lax.all_gather(w, "batch", tiled=True))
    scattered = lax.psum_scatter(product, "feats", scatter_dimension=1,
                                 tiled=True)
    return (scattered + lax.all_gather(b, "batch", tiled=True) - t) ** 2

  out = tfspmd.shard_map(
      f, mesh=mesh, in_specs=(P("batch", "feats"), P(("feats", "batch")),
                              P(("feats", "batch")), P("batch", "feats")),
      out_specs=P("batch", "feats"))(x, w, b, t)
  np.testing.assert_allclose(out, (x @ w + b - t) ** 2, rtol=1e-4, atol=1e-4)


def fsdp_tp_data():
  """The shard_map tutorial's network, drawn with NumPy, and a batch of 16.

  The tutorial's own batch of 32 is tests/test_ported_programs.py's.
  """
  rng = np.random.default_rng(0)
  sizes = [784, 128, 128, 128, 128, 128, 8]
  params = [((rng.standard_normal((i, o)) / np.sqrt(i)).astype(np.float32),
             rng.standard_normal((o,)).astype(np.float32))
            for i, o in zip(sizes[:-1], sizes[1:])]
  inputs = rng.standard_normal((16, 784)).astype(np.float32)
  targets = rng.standard_normal((16, 8)).astype(np.float32)
  return params, (inputs, targets)


def test_fsdp_and_tensor_parallel_loss_on_a_4_by_2_mesh():
  # JAX's shard_map tutorial, "FSDP + TP, with shard_map at the top level".
  # On this data JAX 0.10.2 (jax.shard_map, 8 CPU devices) printed
  # 12.354124069213867.
  params, batch = fsdp_tp_data()
  mesh = tfspmd.make_mesh((4, 2), ("batch", "feats"))

  def predict(params_frag, inputs):
    for w_frag, b_frag in params_frag:
      w = lax.all_gather(w_frag, "batch", tiled=True)
      b = lax.all_gather(b_frag, "batch", tiled=True)
      block_result = tf.matmul(inputs, w)
      outputs = lax.psum_scatter(block_result, "feats", scatter_dimension=1,
                                 tiled=True) + b
      inputs = tf.nn.relu(outputs)
    return outputs

  def loss(local_params, local_batch):
    inputs, targets = local_batch
    predictions = predict(local_params, inputs)
    sq_err = lax.psum(tf.reduce_sum((predictions - targets) ** 2, axis=-1),
                      "feats")
    return lax.pmean(tf.reduce_mean(sq_err), "batch")

  value = tfspmd.shard_map(
      loss, mesh=mesh, in_specs=(P(("feats", "batch")), P("batch", "feats")),
      out_specs=P())(params, batch)

  x, targets = batch
  for w, b in params:
    outputs = x.astype(np.float64) @ w + b
    x = np.maximum(outputs, 0)
  expected = np.mean(np.sum((outputs - targets) ** 2, axis=-1))
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  np.testing.assert_allclose(value, 12.354124069213867, rtol=1e-5)


# --- selects with a scalar condition on values the same on every device -------


def _sign_select(kind, y):
  """y or -y by the sign of y's sum: the condition is the same everywhere."""
  positive = tf.reduce_sum(y) > 0
  if kind == "Select":
    return tf.raw_ops.Select(condition=positive, x=y, y=-y)
  return tf.where(positive, y, -y)


@pytest.mark.parametrize("kind", ["SelectV2", "Select"])
@pytest.mark.parametrize("where", ["top level", "tf.cond", "tf.while_loop"])
def test_a_scalar_condition_select_of_unmapped_values(kind, where):
  x, y = data(N, 3), data(2, 3, seed=1)

  def f(x, y):
    if where == "top level":
      return x + _sign_select(kind, y)[0]
    if where == "tf.cond":
      return tf.cond(tf.reduce_sum(x) > 0,
                     lambda: x + _sign_select(kind, y)[0], lambda: x - 1)
    return tf.while_loop(
        lambda i, v: i < 3,
        lambda i, v: (i + 1, v + _sign_select(kind, y)[0]), (0, x))[1]

  out = tfspmd.pmap(f, "i", in_axes=(0, None))(x, y)
  picked = (y if y.sum() > 0 else -y)[0]
  if where == "top level":
    expected = x + picked
  elif where == "tf.cond":
    expected = np.where(x.sum(1, keepdims=True) > 0, x + picked, x - 1)
  else:
    expected = x + 3 * picked
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_a_scalar_condition_select_of_a_constant_and_its_gradient():
  w = data(2, 3, seed=2)

  def f(x):
    chosen = tf.where(tf.constant(True), tf.constant(w), tf.zeros_like(w))
    return tf.reduce_sum(x * chosen[1])

  x = tf.constant(data(N, 3))
  with tf.GradientTape() as tape:
    tape.watch(x)
    out = tfspmd.pmap(f, "i")(x)
  np.testing.assert_allclose(out, (x.numpy() * w[1]).sum(1), rtol=1e-6)
  np.testing.assert_allclose(tape.gradient(out, x), np.tile(w[1], (N, 1)),
                             rtol=1e-6)


# --- scatters with int64 indices ------------------------------------------------


@pytest.mark.parametrize("varies", [True, False], ids=["per-device", "same"])
def test_scatter_nd_with_int64_indices(varies):
  x = data(N, 4)

  def f(x):
    if varies:
      indices = tf.reshape(tf.argmax(x, output_type=tf.int64), [1, 1])
    else:
      indices = tf.constant([[0], [3]], tf.int64)
    updates = tf.ones([tf.shape(indices)[0]])
    return x + tf.scatter_nd(indices, updates, tf.constant([4], tf.int64))

  expected = x.copy()
  for device in range(N):
    for index in ([x[device].argmax()] if varies else [0, 3]):
      expected[device, index] += 1
  np.testing.assert_allclose(tfspmd.pmap(f, "i")(x), expected, rtol=1e-6)


@pytest.mark.parametrize("op", ["update", "add", "max"])
def test_tensor_scatter_with_int64_indices_on_per_device_values(op):
  x = data(N, 4)
  indices = np.array([[1], [2]], np.int64)
  updates = np.array([5.0, -5.0], np.float32)
  scatter = {"update": tf.tensor_scatter_nd_update,
             "add": tf.tensor_scatter_nd_add,
             "max": tf.tensor_scatter_nd_max}[op]
  out = tfspmd.pmap(lambda v: scatter(v, indices, updates), "i")(x)
  expected = x.copy()
  for row, value in zip(indices[:, 0], updates):
    if op == "update":
      expected[:, row] = value
    elif op == "add":
      expected[:, row] += value
    else:
      expected[:, row] = np.maximum(expected[:, row], value)
  np.testing.assert_allclose(out, expected, rtol=1e-6)
