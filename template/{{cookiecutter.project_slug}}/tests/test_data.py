import time

import jax
import numpy as np

from trainer.config import ResolvedMesh, load_config
from trainer.corpus import generate_corpus
from trainer.data import device_batch
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


def test_benchmark_batches_are_the_same_global_array_on_any_mesh():
    config = load_config("tiny")
    single = build_mesh(ResolvedMesh(ici=(1, 1, 1), dcn=(1, 1, 1)), jax.devices()[:1])
    reference = np.asarray(device_batch(3, config, logical_to_sharding(("batch", None), single)))
    assert reference.shape == (16, 65) and reference.dtype == np.int32
    for ici in [(8, 1, 1), (2, 2, 2), (1, 1, 8)]:
        mesh = build_mesh(ResolvedMesh(ici=ici, dcn=(1, 1, 1)))
        sharding = logical_to_sharding(("batch", None), mesh)
        array = device_batch(3, config, sharding)
        np.testing.assert_array_equal(np.asarray(array), reference)
        assert array.sharding == sharding
    other = np.asarray(device_batch(4, config, logical_to_sharding(("batch", None), single)))
    assert not np.array_equal(other, reference)
