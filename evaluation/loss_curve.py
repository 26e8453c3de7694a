"""A schedule-aware law for whole validation-loss curves, fitted on every sweep run: the multi-power law of Luo et
al. (2025, "A Multi-Power Law for Loss Curve Prediction Across Learning Rate Schedules") with the model-size term
of Hoffmann et al.'s law:

    L(N, t) = E + A / N^α + B / S1(t)^β − D · Σ_k d_k · (1 − 1 / (1 + C · η_k^(−1/2) · S_k(t)))

S1 is the learning-rate-weighted token count after t steps (Σ tokens · η/η_peak: a constant-rate run's S1 is its
tokens); the sum runs over every drop of the rate after warmup, d_k = η_(k−1) − η_k (fractions of the peak), each
paying off as the rate area S_k(t) = Σ_(k ≤ τ < t) η_τ swept since it grows, up to D·d_k. A stable phase follows
the data term alone; a decay adds a gain that saturates (Luo et al.'s G with β = 1, γ = 1/2). Tissue et al.'s
(2024) linear annealing term fitted the demo's sweep as well but grows without bound with the decay's length: it
put a cosine schedule 15% below WSD's for the same run, where this law says 3% above (the literature's ordering).
Fitted in log loss with a robust (soft-L1) objective, the law predicts a new run's curve under any schedule, so
the rung's curve is written before it trains and other schedules' end points are read off the same law.

Anchored (`anchored`): the law's additive size and data terms miss how a shape the sweep did not train falls with
data (3.1-3.4% at the demo's rung by its end), where the point law, fitted on annealed end points only, lands within
0.1%. So a curve is predicted as the point law's loss at each evaluation's tokens (a run like the sweep's,
decayed there) plus what this run's schedule adds over that run's, by this law: the law carries only the
difference between two schedules at the same size and step, which it is fitted to see (every run has decayed
branches beside its stable phase).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from scipy.optimize import least_squares

from evaluation.chinchilla_fit import Law, fit_law
from evaluation.scaling_data import ScalingPoints
from training.config import OptimConfig
from training.optim.optimizers import lr_at

CURVE_TOLERANCE = 0.015  # the goal for a predicted curve: each evaluation of the run this close to it
ROBUST_SCALE = 0.02  # soft-L1 threshold in log loss: residuals beyond ~2% count linearly
N_STARTS = 8


@dataclass(frozen=True)
class Annealing:
    """Every drop of the learning rate each point has seen: its size, the rate after it and the rate area swept
    since (`point` says whose drop it is)."""

    drop: np.ndarray
    rate: np.ndarray
    area: np.ndarray
    point: np.ndarray

    @classmethod
    def concat(cls, parts: list[Annealing], sizes: list[int]) -> Annealing:
        offsets = np.cumsum([0, *sizes])
        return cls(
            *(np.concatenate([getattr(p, k) for p in parts]) for k in ("drop", "rate", "area")),
            point=np.concatenate([p.point + o for p, o in zip(parts, offsets, strict=False)]),
        )

    def keep(self, mask: np.ndarray) -> Annealing:
        """The drops of the points where `mask` holds, indexed among those points."""
        index = np.cumsum(mask) - 1  # a kept point's new index
        own = mask[self.point]
        return Annealing(self.drop[own], self.rate[own], self.area[own], index[self.point[own]])


@dataclass(frozen=True)
class Schedule:
    """A run's learning rates per optimiser step, as fractions of the peak, with its tokens per step."""

    lrs: np.ndarray
    tokens_per_step: float
    warmup: int

    @classmethod
    def of(cls, optim: OptimConfig, horizon: int, tokens_per_step: float) -> Schedule:
        """The schedule of `optim` for a run of `horizon` steps."""
        rates = [lr_at(i, optim, horizon) / optim.lr for i in range(horizon)]
        return cls(np.asarray(rates), float(tokens_per_step), optim.warmup_steps)

    @classmethod
    def ending(
        cls, optim: OptimConfig, step: int, tokens_per_step: float, warmup: int | None = None
    ) -> Schedule:
        """The run of `optim` that ends, decayed, at `step`: what an anchored curve measures a schedule against.
        Its warmup is `warmup` (default the optimiser's), at most half the run, as a sweep's."""
        warmup = optim.warmup_steps if warmup is None else warmup
        return cls.of(
            optim.model_copy(update={"warmup_steps": min(warmup, step // 2)}), step, tokens_per_step
        )

    def at(self, steps: list[int]) -> tuple[np.ndarray, Annealing]:
        """S1 (tokens) and the drops seen after each of `steps` optimiser steps."""
        prefix = np.concatenate([[0.0], np.cumsum(self.lrs)])
        drops = np.zeros_like(self.lrs)
        w = self.warmup
        if len(self.lrs) > w + 1:
            drops[w + 1 :] = np.maximum(self.lrs[w:-1] - self.lrs[w + 1 :], 0.0)
        where = np.flatnonzero(drops)
        seen = [where[where < t] for t in steps]
        annealing = Annealing(
            drop=np.concatenate([drops[k] for k in seen]),
            rate=np.concatenate([self.lrs[k] for k in seen]),
            area=np.concatenate([prefix[t] - prefix[k] for t, k in zip(steps, seen, strict=True)]),
            point=np.concatenate([np.full(len(k), i) for i, k in enumerate(seen)]).astype(int),
        )
        return prefix[np.asarray(steps)] * self.tokens_per_step, annealing


@dataclass(frozen=True)
class CurvePoints:
    """Validation losses along runs: each after `step` steps of a schedule, with what that schedule had swept and
    what its reference (the same run decayed at that step, `Schedule.ending`) had."""

    n: np.ndarray
    step: np.ndarray
    tokens: np.ndarray
    s1: np.ndarray
    annealing: Annealing
    ref_s1: np.ndarray
    ref_annealing: Annealing
    loss: np.ndarray
    run: np.ndarray  # which run (an index into `runs`)
    runs: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.loss)

    @classmethod
    def concat(cls, parts: list[CurvePoints]) -> CurvePoints:
        offsets = np.cumsum([0, *(len(p.runs) for p in parts)])
        sizes = [len(p) for p in parts]
        return cls(
            *(np.concatenate([getattr(p, k) for p in parts]) for k in ("n", "step", "tokens", "s1")),
            annealing=Annealing.concat([p.annealing for p in parts], sizes),
            ref_s1=np.concatenate([p.ref_s1 for p in parts]),
            ref_annealing=Annealing.concat([p.ref_annealing for p in parts], sizes),
            loss=np.concatenate([p.loss for p in parts]),
            run=np.concatenate([p.run + o for p, o in zip(parts, offsets, strict=False)]),
            runs=tuple(r for p in parts for r in p.runs),
        )

    def subset(self, mask: np.ndarray) -> CurvePoints:
        """The points where `mask` holds, with their drops."""
        fields = {k: getattr(self, k)[mask] for k in ("n", "step", "tokens", "s1", "ref_s1", "loss", "run")}
        return CurvePoints(
            **fields,
            annealing=self.annealing.keep(mask),
            ref_annealing=self.ref_annealing.keep(mask),
            runs=self.runs,
        )


def curve_points(
    n: float,
    losses: dict[tuple[int, int], float],
    schedules: dict[int, Schedule],
    reference: Callable[[int], Schedule],
    name: str = "",
) -> CurvePoints:
    """Points of one run: `losses[(step, horizon)]` measured after `step` steps of the schedule that ends at
    `horizon` (the run's own, or a decay branch's); `reference(step)` is the same run decayed at `step`."""
    keys = sorted(losses)
    s1, parts, sizes, tokens = [], [], [], []
    for horizon in sorted({h for _, h in keys}):
        steps = [s for s, h in keys if h == horizon]
        a1, annealing = schedules[horizon].at(steps)
        s1.append(a1)
        parts.append(annealing)
        sizes.append(len(steps))
        tokens += [s * schedules[horizon].tokens_per_step for s in steps]
    order = sorted(keys, key=lambda k: (k[1], k[0]))
    refs = [reference(s).at([s]) for s, _ in order]
    return CurvePoints(
        n=np.full(len(keys), float(n)),
        step=np.array([s for s, _ in order], dtype=float),
        tokens=np.asarray(tokens),
        s1=np.concatenate(s1),
        annealing=Annealing.concat(parts, sizes),
        ref_s1=np.concatenate([r[0] for r in refs]),
        ref_annealing=Annealing.concat([r[1] for r in refs], [1] * len(refs)),
        loss=np.array([losses[k] for k in order]),
        run=np.zeros(len(keys), dtype=int),
        runs=(name,),
    )


def run_curve(run_dir: str | Path, n: float, min_step: int = 1) -> CurvePoints | None:
    """A finished pretraining run's validation curve (every evaluation from `min_step` on) and its decay
    branches' end points, read from its spec.json and metrics.jsonl; None when it has none."""
    run_dir = Path(run_dir)
    spec = json.loads((run_dir / "spec.json").read_text())
    optim = OptimConfig.model_validate(spec["optim"])
    horizon = int(spec["train"]["max_steps"])
    per_step = spec["train"]["global_batch_size"] * spec["train"]["seq_len"]
    losses: dict[tuple[int, int], float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line) if line.strip() else {}
        if "horizon/val_loss" in m:
            h = int(m["horizon/steps"])
            losses[(h, h)] = float(m["horizon/val_loss"])
        elif "val/loss" in m and max(1, min_step) <= m["step"] <= horizon:
            losses[(int(m["step"]), horizon)] = float(m["val/loss"])
    losses = {k: v for k, v in losses.items() if k[0] >= min_step}
    if not losses:
        return None
    schedules = {h: Schedule.of(optim, h, per_step) for h in {h for _, h in losses}}
    return curve_points(n, losses, schedules, lambda s: Schedule.ending(optim, s, per_step), str(run_dir))


def _exp(x: float) -> float:
    """`math.exp`, inf past a float's range."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class CurveLaw:
    """The law in the module docstring (S1 in millions of tokens, S_k in steps at the peak rate)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    D: float
    C: float

    @classmethod
    def from_theta(cls, theta: np.ndarray) -> CurveLaw:
        """Parameters from their logs (α, β as they are); a log past a float's range gives inf, not an error (a
        least-squares trial step far out: it shrinks its step on the non-finite residuals)."""
        e, a, b, d, c = (_exp(float(theta[i])) for i in (0, 1, 3, 5, 6))
        return cls(E=e, A=a, B=b, alpha=float(theta[2]), beta=float(theta[4]), D=d, C=c)

    def loss(self, n: np.ndarray | float, s1: np.ndarray, annealing: Annealing) -> np.ndarray:
        s1 = np.asarray(s1, dtype=float)
        x = self.C * annealing.area / np.sqrt(annealing.rate)
        gain = np.bincount(annealing.point, weights=annealing.drop * x / (1.0 + x), minlength=s1.size)
        return (
            self.E
            + self.A * np.power(n, -self.alpha)
            + self.B * np.power(s1 / 1e6, -self.beta)
            - self.D * gain
        )

    def log_jacobian(self, n: np.ndarray, s1: np.ndarray, annealing: Annealing) -> np.ndarray:
        """(P, 7) derivatives of the log loss in the law's parameters (log E, log A, α, log B, β, log D, log C)."""
        s = np.asarray(s1, dtype=float) / 1e6
        size, data = self.A * np.power(n, -self.alpha), self.B * np.power(s, -self.beta)
        x = self.C * annealing.area / np.sqrt(annealing.rate)
        gain = np.bincount(annealing.point, weights=annealing.drop * x / (1.0 + x), minlength=s.size)
        slope = np.bincount(annealing.point, weights=annealing.drop * x / (1.0 + x) ** 2, minlength=s.size)
        columns = [
            np.full(s.size, self.E),
            size,
            -size * np.log(n),
            data,
            -data * np.log(s),
            -self.D * gain,
            -self.D * slope,
        ]
        return np.stack(columns, axis=1) / (self.E + size + data - self.D * gain)[:, None]

    def curve(self, n: float, schedule: Schedule, steps: list[int]) -> np.ndarray:
        """The predicted loss after each of `steps` optimiser steps of `schedule`."""
        s1, annealing = schedule.at(steps)
        return self.loss(n, s1, annealing)

    def difference(
        self, n: float, schedule: Schedule, steps: list[int], reference: Callable[[int], Schedule]
    ) -> np.ndarray:
        """What `schedule` adds to the loss after each of `steps` over `reference(step)` (a run decayed there)."""
        own = self.curve(n, schedule, steps)
        return own - np.array([self.curve(n, reference(s), [s])[0] for s in steps])

    def anchored(self, points: CurvePoints, decayed: np.ndarray) -> np.ndarray:
        """Each point's loss as `decayed` (its reference's: e.g. the point law's at its tokens) plus what its
        schedule adds over its reference's."""
        own = self.loss(points.n, points.s1, points.annealing)
        return decayed + own - self.loss(points.n, points.ref_s1, points.ref_annealing)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class PointLaw(Protocol):
    """A law of the loss at (N, D) tokens: Chinchilla's or Kaplan's form."""

    def loss(self, n: np.ndarray | float, d: np.ndarray | float) -> np.ndarray: ...


@dataclass(frozen=True)
class Anchor:
    """The point law curves are anchored to (the form the fit chose), with the points it was fitted to and how it
    is refitted on others: refitted without a run, it predicts that run's decayed losses as a new run's."""

    points: ScalingPoints
    law: PointLaw
    refit: Callable[[ScalingPoints], PointLaw]

    @classmethod
    def chinchilla(cls, points: ScalingPoints, law: Law, delta: float) -> Anchor:
        """Chinchilla's law, refitted from itself with the fit's Huber threshold `delta`."""
        return cls(points, law, lambda others: fit_law(others, starts=law.theta(), delta=delta).law)

    def without(self, run: str) -> PointLaw:
        return self.refit(self.points.subset(self.points.run != run))


@dataclass(frozen=True)
class CurveFit:
    law: CurveLaw
    rel_errors: np.ndarray  # |predicted / measured − 1| per point, in sample
    run_offsets: np.ndarray  # per run: its mean log residual (how far the run sits from the law)
    held_out: np.ndarray  # per point: the error of laws fitted without the point's run (empty: not measured)
    n_points: int
    n_runs: int
    seed_spread: np.ndarray  # per run with replicas: how far its curve strays from its seeds' (`seed_spread`)

    @property
    def band(self) -> float | None:
        """The relative error 95% of a held-out run's points stayed within: how far a new run's curve can lie."""
        return float(np.quantile(self.held_out, 0.95)) if self.held_out.size else None

    def summary(self) -> dict[str, float | int | dict[str, float] | None]:
        return {
            "law": self.law.as_dict(),
            "n_points": self.n_points,
            "n_runs": self.n_runs,
            "mean_rel_error": float(self.rel_errors.mean()),
            "max_rel_error": float(self.rel_errors.max()),
            "run_offset_sd": float(self.run_offsets.std(ddof=1)) if self.n_runs > 1 else 0.0,
            "held_out_mean_rel_error": float(self.held_out.mean()) if self.held_out.size else None,
            "held_out_rel_error_95": self.band,
            "seed_spread_median": float(np.median(self.seed_spread)) if self.seed_spread.size else None,
            "seed_spread_over_tolerance": (
                float(np.mean(self.seed_spread > CURVE_TOLERANCE)) if self.seed_spread.size else None
            ),
        }


def seed_spread(points: CurvePoints) -> np.ndarray:
    """Per run with replicas (runs of its size evaluated at the same steps: its other seeds), the largest relative
    distance of its curve from their mean curve, times √(k/(k−1)) for k replicas: how far one run's curve strays
    from its expectation, a floor under any law's error on a single run. Empty without replicas."""
    curves: dict[tuple, list[np.ndarray]] = {}
    for run in np.unique(points.run):
        mine = points.run == run
        order = np.lexsort((points.ref_s1[mine], points.step[mine]))
        key = (float(points.n[mine][0]), *points.step[mine][order].tolist())
        curves.setdefault(key, []).append(points.loss[mine][order])
    spread = []
    for replicas in curves.values():
        if (k := len(replicas)) > 1:
            y = np.array(replicas)
            spread += (np.abs(y / y.mean(axis=0) - 1.0).max(axis=1) * math.sqrt(k / (k - 1))).tolist()
    return np.asarray(spread)


def fit_curve_law(
    points: CurvePoints,
    start: dict[str, float] | None = None,
    seed: int = 0,
    cross_validate: bool = True,
    anchor: Anchor | None = None,
) -> CurveFit:
    """Fit the law to every point (log loss, soft-L1) from `start` (e.g. the sweep's Chinchilla law: E, A, B,
    alpha, beta) and random perturbations of it; the lowest objective wins. With `cross_validate` (and 3 or more
    sizes) the law is refitted without each run in turn and scored on that run's points: a new run's error (with
    an `anchor`, of the curve anchored to the point law refitted without the run too, as a new run's is)."""
    sizes = len(np.unique(points.n))
    if len(points) < 8 or sizes < 2:
        raise ValueError(
            f"a loss-curve law needs at least 8 points from runs of 2 or more sizes (got {len(points)} points, "
            f"{sizes} sizes)"
        )
    y = np.log(points.loss)

    def residuals(theta: np.ndarray) -> np.ndarray:
        predicted = CurveLaw.from_theta(theta).loss(points.n, points.s1, points.annealing)
        return np.log(np.clip(predicted, 1e-6, None)) - y

    def jacobian(theta: np.ndarray) -> np.ndarray:
        law = CurveLaw.from_theta(theta)
        clipped = law.loss(points.n, points.s1, points.annealing) < 1e-6  # flat where the loss is clipped
        return np.where(clipped[:, None], 0.0, law.log_jacobian(points.n, points.s1, points.annealing))

    s = start or {"E": 1.5, "A": 30.0, "B": 300.0, "alpha": 0.3, "beta": 0.5}
    b = math.log(s["B"]) - s["beta"] * math.log(1e6)  # the law's B for D in tokens, here in millions
    base = np.array(
        [math.log(s["E"]), math.log(s["A"]), s["alpha"], b, s["beta"], math.log(0.2), math.log(0.1)]
    )
    rng = np.random.default_rng(seed)
    best = None
    for i in range(N_STARTS):
        theta0 = base + (rng.normal(0.0, 0.5, base.size) if i else 0.0)
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                sol = least_squares(
                    residuals, theta0, jac=jacobian, loss="soft_l1", f_scale=ROBUST_SCALE, max_nfev=2000
                )
        except ValueError:  # a start whose residuals are not finite: the next one
            continue
        if np.isfinite(sol.cost) and (best is None or sol.cost < best.cost):
            best = sol
    if best is None:
        raise ValueError("the loss-curve law did not converge from any start")
    law = CurveLaw.from_theta(best.x)
    resid = np.log(law.loss(points.n, points.s1, points.annealing)) - y
    runs = np.unique(points.run)
    offsets = np.array([resid[points.run == r].mean() for r in runs])
    held_out = []
    if cross_validate and sizes >= 3:
        for run in runs:
            mine = points.run == run
            other = fit_curve_law(points.subset(~mine), start, seed, cross_validate=False).law
            test = points.subset(mine)
            if anchor is None:
                predicted = other.loss(test.n, test.s1, test.annealing)
            else:
                try:
                    point_law = anchor.without(points.runs[run])
                except ValueError:  # too few points left to refit the point law: the run is not scored
                    continue
                predicted = other.anchored(test, point_law.loss(test.n, test.tokens))
            held_out.append(np.abs(predicted / test.loss - 1.0))
    held = np.concatenate(held_out) if held_out else np.empty(0)
    spread = seed_spread(points)
    return CurveFit(law, np.abs(np.expm1(resid)), offsets, held, len(points), len(offsets), spread)
