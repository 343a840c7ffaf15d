"""`bam-train` with bad flags and config files: one line `error: ...` naming the flag, field or
file and what it expects, exit status 2, before anything is built or compiled."""

import json

import pytest

from bam_configs.presets import preset
from bam_train.cli import parse_args, run

PROG = "bam-train"


@pytest.fixture
def error_of(tmp_path, capsys):
    """`error_of(*ARGS)`: the one-line error of `bam-train ARGS --workdir=TMP/run`, after
    checking its exit status."""

    def error_line(*argv):
        assert run([PROG, *argv, f"--workdir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err.strip()

    return error_line


def write(path, text):
    path.write_text(text)
    return str(path)


# Python config files


def test_python_config_with_a_syntax_error(tmp_path, error_of):
    bad = write(tmp_path / "bad.py", "def get_config(:\n    pass\n")
    err = error_of(f"--config={bad}")
    assert err.startswith(f"error: config: {bad} line 1: SyntaxError")


def test_python_config_that_fails_while_loading(tmp_path, error_of):
    bad = write(tmp_path / "bad.py", "import json\n\nVALUES = json.loads('{')\n")
    err = error_of(f"--config={bad}")
    assert err.startswith(f"error: config: {bad} line 3: JSONDecodeError")


def test_python_config_without_get_config(tmp_path, error_of):
    bad = write(tmp_path / "bad.py", "STEPS = 3\n")
    err = error_of(f"--config={bad}")
    assert err == (
        f"error: config: {bad} defines no get_config(); define one returning "
        "an ml_collections ConfigDict of TrainConfig fields or a TrainConfig"
    )


def test_python_config_whose_get_config_raises(tmp_path, error_of):
    bad = write(tmp_path / "bad.py", "def get_config():\n    raise RuntimeError('no data')\n")
    err = error_of(f"--config={bad}")
    assert err == f"error: config: {bad} line 2: RuntimeError: no data"


@pytest.mark.parametrize("result", ["3", "None", "{'steps': 3}"])
def test_python_config_returning_something_else(tmp_path, error_of, result):
    bad = write(tmp_path / "bad.py", f"def get_config():\n    return {result}\n")
    err = error_of(f"--config={bad}")
    assert f"error: config: {bad}: get_config() returned " in err
    assert "expected an ml_collections ConfigDict of TrainConfig fields or a TrainConfig" in err


def test_python_config_that_does_not_exist(tmp_path, error_of):
    missing = tmp_path / "missing.py"
    err = error_of(f"--config={missing}")
    assert err == f"error: config: file '{missing}' does not exist"


def test_python_config_may_return_a_train_config_and_take_an_argument(tmp_path):
    py = write(
        tmp_path / "my_config.py",
        "from bam_configs.presets import preset\n"
        "def get_config(name):\n"
        "    return preset(name).replace(steps=3)\n",
    )
    cfg, _ = parse_args([PROG, f"--config={py}:micro", "--config.batch_size=2"])
    assert cfg == preset("micro").replace(steps=3, batch_size=2)


# JSON config files


def test_json_config_that_is_not_valid_json(tmp_path, error_of):
    bad = write(tmp_path / "config.json", '{"steps": 3,\n bad}')
    err = error_of(f"--config={bad}")
    assert err.startswith(f"error: config: {bad} line 2 column 2: not valid JSON")


def test_json_config_that_is_not_an_object(tmp_path, error_of):
    bad = write(tmp_path / "config.json", "[1, 2]")
    err = error_of(f"--config={bad}")
    assert err == f"error: config: {bad} must hold a JSON object of config fields, got a JSON list"


def test_json_config_that_is_a_directory(tmp_path, error_of):
    folder = tmp_path / "config.json"
    folder.mkdir()
    err = error_of(f"--config={folder}")
    assert err == f"error: config: '{folder}' is a directory, not a config.json file"


def test_json_config_with_an_unknown_nested_key(tmp_path, error_of):
    d = preset("tiny").to_dict()
    d["model"]["depth"] = 3
    bad = write(tmp_path / "config.json", json.dumps(d))
    err = error_of(f"--config={bad}")
    assert err.startswith("error: config: unknown field 'model.depth'; valid fields of model: ")
    assert ", dim, " in err


@pytest.mark.parametrize(
    ("key_path", "value", "expected"),
    [
        ("steps", "abc", "steps must be an int, got 'abc'"),
        ("steps", True, "steps must be an int, got True"),
        ("async_checkpoint", "false", "async_checkpoint must be true or false, got 'false'"),
        ("model.dim", "64", "model.dim must be an int, got '64'"),
        ("optim.lr", "1e-3", "optim.lr must be a number, got '1e-3'"),
        ("model.n_kv_heads", 1.5, "model.n_kv_heads must be an int or None, got 1.5"),
        ("mesh", [1, 1, 1], "mesh must be a mapping of field names to values, got list"),
    ],
)
def test_json_config_value_of_the_wrong_type(tmp_path, error_of, key_path, value, expected):
    d = preset("tiny").to_dict()
    *sections, key = key_path.split(".")
    target = d
    for section in sections:
        target = target[section]
    target[key] = value
    bad = write(tmp_path / "config.json", json.dumps(d))
    err = error_of(f"--config={bad}")
    assert err.startswith(f"error: config: {expected}")


def test_json_section_value_errors_name_the_section(tmp_path, error_of):
    d = preset("tiny").to_dict()
    d["model"]["encoding"] = "rotary"
    bad = write(tmp_path / "config.json", json.dumps(d))
    assert error_of(f"--config={bad}").startswith("error: model.encoding must be one of")


def test_directory_instead_of_a_config(tmp_path, error_of):
    err = error_of(f"--config={tmp_path}")
    assert err.startswith(f"error: config: '{tmp_path}' is a directory")
    assert f"{tmp_path}/config.json" in err


# Overrides


def test_unknown_field_is_named_plainly_with_the_valid_ones(error_of):
    err = error_of("--config=tiny", "--config.stepz=3")
    assert err.startswith("error: config: unknown field 'stepz'; valid fields: async_checkpoint, ")
    assert ", steps, " in err and "\\n" not in err and "Did you mean" not in err


def test_unknown_nested_field_lists_the_fields_of_its_section(error_of):
    err = error_of("--config=tiny", "--config.model.foo=1")
    assert err.startswith("error: config: unknown field 'model.foo'; valid fields of model: ")
    assert ", dim, " in err and "steps" not in err


def test_unknown_section(error_of):
    err = error_of("--config=tiny", "--config.foo.bar=1")
    assert err.startswith("error: config: unknown field 'foo'; valid fields: ")


def test_field_of_a_field_that_is_not_a_section(error_of):
    err = error_of("--config=tiny", "--config.steps.x=1")
    assert err == (
        "error: config: unknown field 'steps.x'; steps is an int, not a section with fields"
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("steps=abc", "config: steps must be an int, got 'abc'"),
        ("steps=1.5", "config: steps must be an int, got '1.5'"),
        ("optim.lr=fast", "config: optim.lr must be a number, got 'fast'"),
        ("async_checkpoint=maybe", "config: async_checkpoint must be true or false, got 'maybe'"),
        ("model.n_kv_heads=abc", "config: model.n_kv_heads must be an int or None, got 'abc'"),
        ("model=3", "config: model must be a dict of its fields"),
    ],
)
def test_override_value_of_the_wrong_type(error_of, override, expected):
    err = error_of("--config=tiny", f"--config.{override}")
    assert err.startswith(f"error: {expected}")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("mesh.data=0", "mesh.data must be a positive int or -1 (the remaining devices), got 0"),
        ("mesh.tensor=-2", "mesh.tensor must be a positive int or -1"),
        ("model.encoding=rotary", "model.encoding must be one of"),
        ("model.dim=-64", "model.dim must be a positive"),
        ("profile_start=-5", "profile_start must be an int >= -1, got -5"),
        ("seed=-3", "seed must be an int in [0, 2147483647], got -3"),
        ("seed=99999999999999999999", "seed must be an int in [0, 2147483647]"),
        ("eval_batches=-1", "eval_batches must be an int >= 0, got -1"),
    ],
)
def test_override_with_a_bad_value_names_the_field(override, expected):
    with pytest.raises(ValueError) as err:
        parse_args([PROG, "--config=tiny", f"--config.{override}"])
    assert str(err.value).startswith(expected)


