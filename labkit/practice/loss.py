"""Token-normalised losses and their check against the unsplit model (notebook 14, section 1).

A pipeline computes one loss per microbatch. With `reduction="mean"` each microbatch averages over
ITS valid tokens, and the schedule's default `scale_grads=True` then averages those means: when
microbatches hold different numbers of valid tokens (padding, packed sequences) that is not the
unsplit model's token mean over the whole batch (pytorch/torchtitan#2972). The fix: each microbatch
sums its token losses and divides by the GLOBAL count of valid tokens, and the schedule does not
divide again (`scale_grads=False`); the count reaches the loss through a closure, or through
`schedule.step(..., loss_kwargs=...)` where torch has it (2.13 and newer).

`check_step`'s reference backpropagates the MEAN of its per-microbatch losses; `check_token_step`
hands it the per-microbatch loss whose mean is the token mean (the token sum over the global count,
times the number of microbatches) and the pipelined losses in the same unit, so the whole
noise-aware verdict (figures, floor, where) applies unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def valid_tokens(target: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """How many target tokens count (those not equal to `ignore_index`)."""
    return int((target != ignore_index).sum())


def _token_sum(output: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten(), ignore_index=ignore_index, reduction="sum")


def token_loss(output: torch.Tensor, target: torch.Tensor, n_valid: int,
               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy summed over this microbatch's valid tokens, divided by `n_valid`, the count over the
    whole batch: the loss torch 2.13+'s `schedule.step(..., loss_kwargs={"n_valid": N})` passes the count to."""
    return _token_sum(output, target, ignore_index) / n_valid


def token_sum_loss(n_valid: int, ignore_index: int = IGNORE_INDEX):
    """`token_loss` with the global count bound in a closure (every torch release): build the schedule
    with `loss_fn=token_sum_loss(N), scale_grads=False`."""
    if n_valid < 1:
        raise ValueError(f"n_valid must be >= 1 (the batch's valid tokens), got {n_valid}: a batch with no valid "
                         f"token has no loss to normalise.")

    def loss(output, target):
        return token_loss(output, target, n_valid, ignore_index)

    return loss


def check_token_step(full, stages, x, y, losses, n_microbatches: int, n_valid: int | None = None,
                     ignore_index: int = IGNORE_INDEX, **kwargs):
    """Collective, like `check_step`: a step run with a token-normalised loss (`token_sum_loss`, no
    `scale_grads`) against the unsplit model's token mean over the whole batch `y`.

    `losses`: the step's per-microbatch losses (each the microbatch's token sum over the global count);
    `n_valid`: that count (default: the valid tokens of `y`). The reference loss of a microbatch is its
    token sum over `n_valid`, times `n_microbatches`, so the mean check_step backpropagates is the token
    mean; the pipelined losses are multiplied by `n_microbatches` to the same unit (exact for a power of
    two). Other keyword arguments go to `check_step` (prefix_stage_index, autocast, tolerance...)."""
    from ..check.reference import check_step

    n = valid_tokens(y, ignore_index) if n_valid is None else n_valid

    def reference_loss(output, target):
        return _token_sum(output, target, ignore_index) / n * n_microbatches

    scaled = [float(l.detach() if torch.is_tensor(l) else l) * n_microbatches for l in losses]
    check = check_step(full, stages, x, y, scaled, n_microbatches, reference_loss, **kwargs)
    if not check.ok and not check.values and not check.no_grad and "every stage computes as" in check.where:
        check.where = (f"the loss is normalised differently from the unsplit model's token mean over the batch "
                       f"({n} valid tokens): the likeliest cause when the stages compute as the unsplit model. Each "
                       f"microbatch's loss must be its token sum over the batch's count (token_sum_loss(n_valid), "
                       f"scale_grads=False), not its own mean; " + check.where)
    return check


def fit_weights(grads: dict[str, torch.Tensor], basis: list[dict[str, torch.Tensor]]) -> list[float]:
    """Least-squares weights w with grads ~= sum_k w_k * basis[k], over the parameters both hold.

    After two accumulated steps whose gradients should add up (w = [1, 1] for per-step means), the
    weights say what the run did instead: `scale_grads=True` divides the whole accumulated gradient
    again at every step, so an earlier batch weighs 1/n_microbatches of the next (torchtitan#1733)."""
    names = [n for n in grads if all(n in b for b in basis)]
    if not names:
        raise ValueError("fit_weights: no parameter is held by both the gradients and every basis gradient.")
    target = torch.cat([grads[n].detach().double().flatten() for n in names])
    a = torch.stack([torch.cat([b[n].detach().double().flatten() for n in names]) for b in basis], dim=1)
    return [float(w) for w in torch.linalg.lstsq(a, target.unsqueeze(1)).solution.flatten()]
