"""TPU meshes, on a Cloud TPU VM (marked `tpu`: skipped without a TPU).

Run alone (`pytest -m tpu tests/test_tpu.py`): the first device query
brings up the TPU system, which must happen before any TensorFlow op.
"""

import functools

import numpy as np
import pytest

import tfspmd
from tfspmd import lax

pytestmark = pytest.mark.tpu


def test_tpus_are_the_default_platform():
  devices = tfspmd.devices()
  assert devices == tfspmd.devices("tpu")
  assert [d.platform for d in devices] == ["tpu"] * len(devices)
  assert all("/device:TPU:" in d.name for d in devices)


def test_psum_over_the_tpus():
  count = tfspmd.device_count()
  x = np.arange(count, dtype=np.float32)
  out = tfspmd.pmap(lambda v: v + lax.psum(v, "i"), "i", backend="tpu")(x)
  np.testing.assert_allclose(np.asarray(out), x + x.sum())
  assert all("TPU" in s.data.device for s in out.addressable_shards)


def test_nested_normalize_over_the_tpus():
  count = tfspmd.device_count()
  if count % 2:
    pytest.skip(f"needs an even number of TPU devices, this host has {count}")

  @functools.partial(tfspmd.pmap, axis_name="rows")
  @functools.partial(tfspmd.pmap, axis_name="cols")
  def normalize(x):
    return x / lax.psum(x, "rows"), x / lax.psum(x, ("rows", "cols"))

  x = np.arange(count, dtype=np.float32).reshape((count // 2, 2)) + 1
  rows, both = normalize(x)
  np.testing.assert_allclose(np.asarray(rows), x / x.sum(0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(both), x / x.sum(), rtol=1e-6)
