"""Command line, presets, overrides and the errors raised before anything compiles."""

import dataclasses
import json

import pytest

from bam_configs import presets
from bam_configs.presets import PAPER_SIZES, TRAINING_PRESETS, get_config, preset
from bam_configs.training import (
    DataConfig,
    MeshConfig,
    OptimConfig,
    TrainConfig,
    validate_for_runtime,
)
from bam_train.cli import main, parse_args

PROG = "bam-train"


def test_overrides_of_nested_fields():
    cfg, flags = parse_args(
        [
            PROG,
            "--config=tiny",
            "--workdir=/tmp/x",
            "--config.steps=7",
            "--config.model.encoding=rope",
            "--config.model.n_kv_heads=2",
            "--config.model.prior_alpha_init=slope",
            "--config.optim.lr=3e-4",
            "--config.mesh.fsdp=2",
            "--config.data.tokenizer=byte",
        ]
    )
    assert isinstance(cfg, TrainConfig) and flags.workdir == "/tmp/x"
    assert (cfg.steps, cfg.model.encoding, cfg.model.n_kv_heads) == (7, "rope", 2)
    assert cfg.model.prior_alpha_init == "slope" and cfg.optim.lr == 3e-4
    assert cfg.mesh.fsdp == 2 and cfg.data.tokenizer == "byte"


def test_config_from_python_file_and_resolved_json(tmp_path):
    py = tmp_path / "my_config.py"
    py.write_text(
        "from bam_configs.presets import preset\n"
        "from bam_configs.training import to_config_dict\n"
        "def get_config():\n"
        "    return to_config_dict(preset('micro').replace(steps=3))\n"
    )
    cfg, _ = parse_args([PROG, f"--config={py}", "--config.batch_size=2"])
    assert cfg == preset("micro").replace(steps=3, batch_size=2)
    js = tmp_path / "config.json"
    js.write_text(json.dumps(cfg.to_dict()))
    assert parse_args([PROG, f"--config={js}"])[0] == cfg


FLAX_STYLE_CONFIG = """
import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.steps = 3
    config.batch_size = 4
    config.model = ml_collections.ConfigDict()
    config.model.dim = 32
    config.model.n_layers = 2
    config.model.n_heads = 4
    config.model.n_kv_heads = None
    config.model.max_seq_len = 64
    config.optim = ml_collections.ConfigDict()
    config.optim.lr = 3e-3
    config.data = ml_collections.ConfigDict()
    config.data.source = "passkey"
    config.data.tokenizer = "mistral"
    return config
"""


def test_flax_style_config_file_returning_a_config_dict(tmp_path):
    py = tmp_path / "flax_config.py"
    py.write_text(FLAX_STYLE_CONFIG)
    cfg, _ = parse_args(
        [
            PROG,
            f"--config={py}",
            "--config.model.n_kv_heads=2",
            "--config.eval_every=2",
            "--config.model.prior_alpha_init=slope",
        ]
    )
    defaults = TrainConfig()
    expected_model = defaults.model.replace(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, prior_alpha_init="slope"
    )
    assert cfg == defaults.replace(
        steps=3,
        batch_size=4,
        eval_every=2,
        model=expected_model,
        optim=OptimConfig(lr=3e-3),
        data=DataConfig(source="passkey", tokenizer="mistral"),
    )
    with pytest.raises(ValueError, match=r"^config: unknown field 'model.depth'; valid fields"):
        parse_args([PROG, f"--config={py}", "--config.model.depth=3"])


def test_presets_file_is_an_ml_collections_config_file():
    assert TrainConfig.from_dict(get_config("micro").to_dict()) == preset("micro")
    cfg, _ = parse_args([PROG, f"--config={presets.__file__}:micro", "--config.steps=7"])
    assert cfg == preset("micro").replace(steps=7)


def test_print_config_prints_the_resolved_config_and_exits(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([PROG, "--config=micro", "--config.steps=7", "--print_config"])
    assert exit_info.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert TrainConfig.from_dict(printed) == preset("micro").replace(steps=7)


def test_every_preset_builds_and_paper_presets_follow_the_recipe():
    for name in TRAINING_PRESETS:
        assert isinstance(preset(name), TrainConfig)
    for size in PAPER_SIZES:
        for context in (512, 1024):
            cfg = preset(f"{size}_{context}")
            assert cfg.model.max_seq_len == context and cfg.model.encoding == "bam_ssmax"
            assert cfg.accum_steps * cfg.tokens_per_pass == 589_824
            assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.b2) == (1e-3, 0.1, 0.95)
            assert cfg.optim.final_lr_fraction == 0.1 and cfg.optim.warmup_steps == 0
            assert cfg.model.dtype == "bfloat16" and cfg.eval_every == 32


