"""Each kind of bad input raises a specific error that names what to change."""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax


def test_mismatched_mapped_sizes_name_each_argument():
  f = tfspmd.pmap(lambda a, b: a + b)
  with pytest.raises(ValueError) as info:
    f(np.zeros((4, 2)), {"w": np.zeros((3, 2))})
  message = str(info.value)
  assert "inconsistent sizes" in message
  assert "args[0] of shape (4, 2) mapped along axis 0 has size 4" in message
  assert "args[1]['w'] of shape (3, 2) mapped along axis 0 has size 3" in message


def test_too_many_replicas():
  with pytest.raises(ValueError, match="requires 9 replicas, but only 8 devices"):
    tfspmd.pmap(lambda x: x)(np.zeros(9))


def test_too_many_replicas_in_nested_pmaps():
  inner = tfspmd.pmap(lambda x: x, axis_name="c")
  with pytest.raises(ValueError, match=r"requires 12 replicas \(4 x 3 nested"):
    tfspmd.pmap(inner, axis_name="r")(np.zeros((4, 3)))


def test_zero_size_mapped_axis():
  with pytest.raises(ValueError, match="size 0"):
    tfspmd.pmap(lambda x: x)(np.zeros((0, 3)))


def test_mapping_a_scalar():
  with pytest.raises(ValueError, match=r"in_axes maps axis 0 of argument args\[1\], but it is a scalar"):
    tfspmd.pmap(lambda a, b: a + b)(np.zeros(2), 3.0)


@pytest.mark.parametrize("in_axes", [2, -3])
def test_in_axes_out_of_range(in_axes):
  with pytest.raises(ValueError, match=r"args\[0\], which has rank 2: the axis must be in \[-2, 2\)"):
    tfspmd.pmap(lambda x: x, in_axes=in_axes)(np.zeros((2, 2)))


def test_out_axes_out_of_range():
  with pytest.raises(ValueError, match=r"out_axes puts the mapped axis at 3 of output\[1\], .* rank 2 .*\[-2, 2\)"):
    tfspmd.pmap(lambda x: (x, x), out_axes=(0, 3))(np.zeros((2, 2)))


def test_in_axes_wrong_tree():
  with pytest.raises(ValueError, match="in_axes has 1 entries, but the function was called with 2"):
    tfspmd.pmap(lambda a, b: a, in_axes=(0,))(np.zeros(2), np.zeros(2))
  with pytest.raises(ValueError, match=r"in_axes specification at args\[0\] has keys \['a'\]"):
    tfspmd.pmap(lambda a: a, in_axes=({"a": 0},))({"b": np.zeros(2)})
  with pytest.raises(ValueError, match="tree prefix"):
    tfspmd.pmap(lambda a: a, in_axes=((0, 0),))(np.zeros(2))


def test_out_axes_wrong_tree():
  with pytest.raises(ValueError, match="out_axes specification at output has 3 entries"):
    tfspmd.pmap(lambda a: (a, a), out_axes=(0, 0, 0))(np.zeros(2))


@pytest.mark.parametrize("spec", [True, "0", 1.5, {0}])
def test_axis_specs_of_the_wrong_type(spec):
  with pytest.raises(TypeError, match="in_axes must be an int, None"):
    tfspmd.pmap(lambda a: a, in_axes=spec)
  with pytest.raises(TypeError, match="out_axes must be an int, None"):
    tfspmd.pmap(lambda a: a, out_axes=spec)


def test_non_array_argument_names_its_path():
  with pytest.raises(TypeError, match=r"argument args\[0\]\['f'\] is a builtin_function_or_method .* static_broadcasted_argnums"):
    tfspmd.pmap(lambda d: d)({"f": print, "x": np.zeros(2)})


def test_string_argument_cannot_be_placed():
  with pytest.raises(TypeError, match=r"args\[0\] has dtype string"):
    tfspmd.pmap(lambda s: s)(tf.constant(["a", "b"]))
  with pytest.raises(TypeError, match=r"args\[0\] has dtype string"):
    tfspmd.pmap(lambda s: s)(np.array(["a", "b"]))


def test_unhashable_static_argument():
  f = tfspmd.pmap(lambda x, n: x, static_broadcasted_argnums=1)
  with pytest.raises(ValueError, match=r"static argument args\[1\] .* not hashable: list"):
    f(np.zeros(2), [1, 2])


def test_missing_static_argument():
  f = tfspmd.pmap(lambda x, n=2: x, static_broadcasted_argnums=1)
  with pytest.raises(ValueError, match=r"static_broadcasted_argnums=\(1,\), but was called with only 1"):
    f(np.zeros(2))


