"""Data-parallel training of an unchanged Keras 3 model through pmap.

`KerasTrainer(model).fit(dataset, epochs=...)` trains a compiled Keras model
(TensorFlow backend) on every local device, as `model.fit` would on one:

- the model's trainable and non-trainable variables, the optimizer's
  variables and the compiled metrics' variables are the pmap's state, carried
  as replicated arguments (`in_axes=None`) from call to call within an
  epoch;
- the model stays the one place the values live: they go back into its
  variables at the end of every epoch (before the callbacks' `on_epoch_end`),
  after every batch where a callback has batch methods (ModelCheckpoint
  with `save_freq` in batches) and when fit is interrupted, and are read
  from it again before the next step, so what callbacks or the user assign
  (a learning rate, `set_weights`, `load_weights`, restored best weights)
  is what training and `evaluate` go on from;
- each global batch is split over the devices (`tfspmd.adapters.tf_data`); each
  device runs Keras' functional step on its rows: `model.stateless_call`
  under a `tf.GradientTape`, the compiled loss (`stateless_compute_loss`),
  the gradients `pmean`-ed over the data axis, and the optimizer's
  `stateless_apply`;
- the compiled metrics and the reported loss are updated once per step on
  the whole global batch (predictions `all_gather`-ed from the devices), so
  they equal `fit`'s, and so does the loss of each output of a model with
  several outputs ('<output>_loss', the mean of the devices' losses);
- `model.compile(steps_per_execution=K)` runs K steps per pmap call
  (`pmap(..., steps=K)`), as it runs K steps per call in `fit`;
- with `remainder='pad'`, a batch that does not divide by the devices is
  padded with rows that count nowhere: the real rows' sample weights are
  scaled so that the loss and gradients are those of the unpadded batch,
  the metrics weigh padding rows 0, and BatchNormalization leaves them out
  of its batch statistics;
- validation (`validation_data`, `validation_split`, `validation_freq`),
  `class_weight` and `shuffle` are `model.fit`'s: 'val_<name>' logs come
  from the trained model on the validation batches at the end of the epoch,
  before the callbacks' `on_epoch_end`;
- `evaluate` returns what `model.evaluate` returns, and `predict` runs the
  forward pass split over the devices, returning `model.predict`'s arrays;
- under a `mixed_float16` policy the `LossScaleOptimizer` Keras wraps the
  optimizer in scales the loss and skips steps whose gradients overflow, as
  in `fit`; `mixed_bfloat16` needs no scaling;
- the optimizer's options are `fit`'s: weight decay, gradient clipping,
  `gradient_accumulation_steps`, and `use_ema` (with
  `ema_overwrite_frequency`), whose moving averages become the model's
  weights at the end of `fit`.

With the default loss reduction (the mean over the batch), the mean of the
devices' gradients is the gradient of the global batch, so the training is
`fit`'s up to float rounding. BatchNormalization normalizes each device's
rows by their own batch moments, as each replica of a `tf.distribute`
strategy does, so a model with it trains as `fit` would on batches of a
device's rows; its moving mean and variance, though, are `fit`'s: the
devices' moments pooled into the mean and the variance of the global
batch's real rows (a device with no real row weighs nothing). Give each
device several rows: one row alone normalizes to the layer's offset.
Other non-trainable variables a step updates are averaged over the
devices, each weighted by its real rows.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any
import warnings

import numpy as np
import tensorflow as tf

import keras
import tfspmd
from tfspmd import lax

from . import _batch_norm
from . import _custom_step
from . import _keras_inputs
from . import _keras_internal
from . import _keras_step
from . import _padded_rows
from . import _placement
from . import _step_batches


class KerasTrainer:
  """Trains a compiled Keras model data-parallel over the local devices.

  `fit`, `evaluate` and `predict` take the arguments of `model.fit`,
  `model.evaluate` and `model.predict` that make sense for data on several
  devices, and give their results. Keras' own steps are run, statelessly on
  each device; a model that overrides `train_step`, `test_step` or
  `predict_step` runs its own on each device as MirroredStrategy runs it
  on a replica, on batches that divide by the devices.

  Attributes:
    model: The Keras model; its variables hold the trained values after each
      epoch of `fit`.
    devices: The devices of the data axis, in order.
    axis_name: The pmap axis name of the data axis.

  Example:
    >>> import numpy as np, keras
    >>> from tfspmd.adapters import keras_training
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> trainer = keras_training.KerasTrainer(model)
    >>> x, y = np.ones((64, 3), np.float32), np.ones((64, 1), np.float32)
    >>> history = trainer.fit(x, y, batch_size=32, epochs=2, verbose=0,
    ...                       validation_split=0.25, shuffle=True)
    >>> sorted(history.history), len(history.history["val_loss"])
    (['loss', 'val_loss'], 2)
    >>> trainer.predict(x[:20], batch_size=8).shape
    (20, 1)
    >>> isinstance(trainer.evaluate(x, y, batch_size=32), float)
    True
  """

  def __init__(self, model: keras.Model, *, num_devices: int | None = None,
               axis_name: Hashable = "data") -> None:
    """Prepares `model` for data-parallel training.

    Args:
      model: A Keras 3 `keras.Model`, compiled with an optimizer and a loss.
      num_devices: How many local devices to train on; None for all.
      axis_name: The name of the data axis, for collectives.

    Raises:
      TypeError: If `model` is not a Keras 3 model.
      ValueError: If it is not compiled.
      ImportError: If the installed Keras keeps a private attribute the
        adapters use elsewhere than the tested versions do.
    """
    _keras_inputs.check_model(model)
    self._prepare(model, num_devices, axis_name)

  @classmethod
  def _for_prediction(cls, model, num_devices, axis_name):
    """A trainer whose model, compiled or not, is only to predict."""
    _keras_inputs.check_keras_model(model)
    trainer = cls.__new__(cls)
    trainer._prepare(model, num_devices, axis_name)  # pylint: disable=protected-access
    return trainer

  def _prepare(self, model, num_devices, axis_name):
    self.model = model
    self.devices = _placement.data_devices(num_devices)
    self.axis_name = axis_name
    self._state = None
    self._variables = None
    self._write_variables = None
    self._devices_ahead = False
    self._known_learning_rate = None
    self._reset_metrics = None
    self._train_calls = {}
    self._test_call = None
    self._predict_call = None

  # --- state ---------------------------------------------------------------
  #
  # The model is the one place the values live between steps; the devices'
  # `_state` is a copy that steps advance. `fit` and `evaluate` read the
  # model's variables into it before their first step (`_pull`), and `fit`
  # writes it back (`sync_to_model`) at every epoch end, before the
  # callbacks' `on_epoch_end`, then reads the model again before the next
  # step. So whatever the user or a callback assigns to the model between
  # epochs or calls (`set_weights`, `load_weights`, the learning rate of
  # LearningRateScheduler or ReduceLROnPlateau, EarlyStopping's restored
  # best weights) is what the next step uses, and is never overwritten by an
  # older copy: `_devices_ahead` says whether the devices hold values the
  # model does not have yet, and only then is the model written. Reading
  # every variable costs one host-to-devices copy per epoch; telling which
  # variables changed would cost as much (a host read of each). Within an
  # epoch the model's weights are those of the last epoch end, unless a
  # callback has batch methods of its own (ModelCheckpoint saving every n
  # batches): the model is then written after each batch, before the
  # callbacks see it, and read again for the next step. Otherwise the
  # learning rate, the value a batch-level callback sets, is read after each
  # batch's callbacks (one scalar). A fit stopped by an exception (a
  # KeyboardInterrupt) leaves the model the values of its last step.

  @property
  def state(self) -> tuple[list[tfspmd.ShardedArray], ...] | None:
    """The training state: `(trainable, non_trainable, optimizer, metrics)`.

    Four lists of replicated `tfspmd.ShardedArray`s, in the order of
    `model.trainable_variables`, `model.non_trainable_variables`,
    `model.optimizer.variables` and `model.metrics_variables`, read from the
    model (from the devices while a `fit` epoch runs); None before the
    first batch builds the model. Assign a state of the same structure,
    shapes and dtypes (e.g. from `tfspmd.adapters.checkpoint.restore`) to continue
    from it: it is written into the model's variables.
    """
    if self._state is not None and not self._devices_ahead:
      self._pull()
    return self._state

  @state.setter
  def state(self, value: Sequence[Sequence[Any]]) -> None:
    if self._state is None:
      raise ValueError(
          "KerasTrainer.state can be set only once the model is built: call "
          "build(dataset) (or fit) first.")
    _keras_inputs.check_state(value, self._variables)
    self._state = self._replicated_state(value)
    self._devices_ahead = True
    self.sync_to_model()

  def build(self, data: Any) -> None:
    """Builds the model, loss, metrics and optimizer, and places the state.

    Called by `fit` and `evaluate`; call it yourself to get `state` before
    training (to restore a checkpoint into it). A model compiled again (a
    new optimizer or metrics) is built again.

    Args:
      data: A `tf.data.Dataset` of global batches `(x, y[, sample_weight])`,
        or its `element_spec`.
    """
    spec = data.element_spec if isinstance(data, tf.data.Dataset) else data
    _keras_internal.build(self.model, spec)
    variables = _model_variables(self.model)
    if self._variables is not None and _same_variables(
        variables, self._variables):
      return
    self.model.reset_metrics()
    self._variables = variables
    self._write_variables = None
    self._train_calls = {}
    self._test_call = None
    self._predict_call = None
    self._devices_ahead = False
    self._pull()
    self._reset_metrics = self._state[3]

  def sync_to_model(self) -> None:
    """Writes the devices' state into the model's and optimizer's variables.

    Only values the model does not have yet: a model changed since (e.g. by
    `set_weights`) is left as it is.
    """
    if self._state is None or not self._devices_ahead:
      return
    if self._write_variables is None:
      variables = [v for part in self._variables for v in part]

      def write(values):
        for variable, value in zip(variables, values):
          variable.assign(value)

      # One call writes them all: an eager assign each would wait for the
      # interpreter's lock behind the thread placing the next batches.
      self._write_variables = tf.function(write, autograph=False)
    self._write_variables([tf.convert_to_tensor(value)
                           for values in self._state for value in values])
    self._devices_ahead = False

  def _pull(self):
    """Reads the model's variables into the devices' state."""
    if not _same_variables(_model_variables(self.model), self._variables):
      raise RuntimeError(
          f"KerasTrainer: the variables of {self.model.name!r} changed while "
          f"fit ran (was it compiled again in a callback?). Compile the model "
          f"before fit; a later fit or evaluate builds the new one.")
    self._state = self._replicated_state(self._variables)
    rate = _keras_internal.learning_rate_variable(self.model.optimizer)
    self._known_learning_rate = None if rate is None else rate.numpy()

  def _step_state(self):
    """The state the next step starts from: the model's, if it is current."""
    if not self._devices_ahead:
      self._pull()
      return self._state
    rate = _keras_internal.learning_rate_variable(self.model.optimizer)
    if rate is not None and rate.numpy() != self._known_learning_rate:
      position = next(k for k, v in enumerate(self._variables[2])
                      if v is rate)
      optimizer_values = list(self._state[2])
      optimizer_values[position] = self._replicated(rate)
      self._state = (self._state[0], self._state[1], optimizer_values,
                     self._state[3])
      self._known_learning_rate = rate.numpy()
    return self._state

  def _replicated_state(self, parts):
    """Each value of four lists (a state, or the model's variables) replicated."""
    return tuple([self._replicated(v) for v in part] for part in parts)

  def _replicated(self, value):
    if isinstance(value, tfspmd.ShardedArray) and _placement.is_replicated(
        value) and value.devices() == tuple(self.devices):
      return value
    if isinstance(value, tfspmd.ShardedArray):
      value = np.asarray(value)
    # A variable is read as a tensor, with no copy through NumPy.
    return _placement.place(tf.convert_to_tensor(value), self.devices,
                            split=False)

  # --- fit and evaluate ------------------------------------------------------

  def fit(self, x: Any, y: Any = None, *,
          batch_size: int | None = None,
          epochs: int = 1,
          initial_epoch: int = 0,
          steps_per_epoch: int | None = None,
          verbose: str | int = "auto",
          callbacks: Sequence[keras.callbacks.Callback] | None = None,
          validation_split: float = 0.0,
          validation_data: Any = None,
          shuffle: bool | None = None,
          class_weight: dict[int, float] | None = None,
          sample_weight: Any = None,
          validation_batch_size: int | None = None,
          validation_freq: int | Sequence[int] = 1,
          remainder: str = "error") -> keras.callbacks.History:
    """Trains the model for `epochs` epochs, like `model.fit`.

    Args:
      x: A `tf.data.Dataset` of global batches `(x, y)`, `(x, y,
        sample_weight)` or, for a model compiled with neither a loss nor
        metrics (its losses from `add_loss`), `x` alone; iterated once per
        epoch (shuffle it there). Or the inputs as NumPy arrays or tensors,
        with `y` and `batch_size`, taken in order.
      y: The targets, when `x` is an array.
      batch_size: The global batch size, when `x` is an array.
      epochs: The epoch to stop at, as in `model.fit`.
      initial_epoch: The epoch to start at (to resume a run).
      steps_per_epoch: None to iterate the dataset once per epoch. An int
        reads that many batches per epoch from one iterator that goes on
        across epochs, as `model.fit` does: give it for a repeated dataset
        (`dataset.repeat()`). A multiple of the model's
        `steps_per_execution`.
      verbose: 'auto', 0, 1 or 2, as in `model.fit` (1: a progress bar).
      callbacks: Keras callbacks. They see the model with the trained values
        at the end of each epoch, and what they assign to it (the learning
        rate, weights) is what training goes on from.
      validation_split: For arrays: the fraction of the rows, the last
        ones (before any shuffling), to validate on instead of training, as
        in `model.fit`. Ignored when `validation_data` is given.
      validation_data: Data to compute the loss and metrics on at the end
        of the epochs `validation_freq` names, reported as 'val_loss' and
        'val_<metric>' in the logs and history: a tuple `(x, y)` or `(x, y,
        sample_weight)` of arrays, or a `tf.data.Dataset` of global batches.
      shuffle: For arrays: whether to take the rows in a new random order
        every epoch. None (the default) does, as `model.fit`'s default
        `shuffle=True` does; False keeps the given order. With a dataset,
        leave it out: shuffle the rows in the pipeline.
      class_weight: A dict from class index to a weight that multiplies the
        loss of the rows of that class, as in `model.fit` (for a single
        target of class indices or one-hot rows; not with sample weights).
        Validation rows are not weighted.
      sample_weight: Per-example weights, when `x` is an array.
      validation_batch_size: The global batch size of array validation
        data; None for `batch_size` (32, as in `model.fit`, where `x` is a
        dataset).
      validation_freq: Validate every that many epochs (an int), or at the
        end of the epochs of a list (counted from 1), as in `model.fit`.
      remainder: 'error' or 'pad', for a global batch (of training or
        validation data) that does not divide by the devices (see
        `tfspmd.adapters.tf_data.device_batches`). Padding rows change nothing:
        they are left out of the loss, the gradients, the metrics and
        BatchNormalization's statistics.

    Returns:
      The `keras.callbacks.History` of the run (also `model.history`).

    Raises:
      TypeError, ValueError: For a bad argument, naming it, before any step.
    """
    _keras_inputs.check_no_strategy(self.model, "fit")
    _keras_inputs.check_fit_arguments(epochs, initial_epoch, steps_per_epoch,
                                      verbose, callbacks)
    _keras_inputs.check_validation_arguments(validation_split, validation_data,
                                             validation_freq)
    if validation_split and validation_data is None:
      (x, y, sample_weight), validation_data = (
          _keras_inputs.split_validation(x, y, sample_weight,
                                         validation_split))
    dataset = _keras_inputs.global_batches(
        x, y, sample_weight, batch_size, remainder, self.model, "fit",
        shuffle=shuffle, class_weight=class_weight)
    validation = None
    if validation_data is not None:
      # As model.fit: array validation data beside a dataset goes in
      # batches of 32 unless `validation_batch_size` says otherwise.
      validation = self._validation_batches(
          validation_data,
          validation_batch_size or batch_size or _KERAS_BATCH_SIZE, remainder)
    self.build(dataset)
    model = self.model
    steps_per_call = _step_batches.steps_per_execution(model)
    _keras_inputs.check_steps_per_epoch(steps_per_epoch, steps_per_call)
    batches = _step_batches.device_batches(dataset, len(self.devices),
                                           remainder, steps_per_call,
                                           self._own_step("train_step"))
    stream = None if steps_per_epoch is None else iter(batches)
    cardinality = int(dataset.cardinality())
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0,
        verbose=1 if verbose == "auto" else verbose, epochs=epochs,
        steps=steps_per_epoch or (cardinality if cardinality >= 0 else None),
        model=model)
    model.stop_training = False
    callback_list.on_train_begin()
    logs = {}
    try:
      for epoch in range(initial_epoch, epochs):
        validate = validation if validation is not None and _validates_after(
            epoch, validation_freq) else None
        logs = self._fit_epoch(
            epoch, batches if stream is None else _step_batches.take_steps(
                stream, steps_per_epoch), callback_list, validate) or logs
        if model.stop_training:
          break
    finally:
      if stream is not None:
        stream.close()
      # Interrupted (a KeyboardInterrupt, a callback's error), the model
      # keeps the weights of the last step that ran, as in `fit`.
      self.sync_to_model()
    if epochs > 0:
      # As fit does: an optimizer with `use_ema` gives the model the moving
      # averages of its weights.
      model.optimizer.finalize_variable_values(model.trainable_weights)
    callback_list.on_train_end(logs)
    return model.history

  def _validation_batches(self, validation_data, batch_size, remainder):
    """The placed batches of `fit`'s `validation_data`."""
    if isinstance(validation_data, tf.data.Dataset):
      x, y, sample_weight, batch_size = validation_data, None, None, None
    else:
      x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
          tuple(validation_data))
    dataset = _keras_inputs.global_batches(
        x, y, sample_weight, batch_size, remainder, self.model,
        "fit(validation_data)")
    return _step_batches.device_batches(dataset, len(self.devices), remainder,
                                        None, self._own_step("test_step"))

  def _fit_epoch(self, epoch, batches, callback_list, validation):
    """One epoch of `fit`; returns its logs (empty if there was no batch).

    With `validation` (placed batches), the epoch's logs get the loss and
    metrics of the trained model on them, as 'val_<name>'.
    """
    callback_list.on_epoch_begin(epoch)
    reads_model = _reads_model_per_batch(callback_list)
    step = 0
    logs = {}
    for batch in batches:
      steps = _step_batches.batch_steps(batch)
      callback_list.on_train_batch_begin(step)
      state = self._step_state()
      if not step:
        state = state[:3] + (self._reset_metrics,)
      self._state, step_logs = self._train_call(steps)(state, batch)
      self._devices_ahead = True
      step += steps
      # In sorted order, as Keras 3 reports them.
      logs = {name: _log_value(np.asarray(value)[0, -1])
              for name, value in sorted(step_logs.items())}
      if reads_model:
        self.sync_to_model()
      callback_list.on_train_batch_end(step - 1, logs)
      if self.model.stop_training:
        break
    if not step:
      self.model.stop_training = True
      warnings.warn(
          f"{_keras_inputs.called('fit')}: the dataset ran out of batches; "
          "training stops. "
          "With steps_per_epoch, repeat the dataset (dataset.repeat()).",
          stacklevel=3)
      return logs
    if validation is not None:
      validation_logs = self._test_logs(validation, callback_list)
      logs = dict(sorted({**logs, **{f"val_{name}": value
                                     for name, value in
                                     validation_logs.items()}}.items()))
    self.sync_to_model()
    callback_list.on_epoch_end(epoch, logs)
    return logs

  def evaluate(
      self, x: Any, y: Any = None, *, batch_size: int | None = None,
      sample_weight: Any = None, return_dict: bool = False,
      remainder: str = "error", verbose: str | int = 0,
      callbacks: Sequence[keras.callbacks.Callback] | None = None
  ) -> float | list[float | np.ndarray] | dict[str, float | np.ndarray]:
    """The compiled loss and metrics of the model on some data.

    The model's current variables are used (those `fit` trained, or any the
    user assigned since).

    Args:
      x, y, batch_size, sample_weight: As for `fit`.
      return_dict: True for a dict from name to value, as in
        `model.evaluate`.
      remainder: As for `fit`.
      verbose: 0 for silence; 1 (or 'auto') for Keras' progress bar; 2
        for one line at the end.
      callbacks: Keras callbacks, whose `on_test_*` methods are called as
        `model.evaluate` calls them.

    Returns:
      What `model.evaluate` returns: the loss alone (a float) for a model
      compiled without metrics, else a list of floats, the loss first, then
      each output's loss for a model with several outputs, then the
      compiled metrics in order; with `return_dict`, a dict from metric
      name ('loss', '<output>_loss' and the compiled metrics) to a float. A
      metric whose result is not a scalar (F1Score per class) gives a NumPy
      array instead of a float.
    """
    _keras_inputs.check_no_strategy(self.model, "evaluate")
    _keras_inputs.check_verbose(verbose, _keras_inputs.called("evaluate"))
    _keras_inputs.check_callbacks(callbacks, "evaluate")
    dataset = _keras_inputs.global_batches(x, y, sample_weight, batch_size,
                                           remainder, self.model, "evaluate")
    self.build(dataset)
    logs = self._test_logs(_step_batches.device_batches(
        dataset, len(self.devices), remainder, None,
        self._own_step("test_step")),
                           _callback_list(callbacks, verbose, dataset,
                                          self.model))
    if return_dict:
      return logs
    return _keras_internal.metrics_in_order(self.model, logs)

  def _test_logs(self, batches, callback_list):
    """The compiled loss and metrics on placed batches, as floats by name.

    The callbacks' `on_test_*` methods are called as `model.evaluate` calls
    them.
    """
    trainable, non_trainable = self._step_state()[:2]
    metrics = self._reset_metrics
    logs = {}
    if self._test_call is None:
      self._test_call = tfspmd.pmap(
          _keras_internal.without_strategy(self._test_step), self.axis_name,
          in_axes=(None, None, None, 0),
          out_axes=None, jit_compile=self._jit_compile())
    callback_list.on_test_begin()
    for step, batch in enumerate(batches):
      callback_list.on_test_batch_begin(step)
      metrics, logs = self._test_call(trainable, non_trainable, metrics, batch)
      logs = {name: _log_value(value)
              for name, value in sorted(logs.items())}
      callback_list.on_test_batch_end(step, logs)
    callback_list.on_test_end(logs)
    return logs

  def predict(self, x: Any, *, batch_size: int | None = None,
              verbose: str | int = 0,
              callbacks: Sequence[keras.callbacks.Callback] | None = None
              ) -> Any:
    """The model's outputs on some inputs, like `model.predict`.

    Each global batch is split over the devices, and each device runs the
    model's forward pass (in inference mode) on its rows. A batch that does
    not divide by the devices is padded, and the padding rows' outputs are
    dropped. The model's current variables are used, as in `evaluate`.

    Args:
      x: The inputs as arrays (or a structure of arrays, for a model with
        several inputs), or a `tf.data.Dataset` of global batches `x`
        (or `(x, y[, sample_weight])`, whose `x` is taken).
      batch_size: The global batch size, for arrays: 32 if None, as in
        `model.predict`.
      verbose: As for `evaluate`.
      callbacks: Keras callbacks, whose `on_predict_*` methods are called
        as `model.predict` calls them (a batch's end gets its outputs).

    Returns:
      What `model.predict` returns: a NumPy array with one row per input
      row, in order, or the model's structure of them for a model with
      several outputs.
    """
    _keras_inputs.check_no_strategy(self.model, "predict")
    _keras_inputs.check_verbose(verbose, _keras_inputs.called("predict"))
    _keras_inputs.check_callbacks(callbacks, "predict")
    dataset = _keras_inputs.prediction_inputs(x, batch_size)
    model = self.model
    if not model.built:
      _keras_internal.build(model, dataset.element_spec)
    if self._state is not None and self._devices_ahead:
      trainable, non_trainable = self._state[:2]
    else:
      trainable, non_trainable = (
          [self._replicated(v) for v in variables]
          for variables in (model.trainable_variables,
                            model.non_trainable_variables))
    if self._predict_call is None:
      self._predict_call = tfspmd.pmap(
          _keras_internal.without_strategy(self._predict_step), self.axis_name,
          in_axes=(None, None, 0),
          jit_compile=self._jit_compile())
    callback_list = _callback_list(callbacks, verbose, dataset, model)
    callback_list.on_predict_begin()
    outputs = []
    for step, batch in enumerate(
        _step_batches.prediction_batches(dataset, len(self.devices))):
      callback_list.on_predict_batch_begin(step)
      rows = np.asarray(batch["rows"]) > 0
      outputs.append(tf.nest.map_structure(
          lambda value, rows=rows: np.asarray(value)[rows],
          self._predict_call(trainable, non_trainable, batch)))
      callback_list.on_predict_batch_end(step, {"outputs": outputs[-1]})
    callback_list.on_predict_end()
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts),
                                 *outputs)

  # --- one batch ---------------------------------------------------------------

  def train_on_batch(self, x: Any, y: Any = None, *, sample_weight: Any = None,
                     class_weight: dict[int, float] | None = None,
                     return_dict: bool = False) -> Any:
    """One training step on one global batch, like `model.train_on_batch`.

    The batch is split over the devices (padded where it does not divide by
    them), the metrics start afresh, and the model holds the trained values
    afterwards.

    Args:
      x, y, sample_weight: The batch's arrays, as `model.train_on_batch`
        takes them.
      class_weight: As for `fit`.
      return_dict: As for `evaluate`.

    Returns:
      The loss and metrics of the step, as `evaluate` returns them.
    """
    dataset = self._one_batch(x, y, sample_weight, "train_on_batch",
                              class_weight)
    batch = next(iter(_step_batches.device_batches(
        dataset, len(self.devices), "pad", 1, self._own_step("train_step"))))
    state = self._step_state()
    self._state, step_logs = self._train_call(1)(
        state[:3] + (self._reset_metrics,), batch)
    self._devices_ahead = True
    self.sync_to_model()
    logs = {name: _log_value(np.asarray(value)[0, -1])
            for name, value in sorted(step_logs.items())}
    if return_dict:
      return logs
    return _keras_internal.metrics_in_order(self.model, logs)

  def test_on_batch(self, x: Any, y: Any = None, *, sample_weight: Any = None,
                    return_dict: bool = False) -> Any:
    """The loss and metrics on one global batch, like `model.test_on_batch`."""
    dataset = self._one_batch(x, y, sample_weight, "test_on_batch")
    logs = self._test_logs(
        _step_batches.device_batches(dataset, len(self.devices), "pad", None,
                                     self._own_step("test_step")),
        keras.callbacks.CallbackList(model=self.model))
    if return_dict:
      return logs
    return _keras_internal.metrics_in_order(self.model, logs)

  def predict_on_batch(self, x: Any) -> Any:
    """The model's outputs on one global batch, like `model.predict_on_batch`."""
    return self.predict(x, batch_size=max(1, _rows(x)))

  def _one_batch(self, x, y, sample_weight, method, class_weight=None):
    """A dataset of the one batch of arrays `x`, `y`, `sample_weight`; built."""
    _keras_inputs.check_no_strategy(self.model, method)
    dataset = _keras_inputs.global_batches(
        x, y, sample_weight, max(1, _rows(x)), "pad", self.model, method,
        shuffle=False, class_weight=class_weight)
    self.build(dataset)
    return dataset

  def _train_call(self, steps):
    call = self._train_calls.get(steps)
    if call is None:
      call = tfspmd.pmap(_keras_internal.without_strategy(self._train_step),
                         self.axis_name, in_axes=(None, 0),
                         out_axes=(None, 0), steps=steps,
                         jit_compile=self._jit_compile())
      self._train_calls[steps] = call
    return call

  def _jit_compile(self):
    """Whether XLA compiles the steps: the model's own `jit_compile`.

    As in `fit`: Keras' default ('auto') is False on a machine with only
    CPUs, where XLA's compile costs more than it saves for most models.
    """
    return bool(self.model.jit_compile)

  # --- the per-device steps ---------------------------------------------------

  def _train_step(self, state, batch):
    """One device's training step on its rows of a global batch."""
    model, optimizer = self.model, self.model.optimizer
    trainable, non_trainable, optimizer_values, metrics = state
    x, y, sample_weight, rows = _step_batches.unpack(batch)
    if _keras_internal.overrides_step(model, "train_step"):
      return _custom_step.train_step(
          model, state,
          keras.utils.pack_x_y_sample_weight(x, y, sample_weight),
          self.axis_name, len(self.devices) * tfspmd.process_count())
    seeds = _keras_internal.seed_state_positions(model)
    with tf.GradientTape() as tape:
      tape.watch(trainable)
      with _batch_norm.recorded_moments(model, rows,
                                        self.axis_name) as moments:
        seeded = _keras_step.per_device_seeds(non_trainable, seeds, 1,
                                              self.axis_name)
        loss, y_pred, new_non_trainable, output_losses = (
            _keras_step.compiled_loss(
                model, trainable, seeded, metrics, x, y,
                _padded_rows.sample_weights_for_loss(sample_weight, rows,
                                                     self.axis_name), True))
      with keras.StatelessScope(
          state_mapping=list(zip(optimizer.variables, optimizer_values))):
        scaled_loss = optimizer.scale_loss(
            _keras_step.loss_for_distribution(loss, self.axis_name))
    # Moved back, every device's state is the same; the pmin tells tfspmd so
    # (the state is returned once, and a value computed from a per-device
    # one counts as per-device).
    new_non_trainable = [
        lax.pmin(value, self.axis_name) if k in seeds else value
        for k, value in enumerate(
            _keras_step.per_device_seeds(new_non_trainable, seeds, -1,
                                         self.axis_name))]
    _keras_step.check_no_untracked_variables(tape, model)
    grads = _keras_step.combined_gradients(
        tape.gradient(scaled_loss, trainable), self.axis_name,
        _keras_step.updates_sparse_rows(optimizer))
    with _keras_internal.stateless_optimizer(optimizer):
      trainable, optimizer_values = optimizer.stateless_apply(
          optimizer_values, grads, trainable)
    new_non_trainable, pooled = _batch_norm.moving_statistics_of_global_batch(
        model, non_trainable, new_non_trainable, moments, self.axis_name)
    non_trainable = _padded_rows.averaged_non_trainable(
        non_trainable, new_non_trainable, rows, self.axis_name, pooled)
    metrics, logs = _keras_step.metrics_of_global_batch(
        model, self.axis_name, metrics, loss, output_losses, x, y, y_pred,
        sample_weight, rows)
    return (trainable, non_trainable, optimizer_values, metrics), logs

  def _own_step(self, step):
    """`(model class name, step)` if the model overrides `step`, else None."""
    if _keras_internal.overrides_step(self.model, step):
      return type(self.model).__name__, step
    return None

  def _predict_step(self, trainable, non_trainable, batch):
    """One device's predictions for its rows of a global batch."""
    if _keras_internal.overrides_step(self.model, "predict_step"):
      return _custom_step.predict_step(
          self.model, trainable, non_trainable,
          keras.utils.pack_x_y_sample_weight(batch["x"]))
    kwargs = {}
    if _keras_internal.call_has_training_arg(self.model):
      kwargs["training"] = False
    y_pred, _ = self.model.stateless_call(trainable, non_trainable,
                                          batch["x"], **kwargs)
    return y_pred

  def _test_step(self, trainable, non_trainable, metrics, batch):
    """One device's evaluation step: the metrics updated by its rows."""
    x, y, sample_weight, rows = _step_batches.unpack(batch)
    if _keras_internal.overrides_step(self.model, "test_step"):
      return _custom_step.test_step(
          self.model, trainable, non_trainable, metrics,
          keras.utils.pack_x_y_sample_weight(x, y, sample_weight),
          self.axis_name, len(self.devices) * tfspmd.process_count())
    loss, y_pred, _, output_losses = _keras_step.compiled_loss(
        self.model, trainable, non_trainable, metrics, x, y,
        _padded_rows.sample_weights_for_loss(sample_weight, rows,
                                             self.axis_name), False)
    return _keras_step.metrics_of_global_batch(
        self.model, self.axis_name, metrics, loss, output_losses, x, y,
        y_pred, sample_weight, rows)


