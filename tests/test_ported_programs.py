"""Public jax.pmap / shard_map programs, ported to tfspmd, against JAX's numbers.

Each test ports one program line by line (tf ops for jnp, tfspmd.lax for
jax.lax, the same collectives, loops and specs) and runs it on the inputs
the JAX original was run on (JAX 0.10.2, 8 CPU devices, in its own process).
The expected values come from NumPy code of the same math; the numbers
JAX printed are quoted in comments, and the NumPy references reproduce them.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax

# The MLP of the shard_map tutorial, "Neural networks" section.
LAYER_SIZES = (784, 128, 128, 128, 128, 128, 8)


def mlp_data():
  rng = np.random.default_rng(0)
  params = []
  for n_in, n_out in zip(LAYER_SIZES[:-1], LAYER_SIZES[1:]):
    w = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
    b = rng.standard_normal((n_out,)).astype(np.float32)
    params.append((w, b))
  inputs = rng.standard_normal((32, LAYER_SIZES[0])).astype(np.float32)
  targets = rng.standard_normal((32, LAYER_SIZES[-1])).astype(np.float32)
  return params, (inputs, targets)


def numpy_loss_and_grads(params, batch):
  """The tutorial's `loss` and its gradient, by hand in float64."""
  inputs, targets = (np.asarray(x, np.float64) for x in batch)
  activations, pre = [inputs], []
  for w, b in params:
    pre.append(activations[-1] @ w + b)
    activations.append(np.maximum(pre[-1], 0))
  predictions = pre[-1]
  loss = np.mean(np.sum((predictions - targets) ** 2, axis=-1))
  delta = 2 * (predictions - targets) / len(inputs)
  grads = []
  for layer in reversed(range(len(params))):
    grads.append((activations[layer].T @ delta, delta.sum(0)))
    delta = (delta @ params[layer][0].T) * (pre[layer - 1] > 0) if layer else None
  return loss, grads[::-1]


def variables(params):
  return [tuple(tf.Variable(x) for x in layer) for layer in params]


def check_against_numpy(loss, grads, params, batch):
  want_loss, want_grads = numpy_loss_and_grads(params, batch)
  np.testing.assert_allclose(float(np.asarray(loss)), want_loss, rtol=1e-5)
  for got, want in zip(tf.nest.flatten(grads), tf.nest.flatten(want_grads)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3, atol=2e-5)


def test_numpy_reference_reproduces_jax_loss_and_gradient_sums():
  # JAX printed jax.jit(loss) 14.112876892089844 and these gradient sums
  # (W, b per layer) for the same data.
  jax_grad_sums = [5.754343473304743, -0.19439829559996724,
                   -11.981515327639713, -0.19086798693751916,
                   278.99066613506113, 3.385805993399117, 194.64149116842373,
                   2.812255665427074, 459.20235789003686, 6.128950542770326,
                   -287.07144649226393, -3.3649147674441338]
  params, batch = mlp_data()
  loss, grads = numpy_loss_and_grads(params, batch)
  np.testing.assert_allclose(loss, 14.112876892089844, rtol=1e-6)
  np.testing.assert_allclose([g.sum() for g in tf.nest.flatten(grads)],
                             jax_grad_sums, rtol=1e-5, atol=1e-5)


@pytest.mark.xfail(strict=True, reason=(
    "wrong gradient: the weight gradients of the first five layers (each "
    "all_gather'ed inside the shard_map, under a tape around it) are wrong "
    "element by element, though their sums and the loss, the biases and the "
    "last layer's weights are right (max difference from JAX 5.48)"))
