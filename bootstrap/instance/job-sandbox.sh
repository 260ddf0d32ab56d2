#!/usr/bin/env bash
# The job's sandbox, before every start of the agent (trainstack-agent.service ExecStartPre): the unprivileged
# user the agent starts the job as (bootstrap/jobuser.py), and a firewall rule that keeps that user away from
# the instance metadata service (IMDS), as container platforms do for their tasks. Without it the job could
# read the instance role's credentials from IMDS: the hop limit of 1 stops containers, not a host process.
# Idempotent, and fail-closed: if the rule cannot be installed the agent does not start (its failures reach
# trainstack-giveup.service, which scales the group to zero and says why).
set -euo pipefail

job_user=${TRAINSTACK_JOB_USER:-trainstack-job}
imds_v4=169.254.169.254
imds_v6=fd00:ec2::254

log() { printf '{"stage": "job-sandbox", "message": "%s"}\n' "$*"; }

ensure_user() {
  if id -u "$job_user" >/dev/null 2>&1; then
    return 0
  fi
  # A system user: no password, no login shell, no home on the root volume (the agent gives it one in
  # scratch), no supplementary groups.
  useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$job_user"
  log "created user $job_user"
}

ipv6_on() { [ -e /proc/net/if_inet6 ]; }

with_iptables() {
  local tool=$1 address=$2
  local rule=(OUTPUT -m owner --uid-owner "$job_user" -d "$address" -j REJECT)
  # First in the chain: no earlier ACCEPT may let the job through.
  "$tool" -w -C "${rule[@]}" 2>/dev/null || "$tool" -w -I "${rule[@]}"
}

with_nft() {
  local ipv6_rule=""
  if ipv6_on; then
    ipv6_rule="meta skuid \"$job_user\" ip6 daddr $imds_v6 reject"
  fi
  # A table of our own, replaced whole: a reject in any table's output hook is final for the packet.
  nft -f - <<NFT
table inet trainstack
delete table inet trainstack
table inet trainstack {
  chain output {
    type filter hook output priority 0; policy accept;
    meta skuid "$job_user" ip daddr $imds_v4 reject
    $ipv6_rule
  }
}
NFT
}

ensure_user
if command -v iptables >/dev/null 2>&1; then
  with_iptables iptables "$imds_v4"
  if ipv6_on; then
    if command -v ip6tables >/dev/null 2>&1; then
      with_iptables ip6tables "$imds_v6"
    else
      log "ip6tables missing with IPv6 on: cannot close $imds_v6"
      exit 1
    fi
  fi
elif command -v nft >/dev/null 2>&1; then
  with_nft
else
  log "neither iptables nor nft: cannot keep $job_user away from IMDS"
  exit 1
fi
log "$job_user may not reach IMDS ($imds_v4, $imds_v6)"
