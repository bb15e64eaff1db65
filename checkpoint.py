"""
Checkpoints: where a run starts from (new, resumed, or --init_from=auto's choice of the two),
written atomically (the last --keep_checkpoints states kept beside ckpt.pt), read safely (plain
tensors and data only), and a run's model loaded for sampling.
"""

import errno
import fcntl
import os
import re
import shutil
from contextlib import suppress
from dataclasses import asdict, fields, replace

import torch

from common import UsageError, as_given
from device import set_rng_state
from distributed import load_optimizer_state
from data import new_model_config
from lora import merged_state
from model import ModelConfig, Transformer
from quantize import quantize_int4, quantize_int4_dynamic, quantize_int8, quantize_int8_dynamic
from tokenizer import Tokenizer


def checkpoint_paths(out_dir):  # the latest state (--init_from=resume continues it) and the lowest val loss
    return os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "best.pt")


def holds(path, saved_at):  # what a run's last message says of ckpt.pt
    return "no checkpoint was written" if saved_at is None else f"{path} keeps iteration {saved_at}"


def write_whole(path, write):
    """Write path through write(f) into a temporary file, flush it to disk, then rename: a crash at
    any instant leaves either the old file or the new one, never half of one. A full disk removes
    the temporary file and stops in one line."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # a full disk or quota (torch.save wraps some as RuntimeError)
        with suppress(FileNotFoundError):
            os.remove(tmp)
        cause = e if isinstance(e, OSError) else e.__context__  # the OSError that torch.save's error hides
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(e)
        raise UsageError(f"could not write {path} ({reason}); the previous checkpoint is intact: free some space, "
                         "then continue with --init_from=resume") from None
    os.replace(tmp, path)
    sync_folder(path)


def sync_folder(path):
    dirfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dirfd)  # a rename or a link itself, on disk
    finally:
        os.close(dirfd)


def save_atomic(obj, path):  # torch.save's file of obj, whole or not at all
    write_whole(path, lambda f: torch.save(obj, f))


KEPT = re.compile(r"ckpt-(\d+)\.pt")  # --keep_checkpoints: the states of ckpt.pt kept beside it


def keep_checkpoints(path, it, n):
    """Keep the state just written whole to path (ckpt.pt) as ckpt-<it>.pt too, then remove the
    oldest kept ones past the last n, so that a disk that fills never leaves fewer than n whole. A
    hard link writes no bytes (a file system without them gets a copy, written as a checkpoint is);
    a kept one past it (a run resumed from an earlier state) is left alone."""
    if not n:
        return
    out_dir, kept = os.path.dirname(path), os.path.join(os.path.dirname(path), f"ckpt-{it}.pt")
    try:  # under a temporary name first: a ckpt-<it>.pt already there (an earlier history's) is replaced whole
        os.link(path, f"{kept}.tmp.{os.getpid()}")
        os.replace(f"{kept}.tmp.{os.getpid()}", kept)
        sync_folder(kept)
    except OSError:
        with suppress(FileNotFoundError):
            os.remove(f"{kept}.tmp.{os.getpid()}")
        with open(path, "rb") as src:
            write_whole(kept, lambda f: shutil.copyfileobj(src, f))
    older = sorted(int(m[1]) for m in map(KEPT.fullmatch, os.listdir(out_dir)) if m and int(m[1]) <= it)
    for k in older[:-n]:
        os.remove(os.path.join(out_dir, f"ckpt-{k}.pt"))


CKPT_KEYS = {"model", "optimizer", "scaler", "model_config", "train_config", "iter_num", "best_val_loss", "rng",
             "tokens", "meta"}  # what train.py writes
# model settings that earlier versions saved and this one no longer has, each with why it went:
# load_checkpoint drops them, so that those checkpoints still load
RETIRED_SETTINGS = {
    "linear_impl": "how earlier versions ran products on a CPU: a run-time choice, not the model's",
}


def load_plain(path, way_out):
    """What torch.save wrote at path, if it is tensors and plain data only (weights_only): a file
    that holds any other object, whose loading would run code, is refused in one line before
    anything in it runs. way_out: what to do about a file that cannot be read at all."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if found := re.search(r"GLOBAL (\S+)", str(e)):  # torch names the global it refused
            raise UsageError(f"{path} holds objects that loading would have to run code for ({found[1]}), so it "
                             "is not loaded: use files from a source you trust, re-saved as plain tensors and "
                             "data") from None
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): {way_out}") from None


