"""seqax's transformer training step, ported from JAX, on a 4-axis mesh.

The program is the training step of seqax, MatX's LLM training codebase
(github.com/MatX-inc/seqax at commit 42cf9af49cbbd994b00f6788bf7785174072c55b):
`train.py`'s `Model.forward_pass` (token embedding from a vocab-sharded
table, then a `lax.scan` over layers of RMSNorm, grouped-query attention
with RoPE and a causal mask within packed sequences, RMSNorm and a SwiGLU
MLP), `Model.loss` (cross entropy over a vocab-sharded softmax) and
`training_step` (`jax.value_and_grad` inside one `shard_map`, global-norm
gradient clipping, AdamW with warmup and cosine decay), with the helpers
it calls from `shardlib/shardops.py` (string-specified `all_gather`,
`psum_scatter`, `einsum_unreduced` and the vmapped `index_unreduced`),
`shardlib/shardtypes.py` (partition specs from type annotations,
`typed_shard_map`) and `jax_extra.py`. Every weight is fully sharded
(FSDP over seqax's axis `d`, tensor parallel over `t`: heads, d_ff and
vocab; the residual stream between blocks is reduce-scattered over `t`),
and the gradient of each weight `all_gather` is the `psum_scatter` that
reduces it, so the update needs no other communication.

The port keeps the original's structure line by line: tf ops for jnp,
`tfspmd.lax` for `jax.lax`, `tfspmd.vmap` for `jax.vmap` (in
`index_unreduced`), `tf.GradientTape` for `jax.value_and_grad`,
`tf.scan` for the `lax.scan` over layers and `tfspmd.shard_map` (with the
original's `check_rep=False`) under `tfspmd.set_mesh` for the mesh context.
What differs:
  * the mesh is (1, 2, 1, 4) with axes ('dp', 'fsdp', 'tp', 'sp'): seqax's
    data/FSDP axis `d` is ('dp', 'fsdp') and its tensor axis `t` (heads,
    d_ff, vocab, the residual stream, the loss's token split) is
    ('tp', 'sp'), in every shape string ('B/d' -> 'B/dp/fsdp', 'M/t/d' ->
    'M/tp/sp/dp/fsdp') and collective; the JAX run used the same renaming
    (and gave bit-for-bit the numbers of the original names on a (2, 4)
    ('d', 't') mesh);
  * the original's bfloat16 casts are float32 (in the JAX run as well), so
    that the two agree to float32 rounding;
  * shardtypes' shape checks (`check`, typeguard's `typechecked`) are left
    out, `explicit_activation_checkpointing`/`save_for_backward` (memory
    only) are the identity, and a `pytree_dataclass` is also a tf.nest
    structure so that `tf.scan` takes it;
  * `jax.jit(static_argnums=(2, 3))` is an lru_cache of the shard_mapped
    step per (Hparams, TrainingHparams); uint32 indices are cast to int32
    where TensorFlow does not promote; `Model.init`'s jax.random draws are
    NumPy draws of the same shapes and scales.
The original's quirk is kept: `final_layer_norm` is laid out 'd_model/d/t'
but gathered as 'M/t/d', so the norm applied is a fixed permutation of the
stored vector (the NumPy reference applies it too).

JAX 0.10.2 printed the expected numbers on 8 CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8) for the inputs of
`numpy_inputs`, running the original source text with the substitutions
above; the NumPy reference below (float64, the same math written out)
reproduces them.
"""

import dataclasses
from dataclasses import dataclass, make_dataclass
import functools
from functools import partial
import inspect
import math
import typing
from types import GenericAlias
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax
from tfspmd.tree_util import tree_leaves

MESH_SHAPE, MESH_AXES = (1, 2, 1, 4), ("dp", "fsdp", "tp", "sp")

# ---------------------------------------------------------------------------
# shardlib/shardtypes.py (the partition-spec half; the shape checks read
# JAX's trace state and are left out).


@dataclass(frozen=True)
class DimSpec:
  """Parsed result of a dimension in a shape string."""
  shape: str
  sharding: Sequence[str]

  @staticmethod
  def parse(spec: str) -> "DimSpec":
    pieces = spec.split("/")
    shape = pieces[0]
    sharding = tuple(pieces[1:])
    return DimSpec(shape, sharding)

  def __str__(self):
    return "/".join([self.shape] + list(self.sharding))


@dataclass
class ShapeSpec:
  """Parsed result of a shape string."""
  dims: Sequence[DimSpec]

  @staticmethod
  def parse(spec: Union[bytes, str]) -> "ShapeSpec":
    if isinstance(spec, bytes):
      spec = spec.decode("utf-8")
    if not isinstance(spec, str):
      raise ValueError("Expected a string")
    dims = spec.split()  # Split on spaces, trimming excess space
    result = []
    for dim in dims:
      result.append(DimSpec.parse(dim))
    return ShapeSpec(result)

  def partition_spec(self) -> tfspmd.P:
    result = []
    for dim_spec in self.dims:
      if len(dim_spec.sharding) == 0:
        result.append(None)
      elif len(dim_spec.sharding) == 1:
        result.append(dim_spec.sharding[0])
      else:
        result.append(tuple(dim_spec.sharding))
    return tfspmd.P(*result)

  def __str__(self):
    return " ".join(str(dim) for dim in self.dims)


class number:
  def __class_getitem__(cls, x):
    if isinstance(x, str):
      x = x.encode("utf-8")
    return GenericAlias(cls, x)


class bool_(number):
  dtype = tf.bool


class f32(number):
  dtype = tf.float32


class u32(number):
  dtype = tf.uint32


