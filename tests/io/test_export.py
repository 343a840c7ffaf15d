"""A model exported as model.safetensors + config.json reads back into the same model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from bam_jax.config import ModelConfig
from bam_jax.io.export import export_model, import_model, main
from bam_jax.model import Transformer

pytest.importorskip("safetensors")


@pytest.mark.parametrize("encoding", ["bam_ssmax", "rope"])
def test_export_round_trip_gives_the_same_logits(tmp_path, encoding):
    config = ModelConfig.of_size("nano", encoding=encoding, global_prior=False)
    model = Transformer(config, rngs=nnx.Rngs(3))
    export_model(model, config, str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "bam" and saved["encoding"] == encoding
    loaded_config, loaded = import_model(str(tmp_path))
    assert loaded_config == config
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    forward = nnx.jit(lambda model, tokens: model(tokens))
    np.testing.assert_array_equal(forward(loaded, tokens), forward(model, tokens))


def test_a_folder_for_another_model_is_refused_naming_the_tensor(tmp_path):
    config = ModelConfig.of_size("nano", encoding="bam_ssmax", global_prior=False)
    export_model(Transformer(config, rngs=nnx.Rngs(0)), config, str(tmp_path))
    fields = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "dim": fields["dim"] * 2}))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor .* has shape"):
        import_model(str(tmp_path))


def test_export_command_names_a_missing_run(tmp_path, capsys):
    assert main([str(tmp_path / "no_run"), str(tmp_path / "out")]) == 2
    assert "no_run" in capsys.readouterr().err
