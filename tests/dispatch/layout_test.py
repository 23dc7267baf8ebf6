"""Layouts: construction, validation against batches, and the errors bad input gets."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from earl_jax.config import ParallelConfig
from earl_jax.dispatch import (
  DispatchConfig,
  Dispatcher,
  Layout,
  LayoutError,
  check_compatible,
  pad_rows,
  row_multiple,
)
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.testing import dispatch_bodies as bodies

# auto, per-permutation kernels, no donation (the source batch stays usable).
_PLAIN = DispatchConfig(strategy='auto', stable_kernels=False, donate=False)


def _host(rows=16, length=8):
  return bodies.host_batch(rows, length)


def test_parse_kinds_give_the_documented_specs():
  host = _host()
  assert Layout.parse('dp2.tp4', host).specs['tokens'] == P(('data', 'fsdp'))
  assert Layout.parse('dp2.tp4:rows', host).specs['rewards'] == P(('data', 'fsdp', 'tensor'))
  seq = Layout.parse('dp2.tp4:seq', host)
  assert seq.specs['logprobs'] == P(('data', 'fsdp'), ('tensor',))
  assert seq.specs['rewards'] == P(('data', 'fsdp'))
  assert Layout.parse('dp2.tp4:perm', host).specs['valid'] == P(('tensor', 'data', 'fsdp'))
  with pytest.raises(LayoutError, match='Unknown layout kind'):
    Layout.parse('dp8:diagonal', host)


def test_layout_of_reads_placed_batch():
  host = _host()
  src = Layout.parse('dp2.tp4:seq', host)
  batch = bodies.place(host, src)
  got = Layout.of(batch)
  assert got.key() == src.key()
  assert got.check(batch, placed=True)


def test_missing_and_extra_fields_are_named():
  host = _host()
  layout = Layout.parse('dp8', host)
  bad = dict(host)
  del bad['rewards']
  bad['returns'] = host['rewards']
  with pytest.raises(LayoutError, match=r"missing fields \[\"\['rewards'\]\"\].*unexpected fields"):
    layout.check(bad)


def test_dtype_mismatch_names_field_and_dtypes():
  host = _host()
  layout = Layout.parse('dp8', host)
  bad = dict(host, logprobs=host['logprobs'].astype(np.float16))
  with pytest.raises(LayoutError, match=r"\['logprobs'\].*float16.*expects float32"):
    layout.check(bad)
  # And through a dispatch: the target layout expects f32 log-probs.
  src16 = Layout.parse('dp8', bad)
  with pytest.raises(LayoutError, match=r"\['logprobs'\].*float16.*float32"):
    check_compatible(src16, layout)


def test_rows_that_do_not_divide_are_an_error_pointing_at_pad_rows():
  host = _host(rows=12)
  layout = Layout.parse('dp8', _host())
  with pytest.raises(LayoutError, match=r'has shape \(12,.*dimension 0 \(12\).*8 shards.*pad_rows'):
    layout.check(host)


def test_pad_rows_pads_and_masks_instead_of_replicating():
  host = _host(rows=12)
  src, dst = Layout.parse('dp8', _host()), Layout.parse('dp2.tp4:seq', _host())
  multiple = row_multiple(src, dst)
  assert multiple == 8
  padded, valid = pad_rows(host, multiple)
  assert padded['tokens'].shape == (16, 8)
  np.testing.assert_array_equal(valid, np.arange(16) < 12)
  np.testing.assert_array_equal(padded['logprobs'][:12], host['logprobs'])
  assert not padded['loss_mask'][12:].any()
  batch = bodies.place(dict(padded, valid=valid), src)
  out, _ = Dispatcher(_PLAIN).dispatch(batch, dst, src=src, strategy='layout_aware')
  assert bodies.check_placed(out, dict(padded, valid=valid), dst) == []
  assert int(np.asarray(out['valid']).sum()) == 12


def test_layouts_over_different_device_orders_or_sets_are_rejected():
  host = _host()
  devices = mesh_lib.canonical_devices()
  a = Layout.parse('dp8', host)
  reversed_mesh = Mesh(
    np.array(devices[::-1]).reshape(8, 1, 1, 1), mesh_lib.MESH_AXES, axis_types=a.mesh.axis_types
  )
  b = Layout.rows(reversed_mesh, host)
  with pytest.raises(LayoutError, match=r'device order.*devices \[0, 1, 2.*devices \[7, 6, 5'):
    check_compatible(a, b)
  four = Layout.rows(mesh_lib.make_mesh(ParallelConfig(dp=4), devices[:4]), _host(rows=8))
  other = Layout.rows(mesh_lib.make_mesh(ParallelConfig(dp=4), devices[4:]), _host(rows=8))
  with pytest.raises(LayoutError, match=r'device set.*\(data=4 x fsdp=1 x context=1 x tensor=1\)'):
    check_compatible(four, other)


def test_batch_not_on_the_source_layout_is_rejected():
  host = _host()
  src, other = Layout.parse('dp8', host), Layout.parse('dp2.tp4', host)
  batch = bodies.place(host, other)
  with pytest.raises(LayoutError, match=r'sharded as .* not as the source layout'):
    src.check(batch, placed=True)


def test_sharding_a_trailing_dimension_is_rejected():
  mesh = mesh_lib.make_mesh(ParallelConfig(dp=2, tp=4))
  with pytest.raises(LayoutError, match='shards dimension 2'):
    Layout(mesh=mesh, specs={'x': P('data', None, 'tensor')})
  with pytest.raises(LayoutError, match="names axis 'model'"):
    Layout(mesh=mesh, specs={'x': P('model')})


def test_works_with_flax_struct_batches():
  import flax.struct

  @flax.struct.dataclass
  class Batch:
    tokens: jax.Array
    rewards: jax.Array

  host = Batch(
    tokens=np.arange(64, dtype=np.int32).reshape(16, 4), rewards=np.arange(16, dtype=np.float32)
  )
  src = Layout.parse('dp2.tp4:seq', host)
  dst = Layout.parse('dp8', host)
  assert [f.path for f in src.fields] == ['.tokens', '.rewards']
  batch = bodies.place(host, src)
  out, _ = Dispatcher(_PLAIN).dispatch(batch, dst, src=src, perm=np.arange(16)[::-1].copy())
  assert isinstance(out, Batch)
  np.testing.assert_array_equal(np.asarray(out.tokens), host.tokens[::-1])
  np.testing.assert_array_equal(np.asarray(out.rewards), host.rewards[::-1])


def test_dispatch_rejects_a_target_layout_with_other_fields():
  host = _host()
  src = Layout.parse('dp8', host)
  other = dict(host)
  other['returns'] = other.pop('rewards')
  dst = Layout.parse('dp2.tp4', other)
  batch = bodies.place(host, src)
  with pytest.raises(LayoutError, match=r"only in source \[\"\['rewards'\]\"\].*only in target"):
    Dispatcher(_PLAIN).dispatch(batch, dst, src=src)