def pytree_dataclass(cls):
  """Declares a dataclass that tfspmd (and tf.nest, for tf.scan) see as a pytree."""
  cls = dataclass(cls)
  tfspmd.tree_util.register_dataclass(cls)
  cls.__tf_flatten__ = lambda self: ((), tuple(
      getattr(self, k.name) for k in dataclasses.fields(cls)))
  cls.__tf_unflatten__ = classmethod(lambda c, _, fields: c(*fields))
  return cls


class Array:
  """`Array[axes, cls]` extends `cls` with leading axes `axes`."""

  def __class_getitem__(cls, x):
    axes, input_cls = x
    if isinstance(axes, str):
      axes = axes.encode("utf-8")
    elif isinstance(axes, bytes):
      pass
    else:
      raise ValueError(f"input axes to {cls} must be Union[bytes, str]")

    if dataclasses.is_dataclass(input_cls):
      extended_fields = []
      for fld in dataclasses.fields(input_cls):
        extended_type = Array[axes, fld.type]
        extended_fields.append((fld.name, extended_type))

      extended_cls = make_dataclass(input_cls.__name__, extended_fields,
                                    bases=(input_cls,))
      pytree_dataclass(extended_cls)
      return extended_cls
    else:
      number_type, shape = typing.get_origin(input_cls), typing.get_args(input_cls)
      extended_shape = (axes + b" " + shape[0],)
      return GenericAlias(number_type, extended_shape)


def make_partition_specs(cls):
  """Instantiates a pytree dataclass with a PartitionSpec at array type."""
  origin = typing.get_origin(cls)
  args = typing.get_args(cls)
  if origin is tuple:
    return tuple(make_partition_specs(arg) for arg in args)
  elif origin is not None and issubclass(origin, number):
    if len(args) != 1 or (type(args[0]) is not str and type(args[0]) is not bytes):
      raise ValueError(f"Type annotation {cls} should be <dtype>[<shape string>], got {cls}")
    spec = ShapeSpec.parse(args[0])
    return spec.partition_spec()
  elif dataclasses.is_dataclass(cls):
    values = []
    for field in dataclasses.fields(cls):
      values.append(make_partition_specs(field.type))
    return cls(*values)

  raise ValueError(f"Unsupported type {cls} is not a array, dataclass, or tuple type")


def typed_shard_map(f, **kwargs):
  """shard_map, with in_specs and out_specs read from f's annotations."""
  sig = inspect.signature(f)

  def wrapped(*args):
    mesh = tfspmd.sharding.get_mesh()
    in_specs = tuple(make_partition_specs(param.annotation)
                     for param in sig.parameters.values())
    out_specs = make_partition_specs(sig.return_annotation)
    return tfspmd.shard_map(f, in_specs=in_specs, out_specs=out_specs,
                            mesh=mesh, **kwargs)(*args)

  return wrapped


def is_fully_sharded(spec: tfspmd.P):
  """True if every device axis is used in the partition spec."""
  axis_count = 0
  for axis in spec:
    if axis is None:
      continue
    elif isinstance(axis, str):
      axis_count += 1
    elif isinstance(axis, tuple):
      axis_count += len(axis)
    else:
      raise ValueError(f"Unknown axis type {axis}")
  return axis_count == len(tfspmd.sharding.get_mesh().axis_names)


# ---------------------------------------------------------------------------
# shardlib/shardops.py


def all_gather(spec: str, x):
  """String-specified all-gather operation, e.g. 'A/x/y B/z C/w -> A B C/w'."""
  before, after = spec.split("->")
  before = ShapeSpec.parse(before)
  after = ShapeSpec.parse(after)
  for i, (before_dim, after_dim) in enumerate(zip(before.dims, after.dims)):
    # Check that after_dim.sharding is a prefix of before_dim.sharding
    after_n = len(after_dim.sharding)
    if (before_dim.shape != after_dim.shape or
        before_dim.sharding[:after_n] != after_dim.sharding):
      raise ValueError(f"Cannot all-gather {before_dim} into {after_dim}")
    if len(before_dim.sharding) == after_n:
      continue
    x = lax.all_gather(x, tuple(before_dim.sharding[after_n:]), axis=i, tiled=True)
  return x


def psum_scatter(spec: str, x):
  """String-specified reduce-scatter operation, e.g. 'A B C/w -> A/x/y B/z C/w'."""
  before, after = spec.split("->")
  before = ShapeSpec.parse(before)
  after = ShapeSpec.parse(after)
  for i, (before_dim, after_dim) in enumerate(zip(before.dims, after.dims)):
    # Check that before_dim.sharding is a prefix of after_dim.sharding
    before_n = len(before_dim.sharding)
    if (before_dim.shape != after_dim.shape or
        after_dim.sharding[:before_n] != before_dim.sharding):
      raise ValueError(f"Cannot reduce-scatter {before_dim} into {after_dim}")
    if len(after_dim.sharding) == before_n:
      continue
    x = lax.psum_scatter(x, tuple(after_dim.sharding[before_n:]),
                         scatter_dimension=i, tiled=True)
  return x


def einsum_unreduced(spec: str, x, y, **kwargs):
  """Ordinary chip-local einsum; the caller reduces over sharded contractions."""
  del kwargs  # preferred_element_type=float32: everything is float32 here
  tmp, result = spec.split("->")
  lhs, rhs = tmp.split(",")
  lhs = ShapeSpec.parse(lhs)
  rhs = ShapeSpec.parse(rhs)
  result = ShapeSpec.parse(result)
  # Convert to einsum syntax, with single-letter variables.
  jaxspec = ""

  variables = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
  var_i = 0
  dim_table = {}

  def map_var(dim):
    if dim in dim_table:
      return dim_table[dim]
    nonlocal var_i
    if var_i >= len(variables):
      raise ValueError("Too many dimensions in einsum, we ran out of variables")
    var = variables[var_i]
    var_i += 1
    dim_table[dim] = var
    return var

  for dim in lhs.dims:
    jaxspec += map_var(dim)
  jaxspec += ","
  for dim in rhs.dims:
    jaxspec += map_var(dim)
  jaxspec += "->"
  for dim in result.dims:
    jaxspec += map_var(dim)
  return tf.einsum(jaxspec, x, y)


