"""``--export-cast`` arguments, the one-line activation and the misuse errors (single process)."""
import argparse
import sys
from types import SimpleNamespace

import pytest

import megatron_patches
from faircast_dist import ExportCastConfig
from faircast_dist.config import ENV
from megatron_lm_standin import parse
from megatron_patches import add_export_cast_args, check_config, config_from_args, with_export_cast_args


def megatron_like_parser():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--use-precision-aware-optimizer", action="store_true")
    return parser


def test_defaults_are_stock_round_to_nearest():
    args = add_export_cast_args(megatron_like_parser()).parse_args([])
    assert (args.export_cast, args.export_cast_method, args.export_cast_seed) == ("nearest", "stochastic", 1234)
    assert config_from_args(args) == ExportCastConfig()  # nearest needs no bf16 check
    assert not config_from_args(args).enabled


@pytest.mark.parametrize("flag,method", [("error-feedback", "error_feedback"), ("dithered", "dithered")])
def test_flags_parse_into_the_shared_config(flag, method):
    parser = add_export_cast_args(megatron_like_parser())
    args = parser.parse_args(f"--bf16 --export-cast fair --export-cast-method {flag} --export-cast-seed 7".split())
    assert config_from_args(args) == ExportCastConfig(mode="fair", method=method, seed=7)


def test_fp8_flags_parse_into_the_shared_config_and_name_themselves():
    parser = add_export_cast_args(megatron_like_parser())
    args = parser.parse_args("--bf16 --export-cast nearest --export-cast-format fp8 --export-cast-fp8-via-bf16 "
                             "--export-cast-fp8-ue8m0 --export-cast-fp8-exclude output_layer".split())
    assert config_from_args(args) == ExportCastConfig(mode="nearest", format="fp8", fp8_via_bf16=True,
                                                      fp8_ue8m0=True, fp8_exclude="output_layer")
    assert config_from_args(args).enabled  # the stacks' FP8 rounding is served too: Fair Cast installs
    with pytest.raises(ValueError, match="--export-cast-fp8-via-bf16: .*round-to-nearest"):
        config_from_args(parser.parse_args("--bf16 --export-cast fair --export-cast-format fp8 "
                                           "--export-cast-fp8-via-bf16".split()))
    assert config_from_args(parser.parse_args("--bf16 --export-cast fair --export-cast-format fp8 "
                                              "--export-cast-fp8-scales block".split())).fp8_scales == "block"
    with pytest.raises(SystemExit):
        parser.parse_args("--export-cast-fp8-scales row".split())
    args = parser.parse_args("--bf16 --export-cast fair --export-cast-method dithered --export-cast-format fp8 "
                             "--export-cast-fp8-rule vllm-fp8-per-channel".split())
    assert config_from_args(args).scale_rule.name == "vllm-fp8-per-channel" and not config_from_args(args).fp8_grid
    assert config_from_args(parser.parse_args("--bf16 --export-cast-format fp8 --export-cast-fp8-rule verl "
                                              "--export-cast-fp8-grid".split())).fp8_grid
    with pytest.raises(ValueError, match="--export-cast-fp8-grid: .*needs an fp8_rule"):
        config_from_args(parser.parse_args("--bf16 --export-cast-format fp8 --export-cast-fp8-grid".split()))
    with pytest.raises(ValueError, match="--export-cast-fp8-scales: .*fp8_rule 'verl' sets the scales"):
        config_from_args(parser.parse_args("--bf16 --export-cast-format fp8 --export-cast-fp8-rule verl "
                                           "--export-cast-fp8-scales block".split()))


def test_provider_chains_with_a_scripts_own_provider_and_is_idempotent():
    def own(parser):
        parser.add_argument("--my-flag", type=int, default=3)
        return parser
    parser = with_export_cast_args(own)(megatron_like_parser())
    parser = add_export_cast_args(parser)  # added twice (activate + provider): no conflict
    args = parser.parse_args(["--my-flag", "5", "--export-cast", "fair", "--bf16"])
    assert args.my_flag == 5 and args.export_cast == "fair"
    assert with_export_cast_args()(megatron_like_parser()).parse_args([]).export_cast == "nearest"


@pytest.mark.parametrize("argv", [["--export-cast", "fiar"], ["--export-cast-method", "kahan"],
                                  ["--export-cast-seed", "x"]])
def test_bad_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        add_export_cast_args(megatron_like_parser()).parse_args(argv)
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [
    ("", r"--export-cast fair needs --bf16"),
    ("--fp16", r"needs --bf16.*--fp16"),
    ("--bf16 --use-precision-aware-optimizer", r"--use-precision-aware-optimizer.*store_param_remainders"),
])
def test_fair_misuse_is_an_error_naming_the_flag(flags, match):
    args = add_export_cast_args(megatron_like_parser()).parse_args(["--export-cast", "fair", *flags.split()])
    with pytest.raises(ValueError, match=match):
        config_from_args(args)


