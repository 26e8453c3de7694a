"""Scaling-law input: a table of training runs (parameters N, tokens D, final loss) read from Parquet or CSV.

Column names are matched loosely so the same loader reads our sweep results, the Chinchilla extraction
(`Model Size`, `Training FLOP`, `loss`; D = C / 6N) and hand-made tables. Bad rows are dropped with a count;
a table that cannot support a fit is refused with a message that says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from infra.errors import UserError

log = logging.getLogger(__name__)

# Accepted spellings, matched case-insensitively after stripping spaces, dashes and underscores.
ALIASES: dict[str, tuple[str, ...]] = {
    "n": ("n", "nactive", "params", "nparams", "parameters", "modelsize", "activeparams"),
    "d": ("d", "tokens", "ntokens", "datasize", "trainingtokens"),
    "c": ("c", "flops", "compute", "trainingflop", "trainingflops", "budget"),
    "loss": ("loss", "finalloss", "finalvalloss", "valloss", "validationloss"),
    "n_total": ("ntotal", "totalparams"),
    "run": ("run", "runid", "rundir", "trial"),
}


class ScalingDataError(UserError, ValueError):
    """A scaling table that cannot be fitted; the message names the problem and the fix."""


@dataclass(frozen=True)
class ScalingPoints:
    """One row per (run, horizon). `c` defaults to 6·N·D; `n_total` equals `n` for dense models; `run` labels the
    training run each point comes from (the points of one multi-horizon run share its noise), by default one run
    per point."""

    n: np.ndarray
    d: np.ndarray
    loss: np.ndarray
    c: np.ndarray
    n_total: np.ndarray
    dropped: int = 0
    source: str = ""
    notes: list[str] = field(default_factory=list)
    run: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.loss)

    @property
    def runs(self) -> np.ndarray:
        """Each point's run as an index 0..R-1."""
        if self.run is None:
            return np.arange(len(self))
        return np.unique(self.run, return_inverse=True)[1].ravel()

    @property
    def cells(self) -> np.ndarray:
        """Each point's (size, budget) cell as an index 0..C−1: the seeds' runs of one size at one budget share a
        cell, and with it whatever the law misses there."""
        keys = np.stack([self.n, self.budgets()], axis=1)
        return np.unique(keys, axis=0, return_inverse=True)[1].ravel()

    @property
    def shapes(self) -> np.ndarray:
        """Each point's shape (its model size N) as an index 0..S−1: the runs of one shape at every budget and seed
        share whatever the law misses about its depth and width."""
        return np.unique(self.n, return_inverse=True)[1].ravel()

    def subset(self, mask: np.ndarray) -> ScalingPoints:
        run = None if self.run is None else self.run[mask]
        return ScalingPoints(
            self.n[mask],
            self.d[mask],
            self.loss[mask],
            self.c[mask],
            self.n_total[mask],
            0,
            self.source,
            [],
            run,
        )

    def budgets(self, rel_tol: float = 0.05) -> np.ndarray:
        """Label each run with its compute budget, grouping budgets within `rel_tol` of each other."""
        order = np.argsort(self.c)
        labels = np.empty(len(self), dtype=float)
        anchor = None
        for i in order:
            if anchor is None or self.c[i] > anchor * (1 + rel_tol):
                anchor = self.c[i]
            labels[i] = anchor
        # name each group by its geometric mean, so the label is a typical budget of the group
        for b in np.unique(labels):
            group = labels == b
            labels[group] = float(np.exp(np.log(self.c[group]).mean()))
        return labels


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _find(table: pa.Table, key: str) -> str | None:
    by_norm = {_normalise(c): c for c in table.column_names}
    for alias in ALIASES[key]:
        if alias in by_norm:
            return by_norm[alias]
    return None


