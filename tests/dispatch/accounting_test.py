"""Reading collectives and their bytes from compiled HLO text."""

import numpy as np

from earl_jax.dispatch import hlo_collective_counts, hlo_collectives, hlo_received_bytes

_HLO = """
ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %cp = f32[4,16]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={{0,1},{1,0},{2,2}}
  %a2a = (f32[1,16]{1,0}, f32[1,16]{1,0}, f32[1,16]{1,0}, f32[1,16]{1,0}) all-to-all(%a, %b, %c, %d), channel_id=2, replica_groups={{0,1,2,3}}
  %ag = u8[64,16]{1,0} all-gather(%p), channel_id=3, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
  %ags = (f32[2]{0}, f32[8]{0}) all-gather-start(%q), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  ROOT %r = pred[2,3]{1,0} all-reduce(%x), channel_id=5, replica_groups={{0,1},{2,3}}, to_apply=%sum
}
"""


def test_hlo_collectives_parse_kinds_sizes_pairs_and_groups():
  ops = hlo_collectives(_HLO, 4)
  assert [o.kind for o in ops] == [
    'collective-permute',
    'all-to-all',
    'all-gather',
    'all-gather',
    'all-reduce',
  ]
  assert ops[0].result_bytes == 4 * 16 * 4 and ops[0].pairs == ((0, 1), (1, 0), (2, 2))
  assert ops[1].result_bytes == 4 * 16 * 4 and ops[1].group_size == 4
  assert ops[2].result_bytes == 64 * 16 and ops[2].group_size == 4
  assert ops[3].result_bytes == 8 * 4 and ops[3].group_size == 4
  assert ops[4].result_bytes == 6 and ops[4].group_size == 2
  assert hlo_collective_counts(_HLO, 4) == {
    'collective-permute': 1,
    'all-to-all': 1,
    'all-gather': 2,
    'all-reduce': 1,
  }


def test_hlo_received_bytes_skip_self_pairs_and_own_chunks():
  got = hlo_received_bytes(_HLO, 4)
  shared = 256 * 3 // 4 + 1024 * 3 // 4 + 32 * 3 // 4 + 6 // 2
  np.testing.assert_array_equal(got, [256 + shared, 256 + shared, shared, shared])
