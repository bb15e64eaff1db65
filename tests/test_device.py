"""The device module: the peak FLOP/s that MFU counts against, and out-of-memory messages."""

import pytest
import torch

import device


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
                                          ("NVIDIA H100 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312)])
def test_mfu_counts_against_the_peak_of_the_gpus_own_variant(name, tflops, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device.peak_flops(torch.device("cuda"), torch.bfloat16)[0] == tflops * 1e12
    assert device.peak_flops(torch.device("cuda"), torch.float16)[0] == tflops * 1e12  # the same tensor cores


def test_a_cpu_measures_its_peak_with_a_product_sized_to_its_dtype():
    # fp32 is this project's CPU precision; half precision, often without matmul instructions on a
    # CPU, gets a smaller product so that start-up is not seconds of measuring
    for dtype, n in ((torch.float32, 1024), (torch.float16, 256), (torch.bfloat16, 256)):
        flops, source = device.peak_flops(torch.device("cpu"), dtype)
        assert flops > 0 and source.endswith(f"(measured {n}^3 matmul, {dtype})")


def test_a_gpu_missing_from_the_peak_table_is_not_taken_for_one_whose_name_it_contains():
    assert [device.spec_tflops(n) for n in ("NVIDIA A10", "NVIDIA A10G", "NVIDIA L40S", "NVIDIA GH200 480GB",
                                           "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090")] \
        == [125, None, 362, 989, 125, 165]


def test_out_of_memory_reads_torchs_messages():
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                  "79.19 GiB of which 1.06 GiB is free.")  # (torch's message, shortened)
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 3276800000 bytes. Error code 12 (Cannot allocate memory)")
    assert device.out_of_memory(cuda) == "out of memory (asked for 2.00 GiB more)"
    assert device.out_of_memory(cpu) == "out of memory (asked for 3.1 GiB more)"
    assert device.out_of_memory(MemoryError()) == "out of memory"
    assert device.out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None  # a bug stays a bug
