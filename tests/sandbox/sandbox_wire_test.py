"""The wire protocol has one definition: the launcher, started as `python -I -S`, loads the same
`_wire.py` as the parent, with the standard library only, and each side reads what the other
writes."""

import json
import os
import subprocess
import sys

import pytest

from earl_jax.sandbox import _wire, values
from earl_jax.sandbox import sandbox as sandbox_module

# Run by `python -I -S`, as the launcher is: imports _launcher.py by its path (without starting
# it), reads one job frame on stdin with the launcher's `_wire` and answers with one on stdout.
_ECHO = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location('launcher', sys.argv[1])
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)
wire = launcher._wire
job = wire.read_frame(0)
constants = {
  name: list(value) if isinstance(value, tuple) else value
  for name, value in vars(wire).items()
  if name.isupper() and isinstance(value, (int, tuple))
}
wire.write_frame(1, {
  'job': job,
  'wire_file': wire.__file__,
  'constants': constants,
  'headers': [wire.FRAME_HEADER.format, wire.RESULT_HEADER.format],
  'value': wire.encode_value(job['value']),
  'result_frame': wire.result_frame(0, wire.KIND_VALUE, b'xy').hex(),
  'modules': sorted(sys.modules),
})
"""
_JOB = {'op': 'check', 'id': 7, 'source': 'def f():\n  return "é"\n', 'value': [1, ['é', 2.5]]}


@pytest.fixture(scope='module')
def echo():
  """The launcher side's answer to `_JOB`, written by the parent's `_wire`."""
  run = subprocess.run(
    [sys.executable, '-I', '-S', '-c', _ECHO, sandbox_module._LAUNCHER],
    input=_wire.encode_frame(_JOB),
    capture_output=True,
    timeout=60,
    check=False,
  )
  assert run.returncode == 0, run.stderr.decode(errors='replace')[-2000:]
  buffer = bytearray(run.stdout)
  (reply,) = _wire.take_frames(buffer)
  assert not buffer
  return reply


def test_each_side_reads_the_frames_the_other_writes(echo):
  assert echo['job'] == _JOB
  assert values.decode_value(json.dumps(echo['value'])) == _JOB['value']
  frame = bytes.fromhex(echo['result_frame'])
  size, index, kind = _wire.RESULT_HEADER.unpack_from(frame)
  assert (size, index, kind) == (2, 0, _wire.KIND_VALUE)
  assert frame[_wire.RESULT_HEADER.size :] == b'xy'


def test_every_constant_the_parent_uses_is_the_launchers(echo):
  assert os.path.realpath(echo['wire_file']) == os.path.realpath(_wire.__file__)
  assert echo['headers'] == [_wire.FRAME_HEADER.format, _wire.RESULT_HEADER.format]
  parent = {
    name: list(value) if isinstance(value, tuple) else value
    for name, value in vars(_wire).items()
    if name.isupper() and isinstance(value, (int, tuple))
  }
  assert echo['constants'] == parent
  assert {'KIND_EXCEPTION', 'KIND_UNSUPPORTED', 'EXIT_MEMORY'} <= set(parent)
  # The parent takes them from `_wire` and keeps no copy of its own.
  assert sandbox_module._wire is _wire
  prefixes = ('KIND_', 'EXIT_', 'RESULT_', 'FRAME_', 'INDEX_')
  assert [name for name in vars(sandbox_module) if name.lstrip('_').startswith(prefixes)] == []


def test_the_launcher_imports_the_standard_library_only(echo):
  modules = set(echo['modules'])
  top_level = {name.split('.')[0] for name in modules} - {'launcher', '__main__'}
  stdlib = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
  assert sorted(top_level - stdlib) == []
  # Its own modules are dropped from sys.modules once imported: a program's `_wire.py` is its own.
  assert sorted(modules & {'_wire', '_pool', '_worker', '_supervise', '_containment'}) == []
