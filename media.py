"""
Images and sounds as a ViT reads them: prepare.py's `digits`, `images` and `audio` datasets, and
sample.py's --image.

    digits   scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download)
    images   a folder per class, dir/<label>/*.png (torchvision's ImageFolder layout), read with Pillow
             and resized to image_size
    audio    dir/<label>/*.wav, PCM read with the standard library's wave, then a log-mel spectrogram
             (torch.stft and a mel matrix written here, no torchaudio): an image of one channel

A dataset is data/<name>/{train,val}.bin (float32 images (C, S, S) back to back, normalised),
{train,val}_labels.bin (uint16) and meta.json with kind "images" or "audio", the shape, the classes and
the normalisation: pixels in [0, 1] go to (x - 0.5) / 0.5, the mean and std of
google/vit-base-patch16-224's image processor, which hf.py's ViT import and export keep; a
log-mel spectrogram to (x - mean) / std of its train split. Every class gives every fifth of its
examples (after a seeded shuffle) to the validation split.

numpy at the top only: torch, Pillow and scikit-learn are imported where they are needed, so that
prepare.py --help stays without torch.
"""

import glob
import json
import os
import wave

import numpy as np

from common import UsageError, write_atomic

MEDIA = ("images", "audio")  # meta.json's kinds
PIXELS = (0.5, 0.5)  # images: the mean and std of pixels in [0, 1] (google/vit-base-patch16-224's processor)
VAL_EVERY = 5  # every fifth example of a class is a validation one
SAMPLE_RATE, N_FFT, HOP = 16000, 400, 160  # audio: 25 ms windows every 10 ms (Whisper's)


def need(package, name):
    """Import an optional package, or a one-line UsageError naming it."""
    try:
        return __import__(package, fromlist=["_"])
    except ImportError:
        raise UsageError(f"this needs {name}: pip install {name}") from None


# ----------------------------------------------------------------------------------------------
# Reading examples

def digits():
    """scikit-learn's digits: (1797, 1, 8, 8) pixels in [0, 1] and their labels 0-9."""
    data = need("sklearn.datasets", "scikit-learn").load_digits()
    return (data.images / 16.0).astype(np.float32)[:, None], data.target, [str(d) for d in range(10)]


def read_image(path, image_size, channels):
    """An image file as (channels, image_size, image_size) pixels in [0, 1]: grey ("L") or RGB, resized."""
    Image = need("PIL.Image", "Pillow")
    try:
        with Image.open(path) as im:
            im = im.convert("L" if channels == 1 else "RGB").resize((image_size, image_size), Image.BILINEAR)
            x = np.asarray(im, dtype=np.float32) / 255.0
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is not an image Pillow reads ({e}): remove it or convert it") from None
    x = x[None] if x.ndim == 2 else x.transpose(2, 0, 1)  # (H, W, C) -> (C, H, W)
    if x.shape != (channels, image_size, image_size):
        raise UsageError(f"{path} is {x.shape} after resizing, not {(channels, image_size, image_size)}")
    return x


def read_wav(path):
    """A PCM .wav file as float32 samples in [-1, 1] (mono: the channels' mean) and its sample rate."""
    try:
        with wave.open(path, "rb") as w:
            width, n_channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError, OSError) as e:  # wave reads PCM only: float and compressed WAVs land here
        raise UsageError(f"{path} is not a PCM .wav file ({e}): convert it (ffmpeg -i IN -c:a pcm_s16le OUT.wav)") \
            from None
    if width not in (1, 2, 4):
        raise UsageError(f"{path} holds {8 * width}-bit samples: convert it to 16-bit PCM")
    x = np.frombuffer(raw, dtype={1: np.uint8, 2: np.int16, 4: np.int32}[width]).astype(np.float32)
    x = (x - 128) / 128 if width == 1 else x / 2 ** (8 * width - 1)  # 8-bit PCM is unsigned
    return x.reshape(-1, n_channels).mean(1), rate


def mel_matrix(n_freqs, n_mels, sample_rate):
    """(n_freqs, n_mels) triangular filters evenly spaced on the mel scale (HTK's 2595 log10(1 + f/700)),
    from 0 Hz to sample_rate / 2, each peaking at 1 (torchaudio's melscale_fbanks, norm=None)."""
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    hz = 700 * (10 ** (np.linspace(0, mel(sample_rate / 2), n_mels + 2) / 2595) - 1)  # the filters' edges
    f = np.linspace(0, sample_rate / 2, n_freqs)[:, None]
    up, down = (f - hz[:-2]) / (hz[1:-1] - hz[:-2]), (hz[2:] - f) / (hz[2:] - hz[1:-1])
    return np.maximum(0, np.minimum(up, down)).astype(np.float32)


