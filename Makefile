# llmq: the two commands of the quick start, and their parts.
#   make demo   set up, build, start a local stack and stream SmolLM2's answer through NATS
#   make test   set up, build, make the image, and run every test (compose's included)
#   make image  llmq's Docker image, llmq:local, from the release build (no registry needed)
#   make compose-test  docker-compose.yml on the Docker daemon: scale-out and faults
#   make fuzz   each fuzz target (fuzz/) for FUZZ_SECONDS (60) with cargo-fuzz; fails on a crash
#   make lint   rustfmt, clippy (warnings are errors), rustdoc (broken links are errors),
#               every path a document names, and no file importing another that imports it
#   make check  lint, then the tests that need no model and no server (protocol, config, text,
#               scheduling policy, gateway)
.PHONY: setup build image demo test lint compose-test soak fuzz check bench fixtures clean

CARGO ?= cargo
LLMQ := target/release/llmq

setup:
	bash deploy/setup/setup.sh

build: setup
	$(CARGO) build --release --workspace

demo: build
	bash deploy/demo.sh "What is the capital of France?"

image: build
	bash deploy/setup/setup.sh image
	bash deploy/setup/setup.sh tls
	bash deploy/docker/image.sh

test: image lint
	$(CARGO) test --release --workspace

# Release profile throughout, so that MLX's build (mlx-sys's build script) is shared with
# `make build`.
lint: setup
	$(CARGO) fmt --all --check
	cd fuzz && $(CARGO) fmt --all --check
	cd lab/constraint-libraries && $(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D rustdoc::broken_intra_doc_links -D rustdoc::private_intra_doc_links" \
	  $(CARGO) doc --release --no-deps --workspace
	python3 .ci/doc_paths.py
	python3 .ci/import_cycles.py

compose-test: image
	$(CARGO) test --release -p llmq --test compose

# Not part of `make test`: the compose stack with three workers under a mixed load for
# SOAK_SECONDS (default 1800), workers killed and restarted, NATS restarted once; a report.
SOAK_SECONDS ?= 1800
soak: image
	bash deploy/setup/setup.sh clients
	.cache/pyclient/bin/python deploy/soak/soak.py --seconds $(SOAK_SECONDS)

# cargo-fuzz needs the sanitizer flags of a nightly compiler: RUSTC_BOOTSTRAP lets the stable
# one accept them. The corpus in fuzz/corpus grows with each run (minimize: cargo fuzz cmin).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := protocol_decode gguf_reader gateway_request
fuzz: setup
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	cd fuzz && for t in $(FUZZ_TARGETS); do \
	  mkdir -p corpus/$$t && \
	  RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run -O $$t corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) -max_len=4096 || exit 1; \
	done

check: lint
	$(CARGO) test --release -p llmq-protocol -p llmq-config -p llmq-text -p llmq-scheduler -p llmq-gateway

bench: build
	$(LLMQ) bench single --model smollm2 --json
	$(LLMQ) bench single --random-weights smollm2 --json

# Maintainers: remake the tiny checkpoints and transformers' reference outputs.
fixtures:
	bash deploy/setup/setup.sh reference
	.cache/pyref/bin/python tests/reference/make_fixtures.py

clean:
	$(CARGO) clean
