"""ppermute and pshuffle: send each device's value to another device.

Lowering: a gather along the stacked axis by the source of each destination,
with zeros where a device receives nothing. Where DTensor's all-to-all is
right (`resplit`), that gather runs between two all-to-alls: each device's
value is cut into n chunks, chunk k of every device goes to device k, which
reorders them by destination, and the chunks go back, so each device sends
2(n-1)/n of its value instead of receiving every device's. Elsewhere DTensor
gathers the whole stacked value to every device. Transpose: the inverse
permutation.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfspmd._src.collectives import checks
from tfspmd._src.collectives import marker
from tfspmd._src.collectives import resplit
from tfspmd._src.core import stacking
from tfspmd._src.rewrites import dtensor_rewrites
from tfspmd._src.runtime import axis_env


def _check_perm(perm, size, function):
  try:
    pairs = [tuple(pair) for pair in perm]
  except TypeError:
    raise TypeError(
        f"{function}: `perm` must be a sequence of (source, destination) "
        f"pairs, got {perm!r}.") from None
  for pair in pairs:
    if len(pair) != 2 or not all(
        isinstance(p, (int, np.integer)) and not isinstance(p, bool)
        for p in pair):
      raise TypeError(
          f"{function}: each entry of `perm` must be a pair of ints "
          f"(source, destination), got {pair!r}.")
    if not all(0 <= p < size for p in pair):
      raise ValueError(
          f"{function}: `perm` entry {pair} is out of range for an axis of "
          f"size {size}; indices must be in [0, {size}).")
  sources = [int(s) for s, _ in pairs]
  destinations = [int(d) for _, d in pairs]
  for name, values in (("source", sources), ("destination", destinations)):
    if len(set(values)) != len(values):
      raise ValueError(
          f"{function}: `perm` is not a permutation: a {name} appears more "
          f"than once in {pairs}.")
  return tuple(zip(sources, destinations))


def _permute_step(pairs):
  def step(tensor, stacked, frame, _):
    size = frame.size
    source_of = np.full(size, -1)
    for source, destination in pairs:
      source_of[destination] = source
    if not stacked:
      tensor = stacking.repeat_along_new_axis(tensor, 0, size)
    resplitter = resplit.for_frame(frame, tensor.dtype)
    if resplitter is None:
      return _gather_sources(tensor, source_of), True
    return _permute_in_chunks(tensor, source_of, resplitter), True
  return step


def _gather_sources(tensor, source_of):
  """Row d of the result is row `source_of[d]` of `tensor`, or zeros if -1."""
  moved = tf.gather(tensor, np.maximum(source_of, 0).astype(np.int32))
  if (source_of >= 0).all():
    return moved
  receives = tf.reshape(tf.constant(source_of >= 0),
                        [len(source_of)] + [1] * (moved.shape.rank - 1))
  return dtensor_rewrites.select(receives, moved, tf.zeros_like(moved))


def _permute_in_chunks(tensor, source_of, resplitter):
  """`_gather_sources` between two all-to-alls over chunks of each row."""
  shape = stacking.sizes(tensor)
  count = resplitter.size
  rows = tf.reshape(tensor, [shape[0], -1])
  length = rows.shape[1]
  chunk = -(-length // count)
  if chunk * count != length:
    rows = tf.pad(rows, [[0, 0], [0, chunk * count - length]])
  chunks = tf.reshape(rows, [shape[0], count, chunk])
  by_chunk = resplitter.move_split(chunks, 0, 1)
  moved = resplitter.split_along(_gather_sources(by_chunk, source_of), 0)
  rows = tf.reshape(moved, [shape[0], chunk * count])
  if chunk * count != length:
    rows = rows[:, :length]
  return tf.reshape(rows, shape)


def _ppermute_leaf(value, targets, pairs):
  inverse = tuple((d, s) for s, d in pairs)
  return marker.with_transpose(
      value, targets, _permute_step(pairs), "ppermute",
      lambda cotangent: _ppermute_leaf(cotangent, targets, inverse), joint=True,
      elementwise=True)


def ppermute(x: Any, axis_name: Hashable,
             perm: Sequence[tuple[int, int]]) -> Any:
  """Sends each device's `x` along the named axis as `perm` says.

  Args:
    x: A tensor or pytree of tensors.
    axis_name: A bound axis name, or a tuple of names: then positions are
      linear indices over them (the first name major).
    perm: (source, destination) pairs of positions along the axis; no source
      or destination may repeat. Devices that receive nothing get zeros.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> shift = lambda x: tfspmd.lax.ppermute(x, 'i', [(0, 1), (1, 2), (2, 3)])
    >>> print(tfspmd.pmap(shift, 'i')(tf.constant([1., 2., 3., 4.])))
    [0. 1. 2. 3.]
  """
  targets = axis_env.normalize_axis_names(axis_name, "ppermute")
  pairs = _check_perm(perm, checks.total_size(targets), "ppermute")
  return checks.leafwise(lambda v: _ppermute_leaf(v, targets, pairs), x,
                         collective="ppermute")


def pshuffle(x: Any, axis_name: Hashable, perm: Sequence[int]) -> Any:
  """Device i receives the `x` of device `perm[i]` (a full permutation).

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = lambda x: tfspmd.lax.pshuffle(x, 'i', [3, 0, 1, 2])
    >>> print(tfspmd.pmap(f, 'i')(tf.constant([1., 2., 3., 4.])))
    [4. 1. 2. 3.]
  """
  targets = axis_env.normalize_axis_names(axis_name, "pshuffle")
  size = checks.total_size(targets)
  try:
    sources = list(perm)
    is_permutation = sorted(sources) == list(range(size))
  except TypeError:  # not iterable, or entries that do not compare
    is_permutation = False
  if not is_permutation:
    raise ValueError(
        f"pshuffle: `perm` must be a permutation of range({size}), got "
        f"{perm!r}.")
  pairs = _check_perm([(s, d) for d, s in enumerate(sources)], size,
                      "pshuffle")
  return checks.leafwise(lambda v: _ppermute_leaf(v, targets, pairs), x,
                         collective="pshuffle")
