"""Small function bodies that tests run in several processes (see testing.multiprocess)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def global_psum() -> dict:
  """Every device holds its global index; a jitted sum over the global array adds them."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  sharding = NamedSharding(mesh, P('x'))
  index = {d: i for i, d in enumerate(jax.devices())}
  local = [jax.device_put(np.array([float(index[d])], np.float32), d) for d in jax.local_devices()]
  x = jax.make_array_from_single_device_arrays((jax.device_count(),), sharding, local)
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
  return {
    'process_index': jax.process_index(),
    'device_count': jax.device_count(),
    'local_device_count': jax.local_device_count(),
    'psum': float(total.addressable_data(0)),
  }
