"""Synchronous multi-tower training with queue runners (upstream cifar10_multi_gpu_train.py).

One input pipeline on the CPU fills one prefetch queue of whole batches.
Each tower dequeues its own batch, computes its loss and gradients on its
device, and the towers meet on the CPU, where the gradients are averaged and
applied once to the shared variables, followed by the moving average.

`build_towers` is that graph, given the towers' batches; `train` feeds it
from the queues and runs the loop (logging, summaries, checkpoints, resume).
"""

import collections
import contextlib
import logging

import tensorflow.compat.v1 as tf
from tf_slim.data import prefetch_queue

from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.common import lrn as lrn_lib
from cifar10_towers.common import model_spec
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.common import tags
from cifar10_towers.legacy import inputs
from cifar10_towers.legacy import model
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import training

logger = logging.getLogger(__name__)

# train_op: one synchronous step: average, apply, then moving average
# global_step: int64 variable, incremented by train_op
# lr: float32 scalar, the learning rate at global_step
# tower_losses: list of N float32 scalars, each tower's total loss
# averaged_grads: list of (gradient, variable), mean over the towers
# applied_grads: what the optimizer applies: averaged_grads, clipped if asked
# ema: the tf.train.ExponentialMovingAverage of the trainable variables
# summary_op: common.tags.summary_tags' summaries, merged (variables after the step)
TowerOps = collections.namedtuple('TowerOps', 'train_op global_step lr tower_losses '
                                'averaged_grads applied_grads ema summary_op')


# towers: TowerOps
# saver: tf.train.Saver of all global variables
# init_op: initializes global and local variables
# close_queues: ops closing each queue, cancelling pending enqueues
# queue_size: int32 scalar, the examples in the shuffle queue (progress)
TrainGraph = collections.namedtuple('TrainGraph', 'towers saver init_op close_queues queue_size')



def tower_loss(scope, images, labels, lrn=None):
  """The total loss of one tower.

  Args:
    scope: str, the tower's name scope with its trailing slash, e.g. 'tower_0/'.
    images: float32 [batch, 24, 24, 3].
    labels: int32 [batch].
    lrn: optional callable computing the LRN (`common.lrn.for_plan`);
      default upstream's `tf.nn.lrn`.

  Returns:
    float32 scalar: the tower's mean cross-entropy plus the weight decay of
    local3 and local4, each counted once.
  """
  # model.loss sums the 'losses' of the whole graph, so with several towers
  # its result double counts; as upstream, only its side effect is used.
  model.loss(model.inference(images, lrn=lrn), labels)

  # Assemble the losses of the current tower only: its cross-entropy and the
  # weight decay terms built inside its scope. The trailing slash keeps
  # 'tower_1/' from matching 'tower_10/...'.
  losses = tf.get_collection(model.LOSSES_COLLECTION, scope)
  total_loss = tf.add_n(losses, name='total_loss')

  # Scalar summaries of each term and of the total, tagged with the tower's
  # name scope, e.g. 'tower_0/local3/weight_loss': its op's name.
  # (The total's op is 'total_loss_1': model.loss took 'total_loss'.)
  for l in losses:
    model.scalar_summary(l.op.name, l)
  model.scalar_summary(f'{scope}total_loss', total_loss)
  return total_loss


def average_gradients(tower_grads):
  """The mean gradient of each shared variable over all towers.

  This is the synchronization point of the towers: no variable is updated
  before every tower's gradients exist.

  Args:
    tower_grads: list over towers of lists of (gradient, variable), as
      returned by `Optimizer.compute_gradients`, in the same variable order.

  Returns:
    list of (gradient, variable), the gradient being the mean over towers.
  """
  # Deviation from upstream: a name scope, so traces (towerprofile) can tell
  # the averaging from the update.
  average_grads = []
  with tf.name_scope('average_gradients'):
    for grad_and_vars in zip(*tower_grads):
      # Each grad_and_vars is ((grad0_tower0, var0), ..., (grad0_towerN, var0)).
      grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]
      grad = tf.reduce_mean(tf.concat(grads, 0), 0)
      # The variables are shared, so the first tower's pointer is enough.
      average_grads.append((grad, grad_and_vars[0][1]))
  return average_grads


