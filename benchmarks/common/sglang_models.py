"""The models sglang_e2e.py runs SGLang on: public config.json values (enough to build each
with dummy weights), a model folder with a tokenizer of a few words, and the share of a GPU's
memory SGLang's static memory (weights and KV cache) may take beside a worker's prefill."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

# public config.json values (Hugging Face), enough for SGLang to build the model with dummy weights
CONFIGS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": {
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
        "max_window_layers": 28, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "use_sliding_window": False, "vocab_size": 152064, "bos_token_id": 151643, "eos_token_id": 151645,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
# Qwen 2.5 7B past 32k, as its model card extends it (YaRN, factor 4): the card adds the
# rope_scaling below; SGLang takes a config with original_max_position_embeddings at its
# max_position_embeddings, so that is the scaled context here (the attention's shapes, 28/4
# heads, are Qwen 2.5 7B's)
CONFIGS["qwen2.5-7b-128k"] = dict(CONFIGS["qwen2.5-7b"], max_position_embeddings=131072, rope_scaling={
    "factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"})
# bench_one_batch prefills a whole batch in one forward: past this many tokens its activations
# alone (an 8B model's MLP) outgrow what the KV cache leaves, so a larger batch is prefilled in
# parts of whole requests (sglang_e2e.prefill_in_parts); one request is at most this long
MAX_PREFILL_TOKENS = 131072
# what SGLang's static memory (weights and KV cache) leaves the rest of a worker by default:
# PREFILL_MARGIN times prefill_activation_gb. Llama 3.1 8B (16.5 GiB by it): 0.85 of an H200's
# memory ran, 0.85 of an H100's ran out of memory in prefill, 0.7 ran; Qwen 2.5 7B (19.1 GiB):
# 0.75 of an H100's ran out of memory in prefill, 0.6 ran
PREFILL_MARGIN = 1.5


def _special(token_id: int, content: str) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def write_model_dir(model: str, path: Path, layers: int | None = None) -> Path:
    """config.json, and a tokenizer of a few words: bench_one_batch loads one whatever its
    flags, from tokenizer.json and tokenizer_config.json both, and feeds token ids it draws
    itself (below 10000), so the tokenizer never encodes a prompt."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIGS[model], **({"num_hidden_layers": layers} if layers else {}))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    specials = ["<unk>", "<s>", "</s>"]
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_special(i, t) for i, t in enumerate(specials)], "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(specials + ["a", "the"])},
                  "unk_token": "<unk>"}}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": CONFIGS[model]["max_position_embeddings"], "clean_up_tokenization_spaces": False}))
    return path


def prefill_activation_gb(config: dict) -> float:
    """GiB of the largest activations of a MAX_PREFILL_TOKENS prefill in bf16: the MLP's gate
    and up projections and their product (3 x intermediate), and a few hidden-size tensors."""
    per_token = 3 * config["intermediate_size"] + 6 * config["hidden_size"]
    return MAX_PREFILL_TOKENS * per_token * 2 / 2**30


def mem_fraction(total_gb: float | None, config: dict) -> float:
    """SGLang's --mem-fraction-static for a GPU of total_gb (GiB) and this model: all but
    PREFILL_MARGIN x its prefill's activations, at most 0.85 and at least 0.5 (0.85 where the
    size is not known)."""
    if not total_gb:
        return 0.85
    headroom = PREFILL_MARGIN * prefill_activation_gb(config)
    return round(min(0.85, max(0.5, 1 - headroom / total_gb)), 2)


def gpu_memory_gb() -> float | None:
    """The first GPU's memory, from nvidia-smi: the parent process never makes a CUDA
    context, which would take memory from its workers' GPU. None where it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return float(out.split()[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None
