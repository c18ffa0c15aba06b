"""The README's Commands section runs top to bottom, in order, each exiting 0.

Each shell line of the section's code block is run as written, in a scratch
working directory, with these substitutions (and nothing else):

- `python cli.py` is this checkout's command line, run in this process
  (click's CliRunner, as tests/faults_support.invoke_cli): a process per
  command would import TensorFlow 8 times, ~5 s of CPU each, and the test
  must stay near a minute on 2 cores (`bench` still starts its contenders'
  own processes). tests/test_prog.py runs real `python cli.py` processes;
- every `/tmp/...` path becomes the same path under the test's temp dir, and
  the defaults the section relies on are redirected there too, through the
  options' own environment variables: CIFAR10_DATA_DIR (default data dir),
  CIFAR10_TRAIN_DIR (default train dir), CIFAR10_EVAL_DIR (default eval
  dir); profile's `profile_out/` lands in
  the scratch working directory;
- flags in SMALLER are appended (click keeps an option's last value), so a
  trainer takes 2 steps of batch 8 instead of 1,000,000 of 128 and the whole
  section runs in about a minute; the commands' meaning is unchanged;
- CIFAR10_DATA_URL points at a closed port, so nothing touches the network.

`data download` fetches 170 MB from the network, so it is the one command
skipped (tests/test_download.py covers it with a local server). Everything
else - including `data digits`, which needs the [digits] extra
(scikit-learn), as the README's test command installs - must exit 0.
"""

import os
import re
import shlex
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


def commands_section(text):
  """The shell lines of the first code block under '## Commands'."""
  section = text.split('\n## Commands\n', 1)[1].split('\n## ', 1)[0]
  block = re.search(r'^```\n(.*?)^```$', section, re.M | re.S).group(1)
  return [shlex.split(line, comments=True) for line in block.splitlines()
          if line.strip()]


def _prepared(words, root, data_dir):
  assert words[:2] == ['python', 'cli.py'], words
  args = [root + w[len('/tmp'):] if w.startswith('/tmp/') else w for w in words[2:]]
  for prefix, extra in SMALLER.items():
    if tuple(args[:len(prefix)]) == prefix:
      args += [e.format(data_dir=data_dir) for e in extra]
  return args


def test_commands_section_parses():
  commands = commands_section(open(README, encoding='utf-8').read())
  assert len(commands) >= 10
  names = [tuple(c[2:4]) if c[2] == 'data' else (c[2],) for c in commands]
  # Every command of the CLI is shown, data first: the trainers need it.
  for name in [('legacy',), ('modern',), ('eval',), ('crosscheck',),
               ('convert',), ('bench',), ('profile',), ('data', 'synth'),
               ('data', 'check'), ('data', 'digits'), ('data', 'download')]:
    assert name in names, name
  assert names.index(('data', 'synth')) < names.index(('legacy',))


def test_commands_section_runs_in_order(tmp_path, monkeypatch):
  root = str(tmp_path / 'tmp')  # stands for /tmp
  work = str(tmp_path / 'work')
  os.makedirs(root)
  os.makedirs(work)
  data_dir = os.path.join(root, 'cifar10_data')
  env = {'CIFAR10_DATA_DIR': data_dir,
         'CIFAR10_TRAIN_DIR': os.path.join(root, 'cifar10_train'),
         'CIFAR10_EVAL_DIR': os.path.join(root, 'cifar10_eval'),
         'CIFAR10_DATA_URL': fs.closed_port_url()}
  commands = commands_section(open(README, encoding='utf-8').read())
  monkeypatch.chdir(work)
  ran = []
  for words in commands:
    if tuple(words[2:4]) in NEEDS_NETWORK:
      continue
    args = _prepared(words, root, data_dir)
    start = time.time()
    code, out, err, exception = fs.invoke_cli(args, env=env)
    ran.append('%5.1f s  %s' % (time.time() - start, ' '.join(args)))
    print(ran[-1])
    assert exception is None, (' '.join(words), repr(exception), err[-2000:])
    assert code == 0, (' '.join(words), out[-2000:], err[-2000:])
  assert len(ran) == len(commands) - 1, ran  # all but `data download`
