"""The batches `KerasTrainer`'s steps take, and how many steps each holds.

A global batch `(x, y[, sample_weight])` of the dataset becomes a dict
batch with the keys 'x', 'y', 'sample_weight' and, when padded, 'rows'
(present only where given), placed on the devices by
`tfspmd.adapters.tf_data.device_batches`; with `steps_per_call=K` one item
holds K steps, for `pmap(..., steps=K)` (each leaf shaped `(devices, K,
per_device_batch, ...)`).
"""

import tensorflow as tf

import keras
import tfspmd

from . import tf_data


def device_batches(dataset, num_devices, remainder, steps_per_call,
                   own_step=None):
  """`dataset` as placed dict batches: x, y, sample_weight, rows (if padded).

  With remainder='pad' each batch is padded to a multiple of the devices
  of all processes here, and its 'rows' mask (1 for a row of the dataset,
  0 for padding) tells the steps which rows to leave out: a sample weight
  of 0 cannot, since a dataset may weight its own rows 0.

  Args:
    dataset: A `tf.data.Dataset` of global batches `(x, y[, sample_weight])`.
    num_devices: How many local devices the batches are split over.
    remainder: 'error' or 'pad', as `KerasTrainer.fit` takes it.
    steps_per_call: As `tfspmd.adapters.tf_data.device_batches` takes it:
      None for one batch per item, K for K steps per item.
    own_step: For a model with its own step, `(model class name, step
      name)`: the step runs on every row it is given, so no batch is
      padded and one that does not divide by the devices is an error.

  Returns:
    A `tf_data.DeviceBatches` of the placed dict batches.
  """
  multiple = num_devices * tfspmd.process_count()
  pad = remainder == "pad" and own_step is None

  def keyed(*element):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
        element[0] if len(element) == 1 else element)
    batch = {"x": x}
    if y is not None:
      batch["y"] = y
    if sample_weight is not None:
      batch["sample_weight"] = sample_weight
    if not pad:
      return batch
    batch, rows = tf_data.pad_rows(batch, multiple)
    batch["rows"] = rows
    return batch

  advice = None
  if own_step is not None:
    model_class, step = own_step
    advice = (f"{model_class} has its own {step}, which runs on every row "
              f"it is given, so no padding rows can be added: give batch "
              f"sizes that are multiples of {multiple} (a short last batch "
              f"can be dropped with dataset.batch(n, drop_remainder=True)).")
  return tf_data.DeviceBatches(
      tf_data.map_as_written(dataset, keyed), num_devices=num_devices,
      steps_per_call=steps_per_call, remainder="error",
      buffer_size=tf_data.DEFAULT_BUFFER_SIZE, process_index=None,
      process_count=None, undivided_advice=advice)


def prediction_batches(dataset, num_devices):
  """Inputs `(x,)` as placed dict batches 'x' and 'rows', always padded.

  Each batch is padded to a multiple of the devices of all processes; its
  'rows' mask (1 for a row of the dataset, 0 for padding) tells which
  predictions to keep.

  Args:
    dataset: A `tf.data.Dataset` of global batches `(x,)`.
    num_devices: How many local devices the batches are split over.

  Returns:
    A `tf_data.DeviceBatches` of the placed dict batches.
  """
  multiple = num_devices * tfspmd.process_count()

  def keyed(x):
    batch, rows = tf_data.pad_rows({"x": x}, multiple)
    batch["rows"] = rows
    return batch

  return tf_data.device_batches(tf_data.map_as_written(dataset, keyed),
                                num_devices=num_devices)


def unpack(batch):
  """A step's dict batch as `(x, y, sample_weight, rows)`, None if absent."""
  return (batch["x"], batch.get("y"), batch.get("sample_weight"),
          batch.get("rows"))


def steps_per_execution(model):
  """The steps one pmap call runs: the model's compiled `steps_per_execution`."""
  steps = getattr(model, "steps_per_execution", 1) or 1
  return int(steps)


def batch_steps(batch):
  """The number of steps in an item of `device_batches(steps_per_call=K)`."""
  return int(tf.nest.flatten(batch)[0].shape[1])


def take_steps(stream, steps):
  """Items of `stream` until they hold `steps` steps (or it ends)."""
  taken = 0
  while taken < steps:
    batch = next(stream, None)
    if batch is None:
      return
    taken += batch_steps(batch)
    yield batch
