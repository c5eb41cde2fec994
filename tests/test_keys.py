import json
import random

import pytest
import torch

from tuner.keys import (
    AttentionRunKey,
    AttentionStaticKey,
    attention_run_key,
    attention_static_key,
    canonical_json,
    kv_bucket_exponent,
    kv_bucket_low,
    kv_len_bucket,
    nearest_run_key,
)

# kv lengths to hold the bucket spellings to: the edges (0, 1, 2, each power of two and
# either side of it, up to 2**20) and a sample of 1..2**20
KV_LENGTHS = sorted({0, 1, 2} | {2**k + d for k in range(1, 21) for d in (-1, 0, 1)}
                    | set(random.Random(0).sample(range(1, 2**20 + 1), 300)))


def tensors(q_heads=32, kv_heads=8, d=128, page=1, dtype=torch.bfloat16, dv=None):
    q = torch.empty(4, 1, q_heads, d, dtype=dtype)
    k = torch.empty(10, page, kv_heads, d, dtype=dtype)
    v = torch.empty(10, page, kv_heads, dv or d, dtype=dtype)
    return q, k, v


def key(**kw):
    args = {k: kw.pop(k) for k in list(kw) if k in ("q_heads", "kv_heads", "d", "page", "dtype", "dv")}
    kw.setdefault("causal", True)
    return attention_static_key(*tensors(**args), **kw)


def test_static_key_reads_shapes_and_dtypes():
    k = key(q_heads=32, kv_heads=8, d=128, page=16, dv=64)
    assert (k.num_q_heads, k.num_kv_heads, k.head_dim_qk, k.head_dim_v, k.page_size) == (32, 8, 128, 64, 16)
    assert k.q_dtype == k.k_dtype == "bfloat16"
    assert (k.window_left, k.window_right) == (-1, -1)
    assert not (k.softcap or k.sinks or k.k_descale or k.v_descale)


@pytest.mark.parametrize(
    "window, expected",
    [(None, (-1, -1)), (128, (128, 128)), ((64, 0), (64, 0)), ([64, 0], (64, 0)), ((-1, 5), (-1, 5))],
)
def test_window_forms_normalise(window, expected):
    k = key(window_size=window)
    assert (k.window_left, k.window_right) == expected


def test_equivalent_window_forms_give_equal_keys_and_json():
    a, b, c = key(window_size=None), key(window_size=(-1, -1)), key(window_size=[-1, -1])
    assert a == b == c and hash(a) == hash(b)
    assert a.to_json() == b.to_json() == c.to_json()


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"window_size": "128"}, "window_size"),
        ({"window_size": (1, 2, 3)}, "window_size"),
        ({"window_size": (1.5, 2)}, "window_size"),
        ({"window_size": -2}, "window_size"),
        ({"window_size": True}, "window_size"),
        ({"softcap": "30"}, "softcap"),
        ({"softcap": -1.0}, "softcap"),
        ({"softcap": float("nan")}, "softcap"),
        ({"causal": 1}, "causal"),
    ],
)
def test_bad_values_raise_value_error_naming_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        key(**kwargs)


def test_bad_tensor_shapes_raise():
    q, k, v = tensors()
    with pytest.raises(ValueError, match="k_cache"):
        attention_static_key(q, k[0], v, causal=True)
    with pytest.raises(ValueError, match="multiple"):
        attention_static_key(*tensors(q_heads=6, kv_heads=4), causal=True)
    with pytest.raises(ValueError, match="q"):
        attention_static_key("q", k, v, causal=True)


def test_softcap_none_and_zero_are_off_any_positive_is_on():
    assert not key(softcap=None).softcap and not key(softcap=0.0).softcap and not key(softcap=0).softcap
    assert key(softcap=30.0).softcap and key(softcap=50).softcap


def test_every_kernel_selecting_field_changes_the_key():
    base = key()
    variants = [
        key(dtype=torch.float16), key(q_heads=64), key(kv_heads=4), key(d=64), key(dv=64), key(page=16),
        key(causal=False), key(window_size=128), key(softcap=30.0), key(sinks=torch.zeros(32)),
        key(k_descale=torch.ones(1)), key(v_descale=torch.ones(1)),
    ]
    jsons = {v.to_json() for v in variants}
    assert base.to_json() not in jsons and len(jsons) == len(variants)


