"""The pieces of Keras' stateless step that one device of `KerasTrainer` runs.

The trainer's pmapped train and test steps are made of these: the compiled
loss of the device's rows, the loss tracker and compiled metrics updated on
the global batch (gathered from the devices), a seed stream of its own for
each device, and the check that the model keeps no state Keras cannot map
statelessly. Each takes the model and the data axis rather than the trainer.
"""

import warnings

import tensorflow as tf

import keras
from tfspmd import lax

from . import _keras_internal


# The Keras optimizers whose update of a sparse gradient keeps static shapes
# and gives one-device model.fit's numbers in a pmap's program (checked in
# tests/test_adapters_keras.py). Those of RMSprop, Adagrad, Adadelta and
# Adafactor make values of data-dependent shape (a tf.cond over the rows),
# and Nadam's gave NaNs: they get the gradient dense.
_SPARSE_UPDATES = (keras.optimizers.SGD, keras.optimizers.Adam,
                   keras.optimizers.AdamW, keras.optimizers.Adamax,
                   keras.optimizers.Ftrl, keras.optimizers.Lion,
                   keras.optimizers.Lamb)


def updates_sparse_rows(optimizer):
  """Whether `optimizer` (a loss-scaling one: its inner one) takes sparse rows."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  return type(inner) in _SPARSE_UPDATES


def combined_gradients(grads, axis_name, sparse):
  """The devices' gradients combined as MirroredStrategy combines them.

  Each device's gradient is that of its loss divided by the number of
  devices (`loss_for_distribution`), so the devices' gradients are summed:
  a dense one in one all-reduce for all. A sparse one (an `IndexedSlices`,
  as an Embedding's is) stays sparse where the optimizer takes it
  (`sparse`): every device's rows, one after the other, so that the
  optimizer meets each looked-up row as `model.fit` on one device gives it. Keras'
  optimizers update a sparse gradient row by row (Adam's second moment
  sums each row's square), so an averaged dense gradient gives other
  weights where ids repeat in a batch; where the optimizer cannot take the
  rows, that is what it gets, and a warning says so.

  Args:
    grads: This device's gradients, tensors, `IndexedSlices` or None.
    axis_name: The pmap axis the batch is split over.
    sparse: Whether sparse gradients reach the optimizer sparse
      (`updates_sparse_rows`).

  Returns:
    The combined gradients, the same on every device, in `grads`' order.
  """
  if not sparse and any(isinstance(g, tf.IndexedSlices) for g in grads):
    warnings.warn(
        "KerasTrainer: the optimizer updates a sparse gradient (an "
        "Embedding's) with ops of data-dependent shape, which a pmap's "
        "program cannot hold, so it gets the gradient dense, summed over "
        "the devices; where ids repeat in a batch its weights then differ "
        "from model.fit's. SGD, Adam, AdamW, Adamax, Ftrl, Lion and Lamb "
        "take the rows as model.fit gives them.", stacklevel=2)
    grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices)
             else g for g in grads]
  combined = list(grads)
  dense = [k for k, g in enumerate(grads)
           if g is not None and not isinstance(g, tf.IndexedSlices)]
  for k, total in zip(dense, lax.psum([grads[k] for k in dense], axis_name)):
    combined[k] = total
  for k, g in enumerate(grads):
    if isinstance(g, tf.IndexedSlices):
      combined[k] = tf.IndexedSlices(
          lax.all_gather(g.values, axis_name, tiled=True),
          lax.all_gather(g.indices, axis_name, tiled=True), g.dense_shape)
  return combined


def loss_for_distribution(loss, axis_name):
  """This device's loss divided by the number of devices, as Keras scales it.

  Keras' trainers divide each replica's loss by the number of replicas
  (`scale_loss_for_distribution`) before a LossScaleOptimizer scales it,
  and sum the replicas' gradients: each device's scaled gradients are then
  as large as one device's of the global batch, and overflow float16 where
  `model.fit`'s do (at n times the size they overflowed at n times the
  loss scale: fewer steps applied, a smaller scale).
  """
  return loss / tf.cast(lax.psum(1, axis_name), loss.dtype)


def compiled_loss(model, trainable, non_trainable, metrics, x, y,
                  sample_weight, training):
  """The compiled loss of this device's rows, as Keras' JAX trainer has it.

  Args:
    model: The compiled Keras model.
    trainable, non_trainable, metrics: The values of the model's trainable,
      non-trainable and metrics variables.
    x, y, sample_weight: This device's rows of the batch.
    training: Whether the model is called in training mode.

  Returns:
    `(loss, y_pred, non_trainable, output_losses)`: the loss, the
    predictions, the non-trainable values the forward pass updated, and
    for a model with several outputs the `(tracker, loss)` pair of each
    output's loss (`_keras_internal.recorded_output_losses`).
  """
  kwargs = {}
  if _keras_internal.call_has_training_arg(model):
    kwargs["training"] = training
  y_pred, non_trainable, losses = model.stateless_call(
      trainable, non_trainable, x, return_losses=True, **kwargs)
  with _keras_internal.forward_losses(model, losses), (
      _keras_internal.recorded_output_losses(model)) as output_losses:
    loss, (_, non_trainable, _) = model.stateless_compute_loss(
        trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred,
        sample_weight=sample_weight, training=training)
  return loss, y_pred, non_trainable, output_losses


def metrics_of_global_batch(model, axis_name, metrics, loss, output_losses,
                            x, y, y_pred, sample_weight, rows):
  """The loss trackers and compiled metrics, updated on the global batch.

  Padding rows (`rows` 0) weigh nothing: the metrics see the global batch
  as the dataset gave it.

  Args:
    model: The compiled Keras model.
    axis_name: The pmap axis the batch is split over.
    metrics: The values of the model's metrics variables before the update.
    loss: This device's loss.
    output_losses: This device's `(tracker, loss)` pair of each output's
      loss, from `compiled_loss`.
    x, y, y_pred, sample_weight, rows: This device's rows of the batch, its
      predictions and its row mask (None for an unpadded batch).

  Returns:
    `(metrics, logs)`: the updated metrics values and the metrics' results.
  """
  gather = lambda t: tf.nest.map_structure(
      lambda v: lax.all_gather(v, axis_name, tiled=True), t)
  x_all, y_all, y_pred_all, weight_all = (
      gather(x), gather(y), gather(y_pred), gather(sample_weight))
  if rows is None:
    first_input = next(v for v in tf.nest.flatten(x_all) if v is not None)
    size = tf.shape(first_input)[0]
  else:
    rows_all = gather(rows)
    size = tf.reduce_sum(rows_all)
  with keras.StatelessScope(
      state_mapping=list(zip(model.metrics_variables, metrics))) as scope:
    _keras_internal.loss_tracker(model).update_state(
        lax.pmean(loss, axis_name), sample_weight=size)
    # Keras weighs each output's loss by the batch's static size, which its
    # TensorFlow trainer traces as unknown (batches of arrays or of a
    # dataset that keeps a short last batch): each batch then weighs 1, a
    # short last batch included, and so it does here.
    for tracker, output_loss in output_losses:
      tracker.update_state(lax.pmean(output_loss, axis_name))
    if rows is None:
      logs = model.compute_metrics(x_all, y_all, y_pred_all,
                                   sample_weight=weight_all)
    else:
      logs = _keras_internal.compute_metrics_of_rows(
          model, x_all, y_all, y_pred_all, weight_all, rows_all)
  new_metrics = []
  for variable, old in zip(model.metrics_variables, metrics):
    new = scope.get_current_value(variable)
    new_metrics.append(old if new is None else new)
  # A metric whose result is one of its variables (TruePositives at a list
  # of thresholds) returns the variable itself, which is read outside the
  # scope: its value is the updated one.
  updated = {id(variable): value
             for variable, value in zip(model.metrics_variables, new_metrics)}
  logs = {name: updated.get(id(value), value) for name, value in logs.items()}
  return new_metrics, logs


def per_device_seeds(non_trainable, seeds, sign, axis_name):
  """Moves each seed generator's state to this device's stream (sign -1: back).

  Keras advances a generator's state in its second element only, so
  adding the device's position to the first gives each device streams
  no other device reaches: a Dropout draws a different mask on each
  device, and device 0 draws what Keras' own fit draws.

  Args:
    non_trainable: The values of the model's non-trainable variables.
    seeds: The positions in `non_trainable` of the seed generators' states.
    sign: 1 to move the states to this device's stream, -1 to move them back.
    axis_name: The pmap axis whose index tells the devices apart.

  Returns:
    `non_trainable` with the seed states moved.
  """
  if not seeds:
    return non_trainable
  position = tf.cast(lax.axis_index(axis_name), tf.int64)
  return [value + sign * tf.cast(tf.stack([position, 0]), value.dtype)
          if k in seeds else value for k, value in enumerate(non_trainable)]


def check_no_untracked_variables(tape, model):
  """Raises if the step read a tf.Variable Keras does not map statelessly."""
  read = tape.watched_variables()
  if read:
    names = ", ".join(sorted(v.name for v in read))
    raise ValueError(
        f"KerasTrainer: {model.name!r} cannot run statelessly: its call reads "
        f"tf.Variable(s) that are not Keras variables of the model ({names}), "
        f"so they would be neither trained nor updated on the devices. "
        f"Create the model's state with Layer.add_weight / keras.Variable "
        f"(or wrap the tf.Module in a Keras layer that does).")
