"""Tracing a pmap's program: one jit-compiled DTensor function per signature.

`cached_program` returns the `Program` of a call signature, tracing it the
first time: the per-device function vectorized over the mapped axis by pfor
(nested pmaps met while tracing add mesh dimensions), inside one
`tf.function(jit_compile=True)`, with the placement of every input and
output on the program's mesh.
"""

import dataclasses
import hashlib
import time

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import compile_log
from tfspmd._src.core import merged_dims
from tfspmd._src.core import multiprocess_hooks
from tfspmd._src.core import tf_internal
from tfspmd._src.core.config import config
from tfspmd._src.executors import dtensor_calls
from tfspmd._src.executors import dtensor_device
from tfspmd._src.executors import dtensor_settings
from tfspmd._src.executors import host as host_executor
from tfspmd._src.executors import replicated_ops
from tfspmd._src.executors import run_errors
from tfspmd._src.executors import selection
from tfspmd._src.executors import small_values
from tfspmd._src.programs import pmap_nested
from tfspmd._src.programs import steps as steps_lib
from tfspmd._src.programs import vectorize
from tfspmd._src.rewrites import control_flow
from tfspmd._src.rewrites import new_axis
from tfspmd._src.rewrites import rank_limits
from tfspmd._src.runtime import axis_env
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import mesh as mesh_lib
from tfspmd._src.runtime import placement as placement_lib
from tfspmd._src.trees import tree

_do_not_convert = tf.autograph.experimental.do_not_convert


@dataclasses.dataclass
class Program:
  """A traced program and how its inputs and outputs lie on the mesh.

  Attributes:
    function: Calls the compiled program on placed inputs (None for a
      program traced into a user's graph); for the host executor, its
      `host.HostExecutable`.
    input_placements: The `Placement` of each input leaf.
    input_wide: For each input leaf, whether the program takes it wide
      (`small_values`).
    input_blocks: For each input leaf, where each local device's block
      lies in a host array of its shape (`placement.host_blocks`).
    output_placements: The `Placement` of each output leaf.
    output_wide: For each output leaf, whether the program returns it wide.
    output_shapes: This process's shape of each output leaf (a
      `tf.TensorShape`, shared by the results of every call).
    output_dtypes: The dtype of each output leaf.
    output_treedef: The output tree.
    inline: The traced Python function, to call inside a user's graph
      (None for a program that runs on its own).
    output_axes: Where each output leaf has the mapped axis (None: nowhere).
    mesh: The DTensor mesh.
    size: The mapped size, over all processes.
    trainable_variables: The trainable variables the program reads.
    dtensor_switches: The DTensor settings it runs under.
    expanded: Whether they expand it into one function over all devices,
      whose outputs report the first device (`expanded_inputs`).
    device_generation: The `dtensor_device.generation()` it was traced in.
    may_fail: Whether it may fail while it runs (`run_errors.may_fail`): its
      call then waits for its results.
    effects: The `side_effects.Record`s of its prints and checks, whose
      values follow the outputs (`function` and `inline` return them after
      the output leaves): for each, its mask (if any), then its tensors.
    effect_placements: The `Placement` of each of those values.
    effect_shapes: This process's shape of each of those values.
    name: The mapped function, as messages name it ('pmap of step').
    signature: `((shape, dtype), ...)` of the inputs it was traced for.
    ran: Whether it ran once (DTensor lowered and compiled it then).
    executor: What runs it (`selection.HOST` or `selection.DTENSOR`).
  """
  function: object
  input_placements: tuple
  input_wide: tuple
  input_blocks: tuple
  output_placements: tuple
  output_wide: tuple
  output_shapes: tuple
  output_dtypes: tuple
  output_treedef: object
  inline: object
  output_axes: tuple
  mesh: object
  size: int
  trainable_variables: tuple
  dtensor_switches: tuple
  expanded: bool
  device_generation: int
  may_fail: bool
  effects: tuple = ()
  effect_placements: tuple = ()
  effect_shapes: tuple = ()
  name: str = ""
  signature: tuple = ()
  ran: bool = False
  executor: str = selection.DTENSOR