def test_static_key_json_is_canonical_and_round_trips():
    k = key(window_size=(8, 0), softcap=20.0)
    text = k.to_json()
    assert text == canonical_json(json.loads(text))
    assert " " not in text and list(json.loads(text)) == sorted(json.loads(text))
    assert AttentionStaticKey.from_json(text) == k


def test_kv_len_bucket_is_the_next_power_of_two():
    assert [kv_len_bucket(n) for n in (0, 1, 2, 3, 4, 5, 512, 513, 1024)] == [1, 1, 2, 4, 4, 8, 512, 1024, 1024]
    assert kv_len_bucket(2**40) == 2**40 and kv_len_bucket(2**40 + 1) == 2**41


def test_a_bucket_is_its_exponent_and_runs_from_its_first_length_to_its_top():
    for n in KV_LENGTHS:
        top, low = kv_len_bucket(n), kv_bucket_low(n)
        assert top == 1 << kv_bucket_exponent(n), n
        assert low <= max(n, 1) <= top and kv_len_bucket(low) == top, n
        assert low == 1 or kv_len_bucket(low - 1) == top // 2, n  # the length before is the bucket below
    assert [kv_bucket_low(n) for n in (0, 1, 2, 3, 4, 5, 1024, 1025)] == [1, 1, 2, 3, 3, 5, 513, 1025]


def test_the_runtimes_memo_keys_bucket_as_the_helper_does(db_path):
    """The memo keys of @autotune's wrapper and of ConfigLookup spell the bucket inline (a
    call there would cost on every call); they must agree with kv_bucket_exponent."""
    import tuner
    from tuner.runtime import ConfigLookup

    tuner.configure(db=db_path, mode="off")
    lookup = ConfigLookup("toy-lookup", lambda static: static)

    @tuner.autotune("toy", configs=[{"block": 16}], static_key=lambda batch, kv: "s",
                    run_key=lambda batch, kv: (batch, 1, kv), default={"block": 16})
    def fn(batch, kv, *, config):
        return config

    for n in KV_LENGTHS:
        fn.tuner.memo.clear()
        fn(1, n)
        [memo_key] = fn.tuner.memo
        assert memo_key[3] == kv_bucket_exponent(n), n
        lookup.memo.clear()
        lookup.get("s", 1, 1, n, {"block": 16})
        [memo_key] = lookup.memo
        assert memo_key[3] == kv_bucket_exponent(n), n


def test_decode_attentions_fallback_key_buckets_as_the_helper_does(monkeypatch):
    """decode_attention's fallback cache keys a call by its kv bucket, spelt inline for the
    same reason; it must agree with kv_bucket_exponent."""
    import tuner.integrations.decode_attention as da

    monkeypatch.setattr(da, "_FALLBACKS", {})
    q, k, v = tensors(q_heads=4, kv_heads=2, d=32, page=16)
    table, lengths = torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    for n in KV_LENGTHS:
        da._FALLBACKS.clear()
        da._fallback(q, k, v, table, lengths, n, True, (-1, -1), 0.0, None)
        [fallback_key] = da._FALLBACKS
        assert fallback_key[7] == kv_bucket_exponent(n), n  # the key's kv bucket


def test_run_keys_differing_in_batch_or_q_never_collide_at_any_kv():
    kvs = [1, 1000, 2**20, 3 * 10**6, 2**32 + 7, 2**40]  # one per bucket
    inputs = [(b, q, kv) for b in (1, 2, 1000, 10**6) for q in (1, 2, 4) for kv in kvs]
    keys = {attention_run_key(*i) for i in inputs}
    json_keys = {attention_run_key(*i).to_json() for i in inputs}
    # the packed-integer scheme of the seeds (batch * 10**12 + q * 10**6 + kv) collided
    # once kv passed 10**6; keys with separate fields cannot
    assert len(keys) == len(json_keys) == len(inputs)
    assert attention_run_key(1, 1, 2 * 10**6) != attention_run_key(1, 2, 10**6)


