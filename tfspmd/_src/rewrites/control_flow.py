"""Loops, conditionals and function calls inside the per-device program.

pfor's own converters for `While`, `If`, `Case` and function calls wrap the
converted body in a nested `tf.function`, split a per-device predicate into
the positions that take each branch (`DynamicPartition`, `DynamicStitch`),
and give the loop state dynamic shapes. DTensor can place none of those
(TF 2.21), so the converters here vectorize the same ops as jax.vmap does:

* A loop whose predicate is the same on every device is one `tf.while_loop`
  over the stacked state, with static shapes and the body's ops converted
  in place.
* A loop whose predicate differs between devices runs until every device
  is done; a device that is done keeps its state unchanged (a select), as
  JAX's batched while.
* A conditional computes its branches and selects each device's result:
  `tf.cond`, `tf.switch_case` and `tf.case` with a per-device predicate or
  branch index, and with one the same everywhere (whose other branches
  then cost compute, not correctness).
* A call of a `tf.function` is inlined.
* Loops nest: each loop's variables enter its body through an Identity
  (see `_build_loop`), and TensorArrays, including those of a loop's
  gradient, are dense tensors (`tensor_lists`).

A collective needs every device of its axes to reach it. Where the devices
of a loop or conditional may go different ways, a collective inside it is
an error at trace time that names both, as the devices would not meet
under jax.pmap either.
"""

import contextlib
import functools
import math

import numpy as np
import tensorflow as tf

from tfspmd._src.core import merged_dims
from tfspmd._src.core import op_types
from tfspmd._src.core import stacking
from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal
from tfspmd._src.core import trace_context
from tfspmd._src.rewrites import branch_slices
from tfspmd._src.rewrites import counted_loops
from tfspmd._src.rewrites import dtensor_rewrites
from tfspmd._src.rewrites import lane_guards
from tfspmd._src.rewrites import shape_folding
from tfspmd._src.rewrites import side_effects
from tfspmd._src.rewrites import tensor_lists
from tfspmd._src.runtime import axis_env

_do_not_convert = tf.autograph.experimental.do_not_convert

_IF = ("If", "StatelessIf")
_CASE = ("Case", "StatelessCase")
_CALL = ("PartitionedCall", "StatefulPartitionedCall")

# Marker ops of collectives carry this attribute: the collective's name.
COLLECTIVE_ATTRIBUTE = "_tfspmd_collective"


def called_graphs(operation):
  """The function graphs the control-flow `operation` calls."""
  kind = operation.type
  if kind in op_types.LOOPS:
    return [tf_internal.function_graph(operation, "cond"),
            tf_internal.function_graph(operation, "body")]
  if kind in _IF:
    return [tf_internal.function_graph(operation, "then_branch"),
            tf_internal.function_graph(operation, "else_branch")]
  if kind in _CASE:
    return [tf_internal.function_graph(operation, ("branches", k))
            for k in range(len(operation.get_attr("branches")))]
  return [tf_internal.function_graph(operation, "f")]


def find_operation(operations, predicate):
  """The first of `operations`, or of the ops of functions they call, that
  satisfies `predicate`; None if there is none."""
  for operation in operations:
    if predicate(operation):
      return operation
    if operation.type in CONVERTERS:
      for graph in called_graphs(operation):
        found = find_operation(graph.get_operations(), predicate)
        if found is not None:
          return found
  return None


def find_live_operation(graph, predicate):
  """The first op some output of `graph` depends on that satisfies `predicate`.

  Follows the functions control flow calls, from their outputs. Ops that
  nothing uses (those an op callback replaced while tracing) never run and
  are not looked at.
  """
  seen = set()
  pending = [t.op for t in graph.outputs] + list(graph.control_outputs)
  while pending:
    operation = pending.pop()
    if operation in seen:
      continue
    seen.add(operation)
    if predicate(operation):
      return operation
    pending.extend(t.op for t in operation.inputs)
    pending.extend(operation.control_inputs)
    if operation.type in CONVERTERS:
      for called in called_graphs(operation):
        found = find_live_operation(called, predicate)
        if found is not None:
          return found
  return None


