"""The memory estimate of a training run, and the refusal of a run that cannot fit.

The estimate is checked against the layer shapes of the real model, against
the peak RSS of real runs of both trainers (within the factor stated in
runtime/memory.py: never below the measured peak, at most twice it), and
against the design range (batch 128 x 64 towers fits a 24 GiB machine). The
refusal is checked as a user sees it: exit 1, one line, no traceback,
nothing written, before TensorFlow builds anything.
"""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import faults_support as fs
from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.common import model_spec
from cifar10_towers.runtime import memory

GIB = memory.GIB
CPU_PLAN = devices.DevicePlan(('/device:CPU:0', '/device:CPU:1'), 'cpu', 2)
GPU_PLAN = devices.DevicePlan(('/device:GPU:0', '/device:GPU:1'), 'gpu', 1)
# The estimate may be above the measured peak RSS by this factor, never below.
MAX_OVERESTIMATE = 2.0


def test_activation_bytes_are_the_outputs_of_the_real_layers():
  """A = the float32 outputs of conv1, pool1, norm1, conv2, norm2, pool2, local3,
  local4 and the logits, summed over the ops of the traced forward pass."""
  params = {layer.name: (tf.zeros(layer.weight_shape),
                         tf.zeros(layer.weight_shape[-1:]))
            for layer in model_spec.LAYERS}
  forward = tf.function(lambda images: model_spec.forward(images, params))
  graph = forward.get_concrete_function(
      tf.TensorSpec([1, hparams.IMAGE_SIZE, hparams.IMAGE_SIZE, 3])).graph
  kept = [op for op in graph.get_operations()
          if op.type in ('Relu', 'MaxPool', 'LRN') or op.name == 'softmax_linear']
  assert sorted(op.type for op in kept).count('Relu') == 4  # conv1..local4
  assert len(kept) == 9, [op.name for op in kept]
  total = sum(op.outputs[0].shape.num_elements() * 4 for op in kept)
  assert memory.activation_bytes_per_image() == total == 306472


def test_estimate_grows_with_batch_and_towers_and_gpu_towers_are_not_host_memory():
  for impl in ('legacy', 'modern'):
    small = memory.estimate(impl, 64, 2, 50000)
    assert memory.estimate(impl, 128, 2, 50000) > small
    assert memory.estimate(impl, 64, 4, 50000) > small
    on_gpu = memory.estimate(impl, 64, 2, 50000, towers_on_host=False)
    # N x B x K x A: the towers' activations and their gradients.
    assert small - on_gpu == int(2 * 64 * memory.ACTIVATION_FACTOR
                                 * memory.activation_bytes_per_image())


def test_design_range_fits_a_shared_24_gib_machine():
  """Batch 128 x 64 towers on CIFAR-10 is estimated under 8 GiB, so three other
  users may hold two thirds of a 24 GiB machine; the refusal starts well above."""
  for impl in ('legacy', 'modern'):
    assert memory.estimate(impl, 128, 64, 50000) < 8 * GIB
    assert memory.estimate(impl, 100000, 1, 50000) > 24 * GIB


# Runs a command and prints its peak RSS in KiB. The measured process is the
# child of this small process, not of pytest: ru_maxrss outlives exec, so a
# child forked from the test process (GiBs into a full test run) would report
# at least the test process's RSS.
_MEASURE = ('import os, subprocess, sys\n'
            'proc = subprocess.Popen(sys.argv[1:])\n'
            '_, status, usage = os.wait4(proc.pid, 0)\n'
            'print(usage.ru_maxrss)\n'
            'sys.exit(os.waitstatus_to_exitcode(status))\n')


def _peak_rss(proc, deadline):
  """Exit code and peak RSS in bytes of a command run through _MEASURE."""
  try:
    out, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.communicate()
    raise
  return proc.returncode, int(out.split()[-1]) * 1024


