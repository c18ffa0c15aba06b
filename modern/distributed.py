"""Beyond the towers: the modern trainer on TensorFlow's distribution engines.

Two engines run the step of `modern.train` (docs/equivalence.md §1) with `tf.distribute`
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
layout of `modern.checkpoints.checkpoint_object`, so eval and convert read them.

Every step is synchronous: each replica computes the gradients of its own
batch, the all-reduce waits for every replica of every worker, and every
replica applies the same averaged gradient to its own copy of the variables.
The global batch is batch_size x num_gpus x number of workers.

`train()` is the training loop for both engines (`modern.train.train` hands
over to it when `config.strategy` is not 'towers'). With several workers the
chief (task 0, or the 'chief' task of TF_CONFIG) locks train_dir, writes
checkpoints and summaries there and prints progress; every other worker
locks and writes to `<train_dir>/workertemp_<id>` (TensorFlow's multi-worker
convention: all workers save, only the chief's copy is kept), removes it when
it ends, and prints only warnings and errors.

The workers meet in Python before TensorFlow's start-up (`modern.cluster`:
host names, this worker's port, a hello from every peer within
--startup_timeout), because TensorFlow's own wait for them cannot be
interrupted. After it, every wait for the peers (the first broadcast, each
step, the final barrier) is watched (`_PeerWatchdog`): past --peer_timeout, or
a few seconds after SIGINT/SIGTERM, the watchdog aborts it, and the worker
saves what it completed and says so.
"""

import contextlib
import os
import re
import shutil
import signal
import sys
import threading
import time
import types

import tensorflow as tf
# MultiWorkerMirroredStrategy has no public way to choose its local devices
# (see _PlannedCollectiveExtended), to bound its start-up, or to abort a
# collective that waits for a hung peer (see _configure_startup and
# _abort_collectives).
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.distribute import collective_all_reduce_strategy  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import context as tf_context  # pylint: disable=g-direct-tensorflow-import

from common import checkpoints
from common import cifar10_format as fmt
from common import config as config_lib
from common import devices
from common import lock
from common import model_spec
from common import training
from modern import checkpoints as ckpt_lib
from modern import cluster as cluster_lib
from modern import inputs
from modern import train as train_lib

DEFAULT_PEER_TIMEOUT_SECS = config_lib.TrainConfig.peer_timeout  # 60 s
DEFAULT_STARTUP_TIMEOUT_SECS = config_lib.TrainConfig.startup_timeout  # 600 s
WORKER_TEMP_PREFIX = 'workertemp_'  # a non-chief's write dir: <train_dir>/workertemp_<id>

# What a collective raises when a peer is gone: UnavailableError (the peer's
# process is dead or unreachable, found by the coordination service's
# heartbeats or a refused connection), DeadlineExceededError (the collective
# timeout), and the aborts that follow either.
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
               tf.errors.CancelledError, tf.errors.AbortedError)



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
  when there is none; docs/equivalence.md §3 wants `--num_gpus` replicas per worker on the
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
  started, waiting inside TensorFlow, where no signal or Python thread runs
  (`train` meets the workers first and bounds this wait: see `_start`).

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
      # Why 1/R: the all-reduce SUMs the replicas' gradients, and docs/equivalence.md §2
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


# --- the start-up -------------------------------------------------------------

# TensorFlow's own start-up follows the rendezvous (modern.cluster), when every
# peer is up, and takes a second; its timeout is the start-up's time left, but
# at least this, a backstop for a peer that fails between the two.
STARTUP_BACKSTOP_MIN_SECS = 10


def _configure_startup(cluster, seconds):
  """Bounds TensorFlow's own wait for the workers to register: the backstop.

  Call before the strategy exists: MultiWorkerMirroredStrategy configures the
  coordination service only if nothing did. This is its configuration plus
  `cluster_register_with_barrier`, without which the chief of a cluster whose
  peer never comes waits (in WaitForAllTasks) with no deadline at all; with
  it, the registration fails after `seconds` with DeadlineExceededError
  naming the tasks that never registered (see `_startup_error`).
  """
  leader = 'chief' if cluster.jobs.get('chief') else 'worker'
  context = tf_context.context()
  context.configure_coordination_service(
      service_type='standalone',
      service_leader='/job:%s/replica:0/task:0' % leader,
      coordinated_jobs=[
          coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(hosts))
          for job, hosts in ((j, cluster.jobs.get(j)) for j in ('chief', 'worker'))
          if hosts],
      cluster_register_timeout_in_ms=int(seconds * 1000))
  context.coordination_service.cluster_register_with_barrier = True


