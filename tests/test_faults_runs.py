"""Whole training runs that a scheduler, an impatient user or a full disk disturb.

Real `python cli.py` processes where a signal or a second run is the point:
- two runs in one train_dir (legacy + legacy, legacy + modern, modern +
  modern): the second exits 1 naming the first's PID and host and writes
  nothing; the first finishes as if alone;
- SIGINT / SIGTERM at every phase, delivered while the run is inside it (the
  run is frozen with SIGSTOP at a marker line, signalled, thawed): before the
  first step the run ends at once with one line and writes nothing; after
  it, the step, save or summary in progress is finished and the step saved;
  each within 10 s;
- in this process (click's CliRunner): the train_dir removed or made
  read-only under a running trainer, a full disk at the first save,
  --max_steps below the resumed step, huge --log_every / --save_every /
  --summary_every.

The marker lines come from test hooks (`faults_support.hooks_env`), which
wrap a function of the run as its module loads; the code under test has none.
The processes are forked from tests/fork_server.py, which imported TensorFlow
once for all of them, but for the phase that is that import itself.
"""

import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import tensorflow as tf

import faults_support as fs
from cifar10_towers.common import cifar10_format
from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.legacy import train as legacy_train
from cifar10_towers.modern import checkpoints as modern_checkpoints
from cifar10_towers.modern import engines
from cifar10_towers.modern import step as modern_step
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import lock
from cifar10_towers.runtime import training

STEP_LINE = re.compile(r': step (\d+), loss = ')
EXIT_WITHIN_SECS = 10
NOT_STARTED = 'Stopped by %s before the first step; nothing was saved.'


def _step(line):
  match = STEP_LINE.search(line or '')
  return int(match.group(1)) if match else None


def _steps_logged(text):
  return [int(m.group(1)) for m in STEP_LINE.finditer(text)]


def _reached(step):
  return lambda line: (_step(line) or 0) >= step


def _global_step(path):
  key = ('global_step' if checkpoints.read(path).kind == checkpoints.LEGACY
         else 'global_step/.ATTRIBUTES/VARIABLE_VALUE')
  return int(tf.train.load_variable(path, key))


def _errors(err):
  return [line for line in err.splitlines() if line.startswith('Error: ')]


def _train_args(impl, data_dir, train_dir, *extra):
  return ([impl, '--data_dir', data_dir, '--train_dir', train_dir]
          + list(fs.FAST_FLAGS) + [str(a) for a in extra])


def _thaw_all(runs):
  for run in runs:
    if run.proc.poll() is None:
      run.proc.send_signal(signal.SIGCONT)
      run.kill()


# --- one writer per train_dir ------------------------------------------------

PAIRS = [('legacy', 'legacy'), ('legacy', 'modern'), ('modern', 'modern')]
PAIR_STEPS = 30  # both runs' --max_steps


