"""The converter registry: which pfor converter each op of a per-device program takes.

pfor asks an op for its converter (the op's `pfor_converter` attribute,
`tf_internal.set_pfor_converter`) before its own registry. `ROUTES` says,
for each op type tfspmd converts itself, which rewrite converts it, and for
types where only some ops need it, which ones. `give_converters` walks the
ops of a per-device program once, and the ops of the functions its control
flow calls, and gives each op its route:

* an op with a route takes its converter;
* a collective's marker op already carries its converter (`collectives`);
* any other op keeps pfor's converter, and takes the per-position route of
  last resort (`per_position`) where pfor has none or refuses an input that
  differs between devices (docs/ops.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import tensorflow as tf

from tfspmd._src.core import tf_internal
from tfspmd._src.rewrites import broadcast_matmul
from tfspmd._src.rewrites import control_flow
from tfspmd._src.rewrites import conv_gradients
from tfspmd._src.rewrites import dtensor_rewrites
from tfspmd._src.rewrites import dynamic_slices
from tfspmd._src.rewrites import integer_division
from tfspmd._src.rewrites import lane_guards
from tfspmd._src.rewrites import new_axis
from tfspmd._src.rewrites import per_position
from tfspmd._src.rewrites import random_ops
from tfspmd._src.rewrites import rank_limits
from tfspmd._src.rewrites import scatters
from tfspmd._src.rewrites import segment_reductions
from tfspmd._src.rewrites import side_effects
from tfspmd._src.rewrites import static_axes


class Route(NamedTuple):
  """A converter for an op type, for the ops of it that `applies` to."""
  converter: Callable
  applies: Callable[[tf.Operation], bool] | None = None


_DTENSOR_REWRITE_APPLIES = {
    "Einsum": dtensor_rewrites.einsum_applies,
    "IdentityN": dtensor_rewrites.identity_n_applies,
}


def _routes() -> dict[str, tuple[Route, ...]]:
  routes: dict[str, list[Route]] = {}

  def add(op_types, converter, applies=None):
    for op_type in op_types:
      routes.setdefault(op_type, []).append(Route(converter, applies))

  add(["BatchMatMulV2"], broadcast_matmul.convert)
  add(["MatMul"], broadcast_matmul.convert_matmul,
      broadcast_matmul.matmul_applies)
  add(["Conv2DBackpropFilter"], conv_gradients.convert, conv_gradients.applies)
  add(["Slice"], dynamic_slices.convert_slice)
  add(["GatherV2"], dynamic_slices.convert_batched_gather,
      dynamic_slices.batched_gather_applies)
  add(["GatherNd"], dynamic_slices.convert_gather_nd)
  add(["StridedSlice"], dynamic_slices.convert_strided_slice,
      dynamic_slices.strided_slice_applies)
  add(["StridedSlice"], new_axis.convert, new_axis.applies)
  add(["StridedSliceGrad"], new_axis.convert_gradient, new_axis.applies)
  add(random_ops.SEEDED, per_position.convert)
  add(segment_reductions.SEGMENT_TYPES, segment_reductions.convert)
  add(static_axes.REDUCTION_TYPES, static_axes.convert_reduction)
  add(scatters.SCATTER_TYPES, scatters.convert)
  add(sorted(rank_limits.BINARY), rank_limits.convert_binary)
  add(sorted(rank_limits.SAME_SHAPE_GRADIENTS),
      rank_limits.convert_same_shape_gradient)
  for op_type, converter in dtensor_rewrites.CONVERTERS.items():
    add([op_type], converter, _DTENSOR_REWRITE_APPLIES.get(op_type))
  add(side_effects.EFFECT_TYPES, side_effects.convert_effect,
      lambda operation: not side_effects.is_ignored(operation))
  for op_type, converter in control_flow.CONVERTERS.items():
    add([op_type], converter)
  return {op_type: tuple(found) for op_type, found in routes.items()}


ROUTES = _routes()


def route_for(operation: tf.Operation) -> Route | None:
  """The route `operation` takes, or None if it has none of tfspmd's."""
  for route in ROUTES.get(operation.type, ()):
    if route.applies is None or route.applies(operation):
      return route
  return None


def give_converters(operations: Sequence[tf.Operation]) -> None:
  """Gives each of `operations`, and each op of a function they call, its converter."""
  for operation in operations:
    route = route_for(operation)
    if route is None:
      if not hasattr(operation, "pfor_converter"):
        per_position.give_fallback(operation)
      lane_guards.guard(operation)
      integer_division.follow_jax(operation)
      continue
    tf_internal.set_pfor_converter(operation, route.converter)
    lane_guards.guard(operation)
    integer_division.follow_jax(operation)
    if operation.type in control_flow.CONVERTERS:
      for graph in control_flow.called_graphs(operation):
        give_converters(graph.get_operations())