def load_checkpoint(path, hint=None):
    """A checkpoint that train.py wrote, read into host memory (load_plain), or a one-line UsageError
    that says what to do instead (hint: what else to try, e.g. the run's other checkpoint)."""
    if not os.path.exists(path):
        raise UsageError(f"no checkpoint at {path}: {hint or 'train first, or point --out_dir at a run'}")
    ckpt = load_plain(path, f"it is truncated or corrupted; {hint + ', or ' if hint else ''}start a new run in "
                            "another out_dir")
    if not isinstance(ckpt, dict) or not CKPT_KEYS <= ckpt.keys():
        missing = sorted(CKPT_KEYS - ckpt.keys()) if isinstance(ckpt, dict) else "everything"
        raise UsageError(f"{path} is not a nanoformer checkpoint (it lacks {missing})")
    for name in RETIRED_SETTINGS:
        ckpt["model_config"].pop(name, None)
    unknown = sorted(ckpt["model_config"].keys() - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise UsageError(f"{path} has model settings this model.py does not know ({', '.join(unknown)}): "
                         "it was written by another version of nanoformer; load it with that version")
    return ckpt


def restore(ckpt, model, optimizer, scaler, rank, world, device):
    """A resumed run: put back the optimizer's moments, the gradient scale and this rank's random state
    from ckpt; returns the iteration to go on from and the progress the checkpoint kept (with a
    Transformer-XL's memory)."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    load_optimizer_state(model, optimizer, ckpt["optimizer"])  # the moments, and the checkpoint's betas and decay...
    for group, ours in zip(optimizer.param_groups, settings):  # ...which give way to this run's, as logged
        group.update(ours)
    if ckpt["scaler"]:  # empty from a run without fp16: a run that switches to fp16 starts a new scale
        scaler.load_state_dict(ckpt["scaler"])
    if len(ckpt["rng"]) == world:  # each rank carries on with its own dropout stream
        set_rng_state(ckpt["rng"][rank], device)
    it = ckpt["iter_num"]
    mems = {k: [m.to(device) for m in layers] for k, layers in ckpt.get("mems", {}).items()}  # Transformer-XL's
    return it, dict(best_val_loss=ckpt["best_val_loss"], evaluated_at=ckpt.get("evaluated_at", it),
                    val_loss=ckpt.get("val_loss"), fitted_iters=ckpt.get("fitted_iters"), mems=mems)


def starting_point(cfg, writes, given):
    """What a run starts from: the training settings (cfg, with --init_from=auto made "resume" where
    out_dir holds ckpt.pt, else "scratch") and the checkpoint to resume (None for the others). A new
    run that would overwrite a checkpoint is refused (writes: the run saves checkpoints). given: the
    training settings set on the command line or in a config file."""
    ckpt_path, best_path = checkpoint_paths(cfg.out_dir)
    if cfg.init_from == "auto":  # a run started again (torchrun --max_restarts) goes on from its last save
        cfg = replace(cfg, init_from="resume" if os.path.exists(ckpt_path) else "scratch")
    if writes and cfg.init_from != "resume":
        for p in (ckpt_path, best_path):
            if os.path.exists(p):
                raise UsageError(f"{p} holds a run that a new one would overwrite: continue it with "
                                 "--init_from=resume, or choose another --out_dir (or delete it)")
    if cfg.init_from != "resume":
        return cfg, None
    ckpt = load_checkpoint(ckpt_path, f"copy {best_path} to {ckpt_path} to resume from the best checkpoint"
                           if os.path.exists(best_path) else None)
    if "dataset" not in given:  # the run's own data, unless told otherwise
        cfg = replace(cfg, **{k: ckpt["train_config"][k] for k in ("dataset", "data_dir")
                              if k not in given and k in ckpt["train_config"]})
    if cfg.max_time and ckpt.get("fitted_iters"):  # a --max_time run goes on with the length it chose
        cfg = replace(cfg, max_iters=ckpt["fitted_iters"], lr_decay_iters=ckpt["fitted_iters"])
    return cfg, ckpt


RUN_TIME = ("attn_impl", "dropout")  # model settings that a resumed run may change


def model_config_of(cfg, model_args, meta, ckpt, ckpt_path, whole=False):
    """The model's settings: from the command line for a new run; else from the checkpoint to
    resume, or the pretrained model to finetune, where only RUN_TIME settings may change (and a
    pretrained model's block_size may shrink: its position table is cropped). whole (a resume
    that --init_from=auto chose): every setting counts as asked for, its default too, so that the
    checkpoint of another model is refused rather than resumed. Returns the settings, and the
    training settings (cfg, train.py's) that differ from the checkpoint's, as lines to show."""
    source = ckpt_path if cfg.init_from == "resume" else cfg.init_from
    if ckpt is None:
        return new_model_config(model_args, meta.get("vocab_size"), meta), []
    given = model_args
    if whole:  # the vocabulary is the data's: compared below
        model_args = {k: v for k, v in asdict(new_model_config(model_args, meta.get("vocab_size"), meta)).items()
                      if k not in RUN_TIME and k != "vocab_size"} | model_args
    try:
        config = ModelConfig(**ckpt["model_config"])  # a field newer than the checkpoint: its default
        may_shrink = cfg.init_from != "resume" and model_args.get("block_size", 0) <= config.block_size
        may_change = RUN_TIME + ("block_size",) if may_shrink else RUN_TIME
        config = replace(config, **{k: v for k, v in model_args.items() if k in may_change})
    except ValueError as e:
        raise UsageError(f"bad model settings: {e}") from None
    saved = asdict(config)
    for k, want in model_args.items():  # from the command line or the config file
        if saved[k] != want:
            asked, fix = (as_given(k, want), "or drop it") if k in given else \
                (f"--init_from=auto: the default {k}={want!r}", "to continue that run")
            raise UsageError(f"{asked} does not match {source}'s {k}={saved[k]!r}: set --{k}={saved[k]!r} {fix}, or "
                             "train a new model (--init_from=scratch) in another --out_dir")
    if any(ckpt["meta"].get(k) != meta.get(k) for k in ("vocab_size", "tokenizer", "vocab", "tokenizer_json",
                                                              "classes")):
        if cfg.init_from != "resume":
            raise UsageError(f"dataset {cfg.dataset!r} was not prepared with {source}'s tokenizer: prepare it with "
                             f"python prepare.py text --input=... --tokenizer={ckpt['path']}")
        raise UsageError(f"{source} was trained on other data ({ckpt['meta'].get('tokenizer', 'images')}, vocabulary "
                         f"{ckpt['meta'].get('vocab_size')}) than {cfg.dataset}: resume with "
                         f"--dataset={ckpt['train_config']['dataset']}")
    # as in nanoGPT, training settings come from the command line and config file, not the
    # checkpoint: the caller says which differ, so that a resume without the run's config file is noticed
    return config, [f"{k} {v!r} -> {getattr(cfg, k)!r}" for k, v in ckpt.get("train_config", {}).items()
                    if k not in ("init_from", "out_dir") and hasattr(cfg, k) and getattr(cfg, k) != v]


def load_run(out_dir, which="best"):
    """A run's model (fp32, on the CPU) and its checkpoint: out_dir's best.pt ("best"; ckpt.pt if
    there is none) or ckpt.pt ("latest")."""
    path = {"best": os.path.join(out_dir, "best.pt"), "latest": os.path.join(out_dir, "ckpt.pt")}
    which = "latest" if which == "best" and not os.path.exists(path["best"]) else which
    other = "latest" if which == "best" else "best"
    ckpt = load_checkpoint(path[which], f"try --ckpt={other}" if os.path.exists(path[other]) else None)
    model = Transformer(ModelConfig(**ckpt["model_config"]))
    train_config = ckpt["train_config"] or {}
    lora = train_config.get("lora_rank", 0)  # a LoRA run samples (and exports) with its updates merged
    state = merged_state(ckpt["model"], train_config["lora_alpha"] / lora) if lora else ckpt["model"]
    model.load_state_dict(state)
    ckpt["path"] = path[which]
    return model, ckpt


def describe(ckpt):
    """One line on the checkpoint loaded: its file, iteration and val loss; for best.pt, whether
    ckpt.pt beside it trained on past it with no evaluation since (so nothing says best.pt is better)."""
    it, path = ckpt["iter_num"], ckpt["path"]
    best = os.path.basename(path) == "best.pt"
    val = ckpt.get("val_loss", ckpt["best_val_loss"] if best else None)  # best.pt's best is its own
    line = f"{path}: iteration {it}, " + (f"val loss {val:.4f}" if val is not None and ckpt.get("evaluated_at") == it
                                          else f"not evaluated since iteration {ckpt.get('evaluated_at')}")
    latest = os.path.join(os.path.dirname(path), "ckpt.pt")
    if best and os.path.exists(latest):
        with suppress(Exception):  # a damaged ckpt.pt says nothing here; loading it would
            newer = torch.load(latest, map_location="cpu", weights_only=True, mmap=True)
            if newer["iter_num"] > it and newer.get("evaluated_at", it) <= it:
                line += (f"; {latest} trained on to iteration {newer['iter_num']} with no evaluation since: "
                         "--ckpt=latest samples it")
    return line


def for_sampling(model, ckpt, device, dtype=torch.float32, quantize="", group_size=128):
    """model in eval mode on device, its weights in dtype (its Linear layers in int8 with
    quantize="int8", in int4 in groups of group_size with "int4", int8 activations too with
    "int8-dynamic" and "int4-dynamic"), and the tokenizer its checkpoint
    names. A model trained through the Triton kernel on a GPU runs the same attention through SDPA
    elsewhere (model.attn_impl)."""
    if quantize == "int8":
        quantize_int8(model)  # from the fp32 weights: one rounding, not two
    model = model.to(device)
    if quantize == "int4":  # packed in the layout of device's kernel, from the fp32 weights
        quantize_int4(model, group_size)
    if quantize == "int8-dynamic":  # W8A8 (a CPU's kernel)
        quantize_int8_dynamic(model)
    if quantize == "int4-dynamic":  # W4A8 (w4a8.cpp, a CPU's)
        quantize_int4_dynamic(model, group_size)
    model = model.to(dtype=dtype).eval()  # (the quantized weights are integers, which stay)
    return model, Tokenizer(ckpt["meta"])


def load_model(out_dir, device, dtype=torch.float32, quantize="", which="best", group_size=128):
    """A run's model ready to sample from (load_run, then for_sampling), its tokenizer and its checkpoint."""
    model, ckpt = load_run(out_dir, which)
    return *for_sampling(model, ckpt, device, dtype, quantize, group_size), ckpt


def prepare_out_dir(path, held):
    """Make out_dir, lock it, check that it takes bytes, and remove temporary files of a killed save.
    The lock is out_dir/.lock, flock-ed until `held` (the run's ExitStack) closes: a second train.py
    writing there would overwrite this run's checkpoints or remove the one it is writing, so it is
    refused meanwhile; the kernel releases the lock when the process ends, however it ends. An
    out_dir this run made and left empty (it failed before its first checkpoint) goes at the end."""
    made = not os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        if made:
            held.callback(remove_if_unused, path)
        lock = held.enter_context(open(os.path.join(path, ".lock"), "a+b", buffering=0))  # nothing held back
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.truncate(0)  # the pid names the holder to a second run; writing it finds a full disk now
        pid, written = f"{os.getpid()}\n".encode(), 0
        while written < len(pid):  # a write may stop short without an error when the disk fills up; the next
            written += lock.write(pid[written:])  # one then raises, with the reason (ENOSPC, EDQUOT, EFBIG)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().decode().strip() or "?"
        raise UsageError(f"out_dir {path!r} is in use by another train.py (process {holder}): wait for it to end, "
                         "or choose another --out_dir") from None
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        raise UsageError(f"out_dir {path!r} is not writable ({e.strerror}): "
                         f"{'free some space, or ' if full else ''}choose another --out_dir") from None
    for name in os.listdir(path):
        if ".pt.tmp." in name:
            os.remove(os.path.join(path, name))


def remove_if_unused(path):
    if set(os.listdir(path)) <= {".lock"}:
        with suppress(OSError):  # another train.py may have just taken it
            if os.listdir(path):
                os.remove(os.path.join(path, ".lock"))
            os.rmdir(path)
