"""Model configuration: one frozen dataclass, validated on construction, plus named model sizes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from bam_jax.attention_spec import AttentionSpec
from bam_jax.implementation import canonical_implementation
from bam_jax.priors import check_ggd_form
from bam_jax.validation import (
    check_bool_fields,
    check_int,
    check_positive_int,
    dataclass_from_dict,
    is_float32_number,
    is_int,
)

POSITIONAL_FAMILIES = ("nope", "sinusoidal", "rope", "rope_local", "alibi", "bam")
SSMAX_SUFFIX = "_ssmax"
ENCODINGS = POSITIONAL_FAMILIES + tuple(
    family + SSMAX_SUFFIX for family in POSITIONAL_FAMILIES if family != "rope_local"
)
DTYPES = ("float32", "bfloat16")
ALPHA_INIT_MODES = ("slope", "sampled")
BETA_INIT_MODES = ("linear", "sampled")

# dim, n_layers, n_heads of the paper's model sizes (docs/spec.md section 7).
_PAPER_SIZES: dict[str, tuple[int, int, int]] = {
    "l6": (512, 6, 16),
    "l8": (768, 8, 16),
    "l12": (768, 12, 16),
    "l15": (1152, 15, 24),
    "l18": (1536, 18, 32),
    "l24": (2048, 24, 64),
}
# Small models for laptops and tests.
_SMALL_SIZES: dict[str, dict[str, Any]] = {
    "toy": {"dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 256},
    "nano": {"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "max_seq_len": 32},
}
MODEL_SIZES = tuple(_PAPER_SIZES) + tuple(_SMALL_SIZES)


@dataclasses.dataclass(frozen=True)
class Encoding:
    """An encoding name read once: its positional family and whether it has SSMax.

    Callers ask its properties (`learned_prior`, `rotary`, ...) instead of parsing names."""

    family: str
    ssmax: bool

    @classmethod
    def parse(cls, name: str, *, field: str = "encoding") -> Encoding:
        if name not in ENCODINGS:
            raise ValueError(f"{field} must be one of {ENCODINGS}, got {name!r}")
        family = name.removesuffix(SSMAX_SUFFIX)
        return cls(family=family, ssmax=family != name)

    @property
    def name(self) -> str:
        return self.family + SSMAX_SUFFIX if self.ssmax else self.family

    @property
    def learned_prior(self) -> bool:
        """BAM: a trained generalized Gaussian prior added to the logits."""
        return self.family == "bam"

    @property
    def alibi(self) -> bool:
        """ALiBi: a fixed linear distance penalty added to the logits."""
        return self.family == "alibi"

    @property
    def additive_prior(self) -> bool:
        """A prior over distances added to the logits (BAM or ALiBi)."""
        return self.learned_prior or self.alibi

    @property
    def rotary(self) -> bool:
        """RoPE: queries and keys rotated by position (rope, rope_local)."""
        return self.family in ("rope", "rope_local")

    @property
    def windowed(self) -> bool:
        """rope_local: every layer sees only the `local_window` keys before each query and
        the query itself."""
        return self.family == "rope_local"

    @property
    def absolute(self) -> bool:
        """Sinusoidal embeddings added to the token embeddings once, before the layers."""
        return self.family == "sinusoidal"

    @property
    def positionless(self) -> bool:
        """NoPE: no positional information besides the causal mask."""
        return self.family == "nope"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder with one of the positional encodings of the BAM paper.

    Prior fields apply to the "bam" encodings: `prior_alpha_init` is the initial value of
    exp(theta_alpha) ("slope" = ALiBi slopes, "sampled" = log-normal draws, or a positive
    number); `prior_beta_init` the initial theta_beta ("linear" = linspace(0, 1, H),
    "sampled" = standard normal, or a number); `prior_mu_init` the initial theta_mu. The
    defaults are the "uniform" prior (starts as NoPE). `global_prior` shares one prior
    across layers; otherwise every layer has its own. `train_*` choose which prior
    parameters (and SSMax scales) are trained; frozen ones are stored as constants.
    `prior_form` chooses the GGD prior's formula (`bam_jax.GGDPrior`, docs/spec.md section 2):
    "training" (the default), -exp(theta_alpha) * (|d - mu| + eps) ** theta_beta, what the
    authors' models train with, or "inference", -(|d - mu| * exp(theta_alpha) + eps) **
    theta_beta, what their evaluation code computes for `bam` (no SSMax) checkpoints. It
    does not change the parameters; the fused kernels evaluate the inference form from a
    table of its bias and train it with the blockwise backward.

    Other fields: `n_kv_heads` (None = n_heads) for grouped-query attention;
    `ssmax_prior_inside` puts the BAM prior inside the SSMax scaling (docs/spec.md section 4);
    `ssmax_capped_layers` caps SSMax's key count n at `max_seq_len` in the first that many
    layers, so they attend at any length as sharply as at the training context while the
    later layers scale with the prompt (0, the paper's model: no cap; docs/spec.md section 4);
    `local_layers` makes the first that many layers sliding-window (local) layers: each of
    their queries sees only itself and the `local_window` positions before it, at any prompt
    length (0: all layers global, the paper's model);
    `local_window` is the window w of rope_local and of the local layers, in keys back from
    the query: it sees w + 1 keys, as `AttentionSpec.window` (0: itself only; None =
    max_seq_len, as in the reference's rope_local, which masks keys farther than that);
    `dtype` the compute dtype of the matmuls ("bfloat16" is mixed precision, see below; a
    dtype object such as `jnp.bfloat16` is stored as its name);
    `attention_impl` ("reference", "blockwise" or "fused"; "pallas" is fused's earlier
    name, stored as "fused"), `block_q`, `block_k` select the attention kernel and its tiles
    (None: the implementation's default, which for the fused kernel depends on the backend
    and head dim);
    `remat` rematerialises each block in the backward pass; `scan_layers` stacks the
    blocks and scans over them (faster compilation of deep models).

    Precision: parameters are stored in float32 whatever `dtype` is. Under "bfloat16" the
    embeddings and the residual stream stay float32; the inputs of every matmul (the
    q/k/v/o projections, the feed-forward and the output layer) are cast to bfloat16, and
    the layers that write to the residual stream (wo, w2) and the output layer accumulate
    and return float32. Attention logits, softmax, the priors, the norms, the logits and
    the loss are float32.
    """

    vocab_size: int = 32768
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 16
    n_kv_heads: int | None = None
    ffn_dim_multiplier: float = 2.0
    multiple_of: int = 1
    norm_eps: float = 1e-5
    max_seq_len: int = 512
    encoding: str = "bam_ssmax"
    global_prior: bool = True
    prior_alpha_init: str | float = 1.0
    prior_beta_init: str | float = 0.0
    prior_mu_init: float = 0.0
    train_prior_alpha: bool = True
    train_prior_beta: bool = True
    train_prior_mu: bool = False
    prior_form: str = "training"
    train_ssmax_scale: bool = True
    ssmax_prior_inside: bool = True
    ssmax_capped_layers: int = 0
    local_layers: int = 0
    rope_theta: float = 500000.0
    sinusoidal_theta: float = 10000.0
    local_window: int | None = None
    dtype: str = "float32"
    attention_impl: str = "blockwise"
    block_q: int | None = None
    block_k: int | None = None
    remat: bool = False
    scan_layers: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            check_positive_int(name, getattr(self, name))
        for name in ("block_q", "block_k"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is not None:
            check_positive_int("n_kv_heads", self.n_kv_heads)
        if self.local_window is not None:
            check_int("local_window", self.local_window, 0)
        self._check_ssmax_capped_layers()
        self._check_local_layers()
        for name in ("ffn_dim_multiplier", "norm_eps", "rope_theta", "sinusoidal_theta"):
            value = getattr(self, name)
            if not is_float32_number(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite float32 number, got {value!r}")
        Encoding.parse(self.encoding)
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2 and self.positional.rotary:
            raise ValueError(f"dim / n_heads must be even for rope, got head_dim {self.head_dim}")
        if self.dim % 2 and self.positional.absolute:
            raise ValueError(f"dim must be even for sinusoidal, got {self.dim}")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})"
            )
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        implementation = canonical_implementation(
            self.attention_impl, field="attention_impl", allow_auto=False
        )
        object.__setattr__(self, "attention_impl", implementation)
        _check_init("prior_alpha_init", self.prior_alpha_init, ALPHA_INIT_MODES, positive=True)
        _check_init("prior_beta_init", self.prior_beta_init, BETA_INIT_MODES, positive=False)
        check_ggd_form("prior_form", self.prior_form)
        if not is_float32_number(self.prior_mu_init):
            raise ValueError(
                f"prior_mu_init must be a finite float32 number, got {self.prior_mu_init!r}"
            )
        check_bool_fields(self)

    def _check_local_layers(self) -> None:
        local = self.local_layers
        if not is_int(local):
            raise ValueError(f"local_layers must be an int, got {local!r}")
        if not 0 <= local <= self.n_layers:
            raise ValueError(f"local_layers must be in [0, n_layers={self.n_layers}], got {local}")
        if self.scan_layers and 0 < local < self.n_layers:
            raise ValueError(
                f"local_layers={local} of {self.n_layers} mixes local and global layers, which "
                "scan_layers=True cannot stack into one scanned block; use scan_layers=False"
            )

    def _check_ssmax_capped_layers(self) -> None:
        capped = self.ssmax_capped_layers
        if not is_int(capped):
            raise ValueError(f"ssmax_capped_layers must be an int, got {capped!r}")
        if not 0 <= capped <= self.n_layers:
            raise ValueError(
                f"ssmax_capped_layers must be in [0, n_layers={self.n_layers}], got {capped}"
            )
        if capped and not self.ssmax:
            raise ValueError(
                f"ssmax_capped_layers={capped} needs an SSMax encoding (*_ssmax), "
                f"got encoding {self.encoding!r}"
            )

    def ssmax_max_counts(self) -> tuple[int | None, ...]:
        """Per layer: the cap on SSMax's key count (max_seq_len), or None for no cap."""
        cap = self.max_seq_len
        return tuple(cap if i < self.ssmax_capped_layers else None for i in range(self.n_layers))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(self.ffn_dim_multiplier * self.dim)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def positional(self) -> Encoding:
        """The encoding's structured fields: positional family and SSMax."""
        return Encoding.parse(self.encoding)

    @property
    def ssmax(self) -> bool:
        return self.positional.ssmax

    @property
    def per_layer_prior(self) -> bool:
        """Whether each layer has its own learned prior (BAM without `global_prior`)."""
        return self.positional.learned_prior and not self.global_prior

    @property
    def shared_prior(self) -> bool:
        """Whether one learned prior serves every layer (BAM with `global_prior`)."""
        return self.positional.learned_prior and self.global_prior

    def dilation_problem(self) -> str | None:
        """Why a prior dilation (every distance seen that many times longer) has no
        analogue in this model, or None where it has one; it reads after "the model"."""
        encoding = self.positional
        if encoding.positionless:
            return f"has no positions to dilate: encoding={self.encoding!r} (NoPE)"
        if encoding.absolute and self.local_layers:
            return (
                "cannot dilate the global layers apart from the local ones: "
                f"encoding={self.encoding!r} adds its positions once, before every layer, "
                f"local ones included (local_layers={self.local_layers})"
            )
        if not any(self.global_layers()):
            return (
                f"has no global layer to dilate: all {self.n_layers} are windowed "
                "(local_layers, rope_local)"
            )
        return None

    @property
    def window(self) -> int | None:
        """Attention window of rope_local (keys farther back than this are masked; a query
        sees window + 1 keys), else None."""
        return self._window_size if self.positional.windowed else None

    @property
    def _window_size(self) -> int:
        return self.max_seq_len if self.local_window is None else self.local_window

    def ssmax_growing_layers(self) -> tuple[bool, ...]:
        """Per layer: whether SSMax's key count grows with the prompt without bound (an SSMax
        layer that is neither capped nor windowed)."""
        return tuple(
            self.ssmax and cap is None and window is None
            for cap, window in zip(self.ssmax_max_counts(), self.layer_windows(), strict=True)
        )

    def global_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its queries see every earlier key (no window)."""
        return tuple(window is None for window in self.layer_windows())

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: its attention window (rope_local's, or a local layer's), None for a
        global layer."""
        if self.window is not None:
            return (self.window,) * self.n_layers
        return tuple(
            self._window_size if i < self.local_layers else None for i in range(self.n_layers)
        )

    def attention_spec(self, layer: int = 0) -> AttentionSpec:
        """The attention spec of layer `layer`: causal, its window, the configured
        implementation and tiles, and the prior inside SSMax's scaling only for BAM (the
        SSMax baselines scale the content term; ALiBi's bias comes after)."""
        return AttentionSpec(
            causal=True,
            window=self.layer_windows()[layer],
            ssmax_prior_inside=self.ssmax_prior_inside and self.positional.learned_prior,
            implementation=self.attention_impl,
            block_q=self.block_q,
            block_k=self.block_k,
        )

    @classmethod
    def of_size(cls, size: str, **overrides: Any) -> ModelConfig:
        """A model of a named size: "l6", "l8", "l12", "l15", "l18", "l24" (paper) or "toy",
        "nano" (small), with `overrides` of any field."""
        if size in _PAPER_SIZES:
            dim, n_layers, n_heads = _PAPER_SIZES[size]
            fields: dict[str, Any] = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads}
        elif size in _SMALL_SIZES:
            fields = dict(_SMALL_SIZES[size])
        else:
            raise ValueError(f"model size must be one of {MODEL_SIZES}, got {size!r}")
        fields.update(overrides)
        return cls(**fields)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str = "model") -> ModelConfig:
        """The config of a mapping such as a run's config.json "model" section
        (`bam_jax.validation.dataclass_from_dict`: errors name the key path)."""
        return dataclass_from_dict(cls, d, path)


