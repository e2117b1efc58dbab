import pytest

from trainer.bench import build_parser, run_bench
from trainer.config import ConfigError
from trainer.runtime.metrics import peak_tflops_for_kind, peak_tflops_per_device, throughput


def test_bench_flags_match_the_multislice_guide():
    args = build_parser().parse_args(
        ["--ici_fsdp_parallelism", "4", "--batch_size", "131072", "--embedding_dimension", "2048",
         "--dcn_data_parallelism", "2"])
    assert (args.ici_fsdp_parallelism, args.dcn_data_parallelism, args.batch_size,
            args.embedding_dimension) == (4, 2, 131072, 2048)


@pytest.mark.parametrize("ici", [(1, 8, 1), (1, 2, 4), (8, 1, 1)])
def test_bench_runs_and_reports_throughput(ici):
    result = run_bench(batch_size=32, embedding_dimension=64, num_layers=2, ici=ici,
                       dcn=(1, 1, 1), steps=2, dtype="float32", log=lambda _: None)
    assert (result["mesh"]["data"], result["mesh"]["fsdp"], result["mesh"]["tensor"]) == ici
    assert result["tflops_per_device"] > 0 and result["mfu"] > 0


def test_bench_runs_a_pipeline_and_reports_its_bubble():
    args = build_parser().parse_args(["--ici_pipeline_parallelism", "2",
                                      "--pipeline_microbatches", "4"])
    assert (args.ici_pipeline_parallelism, args.dcn_pipeline_parallelism,
            args.pipeline_microbatches) == (2, 1, 4)
    result = run_bench(batch_size=4, embedding_dimension=64, num_layers=4, ici=(2, 1, -1, 1),
                       dcn=(1, 1, 1, 1), steps=2, dtype="float32", pipeline_microbatches=4,
                       log=lambda _: None)
    assert result["mesh"] == {"pipeline": 2, "data": 1, "fsdp": 4, "tensor": 1}
    assert result["pipeline_microbatches"] == 4 and result["bubble_fraction"] == 0.2
    assert result["tflops_per_device"] > 0
    circular = run_bench(batch_size=4, embedding_dimension=64, num_layers=4, ici=(2, 1, -1, 1),
                         dcn=(1, 1, 1, 1), steps=1, dtype="float32", pipeline_microbatches=4,
                         pipeline_repeats=2, log=lambda _: None)
    assert circular["pipeline_repeats"] == 2 and circular["bubble_fraction"] == 1 / 9


@pytest.mark.parametrize(("flags", "message"), [
    ({"num_layers": 3}, "stages x repeats must divide the layers"),
    ({"pipeline_repeats": 4}, "--pipeline_repeats 4 with 2 stage.*stages x repeats must divide"),
    ({"pipeline_microbatches": 3}, "must be a multiple of the stages"),
    ({"pipeline_microbatches": 64}, "each micro-batch must split over the 4 data x fsdp"),
])
def test_bench_rejects_a_pipeline_that_cannot_run(flags, message):
    kwargs = {"batch_size": 4, "embedding_dimension": 64, "num_layers": 4, "ici": (2, 1, -1, 1),
              "dcn": (1, 1, 1, 1), "steps": 1, "dtype": "float32", **flags}
    with pytest.raises(ConfigError, match=message):
        run_bench(**kwargs)


def test_batch_size_is_per_device_as_in_the_guide():
    # shardings.py: BATCH = len(jax.devices()) * args.batch_size.
    result = run_bench(batch_size=3, embedding_dimension=64, num_layers=1, ici=(1, -1, 1),
                       dcn=(1, 1, 1), steps=1, dtype="float32", log=lambda _: None)
    assert (result["batch_size_per_device"], result["global_batch_size"]) == (3, 24)


def test_bench_rejects_an_empty_batch():
    with pytest.raises(ConfigError, match="--batch_size 0: must be >= 1"):
        run_bench(batch_size=0, embedding_dimension=64, num_layers=1, ici=(1, -1, 1),
                  dcn=(1, 1, 1), steps=1, dtype="float32")


@pytest.mark.parametrize(("kind", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("NVIDIA B200", 2250.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0),
    ("TPU v5", 459.0), ("TPU v6 lite", 918.0),
    ("TPU7x", 1153.5),  # per device: a TPU7x chip (2307) shows two
])
def test_peak_table_tells_the_parts_apart(kind, peak):
    assert peak_tflops_for_kind(kind) == peak


def test_an_unknown_accelerator_gets_no_peak_instead_of_a_cpu_measurement():
    def must_not_measure():
        raise AssertionError("timed a CPU-sized matmul on an accelerator")

    peak, source = peak_tflops_per_device("NVIDIA RTX 9090", "gpu", measure=must_not_measure)
    assert peak is None and "PEAK_TFLOPS" in source
    assert peak_tflops_per_device("cpu", "cpu", measure=lambda: 0.5) == (0.5, "measured f32 matmul")
    assert throughput(tokens=10, step_time_s=1.0, flops_per_token=1, num_devices=1,
                      peak_tflops=None)["mfu"] is None


def test_a_cpu_peak_is_measured_once_and_remembered_in_the_cache_directory(tmp_path):
    measured = []

    def measure():
        measured.append(1)
        return 0.25

    first = peak_tflops_per_device("cpu", "cpu", measure=measure, remember_in=str(tmp_path))
    again = peak_tflops_per_device("cpu", "cpu", measure=measure, remember_in=str(tmp_path))
    assert first == (0.25, "measured f32 matmul")
    assert again == (0.25, "measured f32 matmul, remembered from an earlier start")
    assert measured == [1]
    [memo] = tmp_path.iterdir()
    memo.write_text("{not json")  # a memo cut short is measured again, not a failed start
    assert peak_tflops_per_device("cpu", "cpu", measure=measure,
                                  remember_in=str(tmp_path))[0] == 0.25
    assert measured == [1, 1]