@pytest.mark.slow
def test_estimate_against_the_measured_peak_of_real_runs(tmp_path, synth_data_dir):
  """Legacy and modern, batch 64 x 2 towers, 3 steps, at once, each in its own process."""
  runs = {}
  for impl in ('legacy', 'modern'):
    args = [sys.executable, fs.CLI, impl, '--data_dir', synth_data_dir,
            '--train_dir', str(tmp_path / impl), '--batch_size', '64',
            '--num_gpus', '2', '--max_steps', '3', '--log_every', '1']
    runs[impl] = subprocess.Popen([sys.executable, '-c', _MEASURE] + args,
                                  cwd=fs.ROOT, env=fs.cli_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True)
  deadline = time.time() + 240
  try:
    for impl, proc in runs.items():
      code, peak = _peak_rss(proc, deadline)
      assert code == 0, impl
      estimate = memory.estimate(impl, 64, 2, 1000)
      print('%s: estimate %.2f GiB, measured peak RSS %.2f GiB (x%.2f)'
            % (impl, estimate / GIB, peak / GIB, estimate / peak))
      assert peak <= estimate <= MAX_OVERESTIMATE * peak, (impl, estimate, peak)
  finally:
    for proc in runs.values():
      if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _fake_system(root, meminfo_kb=None, cgroup=None):
  """A /proc and /sys/fs/cgroup of our own under root.

  Args:
    meminfo_kb: MemAvailable in kB, or None for no /proc/meminfo.
    cgroup: None, or ('v2' | 'v1', limit text, usage bytes, inactive file bytes).
  """
  proc = root / 'proc'
  (proc / 'self').mkdir(parents=True)
  (proc / 'self' / 'statm').write_text('1000 256 0 0 0 0 0\n')  # 256 pages resident
  if meminfo_kb is not None:
    (proc / 'meminfo').write_text('MemTotal:       25000000 kB\n'
                                  'MemAvailable:   %d kB\n' % meminfo_kb)
  cgroups = root / 'cgroup'
  if cgroup:
    version, limit, usage, inactive = cgroup
    if version == 'v2':
      (proc / 'self' / 'cgroup').write_text('0::/job/run\n')
      d = cgroups / 'job' / 'run'
      d.mkdir(parents=True)
      (d / 'memory.max').write_text(limit + '\n')
      (d / 'memory.current').write_text('%d\n' % usage)
      (d / 'memory.stat').write_text('anon 1\ninactive_file %d\n' % inactive)
    else:
      (proc / 'self' / 'cgroup').write_text('5:cpu:/\n4:memory:/job\n')
      d = cgroups / 'memory' / 'job'
      d.mkdir(parents=True)
      (d / 'memory.limit_in_bytes').write_text(limit + '\n')
      (d / 'memory.usage_in_bytes').write_text('%d\n' % usage)
      (d / 'memory.stat').write_text('total_inactive_file %d\n' % inactive)
  return str(proc), str(cgroups)


RSS = 256 * os.sysconf('SC_PAGE_SIZE')


@pytest.mark.parametrize('meminfo_kb, cgroup, expected, source', [
    (20 * 2**20, None, 20 * GIB + RSS, r'^MemAvailable in .*/proc/meminfo$'),
    # v2 limit 8 GiB, 3 GiB used of which 1 GiB reclaimable cache: 6 GiB left.
    (20 * 2**20, ('v2', str(8 * GIB), 3 * GIB, GIB), 6 * GIB + RSS,
     r'^under the memory limit of cgroup .*/cgroup/job/run$'),
    (20 * 2**20, ('v2', 'max', 3 * GIB, 0), 20 * GIB + RSS, r'^MemAvailable'),
    # v1 "no limit" is a number near 2**63.
    (20 * 2**20, ('v1', '9223372036854771712', GIB, 0), 20 * GIB + RSS,
     r'^MemAvailable'),
    (20 * 2**20, ('v1', str(4 * GIB), GIB, 0), 3 * GIB + RSS,
     r'^under the memory limit of cgroup .*/cgroup/memory/job$'),
    (None, ('v2', str(8 * GIB), 2 * GIB, 0), 6 * GIB + RSS, r'^under the memory'),
    (None, None, None, None),
], ids=['meminfo', 'cgroup_v2_lower', 'cgroup_v2_max', 'cgroup_v1_unlimited',
        'cgroup_v1_lower', 'cgroup_only', 'neither'])
def test_available_is_the_least_of_meminfo_and_cgroup_limits(
    tmp_path, meminfo_kb, cgroup, expected, source):
  proc, cgroup_root = _fake_system(tmp_path, meminfo_kb, cgroup)
  have, where = memory.available(proc=proc, cgroup_root=cgroup_root)
  assert have == expected
  if source is None:
    assert where is None
  else:
    assert re.search(source, where), where


def test_without_a_figure_nothing_is_refused(synth_data_dir, monkeypatch):
  monkeypatch.setattr(memory, 'available', lambda: (None, None))
  estimate = memory.check_training('legacy', CPU_PLAN, 10**6, synth_data_dir)
  assert estimate > 100 * GIB


