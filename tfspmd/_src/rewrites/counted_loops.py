"""Trip counts of per-device loops that count, known before they start.

A loop whose trip count differs between devices runs until every device is
done (`control_flow`); asking "is any device still running?" after every
pass is a reduction over the devices, a collective under DTensor, which a
pass of a small body costs many times over (a `lax.fori_loop` with
per-device bounds, as the Lorenz colab draws its lines). Where the loop
counts (its condition compares an int32 or int64 variable that each pass
steps by a constant with a bound no pass changes, the form a
`lax.fori_loop` with traced bounds takes), each device's trip count is
arithmetic on the starting values, and one reduction before the loop gives
the passes all must run.
"""

from typing import NamedTuple

import tensorflow as tf

_COMPARISONS = {"Less": "<", "LessEqual": "<=", "Greater": ">",
                "GreaterEqual": ">="}
_MIRRORED = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _through_identities(tensor):
  while tensor.op.type == "Identity":
    tensor = tensor.op.inputs[0]
  return tensor


def _constant(tensor):
  tensor = _through_identities(tensor)
  if tensor.op.type != "Const":
    return None
  value = tf.get_static_value(tensor)
  return None if value is None or value.shape else value.item()


def _step(body_graph, index):
  """The constant loop variable `index` steps by in each pass, or None."""
  output = _through_identities(body_graph.outputs[index])
  if output.op.type not in ("AddV2", "Add", "Sub"):
    return None
  left, right = output.op.inputs
  if (output.op.type != "Sub" and
      _through_identities(right) is body_graph.inputs[index]):
    left, right = right, left
  if _through_identities(left) is not body_graph.inputs[index]:
    return None
  step = _constant(right)
  if step is None:
    return None
  return -step if output.op.type == "Sub" else step


def _unchanged(body_graph, index):
  return _through_identities(body_graph.outputs[index]) is (
      body_graph.inputs[index])


class CountingForm(NamedTuple):
  """How a loop counts: `counter comparison bound`, stepping by `step`.

  Attributes:
    counter: The position of the loop variable that counts.
    comparison: `<`, `<=`, `>` or `>=`, the counter on its left.
    bound_at: The position of the loop variable it is compared with, or
      None for a constant.
    bound: The constant it is compared with, where `bound_at` is None.
    step: What each pass adds to the counter.
  """
  counter: int
  comparison: str
  bound_at: int | None
  bound: int | None
  step: int


def counting_form(cond_graph, body_graph):
  """The loop's `CountingForm` if it counts, else None."""
  predicate = _through_identities(cond_graph.outputs[0])
  comparison = _COMPARISONS.get(predicate.op.type)
  if comparison is None or not predicate.dtype == tf.bool:
    return None
  operands = [_through_identities(t) for t in predicate.op.inputs]
  # Narrower or unsigned counters wrap where the loop's own arithmetic
  # would not be asked to: left to the loop.
  if operands[0].dtype not in (tf.int32, tf.int64):
    return None
  positions = [next((k for k, t in enumerate(cond_graph.inputs) if t is o),
                    None) for o in operands]
  for side in (0, 1):
    counter = positions[side]
    if counter is None:
      continue
    step = _step(body_graph, counter)
    other = 1 - side
    bound_at, bound = positions[other], None
    if bound_at is None:
      bound = _constant(operands[other])
      if bound is None:
        continue
    elif not _unchanged(body_graph, bound_at) or bound_at == counter:
      continue
    if not step:
      continue
    form = comparison if side == 0 else _MIRRORED[comparison]
    # A counter stepping away from its bound never stops: left to the loop.
    if (step > 0) != (form in ("<", "<=")):
      continue
    return CountingForm(counter, form, bound_at, bound, step)
  return None


def trip_counts(form, init):
  """Each position's passes of a loop that counts as `form` says.

  Args:
    form: The loop's `CountingForm`.
    init: The loop variables' starting values.

  Returns:
    An int64 tensor: each position's trip count (a scalar for all).
  """
  start = tf.cast(init[form.counter], tf.int64)
  limit = (tf.constant(form.bound, tf.int64) if form.bound_at is None
           else tf.cast(init[form.bound_at], tf.int64))
  distance = limit - start if form.step > 0 else start - limit
  stride = abs(form.step)
  if form.comparison in ("<", ">"):
    passes = tf.math.floordiv(tf.maximum(distance, 0) + stride - 1, stride)
  else:
    passes = tf.where(distance < 0, tf.zeros_like(distance),
                      tf.math.floordiv(distance, stride) + 1)
  return passes