def _reclaim_sigterm(handler):
  """Gives SIGTERM back to `handler`, Python's (the StopRequest's).

  TensorFlow's start-up installs a SIGTERM handler of its own (the
  coordination service's preemption notifier, which only records the signal
  for TensorFlow's failure handling, unused here): without this, SIGTERM
  would be ignored for the rest of the run.
  """
  if handler is not None and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, handler)


def _startup_error(cluster, error, seconds):
  """The StartupError of a TensorFlow start-up that failed with `error` (OpError)."""
  text = str(error)
  if 'Could not start gRPC server' in text:
    return cluster_lib.StartupError(
        '%s: TensorFlow could not start its server on port %s: another process '
        'took it after this worker found it free. Start this worker again, or '
        'give it another port in %s (the same list on every worker).'
        % (cluster.name(), cluster.address.rpartition(':')[2], cluster.source))
  if isinstance(error, (tf.errors.DeadlineExceededError, tf.errors.UnavailableError)):
    # The leader lists the tasks that never registered; a worker that could
    # not reach the leader itself knows only that.
    names = re.findall(r'/job:\w+/replica:\d+/task:\d+',
                       text.partition('timed out task names:')[2])
    missing = {cluster.hosts.index(a) for a in map(cluster.task_address, names)
               if a in cluster.hosts}
    if not missing and not cluster.is_chief and 'RegisterTask' in text:
      missing = {0}
    missing = missing or set(range(cluster.num_workers)) - {cluster.worker_index}
    return cluster_lib.StartupError(
        '%s: %s said hello but did not register with TensorFlow within %d s '
        '(--startup_timeout): it failed or was stopped while starting (see its '
        'output). Start every worker again.'
        % (cluster.name(), cluster_lib.names(cluster, missing), seconds))
  return cluster_lib.StartupError('%s: TensorFlow\'s start-up failed (%s: %s). Start every '
                      'worker again with the same flags.'
                      % (cluster.name(), type(error).__name__,
                         text.strip().splitlines()[0] if text.strip() else ''))


def _start(config, plan, cluster, decay_steps, warn):
  """Meets the other workers, then starts TensorFlow's engine on this one.

  The checks and the rendezvous of `modern.cluster` first, in Python, where a
  signal stops them at once; then TensorFlow's start-up, which holds Python's
  lock until it returns, bounded by `_configure_startup`.

  Returns:
    MultiWorkerTrainer.

  Raises:
    StartupError: a host name does not resolve, this worker's port is taken,
      a peer did not answer within config.startup_timeout or was started
      with another cluster, or TensorFlow's start-up failed.
  """
  started = time.monotonic()
  cluster_lib.check_hosts(cluster)
  cluster_lib.rendezvous(cluster, cluster_lib.listen(cluster),
                         config.startup_timeout, warn)
  seconds = max(STARTUP_BACKSTOP_MIN_SECS,
                config.startup_timeout - (time.monotonic() - started))
  _configure_startup(cluster, seconds)
  sigterm = signal.getsignal(signal.SIGTERM)
  try:
    return MultiWorkerTrainer(
        plan, decay_steps, cluster, jit=config.jit,
        collective_timeout=COLLECTIVE_TIMEOUT_FACTOR * config.peer_timeout)
  except tf.errors.OpError as e:
    raise _startup_error(cluster, e, config.startup_timeout) from None
  finally:
    _reclaim_sigterm(sigterm)


# --- the training loop -----------------------------------------------------

# In `train` the collective timeout is this many peer timeouts: a backstop
# behind the watchdog, which ends a wait first and cleanly (see _PeerWatchdog).
COLLECTIVE_TIMEOUT_FACTOR = 2


