"""Checks of what `KerasTrainer` is given, each raising before any step.

The model (Keras 3, compiled, Keras' own `train_step`), the arguments of
`fit` as `model.fit` would take them, the data of `fit` and `evaluate` (a
dataset of global batches, or arrays batched here) and a `state` assigned
to the trainer. Each error names the argument or the part of the data at
fault, so that a bad call fails at once rather than deep in a traced step.
"""

import contextlib
import contextvars

import numpy as np
import tensorflow as tf

import keras
import tfspmd

from . import _keras_internal
from . import _placement
from . import tf_data


def check_model(model):
  """Raises unless `model` is a compiled Keras 3 model `KerasTrainer` can run.

  Args:
    model: What `KerasTrainer` was given as the model.

  Raises:
    TypeError: If `model` is not a Keras 3 model.
    ValueError: If it is not compiled.
    ImportError: If the installed Keras keeps a private attribute the
      adapters use elsewhere than the tested versions do.
  """
  check_keras_model(model)
  if not model.compiled or model.optimizer is None:
    raise ValueError(
        f"KerasTrainer: the model {model.name!r} is not compiled with an "
        f"optimizer; call model.compile(optimizer=..., loss=..., "
        f"metrics=...) first, as for model.fit.")
  _keras_internal.check_instance_attributes(model)


# Who the user called: 'model' for a data-parallel model's own methods.
_caller = contextvars.ContextVar("caller", default="KerasTrainer")


def called(method):
  """'KerasTrainer.fit', or 'model.fit' within `called_as('model')`."""
  return f"{_caller.get()}.{method}"


@contextlib.contextmanager
def called_as(name):
  """Within it, messages name the method the user called as `name.method`."""
  token = _caller.set(name)
  try:
    yield
  finally:
    _caller.reset(token)


def check_keras_model(model, caller="KerasTrainer"):
  """Raises unless `model` is a Keras 3 model."""
  if not isinstance(model, keras.Model):
    raise TypeError(
        f"{caller}: `model` must be a Keras 3 `keras.Model`, got "
        f"{type(model).__module__}.{type(model).__name__}. (A tf_keras / "
        f"Keras 2 model has no stateless path; rebuild it with Keras 3.)")


def check_no_strategy(model, method):
  """Raises if a `tf.distribute` strategy is in scope or holds the model.

  The devices' program divides each device's loss by the number of devices
  already; in a strategy's scope Keras would divide it again by the
  strategy's replicas (training at a fraction of the learning rate), and a
  model built in one has variables only that strategy may write.

  Args:
    model: The Keras model about to run.
    method: 'fit', 'evaluate', 'predict' or another method, for the message.
  """
  if tf.distribute.has_strategy():
    where = (f"inside the scope of a tf.distribute."
             f"{type(tf.distribute.get_strategy()).__name__}")
  elif model.distribute_strategy is not tf.distribute.get_strategy():
    where = (f"on a model built under the scope of a tf.distribute."
             f"{type(model.distribute_strategy).__name__}")
  else:
    return
  raise ValueError(
      f"{called(method)} {where}: tfspmd runs the model data-parallel over "
      f"the devices itself, and a strategy would distribute it a second "
      f"time. Build, compile and train the model outside any "
      f"`with strategy.scope():` (drop the strategy; "
      f"tfspmd.adapters.data_parallel(model) takes its place).")


def check_verbose(verbose, caller):
  """Raises unless `verbose` is one `model.fit` takes."""
  if verbose not in ("auto", 0, 1, 2) or isinstance(verbose, bool):
    raise ValueError(
        f"{caller}: `verbose` must be 'auto', 0, 1 or 2, got {verbose!r}.")


def check_fit_arguments(epochs, initial_epoch, steps_per_epoch, verbose,
                        callbacks):
  """Raises, naming the argument, for a value `model.fit` would not take."""
  for name, value, least in (("epochs", epochs, 0),
                             ("initial_epoch", initial_epoch, 0),
                             ("steps_per_epoch", steps_per_epoch, 1)):
    if value is None and name == "steps_per_epoch":
      continue
    if not _is_int(value) or value < least:
      raise ValueError(
          f"{called('fit')}: `{name}` must be an int >= {least}"
          f"{' or None' if name == 'steps_per_epoch' else ''}, got "
          f"{value!r}.")
  check_verbose(verbose, called("fit"))
  check_callbacks(callbacks, "fit")