def test_gpu_plans_check_host_memory_only(synth_data_dir, monkeypatch):
  """What fits the host on GPUs (activations there) is refused on CPU towers."""
  have = memory.estimate('legacy', 20000, 2, 1000, towers_on_host=False)
  monkeypatch.setattr(memory, 'available', lambda: (have, 'a test'))
  memory.check_training('legacy', GPU_PLAN, 20000, synth_data_dir)
  with pytest.raises(memory.NotEnoughMemory, match=r'of memory \(estimate\)'):
    memory.check_training('legacy', CPU_PLAN, 20000, synth_data_dir)
  with pytest.raises(memory.NotEnoughMemory, match=r'of host memory'):
    memory.check_training('legacy', GPU_PLAN, 10**7, synth_data_dir)


def test_the_advice_fits(synth_data_dir, monkeypatch):
  """The --batch_size and --num_gpus the message suggests pass the check."""
  monkeypatch.setattr(memory, 'available', lambda: (6 * GIB, 'a test'))
  plan = devices.DevicePlan(tuple('/device:CPU:%d' % i for i in range(4)), 'cpu', 4)
  with pytest.raises(memory.NotEnoughMemory) as e:
    memory.check_training('modern', plan, 4000, synth_data_dir)
  match = re.search(r'Pass --batch_size (\d+) or less, or --num_gpus (\d+) or '
                    r'fewer\.$', str(e.value))
  assert match, str(e.value)
  batch, towers = int(match.group(1)), int(match.group(2))
  memory.check_training('modern', plan, batch, synth_data_dir)
  smaller = devices.DevicePlan(plan.tower_devices[:towers], 'cpu', 4)
  memory.check_training('modern', smaller, 4000, synth_data_dir)
  monkeypatch.setattr(memory, 'available', lambda: (GIB // 2, 'a test'))
  with pytest.raises(memory.NotEnoughMemory, match='Not even batch 1 fits'):
    memory.check_training('modern', plan, 4000, synth_data_dir)


@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_refusal_in_process(impl, tmp_path, synth_data_dir, monkeypatch):
  """--batch_size 100000 with 16 GiB available: one line, exit 1, nothing written."""
  monkeypatch.setattr(memory, 'available', lambda: (16 * GIB, 'a test'))
  data = str(tmp_path / 'data')
  shutil.copytree(synth_data_dir, data)
  train_dir = str(tmp_path / 'train')
  before = fs.snapshot(data)
  start = time.time()
  code, out, err, exception = fs.invoke_cli(
      [impl, '--data_dir', data, '--train_dir', train_dir, '--batch_size', 100000,
       '--num_gpus', 2])
  elapsed = time.time() - start
  assert exception is None, exception
  assert code == 1 and out == ''
  errors = [line for line in err.splitlines() if line.startswith('Error: ')]
  assert len(errors) == 1, err
  assert re.match(
      r'^Error: %s training of 2 tower\(s\) x batch 100000 needs about '
      r'1\d\d\.\d GiB of memory \(estimate\), more than the 16\.0 GiB available '
      r'to this process \(a test\)\. Pass --batch_size \d+ or less\.$' % impl,
      errors[0]), errors[0]
  assert not os.path.exists(train_dir)
  assert fs.changed(before, fs.snapshot(data)) == []
  assert elapsed < 10, elapsed  # refused before any graph or dataset is built


@pytest.mark.slow
def test_refusal_as_a_user_sees_it(tmp_path, synth_data_dir):
  """A real process (forked), the real /proc/meminfo: batch 10^7 fits no machine."""
  train_dir = str(tmp_path / 'train')
  result = fs.run_cli(['legacy', '--data_dir', synth_data_dir, '--train_dir',
                       train_dir, '--batch_size', 10**7], timeout=120, forked=True)
  assert result.returncode == 1
  assert result.stdout == ''
  assert len(fs.ours(result.stderr)) == 1, result.stderr
  assert re.fullmatch(r'Error: legacy training of 1 tower\(s\) x batch 10000000 '
                      r'needs about \d+\.\d GiB of memory \(estimate\), more than the '
                      r'\d+\.\d GiB available to this process \((MemAvailable|under '
                      r'the memory limit).*\. Pass --batch_size \d+ or less\.',
                      fs.ours(result.stderr)[0]), result.stderr
  assert not os.path.exists(train_dir)
