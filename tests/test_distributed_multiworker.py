"""modern.engines' multiworker engine across processes: MultiWorkerMirroredStrategy on localhost.

Every test starts real worker processes (TF_CONFIG or --worker_hosts, free
loopback ports): a process hosts one worker, and MultiWorkerMirroredStrategy
must be created before anything else in it, so none of this can run inside the
pytest process. The workers are forked by tests/fork_server.py (TensorFlow
imported, nothing created yet), which spares each its TensorFlow import. On
this CPU-only machine every worker runs one replica (the stock strategy's CPU
layout). Run as a script, this file is the worker of the equivalence test (see
`_worker_main`).
"""

import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import faults_support as fs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, 'cli.py')

# docs/equivalence.md §2 tolerances.
GRAD_REL_TOL = 1e-5  # averaged gradients: max|a - b| <= 1e-5 * max|b|, per variable
LOSS_REL_TOL = 1e-6  # tower losses
FINAL_REL_TOL = 1e-4  # variables and moving averages after K steps
K_STEPS = 3
DECAY_STEPS = 2  # the learning rate decays within the K steps
BATCH = 4
# Seconds a run of 2 or 3 workers may take, start-up included (each builds its
# strategy on the same 2 cores).
STARTUP_SLACK = 180
COLLECTIVE_TIMEOUT = 120  # seconds a collective of the engine-level workers waits


def _env(extra=None):
  env = dict(os.environ)
  env['TF_CPP_MIN_LOG_LEVEL'] = '2'
  env['PYTHONUNBUFFERED'] = '1'
  env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
  env.pop('TF_CONFIG', None)
  env.update(extra or {})
  return env


def _tf_config(hosts, index):
  return json.dumps({'cluster': {'worker': hosts},
                     'task': {'type': 'worker', 'index': index}})


def _wait_all(procs, timeout):
  """(returncode, stdout, stderr) of every process; kills them all on timeout."""
  deadline = time.time() + timeout
  results = []
  try:
    for proc in procs:
      out, err = proc.communicate(timeout=max(1.0, deadline - time.time()))
      results.append((proc.returncode, out, err))
  except subprocess.TimeoutExpired:
    for proc in procs:
      proc.kill()
      proc.communicate()
    pytest.fail('workers still running after %d s' % timeout)
  return results


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


# --- the worker of the engine-level tests ------------------------------------


def _worker_main(in_path, out_path, local_batches):
  """One worker (one replica): modern.engines.ReplicaStep on the inputs of in_path.

  Args:
    in_path: npz with init/<var>, images [R, B, ...], labels [R, B] and
      steps/images, steps/labels [K, R, B, ...] (R workers, a replica each).
    out_path: npz written with grad/<var>, tower_loss [R], final/<var>,
      final_ema/<var>, global_step.
    local_batches: bool, pass only this worker's batch (else all R).
  """
  sys.path.insert(0, ROOT)
  from cifar10_towers.common import devices  # pylint: disable=g-import-not-at-top
  plan = devices.plan_devices(1)
  from cifar10_towers.modern import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from cifar10_towers.modern import engines  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.resolve_cluster()  # from TF_CONFIG
  strategy = engines.multi_worker_strategy(plan, cluster, COLLECTIVE_TIMEOUT)
  trainer = engines.ReplicaStep(plan, DECAY_STEPS, strategy=strategy)
  assert trainer.num_towers == cluster.num_workers, trainer.num_towers
  assert len(strategy.extended.worker_devices) == 1  # one local replica
  state = trainer.state
  data = np.load(in_path)
  state.assign_variables({name[len('init/'):]: data[name]
                          for name in data.files if name.startswith('init/')})
  mine = slice(cluster.worker_index, cluster.worker_index + 1)
  pick = (lambda x: x[mine]) if local_batches else (lambda x: x)
  grads, losses = trainer.compute_gradients((pick(data['images']),
                                             pick(data['labels'])))
  for k in range(K_STEPS):
    trainer.train_step((pick(data['steps/images'][k]), pick(data['steps/labels'][k])))
  arrays = {'tower_loss': losses.numpy(),
            'global_step': state.global_step.numpy()}
  for name, grad in grads.items():
    arrays['grad/' + name] = grad.numpy()
  for name, var in state.variables().items():
    arrays['final/' + name] = var.numpy()
    # Every local copy of a mirrored variable holds the same value.
    for copy in var.values:
      np.testing.assert_array_equal(copy.numpy(), arrays['final/' + name])
  for name, var in state.shadow_variables().items():
    arrays['final_ema/' + name] = var.numpy()
  engines.all_sum(strategy, tf.constant(1.0))  # a barrier
  np.savez(out_path, **arrays)


