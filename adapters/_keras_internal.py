"""Every private Keras name `tfspmd.adapters` uses, in one place.

Keras 3 runs a model statelessly through public methods (`stateless_call`,
`stateless_compute_loss`, a `Metric`'s variables in a `StatelessScope`), but
three pieces of its stateless training step are private or refused on the
TensorFlow backend:
  - building the compiled loss, metrics and optimizer before the first step
    (`Trainer._symbolic_build`);
  - the loss tracker `fit` reports as 'loss' (`Trainer._loss_tracker`) and
    the forward pass's losses handed to `compute_loss`
    (`Layer._losses_override`), as Keras' JAX trainer does, and the loss of
    each output, which the compiled loss (`Trainer._compile_loss`) hands its
    trackers;
  - `optimizer.stateless_apply`, which the TensorFlow backend's optimizer
    refuses (it would break `tf.distribute`): `stateless_optimizer` gives the
    optimizer the backend-neutral methods of `BaseOptimizer` while a step
    traces.
Also here: the optimizer's learning-rate variable, whether a loss or
metrics were compiled, BatchNormalization's batch moments, recorded
with padding rows left out, and the module whose loss scaling a model's
own `train_step` runs under (`loss_scaling_module`).
Any Keras that keeps these names where the tested versions
(`TESTED_KERAS_VERSIONS`, rerun with tests/keras_versions.sh) keep them is
accepted. One that moved a name is an ImportError naming it and the installed
version: at import for the private classes and methods, and when a
`KerasTrainer` is made for the attributes Keras sets on each compiled model
and its optimizer, rather than an AttributeError or a wrong number in the
middle of training.
"""

import contextlib
import functools
import importlib
import types

import keras
import tensorflow as tf

# The latest patch of each Keras minor TensorFlow 2.21 accepts (keras>=3.12),
# each passing the adapters' tests.
TESTED_KERAS_VERSIONS = ("3.12.4", "3.13.2", "3.14.1", "3.15.1")

# The TensorFlow optimizer's versions of these go through tf.distribute and
# need tf.Variables; BaseOptimizer's work on the tensors of a StatelessScope.
_BASE_OPTIMIZER_METHODS = (
    "stateless_apply", "assign", "assign_add", "assign_sub",
    "_backend_update_step", "_apply_weight_decay",
    "_backend_increment_gradient_accumulators")

# (module, class, the attributes this module reads or replaces on it).
PRIVATE_CLASSES = (
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer",
     ("train_step", "test_step", "predict_step", "_symbolic_build",
      "_flatten_metrics_in_order")),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer",
     _BASE_OPTIMIZER_METHODS + (
         "_var_key", "_backend_apply_gradients", "_get_variable_index",
         "_clip_gradients", "_update_model_variables_moving_average")),
    ("keras.src.trainers.compile_utils", "CompileMetrics", ("_flatten_y",)),
    ("keras.layers", "Layer", ("_flatten_layers",)),
    ("keras.layers", "BatchNormalization", ("_moments",)),
    ("keras.optimizers", "LossScaleOptimizer",
     ("check_finite", "_stateless_handle_finite_grads",
      "_stateless_handle_non_finite_grads")),
)

# Keras sets these on each instance (in the model's or optimizer's `__init__`
# or in `compile`), so only a compiled model can show whether they exist.
# (A BatchNormalization's `_reduction_axes` and the compiled metrics'
# `_flat_metrics` and `_flat_weighted_metrics` exist only in some models, and
# are read only where they do.)
MODEL_ATTRIBUTES = ("_loss_tracker", "_losses_override",
                    "_call_has_training_arg", "_seed_generators",
                    "_compile_loss", "_compile_metrics")
OPTIMIZER_ATTRIBUTES = ("_trainable_variables", "_learning_rate")


def unsupported_keras_error(missing_names):
  """The error for private Keras names the installed Keras does not have."""
  return ImportError(
      f"tfspmd.adapters' Keras training needs private Keras names that the "
      f"installed Keras {keras.__version__} does not have (moved or removed): "
      f"{', '.join(missing_names)}. tfspmd.adapters is tested with Keras "
      f"{', '.join(TESTED_KERAS_VERSIONS)}: install one of those, or adapt "
      f"tfspmd.adapters._keras_internal to this version.")