@pytest.fixture(scope='module')
def two_runs(synth_data_dir, tmp_path_factory):
  """A first run of each trainer, frozen at step 3, and its pairs' second runs.

  All runs start together (their TensorFlow imports overlap). Each first run
  is frozen (SIGSTOP) at step 3 - holding its train_dir, with nothing saved
  yet (--save_every 5) - and each second run in that train_dir just before it
  takes the lock; then the second ones go on, and when they have ended, the
  first ones. (The legacy first run serves both pairs that start with it.)

  Returns:
    dict pair -> (train_dir, first run's pid, its (code, out, err), the
    second's (code, out, err), train_dir snapshots before and after the
    second runs went on).
  """
  firsts, seconds = {}, {}
  for first_impl in sorted({first for first, _ in PAIRS}):
    train_dir = str(tmp_path_factory.mktemp('%s_first' % first_impl) / 'train')
    first = fs.Running(_train_args(first_impl, synth_data_dir, train_dir,
                                   '--max_steps', PAIR_STEPS, '--save_every', 5),
                       forked=True)
    firsts[first_impl] = (train_dir, first, fs.Frozen(first, _reached(3)))
  for pair in PAIRS:
    base = tmp_path_factory.mktemp('%s_then_%s' % pair)
    second = fs.Running(
        _train_args(pair[1], synth_data_dir, firsts[pair[0]][0],
                    '--max_steps', PAIR_STEPS, '--save_every', 5),
        env=fs.hooks_env(str(base / 'hooks'),
                         [fs.hook(lock.exclusive, say='HOOK lock',
                                  dwell=5, freeze=True)]), forked=True)
    seconds[pair] = (second, fs.Frozen(second, lambda line: line == 'HOOK lock', itself=True))
  runs = [run for _, run, _ in firsts.values()] + [run for run, _ in seconds.values()]
  try:
    for _, run, frozen in firsts.values():
      assert frozen.wait() is not None, run.stderr[-20:]
    for run, frozen in seconds.values():
      assert frozen.wait() is not None, run.stderr[-20:]
    before = {impl: fs.snapshot(first[0]) for impl, first in firsts.items()}
    for second, _ in seconds.values():
      second.proc.send_signal(signal.SIGCONT)
    ended = {pair: second.finish(timeout=180) for pair, (second, _) in seconds.items()}
    after = {impl: fs.snapshot(first[0]) for impl, first in firsts.items()}
    for _, first, _ in firsts.values():
      first.proc.send_signal(signal.SIGCONT)
    finished = {impl: first.finish(timeout=180) for impl, (_, first, _) in firsts.items()}
    return {pair: (firsts[pair[0]][0], firsts[pair[0]][1].proc.pid, finished[pair[0]],
                   ended[pair], before[pair[0]], after[pair[0]]) for pair in PAIRS}
  finally:
    _thaw_all(runs)


@pytest.mark.slow
@pytest.mark.parametrize('pair', PAIRS, ids=lambda p: '%s_then_%s' % p)
def test_a_second_run_in_a_train_dir_exits_1_naming_the_first(two_runs, pair):
  train_dir, first_pid, first, second, before, after = two_runs[pair]
  code, out, err = second
  assert 'Traceback' not in out + err, err[-2000:]
  assert _errors(err) == [
      'Error: %s is in use by another run (PID %d on host %s, %s training, since '
      '%s). Wait for it to end, or pass another --train_dir; two runs in one '
      'train_dir would overwrite each other\'s checkpoints.'
      % (train_dir, first_pid, socket.gethostname(), pair[0],
         re.search(r', since (.*)\)\. Wait', err).group(1))], err[-2000:]
  assert code == 1
  assert out.splitlines() == ['HOOK lock']  # no step, nothing else
  # The second run wrote nothing: the first one's files are as they were.
  assert after == before


@pytest.mark.slow
@pytest.mark.parametrize('pair', PAIRS, ids=lambda p: '%s_then_%s' % p)
def test_the_first_run_finishes_as_if_alone(two_runs, pair):
  train_dir, _, first, _, _, _ = two_runs[pair]
  code, out, err = first
  assert (code, 'Traceback' in err) == (0, False), err[-2000:]
  assert _steps_logged(out) == list(range(1, PAIR_STEPS + 1))  # each step once
  final = os.path.join(train_dir, 'model.ckpt-%d' % PAIR_STEPS)
  assert checkpoints.resume_point(train_dir) == final
  assert checkpoints.read(final).kind == (checkpoints.LEGACY if pair[0] == 'legacy'
                                     else checkpoints.MODERN)
  assert _global_step(final) == PAIR_STEPS
  names = os.listdir(train_dir)
  assert len([n for n in names if n.startswith('events.out.tfevents')]) == 1
  # Only the first trainer's kind of files, and no lock left behind.
  assert bool([n for n in names if n.endswith('.meta')]) == (pair[0] == 'legacy')
  assert lock.LOCK_FILE not in names


# --- a signal at every phase -------------------------------------------------

Phase = collections.namedtuple('Phase', [
    'name',  # the phase, for the test id
    'impl',  # trainer
    'sig',  # the signal delivered inside the phase
    'hooks',  # faults_support.hook specs that mark (and widen) the phase
    'marker',  # the stdout line (prefix) at which the run is in the phase
    'args',  # extra CLI flags
    'resumed',  # train_dir holds model.ckpt-2 of this trainer
    'saved',  # the step the stop saves, or None: stopped before the first step
])