def make_optimizer(spec, lr):
  """TF1's own optimizer for a common.optimizer.OptimizerSpec, at learning rate `lr`.

  Its slots get TF1's names ('conv1/weights/Momentum', '.../Adam',
  '.../Adam_1', 'beta1_power', 'beta2_power'), which checkpoints keep.
  """
  if spec.name == optimizer_lib.MOMENTUM:
    return tf.train.MomentumOptimizer(lr, spec.momentum)
  if spec.name == optimizer_lib.ADAM:
    return tf.train.AdamOptimizer(lr, spec.adam_beta1, spec.adam_beta2, spec.adam_epsilon)
  return tf.train.GradientDescentOptimizer(lr)


def _clip(grads_and_vars, clip_norm):
  """The gradients scaled together so that their global norm is <= clip_norm."""
  grads, variables = zip(*grads_and_vars)
  return list(zip(tf.clip_by_global_norm(grads, clip_norm)[0], variables))


@contextlib.contextmanager
def _control_flow_v1():
  """TF1's tf.cond, Switch and Merge ops, while building (upstream's graph had them).

  TF2's tf.cond is an If op whose two branches are library functions, and
  TensorBoard's graph tab counts each function as a top-level node without
  edges: with the 20 of the moving averages' conds and 10 per tower of the
  sparsity summaries', it moved every node with more than 4 inputs, the towers
  among them, to "Auxiliary Nodes" (tests/test_tensorboard.py). Switch and
  Merge compute the same values.
  """
  v2 = tf.control_flow_v2_enabled()
  tf.disable_control_flow_v2()
  try:
    yield
  finally:
    if v2:
      tf.enable_control_flow_v2()


def build_towers(tower_batches, plan, decay_steps, jit=False,
                 optimizer=optimizer_lib.OptimizerSpec()):
  """Builds the towers, the averaged update and the moving average.

  Used by `train` (batches from the prefetch queue) and by the cross-check
  harness (batches from placeholders or constants). Call inside a graph;
  creates the model variables, `global_step` and the moving averages.

  Args:
    tower_batches: list of N (images float32 [B, 24, 24, 3], labels int32
      [B]) pairs, batch i going to tower i.
    plan: common.devices.DevicePlan with at least N tower devices.
    decay_steps: int, steps between learning-rate decays
      (`common.hparams.decay_steps`).
    jit: bool, compile each tower's loss and gradients with XLA (as the
      modern towers do with `jit`).
    optimizer: common.optimizer.OptimizerSpec, the update (default upstream's
      SGD) and the gradient clipping.

  Returns:
    TowerOps.
  """
  # Deviation from upstream: TF1's control flow, as upstream's TF1 had (see _control_flow_v1).
  with tf.device(devices.VARIABLE_DEVICE), _control_flow_v1():
    global_step = tf.train.get_or_create_global_step()
    # Deviation from upstream: the name scopes of this graph (learning_rate,
    # mean_loss, summaries, update, moving_average; build_train_graph's input
    # and init) make TensorBoard's graph tab show the towers and where they
    # meet, as upstream's did, instead of their ops strewn over the top level.
    # Variable names (checkpoint keys) do not depend on name scopes.
    with tf.name_scope('learning_rate'):
      lr = tf.train.exponential_decay(optimizer.learning_rate, global_step, decay_steps,
                                      hparams.LEARNING_RATE_DECAY_FACTOR, staircase=True)
    opt = make_optimizer(optimizer, lr)

    tower_grads, tower_losses = [], []
    # Deviation from upstream: CPU towers compute the LRN with common.lrn's XLA functions.
    # The same function as tf.nn.lrn to ~4e-7 relative
    # (tests/test_lrn.py) and the same kernels as modern's towers, so the two
    # trainers' arithmetic stays identical (docs/performance.md).
    lrn = lrn_lib.for_plan(plan)
    with tf.variable_scope(tf.get_variable_scope()):
      for i, (images, labels) in enumerate(tower_batches):
        # With `jit`, the tower's forward and backward ops form XLA clusters
        # on its device (explicitly requested, so also on CPUs); the
        # variables, on another device, stay outside them.
        xla = tf.xla.experimental.jit_scope() if jit else contextlib.nullcontext()
        with tf.device(plan.tower_devices[i]), xla, tf.name_scope(
            f'{model.TOWER_NAME}_{i}') as scope:
          # Deviation from upstream: every tower's loss summary is written
          # (summary_op merges the summaries of every tower's scope).
          loss = tower_loss(scope, images, labels, lrn=lrn)
          # The next towers share this tower's variables.
          tf.get_variable_scope().reuse_variables()
          grads_and_vars = opt.compute_gradients(loss)
          if optimizer.clips_per_tower:
            # Each tower's gradients by their own global norm, before the
            # average: not the same as clipping the average (README).
            grads_and_vars = _clip(grads_and_vars, optimizer.clip_norm)
          tower_grads.append(grads_and_vars)
          tower_losses.append(loss)

    # Synchronization point: every tower's gradients and losses meet here.
    grads = applied = average_gradients(tower_grads)
    if optimizer.clips_averaged:
      with tf.name_scope('clip_gradients'):
        applied = _clip(grads, optimizer.clip_norm)
    # Deviation from upstream: the loss logged is the mean over towers, not the last tower's.
    with tf.name_scope('mean_loss'):
      mean_loss = tf.reduce_mean(tf.stack(tower_losses))

    # The tags of common.tags.summary_tags, as modern writes them (a
    # summary op takes its tag as a value: name scopes do not change it).
    with tf.name_scope('summaries') as summaries_scope:
      model.scalar_summary(tags.LEARNING_RATE_TAG, lr)
      model.scalar_summary(tags.MEAN_LOSS_TAG, mean_loss)
      for grad, var in grads:
        model.histogram_summary(tags.gradients_tag(var.op.name), grad)
      # A few of tower 0's images, as TF1's image summary scales them.
      model.collected(tf.raw_ops.ImageSummary(
          tag='images', tensor=tower_batches[0][0],
          max_images=tags.NUM_SUMMARY_IMAGES, name='image_summary'))

    # Named by `name`, not by a name scope around it, which would rename
    # Adam's 'beta1_power' and 'beta2_power' (tf.Variables).
    apply_gradient_op = opt.apply_gradients(applied, global_step=global_step, name='update')

    ema = tf.train.ExponentialMovingAverage(hparams.MOVING_AVERAGE_DECAY,
                                            global_step)
    # Deviation from upstream: the moving averages see the updated variables and the new step.
    # Upstream's multi-GPU script grouped the update and the moving average
    # with no order between them; upstream cifar10.train
    # orders them like this, which makes the step deterministic: the
    # averages see the updated variables and num_updates = the new step.
    with tf.control_dependencies([apply_gradient_op]), tf.name_scope('moving_average'):
      variables_averages_op = ema.apply(tf.trainable_variables())
    train_op = tf.group(apply_gradient_op, variables_averages_op, name='train')

    # The variables and their averages after the step, as modern writes them
    # (the summary op is only ever fetched together with train_op).
    with tf.name_scope(summaries_scope):
      with tf.control_dependencies([train_op]):
        for var in tf.trainable_variables():
          model.histogram_summary(var.op.name, var.read_value())
          model.histogram_summary(model_spec.average_name(var.op.name),
                                  ema.average(var).read_value())
      # Deviation from upstream: both trainers write the tags of common.tags.summary_tags.
      # The towers' summaries only: not the input pipeline's queue-fill
      # fractions and image summary, which the modern trainer has no counterpart of.
      summary_op = tf.summary.merge(tf.get_collection(
          tf.GraphKeys.SUMMARIES, rf'{model.TOWER_NAME}_\d+/|summaries/'))

  return TowerOps(train_op, global_step, lr, tower_losses, grads,
                applied, ema, summary_op)


