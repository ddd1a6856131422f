"""A two-layer MLP split over a 2-D mesh: data x model parallel.

Nested pmaps make a 2 x 4 mesh with axes ('data', 'model'). The batch is
split over 'data'; the hidden layer is split over 'model' as in Megatron-LM:
  - layer 1 is column-parallel: device j of 'model' holds the columns
    W1[:, j] and computes its slice of the hidden units, relu(x @ W1[:, j]);
  - layer 2 is row-parallel: it holds the rows W2[j, :] and computes a
    partial product h_j @ W2[j, :] that must be summed over 'model';
    `psum_scatter` sums it and leaves each device its slice of the output
    features, and `all_gather` puts the slices together where the whole
    output is wanted.
A training step computes the loss on each device's output slice, so the
gradients of the slices' weights come back through the transposes of the
collectives (psum_scatter <-> all_gather), and averages them over 'data'.
Every number is checked against the same MLP run whole on one device.

The same model is written twice: with nested pmaps over arrays split by
hand (`split`), and with `tfspmd.shard_map` over a named mesh, which takes
the global arrays and splits them as its `PartitionSpec`s say. A
tf.function of DTensor code then calls the shard_map forward pass in the
middle of global-view ops.

Run: python examples/model_parallel.py
"""

import functools
import os

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

from tensorflow.experimental import dtensor

import tfspmd
from tfspmd import P
from tfspmd import lax
# pylint: enable=g-import-not-at-top,wrong-import-position

DATA, MODEL = 2, 4
BATCH, FEATURES, HIDDEN, OUTPUTS = 16, 6, 32, 8
LEARNING_RATE = 0.1


def problem(seed=0):
  """Inputs, targets and initial weights of the whole (unsplit) MLP."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
  t = rng.standard_normal((BATCH, OUTPUTS)).astype(np.float32)
  w1 = (rng.standard_normal((FEATURES, HIDDEN)) * 0.5).astype(np.float32)
  w2 = (rng.standard_normal((HIDDEN, OUTPUTS)) * 0.3).astype(np.float32)
  return x, t, w1, w2


def split(x, t, w1, w2):
  """The arrays as the mesh takes them: batch over 'data', W over 'model'.

  The targets are split both ways, like the output slices they are compared
  with: (data, model, rows, outputs / model).
  """
  x = x.reshape(DATA, BATCH // DATA, FEATURES)
  t = t.reshape(DATA, BATCH // DATA, MODEL, OUTPUTS // MODEL).transpose(
      0, 2, 1, 3)
  w1 = w1.reshape(FEATURES, MODEL, HIDDEN // MODEL).transpose(1, 0, 2)
  w2 = w2.reshape(MODEL, HIDDEN // MODEL, OUTPUTS)
  return x, t, w1, w2


def local_output_slice(x, w1, w2):
  """This device's output features: a column- then a row-parallel layer."""
  hidden = tf.nn.relu(x @ w1)
  partial = hidden @ w2  # this device's term of the sum over 'model'
  return lax.psum_scatter(partial, "model", scatter_dimension=1, tiled=True)


@functools.partial(tfspmd.pmap, axis_name="data", in_axes=(0, None, None))
@functools.partial(tfspmd.pmap, axis_name="model", in_axes=(None, 0, 0))
def forward(x, w1, w2):
  """The whole output on every device: (data, model, rows, outputs)."""
  return lax.all_gather(local_output_slice(x, w1, w2), "model", axis=1,
                        tiled=True)


def local_train_step(x, t, w1, w2):
  """One SGD step on the mean squared error; returns (loss, w1, w2).

  Runs on one device's blocks; `t` is its slice of the targets' output
  features.
  """
  with tf.GradientTape() as tape:
    tape.watch([w1, w2])
    y_slice = local_output_slice(x, w1, w2)
    # This slice's share of the batch mean over all outputs.
    loss = tf.reduce_sum((y_slice - t) ** 2) / (t.shape[0] * OUTPUTS)
  g1, g2 = tape.gradient(loss, [w1, w2])
  g1, g2 = lax.pmean(g1, "data"), lax.pmean(g2, "data")
  total = lax.pmean(lax.psum(loss, "model"), "data")
  return total, w1 - LEARNING_RATE * g1, w2 - LEARNING_RATE * g2


train_step = tfspmd.pmap(
    tfspmd.pmap(local_train_step, axis_name="model", in_axes=(None, 0, 0, 0),
                out_axes=(None, 0, 0)),
    axis_name="data", in_axes=(0, 0, None, None), out_axes=(None, None, None))


MESH = tfspmd.make_mesh((DATA, MODEL), ("data", "model"))


@functools.partial(
    tfspmd.shard_map, mesh=MESH,
    in_specs=(P("data", None), P(None, "model"), P("model", None)),
    out_specs=P("data", None))
