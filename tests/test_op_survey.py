"""Which ops of tf.math, tf.linalg, tf.nn, tf.image and tf.signal run inside pmap.

Each op runs on 8 devices on per-device data, and its result is compared
with the same op run eagerly on each device's slice. An op that cannot run
must raise tfspmd's error (ValueError or TypeError naming the op), never a
TensorFlow internal. docs/ops.md is the table of the outcomes; a test keeps
it equal to what the code does (`TFSPMD_WRITE_OPS_DOC=1` rewrites it).
"""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tfspmd

N = 8
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PATH = os.path.join(_ROOT, "docs", "ops.md")

RNG = np.random.default_rng(0)
MATRIX = (RNG.standard_normal((N, 4, 4)) + 4 * np.eye(4)).astype(np.float32)
SPD = np.einsum("nij,nkj->nik", MATRIX, MATRIX).astype(np.float32)
VECTOR = RNG.standard_normal((N, 6)).astype(np.float32)
POSITIVE = (np.abs(VECTOR) + 0.5).astype(np.float32)
IMAGES = RNG.uniform(size=(N, 2, 6, 6, 3)).astype(np.float32)
SIGNAL = RNG.standard_normal((N, 32)).astype(np.float32)
LABELS = RNG.integers(0, 6, (N, 3)).astype(np.int32)
LOGITS = RNG.standard_normal((N, 3, 6)).astype(np.float32)
SEGMENTS = np.tile(np.array([0, 0, 1, 1, 2, 2], np.int32), (N, 1))
KERNEL = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
KERNEL_1D = RNG.standard_normal((3, 6, 2)).astype(np.float32)
TABLE = RNG.standard_normal((6, 5)).astype(np.float32)