def test_kv_lengths_in_different_buckets_stay_distinct():
    assert attention_run_key(8, 1, 1000) == attention_run_key(8, 1, 1024)
    assert attention_run_key(8, 1, 1024) != attention_run_key(8, 1, 1025)
    assert attention_run_key(8, 1, 2**39 + 1) != attention_run_key(8, 1, 2**40 + 1)


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 0, 1), (1, 1, -1), (1.5, 1, 1), (True, 1, 1), (1, 1, 2**62 + 1)])
def test_bad_run_key_values_raise(args):
    with pytest.raises(ValueError):
        attention_run_key(*args)


def test_run_key_json_has_named_fields():
    assert json.loads(attention_run_key(16, 2, 3000).to_json()) == {"batch": 16, "kv_len_bucket": 4096, "max_q_len": 2}


def rk(b, q, kv):
    return AttentionRunKey(b, q, kv)


def test_nearest_prefers_same_q_len_then_log_distance():
    cands = [rk(1, 1, 512), rk(64, 1, 8192), rk(16, 4, 2048), rk(16, 1, 4096)]
    assert nearest_run_key(rk(16, 1, 2048), cands) == rk(16, 1, 4096)
    assert nearest_run_key(rk(16, 4, 4096), cands) == rk(16, 4, 2048)  # q len wins over distance
    assert nearest_run_key(rk(2, 1, 512), cands) == rk(1, 1, 512)


def test_nearest_never_borrows_across_far_q_lens_and_filters_before_ranking():
    # a q len 1 octave away but same batch/kv beats a far batch at the same q len...
    assert nearest_run_key(rk(1, 1, 512), [rk(1024, 1, 512), rk(1, 2, 512)]) == rk(1, 2, 512)
    # ...but a prefill-sized q len is never used for decode
    assert nearest_run_key(rk(1, 1, 512), [rk(1, 4096, 512)]) is None


def test_nearest_ties_go_to_the_upper_bound_and_far_keys_are_not_used():
    cands = [rk(8, 1, 1024), rk(8, 1, 4096)]
    assert nearest_run_key(rk(8, 1, 2048), cands) == rk(8, 1, 4096)
    assert nearest_run_key(rk(8, 1, 2**20), cands) is None  # 8 octaves away
    assert nearest_run_key(rk(8, 1, 2**20), cands, max_distance=100) == rk(8, 1, 4096)
    assert nearest_run_key(rk(8, 1, 1024), []) is None


def test_nearest_run_keys_lists_every_tie_the_tie_rule_s_choice_first():
    from tuner.keys import nearest_run_keys

    cands = [rk(4, 1, 2048), rk(16, 1, 2048), rk(8, 1, 8192), rk(64, 1, 2048)]
    assert nearest_run_keys(rk(8, 1, 2048), cands) == [rk(16, 1, 2048), rk(4, 1, 2048)]  # 1 octave each
    assert nearest_run_keys(rk(8, 1, 2048), cands)[0] == nearest_run_key(rk(8, 1, 2048), cands)
    assert nearest_run_keys(rk(8, 1, 2**30), cands) == []


def test_canonical_json_rejects_what_has_no_one_form():
    assert canonical_json({"b": (1, 2), "a": 2.0}) == '{"a":2,"b":[1,2]}'
    assert canonical_json(torch.bfloat16) == '"bfloat16"'
    for bad in (float("inf"), {1: 2}, object()):
        with pytest.raises(ValueError):
            canonical_json(bad)


def test_a_numpy_window_is_a_window():
    import numpy as np

    from tuner.keys import normalize_window

    assert normalize_window(np.array([64, 0])) == (64, 0) and normalize_window(np.int64(5)) == (5, 5)
    assert normalize_window((np.int32(3), np.int64(-1))) == (3, -1)
    with pytest.raises(ValueError):
        normalize_window(np.array([1, 2, 3]))


def test_a_window_caps_what_a_call_reads_but_not_the_kv_length_its_run_key_buckets():
    from tuner.keys import visible_kv_len
    from tuner.workload import DecodeShape

    assert visible_kv_len(65536, 1, 127) == 128 and visible_kv_len(100, 2, 127) == 100
    assert visible_kv_len(65536, 4, -1) == 65536
    shape = DecodeShape(batch=4, kv_len=16384, num_q_heads=8, num_kv_heads=2, head_dim=16, window=(127, 0))
    assert shape.run_key() == attention_run_key(4, 1, 16384)
