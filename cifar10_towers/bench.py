"""How fast the trainers are, against the same net in Keras `model.fit` and the machine.

For every (implementation, towers) combination the benchmark measures

- training images/sec in steady state: the trainer's own `train()` (its real
  input pipeline, step, logging and summaries), timed over windows of
  `window_steps` steps; a window is the time between two of the trainer's
  log lines;
- the input pipeline alone: images/sec the trainer's pipeline delivers to its
  towers when nothing trains;
- the baseline: the same net (`common.model_spec` layers, initializers and
  weight decay, staircase-decayed SGD with a 0.9999 weight average) in Keras
  `model.fit` under `tf.distribute.MirroredStrategy` over the same logical
  devices, fed pre-batched in-memory data, timed over epochs of
  `window_steps` steps;
- the matmul estimate: the best fp32 FLOP/s of large matmuls divided by the
  FLOPs one training image costs (forward x 3 less conv1's input gradient).
  It is a sample taken on a shared machine under the same load as the
  training windows, not a bound: a training window can beat it (one did in
  docs/bench.json), so nothing calls it a ceiling;
- peak memory: the RSS high-water mark of each contender's process;
- images per CPU-second: images over the CPU time the process used in the
  window, an efficiency that other load on the machine disturbs far less
  than wall time does.

How. Every contender (Keras, legacy and modern for each tower count, and the
matmul) runs in its own process (`python -m cifar10_towers.bench --contend SPEC`), started
once and then paced: at each window boundary it reports the window's times
and waits, blocked, until the parent says "go". The parent runs one window of
each contender in turn (a round; the order rotates from round to round), so
the windows a ratio compares are seconds apart, not minutes: this machine is
shared and its speed drifts by 20-40% from minute to minute. Every ratio is
the median over rounds of that round's ratio. Separate processes because the
trainers cannot share one: the CPU is split into logical devices once per
process, legacy's queue threads and tf.data's and Keras' thread pools would
compete, and peak memory is per process. A waiting contender uses no CPU once
its input buffers are full (legacy's queues, tf.data's prefetch); the few
batches buffered during the wait save the next window at most their
preprocessing, about 1% of a window. The inputs alone are then measured one
process each (`--worker SPEC`).

No click here: `cli.py bench` is the command line; `run`, `format_table`,
`write_json`, `read_json` and `plot` are the API. `plot` draws a report (a
fresh one or a `--json` file read back) as a PNG with matplotlib, which is
an optional extra.
"""

import dataclasses
import datetime
import json
import os
import platform
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from cifar10_towers.common import errors

# The directory that holds the cifar10_towers package (a checkout or site-packages).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ('legacy', 'modern')
BASELINE = 'keras'  # the contender every ratio is taken against
MATMUL = 'matmul'  # the contender that measures the machine's FLOP/s
RESULT_PREFIX = 'BENCH_RESULT '  # a worker's last stdout line: prefix + JSON
READY = 'BENCH_READY'  # a contender is built and waits for its first window
WINDOW_PREFIX = 'BENCH_WINDOW '  # a contender's window times: prefix + JSON
GO = 'go'  # the parent's line: run one more window
BASELINE_DISTINCT_BATCHES = 8  # in-memory global batches the baseline cycles over
INPUT_WARMUP_WINDOWS = 2  # input-alone windows discarded (the shuffle buffer fills first)
INPUT_WINDOWS = 5  # input-alone timed windows
MATPLOTLIB_HINT = ('matplotlib is not installed, and --plot needs it: pip install '
                   'matplotlib (or the [profile] extra: pip install -e .[profile])')


