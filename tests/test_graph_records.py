"""Graph records (issue 37): decode_attention's config for a CUDA graph captured at a bound with
no declared lengths, measured over the lengths such a graph replays, and served to a capture
before the frozen rule."""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

import tuner
from support.recorders import recording_triton
from tuner import settings
from tuner.cli import app
from tuner.db import Problem, TuningDB, current_fingerprint, current_fingerprint_id
from tuner.integrations.decode_attention import decode_attention
from tuner.ops import check_record, get_op
from tuner.sweep.trials import build_trial
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.traffic import DISTRIBUTIONS, graph_caps, graph_draws

SHAPE = DecodeShape(batch=2, kv_len=64, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")
GRAPH_OP = "decode_attention_graph"


def _triton(block_n, splits):
    return {"backend": "triton_decode", "block_n": block_n, "num_kv_splits": splits, "num_warps": 4, "num_stages": 2}


def test_a_graph_replays_every_octave_up_to_its_bound_within_the_token_limit():
    caps = graph_caps(4, 131072)
    assert caps == [2**i for i in range(10, 18)]  # 1k-128k: settings.GRAPH_OCTAVES of them
    assert graph_caps(1, 64) == [16, 32, 64]  # not below a sequence's least length
    big = graph_caps(256, 131072)
    assert max(big) * 256 <= settings.GRAPH_MAX_TOKENS and min(big) == 1024
    assert graph_caps(10**6, 64) == [16]  # the smallest cap always stays
    draws = graph_draws(3, 4096, seed=7)
    assert len(draws) == len(graph_caps(3, 4096)) * len(DISTRIBUTIONS)
    assert all(len(lens) == 3 and max(lens) <= 4096 for lens in draws)
    assert max(max(lens) for lens in draws) > 2048 and min(max(lens) for lens in draws) <= 64
    assert draws == graph_draws(3, 4096, seed=7) != graph_draws(3, 4096, seed=8)


def test_a_graph_trial_runs_each_batch_at_the_bound_with_no_host_lengths():
    """As a graph captured at the bound replays: max length and page table at the bound, the
    lengths on the device only."""
    op = get_op(GRAPH_OP)
    shape = dataclasses.replace(SHAPE, batch=3, kv_len=128, lengths="graph")
    trial = build_trial(op, shape, "cpu", seed=1)
    runs = [run.args[0] for run in trial.runs]
    assert len(runs) == len(graph_draws(3, 128, 1))
    assert all(inputs.shape.kv_len == 128 and inputs.page_table.shape[1] == 128 // 16 for inputs in runs)
    assert all(inputs.seq_lens_host is None for inputs in runs)
    assert sorted(inputs.cache_seqlens.tolist() for inputs in runs) == sorted(graph_draws(3, 128, 1))
    for i, reference in [(0, trial.reference), *trial.checks]:  # each replay's output is its own batch's
        torch.testing.assert_close(trial.runs[i](op.default(shape)), reference, atol=2e-4, rtol=2e-4)


def test_the_graph_ops_space_holds_only_configs_a_captured_graph_can_run():
    op = get_op(GRAPH_OP)
    shape = dataclasses.replace(SHAPE, lengths="graph")
    assert op.configs(shape) and all(c["backend"] != "flashinfer" for c in op.configs(shape))
    flashinfer = {"backend": "flashinfer", "use_tensor_cores": True, "flashinfer_backend": "fa2",
                  "fixed_split_size": None, "disable_split_kv": False}
    assert "captured graph" in op.check(flashinfer, shape)
    assert check_record(GRAPH_OP, shape.static_key().to_json(), shape.run_key(), flashinfer)
    assert check_record(GRAPH_OP, shape.static_key().to_json(), shape.run_key(), _triton(16, 2)) is None


def _store(db_path, op_name, shape, config):
    with TuningDB(db_path) as db:
        db.save_record(Problem(op_name, shape.static_key().to_json(), shape.run_key()),
                       (current_fingerprint_id(), current_fingerprint()), config, median_us=1.0, spread_us=0.0,
                       samples=3, default_config={"backend": "triton_decode"}, default_median_us=2.0,
                       default_spread_us=0.0, method={})


@pytest.fixture
def ran(monkeypatch):
    return recording_triton(monkeypatch)


def _call_at_bound(bound, batch=2):
    inputs = make_decode_inputs(dataclasses.replace(SHAPE, batch=batch), seq_lens=[17] * batch)
    return (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, bound)


def test_a_capture_without_lengths_runs_the_graph_record_of_its_batch_and_bound(db_path, ran):
    """The frozen rule alone froze the default here (the winners differ by kv bucket); the
    graph record, measured as such a graph replays, is what the capture runs. Eager calls
    and declared lengths keep decode_attention's own records."""
    bound = 2048
    for kv, config in ((1024, _triton(16, 2)), (2048, _triton(64, 8))):
        _store(db_path, "decode_attention", dataclasses.replace(SHAPE, kv_len=kv), config)
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    args = _call_at_bound(bound)
    with tuner.graph_capture():
        decode_attention(*args)
    assert ran.pop() == (32, 4)  # no graph record: the frozen rule's default
    _store(db_path, GRAPH_OP, dataclasses.replace(SHAPE, kv_len=bound, lengths="graph"), _triton(64, 2))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    with tuner.graph_capture():
        decode_attention(*args)
    assert ran.pop() == (64, 2)
    with tuner.graph_capture():  # another batch size has no graph record
        decode_attention(*_call_at_bound(bound, batch=3))
    assert ran.pop() == (32, 4)
    decode_attention(*args)  # eager: the call's own key, kv bucket 2048
    assert ran.pop() == (64, 8)
    with tuner.graph_capture([2000] * 64):  # declared: the declared lengths' key
        decode_attention(*args)
    assert ran.pop() == (64, 8)


def test_a_capture_at_a_bound_without_a_graph_record_takes_a_larger_bounds_within_two_octaves(db_path, ran):
    """A graph grid has bounds 8k, 32k and 128k; a server's max context may be 64k or 40k. A
    larger bound's record held on every octave of lengths below it, a smaller one's never saw
    the longer ones."""
    _store(db_path, GRAPH_OP, dataclasses.replace(SHAPE, kv_len=2048, lengths="graph"), _triton(64, 2))
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    for bound, expected in ((2048, (64, 2)), (1500, (64, 2)), (512, (64, 2)), (256, (32, 4)), (4096, (32, 4))):
        with tuner.graph_capture():
            decode_attention(*_call_at_bound(bound))
        assert ran.pop() == expected, bound


def test_a_graph_sweep_stores_graph_records_that_a_capture_runs(db_path, tmp_path):
    shape = dataclasses.replace(SHAPE, batch=1, kv_len=32, lengths="graph")
    shapes = tmp_path / "graph.json"
    shapes.write_text(json.dumps([shape.to_dict()]))
    done = CliRunner().invoke(app, ["sweep", GRAPH_OP, "--shapes", str(shapes), "--db", str(db_path), "--repeats",
                                    "3", "--warmup", "1", "--no-isolate"])
    assert done.exit_code == 0, done.output
    assert "guided search (triton_decode; fa3 cannot run here)" in " ".join(done.output.split())
    with TuningDB(db_path) as db:
        [record] = db.records(op=GRAPH_OP)
        assert record.problem.run_key == shape.run_key() and not db.records(op="decode_attention")
        rows = db.measurements(record.problem, record.fingerprint_id)
        assert rows and all(m.method.get("lengths") == "graph" for m in rows)
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    inputs = make_decode_inputs(dataclasses.replace(shape, lengths="full"))
    args = (inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.cache_seqlens, shape.kv_len)
    with tuner.graph_capture():
        assert decode_attention.tuner.config_for(*args) == record.config


def test_a_graph_sweep_from_misses_takes_decode_attentions_missed_static_keys(db_path):
    TuningDB(db_path).close()  # misses are kept only where a DB exists
    tuner.configure(db=db_path, mode="lookup", shipped="off")
    decode_attention(*_call_at_bound(64))
    assert tuner.flush_misses() == 1
    plan = CliRunner().invoke(app, ["sweep", GRAPH_OP, "--from-misses", "--plan", "--db", str(db_path)])
    assert plan.exit_code == 0, plan.output
    text = " ".join(plan.output.split())
    assert SHAPE.static_label() in text and "graph" in text
    assert f"{len(get_op(GRAPH_OP).grids['serving'])} shapes" in text


def test_graph_replays_are_measured_by_the_graph_op_only(tmp_path):
    """A graph-replay timing stored as decode_attention's record would serve eager calls; a
    graph op's record timed on other batches would be the bound's winner frozen for a graph."""
    runner = CliRunner()
    for args, fragment in ((["decode_attention", "--grid", "cpu-serving", "--lengths", "graph"], "not decode_attention"),
                           ([GRAPH_OP, "--grid", "cpu-serving", "--lengths", "serving"], "not serving")):
        done = runner.invoke(app, ["sweep", *args, "--plan"])
        assert done.exit_code == 2 and fragment in done.output, done.output
    bounds = tmp_path / "bounds.json"
    bounds.write_text(json.dumps([dataclasses.replace(SHAPE, kv_len=4096).to_dict()]))  # lengths full: a bound
    plan = runner.invoke(app, ["sweep", GRAPH_OP, "--shapes", str(bounds), "--plan"])
    assert plan.exit_code == 0 and "graph" in plan.output.split("lengths")[-1], plan.output


def test_a_graph_sweep_names_and_needs_backends_a_captured_graph_can_run():
    runner = CliRunner()
    plan = runner.invoke(app, ["sweep", GRAPH_OP, "--grid", "cpu-serving", "--plan", "--backends",
                               "triton_decode,flashinfer"])
    assert plan.exit_code == 0 and "(triton_decode)" in " ".join(plan.output.split()), plan.output
    refused = runner.invoke(app, ["sweep", GRAPH_OP, "--grid", "cpu-serving", "--plan", "--backends", "flashinfer"])
    assert refused.exit_code == 2 and "captured graph" in refused.output, refused.output
