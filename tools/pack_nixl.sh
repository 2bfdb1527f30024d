#!/usr/bin/env bash
# Downloads the NIXL wheel (nixl-cu13 by default) and repacks what pdserve's NIXL backend and
# bench_kvtransfer.py use into a .tar.xz under .gpu/nixl/ (ignored by git), to carry to a GPU host
# that has no registry: the Python API, its native libraries, the bundled UCX and the UCX plugin.
# Left out: the expert-parallel package (nixl_ep_*), the other plugins (storage, libfabric, ...),
# headers and example binaries. On the GPU host:
#   mkdir -p /tmp/nixl && tar -xJf .gpu/nixl/nixl-cu13-1.5.1-cp312.tar.xz -C /tmp/nixl
#   PYTHONPATH=/tmp/nixl python -m benchmarks.bench_kvtransfer --device cuda
# Usage: tools/pack_nixl.sh [FLAVOUR (cu13|cu12)] [VERSION] [PYTHON_VERSION (e.g. 3.12)]
set -euo pipefail
flavour=${1:-cu13}
version=${2:-1.5.1}
pyver=${3:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
tag=cp${pyver/./}
root=$(cd "$(dirname "$0")/.." && pwd)
out=$root/.gpu/nixl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$work" "nixl-$flavour==$version"
wheel=$(ls "$work"/nixl_"$flavour"-"$version"-*.whl)
mkdir -p "$work/site" "$out"
python3 - "$wheel" "$work/site" "$flavour" <<'PY'
import sys, zipfile
wheel, dest, flavour = sys.argv[1:]
pkg, libs, mlibs = f"nixl_{flavour}/", f"nixl_{flavour}.libs/", f".nixl_{flavour}.mesonpy.libs/"
def keep(name: str) -> bool:
    if name.startswith(pkg):
        return True
    for prefix in (libs, mlibs):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest.startswith(("nixl/", "plugins/")):  # plugins: UCX only
                return "libplugin_UCX" in rest
            return not rest.endswith(".la") and "perftest" not in rest
    return ".dist-info/" in name and not name.endswith("RECORD")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if keep(n)]
    z.extractall(dest, names)
print(f"kept {len(names)} of {len(zipfile.ZipFile(wheel).namelist())} files")
PY
tarball=$out/nixl-$flavour-$version-$tag.tar.xz
tar -C "$work/site" -cJf "$tarball" .
echo "$tarball: $(du -h "$tarball" | cut -f1) (wheel $(du -h "$wheel" | cut -f1))"
