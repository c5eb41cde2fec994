"""tuner's FA3 winners as the kernel-config files LightLLM's FA3 wrapper reads, unmodified.

What LightLLM loads (ModelTC/LightLLM's sources; docs/decisions.md names the files and version read):
- its FA3 decode wrapper is autotuned kernel `sgl_fa3_kvcache_ns:v1`; its autotuner reads
  lightllm/common/triton_utils/autotune_kernel_configs/triton_<triton version>/<device>/
  <kernel name>/, the device being torch.cuda.get_device_name() with spaces as "_";
- one file per static key, named json.dumps(key, sort_keys=True) with spaces, newlines
  and quotes removed and ":" turned into "=", then "_<device>.json";
- the static key: q/k/v dtypes ("torch.bfloat16"), q heads, kv heads, head dims (qk, v),
  page size, causal, window, softcap on, sinks on, descales, and sgl_kernel.__version__;
- the file holds {run key: config}, the run key the decimal string of
  batch * 10**13 + max q len * 10**7 + page-table width;
- the config's num_splits is passed to FA3; nothing else is (pack_gqa stays FA3's own);
- a run key not in the file takes the nearest one by |difference|, with no distance limit.

So only FA3 decode winners are written, at page size 1 (LightLLM's decode path views its
cache so); a winner needing pack_gqa is replaced by the best pack_gqa=None config its own
measurements show (num_splits 0, FA3's default, where none beat it or the DB holds no
measurements).

Since the batch dominates LightLLM's run key and its nearest match has no distance limit, a
file holding only the stored winners sent a batch without one to the neighbouring batch's
widest entry, and a width inside a kv bucket to the previous bucket's top. So each file is a
full grid: every batch from 1 to LightLLM's largest decode batch (the larger of
DECODE_MAX_BATCH and the largest stored), every query length and every kv bucket the key
has winners for, from its smallest to its largest; each entry holds what tuner's runtime
serves there (tuner.runtime.borrowing.choose: the exact winner, else a neighbour's by the
borrowing rule, else FA3's default). A bucket (low, top] is written at width low + 1 and at
width top, so LightLLM's nearest width is always one of its own bucket's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tuner import settings
from tuner.db.location import DBError
from tuner.db.store import TuningDB
from tuner.db.values import Record
from tuner.keys import AttentionRunKey, AttentionStaticKey, kv_bucket_low
from tuner.runtime.borrowing import Winner, choose, winner_gain

KERNEL = "sgl_fa3_kvcache_ns:v1"
MAX_NAME_BYTES = 255  # a file or directory name, on every filesystem LightLLM runs on
# LightLLM's wrapper runs decode (MTP verify included: a few query tokens); the run key's
# width must stay below 10**7 to keep batch * 10**13 + q * 10**7 + width unambiguous
MAX_Q_LEN, MAX_WIDTH = 16, 10**7 - 1
# the largest batch LightLLM's decode runs by default (its graph_max_batch_size); every batch
# up to it (or up to the largest stored, if larger) is written
DECODE_MAX_BATCH = 256
# ops whose winners LightLLM has no reader for, and why
NO_CONSUMER = {
    "decode_attention": "its configs choose a backend (FA3, FlashInfer or tuner's Triton kernel); "
                        "LightLLM has no autotuned kernel that takes a backend choice",
    "decode_attention_graph": "graph records choose a backend for tuner's decode_attention in CUDA graphs; "
                              "LightLLM has no autotuned kernel that takes a backend choice",
    "flashinfer": "LightLLM plans FlashInfer with its own arguments and reads no autotuned config for "
                  "FlashInfer's plan (use_tensor_cores, split size)",
    "triton_decode": "tuner's Triton decode kernel is not one of LightLLM's kernels; nothing in LightLLM "
                     "reads its block, split, warp and stage knobs",
    "torch_split_decode": "a torch reference kernel that LightLLM does not have",
}


@dataclass
class LightLLMExport:
    """The files to write ({relative path: {run key: config}}) and what was left out, why."""

    files: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    written: int = 0  # stored winners written (each file also holds the run keys between them)
    left_out: dict[str, int] = field(default_factory=dict)  # reason -> winners
    substituted: int = 0  # winners with pack_gqa set, written as their best pack_gqa=None config
    defaulted: int = 0  # winners with pack_gqa set and no measurements: written as FA3's default

    def leave_out(self, reason: str) -> None:
        self.left_out[reason] = self.left_out.get(reason, 0) + 1


def device_dir(device: str) -> str:
    """LightLLM's device directory: the CUDA device name, spaces as "_" (a "4090" that is not
    a "4090 D" becomes one, as LightLLM's get_current_device_name does)."""
    if "4090" in device and "4090 D" not in device:
        device = device.replace("4090", "4090 D")
    return device.replace(" ", "_")


