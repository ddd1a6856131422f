"""Data-parallel training of an unchanged Keras 3 model through pmap.

`KerasTrainer(model).fit(dataset, epochs=...)` trains a compiled Keras model
(TensorFlow backend) on every local device, as `model.fit` would on one:

- the model's trainable and non-trainable variables, the optimizer's
  variables and the compiled metrics' variables are the pmap's state, carried
  as replicated arguments (`in_axes=None`) from call to call and never
  written to the model's variables while training;
- each global batch is split over the devices (`adapters.tf_data`); each
  device runs Keras' functional step on its rows: `model.stateless_call`
  under a `tf.GradientTape`, the compiled loss (`stateless_compute_loss`),
  the gradients `pmean`-ed over the data axis, and the optimizer's
  `stateless_apply`;
- the compiled metrics and the reported loss are updated once per step on
  the whole global batch (predictions `all_gather`-ed from the devices), so
  they equal `fit`'s;
- `model.compile(steps_per_execution=K)` runs K steps per pmap call
  (`pmap(..., steps=K)`), as it runs K steps per call in `fit`;
- the trained values go back into the model's variables at the end of every
  epoch (before the callbacks' `on_epoch_end`) and of `fit`.

With the default loss reduction (the mean over the batch) and equal
per-device batches, the mean of the devices' gradients is the gradient of
the global batch, so the training is `fit`'s up to float rounding.
Non-trainable variables a step updates (BatchNormalization's moving
statistics) are averaged over the devices: exact for moving means, close
for moving variances.
"""

import warnings

import numpy as np
import tensorflow as tf

import keras
import tfspmd
from tfspmd import lax

from adapters import _keras_internal
from adapters import _placement
from adapters import tf_data