def test_seed_out_of_range_names_the_flag():
    args = SimpleNamespace(export_cast="fair", export_cast_method="stochastic", export_cast_seed=2**64, bf16=True)
    with pytest.raises(ValueError, match="--export-cast-seed"):
        config_from_args(args)


def test_optimizer_config_checks():
    from megatron.core.optimizer import OptimizerConfig
    check_config(OptimizerConfig(bf16=True))
    with pytest.raises(ValueError, match="--bf16"):
        check_config(OptimizerConfig(fp16=True))
    with pytest.raises(ValueError, match="precision-aware"):
        check_config(SimpleNamespace(bf16=True, use_precision_aware_optimizer=True, store_param_remainders=True))
    with pytest.raises(NotImplementedError, match="cpu-offload"):
        check_config(SimpleNamespace(bf16=True, optimizer_cpu_offload=True))
    with pytest.raises(NotImplementedError, match="--optimizer-cuda-graph"):
        check_config(SimpleNamespace(bf16=True, optimizer_cuda_graph=True))
    with pytest.raises(NotImplementedError, match="--reuse-grad-buf-for-mxfp8-param-ag"):
        check_config(OptimizerConfig(bf16=True, reuse_grad_buf_for_mxfp8_param_ag=True))


@pytest.fixture
def fake_megatron_training(monkeypatch):
    """Megatron-LM's megatron.training (not in the megatron-core wheel): just what activate() uses."""
    import megatron
    import megatron.core.optimizer as core_optimizer

    from megatron_lm_standin import modules
    fake = modules()
    for name, module in fake.sys_modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(megatron, "training", fake.package, raising=False)
    monkeypatch.setattr(core_optimizer, "get_megatron_optimizer", core_optimizer.get_megatron_optimizer)
    monkeypatch.setattr(megatron_patches, "_ACTIVE", None)
    fake.core_optimizer = core_optimizer
    return fake


def test_activate_adds_the_flags_and_wraps_get_megatron_optimizer(fake_megatron_training):
    fake = fake_megatron_training
    original = fake.core_optimizer.get_megatron_optimizer
    megatron_patches.activate()
    megatron_patches.activate()  # idempotent
    # the script's own provider still works, and the flags parse without it
    args = parse(fake, ["--bf16", "--export-cast", "fair", "--export-cast-seed", "9"])
    assert (args.export_cast, args.export_cast_seed) == ("fair", 9)
    args = parse(fake, ["--export-cast", "fair"], with_export_cast_args())
    assert args.export_cast == "fair"
    for module in (fake.core_optimizer, fake.training):
        assert module.get_megatron_optimizer is not original
        assert module.get_megatron_optimizer.__wrapped__ is original
    assert fake.training.training_log._faircast and not hasattr(fake.training.training_log.__wrapped__, "_faircast")
    # the wrapper reads the parsed arguments at optimizer build time
    fake.global_vars.get_args = lambda: parse(
        fake, ["--bf16", "--export-cast", "fair", "--export-cast-method", "error-feedback"])
    assert megatron_patches._args_config() == ExportCastConfig(mode="fair", method="error_feedback")
    fake.global_vars.get_args = lambda: parse(fake, ["--export-cast", "fair"])
    with pytest.raises(ValueError, match="--bf16"):
        megatron_patches._args_config()

    def unparsed():  # Megatron-LM's get_args before parse_args (megatron-core >= 0.17 ships megatron.training)
        raise AssertionError("args is not initialized.")
    fake.global_vars.get_args = unparsed
    assert megatron_patches._args_telemetry() is False and megatron_patches._args_iteration() is None
    with pytest.raises(RuntimeError, match="activate\\(config=...\\)"):
        megatron_patches._args_config()


