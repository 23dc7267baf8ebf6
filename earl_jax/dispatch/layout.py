"""Layouts: a mesh plus a PartitionSpec for every field of an RL batch pytree.

The dispatcher moves a batch from the layout of the stage that produced it to the layout of the
stage that consumes it. A layout says, for every field (leaf) of the batch pytree, how its
dimensions map onto the mesh axes:

  src = Layout.rows(rollout_mesh, batch, row_axes=('data',))            # TP engine: rows on data,
                                                                        # replicated over tensor
  dst = Layout.rows(train_mesh, batch)                                  # rows on ('data', 'fsdp')
  seq = Layout.rows(mesh, batch, row_axes=('data',), seq_axes=('tensor',))  # [B, T] fields split on T
  src.check(batch)          # fields, divisibility, dtypes, placement; errors name field and shapes

Rules (checked, with errors naming the field, its shape, the spec and the mesh):
  - Dimension 0 is the row dimension B of every field; it may be sharded over any mesh axes.
  - Dimension 1 (T for [B, T] fields) may be sharded too ("sequence-sharded"); dimensions >= 2
    may not (a spec may name an axis of size 1 there).
  - Every sharded dimension divides by its number of shards. A batch whose row count does not
    divide is padded with `pad_rows`, which returns the validity mask to carry along; nothing is
    ever replicated silently.
  - Two layouts take part in one dispatch only if their meshes hold the same devices in the
    same order (every stage mesh is built over `canonical_devices()`), since one program runs
    over both.

A layout records the batch's tree structure (so a batch with other fields is an error) and,
when built from a batch or from `ShapeDtypeStruct`s, the dtype of every field (so a batch of
another dtype is an error). It does not record the row count: the same layout serves every step.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding.mesh import BATCH_AXES, ShardingError


class LayoutError(ShardingError):
  """A layout that does not fit a batch, or two layouts that cannot take part in one dispatch."""


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def _norm_entry(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def normalize_spec(spec: P, ndim: int | None = None) -> tuple[tuple[str, ...], ...]:
  """A spec as one tuple of axis names per dimension (padded with () to `ndim`)."""
  dims = tuple(_norm_entry(e) for e in spec)
  if ndim is not None and len(dims) < ndim:
    dims = dims + ((),) * (ndim - len(dims))
  return dims


def mesh_description(mesh: Mesh) -> str:
  """'data=2 x fsdp=1 x tensor=4 over devices [0, 1, ...]' for error messages."""
  axes = ' x '.join(f'{name}={size}' for name, size in mesh.shape.items())
  ids = [d.id for d in mesh.devices.flat]
  return f'mesh ({axes}) over devices {ids}'


@dataclasses.dataclass(frozen=True)
class FieldLayout:
  """One field of a layout.

  Attributes:
    path: the field's key path, e.g. "['logprobs']" or '.tokens'.
    spec: its PartitionSpec.
    dtype: the dtype the layout expects, or None when it was not recorded.
  """

  path: str
  spec: P
  dtype: np.dtype | None


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Layout:
  """A mesh plus a PartitionSpec for every field of a batch pytree.

  Attributes:
    mesh: the stage mesh (all stage meshes share one canonical device order).
    specs: a pytree with the batch's structure whose leaves are PartitionSpecs.
    dtypes: optionally, a pytree with the same structure whose leaves are dtypes; when given,
      `check` rejects a batch whose fields have other dtypes.
  """

  mesh: Mesh
  specs: Any
  dtypes: Any = None

  def __post_init__(self):
    if not isinstance(self.mesh, Mesh):
      raise LayoutError(f'Layout.mesh must be a jax.sharding.Mesh, got {type(self.mesh)}.')
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(self.specs, is_leaf=_is_spec)
    if not path_leaves:
      raise LayoutError('Layout.specs has no fields.')
    paths = tuple(jax.tree_util.keystr(p) for p, _ in path_leaves)
    specs = tuple(s for _, s in path_leaves)
    for path, spec in zip(paths, specs):
      if not isinstance(spec, P):
        raise LayoutError(f'Layout field {path}: expected a PartitionSpec, got {spec!r}.')
      used = [a for entry in normalize_spec(spec) for a in entry]
      for axis in used:
        if axis not in self.mesh.shape:
          raise LayoutError(
            f'Layout field {path}: spec {spec} names axis {axis!r}, which is not an axis of the '
            f'{mesh_description(self.mesh)}.'
          )
      if len(set(used)) != len(used):
        raise LayoutError(f'Layout field {path}: spec {spec} uses a mesh axis twice.')
      for dim, entry in enumerate(normalize_spec(spec)):
        if dim >= 2 and math.prod(self.mesh.shape[a] for a in entry) > 1:
          raise LayoutError(
            f'Layout field {path}: spec {spec} shards dimension {dim}; only the row dimension '
            f'(0) and the sequence dimension (1) may be sharded in a dispatch layout.'
          )
    dtypes: tuple[np.dtype | None, ...]
    if self.dtypes is None:
      dtypes = (None,) * len(specs)
    else:
      dtype_leaves, dtype_def = jax.tree_util.tree_flatten(
        self.dtypes, is_leaf=lambda x: isinstance(x, (np.dtype, type))
      )
      if dtype_def != treedef:
        raise LayoutError(
          f'Layout.dtypes has structure {dtype_def}, which is not the structure of the specs '
          f'{treedef}.'
        )
      dtypes = tuple(np.dtype(d) for d in dtype_leaves)
    object.__setattr__(self, '_treedef', treedef)
    object.__setattr__(self, '_fields', tuple(map(FieldLayout, paths, specs, dtypes)))
    object.__setattr__(
      self,
      '_key',
      (
        tuple(d.id for d in self.mesh.devices.flat),
        tuple(self.mesh.shape.items()),
        str(treedef),
        tuple((normalize_spec(s), None if d is None else d.str) for s, d in zip(specs, dtypes)),
      ),
    )
    object.__setattr__(self, '_shardings', tuple(NamedSharding(self.mesh, s) for s in specs))

  # ----------------------------------------------------------------------------- constructors

  @classmethod
  def rows(
    cls,
    mesh: Mesh,
    like: Any,
    *,
    row_axes: Sequence[str] = BATCH_AXES,
    seq_axes: Sequence[str] = (),
  ) -> 'Layout':
    """Rows (dimension 0) of every field on `row_axes`; dimension 1 of [B, T, ...] fields on
    `seq_axes`; everything else replicated. Dtypes are taken from `like` (arrays or
    `jax.ShapeDtypeStruct`s with the batch's structure)."""
    row, seq = tuple(row_axes), tuple(seq_axes)

    def spec_of(x):
      if x.ndim == 0:
        raise LayoutError(f'A batch field has shape {x.shape}; every field needs a row dim.')
      if x.ndim == 1 or not seq:
        return P(row or None)
      return P(row or None, seq)

    return cls(
      mesh=mesh,
      specs=jax.tree.map(spec_of, like),
      dtypes=jax.tree.map(lambda x: np.dtype(x.dtype), like),
    )

  @classmethod
  def parse(cls, text: str, like: Any, devices: Sequence[jax.Device] | None = None) -> 'Layout':
    """A layout from a short description, for flags and tests: '<parallel>[:<kind>]'.

    <parallel> is a ParallelConfig ('dp8', 'dp2.tp4', '2x4', ...) over the canonical devices;
    <kind> is one of
      rep   rows on ('data', 'fsdp'), replicated over 'tensor' (the default; a TP engine)
      rows  rows on ('data', 'fsdp', 'tensor'): every device a different block
      seq   rows on ('data', 'fsdp'), dimension 1 of [B, T] fields on 'tensor'
      perm  rows on ('tensor', 'data', 'fsdp'): every device a block, in tensor-major order
    """
    from earl_jax.config import ParallelConfig
    from earl_jax.sharding.mesh import DATA, FSDP, TENSOR, make_mesh

    parallel, _, kind = text.partition(':')
    kind = kind or 'rep'
    axes = {
      'rep': ((DATA, FSDP), ()),
      'rows': ((DATA, FSDP, TENSOR), ()),
      'seq': ((DATA, FSDP), (TENSOR,)),
      'perm': ((TENSOR, DATA, FSDP), ()),
    }
    if kind not in axes:
      raise LayoutError(f'Unknown layout kind {kind!r} in {text!r}; known kinds: {sorted(axes)}.')
    mesh = make_mesh(ParallelConfig.parse(parallel), devices)
    row_axes, seq_axes = axes[kind]
    return cls.rows(mesh, like, row_axes=row_axes, seq_axes=seq_axes)

  @classmethod
  def of(cls, batch: Any) -> 'Layout':
    """The layout a batch of jax.Arrays already has (every field on one mesh)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(batch)
    meshes = []
    for path, x in leaves:
      sharding = getattr(x, 'sharding', None)
      if not isinstance(sharding, NamedSharding):
        raise LayoutError(
          f'Field {jax.tree_util.keystr(path)} ({type(x).__name__}, shape '
          f'{getattr(x, "shape", None)}) is not a jax.Array with a NamedSharding; build the '
          f'layout explicitly.'
        )
      meshes.append(sharding.mesh)
    mesh = meshes[0]
    for (path, _), m in zip(leaves, meshes):
      if m != mesh:
        raise LayoutError(
          f'Field {jax.tree_util.keystr(path)} is on {mesh_description(m)}, but the first field '
          f'is on {mesh_description(mesh)}; a layout has one mesh.'
        )
    return cls(
      mesh=mesh,
      specs=jax.tree.map(lambda x: x.sharding.spec, batch),
      dtypes=jax.tree.map(lambda x: np.dtype(x.dtype), batch),
    )

  # ----------------------------------------------------------------------------- accessors

  @property
  def treedef(self) -> Any:
    return self._treedef  # type: ignore[attr-defined]

  @property
  def fields(self) -> tuple[FieldLayout, ...]:
    return self._fields  # type: ignore[attr-defined]

  @property
  def num_devices(self) -> int:
    return self.mesh.devices.size

  @property
  def device_ids(self) -> tuple[int, ...]:
    return tuple(d.id for d in self.mesh.devices.flat)

  def shardings(self) -> Any:
    """A pytree of NamedShardings with the batch's structure."""
    return jax.tree.unflatten(self.treedef, list(self._shardings))  # type: ignore[attr-defined]

  def sharding(self, index: int) -> NamedSharding:
    return self._shardings[index]  # type: ignore[attr-defined]

  def key(self) -> tuple:
    """A hashable key: device order, mesh shape and axes, structure, specs and dtypes."""
    return self._key  # type: ignore[attr-defined]

  def row_shards(self, index: int) -> int:
    """Into how many blocks the rows of field `index` are split."""
    entry = normalize_spec(self.fields[index].spec, 1)[0]
    return math.prod(self.mesh.shape[a] for a in entry)

  def shards(self, index: int, ndim: int) -> tuple[int, ...]:
    """Number of shards along every dimension of field `index` with `ndim` dims."""
    return tuple(
      math.prod(self.mesh.shape[a] for a in entry)
      for entry in normalize_spec(self.fields[index].spec, ndim)
    )

  def __repr__(self) -> str:
    inner = ', '.join(f'{f.path}: {f.spec}' for f in self.fields)
    return f'Layout({mesh_description(self.mesh)}; {inner})'

  # ----------------------------------------------------------------------------- validation

  def check_structure(self, batch: Any, *, what: str = 'batch') -> list[Any]:
    """Returns the batch's leaves in layout order; raises if its fields differ from the layout's."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
    if treedef != self.treedef:
      got = {jax.tree_util.keystr(p) for p, _ in path_leaves}
      want = {f.path for f in self.fields}
      missing, extra = sorted(want - got), sorted(got - want)
      detail = []
      if missing:
        detail.append(f'missing fields {missing}')
      if extra:
        detail.append(f'unexpected fields {extra}')
      if not detail:
        detail.append(f'structure {treedef} differs from {self.treedef}')
      raise LayoutError(f'The {what} does not match the layout: ' + '; '.join(detail) + '.')
    return [x for _, x in path_leaves]

  def check(self, batch: Any, *, placed: bool = False, what: str = 'batch') -> list[Any]:
    """Validates a batch (arrays or ShapeDtypeStructs) against this layout.

    Args:
      batch: the batch pytree.
      placed: also require every field to be a jax.Array already sharded as this layout says
        (used for the source layout of a dispatch).
      what: how error messages name the batch.

    Returns:
      The batch's leaves, in layout order.

    Raises:
      LayoutError: naming the field, its shape and dtype, the spec and the mesh.
    """
    leaves = self.check_structure(batch, what=what)
    rows = None
    for index, (f, x) in enumerate(zip(self.fields, leaves)):
      shape = tuple(getattr(x, 'shape', ()))
      if len(shape) < 1:
        raise LayoutError(f'Field {f.path} of the {what} has shape {shape}; it needs a row dim.')
      spec_dims = normalize_spec(f.spec)
      if len(spec_dims) > len(shape):
        raise LayoutError(
          f'Field {f.path} of the {what} has shape {shape} but the layout spec {f.spec} has '
          f'{len(spec_dims)} entries.'
        )
      if rows is None:
        rows = shape[0]
      elif shape[0] != rows:
        raise LayoutError(
          f'Field {f.path} of the {what} has {shape[0]} rows (shape {shape}); the other fields '
          f'have {rows}. Every field of a batch shares its leading (row) dimension.'
        )
      for dim, (size, n) in enumerate(zip(shape, self.shards(index, len(shape)))):
        if size % n:
          hint = (
            ' Pad the rows with earl_jax.dispatch.pad_rows and carry the returned validity mask.'
            if dim == 0
            else ''
          )
          raise LayoutError(
            f'Field {f.path} of the {what} has shape {shape}: dimension {dim} ({size}) does not '
            f'divide into the {n} shards of spec {f.spec} on the {mesh_description(self.mesh)}.'
            + hint
          )
      dtype = getattr(x, 'dtype', None)
      if f.dtype is not None and dtype is not None and np.dtype(dtype) != f.dtype:
        raise LayoutError(
          f'Field {f.path} of the {what} has dtype {np.dtype(dtype)} (shape {shape}) but the '
          f'layout expects {f.dtype}.'
        )
      if placed:
        sharding = getattr(x, 'sharding', None)
        want = NamedSharding(self.mesh, f.spec)
        if not isinstance(x, jax.Array) or sharding is None:
          raise LayoutError(
            f'Field {f.path} of the {what} (shape {shape}) is a {type(x).__name__}, not a '
            f'jax.Array on the source layout.'
          )
        if not sharding.is_equivalent_to(want, len(shape)):
          raise LayoutError(
            f'Field {f.path} of the {what} (shape {shape}) is sharded as {sharding}, not as the '
            f'source layout says ({f.spec} on the {mesh_description(self.mesh)}).'
          )
    return leaves


def check_compatible(src: Layout, dst: Layout) -> None:
  """Raises LayoutError unless `src` and `dst` can take part in one dispatch.

  They must have the same fields, the same devices in the same order and, where both record
  them, the same dtypes.
  """
  if not mesh_lib.same_devices(src.mesh, dst.mesh):
    a, b = set(src.device_ids), set(dst.device_ids)
    kind = 'device order' if a == b else 'device set'
    raise LayoutError(
      f'Source and target layouts differ in {kind}: source {mesh_description(src.mesh)}, target '
      f'{mesh_description(dst.mesh)}. Build every stage mesh with '
      f'earl_jax.sharding.make_mesh over the same canonical devices.'
    )
  if src.treedef != dst.treedef:
    s = {f.path for f in src.fields}
    d = {f.path for f in dst.fields}
    raise LayoutError(
      f'Source and target layouts have different fields: only in source {sorted(s - d)}, only '
      f'in target {sorted(d - s)}.'
    )
  for fs, fd in zip(src.fields, dst.fields):
    if fs.dtype is not None and fd.dtype is not None and fs.dtype != fd.dtype:
      raise LayoutError(
        f'Field {fs.path}: the source layout has dtype {fs.dtype} and the target layout '
        f'{fd.dtype}; a dispatch never converts dtypes.'
      )


def row_multiple(*layouts: Layout) -> int:
  """The smallest row count multiple that every field of every layout can split."""
  out = 1
  for layout in layouts:
    for i in range(len(layout.fields)):
      out = math.lcm(out, layout.row_shards(i))
  return out


def pad_rows(batch: Any, multiple: int) -> tuple[Any, Any]:
  """Pads every field's rows up to a multiple of `multiple`, with zeros.

  Works on numpy arrays (on the host, before the batch is placed) and on jax arrays (traced or
  not). Padded rows are zeros and must be ignored through the returned mask.

  Args:
    batch: pytree of arrays that share their leading dimension B.
    multiple: the row multiple, e.g. `row_multiple(src, dst)`.

  Returns:
    (padded batch, valid_B) where valid_B is a bool array of the padded row count, True for the
    original rows.
  """
  if multiple < 1:
    raise ValueError(f'pad_rows: multiple must be >= 1, got {multiple}.')
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError('pad_rows: the batch has no fields.')
  rows = leaves[0].shape[0]
  for x in leaves:
    if x.shape[0] != rows:
      raise LayoutError(f'pad_rows: fields have different row counts ({x.shape[0]} vs {rows}).')
  padded = -(-rows // multiple) * multiple
  is_np = all(isinstance(x, np.ndarray) for x in leaves)
  xp = np if is_np else jax.numpy

  def pad(x):
    if padded == rows:
      return x
    width = [(0, padded - rows)] + [(0, 0)] * (x.ndim - 1)
    return xp.pad(x, width)

  valid = xp.arange(padded) < rows
  return jax.tree.map(pad, batch), valid
