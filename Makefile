# bevcompile — set-up and everyday commands. Only Python 3.11 and make are needed.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP_RUN  := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test

.PHONY: demo test test-min lint typecheck bench clean npu-envs npu-envs-all npu-check

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (set PYTHON=/path/to/python3.11)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP_RUN): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e '.[plot]'
	@touch $@

$(STAMP_TEST): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	@touch $@ $(STAMP_RUN)

## make demo: install, then build the default nuScenes store into artifacts/ and print the summary
demo: $(STAMP_RUN)
	$(BIN)/bevcompile grid --force

## NPU toolchains, each in its OWN venv under $(NPU_ENVS) (they pin old numpy/onnx/torch/TensorFlow and never touch
## $(VENV)); every package pinned in toolchains/<name>.txt and installed with --no-deps. The project talks to them through files
## (bevcompile/deploy/toolchains/). npu-envs: RKNN-Toolkit2 + OpenVINO (what make test proves); npu-envs-all adds LiteRT.
NPU_ENVS ?= .venv-npu
$(NPU_ENVS)/%/.installed: toolchains/%.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (set PYTHON=/path/to/python3.11)"; exit 2; }
	rm -rf $(NPU_ENVS)/$* && $(PYTHON) -m venv $(NPU_ENVS)/$*
	$(NPU_ENVS)/$*/bin/python -m pip install -q --upgrade pip
	$(NPU_ENVS)/$*/bin/pip install -q --no-deps -r toolchains/$*.txt
	@touch $@
npu-envs:  # the installs wait on the network, not the CPU: side by side
	@$(MAKE) --no-print-directory -j2 $(NPU_ENVS)/rknn/.installed $(NPU_ENVS)/openvino/.installed
npu-envs-all: npu-envs $(NPU_ENVS)/litert/.installed

## make npu-check: every target x product x precision on the nuScenes rig and dense-6cam, built and run on the real
## toolchains; writes benchmarks/results/npu_check.json (the table in docs/deploy.md is printed from it)
npu-check: $(STAMP_TEST) npu-envs-all
	$(BIN)/python benchmarks/npu_check.py

## make test: install with test extras (OpenCV, PyTorch 2.13.0 CPU, onnx) and the RKNN + OpenVINO toolchain venvs, lint,
## type-check, run the suite (tests/deploy/test_toolchains.py builds on both toolchains)
NPU_TEST_ENVS := $(NPU_ENVS)/rknn/.installed $(NPU_ENVS)/openvino/.installed
test:  # the three installs wait on the network more than on the CPU: side by side
	@$(MAKE) --no-print-directory -j3 $(STAMP_TEST) $(NPU_TEST_ENVS)
	$(BIN)/ruff check .
	$(BIN)/mypy
	BEVCOMPILE_REQUIRE_TOOLCHAINS=rknn,openvino HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/pytest -n 2 -q
	@echo "== end-to-end: default store into a temporary folder, then bevcompile inspect"
	@tmp=$$(mktemp -d) && \
	  $(BIN)/bevcompile grid --out $$tmp --quiet && \
	  $(BIN)/bevcompile matrix --out $$tmp --topk 24 --align 16 --quiet && \
	  $(BIN)/bevcompile inspect $$tmp; rc=$$?; rm -rf $$tmp; exit $$rc

## make test-min: the LOWEST versions pyproject.toml allows (runtime deps and torch), in $(VENV_MIN), and a
## smoke subset of the suite plus the end-to-end build; not part of `make test` (it downloads old wheels)
VENV_MIN ?= .venv-min
MIN_SMOKE := tests/rig/test_config_hardening.py tests/rig/test_config_fuzz.py tests/cli/test_main.py \
	tests/cli/test_grid_cmd.py tests/cli/test_matrix_cmd.py tests/store/test_inspection.py tests/test_memory.py
test-min:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (set PYTHON=/path/to/python3.11)"; exit 2; }
	rm -rf $(VENV_MIN) && $(PYTHON) -m venv $(VENV_MIN) && $(VENV_MIN)/bin/python -m pip install -q --upgrade pip
	$(VENV_MIN)/bin/python tests/min_versions.py pyproject.toml > $(VENV_MIN)/min-constraints.txt
	@echo "== declared minimums:" && cat $(VENV_MIN)/min-constraints.txt
	$(VENV_MIN)/bin/pip install -q -c $(VENV_MIN)/min-constraints.txt -e '.[torch]' pytest hypothesis
	$(VENV_MIN)/bin/python tests/min_versions.py pyproject.toml --check
	$(VENV_MIN)/bin/pytest -q -p no:cacheprovider $(MIN_SMOKE) tests/deploy/test_torch.py -k "not onnx and not cv2"
	@tmp=$$(mktemp -d) && \
	  $(VENV_MIN)/bin/bevcompile grid --out $$tmp --quiet && \
	  $(VENV_MIN)/bin/bevcompile matrix --out $$tmp --topk 24 --align 16 --quiet && \
	  $(VENV_MIN)/bin/bevcompile export-interop $$tmp/nuscenes.zarr --to bevpoolv2 --quiet && \
	  $(VENV_MIN)/bin/bevcompile inspect $$tmp; rc=$$?; rm -rf $$tmp; exit $$rc

lint: $(STAMP_TEST)
	$(BIN)/ruff check .

typecheck: $(STAMP_TEST)
	$(BIN)/mypy

bench: $(STAMP_TEST)
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/bevpoolv2.py
	$(BIN)/python benchmarks/scaling.py

clean:
	rm -rf $(NPU_ENVS) artifacts/*.zarr artifacts/.*.zarr.* artifacts/*_coverage.png .pytest_cache .mypy_cache .ruff_cache
