#!/usr/bin/env bash
# Pack the CUDA stack a device machine lacks (fbgemm-gpu 1.6.0 for its torch 2.11, torchrec 1.6.1, torchrec's and the
# app's pure-Python needs) into .gpusite/p0 and .gpusite/p1, two parts under the 64 MiB a device call may carry.
# fbgemm's kernels are kept for one GPU architecture only (scripts/prune_fatbin.py; default 90: H100 / H200).
#
#   bash scripts/gpu_pack.sh [ARCH]          # here, once (~3 min): needs ../shared/tools/gpu-wheels.sh, readelf, xz
# On the device machine, two calls back to back (it stays warm 30 s), /tmp surviving between them:
#   carry .gpusite/p0:  mkdir -p /tmp/g && cp .gpusite/p0/* /tmp/g/
#   carry .gpusite/p1:  mkdir -p /tmp/site && cat /tmp/g/* .gpusite/p1/* | xz -d -T4 | tar -x -C /tmp/site &&
#                       export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_check.sh info cuda bench
set -euo pipefail
ARCH=${1:-90}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bash ../shared/tools/gpu-wheels.sh >/dev/null
site=$work/site
mkdir -p "$site"
unzip -q .gpuwhl/big/fbgemm.whl -d "$site"
python3 scripts/prune_fatbin.py "$ARCH" "$site"/fbgemm_gpu/*.so
for w in .gpuwhl/small/*.whl; do unzip -q -o "$w" -d "$site"; done
# pure-Python packages published as source archives only: their package folders are all they need
python3 -m pip download -q --no-deps -d "$work/src" iopath==0.1.10
for a in .gpuwhl/small/antlr4-python3-runtime-4.9.3.tar.gz "$work"/src/iopath-0.1.10.tar.gz; do
  tar -xzf "$a" -C "$work"
done
cp -r "$work"/antlr4-python3-runtime-4.9.3/src/antlr4 "$work"/iopath-0.1.10/iopath "$site"/
grep -qx '/.gpusite/' .git/info/exclude 2>/dev/null || echo '/.gpusite/' >> .git/info/exclude
rm -rf .gpusite && mkdir -p .gpusite/p0 .gpusite/p1
tar -C "$site" -cf - . | xz -T2 -6 > "$work/site.tar.xz"
split -n 2 -d -a 2 "$work/site.tar.xz" "$work/site.part-"
mv "$work/site.part-00" .gpusite/p0/ && mv "$work/site.part-01" .gpusite/p1/
ls -la .gpusite/p0 .gpusite/p1
