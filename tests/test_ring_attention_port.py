"""Ring attention with its ring-pass gradient, ported from JAX, against JAX.

The program is `ring_attention` of the `ringattention` package
(github.com/haoliuhl/ringattention, ringattention/ringattention_jax.py at
commit 6305e2f): a `jax.custom_vjp` whose forward pass runs a `lax.scan`
over the devices of the sequence axis, each step attending the local
queries to the key/value block it holds (chunk by chunk, with an online
softmax, skipping the chunks above the causal diagonal by `lax.cond`) and
passing that block on by `lax.ppermute`; its backward pass runs the same
ring again, passing the key and value blocks together with their gradient
accumulators, which are home again after the last step.

The port keeps the original's structure line by line: tf ops for jnp,
`tfspmd.lax` for `jax.lax` (its `scan` and `cond` included, renamed only),
`tf.custom_gradient` for `jax.custom_vjp`. It ports
the path the package's README uses (`cache_idx=None`, `deterministic=True`,
so no dropout); `jax.checkpoint` around the chunk step is left out, as
nothing differentiates through the forward pass.
"""

import functools
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax

# 8 devices on the sequence axis, each holding a block of 4 positions cut
# into 2 chunks of 2; batch 1, 2 heads of 8 features.
N, BATCH, BLOCK, HEADS, DIM, CHUNK = 8, 1, 4, 2, 8, 2
LENGTH = N * BLOCK
SEGMENT_START = 13  # positions from here on are segment 1, before it 0


def ring_data():
  rng = np.random.default_rng(7)
  q, k, v = (rng.standard_normal((BATCH, LENGTH, HEADS, DIM)).astype(
      np.float32) for _ in range(3))
  bias = (0.5 * rng.standard_normal((BATCH, 1, 1, LENGTH))).astype(np.float32)
  segment_ids = (np.arange(LENGTH)[None] >= SEGMENT_START).astype(np.int32)
  loss_weights = rng.standard_normal((BATCH, LENGTH, HEADS, DIM)).astype(
      np.float32)
  return q, k, v, bias, segment_ids, loss_weights