def effect_operations(operations, axis_name):
  """The ops among `operations` that are, or hold, side effects to keep.

  A print or check inside a loop raises: its effects cannot leave the
  compiled loop.
  """
  found = []
  for operation in operations:
    if side_effects.is_ignored(operation):
      continue
    if side_effects.is_effect(operation):
      found.append(operation)
    elif operation.type in CONVERTERS and any(
        effect_operations(graph.get_operations(), axis_name)
        for graph in called_graphs(operation)):
      if operation.type in op_types.LOOPS:
        raise side_effects.while_loop_error("tf.while_loop", axis_name)
      found.append(operation)
  return found


def _graph_effects(graph):
  return effect_operations(graph.get_operations(), None)


def _collectives_in(graphs):
  """The name of the first collective in `graphs` (or called from them)."""
  for graph in graphs:
    found = find_operation(
        graph.get_operations(),
        lambda op: getattr(op, COLLECTIVE_ATTRIBUTE, None) is not None)
    if found is not None:
      return getattr(found, COLLECTIVE_ATTRIBUTE)
  return None


def _diverging_collective_error(collective, construct, chooser):
  return ValueError(
      f"{collective} inside {construct} whose {chooser} differs between the "
      f"devices of the mapped axis: devices that go different ways would not "
      f"all reach the {collective}, so they cannot meet there (under jax.pmap "
      f"they would not either). Compute the {collective} outside the "
      f"{construct} and pass its result in, or make the {chooser} the same on "
      f"every device (for example from a pmax or psum of the per-device one).")


def _repeat(value, size):
  if value.stacked:
    return value.tensor
  return stacking.repeat_along_new_axis(value.tensor, 0, size)


def _select(predicate, on_true, on_false):
  """Per-position `predicate ? on_true : on_false` over the stacked axis."""
  shape = [-1] + [1] * (on_true.shape.rank - 1)
  return dtensor_rewrites.select(tf.reshape(predicate, shape), on_true,
                                  on_false)


@_do_not_convert
def prepare(conversion, operations, position=None):
  """Defines for pfor what among `operations` it cannot convert as it is.

  TensorArrays become dense tensors, and shape computations known when
  tracing constants (`shape_folding`). `position` is the
  `tensor_lists.LoopPosition` where `operations` are the body of a loop.
  """
  shape_folding.fold(conversion, operations)
  side_effects.prepare(conversion, operations)
  tensor_lists.densify(conversion, operations, _convert_while, position)


def _prepare_body(body_graph):
  """`prepare` for the body of a while_v2 loop (forward or backward)."""
  steps = (body_graph.inputs[2]
           if tf_internal.is_loop_gradient_body(body_graph) else None)
  return functools.partial(
      prepare, position=tensor_lists.LoopPosition(body_graph.inputs[0], steps))


# --- calls -------------------------------------------------------------------


@_do_not_convert
def _convert_call(op_inputs):
  graph = tf_internal.function_graph(op_inputs.op, "f")
  converted = tf_internal.convert_graph_inline(
      op_inputs, graph, op_inputs.inputs(), prepare,
      _graph_effects(graph))
  if not op_inputs.op.outputs:
    return tf.no_op()
  return [tf_internal.wrap_converted(v.tensor, v.stacked) for v in converted]


# --- conditionals ------------------------------------------------------------


