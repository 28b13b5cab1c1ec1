import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers (ds_worker, shims)
# Triton reads this once, when first imported, and megatron.core imports it: set it before any
# test module imports anything, or the Triton kernel tests fail after a Megatron test (CI has no GPU)
os.environ.setdefault("TRITON_INTERPRET", "1")