def _start_workers(tmp_path, in_path, num_workers, local_batches=False):
  hosts = ['localhost:%d' % port for port in fs.free_ports(num_workers)]
  procs = []
  for index in range(num_workers):
    procs.append(fs.Spawned(
        [os.path.abspath(__file__), in_path, tmp_path / ('worker%d.npz' % index),
         int(local_batches)], _env({'TF_CONFIG': _tf_config(hosts, index)})))
  return procs


def _inputs(tmp_path, num_replicas, seed):
  """Initial variables and batches for R replicas, written to an npz."""
  rng = np.random.default_rng(seed)
  from cifar10_towers import crosscheck  # pylint: disable=g-import-not-at-top
  arrays = {'init/' + k: v for k, v in crosscheck.initial_values(seed).items()}
  arrays['images'] = rng.standard_normal(
      (num_replicas, BATCH, 24, 24, 3)).astype(np.float32)
  arrays['labels'] = rng.integers(0, 10, (num_replicas, BATCH)).astype(np.int32)
  arrays['steps/images'] = rng.standard_normal(
      (K_STEPS, num_replicas, BATCH, 24, 24, 3)).astype(np.float32)
  arrays['steps/labels'] = rng.integers(
      0, 10, (K_STEPS, num_replicas, BATCH)).astype(np.int32)
  path = str(tmp_path / 'inputs.npz')
  np.savez(path, **arrays)
  return path, arrays


@pytest.mark.slow
@pytest.mark.parametrize('num_workers,local_batches', [(2, False), (3, True)],
                         ids=['2x1 all batches', '3x1 own batch'])
def test_workers_compute_the_towers_averaged_gradient(tmp_path, num_workers,
                                                      local_batches):
  """W workers x 1 replica == 1 process x W towers on the same batches (docs/equivalence.md §2).

  Worker w's replica takes batch w, whether every worker passes all W batches
  or only its own. With 3 replicas the 1/R scaling of each replica's loss is
  not exact in floating point, hence the relative tolerances.
  """
  from cifar10_towers.common import devices  # pylint: disable=g-import-not-at-top
  from cifar10_towers.common import model_spec  # pylint: disable=g-import-not-at-top
  from cifar10_towers.modern import step as step_lib  # pylint: disable=g-import-not-at-top
  in_path, arrays = _inputs(tmp_path, num_workers, seed=num_workers)
  procs = _start_workers(tmp_path, in_path, num_workers, local_batches)

  # Meanwhile, the towers in this process on the same inputs.
  towers = step_lib.TowerStep(devices.DevicePlan(
      tuple('/device:CPU:%d' % i for i in range(num_workers)), 'cpu', 4), DECAY_STEPS)
  towers.state.assign_variables({k[len('init/'):]: v for k, v in arrays.items()
                                 if k.startswith('init/')})
  grads, losses = towers.compute_gradients((arrays['images'], arrays['labels']))
  for k in range(K_STEPS):
    towers.train_step((arrays['steps/images'][k], arrays['steps/labels'][k]))

  for index, (code, _, err) in enumerate(_wait_all(procs, STARTUP_SLACK)):
    assert code == 0, 'worker %d failed:\n%s' % (index, err[-3000:])
  results = [np.load(tmp_path / ('worker%d.npz' % i)) for i in range(num_workers)]
  for result in results:  # each worker holds the whole run's figures
    assert result['tower_loss'].shape == (num_workers,)
    np.testing.assert_allclose(result['tower_loss'], losses.numpy(), rtol=LOSS_REL_TOL)
    assert int(result['global_step']) == K_STEPS
    for name in model_spec.VARIABLE_NAMES:
      want = grads[name].numpy()
      np.testing.assert_allclose(result['grad/' + name], want, rtol=0,
                                 atol=GRAD_REL_TOL * np.abs(want).max(), err_msg=name)
      for key, var in (('final/', towers.state.variables()[name]),
                       ('final_ema/', towers.state.shadow_variables()[name])):
        want = var.numpy()
        np.testing.assert_allclose(result[key + name], want, rtol=0,
                                   atol=FINAL_REL_TOL * np.abs(want).max(),
                                   err_msg=key + name)
  # The workers end in exactly the same state.
  for other in results[1:]:
    for key in results[0].files:
      np.testing.assert_array_equal(results[0][key], other[key], err_msg=key)
  # The steps changed the variables: a comparison of initial values proves nothing.
  assert _rel(results[0]['final/local3/weights'], arrays['init/local3/weights']) > 1e-4


