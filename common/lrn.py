"""Local response normalization: upstream's op, or the same function made fast on CPUs.

`tf.nn.local_response_normalization` computes, along the channel axis,

    s = bias + alpha * sum(x[c - r .. c + r] ** 2),    y = x * s ** -beta.

On the CPU its forward kernel is a band-matrix product and its gradient
kernel (`LRNGrad`) recomputes `s` from `x` with a `pow` per element and window
position: together a fifth of a training step. `fast_lrn` computes the same
function with XLA-compiled elementwise loops, keeps `s ** -beta` and
`s ** (-beta - 1)` from the forward pass for the gradient, and for upstream's
beta = 0.75 takes `s ** -0.75` as `rsqrt(s) * sqrt(rsqrt(s))` instead of a
`pow`. Its outputs and gradients agree with the TF kernels to ~4e-7 relative,
a training step's gradients to ~2e-6 (tests/test_lrn.py); docs/performance.md
has the measured speed.

The gradient, with W(c) the window of channel c (symmetric: k in W(c) iff
c in W(k)):

    dx[k] = g[k] * s[k] ** -beta
            - 2 * alpha * beta * x[k] * sum over c in W(k) of g[c] * x[c] * s[c] ** (-beta - 1).
"""

import functools

import tensorflow as tf

from cifar10_towers.common import hparams


def _window_sum(t, depth_radius):
  """sum(t[..., c - r .. c + r]) for every channel c, zero outside the channels."""
  channels = t.shape[-1]
  padded = tf.pad(t, [[0, 0]] * (t.shape.rank - 1) + [[depth_radius, depth_radius]])
  total = padded[..., 0:channels]
  for k in range(1, 2 * depth_radius + 1):
    total += padded[..., k:k + channels]
  return total


def _negative_power(s, beta):
  """s ** -beta; for beta = 0.75 without a pow (s >= bias > 0 here)."""
  if beta == 0.75:
    r = tf.math.rsqrt(s)
    return r * tf.sqrt(r)
  return tf.pow(s, -beta)


@functools.cache
def make_fast_lrn(depth_radius, bias, alpha, beta):
  """An XLA-compiled `tf.nn.local_response_normalization` with these parameters.

  Returns:
    callable(x float32 [..., channels]) -> float32 tensor shaped like x, with
    the gradient of the module docstring. It works in eager code, inside
    `tf.function` (including `jit_compile=True` ones) and under
    `tf.distribute` strategies.
  """

  # No autograph: Python loops and ifs over numbers only (converting them cost a
  # process 0.4 s at its first step).
  @tf.function(jit_compile=True, autograph=False)
  def forward(x):
    s = bias + alpha * _window_sum(tf.square(x), depth_radius)
    p = _negative_power(s, beta)  # s ** -beta
    return x * p, p, p / s

  @tf.function(jit_compile=True, autograph=False)
  def backward(x, p, q, g):
    return g * p - (2.0 * alpha * beta) * x * _window_sum(g * x * q, depth_radius)

  @tf.custom_gradient
  def fast_lrn(x):
    y, p, q = forward(x)
    return y, lambda g: backward(x, p, q, g)

  return fast_lrn


def upstream_lrn(x):
  """Upstream's `tf.nn.lrn` with the hyperparameters of docs/equivalence.md §1."""
  return tf.nn.local_response_normalization(x, hparams.LRN_DEPTH_RADIUS, hparams.LRN_BIAS,
                                            hparams.LRN_ALPHA, hparams.LRN_BETA)


def fast_lrn(x):
  """`make_fast_lrn` with the hyperparameters of docs/equivalence.md §1, read when called."""
  return make_fast_lrn(hparams.LRN_DEPTH_RADIUS, hparams.LRN_BIAS,
                       hparams.LRN_ALPHA, hparams.LRN_BETA)(x)


def for_plan(plan):
  """The LRN a trainer's towers use: `fast_lrn` on CPU plans, upstream's on GPUs.

  Both trainers take their LRN from here, so on the same plan they run the
  same kernels. With different LRN kernels (legacy TF's, modern this one) the
  first step's gradients agreed to 1.5e-6, but the variables after two steps
  differed by 4e-3 relative (conv1/biases, 3 towers), far outside docs/equivalence.md §2's
  1e-4 (docs/performance.md). The fast version was measured on CPUs only; on
  GPUs TF's LRN is cuDNN's.

  Args:
    plan: common.devices.DevicePlan.
  """
  return fast_lrn if plan.kind == 'cpu' else upstream_lrn