def _branch_outputs(op_inputs, graphs, inputs, chosen=None):
  """The converted outputs of each branch.

  `chosen[k]` (a bool per device, or one for all) tells where branch `k`
  is taken, and so where its side effects happen; None: the one branch.
  """
  outputs = []
  for k, graph in enumerate(graphs):
    effects = _graph_effects(graph)
    if chosen is None:
      outputs.append(tf_internal.convert_graph_inline(
          op_inputs, graph, inputs, prepare, effects))
      continue
    with lane_guards.reached_where(chosen[k]), (
        side_effects.branch(chosen[k], (op_inputs.op._id, k))  # pylint: disable=protected-access
        if effects else contextlib.nullcontext()):
      outputs.append(tf_internal.convert_graph_inline(
          op_inputs, graph, inputs, prepare, effects))
  return outputs


def _fake_outputs(graphs):
  """For each branch, which of its outputs are placeholders of another's.

  A conditional under a tape also returns each branch's intermediates for
  its gradient; the other branches return a `FakeParam` in their place,
  never read, since the gradient takes the same branch (TensorFlow's
  cond_v2 under XLA).
  """
  return [[output.op.type == "FakeParam" for output in graph.outputs]
          for graph in graphs]


def _merge_branches(op_inputs, chosen, branch_outputs, chooser_stacked,
                    fake):
  """Each output: the branch `chosen[k]` (a bool per branch) picks.

  An intermediate only one branch computes is that branch's value as it
  is: its gradient reads it only where that branch was taken, and a value
  the same on every device (a shape) stays so.

  A predicate the same everywhere is broadcast to the value's shape first:
  DTensor's layout propagation of a select with a scalar predicate crashes
  the process (TF 2.21).
  """
  size = op_inputs.loop_size
  merged = []
  for index, outputs in enumerate(zip(*branch_outputs)):
    real = [v for v, placeholders in zip(outputs, fake)
            if not placeholders[index]]
    if len(real) == 1:
      merged.append(tf_internal.wrap_converted(*real[0]))
      continue
    same = _same_static_value(real)
    if same is not None:
      merged.append(tf_internal.wrap_converted(same, False))
      continue
    stacked = chooser_stacked or any(v.stacked for v in outputs)
    values = [_repeat(v, size) if stacked else v.tensor for v in outputs]
    result = values[-1]
    for picks, value in reversed(list(zip(chosen[:-1], values[:-1]))):
      if chooser_stacked:
        result = _select(picks, value, result)
      else:
        everywhere = tf.logical_and(tf.ones(tf.shape(value), tf.bool), picks)
        result = dtensor_rewrites.select(everywhere, value, result)
    merged.append(tf_internal.wrap_converted(result, stacked))
  return merged


@_do_not_convert
def _convert_if(op_inputs):
  values = op_inputs.inputs()
  predicate = values[0]
  graphs = [tf_internal.function_graph(op_inputs.op, "then_branch"),
            tf_internal.function_graph(op_inputs.op, "else_branch")]
  if predicate.stacked:
    found = _collectives_in(graphs)
    if found is not None:
      raise _diverging_collective_error(found, "tf.cond", "predicate")
  # The per-device op's predicate folds where it depends on static shapes.
  known = static_values.value(op_inputs.op.inputs[0])
  if known is not None:
    return _only_branch(op_inputs, graphs[0 if known else 1], values[1:])
  truth = tf.cast(predicate.tensor, tf.bool)
  chosen = [truth, tf.logical_not(truth)]
  outputs = _branch_outputs(op_inputs, graphs, values[1:], chosen)
  return _merged_or_effects(op_inputs, graphs, chosen, outputs,
                            predicate.stacked)


def _only_branch(op_inputs, graph, inputs):
  """The branch a predicate known when tracing takes, alone.

  TensorFlow's own code conditions on static sizes (`tf.math.
  is_non_decreasing` of a short vector), and its branches may then give
  shapes that no select could merge.
  """
  outputs = _branch_outputs(op_inputs, [graph], inputs)[0]
  if not op_inputs.op.outputs:
    return tf.no_op()
  return [tf_internal.wrap_converted(v.tensor, v.stacked) for v in outputs]


