"""Which TensorFlow ops run inside pmap, forward and gradient.

Each op runs on 8 devices on per-device data, and its result is compared
with the same op run eagerly on each device's slice; where the op is
differentiable, so is the gradient of a weighted sum of its outputs with
respect to its first input. Every function of tf.math that runs eagerly on
a float (or an integer) vector, alone or with a second one, is found and
surveyed; the ops of tf.linalg, tf.nn, tf.image, tf.signal, the sorts, the
gather and scatter family and the shape family are listed by hand. An op
that cannot run must raise tfspmd's error (ValueError or TypeError naming
the op), never a TensorFlow internal. docs/ops.md is the table of the
outcomes and of the route each op took; a test keeps it equal to what the
code does (`TFSPMD_WRITE_OPS_DOC=1` rewrites it).
"""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd._src.core import route_log

N = 8
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PATH = os.path.join(_ROOT, "docs", "ops.md")

RNG = np.random.default_rng(0)
MATRIX = (RNG.standard_normal((N, 4, 4)) + 4 * np.eye(4)).astype(np.float32)
SPD = np.einsum("nij,nkj->nik", MATRIX, MATRIX).astype(np.float32)
VECTOR = RNG.standard_normal((N, 6)).astype(np.float32)
POSITIVE = (np.abs(VECTOR) + 0.5).astype(np.float32)
UNIT = RNG.uniform(0.1, 0.9, (N, 6)).astype(np.float32)
UNIT_2 = RNG.uniform(0.1, 0.9, (N, 6)).astype(np.float32)
COUNTS = RNG.integers(1, 6, (N, 6)).astype(np.int32)
COUNTS_2 = RNG.integers(1, 6, (N, 6)).astype(np.int32)
IMAGES = RNG.uniform(size=(N, 2, 6, 6, 3)).astype(np.float32)
VOLUMES = RNG.uniform(size=(N, 1, 4, 4, 4, 2)).astype(np.float32)
SIGNAL = RNG.standard_normal((N, 32)).astype(np.float32)
LABELS = RNG.integers(0, 6, (N, 3)).astype(np.int32)
LOGITS = RNG.standard_normal((N, 3, 6)).astype(np.float32)
SEGMENTS = np.tile(np.array([0, 0, 1, 1, 2, 2], np.int32), (N, 1))
INDEX = np.arange(N, dtype=np.int32)
SHIFTS = RNG.integers(-5, 6, (N,)).astype(np.int32)
KERNEL = RNG.standard_normal((3, 3, 3, 4)).astype(np.float32)
KERNEL_1D = RNG.standard_normal((3, 6, 2)).astype(np.float32)
KERNEL_3D = RNG.standard_normal((2, 2, 2, 2, 3)).astype(np.float32)
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

