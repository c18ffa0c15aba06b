"""Beyond the towers: the modern trainer on TensorFlow's distribution engines.

Two engines run the step of `modern.train` (SPEC §1) with `tf.distribute`
instead of hand-placed towers:

  mirrored     `tf.distribute.MirroredStrategy` over the plan's devices (the
               towers' devices): one replica per device, the variables
               mirrored on every device, gradients all-reduced on
               `devices.VARIABLE_DEVICE` (`ReductionToOneDevice`, which works
               on CPUs and GPUs alike).
  multiworker  `tf.distribute.MultiWorkerMirroredStrategy`: `--num_gpus`
               replicas on each of several worker processes (machines), the
               gradients all-reduced across all replicas of all workers by
               collective ops over gRPC. The cluster comes from the
               `TF_CONFIG` environment variable (the ecosystem's convention)
               or from `--worker_hosts` and `--task_index`.

Both are `StrategyTrainer`s, which have the interface of `modern.train.Trainer`
(`compute_gradients`, `train_step`, `assign_variables`, `variables`,
`shadow_variables`, `global_step`), so the cross-check drives them like the
towers. The update is the towers': no Keras optimizer, plain gradient descent
with the learning rate read before the global step's increment, then the
moving averages with the decay of the incremented step. Checkpoints have the
layout of `modern.train.checkpoint_object`, so eval and convert read them.

Every step is synchronous: each replica computes the gradients of its own
batch, the all-reduce waits for every replica of every worker, and every
replica applies the same averaged gradient to its own copy of the variables.
The global batch is batch_size x num_gpus x number of workers.

`train()` is the training loop for both engines (`modern.train.train` hands
over to it when `config.strategy` is not 'towers'). With several workers the
chief (task 0, or the 'chief' task of TF_CONFIG) writes checkpoints and
summaries to train_dir and prints progress; every other worker writes to
`<train_dir>/workertemp_<id>` (TensorFlow's multi-worker convention: all
workers save, only the chief's copy is kept), removes it when it ends, and
prints only warnings and errors.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import threading
import time

import tensorflow as tf
# MultiWorkerMirroredStrategy has no public way to choose its local devices;
# see _PlannedCollectiveExtended.
from tensorflow.python.distribute import collective_all_reduce_strategy  # pylint: disable=g-direct-tensorflow-import

from common import checkpoints
from common import cifar10_format as fmt
from common import config as config_lib
from common import devices
from common import hparams
from common import model_spec
from common import training
from modern import inputs
from modern import train as train_lib

DEFAULT_PEER_TIMEOUT_SECS = config_lib.TrainConfig.peer_timeout  # 60 s
STARTUP_TIMEOUT_SECS = 600  # workers wait this long for each other to start
WORKER_TEMP_PREFIX = 'workertemp_'  # a non-chief's write dir: <train_dir>/workertemp_<id>
TF_CONFIG = 'TF_CONFIG'  # the environment variable naming the cluster

# What a collective raises when a peer is gone: UnavailableError (the peer's
# process is dead or unreachable, found by the coordination service's
# heartbeats or a refused connection), DeadlineExceededError (the collective
# timeout), and the aborts that follow either.
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
               tf.errors.CancelledError, tf.errors.AbortedError)


class ClusterError(Exception):
  """The cluster description is missing or malformed; the message says what to do."""


def _stderr(message):
  print(message, file=sys.stderr)


# --- the cluster ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The workers of a multi-worker run and which of them this process is."""
  jobs: dict  # job name ('chief', 'worker') -> tuple of 'host:port'
  task_type: str  # this process's job, 'worker' or 'chief'
  task_id: int  # this process's index within its job

  @property
  def num_workers(self):
    """Processes that train (the chief, if a 'chief' job is listed, and the workers)."""
    return sum(len(self.jobs.get(job, ())) for job in ('chief', 'worker'))

  @property
  def worker_index(self):
    """This process's place among the workers: 0 for the chief, then 1, 2, ...

    It is TensorFlow's `id_in_cluster`: the replicas of worker w have the
    global replica ids w * num_gpus ... (w + 1) * num_gpus - 1.
    """
    if self.task_type == 'chief':
      return self.task_id
    return len(self.jobs.get('chief', ())) + self.task_id

  @property
  def is_chief(self):
    return self.worker_index == 0

  def cluster_resolver(self):
    """A `tf.distribute.cluster_resolver.ClusterResolver` of this cluster."""
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({job: list(hosts) for job, hosts in self.jobs.items()}),
        task_type=self.task_type, task_id=self.task_id, rpc_layer='grpc')


