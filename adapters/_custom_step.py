"""A model's own `train_step`, `test_step` and `predict_step` on each device.

A Keras user who overrides `train_step` writes it for variables: the
forward pass reads them, a `tf.GradientTape` differentiates the loss by
`self.trainable_variables`, `self.optimizer.apply` writes them, metrics
`update_state`. Each device runs that code unchanged, inside a
`keras.StatelessScope` whose mapping holds the values the trainer carries:
reads see them and writes are recorded, and the recorded values are the
step's new state. What MirroredStrategy does around a replica's step is
done around each device's:

- a Keras loss is divided by the number of devices (Keras'
  `scale_loss_for_distribution`, which reads the strategy's replica count)
  and `optimizer.apply` sums the devices' gradients first, so the weights
  move as MirroredStrategy moves them;
- a tape started in the step watches the carried trainable values, and
  its gradient by a trainable variable is the gradient by that value (a
  variable read in a StatelessScope is a tensor, which a tape cannot
  trace back to the variable);
- metric variables are merged as their `aggregation` says ('sum': each
  device accumulates from zero but the first, from the state, and the
  devices' values are added up, as MirroredStrategy's on-read sums are),
  so a log named after a metric is its result over the global batch;
  other logs are the devices' mean, as Keras reduces a replica's logs
  under MirroredStrategy.

The tape, the loss scaling and a Keras variable's `handle` (which a tape
not made for the step would ask for) are TensorFlow's and Keras' own,
replaced while any step is traced (`tf.GradientTape` is then this module's
subclass); they act differently only in the thread tracing a step. The
model's optimizers' `apply` is replaced on the instance for the trace, so
the steps of the data-parallel models are traced one at a time.
"""

import contextlib
import threading

import tensorflow as tf

import keras
from tfspmd import lax

from . import _keras_internal
from . import _keras_step

# The trace of a custom step in this thread: `_Trace` or None.
_local = threading.local()
_install_lock = threading.Lock()
_installed = {"count": 0, "saved": None}
# One step's trace at a time: it replaces methods on the model's optimizers.
_trace_lock = threading.Lock()


class _Trace:
  """What the replaced functions need while a step of this thread traces."""

  def __init__(self, num_devices, carried, trainable):
    self.num_devices = num_devices
    # id(variable) -> the value its reads give in the step.
    self.carried = carried
    # The carried values of the trainable variables, which a tape watches.
    self.trainable = trainable

  def mapped(self, structure):
    """`structure` with each carried variable replaced by its value."""
    return tf.nest.map_structure(
        lambda item: self.carried.get(id(item), item), structure)


def _current():
  return getattr(_local, "trace", None)


class _StepTape(tf.GradientTape):
  """`tf.GradientTape`, which in a custom step sees the carried variables."""

  def __enter__(self):
    tape = super().__enter__()
    trace = _current()
    if trace is not None:
      self.watch(trace.trainable)
    return tape

  def gradient(self, target, sources, output_gradients=None,
               unconnected_gradients=tf.UnconnectedGradients.NONE):
    trace = _current()
    if trace is not None:
      sources = trace.mapped(sources)
    return super().gradient(target, sources, output_gradients,
                            unconnected_gradients)


def _scale_loss(original):
  def scale(value):
    trace = _current()
    if trace is None:
      return original(value)
    return value / tf.cast(trace.num_devices, value.dtype)
  return scale


def _unscale_loss(original):
  def unscale(value):
    trace = _current()
    if trace is None:
      return original(value)
    return value * tf.cast(trace.num_devices, value.dtype)
  return unscale


def _guarded_handle(original):
  """A Keras variable's `handle`, refused for a carried one in a step.

  A tape asks a variable for its handle to find its reads; in a step the
  reads are the carried values, which `_StepTape` maps the variable to. A
  tape that is not one (a GradientTape imported by name) would get no
  gradient, or Keras' AttributeError on a tensor.
  """
  def handle(variable):
    trace = _current()
    if trace is not None and id(variable) in trace.carried:
      raise ValueError(
          "a tape other than tf.GradientTape() asked for the gradient by a "
          "model variable in a data-parallel train_step: a GradientTape "
          "imported by name (from tensorflow import GradientTape) cannot "
          "see the values the devices carry for the variables. Start the "
          "step's tape as tf.GradientTape().")
    return original.__get__(variable, type(variable))
  return property(handle)


