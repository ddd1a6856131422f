"""psum, pmean, pmax, pmin: all-reduce over named axes.

Lowering: a reduction over the stacked axis, which DTensor turns into an
all-reduce over the mesh dimension; the floating leaves of one dtype of a
pytree go in one all-reduce. The result is the same on every position
of the axis, so it leaves the converter unstacked (no broadcast back).
Transposes: the cotangent of psum is the psum of the cotangent; pmax and
pmin send the summed cotangent to the positions that hold the extremum,
split evenly between ties. With `axis_index_groups`, each runs within the
groups (see `groups`), its transpose within the same groups.

Python numbers and NumPy values are the same on every device: their
reductions are computed while tracing and come back as host values of the
operand's type, as in JAX (see `constants`).
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfspmd._src.collectives import checks
from tfspmd._src.collectives import groups as groups_lib
from tfspmd._src.collectives import marker
from tfspmd._src.core import collective_constants as constants
from tfspmd._src.core import graph_gradients
from tfspmd._src.runtime import axis_env


def _sum_step(tensor, stacked, frame, _):
  if stacked:
    return tf.reduce_sum(tensor, axis=0), False
  return tensor * tf.cast(frame.size, tensor.dtype), False


def _psum_leaf(value, targets, groups, function="psum"):
  step = groups_lib.within(_sum_step, groups)
  return marker.with_transpose(
      value, targets, step, function,
      lambda cotangent: _psum_leaf(cotangent, targets, groups),
      joint=groups is not None, transpose_step=step, elementwise=True)


def _sums_in_one(tensors, targets, groups, function):
  """The sums of the floating `tensors`, one all-reduce per dtype.

  As PyTorch's DDP and Horovod reduce a model's gradients in buckets: each
  collective costs a meeting of every device's executor, whatever its size,
  so an MLP's four gradients and loss take one all-reduce, not five (the
  gain is in the CHANGELOG). Only on a program's mesh of one
  dimension, where every value lies split over it the same way: on a mesh
  of several, two leaves may lie split over different dimensions, which
  joining would gather.

  Returns:
    For each tensor, its sum, or None where it is left to a collective of
    its own (a dtype no other leaf has, integers, or another mesh).
  """
  results = [None] * len(tensors)
  state = axis_env.trace_state()
  if state is None or len(state.mesh_axes) != 1:
    return results
  by_dtype = {}
  for index, tensor in enumerate(tensors):
    if tensor.dtype.is_floating and tensor.shape.is_fully_defined():
      by_dtype.setdefault(tensor.dtype, []).append(index)
  for indices in by_dtype.values():
    if len(indices) < 2:
      continue
    parts = [tensors[index] for index in indices]
    total = _psum_leaf(tf.concat([tf.reshape(t, [-1]) for t in parts], 0),
                       targets, groups, function)
    pieces = tf.split(total, [t.shape.num_elements() for t in parts])
    for index, piece, part in zip(indices, pieces, parts):
      results[index] = tf.reshape(piece, part.shape)
  return results


def psum(x: Any, axis_name: Hashable, *,
         axis_index_groups: Sequence[Sequence[int]] | None = None) -> Any:
  """Sums `x` over the devices of the named axis (or axes).

  A leaf of `x` that is a Python number (int, float or complex) or a NumPy
  value is the same on every device: as in JAX, its sum is the axis size
  times it, computed while tracing and returned in its own type, not as a
  tensor. So `psum(1, axis_name)` is the axis size as a Python int (the
  product of the sizes for a tuple of axes), usable in `range(...)`;
  `psum(2.0, 'i')` is a Python float and a NumPy operand gives NumPy. A
  tensor leaf, even `tf.constant(1)`, gives a tensor.

  Args:
    x: A tensor, Python number or NumPy value, or a pytree of them.
    axis_name: An axis name bound by an enclosing `pmap`/`vmap`, or a tuple
      of such names to sum over all of them.
    axis_index_groups: Optional groups of axis indices (a list of lists of
      ints, such as `[[0, 1], [2, 3]]` on an axis of size 4): each index in
      exactly one group, all groups of one size. Each device then sums over
      its own group only. For a tuple of names, the indices are the linear
      index over them (the first name major).

  Returns:
    The sum, with the structure and shapes of `x`, the same on every device
    of the named axes (of each group, with `axis_index_groups`).

  Raises:
    NameError: If an axis name is not bound by an enclosing map.
    TypeError: If `axis_index_groups` is not a list of lists of ints.
    ValueError: If `axis_index_groups` does not cover every index once in
      groups of one size.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = lambda x: x / tfspmd.lax.psum(x, axis_name='i')
    >>> print(tfspmd.pmap(f, axis_name='i')(tf.range(4.)))
    [0.         0.16666667 0.33333334 0.5       ]

    Sums within groups of devices:

    >>> groups = [[0, 1], [2, 3]]
    >>> g = lambda x: tfspmd.lax.psum(x, 'i', axis_index_groups=groups)
    >>> print(tfspmd.pmap(g, axis_name='i')(tf.range(4.)))
    [1. 1. 5. 5.]

    The axis size as a Python int drives a Python loop, here a ring sum:

    >>> def ring_sum(x):
    ...   n = tfspmd.lax.psum(1, 'i')
    ...   right = [(k, (k + 1) % n) for k in range(n)]
    ...   total = x
    ...   for _ in range(n - 1):
    ...     x = tfspmd.lax.ppermute(x, 'i', right)
    ...     total += x
    ...   return total
    >>> print(tfspmd.pmap(ring_sum, axis_name='i')(tf.range(4.)))
    [6. 6. 6. 6.]
  """
  targets = axis_env.normalize_axis_names(axis_name, "psum")
  groups = groups_lib.resolve(axis_index_groups, targets, "psum")
  size = groups_lib.size(targets, groups)
  return checks.leafwise(
      lambda leaf: _psum_leaf(leaf, targets, groups), x, collective="psum",
      accepts=checks.NUMBERS,
      constant=lambda leaf: constants.scaled(leaf, size),
      together=lambda tensors: _sums_in_one(tensors, targets, groups, "psum"))


def pmean(x: Any, axis_name: Hashable, *,
          axis_index_groups: Sequence[Sequence[int]] | None = None) -> Any:
  """Averages `x` over the devices of the named axis (or axes).

  Integers give floats: float64 for int64, uint32 and uint64 (so large
  values keep their precision), float32 for the narrower ones.

  A leaf that is a Python number or a NumPy value gives, as in JAX,
  `psum(x, axis_name) / psum(1, axis_name)` computed while tracing: a host
  value, `x` up to rounding, of the type Python's or NumPy's division gives
  (`pmean(1, 'i')` is the Python float 1.0; NumPy int32 gives float64).

  With `axis_index_groups` (see `psum`), each device averages over its own
  group.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> print(tfspmd.pmap(lambda x: tfspmd.lax.pmean(x, 'i'), 'i')(tf.range(4.)))
    [1.5 1.5 1.5 1.5]
    >>> f = lambda x: x * tfspmd.lax.pmean(3, 'i')  # the Python float 3.0
    >>> print(tfspmd.pmap(f, 'i')(tf.range(4.)))
    [0. 3. 6. 9.]
  """
  targets = axis_env.normalize_axis_names(axis_name, "pmean")
  groups = groups_lib.resolve(axis_index_groups, targets, "pmean")
  count = groups_lib.size(targets, groups)

  def mean(leaf):
    total = checks.as_int64(
        lambda v: _psum_leaf(v, targets, groups, "pmean"), leaf)
    if total.dtype.is_integer:
      # 64-bit integers keep their precision in float64 (2**40 + 1.5 stays
      # exact); narrower ones give float32, as JAX's pmean does.
      wide = leaf.dtype in (tf.int64, tf.uint64, tf.uint32)
      return tf.cast(total, tf.float64 if wide else tf.float32) / count
    return total / tf.cast(count, total.dtype)

  def means_in_one(tensors):
    return [None if total is None else total / tf.cast(count, total.dtype)
            for total in _sums_in_one(tensors, targets, groups, "pmean")]

  return checks.leafwise(
      mean, x, collective="pmean", accepts=checks.NUMBERS,
      uint64_as_int64=False,
      constant=lambda leaf: constants.scaled(leaf, count) / count,
      together=means_in_one)


def _extremum_step(reduce):
  def step(tensor, stacked, *_):
    if stacked:
      return reduce(tensor, axis=0), False
    return tensor, False
  return step


def _extremum(x, axis_name, axis_index_groups, function, reduce):
  targets = axis_env.normalize_axis_names(axis_name, function)
  groups = groups_lib.resolve(axis_index_groups, targets, function)
  step = groups_lib.within(_extremum_step(reduce), groups)

  def leaf_extremum(leaf):
    @graph_gradients.custom_gradient
    def extremum_with_transpose(value):
      result = marker.over_axes(value, targets, step, function,
                                joint=groups is not None)

      def transpose(cotangent):
        holds = tf.cast(tf.equal(value, result), cotangent.dtype)
        return (_psum_leaf(cotangent, targets, groups) * holds /
                _psum_leaf(holds, targets, groups))

      return result, transpose

    return marker.flat_where_too_high(leaf, extremum_with_transpose)

  return checks.leafwise(leaf_extremum, x, collective=function,
                         accepts=checks.ORDERED, ordered=True,
                         constant=lambda leaf: leaf)


def pmax(x: Any, axis_name: Hashable, *,
         axis_index_groups: Sequence[Sequence[int]] | None = None) -> Any:
  """The elementwise maximum of `x` over the devices of the named axis (or axes).

  Its gradient goes to the device(s) holding the maximum, split between ties.
  With `axis_index_groups` (see `psum`), each device takes the maximum over
  its own group.
  A leaf that is a Python number or a NumPy value is the same on every
  device, so its maximum is that leaf itself, returned as it is (JAX
  returns it as an array).

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> print(tfspmd.pmap(lambda x: tfspmd.lax.pmax(x, 'i'), 'i')(
    ...     tf.constant([3., 7., 1., 5.])))
    [7. 7. 7. 7.]
    >>> groups = [[0, 2], [1, 3]]
    >>> f = lambda x: tfspmd.lax.pmax(x, 'i', axis_index_groups=groups)
    >>> print(tfspmd.pmap(f, 'i')(tf.constant([3., 7., 1., 5.])))
    [3. 7. 3. 7.]
  """
  return _extremum(x, axis_name, axis_index_groups, "pmax", tf.reduce_max)


def pmin(x: Any, axis_name: Hashable, *,
         axis_index_groups: Sequence[Sequence[int]] | None = None) -> Any:
  """The elementwise minimum of `x` over the devices of the named axis (or axes).

  A leaf that is a Python number or a NumPy value is returned as it is, as
  `pmax` does. With `axis_index_groups` (see `psum`), each device takes the
  minimum over its own group.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> print(tfspmd.pmap(lambda x: tfspmd.lax.pmin(x, 'i'), 'i')(
    ...     tf.constant([3., 7., 1., 5.])))
    [1. 1. 1. 1.]
  """
  return _extremum(x, axis_name, axis_index_groups, "pmin", tf.reduce_min)
