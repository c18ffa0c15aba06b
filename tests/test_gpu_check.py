"""scripts/gpu_check.sh: without a GPU, one line and exit 2; its stages, dry.

The check itself needs an NVIDIA GPU (docs/performance.md, "The GPU check").
Here: the no-GPU path, a directory it must not touch, and a dry run
(GPU_CHECK_DRY=1) whose report must be one JSON object holding every stage,
in order, each a command the CLI accepts.
"""

import json
import os
import shlex
import subprocess

import click
import pytest

from cifar10_towers import cli

# Each test runs scripts/gpu_check.sh: a process.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'gpu_check.sh')
STAGES = ['venv', 'install', 'data', 'crosscheck', 'legacy', 'eval_legacy', 'modern',
          'eval_modern', 'bench', 'profile_legacy', 'profile_modern']


def run_check(out, tmp_path, **env):
  """The script on `out`, with an nvidia-smi that finds no GPU first on PATH."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir(exist_ok=True)
  fake = bin_dir / 'nvidia-smi'
  fake.write_text('#!/bin/sh\necho "No devices were found"\nexit 6\n')
  fake.chmod(0o755)
  env = dict({k: v for k, v in os.environ.items() if k != 'GPU_CHECK_DRY'},
             PATH=f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', **env)
  return subprocess.run(['bash', SCRIPT, str(out)], env=env, capture_output=True, text=True,
                        timeout=60, check=False)


@pytest.mark.slow  # it runs scripts/gpu_check.sh
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
  out = tmp_path / 'check'
  result = run_check(out, tmp_path)
  assert result.returncode == 2
  assert (result.stdout + result.stderr).splitlines() == [
      'gpu_check: no NVIDIA GPU here (nvidia-smi -L lists none), so nothing to check.']
  assert not out.exists()  # nothing installed, nothing written


@pytest.mark.slow  # it runs scripts/gpu_check.sh
def test_a_directory_in_use_is_refused_untouched(tmp_path):
  out = tmp_path / 'check'
  out.mkdir()
  (out / 'mine.txt').write_text('keep')
  result = run_check(out, tmp_path, GPU_CHECK_DRY='1')
  assert result.returncode == 2
  assert 'is not empty; give a new directory' in result.stderr
  assert [p.name for p in out.iterdir()] == ['mine.txt']


@pytest.mark.slow  # it runs scripts/gpu_check.sh
def test_a_dry_run_writes_one_report_of_every_stage_in_order(tmp_path):
  out = tmp_path / 'check'
  result = run_check(out, tmp_path, GPU_CHECK_DRY='1')
  assert result.returncode == 0, result.stderr
  with open(out / 'gpu_check.json', encoding='utf-8') as f:
    report = json.load(f)
  assert [s['stage'] for s in report['stages']] == STAGES
  assert all(s['exit'] == 0 and s['json'] is None for s in report['stages'])
  table = result.stdout.split('\nstage ')[1].splitlines()[1:len(STAGES) + 1]
  assert [line.split()[:2] for line in table] == [[name, '0'] for name in STAGES]
  commands = {s['stage']: shlex.split(s['command']) for s in report['stages']}
  assert commands['crosscheck'][:2] == ['env', 'NVIDIA_TF32_OVERRIDE=0']
  for impl in ('legacy', 'modern'):  # what eval and profile read, the trainer wrote
    assert commands[impl][commands[impl].index('--max_steps') + 1] == '300'
  assert commands['bench'][commands['bench'].index('--num_gpus') + 1] == '1,2'
  # Every `cli.py` command is one the CLI accepts: its options parse (the
  # directories it reads made first), as `cli.py` would before running it.
  for name in ('data', 'legacy', 'modern'):
    os.makedirs(out / name, exist_ok=True)
  parsed = []
  for command in commands.values():
    if 'cli.py' in command:
      name, *args = command[command.index('cli.py') + 1:]
      sub = cli.cli.get_command(None, name)
      while isinstance(sub, click.Group):
        name, *args = args
        sub = sub.get_command(None, name)
      sub.make_context(name, args)  # raises click's UsageError for an unknown or bad option
      parsed.append(name)
  assert parsed == ['synth', 'crosscheck', 'legacy', 'eval', 'modern', 'eval', 'bench',
                    'profile', 'profile']
