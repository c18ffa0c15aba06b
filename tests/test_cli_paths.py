"""Path options: one type refuses an empty path, and an output path that cannot be written,
as a usage error (exit 2) naming the flag, before any work. In-process (CliRunner)."""

import os
import shlex

import click
import pytest

import faults_support as fs
from cifar10_towers import cli
from cifar10_towers.common import prog


def _commands(group=cli.cli):
  """Every command of the CLI (not the groups)."""
  for command in group.commands.values():
    yield from _commands(command) if isinstance(command, click.Group) else [command]


def test_every_path_option_has_the_one_type():
  params = [p for c in _commands() for p in c.params if isinstance(p.type, click.Path)]
  assert len(params) > 10
  ours = cli._Path  # pylint: disable=protected-access
  assert [p.name for p in params if not isinstance(p.type, ours)] == []


@pytest.fixture(name='refused')
def fixture_refused(monkeypatch):
  """refused(args): the one Error line of `args`, which must exit 2 before any work."""

  def work(*args, **kwargs):
    raise AssertionError(f'the command ran: {args} {kwargs}')

  for command in _commands():
    monkeypatch.setattr(command, 'callback', work)
  return _refused


def _refused(args):
  exit_code, out, err, exception = fs.invoke_cli(args)
  assert exception is None and exit_code == 2, (exit_code, out, err, exception)
  return [line for line in err.splitlines() if line.startswith('Error:')]


@pytest.mark.parametrize('args', [
    ['legacy', '--train_dir'], ['modern', '--data_dir'], ['eval', '--checkpoint_dir'],
    ['eval', '--eval_dir'], ['crosscheck', '--dump'], ['profile', 'legacy', '--out'],
    ['convert', '--to_dir', 'x', '--from_dir'], ['convert', '--from_dir', '.', '--to_dir'],
    ['bench', '--json'], ['bench', '--plot'], ['bench', '--from_json'],
    ['data', 'synth', '--data_dir']], ids=' '.join)
def test_an_empty_path_is_a_usage_error(args, refused):
  flag = args[-1]
  assert refused(args + ['']) == [
      f'Error: Invalid value for {flag}: an empty path; pass another {flag}.']


@pytest.mark.parametrize('flag,path,why', [
    ('--json', 'none/B.json', 'none does not exist'),
    ('--plot', 'afile/B.png', 'afile is a file, not a directory'),
    ('--dump', 'afile', 'afile is a file, not a directory'),
    ('--out', 'afile/sub', 'afile is a file, so afile/sub cannot be created under it'),
    ('--to_dir', 'afile/sub', 'afile is a file, so afile/sub cannot be created under it'),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
    flag, path, why, tmp_path, monkeypatch, refused):
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'afile').write_text('')
  command = {'--dump': ['crosscheck'], '--out': ['profile', 'legacy'],
             '--to_dir': ['convert', '--from_dir', '.']}.get(flag, ['bench'])
  assert refused(command + [flag, path]) == [
      f'Error: Invalid value for {flag}: {why}; pass another {flag}.']
  assert os.listdir(tmp_path) == ['afile']


def test_an_output_file_in_a_directory_not_writable(tmp_path, monkeypatch, refused):
  """Root writes anywhere: os.access stands for the permission bits."""
  monkeypatch.setattr(os, 'access', lambda path, mode: path != str(tmp_path))
  assert refused(['bench', '--json', str(tmp_path / 'B.json')]) == [
      f'Error: Invalid value for --json: {tmp_path} is not writable; pass another --json.']


def test_a_suggested_command_quotes_each_path_as_a_shell_needs():
  assert prog.command('eval --run_once', checkpoint_dir='my run', data_dir='/d') == (
      "python cli.py eval --run_once --checkpoint_dir 'my run' --data_dir /d")


@pytest.mark.slow
def test_the_done_line_can_be_pasted(synth_data_dir, tmp_path):
  """Paths with a space: the `eval` command of the finished run's last line, as a shell
  splits it, names the run's directories."""
  data_dir, train_dir = str(tmp_path / 'my data'), str(tmp_path / "Bob's run")
  os.symlink(synth_data_dir, data_dir)
  exit_code, out, err, exception = fs.invoke_cli(
      ['legacy', '--num_gpus', '1', '--max_steps', '1', '--data_dir', data_dir,
       '--train_dir', train_dir] + list(fs.FAST_FLAGS))
  assert exception is None and exit_code == 0, (out, err, exception)
  done, command = out.splitlines()[-1].split(' Evaluate it: ')
  assert done == f'Done: the newest checkpoint is {train_dir}/model.ckpt-1.'
  assert shlex.split(command) == ['python', 'cli.py', 'eval', '--run_once', '--checkpoint_dir',
                                  train_dir, '--data_dir', data_dir]