class BenchError(errors.Failure):
  """A measurement failed; the message names it and shows the worker's last error line."""


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What `run` measures and how long."""
  impls: tuple = IMPLS  # trainers to measure
  num_gpus: tuple = (1, 2)  # tower counts (logical CPU devices without GPUs)
  batch_size: int = 128  # images per tower per step
  data_dir: str | None = None  # CIFAR-10 data; None generates data in a temp dir
  rounds: int = 10  # timed rounds: one window of every contender each
  warmup_rounds: int = 2  # rounds run first and not counted
  window_steps: int = 10  # training steps per window
  matmul_size: int = 4096  # n of the n x n fp32 matmuls of the matmul estimate
  matmul_repeats: int = 2  # products per round; the estimate takes the best of all
  jit: bool = False  # XLA for both trainers (TrainConfig.jit); Keras keeps its default
  synth_per_file: int = 10000  # generated records per training file (CIFAR-10's size)
  timeout_secs: float = 900.0  # longest wait for one window (or a start) of a contender

  def __post_init__(self):
    unknown = [impl for impl in self.impls if impl not in IMPLS]
    if not self.impls or unknown:
      raise ValueError('impls must be a non-empty subset of %s, got %s'
                       % (IMPLS, self.impls))
    if not self.num_gpus or min(self.num_gpus) < 1:
      raise ValueError('num_gpus must be tower counts >= 1, got %s' % (self.num_gpus,))
    for name in ('batch_size', 'rounds', 'window_steps', 'matmul_size',
                 'matmul_repeats', 'synth_per_file'):
      if getattr(self, name) < 1:
        raise ValueError('%s must be >= 1, got %s' % (name, getattr(self, name)))
    if self.warmup_rounds < 0:
      raise ValueError('warmup_rounds must be >= 0, got %d' % self.warmup_rounds)

  @property
  def total_rounds(self):
    return self.warmup_rounds + self.rounds


def layer_flops_per_image():
  """(layer name, FLOPs of its forward product) of one image, from model_spec.LAYERS.

  FLOPs count 2 per multiply-add. Convolutions and matmuls only (pooling, LRN
  and ReLU are a rounding error): conv1 at 24x24, conv2 at 12x12 (after the
  first stride-2 pool), then the three fully connected layers.
  """
  from cifar10_towers.common import hparams  # pylint: disable=g-import-not-at-top
  from cifar10_towers.common import model_spec  # pylint: disable=g-import-not-at-top
  size = hparams.IMAGE_SIZE
  flops = []
  for layer in model_spec.LAYERS:
    if len(layer.weight_shape) == 4:
      kh, kw, cin, cout = layer.weight_shape
      flops.append((layer.name, 2 * size * size * kh * kw * cin * cout))
      size //= hparams.POOL_STRIDE  # the SAME, stride-2 max pool of the block
    else:
      fan_in, fan_out = layer.weight_shape
      flops.append((layer.name, 2 * fan_in * fan_out))
  return flops


def forward_flops_per_image():
  """FLOPs of one image's forward pass: about 36.9 MFLOP.

  docs/equivalence.md §1: ~18.5M multiply-adds.
  """
  return sum(flops for _, flops in layer_flops_per_image())


def training_flops_per_image():
  """FLOPs of one training image: about 105.3 MFLOP.

  The forward product of every layer, then backward the same again for its
  weight gradient, and again for its input gradient except for the first
  layer: conv1's input is the images, which no variable depends on, so
  neither trainer (nor Keras) runs that product (a traced step of
  `cli.py profile` shows Conv2DBackpropInput for conv2 only). So 3 x forward
  less conv1's forward, not 3 x forward (which counted 5.5 MFLOP too many).
  """
  layers = layer_flops_per_image()
  return 3 * sum(flops for _, flops in layers) - layers[0][1]


# --- inside a worker process -------------------------------------------------


def _peak_rss_bytes():
  """The RSS high-water mark of this process, in bytes.

  `getrusage`'s ru_maxrss survives exec on Linux: a worker would report its
  parent's peak (for example the 2 GB of generating data) if that was
  higher. /proc/self/status's VmHWM belongs to this program's own memory map,
  so it is preferred; getrusage (KiB on Linux) is the fallback elsewhere.
  """
  try:
    with open('/proc/self/status', encoding='ascii') as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Pacer:
  """Holds a contender at each window boundary until the parent says go.

  The first boundary reports READY; every later one reports the window just
  run: its wall and CPU seconds (and any extra figures). Talks over
  stdin/stdout, one line per message.
  """

  def __init__(self, stdin=None, stdout=None):
    self._stdin = stdin or sys.stdin
    self._stdout = stdout or sys.stdout
    self._start = None

  def boundary(self, **extra):
    now, cpu = time.perf_counter(), time.process_time()
    if self._start is None:
      message = READY
    else:
      message = WINDOW_PREFIX + json.dumps(dict(
          extra, seconds=now - self._start[0], cpu_seconds=cpu - self._start[1]))
    self._stdout.write(message + '\n')
    self._stdout.flush()
    line = self._stdin.readline()
    if line.strip() != GO:
      raise SystemExit('bench contender: the parent went away (got %r)' % line)
    self._start = (time.perf_counter(), time.process_time())


def _plan(num_gpus):
  from cifar10_towers.common import devices  # pylint: disable=g-import-not-at-top
  return devices.plan_devices(num_gpus)


def _train_config(spec, train_dir, max_steps):
  from cifar10_towers.common import config as config_lib  # pylint: disable=g-import-not-at-top
  return config_lib.TrainConfig(
      data_dir=spec['data_dir'], train_dir=train_dir, num_gpus=spec['num_gpus'],
      batch_size=spec['batch_size'], max_steps=max_steps,
      # Only the final checkpoint, after the last window.
      save_every=max_steps + 1, jit=spec['jit'])


def contend_training(spec, pacer):
  """Runs one trainer's real `train()`, paced by its `on_step` callback.

  Every `window_steps`-th step ends a window; the first (after graph building,
  queue filling or tracing, and one window of steps) is the READY boundary.

  Args:
    spec: dict with impl, num_gpus, batch_size, data_dir, window_steps, jit
      and windows (the number of windows to run).
    pacer: Pacer.

  Returns:
    dict with peak_rss_bytes.
  """
  plan = _plan(spec['num_gpus'])
  if spec['impl'] == 'legacy':
    from cifar10_towers.legacy import train as trainer  # pylint: disable=g-import-not-at-top
  else:
    from cifar10_towers.modern import train as trainer  # pylint: disable=g-import-not-at-top
  boundaries = []

  def on_step(step, seconds, images):
    del seconds, images  # the pacer times whole windows
    if step % spec['window_steps'] == 0:
      boundaries.append(step)
      pacer.boundary()

  with tempfile.TemporaryDirectory(prefix='bench_train_') as train_dir:
    config = _train_config(spec, train_dir,
                           (spec['windows'] + 1) * spec['window_steps'])
    trainer.train(config, plan, on_step=on_step)
  if len(boundaries) != spec['windows'] + 1:
    raise BenchError('%s ran %d windows, expected %d'
                     % (spec['impl'], len(boundaries), spec['windows'] + 1))
  return {'peak_rss_bytes': _peak_rss_bytes()}


def keras_model(tf, keras):
  """The CIFAR-10 net of docs/equivalence.md §1 as a Keras functional model (the baseline's).

  The same layers, shapes, initializers (truncated normal weights, constant
  biases) and weight decay as `common.model_spec`: Keras' L2(l) adds
  l * sum(w**2), so wd * l2_loss(w) = wd * sum(w**2) / 2 is L2(wd / 2).
  """
  from cifar10_towers.common import hparams  # pylint: disable=g-import-not-at-top
  from cifar10_towers.common import model_spec  # pylint: disable=g-import-not-at-top
  layers = keras.layers

  class LocalResponseNormalization(layers.Layer):
    """`tf.nn.local_response_normalization` with the net's constants."""

    def call(self, x):
      return tf.nn.local_response_normalization(
          x, depth_radius=hparams.LRN_DEPTH_RADIUS, bias=hparams.LRN_BIAS,
          alpha=hparams.LRN_ALPHA, beta=hparams.LRN_BETA)

  def kwargs(name, activation):
    spec = model_spec.LAYERS_BY_NAME[name]
    return dict(
        name=name, activation=activation,
        kernel_initializer=keras.initializers.TruncatedNormal(stddev=spec.stddev),
        bias_initializer=keras.initializers.Constant(spec.bias_init),
        kernel_regularizer=(keras.regularizers.L2(spec.wd / 2.0) if spec.wd
                            else None))

  def conv(name):
    spec = model_spec.LAYERS_BY_NAME[name]
    return layers.Conv2D(spec.weight_shape[-1], spec.weight_shape[:2],
                         padding='same', **kwargs(name, 'relu'))

  def dense(name, activation='relu'):
    spec = model_spec.LAYERS_BY_NAME[name]
    return layers.Dense(spec.weight_shape[-1], **kwargs(name, activation))

  def pool(name):
    return layers.MaxPooling2D(hparams.POOL_KSIZE, hparams.POOL_STRIDE,
                               padding='same', name=name)

  size = hparams.IMAGE_SIZE
  images = keras.Input((size, size, 3))
  x = conv('conv1')(images)
  x = pool('pool1')(x)
  x = LocalResponseNormalization(name='norm1')(x)
  x = conv('conv2')(x)
  x = LocalResponseNormalization(name='norm2')(x)
  x = pool('pool2')(x)
  x = layers.Flatten()(x)
  x = dense('local3')(x)
  x = dense('local4')(x)
  logits = dense('softmax_linear', activation=None)(x)
  return keras.Model(images, logits, name='cifar10')


def contend_baseline(spec, pacer):
  """Runs the same net in Keras `model.fit` under MirroredStrategy, paced at epoch ends.

  One `fit` call of windows + 1 epochs of `window_steps` steps; the first
  epoch's end (after tracing) is the READY boundary.

  Args:
    spec: dict with num_gpus, batch_size, data_dir, window_steps, windows.
    pacer: Pacer.

  Returns:
    dict with peak_rss_bytes.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  plan = _plan(spec['num_gpus'])
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from cifar10_towers.common import cifar10_format as fmt  # pylint: disable=g-import-not-at-top
  from cifar10_towers.common import hparams  # pylint: disable=g-import-not-at-top
  size = hparams.IMAGE_SIZE
  global_batch = spec['batch_size'] * spec['num_gpus']
  rng = np.random.default_rng(0)
  shape = (BASELINE_DISTINCT_BATCHES, global_batch)
  images = rng.standard_normal(shape + (size, size, 3)).astype(np.float32)
  labels = rng.integers(0, hparams.NUM_CLASSES, shape).astype(np.int32)
  # Pre-batched in memory: the baseline spends nothing on input.
  dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat()
  dataset = dataset.prefetch(tf.data.AUTOTUNE)

  strategy = tf.distribute.MirroredStrategy(devices=list(plan.tower_devices))
  with strategy.scope():
    model = keras_model(tf, keras)
    decay_steps = hparams.decay_steps(
        fmt.num_examples(fmt.train_files(spec['data_dir'])), spec['batch_size'],
        spec['num_gpus'])
    schedule = keras.optimizers.schedules.ExponentialDecay(
        hparams.INITIAL_LEARNING_RATE, decay_steps=decay_steps,
        decay_rate=hparams.LEARNING_RATE_DECAY_FACTOR, staircase=True)
    model.compile(
        optimizer=keras.optimizers.SGD(
            schedule, use_ema=True, ema_momentum=hparams.MOVING_AVERAGE_DECAY),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

  class EpochEnds(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      del epoch, logs
      pacer.boundary()

  model.fit(dataset, epochs=spec['windows'] + 1,
            steps_per_epoch=spec['window_steps'], verbose=0,
            callbacks=[EpochEnds()])
  return {'peak_rss_bytes': _peak_rss_bytes()}


def contend_matmul(spec, pacer):
  """Measures fp32 matmul FLOP/s: each window, the best of `matmul_repeats` products.

  Args:
    spec: dict with matmul_size (n), matmul_repeats and windows.
    pacer: Pacer.

  Returns:
    dict with peak_rss_bytes.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = spec['matmul_size']
  a = tf.random.normal([n, n], dtype=tf.float32)
  b = tf.random.normal([n, n], dtype=tf.float32)
  tf.matmul(a, b).numpy()
  pacer.boundary()
  for _ in range(spec['windows']):
    best = 0.0
    for _ in range(spec['matmul_repeats']):
      start = time.perf_counter()
      product = tf.matmul(a, b)
      product[0, 0].numpy()  # eager CPU ops are synchronous; this makes sure
      best = max(best, 2.0 * n ** 3 / (time.perf_counter() - start))
    pacer.boundary(flops_per_sec=best)
  return {'peak_rss_bytes': _peak_rss_bytes()}


def _legacy_input_stamps(spec, windows):
  """Time stamps of legacy's prefetch-queue dequeues, one per window end."""
  import tensorflow.compat.v1 as tf  # pylint: disable=g-import-not-at-top
  from cifar10_towers.legacy import inputs as legacy_inputs  # pylint: disable=g-import-not-at-top
  from cifar10_towers.legacy import train as legacy_train  # pylint: disable=g-import-not-at-top
  plan = _plan(spec['num_gpus'])
  stamps = []
  config = _train_config(spec, tempfile.gettempdir(), 1)
  with tf.Graph().as_default():
    tower_batches = legacy_train.tower_input_batches(config)
    init = tf.local_variables_initializer()
    close_queues = legacy_inputs.close_queue_ops()
    with tf.Session(config=legacy_train.session_config(plan)) as sess:
      sess.run(init)
      coord = tf.train.Coordinator()
      threads = tf.train.start_queue_runners(sess=sess, coord=coord)
      try:
        sess.run(tower_batches)  # waits for the shuffle queue to fill
        stamps.append(time.perf_counter())
        for _ in range(windows):
          for _ in range(spec['window_steps']):
            sess.run(tower_batches)
          stamps.append(time.perf_counter())
      finally:
        coord.request_stop()
        for close in close_queues:
          sess.run(close)
        coord.join(threads, stop_grace_period_secs=10)
  return stamps


def _modern_input_stamps(spec, windows):
  """Time stamps of modern's dataset elements (all towers' batches) at window ends."""
  from cifar10_towers.modern import inputs  # pylint: disable=g-import-not-at-top
  _plan(spec['num_gpus'])
  iterator = iter(inputs.distorted_inputs(spec['data_dir'], spec['batch_size'],
                                          spec['num_gpus']))
  next(iterator)  # fills the shuffle buffer
  stamps = [time.perf_counter()]
  for _ in range(windows):
    for _ in range(spec['window_steps']):
      next(iterator)
    stamps.append(time.perf_counter())
  return stamps


def measure_input(spec):
  """Images/sec one trainer's input pipeline delivers to its towers, with no training.

  A "step" takes one batch for each tower, as a training step does; the
  first INPUT_WARMUP_WINDOWS windows are not counted.

  Args:
    spec: dict with impl, num_gpus, batch_size, data_dir, window_steps.

  Returns:
    dict with window_images_per_sec and peak_rss_bytes.
  """
  windows = INPUT_WARMUP_WINDOWS + INPUT_WINDOWS
  if spec['impl'] == 'legacy':
    stamps = _legacy_input_stamps(spec, windows)
  else:
    stamps = _modern_input_stamps(spec, windows)
  images = spec['window_steps'] * spec['batch_size'] * spec['num_gpus']
  rates = [images / (b - a) for a, b in zip(stamps, stamps[1:])]
  return {'window_images_per_sec': rates[INPUT_WARMUP_WINDOWS:],
          'peak_rss_bytes': _peak_rss_bytes()}


_CONTENDERS = {
    'train': contend_training,
    'baseline': contend_baseline,
    'matmul': contend_matmul,
}
_MEASUREMENTS = {
    'input': measure_input,
}


def worker_main(argv):
  """`python -m cifar10_towers.bench --contend SPEC` (paced) or `--worker SPEC` (one shot)."""
  if len(argv) != 2 or argv[0] not in ('--contend', '--worker'):
    print('usage: python -m cifar10_towers.bench --contend|--worker SPEC_JSON (internal; use '
          '`cifar10-towers bench` or `python cli.py bench`)', file=sys.stderr)
    return 2
  spec = json.loads(argv[1])
  try:
    if argv[0] == '--contend':
      result = _CONTENDERS[spec['kind']](spec, Pacer())
    else:
      result = _MEASUREMENTS[spec['kind']](spec)
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    return 1
  sys.stdout.flush()
  print(RESULT_PREFIX + json.dumps(result), flush=True)
  return 0


# --- orchestration (the parent process) --------------------------------------


def _worker_command(flag, spec):
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env['PYTHONPATH'] = os.pathsep.join(
      [ROOT] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
  return [sys.executable, '-m', 'cifar10_towers.bench', flag, json.dumps(spec)], env


def _last_error_line(text):
  lines = [l for l in text.splitlines() if l.strip()]
  return lines[-1] if lines else 'no output'


def run_worker(spec, timeout_secs):
  """Runs one one-shot measurement in a fresh Python process; returns its result dict.

  Raises:
    BenchError: the worker failed or timed out; the message holds its last
      error line.
  """
  command, env = _worker_command('--worker', spec)
  try:
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_secs, check=False)
  except subprocess.TimeoutExpired as e:
    raise BenchError('%s timed out after %.0f s' % (describe(spec), timeout_secs)) from e
  for line in reversed(proc.stdout.splitlines()):
    if proc.returncode == 0 and line.startswith(RESULT_PREFIX):
      return json.loads(line[len(RESULT_PREFIX):])
  raise BenchError('%s failed (exit %d): %s' % (
      describe(spec), proc.returncode, _last_error_line(proc.stderr)))


class Contender:
  """A paced contender process (`python -m cifar10_towers.bench --contend SPEC`), parent side."""

  def __init__(self, spec, timeout_secs):
    self.spec = spec
    self._timeout = timeout_secs
    self._stderr = tempfile.TemporaryFile(mode='w+')
    command, env = _worker_command('--contend', spec)
    self._proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1)
    # A thread turns stdout into a queue of lines ('' at its end), so that
    # waiting for a line can time out.
    self._lines = queue.Queue()
    threading.Thread(target=self._pump, daemon=True).start()

  def _pump(self):
    for line in self._proc.stdout:
      self._lines.put(line)
    self._lines.put('')

  def _read(self, expect):
    """The next protocol line starting with `expect` (other output is skipped)."""
    deadline = time.monotonic() + self._timeout
    while True:
      try:
        line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.001))
      except queue.Empty:
        self.kill()
        raise BenchError('%s timed out after %.0f s' % (describe(self.spec),
                                                        self._timeout)) from None
      if not line:  # the process ended
        self._proc.wait()
        self._stderr.seek(0)
        raise BenchError('%s failed (exit %s): %s' % (
            describe(self.spec), self._proc.returncode,
            _last_error_line(self._stderr.read())))
      if line.startswith(expect):
        return line.rstrip('\n')[len(expect):]

  def _go(self):
    self._proc.stdin.write(GO + '\n')
    self._proc.stdin.flush()

  def wait_ready(self):
    """Blocks until the contender is built and waits for its first window."""
    self._read(READY)

  def window(self):
    """Runs one window; returns its dict (seconds, cpu_seconds, ...)."""
    self._go()
    return json.loads(self._read(WINDOW_PREFIX))

  def finish(self):
    """Lets the contender end after its last window; returns its result dict."""
    self._go()
    result = json.loads(self._read(RESULT_PREFIX))
    self._proc.wait(timeout=self._timeout)
    self._stderr.close()
    return result

  def kill(self):
    if self._proc.poll() is None:
      self._proc.kill()
      self._proc.wait()