@pytest.mark.parametrize("variable,argv,want,overridden", [
    # the command line wins over the variable, which fills what the command line leaves unset
    ('{"mode": "fair", "method": "stochastic", "seed": 1234, "residual_dtype": "bfloat16"}',
     ["--export-cast-method", "error-feedback", "--export-cast-seed", "7"],
     ExportCastConfig(mode="fair", method="error_feedback", seed=7, residual_dtype="bfloat16"),
     ["--export-cast-method error_feedback (command line) over method stochastic",
      "--export-cast-seed 7 (command line) over seed 1234"]),
    ('{"mode": "fair", "method": "dithered", "seed": 5}', [], ExportCastConfig(mode="fair", method="dithered", seed=5), []),
    ("nearest", ["--export-cast", "fair"], ExportCastConfig(mode="fair"), ["--export-cast fair (command line) over mode nearest"]),
    ("fair", ["--export-cast", "fair", "--export-cast-seed", "1234"], ExportCastConfig(mode="fair"), []),  # agrees
    (None, ["--export-cast", "fair", "--export-cast-residual-dtype", "bfloat16"],
     ExportCastConfig(mode="fair", residual_dtype="bfloat16"), []),  # no variable: nothing to disagree with
])
def test_flags_default_to_the_variable_and_the_command_line_wins(fake_megatron_training, monkeypatch, caplog,
                                                                variable, argv, want, overridden):
    """What runs is what Megatron-LM's parsed arguments say; a flag that differs from
    FAIRCAST_EXPORT_CAST is one warning naming both values."""
    fake = fake_megatron_training
    if variable is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, variable)
    megatron_patches.activate()  # as faircast-run's start-up hook does
    args = parse(fake, ["--bf16", *argv])
    assert config_from_args(args) == want  # the arguments are the config...
    fake.global_vars.get_args = lambda: args
    with caplog.at_level("WARNING", logger="faircast"):
        assert megatron_patches._args_config() == want  # ...that runs
    warned = [r.getMessage() for r in caplog.records if "command line overrides" in r.getMessage()]
    assert len(warned) == (1 if overridden else 0), warned
    for item in overridden:
        assert item in warned[0] and f"{ENV} (which fills the rest)" in warned[0], warned
    assert "{" not in "".join(warned)  # the fields that differ, not the variable's whole JSON


def test_a_namespace_with_some_flags_and_either_method_spelling(monkeypatch):
    """Flags a namespace lacks are their defaults, in the config and in the disagreement (it raised
    AttributeError); the method flag takes error_feedback as well as error-feedback."""
    from argparse import Namespace

    from megatron_patches.args import disagreements
    env = ExportCastConfig(mode="fair", method="dithered", seed=3)
    args = Namespace(export_cast="fair", export_cast_method="stochastic", bf16=True)
    assert config_from_args(args) == ExportCastConfig(mode="fair")
    assert disagreements(args, env) == ["--export-cast-method stochastic (command line) over method dithered",
                                        "--export-cast-seed 1234 (command line) over seed 3"]
    monkeypatch.delenv(ENV, raising=False)
    parsed = add_export_cast_args(megatron_like_parser()).parse_args(["--export-cast-method", "error_feedback"])
    assert parsed.export_cast_method == "error_feedback"
    monkeypatch.setenv(ENV, '{"mode": "fair", "seed": 5}')  # a script's own provider defaults to the variable too
    parsed = with_export_cast_args()(megatron_like_parser()).parse_args(["--bf16"])
    assert config_from_args(parsed) == ExportCastConfig(mode="fair", seed=5)


def test_without_parsed_arguments_the_variable_is_the_config(fake_megatron_training, monkeypatch):
    """megatron-core code that builds its own optimizers (no Megatron-LM arguments) under faircast-run."""
    def unparsed():
        raise AssertionError("args is not initialized.")
    fake_megatron_training.global_vars.get_args = unparsed
    monkeypatch.setenv(ENV, '{"mode": "fair", "method": "dithered", "seed": 3}')
    assert megatron_patches._args_config() == ExportCastConfig(mode="fair", method="dithered", seed=3)


@pytest.mark.parametrize("argv,on", [
    ([], False),  # no writer: nothing to log to
    (["--tensorboard-dir", "tb"], True),
    (["--wandb-project", "p"], True),
    (["--tensorboard-dir", "tb", "--no-export-cast-telemetry"], False),
    (["--wandb-project", "p", "--export-cast-telemetry"], True),
])
def test_telemetry_is_on_with_a_writer_unless_turned_off(argv, on):
    from megatron_patches.telemetry import logging_on
    parser = megatron_like_parser()
    parser.add_argument("--tensorboard-dir")
    parser.add_argument("--wandb-project")
    assert logging_on(add_export_cast_args(parser).parse_args(argv)) is on


def test_training_log_without_an_iteration_parameter_is_named():
    """A training_log whose signature hides ``iteration`` would never log the drift: say so."""
    from megatron_patches.telemetry import wrap_training_log

    def training_log(*args, **kwargs):
        return None
    training = SimpleNamespace(training_log=training_log)
    with pytest.warns(RuntimeWarning, match="no 'iteration' parameter"):
        wrap_training_log(training, [])
    assert training.training_log._faircast