def check_callbacks(callbacks, method):
  """Raises unless `callbacks` is None or a list of Keras 3 callbacks."""
  if callbacks is None:
    return
  if not isinstance(callbacks, (list, tuple)):
    raise TypeError(
        f"{called(method)}: `callbacks` must be a list of "
        f"keras.callbacks.Callback, got a {type(callbacks).__name__}.")
  for k, callback in enumerate(callbacks):
    if not isinstance(callback, keras.callbacks.Callback):
      raise TypeError(
          f"{called(method)}: callbacks[{k}] is a "
          f"{type(callback).__module__}.{type(callback).__name__}, not a "
          f"Keras 3 keras.callbacks.Callback (a tf.keras / Keras 2 callback "
          f"does not work with a Keras 3 model).")


def check_validation_arguments(validation_split, validation_data,
                               validation_freq):
  """Raises, naming the argument, for validation arguments fit cannot use."""
  if validation_split != 0 and (
      isinstance(validation_split, bool)
      or not isinstance(validation_split, (int, float, np.floating))
      or not 0 < validation_split < 1):
    raise ValueError(
        f"{called('fit')}: `validation_split` must be a float between 0 and "
        f"1 (the fraction of the arrays' last rows to validate on), got "
        f"{validation_split!r}.")
  if validation_data is not None and not isinstance(
      validation_data, tf.data.Dataset) and not (
          isinstance(validation_data, (tuple, list))
          and len(validation_data) in (2, 3)):
    given = (f"a {type(validation_data).__name__} of {len(validation_data)}"
             if isinstance(validation_data, (tuple, list))
             else f"a {type(validation_data).__name__}")
    raise ValueError(
        f"{called('fit')}: `validation_data` must be a tuple (x, y) or (x, "
        f"y, sample_weight) of arrays, or a tf.data.Dataset of global "
        f"batches; got {given}.")
  frequencies = (validation_freq if isinstance(validation_freq, (list, tuple))
                 else [validation_freq])
  if not frequencies or not all(_is_int(f) and f >= 1 for f in frequencies):
    raise ValueError(
        f"{called('fit')}: `validation_freq` must be an int >= 1 (validate "
        f"every that many epochs) or a list of epochs (counted from 1), got "
        f"{validation_freq!r}.")


def split_validation(x, y, sample_weight, validation_split):
  """The arrays' first rows to train on and last rows to validate on.

  As `model.fit(validation_split=...)`: the last `validation_split` of the
  rows (rounded so that `floor(rows * (1 - validation_split))` train),
  taken before any shuffling.

  Returns:
    `((x, y, sample_weight), validation_data)`, the validation data a
    tuple `(x, y, sample_weight)`.
  """
  if isinstance(x, tf.data.Dataset):
    raise ValueError(
        f"{called('fit')}: `validation_split` splits in-memory arrays; with a "
        "tf.data.Dataset give `validation_data` (e.g. dataset.skip / "
        "dataset.take of the batches).")
  rows = _length("x", x, "fit")
  split_at = int(np.floor(rows * (1.0 - validation_split)))
  if split_at in (0, rows):
    raise ValueError(
        f"{called('fit')}: validation_split={validation_split} of {rows} "
        f"rows leaves no rows to {'validate' if split_at else 'train'} on; "
        f"give more rows or another validation_split.")

  def part(start, end):
    return tuple(None if value is None else tf.nest.map_structure(
        lambda leaf: leaf[start:end], value)
                 for value in (x, y, sample_weight))

  return part(0, split_at), part(split_at, rows)


def check_steps_per_epoch(steps_per_epoch, steps_per_call):
  """Raises unless each epoch of `steps_per_epoch` steps ends with a call."""
  if steps_per_epoch is not None and steps_per_epoch % steps_per_call:
    raise ValueError(
        f"{called('fit')}: steps_per_epoch={steps_per_epoch} must be a "
        f"multiple of the model's steps_per_execution={steps_per_call}, so "
        f"that every epoch ends at the end of a call.")


def global_batches(x, y, sample_weight, batch_size, remainder, model, method,
                   shuffle=False, class_weight=None):
  """The global batches of `fit` / `evaluate`, checked before any step.

  Args:
    x, y, sample_weight, batch_size, remainder: As `KerasTrainer.fit` takes
      them.
    model: The compiled model the batches are for.
    method: 'fit', 'evaluate' or 'fit(validation_data)', for the error
      messages.
    shuffle: Whether arrays are reshuffled on every iteration of the
      dataset (every epoch); None as True.
    class_weight: None, or a dict from class index to the weight of the
      rows of that class, which become the batches' sample weights.

  Returns:
    A `tf.data.Dataset` of global batches `(x, y[, sample_weight])`.
  """
  if remainder not in ("error", "pad"):
    raise ValueError(
        f"{called(method)}: `remainder` must be 'error' or 'pad', got "
        f"{remainder!r}.")
  dataset = _as_dataset(x, y, sample_weight, batch_size, method, shuffle)
  if class_weight is not None:
    dataset = _with_class_weights(dataset, class_weight, method)
  _check_elements(dataset.element_spec, model, method)
  return dataset


