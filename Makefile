# culvert: run `make help` for the list.
.DEFAULT_GOAL := help
CARGO ?= cargo
KUBE_ENV_DIR ?= .kube-env

.PHONY: help build release demo test lint fmt kube-env kube-env-start kube-env-stop clean

help: ## List the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  make %-16s %s\n", $$1, $$2}'

build: ## Build the culvert binary (debug)
	$(CARGO) build -j2 --bin culvert

release: ## Build the release binary (size-tuned, LTO) into target/release/culvert
	$(CARGO) build -j2 --release --bin culvert

bench: ## Benchmark vs the direct path and nginx (release build; BENCH_QUICK=1: ~2 min smoke)
	bench/run

.PHONY: bench

demo: ## Edge + app + agent on this machine, ending with a curl through the edge
	scripts/demo

test: ## Run every test (starts the real Kubernetes control plane first)
	scripts/test

fuzz: ## Run each fuzz target of fuzz/ for FUZZ_SECONDS (default 30); fails on a crash, leaving the input in fuzz/artifacts/
	scripts/fuzz

.PHONY: fuzz

lint: ## rustfmt check, clippy with warnings as errors, shellcheck, pyflakes, actionlint of the workflows, README names exist
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy -j2 --all-targets -- -D warnings
	shellcheck -S warning $(filter-out scripts/check-readme scripts/check-deps scripts/lib,$(wildcard scripts/*)) scripts/lib/*.sh .ci/run
	shellcheck -S warning deploy/install-edge.sh deploy/certbot-deploy-hook
	pyflakes3 bench/run bench/counts bench/pairs scripts/check-readme scripts/check-deps tools/chart-readme.py
	scripts/actionlint
	scripts/check-readme
	scripts/check-deps

fmt: ## Format the code
	$(CARGO) fmt --all

kube-env: ## Build the control plane harness, kubectl and helm (cached)
	scripts/kube-env build

kube-env-start: ## Start the control plane in $(KUBE_ENV_DIR); then export CULVERT_KUBECONFIG=$(KUBE_ENV_DIR)/kubeconfig
	scripts/kube-env start $(KUBE_ENV_DIR)

kube-env-stop: ## Stop the control plane
	scripts/kube-env stop $(KUBE_ENV_DIR)

clean: ## Remove build outputs
	$(CARGO) clean

# --- Shipping: chart, manifests, static binaries, image, kind ----------------------------------
TARGET ?= x86_64-unknown-linux-musl
TARGETS := x86_64-unknown-linux-musl aarch64-unknown-linux-musl armv7-unknown-linux-musleabihf
# zigbuild (no Docker) or cross (Docker) builds the binaries of `make image`.
BUILDER ?= zigbuild
IMAGE ?= ghcr.io/culvert-dev/culvert:$(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
PLATFORMS ?= linux/amd64,linux/arm64,linux/arm/v7
# dist/linux-<arch>[-<variant>]/culvert, the layout Dockerfile.multiarch copies from.
dist_dir = dist/linux-$(if $(findstring x86_64,$(1)),amd64,$(if $(findstring aarch64,$(1)),arm64,arm-v7))

.PHONY: crds chart chart-readme k3s-manifests check-manifests check-hardened zigbuild check-cross cross image check-image kind-demo kind-clean

crds: ## Regenerate crds/culvert.yaml with `culvert crd` (then run `make chart k3s-manifests`)
	$(CARGO) run -q -j2 --bin culvert -- crd > crds/culvert.yaml

chart: ## Chart CRD template from crds/culvert.yaml, then helm lint (no Rust needed)
	scripts/gen-manifests chart
	"$$(scripts/kube-env tools)/helm" lint --strict charts/culvert

chart-readme: ## Regenerate the values table of charts/culvert/README.md from values.yaml comments
	tools/chart-readme.py

k3s-manifests: chart ## Regenerate k3s-manifests/ (k3s HelmChart with the chart inline + plain render)
	scripts/gen-manifests k3s

check-manifests: ## Drift, helm lint, bad values, server dry-run of every manifest, helm install/uninstall
	scripts/check-manifests

check-hardened: ## Operator as uid 65532, read-only root (bwrap), chart RBAC only, publishes a Tunnel (root)
	scripts/check-hardened

zigbuild: ## Static musl release binary without Docker: make zigbuild TARGET=aarch64-unknown-linux-musl
	scripts/zigbuild $(TARGET)
	install -D -m 0755 target/zig/$(TARGET)/release/culvert $(call dist_dir,$(TARGET))/culvert

check-cross: ## aarch64 + armv7 binaries (zigbuild) under qemu: --version and a tunnel through an x86_64 edge
	scripts/check-cross

cross: ## Static musl release binary with cross (needs Docker): make cross TARGET=armv7-unknown-linux-musleabihf
	cross build --release --locked --bin culvert --target $(TARGET)
	install -D -m 0755 target/$(TARGET)/release/culvert $(call dist_dir,$(TARGET))/culvert

image: ## Multi-arch image: docker buildx, or buildah without Docker (IMAGE=..., PUSH=1; else target/culvert-image.oci.tar)
	for t in $(TARGETS); do $(MAKE) --no-print-directory $(BUILDER) TARGET=$$t || exit 1; done
	IMAGE=$(IMAGE) PLATFORMS=$(PLATFORMS) PUSH=$(PUSH) scripts/image

check-image: ## The image built with buildah (no Docker) from dist/ or target/zig: config, files, runs as uid 65532 (root)
	PLATFORMS=$(PLATFORMS) scripts/image check

kind-demo: ## kind cluster + image built in Docker + edge container + operator + podinfo Ingress, ends with a curl
	scripts/kind-demo

kind-clean: ## Remove what kind-demo made
	scripts/kind-demo clean

.PHONY: check-cluster cluster-demo check-conformance
check-cluster: ## Every install path on a real node (kubelet, containerd) with a real edge (root; ~3 min once built)
	scripts/check-cluster

check-conformance: ## Upstream Gateway API conformance (GATEWAY-HTTP profile) against culvert on the real node (root; docs/conformance.md)
	scripts/check-conformance

cluster-demo: ## The kind demo without Docker: node, edge, chart, podinfo Ingress, curl; then stops (root)
	scripts/cluster-demo