def parse_worker_hosts(text):
  """'h1:p1,h2:p2' -> ('h1:p1', 'h2:p2'), every item checked.

  Raises:
    ClusterError: an item is not host:port with a port in 1..65535, or a
      host:port is listed twice.
  """
  hosts = tuple(item.strip() for item in text.split(',') if item.strip())
  if not hosts:
    raise ClusterError('--worker_hosts is empty; list the workers as '
                       'host:port,host:port.')
  for host in hosts:
    name, _, port = host.rpartition(':')
    if not name or not port.isdigit() or not 1 <= int(port) <= 65535:
      raise ClusterError('%r in --worker_hosts is not host:port (port 1..65535), '
                         'e.g. 10.0.0.1:2222.' % host)
  if len(set(hosts)) != len(hosts):
    raise ClusterError('--worker_hosts lists a host:port twice: %s.' % ','.join(hosts))
  return hosts


def resolve_cluster(worker_hosts=(), task_index=0, environ=None):
  """The cluster of a multiworker run, from --worker_hosts or TF_CONFIG.

  Args:
    worker_hosts: tuple of 'host:port', one per worker, the same list and
      order on every worker; empty to read TF_CONFIG.
    task_index: int, this worker's index in worker_hosts (0 is the chief).
    environ: mapping holding TF_CONFIG; default os.environ.

  Returns:
    Cluster.

  Raises:
    ClusterError: neither is given, TF_CONFIG is malformed, or the task is
      not in the cluster.
  """
  environ = os.environ if environ is None else environ
  if worker_hosts:
    hosts = tuple(worker_hosts)
    if not 0 <= task_index < len(hosts):
      raise ClusterError('--task_index %d is not an index of the %d --worker_hosts '
                         '(0..%d).' % (task_index, len(hosts), len(hosts) - 1))
    return Cluster({'worker': hosts}, 'worker', task_index)
  text = environ.get(TF_CONFIG, '').strip()
  if not text:
    raise ClusterError(
        '--strategy multiworker needs the cluster: set TF_CONFIG (e.g. '
        '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": '
        '{"type": "worker", "index": 0}}) or pass --worker_hosts and --task_index.')
  try:
    tf_config = json.loads(text)
  except ValueError as e:
    raise ClusterError('TF_CONFIG is not valid JSON (%s): %r' % (e, text)) from None
  cluster = tf_config.get('cluster') if isinstance(tf_config, dict) else None
  task = tf_config.get('task') if isinstance(tf_config, dict) else None
  if not isinstance(cluster, dict) or not isinstance(task, dict):
    raise ClusterError('TF_CONFIG needs "cluster" and "task" objects, got %r.' % text)
  jobs = {}
  for job, hosts in cluster.items():
    if job not in ('chief', 'worker'):
      raise ClusterError('TF_CONFIG lists a %r job; MultiWorkerMirroredStrategy '
                         'trains with "chief" and "worker" tasks only.' % job)
    if isinstance(hosts, str) or not isinstance(hosts, list) or not all(
        isinstance(h, str) for h in hosts):
      raise ClusterError('TF_CONFIG cluster.%s must be a list of "host:port", got %r.'
                         % (job, hosts))
    jobs[job] = parse_worker_hosts(','.join(hosts)) if hosts else ()
  if len(jobs.get('chief', ())) > 1:
    raise ClusterError('TF_CONFIG lists %d chiefs; there can be one.'
                       % len(jobs['chief']))
  task_type, task_id = task.get('type'), task.get('index', 0)
  if task_type not in jobs or not isinstance(task_id, int) or not (
      0 <= task_id < len(jobs[task_type])):
    raise ClusterError('TF_CONFIG task %r is not in its cluster %r.' % (task, cluster))
  return Cluster(jobs, task_type, task_id)


# --- the strategies ---------------------------------------------------------


def mirrored_strategy(plan):
  """MirroredStrategy with one replica on each of the plan's devices.

  The gradients meet on the variables' device (`ReductionToOneDevice`), where
  the towers average theirs; NCCL would need GPUs.
  """
  return tf.distribute.MirroredStrategy(
      devices=list(plan.tower_devices),
      cross_device_ops=tf.distribute.ReductionToOneDevice(
          reduce_to_device=devices.VARIABLE_DEVICE))


