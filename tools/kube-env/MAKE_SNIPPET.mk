# kube-env: a real Kubernetes control plane for the tests (see tools/kube-env/README.md).
# Merge into the main Makefile.
KUBE_ENV_DIR ?= .kube-env

.PHONY: kube-env kube-env-start kube-env-stop

# Build kubeharness, kubectl and helm into target/kube-env/bin (no-op when up to date).
kube-env:
	scripts/kube-env build

# Start etcd + kube-apiserver + kube-controller-manager in the background; then
#   export CULVERT_KUBECONFIG=$(CURDIR)/$(KUBE_ENV_DIR)/kubeconfig
kube-env-start:
	scripts/kube-env start $(KUBE_ENV_DIR)

kube-env-stop:
	scripts/kube-env stop $(KUBE_ENV_DIR)
