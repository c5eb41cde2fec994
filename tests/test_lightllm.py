"""`tuner export --format lightllm` against what LightLLM loads, as its source states it
(ModelTC/LightLLM 87881ae: lightllm/utils/sgl_utils.py, lightllm/common/triton_utils/
autotuner.py, lightllm/common/kernel_config.py). The rules below are restated in this
test's own words and code; none of LightLLM's code is copied.

- directory: triton_<triton.__version__>/<torch.cuda.get_device_name(), spaces as "_">/
  sgl_fa3_kvcache_ns:v1/, under lightllm/common/triton_utils/autotune_kernel_configs/;
- file: the static key dict {qd, kd, vd: "torch.<dtype>", qh, kh, hd, vh, pb, c, wl, wr,
  sc, sk: ints, has_k_descale, has_v_descale: bools, sgl: sgl_kernel.__version__}, dumped as
  sorted JSON with spaces, newlines and quotes dropped and ":" as "=", then "_<device>.json";
- content: {str(batch * 10**13 + max_q_len * 10**7 + page_table.shape[1]): {"num_splits": n}};
  LightLLM takes the exact key, else the one of least |int(key) - run key|, at any distance;
- only num_splits reaches FA3 (pack_gqa is not passed).
"""

import json
from bisect import bisect_left
from pathlib import Path

import pytest

from typer.testing import CliRunner

from tuner.cli import app
from tuner.db import Problem, TuningDB, fingerprint_id
from tuner.db.jsonio import load_document
from tuner.keys import AttentionRunKey, attention_run_key, kv_len_bucket, static_key_from_parts
from tuner.runtime.borrowing import Winner, choose, winner_gain

H200 = {"capability": "9.0", "cuda": "13.0", "device": "NVIDIA H200", "device_kind": "cuda", "driver": "580.159.04",
        "flashinfer": "0.6.15.post1", "sgl_kernel": "0.4.5", "sm_count": 132, "torch": "2.11.0", "triton": "3.6.0",
        "tuner": "0.1.0"}
SHIPPED = Path(__file__).resolve().parents[1] / "tuning_cache" / "h200.tunings.json.gz"
KERNEL_DIR = "triton_3.6.0/NVIDIA_H200/sgl_fa3_kvcache_ns:v1"
# the file LightLLM's get_config_file_name gives for bf16, 32 q / 8 kv heads, head dim 128,
# page 1, causal, no window, softcap, sinks or descales, sgl-kernel 0.4.5 on an H200
NAME_32_8 = ("{c=1,has_k_descale=false,has_v_descale=false,hd=128,kd=torch.bfloat16,kh=8,pb=1,qd=torch.bfloat16,"
             "qh=32,sc=0,sgl=0.4.5,sk=0,vd=torch.bfloat16,vh=128,wl=-1,wr=-1}_NVIDIA_H200.json")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def lightllm_name(q_dtype, heads, kv_heads, head_dim, page_size, causal, window, softcap, sinks, sgl, device):
    """The file name, built as LightLLM's rule says (this test's own code)."""
    key = {"qd": f"torch.{q_dtype}", "kd": f"torch.{q_dtype}", "vd": f"torch.{q_dtype}", "qh": heads, "kh": kv_heads,
           "hd": head_dim, "vh": head_dim, "pb": page_size, "c": int(causal), "wl": window[0], "wr": window[1],
           "sc": int(softcap), "sk": int(sinks), "has_k_descale": False, "has_v_descale": False, "sgl": sgl}
    body = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(key.items()))
    return "{" + body + "}_" + device.replace(" ", "_") + ".json"


def nearest(content: dict, batch: int, q_len: int, width: int) -> dict:
    """LightLLM's choice for a call: the exact run key, else the least |difference|, the first
    in file order on a tie."""
    wanted = batch * 10**13 + q_len * 10**7 + width
    return min(content.items(), key=lambda kv: abs(wanted - int(kv[0])))[1]


