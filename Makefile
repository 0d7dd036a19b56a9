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

demo: ## Edge + app + agent on this machine, ending with a curl through the edge
	scripts/demo

test: ## Run every test (starts the real Kubernetes control plane first)
	scripts/test

lint: ## rustfmt check and clippy with warnings as errors
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy -j2 --all-targets -- -D warnings

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
