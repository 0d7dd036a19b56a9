#!/usr/bin/env bash
# Installs the culvert edge on a VPS with systemd:
#   sudo deploy/install-edge.sh [BINARY]
# BINARY defaults to ./culvert, then dist/linux-<arch>/culvert (make zigbuild), then
# target/release/culvert. Installs /usr/local/bin/culvert, the system user `culvert`,
# /etc/systemd/system/culvert-edge.service, /etc/culvert/edge.env (mode 0600; kept if it exists),
# the directory /etc/culvert/tls for certificate files, and a certbot deploy hook when certbot is
# there. Starts nothing: it prints the next steps. DESTDIR=/tmp/stage installs into a staging
# tree instead (no user, no systemctl; for packaging and tests).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
DESTDIR=${DESTDIR:-}
say() { echo "install-edge: $*" >&2; }

if [ -z "$DESTDIR" ] && [ "$(id -u)" != 0 ]; then
  say "run as root (sudo $0)"; exit 1
fi
case "$(uname -m)" in
  x86_64) arch=amd64 ;; aarch64) arch=arm64 ;; armv7l) arch=arm-v7 ;; *) arch=$(uname -m) ;;
esac
bin=${1:-}
if [ -z "$bin" ]; then
  for c in ./culvert "$here/../dist/linux-$arch/culvert" "$here/../target/release/culvert"; do
    if [ -x "$c" ]; then bin=$c; break; fi
  done
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  say "no culvert binary found: give its path (sudo $0 /path/to/culvert), or build one (make zigbuild, or cargo build --release)"
  exit 1
fi
version=$("$bin" --version) || { say "$bin does not run on this machine ($(uname -m))"; exit 1; }

install -D -m 0755 "$bin" "$DESTDIR/usr/local/bin/culvert"
say "installed $version as /usr/local/bin/culvert"

if [ -z "$DESTDIR" ]; then
  if ! getent passwd culvert >/dev/null; then
    useradd --system --user-group --home-dir /var/lib/culvert --no-create-home --shell /usr/sbin/nologin culvert
    say "created the system user culvert"
  fi
  group=culvert
else
  group=$(id -g)
fi

install -d -m 0755 "$DESTDIR/etc/culvert"
install -d -m 0750 -g "$group" "$DESTDIR/etc/culvert/tls"
env_file=$DESTDIR/etc/culvert/edge.env
if [ -e "$env_file" ]; then
  say "kept the existing /etc/culvert/edge.env"
else
  (umask 077 && cat >"$env_file" <<'ENV')
# Settings of the culvert edge (CULVERT_* variables: `culvert edge --help` lists them all).
# After a change: systemctl restart culvert-edge. Mode 0600: it may hold secrets.
CULVERT_DOMAIN=edge.example.com

# The certificate for DOMAIN and *.DOMAIN, either
# (a) from files, reloaded when they change (certbot renewal) and on `systemctl reload`:
CULVERT_TLS_CERT=/etc/culvert/tls/fullchain.pem
CULVERT_TLS_KEY=/etc/culvert/tls/privkey.pem
# (b) or obtained and renewed by the edge itself with ACME DNS-01 (remove the two lines above):
#CULVERT_ACME=true
#CULVERT_ACME_EMAIL=ops@example.com
#CULVERT_ACME_DNS01=rfc2136
#CULVERT_ACME_DNS01_SERVER=203.0.113.53
#CULVERT_ACME_DNS01_ZONE=example.com
#CULVERT_ACME_DNS01_TSIG_KEY=culvert
#CULVERT_ACME_DNS01_TSIG_SECRET=base64-secret-from-tsig-keygen
#   ... or with your DNS provider's tool: CULVERT_ACME_DNS01=hook and
#CULVERT_ACME_DNS01_HOOK=/usr/local/lib/culvert/dns01-hook
# (it must be readable and executable by the user culvert; ProtectHome=yes hides /home and /root).

# Custom domains with certificates from ACME (TLS-ALPN-01 on 443) need CULVERT_ACME=true too.
#CULVERT_TCP_PORTS=20000-20999
#CULVERT_DRAIN_SECONDS=25
ENV
  chmod 0600 "$env_file"
  say "wrote /etc/culvert/edge.env (mode 0600): edit it"
fi

install -D -m 0644 "$here/culvert-edge.service" "$DESTDIR/etc/systemd/system/culvert-edge.service"
say "installed /etc/systemd/system/culvert-edge.service"
if [ -d "$DESTDIR/etc/letsencrypt/renewal-hooks/deploy" ]; then
  install -m 0755 "$here/certbot-deploy-hook" "$DESTDIR/etc/letsencrypt/renewal-hooks/deploy/culvert-edge"
  say "installed the certbot deploy hook /etc/letsencrypt/renewal-hooks/deploy/culvert-edge"
fi
if [ -z "$DESTDIR" ]; then
  systemctl daemon-reload
fi

cat <<'NEXT'

Next steps:
  1. Edit /etc/culvert/edge.env: CULVERT_DOMAIN and one way to the certificate.
  2. DNS: DOMAIN and *.DOMAIN -> this machine (A/AAAA records).
  3. Certificate files (option a): copy fullchain.pem and privkey.pem to /etc/culvert/tls/
     (group culvert, privkey.pem mode 0640). With certbot, the first copy is
       RENEWED_LINEAGE=/etc/letsencrypt/live/DOMAIN /etc/letsencrypt/renewal-hooks/deploy/culvert-edge
     and every renewal runs that hook again.
  4. Firewall: open 443/tcp, 80/tcp and the TCP reservation range (20000-20999/tcp).
  5. systemctl enable --now culvert-edge
     journalctl -u culvert-edge -f        (look for "edge ready")
     The admin key is in /var/lib/culvert/admin.key (root can read it: sudo cat ...).
NEXT