_LOSS_SCALING = ("keras.src.losses.loss",
                 ("scale_loss_for_distribution",
                  "unscale_loss_for_distribution"))


def loss_scaling_module():
  """Keras' module of `scale_loss_for_distribution` and its inverse.

  A Keras loss divides itself by the replicas of the `tf.distribute`
  strategy in use through them (its `reduce_weighted_values`, and the
  trainer's loss tracker through the inverse), looking them up in this
  module when called.

  Raises:
    ImportError: If the installed Keras keeps them elsewhere.
  """
  name, functions = _LOSS_SCALING
  try:
    module = importlib.import_module(name)
  except ModuleNotFoundError:
    raise unsupported_keras_error([name]) from None
  missing = [f"{name}.{f}" for f in functions if not hasattr(module, f)]
  if missing:
    raise unsupported_keras_error(missing)
  return module


def variable_class_with_handle():
  """The class of Keras' TensorFlow variables that defines `handle`.

  A `tf.GradientTape` asks a variable for its resource handle to find its
  reads.

  Raises:
    ImportError: If no class of `keras.Variable` defines it.
  """
  owner = next((cls for cls in keras.Variable.__mro__
                if "handle" in vars(cls)), None)
  if owner is None:
    raise unsupported_keras_error(["keras.Variable.handle"])
  return owner


def import_private_classes(private_classes=PRIVATE_CLASSES):
  """Imports each private class and checks it has the attributes used.

  Args:
    private_classes: `(module, class, attributes)` triples.

  Returns:
    A dict from each class's name to the class.

  Raises:
    ImportError: Naming every module, class or attribute that is missing and
      the installed Keras version.
    ModuleNotFoundError: If a module exists but something it imports does not.
  """
  classes, missing = {}, []
  for module_name, class_name, attributes in private_classes:
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
      # Only the module itself (or a package above it) missing means Keras
      # moved it; a dependency it fails to import is a different problem.
      if not (module_name + ".").startswith(f"{error.name}."):
        raise
      missing.append(module_name)
      continue
    cls = getattr(module, class_name, None)
    if cls is None:
      missing.append(f"{module_name}.{class_name}")
      continue
    missing.extend(f"{module_name}.{class_name}.{attribute}"
                   for attribute in attributes if not hasattr(cls, attribute))
    classes[class_name] = cls
  if missing:
    raise unsupported_keras_error(missing)
  return classes


def check_instance_attributes(model):
  """Checks a compiled model and its optimizer have the private attributes used.

  Args:
    model: A compiled Keras model.

  Raises:
    ImportError: Naming every attribute that is missing and the installed
      Keras version.
  """
  missing = [f"{owner_name}.{attribute}"
             for owner, owner_name, attributes in (
                 (model, "keras.Model", MODEL_ATTRIBUTES),
                 (inner_optimizer(model.optimizer),
                  "keras.optimizers.Optimizer", OPTIMIZER_ATTRIBUTES))
             for attribute in attributes if not hasattr(owner, attribute)]
  if missing:
    raise unsupported_keras_error(missing)


_PRIVATE = import_private_classes()
TensorFlowTrainer = _PRIVATE["TensorFlowTrainer"]
BaseOptimizer = _PRIVATE["BaseOptimizer"]


# Read at import, outside any strategy's scope (inside one, the replica
# context is None).
_DEFAULT_REPLICA = (tf.distribute.get_replica_context() or
                    contextlib.nullcontext())


def without_strategy(step):
  """`step`, traced in the default strategy's replica context.

  A function tfspmd maps traces in a replica context whose strategy counts
  the devices, for code written for `Strategy.run`. Keras' steps then
  scale their losses and all-reduce their gradients as under
  MirroredStrategy; the adapters do both themselves, as one-device `fit`
  computes, so their steps see no strategy.
  """
  @functools.wraps(step)
  def in_default_replica_context(*args, **kwargs):
    with _DEFAULT_REPLICA:
      return step(*args, **kwargs)

  return in_default_replica_context


