"""`profile` and `crosscheck` get training's memory check: an absurd --batch_size is refused
in seconds, with the figures and the advice, before anything is built. In-process."""

import re
import time

import pytest

import faults_support as fs
from cifar10_towers import crosscheck as crosscheck_lib
from cifar10_towers.runtime import memory
from cifar10_towers.towerprofile import run as profile_lib

GIB = memory.GIB


@pytest.mark.parametrize('args,what', [
    (['profile', 'legacy', '--num_gpus', '1'], 'legacy training'),
    (['profile', 'modern', '--num_gpus', '1'], 'modern training'),
    (['crosscheck', '--num_gpus', '1'], 'the cross-check'),
])
def test_an_absurd_batch_is_refused_before_building(args, what, monkeypatch, tmp_path):
  monkeypatch.setattr(memory, 'available', lambda: (16 * GIB, 'a test'))
  for module, name in ((profile_lib, 'profile'), (crosscheck_lib, 'run')):
    monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail('it was built'))
  monkeypatch.chdir(tmp_path)  # profile's default --out
  start = time.time()
  code, out, err, exception = fs.invoke_cli(args + ['--batch_size', 100000])
  assert exception is None and code == 1, (code, err, exception)
  errors = [line for line in err.splitlines() if line.startswith('Error: ')]
  assert len(errors) == 1 and re.fullmatch(
      rf'Error: {what} of 1 tower\(s\) x batch 100000 needs about \d\d\.\d GiB of memory '
      r'\(estimate\), more than the 16\.0 GiB available to this process \(a test\)\. '
      r'Pass --batch_size \d+ or less\.', errors[0]), err
  assert time.time() - start < 10


def test_what_fits_is_not_refused(monkeypatch):
  """The default cross-check's estimate is about 1 GiB: with 2 GiB it runs."""
  monkeypatch.setattr(memory, 'available', lambda: (2 * GIB, 'a test'))
  monkeypatch.setattr(crosscheck_lib, 'run', lambda *a, **k: pytest.fail('ran'))
  with pytest.raises(pytest.fail.Exception, match='ran'):
    fs.invoke_cli(['crosscheck', '--num_gpus', '2'])
