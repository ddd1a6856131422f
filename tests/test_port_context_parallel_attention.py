"""EasyDeL's context-parallel attention on a (dp, fsdp, tp, sp) mesh, from JAX.

The program is the default attention of EasyDeL (github.com/erfanzar/EasyDeL
at commit 34f22fff05d2399121107192f719d9a717ddff9c, "the default attention is
`local_ring` right now"):

* `ring_attention_standard` (lib/python/EasyDel/modules/_attentions/ring.py):
  a `jax.custom_vjp` whose forward pass runs a `lax.scan` over the devices of
  the sequence axis, each step attending the local queries to the key/value
  block it holds with an online softmax and passing that block on with
  `lax.ppermute`; the additive bias block is cut out with
  `lax.dynamic_slice_in_dim` at `(axis_index - step) % axis_size` times the
  block length. Its backward pass runs the ring again, passing the key and
  value blocks together with their gradient accumulators, which are home
  after the last step.
* `AttentionModule.local_ring_attention`
  (lib/python/EasyDel/modules/attention_module.py): the shard_map around it
  on the mesh ('dp', 'fsdp', 'tp', 'sp') with the module's default specs:
  queries, keys, values and the output `P(("dp", "fsdp"), "sp", "tp",
  None)` (batch over dp and fsdp together, sequence over sp, heads over tp),
  the bias `P(("dp", "fsdp"), None, "sp", None)`, `scale=1 / sm_scale` with
  `sm_scale = 1 / sqrt(head_dims)`, `float32_logits=True`,
  `check_rep=False`.

The bias arrives split over 'sp' along the query dimension, so each device's
bias block has exactly `q_len` query rows and the original's slice of the
query rows at offset `((axis_index - step) % axis_size) * q_len` is clamped
to 0 by `lax.dynamic_slice`, as JAX clamps every dynamic slice: the port
writes that slice as `tf.slice` at the same offset, which tfspmd clamps the
same way (docs/ops.md); the key slice is the block the device holds at that
step.

The port goes line by line: tf ops for jnp, `tfspmd.lax` for `jax.lax`,
`tf.custom_gradient` for `jax.custom_vjp` (the non-differentiable arguments
closed over), `tf.foldl` for each `lax.scan` that keeps no per-step output,
`tf.transpose` for einops' `rearrange(x, "b h q -> b q h")`. The gradient is
taken as EasyDeL's training takes it, around the attention (a
`tf.GradientTape` around the shard_map), and also inside the shard_map.
The JAX run that gave the numbers below ran the two EasyDeL functions
unchanged except `jax.experimental.shard_map.shard_map(check_rep=False)`,
gone from jax 0.10.2, spelled `jax.shard_map(check_vma=False)`. Sizes are
tiny: batch 2, 16 positions (4 per device on 'sp'), 2 heads of 8 features;
the bias is causal with the last 3 keys of batch row 1 padded away, in
EasyDeL's additive form (0 where seen, the float32 minimum elsewhere).
"""

import functools
import math

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax

B, L, H, D = 2, 16, 2, 8
PartitionSpec = P


def inputs():
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, L, H, D)).astype(np.float32)
             for _ in range(3))
  w = rng.standard_normal((B, L, H, D)).astype(np.float32)
  valid = np.ones((B, L), bool)
  valid[1, 13:] = False
  position = np.arange(L)
  seen = (position[:, None] >= position[None, :])[None] & valid[:, None, :]
  bias = np.where(seen, 0.0, np.finfo(np.float32).min).astype(
      np.float32)[:, None]  # B, 1, Q, K
  return q, k, v, bias, w


# JAX 0.10.2 printed these on 8 CPU devices (XLA_FLAGS=
# --xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu) for the program
# in the module docstring with the inputs above, the same on the meshes
# (1, 2, 1, 4), (2, 1, 1, 4) and (1, 1, 2, 4); the gradients of
# sum(out * w) with jax.grad around the shard_map and inside it agreed
# exactly.
JAX_OUT_SUM = 59.66242218017578
JAX_OUT_ABS = 225.63995361328125
JAX_LOSS = 22.425678253173828
JAX_DQ_SUM, JAX_DQ_ABS = 0.5835533142089844, 96.97129821777344
JAX_DK_ABS = 97.96461486816406  # sum(dk) is 0 up to rounding: not compared
JAX_DV_SUM, JAX_DV_ABS = -31.938369750976562, 175.70199584960938
JAX_DQ_W, JAX_DK_W, JAX_DV_W = (-4.857992172241211, 1.616598129272461,
                                102.8316421508789)  # sum(grad * w)
JAX_OUT_1_14_1 = [-0.18043504655361176, 0.08733630925416946,
                  0.3795449733734131, 0.4498837888240814,
                  0.22467783093452454, 0.30787932872772217,
                  -0.048146385699510574, 0.4139358401298523]