def test_override_forms_accepted_by_absl_still_work():
    cfg, _ = parse_args(
        [
            PROG,
            "--config.steps",
            "5",
            "--config",
            "tiny",
            "--config.mesh={'data': 1, 'fsdp': 1, 'tensor': 1}",
            "--noconfig.async_checkpoint",
        ]
    )
    assert (cfg.steps, cfg.mesh.sizes, cfg.async_checkpoint) == (5, (1, 1, 1), False)


# Other flags


def test_config_field_given_as_a_flag(error_of):
    err = error_of("--config=tiny", "--steps=3")
    assert err == "error: unknown flag --steps; to set the config field, use --config.steps=VALUE"


def test_stray_argument():
    with pytest.raises(ValueError, match=r"^unexpected argument 'micro'; flags take the form"):
        parse_args([PROG, "--config=tiny", "micro"])


def test_config_given_twice_or_without_a_value(error_of):
    err = error_of("--config=tiny", "--config=micro")
    assert err.startswith("error: --config is given 2 times (tiny, micro); give it once")
    assert error_of("--config").startswith("error: --config needs a value: A preset name")


def test_process_flags_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match=r"^--process_id must be in \[0, 1\] for 2 processes"):
        parse_args(
            [PROG, "--config=tiny", "--num_processes=2", "--process_id=2", "--coordinator=h:1"]
        )
    with pytest.raises(ValueError, match=r"^--num_processes must be >= 1, got 0"):
        parse_args([PROG, "--config=tiny", "--num_processes=0"])
    with pytest.raises(ValueError, match=r"^--coordinator=HOST:PORT .* is required"):
        parse_args([PROG, "--config=tiny", "--num_processes=2", "--process_id=1"])


def test_process_count_from_the_environment_that_is_not_an_int(monkeypatch, error_of):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    err = error_of("--config=tiny")
    assert err == "error: environment variable JAX_NUM_PROCESSES must be an int, got 'two'"
