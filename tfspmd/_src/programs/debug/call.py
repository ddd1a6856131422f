"""A pmap call in debug mode: each device's program runs in its own thread.

The arguments go through the compiled path's own checks and helpers (the
`PmappedFunction`'s argument binding and device check), so a call that is
an error there is the same error here. Each device's slice of every mapped
input is taken on the host, the function runs eagerly once per device, each
in a thread of the call's `Session` with the axis bound to a `DebugFrame`,
and the per-device results are stacked along `out_axes` into eager
`tf.Tensor`s with the shapes and dtypes of the compiled path's results.
Under a GradientTape the call is recorded as one op (`debug.gradient`).
"""

import collections
import contextlib
import functools
import math

import tensorflow as tf

from tfspmd._src.arguments import arguments
from tfspmd._src.arguments import out_axes as out_axes_lib
from tfspmd._src.arguments import pmap_donation
from tfspmd._src.core import debug_mode as mode
from tfspmd._src.core import tf_internal
from tfspmd._src.programs import pmap_nested
from tfspmd._src.programs import vectorize
from tfspmd._src.programs.debug import exchange
from tfspmd._src.programs.debug import gradient
from tfspmd._src.programs.debug import session as session_lib
from tfspmd._src.rewrites import variable_writes
from tfspmd._src.runtime import axis_env
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.trees import tree

# pylint: disable=protected-access

_Bound = collections.namedtuple(
    "_Bound", ["size", "values", "in_axes", "axes", "rebuild"])

_DeviceResult = collections.namedtuple(
    "_DeviceResult", ["treedef", "specs", "outputs", "paths", "variables"])


def call(pmapped, args, kwargs):
  """Calls the `PmappedFunction` `pmapped` in debug mode.

  Raises:
    RuntimeError: If called while tracing a `tf.function`, a compiled pmap
      or a vmap.
    ValueError: With `steps=`, which debug mode does not run.
  """
  if not tf.executing_eagerly():
    raise RuntimeError(
        "pmap(debug=True) runs each device's program eagerly, so it cannot "
        "run while a tf.function, a compiled pmap or a vmap is being traced. "
        "Give debug=True to the outermost pmap (every pmap inside it runs in "
        "debug mode too) and call it outside any tf.function or vmap.")
  if devices_lib.process_count() > 1:
    raise NotImplementedError(
        "pmap(debug=True) runs one process's devices in threads of that "
        "process; with several processes (tfspmd.distributed), debug each "
        "process's program in a single-process run instead.")
  parent = axis_env.frames()
  if parent:
    pmap_nested.check_nested(pmapped.options)
  elif pmapped.options.steps is not None:
    raise ValueError(
        f"pmap(debug=True) does not run steps={pmapped.options.steps}: debug "
        f"the step function with steps=None, one step per call.")
  bound = _bind(pmapped, args, kwargs, parent)
  session = parent[-1].session if parent else session_lib.Session()
  chains = [parent + (session_lib.DebugFrame(
      pmapped.options.axis_name, bound.size, k, session=session,
      run_collective=exchange.over_axes),)
            for k in range(bound.size)]
  run = functools.partial(_run, pmapped, chains, bound.axes, bound.rebuild)
  # The tape of this thread cannot see the devices' threads: the call is
  # recorded as one op with a gradient of its own.
  if tf_internal.tape_active():
    return gradient.recorded_call(pmapped, run, bound)
  outputs, _, _ = run(bound.values)
  if not parent:
    pmap_donation.delete_donated(pmapped.options.donate_argnums, args, ())
  return outputs


def _bind(pmapped, args, kwargs, parent):
  """Checks the call as the compiled path does; returns a `_Bound`."""
  binding = pmapped.options.args
  call = binding.bind(args, kwargs)
  paths = call.paths
  values = [tf.convert_to_tensor(arguments.to_array_leaf(leaf, path))
            for leaf, path in zip(call.leaves, paths)]
  axes, size = binding.axes_and_size(
      call.in_axes, [tuple(v.shape) for v in values], paths)
  # The devices the compiled program would need, checked the same way.
  pmapped.options.mesh_devices(
      math.prod(frame.size for frame in parent) * size)
  return _Bound(size, values, call.in_axes, axes, call.rebuilder())


def _run(pmapped, chains, axes, rebuild, values, watch_variables=False):
  """Runs the devices' programs on the input leaves `values`.

  Returns:
    The outputs, the out axis of each output leaf, and (with
    `watch_variables`) the trainable variables the devices read.
  """
  pieces = [None if axis is None else tf.unstack(value, axis=axis)
            for value, axis in zip(values, axes)]

  def device(chain):
    k = chain[-1].index
    with mode.debug_mode(), _bound(chain), _reads(watch_variables) as read, \
         variable_writes.refused(chain[-1].name):
      args_k, kwargs_k = rebuild([value if split is None else split[k]
                                  for value, split in zip(values, pieces)])
      result = pmapped.options.fun(*args_k, **kwargs_k)
    out_leaves, out_treedef = tree.flatten(result)
    out_paths = tree.leaf_paths(result, "output")
    outputs = [vectorize.output_tensor(leaf, path)
               for leaf, path in zip(out_leaves, out_paths)]
    specs = out_axes_lib.resolve(pmapped.options.out_axes, result,
                                 [o.shape.rank for o in outputs])
    return _DeviceResult(out_treedef, specs, outputs, out_paths, read)

  session = chains[0][-1].session
  results = session.run_devices(chains, device, nested=len(chains[0]) > 1)
  variables = {}
  for result in results:
    variables.update((id(v), v) for v in result.variables)
  return (_assemble(results, chains, pmapped.options.axis_name,
                    pmapped.options.varying_output_error),
          results[0].specs,
          list(variables.values()))


@contextlib.contextmanager
def _reads(enabled):
  """Collects the trainable variables the body reads, if `enabled`."""
  found = []
  if not enabled:
    yield found
    return
  with tf.GradientTape() as tape:
    yield found
  found.extend(tape.watched_variables())


@contextlib.contextmanager
def _bound(chain):
  """Binds every axis of `chain` in this (new) thread, outermost first."""
  with contextlib.ExitStack() as stack:
    for frame in chain:
      stack.enter_context(axis_env.bound_axis(frame))
    yield


def _assemble(results, chains, axis_name, varying_output_error):
  """Stacks the devices' outputs along their out axes, as the compiled path.

  An output with out_axes None must be the same on every device, or
  `varying_output_error(path, axis_name)` is raised; where that gives None
  (shard_map's `check_vma=False`) it is the first device's.
  """
  devices = [session_lib.describe(chain) for chain in chains]
  first = results[0]
  for device, result in zip(devices[1:], results[1:]):
    if result.treedef != first.treedef:
      raise ValueError(
          f"pmap(debug=True): the device at {device} returned the tree "
          f"{tree.describe(result.treedef)}, the device at {devices[0]} "
          f"returned {tree.describe(first.treedef)}; every device must return "
          f"the same structure.")
  values = []
  for leaf, (spec, path) in enumerate(zip(first.specs, first.paths)):
    per_device = [result.outputs[leaf] for result in results]
    exchange.check_alike(per_device, devices, path)
    if spec is not None:
      values.append(tf.stack(per_device, axis=spec))
      continue
    # Bitwise, so that NaNs compare equal.
    if len({value.numpy().tobytes() for value in per_device}) > 1:
      error = varying_output_error(path, axis_name)
      if error is not None:
        raise error
    values.append(per_device[0])
  return first.treedef.unflatten(values)