def describe(spec):
  """What a measurement spec measures, in words (the progress line)."""
  kind = spec['kind']
  if kind == 'matmul':
    return ('matmul rate: %d fp32 %dx%d matmul(s)'
            % (spec['matmul_repeats'], spec['matmul_size'], spec['matmul_size']))
  who = BASELINE if kind == 'baseline' else spec['impl']
  what = {'train': 'training', 'input': 'input pipeline alone',
          'baseline': 'Keras model.fit, MirroredStrategy, in-memory data'
         }.get(kind, kind)
  return '%s, %d tower(s) x batch %d: %s%s' % (
      who, spec['num_gpus'], spec['batch_size'], what,
      ' (XLA)' if spec.get('jit') and kind != 'baseline' else '')


def _median(values):
  return float(statistics.median(values))


def contender_specs(config, data_dir):
  """The paced contenders: per tower count Keras and each trainer; then the matmul."""
  common = dict(batch_size=config.batch_size, data_dir=data_dir,
                window_steps=config.window_steps, jit=config.jit,
                windows=config.total_rounds)
  specs = []
  for num_gpus in config.num_gpus:
    specs.append(dict(common, kind='baseline', impl=BASELINE, num_gpus=num_gpus))
    for impl in config.impls:
      specs.append(dict(common, kind='train', impl=impl, num_gpus=num_gpus))
  specs.append(dict(kind='matmul', impl=MATMUL, matmul_size=config.matmul_size,
                    matmul_repeats=config.matmul_repeats,
                    windows=config.total_rounds))
  return specs


