# syntax=docker/dockerfile:1
# The culvert image built from source inside Docker: a Rust build stage on Alpine (musl, so the
# binary is static) and the same FROM scratch image as Dockerfile.multiarch (one file, /culvert).
# No toolchain is needed on the host; `make kind-demo` builds it for the host's platform:
#   docker buildx build -t culvert:dev .
# Files sent to the build: Dockerfile.dockerignore (only the sources).
FROM rust:1-alpine AS build
# C compiler and musl headers for the crates with C code (bundled SQLite, ring, mimalloc).
RUN apk add --no-cache build-base
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# Cargo's registry and the target directory in BuildKit caches: a rebuild compiles only culvert.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin culvert && \
    install -D -m 0555 target/release/culvert /out/culvert && \
    mkdir -p /out/var/lib/culvert
# The binary must be static: FROM scratch has no libc.
RUN ! ldd /out/culvert 2>/dev/null | grep -q '=>'

FROM scratch
LABEL org.opencontainers.image.title="culvert" \
      org.opencontainers.image.description="Publish services without a public address through a self-hosted edge"
COPY --from=build /out/culvert /culvert
# The edge's default --data-dir, owned by the image's user, so a new named volume mounted there
# (docker run -v culvert-data:/var/lib/culvert) is writable by uid 65532.
COPY --from=build --chown=65532:65532 /out/var/lib/culvert /var/lib/culvert
USER 65532:65532
ENTRYPOINT ["/culvert"]
