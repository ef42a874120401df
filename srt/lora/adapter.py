"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors` (or `.bin`).

An adapter adds `scaling * B @ A` to some of the base model's linear weights, A: [r, in], B: [out, r],
scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Reading an adapter checks it against
the base model and the server's limits, so a bad folder is a clear error (the HTTP layer answers 400)
and never reaches the forward pass. B is returned with its scaling folded in.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

# Projections of a Llama-family decoder layer that an adapter may target, by PEFT's module name.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """A LoRA adapter or request the server cannot use (a client mistake: HTTP 400)."""


@dataclass(frozen=True)
class LoRARef:
    """An adapter as named to the server: --lora-paths entries and /load_lora_adapter bodies."""

    name: str
    path: str
    pinned: bool = False

    def to_json(self) -> dict:
        return {"lora_name": self.name, "lora_path": self.path, "pinned": self.pinned}


def not_loaded(what: str, names) -> str:
    """The message for a request naming an adapter the server does not have (HTTP 400)."""
    return f"{what} is not loaded (loaded adapters: {', '.join(sorted(names)) or 'none'})"


def parse_lora_paths(entries: list[str] | None) -> list[LoRARef]:
    """--lora-paths values: `PATH` (named after its folder), `NAME=PATH`, or a JSON object
    {"lora_name", "lora_path", "pinned"}."""
    refs: list[LoRARef] = []
    for entry in entries or []:
        entry = entry.strip()
        if entry.startswith("{"):
            try:
                obj = json.loads(entry)
            except json.JSONDecodeError as e:
                raise LoRAError(f"--lora-paths entry {entry!r} is not valid JSON: {e}") from None
            refs.append(lora_ref(obj, "--lora-paths entry"))
        elif "=" in entry:
            name, path = entry.split("=", 1)
            refs.append(lora_ref({"lora_name": name, "lora_path": path}, "--lora-paths entry"))
        else:
            path = entry.rstrip("/")
            refs.append(lora_ref({"lora_name": os.path.basename(path) or path, "lora_path": path}, "--lora-paths"))
    names = [r.name for r in refs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise LoRAError(f"--lora-paths names the adapter {dup!r} twice")
    return refs


def lora_ref(obj, where: str) -> LoRARef:
    """A checked {"lora_name", "lora_path", "pinned"} object."""
    if not isinstance(obj, dict):
        raise LoRAError(f"{where} must be an object with lora_name and lora_path")
    name, path, pinned = obj.get("lora_name"), obj.get("lora_path"), obj.get("pinned", False)
    if not isinstance(name, str) or not re.fullmatch(r"[\w.\-/]{1,128}", name):
        raise LoRAError(f"{where}: lora_name = {name!r} must be 1-128 letters, digits, '_', '-', '.' or '/' (no ':')")
    if not isinstance(path, str) or not path:
        raise LoRAError(f"{where}: lora_path = {path!r} must be the path of an adapter folder")
    if not isinstance(pinned, bool):
        raise LoRAError(f"{where}: pinned = {pinned!r} must be a boolean")
    return LoRARef(name, path, pinned)


@dataclass(frozen=True)
class BaseShape:
    """What an adapter is checked against: the base model's projection sizes (full, unsharded)."""

    num_layers: int
    in_out: dict[str, tuple[int, int]]  # PEFT module name -> (in_features, out_features)

    @classmethod
    def from_hf_config(cls, config) -> BaseShape:
        hidden, inter = config.hidden_size, config.intermediate_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        in_out = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(config.num_hidden_layers, in_out)


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, module) -> (A [r, in], scaling * B [out, r]), float32 on the CPU."""

    path: str
    rank: int  # the largest rank of any of its modules
    modules: frozenset[str]  # PEFT module names it targets
    uid: str  # a hash of its files: KV computed under one adapter's weights is cached under this key
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def _pattern_value(pattern: dict | None, module_key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name it ends with."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_key):
            return value
    return default


def read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise LoRAError(f"lora_path {path!r} is not a folder (expected PEFT's adapter_config.json + weights)")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"lora_path {path!r} has no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_path} must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{cfg_path}: peft_type = {peft_type!r}; only LORA adapters are supported")
    for key, ok, what in (
        ("use_dora", lambda v: not v, "DoRA (use_dora) is not supported"),
        ("bias", lambda v: v in (None, "none"), "adapters that train biases (bias != 'none') are not supported"),
        ("modules_to_save", lambda v: not v, "modules_to_save (fully trained extra modules) is not supported"),
        ("fan_in_fan_out", lambda v: not v, "fan_in_fan_out (Conv1D-style weights) is not supported"),
    ):
        if not ok(cfg.get(key)):
            raise LoRAError(f"{cfg_path}: {key} = {cfg.get(key)!r}: {what}")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{cfg_path}: r = {r!r} must be a positive integer")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{cfg_path}: lora_alpha = {alpha!r} must be a number")
    return cfg


def _read_tensors(path: str) -> tuple[dict[str, torch.Tensor], bytes]:
    """The adapter's tensors and the bytes of its weight file (for the uid)."""
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load

        with open(st, "rb") as f:
            data = f.read()
        try:
            return load(data), data
        except Exception as e:  # a truncated or foreign file
            raise LoRAError(f"{st} is not a readable safetensors file: {e}") from None
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pt):
        with open(pt, "rb") as f:
            data = f.read()
        try:
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:
            raise LoRAError(f"{pt} is not a readable torch file: {e}") from None
        return tensors, data
    raise LoRAError(f"lora_path {path!r} has no adapter_model.safetensors (or adapter_model.bin)")


