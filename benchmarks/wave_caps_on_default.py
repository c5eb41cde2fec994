"""Which serving.py cases a cap graph of FA3's default would change, and by how much their
screens say (CPU, no timing): for each case where graph variants ran FA3's plain default,
the wave model's cap for the case's lengths (tuner.ops.fa3_waves.wave_cap, 132 SMs, at the
run's 128k bound) and, where the run screened FA3 at that cap, FA3's default over it. A
case's lengths are drawn again from its distribution, cap and seed; the seed, which rows do
not keep, is the first whose draw has the row's longest and mean lengths.

    python benchmarks/wave_caps_on_default.py RUN.json[.xz] ... > results/cpu/wave_caps_on_default.json
"""

from __future__ import annotations

import json
import lzma
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import heads as head_configs  # noqa: E402
from serving import MAX_CONTEXT, MODELS  # noqa: E402

from tuner.ops.fa3_waves import wave_cap  # noqa: E402
from tuner.workload.traffic import draw_lengths  # noqa: E402

SEEDS = 4000  # the seeds tried per case


def _lengths(row: dict) -> list[int] | None:
    for seed in range(SEEDS):
        lens = draw_lengths(row["distribution"], row["batch"], row["cap"], seed)
        if max(lens) == row["kv_max"] and abs(sum(lens) / len(lens) - row["kv_mean"]) < 1e-6:
            return lens
    return None


def _heads(model: str) -> dict:
    if model in MODELS:
        return MODELS[model]
    return head_configs.parse_spec(model.split()[0].removeprefix("h"))  # "h48/8 (new)"


def _is_fa3_default(config: dict) -> bool:
    return config.get("backend") == "fa3" and config.get("num_splits") == 0 and config.get("pack_gqa") is None \
        and not config.get("wave_fit")


def score(path: Path) -> dict:
    rows = json.load(lzma.open(path) if path.suffix == ".xz" else path.open())["rows"]
    changed, unmatched = [], 0
    for row in rows:
        if not _is_fa3_default(row["tuner"]["graph_variants"]):
            continue
        lens = _lengths(row)
        if lens is None:
            unmatched += 1
            continue
        heads = _heads(row["model"])
        kv = heads["num_kv_heads"]
        cap = wave_cap(lens, num_kv_heads=kv, q_per_kv=heads["num_q_heads"] // kv, q_len=1,
                       head_dim=heads.get("head_dim", 128), table_keys=MAX_CONTEXT, sms=132)
        if not cap:
            continue
        screens = {(c["backend"], c.get("num_splits"), c.get("pack_gqa"), bool(c.get("wave_fit"))): us
                   for us, c in row["screen_us"]}
        default, capped = screens.get(("fa3", 0, None, False)), screens.get(("fa3", cap, None, False))
        graph = row["graph_variants"]
        changed.append(dict(model=row["model"], batch=row["batch"], cap=row["cap"], distribution=row["distribution"],
                            lengths=lens, fa3_cap=cap, screen_default_over_cap=None if capped is None else default / capped,
                            graph_oracle_over_default=graph["oracle_speedup"]))
    screened = [c["screen_default_over_cap"] for c in changed if c["screen_default_over_cap"] is not None]
    return dict(run=str(path), cases=len(rows), capped=len(changed), unmatched=unmatched,
                screened_geomean=math.exp(sum(map(math.log, screened)) / len(screened)) if screened else None,
                cases_capped=changed)


if __name__ == "__main__":
    json.dump([score(Path(p)) for p in sys.argv[1:]], sys.stdout, indent=1)
    print()
