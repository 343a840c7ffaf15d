"""The checksums saved with every checkpoint: any changed value is seen, whatever the
changed bits, for every dtype a training state holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bam_jax.io.checkpoints import ChecksumMismatchError, array_checksums, verify_checksums

VALUES = np.random.default_rng(0).normal(size=(48, 33)).astype(np.float32)


def _with_flipped_bits(bits: list[tuple[int, int]]) -> np.ndarray:
    """VALUES with bit `b` of value `i` flipped, for each (i, b)."""
    words = VALUES.copy().view(np.uint32)
    for index, bit in bits:
        words.flat[index] ^= np.uint32(1 << bit)
    return words.view(np.float32)


@pytest.mark.parametrize(
    "bits",
    [[(5, 0)], [(5, 31)], [(5, 31), (9, 31)], [(5, 30), (7, 30)], [(0, 3), (1583, 3)]],
    ids=["lowest bit", "sign", "two signs", "two exponent bits", "first and last"],
)
def test_changed_bits_change_the_checksum(bits) -> None:
    saved = array_checksums({"params": {"w": VALUES}})
    verify_checksums({"params": {"w": VALUES}}, saved)
    with pytest.raises(ChecksumMismatchError, match="params/w differs from the checksum"):
        verify_checksums({"params": {"w": _with_flipped_bits(bits)}}, saved)


def test_swapped_values_change_the_checksum() -> None:
    swapped = VALUES.copy()
    swapped[0, 0], swapped[0, 1] = VALUES[0, 1], VALUES[0, 0]
    assert array_checksums([swapped]) != array_checksums([VALUES])


def test_every_dtype_of_a_state_has_a_checksum() -> None:
    tree = {
        "bf16": jnp.ones((3, 2), jnp.bfloat16),
        "int8": jnp.arange(4, dtype=jnp.int8),
        "step": jnp.asarray(7, jnp.int32),
        "flag": jnp.asarray(True),
        "key": jax.random.key(0),
    }
    arrays = array_checksums(tree)["arrays"]
    assert sorted(arrays) == sorted(tree) and all(len(c) == 16 for c in arrays.values())
    assert array_checksums({**tree, "step": jnp.asarray(8, jnp.int32)})["arrays"] != arrays


def test_checksums_of_another_algorithm_are_refused() -> None:
    with pytest.raises(ChecksumMismatchError, match="'crc32', which this version cannot check"):
        verify_checksums([VALUES], {"algorithm": "crc32", "arrays": {}})
