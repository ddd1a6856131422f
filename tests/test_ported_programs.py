"""Public jax.pmap / shard_map programs, ported to tfspmd, against JAX's numbers.

Each test ports one program line by line (tf ops for jnp, tfspmd.lax for
jax.lax, the same collectives, loops and specs) and runs it on the inputs
the JAX original was run on (JAX 0.10.2, 8 CPU devices, in its own process).
The expected values come from NumPy code of the same math; the numbers
JAX printed are quoted in comments, and the NumPy references reproduce them.
"""

import functools
from typing import NamedTuple

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


def dynamic_slice_in_dim(operand, start_index, slice_size, axis=0):
  """`jax.lax.dynamic_slice_in_dim`: `start_index` may differ per device."""
  begin = [0] * operand.shape.rank
  size = [-1] * operand.shape.rank
  begin[axis] = start_index
  size[axis] = slice_size
  return tf.slice(operand, tf.stack(begin), size)


# The linear regression of JAX's pmap tutorial, "Example" section.
class Params(NamedTuple):
  weight: tf.Tensor
  bias: tf.Tensor


LEARNING_RATE = 0.005


def regression_data():
  rng = np.random.default_rng(1)
  xs = rng.normal(size=(128, 1)).astype(np.float32)
  noise = 0.5 * rng.normal(size=(128, 1)).astype(np.float32)
  return xs, xs * 2 - 1 + noise


def numpy_regression(xs, ys, steps):
  """Full-batch gradient descent on the mean squared error, in float64."""
  xs, ys = np.float64(xs), np.float64(ys)
  weight, bias, losses = 0.3, -0.2, []
  for _ in range(steps):
    error = weight * xs + bias - ys
    losses.append(np.mean(error ** 2))
    weight, bias = (weight - LEARNING_RATE * np.mean(2 * error * xs),
                    bias - LEARNING_RATE * np.mean(2 * error))
  return np.array(losses), weight, bias