JAX_DK_1_12_0 = [0.0005822922685183585, -0.04091310873627663,
                 0.01198858767747879, -0.006260338705033064,
                 0.003032461041584611, 0.019458090886473656,
                 0.001505253603681922, 0.004054508171975613]


# ---------------------------------------------------------------------------
# The port of ring.py's ring_attention_standard.
# ---------------------------------------------------------------------------


def dynamic_slice_in_dim(operand, start_index, slice_size, axis=0):
  """`lax.dynamic_slice_in_dim`: a `tf.slice`, clamped into the array."""
  axis = axis % len(operand.shape)
  begin = [0] * len(operand.shape)
  begin[axis] = start_index
  size = [-1] * len(operand.shape)
  size[axis] = slice_size
  return tf.slice(operand, tf.stack(begin), size)


def scan(f, init, xs):
  """`lax.scan` of a body that emits no per-step output."""
  return tf.foldl(lambda carry, x: f(carry, x)[0], xs, initializer=init), None


def rearrange_bhq_bqh(x):
  """einops' `rearrange(x, "b h query_states -> b query_states h")`."""
  return tf.transpose(x, [0, 2, 1])


BACKWARD_CALLS = []


def _ring_attention_standard_fwd(query, key, value, attn_bias, scale,
                                 axis_name, float32_logits):
  if float32_logits:
    query, key = tf.cast(query, tf.float32), tf.cast(key, tf.float32)
  batch, q_len, num_heads, _ = query.shape
  batch, kv_len, num_heads, dim_per_head = key.shape
  numerator = tf.zeros((batch, q_len, num_heads, dim_per_head), query.dtype)
  denominator = tf.zeros((batch, num_heads, q_len), query.dtype)
  axis_size = lax.psum(1, axis_name)

  def scan_kv_block(carry, idx):
    p_max_score, _numerator, _denominator, _key, _value = carry
    bias = dynamic_slice_in_dim(
        dynamic_slice_in_dim(
            attn_bias,
            (lax.axis_index(axis_name) - idx) % axis_size * q_len, q_len,
            axis=-2),
        (lax.axis_index(axis_name) - idx) % axis_size * kv_len, kv_len,
        axis=-1)
    attn_weights = tf.einsum("bqhd,bkhd->bhqk", query, _key) / scale
    attn_weights = tf.add(bias, attn_weights)
    _max_score = tf.maximum(p_max_score,
                            tf.reduce_max(attn_weights, axis=-1))
    exp_weights = tf.exp(attn_weights - _max_score[..., None])
    correction = rearrange_bhq_bqh(
        tf.exp(p_max_score - _max_score))[..., None]
    _numerator = _numerator * correction + tf.einsum(
        "bhqk,bkhd->bqhd", exp_weights, _value)
    _denominator = (_denominator * tf.exp(p_max_score - _max_score) +
                    tf.reduce_sum(exp_weights, axis=-1))

    _key, _value = map(
        lambda x: lax.ppermute(
            x, axis_name,
            perm=[(i, (i + 1) % axis_size) for i in range(axis_size)]),
        (_key, _value))
    return (_max_score, _numerator, _denominator, _key, _value), None

  prev_max_score = tf.cast(tf.fill((batch, num_heads, q_len), -np.inf),
                           query.dtype)
  (max_score, numerator, denominator, _, _), _ = scan(
      scan_kv_block,
      init=(prev_max_score, numerator, denominator, key, value),
      xs=tf.range(0, axis_size))
  output = numerator / rearrange_bhq_bqh(denominator)[..., None]
  return tf.cast(output, value.dtype), (output, query, key, value, attn_bias,
                                        numerator, denominator, max_score)