OPS.update({
    # tf.linalg
    "tf.linalg.slogdet": (lambda m: tf.linalg.slogdet(m)[1], (MATRIX,)),
    "tf.linalg.logdet": (tf.linalg.logdet, (SPD,)),
    "tf.linalg.triangular_solve": (
        lambda m, v: tf.linalg.triangular_solve(
            tf.linalg.band_part(m, -1, 0), v[:4, None]), (MATRIX, VECTOR)),
    "tf.linalg.cholesky_solve": (
        lambda m, v: tf.linalg.cholesky_solve(tf.linalg.cholesky(m),
                                              v[:4, None]), (SPD, VECTOR)),
    "tf.linalg.lstsq": (
        lambda m, v: tf.linalg.lstsq(m, v[:4, None]), (MATRIX, VECTOR)),
    "tf.linalg.pinv": (tf.linalg.pinv, (MATRIX,)),
    "tf.linalg.expm": (lambda m: tf.linalg.expm(m / 8.), (MATRIX,)),
    "tf.linalg.lu": (lambda m: tf.linalg.lu(m)[0], (MATRIX,)),
    "tf.linalg.eigvalsh": (tf.linalg.eigvalsh, (SPD,)),
    "tf.linalg.qr q": (lambda m: tf.abs(tf.linalg.qr(m).q), (MATRIX,)),
    "tf.linalg.svd u": (
        lambda m: tf.abs(tf.linalg.svd(m)[1][:, 0]), (MATRIX,)),
    "tf.linalg.matrix_transpose": (tf.linalg.matrix_transpose, (MATRIX,)),
    "tf.linalg.adjoint": (tf.linalg.adjoint, (MATRIX,)),
    "tf.linalg.diag": (tf.linalg.diag, (VECTOR,)),
    "tf.linalg.set_diag": (
        lambda m, v: tf.linalg.set_diag(m, v[:4]), (MATRIX, VECTOR)),
    "tf.linalg.cross": (lambda v: tf.linalg.cross(v[:3], v[3:]), (VECTOR,)),
    "tf.linalg.tensordot": (
        lambda m: tf.linalg.tensordot(m, m, [[1], [0]]), (MATRIX,)),
    "tf.linalg.normalize": (lambda v: tf.linalg.normalize(v)[0], (VECTOR,)),
    "tf.linalg.global_norm": (lambda v: tf.linalg.global_norm([v]),
                              (VECTOR,)),
    "tf.linalg.matmul batched broadcast": (
        lambda m, w: tf.linalg.matmul(tf.stack([m, m + 1.]), w),
        (MATRIX,), (MATRIX[0],)),
    # tf.nn
    "tf.nn.conv1d per-device kernel": (
        lambda v, k: tf.nn.conv1d(v[None, :, None] * tf.ones([1, 1, 6]),
                                  k, 1, "VALID"),
        (VECTOR,), (KERNEL_1D,)),
    "tf.nn.conv3d": (
        lambda x, k: tf.nn.conv3d(x, k, [1, 1, 1, 1, 1], "SAME"),
        (VOLUMES,), (KERNEL_3D,)),
    "tf.nn.separable_conv2d": (
        lambda x, k: tf.nn.separable_conv2d(
            x, k[..., :1], tf.ones([1, 1, 3, 2]), [1, 1, 1, 1], "SAME"),
        (IMAGES,), (KERNEL,)),
    "tf.nn.atrous_conv2d": (
        lambda x, k: tf.nn.atrous_conv2d(x, k, 2, "SAME"), (IMAGES,),
        (KERNEL,)),
    "tf.nn.max_pool1d": (
        lambda v: tf.nn.max_pool1d(v[None, :, None], 2, 2, "VALID"),
        (VECTOR,)),
    "tf.nn.avg_pool3d": (
        lambda x: tf.nn.avg_pool3d(x, 2, 2, "VALID"), (VOLUMES,)),
    "tf.nn.max_pool3d": (
        lambda x: tf.nn.max_pool3d(x, 2, 2, "VALID"), (VOLUMES,)),
    "tf.nn.local_response_normalization": (
        tf.nn.local_response_normalization, (IMAGES,)),
    "tf.nn.leaky_relu": (tf.nn.leaky_relu, (VECTOR,)),
    "tf.nn.elu": (tf.nn.elu, (VECTOR,)),
    "tf.nn.selu": (tf.nn.selu, (VECTOR,)),
    "tf.nn.silu": (tf.nn.silu, (VECTOR,)),
    "tf.nn.relu6": (tf.nn.relu6, (VECTOR,)),
    "tf.nn.softsign": (tf.nn.softsign, (VECTOR,)),
    "tf.nn.bias_add": (lambda x: tf.nn.bias_add(x, [1., 2., 3.]), (IMAGES,)),
    "tf.nn.log_poisson_loss": (
        lambda v, w: tf.nn.log_poisson_loss(w, v), (VECTOR, POSITIVE)),
    "tf.nn.weighted_cross_entropy_with_logits": (
        lambda v, w: tf.nn.weighted_cross_entropy_with_logits(w, v, 2.),
        (VECTOR, UNIT)),
    "tf.nn.normalize_moments": (
        lambda v: tf.nn.normalize_moments(6., tf.reduce_sum(v),
                                          tf.reduce_sum(v * v), None)[1],
        (VECTOR,)),
    "tf.nn.in_top_k": (
        lambda z, y: tf.cast(tf.nn.in_top_k(y, z, 2), tf.int32),
        (LOGITS, LABELS)),
    "tf.nn.ctc_greedy_decoder": (
        lambda z: tf.nn.ctc_greedy_decoder(z[:, None, :], [3])[1],
        (LOGITS,)),
    "tf.nn.space_to_depth": (
        lambda x: tf.nn.space_to_depth(x, 2), (IMAGES,)),
    "tf.nn.depth_to_space": (
        lambda x: tf.nn.depth_to_space(tf.tile(x, [1, 1, 1, 4])[..., :4],
                                       2), (IMAGES,)),
    "tf.nn.compute_average_loss": (
        lambda v: tf.nn.compute_average_loss(v, global_batch_size=48),
        (VECTOR,)),
    # tf.image
    "tf.image.adjust_brightness": (
        lambda x: tf.image.adjust_brightness(x, 0.1), (IMAGES,)),
    "tf.image.adjust_contrast": (
        lambda x: tf.image.adjust_contrast(x, 2.), (IMAGES,)),
    "tf.image.adjust_saturation": (
        lambda x: tf.image.adjust_saturation(x, 2.), (IMAGES,)),
    "tf.image.adjust_hue": (lambda x: tf.image.adjust_hue(x, 0.2), (IMAGES,)),
    "tf.image.adjust_gamma": (
        lambda x: tf.image.adjust_gamma(x, 2.), (IMAGES,)),
    "tf.image.rgb_to_hsv": (tf.image.rgb_to_hsv, (IMAGES,)),
    "tf.image.hsv_to_rgb": (tf.image.hsv_to_rgb, (IMAGES,)),
    "tf.image.rgb_to_yuv": (tf.image.rgb_to_yuv, (IMAGES,)),
    "tf.image.sobel_edges": (tf.image.sobel_edges, (IMAGES,)),
    "tf.image.image_gradients": (
        lambda x: tf.image.image_gradients(x)[0], (IMAGES,)),
    "tf.image.total_variation": (tf.image.total_variation, (IMAGES,)),
    "tf.image.central_crop": (
        lambda x: tf.image.central_crop(x, 0.5), (IMAGES,)),
    "tf.image.resize area": (
        lambda x: tf.image.resize(x, [3, 3], method="area"), (IMAGES,)),
    "tf.image.resize lanczos3": (
        lambda x: tf.image.resize(x, [9, 9], method="lanczos3"), (IMAGES,)),
    "tf.image.extract_patches": (
        lambda x: tf.image.extract_patches(x, [1, 2, 2, 1], [1, 2, 2, 1],
                                           [1, 1, 1, 1], "VALID"),
        (IMAGES,)),
    "tf.image.psnr": (lambda x: tf.image.psnr(x, x * 0.9, 1.), (IMAGES,)),
    "tf.image.ssim": (
        lambda x: tf.image.ssim(x, x * 0.9, 1., filter_size=3), (IMAGES,)),
    "tf.image.rot90": (lambda x: tf.image.rot90(x), (IMAGES,)),
    "tf.image.transpose": (tf.image.transpose, (IMAGES,)),
    "tf.image.flip_up_down": (tf.image.flip_up_down, (IMAGES,)),
    "tf.image.crop_and_resize": (
        lambda x, b: tf.image.crop_and_resize(
            x, tf.stack([b[:4] * 0.5, b[:4] * 0.5 + 0.5]) * 1., [0, 1],
            [3, 3]), (IMAGES, UNIT)),
    # tf.signal
    "tf.signal.ifft": (
        lambda s: tf.math.real(tf.signal.ifft(tf.complex(s, s))), (SIGNAL,)),
    "tf.signal.irfft": (
        lambda s: tf.signal.irfft(tf.complex(s[:17], s[:17])), (SIGNAL,)),
    "tf.signal.fft2d": (
        lambda s: tf.math.abs(tf.signal.fft2d(
            tf.complex(tf.reshape(s, [4, 8]), 0.))), (SIGNAL,)),
    "tf.signal.dct": (tf.signal.dct, (SIGNAL,)),
    "tf.signal.idct": (tf.signal.idct, (SIGNAL,)),
    "tf.signal.overlap_and_add": (
        lambda s: tf.signal.overlap_and_add(tf.reshape(s, [4, 8]), 4),
        (SIGNAL,)),
    "tf.signal.inverse_stft": (
        lambda s: tf.signal.inverse_stft(tf.signal.stft(s, 8, 4), 8, 4),
        (SIGNAL,)),
    "tf.signal.linear_to_mel_weight_matrix": (
        lambda s: tf.matmul(tf.abs(tf.signal.rfft(s))[None],
                            tf.signal.linear_to_mel_weight_matrix(
                                4, 17, 8000, 20., 3000.)), (SIGNAL,)),
    "tf.signal.mfccs_from_log_mel_spectrograms": (
        lambda s: tf.signal.mfccs_from_log_mel_spectrograms(
            tf.reshape(s, [4, 8])), (SIGNAL,)),
    "tf.signal.hamming_window": (
        lambda s: s[:8] * tf.signal.hamming_window(8), (SIGNAL,)),
    # sorts
    "tf.sort descending": (
        lambda v: tf.sort(v, direction="DESCENDING"), (VECTOR,)),
    "tf.math.top_k indices": (
        lambda v: tf.math.top_k(v, 3).indices, (VECTOR,)),
    # gather and scatter
    "tf.gather batch_dims": (
        lambda m, i: tf.gather(m, i[:4] % 4, axis=1, batch_dims=0),
        (MATRIX, COUNTS)),
    "tf.gather at per-device index": (
        lambda v, k: tf.gather(v, k % 6), (VECTOR, INDEX)),
    "tf.gather_nd batch_dims": (
        lambda m, i: tf.gather_nd(m, (i[:4, None] - 1) % 4, batch_dims=1),
        (MATRIX, COUNTS)),
    "tf.scatter_nd per-device shape values": (
        lambda v, i: tf.scatter_nd(i[:, None], v[:3], [6]),
        (VECTOR, LABELS)),
    "tf.tensor_scatter_nd_add": (
        lambda v, i: tf.tensor_scatter_nd_add(v, i[:, None], v[:3]),
        (VECTOR, LABELS)),
    "tf.tensor_scatter_nd_sub": (
        lambda v, i: tf.tensor_scatter_nd_sub(v, i[:, None], v[:3]),
        (VECTOR, LABELS)),
    "tf.tensor_scatter_nd_max": (
        lambda v, i: tf.tensor_scatter_nd_max(v, i[:, None], v[3:]),
        (VECTOR, LABELS)),
    "tf.tensor_scatter_nd_min": (
        lambda v, i: tf.tensor_scatter_nd_min(v, i[:, None], v[3:]),
        (VECTOR, LABELS)),
    "tf.tensor_scatter_nd_update at per-device offset": (
        lambda v, k: tf.tensor_scatter_nd_update(
            v, tf.reshape(k % 6, [1, 1]), [0.]), (VECTOR, INDEX)),
    "tf.math.unsorted_segment_max": (
        lambda v, s: tf.math.unsorted_segment_max(v, s, 3),
        (VECTOR, SEGMENTS)),
    "tf.math.unsorted_segment_min": (
        lambda v, s: tf.math.unsorted_segment_min(v, s, 3),
        (VECTOR, SEGMENTS)),
    "tf.math.unsorted_segment_prod": (
        lambda v, s: tf.math.unsorted_segment_prod(v, s, 3),
        (VECTOR, SEGMENTS)),
    "tf.math.unsorted_segment_mean": (
        lambda v, s: tf.math.unsorted_segment_mean(v, s, 3),
        (VECTOR, SEGMENTS)),
    "tf.math.unsorted_segment_sqrt_n": (
        lambda v, s: tf.math.unsorted_segment_sqrt_n(v, s, 3),
        (VECTOR, SEGMENTS)),
    "tf.math.segment_sum static segments": (
        lambda v, s: tf.math.segment_sum(v, s), (VECTOR,), (SEGMENTS[0],)),
    "tf.math.segment_max static segments": (
        lambda v, s: tf.math.segment_max(v, s), (VECTOR,), (SEGMENTS[0],)),
    "tf.math.bincount": (
        lambda i: tf.math.bincount(i, minlength=6, maxlength=6), (COUNTS,)),
    "tf.math.bincount weights": (
        lambda i, w: tf.math.bincount(i, w, minlength=6, maxlength=6),
        (COUNTS, UNIT)),
    "tf.histogram_fixed_width": (
        lambda v: tf.histogram_fixed_width(v, [-2., 2.], 5), (VECTOR,)),
    "tf.searchsorted right": (
        lambda v: tf.searchsorted(tf.sort(v), v, side="right"), (VECTOR,)),
    "tf.dynamic_stitch": (
        lambda v: tf.dynamic_stitch([[0, 2, 4], [1, 3, 5]],
                                    [v[:3], v[3:]]), (VECTOR,)),
    # the shape family
    "tf.reshape": (lambda m: tf.reshape(m, [2, 8]), (MATRIX,)),
    "tf.transpose perm": (lambda x: tf.transpose(x, [2, 0, 1, 3]), (IMAGES,)),
    "tf.stack": (lambda v: tf.stack([v, 2 * v], axis=1), (VECTOR,)),
    "tf.unstack": (lambda m: tf.unstack(m, axis=1), (MATRIX,)),
    "tf.expand_dims": (lambda v: tf.expand_dims(v, 1), (VECTOR,)),
    "tf.squeeze": (lambda v: tf.squeeze(v[None, :, None]), (VECTOR,)),
    "tf.pad reflect": (
        lambda v: tf.pad(v, [[2, 2]], mode="REFLECT"), (VECTOR,)),
    "tf.pad symmetric": (
        lambda v: tf.pad(v, [[2, 1]], mode="SYMMETRIC"), (VECTOR,)),
    "tf.repeat": (lambda v: tf.repeat(v, 2), (VECTOR,)),
    "tf.meshgrid": (lambda v: tf.meshgrid(v[:3], v[3:])[0], (VECTOR,)),
    "tf.roll per-device shift": (
        lambda v, k: tf.roll(v, k, 0), (VECTOR, SHIFTS)),
    "tf.reverse 2 axes": (lambda m: tf.reverse(m, [0, 1]), (MATRIX,)),
    "tf.slice per-device offset": (
        lambda m, k: tf.slice(m, tf.stack([k % 3, 1]), [2, 3]),
        (MATRIX, INDEX)),
    "x[i] per-device index": (
        lambda m, k: m[(k + 1) % 4], (MATRIX, INDEX)),
    "x[i, 1:3] per-device index": (
        lambda m, k: m[-1 - k % 4, 1:3], (MATRIX, INDEX)),
    "tf.split sizes": (lambda v: tf.split(v, [2, 4]), (VECTOR,)),
    "tf.where 3 arguments broadcast": (
        lambda m, v: tf.where(m > 4., m, v[:4]), (MATRIX, VECTOR)),
    "tf.broadcast_to rank 3": (
        lambda v: tf.broadcast_to(v[:, None], [2, 6, 3]), (VECTOR,)),
    "tf.identity_n": (lambda v: tf.identity_n([v, -v])[1], (VECTOR,)),
    "tf.fill per-device value": (
        lambda v: tf.fill([3], v[0]), (VECTOR,)),
    "tf.sequence_mask": (
        lambda i: tf.cast(tf.sequence_mask(i, 6), tf.int32), (COUNTS,)),
    "tf.clip_by_norm": (lambda v: tf.clip_by_norm(v, 1.), (VECTOR,)),
})

