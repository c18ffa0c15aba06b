"""The legacy adapter: a few FULL_TRACE steps of the queue-runner trainer.

The only contact with legacy/: `build_train_graph`, `session_config` and the
queue-thread helpers. RunMetadata.step_stats has one lane per device
(`/job:localhost/replica:0/task:0/device:CPU:1`, on a GPU also
`.../GPU:0/stream:all` and `.../GPU:0/memcpy`) with each op's start and end.
"""

import time

import tensorflow.compat.v1 as tf

from cifar10_towers.common import cifar10_format
from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.legacy import inputs
from cifar10_towers.legacy import train
from cifar10_towers.towerprofile import analysis

INPUT_THREADS = 4  # preprocessing threads; the profile keeps the CPU for the towers


def _op_type(label):
  """'tower_0/conv1/Conv2D = Conv2D(a, b)' -> 'Conv2D'."""
  if ' = ' not in label:
    return ''
  return label.split(' = ', 1)[1].split('(', 1)[0].strip()


def events_from_step_stats(step_stats, step):
  """Normalized events of one step's tensorflow StepStats.

  Args:
    step_stats: a StepStats proto (RunMetadata.step_stats).
    step: int, the index of the traced step.

  Returns:
    list of analysis.Event.
  """
  events = []
  for dev in step_stats.dev_stats:
    lane = dev.device
    # A GPU's kernels appear twice: per stream and in 'stream:all'.
    if '/stream:' in lane and not lane.endswith('/stream:all'):
      continue
    memcpy = lane.endswith('/memcpy')
    device = analysis.canonical_device(lane)
    for node in dev.node_stats:
      if node.node_name == '_SOURCE':
        continue
      start = (node.all_start_nanos / 1e3 if node.all_start_nanos
               else float(node.all_start_micros))
      length = (node.all_end_rel_nanos / 1e3 if node.all_end_rel_nanos
                else float(node.all_end_rel_micros))
      op_type = 'MEMCPY' if memcpy else _op_type(node.timeline_label)
      events.append(analysis.Event(node.node_name, op_type, device, start,
                                   start + length, step))
  return events


def trace(config, plan, steps, warmup=3, trainer_plan=None,
          num_threads=INPUT_THREADS):
  """Trains `warmup` then `steps` traced steps; nothing is written anywhere.

  Args:
    config: common.config.TrainConfig (train_dir is not used).
    plan: common.devices.DevicePlan, the planned devices.
    steps: int >= 1, traced steps.
    warmup: int, untraced steps first (queues fill, kernels warm up).
    trainer_plan: DevicePlan the trainer builds with, if not `plan` (the
      misplaced-tower demonstration).
    num_threads: int, input preprocessing threads.

  Returns:
    (events, windows, wall_us): list of analysis.Event, per step the traced
    window (start_us, end_us), per step the time sess.run took (us).
  """
  trainer_plan = trainer_plan or plan
  examples = cifar10_format.num_examples(
      cifar10_format.train_files(config.data_dir))
  decay_steps = max(1, hparams.decay_steps(examples, config.batch_size,
                                           config.num_gpus))
  events, windows, wall_us = [], [], []
  with tf.Graph().as_default() as graph:
    parts = train.build_train_graph(config, trainer_plan, decay_steps,
                                    num_threads)
    graph.finalize()
    with tf.Session(config=train.session_config(trainer_plan, config.log_device_placement)) as sess:
      sess.run(parts.init_op)
      coord = tf.train.Coordinator(clean_stop_exception_types=(
          tf.errors.OutOfRangeError, tf.errors.CancelledError))
      threads = tf.train.start_queue_runners(sess=sess, coord=coord)
      try:
        for _ in range(warmup):
          sess.run(parts.towers.train_op)
        options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
        for k in range(steps):
          metadata = tf.RunMetadata()
          # step_stats times are wall-clock microseconds since the epoch, so
          # the call's own bounds place the window on the trace's clock: the
          # runtime's time before the first and after the last op (dispatch,
          # collecting the trace: 0.5 and 2-7 ms measured) is part of the step.
          called = time.time() * 1e6
          began = time.perf_counter()
          sess.run(parts.towers.train_op, options=options,
                   run_metadata=metadata)
          wall_us.append((time.perf_counter() - began) * 1e6)
          returned = time.time() * 1e6
          step_events = events_from_step_stats(metadata.step_stats, k)
          events.extend(step_events)
          windows.append((min(called, min(e.start_us for e in step_events)),
                          max(returned, max(e.end_us for e in step_events))))
      finally:
        inputs.stop_queue_threads(sess, coord, threads, parts.close_queues)
  return events, windows, wall_us


def input_device():
  """Where the legacy input pipeline and prefetch queue run."""
  return devices.VARIABLE_DEVICE
