"""Values laid out over a mesh of several axes meet as a real program's do.

On a mesh of several axes, a gathered value, a transposed one and one over
an axis of size 1 could each reach an op laid out differently from the
other operands (DTensor refuses an einsum whose label lies split over two
mesh dimensions, and a transpose whose operand and result disagree). These
programs are the shapes of a transformer layer's attention with fully
sharded weights on a ('dp', 'fsdp', 'tp', 'sp') mesh; each is checked
against NumPy in float64.
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfspmd
from tfspmd import P
from tfspmd import lax

AXES = ("dp", "fsdp", "tp", "sp")
BATCH = P(("dp", "fsdp"), None, ("tp", "sp"))


def mesh():
  return tfspmd.make_mesh((1, 2, 1, 4), AXES)


def test_values_gathered_over_different_axes_meet_in_an_einsum():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 3, 16)).astype(np.float32)  # B/d L M/t
  w = rng.standard_normal((16, 8)).astype(np.float32)     # M/d F/t

  def layer(x, w):
    gathered_x = lax.all_gather(x, ("tp", "sp"), axis=2, tiled=True)
    gathered_w = lax.all_gather(w, ("dp", "fsdp"), axis=0, tiled=True)
    return tf.einsum("blm,mf->blf", gathered_x, gathered_w)

  out = tfspmd.shard_map(layer, mesh=mesh(),
                         in_specs=(BATCH, P(("dp", "fsdp"), ("tp", "sp"))),
                         out_specs=BATCH)(x, w)
  np.testing.assert_allclose(np.asarray(out), np.einsum("blm,mf->blf", x, w),
                             rtol=1e-5, atol=1e-5)


def numpy_attention_loss(nx, w):
  """sum(out**2) of one attention step, heads k, keys y, queries x."""
  k, v = np.einsum("blm,cmkd->cblkd", nx, w)
  half = k.shape[-1] // 2
  k = np.concatenate([k[..., half:], k[..., :half]], axis=-1)
  logits = np.einsum("bxkd,bykd->bxyk", k, k)
  probs = np.exp(logits - logits.max(axis=2, keepdims=True))
  probs /= probs.sum(axis=2, keepdims=True)
  out = np.einsum("bxyk,bykd->bxkd", probs, v)
  out = out / (1 + np.exp(-out)) * out  # silu(out) * out
  return (out ** 2).sum()


def test_attention_gradient_with_weights_gathered_over_fsdp():
  rng = np.random.default_rng(1)
  nx = (rng.standard_normal((4, 8, 16)) / 4).astype(np.float32)
  w = (rng.standard_normal((2, 16, 4, 6)) / 4).astype(np.float32)

  def gradient(nx, w):
    with tf.GradientTape() as tape:
      tape.watch(w)
      gathered = lax.all_gather(w, ("dp", "fsdp"), axis=1, tiled=True)
      k, v = tf.unstack(tf.einsum("blm,cmkd->cblkd", nx, gathered))
      first, second = tf.split(k, 2, axis=-1)
      k = tf.concat([second, first], axis=-1)
      logits = tf.einsum("bxkd,bykd->bxyk", k, k)
      out = tf.einsum("bxyk,bykd->bxkd", tf.nn.softmax(logits, axis=2), v)
      loss = tf.reduce_sum(tf.square(tf.nn.silu(out) * out))
    return tape.gradient(loss, w), lax.psum(loss, AXES)

  spec = P(None, ("dp", "fsdp"), ("tp", "sp"))
  grad, loss = tfspmd.shard_map(
      gradient, mesh=mesh(), in_specs=(P(("dp", "fsdp")), spec),
      out_specs=(spec, P()))(nx, w)
  nx64, w64 = nx.astype(np.float64), w.astype(np.float64)
  np.testing.assert_allclose(float(np.asarray(loss)),
                             numpy_attention_loss(nx64, w64), rtol=1e-5)
  # Each head's loss depends on its own block of w, and each batch block's
  # on all of w gathered: the blocks' gradients form the whole loss's.
  eps = 1e-6
  for seed in range(3):
    direction = np.random.default_rng(10 + seed).standard_normal(w.shape)
    numeric = (numpy_attention_loss(nx64, w64 + eps * direction) -
               numpy_attention_loss(nx64, w64 - eps * direction)) / (2 * eps)
    np.testing.assert_allclose((np.asarray(grad) * direction).sum(), numeric,
                               rtol=1e-4)


def test_softmax_of_a_rank_3_block_on_four_axes_and_its_gradient():
  # Softmax's CPU kernel takes rank 5; a block on four axes is rank 7, and
  # merged to [rows, last] still rank 6.
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((8, 6, 8)).astype(np.float32)
  weights = np.arange(8, dtype=np.float32)

  def probabilities(block):
    with tf.GradientTape() as tape:
      tape.watch(block)
      probs = tf.nn.softmax(block)
      loss = tf.reduce_sum(probs * weights)
    return probs, tf.nn.log_softmax(block), tape.gradient(loss, block)

  spec = P(AXES)
  probs, log_probs, grad = tfspmd.shard_map(
      probabilities, mesh=mesh(), in_specs=spec,
      out_specs=(spec, spec, spec))(logits)
  shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
  expected = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(probs), expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(log_probs), np.log(expected),
                             rtol=1e-5, atol=1e-6)
  mean = (expected * weights).sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(grad), expected * (weights - mean),
                             rtol=1e-5, atol=1e-6)


def test_a_result_over_an_axis_of_size_1_keeps_its_spec():
  x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  out = tfspmd.shard_map(lambda b: b * 2, mesh=mesh(),
                         in_specs=P(("dp", "fsdp", "sp"), "tp"),
                         out_specs=P(("dp", "fsdp", "sp"), "tp"))(x)
  np.testing.assert_array_equal(np.asarray(out), x * 2)
  assert out.sharding.spec == P(("dp", "fsdp", "sp"), "tp")
  # Split over the size-1 axis 'tp' is whole on every device.
  assert out.layout.sharding_specs[1] == dtensor.UNSHARDED


def test_a_dtensor_split_over_an_axis_of_size_1_goes_in_as_it_is():
  # A user's DTensor laid out on the mesh's own DTensor mesh, its rows
  # split over 'fsdp' and its columns over 'dp' (size 1).
  x = np.arange(24.0, dtype=np.float32).reshape(4, 6)
  given = dtensor.Layout(["fsdp", "dp"], mesh().dtensor_mesh)
  value = dtensor.relayout(
      dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh().dtensor_mesh,
                                                        2)), given)
  def plus_dp_index(block):
    return block + tf.cast(lax.axis_index("dp"), block.dtype)

  out = tfspmd.shard_map(plus_dp_index, mesh=mesh(), in_specs=P("fsdp", "dp"),
                         out_specs=P("fsdp", "dp"))(value)
  np.testing.assert_array_equal(np.asarray(out), x)
  assert out.sharding.spec == P("fsdp", "dp")


def test_data_parallel_gradients_of_rows_split_over_two_axes():
  # A dense layer's weight and bias gradients, averaged over a batch split
  # over both axes of a 2 x 4 mesh: JAX's P(('data', 'model')) batch.
  two_axes = tfspmd.make_mesh((2, 4), ("data", "model"))
  rng = np.random.default_rng(3)
  x = rng.standard_normal((8, 2, 4)).astype(np.float32)
  w = rng.standard_normal((4, 3)).astype(np.float32)
  b = rng.standard_normal(3).astype(np.float32)

  def gradients(w, b, x):
    rows = tf.reshape(x, [-1, 4])
    with tf.GradientTape() as tape:
      tape.watch([w, b])
      y = rows @ w + b
      loss = tf.reduce_mean(y * y)
    return lax.pmean(tape.gradient(loss, [w, b]), ("data", "model"))

  grad_w, grad_b = tfspmd.shard_map(
      gradients, mesh=two_axes, in_specs=(P(), P(), P(("data", "model"))),
      out_specs=P())(w, b, x)
  rows = x.astype(np.float64).reshape(8, 2, 4)
  y = rows @ w + b
  np.testing.assert_allclose(
      np.asarray(grad_w), np.mean([r.T @ d for r, d in zip(rows, y / 3)],
                                  axis=0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(grad_b), (y / 3).sum(1).mean(0),
                             rtol=1e-5, atol=1e-6)
