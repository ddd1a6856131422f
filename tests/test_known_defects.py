"""DTensor defects tfspmd works around (docs/collectives.md), as strict xfails.

Each test asserts the right answer of plain DTensor and fails today for the
reason it names. Being strict, it starts failing once TensorFlow fixes the
defect, so the workaround and its note can go.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfspmd  # noqa: F401  (makes the 8 logical CPU devices)


@pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="DTensor (TF 2.21) scrambles an all-to-all relayout between two "
    "inner dimensions when a dimension follows them")
def test_dtensor_relayout_between_inner_dimensions():
  mesh = dtensor.create_mesh([("r", 2), ("c", 4)],
                             devices=[f"CPU:{i}" for i in range(8)])
  unsharded = dtensor.UNSHARDED
  x = np.arange(2 * 4 * 4 * 2, dtype=np.float32).reshape(2, 4, 4, 2)
  replicated = dtensor.Layout.replicated(mesh, 4)
  source = dtensor.relayout(dtensor.copy_to_mesh(x, replicated),
                            dtensor.Layout(["r", unsharded, "c", unsharded], mesh))
  moved = tf.function(lambda v: dtensor.relayout(
      v, dtensor.Layout(["r", "c", unsharded, unsharded], mesh)))(source)
  back = dtensor.unpack(dtensor.relayout(moved, replicated))[0]
  np.testing.assert_array_equal(back.numpy(), x)