class KerasTrainer:
  """Trains a compiled Keras model data-parallel over the local devices.

  Attributes:
    model: The Keras model; its variables hold the trained values after each
      epoch of `fit`.
    devices: The devices of the data axis, in order.
    axis_name: The pmap axis name of the data axis.

  Example:
    >>> import numpy as np, keras
    >>> from adapters import keras_training
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> trainer = keras_training.KerasTrainer(model)
    >>> x, y = np.ones((64, 3), np.float32), np.ones((64, 1), np.float32)
    >>> history = trainer.fit(x, y, batch_size=32, epochs=2, verbose=0)
    >>> sorted(history.history), len(history.history["loss"])
    (['loss'], 2)
  """

  def __init__(self, model, *, num_devices=None, axis_name="data"):
    """Prepares `model` for data-parallel training.

    Args:
      model: A Keras 3 `keras.Model`, compiled with an optimizer and a loss,
        whose `train_step` is Keras' own.
      num_devices: How many local devices to train on; None for all.
      axis_name: The name of the data axis, for collectives.

    Raises:
      TypeError: If `model` is not a Keras 3 model.
      ValueError: If it is not compiled, or replaces `train_step`.
    """
    if not isinstance(model, keras.Model):
      raise TypeError(
          f"KerasTrainer: `model` must be a Keras 3 `keras.Model`, got "
          f"{type(model).__module__}.{type(model).__name__}. (A tf_keras / "
          f"Keras 2 model has no stateless path; rebuild it with Keras 3.)")
    if not model.compiled or model.optimizer is None:
      raise ValueError(
          f"KerasTrainer: the model {model.name!r} is not compiled with an "
          f"optimizer; call model.compile(optimizer=..., loss=..., "
          f"metrics=...) first, as for model.fit.")
    if _keras_internal.overrides_train_step(model):
      raise ValueError(
          f"KerasTrainer: {type(model).__name__} overrides train_step, which "
          f"cannot run statelessly on several devices: KerasTrainer runs "
          f"Keras' own stateless step (stateless_call, compute_loss, "
          f"optimizer.stateless_apply). Move the custom logic into call() or "
          f"compute_loss(), or train with model.fit on one device.")
    self.model = model
    self.devices = _placement.data_devices(num_devices)
    self.axis_name = axis_name
    self._state = None
    self._reset_metrics = None
    self._train_calls = {}
    self._test_call = None

  # --- state ---------------------------------------------------------------

  @property
  def state(self):
    """The training state: `(trainable, non_trainable, optimizer, metrics)`.

    Four lists of replicated `tfspmd.ShardedArray`s, in the order of
    `model.trainable_variables`, `model.non_trainable_variables`,
    `model.optimizer.variables` and `model.metrics_variables`; None before
    the first batch builds the model. Assign a state of the same structure
    (e.g. from `adapters.checkpoint.restore`) to continue from it.
    """
    return self._state

  @state.setter
  def state(self, value):
    if self._state is None:
      raise ValueError(
          "KerasTrainer.state can be set only once the model is built: call "
          "build(dataset) (or fit) first.")
    expected = [len(part) for part in self._state]
    got = [len(part) for part in value] if len(value) == 4 else None
    if got != expected:
      raise ValueError(
          f"KerasTrainer.state: expected 4 lists with {expected} values "
          f"(trainable, non-trainable, optimizer, metrics), got "
          f"{got if got is not None else f'{len(value)} parts'}.")
    self._state = tuple(
        [self._replicated(v) for v in part] for part in value)

  def build(self, data):
    """Builds the model, loss, metrics and optimizer, and places the state.

    Called by `fit` and `evaluate`; call it yourself to get `state` before
    training (to restore a checkpoint into it).

    Args:
      data: A `tf.data.Dataset` of global batches `(x, y[, sample_weight])`,
        or its `element_spec`.
    """
    if self._state is not None:
      return
    spec = data.element_spec if isinstance(data, tf.data.Dataset) else data
    _keras_internal.build(self.model, spec)
    model = self.model
    model.reset_metrics()
    parts = (model.trainable_variables, model.non_trainable_variables,
             model.optimizer.variables, model.metrics_variables)
    self._state = tuple([self._replicated(v) for v in part] for part in parts)
    self._reset_metrics = self._state[3]

  def sync_to_model(self):
    """Writes the trained state into the model's and optimizer's variables."""
    if self._state is None:
      return
    model = self.model
    parts = (model.trainable_variables, model.non_trainable_variables,
             model.optimizer.variables, model.metrics_variables)
    for variables, values in zip(parts, self._state):
      for variable, value in zip(variables, values):
        variable.assign(np.asarray(value))

  def _replicated(self, value):
    if isinstance(value, tfspmd.ShardedArray) and _placement.is_replicated(
        value) and value.devices() == tuple(self.devices):
      return value
    array = tf.convert_to_tensor(np.asarray(value))
    return _placement.pack([array] * len(self.devices), self.devices,
                           split=False)

  # --- fit and evaluate ------------------------------------------------------

  def fit(self, x, y=None, *, batch_size=None, epochs=1, initial_epoch=0,
          steps_per_epoch=None, verbose="auto", callbacks=None,
          remainder="error"):
    """Trains the model for `epochs` epochs, like `model.fit`.

    Args:
      x: A `tf.data.Dataset` of global batches `(x, y)` or `(x, y,
        sample_weight)`, iterated once per epoch (shuffle it there); or the
        inputs as NumPy arrays or tensors, with `y` and `batch_size`, taken
        in order.
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
      callbacks: Keras callbacks; they see the model with the trained values
        at the end of each epoch.
      remainder: 'error' or 'pad', for a global batch that does not divide
        by the devices (see `adapters.tf_data.device_batches`).

    Returns:
      The `keras.callbacks.History` of the run (also `model.history`).
    """
    dataset = _as_dataset(x, y, batch_size, "fit")
    self.build(dataset)
    model = self.model
    steps_per_call = _steps_per_execution(model)
    if steps_per_epoch is not None and steps_per_epoch % steps_per_call:
      raise ValueError(
          f"KerasTrainer.fit: steps_per_epoch={steps_per_epoch} must be a "
          f"multiple of the model's steps_per_execution={steps_per_call}, so "
          f"that every epoch ends at the end of a call.")
    batches = tf_data.device_batches(
        dataset, num_devices=len(self.devices), steps_per_call=steps_per_call,
        remainder=remainder)
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
        logs = self._fit_epoch(
            epoch, batches if stream is None else _take_steps(
                stream, steps_per_epoch), callback_list) or logs
        if model.stop_training:
          break
    finally:
      if stream is not None:
        stream.close()
    callback_list.on_train_end(logs)
    return model.history

  def _fit_epoch(self, epoch, batches, callback_list):
    """One epoch of `fit`; returns its logs (empty if there was no batch)."""
    callback_list.on_epoch_begin(epoch)
    state = self._state[:3] + (self._reset_metrics,)
    step = 0
    logs = {}
    for batch in batches:
      steps = batch_steps(batch)
      callback_list.on_train_batch_begin(step)
      state, step_logs = self._train_call(steps)(state, batch)
      self._state = state
      step += steps
      logs = {name: float(np.asarray(value)[0, -1])
              for name, value in step_logs.items()}
      callback_list.on_train_batch_end(step - 1, logs)
    if not step:
      self.model.stop_training = True
      warnings.warn(
          "KerasTrainer.fit: the dataset ran out of batches; training stops. "
          "With steps_per_epoch, repeat the dataset (dataset.repeat()).",
          stacklevel=3)
      return logs
    self.sync_to_model()
    callback_list.on_epoch_end(epoch, logs)
    return logs

  def evaluate(self, x, y=None, *, batch_size=None, remainder="error"):
    """The compiled loss and metrics of the trained model on some data.

    Args:
      x, y, batch_size: As for `fit`.
      remainder: As for `fit`.

    Returns:
      A dict from metric name ('loss' and the compiled metrics) to a float.
    """
    dataset = _as_dataset(x, y, batch_size, "evaluate")
    self.build(dataset)
    trainable, non_trainable = self._state[:2]
    metrics = self._reset_metrics
    logs = {}
    if self._test_call is None:
      self._test_call = tfspmd.pmap(
          self._test_step, self.axis_name, in_axes=(None, None, None, 0),
          out_axes=None)
    for batch in tf_data.device_batches(
        dataset, num_devices=len(self.devices), remainder=remainder):
      metrics, logs = self._test_call(trainable, non_trainable, metrics, batch)
    return {name: float(np.asarray(value)) for name, value in logs.items()}

  def _train_call(self, steps):
    call = self._train_calls.get(steps)
    if call is None:
      call = tfspmd.pmap(self._train_step, self.axis_name, in_axes=(None, 0),
                         out_axes=(None, 0), steps=steps)
      self._train_calls[steps] = call
    return call

  # --- the per-device steps ---------------------------------------------------

  def _train_step(self, state, batch):
    """One device's training step on its rows of a global batch."""
    model, optimizer = self.model, self.model.optimizer
    trainable, non_trainable, optimizer_values, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    seeds = _keras_internal.seed_state_positions(model)
    with tf.GradientTape() as tape:
      tape.watch(trainable)
      loss, y_pred, new_non_trainable = self._loss(
          trainable, self._per_device_seeds(non_trainable, seeds, 1), metrics,
          x, y, sample_weight, True)
      with keras.StatelessScope(
          state_mapping=list(zip(optimizer.variables, optimizer_values))):
        scaled_loss = optimizer.scale_loss(loss)
    # Moved back, every device's state is the same; the pmin tells tfspmd so
    # (the state is returned once, and a value computed from a per-device
    # one counts as per-device).
    new_non_trainable = [
        lax.pmin(value, self.axis_name) if k in seeds else value
        for k, value in enumerate(
            self._per_device_seeds(new_non_trainable, seeds, -1))]
    _check_no_untracked_variables(tape, model)
    grads = tape.gradient(scaled_loss, trainable)
    grads = [None if g is None else lax.pmean(g, self.axis_name)
             for g in grads]
    with _keras_internal.stateless_optimizer(optimizer):
      trainable, optimizer_values = optimizer.stateless_apply(
          optimizer_values, grads, trainable)
    non_trainable = [
        new if new is old or not new.dtype.is_floating
        else lax.pmean(new, self.axis_name)
        for old, new in zip(non_trainable, new_non_trainable)]
    metrics, logs = self._update_metrics(metrics, loss, x, y, y_pred,
                                         sample_weight)
    return (trainable, non_trainable, optimizer_values, metrics), logs

  def _per_device_seeds(self, non_trainable, seeds, sign):
    """Moves each seed generator's state to this device's stream (sign -1: back).

    Keras advances a generator's state in its second element only, so
    adding the device's position to the first gives each device streams
    no other device reaches: a Dropout draws a different mask on each
    device, and device 0 draws what Keras' own fit draws.
    """
    if not seeds:
      return non_trainable
    position = tf.cast(lax.axis_index(self.axis_name), tf.int64)
    return [value + sign * tf.cast(tf.stack([position, 0]), value.dtype)
            if k in seeds else value for k, value in enumerate(non_trainable)]

  def _test_step(self, trainable, non_trainable, metrics, batch):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    loss, y_pred, _ = self._loss(trainable, non_trainable, metrics, x, y,
                                 sample_weight, False)
    return self._update_metrics(metrics, loss, x, y, y_pred, sample_weight)

  def _loss(self, trainable, non_trainable, metrics, x, y, sample_weight,
            training):
    """The compiled loss of this device's rows, as Keras' JAX trainer has it."""
    model = self.model
    kwargs = {}
    if _keras_internal.call_has_training_arg(model):
      kwargs["training"] = training
    y_pred, non_trainable, losses = model.stateless_call(
        trainable, non_trainable, x, return_losses=True, **kwargs)
    with _keras_internal.forward_losses(model, losses):
      loss, (_, non_trainable, _) = model.stateless_compute_loss(
          trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred,
          sample_weight=sample_weight, training=training)
    return loss, y_pred, non_trainable

  def _update_metrics(self, metrics, loss, x, y, y_pred, sample_weight):
    """The loss tracker and compiled metrics, updated on the global batch."""
    model = self.model
    gather = lambda t: tf.nest.map_structure(
        lambda v: lax.all_gather(v, self.axis_name, tiled=True), t)
    x_all, y_all, y_pred_all, weight_all = (
        gather(x), gather(y), gather(y_pred), gather(sample_weight))
    first_input = next(v for v in tf.nest.flatten(x_all) if v is not None)
    with keras.StatelessScope(
        state_mapping=list(zip(model.metrics_variables, metrics))) as scope:
      _keras_internal.loss_tracker(model).update_state(
          lax.pmean(loss, self.axis_name),
          sample_weight=tf.shape(first_input)[0])
      logs = model.compute_metrics(x_all, y_all, y_pred_all,
                                   sample_weight=weight_all)
    new_metrics = []
    for variable, old in zip(model.metrics_variables, metrics):
      new = scope.get_current_value(variable)
      new_metrics.append(old if new is None else new)
    return new_metrics, logs


def batch_steps(batch):
  """The number of steps in an item of `device_batches(steps_per_call=K)`."""
  return int(tf.nest.flatten(batch)[0].shape[1])


def _take_steps(stream, steps):
  """Items of `stream` until they hold `steps` steps (or it ends)."""
  taken = 0
  while taken < steps:
    batch = next(stream, None)
    if batch is None:
      return
    taken += batch_steps(batch)
    yield batch


def _steps_per_execution(model):
  steps = getattr(model, "steps_per_execution", 1) or 1
  return int(steps)


def _as_dataset(x, y, batch_size, method):
  if isinstance(x, tf.data.Dataset):
    if y is not None or batch_size is not None:
      raise ValueError(
          f"KerasTrainer.{method}: with a tf.data.Dataset, give neither `y` "
          f"nor `batch_size`: the dataset's elements are the global batches "
          f"(x, y[, sample_weight]).")
    return x
  if y is None or batch_size is None:
    raise ValueError(
        f"KerasTrainer.{method}: give `x` as a tf.data.Dataset of global "
        f"batches, or arrays `x` and `y` with the global `batch_size`.")
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def _check_no_untracked_variables(tape, model):
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