_SAVE = {impl: checkpoints.StepSaver.__call__ for impl in fs.TRAINERS}  # one save path
_SUMMARIES = {
    'legacy': ('tensorflow.python.summary.writer.writer:'
               'SummaryToEventTransformer.add_summary'),
    'modern': engines.Towers.write_summaries}
_GRAPH = {'legacy': legacy_train.build_train_graph, 'modern': modern_step.TowerStep.__init__}
_RESTORE = {'legacy': legacy_train.restore_or_initialize,
            'modern': modern_checkpoints.restore_latest}
# Legacy's first step waits in C++ while the shuffle queue fills: with this
# many examples to hold first, it would wait for minutes.
_ENDLESS_FILL = fs.hook(hparams.min_queue_examples, returns=10 ** 6)


def _phases(impl):
  term, sigint = signal.SIGTERM, signal.SIGINT
  rows = [
      Phase('data_check', impl, sigint if impl == 'legacy' else term,
            [fs.hook(cifar10_format.train_files, say='HOOK data',
                     dwell=5, freeze=True)],
            'HOOK data', (), False, None),
      Phase('tensorflow_import', impl, term if impl == 'legacy' else sigint,
            [fs.hook(devices.plan_devices, say='HOOK import')],
            'HOOK import', (), False, None),
      Phase('graph_building', impl, term,
            [fs.hook(_GRAPH[impl], say='HOOK graph', dwell=5, freeze=True)],
            'HOOK graph', (), False, None),
      Phase('restore', impl, term,
            [fs.hook(_RESTORE[impl], say='HOOK restore', dwell=5, freeze=True)],
            'HOOK restore', (), True, None),
      Phase('save', impl, term, [fs.hook(_SAVE[impl], say='HOOK save', dwell=5, freeze=True)],
            'HOOK save', ('--save_every', 3), False, 3),
      Phase('final_save', impl, term,
            [fs.hook(_SAVE[impl], say='HOOK save', dwell=5, freeze=True)],
            'HOOK save', ('--max_steps', 3), False, 3),
      # SIGINT after a step: its save and exit 130 (SIGTERM's: the saves above).
      Phase('summaries', impl, sigint,
            [fs.hook(_SUMMARIES[impl], say='HOOK summaries', dwell=5, freeze=True)],
            'HOOK summaries', ('--summary_every', 2), False, 2),
  ]
  if impl == 'legacy':
    rows += [
        Phase('queue_filling', impl, term, [_ENDLESS_FILL], 'Filling the queue',
              (), False, None),
        Phase('queue_filling_resumed', impl, sigint, [_ENDLESS_FILL],
              'Filling the queue', (), True, None),
    ]
  else:
    # Tracing and compiling the step: seconds, tens on a busy machine.
    first_step = fs.hook(engines.Towers.run_step, say='HOOK first step')
    rows += [
        Phase('first_step', impl, term, [first_step], 'HOOK first step', (),
              False, None),
        Phase('first_step_resumed', impl, sigint, [first_step], 'HOOK first step',
              (), True, None),
    ]
  return rows


PHASES = _phases('legacy') + _phases('modern')


def _signal_in_phases(impl, synth_data_dir, tmp_path_factory):
  """Runs `impl`'s phases at once; each frozen at its marker, then signalled alone.

  Returns:
    dict phase name -> (train_dir, snapshot before, seconds from the thaw
    (when the signal is delivered) to the exit, exit code, stdout, stderr).
  """
  runs = {}
  for phase in _phases(impl):
    base = tmp_path_factory.mktemp('%s_%s' % (impl, phase.name))
    train_dir = str(base / 'train')
    if phase.resumed:
      fs.copy_trained(impl, synth_data_dir, train_dir)
    before = fs.snapshot(train_dir)
    run = fs.Running(
        _train_args(impl, synth_data_dir, train_dir, '--max_steps', 1000,
                    *phase.args),
        env=fs.hooks_env(str(base / 'hooks'), phase.hooks),
        # A fresh process where its TensorFlow import is the phase.
        forked=phase.name != 'tensorflow_import')
    marker = phase.marker
    runs[phase.name] = (phase, train_dir, before, run,
                        fs.Frozen(run, lambda line, m=marker: line.startswith(m),
                                  itself=any(hook['freeze'] for hook in phase.hooks)))
  results = {}
  try:
    for name, (_, _, _, run, frozen) in runs.items():
      assert frozen.wait() is not None, (name, run.stderr[-20:])
    for name, (phase, train_dir, before, run, frozen) in runs.items():
      # A hook's pause has run out while frozen (sleep ends at a deadline),
      # so the time to exit counts none of it. (The pauses are long enough
      # to be frozen in, on a busy machine.)
      time.sleep(max(0.0, frozen.frozen_at + max(h['dwell'] for h in phase.hooks)
                     - time.time()))
      # Pending while the run is frozen: delivered inside the phase at SIGCONT.
      run.proc.send_signal(phase.sig)
      start = time.time()
      run.proc.send_signal(signal.SIGCONT)
      code, out, err = run.finish(timeout=120)
      results[name] = (train_dir, before, run.exited - start, code, out, err)
  finally:
    _thaw_all([run for _, _, _, run, _ in runs.values()])
  return results