# tf.math functions that take other arguments than tensors to compute on,
# draw random numbers, or give no tensor.
_NOT_ELEMENTWISE = frozenset({
    "bincount", "confusion_matrix", "in_top_k", "segment_max",
    "segment_mean", "segment_min", "segment_prod", "segment_sum",
    "sobol_sample", "unsorted_segment_max", "unsorted_segment_mean",
    "unsorted_segment_min", "unsorted_segment_prod", "unsorted_segment_sqrt_n",
    "unsorted_segment_sum", "top_k", "polyval", "accumulate_n", "add_n",
})


def _discovered_math_ops():
  """Each tf.math function that runs eagerly on vectors, with its inputs."""
  found = {}
  for name in sorted(dir(tf.math)):
    fun = getattr(tf.math, name)
    if name.startswith("_") or name in _NOT_ELEMENTWISE or not callable(fun):
      continue
    for inputs in ((UNIT,), (UNIT, UNIT_2), (COUNTS,), (COUNTS, COUNTS_2)):
      try:
        out = fun(*[tf.constant(v[0]) for v in inputs])
      except Exception:  # pylint: disable=broad-except
        continue
      leaves = tf.nest.flatten(out)
      if leaves and all(isinstance(leaf, tf.Tensor) and
                        leaf.dtype != tf.string for leaf in leaves):
        found[f"tf.math.{name}"] = (fun, inputs)
      break
  return found


