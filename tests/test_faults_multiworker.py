"""Multiworker faults: start-up failures and stops end promptly, with one line.

Real `python cli.py modern --strategy multiworker` workers on loopback ports
with short timeouts where a signal or a second worker is the point (forked
from tests/fork_server.py, which spares each its TensorFlow import); a lone
worker that fails at its start-up (no peer, a taken port, a name that does not
resolve, TF_CONFIG beside --worker_hosts) runs in this process (click's
CliRunner). A module fixture runs every case at once: the processes' cases in
threads (each worker costing a TensorFlow import), the in-process ones in the
main thread meanwhile. Each test then checks one case's outcome: the exit
status, no traceback, the facts of its message (host:port, port, host name,
flag), how long it took, and that no checkpoint in train_dir changed. Every
worker is killed if it outlives HARD_TIMEOUT_SECS, so nothing hangs CI.

Every multiworker run here has one replica per worker (--num_gpus 1, the
default): on a CPU-only machine the stock MultiWorkerMirroredStrategy runs
one, and --num_gpus 2 is a usage error.

The tests below them cover modern.cluster's rendezvous and
modern.engines.PeerWatchdog in-process, and modern.engines._bounded (the
backstop on TensorFlow's start-up) in a small forked script.
"""

import collections
import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

import faults_support as fs

# --startup_timeout of the lone workers (in this process: no TensorFlow
# import to wait for; each case runs this long, one after the other).
STARTUP_TIMEOUT = 5
PEER_TIMEOUT = 10  # --peer_timeout of every worker here
SIGNAL_EXIT_SECS = 10  # a signal ends a worker within this (measured: 0.3-3 s)
# A start-up failure ends a worker within this after its cause (the timeout,
# the second hello): measured 2-4 s, and up to 12 s while the other cases'
# workers import TensorFlow on the same 2 cores.
TIMEOUT_SLACK_SECS = 20
HARD_TIMEOUT_SECS = 240  # any worker still running then is killed: a failure
FLAGS = ('--batch_size', '8', '--log_every', '1', '--summary_every', '1000',
         '--peer_timeout', str(PEER_TIMEOUT))
WAITING = 'waiting up to'  # the stderr line of a worker that waits for its peers


def _loopback(ports):
  return ['127.0.0.1:%d' % port for port in ports]


class _Worker:
  """One `python cli.py modern --strategy multiworker` process, lines read as they come."""

  def __init__(self, hosts, index, train_dir, data_dir, *flags, env=None):
    args = [fs.CLI, 'modern', '--strategy', 'multiworker',
            '--data_dir', data_dir, '--train_dir', str(train_dir)] + list(FLAGS)
    if hosts is not None:
      args += ['--worker_hosts', ','.join(hosts), '--task_index', str(index)]
    environ = fs.cli_env(env)
    if not env or 'TF_CONFIG' not in env:
      environ.pop('TF_CONFIG', None)
    # Forked by the fork server: no TensorFlow import of its own.
    self.proc = fs.Spawned(args + list(flags), environ)
    self.started = time.monotonic()
    self.lines = queue.Queue()  # (stream, line) as they come
    self.out, self.err = [], []
    self._readers = [threading.Thread(target=self._read, args=(s, sink, name),
                                      daemon=True)
                     for s, sink, name in ((self.proc.stdout, self.out, 'out'),
                                           (self.proc.stderr, self.err, 'err'))]
    for reader in self._readers:
      reader.start()

  def _read(self, stream, sink, name):
    for line in stream:
      sink.append(line.rstrip('\n'))
      self.lines.put((name, line.rstrip('\n')))

  def wait_for(self, text, timeout=HARD_TIMEOUT_SECS):
    """Seconds (monotonic) when a line holding `text` came; None if the worker ended first."""
    deadline = self.started + timeout
    while True:
      try:
        _, line = self.lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
      except queue.Empty:
        if self.proc.poll() is not None and self.lines.empty():
          return None
        if time.monotonic() >= deadline:
          return None
        continue
      if text in line:
        return time.monotonic()

  def finish(self):
    """(exit status, stdout, stderr, monotonic time of the exit); kills at the hard timeout."""
    try:
      self.proc.wait(timeout=max(1.0, self.started + HARD_TIMEOUT_SECS - time.monotonic()))
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    ended = time.monotonic()
    for reader in self._readers:
      reader.join(timeout=10)
    return self.proc.returncode, '\n'.join(self.out), '\n'.join(self.err), ended

  def kill(self):
    if self.proc.poll() is None:
      self.proc.kill()
    return self.finish()