def input_specs(config, data_dir):
  """The one-shot input-alone measurements."""
  return [dict(kind='input', impl=impl, num_gpus=num_gpus,
               batch_size=config.batch_size, data_dir=data_dir,
               window_steps=config.window_steps, jit=config.jit)
          for num_gpus in config.num_gpus for impl in config.impls]


def _key(spec):
  return (spec['impl'], spec.get('num_gpus'))


def cpu_model():
  """The CPU's model name (Linux: /proc/cpuinfo), for the report; '' if unknown."""
  try:
    with open('/proc/cpuinfo', encoding='ascii', errors='replace') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def summarize(config, windows, finals, inputs, data_description):
  """The report: rates, ratios and memory of every contender.

  Args:
    config: BenchConfig.
    windows: dict (impl, num_gpus) -> list of window dicts (seconds,
      cpu_seconds, round; round < 0 in warm-up), in the order they ran; the
      matmul's key is (MATMUL, None) and its windows hold flops_per_sec.
    finals: dict (impl, num_gpus) -> the contender's result (peak_rss_bytes).
    inputs: dict (impl, num_gpus) -> `measure_input` result.
    data_description: str, where the training data came from.

  Returns:
    dict, JSON-serializable: settings, machine and one row per contender.
  """
  matmul_runs = [w['flops_per_sec'] for w in windows[(MATMUL, None)]]
  flops_per_sec = max(matmul_runs)
  image_flops = training_flops_per_image()
  estimate = flops_per_sec / image_flops
  fewest = min(config.num_gpus)
  towers_key = 'ratio_to_%d_tower' % fewest

  def timed(impl, num_gpus):
    """Round -> images/sec and images/CPU-second of a contender's timed windows."""
    images = config.window_steps * config.batch_size * num_gpus
    return {w['round']: (images / w['seconds'], images / w['cpu_seconds'])
            for w in windows[(impl, num_gpus)] if w['round'] >= 0}

  rows = []
  for num_gpus in config.num_gpus:
    baseline = timed(BASELINE, num_gpus)
    for impl in (BASELINE,) + tuple(config.impls):
      mine, few = timed(impl, num_gpus), timed(impl, fewest)
      rounds = [{
          'round': r,
          'images_per_sec': rate,
          'images_per_cpu_second': cpu_rate,
          'baseline_images_per_sec': baseline[r][0],
          'ratio_to_baseline': rate / baseline[r][0],
          towers_key: rate / few[r][0],
      } for r, (rate, cpu_rate) in sorted(mine.items())]
      rates = [r['images_per_sec'] for r in rounds]
      rate = _median(rates)
      row = {
          'impl': impl,
          'num_gpus': num_gpus,
          'batch_size': config.batch_size,
          'jit': config.jit and impl != BASELINE,
          'images_per_sec': rate,
          'window_min': min(rates),
          'window_max': max(rates),
          'images_per_cpu_second': _median(r['images_per_cpu_second'] for r in rounds),
          'ratio_to_baseline': _median(r['ratio_to_baseline'] for r in rounds),
          'ratio_to_matmul_estimate': rate / estimate,
          towers_key: _median(r[towers_key] for r in rounds),
          'peak_rss_bytes': finals[(impl, num_gpus)]['peak_rss_bytes'],
          'rounds': rounds,
          'input_images_per_sec': None,
          'input_window_images_per_sec': None,
          'input_to_training': None,
          'input_peak_rss_bytes': None,
      }
      result = inputs.get((impl, num_gpus))
      if result is not None:
        row['input_images_per_sec'] = _median(result['window_images_per_sec'])
        row['input_window_images_per_sec'] = result['window_images_per_sec']
        row['input_to_training'] = row['input_images_per_sec'] / rate
        row['input_peak_rss_bytes'] = result['peak_rss_bytes']
      rows.append(row)
  return {
      'settings': dict(dataclasses.asdict(config), data=data_description),
      'measured_at': datetime.datetime.now(datetime.timezone.utc).strftime(
          '%Y-%m-%d %H:%M UTC'),
      'machine': {
          'cpu_count': os.cpu_count(),
          'cpu_model': cpu_model(),
          'matmul_size': config.matmul_size,
          'matmul_flops_per_sec': flops_per_sec,
          'matmul_runs_flops_per_sec': matmul_runs,
          'training_flops_per_image': image_flops,
          'matmul_estimate_images_per_sec': estimate,
      },
      'rows': rows,
  }


