"""NumPy references shared by the test files: written without tfspmd."""

import numpy as np


def data(*shape, seed=0, dtype=np.float32):
  """Standard normal values of `shape`, the same for the same `seed`."""
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def finite_difference(f, x, eps=1e-2):
  """Central differences of the scalar function `f` at the float array `x`."""
  grad = np.zeros_like(x)
  for index in np.ndindex(x.shape):
    step = np.zeros_like(x)
    step[index] = eps
    grad[index] = (f(x + step) - f(x - step)) / (2 * eps)
  return grad


def over_axes(x, mesh_names, names, per_device):
  """A collective over the mesh axes `names`, device by device.

  Args:
    x: One leading dimension per mesh axis, then a device's value.
    mesh_names: The names of the mesh axes, in order.
    names: The axes the collective runs over. A device's group is the
      devices that differ from it only along `names`, in linear order over
      `names` with the first name major.
    per_device: `per_device(group_values, my_index_in_group)` -> the
      device's result.

  Returns:
    The results stacked over the mesh: `mesh shape + result shape`.
  """
  mesh_shape = x.shape[:len(mesh_names)]
  dims = [mesh_names.index(n) for n in names]
  results = {}
  for coords in np.ndindex(mesh_shape):
    members = []
    for position in np.ndindex(*[mesh_shape[d] for d in dims]):
      member = list(coords)
      for d, p in zip(dims, position):
        member[d] = p
      members.append(tuple(member))
    results[coords] = per_device([x[m] for m in members], members.index(coords))
  first = np.asarray(results[next(iter(results))])
  out = np.empty(mesh_shape + first.shape, first.dtype)
  for coords, value in results.items():
    out[coords] = value
  return out