Outcome = collections.namedtuple(
    'Outcome', 'code out err secs train_dir facts before')


def _outcome(worker, since, train_dir, facts, before):
  code, out, err, ended = worker.finish()
  return Outcome(code, out, err, ended - since if since else None, train_dir,
                 facts, before)


def _checkpoint_files(train_dir):
  return {path: digest for path, digest in fs.snapshot(str(train_dir)).items()
          if os.path.basename(path).startswith(('model.ckpt', 'checkpoint'))}


def _in_process(hosts, index, train_dir, data_dir, *flags, env=None):
  """A worker run in this process (fs.invoke_cli), its Outcome's fields but facts
  and before: (exit status, stdout, stderr, seconds from the WAITING line, or
  from the start without one, to the end, train_dir)."""
  waited = []
  args = ['modern', '--strategy', 'multiworker', '--data_dir', data_dir,
          '--train_dir', str(train_dir)] + list(FLAGS)
  if hosts is not None:
    args += ['--worker_hosts', ','.join(hosts), '--task_index', str(index)]
  started = time.monotonic()
  with fs.Logged(then=lambda line: waited.append(time.monotonic())
                 if WAITING in line else None):
    code, out, err, exception = fs.invoke_cli(args + list(flags),
                                              env=dict({'TF_CONFIG': None}, **(env or {})))
  assert exception is None, exception  # a user would see a traceback
  return code, out, err, time.monotonic() - (waited or [started])[0], str(train_dir)


# --- the cases: each starts its workers, acts, and returns Outcomes ---------------
# Those in IN_PROCESS run in this process, one at a time; the others in threads.


def _lone(index):
  """A worker whose only peer never starts: it gives up after --startup_timeout."""
  def run(train_dir, data_dir):
    hosts = _loopback(fs.free_ports(2))
    peer = 1 - index
    return [Outcome(*_in_process(hosts, index, train_dir, data_dir,
                                 '--startup_timeout', str(STARTUP_TIMEOUT)), [
        'worker %d of 2 (%s)' % (index, hosts[index]),
        'no answer from %s (worker %d)' % (hosts[peer], peer),
        'within %d s (--startup_timeout)' % STARTUP_TIMEOUT], None)]
  return run


def _signal_during_startup(sig):
  """A lone worker stopped by a signal while it waits for its peer."""
  def run(train_dir, data_dir):
    worker = _Worker(_loopback(fs.free_ports(2)), 0, train_dir, data_dir)
    assert worker.wait_for(WAITING), worker.kill()
    since = time.monotonic()
    worker.proc.send_signal(sig)
    return [_outcome(worker, since, train_dir, ['Stopped by %s' % sig.name], None)]
  return run


def _locked_then_sigterm(train_dir, data_dir):
  """A chief waits for its peer (holding train_dir); a second chief of another
  cluster on the same train_dir is refused; then SIGTERM ends the first."""
  first = _Worker(_loopback(fs.free_ports(2)), 0, train_dir, data_dir)
  assert first.wait_for(WAITING), first.kill()
  started = time.monotonic()
  second = _Worker(_loopback(fs.free_ports(2)), 0, train_dir, data_dir)
  refused = _outcome(second, started, train_dir, [
      '%s is in use by another run' % train_dir, 'PID %d ' % first.proc.pid,
      '--train_dir'], None)
  since = time.monotonic()
  first.proc.send_signal(signal.SIGTERM)
  return [refused, _outcome(first, since, train_dir, ['Stopped by SIGTERM'], None)]