def prediction_inputs(x, batch_size):
  """The global batches of inputs `KerasTrainer.predict` runs, as 1-tuples.

  Args:
    x: Arrays (or a structure of arrays) of inputs, batched here by
      `batch_size` (32 if None, as `model.predict`), or a `tf.data.Dataset`
      of global batches `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`
      (its `x` is taken).
    batch_size: The global batch size, for arrays.

  Returns:
    A `tf.data.Dataset` of `(x,)`.
  """
  if isinstance(x, tf.data.Dataset):
    if batch_size is not None:
      raise ValueError(
          f"{called('predict')}: with a tf.data.Dataset, give no "
          "`batch_size`: the dataset's elements are the global batches.")
    tf_data.check_element_spec(x.element_spec, called("predict"), "x")
    dataset = tf_data.map_as_written(x, lambda *element: (
        keras.utils.unpack_x_y_sample_weight(
            element[0] if len(element) == 1 else element)[0],))
  else:
    if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
      raise ValueError(
          f"{called('predict')}: `batch_size` must be an int >= 1, got "
          f"{batch_size!r}.")
    _length("x", x, "predict")
    dataset = tf.data.Dataset.from_tensor_slices((x,)).batch(batch_size or 32)
  _check_no_strings(dataset.element_spec[0], "x", called("predict"),
                    "dataset.map(lookup)")
  return dataset


def check_state(value, variables):
  """Raises unless `value` is a state that matches the model's `variables`.

  Args:
    value: What was assigned to `KerasTrainer.state`.
    variables: The model's variables, as four lists in the state's order.
  """
  expected = [len(part) for part in variables]
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
  for i, (part, part_variables) in enumerate(zip(value, variables)):
    for j, (leaf, variable) in enumerate(zip(part, part_variables)):
      _check_state_leaf(f"state[{i}][{j}]", leaf, variable)


def _is_int(value):
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _as_dataset(x, y, sample_weight, batch_size, method, shuffle):
  """`x` if it is a dataset of global batches, else arrays batched.

  Arrays are taken in a new order on every iteration (every epoch) with
  `shuffle` True or None, as `model.fit(shuffle=True)` takes them, or in
  order with `shuffle` False.
  """
  if isinstance(x, tf.data.Dataset):
    given = [name for name, value in (("y", y), ("batch_size", batch_size),
                                      ("sample_weight", sample_weight),
                                      ("shuffle", shuffle or None))
             if value is not None]
    if given:
      advice = ("; shuffle its rows in the pipeline (dataset.shuffle(n) "
                "before dataset.batch)" if shuffle else "")
      raise ValueError(
          f"{called(method)}: with a tf.data.Dataset, give no "
          f"{', '.join(f'`{name}`' for name in given)}: the dataset's "
          f"elements are the global batches (x, y[, sample_weight])"
          f"{advice}.")
    return x
  if batch_size is None:
    raise ValueError(
        f"{called(method)}: give `x` as a tf.data.Dataset of global "
        f"batches, or arrays `x` and `y` with the global `batch_size`.")
  if not _is_int(batch_size) or batch_size < 1:
    raise ValueError(
        f"{called(method)}: `batch_size` must be an int >= 1, got "
        f"{batch_size!r}.")
  arrays = {name: value for name, value in (
      ("x", x), ("y", y), ("sample_weight", sample_weight))
            if value is not None}
  lengths = {name: _length(name, value, method)
             for name, value in arrays.items()}
  if len(set(lengths.values())) > 1:
    raise ValueError(
        f"{called(method)}: the arrays have different numbers of "
        f"examples ({', '.join(f'{n}: {k}' for n, k in lengths.items())}); "
        f"they need one row per example.")
  dataset = tf.data.Dataset.from_tensor_slices(tuple(arrays.values()))
  if shuffle or shuffle is None:
    dataset = dataset.shuffle(lengths["x"], reshuffle_each_iteration=True)
  return dataset.batch(batch_size)


