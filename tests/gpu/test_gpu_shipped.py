"""On the GPU the shipped tunings were made for: calls pick the shipped winners and still
compute the right thing. Skipped elsewhere (another GPU or library versions: the tunings do
not apply there, which tests/test_shipped.py checks on the CPU)."""

import json
from pathlib import Path

import pytest
import torch

import tuner
from tuner.db import current_fingerprint
from tuner.db.shipped import load_shipped
from tuner.keys import AttentionRunKey
from tuner.workload import make_decode_inputs
from tuner.workload.shapes import shape_from_keys

pytestmark = pytest.mark.gpu
SHIPPED = Path(__file__).resolve().parents[2] / "tuning_cache"


@pytest.fixture(scope="module")
def layer():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    layer = load_shipped(current_fingerprint(), SHIPPED)
    if not layer.applied:
        pytest.skip("no shipped tuning applies here: " + "; ".join(
            why for f in layer.files for why in f.mismatches.values()))
    return layer


def _entries(layer, op: str, static_filter) -> list[tuple[str, AttentionRunKey, dict]]:
    out = []
    for (name, static), runs in sorted(layer.table.items()):
        if name == op and static_filter(json.loads(static)):
            out += [(static, run, timed.config) for run, timed in sorted(runs.items())]
    return out


def test_decode_attention_runs_the_shipped_winner(layer):
    from tuner.integrations.decode_attention import decode_attention

    tuner.configure(shipped=SHIPPED, mode="lookup")
    # Llama 3 8B at TP 1 (32/8 heads), a few batch and kv sizes, every backend that won
    entries = _entries(layer, "decode_attention", lambda k: k["num_q_heads"] == 32 and k["num_kv_heads"] == 8)
    assert entries
    picked = {}
    for static, run, config in entries:
        if run.batch in (1, 64) and run.kv_len_bucket in (2048, 32768):
            picked[(run.batch, run.kv_len_bucket)] = (static, run, config)
    assert len(picked) == 4
    for static, run, config in picked.values():
        shape = shape_from_keys(static, run)
        inputs = make_decode_inputs(shape, device="cuda")
        decode_attention.tuner.memo.clear()
        out = decode_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens,
                               shape.kv_len, causal=True, seq_lens_host=inputs.cache_seqlens.cpu())
        assert list(decode_attention.tuner.memo.values()) == [config]
        torch.testing.assert_close(out, inputs.reference(), atol=1.6e-2, rtol=1.6e-2)


def test_the_fa3_drop_in_runs_the_shipped_winner(layer):
    from tuner.integrations.fa3 import flash_attn_with_kvcache

    tuner.configure(shipped=SHIPPED, mode="lookup")
    entries = [e for e in _entries(layer, "fa3", lambda k: k["num_q_heads"] == 8 and k["num_kv_heads"] == 1)
               if e[2]["num_splits"] != 0]  # one where tuning changed FA3's own choice
    assert entries
    static, run, config = entries[0]
    shape = shape_from_keys(static, run)
    inputs = make_decode_inputs(shape, device="cuda")
    flash_attn_with_kvcache.tuner.memo.clear()
    out = flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.cache_seqlens,
                                  page_table=inputs.page_table, causal=True)
    assert list(flash_attn_with_kvcache.tuner.memo.values()) == [config]
    torch.testing.assert_close(out, inputs.reference(), atol=1.6e-2, rtol=1.6e-2)
