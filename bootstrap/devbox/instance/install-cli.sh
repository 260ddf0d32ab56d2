#!/usr/bin/env bash
# The trainstack CLI on the dev box, after install-agent.sh has unpacked the box's bundle (the agent's
# packages plus trainstack/ and infra/, infra/bundle.py DEV_BOX_PACKAGES) to /opt/trainstack/current:
# a venv that sees the AMI's env (its torch, and the instance lock's boto3 and pyyaml) with the CLI's own
# locked packages (bootstrap/devbox/requirements-cli.lock.txt: rich and what it needs), and the command
# /usr/local/bin/trainstack, which reads the stack's outputs the user-data wrote (no Pulumi on the box).
#
# As install-agent.sh: an unprivileged user downloads the wheels with --require-hashes --only-binary=:all:,
# root installs only those verified files, offline. Its own venv, not the AMI's env: what the user installs
# there for their work cannot change the CLI's packages, nor the CLI's theirs.
set -euo pipefail

# Overridable only so that tests can run this script in a sandbox; the box uses the defaults.
install_root=${TRAINSTACK_INSTALL_ROOT:-/opt/trainstack}
pytorch_python=${TRAINSTACK_PYTORCH_PYTHON:-/opt/pytorch/bin/python}
bin_dir=${TRAINSTACK_BIN_DIR:-/usr/local/bin}
outputs=${TRAINSTACK_OUTPUTS_FILE:-/etc/trainstack/stack-outputs.json}
code="$install_root/current"
lock=${TRAINSTACK_CLI_LOCK:-$code/bootstrap/devbox/requirements-cli.lock.txt}

log() { printf '{"stage": "install-cli", "message": "%s"}\n' "$*"; }

venv="$install_root/cli"
if [ ! -f "$lock" ] || [ ! -f "$code/trainstack/__main__.py" ]; then
  log "no trainstack CLI in $code: the dev template must boot the dev bundle (infra/devbox.py); run pulumi up"
  exit 1
fi
# The DLAMI's PyTorch env, as the agent's: a job's code tried here imports the same torch.
if [ -x "$pytorch_python" ]; then
  python=$pytorch_python
else
  python=$(command -v python3)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

rm -rf "$venv"
# No pip of its own: `python -m pip` in the venv is the AMI env's, seen through the .pth, and installs into
# the venv. The .pth names the AMI env's site-packages after the venv's own (--system-site-packages would
# see the interpreter's base, not the AMI's own venv).
"$python" -m venv --without-pip "$venv"
site_packages=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$python" -c 'import site, sysconfig
p = sysconfig.get_paths()
print(*dict.fromkeys([p["purelib"], p["platlib"], *site.getsitepackages()]), sep="\n")' \
  >"$site_packages/_trainstack_ami_env.pth"

pip_flags=(--no-input --disable-pip-version-check --quiet --require-hashes --only-binary=:all: --no-deps)
wheels="$work/wheels"
mkdir -p "$wheels"
download=("$python" -m pip download "${pip_flags[@]}" --no-cache-dir --dest "$wheels" --requirement "$lock")
if [ "$(id -u)" = 0 ] && command -v runuser >/dev/null 2>&1; then
  # A hostile index or mirror meets an unprivileged process; the hashes decide what root installs.
  chmod 711 "$work" && chown nobody "$wheels"
  download=(runuser -u nobody -- env HOME="$wheels" "${download[@]}")
fi
if ! "${download[@]}"; then
  log "cannot download the CLI's locked packages ($lock) from the package index: the box needs PyPI over https"
  exit 1
fi
chown -R "$(id -u):$(id -g)" "$wheels"
chmod -R go-w "$wheels"
# --ignore-installed: the lock's versions in the venv, whatever the AMI's env holds of the same packages.
if ! "$venv/bin/python" -m pip install "${pip_flags[@]}" --ignore-installed --no-index --find-links "$wheels" \
  --requirement "$lock"; then
  log "cannot install the CLI's locked packages into $venv: see pip's error above"
  exit 1
fi
# The user cannot write root's copy of the code: compiled once here, or on every command.
"$venv/bin/python" -m compileall -q "$code/"

# PYTHONSAFEPATH: `python -m` would put the working folder first on sys.path, and a folder of the user's
# named like one of the CLI's packages (training/, infra/) would shadow it. TRAINSTACK_OUTPUTS is the default
# of --outputs, which a command line still overrides.
mkdir -p "$bin_dir"
cat >"$work/trainstack" <<EOF
#!/bin/sh
# trainstack on the dev box (bootstrap/devbox/instance/install-cli.sh): the CLI of the box's bundle.
export TRAINSTACK_OUTPUTS="\${TRAINSTACK_OUTPUTS:-$outputs}"
export PYTHONPATH="$code\${PYTHONPATH:+:\$PYTHONPATH}"
export PYTHONSAFEPATH=1
exec "$venv/bin/python" -m trainstack "\$@"
EOF
install -m 0755 "$work/trainstack" "$bin_dir/trainstack"
log "trainstack installed as $bin_dir/trainstack (venv $venv, code $code)"