def read_table(path: str | Path) -> pa.Table:
    path = Path(path)
    if not path.is_file():
        raise ScalingDataError(f"{path}: no such file; pass a results.parquet from `lmforge sweep` or a CSV")
    if path.suffix == ".parquet":
        return pq.read_table(path)
    if path.suffix in (".csv", ".tsv"):
        opts = pacsv.ParseOptions(delimiter="\t" if path.suffix == ".tsv" else ",")
        return pacsv.read_csv(path, parse_options=opts)
    raise ScalingDataError(f"{path}: unsupported format {path.suffix!r}; use .parquet, .csv or .tsv")


def points_from_table(table: pa.Table, source: str = "") -> ScalingPoints:
    """Pick N, D (or C), loss columns; drop non-finite or non-positive rows with a count."""
    cols = {k: _find(table, k) for k in ALIASES}
    missing = [k for k in ("n", "loss") if cols[k] is None]
    if cols["d"] is None and cols["c"] is None:
        missing.append("d (or c)")
    if missing:
        raise ScalingDataError(
            f"{source or 'table'}: no column for {', '.join(missing)} (columns: {', '.join(table.column_names)}); "
            "name them N, D (or C for FLOPs, D = C/6N) and loss"
        )

    def col(key: str) -> np.ndarray:
        values = table.column(cols[key]).to_numpy(zero_copy_only=False)
        try:
            return np.asarray(values, dtype=float)
        except (TypeError, ValueError) as error:
            raise ScalingDataError(
                f"{source or 'table'}: column {cols[key]!r} is not numeric ({error}); give numbers"
            ) from None

    n, loss = col("n"), col("loss")
    d = col("d") if cols["d"] else col("c") / (6.0 * n)
    c = col("c") if cols["c"] else 6.0 * n * d
    n_total = col("n_total") if cols["n_total"] else n.copy()
    run = np.asarray(table.column(cols["run"]).to_pylist(), dtype=str) if cols["run"] else None
    good = np.isfinite(n) & np.isfinite(d) & np.isfinite(loss) & (n > 0) & (d > 0) & (loss > 0)
    dropped = int((~good).sum())
    if dropped:
        log.warning("%s: dropped %d rows with non-finite or non-positive N, D or loss", source, dropped)
    return ScalingPoints(
        n[good],
        d[good],
        loss[good],
        c[good],
        n_total[good],
        dropped,
        source,
        [],
        None if run is None else run[good],
    )


def load_points(path: str | Path, drop_highest: int = 0) -> ScalingPoints:
    """Read a results table; optionally drop the `drop_highest` highest-loss runs (Epoch drop 5 on Chinchilla)."""
    points = points_from_table(read_table(path), source=str(path))
    if len(points) == 0:
        raise ScalingDataError(
            f"{path}: no usable runs ({points.dropped} rows dropped as non-finite or non-positive N, D or loss); "
            "give finite positive values"
        )
    if not 0 <= drop_highest < len(points):
        raise ScalingDataError(
            f"{path}: --drop-highest {drop_highest} must lie in 0..{len(points) - 1} (the table has {len(points)} "
            "usable runs)"
        )
    if drop_highest:
        threshold = np.sort(points.loss)[-drop_highest]
        keep = points.loss < threshold
        points = replace(points.subset(keep), dropped=points.dropped + int((~keep).sum()))
    return points


def check_design(points: ScalingPoints, n_params: int) -> None:
    """Refuse a table that cannot identify the law's parameters."""
    if len(points) < n_params + 1:
        raise ScalingDataError(
            f"{points.source or 'table'}: {len(points)} usable runs"
            + (f" ({points.dropped} dropped as non-finite or non-positive)" if points.dropped else "")
            + f"; a fit of {n_params} parameters needs at least {n_params + 1}: add runs"
        )
    for name, values in (("N (model size)", points.n), ("D (tokens)", points.d)):
        if np.ptp(np.log(values)) < 1e-6:
            raise ScalingDataError(
                f"{points.source or 'table'}: every run has the same {name} = {values[0]:.4g}, so its "
                "exponent cannot be fitted (degenerate design); vary it across runs"
            )