def index_unreduced(spec: str, table, indices):
  """String-specified sharded table lookup, e.g. 'A [B/x/y] C/z, D/w A -> C/z A D/w'.

  Each shard looks up the indices that fall in its part of the bracketed
  axis and gives zero for the others; the caller reduces over that axis's
  mesh axes.
  """
  tmp, result = spec.split("->")
  lhs, rhs = tmp.split(",")
  lhs_dims = lhs.split()
  index_axis = None
  for i, dim in enumerate(lhs_dims):
    if dim.startswith("["):
      index_axis = i
      if not dim.endswith("]"):
        raise ValueError(f"Expected closing bracket in {dim}")
      lhs_dims[i] = dim[1:-1]
      break
  if index_axis is None:
    raise ValueError(f"Expected an index axis in {lhs}")

  lhs_dims = [DimSpec.parse(dim) for dim in lhs_dims]
  rhs_spec = ShapeSpec.parse(rhs)
  result_spec = ShapeSpec.parse(result)

  # Do the base operation on scalars, then a sequence of vmaps up to the shape.
  def base_op(table, index):
    index = tf.cast(index, tf.int32)  # uint32 in; TensorFlow does not promote
    len_per_chip = table.shape[0]
    lower_bound = len_per_chip * lax.axis_index(lhs_dims[index_axis].sharding)
    upper_bound = lower_bound + len_per_chip
    in_bounds = (lower_bound <= index) & (index < upper_bound)
    return tf.where(in_bounds, table[tf.where(in_bounds, index - lower_bound, 0)],
                    tf.zeros((), table.dtype))

  op = base_op

  lhs_dims_handled = [False] * len(lhs_dims)
  lhs_dims_handled[index_axis] = True
  rhs_dims_handled = [False] * len(rhs_spec.dims)
  for dim in reversed(result_spec.dims):
    try:
      lhs_index = lhs_dims.index(dim)
      lhs_vmap_axis = sum(lhs_dims_handled[:lhs_index])
      assert not lhs_dims_handled[lhs_index]
      lhs_dims_handled[lhs_index] = True
    except ValueError:
      lhs_index = None
      lhs_vmap_axis = None

    try:
      rhs_index = rhs_spec.dims.index(dim)
      rhs_vmap_axis = sum(rhs_dims_handled[:rhs_index])
      assert not rhs_dims_handled[rhs_index]
      rhs_dims_handled[rhs_index] = True
    except ValueError:
      rhs_index = None
      rhs_vmap_axis = None

    op = tfspmd.vmap(op, in_axes=(lhs_vmap_axis, rhs_vmap_axis), out_axes=0)

  assert all(lhs_dims_handled)
  assert all(rhs_dims_handled)

  return op(table, indices)


# ---------------------------------------------------------------------------
# jax_extra.py: activation checkpointing changes memory, not values.


def explicit_activation_checkpointing(f):
  return f


def save_for_backward(x):
  return x


# ---------------------------------------------------------------------------
# input_loader.py and train.py


def to_compute(x):
  """The original's `jnp.bfloat16(x)` casts; float32 here and in the JAX run."""
  return tf.cast(x, tf.float32)


@dataclass(frozen=True)
class TokenBatchParams:
  """The shape of a token batch."""
  len: int
  batch: int


@pytree_dataclass
class TokenBatch:
  """A batch of tokens, which are typically the input to training."""
  targets: u32["batch/dp/fsdp len"]
  is_seq_start: bool_["batch/dp/fsdp len"]


@dataclass(frozen=True)
class Hparams:
  d_model: int
  n_q_per_kv: int
  n_kv: int
  d_head: int
  layers: int
  vocab: int
  d_ff: int
  rope_max_timescale: int


@pytree_dataclass
class TransformerLayer:
  ln1: f32["d_model/tp/sp/dp/fsdp"]
  ln2: f32["d_model/tp/sp/dp/fsdp"]
  w_q: f32["d_model/dp/fsdp n_q_per_kv n_kv/tp/sp d_head"]
  w_kv: f32["2 d_model/dp/fsdp n_kv/tp/sp d_head"]
  w_o: f32["d_model/dp/fsdp n_q_per_kv n_kv/tp/sp d_head"]
  w_gate: f32["d_model/dp/fsdp d_ff/tp/sp"]
  w_up: f32["d_model/dp/fsdp d_ff/tp/sp"]
  w_down: f32["d_model/dp/fsdp d_ff/tp/sp"]


Transformer = Array["layers", TransformerLayer]