def run(config, progress=None, launch=Contender, runner=run_worker):
  """Runs every measurement of `config`; returns the report of `summarize`.

  Args:
    config: BenchConfig.
    progress: optional callable(str), told what is being measured (stderr).
    launch: callable(spec, timeout_secs) -> a started Contender (tests may
      substitute it).
    runner: callable(spec, timeout_secs) -> result dict of a one-shot
      measurement; `run_worker` runs a subprocess.

  Raises:
    BenchError: a measurement failed.
    common.cifar10_format.DataError: data_dir holds no valid training data.
  """
  progress = progress or (lambda _: None)
  with tempfile.TemporaryDirectory(prefix='bench_data_') as tmp:
    if config.data_dir is None:
      from cifar10_towers.common import synth  # pylint: disable=g-import-not-at-top
      progress('Generating %d training records in %s ...'
               % (5 * config.synth_per_file, tmp))
      synth.generate(tmp, train_per_file=config.synth_per_file, num_test=10)
      data_dir = tmp
      data_description = 'generated (common.synth), %d records' % (
          5 * config.synth_per_file)
    else:
      from cifar10_towers.common import cifar10_format as fmt  # pylint: disable=g-import-not-at-top
      data_dir = config.data_dir
      data_description = '%s, %d records' % (
          data_dir, fmt.num_examples(fmt.train_files(data_dir)))

    specs = contender_specs(config, data_dir)
    progress('Starting %d contenders, one process each: %s'
             % (len(specs), '; '.join(describe(s) for s in specs)))
    contenders = []
    try:
      for spec in specs:
        contenders.append(launch(spec, config.timeout_secs))
      for i, contender in enumerate(contenders):
        contender.wait_ready()  # its TensorFlow import, graph or trace: seconds each
        progress('Ready: %s (%d of %d)' % (describe(contender.spec), i + 1,
                                             len(contenders)))
      windows = {_key(c.spec): [] for c in contenders}
      for r in range(config.total_rounds):
        timed_round = r - config.warmup_rounds
        label = ('warm-up %d/%d' % (r + 1, config.warmup_rounds) if timed_round < 0
                 else 'round %d/%d' % (timed_round + 1, config.rounds))
        shift = r % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
          what = describe(contender.spec)
          if contender.spec['kind'] != 'matmul':
            what += ', %d steps' % config.window_steps
          progress('[%s] measuring %s' % (label, what))
          window = contender.window()
          window['round'] = timed_round
          windows[_key(contender.spec)].append(window)
      finals = {_key(c.spec): c.finish() for c in contenders}
    finally:
      for contender in contenders:
        contender.kill()

    inputs = {}
    for spec in input_specs(config, data_dir):
      progress('[inputs] measuring %s' % describe(spec))
      inputs[_key(spec)] = runner(spec, config.timeout_secs)
  return summarize(config, windows, finals, inputs, data_description)


