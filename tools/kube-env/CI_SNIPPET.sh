# --- kube-env: real Kubernetes control plane for the tests (tools/kube-env/README.md) ---
# Merge into .ci/run before the test command (the script is expected to run with `set -euo pipefail`).
# A fresh machine pays the cold build (module downloads + compile, see README); later runs on the
# same machine reuse GOMODCACHE/GOCACHE and the binaries in target/kube-env/bin.
kube_env_t0=$(date +%s)
scripts/kube-env build
echo "kube-env: harness/kubectl/helm build took $(( $(date +%s) - kube_env_t0 ))s"
kube_env_stop() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -d .kube-env/logs ]; then
    echo "--- kube-env logs (exit $rc) ---"
    tail -n 40 .kube-env/harness.log .kube-env/logs/*.log 2>/dev/null || true
  fi
  scripts/kube-env stop .kube-env || true
}
trap kube_env_stop EXIT
eval "$(scripts/kube-env start .kube-env)"          # prints: export KUBECONFIG=$PWD/.kube-env/kubeconfig
export CULVERT_KUBECONFIG="$KUBECONFIG"
export PATH="$PWD/target/kube-env/bin:$PATH"       # kubectl, helm
kubectl version
# ... cargo test -j2 ... (tests/kube_smoke.rs and others use CULVERT_KUBECONFIG; with CI set they fail, not skip, without it)