@pytree_dataclass
class Model:
  embed: f32["vocab/tp/sp d_model/dp/fsdp"]
  unembed: f32["vocab/tp/sp d_model/dp/fsdp"]
  transformer: Transformer
  final_layer_norm: f32["d_model/dp/fsdp/tp/sp"]

  def forward_pass(self, h: Hparams, ids: u32[b"B/dp/fsdp L"],
                   is_seq_start: bool_[b"B/dp/fsdp L"]) -> f32[b"B/dp/fsdp L V/tp/sp"]:
    ##### Initial embedding lookup.
    embed = all_gather("V/tp/sp M/dp/fsdp -> V/tp/sp M", to_compute(self.embed))
    x = index_unreduced("[V/tp/sp] M, B/dp/fsdp L -> B/dp/fsdp L M", embed, ids)
    x = psum_scatter("B/dp/fsdp L M -> B/dp/fsdp L M/tp/sp", x)

    L = ids.shape[1]
    segment_ids = tf.cumsum(tf.cast(is_seq_start, tf.int32), axis=1)
    segment_mask = segment_ids[:, :, tf.newaxis] == segment_ids[:, tf.newaxis, :]
    segment_mask = segment_mask[..., tf.newaxis, tf.newaxis]  # add axes for q_per_k, num_kv_heads dimensions
    causal_mask = (tf.linalg.band_part(tf.ones((L, L)), -1, 0) > 0)[tf.newaxis, ..., tf.newaxis, tf.newaxis]
    causal_mask = tf.logical_and(segment_mask, causal_mask)

    rope_table = RopeTable.create(L, h)

    ##### Transformer blocks.
    @explicit_activation_checkpointing
    def loop_body(x: f32[b"B/dp/fsdp L M/tp/sp"], layer_weights: TransformerLayer):
      # Pre-attention RMSNorm
      ln1 = all_gather("M/tp/sp/dp/fsdp -> M", tf.cast(layer_weights.ln1, tf.float32))
      gx = all_gather("B/dp/fsdp L M/tp/sp -> B/dp/fsdp L M", x)
      nx = to_compute(rms_norm(gx) * ln1)

      # Attention, using Grouped Query Attention and RoPE position embeddings.
      w_q = all_gather("M/dp/fsdp Q K/tp/sp D -> M Q K/tp/sp D", to_compute(layer_weights.w_q))
      q = save_for_backward(einsum_unreduced("B/dp/fsdp L M, M Q K/tp/sp D -> B/dp/fsdp L Q K/tp/sp D", nx, w_q))
      q = rope_table.apply("L D -> 1 L 1 1 D", q)
      w_kv = all_gather("2 M/dp/fsdp K/tp/sp D -> 2 M K/tp/sp D", to_compute(layer_weights.w_kv))
      k, v = tf.unstack(einsum_unreduced("B/dp/fsdp L M, k_v M K/tp/sp D -> k_v B/dp/fsdp L K/tp/sp D", nx, w_kv))
      k = save_for_backward(k)
      v = save_for_backward(v)
      k = rope_table.apply("L d -> 1 L 1 d", k)
      logits = einsum_unreduced(
          "B/dp/fsdp Qlen Q K/tp/sp D, B/dp/fsdp Klen K/tp/sp D -> B/dp/fsdp Qlen Klen Q K/tp/sp", q, k,
          preferred_element_type=tf.float32)
      logits = tf.where(causal_mask, logits, -1e10)
      probs = to_compute(tf.nn.softmax(logits, axis=2))
      attn_out = einsum_unreduced(
          "B/dp/fsdp Qlen Klen Q K/tp/sp, B/dp/fsdp Klen K/tp/sp D -> B/dp/fsdp Qlen Q K/tp/sp D", probs, v)
      w_o = all_gather("M/dp/fsdp Q K/tp/sp D -> M Q K/tp/sp D", to_compute(layer_weights.w_o))
      attn_out = einsum_unreduced("B/dp/fsdp Qlen Q K/tp/sp D, M Q K/tp/sp D -> B/dp/fsdp Qlen M", attn_out, w_o)
      attn_out = psum_scatter("B/dp/fsdp Qlen M -> B/dp/fsdp Qlen M/tp/sp", attn_out)
      x = save_for_backward(x + attn_out)

      # Pre-FFN RMSNorm
      ln2 = save_for_backward(all_gather("M/tp/sp/dp/fsdp -> M", tf.cast(layer_weights.ln2, tf.float32)))
      gx = all_gather("B/dp/fsdp L M/tp/sp -> B/dp/fsdp L M", x)
      nx = to_compute(rms_norm(gx) * ln2)

      # FFN, using SwiGLU
      w_gate = all_gather("M/dp/fsdp F/tp/sp -> M F/tp/sp", to_compute(layer_weights.w_gate))
      gate_proj = save_for_backward(einsum_unreduced("B/dp/fsdp L M, M F/tp/sp -> B/dp/fsdp L F/tp/sp", nx, w_gate))
      w_up = all_gather("M/dp/fsdp F/tp/sp -> M F/tp/sp", to_compute(layer_weights.w_up))
      up_proj = save_for_backward(einsum_unreduced("B/dp/fsdp L M, M F/tp/sp -> B/dp/fsdp L F/tp/sp", nx, w_up))
      y = tf.nn.silu(gate_proj) * up_proj
      w_down = all_gather("M/dp/fsdp F/tp/sp -> M F/tp/sp", to_compute(layer_weights.w_down))
      ffn_out = einsum_unreduced("B/dp/fsdp L F/tp/sp, M F/tp/sp -> B/dp/fsdp L M", y, w_down)
      ffn_out = psum_scatter("B/dp/fsdp L M -> B/dp/fsdp L M/tp/sp", ffn_out)

      return to_compute(x + ffn_out), ()

    # jax.lax.scan(loop_body, x, self.transformer), keeping the last carry.
    x = tf.scan(lambda carry, layer: loop_body(carry, layer)[0], self.transformer,
                initializer=to_compute(x))[-1]

    ##### Final layernorm and output projection.
    x = all_gather("B/dp/fsdp L M/tp/sp -> B/dp/fsdp L M", x)
    ln = all_gather("M/tp/sp/dp/fsdp -> M", tf.cast(self.final_layer_norm, tf.float32))
    x = to_compute(rms_norm(x) * ln)
    unembed = all_gather("V/tp/sp M/dp/fsdp -> V/tp/sp M", to_compute(self.unembed))
    logits = einsum_unreduced("B/dp/fsdp L M, V/tp/sp M -> B/dp/fsdp L V/tp/sp", x, unembed,
                              preferred_element_type=tf.float32)

    return logits

  def loss(self, h: Hparams, batch: TokenBatch) -> f32[b""]:
    # Given sequence-packed targets [[1, 2], [3, 4, 5], [6, 7, 8, 9]] we want
    # inputs [[0, 1], [0, 3, 4], [0, 6, 7, 8]]: the targets shifted right by
    # 1, sequence-start tokens masked to 0.
    inputs = tf.pad(batch.targets[:, :-1], paddings=((0, 0), (1, 0)))
    is_seq_start = batch.is_seq_start
    inputs = tf.where(is_seq_start, tf.zeros_like(inputs), inputs)

    logits = self.forward_pass(h, inputs, is_seq_start)
    max_logits = lax.pmax(tf.reduce_max(tf.stop_gradient(logits), axis=-1, keepdims=True), ("tp", "sp"))
    logits = logits - max_logits
    sum_logits = lax.psum(tf.reduce_sum(tf.exp(logits), axis=-1, keepdims=True), ("tp", "sp"))
    logsumexp = tf.math.log(sum_logits)
    logprobs = logits - logsumexp
    logprobs_at_targets = index_unreduced("batch/dp/fsdp len [V/tp/sp], batch/dp/fsdp len -> batch/dp/fsdp len",
                                          logprobs, batch.targets)
    logprobs_at_targets = psum_scatter("batch/dp/fsdp len -> batch/dp/fsdp len/tp/sp", logprobs_at_targets)
    tokens_in_global_batch = logprobs_at_targets.shape.num_elements() * lax.psum(1, ("dp", "fsdp", "tp", "sp"))
    return -tf.reduce_sum(logprobs_at_targets) / tf.cast(tokens_in_global_batch, tf.float32)


