"""pfor converters for matmuls: batch axes that broadcast, a stacked operand.

TensorFlow's oneDNN kernel of `BatchMatMulV2` on CPU (TF 2.21, on unless
`TF_ENABLE_ONEDNN_OPTS=0`) writes outside its buffers when a left operand
of rank 4 or more has a batch axis of size 1 after a larger one and the
right operand is broadcast over them: `[4, 1, 8, 2] @ [1, 2, 16]` gives
wrong values or aborts the process ("free(): invalid size",
"malloc(): unaligned tcache chunk detected"; tensorflow/tensorflow#117700).

pfor's converter writes such a matmul whenever a value stacked over the
mapped axis is multiplied by one that is not: nested maps add a batch axis
per level, and DTensor's per-device shapes decide the sizes. In JAX's
FSDP + tensor-parallel example on a (4, 2) mesh, DTensor splits the
contraction over the 'batch' devices, so each device multiplies
`[4, 1, 8, 2]` by the `[1, 2, 16]` block of the weights it keeps. Here a
batched matmul whose batch axes broadcast becomes an einsum with every
axis named: TensorFlow's einsum folds the axes only one operand has into
the rows or columns of a matmul of rank 3, which that kernel gets right.
"""

import string

import tensorflow as tf

from tfspmd._src.core import tf_internal
from tfspmd._src.runtime import axis_env

_do_not_convert = tf.autograph.experimental.do_not_convert


@_do_not_convert
def convert(op_inputs):
  """The converter of BatchMatMulV2 (`converters`)."""
  left, right = op_inputs.broadcast_inputs()
  adjoint = (op_inputs.get_attr("adj_x"), op_inputs.get_attr("adj_y"))
  return [tf_internal.wrap_converted(matmul(left, right, *adjoint), True)]


def matmul_applies(operation):
  """Whether `convert_matmul` takes this MatMul (floating or complex)."""
  dtype = operation.outputs[0].dtype
  return dtype.is_floating or dtype.is_complex


@_do_not_convert
def convert_matmul(op_inputs):
  """The converter of a MatMul with an operand stacked over the mapped axis.

  pfor's own folds the mapped axis into the rows of the other operand's matmul
  (`[n, rows, k] -> [n * rows, k]`). On a mesh of several dimensions that
  merges one mesh axis into the rows, which DTensor then lays out split over the
  outer mesh axis only; the gradient of a bias over a batch split over two
  axes (`P(('data', 'model'))`) then reduces a value DTensor cannot
  expand. An einsum names the mapped axis instead, so every level keeps
  its own dimension.
  """
  state = axis_env.trace_state()
  if state is None or len(state.mesh_axes) < 2:
    # One mesh dimension: pfor's merge keeps the rows split over it, as
    # DTensor's reshape can.
    return tf_internal.default_pfor_converter("MatMul")(op_inputs)
  (left, left_stacked), (right, right_stacked) = op_inputs.inputs()
  left_term = ("n" if left_stacked else "") + (
      "ji" if op_inputs.get_attr("transpose_a") else "ij")
  right_term = ("n" if right_stacked else "") + (
      "kj" if op_inputs.get_attr("transpose_b") else "jk")
  product = tf.einsum(f"{left_term},{right_term}->nik", left, right)
  return [tf_internal.wrap_converted(product, True)]


def matmul(left, right, adjoint_left=False, adjoint_right=False):
  """`tf.matmul`, as an einsum where the batch axes broadcast.

  Args:
    left: A tensor of rank >= 2.
    right: A tensor of rank >= 2 with the same dtype.
    adjoint_left: Multiply by the adjoint of `left`'s matrices.
    adjoint_right: Multiply by the adjoint of `right`'s matrices.

  Returns:
    The product, with NumPy's broadcasting of the batch axes.

  Example:
    >>> left, right = tf.ones([4, 1, 8, 2]), tf.ones([1, 2, 16])
    >>> matmul(left, right).shape
    TensorShape([4, 1, 8, 16])
  """
  shapes = (left.shape[:-2], right.shape[:-2])
  if (not (left.dtype.is_floating or left.dtype.is_complex) or
      shapes[0] == shapes[1] or
      not all(s.is_fully_defined() for s in shapes)):
    return tf.matmul(left, right, adjoint_a=adjoint_left,
                     adjoint_b=adjoint_right)
  batch = tf.broadcast_static_shape(*shapes).as_list()
  letters = string.ascii_letters[:len(batch)]
  rows, inner, columns = string.ascii_letters[len(batch):len(batch) + 3]
  left, left_term = _named(left, batch, letters, adjoint_left, rows + inner)
  right, right_term = _named(right, batch, letters, adjoint_right,
                             inner + columns)
  return tf.einsum(f"{left_term},{right_term}->{letters}{rows}{columns}",
                   left, right)


def _named(value, batch, letters, adjoint, matrix):
  """`value` without its broadcast axes, and the einsum term naming it.

  A batch axis of size 1 where the result's is larger is squeezed out (the
  einsum broadcasts what an operand does not name).
  """
  own = value.shape[:-2].as_list()
  offset = len(batch) - len(own)
  broadcast = [k for k, size in enumerate(own)
               if size == 1 and batch[offset + k] != 1]
  if broadcast:
    value = tf.squeeze(value, broadcast)
  term = "".join(letters[offset + k] for k in range(len(own))
                 if k not in broadcast)
  if adjoint:
    matrix = matrix[::-1]
    if value.dtype.is_complex:
      value = tf.math.conj(value)
  return value, term + matrix
