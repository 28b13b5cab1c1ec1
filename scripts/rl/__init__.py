"""The pieces of the GRPO harness (``scripts/rl_grpo.py`` composes them with the loop): :mod:`rl.engines`,
the rollout engines and the weight sync; :mod:`rl.stats`, the declared statistics over seed pairs."""
