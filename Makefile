# Everything a fresh machine needs. `make demo` scores the shipped example; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# lmms-eval gets its own venv: its dependencies (timm, opencv, sentencepiece, ...) would change what
# transformers imports in the main suite. torchvision is pinned to the build of TORCH so pip keeps that torch,
# then removed: PyPI's torchvision does not load beside the CPU torch, and lmms-eval's core does not need it.
LMMS_VENV ?= .venv-lmms
LMMS_TORCHVISION ?= torchvision==0.28.*
LMMS_STAMP := $(LMMS_VENV)/.installed

.PHONY: demo test docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
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

$(LMMS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(LMMS_VENV)
	$(LMMS_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMMS_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(LMMS_VENV)/bin/python -m pip install -q -e ".[test,lmms]" "$(LMMS_TORCHVISION)" decord
	$(LMMS_VENV)/bin/python -m pip uninstall -q -y torchvision
	touch $(LMMS_STAMP)

# The suite, then the lmms-eval tests in their own venv (they skip in the main one).
test: $(STAMP) $(LMMS_STAMP)
	HF_HUB_OFFLINE=1 HF_EVALUATE_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/pytest -q
	HF_HUB_OFFLINE=1 HF_EVALUATE_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(LMMS_VENV)/bin/pytest -q tests/test_lmms_eval_adapter.py

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(LMMS_VENV) .cache site scores.jsonl scores.jsonl.capeval-run