def _with_class_weights(dataset, class_weight, method):
  """`dataset` with each row weighted by its class, as `model.fit` weighs it.

  The class of a row is its target (rounded) for targets of shape (batch,)
  or (batch, 1), else the argmax of its one-hot target; a class not in
  `class_weight` weighs 1.
  """
  caller = f"{called(method)}"
  if not isinstance(class_weight, dict) or not all(
      _is_int(k) and k >= 0 and isinstance(w, (int, float, np.number))
      and not isinstance(w, bool) for k, w in class_weight.items()):
    raise TypeError(
        f"{caller}: `class_weight` must be a dict from class index (an int "
        f">= 0) to the weight of that class's rows, got {class_weight!r}.")
  _, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
      dataset.element_spec)
  if sample_weight is not None:
    raise ValueError(
        f"{caller}: give `class_weight` or sample weights, not both (as "
        f"model.fit). Multiply each row's class weight into its sample "
        f"weight yourself to weigh by both.")
  if y is None or tf.nest.is_nested(y):
    raise ValueError(
        f"{caller}: `class_weight` weighs the rows by a single target `y`; "
        f"these batches have {'none' if y is None else 'several'}. Give "
        f"per-row sample weights instead.")
  last = max(class_weight, default=-1) + 1
  # One weight per class up to the largest given, then 1 for any other.
  table = tf.constant([float(class_weight.get(c, 1.0)) for c in range(last)]
                      + [1.0], tf.float32)

  def weighted(*element):
    x, y, _ = keras.utils.unpack_x_y_sample_weight(element)
    if y.shape.rank >= 2 and y.shape[-1] != 1:
      classes = tf.argmax(y, axis=-1, output_type=tf.int32)
    else:
      labels = tf.reshape(y, [-1]) if y.shape.rank >= 2 else y
      classes = tf.cast(tf.round(tf.cast(labels, tf.float32)), tf.int32)
    known = (classes >= 0) & (classes < last)
    return x, y, tf.gather(table, tf.where(known, classes, last))

  return tf_data.map_as_written(dataset, weighted)


def _length(name, value, method):
  """The number of examples in the array (or arrays) `value`."""
  leaves = tf.nest.flatten(value)
  # np.shape, not len(): a scalar tensor has __len__ and raises in it.
  lengths = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if None in lengths or len(lengths) != 1:
    raise ValueError(
        f"{called(method)}: `{name}` must be an array (or a structure "
        f"of arrays) with the examples along axis 0, or a tf.data.Dataset; "
        f"got {type(value).__name__}"
        f"{'' if None in lengths else f' with lengths {sorted(lengths)}'}.")
  return lengths.pop()


def _check_elements(spec, model, method):
  """Raises, naming the part at fault, for batches `fit` could not use."""
  caller = f"{called(method)}"
  tf_data.check_element_spec(spec, caller, "x")
  try:
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(spec)
  except ValueError:
    raise ValueError(
        f"{caller}: the dataset's elements must be `x`, `(x,)`, `(x, y)` or "
        f"`(x, y, sample_weight)`; got a tuple of {len(spec)}.") from None
  for name, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
    _check_no_strings(part, name, caller, "dataset.map(lambda x, y: "
                      "(lookup(x), y))")
  users = _keras_internal.compiled_users_of_targets(model)
  if y is None and users:
    raise ValueError(
        f"{caller}: the batches have no targets `y`, but the model was "
        f"compiled with a {' and '.join(users)}, which need them. Give "
        f"elements (x, y) (or arrays `x` and `y`), or compile without "
        f"loss and metrics for a model whose losses are its own (add_loss).")
  _check_sample_weight(y, sample_weight, caller)


def _check_no_strings(spec, name, caller, mapped):
  """Raises, naming the part, if a leaf of `spec` holds strings.

  Args:
    spec: The `tf.TensorSpec`s of a part of the batches.
    name: The part's name ('x', 'y' or 'sample_weight').
    caller: The method, for the message.
    mapped: The `dataset.map` call the message shows.
  """
  for path, leaf in tf_data.named_leaves(spec, name):
    if leaf is not None and leaf.dtype == tf.string:
      raise ValueError(
          f"{caller}: {path} holds strings, which cannot go onto the "
          f"devices. Turn them into numbers in the input pipeline, e.g. "
          f"`{mapped}` with a keras.layers.StringLookup or TextVectorization "
          f"adapted beforehand, and give the model that layer's output as "
          f"input.")


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