def static_key_dict(key: AttentionStaticKey, sgl_version: str) -> dict[str, Any]:
    """LightLLM's static key of its FA3 wrapper for a tuner static key."""
    return {
        "qd": f"torch.{key.q_dtype}", "kd": f"torch.{key.k_dtype}", "vd": f"torch.{key.v_dtype}",
        "qh": key.num_q_heads, "kh": key.num_kv_heads, "hd": key.head_dim_qk, "vh": key.head_dim_v,
        "pb": key.page_size, "c": int(key.causal), "wl": key.window_left, "wr": key.window_right,
        "sc": int(key.softcap), "sk": int(key.sinks), "has_k_descale": key.k_descale,
        "has_v_descale": key.v_descale, "sgl": sgl_version,
    }


def config_file_name(static: dict[str, Any], device: str) -> str:
    """The file name LightLLM looks for: its rule (kernel_config.py), written here anew."""
    text = json.dumps(static, sort_keys=True)
    text = text.replace(" ", "").replace("\n", "").replace('"', "").replace(":", "=")
    return f"{text}_{device}.json"


def run_key(batch: int, max_q_len: int, width: int) -> str:
    """LightLLM's run key of its FA3 wrapper: batch, query length and page-table width packed."""
    return str(batch * 10**13 + max_q_len * 10**7 + width)