def test_fsdp_loss_and_gradient():
  """jax-ml/jax docs/notebooks/shard_map.md, "8-way fully sharded data
  parallelism (FSDP)": predict_fsdp / loss_fsdp on a 4-device 'batch' mesh,
  all_gather of each parameter block, pmean of the loss, jax.grad.

  The jax.remat (re-gather on the backward pass) is left out: it changes
  memory, not values. JAX printed loss 14.112878799438477, gradient sums
  [5.7543464, -0.1943981, -11.9815177, ..., -287.0714315, -3.3649144].
  """
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()[:4]), ("batch",))

  def predict_fsdp(params_frag, inputs):
    for w_frag, b_frag in params_frag:
      w = lax.all_gather(w_frag, "batch", tiled=True)
      b = lax.all_gather(b_frag, "batch", tiled=True)
      outputs = inputs @ w + b
      inputs = tf.nn.relu(outputs)
    return outputs

  def loss_block(local_params, local_batch):
    inputs, targets = local_batch
    predictions = predict_fsdp(local_params, inputs)
    local_loss = tf.reduce_mean(
        tf.reduce_sum((predictions - targets) ** 2, axis=-1))
    return lax.pmean(local_loss, "batch")

  loss_fsdp = tfspmd.shard_map(loss_block, mesh=mesh,
                               in_specs=(P("batch"), P("batch")),
                               out_specs=P())
  params, batch = mlp_data()
  weights = variables(params)
  with tf.GradientTape() as tape:
    loss = tf.convert_to_tensor(loss_fsdp(weights, batch))
  check_against_numpy(loss, tape.gradient(loss, weights), params, batch)


def test_tensor_parallel_loss_and_gradient():
  """jax-ml/jax docs/notebooks/shard_map.md, "8-way tensor parallelism
  (TP)": gemm_tp (a shard_map with psum_scatter over 'feats') called per
  layer from predict_tp, the loss outside, jax.grad through all of it.

  JAX printed loss 14.11287784576416, gradient sums [5.7543488,
  -0.1943980, -11.9815102, ..., -287.0714292, -3.3649143].
  """
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()), ("feats",))

  def gemm_block(inputs, w, b):
    block_result = inputs @ w
    return lax.psum_scatter(block_result, "feats", scatter_dimension=1,
                            tiled=True) + b

  gemm_tp = tfspmd.shard_map(
      gemm_block, mesh=mesh,
      in_specs=(P(None, "feats"), P("feats", None), P("feats")),
      out_specs=P(None, "feats"))

  def predict_tp(params, inputs):
    for w, b in params:
      outputs = tf.convert_to_tensor(gemm_tp(inputs, w, b))
      inputs = tf.nn.relu(outputs)
    return outputs

  def loss_tp(params, batch):
    inputs, targets = batch
    predictions = predict_tp(params, inputs)
    return tf.reduce_mean(tf.reduce_sum((predictions - targets) ** 2, axis=-1))

  params, batch = mlp_data()
  weights = variables(params)
  with tf.GradientTape() as tape:
    loss = loss_tp(weights, batch)
  check_against_numpy(loss, tape.gradient(loss, weights), params, batch)


@pytest.mark.xfail(strict=True, reason=(
    "DTensor at run time: 'TransposeOp SPMD needs communication is not "
    "supported yet' for all_gather over 'batch' -> matmul -> psum_scatter "
    "over 'feats' on a 4 x 2 mesh"))
def test_fsdp_with_tensor_parallel_loss():
  """jax-ml/jax docs/notebooks/shard_map.md, "FSDP + TP, with shard_map at
  the top level": a ('batch', 'feats') = (4, 2) mesh, params split over
  ('feats', 'batch'). JAX printed loss 14.112876892089844."""
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(4, 2),
                     ("batch", "feats"))

  def predict_fsdp_tp(params_frag, inputs):
    for w_frag, b_frag in params_frag:
      w = lax.all_gather(w_frag, "batch", tiled=True)
      b = lax.all_gather(b_frag, "batch", tiled=True)
      block_result = inputs @ w
      outputs = lax.psum_scatter(block_result, "feats", scatter_dimension=1,
                                 tiled=True) + b
      inputs = tf.nn.relu(outputs)
    return outputs

  def loss_block(local_params, local_batch):
    inputs, targets = local_batch
    predictions = predict_fsdp_tp(local_params, inputs)
    sq_err = lax.psum(tf.reduce_sum((predictions - targets) ** 2, axis=-1),
                      "feats")
    return lax.pmean(tf.reduce_mean(sq_err), "batch")

  loss_fsdp_tp = tfspmd.shard_map(
      loss_block, mesh=mesh,
      in_specs=(P(("feats", "batch")), P("batch", "feats")), out_specs=P())
  params, batch = mlp_data()
  want, _ = numpy_loss_and_grads(params, batch)
  np.testing.assert_allclose(float(np.asarray(loss_fsdp_tp(params, batch))),
                             want, rtol=1e-5)