def _same_static_value(values):
  """The value of all `values` if all are one known when tracing, else None.

  Branches of a gradient give the dense shape of their IndexedSlices as
  different tensors of one value; picking between them per device would
  make a shape differ between devices.
  """
  if any(v.stacked for v in values):
    return None
  known = [static_values.value(v.tensor) for v in values]
  if any(k is None for k in known) or any(
      not np.array_equal(k, known[0]) for k in known[1:]):
    return None
  return tf.constant(known[0], values[0].tensor.dtype)


def _merged_or_effects(op_inputs, graphs, chosen, branch_outputs,
                       chooser_stacked):
  """`_merge_branches`, or an op for a conditional with only side effects."""
  if not op_inputs.op.outputs:
    return tf.no_op()
  if chooser_stacked:
    branch_outputs = branch_slices.merge_ready(graphs, branch_outputs,
                                               op_inputs.loop_size)
  return _merge_branches(op_inputs, chosen, branch_outputs, chooser_stacked,
                         _fake_outputs(graphs))


@_do_not_convert
def _convert_case(op_inputs):
  values = op_inputs.inputs()
  index = values[0]
  count = len(op_inputs.op.get_attr("branches"))
  graphs = [tf_internal.function_graph(op_inputs.op, ("branches", k))
            for k in range(count)]
  if index.stacked:
    found = _collectives_in(graphs)
    if found is not None:
      raise _diverging_collective_error(
          found, "tf.switch_case (or tf.case)", "branch index")
  known = static_values.value(op_inputs.op.inputs[0])
  if known is not None:
    # An index out of range takes the last branch, as the Case op does.
    branch = int(known) if 0 <= int(known) < count else count - 1
    return _only_branch(op_inputs, graphs[branch], values[1:])
  # An index out of range takes the last branch, as the Case op does.
  chosen = [tf.equal(index.tensor, k) for k in range(count - 1)]
  chosen.append(tf.logical_not(tf.reduce_any(
      tf.stack(chosen, axis=-1), axis=-1)) if chosen else tf.constant(True))
  outputs = _branch_outputs(op_inputs, graphs, values[1:], chosen)
  return _merged_or_effects(op_inputs, graphs, chosen, outputs, index.stacked)


# --- loops -------------------------------------------------------------------


def _loop_stacking(op_inputs, cond_graph, body_graph, values):
  """Which loop variables must be stacked, and whether the predicate is.

  A variable that enters the same on every device may leave a body pass
  different on each (it adds axis_index, or a per-device input): it is
  then stacked from the start, and the body converted again, until nothing
  changes (pfor's own loop converter iterates the same way). Once the
  predicate is per-device, every variable the body changes is too.
  The conversions happen in a scratch graph that is thrown away.
  """
  stacked = [v.stacked for v in values]
  size = op_inputs.loop_size
  while True:
    with tf_internal.scratch_graph():
      inputs = [tf_internal.ConvertedValue(
          _repeat(v, size) if s else v.tensor, s)
                for v, s in zip(values, stacked)]
      predicate = tf_internal.convert_graph_inline(
          op_inputs, cond_graph, inputs, prepare)[0]
      outputs = tf_internal.convert_graph_inline(
          op_inputs, body_graph, inputs, _prepare_body(body_graph))
    changed = False
    for k, output in enumerate(outputs):
      through = body_graph.outputs[k] is body_graph.inputs[k]
      want = output.stacked or (predicate.stacked and not through)
      if want and not stacked[k]:
        stacked[k] = True
        changed = True
    if not changed:
      return stacked, predicate.stacked


@contextlib.contextmanager
def remembered_loop_stacking():
  """Within, each loop's stacking is found once per stacked inputs.

  A loop nested in another is converted in every pass of the outer loop's
  `_loop_stacking` and again when the outer loop is built. Finding the
  inner loop's stacking anew each time would multiply the conversions by
  the passes of every enclosing loop; what it finds depends only on which
  of the loop's inputs are stacked (the loop size is the same throughout
  one vectorization), so it is kept for the vectorization.
  """
  context = trace_context.this_thread
  enclosing, context.loop_stacking = context.loop_stacking, {}
  try:
    yield
  finally:
    context.loop_stacking = enclosing