def _name_problem(name: str, what: str) -> str | None:
    """Why `name` cannot be one of LightLLM's file or directory names, or None."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        return f"LightLLM {what} {name!r:.80} is not a plain file or directory name"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return (f"LightLLM {what} {name[:60]!r}... is {len(name.encode('utf-8', 'surrogatepass'))} bytes, "
                f"over the {MAX_NAME_BYTES}-byte limit of a file name")
    return None


def _without_pack_gqa(db: TuningDB, record: Record) -> dict[str, int] | None:
    """The FA3 config LightLLM can run for a winner that set pack_gqa: the fastest measured
    pack_gqa=None config if it beat FA3's default (num_splits 0) by more than the noise and
    settings.MIN_GAIN, else num_splits 0; None without measurements of the default."""
    rows = [m for m in db.measurements(record.problem, record.fingerprint_id)
            if m.status == "ok" and m.median_us and m.config.get("pack_gqa") is None]
    default = next((m for m in rows if m.config.get("num_splits") == 0), None)
    if default is None:
        return None
    best = min(rows, key=lambda m: m.median_us)
    margin = max(((best.spread_us or 0.0) + (default.spread_us or 0.0)) / 2, settings.MIN_GAIN * default.median_us)
    return {"num_splits": int(best.config["num_splits"]) if best.median_us < default.median_us - margin else 0}


def lightllm_export(db: TuningDB, *, op: str | None = None) -> LightLLMExport:
    """Every FA3 decode winner as LightLLM's files, each file the grid of run keys the module
    docstring describes, checked (names, keys) before anything is written; a winner whose environment gives names LightLLM's files cannot have is left
    out (export.left_out says why). op: None or "fa3"; any other op is refused with why
    LightLLM cannot use it."""
    if op is not None and op != "fa3":
        why = NO_CONSUMER.get(op, "LightLLM reads autotuned configs only for its FA3 wrapper, and this is "
                                  "not an op tuner exports for it")
        raise DBError(f"--format lightllm writes FA3 winners only; {op}: {why}")
    fingerprints = db.fingerprints()
    export = LightLLMExport()
    newest: dict[str, dict[AttentionRunKey, Record]] = {}  # file -> run key -> its newest winner
    for record in db.records():
        if record.problem.op != "fa3":
            export.leave_out(f"{record.problem.op}: {NO_CONSUMER.get(record.problem.op, 'not an FA3 winner')}")
            continue
        env = fingerprints.get(record.fingerprint_id, {})
        path = _path(record, env, export)
        if path is None:
            continue
        runs = newest.setdefault(path, {})
        held = runs.get(record.problem.run_key)
        if held is None or record.created_at >= held.created_at:  # the newest measurement wins
            runs[record.problem.run_key] = record
    for path in sorted(newest):
        winners = {run: Winner(_lightllm_config(db, record, export), winner_gain(record.median_us,
                                                                               record.default_median_us))
                   for run, record in sorted(newest[path].items())}
        export.files[path] = _grid(winners)
        export.written += len(winners)
    return export


def _lightllm_config(db: TuningDB, record: Record, export: LightLLMExport) -> dict[str, int]:
    """The config LightLLM runs for a stored winner: its num_splits, or for a winner that set
    pack_gqa its best pack_gqa=None config (counted in export.substituted or .defaulted)."""
    config = record.config
    if config.get("pack_gqa") is None:
        return {"num_splits": int(config["num_splits"])}
    chosen = _without_pack_gqa(db, record)
    if chosen is None:  # no measurements: FA3's default
        export.defaulted += 1
        return {"num_splits": 0}
    export.substituted += 1
    return chosen


def _grid(winners: dict[AttentionRunKey, Winner]) -> dict[str, dict[str, int]]:
    """One file's {run key: config}: at every batch up to LightLLM's largest, every query
    length and kv bucket of `winners`, what tuner's runtime serves there (the borrowing
    rule's choice, else FA3's default), each bucket at its first width and at its top."""
    largest_batch = max(DECODE_MAX_BATCH, max(run.batch for run in winners))
    q_lens = sorted({run.max_q_len for run in winners})
    top, largest_top = min(run.kv_len_bucket for run in winners), max(run.kv_len_bucket for run in winners)
    buckets = []
    while top <= largest_top:
        buckets.append(top)
        top *= 2
    content: dict[str, dict[str, int]] = {}
    for batch in range(1, largest_batch + 1):
        for q_len in q_lens:
            for top in buckets:
                config, _ = choose(winners, AttentionRunKey(batch, q_len, top))
                served = dict(config) if config is not None else {"num_splits": 0}  # the default: FA3's own
                for width in (kv_bucket_low(top), top):
                    content[run_key(batch, q_len, width)] = served
    return dict(sorted(content.items(), key=lambda item: int(item[0])))


def _path(record: Record, env: dict[str, Any], export: LightLLMExport) -> str | None:
    """triton_<version>/<device>/<kernel>/<file> for an FA3 winner, or None (left out)."""
    run = record.problem.run_key
    try:
        key = AttentionStaticKey.from_json(record.problem.static_key)
    except (ValueError, TypeError):  # an FA3 key with extras (new k/v, rotary, ...): not LightLLM's call
        export.leave_out("uses an FA3 feature (new k/v, rotary, qv, ...) that LightLLM's decode wrapper never passes")
        return None
    if key.page_size != 1:
        export.leave_out("page size other than 1 (LightLLM's FA3 decode views its cache as page size 1)")
        return None
    if run.max_q_len > MAX_Q_LEN:
        export.leave_out(f"prefill winners (over {MAX_Q_LEN} query tokens; LightLLM's FA3 wrapper runs decode only)")
        return None
    if run.kv_len_bucket > MAX_WIDTH:
        export.leave_out("kv bucket past what LightLLM's packed run key holds (10**7)")
        return None
    missing = [f for f in ("triton", "device", "sgl_kernel") if not env.get(f)]
    if missing or env.get("device_kind") != "cuda":
        export.leave_out(f"its environment names no {', '.join(missing) or 'CUDA device'}")
        return None
    device = device_dir(str(env["device"]))
    parts = [f"triton_{env['triton']}", device, KERNEL,
             config_file_name(static_key_dict(key, str(env["sgl_kernel"])), device)]
    for part, what in zip(parts, ("directory", "directory", "directory", "file name")):
        why = _name_problem(part, what)
        if why is not None:  # its environment's names (an imported device name): the others still export
            export.leave_out(f"environment {record.fingerprint_id}: {why}")
            return None
    return "/".join(parts)