def cached_program(options, programs, key, call, values, in_user_graph=False,
                   lays_out=True, whole=False):
  """The `Program` of the call signature `key`, traced if not in `programs`.

  Args:
    options: The pmap's `PmapOptions`.
    programs: The pmap's `lru.LRUCache` of programs.
    key: `(treedef, static key, ((shape, dtype), ...))` of the call, with
      this process's shapes.
    call: The bound call (`mapped_args`).
    values: The input leaves (their dtypes are read).
    in_user_graph: Whether the program is for a user's graph (`inline`).
    lays_out: Whether the program places its values on the mesh
      (`axis_env.TraceState.lays_out`).
    whole: Whether `key` has the whole arrays' shapes, not this process's
      parts' (the DTensors a user's graph traces, with several processes).
  """
  program = known_program(programs, key, in_user_graph, lays_out)
  if program is None:
    shapes = [shape for shape, _ in key[2]]
    dtypes = [value.dtype for value in values]
    start = time.perf_counter()
    program = (_trace_of_whole_arrays(options, call, shapes, dtypes, lays_out)
               if whole else
               _trace(options, call, shapes, dtypes, in_user_graph, lays_out))
    program.name, program.signature = function_name(options), key[2]
    compile_log.traced(programs, program.name, key[2],
                       time.perf_counter() - start)
    programs.put(_cache_prefix(in_user_graph, lays_out) + key, program)
  return program


def _cache_prefix(in_user_graph, lays_out):
  """What a program's cache key holds beyond the call's signature.

  A program at the top level keeps the executor it was traced under: a
  change of `tfspmd_executor` traces anew.
  """
  executor = (None if in_user_graph or not lays_out else
              config.tfspmd_executor)
  return (in_user_graph, lays_out, executor)


def function_name(options):
  """The mapped function as messages name it: 'pmap of step'."""
  if options.level is not None:
    return f"shard_map of {options.level.function_name}"
  fun = options.fun
  return f"pmap of {getattr(fun, '__qualname__', None) or repr(fun)}"


def known_program(programs, key, in_user_graph=False, lays_out=True):
  """The `Program` of the call signature `key` in `programs`, or None.

  None also for a DTensor program traced before DTensor's device was
  replaced (`dtensor_device.generation`): it cannot run on the new one.
  """
  program = programs.get(_cache_prefix(in_user_graph, lays_out) + key)
  if program is None or (
      program.executor == selection.DTENSOR and
      program.device_generation != dtensor_device.generation()):
    return None
  return program


@dataclasses.dataclass(frozen=True)
class _Call:
  """What every trace of one call signature shares.

  Attributes:
    options: The pmap's `PmapOptions`.
    call: The bound call (`mapped_args`).
    axes: The mapped axis of each input leaf (None: unmapped).
    dtypes: The dtype of each input leaf.
    local_shapes: The shape of each input leaf in this process.
    top_local: The mapped size in this process's inputs.
    devices: The devices of the program's mesh in this process.
    in_user_graph: Whether the program is for a user's graph (`inline`).
    lays_out: Whether the program places its values on the mesh.
    executor: What runs it (`selection`): a program the host executor
      runs lays nothing out.
  """
  options: object
  call: object
  axes: tuple
  dtypes: tuple
  local_shapes: tuple
  top_local: int
  devices: tuple
  in_user_graph: bool
  lays_out: bool
  executor: str = selection.DTENSOR


