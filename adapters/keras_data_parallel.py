"""A Keras model whose own `fit`, `evaluate` and `predict` run over the devices.

`data_parallel(model)` is the one line a Keras user adds: after it, the
user's unchanged calls `model.fit(...)`, `model.evaluate(...)` and
`model.predict(...)` (and those of any library that calls them, such as a
tuner) train and run the model data-parallel over the local devices, with
`model.fit`'s arguments and results. Each call runs through
`tfspmd.adapters.keras_training.KerasTrainer`, so everything its docstring
says holds: each global batch is split over the devices, the gradients are
averaged over them, the loss, metrics, loss scaling, sparse gradients and
`BatchNormalization(synchronized=True)` are `fit`'s, and the trained values
are in the model's variables after each epoch.

What differs from `KerasTrainer` is only what makes the calls `fit`'s own:

- the arguments are `model.fit`'s, in its order, with its defaults: arrays
  are taken in batches of 32 when no `batch_size` is given, `shuffle` is
  ignored for a dataset and so is `batch_size` (with a warning), and a last
  batch that does not divide by the devices is padded with rows that count
  nowhere (`remainder='pad'`) rather than refused;
- a `keras.utils.PyDataset` or a Python generator of batches is read as
  `model.fit` reads it, one global batch per item;
- `validation_steps` and `steps` take that many batches of a dataset;
- the model may be compiled (or compiled again) after `data_parallel`: each
  call runs the model as it is compiled then.

`train_on_batch`, `test_on_batch` and `predict_on_batch` run over the
devices too, one global batch each.

The model keeps its class, its weights and its saving; only these six
methods of this one model object are replaced.
"""

from __future__ import annotations

from collections.abc import Hashable
import inspect
import warnings

import numpy as np
import tensorflow as tf

import keras

from . import _keras_inputs
from . import _keras_internal
from . import keras_training

_RUNNER = "_tfspmd_data_parallel"


def data_parallel(model: keras.Model, *, num_devices: int | None = None,
                  axis_name: Hashable = "data") -> keras.Model:
  """Makes `model.fit`, `evaluate` and `predict` run data-parallel.

  Args:
    model: A Keras 3 model, compiled now or before its first `fit` or
      `evaluate`. A model with its own `train_step`, `test_step` or
      `predict_step` runs it on each device.
    num_devices: How many local devices to run on; None for all.
    axis_name: The name of the data axis, for collectives.

  Returns:
    `model` itself, whose `fit`, `evaluate` and `predict` (and their
    `*_on_batch` forms) now run over the devices. Calling `data_parallel` again on it changes nothing if the
    arguments are the same.

  Raises:
    TypeError: If `model` is not a Keras 3 model.
    ValueError: If it was made data-parallel before with other arguments.

  Example:
    >>> import numpy as np, keras
    >>> from tfspmd.adapters import data_parallel
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model = data_parallel(model)
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x, y = np.ones((64, 3), np.float32), np.ones((64, 1), np.float32)
    >>> history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    >>> len(history.history["loss"]), model.predict(x, verbose=0).shape
    (2, (64, 1))
  """
  _keras_inputs.check_keras_model(model, "data_parallel")
  existing = model.__dict__.get(_RUNNER)
  if existing is not None:
    if (existing.num_devices, existing.axis_name) != (num_devices, axis_name):
      raise ValueError(
          f"data_parallel: the model {model.name!r} already runs "
          f"data-parallel with num_devices={existing.num_devices!r}, "
          f"axis_name={existing.axis_name!r}; got num_devices="
          f"{num_devices!r}, axis_name={axis_name!r}. Make it data-parallel "
          f"once (a copy from keras.models.clone_model starts afresh).")
    return model
  runner = _DataParallelCalls(model, num_devices, axis_name)
  # Keras tracks what is assigned to a model's attributes; these are plain
  # methods of this one object, so they bypass the tracking.
  object.__setattr__(model, _RUNNER, runner)
  for name in ("fit", "evaluate", "predict", "train_on_batch",
               "test_on_batch", "predict_on_batch"):
    object.__setattr__(model, name, getattr(runner, name))
  return model


