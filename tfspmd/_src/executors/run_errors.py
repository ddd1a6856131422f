"""A program's failure while it runs, as one error that names the op.

When an op's kernel raises on some devices (`tf.debugging.check_numerics` on
a NaN, a `tf.gather` index out of range on CPU), TensorFlow reports one
root error per device, wrapped in DTensor's function names, and the other
devices' programs as cancelled. `failed_run` keeps what the user wrote: the
op's name in the mapped function and the kernel's message.
"""

import re

from tfspmd._src.core import tf_internal

# Ops whose kernels cannot fail on inputs of the shapes their program was
# traced with: a program of only these runs without waiting for its result.
_CANNOT_FAIL = frozenset("""
Abs Acos Acosh Add AddN AddV2 All Any ArgMax ArgMin Asin Asinh Atan Atan2
Atanh AvgPool AvgPoolGrad BatchMatMulV2 BatchMatMulV3 BiasAdd BiasAddGrad
BroadcastArgs BroadcastGradientArgs BroadcastTo Cast Ceil ClipByValue
Complex ComplexAbs Concat ConcatV2 Conj Const Conv2D Conv2DBackpropFilter
Conv2DBackpropInput Cos Cosh Cumprod Cumsum DepthwiseConv2dNative
DepthwiseConv2dNativeBackpropFilter DepthwiseConv2dNativeBackpropInput
Div DivNoNan Einsum Elu EluGrad Equal Erf Erfc Exp ExpandDims Expm1 Fill
Floor FloorDiv FloorMod Greater GreaterEqual Identity IdentityN Imag
IsFinite IsInf IsNan L2Loss LeakyRelu LeakyReluGrad Less LessEqual Lgamma
Log Log1p LogSoftmax LogicalAnd LogicalNot LogicalOr MatMul Max MaxPool
MaxPoolGrad Maximum Mean Min Minimum Mod Mul MulNoNan Neg NoOp NotEqual
OneHot OnesLike Pack Pad PadV2 Placeholder Pow Prod Range Rank
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


def may_fail(graph_def):
  """Whether the program of `graph_def` may fail while it runs.

  A kernel that raises (`tf.debugging.check_numerics` of a NaN, a gather
  index out of range on CPU) leaves DTensor's device unable to run anything
  more, and the next program on it crashes the process (TF 2.21). So a
  program with an op not known to be safe is waited on at its call, where
  its failure is caught and the device replaced. A gather at constant
  positions (ppermute's) is safe.
  """
  for nodes in [graph_def.node] + [f.node_def for f in graph_def.library.function]:
    by_name = {node.name: node for node in nodes}
    for node in nodes:
      if node.op in _CANNOT_FAIL:
        continue
      if node.op in _GATHERS and len(node.input) > 1:
        indices = by_name.get(node.input[1].split(":")[0])
        if indices is not None and indices.op == "Const":
          continue
      return True
  return False


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
  code, where, text = _failure(error)
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


def _failure(error):
  """`(error code, ' in the op ...' or '', the kernel's message)` of `error`."""
  code, message = _first_failure(error)
  node = _NODE.search(message)
  text = _TAIL.split(message.split("\n\t [[")[0].split("\n [[")[0])[0]
  text = _FUNCTION.sub("", text).strip()
  where = f" in the op {_user_name(node.group(1))!r}" if node else ""
  return code, where, text


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
