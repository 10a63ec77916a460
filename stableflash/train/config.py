"""Training configuration: nested frozen dataclasses, TOML presets, `--set key=value` overrides.

A config is data: `TrainConfig{model, attention, optim, data, monitor, run}`; each
section validates itself in `__post_init__`; the resolved config is written into
every run folder as `config.toml` and is what `--resume` reads back.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from stableflash.attention.precision import Precision
    from stableflash.model.gpt import LayerAttention

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"  # package data: a wheel install has the presets


@dataclass(frozen=True)
class ModelConfig:
    """GPT-2 shape and architecture options."""

    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Width; head size is n_embd / n_head."""
    block_size: int = 128
    """Context length T."""
    vocab_size: int = 256
    """Token vocabulary (256 for the byte-level embedded corpus, 50304 for GPT-2 BPE)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as GPT-2 (the analysed code trains without: false)."""
    gelu: str = "tanh"
    """tanh (GPT-2's approximation) | exact (nn.GELU's default, as the analysed code uses)."""
    qk_norm: bool = False
    """LayerNorm on each head's q and k before the scores."""
    qk_clip: float = 0.0
    """> 0: after each step rescale W_q, W_k of heads whose max logit exceeded this (Kimi's QK-clip)."""
    gated_attention: bool = False
    """Sigmoid output gate per head on the attention output (Qwen's gated attention)."""

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}: expected >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd: {self.n_embd} is not divisible by model.n_head = {self.n_head}")
        if self.qk_clip < 0:
            raise ValueError(f"model.qk_clip: expected >= 0, got {self.qk_clip}")
        if self.gelu not in ("tanh", "exact"):
            raise ValueError(f"model.gelu: expected 'tanh' or 'exact', got {self.gelu!r}")


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention each layer and head uses.

    `layers` maps a layer index (as a string in TOML) to an override table with
    the same keys; `heads` is a list of head indices computed with `head_precision`.
    Example: every layer SDPA, layer 2 `paper`, heads 1,7,8 of layer 2 in fp32:
        backend = "sdpa"
        [attention.layers.2]
        backend = "reference"
        precision = "paper"
        heads = [1, 7, 8]
        head_precision = "fp32"
    """

    backend: str = "auto"
    """reference | triton | sdpa | math | auto."""
    precision: str = "fa2"
    """A preset name (fa2, bf16, paper, fp32, fp64)."""
    stabilize: str = "none"
    """none | sfa (`SFA()`, the bounded rule) | sfa-official (`SFA.official()`, the paper's code's rule) |
    sfa-unbounded (`SFA(bounded=False)`, the rule as written) | clamp (`ClampPbar()`)."""
    sfa_beta: float = 2.0
    sfa_eps: float = 1e-3
    tiling: bool = True
    """False: one tile (the seed's tiling-off experiment)."""
    delta: str = "do_o"
    """do_o | dp_p | do_o_recomputed."""
    pv_fp32: bool = False
    o_fp32: bool = False
    forward_precision: str = ""
    """A preset whose formats the forward's sites take ("": `precision`'s); isolates the passes."""
    backward_precision: str = ""
    """A preset whose formats the backward's sites take ("": `precision`'s)."""
    rounding: str = "nearest"
    """nearest | toward_zero | up | down | stochastic: the rounding mode of `rounding_sites` (all sites when empty)."""
    rounding_sites: tuple[str, ...] = ()
    """The sites `rounding` applies to, e.g. ["pbar_operand", "pv", "acc_scaled", "acc"] (P̄V's path); the others
    round to nearest."""
    sites: dict = field(default_factory=dict)
    """Site formats set by hand, applied last: {"qk": "fp32", "scores": "fp32"} (`--set attention.sites.qk=fp32`)."""
    heads: tuple[int, ...] = ()
    """Head indices computed with `head_precision`."""
    head_precision: str = "fp32"
    layers: dict = field(default_factory=dict)
    """Per-layer overrides: {"2": {"precision": "paper", ...}}."""

    def __post_init__(self):
        from stableflash.attention.api import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"attention.backend: expected one of {BACKENDS}, got {self.backend!r}")
        object.__setattr__(self, "heads", tuple(int(h) for h in self.heads))
        object.__setattr__(self, "rounding_sites", tuple(self.rounding_sites))
        normalized = {str(k): {**t, **({"heads": tuple(int(h) for h in t["heads"])} if "heads" in t else {})}
                      for k, t in self.layers.items()}
        object.__setattr__(self, "layers", normalized)
        valid = {f.name for f in dataclasses.fields(self)} - {"layers"}
        for layer, table in self.layers.items():
            if not str(layer).isdigit():
                raise ValueError(f"attention.layers: keys are layer indices, got {layer!r}")
            unknown = set(table) - valid
            if unknown:
                raise ValueError(f"attention.layers.{layer}: unknown keys {sorted(unknown)}; valid: {sorted(valid)}")

        self.layer_attention(None)  # the policy and stabilizer, validated where they are built
        for layer in self.layers:
            self.for_layer(int(layer))

    def policy(self) -> Precision:
        """The policy this config describes: a preset, its table of sites, then the knobs that change a part of it
        whatever the table says (`pv_fp32`, `o_fp32`, one pass in another preset: the isolation's experiments on any
        run), then the rounding mode and the per-head override. Validated here, once; a ValueError names the
        config's field (`attention.precision`, `attention.sites.qk`, ...)."""
        from stableflash.attention.precision import DELTA_FORMULAS, PRESETS, SITES
        from stableflash.numerics.formats import get_format
        from stableflash.numerics.rounding import ROUNDING_MODES

        cfg = self

        def preset(name: str, value: str) -> Precision:
            if value not in PRESETS:
                either = "'' or " if name.endswith("_precision") and name != "head_precision" else ""
                raise ValueError(f"attention.{name}: expected {either}one of {sorted(PRESETS)}, got {value!r}")
            return PRESETS[value]

        policy = preset("precision", cfg.precision)
        if not cfg.tiling:
            policy = policy.tiling_off()
        if cfg.delta != "do_o":
            if cfg.delta not in DELTA_FORMULAS:
                raise ValueError(f"attention.delta: expected one of {DELTA_FORMULAS}, got {cfg.delta!r}")
            policy = policy.with_delta(cfg.delta)
        if cfg.sites:
            if not isinstance(cfg.sites, dict):
                raise ValueError(f"attention.sites: expected a table of site = format, got {cfg.sites!r}")
            for site, fmt in cfg.sites.items():
                if site not in SITES:
                    raise ValueError(f"attention.sites: unknown site {site!r}; sites: {list(SITES)}")
                try:
                    if fmt != "input":
                        get_format(fmt)
                except ValueError:
                    raise ValueError(f"attention.sites.{site}: expected 'input' or a format name like 'fp32', "
                                     f"got {fmt!r}") from None
            policy = policy.with_sites(**cfg.sites)
        if cfg.pv_fp32:
            policy = policy.with_pv_fp32()
        if cfg.o_fp32:
            policy = policy.with_o_fp32()
        for which in ("forward", "backward"):
            other = getattr(cfg, f"{which}_precision")
            if other:
                policy = policy.with_pass_of(which, preset(f"{which}_precision", other))
        if cfg.rounding != "nearest" or cfg.rounding_sites:
            if cfg.rounding not in ROUNDING_MODES:
                raise ValueError(f"attention.rounding: expected one of {ROUNDING_MODES}, got {cfg.rounding!r}")
            unknown = sorted(set(cfg.rounding_sites) - set(SITES))
            if unknown:
                raise ValueError(f"attention.rounding_sites: unknown sites {unknown}; sites: {list(SITES)}")
            policy = policy.with_rounding(cfg.rounding, cfg.rounding_sites)
        head_policy = preset("head_precision", cfg.head_precision)
        if cfg.heads:
            policy = policy.with_heads(set(cfg.heads), head_policy)
        return policy

    def stabilizer(self):
        """The stabilizer `stabilize` names (`stabilize.STABILIZERS`), with `sfa_beta` and `sfa_eps`."""
        from stableflash.attention.stabilize import SFA, STABILIZERS, ClampPbar

        if self.stabilize not in STABILIZERS:
            raise ValueError(f"attention.stabilize: expected one of {'|'.join(STABILIZERS)}, got {self.stabilize!r}")
        return {
            "none": lambda: None,
            "sfa": lambda: SFA(beta=self.sfa_beta, eps=self.sfa_eps),
            "sfa-official": lambda: SFA.official(beta=self.sfa_beta, eps=self.sfa_eps),
            "sfa-unbounded": lambda: SFA(beta=self.sfa_beta, eps=self.sfa_eps, bounded=False),
            "clamp": lambda: ClampPbar(eps=self.sfa_eps),
        }[self.stabilize]()

    def for_layer(self, layer: int) -> AttentionConfig:
        """This config with layer `layer`'s overrides applied (and no per-layer table); validated."""
        table = self.layers.get(str(layer), {})
        return dataclasses.replace(self, layers={}, **table)

    def layer_attention(self, layer: int | None) -> LayerAttention:
        """What layer `layer` (None: a layer without overrides) calls `flash_attention` with."""
        from stableflash.attention.precision import PRESETS
        from stableflash.model.gpt import LayerAttention

        cfg = self if layer is None else self.for_layer(layer)
        policy, stabilize = cfg.policy(), cfg.stabilizer()
        if cfg.backend in ("sdpa", "math") and (stabilize is not None or policy != PRESETS["fa2"]):
            raise ValueError(f"attention: backend {cfg.backend!r} has fixed numerics; precision/stabilize/knobs need "
                             "backend 'reference', 'triton' or 'auto'")
        return LayerAttention(cfg.backend, policy, stabilize)

    def resolve(self, n_layer: int) -> list[LayerAttention]:
        """Every layer's attention, for `GPT`."""
        return [self.layer_attention(i) for i in range(n_layer)]


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule. `max_steps` (in RunConfig) only says where to stop."""

    name: str = "adamw"
    """adamw | muon (Muon on 2-D hidden weights, AdamW on the rest)."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-5
    warmup_steps: int = 10
    decay_steps: int = 1000
    """Length of the cosine decay (ends at min_lr), independent of where the run stops."""
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    muon_lr: float = 0.02
    muon_momentum: float = 0.95

    def __post_init__(self):
        if self.name not in ("adamw", "muon"):
            raise ValueError(f"optim.name: expected adamw or muon, got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"optim.lr: expected > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.decay_steps < 1:
            raise ValueError("optim.warmup_steps must be >= 0 and optim.decay_steps >= 1")


@dataclass(frozen=True)
class DataConfig:
    """Token memmaps and batch shape."""

    dataset: str = "shakespeare-char"
    """Folder name under data_dir holding train.bin / val.bin / meta.json."""
    data_dir: str = "data"
    batch_size: int = 8
    """Sequences per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per step per process."""

    def __post_init__(self):
        if self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("data.batch_size and data.grad_accum must be >= 1")


@dataclass(frozen=True)
class MonitorConfig:
    """The cheap per-N-steps monitor and the early-warning rule."""

    interval: int = 10
    """Steps between monitor passes (spectral norms, attention stats); 0 disables."""
    power_iters: int = 4
    """Power-iteration steps per spectral norm (vectors persist across passes)."""
    warn_factor: float = 3.0
    """Warn when a head's repeated-max rows exceed this multiple of their running median."""
    warn_min_fraction: float = 0.05
    """...and at least this fraction of its rows."""
    spike_factor: float = 3.0
    """Stop when the loss exceeds this multiple of its running median (after warm-up)."""
    grad_warn_factor: float = 10.0
    """Warn when the gradient norm exceeds this multiple of its running median, or is not finite."""
    logit_warn_factor: float = 3.0
    """Warn when a head's largest attention logit exceeds this multiple of its running median..."""
    logit_warn_min: float = 200.0
    """...and this value (logit growth: the failure QK-norm and QK-clip address)."""
    score_ulp_warn: float = 4.0
    """Warn when a layer rounds its scores (QKᵀ or S) to a 16-bit format and a head's largest score sits where
    that format's values are this far apart (bf16: 4 at |s| >= 512): the rounding of S then moves softmax weights
    by e^4 and merges distinct scores into ties (RESULTS.md: the gradient explosions of the bf16 regime). 0: off."""
    action: str = "none"
    """On a warning: none | sfa | fp32 (switch that layer) | rollback."""

    def __post_init__(self):
        if self.action not in ("none", "sfa", "fp32", "rollback"):
            raise ValueError(f"monitor.action: expected none|sfa|fp32|rollback, got {self.action!r}")


@dataclass(frozen=True)
class RunConfig:
    """Where to stop, how often to evaluate and checkpoint, numerics of the loop."""

    max_steps: int = 100
    seed: int = 1337
    dtype: str = "bf16"
    """Autocast dtype of the forward: bf16 | fp32 (no autocast)."""
    device: str = "auto"
    """auto | cpu | cuda."""
    eval_interval: int = 50
    eval_batches: int = 4
    checkpoint_interval: int = 50
    keep_previous_checkpoint: bool = False
    """Also keep the checkpoint before the latest (`checkpoint-previous.pt`): after a stop on a diverging loss,
    the state before the divergence, for its diagnosis."""
    keep_interval_checkpoints: bool = False
    """Also keep every interval's checkpoint as `checkpoint-STEP.pt` (STEP zero-padded to 6 digits): a run that
    trains on past a divergence still has the state just before it."""
    log_interval: int = 1
    deterministic: bool = True
    """torch.use_deterministic_algorithms and a fixed CPU thread count (bit-identical reruns on CPU, on any
    machine; on GPU as far as torch allows)."""
    threads: int = 0
    """CPU threads for torch; 0: 1 under `deterministic` (CPU sums depend on the thread count), else half the
    cores, at most 4 (torch's default, every core, ran 9x slower on a busy 2-core machine)."""
    compile: bool = False
    time_limit_s: float = 0.0
    """> 0: stop with a checkpoint after this many seconds of training (every rank at the same step), to continue
    with `--resume` in a later call; 0: no limit."""
    ddp_bucket_mb: float = 25.0
    """DDP's gradient bucket size (torch's default 25); under torch.compile each bucket splits the graph."""
    tensorboard: bool = False
    """Write the metrics and the monitor's signals to TensorBoard (`tb/` in the run folder)."""
    wandb: bool = False
    """Send them to the Weights & Biases run in progress (started by the caller's `wandb.init`)."""
    progress: bool = True

    def __post_init__(self):
        if self.max_steps < 0:
            raise ValueError(f"run.max_steps: expected >= 0, got {self.max_steps}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"run.dtype: expected bf16 or fp32, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"run.device: expected auto, cpu or cuda, got {self.device!r}")
        if self.time_limit_s < 0:
            raise ValueError(f"run.time_limit_s: expected >= 0 (0: no limit), got {self.time_limit_s}")
        if not self.ddp_bucket_mb > 0:
            raise ValueError(f"run.ddp_bucket_mb: expected a positive size in MB, got {self.ddp_bucket_mb}")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        # what one section cannot check alone: the attention tables against the model's layers and heads
        n_layer, n_head = self.model.n_layer, self.model.n_head
        for layer, table in self.attention.layers.items():
            if int(layer) >= n_layer:
                raise ValueError(f"attention.layers.{layer}: the model has {n_layer} layers (0..{n_layer - 1})")
            bad = [h for h in table.get("heads", ()) if h >= n_head]
            if bad:
                raise ValueError(f"attention.layers.{layer}.heads: {bad} outside the model's {n_head} heads")
        bad = [h for h in self.attention.heads if h >= n_head]
        if bad:
            raise ValueError(f"attention.heads: {bad} outside the model's {n_head} heads (0..{n_head - 1})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return to_toml(self.to_dict())


SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
_SECTION_CLASSES = {"model": ModelConfig, "attention": AttentionConfig, "optim": OptimConfig, "data": DataConfig,
                    "monitor": MonitorConfig, "run": RunConfig}


def valid_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)]