def _port_taken(train_dir, data_dir):
  with socket.socket() as holder:
    # Held from the start (port 0: the system picks a free one), so no case
    # running beside this one can take it in between.
    holder.bind(('127.0.0.1', 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    hosts = _loopback([port] + fs.free_ports(1))
    result = Outcome(*_in_process(hosts, 0, train_dir, data_dir), [
        'worker 0 of 2 (%s)' % hosts[0], 'port %d is not free' % port,
        '--worker_hosts'], None)
  return [result]


def _unresolvable(index):
  """A host name that never resolves (the reserved .invalid TLD): this worker's or its peer's."""
  def run(train_dir, data_dir):
    ports = fs.free_ports(2)
    name = 'nosuchworker.invalid'
    hosts = _loopback(ports)
    hosts[index] = '%s:%d' % (name, ports[index])
    return [Outcome(*_in_process(hosts, 0, train_dir, data_dir), [
        "cannot resolve '%s', the host of %s (worker %d)" % (name, hosts[index], index),
        '--worker_hosts'], None)]
  return run


def _tf_config_and_worker_hosts(train_dir, data_dir):
  hosts = _loopback(fs.free_ports(2))
  tf_config = json.dumps({'cluster': {'worker': hosts},
                          'task': {'type': 'worker', 'index': 0}})
  return [Outcome(*_in_process(hosts, 0, train_dir, data_dir, env={'TF_CONFIG': tf_config}),
                  ['TF_CONFIG is set and --worker_hosts is given', 'unset TF_CONFIG'],
                  None)]


def _different_clusters(train_dir, data_dir):
  """Two workers given different --worker_hosts lists: both say so, at once."""
  a, b, c = _loopback(fs.free_ports(3))
  workers = [_Worker([a, b], 0, train_dir, data_dir, '--startup_timeout', '60'),
             _Worker([a, b, c], 1, train_dir, data_dir, '--startup_timeout', '60')]
  since = [w.wait_for(WAITING) for w in workers]
  # Each names the other's address, index and list.
  facts = ['the worker at %s was started as worker 1 of %s,%s,%s' % (b, a, b, c),
           'the worker at %s was started as worker 0 of %s,%s' % (a, a, b)]
  return [_outcome(w, max(s for s in since if s), train_dir, [fact, '--worker_hosts'], None)
          for w, fact in zip(workers, facts)]


def _sigterm_while_peer_hangs(train_dir, data_dir):
  """Two workers train; worker 1 freezes (SIGSTOP); SIGTERM to the chief, which
  waits for it in a step: it stops within seconds, saving its last step."""
  hosts = _loopback(fs.free_ports(2))
  workers = [_Worker(hosts, i, train_dir, data_dir, '--save_every', '1000')
             for i in range(2)]
  try:
    assert workers[0].wait_for(': step 2, '), workers[0].kill()
    workers[1].proc.send_signal(signal.SIGSTOP)
    time.sleep(1.0)  # the chief is in the next step, waiting
    since = time.monotonic()
    workers[0].proc.send_signal(signal.SIGTERM)
    result = _outcome(workers[0], since, train_dir, [
        'worker 0 of 2 (%s): stopped by SIGTERM at global step' % hosts[0],
        'of waiting for the other workers', 'saved %s' % os.path.join(
            str(train_dir), 'model.ckpt-')], None)
  finally:
    workers[1].kill()  # also ends a stopped process
  return [result]


def _signal_to_a_training_non_chief(sig):
  """Two workers train; `sig` to worker 1: both stop after the same step, the
  chief saving it; worker 1 exits 128 + sig, the chief 1 (its run did not end)."""
  def run(train_dir, data_dir):
    hosts = _loopback(fs.free_ports(2))
    workers = [_Worker(hosts, i, train_dir, data_dir, '--save_every', '1000')
               for i in range(2)]
    try:
      assert workers[0].wait_for(': step 2, '), workers[0].kill()
      since = time.monotonic()
      workers[1].proc.send_signal(sig)
      saved = os.path.join(str(train_dir), 'model.ckpt-')
      stopped = _outcome(workers[1], since, train_dir, [
          'worker 1 of 2 (%s): stopped by %s at global step' % (hosts[1], sig.name),
          'the chief saved %s' % saved], None)
      chief = _outcome(workers[0], since, train_dir, [
          'worker 0 of 2 (%s): stopped by a stop request of another worker at global step'
          % hosts[0], 'it saved %s' % saved, 'Restart every worker'], None)
    finally:
      for worker in workers:
        worker.kill()
    return [stopped, chief]
  return run


_SIGTERM_TO_NON_CHIEF = _signal_to_a_training_non_chief(signal.SIGTERM)
_SIGUSR1_TO_NON_CHIEF = _signal_to_a_training_non_chief(signal.SIGUSR1)

# name: (case, index of its Outcome, exit status)
CASES = {
    'lone chief past --startup_timeout': (_lone(0), 0, 1),
    'lone non-chief past --startup_timeout': (_lone(1), 0, 1),
    'SIGTERM during the start-up': (_signal_during_startup(signal.SIGTERM), 0, 143),
    'SIGINT during the start-up': (_signal_during_startup(signal.SIGINT), 0, 130),
    'second chief on a locked train_dir': (_locked_then_sigterm, 0, 1),
    'SIGTERM to the lock holder': (_locked_then_sigterm, 1, 143),
    'port taken': (_port_taken, 0, 1),
    'unresolvable own host': (_unresolvable(0), 0, 1),
    'unresolvable peer': (_unresolvable(1), 0, 1),
    'TF_CONFIG and --worker_hosts': (_tf_config_and_worker_hosts, 0, 2),
    'different clusters, worker 0': (_different_clusters, 0, 1),
    'different clusters, worker 1': (_different_clusters, 1, 1),
    'SIGTERM while a peer hangs': (_sigterm_while_peer_hangs, 0, 143),
    'SIGTERM to a training non-chief': (_SIGTERM_TO_NON_CHIEF, 0, 143),
    'the chief of a stopped non-chief': (_SIGTERM_TO_NON_CHIEF, 1, 1),
    # The third stop signal of the multiworker pair (docs/ending.md).
    'SIGUSR1 to a training non-chief': (_SIGUSR1_TO_NON_CHIEF, 0, 138),
}
# How long each may take, from its `since` (None: not timed).
MAX_SECS = {
    'lone chief past --startup_timeout': STARTUP_TIMEOUT + TIMEOUT_SLACK_SECS,
    'lone non-chief past --startup_timeout': STARTUP_TIMEOUT + TIMEOUT_SLACK_SECS,
    'SIGTERM during the start-up': SIGNAL_EXIT_SECS,
    'SIGINT during the start-up': SIGNAL_EXIT_SECS,
    'SIGTERM to the lock holder': SIGNAL_EXIT_SECS,
    'different clusters, worker 0': TIMEOUT_SLACK_SECS,
    'different clusters, worker 1': TIMEOUT_SLACK_SECS,
    'SIGTERM while a peer hangs': SIGNAL_EXIT_SECS,
    'SIGTERM to a training non-chief': SIGNAL_EXIT_SECS,
    'the chief of a stopped non-chief': SIGNAL_EXIT_SECS,
    'SIGUSR1 to a training non-chief': SIGNAL_EXIT_SECS,
}
# Cases where the chief saves the step reached, named in the message.
WRITES_CHECKPOINT = {'SIGTERM while a peer hangs', 'SIGTERM to a training non-chief',
                     'the chief of a stopped non-chief', 'SIGUSR1 to a training non-chief'}
# Cases of one worker and no signal: run in this process.
IN_PROCESS = {CASES[name][0] for name in (
    'lone chief past --startup_timeout', 'lone non-chief past --startup_timeout',
    'port taken', 'unresolvable own host', 'unresolvable peer',
    'TF_CONFIG and --worker_hosts')}


@pytest.fixture(scope='module')
def outcomes(synth_data_dir, tmp_path_factory):
  """Runs every case at once; {case function: [Outcome, ...]}."""
  runs = {}
  for case, _, _ in CASES.values():
    if case not in runs:
      train_dir = str(tmp_path_factory.mktemp('mw') / 'train')
      if case not in (_sigterm_while_peer_hangs, _SIGTERM_TO_NON_CHIEF,
                      _SIGUSR1_TO_NON_CHIEF):
        # A checkpoint that must survive untouched.
        fs.copy_trained('modern', synth_data_dir, train_dir)
      runs[case] = train_dir
  befores = {case: _checkpoint_files(d) for case, d in runs.items()}
  results = {}

  def run(case, train_dir):
    try:
      results[case] = [o._replace(before=befores[case])
                       for o in case(train_dir, synth_data_dir)]
    except BaseException as e:  # pylint: disable=broad-except
      results[case] = e

  threads = [threading.Thread(target=run, args=item) for item in runs.items()
             if item[0] not in IN_PROCESS]
  for thread in threads:
    thread.start()
  for case in IN_PROCESS:  # meanwhile, in the main thread (signals, CliRunner)
    run(case, runs[case])
  for thread in threads:
    thread.join(HARD_TIMEOUT_SECS + 60)
  return results


@pytest.mark.slow
@pytest.mark.parametrize('name', list(CASES))
def test_fault(outcomes, name):
  case, index, status = CASES[name]
  result = outcomes.get(case)
  assert result is not None, 'the case was still running after %d s' % HARD_TIMEOUT_SECS
  if isinstance(result, BaseException):
    raise result
  outcome = result[index]
  context = 'stdout:\n%s\nstderr:\n%s' % (outcome.out[-2000:], outcome.err[-3000:])
  assert outcome.code == status, context
  assert 'Traceback' not in outcome.err, context
  # The message: stderr's last line of ours, one line with every fact.
  lines = fs.ours(outcome.err)
  assert lines, context
  for fact in outcome.facts:
    assert fact in lines[-1], (fact, context)
  if name in MAX_SECS:
    assert outcome.secs is not None, context
    assert outcome.secs <= MAX_SECS[name], (outcome.secs, context)
  names = os.listdir(outcome.train_dir) if os.path.isdir(outcome.train_dir) else []
  if name != 'SIGTERM while a peer hangs':  # there the frozen worker is killed
    assert not [n for n in names if n.startswith('workertemp_')], names
  after = _checkpoint_files(outcome.train_dir)
  if name in WRITES_CHECKPOINT:
    # The chief's last completed step, named in its line, is kept whole.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from cifar10_towers.modern import checkpoints as modern_checkpoints  # pylint: disable=import-outside-toplevel
    saved = lines[-1].rpartition('saved ')[2].split()[0].rstrip('.')
    step = int(saved.rpartition('-')[2])
    assert step >= 2 and tf.train.latest_checkpoint(outcome.train_dir) == saved
    assert tf.train.load_variable(saved, modern_checkpoints.checkpoint_key('global_step')) == step
    logged = [int(m) for m in re.findall(r': step (\d+), loss = ', outcome.out)]
    if logged:  # the chief's: the last step it logged (log_every 1), no later
      assert step == max(logged), outcome.out[-2000:]
  else:
    assert fs.changed(outcome.before, after) == [], context
    assert set(after) == set(outcome.before), context


# --- in-process: modern.cluster and the watchdog --------------------------------


def _cluster(hosts, index):
  from cifar10_towers.modern import cluster  # pylint: disable=import-outside-toplevel
  return cluster.resolve_cluster(tuple(hosts), index, environ={})


def test_workers_meet_whichever_starts_first():
  from cifar10_towers.modern import cluster  # pylint: disable=import-outside-toplevel
  hosts = _loopback(fs.free_ports(3))
  errors = []

  def worker(index, delay):
    time.sleep(delay)
    me = _cluster(hosts, index)
    try:
      cluster.rendezvous(me, cluster.listen(me), 20)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(i, d))
             for i, d in ((2, 0.0), (0, 0.5), (1, 1.5))]
  start = time.monotonic()
  with fs.Logged() as logged:
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(30)
  lines = logged.err
  assert not errors
  assert time.monotonic() - start < 10
  assert len(lines) == 3 and all(WAITING in line for line in lines)
  # Every port is free again, for TensorFlow's server.
  for host in hosts:
    with socket.socket() as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind(('127.0.0.1', int(host.rpartition(':')[2])))


