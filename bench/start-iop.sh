#!/usr/bin/env bash
# Starts one edge and one node for the yardstick; both end when this script's process group ends.
# IOP_BENCH_CONFIG names another deployment of the same shape (say, other ports when 18000 is taken).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
iop=${IOP:-"${PYTHON:-python3} -m iop"}
config=${IOP_BENCH_CONFIG:-bench/yardstick.yaml}
cd "$here/.."
if [ -z "${IOP_BENCH_CONFIG:-}" ]; then
  rm -rf .iop/bench-nats
fi
$iop edge --config "$config" &
$iop node --config "$config" --node bench-node &
wait
