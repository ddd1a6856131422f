"""tf.Variables and the mapped function: reads are broadcast, writes refused.

The expected values are NumPy arithmetic on the same numbers.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd


def test_every_device_reads_the_variable_and_sees_later_assignments():
  scale = tf.Variable([1., 2.])
  f = tfspmd.pmap(lambda x: x * scale)
  x = np.arange(8, dtype=np.float32).reshape(4, 2)
  np.testing.assert_array_equal(f(x), x * [1., 2.])
  scale.assign([3., 4.])
  np.testing.assert_array_equal(f(x), x * [3., 4.])


def test_assigning_a_variable_inside_says_to_pass_the_state():
  total = tf.Variable([0., 0.])
  with pytest.raises(ValueError, match=r"writes to a tf.Variable \(AssignAddVariableOp\).*"
                     r"Pass the state as an argument and return its new value"):
    tfspmd.pmap(lambda x: total.assign_add(x))(np.ones((4, 2), np.float32))
  np.testing.assert_array_equal(total.numpy(), [0., 0.])


def test_state_passed_as_an_argument_and_returned():
  total = tf.Variable(np.zeros((4, 2), np.float32))
  x = np.arange(8, dtype=np.float32).reshape(4, 2)
  step = tfspmd.pmap(lambda state, v: state + v)
  for _ in range(3):
    total.assign(step(total, x))
  np.testing.assert_array_equal(total.numpy(), 3 * x)


def test_an_op_pfor_cannot_vectorize_is_named():
  with pytest.raises(ValueError, match="uses the op Unique, which TensorFlow's "
                     "vectorizer \\(pfor\\) cannot map over an axis"):
    tfspmd.pmap(lambda v: tf.unique(v)[0][:1])(np.zeros((4, 3), np.float32))