def _abort_collectives(message):
  """Makes every collective of this process, waiting or to come, fail at once.

  They raise UnavailableError with `message`; no collective can run in this
  process afterwards, other ops (a checkpoint's save) still can.
  """
  tf_context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)


class _PeerWatchdog:
  """Ends a wait for the peers that lasts too long, or that a stop cuts short.

  The guarded blocks are the waits for the peers (the first broadcast, each
  step, the final barrier), where the main thread waits in C++ with Python's
  lock released. A thread watches them:

  - past a block's deadline (the peer timeout), or STOP_GRACE_SECS into a
    block after a stop request (SIGINT, SIGTERM: `stop_requested`, the
    StopRequest's `while_blocked` callback), it aborts this process's
    collectives (`_abort_collectives`): the wait raises at once, and the loop
    saves what it completed and says so (`_train_loop`);
  - if the main thread has not finished EXIT_GRACE_SECS after that, it prints
    the message itself, runs `cleanup` and ends the process: status 1, or
    128 + the signal's number (os._exit: the main thread is stuck in C++).

  TensorFlow's collective timeout ends such a wait too, but TF 2.21 on CPU
  sometimes crashes (SIGABRT, SIGSEGV) while aborting the collective, which
  leaves the user without a message.
  """

  POLL_SECS = 0.25
  STOP_GRACE_SECS = 2.0  # a step or barrier still waiting this long after a stop is hung
  STOP_LIMIT_SECS = 6.0  # after a stop, no wait goes on past this
  EXIT_GRACE_SECS = 3.0  # for the main thread to save and return after an abort

  def __init__(self, cluster, warn, cleanup, abort=_abort_collectives):
    self._cluster = cluster
    self._warn = warn
    self._cleanup = cleanup
    self._abort = abort
    self._lock = threading.Lock()
    self._block = None  # (start, deadline, what, step, flag) of the guarded wait
    self._stop = None  # (time, signal name) of the first stop request
    self._aborted = None  # (time, message of a forced exit, exit status)
    self.reason = None  # why it aborted the collectives, or None
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._watch, name='peer-watchdog',
                                    daemon=True)
    self._thread.start()

  @contextlib.contextmanager
  def guard(self, seconds, what, step, flag):
    """The block waits for the peers at most `seconds` (the value of `flag`)."""
    now = time.monotonic()
    with self._lock:
      self._block = (now, now + seconds, what, step, flag)
    try:
      yield
    finally:
      with self._lock:
        self._block = None

  def stop_requested(self, signal_name):
    """A stop request came (SIGINT, SIGTERM): waits for the peers end soon."""
    with self._lock:
      if self._stop is None:
        self._stop = (time.monotonic(), signal_name)

  def stop(self):
    self._stopped.set()
    self._thread.join()

  def _expired(self, now):
    """(reason, message of a forced exit, status) if the current wait must end."""
    if self._block is None:
      return None
    start, deadline, what, step, flag = self._block
    name = self._cluster.name()
    if self._stop is not None:
      since, signal_name = self._stop
      if now > min(max(start, since) + self.STOP_GRACE_SECS,
                   since + self.STOP_LIMIT_SECS):
        return ('%s: stopped by %s at global step %d, ending %s after %d s of '
                'waiting for the other workers' % (name, signal_name, step, what,
                                                   now - max(start, since)),
                '%s: stopped by %s at global step %d while %s waited for the '
                'other workers, without saving: the newest checkpoint in '
                '--train_dir is kept. %s' % (name, signal_name, step, what, _RESTART),
                training.exit_status(signal_name))
    if now > deadline:
      reason = ('%s lost its peers in %s after global step %d: no answer within '
                '%d s (%s); a worker stopped, hung or is unreachable.'
                % (name, what, step, round(deadline - start), flag))
      return (reason, 'Error: %s Nothing was saved. %s' % (reason, _RESTART), 1)
    return None

  def _watch(self):
    while not self._stopped.wait(self.POLL_SECS):
      now = time.monotonic()
      abort = None
      with self._lock:
        if self._aborted is None:
          expired = self._expired(now)
          if expired is not None:
            self.reason, message, status = expired
            self._aborted = (now, message, status)
            abort = self.reason
        aborted = self._aborted
      if abort is not None:
        try:
          self._abort(abort)
        except Exception:  # pylint: disable=broad-except
          pass  # the forced exit below still ends the wait
      elif aborted is not None and now > aborted[0] + self.EXIT_GRACE_SECS:
        self._warn(aborted[1])
        sys.stdout.flush()
        sys.stderr.flush()
        self._cleanup()
        os._exit(aborted[2])  # pylint: disable=protected-access


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
      '%s lost its peers at global step %d (%s: %s). %s %s'
      % (cluster.name(), step, type(error).__name__, reason, _saved(saved), _RESTART))