@contextlib.contextmanager
def _replaced_functions():
  """`tf.GradientTape`, Keras' loss scaling and `handle`, for every thread.

  The replacements act only in a thread tracing a step (`_current`); the
  originals come back when the last trace that installed them ends.
  """
  # Both found (or an ImportError naming them) before anything is replaced.
  losses = _keras_internal.loss_scaling_module()
  variable_class = _keras_internal.variable_class_with_handle()
  with _install_lock:
    if _installed["count"] == 0:
      saved = (tf.GradientTape, losses.scale_loss_for_distribution,
               losses.unscale_loss_for_distribution,
               vars(variable_class)["handle"])
      _installed["saved"] = saved
      tf.GradientTape = _StepTape
      losses.scale_loss_for_distribution = _scale_loss(saved[1])
      losses.unscale_loss_for_distribution = _unscale_loss(saved[2])
      variable_class.handle = _guarded_handle(saved[3])
    _installed["count"] += 1
  try:
    yield
  finally:
    with _install_lock:
      _installed["count"] -= 1
      if _installed["count"] == 0:
        (tf.GradientTape, losses.scale_loss_for_distribution,
         losses.unscale_loss_for_distribution,
         variable_class.handle) = _installed["saved"]


@contextlib.contextmanager
def _tracing(trace):
  if _current() is not None:
    raise ValueError("a model's train_step runs a model's train_step: one "
                     "step of a data-parallel model cannot run another.")
  with _replaced_functions():
    _local.trace = trace
    try:
      yield
    finally:
      _local.trace = None


@contextlib.contextmanager
def _combining_apply(optimizer, scope, axis_name):
  """`optimizer.apply` sums the devices' gradients, then updates statelessly.

  The updated weights and optimizer variables are assigned in `scope`, as
  `apply` assigns them, so what the step reads after it is updated. The
  optimizer is within `_keras_internal.stateless_optimizer`.
  """
  sparse = _keras_step.updates_sparse_rows(optimizer)
  applying = []

  def apply(grads, trainable_variables=None):
    if applying:
      # `stateless_apply`'s own call, within the one below.
      return type(optimizer).apply(optimizer, grads, trainable_variables)
    built = _keras_internal.built_for(optimizer)
    if trainable_variables is not None and (
        [id(v) for v in trainable_variables] != [id(v) for v in built]):
      raise ValueError(
          "optimizer.apply in a data-parallel train_step must update the "
          "model's trainable variables, all of them, in their order "
          "(self.trainable_variables): the optimizer was built for them.")
    grads = list(grads)
    if grads and all(g is None for g in grads):
      raise ValueError(
          "optimizer.apply in a data-parallel train_step got no gradient "
          "at all (every one is None): compute the loss inside the step's "
          "tf.GradientTape() block.")
    grads = _keras_step.combined_gradients(grads, axis_name, sparse)
    values = [scope.get_current_value(v) for v in built]
    optimizer_values = [scope.get_current_value(v)
                        for v in optimizer.variables]
    applying.append(True)
    try:
      values, optimizer_values = optimizer.stateless_apply(
          optimizer_values, grads, values)
    finally:
      applying.pop()
    for variable, value in zip(list(built) + list(optimizer.variables),
                               list(values) + list(optimizer_values)):
      variable.assign(value)

  def apply_gradients(grads_and_vars):
    grads, variables = zip(*grads_and_vars)
    apply(grads, variables)
    return optimizer.iterations

  object.__setattr__(optimizer, "apply", apply)
  object.__setattr__(optimizer, "apply_gradients", apply_gradients)
  try:
    yield
  finally:
    object.__delattr__(optimizer, "apply")
    object.__delattr__(optimizer, "apply_gradients")


