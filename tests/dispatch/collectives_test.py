"""The dispatch kernels against a dense single-device reference: values, gradients, word packing."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.dispatch import Layout, PlanOptions, collectives, make_plan
from earl_jax.dispatch import landing as landing_lib
from earl_jax.testing import dispatch_bodies as bodies

ROWS, LENGTH = 16, 8


def _host():
  rng = np.random.default_rng(0)
  return {
    'logprobs': rng.standard_normal((ROWS, LENGTH)).astype(np.float32),
    'mask': rng.random((ROWS, LENGTH)) > 0.5,
    'lengths': rng.integers(1, LENGTH + 1, ROWS).astype(np.int32),
  }


def _plan(src, dst, leaves, perm, collective, **plan_options):
  shapes, dtypes = [x.shape for x in leaves], [x.dtype for x in leaves]
  options = PlanOptions(collective=collective, **plan_options)
  return make_plan(src, dst, shapes, dtypes, perm=perm, options=options)


def _kernel(host, src_text, dst_text, perm, collective, **plan_options):
  src, dst = Layout.parse(src_text, host), Layout.parse(dst_text, host)
  plan = _plan(src, dst, jax.tree.leaves(host), perm, collective, **plan_options)
  tables = collectives.device_tables(collectives.plan_tables(plan), src.mesh)
  return src, dst, collectives.make_kernel(plan, src), tables


CASES = [
  ('dp8', 'dp4.tp2', None, 'ppermute'),
  ('dp2.tp4', 'dp8', 'random', 'ppermute'),
  ('dp4.tp2:seq', 'dp2.tp4', None, 'ppermute'),
  ('dp8:perm', 'dp2.fsdp2.tp2', 'random', 'all_to_all'),
  ('dp1.tp8:rows', 'dp8', 'reverse', 'all_to_all'),
]


def _perm(kind):
  if kind is None:
    return None
  if kind == 'reverse':
    return np.arange(ROWS)[::-1].copy()
  return np.random.default_rng(1).permutation(ROWS)


@pytest.mark.parametrize(('src_text', 'dst_text', 'perm_kind', 'collective'), CASES)
def test_kernel_and_rewrap_match_the_dense_reference(src_text, dst_text, perm_kind, collective):
  """Every target block holds exactly host[perm] on the device the target sharding names."""
  host, perm = _host(), _perm(perm_kind)
  src, dst, kernel, tables = _kernel(host, src_text, dst_text, perm, collective)
  leaves = jax.tree.leaves(bodies.place(host, src))
  with jax.transfer_guard('disallow'):
    raw = kernel(leaves, tables)
    outs = [
      collectives.rewrap(o, x.shape, dst.sharding(i)) for i, (o, x) in enumerate(zip(raw, leaves))
    ]
  out = jax.tree.unflatten(dst.treedef, outs)
  assert bodies.check_placed(out, host, dst, perm) == []


@pytest.mark.parametrize('static', [True, False])
def test_kernel_with_pairs_cut_over_rounds_matches_the_dense_reference(static):
  """A pair cut into chunks (`schedule._chunkings`) sends its next units in each of its rounds."""
  rows, length = 64, 32768  # 8 MiB: large enough that bytes, not rounds, set the schedule
  rng = np.random.default_rng(4)
  host = {
    'logprobs': rng.standard_normal((rows, length)).astype(np.float32),
    'lengths': rng.integers(1, length + 1, rows).astype(np.int32),
  }
  perm = (np.arange(rows) + rows // 8) % rows
  src, dst = Layout.parse('dp2.tp4:seq', host), Layout.parse('dp4.tp2', host)
  leaves = jax.tree.leaves(host)
  plan = make_plan(
    src,
    dst,
    [x.shape for x in leaves],
    [x.dtype for x in leaves],
    perm=perm,
    options=PlanOptions(static=static),
  )
  uses = collections.Counter(pair for r in plan.rounds for pair in r.pairs)
  assert max(uses.values()) == 2
  tables = collectives.device_tables(collectives.plan_tables(plan), src.mesh)
  raw = collectives.make_kernel(plan, src)(jax.tree.leaves(bodies.place(host, src)), tables)
  outs = [
    collectives.rewrap(o, x.shape, dst.sharding(i)) for i, (o, x) in enumerate(zip(raw, leaves))
  ]
  assert bodies.check_placed(jax.tree.unflatten(dst.treedef, outs), host, dst, perm) == []


@pytest.mark.parametrize(('src_text', 'dst_text', 'perm_kind', 'collective'), CASES[:4])
def test_kernel_gradient_is_the_reverse_move(src_text, dst_text, perm_kind, collective):
  """A dispatch is linear: the gradient of <w, kernel(x)> w.r.t. x is w moved back, which a
  dense reference computes by scatter-adding w at the source index of every output element.
  (Unpacked plans: a packed round bitcasts its fields to shared words, which has no gradient.)"""
  host, perm = _host(), _perm(perm_kind)
  x = host['logprobs']
  src, _, kernel, tables = _kernel(host, src_text, dst_text, perm, collective, pack_max_bytes=0)
  placed = jax.tree.leaves(bodies.place(host, src))
  i = sorted(host).index('logprobs')  # dict fields flatten in key order
  assert np.array_equal(np.asarray(placed[i]), x)
  # Which source element each raw output element holds: run the kernel on the element indices.
  iota = np.arange(x.size, dtype=np.float32).reshape(x.shape)  # exact in f32 (< 2^24)
  index_leaves = list(placed)
  index_leaves[i] = bodies.place({'a': iota}, Layout.parse(src_text, {'a': iota}))['a']
  source_of = np.asarray(kernel(index_leaves, tables)[i]).astype(np.int64)
  w = np.random.default_rng(2).standard_normal(source_of.shape).astype(np.float32)

  def objective(field):
    leaves = list(placed)
    leaves[i] = field
    return jnp.sum(kernel(leaves, tables)[i] * w)

  grad = np.asarray(jax.grad(objective)(placed[i]))
  expected = np.zeros(x.size, np.float32)
  np.add.at(expected, source_of.reshape(-1), w.reshape(-1))
  np.testing.assert_allclose(grad, expected.reshape(x.shape), rtol=1e-6, atol=1e-6)
  # Every source element reaches the output at least once (nothing is dropped).
  assert set(source_of.reshape(-1).tolist()) == set(range(x.size))


@pytest.mark.parametrize('dtype', [np.float32, jnp.bfloat16, np.int32, np.int8, np.bool_])
def test_words_round_trip_bit_for_bit(dtype):
  rng = np.random.default_rng(3)
  x = rng.standard_normal((4, 3, 5)) * 50
  x = (x > 0) if dtype is np.bool_ else x.astype(dtype)
  words = collectives.to_words(jnp.asarray(x), 4)
  assert words.shape == (4, 15) and jnp.issubdtype(words.dtype, jnp.unsignedinteger)
  back = np.asarray(collectives.from_words(words, np.dtype(dtype), x.shape))
  assert back.dtype == np.dtype(dtype)
  np.testing.assert_array_equal(back.view(np.uint8), np.asarray(x).view(np.uint8))


def test_pack_classes_group_buffers_by_item_size_largest_first():
  dtypes = [np.dtype(d) for d in (np.float32, np.bool_, np.int32, jnp.bfloat16, np.int8)]
  assert collectives.pack_classes(dtypes) == [[0, 2], [3], [1, 4]]


def test_device_tables_put_row_k_on_device_k():
  host = _host()
  mesh = Layout.parse('dp2.tp4', host).mesh
  table = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
  [placed] = collectives.device_tables([table], mesh)
  devices = list(mesh.devices.flat)
  for shard in placed.addressable_shards:
    k = devices.index(shard.device)
    np.testing.assert_array_equal(np.asarray(shard.data), table[k : k + 1])


def test_take_rows_is_a_row_gather():
  x = jnp.arange(12.0).reshape(6, 2)
  idx = jnp.array([5, 0, 0, 3], jnp.int32)
  np.testing.assert_array_equal(
    np.asarray(collectives.take_rows(x, idx)), np.asarray(x)[[5, 0, 0, 3]]
  )


@pytest.mark.parametrize(('src_text', 'dst_text', 'perm_kind', 'collective'), CASES)
def test_recycling_kernel_lands_outputs_in_the_given_buffers(
  src_text, dst_text, perm_kind, collective
):
  """With recycle=True every new-buffer output is written into its donated landing buffer (the
  same memory), the values match the dense reference, and the spent sources come back whole."""
  host, perm = _host(), _perm(perm_kind)
  src, dst = Layout.parse(src_text, host), Layout.parse(dst_text, host)
  leaves = bodies.device_copy(jax.tree.leaves(bodies.place(host, src)))
  plan = _plan(src, dst, leaves, perm, collective)
  tables = collectives.device_tables(collectives.plan_tables(plan), src.mesh)
  kernel = collectives.make_kernel(plan, src, donate=True, recycle=True)
  fields = landing_lib.landing_fields(plan)
  assert fields  # every case moves data
  pool = landing_lib.BufferPool()
  landing = [pool.landing(landing_lib.output_struct(plan, src, i))[0] for i in fields]
  at = [bodies.buffers(x) for x in landing]
  source_at = {i: bodies.buffers(leaves[i]) for i in fields}
  raw, spent = kernel(leaves, tables, landing)
  for i, where in zip(fields, at):
    assert bodies.buffers(raw[i]) == where
  for i, x in zip(fields, spent):  # the source blocks, unchanged, in their own memory
    assert bodies.buffers(x) == source_at[i]
    np.testing.assert_array_equal(np.asarray(x), jax.tree.leaves(host)[i])
  outs = [
    collectives.rewrap(o, x.shape, dst.sharding(i)) for i, (o, x) in enumerate(zip(raw, leaves))
  ]
  assert bodies.check_placed(jax.tree.unflatten(dst.treedef, outs), host, dst, perm) == []


def _dirty(struct: jax.ShapeDtypeStruct) -> jax.Array:
  """A landing buffer full of a value no field holds (an old batch's leftovers)."""
  fill = True if struct.dtype == np.bool_ else -77
  # Made on the devices (a device_put of a NumPy array may alias host memory, which XLA:CPU
  # does not donate).
  return jax.jit(
    lambda: jnp.full(struct.shape, fill, struct.dtype), out_shardings=struct.sharding
  )()


@pytest.mark.parametrize(('src_text', 'dst_text', 'perm_kind', 'collective'), CASES)
@pytest.mark.parametrize('recycle', [True, False])
def test_landing_kernels_write_every_slot_of_a_dirty_landing_buffer(
  src_text, dst_text, perm_kind, collective, recycle
):
  """A `land` plan's 'scatter' outputs, written region by region into landing buffers that
  hold another batch's values (recycle) or into zeros (no landing buffer): every slot is
  overwritten, the values match the dense reference, and a recycled output is its landing
  buffer's memory."""
  host, perm = _host(), _perm(perm_kind)
  src, dst = Layout.parse(src_text, host), Layout.parse(dst_text, host)
  leaves = bodies.device_copy(jax.tree.leaves(bodies.place(host, src)))
  plan = _plan(src, dst, leaves, perm, collective, land=True, land_min_bytes=0)
  tables = collectives.device_tables(collectives.plan_tables(plan), src.mesh)
  if recycle:
    kernel = collectives.make_kernel(plan, src, donate=True, recycle=True)
    fields = landing_lib.landing_fields(plan)
    landing = [_dirty(landing_lib.output_struct(plan, src, i)) for i in fields]
    at = [bodies.buffers(x) for x in landing]
    raw, _ = kernel(leaves, tables, landing)
    for i, where in zip(fields, at):
      assert bodies.buffers(raw[i]) == where
  else:
    raw = collectives.make_kernel(plan, src)(leaves, tables)
  outs = [
    collectives.rewrap(o, x.shape, dst.sharding(i)) for i, (o, x) in enumerate(zip(raw, leaves))
  ]
  assert bodies.check_placed(jax.tree.unflatten(dst.treedef, outs), host, dst, perm) == []


def test_landing_kernel_holds_about_one_round_of_temporaries():
  """dp8 -> dp8 with random rows: 7 rounds of row gathers. The gather output keeps every
  received buffer live until its final gather; the landing kernel writes each round's buffer
  as it arrives, and each round's sends wait for the last round's writes (`_after`), so its
  temporaries are about one round's send and receive buffers, whatever the number of rounds."""
  rows, length = 512, 256
  structs = {'logprobs': jax.ShapeDtypeStruct((rows, length), np.float32)}
  src = Layout.parse('dp8', structs)
  perm = np.random.default_rng(2).permutation(rows)
  temps, rounds = {}, None
  for land in (False, True):
    options = PlanOptions(land=land, land_min_bytes=0)
    plan = make_plan(src, src, [(rows, length)], [np.dtype(np.float32)], perm=perm, options=options)
    rounds = plan.rounds
    kernel = collectives.make_kernel(plan, src, donate=True, recycle=True)
    leaves = [jax.ShapeDtypeStruct((rows, length), np.float32, sharding=src.sharding(0))]
    tables = [
      jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=jax.NamedSharding(src.mesh, jax.P(('data',))))
      for t in collectives.plan_tables(plan)
    ]
    landing = [landing_lib.output_struct(plan, src, i) for i in landing_lib.landing_fields(plan)]
    compiled = kernel.lower(leaves, tables, landing).compile()
    temps[land] = compiled.memory_analysis().temp_size_in_bytes
  row_bytes = length * 4
  assert len(rounds) == 7
  assert temps[False] >= sum(r.caps[0] for r in rounds) * row_bytes  # every received buffer
  # About one round's send and receive buffers (and a local piece), not seven.
  assert temps[True] <= 3 * max(r.caps[0] for r in rounds) * row_bytes
  assert temps[True] < temps[False] / 2, temps


def test_buffer_pool_reuses_matching_blocks_and_keeps_two_calls():
  mesh = Layout.parse('dp8', _host()).mesh
  struct = jax.ShapeDtypeStruct(
    (16, 4), np.float32, sharding=jax.NamedSharding(mesh, jax.P('data'))
  )
  pool = landing_lib.BufferPool(keep_calls=2)
  fresh, reused = pool.landing(struct)
  assert reused == 0 and np.all(np.asarray(fresh) == 0)
  spent = [jax.device_put(np.ones((16, 4), np.float32), struct.sharding) for _ in range(3)]
  at = bodies.buffers(spent[2])
  for x in spent:  # three calls: the first one's buffers are dropped
    pool.add([x])
  assert pool.nbytes == 2 * spent[0].nbytes
  got, reused = pool.landing(struct)  # the newest first
  assert reused == got.nbytes and got.sharding == struct.sharding
  assert bodies.buffers(got) == at
  odd = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=struct.sharding)
  assert pool.landing(odd)[1] == 0  # no block of that shape
