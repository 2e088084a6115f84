#!/usr/bin/env bash
# transformer-engine on one lent H200 (issue 16, item 3): TE 2.20.2's core wheel (transformer_engine_cu13,
# 276 MB: five parts in .te/pNN) and its torch extension built there from the sdist against the
# installed torch (2.11.0+cu130, nvcc 13.0), for sm_90 only. Kit: bench/device_kit.sh te.
#   there: bench/h200_te.sh stash .te/pNN    (one call per part, carry [".te/pNN"]: the machine keeps them)
#          bench/h200_te.sh install          (carry .te/small: the core wheel and the small runtime deps)
#          bench/h200_te.sh build            (the torch extension; then `import transformer_engine.pytorch`)
# Everything goes to /tmp/te (on PYTHONPATH after this project's /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
store=/root/te-parts; T=/tmp/te
export PYTHONPATH=$T:$PWD:/tmp/kern:/tmp/site PATH=$T/bin:$PATH
case "$1" in
  stash) mkdir -p "$store"; mv "$2"/* "$store"/; ls "$store" ;;
  install)
    cd "$store"
    [ "$(cat part.* | sha256sum | cut -c1-64)" = "$(cat SUM)" ] || { echo "TE parts incomplete or corrupt:"; ls -l; exit 1; }
    cat part.* > /tmp/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
    cd - >/dev/null
    python3 -m pip install -q --no-index --no-deps --no-compile --target $T /tmp/transformer_engine_cu13-*.whl .te/small/*.whl
    python3 -c "import transformer_engine, onnxscript, einops, nvdlfw_inspect; print('te core', transformer_engine.__file__)" ;;
  build)
    rm -rf /tmp/te-src && mkdir -p /tmp/te-src && tar xzf .te/small/transformer_engine_torch-*.tar.gz -C /tmp/te-src
    [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
    nvcc --version | tail -2; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
    # a wheel, unpacked into $T: `pip install --target` skips a top-level folder that exists
    # (transformer_engine/, the core's), and the extension's .so goes into it
    rm -rf /tmp/te-wheel
    ( cd /tmp/te-src/* && time NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=16 NVTE_BUILD_THREADS_PER_JOB=1 \
        python3 -m pip wheel -v --no-index --no-deps --no-build-isolation -w /tmp/te-wheel . ) 2>&1 | \
        grep -v "^ *\(copying\|creating\|adding\)" | tail -60
    python3 -m zipfile -e /tmp/te-wheel/transformer_engine_torch-*.whl $T
    python3 -c "import transformer_engine.pytorch as te, transformer_engine; print('transformer_engine.pytorch imports', transformer_engine.__version__)" ;;
  *) echo "usage: $0 stash DIR | install | build"; exit 2 ;;
esac