def numpy_attention_and_grads(q, k, v, bias, segment_ids, loss_weights):
  """Causal attention within segments and the gradients of sum(out * w).

  The original joins the bias to the causal and segment masks with
  `minimum` against a zero bias, so where a key is seen a positive bias
  counts as 0: the reference adds min(bias, 0).
  """
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, loss_weights))
  position = np.arange(LENGTH)
  seen = ((position[:, None] >= position[None]) &
          (segment_ids[0][:, None] == segment_ids[0][None]))
  logits = (np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DIM) +
            np.minimum(bias, 0))
  logits = np.where(seen, logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", p, v)
  d_p = np.einsum("bqhd,bkhd->bhqk", w, v)
  d_logits = p * (d_p - np.sum(p * d_p, -1, keepdims=True))
  dq = np.einsum("bhqk,bkhd->bqhd", d_logits, k) / np.sqrt(DIM)
  dk = np.einsum("bhqk,bqhd->bkhd", d_logits, q) / np.sqrt(DIM)
  dv = np.einsum("bhqk,bqhd->bkhd", p, w)
  return out, np.sum(out * w), (dq, dk, dv)


# --- the port -----------------------------------------------------------------


def moveaxis_1_0(x):
  return tf.transpose(x, [1, 0] + list(range(2, x.shape.rank)))


def dynamic_slice(operand, start_indices, slice_sizes):
  return tf.slice(operand, tf.stack(start_indices), slice_sizes)


def _ring_attention_fwd(q, k, v, attn_bias, segment_ids, axis_name,
                        blockwise_kwargs):
  q, k = tf.cast(q, tf.float32), tf.cast(k, tf.float32)  # float32_logits
  batch, q_len, num_heads, dim_per_head = q.shape
  batch, kv_len, num_heads, dim_per_head = k.shape
  numerator = tf.zeros((batch, q_len, num_heads, dim_per_head), q.dtype)
  denominator = tf.zeros((batch, num_heads, q_len), q.dtype)
  axis_size = lax.psum(1, axis_name)
  q_block_size, kv_block_size = q_len, kv_len
  query_chunk_size = blockwise_kwargs["query_chunk_size"]
  key_chunk_size = blockwise_kwargs["key_chunk_size"]

  def scan_kv_block(carry, idx):
    prev_max_score, numerator, denominator, k, v = carry
    q_block_idx = lax.axis_index(axis_name)
    q_chunk_idx_start = q_block_idx * (q_block_size // query_chunk_size)
    k_block_idx = (lax.axis_index(axis_name) - idx) % axis_size
    k_chunk_idx_start = k_block_idx * (kv_block_size // key_chunk_size)
    numerator, denominator, max_score = _blockwise_attention_fwd(
        q, k, v, (numerator, denominator, prev_max_score),
        q_chunk_idx_start, k_chunk_idx_start, bias=attn_bias,
        segment_ids=segment_ids, **blockwise_kwargs)
    perm = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    k, v = (lax.ppermute(x, axis_name, perm=perm) for x in (k, v))
    return (max_score, numerator, denominator, k, v), None

  prev_max_score = tf.fill((batch, num_heads, q_len), -np.inf)
  (max_score, numerator, denominator, _, _), _ = lax.scan(
      scan_kv_block, (prev_max_score, numerator, denominator, k, v),
      tf.range(axis_size))
  output = numerator / tf.transpose(denominator, [0, 2, 1])[..., None]
  return tf.cast(output, v.dtype), (output, q, k, v, denominator, max_score)


def _ring_attention_bwd(attn_bias, segment_ids, axis_name, blockwise_kwargs,
                        res, g):
  output, q, k, v, denominator, max_score = res
  batch, q_len, num_heads, dim_per_head = q.shape
  batch, kv_len, num_heads, dim_per_head = k.shape
  axis_size = lax.psum(1, axis_name)
  dq, dk, dv = tf.zeros_like(q), tf.zeros_like(k), tf.zeros_like(v)
  query_chunk_size = blockwise_kwargs["query_chunk_size"]
  key_chunk_size = blockwise_kwargs["key_chunk_size"]
  q_block_size, kv_block_size = q_len, kv_len

  def scan_kv_block(carry, idx):
    dq, dk, dv, k, v = carry
    q_block_idx = lax.axis_index(axis_name)
    q_chunk_idx_start = q_block_idx * (q_block_size // query_chunk_size)
    k_block_idx = (lax.axis_index(axis_name) - idx) % axis_size
    k_chunk_idx_start = k_block_idx * (kv_block_size // key_chunk_size)
    dq, dk, dv = _blockwise_attention_bwd(
        q, k, v, g, (dq, dk, dv, output, denominator, max_score),
        q_chunk_idx_start, k_chunk_idx_start, bias=attn_bias,
        segment_ids=segment_ids, **blockwise_kwargs)
    perm = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    k, v, dk, dv = (lax.ppermute(x, axis_name, perm=perm)
                    for x in (k, v, dk, dv))
    return (dq, dk, dv, k, v), None

  (dq, dk, dv, k, v), _ = lax.scan(scan_kv_block, (dq, dk, dv, k, v),
                                   tf.range(axis_size))
  return dq, dk, dv


def ring_attention(q, k, v, attn_bias, segment_ids, axis_name,
                   blockwise_kwargs):
  """`ring_attention`: `jax.custom_vjp` with the bias and segments fixed."""

  @tf.custom_gradient
  def attention(q, k, v):
    output, res = _ring_attention_fwd(q, k, v, attn_bias, segment_ids,
                                      axis_name, blockwise_kwargs)

    def backward(g):
      return _ring_attention_bwd(attn_bias, segment_ids, axis_name,
                                 blockwise_kwargs, res, g)

    return output, backward

  return attention(q, k, v)


def _blockwise_attention_fwd(q, k, v, carry, q_chunk_idx_start,
                             k_chunk_idx_start, bias, segment_ids,
                             causal_block_size, query_chunk_size,
                             key_chunk_size, dtype):
  batch, q_len, num_heads, dim_per_head = q.shape
  batch, kv_len, num_heads, dim_per_head = k.shape
  num_q = q_len // query_chunk_size
  num_kv = kv_len // key_chunk_size
  q = tf.reshape(q, (batch, num_q, query_chunk_size, num_heads, dim_per_head))
  k = tf.reshape(k, (batch, num_kv, key_chunk_size, num_heads, dim_per_head))
  v = tf.reshape(v, (batch, num_kv, key_chunk_size, num_heads, dim_per_head))
  q, k, v = map(moveaxis_1_0, (q, k, v))

  numerator, denominator, max_score = carry
  numerator = moveaxis_1_0(tf.reshape(
      numerator, (batch, num_q, query_chunk_size, num_heads, dim_per_head)))
  # 'b h n c -> n b h c'
  denominator, max_score = (
      tf.transpose(tf.reshape(x, (batch, num_heads, num_q, query_chunk_size)),
                   [2, 0, 1, 3]) for x in (denominator, max_score))

  scale = np.sqrt(q.shape[-1]).astype(np.float32)
  _chunk_bias_fn = functools.partial(
      _chunk_attention_bias, query_chunk_size, key_chunk_size, bias,
      segment_ids, causal_block_size, dtype)

  def scan_attention(_, scan_args):
    (q_chunk, numerator_chunk, denominator_chunk, max_score_chunk,
     q_chunk_idx) = scan_args

    def scan_kv_block(carry, scan_args):
      k_chunk, value_chunk, k_chunk_idx = scan_args
      numerator_chunk, denominator_chunk, prev_max_score_chunk = carry
      attn_weights = tf.einsum("bqhd,bkhd->bhqk", q_chunk, k_chunk) / scale
      bias_chunk = _chunk_bias_fn(q_chunk_idx_start + q_chunk_idx,
                                  k_chunk_idx_start + k_chunk_idx)
      attn_weights = attn_weights + bias_chunk

      max_score_chunk = tf.maximum(prev_max_score_chunk,
                                   tf.reduce_max(attn_weights, axis=-1))
      max_score_chunk = tf.stop_gradient(max_score_chunk)
      exp_weights = tf.exp(attn_weights - max_score_chunk[..., None])
      exp_values = tf.einsum("bhqk,bkhd->bqhd", exp_weights, value_chunk)
      correction = tf.transpose(
          tf.exp(prev_max_score_chunk - max_score_chunk), [0, 2, 1])[..., None]
      numerator_chunk = numerator_chunk * correction + exp_values
      denominator_chunk = (
          denominator_chunk * tf.exp(prev_max_score_chunk - max_score_chunk) +
          tf.reduce_sum(exp_weights, axis=-1))
      return (numerator_chunk, denominator_chunk, max_score_chunk), None

    def skip_upper_half(carry, args):
      _, _, k_chunk_idx = args
      should_run = tf.constant(True)
      if causal_block_size is not None:
        should_run = below_or_on_diag(
            q_chunk_idx_start + q_chunk_idx, query_chunk_size,
            k_chunk_idx_start + k_chunk_idx, key_chunk_size,
            causal_block_size)
      return lax.cond(should_run, scan_kv_block,
                      lambda carry, args: (carry, None), carry, args)

    (numerator_chunk, denominator_chunk, max_score_chunk), _ = lax.scan(
        skip_upper_half, (numerator_chunk, denominator_chunk, max_score_chunk),
        (k, v, tf.range(num_kv)))
    output_chunk = numerator_chunk / tf.cast(
        tf.transpose(denominator_chunk, [0, 2, 1])[..., None], dtype)
    return (), (output_chunk, numerator_chunk, denominator_chunk,
                max_score_chunk)

  _, (_, numerator, denominator, max_score) = lax.scan(
      scan_attention, (),
      (q, numerator, denominator, max_score, tf.range(num_q)))

  numerator = tf.reshape(moveaxis_1_0(numerator),
                         (batch, q_len, num_heads, dim_per_head))
  # 'n b h c -> b h n c'
  denominator, max_score = (
      tf.reshape(tf.transpose(x, [1, 2, 0, 3]), (batch, num_heads, q_len))
      for x in (denominator, max_score))
  return numerator, denominator, max_score


def _blockwise_attention_bwd(q, k, v, g, carry, q_chunk_idx_start,
                             k_chunk_idx_start, bias, segment_ids,
                             causal_block_size, query_chunk_size,
                             key_chunk_size, dtype):
  batch, q_len, num_heads, dim_per_head = q.shape
  batch, kv_len, num_heads, dim_per_head = k.shape
  num_q = q_len // query_chunk_size
  num_kv = kv_len // key_chunk_size
  dq, dk, dv, output, denominator, max_score = carry

  def q_chunks(x):
    return moveaxis_1_0(tf.reshape(
        x, (batch, num_q, query_chunk_size, num_heads, dim_per_head)))

  def kv_chunks(x):
    return moveaxis_1_0(tf.reshape(
        x, (batch, num_kv, key_chunk_size, num_heads, dim_per_head)))

  g, dq, output = map(q_chunks, (g, dq, output))
  dk, dv = map(kv_chunks, (dk, dv))
  denominator, max_score = (
      tf.transpose(tf.reshape(x, (batch, num_heads, num_q, query_chunk_size)),
                   [2, 0, 1, 3]) for x in (denominator, max_score))
  q = q_chunks(q)
  k, v = map(kv_chunks, (k, v))

  scale = np.sqrt(q.shape[-1]).astype(np.float32)
  _chunk_bias_fn = functools.partial(
      _chunk_attention_bias, query_chunk_size, key_chunk_size, bias,
      segment_ids, causal_block_size, dtype)

  def scan_attention(carry, scan_args):
    dk, dv = carry
    (q_chunk, dq_chunk, g_chunk, output_chunk, denominator_chunk,
     max_score_chunk, q_chunk_idx) = scan_args
    dl_part = tf.einsum("bqhd,bqhd->bhq", g_chunk, output_chunk)[..., None]

    def scan_kv_block(carry, scan_args):
      k_chunk, value_chunk, k_chunk_idx = scan_args
      dq_chunk = carry
      attn_weights = tf.einsum("bqhd,bkhd->bhqk", q_chunk, k_chunk) / scale
      bias_chunk = _chunk_bias_fn(q_chunk_idx_start + q_chunk_idx,
                                  k_chunk_idx_start + k_chunk_idx)
      attn_weights = attn_weights + bias_chunk
      exp_weights = (tf.exp(attn_weights - max_score_chunk[..., None]) /
                     denominator_chunk[..., None])

      ds = tf.einsum("bqhd,bkhd->bhqk", g_chunk, value_chunk)
      dl = (ds - dl_part) * exp_weights
      dq_chunk = dq_chunk + tf.einsum("bhqk,bkhd->bqhd", dl, k_chunk) / scale
      dk_chunk = tf.einsum("bqhd,bhqk->bkhd", q_chunk, dl) / scale
      dv_chunk = tf.einsum("bhqk,bqhd->bkhd", exp_weights, g_chunk)
      return dq_chunk, (dk_chunk, dv_chunk)

    def skip_upper_half(carry, args):
      _, _, k_chunk_idx = args
      should_run = tf.constant(True)
      if causal_block_size is not None:
        should_run = below_or_on_diag(
            q_chunk_idx_start + q_chunk_idx, query_chunk_size,
            k_chunk_idx_start + k_chunk_idx, key_chunk_size,
            causal_block_size)
      return lax.cond(
          should_run, scan_kv_block,
          lambda carry, args: (carry, (
              tf.zeros((batch, key_chunk_size, num_heads, dim_per_head),
                       dk.dtype),
              tf.zeros((batch, key_chunk_size, num_heads, dim_per_head),
                       dk.dtype))),
          carry, args)

    dq_chunk, (dk_part, dv_part) = lax.scan(skip_upper_half, dq_chunk,
                                            (k, v, tf.range(num_kv)))
    return (dk + dk_part, dv + dv_part), dq_chunk

  (dk, dv), dq = lax.scan(
      scan_attention, (dk, dv),
      (q, dq, g, output, denominator, max_score, tf.range(num_q)))

  dq, dk, dv = map(moveaxis_1_0, (dq, dk, dv))
  dq = tf.reshape(dq, (batch, q_len, num_heads, dim_per_head))
  dk = tf.reshape(dk, (batch, kv_len, num_heads, dim_per_head))
  dv = tf.reshape(dv, (batch, kv_len, num_heads, dim_per_head))
  return dq, dk, dv


def _chunk_attention_bias(query_chunk_size, key_chunk_size, bias, segment_ids,
                          causal_block_size, dtype, query_chunk_idx,
                          key_chunk_idx):
  query_offset = query_chunk_idx * query_chunk_size
  key_offset = key_chunk_idx * key_chunk_size
  chunk_bias = tf.zeros((1, 1, 1, 1), dtype)
  if bias is not None:
    chunk_bias = dynamic_slice(
        bias, (0, 0, 0, key_offset),
        (*bias.shape[:2], min(bias.shape[-2], query_chunk_size),
         min(bias.shape[-1], key_chunk_size)))

  if segment_ids is not None:
    q_segment_ids = dynamic_slice(segment_ids, (0, query_offset),
                                  (segment_ids.shape[0], query_chunk_size))
    k_segment_ids = dynamic_slice(segment_ids, (0, key_offset),
                                  (segment_ids.shape[0], key_chunk_size))
    segment_ids_mask = tf.not_equal(q_segment_ids[:, :, None],
                                    k_segment_ids[:, None, :])
    segment_ids_mask = segment_ids_mask[:, None]  # B1QK
    segment_ids_bias = tf.cast(segment_ids_mask, dtype) * dtype.min
    chunk_bias = tf.minimum(chunk_bias, segment_ids_bias)

  if causal_block_size is not None:
    query_idx = tf.range(query_chunk_size)[:, None] + query_offset
    key_idx = tf.range(key_chunk_size)[None, :] + key_offset
    query_idx //= causal_block_size
    key_idx //= causal_block_size
    causal_mask_value = tf.cast(query_idx < key_idx, dtype) * dtype.min
    chunk_bias = tf.minimum(
        chunk_bias, tf.reshape(causal_mask_value,
                               (1, 1, query_chunk_size, key_chunk_size)))
  return tf.cast(chunk_bias, dtype)


def below_or_on_diag(r, r_blk_size, c, c_blk_size, causal_block_size):
  # A block is below or on the diagonal when its bottom left corner is.
  causal_block_size_q = max(causal_block_size, r_blk_size)
  causal_block_size_k = max(causal_block_size, c_blk_size)
  r = r // (causal_block_size_q // r_blk_size)
  c = c // (causal_block_size_k // c_blk_size)
  return ((r + 1) * causal_block_size_q - 1) > (c * causal_block_size_k)


# --- the tests ----------------------------------------------------------------

BLOCKWISE_KWARGS = dict(causal_block_size=1, query_chunk_size=CHUNK,
                        key_chunk_size=CHUNK, dtype=tf.float32)


def sharded_ring_attention():
  """The README's shard_map of `ring_attention` over a mesh axis 'sp'."""
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()), ("sp",))
  return tfspmd.shard_map(
      functools.partial(ring_attention, axis_name="sp",
                        blockwise_kwargs=BLOCKWISE_KWARGS),
      mesh=mesh,
      in_specs=(P(None, "sp", None, None),) * 3 + (P(None, None, None, None),
                                                   P(None, None)),
      out_specs=P(None, "sp", None, None))


def test_numpy_reference_reproduces_jax_numbers():
  # JAX 0.10.2 printed, on 8 CPU devices (jax.shard_map, check_vma=False,
  # jax.value_and_grad of sum(out * w) under jax.jit): out sum
  # 15.211339950561523, sum |out| 213.69879150390625, loss
  # 5.159573554992676; dq sum -6.168609619140625, sum |dq|
  # 104.89450073242188; dk sum 4.76837158203125e-07 (0 up to rounding: the
  # rows of softmax's gradient sum to 0), sum |dk| 92.87477111816406; dv sum
  # -17.312496185302734, sum |dv| 141.49679565429688.
  q, k, v, bias, segment_ids, w = ring_data()
  out, loss, (dq, dk, dv) = numpy_attention_and_grads(q, k, v, bias,
                                                      segment_ids, w)
  np.testing.assert_allclose([out.sum(), np.abs(out).sum(), loss],
                             [15.211339950561523, 213.69879150390625,
                              5.159573554992676], rtol=1e-6)
  np.testing.assert_allclose(
      [dq.sum(), np.abs(dq).sum(), np.abs(dk).sum(), dv.sum(),
       np.abs(dv).sum()],
      [-6.168609619140625, 104.89450073242188, 92.87477111816406,
       -17.312496185302734, 141.49679565429688], rtol=1e-6)
  assert abs(dk.sum()) < 1e-12


def backward_calls(monkeypatch):
  """Records each run of the ported backward pass `_ring_attention_bwd`."""
  calls = []
  ported = _ring_attention_bwd

  def recorded(*args):
    calls.append(args)
    return ported(*args)

  monkeypatch.setattr(sys.modules[__name__], "_ring_attention_bwd", recorded)
  return calls


def test_ring_attention_output_and_ring_pass_gradient(monkeypatch):
  """The forward ring and, under a tape, the custom backward ring."""
  calls = backward_calls(monkeypatch)
  q, k, v, bias, segment_ids, w = ring_data()
  attention = sharded_ring_attention()
  qkv = [tf.Variable(x) for x in (q, k, v)]
  with tf.GradientTape() as tape:
    out = tf.convert_to_tensor(attention(*qkv, bias, segment_ids))
    loss = tf.reduce_sum(out * w)
  grads = [np.asarray(g) for g in tape.gradient(loss, qkv)]
  out = np.asarray(out)
  assert calls, "the gradient did not come from the ported backward ring"

  want_out, want_loss, want_grads = numpy_attention_and_grads(
      q, k, v, bias, segment_ids, w)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  # The checksums JAX printed (see the test above).
  np.testing.assert_allclose(
      [out.sum(), np.abs(out).sum(), float(loss)],
      [15.211339950561523, 213.69879150390625, 5.159573554992676], rtol=1e-5)
  np.testing.assert_allclose(
      [grads[0].sum(), np.abs(grads[0]).sum(), np.abs(grads[1]).sum(),
       grads[2].sum(), np.abs(grads[2]).sum()],
      [-6.168609619140625, 104.89450073242188, 92.87477111816406,
       -17.312496185302734, 141.49679565429688], rtol=1e-5)


@pytest.mark.parametrize("loss_over", ["block", "psum"])
def test_ring_pass_gradient_taken_inside_the_shard_map(monkeypatch, loss_over):
  """`jax.grad` inside the shard_map, of each device's own loss or of its psum.

  The backward ring already brings every device's share of dk and dv home,
  so the gradient of a device's own loss is the whole gradient. The
  transpose of psum is psum (JAX's pmap semantics, and shard_map's with
  check_vma=False), so the gradient of the psum is 8 times that: JAX
  printed dq sum -49.348876953125, sum |dq| 839.156005859375, sum |dk|
  742.9981689453125, dv sum -138.49996948242188, sum |dv| 1131.974365234375
  for it, and the numbers of the tests above for the device's own loss.
  """
  calls = backward_calls(monkeypatch)
  q, k, v, bias, segment_ids, w = ring_data()
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()), ("sp",))

  def block_gradient(q, k, v, bias, segment_ids, w):
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      out = ring_attention(q, k, v, bias, segment_ids, "sp", BLOCKWISE_KWARGS)
      loss = tf.reduce_sum(out * w)
      if loss_over == "psum":
        loss = lax.psum(loss, "sp")
    return tape.gradient(loss, [q, k, v])

  blocks = P(None, "sp", None, None)
  grads = tfspmd.shard_map(
      block_gradient, mesh=mesh,
      in_specs=(blocks,) * 3 + (P(None, None, None, None), P(None, None),
                                blocks),
      out_specs=[blocks] * 3)(q, k, v, bias, segment_ids, w)
  grads = [np.asarray(g) for g in grads]
  assert calls, "the gradient did not come from the ported backward ring"

  scale = 8 if loss_over == "psum" else 1
  _, _, want_grads = numpy_attention_and_grads(q, k, v, bias, segment_ids, w)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, scale * want, rtol=1e-4, atol=1e-5)
  jax_sums = {
      "block": [-6.168609619140625, 104.89450073242188, 92.87477111816406,
                -17.312496185302734, 141.49679565429688],
      "psum": [-49.348876953125, 839.156005859375, 742.9981689453125,
               -138.49996948242188, 1131.974365234375],
  }[loss_over]
  np.testing.assert_allclose(
      [grads[0].sum(), np.abs(grads[0]).sum(), np.abs(grads[1]).sum(),
       grads[2].sum(), np.abs(grads[2]).sum()], jax_sums, rtol=1e-5)


