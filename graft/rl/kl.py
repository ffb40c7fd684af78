"""Per-token estimators of KL(policy || ref) from the log-probs of tokens sampled from the policy.

Schulman's k1, k2, k3 (http://joschu.net/blog/kl-approx.html), with ``d = ref - logp`` (log of the
ratio ref / policy at a sampled token): k1 = ``-d`` is unbiased but can be negative, k2 =
``d^2 / 2`` is biased but low-variance and its gradient is that of the KL, k3 = ``exp(d) - d - 1``
is unbiased and ``>= 0``. ``k3-clamped`` bounds k3 against far-off tokens as verl's ``low_var_kl``.

Shape suffixes: see graft/__init__.py. Every function works token by token.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from graft.rl.registry import lookup

KLEstimator = Callable[[Tensor, Tensor], Tensor]


def kl_k1(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k1 = ``logp - ref``: unbiased, the plain log-ratio, negative at some tokens."""
    return logprobs_BT - ref_logprobs_BT


def kl_k2(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k2 = ``(logp - ref)^2 / 2``: biased, low variance; its expected gradient is the KL's."""
    return 0.5 * (logprobs_BT - ref_logprobs_BT).square()


def kl_k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || ref): ``exp(d) - d - 1`` with ``d = ref - new``.

    Unbiased under samples from the policy, and ``>= 0`` token by token. Written as
    ``expm1(d) - d``: ``expm1`` keeps precision near ``d = 0`` and, faithfully rounded, never falls
    below ``d``, so the result is never a tiny negative number.
    """
    d_BT = ref_logprobs_BT - logprobs_BT
    return torch.expm1(d_BT) - d_BT


# verl's low_var_kl bounds: the log-ratio to [-20, 20] before exp, the estimate to [-10, 10].
K3_LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0


def kl_k3_clamped(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k3 with the log-ratio clamped to ``[-20, 20]`` and the estimate to ``[-10, 10]`` (verl
    ``low_var_kl``): one token the reference finds far likelier cannot dominate the loss, and its
    gradient is zero beyond the bound."""
    d_BT = (ref_logprobs_BT - logprobs_BT).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (torch.expm1(d_BT) - d_BT).clamp(-K3_BOUND, K3_BOUND)


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "k3-clamped": kl_k3_clamped,
}


def get_kl_estimator(name: str) -> KLEstimator:
    """Looks up ``KL_ESTIMATORS[name]``. ValueError if it is not registered."""
    return lookup(KL_ESTIMATORS, name, "KL estimator")