def loader(content: dict):
    """nearest() for many calls: the same choice (least |difference|, the first in file order
    on a tie), found by bisection over the sorted keys."""
    ordered = sorted((int(k), i) for i, k in enumerate(content))
    keys, values = [k for k, _ in ordered], list(content.values())

    def lookup(batch: int, q_len: int, width: int) -> dict:
        wanted = batch * 10**13 + q_len * 10**7 + width
        at = bisect_left(keys, wanted)
        near = [ordered[j] for j in (at - 1, at) if 0 <= j < len(ordered)]
        return values[min(near, key=lambda c: (abs(wanted - c[0]), c[1]))[1]]
    return lookup


def run_key(batch: int, q_len: int, width: int) -> str:
    return str(batch * 10**13 + q_len * 10**7 + width)


def one_winner_file(splits: int) -> dict:
    """The file of one winner at batch 1, kv 512 (bucket (256, 512]) with a 2x gain: its config
    up to batch 4 (the borrowing rule's 2 octaves), FA3's default beyond, to batch 256."""
    return {run_key(b, 1, w): {"num_splits": splits if b <= 4 else 0} for b in range(1, 257) for w in (257, 512)}


@pytest.fixture
def shipped_db(tmp_path):
    assert cli("import", SHIPPED, "--db", tmp_path / "shipped.db").exit_code == 0
    return tmp_path / "shipped.db"


def test_the_shipped_db_exports_with_the_defaults_to_files_lightllm_finds(tmp_path, shipped_db):
    out = tmp_path / "autotune_kernel_configs"
    result = cli("export", "--format", "lightllm", "--out", out, "--db", shipped_db)
    assert result.exit_code == 0, result.output
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files and all(f.startswith(KERNEL_DIR + "/") for f in files)
    assert all(len(part.encode()) <= 255 for f in files for part in f.split("/"))
    assert f"{KERNEL_DIR}/{NAME_32_8}" in files
    assert lightllm_name("bfloat16", 32, 8, 128, 1, True, (-1, -1), False, False, "0.4.5", "NVIDIA H200") == NAME_32_8
    shipped = load_document(SHIPPED)
    decode = [r for r in shipped["records"] if r["op"] == "fa3" and r["run_key"]["max_q_len"] <= 16]
    for f in files:
        content = json.loads((out / f).read_text())
        assert all(str(int(k)) == k for k in content)  # keys LightLLM's int() reads back exactly
        assert all(set(v) == {"num_splits"} and type(v["num_splits"]) is int for v in content.values())
    # every shipped FA3 decode winner without pack_gqa is in the file LightLLM would open for
    # that call, under the run key it computes, with tuner's num_splits
    checked = 0
    for r in decode:
        if r["config"]["pack_gqa"] is not None:
            continue
        k, run = r["static_key"], r["run_key"]
        name = lightllm_name(k["q_dtype"], k["num_q_heads"], k["num_kv_heads"], k["head_dim_qk"], k["page_size"],
                             k["causal"], (k["window_left"], k["window_right"]), k["softcap"], k["sinks"], "0.4.5",
                             "NVIDIA H200")
        content = json.loads((out / KERNEL_DIR / name).read_text())
        key = str(run["batch"] * 10**13 + run["max_q_len"] * 10**7 + run["kv_len_bucket"])
        assert content[key] == {"num_splits": r["config"]["num_splits"]}
        checked += 1
    assert checked == sum(r["config"]["pack_gqa"] is None for r in decode) > 100
    # what LightLLM drops is said, and what it has no reader for is left out, with why
    said = " ".join(result.output.split())
    assert "pack_gqa, which LightLLM's wrapper does not pass" in said and "decode_attention" in said
    assert "prefill winners" in said


