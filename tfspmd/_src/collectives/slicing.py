"""`lax.dynamic_slice` and `lax.dynamic_slice_in_dim`, as JAX clamps them.

Per-device code written for JAX slices its block at offsets computed from
`axis_index` (the shard_map tutorial's overlapped matmuls); TensorFlow's
`tf.slice` takes the same arguments but fails where JAX moves the start so
that the slice fits.
"""

from collections.abc import Sequence

import numpy as np
import tensorflow as tf


def _check_integer(start, function, name):
  """Raises TypeError unless `start` is an integer, as `jax.lax` does.

  TensorFlow would cast a float or bool start to an integer and slice
  where the truncated value says.

  Args:
    start: A start index: a Python int, a NumPy or tensor integer.
    function: The caller's name, for the message.
    name: The argument's name, for the message.
  """
  if isinstance(start, (int, np.integer)) and not isinstance(start, bool):
    return
  dtype = tf.convert_to_tensor(start).dtype
  if not dtype.is_integer:
    raise TypeError(
        f"{function}: {name} has dtype {dtype.name}, but start indices must "
        f"be integers, as in jax.lax; round it and cast it first "
        f"(tf.cast(tf.round(start), tf.int32)).")


def dynamic_slice(operand: tf.Tensor, start_indices: Sequence,
                  slice_sizes: Sequence[int]) -> tf.Tensor:
  """The block of `slice_sizes` starting at `start_indices`, as `jax.lax`'s.

  A negative start counts from the end, then a start is clamped to
  `[0, dim - size]`, so the slice always fits, as in JAX; the starts may be
  tensors computed inside a pmap (one per device).

  Args:
    operand: The tensor to slice.
    start_indices: One integer start per dimension (Python ints or scalar
      tensors), or one integer tensor of them.
    slice_sizes: One static size per dimension.

  Returns:
    A tensor of shape `slice_sizes`.

  Raises:
    TypeError: If a start is not an integer (a float or a bool).
    ValueError: If the numbers of starts or sizes are not the operand's
      rank, or a size is negative or larger than its dimension.

  Example:
    >>> import tensorflow as tf
    >>> from tfspmd import lax
    >>> x = tf.reshape(tf.range(12), (3, 4))
    >>> print(lax.dynamic_slice(x, (1, 3), (2, 2)))
    tf.Tensor(
    [[ 6  7]
     [10 11]], shape=(2, 2), dtype=int32)
  """
  operand = tf.convert_to_tensor(operand)
  dims = operand.shape.as_list()
  sizes = [int(size) for size in slice_sizes]
  if isinstance(start_indices, (tf.Tensor, tf.Variable)) and (
      start_indices.shape.rank == 1):
    _check_integer(start_indices, "dynamic_slice", "`start_indices`")
    starts = tf.unstack(start_indices,
                        num=start_indices.shape[0] or len(dims))
  else:
    starts = list(start_indices)
    for axis, start in enumerate(starts):
      _check_integer(start, "dynamic_slice", f"`start_indices`[{axis}]")
  if len(starts) != len(dims) or len(sizes) != len(dims):
    raise ValueError(
        f"dynamic_slice: `start_indices` ({len(starts)}) and `slice_sizes` "
        f"({len(sizes)}) must have one entry per dimension of the operand of "
        f"shape {operand.shape}.")
  for axis, (size, dim) in enumerate(zip(sizes, dims)):
    if size < 0 or (dim is not None and size > dim):
      raise ValueError(
          f"dynamic_slice: `slice_sizes`[{axis}]={size} must lie in "
          f"[0, {dim}] for the operand of shape {operand.shape}.")
  begin = []
  for axis, (start, size, dim) in enumerate(zip(starts, sizes, dims)):
    dim = tf.cast(dim if dim is not None else tf.shape(operand)[axis],
                  tf.int64)
    start = tf.cast(start, tf.int64)
    # A negative start counts from the end, as JAX's, then the slice is
    # moved to fit.
    start = tf.where(start < 0, start + dim, start)
    begin.append(tf.clip_by_value(start, 0, dim - size))
  return tf.slice(operand, tf.stack(begin), sizes)


def dynamic_slice_in_dim(operand: tf.Tensor, start_index: int | tf.Tensor,
                         slice_size: int, axis: int = 0) -> tf.Tensor:
  """`dynamic_slice` along one axis, the others whole, as `jax.lax`'s.

  Args:
    operand: The tensor to slice.
    start_index: The integer start along `axis` (clamped so the slice fits).
    slice_size: The static size along `axis`.
    axis: The axis to slice (negative counts from the end).

  Returns:
    `operand` with `axis` cut to `slice_size`.

  Raises:
    TypeError: If `start_index` is not an integer (a float or a bool).
    ValueError: If `axis` is out of range, or as `dynamic_slice`.

  Example:
    >>> import tensorflow as tf
    >>> from tfspmd import lax
    >>> print(lax.dynamic_slice_in_dim(tf.range(6), 5, 2))
    tf.Tensor([4 5], shape=(2,), dtype=int32)
  """
  operand = tf.convert_to_tensor(operand)
  rank = operand.shape.rank
  if not isinstance(axis, int) or not -rank <= axis < rank:
    raise ValueError(
        f"dynamic_slice_in_dim: `axis`={axis!r} is out of range for an "
        f"operand of rank {rank}.")
  axis %= rank
  _check_integer(start_index, "dynamic_slice_in_dim", "`start_index`")
  starts = [0] * rank
  starts[axis] = start_index
  sizes = [tf.compat.dimension_value(d) if i != axis else slice_size
           for i, d in enumerate(operand.shape)]
  if None in sizes:
    raise ValueError(
        f"dynamic_slice_in_dim: the operand's shape {operand.shape} must be "
        f"known outside `axis`.")
  return dynamic_slice(operand, starts, sizes)
