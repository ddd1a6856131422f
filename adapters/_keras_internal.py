"""Every private Keras name `adapters` uses, in one place.

Keras 3 runs a model statelessly through public methods (`stateless_call`,
`stateless_compute_loss`, a `Metric`'s variables in a `StatelessScope`), but
three pieces of its stateless training step are private or refused on the
TensorFlow backend:
  - building the compiled loss, metrics and optimizer before the first step
    (`Trainer._symbolic_build`);
  - the loss tracker `fit` reports as 'loss' (`Trainer._loss_tracker`) and
    the forward pass's losses handed to `compute_loss`
    (`Layer._losses_override`), as Keras' JAX trainer does;
  - `optimizer.stateless_apply`, which the TensorFlow backend's optimizer
    refuses (it would break `tf.distribute`): `stateless_optimizer` gives the
    optimizer the backend-neutral methods of `BaseOptimizer` while a step
    traces.
The suite runs on the Keras versions below; another version is an error
here, at import, rather than a wrong number later.
"""

import contextlib
import types

import keras

SUPPORTED_KERAS_VERSIONS = ("3.15",)

if not keras.__version__.startswith(SUPPORTED_KERAS_VERSIONS):
  raise ImportError(
      f"adapters' Keras training uses private Keras internals tested with "
      f"Keras {', '.join(SUPPORTED_KERAS_VERSIONS)}, but Keras "
      f"{keras.__version__} is installed (TensorFlow 2.21 brings Keras 3.15).")

# pylint: disable=g-import-not-at-top,wrong-import-position
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.optimizers.base_optimizer import BaseOptimizer
# pylint: enable=g-import-not-at-top,wrong-import-position

# The TensorFlow optimizer's versions of these go through tf.distribute and
# need tf.Variables; BaseOptimizer's work on the tensors of a StatelessScope.
_BASE_OPTIMIZER_METHODS = (
    "stateless_apply", "assign", "assign_add", "assign_sub",
    "_backend_update_step", "_apply_weight_decay",
    "_backend_increment_gradient_accumulators")


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


def overrides_train_step(model):
  """True if the model's class replaces Keras' TensorFlow `train_step`."""
  return type(model).train_step is not TensorFlowTrainer.train_step


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
def stateless_optimizer(optimizer):
  """Lets a TensorFlow-backend optimizer run `stateless_apply`.

  Inside, the optimizer has `BaseOptimizer`'s methods for the names above,
  and a `_var_key` that finds each model variable's slot by the key the
  optimizer was built with (the TensorFlow key reads `variable.value`,
  which inside a StatelessScope is a tensor without one).
  """
  original_key = optimizer._var_key  # pylint: disable=protected-access
  keys = {id(v): original_key(v)
          for v in optimizer._trainable_variables}  # pylint: disable=protected-access

  def var_key(variable):
    key = keys.get(id(variable))
    return original_key(variable) if key is None else key

  patched = {name: types.MethodType(getattr(BaseOptimizer, name), optimizer)
             for name in _BASE_OPTIMIZER_METHODS}
  patched["_var_key"] = var_key
  for name, method in patched.items():
    object.__setattr__(optimizer, name, method)
  try:
    yield optimizer
  finally:
    for name in patched:
      object.__delattr__(optimizer, name)
