"""Argument checks shared by every collective, so each message is right."""

import tensorflow as tf

from tfspmd._src.core import collective_constants as constants
from tfspmd._src.trees import tree


# What each collective takes: (description, test of a tf.DType).
ARRAYS = ("numeric or bool values",
          lambda d: (d.is_numeric and not d.is_quantized) or d.is_bool)
NUMBERS = ("numbers (integer, floating or complex; not bool)",
           lambda d: d.is_numeric and not d.is_quantized and not d.is_bool)
ORDERED = ("real numbers (integer or floating; not bool or complex)",
           lambda d: d.is_integer or d.is_floating)


def leafwise(function, x, *, collective, accepts=ARRAYS, ordered=False,
             uint64_as_int64=True, constant=None, together=None):
  """Applies `function` to each leaf of the pytree `x`, as a tensor.

  A uint64 leaf goes through `function` as int64 (see `as_int64`), unless
  `uint64_as_int64` is False; `ordered` says the collective compares values.
  With `constant`, a leaf that is a Python number or a NumPy value of a
  dtype `collective` accepts gives `constant(leaf)` instead, a host value
  (see `constants`). With `together`, `together(tensors)` first gets every
  tensor leaf at once and returns, for each, its result or None to leave it
  to `function` (a reduction of several leaves in one collective).

  Raises:
    TypeError: Naming the leaf's path in `x`, if a leaf is not an array or
      its dtype is not one `collective` accepts.
  """
  leaves, treedef = tree.flatten(x)
  paths = tree.leaf_paths(x, "x")
  kind, accepted = accepts
  results = []
  tensors = {}  # position in `results` -> the leaf as a tensor
  for leaf, path in zip(leaves, paths):
    if constant is not None:
      dtype = constants.host_dtype(leaf)
      if dtype is not None and accepted(dtype):
        results.append(constant(leaf))
        continue
    try:
      tensor = tf.convert_to_tensor(leaf)
    except (TypeError, ValueError):
      raise TypeError(
          f"{collective}: {path} is of type {type(leaf).__name__}, which is "
          f"not convertible to a tensor; {collective} takes tensors, NumPy arrays "
          f"or Python numbers, in tuples, lists, dicts or namedtuples."
      ) from None
    if not accepted(tensor.dtype):
      raise TypeError(
          f"{collective}: {path} has dtype {tensor.dtype.name}, but "
          f"{collective} takes {kind}; cast it first (for example "
          f"tf.cast(x, tf.int32)).")
    tensors[len(results)] = tensor
    results.append(None)
  joint = together(list(tensors.values())) if together else [None] * len(
      tensors)
  for position, result in zip(tensors, joint):
    tensor = tensors[position]
    if result is None:
      result = (as_int64(function, tensor, ordered=ordered)
                if uint64_as_int64 else function(tensor))
    results[position] = result
  return treedef.unflatten(results)


def as_int64(function, tensor, *, ordered=False):
  """`function(tensor)`, with a uint64 tensor moved as int64.

  DTensor's collectives refuse uint64 (TF 2.21: "operand #0 must be tensor
  of floating-point or 32/64-bit signed integer values"). A cast to int64
  keeps the bits, and sums wrap the same; for comparisons, flipping the top
  bit first maps unsigned order onto signed order.
  """
  if tensor.dtype != tf.uint64:
    return function(tensor)
  top = tf.constant(1 << 63, tf.uint64)
  if ordered:
    tensor = tf.bitwise.bitwise_xor(tensor, top)
  result = tf.cast(function(tf.cast(tensor, tf.int64)), tf.uint64)
  return tf.bitwise.bitwise_xor(result, top) if ordered else result


def normalize_axis(axis, rank, *, argument, function, of=None):
  """Resolves a possibly negative axis of a per-device value of `rank`.

  `of` says what the axis indexes, where that is not the per-device value.
  """
  if isinstance(axis, bool) or not isinstance(axis, int):
    raise TypeError(
        f"{function}: `{argument}` must be an int, got {type(axis).__name__} "
        f"{axis!r}.")
  if not -rank <= axis < rank:
    raise ValueError(
        f"{function}: `{argument}`={axis} is out of range for "
        f"{of or f'a per-device value of rank {rank}'}; it must be in "
        f"[{-rank}, {rank}).")
  return axis % rank


def total_size(frames):
  """The size of the linear axis over `frames`."""
  size = 1
  for frame in frames:
    size *= frame.size
  return size


def check_divisible(extent, size, *, argument, function, tiled, groups=False):
  """Checks a dimension split in `size` blocks, one per device.

  With `groups`, `size` is the size of each of axis_index_groups' groups.
  """
  what = ("the size of each axis_index_groups group" if groups else
          "the axis size")
  if extent is None:
    raise ValueError(
        f"{function}: the dimension `{argument}` is split over the devices, "
        f"so its size must be known when the function traces, but it is "
        f"open (None, as an input_signature may leave it). Give that "
        f"dimension a fixed size; the others may stay open.")
  if tiled:
    if extent % size:
      raise ValueError(
          f"{function}: with tiled=True the dimension `{argument}` "
          f"(size {extent}) must divide evenly by {what} {size}.")
  elif extent != size:
    raise ValueError(
        f"{function}: the dimension `{argument}` has size {extent}, but must "
        f"equal {what} {size} (or pass tiled=True to split it in "
        f"{size} blocks).")
