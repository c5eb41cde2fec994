#!/bin/bash
# Builds .gpu/sglang/ (git-ignored): SGLang 0.5.17 and the wheels its offline benchmark
# (bench_one_batch, a dense model, dummy weights, TP 1) imports beyond what
# ../shared/gpu/prepare stages (sgl-kernel 0.4.5, FlashInfer 0.6.15.post1, SQLAlchemy) and
# the GPU image has, as one installed tree of about 32 MiB: one call carries it.
#
#   bash tools/prepare_sglang.sh                       # here, once (downloads ~100 MB)
#   run: "source .gpu/bin/activate && bash .gpu/sglang/install && python benchmarks/sglang_e2e.py ..."
#        carrying .gpu/bin and .gpu/sglang (after the four staging calls of ../shared/gpu/README.md)
#
# Why these and not SGLang's ~70 requirements: docs/lab/sglang_integration_notes.md
# ("Staging SGLang"). transformers and tokenizers are pinned below the image's (its
# transformers 5.17 breaks SGLang 0.5.17 at import); fastapi 0.141.1 is the last without
# opentelemetry; xgrammar is repacked without its C++ static library (65 MB, never loaded).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out="$root/.gpu/sglang"
cache=${TUNER_GPU_CACHE:-$HOME/.cache/tuner-gpu}/sglang-0.5.17
wheels=(sglang==0.5.17 xgrammar==0.2.1 transformers==5.12.1 tokenizers==0.22.2 pydantic==2.14.4
        pydantic-core==2.50.5 openai==2.6.1 pyzmq==27.3.0 ipython==9.18.1 compressed-tensors==0.20.1
        msgspec==0.23.0 fastapi==0.141.1 orjson==3.13.0 dill==0.4.1 gguf==0.19.0 pybase64==1.5.1
        uvicorn==0.55.0 traitlets==5.16.1 starlette==1.10.0 loguru==0.7.3 typing-extensions==4.16.0
        setproctitle==1.3.8 distro==1.9.0 typing-inspection==0.4.5 annotated-types==0.8.0
        partial-json-parser==0.2.1.1.post7 sniffio==1.3.1)
mkdir -p "$cache/whl" "$out"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -q -d "$cache/whl" "${wheels[@]}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the installed tree, as the GPU machine's /tmp/site will hold it
python3 -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" --python-version 3.12 \
  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --only-binary=:all: "$cache"/whl/*.whl
rm -f "$tmp"/site/xgrammar/lib/libxgrammar.a  # a C++ static library, never loaded by Python
tar -C "$tmp/site" -cf - . | zstd -T0 -19 --long=30 -q -o "$out/site.tar.zst"
cat > "$out/install" <<'EOF'
#!/bin/bash
# on the GPU machine, after .gpu/bin/activate: SGLang's tree over /tmp/site (its transformers
# and tokenizers shadow the image's), offline
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/site
# the image may lack zstd: the staging parts bring one
z=zstd; command -v zstd >/dev/null || { chmod +x /tmp/stage/zstd; z=/tmp/stage/zstd; }
$z -d --long=30 -q -c "$here/site.tar.zst" | tar -C /tmp/site -x
echo "staged SGLang 0.5.17 into /tmp/site"
EOF
chmod +x "$out/install"
du -sh "$out"/site.tar.zst