def test_data_parallel_training_loop():
  """jax-ml/jax docs/jax-101/06-parallelism.md, "Example": `update` under
  pmap over 'num_devices' (value_and_grad of the mean squared error, pmean
  of the gradients and of the loss, SGD step), params replicated and the
  128 examples split over 8 devices, 1000 steps from w=0.3, b=-0.2.

  JAX printed the loss every 100 steps [3.33606, 0.699244, 0.284895,
  0.217048, 0.205500, 0.203467, 0.203099, 0.203031, 0.203018, 0.203016]
  and ended at w=1.92885, b=-1.07487.
  """
  jax_losses = [3.33606, 0.699244, 0.284895, 0.217048, 0.205500, 0.203467,
                0.203099, 0.203031, 0.203018, 0.203016]

  def loss_fn(params, xs, ys):
    pred = params.weight * xs + params.bias
    return tf.reduce_mean((pred - ys) ** 2)

  @functools.partial(tfspmd.pmap, axis_name="num_devices")
  def update(params, xs, ys):
    with tf.GradientTape() as tape:
      tape.watch(params)
      loss = loss_fn(params, xs, ys)
    grads = tape.gradient(loss, params)
    grads = lax.pmean(grads, axis_name="num_devices")
    loss = lax.pmean(loss, axis_name="num_devices")
    new_params = tf.nest.map_structure(
        lambda param, g: param - g * LEARNING_RATE, params, grads)
    return new_params, loss

  xs, ys = regression_data()
  n_devices = tfspmd.local_device_count()
  replicated_params = tf.nest.map_structure(
      lambda x: np.array([x] * n_devices),
      Params(np.float32(0.3), np.float32(-0.2)))

  def split(arr):
    return arr.reshape(n_devices, arr.shape[0] // n_devices, *arr.shape[1:])

  losses = []
  for i in range(1000):
    replicated_params, loss = update(replicated_params, split(xs), split(ys))
    if i % 100 == 0:
      losses.append(float(np.asarray(loss)[0]))
  want_losses, want_weight, want_bias = numpy_regression(xs, ys, 1000)
  np.testing.assert_allclose(want_losses[::100], jax_losses, rtol=2e-5)
  np.testing.assert_allclose([want_weight, want_bias], [1.92885, -1.07487],
                             rtol=2e-5)
  np.testing.assert_allclose(losses, want_losses[::100], rtol=1e-5)
  weight, bias = (np.asarray(p) for p in replicated_params)
  np.testing.assert_array_equal(weight, weight[0])  # the copies stay equal
  np.testing.assert_allclose([weight[0], bias[0]], [want_weight, want_bias],
                             rtol=1e-5)


def test_collective_matmul_psum_scatter_bidirectional():
  """jax-ml/jax docs/notebooks/shard_map.md, "Example 2: psum_scatter the
  result": matmul_psumscatter_overlapped_bidi, lhs split over its columns
  and rhs over its rows on a 4-device 'i' mesh, half blocks of each
  device's partial product sent both ways round the ring by ppermute.

  JAX printed (lhs 16 x 8, rhs 8 x 4 from default_rng(2)) sum 13.083048
  and row 5 [2.49794, 0.0149447, 1.01393, -0.894147].
  """
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()[:4]), ("i",))
  lhs_spec = P(None, "i")
  rhs_spec = P("i", None)

  @functools.partial(tfspmd.shard_map, mesh=mesh,
                     in_specs=(lhs_spec, rhs_spec), out_specs=rhs_spec)
  def matmul_psumscatter_overlapped_bidi(lhs_block, rhs_block):
    size = lax.axis_size("i")
    idx = lax.axis_index("i")
    shift_up = functools.partial(
        lax.ppermute, axis_name="i",
        perm=[(i, (i + 1) % size) for i in range(size)])
    shift_dn = functools.partial(
        lax.ppermute, axis_name="i",
        perm=[(i, (i - 1) % size) for i in range(size)])

    B = lhs_block.shape[0] // size // 2  # pylint: disable=invalid-name
    lhs_blocks = lambda i, hi: dynamic_slice_in_dim(
        lhs_block, (2 * i + hi) * B, B, 0)

    out_summand_lo = lhs_blocks((idx - 1) % size, 0) @ rhs_block
    out_summand_hi = lhs_blocks((idx + 1) % size, 1) @ rhs_block
    for i in range(1, size):
      out_summand_lo = shift_up(out_summand_lo)
      out_summand_hi = shift_dn(out_summand_hi)
      out_summand_lo += lhs_blocks((idx - i - 1) % size, 0) @ rhs_block
      out_summand_hi += lhs_blocks((idx + i + 1) % size, 1) @ rhs_block
    return tf.concat([out_summand_lo, out_summand_hi], 0)

  rng = np.random.default_rng(2)
  lhs = rng.standard_normal((16, 8)).astype(np.float32)
  rhs = rng.standard_normal((8, 4)).astype(np.float32)
  want = np.float64(lhs) @ rhs
  np.testing.assert_allclose(want.sum(), 13.083048, rtol=1e-6)
  np.testing.assert_allclose(want[5], [2.49794, 0.0149447, 1.01393, -0.894147],
                             rtol=1e-5)
  out = np.asarray(matmul_psumscatter_overlapped_bidi(lhs, rhs))
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


# The expert-parallel MoE: E experts, hidden size H, top-K routing of NT
# tokens, CAPACITY (token, k) pairs per expert from each device.
E, H, K, NT, CAPACITY, PAD_VALUE = 8, 4, 2, 64, 4, -1000.


def moe_data():
  rng = np.random.default_rng(3)
  tokens = rng.standard_normal((NT, H)).astype(np.float32)
  router = rng.standard_normal((H, E)).astype(np.float32)
  experts = rng.standard_normal((E, 1)).astype(np.float32)
  weights_out = rng.standard_normal((NT, H)).astype(np.float32)
  return tokens, router, experts, weights_out


