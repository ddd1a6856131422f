"""TensorFlow's custom training loop, moved from MirroredStrategy to tfspmd.

TensorFlow's tutorial "Custom training with tf.distribute.Strategy" trains a
small convolutional classifier with its own loop: a per-replica
`train_step` (loss by `tf.nn.compute_average_loss` over the global batch,
regularization by `tf.nn.scale_regularization_loss`, a Keras optimizer's
`apply_gradients`) that `strategy.run` runs on every replica inside the
user's `tf.function`. This program runs that loop both ways on the same
data, from the same weights:

- as the tutorial writes it, under `tf.distribute.MirroredStrategy` over
  the local devices;
- with tfspmd: the same per-replica step, mapped by `tfspmd.pmap` inside
  the user's own `tf.function`, and again with K steps in one call of that
  function (a `tf.range` loop around the pmap).

Inside a mapped function `tf.nn.compute_average_loss` and
`tf.nn.scale_regularization_loss` see the devices as replicas, as under the
strategy. What changes is that a mapped function computes values instead of
writing variables: the step reads the model's values
(`model.stateless_call`) and returns the gradients summed over the devices
(`tfspmd.lax.psum`, the strategy's all-reduce), and the user's
`tf.function` applies them with the Keras optimizer
(`optimizer.apply_gradients`, as in the tutorial). The last line compares
the loss curves and the weights.

The data is scikit-learn's handwritten digits (shipped with it: nothing is
downloaded), 8x8 images in global batches of 96.

Run: python examples/custom_training_loop.py [--epochs N] [--steps-per-call K]
(8 logical CPU devices unless TFSPMD_NUM_CPU_DEVICES says otherwise.)
"""

import argparse
import os

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

import keras
import tfspmd
# pylint: enable=g-import-not-at-top,wrong-import-position

GLOBAL_BATCH = 96
TRAIN_EXAMPLES = 1440  # 15 global batches


def load_digits():
  """The first 1,440 digits, as (images of 8x8x1 in [0, 1], labels)."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  digits = datasets.load_digits()
  order = np.random.default_rng(0).permutation(len(digits.data))
  images = (digits.images[order] / 16.0).astype(np.float32)[..., None]
  labels = digits.target[order].astype(np.int64)
  return images[:TRAIN_EXAMPLES], labels[:TRAIN_EXAMPLES]


def create_model():
  """The tutorial's classifier, sized for 8x8 images."""
  return keras.Sequential([
      keras.Input((8, 8, 1)),
      keras.layers.Conv2D(16, 3, activation="relu",
                          kernel_regularizer=keras.regularizers.L2(1e-4)),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(32, activation="relu"),
      keras.layers.Dense(10),
  ])


loss_object = keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=None)


def compute_loss(labels, predictions, model_losses):
  """The tutorial's loss: the global batch's mean, plus regularization."""
  per_example_loss = loss_object(labels, predictions)
  loss = tf.nn.compute_average_loss(per_example_loss)
  if model_losses:
    loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
  return loss


def batches(images, labels, epochs):
  """The global batches, in order, epoch after epoch."""
  dataset = tf.data.Dataset.from_tensor_slices((images, labels))
  return dataset.batch(GLOBAL_BATCH).repeat(epochs)


def train_mirrored(strategy, weights, images, labels, epochs):
  """The tutorial's loop under MirroredStrategy; the loss of each step."""
  with strategy.scope():
    model = create_model()
    model.set_weights(weights)
    optimizer = keras.optimizers.Adam(1e-2)

  def train_step(inputs):
    images, labels = inputs
    with tf.GradientTape() as tape:
      predictions = model(images, training=True)
      loss = compute_loss(labels, predictions, model.losses)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss

  @tf.function
  def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses,
                           axis=None)

  replicas = strategy.num_replicas_in_sync
  losses = []
  for global_images, global_labels in batches(images, labels, epochs):
    # Replica k takes the k-th share of the global batch, as the strategy's
    # distributed datasets split it.
    shares = (np.split(global_images.numpy(), replicas),
              np.split(global_labels.numpy(), replicas))
    inputs = strategy.experimental_distribute_values_from_function(
        lambda context, shares=shares: tuple(
            tf.constant(share[context.replica_id_in_sync_group])
            for share in shares))
    losses.append(float(distributed_train_step(inputs)))
  return losses, model.get_weights()