def session_config(plan, log_device_placement=False):
  """The ConfigProto of every legacy-graph Session (training, bench, cross-check, convert).

  Args:
    plan: common.devices.DevicePlan whose devices the Session must create.
    log_device_placement: bool, log where each op runs.
  """
  # A tf.compat.v1 Session creates only the devices its ConfigProto names: the
  # logical CPU towers of a CPU plan, and the logical GPUs devices.plan_devices
  # made (the same split as TensorFlow's eager context, which TF requires).
  config = tf.ConfigProto(allow_soft_placement=True, log_device_placement=log_device_placement,
                          device_count={'CPU': plan.num_cpu_devices})
  limits = [[logical.memory_limit for logical in tf.config.get_logical_device_configuration(gpu)
             or ()] for gpu in tf.config.list_physical_devices('GPU')]
  if any(limits):
    config.gpu_options.experimental.virtual_devices.extend(
        config.gpu_options.Experimental.VirtualDevices(memory_limit_mb=mb) for mb in limits)
  return config


def train(config, plan, num_threads=hparams.NUM_PREPROCESS_THREADS, on_step=None):
  """Trains until `global_step == config.max_steps`, resuming if possible.

  Args:
    config: runtime.config.TrainConfig.
    plan: common.devices.DevicePlan with `config.num_gpus` tower devices.
    num_threads: int, input preprocessing threads (upstream: 16).
    on_step: optional callable(step, seconds, images) after every step: the
      global step reached, the step's wall seconds, and the images it
      trained on over all replicas (bench paces itself with it).

  Returns:
    int, the final global step; `<train_dir>/model.ckpt-<step>` holds it.
    Less than `config.max_steps` when a stop signal stopped the run.

  Raises:
    common.cifar10_format.DataError: the training data is missing or bad.
    runtime.training.TrainingError: the loss diverged, or the checkpoint in
      train_dir is a modern one or does not fit the model.
    runtime.checkpoints.CheckpointError: the latest checkpoint is damaged or
      of another model, or a write into train_dir failed (e.g. disk full).
    runtime.lock.LockError: another run trains in train_dir.
    runtime.training.Stopped: a stop signal came before the first step;
      nothing was written.
  """
  with training.starting(config, config.num_gpus, config.train_dir, 'legacy training') as (
      stop, examples_per_epoch, decay_steps):
    with tf.Graph().as_default() as graph:
      with stop.raising():
        graph_parts = build_train_graph(config, plan, decay_steps, num_threads)
        graph.finalize()
      with tf.Session(config=session_config(plan, config.log_device_placement)) as sess:
        with stop.raising():
          step = restore_or_initialize(sess, graph_parts, config.train_dir,
                                        config.optimizer)
        if step >= config.max_steps:
          logger.warning(training.nothing_to_train(step, config.max_steps, config.train_dir))
          return step
        fill = hparams.min_queue_examples(examples_per_epoch)
        logger.info(f'Filling the queue with {fill} CIFAR images before starting to train. '
                    'This may take a while.')
        trainer = QueueTrainer(sess, config, graph_parts, step, stop, fill)
        # On the stop request's own thread, while this one may wait in sess.run
        # for a batch: the dequeue then fails with OutOfRangeError. The towers'
        # queue first: a shuffle queue still filling hands out what it holds
        # once closed, and no such batch must reach a tower. (Not
        # coord.request_stop() first: the input threads would close the shuffle
        # queue themselves as they stop.)
        with stop.while_blocked(
            lambda _: inputs.close_queues(sess, graph_parts.close_queues[::-1])):
          return training.train_loop(config, stop, trainer, step, on_step)