class _PlannedCollectiveExtended(
    collective_all_reduce_strategy.CollectiveAllReduceExtended):
  """MultiWorkerMirroredStrategy's internals, with the plan's devices as local replicas.

  The stock strategy takes all visible GPUs, or a single replica on the CPU
  when there is none; SPEC §3 wants `--num_gpus` replicas per worker on the
  plan's devices (GPUs, or logical CPU devices), as the towers have.
  """

  def __init__(self, container_strategy, cluster_resolver, communication_options,
               local_devices, device_type):
    self._planned_devices = tuple(local_devices)
    self._planned_device_type = device_type
    super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                     communication_options=communication_options)

  def _initialize_local_devices(self, cluster_resolver, worker_device):
    del cluster_resolver  # the plan decides
    names = tuple('%s/device:%s:%d' % (worker_device, spec.device_type, spec.device_index)
                  for spec in map(tf.DeviceSpec.from_string, self._planned_devices))
    return names, self._planned_device_type


class _PlannedMultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
  """tf.distribute.MultiWorkerMirroredStrategy over the plan's devices on every worker."""

  def __init__(self, cluster_resolver, communication_options, plan):
    # Skips MultiWorkerMirroredStrategy.__init__, which would build the stock
    # extended object; everything else is the stock strategy.
    tf.distribute.Strategy.__init__(  # pylint: disable=non-parent-init-called
        self, _PlannedCollectiveExtended(
            self, cluster_resolver, communication_options, plan.tower_devices,
            'GPU' if plan.kind == 'gpu' else 'CPU'))


def multi_worker_strategy(plan, cluster, collective_timeout=DEFAULT_PEER_TIMEOUT_SECS):
  """MultiWorkerMirroredStrategy with plan.num_towers replicas on this worker.

  Must be called before any other TensorFlow op runs in this process (it
  starts the process's gRPC server); it returns once every worker has
  started.

  Args:
    plan: common.devices.DevicePlan, this worker's devices.
    cluster: Cluster.
    collective_timeout: seconds; a collective that waits longer than this for
      its peers fails with DeadlineExceededError instead of hanging. (TF
      2.21 on CPU sometimes crashes, SIGABRT or SIGSEGV, instead of raising
      it: the process still ends, without the error; see `train`.)
  """
  options = tf.distribute.experimental.CommunicationOptions(
      implementation=tf.distribute.experimental.CommunicationImplementation.RING,
      timeout_seconds=float(collective_timeout))
  return _PlannedMultiWorkerMirroredStrategy(cluster.cluster_resolver(), options, plan)


# --- the engine -------------------------------------------------------------


