"""The program: the process a worker forks for each job; everything after `contain` is untrusted.

It confines itself (`_containment.contain`) and reports its setup frame; then it either execs a
command, or runs the candidate's source as module `main` and answers the test calls one at a time
over its result pipe (fd 3), each return value encoded with its type (plain types only). It never
sees the expected values: the trusted parent compares.
"""

import contextlib
import json
import os
import signal
import sys
import types

import _containment
import _wire


def program_main(job, confinement):
  """The forked program: confines itself, then runs the command or the source. Never returns."""
  try:
    _containment.contain(confinement)
    # Only after this frame does anything untrusted run: a program that dies before it is our
    # failure (the parent raises SandboxError), one that dies after it is the program's.
    _report(_wire.INDEX_SETUP, _wire.KIND_SETUP)
  except BaseException:
    os._exit(1)
  if job['op'] == 'command':
    _exec_command(job['argv'], confinement.env)
  try:
    _run_program(job['source'], job['calls'], confinement.workdir)
  except MemoryError:
    os._exit(_wire.EXIT_MEMORY)
  except BaseException:
    pass
  os._exit(0)


def _exec_command(argv, env):
  """Execs `argv` (`python`: this interpreter, isolated); exit code 127 if it cannot start."""
  argv = list(argv)
  if argv[0] == 'python':
    argv = [sys.executable, '-I', '-S', '-B', *argv[1:]]
  try:
    for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
      signal.signal(sig, signal.SIG_DFL)  # Python ignores these; a fresh program should not
    os.close(_wire.RESULT_FD)
    os.execvpe(argv[0], argv, env)
  except OSError as e:
    os.write(2, f'cannot run {argv[0]!r}: {e.strerror}\n'.encode())
  os._exit(127)


def _run_program(source, calls, workdir):
  """Loads `source` as module `main`, then evaluates each call, reporting every outcome."""
  sys.path.insert(0, workdir)
  module = types.ModuleType('main')
  module.__file__ = os.path.join(workdir, 'main.py')
  sys.modules['main'] = module
  try:
    exec(compile(source, module.__file__, 'exec'), module.__dict__)
  except BaseException as e:  # SystemExit and KeyboardInterrupt included: a load that did not end
    _flush_output()
    _report(_wire.INDEX_LOAD, _wire.KIND_LOAD_ERROR, _wire.exception_payload(e))
    return
  _flush_output()
  _report(_wire.INDEX_LOAD, _wire.KIND_LOADED)
  for index, call in enumerate(calls):
    try:
      value = eval(compile(call, '<test>', 'eval'), module.__dict__)
    except BaseException as e:
      _flush_output()
      _report(index, _wire.KIND_EXCEPTION, _wire.exception_payload(e))
      continue
    # Encoded inline: a helper's frame would take one level off the program's recursion limit.
    try:
      payload = json.dumps(_wire.encode_value(value), separators=(',', ':')).encode()
      kind = _wire.KIND_VALUE
    except _wire.UnsupportedError as e:
      payload, kind = json.dumps([str(e)]).encode(), _wire.KIND_UNSUPPORTED
    except RecursionError:
      payload, kind = json.dumps(['nesting too deep to encode']).encode(), _wire.KIND_UNSUPPORTED
    _flush_output()
    _report(index, kind, payload)


def _report(index, kind, payload=b''):
  _wire.write_all(_wire.RESULT_FD, _wire.result_frame(index, kind, payload))


def _flush_output():
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(BaseException):
      stream.flush()
