"""TensorFlow op types that more than one layer of tfspmd looks for.

Example:
  >>> "StatelessWhile" in LOOPS
  True
  >>> writes_variable("ResourceSparseApplyAdagradV2")
  True
"""

# The loop ops: `tf.while_loop`, `tf.scan`, `tf.range` loops in a graph.
LOOPS = ("While", "StatelessWhile")


def writes_variable(op_type: str) -> bool:
  """Whether the op `op_type` writes to a variable.

  The assignments, the resource scatters and the optimizers' dense and
  sparse apply ops.
  """
  return "Assign" in op_type or op_type.startswith(
      ("ResourceScatter", "ResourceApply", "ResourceSparseApply"))
