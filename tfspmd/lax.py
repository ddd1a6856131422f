"""Named-axis collectives, as in `jax.lax`: use them inside a pmapped function.

With them, the `jax.lax` slicing ops per-device code slices its blocks with,
`jax.lax`'s control flow over pytrees (`scan`, `fori_loop`, `while_loop`,
`cond`, `switch`, `map`), which may call collectives inside their bodies,
and `with_sharding_constraint` for the values of a `tfspmd.jit` function.
"""

from collections.abc import Hashable
from collections.abc import Sequence
import functools
from typing import Any

import numpy as np
import tensorflow as tf

# pylint: disable=useless-import-alias
from tfspmd._src.collectives.all_to_all import all_to_all as all_to_all
from tfspmd._src.collectives.all_to_all import pswapaxes as pswapaxes
from tfspmd._src.collectives.control import cond as cond
from tfspmd._src.collectives.control import fori_loop as fori_loop
from tfspmd._src.collectives.control import map as map  # pylint: disable=redefined-builtin
from tfspmd._src.collectives.control import scan as scan
from tfspmd._src.collectives.control import switch as switch
from tfspmd._src.collectives.control import while_loop as while_loop
from tfspmd._src.collectives.gather import all_gather as all_gather
from tfspmd._src.collectives.gather import psum_scatter as psum_scatter
from tfspmd._src.collectives.indexing import axis_index as axis_index
from tfspmd._src.collectives.indexing import axis_size as axis_size
from tfspmd._src.collectives.permute import ppermute as ppermute
from tfspmd._src.collectives.permute import pshuffle as pshuffle
from tfspmd._src.collectives import slicing as _slicing
from tfspmd._src.collectives import reductions as _reductions
from tfspmd._src.programs import sharding_constraint as _sharding_constraint
from tfspmd._src.trees.tree_util import tree_map as _tree_map

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "cond",
    "dynamic_slice",
    "dynamic_slice_in_dim",
    "fori_loop",
    "map",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pshuffle",
    "pswapaxes",
    "scan",
    "switch",
    "while_loop",
    "with_sharding_constraint",
]


def _is_bool(leaf):
  if isinstance(leaf, (bool, np.bool_)):
    return True
  return (isinstance(leaf, (np.ndarray, tf.Tensor, tf.Variable)) and
          leaf.dtype in (np.bool_, tf.bool))


def _taking_bools(reduction, bool_result):
  """`reduction` that takes bool leaves as JAX's does: as int32.

  Each bool leaf (Python, NumPy or tensor) is reduced as an int32 tensor; with
  `bool_result` its result is cast back to bool, as JAX's pmax and pmin give.
  """

  @functools.wraps(reduction)
  def reduce(x: Any, axis_name: Hashable, *,
             axis_index_groups: Sequence[Sequence[int]] | None = None) -> Any:
    as_ints = _tree_map(
        lambda leaf: tf.cast(leaf, tf.int32) if _is_bool(leaf) else leaf, x)
    result = reduction(as_ints, axis_name, axis_index_groups=axis_index_groups)
    if not bool_result:
      return result
    return _tree_map(
        lambda out, leaf: tf.cast(out, tf.bool) if _is_bool(leaf) else out,
        result, x)

  reduce.__doc__ = reduction.__doc__.rstrip() + _BOOLS_NOTE[reduction.__name__]
  reduce.__module__ = __name__
  return reduce


_BOOLS_NOTE = {
    "psum": """

  A bool leaf is summed as int32 (the number of True), as in JAX:

    >>> print(tfspmd.pmap(lambda b: psum(b, 'i'), 'i')(
    ...     tf.constant([True, False, True, True])))
    [3 3 3 3]
""",
    "pmean": """

  A bool leaf is averaged as int32, giving float32 (the fraction of True),
  as in JAX:

    >>> print(tfspmd.pmap(lambda b: pmean(b, 'i'), 'i')(
    ...     tf.constant([True, False, True, True])))
    [0.75 0.75 0.75 0.75]
""",
    "pmax": """

  A bool leaf gives a bool, True where any device has True, as in JAX:

    >>> print(tfspmd.pmap(lambda b: pmax(b, 'i'), 'i')(
    ...     tf.constant([True, False])))
    [ True  True]
""",
    "pmin": """

  A bool leaf gives a bool, True where every device has True, as in JAX:

    >>> print(tfspmd.pmap(lambda b: pmin(b, 'i'), 'i')(
    ...     tf.constant([True, False])))
    [False False]
""",
}

psum = _taking_bools(_reductions.psum, bool_result=False)
pmean = _taking_bools(_reductions.pmean, bool_result=False)
pmax = _taking_bools(_reductions.pmax, bool_result=True)
pmin = _taking_bools(_reductions.pmin, bool_result=True)
dynamic_slice = _slicing.dynamic_slice
dynamic_slice_in_dim = _slicing.dynamic_slice_in_dim
with_sharding_constraint = _sharding_constraint.with_sharding_constraint
