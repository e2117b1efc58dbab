import pytest

from trainer.bench import build_parser, run_bench
from trainer.config import ConfigError


def test_bench_flags_match_the_multislice_guide():
    args = build_parser().parse_args(
        ["--ici_fsdp_parallelism", "4", "--batch_size", "131072", "--embedding_dimension", "2048",
         "--dcn_data_parallelism", "2"])
    assert (args.ici_fsdp_parallelism, args.dcn_data_parallelism, args.batch_size,
            args.embedding_dimension) == (4, 2, 131072, 2048)


@pytest.mark.parametrize("ici", [(1, 8, 1), (1, 2, 4), (8, 1, 1)])
def test_bench_runs_and_reports_throughput(ici):
    result = run_bench(batch_size=256, embedding_dimension=64, num_layers=2, ici=ici,
                       dcn=(1, 1, 1), steps=2, dtype="float32", log=lambda _: None)
    assert (result["mesh"]["data"], result["mesh"]["fsdp"], result["mesh"]["tensor"]) == ici
    assert result["tflops_per_device"] > 0 and result["mfu"] > 0


def test_bench_rejects_batch_that_does_not_divide():
    with pytest.raises(ConfigError, match="--batch_size 100 is not divisible by data\\*fsdp = 8"):
        run_bench(batch_size=100, embedding_dimension=64, num_layers=1, ici=(1, -1, 1),
                  dcn=(1, 1, 1), steps=1, dtype="float32")
