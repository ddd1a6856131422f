"""Named-axis collectives, as in `jax.lax`: use them inside a pmapped function."""

# pylint: disable=useless-import-alias
from tfspmd._src.collectives.indexing import axis_index as axis_index
from tfspmd._src.collectives.indexing import axis_size as axis_size
from tfspmd._src.collectives.reductions import pmean as pmean
from tfspmd._src.collectives.reductions import psum as psum

__all__ = [
    "axis_index",
    "axis_size",
    "pmean",
    "psum",
]