def rearrange(x, spec):
  """einops.rearrange for the patterns RopeTable uses: adding unit axes."""
  before, after = (side.split() for side in spec.split("->"))
  assert [d for d in after if d != "1"] == before, spec
  return tf.reshape(x, [1 if d == "1" else x.shape[before.index(d)] for d in after])


@pytree_dataclass
class RopeTable:
  sin: f32["len d_head2"]
  cos: f32["len d_head2"]

  @staticmethod
  def create(max_len: int, hparams: Hparams) -> "RopeTable":
    rope_max_timescale = hparams.rope_max_timescale
    d_head = hparams.d_head
    d = d_head // 2
    # endpoint=False is equivalent to what MaxText does.
    # jnp.logspace(0, log10(rope_max_timescale), d, endpoint=False):
    timescale = 10.0 ** (tf.range(d, dtype=tf.float32) *
                         (tf.math.log(tf.cast(rope_max_timescale, tf.float32)) /
                          tf.math.log(10.0) / d))
    position = tf.range(max_len, dtype=tf.int32)
    sinusoid_inp = tf.cast(position[:, tf.newaxis], tf.float32) / timescale[tf.newaxis, :]
    sin = tf.sin(sinusoid_inp)
    cos = tf.cos(sinusoid_inp)
    return RopeTable(sin=sin, cos=cos)

  def apply(self, rearrange_spec, x):
    x1, x2 = tf.split(x, 2, axis=-1)
    sin = rearrange(self.sin, rearrange_spec)
    cos = rearrange(self.cos, rearrange_spec)
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    return tf.concat([r1, r2], axis=-1)


def rms_norm(x: f32[b"batch/dp/fsdp len M"]) -> f32[b"batch/dp/fsdp len M"]:
  mean2 = save_for_backward(tf.reduce_mean(tf.square(tf.cast(x, tf.float32)), axis=-1, keepdims=True))
  return to_compute(x * tf.math.rsqrt(mean2 + 1e-6))


@pytree_dataclass
class Metrics:
  loss: f32[b""]
  learning_rate: f32[b""]
  grad_norm: f32[b""]
  raw_grad_norm: f32[b""]


@dataclass(frozen=True)
class TrainingHparams:
  adam_b1: float
  adam_b2: float
  adam_eps: float
  adam_eps_root: float
  weight_decay: float
  warmup_steps: int
  steps: int
  steps_for_lr: int
  cosine_learning_rate_final_fraction: float
  learning_rate: float
  tokens: TokenBatchParams
  seed: int
  queue: Optional[str] = None


@pytree_dataclass
class State:
  weights: Model
  adam_mu: Model
  adam_nu: Model


