"""How much memory a training run needs, checked before anything big is allocated.

A run whose step cannot fit is refused with the figures instead of growing
until the kernel's OOM killer ends it. The estimate is of the peak resident
memory of the training process, in bytes:

  total = RUNTIME + variables + inputs + towers

  RUNTIME   1 GiB: TensorFlow itself (libraries, kernels, thread pools, the
            graph or traced functions). Measured: 0.72-0.77 GiB at batch 1.
  variables 4 x NUM_PARAMETERS x (4 + N): the variables, their moving
            averages, the averaged gradients, a checkpoint's copy, and the
            gradients of each of the N towers.
  inputs    legacy: (min_after_dequeue + 3B) x I    the shuffle_batch queue, full
                    + (3N + 1) x B x I              the prefetch queue (2N
                                                    batches), the N batches the
                                                    towers hold, one being dequeued
                    + 16 x 128 x P                  16 threads preprocessing up
                                                    to 128 records each
            modern: min_after_dequeue x R           the shuffle buffer of raw records
                    + (3N + 1) x B x I              the prefetch buffer (it grows
                                                    as the step waits; taken as
                                                    2 elements of N
                                                    batches), the element the
                                                    step holds, one being batched
                    + C x B x P                     C parallel map calls (one
                                                    per core), a batch each
  towers    N x B x K x A   on CPU plans (logical CPU devices); on GPU plans the
            towers' activations are in GPU memory and not counted here.

N towers (--num_gpus), B images per tower (--batch_size), min_after_dequeue =
40% of the training examples on disk, I = 24*24*3*4 + 4 bytes (a preprocessed
image and its label), R = 3073 + 128 bytes (a raw record and its tensor in a
tf.data buffer), P = 4 x 32*32*3*4 bytes (the float copies of an image being
preprocessed), A = the forward activations of one image: the float32 outputs
of conv1, pool1, norm1, conv2, norm2, pool2, local3, local4 and softmax_linear
from `common.model_spec` (306,472 bytes), and K = 2.5: the activations kept for
the backward pass, the gradient flowing back through them, and the kernels'
temporaries.

Calibration (CPU, this project's trainers, 5 steps): the towers' slope
measured 0.55-0.65 MiB per image at batch 2048-4096, 0.95 MiB at batch 512
(K x A = 0.73 MiB); the whole estimate is 1.2-1.7x the measured peak RSS of
both trainers from batch 1 to 2048 and 1 to 8 towers (legacy also at 4096),
never below it. The default run (batch 128) with up to 64 towers is estimated
at under 8 GiB.

What is compared: the estimate (host part) with the memory available to this
process: the least of MemAvailable (/proc/meminfo) and the headroom under any
cgroup memory limit (v2 memory.max, v1 memory.limit_in_bytes), plus what
this process already holds (its RSS is part of the estimate). Where neither
can be read (not Linux) nothing is checked.
"""

import bisect
import itertools
import os
import pathlib
import re

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import hparams
from cifar10_towers.runtime import training

GIB = 2 ** 30
RUNTIME_BYTES = 1 * GIB  # TensorFlow's own footprint in a training process
ACTIVATION_FACTOR = 2.5  # K: peak tower memory per image over its forward activations
IMAGE_BYTES = hparams.IMAGE_SIZE * hparams.IMAGE_SIZE * 3 * 4 + 4  # I
RAW_RECORD_BYTES = fmt.RECORD_BYTES + 128  # R
PREPROCESS_BYTES = 4 * fmt.IMAGE_BYTES * 4  # P
LEGACY_READ_RECORDS = 128  # records a legacy preprocessing thread reads at once
_NO_LIMIT = 2 ** 60  # cgroup v1 reports "no limit" as a number near 2**63


class NotEnoughMemory(training.TrainingError):
  """The run would need more memory than this process can get; says what fits."""


