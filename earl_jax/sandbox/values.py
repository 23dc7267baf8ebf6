"""Strict decoding of the values a sandboxed program reports, and their comparison with expected ones.

The program encodes each return value with its type (`_wire.encode_value`): tagged JSON lists
that can only describe None, bool, int, float, complex, str, bytes and lists, tuples, sets,
frozensets and dicts of them. This side rebuilds exactly those types and nothing else, so an
object of a user class (one whose `__eq__` always returns True, say) can never reach a comparison:
the program refuses to encode it, and a forged encoding can only describe a plain value.
"""

import json
import math
import re
from typing import Any

MAX_DEPTH = 100
_HEX_INT = re.compile(r'-?0x[0-9a-f]+')
_SEQUENCES = {'l': list, 't': tuple, 'S': set, 'Z': frozenset}


class MalformedValueError(ValueError):
  """The reported bytes do not describe a plain value."""


def decode_value(text: str) -> Any:
  """Rebuilds a plain value from its tagged JSON; MalformedValueError for anything else."""
  try:
    tree = json.loads(text)
  except (ValueError, RecursionError) as e:
    raise MalformedValueError(f'not JSON: {type(e).__name__}') from None
  try:
    return _build(tree, 0)
  except MalformedValueError:
    raise
  except (TypeError, ValueError, OverflowError, RecursionError, IndexError) as e:
    raise MalformedValueError(f'{type(e).__name__}: {e}') from None


def _build(node: Any, depth: int) -> Any:
  if depth > MAX_DEPTH:
    raise MalformedValueError(f'nested deeper than {MAX_DEPTH}')
  if not isinstance(node, list) or not node or not isinstance(node[0], str):
    raise MalformedValueError(f'not a tagged value: {str(node)[:40]}')
  tag, args = node[0], node[1:]
  if tag == 'n' and not args:
    return None
  if len(args) == 1:
    (arg,) = args
    if tag == 'b' and isinstance(arg, bool):
      return arg
    if tag == 'i' and isinstance(arg, str) and _HEX_INT.fullmatch(arg):
      return int(arg, 16)
    if tag == 'f' and isinstance(arg, str):
      return float.fromhex(arg)
    if tag == 's' and isinstance(arg, str):
      return arg
    if tag == 'y' and isinstance(arg, str):
      return bytes.fromhex(arg)
    if tag in _SEQUENCES and isinstance(arg, list):
      return _SEQUENCES[tag](_build(item, depth + 1) for item in arg)
    if tag == 'd' and isinstance(arg, list):
      result = {}
      for pair in arg:
        if not isinstance(pair, list) or len(pair) != 2:
          raise MalformedValueError('a dict entry that is not a pair')
        result[_build(pair[0], depth + 1)] = _build(pair[1], depth + 1)
      return result
  if tag == 'c' and len(args) == 2 and all(isinstance(a, str) for a in args):
    return complex(float.fromhex(args[0]), float.fromhex(args[1]))
  raise MalformedValueError(f'unknown tag {tag!r} with {len(args)} argument(s)')


def values_match(got: Any, expected: Any, *, rel_tol: float = 0.0, abs_tol: float = 0.0) -> bool:
  """`got == expected` (Python's own equality, as an `assert ... ==` test has it), with floats
  compared within the tolerances when either is set (elementwise inside lists, tuples and dicts)."""
  if rel_tol == 0.0 and abs_tol == 0.0:
    return bool(got == expected)
  return _close(got, expected, rel_tol, abs_tol)


def _close(got: Any, expected: Any, rel_tol: float, abs_tol: float) -> bool:
  number = (int, float)
  if isinstance(got, number) and isinstance(expected, number):
    if isinstance(got, bool) or isinstance(expected, bool):
      return got == expected
    return math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
  if isinstance(got, (list, tuple)) and type(got) is type(expected):
    return len(got) == len(expected) and all(
      _close(g, e, rel_tol, abs_tol) for g, e in zip(got, expected)
    )
  if isinstance(got, dict) and isinstance(expected, dict):
    return got.keys() == expected.keys() and all(
      _close(got[k], expected[k], rel_tol, abs_tol) for k in got
    )
  return bool(got == expected)
