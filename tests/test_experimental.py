"""`tfspmd.experimental`: JAX's `jax.experimental` names for many devices.

mesh_utils' arrays are checked against the layouts JAX's documentation
gives (a block of devices per process, the blocks in order along each
axis), with devices of several processes made up where one process has
only its own.
"""

import numpy as np
import pytest

import tfspmd
from tfspmd import P
from tfspmd._src.runtime.devices import Device
from tfspmd.experimental import mesh_utils
from tfspmd.experimental import shard_map as shard_map_module


def processes_of(devices_per_process, count):
  """Made-up CPU devices of `count` processes, ids in process order."""
  return [Device(id=p * devices_per_process + k, platform="cpu",
                 process_index=p, local_id=k,
                 name=f"/job:worker/replica:0/task:{p}/device:CPU:{k}")
          for p in range(count) for k in range(devices_per_process)]


def ids(grid):
  return np.vectorize(lambda device: device.id)(grid).tolist()


def test_create_device_mesh_lays_out_the_devices_in_order():
  grid = mesh_utils.create_device_mesh((2, 4))
  assert ids(grid) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  mesh = tfspmd.Mesh(grid, ("data", "model"))
  f = tfspmd.shard_map(lambda b: b + 1, mesh=mesh, in_specs=P("data", "model"),
                       out_specs=P("data", "model"))
  x = np.arange(16.).reshape(4, 4)
  np.testing.assert_array_equal(np.asarray(f(x)), x + 1)
  devices = tfspmd.devices()[::-1]
  assert ids(mesh_utils.create_device_mesh((4, 2), devices)) == [
      [7, 6], [5, 4], [3, 2], [1, 0]]


def test_a_hybrid_mesh_puts_each_process_in_a_block():
  devices = processes_of(4, 2)
  # Processes along the first axis: each row is one process's devices.
  assert ids(mesh_utils.create_hybrid_device_mesh((1, 4), (2, 1),
                                                  devices)) == [
      [0, 1, 2, 3], [4, 5, 6, 7]]
  # Along the second: each process a 2 x 2 block, side by side.
  assert ids(mesh_utils.create_hybrid_device_mesh((2, 2), (1, 2),
                                                  devices)) == [
      [0, 1, 4, 5], [2, 3, 6, 7]]
  # Processes in the order their devices come, unsorted.
  shuffled = devices[4:] + devices[:4]
  assert ids(mesh_utils.create_hybrid_device_mesh(
      (1, 4), (2, 1), shuffled, should_sort_granules_by_key=False)) == [
          [4, 5, 6, 7], [0, 1, 2, 3]]
  assert ids(mesh_utils.create_hybrid_device_mesh((2, 4), (1, 1))) == [
      [0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("call, error, words", [
    (lambda: mesh_utils.create_device_mesh((3, 2)), ValueError,
     "a mesh of shape (3, 2) holds 6 devices, but 8 were given"),
    (lambda: mesh_utils.create_device_mesh((2, 4.0)), TypeError,
     "`mesh_shape` must be a sequence of positive ints"),
    (lambda: mesh_utils.create_device_mesh((8,), ["cpu:0"] * 8), TypeError,
     "`devices` must be tfspmd devices"),
    (lambda: mesh_utils.create_device_mesh(
        (8,), contiguous_submeshes="yes"), TypeError,
     "`contiguous_submeshes` must be a bool"),
    (lambda: mesh_utils.create_hybrid_device_mesh((2, 4), (2, 1)),
     ValueError, "lays out 2 processes, but the devices belong to 1"),
    (lambda: mesh_utils.create_hybrid_device_mesh((8,), (1, 1)), ValueError,
     "must have one size per mesh axis each"),
    (lambda: mesh_utils.create_hybrid_device_mesh(
        (1, 4), (2, 1), processes_of(4, 2)[:7]), ValueError,
     "process 1 holds 3 of the devices, but a block of `mesh_shape` (1, 4) "
     "holds 4"),
])
def test_bad_arguments_name_what_was_expected(call, error, words):
  with pytest.raises(error) as raised:
    call()
  assert words in str(raised.value)


def test_the_experimental_shard_map_is_shard_map_in_its_older_form():
  assert shard_map_module.shard_map is tfspmd.shard_map
  mesh = tfspmd.make_mesh((4, 2), ("x", "y"))
  f = shard_map_module.shard_map(lambda b: tfspmd.lax.psum(b, "y"), mesh,
                                 in_specs=P("x", "y"), out_specs=P("x", None),
                                 check_rep=True)
  x = np.arange(32.).reshape(8, 4)
  np.testing.assert_array_equal(
      np.asarray(f(x)), x.reshape(8, 2, 2).sum(1))