for _name, _spec_value in _discovered_math_ops().items():
  OPS.setdefault(_name, _spec_value)


def _spec(name):
  spec = OPS[name]
  return spec[0], spec[1], spec[2] if len(spec) > 2 else ()


def _weights(leaf):
  """Fixed cotangent weights of an output: a weighted sum to differentiate."""
  count = tf.cast(tf.range(tf.size(leaf)), tf.float32)
  return tf.reshape(tf.cos(count), tf.shape(leaf))


def _gradient_of(fun):
  """The gradient of a weighted sum of `fun`'s float outputs, by its first input."""
  def gradient(x, *rest):
    with tf.GradientTape() as tape:
      tape.watch(x)
      out = fun(x, *rest)
      # The loss is taken under the tape: out of it, nothing connects the
      # loss to `x` and every gradient would be zero.
      leaves = [leaf for leaf in tf.nest.flatten(out)
                if leaf.dtype.is_floating]
      loss = tf.add_n([tf.reduce_sum(tf.cast(leaf, tf.float32) *
                                     _weights(leaf)) for leaf in leaves])
    found = tape.gradient(loss, x)
    # A gather's gradient is IndexedSlices: compare it dense.
    return tf.zeros_like(x) if found is None else tf.convert_to_tensor(found)
  return gradient