def unknown_key(key: str) -> str:
    """What to say of an unknown key: the closest valid ones, not all of them."""
    name = key.rsplit(".", 1)[-1]
    initials = "".join(word[:1] for word in name.split("_"))  # learning_rate -> lr
    close = [k for k in valid_keys() if k.rsplit(".", 1)[-1] == initials and k.split(".")[0] == key.split(".")[0]]
    close += [k for k in difflib.get_close_matches(key, valid_keys(), n=3, cutoff=0.6) if k not in close]
    if not close:  # a right key in the wrong section, or a typo of the key alone
        names = {k.split(".", 1)[1]: k for k in valid_keys()}
        close = [names[n] for n in difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)]
    close = close[:3]
    hint = f"did you mean {' or '.join(close)}?" if close else "`stableflash train --help` and configs/ show the keys"
    return f"unknown key {key!r}; {hint}"


def _check_types(section: str, cls, table: dict) -> None:
    """A scalar of the wrong type names its key: `n_layer = "two"` fails here, not deep in a comparison."""
    hints = typing.get_type_hints(cls)
    for key, value in table.items():
        kind = hints[key]
        expected = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}.get(kind)
        if expected is None:
            continue
        if not isinstance(value, expected) or (kind in (int, float) and isinstance(value, bool)):
            raise ValueError(f"config: {section}.{key}: expected {kind.__name__}, got {value!r}")


