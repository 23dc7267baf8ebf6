"""Meshes over the canonical devices, factorisations and fit checks."""

import jax
import numpy as np
import pytest

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.sharding import mesh as mesh_lib


def test_every_mesh_uses_the_canonical_order_with_tensor_fastest():
  a = mesh_lib.make_mesh(ParallelConfig(dp=2, tp=4))
  b = mesh_lib.make_mesh(ParallelConfig(dp=8))
  assert a.axis_names == ('data', 'fsdp', 'context', 'tensor')
  assert dict(a.shape) == {'data': 2, 'fsdp': 1, 'context': 1, 'tensor': 4}
  assert mesh_lib.same_devices(a, b)
  assert [d.id for d in a.devices[0, 0, 0]] == [0, 1, 2, 3]  # one TP group = consecutive devices
  assert all(t == jax.sharding.AxisType.Auto for t in a.axis_types)
  assert mesh_lib.parallel_config_of(a) == ParallelConfig(dp=2, tp=4)
  # A context-parallel ring: consecutive TP groups (here of one device).
  c = mesh_lib.make_mesh(ParallelConfig(dp=2, cp=4))
  assert [d.id for d in c.devices[1, 0, :, 0]] == [4, 5, 6, 7]
  assert mesh_lib.parallel_config_of(c) == ParallelConfig(dp=2, cp=4)


def test_context_parallel_names_parse_and_round_trip():
  for text, want in (
    ('dp2.cp4', ParallelConfig(dp=2, cp=4)),
    ('dp2.tp2.cp2', ParallelConfig(dp=2, tp=2, cp=2)),
    ('dp1.fsdp2.tp1.cp4', ParallelConfig(fsdp=2, cp=4)),
  ):
    assert ParallelConfig.parse(text) == want
    assert ParallelConfig.parse(want.name) == want
  assert ParallelConfig(dp=2, cp=4).name == 'dp2.tp1.cp4'
  assert ParallelConfig(dp=8).name == 'dp8.tp1'  # no 'cp1': every name of before stays
  assert ParallelConfig(dp=2, cp=4).batch_shards == 2


def test_wrong_device_count():
  with pytest.raises(
    mesh_lib.ShardingError, match=r'dp=2 x fsdp=1 x cp=1 x tp=2 = 4 devices\) does not match the 8'
  ):
    mesh_lib.make_mesh(ParallelConfig(dp=2, tp=2))


def test_factorizations_of_eight():
  f = mesh_lib.factorizations(8)
  assert len(f) == 10  # ordered triples with product 8
  assert all(p.num_devices == 8 for p in f)
  assert len(set(f)) == len(f)
  assert [p.tp for p in mesh_lib.factorizations(8, with_fsdp=False)] == [1, 2, 4, 8]
  with_cp = mesh_lib.factorizations(8, with_cp=True)
  assert len(with_cp) == 20  # ordered 4-tuples with product 8
  assert with_cp[:10] == f and all(p.cp > 1 for p in with_cp[10:])
  assert [p.name for p in mesh_lib.factorizations(8, with_fsdp=False, with_cp=True)][-3:] == [
    'dp2.tp1.cp4',
    'dp1.tp2.cp4',
    'dp1.tp1.cp8',
  ]


def test_model_fit_names_every_bad_dimension():
  cfg = ModelConfig.preset('qwen2.5-0.5b')  # H=14, K=2
  with pytest.raises(
    mesh_lib.ShardingError,
    match=r'num_heads \(H\)=14 is not divisible by tp=4; num_kv_heads \(K\)=2',
  ):
    mesh_lib.check_model_fits(ParallelConfig(dp=2, tp=4), cfg)
  mesh_lib.check_model_fits(ParallelConfig(dp=4, tp=2), cfg)


def test_batch_fit():
  with pytest.raises(
    mesh_lib.ShardingError,
    match=r'batch=6 is not divisible by the 4 batch shards of dp2\.fsdp2\.tp2',
  ):
    mesh_lib.check_batch_fits(ParallelConfig(dp=2, fsdp=2, tp=2), 6)
  mesh_lib.check_batch_fits(ParallelConfig(dp=2, fsdp=2, tp=2), 8)


@pytest.mark.parametrize('parallel', ['dp8', 'dp2.tp4', 'dp1.tp8', 'dp2.fsdp2.tp2'])
def test_rows_put_and_read_back_by_this_process(parallel):
  """put_rows builds a global array from this process's rows, host_rows reads them back from the
  addressable shards once each, local_rows names them (all rows in one process)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = mesh_lib.make_mesh(ParallelConfig.parse(parallel))
  sharding = NamedSharding(mesh, P(('data', 'fsdp'), None))
  values = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
  rows = mesh_lib.local_rows(sharding, (16, 3))
  np.testing.assert_array_equal(rows, np.arange(16))
  x = mesh_lib.put_rows(values[::-1], rows[::-1], (16, 3), sharding)  # any order of rows
  assert x.sharding == sharding
  got_rows, got = mesh_lib.host_rows(x)
  np.testing.assert_array_equal(got_rows, np.arange(16))
  np.testing.assert_array_equal(got, values)
  with pytest.raises(mesh_lib.ShardingError, match='row 0 of \\(16, 3\\) is not held here'):
    mesh_lib.put_rows(values[1:], rows[1:], (16, 3), sharding)
  seq = NamedSharding(mesh, P(None, 'tensor'))
  if mesh.shape['tensor'] > 1:
    with pytest.raises(mesh_lib.ShardingError, match='split a dimension other than 0'):
      mesh_lib.host_rows(jax.device_put(np.zeros((16, 8), np.float32), seq))
  r = mesh_lib.put_replicated(np.arange(2, dtype=np.uint32), NamedSharding(mesh, P()))
  assert r.sharding.is_fully_replicated and np.asarray(r).tolist() == [0, 1]


@pytest.mark.parametrize('parallel', ['dp8', 'dp2.tp4'])
def test_rows_held_by_one_process_go_over_in_one_explicit_transfer(parallel, monkeypatch):
  """When this process holds every device, put_rows and put_replicated place the whole array
  with one device_put (not one per device), allowed under the 'disallow' transfer guard, in
  any order of rows, and on a copy: the host buffer may change afterwards."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  def per_device(*args):
    raise AssertionError('put one device at a time')

  monkeypatch.setattr(mesh_lib, '_explicit', per_device)
  mesh = mesh_lib.make_mesh(ParallelConfig.parse(parallel))
  sharding = NamedSharding(mesh, P(('data', 'fsdp'), None))
  values = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)
  key = np.arange(2, dtype=np.uint32)
  with jax.transfer_guard('disallow'):
    x = mesh_lib.put_rows(values[::-1], np.arange(16)[::-1], (16, 3), sharding)
    r = mesh_lib.put_replicated(key, NamedSharding(mesh, P()))
  values[:] = -1
  key[:] = 7
  assert x.sharding == sharding and r.sharding.is_fully_replicated
  np.testing.assert_array_equal(np.asarray(x), np.arange(16 * 3).reshape(16, 3))
  assert np.asarray(r).tolist() == [0, 1]
