"""One small sandbox pool shared by the code environment tests."""

import pytest

from earl_jax.sandbox import Sandbox, SandboxConfig


@pytest.fixture(scope='session')
def sandbox():
  with Sandbox(SandboxConfig(workers=2, test_timeout_s=2.0, program_timeout_s=5.0)) as pool:
    yield pool


class CountingSandbox:
  """Forwards to a real sandbox and records the size of every `check_many` batch."""

  def __init__(self, sandbox):
    self.sandbox = sandbox
    self.batches: list[int] = []

  def check_many(self, items):
    self.batches.append(len(items))
    return self.sandbox.check_many(items)


@pytest.fixture
def counting_sandbox(sandbox):
  return CountingSandbox(sandbox)