def _ring_attention_standard_bwd(scale, axis_name, float32_logits, res, g):
  del float32_logits
  BACKWARD_CALLS.append(axis_name)
  axis_size = lax.psum(1, axis_name)
  (output, query, key, value, attn_bias, numerator, denominator,
   max_score) = res
  dq = tf.zeros_like(query, dtype=tf.float32)
  dk = tf.zeros_like(key, dtype=tf.float32)
  dv = tf.zeros_like(value, dtype=tf.float32)
  q_len = query.shape[1]
  batch, kv_len, num_heads, dim_per_head = key.shape

  def scan_kv_block(carry, idx):
    _dq, _dk, _dv, _key, _value = carry
    bias = dynamic_slice_in_dim(
        dynamic_slice_in_dim(
            attn_bias,
            (lax.axis_index(axis_name) - idx) % axis_size * q_len, q_len,
            axis=-2),
        (lax.axis_index(axis_name) - idx) % axis_size * kv_len, kv_len,
        axis=-1)
    attn_weights = tf.einsum("bqhd,bkhd->bhqk", query, _key) / scale
    attn_weights = tf.add(bias, attn_weights)
    exp_weights = (tf.exp(attn_weights - max_score[..., None]) /
                   denominator[..., None])
    ds = tf.einsum("bqhd,bkhd->bhqk", g, _value)
    dl = (ds - tf.einsum("bqhd,bqhd->bhq", g, output)[..., None]) * exp_weights
    _dq = _dq + tf.einsum("bhqk,bkhd->bqhd", dl, _key) / scale
    _dk = _dk + tf.einsum("bqhd,bhqk->bkhd", query, dl) / scale
    _dv = _dv + tf.einsum("bhqk,bqhd->bkhd", exp_weights, g)
    _key, _value, _dk, _dv = map(
        lambda x: lax.ppermute(
            x, axis_name,
            perm=[(i, (i + 1) % axis_size) for i in range(axis_size)]),
        (_key, _value, _dk, _dv))
    return (_dq, _dk, _dv, _key, _value), None

  (dq, dk, dv, key, value), _ = scan(
      scan_kv_block, init=(dq, dk, dv, key, value), xs=tf.range(0, axis_size))
  dq, dk, dv = (tf.cast(dq, query.dtype), tf.cast(dk, key.dtype),
                tf.cast(dv, value.dtype))
  return dq, dk, dv, None


def ring_attention_standard(query, key, value, attn_bias, scale, axis_name,
                            float32_logits=True):
  """`@partial(jax.custom_vjp, nondiff_argnums=[4, 5, 6])`, with
  `defvjp(_ring_attention_standard_fwd, _ring_attention_standard_bwd)`."""

  @tf.custom_gradient
  def with_ring_vjp(query, key, value, attn_bias):
    y, res = _ring_attention_standard_fwd(query, key, value, attn_bias, scale,
                                          axis_name, float32_logits)
    return y, lambda g: _ring_attention_standard_bwd(
        scale, axis_name, float32_logits, res, g)

  return with_ring_vjp(query, key, value, attn_bias)


# ---------------------------------------------------------------------------
# The port of AttentionModule.local_ring_attention with the default specs.
# ---------------------------------------------------------------------------

QUERY_PARTITION_SPEC = PartitionSpec(("dp", "fsdp"), "sp", "tp", None)
KEY_PARTITION_SPEC = PartitionSpec(("dp", "fsdp"), "sp", "tp", None)
VALUE_PARTITION_SPEC = PartitionSpec(("dp", "fsdp"), "sp", "tp", None)
BIAS_PARTITION_SPEC = PartitionSpec(("dp", "fsdp"), None, "sp", None)
ATTENTION_PARTITION_SPEC = PartitionSpec(("dp", "fsdp"), "sp", "tp", None)


class AttentionModule:
  """The parts of EasyDeL's AttentionModule that local_ring uses."""

  def __init__(self, mesh, head_dims, sm_scale=None, axis_name="sp"):
    if sm_scale is None:
      sm_scale = 1 / math.sqrt(head_dims)
    self.mesh = mesh
    self.sm_scale = sm_scale
    self.axis_name = axis_name

  def get_partition_specs(self, qs):
    del qs  # not generating: the query length is above 1
    return (QUERY_PARTITION_SPEC, KEY_PARTITION_SPEC, VALUE_PARTITION_SPEC,
            BIAS_PARTITION_SPEC, ATTENTION_PARTITION_SPEC, False)

  def local_ring_attention(
      self,
      *,  # it's Kwarg Only
      query_states,
      key_states,
      value_states,
      query_sequence_length,
      key_value_sequence_length,
      bias=None,
  ):
    del key_value_sequence_length  # unused, as in EasyDeL
    qps, kps, vps, bps, aps, _ = self.get_partition_specs(
        query_sequence_length)
    attention_outputs = tfspmd.shard_map(
        functools.partial(
            ring_attention_standard,
            axis_name=self.axis_name,
            scale=1 / self.sm_scale,
            float32_logits=True,
        ),
        mesh=self.mesh,
        in_specs=(qps, kps, vps, bps,),
        out_specs=aps,
        check_rep=False
    )(
        query_states, key_states, value_states, bias
    )
    return attention_outputs


def make_mesh(shape):
  return tfspmd.Mesh(np.array(tfspmd.devices()).reshape(shape),
                     ("dp", "fsdp", "tp", "sp"))


def attend(module, q, k, v, bias):
  return module.local_ring_attention(
      query_states=q, key_states=k, value_states=v,
      query_sequence_length=L, key_value_sequence_length=L, bias=bias)


# ---------------------------------------------------------------------------
# A NumPy reference: masked softmax attention and its gradients (float64).
# ---------------------------------------------------------------------------


