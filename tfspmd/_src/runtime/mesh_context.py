"""The mesh of a context: `tfspmd.set_mesh`, as JAX's `jax.set_mesh`.

A shard_map given no mesh runs over the mesh set here (or by `with mesh:`)
when it is called. The mesh is per thread, as JAX's is, so threads that run
programs over different meshes do not see each other's.
"""

from __future__ import annotations

import types

from tfspmd._src.runtime import named_mesh
from tfspmd._src.runtime.named_mesh import Mesh


def get_mesh() -> Mesh | None:
  """The mesh `tfspmd.set_mesh` set in this thread, or None.

  Example:
    >>> import tfspmd
    >>> mesh = tfspmd.make_mesh((8,), ('x',))
    >>> with tfspmd.set_mesh(mesh):
    ...   print(tfspmd.sharding.get_mesh())
    Mesh({'x': 8})
    >>> print(tfspmd.sharding.get_mesh())
    None
  """
  return named_mesh.context_mesh()


# A class, as JAX's, so that the one call both sets the mesh and, used in a
# `with`, restores the previous one when the block ends.
class set_mesh:  # pylint: disable=invalid-name
  """Sets the mesh of this thread; in a `with`, until the block ends.

  `tfspmd.shard_map` without a `mesh` runs over this mesh. As JAX's
  `jax.set_mesh`, it works as a setter (`tfspmd.set_mesh(mesh)` sets it
  from then on; `tfspmd.set_mesh(None)` clears it) and as a context manager
  (`with tfspmd.set_mesh(mesh):` sets it for the block and restores the
  previous mesh after it).

  Args:
    mesh: A `tfspmd.Mesh`, or None for no mesh.

  Raises:
    TypeError: If `mesh` is neither a `tfspmd.Mesh` nor None.

  Example:
    >>> import numpy as np, tfspmd
    >>> from tfspmd import P
    >>> mesh = tfspmd.make_mesh((8,), ('x',))
    >>> double = tfspmd.shard_map(lambda b: b * 2, in_specs=P('x'),
    ...                           out_specs=P('x'))
    >>> with tfspmd.set_mesh(mesh):
    ...   print(np.asarray(double(np.arange(8.))))
    [ 0.  2.  4.  6.  8. 10. 12. 14.]
  """

  __slots__ = ("_previous",)

  def __init__(self, mesh: Mesh | None) -> None:
    if mesh is not None and not isinstance(mesh, Mesh):
      raise TypeError(
          f"set_mesh: `mesh` must be a tfspmd.Mesh (tfspmd.make_mesh(...)) "
          f"or None, got {type(mesh).__name__}.")
    self._previous = get_mesh()
    named_mesh.set_context_mesh(mesh)

  def __enter__(self) -> None:
    # The mesh is set already: the constructor sets it, for the setter form.
    pass

  def __exit__(self, exc_type: type[BaseException] | None,
               exc_value: BaseException | None,
               traceback: types.TracebackType | None) -> None:
    named_mesh.set_context_mesh(self._previous)