# --- the CLI across processes --------------------------------------------------


def _cli_workers(args, hosts, train_dir, data_dir, peer_timeout=60):
  procs = []
  for index in range(len(hosts)):
    procs.append(fs.Spawned(
        [CLI, 'modern', '--strategy', 'multiworker',
         '--worker_hosts', ','.join(hosts), '--task_index', str(index),
         '--data_dir', data_dir, '--train_dir', str(train_dir),
         '--peer_timeout', peer_timeout] + list(args), _env()))
  return procs


def _steps_logged(text):
  return [int(m) for m in re.findall(r': step (\d+), loss = ', text)]


@pytest.mark.slow
def test_three_workers_train_together_and_the_chief_keeps_the_checkpoints(
    synth_data_dir, tmp_path):
  train_dir = tmp_path / 'train'
  hosts = ['localhost:%d' % p for p in fs.free_ports(3)]
  # 3 workers x 1 replica (the one replica of a CPU-only worker), each
  # worker its own shard of the records.
  results = _wait_all(_cli_workers(
      ['--num_gpus', '1', '--batch_size', '8', '--max_steps', '20', '--log_every',
       '5', '--summary_every', '10', '--save_every', '10', '--seed', '1'],
      hosts, train_dir, synth_data_dir), STARTUP_SLACK)
  for index, (code, _, err) in enumerate(results):
    assert code == 0, 'worker %d:\n%s' % (index, err[-3000:])
  out0 = results[0][1]
  assert _steps_logged(out0) == [5, 10, 15, 20]
  # examples/sec counts the global batch: 8 images x 1 replica x 3 workers
  # (the two figures are rounded in the log line: 5 % covers it).
  rates = re.findall(r'\(([\d.]+) examples/sec; ([\d.]+) sec/batch\)', out0)
  assert len(rates) == 4
  for rate, seconds in rates:
    assert float(rate) * float(seconds) == pytest.approx(24, rel=0.05)
  for index, (_, out, err) in enumerate(results):
    assert 'Traceback' not in err, (index, err[-3000:])
    if index:
      assert out.strip() == '', (index, out)  # progress comes from the chief only
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from cifar10_towers.modern import checkpoints as modern_checkpoints  # pylint: disable=g-import-not-at-top
  from cifar10_towers.modern import eval as eval_lib  # pylint: disable=g-import-not-at-top
  from cifar10_towers.runtime import evaluation  # pylint: disable=g-import-not-at-top
  path = tf.train.latest_checkpoint(str(train_dir))
  assert path == str(train_dir / 'model.ckpt-20')
  assert (train_dir / 'model.ckpt-10.index').exists()
  assert tf.train.load_variable(path, modern_checkpoints.checkpoint_key('global_step')) == 20
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(train_dir))
  # The non-chief's temporary dir is gone; only the chief's files remain.
  assert not any(name.startswith('workertemp_') for name in os.listdir(train_dir))
  # eval reads the chief's dir.
  (result,) = evaluation.run(str(train_dir), functools.partial(
      eval_lib.evaluate_contents, data_dir=synth_data_dir))
  assert result.global_step == 20 and 0.0 <= result.precision <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize('how,peer_timeout', [
    (signal.SIGKILL, 20),  # the peer's process is gone: its connections fail
    (signal.SIGSTOP, 4),  # the peer hangs: only the peer timeout can tell
], ids=['killed', 'frozen'])
def test_a_worker_that_loses_its_peer_stops_with_a_clear_error(
    synth_data_dir, tmp_path, how, peer_timeout):
  train_dir = tmp_path / 'train'
  flags = ['--batch_size', '8', '--log_every', '1', '--summary_every', '1000',
           '--save_every', '1000']
  hosts = ['localhost:%d' % p for p in fs.free_ports(2)]
  procs = _cli_workers(flags + ['--max_steps', '1000000'], hosts, train_dir,
                       synth_data_dir, peer_timeout)
  lines = queue.Queue()
  reader = threading.Thread(target=lambda: [lines.put(l) for l in procs[0].stdout],
                            daemon=True)
  reader.start()
  try:
    # Wait until the two train together: the chief has logged step 2 (the
    # first step may take the start-up's longer allowance).
    deadline = time.time() + STARTUP_SLACK
    line, seen = '', []
    while ': step 2, ' not in line:
      assert time.time() < deadline, 'no step logged'
      assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
      try:
        line = lines.get(timeout=1)
        seen.append(line)
      except queue.Empty:
        pass
    procs[1].send_signal(how)
    lost = time.time()
    out, err = procs[0].communicate(timeout=peer_timeout + 60)
    elapsed = time.time() - lost
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()  # also ends a stopped process
      proc.communicate()
  assert procs[0].returncode == 1, err[-3000:]
  # Within the peer timeout, plus the watchdog's poll and the exit.
  assert elapsed <= peer_timeout + 5, elapsed
  message = fs.ours(err)[-1]
  assert message.startswith('Error: worker 0 of 2 (%s): lost its peers ' % hosts[0]), (
      message)
  assert 'Restart every worker with the same flags' in message
  assert 'Traceback' not in err
  # The chief saved the last step both had finished (a frozen peer's wait is
  # ended by the watchdog, which saves it from its own thread before the exit).
  saved = re.search(r'saved (\S+-(\d+))\.', message)
  assert saved, message
  step = int(saved.group(2))
  assert step >= 2
  # It is the last step the chief logged (log_every 1), by name and by its
  # global step: the failed step's increment is not in it.
  reader.join(timeout=10)
  while not lines.empty():
    seen.append(lines.get())
  out = ''.join(seen) + out
  assert step == max(_steps_logged(out)), (step, out[-2000:])
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from cifar10_towers.modern import checkpoints as modern_checkpoints  # pylint: disable=g-import-not-at-top
  assert tf.train.load_variable(saved.group(1),
                                modern_checkpoints.checkpoint_key('global_step')) == step
  if how != signal.SIGKILL:
    return

  # Restarting both resumes from it.
  hosts = ['localhost:%d' % p for p in fs.free_ports(2)]
  results = _wait_all(_cli_workers(flags + ['--max_steps', str(step + 3)], hosts,
                                   train_dir, synth_data_dir), STARTUP_SLACK)
  for index, (code, _, err) in enumerate(results):
    assert code == 0, 'worker %d:\n%s' % (index, err[-3000:])
  assert ('Resuming from %s at global step %d.' % (saved.group(1), step)
          in results[0][1])
  assert _steps_logged(results[0][1]) == [step + 1, step + 2, step + 3]


if __name__ == '__main__':
  _worker_main(sys.argv[1], sys.argv[2], bool(int(sys.argv[3])))