def _trace(options, call, shapes, dtypes, in_user_graph, lays_out):
  """The `Program` of a call whose input leaves have `shapes` in this process.

  With several processes each passes its part, and the program sees the
  whole array (`_trace_of_process_parts`).
  """
  axes, top_local = options.args.axes_and_size(call.in_axes, shapes,
                                               call.paths)
  local, total = options.process_share()
  try:
    devices = options.mesh_devices(top_local)
  except ValueError as error:
    # With devices= over several processes the inputs may be a nested
    # axis's parts (then the call gets a clearer error, below).
    if options.devices is None or local == total:
      raise
    devices, devices_error = options.devices, error
  else:
    devices_error = None
  executor = selection.DTENSOR
  if not in_user_graph and lays_out:
    executor = selection.executor_for(
        [device.platform for device in devices],
        devices_lib.process_count(), function_name(options))
    lays_out = executor == selection.DTENSOR
  signature = _Call(options, call, tuple(axes), tuple(dtypes), tuple(shapes),
                    top_local, tuple(devices), in_user_graph, lays_out,
                    executor)

  def trace(size, shapes, parts, crossing):
    try:
      program = _trace_whole(signature, size, shapes, parts, crossing)
    except ValueError:
      if devices_error is None:
        raise
      raise devices_error from None
    if devices_error is not None:
      raise devices_error
    return program

  if local == total:
    return trace(top_local, shapes, parts=False, crossing={})
  return _trace_of_process_parts(signature, top_local * total // local, trace)


def _trace_of_process_parts(signature, size, trace):
  """The `Program` of inputs that are this process's parts of the arrays.

  The mapped axis spans the devices of all processes (`size` positions),
  and a nested axis may too: a trace (`trace(size, shapes, parts,
  crossing)`) that meets a nested pmap whose inputs are still this
  process's part along its axis (`pmap_nested.CrossingAxis`) is done again
  with their global shapes.
  """
  options, axes = signature.options, signature.axes
  crossing, splits, names = {}, {}, {}
  while True:
    if crossing:
      size = pmap_nested.top_size(signature.top_local, crossing, names)
    shapes = [list(shape) for shape in signature.local_shapes]
    for leaf, axis in enumerate(axes):
      if axis is not None:
        shapes[leaf][axis] = size
    for (leaf, axis), depth in splits.items():
      shapes[leaf][axis] = crossing[depth].size
    try:
      return trace(size, [tuple(s) for s in shapes], parts=True,
                   crossing=dict(crossing))
    except pmap_nested.CrossingAxis as found:
      _check_crossing(options, found, crossing, names)
      if all(split in splits for split in found.splits):
        raise ValueError(
            f"pmap: a nested pmap's inputs hold {found.local} positions of "
            f"its axis of global size {found.size} in every trace; with "
            f"several processes give the nested pmaps at one depth the same "
            f"axis_size (docs/multiprocess.md).") from None
      crossing[found.depth] = axis_env.Crossing(found.local, found.size)
      names[found.depth] = found.axis_name
      splits.update((split, found.depth) for split in found.splits)


def _trace_of_whole_arrays(options, call, shapes, dtypes, lays_out):
  """The `Program`, for a user's graph, of inputs of the whole `shapes`.

  A DTensor traces with its whole shape, every nested axis's included, so
  no nested pmap finds a part of its axis; with several processes its
  layout, not its blocks in each process, says where it lies.
  """
  axes, size = options.args.axes_and_size(call.in_axes, shapes, call.paths)
  local, total = options.process_share()
  # The devices of the process's share of the outermost axis, at least one
  # where a nested axis crossing processes leaves it less than a position.
  devices = options.mesh_devices(max(1, size * local // total))
  signature = _Call(options, call, tuple(axes), tuple(dtypes), tuple(shapes),
                    size, tuple(devices), True, lays_out)
  return _trace_whole(signature, size, shapes, parts=False, crossing={})


def _check_crossing(options, found, crossing, names):
  """Raises if the crossing axis `found` cannot join those in `crossing`."""
  if options.devices is not None:
    raise ValueError(
        f"pmap: the nested pmap over axis {found.axis_name!r} has global "
        f"size {found.size}, of which its inputs hold {found.local} "
        f"positions, so its axis crosses processes; an axis crossing "
        f"processes needs the outermost pmap without devices=. Leave "
        f"devices= out: the nested pmaps' axes then form a grid over "
        f"tfspmd.devices() in process order (outer axis slowest), and each "
        f"process passes, for each mapped input, the block of it that its "
        f"own devices hold (docs/multiprocess.md).")
  if crossing.get(found.depth, (found.local, found.size)) != (found.local,
                                                              found.size):
    local, size = crossing[found.depth]
    raise ValueError(
        f"pmap: the nested pmaps over axes {names[found.depth]!r} and "
        f"{found.axis_name!r} run at one depth, so they share a mesh "
        f"dimension, but their axes cross processes differently: the "
        f"inputs of {names[found.depth]!r} hold {local} of its {size} "
        f"positions, those of {found.axis_name!r} {found.local} of "
        f"{found.size}. Give the nested pmaps at one depth the same "
        f"axis_size, and pass each the same positions of it "
        f"(docs/multiprocess.md).")


@dataclasses.dataclass
class _Traced:
  """What tracing the program found, beyond its outputs."""
  result: object = None
  mesh_key: object = None
  placements: tuple = ()
  output_wide: tuple = ()
  effect_placements: tuple = ()


def _trace_whole(signature, size, shapes, parts, crossing,
                 split_by_nested=frozenset()):
  """The `Program` over the whole arrays, of `shapes` and mapped `size`.

  `parts`, `crossing`: as `axis_env.TraceState` takes them. Small unmapped
  inputs are taken wide (`small_values`) but those in `split_by_nested`: a
  nested pmap maps them, and they are placed split as it needs them (a
  process passes its part of them), which a trace finds.
  """
  options, axes = signature.options, signature.axes
  top_dim = options.mesh_dim or mesh_lib.mesh_dim_name(0)
  # A serving function's input_signature may leave the per-device sizes
  # open: such a program runs only inside the user's graph, on one device,
  # where nothing lays its values out.
  open_sizes = any(None in shape for shape in shapes)
  state = axis_env.TraceState(
      mesh_axes=[mesh_lib.MeshAxis(options.axis_name, size, top_dim)],
      max_devices=(len(signature.devices) if options.devices is None
                   else size),
      devices=signature.devices, lays_out=signature.lays_out, parts=parts,
      crossing=crossing, given_devices=options.devices is not None,
      host=signature.executor == selection.HOST)
  # A program the user's graph calls takes that graph's tensors as they
  # are, and one that lays nothing out takes them whole.
  input_wide = tuple(
      signature.lays_out and not signature.in_user_graph and axis is None and
      leaf not in split_by_nested and small_values.is_small(shape, dtype)
      for leaf, (shape, axis, dtype) in enumerate(
          zip(shapes, axes, signature.dtypes)))
  traced = _Traced()
  program = _program_function(signature, state, size, shapes, input_wide,
                              top_dim, open_sizes, traced)
  # Named specs: TensorFlow reads each input's name from its placeholder,
  # and an unnamed one costs it a raised and caught error (1-2 ms each).
  specs = [tf.TensorSpec((small_values.WIDTH,) if wide else shape,
                         tf.as_dtype(dtype), name=f"input_{leaf}")
           for leaf, (shape, dtype, wide) in enumerate(
               zip(shapes, signature.dtypes, input_wide))]
  concrete = tf.function(program, jit_compile=True,
                         autograph=False).get_concrete_function(*specs)
  split_wide = {leaf for leaf in state.input_splits if input_wide[leaf]}
  if split_wide:
    return _trace_whole(signature, size, shapes, parts, crossing,
                        split_by_nested | split_wide)
  _check_program(options, concrete, open_sizes, traced.mesh_key, specs)
  return _program(signature, state, size, shapes, top_dim, input_wide,
                  program, concrete, traced)


def _program_function(signature, state, size, shapes, input_wide, top_dim,
                      open_sizes, traced):
  """The Python function of the program: the mapped function, laid out.

  Its trace fills `traced` (a `_Traced`).
  """
  options, axes = signature.options, signature.axes
  rebuild = signature.call.rebuilder()

  def on_slice(leaf, piece, _):
    state.record_origin(piece, leaf, [
        a for a in range(len(shapes[leaf])) if a != axes[leaf]])

  @_do_not_convert
  def program(*inputs):
    with axis_env.tracing(state):
      inputs = [small_values.narrow(value, shapes[leaf]) if wide else value
                for leaf, (value, wide) in enumerate(zip(inputs, input_wide))]
      for leaf, (value, axis) in enumerate(zip(inputs, axes)):
        if axis is None:
          state.record_origin(value, leaf, range(len(shapes[leaf])))
      frame_template = (options.axis_name, size, top_dim)
      if options.steps is None:
        result = vectorize.map_over_axis(
            options.fun, frame_template=frame_template, inputs=list(inputs),
            in_axes=axes, rebuild_args=rebuild, out_axes=options.out_axes,
            on_slice=on_slice, varying_output_error=options.varying_output_error)
      else:
        result = steps_lib.map_steps(
            options.fun, options.steps, frame_template=frame_template,
            inputs=list(inputs), in_axes=axes, paths=signature.call.paths,
            carry_treedef=_carry_treedef(signature.call.dynamic,
                                         options.steps),
            rebuild_args=rebuild, out_axes=options.out_axes,
            on_slice=on_slice)
      if state.crossing:
        pmap_nested.check_parts(state, signature.top_local)
      if not open_sizes:
        _check_static_shapes(result)
      traced.result, traced.mesh_key = result, state.mesh_key()
      return (_laid_out_outputs(signature, state, result, top_dim, traced) +
              _laid_out_effects(signature, result, top_dim, traced))

  return program


def _laid_out_outputs(signature, state, result, top_dim, traced):
  """The program's outputs on the mesh; their placements go to `traced`."""
  placements, output_wide, outputs = [], [], []
  for value, axis, per_device in zip(result.values, result.out_axes,
                                     result.per_device):
    spec = [None] * value.shape.rank
    if axis is not None:
      for split_axis, dim in state.result_splits(
          per_device, axis, top_dim).items():
        spec[split_axis] = dim
    placement = placement_lib.placement_for(traced.mesh_key, tuple(spec))
    placements.append(placement)
    wide = (signature.lays_out and not signature.in_user_graph and
            small_values.is_small_replicated(spec, value.shape, value.dtype))
    output_wide.append(wide)
    if wide:
      # Whole on each device first: a nested pmap's result may be split.
      value = _relayout(small_values.widen(
          _relayout(value, placement.layout)),
                        small_values.wide_layout(placement.mesh))
    elif signature.lays_out:
      value = _relayout(value, placement.layout)
    outputs.append(value)
  traced.placements, traced.output_wide = tuple(placements), tuple(output_wide)
  return outputs


def _laid_out_effects(signature, result, top_dim, traced):
  """The values of the program's prints and checks, after its outputs."""
  placements, outputs = [], []
  for value in _effect_values(result.effects):
    # Split over the outermost axis like a mapped output: no device
    # sends its part to another.
    placement = placement_lib.placement_for(
        traced.mesh_key, (top_dim,) + (None,) * (value.shape.rank - 1))
    placements.append(placement)
    outputs.append(_relayout(value, placement.layout) if signature.lays_out
                   else value)
  traced.effect_placements = tuple(placements)
  return outputs


def _check_program(options, concrete, open_sizes, mesh_key, specs):
  """Raises, before the program runs, for what DTensor would run wrong."""
  new_axis.check_program(concrete.outputs, options.axis_name)
  _check_no_stateful_random(concrete.graph, options.axis_name)
  if not open_sizes:
    _check_no_data_dependent_shapes(concrete.graph, options.axis_name)
  _check_kernel_ranks(concrete.graph, options.axis_name, mesh_key)
  multiprocess_hooks.check_same_program(
      lambda: _describe(options, mesh_key, specs, concrete.graph))


def _program(signature, state, size, shapes, top_dim, input_wide, program,
             concrete, traced):
  """The `Program` of the traced `concrete` function."""
  mesh_key, result = traced.mesh_key, traced.result
  input_placements = []
  for leaf, (shape, axis) in enumerate(zip(shapes, signature.axes)):
    spec = [None] * len(shape)
    if axis is not None:
      spec[axis] = top_dim
    for original_axis, dim in state.input_splits.get(leaf, {}).items():
      spec[original_axis] = dim
    input_placements.append(placement_lib.placement_for(mesh_key, tuple(spec)))
  mesh = mesh_lib.mesh_for_axes(*mesh_key)
  on_host = signature.executor == selection.HOST
  graph_def = None if on_host else concrete.graph.as_graph_def()
  switches = ()
  # A program traced into a user's graph runs only there (`inline`); what
  # it closes over may be the user's graph tensors, which DTensor cannot
  # place from here.
  function = None
  if on_host:
    function = host_executor.HostExecutable(
        concrete, signature.devices[0].name, function_name(signature.options),
        xla=signature.options.jit_compile)
  elif not signature.in_user_graph:
    replicated_ops.enroll(
        node.op for node in dtensor_settings.nodes(graph_def))
    switches = dtensor_settings.for_program(
        mesh_key.devices, len(mesh_key.sizes), devices_lib.process_count(),
        graph_def, after_a_failure=dtensor_device.generation() > 0)
    function = dtensor_calls.flat_caller(
        concrete, [_on_mesh(value, mesh) for value in concrete.captured_inputs])
  return Program(
      function=function,
      input_placements=tuple(input_placements),
      input_wide=input_wide,
      input_blocks=tuple(
          placement_lib.host_blocks(placement, shape)
          for placement, shape in zip(input_placements,
                                      signature.local_shapes)),
      output_placements=traced.placements,
      output_wide=traced.output_wide,
      output_shapes=tuple(
          tf.TensorShape(placement.local_shape(tuple(v.shape)))
          for v, placement in zip(result.values, traced.placements)),
      output_dtypes=tuple(v.dtype for v in result.values),
      output_treedef=result.treedef,
      # Kept only where it is called: its closure holds the trace, the
      # per-device graph included.
      inline=program if signature.in_user_graph else None,
      output_axes=tuple(result.out_axes),
      size=size,
      trainable_variables=tuple(concrete.trainable_variables),
      dtensor_switches=switches,
      expanded=dtensor_settings.expands(switches),
      mesh=mesh,
      device_generation=dtensor_device.generation(),
      may_fail=not on_host and run_errors.may_fail(graph_def),
      effects=tuple(result.effects),
      effect_placements=traced.effect_placements,
      effect_shapes=tuple(
          tf.TensorShape(placement.local_shape(tuple(value.shape)))
          for value, placement in zip(_effect_values(result.effects),
                                      traced.effect_placements)),
      executor=signature.executor)


def _effect_values(records):
  """The tensors the program returns for `records`, in `Program.effects` order."""
  values = []
  for record in records:
    if record.mask is not None:
      values.append(record.mask)
    values.extend(record.tensors)
  return values


def effect_values(program, values):
  """Splits the values of `Program.effects` into `(mask, tensors)` per record."""
  values = iter(values)
  split = []
  for record in program.effects:
    mask = None if record.mask is None else next(values)
    split.append((mask, [next(values) for _ in record.tensors]))
  return split


def _describe(options, mesh_key, specs, graph):
  """The traced program in words every process would write the same way.

  Two lambdas on one line have one name: the digest of the program's op
  types tells their programs apart (a psum's from a pmax's).
  """
  function = getattr(options.fun, "__qualname__", type(options.fun).__name__)
  _, sizes, devices = mesh_key
  inputs = ", ".join(f"{spec.dtype.name}{spec.shape.as_list()}"
                     for spec in specs)
  ops = hashlib.sha1(" ".join(
      op.type for op in graph.get_operations()).encode()).hexdigest()[:10]
  return (f"pmap of {function} over axis {options.axis_name!r}, a mesh of "
          f"{' x '.join(str(s) for s in sizes)} on devices "
          f"{[device.id for device in devices]}, inputs ({inputs}), ops {ops}")


def _check_static_shapes(result):
  """Raises for an output whose size depends on the data (`tf.unique`)."""
  for value, path in zip(result.values, result.paths):
    if not value.shape.is_fully_defined():
      raise ValueError(
          f"the pmapped function returned {path} of shape {value.shape} (with "
          f"the mapped axis), whose size depends on the data (from an op such "
          f"as tf.unique, tf.boolean_mask or tf.where); DTensor lays out only "
          f"static shapes. Return a fixed-size result: pad it to its largest "
          f"size, with its length (or a mask) as another output.")


# Ops whose outputs have no static shape by design: py functions until the
# user says it (tf.ensure_shape, which the outputs' own check asks for), and
# the inputs of loop bodies and conditions, which TensorFlow may relax.
_SHAPELESS_BY_DESIGN = frozenset(("EagerPyFunc", "PyFunc", "PyFuncStateless",
                                  "Placeholder"))


def _check_no_data_dependent_shapes(graph, axis_name):
  """Raises for an op whose output size depends on the data (tf.unique).

  Every input of the program has a static shape, so a tensor of unknown
  size comes from such an op; DTensor mis-expands it (wrong values, or a
  crash of the process, TF 2.21), as it lays out only static shapes.
  """
  def data_dependent(operation):
    return operation.type not in _SHAPELESS_BY_DESIGN and any(
        output.dtype not in (tf.resource, tf.variant) and
        not output.shape.is_fully_defined() for output in operation.outputs)

  found = control_flow.find_operation(graph.get_operations(), data_dependent)
  if found is not None:
    shape = next(o.shape for o in found.outputs if not o.shape.is_fully_defined())
    name = tf_internal.user_op_name(found)
    raise ValueError(
        f"the function mapped over axis {axis_name!r} makes a tensor whose "
        f"size depends on the data: the op {found.type} ({name}) gives "
        f"shape {shape}, as tf.unique, tf.boolean_mask, tf.where(condition) "
        f"or a slice with a computed end do. A pmap's program needs static "
        f"shapes, as under jax.pmap: keep the full size and mask instead "
        f"(tf.where(condition, x, 0), a weight of 0, a one-hot sum), or pad "
        f"to a fixed size.")


# TensorFlow's random ops that draw from a hidden state of the process.
_STATEFUL_RANDOM = frozenset((
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "RandomShuffle", "Multinomial", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2",
    "ParameterizedTruncatedNormal"))


def _check_no_stateful_random(graph, axis_name):
  """Raises for a stateful random op (`tf.random.uniform`), whichever executor.

  Its draws come from a hidden state of the process, not from the program's
  inputs: no executor can make them agree with a device's own run, and
  DTensor refuses them (TF 2.21).
  """
  found = control_flow.find_operation(
      graph.get_operations(), lambda op: op.type in _STATEFUL_RANDOM)
  if found is not None:
    raise ValueError(
        f"the function mapped over axis {axis_name!r} uses the op "
        f"{found.type}, a stateful random op ({tf_internal.user_op_name(found)}"
        f"), whose draws come from a hidden state of the process that a "
        f"mapped program does not carry, as jax.pmap has no such op. Use the "
        f"stateless random ops (tf.random.stateless_uniform, ...) with a seed "
        f"passed as an argument; for a different stream on each device, fold "
        f"in lax.axis_index (tf.random.experimental.stateless_fold_in).")


def _check_kernel_ranks(graph, axis_name, mesh_key):
  """Raises for an op of a rank its kernel cannot take, before it runs.

  On TPUs XLA compiles the program, at any rank.
  """
  dims, _, devices = mesh_key
  if any(device.platform == "tpu" for device in devices):
    return
  found = control_flow.find_live_operation(graph,
                                           rank_limits.exceeds_kernel_rank)
  if found is not None:
    raise rank_limits.kernel_rank_error(found, axis_name, len(dims))


def _relayout(value, layout):
  """`dtensor.relayout`, moving uint64 as int64, which DTensor can move.

  DTensor's collectives refuse uint64 (TF 2.21); the cast keeps the bits.
  """
  if value.dtype != tf.uint64:
    return _relayout_below_kernel_rank(value, layout)
  moved = _relayout_below_kernel_rank(tf.cast(value, tf.int64), layout)
  return tf.cast(moved, tf.uint64)


def _relayout_below_kernel_rank(value, layout):
  """`dtensor.relayout`, of a value past rank 8 with its whole tail merged.

  DTensor moves a value between layouts with slices of its rank, which
  TensorFlow's kernels take up to rank 8; the dimensions after the last
  split one are whole on every device, so merging them moves no data.
  """
  specs = list(layout.sharding_specs)
  shape = value.shape
  split = [k for k, spec in enumerate(specs) if spec != dtensor.UNSHARDED]
  kept = (split[-1] + 1) if split else 0
  if (shape.rank is None or shape.rank <= merged_dims.MAX_KERNEL_RANK or
      not shape.is_fully_defined() or kept + 1 >= shape.rank):
    return dtensor.relayout(value, layout)
  sizes = shape.as_list()
  merged = tf.reshape(value, sizes[:kept] + [-1])
  moved = dtensor.relayout(merged, dtensor.Layout(
      specs[:kept] + [dtensor.UNSHARDED], layout.mesh))
  return tf.reshape(moved, sizes)


def _carry_treedef(dynamic, steps):
  if not dynamic:
    raise TypeError(
        f"pmap with steps={steps} needs the carry as the first positional "
        f"argument (not static), and got none.")
  return tree.flatten(dynamic[0])[1]


def _on_mesh(captured, mesh):
  """A tensor the program closes over, as DTensor takes it.

  DTensor takes an eager tensor that is not a DTensor only if it is a scalar
  or a small integer one ("was expecting a DTensor"): a closed-over array is
  copied to every device of the mesh once, when the program is traced (an
  eager tensor never changes). Resource handles (variables) pass as they are.
  """
  if (not isinstance(captured, tf.Tensor) or dtensor.is_dtensor(captured) or
      captured.dtype in (tf.resource, tf.variant)):
    return captured
  return placement_lib.replicated(captured, mesh)