# Keras' batch size for arrays given none.
_KERAS_BATCH_SIZE = 32


def _rows(x):
  """The number of rows of arrays `x` (of their first leaf)."""
  return len(tf.nest.flatten(x)[0])


def _log_value(value):
  """A metric's result as Keras logs it: a float, or an array if not scalar."""
  array = np.asarray(value)
  return float(array) if array.ndim == 0 else array


def _callback_list(callbacks, verbose, dataset, model):
  """The callbacks of an `evaluate` or `predict`, with Keras' progress bar."""
  cardinality = int(dataset.cardinality())
  return keras.callbacks.CallbackList(
      callbacks, add_progbar=verbose != 0,
      verbose=1 if verbose == "auto" else verbose, epochs=1,
      steps=cardinality if cardinality >= 0 else None, model=model)


def _reads_model_per_batch(callback_list):
  """Whether a callback may read the model between batches.

  Keras' progress bar, history and TerminateOnNaN (which reads the logs)
  do not; any other callback with its own batch methods (ModelCheckpoint
  with `save_freq` in batches, the user's) may, so the model gets the
  devices' values after each batch then.
  """
  hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin",
           "on_batch_end")
  return any(
      getattr(type(callback), hook) is not getattr(keras.callbacks.Callback,
                                                   hook)
      for callback in callback_list.callbacks
      if not isinstance(callback, (keras.callbacks.ProgbarLogger,
                                   keras.callbacks.History,
                                   keras.callbacks.TerminateOnNaN))
      for hook in hooks)


def _validates_after(epoch, validation_freq):
  """Whether `fit` validates at the end of `epoch` (counted from 0)."""
  if isinstance(validation_freq, (list, tuple)):
    return epoch + 1 in validation_freq
  return (epoch + 1) % validation_freq == 0


def _model_variables(model):
  """The variables the state holds, in its order: four lists."""
  return (list(model.trainable_variables),
          list(model.non_trainable_variables),
          list(model.optimizer.variables), list(model.metrics_variables))


def _same_variables(these, those):
  return [[id(v) for v in part] for part in these] == [
      [id(v) for v in part] for part in those]