def _differentiable(fun, mapped, broadcast):
  if not mapped[0].dtype.kind == "f":
    return False
  x = tf.constant(mapped[0][0])
  with tf.GradientTape() as tape:
    tape.watch(x)
    out = fun(x, *[tf.constant(m[0]) for m in mapped[1:]],
              *[tf.constant(b) for b in broadcast])
  leaves = [leaf for leaf in tf.nest.flatten(out) if leaf.dtype.is_floating]
  try:
    return bool(leaves) and tape.gradient(leaves, x) is not None
  except LookupError:  # No gradient registered for an op of `fun`.
    return False


def _eager(fun, mapped, broadcast, device):
  """`fun` run eagerly on `device`'s slice of the mapped inputs."""
  return fun(*[tf.constant(m[device]) for m in mapped],
             *[tf.constant(b) for b in broadcast])


def _compared(fun, mapped, broadcast, expected, rtol, atol):
  """'works', or what went wrong, for `fun` in a pmap against `expected`.

  `expected` holds each device's flattened result.
  """
  in_axes = (0,) * len(mapped) + (None,) * len(broadcast)
  try:
    out = tfspmd.pmap(fun, "i", in_axes=in_axes)(*mapped, *broadcast)
    got = [np.asarray(leaf) for leaf in tf.nest.flatten(out)]
  except (ValueError, TypeError, NotImplementedError) as e:
    return "fails: " + _first_sentence(str(e))
  except Exception as e:  # pylint: disable=broad-except
    return f"ERROR {type(e).__name__}: {_first_sentence(str(e))[:200]}"
  for leaf, value in enumerate(got):
    reference = np.stack([np.asarray(e[leaf]) for e in expected])
    if value.shape != reference.shape or not np.allclose(
        value, reference, rtol=rtol, atol=atol, equal_nan=True):
      return "WRONG VALUES"
  return "works"