def test_a_worker_listed_at_the_wrong_index_is_named():
  from cifar10_towers.modern import cluster  # pylint: disable=import-outside-toplevel
  hosts = _loopback(fs.free_ports(2))
  errors = []
  # The process listening at hosts[1] believes it is worker 0 (as on another
  # machine with the same port numbers): both workers 0 refuse.
  impostor = cluster.Cluster({'worker': tuple(hosts)}, 'worker', 0)
  sock = socket.socket()
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind(('127.0.0.1', int(hosts[1].rpartition(':')[2])))
  sock.listen(4)

  def run(me, listener):
    try:
      # The impostor's own hello fails at once; the real worker 0 fails as
      # fast when the impostor reads its hello, else at this timeout (no answer).
      cluster.rendezvous(me, listener, 2)
    except cluster.StartupError as e:
      errors.append(str(e))

  threads = [threading.Thread(target=run, args=(impostor, sock)),
             threading.Thread(target=run, args=(_cluster(hosts, 0),
                                                cluster.listen(_cluster(hosts, 0))))]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(30)
  assert len(errors) == 2, errors
  assert any('the worker at %s was started as worker 0 of %s' % (hosts[1], ','.join(hosts))
             in e for e in errors), errors


# --- modern.engines._bounded: the backstop on TensorFlow's start-up -------------

