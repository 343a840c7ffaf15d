"""Import/export of reference checkpoints against the numpy oracle of the reference model.

Fixtures write reference-layout run directories (args.json + model.npz with random
weights in the torch layout, key prefixes included) for all eleven encodings, global and
per-layer BAM priors and both prior namings; no torch is needed except for the model.pt
round trip, which is skipped when torch is absent.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from bam_jax.reference_checkpoint import (
    NUMPY_FILE,
    TORCH_FILE,
    export_reference_checkpoint,
    load_reference_checkpoint,
    reference_args,
    strip_prefixes,
)
from tests.support.grids import slow_unless
from tests.support.reference_numpy import reference_forward
from tests.support.reference_runs import (
    CASES,
    HEADS,
    LENGTH,
    TOL,
    VOCAB,
    Case,
    SEQ_CODES_BxT,
    make_run,
    write_run,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict, dict]]:
    root = tmp_path_factory.mktemp("reference_runs")
    out = {}
    for i, case in enumerate(CASES):
        run_args, state = make_run(case, seed=i)
        out[case.id] = (write_run(root / case.id, run_args, state), run_args, state)
    return out


def _tokens(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, LENGTH), dtype=np.int32)


@nnx.jit
def _forward(model, tokens_BxT, segment_ids_BxT):
    return model(tokens_BxT, segment_ids_BxT)


def _logits(model, tokens: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
    import jax.numpy as jnp

    segments = None if segment_ids is None else jnp.asarray(segment_ids)
    return np.asarray(_forward(model, jnp.asarray(tokens), segments))


# Every encoding, both prior layouts and name styles, grouped-query heads and every checkpoint
# prefix; the other combinations are slow.
DEFAULT_CASES = [
    case
    for case in CASES
    if case.id
    in (
        "nope_ssmax",
        "sinusoidal",
        "alibi_ssmax",
        "rotary_local",
        "rotary-ffn_none",
        "bam-global-theta",
        "bam-layer-legacy",
        "bam_ssmax-global-legacy",
        "bam_ssmax-layer-theta",
        "bam_ssmax-layer-theta-gqa2",
    )
]


@pytest.mark.parametrize("case", slow_unless(CASES, DEFAULT_CASES), ids=lambda c: c.id)
def test_loaded_model_matches_reference(case: Case, runs, tmp_path):
    run_dir, run_args, state = runs[case.id]
    config, model = load_reference_checkpoint(run_dir)
    tokens = _tokens()
    for segments in (None, SEQ_CODES_BxT):
        expected = reference_forward(state, run_args, tokens, segments)
        got = _logits(model, tokens, segments)
        assert got.dtype == np.float32 and got.shape == (2, LENGTH, VOCAB)
        np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)

    naming = "legacy" if case.legacy_names else "theta"
    export_reference_checkpoint(model, config, tmp_path, fmt="npz", prior_naming=naming)
    with np.load(tmp_path / NUMPY_FILE) as exported:
        assert sorted(exported.files) == sorted(strip_prefixes(k) for k in state)
        for key, value in state.items():
            np.testing.assert_array_equal(exported[strip_prefixes(key)], value, strict=True)
    config_again, model_again = load_reference_checkpoint(tmp_path)
    assert _comparable(config_again) == _comparable(config)
    again, original = nnx.to_flat_state(nnx.state(model_again)), nnx.to_flat_state(nnx.state(model))
    assert [path for path, _ in again] == [path for path, _ in original]
    for (_, a), (_, b) in zip(again, original, strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))


def _comparable(config) -> dict:
    fields = config.to_dict()
    if isinstance(fields["prior_alpha_init"], float):  # written as log, read back as exp
        fields["prior_alpha_init"] = round(fields["prior_alpha_init"], 9)
    return fields


def test_config_fields_follow_args(runs):
    config, _ = load_reference_checkpoint(runs["rotary_local"][0])
    assert (config.encoding, config.window, config.rope_theta) == ("rope_local", 8, 500000.0)
    config, _ = load_reference_checkpoint(runs["bam_ssmax-layer-theta"][0])
    assert config.encoding == "bam_ssmax" and not config.global_prior
    assert config.ssmax_prior_inside and config.train_ssmax_scale
    assert config.prior_alpha_init == 1.0 and config.prior_beta_init == 0.0
    config, _ = load_reference_checkpoint(runs["bam-global-legacy"][0])
    assert config.global_prior and config.prior_alpha_init == "slope"
    assert (config.prior_beta_init, config.train_prior_mu) == (1.0, False)
    config, _ = load_reference_checkpoint(runs["rotary-ffn_none"][0])
    assert config.ffn_hidden_dim == 48  # dim 32 rounded up to a multiple of 24


def test_load_options(runs, tmp_path):
    run_dir, run_args, state = runs["bam_ssmax-layer-theta"]
    tokens = _tokens()
    config, model = load_reference_checkpoint(run_dir, scan_layers=True)
    assert config.scan_layers
    expected = reference_forward(state, run_args, tokens, SEQ_CODES_BxT)
    np.testing.assert_allclose(_logits(model, tokens, SEQ_CODES_BxT), expected, atol=TOL, rtol=0)
    export_reference_checkpoint(model, config, tmp_path, fmt="npz")
    with np.load(tmp_path / NUMPY_FILE) as exported:
        for key, value in state.items():
            np.testing.assert_array_equal(exported[strip_prefixes(key)], value, strict=True)

    config, _ = load_reference_checkpoint(run_dir, dtype="bfloat16")
    assert config.dtype == "bfloat16"
    run_dir, run_args, state = runs["bam_ssmax-global-theta"]
    config, model = load_reference_checkpoint(run_dir, ssmax_prior_inside=False)
    expected = reference_forward(state, run_args, tokens, ssmax_prior_inside=False)
    np.testing.assert_allclose(_logits(model, tokens), expected, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="cannot override"):
        load_reference_checkpoint(run_dir, dim=64)


def test_ssmax_prior_false_scales_the_content_before_adding_the_prior(runs, tmp_path):
    _, run_args, state = runs["bam_ssmax-layer-theta"]
    run_args = json.loads(json.dumps(run_args))
    run_args["model_args"]["ssmax_prior"] = False
    run_dir = write_run(tmp_path / "outside", run_args, state)
    config, model = load_reference_checkpoint(run_dir)
    assert not config.ssmax_prior_inside
    tokens = _tokens()
    expected = reference_forward(state, run_args, tokens, SEQ_CODES_BxT)
    np.testing.assert_allclose(_logits(model, tokens, SEQ_CODES_BxT), expected, atol=TOL, rtol=0)
    inside = reference_forward(state, run_args, tokens, SEQ_CODES_BxT, ssmax_prior_inside=True)
    assert np.max(np.abs(expected - inside)) > 100 * TOL

    export_reference_checkpoint(model, config, tmp_path / "again", fmt="npz")
    assert (
        json.loads((tmp_path / "again" / "args.json").read_text())["model_args"]["ssmax_prior"]
        is False
    )
    assert not load_reference_checkpoint(tmp_path / "again")[0].ssmax_prior_inside
    assert load_reference_checkpoint(run_dir, ssmax_prior_inside=True)[0].ssmax_prior_inside


def test_ssmax_prior_must_be_a_bool(runs, tmp_path):
    run_args, state, run_dir = _broken_run(runs, tmp_path)
    run_args["model_args"]["ssmax_prior"] = "yes"
    write_run(run_dir, run_args, state)
    with pytest.raises(ValueError, match=r"args\.json: model_args\.ssmax_prior must be true or"):
        load_reference_checkpoint(run_dir)


@pytest.mark.parametrize("name", ["bam-global-theta", "bam-layer-legacy"])
def test_inference_prior_form_gives_the_authors_evaluation_logits(name, runs):
    run_dir, run_args, state = runs[name]
    config, model = load_reference_checkpoint(run_dir, prior_form="inference")
    assert config.prior_form == "inference"
    tokens = _tokens()
    expected = reference_forward(state, run_args, tokens, SEQ_CODES_BxT, prior_form="inference")
    np.testing.assert_allclose(_logits(model, tokens, SEQ_CODES_BxT), expected, atol=TOL, rtol=0)
    training = reference_forward(state, run_args, tokens, SEQ_CODES_BxT)
    assert np.max(np.abs(expected - training)) > 100 * TOL
    assert load_reference_checkpoint(run_dir)[0].prior_form == "training"
    with pytest.raises(ValueError, match=r"prior_form must be one of \('training', 'inference'"):
        load_reference_checkpoint(run_dir, prior_form="evaluation")


def test_exported_args_are_readable_by_the_reference(runs, tmp_path):
    config, model = load_reference_checkpoint(runs["bam_ssmax-layer-legacy"][0])
    export_reference_checkpoint(model, config, tmp_path, fmt="npz")
    written = json.loads((tmp_path / "args.json").read_text())
    assert written == reference_args(config)
    assert written["args"]["position_encoding"] == "bam_ssmax"
    assert written["model_args"]["global_positional_encoding"] is False
    assert {"thata_beta_init", "theta_alpha_init", "seq_scale"} <= set(written["model_args"])
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_capped_ssmax_model_is_not_exported(runs, tmp_path):
    config, model = load_reference_checkpoint(runs["bam_ssmax-layer-legacy"][0])
    capped = config.replace(ssmax_capped_layers=1)
    with pytest.raises(ValueError, match="ssmax_capped_layers=1: the reference code has no cap"):
        export_reference_checkpoint(model, capped, tmp_path / "run", fmt="npz")
    assert not (tmp_path / "run").exists()


def test_a_model_with_local_layers_is_not_exported(runs, tmp_path):
    config, model = load_reference_checkpoint(runs["bam_ssmax-layer-legacy"][0])
    with pytest.raises(ValueError, match="local_layers=1: the reference code has no sliding"):
        export_reference_checkpoint(model, config.replace(local_layers=1), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- bad inputs


def _broken_run(runs, tmp_path, name="bam_ssmax-layer-theta"):
    _, run_args, state = runs[name]
    return json.loads(json.dumps(run_args)), dict(state), tmp_path / "broken"


def test_missing_files(runs, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_reference_checkpoint(tmp_path / "nowhere")
    _, state, run_dir = _broken_run(runs, tmp_path)
    run_dir.mkdir()
    with pytest.raises(ValueError, match="no weights file"):
        load_reference_checkpoint(run_dir)
    np.savez(run_dir / NUMPY_FILE, **state)
    with pytest.raises(ValueError, match=r"args\.json: missing"):
        load_reference_checkpoint(run_dir)
    (run_dir / "args.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_reference_checkpoint(run_dir)
    (run_dir / TORCH_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match=r"both model\.pt and model\.npz"):
        load_reference_checkpoint(run_dir)


def test_unknown_encoding_and_bad_args(runs, tmp_path):
    run_args, state, run_dir = _broken_run(runs, tmp_path)
    run_args["args"]["position_encoding"] = "laplace"
    write_run(run_dir, run_args, state)
    with pytest.raises(ValueError, match=r"args\.json: args\.position_encoding 'laplace'"):
        load_reference_checkpoint(run_dir)
    run_args["args"]["position_encoding"] = "bam_ssmax"
    del run_args["model_args"]["n_heads"]
    write_run(run_dir, run_args, state)
    with pytest.raises(ValueError, match=r"model_args\.n_heads is missing"):
        load_reference_checkpoint(run_dir)
    run_args["model_args"]["n_heads"] = 5
    write_run(run_dir, run_args, state)
    with pytest.raises(ValueError, match=r"args\.json: dim \(32\) must be divisible"):
        load_reference_checkpoint(run_dir)


def test_missing_unexpected_and_misshapen_keys(runs, tmp_path):
    run_args, state, run_dir = _broken_run(runs, tmp_path)
    prefix = next(iter(state)).removesuffix("tok_embeddings.weight")
    missing = dict(state)
    del missing[prefix + "layers.1.attention.seq_scale"]
    write_run(run_dir, run_args, missing)
    with pytest.raises(ValueError, match=r"model\.npz: missing keys .*'layers\.1\.attention\.seq_"):
        load_reference_checkpoint(run_dir)

    extra = dict(state, **{"prior.theta_beta": np.zeros((1, HEADS, 1, 1), np.float32)})
    write_run(run_dir, run_args, extra)
    with pytest.raises(ValueError, match=r"model\.npz: unexpected keys .*'prior\.theta_beta'"):
        load_reference_checkpoint(run_dir)

    misshapen = dict(state)
    misshapen[prefix + "layers.0.feed_forward.w2.weight"] = np.zeros((64, 32), np.float32)
    write_run(run_dir, run_args, misshapen)
    with pytest.raises(ValueError, match=r"'layers\.0\.feed_forward\.w2\.weight' has shape"):
        load_reference_checkpoint(run_dir)

    duplicate = dict(state)
    duplicate["layers.0.attention.prior.shape"] = duplicate[
        prefix + "layers.0.attention.prior.theta_beta"
    ]
    write_run(run_dir, run_args, duplicate)
    with pytest.raises(ValueError, match=r"both give 'layers\.0\.attention\.prior\.theta_beta'"):
        load_reference_checkpoint(run_dir)


def test_model_pt_without_torch_says_how_to_install(runs, tmp_path, monkeypatch):
    run_args, _, run_dir = _broken_run(runs, tmp_path)
    run_dir.mkdir()
    (run_dir / "args.json").write_text(json.dumps(run_args))
    (run_dir / TORCH_FILE).write_bytes(b"")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"pip install 'bam-jax\[torch\]'"):
        load_reference_checkpoint(run_dir)


def test_model_pt_round_trip(runs, tmp_path):
    torch = pytest.importorskip("torch")
    _, run_args, state = runs["bam_ssmax-global-legacy"]
    run_dir = tmp_path / "pt"
    run_dir.mkdir()
    (run_dir / "args.json").write_text(json.dumps(run_args))
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, run_dir / TORCH_FILE)
    config, model = load_reference_checkpoint(run_dir)
    tokens = _tokens()
    expected = reference_forward(state, run_args, tokens, SEQ_CODES_BxT)
    logits = _logits(model, tokens, SEQ_CODES_BxT)
    np.testing.assert_allclose(logits, expected, atol=TOL, rtol=0)

    export_reference_checkpoint(model, config, tmp_path / "out", fmt="pt", prior_naming="legacy")
    exported = torch.load(tmp_path / "out" / TORCH_FILE, weights_only=True)
    assert sorted(exported) == sorted(strip_prefixes(k) for k in state)
    for key, value in state.items():
        np.testing.assert_array_equal(exported[strip_prefixes(key)].numpy(), value, strict=True)
    _, model_again = load_reference_checkpoint(tmp_path / "out")
    np.testing.assert_array_equal(_logits(model_again, tokens, SEQ_CODES_BxT), logits)