def test_a_batch_between_the_keys_takes_the_nearest_batch_in_lightllm(tmp_path, shipped_db):
    out = tmp_path / "cfg"
    assert cli("export", "--format", "lightllm", "--out", out, "--db", shipped_db).exit_code == 0
    content = json.loads((out / KERNEL_DIR / NAME_32_8).read_text())
    exact = {int(k): v for k, v in content.items()}
    # batch 17 at the server's width 8192 (LightLLM's graph_max_len_in_batch): batch 16's row
    assert nearest(content, 17, 1, 8192) == exact[16 * 10**13 + 10**7 + 8192]
    # no distance limit in LightLLM: batch 4000 still takes the largest batch stored
    largest = max(exact)
    assert nearest(content, 4000, 1, 8192) == exact[largest]


def _fa3_record(db, fp, batch, kv, config, default_median=20.0, median=10.0, page_size=1, q_len=1, window=None):
    key = static_key_from_parts(q_dtype="bfloat16", k_dtype="bfloat16", v_dtype="bfloat16", num_q_heads=32,
                                num_kv_heads=8, head_dim_qk=128, head_dim_v=128, page_size=page_size, causal=True,
                                window_size=window, softcap=None, sinks=False, k_descale=False, v_descale=False)
    problem = Problem("fa3", key.to_json(), attention_run_key(batch, q_len, kv))
    db.save_record(problem, fp, config, median_us=median, spread_us=0.1, samples=5,
                   default_config={"num_splits": 0, "pack_gqa": None}, default_median_us=default_median,
                   default_spread_us=0.1, method={})
    return problem


def test_pack_gqa_winners_are_written_as_their_best_measured_config_without_it(tmp_path):
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    fp = (fingerprint_id(H200), H200)
    p = _fa3_record(db, fp, 16, 2048, {"num_splits": 8, "pack_gqa": True})
    for config, us in (({"num_splits": 0, "pack_gqa": None}, 20.0), ({"num_splits": 4, "pack_gqa": None}, 15.0),
                       ({"num_splits": 8, "pack_gqa": True}, 10.0)):
        db.save_measurement(p, fp, config, kv_len=2048, status="ok", method={}, median_us=us, spread_us=0.1, samples=5)
    # no measurements: FA3's default (left out, LightLLM would borrow batch 16's num_splits)
    _fa3_record(db, fp, 64, 2048, {"num_splits": 2, "pack_gqa": False})
    out = tmp_path / "cfg"
    result = cli("export", "--format", "lightllm", "--out", out, "--db", db_path)
    assert result.exit_code == 0, result.output
    content = json.loads((out / KERNEL_DIR / NAME_32_8).read_text())
    assert set(content) == {run_key(b, 1, w) for b in range(1, 257) for w in (1025, 2048)}
    for width in (1025, 2048):
        assert content[run_key(16, 1, width)] == {"num_splits": 4} and content[run_key(64, 1, width)] == {"num_splits": 0}
        # the substitute is what neighbours borrow too: batch 4 (2 octaves) and 17 from 16, 40 from 64
        assert content[run_key(4, 1, width)] == content[run_key(17, 1, width)] == {"num_splits": 4}
        assert content[run_key(40, 1, width)] == {"num_splits": 0}
    said = " ".join(result.output.split())  # rich folds lines at 80 columns
    assert "2 winners set pack_gqa" in said and "1 written as their best" in said


def test_a_windowed_key_tuned_at_its_window_serves_every_width_in_lightllm(tmp_path):
    """tuner keys a windowed call by the keys it can see, so a window-127 key is tuned at kv
    128 alone; LightLLM keys by the page table's width, and its nearest match must still
    find that batch's config at a server's 128k-wide table, not another batch's."""
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    fp = (fingerprint_id(H200), H200)
    for batch, splits in ((4, 3), (8, 1)):
        _fa3_record(db, fp, batch, 128, {"num_splits": splits, "pack_gqa": None}, window=(127, 0))
    out = tmp_path / "cfg"
    assert cli("export", "--format", "lightllm", "--out", out, "--db", db_path).exit_code == 0
    [path] = (out / KERNEL_DIR).iterdir()
    assert "wl=127" in path.name
    content = json.loads(path.read_text())
    assert nearest(content, 4, 1, 131072) == {"num_splits": 3} and nearest(content, 8, 1, 131072) == {"num_splits": 1}
    assert nearest(content, 5, 1, 131072) == {"num_splits": 3}  # between the batches: the nearer one's