BOUNDED_MESSAGE = ('Error: worker 0 of 2 (127.0.0.1:1): TensorFlow\'s start-up did '
                   'not finish within 1 s (--startup_timeout).')
# Run as `python SCRIPT`: enters `_bounded(BOUND, MESSAGE)` around a sleep of BLOCK
# seconds (time.sleep stands in for TensorFlow's start-up), after saying so on
# stdout; a KeyboardInterrupt in the block ends it with status 130, quietly.
_BOUNDED_SCRIPT = '''
import sys, time
sys.path.insert(0, sys.argv[4])
from cifar10_towers.modern import engines
bound, block, message = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
print('entering', flush=True)
try:
  with engines._bounded(bound, message):
    time.sleep(block)
except KeyboardInterrupt:
  print('interrupted', flush=True)
  sys.exit(130)
print('left', flush=True)
'''
BOUNDED_EXIT_SECS = 10  # the 1 s bound, the exit and the message's child: ~1.1 s idle


def _bounded_run(script, bound, block, interrupt_after=None):
  """(exit status, stdout, stderr, seconds from 'entering' to the exit) of
  `python script` (_BOUNDED_SCRIPT), forked by the fork server."""
  proc = fs.Spawned([script, bound, block, BOUNDED_MESSAGE, fs.ROOT], fs.cli_env(),
                    new_session=True)  # a process group of its own, for the Ctrl-C
  try:
    first = proc.stdout.readline()  # after the TensorFlow import
    entered = time.monotonic()
    assert first == 'entering\n', (first, proc.stderr.read())
    if interrupt_after is not None:
      time.sleep(interrupt_after)
      # As a Ctrl-C in a terminal: to every process of the group.
      os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  return proc.returncode, first + out, err, time.monotonic() - entered


