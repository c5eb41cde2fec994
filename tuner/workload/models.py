"""What a user serves, as attention head configurations: a built-in table of popular models,
a local Hugging Face config.json (read offline), or heads given by hand; each tensor-parallel
size's per-GPU heads; and a grid's shapes applied to them."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tuner.errors import TunerError
from tuner.jsonfile import read_json
from tuner.workload.shapes import DecodeShape

MAX_HEADS = 1024  # past any model's attention heads: a larger count is a typo or hostile input
MAX_HEAD_DIM = 512  # head dims are multiples of 16 up to this (each op's rules say which it runs)
MAX_WINDOW = 1 << 24
MAX_TP = 64


@dataclass(frozen=True)
class Attention:
    """One kind of attention layer of a model, for the whole model (all GPUs): its heads,
    head dim, sliding window (keys before the current one it sees, FA3's window_size[0]; -1:
    none), logit softcap (0: none) and whether it has attention sinks."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int = -1
    softcap: float = 0.0
    sinks: bool = False

    def per_gpu(self, tp: int) -> "Attention":
        """The heads one GPU holds at tensor-parallel size tp: q heads split evenly; kv heads
        split, or replicated one a GPU where tp exceeds them (as SGLang and vLLM do)."""
        if tp < 1 or tp > MAX_TP:
            raise TunerError(f"tp {tp}: a tensor-parallel size is 1-{MAX_TP}")
        kv = self.num_kv_heads
        problem = (f"does not divide the {self.num_q_heads} query heads" if self.num_q_heads % tp else
                   f"neither divides the {kv} kv heads nor is a multiple of them" if not self._splits(tp) else None)
        if problem:  # (a habit's --tp 1,2,4,8 meets a model with 28 heads: say what would do)
            fits = ", ".join(str(t) for t in range(1, MAX_TP + 1) if self._splits(t))
            raise TunerError(f"tp {tp} {problem} ({self.label()}); tp sizes that fit: {fits}")
        return dataclasses.replace(self, num_q_heads=self.num_q_heads // tp, num_kv_heads=max(1, kv // tp))

    def _splits(self, tp: int) -> bool:
        kv = self.num_kv_heads
        return not self.num_q_heads % tp and not (kv % tp if kv >= tp else tp % kv)

    def label(self) -> str:
        parts = [f"{self.num_q_heads}/{self.num_kv_heads} heads, dim {self.head_dim}"]
        if self.window_left >= 0:
            parts.append(f"window {self.window_left}")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        return ", ".join(parts)


def _sliding(window: int) -> int:
    return window - 1  # a window of W tokens sees the current key and W - 1 before it (SGLang, vLLM)


# Each model's attention layer kinds, from its config.json. Gemma 2/3 and gpt-oss interleave
# sliding-window layers with full ones: each kind is a static key of its own.
MODELS: dict[str, tuple[Attention, ...]] = {
    "llama-3.1-8b": (Attention(32, 8, 128),),
    "llama-3.1-70b": (Attention(64, 8, 128),),
    "llama-3.1-405b": (Attention(128, 8, 128),),
    "llama-3.2-1b": (Attention(32, 8, 64),),
    "llama-3.2-3b": (Attention(24, 8, 128),),
    "llama-3.3-70b": (Attention(64, 8, 128),),
    "qwen2.5-7b": (Attention(28, 4, 128),),
    "qwen2.5-14b": (Attention(40, 8, 128),),
    "qwen2.5-32b": (Attention(40, 8, 128),),
    "qwen2.5-72b": (Attention(64, 8, 128),),
    "qwen3-8b": (Attention(32, 8, 128),),
    "qwen3-14b": (Attention(40, 8, 128),),
    "qwen3-32b": (Attention(64, 8, 128),),
    "qwen3-30b-a3b": (Attention(32, 4, 128),),
    "qwen3-235b-a22b": (Attention(64, 4, 128),),
    "mistral-7b-v0.3": (Attention(32, 8, 128),),
    "mistral-nemo-12b": (Attention(32, 8, 128),),
    "mistral-small-24b": (Attention(32, 8, 128),),
    "gemma-2-9b": (Attention(16, 8, 256, softcap=50.0), Attention(16, 8, 256, _sliding(4096), 50.0)),
    "gemma-2-27b": (Attention(32, 16, 128, softcap=50.0), Attention(32, 16, 128, _sliding(4096), 50.0)),
    "gpt-oss-20b": (Attention(64, 8, 64, sinks=True), Attention(64, 8, 64, _sliding(128), sinks=True)),
    "gpt-oss-120b": (Attention(64, 8, 64, sinks=True), Attention(64, 8, 64, _sliding(128), sinks=True)),
}


def _model_key(name: str) -> str:
    return name.strip().lower().rsplit("/", 1)[-1].removesuffix("-instruct").removesuffix("-it")


def known_model(name: str) -> tuple[Attention, ...] | None:
    """A built-in model's attention kinds, by its name as on the Hub (an org prefix and an
    -Instruct or -it suffix are ignored, case too); None when it is not in the table."""
    return MODELS.get(_model_key(name))


def _is_head_dim(value: Any) -> bool:
    return type(value) is int and 16 <= value <= MAX_HEAD_DIM and value % 16 == 0


def _field(config: dict[str, Any], name: str, where: str, *, default: Any = None, low: int = 1,
           high: int = MAX_HEADS) -> int:
    value = config.get(name)
    value = default if value is None else value  # (null: the default, as Hugging Face reads it)
    if type(value) is not int or not low <= value <= high:
        shown = "missing" if name not in config and default is None else f"{value!r:.40}"
        raise TunerError(f"{where}: {name} must be an integer in [{low}, {high}], it is {shown}")
    return value


def _layer_kinds(config: dict[str, Any], where: str) -> tuple[bool, bool]:
    """(has full-attention layers, has sliding-window layers) of a config."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return True, False
    types = config.get("layer_types")
    if types is not None and not isinstance(types, list):  # (a string was read as all sliding)
        raise TunerError(f"{where}: layer_types must be a list of attention types, it is {types!r:.40}")
    if types:
        if not all(t in ("full_attention", "sliding_attention") for t in types):
            raise TunerError(f"{where}: layer_types holds an attention type tuner does not know")
        return "full_attention" in types, "sliding_attention" in types
    if config.get("max_window_layers") is not None:  # Qwen 2 and 3: the layers from that one on slide
        layers = _field(config, "num_hidden_layers", where, high=1 << 16)
        first = _field(config, "max_window_layers", where, low=0, high=1 << 16)
        return first > 0, first < layers
    interleaved = config.get("model_type") in ("gemma2", "gemma3", "gemma3_text", "gpt_oss", "cohere2")
    return interleaved, True


def attention_from_config(config: Any, where: str) -> tuple[Attention, ...]:
    """A Hugging Face config's attention layer kinds (its text model's, for a multimodal one)."""
    if not isinstance(config, dict):
        raise TunerError(f"{where}: a model config is a JSON object")
    if isinstance(config.get("text_config"), dict):
        config = {"model_type": config.get("model_type"), **config["text_config"]}
    if "kv_lora_rank" in config:
        raise TunerError(f"{where}: multi-head latent attention (DeepSeek's MLA) is not a decode tuner sweeps")
    heads = _field(config, "num_attention_heads", where)
    kv_heads = _field(config, "num_key_value_heads", where, default=heads, high=heads)
    if heads % kv_heads:
        raise TunerError(f"{where}: {kv_heads} kv heads do not divide {heads} query heads")
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _field(config, "hidden_size", where, high=1 << 20)
        if hidden % heads:
            raise TunerError(f"{where}: hidden_size {hidden} is not a multiple of {heads} heads, and no head_dim "
                             "says the head size")
        head_dim = hidden // heads
    if not _is_head_dim(head_dim):
        raise TunerError(f"{where}: head_dim {head_dim!r:.40} is not a multiple of 16 in [16, {MAX_HEAD_DIM}]")
    softcap = config.get("attn_logit_softcapping") or 0.0
    if type(softcap) not in (int, float) or not 0 <= softcap <= 1e4:
        raise TunerError(f"{where}: attn_logit_softcapping must be a number in [0, 10000], it is {softcap!r:.40}")
    base = Attention(heads, kv_heads, head_dim, softcap=float(softcap), sinks=config.get("model_type") == "gpt_oss")
    full, sliding = _layer_kinds(config, where)
    kinds = [base] if full else []
    if sliding:
        window = _field(config, "sliding_window", where, high=MAX_WINDOW)
        kinds.append(dataclasses.replace(base, window_left=_sliding(window)))
    return tuple(kinds)


def model_attention(model: str) -> tuple[Attention, ...]:
    """--model: a path to a Hugging Face config.json (or the directory holding one), read
    offline, or a built-in model's name. A path that exists wins: a fine-tuned model's
    directory may carry its base model's name."""
    if not model.strip():  # (an unset $MODEL: Path("") is the current directory)
        raise TunerError("--model is empty: give a config.json path or one of: " + ", ".join(MODELS))
    path = Path(model).expanduser()  # (--model=~/m: the shell leaves a ~ after = as it is)
    known = None if path.exists() else known_model(model)
    if known is not None:
        return known
    if not path.exists() and (model.endswith(".json") or model.startswith(("/", ".", "~"))):
        raise TunerError(f"--model {model!r:.80}: no such file or directory")
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise TunerError(f"--model {model!r:.80}: the directory holds no config.json")
    elif path.exists() and not path.is_file():
        raise TunerError(f"--model {model!r:.80}: not a regular file (give a config.json)")
    if not path.is_file():
        raise TunerError(f"unknown model {model!r:.80}: give a config.json path or one of: {', '.join(MODELS)}")
    return attention_from_config(read_json(path, what="model config"), str(path))


