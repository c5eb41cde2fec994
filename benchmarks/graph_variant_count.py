"""How many graph variants the shipped H200 tunings name per capture batch size at a 128k bound
(GraphVariants.plan on the CPU, the runtime made to see the H200's fingerprint and every backend
installed, FA3 first as there), and how many of serving.py's cases (the shipped keys, their
batch sizes and caps) a cap of 2, 4 or 8 variants sends to the base graph where an uncapped
table had a variant for them. No timing: what the records name, not what it gains.

    cd benchmarks && python graph_variant_count.py > results/cpu/graph_variant_count.json
"""
import gzip, json, sys, collections
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import torch
import tuner.db.fingerprint as fp
shipped = json.load(gzip.open(str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tuning_cache" / "h200.tunings.json.gz")))
[(fid, data)] = shipped["fingerprints"].items()
fp.current_fingerprint = lambda: dict(data)
import tuner.runtime.table as table_mod
table_mod.current_fingerprint = fp.current_fingerprint
import tuner
from tuner.integrations.graph_variants import GraphVariants
from tuner.workload import DecodeShape, make_decode_inputs
from tuner.workload.traffic import CAPTURE_BATCHES, DISTRIBUTIONS, draw_lengths
import serving
tuner.configure(db=__import__("tempfile").mkdtemp() + "/none.db", shipped=str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tuning_cache"), mode="lookup")
import tuner.ops.decode_attention as da
import tuner.integrations.decode_attention as ida
every = tuple(da.BACKENDS.values())
da.installed = lambda: every          # as on the H200: FA3 first (its default is the default)
ida.installed = da.installed
BOUND = 131072
out = {}
for name, spec in list(serving.MODELS.items())[:3]:
    spec = dict(spec, dtype="bfloat16")
    per_batch = {}
    for batch in serving.BATCHES:
        shape = DecodeShape(batch=batch, kv_len=64, **{k: v for k, v in spec.items()})
        # meta tensors: only shapes and dtypes are read
        q = torch.empty(batch, 1, shape.num_q_heads, shape.head_dim, dtype=torch.bfloat16, device="meta")
        k = torch.empty(16, shape.page_size, shape.num_kv_heads, shape.head_dim, dtype=torch.bfloat16, device="meta")
        table = torch.empty(batch, BOUND // shape.page_size, dtype=torch.int32, device="meta")
        lens = torch.empty(batch, dtype=torch.int32, device="meta")
        call = (q, k, k, table, lens, BOUND)
        for cap in (None, 4, 2, 8):
            v = GraphVariants(max_variants=100 if cap is None else cap)
            planned = v.plan(batch, [call])
            if cap is None:
                per_batch[batch] = dict(variants=len(planned))
                full = v
            else:
                # serving.py's cases of this batch: does the capped table send them to the base graph
                # where the uncapped one had a variant?
                lost = tot = 0
                for c in serving.CAPS:
                    if batch * c > serving.MAX_TOKENS: continue
                    for d in DISTRIBUTIONS:
                        lens_ = draw_lengths(d, batch, c, 0)
                        tot += 1
                        lost += full.label(batch, lens_) is not None and v.label(batch, lens_) is None
                per_batch[batch][f"cases_to_base_at_cap_{cap}"] = f"{lost}/{tot}"
    out[name] = per_batch
print(json.dumps(out, indent=1))
