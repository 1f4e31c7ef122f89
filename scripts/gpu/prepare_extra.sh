#!/usr/bin/env bash
# Prepares what the lent GPU machine needs beyond ../shared/gpu/prepare.sh's MLX wheels: the
# service's other dependencies (its Python 3.12 has no registry) in .gpu/c, an env.sh that
# installs them, and an empty .gpu/k for the MLX kernel cache carried between windows.
# Run here, in the project root, after ../shared/gpu/prepare.sh. On the GPU machine (call two
# of the README's recipe), carry [".gpu/b", ".gpu/c", ".gpu/k"] and start with
#   source .gpu/c/env.sh || exit 3
# At the end of a window: tar czf $OUT/kernels.tgz -C ~/.cache/runtime mlx-kernels, and copy
# the file into .gpu/k/ for the next window (a cold machine takes minutes to build kernels).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -d .gpu/b ] || { echo "run ../shared/gpu/prepare.sh first" >&2; exit 2; }
mkdir -p .gpu/c .gpu/k
# Versions of this checkout's environment where it has them (a fresh one: the latest): its
# .venv's, not the system Python's (an older typing_extensions there broke anyio's import).
py=python3
[ -x .venv/bin/python3 ] && py=.venv/bin/python3
pins=$($py - <<'E'
from importlib.metadata import version, PackageNotFoundError
names = ["llguidance", "fastapi", "starlette", "uvicorn", "httptools", "uvloop", "pydantic", "pydantic_core",
         "annotated-types", "typing-inspection", "typing_extensions", "anyio", "h11", "click", "sniffio",
         "annotated-doc", "prometheus_client", "httpx", "httpcore", "certifi", "idna", "opentelemetry-api",
         "pytest", "pluggy", "iniconfig", "pytest-asyncio", "hypothesis", "sortedcontainers"]
out = []
for n in names:
    try:
        out.append(f"{n}=={version(n)}")
    except PackageNotFoundError:
        out.append(n)
print(" ".join(out))
E
)
for spec in $pins; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/c "$spec" 2>&1 \
    | grep -v "^WARNING: Location" || true
done
cat > .gpu/c/env.sh <<'E'
# Sourced on the GPU machine from the repo root: MLX (.gpu/b), the other wheels, the kernel cache.
bash .gpu/b/install.sh >/dev/null || return 3
if [ ! -d /root/site2/fastapi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site2 .gpu/c/*.whl || return 4
fi
export PYTHONPATH=/root/site:/root/site2:$PWD
if [ -f .gpu/k/kernels.tgz ] && [ ! -d ~/.cache/runtime/mlx-kernels ]; then
  mkdir -p ~/.cache/runtime && tar xzf .gpu/k/kernels.tgz -C ~/.cache/runtime
fi
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
E
echo "$(ls .gpu/c/*.whl | wc -l) wheels in .gpu/c ($(du -sh .gpu/c | cut -f1)); .gpu/c/env.sh written"