def numpy_attention_and_grads(q, k, v, bias, w):
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
  seen = bias[:, 0] == 0  # B, Q, K
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
  s = np.where(seen[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", p, v)
  dp = np.einsum("bqhd,bkhd->bhqk", w, v)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  dq = np.einsum("bhqk,bkhd->bqhd", ds, k) / math.sqrt(D)
  dk = np.einsum("bhqk,bqhd->bkhd", ds, q) / math.sqrt(D)
  dv = np.einsum("bhqk,bqhd->bkhd", p, w)
  return out, (out * w).sum(), (dq, dk, dv)


def check_against_jax(out, loss, grads):
  w = inputs()[4]
  dq, dk, dv = grads
  np.testing.assert_allclose([out.sum(), np.abs(out).sum(), loss],
                             [JAX_OUT_SUM, JAX_OUT_ABS, JAX_LOSS], rtol=1e-4)
  np.testing.assert_allclose(out[1, 14, 1], JAX_OUT_1_14_1, rtol=1e-4,
                             atol=1e-6)
  np.testing.assert_allclose(
      [dq.sum(), np.abs(dq).sum(), np.abs(dk).sum(), dv.sum(),
       np.abs(dv).sum()],
      [JAX_DQ_SUM, JAX_DQ_ABS, JAX_DK_ABS, JAX_DV_SUM, JAX_DV_ABS], rtol=1e-4)
  np.testing.assert_allclose(
      [(dq * w).sum(), (dk * w).sum(), (dv * w).sum()],
      [JAX_DQ_W, JAX_DK_W, JAX_DV_W], rtol=1e-4)
  np.testing.assert_allclose(dk[1, 12, 0], JAX_DK_1_12_0, rtol=1e-4,
                             atol=1e-6)


def check_against_numpy(out, loss, grads):
  q, k, v, bias, w = inputs()
  want_out, want_loss, want_grads = numpy_attention_and_grads(q, k, v, bias, w)
  if out is not None:
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------

MESHES = [(1, 2, 1, 4), (2, 1, 1, 4), (1, 1, 2, 4)]


def test_numpy_reference_reproduces_jax_numbers():
  q, k, v, bias, w = inputs()
  out, loss, grads = numpy_attention_and_grads(q, k, v, bias, w)
  check_against_jax(out, loss, grads)


@pytest.mark.parametrize("mesh_shape", MESHES,
                         ids=lambda s: "x".join(map(str, s)))
def test_local_ring_attention_and_its_ring_gradient(mesh_shape):
  """Forward, and the gradient with a tape around the shard_map."""
  q, k, v, bias, w = inputs()
  module = AttentionModule(make_mesh(mesh_shape), head_dims=D)
  del BACKWARD_CALLS[:]
  qkv = [tf.Variable(x) for x in (q, k, v)]
  with tf.GradientTape() as tape:
    out = tf.convert_to_tensor(attend(module, *qkv, bias))
    loss = tf.reduce_sum(out * w)
  grads = [np.asarray(g) for g in tape.gradient(loss, qkv)]
  assert BACKWARD_CALLS, "the gradient did not come from the ported ring"
  out, loss = np.asarray(out), float(loss)
  check_against_jax(out, loss, grads)
  check_against_numpy(out, loss, grads)


def test_ring_gradient_taken_inside_the_shard_map():
  """`jax.grad` of each device's sum(out * w) inside the shard_map."""
  q, k, v, bias, w = inputs()
  module = AttentionModule(make_mesh((1, 2, 1, 4)), head_dims=D)
  del BACKWARD_CALLS[:]

  def block_grads(q, k, v, bias, w):
    with tf.GradientTape() as tape:
      tape.watch([q, k, v])
      out = ring_attention_standard(q, k, v, bias, 1 / module.sm_scale,
                                    "sp", True)
      loss = tf.reduce_sum(out * w)
    return tape.gradient(loss, [q, k, v])

  grads = tfspmd.shard_map(
      block_grads, mesh=module.mesh,
      in_specs=(QUERY_PARTITION_SPEC, KEY_PARTITION_SPEC, VALUE_PARTITION_SPEC,
                BIAS_PARTITION_SPEC, QUERY_PARTITION_SPEC),
      out_specs=[QUERY_PARTITION_SPEC, KEY_PARTITION_SPEC,
                 VALUE_PARTITION_SPEC],
      check_rep=False)(q, k, v, bias, w)
  assert BACKWARD_CALLS, "the gradient did not come from the ported ring"
  grads = [np.asarray(g) for g in grads]
  want_out, want_loss, _ = numpy_attention_and_grads(q, k, v, bias, w)
  check_against_jax(want_out, want_loss, grads)
  check_against_numpy(None, None, grads)