class StrategyTrainer(train_lib.Trainer):
  """modern.train.Trainer's step on a tf.distribute strategy's replicas.

  The same interface as `modern.train.Trainer`. `tower_batches` =
  (images [N, B, 24, 24, 3], labels [N, B]) hold either one batch per
  replica of the whole run (N = num_towers, replica r takes images[r]; every
  worker passes the same N batches) or one per replica of this worker
  (N = num_local_replicas, local replica i takes images[i]). With one worker
  the two are the same.

  Attributes:
    strategy: the tf.distribute.Strategy.
    num_towers: int, replicas in sync over all workers (R).
    num_local_replicas: int, replicas of this worker (plan.num_towers).
    num_workers: int.
    worker_index: int, this worker's place; its replicas have the global ids
      worker_index * num_local_replicas + 0 .. num_local_replicas - 1.
    model, global_step, ema, decay_steps: as modern.train.Trainer, created
      under the strategy's scope (mirrored variables, one copy per replica).
  """

  def __init__(self, strategy, plan, decay_steps, jit=False, worker_index=0):
    """Creates the mirrored variables (initial values: the chief's).

    Args:
      strategy: tf.distribute.MirroredStrategy or MultiWorkerMirroredStrategy
        whose local replicas are plan.tower_devices.
      plan: common.devices.DevicePlan of this worker.
      decay_steps: int >= 1.
      jit: bool, compile each replica's loss and gradients with XLA.
      worker_index: int, Cluster.worker_index (0 with one worker).
    """
    local = len(strategy.extended.worker_devices)
    if local != plan.num_towers:
      raise ValueError('the strategy has %d local replicas, the plan %d devices'
                       % (local, plan.num_towers))
    self.strategy = strategy
    with strategy.scope():
      super().__init__(plan, decay_steps, jit=jit)
    self.num_local_replicas = plan.num_towers
    self.num_towers = strategy.num_replicas_in_sync
    self.num_workers = self.num_towers // self.num_local_replicas
    self.worker_index = int(worker_index)
    self._replica_fn = (tf.function(self._replica_loss_and_grads, jit_compile=True)
                        if jit else self._replica_loss_and_grads)
    self._voting_step_fn = tf.function(self._voting_step)
    self._broadcast_fn = tf.function(self._broadcast_from_chief)
    self._barrier_fn = tf.function(self._barrier)

  # --- the step -------------------------------------------------------------

  def _replica_loss_and_grads(self, values, images, labels):
    """One replica: its total loss, and the gradients of its share of the mean.

    Args:
      values: list of tensors, this replica's copy of the variables' values
        in VARIABLE_NAMES order.
      images: float32 [batch, 24, 24, 3].
      labels: int32 [batch].

    Returns:
      (loss float32 scalar, list of gradients of loss / R shaped like values).
    """
    with tf.GradientTape() as tape:
      tape.watch(values)
      loss = train_lib.tower_loss(self.model, images, labels,
                                  self.model.params(values))
      # Why 1/R: the all-reduce SUMs the replicas' gradients, and SPEC §2
      # wants the towers' MEAN of the per-tower gradients, each tower's loss
      # being its batch's mean cross-entropy plus the weight decay once:
      #   sum_r grad(loss_r / R) = (1/R) sum_r grad(CE_r + WD)
      #                          = mean_r grad(CE_r) + grad(WD).
      # So weight decay is counted once in total (not R times, upstream's
      # collection bug), and the result is the gradient of the mean loss over
      # all R * batch images. Scaling the loss by a power of two (R = 2, 4)
      # scales every backpropagated value exactly, so the sum matches the
      # towers' reduce_mean to the last bit but for the summation order.
      scaled_loss = loss / tf.cast(self.num_towers, loss.dtype)
    return loss, tape.gradient(scaled_loss, values)

  def _replica_step(self, images, labels, vote):
    """Runs in each replica: its gradients, then the all-reduce over every replica.

    Returns:
      (list of averaged gradients, identical on every replica;
       float32 [R + 1]: every replica's loss, then the sum of the stop votes).
    """
    context = tf.distribute.get_replica_context()
    variables = self.model.variable_list()
    # This replica's own copy of the variables (mirrored on its device).
    values = [var.read_value() for var in variables]
    loss, grads = self._replica_fn(values, images, labels)
    # Each replica's loss goes into its own slot of a vector (zeros elsewhere,
    # so the sum is exact), and the worker's stop vote into the last slot; one
    # all-reduce then gives every worker all R losses and whether any worker
    # wants to stop.
    slots = tf.range(self.num_towers + 1)
    report = tf.where(tf.equal(slots, context.replica_id_in_sync_group),
                      loss, 0.0) + tf.where(tf.equal(slots, self.num_towers),
                                            vote, 0.0)
    # Synchronization point: every replica of every worker meets here. The
    # SUM over replicas of the gradients of loss_r / R is the towers' mean.
    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, grads + [report])
    return reduced[:-1], reduced[-1]

  def _distribute(self, images, labels):
    """Per-replica inputs: replica r gets batch r (see the class docstring)."""
    offset = 0
    if images.shape[0] != self.num_towers:
      offset = self.worker_index * self.num_local_replicas  # local batches
    per_replica = []
    for tensor in (images, labels):
      per_replica.append(self.strategy.experimental_distribute_values_from_function(
          lambda ctx, t=tensor: t[ctx.replica_id_in_sync_group - offset]))
    return per_replica

  def _run_replicas(self, images, labels, vote):
    """All-reduced gradients (per replica), tower losses [R] and the vote sum."""
    dist_images, dist_labels = self._distribute(images, labels)
    grads, report = self.strategy.run(
        self._replica_step, args=(dist_images, dist_labels, vote))
    # Identical on every replica after the all-reduce: take the first local one.
    report = self.strategy.experimental_local_results(report)[0]
    return grads, report[:self.num_towers], report[self.num_towers]

  def _averaged_gradients(self, images, labels):
    """As Trainer's: (list of (averaged gradient, variable), tower losses [R])."""
    grads, tower_losses, _ = self._run_replicas(images, labels, tf.constant(0.0))
    variables = self.model.variable_list()
    return ([(self.strategy.experimental_local_results(g)[0], v)
             for g, v in zip(grads, variables)], tower_losses)

  def _voting_step(self, images, labels, vote):
    """One SGD step on every replica; returns (tower losses [R], vote sum)."""
    grads, tower_losses, votes = self._run_replicas(images, labels, vote)
    variables = self.model.variable_list()
    shadows = list(self.ema.variables_by_name().values())
    extended = self.strategy.extended
    # Read before the increment, as exponential_decay inside legacy's
    # apply_gradients reads it.
    lr = model_spec.learning_rate(self.global_step, self.decay_steps)
    for grad, var in zip(grads, variables):
      # Each replica's copy gets that replica's (identical) averaged gradient.
      extended.update(var, lambda v, g: v.assign_sub(lr * g), args=(grad,))
    self.global_step.assign_add(1)
    # After the update and the increment, as legacy's control dependencies
    # order them; every copy of a shadow averages its own replica's copy.
    decay = model_spec.ema_decay(self.global_step)
    for shadow, var in zip(shadows, variables):
      extended.update(shadow, lambda s, v: s.assign_sub((s - v) * (1.0 - decay)),
                      args=(var,))
    return tower_losses, votes

  def _train_step(self, images, labels):
    """One SGD step; returns tower losses float32 [R] (Trainer's signature)."""
    tower_losses, _ = self._voting_step(images, labels, tf.constant(0.0))
    return tower_losses

  def _batch_counts(self):
    counts = sorted({self.num_towers, self.num_local_replicas})
    return counts, ('N', " with N in %s (all replicas, or this worker's)" % counts)

  def train_step_and_vote(self, tower_batches, stop_requested):
    """One training step that also tells every worker whether any wants to stop.

    A stop request (Ctrl-C, SIGTERM) on one worker rides on the step's
    all-reduce, so every worker stops after the same step.

    Args:
      tower_batches: as for `train_step`.
      stop_requested: bool, this worker wants to stop after this step.

    Returns:
      (tower losses float32 numpy [R], bool: some worker wants to stop).
    """
    tower_losses, votes = self._voting_step_fn(
        *self._check_batches(tower_batches),
        tf.constant(1.0 if stop_requested else 0.0))
    return tower_losses.numpy(), float(votes.numpy()) > 0.0

  # --- keeping the workers together ----------------------------------------

  def _broadcast_from_chief(self):
    state = self.model.variable_list() + list(self.ema.variables_by_name().values())

    def replica_fn():
      context = tf.distribute.get_replica_context()
      is_source = tf.equal(context.replica_id_in_sync_group, 0)
      # Replica 0 (the chief's first) sends its values, all others zeros: the
      # SUM is the chief's values, exactly. The step goes as float64 (exact
      # below 2**53) in its own all-reduce: one all-reduce packs one dtype.
      values = context.all_reduce(
          tf.distribute.ReduceOp.SUM,
          [tf.where(is_source, var.read_value(), tf.zeros_like(var)) for var in state])
      step = context.all_reduce(
          tf.distribute.ReduceOp.SUM,
          tf.where(is_source, tf.cast(self.global_step.read_value(), tf.float64),
                   tf.constant(0.0, tf.float64)))
      return values, tf.cast(step, tf.int64)

    values, step = self.strategy.run(replica_fn)
    for var, value in zip(state + [self.global_step], list(values) + [step]):
      self.strategy.extended.update(var, lambda v, x: v.assign(x), args=(value,))

  def broadcast_from_chief(self):
    """Sets every worker's variables, averages and global step to the chief's.

    Only the chief restores a checkpoint; this brings the others to the same
    state, so no worker needs to read the chief's train_dir.
    """
    self._broadcast_fn()

  def _barrier(self):
    def replica_fn():
      return tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, tf.constant(1.0))
    return self.strategy.experimental_local_results(self.strategy.run(replica_fn))[0]

  def barrier(self):
    """Returns when every replica of every worker has called it."""
    self._barrier_fn()