def _mib(num_bytes):
  return '%.0f' % (num_bytes / 2 ** 20) if num_bytes is not None else '-'


def format_table(report):
  """The report as a text table with a header of how it was measured."""
  machine, settings = report['machine'], report['settings']
  fewest = min(settings['num_gpus'])
  towers_key = 'ratio_to_%d_tower' % fewest
  lines = [
      'matmul estimate: best of %d rounds of fp32 %dx%d matmuls = %.1f GFLOP/s / '
      '%.1f MFLOP per training image (forward x 3 less conv1\'s input gradient) = '
      '%.0f images/sec (a sample under the same load, not a bound)'
      % (len(machine['matmul_runs_flops_per_sec']), machine['matmul_size'],
         machine['matmul_size'], machine['matmul_flops_per_sec'] / 1e9,
         machine['training_flops_per_image'] / 1e6,
         machine['matmul_estimate_images_per_sec']),
      'training: median of %d rounds, one window of %d steps per contender each '
      '(the order rotating; %d warm-up rounds first); ratios: median of the '
      'per-round ratios; data: %s'
      % (settings['rounds'], settings['window_steps'], settings['warmup_rounds'],
         settings['data']),
      '',
  ]
  header = ('impl', 'towers', 'batch', 'img/s', 'windows min-max', 'img/cpu-s',
            'vs keras', 'vs matmul', 'vs %d tower' % fewest, 'input img/s',
            'input/train', 'peak RSS MiB')
  table = [header]
  for row in report['rows']:
    name = row['impl'] + (' (XLA)' if row['jit'] else '')
    table.append((
        name, str(row['num_gpus']), str(row['batch_size']),
        '%.0f' % row['images_per_sec'],
        '%.0f-%.0f' % (row['window_min'], row['window_max']),
        '%.0f' % row['images_per_cpu_second'],
        '%.2fx' % row['ratio_to_baseline'],
        '%.2f' % row['ratio_to_matmul_estimate'],
        '%.2fx' % row[towers_key],
        ('%.0f' % row['input_images_per_sec']
         if row['input_images_per_sec'] is not None else '-'),
        ('%.1fx' % row['input_to_training']
         if row['input_to_training'] is not None else '-'),
        _mib(row['peak_rss_bytes']),
    ))
  widths = [max(len(r[i]) for r in table) for i in range(len(header))]
  for r in table:
    lines.append('  '.join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip())
  return '\n'.join(lines)


