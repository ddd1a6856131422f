"""DTensor's eager API, each call made under its device's lock.

DTensor's device is not safe to enter from two threads at once (TF 2.21,
`dtensor_device`): every call tfspmd makes into it goes through here, so
that no module outside the executors holds the lock or changes the C
environment DTensor reads.
"""

from tensorflow.experimental import dtensor

from tfspmd._src.executors import dtensor_device
from tfspmd._src.executors import dtensor_settings


def pack(components, layout):
  """`dtensor.pack`: the DTensor of one tensor per local device."""
  with dtensor_device.entry:
    return dtensor.pack(components, layout)


def repack(value, layout):
  """The DTensor `value`'s per-device tensors, packed onto `layout`."""
  with dtensor_device.entry:
    return dtensor.pack(dtensor.unpack(value), layout)


def fetch_layout(value):
  """`dtensor.fetch_layout`."""
  with dtensor_device.entry:
    return dtensor.fetch_layout(value)


def relayout(value, layout):
  """`dtensor.relayout`, eagerly."""
  with dtensor_device.entry:
    return dtensor.relayout(value, layout)


def copy_to_mesh(tensor, layout):
  """`dtensor.copy_to_mesh`: a host tensor copied onto the mesh of `layout`."""
  with dtensor_device.entry:
    return dtensor.copy_to_mesh(tensor, layout)


def replicated_on(value):
  """The DTensor `value` whole on each device of its mesh."""
  with dtensor_device.entry:
    layout = dtensor.fetch_layout(value)
    if layout.is_fully_replicated():
      return value
    return dtensor.relayout(
        value, dtensor.Layout.replicated(layout.mesh, layout.rank))


def entered(function, *args):
  """`function(*args)`, a call into DTensor's device, under its lock."""
  with dtensor_device.entry:
    return function(*args)


def call_program(function, inputs, switches, mesh):
  """Calls a DTensor program on its placed `inputs`, under its `switches`.

  DTensor reads its switches when it lowers and starts the program, not
  while its results are awaited: other threads' calls go on then. A program
  with no inputs runs on `mesh`.
  """
  with dtensor_settings.applied(switches):
    with dtensor_device.entry:
      if inputs:
        return function(*inputs)
      with dtensor.default_mesh(mesh):
        return function()
