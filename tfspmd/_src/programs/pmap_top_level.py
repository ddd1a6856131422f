"""A pmap called at the top level: place the inputs, run, wrap the results.

Outside any trace, a call's leaves are NumPy arrays, tensors or
`ShardedArray`s. Each is placed on the program's mesh as the program wants
it, moving as little as possible (a `ShardedArray` already placed so is
passed as it is), and each output comes back as a `ShardedArray`.
"""

import time

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.arguments import arguments
from tfspmd._src.arguments import pmap_donation
from tfspmd._src.core import compile_log
from tfspmd._src.core import multiprocess_hooks
from tfspmd._src.core.config import config
from tfspmd._src.executors import dtensor_device
from tfspmd._src.executors import dtensor_errors
from tfspmd._src.executors import dtensor_values
from tfspmd._src.executors import expanded_inputs
from tfspmd._src.executors import host as host_executor
from tfspmd._src.executors import run_errors
from tfspmd._src.executors import selection
from tfspmd._src.executors import small_values
from tfspmd._src.programs import pmap_trace
from tfspmd._src.rewrites import side_effects
from tfspmd._src.runtime import placement as placement_lib
from tfspmd._src.runtime.sharded_array import ShardedArray
from tfspmd._src.trees import tree


def values_and_key(call):
  """The call's input leaves as arrays, and its signature for the cache.

  Returns:
    `(values, key)`: one `ShardedArray`, tensor or NumPy array per leaf, and
    `(treedef, static key, ((shape, dtype), ...))`.
  """
  values, signature = [], []
  # The leaves' paths are made only for a message: most calls need none.
  for index, leaf in enumerate(call.leaves):
    if isinstance(leaf, tf.Variable):
      leaf = tf.convert_to_tensor(leaf)
    value = _ready_value(leaf)
    if value is None:
      if isinstance(leaf, ShardedArray):
        raise pmap_donation.donated_argument_error(call.paths[index])
      value = arguments.to_array_leaf(leaf, call.paths[index])
    values.append(value)
    signature.append((tuple(value.shape), tf.as_dtype(value.dtype)))
  return values, (call.treedef, call.static_key, tuple(signature))


def known_call(options, programs, args, kwargs):
  """`(program, values)` of a call like one traced before, or None.

  The quick way of `values_and_key` and `pmap_trace.cached_program` for a
  call of a pmap without static arguments whose leaves are all ready to
  place (live `ShardedArray`s, numeric tensors and NumPy arrays): the key
  comes straight from the flattened arguments, with no `BoundCall`. Its
  checks passed when the program was traced for that key, so they would
  pass again. Any other call (None) takes the full way, which raises
  whatever error it has to.
  """
  if options.args.static_argnums:
    return None
  if not kwargs and all(isinstance(arg, _ARRAY_TYPES) for arg in args):
    # Arrays are the trees' leaves: no need to walk them (much the slower
    # way on a cold cache, as after each program's run).
    leaves, treedef = args, tree.flat_call_treedef(len(args))
  else:
    leaves, treedef = tree.flatten((args, kwargs))
  values, signature = [], []
  for leaf in leaves:
    value = _ready_value(leaf)
    if value is None:
      return None
    values.append(value)
    signature.append((tuple(value.shape), tf.as_dtype(value.dtype)))
  program = pmap_trace.known_program(programs, (treedef, (), tuple(signature)))
  return None if program is None else (program, values)


# Always leaves of tfspmd's trees (`tree`'s rules): never walked into.
_ARRAY_TYPES = (ShardedArray, np.ndarray, tf.Tensor)


def _ready_value(leaf):
  """`leaf` as a program takes it, or None if it needs converting or is refused.

  Ready: a live `ShardedArray`, a numeric or bool tensor, a numeric or bool
  NumPy array (narrowed as `config` says).
  """
  if isinstance(leaf, ShardedArray):
    return None if leaf.is_deleted() else leaf
  if isinstance(leaf, tf.Tensor):
    dtype = leaf.dtype
    if (dtype.is_numeric and not dtype.is_quantized) or dtype.is_bool:
      return leaf
    return None
  if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biufc":
    return config.narrowed(leaf)
  return None