def test_other_ops_are_refused_with_why_and_nothing_is_written(tmp_path, shipped_db):
    for op, why in (("decode_attention", "backend"), ("flashinfer", "FlashInfer's plan"), ("triton_decode", "Triton")):
        out = tmp_path / op
        result = cli("export", "--format", "lightllm", "--op", op, "--out", out, "--db", shipped_db)
        assert result.exit_code == 2 and why in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert not out.exists()


def test_an_environment_lightllm_cannot_name_is_left_out_and_the_rest_exported(tmp_path):
    """One imported device name of ".." (or one too long for a file name) refused the whole
    export; now its winners are left out, said why, and the others written."""
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    good = (fingerprint_id(H200), H200)
    _fa3_record(db, good, 1, 512, {"num_splits": 3, "pack_gqa": None})
    evil = dict(H200, device="..", tuner="evil")  # an imported device name of ".."
    long = dict(H200, device="NVIDIA " + "H" * 300)
    for env in (evil, long):
        for batch in (1, 2):
            _fa3_record(db, (fingerprint_id(env), env), batch, 512, {"num_splits": 0, "pack_gqa": None})
    out = tmp_path / "a" / "cfg"
    result = cli("export", "--format", "lightllm", "--out", out, "--db", db_path)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # rich folds lines at 80 columns
    assert "exported 1 FA3 winners in 1 LightLLM files" in said
    assert f"2 environment {fingerprint_id(evil)}: LightLLM directory '..' is not a plain" in said
    assert f"2 environment {fingerprint_id(long)}: LightLLM directory" in said and "255-byte" in said
    assert json.loads((out / KERNEL_DIR / NAME_32_8).read_text()) == one_winner_file(3)
    written = [str(p.relative_to(tmp_path)) for p in tmp_path.glob("**/*") if p.is_file() and "t.db" not in p.name]
    assert written == [f"a/cfg/{KERNEL_DIR}/{NAME_32_8}"]  # nothing else, nothing outside --out
    only_long = TuningDB(tmp_path / "long.db")
    _fa3_record(only_long, (fingerprint_id(long), long), 1, 512, {"num_splits": 0, "pack_gqa": None})
    result = cli("export", "--format", "lightllm", "--out", tmp_path / "b", "--db", tmp_path / "long.db")
    assert result.exit_code == 2 and "no FA3 winners LightLLM can read" in result.stderr
    assert "255-byte" in result.stderr and not (tmp_path / "b").exists()


def test_an_existing_file_is_kept_unless_force(tmp_path):
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    _fa3_record(db, (fingerprint_id(H200), H200), 1, 512, {"num_splits": 3, "pack_gqa": None})
    out = tmp_path / "cfg"
    assert cli("export", "--format", "lightllm", "--out", out, "--db", db_path).exit_code == 0
    target = out / KERNEL_DIR / NAME_32_8
    target.write_text('{"1": {"num_splits": 16}}')  # LightLLM's own tuner wrote one
    result = cli("export", "--format", "lightllm", "--out", out, "--db", db_path)
    assert result.exit_code == 2 and "--force" in result.stderr
    assert target.read_text() == '{"1": {"num_splits": 16}}'
    assert cli("export", "--format", "lightllm", "--out", out, "--db", db_path, "--force").exit_code == 0
    assert json.loads(target.read_text()) == one_winner_file(3)
    assert sorted(p.name for p in out.iterdir()) == ["triton_3.6.0"]  # no staging directory left behind