@functools.lru_cache
def sharded_training_step(h: Hparams, hparams: TrainingHparams):
  """training_step's shard_map, built once per static (h, hparams) as jax.jit would."""

  @partial(typed_shard_map, check_rep=False)  # check_rep=False for https://github.com/google/jax/issues/20335
  def sharded_step(state: State, step: u32[b""], batch: TokenBatch) -> Tuple[State, Metrics]:
    # jax.value_and_grad(lambda weights: weights.loss(h, batch))(state.weights)
    weight_leaves, weight_treedef = tfspmd.tree_util.tree_flatten(state.weights)
    with tf.GradientTape() as tape:
      tape.watch(weight_leaves)
      weights = tfspmd.tree_util.tree_unflatten(weight_treedef, weight_leaves)
      loss = weights.loss(h, batch)
    grad = tfspmd.tree_util.tree_unflatten(weight_treedef, tape.gradient(loss, weight_leaves))
    # Gradients have already been reduced across chips because the gradient of the weight `all_gather`
    # is weight-gradient `psum_scatter`. Loss, on the other hand, hasn't been reduced across chips: if we
    # did that inside the autodiff, we'd be double-reducing the loss, effectively multiplying it by the
    # amount of data parallelism.
    #
    # So we reduce the loss across chips _outside_ the autodiff.
    loss = lax.psum(loss, ("dp", "fsdp", "tp", "sp"))

    # Calculate learning rate from step number: linear warmup then cosine decay.
    warmup_lr = (tf.cast(step, tf.float32) / tf.cast(hparams.warmup_steps, tf.float32)) * hparams.learning_rate
    cosine = tf.cos(math.pi * (tf.cast(step - hparams.warmup_steps, tf.float32) /
                               tf.cast(hparams.steps_for_lr - hparams.warmup_steps, tf.float32)))
    cosine_lr = hparams.learning_rate * (hparams.cosine_learning_rate_final_fraction + (
        1 - hparams.cosine_learning_rate_final_fraction) * (cosine * .5 + .5))
    lr = tf.where(step < hparams.warmup_steps, warmup_lr, cosine_lr)

    # AdamW optimizer with global gradient clipping.
    grad_leaves, grad_treedef = tfspmd.tree_util.tree_flatten(grad)
    global_norm_square = tf.constant(0.0, tf.float32)
    for g in grad_leaves:
      assert g.dtype == tf.float32
      global_norm_square += tf.reduce_sum(tf.square(g))
    global_norm_square = lax.psum(global_norm_square, ("dp", "fsdp", "tp", "sp"))
    global_norm = tf.sqrt(global_norm_square)
    rescale = tf.minimum(1.0, 1.0 / global_norm)

    new_ps = []
    new_mus = []
    new_nus = []
    for p, g, mu, nu, spec in zip(tree_leaves(state.weights), grad_leaves, tree_leaves(state.adam_mu),
                                  tree_leaves(state.adam_nu), tree_leaves(make_partition_specs(State))):
      assert is_fully_sharded(spec), "Weight update is only correctly scaled for fully sharded weights."
      # Gradient clipping
      g = g * rescale
      # Adam scaling
      mu = (1 - hparams.adam_b1) * g + hparams.adam_b1 * mu
      nu = (1 - hparams.adam_b2) * tf.square(g) + hparams.adam_b2 * nu
      # We need step numbers to start at 1, not 0. Otherwise the bias correction produces NaN.
      completed_steps = tf.cast(step + 1, tf.float32)
      mu_hat = mu / (1 - tf.constant(hparams.adam_b1, tf.float32)**completed_steps)
      nu_hat = nu / (1 - tf.constant(hparams.adam_b2, tf.float32)**completed_steps)
      g = mu_hat / (tf.sqrt(nu_hat + hparams.adam_eps_root) + hparams.adam_eps)
      # Weight decay
      g += hparams.weight_decay * p
      # Learning rate
      g *= lr

      # Apply update
      new_ps.append(p - g)
      new_mus.append(mu)
      new_nus.append(nu)

    new_state = State(
        weights=tfspmd.tree_util.tree_unflatten(grad_treedef, new_ps),
        adam_mu=tfspmd.tree_util.tree_unflatten(grad_treedef, new_mus),
        adam_nu=tfspmd.tree_util.tree_unflatten(grad_treedef, new_nus),
    )
    metrics = Metrics(
        loss=loss,
        learning_rate=lr,
        grad_norm=global_norm * rescale,
        raw_grad_norm=global_norm,
    )
    return new_state, metrics

  return sharded_step


def training_step(state: State, step, h: Hparams, hparams: TrainingHparams, batch: TokenBatch):
  return sharded_training_step(h, hparams)(state, step, batch)


# ---------------------------------------------------------------------------
# The run: tiny sizes, deterministic NumPy inputs (the JAX run's).

H = Hparams(d_model=16, n_q_per_kv=2, n_kv=4, d_head=4, layers=2, vocab=32, d_ff=32,
            rope_max_timescale=256)
BATCH, LEN, STEPS = 4, 8, 4
TH = TrainingHparams(adam_b1=0.9, adam_b2=0.95, adam_eps=1e-8, adam_eps_root=0.0,
                     weight_decay=0.1, warmup_steps=2, steps=STEPS, steps_for_lr=6,
                     cosine_learning_rate_final_fraction=0.1, learning_rate=3e-2,
                     tokens=TokenBatchParams(len=LEN, batch=BATCH), seed=0)
LAYER_LEAVES = ("ln1", "ln2", "w_q", "w_kv", "w_o", "w_gate", "w_up", "w_down")
# Model's leaves in tree order: embed, unembed, transformer.*, final_layer_norm
LEAF_NAMES = ("embed", "unembed") + LAYER_LEAVES + ("final_layer_norm",)

# What JAX 0.10.2 printed on 8 CPU devices for these inputs (the original
# program, renamed to the 4-axis mesh, float32), step by step: loss,
# learning rate, clipped and raw gradient norm.
JAX_METRICS = [
    (4.254218101501465, 0.0, 1.0, 2.402291774749756),
    (4.254218101501465, 0.014999999664723873, 1.0, 2.402291774749756),
    (3.321183681488037, 0.029999999329447746, 0.9999999403953552, 1.5546759366989136),
    (2.786106586456299, 0.026045940816402435, 1.0, 1.1720716953277588),
]
# The step-0 gradient of each leaf (adam_mu after step 0 / ((1 - b1) * clip
# scale)): its sum and its sum of squares.
JAX_GRAD_SUMS = [
    0.2431939827730918, 3.0860799415943774e-08, 0.2087584176704747, -0.4557420262431615,
    -1.1057404986482038, -0.9395961126623622, -2.1542737341347333, -0.6055449690874846,
    0.5240896726873843, -1.0127528127718468, 1.311661690899197]