def seed_state_positions(model):
  """Where in `model.non_trainable_variables` the layers' random seeds are.

  Each `keras.random.SeedGenerator` of a layer (a Dropout's, a noise
  layer's) keeps its state in a non-trainable variable; layers list their
  generators in the private `_seed_generators`.
  """
  states = {id(generator.state)
            for layer in model._flatten_layers(include_self=True)  # pylint: disable=protected-access
            for generator in getattr(layer, "_seed_generators", ())}
  return frozenset(k for k, variable in enumerate(model.non_trainable_variables)
                   if id(variable) in states)


def build(model, data_spec):
  """Creates the model's, compiled loss's, metrics' and optimizer's variables.

  Args:
    model: A compiled Keras model.
    data_spec: The structure of one batch, `(x, y[, sample_weight])`, as
      `tf.TensorSpec`s (a dataset's `element_spec`).
  """
  model._symbolic_build(data_batch=data_spec)  # pylint: disable=protected-access


def compilation(model):
  """What `model.compile` last set: a new compile gives other objects."""
  return (model.optimizer, model._compile_loss, model._compile_metrics,  # pylint: disable=protected-access
          model.steps_per_execution)


def overrides_step(model, step):
  """True if the model's class replaces Keras' TensorFlow `step` method.

  Args:
    model: A Keras model.
    step: 'train_step', 'test_step', 'predict_step' or another method of
      Keras' trainer ('compute_metrics').
  """
  return getattr(type(model), step) is not getattr(TensorFlowTrainer, step)


def metrics_in_order(model, logs):
  """`model.evaluate`'s result without return_dict: a list, or one value.

  The loss, then the compiled metrics in their order, then any other logs
  by name; a single value alone.
  """
  return model._flatten_metrics_in_order(logs)  # pylint: disable=protected-access


def call_has_training_arg(model):
  return model._call_has_training_arg  # pylint: disable=protected-access


def loss_tracker(model):
  """The metric `fit` reports as 'loss'."""
  return model._loss_tracker  # pylint: disable=protected-access


@contextlib.contextmanager
def forward_losses(model, losses):
  """Makes the losses `stateless_call` returned visible to `compute_loss`."""
  if not losses:
    yield
    return
  model._losses_override = losses  # pylint: disable=protected-access
  try:
    yield
  finally:
    model._losses_override = []  # pylint: disable=protected-access


@contextlib.contextmanager
def recorded_output_losses(model):
  """Records the loss of each output the compiled loss computes.

  For a model with several outputs, Keras' compiled loss updates a `Mean`
  tracker per output ('<output>_loss' in the logs) with that output's
  unweighted loss, inside `compute_loss`. A device's tracker would hold its
  own rows' loss only, so the values are recorded here for the trainer to
  update the trackers once per step with their mean over the devices.

  Args:
    model: A compiled Keras model.

  Yields:
    A list that `compute_loss`, run inside, fills with `(tracker, loss)`
    pairs in the order the trackers are updated.
  """
  compiled = model._compile_loss  # pylint: disable=protected-access
  trackers = [] if compiled is None else list(compiled.metrics)
  recorded = []
  for tracker in trackers:

    def update_state(values, sample_weight=None, tracker=tracker,
                     update=tracker.update_state):
      recorded.append((tracker, values))
      return update(values, sample_weight=sample_weight)

    object.__setattr__(tracker, "update_state", update_state)
  try:
    yield recorded
  finally:
    for tracker in trackers:
      object.__delattr__(tracker, "update_state")


def inner_optimizer(optimizer):
  """The optimizer that updates the weights: a LossScaleOptimizer's inner one.

  Keras wraps the compiled optimizer in a `LossScaleOptimizer` under a
  `mixed_float16` policy; the wrapper keeps a learning rate of its own,
  fixed at 0, and forwards `learning_rate` to the optimizer it wraps.
  """
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return optimizer.inner_optimizer
  return optimizer


def built_for(optimizer):
  """The variables `optimizer` (a LossScaleOptimizer's inner one) updates."""
  return list(inner_optimizer(optimizer)._trainable_variables)  # pylint: disable=protected-access


