"""Meshes, axis names and the logical-axis rules table."""

from earl_jax.sharding import mesh, rules
from earl_jax.sharding.mesh import (
  BATCH_AXES,
  CONTEXT,
  DATA,
  FSDP,
  MESH_AXES,
  TENSOR,
  ShardingError,
  canonical_devices,
  make_mesh,
)

__all__ = [
  'BATCH_AXES',
  'CONTEXT',
  'DATA',
  'FSDP',
  'MESH_AXES',
  'TENSOR',
  'ShardingError',
  'canonical_devices',
  'make_mesh',
  'mesh',
  'rules',
]
