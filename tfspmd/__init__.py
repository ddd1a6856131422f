"""tfspmd: JAX's pmap programming model for TensorFlow, on DTensor.

Write the program one device sees, name the mapped axis, and use named-axis
collectives from `tfspmd.lax`:

>>> import tensorflow as tf, tfspmd
>>> f = tfspmd.pmap(lambda x: x / tfspmd.lax.psum(x, 'i'), axis_name='i')
>>> print(f(tf.range(4.)))
[0.         0.16666667 0.33333334 0.5       ]
"""

from tfspmd._src.core import checkout_adapters as _checkout_adapters
from tfspmd._src.runtime import devices as _devices

# The one version: pyproject.toml reads it from here.
__version__ = "0.1.0"

_checkout_adapters.install(__path__[0])
_devices.configure_from_environment()

# pylint: disable=g-import-not-at-top,useless-import-alias
from tfspmd import distributed as distributed
from tfspmd import experimental as experimental
from tfspmd import lax as lax
from tfspmd import sharding as sharding
from tfspmd import tree as tree
from tfspmd import tree_util as tree_util
from tfspmd._src.arguments.global_arrays import make_array_from_callback as make_array_from_callback
from tfspmd._src.arguments.global_arrays import make_array_from_process_local_data as make_array_from_process_local_data
from tfspmd._src.arguments.global_arrays import make_array_from_single_device_arrays as make_array_from_single_device_arrays
from tfspmd._src.arguments.transfers import block_until_ready as block_until_ready
from tfspmd._src.arguments.transfers import device_get as device_get
from tfspmd._src.arguments.transfers import device_put as device_put
from tfspmd._src.arguments.transfers import device_put_replicated as device_put_replicated
from tfspmd._src.arguments.transfers import device_put_sharded as device_put_sharded
from tfspmd._src.core.config import config as config
from tfspmd._src.core.lru import clear_caches as clear_caches
from tfspmd._src.core.debug_mode import debug_mode as debug_mode
from tfspmd._src.programs.autodiff import grad as grad
from tfspmd._src.programs.autodiff import value_and_grad as value_and_grad
from tfspmd._src.programs.jit import jit as jit
from tfspmd._src.programs.pmap import pmap as pmap
from tfspmd._src.programs.shard_map import shard_map as shard_map
from tfspmd._src.programs.vmap import vmap as vmap
from tfspmd._src.runtime.devices import Device as Device
from tfspmd._src.runtime.devices import device_count as device_count
from tfspmd._src.runtime.devices import devices as devices
from tfspmd._src.runtime.devices import local_device_count as local_device_count
from tfspmd._src.runtime.devices import local_devices as local_devices
from tfspmd._src.runtime.devices import process_count as process_count
from tfspmd._src.runtime.devices import process_index as process_index
from tfspmd._src.runtime.devices import set_num_cpu_devices as set_num_cpu_devices
from tfspmd._src.runtime.mesh_context import set_mesh as set_mesh
from tfspmd._src.runtime.named_mesh import Mesh as Mesh
from tfspmd._src.runtime.named_mesh import PartitionSpec as PartitionSpec
from tfspmd._src.runtime.named_mesh import PartitionSpec as P
from tfspmd._src.runtime.named_mesh import make_mesh as make_mesh
from tfspmd._src.runtime.named_sharding import NamedSharding as NamedSharding
from tfspmd._src.runtime.sharded_array import Shard as Shard
from tfspmd._src.runtime.sharded_array import ShardedArray as ShardedArray

__all__ = [
    "Device",
    "Mesh",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "Shard",
    "ShardedArray",
    "block_until_ready",
    "clear_caches",
    "config",
    "debug_mode",
    "device_count",
    "device_get",
    "device_put",
    "device_put_replicated",
    "device_put_sharded",
    "devices",
    "distributed",
    "experimental",
    "grad",
    "jit",
    "lax",
    "local_device_count",
    "local_devices",
    "make_array_from_callback",
    "make_array_from_process_local_data",
    "make_array_from_single_device_arrays",
    "make_mesh",
    "pmap",
    "process_count",
    "process_index",
    "set_mesh",
    "set_num_cpu_devices",
    "shard_map",
    "sharding",
    "tree",
    "tree_util",
    "value_and_grad",
    "vmap",
]