@contextlib.contextmanager
def _other_optimizers_refused(model, step):
  """Makes the `apply` of the model's other optimizers raise tfspmd's error.

  Only `model.optimizer`'s gradients are combined and its state carried
  from step to step; a step that applies another optimizer held by the
  model (a GAN's `d_optimizer`) is refused where it calls it.
  """
  others = {name: value for name, value in vars(model).items()
            if isinstance(value, keras.optimizers.Optimizer) and
            value is not model.optimizer}

  def refusal(name):
    def refuse(*args, **kwargs):
      del args, kwargs
      raise ValueError(
          f"{type(model).__name__}.{step.__name__} applies the optimizer "
          f"self.{name}: on several devices only the optimizer given to "
          f"compile(optimizer=...) has its gradients combined and its state "
          f"carried. Update the weights with self.optimizer (one optimizer "
          f"for all of them), or train a model with optimizers of its own "
          f"(a GAN's) with model.fit on one device.")
    return refuse

  for name, optimizer in others.items():
    object.__setattr__(optimizer, "apply", refusal(name))
    object.__setattr__(optimizer, "apply_gradients", refusal(name))
  try:
    yield
  finally:
    for optimizer in others.values():
      object.__delattr__(optimizer, "apply")
      object.__delattr__(optimizer, "apply_gradients")


def _first_device_only(variables, values, axis_name):
  """`values`, each summed variable's zeroed on every device but the first.

  A metric's accumulator ('sum' aggregation) then counts the state once
  and each device's rows once when the devices' values are added up, also
  after a step that resets it.
  """
  first = tf.equal(lax.axis_index(axis_name), 0)
  return [tf.where(first, value, tf.zeros_like(value))
          if getattr(variable, "aggregation", "none") == "sum" else value
          for variable, value in zip(variables, values)]


def _merged(variables, values, axis_name):
  """The variables' values after every device's step, by their `aggregation`.

  'sum' (a metric's accumulators, started by `_first_device_only`): the
  devices' values added up; 'only_first_replica': the first device's;
  otherwise the devices' mean (an integer's largest). A value the same on
  every device costs no collective.
  """
  merged = list(values)
  sums, means = [], []
  for k, (variable, value) in enumerate(zip(variables, values)):
    aggregation = getattr(variable, "aggregation", "none")
    if aggregation == "sum":
      sums.append(k)
    elif aggregation == "only_first_replica":
      merged[k] = lax.all_gather(value, axis_name)[0]
    elif value.dtype.is_floating:
      means.append(k)
    else:
      merged[k] = lax.pmax(value, axis_name)
  for kind, reduce in ((sums, lax.psum), (means, lax.pmean)):
    if kind:
      for k, total in zip(kind, reduce([values[k] for k in kind], axis_name)):
        merged[k] = total
  return merged


def _flat_logs(logs):
  """The logs with nested dicts flattened into them, as Keras logs them."""
  flat = {}
  for name, value in dict(logs).items():
    if isinstance(value, dict):
      flat.update(_flat_logs(value))
    else:
      flat[name] = value
  return flat


def _logs(model, raw_logs, metrics, axis_name):
  """The step's logs, the same on every device.

  A log named after a metric is its result over the merged state; another
  float is the devices' mean, as Keras reduces a replica's logs under
  MirroredStrategy; anything else is the first device's.
  """
  with keras.StatelessScope(
      state_mapping=list(zip(model.metrics_variables, metrics))):
    results = model.get_metrics_result()
  logs = {}
  for name, value in _flat_logs(raw_logs).items():
    if name in results:
      logs[name] = results[name]
      continue
    value = tf.convert_to_tensor(value)
    logs[name] = (lax.pmean(value, axis_name) if value.dtype.is_floating
                  else lax.all_gather(value, axis_name)[0])
  return logs


def _run(model, step, data, variables, values, axis_name, num_devices,
         training):
  """Runs `step(data)` with `variables` holding `values` (lists by part).

  Returns:
    The values the step left in each part's variables, and its logs.
  """
  mapping = [pair for part in zip(variables, values) for pair in zip(*part)]
  with _trace_lock, contextlib.ExitStack() as stack:
    if training:
      # Finds each variable's slots while its value is still the variable's.
      stack.enter_context(_keras_internal.stateless_optimizer(
          model.optimizer))
    scope = stack.enter_context(keras.StatelessScope(
        state_mapping=mapping, collect_losses=True))
    carried = {id(v): scope.get_current_value(v)
               for part in variables for v in part}
    stack.enter_context(_tracing(_Trace(
        num_devices, carried, [carried[id(v)] for v in variables[0]])))
    if training:
      stack.enter_context(_combining_apply(model.optimizer, scope, axis_name))
    stack.enter_context(_other_optimizers_refused(model, step))
    raw_logs = step(data)
    _check_only_carried_assigned(model, step, scope, variables)
  return [[scope.get_current_value(v) for v in part]
          for part in variables], raw_logs


