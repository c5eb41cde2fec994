import dataclasses
import json
import math

import pytest
import torch

from tuner.ops import get_op, list_ops

from tuner.workload import DecodeShape, ShapeError, load_shapes, make_decode_inputs
from tuner.workload.shapes import shape_from_dict

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")


def sdpa_oracle(inputs, *, window=None, softcap=None, sinks=None):
    """An independent computation on contiguous K/V, one (batch, head, query) at a time."""
    s = inputs.shape
    out = torch.zeros(s.batch, s.q_len, s.num_q_heads, s.head_dim)
    group = s.num_q_heads // s.num_kv_heads
    for b in range(s.batch):
        n = int(inputs.cache_seqlens[b])
        rows = []
        for t in range(n):
            page = int(inputs.page_table[b, t // s.page_size])
            rows.append((inputs.k_cache[page, t % s.page_size], inputs.v_cache[page, t % s.page_size]))
        k = torch.stack([r[0] for r in rows]).float()
        v = torch.stack([r[1] for r in rows]).float()
        for h in range(s.num_q_heads):
            for i in range(s.q_len):
                pos = n - s.q_len + i
                logits = []
                for j in range(n):
                    allowed = j <= pos if s.causal else True
                    if window is not None:
                        allowed = allowed and j >= pos - window[0]
                    x = float(q_at(inputs, b, i, h) @ k[j, h // group]) / math.sqrt(s.head_dim)
                    if softcap:
                        x = softcap * math.tanh(x / softcap)
                    logits.append(x if allowed else -math.inf)
                extra = [float(sinks[h])] if sinks is not None else []
                m = max(logits + extra)
                w = [math.exp(x - m) for x in logits]
                z = sum(w) + sum(math.exp(e - m) for e in extra)
                out[b, i, h] = sum(wj * v[j, h // group] for j, wj in enumerate(w)) / z
    return out


def q_at(inputs, b, i, h):
    return inputs.q[b, i, h].float()


@pytest.mark.parametrize(
    "extra",
    [{}, {"q_len": 3}, {"window": (5, 0)}, {"softcap": 2.0}, {"sinks": True}, {"causal": False, "q_len": 2}],
)
def test_reference_matches_an_independent_oracle(extra):
    shape = DecodeShape(batch=2, kv_len=11, **dict(SMALL, **extra))
    inputs = make_decode_inputs(shape, seed=1)
    got = inputs.reference()
    want = sdpa_oracle(
        inputs, window=shape.window if shape.window != (-1, -1) else None,
        softcap=shape.softcap or None, sinks=inputs.sinks,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_honours_each_sequences_length():
    inputs = make_decode_inputs(DecodeShape(batch=2, kv_len=12, **SMALL), seed=2)
    full = inputs.reference()
    inputs.cache_seqlens[1] = 5
    short = inputs.reference()
    torch.testing.assert_close(short[0], full[0])
    assert not torch.allclose(short[1], full[1])
    torch.testing.assert_close(short, sdpa_oracle(inputs))


@pytest.mark.parametrize("extra", [{}, {"q_len": 3}, {"window": (5, 0)}, {"softcap": 2.0, "sinks": True}])
def test_reference_over_mixed_lengths_in_a_wide_table_matches_the_independent_oracle(extra):
    shape = DecodeShape(batch=5, kv_len=23, **dict(SMALL, **extra))
    inputs = make_decode_inputs(shape, seq_lens=[23, 4, 17, 9, 12], table_width=40, seed=4)
    got = inputs.reference()
    want = sdpa_oracle(inputs, window=shape.window if shape.window != (-1, -1) else None,
                       softcap=shape.softcap or None, sinks=inputs.sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 40_000, 1 << 30])  # one sequence a chunk, a few, all
@pytest.mark.parametrize("extra", [{"q_len": 3}, {"window": (5, 0), "q_len": 2, "sinks": True}])
def test_reference_in_chunks_of_any_size_matches_the_independent_oracle(monkeypatch, chunk_bytes, extra):
    from tuner import settings

    monkeypatch.setattr(settings, "REFERENCE_CHUNK_BYTES", chunk_bytes)
    shape = DecodeShape(batch=6, kv_len=23, **dict(SMALL, **extra))
    inputs = make_decode_inputs(shape, seq_lens=[23, 4, 3, 17, 9, 23], table_width=40, seed=6)
    want = sdpa_oracle(inputs, window=shape.window if shape.window != (-1, -1) else None, sinks=inputs.sinks)
    torch.testing.assert_close(inputs.reference(), want, atol=1e-5, rtol=1e-5)


def test_a_sequence_with_no_keys_attends_to_nothing_in_any_chunk():
    inputs = make_decode_inputs(DecodeShape(batch=3, kv_len=10, **SMALL), seq_lens=[10, 0, 6], seed=5)
    out = inputs.reference()
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[0]) > 0


@pytest.mark.parametrize("sinks", [False, True])
def test_a_sequence_with_no_keys_reads_nothing_of_its_page_table_row(sinks):
    """A server may leave anything in a padded batch slot's row (a page out of range, one
    of another sequence's, a freed page holding NaN): the reference reads none of it."""
    shape = DecodeShape(batch=3, kv_len=10, **dict(SMALL, sinks=sinks))
    inputs = make_decode_inputs(shape, seq_lens=[10, 0, 6], seed=7)
    want = inputs.reference()
    inputs.page_table[1] = 10**6  # no such page
    torch.testing.assert_close(inputs.reference(), want, atol=0, rtol=0)
    nan_page = torch.full_like(inputs.k_cache[:1], float("nan"))  # a freed page
    freed = dataclasses.replace(inputs, k_cache=torch.cat([inputs.k_cache, nan_page]),
                                v_cache=torch.cat([inputs.v_cache, nan_page]))
    freed.page_table[1] = inputs.k_cache.shape[0]
    torch.testing.assert_close(freed.reference(), want, atol=0, rtol=0)
    assert torch.count_nonzero(want[1]) == 0


def test_inputs_have_a_valid_page_table():
    s = DecodeShape(batch=3, kv_len=10, **SMALL)
    inputs = make_decode_inputs(s)
    pt = inputs.page_table
    assert pt.shape == (3, 3) and pt.dtype == torch.int32
    assert sorted(pt.flatten().tolist()) == list(range(inputs.k_cache.shape[0]))  # each page once, in range
    assert (inputs.cache_seqlens <= pt.shape[1] * s.page_size).all()


def test_mixed_length_inputs_in_a_wide_table_hold_only_their_own_pages():
    s = DecodeShape(batch=3, kv_len=10, **SMALL)
    inputs = make_decode_inputs(s, seq_lens=[10, 3, 0], table_width=40, seed=3)
    assert inputs.page_table.shape == (3, 10)  # 40 tokens of 4-token pages
    assert inputs.lengths() == [10, 3, 0] and inputs.cache_seqlens.tolist() == [10, 3, 0]
    assert inputs.k_cache.shape[0] == 3 + 1  # ceil(10/4) + ceil(3/4) pages, nothing for the rest
    held = inputs.page_table[0, :3].tolist() + inputs.page_table[1, :1].tolist()
    assert sorted(held) == [0, 1, 2, 3]
    two = make_decode_inputs(DecodeShape(batch=2, kv_len=10, **SMALL), seq_lens=[10, 3], table_width=40, seed=3)
    torch.testing.assert_close(two.reference(), sdpa_oracle(two), atol=1e-5, rtol=1e-5)
    for bad in ([10, 3], [11, 3, 0], [-1, 3, 0]):
        with pytest.raises(ValueError, match="seq_lens"):
            make_decode_inputs(s, seq_lens=bad)
    with pytest.raises(ValueError, match="table_width"):
        make_decode_inputs(s, table_width=8)


@pytest.mark.parametrize("extra, lens", [({}, None), ({}, [9, 2, 6]), ({}, [5, 0, 3]),
                                         ({"window": (3, 0), "q_len": 2}, [40, 7, 30]),
                                         ({"window": (100, 0), "q_len": 2}, [1000, 50, 701])])
@pytest.mark.parametrize("shuffled", [False, True])
def test_fresh_page_copies_give_the_same_output_and_share_no_page_a_call_reads(extra, lens, shuffled):
    from tuner.workload.rotation import WINDOW_MARGIN, bytes_read, fresh_page_copies, read_spans

    kv = max(lens) if lens else 9
    s = DecodeShape(batch=3, kv_len=kv, **dict(SMALL, **extra))
    inputs = make_decode_inputs(s, seq_lens=lens, table_width=4 * kv, seed=4)
    reference, spans = inputs.reference(), read_spans(inputs)
    nbytes = bytes_read(inputs)
    copies = fresh_page_copies(inputs, 3, shuffled=shuffled)
    assert len(copies) == 3 and copies[0].page_table.equal(inputs.page_table)
    read_by = []
    for i, copy in enumerate(copies):
        assert copy.k_cache is copies[0].k_cache  # one pool
        torch.testing.assert_close(copy.reference(), reference, atol=0, rtol=0)
        order = [int(copy.page_table[b, j]) for b, (lo, hi) in enumerate(spans)
                 for j in range(lo // s.page_size, -(-hi // s.page_size))]
        pages = set(order)
        read_by.append(pages)
        assert len(pages) * (copy.k_cache[0].nbytes * 2) == nbytes
        if i and len(order) > 8:  # a copy's own pages: in the order its table reads them, or not
            assert (order == sorted(order)) is not shuffled
    assert not (read_by[0] & read_by[1]) and not (read_by[0] & read_by[2]) and not (read_by[1] & read_by[2])
    if s.window[0] >= 0:  # a window reads its last keys (and a margin), not the whole sequence
        n = lens[0]
        assert spans[0] == (max(0, n - 2 - s.window[0] - WINDOW_MARGIN), n)
        if n > 400:  # a span that starts inside the sequence: its earlier pages are not copied
            assert spans[0][0] > 0 and nbytes < inputs.kv_bytes
    else:
        assert spans == [(0, n) for n in inputs.lengths()]
    assert fresh_page_copies(copies[0], 1) == [copies[0]]


def test_a_contiguous_layout_gives_each_sequence_consecutive_pages_and_a_valid_problem():
    s = DecodeShape(batch=3, kv_len=40, **SMALL)
    for lens in (None, [40, 9, 23]):
        inputs = make_decode_inputs(s, seq_lens=lens, table_width=64, layout="contiguous", seed=2)
        page, start = s.page_size, 0
        for b, n in enumerate(inputs.lengths()):
            held = -(-n // page)
            assert inputs.page_table[b, :held].tolist() == list(range(start, start + held))
            start += held
        shuffled = make_decode_inputs(s, seq_lens=lens, table_width=64, seed=2)
        assert not shuffled.page_table.equal(inputs.page_table)
        # the same problem as its reference computes it from the pages (each entry in range)
        assert inputs.reference().isfinite().all()
        assert int(inputs.page_table.max()) < inputs.k_cache.shape[0]
    with pytest.raises(ValueError, match="layout 'sorted' is not one of shuffled, contiguous"):
        make_decode_inputs(s, layout="sorted")


def test_a_window_reads_less_than_it_allocates():
    from tuner.workload.rotation import bytes_read

    s = DecodeShape(batch=2, kv_len=2048, **dict(SMALL, window=(100, 0)))
    inputs = make_decode_inputs(s)
    per_token = 2 * inputs.k_cache[0, 0].nbytes
    assert inputs.kv_bytes == 2 * 2048 * per_token
    # keys 1691..2047 (the query, its 100 to the left, the margin): pages 422..511, 90 of 4 keys
    assert bytes_read(inputs) == 2 * 90 * 4 * per_token
    assert bytes_read(make_decode_inputs(DecodeShape(batch=2, kv_len=2048, **SMALL))) == inputs.kv_bytes


def test_torch_split_decode_matches_reference_for_every_config():
    op = get_op("torch_split_decode")
    for extra in ({}, {"q_len": 2, "window": (7, 0), "softcap": 3.0, "sinks": True}):
        shape = DecodeShape(batch=2, kv_len=300, **dict(SMALL, **extra))
        inputs = make_decode_inputs(shape)
        ref = inputs.reference()
        assert len(op.configs(shape)) >= 4
        for config in op.configs(shape):
            torch.testing.assert_close(op.run(inputs, config), ref, atol=1e-5, rtol=1e-5)


def test_registry_lists_the_cpu_ops_with_grids():
    names = [op.name for op in list_ops()]
    assert "torch_split_decode" in names and "triton_decode" in names
    for op in list_ops():
        assert "decode" in op.grids
        if op.name in ("torch_split_decode", "triton_decode"):  # CPU-capable: grids sized for one
            assert {"cpu-tiny", "cpu-small"} <= set(op.grids)
        for grid in op.grids.values():
            assert grid and all(op.default(s) in op.configs(s) for s in grid)


def test_decode_grid_is_the_issue_grid():
    shapes = get_op("torch_split_decode").grids["decode"]
    assert all(s.batch * s.kv_len <= 4 * 2**20 for s in shapes)
    assert {(s.num_q_heads, s.num_kv_heads) for s in shapes} == {(32, 8), (8, 1)}
    assert {s.batch for s in shapes} == {1, 4, 16, 64, 256}
    assert {s.kv_len for s in shapes} == {512, 2048, 8192, 32768, 131072}


def test_shapes_file_parses_and_validates(tmp_path):
    f = tmp_path / "shapes.json"
    f.write_text(json.dumps([{"batch": 2, "kv_len": 64, "window": 16, "softcap": None}, {"batch": 1, "kv_len": 8}]))
    shapes = load_shapes(f)
    assert shapes[0].window == (16, 16) and shapes[0].softcap == 0.0 and shapes[1].num_q_heads == 32
    f.write_text(json.dumps({"shapes": [{"batch": 1, "kv_len": 8}]}))
    assert len(load_shapes(f)) == 1


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "not valid JSON"),
        ("[]", "non-empty list"),
        ('[{"batch": 1}]', "missing field kv_len"),
        ('[{"batch": 1, "kv_len": 8, "heads": 3}]', "unknown field"),
        ('[{"batch": 0, "kv_len": 8}]', "batch"),
        ('[{"batch": "1", "kv_len": 8}]', "batch"),
        ('[{"batch": 1, "kv_len": 8, "dtype": "int8"}]', "dtype"),
        ('[{"batch": 1, "kv_len": 8, "num_q_heads": 6, "num_kv_heads": 4}]', "multiple"),
        ('[{"batch": 1, "kv_len": 8, "window": "x"}]', "window"),
        ('[{"batch": 1, "kv_len": 2, "q_len": 3}]', "exceeds"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
        ("[" + "9" * 5000 + "]", "thousands of digits"),
        ('[{"batch": 1, "kv_len": 8, "head_dim": 1099511627776}]', "head_dim"),
    ],
)
def test_bad_shapes_files_give_one_line_errors(tmp_path, content, message):
    f = tmp_path / "shapes.json"
    f.write_text(content)
    with pytest.raises(ShapeError, match=message) as e:
        load_shapes(f)
    assert "\n" not in str(e.value)


def test_missing_and_binary_shapes_files(tmp_path):
    with pytest.raises(ShapeError, match="cannot read"):
        load_shapes("/nonexistent/shapes.json")
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe[")
    with pytest.raises(ShapeError, match="not UTF-8"):
        load_shapes(binary)


def test_shape_from_dict_rejects_non_objects():
    with pytest.raises(ShapeError):
        shape_from_dict([1, 2])


@pytest.mark.parametrize("extra", [{}, {"window": (8, 0), "softcap": 5.0, "sinks": True, "q_len": 2}, {"page_size": 16}])
def test_a_shapes_keys_are_the_keys_read_off_its_inputs(extra):
    shape = DecodeShape(batch=2, kv_len=100, **dict(SMALL, **extra))
    inputs = make_decode_inputs(shape)
    assert shape.static_key() == inputs.static_key() and shape.run_key() == inputs.run_key()


@pytest.mark.parametrize("distribution", ["uniform", "long_tail", "few_long"])
def test_serving_lengths_are_deterministic_bounded_and_shaped(distribution):
    from tuner.workload.traffic import draw_lengths

    lens = draw_lengths(distribution, 64, 8192, seed=1)
    assert lens == draw_lengths(distribution, 64, 8192, seed=1) != draw_lengths(distribution, 64, 8192, seed=2)
    assert len(lens) == 64 and all(16 <= n <= 8192 for n in lens)
    mean = sum(lens) / len(lens)
    if distribution == "uniform":
        assert min(lens) >= 4096 and 5500 < mean < 6800
    elif distribution == "long_tail":
        assert sorted(lens)[32] < 2048 and max(lens) > 4096  # most short, some long
    else:
        assert sum(n >= 6144 for n in lens) == 8 and sum(n <= 512 for n in lens) == 56
    assert draw_lengths(distribution, 1, 8, seed=0)[0] <= 8


def test_serving_lengths_refuse_bad_arguments():
    from tuner.workload.traffic import CAPTURE_BATCHES, draw_lengths

    with pytest.raises(ValueError, match="not one of"):
        draw_lengths("zipf", 4, 100, 0)
    with pytest.raises(ValueError, match=">= 1"):
        draw_lengths("uniform", 0, 100, 0)
    assert CAPTURE_BATCHES[:10] == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16) and CAPTURE_BATCHES[-1] == 256


def test_serving_shapes_parse_and_say_so_in_their_label():
    shape = shape_from_dict({"batch": 4, "kv_len": 4096, "lengths": "serving"})
    assert shape.lengths == "serving" and "(serving lengths)" in shape.label()
    assert shape.static_key() == DecodeShape(batch=4, kv_len=4096).static_key()  # the same keys
    assert shape.run_key() == DecodeShape(batch=4, kv_len=4096).run_key()
    with pytest.raises(ShapeError, match="lengths must be one of full, serving"):
        shape_from_dict({"batch": 4, "kv_len": 4096, "lengths": "zipf"})


def test_serving_draws_put_each_batchs_longest_in_the_kv_bucket():
    from tuner.workload.traffic import serving_draws, serving_grid

    # one batch per distribution, four rounds of them at batch 1 (settings.TRIAL_MIN_SEQUENCES)
    for batch, kv, rounds in ((1, 4096, 4), (8, 3000, 1), (64, 131072, 1)):
        draws = serving_draws(batch, kv, seed=2)
        assert len(draws) == 3 * rounds and draws == serving_draws(batch, kv, seed=2)
        bucket = 1 << (kv - 1).bit_length()
        assert all(len(d) == batch and bucket // 2 < max(d) <= kv and min(d) >= 16 for d in draws)
    grid = serving_grid()
    assert all(s.lengths == "serving" and s.batch * s.kv_len <= 4 * 2**20 for s in grid)
    assert {s.batch for s in grid} >= {1, 2, 3, 5, 7, 12, 24, 40, 136, 256}


def test_a_small_batchs_trial_draws_more_batches_of_each_distribution_each_its_own():
    """One length per distribution judged a batch-1 record by luck (FA3's default moves by
    +-5% from one length to the next): a serving trial holds at least
    settings.TRIAL_MIN_SEQUENCES sequences of each distribution, each batch drawn anew."""
    from tuner import settings
    from tuner.workload.traffic import dense_draws, draws_per_distribution, serving_draws

    assert [draws_per_distribution(b) for b in (1, 2, 3, 4, 8, 256)] == [4, 2, 2, 1, 1, 1]
    draws = serving_draws(1, 65536, seed=0)
    assert len({d[0] for d in draws}) == 12  # twelve lengths, not three drawn four times
    # the first round is the one trials drew before (batch 1 x kv 64k, seed 0: the lengths the
    # H200's trials of that key ran); round j is the first round of the seed plus j strides
    assert [d[0] for d in draws[:3]] == [42437, 47949, 49725]
    for j in (1, 2, 3):
        assert draws[3 * j:3 * j + 3] == serving_draws(1, 65536, j * settings.TRIAL_DRAW_SEED_STRIDE)[:3]
    assert len(serving_draws(8, 3000, seed=5)) == 3
    dense = dense_draws(3, 4096, seed=1)
    assert len(dense) == 4 and len({tuple(d) for d in dense}) == 4


def test_serving_draws_that_reach_the_top_put_the_first_batchs_longest_at_kv_len():
    """A second trial's draws: of batch 1 above all, whose three lengths may all fall in the
    middle of a bucket twice as wide as its bottom."""
    from tuner.workload.traffic import serving_draws

    for batch, kv in ((1, 65536), (8, 3000)):
        plain, top = serving_draws(batch, kv, seed=3), serving_draws(batch, kv, seed=3, reach_top=True)
        assert max(top[0]) == kv and top[1:] == plain[1:]
        assert sorted(top[0])[:-1] == sorted(plain[0])[:-1]  # only the longest moved
    assert max(serving_draws(1, 65536, seed=0)[0]) < 65536  # which plain draws miss here


def test_torch_split_decode_honours_each_sequences_length():
    op = get_op("torch_split_decode")
    shape = DecodeShape(batch=3, kv_len=40, **dict(SMALL, q_len=2, window=(9, 0), sinks=True))
    inputs = make_decode_inputs(shape, seq_lens=[40, 5, 23], seed=6)
    for config in op.configs(shape):
        torch.testing.assert_close(op.run(inputs, config), inputs.reference(), atol=1e-5, rtol=1e-5)


def test_the_serving_grid_holds_the_kv_bucket_of_every_serving_batch():
    """Every batch serving traffic makes (each capture batch size, caps 1k-128k, every
    distribution) keys on a kv bucket of the serving grid, or one octave below its smallest
    (MIN_LEN's), which the borrowing rule reaches. The grid began at kv 1k while batch-1
    long-tailed traffic keyed on 32 and 64, where FA3's default ran 1.9-2.6x slower than the
    best config and tuner had no record."""
    from tuner.keys import kv_len_bucket
    from tuner.workload.traffic import CAPTURE_BATCHES, DISTRIBUTIONS, MIN_LEN, SERVING_KV, draw_lengths

    assert min(SERVING_KV) <= 2 * kv_len_bucket(MIN_LEN)
    for name in DISTRIBUTIONS:
        for batch in CAPTURE_BATCHES:
            for cap in (2**i for i in range(10, 18)):
                for seed in range(3):
                    bucket = kv_len_bucket(max(draw_lengths(name, batch, cap, seed)))
                    assert bucket in SERVING_KV or bucket * 2 == min(SERVING_KV), (name, batch, cap, seed, bucket)
