"""The compress stage's configuration: the recipe's `compress:` section (which variants, their calibration, which
one the registry may take) and the spec the stage receives. Light to import (no torch).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    field_validator,
    model_validator,
)

from infra.tracking import TrackingConfig

SUPPORTED_BITS = (2, 3, 4, 8)
VARIANT_FILE = "variant.json"  # a finished variant's record, beside its hf/ export
Method = Literal["int8-weight", "int8-dynamic", "int4", "rtn", "gptq", "lowrank", "magnitude", "wanda"]
QUANTIZED = ("int8-weight", "int8-dynamic", "int4", "rtn", "gptq")
SETTINGS: dict[str, tuple[str, ...]] = {  # the fields each method reads
    "int8-weight": (),
    "int8-dynamic": (),
    "int4": ("group_size",),
    "rtn": ("bits", "group_size"),
    "gptq": ("bits", "group_size", "damp"),
    "lowrank": ("energy", "rank", "budget"),
    "magnitude": ("sparsity", "pattern"),
    "wanda": ("sparsity", "pattern"),
}


def check_sparsity(sparsity: float) -> None:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"pruning sparsity {sparsity} is outside [0, 1); give the share of weights to zero")


class VariantConfig(BaseModel):
    """One entry of the recipe's `compress.variants`: a method and its settings (the others must stay unset)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Method
    bits: int | None = None  # rtn, gptq: 2, 3, 4 or 8 (default 4)
    group_size: PositiveInt | None = None  # int4, rtn, gptq: input columns sharing a scale (default 32)
    damp: float | None = Field(None, gt=0)  # gptq: λ = damp · mean(diag H) (default 0.01)
    energy: float | None = Field(None, gt=0, le=1)  # lowrank: share of Σσ² kept per layer (default 0.9)
    rank: PositiveInt | None = None  # lowrank: the same rank in every layer
    budget: float | None = Field(None, gt=0, le=1)  # lowrank: share of the layers' parameters kept, globally
    sparsity: float | None = None  # magnitude, wanda: share of weights zeroed, in [0, 1) (default 0.5)
    pattern: Literal["unstructured", "2:4"] | None = None  # magnitude, wanda (default unstructured)

    @model_validator(mode="after")
    def _check(self) -> VariantConfig:
        allowed = SETTINGS[self.method]
        extra = [
            f
            for f in ("bits", "group_size", "damp", "energy", "rank", "budget", "sparsity", "pattern")
            if getattr(self, f) is not None and f not in allowed
        ]
        if extra:
            raise ValueError(
                f"{', '.join(extra)} is not a setting of {self.method} (its settings: {', '.join(allowed) or 'none'})"
            )
        if self.bits is not None and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"{self.bits}-bit quantization is not supported; use one of {SUPPORTED_BITS}")
        if self.sparsity is not None:
            check_sparsity(self.sparsity)
        if self.pattern == "2:4" and self.sparsity not in (None, 0.5):
            raise ValueError("2:4 pruning zeroes exactly half the weights; drop sparsity or set it to 0.5")
        if sum(x is not None for x in (self.energy, self.rank, self.budget)) > 1:
            raise ValueError("lowrank takes one of energy, rank or budget")
        return self

    def settings(self) -> dict[str, Any]:
        """Every setting the method reads, defaults filled in."""
        defaults = {"bits": 4, "group_size": 32, "damp": 0.01, "sparsity": 0.5, "pattern": "unstructured"}
        values = {
            f: getattr(self, f) if getattr(self, f) is not None else defaults.get(f)
            for f in SETTINGS[self.method]
        }
        if self.method == "lowrank" and not any(values.values()):
            values["energy"] = 0.9
        if values.get("pattern") == "2:4":
            values["sparsity"] = 0.5
        return {k: v for k, v in values.items() if v is not None}

    @property
    def name(self) -> str:
        """A short, path-safe label: `gptq-w4g32` (`-d0.1` with a damping given), `int4-g64`, `lowrank-e0.9`,
        `wanda-2of4`, `magnitude-s0.5`."""
        s = self.settings()
        if self.method in ("rtn", "gptq"):
            damp = f"-d{s['damp']:g}" if self.damp is not None else ""
            return f"{self.method}-w{s['bits']}g{s['group_size']}{damp}"
        if self.method == "int4":
            return f"int4-g{s['group_size']}"
        if self.method == "lowrank":
            key, value = next(iter(s.items()))
            return f"lowrank-{key[0]}{value:g}"
        if self.method in ("magnitude", "wanda"):
            return f"{self.method}-2of4" if s["pattern"] == "2:4" else f"{self.method}-s{s['sparsity']:g}"
        return self.method


DEFAULT_VARIANTS = (
    {"method": "int8-weight"},
    {"method": "int8-dynamic"},
    {"method": "int4", "group_size": 32},
    {"method": "rtn", "bits": 4, "group_size": 32},
    {"method": "gptq", "bits": 4, "group_size": 32},
    {"method": "lowrank", "energy": 0.9},
    {"method": "magnitude", "sparsity": 0.5},
    {"method": "wanda", "sparsity": 0.5},
    {"method": "wanda", "pattern": "2:4"},
)


class CalibrationConfig(BaseModel):
    """The calibration sample: `sequences` context-length windows of the train split, drawn with `seed`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sequences: PositiveInt = 32
    seed: NonNegativeInt = 0
    batch_size: PositiveInt = 8


class CompressConfig(BaseModel):
    """The recipe's `compress:` section: the variants to make, their calibration, and which one the registry may
    take (the smallest whose held-out loss is within `tolerance` of the uncompressed model's, alias `alias`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    variants: list[VariantConfig] = Field(
        default_factory=lambda: [VariantConfig(**v) for v in DEFAULT_VARIANTS]
    )
    calibration: CalibrationConfig = CalibrationConfig()
    tolerance: float = Field(0.02, ge=0)  # relative held-out loss increase the registered variant may show
    alias: str = "compressed"
    generate_tokens: PositiveInt = 64  # tokens generated (greedy) to measure tokens/s

    @field_validator("variants")
    @classmethod
    def _distinct(cls, variants: list[VariantConfig]) -> list[VariantConfig]:
        names = [v.name for v in variants]
        if not variants:
            raise ValueError("no variants; list at least one method (e.g. {method: gptq, bits: 4})")
        if len(set(names)) != len(names):
            raise ValueError(f"variants repeat: {sorted({n for n in names if names.count(n) > 1})}")
        return variants


class CompressSpec(BaseModel):
    """What the compress stage receives."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    output_dir: str
    compress: CompressConfig = CompressConfig()
    tracking: TrackingConfig = TrackingConfig()
