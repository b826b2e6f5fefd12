#!/usr/bin/env bash
# Repack the GPU wheels that ../shared/tools/gpu-wheels.sh prepares so that each of the two device calls
# carries less than 64 MiB with this checkout (about 9 MB of tracked files): the CuTe DSL's cu13 libraries
# (a 92 MB wheel) travel unpacked and xz-compressed (64 MB), split 50 MB / the rest.
#
#   bash ../shared/tools/gpu-wheels.sh && bash scripts/gpu_wheels_xz.sh     # here, once (xz: ~3 min)
#   device run, carry [".whl-a"]:                 mkdir -p /tmp/wheels && cp .whl-a/* /tmp/wheels/
#   device run, carry [".whl-b", ".whl"] (at once after): source .whl-b/install.sh && bash scripts/gpu_session.sh STEP
#
# install.sh installs the wheels into /tmp/site (pip --target), then unpacks the cu13 libraries over them
# (after pip: its --upgrade replaces the nvidia_cutlass_dsl folder the wheels share), and exports PYTHONPATH.
set -eu
cd "$(git rev-parse --show-toplevel)"
[ -f .whl-a/cu13.part.aa ] && [ -f .whl-b/cu13.part.ab ] || { echo "run ../shared/tools/gpu-wheels.sh first"; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat .whl-a/cu13.part.aa .whl-b/cu13.part.ab > "$work/cu13.whl"
mkdir "$work/files" && python3 -m zipfile -e "$work/cu13.whl" "$work/files"
tar cf - -C "$work/files" . | xz -9e -T0 > "$work/cu13.tar.xz"
rm -f .whl-a/cu13.part.aa .whl-b/cu13.part.ab .whl-b/wheel-name .whl-b/install.sh
mv .whl-a/*.whl .whl-b/
split -b 50000000 "$work/cu13.tar.xz" .whl-a/cu13x.part.
mv .whl-a/cu13x.part.ab .whl-b/
cat > .whl-b/install.sh <<'SH'
# On the GPU machine, from the checkout's root (see scripts/gpu_wheels_xz.sh).
[ -f /tmp/wheels/cu13x.part.aa ] || { echo "no /tmp/wheels/cu13x.part.aa: make the .whl-a call first (the machine was given back)"; return 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl .whl-b/*.whl || return 1
cat /tmp/wheels/cu13x.part.aa .whl-b/cu13x.part.ab | xz -dc | tar xf - -C /tmp/site || return 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
SH
du -sh .whl .whl-a .whl-b