def write_json(report, path):
  """Writes the report as JSON (atomically)."""
  tmp = '%s.tmp-%d' % (path, os.getpid())
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(report, f, indent=2, sort_keys=True)
    f.write('\n')
  os.replace(tmp, path)


def read_json(path):
  """Reads back a report written by `write_json` (`bench --json`).

  Raises:
    BenchError: the file cannot be read or holds no bench report.
  """
  try:
    with open(path, encoding='utf-8') as f:
      report = json.load(f)
  except (OSError, ValueError) as e:
    raise BenchError('cannot read %s: %s' % (path, e)) from e
  if not (isinstance(report, dict) and report.get('rows')
          and all(k in report for k in ('settings', 'machine'))):
    raise BenchError('%s is not a bench results file (one written by bench --json)'
                     % path)
  return _upgraded(report)


def _upgraded(report):
  """An older report with today's names, its derived figures recomputed.

  Reports written before the matmul estimate was named for what it is call
  it 'ceiling_images_per_sec' (and each row's ratio 'ratio_to_ceiling'),
  computed from forward x 3 FLOPs per image. They get today's keys, values
  and FLOP count; what was measured (the matmul rates, every window) stays
  as it is.
  """
  machine = report['machine']
  if 'ceiling_images_per_sec' not in machine:
    return report
  del machine['ceiling_images_per_sec']
  machine['training_flops_per_image'] = training_flops_per_image()
  estimate = machine['matmul_flops_per_sec'] / machine['training_flops_per_image']
  machine['matmul_estimate_images_per_sec'] = estimate
  for row in report['rows']:
    row.pop('ratio_to_ceiling', None)
    row['ratio_to_matmul_estimate'] = row['images_per_sec'] / estimate
  return report