def test_ring_attention_on_a_four_axis_mesh_of_an_llm_codebase(monkeypatch):
  """The same program on a (1, 2, 1, 4) mesh named as LLM codebases name it.

  Heads split over 'tp', the sequence over 'sp' (4 blocks of 8 positions),
  the batch of one the same on 'dp' and 'fsdp'. Each of the four mesh axes
  adds a dimension to every tensor of the vectorized program; the ring's
  blocks reach rank 9 in its gradient, past TensorFlow's rank-8 kernels,
  unless the slices and broadcasts run on merged dimensions.
  """
  calls = backward_calls(monkeypatch)
  q, k, v, bias, segment_ids, w = ring_data()
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(1, 2, 1, 4),
                     ("dp", "fsdp", "tp", "sp"))
  blocks = P(None, "sp", "tp", None)
  attention = tfspmd.shard_map(
      functools.partial(ring_attention, axis_name="sp",
                        blockwise_kwargs=BLOCKWISE_KWARGS),
      mesh=mesh,
      in_specs=(blocks,) * 3 + (P(None, None, None, None), P(None, None)),
      out_specs=blocks)
  qkv = [tf.Variable(x) for x in (q, k, v)]
  with tf.GradientTape() as tape:
    out = tf.convert_to_tensor(attention(*qkv, bias, segment_ids))
    loss = tf.reduce_sum(out * w)
  grads = [np.asarray(g) for g in tape.gradient(loss, qkv)]
  assert calls, "the gradient did not come from the ported backward ring"
  want_out, want_loss, want_grads = numpy_attention_and_grads(
      q, k, v, bias, segment_ids, w)
  np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  # The sums JAX printed for this program on 8 devices of one axis: the
  # mesh changes how the work is split, not the numbers.
  np.testing.assert_allclose(
      [np.asarray(out).sum(), float(loss), grads[0].sum(), grads[2].sum()],
      [15.211339950561523, 5.159573554992676, -6.168609619140625,
       -17.312496185302734], rtol=1e-4)


def test_ring_pass_gradient_inside_a_shard_map_on_a_four_axis_mesh(
    monkeypatch):
  """`jax.grad` inside the shard_map, on the (1, 2, 1, 4) mesh."""
  calls = backward_calls(monkeypatch)
  q, k, v, bias, segment_ids, w = ring_data()
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(1, 2, 1, 4),
                     ("dp", "fsdp", "tp", "sp"))

  def block_gradient(q, k, v, bias, segment_ids, w):
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      out = ring_attention(q, k, v, bias, segment_ids, "sp", BLOCKWISE_KWARGS)
      loss = tf.reduce_sum(out * w)
    return tape.gradient(loss, [q, k, v])

  blocks = P(None, "sp", "tp", None)
  grads = tfspmd.shard_map(
      block_gradient, mesh=mesh,
      in_specs=(blocks,) * 3 + (P(None, None, None, None), P(None, None),
                                blocks),
      out_specs=[blocks] * 3)(q, k, v, bias, segment_ids, w)
  assert calls, "the gradient did not come from the ported backward ring"
  _, _, want_grads = numpy_attention_and_grads(q, k, v, bias, segment_ids, w)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
