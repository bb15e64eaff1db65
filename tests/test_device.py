"""The device module: the peak FLOP/s that MFU counts against, out-of-memory messages, and a script's exit."""

import os
import subprocess
import sys

import pytest
import torch

import device

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


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


def test_a_script_leaves_with_its_status_after_its_exit_handlers_and_its_output(tmp_path):
    """device.leave skips Python's teardown, not what a script owes: exit handlers (wandb's finish, say)
    run, told the status through sys.exit as wandb's hook reads it, buffered output is written, and the
    status is main's."""
    script = ("import atexit, sys\nfrom device import run_script\nseen, real_exit = [], sys.exit\n"
              "sys.exit = lambda code=0: (seen.append(code), real_exit(code))\n"
              "atexit.register(lambda: open('handled', 'w').write(f'status {seen}'))\n"
              "def main(argv):\n    print('out', end='')\n    sys.stderr.write('err')\n    return int(argv[0])\n"
              "run_script(main, 'x.py')\n")
    (tmp_path / "x.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | {"PYTHONPATH": HERE}  # buffered
    for status in (0, 3):
        p = subprocess.run([sys.executable, "x.py", str(status)], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert (p.returncode, p.stdout, p.stderr) == (status, "out", "err")
        assert (tmp_path / "handled").read_text() == f"status [{status}]"
        (tmp_path / "handled").unlink()
