"""Which law form sizes the rung and predicts it: Chinchilla's (`chinchilla_fit`) or Kaplan's (`kaplan_fit`).

Both are fitted to every sweep. With `sweep.law_form: auto` the one with the smaller mean error on the held-out
budget wins: each form fitted without the sweep's largest budget and scored predicting it, the same extrapolation
in compute the rung asks of it. On the demo's sweeps it chose Kaplan's, which then predicted the rung and seven
shapes trained at its budget better (README, "Which form sizes the rung").
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from training.bootstrap import mean_interval
from training.config import LawForm

FORMS = ("chinchilla", "kaplan")


class FormChoice(BaseModel):
    """The form that sized the rung and made its prediction, why, and what it says at the target budget: N* with
    its 95% interval and its two exponents' 95% intervals (Chinchilla's alpha and beta, Kaplan's alpha_n and
    alpha_d: the size's and the data's)."""

    form: str
    law: dict[str, float]  # its fitted parameters (Chinchilla's are also the fit's `law`)
    reason: str
    heldout: dict[str, float | None]  # each form's mean relative error on the held-out budget
    # Kaplan's minus Chinchilla's, 95% over the held-out runs resampled (`heldout_gap`): does the budget tell them apart?
    heldout_gap: tuple[float, float] | None = None
    n_opt: float
    n_opt_interval: tuple[float, float]
    exponents: dict[str, tuple[float, float]]
    # its intervals also span the law without a floor (`FormPrediction.floorless`)
    floorless: bool | None = None


def choose_form(
    setting: LawForm, heldout: dict[str, float | None], gap: tuple[float, float] | None = None
) -> tuple[str, str]:
    """(form, reason): the recipe's `setting`, or with `auto` the form with the smaller held-out error
    (Chinchilla's when either has none: a sweep of one budget, or a form that did not converge without it). The
    reason says whether the `gap` between the two (`heldout_gap`) is beyond the held-out runs' noise."""
    if setting != "auto":
        return setting, f"set by sweep.law_form={setting}"
    if any(heldout.get(f) is None for f in FORMS):
        return "chinchilla", "sweep.law_form=auto, but not both forms have a held-out error: the default"
    form, other = sorted(FORMS, key=lambda f: heldout[f])
    reason = (
        f"sweep.law_form=auto: the smaller mean error on the held-out budget, {heldout[form]:.2%} against "
        f"{other.capitalize()}'s {heldout[other]:.2%}"
    )
    if gap is not None:
        apart = "beyond" if gap[0] > 0 or gap[1] < 0 else "within"
        reason += (
            f"; a gap {apart} the held-out runs' noise, Kaplan's minus Chinchilla's 95% "
            f"[{gap[0]:+.2%}, {gap[1]:+.2%}]"
        )
    return form, reason


def heldout_gap(
    chinchilla: np.ndarray, kaplan: np.ndarray, runs: np.ndarray, n_resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% interval of Kaplan's mean relative error on the held-out points minus Chinchilla's, the held-out runs
    resampled with replacement: both forms are scored on the same points, so what their errors share (a run's
    own luck) cancels and what is left is how far the budget tells the forms apart."""
    diff = np.asarray(kaplan, dtype=float) - np.asarray(chinchilla, dtype=float)
    return mean_interval(diff, runs, n_resamples=n_resamples, seed=seed)