@contextlib.contextmanager
def stateless_optimizer(optimizer):
  """Lets a TensorFlow-backend optimizer run `stateless_apply`.

  Inside, the optimizer has `BaseOptimizer`'s methods for the names above,
  and a `_var_key` that finds each model variable's slot by the key the
  optimizer was built with (the TensorFlow key reads `variable.value`,
  which inside a StatelessScope is a tensor without one), and applies
  gradients without Keras' branches (`_apply_gradients_without_branches`). A
  `LossScaleOptimizer` keeps its own steps (its `apply` goes through
  `tf.distribute`) but selects between them rather than branching
  (`_loss_scaled_apply_without_branches`); the optimizer it wraps gets the
  methods.
  """
  if optimizer is not inner_optimizer(optimizer):
    object.__setattr__(optimizer, "stateless_apply", types.MethodType(
        _loss_scaled_apply_without_branches, optimizer))
    try:
      with stateless_optimizer(inner_optimizer(optimizer)):
        yield optimizer
    finally:
      object.__delattr__(optimizer, "stateless_apply")
    return
  original_key = optimizer._var_key  # pylint: disable=protected-access
  keys = {id(v): original_key(v)
          for v in optimizer._trainable_variables}  # pylint: disable=protected-access

  def var_key(variable):
    key = keys.get(id(variable))
    return original_key(variable) if key is None else key

  patched = {name: types.MethodType(getattr(BaseOptimizer, name), optimizer)
             for name in _BASE_OPTIMIZER_METHODS}
  patched["_var_key"] = var_key
  patched["_backend_apply_gradients"] = types.MethodType(
      _apply_gradients_without_branches, optimizer)
  for name, method in patched.items():
    object.__setattr__(optimizer, name, method)
  try:
    yield optimizer
  finally:
    for name in patched:
      object.__delattr__(optimizer, name)


def _loss_scaled_apply_without_branches(optimizer, optimizer_variables, grads,
                                        trainable_variables):
  """`LossScaleOptimizer.stateless_apply`, selecting instead of branching.

  Keras' own applies the gradients in one branch of an `ops.cond` on
  whether they are finite. A sparse gradient (an Embedding's) enters the
  branch as a captured tensor whose dense shape is then unknown, and the
  optimizer's update densifying it there has a number of rows pmap cannot
  place. Both outcomes are computed outside a branch and the step's values
  selected: a step whose gradients overflow leaves the weights as they were
  and halves the loss scale, as in `fit`.

  Args:
    optimizer: The LossScaleOptimizer.
    optimizer_variables: The values of its variables (its own, then the
      wrapped optimizer's).
    grads: The scaled gradients, one per trainable variable.
    trainable_variables: The values of the trainable variables.

  Returns:
    `(trainable_variables, optimizer_variables)` after the step.
  """
  finite = optimizer.check_finite(grads)
  applied = optimizer._stateless_handle_finite_grads(  # pylint: disable=protected-access
      optimizer_variables, grads, trainable_variables)
  skipped = optimizer._stateless_handle_non_finite_grads(  # pylint: disable=protected-access
      optimizer_variables, trainable_variables)
  return tuple([_select(finite, a, s) for a, s in zip(when_applied,
                                                         when_skipped)]
               for when_applied, when_skipped in zip(applied, skipped))


