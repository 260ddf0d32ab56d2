#!/usr/bin/env bash
# Freeze the OS under the GPU driver: no unattended upgrades, no apt timers, driver and kernel held.
# A kernel or driver upgrade on a running instance leaves nvidia-smi broken after the next module load.
set -euo pipefail

log() { printf '{"stage": "prepare-os", "message": "%s"}\n' "$*"; }

disable_units() {
  local unit
  for unit in "$@"; do
    # Units the AMI does not ship are fine to skip; any other failure is worth seeing in the log.
    if systemctl list-unit-files "$unit" >/dev/null 2>&1; then
      systemctl disable --now "$unit" >/dev/null 2>&1 || log "could not disable $unit"
      systemctl mask "$unit" >/dev/null 2>&1 || true
    fi
  done
}

retry() {
  # The dpkg lock may still be held by an upgrade that started at boot; wait for it rather than fail.
  local attempt
  for attempt in $(seq 1 60); do
    if "$@"; then
      return 0
    fi
    log "waiting for the package manager (attempt $attempt): $*"
    sleep 5
  done
  return 1
}

hold_debian_packages() {
  local packages
  packages=$(dpkg-query -W -f='${db:Status-Abbrev} ${binary:Package}\n' \
    'nvidia-*' 'libnvidia-*' 'cuda-drivers*' 'linux-image-*' 'linux-headers-*' 'linux-modules-*' \
    'linux-aws*' 'linux-generic*' 2>/dev/null | awk '$1 == "ii" {print $2}')
  if [ -n "$packages" ]; then
    # shellcheck disable=SC2086  # one word per package name is what apt-mark wants
    retry apt-mark hold $packages >/dev/null
    log "held $(echo "$packages" | wc -l) driver and kernel packages"
  fi
}

hold_rpm_packages() {
  retry dnf -y -q install 'dnf-command(versionlock)' >/dev/null 2>&1 || return 0
  retry dnf -q versionlock add 'kernel*' 'nvidia*' 'cuda-drivers*' >/dev/null 2>&1 || log "no versionlock"
  log "version-locked driver and kernel packages"
}

disable_units unattended-upgrades.service apt-daily.timer apt-daily-upgrade.timer \
  apt-daily.service apt-daily-upgrade.service dnf-automatic.timer dnf-makecache.timer

if command -v apt-mark >/dev/null 2>&1; then
  hold_debian_packages
elif command -v dnf >/dev/null 2>&1; then
  hold_rpm_packages
fi
log "done"