def _run(fun, mapped, broadcast, rtol, atol):
  """'works', or what went wrong, for `fun` in a pmap against eager runs."""
  expected = [tf.nest.flatten(_eager(fun, mapped, broadcast, k))
              for k in range(N)]
  return _compared(fun, mapped, broadcast, expected, rtol, atol)


def _run_in_branch(fun, mapped, broadcast, rtol, atol):
  """`_run` of `fun` in a per-device `tf.cond` branch half the devices skip.

  Devices 0-3 take the branch and must give the op's eager result; devices
  4-7 take the other branch, zeros of the same structure, and must not
  fail for what the skipped branch would compute on their data.
  """
  taken = [_eager(fun, mapped, broadcast, k) for k in range(N // 2)]
  skipped = tf.nest.map_structure(np.zeros_like, taken[0])

  def in_branch(*args):
    chosen = tfspmd.lax.axis_index("i") < N // 2
    return tf.cond(chosen, lambda: fun(*args), lambda: tf.nest.map_structure(
        tf.constant, skipped))

  expected = ([tf.nest.flatten(t) for t in taken] +
              [tf.nest.flatten(skipped)] * (N - N // 2))
  return _compared(in_branch, mapped, broadcast, expected, rtol, atol)


def _route(routes):
  parts = [f"{route}: {', '.join(sorted(routes[route]))}"
           for route in (route_log.PER_POSITION, route_log.REPLICATED)
           if routes.get(route)]
  return "; ".join(parts) if parts else "pfor"


# Gradients that fail while their program runs, which would leave the
# process's later programs failing too: run in a process of their own by
# tests/test_known_defects.py, which fails once they work.
GRADIENTS_THAT_FAIL_WHILE_THEY_RUN = {
    "tf.image.rot90": (
        "fails: while it runs, DTensor's mesh propagation loses a constant of "
        "the gradient of the replicated ReverseV2 (tests/test_known_defects.py)"),
}


def outcome(name):
  """(forward, gradient, route) of the op `name` inside a pmap.

  Each of forward and gradient is 'works', 'fails: <tfspmd's error>', or
  (for a defect) what went wrong; gradient is '-' for an op that is not
  differentiable by its first input.
  """
  fun, mapped, broadcast = _spec(name)
  with route_log.recording() as routes:
    forward = _run(fun, mapped, broadcast, rtol=2e-4, atol=2e-5)
    gradient = "-"
    if name in GRADIENTS_THAT_FAIL_WHILE_THEY_RUN:
      gradient = GRADIENTS_THAT_FAIL_WHILE_THEY_RUN[name]
    elif _differentiable(fun, mapped, broadcast):
      gradient = _run(_gradient_of(fun), mapped, broadcast, rtol=2e-3,
                      atol=1e-4)
  return forward, gradient, _route(routes)


def _first_sentence(message):
  message = re.sub(r"\s+", " ", message).strip()
  message = re.sub(r"\(TF [0-9.]+\)", "(TF 2.21)", message)
  return message.split(": ")[0] if len(message) > 400 else message


def _cell(text):
  return text.replace("|", chr(92) + "|")


_ROW = re.compile(r"\| `(.+?)` \| (.*?) \| (.*?) \| (.*?) \|$")


def _documented():
  rows = {}
  with open(DOC_PATH) as f:
    for line in f:
      found = _ROW.match(line.rstrip())
      if found and found.group(1) != "op":
        rows[found.group(1)] = tuple(
            found.group(k).replace(chr(92) + "|", "|") for k in (2, 3, 4))
  return rows


def _write_doc(outcomes):
  forward = sum(o[0] == "works" for o in outcomes.values())
  differentiable = [o[1] for o in outcomes.values() if o[1] != "-"]
  gradients = sum(g == "works" for g in differentiable)
  per_position = sum(route_log.PER_POSITION in o[2] for o in outcomes.values())
  replicated = sum(route_log.REPLICATED in o[2] for o in outcomes.values())
  lines = [
      "# Ops inside a mapped function",
      "",
      "Each op below ran inside `tfspmd.pmap` on 8 logical CPU devices, on "
      "DTensor's executor (`tfspmd_executor='dtensor'`: the routes below are "
      "those DTensor's SPMD expansion takes, as on accelerators), on "
      "per-device data, and its result was compared with the op run eagerly "
      "on each device's slice; where it is differentiable by its first "
      "input, so was the gradient of a weighted sum of its outputs "
      "(tests/test_op_survey.py, which also keeps this table equal to what "
      "the code does). Every function of `tf.math` that runs on float or "
      "integer vectors is in it, found by the test; the rest are listed by "
      "hand. TensorFlow 2.21.",
      "",
      f"Forward: {forward} of {len(outcomes)} work. Gradient: {gradients} of "
      f"{len(differentiable)} differentiable ops work. An op that fails "
      f"raises tfspmd's error at trace time, quoted here. Each op that "
      f"works also works inside a `tf.cond` branch that half the devices "
      f"skip (their lanes get zeros from the other branch), with the same "
      f"values on the devices that take it.",
      "",
      "## Routes",
      "",
      "- **pfor**: TensorFlow's vectorizer has a converter for the op (or "
      "tfspmd gives it one), and DTensor splits the batched op over the "
      "devices: each device computes its own part.",
      f"- **per position** ({per_position} ops here): pfor cannot map the "
      "op, or not with an input that differs between devices. tfspmd makes "
      "one copy of the op per position of the mapped axis, on that "
      "position's inputs, and stacks the results: every device gathers the "
      "op's inputs and computes it for every position, n times the op's "
      "work. Any op with a kernel and outputs of static shape runs this "
      "way.",
      f"- **replicated** ({replicated} ops here): DTensor has no SPMD "
      "expander for the (batched) op. tfspmd has DTensor compute it whole on "
      "every device, from inputs gathered onto every device, each device "
      "keeping its own part: n times the op's work, plus the gathering.",
      "",
      "What the routes cost (benchmarks/op_routes.py, 8 logical CPU "
      "devices, 128 x 256 float32 per device, medians of 30 interleaved "
      "rounds): `tf.math.cumprod` on the replicated route 9.9 ms against "
      "2.5 ms for the same values as `exp(cumsum(log x))` on pfor's (4.0x); "
      "`tf.math.bincount` per position 3.0 ms against 3.6 ms for a one-hot "
      "sum (0.84x: the one-hot rows cost more than eight small counts); "
      "`tf.slice` at an `axis_index` offset 0.98 ms against 0.67 ms for a "
      "static slice (1.5x).",
      "",
      "A slice or strided slice at an offset that differs between devices "
      "(`x[i]`, `tf.slice(x, begin, size)` with `begin` from "
      "`lax.axis_index`) is a gather of each device's own rows, clamped into "
      "the array as `lax.dynamic_slice` is: no route of last resort.",
      "",
      "| op | forward | gradient | route |",
      "| --- | --- | --- | --- |",
  ]
  for name, (result, gradient, route) in outcomes.items():
    lines.append(f"| `{name}` | {_cell(result)} | {_cell(gradient)} | "
                 f"{_cell(route)} |")
  with open(DOC_PATH, "w") as f:
    f.write("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def outcomes():
  before = tfspmd.config.tfspmd_executor
  tfspmd.config.update("tfspmd_executor", "dtensor")
  try:
    return {name: outcome(name) for name in OPS}
  finally:
    tfspmd.config.update("tfspmd_executor", before)


def _acceptable(result):
  return result in ("works", "-") or (
      result.startswith("fails: ") and
      ("DTensor" in result or "tfspmd" in result or "mapped" in result or
       "devices" in result))


def test_every_op_works_or_raises_tfspmds_error(outcomes):
  bad = {name: result for name, result in outcomes.items()
         if not (_acceptable(result[0]) and _acceptable(result[1]))}
  assert not bad, bad


def test_docs_ops_md_is_the_survey(outcomes):
  if os.environ.get("TFSPMD_WRITE_OPS_DOC"):
    _write_doc(outcomes)
  assert _documented() == outcomes, (
      "docs/ops.md differs from the survey; rewrite it with "
      "TFSPMD_WRITE_OPS_DOC=1 pytest tests/test_op_survey.py")


def test_every_op_in_a_branch_some_devices_skip(outcomes):
  """Each op that works in a pmap works in a per-device cond branch too."""
  bad = {}
  for name, (forward, _, _) in outcomes.items():
    if forward != "works":
      continue
    fun, mapped, broadcast = _spec(name)
    result = _run_in_branch(fun, mapped, broadcast, rtol=2e-4, atol=2e-5)
    if result != "works":
      bad[name] = result
  assert not bad, bad


# Blocks of rank 7 and 8 on a mesh of three axes: the vectorized program
# holds tensors of rank 10 and 11, past the rank 8 TensorFlow's kernels of
# slices and broadcasts take.
HIGH_RANK_BLOCKS = {7: (2, 1, 3, 1, 2, 1, 2), 8: (1, 2, 1, 3, 1, 2, 1, 2)}


def _softmax(x, axis):
  e = np.exp(x - x.max(axis, keepdims=True))
  return e / e.sum(axis, keepdims=True)


HIGH_RANK_OPS = {
    "tf.exp": tf.exp,
    "tf.tanh": tf.tanh,
    "x + tf.range(2.)": lambda x: x + tf.range(2.),
    "tf.where": lambda x: tf.where(x > 0.5, x, -x),
    "tf.where, broadcast": lambda x: tf.where(x > 0.5, x, tf.zeros([2])),
    "tf.maximum": lambda x: tf.maximum(x, 0.3),
    "tf.clip_by_value": lambda x: tf.clip_by_value(x, 0.2, 0.8),
    "x[..., 1:]": lambda x: x[..., 1:],
    "x[0]": lambda x: x[0],
    "tf.slice": lambda x: tf.slice(x, [0] * x.shape.rank,
                                   [-1] * (x.shape.rank - 1) + [1]),
    "tf.reverse": lambda x: tf.reverse(x, [x.shape.rank - 1]),
    "tf.tile": lambda x: tf.tile(x, [2] + [1] * (x.shape.rank - 1)),
    "tf.concat": lambda x: tf.concat([x, x], -1),
    "tf.transpose": lambda x: tf.transpose(x,
                                           list(range(x.shape.rank))[::-1]),
    "tf.reduce_sum": lambda x: tf.reduce_sum(x, -1),
    "tf.reduce_max": lambda x: tf.reduce_max(x, 3),
    "tf.math.cumsum": lambda x: tf.math.cumsum(x, axis=-1),
    "tf.gather": lambda x: tf.gather(x, [1, 0], axis=-1),
    "tf.broadcast_to": lambda x: tf.broadcast_to(x[..., :1], x.shape),
    "tf.reshape": lambda x: tf.reshape(x, [-1, 2]),
    "tf.einsum": lambda x: tf.einsum("...i,ij->...j", x, tf.ones([2, 3])),
    "tf.matmul": lambda x: tf.matmul(x, tf.ones([2, 2])),
    "tf.nn.softmax": lambda x: tf.nn.softmax(x, axis=3),
}


def _high_rank_reference(name, fun, block, gradient):
  """The op (or its gradient) on one device's block, eagerly or in NumPy.

  TensorFlow's own softmax kernel takes at most rank 5: NumPy stands in.
  """
  if name == "tf.nn.softmax":
    s = _softmax(block.astype(np.float64), 3)
    if not gradient:
      return s
    w = np.asarray(_weights(tf.constant(s, tf.float32)))
    return s * (w - (s * w).sum(3, keepdims=True))
  x = tf.constant(block)
  if not gradient:
    return np.asarray(fun(x))
  return np.asarray(_gradient_of(fun)(x))


def _high_rank_outcome(name, rank, gradient):
  fun = HIGH_RANK_OPS[name]
  block = HIGH_RANK_BLOCKS[rank]
  x = np.random.default_rng(rank).uniform(
      size=(N * block[0],) + block[1:]).astype(np.float32)
  names = ("a", "b", "c")
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(2, 2, 2), names)
  mapped = _gradient_of(fun) if gradient else fun
  try:
    got = np.asarray(tfspmd.shard_map(mapped, mesh=mesh, in_specs=P(names),
                                      out_specs=P(names))(x))
  except (ValueError, TypeError) as e:
    return "fails: " + _first_sentence(str(e))
  expected = np.concatenate([
      _high_rank_reference(name, fun, b, gradient)
      for b in x.reshape((N,) + block)], 0)
  if got.shape != expected.shape or not np.allclose(
      got, expected, rtol=2e-4, atol=2e-5):
    return "WRONG VALUES"
  return "works"


# Their gradients of rank-8 blocks fail while the program runs: DTensor
# moves a rank-11 value between layouts, with slices no kernel takes past
# rank 8. A failed program leaves the process's later ones failing too, so
# they are not run here (tests/test_known_defects.py runs one).
HIGH_RANK_GRADIENTS_THAT_FAIL_WHILE_THEY_RUN = frozenset({
    "tf.tanh", "tf.clip_by_value", "tf.maximum", "x[..., 1:]", "x[0]"})


@pytest.mark.parametrize("name", sorted(HIGH_RANK_OPS))
def test_ops_on_rank_7_and_8_blocks_of_a_three_axis_mesh(name):
  cases = [(7, False), (8, False)]
  if name not in HIGH_RANK_GRADIENTS_THAT_FAIL_WHILE_THEY_RUN:
    cases.append((8, True))
  outcomes = {(rank, gradient): _high_rank_outcome(name, rank, gradient)
              for rank, gradient in cases}
  assert set(outcomes.values()) == {"works"}, outcomes
