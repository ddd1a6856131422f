"""Checking and normalizing what a pmapped function is called with."""

import numpy as np
import tensorflow as tf

from tfspmd._src.core.config import config
from tfspmd._src.runtime.sharded_array import ShardedArray
from tfspmd._src.trees import tree

# Python numbers become these dtypes, as `tf.constant` would make them.
_PYTHON_DTYPES = ((bool, np.bool_), (int, np.int32), (float, np.float32),
                  (complex, np.complex64))


def is_axis_spec(value):
  """True for an axis spec leaf: an int (not a bool) or None."""
  return value is None or (isinstance(value, int) and not isinstance(value, bool))


def check_axis_spec_tree(spec, name):
  """Checks that `spec` is an axis, None, or a pytree of those.

  The containers are those of argument trees, registered nodes included, so
  an in_axes prefix can be a registered node holding axes.

  Raises:
    TypeError: Naming the first leaf that is neither an int nor None.
  """
  for leaf in tree.flatten(spec, is_leaf=_is_none)[0]:
    if isinstance(leaf, bool):
      raise TypeError(
          f"{name} must be an int, None, or a container of those; got the "
          f"bool {leaf!r} (bools are not axes).")
    if not is_axis_spec(leaf):
      raise TypeError(
          f"{name} must be an int, None, or a (nested) tuple/list/dict of "
          f"those; got {type(leaf).__name__} {leaf!r}.")


def _is_none(value):
  return value is None


def normalize_axis(axis, rank, *, spec_name, path, what="argument"):
  """Resolves a possibly negative `axis` of a `rank`-d value, or raises."""
  if not -rank <= axis < rank:
    if rank == 0:
      raise ValueError(
          f"{spec_name} maps axis {axis} of {what} {path}, but it is a scalar "
          f"(rank 0). Map an array with that axis, or give {spec_name}=None "
          f"there to broadcast it.")
    raise ValueError(
        f"{spec_name} maps axis {axis} of {what} {path}, which has rank {rank}: "
        f"the axis must be in [{-rank}, {rank}).")
  return axis % rank


def to_array_leaf(leaf, path):
  """Returns `leaf` as a ShardedArray, tf.Tensor or NumPy array.

  Raises:
    TypeError: Naming `path`, if the leaf is not array-like or has a dtype
      that cannot be placed on devices (strings, objects).
  """
  if isinstance(leaf, (ShardedArray, tf.Tensor)):
    value = leaf
  elif isinstance(leaf, np.ndarray):
    value = config.narrowed(leaf)
  elif isinstance(leaf, tf.Variable):
    value = leaf.value()
  elif isinstance(leaf, np.generic):
    value = config.narrowed(np.asarray(leaf))
  else:
    # Only these Python numbers have a TensorFlow dtype (not a Fraction).
    dtype = next((dtype for python_type, dtype in _PYTHON_DTYPES
                  if isinstance(leaf, python_type)), None)
    if dtype is None:
      raise TypeError(
          f"pmapped function argument {path} is a {type(leaf).__name__} "
          f"({_short_repr(leaf)}), not an array. Pass a tf.Tensor, a NumPy "
          f"array or a Python bool, int, float or complex, or list its "
          f"position in static_broadcasted_argnums to pass it as a "
          f"compile-time constant.")
    value = _python_number(leaf, dtype, path)
  if isinstance(value, np.ndarray) and value.dtype.kind in "OUSMm":
    # NumPy's object, str, bytes and datetime arrays: tf.as_dtype calls an
    # object array a string one.
    dtype, name = None, _NUMPY_KIND_NAMES[value.dtype.kind]
  else:
    # bfloat16 (ml_dtypes) is of NumPy's kind "V", as an untyped void is.
    try:
      dtype = tf.as_dtype(value.dtype)
    except TypeError:
      dtype = None
    name = dtype.name if dtype is not None else _NUMPY_KIND_NAMES.get(
        value.dtype.kind, str(value.dtype))
  if dtype is None or dtype.is_quantized or not (dtype.is_numeric or
                                                  dtype.is_bool):
    raise TypeError(
        f"pmapped function argument {path} has dtype {name}, which "
        f"cannot be split over devices; only numeric and bool arrays can. "
        f"Encode it as numbers, or pass a hashable Python value (a tuple of "
        f"str, say) through static_broadcasted_argnums.")
  return value


_NUMPY_KIND_NAMES = {"O": "object", "U": "str", "S": "bytes",
                     "M": "datetime64", "m": "timedelta64", "V": "void"}


def _python_number(value, dtype, path):
  """A Python number as a NumPy scalar of TensorFlow's default `dtype`."""
  try:
    return np.asarray(value, dtype=dtype)
  except OverflowError:
    raise OverflowError(
        f"pmapped function argument {path} is the Python int {value}, which "
        f"does not fit {np.dtype(dtype).name} (Python ints become int32, as "
        f"in tf.constant). Pass np.int64({value}) or a tf.int64 tensor."
    ) from None


def _short_repr(value):
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def traced_tensor(leaf, path):
  """An argument leaf of a pmap called inside a trace, as a tensor."""
  if isinstance(leaf, ShardedArray):
    raise TypeError(
        f"nested pmap argument {path} is a ShardedArray from outside the "
        f"enclosing pmap; pass it to the outer pmap instead.")
  if isinstance(leaf, tf.Tensor):
    return leaf
  return tf.convert_to_tensor(to_array_leaf(leaf, path))