JAX_GRAD_SQUARE_SUMS = [
    0.08414584330333771, 1.0320646899500547, 0.06836609048510643, 0.09087125752836483,
    0.321348033410518, 0.8918213324947128, 1.805963823804828, 0.3926546721761903,
    0.17556079517521173, 0.7100429713734935, 0.1981672817472902]
# The weights after 4 steps, per leaf: (sum, sum of w * cos(flat index)).
JAX_WEIGHT_CHECKSUMS = [
    (-12.64921193011105, -6.4234185815047),
    (-11.02544371492695, 2.085411377311205),
    (31.623302161693573, 0.5245236251795267),
    (32.269345819950104, 0.5709801469059647),
    (2.24410094198538, 1.2765870938493893),
    (-11.419303820672212, 0.9227150426527144),
    (8.341194069158519, 0.9670093977433771),
    (14.009791221295018, 4.2863571949217185),
    (0.7742523309207172, -1.1574079807070223),
    (3.5129273436323274, -2.358288671308844),
    (15.317644953727722, 0.6674032961553791),
]


def numpy_inputs():
  """Model.init's shapes and scales, drawn by NumPy (truncated normal by clipping)."""
  h = H
  rng = np.random.default_rng(0)
  tn = lambda shape: np.clip(rng.standard_normal(shape), -2, 2)
  truncated_normal_stddev = .87962566103423978
  d_model_scale = 1 / (math.sqrt(h.d_model) * truncated_normal_stddev)
  total_head_dim = h.n_q_per_kv * h.n_kv * h.d_head
  w_q_shape = (h.layers, h.d_model, h.n_q_per_kv, h.n_kv, h.d_head)
  ff_shape = (h.layers, h.d_model, h.d_ff)
  w = dict(
      embed=rng.standard_normal((h.vocab, h.d_model)),
      unembed=d_model_scale * tn((h.vocab, h.d_model)),
      ln1=np.ones((h.layers, h.d_model)),
      ln2=np.ones((h.layers, h.d_model)),
      w_q=d_model_scale / math.sqrt(h.d_head) * tn(w_q_shape),
      w_kv=d_model_scale * tn((h.layers, 2, h.d_model, h.n_kv, h.d_head)),
      w_o=1 / (math.sqrt(total_head_dim) * truncated_normal_stddev) * tn(w_q_shape),
      w_gate=d_model_scale * tn(ff_shape),
      w_up=d_model_scale * tn(ff_shape),
      w_down=1 / (math.sqrt(h.d_ff) * truncated_normal_stddev) * tn(ff_shape),
      final_layer_norm=np.ones((h.d_model,)),
  )
  w = {k: v.astype(np.float32) for k, v in w.items()}
  targets = rng.integers(0, h.vocab, (BATCH, LEN)).astype(np.uint32)
  is_seq_start = rng.random((BATCH, LEN)) < 0.25
  is_seq_start[:, 0] = True
  return w, targets, is_seq_start


def model_of(w):
  return Model(embed=w["embed"], unembed=w["unembed"],
               transformer=Transformer(**{k: w[k] for k in LAYER_LEAVES}),
               final_layer_norm=w["final_layer_norm"])


def leaves_by_name(model):
  return dict(zip(LEAF_NAMES, (np.asarray(x) for x in tree_leaves(model))))


def checksum(x):
  x = np.asarray(x, np.float64)
  return x.sum(), (x * np.cos(np.arange(x.size)).reshape(x.shape)).sum()


# ---------------------------------------------------------------------------
# NumPy reference: the same model in float64, unsharded.


def final_norm_permutation():
  """Where `all_gather('M/t/d -> M')` puts the blocks laid out 'd_model/d/t'.

  Gathered block j (t major: j = sp * 2 + fsdp) is the stored block of the
  device with that (fsdp, sp), which the 'd/t' layout numbers fsdp * 4 + sp.
  """
  d_axis, t_axis = 2, 4
  block = H.d_model // (d_axis * t_axis)
  return np.concatenate([np.arange(block) + block * ((j % d_axis) * t_axis + j // d_axis)
                         for j in range(d_axis * t_axis)])


def numpy_loss(w, targets, is_seq_start):
  w = {k: np.asarray(v, np.float64) for k, v in w.items()}
  final_ln = w["final_layer_norm"][final_norm_permutation()]
  L = targets.shape[1]
  rms = lambda x: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  inputs = np.where(is_seq_start, 0, np.pad(targets[:, :-1], ((0, 0), (1, 0))))
  x = w["embed"][inputs]
  segment = np.cumsum(is_seq_start, axis=1)
  mask = ((segment[:, :, None] == segment[:, None, :]) &
          np.tril(np.ones((L, L), bool))[None])[..., None, None]
  d = H.d_head // 2
  angle = np.arange(L)[:, None] / np.logspace(0, np.log10(H.rope_max_timescale), d,
                                              endpoint=False)[None]

  def rope(t, shape):
    t1, t2 = np.split(t, 2, axis=-1)
    sin, cos = np.sin(angle).reshape(shape), np.cos(angle).reshape(shape)
    return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)

  for i in range(H.layers):
    nx = rms(x) * w["ln1"][i]
    q = rope(np.einsum("blm,mqkd->blqkd", nx, w["w_q"][i]), (1, L, 1, 1, d))
    k, v = np.einsum("blm,cmkd->cblkd", nx, w["w_kv"][i])
    k = rope(k, (1, L, 1, d))
    logits = np.where(mask, np.einsum("bxqkd,bykd->bxyqk", q, k), -1e10)
    probs = np.exp(logits - logits.max(axis=2, keepdims=True))
    probs /= probs.sum(axis=2, keepdims=True)
    x = x + np.einsum("bxqkd,mqkd->bxm", np.einsum("bxyqk,bykd->bxqkd", probs, v), w["w_o"][i])
    nx = rms(x) * w["ln2"][i]
    gate, up = nx @ w["w_gate"][i], nx @ w["w_up"][i]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w["w_down"][i].T
  logits = (rms(x) * final_ln) @ w["unembed"].T
  logits -= logits.max(axis=-1, keepdims=True)
  logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
  return -np.take_along_axis(logprobs, targets[..., None].astype(np.int64), -1).mean()


