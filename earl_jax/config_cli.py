"""`--config=<preset>` and `--config.a.b=value` overrides for frozen, validated config dataclasses.

`ml_collections.config_flags.DEFINE_config_dataclass` sets fields with `setattr`, which frozen
dataclasses refuse; this module gives the same command line while keeping configs frozen: every
override is applied with `dataclasses.replace`, so `__post_init__` validates the result.

  _CONFIG = config_cli.DEFINE_config('config', presets=PRESETS, default='default')
  ...
  app.run(main, flags_parser=_CONFIG.flags_parser)   # several: config_cli.flags_parser(_A, _B)
  # python experiments/train.py --config=long --config.optim.learning_rate=3e-4 \
  #     --config.buckets.lengths=256,512,1024

Values are parsed by the field's annotation: int, float, bool (true/false/1/0), str, None
('none'), Literal choices, and tuples ('1,2,3' or '(1, 2, 3)').
"""

import ast
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import flags

from earl_jax.errors import UserError


class ConfigOverrideError(UserError):
  """A `--config...` argument that names no field or does not parse as the field's type."""


def _parse_value(text: str, annotation: Any, where: str) -> Any:
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if origin in (typing.Union, types.UnionType):
    if text.strip().lower() == 'none' and type(None) in args:
      return None
    errors = []
    for arg in args:
      if arg is type(None):
        continue
      try:
        return _parse_value(text, arg, where)
      except (ConfigOverrideError, ValueError) as e:
        errors.append(str(e))
    raise ConfigOverrideError(f'{where}: cannot parse {text!r} as {annotation}: {errors}')
  if origin is typing.Literal:
    for choice in args:
      if str(choice) == text:
        return choice
    raise ConfigOverrideError(f'{where}: {text!r} is not one of {list(args)}.')
  if origin is tuple:
    stripped = text.strip()
    if stripped.startswith('(') or stripped.startswith('['):
      try:
        items = list(ast.literal_eval(stripped))
      except (SyntaxError, ValueError, TypeError):
        raise ConfigOverrideError(
          f'{where}: {text!r} is not a tuple: expected comma-separated values, e.g. 64,128 '
          'or (64, 128).'
        ) from None
    else:
      items = [s for s in stripped.split(',') if s.strip()]
    item_type = args[0] if args else str
    return tuple(
      _parse_value(str(x).strip(), item_type, f'{where}[{i}]') for i, x in enumerate(items)
    )
  if annotation is bool:
    lowered = text.strip().lower()
    if lowered in ('true', '1', 'yes'):
      return True
    if lowered in ('false', '0', 'no'):
      return False
    raise ConfigOverrideError(f'{where}: {text!r} is not a bool (true/false).')
  if annotation is int:
    try:
      return int(text)
    except ValueError:
      raise ConfigOverrideError(f'{where}: {text!r} is not an int.') from None
  if annotation is float:
    try:
      return float(text)
    except ValueError:
      raise ConfigOverrideError(f'{where}: {text!r} is not a number.') from None
  if annotation is str or annotation is Any:
    return text
  if isinstance(annotation, type) and issubclass(annotation, str):  # str enums
    return annotation(text)
  raise ConfigOverrideError(
    f'{where}: cannot set a field of type {annotation} from the command line.'
  )


def apply_override(config: Any, path: str, text: str) -> Any:
  """Returns `config` with the field at dotted `path` set from `text`."""
  head, _, rest = path.partition('.')
  if not dataclasses.is_dataclass(config):
    raise ConfigOverrideError(f'Cannot override {path!r}: {type(config).__name__} is not a config.')
  fields = {f.name: f for f in dataclasses.fields(config)}
  if head not in fields:
    raise ConfigOverrideError(
      f'{type(config).__name__} has no field {head!r}; fields: {sorted(fields)}.'
    )
  current = getattr(config, head)
  if rest:
    value = apply_override(current, rest, text)
  else:
    hints = typing.get_type_hints(type(config))
    value = _parse_value(text, hints[head], f'{type(config).__name__}.{head}')
  return dataclasses.replace(config, **{head: value})