# name -> (per-device function, per-device inputs (mapped), broadcast inputs)
OPS = {
    "tf.abs": (tf.abs, (VECTOR,)),
    "tf.exp": (tf.exp, (VECTOR,)),
    "tf.math.log": (tf.math.log, (POSITIVE,)),
    "tf.sqrt": (tf.sqrt, (POSITIVE,)),
    "tf.math.rsqrt": (tf.math.rsqrt, (POSITIVE,)),
    "tf.tanh": (tf.tanh, (VECTOR,)),
    "tf.sigmoid": (tf.sigmoid, (VECTOR,)),
    "tf.math.softplus": (tf.math.softplus, (VECTOR,)),
    "tf.math.erf": (tf.math.erf, (VECTOR,)),
    "tf.pow": (lambda v: tf.pow(v, 3.), (POSITIVE,)),
    "tf.maximum": (lambda v: tf.maximum(v, 0.1), (VECTOR,)),
    "tf.floor": (tf.floor, (VECTOR,)),
    "tf.round": (tf.round, (VECTOR,)),
    "tf.sign": (tf.sign, (VECTOR,)),
    "tf.clip_by_value": (lambda v: tf.clip_by_value(v, -0.5, 0.5), (VECTOR,)),
    "tf.math.cumsum": (tf.math.cumsum, (VECTOR,)),
    "tf.math.cumprod": (tf.math.cumprod, (VECTOR,)),
    "tf.math.cumulative_logsumexp": (tf.math.cumulative_logsumexp, (VECTOR,)),
    "tf.reduce_sum": (tf.reduce_sum, (VECTOR,)),
    "tf.reduce_prod": (tf.reduce_prod, (VECTOR,)),
    "tf.reduce_max": (tf.reduce_max, (VECTOR,)),
    "tf.reduce_logsumexp": (tf.reduce_logsumexp, (VECTOR,)),
    "tf.argmax": (tf.argmax, (VECTOR,)),
    "tf.argmin": (tf.argmin, (VECTOR,)),
    "tf.math.top_k": (lambda v: tf.math.top_k(v, 3), (VECTOR,)),
    "tf.sort": (tf.sort, (VECTOR,)),
    "tf.argsort": (tf.argsort, (VECTOR,)),
    "tf.math.segment_sum": (
        lambda v, s: tf.math.segment_sum(v, s), (VECTOR, SEGMENTS)),
    "tf.math.unsorted_segment_sum": (
        lambda v, s: tf.math.unsorted_segment_sum(v, s, 3), (VECTOR, SEGMENTS)),
    "tf.searchsorted": (
        lambda v: tf.searchsorted(tf.sort(v), v), (VECTOR,)),
    "tf.linalg.matmul": (lambda m: tf.linalg.matmul(m, m), (MATRIX,)),
    "tf.linalg.matvec": (
        lambda m, v: tf.linalg.matvec(m, v[:4]), (MATRIX, VECTOR)),
    "tf.einsum": (lambda m: tf.einsum("ij,jk->ik", m, m), (MATRIX,)),
    "tf.einsum with ...": (
        lambda m: tf.einsum("...ij,...jk->...ik", m, m), (MATRIX,)),
    "tf.linalg.inv": (tf.linalg.inv, (MATRIX,)),
    "tf.linalg.cholesky": (tf.linalg.cholesky, (SPD,)),
    "tf.linalg.solve": (
        lambda m, v: tf.linalg.solve(m, v[:4, None]), (MATRIX, VECTOR)),
    "tf.linalg.det": (tf.linalg.det, (MATRIX,)),
    "tf.linalg.qr": (lambda m: tf.abs(tf.linalg.qr(m).r), (MATRIX,)),
    "tf.linalg.eigh": (lambda m: tf.linalg.eigh(m)[0], (SPD,)),
    "tf.linalg.svd": (lambda m: tf.linalg.svd(m, compute_uv=False), (MATRIX,)),
    "tf.norm": (tf.norm, (VECTOR,)),
    "tf.math.l2_normalize": (tf.math.l2_normalize, (VECTOR,)),
    "tf.linalg.band_part": (
        lambda m: tf.linalg.band_part(m, 1, 0), (MATRIX,)),
    "tf.linalg.diag_part": (tf.linalg.diag_part, (MATRIX,)),
    "tf.linalg.trace": (tf.linalg.trace, (MATRIX,)),
    "tf.nn.relu": (tf.nn.relu, (VECTOR,)),
    "tf.nn.gelu": (tf.nn.gelu, (VECTOR,)),
    "tf.nn.softmax": (tf.nn.softmax, (LOGITS,)),
    "tf.nn.log_softmax": (tf.nn.log_softmax, (LOGITS,)),
    "tf.nn.moments": (lambda v: tf.nn.moments(v, [0]), (VECTOR,)),
    "tf.nn.batch_normalization": (
        lambda v: tf.nn.batch_normalization(v, 0.1, 2., 0.3, 1.5, 1e-3),
        (VECTOR,)),
    "tf.nn.embedding_lookup": (
        lambda i, t: tf.nn.embedding_lookup(t, i), (LABELS,), (TABLE,)),
    "tf.nn.sparse_softmax_cross_entropy_with_logits": (
        lambda y, z: tf.nn.sparse_softmax_cross_entropy_with_logits(y, z),
        (LABELS, LOGITS)),
    "tf.nn.softmax_cross_entropy_with_logits": (
        lambda y, z: tf.nn.softmax_cross_entropy_with_logits(
            tf.one_hot(y, 6), z), (LABELS, LOGITS)),
    "tf.nn.sigmoid_cross_entropy_with_logits": (
        lambda z: tf.nn.sigmoid_cross_entropy_with_logits(tf.ones_like(z), z),
        (LOGITS,)),
    "tf.nn.conv1d": (
        lambda v, k: tf.nn.conv1d(v[None, :, None] * tf.ones([1, 1, 6]), k, 1,
                                  "SAME"), (VECTOR,), (KERNEL_1D,)),
    "tf.nn.conv2d": (
        lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"), (IMAGES,), (KERNEL,)),
    "tf.nn.depthwise_conv2d": (
        lambda x, k: tf.nn.depthwise_conv2d(x, k[..., :1], [1, 1, 1, 1],
                                            "SAME"), (IMAGES,), (KERNEL,)),
    "tf.nn.conv2d_transpose": (
        lambda x, k: tf.nn.conv2d_transpose(x[..., :3], tf.transpose(
            k, [0, 1, 3, 2])[..., :3, :], [2, 6, 6, 3], 1), (IMAGES,),
        (KERNEL,)),
    "tf.nn.max_pool2d": (lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"),
                         (IMAGES,)),
    "tf.nn.avg_pool2d": (lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID"),
                         (IMAGES,)),
    "tf.image.resize": (lambda x: tf.image.resize(x, [3, 3]), (IMAGES,)),
    "tf.image.resize nearest": (
        lambda x: tf.image.resize(x, [4, 4], method="nearest"), (IMAGES,)),
    "tf.image.resize bicubic": (
        lambda x: tf.image.resize(x, [9, 9], method="bicubic"), (IMAGES,)),
    "tf.nn.l2_loss": (tf.nn.l2_loss, (VECTOR,)),
    "tf.image.flip_left_right": (tf.image.flip_left_right, (IMAGES,)),
    "tf.image.rgb_to_grayscale": (tf.image.rgb_to_grayscale, (IMAGES,)),
    "tf.image.crop_to_bounding_box": (
        lambda x: tf.image.crop_to_bounding_box(x, 1, 1, 4, 4), (IMAGES,)),
    "tf.image.pad_to_bounding_box": (
        lambda x: tf.image.pad_to_bounding_box(x, 1, 1, 8, 8), (IMAGES,)),
    "tf.image.per_image_standardization": (
        tf.image.per_image_standardization, (IMAGES,)),
    "tf.signal.fft": (
        lambda s: tf.math.real(tf.signal.fft(tf.complex(s, 0.))), (SIGNAL,)),
    "tf.signal.rfft": (lambda s: tf.math.abs(tf.signal.rfft(s)), (SIGNAL,)),
    "tf.signal.frame": (lambda s: tf.signal.frame(s, 8, 4), (SIGNAL,)),
    "tf.signal.stft": (
        lambda s: tf.math.abs(tf.signal.stft(s, 8, 4)), (SIGNAL,)),
    "tf.signal.hann_window": (
        lambda s: s[:8] * tf.signal.hann_window(8), (SIGNAL,)),
    "tf.reverse": (lambda v: tf.reverse(v, [0]), (VECTOR,)),
    "tf.roll": (lambda v: tf.roll(v, 2, 0), (VECTOR,)),
    "tf.concat": (lambda v: tf.concat([v, v[:2]], 0), (VECTOR,)),
    "tf.split": (lambda v: tf.split(v, 2), (VECTOR,)),
    "tf.tile": (lambda v: tf.tile(v, [2]), (VECTOR,)),
    "tf.pad": (lambda v: tf.pad(v, [[1, 2]]), (VECTOR,)),
    "tf.gather": (lambda v, i: tf.gather(v, i), (VECTOR, LABELS)),
    "tf.gather_nd": (lambda v, i: tf.gather_nd(v, i[:, None]),
                     (VECTOR, LABELS)),
    "tf.scatter_nd": (lambda i: tf.scatter_nd(i[:, None], tf.ones(3), [6]),
                      (LABELS,)),
    "tf.tensor_scatter_nd_update": (
        lambda v, i: tf.tensor_scatter_nd_update(v, i[:, None], tf.zeros(3)),
        (VECTOR, LABELS)),
    "tf.where": (lambda v: tf.where(v > 0, v, -v), (VECTOR,)),
    "tf.one_hot": (lambda i: tf.one_hot(i, 6), (LABELS,)),
    "tf.transpose": (tf.transpose, (MATRIX,)),
    "tf.broadcast_to": (lambda v: tf.broadcast_to(v, [2, 6]), (VECTOR,)),
    "tf.unique": (lambda i: tf.unique(i).y, (LABELS,)),
    "tf.boolean_mask": (lambda v: tf.boolean_mask(v, v > 0), (VECTOR,)),
    "tf.clip_by_global_norm": (
        lambda v: tf.clip_by_global_norm([v], 1.)[0][0], (VECTOR,)),
}


def _spec(name):
  spec = OPS[name]
  return spec[0], spec[1], spec[2] if len(spec) > 2 else ()


def outcome(name):
  """'works', or the first sentence of the error tfspmd raises."""
  fun, mapped, broadcast = _spec(name)
  in_axes = (0,) * len(mapped) + (None,) * len(broadcast)
  try:
    out = tfspmd.pmap(fun, "i", in_axes=in_axes)(*mapped, *broadcast)
  except (ValueError, TypeError, NotImplementedError) as e:
    return "fails: " + _first_sentence(str(e))
  expected = [fun(*[tf.constant(m[k]) for m in mapped],
                  *[tf.constant(b) for b in broadcast]) for k in range(N)]
  got, want = tf.nest.flatten(out), tf.nest.flatten(expected[0])
  for leaf, (value, first) in enumerate(zip(got, want)):
    reference = np.stack([np.asarray(tf.nest.flatten(e)[leaf])
                          for e in expected])
    np.testing.assert_allclose(np.asarray(value), reference, rtol=2e-4,
                               atol=2e-5, err_msg=name)
    del first
  return "works"


def _first_sentence(message):
  message = re.sub(r"\s+", " ", message).strip()
  message = re.sub(r"\(TF [0-9.]+\)", "(TF 2.21)", message)
  return message.split(": ")[0] if len(message) > 400 else message


def _documented():
  rows = {}
  with open(DOC_PATH) as f:
    for line in f:
      found = re.match(r"\| `(.+?)` \| (works|fails: .*) \|$", line.rstrip())
      if found:
        rows[found.group(1)] = found.group(2).replace("\\|", "|")
  return rows


def _write_doc(outcomes):
  works = sum(o == "works" for o in outcomes.values())
  lines = [
      "# Ops inside a mapped function",
      "",
      "Each op below ran inside `tfspmd.pmap` on 8 logical CPU devices, on "
      "per-device data, and its result was compared with the op run eagerly "
      "on each device's slice (tests/test_op_survey.py, which also keeps "
      "this table equal to what the code does). TensorFlow 2.21.",
      "",
      f"{works} of {len(outcomes)} work. An op that fails raises tfspmd's "
      f"error at trace time, quoted here.",
      "",
      "| op | outcome |",
      "| --- | --- |",
  ]
  for name, result in outcomes.items():
    lines.append(f"| `{name}` | {result.replace('|', chr(92) + '|')} |")
  with open(DOC_PATH, "w") as f:
    f.write("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def outcomes():
  return {name: outcome(name) for name in OPS}


def test_every_op_works_or_raises_tfspmds_error(outcomes):
  for name, result in outcomes.items():
    assert result == "works" or "DTensor" in result or "tfspmd" in result or (
        "mapped" in result), (name, result)


def test_docs_ops_md_is_the_survey(outcomes):
  if os.environ.get("TFSPMD_WRITE_OPS_DOC"):
    _write_doc(outcomes)
  assert _documented() == outcomes, (
      "docs/ops.md differs from the survey; rewrite it with "
      "TFSPMD_WRITE_OPS_DOC=1 pytest tests/test_op_survey.py")