def _saved(saved):
  return ('Saved %s.' % saved) if saved else 'This worker saved no checkpoint.'


def _silent(_):
  pass


def train(config, plan, out=print, warn=training.stderr, on_step=None):
  """Trains with config.strategy ('mirrored' or 'multiworker') until max_steps.

  As modern.train.train (resumes from train_dir, logs every log_every steps,
  summaries, checkpoints, stops at a step boundary on SIGINT/SIGTERM), plus,
  with several workers: the workers meet first (config.startup_timeout); only
  the chief prints progress and keeps checkpoints and summaries in train_dir;
  the chief restores and broadcasts its state; each worker reads its own
  shard of the training records; a stop request on any worker stops all
  after the same step; a stop request while the peers do not answer stops
  this worker within seconds, with what it completed saved; and a worker whose
  peers do not answer within config.peer_timeout seconds (config.startup_timeout
  for the first broadcast and step) raises TrainingError, or, if it cannot,
  exits with status 1 and the error on stderr.

  Args:
    config: common.config.TrainConfig with strategy 'mirrored' or 'multiworker'.
    plan: common.devices.DevicePlan with config.num_gpus devices (this worker's).
    out: callable(str) for progress lines (stdout); the chief's only.
    warn: callable(str) for diagnostics (stderr).
    on_step: optional callable(step, seconds, images) after every step: the
      global step reached, the step's wall seconds, and the images it
      trained on over all replicas (bench paces itself with it).

  Returns:
    int, the global step reached (less than max_steps when a signal stopped
    this process).

  Raises:
    ClusterError: the multiworker cluster is missing or malformed.
    StartupError (a TrainingError): the workers could not start together; the
      message names the hosts and ports.
    common.training.TrainingError: the loss diverged, a peer was lost,
      another worker was stopped, or train_dir holds a checkpoint this
      trainer cannot resume.
    common.training.Stopped: SIGINT or SIGTERM before TensorFlow's engine
      was up; nothing was written.
    common.lock.LockError: another run trains in train_dir (this worker's
      own directory for a non-chief).
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
    cluster = cluster_lib.resolve_cluster(config.worker_hosts, config.task_index)
  num_workers = cluster.num_workers if cluster else 1
  filenames = fmt.train_files(config.data_dir)
  # Deviation from upstream: the epoch size is what is on disk, not 50000.
  examples_per_epoch = fmt.num_examples(filenames)
  # All replicas of all workers count, as upstream's num_gpus counted its towers.
  num_replicas = config.num_gpus * num_workers
  decay_steps = training.checked_decay_steps(
      examples_per_epoch, config.batch_size, num_replicas)
  if config.seed is not None:
    tf.random.set_seed(config.seed)

  if cluster is None:
    trainer = MirroredTrainer(plan, decay_steps, jit=config.jit)
    if config.log_device_placement:
      tf.debugging.set_log_device_placement(True)
    tf.io.gfile.makedirs(config.train_dir)
    with training.StopRequest() as stop:
      return _train_loop(config, trainer, None, config.train_dir, decay_steps,
                         None, stop, out, warn, on_step)
  return _train_workers(config, plan, cluster, decay_steps, out, warn, on_step)


def _train_workers(config, plan, cluster, decay_steps, out, warn, on_step):
  """`train` with MultiWorkerMirroredStrategy, this process one of the workers."""
  # Deviation from upstream: train_dir is never deleted; training resumes.
  # A non-chief writes to a temporary dir that it
  # removes at the end (left over only if it was killed: cleared here).
  is_chief = cluster.is_chief
  write_dir = config.train_dir
  if not is_chief:
    out = _silent  # progress and logs come from the chief only
    write_dir = os.path.join(config.train_dir,
                             '%s%d' % (WORKER_TEMP_PREFIX, cluster.worker_index))
  cleanup = (lambda: None) if is_chief else (
      lambda: shutil.rmtree(write_dir, ignore_errors=True))
  with training.StopRequest() as stop:
    try:
      # One run at a time: the chief locks train_dir, any other worker its own
      # dir in it (the workers of one machine share train_dir), before the
      # start-up, so that a second run fails at once, naming the first.
      with lock.exclusive(write_dir, what='multiworker training as %s'
                          % cluster.name()):
        if not is_chief:
          _clear(write_dir)
        # Nothing is written until the first step: a stop (signal) ends the
        # start-up at once. TensorFlow's part of it (a second, once every peer
        # has said hello) holds Python's lock: a SIGINT there takes effect
        # when it returns; a SIGTERM there goes to TensorFlow's own handler
        # and is lost (see _reclaim_sigterm).
        with stop.raising():
          trainer = _start(config, plan, cluster, decay_steps, warn)
        if config.log_device_placement:
          tf.debugging.set_log_device_placement(True)
        watchdog = _PeerWatchdog(cluster, warn, cleanup)
        try:
          return _train_loop(config, trainer, cluster, write_dir, decay_steps,
                             watchdog, stop, out, warn, on_step)
        finally:
          watchdog.stop()
    finally:
      cleanup()


def _clear(directory):
  """Removes what a killed run left in `directory`, but for the lock file."""
  for name in os.listdir(directory):
    if name != lock.LOCK_FILE:
      path = os.path.join(directory, name)
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        try:
          os.remove(path)
        except OSError:
          pass


def _train_loop(config, trainer, cluster, write_dir, decay_steps, watchdog,
                stop, out, warn, on_step):
  """The loop of `train` once the engine exists (see there).

  Args:
    cluster: Cluster, or None for one process (MirroredStrategy).
    write_dir: where this worker writes checkpoints and summaries.
    watchdog: _PeerWatchdog, or None for one process.
    stop: common.training.StopRequest, entered.
  """
  is_chief = cluster is None or cluster.is_chief

  def guard(what, step, first=False):
    """No wait for the peers longer than the peer timeout (first: the start-up's)."""
    if watchdog is None:
      return contextlib.nullcontext()
    if first and config.startup_timeout > config.peer_timeout:
      return watchdog.guard(config.startup_timeout, what, step, '--startup_timeout')
    return watchdog.guard(config.peer_timeout, what, step, '--peer_timeout')

  checkpoint = ckpt_lib.checkpoint_object(trainer)
  # Only the chief restores; the others take its state in the broadcast below.
  resume_from = (ckpt_lib.restore_latest(config.train_dir, checkpoint, warn)
                 if is_chief else None)
  manager = tf.train.CheckpointManager(  # after restore_latest: see there
      checkpoint, write_dir, max_to_keep=ckpt_lib.MAX_TO_KEEP,
      checkpoint_name=config_lib.CHECKPOINT_BASENAME)
  save = ckpt_lib.StepSaver(trainer, manager, write_dir)
  # The last global step completed (None before the broadcast), for a save
  # after a failed wait; the step this run began at.
  progress = types.SimpleNamespace(step=None, first_step=None)

  try:
    # A stop request while the main thread waits for the peers in C++: the
    # watchdog ends that wait if it goes on (see _PeerWatchdog).
    with (stop.while_blocked(watchdog.stop_requested) if watchdog
          else contextlib.nullcontext()):
      if cluster is not None:
        # Synchronization point: every worker takes the chief's state (fresh or
        # restored), so all resume from the chief's checkpoint.
        with guard('the start-up', int(trainer.global_step.numpy()), first=True):
          trainer.broadcast_from_chief()
      step = progress.step = progress.first_step = int(trainer.global_step.numpy())
      if resume_from:
        out('Resuming from %s at global step %d.' % (resume_from, step))
        save.last_saved = step
      if step >= config.max_steps:
        warn(training.nothing_to_train(step, config.max_steps, config.train_dir))
        return step
      step, stopped_by, path = _steps(config, trainer, write_dir, decay_steps,
                                      guard, save, stop, progress, out, warn,
                                      on_step)
      if cluster is not None:
        # Synchronization point: no worker leaves before all have saved, and no
        # op runs after it (see _steps).
        with guard('the final barrier', step):
          trainer.barrier()
  except PEER_ERRORS as e:
    if cluster is None:
      raise
    return _lost_peers(cluster, trainer, save, progress, e, watchdog, stop, warn)
  if stopped_by and not is_chief:
    # Its own copy is removed at the end: the chief's is the one kept.
    path = os.path.join(config.train_dir, '%s-%d' % (config_lib.CHECKPOINT_BASENAME,
                                                     step))
  if stopped_by == _ANOTHER_WORKER:
    # Not a signal of this process, so not its exit status: the run did not
    # end, and every worker must be started again.
    raise training.TrainingError(
        '%s stopped at global step %d because another worker was stopped '
        '(SIGINT or SIGTERM); %s saved %s. %s'
        % (cluster.name(), step, 'it' if is_chief else 'the chief', path, _RESTART))
  if stopped_by and is_chief:
    out(training.stopped_line(stopped_by, step, path))
  elif stopped_by:
    warn('%s: stopped by %s at global step %d; the chief saved %s.'
         % (cluster.name(), stopped_by, step, path))
  return step


_ANOTHER_WORKER = 'a stop request of another worker'


def _steps(config, trainer, write_dir, decay_steps, guard, save, stop, progress,
           out, warn, on_step):
  """The steps of `_train_loop`, until max_steps or a stop, then the last save.

  Sets progress.step to the global step after each step completed.

  Returns:
    (global step reached, what stopped it or None, path of the last save).
  """
  step = int(trainer.global_step.numpy())
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
  with writer.as_default():
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
        step = progress.step = int(trainer.global_step.numpy())
        training.check_divergence(step, tower_losses)
        if step % config.log_every == 0:
          # Deviation from upstream: the loss logged is the mean over towers, not the last tower's.
          out(training.log_line(step, float(tower_losses.mean()),
                                global_batch / duration, duration))
        if on_step is not None:
          on_step(step, duration, global_batch)
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
          stopped_by = stop.signal_name or _ANOTHER_WORKER
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
  return step, stopped_by, path


def _lost_peers(cluster, trainer, save, progress, error, watchdog, stop, warn):
  """After a wait for the peers failed: saves what can be kept, says so.

  The chief saves the last step completed in this run (the failed step's
  update needed the all-reduce, so the variables hold that step's values).

  Returns:
    int, the global step, when a stop request (signal) of this worker ended
    the wait: the run stopped.

  Raises:
    common.training.TrainingError: the peers were lost.
  """
  saved = None
  step = progress.step
  if cluster.is_chief and step is not None and step > progress.first_step:
    try:
      # The failed step incremented the global step before its all-reduce
      # failed (the increment does not depend on it): back to the last one.
      trainer.global_step.assign(step)
      saved = save()
    except (checkpoints.CheckpointError, tf.errors.OpError, OSError):
      saved = None
  step = step if step is not None else int(trainer.global_step.numpy())
  if stop.requested:
    reason = (watchdog.reason if watchdog.reason and 'stopped by' in watchdog.reason
              else '%s: stopped by %s at global step %d while waiting for the '
              'other workers' % (cluster.name(), stop.signal_name, step))
    warn('%s; %s' % (reason, ('saved %s.' % saved) if saved else
                     'this worker saved no checkpoint.'))
    return step
  if watchdog.reason:
    raise training.TrainingError('%s %s %s' % (watchdog.reason, _saved(saved),
                                               _RESTART)) from error
  raise _peer_error(cluster, step, error, saved) from error