def test_static_and_donated_together():
  with pytest.raises(ValueError, match="both static"):
    tfspmd.pmap(lambda x: x, static_broadcasted_argnums=0, donate_argnums=0)


def test_argnums_of_the_wrong_type():
  with pytest.raises(TypeError, match="static_broadcasted_argnums must be an int"):
    tfspmd.pmap(lambda x: x, static_broadcasted_argnums="0")
  with pytest.raises(TypeError, match="donate_argnums must be an int"):
    tfspmd.pmap(lambda x: x, donate_argnums=[0.5])


def test_unbound_axis_lists_bound_names():
  f = tfspmd.pmap(lambda x: lax.psum(x, "j"), axis_name="i")
  with pytest.raises(NameError, match="unbound axis name: 'j'. The following axis names .* are available: 'i'"):
    f(np.zeros(2))


def test_collective_outside_any_map():
  with pytest.raises(NameError, match="unbound axis name: 'i'. No axis is bound"):
    lax.psum(tf.constant(1.), "i")


def test_colliding_axis_names_in_nested_pmaps():
  inner = tfspmd.pmap(lambda x: x, axis_name="i")
  with pytest.raises(ValueError, match="'i' is already bound"):
    tfspmd.pmap(inner, axis_name="i")(np.zeros((2, 2)))


def test_out_axes_none_on_a_varying_output():
  with pytest.raises(ValueError, match=r"out_axes=None for output\[1\], but that output varies"):
    tfspmd.pmap(lambda x: (lax.psum(x, "i"), x), "i", out_axes=None)(np.zeros(2))


def test_devices_argument_checks():
  devices = tfspmd.devices()
  with pytest.raises(ValueError, match="`devices` is empty"):
    tfspmd.pmap(lambda x: x, devices=[])
  with pytest.raises(ValueError, match="lists a device twice"):
    tfspmd.pmap(lambda x: x, devices=[devices[0], devices[0]])
  with pytest.raises(TypeError, match="must hold tfspmd.Device objects"):
    tfspmd.pmap(lambda x: x, devices=["CPU:0"])
  with pytest.raises(ValueError, match="mapped axis has size 3"):
    tfspmd.pmap(lambda x: x, devices=devices[:2])(np.zeros(3))


def test_nested_pmap_with_devices():
  inner = tfspmd.pmap(lambda x: x, axis_name="c", devices=tfspmd.devices()[:2])
  with pytest.raises(ValueError, match="nested pmaps with devices= are not supported"):
    tfspmd.pmap(inner, axis_name="r")(np.zeros((2, 2)))


def test_axis_size_checks():
  with pytest.raises(ValueError, match="axis_size"):
    tfspmd.pmap(lambda x: x, axis_size=0)
  with pytest.raises(ValueError, match="pass axis_size= to pmap"):
    tfspmd.pmap(lambda x: x, in_axes=None)(np.zeros(2))
  with pytest.raises(ValueError, match="axis_size=3, but its mapped arguments have size 2"):
    tfspmd.pmap(lambda x: x, axis_size=3)(np.zeros(2))


def test_fun_must_be_callable():
  with pytest.raises(TypeError, match="`fun` must be callable"):
    tfspmd.pmap(3)


def test_unhashable_axis_name():
  with pytest.raises(TypeError, match="`axis_name` must be hashable"):
    tfspmd.pmap(lambda x: x, axis_name=["i"])


def test_output_that_is_not_a_tensor():
  with pytest.raises(TypeError, match=r"returned a object at output\[1\]"):
    tfspmd.pmap(lambda x: (x, object()))(np.zeros(2))


def test_donated_argument_used_again():
  x = tfspmd.pmap(lambda v: v)(np.zeros(2))
  tfspmd.pmap(lambda v: v + 1, donate_argnums=(0,))(x)
  with pytest.raises(RuntimeError, match="donated to a pmapped function"):
    tfspmd.pmap(lambda v: v)(x)


def test_collective_errors_name_the_collective_called():
  with pytest.raises(ValueError, match=r"pswapaxes: `split_axis`=5 is out of range"):
    tfspmd.pmap(lambda v: lax.pswapaxes(v, "i", 5), "i")(np.zeros((2, 2)))
  with pytest.raises(ValueError, match=r"all_to_all: the dimension `split_axis` has size 3"):
    tfspmd.pmap(lambda v: lax.all_to_all(v, "i", 0, 0), "i")(np.zeros((2, 3)))
