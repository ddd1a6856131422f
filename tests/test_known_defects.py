"""Known lowering defects (docs/collectives.md, "Known defects") as strict xfails.

Each test asserts the right answer and fails today for the reason it names.
Being strict, it starts failing once the defect is fixed, so the note in the
docs goes away with the defect.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfspmd
from tfspmd import lax


@pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="DTensor (TF 2.21) scrambles an all-to-all relayout between two "
    "inner dimensions when a dimension follows them")
def test_all_to_all_over_an_inner_axis_with_blocks_of_two():
  x = np.arange(2 * 4 * 4 * 2, dtype=np.float32).reshape(2, 4, 4, 2)
  inner = tfspmd.pmap(lambda v: lax.all_to_all(v, "c", 0, 0), axis_name="c")
  out = tfspmd.pmap(inner, axis_name="r")(x)
  # Device (r, c) receives block c of every device (r, j) of its row.
  np.testing.assert_array_equal(np.asarray(out), np.swapaxes(x, 1, 2))


@pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="the DTensor relayout bug behind the test above, without tfspmd")
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


@pytest.mark.xfail(
    strict=True, raises=tf.errors.UnknownError,
    reason="CollectiveAllToAllV2 takes only 16/32/64-bit floats and 32/64-bit "
    "integers")
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.bool_])
def test_all_to_all_of_narrow_dtypes(dtype):
  x = (np.arange(8 * 8 * 3).reshape(8, 8, 3) % 3).astype(dtype)
  out = tfspmd.pmap(lambda v: lax.all_to_all(v, "i", 0, 0), axis_name="i")(x)
  np.testing.assert_array_equal(np.asarray(out), np.swapaxes(x, 0, 1))
