"""The bytes one decode step of a dense decoder must read from HBM (its weights once, every
sequence's KV cache once), and the time that takes at the card's nominal bandwidth: a floor no
backend's step can beat. A backend's step time over it says how far the step is from the card,
and the attention's share of it how much an attention kernel can move the step at all."""

from __future__ import annotations

# nominal HBM bandwidth by the name torch gives the card (a substring of it)
NOMINAL_HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12}
BYTES_PER_VALUE = 2  # bf16 weights and KV cache


def nominal_bandwidth(device_name: str) -> float | None:
    """The card's nominal HBM bytes per second, or None for a card not in the table."""
    return next((bw for name, bw in NOMINAL_HBM_BYTES_PER_S.items() if name in device_name), None)


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def weight_bytes(config: dict) -> int:
    """The matrices a decode step reads: each layer's q, k, v, o and its gated MLP, and the LM
    head (the embedding table gives only the batch's rows; norms and biases are left out)."""
    hidden, q_heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads, dim = config["num_key_value_heads"], _head_dim(config)
    attention = 2 * hidden * q_heads * dim + 2 * hidden * kv_heads * dim
    mlp = 3 * hidden * config["intermediate_size"]
    layers = config["num_hidden_layers"] * (attention + mlp)
    return (layers + config["vocab_size"] * hidden) * BYTES_PER_VALUE


def kv_bytes(config: dict, kv_lens: list[int]) -> int:
    """Every layer's K and V of every sequence's kv_lens keys."""
    per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * _head_dim(config) * 2
    return sum(kv_lens) * per_token * BYTES_PER_VALUE


def step_floor(config: dict, kv_lens: list[int], device_name: str, ranks: int = 1) -> dict | None:
    """A decode step's bytes on each of `ranks` tensor-parallel GPUs (each reads its share of
    the heads and of the MLP) and its floor in ms at the card's nominal bandwidth (None for a
    card not in NOMINAL_HBM_BYTES_PER_S); attention_share: the KV cache's share of the bytes."""
    bandwidth = nominal_bandwidth(device_name)
    if bandwidth is None:
        return None
    weights, kv = weight_bytes(config) / ranks, kv_bytes(config, kv_lens) / ranks
    return dict(weight_gb=weights / 1e9, kv_gb=kv / 1e9, attention_share=kv / (weights + kv),
                hbm_tb_per_s=bandwidth / 1e12, floor_ms=(weights + kv) / bandwidth * 1e3)