def numpy_directional_derivative(w, targets, is_seq_start, name, direction, eps=1e-5):
  w = {k: np.asarray(v, np.float64) for k, v in w.items()}
  plus, minus = dict(w), dict(w)
  plus[name] = w[name] + eps * direction
  minus[name] = w[name] - eps * direction
  return (numpy_loss(plus, targets, is_seq_start) -
          numpy_loss(minus, targets, is_seq_start)) / (2 * eps)


def test_numpy_reference_reproduces_jax_loss_and_gradient_sums():
  w, targets, is_seq_start = numpy_inputs()
  np.testing.assert_allclose(numpy_loss(w, targets, is_seq_start), JAX_METRICS[0][0], rtol=1e-6)
  # The derivative along all-ones in a leaf is the sum of its gradient.
  sums = [numpy_directional_derivative(w, targets, is_seq_start, name, np.ones_like(w[name]))
          for name in LEAF_NAMES]
  np.testing.assert_allclose(sums, JAX_GRAD_SUMS, rtol=1e-5, atol=1e-6)


@functools.lru_cache(maxsize=None)
def trained():
  """The states and metrics of 4 training steps with tfspmd, run once."""
  return _train()


def _train():
  """Runs 4 training steps with tfspmd; returns the states and metrics."""
  mesh = tfspmd.make_mesh(MESH_SHAPE, MESH_AXES)
  w, targets, is_seq_start = numpy_inputs()
  weights = model_of(w)
  zeros = tfspmd.tree_util.tree_map(np.zeros_like, weights)
  state = State(weights=weights, adam_mu=zeros, adam_nu=zeros)
  batch = TokenBatch(targets=targets, is_seq_start=is_seq_start)
  states, metrics = [state], []
  with tfspmd.set_mesh(mesh):
    for step in range(STEPS):
      state, m = training_step(state, np.uint32(step), H, TH, batch)
      states.append(state)
      metrics.append(tuple(float(np.asarray(x)) for x in tree_leaves(m)))
  return states, metrics


def test_training_step_matches_jax():
  states, metrics = trained()
  np.testing.assert_allclose(metrics, JAX_METRICS, rtol=1e-4, atol=1e-7)
  rescale = min(1.0, 1.0 / metrics[0][3])
  grads = [np.asarray(mu, np.float64) / ((1 - TH.adam_b1) * rescale)
           for mu in tree_leaves(states[1].adam_mu)]
  np.testing.assert_allclose([g.sum() for g in grads], JAX_GRAD_SUMS, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose([(g ** 2).sum() for g in grads], JAX_GRAD_SQUARE_SUMS, rtol=1e-4)
  np.testing.assert_allclose([checksum(x) for x in tree_leaves(states[-1].weights)],
                             JAX_WEIGHT_CHECKSUMS, rtol=1e-4, atol=1e-5)


def test_training_step_matches_numpy():
  states, metrics = trained()
  _, targets, is_seq_start = numpy_inputs()
  # Each step's loss is the NumPy loss of the weights that step was given.
  for state, m in zip(states, metrics):
    np.testing.assert_allclose(
        m[0], numpy_loss(leaves_by_name(state.weights), targets, is_seq_start), rtol=1e-5)
  # The step-0 gradient (from adam_mu, as lr is 0 at step 0) against NumPy's
  # derivatives along a random direction in each leaf, and its global norm.
  w = leaves_by_name(states[0].weights)
  rescale = min(1.0, 1.0 / metrics[0][3])
  grads = {k: np.asarray(mu, np.float64) / ((1 - TH.adam_b1) * rescale)
           for k, mu in leaves_by_name(states[1].adam_mu).items()}
  rng = np.random.default_rng(1)
  for name in LEAF_NAMES:
    direction = rng.standard_normal(w[name].shape)
    np.testing.assert_allclose(
        (grads[name] * direction).sum(),
        numpy_directional_derivative(w, targets, is_seq_start, name, direction),
        rtol=1e-3, atol=1e-6, err_msg=name)
  np.testing.assert_allclose(
      np.sqrt(sum((g ** 2).sum() for g in grads.values())), metrics[0][3], rtol=1e-5)
  # The last step's AdamW update, in NumPy from the moments it returned.
  b1, b2, t = TH.adam_b1, TH.adam_b2, STEPS
  lr = metrics[-1][1]
  before, after = states[-2], states[-1]
  for p, mu, nu, new_p in zip(*(tree_leaves(s) for s in (
      before.weights, after.adam_mu, after.adam_nu, after.weights))):
    p, mu, nu = (np.asarray(x, np.float64) for x in (p, mu, nu))
    update = (mu / (1 - b1 ** t)) / (np.sqrt(nu / (1 - b2 ** t)) + TH.adam_eps)
    np.testing.assert_allclose(np.asarray(new_p), p - lr * (update + TH.weight_decay * p),
                               rtol=1e-5, atol=1e-6)