def test_gpipe_spmd_pipeline_loss_and_gradient():
  """jax-ml/jax docs/notebooks/shard_map.md, "SPMD pipeline parallelism
  (PP)": spmd_pipeline and shift (ppermute of the stage state, inputs and
  outputs) on a 2-device 'stages' mesh, S=2, B=8, 4 inner layers.

  JAX printed loss 14.11287784576416; jax.grad gave the plain gradient for
  the first and last layers and the inner biases, and for the stacked inner
  weights the first layer's gradient and NaN everywhere in the other three
  (the NaN that initializes the state reaches them as NaN * 0).
  """
  n_inner, features, stages, micro = 4, 128, 2, 8
  microbatches = 32 // micro
  per_stage = microbatches // stages
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()[:stages]), ("stages",))

  def set_row(x, i, row):
    return tf.tensor_scatter_nd_update(x, [[i]], row[None])

  def spmd_pipeline(fn, stage_params, inputs):
    stage = lax.axis_index("stages")
    outputs = tf.zeros_like(inputs) * np.nan
    state = tf.zeros((n_inner // stages, micro, features)) * np.nan
    for i in range(microbatches + n_inner - 1):
      state = set_row(state, 0,
                      tf.where(stage == 0, inputs[i % per_stage], state[0]))
      state = tfspmd.vmap(fn)(stage_params, state)
      j = (i - n_inner + 1) % per_stage
      outputs = set_row(outputs, j,
                        tf.where(stage == stages - 1, state[-1], outputs[j]))
      state, inputs, outputs = shift(i, state, inputs, outputs)
    return lax.ppermute(outputs, "stages",
                        [(i, (i + 1) % stages) for i in range(stages)])

  def shift(i, state, inputs, outputs):
    def sh(x, d):
      return lax.ppermute(x, "stages",
                          [(k, (k + d) % stages) for k in range(stages)])
    state = set_row(tf.roll(state, +1, axis=0), 0, sh(state[-1], +1))
    if (i % per_stage) == (-1 % per_stage):
      inputs = sh(inputs, +1)
    if ((i - n_inner + 1) % per_stage) == (-1 % per_stage):
      outputs = sh(outputs, +1)
    return state, inputs, outputs

  def predict_pp(params, inputs):
    (w_first, b_first), inner_params, (w_last, b_last) = params
    inputs = tf.nn.relu(inputs @ w_first + b_first)
    inputs = spmd_pipeline(lambda wb, x: tf.nn.relu(x @ wb[0] + wb[1]),
                           inner_params, inputs)
    return inputs @ w_last + b_last

  def loss_block(params, batch):
    inputs, targets = batch
    predictions = tf.reshape(
        predict_pp(params, tf.reshape(inputs, [per_stage, micro, -1])),
        [per_stage * micro, -1])
    local_loss = tf.reduce_mean(
        tf.reduce_sum((predictions - targets) ** 2, axis=-1))
    return lax.pmean(local_loss, "stages")

  loss_pp = tfspmd.shard_map(
      loss_block, mesh=mesh,
      in_specs=((P(), P("stages"), P()), P("stages")), out_specs=P())
  params, batch = mlp_data()
  first, *inner, last = params
  ws, bs = zip(*inner)
  weights = (tuple(map(tf.Variable, first)),
             (tf.Variable(np.stack(ws)), tf.Variable(np.stack(bs))),
             tuple(map(tf.Variable, last)))
  with tf.GradientTape() as tape:
    loss = tf.convert_to_tensor(loss_pp(weights, batch))
  grads = tape.gradient(loss, weights)
  want_loss, want = numpy_loss_and_grads(params, batch)
  np.testing.assert_allclose(float(np.asarray(loss)), want_loss, rtol=1e-5)
  for got, expected in [(grads[0], want[0]), (grads[2], want[-1])]:
    for g, e in zip(got, expected):
      np.testing.assert_allclose(np.asarray(g), e, rtol=2e-3, atol=2e-5)
  np.testing.assert_allclose(np.asarray(grads[1][1]),
                             np.stack([g[1] for g in want[1:-1]]),
                             rtol=2e-3, atol=2e-5)
  inner_w = np.asarray(grads[1][0])
  np.testing.assert_allclose(inner_w[0], want[1][0], rtol=2e-3, atol=2e-5)
  assert np.isnan(inner_w[1:]).all()