# name: (bound, block, interrupt_after) of a _bounded_run
BOUNDED_RUNS = {'past': (1, 30, None), 'within': (5, 0.5, None), 'ctrl-c': (20, 30, 1)}


@pytest.fixture(scope='module')
def bounded_runs(tmp_path_factory):
  """The BOUNDED_RUNS at once: name -> _bounded_run's result."""
  script = tmp_path_factory.mktemp('bounded') / 'bounded.py'
  script.write_text(_BOUNDED_SCRIPT, encoding='utf-8')
  results = {}

  def run(name):
    try:
      results[name] = _bounded_run(str(script), *BOUNDED_RUNS[name])
    except BaseException as e:  # pylint: disable=broad-except
      results[name] = e

  threads = [threading.Thread(target=run, args=(name,)) for name in BOUNDED_RUNS]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(120)
  for name, result in results.items():
    if isinstance(result, BaseException):
      raise AssertionError('%s: %r' % (name, result)) from result
  return results


@pytest.mark.slow
def test_a_start_up_past_its_bound_ends_with_the_message_alone(bounded_runs):
  code, out, err, secs = bounded_runs['past']
  assert code == 1, (out, err)
  assert fs.ours(err)[-1] == BOUNDED_MESSAGE, err
  assert 'Traceback' not in err and 'File ' not in err, err  # faulthandler's goes to the pipe
  assert 'left' not in out
  # Well before the 30 s block would have ended, after the 1 s bound.
  assert 1 <= secs <= fs.exit_bound(BOUNDED_EXIT_SECS), secs


@pytest.mark.slow
def test_a_start_up_within_its_bound_says_nothing(bounded_runs):
  code, out, err, _ = bounded_runs['within']
  assert code == 0, (out, err)
  assert out == 'entering\nleft\n'
  assert fs.ours(err) == []


