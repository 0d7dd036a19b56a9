# shellcheck shell=bash
# Shared by scripts/check-cluster and scripts/cluster-demo (source it; needs ROOT, W and say()):
# a real cluster on this machine without Docker (scripts/kube-env start --node: control plane +
# kube-scheduler + containerd/kubelet/kube-proxy in a network namespace), culvert's image built
# here and imported into the node, and a real edge on the node's host-side address that the pods
# reach by name (the harness's DNS answers *.DOMAIN with that address).
#
#   cluster_up DIR DOMAIN    sets KUBECONFIG, NODE_* (DIR/node.env), EDGE, EDGE_PORT, EDGE_CA,
#                            EDGE_ADMIN_KEY, CULVERT (the static binary), CULVERT_IMAGE, EDGE_PID
#   cluster_down DIR         stops the edge and the cluster (idempotent; for traps)
#   edge_admin ARGS...       culvert admin against that edge
#   through HOST PATH        curl https://HOST:EDGE_PORT/PATH through the edge (prints the body)
#
# The image: one static musl binary at /culvert, mode 0555, USER 65532:65532, ENTRYPOINT
# ["/culvert"]: the layout of Dockerfile.multiarch, written by `kubeharness image` (no buildah,
# no registry). CULVERT_IMAGE_OCI=FILE imports an archive made by `make image` instead
# (OCI=... scripts/image); CULVERT_STATIC_BIN=FILE uses that binary instead of building one.
# CLUSTER_EDGE_HTTP_PORT / CLUSTER_EDGE_HTTPS_PORT (default 0: any free port) fix the edge's ports on
# the node link; CLUSTER_EDGE_ARGS adds flags to `culvert edge` (words split on spaces).

KUBE_ENV=$ROOT/scripts/kube-env
CULVERT_TARGET=x86_64-unknown-linux-musl

# culvert_static: a static musl build of this checkout (debug profile without debug info: the
# fastest build that gives a static binary; the release profile's LTO takes much longer).
culvert_static() {
  if [ -n "${CULVERT_STATIC_BIN:-}" ]; then readlink -f "$CULVERT_STATIC_BIN"; return; fi
  local td=${CARGO_TARGET_DIR:-$ROOT/target}
  if ! rustup target list --installed 2>/dev/null | grep -qx "$CULVERT_TARGET"; then
    say "rustup target add $CULVERT_TARGET"
    rustup target add "$CULVERT_TARGET" >&2
  fi
  command -v musl-gcc >/dev/null || {
    say "installing musl-tools with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends musl-tools >/dev/null
  }
  say "cargo build --target $CULVERT_TARGET (static, debug profile without debug info)"
  (cd "$ROOT" && CARGO_PROFILE_DEV_DEBUG=0 CC_x86_64_unknown_linux_musl=musl-gcc \
    cargo build -j"${CARGO_JOBS:-2}" -q --target "$CULVERT_TARGET" --bin culvert) >&2 ||
    { say "the static build of culvert failed"; return 1; }   # not an older binary left in the target dir
  echo "$td/$CULVERT_TARGET/debug/culvert"
}

# chart_image: the image the chart's default values name, as a full reference
chart_image() {
  local repo
  repo=$(awk '/^image:/ {i = 1; next} /^[^ #]/ {i = 0} i && $1 == "repository:" {print $2; exit}' "$ROOT/charts/culvert/values.yaml")
  case ${repo%%/*} in
    *.*| *:* | localhost) ;;
    *) case $repo in */*) repo=docker.io/$repo ;; *) repo=docker.io/library/$repo ;; esac ;;
  esac
  echo "$repo:$(chart_version)"
}