def tower_input_batches(config, num_threads=hparams.NUM_PREPROCESS_THREADS):
  """The towers' batches: one input pipeline behind one shared prefetch queue.

  Builds, in the default graph, what `build_train_graph` feeds the towers
  (the benchmark times it alone).

  Args:
    config: runtime.config.TrainConfig.
    num_threads: int, input preprocessing threads.

  Returns:
    list of `config.num_gpus` (images float32 [batch, 24, 24, 3], labels int32
    [batch]) dequeues, one per tower.
  """
  with tf.device(devices.VARIABLE_DEVICE):
    images, labels = inputs.distorted_inputs(config.data_dir, config.batch_size, num_threads,
                                             config.seed)
    batch_queue = prefetch_queue.prefetch_queue([images, labels], 2 * config.num_gpus)
    # Each tower gets its own full batch from the one shared queue.
    # Deviation from upstream: the dequeues are built here on the CPU, not
    # inside each tower's scope; the placer put them next to the queue on the
    # CPU there too.
    return [batch_queue.dequeue(name=f'dequeue_{i}')
            for i in range(config.num_gpus)]


def build_train_graph(config, plan, decay_steps, num_threads):
  """Builds, in the default graph, everything `train` runs.

  Args:
    config: runtime.config.TrainConfig.
    plan: common.devices.DevicePlan with `config.num_gpus` tower devices.
    decay_steps: int, steps between learning-rate decays.
    num_threads: int, input preprocessing threads.

  Returns:
    TrainGraph.
  """
  tf.set_random_seed(config.seed)  # None leaves the graph unseeded
  with tf.name_scope('input'):
    tower_batches = tower_input_batches(config, num_threads)
    close_queues = inputs.close_queue_ops()
    queue_size = next(runner.queue for runner in tf.get_collection(tf.GraphKeys.QUEUE_RUNNERS)
                      if isinstance(runner.queue, tf.RandomShuffleQueue)).size()
  towers = build_towers(tower_batches, plan, decay_steps, config.jit, config.optimizer)

  # Deviation from upstream: the `checkpoint` state file records paths
  # relative to train_dir, so a copied or moved train_dir resumes from its
  # own files (upstream's absolute paths pointed back at the original).
  saver = tf.train.Saver(tf.global_variables(), save_relative_paths=True)
  with tf.name_scope('init'):
    init_op = tf.group(tf.global_variables_initializer(),
                       tf.local_variables_initializer())
  return TrainGraph(towers, saver, init_op, close_queues, queue_size)


