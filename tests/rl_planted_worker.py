"""The RL loop with a planted bug: the rollout engine is sent round-to-nearest of the fp32 master
instead of the trainer's served bf16 weights. ``scripts/rl_grpo.py`` must stop on it."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import rl_grpo  # noqa: E402


def load_master_instead(engine, rollout, tracker=None):
    from deepspeed.utils import safe_get_full_fp32_param
    rollout.load_weights((n, safe_get_full_fp32_param(p).to(torch.bfloat16)) for n, p in engine.module.named_parameters())


if __name__ == "__main__":
    rl_grpo.sync_weights = load_master_instead
    rl_grpo.main()