def test_help_documents_the_override_syntax(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([PROG, "--help"])
    assert exit_info.value.code == 0
    assert "--config.FIELD=VALUE" in capsys.readouterr().out


# One test per kind of bad input; all are raised before anything is compiled.


def test_unknown_encoding():
    with pytest.raises(ValueError, match="encoding must be one of"):
        parse_args([PROG, "--config=tiny", "--config.model.encoding=rotary"])


def test_heads_not_dividing_dim():
    with pytest.raises(ValueError, match=r"dim \(64\) must be divisible by n_heads \(3\)"):
        parse_args([PROG, "--config=tiny", "--config.model.n_heads=3"])


def test_unknown_field_and_wrong_type_are_flag_errors(capsys):
    assert main_exit_code([PROG, "--config=tiny", "--workdir=/tmp/x", "--config.stepz=3"]) == 2
    assert "unknown field 'stepz'" in capsys.readouterr().err
    assert main_exit_code([PROG, "--config=tiny", "--workdir=/tmp/x", "--config.steps=a"]) == 2
    assert "config: steps must be an int, got 'a'" in capsys.readouterr().err


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        parse_args([PROG, "--config=huge"])


def test_batch_not_divisible_by_data_parallel_size():
    cfg = preset("tiny").replace(batch_size=12)
    with pytest.raises(ValueError, match=r"batch_size \(12\) must be divisible by .* = 8"):
        validate_for_runtime(cfg, n_devices=8)


def test_mesh_larger_than_device_count():
    cfg = preset("tiny").replace(mesh=MeshConfig(data=2, fsdp=2, tensor=2))
    with pytest.raises(ValueError, match=r"mesh: .* needs 8 devices .* 4 are available"):
        validate_for_runtime(cfg, n_devices=4)


def test_mesh_that_does_not_use_every_device():
    cfg = preset("tiny").replace(mesh=MeshConfig(data=2, fsdp=1, tensor=1))
    with pytest.raises(ValueError, match=r"mesh: .* uses 2 devices, but 4"):
        validate_for_runtime(cfg, n_devices=4)


def test_missing_data_path():
    cfg = preset("tiny").replace(data=DataConfig(source="text", path="/no/such/corpus"))
    with pytest.raises(ValueError, match=r"data.path: '/no/such/corpus' does not exist"):
        validate_for_runtime(cfg, n_devices=1)
    with pytest.raises(ValueError, match=r"data.path is required"):
        validate_for_runtime(preset("l6_512").replace(data=DataConfig(source="shards")), 1)


def test_tokenizer_vocabulary_larger_than_the_model():
    cfg = preset("tiny")
    cfg = cfg.replace(model=cfg.model.replace(vocab_size=1000))
    with pytest.raises(ValueError, match=r"model.vocab_size \(1000\) is smaller .* \(32768\)"):
        validate_for_runtime(cfg, n_devices=1)


def test_tokens_per_step_not_a_multiple_of_a_pass():
    with pytest.raises(ValueError, match=r"tokens_per_step .* must be a multiple"):
        preset("tiny").replace(tokens_per_step=1000)


def test_bad_optimizer_value():
    with pytest.raises(ValueError, match=r"optim.b2"):
        parse_args([PROG, "--config=tiny", "--config.optim.b2=1.5"])


@pytest.mark.parametrize("name", ["lr", "prior_lr", "ssmax_lr"])
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1e39", r"must fit in float32 \(at most 3.4028235e\+38\), got 1e\+39"),
        ("-1e39", r"must fit in float32 \(at most 3.4028235e\+38\), got -1e\+39"),
        ("inf", r"must be a finite number, got inf"),
        ("nan", r"must be a finite number, got nan"),
        ("1e-50", r"must be > 0 in float32, got 1e-50, which rounds to 0"),
        ("0", r"must be > 0, got 0.0"),
        ("-3e-4", r"must be > 0, got -0.0003"),
    ],
)
def test_learning_rates_must_be_positive_finite_float32(name, value, expected):
    with pytest.raises(ValueError, match=rf"^optim.{name} {expected}$"):
        parse_args([PROG, "--config=tiny", f"--config.optim.{name}={value}"])


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("eps", float("inf"), r"optim.eps must be a finite number, got inf"),
        ("eps", 1e-46, r"optim.eps must be > 0 in float32, got 1e-46"),
        ("weight_decay", float("nan"), r"optim.weight_decay must be a finite number, got nan"),
        ("weight_decay", 1e39, r"optim.weight_decay must fit in float32"),
        ("clip_norm", float("inf"), r"optim.clip_norm must be a finite number, got inf"),
        ("clip_norm", -1.0, r"optim.clip_norm must be >= 0, got -1.0"),
        ("warmup_steps", 1.5, r"optim.warmup_steps must be an int >= 0, got 1.5"),
    ],
)
def test_other_optimizer_numbers_must_be_finite_float32(name, value, expected):
    with pytest.raises(ValueError, match=rf"^{expected}"):
        OptimConfig(**{name: value})


def test_largest_float32_learning_rate_is_accepted():
    assert OptimConfig(lr=3.4028234663852886e38, prior_lr=1e-45).lr > 0


def test_unknown_field_in_a_json_config(tmp_path):
    js = tmp_path / "config.json"
    d = preset("tiny").to_dict()
    d["model"]["depth"] = 3
    d["model"]["width"] = 3
    js.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"unknown fields 'model.depth', 'model.width'; valid"):
        parse_args([PROG, f"--config={js}"])


def test_dataclass_round_trip():
    cfg = preset("l12_1024")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.asdict(cfg)["model"]["dim"] == 768


def main_exit_code(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code
