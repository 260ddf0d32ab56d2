#!/usr/bin/env bash
# Fetch the code bundle named in /etc/trainstack/bundle.env, verify its sha256, unpack it,
# install what the Deep Learning AMI's PyTorch env lacks, and start the agent service.
#
# Boot-time packages come only from the bundle's hashed lock (bootstrap/requirements-instance.lock.txt,
# `make lock`): pip installs with --require-hashes --only-binary=:all:, so no file the lock does not name
# is installed and no package's build code runs. The wheels come from the stack's bucket (code/wheels/,
# uploaded by `pulumi up` under trainstack:networkIsolation) or else from PyPI, downloaded by an
# unprivileged user; root installs only the verified local files, offline. Packages the AMI already has at
# the locked version, and the AMI's own numpy and torch (trainstack_job/bootlock.py), are left as they are.
# Root installs into the AMI's env because the agent and the trainer run with that interpreter.
set -euo pipefail

# Overridable only so that tests can run this script in a sandbox; the instance uses the defaults.
etc_dir=${TRAINSTACK_ETC_DIR:-/etc/trainstack}
install_root=${TRAINSTACK_INSTALL_ROOT:-/opt/trainstack}
pytorch_python=${TRAINSTACK_PYTORCH_PYTHON:-/opt/pytorch/bin/python}

# shellcheck source=/dev/null
. "$etc_dir/bundle.env"

log() { printf '{"stage": "install-agent", "message": "%s"}\n' "$*"; }

python_env() {
  # The DLAMI's PyTorch env carries the CUDA build of torch matched to the driver: always prefer it.
  if [ -x "$pytorch_python" ]; then
    echo "$pytorch_python"
  else
    command -v python3
  fi
}

fetch_bundle() {
  local target=$1
  if command -v aws >/dev/null 2>&1; then
    aws s3 cp --only-show-errors --region "$AWS_REGION" "s3://$BUNDLE_BUCKET/$BUNDLE_KEY" "$target"
  else
    "$PYTHON" -c 'import sys, boto3; boto3.client("s3", region_name=sys.argv[1]).download_file(*sys.argv[2:])' \
      "$AWS_REGION" "$BUNDLE_BUCKET" "$BUNDLE_KEY" "$target"
  fi
}

# The stack's copy of the locked wheels, if `pulumi up` uploaded one; none is no error (PyPI then).
fetch_wheels() {
  local target=$1
  if command -v aws >/dev/null 2>&1; then
    aws s3 cp --only-show-errors --recursive --region "$AWS_REGION" \
      "s3://$BUNDLE_BUCKET/$WHEELS_PREFIX" "$target" >/dev/null 2>&1 || true
  fi
}

# Network-facing pip runs as nobody when this script runs as root: a hostile index or mirror meets an
# unprivileged process, and the hashes decide what root later installs.
as_unprivileged() {
  if [ "$(id -u)" = 0 ] && command -v runuser >/dev/null 2>&1; then
    runuser -u nobody -- env HOME="$1" "${@:2}"
  else
    "${@:2}"
  fi
}

pip_flags=(--no-input --disable-pip-version-check --quiet --require-hashes --only-binary=:all:)

install_offline() {
  "$PYTHON" -m pip install "${pip_flags[@]}" --no-index --find-links "$1" --requirement "$2"
}

# Called in an `if`, where set -e does not apply: every step returns its own failure.
install_locked() {
  local lock=$1 wheels="$work/wheels" wanted="$work/wanted.txt" count
  "$PYTHON" "$dest/trainstack_job/bootlock.py" select "$lock" >"$wanted" || return 1
  if [ ! -s "$wanted" ]; then
    log "every locked package is already installed in $PYTHON"
    return 0
  fi
  count=$(grep -c '==' "$wanted")
  mkdir -p "$wheels" || return 1
  fetch_wheels "$wheels"
  if [ -n "$(ls -A "$wheels")" ] && install_offline "$wheels" "$wanted" 2>"$work/offline.err"; then
    log "$count locked packages installed from the stack's wheels (s3://$BUNDLE_BUCKET/$WHEELS_PREFIX)"
    return 0
  fi
  chmod 711 "$work" && chown nobody "$wheels" 2>/dev/null
  as_unprivileged "$wheels" "$PYTHON" -m pip download "${pip_flags[@]}" --no-cache-dir --no-deps \
    --dest "$wheels" --requirement "$wanted" || return 1
  # Root's copy from here on: nothing unprivileged can swap a file between pip's hash check and its unpack.
  chown -R 0:0 "$wheels" 2>/dev/null
  chmod -R go-w "$wheels" || return 1
  install_offline "$wheels" "$wanted" || return 1
  log "$count locked packages downloaded from the package index and installed"
}

PYTHON=$(python_env)
WHEELS_PREFIX=${WHEELS_PREFIX:-code/wheels/}
dest="$install_root/$BUNDLE_SHA256"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fetched=0
for attempt in 1 2 3 4 5 6; do
  # Instance-role credentials and the S3 endpoint can take a few seconds to be ready at boot.
  if fetch_bundle "$work/bundle.tar.gz"; then
    fetched=1
    break
  fi
  log "bundle fetch attempt $attempt failed; retrying"
  sleep $((attempt * 5))
done
if [ "$fetched" != 1 ]; then
  log "cannot fetch s3://$BUNDLE_BUCKET/$BUNDLE_KEY: check the instance role and that pulumi up uploaded it"
  exit 1
fi

if ! echo "$BUNDLE_SHA256  $work/bundle.tar.gz" | sha256sum --check --status; then
  log "sha256 mismatch for s3://$BUNDLE_BUCKET/$BUNDLE_KEY: the object changed after pulumi up; run pulumi up again"
  exit 1
fi

mkdir -p "$dest"
tar -xzf "$work/bundle.tar.gz" -C "$dest"
ln -sfn "$dest" "$install_root/current"
log "bundle $BUNDLE_SHA256 unpacked to $dest"

# torch and torchvision are never in the lock (a test keeps them out), so pip cannot swap the AMI's
# driver-matched builds; the AMI's numpy stays too.
if ! install_locked "$dest/bootstrap/requirements-instance.lock.txt"; then
  log "cannot install the locked instance packages: reach PyPI, or run make wheels and pulumi up"
  exit 1
fi
log "instance requirements satisfied in $PYTHON"

systemctl daemon-reload
if [ -n "${AGENT_SERVICE:-}" ]; then
  # The dev box's idle watcher (bootstrap/devbox/cloud_init.py).
  systemctl enable --now "$AGENT_SERVICE"
  log "$AGENT_SERVICE started"
  exit 0
fi
systemctl enable --now trainstack-agent.service
log "trainstack-agent.service started"