def restore_or_initialize(sess, graph_parts, train_dir, optimizer):
  """Restores the newest intact checkpoint of train_dir, or initializes; the step.

  The values restored are the ones `runtime.checkpoints.resume` read (and
  checked against their checksums and this graph), fed variable by variable into
  each variable's initializer: no new op in the finalized graph, and a
  train_dir of the upstream script resumes too (its `global_step` is
  float32, ours int64: each value is cast to its variable's dtype, which
  the Saver cannot do).

  Raises:
    runtime.checkpoints.CheckpointError, runtime.training.TrainingError: see
      `runtime.checkpoints.resume`.
  """
  variables = tf.global_variables()
  contents = checkpoints.resume(train_dir, checkpoints.LEGACY, optimizer.name,
                                {v.op.name: tuple(v.shape) for v in variables},
                                training.TrainingError)
  sess.run(graph_parts.init_op)
  if contents is None:
    return 0
  # Deviation from upstream: train_dir is never deleted; training resumes.
  for variable in variables:
    variable.load(contents.tensors[variable.op.name].astype(
        variable.dtype.base_dtype.as_numpy_dtype), sess)
  step = int(sess.run(graph_parts.towers.global_step))
  logger.info(f'Resuming an upstream train_dir from {contents.path} at global step {step} '
              '(float32 global_step); new checkpoints are named by the global step.'
              if contents.tensors['global_step'].dtype.kind == 'f' else
              f'Resuming from {contents.path} at global step {step}.')
  return step


class QueueTrainer(training.Trainer):
  """`runtime.training.train_loop`'s trainer, fed by the queue threads, which it always stops.

  A step waiting for its batch (the first one waits while the shuffle queue
  fills: tens of seconds with CIFAR-10) is ended at once by a stop closing the
  input queues under it.
  """

  def __init__(self, sess, config, graph_parts, step, stop, fill):
    self.sess, self.graph_parts, self.stop, self.fill = sess, graph_parts, stop, fill
    self.images = config.batch_size * config.num_gpus
    self.write_dir = self.train_dir = config.train_dir
    # The Saver names a checkpoint latest only after writing it whole.
    self.saver = checkpoints.StepSaver(
        config.train_dir, self.global_step, lambda step: graph_parts.saver.save(
            sess, self.saver.prefix, global_step=step), step)
    self._summary = None  # the serialized summary of the last summary step
    # A stop closes the queues: a dequeue then raises OutOfRangeError, an
    # enqueue CancelledError. Input threads ending with either is a clean stop,
    # not an error to re-raise.
    self._closed = (tf.errors.OutOfRangeError, tf.errors.CancelledError)
    self._coord = tf.train.Coordinator(self._closed)
    self._threads = tf.train.start_queue_runners(sess, self._coord)

  def _first_step_progress(self, seconds):
    """The heartbeat line of the first step: the queue's filling, then the step."""
    held = int(self.sess.run(self.graph_parts.queue_size))
    if held < self.fill:
      return f'Filling the queue: {held} of {self.fill} examples... {seconds} s'
    return f'Running the first step... {seconds} s'

  def step(self, step, first, summaries):
    if self._coord.should_stop():  # an input thread failed: its error ends the run
      self._coord.raise_requested_exception()
      return None
    towers = self.graph_parts.towers
    # Deviation from upstream: the summaries are fetched with the step;
    # upstream ran them separately, dequeuing batches it never trained on.
    # The first step waits for the shuffle queue to fill: tens of seconds,
    # said on stdout past training.HEARTBEAT_AFTER.
    try:
      with training.heartbeat(self._first_step_progress) if first else contextlib.nullcontext():
        _, tower_losses, self._summary = self.sess.run([
            towers.train_op, towers.tower_losses, towers.summary_op if summaries else []])
    except self._closed:
      if not self.stop.requested:
        raise
      return None  # the stop closed the queues under this step: it did not run
    return training.StepResult(tower_losses)

  def global_step(self):
    return int(self.sess.run(self.graph_parts.towers.global_step))

  def open_summaries(self):
    return tf.summary.FileWriter(self.train_dir, self.sess.graph)

  def write_summaries(self, writer, step):
    writer.add_summary(self._summary, step)

  def close(self):
    # The first recorded error wins: if an input thread failed first (and so
    # closed the queues under this loop), join re-raises the thread's error.
    inputs.stop_queue_threads(self.sess, self._coord, self._threads,
                              self.graph_parts.close_queues)