class MirroredTrainer(StrategyTrainer):
  """`tf.distribute.MirroredStrategy` over the plan's devices, Trainer's interface."""

  def __init__(self, plan, decay_steps, jit=False):
    """Same arguments as modern.train.Trainer."""
    super().__init__(mirrored_strategy(plan), plan, decay_steps, jit=jit)


class MultiWorkerTrainer(StrategyTrainer):
  """`tf.distribute.MultiWorkerMirroredStrategy`, Trainer's interface.

  Create it first thing in the process (see `multi_worker_strategy`), on
  every worker in the same way.
  """

  def __init__(self, plan, decay_steps, cluster,
               collective_timeout=DEFAULT_PEER_TIMEOUT_SECS, jit=False):
    """As modern.train.Trainer's, plus the Cluster and the collective timeout (s)."""
    self.cluster = cluster
    super().__init__(multi_worker_strategy(plan, cluster, collective_timeout), plan,
                     decay_steps, jit=jit, worker_index=cluster.worker_index)


# --- the training loop -----------------------------------------------------

# In `train` the collective timeout is this many peer timeouts: a backstop
# behind the watchdog, which ends a wait first and cleanly (see _PeerWatchdog).
COLLECTIVE_TIMEOUT_FACTOR = 2


class _PeerWatchdog:
  """Ends this process with a clear error when a wait for the peers is too long.

  TensorFlow's collective timeout ends such a wait too, but TF 2.21 on CPU
  sometimes crashes (SIGABRT, SIGSEGV) while aborting the collective, which
  leaves the user without a message; and while the workers start, the chief
  waits for the others inside a C++ call with no deadline at all. So a thread
  watches: when a guarded block (the start-up, a step) runs past its
  deadline, it prints the message on stderr, runs `cleanup` and exits with
  status 1. (os._exit: the main thread is blocked in C++, where no Python
  exception can reach it.)
  """

  POLL_SECS = 0.25

  def __init__(self, warn, cleanup=None):
    self._warn = warn
    self._cleanup = cleanup or (lambda: None)
    self._lock = threading.Lock()
    self._deadline = None
    self._message = None
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._watch, name='peer-watchdog',
                                    daemon=True)
    self._thread.start()

  @contextlib.contextmanager
  def guard(self, seconds, message):
    """The block must end within `seconds`, or the process ends with `message`."""
    with self._lock:
      self._deadline = time.monotonic() + seconds
      self._message = message
    try:
      yield
    finally:
      with self._lock:
        self._deadline = None

  def stop(self):
    self._stopped.set()
    self._thread.join()

  def _watch(self):
    while not self._stopped.wait(self.POLL_SECS):
      with self._lock:
        expired = self._deadline is not None and time.monotonic() > self._deadline
        message = self._message
      if expired:
        self._warn('Error: ' + message)
        sys.stdout.flush()
        sys.stderr.flush()
        self._cleanup()
        os._exit(1)  # pylint: disable=protected-access


