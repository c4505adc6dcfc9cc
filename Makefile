# llmq: the two commands of the quick start, and their parts.
#   make demo   set up, build, start a local stack and stream SmolLM2's answer through NATS
#   make test   set up, build, and run every test
.PHONY: setup build demo test bench fixtures clean

CARGO ?= cargo
LLMQ := target/release/llmq

setup:
	bash deploy/setup/setup.sh

build: setup
	$(CARGO) build --release --workspace

demo: build
	bash deploy/demo.sh "What is the capital of France?"

test: build
	$(CARGO) test --release --workspace

bench: build
	$(LLMQ) bench single --local --model smollm2 --json
	$(LLMQ) bench single --local --random-weights smollm2 --json

# Maintainers: remake the tiny checkpoints and transformers' reference outputs.
fixtures:
	bash deploy/setup/setup.sh reference
	.cache/pyref/bin/python tests/reference/make_fixtures.py

clean:
	$(CARGO) clean