def dtype_name(dtype: Any) -> str:
    """The name in DTYPES of a compute dtype given as a name ("bfloat16") or a dtype object
    (`jnp.bfloat16`, `np.dtype("float32")`); a ValueError for any other."""
    name = dtype
    if not isinstance(dtype, str):
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = None
    if name not in DTYPES:
        raise ValueError(
            f"dtype must be one of {DTYPES} (a name or a dtype such as jnp.bfloat16), got {dtype!r}"
        )
    return name


def _check_init(name: str, value: Any, modes: tuple[str, ...], *, positive: bool) -> None:
    if isinstance(value, str):
        if value not in modes:
            raise ValueError(f"{name} must be one of {modes} or a number, got {value!r}")
        return
    if not is_float32_number(value):
        raise ValueError(f"{name} must be one of {modes} or a finite float32 number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive (it is exp(theta_alpha)), got {value!r}")


ATTENTION_FIELDS = (
    "prior_alpha_init",
    "prior_beta_init",
    "prior_mu_init",
    "train_prior_alpha",
    "train_prior_beta",
    "train_prior_mu",
    "prior_form",
    "train_ssmax_scale",
    "rope_theta",
    "dtype",
)


def attention_layer_config(
    dim: int, n_heads: int, *, encoding: str, n_kv_heads: int | None, **fields: Any
) -> ModelConfig:
    """The config of one attention layer on its own (`Attention.of_spec`), with its own
    prior; `fields` are any of ATTENTION_FIELDS, and a field of AttentionSpec is pointed to
    the spec."""
    unknown = sorted(set(fields) - set(ATTENTION_FIELDS))
    spec_fields = [name for name in unknown if name in AttentionSpec.__dataclass_fields__]
    if spec_fields:
        example = ", ".join(f"{name}={fields[name]!r}" for name in spec_fields)
        raise TypeError(
            f"Attention.of_spec got {spec_fields}, which are fields of the layer's "
            f"AttentionSpec: pass spec=bam_jax.AttentionSpec({example})"
        )
    if unknown:
        raise TypeError(
            f"Attention.of_spec got {unknown}, which an attention layer does not read; "
            f"it takes {list(ATTENTION_FIELDS)} (configure a whole model with ModelConfig)"
        )
    return ModelConfig(
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        n_layers=1,
        encoding=encoding,
        global_prior=False,
        **fields,
    )