def from_dict(data: dict) -> TrainConfig:
    """Build a config, rejecting unknown sections and keys with the list of valid ones."""
    unknown = set(data) - set(_SECTION_CLASSES)
    if unknown:
        raise ValueError(f"config: unknown sections {sorted(unknown)}; valid: {sorted(_SECTION_CLASSES)}")
    sections = {}
    for name, cls in _SECTION_CLASSES.items():
        table = dict(data.get(name, {}))
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(table) - names)
        if bad:
            raise ValueError("config: " + "; ".join(unknown_key(f"{name}.{k}") for k in bad))
        _check_types(name, cls, table)
        if "heads" in table:
            table["heads"] = tuple(table["heads"])
        sections[name] = cls(**table)
    return TrainConfig(**sections)


def _coerce(text: str, kind):
    """Parse a --set value by the field's type."""
    origin = typing.get_origin(kind)
    if kind is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"expected a bool, got {text!r}")
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    if origin is tuple or kind is tuple:
        item = int if typing.get_args(kind)[:1] == (int,) else str
        items = [x.strip().strip("'\"") for x in text.replace("[", "").replace("]", "").split(",")]
        return tuple(item(x) for x in items if x)
    if kind is dict or origin is dict:
        return json.loads(text)
    return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` (or `attention.layers.2.precision=paper`) strings to a config dict."""
    data = json.loads(json.dumps(data))  # deep copy
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set: expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) == 1:  # a bare key is accepted when exactly one section has it
            owners = [name for name, cls in _SECTION_CLASSES.items()
                      if parts[0] in {f.name for f in dataclasses.fields(cls)}]
            if len(owners) == 1:
                parts = [owners[0], parts[0]]
        if parts[0] == "attention" and len(parts) == 3 and parts[1] == "sites":
            data.setdefault("attention", {}).setdefault("sites", {})[parts[2]] = value.strip()
            continue
        if parts[0] == "attention" and len(parts) >= 4 and parts[1] == "layers":
            layer, sub = parts[2], parts[3]
            ann = typing.get_type_hints(AttentionConfig).get(sub)
            if ann is None:
                raise ValueError(f"--set {key}: {unknown_key(f'attention.{sub}')}")
            try:
                data.setdefault("attention", {}).setdefault("layers", {}).setdefault(layer, {})[sub] = _coerce(value, ann)
            except ValueError as error:
                raise ValueError(f"--set {key}: {error}") from None
            continue
        if len(parts) != 2 or parts[0] not in _SECTION_CLASSES:
            raise ValueError(f"--set {key}: {unknown_key('.'.join(parts))}")
        fields_ = typing.get_type_hints(_SECTION_CLASSES[parts[0]])
        if parts[1] not in fields_:
            raise ValueError(f"--set {key}: {unknown_key('.'.join(parts))}")
        try:
            data.setdefault(parts[0], {})[parts[1]] = _coerce(value, fields_[parts[1]])
        except ValueError as error:
            raise ValueError(f"--set {key}: {error}") from None
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """A config from a TOML file (a path, or a preset name in configs/) plus overrides."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.exists() and (CONFIG_DIR / f"{path}.toml").exists():
            path = CONFIG_DIR / f"{path}.toml"
        if not path.exists():
            presets = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
            raise FileNotFoundError(f"--config: no file {path}; presets: {presets}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"--config: {path} is not valid TOML: {error}") from None
    data = apply_overrides(data, list(overrides))
    try:
        return from_dict(data)
    except ValueError as error:
        raise ValueError(f"{path}: {error}" if path is not None else str(error)) from None


def to_toml(data: dict, prefix: str = "") -> str:
    """Minimal TOML writer for config dicts (scalars, lists, nested tables)."""
    scalars, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            scalars.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(scalars)
    for key, value in tables:
        name = f"{prefix}.{key}" if prefix else key
        body = to_toml(value, name)
        out += f"\n\n[{name}]\n{body}" if not all(isinstance(v, dict) for v in value.values()) or not value else f"\n{body}"
    return out.strip() + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))
