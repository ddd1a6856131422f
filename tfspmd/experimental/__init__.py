"""JAX's `jax.experimental` names that JAX programs for many devices import.

>>> from tfspmd.experimental import mesh_utils, multihost_utils
>>> from tfspmd.experimental.shard_map import shard_map
"""

# pylint: disable=useless-import-alias
from tfspmd.experimental import mesh_utils as mesh_utils
from tfspmd.experimental import multihost_utils as multihost_utils
from tfspmd.experimental import shard_map as shard_map

__all__ = ["mesh_utils", "multihost_utils", "shard_map"]