def log_mel(samples, rate, n_mels, frames):
    """(1, n_mels, frames) log-mel spectrogram of the samples (resampled to SAMPLE_RATE by linear
    interpolation): |STFT|² of Hann windows of N_FFT every HOP, through mel_matrix, log(· + 1e-6);
    cut or padded (with the quietest value) to frames."""
    import torch

    if rate != SAMPLE_RATE:
        samples = np.interp(np.arange(0, len(samples), rate / SAMPLE_RATE), np.arange(len(samples)), samples)
    x = torch.as_tensor(np.asarray(samples, dtype=np.float32))
    x = torch.nn.functional.pad(x, (0, max(0, N_FFT - len(x))))
    spec = torch.stft(x, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True).abs() ** 2  # (F, frames)
    mel = torch.log(torch.as_tensor(mel_matrix(N_FFT // 2 + 1, n_mels, SAMPLE_RATE)).T @ spec + 1e-6)
    mel = torch.nn.functional.pad(mel[:, :frames], (0, max(0, frames - mel.size(1))), value=np.log(1e-6))
    return mel[None].numpy()


def class_files(pattern, ext):
    """The files of `dir/<label>/*.ext` by class: {label: [paths, sorted]}, labels sorted, or a UsageError."""
    paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    by_class = {}
    for p in paths:
        by_class.setdefault(os.path.basename(os.path.dirname(p)), []).append(p)
    if len(by_class) < 2:
        raise UsageError(f"--input={pattern!r} finds {len(by_class)} class folder(s): give 'dir/<label>/*.{ext}' "
                         "with a folder per class, two or more")
    return dict(sorted(by_class.items()))


def read_examples(kind, pattern, image_size, channels):
    """(examples (N, C, S, S) float32 before normalisation, labels (N,), class names) of a dataset kind."""
    if kind == "digits":
        return digits()
    by_class = class_files(pattern, "wav" if kind == "audio" else "png")
    read = (lambda p: log_mel(*read_wav(p), image_size, image_size)) if kind == "audio" else \
        (lambda p: read_image(p, image_size, channels))
    x = np.stack([read(p) for paths in by_class.values() for p in paths])
    y = np.concatenate([np.full(len(paths), i) for i, paths in enumerate(by_class.values())])
    return x, y, list(by_class)


# ----------------------------------------------------------------------------------------------
# Writing a dataset, reading it back

def split(labels, seed=0):
    """Whether each example is a validation one: every VAL_EVERY-th of its class, after a seeded shuffle."""
    order = np.random.default_rng(seed).permutation(len(labels))
    val = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        val[order[labels[order] == c][::VAL_EVERY]] = True
    return val


def prepare_media(kind, out, pattern="", image_size=32, channels=1):
    """Write data/<name> for kind "digits", "images" or "audio" (see the module's docstring)."""
    x, y, classes = read_examples(kind, pattern, image_size, channels)
    val = split(y)
    if kind == "audio":  # a spectrogram's own scale: the train split's mean and std
        mean, std = float(x[~val].mean()), float(x[~val].std()) or 1.0
    else:
        mean, std = PIXELS
    x = (x - mean) / std
    os.makedirs(out, exist_ok=True)
    for name, keep in (("train", ~val), ("val", val)):
        write_atomic(os.path.join(out, f"{name}.bin"), x[keep].astype(np.float32).tobytes())
        write_atomic(os.path.join(out, f"{name}_labels.bin"), y[keep].astype(np.uint16).tobytes())
    meta = dict(kind="audio" if kind == "audio" else "images", shape=list(x.shape[1:]), classes=classes,
                n_classes=len(classes), normalize=dict(mean=mean, std=std), train_images=int((~val).sum()),
                val_images=int(val.sum()), source=kind if kind == "digits" else pattern)
    write_atomic(os.path.join(out, "meta.json"), json.dumps(meta, indent=1).encode())  # last: marks it done
    return meta


def load_media(path, meta):
    """{split: {"images": (N, C, S, S) memmap, "labels": (N,) memmap}} of a dataset prepare_media wrote."""
    data = {}
    for s in ("train", "val"):
        n = meta[f"{s}_images"]
        images = np.memmap(os.path.join(path, f"{s}.bin"), dtype=np.float32, mode="r")
        labels = np.memmap(os.path.join(path, f"{s}_labels.bin"), dtype=np.uint16, mode="r")
        if len(images) != n * int(np.prod(meta["shape"])) or len(labels) != n:
            raise ValueError(f"{s}.bin or {s}_labels.bin does not hold the {n:,} examples meta.json says")
        data[s] = dict(images=images.reshape(n, *meta["shape"]), labels=labels)
    return data


def example(path, meta):
    """One file as the model reads it, normalised as its dataset was: an image, or a .wav's log-mel."""
    C, S, _ = meta["shape"]
    x = log_mel(*read_wav(path), S, S) if path.endswith(".wav") else read_image(path, S, C)
    mean, std = (np.reshape(meta["normalize"][k], (-1, 1, 1)) for k in ("mean", "std"))  # a scalar, or one a channel
    return ((x - mean) / std).astype(np.float32)


def top_classes(model, meta, path, k=5):
    """sample.py --image: [(class, probability)] of the model's k likeliest classes for the file at path."""
    import torch

    if not model.config.patch_size or not path:
        raise UsageError("--image=FILE.png is for an image classifier (patch_size)" if path else
                         "this model classifies images (patch_size): give --image=FILE.png (or .wav for audio)")
    dev = next(model.parameters()).device
    with torch.no_grad():
        x = torch.as_tensor(example(path, meta), dtype=next(model.parameters()).dtype, device=dev)[None]
        probs = model(x)[0].float().softmax(-1)[0]
    p, i = probs.topk(min(k, len(probs)))
    return [(meta["classes"][j] if j < len(meta["classes"]) else str(j), q) for j, q in zip(i.tolist(), p.tolist())]
