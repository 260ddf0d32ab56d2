#!/usr/bin/env bash
# Start the agent with the DLAMI's PyTorch env (the one the trainer uses), from the unpacked bundle.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=/opt/pytorch/bin/python
[ -x "$python" ] || python=$(command -v python3)
cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m bootstrap.agent "$@"
