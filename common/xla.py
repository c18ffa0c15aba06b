"""The ops both trainers compile with XLA on CPU towers, even without `jit`.

TF's CPU kernel of the LRN gradient is a scalar loop, a fifth of a step; XLA's
is 3x faster and agrees with it to ~2e-7 relative (docs/performance.md). The
forward LRN and the convolutions keep TF's kernels, faster on the CPU than
XLA's. Both trainers use this one scope, so they run the same kernels.
"""

import contextlib

import tensorflow as tf

XLA_OPS = ('LRNGrad',)


def xla_ops_scope(plan):
  """Marks the XLA_OPS created inside it for XLA compilation (CPU plans only).

  Works while building a tf.compat.v1 graph and inside a tf.function.

  Args:
    plan: common.devices.DevicePlan.
  """
  if plan.kind != 'cpu':
    return contextlib.nullcontext()
  return tf.xla.experimental.jit_scope(
      compile_ops=lambda node_def: node_def.op in XLA_OPS,
      separate_compiled_gradients=False)
