import time

import jax
import numpy as np

from trainer.config import ResolvedMesh, load_config
from trainer.corpus import generate_corpus
from trainer.data import device_batch, global_batch, local_rows
from trainer.mesh import build_mesh
from trainer.sharding import logical_to_sharding


def test_corpus_is_deterministic_fast_and_ascii_text():
    generate_corpus.cache_clear()
    start = time.perf_counter()
    text = generate_corpus(seed=123)
    assert time.perf_counter() - start < 1.0
    assert 1_000_000 <= len(text) <= 4_000_000
    assert text == generate_corpus.__wrapped__(seed=123)
    assert text != generate_corpus.__wrapped__(seed=124)
    assert text.decode("ascii")[0].isupper() and text.count(b". ") > 1000


def test_global_batch_depends_only_on_seed_and_step():
    config = load_config("tiny")
    first = global_batch(5, config)
    assert first.shape == (16, 65) and first.dtype == np.int32
    np.testing.assert_array_equal(first, global_batch(5, config))
    assert not np.array_equal(first, global_batch(6, config))
    other_seed = load_config("tiny", ["train.seed=1"])
    assert not np.array_equal(first, global_batch(5, other_seed))


def test_device_batch_assembles_the_global_batch_on_any_mesh():
    config = load_config("tiny")
    for ici in [(8, 1, 1), (2, 2, 2), (1, 1, 8)]:
        mesh = build_mesh(ResolvedMesh(ici=ici, dcn=(1, 1, 1)))
        sharding = logical_to_sharding(("batch", None), mesh)
        array = device_batch(3, config, sharding)
        np.testing.assert_array_equal(np.asarray(array), global_batch(3, config))
        assert array.sharding == sharding


def test_local_rows_cover_this_process_devices():
    mesh = build_mesh(ResolvedMesh(ici=(4, 2, 1), dcn=(1, 1, 1)))
    sharding = logical_to_sharding(("batch", None), mesh)
    assert local_rows(sharding, (16, 65)) == slice(0, 16)
    assert len(jax.devices()) == 8
