"""Ops DTensor has no SPMD expander for, computed whole on every device.

DTensor (TF 2.21) expands an op into each device's part only through an
expander written for its type, and fails on the first run of a program with
any other ("'tf.MatrixInverse' op does not implement layout propagation").
For those it has one more route, which it takes for the op types named in
`DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.<OP TYPE>`: the op's inputs
are gathered onto every device, each device computes the whole op (pfor's
vectorized op, for every position of the mapped axis) and keeps the part
its layout asks for. Right for any op with a kernel; the cost is `n` times
the op's work and the gathering of its inputs. DTensor reads the variable
when it first meets the op type without an expander and keeps its choice
for the process, so tfspmd names every op type of a program before the
program first runs. An op type that has an expander never reads it.
"""

from tfspmd._src.core import route_log
from tfspmd._src.executors import dtensor_settings

_PREFIX = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF."

# The op types DTensor has an SPMD expander for (tensorflow/dtensor/mlir/
# spmd_expanders.cc, TF 2.21); every other op type takes the replicated route.
EXPANDED = frozenset("""
Abs Acos Acosh Add AddN AddV2 All Angle Any ArgMax Asin Asinh Assert
AssignAddVariableOp AssignSubVariableOp AssignVariableOp Atan Atan2 Atanh
AvgPool AvgPool3D BatchMatMulV2 BesselI0e BesselI1e Betainc BiasAdd
BiasAddGrad Bitcast BitwiseAnd BitwiseOr BitwiseXor BroadcastGradientArgs
BroadcastTo Cast Ceil CheckNumerics Cholesky ClipByValue Complex ComplexAbs
Concat ConcatV2 Conj Const Conv2D Conv2DBackpropFilter Conv2DBackpropInput
Conv3D Conv3DBackpropFilterV2 Conv3DBackpropInputV2 Cos Cosh Cumsum
DepthwiseConv2dNative DestroyResourceOp DiagPart Digamma Div DivNoNan Elu
EluGrad Einsum Equal Erf Erfc Erfinv Exp ExpandDims Expm1 FFT FFT2D FFT3D
Fill Floor FloorDiv FloorMod GatherNd GatherV2 Greater GreaterEqual IFFT
IFFT2D IFFT3D IRFFT IRFFT2D IRFFT3D Identity IdentityN Igamma IgammaGradA
Igammac Imag InTopKV2 Inv Invert InvertPermutation IsFinite IsInf IsNan
L2Loss LeakyRelu LeakyReluGrad LeftShift Less LessEqual Lgamma Log Log1p
LogSoftmax LogicalAnd LogicalNot LogicalOr MatMul Max MaxPool MaxPool3D
MaxPool3DGrad MaxPool3DGradGrad MaxPoolGrad MaxPoolGradGrad Maximum Mean
Min Minimum Mul MulNoNan Ndtri Neg NextAfter NotEqual OneHot Pack Pad PadV2
Polygamma PopulationCount Pow PreventGradient Prod Qr RFFT RFFT2D RFFT3D
Range Rank ReadVariableOp Real RealDiv Reciprocal ReciprocalGrad Relayout
Relu Relu6 Relu6Grad ReluGrad Reshape ResizeBilinear ResizeBilinearGrad
ResizeNearestNeighbor ResizeNearestNeighborGrad RightShift Rint Round Rsqrt
RsqrtGrad Select SelectV2 Selu SeluGrad Shape ShapeN Sigmoid SigmoidGrad
Sign Sin Sinh Slice Softmax SoftmaxCrossEntropyWithLogits Softplus Softsign
SparseSoftmaxCrossEntropyWithLogits SparseToDense Split SplitV Sqrt
SqrtGrad Square SquaredDifference Squeeze StatelessRandomGetKeyCounter
StatelessRandomNormal StatelessRandomNormalV2 StatelessRandomUniform
StatelessRandomUniformFullInt StatelessRandomUniformFullIntV2
StatelessRandomUniformIntV2 StatelessRandomUniformV2
StatelessTruncatedNormal StatelessTruncatedNormalV2 StopGradient
StridedSlice StridedSliceGrad Sub Sum Tan Tanh TanhGrad
TensorScatterAdd TensorScatterUpdate TensorStridedSliceUpdate Tile TopKV2
Transpose TruncateDiv TruncateMod Unpack UnsortedSegmentSum VarHandleOp
VarIsInitializedOp Xdivy Xlog1py Xlogy Zeta ZerosLike
""".split())

# Ops DTensor turns into other constructs (regions, calls, layouts) before
# it looks for expanders, or leaves as they are: never enrolled.
_STRUCTURAL = frozenset("""
Case CopyToMesh CopyToMeshGrad If NoOp PartitionedCall
Placeholder Relayout RelayoutLike StatefulPartitionedCall StatelessCase
StatelessIf StatelessWhile While _Arg _Retval
""".split())

_enrolled = set()


def enroll(op_types):
  """Sends the op types of `op_types` DTensor cannot expand the replicated way.

  Args:
    op_types: The op types of a program (of its functions too), before its
      first run.

  Returns:
    The op types of `op_types` that take the replicated route, sorted.
  """
  replicated = sorted(set(op_types) - EXPANDED - _STRUCTURAL)
  with dtensor_settings.lock:
    for op_type in replicated:
      route_log.record(route_log.REPLICATED, op_type)
      if op_type not in _enrolled:
        dtensor_settings.set_for_process(_PREFIX + op_type.upper())
        _enrolled.add(op_type)
  return replicated
