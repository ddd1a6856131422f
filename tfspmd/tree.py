"""JAX's `jax.tree`: the short names of `tfspmd.tree_util`'s functions.

>>> import tfspmd
>>> tfspmd.tree.map(lambda x: x * 2, {'a': 1, 'b': (2, 3)})
{'a': 2, 'b': (4, 6)}
>>> tfspmd.tree.leaves([1, {'k1': 2, 'k2': (3, 4)}, 5])
[1, 2, 3, 4, 5]
"""

# pylint: disable=redefined-builtin,useless-import-alias
from tfspmd._src.trees.tree_util import tree_all as all
from tfspmd._src.trees.tree_util import tree_flatten as flatten
from tfspmd._src.trees.tree_util import tree_flatten_with_path as flatten_with_path
from tfspmd._src.trees.tree_util import tree_leaves as leaves
from tfspmd._src.trees.tree_util import tree_leaves_with_path as leaves_with_path
from tfspmd._src.trees.tree_util import tree_map as map
from tfspmd._src.trees.tree_util import tree_map_with_path as map_with_path
from tfspmd._src.trees.tree_util import tree_reduce as reduce
from tfspmd._src.trees.tree_util import tree_structure as structure
from tfspmd._src.trees.tree_util import tree_transpose as transpose
from tfspmd._src.trees.tree_util import tree_unflatten as unflatten

__all__ = [
    "all",
    "flatten",
    "flatten_with_path",
    "leaves",
    "leaves_with_path",
    "map",
    "map_with_path",
    "reduce",
    "structure",
    "transpose",
    "unflatten",
]