def _apply_gradients_without_branches(optimizer, grads, trainable_variables):
  """`BaseOptimizer._backend_apply_gradients`, selecting instead of branching.

  Keras' own branches (`ops.cond`) on whether a step applies the
  accumulated gradients (`gradient_accumulation_steps`) and whether it
  overwrites the weights by their moving averages (`ema_overwrite_frequency`);
  in a StatelessScope a value one branch assigns would be read outside it.
  As Keras' JAX optimizer does, both outcomes are computed and the step's
  values selected.

  Args:
    optimizer: The optimizer (not a LossScaleOptimizer) applying `grads`.
    grads: The gradients, one per trainable variable.
    trainable_variables: The variables to update.
  """
  steps = optimizer.gradient_accumulation_steps
  if steps:
    is_update_step = (optimizer._iterations + 1) % steps == 0  # pylint: disable=protected-access
    accumulators = [
        optimizer._accumulated_gradients[optimizer._get_variable_index(v)]  # pylint: disable=protected-access
        for v in trainable_variables]
    before = [(v, v.value) for v in
              list(trainable_variables) + list(optimizer.variables)]
    accumulated = [_select(is_update_step, tf.zeros_like(a.value),
                           g + a.value)
                   for g, a in zip(grads, accumulators)]
    grads = [_select(is_update_step, (g + a.value) / steps, g)
             for g, a in zip(grads, accumulators)]
  grads = optimizer._clip_gradients(grads)  # pylint: disable=protected-access
  optimizer._apply_weight_decay(trainable_variables)  # pylint: disable=protected-access
  optimizer._backend_update_step(grads, trainable_variables,  # pylint: disable=protected-access
                                 optimizer.learning_rate)
  if steps:
    for variable, value in before:
      variable.assign(_select(is_update_step, variable.value, value))
    for accumulator, value in zip(accumulators, accumulated):
      accumulator.assign(value)
  if optimizer.use_ema:
    optimizer._update_model_variables_moving_average(  # pylint: disable=protected-access
        optimizer._trainable_variables)  # pylint: disable=protected-access
    if optimizer.ema_overwrite_frequency:
      overwrite = (optimizer.iterations + 1) % (
          optimizer.ema_overwrite_frequency) == 0
      for variable, average in zip(
          optimizer._trainable_variables,  # pylint: disable=protected-access
          optimizer._model_variables_moving_average):  # pylint: disable=protected-access
        if average is not None:
          variable.assign(_select(overwrite, average.value, variable.value))


def _select(condition, if_true, if_false):
  """`tf.where` of a scalar condition, broadcast to the values' shape.

  DTensor (TF 2.21) crashes on a `SelectV2` whose condition is a scalar
  and whose values are not.
  """
  if_true = tf.convert_to_tensor(if_true)
  return tf.where(tf.broadcast_to(condition, tf.shape(if_true)), if_true,
                  if_false)


def learning_rate_variable(optimizer):
  """The optimizer's learning-rate variable; None for a schedule or callable."""
  rate = inner_optimizer(optimizer)._learning_rate  # pylint: disable=protected-access
  return rate if isinstance(rate, keras.Variable) else None


def compiled_users_of_targets(model):
  """What `compile` was given that needs targets `y`: the loss, metrics."""
  compiled = (("loss", model._compile_loss),  # pylint: disable=protected-access
              ("metrics", model._compile_metrics))  # pylint: disable=protected-access
  return [name for name, value in compiled if value is not None]


@contextlib.contextmanager
def batch_norm_moments(model, rows, pooled):
  """Records every BatchNormalization's batch moments, weighing rows by `rows`.

  Keras' BatchNormalization takes a mask only through Keras' mask
  propagation (shaped like the inputs less the feature axis, and refused
  for some layers), so padding rows are left out by giving each layer a
  `_moments` that weights the rows: the layer's own `mask`, if any, times
  `rows` along the batch axis. The moments it returns are recorded, with
  the count of rows they cover, for the trainer to pool over the devices.
  A layer made with `synchronized=True` normalizes by the moments of the
  global batch, as under a `tf.distribute` strategy: `pooled(count, mean,
  variance)` gives them from its device's.

  Args:
    model: The Keras model whose layers to change while inside.
    rows: A float tensor of shape `(batch,)`: 1 for a real row, 0 for a
      padding row; or None for a batch without padding.
    pooled: `pooled(count, mean, variance) -> (count, mean, variance)` of
      the global batch, from each device's moments.

  Yields:
    A list that each training-mode call of a BatchNormalization inside
    appends `(layer, count, mean, variance)` to, the last three per
    feature.
  """
  layers = [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
            if isinstance(layer, keras.layers.BatchNormalization)]
  recorded = []
  for layer in layers:
    object.__setattr__(layer, "_moments", functools.partial(
        _row_weighted_moments, layer, rows, recorded,
        pooled if layer.synchronized else None))
  try:
    yield recorded
  finally:
    for layer in layers:
      object.__delattr__(layer, "_moments")