def sharded_forward(x, w1, w2):
  """`forward` on the global arrays: (batch, outputs), split over 'data'."""
  return lax.all_gather(local_output_slice(x, w1, w2), "model", axis=1,
                        tiled=True)


# The targets are split like the output slices they are compared with.
sharded_train_step = tfspmd.shard_map(
    local_train_step, mesh=MESH,
    in_specs=(P("data", None), P("data", "model"), P(None, "model"),
              P("model", None)),
    out_specs=(P(), P(None, "model"), P("model", None)))


@tf.function
def dtensor_program(x, w1, w2):
  """Global-view DTensor code around the shard_map forward pass."""
  normalized = tf.math.l2_normalize(x, axis=1)
  return tf.reduce_mean(sharded_forward(normalized, w1, w2) ** 2)


def on_mesh(array, *names):
  """`array` as a DTensor on MESH, split over the mesh dimensions named."""
  dims = [dtensor.UNSHARDED if n is None else n for n in names]
  whole = dtensor.copy_to_mesh(
      tf.constant(array), dtensor.Layout.replicated(MESH.dtensor_mesh,
                                                    array.ndim))
  return dtensor.relayout(whole, dtensor.Layout(dims, MESH.dtensor_mesh))


def reference_forward(x, w1, w2):
  return tf.nn.relu(x @ w1) @ w2


def reference_train_step(x, t, w1, w2):
  w1, w2 = tf.constant(w1), tf.constant(w2)
  with tf.GradientTape() as tape:
    tape.watch([w1, w2])
    loss = tf.reduce_mean((reference_forward(x, w1, w2) - t) ** 2)
  g1, g2 = tape.gradient(loss, [w1, w2])
  return loss, w1 - LEARNING_RATE * g1, w2 - LEARNING_RATE * g2


def run(steps=5):
  """Forward and `steps` training steps both ways; returns the largest gaps."""
  x, t, w1, w2 = problem()
  xs, ts, w1s, w2s = split(x, t, w1, w2)
  out = forward(xs, w1s, w2s)
  whole = reference_forward(x, w1, w2).numpy()
  gaps = {"forward": float(np.max(np.abs(
      np.asarray(out) - whole.reshape(DATA, 1, BATCH // DATA, OUTPUTS))))}
  losses, reference_losses = [], []
  rw1, rw2 = w1, w2
  for _ in range(steps):
    loss, w1s, w2s = train_step(xs, ts, w1s, w2s)
    reference_loss, rw1, rw2 = reference_train_step(x, t, rw1, rw2)
    losses.append(float(loss))
    reference_losses.append(float(reference_loss))
  got_w1, got_w2 = np.asarray(w1s), np.asarray(w2s)
  gaps["loss"] = float(np.max(np.abs(np.subtract(losses, reference_losses))))
  gaps["weights"] = float(max(
      np.max(np.abs(got_w1 - split(x, t, rw1.numpy(), rw2.numpy())[2])),
      np.max(np.abs(got_w2 - split(x, t, rw1.numpy(), rw2.numpy())[3]))))

  gaps["shard_map forward"] = float(np.max(np.abs(
      np.asarray(sharded_forward(x, w1, w2)) - whole)))
  sw1, sw2 = w1, w2
  for _ in range(steps):
    sharded_loss, sw1, sw2 = sharded_train_step(x, t, sw1, sw2)
  gaps["shard_map loss"] = abs(float(sharded_loss) - reference_losses[-1])
  gaps["shard_map weights"] = float(max(
      np.max(np.abs(np.asarray(sw1) - rw1.numpy())),
      np.max(np.abs(np.asarray(sw2) - rw2.numpy()))))

  in_dtensor = dtensor_program(on_mesh(x, "data", None),
                               on_mesh(w1, None, "model"),
                               on_mesh(w2, "model", None))
  normalized = x / np.linalg.norm(x, axis=1, keepdims=True)
  expected = np.mean(reference_forward(normalized, w1, w2).numpy() ** 2)
  gaps["DTensor program"] = abs(
      float(dtensor.unpack(in_dtensor)[0]) - float(expected))
  return dict(output=out, losses=losses, reference_losses=reference_losses,
              gaps=gaps)


def main():
  result = run()
  print(f"mesh ('data', 'model') = {DATA} x {MODEL}; output "
        f"{tuple(result['output'].shape)} on devices "
        f"{[d.id for d in result['output'].devices()]}")
  print("losses (2 x 4 mesh):", np.round(result["losses"], 6))
  print("losses (one device):", np.round(result["reference_losses"], 6))
  print("largest differences from one device:",
        {k: f"{v:.1e}" for k, v in result["gaps"].items()})


if __name__ == "__main__":
  main()