@pytest.mark.slow
def test_a_ctrl_c_during_the_bounded_start_up_leaves_no_traceback(bounded_runs):
  """The message's child process is not in the terminal's process group."""
  code, out, err, _ = bounded_runs['ctrl-c']
  assert code == 130, (out, err)
  assert out.endswith('interrupted\n')
  assert fs.ours(err) == []  # neither the message nor the child's KeyboardInterrupt


# --- modern.engines.PeerWatchdog ------------------------------------------------

SAVED = '/runs/train/model.ckpt-7'


class _Ending:
  """The watchdog's callbacks, faked: every call in order, and when it exits."""

  def __init__(self, saved):
    self.saved = saved
    self.calls = []
    self.exited = threading.Event()
    self.exit_time = None

  def save_completed(self, step, first_step):
    self.calls.append(('save', step, first_step))
    if isinstance(self.saved, Exception):
      raise self.saved
    return self.saved

  def warn(self, message):
    self.calls.append(('warn', message))

  def cleanup(self):
    self.calls.append(('cleanup',))

  def exit(self, status):
    self.exit_time = time.monotonic()
    self.calls.append(('exit', status))
    self.exited.set()


def _watchdog(ending, monkeypatch):
  """A PeerWatchdog whose stop grace and limit are half the product's (half the wait)."""
  from cifar10_towers.modern import engines  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(engines.logger, 'warning', ending.warn)  # the line it says
  for name in ('STOP_GRACE_SECS', 'STOP_LIMIT_SECS'):
    monkeypatch.setattr(engines.PeerWatchdog, name, getattr(engines.PeerWatchdog, name) / 2)
  return engines.PeerWatchdog(
      _cluster(_loopback([1, 2]), 0), ending.save_completed, ending.cleanup, exit=ending.exit)


@pytest.mark.parametrize('saved', [SAVED, None, RuntimeError('the save failed')],
                         ids=['saved', 'nothing saved', 'the save raised'])
@pytest.mark.parametrize('stop', [False, True], ids=['peer timeout', 'stop request'])
def test_the_watchdog_saves_says_and_exits_when_a_wait_goes_on(stop, saved, monkeypatch):
  ending = _Ending(saved)
  watchdog = _watchdog(ending, monkeypatch)
  try:
    with watchdog.guard(60, 'the start-up', 5, '--startup_timeout'):
      pass  # the first wait, at the run's first step
    start = time.monotonic()
    with watchdog.guard(60 if stop else 1, 'the step', 7, '--peer_timeout'):
      if stop:
        watchdog.stop_requested('SIGTERM')
      assert ending.exited.wait(10)
  finally:
    watchdog.stop()
  waited = ending.exit_time - start
  # It polls every POLL_SECS; +1 s for a busy machine.
  if stop:
    assert watchdog.STOP_GRACE_SECS <= waited < watchdog.STOP_GRACE_SECS + 1, waited
  else:
    assert 1 <= waited < 2, waited
  # The chief saves the last completed step (7) of a run that began at 5,
  # then the line, then the cleanup, then the exit; once (a save that raises
  # is no save: the exit must come, the main thread being stuck).
  assert [call[0] for call in ending.calls] == ['save', 'warn', 'cleanup', 'exit']
  assert ending.calls[0] == ('save', 7, 5)
  message = ending.calls[1][1]
  assert '\n' not in message
  name = 'worker 0 of 2 (127.0.0.1:1)'
  if stop:
    assert message.startswith('%s: stopped by SIGTERM at global step 7 (ending the '
                              'step after ' % name), message
    assert ' s of waiting for the other workers); ' in message
    assert ending.calls[-1] == ('exit', 143)
  else:
    assert message.startswith('Error: %s: lost its peers at global step 7 (no answer in the '
                              'step within 1 s (--peer_timeout)' % name), message
    assert ending.calls[-1] == ('exit', 1)
  assert ('; saved %s.' % SAVED if saved == SAVED else
          '; this worker saved no checkpoint.') in message
  assert 'Restart every worker with the same flags' in message


