"""JAX's `jax.experimental.shard_map`: `shard_map` in its older form.

`shard_map(f, mesh, in_specs, out_specs, check_rep=True, auto=frozenset())`
is `tfspmd.shard_map`, which takes that positional form as well as JAX's
current keyword form.

>>> import numpy as np, tfspmd
>>> from tfspmd.experimental.shard_map import shard_map
>>> mesh = tfspmd.make_mesh((8,), ('x',))
>>> f = shard_map(lambda b: b * 2, mesh, tfspmd.P('x'), tfspmd.P('x'))
>>> print(np.asarray(f(np.arange(8.))))
[ 0.  2.  4.  6.  8. 10. 12. 14.]
"""

# pylint: disable=useless-import-alias
from tfspmd._src.programs.shard_map import shard_map as shard_map

__all__ = ["shard_map"]
