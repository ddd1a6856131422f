"""A program's failure while it runs, as one error that names the op.

When an op's kernel raises on some devices (`tf.debugging.check_numerics` on
a NaN, a `tf.gather` index out of range on CPU), TensorFlow reports one
root error per device, wrapped in DTensor's function names, and the other
devices' programs as cancelled. `failed_run` keeps what the user wrote: the
op's name in the mapped function and the kernel's message.
"""

import re

from tfspmd._src import tf_internal

_ROOT = re.compile(r"^\s*\(\d+\) ([A-Z_]+): ", re.MULTILINE)
_FUNCTION = re.compile(r"\{\{function_node [^}]*\}\}\s*")
_NODE = re.compile(r"\[\[\{\{node ([^}]*)\}\}\]\]")
_TAIL = re.compile(
    r"\s*(\n\s*Encountered when executing|\[Op:|\n\d+ successful operations)")


def failed_run(error, axis_name):
  """The error to raise for `error`, a failure of a program while it ran.

  Args:
    error: The `tf.errors.OpError` the call raised.
    axis_name: The pmap's axis name, for the message.

  Returns:
    An exception of the `tf.errors` class of the first device's failure
    (`InvalidArgumentError` for a failed check), whose message names the
    op and gives the kernel's message.
  """
  code, message = _first_failure(error)
  node = _NODE.search(message)
  text = _TAIL.split(message.split("\n\t [[")[0].split("\n [[")[0])[0]
  text = _FUNCTION.sub("", text).strip()
  where = f" in the op {_user_name(node.group(1))!r}" if node else ""
  return tf_internal.error_class(code)(None, None, (
      f"The function mapped over axis {axis_name!r} failed while it "
      f"ran{where}: {text}. Later calls run as usual, and arrays computed "
      f"before stay valid."))


def _first_failure(error):
  """(code, message) of the first device's failure that is not a cancellation."""
  message = error.message
  roots = list(_ROOT.finditer(message))
  for k, root in enumerate(roots):
    name = root.group(1)
    if name == "CANCELLED":
      continue
    end = roots[k + 1].start() if k + 1 < len(roots) else len(message)
    return tf_internal.error_code(name), message[root.end():end]
  return error.error_code, message


def _user_name(node):
  """The op's name in the mapped function, from the name of its node.

  DTensor nests the program in calls (`tf.StatefulPartitionedCall...`), and
  pfor names the op's vectorized form `<name>/pfor/...`.
  """
  parts = [part for part in node.split("/")
           if not part.startswith(("tf.StatefulPartitionedCall",
                                   "StatefulPartitionedCall"))]
  if "pfor" in parts:
    parts = parts[:parts.index("pfor")]
  return "/".join(parts) or node
