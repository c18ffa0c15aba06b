"""The README's Commands section: read, made small, run, and its outputs checked.

One place for what two runs of that section share: tests/test_readme.py runs
it in-process under pytest, and .ci/run runs this file as a script,
`python tests/readme_commands.py`, in the quick start's venv, before
anything else is installed there. Each shell line of the section's code
block is run as written, with these substitutions (and nothing else):

- every `/tmp/...` path becomes the same path under a fresh temp dir, and the
  defaults the section relies on are redirected there too, through the
  options' own environment variables: CIFAR10_DATA_DIR (default data dir),
  CIFAR10_TRAIN_DIR (default train dir); CIFAR10_EVAL_DIR is unset, so eval
  writes where the README says, below its checkpoint dir;
- flags in SMALLER are appended (click keeps an option's last value), so a
  trainer takes 2 steps of batch 8 instead of 1,000,000 of 128 and the whole
  section runs in a minute or two; the commands' meaning is unchanged;
- CIFAR10_DATA_URL points at a closed port, so nothing touches the network,
  and `data download` (170 MB from the network) is the one command skipped
  (tests/test_download.py covers it with a local server).

A command has run when it exits 0 and leaves its main output (main_outputs):
the files it is there to write, each written by this run, and the line it
is there to print. `profile` without matplotlib exits 0 with no
timeline.png, and that counts as a failure. A command the section gains
without an entry in main_outputs fails too, until one is added.

As a script, each command runs as a real process, `python cli.py ...`
through bash, from the checkout's root, with this interpreter's directory
first on PATH (the venv the script runs in, as `activate` would), and the
script exits 1 at the first failure, naming the README's line. It prints
each command with its time, and the commands' stdout.
"""

import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import faults_support as fs

README = os.path.join(fs.ROOT, 'README.md')
NEEDS_NETWORK = {('data', 'download')}
SMALL_DATA = ['--train_per_file', '100', '--num_test', '100']
SMALL_TRAIN = ['--max_steps', '2', '--batch_size', '8', '--log_every', '1']
# Appended to a command whose words start with the key.
SMALLER = {
    ('data', 'synth'): SMALL_DATA,
    ('legacy',): SMALL_TRAIN,
    ('modern',): SMALL_TRAIN,
    ('eval',): ['--batch_size', '50'],
    ('crosscheck',): ['--batch_size', '4', '--steps', '1'],
    # One trainer: each more one is two more processes importing TensorFlow.
    ('bench',): ['--impl', 'modern', '--num_gpus', '1', '--batch_size', '8',
                 '--rounds', '1', '--warmup_rounds', '0', '--window_steps', '1',
                 '--matmul_size', '64', '--data_dir', '{data_dir}'],
    ('profile',): ['--batch_size', '8', '--steps', '1'],
}
# What `data synth` and `data digits` write into <data_dir>/cifar-10-batches-bin.
DATA_FILES = tuple('data_batch_%d.bin' % i for i in range(1, 6)) + (
    'test_batch.bin', 'GENERATED.json')
# A written file older than its command's start by more than this is a
# leftover (the file system's clock may lag time.time() by a tick).
CLOCK_SLACK_S = 1.0


def commands_section(text):
  """The shell lines of the first code block under '## Commands', as word lists."""
  section = text.split('\n## Commands\n', 1)[1].split('\n## ', 1)[0]
  block = re.search(r'^```\n(.*?)^```$', section, re.M | re.S).group(1)
  return [shlex.split(line, comments=True) for line in block.splitlines()
          if line.strip()]


def read_commands():
  with open(README, encoding='utf-8') as f:
    return commands_section(f.read())


def command_name(words):
  """('data', 'synth') for `python cli.py data synth ...`, ('legacy',) for a trainer."""
  assert words[:2] == ['python', 'cli.py'], words
  return tuple(words[2:4]) if words[2] == 'data' else (words[2],)


def needs_network(words):
  return command_name(words) in NEEDS_NETWORK


def prepared(words, root, data_dir):
  """The CLI arguments of a README line, its /tmp moved to root, SMALLER appended."""
  assert words[:2] == ['python', 'cli.py'], words
  args = [root + w[len('/tmp'):] if w.startswith('/tmp/') else w for w in words[2:]]
  for prefix, extra in SMALLER.items():
    if tuple(args[:len(prefix)]) == prefix:
      args += [e.format(data_dir=data_dir) for e in extra]
  return args


def environment(root):
  """The variables the commands run with; None: unset."""
  return {'CIFAR10_DATA_DIR': os.path.join(root, 'cifar10_data'),
          'CIFAR10_TRAIN_DIR': os.path.join(root, 'cifar10_train'),
          'CIFAR10_EVAL_DIR': None,
          'CIFAR10_DATA_URL': fs.closed_port_url()}


def _option(args, name, default=None):
  """The value click gives option `name` in args: its last one, else default."""
  value = default
  for i, word in enumerate(args):
    if word == name and i + 1 < len(args):
      value = args[i + 1]
    elif word.startswith(name + '='):
      value = word[len(name) + 1:]
  return value


