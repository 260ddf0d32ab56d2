#!/usr/bin/env bash
# Fetch the code bundle named in /etc/trainstack/bundle.env, verify its sha256, unpack it,
# install what the Deep Learning AMI's PyTorch env lacks, and start the agent service.
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

PYTHON=$(python_env)
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

# Pin the AMI's torch and torchvision so that pip can never swap them for a build that misses the driver;
# pip leaves every requirement that is already satisfied alone.
"$PYTHON" -m pip freeze 2>/dev/null | grep -E '^(torch|torchvision)==' >"$work/constraints.txt" || true
"$PYTHON" -m pip install --quiet --no-input --disable-pip-version-check \
  --constraint "$work/constraints.txt" --requirement "$dest/bootstrap/requirements-instance.txt"
log "instance requirements satisfied in $PYTHON"

systemctl daemon-reload
systemctl enable --now trainstack-agent.service
log "trainstack-agent.service started"
