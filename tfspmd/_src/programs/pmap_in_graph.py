"""A pmap called while the user's own `tf.function` traces: its ops go there.

The program's ops go into the user's graph as they are (a nested
jit-compiled DTensor function mis-expands collectives: "SPMD expansion
resulted in op output inconsistent with the provided layout", TF 2.21).
`tf.function` traces a tensor and a DTensor alike, so in one process the
program has no DTensor op (no relayout): each collective is a reduction or
a reshuffle over the mapped axis of the stacked values, a correct program
on one device for plain tensors, which DTensor splits over the devices of
DTensor inputs as their layouts say (the user's own mesh included). A
SavedModel of such a function needs only TensorFlow to serve.

With several processes each passes only its part of a plain array, which
one device could not reduce over the others: there the program keeps its
relayouts onto the mesh of every process's devices, and takes DTensors,
which trace with their global shapes (a nested axis crossing processes
included): the program is traced over those.
"""

import tensorflow as tf

from tfspmd._src.arguments import arguments
from tfspmd._src.programs import pmap_trace
from tfspmd._src.rewrites import side_effects
from tfspmd._src.runtime import devices
from tfspmd._src.runtime import function_inputs
from tfspmd._src.runtime.sharded_array import ShardedArray


def call(pmapped, args, kwargs):
  """The outputs of the `PmappedFunction` on `args`, in the user's graph."""
  options, programs = pmapped.options, pmapped.programs
  bound = options.args.bind(args, kwargs)
  values = []
  several = devices.process_count() > 1
  function_inputs.mark(tf.compat.v1.get_default_graph(),
                       laid_out_over_processes=several)
  for leaf, path, axis in zip(bound.leaves, bound.paths, bound.in_axes):
    if isinstance(leaf, ShardedArray):
      leaf = leaf.dtensor_value
    value = arguments.traced_tensor(leaf, path)
    _check_sizes(value, path, axis, several, options)
    # Through an Identity: DTensor's mesh propagation cannot follow a loop
    # variable of the user's loop (`tf.range`) into a loop of the program
    # ("Block argument must be enclosed by a function", TF 2.21), but
    # follows an op's result.
    values.append(tf.identity(value))
  signature = tuple((tuple(v.shape), v.dtype) for v in values)
  key = (bound.treedef, bound.static_key, signature)
  program = pmap_trace.cached_program(
      options, programs, key, bound, values, in_user_graph=True,
      lays_out=several, whole=several)
  outputs = program.inline(*values)
  count = len(program.output_placements)
  side_effects.replay_in_graph(
      program.effects, pmap_trace.effect_values(program, outputs[count:]))
  return program.output_treedef.unflatten(list(outputs[:count]))


def _check_sizes(value, path, axis, several, options):
  """Raises for sizes a program in the user's graph cannot leave open.

  In one process a per-device size may be open (None), as a serving
  `input_signature` leaves a batch size: the program's ops take it when the
  graph runs. The mapped axis is the devices' count, which must be known,
  and with several processes every size: the program lays its values out
  over the processes' devices. `tf.function(reduce_retracing=True)` opens
  a size that changed between calls, the mapped one too, so its message
  names both ways a size comes to be open.
  """
  shape = value.shape
  if shape.rank is None:
    raise ValueError(
        f"pmap inside a tf.function needs the rank of its arguments, but "
        f"{path} has an unknown shape; give the tf.function an "
        f"input_signature with a shape such as [8, None, 3].")
  if several and not shape.is_fully_defined():
    raise ValueError(
        f"pmap inside a tf.function needs static shapes with several "
        f"processes, but {path} has shape {shape}; give the tf.function an "
        f"input_signature with full shapes, or call it with tensors of "
        f"fixed shape.")
  if axis is None:
    return
  axis %= shape.rank
  if shape[axis] is None:
    sizes = shape.as_list()
    sizes[axis] = (devices.local_device_count() if options.devices is None
                   else sum(1 for d in options.devices
                            if d.process_index == devices.process_index()))
    raise ValueError(
        f"{pmap_trace.function_name(options)} inside a tf.function maps "
        f"axis {axis} of {path}, of shape {shape}, whose size is open "
        f"(None): it is the number of devices, which the program needs when "
        f"it traces. The tf.function leaves it open where its "
        f"input_signature does, or where reduce_retracing=True opened a "
        f"size that changed between calls. Give the size: an "
        f"input_signature of tf.TensorSpec({sizes}, tf.{value.dtype.name}) "
        f"for this argument (the other sizes may stay None), or no "
        f"reduce_retracing=True, so that each size traces its own program.")
