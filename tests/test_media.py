"""media.py and the scripts on images and sounds: prepare.py digits, images and audio; the log-mel
spectrogram; a ViT trained on tones synthesized here (configs/vit_tones.py), its val_acc in
metrics.jsonl; sample.py --image; and the bad input each refuses in one line."""

import json
import math
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

import hf
import prepare
import sample
import train
from data import get_batch, load_data
from media import PIXELS, example, log_mel, mel_matrix, read_wav

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

PITCHES = (300.0, 500.0, 800.0, 1200.0)  # Hz: the four classes of tones()


def write_wav(path, samples, rate=16000):
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())


def tones(folder, per_class=25, seconds=0.33, seed=0):
    """folder/<pitch>/k.wav: per_class clips of each pitch, with noise of the tone's own loudness."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    for f in PITCHES:
        for k in range(per_class):
            tone = 0.3 * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
            write_wav(folder / f"{int(f)}hz" / f"{k}.wav", tone + 0.3 * rng.standard_normal(len(t)))


def test_digits_are_1797_images_split_by_class_normalised_as_vits_processor(tmp_path, in_process):
    assert in_process(prepare.main, ["digits"], cwd=tmp_path) is None
    data, meta = load_data(tmp_path / "data", "digits")
    assert meta["kind"] == "images" and meta["shape"] == [1, 8, 8] and meta["classes"] == list("0123456789")
    assert meta["train_images"] + meta["val_images"] == 1797 and meta["normalize"] == dict(mean=0.5, std=0.5)
    from sklearn.datasets import load_digits
    digits = load_digits()
    val = data["val"]
    assert np.bincount(val["labels"], minlength=10).min() >= 35  # every fifth of each class
    first = (digits.images[digits.target == val["labels"][0]] / 16 - PIXELS[0]) / PIXELS[1]  # its class's images
    assert np.isclose(first, val["images"][0, 0]).all(axis=(1, 2)).any()  # one of them, normalised
    b = get_batch(data["train"], "encoder", 5, 17, torch.Generator().manual_seed(0), {}, None)
    assert b["idx"].shape == (5, 1, 8, 8) and b["idx"].dtype == torch.float32 and b["targets"].dtype == torch.int64


def test_an_image_folder_is_read_per_class_with_pillow_and_resized(tmp_path, in_process, refusal):
    from PIL import Image
    for label, color, size in (("cat", 40, (20, 10)), ("dog", 200, (7, 9))):
        for k in range(5):
            (tmp_path / "pics" / label).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", size, (color, k, 255 - color)).save(tmp_path / "pics" / label / f"{k}.png")
    in_process(prepare.main, ["images", "--input=pics/*/*.png", "--name=pets", "--image_size=4"], cwd=tmp_path)
    data, meta = load_data(tmp_path / "data", "pets")
    assert meta["classes"] == ["cat", "dog"] and meta["shape"] == [3, 4, 4]
    x, y = np.concatenate([data[s]["images"] for s in data]), np.concatenate([data[s]["labels"] for s in data])
    assert np.allclose(x[y == 0][:, 0], (40 / 255 - 0.5) / 0.5, atol=1e-6)  # red channel, resized, normalised
    assert np.allclose(x[y == 1][:, 2], (55 / 255 - 0.5) / 0.5, atol=1e-6)
    (tmp_path / "one" / "cat").mkdir(parents=True)
    Image.new("L", (4, 4)).save(tmp_path / "one" / "cat" / "0.png")
    refusal(prepare.main, ["images", "--input=one/*/*.png", "--name=x"], "finds 1 class folder", cwd=tmp_path)
    (tmp_path / "pics" / "dog" / "bad.png").write_text("not an image")
    refusal(prepare.main, ["images", "--input=pics/*/*.png", "--name=y"], "bad.png is not an image", cwd=tmp_path)


def test_the_mel_filters_are_triangles_on_the_mel_scale_and_a_tone_lights_its_band():
    m = mel_matrix(201, 16, 16000)  # 201 frequencies, 0 to 8 kHz
    assert m.shape == (201, 16) and np.isclose(m.max(0), 1, atol=0.1).all() and (m >= 0).all()
    peaks = np.linspace(0, 8000, 201)[m.argmax(0)]
    mels = 2595 * np.log10(1 + peaks / 700)
    assert np.allclose(np.diff(mels), np.diff(mels).mean(), rtol=0.2)  # evenly spaced in mels
    t = np.arange(8000) / 16000
    for f in (400.0, 2000.0):
        spec = log_mel(np.sin(2 * np.pi * f * t), 16000, 16, 20)[0]  # (16 mels, 20 frames)
        assert spec.shape == (16, 20)
        assert abs(np.linspace(0, 8000, 201)[m[:, spec.mean(1).argmax()].argmax()] - f) < 250
    at_8k = log_mel(np.sin(2 * np.pi * 400 * np.arange(4000) / 8000), 8000, 16, 20)[0]  # resampled to 16 kHz
    at_16k = log_mel(np.sin(2 * np.pi * 400 * t), 16000, 16, 20)[0]
    assert at_8k.mean(1).argmax() == at_16k.mean(1).argmax()
    loud = at_16k > at_16k.max() - 3  # the tone's bands: within 0.5 (a factor of 1.6 in power)
    assert np.abs(at_8k - at_16k)[loud].max() < 0.5


def test_a_wav_that_is_not_pcm_is_refused_in_one_line(tmp_path, refusal):
    write_wav(tmp_path / "s" / "a" / "0.wav", np.zeros(100))
    write_wav(tmp_path / "s" / "b" / "0.wav", np.zeros(100))
    samples, rate = read_wav(str(tmp_path / "s" / "a" / "0.wav"))
    assert rate == 16000 and len(samples) == 100
    data = struct.pack("<4f", 0, 0.5, -0.5, 0)  # IEEE float samples: format 3, which wave does not read
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    (tmp_path / "s" / "b" / "1.wav").write_bytes(b"RIFF" + struct.pack("<I", len(riff)) + riff)
    refusal(prepare.main, ["audio", "--input=s/*/*.wav", "--name=s"], "1.wav is not a PCM .wav file", cwd=tmp_path)


def test_a_vit_learns_synthesized_tones_logs_val_acc_and_sample_names_the_pitch(tmp_path, in_process, capsys):
    tones(tmp_path / "tones")
    in_process(prepare.main, ["audio", "--input=tones/*/*.wav", "--name=tones", "--image_size=32"], cwd=tmp_path)
    assert in_process(train.main, [str(CONFIGS / "vit_tones.py")], cwd=tmp_path) == 0
    evals = [r for r in map(json.loads, open(tmp_path / "out-vit-tones" / "metrics.jsonl")) if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 50, 100, 150] and evals[0]["val_acc"] < 0.5
    assert evals[-1]["val_acc"] >= 0.95, evals
    tones(tmp_path / "new", per_class=1, seed=1)  # clips it has not heard
    for f in PITCHES:
        capsys.readouterr()
        in_process(sample.main, ["--out_dir=out-vit-tones", f"--image=new/{int(f)}hz/0.wav"], cwd=tmp_path)
        lines = capsys.readouterr().out.splitlines()
        probs = [float(line.split()[0]) for line in lines]
        assert lines[0].split()[1] == f"{int(f)}hz" and len(lines) == 4 and math.isclose(sum(probs), 1, abs_tol=1e-3)
    transformers = pytest.importorskip("transformers")  # the run exported, read by transformers with our logits
    assert in_process(hf.main, ["export", "out-vit-tones", "hf-tones"], cwd=tmp_path) == 0
    theirs = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf-tones").eval()
    ours, _ = hf.load_source("resume", tmp_path / "out-vit-tones")
    x = torch.from_numpy(example(str(tmp_path / "new" / "800hz" / "0.wav"), json.load(open(tmp_path / "data" / "tones" /
                                                                                             "meta.json"))))[None]
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x)[0], theirs(pixel_values=x).logits, atol=1e-4, rtol=0)
    assert list(theirs.config.id2label.values()) == ["1200hz", "300hz", "500hz", "800hz"]  # the folders, sorted


def test_token_data_for_an_image_model_and_images_for_a_token_model_are_refused(tmp_path, in_process, refusal,
                                                                                    workdir, tiny_args):
    d, _ = workdir
    in_process(prepare.main, ["digits"], cwd=d)
    refusal(train.main, ["--dataset=verse", "--arch=encoder", "--patch_size=4", "--out_dir=o1", *tiny_args],
            "patch_size=4 reads images, and the dataset holds tokens", cwd=d)
    refusal(train.main, ["--dataset=digits", "--out_dir=o2", *tiny_args], "the dataset holds images", cwd=d)
    refusal(train.main, ["--dataset=digits", "--patch_size=3", "--out_dir=o3", *tiny_args],
            "image_size is a multiple of patch_size", cwd=d)
    refusal(train.main, ["--dataset=digits", "--patch_size=2", "--image_size=4", "--out_dir=o4", *tiny_args],
            "holds images (1, 8, 8)", cwd=d)