def main_outputs(args, env, cwd):
  """What a command is there to leave: (file globs, a regex its stdout must match).

  Args:
    args: the CLI arguments, after `python cli.py` (prepared()).
    env: the environment it runs with (environment()'s variables).
    cwd: the directory it runs in; relative paths are below it.

  Returns:
    (list of str, str), or None for a command without an entry here.
  """
  name = command_name(['python', 'cli.py'] + list(args))
  data_dir = _option(args, '--data_dir', env['CIFAR10_DATA_DIR'])
  train_dir = _option(args, '--train_dir', env['CIFAR10_TRAIN_DIR'])
  if name in (('data', 'synth'), ('data', 'digits')):
    batches = os.path.join(data_dir, 'cifar-10-batches-bin')
    return ([os.path.join(batches, f) for f in DATA_FILES],
            r'^Wrote \d+ training and \d+ test records of generated data')
  if name == ('data', 'check'):
    return [], r'^%s: all \d+ files are valid' % re.escape(data_dir)
  if name in (('legacy',), ('modern',)):
    # The checkpoint of the last step, as `Done:` names it.
    last = os.path.join(train_dir, 'model.ckpt-%s.index' % _option(args, '--max_steps'))
    return [last], r'^Done: the newest checkpoint is '
  if name == ('eval',):
    checkpoint_dir = _option(args, '--checkpoint_dir', env['CIFAR10_TRAIN_DIR'])
    eval_dir = _option(args, '--eval_dir', os.path.join(checkpoint_dir, 'eval'))
    return ([os.path.join(eval_dir, 'events.out.tfevents.*')],
            r'precision @ 1 = \d\.\d{3}')
  if name == ('crosscheck',):
    return [], r'^PASS: all \d+ figures within the contract'
  if name == ('convert',):
    return ([os.path.join(_option(args, '--to_dir'), 'model.ckpt-*.index')],
            r'^Converted the ')
  if name == ('bench',):
    files = [path for path in (_option(args, '--json'), _option(args, '--plot')) if path]
    return files, r'^impl\s+towers\s+batch\s+img/s'
  if name == ('profile',):
    out_dir = os.path.join(cwd, _option(args, '--out', 'profile_out'))
    files = ('trace.json', 'report.json', 'timeline.png')
    return ([os.path.join(out_dir, f) for f in files],
            r'^Wrote \S+timeline\.png \(png\)\.$')
  return None


def missing_outputs(args, env, cwd, stdout, since):
  """What a command that exited 0 failed to leave, as sentences; [] when all is there.

  Args:
    args, env, cwd: as for main_outputs.
    stdout: str, what it printed.
    since: float, time.time() when it started: older files are leftovers.
  """
  expected = main_outputs(args, env, cwd)
  if expected is None:
    return ['no main output is known for `%s`: give it one in '
            'tests/readme_commands.py main_outputs' % ' '.join(args)]
  files, pattern = expected
  problems = []
  for pattern_path in files:
    paths = glob.glob(pattern_path)
    if not paths:
      problems.append('%s was not written' % pattern_path)
      continue
    newest = max(paths, key=os.path.getmtime)
    if os.path.getmtime(newest) < since - CLOCK_SLACK_S:
      problems.append('%s is older than the command (a leftover)' % newest)
    elif os.path.getsize(newest) == 0:
      problems.append('%s is empty' % newest)
  if not re.search(pattern, stdout, re.M):
    problems.append('its stdout has no line matching %r' % pattern)
  return problems


def _tail(text, lines=40):
  return '\n'.join(text.rstrip('\n').splitlines()[-lines:])


def main():
  """Runs the Commands section as processes; 0 when every command ran, else 1."""
  commands = read_commands()
  started = time.time()
  with tempfile.TemporaryDirectory(prefix='readme_commands_') as base:
    root = os.path.join(base, 'tmp')  # stands for /tmp
    os.makedirs(root)
    env = dict(os.environ)
    for key, value in environment(root).items():
      if value is None:
        env.pop(key, None)
      else:
        env[key] = value
    # This interpreter's venv, as `. .venv/bin/activate` puts it.
    env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
    ran = 0
    for words in commands:
      readme_line = shlex.join(words)
      if needs_network(words):
        print('skipped (needs the network): %s' % readme_line, flush=True)
        continue
      args = prepared(words, root, env['CIFAR10_DATA_DIR'])
      line = shlex.join(words[:2] + args)
      print('$ %s' % line, flush=True)
      start = time.time()
      result = subprocess.run(['bash', '-c', line], cwd=fs.ROOT, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, check=False)
      sys.stdout.write(result.stdout)
      print('  %.1f s, exit %d' % (time.time() - start, result.returncode), flush=True)
      if result.returncode != 0:
        problems = ['it exited %d' % result.returncode]
      else:
        problems = missing_outputs(args, env, fs.ROOT, result.stdout, start)
      if problems:
        sys.stderr.write('%s\n' % _tail(result.stderr))
        print('README command failed: `%s` (run as `%s`): %s.'
              % (readme_line, line, '; '.join(problems)), file=sys.stderr)
        return 1
      ran += 1
  print('All %d commands of README.md\'s Commands section ran, each with its output, '
        'in %.0f s.' % (ran, time.time() - started), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