def load_adapter(
    path: str, base: BaseShape, max_rank: int | None = None, allowed: frozenset[str] | None = None
) -> LoRAAdapter:
    """Read and check an adapter folder: every tensor must be a LoRA A or B of a supported
    projection of an existing layer with the base model's sizes, ranks at most `max_rank`, modules
    within `allowed` (the server's --lora-target-modules)."""
    try:
        return _load_adapter(path, base, max_rank, allowed)
    except OSError as e:  # permissions, a file vanishing while read: the client's folder, not the server
        raise LoRAError(f"cannot read the adapter at {path!r}: {e}") from None


def _load_adapter(path: str, base: BaseShape, max_rank: int | None, allowed: frozenset[str] | None) -> LoRAAdapter:
    cfg = read_config(path)
    tensors, data = _read_tensors(path)
    cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
    uid = hashlib.sha256(cfg_bytes + data).hexdigest()[:16]
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(
                f"adapter tensor {key!r} in {path!r} is not a LoRA A/B weight of a decoder layer projection "
                f"(supported targets: {', '.join(TARGET_MODULES)})"
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise LoRAError(f"adapter {path!r} targets {module!r}; supported targets: {', '.join(TARGET_MODULES)}")
        if not 0 <= layer < base.num_layers:
            raise LoRAError(f"adapter tensor {key!r} is for layer {layer}; the base model has {base.num_layers} layers")
        parts.setdefault((layer, module), {})[ab] = tensor
    if not parts:
        raise LoRAError(f"adapter {path!r} holds no LoRA weights")
    use_rslora = bool(cfg.get("use_rslora", False))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {path!r}: layer {layer} {module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"].float(), ab["B"].float()
        n_in, n_out = base.in_out[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or b.shape[1] != r:
            raise LoRAError(
                f"adapter {path!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base "
                f"model needs A [r, {n_in}] and B [{n_out}, r] (was it trained on another base model?)"
            )
        if max_rank is not None and r > max_rank:
            raise LoRAError(
                f"adapter {path!r} has rank {r} (layer {layer} {module}), above this server's "
                f"--max-lora-rank {max_rank}"
            )
        if allowed is not None and module not in allowed:
            raise LoRAError(
                f"adapter {path!r} targets {module}, which this server's LoRA memory pool does not hold "
                f"(--lora-target-modules: {', '.join(sorted(allowed))})"
            )
        module_key = f"layers.{layer}.{module}"
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), module_key, cfg.get("lora_alpha", cfg["r"])))
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
        rank = max(rank, r)
    return LoRAAdapter(path, rank, frozenset(m for _, m in weights), uid, weights)


def adapter_rank_and_modules(path: str) -> tuple[int, frozenset[str]]:
    """An adapter's rank and targets from its config alone (sizing the pool at start-up)."""
    cfg = read_config(path)
    rank = max([cfg["r"], *(v for v in (cfg.get("rank_pattern") or {}).values() if isinstance(v, int))])
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # a regex, or PEFT's "all-linear"
        names = (
            set(TARGET_MODULES)
            if targets == "all-linear"
            else {m for m in TARGET_MODULES if re.search(targets, m) or re.search(targets, f"layers.0.self_attn.{m}")}
        )
    else:
        names = {t.rsplit(".", 1)[-1] for t in targets or TARGET_MODULES}
    return rank, frozenset(n for n in names if n in TARGET_MODULES)
