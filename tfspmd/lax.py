"""Named-axis collectives, as in `jax.lax`: use them inside a pmapped function."""

# pylint: disable=useless-import-alias
from tfspmd._src.collectives.all_to_all import all_to_all as all_to_all
from tfspmd._src.collectives.all_to_all import pswapaxes as pswapaxes
from tfspmd._src.collectives.gather import all_gather as all_gather
from tfspmd._src.collectives.gather import psum_scatter as psum_scatter
from tfspmd._src.collectives.indexing import axis_index as axis_index
from tfspmd._src.collectives.indexing import axis_size as axis_size
from tfspmd._src.collectives.permute import ppermute as ppermute
from tfspmd._src.collectives.permute import pshuffle as pshuffle
from tfspmd._src.collectives.reductions import pmax as pmax
from tfspmd._src.collectives.reductions import pmean as pmean
from tfspmd._src.collectives.reductions import pmin as pmin
from tfspmd._src.collectives.reductions import psum as psum

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pshuffle",
    "pswapaxes",
]