class _DataParallelCalls:
  """`fit`, `evaluate`, `predict` and their `*_on_batch` forms of one model."""

  def __init__(self, model, num_devices, axis_name):
    self.model = model
    self.num_devices = num_devices
    self.axis_name = axis_name
    self._trainer = None
    self._compiled_with = None

  def trainer(self, method):
    """The trainer for the model as it is compiled now (made again if not)."""
    model = self.model
    if not model.compiled or model.optimizer is None:
      raise ValueError(
          f"{method}: the model {model.name!r} is not compiled with an "
          f"optimizer; call model.compile(optimizer=..., loss=..., "
          f"metrics=...) first.")
    compiled_with = _keras_internal.compilation(model)
    if self._trainer is None or not _same(compiled_with, self._compiled_with):
      self._trainer = keras_training.KerasTrainer(
          model, num_devices=self.num_devices, axis_name=self.axis_name)
      self._compiled_with = compiled_with
    return self._trainer

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
          callbacks=None, validation_split=0.0, validation_data=None,
          shuffle=True, class_weight=None, sample_weight=None,
          initial_epoch=0, steps_per_epoch=None, validation_steps=None,
          validation_batch_size=None, validation_freq=1):
    """`keras.Model.fit`, data-parallel over the devices."""
    trainer = self.trainer("model.fit")
    x, y, sample_weight, batch_size, shuffle = _inputs(
        x, y, sample_weight, batch_size, shuffle, "model.fit")
    if validation_data is not None and not isinstance(
        validation_data, (tuple, list, tf.data.Dataset)):
      validation_data = _as_dataset(validation_data,
                                    "model.fit(validation_data)")
    if validation_steps is not None:
      if validation_data is None:
        raise ValueError(
            "model.fit: `validation_steps` counts batches of "
            "`validation_data`; "
            "with `validation_split`, all the rows split off are used.")
      if isinstance(validation_data, (tuple, list)):
        validation_data = _batched(
            *keras.utils.unpack_x_y_sample_weight(tuple(validation_data)),
            validation_batch_size or batch_size or 32)
        validation_batch_size = None
      validation_data = _first_batches(validation_data, validation_steps,
                                       "model.fit", "validation_steps")
    with _keras_inputs.called_as("model"):
      history = trainer.fit(
          x, y, batch_size=batch_size, epochs=epochs,
          initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
          verbose=verbose, callbacks=callbacks,
          validation_split=validation_split, validation_data=validation_data,
          shuffle=shuffle, class_weight=class_weight,
          sample_weight=sample_weight,
          validation_batch_size=validation_batch_size,
          validation_freq=validation_freq, remainder="pad")
    object.__setattr__(self.model, "history", history)
    return history

  def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
               sample_weight=None, steps=None, callbacks=None,
               return_dict=False):
    """`keras.Model.evaluate`, data-parallel over the devices."""
    _keras_inputs.check_verbose(verbose, "model.evaluate")
    trainer = self.trainer("model.evaluate")
    x, y, sample_weight, batch_size, _ = _inputs(
        x, y, sample_weight, batch_size, None, "model.evaluate")
    if steps is not None:
      x = _first_batches(
          _batched(x, y, sample_weight, batch_size), steps, "model.evaluate",
          "steps")
      y = sample_weight = batch_size = None
    with _keras_inputs.called_as("model"):
      return trainer.evaluate(x, y, batch_size=batch_size,
                              sample_weight=sample_weight,
                              return_dict=return_dict, remainder="pad",
                              verbose=verbose, callbacks=callbacks)

  def predict(self, x, batch_size=None, verbose="auto", steps=None,
              callbacks=None):
    """`keras.Model.predict`, data-parallel over the devices."""
    _keras_inputs.check_verbose(verbose, "model.predict")
    if not isinstance(x, tf.data.Dataset) and _is_stream(x):
      x = _as_dataset(x, "model.predict")
    if isinstance(x, tf.data.Dataset):
      batch_size = _ignored_batch_size(batch_size, "model.predict")
    if steps is not None:
      if not isinstance(x, tf.data.Dataset):
        x = tf.data.Dataset.from_tensor_slices(x).batch(batch_size or 32)
        batch_size = None
      x = _first_batches(x, steps, "model.predict", "steps")
    with _keras_inputs.called_as("model"):
      return self._predicting_trainer().predict(
          x, batch_size=batch_size, verbose=verbose, callbacks=callbacks)

  def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                     return_dict=False):
    """`keras.Model.train_on_batch`, data-parallel over the devices."""
    trainer = self.trainer("model.train_on_batch")
    with _keras_inputs.called_as("model"):
      return trainer.train_on_batch(x, y, sample_weight=sample_weight,
                                    class_weight=class_weight,
                                    return_dict=return_dict)

  def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
    """`keras.Model.test_on_batch`, data-parallel over the devices."""
    trainer = self.trainer("model.test_on_batch")
    with _keras_inputs.called_as("model"):
      return trainer.test_on_batch(x, y, sample_weight=sample_weight,
                                   return_dict=return_dict)

  def predict_on_batch(self, x):
    """`keras.Model.predict_on_batch`, data-parallel over the devices."""
    with _keras_inputs.called_as("model"):
      return self._predicting_trainer().predict_on_batch(x)

  def _predicting_trainer(self):
    # model.predict needs no compile: neither does this.
    if self.model.compiled and self.model.optimizer is not None:
      return self.trainer("model.predict")
    return keras_training.KerasTrainer._for_prediction(  # pylint: disable=protected-access
        self.model, self.num_devices, self.axis_name)