def shipped_table(static: dict) -> dict:
    """tuner's runtime table of one shipped FA3 static key: {run key: Winner}."""
    return {AttentionRunKey(**r["run_key"]): Winner(r["config"], winner_gain(r["timing"]["median_us"],
                                                                              r["default"]["median_us"]))
            for r in load_document(SHIPPED)["records"] if r["op"] == "fa3" and r["static_key"] == static}


def test_a_batch_without_a_winner_takes_what_tuners_runtime_serves_it_not_the_next_batchs_widest(
        tmp_path, shipped_db):
    """The file held only the stored winners: LightLLM's nearest key for batch 5 at a 600-wide
    table was batch 4 at kv 128k (num_splits 32), since the batch dominates its run key. Now
    batch 5 x kv bucket 1024 holds what tuner's runtime serves there."""
    out = tmp_path / "cfg"
    assert cli("export", "--format", "lightllm", "--out", out, "--db", shipped_db).exit_code == 0
    static = next(r["static_key"] for r in load_document(SHIPPED)["records"]
                  if r["op"] == "fa3" and r["static_key"]["num_q_heads"] == 7 and r["static_key"]["num_kv_heads"] == 1
                  and r["static_key"]["page_size"] == 1 and r["static_key"]["window_left"] == -1)
    content = json.loads((out / KERNEL_DIR / lightllm_name("bfloat16", 7, 1, 128, 1, True, (-1, -1), False, False,
                                                            "0.4.5", "NVIDIA H200")).read_text())
    table = shipped_table(static)
    served, _ = choose(table, AttentionRunKey(5, 1, 1024))
    expected = {"num_splits": 0 if served is None or served["pack_gqa"] is not None else served["num_splits"]}
    assert table[AttentionRunKey(4, 1, 131072)].config["num_splits"] == 32
    assert nearest(content, 5, 1, 600) == expected == {"num_splits": 0}  # batch 4's neighbours lost or won by < 10%
    # every batch to 256 and every width of each bucket, in LightLLM, gets its bucket's entry
    # there: what tuner's runtime serves (a pack_gqa config as FA3's default: no measurements shipped)
    lookup = loader(content)
    for batch in range(1, 257):
        for top in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072):
            served, _ = choose(table, AttentionRunKey(batch, 1, top))
            expected = {"num_splits": 0 if served is None or served["pack_gqa"] is not None else served["num_splits"]}
            for width in (top // 2 + 1, top // 2 + 2, top * 3 // 4, top - 1, top):
                assert lookup(batch, 1, width) == expected, (batch, width)
    assert nearest(content, 5, 1, 600) == lookup(5, 1, 600) and nearest(content, 37, 1, 70000) == lookup(37, 1, 70000)


def test_every_batch_and_width_in_lightllm_maps_to_its_kv_buckets_config(tmp_path):
    """A width inside a bucket was nearer the previous bucket's top (600: 512 rather than 1024);
    each bucket (low, top] is now written at low + 1 and at top."""
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    fp = (fingerprint_id(H200), H200)
    winners = {(8, 512): 2, (8, 1024): 5, (8, 4096): 7, (32, 1024): 9}
    for (batch, kv), splits in winners.items():
        _fa3_record(db, fp, batch, kv, {"num_splits": splits, "pack_gqa": None})
    out = tmp_path / "cfg"
    assert cli("export", "--format", "lightllm", "--out", out, "--db", db_path).exit_code == 0
    content = json.loads((out / KERNEL_DIR / NAME_32_8).read_text())
    lookup = loader(content)
    assert nearest(content, 8, 1, 600) == lookup(8, 1, 600) == {"num_splits": 5}  # bucket 1024's, not 512's
    assert lookup(8, 1, 512) == {"num_splits": 2} and lookup(8, 1, 3000) == {"num_splits": 7}
    assert lookup(8, 1, 2000) == {"num_splits": 7}  # bucket 2048 borrows, as the runtime does (the larger bucket on a tie)
    assert lookup(30, 1, 1000) == {"num_splits": 9}
    table = {AttentionRunKey(b, 1, kv): Winner({"num_splits": s}, 2.0) for (b, kv), s in winners.items()}
    for batch in range(1, 257):
        bucket = {}
        for top in (512, 1024, 2048, 4096):
            config, _ = choose(table, AttentionRunKey(batch, 1, top))
            bucket[top] = config or {"num_splits": 0}
        for width in [*range(1, 9000, 7), 255, 256, 257, 511, 512, 513, 1024, 1025, 2048, 2049, 4096, 4097, 10**6]:
            assert lookup(batch, 1, width) == bucket[min(max(kv_len_bucket(width), 512), 4096)], (batch, width)
    assert nearest(content, 3000, 1, 100) == lookup(256, 1, 4096)  # past the largest batch: no limit in LightLLM


def test_a_batch_with_no_winner_near_gets_fa3s_default_not_a_far_winner(tmp_path):
    """LightLLM's nearest has no distance limit; the file holds FA3's default wherever tuner's
    borrowing rule refuses (a winner over 2 octaves away, or one that beat its default by
    under 10%), so no far winner is lent."""
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    fp = (fingerprint_id(H200), H200)
    _fa3_record(db, fp, 1, 512, {"num_splits": 3, "pack_gqa": None})
    _fa3_record(db, fp, 256, 512, {"num_splits": 7, "pack_gqa": None})
    _fa3_record(db, fp, 64, 512, {"num_splits": 5, "pack_gqa": None}, default_median=10.5)  # a 5% gain
    out = tmp_path / "cfg"
    result = cli("export", "--format", "lightllm", "--out", out, "--db", db_path)
    assert result.exit_code == 0, result.output
    assert "exported 3 FA3 winners in 1 LightLLM files" in " ".join(result.output.split())
    content = json.loads((out / KERNEL_DIR / NAME_32_8).read_text())
    assert nearest(content, 1, 1, 512) == {"num_splits": 3} and nearest(content, 4, 1, 400) == {"num_splits": 3}
    assert nearest(content, 12, 1, 512) == {"num_splits": 0}  # 3.6 octaves from batch 1, 2.4 from batch 64
    assert nearest(content, 64, 1, 512) == {"num_splits": 5}  # its own winner, exact
    assert nearest(content, 65, 1, 512) == nearest(content, 48, 1, 300) == {"num_splits": 0}  # not lent: 5% gain
    assert nearest(content, 255, 1, 512) == {"num_splits": 7} and nearest(content, 100, 1, 512) == {"num_splits": 0}


def test_mtp_winners_and_batches_past_256_are_written_at_their_own_keys(tmp_path):
    """A winner of 2 query tokens (MTP's verify step) gets its own query length's keys, and a
    winner at batch 512 widens the file to its batch."""
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    fp = (fingerprint_id(H200), H200)
    _fa3_record(db, fp, 4, 512, {"num_splits": 3, "pack_gqa": None})
    _fa3_record(db, fp, 4, 512, {"num_splits": 6, "pack_gqa": None}, q_len=2)
    _fa3_record(db, fp, 512, 512, {"num_splits": 2, "pack_gqa": None})
    out = tmp_path / "cfg"
    assert cli("export", "--format", "lightllm", "--out", out, "--db", db_path).exit_code == 0
    content = json.loads((out / KERNEL_DIR / NAME_32_8).read_text())
    assert content[run_key(4, 1, 512)] == {"num_splits": 3} and content[run_key(4, 2, 512)] == {"num_splits": 6}
    assert content[run_key(512, 1, 512)] == {"num_splits": 2}
    assert set(content) == {run_key(b, q, w) for b in range(1, 513) for q in (1, 2) for w in (257, 512)}


def test_of_two_machines_of_one_kind_the_newest_winner_is_written(tmp_path):
    """Whichever was written first: batch 1's older winner was, batch 2's newer one."""
    import sqlite3

    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    older, newer = ((fingerprint_id(env), env) for env in (dict(H200, driver=d) for d in ("570.0", "580.0")))
    _fa3_record(db, older, 1, 512, {"num_splits": 9, "pack_gqa": None})
    _fa3_record(db, newer, 1, 512, {"num_splits": 3, "pack_gqa": None})
    _fa3_record(db, newer, 2, 512, {"num_splits": 5, "pack_gqa": None})
    _fa3_record(db, older, 2, 512, {"num_splits": 9, "pack_gqa": None})
    with sqlite3.connect(db_path) as conn:  # (every winner of the older machine measured in 2020)
        for rid, stamp in conn.execute("SELECT id, created_at FROM records WHERE fingerprint_id = ?",
                                       (older[0],)).fetchall():
            conn.execute("UPDATE records SET created_at = ? WHERE id = ?", ("2020" + stamp[4:], rid))
    out = tmp_path / "cfg"
    assert cli("export", "--format", "lightllm", "--out", out, "--db", db_path).exit_code == 0
    content = json.loads((out / KERNEL_DIR / NAME_32_8).read_text())
    assert content[run_key(1, 1, 512)] == {"num_splits": 3} and content[run_key(2, 1, 512)] == {"num_splits": 5}


@pytest.mark.parametrize("why, record", [
    ("page size other than 1", dict(page_size=16)),
    ("kv bucket past what LightLLM's packed run key holds", dict(kv=2**24)),
    ("its environment names no CUDA device", dict(env=dict(H200, device_kind="cpu"))),
])
def test_a_winner_lightllm_cannot_use_is_left_out_with_why(tmp_path, why, record):
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    _fa3_record(db, (fingerprint_id(H200), H200), 1, 512, {"num_splits": 3, "pack_gqa": None})
    env = record.pop("env", H200)
    _fa3_record(db, (fingerprint_id(env), env), 2, record.pop("kv", 512), {"num_splits": 7, "pack_gqa": None},
                **record)
    out = tmp_path / "cfg"
    result = cli("export", "--format", "lightllm", "--out", out, "--db", db_path)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "exported 1 FA3 winners in 1 LightLLM files" in said and why in said
    assert [p.name for p in (out / KERNEL_DIR).iterdir()] == [NAME_32_8]
    assert json.loads((out / KERNEL_DIR / NAME_32_8).read_text()) == one_winner_file(3)


def test_a_forced_export_that_fails_midway_puts_back_every_file_it_replaced(tmp_path, monkeypatch):
    db_path = tmp_path / "t.db"
    db = TuningDB(db_path)
    fp = (fingerprint_id(H200), H200)
    _fa3_record(db, fp, 1, 512, {"num_splits": 3, "pack_gqa": None})
    _fa3_record(db, fp, 1, 512, {"num_splits": 4, "pack_gqa": None}, window=(127, 0))
    out = tmp_path / "cfg"
    assert cli("export", "--format", "lightllm", "--out", out, "--db", db_path).exit_code == 0
    files = sorted((out / KERNEL_DIR).iterdir())
    assert len(files) == 2
    for f in files:
        f.write_text('{"1": {"num_splits": 16}}')  # LightLLM's own tuner wrote them
    real_replace, moves = Path.replace, []

    def replace(self, target):
        moves.append(self)
        if self.name == "1.json":  # the second file's move into place
            raise OSError(28, "No space left on device")
        return real_replace(self, target)
    monkeypatch.setattr(Path, "replace", replace)
    result = cli("export", "--format", "lightllm", "--out", out, "--db", db_path, "--force")
    assert result.exit_code == 2 and "nothing was written" in result.stderr
    assert any(p.name == "0.json" for p in moves)  # (the first file had been replaced)
    assert [f.read_text() for f in files] == ['{"1": {"num_splits": 16}}'] * 2
