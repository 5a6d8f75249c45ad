#!/usr/bin/env bash
# Starts one edge and one node for the yardstick; both end when this script's process group ends.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
iop=${IOP:-"${PYTHON:-python3} -m iop"}
cd "$here/.."
rm -rf .iop/bench-nats
$iop edge --config bench/yardstick.yaml &
$iop node --config bench/yardstick.yaml --node bench-node &
wait