def check_plotting():
  """Raises BenchError(MATPLOTLIB_HINT) unless matplotlib can be imported."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise BenchError(MATPLOTLIB_HINT) from e
  del matplotlib  # only whether it imports


COLOURS = {BASELINE: '#9e9e9e', 'legacy': '#1f77b4', 'modern': '#ff7f0e'}


def plot(report, path):
  """Draws the report's training images/sec (`figure`) into a PNG file.

  Raises:
    BenchError: matplotlib is missing (MATPLOTLIB_HINT).
  """
  check_plotting()
  figure(report).savefig(path, dpi=100)


def figure(report):
  """The report's training images/sec as a matplotlib bar chart.

  One group of bars per tower count, one bar per contender: the median
  img/s, the windows' min-max as error bars, Keras (grey) the reference,
  each trainer's ratio to it (the median of the per-round ratios) written
  above its bar; the matmul estimate a dotted line, labelled with how it
  was computed and not as a bound (a training window can beat it). The
  caption names the settings, the data, the machine and when it was
  measured, and the report's 'note' if it has one.

  Returns:
    matplotlib.figure.Figure (no pyplot: nothing global is touched).
  """
  from matplotlib import figure as figure_lib  # pylint: disable=g-import-not-at-top
  settings, machine = report['settings'], report['machine']
  towers = sorted({row['num_gpus'] for row in report['rows']})
  names = []
  for row in report['rows']:
    if row['impl'] not in names:
      names.append(row['impl'])
  rows = {(row['impl'], row['num_gpus']): row for row in report['rows']}
  width = 0.8 / len(names)
  fig = figure_lib.Figure(figsize=(8, 5.2))
  axes = fig.add_subplot()
  estimate = machine['matmul_estimate_images_per_sec']
  top = estimate
  for i, impl in enumerate(names):
    xs, heights, errors = [], [], [[], []]
    for g, n in enumerate(towers):
      row = rows.get((impl, n))
      if row is None:
        continue
      x = g + (i - (len(names) - 1) / 2) * width
      rate = row['images_per_sec']
      xs.append(x)
      heights.append(rate)
      errors[0].append(rate - row['window_min'])
      errors[1].append(row['window_max'] - rate)
      top = max(top, row['window_max'])
      text = ('%.0f\n%s' % (rate, 'reference' if impl == BASELINE
                              else '%.2fx Keras' % row['ratio_to_baseline']))
      axes.annotate(text, (x, row['window_max']), xytext=(0, 3),
                    textcoords='offset points', ha='center', va='bottom',
                    fontsize=8, fontweight='normal' if impl == BASELINE else 'bold',
                    bbox={'facecolor': 'white', 'edgecolor': 'none', 'pad': 1,
                          'alpha': 0.8})  # readable across the matmul line
    jit = any(rows[(impl, n)]['jit'] for n in towers if (impl, n) in rows)
    label = ('Keras model.fit of the same net (MirroredStrategy, in-memory data)'
             if impl == BASELINE else
             '%s%s: its own train() loop and input pipeline'
             % (impl, ' (XLA)' if jit else ''))
    axes.bar(xs, heights, width * 0.9, yerr=errors, capsize=4,
             color=COLOURS.get(impl, '#2ca02c'), label=label,
             error_kw={'elinewidth': 1, 'ecolor': '#333333'})
  axes.axhline(estimate, color='black', linestyle=':', linewidth=1,
               label='matmul estimate %.0f = best fp32 %dx%d matmul rate, %.1f '
               'GFLOP/s, / %.1f MFLOP per training image'
               % (estimate, machine['matmul_size'], machine['matmul_size'],
                  machine['matmul_flops_per_sec'] / 1e9,
                  machine['training_flops_per_image'] / 1e6))
  axes.set_xticks(range(len(towers)))
  axes.set_xticklabels(['%d tower%s' % (n, '' if n == 1 else 's') for n in towers])
  axes.set_ylim(0, top * 1.25)
  axes.set_ylabel('training images/sec (median of the windows)')
  axes.set_title('Training images/sec, batch %d per tower: bars median, error bars '
                 'windows min-max' % settings['batch_size'], fontsize=10)
  axes.legend(loc='upper left', fontsize=8, frameon=False)
  where = ', '.join(str(part) for part in (
      '%s CPUs' % machine.get('cpu_count'), machine.get('cpu_model'),
      report.get('measured_at')) if part)
  caption = ['%d rounds of one %d-step window per contender (after %d warm-up); '
             'ratios: median of per-round ratios to Keras'
             % (settings['rounds'], settings['window_steps'],
                settings['warmup_rounds']),
             'matmul estimate: measured in its own process, taking turns with '
             'the bars\' windows; a sample under the same load, not a bound '
             '(a window can beat it)',
             'data: %s; machine: %s' % (settings['data'], where)]
  if report.get('note'):
    caption.append(report['note'])
  fig.text(0.01, 0.01, '\n'.join(caption), fontsize=7, va='bottom', ha='left',
           wrap=True)
  fig.tight_layout(rect=(0, 0.04 + 0.025 * len(caption), 1, 1))
  return fig


if __name__ == '__main__':
  from cifar10_towers.common import stderr_filter
  stderr_filter.install()  # as cli.main: TensorFlow's known noise never shows
  sys.exit(worker_main(sys.argv[1:]))