def numpy_moe(tokens, router, experts, weights_out, devices=8):
  """The MoE's outputs, loss and gradients, with its capacity cut, in float64.

  Device d holds (token, k) pairs [d * m, (d + 1) * m). Sorted by expert,
  each expert keeps its first CAPACITY; the kept pairs come back in that
  order and are written over the sorted positions from the first, so after
  a cut a pair gets a later pair's value and the last pairs get padding.
  """
  tokens, router, experts, weights_out = (
      np.asarray(a, np.float64) for a in (tokens, router, experts,
                                           weights_out))
  logits = tokens @ router
  indices = np.argsort(-logits, axis=1, kind="stable")[:, :K]
  top = np.take_along_axis(logits, indices, 1)
  gates = np.exp(top - top.max(1, keepdims=True))
  gates /= gates.sum(1, keepdims=True)
  pairs = indices.reshape(-1)
  per_device = len(pairs) // devices
  source = np.full(len(pairs), -1)  # the pair whose value each pair gets
  for d in range(devices):
    mine = np.arange(d * per_device, (d + 1) * per_device)
    by_expert = mine[np.argsort(pairs[mine], kind="stable")]
    kept = [p for e in range(E)
            for p in by_expert[pairs[by_expert] == e][:CAPACITY]]
    source[by_expert[:len(kept)]] = kept
  served = source >= 0
  out = np.full((len(pairs), H), PAD_VALUE)
  out[served] = tokens[source[served] // K] + experts[pairs[source[served]]]
  out = out.reshape(NT, K, H)
  y = np.sum(gates[..., None] * out, axis=1)
  loss = np.sum(y * weights_out)
  d_out = (gates[..., None] * weights_out[:, None]).reshape(-1, H)
  d_gates = np.sum(out * weights_out[:, None], axis=-1)
  d_top = gates * (d_gates - np.sum(gates * d_gates, 1, keepdims=True))
  d_logits = np.zeros_like(logits)
  np.put_along_axis(d_logits, indices, d_top, 1)
  d_tokens = d_logits @ router.T
  np.add.at(d_tokens, source[served] // K, d_out[served])
  d_experts = np.zeros((E, 1))
  np.add.at(d_experts[:, 0], pairs[source[served]], d_out[served].sum(-1))
  return y, loss, (d_tokens, tokens.T @ d_logits, d_experts), np.sum(~served)


def test_expert_parallel_moe_with_capacity_cut_and_gradient():
  """The expert-parallel MoE of a public JAX test file (its unittest class
  TestMoe, on 12 CPU devices: `_func` of test_compute_ragged_all_to_all_info,
  with the top-k routing of `_ragged_all_to_all_moe`): in a shard_map over an ('x', 'y') mesh, each
  device sorts its (token, k) pairs by expert, cuts each expert's run to
  the capacity (padding with -1000), all_to_all's them over 'y' to the
  devices of their experts (each adds its expert's parameter) and back,
  and unsorts them; the gates weight the K results; jax.grad of a weighted
  sum. Here on a (2, 4) mesh with 8 experts, 64 tokens of 4 features,
  top-2, and a capacity per device of half its pairs (4 per expert): 5
  pairs are cut (3 experts overflow on some device).

  JAX printed y sum -10333.16388956923, loss -3243.915771484375, gradient
  sums (tokens, router, experts) 1149.9763295683078, -0.0001156926,
  15.932575106620789, the experts' gradient [1.9078646, 7.1779919,
  0.3119745, -0.7332257, 3.7317429, -0.7510149, 0.5813282, 3.7059138],
  and 5 rows of y holding padding.
  """
  jax_experts_grad = [1.9078646, 7.1779919, 0.3119745, -0.7332257,
                      3.7317429, -0.7510149, 0.5813282, 3.7059138]
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(2, 4), ("x", "y"))
  capacity_per_device = NT * K // 8 // 2
  expert_capacity_per_expert = capacity_per_device * 4 // E
  assert expert_capacity_per_expert == CAPACITY

  @functools.partial(
      tfspmd.shard_map, mesh=mesh,
      in_specs=(P(("x", "y")), P(("x", "y")), P("y")),
      out_specs=P(("x", "y")))
  def _func(local_tokens, local_expert_indices, local_expert_param):
    sorter = tf.argsort(local_expert_indices, stable=True)
    unsorter = tf.argsort(sorter, stable=True)
    sorted_local_tokens = tf.gather(local_tokens, sorter)
    sorted_expert_indices = tf.gather(local_expert_indices, sorter)
    num_tokens, hidden_dim = local_tokens.shape
    all_expert_indices = tf.range(E)
    expert_start_offsets = tf.searchsorted(sorted_expert_indices,
                                           all_expert_indices)
    num_tokens_send_to_each_expert = tf.concat(
        [expert_start_offsets[1:], [num_tokens]], 0) - expert_start_offsets
    padded_sorted_local_tokens = tf.pad(
        sorted_local_tokens, [[0, expert_capacity_per_expert], [0, 0]])

    def _slice_tokens(expert_idx):
      offset = expert_start_offsets[expert_idx]
      tokens = dynamic_slice_in_dim(padded_sorted_local_tokens, offset,
                                    expert_capacity_per_expert, 0)
      size = num_tokens_send_to_each_expert[expert_idx]
      mask = tf.where(tf.range(expert_capacity_per_expert) < size, 1., 0.)
      return (mask[..., None] * tokens) + (1 - mask[..., None]) * (
          tf.broadcast_to(PAD_VALUE, tokens.shape))

    tokens_to_send = tfspmd.vmap(_slice_tokens)(all_expert_indices)
    tokens_to_me = lax.all_to_all(tokens_to_send, axis_name="y",
                                  split_axis=0, concat_axis=1, tiled=True)
    num_local_experts = local_expert_param.shape[0]
    mask = tokens_to_me != PAD_VALUE
    applied_tokens = tokens_to_me + tf.reshape(
        local_expert_param, [num_local_experts, 1, 1])
    applied_tokens = tf.where(mask, applied_tokens, PAD_VALUE)
    applied_tokens = lax.all_to_all(applied_tokens, axis_name="y",
                                    split_axis=1, concat_axis=0, tiled=True)
    applied_tokens = tf.reshape(applied_tokens, [-1, hidden_dim])
    discard_padding_sorter = tf.argsort(
        tf.where(applied_tokens[..., 0] != PAD_VALUE, 0, 1), stable=True)
    result = tf.gather(applied_tokens, discard_padding_sorter)[:num_tokens]
    return tf.gather(result, unsorter)

  def moe(tokens, router, experts):
    routing_weights = tokens @ router
    expert_weights, expert_indices = tf.math.top_k(routing_weights, k=K)
    expert_weights = tf.nn.softmax(expert_weights, axis=-1)
    duplicated = tf.reshape(
        tf.broadcast_to(tokens[:, None], (NT, K, H)), [-1, H])
    out = tf.reshape(
        tf.convert_to_tensor(
            _func(duplicated, tf.reshape(expert_indices, [-1]), experts)),
        [NT, K, H])
    return tf.reduce_sum(expert_weights[..., None] * out, axis=1)

  tokens, router, experts, weights_out = moe_data()
  want_y, want_loss, want_grads, cut = numpy_moe(tokens, router, experts,
                                                 weights_out)
  assert cut == 5
  np.testing.assert_allclose(want_y.sum(), -10333.16388956923, rtol=1e-7)
  np.testing.assert_allclose(want_loss, -3243.915771484375, rtol=1e-7)
  np.testing.assert_allclose([g.sum() for g in want_grads],
                             [1149.9763295683078, -0.0001156926,
                              15.932575106620789], rtol=1e-6, atol=3e-4)
  np.testing.assert_allclose(want_grads[2].ravel(), jax_experts_grad,
                             rtol=1e-6)
  assert np.sum((want_y < -100).any(-1)) == 5

  variables = [tf.Variable(a) for a in (tokens, router, experts)]
  with tf.GradientTape() as tape:
    y = moe(*variables)
    loss = tf.reduce_sum(y * weights_out)
  grads = tape.gradient(loss, variables)
  np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)
