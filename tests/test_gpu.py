"""GPU meshes, on a machine with GPUs (marked `gpu`: skipped without one)."""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

pytestmark = pytest.mark.gpu


def test_gpus_are_the_default_platform_one_device_each():
  gpus = tf.config.list_physical_devices("GPU")
  assert tfspmd.devices() == tfspmd.devices("gpu")
  assert [d.platform for d in tfspmd.local_devices()] == ["gpu"] * len(gpus)


def test_psum_over_the_gpus():
  count = tfspmd.device_count("gpu")
  x = np.arange(count, dtype=np.float32)
  out = tfspmd.pmap(lambda v: v + lax.psum(v, "i"), "i", backend="gpu")(x)
  np.testing.assert_allclose(np.asarray(out), x + x.sum())
  assert [s.device.platform for s in out.addressable_shards] == ["gpu"] * count
  assert all("GPU" in s.data.device for s in out.addressable_shards)
