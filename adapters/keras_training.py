"""Data-parallel training of an unchanged Keras 3 model through pmap.

`KerasTrainer(model).fit(dataset, epochs=...)` trains a compiled Keras model
(TensorFlow backend) on every local device, as `model.fit` would on one:

- the model's trainable and non-trainable variables, the optimizer's
  variables and the compiled metrics' variables are the pmap's state, carried
  as replicated arguments (`in_axes=None`) from call to call within an
  epoch;
- the model stays the one place the values live: they go back into its
  variables at the end of every epoch (before the callbacks' `on_epoch_end`)
  and are read from it again before the next step, so what callbacks or the
  user assign (a learning rate, `set_weights`, `load_weights`, restored
  best weights) is what training and `evaluate` go on from;
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
- with `remainder='pad'`, a batch that does not divide by the devices is
  padded with rows that count nowhere: the real rows' sample weights are
  scaled so that the loss and gradients are those of the unpadded batch,
  the metrics weigh padding rows 0, and BatchNormalization leaves them out
  of its batch statistics.

With the default loss reduction (the mean over the batch), the mean of the
devices' gradients is the gradient of the global batch, so the training is
`fit`'s up to float rounding. Non-trainable variables a step updates
(BatchNormalization's moving statistics) are averaged over the devices,
each weighted by its real rows: the moving mean is `fit`'s, the moving
variance the mean of the devices' batch variances (not the global batch's
variance, since each device normalizes by its own batch statistics).
"""