def test_the_watchdog_leaves_a_stop_alone_when_the_waits_end_in_time(monkeypatch):
  """A stop rides on the next step's vote: waits that end within the grace are left alone."""
  from cifar10_towers.modern import engines  # pylint: disable=import-outside-toplevel
  # The 4 steps end before STOP_LIMIT_SECS (see the next test).
  assert 4 * engines.PeerWatchdog.STOP_GRACE_SECS / 2 < engines.PeerWatchdog.STOP_LIMIT_SECS
  ending = _Ending(SAVED)
  watchdog = _watchdog(ending, monkeypatch)
  try:
    watchdog.stop_requested('SIGINT')
    for step in range(4):  # steps of half the grace each: the stop rides on them
      with watchdog.guard(60, 'the step', step, '--peer_timeout'):
        time.sleep(watchdog.STOP_GRACE_SECS / 2)
    time.sleep(watchdog.STOP_GRACE_SECS + 1)  # between waits there is nothing to end
  finally:
    watchdog.stop()
  assert ending.calls == []


def test_the_watchdog_ends_a_stop_that_never_takes_effect(monkeypatch):
  """Past STOP_LIMIT_SECS after a stop, even waits that each end in time are cut."""
  ending = _Ending(None)
  watchdog = _watchdog(ending, monkeypatch)
  try:
    watchdog.stop_requested('SIGINT')
    since = time.monotonic()
    step = 0
    while not ending.exited.is_set() and time.monotonic() - since < 30:
      with watchdog.guard(60, 'the step', step, '--peer_timeout'):
        ending.exited.wait(watchdog.STOP_GRACE_SECS / 2)
      step += 1
  finally:
    watchdog.stop()
  waited = ending.exit_time - since
  assert watchdog.STOP_LIMIT_SECS <= waited < watchdog.STOP_LIMIT_SECS + 1, waited
  assert ending.calls[-1] == ('exit', 130)
  assert 'stopped by SIGINT' in ending.calls[1][1]


@pytest.mark.parametrize('args,match', [
    (['--startup_timeout', '30'], '--startup_timeout is for --strategy multiworker'),
    (['--strategy', 'multiworker', '--worker_hosts', 'a:1,b:2', '--startup_timeout',
      '0'], '--startup_timeout'),
    (['--strategy', 'multiworker', '--worker_hosts', 'a:1,b:2'],
     'TF_CONFIG is set and --worker_hosts is given'),
])
def test_cli_rejects_bad_startup_flags(args, match, tmp_path):
  tf_config = json.dumps({'cluster': {'worker': ['a:1', 'b:2']},
                          'task': {'type': 'worker', 'index': 0}})
  code, out, err, exception = fs.invoke_cli(
      ['modern', '--data_dir', tmp_path / 'none', '--train_dir', tmp_path / 't'] + args,
      env={'TF_CONFIG': tf_config if 'TF_CONFIG' in match else ''})
  assert exception is None
  assert code == 2, out + err
  assert match in err
  assert not (tmp_path / 't').exists()  # nothing started


def test_cli_refuses_two_replicas_per_worker_on_a_cpu_only_machine(tmp_path):
  """The stock strategy runs one replica per CPU-only worker: --num_gpus 2 is a usage error."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  if tf.config.list_physical_devices('GPU'):
    pytest.skip('this machine has GPUs')
  train_dir = tmp_path / 'train'
  train_dir.mkdir()  # an existing, empty train_dir stays empty: no lock, no files
  code, out, err, exception = fs.invoke_cli(
      ['modern', '--strategy', 'multiworker', '--worker_hosts',
       ','.join(_loopback(fs.free_ports(2))), '--task_index', '0', '--num_gpus', '2',
       '--data_dir', tmp_path / 'no_data', '--train_dir', train_dir], env={'TF_CONFIG': ''})
  context = 'stdout:\n%s\nstderr:\n%s' % (out, err)
  assert (code, exception) == (2, None), context
  assert 'Traceback' not in err, context
  message = fs.ours(err)[-1]
  assert message.startswith('Error: --strategy multiworker '), context
  for fact in ('one replica per GPU', '0 GPU(s) for --num_gpus 2',
               'pass --num_gpus 1 and start more workers'):
    assert fact in message, (fact, context)
  assert os.listdir(train_dir) == []
  assert not (tmp_path / 'no_data').exists()  # nothing downloaded either
