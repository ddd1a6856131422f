"""A program's failure while it runs, as one error that names the op.

When an op's kernel raises on some devices (`tf.debugging.check_numerics` on
a NaN, a `tf.gather` index out of range on CPU), TensorFlow reports one
root error per device, wrapped in DTensor's function names, and the other
devices' programs as cancelled. `failed_run` keeps what the user wrote: the
op's name in the mapped function and the kernel's message.
"""

import re

import numpy as np
import tensorflow as tf

from tfspmd._src.core import tf_internal

# Ops whose kernels cannot fail on inputs of the shapes their program was
# traced with (and those of `_INTEGER_FAILURES` of float dtypes): a program
# of only these runs without waiting for its result.
_CANNOT_FAIL = frozenset("""
Abs Acos Acosh Add AddN AddV2 All Any ArgMax ArgMin Asin Asinh Atan Atan2
Atanh AvgPool AvgPoolGrad BatchMatMulV2 BatchMatMulV3 BiasAdd BiasAddGrad
BroadcastArgs BroadcastGradientArgs BroadcastTo Cast Ceil ClipByValue
Complex ComplexAbs Concat ConcatV2 Conj Const Conv2D Conv2DBackpropFilter
Conv2DBackpropInput Cos Cosh Cumprod Cumsum DepthwiseConv2dNative
DepthwiseConv2dNativeBackpropFilter DepthwiseConv2dNativeBackpropInput
DivNoNan Einsum Elu EluGrad Equal Erf Erfc Exp ExpandDims Expm1 Fill
Floor Greater GreaterEqual Identity IdentityN Imag
IsFinite IsInf IsNan L2Loss LeakyRelu LeakyReluGrad Less LessEqual Lgamma
Log Log1p LogSoftmax LogicalAnd LogicalNot LogicalOr MatMul Max MaxPool
MaxPoolGrad Maximum Mean Min Minimum Mul MulNoNan Neg NoOp NotEqual
OneHot OnesLike Pack Pad PadV2 Placeholder Prod Range Rank
ReadVariableOp Real RealDiv Reciprocal ReciprocalGrad Relayout Relu Relu6
Relu6Grad ReluGrad Reshape Rint Round Rsqrt RsqrtGrad Select SelectV2
Selu SeluGrad Shape ShapeN Sigmoid SigmoidGrad Sign Sin Sinh Size Slice
Softmax SoftmaxCrossEntropyWithLogits Softplus SoftplusGrad Softsign
SoftsignGrad Split SplitV Sqrt SqrtGrad Square SquaredDifference Squeeze
StatefulPartitionedCall StatelessIf StatelessWhile StopGradient
StridedSlice StridedSliceGrad Sub Sum Tan Tanh TanhGrad Tile TopKV2
Transpose Unpack While If PartitionedCall Xdivy Xlog1py Xlogy ZerosLike
_Arg _Retval
""".split())
_GATHERS = ("GatherV2", "GatherNd", "ResourceGather")
# Ops whose integer kernels fail on some values of one input (a division by
# zero, an integer to a negative power), where their float kernels give
# inf or NaN: op type -> (that input, whether a value of it fails).
_INTEGER_FAILURES = {
    "Div": (1, lambda value: value == 0),
    "FloorDiv": (1, lambda value: value == 0),
    "FloorMod": (1, lambda value: value == 0),
    "Mod": (1, lambda value: value == 0),
    "Pow": (1, lambda value: value < 0),
    "TruncateDiv": (1, lambda value: value == 0),
    "TruncateMod": (1, lambda value: value == 0),
}


def may_fail(graph_def):
  """Whether the program of `graph_def` may fail while it runs.

  A kernel that raises (`tf.debugging.check_numerics` of a NaN, a gather
  index out of range on CPU, an integer division by zero) leaves DTensor's
  device unable to run anything more, and the next program on it crashes
  the process (TF 2.21). So a program with an op not known to be safe is
  waited on at its call, where its failure is caught and the device
  replaced. A gather at constant positions (ppermute's) is safe, and so is
  an integer division by a constant with no zero (`x // 2`) or a power
  with a constant exponent of no negative value (`x ** 2`).
  """
  for nodes in [graph_def.node] + [f.node_def for f in graph_def.library.function]:
    by_name = {node.name: node for node in nodes}
    for node in nodes:
      if not _safe(node, by_name):
        return True
  return False


