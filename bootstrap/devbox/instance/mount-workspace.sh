#!/usr/bin/env bash
# Mount the dev box's workspace at /workspace: the EBS volume `trainstack dev up` attaches once the box runs,
# named by the instance's tag trainstack:dev-workspace (IMDS instance tags). A blank volume is formatted
# once; a volume with a filesystem is never formatted again (docs/internals.md, "The dev box").
set -euo pipefail

# Overridable only so that tests can run this script in a sandbox; the box uses the defaults.
mount_point=${TRAINSTACK_WORKSPACE:-/workspace}
imds=${TRAINSTACK_IMDS:-http://169.254.169.254}/latest
fstab=${TRAINSTACK_FSTAB:-/etc/fstab}
disks=${TRAINSTACK_DISKS:-/dev}
homes=${TRAINSTACK_HOMES:-/home}
attempts=${TRAINSTACK_ATTACH_ATTEMPTS:-150}

log() { printf '{"stage": "mount-workspace", "message": "%s"}\n' "$*"; }

metadata() {
  local token
  token=$(curl -sf -X PUT "$imds/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 300") || return 1
  curl -sf -H "X-aws-ec2-metadata-token: $token" "$imds/meta-data/$1"
}

volume=$(metadata "tags/instance/trainstack:dev-workspace") || {
  log "no trainstack:dev-workspace tag on this instance: start the box with trainstack dev up"
  exit 1
}
# On Nitro instances the volume is an NVMe disk whose serial is the volume id without its dash.
by_id="$disks/disk/by-id/nvme-Amazon_Elastic_Block_Store_${volume//-/}"
device=""
for attempt in $(seq 1 "$attempts"); do
  [ "$attempt" = 1 ] || sleep 2
  for candidate in "$by_id" "$disks/xvdf" "$disks/sdf"; do
    if [ -b "$candidate" ] || { [ -n "${TRAINSTACK_DISKS:-}" ] && [ -e "$candidate" ]; }; then
      device=$(readlink -f "$candidate")
      break 2
    fi
  done
done
if [ -z "$device" ]; then
  log "workspace $volume not attached after 5 minutes: trainstack dev down, then trainstack dev up"
  exit 1
fi

owner=$(id -un 1000 2>/dev/null || echo root)
# blkid -p exits 2 when the device holds no filesystem at all: only then is it new and formatted.
status=0
blkid -p "$device" >/dev/null 2>&1 || status=$?
if [ "$status" = 2 ]; then
  mkfs.ext4 -q -L workspace "$device"
  log "formatted the new workspace $volume"
  fresh=1
elif [ "$status" != 0 ]; then
  log "cannot probe $device ($volume), exit $status: not formatting it; mount it by hand"
  exit 1
fi
mkdir -p "$mount_point"
uuid=$(blkid -s UUID -o value "$device")
# nofail: a reboot without the volume still boots (the box is reachable to find out why).
grep -q " $mount_point " "$fstab" || echo "UUID=$uuid $mount_point ext4 defaults,nofail 0 2" >>"$fstab"
mountpoint -q "$mount_point" || mount "$mount_point"
if [ "${fresh:-0}" = 1 ]; then
  chown "$owner:" "$mount_point"
fi
if [ "$owner" != root ]; then
  ln -sfn "$mount_point" "$homes/$owner/workspace"
fi
log "workspace $volume mounted at $mount_point"