def _remembered_loop_stacking(op_inputs, cond_graph, body_graph, values):
  """`_loop_stacking`, found once per loop and stacked inputs."""
  results = trace_context.this_thread.loop_stacking
  if results is None:
    return _loop_stacking(op_inputs, cond_graph, body_graph, values)
  key = (op_inputs.op, tuple(v.stacked for v in values))
  if key not in results:
    results[key] = _loop_stacking(op_inputs, cond_graph, body_graph, values)
  stacked, per_device = results[key]
  return list(stacked), per_device


@_do_not_convert
def _convert_while(op_inputs):
  operation = op_inputs.op
  cond_graph = tf_internal.function_graph(operation, "cond")
  body_graph = tf_internal.function_graph(operation, "body")
  values = op_inputs.inputs()
  size = op_inputs.loop_size
  stacked, per_device = _remembered_loop_stacking(op_inputs, cond_graph,
                                                  body_graph, values)
  if per_device:
    found = _collectives_in([cond_graph, body_graph])
    if found is not None:
      raise _diverging_collective_error(found, "tf.while_loop", "condition")

  init = [_repeat(v, size) if s else v.tensor
          for v, s in zip(values, stacked)]
  final = _build_loop(op_inputs, operation, cond_graph, body_graph, stacked,
                      per_device, init, size)
  return [tf_internal.wrap_converted(t, s) for t, s in zip(final, stacked)]


def _flat_shapes(stacked, init):
  """For each loop variable, its shape if it is carried flat, else None.

  A stacked variable that the enclosing mapped axes would take past the
  rank TensorFlow's kernels take is carried as `[size, elements]`: DTensor
  moves a loop variable between layouts inside the loop with slices of
  the variable's own rank. Its dimensions after the stacked one are the
  device's own, never split, so the reshape moves no data.
  """
  enclosing = len(axis_env.frames())
  return [t.shape.as_list() if (
      s and t.dtype != tf.variant and t.shape.is_fully_defined() and
      t.shape.rank > 2 and
      t.shape.rank + enclosing > merged_dims.MAX_KERNEL_RANK) else None
          for t, s in zip(init, stacked)]


def _build_loop(op_inputs, operation, cond_graph, body_graph, stacked,
                per_device, init, size):
  """The vectorized loop: one tf.while_loop over the stacked state."""
  shapes = _flat_shapes(stacked, init)

  def flat(state):
    return [t if shape is None else tf.reshape(t, [shape[0], -1])
            for t, shape in zip(state, shapes)]

  def convert(graph, state):
    # Through an Identity: DTensor's mesh propagation cannot follow a loop
    # variable into a loop nested in this one ("Block argument must be
    # enclosed by a function", TF 2.21), but follows an op's result.
    state = [tf.identity(t) if shape is None else tf.reshape(t, shape)
             for t, shape in zip(state, shapes)]
    return tf_internal.convert_graph_inline(op_inputs, graph, [
        tf_internal.ConvertedValue(t, s)
        for t, s in zip(state, stacked)],
                                            prepare if graph is cond_graph
                                            else _prepare_body(graph))

  def body_outputs(state):
    outputs = convert(body_graph, state)
    return flat([_repeat(v, size) if s else v.tensor
                 for v, s in zip(outputs, stacked)])

  final = _run_loop(operation, cond_graph, stacked, per_device, flat(init),
                    size, convert, body_outputs, shapes)
  return [t if shape is None else tf.reshape(t, shape)
          for t, shape in zip(final, shapes)]