_HEADS = re.compile(r"(\d+)/(\d+)")


def attention_from_flags(heads: str, head_dim: int, window: int | None = None, softcap: float | None = None,
                         sinks: bool = False) -> Attention:
    """--heads Q/KV --head-dim D [--window W] [--softcap C] [--sinks]."""
    match = _HEADS.fullmatch(heads.strip())
    if not match:
        raise TunerError(f"--heads {heads!r:.40}: give query/kv heads, as 32/8")
    q, kv = (int(n) if len(n) <= 9 else MAX_HEADS + 1 for n in (match[1], match[2]))  # (huge: out of range)
    if not 1 <= kv <= q <= MAX_HEADS or q % kv:
        raise TunerError(f"--heads {heads:.40}: kv heads must divide query heads, both 1-{MAX_HEADS}")
    if not _is_head_dim(head_dim):
        raise TunerError(f"--head-dim {head_dim} is not a multiple of 16 in [16, {MAX_HEAD_DIM}]")
    if window is not None and not 1 <= window <= MAX_WINDOW:
        raise TunerError(f"--window {window}: a sliding window is 1-{MAX_WINDOW} tokens")
    if softcap is not None and not 0 < softcap <= 1e4:
        raise TunerError(f"--softcap {softcap:g}: a logit softcap is in (0, 10000]")
    return Attention(q, kv, head_dim, -1 if window is None else _sliding(window), float(softcap or 0.0), sinks)