chart_version() { sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/charts/culvert/Chart.yaml" | head -n1; }

# test_ca DOMAIN IP: a throw-away CA and the edge's certificate for DOMAIN, *.DOMAIN and IP (the
# edge's address on the node link: the admin client on the host uses it; pods use edge.DOMAIN).
test_ca() {
  local d=$W/pki
  mkdir -p "$d"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=culvert test CA" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$d/ca.key" -out "$d/ca.pem" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
    -keyout "$d/edge.key" -out "$d/edge.csr" 2>/dev/null
  printf 'subjectAltName=DNS:%s,DNS:*.%s,IP:%s,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n' \
    "$1" "$1" "$2" >"$d/ext"
  openssl x509 -req -in "$d/edge.csr" -CA "$d/ca.pem" -CAkey "$d/ca.key" -CAcreateserial -days 2 \
    -extfile "$d/ext" -out "$d/edge.crt" 2>/dev/null
  cat "$d/ca.pem" >>"$d/edge.crt"
}

cluster_up() {
  local dir=$1 domain=$2 tools ready
  tools=$("$KUBE_ENV" tools)
  export PATH="$tools:$PATH"
  CULVERT=$(culvert_static)
  eval "$("$KUBE_ENV" start --node "$dir")"
  # shellcheck disable=SC1091
  . "$dir/node.env"
  CULVERT_IMAGE=$(chart_image)   # what the chart's defaults name: nothing to override
  if [ -n "${CULVERT_IMAGE_OCI:-}" ]; then
    "$KUBE_ENV" load "$dir" "$CULVERT_IMAGE_OCI"
  else
    "$tools/kubeharness" image --out "$W/culvert-image.tar" --name "$CULVERT_IMAGE" \
      --entrypoint /culvert --user 65532:65532 "$CULVERT=/culvert:0555"
    "$KUBE_ENV" load "$dir" "$W/culvert-image.tar"
  fi
  say "edge: culvert edge --domain $domain on $NODE_HOST_IP (the node's host-side address)"
  mkdir -p "$W/edge"
  test_ca "$domain" "$NODE_HOST_IP"
  "$CULVERT" edge --domain "$domain" --data-dir "$W/edge" --tls-cert "$W/pki/edge.crt" --tls-key "$W/pki/edge.key" \
    --https-addr "$NODE_HOST_IP:${CLUSTER_EDGE_HTTPS_PORT:-0}" --http-addr "$NODE_HOST_IP:${CLUSTER_EDGE_HTTP_PORT:-0}" \
    --admin-addr 127.0.0.1:0 --tcp-bind "$NODE_HOST_IP" --public-host "$NODE_HOST_IP" ${CLUSTER_EDGE_ARGS:-} \
    >"$W/edge.out" 2>"$W/edge.log" &
  EDGE_PID=$!
  local i
  for ((i = 0; i < 300; i++)); do
    ready=$(grep -m1 '^culvert edge ready' "$W/edge.out" 2>/dev/null) && break
    kill -0 "$EDGE_PID" 2>/dev/null || { cat "$W/edge.log" >&2; return 1; }
    sleep 0.1
  done
  [ -n "$ready" ] || { say "the edge did not get ready: $(tail -n 5 "$W/edge.log")"; return 1; }
  EDGE_PORT=$(sed -n 's/.* https=[^ ]*:\([0-9]*\).*/\1/p' <<<"$ready")
  # shellcheck disable=SC2034
  EDGE_HTTP_PORT=$(sed -n 's/.* http=[^ ]*:\([0-9]*\).*/\1/p' <<<"$ready")
  # shellcheck disable=SC2034 # used by the scripts that source this
  EDGE_DOMAIN=$domain
  # shellcheck disable=SC2034
  EDGE=https://edge.$domain:$EDGE_PORT
  EDGE_CA=$W/pki/ca.pem
  EDGE_ADMIN_KEY=$(cat "$W/edge/admin.key")
  # the pods' resolver (kubeharness, on NODE_HOST_IP:53) answers the edge's names
  echo "$NODE_HOST_IP $domain *.$domain" >>"$NODE_HOSTS"
}

edge_admin() {
  "$CULVERT" admin --edge "https://$NODE_HOST_IP:$EDGE_PORT" --key "$EDGE_ADMIN_KEY" --ca-file "$EDGE_CA" "$@"
}

# through HOST PATH: one HTTPS request through the edge, as a client on the internet would make it
through() {
  curl -sS -m 10 --fail --cacert "$EDGE_CA" --resolve "$1:$EDGE_PORT:$NODE_HOST_IP" "https://$1:$EDGE_PORT$2"
}

cluster_down() {
  local dir=$1
  if [ -n "${EDGE_PID:-}" ]; then kill "$EDGE_PID" 2>/dev/null || true; wait "$EDGE_PID" 2>/dev/null || true; EDGE_PID=""; fi
  "$KUBE_ENV" stop "$dir" >/dev/null 2>&1 || true
}