def _check_only_carried_assigned(model, step, scope, variables):
  """Raises if the step assigned a variable the trainer does not carry.

  Such a variable (a second optimizer's, a layer's attribute outside the
  model) would be written on no device and read again at its old value.
  """
  carried = {id(v) for part in variables for v in part}
  stray = [key for key in scope.state_mapping if key not in carried]
  if not stray:
    return
  named = {id(v): v.path for v in _all_keras_variables(model)}
  names = ", ".join(sorted(named.get(key, "a variable outside the model")
                           for key in stray))
  raise ValueError(
      f"{type(model).__name__}.{step.__name__} assigns variables that are "
      f"not the model's, its optimizer's or its metrics' ({names}); on "
      f"several devices only those are carried from step to step. Keep "
      f"state in the model (layers' weights, metrics) and update weights "
      f"with self.optimizer.")


def _all_keras_variables(model):
  found = list(model.variables) + list(model.metrics_variables)
  for value in vars(model).values():
    if isinstance(value, keras.optimizers.Optimizer):
      found += list(value.variables)
  return found


def train_step(model, state, data, axis_name, num_devices):
  """The model's own `train_step` on this device's rows of a global batch.

  Args:
    model: The compiled Keras model; its optimizer is built.
    state: `(trainable, non_trainable, optimizer, metrics)` values, in the
      order of the model's and optimizer's variable lists.
    data: This device's rows, as Keras gives them to `train_step`.
    axis_name: The pmap axis the batch is split over.
    num_devices: How many devices the batch is split over.

  Returns:
    `(state, logs)`: the state after every device's step, the same on each
    device, and the step's logs.
  """
  trainable, non_trainable, optimizer_values, metrics = state
  seeds = _keras_internal.seed_state_positions(model)
  variables = (list(model.trainable_variables),
               list(model.non_trainable_variables),
               list(model.optimizer.variables), list(model.metrics_variables))
  seeded = _keras_step.per_device_seeds(non_trainable, seeds, 1, axis_name)
  new, raw_logs = _run(
      model, model.train_step, data, variables,
      (trainable, seeded, optimizer_values,
       _first_device_only(variables[3], metrics, axis_name)),
      axis_name, num_devices, training=True)
  # The optimizer's updates come from the summed gradients: the same on
  # every device, as they are kept.
  trainable, optimizer_values = new[0], new[2]
  moved_back = _keras_step.per_device_seeds(new[1], seeds, -1, axis_name)
  non_trainable = _merged(variables[1], moved_back, axis_name)
  # Moved back, every device's seed state is the same; the pmin tells
  # tfspmd so.
  for k in seeds:
    non_trainable[k] = lax.pmin(moved_back[k], axis_name)
  metrics = _merged(variables[3], new[3], axis_name)
  return ((trainable, non_trainable, optimizer_values, metrics),
          _logs(model, raw_logs, metrics, axis_name))


def test_step(model, trainable, non_trainable, metrics, data, axis_name,
              num_devices):
  """The model's own `test_step`: `(metrics, logs)`, as `train_step`."""
  variables = (list(model.trainable_variables),
               list(model.non_trainable_variables), [],
               list(model.metrics_variables))
  new, raw_logs = _run(
      model, model.test_step, data, variables,
      (trainable, non_trainable, [],
       _first_device_only(variables[3], metrics, axis_name)),
      axis_name, num_devices, training=False)
  metrics = _merged(variables[3], new[3], axis_name)
  return metrics, _logs(model, raw_logs, metrics, axis_name)


def predict_step(model, trainable, non_trainable, data):
  """The model's own `predict_step` on this device's rows: its outputs."""
  mapping = list(zip(model.trainable_variables, trainable)) + list(
      zip(model.non_trainable_variables, non_trainable))
  with keras.StatelessScope(state_mapping=mapping):
    return model.predict_step(data)
