"""JAX's `jax.sharding`: meshes, partition specs and shardings.

>>> import numpy as np, tfspmd
>>> from tfspmd.sharding import Mesh, NamedSharding, PartitionSpec as P
>>> mesh = Mesh(np.array(tfspmd.devices()).reshape(4, 2), ('x', 'y'))
>>> x = tfspmd.device_put(np.arange(8.), NamedSharding(mesh, P('x')))
>>> x.sharding == NamedSharding(mesh, P('x'))
True
"""

# pylint: disable=useless-import-alias
from tfspmd._src.runtime.mesh_context import get_mesh as get_mesh
from tfspmd._src.runtime.mesh_context import set_mesh as set_mesh
from tfspmd._src.runtime.named_mesh import AxisType as AxisType
from tfspmd._src.runtime.named_mesh import Mesh as Mesh
from tfspmd._src.runtime.named_mesh import PartitionSpec as PartitionSpec
from tfspmd._src.runtime.named_sharding import NamedSharding as NamedSharding
from tfspmd._src.runtime.named_sharding import SingleDeviceSharding as SingleDeviceSharding

__all__ = [
    "AxisType",
    "Mesh",
    "NamedSharding",
    "PartitionSpec",
    "SingleDeviceSharding",
    "get_mesh",
    "set_mesh",
]