def _same(a, b):
  """Whether two `compilation`s are of one compile."""
  return b is not None and len(a) == len(b) and all(
      p is q or (type(p) is int and p == q) for p, q in zip(a, b))


def _inputs(x, y, sample_weight, batch_size, shuffle, method):
  """`model.fit`'s inputs as `KerasTrainer` takes them."""
  if x is None:
    raise ValueError(f"{method}: give the inputs `x`.")
  if isinstance(x, tf.data.Dataset) or _is_stream(x):
    if not isinstance(x, tf.data.Dataset):
      x = _as_dataset(x, method, shuffle=bool(shuffle))
    # model.fit ignores `shuffle` for a dataset (its default is True).
    return x, y, sample_weight, _ignored_batch_size(batch_size, method), None
  return x, y, sample_weight, 32 if batch_size is None else batch_size, shuffle


def _ignored_batch_size(batch_size, method):
  """None, warning that a `batch_size` given with a dataset goes unused.

  Keras' own methods take the batches a dataset (or a PyDataset, or a
  generator) gives and ignore `batch_size` beside one; so do these.
  """
  if batch_size is not None:
    warnings.warn(
        f"{method}: `batch_size={batch_size!r}` is ignored, as Keras ignores "
        f"it for a dataset: the dataset's elements are the global batches. "
        f"Batch the dataset itself (dataset.batch(n)), and leave "
        f"`batch_size` out.", stacklevel=3)
  return None


def _is_stream(x):
  return isinstance(x, keras.utils.PyDataset) or inspect.isgenerator(x)


def _as_dataset(x, method, shuffle=False):
  """A PyDataset or a generator of global batches as a dataset of them.

  A PyDataset is read in its order (a new random one each epoch with
  `shuffle`), and its `on_epoch_end` runs after each pass, as in
  `model.fit`. A generator is read once: its first batch gives the
  dataset's element structure.
  """
  if isinstance(x, keras.utils.PyDataset):
    count = len(x)
    if count < 1:
      raise ValueError(f"{method}: the PyDataset `x` has no batches.")
    first = _as_element(x[0])

    def batches():
      order = np.random.permutation(count) if shuffle else range(count)
      for index in order:
        yield _as_element(x[int(index)])
      x.on_epoch_end()
  else:
    try:
      first = _as_element(next(x))
    except StopIteration:
      raise ValueError(
          f"{method}: the generator `x` yields no batch.") from None
    unread = [first]

    def batches():
      # A generator runs out after its first pass, as in model.fit.
      while unread:
        yield unread.pop()
      for batch in x:
        yield _as_element(batch)
  signature = tf.nest.map_structure(
      lambda a: tf.TensorSpec((None,) + tuple(np.shape(a))[1:],
                              tf.as_dtype(np.asarray(a).dtype)), first)
  return tf.data.Dataset.from_generator(batches, output_signature=signature)


def _as_element(batch):
  """A batch `(x, y)`, `[x, y]` or `x` as tf.data takes it (lists as tuples)."""
  return tuple(batch) if isinstance(batch, list) else batch


def _batched(x, y, sample_weight, batch_size):
  if isinstance(x, tf.data.Dataset):
    return x
  arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
  return tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size)


def _first_batches(dataset, steps, method, argument):
  """The first `steps` batches of `dataset`."""
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(
        f"{method}: `{argument}` must be an int >= 1 (a number of batches), "
        f"got {steps!r}.")
  return dataset.take(steps)