def mapped_train_step(model):
  """The tutorial's `train_step` as one device's program, on values.

  It returns the gradients summed over the devices (as the strategy's
  optimizer sums them over its replicas) and the loss; the user's
  `tf.function` applies them with the Keras optimizer.
  """

  def train_step(trainable, non_trainable, images, labels):
    with tf.GradientTape() as tape:
      tape.watch(trainable)
      predictions, _, model_losses = model.stateless_call(
          trainable, non_trainable, images, training=True,
          return_losses=True)
      loss = compute_loss(labels, predictions, model_losses)
    gradients = tape.gradient(loss, trainable)
    return (tfspmd.lax.psum(gradients, "batch"),
            tfspmd.lax.psum(loss, "batch"))

  return tfspmd.pmap(train_step, "batch", in_axes=(None, None, 0, 0),
                     out_axes=None)


def train_tfspmd(weights, images, labels, epochs, steps_per_call):
  """The same loop with tfspmd.pmap; the loss of each step.

  With `steps_per_call` K > 1, the user's `tf.function` runs K steps in a
  `tf.range` loop: one call for K global batches.
  """
  devices = tfspmd.local_device_count()
  model = create_model()
  model.set_weights(weights)
  optimizer = keras.optimizers.Adam(1e-2)
  train_step = mapped_train_step(model)

  def one_step(images, labels):
    gradients, loss = train_step(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        tf.reshape(images, [devices, -1, 8, 8, 1]),
        tf.reshape(labels, [devices, -1]))
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss

  @tf.function
  def distributed_train_step(images, labels):
    if steps_per_call == 1:
      return one_step(images, labels)
    losses = tf.TensorArray(tf.float32, size=steps_per_call)
    for t in tf.range(steps_per_call):
      losses = losses.write(t, one_step(images[t], labels[t]))
    return losses.stack()

  dataset = batches(images, labels, epochs)
  if steps_per_call > 1:
    dataset = dataset.batch(steps_per_call, drop_remainder=True)
  losses = []
  for inputs in dataset:
    losses.extend(np.atleast_1d(distributed_train_step(*inputs)).tolist())
  return losses, model.get_weights()


def run(epochs, steps_per_call):
  """Trains three ways; returns the loss curves and weights of each."""
  images, labels = load_digits()
  keras.utils.set_random_seed(0)
  weights = create_model().get_weights()
  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{k}" for k in range(tfspmd.local_device_count())],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  results = {
      "MirroredStrategy": train_mirrored(strategy, weights, images, labels,
                                         epochs),
      "tfspmd.pmap": train_tfspmd(weights, images, labels, epochs, 1),
      f"tfspmd.pmap, {steps_per_call} steps a call": train_tfspmd(
          weights, images, labels, epochs, steps_per_call),
  }
  steps_per_epoch = TRAIN_EXAMPLES // GLOBAL_BATCH
  reference, reference_weights = results["MirroredStrategy"]
  differences = {}
  for name, (losses, trained) in results.items():
    epoch_losses = np.reshape(losses, (epochs, steps_per_epoch)).mean(1)
    print(f"{name:>28}: loss by epoch "
          + " ".join(f"{loss:.4f}" for loss in epoch_losses))
    differences[name] = (
        np.max(np.abs(np.subtract(losses, reference))),
        max(np.max(np.abs(a - b)) / np.max(np.abs(b))
            for a, b in zip(trained, reference_weights)))
  loss_difference = max(loss for loss, _ in differences.values())
  weight_difference = max(weight for _, weight in differences.values())
  print(f"largest difference from MirroredStrategy: loss of a step "
        f"{loss_difference:.1e}, weights {weight_difference:.1e} of the "
        f"largest weight "
        f"-> {'the same' if same(differences) else 'NOT the same'} to "
        f"{LOSS_TOLERANCE:.0e} and {WEIGHT_TOLERANCE:.0e}")
  return results, differences


# Summed in other orders (a psum, the strategy's add_n on one device), the
# gradients differ in their last bits; Adam's steps carry that into the
# weights.
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-4


def same(differences):
  """Whether every run's losses and weights are MirroredStrategy's."""
  return all(loss <= LOSS_TOLERANCE and weight <= WEIGHT_TOLERANCE
             for loss, weight in differences.values())


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=4)
  parser.add_argument("--steps-per-call", type=int, default=5,
                      help="steps one call of the training function runs; "
                      "divides the steps of the run")
  options = parser.parse_args(argv)
  if (TRAIN_EXAMPLES // GLOBAL_BATCH * options.epochs) % options.steps_per_call:
    parser.error("--steps-per-call must divide the steps of the run")
  results, differences = run(options.epochs, options.steps_per_call)
  if not same(differences):
    raise SystemExit("tfspmd's loop and MirroredStrategy's differ")
  return results, differences


if __name__ == "__main__":
  main()