@pytest.fixture(scope='module')
def legacy_phases(synth_data_dir, tmp_path_factory):
  return _signal_in_phases('legacy', synth_data_dir, tmp_path_factory)


@pytest.fixture(scope='module')
def modern_phases(synth_data_dir, tmp_path_factory):
  return _signal_in_phases('modern', synth_data_dir, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize('phase', PHASES,
                         ids=lambda p: '%s-%s-%s' % (p.impl, p.name, p.sig.name))
def test_a_signal_in_any_phase_stops_within_10s_with_one_line(phase, request):
  train_dir, before, seconds, code, out, err = request.getfixturevalue(
      '%s_phases' % phase.impl)[phase.name]
  print('%s %s: exit %.2f s after the signal' % (phase.impl, phase.name, seconds))
  assert 'Traceback' not in out + err, err[-2000:]
  # One line of ours on stderr: the ending line.
  assert len(fs.ours(err)) == 1, err[-2000:]
  assert code == 128 + phase.sig
  assert seconds < fs.exit_bound(EXIT_WITHIN_SECS)
  last = fs.ours(err)[-1]
  if phase.saved is None:
    assert last == NOT_STARTED % phase.sig.name
    assert _steps_logged(out) == []
    # Nothing written: a fresh train_dir holds no file, a resumed one is as it was.
    after = fs.snapshot(train_dir)
    assert after == before, fs.changed(before, after) + sorted(set(after) - set(before))
  else:
    # The save or summary in progress was finished, then the run stopped.
    path = os.path.join(train_dir, 'model.ckpt-%d' % phase.saved)
    assert last == ('Stopped by %s at global step %d; saved %s. The same command '
                    'resumes from it.' % (phase.sig.name, phase.saved, path))
    assert max(_steps_logged(out)) == phase.saved
    assert checkpoints.resume_point(train_dir) == path
    assert tf.train.latest_checkpoint(train_dir) == path
    assert _global_step(path) == phase.saved
  assert lock.LOCK_FILE not in (os.listdir(train_dir) if os.path.isdir(train_dir)
                                else [])


class _TrickleServer:
  """An http server on 127.0.0.1 that sends CIFAR-10's size in bytes, slowly."""

  def __init__(self):
    self._socket = socket.socket()
    self._socket.bind(('127.0.0.1', 0))
    self._socket.listen(4)
    self.url = 'http://127.0.0.1:%d/cifar-10-binary.tar.gz' % (
        self._socket.getsockname()[1])
    threading.Thread(target=self._serve, daemon=True).start()

  def _serve(self):
    while True:
      try:
        connection, _ = self._socket.accept()
      except OSError:  # closed
        return
      threading.Thread(target=self._trickle, args=(connection,), daemon=True).start()

  @staticmethod
  def _trickle(connection):
    with connection:
      try:
        connection.recv(4096)
        connection.sendall(b'HTTP/1.0 200 OK\r\nContent-Length: 170052171\r\n\r\n')
        for _ in range(2000):  # 64 KB every 50 ms: 100 s at most
          connection.sendall(b'\0' * 65536)
          time.sleep(0.05)
      except OSError:  # the client went away
        pass

  def close(self):
    self._socket.close()


@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_during_the_download_stops_at_once_and_leaves_no_part_file(
    tmp_path, sig):
  server = _TrickleServer()
  data_dir, train_dir = str(tmp_path / 'data'), str(tmp_path / 'train')
  os.makedirs(data_dir)
  run = fs.Running(['legacy', '--data_dir', data_dir, '--train_dir', train_dir],
                   env={'CIFAR10_DATA_URL': server.url}, forked=True)
  try:
    deadline = time.time() + 60
    # The archive streams into a hidden staging directory in data_dir
    # (cifar10_format.staged_batches_dir): wait for its first bytes.
    while not [f for d, _, files in os.walk(data_dir) for f in files
               if os.path.getsize(os.path.join(d, f)) > 0]:
      assert time.time() < deadline and run.proc.poll() is None, run.stderr[-20:]
      time.sleep(0.05)
    time.sleep(0.5)  # downloading
    start = time.time()
    run.proc.send_signal(sig)
    code, out, err = run.finish(timeout=60)
  finally:
    server.close()
    if run.proc.poll() is None:
      run.kill()
  assert 'Traceback' not in out + err, err[-2000:]
  assert fs.ours(err)[-1] == NOT_STARTED % sig.name  # after the download's bar
  assert out == ''
  assert code == 128 + sig
  assert run.exited - start < fs.exit_bound(EXIT_WITHIN_SECS)
  assert os.listdir(data_dir) == []  # the partial download is gone
  assert not os.path.exists(train_dir)


# --- what else a user, a scheduler or a disk does ----------------------------

def _chattr(flag, path):
  return subprocess.run(['chattr', flag, path], capture_output=True, timeout=30,
                        check=False).returncode == 0


@pytest.fixture(scope='module')
def disturbed_runs(synth_data_dir, tmp_path_factory):
  """Each trainer's train_dir removed, and made read-only, under it at step 2.

  In this process: at the second log line (--save_every 5: nothing saved
  yet) the train_dir is removed or made immutable (`chattr +i`: not even
  root can create a file in it), and the run goes on.

  Returns:
    dict (impl, 'removed' | 'read_only') -> (train_dir, exit code, stdout,
    stderr); 'read_only' is missing where chattr does not work.
  """
  results = {}
  with pytest.MonkeyPatch.context() as patch:
    for impl in fs.TRAINERS:
      for what in ('removed', 'read_only'):
        train_dir = str(tmp_path_factory.mktemp('%s_%s' % (impl, what)) / 'train')
        os.makedirs(train_dir)
        if what == 'read_only' and not (_chattr('+i', train_dir)
                                        and _chattr('-i', train_dir)):
          continue
        patch.setattr(training, 'log_line',
                      fs.at_call(2, _disturb(what, train_dir), training.log_line))
        try:
          code, out, err, exception = fs.invoke_cli(
              _train_args(impl, synth_data_dir, train_dir, '--max_steps', 12,
                          '--save_every', 5))
        finally:
          patch.undo()
          if what == 'read_only':
            _chattr('-i', train_dir)
        assert exception is None, exception  # a user would see a traceback
        results[impl, what] = (train_dir, code, out, err)
  return results


def _disturb(what, train_dir):
  def removed():
    shutil.rmtree(train_dir)

  def read_only():
    assert _chattr('+i', train_dir)
  return removed if what == 'removed' else read_only


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_train_dir_removed_under_a_run_stops_it_before_writing_there(
    disturbed_runs, impl):
  train_dir, code, out, err = disturbed_runs[impl, 'removed']
  assert 'Traceback' not in out + err, err[-2000:]
  said = ('Error: %s was removed, or its lock file %s, while this run trained in it; '
          'stopped without writing there again, as another run may have started in '
          'it since. ' % (train_dir, lock.LOCK_FILE))
  # What remains: nothing (a summary writer may have made the directory again).
  assert _errors(err) in (
      [said + '%s is gone: no checkpoint remains; the same command starts again at '
       'step 0.' % train_dir],
      [said + 'No checkpoint was written; the same command starts again at step 0.']
  ), err[-2000:]
  assert code == 1
  assert max(_steps_logged(out)) == 5  # stopped at the first save after it
  if os.path.isdir(train_dir):  # a summary writer may have made it again
    assert not [n for n in os.listdir(train_dir) if n.startswith('model.ckpt')]


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_train_dir_made_read_only_under_a_run_fails_at_the_save(disturbed_runs,
                                                                 impl):
  if (impl, 'read_only') not in disturbed_runs:
    pytest.skip('chattr +i does not work on this file system')
  train_dir, code, out, err = disturbed_runs[impl, 'read_only']
  assert 'Traceback' not in out + err, err[-2000:]
  assert len(_errors(err)) == 1, err[-2000:]
  assert re.fullmatch(
      r'Error: could not write checkpoint model\.ckpt-5 in %s \(Operation not '
      r'permitted\)\. Make it writable, or pass another --train_dir\. No checkpoint '
      r'was written; the same command starts again at step 0\.'
      % re.escape(train_dir), _errors(err)[0]), err[-2000:]
  assert code == 1
  assert not [n for n in os.listdir(train_dir) if n.startswith('model.ckpt')]


@pytest.fixture(scope='module')
def tiny_full_disk(tmp_path_factory):
  """A 1 MB tmpfs: not room for one checkpoint (8.6 MB)."""
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root')
  path = str(tmp_path_factory.mktemp('tiny_full_disk'))
  if not fs.mount_tmpfs(path, '1m'):
    pytest.skip('mounting a tmpfs is not permitted here')
  yield path
  fs.umount(path)


@pytest.mark.slow
def test_a_full_disk_at_the_first_save(tiny_full_disk, synth_data_dir):
  for impl in fs.TRAINERS:
    train_dir = os.path.join(tiny_full_disk, impl)
    code, out, err, exception = fs.invoke_cli(_train_args(
        impl, synth_data_dir, train_dir, '--max_steps', 4, '--save_every', 2))
    assert exception is None, exception
    assert 'Traceback' not in out + err, err[-2000:]
    assert _errors(err) == [
        'Error: could not write checkpoint model.ckpt-2 in %s (No space left on '
        'device). Free space on that disk, or pass another --train_dir. No '
        'checkpoint was written; the same command starts again at step 0.' % train_dir
    ], err[-2000:]
    assert code == 1
    assert _steps_logged(out) == [1, 2]
    names = os.listdir(train_dir)
    assert not [n for n in names if n.startswith('model.ckpt') or 'temp' in n]
    assert lock.LOCK_FILE not in names


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_max_steps_below_the_resumed_step_trains_nothing_and_says_why(
    impl, synth_data_dir, tmp_path):
  train_dir = fs.copy_trained(impl, synth_data_dir, str(tmp_path / 'train'))
  before = fs.snapshot(train_dir)
  code, out, err, exception = fs.invoke_cli(
      _train_args(impl, synth_data_dir, train_dir, '--max_steps', 1))
  assert (code, exception) == (0, None), err
  line = training.nothing_to_train(2, 1, train_dir)
  assert 'from step 0, not from the resumed step' in line
  # Both trainers say it on stderr (a diagnostic), and not on stdout.
  assert line in err.splitlines()
  assert line not in out.splitlines()
  assert _steps_logged(out) == []
  assert fs.snapshot(train_dir) == before  # nothing added, nothing changed


@pytest.mark.slow
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_huge_log_save_and_summary_intervals_still_save_the_last_step(
    impl, synth_data_dir, tmp_path):
  train_dir = str(tmp_path / 'train')
  huge = 10 ** 30
  code, out, err, exception = fs.invoke_cli(
      [impl, '--data_dir', synth_data_dir, '--train_dir', train_dir,
       '--batch_size', 8, '--max_steps', 5, '--log_every', huge,
       '--save_every', huge, '--summary_every', huge])
  assert (code, exception) == (0, None), err
  assert 'Traceback' not in out + err
  assert _steps_logged(out) == []
  final = os.path.join(train_dir, 'model.ckpt-5')
  assert checkpoints.resume_point(train_dir) == final
  assert _global_step(final) == 5
  assert sorted(checkpoints.step_of(n[:-len('.index')])
                for n in os.listdir(train_dir) if n.endswith('.index')) == [5]
