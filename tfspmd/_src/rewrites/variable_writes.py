"""A mapped function may read tf.Variables but not write them.

Every device would assign its own value to the one variable. The compiled
path finds a write when pfor cannot vectorize the op; debug mode, whose
devices run eagerly, finds it before the op runs. Both raise `write_error`.
"""

import contextlib

from tfspmd._src.core import op_types
from tfspmd._src.core import tf_internal


def write_error(op_type, axis_name):
  return ValueError(
      f"the function mapped over axis {axis_name!r} writes to a tf.Variable "
      f"({op_type}); a mapped function cannot assign per-device values to "
      f"one variable. Pass the state as an argument and return its new "
      f"value, JAX-style (`state = f(state, x)`; `variable.assign(state)` "
      f"outside the pmap if you keep it in a variable). Reading variables "
      f"inside is fine: every device sees the same value.")


@contextlib.contextmanager
def refused(axis_name):
  """Raises `write_error` at any variable write this thread runs or traces.

  A variable created here (a Keras layer building its weights on its first
  call) may be given its initial value. A write through TensorFlow's Python API
  (`assign`, `scatter_*`, an optimizer's apply, `tf.raw_ops`) is refused
  before it runs, so the variable keeps its value; an op callback catches
  any other, which TensorFlow reports after the op ran.
  """
  created = set()

  def check_write(op_type, resource):
    if id(resource) not in created:
      raise write_error(op_type, axis_name)

  def check(op_type, inputs, attrs, outputs, *_, **__):
    del attrs  # unused
    if isinstance(op_type, bytes):  # as eager ops report it
      op_type = op_type.decode()
    if op_type == "VarHandleOp":
      created.update(id(handle) for handle in outputs)
    elif op_types.writes_variable(op_type):
      check_write(op_type, inputs[0])

  with tf_internal.op_callback(check), \
       tf_internal.before_variable_writes(check_write):
    yield