_RESTART = ('Restart every worker with the same flags: they resume from the '
            'newest checkpoint in the chief\'s --train_dir.')


def _peer_error(cluster, step, error, saved):
  """The TrainingError of a worker whose collective failed for want of its peers."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  reason = lines[0] if lines else type(error).__name__
  for i, line in enumerate(lines):
    if any(word in line for word in ('aborted by', 'unhealthy', 'Deadline', 'onnect')):
      reason = line
      if line.endswith(':') and i + 1 < len(lines):  # the unhealthy tasks follow
        reason += ' ' + lines[i + 1]
      break
  return training.TrainingError(
      'worker %d of %d lost its peers at global step %d (%s: %s). %s %s'
      % (cluster.worker_index, cluster.num_workers, step, type(error).__name__,
         reason, ('Saved %s.' % saved) if saved else 'This worker saved no checkpoint.',
         _RESTART))


def _silent(_):
  pass


def train(config, plan, out=print, warn=_stderr):
  """Trains with config.strategy ('mirrored' or 'multiworker') until max_steps.

  As modern.train.train (resumes from train_dir, logs every log_every steps,
  summaries, checkpoints, stops at a step boundary on SIGINT/SIGTERM), plus,
  with several workers: only the chief prints progress and keeps checkpoints
  and summaries in train_dir; the chief restores and broadcasts its state;
  each worker reads its own shard of the training records; a stop request on
  any worker stops all after the same step; and a worker whose peers do not
  answer within config.peer_timeout seconds (STARTUP_TIMEOUT_SECS while the
  workers start and take their first step) exits with status 1 and an error
  on stderr, or raises TrainingError when TensorFlow reports the loss first.

  Args:
    config: common.config.TrainConfig with strategy 'mirrored' or 'multiworker'.
    plan: common.devices.DevicePlan with config.num_gpus devices (this worker's).
    out: callable(str) for progress lines (stdout); the chief's only.
    warn: callable(str) for diagnostics (stderr).

  Returns:
    int, the global step reached.

  Raises:
    ClusterError: the multiworker cluster is missing or malformed.
    common.training.TrainingError: the loss diverged, a peer was lost, or
      train_dir holds a checkpoint this trainer cannot resume.
    common.checkpoints.CheckpointError: as modern.train.train.
    ValueError: bad config or plan.
  """
  if plan.num_towers != config.num_gpus:
    raise ValueError('the device plan has %d towers, config.num_gpus is %d'
                     % (plan.num_towers, config.num_gpus))
  if config.strategy not in ('mirrored', 'multiworker'):
    raise ValueError('distributed.train runs strategy mirrored or multiworker, '
                     'got %r' % config.strategy)
  cluster = None
  if config.strategy == 'multiworker':
    cluster = resolve_cluster(config.worker_hosts, config.task_index)
  num_workers = cluster.num_workers if cluster else 1
  worker_index = cluster.worker_index if cluster else 0
  filenames = fmt.train_files(config.data_dir)
  examples_per_epoch = fmt.num_examples(filenames)
  # All replicas of all workers count, as upstream's num_gpus counted its towers.
  num_replicas = config.num_gpus * num_workers
  decay_steps = hparams.decay_steps(examples_per_epoch, config.batch_size,
                                    num_replicas)
  if decay_steps < 1:
    raise training.TrainingError(
        'decay_steps = int(%d examples / %d batch / %d replicas * %g epochs) = 0: '
        'too few training examples for this batch size. Use more data or a '
        'smaller --batch_size.' % (examples_per_epoch, config.batch_size,
                                   num_replicas, hparams.NUM_EPOCHS_PER_DECAY))
  if config.seed is not None:
    tf.random.set_seed(config.seed)

  if cluster is None:
    trainer = MirroredTrainer(plan, decay_steps, jit=config.jit)
    if config.log_device_placement:
      tf.debugging.set_log_device_placement(True)
    tf.io.gfile.makedirs(config.train_dir)
    return _train_loop(config, trainer, None, config.train_dir, decay_steps,
                       None, out, warn)

  # Deviation from upstream: train_dir is never deleted; training resumes
  # from its latest checkpoint. A non-chief writes to a temporary dir that it
  # removes at the end (left over only if it was killed: cleared here).
  is_chief = cluster.is_chief
  write_dir = config.train_dir
  if not is_chief:
    out = _silent  # progress and logs come from the chief only
    write_dir = os.path.join(config.train_dir,
                             '%s%d' % (WORKER_TEMP_PREFIX, worker_index))
    shutil.rmtree(write_dir, ignore_errors=True)
  cleanup = (lambda: None) if is_chief else (
      lambda: shutil.rmtree(write_dir, ignore_errors=True))
  watchdog = _PeerWatchdog(warn, cleanup)
  startup = max(STARTUP_TIMEOUT_SECS, config.peer_timeout)
  hosts = ','.join(h for job in ('chief', 'worker') for h in cluster.jobs.get(job, ()))
  try:
    # MultiWorkerMirroredStrategy must come before any other op (it starts
    # this process's gRPC server); it returns when every worker is up, and
    # creating the variables broadcasts the chief's initial values.
    with watchdog.guard(startup, (
        'worker %d of %d: the other workers of %s did not start within %d s. '
        'Start every worker (the same --worker_hosts or TF_CONFIG cluster, '
        'each with its own index) within that time.'
        % (worker_index, num_workers, hosts, startup))):
      try:
        trainer = MultiWorkerTrainer(
            plan, decay_steps, cluster, jit=config.jit,
            collective_timeout=COLLECTIVE_TIMEOUT_FACTOR * config.peer_timeout)
      except PEER_ERRORS as e:
        raise _peer_error(cluster, 0, e, None) from e
    if config.log_device_placement:
      tf.debugging.set_log_device_placement(True)
    tf.io.gfile.makedirs(write_dir)
    return _train_loop(config, trainer, cluster, write_dir, decay_steps,
                       watchdog, out, warn)
  finally:
    watchdog.stop()
    cleanup()


def _train_loop(config, trainer, cluster, write_dir, decay_steps, watchdog,
                out, warn):
  """The loop of `train` once the engine exists (see there).

  Args:
    cluster: Cluster, or None for one process (MirroredStrategy).
    write_dir: where this worker writes checkpoints and summaries.
    watchdog: _PeerWatchdog, or None for one process.
  """
  is_chief = cluster is None or cluster.is_chief

  def guard(what, step, first=False):
    """No wait for the peers longer than the peer timeout (first: the start-up's)."""
    if watchdog is None:
      return contextlib.nullcontext()
    seconds = max(STARTUP_TIMEOUT_SECS, config.peer_timeout) if first else (
        config.peer_timeout)
    return watchdog.guard(seconds, (
        'worker %d of %d lost its peers in %s after global step %d: no answer '
        'within %d s (--peer_timeout); a worker stopped, hung or is unreachable. %s'
        % (cluster.worker_index, cluster.num_workers, what, step, seconds, _RESTART)))

  checkpoint = train_lib.checkpoint_object(trainer)
  manager = tf.train.CheckpointManager(
      checkpoint, write_dir, max_to_keep=train_lib.MAX_TO_KEEP,
      checkpoint_name=config_lib.CHECKPOINT_BASENAME)
  save = train_lib.StepSaver(trainer, manager, write_dir)

  try:
    resume_from = (train_lib.restore_latest(config.train_dir, checkpoint, warn)
                   if is_chief else None)
    if cluster is not None:
      # Synchronization point: every worker takes the chief's state (fresh or
      # restored), so all resume from the chief's checkpoint.
      with guard('the start-up', 0, first=True):
        trainer.broadcast_from_chief()
    step = int(trainer.global_step.numpy())
    if resume_from:
      out('Resuming from %s at global step %d.' % (resume_from, step))
      save.last_saved = step
    if step >= config.max_steps:
      warn('global step %d in %s is already >= max_steps %d: nothing to train.'
           % (step, config.train_dir, config.max_steps))
      return step

    # Each worker reads its own records: worker w takes records w, w + W, ...
    # of the training files, so no two workers train on the same record.
    dataset = inputs.distorted_inputs(config.data_dir, config.batch_size,
                                      config.num_gpus, seed=config.seed,
                                      num_shards=trainer.num_workers,
                                      shard_index=trainer.worker_index)
    # tf.data's autotuning thread can hold up the deletion of the iterator at
    # the end for tens of seconds (TF 2.21), while the other workers wait at
    # the final barrier; without it AUTOTUNE means one parallel call per core.
    options = tf.data.Options()
    options.autotune.enabled = False
    iterator = iter(dataset.with_options(options))
    writer = tf.summary.create_file_writer(write_dir)
    global_batch = config.batch_size * trainer.num_towers  # all replicas, all workers
    first_step, stopped_by, batches = step, None, None
    with writer.as_default(), training.StopRequest() as stop:
      try:
        while step < config.max_steps:
          batches = next(iterator)
          start_time = time.time()
          with guard('the step', step, first=step == first_step):
            # A stop request rides on the step's all-reduce: every worker
            # learns of it and stops after this same step.
            tower_losses, stop_agreed = trainer.train_step_and_vote(
                batches, stop.requested)
          duration = time.time() - start_time
          step = int(trainer.global_step.numpy())
          training.check_finite(step, tower_losses)
          if step % config.log_every == 0:
            # Deviation from upstream: the mean over all replicas' losses.
            out(training.log_line(step, float(tower_losses.mean()),
                                  global_batch / duration, duration))
          if step % config.summary_every == 0:
            # The learning rate the step just taken used (read before the increment).
            lr = float(model_spec.learning_rate(step - 1, decay_steps))
            try:
              train_lib._write_summaries(  # pylint: disable=protected-access
                  trainer, step, tower_losses, lr)
            except (tf.errors.OpError, OSError) as e:
              raise checkpoints.write_failed(write_dir, 'TensorBoard summaries',
                                             e) from e
          if step % config.save_every == 0:
            save()
          if stop_agreed:
            stopped_by = stop.signal_name or 'a stop request of another worker'
            break
      except KeyboardInterrupt:
        stopped_by = 'KeyboardInterrupt'
      path = save()  # every worker saves: the chief's copy is the one kept
      try:
        writer.flush()
      except (tf.errors.OpError, OSError) as e:
        warn('could not write the last TensorBoard summaries to %s (%s).'
             % (write_dir, str(e).strip().splitlines()[0]))
    step = int(trainer.global_step.numpy())
    # Release the input pipeline and the writer now: deleting them runs ops,
    # which after the barrier could wait (~10 s) for the coordination service
    # to declare an already finished peer dead.
    del iterator, batches, writer, dataset
    if cluster is not None:
      # Synchronization point: no worker leaves before all have saved, and no
      # op runs after it (see above).
      with guard('the final barrier', step):
        trainer.barrier()
  except PEER_ERRORS as e:
    if cluster is None:
      raise
    saved = None
    if is_chief:
      # The failed step changed nothing (its update needs the all-reduce), so
      # the chief holds the last completed step's state: keep it if it can.
      try:
        saved = save()
      except (checkpoints.CheckpointError, tf.errors.OpError, OSError):
        saved = None
    raise _peer_error(cluster, int(trainer.global_step.numpy()), e, saved) from e
  if stopped_by:
    out('Stopped by %s at global step %d; saved %s.' % (stopped_by, step, path))
  return step