def _run_loop(operation, cond_graph, stacked, per_device, init, size,
              convert, body_outputs, shapes):
  """The tf.while_loop of `_build_loop` over its (possibly flat) state."""
  invariants = [tf.TensorShape([shape[0], math.prod(shape[1:])])
                if shape is not None else invariant
                for invariant, shape in zip(
                    _shape_invariants(operation, stacked, size, init),
                    shapes)]
  iterations = operation.get_attr("parallel_iterations")
  if not per_device:
    final = tf.while_loop(
        lambda *state: tf.reshape(convert(cond_graph, state)[0].tensor, []),
        lambda *state: body_outputs(state), init,
        shape_invariants=invariants, parallel_iterations=iterations)
    final = list(final) if isinstance(final, (list, tuple)) else [final]
  elif (counting := counted_loops.counting_form(
      cond_graph, tf_internal.function_graph(operation, "body"))) is not None:
    final = _run_counted_loop(counting, stacked, init, size, body_outputs,
                              invariants, iterations)
  else:
    def body(running, *state):
      with lane_guards.reached_where(running):
        outputs = body_outputs(state)
      updated = [_select(running, new, old) if s else new
                 for new, old, s in zip(outputs, state, stacked)]
      still = tf.logical_and(
          running, tf.cast(convert(cond_graph, updated)[0].tensor, tf.bool))
      return [still] + updated

    running = _where_reached(
        tf.cast(convert(cond_graph, init)[0].tensor, tf.bool), False)
    final = tf.while_loop(
        lambda running, *_: tf.reduce_any(running), body, [running] + init,
        shape_invariants=[running.shape] + invariants,
        parallel_iterations=iterations)[1:]
  return final


def _where_reached(value, elsewhere):
  """`value` at the positions that reach the loop, `elsewhere` at the rest.

  A position an enclosing branch or loop does not reach runs none of the
  loop's passes: its values there are dropped, and a bound computed from
  them may be anything.
  """
  reached = lane_guards.reached()
  if reached is None:
    return value
  return tf.where(reached, value, tf.constant(elsewhere, value.dtype))


def _run_counted_loop(counting, stacked, init, size, body_outputs, invariants,
                      iterations):
  """A per-device loop that counts: one reduction for every device's passes.

  Each position runs its own trip count (`counted_loops`); the loop runs
  the most any position needs, which one reduction before it finds,
  instead of one after every pass.
  """
  trips = tf.broadcast_to(
      _where_reached(counted_loops.trip_counts(counting, init), 0), [size])
  passes = tf.reduce_max(trips)

  def body(done, *state):
    running = done < trips
    with lane_guards.reached_where(running):
      outputs = body_outputs(state)
    return [done + 1] + [_select(running, new, old) if s else new
                         for new, old, s in zip(outputs, state, stacked)]

  done = tf.zeros([], trips.dtype)
  return tf.while_loop(
      lambda done, *_: done < passes, body, [done] + init,
      shape_invariants=[done.shape] + invariants,
      parallel_iterations=iterations)[1:]


def _shape_invariants(operation, stacked, size, init):
  """The loop's shape invariants (its `output_shapes`), stacked where needed.

  A TensorArray is carried as a dense tensor of fixed shape (its `init`).
  """
  shapes = [tf.TensorShape(s) for s in operation.get_attr("output_shapes")]
  if not shapes:
    shapes = [tf.TensorShape(None)] * len(stacked)
  invariants = []
  for shape, output, s, start in zip(shapes, operation.outputs, stacked, init):
    shape = shape.merge_with(output.shape) if shape.rank is not None else output.shape
    if output.dtype == tf.variant:
      invariants.append(start.shape)
    elif s:
      invariants.append(tf.TensorShape([size]).concatenate(shape))
    else:
      invariants.append(shape)
  return invariants


CONVERTERS = {}
for _kind in op_types.LOOPS:
  CONVERTERS[_kind] = _convert_while
for _kind in _IF:
  CONVERTERS[_kind] = _convert_if
for _kind in _CASE:
  CONVERTERS[_kind] = _convert_case
for _kind in _CALL:
  CONVERTERS[_kind] = _convert_call
