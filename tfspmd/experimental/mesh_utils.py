"""JAX's `jax.experimental.mesh_utils`: arrays of devices for a mesh.

>>> import tfspmd
>>> from tfspmd.experimental import mesh_utils
>>> tfspmd.Mesh(mesh_utils.create_device_mesh((4, 2)), ('data', 'model'))
Mesh({'data': 4, 'model': 2})
"""

# pylint: disable=useless-import-alias
from tfspmd._src.runtime.device_meshes import create_device_mesh as create_device_mesh
from tfspmd._src.runtime.device_meshes import create_hybrid_device_mesh as create_hybrid_device_mesh

__all__ = ["create_device_mesh", "create_hybrid_device_mesh"]
