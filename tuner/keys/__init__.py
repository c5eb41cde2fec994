"""Static and run keys: pure functions, canonical and collision-free. No kernel library."""

from tuner.keys.call import (STATIC_FIELDS, UNKEYED, Untunable, host_flags, host_scalar, host_window,
                             static_key_from_tuple)
from tuner.keys.canonical import Config, canonical_json, count
from tuner.keys.run import (
    KV_BUCKET_MAX,
    AttentionRunKey,
    attention_run_key,
    kv_bucket_exponent,
    kv_bucket_low,
    kv_len_bucket,
    nearest_run_key,
    nearest_run_keys,
    run_key_distance,
    visible_kv_len,
)
from tuner.keys.static import AttentionStaticKey, attention_static_key, normalize_window, static_key_from_parts

__all__ = [
    "KV_BUCKET_MAX",
    "STATIC_FIELDS",
    "UNKEYED",
    "Untunable",
    "AttentionRunKey",
    "AttentionStaticKey",
    "Config",
    "attention_run_key",
    "attention_static_key",
    "canonical_json",
    "count",
    "host_flags",
    "host_scalar",
    "host_window",
    "kv_bucket_exponent",
    "kv_bucket_low",
    "kv_len_bucket",
    "nearest_run_key",
    "nearest_run_keys",
    "normalize_window",
    "run_key_distance",
    "static_key_from_parts",
    "static_key_from_tuple",
    "visible_kv_len",
]