def apply_overrides(config: Any, overrides: Sequence[tuple[str, str]], *, flag: str) -> Any:
  """`config` with the `--flag.path=text` overrides applied (a path given twice: its last value).
  Their order does not matter: one the config refuses as it stands (a combination of fields,
  e.g. an estimator that needs a group size set by a later override) is tried again once the
  others are applied. An error (a value that does not parse, or that the config refuses
  whatever the order) names that override's flag first."""
  pending = list(dict(overrides).items())  # in order, each path once, with its last value
  while pending:
    refused: list[tuple[tuple[str, str], UserError]] = []
    for path, text in pending:
      try:
        config = apply_override(config, path, text)
      except ConfigOverrideError as e:  # names no field, or does not parse: in any order
        raise _named(e, flag, path, text) from None
      except UserError as e:
        refused.append(((path, text), e))
    if len(refused) == len(pending):  # no progress: the first refusal stands
      (path, text), e = refused[0]
      raise _named(e, flag, path, text) from None
    pending = [override for override, _ in refused]
  return config


def _named(error: UserError, flag: str, path: str, text: str) -> UserError:
  """`error` with the override's flag named first (its type kept)."""
  error.args = (f'--{flag}.{path}={text}: {error}',)
  return error


class ConfigFlag:
  """`--name=<preset>` and the `--name.a.b=value` overrides that go with it (see the module)."""

  def __init__(self, name: str, presets: Mapping[str, Callable[[], Any]], default: str):
    if default not in presets:
      raise ValueError(f'default preset {default!r} is not in {sorted(presets)}.')
    self.name = name
    self.presets = presets
    self._overrides: list[tuple[str, str]] = []
    self._preset = flags.DEFINE_enum(
      name, default, sorted(presets), f'Config preset; override fields with --{name}.a.b=value.'
    )

  @property
  def preset(self) -> str:
    return self._preset.value

  @property
  def overrides(self) -> list[tuple[str, str]]:
    return list(self._overrides)

  def set_overrides(self, overrides: Sequence[tuple[str, str]]) -> None:
    self._overrides = list(overrides)

  @property
  def value(self) -> Any:
    return apply_overrides(self.presets[self._preset.value](), self._overrides, flag=self.name)

  def flags_parser(self, argv: Sequence[str]) -> list[str]:
    """An absl `flags_parser` for this config flag alone."""
    return flags_parser(self)(argv)


def DEFINE_config(
  name: str, *, presets: Mapping[str, Callable[[], Any]], default: str
) -> ConfigFlag:
  """Defines `--name=<preset>` plus `--name.field.sub=value` overrides (see module docstring)."""
  return ConfigFlag(name, presets, default)


def split_overrides(
  argv: Sequence[str], names: Sequence[str]
) -> tuple[list[str], dict[str, list[tuple[str, str]]]]:
  """Separates `--name.path=value` arguments (for each of `names`) from the rest."""
  rest, found = [], {}
  for arg in argv:
    matched = False
    for name in names:
      prefix = f'--{name}.'
      if arg.startswith(prefix):
        path, sep, value = arg[len(prefix) :].partition('=')
        if not sep:
          raise ConfigOverrideError(f'{arg}: overrides need a value, e.g. {prefix}{path}=...')
        found.setdefault(name, []).append((path, value))
        matched = True
        break
    if not matched:
      rest.append(arg)
  return rest, found


def flags_parser(*config_flags: ConfigFlag) -> Callable[[Sequence[str]], list[str]]:
  """An absl `flags_parser` that takes the overrides of `config_flags` out before absl parses."""

  def parse(argv: Sequence[str]) -> list[str]:
    rest, found = split_overrides(argv, [c.name for c in config_flags])
    for c in config_flags:
      c.set_overrides(found.get(c.name, []))
    return flags.FLAGS(rest)

  return parse