def _safe(node, by_name):
  """Whether the kernel of `node` cannot fail (its inputs by `by_name`)."""
  if node.op in _INTEGER_FAILURES and "T" in node.attr:
    if not tf.dtypes.as_dtype(node.attr["T"].type).is_integer:
      return True
    index, fails = _INTEGER_FAILURES[node.op]
    value = _constant(node, index, by_name)
    return value is not None and not fails(value).any()
  if node.op in _CANNOT_FAIL:
    return True
  return node.op in _GATHERS and _constant(node, 1, by_name) is not None


def _constant(node, index, by_name):
  """The value of input `index` of `node` if a constant gives it, else None."""
  if len(node.input) <= index:
    return None
  source = by_name.get(node.input[index].split(":")[0])
  if source is None or source.op != "Const":
    return None
  return tf.make_ndarray(source.attr["value"].tensor)


_ROOT = re.compile(r"^\s*\(\d+\) ([A-Z_]+): ", re.MULTILINE)
_FUNCTION = re.compile(r"\{\{function_node [^}]*\}\}\s*")
_NODE = re.compile(r"\[\[\{\{node ([^}]*)\}\}\]\]")
# DTensor's call of a device's part of the program: `<call>_<id>_<device>`,
# the device by its index among the mesh's local devices.
_DEVICE_CALL = re.compile(r"StatefulPartitionedCall_\d+_(\d+)/")
_CALLED_AT = re.compile(r"^\s*\[\[([^\]{]*)\]\]", re.MULTILINE)
_TAIL = re.compile(
    r"\s*(\n\s*Encountered when executing|\[Op:|\n\d+ successful operations)")


def failed_run(error, axis_name, mesh=None):
  """The error to raise for `error`, a failure of a program while it ran.

  Args:
    error: The `tf.errors.OpError` the call raised.
    axis_name: The pmap's axis name, for the message.
    mesh: The DTensor mesh the program ran on, to name the device that
      failed; None where the host executor ran it whole.

  Returns:
    An exception of the `tf.errors` class of the first device's failure
    (`InvalidArgumentError` for a failed check), whose message names the
    op, the device (its position on the mesh) and the kernel's message.
  """
  code, where, text = _failure(error, mesh)
  return tf_internal.error_class(code)(None, None, (
      f"The function mapped over axis {axis_name!r} failed while it "
      f"ran{where}: {text}. Later calls run as usual, and arrays computed "
      f"before stay valid."))


def failed_program(error):
  """`failed_run` for a failure found where a result is read, not at the call.

  A program whose ops cannot fail on their shapes is not waited for at its
  call; should it fail anyway, the failure comes with its results.
  """
  code, where, text = _failure(error)
  return tf_internal.error_class(code)(None, None, (
      f"A mapped function's program failed while it ran{where}: {text}. "
      f"Its results cannot be read."))


def _failure(error, mesh=None):
  """`(error code, ' in the op ... on device ...' or '', the kernel's message)`."""
  code, message = _first_failure(error)
  node = _NODE.search(message)
  text = _TAIL.split(message.split("\n\t [[")[0].split("\n [[")[0])[0]
  text = _FUNCTION.sub("", text).strip()
  where = f" in the op {_user_name(node.group(1))!r}" if node else ""
  position = _device_position(message, node, mesh)
  if position is not None:
    where += f" on device {position}"
  return code, where, text


def _device_position(message, node, mesh):
  """The mesh position of the device whose failure `message` is, or None.

  DTensor names each device's call of the program after the device's
  index among the mesh's local devices: the failed op's node lies in it,
  or, for an op inside a loop or a branch, the call of the loop or branch
  is given after the node (the transfers between devices, `Func/...`,
  may be another device's).
  """
  if mesh is None or node is None:
    return None
  found = _DEVICE_CALL.search(node.group(1))
  if found is None:
    for called in _CALLED_AT.finditer(message, node.end()):
      if not called.group(1).startswith("Func/"):
        found = _DEVICE_CALL.search(called.group(1))
        break
  ids = mesh.local_device_ids()
  if found is None or int(found.group(1)) >= len(ids):
    return None
  position = np.unravel_index(ids[int(found.group(1))], mesh.shape())
  return (str(int(position[0])) if len(position) == 1 else
          str(tuple(int(k) for k in position)))


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