import contextlib
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
      ImportError: If the installed Keras keeps a private attribute the
        adapters use elsewhere than the tested versions do.
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
    _keras_internal.check_instance_attributes(model)
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
    self._variables = None
    self._devices_ahead = False
    self._known_learning_rate = None
    self._reset_metrics = None
    self._train_calls = {}
    self._test_call = None

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
  # epoch the model's weights are those of the last epoch end; the learning
  # rate, the value a batch-level callback sets, is read after each batch's
  # callbacks (one scalar).

  @property
  def state(self):
    """The training state: `(trainable, non_trainable, optimizer, metrics)`.

    Four lists of replicated `tfspmd.ShardedArray`s, in the order of
    `model.trainable_variables`, `model.non_trainable_variables`,
    `model.optimizer.variables` and `model.metrics_variables`, read from the
    model (from the devices while a `fit` epoch runs); None before the
    first batch builds the model. Assign a state of the same structure,
    shapes and dtypes (e.g. from `adapters.checkpoint.restore`) to continue
    from it: it is written into the model's variables.
    """
    if self._state is not None and not self._devices_ahead:
      self._pull()
    return self._state

  @state.setter
  def state(self, value):
    if self._state is None:
      raise ValueError(
          "KerasTrainer.state can be set only once the model is built: call "
          "build(dataset) (or fit) first.")
    self._state = self._checked_state(value)
    self._devices_ahead = True
    self.sync_to_model()

  def _checked_state(self, value):
    """`value` as a state of replicated arrays, if it matches the model's."""
    expected = [len(part) for part in self._variables]
    got = None
    if isinstance(value, (tuple, list)) and len(value) == 4 and all(
        isinstance(part, (tuple, list)) for part in value):
      got = [len(part) for part in value]
    if got != expected:
      given = (f"{got}" if got is not None else
               f"a {type(value).__name__}" if not isinstance(value, (
                   tuple, list)) else f"{len(value)} parts")
      raise ValueError(
          f"KerasTrainer.state: expected 4 lists with {expected} values "
          f"(trainable, non-trainable, optimizer, metrics), got {given}.")
    for i, (part, variables) in enumerate(zip(value, self._variables)):
      for j, (leaf, variable) in enumerate(zip(part, variables)):
        _check_state_leaf(f"state[{i}][{j}]", leaf, variable)
    return tuple([self._replicated(v) for v in part] for part in value)

  def build(self, data):
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
    self._train_calls = {}
    self._test_call = None
    self._devices_ahead = False
    self._pull()
    self._reset_metrics = self._state[3]

  def sync_to_model(self):
    """Writes the devices' state into the model's and optimizer's variables.

    Only values the model does not have yet: a model changed since (e.g. by
    `set_weights`) is left as it is.
    """
    if self._state is None or not self._devices_ahead:
      return
    for variables, values in zip(self._variables, self._state):
      for variable, value in zip(variables, values):
        variable.assign(np.asarray(value))
    self._devices_ahead = False

  def _pull(self):
    """Reads the model's variables into the devices' state."""
    if not _same_variables(_model_variables(self.model), self._variables):
      raise RuntimeError(
          f"KerasTrainer: the variables of {self.model.name!r} changed while "
          f"fit ran (was it compiled again in a callback?). Compile the model "
          f"before fit; a later fit or evaluate builds the new one.")
    self._state = tuple([self._replicated(v) for v in part]
                        for part in self._variables)
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
          sample_weight=None, remainder="error"):
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
      sample_weight: Per-example weights, when `x` is an array.
      remainder: 'error' or 'pad', for a global batch that does not divide
        by the devices (see `adapters.tf_data.device_batches`). Padding rows
        change nothing: they are left out of the loss, the gradients, the
        metrics and BatchNormalization's statistics.

    Returns:
      The `keras.callbacks.History` of the run (also `model.history`).

    Raises:
      TypeError, ValueError: For a bad argument, naming it, before any step.
    """
    _check_fit_arguments(epochs, initial_epoch, steps_per_epoch, verbose,
                         callbacks)
    dataset = self._dataset(x, y, sample_weight, batch_size, remainder, "fit")
    self.build(dataset)
    model = self.model
    steps_per_call = _steps_per_execution(model)
    if steps_per_epoch is not None and steps_per_epoch % steps_per_call:
      raise ValueError(
          f"KerasTrainer.fit: steps_per_epoch={steps_per_epoch} must be a "
          f"multiple of the model's steps_per_execution={steps_per_call}, so "
          f"that every epoch ends at the end of a call.")
    batches = self._device_batches(dataset, remainder, steps_per_call)
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
    step = 0
    logs = {}
    for batch in batches:
      steps = batch_steps(batch)
      callback_list.on_train_batch_begin(step)
      state = self._step_state()
      if not step:
        state = state[:3] + (self._reset_metrics,)
      self._state, step_logs = self._train_call(steps)(state, batch)
      self._devices_ahead = True
      step += steps
      logs = {name: float(np.asarray(value)[0, -1])
              for name, value in step_logs.items()}
      callback_list.on_train_batch_end(step - 1, logs)
      if self.model.stop_training:
        break
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

  def evaluate(self, x, y=None, *, batch_size=None, sample_weight=None,
               remainder="error"):
    """The compiled loss and metrics of the model on some data.

    The model's current variables are used (those `fit` trained, or any the
    user assigned since).

    Args:
      x, y, batch_size, sample_weight: As for `fit`.
      remainder: As for `fit`.

    Returns:
      A dict from metric name ('loss' and the compiled metrics) to a float.
    """
    dataset = self._dataset(x, y, sample_weight, batch_size, remainder,
                            "evaluate")
    self.build(dataset)
    trainable, non_trainable = self._step_state()[:2]
    metrics = self._reset_metrics
    logs = {}
    if self._test_call is None:
      self._test_call = tfspmd.pmap(
          self._test_step, self.axis_name, in_axes=(None, None, None, 0),
          out_axes=None)
    for batch in self._device_batches(dataset, remainder, None):
      metrics, logs = self._test_call(trainable, non_trainable, metrics, batch)
    return {name: float(np.asarray(value)) for name, value in logs.items()}

  def _dataset(self, x, y, sample_weight, batch_size, remainder, method):
    """The global batches of `fit` / `evaluate`, checked before any step."""
    if remainder not in ("error", "pad"):
      raise ValueError(
          f"KerasTrainer.{method}: `remainder` must be 'error' or 'pad', got "
          f"{remainder!r}.")
    dataset = _as_dataset(x, y, sample_weight, batch_size, method)
    _check_elements(dataset.element_spec, self.model, method)
    return dataset

  def _device_batches(self, dataset, remainder, steps_per_call):
    """`dataset` as placed dict batches: x, y, sample_weight, rows (if padded).

    With remainder='pad' each batch is padded to a multiple of the devices
    of all processes here, and its 'rows' mask (1 for a row of the dataset,
    0 for padding) tells the steps which rows to leave out: a sample weight
    of 0 cannot, since a dataset may weight its own rows 0.
    """
    multiple = len(self.devices) * tfspmd.process_count()
    pad = remainder == "pad"

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

    return tf_data.device_batches(
        dataset.map(keyed), num_devices=len(self.devices),
        steps_per_call=steps_per_call)

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
    x, y, sample_weight, rows = _unpack(batch)
    seeds = _keras_internal.seed_state_positions(model)
    with tf.GradientTape() as tape:
      tape.watch(trainable)
      with self._padding_left_out_of_batch_norm(rows):
        loss, y_pred, new_non_trainable = self._loss(
            trainable, self._per_device_seeds(non_trainable, seeds, 1),
            metrics, x, y, self._loss_weight(sample_weight, rows), True)
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
    non_trainable = self._averaged_updates(non_trainable, new_non_trainable,
                                           rows)
    metrics, logs = self._update_metrics(metrics, loss, x, y, y_pred,
                                         sample_weight, rows)
    return (trainable, non_trainable, optimizer_values, metrics), logs

  def _loss_weight(self, sample_weight, rows):
    """The sample weights that give padded batches the loss of unpadded ones.

    Keras' default reduction divides the weighted sum by the number of rows,
    padding included, on each device; scaling each real row's weight by
    (rows with padding) / (real rows) over all devices makes the mean of
    the devices' losses the loss of the real rows. The regularization
    losses, added unweighted, are left as they are.
    """
    if rows is None:
      return sample_weight
    padded = lax.psum(tf.cast(tf.shape(rows)[0], tf.float32), self.axis_name)
    real = lax.psum(tf.reduce_sum(rows), self.axis_name)
    scaled = rows * (padded / real)
    if sample_weight is None:
      return scaled

    def weighted(weight):
      if not weight.dtype.is_floating:
        weight = tf.cast(weight, tf.float32)
      shape = [-1] + [1] * (weight.shape.rank - 1)
      return weight * tf.reshape(tf.cast(scaled, weight.dtype), shape)

    return tf.nest.map_structure(weighted, sample_weight)

  def _padding_left_out_of_batch_norm(self, rows):
    if rows is None:
      return contextlib.nullcontext()
    return _keras_internal.batch_norm_row_weights(self.model, rows)

  def _averaged_updates(self, old_values, new_values, rows):
    """The non-trainable floats a step updated, averaged over the devices.

    Each device's value weighs as many of its rows as are real, so a device
    holding only padding rows counts for nothing, and BatchNormalization's
    moving mean is that of the real rows of the global batch.
    """
    if rows is None:
      average = lambda value: lax.pmean(value, self.axis_name)
    else:
      count = tf.reduce_sum(rows)
      total = lax.psum(count, self.axis_name)
      average = lambda value: lax.psum(
          value * tf.cast(count, value.dtype), self.axis_name) / tf.cast(
              total, value.dtype)
    return [new if new is old or not new.dtype.is_floating else average(new)
            for old, new in zip(old_values, new_values)]

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
    x, y, sample_weight, rows = _unpack(batch)
    loss, y_pred, _ = self._loss(trainable, non_trainable, metrics, x, y,
                                 self._loss_weight(sample_weight, rows), False)
    return self._update_metrics(metrics, loss, x, y, y_pred, sample_weight,
                                rows)

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

  def _update_metrics(self, metrics, loss, x, y, y_pred, sample_weight, rows):
    """The loss tracker and compiled metrics, updated on the global batch.

    Padding rows (`rows` 0) weigh nothing: the metrics see the global batch
    as the dataset gave it.
    """
    model = self.model
    gather = lambda t: tf.nest.map_structure(
        lambda v: lax.all_gather(v, self.axis_name, tiled=True), t)
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
          lax.pmean(loss, self.axis_name), sample_weight=size)
      if rows is None:
        logs = model.compute_metrics(x_all, y_all, y_pred_all,
                                     sample_weight=weight_all)
      else:
        logs = _keras_internal.compute_metrics_of_rows(
            model, y_all, y_pred_all, weight_all, rows_all)
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


def _check_fit_arguments(epochs, initial_epoch, steps_per_epoch, verbose,
                         callbacks):
  """Raises, naming the argument, for a value `model.fit` would not take."""
  for name, value, least in (("epochs", epochs, 0),
                             ("initial_epoch", initial_epoch, 0),
                             ("steps_per_epoch", steps_per_epoch, 1)):
    if value is None and name == "steps_per_epoch":
      continue
    if not _is_int(value) or value < least:
      raise ValueError(
          f"KerasTrainer.fit: `{name}` must be an int >= {least}"
          f"{' or None' if name == 'steps_per_epoch' else ''}, got "
          f"{value!r}.")
  if verbose not in ("auto", 0, 1, 2) or isinstance(verbose, bool):
    raise ValueError(
        f"KerasTrainer.fit: `verbose` must be 'auto', 0, 1 or 2, got "
        f"{verbose!r}.")
  if callbacks is None:
    return
  if not isinstance(callbacks, (list, tuple)):
    raise TypeError(
        f"KerasTrainer.fit: `callbacks` must be a list of "
        f"keras.callbacks.Callback, got a {type(callbacks).__name__}.")
  for k, callback in enumerate(callbacks):
    if not isinstance(callback, keras.callbacks.Callback):
      raise TypeError(
          f"KerasTrainer.fit: callbacks[{k}] is a "
          f"{type(callback).__module__}.{type(callback).__name__}, not a "
          f"Keras 3 keras.callbacks.Callback (a tf.keras / Keras 2 callback "
          f"does not work with a Keras 3 model).")


def _is_int(value):
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _as_dataset(x, y, sample_weight, batch_size, method):
  """`x` if it is a dataset of global batches, else arrays batched in order."""
  if isinstance(x, tf.data.Dataset):
    given = [name for name, value in (("y", y), ("batch_size", batch_size),
                                      ("sample_weight", sample_weight))
             if value is not None]
    if given:
      raise ValueError(
          f"KerasTrainer.{method}: with a tf.data.Dataset, give no "
          f"{', '.join(f'`{name}`' for name in given)}: the dataset's "
          f"elements are the global batches (x, y[, sample_weight]).")
    return x
  if batch_size is None:
    raise ValueError(
        f"KerasTrainer.{method}: give `x` as a tf.data.Dataset of global "
        f"batches, or arrays `x` and `y` with the global `batch_size`.")
  if not _is_int(batch_size) or batch_size < 1:
    raise ValueError(
        f"KerasTrainer.{method}: `batch_size` must be an int >= 1, got "
        f"{batch_size!r}.")
  arrays = {name: value for name, value in (
      ("x", x), ("y", y), ("sample_weight", sample_weight))
            if value is not None}
  lengths = {name: _length(name, value, method)
             for name, value in arrays.items()}
  if len(set(lengths.values())) > 1:
    raise ValueError(
        f"KerasTrainer.{method}: the arrays have different numbers of "
        f"examples ({', '.join(f'{n}: {k}' for n, k in lengths.items())}); "
        f"they need one row per example.")
  return tf.data.Dataset.from_tensor_slices(tuple(arrays.values())).batch(
      batch_size)


def _length(name, value, method):
  """The number of examples in the array (or arrays) `value`."""
  leaves = tf.nest.flatten(value)
  lengths = {len(leaf) if hasattr(leaf, "__len__") else None
             for leaf in leaves}
  if None in lengths or len(lengths) != 1:
    raise ValueError(
        f"KerasTrainer.{method}: `{name}` must be an array (or a structure "
        f"of arrays) with the examples along axis 0, or a tf.data.Dataset; "
        f"got {type(value).__name__}"
        f"{'' if None in lengths else f' with lengths {sorted(lengths)}'}.")
  return lengths.pop()


def _check_elements(spec, model, method):
  """Raises, naming the part at fault, for batches `fit` could not use."""
  caller = f"KerasTrainer.{method}"
  tf_data.check_element_spec(spec, caller, "x")
  try:
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(spec)
  except ValueError:
    raise ValueError(
        f"{caller}: the dataset's elements must be `x`, `(x,)`, `(x, y)` or "
        f"`(x, y, sample_weight)`; got a tuple of {len(spec)}.") from None
  for name, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
    for path, leaf in tf_data.named_leaves(part, name):
      if leaf is not None and leaf.dtype == tf.string:
        raise ValueError(
            f"{caller}: {path} holds strings, which cannot go onto the "
            f"devices. Turn them into numbers in the input pipeline, e.g. "
            f"`dataset.map(lambda x, y: (lookup(x), y))` with a "
            f"keras.layers.StringLookup or TextVectorization adapted "
            f"beforehand, and give the model that layer's output as input.")
  users = _keras_internal.compiled_users_of_targets(model)
  if y is None and users:
    raise ValueError(
        f"{caller}: the batches have no targets `y`, but the model was "
        f"compiled with a {' and '.join(users)}, which need them. Give "
        f"elements (x, y) (or arrays `x` and `y`), or compile without "
        f"loss and metrics for a model whose losses are its own (add_loss).")
  _check_sample_weight(y, sample_weight, caller)


def _check_sample_weight(y, sample_weight, caller):
  """Raises unless each sample weight fits its targets' leading axes.

  As in Keras' losses, the weights of a target of shape `(batch, d1, ...)`
  have shape `(batch,)`, `(batch, d1)`, ... (trailing axes of size 1 are
  squeezed away); one weight leaf may serve every target.
  """
  if sample_weight is None or y is None:
    return
  targets = tf_data.named_leaves(y, "y")
  weights = tf_data.named_leaves(sample_weight, "sample_weight")
  if len(weights) not in (1, len(targets)):
    raise ValueError(
        f"{caller}: `sample_weight` has {len(weights)} leaves for "
        f"{len(targets)} targets `y`; give one per target, or one for all.")
  pairs = ([(weights[0], target) for target in targets] if len(weights) == 1
           else list(zip(weights, targets)))
  for (weight_path, weight), (target_path, target) in pairs:
    if not (weight.dtype.is_floating or weight.dtype.is_integer):
      raise TypeError(
          f"{caller}: {weight_path} has dtype {weight.dtype.name}; sample "
          f"weights are numbers.")
    shape = weight.shape.as_list()
    while len(shape) > 1 and shape[-1] == 1:
      shape.pop()
    leading = target.shape.as_list()[:len(shape)]
    if len(shape) > target.shape.rank or not tf.TensorShape(
        shape[1:]).is_compatible_with(leading[1:]):
      raise ValueError(
          f"{caller}: {weight_path} has shape {weight.shape}, which does not "
          f"fit {target_path} of shape {target.shape}: per-example weights "
          f"have shape (batch,), or the target's leading axes (batch, ...).")


def _check_state_leaf(path, value, variable):
  """Raises unless `value` can stand for `variable` in the state."""
  if isinstance(value, tfspmd.ShardedArray) and not _placement.is_replicated(
      value):
    raise ValueError(
        f"KerasTrainer.{path} ({variable.path!r}) is split over the devices; "
        f"the state holds replicated values.")
  try:
    dtype = tf.as_dtype(value.dtype if hasattr(value, "dtype")
                        else np.asarray(value).dtype)
    shape = tuple(value.shape if hasattr(value, "shape")
                  else np.shape(value))
  except TypeError:
    raise TypeError(
        f"KerasTrainer.{path} ({variable.path!r}) must be an array, got "
        f"{type(value).__name__}.") from None
  if dtype != tf.as_dtype(variable.dtype):
    raise TypeError(
        f"KerasTrainer.{path} ({variable.path!r}) must have dtype "
        f"{tf.as_dtype(variable.dtype).name}, got {dtype.name}.")
  if shape != tuple(variable.shape):
    raise ValueError(
        f"KerasTrainer.{path} ({variable.path!r}) must have shape "
        f"{tuple(variable.shape)}, got {shape}.")


def _model_variables(model):
  """The variables the state holds, in its order: four lists."""
  return (list(model.trainable_variables),
          list(model.non_trainable_variables),
          list(model.optimizer.variables), list(model.metrics_variables))


def _same_variables(these, those):
  return [[id(v) for v in part] for part in these] == [
      [id(v) for v in part] for part in those]


def _unpack(batch):
  """A step's dict batch as `(x, y, sample_weight, rows)`, None if absent."""
  return (batch["x"], batch.get("y"), batch.get("sample_weight"),
          batch.get("rows"))


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