def _row_weighted_moments(layer, rows, recorded, pooled, inputs, mask):
  """Mean and variance over `layer`'s reduction axes, rows weighted by `rows`.

  Those of the global batch where `pooled` is given.
  """
  rank = inputs.shape.rank
  if rows is None:
    weights = tf.ones([tf.shape(inputs)[0]] + [1] * (rank - 1), inputs.dtype)
  else:
    if inputs.shape[0] is not None and inputs.shape[0] != rows.shape[0]:
      raise ValueError(
          f"KerasTrainer(remainder='pad'): the BatchNormalization "
          f"{layer.name!r} gets {inputs.shape[0]} rows where the batch has "
          f"{rows.shape[0]}, so it cannot leave the padding rows out of its "
          f"batch statistics. Use batches that divide by the devices "
          f"(remainder='error').")
    weights = tf.reshape(tf.cast(rows, inputs.dtype), [-1] + [1] * (rank - 1))
  if mask is not None:
    weights = weights * tf.expand_dims(tf.cast(mask, inputs.dtype), -1)
  weights = tf.broadcast_to(weights, tf.shape(inputs))
  axes = layer._reduction_axes  # pylint: disable=protected-access
  count = tf.reduce_sum(weights, axes, keepdims=True)
  mean = tf.math.divide_no_nan(
      tf.reduce_sum(weights * inputs, axes, keepdims=True), count)
  # As tf.nn.moments: no gradient through the mean in the variance.
  squares = tf.math.squared_difference(inputs, tf.stop_gradient(mean))
  variance = tf.math.divide_no_nan(
      tf.reduce_sum(weights * squares, axes, keepdims=True), count)
  count, mean, variance = (tf.squeeze(t, axes) for t in (count, mean,
                                                         variance))
  if pooled is not None:
    count, mean, variance = pooled(count, mean, variance)
  recorded.append((layer, count, mean, variance))
  return mean, variance


def compute_metrics_of_rows(model, x, y, y_pred, sample_weight, rows):
  """`model.compute_metrics` with the rows of weight 0 in `rows` left out.

  Keras gives the compiled `metrics` no sample weights, and a step cannot
  drop rows (shapes are static on the devices), so each compiled metric is
  updated as `CompileMetrics.update_state` does, with `rows` as (or times)
  its sample weights. A model's own `compute_metrics` gets the rows as (or
  times) its `sample_weight`, and Keras' (its `super()`) updates the
  compiled metrics so.
  """
  compiled = model._compile_metrics  # pylint: disable=protected-access
  if not overrides_step(model, "compute_metrics"):
    if compiled is not None:
      _update_compiled_of_rows(compiled, y, y_pred, sample_weight, rows)
    return model.get_metrics_result()
  weight = (rows if sample_weight is None else tf.nest.map_structure(
      lambda w: _times_rows(w, rows), sample_weight))
  if compiled is None:
    return model.compute_metrics(x, y, y_pred, sample_weight=weight)

  def update_state(y_true, y_pred, sample_weight=None):
    _update_compiled_of_rows(compiled, y_true, y_pred, sample_weight, rows)

  object.__setattr__(compiled, "update_state", update_state)
  try:
    return model.compute_metrics(x, y, y_pred, sample_weight=weight)
  finally:
    object.__delattr__(compiled, "update_state")


def _update_compiled_of_rows(compiled, y, y_pred, sample_weight, rows):
  """`CompileMetrics.update_state`, the rows of weight 0 in `rows` left out."""
  if not compiled.built:
    compiled.build(y, y_pred)
  y_true = compiled._flatten_y(y)  # pylint: disable=protected-access
  y_pred = compiled._flatten_y(y_pred)  # pylint: disable=protected-access
  weights = ([None] * len(y_true) if sample_weight is None
             else compiled._flatten_y(sample_weight))  # pylint: disable=protected-access
  if len(weights) < len(y_true):
    weights = [weights[0]] * len(y_true)
  for metric, target, prediction in zip(
      compiled._flat_metrics, y_true, y_pred):  # pylint: disable=protected-access
    if metric:
      metric.update_state(target, prediction, sample_weight=rows)
  for metric, target, prediction, weight in zip(
      compiled._flat_weighted_metrics, y_true, y_pred, weights):  # pylint: disable=protected-access
    if metric:
      metric.update_state(target, prediction,
                          sample_weight=_times_rows(weight, rows))


def _times_rows(weight, rows):
  """Sample weights (or None) times a row mask, broadcast along the rows."""
  if weight is None:
    return rows
  weight = tf.cast(weight, rows.dtype)
  return weight * tf.reshape(rows, [-1] + [1] * (weight.shape.rank - 1))
