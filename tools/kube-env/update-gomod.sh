#!/usr/bin/env bash
# Regenerates tools/kube-env/go.mod + go.sum for a given k8s.io/kubernetes release.
#
#   tools/kube-env/update-gomod.sh v1.36.5
#
# k8s.io/kubernetes requires every staging module (k8s.io/api, client-go, ...) at the placeholder
# version v0.0.0 and maps it to ./staging/src/... with replace directives that are ignored when the
# module is a dependency. So we read that replace list from the module's own go.mod (fetched into the
# module cache by `go mod download`) and pin each staging module to the matching v0.X.Y release.
set -euo pipefail
cd "$(dirname "$0")"
KV=${1:?usage: $0 v1.36.N}
SV=v0.${KV#v1.}                 # v1.36.5 -> v0.36.5
[ -f go.mod ] || go mod init example.invalid/kubeharness
GOMOD=$(go mod download -json "k8s.io/kubernetes@$KV" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[ -n "$GOMOD" ] || { echo "k8s.io/kubernetes@$KV is not served" >&2; exit 1; }
# drop the old k8s.io replaces, then add one per staging module
for m in $(sed -n 's|^\t*\(replace \)\{0,1\}\(k8s\.io/[a-z0-9-]*\) => k8s\.io/.*|\2|p' go.mod); do
  go mod edit -dropreplace="$m"
done
for m in $(sed -n 's|^\t\(k8s\.io/[a-z0-9-]*\) => \./staging/.*|\1|p' "$GOMOD"); do
  go mod edit -replace="$m=$m@$SV"
done
go mod edit -go="$(sed -n 's/^go //p' "$GOMOD")"
go get "k8s.io/kubernetes@$KV"
go get -tool "k8s.io/kubernetes/cmd/kubectl@$KV"
go mod tidy
# cosmetic: gather the single-line replace directives into one block
awk '/^replace [^(]/ { sub(/^replace /, "\t"); r = r $0 "\n"; next } { print }
     END { if (r != "") printf "\nreplace (\n%s)\n", r }' go.mod | cat -s >go.mod.new && mv go.mod.new go.mod
go mod edit -fmt
echo "go.mod now pins k8s.io/kubernetes $KV and $(grep -c "=> k8s.io/.* $SV" go.mod) staging modules at $SV"