def activation_bytes_per_image():
  """A: bytes of the float32 forward activations of one image.

  From the layer shapes of `common.model_spec` (imported here, with
  TensorFlow, so that importing this module stays cheap).
  """
  from cifar10_towers.common import model_spec  # pylint: disable=g-import-not-at-top
  c1, c2, *dense = [layer.weight_shape[-1] for layer in model_spec.LAYERS]
  s1 = hparams.IMAGE_SIZE  # conv1 keeps the size (SAME, stride 1)
  s2 = -(-s1 // hparams.POOL_STRIDE)  # pool1 (SAME): 24 -> 12
  s3 = -(-s2 // hparams.POOL_STRIDE)  # pool2: 12 -> 6
  # conv1; pool1 and norm1; conv2 and norm2; pool2; local3, local4, logits.
  return 4 * (s1 * s1 * c1 + 2 * s2 * s2 * (c1 + c2) + s3 * s3 * c2 + sum(dense))


def estimate(impl, batch_size, num_towers, examples_per_epoch, towers_on_host=True):
  """The peak memory of a training process (see the module docstring).

  Args:
    impl: 'legacy' or 'modern'.
    batch_size: int, images per tower (B).
    num_towers: int, towers (N).
    examples_per_epoch: int, training records on disk.
    towers_on_host: bool, False when the towers run on GPUs.

  Returns:
    int, bytes of host memory: all but the towers' on GPU plans.
  """
  from cifar10_towers.common import model_spec  # pylint: disable=g-import-not-at-top
  b, n = batch_size, num_towers
  min_after_dequeue = hparams.min_queue_examples(examples_per_epoch)
  if impl == 'legacy':
    inputs = ((min_after_dequeue + 3 * b) * IMAGE_BYTES +
              hparams.NUM_PREPROCESS_THREADS * LEGACY_READ_RECORDS * PREPROCESS_BYTES)
  else:
    inputs = (max(1, min_after_dequeue) * RAW_RECORD_BYTES +
              (os.cpu_count() or 1) * b * PREPROCESS_BYTES)
  inputs += (3 * n + 1) * b * IMAGE_BYTES  # the batches, in both
  variables = 4 * model_spec.NUM_PARAMETERS * (4 + n)
  towers = int(n * b * ACTIVATION_FACTOR * activation_bytes_per_image()) if towers_on_host else 0
  return RUNTIME_BYTES + variables + inputs + towers


def _read(*path):
  """The text of the file at os.path.join(*path); '' if it cannot be read."""
  try:
    return pathlib.Path(*path).read_text()
  except (OSError, UnicodeDecodeError):
    return ''


def _field(name, *path):
  """The number after `name` in a file (memory.max's 'max': no limit; kB as bytes), or None."""
  match = re.search(rf'^{name}:?\s*(\d+|max)( kB)?', _read(*path), re.M)
  if not match:
    return None
  return _NO_LIMIT if match[1] == 'max' else int(match[1]) * (1024 if match[2] else 1)


def _headrooms(proc, cgroup_root):
  """(bytes, where) of MemAvailable, if known, and of the headroom under each cgroup limit."""
  meminfo = os.path.join(proc, 'meminfo')
  if (free := _field('MemAvailable', meminfo)) is not None:
    yield free, f'MemAvailable in {meminfo}'
  for line in _read(proc, 'self', 'cgroup').splitlines():
    _, controllers, path = line.split(':', 2)
    if controllers and 'memory' not in controllers.split(','):
      continue
    # Where the hierarchy is, its limit, its usage, memory.stat's reclaimable page cache:
    # v1's memory controller, or v2's one unified hierarchy ('0::/path').
    base, limit_file, usage_file, cache = (
        (os.path.join(cgroup_root, 'memory'), 'memory.limit_in_bytes', 'memory.usage_in_bytes',
         'total_inactive_file') if controllers else
        (cgroup_root, 'memory.max', 'memory.current', 'inactive_file'))
    # This cgroup and every ancestor: each limit applies. In a container the
    # mount's root is the container's own cgroup, whatever the path says.
    for directory in itertools.accumulate(filter(None, path.split('/')), os.path.join,
                                          initial=base):
      limit = _field('', directory, limit_file) or _NO_LIMIT
      if limit < _NO_LIMIT:
        # Page cache the kernel reclaims before it kills counts as free.
        used = ((_field('', directory, usage_file) or 0)
                - (_field(cache, directory, 'memory.stat') or 0))
        yield max(0, limit - max(0, used)), f'under the memory limit of cgroup {directory}'


def available(proc='/proc', cgroup_root='/sys/fs/cgroup'):
  """Bytes of memory this process can reach, and where that figure comes from.

  The least of MemAvailable and the headroom under every cgroup memory limit
  above this process, plus this process's own RSS (already in use, and part
  of any estimate).

  Args:
    proc, cgroup_root: where procfs and the cgroup filesystem are mounted.

  Returns:
    (bytes, str naming the source) or (None, None) when neither can be read.
  """
  free, source = min(_headrooms(proc, cgroup_root), default=(None, None))
  if free is None:
    return None, None
  statm = _read(proc, 'self', 'statm').split()
  rss = int(statm[1]) * os.sysconf('SC_PAGE_SIZE') if statm[1:] else 0
  return free + rss, source


def check_training(impl, plan, batch_size, data_dir, what=None):
  """Refuses a run whose step cannot fit in the memory available to this process.

  Call before the trainer builds anything: it costs a stat of the data files.
  On GPU plans only host memory is checked: the towers' activations and
  gradients live in GPU memory, which TensorFlow cannot report before it
  allocates, so whether a tower fits its GPU is not checked here.

  Args:
    impl: 'legacy' or 'modern', whose estimate.
    plan: common.devices.DevicePlan.
    batch_size: int, images per tower.
    data_dir: str, holds the training files (already validated); None for no
      shuffle queue to count: `profile`'s generated 1,000 records (under 4 MiB),
      or `crosscheck`, which feeds its batches as constants.
    what: what the message calls the run; default '<impl> training'.

  Returns:
    int, the estimate (`estimate`) of host memory.

  Raises:
    NotEnoughMemory: one line with the estimate, what is available, and the
      largest --batch_size (and --num_gpus) that would fit.
  """
  examples = fmt.num_examples(fmt.train_files(data_dir)) if data_dir else 0
  on_host, towers = plan.kind != 'gpu', plan.num_towers

  def host_bytes(b, n):
    return estimate(impl, b, n, examples, towers_on_host=on_host)

  need, (have, source) = host_bytes(batch_size, towers), available()
  if have is None or need <= have:
    return need
  advice = []
  # The largest batch that fits (the estimate grows with the batch), rounded
  # down to two significant digits (24880 -> 24000).
  fit_batch = bisect.bisect_right(range(1, batch_size + 1), have,
                                  key=lambda b: host_bytes(b, towers))
  if fit_batch:
    scale = 10 ** max(0, len(str(fit_batch)) - 2)
    advice.append(f'--batch_size {fit_batch // scale * scale} or less')
  fit_towers = bisect.bisect_right(range(1, towers), have, key=lambda n: host_bytes(batch_size, n))
  if fit_towers:
    advice.append(f'--num_gpus {fit_towers} or fewer')
  todo = (f"Pass {', or '.join(advice)}." if advice else
          f'Not even batch 1 fits on {towers} tower(s): free memory (stop other processes) or '
          'use a larger machine.')
  raise NotEnoughMemory(
      f"{what or impl + ' training'} of {towers} tower(s) x batch {batch_size} needs about "
      f"{need / GIB:.1f} GiB of {'' if on_host else 'host '}memory (estimate), more than "
      f"the {have / GIB:.1f} GiB available to this process ({source}). {todo}")