def parse_tp(text: str) -> tuple[int, ...]:
    """--tp 1,2,4,8 -> (1, 2, 4, 8)."""
    try:
        sizes = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        raise TunerError(f"--tp {text!r:.40}: give tensor-parallel sizes, as 1,2,4,8") from None
    if not sizes or any(not 1 <= tp <= MAX_TP for tp in sizes):
        raise TunerError(f"--tp {text!r:.40}: each tensor-parallel size is 1-{MAX_TP}")
    return sizes


def per_gpu_heads(kinds: Sequence[Attention], tp_sizes: Sequence[int]) -> list[Attention]:
    """Each kind at each tp, as one GPU holds it; kinds that coincide are kept once."""
    return list(dict.fromkeys(kind.per_gpu(tp) for tp in tp_sizes for kind in kinds))


def apply_heads(shapes: Sequence[DecodeShape], heads: Sequence[Attention], *, dtype: str | None = None,
                page_size: int | None = None) -> list[DecodeShape]:
    """A grid's shapes (batch, lengths) for each head configuration, replacing the grid's own."""
    out = []
    for attention in heads:
        for shape in shapes:
            out.append(dataclasses.replace(
                shape, num_q_heads=attention.num_q_heads, num_kv_heads=attention.num_kv_heads,
                head_dim=attention.head_dim, window=(attention.window_left, 0) if attention.window_left >= 0 else (-1, -1),
                softcap=attention.softcap, sinks=attention.sinks,
                dtype=dtype or shape.dtype, page_size=page_size or shape.page_size))
    return list(dict.fromkeys(out))