def run(program, values, axis_name):
  """Places `values`, runs `program`, wraps its outputs as `ShardedArray`s.

  A program that fails while it runs leaves DTensor's device unusable: the
  device is replaced (`dtensor_device`) before the error is raised. DTensor
  runs programs asynchronously, so a program that may fail is waited on
  here, where its failure surfaces. The program's prints and checks happen
  after it ran (`side_effects`): a failed check raises here.
  """
  if program.executor == selection.HOST:
    return _run_on_host(program, values, axis_name)
  placed = [_place_wide(value, placement) if wide else
            _place(value, placement, blocks)
            for value, placement, blocks, wide in zip(
                values, program.input_placements, program.input_blocks,
                program.input_wide)]
  if program.expanded:
    placed = _as_expanded_outputs(values, placed, program.input_placements)
  first_run = not program.ran and config.tfspmd_log_compiles
  program.ran = True
  start = time.perf_counter() if first_run else None
  try:
    outputs = dtensor_values.call_program(
        program.function, placed, program.dtensor_switches, program.mesh)
    if program.may_fail or first_run:
      dtensor_device.components(outputs)
    if first_run:
      compile_log.compiled(program.name, program.signature,
                           time.perf_counter() - start)
  except tf.errors.OpError as e:
    multiprocess_hooks.raise_peer_failure(e)
    explained = dtensor_errors.explain(e, axis_name)
    if explained is not None:
      raise explained from None
    dtensor_device.replace()
    raise run_errors.failed_run(e, axis_name, program.mesh) from None
  outputs = _replay_effects(program, outputs, ShardedArray, axis_name)
  return [ShardedArray(value, placement, shape, dtype, wide=wide,
                       expanded=program.expanded)
          for value, placement, shape, dtype, wide in zip(
              outputs, program.output_placements, program.output_shapes,
              program.output_dtypes, program.output_wide)]


def _run_on_host(program, values, axis_name):
  """`run` for the host executor: the whole arrays in, the whole arrays out."""
  executable = program.function
  tensors = [_whole_on_host(value, executable.device) for value in values]
  first_run = not program.ran and config.tfspmd_log_compiles
  program.ran = True
  start = time.perf_counter() if first_run else None
  try:
    outputs = executable.run(tensors)
  except tf.errors.OpError as e:
    raise run_errors.failed_run(e, axis_name) from None
  if first_run:
    compile_log.compiled(program.name, program.signature,
                         time.perf_counter() - start,
                         by_xla=executable.compiled_by_xla)
  outputs = _replay_effects(program, outputs, ShardedArray.on_host,
                            axis_name)
  return [ShardedArray.on_host(value, placement, shape, dtype)
          for value, placement, shape, dtype in zip(
              outputs, program.output_placements,
              program.output_shapes, program.output_dtypes)]


def _replay_effects(program, outputs, array, axis_name):
  """Carries out the program's prints and checks; returns its output leaves.

  The values of its prints and checks follow its outputs; `array(value,
  placement, shape, dtype)` makes each an array, as the executor holds it.
  """
  count = len(program.output_placements)
  if program.effects:
    side_effects.replay_on_host(program.effects, pmap_trace.effect_values(
        program, [array(value, placement, shape, value.dtype)
                  for value, placement, shape in zip(
                      outputs[count:], program.effect_placements,
                      program.effect_shapes)]), axis_name)
  return outputs[:count]


def _whole_on_host(value, device):
  """The whole array of one input leaf, as a tensor the host program takes."""
  if isinstance(value, ShardedArray):
    return value._whole_tensor()  # pylint: disable=protected-access
  if isinstance(value, tf.Tensor) and dtensor.is_dtensor(value):
    return placement_lib.whole_on_host(value)
  return host_executor.put(value, device)


def _as_expanded_outputs(values, placed, placements):
  """The placed DTensors reporting devices as an expanded program's outputs.

  Those of host values go together, mapped and unmapped apart, and those
  of `ShardedArray`s apart from them: the groups a loop's calls keep. A
  `ShardedArray` given as it is holds the relabelled DTensor from then on
  (`expanded_inputs`).
  """
  groups = [None if isinstance(value, ShardedArray) and
            value._is_expanded(dtensor_value)  # pylint: disable=protected-access
            else (isinstance(value, ShardedArray), any(placement.spec))
            for value, dtensor_value, placement in zip(
                values, placed, placements)]
  if all(group is None for group in groups):
    return placed
  relabelled = expanded_inputs.as_outputs(placed, groups)
  for value, before, after in zip(values, placed, relabelled):
    if isinstance(value, ShardedArray) and after is not before:
      value._hold_expanded(before, after)  # pylint: disable=protected-access
  return relabelled


def _place(value, placement, blocks):
  """The DTensor of one input leaf on `placement`, moving as little as possible.

  `blocks` are `placement_lib.host_blocks` of the leaf's shape.
  """
  if isinstance(value, ShardedArray):
    current = value.placement
    if current is placement:
      return value.dtensor_value
    if current.block_map == placement.block_map:
      return placement_lib.repack(value.dtensor_value, placement)
    value = value.numpy()
  elif isinstance(value, tf.Tensor):
    if dtensor.is_dtensor(value):
      return placement_lib.relayout(value, placement)
    value = value.numpy()
  return placement_lib.pack_host_array(np.asarray(value), placement, blocks)


def _place_wide(value, placement):
  """The wide DTensor (`small_values`) of a small input whole on each device.

  A `ShardedArray` that a program returned wide goes in as it is.
  """
  if isinstance(value, ShardedArray):
    if value.placement.block_map == placement.block_map:
      return value._wide_value(placement)  # pylint: disable=protected-access
    value = value.numpy()
  elif isinstance(value, tf.Tensor):
    value = value.numpy()
  return placement_lib.pack_host_array(
      small_values.widen_host(value),
      placement_lib.placement_for(placement.mesh_key, (None,)))
